# Sourced by the device scripts (scripts/gpu_check.sh, scripts/gpu_ladder.sh): their results folder ($OUT, which the
# device tool sends back), the Python packages the device lacks, the copy of ../shared the tests read, and the GPU's
# name in the results. Prepared here once by scripts/gpu_prepare.sh (.whl and .gpu-shared: carry both in the call).
set -uo pipefail
OUT=${OUT:-bench-out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
if [ ! -d ../shared/models ] && [ -d .gpu-shared ]; then
  export SIEVE_SHARED="$PWD/.gpu-shared"  # ../shared does not travel (tests/conftest.py)
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv | tee "$OUT/gpu.txt"
