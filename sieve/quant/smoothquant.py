"""SmoothQuant (Xiao et al., arXiv 2211.10438): move the activations' outlier channels into the weights, then write
a W8A8 checkpoint in llm-compressor's layout (sieve/quant/compressed_tensors.py).

Activations have a few input channels far larger than the rest, so a per-token int8 scale set by them leaves the
other channels a handful of levels. For each group of linears sharing an input, with per-channel maxima
X_j = max_t |x_tj| (over calibration text) and W_j = max_n |w_nj| (over every output row of the group):

    s_j = X_j^a / W_j^(1 - a),   x' = x / s,   W' = W s         (x' W'^T = x W^T exactly, in float)

and 1/s folds into the op before the group, so the float model is unchanged:

    q/k/v    <- input_layernorm.weight / s            gate/up <- post_attention_layernorm.weight / s
    down     <- up_proj's output rows / s             o       <- v_proj's output rows / s

o's input is the attention's output: head h carries the values of its KV head h // (heads / KV heads), so under
grouped-query attention a channel's scale is shared by the query heads of one KV head (their maxima taken together)
and v_proj's rows are divided by it once.

a: 0.5 (the paper's default), or "auto": per group, the a of a grid over [0, 1] whose W8A8 output error
|| Q(x / s) Q(W s)^T - x W^T ||^2 on the calibration rows is least (the report keeps each group's error without
smoothing too, s = 1).

Activations are captured once from the unsmoothed model with `transformers` (the reference implementation); folding
leaves every layer's output unchanged, so they hold for the smoothed model too.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sieve.quant.formats import quantize
from sieve.quant.w8a8 import quantize_tokens

ALPHA_GRID = [i / 20 for i in range(21)]
SAMPLE_ROWS = 2048  # calibration rows kept per group for the error of each a (the maxima see every row)
LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
GROUP_INPUTS = {"qkv": "self_attn.q_proj", "o": "self_attn.o_proj", "gate_up": "mlp.gate_proj", "down": "mlp.down_proj"}


def smoothing_scale(x_max: torch.Tensor, w_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_j = X_j^a / W_j^(1-a), rounded to the nearest power of two; 1 where a channel saw nothing (or has no weight).
    Powers of two move no bit: x / s and W s are exact in floating point, so folding leaves the float model's
    output unchanged to the last bit, and SmoothQuant's balance is kept within a factor of sqrt(2)."""
    s = x_max.clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha)
    s = torch.exp2(torch.round(torch.log2(s.clamp(min=2.0**-20, max=2.0**20))))
    return torch.where((x_max > 0) & (w_max > 0), s, torch.ones_like(s))


def w8a8_error(x: torch.Tensor, weights: list[torch.Tensor], s: torch.Tensor) -> float:
    """Mean squared output error of the group under W8A8 with smoothing `s` against the float product."""
    w = torch.cat(weights).float()
    q, t = quantize_tokens(x / s)
    xq = q.float() * t[:, None]
    wq = quantize(w * s, "int8").dequantize()
    return (xq @ wq.t() - x @ w.t()).pow(2).mean().item()


def search_alpha(x: torch.Tensor, x_max: torch.Tensor, weights: list[torch.Tensor], alpha: float | str,
                 w_max: torch.Tensor | None = None, expand=None) -> tuple[float, torch.Tensor, float, float]:
    """(a, s, its error, the error without smoothing) for one group: `alpha` itself, or with "auto" the grid's
    best. `w_max` and `expand` serve o_proj under GQA: maxima per shared channel, and how a shared scale spreads
    back over the group's input channels."""
    w_max = torch.cat(weights).float().abs().amax(0) if w_max is None else w_max
    expand = expand or (lambda s: s)
    plain = w8a8_error(x, weights, torch.ones(x.shape[1]))
    best = None
    for a in (ALPHA_GRID if alpha == "auto" else [float(alpha)]):
        s = expand(smoothing_scale(x_max, w_max, a))
        err = w8a8_error(x, weights, s)
        if best is None or err < best[2]:
            best = (a, s, err)
    return best[0], best[1], best[2], plain


def group_statistics(model, wins: list[torch.Tensor]) -> dict:
    """Per layer and group: the input's per-channel max |x| over every calibration row, and up to SAMPLE_ROWS rows."""
    from sieve.quant.calibration import capture_inputs

    stats: dict = {}

    def on_input(key, x: torch.Tensor) -> None:
        st = stats.setdefault(key, {"max": torch.zeros(x.shape[1]), "rows": []})
        st["max"] = torch.maximum(st["max"], x.abs().amax(0))
        kept = sum(r.shape[0] for r in st["rows"])
        if kept < SAMPLE_ROWS:
            st["rows"].append(x[: SAMPLE_ROWS - kept])

    targets = {(li, group): layer.get_submodule(name) for li, layer in enumerate(model.model.layers)
               for group, name in GROUP_INPUTS.items()}
    capture_inputs(model, wins, targets, on_input)
    return {k: (v["max"], torch.cat(v["rows"])) for k, v in stats.items()}


def kv_shared(x_max: torch.Tensor, o_weight: torch.Tensor, kv_heads: int, head_dim: int):
    """o_proj's channels under grouped-query attention: query head h reads KV head h // per_kv, so one scale per
    channel of a KV head, from the maxima of its query heads taken together. Returns (the input's maxima and the
    weight's per shared channel [kv heads * hd], and the function spreading a shared scale back over o's inputs)."""
    per_kv = x_max.numel() // head_dim // kv_heads

    def shared(t: torch.Tensor) -> torch.Tensor:
        return t.view(kv_heads, per_kv, head_dim).amax(1).reshape(-1)

    def expand(s_kv: torch.Tensor) -> torch.Tensor:
        return s_kv.view(kv_heads, 1, head_dim).expand(kv_heads, per_kv, head_dim).reshape(-1)

    return shared(x_max), shared(o_weight.float().abs().amax(0)), expand


@torch.no_grad()
def smooth_layer(layer, stats: dict, li: int, alpha, kv_heads: int, head_dim: int) -> dict:
    """Fold SmoothQuant's scales into one transformers decoder layer (in place). Returns each group's a and errors."""
    at, mlp = layer.self_attn, layer.mlp
    report = {}
    for group, linears, prev in (("qkv", [at.q_proj, at.k_proj, at.v_proj], layer.input_layernorm),
                                 ("gate_up", [mlp.gate_proj, mlp.up_proj], layer.post_attention_layernorm),
                                 ("down", [mlp.down_proj], mlp.up_proj), ("o", [at.o_proj], at.v_proj)):
        x_max, x = stats[(li, group)]
        weights = [m.weight for m in linears]
        w_max = expand = None
        if group == "o":
            x_max, w_max, expand = kv_shared(x_max, at.o_proj.weight, kv_heads, head_dim)
        a, s, err, plain = search_alpha(x, x_max, weights, alpha, w_max, expand)
        report[group] = {"alpha": a, "smoothed": err, "plain": plain}
        for m in linears:
            m.weight.mul_(s.to(m.weight.dtype))
        divisor = s if group != "o" else s.view(kv_heads, -1, head_dim)[:, 0].reshape(-1)
        if prev is at.v_proj or prev is mlp.up_proj:  # output rows of the op before
            prev.weight.div_(divisor[:, None].to(prev.weight.dtype))
            if getattr(prev, "bias", None) is not None:
                prev.bias.div_(divisor.to(prev.bias.dtype))
        else:  # an RMSNorm's weight
            prev.weight.div_(divisor.to(prev.weight.dtype))
    return report


@torch.no_grad()
def smoothquant(model_path: str | Path, calib_file: str | Path, out: str | Path, alpha: float | str = "auto",
                seq_len: int = 256, max_windows: int = 32, log=print) -> dict:
    """Smooth every layer of the checkpoint at `model_path` (a Hugging Face folder, or a GGUF file dequantized) on
    the calibration text, quantize its decoder linears to int8 per channel, and write a W8A8 compressed-tensors
    checkpoint at `out`. Returns each group's a and output errors (smoothed, and without smoothing)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from sieve.quant.calibration import reference_model, windows
    from sieve.quant.compressed_tensors import to_tensors, w8a8_config

    model_path, out = Path(model_path), Path(out)
    model, tok, src_config, save_tokenizer = reference_model(model_path)
    cfg = model.config
    texts = [t for t in Path(calib_file).read_text().split("\n\n") if t.strip()]
    wins = windows(tok, texts, seq_len, max_windows)
    stats = group_statistics(model, wins)
    log(f"calibration: {sum(len(w) for w in wins)} tokens from {calib_file}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    report = {}
    for li, layer in enumerate(tqdm(model.model.layers, desc="SmoothQuant", unit="layer")):
        for group, r in smooth_layer(layer, stats, li, alpha, cfg.num_key_value_heads, head_dim).items():
            report[f"layer{li}.{group}"] = r
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, p in model.state_dict().items():
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and any(base.endswith(lin) for lin in LINEARS):
            for key, t in to_tensors(quantize(p, "w8a8")).items():
                tensors[f"{base}.{key}"] = t
        elif name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        else:
            tensors[name] = p.to(torch.bfloat16).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    c = dict(src_config, torch_dtype="bfloat16", quantization_config=w8a8_config())
    (out / "config.json").write_text(json.dumps(c, indent=2))
    save_tokenizer(out)
    log(f"wrote a W8A8 (SmoothQuant, compressed-tensors) checkpoint to {out}")
    return report
