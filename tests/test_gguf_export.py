"""GGUF export for the llama.cpp side-by-side: the file holds the same weights, named and laid out as
llama.cpp reads them, and (where llama-cpp-python is installed) llama.cpp computes the same logits."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

gguf = pytest.importorskip("gguf")  # in the `test` extra; the guard only spares a partial install

from sieve.bench.gguf_export import unpermute_rope, export_gguf  # noqa: E402

from reference import CLEAR, TOL, top2_margins  # noqa: E402


def read(path):
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    fields = {k: f for k, f in reader.fields.items()}
    return tensors, fields


def field_value(f):
    return f.parts[f.data[0]].tolist()


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_f16_export_holds_the_same_weights(checkpoints, tmp_path, arch):
    ckpt = checkpoints[arch]
    cfg = json.loads((ckpt / "config.json").read_text())
    out = export_gguf(ckpt, tmp_path / f"{arch}.gguf", "f16", log=lambda s: None)
    tensors, fields = read(out)
    hf = load_file(str(ckpt / "model.safetensors"))
    n_layers = cfg["num_hidden_layers"]
    per_layer = 9 + (3 if arch == "qwen2" else 0) + (2 if arch == "qwen3" else 0)
    rope_freqs = 1 if arch == "llama" else 0  # the llama checkpoint uses Llama 3.1 rope scaling
    assert len(tensors) == 2 + (0 if cfg["tie_word_embeddings"] else 1) + rope_freqs + n_layers * per_layer
    assert bytes(field_value(fields["general.architecture"])).decode() == {"llama": "llama"}.get(arch, arch)
    assert field_value(fields[f"{bytes(field_value(fields['general.architecture'])).decode()}.block_count"]) == [n_layers]
    assert len(fields["tokenizer.ggml.tokens"].data) == cfg["vocab_size"]

    def check(gg_name, hf_name, transform=lambda w: w):
        got = np.asarray(tensors[gg_name].data, dtype=np.float32).reshape(hf[hf_name].shape)
        want = transform(hf[hf_name].float().numpy())
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)

    check("token_embd.weight", "model.embed_tokens.weight")
    check("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight")
    check("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight")
    if arch == "llama":  # rotate-half rows become interleaved pairs for llama.cpp's rope
        check("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", lambda w: unpermute_rope(w, cfg["num_attention_heads"]))
        check("output.weight", "lm_head.weight")
    else:
        check("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight")
    if arch == "qwen2":
        check("blk.0.attn_k.bias", "model.layers.0.self_attn.k_proj.bias")
    if arch == "qwen3":
        check("blk.0.attn_q_norm.weight", "model.layers.0.self_attn.q_norm.weight")


def test_unpermute_pairs_rotate_half_rows():
    d, heads = 8, 2
    w = np.arange(heads * d, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    out = unpermute_rope(w, heads)
    for h in range(heads):
        for j in range(d // 2):  # HF rows j and j + d/2 of a head rotate together -> adjacent rows
            assert out[h * d + 2 * j, 0] == w[h * d + j, 0]
            assert out[h * d + 2 * j + 1, 0] == w[h * d + j + d // 2, 0]


def test_q8_0_export_is_within_its_error_bound(checkpoints, tmp_path):
    from gguf.quants import dequantize

    ckpt = checkpoints["qwen2"]
    out = export_gguf(ckpt, tmp_path / "q8.gguf", "q8_0", log=lambda s: None)
    tensors, _ = read(out)
    t = tensors["blk.0.ffn_up.weight"]
    assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
    want = load_file(str(ckpt / "model.safetensors"))["model.layers.0.mlp.up_proj.weight"].float().numpy()
    got = dequantize(t.data, t.tensor_type).reshape(want.shape)
    blocks = want.reshape(-1, 32)
    step = np.abs(blocks).max(axis=1, keepdims=True) / 127  # one int8 step per 32-value block (scale kept in f16)
    assert np.all(np.abs(got.reshape(-1, 32) - blocks) <= step * 0.5 + np.abs(blocks) * 2**-10)
    f16, _ = read(export_gguf(ckpt, tmp_path / "f16.gguf", "f16", log=lambda s: None))
    assert t.n_bytes == want.size // 32 * 34 and f16["blk.0.ffn_up.weight"].n_bytes == want.size * 2  # 8.5 vs 16 bits


def test_export_refuses_what_it_cannot_write(checkpoints, tmp_path):
    with pytest.raises(ValueError, match="writes f32, f16, bf16, q8_0, q4_0, q4_1, not q4_k"):
        export_gguf(checkpoints["qwen2"], tmp_path / "x.gguf", "q4_k")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="supports"):
        export_gguf(bad, tmp_path / "y.gguf")


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_llama_cpp_computes_the_same_logits(checkpoints, tmp_path, arch):
    """Only where the `peers` extra is installed: llama.cpp on the exported f16 file against transformers."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from transformers import AutoModelForCausalLM

    ckpt = checkpoints[arch]
    out = export_gguf(ckpt, tmp_path / f"{arch}.gguf", "f16", log=lambda s: None)
    llm = llama_cpp.Llama(str(out), n_ctx=64, logits_all=True, verbose=False, n_threads=2)
    ids = [5, 99, 1234, 7, 300, 42, 17, 2048]
    llm.eval(ids)
    got = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    clear = top2_margins(torch.log_softmax(torch.from_numpy(want), -1)) >= CLEAR * TOL  # f16 weights: skip near-ties
    assert clear.sum() >= len(ids) // 2 and (got.argmax(-1) == want.argmax(-1))[clear.numpy()].all()
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.999
