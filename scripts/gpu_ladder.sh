#!/usr/bin/env bash
# Issue 61's CUDA run, as one device call of under 10 minutes: the ladder's lossless rungs and int8/FP8 weights and
# KV on a random-weights checkpoint shaped like Llama-3.2-1B (bf16), users within the SLO per rung, and the planner's
# HBM floor beside them (its roofline column, from the bandwidth the run measures).
#
# Prepared here, before the call (neither can be fetched there):
#   python -m sieve.bench.checkpoints llama-3.2-1b bench-out/llama-3.2-1b --tokenizer-only   # a 128k-token BPE: minutes
#   echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_17_x86_64 -d .whl fastapi starlette uvicorn pydantic pydantic-core \
#     annotated-types typing-inspection gguf llguidance
#   (the device's python3 holds torch, transformers, httpx, prometheus-client, pyyaml; docs/benchmarks.md lists the rest)
# The call: run(command="bash scripts/gpu_ladder.sh", carry=["bench-out/llama-3.2-1b", ".whl"], timeout_s=590)
set -uo pipefail
OUT=${OUT:-bench-out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv | tee "$OUT/gpu.txt"
python3 -m sieve.bench.checkpoints llama-3.2-1b bench-out/llama-3.2-1b --no-tokenizer  # the weights, beside the tokenizer
timeout 500 python3 -m sieve.cli bench ladder --model bench-out/llama-3.2-1b --workload chat --naive sieve \
  --rungs batching,prefix,int8,fp8,kv-fp8 --warmup 3 --measure 10 --growth 2 --resolution 0.25 --max-users 512 \
  --memory-gb 20 --output-json "$OUT/ladder-llama-3.2-1b-h200.json" 2>&1 | tee "$OUT/ladder.log"
