# Sourced by the device scripts (scripts/gpu_check.sh, scripts/gpu_ladder.sh): their results folder ($OUT, which the
# device tool sends back), the Python packages the device lacks, and the GPU's name in the results.
#
# The device's python3 holds torch, transformers, peft, httpx, prometheus-client and pyyaml, and reaches no registry;
# the rest travels as wheels, fetched here once (carry [".whl"] in the call):
#   echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_17_x86_64 -d .whl fastapi starlette uvicorn pydantic pydantic-core \
#     annotated-types typing-inspection gguf llguidance
set -uo pipefail
OUT=${OUT:-bench-out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv | tee "$OUT/gpu.txt"
