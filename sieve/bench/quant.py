"""`sieve bench quant`: every weight format against the unquantized model in one run, and KV capacity.

For each format (bf16 first, the reference): batch-1 decode tokens/s (median step after a 32-token
prompt), throughput with `concurrent` requests generating at once, the bytes of linear weights a
step reads, and (for the record) the batch-1 profile per weight shape. Then, with one fixed KV
memory budget, how many sequences of `kv_context` tokens fit for each KV-cache dtype.
"""

from __future__ import annotations

import gc
import time

import torch

from sieve.bench.offline import profile_batch1, run_batch1_decode
from sieve.sampling_params import SamplingParams


def _llm(model: str, dtype: str, **options):
    from sieve.llm import LLM

    return LLM(model, dtype=dtype, skip_tokenizer_init=True, enable_prefix_caching=False, **options)


def run_concurrent(llm, n: int, prompt_len: int, output_len: int) -> dict:
    """`n` requests submitted together (distinct random prompts), each producing `output_len` tokens."""
    g = torch.Generator().manual_seed(0)
    vocab = llm.llm_engine.arch.vocab_size
    prompts = [{"prompt_token_ids": torch.randint(10, vocab - 10, (prompt_len,), generator=g).tolist()} for _ in range(n)]
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"requests": n, "output_tokens": tokens, "seconds": seconds, "output_tokens_per_s": tokens / seconds}


def run_quant_benchmark(args) -> dict:
    formats = args.formats.split(",")
    if formats[0] != "bf16":
        formats = ["bf16", *[f for f in formats if f != "bf16"]]
    rows: dict[str, dict] = {}
    for fmt in formats:
        if fmt == "awq":
            if not args.awq_model:
                print("awq: skipped (give --awq-model, a checkpoint from `sieve quantize --method awq`)")
                continue
            llm = _llm(args.awq_model, "bfloat16", max_num_seqs=max(64, args.concurrent))
        else:
            llm = _llm(args.model, "bfloat16", quantization=None if fmt == "bf16" else fmt,
                       quantization_group_size=args.group_size, max_num_seqs=max(64, args.concurrent))
        b1 = run_batch1_decode(llm, args.batch1_tokens)
        conc = run_concurrent(llm, args.concurrent, args.prompt_len, args.output_len)
        prof = profile_batch1(llm)
        from sieve.layers.linear import Linear

        wbytes = sum(m.weight_bytes for m in llm.llm_engine.runner.model.modules() if isinstance(m, Linear))
        rows[fmt] = {"batch1_tokens_per_s": b1["tokens_per_s"], "batch1_step_ms": b1["median_step_ms"],
                     "concurrent_tokens_per_s": conc["output_tokens_per_s"], "linear_weight_bytes": wbytes,
                     "profile": prof}
        ref = rows["bf16"]
        r = rows[fmt]
        r["batch1_ratio"] = r["batch1_tokens_per_s"] / ref["batch1_tokens_per_s"]
        r["concurrent_ratio"] = r["concurrent_tokens_per_s"] / ref["concurrent_tokens_per_s"]
        print(f"{fmt:>5}: batch-1 {r['batch1_tokens_per_s']:.1f} tok/s ({r['batch1_ratio']:.2f}x bf16), "
              f"{args.concurrent} at once {r['concurrent_tokens_per_s']:.1f} tok/s ({r['concurrent_ratio']:.2f}x), "
              f"linear weights {wbytes / 1e9:.3f} GB; batch-1 linears {prof['linear_ms']:.1f} of {prof['step_ms']:.1f} ms")
        for shape, v in prof["per_shape"].items():
            print(f"         {shape:>12}: {v['ms_per_step']:.2f} ms/step, {v['gbps']:.1f} GB/s")
        del llm
        gc.collect()

    kv = {}
    for kind in ("auto", "fp8", "int8"):
        llm = _llm(args.model, "bfloat16", kv_cache_dtype=kind, kv_cache_memory_gb=args.kv_memory_gb, max_num_seqs=4096,
                   max_model_len=max(args.kv_context + 16, 32))
        e = llm.llm_engine
        per_seq = -(-(args.kv_context + 1) // e.config.block_size)
        kv[kind] = {"blocks": e.block_manager.num_blocks, "sequences_at_context": e.block_manager.num_blocks // per_seq}
        kv[kind]["ratio"] = kv[kind]["sequences_at_context"] / kv["auto"]["sequences_at_context"]
        print(f"KV {kind:>4}: {kv[kind]['blocks']} blocks in {args.kv_memory_gb} GiB -> {kv[kind]['sequences_at_context']} "
              f"sequences of {args.kv_context} tokens ({kv[kind]['ratio']:.2f}x)")
        del llm, e
        gc.collect()
    return {"model": args.model, "threads": torch.get_num_threads(), "formats": rows, "kv_capacity": kv,
            "settings": {k: getattr(args, k) for k in ("batch1_tokens", "concurrent", "prompt_len", "output_len",
                                                      "kv_context", "kv_memory_gb", "group_size")}}
