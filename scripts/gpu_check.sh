#!/usr/bin/env bash
# Issue 62's device check, as one call of under 10 minutes: the CUDA tests (the captured decode steps' among them), then
# decode step time against batch size (1, 8, 32, 64), eager and with CUDA graphs (with and without the fused pointwise
# kernels), beside the HBM floor measured in the same run, on random checkpoints shaped like SmolLM2-135M and
# Llama-3.2-1B, written on the device (nothing large travels; a step's time is its shape's).
#
# Prepared here: the wheels the device lacks (scripts/gpu_env.sh). The call:
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=590)
# Results come back under $OUT: gpu.txt, cuda-tests.log, decode-steps-*.json.
source "$(dirname "$0")/gpu_env.sh"
timeout 240 python3 -m pytest -q -x tests/test_cuda.py 2>&1 | tee "$OUT/cuda-tests.log" | tail -5
for shape in smollm2-135m llama-3.2-1b; do
  python3 -m sieve.bench.checkpoints "$shape" "bench-out/$shape" --no-tokenizer
  timeout 150 python3 scripts/decode_steps.py --model "bench-out/$shape" --device cuda --dtype bfloat16 \
    --batches 1,8,32,64 --modes eager,graphs,graphs-unfused --output-json "$OUT/decode-steps-$shape.json" | grep -v '^ '
done
