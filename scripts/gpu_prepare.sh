#!/usr/bin/env bash
# Run here, once, before the device scripts (scripts/gpu_check.sh): what they need that the device lacks.
#   .whl/         the Python packages its python3 lacks (it holds torch, transformers, peft, httpx, prometheus-client and
#                 pyyaml, and reaches no registry), for Python 3.12 on x86-64;
#   .gpu-shared/  what the CUDA tests read from ../shared (which does not travel): stories260K and its text.
# Both are ignored by git; name them in the call's carry: run(command="bash scripts/gpu_check.sh ...",
# carry=[".whl", ".gpu-shared"], timeout_s=590).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 -d .whl fastapi starlette uvicorn pydantic pydantic-core annotated-types \
  typing-inspection gguf llguidance
mkdir -p .gpu-shared/models .gpu-shared/data
cp -r ../shared/models/stories260K .gpu-shared/models/
cp ../shared/data/tinystories_valid_sample.txt .gpu-shared/data/
du -sh .whl .gpu-shared
