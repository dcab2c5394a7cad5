"""Decode step time against batch size, eager and with CUDA graphs, beside the bandwidth floor measured in the same run
(issues 61 and 62; it runs on a CPU alike, where "graphs" is the same padded static path run eagerly).

python scripts/decode_steps.py --model PATH [--device cuda] [--dtype bfloat16] [--batches 1,8,32,64] [--context 128]
                               [--steps 32] [--modes eager,graphs,graphs-unfused] [--output-json F]

Each batch: that many requests of `--context` prompt tokens, stepped until every one has its first token, then
`--steps` decode steps timed one by one (each returns its tokens to the host, so the device is synchronised); the
median step. The floor: the weights a step reads plus each sequence's KV at its context, at the best of the copy and
triad bandwidth (sieve bench bandwidth's measure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def median_decode_step(llm, batch: int, context: int, steps: int) -> float:
    """Seconds of the median decode step of `batch` sequences at about `context` tokens."""
    from sieve import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=steps + 4, ignore_eos=True, temperature=0)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, {"prompt_token_ids": [5 + (7 * i + j) % 1000 for j in range(context)]}, params)
    started: set[str] = set()
    while len(started) < batch:  # prefills, until every sequence decodes
        started.update(out.request_id for out in engine.step() if out.outputs[0].token_ids)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times)


def _release(device: str) -> None:
    """The last engine's memory back before the next one loads."""
    import gc

    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def main() -> None:
    from sieve import LLM
    from sieve.bench.bandwidth import decode_weight_bytes, measure_bandwidth

    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--modes", default="eager,graphs", help="eager (enforce_eager), graphs (CUDA graphs; on a CPU the "
                   "padded static path, eagerly), graphs-unfused (graphs without the fused pointwise Triton kernels)")
    p.add_argument("--output-json", default=None)
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    rows, bw, result = [], None, {}
    for mode in a.modes.split(","):
        if mode not in ("eager", "graphs", "graphs-unfused"):
            p.error(f"--modes: eager, graphs or graphs-unfused, got {mode!r}")
        os.environ["SIEVE_FUSED_POINTWISE"] = "0" if mode == "graphs-unfused" else "1"  # read at each call
        llm = LLM(a.model, dtype=a.dtype, device=a.device, skip_tokenizer_init=True, max_num_seqs=max(batches),
                  max_model_len=a.context + a.steps + 64, enable_prefix_caching=False, enforce_eager=mode == "eager",
                  static_decode_on_cpu=mode != "eager")
        engine = llm.llm_engine
        device = str(engine.runner.device)
        if bw is None:  # measured once, before the first model's steps
            bw = measure_bandwidth(device, array_mib=1024 if device.startswith("cuda") else 256)
        weights = decode_weight_bytes(engine.arch, engine.dtype.itemsize)
        for b in batches:
            step = median_decode_step(llm, b, a.context, a.steps)
            kv = b * engine.arch.kv_bytes_per_token(engine.dtype.itemsize) * (a.context + a.steps // 2)
            floor = (weights + kv) / (bw.best_gbps * 1e9)
            rows.append({"mode": mode, "batch": b, "step_ms": round(step * 1e3, 3), "tokens_per_s": round(b / step, 1),
                         "floor_ms": round(floor * 1e3, 4), "floor_pct": round(100 * floor / step, 1)})
            print(f"{mode} batch {b}: {step * 1e3:.2f} ms a step ({b / step:.0f} tokens/s); the floor {floor * 1e3:.3f} ms: "
                  f"{100 * floor / step:.1f}%", flush=True)
        result = {"model": a.model, "device": device, "dtype": a.dtype, "context": a.context,
                  "bandwidth_gbps": round(bw.best_gbps, 1), "weight_bytes": weights, "rows": rows}
        del llm, engine
        _release(device)
    if device.startswith("cuda"):
        import torch

        result["device_name"] = torch.cuda.get_device_name()
    print(json.dumps(result, indent=1))
    if a.output_json:
        Path(a.output_json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
