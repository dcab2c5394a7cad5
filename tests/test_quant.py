"""Quantized weights (int8, fp8, int4, AWQ) and KV cache (fp8, int8): error bounds, kernels against
their dequantized reference, AWQ on real weights, capacity, and clear errors."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from sieve.quant.formats import quantize_fp8, quantize_int4, quantize_int8
from sieve.quant.kernels import make_kernel

SHARED_MODEL = "stories260K"


@pytest.fixture(scope="module")
def stories(request):
    from conftest import SHARED

    path = SHARED / "models" / SHARED_MODEL
    if not path.exists():
        pytest.fail(f"{path} is missing: ../shared holds the real checkpoint these tests measure")
    return path


def test_int8_per_channel_round_trip_is_within_half_a_step():
    w = torch.randn(96, 200) * torch.rand(96, 1) * 3
    q = quantize_int8(w)
    assert q.q.dtype == torch.int8 and q.scale.shape == (96,)
    assert ((q.dequantize() - w).abs() <= q.scale[:, None] / 2 + 1e-6).all()


def test_fp8_round_trip_keeps_three_mantissa_bits():
    w = torch.randn(64, 128) * torch.rand(64, 1) * 5
    q = quantize_fp8(w)
    assert q.q.dtype == torch.float8_e4m3fn
    err = (q.dequantize() - w).abs()
    # e4m3: relative error <= 2^-4 for normal numbers; values under the smallest normal (2^-6) round to
    # 0 or 2^-6, no subnormal codes
    assert (err <= w.abs() * 2**-4 + q.scale[:, None] * 2**-7 + 1e-7).all()
    codes = q.q.view(torch.uint8)
    assert not ((codes & 0x78 == 0) & (codes & 0x07 != 0)).any()
    tiny = torch.tensor([[448.0, 0.004, -0.004, 0.012, -0.009, 0.0]])  # in steps of the scale (1.0 here)
    assert quantize_fp8(tiny).dequantize().tolist() == [[448.0, 0.0, 0.0, 2**-6, -(2**-6), 0.0]]


@pytest.mark.parametrize("k,group", [(256, 128), (200, 64), (172, 128)])  # whole groups, and a short last group
def test_int4_groupwise_round_trip(k, group):
    w = torch.randn(48, k, generator=torch.Generator().manual_seed(k + group))
    q = quantize_int4(w, group)
    assert q.values().max() <= 15 and q.zero.max() <= 15 and q.scale.shape == (48, -(-k // group))
    step = q.scale.float().repeat_interleave(group, dim=1)[:, :k]
    # half a step, plus what rounding the min (at most 15 steps) to float16 moves the grid: 15 * 2^-11 of a step
    assert ((q.dequantize() - w).abs() <= step * (0.5 + 16 * 2**-11) + 1e-6).all()
    groups = -(-k // group)  # 4 bits per (padded) weight, a 16-bit scale and a 16-bit min per group
    assert q.nbytes == 48 * groups * group // 2 + 48 * groups * 2 + 48 * groups * 2


def _kernel_input(x: torch.Tensor) -> torch.Tensor:
    """x as the native kernels multiply it: rounded to bf16 by the AVX512-BF16 build, float32 otherwise."""
    from sieve.kernels import cpu_ops

    ops = cpu_ops()
    return x.bfloat16().float() if ops is not None and ops.isa == "avx512-bf16" else x.float()


def _q8_0(w: torch.Tensor) -> "ChannelScaledWeight":
    """GGUF's Q8_0 layout: int8 codes with a float16 scale per 32 inputs."""
    from sieve.quant.formats import ChannelScaledWeight

    n, k = w.shape
    s = (w.view(n, k // 32, 32).abs().amax(-1) / 127).half()
    q = torch.round(w.view(n, k // 32, 32) / s.float()[..., None]).clamp(-127, 127).to(torch.int8).view(n, k)
    return ChannelScaledWeight(q, s)


def _q4_0(w: torch.Tensor):
    """GGUF's Q4_0: 4-bit codes, w = (q - 8) * scale per 32 inputs, no min stored."""
    from sieve.quant.formats import Int4Weight

    q = quantize_int4(w, 32)
    return Int4Weight(q.packed, q.scale, None, 32, q.k)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8", "q8_0", "q4_0"])
@pytest.mark.parametrize("rows", [1, 3, 8, 32, 65])  # decode sizes, several row tiles, a prefill-sized batch with a partial tile
@pytest.mark.parametrize("shape", [(256, 256), (200, 128)])  # whole blocks, and padded rows
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernels_match_their_dequantized_weight(fmt, rows, shape, dtype):
    torch.manual_seed(0)
    n, k = shape
    w = torch.randn(n, k) * 0.05
    qw = {"int8": quantize_int8, "int4": lambda t: quantize_int4(t, 64), "fp8": quantize_fp8, "q8_0": _q8_0, "q4_0": _q4_0}[fmt](w)
    x = torch.randn(rows, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    kernel = make_kernel(qw, dtype, bias)
    got = kernel(x)
    assert got.dtype == dtype and got.shape == (rows, n)
    # the AVX512-BF16 kernels multiply x rounded to bf16 (exact products, float32 sums); AVX2 ones float32 x
    want = F.linear(_kernel_input(x), qw.dequantize(), bias.float())
    tol = 0.01 if dtype == torch.bfloat16 else 1e-5  # bf16 output rounding; float32 sums in another order
    assert (got.float() - want).abs().max() <= tol * want.abs().max()
    assert kernel.nbytes == qw.nbytes


@pytest.mark.parametrize("k,group", [(200, 64), (172, 128)])  # inputs padded to whole groups
def test_int4_kernel_with_padded_inputs(k, group):
    torch.manual_seed(k)
    w = torch.randn(48, k) * 0.05
    qw = quantize_int4(w, group)
    x = torch.randn(5, k)
    got = make_kernel(qw, torch.float32)(x)
    want = F.linear(_kernel_input(x), qw.dequantize())
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_native_kernel_is_chosen_for_bf16_and_float32_on_cpu():
    from sieve.kernels import cpu_ops
    from sieve.quant.kernels import BlockedKernel

    if not hasattr(cpu_ops(), "qmatmul_q8"):
        pytest.skip("a generic build (SIEVE_CPU_ISA=generic): the quantized kernels are not built")
    w = torch.randn(64, 128)
    for q in (quantize_int8(w), quantize_fp8(w), quantize_int4(w, 64)):
        assert isinstance(make_kernel(q, torch.bfloat16), BlockedKernel)
        assert isinstance(make_kernel(q, torch.float32), BlockedKernel)  # inputs rounded to bf16, float32 out
        assert not isinstance(make_kernel(q, torch.float16), BlockedKernel)  # float16 activations: PyTorch's path


@pytest.mark.parametrize("method", ["int8", "fp8", "int4"])
def test_quantized_engine_stays_close_to_the_checkpoint(stories, method):
    """On the real (trained) checkpoint: low KL and high top-1 agreement; weights shrink."""
    from sieve.evaluate import evaluate

    r = evaluate(str(stories), stories.parents[1] / "data" / "tinystories_valid_sample.txt", window=128, max_windows=3,
                 quantization=method, quantization_group_size=32)
    assert r["weight_bytes"] < 0.4 * r["reference_weight_bytes"]
    bound = {"int8": 0.01, "fp8": 0.05, "int4": 0.3}[method]
    assert r["kl_divergence"] < bound and r["top1_agreement"] > 0.7
    assert r["perplexity"] >= r["reference_perplexity"] * 0.97


def test_awq_beats_plain_rounding_and_its_checkpoint_reloads(stories, tmp_path):
    from safetensors.torch import load_file

    from sieve import LLM, SamplingParams
    from sieve.quant.awq import awq_quantize, from_awq_tensors, to_awq_tensors

    data = stories.parents[1] / "data" / "tinystories_valid_sample.txt"
    report = awq_quantize(stories, data, tmp_path / "awq", group=32, seq_len=128, max_windows=8, log=lambda s: None)
    awq, plain = sum(v["awq"] for v in report.values()), sum(v["plain"] for v in report.values())
    assert awq < 0.9 * plain  # the activation-aware scales cut the output error of the quantized linears

    cfg = json.loads((tmp_path / "awq" / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    tensors = load_file(str(tmp_path / "awq" / "model.safetensors"))
    qw = tensors["model.layers.0.mlp.gate_proj.qweight"]
    assert qw.dtype == torch.int32 and qw.shape == (64, 22)  # [in, ceil(172 / 8)]

    # pack -> unpack is exact
    w4 = quantize_int4(torch.randn(172, 64), 32)
    back = from_awq_tensors(**to_awq_tensors(w4), out_features=172, group=32)
    assert torch.equal(back.packed, w4.packed) and torch.equal(back.zero, w4.zero) and torch.equal(back.scale, w4.scale) and torch.equal(back.min, w4.min)

    # the checkpoint loads (recognised from its config), twice the same, and speaks like the original
    prompts = ["Once upon a time", "The little dog"]
    p = SamplingParams(max_tokens=24, temperature=0)
    a = LLM(str(tmp_path / "awq"), dtype="float32", num_gpu_blocks_override=64).generate(prompts, p)
    b = LLM(str(tmp_path / "awq"), dtype="float32", num_gpu_blocks_override=64).generate(prompts, p)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    ref = LLM(str(stories), dtype="float32", num_gpu_blocks_override=64).generate(prompts, p)
    same = sum(x == y for o, r in zip(a, ref) for x, y in zip(o.outputs[0].token_ids, r.outputs[0].token_ids))
    assert same >= 0.5 * 48
    with pytest.raises(ValueError, match="already quantized"):
        LLM(str(tmp_path / "awq"), quantization="int8")


@pytest.mark.parametrize("kv", ["fp8", "int8", "float16", "bfloat16"])
def test_quantized_kv_cache_attention_is_close(stories, kv):
    """Logits read through a quantized cache (prefill in chunks, so later chunks read it back) against
    the model-dtype cache, on the real checkpoint; and greedy decoding through the decode path."""
    from sieve.evaluate import load_engine

    plain = load_engine(str(stories), "float32", 128)
    text = (stories.parents[1] / "data" / "tinystories_valid_sample.txt").read_text()
    ids = plain.tokenizer(text).input_ids[:120]
    ref = plain.score(ids, chunk=16)
    got = load_engine(str(stories), "float32", 128, kv_cache_dtype=kv).score(ids, chunk=16)
    lr, lg = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = (lr.exp() * (lr - lg)).sum(-1).mean().item()
    # e4m3 keeps 3 mantissa bits; int8 per token-head ~7; bfloat16 8; float16 11
    assert 0 < kl < {"fp8": 0.05, "int8": 0.01, "bfloat16": 0.005, "float16": 1e-4}[kv]
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9

    from sieve import LLM, SamplingParams

    p = SamplingParams(max_tokens=32, temperature=0)
    a = LLM(str(stories), dtype="float32", kv_cache_dtype=kv, num_gpu_blocks_override=32).generate(["Once upon a time"], p)
    b = LLM(str(stories), dtype="float32", num_gpu_blocks_override=32).generate(["Once upon a time"], p)
    assert a[0].outputs[0].token_ids[:16] == b[0].outputs[0].token_ids[:16]


@pytest.mark.parametrize("kv", ["fp8", "int8", "float16"])
def test_lossy_kv_cache_attends_to_keys_as_stored_so_prefix_hits_and_chunks_change_nothing(stories, kv):
    """A cache that rounds (fp8, int8, float16 under float32): prefill attends to K/V as stored, its own chunk's too,
    so a prompt prefilled cold in one chunk, in chunks of 16, or after a prefix-cache hit gives the same logprobs."""
    from sieve import LLM, SamplingParams

    ids = list(range(40, 40 + 45))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)

    def run(llm, prompt):
        out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
        return out.token_ids, [{t: v.logprob for t, v in d.items()} for d in out.logprobs]

    def same(a, b):  # SDPA rounds a 45-row chunk and a 13-row one differently in the last digits, no more
        return a[0] == b[0] and all(abs(x[t] - y[t]) < 1e-5 for x, y in zip(a[1], b[1]) for t in x)

    kw = dict(dtype="float32", kv_cache_dtype=kv, num_gpu_blocks_override=64)
    cold = run(LLM(str(stories), enable_prefix_caching=False, **kw), ids)
    assert same(run(LLM(str(stories), enable_prefix_caching=False, max_num_batched_tokens=16, **kw), ids), cold)
    warm = LLM(str(stories), **kw)
    run(warm, ids[:33] + [7, 8])  # caches the first two blocks of 16
    assert same(run(warm, ids), cold)
    assert warm.llm_engine.block_manager.num_hit_tokens == 32


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_quantized_kv_cache_under_bf16_prefills_each_row_alone(llama_dir, kv):
    """Under bf16 activations, prefill chunks over fp8 / int8 codes go through the paged attention kernel, each row
    alone over its context, as decodes do (they used to take SDPA over a widened copy of the whole context, for every
    chunk of every layer: an FP8 cache's TTFT p99 went from 0.5 to 6.7 s at 35 users of the ladder). So a prompt in
    one chunk or in chunks of 16 gives the same logprobs, bit for bit (every linear through one kernel:
    batch_invariant), in the C++ layer loop and in the Python one, which never calls SDPA here."""
    import sieve.layers.attention as attention
    from sieve import LLM, SamplingParams

    ids = [(7 * i) % 4000 + 5 for i in range(70)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)

    def run(native: bool, **kw):
        llm = LLM(str(llama_dir), dtype="bfloat16", kv_cache_dtype=kv, num_gpu_blocks_override=64, batch_invariant=True,
                  enable_prefix_caching=False, **kw)
        if not native:
            llm.llm_engine.runner.model.native = None
        out = llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0]
        return out.token_ids, [{t: v.logprob for t, v in d.items()} for d in out.logprobs]

    native = run(True)
    assert run(True, max_num_batched_tokens=16) == native

    def no_sdpa(*args, **kwargs):
        raise AssertionError("a prefill chunk over fp8 / int8 codes took SDPA")

    real, attention.F.scaled_dot_product_attention = attention.F.scaled_dot_product_attention, no_sdpa
    try:
        python = run(False)
        assert run(False, max_num_batched_tokens=16) == python
    finally:
        attention.F.scaled_dot_product_attention = real
    # the two loops' bf16 arithmetic may differ in the last bits on another CPU, and a random model's later tokens
    # can tie (a margin of 0.0 here): their first token's logprobs (top-1 margin 0.11) agree within bf16 rounding
    first_native, first_python = native[1][0], python[1][0]
    assert native[0][0] == python[0][0] and first_native.keys() == first_python.keys()
    assert all(abs(first_native[t] - first_python[t]) < 0.05 for t in first_native)


def test_kv_capacity_doubles_in_the_same_memory(llama_dir):
    from sieve import EngineConfig, LLMEngine

    def blocks(kv):
        e = LLMEngine(EngineConfig(model=str(llama_dir), dtype="bfloat16", kv_cache_memory_gb=0.01, kv_cache_dtype=kv,
                                   max_num_seqs=1024))
        return e.block_manager.num_blocks, e.arch.head_dim

    base, d = blocks("auto")
    fp8, _ = blocks("fp8")
    int8, _ = blocks("int8")
    assert fp8 == pytest.approx(2 * base, abs=1)
    assert int8 == pytest.approx(2 * base * d / (d + 2), abs=1)  # a float16 scale per token and head
    assert blocks("float16")[0] == base  # a bf16 model's cache is 16-bit already


def test_16bit_kv_cache_holds_twice_the_tokens_of_a_float32_one(llama_dir):
    from sieve import EngineConfig, LLMEngine

    def blocks(kv):
        e = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", kv_cache_memory_gb=0.01, kv_cache_dtype=kv,
                                   max_num_seqs=1024))
        return e.block_manager.num_blocks

    base = blocks("auto")
    assert blocks("float16") == pytest.approx(2 * base, abs=1)
    assert blocks("bfloat16") == pytest.approx(2 * base, abs=1)


def test_unsupported_combinations_are_clear_errors(llama_dir):
    from sieve import LLM
    from sieve.config import EngineConfig

    with pytest.raises(ValueError, match="AWQ checkpoint"):
        LLM(str(llama_dir), quantization="awq")
    for bad in (dict(quantization="int3"), dict(kv_cache_dtype="fp4"), dict(quantization_group_size=0)):
        with pytest.raises(ValueError):
            EngineConfig(**bad).validate()


def test_cli_eval_gates_on_max_kl(stories, capsys):
    from sieve.cli import main

    data = str(stories.parents[1] / "data" / "tinystories_valid_sample.txt")
    base = ["eval", "--model", str(stories), "--data", data, "--window", "64", "--max-windows", "2", "--quantization", "int4",
            "--quantization-group-size", "32"]
    assert main(base + ["--json"]) == 0
    out = capsys.readouterr().out
    r = json.loads(out[out.index("{"):])
    assert r["kl_divergence"] > 0 and 0 < r["top1_agreement"] <= 1
    assert main(base + ["--max-kl", "1e-9"]) == 3


def test_fp8_kv_scales_do_not_depend_on_request_order(stories):
    """FP8 KV scales without checkpoint scales are fixed at load from fixed text: a greedy request gives the
    same tokens whether it runs first or after other, very different, requests."""
    from sieve import LLM, SamplingParams

    p = SamplingParams(max_tokens=24, temperature=0)
    target = "Once upon a time, there was a little girl named Lily."

    def make():
        return LLM(str(stories), dtype="float32", kv_cache_dtype="fp8", num_gpu_blocks_override=64)

    first = make()
    alone = first.generate([target], p)[0].outputs[0].token_ids
    scales = [float(c.k_scale) for c in first.llm_engine.runner.caches]
    after = make()
    after.generate([{"prompt_token_ids": list(range(3, 200))}, "zzzz !!!! 9999 ####"], SamplingParams(max_tokens=8))
    assert [float(c.k_scale) for c in after.llm_engine.runner.caches] == scales
    assert after.generate([target], p)[0].outputs[0].token_ids == alone
    assert not any(c.calibrate for c in after.llm_engine.runner.caches)
