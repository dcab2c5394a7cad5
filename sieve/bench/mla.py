"""`sieve bench mla`: what multi-head latent attention buys, on two random checkpoints of one shape that differ only
in attention: DeepSeek-V3's latent attention (each token caches a kv_lora_rank latent and a shared rope key) and
ordinary multi-head attention with the same heads (Llama: K and V of every head cached). For each: KV bytes per
token (the engine's pool, and the planner's), sequences of `--context` + `--output-len` tokens that fit in
`--memory-gb`, and the decode step time at each batch size with every sequence at that context. The MLP is dense
in both (no experts), so the difference is attention's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_bench_mla_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out-dir", default="bench-out/mla", help="where the two random checkpoints are written (once)")
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-lora-rank", type=int, default=512, help="DeepSeek-V2/V3's latent width")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--memory-gb", type=float, default=2.0)
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--output-json", default=None)


def make_checkpoints(out: Path, args) -> dict[str, Path]:
    import torch
    import transformers

    common = dict(vocab_size=8192, hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads, max_position_embeddings=8192,
                  tie_word_embeddings=False)
    head = 128  # DeepSeek-V3's per-head sizes: 128 nope + 64 rope for q.k, 128 for v
    configs = {
        "latent (DeepSeek-V3 MLA)": transformers.DeepseekV3Config(
            **common, num_key_value_heads=args.heads, kv_lora_rank=args.kv_lora_rank, q_lora_rank=None, qk_nope_head_dim=head,
            qk_rope_head_dim=64, v_head_dim=head, first_k_dense_replace=args.layers, n_routed_experts=8, num_experts_per_tok=2),
        "multi-head (Llama)": transformers.LlamaConfig(**common, num_key_value_heads=args.heads, head_dim=head),
    }
    paths = {}
    for i, (name, cfg) in enumerate(configs.items()):
        path = out / ("mla" if i == 0 else "mha")
        if not (path / "config.json").exists():
            torch.manual_seed(i)
            model = transformers.AutoModelForCausalLM.from_config(cfg).to(getattr(torch, args.dtype))
            model.save_pretrained(path, safe_serialization=True)
        paths[name] = path
    return paths


def run_bench_mla(args: argparse.Namespace) -> dict:
    from sieve.bench.window import decode_step_ms
    from sieve.config import EngineConfig
    from sieve.engine import LLMEngine
    from sieve.plan.shape import shape_from_config

    batches = [int(b) for b in args.batch_sizes.split(",")]
    tokens, memory = args.context + args.output_len, args.memory_gb * 2**30
    print(f"bench mla: hidden {args.hidden_size}, {args.layers} layers, {args.heads} heads, latent {args.kv_lora_rank}, "
          f"{args.dtype}, context {args.context}, {args.steps} decode steps timed per batch size")
    rows = []
    for name, path in make_checkpoints(Path(args.out_dir), args).items():
        shape = shape_from_config(json.loads((path / "config.json").read_text()))
        engine = LLMEngine(EngineConfig(model=str(path), dtype=args.dtype, skip_tokenizer_init=True, max_num_seqs=max(batches),
                                        max_model_len=args.context + args.steps + 16, kv_cache_memory_gb=args.memory_gb, seed=0))
        per_token = engine.runner.block_bytes / engine.config.block_size
        scale = 2 if args.dtype == "float32" else 1
        row = {"attention": name, "kv_bytes_per_token": per_token, "planner_kv_bytes_per_token": scale * shape.kv_bytes_per_token("bf16"),
               "sequences_fit": int(memory // (per_token * tokens)), "planner_sequences_fit": int(memory // (scale * shape.kv_bytes(tokens, "bf16"))),
               "step_ms": decode_step_ms(engine, batches, args.context, args.steps)}
        rows.append(row)
        steps = ", ".join(f"batch {b}: {ms:.2f} ms" for b, ms in row["step_ms"].items())
        print(f"{name:>26}: KV {per_token / 1024:.2f} KiB/token (planner {row['planner_kv_bytes_per_token'] / 1024:.2f}); "
              f"fit in {args.memory_gb:g} GiB at {tokens} tokens: {row['sequences_fit']} (planner {row['planner_sequences_fit']}); "
              f"decode step {steps}")
        del engine
    a, b = rows
    print(f"KV per token: multi-head / latent {b['kv_bytes_per_token'] / a['kv_bytes_per_token']:.2f}x; "
          + "; ".join(f"batch {n}: multi-head / latent step time {b['step_ms'][n] / a['step_ms'][n]:.2f}x" for n in batches))
    return {"rows": rows, "context": args.context, "memory_gb": args.memory_gb, "dtype": args.dtype}
