#!/usr/bin/env bash
# Issue 61's CUDA run, as one device call of under 10 minutes: the ladder's lossless rungs and int8/FP8 weights and
# KV on a random-weights checkpoint shaped like Llama-3.2-1B (bf16), users within the SLO per rung, and the planner's
# HBM floor beside them (its roofline column, from the bandwidth the run measures).
#
# Prepared here, before the call (it cannot be fetched there; the wheels: scripts/gpu_env.sh):
#   python -m sieve.bench.checkpoints llama-3.2-1b bench-out/llama-3.2-1b --tokenizer-only   # 128k-token BPE, 9.7 MB
# The call: run(command="bash scripts/gpu_ladder.sh", carry=["bench-out/llama-3.2-1b", ".whl"], timeout_s=590)
source "$(dirname "$0")/gpu_env.sh"
python3 -m sieve.bench.checkpoints llama-3.2-1b bench-out/llama-3.2-1b --no-tokenizer  # the weights, beside the tokenizer
timeout 500 python3 -m sieve.cli bench ladder --model bench-out/llama-3.2-1b --workload chat --naive sieve \
  --rungs batching,prefix,int8,fp8,kv-fp8 --warmup 3 --measure 10 --growth 2 --resolution 0.25 --max-users 512 \
  --memory-gb 20 --output-json "$OUT/ladder-llama-3.2-1b-h200.json" 2>&1 | tee "$OUT/ladder.log"
