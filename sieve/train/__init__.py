"""Training commands (`sieve distill`): drafters for speculative decoding (Medusa heads, EAGLE layers, small draft
models cut from the target: distill.py, draft.py) and KV-cache quantization scales (kv_distill.py)."""
