"""Command-line glue for `sieve bench serve`: flags -> workload, loads, SLO, floor -> sweep -> JSON/plot."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

import httpx

from sieve.bench.serving import Target, parse_loads, sweep
from sieve.bench.serving_stats import SLO
from sieve.bench.workloads import Session, WorkloadSpec


def _range(s: str) -> tuple[int, int]:
    lo, _, hi = s.partition(":")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 1 <= lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"{s!r}: want MIN:MAX with 1 <= MIN <= MAX")
    return lo_i, hi_i


def add_workload_args(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", default="synthetic", help="synthetic | shared-prefix | multi-turn | jsonl:PATH")
    w.add_argument("--num-prompts", type=int, default=64, help="requests (conversations for multi-turn)")
    w.add_argument("--input-len", type=_range, default=(128, 512), help="MIN:MAX prompt (user turn) tokens")
    w.add_argument("--output-len", type=_range, default=(64, 256), help="MIN:MAX output tokens")
    w.add_argument("--num-prefixes", type=int, default=8, help="shared-prefix: distinct system prompts")
    w.add_argument("--prefix-len", type=int, default=2000, help="shared-prefix: tokens per system prompt")
    w.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    w.add_argument("--system-len", type=int, default=0, help="multi-turn: tokens of one system prompt every conversation opens with")
    w.add_argument("--workload-seed", type=int, default=0)
    w.add_argument("--tokenizer", default=None, help="tokenizer to size prompts with (default: --model when it is a local folder)")
    l = p.add_argument_group("load and objectives")
    l.add_argument("--concurrency", default=None, help="users at once; a comma list sweeps (e.g. 1,4,16,32)")
    l.add_argument("--request-rate", default=None, help="Poisson requests/s; a comma list sweeps; inf = all at once")
    l.add_argument("--prompts-per-user", type=int, default=None,
                   help="with --concurrency: a point with c users sends only c x this many of the prompts")
    l.add_argument("--slo-ttft-ms", type=float, default=None)
    l.add_argument("--slo-tpot-ms", type=float, default=None)
    l.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="let requests stop at EOS")
    l.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    l.add_argument("--no-progress", dest="progress", action="store_false")


def api_base(url: str) -> str:
    """The OpenAI API root of a server URL: vLLM's client takes the server (`http://host:8000`), OpenAI's
    the API root (`http://host:8000/v1`); both mean the same here."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", type=api_base, default="http://127.0.0.1:8000/v1",
                   help="the server (http://host:port) or its API root (http://host:port/v1)")
    p.add_argument("--endpoint", default=None, choices=ENDPOINTS,
                   help="API path the requests go to, as vLLM's client takes it (default: /v1/completions, or "
                        "/v1/chat/completions for multi-turn)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--queue-eta", action="store_true",
                   help="ask a sieve server for each request's expected wait (stream_options.include_queue) and report "
                        "its error against the wait the server measured")
    add_workload_args(p)
    b = p.add_argument_group("a Batch API job beside the load (sieve/bench/batch_load.py)")
    b.add_argument("--batch-requests", type=int, default=0, help="submit this many chat requests through /v1/batches "
                   "as the load starts, and report what the server finished of them meanwhile")
    b.add_argument("--batch-output-len", type=int, default=32, help="output tokens of each batch request")
    b.add_argument("--batch-wait", action="store_true", help="after the load, wait for the batch to complete and report when")
    f = p.add_argument_group("bandwidth floor (when the server runs on this machine)")
    f.add_argument("--floor-model", default=None, help="checkpoint whose weight bytes set the floor")
    f.add_argument("--floor-dtype", default="auto")
    o = p.add_argument_group("output")
    o.add_argument("--output-json", default=None)
    o.add_argument("--plot", default=None, help="PNG of latency percentiles and goodput against load")


def workload_from_args(args) -> WorkloadSpec:
    return WorkloadSpec(dataset=args.dataset, num_prompts=args.num_prompts, input_len=args.input_len,
                        output_len=args.output_len, num_prefixes=args.num_prefixes, prefix_len=args.prefix_len,
                        turns=args.turns, system_len=args.system_len, seed=args.workload_seed)


def load_tokenizer(name: str | None):
    if name is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def with_endpoint(points: list[list[Session]], endpoint: str) -> list[list[Session]]:
    """Every session sent to `endpoint`: a conversation of several turns needs the chat one."""
    chat = endpoint == "/v1/chat/completions"
    if not chat and any(len(s.turns) > 1 or s.messages is not None for sessions in points for s in sessions):
        raise ValueError(f"this workload holds conversations: they need --endpoint /v1/chat/completions, not {endpoint}")
    return [[dataclasses.replace(s, chat=chat) for s in sessions] for sessions in points]


class RemoteTokenizer:
    """The server's tokenizer through vLLM's /tokenize and /detokenize, for sizing prompts when no tokenizer
    is at hand here. Its token pool (what random text is drawn from) is the ids of a fixed English text."""

    POOL_TEXT = ("the of and to in is was that for it with as on be at by this had not are but from or have an they which "
                 "one you were her all she there would their we him been has when who will more no if out so said what up "
                 "its about into than them can only other new some could time these two may then do first any my now such "
                 "like our over man me even most made after also did many before must through back years where much your "
                 "way well down should because each just those people how too little state good very make world still own "
                 "see men work long get here between both life being under never day same another know while last might us "
                 "great old year off come since against go came right used take three house garden river music number")

    def __init__(self, server: str, model: str | None, api_key: str | None):
        self.server, self.model = server.rstrip("/"), model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.all_special_ids: list[int] = []

    @functools.cached_property
    def token_pool(self) -> list[int]:
        return sorted(set(self.encode(self.POOL_TEXT)))

    def _post(self, path: str, body: dict) -> dict:
        r = httpx.post(self.server + path, json={"model": self.model, **body}, headers=self.headers, timeout=60)
        if r.status_code == 404:
            raise ValueError(f"{self.server} has no {path}: pass --tokenizer")
        r.raise_for_status()
        return r.json()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._post("/tokenize", {"prompt": text, "add_special_tokens": add_special_tokens})["tokens"]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._post("/detokenize", {"tokens": list(ids)})["prompt"]


def floor_step_seconds(model: str, dtype: str, log=print) -> float:
    """Weight bytes one decode step reads ÷ this machine's measured bandwidth."""
    from sieve.bench.bandwidth import decode_weight_bytes, measure_bandwidth
    from sieve.models.arch import ModelArch
    from sieve.models.loader import read_config, resolve_dtype, resolve_model_path

    arch = ModelArch.from_hf_config(read_config(resolve_model_path(model)))
    weights = decode_weight_bytes(arch, resolve_dtype(dtype, arch).itemsize)
    bw = measure_bandwidth("cpu")
    step = weights / (bw.best_gbps * 1e9)
    log(f"floor: {weights / 1e9:.3f} GB of weights per step at {bw.best_gbps:.1f} GB/s = {step * 1e3:.1f} ms "
        f"({1 / step:.1f} tok/s at batch 1)")
    return step


def first_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def quiet_http_logs() -> None:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)


def run_bench_serve(args) -> int:
    quiet_http_logs()
    try:
        loads = parse_loads(args.concurrency, args.request_rate)
        model = args.model or first_model(args.base_url, args.api_key)
        tok_name = args.tokenizer or (args.model if args.model and os.path.isdir(args.model) else None)
        # without a tokenizer here, the server's own (/tokenize, /detokenize) sizes the prompts
        tokenizer = load_tokenizer(tok_name) if tok_name else RemoteTokenizer(args.base_url.removesuffix("/v1"), model, args.api_key)
        sessions = workload_from_args(args).build_points(tokenizer, len(loads))
        if args.endpoint is not None:
            sessions = with_endpoint(sessions, args.endpoint)
    except (ValueError, httpx.HTTPError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    slo = SLO(None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1e3,
              None if args.slo_tpot_ms is None else args.slo_tpot_ms / 1e3)
    floor = floor_step_seconds(args.floor_model, args.floor_dtype) if args.floor_model else None
    target = Target(args.base_url, model, args.api_key, ignore_eos=args.ignore_eos, timeout_s=args.timeout,
                    queue_eta=args.queue_eta)
    n_req = sum(len(s.turns) for s in sessions[0])
    print(f"bench serve: {model} at {args.base_url}, {args.dataset} workload ({len(sessions[0])} sessions, {n_req} requests per load point)")
    batch = None
    if args.batch_requests:
        from sieve.bench.batch_load import BackgroundBatch

        if args.batch_requests < 0 or args.batch_output_len < 1:
            print("error: --batch-requests must be >= 0 and --batch-output-len >= 1", file=sys.stderr)
            return 2
        batch = BackgroundBatch(args.base_url, model, args.api_key, args.batch_requests, args.batch_output_len, args.workload_seed)
        try:
            batch.submit()
        except httpx.HTTPError as e:  # (a server without --batch-dir answers 404)
            print(f"error: the batch could not be submitted: {e}", file=sys.stderr)
            return 2
        print(f"batch {batch.id}: {args.batch_requests} chat requests of {args.batch_output_len} tokens submitted")
    result = sweep(target, sessions, loads, slo, floor_step_s=floor, seed=args.workload_seed, progress=args.progress,
                   sessions_per_user=args.prompts_per_user)
    if batch is not None:
        result["batch"] = batch.report(args.batch_wait)
        print(f"batch: {json.dumps(result['batch'])}")
    key = next(k for k in result if k.startswith("max_"))
    if slo.ttft_s is not None or slo.tpot_s is not None:
        print(f"{key.replace('_', ' ')} (p99 TTFT/TPOT within the SLO, no errors): {result[key]}")
    result.update(base_url=args.base_url, model=model, dataset=args.dataset,
                  workload=vars(workload_from_args(args)), slo={"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms})
    if floor is not None:
        result["floor_step_s"] = floor
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        from sieve.bench.plot import plot_sweeps

        plot_sweeps({model: result}, args.plot, f"sieve bench serve: {model}, {args.dataset} workload",
                    slo.ttft_s, slo.tpot_s)
        print(f"plot written to {args.plot}")
    return 0 if all(r["errors"] == 0 for r in result["runs"]) else 1
