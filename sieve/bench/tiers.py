"""`sieve bench tiers`: the KV tiers (sieve/kv_tiers) on returning conversations, a restart, and a tier slower than
recomputing.

- Returning conversations: `--conversations` retrieval conversations, each a document of `--doc-tokens` and
  `--turns` questions, taken round robin (every conversation's first turn, then every second turn, ...), so that
  their KV (far more than the `--pool-tokens` pool) has left the pool when a conversation returns. Time to first
  token of every turn, without tiers and with the disk tier; the returning turns (the second on) are the figure.
- Restart: the first request on a `--restart-doc-tokens` document after a restart, against the same request on a
  fresh server that never saw it.
- A slow tier: the same conversations with every block read delayed by `--slow-read-ms` (a throttled disk): the
  cost model must choose to recompute, and TTFT must be no worse than without tiers.
- Lossy (`--parts lossy`): the returning conversations through a host tier holding the pool's bytes and through one
  holding int8 blocks (`--kv-tier-dtype int8`), the prompts the same (the lossless run's conversation): the bytes a
  block takes in each, and what the int8 blocks cost: returning answers identical, and per returning turn the KL
  divergence of the first answer token's distribution (over the lossless run's top 20, both renormalized there) and
  its top-1 agreement.
- Replicas (`--parts replicas --redis-url URL`): two engines sharing a Redis tier, one after the other; the second is asked the
  documents the first computed.
- Preemption (`--parts preemption`): `--preempt-background` background requests (priority 1, documents of
  `--doc-tokens`, `--preempt-max-tokens` each) fill the running slots; every `--preempt-every` steps an interactive
  request (priority 0, a fresh document of `--restart-doc-tokens`, 16 tokens) displaces one of them, and its prompt
  takes the pool's room, evicting the victim's blocks. Without tiers the victim recomputes them when it resumes; with
  a host tier (`--kv-offloading-size`) it reads them back. Reported: the background's recomputed tokens, the whole
  run's seconds, the interactive requests' TTFT, and whether every background output equals its run without the
  interruptions.

One engine at a time, one request at a time (TTFT is the prompt's own prefill, not a queue), offline.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

QUESTION = "\n\nQuestion: What is this document about?\nAnswer:"
FOLLOW_UPS = ["\n\nQuestion: Who is named first in it?\nAnswer:", "\n\nQuestion: What happens at the end?\nAnswer:",
              "\n\nQuestion: Which year does it mention?\nAnswer:", "\n\nQuestion: Summarise it in one line.\nAnswer:"]


def add_bench_tiers_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto", help="the pool's KV dtype (e.g. bfloat16: a 16-bit pool under a float32 model)")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--doc-tokens", default="2000,2200", help="MIN,MAX tokens of each conversation's document")
    p.add_argument("--pool-tokens", type=int, default=20000, help="the KV pool, in tokens")
    p.add_argument("--max-tokens", type=int, default=16, help="each answer's length")
    p.add_argument("--restart-doc-tokens", type=int, default=4000)
    p.add_argument("--slow-read-ms", type=float, default=50.0, help="the slow tier's delay per block read")
    p.add_argument("--disk", default=None, help="the disk tier's directory (default: a new temporary one per run)")
    p.add_argument("--redis-url", default=None,
                   help="a Redis (redis://HOST:PORT/DB) for two replicas sharing a tier: the second loads the documents the "
                        "first computed (skipped without it)")
    p.add_argument("--replica-docs", type=int, default=8, help="documents both replicas see")
    p.add_argument("--parts", default="returning,restart",
                   help="which to measure: returning, restart, replicas, preemption (comma-separated)")
    p.add_argument("--preempt-background", type=int, default=4, help="preemption: background requests (the running slots)")
    p.add_argument("--preempt-max-tokens", type=int, default=128, help="preemption: each background request's length")
    p.add_argument("--preempt-every", type=int, default=16, help="preemption: steps between interactive arrivals")
    p.add_argument("--host-gb", type=float, default=1.0, help="preemption and lossy: the host tier's size (--kv-offloading-size)")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--output-json", default=None)


def _engine(args, disk: str | None, read_delay_s: float = 0.0, **tiers):
    from sieve import LLM
    from sieve.models.default import resolve_default

    model, _ = resolve_default(args.model)
    os.environ["SIEVE_KV_TIER_READ_DELAY_S"] = str(read_delay_s)
    try:
        return LLM(model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, block_size=16, num_gpu_blocks_override=args.pool_tokens // 16,
                   kv_cache_disk=disk, num_threads=args.num_threads, max_model_len=min(8192, args.pool_tokens), **tiers)
    finally:
        os.environ.pop("SIEVE_KV_TIER_READ_DELAY_S", None)


def _ttft(llm, prompt: str, max_tokens: int):
    from sieve import SamplingParams

    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0]
    m = out.metrics
    return out, m.first_token_time - m.arrival_time


def returning_conversations(args, docs: list[str], disk: str | None, read_delay_s: float = 0.0) -> dict:
    """Every turn's TTFT, round robin over the conversations; the answers (greedy) for the equality check."""
    llm = _engine(args, disk, read_delay_s)
    _ttft(llm, "Hello there, a first request to warm up.", 2)
    prompts = [f"Here is a document.\n\n{d}{QUESTION}" for d in docs]
    first, back, answers, tier_tokens = [], [], [], 0
    started = time.perf_counter()
    for turn in range(args.turns):
        for c in range(len(prompts)):
            out, ttft = _ttft(llm, prompts[c], args.max_tokens)
            (first if turn == 0 else back).append(ttft)
            tier_tokens += sum(out.kv_tier_tokens.values())
            answers.append(out.outputs[0].token_ids)
            prompts[c] += out.outputs[0].text + FOLLOW_UPS[turn % len(FOLLOW_UPS)]
    tiers = llm.llm_engine.kv_tiers
    extra = {}
    if tiers is not None:
        s = tiers.stats
        extra = {"tier_tokens_loaded": tier_tokens, "tier_blocks_loaded": sum(s.hits.values()),
                 "blocks_recomputed": dict(s.recomputed), "checksum_failures": s.checksum_failures,
                 "fetch_ms_per_block": {k: round(1e3 * v, 3) for k, v in tiers.fetch_s_per_block.items()},
                 "recompute_ms_per_block": round(1e3 * tiers.recompute_s_per_block, 3)}
    llm.shutdown()
    q = lambda xs, p: 1e3 * statistics.quantiles(xs, n=100)[p - 1] if len(xs) > 1 else 1e3 * xs[0]  # noqa: E731
    return {"first_turn_ttft_p50_ms": round(1e3 * statistics.median(first), 1),
            "returning_ttft_p50_ms": round(1e3 * statistics.median(back), 1), "returning_ttft_p99_ms": round(q(back, 99), 1),
            "seconds": round(time.perf_counter() - started, 1), "answers": answers, **extra}


def restart(args, doc: str, disk: str) -> dict:
    """TTFT of a cached document's first request after a restart, against a server that never saw it."""
    prompt = f"Here is a document.\n\n{doc}{QUESTION}"
    cold = _engine(args, disk)
    _ttft(cold, "Hello there, a first request to warm up.", 2)
    out_cold, ttft_cold = _ttft(cold, prompt, args.max_tokens)
    cold.llm_engine.kv_tiers.flush(timeout_s=120)
    cold.shutdown()
    warm = _engine(args, disk)
    _ttft(warm, "Hello there, a first request to warm up.", 2)
    out_warm, ttft_warm = _ttft(warm, prompt, args.max_tokens)
    warm.shutdown()
    return {"prompt_tokens": len(out_cold.prompt_token_ids), "cold_ttft_ms": round(1e3 * ttft_cold, 1),
            "restarted_ttft_ms": round(1e3 * ttft_warm, 1), "speedup": round(ttft_cold / ttft_warm, 2),
            "tier_tokens_loaded": sum(out_warm.kv_tier_tokens.values()),
            "outputs_identical": out_cold.outputs[0].token_ids == out_warm.outputs[0].token_ids}


def replicas(args, docs: list[str], redis_url: str, secret_file: str) -> dict:
    """Two replicas sharing a Redis tier, one after the other: the first computes each document's prompt, the second
    (a fresh engine, its pool empty) is asked the same: its TTFT, and the prefill tokens it did not compute."""
    prompts = [f"Here is a document.\n\n{d}{QUESTION}" for d in docs]
    shared = {"kv_cache_remote": redis_url, "kv_cache_secret_file": secret_file}
    ttfts = {}
    for name in ("first", "second"):
        llm = _engine(args, None, **shared)
        _ttft(llm, "Hello there, a first request to warm up.", 2)
        times, loaded = [], 0
        for p in prompts:
            out, ttft = _ttft(llm, p, args.max_tokens)
            times.append(ttft)
            loaded += out.kv_tier_tokens.get("redis", 0)
        llm.llm_engine.kv_tiers.flush(timeout_s=120)
        llm.shutdown()
        ttfts[name] = {"ttft_p50_ms": round(1e3 * statistics.median(times), 1), "prefill_tokens_saved": loaded}
    return {"documents": len(docs), **ttfts,
            "speedup": round(ttfts["first"]["ttft_p50_ms"] / ttfts["second"]["ttft_p50_ms"], 2)}


def preemption(args, docs: list[str], interactive_docs: list[str], host_gb: float | None) -> dict:
    """Background requests displaced by interactive ones whose prompts evict their blocks; `host_gb` None: no tiers.
    Steps the engine itself, so that arrivals come at the same steps with the tier and without."""
    from sieve import SamplingParams

    llm = _engine(args, None, max_num_seqs=args.preempt_background,
                  **({"kv_offloading_size": host_gb} if host_gb is not None else {}))
    eng = llm.llm_engine
    if eng.kv_tiers is not None:
        log_cost = (round(1e3 * (eng.kv_tiers.fetch_s_per_block["host"] + eng.kv_tiers.fill_s_per_block), 3),
                    round(1e3 * eng.kv_tiers.recompute_s_per_block, 3))
    _ttft(llm, "Hello there, a first request to warm up.", 2)
    computed = {"background": 0}
    schedule = eng.scheduler.schedule

    def counted():
        out = schedule()
        computed["background"] += sum(s.num_new_tokens for s in out.scheduled if s.seq.request.priority == 1)
        return out

    eng.scheduler.schedule = counted
    bg = SamplingParams(max_tokens=args.preempt_max_tokens, temperature=0, ignore_eos=True)
    for i, d in enumerate(docs):
        eng.add_request(f"bg{i}", f"Here is a document.\n\n{d}{QUESTION}", bg, 1)
    pending, outputs, ttft, steps = list(interactive_docs), {}, [], 0
    started = time.perf_counter()
    while eng.has_unfinished():
        if pending and steps and steps % args.preempt_every == 0:
            eng.add_request(f"i{len(pending)}", f"Here is a document.\n\n{pending.pop()}{QUESTION}",
                            SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), 0)
        steps += 1
        for out in eng.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
                if out.request_id.startswith("i"):
                    ttft.append(out.metrics.first_token_time - out.metrics.arrival_time)
    seconds = time.perf_counter() - started
    result = {"seconds": round(seconds, 2), "steps": steps, "preemptions": eng.scheduler.num_preemptions,
              "background_tokens_computed": computed["background"],
              "interactive_ttft_p50_ms": round(1e3 * statistics.median(ttft), 1) if ttft else None,
              "outputs": {k: v for k, v in outputs.items() if k.startswith("bg")}}
    if eng.kv_tiers is not None:
        s = eng.kv_tiers.stats
        result.update(blocks_restored=dict(s.resumed), fetch_ms_per_block=log_cost[0], recompute_ms_per_block=log_cost[1],
                      blocks_recomputed=dict(s.recomputed), dropped_writes=s.dropped_writes)
    llm.shutdown()
    return result


def preemption_parts(args, model: str) -> dict:
    """Preemption without tiers, with a host tier, and the background alone (the outputs' reference)."""
    from sieve.bench.ladder import long_documents

    lo, hi = (int(x) for x in args.doc_tokens.split(","))
    docs = long_documents(model, (lo, hi), n=args.preempt_background, seed=2)[: args.preempt_background]
    n_interactive = max(1, args.preempt_max_tokens // args.preempt_every - 1)
    fresh = long_documents(model, (args.restart_doc_tokens, args.restart_doc_tokens + 200), n=n_interactive, seed=3)[:n_interactive]
    alone = preemption(args, docs, [], None)
    plain = preemption(args, docs, fresh, None)
    host = preemption(args, docs, fresh, args.host_gb)
    rows = sum(len(v) - 1 for v in alone["outputs"].values())  # decode rows: a row for each token but the last
    prompt_rows = alone["background_tokens_computed"] - rows
    out = {"background": len(docs), "interactive": len(fresh), "alone": alone, "no_tiers": plain, "host_tier": host,
           "recomputed_tokens": {"no_tiers": plain["background_tokens_computed"] - rows - prompt_rows,
                                 "host_tier": host["background_tokens_computed"] - rows - prompt_rows},
           "outputs_identical_to_alone": {"no_tiers": plain["outputs"] == alone["outputs"],
                                          "host_tier": host["outputs"] == alone["outputs"]},
           "seconds_ratio": round(plain["seconds"] / host["seconds"], 3)}
    for r in (alone, plain, host):
        del r["outputs"]
    print(f"  preemption: {plain['preemptions']} / {host['preemptions']} preemptions; background tokens recomputed "
          f"{out['recomputed_tokens']['no_tiers']} without tiers, {out['recomputed_tokens']['host_tier']} with a host tier "
          f"({host.get('blocks_restored')} blocks read back); run {plain['seconds']} s against {host['seconds']} s "
          f"({out['seconds_ratio']}x); interactive TTFT p50 {plain['interactive_ttft_p50_ms']} / {host['interactive_ttft_p50_ms']} ms; "
          f"outputs equal to alone: {out['outputs_identical_to_alone']}", flush=True)
    return out


def _scripted_turns(args, docs: list[str], script: list[str] | None, **tiers) -> tuple[list[dict], list[str], float]:
    """Every turn, round robin, with the top-20 logprobs of each answer token; each answer appended to its
    conversation is `script`'s where given (the same prompts in every run), else the answer's own. Returns the turns,
    the answers' texts and the bytes a block takes in the first tier."""
    from sieve import SamplingParams

    llm = _engine(args, None, **tiers)
    _ttft(llm, "Hello there, a first request to warm up.", 2)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True, logprobs=20)
    prompts = [f"Here is a document.\n\n{d}{QUESTION}" for d in docs]
    turns, texts = [], []
    for turn in range(args.turns):
        for c in range(len(prompts)):
            out = llm.generate([prompts[c]], params)[0]
            m = out.metrics
            turns.append({"turn": turn, "tokens": out.outputs[0].token_ids, "ttft": m.first_token_time - m.arrival_time,
                          "first": {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()},
                          "tier_tokens": sum(out.kv_tier_tokens.values())})
            texts.append(out.outputs[0].text)
            prompts[c] += (script[len(texts) - 1] if script is not None else texts[-1]) + FOLLOW_UPS[turn % len(FOLLOW_UPS)]
    store = llm.llm_engine.kv_tiers.stores[0]
    per_block = store.bytes_held / max(1, len(store))
    llm.shutdown()
    return turns, texts, per_block


def top_kl(p_logprobs: dict, q_logprobs: dict) -> float:
    """KL(P || Q) over P's top tokens (the keys of `p_logprobs`), both renormalized over that set; a token past Q's
    top list takes Q's last logprob there (at most that). Never negative, and 0 only where they agree on the set."""
    import math

    floor = min(q_logprobs.values())
    ps = {t: math.exp(lp) for t, lp in p_logprobs.items()}
    qs = {t: math.exp(q_logprobs.get(t, floor)) for t in p_logprobs}
    zp, zq = sum(ps.values()), sum(qs.values())
    return sum(p / zp * math.log((p / zp) / (qs[t] / zq)) for t, p in ps.items())


def lossy_part(args, docs: list[str]) -> dict:
    """The lossy tier's room and cost against a lossless one, on the same prompts."""
    exact, script, exact_bytes = _scripted_turns(args, docs, None, kv_offloading_size=args.host_gb)
    lossy, _, lossy_bytes = _scripted_turns(args, docs, script, kv_offloading_size=args.host_gb, kv_tier_dtype="int8")
    back = [(e, q) for e, q in zip(exact, lossy) if e["turn"] > 0]
    kls, top1 = [], []
    for e, q in back:
        kls.append(top_kl(e["first"], q["first"]))
        top1.append(max(e["first"], key=e["first"].get) == max(q["first"], key=q["first"].get))
    out = {"bytes_per_block": {"lossless": round(exact_bytes), "int8": round(lossy_bytes)},
           "capacity_ratio": round(exact_bytes / lossy_bytes, 2), "returning_turns": len(back),
           "tier_tokens_loaded": {"lossless": sum(e["tier_tokens"] for e, _ in back), "int8": sum(q["tier_tokens"] for _, q in back)},
           "answers_identical": round(sum(e["tokens"] == q["tokens"] for e, q in back) / len(back), 3),
           "first_token_kl_mean": round(statistics.mean(kls), 6), "first_token_kl_max": round(max(kls), 6),
           "first_token_top1_agreement": round(sum(top1) / len(top1), 3),
           "returning_ttft_p50_ms": {"lossless": round(1e3 * statistics.median(e["ttft"] for e, _ in back), 1),
                                     "int8": round(1e3 * statistics.median(q["ttft"] for _, q in back), 1)}}
    print(f"  lossy tier: {out['bytes_per_block']['int8']} bytes a block against {out['bytes_per_block']['lossless']} "
          f"({out['capacity_ratio']}x the blocks); returning answers identical {out['answers_identical']}, first-token KL "
          f"mean {out['first_token_kl_mean']} (max {out['first_token_kl_max']}), top-1 {out['first_token_top1_agreement']}; "
          f"returning TTFT p50 {out['returning_ttft_p50_ms']['lossless']} / {out['returning_ttft_p50_ms']['int8']} ms", flush=True)
    return out


PARTS = ("returning", "restart", "replicas", "preemption", "lossy")


def run_bench_tiers(args) -> dict:
    from sieve.bench.ladder import long_documents
    from sieve.config import ConfigError
    from sieve.models.default import resolve_default

    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if not parts or set(parts) - set(PARTS):
        raise ConfigError(f"bench tiers: --parts takes {', '.join(PARTS)} (comma-separated), got {args.parts!r}")
    if "replicas" in parts and not args.redis_url:
        raise ConfigError("bench tiers: the replicas part shares a Redis tier: give --redis-url redis://HOST:PORT/DB")
    model, _ = resolve_default(args.model)
    lo, hi = (int(x) for x in args.doc_tokens.split(","))
    docs = long_documents(model, (lo, hi), n=args.conversations, seed=0)[: args.conversations]
    print(f"bench tiers: {model}; {', '.join(parts)}; {len(docs)} conversations of {args.turns} turns over documents of "
          f"{lo}-{hi} tokens, a pool of {args.pool_tokens} tokens", flush=True)
    out = {"model": model, "conversations": len(docs), "turns": args.turns, "doc_tokens": [lo, hi],
           "pool_tokens": args.pool_tokens, "max_tokens": args.max_tokens}
    with tempfile.TemporaryDirectory(prefix="sieve-tiers-") as tmp:
        if "returning" in parts:
            out.update(returning_parts(args, docs, tmp))
        if "restart" in parts:
            long_doc = long_documents(model, (args.restart_doc_tokens, args.restart_doc_tokens + 200), n=1, seed=1)[0]
            rs = out["restart"] = restart(args, long_doc, os.path.join(tmp, "restart"))
            print(f"  restart:    {rs['prompt_tokens']}-token document, TTFT cold {rs['cold_ttft_ms']} ms, after a restart "
                  f"{rs['restarted_ttft_ms']} ms ({rs['speedup']}x)", flush=True)
        if "replicas" in parts:
            key = os.path.join(tmp, "shared.key")
            with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
                f.write(os.urandom(32))
            rep = out["replicas"] = replicas(args, docs[: args.replica_docs], args.redis_url, key)
            print(f"  replicas:   the second replica's TTFT p50 {rep['second']['ttft_p50_ms']} ms against the first's "
                  f"{rep['first']['ttft_p50_ms']} ms ({rep['speedup']}x), {rep['second']['prefill_tokens_saved']} prefill "
                  "tokens not computed", flush=True)
        if "preemption" in parts:
            out["preemption"] = preemption_parts(args, model)
        if "lossy" in parts:
            out["lossy"] = lossy_part(args, docs)
    return out


def returning_parts(args, docs: list[str], tmp: str) -> dict:
    """Returning conversations without tiers, with the disk tier, and with a slow disk tier."""
    plain = returning_conversations(args, docs, None)
    print(f"  no tiers:   returning TTFT p50 {plain['returning_ttft_p50_ms']} ms, p99 {plain['returning_ttft_p99_ms']} ms", flush=True)
    disk = returning_conversations(args, docs, args.disk or os.path.join(tmp, "disk"))
    print(f"  disk tier:  returning TTFT p50 {disk['returning_ttft_p50_ms']} ms, p99 {disk['returning_ttft_p99_ms']} ms "
          f"({disk['tier_blocks_loaded']} blocks loaded)", flush=True)
    slow = returning_conversations(args, docs, os.path.join(tmp, "slow"), args.slow_read_ms / 1e3)
    print(f"  slow tier:  returning TTFT p50 {slow['returning_ttft_p50_ms']} ms, p99 {slow['returning_ttft_p99_ms']} ms "
          f"({slow['tier_blocks_loaded']} blocks loaded)", flush=True)
    same = plain["answers"] == disk["answers"] == slow["answers"]
    for r in (plain, disk, slow):
        del r["answers"]
    out = {"no_tiers": plain, "disk": disk, "slow_disk": dict(slow, read_delay_ms=args.slow_read_ms), "outputs_identical": same,
           "returning_p50_speedup": round(plain["returning_ttft_p50_ms"] / disk["returning_ttft_p50_ms"], 2),
           "slow_tier_p50_ratio": round(slow["returning_ttft_p50_ms"] / plain["returning_ttft_p50_ms"], 2)}
    print(f"returning turns' TTFT p50 {out['returning_p50_speedup']}x better with the disk tier; a slow tier's at "
          f"{out['slow_tier_p50_ratio']}x of no tiers; outputs identical: {same}", flush=True)
    return out
