"""`sieve bench offline`: one seeded workload through sieve and through plain `transformers`.

Workload: N requests with seeded random prompt lengths and output lengths (random token ids,
ignore_eos so every request produces exactly its output length), all submitted at once.
Baselines, same workload, same threads:
  (a) HF `generate` one request at a time;
  (b) HF `generate` on static batches of 16 left-padded prompts, each batch running until its
      longest output is done (the tokens past a request's own length are not counted).
The baselines are slow, so they run on a seeded subset of the same requests and their tokens/s are
reported for that subset (a rate, so comparable); the subset sizes are printed with the results.
Also: batch-1 decode tokens/s against the floor of weight bytes / measured memory bandwidth.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from pathlib import Path

import torch

from sieve.bench.bandwidth import decode_weight_bytes, measure_bandwidth
from sieve.sampling_params import SamplingParams

log = logging.getLogger("sieve")


def make_workload(n: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        p_len, o_len = rng.randint(*input_len), rng.randint(*output_len)
        reqs.append(([rng.randrange(10, vocab - 10) for _ in range(p_len)], o_len))
    return reqs


def _parse_range(s: str) -> tuple[int, int]:
    lo, hi = s.split(":")
    return int(lo), int(hi)


def run_sieve(llm, reqs) -> dict:
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in reqs]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(o for _, o in reqs), "every request must produce exactly its output length"
    return dict(requests=len(reqs), output_tokens=n_out, seconds=elapsed, output_tokens_per_s=n_out / elapsed,
                steps=llm.llm_engine.num_steps, preemptions=llm.llm_engine.scheduler.num_preemptions)


def load_hf(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@torch.inference_mode()
def run_hf_one_at_a_time(model, reqs) -> dict:
    t = time.perf_counter()
    n_out = 0
    for prompt, o_len in reqs:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=o_len, min_new_tokens=o_len, do_sample=False, pad_token_id=0)
        n_out += out.shape[1] - len(prompt)
    elapsed = time.perf_counter() - t
    return dict(requests=len(reqs), output_tokens=n_out, seconds=elapsed, output_tokens_per_s=n_out / elapsed)


@torch.inference_mode()
def run_hf_static_batches(model, reqs, batch: int = 16) -> dict:
    t = time.perf_counter()
    useful = 0
    for i in range(0, len(reqs), batch):
        group = reqs[i : i + batch]
        width = max(len(p) for p, _ in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group])
        longest = max(o for _, o in group)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                       do_sample=False, pad_token_id=0)
        useful += sum(o for _, o in group)  # tokens past each request's own length are waste
    elapsed = time.perf_counter() - t
    return dict(requests=len(reqs), batch_size=batch, output_tokens=useful, seconds=elapsed, output_tokens_per_s=useful / elapsed)


def run_batch1_decode(llm, tokens: int, prompt_len: int = 32) -> dict:
    """Median time per decode step of one request alone (prefill excluded)."""
    engine = llm.llm_engine
    engine.add_request("batch1", {"prompt_token_ids": list(range(100, 100 + prompt_len))},
                       SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    step = statistics.median(times[1:])
    return dict(decode_tokens=tokens, median_step_ms=step * 1e3, tokens_per_s=1 / step)


def profile_batch1(llm, tokens: int = 32) -> dict:
    """Where a batch-1 decode step goes: time in the linear layers (per weight shape) against the rest,
    and the same linear layers run back to back in isolation (their best case). A model whose layer loop runs in
    C++ (the native loop) calls no Python linear inside a step: its in-step linear time is not seen (None)."""
    from sieve.layers.linear import Linear

    model = llm.llm_engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    spent: dict[tuple, float] = {}
    original = Linear.forward

    def timed(self, x):
        t = time.perf_counter()
        y = original(self, x)
        key = (self.out_features, self.in_features)
        spent[key] = spent.get(key, 0.0) + time.perf_counter() - t
        return y

    engine = llm.llm_engine
    engine.add_request("profile", {"prompt_token_ids": list(range(100, 132))},
                       SamplingParams(max_tokens=tokens + 1, temperature=0, ignore_eos=True))
    engine.step()  # prefill, not profiled
    Linear.forward = timed
    try:
        t, steps = time.perf_counter(), 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        step_s = (time.perf_counter() - t) / steps
    finally:
        Linear.forward = original
    shape_bytes: dict[tuple, int] = {}  # weight bytes read per step, per shape (quantized formats count their own)
    for m in linears:
        key = (m.out_features, m.in_features)
        shape_bytes[key] = shape_bytes.get(key, 0) + m.weight_bytes
    per_shape = {f"{n}x{k}": dict(ms_per_step=spent[(n, k)] / steps * 1e3,
                                  gbps=shape_bytes[(n, k)] / (spent[(n, k)] / steps) / 1e9)
                 for (n, k) in spent}
    linear_s = sum(spent.values()) / steps
    xs = {m.in_features: torch.randn(1, m.in_features, dtype=m.dtype) for m in linears}
    with torch.inference_mode():
        for _ in range(2):
            [m(xs[m.in_features]) for m in linears]
        iso = []
        for _ in range(7):
            t = time.perf_counter()
            [m(xs[m.in_features]) for m in linears]
            iso.append(time.perf_counter() - t)
    weight_bytes = sum(m.weight_bytes for m in linears)
    isolated_s = statistics.median(iso)
    seen = linear_s > 0
    return dict(step_ms=step_s * 1e3, linear_ms=linear_s * 1e3 if seen else None, other_ms=(step_s - linear_s) * 1e3 if seen else None,
                linear_gbps_in_step=weight_bytes / linear_s / 1e9 if seen else None, per_shape=per_shape,
                linear_ms_isolated=isolated_s * 1e3, linear_gbps_isolated=weight_bytes / isolated_s / 1e9)


def run_offline_benchmark(args) -> dict:
    from sieve.engine_args import config_from_args
    from sieve.llm import LLM

    if args.model is None:
        raise SystemExit("bench offline needs --model (use --create-model qwen2.5-0.5b to make a random one)")
    path = Path(args.model)
    if args.create_model and not (path / "model.safetensors").exists():
        from sieve.bench.checkpoints import make_random_checkpoint

        log.info("writing a random %s checkpoint to %s", args.create_model, path)
        make_random_checkpoint(path, args.create_model)

    config = config_from_args(args, skip_tokenizer_init=True)
    llm = LLM(**vars(config))
    engine = llm.llm_engine
    reqs = make_workload(args.num_prompts, _parse_range(args.input_len), _parse_range(args.output_len),
                         engine.arch.vocab_size, args.workload_seed)
    result: dict = dict(model=str(path), dtype=str(engine.dtype).removeprefix("torch."), threads=torch.get_num_threads(),
                        workload=dict(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                                      seed=args.workload_seed))

    bw = measure_bandwidth(str(engine.device))
    weights = decode_weight_bytes(engine.arch, engine.dtype.itemsize)
    floor_tps = bw.best_gbps * 1e9 / weights
    result["bandwidth"] = dict(copy_gbps=bw.copy_gbps, triad_gbps=bw.triad_gbps, weight_bytes=weights, floor_tokens_per_s=floor_tps)
    result["bandwidth"]["read_gbps"] = bw.read_gbps
    print(f"bandwidth: copy {bw.copy_gbps:.1f} GB/s, triad {bw.triad_gbps:.1f} GB/s (read-only {bw.read_gbps:.1f}); "
          f"weights {weights / 1e9:.3f} GB -> batch-1 floor {floor_tps:.1f} tok/s")

    b1 = run_batch1_decode(llm, args.batch1_tokens)
    b1["fraction_of_floor"] = b1["tokens_per_s"] / floor_tps
    b1["achieved_gbps"] = weights * b1["tokens_per_s"] / 1e9
    result["batch1"] = b1
    print(f"batch-1 decode: {b1['tokens_per_s']:.1f} tok/s ({b1['median_step_ms']:.1f} ms/step, {b1['achieved_gbps']:.1f} GB/s) "
          f"= {b1['fraction_of_floor']:.0%} of the floor")

    result["batch1_profile"] = prof = profile_batch1(llm)
    inside = (f"linear layers {prof['linear_ms']:.1f} ms ({prof['linear_gbps_in_step']:.1f} GB/s), everything else "
              f"{prof['other_ms']:.1f} ms" if prof["linear_ms"] is not None else "the layer loop runs in C++ (no per-layer times)")
    print(f"batch-1 step {prof['step_ms']:.1f} ms: {inside}; the same linear layers back to back: "
          f"{prof['linear_ms_isolated']:.1f} ms ({prof['linear_gbps_isolated']:.1f} GB/s)")
    for shape, v in prof["per_shape"].items():
        print(f"    {shape:>12}: {v['ms_per_step']:.2f} ms/step, {v['gbps']:.1f} GB/s")

    result["sieve"] = s = run_sieve(llm, reqs)
    print(f"sieve: {s['requests']} requests, {s['output_tokens']} output tokens in {s['seconds']:.1f} s "
          f"= {s['output_tokens_per_s']:.1f} tok/s ({s['steps']} steps, {s['preemptions']} preemptions)")
    del llm, engine

    rng = random.Random(args.workload_seed + 1)
    if args.hf_one_at_a_time or args.hf_static_batches:
        model = load_hf(path, getattr(torch, result["dtype"]))
        if args.hf_one_at_a_time:
            subset = rng.sample(reqs, min(args.hf_one_at_a_time, len(reqs)))
            result["hf_one_at_a_time"] = a = run_hf_one_at_a_time(model, subset)
            a["sieve_ratio"] = s["output_tokens_per_s"] / a["output_tokens_per_s"]
            print(f"HF one at a time ({a['requests']} of the requests): {a['output_tokens_per_s']:.1f} tok/s "
                  f"-> sieve is {a['sieve_ratio']:.1f}x")
        if args.hf_static_batches:
            subset = rng.sample(reqs, min(16 * args.hf_static_batches, len(reqs)))
            result["hf_static_batch16"] = b = run_hf_static_batches(model, subset)
            b["sieve_ratio"] = s["output_tokens_per_s"] / b["output_tokens_per_s"]
            print(f"HF static batches of 16 ({b['requests']} of the requests): {b['output_tokens_per_s']:.1f} tok/s "
                  f"-> sieve is {b['sieve_ratio']:.1f}x")
    return result
