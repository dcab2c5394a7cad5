"""`sieve bench quant`: every weight format against the unquantized model in one run, and KV capacity.

All formats are loaded side by side (bf16 first, the reference) and measured interleaved, so that a
shared machine's slow moments fall on all of them alike:
  - batch-1 decode: one request per format, decode steps taken round-robin (a few steps of each format
    in turn), median step time per format;
  - throughput with `concurrent` requests submitted at once (distinct random prompts), each format in
    turn, `rounds` times, best round per format: end to end, and split into the prefill phase (until
    every request has its first token) and the decode phase (all of them generating together);
  - the bytes of linear weights one step reads, and the batch-1 profile per weight shape.
Then, with one fixed KV memory budget, how many sequences of `kv_context` tokens fit per KV dtype.

`w8a8-vnni` is W8A8 with AMX-INT8's tiles off (vpdpbusd at every row count: the same bits), set around each of its
steps, so that one run measures what the tiles buy where the CPU has them.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time

import torch

from sieve.bench.offline import profile_batch1
from sieve.sampling_params import SamplingParams


@contextlib.contextmanager
def kernel_variant(name: str):
    """Around a format's steps: `w8a8-vnni` turns the W8A8 AMX tiles off (sieve/kernels/w8a8.cpp) while they run."""
    if name != "w8a8-vnni":
        yield
        return
    from sieve.kernels import cpu_ops

    ops = cpu_ops()
    before = ops.set_w8a8_amx(False) if ops is not None and hasattr(ops, "set_w8a8_amx") else None
    try:
        yield
    finally:
        if before:
            ops.set_w8a8_amx(True)


def _llm(model: str, **options):
    from sieve.llm import LLM

    return LLM(model, dtype="bfloat16", skip_tokenizer_init=True, enable_prefix_caching=False, **options)


def run_concurrent(llm, n: int, prompt_len: int, output_len: int, seed: int = 0) -> dict:
    """`n` requests submitted together (distinct random prompts), each producing `output_len` tokens.
    Also split in two phases: prefill (until every request has its first token) and decode (the rest,
    `n` sequences generating together)."""
    g = torch.Generator().manual_seed(seed)
    engine = llm.llm_engine
    vocab = engine.arch.vocab_size
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"c{seed}-{i}", {"prompt_token_ids": torch.randint(10, vocab - 10, (prompt_len,), generator=g).tolist()},
                           params)
    t0 = time.perf_counter()
    started: set[str] = set()
    tokens = 0
    t_prefilled = None
    while engine.has_unfinished():
        for out in engine.step():
            started.add(out.request_id)
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
        if t_prefilled is None and len(started) == n:
            t_prefilled = time.perf_counter()
    t1 = time.perf_counter()
    return {"requests": n, "output_tokens": tokens, "seconds": t1 - t0, "output_tokens_per_s": tokens / (t1 - t0),
            "prefill_tokens_per_s": n * prompt_len / (t_prefilled - t0),
            "decode_tokens_per_s": (tokens - n) / (t1 - t_prefilled)}


def interleaved_batch1(llms: dict, tokens: int, burst: int = 4, prompt_len: int = 32) -> dict[str, float]:
    """Median decode-step seconds per format, one request each, `burst` steps of each format in turn."""
    engines = {name: llm.llm_engine for name, llm in llms.items()}
    for e in engines.values():
        e.add_request("batch1", {"prompt_token_ids": list(range(100, 100 + prompt_len))},
                      SamplingParams(max_tokens=tokens + 1, temperature=0, ignore_eos=True))
        e.step()  # the prefill
    times: dict[str, list[float]] = {name: [] for name in engines}
    while any(e.has_unfinished() for e in engines.values()):
        for name, e in engines.items():
            for _ in range(burst):
                if not e.has_unfinished():
                    break
                with kernel_variant(name):
                    t = time.perf_counter()
                    e.step()
                    times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def run_quant_benchmark(args) -> dict:
    from sieve.layers.linear import Linear
    from sieve.models.default import resolve_default

    model, _ = resolve_default(args.model)
    formats = [f for f in args.formats.split(",") if f != "bf16"]
    common = dict(kv_cache_memory_gb=args.kv_cache_memory_gb, max_num_seqs=max(64, args.concurrent))
    widen = {"dequantize": True} if str(model).endswith(".gguf") else {}  # a GGUF file's codes widened to bf16 first
    llms = {"bf16": _llm(model, **widen, **common)}
    checkpoints = {"awq": (args.awq_model, "--awq-model, a checkpoint from `sieve quantize --method awq`"),
                   "smoothquant": (args.smoothquant_model,
                                   "--smoothquant-model, a checkpoint from `sieve quantize --method smoothquant`")}
    for fmt in formats:
        if fmt in checkpoints:
            path, hint = checkpoints[fmt]
            if not path:
                print(f"{fmt}: skipped (give {hint})")
                continue
            llms[fmt] = _llm(path, quantize_lm_head=args.quantize_lm_head, **common)
        else:
            llms[fmt] = _llm(model, quantization="w8a8" if fmt == "w8a8-vnni" else fmt, quantization_group_size=args.group_size,
                             quantize_lm_head=args.quantize_lm_head, **widen, **common)

    head = "quantized too" if args.quantize_lm_head else "kept in bf16"
    print(f"formats {', '.join(llms)}; LM head {head}; {torch.get_num_threads()} threads; measured interleaved")
    step = interleaved_batch1(llms, args.batch1_tokens)
    conc: dict[str, list[dict]] = {name: [] for name in llms}
    for r in range(args.rounds):
        for name, llm in llms.items():
            with kernel_variant(name):
                conc[name].append(run_concurrent(llm, args.concurrent, args.prompt_len, args.output_len, seed=r))

    rows: dict[str, dict] = {}
    for name, llm in llms.items():
        linears = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, Linear)]
        best = {k: max(c[k] for c in conc[name]) for k in ("output_tokens_per_s", "prefill_tokens_per_s", "decode_tokens_per_s")}
        rows[name] = r = {"batch1_step_ms": step[name] * 1e3, "batch1_tokens_per_s": 1 / step[name],
                          "concurrent_tokens_per_s": best["output_tokens_per_s"],
                          "concurrent_prefill_tokens_per_s": best["prefill_tokens_per_s"],
                          "concurrent_decode_tokens_per_s": best["decode_tokens_per_s"], "concurrent_rounds": conc[name],
                          "linear_weight_bytes": sum(m.weight_bytes for m in linears)}
        with kernel_variant(name):
            r["profile"] = profile_batch1(llm)
        ref = rows["bf16"]
        r["batch1_ratio"] = r["batch1_tokens_per_s"] / ref["batch1_tokens_per_s"]
        for k in ("concurrent", "concurrent_prefill", "concurrent_decode"):
            r[k + "_ratio"] = r[k + "_tokens_per_s"] / ref[k + "_tokens_per_s"]
        prof = r["profile"]
        print(f"{name:>5}: batch-1 {r['batch1_tokens_per_s']:.1f} tok/s ({r['batch1_ratio']:.2f}x bf16); "
              f"{args.concurrent} at once {r['concurrent_tokens_per_s']:.1f} output tok/s ({r['concurrent_ratio']:.2f}x): "
              f"prefill {r['concurrent_prefill_tokens_per_s']:.0f} tok/s ({r['concurrent_prefill_ratio']:.2f}x), "
              f"decode {r['concurrent_decode_tokens_per_s']:.1f} tok/s ({r['concurrent_decode_ratio']:.2f}x); "
              f"linear weights {r['linear_weight_bytes'] / 1e9:.3f} GB; batch-1 step {prof['step_ms']:.1f} ms"
              + (f", linears {prof['linear_ms']:.1f} of it" if prof["linear_ms"] is not None else " (layer loop in C++)"))
        for shape, v in prof["per_shape"].items():
            print(f"         {shape:>12}: {v['ms_per_step']:.2f} ms/step, {v['gbps']:.1f} GB/s")
    del llms
    gc.collect()

    kv = {}
    for kind in ("auto", "fp8", "int8"):
        llm = _llm(model, kv_cache_dtype=kind, kv_cache_memory_gb=args.kv_memory_gb, max_num_seqs=4096,
                   max_model_len=max(args.kv_context + 16, 32))
        e = llm.llm_engine
        per_seq = -(-(args.kv_context + 1) // e.config.block_size)
        kv[kind] = {"blocks": e.block_manager.num_blocks, "sequences_at_context": e.block_manager.num_blocks // per_seq}
        kv[kind]["ratio"] = kv[kind]["sequences_at_context"] / kv["auto"]["sequences_at_context"]
        print(f"KV {kind:>4}: {kv[kind]['blocks']} blocks in {args.kv_memory_gb} GiB -> {kv[kind]['sequences_at_context']} "
              f"sequences of {args.kv_context} tokens ({kv[kind]['ratio']:.2f}x)")
        del llm, e
        gc.collect()
    return {"model": str(model), "threads": torch.get_num_threads(), "quantize_lm_head": args.quantize_lm_head,
            "formats": rows, "kv_capacity": kv,
            "settings": {k: getattr(args, k) for k in ("batch1_tokens", "concurrent", "prompt_len", "output_len", "rounds",
                                                      "kv_context", "kv_memory_gb", "group_size")}}
