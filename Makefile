# Fresh machine: `make test` or `make run` creates .venv and installs everything first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install test run bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: here it resolves to the local CPU wheel (a bare `torch` pulls GBs of CUDA packages)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[test,serve]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest

run: $(STAMP)
	$(BIN)/sieve serve $(ARGS)

bench: $(STAMP)
	$(BIN)/sieve bench offline --model bench-out/qwen2.5-0.5b --create-model qwen2.5-0.5b --dtype bfloat16 --output-json bench-out/offline.json

clean:
	rm -rf $(VENV) build *.egg-info
