"""AWQ: activation-aware scales for INT4 weights, and the AutoAWQ checkpoint layout.

Search (Lin et al., "AWQ", 2023; AutoAWQ's `auto_scale`). Input channels that see large
activations matter most, so before rounding each linear's weight is multiplied per input channel by
s = mean|x|^a (normalised), and the input is divided by s, which folds exactly into the op before it:

    q/k/v   <- input_layernorm.weight / s          gate/up <- post_attention_layernorm.weight / s
    down    <- up_proj rows / s                    o       <- v_proj rows / s (only without GQA, as AutoAWQ)

For each group of linears sharing an input, a (grid over [0, 1)) is the one minimising
|| Q(W s)(x / s) - W x ||^2 on calibration activations. Activations are captured once from the
unscaled model with `transformers` (the reference implementation), which is exact because the
folding leaves every layer's output unchanged.

Layout (AutoAWQ "gemm", what vLLM and transformers load): per linear `qweight` int32 [in, out/8] and
`qzeros` int32 [groups, out/8], eight 4-bit values per int32 in the order 0 2 4 6 1 3 5 7, `scales`
fp16 [groups, out]; `config.json` gets `quantization_config` {quant_method: awq, bits: 4, group_size,
zero_point: true, version: gemm}. Sizes that are not a multiple of 8 outputs / `group` inputs are
padded (AutoAWQ itself would refuse them); the loader trims them back.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sieve.quant.calibration import capture_inputs, reference_model, windows
from sieve.quant.formats import Int4Weight, quantize_int4

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


# ---- layout -----------------------------------------------------------------------------------
def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] ints 0..15 -> int32 [rows, ceil(cols/8)] in AutoAWQ's order."""
    rows, cols = values.shape
    v = torch.nn.functional.pad(values.to(torch.int64), (0, -cols % 8)).view(rows, -1, 8)
    packed = torch.zeros(v.shape[:2], dtype=torch.int64)
    for i, src in enumerate(AWQ_ORDER):
        packed |= v[..., src] << (4 * i)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # the same bits, signed


def unpack_awq(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """int32 [rows, n/8] -> uint8 [rows, cols]."""
    p = packed.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(p.shape[0], p.shape[1], 8, dtype=torch.uint8)
    for i, dst in enumerate(AWQ_ORDER):
        out[..., dst] = ((p >> (4 * i)) & 0xF).to(torch.uint8)
    return out.view(p.shape[0], -1)[:, :cols]


def to_awq_tensors(w: Int4Weight) -> dict[str, torch.Tensor]:
    """Our [out, in] int4 weight -> AutoAWQ's qweight / qzeros / scales."""
    return {"qweight": pack_awq(w.values()[:, : w.k].t()), "qzeros": pack_awq(w.zero.t()),
            "scales": w.scale.t().contiguous().to(torch.float16)}


def from_awq_tensors(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, out_features: int,
                     group: int) -> Int4Weight:
    k = qweight.shape[0]
    groups = -(-k // group)
    q = unpack_awq(qweight, out_features).t().contiguous()  # [out, in]
    q = torch.nn.functional.pad(q, (0, groups * group - k))
    zero = unpack_awq(qzeros, out_features).t().contiguous()
    scale = scales[:, :out_features].t().contiguous()
    return Int4Weight.from_zero_points(q, scale, zero, group, k)


def awq_config(group: int) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}


# ---- search -----------------------------------------------------------------------------------
def _search_scale(x: torch.Tensor, weights: list[torch.Tensor], group: int, grid: int = 20) -> tuple[torch.Tensor, float, float]:
    """x [T, K] calibration inputs shared by `weights` ([N_i, K] each). Returns (s [K], best loss,
    loss with s = 1, i.e. plain rounding)."""
    w = torch.cat(weights, 0).float()
    ref = x @ w.t()
    x_mean = x.abs().mean(0)
    best, best_s, plain = float("inf"), torch.ones_like(x_mean), None
    for i in range(grid):
        a = i / grid
        s = x_mean.pow(a).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        wq = quantize_int4(w * s, group).dequantize() / s
        loss = (x @ wq.t() - ref).pow(2).mean().item()
        if i == 0:
            plain = loss
        if loss < best:
            best, best_s = loss, s
    return best_s, best, plain


def calibration_inputs(model, tok, texts: list[str], seq_len: int, max_windows: int):
    """Inputs of every linear of every layer on calibration windows: {(layer, name): [T, K]}."""
    captured: dict[tuple[int, str], list[torch.Tensor]] = {}
    targets = {(li, name): layer.get_submodule(name) for li, layer in enumerate(model.model.layers) for name in LINEARS}
    wins = windows(tok, texts, seq_len, max_windows)
    capture_inputs(model, wins, targets, lambda key, x: captured.setdefault(key, []).append(x))
    return {k: torch.cat(v) for k, v in captured.items()}, sum(len(w) for w in wins)


@torch.no_grad()
def awq_quantize(model_path: str | Path, calib_file: str | Path, out: str | Path, group: int = 128, seq_len: int = 256,
                 max_windows: int = 32, log=print) -> dict:
    """Search AWQ scales for every layer of the checkpoint at `model_path` (a Hugging Face folder or a
    GGUF file, dequantized), write an AutoAWQ-layout checkpoint at `out`. Returns per-linear-group output
    errors (AWQ and plain rounding)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    model_path, out = Path(model_path), Path(out)
    model, tok, src_config, save_tokenizer = reference_model(model_path)
    cfg = model.config
    texts = [t for t in Path(calib_file).read_text().split("\n\n") if t.strip()]
    inputs, n_tokens = calibration_inputs(model, tok, texts, seq_len, max_windows)
    log(f"calibration: {n_tokens} tokens from {calib_file}")
    gqa = cfg.num_key_value_heads != cfg.num_attention_heads
    report = {}
    for li, layer in enumerate(tqdm(model.model.layers, desc="AWQ search", unit="layer")):
        at, mlp = layer.self_attn, layer.mlp
        groups = [  # (linears sharing an input, their input, where 1/s folds)
            ([at.q_proj, at.k_proj, at.v_proj], inputs[(li, "self_attn.q_proj")], ("norm", layer.input_layernorm)),
            ([mlp.gate_proj, mlp.up_proj], inputs[(li, "mlp.gate_proj")], ("norm", layer.post_attention_layernorm)),
            ([mlp.down_proj], inputs[(li, "mlp.down_proj")], ("rows", mlp.up_proj)),
        ]
        if not gqa:
            groups.append(([at.o_proj], inputs[(li, "self_attn.o_proj")], ("rows", at.v_proj)))
        for (linears, x, (kind, prev)), label in zip(groups, ["qkv", "gate_up", "down", "o"]):
            s, loss, plain = _search_scale(x, [m.weight for m in linears], group)
            report[f"layer{li}.{label}"] = {"awq": loss, "plain": plain}
            for m in linears:
                m.weight.mul_(s)  # W s
            if kind == "norm":
                prev.weight.div_(s)
            else:
                prev.weight.div_(s[:, None])
                if getattr(prev, "bias", None) is not None:
                    prev.bias.div_(s)

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, p in model.state_dict().items():
        base = name.rsplit(".", 1)[0]
        if any(base.endswith(l) for l in LINEARS) and name.endswith(".weight"):
            w4 = quantize_int4(p, group)
            awq = to_awq_tensors(w4)
            for k in ("qweight", "qzeros", "scales"):
                tensors[f"{base}.{k}"] = awq[k]
        elif name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        else:
            tensors[name] = p.to(torch.float16).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    c = dict(src_config)
    c["quantization_config"] = awq_config(group)
    c["torch_dtype"] = "float16"
    (out / "config.json").write_text(json.dumps(c, indent=2))
    save_tokenizer(out)
    log(f"wrote AWQ checkpoint to {out}")
    return report
