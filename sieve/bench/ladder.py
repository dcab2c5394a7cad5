"""`sieve bench ladder`: users per device within a latency target, measured rung by rung on the engine, beside
the planner's prediction and each lossy rung's quality cost.

Rungs are cumulative; each is one server (a subprocess) under a closed loop of streaming chat users:

    0 naive           one request at a time: transformers' `generate` behind a minimal server (--naive hf,
                      sieve/bench/naive_server.py, in float32: transformers' default dtype, and on a CPU without
                      native bf16 arithmetic several times faster than bf16), or sieve with --max-num-seqs 1 (--naive sieve)
    1 batching        continuous batching with paged KV (sieve, prefix caching off, bf16 weights)
    2 prefix          + prefix caching (the users share a system prompt)
    3 int8            + int8 weights
    4 speculative     + speculative decoding, n-gram proposals with the `auto` depth
    5 kv-fp8          + an FP8 KV cache (a `sieve distill --kv fp8` checkpoint with --kv-checkpoint)
    6 int4            + 4-bit weights (the GGUF file's own Q4_1 codes, or `-q int4`)
      kv-press        (not by default) + KV compression, SnapKV keeping half of each prompt's positions: an
                      alternative to kv-fp8 where memory binds (the long workload); its quality: `sieve bench compression`

How users are counted: a point with U users runs U closed-loop users (each sends a conversation's turn, reads
the whole streamed answer, sends the next; a user starts at a random moment of the first `--ramp` seconds), for
`--warmup` seconds and then `--measure` seconds; only requests sent in the measured window count. The point is
within the SLO when none failed and TTFT p99 <= --slo-ttft-ms and TPOT p99 <= --slo-tpot-ms. Capacity is found
by growing U by `--growth` from the previous rung's capacity until a point fails, then bisecting (users are
integers; the search stops when the bracket is within `--resolution` of the lower end). With `--repeats N` each
rung is measured N times, a fresh server each (its search from the first repeat's capacity), and its users are
the median: a capacity is one sample of a noisy machine, and a rung's gain within that noise is no gain.

Memory: `--memory-gb` is the device's memory budget (weights + KV cache, as a GPU's memory): each rung's KV pool
is that budget minus its weights' bytes, so lighter weights and KV formats buy users as they do on a GPU. On a
CPU host without it, memory never binds and only speed counts.

Quality: `sieve eval` (sieve/evaluate.py) of each lossy rung's options against the bf16 model on held-out text
(KL divergence, top-1 agreement, perplexity). Planner: `sieve plan`'s arithmetic (sieve/plan/roofline.py) for
the same model, the same rung and this CPU measured now, with the workload's mean context and output.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

SCHEMA_ID = "sieve.bench.ladder/1"


# ------------------------------------------------------------------------------------------- the search
@dataclass
class Probe:
    users: int
    within_slo: bool
    summary: dict = field(default_factory=dict)


def find_capacity(probe: Callable[[int], Probe], start: int = 1, growth: float = 2.0, max_users: int = 512,
                  resolution: float = 0.1) -> tuple[int, list[Probe]]:
    """The largest user count within the SLO, assuming more users never makes latency better.

    Starts at `start` (a rung's search starts from the previous rung's capacity); if that fails, searches down
    from 1. Grows by `growth` until a point fails (or `max_users` passes), then bisects until the bracket
    (lo passes, hi fails) is within max(1, resolution * lo). Returns (capacity, every probe in order); capacity 0
    when even one user misses the SLO."""
    if growth <= 1:
        raise ValueError("growth must be > 1")
    probes: list[Probe] = []
    seen: dict[int, bool] = {}

    def ok(u: int) -> bool:
        if u not in seen:
            p = probe(u)
            probes.append(p)
            seen[u] = p.within_slo
        return seen[u]

    start = max(1, min(start, max_users))
    if ok(start):
        lo, hi = start, None
        while hi is None:
            nxt = min(max_users, max(lo + 1, int(math.ceil(lo * growth))))
            if nxt == lo:  # at max_users
                return lo, probes
            if ok(nxt):
                lo = nxt
            else:
                hi = nxt
    else:
        if start == 1 or not ok(1):
            return 0, probes
        lo, hi = 1, start
    while hi - lo > max(1, int(resolution * lo)):
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes


# ------------------------------------------------------------------------------------------- the workload
SYSTEM_PROMPT = (
    "You are Sieve Assistant, the helpful, friendly and precise assistant of a public library's website. Answer the "
    "visitor's question in plain language, in a few short paragraphs or a short list. Be accurate: when you are "
    "not sure of a fact, say so rather than guess. Keep a warm, respectful tone; do not use slang. Do not give "
    "medical, legal or financial advice beyond general information, and suggest a professional when a question "
    "needs one. If a question is unclear, answer the most likely reading and say which one you chose. The library "
    "is open from nine in the morning to eight in the evening on weekdays and from ten to four on Saturdays; it is "
    "closed on Sundays and public holidays. Members may borrow up to twelve items for three weeks and renew them "
    "twice online unless another member has reserved them. The reading rooms, the children's corner, the study "
    "booths and the computers are free for everyone; printing costs ten cents a page. Events this month: a "
    "storytelling morning for children every Saturday, a beginners' chess club on Tuesday evenings, a talk on local "
    "history on the second Thursday and a repair cafe on the last Sunday. Never invent events, opening hours or "
    "rules that are not listed here. When a visitor asks about something unrelated to the library, answer it "
    "helpfully all the same."
)
FOLLOW_UPS = ["Can you explain that more simply?", "Thanks! Can you give me one example?", "What should I read next about it?",
              "Can you summarise that in one sentence?"]


RETRIEVAL_PROMPT = (
    "You are Sieve Assistant, the research assistant of a public library. The visitor gives you a document and asks "
    "about it: answer from the document alone, in a few sentences, and say so when the document does not tell."
)
QUESTIONS = ["What is this document about?", "Who are the main people or places in this document, and why do they matter?",
             "What happened first, and what happened last, in this document?", "What is the most surprising fact here?",
             "Which numbers or dates in this document matter most, and why?"]


def long_sessions(n: int, seed: int, max_tokens: int, turns: int, docs: list[str]):
    """`n` retrieval conversations of `turns` turns: a document of 2-6k tokens (drawn from `docs`, wikitext-2
    articles) and a question about it, then follow-ups over the same history. Memory binds here: every user holds
    thousands of tokens of KV cache of its own."""
    from sieve.bench.workloads import Session, Turn

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        first = "Here is a document.\n\n" + docs[rng.randrange(len(docs))] + "\n\n" + rng.choice(QUESTIONS)
        asks = [first] + [rng.choice(FOLLOW_UPS) for _ in range(turns - 1)]
        out.append(Session([Turn(a, max_tokens) for a in asks], system=RETRIEVAL_PROMPT, chat=True))
    return out


def long_documents(model: str, tokens: tuple[int, int], n: int = 64, seed: int = 0) -> list[str]:
    """The long workload's documents, of tokens[0] to tokens[1] of `model`'s tokens."""
    from sieve.config import ConfigError
    from sieve.models.loader import open_checkpoint, resolve_model_path
    from sieve.prompts import documents

    tok = open_checkpoint(str(resolve_model_path(model))).tokenizer()
    docs = documents(lambda text: len(tok(text, add_special_tokens=False).input_ids), *tokens, n, seed)
    if not docs:
        raise ConfigError(f"bench ladder: --doc-tokens {tokens[0]},{tokens[1]}: wikitext-2 gives no document of that length")
    return docs


def chat_sessions(n: int, seed: int, max_tokens: int, turns: int = 2, grounded: bool = False):
    """`n` conversations of `turns` turns opening with the shared system prompt; the first question from the
    distillation templates' topics (grounded: a wikitext passage to summarise), then follow-ups."""
    from sieve.bench.workloads import Session, Turn
    from sieve.prompts import TEMPLATES, TOPICS, passages as wikitext_passages

    rng = random.Random(seed)
    passages = wikitext_passages(64) if grounded else []
    out = []
    for i in range(n):
        if grounded:
            first = "Summarise this passage for a visitor.\n\n" + passages[rng.randrange(len(passages))]
        else:
            first = rng.choice(TEMPLATES).format(t=rng.choice(TOPICS))
        asks = [first] + [rng.choice(FOLLOW_UPS) for _ in range(turns - 1)]
        out.append(Session([Turn(a, max_tokens) for a in asks], system=SYSTEM_PROMPT, chat=True))
    return out


# ------------------------------------------------------------------------------------------- one point
async def closed_loop(target, sessions: list, users: int, warmup_s: float, measure_s: float, ramp_s: float,
                      seed: int) -> tuple[list, float]:
    """`users` closed-loop users over `sessions` (taken in turn) until warmup + measure seconds have passed;
    returns the records of the requests sent in the measured window, and that window's length."""
    import httpx

    from sieve.bench.serving import send_turn

    rng = random.Random(seed)
    queue = itertools.cycle(sessions)  # (a point is given more conversations than its users can finish)
    records: list = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(target.timeout_s, connect=30.0)) as client:
        t0 = time.perf_counter()
        start, end = t0 + warmup_s, t0 + warmup_s + measure_s

        async def user(delay: float) -> None:
            await asyncio.sleep(delay)
            while time.perf_counter() < end:
                session = next(queue)
                messages = session.first_messages()
                for k, turn in enumerate(session.turns):
                    if time.perf_counter() >= end:
                        return
                    if k:
                        messages.append({"role": "user", "content": turn.user})
                    rec, answer = await send_turn(client, target, session, turn, messages)
                    if rec.sent >= start or not rec.ok:  # a failure anywhere fails the point
                        records.append(rec)
                    if not rec.ok:
                        return
                    messages.append({"role": "assistant", "content": answer})

        await asyncio.gather(*(user(rng.uniform(0, ramp_s)) for _ in range(users)))
    return records, measure_s


def point_summary(records: list, duration_s: float, slo) -> dict:
    from sieve.bench.serving import within_slo
    from sieve.bench.serving_stats import summarize

    s = summarize(records, duration_s, slo)
    s["within_slo"] = bool(s["completed"]) and within_slo(s, slo)
    s["error_examples"] = sorted({r.error for r in records if r.error})[:3]
    s["mean_output_tokens"] = (sum(r.output_tokens for r in records if r.ok) / s["completed"]) if s["completed"] else 0.0
    s["mean_prompt_tokens"] = s["prompt_tokens"] / s["completed"] if s["completed"] else 0.0
    return s


def compact(users: int, s: dict) -> dict:
    """What the JSON keeps of a point."""
    ms = lambda d, q: None if math.isnan(d[q]) else round(d[q] * 1e3, 2)  # noqa: E731
    return {"users": users, "within_slo": s["within_slo"], "requests": s["requests"], "errors": s["errors"],
            "ttft_p50_ms": ms(s["ttft_s"], "p50"), "ttft_p99_ms": ms(s["ttft_s"], "p99"),
            "tpot_p50_ms": ms(s["tpot_s"], "p50"), "tpot_p99_ms": ms(s["tpot_s"], "p99"),
            "output_tokens_per_s": round(s["output_token_throughput"], 2),
            "mean_prompt_tokens": round(s["mean_prompt_tokens"], 1), "mean_output_tokens": round(s["mean_output_tokens"], 1),
            "prefix_cache_hit_rate": s.get("prefix_cache_hit_rate")}


# ------------------------------------------------------------------------------------------- the rungs
@dataclass
class RungSpec:
    key: str
    name: str
    weights: str  # bf16 | int8 | w8a8 | fp8 | int4 (planner and quality)
    kv: str  # bf16 | fp8
    batching: bool = True
    prefix: bool = False
    spec: bool = False
    lossy: bool = False  # changes the tokens' distribution (quality is measured)
    press: str | None = None  # KV compression, PRESS:RATIO (its quality is `sieve bench compression`'s, not `sieve eval`'s)
    default: bool = True  # measured unless --rungs names the rungs


RUNGS = [
    RungSpec("naive", "naive: one request at a time", "bf16", "bf16", batching=False),
    RungSpec("batching", "continuous batching, paged KV", "bf16", "bf16"),
    RungSpec("prefix", "+ prefix caching", "bf16", "bf16", prefix=True),
    RungSpec("int8", "+ int8 weights", "int8", "bf16", prefix=True, lossy=True),
    # int8 weights against int8 activations (issue 63): an alternative to the int8 rung, compared with it by name
    RungSpec("w8a8", "+ W8A8 (int8 weights and activations)", "w8a8", "bf16", prefix=True, lossy=True, default=False),
    # FP8 weights (a CUDA machine's int8 alternative): compared with the int8 rung by name
    RungSpec("fp8", "+ FP8 weights", "fp8", "bf16", prefix=True, lossy=True, default=False),
    RungSpec("speculative", "+ speculative decoding (n-gram, auto depth)", "int8", "bf16", prefix=True, spec=True),
    RungSpec("kv-fp8", "+ FP8 KV cache", "int8", "fp8", prefix=True, spec=True, lossy=True),
    RungSpec("int4", "+ int4 weights", "int4", "fp8", prefix=True, spec=True, lossy=True),
    # KV compression (issue 65): an alternative to the FP8 KV rung on the long workload, compared with the rung before it
    RungSpec("kv-press", "+ KV compression (SnapKV, half the prompt's positions)", "int8", "bf16", prefix=True, spec=True,
             lossy=True, default=False, press="snapkv:0.5"),
]
SPEC_CONFIG = {"method": "ngram", "num_speculative_tokens": "auto", "max_num_speculative_tokens": 6}


def engine_options(r: RungSpec, native_int4: bool) -> dict:
    """EngineConfig fields of a rung (the bf16 reference: the GGUF file's weights widened to bfloat16)."""
    o: dict = {"dtype": "bfloat16", "enable_prefix_caching": r.prefix}
    if r.weights == "int4" and native_int4:
        pass  # the file's own 4-bit codes
    else:
        o["dequantize"] = True
        if r.weights != "bf16":
            o["quantization"] = r.weights
    if r.kv != "bf16":
        o["kv_cache_dtype"] = r.kv
    if r.press:
        o["kv_compression"] = r.press
    return o


def serve_flags(o: dict) -> list[str]:
    flags = ["--dtype", o["dtype"]]
    if not o["enable_prefix_caching"]:
        flags.append("--no-prefix-caching")
    if o.get("dequantize"):
        flags.append("--dequantize")
    if o.get("quantization"):
        flags += ["--quantization", o["quantization"]]
    if o.get("kv_cache_dtype"):
        flags += ["--kv-cache-dtype", o["kv_cache_dtype"]]
    if o.get("kv_compression"):
        flags += ["--kv-compression", o["kv_compression"]]
    return flags


def weight_bytes(model: str, o: dict) -> int:
    """Bytes of the weights a rung loads (as the engine holds them), from a throwaway engine's linears and
    embedding."""
    import torch

    from sieve.config import EngineConfig
    from sieve.engine import LLMEngine

    e = LLMEngine(EngineConfig(model=model, num_gpu_blocks_override=4, max_model_len=64, max_num_seqs=1,
                               **{k: v for k, v in o.items() if k != "enable_prefix_caching"}))
    model = e.runner.model
    total, seen = 0, set()
    for m in model.modules():  # linears: their format's bytes (a native kernel's packed copy is not a parameter)
        if isinstance(getattr(type(m), "weight_bytes", None), property):
            total += m.weight_bytes
            seen.update(id(t) for t in m.parameters(recurse=False))
            seen.update(id(t) for t in m.buffers(recurse=False))
    for t in itertools.chain(model.parameters(), model.buffers()):  # embedding, norms, whatever else
        if id(t) not in seen and isinstance(t, torch.Tensor):
            seen.add(id(t))
            total += t.numel() * t.element_size()
    q = getattr(model, "quantized_embedding", None)
    total += getattr(q, "nbytes", 0) or 0
    del e
    return total


# ------------------------------------------------------------------------------------------- the planner
def planner_ladder(model: str, device, context: float, output: float, shared_prefix: float, slo_ttft_ms: float,
                   slo_tpot_ms: float, acceptance: float, spec_tokens: int, weight_bytes_by_rung: dict,
                   probes_by_rung: dict | None = None) -> dict:
    """Users the planner predicts for each rung of `weight_bytes_by_rung` on `device` (whose memory is the budget),
    with that rung's measured weight bytes (the planner's own formats differ from a GGUF file's): the roofline alone
    ("users"), and, given the rung's probes, the closed loop calibrated by them ("calibrated": `calibration`)."""
    from sieve.pacing import STEP_SHARE
    from sieve.plan.command import load_shape
    from sieve.plan.roofline import Workload, closed_loop_users, decode_point, max_batch_within_slo, prefill_ms, tpot_ms

    shape = load_shape(model)
    out = {}
    for r in (r for r in RUNGS if r.key in weight_bytes_by_rung):
        w = Workload(weights=r.weights, kv=r.kv, context=int(round(context)), output_tokens=int(round(output)),
                     slo_tpot_ms=slo_tpot_ms, slo_ttft_ms=slo_ttft_ms, spec_tokens=spec_tokens if r.spec else 0,
                     acceptance=acceptance, shared_prefix_tokens=int(round(shared_prefix)) if r.prefix else 0)
        m = dataclasses.replace(shape, weight_bytes_override=weight_bytes_by_rung[r.key])
        if not r.batching:
            p = decode_point(m, device, w, 1)
            users, binding = int(tpot_ms(p, w) <= slo_tpot_ms and prefill_ms(m, device, w) <= slo_ttft_ms), "one at a time"
        else:
            users, binding = max_batch_within_slo(m, device, w)
        out[r.key] = {"users": users, "binding": binding}
        probes = (probes_by_rung or {}).get(r.key)
        if r.batching and probes:
            cal = calibration(m, device, w, probes, STEP_SHARE)
            cal_users, cal_binding = closed_loop_users(m, device, w, cal)
            out[r.key]["calibrated"] = {"users": cal_users, "binding": cal_binding, "calibration": dataclasses.asdict(cal)}
    return out


def calibration(m, device, w, probes: list[dict], step_share: float = 1.0):
    """The closed-loop terms of one rung from its own probes.

    - The new prompt tokens a turn brings: the mean prompt less its prefix-cache hits.
    - Each probe's running batch, by Little's law: output tokens/s x mean TPOT (TPOT p50); the users beyond it
      were waiting in the queue (a paced server admits no more than its TPOT objective allows).
    - The step: each probe's measured mean step (TPOT p50 x the tokens a step gives) less its bytes' time at the
      measured bandwidth, against its FLOPs' time at the peak rate (`step_terms`, at its running batch with that
      prefill load), fitted by least squares (`fit_step`): the slope is the share of the peak a step attains, the
      intercept the step's fixed cost.
    - The share of the TPOT objective the mean step reaches where a queue formed (the pacer holds newcomers there):
      the median TPOT p50 over the objective on the probes whose users exceed their running batch by one or more
      and whose running batch is short of what the KV pool holds by more than one (else memory held them), at most
      `step_share` (what the pacer aims at: `sieve.pacing.STEP_SHARE`). Its prediction of a step counts
      the newcomer's prompt and its own margin, so the steps it lets run come out shorter (~0.75 of the objective
      on the chat ladder, 0.9 aimed at).
    - TPOT p99 over p50, and a queued turn's TTFT p99 over the FIFO queue's mean wait (`queued_users`), each the
      median over the probes (the queue's over those that had one)."""
    import statistics

    from sieve.plan.roofline import Calibration, expected_tokens_per_step, sequences_that_fit, step_terms

    seen = [p for p in probes if p.get("requests") and p.get("tpot_p50_ms") and p.get("tpot_p99_ms")]
    if not seen:
        return Calibration(step_share=step_share)
    hit = statistics.median(p.get("prefix_cache_hit_rate") or 0.0 for p in seen)
    new_tokens = statistics.mean(p["mean_prompt_tokens"] for p in seen) * (1 - hit)
    base = Calibration(prefill_tokens_per_turn=new_tokens)
    per_step = expected_tokens_per_step(w)
    running = {id(p): running_batch(p) for p in seen}
    points = []
    for p in seen:
        batch = max(1, round(running[id(p)]))
        points.append((batch, *step_terms(m, device, w, batch, base), p["tpot_p50_ms"] * per_step))
    fixed, compute_scale = fit_step(points)
    spread = statistics.median(p["tpot_p99_ms"] / p["tpot_p50_ms"] for p in seen)
    waits, held = [], []
    fit = sequences_that_fit(m, device, w)
    for p in seen:
        queued = p["users"] - running[id(p)]
        if queued >= 1 and running[id(p)] < fit - 1:
            held.append(p["tpot_p50_ms"] / w.slo_tpot_ms)
        if queued >= 1 and p.get("ttft_p99_ms") and p.get("mean_output_tokens"):
            mean_wait = queued * p["mean_output_tokens"] * p["tpot_p50_ms"] / running[id(p)]
            waits.append(p["ttft_p99_ms"] / mean_wait)
    queue = statistics.median(waits) if waits else 0.0
    share = min(step_share, statistics.median(held)) if held else step_share
    return Calibration(fixed, compute_scale, spread, new_tokens, share, queue)


def running_batch(p: dict) -> float:
    """A probe's mean running batch by Little's law (output tokens/s x mean TPOT), at most its users; its users
    where the probe has no throughput figure."""
    tps = p.get("output_tokens_per_s")
    if not tps:
        return float(p["users"])
    return min(float(p["users"]), max(1.0, tps * p["tpot_p50_ms"] / 1e3))


def fit_step(points: list[tuple[int, float, float, float]]) -> tuple[float, float]:
    """(fixed ms, compute scale) of measured = bytes' ms + scale x FLOPs' ms + fixed over (running batch, bytes' ms,
    FLOPs' ms, measured ms) points, by least squares, neither below 0. Where the running batches span less than a
    factor of 2 (a rung whose probes all sat near its capacity) the two cannot be told apart: the line goes through
    the origin (all of the step past its bytes is arithmetic)."""
    import statistics

    xs = [c for _, _, c, _ in points]
    ys = [max(0.0, y - b) for _, b, _, y in points]  # what the bytes' time leaves
    through_origin = (sum(ys) / sum(xs) if sum(xs) > 0 else 1.0), 0.0
    batches = [n for n, *_ in points]
    if max(batches) < 2 * min(batches):
        return through_origin[1], through_origin[0]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    scale = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    if scale <= 0 or my - scale * mx < 0:
        return through_origin[1], through_origin[0]
    return my - scale * mx, scale


# ------------------------------------------------------------------------------------------- the command
WORKLOADS = ("chat", "grounded", "long")


def _workloads(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in WORKLOADS]
    if not kinds or bad or len(set(kinds)) != len(kinds):
        raise argparse.ArgumentTypeError(f"expected distinct workloads of {', '.join(WORKLOADS)}, comma-separated; got {text!r}")
    return kinds


def _floats(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, or one per workload (comma-separated), got {text!r}") from None


def _span(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(v) for v in text.split(","))
    except ValueError:
        lo = hi = 0
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX tokens with 0 < MIN <= MAX, got {text!r}")
    return lo, hi


def add_bench_ladder_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--slo-ttft-ms", type=_floats, default="2000", help="one value, or one per workload (comma-separated)")
    p.add_argument("--slo-tpot-ms", type=_floats, default="100", help="100 ms: at least 10 tokens/s per user (or one per workload)")
    p.add_argument("--workload", type=_workloads, default="chat",
                   help="chat: questions under a shared system prompt; grounded: the same, each asking about a passage; "
                        "long: retrieval over a 2-6k-token document of each user's own (wikitext-2 articles), where the KV "
                        "cache binds; several, comma-separated: each ladder in turn, in one JSON and one plot")
    p.add_argument("--doc-tokens", type=_span, default="2000,6000", help="the long workload's documents: MIN,MAX tokens")
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128, help="answer length cap (answers stop at EOS)")
    p.add_argument("--rungs", default=",".join(r.key for r in RUNGS if r.default),
                   help="which rungs to measure (comma list; known: " + ", ".join(r.key for r in RUNGS) + ")")
    p.add_argument("--naive", default="hf", choices=["hf", "sieve"], help="the naive rung: transformers generate, or sieve with --max-num-seqs 1")
    p.add_argument("--memory-gb", type=_floats, default=None,
                   help="device memory budget for weights + KV cache, or one per workload (default: no budget: the KV pool "
                        "is --kv-cache-memory-gb)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=4.0, help="KV pool without --memory-gb")
    p.add_argument("--kv-checkpoint", default=None,
                   help="a `sieve distill --kv fp8` checkpoint: the FP8 KV rungs serve it (its quality is measured too)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of each point before measuring")
    p.add_argument("--measure", type=float, default=30.0, help="seconds each point is measured")
    p.add_argument("--repeats", type=int, default=1,
                   help="measure each rung this many times, a fresh server each: its users are their median (the JSON "
                        "keeps each repeat's capacity and probes)")
    p.add_argument("--ramp", type=float, default=5.0, help="users start at random moments of the first this many seconds")
    p.add_argument("--growth", type=float, default=1.5)
    p.add_argument("--resolution", type=float, default=0.1)
    p.add_argument("--max-users", type=int, default=256)
    p.add_argument("--eval-data", default=None, help="held-out text for the quality columns (default: wikitext-2 from ../shared/data)")
    p.add_argument("--eval-windows", type=int, default=16)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="PNG: measured users per rung beside the planner's")
    p.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder)")
    p.add_argument("--at-users", type=int, default=None, metavar="N",
                   help="no capacity search: each rung of --rungs at N users, the --repeats interleaved (rung by rung, "
                        "then again), so that the machine's drift falls on every rung alike; JSON of the points and "
                        "their medians")
    p.add_argument("--replan", default=None, metavar="RUN.json",
                   help="serve nothing: recompute a ladder run file's planner columns (the roofline's, and the closed loop "
                        "calibrated by its probes) with the bandwidth and FLOP/s the run measured, print it, and write "
                        "--output-json / --plot")


SERVED = "bench"  # the name peers.Server probes readiness with


def _server_cmd(args, model: str, rung: RungSpec, o: dict, port: int, kv_gb: float) -> list[str]:
    if not rung.batching and args.naive == "hf":
        cmd = [sys.executable, "-m", "sieve.bench.naive_server", "--model", model, "--port", str(port),
               "--served-model-name", SERVED, "--dtype", "float32"]
        return cmd + (["--num-threads", str(args.num_threads)] if args.num_threads else [])
    cmd = [sys.executable, "-m", "sieve.cli", "serve", "--model", model, "--port", str(port), "--served-model-name", SERVED,
           "--kv-cache-memory-gb", f"{kv_gb:.4f}", "--max-num-seqs", str(args.max_num_seqs if rung.batching else 1),
           "--max-waiting", "100000", "--no-webui", "--seed", str(args.seed), "--slo-ttft-ms", f"{args.slo_ttft_ms:g}",
           "--slo-tpot-ms", f"{args.slo_tpot_ms:g}"] + serve_flags(o)  # the server's run-time choices serve the ladder's SLO
    if rung.spec:
        cmd += ["--speculative-config", json.dumps(SPEC_CONFIG)]
    return cmd + (["--num-threads", str(args.num_threads)] if args.num_threads else [])


def _prime(target, max_tokens: int) -> None:
    """One chat request under the shared system prompt before the first point: the server's first request pays
    one-off costs (the template's first render, lazily built state) and the steady state has the system prompt
    in the prefix cache."""
    import httpx

    r = httpx.post(target.base_url + "/chat/completions", timeout=600, json={
        "model": target.model, "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Hello! When are you open?"}]})
    r.raise_for_status()


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name) and not line.startswith("#"))


def check_args(args, rungs: list[RungSpec]) -> None:
    """ConfigError for a value the ladder cannot run with, before any server starts."""
    from sieve.config import ConfigError

    positive = {"--slo-ttft-ms": args.slo_ttft_ms, "--slo-tpot-ms": args.slo_tpot_ms, "--measure": args.measure,
                "--turns": args.turns, "--max-tokens": args.max_tokens, "--max-users": args.max_users,
                "--max-num-seqs": args.max_num_seqs, "--repeats": args.repeats, "--eval-windows": args.eval_windows,
                "--kv-cache-memory-gb": args.kv_cache_memory_gb}
    if args.memory_gb is not None:
        positive["--memory-gb"] = args.memory_gb
    bad = [f"{k} must be > 0 (got {v})" for k, v in positive.items() if not v > 0]
    bad += [f"{k} must be >= 0 (got {v})" for k, v in (("--warmup", args.warmup), ("--ramp", args.ramp), ("--resolution", args.resolution)) if not v >= 0]
    if not args.growth > 1:
        bad.append(f"--growth must be > 1 (got {args.growth})")
    if getattr(args, "at_users", None) is not None:
        if args.at_users < 1:
            bad.append(f"--at-users must be >= 1 (got {args.at_users})")
        bad += [f"{flag} belongs to a ladder: --at-users measures rungs at one load" for flag, v in
                (("--plot", args.plot), ("--replan", args.replan)) if v]
    if args.kv_checkpoint:
        if not Path(args.kv_checkpoint).exists():
            bad.append(f"--kv-checkpoint {args.kv_checkpoint}: no such file or folder")
        if not any(r.kv == "fp8" and r.weights != "int4" for r in rungs):
            bad.append("--kv-checkpoint is served by the kv-fp8 rung, which --rungs leaves out")
    if bad:
        raise ConfigError("bench ladder: " + "; ".join(bad))


SET_SCHEMA_ID = "sieve.bench.ladders/1"
FIXED_SCHEMA_ID = "sieve.bench.ladder-at-users/1"


def per_workload(args) -> list[argparse.Namespace]:
    """One namespace per workload of --workload, each with its own --slo-ttft-ms, --slo-tpot-ms and --memory-gb (a
    single value serves every workload)."""
    from sieve.config import ConfigError

    kinds = args.workload if isinstance(args.workload, list) else [args.workload]
    out = []
    for i, kind in enumerate(kinds):
        one = argparse.Namespace(**vars(args))
        one.workload = kind
        for name in ("slo_ttft_ms", "slo_tpot_ms", "memory_gb"):
            values = getattr(args, name)
            if isinstance(values, list):
                if len(values) not in (1, len(kinds)):
                    raise ConfigError(f"bench ladder: --{name.replace('_', '-')} takes one value or one per workload "
                                      f"({len(kinds)}), got {len(values)}")
                setattr(one, name, values[i] if len(values) > 1 else values[0])
        out.append(one)
    return out


def run_ladder(args) -> dict:
    """The ladder of each workload of --workload in turn; the JSON and the plot hold them all (one workload: its
    ladder as it is; several: {"schema": SET_SCHEMA_ID, "ladders": [...]})."""
    if args.at_users:
        out = fixed_load(per_workload(args)[0])
        if args.output_json:
            Path(args.output_json).write_text(json.dumps(out, indent=2))
        return out
    ladders = replan(args.replan) if args.replan else [ladder_of(one) for one in per_workload(args)]
    out = ladders[0] if len(ladders) == 1 else {"schema": SET_SCHEMA_ID, "ladders": ladders}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(out, indent=2))
    if args.plot:
        plot_ladder(ladders, args.plot)
    return out


def replan(path: str) -> list[dict]:
    """The ladders of a run file with their planner columns computed again (by this version of the planner), from what
    the run measured: the machine's bandwidth and FLOP/s (this machine's, measured now, where the file has none and
    no memory budget), each rung's weights, probes and acceptance."""
    from sieve.config import ConfigError

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"bench ladder: --replan {path}: {e}") from None
    ladders = data["ladders"] if data.get("schema") == SET_SCHEMA_ID else [data]
    for out in ladders:
        validate_ladder(out)
        wl = out["workload"]
        args = argparse.Namespace(memory_gb=out["memory_gb"], slo_ttft_ms=out["slo"]["ttft_p99_ms"], slo_tpot_ms=out["slo"]["tpot_p99_ms"],
                                  workload=wl["kind"], turns=wl["turns"], max_tokens=wl["max_tokens"], warmup=wl["warmup_s"],
                                  measure=wl["measure_s"], ramp=wl["ramp_s"], doc_tokens=wl.get("doc_tokens"))
        results = out["rungs"]
        acceptance = next((r["spec_acceptance_rate"] for r in results if r.get("spec_acceptance_rate") is not None), None)
        means = {"prompt": [wl["mean_prompt_tokens"]], "output": [wl["mean_output_tokens"]]}
        _, out["workload"] = add_planner(args, out["model"], results, {r["key"]: r["weight_bytes"] for r in results}, means,
                                         acceptance, recorded_device(out))
        validate_ladder(out)
        print_ladder(out)
    return ladders


def recorded_device(out: dict):
    """The CPU a run file's ladder measured (its bandwidth and FLOP/s), where it has them and a memory budget, so
    that --replan calibrates the planner by the run's own measurements; else None (measure this machine now)."""
    from sieve.plan.devices import Device

    mach = out.get("machine") or {}
    if not (out.get("memory_gb") and mach.get("bandwidth_gbps") and mach.get("tflops")):
        return None
    return Device("cpu", out["memory_gb"], mach["bandwidth_gbps"], dict(mach["tflops"]), "recorded by the run")


def ladder_of(args) -> dict:
    """Every rung measured in turn (a fresh server each), then each lossy rung's quality and the planner's figures."""
    from sieve.bench.serve_command import quiet_http_logs
    from sieve.bench.serving_stats import SLO
    from sieve.models.default import resolve_default

    quiet_http_logs()
    model, _ = resolve_default(args.model)
    rungs = select_rungs(args)
    native_int4 = model.endswith(".gguf")
    slo = SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="sieve-ladder-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"bench ladder: {model}; SLO TTFT p99 <= {args.slo_ttft_ms:g} ms, TPOT p99 <= {args.slo_tpot_ms:g} ms; "
          f"{args.workload} workload ({args.turns} turns, answers up to {args.max_tokens} tokens); "
          f"memory budget {args.memory_gb if args.memory_gb else 'none'} GB; naive = {args.naive}", flush=True)
    options = {r.key: engine_options(r, native_int4) for r in RUNGS}
    loaded: dict = {}  # rungs that load the same weights are measured once
    for r in rungs:
        o = options[r.key]
        loaded.setdefault((o.get("dequantize"), o.get("quantization")), weight_bytes(model, o))
    wbytes = {r.key: loaded[(options[r.key].get("dequantize"), options[r.key].get("quantization"))] for r in rungs}
    args.docs = long_documents(model, args.doc_tokens, seed=args.seed) if args.workload == "long" else None
    results, previous_users, acceptance = [], 1, None
    means = {"prompt": [], "output": []}
    for i, rung in enumerate(rungs):
        res = measure_rung(args, model, rung, i, options[rung.key], wbytes[rung.key], previous_users, log_dir, slo, means)
        if rung.spec and res["spec_acceptance_rate"] is not None:
            acceptance = res["spec_acceptance_rate"]
        results.append(res)
        previous_users = max(int(res["users"]), 1)
    eval_data = add_quality(args, model, options, results)
    dev, workload = add_planner(args, model, results, wbytes, means, acceptance)
    out = {"schema": SCHEMA_ID, "model": model, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                       "cpus": os.cpu_count(), "threads": args.num_threads, "bandwidth_gbps": dev.bandwidth_gbps,
                       "tflops": dev.tflops},
           "slo": {"ttft_p99_ms": args.slo_ttft_ms, "tpot_p99_ms": args.slo_tpot_ms}, "workload": workload,
           "memory_gb": args.memory_gb, "naive": args.naive, "kv_checkpoint": args.kv_checkpoint,
           "eval_data": str(eval_data), "rungs": results}
    validate_ladder(out)
    print_ladder(out)
    return out


def select_rungs(args) -> list:
    from sieve.config import ConfigError

    keys = [k.strip() for k in args.rungs.split(",") if k.strip()]
    unknown = sorted(set(keys) - {r.key for r in RUNGS})
    if unknown:
        raise ConfigError(f"--rungs: unknown {', '.join(unknown)} (known: {', '.join(r.key for r in RUNGS)})")
    rungs = [r for r in RUNGS if r.key in keys]
    check_args(args, rungs)
    return rungs


def measure_rung(args, model: str, rung, i: int, o: dict, wbytes: int, previous_users: int, log_dir: Path, slo, means: dict) -> dict:
    """The most users `rung` keeps within the SLO, measured `--repeats` times (a fresh server each, the probes'
    mean prompt and answer go into `means`): `users` is the repeats' median, and with more than one repeat,
    `repeats` holds each one's capacity and probes."""
    import statistics

    served_model, kv_gb = served_and_pool(args, model, rung, wbytes)
    t_rung = time.perf_counter()
    start = 1 if not rung.batching else max(1, previous_users)
    runs = []
    for rep in range(args.repeats):
        run, cmd = measure_once(args, served_model, rung, i, rep, o, kv_gb, start, log_dir, slo)
        runs.append(run)
        start = max(1, run["users"]) if rung.batching else 1  # a repeat's search starts at the first one's capacity
    for p in (p for run in runs for p in run["probes"]):
        if p["requests"]:
            means["prompt"].append(p["mean_prompt_tokens"])
            means["output"].append(p["mean_output_tokens"])
    users = median_users([run["users"] for run in runs])
    rates = [run["spec_acceptance_rate"] for run in runs if run["spec_acceptance_rate"] is not None]
    print(f"{rung.name}: {users:g} users" + (f" (median of {', '.join(str(r['users']) for r in runs)})" if len(runs) > 1 else "")
          + f" ({time.perf_counter() - t_rung:.0f} s)", flush=True)
    closest = min(runs, key=lambda run: abs(run["users"] - users))
    return {"key": rung.key, "name": rung.name, "server": cmd[2:], "weights": rung.weights, "kv": rung.kv,
            "weight_bytes": wbytes, "kv_pool_gb": round(kv_gb, 4), "users": users,
            "at_capacity": closest["at_capacity"], "probes": [p for run in runs for p in run["probes"]],
            "seconds": round(time.perf_counter() - t_rung, 1),
            "spec_acceptance_rate": statistics.mean(rates) if rung.spec and rates else None,
            "served_model": served_model, **({"repeats": runs} if len(runs) > 1 else {})}


def served_and_pool(args, model: str, rung, wbytes: int) -> tuple[str, float]:
    """The checkpoint a rung serves (the --kv-checkpoint for the FP8 KV rung) and its KV pool in GiB: the memory
    budget less its weights, or --kv-cache-memory-gb without one."""
    from sieve.config import ConfigError

    served_model = args.kv_checkpoint if (args.kv_checkpoint and rung.kv == "fp8" and rung.weights != "int4") else model
    if not args.memory_gb:
        return served_model, args.kv_cache_memory_gb
    kv_gb = (args.memory_gb * 1e9 - wbytes) / 2**30
    if kv_gb <= 0:
        raise ConfigError(f"--memory-gb {args.memory_gb}: the {rung.key} rung's weights alone take {wbytes / 1e9:.2f} GB")
    return served_model, kv_gb


def fixed_load(args) -> dict:
    """--at-users N: each rung of --rungs at N users, no capacity search, the --repeats interleaved (every rung once,
    then every rung again...), a fresh server each point. Two rungs measured minutes apart differ by the shared
    machine's drift as well as by themselves; interleaved at one load, the drift falls on both alike."""
    import statistics

    from sieve.bench.serve_command import quiet_http_logs
    from sieve.bench.serving_stats import SLO
    from sieve.models.default import resolve_default

    quiet_http_logs()
    model, _ = resolve_default(args.model)
    rungs = [r for r in select_rungs(args) if r.batching]
    native_int4 = model.endswith(".gguf")
    slo = SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="sieve-ladder-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    options = {r.key: engine_options(r, native_int4) for r in rungs}
    print(f"bench ladder: {model}; {', '.join(r.key for r in rungs)} at {args.at_users} users, {args.repeats} repeats "
          f"interleaved; {args.workload} workload", flush=True)
    points = []
    for rep in range(args.repeats):
        for i, rung in enumerate(rungs):
            served, kv_gb = served_and_pool(args, model, rung, weight_bytes(model, options[rung.key]) if args.memory_gb else 0)
            run, cmd = measure_once(args, served, rung, i, rep, options[rung.key], kv_gb, args.at_users, log_dir, slo, search=False)
            points.append({"key": rung.key, "repeat": rep, "server": cmd[2:], "spec_acceptance_rate": run["spec_acceptance_rate"],
                           "spec_draft_tokens": run.get("spec_draft_tokens"), **run["probes"][0]})
    summary = {}
    for rung in rungs:
        mine = [p for p in points if p["key"] == rung.key]
        summary[rung.key] = {"within_slo": sum(p["within_slo"] for p in mine), "repeats": len(mine),
                             **{f"{k}_median": statistics.median(p[k] for p in mine)
                                for k in ("output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms")}}
        print(f"{rung.key:>12}: within the SLO {summary[rung.key]['within_slo']} of {len(mine)}; median "
              f"{summary[rung.key]['output_tokens_per_s_median']:.0f} tok/s, TTFT p99 {summary[rung.key]['ttft_p99_ms_median']:.0f} ms, "
              f"TPOT p99 {summary[rung.key]['tpot_p99_ms_median']:.1f} ms", flush=True)
    return {"schema": FIXED_SCHEMA_ID, "model": model, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                        "cpus": os.cpu_count(), "threads": args.num_threads},
            "slo": {"ttft_p99_ms": args.slo_ttft_ms, "tpot_p99_ms": args.slo_tpot_ms}, "workload": args.workload,
            "memory_gb": args.memory_gb, "at_users": args.at_users, "points": points, "summary": summary}


def median_users(values: list[int]) -> int | float:
    """The median of the repeats' capacities: an int where it is one (an odd count, or two equal middles), else the
    midpoint (x.5)."""
    import statistics

    m = statistics.median(values)
    return int(m) if float(m).is_integer() else float(m)


def measure_once(args, served_model: str, rung, i: int, rep: int, o: dict, kv_gb: float, start: int, log_dir: Path, slo,
                 search: bool = True):
    """One repeat of a rung: a fresh server, probed with closed-loop users from `start` (without `search`, at `start`
    alone). Returns its capacity, its probes' summaries, and the server's command."""
    import httpx

    from sieve.bench.llama_cpp import Server, free_port
    from sieve.bench.serving import Target

    port = free_port()
    cmd = _server_cmd(args, served_model, rung, o, port, kv_gb)
    probes: list[Probe] = []
    t_run = time.perf_counter()
    log = log_dir / (f"{i}-{rung.key}.log" if rep == 0 else f"{i}-{rung.key}-{rep}.log")
    with Server(cmd, port, log, timeout=600) as server:
        target = Target(server.base_url, SERVED, ignore_eos=False, timeout_s=600.0)
        _prime(target, args.max_tokens)

        def probe(users: int) -> Probe:
            seed = args.seed + 7919 * (len(probes) + 1) + 104729 * i + 15485863 * rep
            p = probe_users(args, target, rung, users, seed, slo)
            probes.append(p)
            return p

        if search:
            users, _ = find_capacity(probe, start=start, growth=args.growth, max_users=args.max_users, resolution=args.resolution)
        else:
            users = start if probe(start).within_slo else 0
        metrics = httpx.get(server.base_url.removesuffix("/v1") + "/metrics", timeout=30).text if rung.batching or args.naive == "sieve" else ""
    acceptance = drafted = None
    if rung.spec and metrics:
        drafted = _metric(metrics, "sieve:spec_decode_num_draft_tokens_total")
        accepted = _metric(metrics, "sieve:spec_decode_num_accepted_tokens_total")
        acceptance = accepted / drafted if drafted else 0.0
    run = {"users": users, "at_capacity": next((p.summary for p in probes if p.users == users), None),
           "probes": [p.summary for p in probes], "seconds": round(time.perf_counter() - t_run, 1),
           "spec_acceptance_rate": acceptance, "spec_draft_tokens": drafted}
    return run, cmd


def probe_users(args, target, rung, users: int, seed: int, slo) -> Probe:
    """`users` closed-loop chat users against the rung's server: within the SLO or not, and the point's summary."""
    if args.workload == "long":
        sessions = long_sessions(users * 8 + 16, seed, args.max_tokens, args.turns, args.docs)
    else:
        sessions = chat_sessions(users * 60 + 64, seed, args.max_tokens, args.turns, args.workload == "grounded")
    records, dur = asyncio.run(closed_loop(target, sessions, users, args.warmup, args.measure, args.ramp, seed))
    s = point_summary(records, dur, slo)
    c = compact(users, s)
    print(f"  {rung.key:>12} {users:>4} users: {'within SLO' if c['within_slo'] else 'misses SLO':<10} "
          f"TTFT p99 {c['ttft_p99_ms']} ms, TPOT p99 {c['tpot_p99_ms']} ms, {c['output_tokens_per_s']:.0f} tok/s, "
          f"{c['requests']} requests" + (f", {c['errors']} errors: {s['error_examples'][0]}" if c["errors"] else ""),
          flush=True)
    return Probe(users, c["within_slo"], c)


def add_quality(args, model: str, options: dict, results: list[dict]) -> Path:
    """Each lossy rung's quality: `sieve eval` against the bf16 model on held-out text. Returns the text's path."""
    from sieve.data import shared_data
    from sieve.evaluate import evaluate

    eval_data = Path(args.eval_data) if args.eval_data else shared_data("wikitext2_test.txt")
    ref = {"reference": model, "reference_dtype": "bfloat16", "reference_dequantize": True}
    for res in results:
        rung = next(r for r in RUNGS if r.key == res["key"])
        if not rung.lossy or rung.press:  # (a press does not change how a prompt is scored: sieve bench compression)
            res["quality"] = None
            continue
        o = {k: v for k, v in options[rung.key].items() if k not in ("enable_prefix_caching", "dtype")}
        q = evaluate(res["served_model"], eval_data, dtype="bfloat16", window=256, max_windows=args.eval_windows, **ref, **o)
        res["quality"] = {"kl_divergence": q["kl_divergence"], "top1_agreement": q["top1_agreement"],
                          "perplexity": q["perplexity"], "reference_perplexity": q["reference_perplexity"],
                          "tokens_scored": q["tokens_scored"]}
        print(f"quality of {rung.key}: KL {q['kl_divergence']:.4f}, top-1 {q['top1_agreement']:.3f}", flush=True)
    return eval_data


def add_planner(args, model: str, results: list[dict], wbytes: dict, means: dict, acceptance: float | None, device=None):
    """The planner's users for the same rungs on this CPU (`device`, else measured now) with the memory budget, at
    the measured mean prompt and answer, and each rung's factors against the first. Returns the device and the
    workload's summary."""
    from sieve.plan.devices import measure_cpu
    from sieve.plan.roofline import MEMORY_UTILIZATION

    dev = device or measure_cpu()
    if args.memory_gb:
        dev = dataclasses.replace(dev, memory_gb=args.memory_gb / MEMORY_UTILIZATION)
    prompt_mean = sum(means["prompt"]) / len(means["prompt"]) if means["prompt"] else 300.0
    output_mean = sum(means["output"]) / len(means["output"]) if means["output"] else args.max_tokens
    prefix_tokens = _system_tokens(model, RETRIEVAL_PROMPT if args.workload == "long" else SYSTEM_PROMPT)
    plan = planner_ladder(model, dev, prompt_mean + output_mean / 2, output_mean, prefix_tokens, args.slo_ttft_ms,
                          args.slo_tpot_ms, acceptance if acceptance is not None else 0.0, SPEC_CONFIG["max_num_speculative_tokens"] // 2,
                          wbytes, {r["key"]: r["probes"] for r in results})
    base_key = "naive" if "naive" in plan else results[0]["key"]  # the factors' base: naive, else the first rung
    base = next(r["users"] for r in results if r["key"] == base_key) or 1
    pbase = plan[base_key]["users"] or 1
    prev = prev_p = None
    for res in results:
        res["factor"] = res["users"] / base
        res["gain"] = (res["users"] / prev) if prev else None
        pu = plan[res["key"]]["users"]
        res["planner"] = {"users": pu, "factor": pu / pbase, "gain": (pu / prev_p) if prev_p else None,
                          "binding": plan[res["key"]]["binding"], "calibrated": plan[res["key"]].get("calibrated")}
        prev, prev_p = max(res["users"], 1), max(pu, 1)
    workload = {"kind": args.workload, "turns": args.turns, "max_tokens": args.max_tokens, "system_prompt_tokens": prefix_tokens,
                "doc_tokens": list(args.doc_tokens) if args.workload == "long" else None,
                "mean_prompt_tokens": prompt_mean, "mean_output_tokens": output_mean, "warmup_s": args.warmup,
                "measure_s": args.measure, "ramp_s": args.ramp}
    return dev, workload


def _system_tokens(model: str, prompt: str) -> int:
    from sieve.models.loader import open_checkpoint, resolve_model_path

    tok = open_checkpoint(str(resolve_model_path(model))).tokenizer()
    return len(tok(prompt, add_special_tokens=False).input_ids)


def print_ladder(out: dict) -> None:
    print(f"\nusers within TTFT p99 <= {out['slo']['ttft_p99_ms']:g} ms and TPOT p99 <= {out['slo']['tpot_p99_ms']:g} ms "
          f"({out['model']}, memory budget {out['memory_gb'] or 'none'} GB):")
    print(f"  {'rung':<46}{'users':>6}{'x naive':>9}{'gain':>7}{'planner':>9}{'p. gain':>9}{'calibr.':>9}  {'KL':>8}{'top-1':>7}")
    for r in out["rungs"]:
        q = r["quality"]
        gain = f"{r['gain']:.2f}" if r["gain"] else "-"
        pgain = f"{r['planner']['gain']:.2f}" if r["planner"]["gain"] else "-"
        cal = r["planner"].get("calibrated")
        qual = f"{q['kl_divergence']:>8.4f}{q['top1_agreement']:>7.3f}" if q else f"{'lossless':>15}"
        print(f"  {r['name']:<46}{r['users']:>6g}{r['factor']:>9.1f}{gain:>7}{r['planner']['users']:>9}{pgain:>9}"
              f"{cal['users'] if cal else '-':>9}  {qual}")


LADDER_SCHEMA = {
    "type": "object",
    "required": ["schema", "model", "machine", "slo", "workload", "memory_gb", "naive", "rungs"],
    "properties": {
        "schema": {"const": SCHEMA_ID},
        "model": {"type": "string"},
        "slo": {"type": "object", "required": ["ttft_p99_ms", "tpot_p99_ms"],
                "properties": {"ttft_p99_ms": {"type": "number", "exclusiveMinimum": 0}, "tpot_p99_ms": {"type": "number", "exclusiveMinimum": 0}}},
        "memory_gb": {"type": ["number", "null"]},
        "naive": {"enum": ["hf", "sieve"]},
        "rungs": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "required": ["key", "name", "users", "factor", "gain", "planner", "quality", "probes", "weights", "kv"],
            "properties": {
                "key": {"enum": [r.key for r in RUNGS]},
                "users": {"type": "number", "minimum": 0},
                "factor": {"type": "number", "minimum": 0},
                "gain": {"type": ["number", "null"]},
                "planner": {"type": "object", "required": ["users", "factor", "gain", "binding"],
                            "properties": {"users": {"type": "integer", "minimum": 0}}},
                "quality": {"oneOf": [{"type": "null"}, {"type": "object",
                                                           "required": ["kl_divergence", "top1_agreement", "perplexity"],
                                                           "properties": {"kl_divergence": {"type": "number", "minimum": 0},
                                                                          "top1_agreement": {"type": "number", "minimum": 0, "maximum": 1}}}]},
                "probes": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["users", "within_slo", "ttft_p99_ms", "tpot_p99_ms", "output_tokens_per_s"]}},
            }}},
    },
}


def validate_ladder(out: dict) -> None:
    """Raises ValueError naming the first place the ladder's JSON departs from LADDER_SCHEMA, or where a rung's
    users disagree with its own probes (the capacity passed, every larger probe failed)."""
    import jsonschema

    try:
        jsonschema.validate(out, LADDER_SCHEMA)
    except jsonschema.ValidationError as e:
        raise ValueError(f"ladder JSON: {'/'.join(map(str, e.absolute_path))}: {e.message}") from None
    for r in out["rungs"]:
        runs = r.get("repeats") or [r]
        if r.get("repeats") and r["users"] != median_users([run["users"] for run in runs]):
            raise ValueError(f"ladder JSON: rung {r['key']}: users {r['users']} is not the median of its repeats")
        for run in runs:
            passed = {p["users"] for p in run["probes"] if p["within_slo"]}
            failed = {p["users"] for p in run["probes"] if not p["within_slo"]}
            if run["users"] and run["users"] not in passed:
                raise ValueError(f"ladder JSON: rung {r['key']}: capacity {run['users']} was never probed within the SLO")
            if any(u <= run["users"] for u in failed):
                raise ValueError(f"ladder JSON: rung {r['key']}: a probe at or below the capacity {run['users']} failed")


def plot_ladder(ladders: list[dict], path: str) -> None:
    """One panel per workload: measured users per rung beside the planner's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ladders), figsize=(10 * len(ladders), 5), squeeze=False)
    for ax, out in zip(axes[0], ladders):
        _plot_one(ax, out)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _plot_one(ax, out: dict) -> None:
    rungs = out["rungs"]
    x = range(len(rungs))
    ax.bar([i - 0.27 for i in x], [r["users"] for r in rungs], width=0.27, label="measured (sieve bench ladder)")
    ax.bar(list(x), [r["planner"]["users"] for r in rungs], width=0.27, alpha=0.6, label="planner (roofline)")
    calibrated = [(r["planner"].get("calibrated") or {}).get("users", 0) for r in rungs]
    ax.bar([i + 0.27 for i in x], calibrated, width=0.27, alpha=0.6, label="planner (closed loop, calibrated)")
    for i, r in enumerate(rungs):
        label = f"{r['users']:g}" + (f" ({', '.join(str(run['users']) for run in r['repeats'])})" if r.get("repeats") else "")
        if r["quality"]:
            label += f"\nKL {r['quality']['kl_divergence']:.3f}"
        ax.annotate(label, (i - 0.27, r["users"]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x))
    ax.set_xticklabels([r["key"] for r in rungs])
    ax.set_ylabel("users within the SLO")
    ax.set_title(f"{out['workload']['kind']} workload, {Path(out['model']).name}: TTFT p99 <= {out['slo']['ttft_p99_ms']:g} ms, "
                 f"TPOT p99 <= {out['slo']['tpot_p99_ms']:g} ms" + (f", {out['memory_gb']:g} GB" if out["memory_gb"] else ""), fontsize=10)
    ax.legend()
