"""`sieve bench families`: one table, a row per architecture family at one shape: the KV (or state) each sequence
holds, how many sequences of `--context` + `--output-len` tokens fit in `--memory-gb`, and the decode step time at
each batch size with every sequence at that context. The engine's figures sit beside the planner's.

Every family is a random checkpoint written with transformers at the same hidden size, layer count and heads
(no download; prompts are random token ids):
  dense    Llama, multi-head attention (the reference row)
  moe      Mixtral: 8 experts, top 2, every layer
  mla      DeepSeek-V3: multi-head latent attention (512 latent + 64 rope per token), dense MLP
  sliding  Gemma 3: five of six layers attend to a `--window`-token window
  hybrid   Bamba: Mamba-2 mixers, attention on one layer of four
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FAMILIES = ("dense", "moe", "mla", "sliding", "hybrid")


def add_bench_families_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of {', '.join(FAMILIES)}")
    p.add_argument("--out-dir", default="bench-out/families", help="where the random checkpoints are written (once)")
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--window", type=int, default=512, help="the sliding family's window")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--memory-gb", type=float, default=2.0)
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--output-json", default=None)


def family_config(name: str, args):
    import transformers

    h, L, H = args.hidden_size, args.layers, args.heads
    common = dict(vocab_size=8192, hidden_size=h, intermediate_size=4 * h, num_hidden_layers=L, num_attention_heads=H,
                  num_key_value_heads=H, max_position_embeddings=8192, tie_word_embeddings=False)
    if name == "dense":
        return transformers.LlamaConfig(**common, head_dim=128)
    if name == "moe":
        return transformers.MixtralConfig(**{**common, "intermediate_size": 2 * h}, head_dim=128, num_local_experts=8,
                                          num_experts_per_tok=2, sliding_window=None)
    if name == "mla":
        return transformers.DeepseekV3Config(**common, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                             v_head_dim=128, first_k_dense_replace=L, n_routed_experts=8, num_experts_per_tok=2)
    if name == "sliding":
        return transformers.Gemma3TextConfig(**common, head_dim=128, sliding_window=args.window, query_pre_attn_scalar=128,
                                             architectures=["Gemma3ForCausalLM"])
    if name == "hybrid":
        return transformers.BambaConfig(**common, attn_layer_indices=list(range(3, L, 4)), mamba_n_heads=32, mamba_d_state=128,
                                        mamba_expand=2, mamba_n_groups=1, mamba_chunk_size=256)
    raise SystemExit(f"error: unknown family {name!r} (choose from {', '.join(FAMILIES)})")


def make_checkpoint(name: str, args) -> Path:
    import torch
    import transformers

    path = Path(args.out_dir) / f"{name}-h{args.hidden_size}-l{args.layers}"
    if not (path / "config.json").exists():
        cfg = family_config(name, args)
        torch.manual_seed(0)
        cls = transformers.Gemma3ForCausalLM if name == "sliding" else transformers.AutoModelForCausalLM
        model = (cls(cfg) if name == "sliding" else cls.from_config(cfg)).to(getattr(torch, args.dtype))
        model.save_pretrained(path, safe_serialization=True)
    return path


def run_bench_families(args: argparse.Namespace) -> dict:
    from sieve.bench.window import decode_step_ms
    from sieve.config import EngineConfig
    from sieve.engine import LLMEngine
    from sieve.plan.shape import shape_from_config

    batches = [int(b) for b in args.batch_sizes.split(",")]
    tokens, memory = args.context + args.output_len, args.memory_gb * 2**30
    kv_scale = 2 if args.dtype == "float32" else 1  # the planner counts 16-bit KV
    print(f"bench families: hidden {args.hidden_size}, {args.layers} layers, {args.heads} heads, {args.dtype}, context "
          f"{args.context} (+{args.output_len}), {args.memory_gb:g} GiB of KV, {args.steps} decode steps timed per batch size")
    header = ["family", "KV/token", "per sequence", "planner", "fit", "planner fit"] + [f"step b={b}" for b in batches]
    print("  ".join(f"{h:>13}" for h in header))
    rows = []
    for name in args.families.split(","):
        path = make_checkpoint(name, args)
        shape = shape_from_config(json.loads((path / "config.json").read_text()))
        engine = LLMEngine(EngineConfig(model=str(path), dtype=args.dtype, skip_tokenizer_init=True, max_num_seqs=max(batches),
                                        max_model_len=args.context + args.steps + 16, kv_cache_memory_gb=args.memory_gb, seed=0))
        runner, arch, bs = engine.runner, engine.arch, engine.config.block_size
        per_token = runner.block_bytes / bs
        window = runner.group_block_bytes(1) * (-(-(arch.max_window - 1) // bs) + 2) if arch.has_sliding_layers else 0
        per_seq = runner.block_bytes * -(-tokens // bs) + window + arch.state_bytes_per_sequence()
        planner_seq = kv_scale * (shape.kv_bytes(tokens, "bf16") - shape.state_bytes_per_sequence) + shape.state_bytes_per_sequence
        row = {"family": name, "architecture": arch.architecture, "kv_bytes_per_token": per_token,
               "bytes_per_sequence": per_seq, "planner_bytes_per_sequence": planner_seq,
               "sequences_fit": int(memory // per_seq), "planner_sequences_fit": int(memory // planner_seq),
               "state_bytes_per_sequence": arch.state_bytes_per_sequence(),
               "step_ms": decode_step_ms(engine, batches, args.context, args.steps)}
        rows.append(row)
        cells = [name, f"{per_token / 1024:.2f} KiB", f"{per_seq / 2**20:.1f} MiB", f"{planner_seq / 2**20:.1f} MiB",
                 str(row["sequences_fit"]), str(row["planner_sequences_fit"])] + [f"{row['step_ms'][b]:.2f} ms" for b in batches]
        print("  ".join(f"{c:>13}" for c in cells))
        del engine
    return {"hidden_size": args.hidden_size, "layers": args.layers, "heads": args.heads, "dtype": args.dtype,
            "context": args.context, "output_len": args.output_len, "memory_gb": args.memory_gb, "rows": rows}
