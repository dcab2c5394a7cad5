#!/usr/bin/env bash
# The device check, as one call of under 10 minutes: the parts named (default: tests w8a8 lora), in that order.
#   tests  the CUDA tests (tests/test_cuda.py: quantized kernels, W8A8 int8 and FP8, KV compression, speculation,
#          captured decode steps, multi-LoRA);
#   w8a8   issue 63's figure: FP8 W8A8 (_scaled_mm) and int8 W8A8 (torch._int_mm) against bf16, the prefill of 8 x 512
#          tokens and a decode step of 64 sequences, on a random checkpoint shaped like Llama-3.2-1B;
#   lora   issue 67's figure: `sieve bench lora --users 64` (8 adapters of rank 16 against base-only) on that checkpoint;
#   steps  decode step time against batch size (1, 8, 32, 64), eager and with CUDA graphs (with and without the fused
#          pointwise kernels), beside the HBM floor measured in the same run, on SmolLM2-135M and Llama-3.2-1B shapes.
# Checkpoints are written on the device (nothing large travels; a step's time is its shape's).
#
# Prepared here: bash scripts/gpu_prepare.sh (wheels, the test data). The call:
#   run(command="bash scripts/gpu_check.sh", carry=[".whl", ".gpu-shared"], timeout_s=590)
# Results come back under $OUT: gpu.txt, cuda-tests.log, w8a8-steps-llama-3.2-1b.json, lora-64-llama-3.2-1b.json,
# decode-steps-*.json.
source "$(dirname "$0")/gpu_env.sh"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests w8a8 lora)
one_b=bench-out/llama-3.2-1b
checkpoint() { [ -f "bench-out/$1/config.json" ] || python3 -m sieve.bench.checkpoints "$1" "bench-out/$1" --no-tokenizer; }
for part in "${parts[@]}"; do
  echo "== $part"
  case "$part" in
    tests) timeout 240 python3 -m pytest -q tests/test_cuda.py 2>&1 | tee "$OUT/cuda-tests.log" | tail -15 ;;
    w8a8) checkpoint llama-3.2-1b
      timeout 150 python3 scripts/quant_steps.py --model "$one_b" --device cuda --formats bf16,fp8,w8a8 \
        --prefill-prompts 8 --prompt-len 512 --decode-batch 64 --output-json "$OUT/w8a8-steps-llama-3.2-1b.json" | grep -v '^INFO' ;;
    lora) checkpoint llama-3.2-1b
      timeout 150 python3 -m sieve.cli bench lora --model "$one_b" --users 64 --requests 128 --max-tokens 32 --repeats 3 \
        --output-json "$OUT/lora-64-llama-3.2-1b.json" 2>&1 | grep -v '^INFO' ;;
    steps) for shape in smollm2-135m llama-3.2-1b; do
        checkpoint "$shape"
        timeout 150 python3 scripts/decode_steps.py --model "bench-out/$shape" --device cuda --dtype bfloat16 \
          --batches 1,8,32,64 --modes eager,graphs,graphs-unfused --output-json "$OUT/decode-steps-$shape.json" | grep -v '^ '
      done ;;
    *) echo "unknown part $part: tests, w8a8, lora or steps"; exit 2 ;;
  esac
done
