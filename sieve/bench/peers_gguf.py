"""`sieve bench peers --gguf-file FILE`: sieve and llama.cpp on the same GGUF files.

The file itself and its re-encodings (`--gguf f16,bf16,q8_0`: every matrix dequantized and encoded
again, sieve.bench.gguf_export.reencode_gguf), each run by both engines:
  1. Batch-1 decode. llama.cpp's own `llama-bench` (tg, one repetition) and sieve's engine on the
     same file (mean time per decode step after the prefill, as llama-bench measures), alternated
     round by round, `--batch1-rounds` times, so that the slow and fast moments of a shared machine
     fall on both. Reported: median tok/s of each, the median of the per-round ratios, and the
     physical floor (the file's bytes read per step ÷ the memory bandwidth measured at the start).
  2. Serving (unless --no-serving). `sieve serve` and `llama-server` on the file, the `bench serve`
     sweep (concurrency 1..32 by default), ratios per load point and the most users within the SLO.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from sieve.bench.bandwidth import measure_bandwidth
from sieve.bench.llama_cpp import LLAMA_FLAGS, SERVED_NAME, Server, find_llama_server, format_table, free_port, llama_cmd, ratio_table
from sieve.bench.serve_command import quiet_http_logs, workload_from_args
from sieve.bench.serving import Target, parse_loads, sweep
from sieve.bench.serving_stats import SLO
from sieve.demo import cache_root
from sieve.models.gguf import GGUFCheckpoint


def gguf_files(src: Path, qtypes: list[str], out_dir: Path) -> dict[str, Path]:
    """{label: file}: the source under its own type, and each re-encoding (cached beside the others)."""
    from sieve.bench.gguf_export import reencode_gguf

    kinds = GGUFCheckpoint(src).tensor_types()
    own = max((k for k in kinds if k not in ("F32",)), key=lambda k: kinds[k], default="F32").lower()
    files = {own: src}
    for q in qtypes:
        if q == own:
            continue
        out = out_dir / f"{src.stem}-{q}.gguf"
        if not out.exists() or out.stat().st_mtime < src.stat().st_mtime:
            reencode_gguf(src, out, q)
        files[q] = out
    return files


def llama_bench(binary: Path, path: Path, threads: int, tokens: int) -> float:
    """llama.cpp's tokens/s for `tokens` generated at batch 1 (tg), one repetition."""
    r = subprocess.run([str(binary), "-m", str(path), "-t", str(threads), "-p", "0", "-n", str(tokens), "-r", "1", "-o", "json"],
                       capture_output=True, text=True, check=True)
    return float(json.loads(r.stdout)[0]["avg_ts"])


def sieve_decode(llm, tokens: int, prompt_len: int = 32) -> float:
    """sieve's tokens/s at batch 1: mean time per decode step after the prefill, as llama-bench's tg."""
    from sieve.sampling_params import SamplingParams

    engine = llm.llm_engine
    engine.add_request(f"b1-{time.monotonic_ns()}", {"prompt_token_ids": list(range(100, 100 + prompt_len))},
                       SamplingParams(max_tokens=tokens + 1, temperature=0, ignore_eos=True))
    engine.step()  # prefill (and the first token)
    t = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps / (time.perf_counter() - t)


def batch1(files: dict[str, Path], bench_binary: Path, threads: int, rounds: int, tokens: int, gbps: float, log=print) -> dict:
    from sieve import LLM

    engines = {label: LLM(str(path), kv_cache_memory_gb=0.25, num_threads=threads) for label, path in files.items()}
    for llm in engines.values():  # warm up: the first steps of a process are slower
        sieve_decode(llm, 16)
    runs: dict[str, dict[str, list[float]]] = {label: {"sieve": [], "llama.cpp": []} for label in files}
    for r in range(rounds):
        for label, path in files.items():
            runs[label]["llama.cpp"].append(llama_bench(bench_binary, path, threads, tokens))
            runs[label]["sieve"].append(sieve_decode(engines[label], tokens))
            log(f"round {r + 1}/{rounds} {label}: sieve {runs[label]['sieve'][-1]:.1f} tok/s, "
                f"llama.cpp {runs[label]['llama.cpp'][-1]:.1f} tok/s")
    out = {}
    for label, path in files.items():
        s, l = runs[label]["sieve"], runs[label]["llama.cpp"]
        step_bytes = GGUFCheckpoint(path).decode_bytes()
        model = engines[label].llm_engine.runner.model
        if model.greedy_head is not None:  # a greedy step reads the head's sketch instead of the head
            step_bytes += model.greedy_head.step_bytes_change
        floor = gbps * 1e9 / step_bytes
        out[label] = {"file": str(path), "dtype": str(engines[label].llm_engine.dtype).removeprefix("torch."),
                      "step_bytes": step_bytes, "floor_tok_s": floor,
                      "sieve_tok_s": statistics.median(s), "llama_cpp_tok_s": statistics.median(l),
                      "ratio": statistics.median(a / b for a, b in zip(s, l)), "rounds": runs[label]}
    return out


def batch1_table(rows: dict, gbps: float) -> str:
    lines = [f"batch-1 decode, greedy (median of rounds; floor = the bytes sieve's step reads ÷ {gbps:.1f} GB/s measured)",
             "| file | sieve dtype | MB per step | sieve tok/s | llama.cpp tok/s | sieve ÷ llama.cpp | floor tok/s | sieve % of floor |",
             "|---|---|---|---|---|---|---|---|"]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['dtype']} | {r['step_bytes'] / 1e6:.1f} | {r['sieve_tok_s']:.1f} | {r['llama_cpp_tok_s']:.1f} | "
                     f"**{r['ratio']:.2f}×** | {r['floor_tok_s']:.1f} | {r['sieve_tok_s'] / r['floor_tok_s']:.0%} |")
    return "\n".join(lines)


def run_gguf_peers(args) -> int:
    quiet_http_logs()
    src = Path(args.gguf_file)
    threads = args.threads or os.cpu_count() or 1
    gguf_dir = Path(args.gguf_dir) if args.gguf_dir else cache_root() / "gguf"
    log_dir = Path(args.log_dir) if args.log_dir else gguf_dir
    gguf_dir.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    files = gguf_files(src, [q for q in args.gguf.split(",") if q], gguf_dir)
    bw = measure_bandwidth("cpu")
    from sieve.kernels import cpu_ops

    print(f"peers on {src.name}: {', '.join(files)}; {threads} threads each; sieve kernels {cpu_ops().isa}, llama.cpp {args.llama_isa}; "
          f"bandwidth copy {bw.copy_gbps:.1f}, "
          f"triad {bw.triad_gbps:.1f}, read {bw.read_gbps:.1f} GB/s")
    out: dict = {"gguf_file": str(src), "threads": threads, "bandwidth_gbps": bw.best_gbps, "files": {k: str(v) for k, v in files.items()},
                 "sieve_isa": cpu_ops().isa, "llama_isa": args.llama_isa}

    def save():
        if args.output_json:
            Path(args.output_json).write_text(json.dumps(out, indent=2))

    if args.batch1_rounds > 0:
        bench_bin = find_llama_server(args, target="llama-bench")
        if bench_bin is None:
            raise SystemExit("llama-bench not found: add --build-llama-server")
        out["batch1"] = batch1(files, bench_bin, threads, args.batch1_rounds, args.batch1_tokens, bw.best_gbps)
        print(batch1_table(out["batch1"], bw.best_gbps))
        save()
    if not args.serving:
        return 0

    binary = find_llama_server(args)
    if binary is None:
        raise SystemExit("llama-server not found: add --build-llama-server")
    loads = parse_loads(args.concurrency, args.request_rate)
    key = "concurrency" if loads[0].concurrency is not None else "request_rate"
    parallel = max(l.concurrency or 32 for l in loads)
    slo = SLO(args.slo_ttft_ms / 1e3 if args.slo_ttft_ms else None, args.slo_tpot_ms / 1e3 if args.slo_tpot_ms else None)
    sessions = workload_from_args(args).build_points(GGUFCheckpoint(src).tokenizer(), len(loads))
    out["serving"], out["failed"] = {}, {}
    for label, path in files.items():
        floor = GGUFCheckpoint(path).decode_bytes() / (bw.best_gbps * 1e9)
        port = free_port()
        sieve_cmd = [sys.executable, "-m", "sieve.cli", "serve", "--model", str(path), "--port", str(port), "--num-threads", str(threads),
                     "--served-model-name", SERVED_NAME, "--max-num-seqs", str(max(64, parallel)), *args.sieve_arg]
        lcmd, desc = llama_cmd(binary, path, port, threads, parallel, args.ctx_per_slot, LLAMA_FLAGS.get(label, []))
        results = {}
        for engine, cmd in (("sieve", sieve_cmd), ("llama.cpp", lcmd)):
            print(f"== {label}, {engine}: {desc if engine == 'llama.cpp' else 'sieve serve'}")
            try:
                with Server(cmd, port, log_dir / f"{label}-{engine}.log", args.startup_timeout) as server:
                    target = Target(server.base_url, SERVED_NAME, ignore_eos=args.ignore_eos, timeout_s=args.timeout)
                    results[engine] = sweep(target, sessions, loads, slo, floor_step_s=floor, seed=args.workload_seed,
                                            progress=args.progress, sessions_per_user=args.prompts_per_user)
            except RuntimeError as e:
                print(f"{label} {engine} failed: {e}")
                out["failed"][f"{label} {engine}"] = str(e)[:2000]
        out["serving"][label] = results
        if len(results) == 2:
            rows = ratio_table(results["sieve"], results["llama.cpp"], key)
            results["ratios"] = rows
            print(format_table(rows, key, results["sieve"], results["llama.cpp"], f"llama.cpp ({label})"))
        save()
    if "batch1" in out:
        print(batch1_table(out["batch1"], bw.best_gbps))
    return 1 if out["failed"] else 0

