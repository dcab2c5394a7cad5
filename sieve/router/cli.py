"""`sieve router serve | train | eval`."""

from __future__ import annotations

import argparse
import json
import sys


def _add_backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="router config (JSON): backends, weak, strong, aliases, classifier, cache")
    p.add_argument("--backend", action="append", default=None, metavar="NAME=URL[,model=ID,version=V,cost_per_token=C]",
                   help="a backend (repeat); added to the config file's")
    p.add_argument("--weak", default=None, help="the cheap backend of the pair")
    p.add_argument("--strong", default=None, help="the strong backend of the pair")
    p.add_argument("--classifier", default=None, help="the learned router, written by `sieve router train`")


def _config(args: argparse.Namespace, **cache):
    from sieve.router.config import load_config

    return load_config(args.config, args.backend, weak=args.weak, strong=args.strong, classifier=args.classifier, **cache)


def cmd_serve(args: argparse.Namespace) -> int:
    import dataclasses
    import logging

    from sieve.server.auth import APIKeys

    import uvicorn

    from sieve.router.app import create_router_app
    from sieve.router.classifier import Classifier
    from sieve.router.config import RouterConfigError

    try:
        config = _config(args, cache_backend=args.cache, cache_redis_url=args.redis_url, cache_ttl=args.cache_ttl,
                         cache_stale_while_revalidate=args.cache_stale_while_revalidate,
                         cache_cache_sampled=True if args.cache_sampled else None, cache_semantic_threshold=args.cache_semantic_threshold)
        classifier = Classifier.load(config.classifier) if config.classifier else None
    except (RouterConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        keys = APIKeys.load(args.api_key, args.api_keys_file)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if keys.enabled:
        config = dataclasses.replace(config, api_keys={**config.api_keys, **keys.by_key})
    if args.max_request_body_bytes is not None:
        config = dataclasses.replace(config, max_body_bytes=args.max_request_body_bytes)
    if not config.api_keys and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"error: a gateway on {args.host} is reachable from other hosts, and it attaches the backends' API keys: give "
              "it client keys (--api-key or --api-keys-file, or api_keys in its config)", file=sys.stderr)
        return 2
    app = create_router_app(config, classifier)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per upstream call and health check
    print(f"sieve router on http://{args.host}:{args.port}/v1: backends {', '.join(config.backends)}"
          + (f"; weak {config.weak}, strong {config.strong}" if config.weak else ""), flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from sieve.router.classifier import fit, read_examples

    try:
        prompts, labels = read_examples(args.data)
        reference = None
        if args.calibration_prompts:
            reference = [json.loads(line)["prompt"] for line in open(args.calibration_prompts) if line.strip()]
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    clf = fit(prompts, labels, args.embedder, reference)
    clf.save(args.out)
    scores = clf.scores(prompts)
    acc = sum((s >= 0.5) == bool(y) for s, y in zip(scores, labels)) / len(labels)
    print(f"trained on {len(prompts)} prompts ({sum(labels)} strong); training accuracy {acc:.3f}; "
          f"threshold for 30% strong calls: {clf.threshold_for_share(0.3):.4f}; written to {args.out}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from sieve.router.config import RouterConfigError
    from sieve.router.evaluate import run_eval
    from sieve.router.tasks import load_tasks

    try:
        config = _config(args)
        config.pair()
        tasks = load_tasks(args.task)
    except (RouterConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = run_eval(config, tasks, max_tokens=args.max_tokens, concurrency=args.concurrency, embedder=args.embedder,
                      out_json=args.output_json, plot=args.plot, cache_requests=args.cache_requests, budget_backend=args.budget_backend,
                      budget_every=args.budget_every)
    return 0 if result else 1


def add_router_parser(sub) -> None:
    r = sub.add_parser("router", help="the gateway: routes between backends, cascades, budgets, caches responses")
    rs = r.add_subparsers(dest="router_command", required=True)

    s = rs.add_parser("serve", help="serve the gateway (OpenAI API) in front of the backends")
    _add_backend_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--api-key", action="append", default=None, help="a client key (repeat for several); every route but /health needs one")
    s.add_argument("--api-keys-file", default=None, help="client keys, a line each: TENANT:KEY or KEY")
    s.add_argument("--max-request-body-bytes", type=int, default=None, help="larger bodies get 413 (default 16 MiB)")
    s.add_argument("--cache", default=None, choices=["memory", "redis", "none"], help="response cache store (default memory)")
    s.add_argument("--redis-url", default=None, help="default redis://127.0.0.1:6379/0")
    s.add_argument("--cache-ttl", type=float, default=None, help="seconds an answer stays fresh (default 600)")
    s.add_argument("--cache-stale-while-revalidate", type=float, default=None,
                   help="seconds past the TTL a stale answer is served while it is refreshed (default 60)")
    s.add_argument("--cache-sampled", action="store_true", help="also cache sampled requests without a seed")
    s.add_argument("--cache-semantic-threshold", type=float, default=None,
                   help="opt in to near-duplicate hits at this cosine similarity (negations and numbers must match)")
    s.set_defaults(func=cmd_serve)

    t = rs.add_parser("train", help="fit the learned router on a jsonl of {prompt, winner: weak|strong}")
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--embedder", default="hash:4096", help="hash[:DIM] or model:PATH (e.g. the weak model's GGUF file)")
    t.add_argument("--calibration-prompts", default=None, help="jsonl of {prompt}: the reference set for strong-call shares "
                   "(default: the training prompts)")
    t.set_defaults(func=cmd_train)

    e = rs.add_parser("eval", help="quality against the share of strong calls per policy, budgets, cache latency")
    _add_backend_args(e)
    e.add_argument("--task", required=True, help="jsonl of {prompt, answer} (answer: a string or a list of accepted strings); "
                   "`builtin` writes and uses sieve's own task (capitals, arithmetic, recall from ../shared/data)")
    e.add_argument("--max-tokens", type=int, default=48)
    e.add_argument("--concurrency", type=int, default=4)
    e.add_argument("--embedder", default="hash:4096", help="for the learned policy (cross-fitted on the task); several, "
                   "comma-separated, give a curve each (e.g. hash:4096,model:PATH)")
    e.add_argument("--budget-every", type=int, default=1, help="the budget runs use every N-th task")
    e.add_argument("--budget-backend", default="strong", choices=["weak", "strong"])
    e.add_argument("--cache-requests", type=int, default=20, help="requests timed through the gateway for cache hit vs miss")
    e.add_argument("--output-json", default=None)
    e.add_argument("--plot", default=None)
    e.set_defaults(func=cmd_eval)
