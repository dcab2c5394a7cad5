"""`sieve bench moe`: decode step time of a mixture-of-experts model against batch size, as the set of experts a
step touches grows, next to the planner's expectation E * (1 - (1 - k/E)^b) for b tokens routed uniformly.

The checkpoint is a random Mixtral-shaped model written with transformers (no download); prompts are random
token ids. Each batch size b runs b sequences to their decode phase, then times decode steps in which all b
decode, counting the experts each MoE layer ran.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path


def add_bench_moe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="bench-out/mixtral-tiny", help="a MoE checkpoint; created there (Mixtral-shaped, random) if absent")
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--expert-size", type=int, default=1024, help="each expert's MLP width")
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per batch size")
    p.add_argument("--output-json", default=None)


def make_mixtral(path: Path, args) -> Path:
    import torch
    import transformers

    if (path / "config.json").exists():
        return path
    cfg = transformers.MixtralConfig(vocab_size=8192, hidden_size=args.hidden_size, intermediate_size=args.expert_size,
                                     num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                                     num_local_experts=args.num_experts, num_experts_per_tok=args.top_k,
                                     max_position_embeddings=2048, sliding_window=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).to(getattr(torch, args.dtype))
    with torch.no_grad():  # routers wider than the default init, so each token's choice is clear-cut
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 1.0 / args.hidden_size ** 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


def run_bench_moe(args: argparse.Namespace) -> dict:
    from sieve.config import EngineConfig
    from sieve.engine import LLMEngine
    from sieve.plan.shape import shape_from_config
    from sieve.sampling_params import SamplingParams

    path = make_mixtral(Path(args.model), args)
    cfg = json.loads((path / "config.json").read_text())
    batches = [int(b) for b in args.batch_sizes.split(",")]
    engine = LLMEngine(EngineConfig(model=str(path), dtype=args.dtype, skip_tokenizer_init=True, max_num_seqs=max(batches),
                                    num_gpu_blocks_override=max(batches) * 8, max_model_len=512, seed=0))
    arch = engine.arch
    E, k = arch.num_experts, arch.num_experts_per_tok
    shape = shape_from_config(cfg)
    moes = [layer.moe for layer in engine.runner.model.layers if layer.moe is not None]
    rng = random.Random(0)
    print(f"bench moe: {path} ({arch.architecture}, {len(moes)} MoE layers, {E} experts, top-{k}, hidden {arch.hidden_size}, "
          f"expert width {arch.moe_intermediate_size}, {args.dtype}), {args.steps} decode steps per batch size")
    print(f"{'batch':>5} {'step ms':>8} {'ms/token':>8} {'experts/layer':>13} {'planner':>8} {'weight MB/step (planner)':>25}")
    rows = []
    for b in batches:
        for i in range(b):
            ids = [rng.randrange(3, arch.vocab_size) for _ in range(16)]
            engine.add_request(f"b{b}-{i}", {"prompt_token_ids": ids},
                               SamplingParams(max_tokens=args.steps + 8, temperature=0, ignore_eos=True))
        while any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        times, touched = [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
            touched.append(statistics.mean(m.last_active for m in moes))
        while engine.has_unfinished():
            engine.step()
        expected = E * (1 - (1 - k / E) ** b)
        step = statistics.median(times)
        mb = shape.step_weight_bytes("bf16", batch=b) / 1e6 * (2 if args.dtype == "float32" else 1)
        rows.append({"batch": b, "step_ms": 1000 * step, "ms_per_token": 1000 * step / b, "experts_touched": statistics.mean(touched),
                     "planner_experts": expected, "planner_weight_mb": mb})
        print(f"{b:>5} {1000 * step:>8.2f} {1000 * step / b:>8.3f} {statistics.mean(touched):>13.2f} {expected:>8.2f} {mb:>25.1f}")
    return {"model": str(path), "num_experts": E, "top_k": k, "dtype": args.dtype, "rows": rows}
