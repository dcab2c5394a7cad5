"""`sieve router eval`: what each policy buys on your pair and your task.

1. Every task goes to both backends once (greedy, the weak one with top-20 logprobs), and is scored.
2. From those answers, quality against the share of strong calls, per policy, with no further calls:
   - cascade (mean, min, entropy): every threshold; the weak answer stands when confident enough;
   - learned: cross-fitted on the task (two folds: fit on one, route the other), labels "strong" where only
     the strong backend was right; and the calibration check: the share it was asked for against the share
     it routed on the held-out fold;
   - random (the straight line between the two) and the oracle.
   Cost counts completion tokens times each backend's cost_per_token; a cascade pays the weak answer always.
3. Budgets (the tasks marked `"budget": true`, else every `budget_every`-th task; one request at a time): the budget backend with no budget, then under route:budget (cap) at each reasoning_effort, and
   the prompt form: tokens generated and accuracy kept.
4. The response cache: the same deterministic requests twice through a gateway started here; latency of a
   miss against a hit.
It prints the tables, and writes JSON and a plot."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import statistics
import time
from pathlib import Path

import httpx

from sieve.router import policy as P
from sieve.router.config import Backend, RouterConfig
from sieve.router.tasks import is_correct


async def _ask(client: httpx.AsyncClient, backend: Backend, body: dict) -> dict:
    body = dict(body, model=backend.upstream_model)
    headers = {"Authorization": f"Bearer {backend.api_key}"} if backend.api_key else {}
    r = await client.post(backend.url + "/chat/completions", json=body, headers=headers)
    r.raise_for_status()
    return r.json()


async def _answer_all(backend: Backend, bodies: list[dict], concurrency: int) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(body):
            async with sem:
                return await _ask(client, backend, body)
        return await asyncio.gather(*(one(b) for b in bodies))


def _body(task: dict, max_tokens: int, logprobs: bool = False) -> dict:
    body = {"messages": [{"role": "user", "content": task["prompt"]}], "temperature": 0, "max_tokens": max_tokens}
    if logprobs:
        body.update(logprobs=True, top_logprobs=20)
    return body


def _curve(order_scores: list[float], weak_ok: list[bool], strong_ok: list[bool], weak_cost: list[float],
           strong_cost: list[float], escalate_low: bool, pays_weak: bool) -> list[dict]:
    """Every cut of the items sorted by score: the lowest (escalate_low) or highest scores go strong."""
    n = len(order_scores)
    idx = sorted(range(n), key=lambda i: order_scores[i], reverse=not escalate_low)
    points = []
    for k in range(n + 1):
        strong = set(idx[:k])
        acc = sum(strong_ok[i] if i in strong else weak_ok[i] for i in range(n)) / n
        cost = sum((strong_cost[i] + (weak_cost[i] if pays_weak else 0)) if i in strong else weak_cost[i] for i in range(n)) / n
        points.append({"strong_share": k / n, "accuracy": acc, "cost_per_query": cost})
    return points


def _at_share(points: list[dict], share: float) -> float:
    return min(points, key=lambda p: abs(p["strong_share"] - share))["accuracy"]


def _cross_fit(prompts: list[str], labels: list[int], embedder: str, seed: int = 0):
    """Two folds: each fold's scores come from a classifier fitted on the other; plus the calibration check."""
    from sieve.router.classifier import fit

    n = len(prompts)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    folds = [order[: n // 2], order[n // 2:]]
    scores = [0.0] * n
    calibration = []
    for a, b in ((0, 1), (1, 0)):
        train = folds[a]
        if len({labels[i] for i in train}) < 2:
            return None, []
        clf = fit([prompts[i] for i in train], [labels[i] for i in train], embedder)
        held = clf.scores([prompts[i] for i in folds[b]])
        for i, s in zip(folds[b], held):
            scores[i] = s
        for share in (0.2, 0.5):
            t = clf.threshold_for_share(share)
            calibration.append({"target": share, "measured": sum(s >= t for s in held) / len(held)})
    return scores, calibration


def run_eval(config: RouterConfig, tasks: list[dict], max_tokens: int = 48, concurrency: int = 4, embedder: str = "hash:4096",
             out_json: str | None = None, plot: str | None = None, cache_requests: int = 20, budget_backend: str = "strong",
             budget_every: int = 1) -> dict:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    weak, strong = config.pair()
    n = len(tasks)
    print(f"{n} tasks; weak {weak.name} ({weak.url}), strong {strong.name} ({strong.url})", flush=True)
    t0 = time.perf_counter()
    w_out = asyncio.run(_answer_all(weak, [_body(t, max_tokens, logprobs=True) for t in tasks], concurrency))
    s_out = asyncio.run(_answer_all(strong, [_body(t, max_tokens) for t in tasks], concurrency))
    print(f"answered on both in {time.perf_counter() - t0:.0f} s", flush=True)
    text = lambda o: o["choices"][0]["message"]["content"] or ""  # noqa: E731
    weak_ok = [is_correct(text(o), t["answer"], t.get("match", "first")) for o, t in zip(w_out, tasks)]
    strong_ok = [is_correct(text(o), t["answer"], t.get("match", "first")) for o, t in zip(s_out, tasks)]
    w_tok = [o["usage"]["completion_tokens"] for o in w_out]
    s_tok = [o["usage"]["completion_tokens"] for o in s_out]
    weak_cost = [x * weak.cost_per_token for x in w_tok]
    strong_cost = [x * strong.cost_per_token for x in s_tok]

    curves = {}
    for metric in ("mean", "min", "entropy"):
        conf = [P.confidence(o["choices"][0], metric) for o in w_out]
        # escalate the least confident: low logprob first; for entropy, high entropy first
        scores = [-c for c in conf] if metric == "entropy" else conf
        curves[f"cascade-{metric}"] = _curve(scores, weak_ok, strong_ok, weak_cost, strong_cost, True, True)
    labels = [int(s and not w) for w, s in zip(weak_ok, strong_ok)]
    calibration = []
    for spec in embedder.split(","):
        name = "learned" if "," not in embedder else f"learned-{spec.split(':')[0]}"
        scores, cal = _cross_fit([t["prompt"] for t in tasks], labels, spec)
        if scores is not None:
            curves[name] = _curve(scores, weak_ok, strong_ok, weak_cost, strong_cost, False, False)
            calibration += [dict(c, embedder=spec) for c in cal]
    acc_w, acc_s = sum(weak_ok) / n, sum(strong_ok) / n
    curves["random"] = [{"strong_share": k / 10, "accuracy": acc_w + (acc_s - acc_w) * k / 10,
                         "cost_per_query": (sum(weak_cost) * (1 - k / 10) + sum(strong_cost) * k / 10) / n} for k in range(11)]
    oracle = sum(w or s for w, s in zip(weak_ok, strong_ok)) / n
    oracle_share = sum(labels) / n

    print(f"\naccuracy: weak {acc_w:.3f}, strong {acc_s:.3f}, oracle {oracle:.3f} at {oracle_share:.0%} strong calls; "
          f"mean completion tokens weak {statistics.mean(w_tok):.1f}, strong {statistics.mean(s_tok):.1f}")
    kinds = sorted({t.get("kind", "all") for t in tasks})
    if len(kinds) > 1:
        print("by kind: " + ", ".join(
            f"{k} {sum(w for w, t in zip(weak_ok, tasks) if t.get('kind') == k)}/{sum(s for s, t in zip(strong_ok, tasks) if t.get('kind') == k)}"
            f" of {sum(t.get('kind') == k for t in tasks)}" for k in kinds) + " (weak/strong)")
    print("\naccuracy at a share of strong calls:")
    shares = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)
    print(f"{'policy':>16} " + " ".join(f"{s:>6.0%}" for s in shares))
    for name, pts in curves.items():
        print(f"{name:>16} " + " ".join(f"{_at_share(pts, s):>6.3f}" for s in shares))
    for c in calibration:
        print(f"learned calibration ({c['embedder'].split(':')[0]}): asked {c['target']:.0%} strong calls, "
              f"routed {c['measured']:.1%} of the held-out fold")

    marked = [t for t in tasks if t.get("budget")]
    budget = _budgets(config, marked or tasks[::budget_every], budget_backend)
    cache = _cache_latency(config, tasks[:cache_requests]) if cache_requests else None
    result = {"weak": weak.name, "strong": strong.name, "tasks": n, "accuracy": {"weak": acc_w, "strong": acc_s, "oracle": oracle},
              "oracle_strong_share": oracle_share, "curves": curves, "calibration": calibration, "budget": budget, "cache": cache,
              "items": [{"prompt": t["prompt"], "answer": t["answer"], "kind": t.get("kind"), "weak": text(w), "strong": text(s),
                         "weak_ok": a, "strong_ok": b} for t, w, s, a, b in zip(tasks, w_out, s_out, weak_ok, strong_ok)]}
    if out_json:
        Path(out_json).write_text(json.dumps(result, indent=1))
    if plot:
        _plot(curves, plot, weak.name, strong.name)
    return result


def _budgets(config: RouterConfig, tasks: list[dict], which: str) -> list[dict]:
    """One request at a time: the runs differ only by their budget, not by what shared their batches (bf16
    kernels round differently at different batch sizes, which flips some greedy tokens)."""
    backend = config.backends[config.weak if which == "weak" else config.strong]
    runs = [("none", None, None), ("cap low", "low", "cap"), ("cap medium", "medium", "cap"), ("cap high", "high", "cap"),
            ("prompt medium", "medium", "prompt")]
    rows = []
    print(f"\nbudgets on {backend.name}, {len(tasks)} tasks one at a time (no budget: max_tokens 256):")
    for name, effort, mode in runs:
        bodies = []
        for t in tasks:
            body = _body(t, 256)
            if mode is not None:
                body = P.apply_budget(body, P.estimate_budget(t["prompt"], effort), mode)
            bodies.append(body)
        outs = asyncio.run(_answer_all(backend, bodies, 1))
        ok = [is_correct(o["choices"][0]["message"]["content"] or "", t["answer"], t.get("match", "first")) for o, t in zip(outs, tasks)]
        tokens = [o["usage"]["completion_tokens"] for o in outs]
        rows.append({"run": name, "accuracy": sum(ok) / len(ok), "mean_tokens": statistics.mean(tokens), "total_tokens": sum(tokens),
                     "mean_budget": statistics.mean(b.get("max_tokens", 256) for b in bodies)})
    base = rows[0]
    for r in rows:
        r["tokens_saved"] = 1 - r["total_tokens"] / base["total_tokens"] if base["total_tokens"] else 0.0
        print(f"{r['run']:>14}: accuracy {r['accuracy']:.3f}, mean tokens {r['mean_tokens']:.1f} (budget {r['mean_budget']:.0f}), "
              f"tokens saved {r['tokens_saved']:.0%}")
    return rows


def _cache_latency(config: RouterConfig, tasks: list[dict]) -> dict:
    """Each request twice through a gateway with an in-memory cache, started on a free port here."""
    import dataclasses

    from sieve.router.app import create_router_app
    from sieve.router.config import CacheConfig
    from sieve.server.serve import serve_in_thread

    cfg = dataclasses.replace(config, cache=CacheConfig(backend="memory"))
    base, stop = serve_in_thread(create_router_app(cfg))
    miss, hit = [], []
    nonce = f"{time.time():.0f}"  # a fresh key space: `user` is part of the key, so earlier runs never hit
    try:
        with httpx.Client(timeout=600) as client:
            for t in tasks:
                body = dict(_body(t, 48), model="route:cascade", user=nonce)
                for bucket, expect in ((miss, "miss"), (hit, "hit")):
                    t0 = time.perf_counter()
                    r = client.post(f"{base}/v1/chat/completions", json=body)
                    bucket.append(time.perf_counter() - t0)
                    if r.headers.get("x-sieve-cache") != expect:
                        raise RuntimeError(f"expected a cache {expect} through the gateway, got HTTP {r.status_code} "
                                           f"x-sieve-cache={r.headers.get('x-sieve-cache')}: {r.text[:200]}")
    finally:
        stop()
    out = {"requests": len(tasks), "miss_ms_median": 1000 * statistics.median(miss), "hit_ms_median": 1000 * statistics.median(hit)}
    out["speedup"] = out["miss_ms_median"] / out["hit_ms_median"] if out["hit_ms_median"] else math.inf
    print(f"\ncache (route:cascade through the gateway): miss {out['miss_ms_median']:.1f} ms, hit {out['hit_ms_median']:.2f} ms "
          f"median over {len(tasks)} requests ({out['speedup']:.0f}x)")
    return out


def _plot(curves: dict, path: str, weak: str, strong: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in curves.items():
        ax.plot([p["strong_share"] for p in pts], [p["accuracy"] for p in pts], label=name,
                linestyle="--" if name == "random" else "-")
    ax.set_xlabel(f"share of calls to the strong model ({strong})")
    ax.set_ylabel("accuracy")
    ax.set_title(f"routing {weak} / {strong}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
