"""`sieve bench pd`: prefill/decode disaggregation against one colocated server, at the same total cores.

Colocated: one `sieve serve` on cores 0-1 (2 threads). Disaggregated: a prefill server on core 0 and a decode server on
core 1 (1 thread each, `--role prefill|decode`, KV over TCP), behind the gateway (`sieve router`, a backend with
`prefill` URLs). The same closed-loop load on both: chat turns (64-256 tokens in, 64-128 out) mixed with long prompts
(2,000 tokens in by default), streamed. Reported per class: TTFT and TPOT percentiles, and requests within the SLO.

What it shows on 2 cores: whether taking prefill off the decode core protects the chat turns' TPOT from long
prompts (DistServe's point), paid for by half the cores for each phase. What it cannot show: a cluster's transfer
costs (both servers share one host's memory) or prefill on a GPU; for those, `sieve plan` (the note in
docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
from pathlib import Path


def add_bench_pd_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint (default: the default model, SmolLM2-135M-Instruct)")
    p.add_argument("--requests", type=int, default=48, help="requests in each run")
    p.add_argument("--users", type=int, default=4, help="closed-loop users at once")
    p.add_argument("--long-every", type=int, default=4, help="one long prompt per this many requests")
    p.add_argument("--long-len", type=int, default=2000, help="tokens in a long prompt")
    p.add_argument("--long-output", type=int, default=32, help="tokens a long prompt's answer has")
    p.add_argument("--slo-ttft-ms", type=float, default=4000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--cores", default="0,1", help="the two cores: colocated uses both, P/D one each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)


def _sessions(tokenizer, args):
    from sieve.bench.workloads import Session, TextMaker, Turn

    rng, text = random.Random(args.seed), TextMaker(tokenizer, args.seed)
    sessions, kinds = [], []
    for i in range(args.requests):
        long = i % args.long_every == 0
        turn = Turn(text.text(args.long_len), args.long_output) if long else Turn(text.text(rng.randint(64, 256)), rng.randint(64, 128))
        sessions.append(Session([turn]))
        kinds.append("long" if long else "chat")
    return sessions, kinds


def _serve(model: str, cores: str, threads: int, port: int, log: Path, extra: list[str]):
    from sieve.bench.llama_cpp import SERVED_NAME, Server

    cmd = ["taskset", "-c", cores, sys.executable, "-m", "sieve.cli", "serve", "--model", model, "--port", str(port),
           "--served-model-name", SERVED_NAME, "--num-threads", str(threads), "--no-webui", "--max-waiting", "100000", *extra]
    return Server(cmd, port, log, timeout=900)


def _summaries(records, kinds, duration, slo) -> dict:
    from sieve.bench.serving_stats import summarize

    out = {"all": summarize(records, duration, slo)}
    for kind in ("chat", "long"):
        mine = [r for r in records if kinds[r.session] == kind]
        out[kind] = summarize(mine, duration, slo)
    return out


def run_bench_pd(args) -> int:
    from sieve.bench.llama_cpp import SERVED_NAME, free_port
    from sieve.bench.serve_command import RemoteTokenizer, quiet_http_logs
    from sieve.bench.serving import Load, Target, run_load
    from sieve.bench.serving_stats import SLO
    from sieve.models.default import resolve_default
    from sieve.router.app import create_router_app
    from sieve.router.config import parse_config
    from sieve.server.serve import serve_in_thread

    quiet_http_logs()
    model = args.model or resolve_default(None)[0]
    cores = args.cores.split(",")
    if len(cores) != 2 or args.requests < 1 or args.users < 1 or args.long_every < 1:
        print("error: --cores takes two cores; --requests, --users and --long-every must be >= 1", file=sys.stderr)
        return 2
    slo = SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    logs = Path(tempfile.mkdtemp(prefix="sieve-bench-pd-"))
    results = {}
    sessions = kinds = None

    def run(label: str, url: str) -> None:
        nonlocal sessions, kinds
        if sessions is None:  # the prompts, in the served model's own tokens
            sessions, kinds = _sessions(RemoteTokenizer(url.removesuffix("/v1"), SERVED_NAME, None), args)
        records, duration = asyncio.run(run_load(Target(url, SERVED_NAME, None), sessions, Load(concurrency=args.users),
                                                 seed=args.seed, progress=False))
        results[label] = _summaries(records, kinds, duration, slo)
        _print(label, results[label])

    print(f"bench pd: {model}, {args.requests} requests ({args.requests // args.long_every} of {args.long_len} tokens), "
          f"{args.users} users, SLO TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= {args.slo_tpot_ms:g} ms; logs in {logs}")
    port = free_port()
    with _serve(model, args.cores, 2, port, logs / "colocated.log", []) as s:
        run("colocated (2 cores)", s.base_url)
    pp, dp, kv_port = free_port(), free_port(), free_port()
    secret = logs / "kv.key"  # the secret both servers share (sieve/distributed/kv_auth.py)
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    produce = json.dumps({"secret_file": str(secret), "kv_port": kv_port})
    consume = json.dumps({"secret_file": str(secret), "producers": [f"127.0.0.1:{kv_port}"]})
    with _serve(model, cores[0], 1, pp, logs / "prefill.log", ["--role", "prefill", "--kv-transfer-config", produce]) as p, \
            _serve(model, cores[1], 1, dp, logs / "decode.log", ["--role", "decode", "--kv-transfer-config", consume]) as d:
        cfg = parse_config({"backends": [{"name": SERVED_NAME, "url": d.base_url, "prefill": [p.base_url]}], "cache": {"backend": "none"}})
        url, stop = serve_in_thread(create_router_app(cfg))
        try:
            run("P/D (1 + 1 core)", url + "/v1")
            import httpx

            page = httpx.get(d.base_url.removesuffix("/v1") + "/metrics").text
            results["P/D (1 + 1 core)"]["kv_transfer"] = _transfer_metrics(page)
            t = {k.split("{")[0].removeprefix("sieve:kv_transfer_"): v for k, v in results["P/D (1 + 1 core)"]["kv_transfer"].items()
                 if 'direction="load"' in k}
            print(f"  KV loaded by the decode server: {t.get('bytes_total', 0) / 2**20:,.1f} MiB in {t.get('blocks_total', 0):,.0f} "
                  f"blocks, {t.get('seconds_total', 0):.2f} s")
        finally:
            stop()
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"model": str(model), "args": vars(args), "runs": results}, indent=2, default=str))
    return 0


def _transfer_metrics(page: str) -> dict[str, float]:
    """The decode server's KV-transfer counters, keyed like 'sieve:kv_transfer_bytes_total{direction="load"}'."""
    out = {}
    for line in page.splitlines():
        if not line.startswith("sieve:kv_transfer_") or "_created" in line:
            continue
        name, labels = line.split("{", 1)
        kept = [part for part in labels.split("}")[0].split(",") if not part.startswith("model_name=")]
        out[f"{name}{{{','.join(kept)}}}"] = float(line.split()[-1])
    return out


def _print(label: str, r: dict) -> None:
    def ms(d, key, q):
        v = d[key].get(q)
        return f"{1e3 * v:,.0f}" if v is not None and v == v else "-"

    print(f"\n{label}: {r['all']['completed']}/{r['all']['requests']} done, {r['all']['output_token_throughput']:.1f} output tok/s, "
          f"within SLO {r['all']['slo_attainment']:.0%} ({r['all']['goodput']:.2f} req/s)")
    for kind in ("chat", "long"):
        s = r[kind]
        print(f"  {kind:>4}: TTFT p50/p99 {ms(s, 'ttft_s', 'p50')}/{ms(s, 'ttft_s', 'p99')} ms, "
              f"TPOT p50/p99 {ms(s, 'tpot_s', 'p50')}/{ms(s, 'tpot_s', 'p99')} ms, within SLO {s['slo_attainment']:.0%}")
