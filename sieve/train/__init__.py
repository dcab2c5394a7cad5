"""Training commands: `sieve distill` (drafters for speculative decoding: Medusa heads, EAGLE layers, small draft
models cut from the target: distill.py, draft.py; KV-cache quantization scales: kv_distill.py) and `sieve finetune
--lora` (LoRA adapters in PEFT's format: lora.py)."""
