"""`sieve bench balance`: the router's replica balancing policies side by side on one workload (multi-turn chat
by default) against the same replicas: prefix-cache hit rate (the replicas' own `cached_tokens`), TTFT and
throughput. Each policy runs its own conversations (a fresh workload seed), so no policy finds another's
prompts in the replicas' prefix caches."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys

import httpx


def add_balance_args(p: argparse.ArgumentParser) -> None:
    from sieve.bench.serve_command import add_workload_args

    p.add_argument("--replica", action="append", required=True, help="base URL of one replica (repeat; at least 2)")
    p.add_argument("--model", default=None, help="model name the replicas serve (default: the first replica's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--policies", default="round_robin,cache_aware")
    p.add_argument("--output-json", default=None)
    add_workload_args(p)  # (with --concurrency: users at once, one value here; default 8)


def _gateway(replicas: list[str], model: str, api_key: str | None, policy: str):
    from sieve.router.app import create_router_app
    from sieve.router.config import parse_config
    from sieve.server.serve import serve_in_thread

    cfg = parse_config({"backends": [{"name": model, "url": replicas[0], "replicas": replicas[1:], "api_key": api_key}],
                        "balance": policy, "cache": {"backend": "none"}})
    url, stop = serve_in_thread(create_router_app(cfg))
    return url + "/v1", stop


def run_bench_balance(args) -> int:
    from sieve.bench.serve_command import RemoteTokenizer, first_model, load_tokenizer, quiet_http_logs, workload_from_args
    from sieve.bench.serving import Load, Target, format_run, run_load, within_slo
    from sieve.bench.serving_stats import SLO, summarize

    quiet_http_logs()
    replicas = [u.rstrip("/") if u.rstrip("/").endswith("/v1") else u.rstrip("/") + "/v1" for u in args.replica]
    if len(replicas) < 2:
        print("error: give at least two --replica URLs", file=sys.stderr)
        return 2
    if args.dataset == "synthetic":
        args.dataset = "multi-turn"
    try:
        model = args.model or first_model(replicas[0], args.api_key)
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else RemoteTokenizer(replicas[0].removesuffix("/v1"), model, args.api_key)
        spec = workload_from_args(args)
    except (ValueError, httpx.HTTPError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    policies = args.policies.split(",")
    users = int(args.concurrency or 8)
    print(f"bench balance: {len(replicas)} replicas of {model}, {spec.dataset} ({spec.num_prompts} conversations x {spec.turns} turns), "
          f"{users} users")
    results = {}
    for i, policy in enumerate(policies):
        sessions = dataclasses.replace(spec, seed=spec.seed + 1000 * (i + 1)).build(tokenizer)
        url, stop = _gateway(replicas, model, args.api_key, policy)
        try:
            records, duration = asyncio.run(run_load(Target(url, model, None, ignore_eos=args.ignore_eos, timeout_s=args.timeout), sessions, Load(concurrency=users), progress=False))
            metrics = httpx.get(url.removesuffix("/v1") + "/metrics").text
        finally:
            stop()
        s = summarize(records, duration, SLO(None, None))
        s["policy"], s["concurrency"] = policy, users
        s["within_slo"] = within_slo(s, SLO(None, None))
        picks: dict[str, float] = {}
        for line in metrics.splitlines():
            if line.startswith("sieve:router_replica_picks_total{"):
                reason = line.split('reason="')[1].split('"')[0]
                picks[reason] = picks.get(reason, 0.0) + float(line.split()[-1])
        s["picks"] = picks
        results[policy] = s
        print(f"{policy:>12}: picks "
              + ", ".join(f"{k} {v:.0f}" for k, v in sorted(picks.items())) + " | " + format_run(s))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model": model, "replicas": replicas, "workload": vars(spec), "concurrency": users, "runs": results},
                      f, indent=2, default=str)
    return 0
