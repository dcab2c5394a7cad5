"""`sieve bench peers`: the same checkpoint, the same workload, sieve against llama.cpp, one invocation.

(`--engines sieve,sieve-no-prefix-cache` compares sieve with itself, prefix cache on and off, the same way.)

Needs the optional extra `peers` (`pip install -e '.[peers]'`: llama-cpp-python[server] and gguf).
1. Convert the checkpoint to GGUF (f16 and/or q8_0) with `gguf_export` (cached next to the output).
2. Find llama.cpp's own HTTP server, `llama-server`, which serves many requests at once through
   parallel slots with continuous batching: `--llama-server PATH`, `$LLAMA_SERVER`, the PATH, or the
   copy `--build-llama-server` compiles from the llama.cpp source that ships inside the installed
   llama-cpp-python's source distribution (downloaded from the package registry). Without it, the
   Python server of llama-cpp-python (`python -m llama_cpp.server`) is used and the table says so:
   that server answers one request at a time, which is not llama.cpp at its best.
3. Start each server in turn on 127.0.0.1 with the same threads, run the same `bench serve` sweep
   against it, stop it; then print ratios sieve ÷ llama.cpp per load point and write JSON and a plot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from sieve.bench.llama_cpp import (LLAMA_FLAGS, LLAMA_ISA_FLAGS, SERVED_NAME, Server, find_llama_server, format_table,
                                   free_port, llama_cmd, ratio_table)
from sieve.bench.serve_command import add_workload_args, floor_step_seconds, quiet_http_logs, workload_from_args
from sieve.bench.serving import Target, parse_loads, sweep
from sieve.bench.serving_stats import SLO
from sieve.demo import cache_root


def add_peers_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local Hugging Face checkpoint folder (with tokenizer.json)")
    p.add_argument("--gguf-file", default=None,
                   help="a GGUF file instead: both engines run it and its --gguf re-encodings, batch-1 decode (llama-bench) "
                        "and the serving sweep (llama-server), see sieve/bench/peers_gguf.py")
    p.add_argument("--batch1-rounds", type=int, default=5, help="--gguf-file: interleaved batch-1 rounds per engine and file")
    p.add_argument("--batch1-tokens", type=int, default=128, help="--gguf-file: tokens per batch-1 round (llama-bench tg)")
    p.add_argument("--no-serving", dest="serving", action="store_false", help="--gguf-file: batch-1 decode only")
    p.add_argument("--create-model", default=None, choices=["qwen2.5-0.5b", "llama-3.2-1b", "smollm2-135m"], help="write a random checkpoint of this shape at --model if absent")
    p.add_argument("--dtype", default="bfloat16", help="sieve's dtype for the checkpoint")
    p.add_argument("--engines", default="sieve,llama.cpp",
                   help="comma list of sieve, sieve-no-prefix-cache, llama.cpp; ratios are the first ÷ each other")
    p.add_argument("--gguf", default="f16", help="llama.cpp formats to run, comma list of f16,q8_0")
    p.add_argument("--gguf-dir", default=None, help="where GGUF files are written (default: beside the sieve cache)")
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"), help="path of llama.cpp's llama-server")
    p.add_argument("--build-llama-server", action="store_true", help="compile llama-server (and llama-bench) from the installed llama-cpp-python's sources")
    p.add_argument("--llama-isa", default="native", choices=sorted(LLAMA_ISA_FLAGS),
                   help="llama.cpp built for this CPU (native) or without AVX-512 (avx2), beside SIEVE_CPU_ISA=avx2")
    p.add_argument("--threads", type=int, default=None, help="threads for both engines (default: all cores)")
    p.add_argument("--ctx-per-slot", type=int, default=4096, help="llama.cpp context per parallel slot")
    p.add_argument("--sieve-arg", action="append", default=[], help="extra `sieve serve` flag, repeatable (e.g. --sieve-arg=--max-num-seqs=64)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    add_workload_args(p)
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--log-dir", default=None, help="server logs (default: beside the GGUF files)")
    p.set_defaults(concurrency="1,2,4,8,16,32", slo_ttft_ms=2000.0, slo_tpot_ms=200.0)


def run_peers(args) -> int:
    from sieve.bench.serve_command import load_tokenizer

    if args.gguf_file:
        from sieve.bench.peers_gguf import run_gguf_peers

        return run_gguf_peers(args)
    if args.model is None:
        raise SystemExit("error: bench peers needs --model (a Hugging Face folder) or --gguf-file")
    quiet_http_logs()
    model = Path(args.model)
    if args.create_model:
        from sieve.bench.checkpoints import make_random_checkpoint

        make_random_checkpoint(model, args.create_model)
    threads = args.threads or os.cpu_count() or 1
    loads = parse_loads(args.concurrency, args.request_rate)
    slo = SLO(args.slo_ttft_ms / 1e3 if args.slo_ttft_ms else None, args.slo_tpot_ms / 1e3 if args.slo_tpot_ms else None)
    key = "concurrency" if loads[0].concurrency is not None else "request_rate"
    parallel = max(l.concurrency or 32 for l in loads)
    gguf_dir = Path(args.gguf_dir) if args.gguf_dir else cache_root() / "gguf"
    log_dir = Path(args.log_dir) if args.log_dir else gguf_dir
    gguf_dir.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)

    floor = floor_step_seconds(str(model), args.dtype)  # measured before any server runs
    sessions = workload_from_args(args).build_points(load_tokenizer(str(model)), len(loads))
    results: dict[str, dict] = {}
    port = free_port()
    engines, llama_names = peer_engines(args, model, port, threads, parallel, gguf_dir)

    print(f"peers: {model.name}, {threads} threads each, {args.dataset} workload, loads {[getattr(l, key) for l in loads]}")
    out = {"model": str(model), "threads": threads, "dataset": args.dataset, "workload": vars(workload_from_args(args)),
           "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms}, "floor_step_s": floor,
           "engines": results, "failed": {}, "ratios": {}}
    for label, cmd in engines:
        print(f"== {label}: {llama_names.get(label, 'sieve serve')}")
        try:
            with Server(cmd, port, log_dir / f"{label.replace(' ', '-')}.log", args.startup_timeout) as server:
                target = Target(server.base_url, SERVED_NAME, ignore_eos=args.ignore_eos, timeout_s=args.timeout)
                results[label] = sweep(target, sessions, loads, slo, floor_step_s=floor, seed=args.workload_seed,
                                       progress=args.progress, sessions_per_user=args.prompts_per_user)
                results[label]["server"] = llama_names.get(label, "sieve serve")
        except RuntimeError as e:  # one engine that will not start must not lose the others' results
            print(f"{label} failed: {e}")
            out["failed"][label] = str(e)[:2000]
        if args.output_json:
            Path(args.output_json).write_text(json.dumps(out, indent=2))

    first = engines[0][0]
    if first not in results:
        return 1
    for label in list(results)[1:]:
        rows = ratio_table(results[first], results[label], key)
        out["ratios"][label] = rows
        print(format_table(rows, key, results[first], results[label], label, first))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(out, indent=2))
    if args.plot:
        from sieve.bench.plot import plot_sweeps

        plot_sweeps(results, args.plot, f"{' vs '.join(results)}: {model.name}, {args.dataset} workload, {threads} threads each",
                    slo.ttft_s, slo.tpot_s)
        print(f"plot written to {args.plot}")
    return 1 if out["failed"] else 0


def peer_engines(args, model: Path, port: int, threads: int, parallel: int, gguf_dir: Path) -> tuple[list, dict]:
    """(label, command) per engine of `--engines`, and what each non-sieve label runs (the GGUF files llama.cpp
    serves are exported here, next to the sieve cache, when missing or older than the checkpoint)."""
    from sieve.bench.gguf_export import export_gguf

    sieve_cmd = [sys.executable, "-m", "sieve.cli", "serve", "--model", str(model), "--dtype", args.dtype, "--port", str(port),
                 "--num-threads", str(threads), "--served-model-name", SERVED_NAME,
                 "--max-num-seqs", str(max(64, parallel)), *args.sieve_arg]
    engines, llama_names = [], {}
    for name in args.engines.split(","):
        if name == "sieve":
            engines.append(("sieve", sieve_cmd))
        elif name == "sieve-no-prefix-cache":
            engines.append((name, [*sieve_cmd, "--no-prefix-caching"]))
            llama_names[name] = "sieve serve --no-prefix-caching"
        elif name == "llama.cpp":
            binary = find_llama_server(args)
            for qtype in args.gguf.split(","):
                gguf = gguf_dir / f"{model.resolve().name}-{qtype}.gguf"
                if not gguf.exists() or gguf.stat().st_mtime < (model / "config.json").stat().st_mtime:
                    export_gguf(model, gguf, qtype)
                cmd, desc = llama_cmd(binary, gguf, port, threads, parallel, args.ctx_per_slot, LLAMA_FLAGS.get(qtype, []))
                llama_names[f"llama.cpp {qtype}"] = desc
                engines.append((f"llama.cpp {qtype}", cmd))
        else:
            raise SystemExit(f"unknown engine {name!r}: use sieve, sieve-no-prefix-cache or llama.cpp")
    return engines, llama_names
