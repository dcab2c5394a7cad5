"""`sieve` command line: generate, serve, eval, quantize, distill, finetune, plan, router, bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from sieve.engine_args import add_engine_args, config_from_args


def _torchrun_worker(args: argparse.Namespace) -> bool:
    """Under torchrun every rank runs the same command: ranks above 0 follow rank 0's engine instead. True if this
    process was such a rank (and its work is done)."""
    from sieve.distributed import launched_by_torchrun, run_worker

    if args.tensor_parallel_size <= 1 or not launched_by_torchrun() or int(os.environ["RANK"]) == 0:
        return False
    run_worker(config_from_args(args))
    return True


def cmd_generate(args: argparse.Namespace) -> int:
    from sieve.engine import LLMEngine
    from sieve.sampling_params import SamplingParams

    try:  # every sampling and constraint flag is checked before the model loads (on every rank alike)
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            min_p=args.min_p, seed=args.seed_sampling, stop=args.stop or None, ignore_eos=args.ignore_eos,
            structured_outputs=_structured_from_args(args),
        )
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if _torchrun_worker(args):
        return 0
    engine = LLMEngine(config_from_args(args))
    try:
        return _generate(engine, args, params)
    finally:
        engine.shutdown()


def _generate(engine, args: argparse.Namespace, params) -> int:
    from sieve.engine import RequestError

    prompt = args.prompt
    if args.chat:
        tok = engine.tokenizer
        if not getattr(tok, "chat_template", None):
            print(f"error: --chat: {engine.config.model} has no chat template (a base model); pass the prompt without "
                  "--chat", file=sys.stderr)
            return 2
        prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    try:  # (what needs the model: a grammar compiled against its vocabulary, the prompt's length)
        engine.add_request("cli", prompt, params)
    except (RequestError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = None
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.deltas[0][0])
            sys.stdout.flush()
    sys.stdout.write("\n")
    if out is not None and args.verbose:
        print(f"[finish_reason={out.outputs[0].finish_reason} tokens={len(out.outputs[0].token_ids)}]", file=sys.stderr)
    return 0


def _structured_from_args(args: argparse.Namespace):
    """--json-schema, --regex, --choice, --grammar / --grammar-file (llama.cpp's names): at most one."""
    from sieve.structured import StructuredOutputsParams

    schema, grammar = args.json_schema, args.grammar
    if schema is not None and schema.startswith("@"):  # a file
        schema = Path(schema[1:]).read_text()
    if args.grammar_file:
        if grammar is not None:
            raise ValueError("give --grammar or --grammar-file, not both")
        grammar = Path(args.grammar_file).read_text()
    given = {"json": schema, "regex": args.regex, "choice": args.choice, "grammar": grammar}
    if all(v is None for v in given.values()):
        return None
    return StructuredOutputsParams(**given)


def cmd_serve(args: argparse.Namespace) -> int:
    from sieve.engine import LLMEngine
    from sieve.server.app import ServerLimits, create_app
    from sieve.server.auth import APIKeys
    from sieve.server.serve import serve
    from sieve.server.tenants import Tenants

    if _torchrun_worker(args):
        return 0
    try:
        keys = APIKeys.load(args.api_key, args.api_keys_file)
        tenants = Tenants.load(args.tenants) if args.tenants else None
        if args.batch_dir:
            Path(args.batch_dir).mkdir(parents=True, exist_ok=True)
            if not os.access(args.batch_dir, os.W_OK):
                raise ValueError(f"--batch-dir {args.batch_dir} is not writable")
        if tenants is not None and keys.enabled:
            raise ValueError("--tenants holds the API keys: give it without --api-key and --api-keys-file")
        limits = ServerLimits(max_stop_strings=args.max_stop_strings, max_stop_string_chars=args.max_stop_string_chars,
                              max_logit_bias=args.max_logit_bias, max_prompt_bytes=args.max_prompt_bytes,
                              max_stream_backlog=args.max_stream_backlog, grammar_workers=args.structured_outputs_compile_workers)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    config = config_from_args(args)
    if tenants is not None:
        config.tier_shares = tenants.tier_shares()
    app = create_app(lambda: LLMEngine(config), served_model_name=args.served_model_name, api_key=keys,
                     shared_prefix_cache=args.shared_prefix_cache,
                     max_waiting=args.max_waiting, allow_client_priority=args.allow_client_priority,
                     metrics_public=args.metrics_public, health_stall_seconds=args.health_stall_seconds, max_n=args.max_n,
                     max_prompts=args.max_prompts_per_request, max_body_bytes=args.max_request_body_bytes,
                     max_prompt_tokens=args.max_prompt_tokens, tokenizer_workers=args.tokenizer_workers,
                     grammar_timeout=args.structured_outputs_compile_timeout, webui=not args.no_webui, limits=limits,
                     tenants=tenants, batch_dir=args.batch_dir, embedding_pooling=args.embedding_pooling,
                     max_stored_responses=args.max_stored_responses, lora_dir=args.lora_dir)
    name = args.served_model_name or app.state.async_engine.engine.model_name
    print(f"sieve serving {name} on http://{args.host}:{args.port}/v1", flush=True)
    rc = serve(app, args.host, args.port, grace=args.shutdown_grace)
    if rc != 0:  # a dead engine: its native threads (a broken gloo group's) may abort the interpreter's own exit
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


def cmd_eval(args: argparse.Namespace) -> int:
    from sieve.evaluate import evaluate

    options = {"quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
               "quantization_group_size": args.quantization_group_size, "quantize_lm_head": args.quantize_lm_head,
               "dequantize": args.dequantize, "activation_quantization": args.activation_quantization}
    try:
        r = evaluate(args.model, args.data, dtype=args.dtype, window=args.window, max_windows=args.max_windows,
                     chunk=args.chunk, reference=args.reference, reference_dtype=args.reference_dtype,
                     reference_dequantize=args.reference_dequantize, **options)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    label = ", ".join(f"{k}={v}" for k, v in options.items() if v not in (None, "auto", False, 128)) or "no lossy option"
    if args.reference:
        label = f"{args.model} against {args.reference}" + ("" if label == "no lossy option" else f", {label}")
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(f"{label}: {r['tokens_scored']} tokens in {r['windows']} windows of {r['window']}")
        print(f"  perplexity {r['perplexity']:.4f} (reference {r['reference_perplexity']:.4f}), "
              f"KL {r['kl_divergence']:.5f} nats/token, top-1 agreement {r['top1_agreement']:.2%}, "
              f"linear weights {r['weight_bytes'] / 1e6:.3f} MB (reference {r['reference_weight_bytes'] / 1e6:.3f} MB)")
    if args.max_kl is not None and r["kl_divergence"] > args.max_kl:
        print(f"KL divergence {r['kl_divergence']:.5f} exceeds --max-kl {args.max_kl}", file=sys.stderr)
        return 3
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from sieve.config import ConfigError

    if args.method == "smoothquant":
        return cmd_smoothquant(args)
    if args.alpha is not None:
        raise ConfigError("--alpha is SmoothQuant's (--method smoothquant)")
    from sieve.quant.awq import awq_quantize

    report = awq_quantize(args.model, args.calib, args.out, group=args.group_size, seq_len=args.seq_len,
                          max_windows=args.max_windows)
    awq = sum(v["awq"] for v in report.values())
    plain = sum(v["plain"] for v in report.values())
    print(f"output error of the quantized linears on the calibration text: AWQ {awq:.4g} vs plain rounding {plain:.4g} "
          f"({awq / plain:.2f}x)")
    return 0


def cmd_smoothquant(args: argparse.Namespace) -> int:
    from sieve.config import ConfigError
    from sieve.quant.smoothquant import smoothquant

    alpha = args.alpha or "auto"
    if alpha != "auto":
        try:
            alpha = float(alpha)
        except ValueError:
            alpha = -1.0
        if not 0 <= alpha <= 1:
            raise ConfigError(f"--alpha takes auto or a number in [0, 1], got {args.alpha!r}")
    report = smoothquant(args.model, args.calib, args.out, alpha=alpha, seq_len=args.seq_len, max_windows=args.max_windows)
    smoothed = sum(v["smoothed"] for v in report.values())
    plain = sum(v["plain"] for v in report.values())
    print(f"W8A8 output error of the linears on the calibration text: smoothed {smoothed:.4g} vs unsmoothed {plain:.4g} "
          f"({smoothed / plain:.2f}x)")
    return 0


def _write_json_result(run, args: argparse.Namespace) -> int:
    result = run(args)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def cmd_bench_ladder(args: argparse.Namespace) -> int:
    from sieve.bench.ladder import run_ladder

    run_ladder(args)
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    if args.kv:
        from sieve.train.kv_distill import run_kv_distill

        return _write_json_result(run_kv_distill, args)
    from sieve.train.distill import run_distill

    return _write_json_result(run_distill, args)


def cmd_finetune(args: argparse.Namespace) -> int:
    from sieve.train.lora import run_finetune

    try:
        return _write_json_result(run_finetune, args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def cmd_bench_offline(args: argparse.Namespace) -> int:
    from sieve.bench.offline import run_offline_benchmark

    return _write_json_result(run_offline_benchmark, args)


def cmd_bench_quant(args: argparse.Namespace) -> int:
    from sieve.bench.quant import run_quant_benchmark

    return _write_json_result(run_quant_benchmark, args)


def cmd_bench_spec(args: argparse.Namespace) -> int:
    from sieve.bench.spec import run_bench_spec

    return _write_json_result(run_bench_spec, args)


def cmd_bench_structured(args: argparse.Namespace) -> int:
    from sieve.bench.structured import run_bench_structured

    return _write_json_result(run_bench_structured, args)


def cmd_bench_moe(args: argparse.Namespace) -> int:
    from sieve.bench.moe import run_bench_moe

    return _write_json_result(run_bench_moe, args)


def cmd_bench_families(args: argparse.Namespace) -> int:
    from sieve.bench.families import run_bench_families

    return _write_json_result(run_bench_families, args)


def cmd_bench_window(args: argparse.Namespace) -> int:
    from sieve.bench.window import run_bench_window

    return _write_json_result(run_bench_window, args)


def cmd_bench_compression(args: argparse.Namespace) -> int:
    from sieve.bench.compression import run_bench_compression

    return _write_json_result(run_bench_compression, args)


def cmd_bench_tiers(args: argparse.Namespace) -> int:
    from sieve.bench.tiers import run_bench_tiers

    return _write_json_result(run_bench_tiers, args)


def cmd_bench_lora(args: argparse.Namespace) -> int:
    from sieve.bench.lora import run_bench_lora

    return _write_json_result(run_bench_lora, args)


def cmd_bench_kv(args: argparse.Namespace) -> int:
    from sieve.bench.kv import run_bench_kv

    return _write_json_result(run_bench_kv, args)


def cmd_bench_bandwidth(args: argparse.Namespace) -> int:
    from sieve.bench.bandwidth import measure_bandwidth, report_floor

    bw = measure_bandwidth(args.device if args.device != "auto" else "cpu", array_mib=args.array_mib)
    print(f"memory bandwidth ({bw.threads} threads, {bw.array_mib} MiB arrays): copy {bw.copy_gbps:.1f} GB/s, "
          f"triad {bw.triad_gbps:.1f} GB/s, read-only {bw.read_gbps:.1f} GB/s")
    if args.model:
        report_floor(args, bw)
    return 0


def add_generate_parser(sub) -> None:
    """`sieve generate`: one prompt, sampled or constrained."""
    g = sub.add_parser("generate", help="generate text for one prompt")
    add_engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed-sampling", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json-schema", "-j", default=None, help="constrain the output to a JSON schema (JSON text, or @file)")
    g.add_argument("--regex", default=None, help="constrain the output to a regular expression")
    g.add_argument("--choice", action="append", default=None, help="constrain the output to one of these strings (repeat)")
    g.add_argument("--grammar", default=None, help="constrain the output to a grammar (Lark, or llama.cpp's GBNF)")
    g.add_argument("--grammar-file", default=None)
    g.add_argument("--verbose", action="store_true")
    g.set_defaults(func=cmd_generate)


def cmd_run_batch(args: argparse.Namespace) -> int:
    from sieve.engine import LLMEngine
    from sieve.server.run_batch import run_batch

    try:
        open(args.input_file, "rb").close()
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine = LLMEngine(config_from_args(args))
    try:
        counts = run_batch(engine, args.input_file, args.output_file, args.served_model_name)
    finally:
        engine.shutdown()
    print(f"{counts['completed']} of {counts['total']} requests answered, {counts['failed']} failed, in "
          f"{counts['seconds']} s: {args.output_file}", file=sys.stderr)
    return 0


def add_run_batch_parser(sub) -> None:
    """`sieve run-batch`: an OpenAI batch file run offline, as vLLM's."""
    rb = sub.add_parser("run-batch", help="run an OpenAI batch file (JSONL) offline: a result line per request")
    add_engine_args(rb)
    rb.add_argument("-i", "--input-file", required=True, help="JSONL: {custom_id, method, url, body} per line")
    rb.add_argument("-o", "--output-file", required=True, help="JSONL: {id, custom_id, response, error} per line")
    rb.add_argument("--served-model-name", default=None, help="the model name the requests give (default: --model)")
    rb.set_defaults(func=cmd_run_batch)


def add_serve_parser(sub) -> None:
    """`sieve serve`: the engine behind the OpenAI-compatible server, with its limits and keys."""
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(sv)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", action="append", default=None, help="a client key (repeat for several)")
    sv.add_argument("--api-keys-file", default=None, help="client keys, a line each: TENANT:KEY or KEY (each tenant's prefix "
                    "cache is kept apart from the others')")
    sv.add_argument("--tenants", default=None, metavar="FILE",
                    help="JSON or YAML: each tenant's keys (plain or sha256), tier and limits (requests/tokens per minute, "
                         "requests in flight); see docs/serving.md#tenants. In place of --api-key and --api-keys-file")
    sv.add_argument("--batch-dir", default=None, metavar="DIR",
                    help="serve OpenAI's Files and Batch API, its files, batches and results kept in DIR (SQLite); batch "
                         "requests run in the capacity interactive ones leave")
    sv.add_argument("--embedding-pooling", default="mean", choices=["mean", "last"],
                    help="how /v1/embeddings pools the model's final hidden states over the input: their mean, or the "
                         "last token's (the mean bypasses the prefix cache)")
    sv.add_argument("--lora-dir", default=None, metavar="DIR",
                    help="with --enable-lora: POST /v1/load_lora_adapter may read adapters from inside DIR (off without it: "
                         "a client never names a path the server reads)")
    sv.add_argument("--max-stored-responses", type=int, default=1000, metavar="N",
                    help="the Responses API keeps the last N stored responses in memory (GET /v1/responses/{id}, "
                         "previous_response_id); older ones are forgotten")
    sv.add_argument("--shared-prefix-cache", action="store_true",
                    help="let several tenants' requests share prefix-cache blocks (then no response reports cached_tokens)")
    sv.add_argument("--allow-client-priority", action="store_true",
                    help="honour the `priority` field of requests (otherwise setting it is a 400)")
    sv.add_argument("--metrics-public", action="store_true", help="serve /metrics without the --api-key")
    sv.add_argument("--max-n", type=int, default=128, help="most choices (n) one request may ask for")
    sv.add_argument("--max-prompts-per-request", type=int, default=64, help="most prompts in one completions request")
    sv.add_argument("--max-request-body-bytes", type=int, default=16 << 20, help="larger bodies get 413")
    sv.add_argument("--max-prompt-tokens", type=int, default=None, help="longer prompts get 400 (default: the context length)")
    sv.add_argument("--tokenizer-workers", type=int, default=1, help="threads that tokenize prompts and render chat templates")
    sv.add_argument("--structured-outputs-compile-timeout", type=float, default=10.0,
                    help="seconds a request's grammar (response_format, structured_outputs, tool_choice) may take to compile; past it, 400")
    sv.add_argument("--structured-outputs-compile-workers", type=int, default=2,
                    help="threads that compile grammars; the timeout counts from a compile's start, not its wait")
    sv.add_argument("--max-stop-strings", type=int, default=32, help="most stop strings one request may give")
    sv.add_argument("--max-stop-string-chars", type=int, default=256, help="longest stop string (streams hold back this much)")
    sv.add_argument("--max-logit-bias", type=int, default=1024, help="most logit_bias entries one request may give")
    sv.add_argument("--max-prompt-bytes", type=int, default=None,
                    help="longer prompts get 400 before tokenizing (default: the prompt token limit x the longest token)")
    sv.add_argument("--max-stream-backlog", type=int, default=256,
                    help="outputs a stream may leave unread before its request is aborted (a reader too slow)")
    sv.add_argument("--no-webui", action="store_true", help="do not serve the chat playground at /")
    sv.add_argument("--health-stall-seconds", type=float, default=60.0,
                    help="/health answers 503 when work is queued and no step has finished for this long")
    sv.add_argument("--served-model-name", default=None)
    sv.add_argument("--max-waiting", type=int, default=None, help="answer 429 when this many requests wait")
    sv.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds requests in flight get to finish on SIGTERM")
    sv.set_defaults(slo_ttft_ms=2000.0, slo_tpot_ms=100.0)  # a person reading a stream: 10 tokens/s each, a first token within 2 s
    sv.set_defaults(func=cmd_serve)


def add_tool_parsers(sub) -> None:
    """`sieve eval`, `quantize`, `distill`, `plan` and `router`."""
    ev = sub.add_parser("eval", help="perplexity, KL divergence and top-1 agreement of lossy options against the checkpoint")
    add_engine_args(ev)
    ev.add_argument("--data", required=True, help="text file to score")
    ev.add_argument("--reference", default=None, help="unquantized checkpoint to compare with (default: --model as it is)")
    ev.add_argument("--reference-dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                    help="the reference's dtype (default: --dtype)")
    ev.add_argument("--reference-dequantize", action="store_true", help="widen the reference's quantized GGUF weights")
    ev.add_argument("--window", type=int, default=256, help="tokens per scored window")
    ev.add_argument("--max-windows", type=int, default=None)
    ev.add_argument("--chunk", type=int, default=64, help="prefill chunk: later chunks read K/V back from the cache")
    ev.add_argument("--max-kl", type=float, default=None, help="exit with status 3 when the mean KL exceeds this")
    ev.add_argument("--json", action="store_true")
    ev.set_defaults(func=cmd_eval)

    qz = sub.add_parser("quantize", help="write an AWQ (INT4, AutoAWQ layout) or SmoothQuant W8A8 (compressed-tensors "
                                         "layout) checkpoint from calibration text")
    qz.add_argument("--model", required=True)
    qz.add_argument("--method", default="awq", choices=["awq", "smoothquant"])
    qz.add_argument("--alpha", default=None, help="SmoothQuant's migration strength: auto (searched per layer and group, "
                                                  "the default) or a number in [0, 1]")
    qz.add_argument("--calib", required=True, help="calibration text file")
    qz.add_argument("--out", required=True)
    qz.add_argument("--group-size", type=int, default=128)
    qz.add_argument("--seq-len", type=int, default=256)
    qz.add_argument("--max-windows", type=int, default=32)
    qz.set_defaults(func=cmd_quantize)

    ds = sub.add_parser("distill", help="train speculative heads (Medusa) on the target's own answers, or (--kv fp8) fine-tune it to tolerate an FP8 KV cache")
    from sieve.train.distill import add_distill_args

    add_distill_args(ds)
    from sieve.train.kv_distill import add_kv_distill_args

    add_kv_distill_args(ds)
    ds.set_defaults(func=cmd_distill)
    ft = sub.add_parser("finetune", help="train a LoRA adapter (--lora) on your own JSONL, written in PEFT's format")
    from sieve.train.lora import add_finetune_args

    add_finetune_args(ft)
    ft.set_defaults(func=cmd_finetune)
    pl = sub.add_parser("plan", help="roofline planner: bytes per token, KV per token, users per device")
    from sieve.plan.command import add_plan_args, run_plan

    add_plan_args(pl)
    pl.set_defaults(func=run_plan)
    from sieve.router.cli import add_router_parser

    add_router_parser(sub)


def add_bench_parsers(sub) -> None:
    """`sieve bench ...`: every benchmark."""
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    add_throughput_benches(bench)
    add_feature_benches(bench)


def add_throughput_benches(bench) -> None:
    """offline, serve, peers, quant and spec."""
    o = bench.add_parser("offline", help="offline throughput against plain transformers and the bandwidth floor")
    add_engine_args(o)
    o.add_argument("--create-model", default=None, choices=["qwen2.5-0.5b", "llama-3.2-1b", "smollm2-135m"], help="write a random checkpoint of this shape at --model if absent")
    o.add_argument("--num-prompts", type=int, default=200)
    o.add_argument("--input-len", default="32:1024", help="min:max prompt tokens")
    o.add_argument("--output-len", default="16:512", help="min:max output tokens")
    o.add_argument("--workload-seed", type=int, default=0)
    o.add_argument("--hf-one-at-a-time", type=int, default=8, help="requests of the workload run through HF generate one by one (0: skip)")
    o.add_argument("--hf-static-batches", type=int, default=2, help="static batches of 16 run through HF generate (0: skip)")
    o.add_argument("--batch1-tokens", type=int, default=128, help="decode tokens for the batch-1 measurement")
    o.add_argument("--output-json", default=None)
    o.set_defaults(func=cmd_bench_offline)
    bs = bench.add_parser("serve", help="load-test any OpenAI-compatible endpoint: TTFT, TPOT, ITL, throughput, goodput")
    from sieve.bench.serve_command import add_bench_serve_args, run_bench_serve

    add_bench_serve_args(bs)
    bs.set_defaults(func=run_bench_serve)
    pe = bench.add_parser("peers", help="sieve vs llama.cpp on the same checkpoint and workload (extra: peers)")
    from sieve.bench.peers import add_peers_args, run_peers

    add_peers_args(pe)
    pe.set_defaults(func=run_peers)
    bq = bench.add_parser("quant", help="each weight format against bf16 (batch 1, many at once) and KV capacity per KV dtype")
    bq.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (a GGUF file is widened to bf16 first)")
    bq.add_argument("--formats", default="bf16,int8,fp8,int4,awq",
                    help="comma list of bf16, int8, fp8, int4, awq, w8a8, w8a8-vnni, smoothquant (the last three: int8 "
                         "activations; w8a8-vnni: W8A8 with the AMX-INT8 tiles off)")
    bq.add_argument("--awq-model", default=None, help="AWQ checkpoint of the same model (from `sieve quantize`)")
    bq.add_argument("--smoothquant-model", default=None,
                    help="W8A8 checkpoint of the same model (from `sieve quantize --method smoothquant`, or llm-compressor)")
    bq.add_argument("--group-size", type=int, default=128)
    bq.add_argument("--quantize-lm-head", action="store_true", help="quantize the LM head too (it is tied to the embedding in many models)")
    bq.add_argument("--batch1-tokens", type=int, default=96)
    bq.add_argument("--concurrent", type=int, default=32)
    bq.add_argument("--rounds", type=int, default=3, help="rounds of the concurrent workload per format (best is kept)")
    bq.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="KV budget of each loaded format")
    bq.add_argument("--prompt-len", type=int, default=128)
    bq.add_argument("--output-len", type=int, default=128)
    bq.add_argument("--kv-context", type=int, default=4096)
    bq.add_argument("--kv-memory-gb", type=float, default=2.0)
    bq.add_argument("--output-json", default=None)
    bq.set_defaults(func=cmd_bench_quant)
    bsp = bench.add_parser("spec", help="speculative decoding against speculation off: batch 1 and N users")
    from sieve.bench.spec import add_bench_spec_args

    add_bench_spec_args(bsp)
    bsp.set_defaults(func=cmd_bench_spec)


def add_feature_benches(bench) -> None:
    """structured, moe, window, kv, families, balance, pd, ladder and bandwidth."""
    bst = bench.add_parser("structured", help="every request constrained by a JSON schema against none: N users, mask time")
    from sieve.bench.structured import add_bench_structured_args

    add_bench_structured_args(bst)
    bst.set_defaults(func=cmd_bench_structured)
    bmo = bench.add_parser("moe", help="mixture-of-experts decode step time against batch size, and the experts touched")
    from sieve.bench.moe import add_bench_moe_args

    add_bench_moe_args(bmo)
    bmo.set_defaults(func=cmd_bench_moe)
    bw = bench.add_parser("window", help="sliding-window layers against every layer global: KV per sequence, sequences that fit, step time")
    from sieve.bench.window import add_bench_window_args

    add_bench_window_args(bw)
    bw.set_defaults(func=cmd_bench_window)
    bkv = bench.add_parser("kv", help="KV-cache dtypes: bytes per token of context, sequences that fit, decode step at each context")
    from sieve.bench.kv import add_bench_kv_args

    add_bench_kv_args(bkv)
    bkv.set_defaults(func=cmd_bench_kv)
    bti = bench.add_parser("tiers", help="the KV tiers: returning conversations' TTFT with a disk tier and without, a restart, "
                                         "a tier slower than recomputing")
    from sieve.bench.tiers import add_bench_tiers_args

    add_bench_tiers_args(bti)
    bti.set_defaults(func=cmd_bench_tiers)
    blo = bench.add_parser("lora", help="many LoRA adapters over one base: throughput against the base alone, what LoRA on "
                                        "costs base requests, the bytes a step reads, adapter load time")
    from sieve.bench.lora import add_bench_lora_args

    add_bench_lora_args(blo)
    blo.set_defaults(func=cmd_bench_lora)
    bco = bench.add_parser("compression", help="KV compression: each press's retrieval and long-document accuracy against "
                                               "ratio, and the decode step at a long context, compressed and not")
    from sieve.bench.compression import add_bench_compression_args

    add_bench_compression_args(bco)
    bco.set_defaults(func=cmd_bench_compression)
    bfa = bench.add_parser("families", help="dense, MoE, latent attention, sliding windows, Mamba hybrid: KV or state per sequence, fit, step time")
    from sieve.bench.families import add_bench_families_args

    add_bench_families_args(bfa)
    bfa.set_defaults(func=cmd_bench_families)
    bb = bench.add_parser("balance", help="the router's replica balancing (round robin, cache-aware) on multi-turn chat")
    from sieve.bench.balance import add_balance_args, run_bench_balance

    add_balance_args(bb)
    bb.set_defaults(func=run_bench_balance)
    bpd = bench.add_parser("pd", help="prefill/decode disaggregation (1 + 1 core behind the gateway) against one 2-core server, "
                                      "under chat turns mixed with long prompts")
    from sieve.bench.pd import add_bench_pd_args, run_bench_pd

    add_bench_pd_args(bpd)
    bpd.set_defaults(func=run_bench_pd)
    bl = bench.add_parser("ladder", help="users per device within an SLO, rung by rung (batching, prefix caching, int8, "
                                         "speculation, FP8 KV, int4), beside the planner and each rung's quality cost")
    from sieve.bench.ladder import add_bench_ladder_args

    add_bench_ladder_args(bl)
    bl.set_defaults(func=cmd_bench_ladder)
    b = bench.add_parser("bandwidth", help="memory bandwidth and the decode floor it implies")
    b.add_argument("--model", default=None)
    b.add_argument("--dtype", default="auto")
    b.add_argument("--device", default="auto")
    b.add_argument("--context", type=int, default=0, help="tokens of KV read per sequence per step")
    b.add_argument("--array-mib", type=int, default=512)
    b.set_defaults(func=cmd_bench_bandwidth)


def build_parser() -> argparse.ArgumentParser:
    """Every `sieve` command and its flags (the docs' checker parses their commands with it too)."""
    parser = argparse.ArgumentParser(prog="sieve", description="LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_serve_parser(sub)
    add_run_batch_parser(sub)
    add_tool_parsers(sub)
    add_bench_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    from sieve.config import ConfigError
    from sieve.models.arch import UnsupportedModelError
    from sieve.models.gguf import GGUFError

    try:
        return args.func(args)
    except (GGUFError, UnsupportedModelError, FileNotFoundError, ConfigError) as e:  # a model that cannot load: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
