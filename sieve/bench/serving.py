"""`sieve bench serve`: drive any OpenAI-compatible endpoint with a workload and measure it.

Each simulated user runs one session (see `workloads`): its turns go out one after another over a
streaming request, and every chunk that carries text is timestamped on arrival. Load is either a
fixed number of users at once (`--concurrency`) or sessions starting as a Poisson process at a rate
(`--request-rate`); a comma list of either sweeps the load in one call. The arithmetic (TTFT, TPOT,
ITL, E2E, percentiles, goodput) lives in `serving_stats`.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass

import httpx

from sieve.bench.serving_stats import SLO, RequestRecord, summarize
from sieve.bench.workloads import Session, Turn


@dataclass
class Target:
    base_url: str  # e.g. http://127.0.0.1:8000/v1
    model: str
    api_key: str | None = None
    ignore_eos: bool = True  # every request produces exactly max_tokens, so engines do equal work
    timeout_s: float = 600.0
    queue_eta: bool = False  # ask sieve for its expected wait (stream_options.include_queue) and score it


@dataclass
class Load:
    concurrency: int | None = None  # users at once
    request_rate: float | None = None  # sessions started per second (Poisson)

    @property
    def label(self) -> str:
        return f"concurrency {self.concurrency}" if self.concurrency is not None else f"rate {self.request_rate:g}/s"


def _content(choice: dict) -> str:
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


def carries_output(choice: dict) -> bool:
    """Whether a streamed choice stands for generated tokens: it has text, or it is an empty chunk that
    is neither the chat role opener nor a bare closing chunk (a token whose text is held back, or a
    special token that decodes to nothing, still took a step)."""
    if _content(choice):
        return True
    return choice.get("finish_reason") is None and "role" not in choice.get("delta", {})


async def send_turn(client: httpx.AsyncClient, target: Target, session: Session, turn: Turn,
                    messages: list[dict] | None) -> tuple[RequestRecord, str]:
    """One streaming request; returns its record and the text it produced."""
    body: dict = {"model": target.model, "max_tokens": turn.max_tokens, "stream": True, "temperature": 0,
                  "stream_options": {"include_usage": True}}
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.queue_eta:
        body["stream_options"]["include_queue"] = True
    if session.chat:
        url, body["messages"] = "/chat/completions", messages
    else:
        url, body["prompt"] = "/completions", session.completion_prompt(turn)
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    rec = RequestRecord(sent=time.perf_counter())
    pieces: list[str] = []
    try:
        async with client.stream("POST", target.base_url.rstrip("/") + url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                rec.ok, rec.error = False, f"HTTP {resp.status_code}: {detail}"
                return rec, ""
            async for line in resp.aiter_lines():
                if line.startswith(": queue ") and "queue-eta-ms=" in line and rec.queue_eta_ms is None:
                    rec.queue_eta_ms = float(line.split("queue-eta-ms=")[1].split()[0])  # as it queued (the first)
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                obj = json.loads(payload)
                if "error" in obj:
                    rec.ok, rec.error = False, str(obj["error"])[:300]
                    return rec, ""
                choices = obj.get("choices") or []
                if any(carries_output(c) for c in choices):
                    rec.chunk_times.append(time.perf_counter())
                    rec.chunk_tokens.append(1)
                    pieces.append("".join(_content(c) for c in choices))
                if (obj.get("metrics") or {}).get("queue_ms") is not None:
                    rec.queue_ms = obj["metrics"]["queue_ms"]
                usage = obj.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
                    rec.reported_output_tokens = usage.get("completion_tokens", rec.reported_output_tokens)
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        rec.cached_tokens = details["cached_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.ok, rec.error = False, f"{type(e).__name__}: {e}"[:300]
        return rec, ""
    if not rec.chunk_times:
        rec.ok, rec.error = False, "no output arrived"
    return rec, "".join(pieces)


async def run_session(client: httpx.AsyncClient, target: Target, index: int, session: Session, records: list,
                      on_done) -> None:
    messages = session.first_messages() if session.chat else None
    for k, turn in enumerate(session.turns):
        if k and session.chat:
            messages.append({"role": "user", "content": turn.user})
        rec, answer = await send_turn(client, target, session, turn, messages)
        rec.session, rec.turn = index, k
        records.append(rec)
        on_done()
        if not rec.ok:  # the rest of this conversation cannot be sent: count each as failed
            for j in range(k + 1, len(session.turns)):
                records.append(RequestRecord(sent=rec.sent, ok=False, error="not sent: an earlier turn failed",
                                             session=index, turn=j))
                on_done()
            return
        if session.chat:
            messages.append({"role": "assistant", "content": answer})


async def run_load(target: Target, sessions: list[Session], load: Load, seed: int = 0,
                   progress: bool = True) -> tuple[list[RequestRecord], float]:
    """Run every session under `load`; returns the request records and the wall time of the run."""
    from tqdm import tqdm

    total = sum(len(s.turns) for s in sessions)
    bar = tqdm(total=total, desc=load.label, unit="req", disable=not progress, leave=False)
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(target.timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        start = time.perf_counter()
        if load.concurrency is not None:
            queue = list(reversed(list(enumerate(sessions))))

            async def user() -> None:
                while queue:
                    await run_session(client, target, *queue.pop(), records, bar.update)

            await asyncio.gather(*(user() for _ in range(max(1, min(load.concurrency, len(sessions))))))
        else:
            rng = random.Random(seed)
            tasks = []
            for i, s in enumerate(sessions):
                if i and math.isfinite(load.request_rate):
                    await asyncio.sleep(rng.expovariate(load.request_rate))
                tasks.append(asyncio.create_task(run_session(client, target, i, s, records, bar.update)))
            await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return records, duration


def within_slo(summary: dict, slo: SLO) -> bool:
    """A load point is within the SLO when nothing failed and the p99s meet both objectives."""
    if summary["errors"] or not summary["completed"]:
        return False
    if slo.ttft_s is not None and not summary["ttft_s"]["p99"] <= slo.ttft_s:
        return False
    tpot99 = summary["tpot_s"]["p99"]
    return slo.tpot_s is None or math.isnan(tpot99) or tpot99 <= slo.tpot_s


def sweep(target: Target, sessions: list[list[Session]], loads: list[Load], slo: SLO, floor_step_s: float | None = None,
          seed: int = 0, progress: bool = True, log=print, sessions_per_user: int | None = None) -> dict:
    """Every load point in turn, point i on `sessions[i]` (each point its own prompts, so no point
    finds the previous one's prompts in a server's prefix cache; with `sessions_per_user`, a
    concurrency-c point runs only the first c x that many, so light loads do not take hours).
    `floor_step_s` (weight bytes / bandwidth) adds each point's fraction of the floor: floor step
    time / TPOT p50."""
    runs = []
    for load, point_sessions in zip(loads, sessions, strict=True):
        todo = point_sessions
        if sessions_per_user and load.concurrency is not None:
            todo = point_sessions[: load.concurrency * sessions_per_user]
        records, duration = asyncio.run(run_load(target, todo, load, seed=seed, progress=progress))
        s = summarize(records, duration, slo)
        s.update({k: v for k, v in asdict(load).items() if v is not None})
        s["within_slo"] = within_slo(s, slo)
        s["error_examples"] = sorted({r.error for r in records if r.error})[:3]
        if floor_step_s is not None:
            s["tpot_floor_fraction"] = floor_step_s / s["tpot_s"]["p50"] if s["tpot_s"]["p50"] > 0 else math.nan
        runs.append(s)
        log(format_run(s))
    ok = [r for r in runs if r["within_slo"]]
    key = "concurrency" if loads[0].concurrency is not None else "request_rate"
    return {"runs": runs, f"max_{key}_within_slo": max((r[key] for r in ok), default=None)}


def format_run(s: dict) -> str:
    ms = lambda d: f"{d['p50'] * 1e3:.0f}/{d['p90'] * 1e3:.0f}/{d['p99'] * 1e3:.0f}"  # noqa: E731
    load = f"c={s['concurrency']}" if "concurrency" in s else f"rate={s['request_rate']:g}/s"
    line = (f"{load:>10}: {s['completed']}/{s['requests']} ok in {s['duration_s']:.1f}s | "
            f"{s['request_throughput']:.2f} req/s, {s['output_token_throughput']:.1f} out tok/s | "
            f"TTFT p50/90/99 {ms(s['ttft_s'])} ms | TPOT {ms(s['tpot_s'])} ms | ITL {ms(s['itl_s'])} ms | "
            f"E2E p50 {s['e2e_s']['p50']:.2f}s | goodput {s['goodput']:.2f} req/s"
            + (" | within SLO" if s["within_slo"] else ""))
    if s.get("prefix_cache_hit_rate") is not None:
        line += f" | prefix-cache hits {s['prefix_cache_hit_rate']:.0%} of prompt tokens"
    e, q = s.get("queue_eta_error_s"), s.get("queue_s")
    if e and e["p50"] == e["p50"]:  # (NaN where the server told no estimate)
        line += (f" | queue p50/p90 {q['p50'] * 1e3:.0f}/{q['p90'] * 1e3:.0f} ms, its estimate off by p50/p90 "
                 f"{e['p50'] * 1e3:.0f}/{e['p90'] * 1e3:.0f} ms")
    if "tpot_floor_fraction" in s:
        line += f" | {s['tpot_floor_fraction']:.0%} of floor"
    if s["errors"]:
        line += f" | {s['errors']} errors, e.g. {s['error_examples'][0]}"
    return line


def parse_loads(concurrency: str | None, request_rate: str | None) -> list[Load]:
    if (concurrency is None) == (request_rate is None):
        raise ValueError("give exactly one of --concurrency and --request-rate (each may be a comma list)")
    if concurrency is not None:
        values = [int(v) for v in concurrency.split(",")]
        if min(values) < 1:
            raise ValueError("--concurrency values must be >= 1")
        return [Load(concurrency=v) for v in values]
    rates = [float(v) for v in request_rate.split(",")]
    if min(rates) <= 0:
        raise ValueError("--request-rate values must be > 0 (inf: all at once)")
    return [Load(request_rate=v) for v in rates]
