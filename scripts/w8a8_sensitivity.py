"""Where W8A8 loses quality (docs/quality.md, "W8A8: where the error comes from"): the default model in `transformers`,
float32, its linears' weights rounded to int8 per channel and their inputs to int8 per token (the arithmetic of
sieve/quant/w8a8.py, simulated in float), against the unquantized model on WikiText-2 windows. Reports KL and top-1
for int8 weights alone, for each group of linears with int8 inputs alone, for every layer alone, and for inputs under
one static scale per tensor (its largest |x| on the calibration text / 127, the per-tensor scheme), before and after
SmoothQuant's scales (sieve/quant/smoothquant.py, calibrated on Shakespeare as `sieve quantize` is).

    python scripts/w8a8_sensitivity.py [--windows 8] [--alpha auto] [--per-layer] [--data FILE]

`--data`: another text to score (e.g. bench/data/smollm2-chat-set.txt, the chat set: scripts/make_chat_set.py),
cut into windows of 256 tokens as it runs (its paragraphs, blank-line separated, in order).
"""
import argparse
from pathlib import Path

import torch

from sieve.models.default import default_model_path
from sieve.quant import smoothquant
from sieve.quant.calibration import reference_model, windows
from sieve.quant.formats import quantize
from sieve.quant.w8a8 import quantize_tokens

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
ALL = tuple(name for names in GROUPS.values() for name in names)


class FakeW8A8(torch.nn.Module):
    """A linear whose weight is int8 per channel and whose input, where `acts`, is int8 per token (dequantized), or
    under the one scale `static` where given."""

    def __init__(self, weight: torch.Tensor, acts: bool, static: float | None = None):
        super().__init__()
        self.weight, self.acts, self.static = quantize(weight, "int8").dequantize(), acts, static

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.acts and self.static is not None:
            x = torch.round(x / self.static).clamp(-127, 127) * self.static
        elif self.acts:
            q, s = quantize_tokens(x.reshape(-1, x.shape[-1]))
            x = (q.float() * s[:, None]).reshape(x.shape)
        return x @ self.weight.t()


def swap(model, originals: dict, layers: set[int], acts: tuple[str, ...], static: dict | None = None) -> None:
    """Linears of `layers` quantized (int8 inputs for the names in `acts`, under `static[(layer, group)]` where given),
    every other one as it was."""
    group_of = {leaf: g for g, leaves in GROUPS.items() for leaf in leaves}
    for (li, name), lin in originals.items():
        parent = model.model.layers[li].get_submodule(name.rsplit(".", 1)[0])
        leaf = name.rsplit(".", 1)[1]
        scale = static[(li, group_of[leaf])] if static else None
        setattr(parent, leaf, FakeW8A8(lin.weight, leaf in acts, scale) if li in layers else lin)


@torch.no_grad()
def score(model, wins, refs) -> tuple[float, float]:
    kl = top = n = 0.0
    for w, ref in zip(wins, refs):
        lp = torch.log_softmax(model(w[None]).logits[0].float(), -1)
        kl += (ref.exp() * (ref - lp)).sum().item()
        top += (ref.argmax(-1) == lp.argmax(-1)).sum().item()
        n += len(w)
    return kl / n, top / n


def report(model, originals, wins, refs, per_layer: bool, label: str, calib) -> None:
    everything = set(range(len(model.model.layers)))
    static = {key: x_max.max().item() / 127 for key, (x_max, _) in smoothquant.group_statistics(model, calib).items()}
    cases = [("int8 weights alone", (), None), ("W8A8 everywhere", ALL, None), ("W8A8, static per-tensor inputs", ALL, static)]
    cases += [(f"int8 weights, int8 inputs of {g} only", names, None) for g, names in GROUPS.items()]
    for what, acts, scales in cases:
        swap(model, originals, everything, acts, scales)
        kl, top = score(model, wins, refs)
        print(f"{label}: {what:<42} KL {kl:.4f}  top-1 {100 * top:.1f}%", flush=True)
    if per_layer:
        for li in sorted(everything):
            swap(model, originals, {li}, ALL)
            kl, top = score(model, wins, refs)
            print(f"{label}: W8A8 in layer {li:>2} alone{'':<22} KL {kl:.4f}  top-1 {100 * top:.1f}%", flush=True)
    swap(model, originals, set(), ())


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--windows", type=int, default=8, help="WikiText-2 windows of 256 tokens scored")
    p.add_argument("--alpha", default="auto")
    p.add_argument("--per-layer", action="store_true", help="also each layer quantized alone")
    p.add_argument("--data", default=str(SHARED / "wikitext2_test.txt"), help="the text scored (default: WikiText-2)")
    args = p.parse_args()
    model, tok, cfg, _ = reference_model(Path(default_model_path()))
    paragraphs = lambda f: [t for t in (SHARED / f).read_text().split("\n\n") if t.strip()]  # noqa: E731
    wins = windows(tok, paragraphs(Path(args.data).resolve()), 256, args.windows)
    refs = [torch.log_softmax(model(w[None]).logits[0].float(), -1) for w in wins]
    originals = {(li, f"{part}.{leaf}"): layer.get_submodule(f"{part}.{leaf}")
                 for li, layer in enumerate(model.model.layers)
                 for part, leaves in (("self_attn", GROUPS["qkv"] + GROUPS["o"]), ("mlp", GROUPS["gate_up"] + GROUPS["down"]))
                 for leaf in leaves}
    calib = windows(tok, paragraphs("tinyshakespeare.txt"), 256, 16)
    report(model, originals, wins, refs, args.per_layer, "plain", calib)
    stats = smoothquant.group_statistics(model, calib)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    for li, layer in enumerate(model.model.layers):
        smoothquant.smooth_layer(layer, stats, li, args.alpha, cfg["num_key_value_heads"], head_dim)
    report(model, originals, wins, refs, args.per_layer, f"SmoothQuant (alpha {args.alpha})", calib)


if __name__ == "__main__":
    main()
