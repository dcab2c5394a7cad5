"""Issue 65's entropy-guided budgets: each layer's attention entropy on calibration text (transformers, float32,
eager attention), the profile `sieve serve --kv-budget-profile FILE` shares a press's total by (its "entropy_nats").
Also the per-layer shares of a total KV budget proportional to it (the seeds' "larger cache budgets to
higher-entropy attention layers"), and what they would cost if one block table served every layer: as many slots as
the largest layer keeps (sieve packs the layers' blocks across the pool's planes instead, sieve/kv_compression/cells.py).

python scripts/attention_entropy.py [--model GGUF] [--windows 4] [--tokens 1024] [--ratio 0.5] [--output-json F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def layer_entropies(model, windows: list[list[int]]) -> torch.Tensor:
    """[layers]: the mean over windows, heads and query positions (the first 64 of each window left out: short
    contexts have low entropy by construction) of each attention distribution's entropy, in nats."""
    sums = None
    for ids in windows:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_attentions=True)
        per = torch.stack([(-(a * a.clamp_min(1e-30).log()).sum(-1))[0, :, 64:].mean() for a in out.attentions])
        sums = per if sums is None else sums + per
    return sums / len(windows)


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sieve.data import shared_data
    from sieve.models.default import default_model_path

    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--ratio", type=float, default=0.5, help="the fraction of a prompt's positions removed")
    p.add_argument("--output-json", default=None)
    a = p.parse_args()
    path = Path(a.model) if a.model else default_model_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    ids = tok(shared_data("wikitext2_test.txt").read_text()[: a.windows * a.tokens * 8])["input_ids"]
    windows = [ids[i * a.tokens: (i + 1) * a.tokens] for i in range(a.windows)]
    entropy = layer_entropies(model, windows)
    shares = entropy / entropy.sum()  # a total budget of L * (1 - ratio) * T positions, split by entropy
    kept = (shares * len(shares) * (1 - a.ratio)).clamp(max=1.0)  # each layer's kept fraction of the prompt
    slots = kept.max().item()  # one table for every layer: the largest layer's count
    result = {
        "model": path.name, "windows": a.windows, "tokens": a.tokens, "ratio": a.ratio,
        "entropy_nats": [round(x, 3) for x in entropy.tolist()],
        "kept_fraction_per_layer": [round(x, 3) for x in kept.tolist()],
        "slots_kept_fraction": round(slots, 3), "uniform_slots_kept_fraction": round(1 - a.ratio, 3),
        "memory_saved": round(1 - slots, 3), "uniform_memory_saved": round(a.ratio, 3),
    }
    print(json.dumps(result, indent=1))
    if a.output_json:
        Path(a.output_json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
