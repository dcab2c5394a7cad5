"""activation_quantization="int8": int4 weights (GGUF Q4_0 / Q4_1, int4) against activations quantized to int8
per row and 32 inputs, as llama.cpp multiplies them. The CPU kernel (sieve/kernels/qmatmul_q8act.cpp) against
its PyTorch reference (sieve/quant/q8_activations.py) at every batch size; an engine that takes the option runs
it in every int4 linear, gives a request the same output alone and in a crowd, and speculates losslessly on
it; a model without int4 weights, or a bad value, is refused."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from sieve import LLM, SamplingParams
from sieve.bench.gguf_export import export_gguf
from sieve.config import ConfigError, EngineConfig
from sieve.kernels import cpu_ops
from sieve.quant.formats import Int4Weight, quantize_int4
from tests.conftest import cpu_flags
from sieve.quant.kernels import BlockedKernel, make_kernel
from sieve.quant.q8_activations import int4_matmul, quantize_rows


@pytest.fixture(scope="module")
def ops():
    ops = cpu_ops()
    if not hasattr(ops, "qmatmul_int4"):
        pytest.skip("a generic build (SIEVE_CPU_ISA=generic): the quantized kernels are not built")
    return ops


def q4_0(w: torch.Tensor) -> Int4Weight:
    q = quantize_int4(w, 32)
    return Int4Weight(q.packed, q.scale, None, 32, q.k)  # no min: w = (q - 8) s


def test_activations_quantize_per_32_inputs_with_round_half_even():
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5, -127.0] + [0.0] * 27 + [0.0] * 32])
    q, d, xs = quantize_rows(x, 64)
    assert d[0, 0] == pytest.approx(1.0) and d[0, 1] == 0  # a block of zeros: scale 0, codes 0
    assert q[0, :5].tolist() == [127, 0, 2, -2, -127] and q[0, 32:].abs().sum() == 0
    assert xs[0].tolist() == [pytest.approx(-0.5), 0.0]
    with pytest.raises(ValueError, match="blocks of 32"):
        quantize_rows(x, 48)


@pytest.mark.parametrize("name", ["int4 g32", "q4_0", "int4 g128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_its_pytorch_reference_at_every_batch_size(ops, name, dtype):
    torch.manual_seed(0)
    quant = {"int4 g32": lambda w: quantize_int4(w, 32), "q4_0": q4_0, "int4 g128": lambda w: quantize_int4(w, 128)}[name]
    for n, k in ((256, 256), (200, 96 if name != "int4 g128" else 300)):  # odd sizes: padded rows and inputs
        w = quant(torch.randn(n, k) * 0.05)
        bias = torch.randn(n).to(dtype)
        kern = make_kernel(w, dtype, bias)
        assert isinstance(kern, BlockedKernel)
        kern.native.q8_activations = True
        for rows in (1, 2, 3, 4, 5, 7, 8, 33):
            x = torch.randn(rows, k).to(dtype)
            got = kern(x)
            assert got.dtype == dtype and got.shape == (rows, n)
            if rows > 1:  # every row the same integer sums and float steps, however many share the call
                assert torch.equal(kern(x[1:2]), got[1:2])
            want = int4_matmul(x, w, bias)
            err = ((got.float() - want).abs().max() / want.abs().max()).item()
            assert err <= (1e-5 if dtype == torch.float32 else 1e-2), f"{name} {dtype} {rows} rows: {err}"
            float_path = F.linear(x.float(), w.dequantize(), bias.float())
            lossy = ((got.float() - float_path).abs().max() / float_path.abs().max()).item()
            assert 0 < lossy < 0.05  # int8 activations: close to the exact product, and not it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vnni_and_avx2_inner_kernels_give_the_same_bits(ops, dtype):
    """Where the build has AVX512-VNNI, vpdpbusd sums a unit's 4 products per row in one instruction; the sums are the
    same exact integers and the float steps the same, so its outputs equal the AVX2 kernel's bit for bit."""
    flags = cpu_flags()
    has_vnni = ops.isa == "avx512-bf16" and "avx512_vnni" in flags
    # the fastest the build and CPU allow is the default: the tiles where the CPU has AMX-INT8 (Linux grants them)
    assert ops.q8act_kernel() == ("amx-int8" if has_vnni and {"amx_tile", "amx_int8"} <= flags else "avx512-vnni" if has_vnni else "avx2")
    if not has_vnni:
        with pytest.raises(RuntimeError, match="not avx512-vnni"):
            ops.set_q8act_kernel("avx512-vnni")
        pytest.skip("this CPU build has no AVX512-VNNI: only the AVX2 inner kernel exists to compare")
    torch.manual_seed(1)
    for w, k in ((quantize_int4(torch.randn(200, 300) * 0.05, 32), 300), (q4_0(torch.randn(96, 128) * 0.05), 128),
                 (quantize_int4(torch.randn(64, 256) * 0.05, 128), 256)):
        kern = make_kernel(w, dtype, torch.randn(w.scale.shape[0]).to(dtype))
        kern.native.q8_activations = True
        x = (torch.randn(11, k) * torch.logspace(-2, 1, k)).to(dtype)  # spread magnitudes: every block its own scale
        outs = {}
        for name in ("avx2", "avx512-vnni"):  # (the AMX-INT8 tiles against vpdpbusd: the test below)
            before = ops.set_q8act_kernel(name)
            try:
                outs[name] = [kern(x[:r]) for r in (1, 4, 8, 11)]
            finally:
                ops.set_q8act_kernel(before)
        for a, b in zip(outs["avx2"], outs["avx512-vnni"]):
            assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="not int2"):
        ops.set_q8act_kernel("int2")


@pytest.fixture
def amx_int8(ops):
    """The AMX-INT8 tiles for every call (from one row: by default they take calls of q8act_amx_rows() rows and more);
    skipped on a CPU without them, as the CUDA tests are without a GPU."""
    if not (ops.isa == "avx512-bf16" and {"amx_tile", "amx_int8"} <= cpu_flags()):
        with pytest.raises(RuntimeError, match="not amx-int8|grant"):
            ops.set_q8act_kernel("amx-int8")
        pytest.skip("this CPU has no AMX-INT8 tiles")
    assert ops.q8act_amx_rows() == 10  # the default: where the tiles overtake vpdpbusd (docs/design-notes.md, issue 15)
    with pytest.raises(RuntimeError, match="at least 1"):
        ops.set_q8act_amx_rows(0)
    before, rows = ops.set_q8act_kernel("amx-int8"), ops.set_q8act_amx_rows(1)
    yield ops
    ops.set_q8act_kernel(before), ops.set_q8act_amx_rows(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amx_int8_tiles_give_the_vnni_kernels_bits_at_every_row_count(amx_int8, dtype):
    """The tiles' int32 sums are vpdpbusd's exact integers and each block ends with the VNNI kernel's float steps in its
    order, so every output is that kernel's, bit for bit: with and without mins, groups of 32 and 128, padded outputs and
    inputs, and 1 to 40 rows (one, two and three tiles of rows, the last padded)."""
    ops = amx_int8
    torch.manual_seed(2)
    for w, k in ((quantize_int4(torch.randn(200, 300) * 0.05, 32), 300), (q4_0(torch.randn(96, 128) * 0.05), 128),
                 (quantize_int4(torch.randn(64, 256) * 0.05, 128), 256), (quantize_int4(torch.randn(3072, 576) * 0.05, 32), 576)):
        kern = make_kernel(w, dtype, torch.randn(w.scale.shape[0]).to(dtype))
        kern.native.q8_activations = True
        x = (torch.randn(40, k) * torch.logspace(-2, 1, k)).to(dtype)
        for rows in (1, 2, 7, 9, 10, 16, 17, 33, 40):
            tiles = kern(x[:rows])
            ops.set_q8act_kernel("avx512-vnni")
            try:
                vnni = kern(x[:rows])
            finally:
                ops.set_q8act_kernel("amx-int8")
            assert torch.equal(tiles, vnni), (k, rows)
            assert torch.equal(kern(x[rows - 1:rows]), tiles[-1:])  # a row's bits alone as among others


def test_kernel_refuses_groups_it_cannot_take(ops):
    w = quantize_int4(torch.randn(32, 64), 16)
    from sieve.quant.kernels import block_int4

    wb, s, mn = block_int4(w)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.qmatmul_int4(torch.randn(1, 64), wb, s, mn, 16, None, 32, True)


@pytest.fixture(scope="module")
def q4_1_file(checkpoints, tmp_path_factory):
    return export_gguf(checkpoints["llama"], tmp_path_factory.mktemp("q8act") / "q4_1.gguf", "q4_1", log=lambda s: None)


def repeating_prompts(n: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        span = [rng.randrange(3, 4000) for _ in range(rng.randint(4, 20))]
        prompts.append({"prompt_token_ids": span * rng.randint(2, 4) if i % 3 else [rng.randrange(3, 4000) for _ in range(rng.randint(5, 60))]})
    return prompts


def test_engine_runs_every_int4_linear_on_int8_activations(ops, q4_1_file, caplog):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    target = {"prompt_token_ids": [5, 99, 1234, 7, 300, 5, 99]}
    exact = LLM(str(q4_1_file), dtype="float32", num_gpu_blocks_override=128)
    with caplog.at_level("INFO", logger="sieve"):
        llm = LLM(str(q4_1_file), dtype="float32", num_gpu_blocks_override=128, activation_quantization="int8")
    assert "activation_quantization int8" in caplog.text
    natives = [m.native for m in llm.llm_engine.runner.model.modules() if hasattr(getattr(m, "native", None), "q8_activations")]
    int4 = [n for n in natives if n.kind == ops.LINEAR_INT4]
    assert int4 and all(n.q8_activations for n in int4)
    alone = llm.generate([target], params)[0].outputs[0]
    base = exact.generate([target], params)[0].outputs[0]
    lp = [d[t].logprob for d, t in zip(alone.logprobs, alone.token_ids)]
    lp_exact = [d[t].logprob for d, t in zip(base.logprobs, base.token_ids)]
    assert lp != lp_exact  # the option is on: other numbers than the exact kernel's
    crowd = repeating_prompts(6, seed=3)
    among = llm.generate(crowd[:3] + [target] + crowd[3:], params)[3].outputs[0]
    assert among.token_ids == alone.token_ids  # batch invariant, bit for bit
    assert [d[t].logprob for d, t in zip(among.logprobs, among.token_ids)] == lp


def test_speculation_on_int8_activations_is_lossless(q4_1_file):
    prompts = repeating_prompts(12)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    kw = dict(dtype="float32", num_gpu_blocks_override=256, activation_quantization="int8")
    plain = LLM(str(q4_1_file), **kw)
    # the draft: the same file on the exact kernels, so most drafts are right and a few are not
    spec = LLM(str(q4_1_file), speculative_config={"method": "draft_model", "model": str(q4_1_file), "num_speculative_tokens": 3}, **kw)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
    stats = spec.llm_engine.speculator.stats
    assert 0 < stats.num_accepted_tokens  # drafts were verified on the int8 path and kept
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # (and some rejected)


def test_an_engine_on_the_amx_int8_tiles_gives_the_vnni_kernels_tokens_and_logprobs(amx_int8, q4_1_file):
    """A whole engine on int8 activations, switched between the tiles (every call) and vpdpbusd: prefill, 12 decoding
    requests and their ngram drafts give the same tokens and logprobs, bit for bit."""
    ops = amx_int8
    prompts = repeating_prompts(12, seed=5)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    llm = LLM(str(q4_1_file), dtype="float32", num_gpu_blocks_override=256, activation_quantization="int8",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})

    def run():
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return [(o.token_ids, [d[t].logprob for d, t in zip(o.logprobs, o.token_ids)]) for o in outs]

    tiles = run()
    ops.set_q8act_kernel("avx512-vnni")
    assert run() == tiles
    assert llm.llm_engine.speculator.stats.num_accepted_tokens > 0  # drafted rows went through both


def test_models_without_int4_weights_and_bad_values_are_refused(llama_dir):
    with pytest.raises(ConfigError, match="takes int4 weights"):
        LLM(str(llama_dir), dtype="float32", num_gpu_blocks_override=16, activation_quantization="int8")
    with pytest.raises(ConfigError, match="activation_quantization must be int8"):
        EngineConfig(model=str(llama_dir), activation_quantization="int4").validate()
    with pytest.raises(ConfigError, match="activation_quantization must be int8"):
        LLM(str(llama_dir), activation_quantization="fp8")


def test_command_line_takes_the_option_and_refuses_it_without_a_traceback(q4_1_file, llama_dir):
    import subprocess
    import sys

    def run(*args):
        return subprocess.run([sys.executable, "-m", "sieve.cli", "generate", "--prompt", "Hello", "--max-tokens", "4",
                               "--temperature", "0", "--ignore-eos", "--dtype", "float32", *args], capture_output=True, text=True, timeout=300)

    r = run("--model", str(q4_1_file), "--activation-quantization", "int8")
    assert r.returncode == 0, r.stderr
    r = run("--model", str(llama_dir), "--activation-quantization", "int8")
    assert r.returncode != 0 and "takes int4 weights" in r.stderr and "Traceback" not in r.stderr
