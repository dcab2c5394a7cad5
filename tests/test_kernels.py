"""The native CPU paged-attention kernel agrees with the PyTorch path it replaces."""

from __future__ import annotations

import random

import pytest
import torch

from sieve import SamplingParams
from sieve.kernels import cpu_ops
from sieve.layers import attention
from sieve.layers.attention import AttentionMetadata, KVCacheLayer, decode_attention_reference


def decode_meta(lens: list[int], block_size: int, num_blocks: int, rng: random.Random) -> AttentionMetadata:
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)  # tables point anywhere in the pool
    tables, used = [], 0
    for n in lens:
        nb = -(-n // block_size)
        tables.append(blocks[used : used + nb])
        used += nb
    width = max(len(t) for t in tables)
    lens_t = torch.tensor(lens)
    return AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64), num_decodes=len(lens),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        decode_context_lens=lens_t, prefills=[],
    )


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size, kv_heads, heads, head_dim", [(16, 2, 14, 64), (1, 4, 4, 32), (8, 1, 8, 16), (32, 2, 4, 128)])
def test_native_decode_attention_matches_reference(dtype, tol, block_size, kv_heads, heads, head_dim):
    ops = cpu_ops()
    assert ops is not None, "the native CPU kernels should build on this machine (g++ and ninja)"
    rng = random.Random(block_size * 7 + heads)
    lens = [1, block_size, block_size + 1, 3 * block_size, 97, 300][: 6]
    num_blocks = sum(-(-n // block_size) for n in lens) + 5
    g = torch.Generator().manual_seed(0)
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    meta = decode_meta(lens, block_size, num_blocks, rng)
    scale = head_dim**-0.5
    got = ops.paged_decode_attention(q, k, v, meta.decode_block_tables, meta.decode_context_lens, scale)
    ref = decode_attention_reference(q, KVCacheLayer(k, v), meta, scale)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


def test_engine_outputs_equal_with_and_without_native_kernel(llama_engine_factory, monkeypatch):
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 40, 17, 90)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    native = llama_engine_factory().generate(prompts, params)
    monkeypatch.setattr(attention, "cpu_ops", lambda: None)
    reference = llama_engine_factory().generate(prompts, params)
    for a, b in zip(native, reference):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in la:
                assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-4)


@pytest.mark.parametrize("rows, out_features, in_features", [(1, 1152, 896), (3, 7, 100), (4, 513, 31), (2, 1, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_gemv_matches_linear(rows, out_features, in_features, with_bias):
    ops = cpu_ops()
    if not hasattr(ops, "gemv_bf16"):
        pytest.skip("this CPU has no AVX512-BF16: the GEMV kernel is not built and Linear uses oneDNN")
    g = torch.Generator().manual_seed(rows * 31 + out_features)
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16() if with_bias else None
    got = ops.gemv_bf16(x, w, b).float()
    exact = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    # float32 accumulation, one bf16 rounding at the end: within half a bf16 ulp (plus summation order)
    assert torch.all((got - exact).abs() <= exact.abs() * 2**-8 + 1e-2)


def test_linear_picks_gemv_for_small_batches_and_packed_for_large(monkeypatch):
    from sieve.layers.linear import Linear

    lin = Linear(64, [48, 16], bias=True, dtype=torch.bfloat16)
    torch.nn.init.normal_(lin.weight)
    lin.prepare(allow_two_layouts=True)
    calls = []
    if lin.gemv is not None:
        real = lin.gemv
        lin.gemv = lambda *a: calls.append("gemv") or real(*a)
    for rows in (1, 4, 5, 64):
        x = torch.randn(rows, 64).bfloat16()
        torch.testing.assert_close(lin(x).float(), torch.nn.functional.linear(x, lin.weight, lin.bias).float(), atol=0.1, rtol=0.02)
    if lin.gemv is not None:
        assert calls == ["gemv", "gemv"] and lin.packed is not None


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_native_one_byte_weight_kernels_decode_every_code(fmt):
    """dequant_q8 and gemv_q8 widen every int8 / e4m3 code (fp8: subnormals and signed zero too)
    exactly as PyTorch's conversion does."""
    ops = cpu_ops()
    if not hasattr(ops, "gemv_q8"):
        pytest.skip("this CPU has no AVX512-BF16: the one-byte-weight kernels are not built")
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    q = codes.view(torch.int8) if fmt == "int8" else codes.view(torch.float8_e4m3fn)
    exact = q.float()
    finite = ~exact.isnan()  # e4m3 has two NaN codes (0x7f, 0xff); quantization never writes them
    q = q[finite].reshape(2, -1) if fmt == "fp8" else q.reshape(4, -1)
    exact = exact[finite].reshape(q.shape)
    scale = torch.tensor([0.5, 2.0, 1.0, 0.25][: q.shape[0]])
    want = exact * scale[:, None]
    torch.testing.assert_close(ops.dequant_q8(q, scale).float(), want.bfloat16().float(), rtol=0, atol=0)
    # one-hot rows pick out single columns: y[m, n] = w[n, m] * scale[n], exactly (then rounded to bf16)
    x = torch.eye(4, q.shape[1]).bfloat16()
    torch.testing.assert_close(ops.gemv_q8(x, q, scale, None).float(), want[:, :4].t().bfloat16().float(), rtol=0, atol=0)
