"""GGUF checkpoints in: the reader on small files the tests write with the `gguf` package (every tensor
type, both tokenizer kinds), parity with transformers' own GGUF loader, and a matrix of bad files."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import gguf

from sieve import LLM, SamplingParams
from sieve.bench.gguf_export import export_gguf, reencode_gguf
from sieve.kernels import cpu_ops
from sieve.models.gguf import GGUFCheckpoint, GGUFError
from sieve.quant.formats import ChannelScaledWeight, Int4Weight

from conftest import SHARED
from reference import assert_matches, clear_greedy_answer, greedy_reference

QUIET = dict(log=lambda s: None)


def file_values(path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file dequantized by the `gguf` package, in Hugging Face row order (llama.cpp
    permutes the q / k rows of "llama" models; transformers' loader undoes it the same way)."""
    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    heads = reader.fields[f"{arch}.attention.head_count"].contents()
    kv_heads = reader.fields[f"{arch}.attention.head_count_kv"].contents()
    out = {}
    for t in reader.tensors:
        v = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            n = heads if "attn_q" in t.name else kv_heads
            v = v.reshape(n, v.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(v.shape)
        out[t.name] = np.array(v)  # writable
    return out


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_1"])
def test_quantized_tensors_keep_their_format_and_the_files_exact_values(checkpoints, tmp_path, qtype):
    path = export_gguf(checkpoints["llama"], tmp_path / f"m-{qtype}.gguf", qtype, **QUIET)
    want = file_values(path)
    reader = gguf.GGUFReader(str(path))
    nbytes = {t.name: int(t.n_bytes) for t in reader.tensors}
    ckpt = GGUFCheckpoint(path)
    from sieve.bench.gguf_export import gguf_name

    seen = 0
    for hf_name, value in ckpt.tensors():
        name = gguf_name(hf_name)
        if want[name].ndim == 1:
            assert isinstance(value, torch.Tensor) and torch.equal(value, torch.from_numpy(want[name]))
            continue
        seen += 1
        if qtype == "q8_0":
            assert isinstance(value, ChannelScaledWeight) and value.q.dtype == torch.int8 and value.group == 32
            assert value.scale.dtype == torch.float16
        else:
            assert isinstance(value, Int4Weight) and value.group == 32
        assert value.nbytes == nbytes[name]  # held in exactly the bytes the file holds
        assert torch.equal(value.dequantize(), torch.from_numpy(want[name])), f"{name} differs from gguf.quants.dequantize"
    assert seen == 2 * 7 + 2  # 2 layers x 7 matrices, the embedding and the untied head


def test_plain_types_load_as_they_are_and_k_quants_are_dequantized_and_logged(tmp_path, demo_dir, caplog):
    """F32 / F16 / BF16 tensors come as the file holds them; Q4_K / Q5_K / Q6_K (no native kernel) are
    dequantized, exactly, and the log says so; a stack of q/k/v in different formats still runs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    src = tmp_path / "wide"  # K-quants need rows of 256
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=4096, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=0, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(src)
    for f in demo_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (src / f.name).write_bytes(f.read_bytes())
    base = export_gguf(src, tmp_path / "base.gguf", "f32", **QUIET)
    rng = np.random.default_rng(0)
    kinds = {"blk.0.attn_v.weight": "Q4_K", "blk.0.ffn_down.weight": "Q6_K", "blk.0.ffn_gate.weight": "Q5_K",
             "blk.0.attn_q.weight": "BF16", "blk.0.attn_output.weight": "F16"}

    def encode(name, data):
        kind = kinds.get(name)
        if kind in ("BF16", "F16"):
            t = getattr(gguf.GGMLQuantizationType, kind)
            return gguf.quants.quantize(data, t) if kind == "BF16" else data.astype(np.float16), t
        if kind is None:
            return None
        t = getattr(gguf.GGMLQuantizationType, kind)
        block, size = gguf.GGML_QUANT_SIZES[t]
        raw = rng.integers(0, 256, size=(data.shape[0], data.shape[1] // block, size), dtype=np.uint8)
        d = np.array([0.002], dtype=np.float16).view(np.uint8)
        if kind == "Q6_K":
            raw[..., -2:] = d  # d is the block's last field
        else:
            raw[..., 0:2], raw[..., 2:4] = d, np.array([0.001], dtype=np.float16).view(np.uint8)  # d, dmin
        return raw.reshape(data.shape[0], -1), t

    path = reencode_gguf(base, tmp_path / "mixed.gguf", "q8_0", encode=encode, **QUIET)
    want = file_values(path)
    values = {name: v for name, v in GGUFCheckpoint(path).tensors()}
    from sieve.bench.gguf_export import gguf_name

    for hf_name, v in values.items():
        name = gguf_name(hf_name)
        if name in kinds:
            assert isinstance(v, torch.Tensor) and torch.equal(v, torch.from_numpy(want[name])), name
    caplog.set_level("WARNING", logger="sieve")
    llm = LLM(str(path), dtype="bfloat16", num_gpu_blocks_override=16)
    assert any("Q6_K tensors dequantized" in r.message for r in caplog.records)
    assert "per shard" in llm.llm_engine.runner.model.layers[0].qkv_proj.kernel_name()  # Q8_0 q, k + Q4_K v
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_bpe_tokenizer_chat_template_and_eos_come_from_the_file(checkpoints, tmp_path):
    from transformers import AutoTokenizer

    ckpt = checkpoints["qwen2"]
    path = export_gguf(ckpt, tmp_path / "bpe.gguf", "q8_0", **QUIET)
    tok = LLM(str(path), dtype="bfloat16", num_gpu_blocks_override=16).get_tokenizer()
    ref = AutoTokenizer.from_pretrained(ckpt)
    for text in ["def main():\n    return 1", "import os, sys  # é ü 漢字", "  spaces\tand\ttabs\n\n"]:
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert GGUFCheckpoint(path).config["eos_token_id"] == [cfg["eos_token_id"]]


@pytest.fixture(scope="module")
def stories_gguf(tmp_path_factory):
    src = SHARED / "models" / "stories260K"
    if not src.exists():
        pytest.fail(f"{src} is missing: ../shared holds the real checkpoint these tests use")
    return src, export_gguf(src, tmp_path_factory.mktemp("stories") / "stories260K-f32.gguf", "f32", **QUIET)


def test_sentencepiece_tokenizer_and_a_real_model_from_gguf(stories_gguf):
    """stories260K (SentencePiece vocabulary, trained weights) as a llama-model GGUF: the same tokens as its
    own tokenizer, the same greedy story as the safetensors checkpoint, which is the documented one."""
    from transformers import AutoTokenizer

    src, path = stories_gguf
    llm = LLM(str(path), dtype="float32", num_gpu_blocks_override=64)
    tok, ref = llm.get_tokenizer(), AutoTokenizer.from_pretrained(src)
    for text in ["Once upon a time, there was a little girl named Lily.", "She loved to play outside!  Tom said: \"no\"."]:
        assert tok.encode(text) == ref.encode(text)
    params = SamplingParams(max_tokens=30, temperature=0)
    got = llm.generate(["Once upon a time"], params)[0].outputs[0]
    want = LLM(str(src), dtype="float32", num_gpu_blocks_override=64).generate(["Once upon a time"], params)[0].outputs[0]
    assert got.token_ids == want.token_ids
    story = ", there was a little girl named Lily. She loved to play outside in the park."
    clear_greedy_answer(src, ref.encode("Once upon a time"), ref, story, tol=1e-3)  # float32: no near-tie on the way
    assert got.text.startswith(story)


@pytest.mark.parametrize("arch,qtype", [("mistral", "q4_1"), ("mistral", "q8_0"), ("qwen2", "q4_0"), ("qwen2", "q4_1")])
def test_dequantized_path_matches_transformers_on_the_same_file(checkpoints, tmp_path, arch, qtype):
    """Mistral checkpoints are written as llama.cpp's "llama" architecture (q/k rows permuted), with
    default rope. The test's llama (Llama 3.1 rope scaling) and qwen3 (head_dim != hidden / heads)
    checkpoints are checked below instead: transformers' GGUF loader ignores `rope_freqs` and
    `attention.key_length`. (The file is exported from a copy named
    "ckpt": transformers maps a llama file whose general.name says "mistral" to an architecture gguf-py
    does not know.)"""
    import shutil

    src = shutil.copytree(checkpoints[arch], tmp_path / "ckpt")
    path = export_gguf(src, tmp_path / f"{arch}-{qtype}.gguf", qtype, **QUIET)
    prompts = [[5, 99, 1234, 7, 300, 42, 17, 2048], list(range(40, 80)), [3]]
    llm = LLM(str(path), dtype="float32", dequantize=True, num_gpu_blocks_override=128, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert_matches(outs, *greedy_reference(path, prompts, 16), f"{arch} {qtype}")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_exact_weight_file_gives_the_original_checkpoints_outputs(checkpoints, tmp_path, arch):
    """Where transformers' GGUF loader cannot be the reference: llama.cpp stores Llama 3.1 rope scaling as
    a `rope_freqs` tensor (a divisor per frequency), and Qwen3's head size as `attention.key_length`;
    transformers' loader drops both. sieve reads them, so the file (f32: exact weights) generates what
    transformers does on the original safetensors checkpoint."""
    ckpt = checkpoints[arch]
    path = export_gguf(ckpt, tmp_path / f"{arch}.gguf", "f32", **QUIET)
    cfg = GGUFCheckpoint(path).config
    if arch == "llama":
        assert cfg["rope_scaling"]["rope_type"] == "freq_factors"
    else:
        assert cfg["head_dim"] == 32 != cfg["hidden_size"] // cfg["num_attention_heads"]
    prompts = [list(range(40, 80)), [5, 99, 1234]]
    outs = LLM(str(path), dtype="float32", num_gpu_blocks_override=64).generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5))
    ref_tokens, ref_lps = greedy_reference(ckpt, prompts, 16)
    assert_matches(outs, ref_tokens, ref_lps, arch)


def test_native_quantized_path_reads_no_more_bytes_than_the_file(checkpoints, tmp_path):
    path = export_gguf(checkpoints["qwen3"], tmp_path / "q.gguf", "q4_1", **QUIET)
    reader = gguf.GGUFReader(str(path))
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors if len(t.shape) == 2 and t.name != "token_embd.weight")
    llm = LLM(str(path), dtype="bfloat16", num_gpu_blocks_override=16)
    model = llm.llm_engine.runner.model
    from sieve.layers.linear import Linear

    read = sum(m.weight_bytes for m in model.modules() if isinstance(m, Linear))
    tied_head = int(next(t.n_bytes for t in reader.tensors if t.name == "token_embd.weight"))
    assert read == file_bytes + tied_head  # the linears (and the head, tied to the embedding) as stored
    assert model.native is not None and f"int4 g32 ({cpu_ops().isa} kernel)" in model.layers[0].qkv_proj.kernel_name()


@pytest.mark.parametrize("qtype", ["q4_1", "q8_0", "q4_0"])
def test_native_quantized_path_is_batch_invariant_in_float32(checkpoints, tmp_path, qtype):
    """The kernels sum each row in one order whatever the batch: a request alone and among others gives the
    same logprobs, bit for bit (float32 activations, the file's weights as stored, the native layer loop)."""
    path = export_gguf(checkpoints["qwen2"], tmp_path / f"q-{qtype}.gguf", qtype, **QUIET)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    target = {"prompt_token_ids": [5, 99, 1234, 7, 300]}
    crowd = [{"prompt_token_ids": list(range(10 + i, 30 + 3 * i))} for i in range(6)]
    llm = LLM(str(path), dtype="float32", num_gpu_blocks_override=128)
    assert llm.llm_engine.runner.model.native is not None
    alone = llm.generate([target], params)[0].outputs[0]
    among = llm.generate(crowd[:3] + [target] + crowd[3:], params)[3].outputs[0]
    assert alone.token_ids == among.token_ids
    assert [{k: v.logprob for k, v in d.items()} for d in alone.logprobs] == [{k: v.logprob for k, v in d.items()} for d in among.logprobs]


@pytest.mark.parametrize("kv", ["float16", "bfloat16", "int8", "fp8"])
def test_16bit_kv_cache_under_float32_runs_in_the_native_layer_loop(checkpoints, tmp_path, kv):
    """`kv_cache_dtype` float16 / bfloat16 / int8 / fp8 under float32 activations: the C++ layer loop writes K/V rounded
    to the pool's dtype (int8: codes and a float16 scale per token and head; fp8: e4m3 codes under the layer's scales,
    calibrated at load by the Python loop) and reads them back widened (decode attention and every prefill chunk),
    giving the bits the Python loop gives over the same cache; and the result is close to the float32 cache's, not
    equal to it. (fp8 used to leave the C++ loop altogether: 0.66x the float16 cache's decode step, SmolLM2.)"""
    path = export_gguf(checkpoints["qwen2"], tmp_path / "q.gguf", "q4_1", **QUIET)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": list(range(7, 7 + n))} for n in (5, 37, 70)]  # 37, 70: prefill in chunks of 16

    def run(kv_cache_dtype, native=True):
        llm = LLM(str(path), dtype="float32", kv_cache_dtype=kv_cache_dtype, num_gpu_blocks_override=64, max_num_batched_tokens=16)
        model = llm.llm_engine.runner.model
        assert model.native is not None
        steps, loop = [], model._forward_native
        model._forward_native = lambda *a: steps.append(1) or loop(*a)
        if not native:
            model.native = None
        outs = llm.generate(prompts, params)
        assert bool(steps) == native  # every step in C++, or none
        return llm.llm_engine.runner.kv_pool.dtype, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    def max_logprob_diff(a, b):
        return max(abs(x[t].logprob - y[t].logprob) for (_, la), (_, lb) in zip(a, b) for x, y in zip(la, lb) for t in x if t in y)

    pool_dtype, native = run(kv)
    assert pool_dtype == (torch.float8_e4m3fn if kv == "fp8" else getattr(torch, kv))
    python = run(kv, native=False)[1]
    assert [t for t, _ in python] == [t for t, _ in native]
    assert max_logprob_diff(native, python) == 0  # bit for bit
    _, plain = run("auto")
    assert 0 < max_logprob_diff(native, plain) < (0.25 if kv == "fp8" else 0.05)  # (fp8 keeps 3 mantissa bits: 0.154 here)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_python_layer_loop_gives_the_native_loops_bits_under_float32(checkpoints, tmp_path, arch):
    """A float32 model's Python layer loop runs the C++ loop's own norm, rotary and silu kernels (layer_ops.cpp), so
    every step's final hidden states are the same bits both ways, on a float32 cache and on a float16 one. Before,
    F.rms_norm's order of summation, PyTorch's separate multiply and add in the rotation and its exp left them 1e-7
    apart, which a float16 cache rounded into other keys (logprobs up to 1.6e-3 apart on 2 of 6 random checkpoints, 4 of 6
    with int4 on the AMX split)."""
    path = export_gguf(checkpoints[arch], tmp_path / "m.gguf", "q4_1", **QUIET)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(7, 7 + n))} for n in (5, 37, 20)]
    for kv in ("auto", "float16"):
        outs = []
        for native in (True, False):
            llm = LLM(str(path), dtype="float32", kv_cache_dtype=kv, num_gpu_blocks_override=64, max_num_batched_tokens=16)
            model, hidden = llm.llm_engine.runner.model, []
            assert model.native is not None
            if not native:
                model.native = None
            forward = model.forward
            model.forward = lambda *a, f=forward, h=hidden: h.append(f(*a)) or h[-1]
            llm.generate(prompts, params, use_tqdm=False)
            outs.append(hidden)
        assert len(outs[0]) == len(outs[1]) > 5
        for step, (a, b) in enumerate(zip(*outs)):
            assert torch.equal(a, b), (kv, step, (a - b).abs().max().item())


def test_16bit_kv_cache_keeps_batching_and_speculation_lossless(checkpoints, tmp_path):
    """On a float16 cache (native layer loop), a request gives the same tokens and logprobs alone and in a crowd, and
    n-gram speculation (drafted rows written rounded and read back in the step that verifies them) changes no token."""
    path = export_gguf(checkpoints["qwen2"], tmp_path / "q.gguf", "q4_1", **QUIET)
    kw = dict(dtype="float32", kv_cache_dtype="float16", num_gpu_blocks_override=256)
    prompts = [{"prompt_token_ids": ([5, 6, 7, 8, 9] * 8)[: 12 + 3 * i] + [100 + i]} for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    plain = LLM(str(path), **kw)
    crowd = plain.generate(prompts, params)
    alone = plain.generate([prompts[2]], params)[0].outputs[0]
    assert alone.token_ids == crowd[2].outputs[0].token_ids
    assert [d[t].logprob for d, t in zip(alone.logprobs, alone.token_ids)] == \
        [d[t].logprob for d, t in zip(crowd[2].outputs[0].logprobs, crowd[2].outputs[0].token_ids)]
    spec = LLM(str(path), speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **kw)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == [o.outputs[0].token_ids for o in crowd]
    stats = spec.llm_engine.speculator.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0


def write_minimal(path, arch="llama", tensors=None, fields=True, context=64):
    """A tiny GGUF written by hand: `tensors` maps name -> (array, raw type or None)."""
    w = gguf.GGUFWriter(str(path), arch)
    if fields:
        w.add_block_count(1)
        w.add_uint64("llama.context_length", context) if context >= 1 << 32 else w.add_context_length(context)
        w.add_embedding_length(32)
        w.add_feed_forward_length(64)
        w.add_head_count(2)
    for name, (arr, raw) in (tensors or {"token_embd.weight": (np.zeros((16, 32), np.float32), None)}).items():
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return path


def assert_reads_as_gguf_py(path) -> None:
    """sieve's header reader and the gguf package's GGUFReader on one file: the same metadata keys in order and
    values, and every tensor's name, type, shape, size, offset and data view (dtype, shape, bytes)."""
    from sieve.models.gguf_reader import GGUFFile, StringArray

    def plain(v):
        if isinstance(v, (np.ndarray, StringArray)):
            return v.tolist()
        return [plain(x) for x in v] if isinstance(v, list) else v

    ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for k in keys:
        got = plain(ours.fields[k])
        if got and isinstance(got, list) and isinstance(got[0], list):  # the gguf package flattens arrays of arrays
            got = [x for sub in got for x in sub]
        assert got == ref.fields[k].contents(), k
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.tensor_type, a.shape, a.n_bytes, a.data_offset) == (b.tensor_type, tuple(int(d) for d in b.shape),
                                                                     int(b.n_bytes), int(b.data_offset)), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name


def test_header_reader_reads_every_value_and_tensor_type_as_the_gguf_package(tmp_path):
    """A file with a value of every GGUF type (arrays of numbers, of strings, of bools and of arrays among them) and
    tensors of plain, integer, block and K-quant types."""
    T, Q = gguf.GGUFValueType, gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(str(tmp_path / "all.gguf"), "llama")
    for i, kind in enumerate([T.UINT8, T.INT8, T.UINT16, T.INT16, T.UINT32, T.INT32, T.UINT64, T.INT64]):
        w.add_key_value(f"test.int{i}", 7 + i if kind.name.startswith("U") else -7 - i, kind)
    w.add_key_value("test.f32", 0.1, T.FLOAT32)
    w.add_key_value("test.f64", 0.1, T.FLOAT64)
    w.add_key_value("test.bool", True, T.BOOL)
    w.add_key_value("test.str", "grüße, 世界", T.STRING)
    w.add_key_value("test.empty_str", "", T.STRING)
    w.add_array("test.ints", [3, -1, 4, 1, -5])
    w.add_array("test.floats", [0.5, 1e-3, -2.25])
    w.add_array("test.strings", ["a", "", "<end_of_turn>", "ß" * 40])
    w.add_array("test.bools", [True, False, True])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_array("test.empty", [])
    rng = np.random.default_rng(0)
    tensors = {"f32": (rng.standard_normal((3, 64), dtype=np.float32), None),
               "f16": (rng.standard_normal((2, 32)).astype(np.float16), None),
               "i8": (rng.integers(-9, 9, (4, 16), dtype=np.int8), Q.I8), "vec": (np.arange(5, dtype=np.float32), None)}
    for qtype in (Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0):
        tensors[qtype.name] = (gguf.quants.quantize(rng.standard_normal((2, 256), dtype=np.float32), qtype), qtype)
    for qtype in (Q.Q4_K, Q.Q6_K):  # the gguf package does not quantize K-quants: rows of random blocks
        tensors[qtype.name] = (rng.integers(0, 256, (3, 2 * gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype)
    for name, (arr, raw) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    assert_reads_as_gguf_py(tmp_path / "all.gguf")
    from sieve.models.gguf_reader import GGUFFile

    fields = GGUFFile(tmp_path / "all.gguf").fields
    assert [x.tolist() for x in fields["test.nested"]] == [[1, 2], [3]] and fields["test.str"] == "grüße, 世界"


def test_header_reader_reads_the_default_model_as_the_gguf_package():
    """SmolLM2-135M-Instruct's file: a 49,152-token vocabulary and merges (what took the gguf package 4-7 s)."""
    from sieve.models.default import default_model_path
    from sieve.models.gguf_reader import GGUFFile

    path = default_model_path()
    assert_reads_as_gguf_py(path)
    tokens = GGUFFile(path).fields["tokenizer.ggml.tokens"]
    assert len(tokens) == 49152 and tokens[0] == "<|endoftext|>"


@pytest.fixture(scope="module")
def bad_files(checkpoints, tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    good = export_gguf(checkpoints["llama"], d / "good.gguf", "q8_0", **QUIET)
    data = good.read_bytes()
    (d / "truncated-data.gguf").write_bytes(data[: len(data) - 5000])
    (d / "truncated-header.gguf").write_bytes(data[:300])
    (d / "garbage.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 40)
    (d / "not-gguf.gguf").write_bytes(b"PK\x03\x04 this is a zip file, not a model")
    write_minimal(d / "gpt2.gguf", arch="gpt2")
    write_minimal(d / "no-fields.gguf", fields=False)
    write_minimal(d / "huge-context.gguf", context=1 << 40)
    import struct  # a header that claims 2^62 vocabulary strings in a file of 49 bytes

    (d / "huge-array.gguf").write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1) + b"a" + struct.pack("<IIQ", 9, 8, 1 << 62))
    big = gguf.GGUFWriter(str(d / "big-endian.gguf"), "llama", endianess=gguf.GGUFEndian.BIG)
    big.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    big.write_header_to_file(), big.write_kv_data_to_file(), big.write_tensors_to_file(progress=False), big.close()
    write_minimal(d / "iq-type.gguf", tensors={"token_embd.weight": (np.zeros((16, 64), np.uint8), gguf.GGMLQuantizationType.I8)})
    two = d / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(data)
    (two / "b.gguf").write_bytes(data)
    return d


BAD = {  # file -> what the one-line error must name
    "truncated-data.gguf": "not a readable GGUF file",
    "truncated-header.gguf": "not a readable GGUF file",
    "garbage.gguf": "not a readable GGUF file",
    "not-gguf.gguf": "not a readable GGUF file: ValueError: GGUF magic invalid",
    "huge-array.gguf": "not a readable GGUF file: ValueError: an array of 4611686018427387904 strings runs past the end",
    "big-endian.gguf": "not a readable GGUF file: ValueError: the file is big-endian GGUF, which sieve does not read",
    "gpt2.gguf": "architecture 'gpt2' is not supported",
    "no-fields.gguf": "lacks llama.attention.head_count",
    "huge-context.gguf": "llama.context_length 1099511627776 is not a context length",
    "iq-type.gguf": "has type I8, which sieve does not load",
    "two": "holds 2 GGUF files",
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_files_raise_one_clear_error(bad_files, name):
    with pytest.raises((GGUFError, FileNotFoundError)) as e:
        LLM(str(bad_files / name), num_gpu_blocks_override=16)
    assert BAD[name] in str(e.value)


@pytest.mark.parametrize("name", ["truncated-data.gguf", "gpt2.gguf", "iq-type.gguf", "huge-context.gguf", "two"])
def test_bad_files_on_the_command_line_exit_non_zero_without_a_traceback(bad_files, name):
    for cmd in (["generate", "--prompt", "hi"], ["serve", "--port", "0"]):
        r = subprocess.run([sys.executable, "-m", "sieve.cli", *cmd, "--model", str(bad_files / name)], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr and BAD[name] in r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("error: ")


def test_llama_cpp_computes_the_same_logits_on_the_file_sieve_loads(checkpoints, tmp_path):
    """Only where the `peers` extra is installed: llama.cpp (llama-cpp-python) and sieve on one Q8_0 file."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path = export_gguf(checkpoints["qwen2"], tmp_path / "q8.gguf", "q8_0", **QUIET)
    ids = [5, 99, 1234, 7, 300, 42, 17, 2048]
    llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2)
    llm.eval(ids)
    theirs = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    engine = LLM(str(path), dtype="float32", dequantize=True, num_gpu_blocks_override=16).llm_engine
    ours = engine.score(ids).numpy()
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 7 / 8  # llama.cpp quantizes activations to Q8_0
    assert np.corrcoef(ours.ravel(), theirs.ravel())[0, 1] > 0.999
