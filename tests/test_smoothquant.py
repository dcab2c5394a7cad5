"""SmoothQuant (sieve/quant/smoothquant.py) and llm-compressor's W8A8 layout (sieve/quant/compressed_tensors.py):
the scales against hand figures, folding that leaves the float model unchanged, the checkpoint both ways between
sieve and compressed-tensors (transformers' reader and llm-compressor's writer), and bad checkpoints refused by
name with exit status 2."""

from __future__ import annotations

import json

import pytest
import torch

from sieve.quant.smoothquant import kv_shared, search_alpha, smoothing_scale

DATA = "tinystories_valid_sample.txt"



def test_the_smoothing_scale_against_hand_figures():
    x_max, w_max = torch.tensor([16.0, 4.0, 0.0, 9.0]), torch.tensor([1.0, 4.0, 2.0, 0.0])
    # a = 0.5: sqrt(X / W): 4, 1; a channel that saw nothing, or has no weight, keeps 1
    assert smoothing_scale(x_max, w_max, 0.5).tolist() == [4.0, 1.0, 1.0, 1.0]
    assert smoothing_scale(x_max, w_max, 1.0).tolist() == [16.0, 4.0, 1.0, 1.0]  # a = 1: all onto the weights
    # rounded to a power of two: sqrt(12 / 1) = 3.46 -> 4, sqrt(5 / 4) = 1.12 -> 1, sqrt(1 / 9) = 0.33 -> 0.25
    assert smoothing_scale(torch.tensor([12.0, 5.0, 1.0]), torch.tensor([1.0, 4.0, 9.0]), 0.5).tolist() == [4.0, 1.0, 0.25]
    # o_proj under GQA: 2 KV heads, 2 query heads each, head_dim 2; the shared maxima, and the scale spread back
    x = torch.tensor([1.0, 8, 3, 2, 5, 0, 4, 6])  # query heads 0, 1 read KV head 0; heads 2, 3 KV head 1
    w = torch.ones(3, 8)
    xs, ws, expand = kv_shared(x, w, 2, 2)
    assert xs.tolist() == [3.0, 8.0, 5.0, 6.0] and ws.tolist() == [1.0] * 4
    assert expand(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [1.0, 2.0, 1.0, 2.0, 3.0, 4.0, 3.0, 4.0]


def test_smoothing_cuts_the_w8a8_error_where_activations_have_outlier_channels():
    """Two input channels 60x the others (as LLM activations have): per-token int8 leaves the rest a few levels;
    smoothing moves that range into the weights. The searched a beats no smoothing (a = None: s = 1) by far, and
    a = 0.5 does too."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=g)
    x[:, [3, 17]] *= 60
    w = torch.randn(96, 64, generator=g) * 0.05
    a, s, err, plain = search_alpha(x, x.abs().amax(0), [w], "auto")
    assert 0 < a <= 1 and err < 0.2 * plain and s[3] >= 4 * s.median()  # measured: 0.06x, 8x (a power of two either way)
    assert search_alpha(x, x.abs().amax(0), [w], 0.5)[2] < 0.5 * plain


def test_folding_leaves_the_float_model_unchanged(stories_dir):
    """stories260K (grouped-query attention: 8 heads, 4 KV heads), float32: every layer smoothed at a = 0.5 (norm
    weights, v_proj and up_proj rows divided, the linears' columns multiplied) gives the same logits within 1e-5 (the
    scales are powers of two: bit for bit, where scales rounded otherwise moved them by 3.5e-5), and the scales are
    not trivial."""
    from sieve.quant.calibration import reference_model
    from sieve.quant.smoothquant import group_statistics, smooth_layer

    model, tok, cfg, _ = reference_model(stories_dir)
    text = (stories_dir.parents[1] / "data" / DATA).read_text()[:3000]
    ids = tok(text, return_tensors="pt").input_ids[0][:256]
    with torch.no_grad():
        before = model(ids[None]).logits[0]
        norm_before = model.model.layers[0].input_layernorm.weight.clone()
        stats = group_statistics(model, [ids])
        for li, layer in enumerate(model.model.layers):
            smooth_layer(layer, stats, li, 0.5, cfg["num_key_value_heads"], cfg["head_dim"])
        after = model(ids[None]).logits[0]
    assert (after - before).abs().max() < 1e-5
    ratio = model.model.layers[0].input_layernorm.weight / norm_before
    assert ratio.max() / ratio.min() >= 2  # channels moved by different powers of two


@pytest.fixture(scope="module")
def smoothquant_dir(stories_dir, tmp_path_factory):
    """`sieve quantize --method smoothquant` on stories260K (a searched per group)."""
    from sieve.cli import main

    out = tmp_path_factory.mktemp("sq") / "stories-w8a8"
    calib = stories_dir.parents[1] / "data" / DATA
    assert main(["quantize", "--method", "smoothquant", "--model", str(stories_dir), "--calib", str(calib),
                 "--out", str(out), "--seq-len", "128", "--max-windows", "4"]) == 0
    return out


def test_a_smoothquant_checkpoint_is_llm_compressors_layout_and_serves(smoothquant_dir, stories_dir):
    """The checkpoint: config.json's quantization_config is a valid compressed-tensors W8A8 config, each linear an
    int8 weight and a [out, 1] scale. sieve serves it with W8A8 kernels and agrees with transformers reading it through
    compressed-tensors, activations quantized per token as vLLM's kernels and sieve do (max |x| / 127), far within
    what W8A8 costs; and in top-1 with compressed-tensors' own fake quantization (max |x| / 127.5). Against the float
    model it costs little."""
    import torch.nn.functional as F
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from sieve import LLM
    from sieve.layers.linear import Linear

    cfg = json.loads((smoothquant_dir / "config.json").read_text())
    qc = QuantizationConfig.model_validate(cfg["quantization_config"])
    scheme = next(iter(qc.config_groups.values()))
    assert (scheme.weights.strategy, scheme.input_activations.strategy, scheme.input_activations.dynamic) == ("channel", "token", True)
    with safe_open(str(smoothquant_dir / "model.safetensors"), "pt") as f:
        q, s = f.get_tensor("model.layers.0.self_attn.q_proj.weight"), f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale")
    assert q.dtype == torch.int8 and s.shape == (q.shape[0], 1)

    llm = LLM(str(smoothquant_dir), dtype="float32", device="cpu", num_gpu_blocks_override=64)
    layers = llm.llm_engine.runner.model.layers
    assert all("w8a8" in m.kernel_name() for m in layers.modules() if isinstance(m, Linear))
    text = (stories_dir.parents[1] / "data" / DATA).read_text()[2000:5000]
    ids = llm.get_tokenizer()(text).input_ids[:200]
    ours = llm.llm_engine.score(ids)

    def transformers_logits(path, own_fake_quant: bool) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        if not own_fake_quant:  # compressed-tensors' weights as stored, activations per token by max|x| / 127
            for m in model.modules():
                if hasattr(m, "quantization_scheme"):
                    m.quantization_enabled = False
                    m.register_forward_pre_hook(lambda m, args: (fake_quant(args[0]),))
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0]

    def kl(p, q):
        return F.kl_div(F.log_softmax(q, -1), F.log_softmax(p, -1), log_target=True, reduction="none").sum(-1).mean().item()

    ref, theirs = transformers_logits(smoothquant_dir, False), transformers_logits(smoothquant_dir, True)
    plain = transformers_logits(stories_dir, True)
    assert kl(ours, ref) < 0.5 * kl(ref, plain) and (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.95
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.9
    assert kl(plain, ours) < 0.01


def fake_quant(x: torch.Tensor) -> torch.Tensor:
    from sieve.quant.w8a8 import quantize_tokens

    q, s = quantize_tokens(x.reshape(-1, x.shape[-1]))
    return (q.float() * s[:, None]).reshape(x.shape)


def test_a_checkpoint_written_by_compressed_tensors_loads(stories_dir, tmp_path):
    """llm-compressor's path: a W8A8 scheme applied to a transformers model, channel scales set as its observers
    would (max |w| / 127.5, compressed-tensors' symmetric range), compressed and saved by compressed-tensors. sieve
    loads the file's int8 codes and scales exactly as stored and serves them with W8A8 kernels."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sieve import LLM

    model = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32)
    qcfg = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("W8A8", ["Linear"])}, ignore=["lm_head"],
                              quantization_status=QuantizationStatus.FROZEN)
    apply_quantization_config(model, qcfg)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "weight_scale"):
                m.weight_scale.copy_(m.weight.abs().amax(1, keepdim=True) / 127.5)
    compressor = ModelCompressor.from_pretrained_model(model, "int-quantized")
    compressor.compress_model(model)
    out = tmp_path / "ct"
    model.save_pretrained(out)
    compressor.update_config(out)
    AutoTokenizer.from_pretrained(stories_dir).save_pretrained(out)

    llm = LLM(str(out), dtype="float32", device="cpu", num_gpu_blocks_override=64)
    q_proj = llm.llm_engine.runner.model.layers[1].qkv_proj
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
        q, s = f.get_tensor("model.layers.1.self_attn.q_proj.weight"), f.get_tensor("model.layers.1.self_attn.q_proj.weight_scale")
    w = q_proj.qkernel.codes()  # the file's codes and scales as stored, whichever kernel holds them
    assert torch.equal(w.q[: q.shape[0]], q) and torch.equal(w.scale[: q.shape[0]], s.float().view(-1)) and w.acts == "int8"
    out_tokens = llm.generate([{"prompt_token_ids": [1, 403, 298, 261]}], None)[0].outputs[0].token_ids
    assert len(out_tokens) > 0


@pytest.mark.parametrize("break_it, message", [
    (lambda cfg, t: t.update({"model.layers.0.mlp.up_proj.weight_scale": torch.ones(3, 2)}), "up_proj.weight_scale"),
    (lambda cfg, t: cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=32),
     "weights.strategy"),
    (lambda cfg, t: cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"].update(dynamic=False, strategy="tensor"),
     "input_activations.strategy"),
    (lambda cfg, t: cfg["quantization_config"].update(format="pack-quantized"), "pack-quantized"),
])
def test_bad_w8a8_checkpoints_are_refused_by_name(smoothquant_dir, tmp_path, break_it, message, capsys):
    """A scale of the wrong shape, a scheme sieve does not serve (groups, static per-tensor activations, packed
    4-bit): `sieve generate` exits with status 2 and one line naming what is wrong, not a traceback."""
    import shutil

    from safetensors.torch import load_file, save_file

    from sieve.cli import main

    bad = tmp_path / "bad"
    shutil.copytree(smoothquant_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    tensors = load_file(str(bad / "model.safetensors"))
    break_it(cfg, tensors)
    (bad / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(bad / "model.safetensors"))
    assert main(["generate", "--model", str(bad), "--prompt", "Once", "--max-tokens", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
