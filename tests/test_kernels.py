"""The native CPU paged-attention kernel agrees with the PyTorch path it replaces."""

from __future__ import annotations

import contextlib
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


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size, L, rows", [(16, 40, 5), (4, 15, 5), (8, 1, 5), (16, 3, 37)])
def test_native_decode_attention_rows_of_one_sequence_equal_each_row_alone(block_size, L, rows, dtype, tol):
    """A decode and its drafts are rows with context L, L + 1, ... through one block table, which the kernel walks
    once for all of them: each row's result is bit for bit what it gets alone, and matches the reference. 37 rows
    are a prefill chunk's shape (the bf16 layer loop sends chunks through this kernel), split into groups of 16."""
    ops = cpu_ops()
    heads, kv_heads, head_dim = 6, 2, 64
    need = -(-(L + rows) // block_size)
    num_blocks = 2 * need + 1
    g = torch.Generator().manual_seed(1)
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(rows + 1, heads, head_dim, generator=g).to(dtype)
    table, other = list(range(need))[::-1], list(range(need, 2 * need))
    tables = torch.tensor([table] * rows + [other])  # the last row: another sequence at the same length as row 0
    lens = torch.tensor([L + i for i in range(rows)] + [L])
    scale = head_dim**-0.5
    got = ops.paged_decode_attention(q, k, v, tables, lens, scale)
    for r in range(rows + 1):
        alone = ops.paged_decode_attention(q[r : r + 1].contiguous(), k, v, tables[r : r + 1], lens[r : r + 1], scale)
        assert torch.equal(got[r], alone[0]), r
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), rows + 1, tables, lens, [])
    ref = decode_attention_reference(q, KVCacheLayer(k, v), meta, scale)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("profile", ["sink", "rising", "late", "flat"])
def test_native_decode_attention_where_the_softmax_max_stands_and_where_it_rises(profile, dtype, tol):
    """The online softmax keeps a running max per query: a tile that does not raise it skips the horizontal max, the
    rescale and its multiply (an exact factor of 1), one that does rescales what came before. Scores shaped to take
    each path on every tile: a first token far above the rest (an attention sink: the max stands from the first
    tile), scores rising token by token (raised on every tile), one token far above the rest near the end (everything
    before it rescaled by a tiny factor), and equal scores. Rows of one sequence, alone and grouped, match the
    reference and each other."""
    ops = cpu_ops()
    bs, kv_heads, heads, head_dim, L, rows = 16, 2, 6, 64, 200, 9
    need = -(-(L + rows) // bs)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(rows, heads, head_dim, generator=g)
    u = q[:, 0::3].mean(dim=(0, 1))  # a direction every query head shares
    u = u / u.norm()
    n = need * bs
    level = {"sink": torch.cat([torch.tensor([12.0]), torch.zeros(n - 1)]), "rising": torch.linspace(-6, 6, n),
             "late": torch.cat([torch.zeros(L - 3), torch.tensor([30.0]), torch.zeros(n - L + 2)]), "flat": torch.zeros(n)}[profile]
    k = (0.05 * torch.randn(n, kv_heads, head_dim, generator=g) + level[:, None, None] * u).view(need, bs, kv_heads, head_dim)
    v = torch.randn(need, bs, kv_heads, head_dim, generator=g)
    q = q.abs().mean() * 8 * u + 0.05 * q  # queries along u: a score follows its key's level
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    tables = torch.tensor([list(range(need))] * rows)
    lens = torch.arange(L, L + rows)
    scale = head_dim**-0.5
    got = ops.paged_decode_attention(q.contiguous(), k, v, tables, lens, scale)
    for r in range(rows):
        alone = ops.paged_decode_attention(q[r : r + 1].contiguous(), k, v, tables[r : r + 1], lens[r : r + 1], scale)
        assert torch.equal(got[r], alone[0]), r
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), rows, tables, lens, [])
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


@pytest.mark.parametrize("rows, out_features, in_features", [(1, 1152, 896), (3, 7, 100), (4, 513, 31), (2, 1, 64), (8, 65, 96), (6, 130, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_gemv_matches_linear(rows, out_features, in_features, with_bias):
    ops = cpu_ops()
    if not hasattr(ops, "gemv_bf16"):
        pytest.skip("this CPU has no AVX512-BF16: the GEMV kernel is not built and Linear uses oneDNN")
    rows = min(rows, ops.gemv_max_rows)  # 8 with AVX512-BF16, 4 with AVX2
    g = torch.Generator().manual_seed(rows * 31 + out_features)
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16() if with_bias else None
    got = ops.gemv_bf16(x, w, b).float()
    exact = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    # float32 accumulation, one bf16 rounding at the end: within half a bf16 ulp (plus summation order)
    assert torch.all((got - exact).abs() <= exact.abs() * 2**-8 + 1e-2)


def _prepared_bf16_linear(in_features: int, shard_sizes: list[int]):
    """(native ops, a bf16 Linear with random weight and bias, its kernels picked); skips on a generic build."""
    from sieve.layers.linear import Linear

    ops = cpu_ops()
    if not hasattr(ops, "gemv_bf16"):
        pytest.skip("a generic build (SIEVE_CPU_ISA=generic): no GEMV kernel, Linear uses oneDNN")
    lin = Linear(in_features, shard_sizes, bias=True, dtype=torch.bfloat16)
    torch.nn.init.normal_(lin.weight)
    torch.nn.init.normal_(lin.bias)
    lin.prepare(allow_two_layouts=True)
    return ops, lin


def test_bf16_linear_rows_do_not_depend_on_the_batch_up_to_the_gemv_rows():
    """Up to `gemv_max_rows` rows (8 with AVX512-BF16) the bf16 linear is the GEMV, whose every (weight row, x row)
    sum is the same arithmetic whatever the number of rows: a row's output is bit for bit the same alone or among
    up to 7 others, so a decode's logits do not depend on how many sequences share its step, nor a verification's
    rows (a decode and up to 7 drafts) on being verified together."""
    ops, lin = _prepared_bf16_linear(200, [96, 37])
    x = torch.randn(ops.gemv_max_rows, 200).bfloat16()
    alone = torch.cat([lin(x[r : r + 1]) for r in range(len(x))])
    for rows in range(2, len(x) + 1):
        assert torch.equal(lin(x[:rows]), alone[:rows]), rows
    if ops.isa == "avx512-bf16":
        assert ops.gemv_max_rows == 8


def test_linear_picks_gemv_for_small_batches_and_packed_for_large():
    """The native linear (sieve/kernels/linear.cpp) answers 1 to gemv_max_rows rows with the GEMV and more with
    float32 FMA panels in the AVX2 build (qmatmul_avx2.cpp) and where the CPU's vdpbf16ps is slow (the AVX512-BF16
    build's `bf16_dot_kernel() == "fma"`: gemm_bf16.cpp), and then no oneDNN copy of the weight is made; else with
    oneDNN's packed weight (ATen's linear where oneDNN could not pack it): bit for bit what each of those gives
    called directly. (The AVX2 build's panels were compared with ATen's linear, whose bf16 rounding of a float32 sum
    differs from theirs in about 1 output of 13,000: the test failed on 2 of 3 runs of random inputs.)"""
    ops, lin = _prepared_bf16_linear(64, [48, 16])
    fma_panels = ops.isa == "avx2" or (ops.isa == "avx512-bf16" and ops.bf16_dot_kernel() == "fma")
    assert lin.native is not None
    assert (lin.packed is None) == (fma_panels or ops.isa != "avx512-bf16")
    if fma_panels:
        assert "float32 panels" in lin.kernel_name()
    for rows in (1, 4, 5, 8, 9, 64, 200):
        x = torch.randn(rows, 64).bfloat16()
        got = lin(x)
        if rows <= ops.gemv_max_rows:
            want = ops.gemv_bf16(x, lin.weight, lin.bias)
        elif fma_panels:
            want = ops.gemm_bf16_fma(x, lin.weight, lin.bias)
        elif lin.packed is not None:
            want = torch.ops.mkldnn._linear_pointwise(x, lin.packed, lin.bias, "none", [], "")
        else:
            want = torch.nn.functional.linear(x, lin.weight, lin.bias)
        assert torch.equal(got, want)
        torch.testing.assert_close(got.float(), torch.nn.functional.linear(x, lin.weight, lin.bias).float(), atol=0.1, rtol=0.02)


@pytest.mark.parametrize("rows, out_features, in_features", [(1, 32, 16), (12, 33, 17), (13, 70, 40), (29, 7, 100), (131, 65, 9)])
def test_fma_panel_gemm_sums_every_output_in_order(rows, out_features, in_features):
    """gemm_bf16.cpp (bf16 weights above the GEMV's rows where vdpbf16ps is slow): each output is its K products
    added in input order to one float32 accumulator (a bf16 product is exact in float32, so each FMA rounds as one
    float32 addition does), plus the bias, rounded once to bf16. Checked bit for bit against that sum written out,
    across the kernel's edges: tiles of 1 to 12 rows, 32-output panels with a partial last one, inputs not a
    multiple of 16, and more than one 128-row chunk of x."""
    ops = cpu_ops()
    if ops is None or ops.isa != "avx512-bf16":
        pytest.skip(f"a {ops.isa if ops else 'PyTorch-only'} build: the FMA panel GEMM is the AVX512-BF16 build's")
    g = torch.Generator().manual_seed(rows + out_features)
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16()
    acc = torch.zeros(rows, out_features)
    for k in range(in_features):
        acc = acc + x[:, k : k + 1].float() * w[:, k].float()
    assert torch.equal(ops.gemm_bf16_fma(x, w, b), (acc + b.float()).bfloat16())
    assert torch.equal(ops.gemm_bf16_fma(x, w, None), acc.bfloat16())


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_native_one_byte_weight_kernels_decode_every_code(fmt):
    """The blocked kernel reads every int8 / e4m3 code (fp8: signed zero too; not the subnormals, which
    quantize_fp8 never writes) exactly as PyTorch converts it, at any input scale."""
    from sieve.quant.kernels import block_bytes

    ops = cpu_ops()
    if not hasattr(ops, "qmatmul_q8"):
        pytest.skip("a generic build (SIEVE_CPU_ISA=generic): the quantized kernels are not built")
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    q = codes.view(torch.int8) if fmt == "int8" else codes.view(torch.float8_e4m3fn)
    written = ~q.float().isnan()  # e4m3 has two NaN codes (0x7f, 0xff); quantization never writes them
    if fmt == "fp8":
        written &= ~((codes & 0x78 == 0) & (codes & 0x07 != 0))  # nor subnormals
    q = q[written].reshape(-1, 2)  # [127 or 120 rows, 2 inputs]
    scale = torch.rand(q.shape[0]) + 0.5
    want = q.float() * scale[:, None]
    fp8 = fmt == "fp8"
    # one-hot rows of x pick out single inputs: y[m, n] = w[n, m] * scale[n], exactly (then rounded to bf16)
    for x_scale in (1.0, 2.0**-60, 2.0**60):  # the fp8 kernel shifts inputs by 2^64: neither flushed nor overflowing
        got = ops.qmatmul_q8(torch.eye(2).bfloat16() * x_scale, block_bytes(q), fp8, scale, 0, None, q.shape[0])
        torch.testing.assert_close(got.float(), (want.t() * x_scale).bfloat16().float(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fma_form_of_the_bf16_dot_products_gives_the_same_bits(dtype):
    """Where vdpbf16ps is slow (2 cycles of one port on the Emerald Rapids host, against 2 FMAs a cycle), the int4 and
    int8 tiles of 2 or more rows run each one as the two float32 FMAs the instruction is defined as (odd pair first,
    round to nearest even, DAZ/FTZ). It is only ever chosen where the two forms agree bit for bit on this CPU; then
    every output, at every row count, every format and both activation dtypes, is the same either way: the register
    tiles and, from 16 (Q8_0) / 24 (int4) rows, the float32 panels the codes are decoded into once per call."""
    from sieve.quant.formats import ChannelScaledWeight, Int4Weight, quantize_int4, quantize_int8
    from sieve.quant.kernels import make_kernel

    ops = cpu_ops()
    if ops is None or ops.isa != "avx512-bf16":
        pytest.skip(f"a {ops.isa if ops else 'PyTorch-only'} build: no AVX512-BF16 dot products to replace")
    with pytest.raises(RuntimeError, match="not vnni"):
        ops.set_bf16_dot_kernel("vnni")
    if not ops.bf16_dot_fma_exact():
        assert ops.bf16_dot_kernel() == "dpbf16"  # never chosen where the bits would differ
        pytest.skip("this CPU's vdpbf16ps rounds otherwise than its two-FMA definition: the FMA form stays unused")
    torch.manual_seed(3)

    def q8_0(w):  # int8 codes with a float16 scale per 32 inputs (GGUF Q8_0)
        n, k = w.shape
        s = (w.view(n, k // 32, 32).abs().amax(-1) / 127).clamp(min=1e-8).half()
        return ChannelScaledWeight(torch.round(w.view(n, k // 32, 32) / s.float()[..., None]).clamp(-127, 127).to(torch.int8).view(n, k), s)

    def q4_0(w):
        q = quantize_int4(w, 32)
        return Int4Weight(q.packed, q.scale, None, 32, q.k)

    weights = [quantize_int4(torch.randn(200, 300) * 0.05, 32), quantize_int4(torch.randn(96, 256) * 0.05, 128),
               q4_0(torch.randn(130, 96) * 0.05), q8_0(torch.randn(120, 160) * 0.05), quantize_int8(torch.randn(70, 64))]
    for w in weights:
        k = w.k if isinstance(w, Int4Weight) else w.q.shape[1]
        with int4_off_amx(ops):
            kern = make_kernel(w, dtype, torch.randn(w.scale.shape[0]).to(dtype))
        x = (torch.randn(150, k) * torch.logspace(-3, 2, k)).to(dtype)  # spread magnitudes, cancellation in the sums
        x[5] = torch.randn(k) * 1e-38  # float32 subnormals (bf16 keeps some): DAZ treats them as zero
        outs = {}
        for name in ("dpbf16", "fma"):
            before = ops.set_bf16_dot_kernel(name)
            try:  # register tiles up to 15 / 23 rows, float32 panels from 16 (Q8_0) / 24 (int4), past one 128-row chunk
                with int4_off_amx(ops):
                    outs[name] = [kern(x[:r]) for r in (1, 2, 3, 4, 5, 8, 9, 11, 16, 17, 23, 24, 25, 33, 64, 150)]
            finally:
                ops.set_bf16_dot_kernel(before)
        for a, b in zip(outs["dpbf16"], outs["fma"]):
            assert torch.equal(a, b), (w.describe() if hasattr(w, "describe") else type(w).__name__, a.shape[0])
            # and a row's bits never depend on the rows beside it, whatever tiles the row count picks
            assert torch.equal(a, outs["fma"][-1][: a.shape[0]]), (type(w).__name__, a.shape[0])


def test_quantized_kernels_take_float32_panels_from_their_row_threshold():
    """Where the FMA form runs, int4 weights from 24 rows and int8 with group scales (Q8_0) from 16 decode each pair of
    weight blocks once into a float32 panel (qmatmul.cpp over_panels) instead of decoding every block again for each
    8-row tile; per-channel int8, fp8 codes and the vdpbf16ps form never do. The kernel's name says so, and an unknown
    kind fails closed. (That the panels give the register tiles' bits at every row count is the test above.)"""
    from sieve.quant.formats import ChannelScaledWeight, quantize_int4, quantize_int8
    from sieve.quant.kernels import make_kernel

    ops = cpu_ops()
    if ops is None or ops.isa != "avx512-bf16":
        pytest.skip(f"a {ops.isa if ops else 'PyTorch-only'} build: the panels belong to the AVX512-BF16 build's FMA form")
    with pytest.raises(RuntimeError, match="int4, q8_0, int8 or fp8"):
        ops.quantized_panel_rows("q4_k")
    before = ops.bf16_dot_kernel()
    with int4_off_amx(ops):
        try:
            ops.set_bf16_dot_kernel("dpbf16")
            assert [ops.quantized_panel_rows(k) for k in ("int4", "q8_0", "int8", "fp8")] == [0, 0, 0, 0]
            if not ops.bf16_dot_fma_exact():
                pytest.skip("this CPU's vdpbf16ps rounds otherwise than its two-FMA definition: the FMA form stays unused")
            ops.set_bf16_dot_kernel("fma")
            assert [ops.quantized_panel_rows(k) for k in ("int4", "q8_0", "int8", "fp8")] == [24, 16, 0, 0]
            assert make_kernel(quantize_int4(torch.randn(32, 64), 32), torch.float32).name.endswith("(avx512-bf16 kernel), float32 panels from 24 rows")
            q8_0 = ChannelScaledWeight(torch.randint(-127, 128, (32, 64), dtype=torch.int8), torch.rand(32, 2).half() + 0.01)
            assert make_kernel(q8_0, torch.float32).name.endswith("(avx512-bf16 kernel), float32 panels from 16 rows")
            assert make_kernel(quantize_int8(torch.randn(32, 64)), torch.float32).name.endswith("(avx512-bf16 kernel)")
        finally:
            ops.set_bf16_dot_kernel(before)


def test_sieve_bf16_dot_forces_a_form_or_fails_closed():
    """SIEVE_BF16_DOT=dpbf16 (or fma) picks the form in a fresh process; any other value, or a build without
    AVX512-BF16 dot products, is a ValueError at load, never a silently ignored setting."""
    import json
    import os
    import subprocess
    import sys

    ops = cpu_ops()
    if ops is None:
        pytest.skip("no native kernels here")
    code = "import json; from sieve.kernels import cpu_ops; o = cpu_ops(); print(json.dumps(o.bf16_dot_kernel()))"

    def run(value: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "SIEVE_BF16_DOT": value}
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)

    bad = run("vnni")
    assert bad.returncode != 0 and "SIEVE_BF16_DOT=vnni: expected fma or dpbf16" in bad.stderr
    if ops.isa != "avx512-bf16":
        r = run("fma")
        assert r.returncode != 0 and "has no bf16 dot products" in r.stderr
        return
    for form in ("dpbf16", "fma"):
        r = run(form)
        assert r.returncode == 0, r.stderr[-2000:]
        assert json.loads(r.stdout.strip().splitlines()[-1]) == form


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between two bf16 tensors in units in the last place."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    ia = torch.where(ia < 0, -32768 - ia, ia)  # sign-magnitude -> ordered integers
    ib = torch.where(ib < 0, -32768 - ib, ib)
    return int((ia - ib).abs().max())


def test_fused_layer_ops_round_like_the_pytorch_path():
    import torch.nn.functional as F

    from sieve.layers.rotary import RotaryEmbedding

    ops = cpu_ops()
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 896, generator=g) * 3).bfloat16()
    r = (torch.randn(5, 896, generator=g) * 3).bfloat16()
    w = (1 + 0.1 * torch.randn(896, generator=g)).bfloat16()
    out, total = ops.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(total, x + r)
    assert _bf16_ulps(out, F.rms_norm(x + r, (896,), w, 1e-6)) <= 1  # only the float32 sum of squares is ordered differently
    out_only, same = ops.add_rms_norm(x, None, w, 1e-6)
    assert same.data_ptr() == x.data_ptr() and _bf16_ulps(out_only, F.rms_norm(x, (896,), w, 1e-6)) <= 1

    gate_up = (torch.randn(3, 2 * 160, generator=g) * 4).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    assert _bf16_ulps(ops.silu_mul(gate_up), F.silu(gate) * up) <= 1  # float32 exp differs by an ulp at most

    rope = RotaryEmbedding(64, 4096, 1e6, None)
    positions = torch.tensor([0, 7, 4095])
    qkv = (torch.randn(3, (6 + 2 * 2) * 64, generator=g)).bfloat16()
    qk = qkv[:, : 8 * 64].view(3, 8, 64)  # q and k heads of a fused projection, rows strided by q|k|v
    cos, sin = rope.cos[positions].bfloat16(), rope.sin[positions].bfloat16()
    want = qk * torch.cat((cos, cos), -1)[:, None] + qk.roll(32, dims=-1) * torch.cat((-sin, sin), -1)[:, None]
    v_before = qkv[:, 8 * 64 :].clone()
    ops.rotary_(qk, positions, rope.cos, rope.sin)
    assert torch.equal(qk, want)  # bit for bit
    assert torch.equal(qkv[:, 8 * 64 :], v_before)  # v untouched


def test_bf16_engine_agrees_with_and_without_native_kernels(checkpoints):
    """Every native kernel off (SIEVE_NO_NATIVE) against on, in bf16 where they are used: the same
    logprobs to within bf16 rounding, and the same greedy tokens while the top two are not near-tied."""
    import os

    from sieve import LLM
    from sieve.kernels import cpu_ops as ops_fn

    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 40, 17)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)

    def run(native: bool):
        os.environ.pop("SIEVE_NO_NATIVE", None) if native else os.environ.__setitem__("SIEVE_NO_NATIVE", "1")
        ops_fn.cache_clear()
        try:
            return LLM(str(checkpoints["qwen2"]), dtype="bfloat16", num_gpu_blocks_override=64).generate(prompts, params)
        finally:
            os.environ.pop("SIEVE_NO_NATIVE", None)
            ops_fn.cache_clear()

    with_native, without = run(True), run(False)
    assert ops_fn() is not None
    for a, b in zip(with_native, without):
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        token = b.outputs[0].token_ids[0]
        assert a.outputs[0].token_ids[0] == token
        assert first_a[token].logprob == pytest.approx(first_b[token].logprob, abs=0.1)


def test_bf16_prefill_chunks_through_the_decode_kernel_agree_with_sdpa(checkpoints):
    """In bf16 with AVX512-BF16 the layer loop sends prefill chunks through the paged decode kernel (a row per
    position) instead of SDPA. Qwen3's head size (32) takes that path: every prompt logprob, one chunk or chunks of
    16, agrees with the path without native kernels (SDPA) to within bf16 rounding, and so does the greedy answer."""
    import os

    from sieve import LLM
    from sieve.kernels import cpu_ops as ops_fn

    prompts = [{"prompt_token_ids": [(7 * i + 3) % 4000 + 5 for i in range(n)]} for n in (90, 37)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=0)

    def run(native: bool, **kw):
        os.environ.pop("SIEVE_NO_NATIVE", None) if native else os.environ.__setitem__("SIEVE_NO_NATIVE", "1")
        ops_fn.cache_clear()
        try:
            llm = LLM(str(checkpoints["qwen3"]), dtype="bfloat16", num_gpu_blocks_override=64, **kw)
            assert (llm.llm_engine.runner.model.native is not None) == native
            return llm.generate(prompts, params)
        finally:
            os.environ.pop("SIEVE_NO_NATIVE", None)
            ops_fn.cache_clear()

    reference = run(False)
    for got in (run(True), run(True, max_num_batched_tokens=16)):
        for a, b in zip(got, reference):
            pa = [d[t].logprob for d, t in zip(a.prompt_logprobs[1:], a.prompt_token_ids[1:])]
            pb = [d[t].logprob for d, t in zip(b.prompt_logprobs[1:], b.prompt_token_ids[1:])]
            assert max(abs(x - y) for x, y in zip(pa, pb)) < 0.1
            token = b.outputs[0].token_ids[0]
            assert a.outputs[0].token_ids[0] == token
            assert a.outputs[0].logprobs[0][token].logprob == pytest.approx(b.outputs[0].logprobs[0][token].logprob, abs=0.1)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_attention_reads_quantized_cache_codes(kind, dtype):
    """The native kernel reads fp8 / int8 codes in place (with the layer's or the token's scales) and
    agrees with the PyTorch path, which dequantizes through `read_kv`."""
    from sieve.layers.attention import QuantizedKVCacheLayer

    rng = random.Random(3)
    block_size, kv_heads, heads, head_dim = 16, 2, 14, 64
    lens = [1, 16, 17, 100, 300]
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    code_dtype = torch.float8_e4m3fn if kind == "fp8" else torch.int8
    k = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=code_dtype)
    v = torch.zeros_like(k)
    if kind == "fp8":
        cache = QuantizedKVCacheLayer(k, v, "fp8", torch.tensor(1.0), torch.tensor(1.0), calibrate=True)
    else:
        scales = torch.ones(2, num_blocks, block_size, kv_heads, dtype=torch.float16)
        cache = QuantizedKVCacheLayer(k, v, "int8", scales[0], scales[1])
    g = torch.Generator().manual_seed(1)
    slots = torch.arange(num_blocks * block_size)
    cache.write_kv(slots, torch.randn(len(slots), kv_heads, head_dim, generator=g) * 3,
                   torch.randn(len(slots), kv_heads, head_dim, generator=g))
    meta = decode_meta(lens, block_size, num_blocks, rng)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    got = cpu_ops().paged_decode_attention(q, k, v, meta.decode_block_tables, meta.decode_context_lens, head_dim**-0.5,
                                           cache.k_scale, cache.v_scale)
    ref = decode_attention_reference(q, cache, meta, head_dim**-0.5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


def fp8_codes_read_back() -> tuple[torch.Tensor, torch.Tensor]:
    """(what the native kernel gives, what PyTorch gives) for every finite e4m3 code under a scale of 2^-3: each code
    is the value row of a sequence of one token, whose attention output is that row exactly (one key: probability 1)."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # (0x7f, 0xff: NaN)
    head_dim = 64
    codes = torch.cat([codes, codes[: -len(codes) % head_dim]]) if len(codes) % head_dim else codes
    rows = codes.view(-1, 1, 1, head_dim)  # a block of one token per row of codes
    v = rows.view(torch.float8_e4m3fn).clone()
    k = torch.zeros_like(v)
    n = v.shape[0]
    q = torch.randn(n, 2, head_dim, generator=torch.Generator().manual_seed(0))
    scale = torch.tensor(0.125)
    got = cpu_ops().paged_decode_attention(q, k, v, torch.arange(n)[:, None], torch.ones(n, dtype=torch.int64),
                                           head_dim**-0.5, scale, scale, None)
    want = (v.float() * scale).view(n, 1, head_dim).expand(n, 2, head_dim)
    return got, want


def test_native_decode_attention_widens_every_fp8_code_exactly():
    """The vector loads widen e4m3 codes through their float16 bits (the value / 256) and apply the pool's scale once:
    every finite code, subnormals and signed zeros included, reads back as PyTorch's float8 conversion times the
    scale, bit for bit. (The AVX2 build: tests/test_isa.py.)"""
    got, want = fp8_codes_read_back()
    assert torch.equal(got, want)


@pytest.mark.parametrize("kv", [torch.float16, torch.bfloat16])
def test_native_decode_attention_reads_a_16bit_cache_under_float32_queries(kv):
    """A float16 / bfloat16 cache under float32 activations (`kv_cache_dtype`): the kernel widens each K/V element
    as it reads it and agrees with the PyTorch path, which widens the gathered blocks."""
    rng = random.Random(5)
    block_size, kv_heads, heads, head_dim = 16, 3, 9, 64
    lens = [1, 16, 17, 100, 300]
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    g = torch.Generator().manual_seed(2)
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(kv)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(kv)
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    meta = decode_meta(lens, block_size, num_blocks, rng)
    got = cpu_ops().paged_decode_attention(q, k, v, meta.decode_block_tables, meta.decode_context_lens, head_dim**-0.5)
    assert got.dtype == torch.float32
    ref = decode_attention_reference(q, KVCacheLayer(k, v), meta, head_dim**-0.5)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@contextlib.contextmanager
def int4_off_amx(ops):
    """int4 weights on the vdpbf16ps / FMA forms, for tests of those forms on a CPU whose int4 would take the tiles."""
    before = ops.set_int4_amx(False) if hasattr(ops, "set_int4_amx") else None
    try:
        yield
    finally:
        if before:
            ops.set_int4_amx(True)


def _amx_or_skip(ops):
    if ops is None or not hasattr(ops, "set_int4_amx"):
        pytest.skip(f"a {ops.isa if ops else 'PyTorch-only'} build: no AMX kernel")
    try:
        return ops.set_int4_amx(True)
    except RuntimeError:
        pytest.skip("this CPU has no AMX-BF16, or Linux does not grant the tile registers")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_on_amx_tiles_gives_the_bits_of_fmas_in_their_order_and_keeps_each_row_its_own(dtype):
    """int4 on AMX (qmatmul.cpp): a group of 32 inputs against 16 output rows is one bf16 tile product, and below
    `int4_amx_rows()` rows FMAs run in the order the SDM gives that product (two chains from zero, even and odd inputs,
    then their sum). Both give the same bits at every row count: with and without mins, groups of 32 to 256, padded
    rows and inputs, subnormal inputs, past one tile of 16 rows. So a row's bits are the same alone as among any number
    of others under the default split, and every output is within float32 rounding of the other forms'."""
    from sieve.quant.formats import Int4Weight, quantize_int4
    from sieve.quant.kernels import make_kernel

    ops = cpu_ops()
    before = _amx_or_skip(ops)
    rows_before = ops.int4_amx_rows()
    assert rows_before == 2  # the default split (measured: qmatmul.cpp, use_int4_amx)
    try:
        torch.manual_seed(5)
        q = quantize_int4(torch.randn(130, 96) * 0.05, 32)
        weights = [quantize_int4(torch.randn(200, 300) * 0.05, 32), quantize_int4(torch.randn(96, 256) * 0.05, 128),
                   quantize_int4(torch.randn(64, 192) * 0.05, 64), quantize_int4(torch.randn(48, 512) * 0.05, 256),
                   quantize_int4(torch.randn(40, 64) * 0.05, 64),  # one group: the pipeline's shortest (qmatmul.cpp)
                   Int4Weight(q.packed, q.scale, None, 32, q.k)]
        for w in weights:
            bias = torch.randn(w.scale.shape[0]).to(dtype)
            x = (torch.randn(150, w.k) * torch.logspace(-3, 2, w.k)[torch.randperm(w.k)]).to(dtype)
            x[5] = torch.randn(w.k) * 1e-38  # subnormals: taken as zero, as tdpbf16ps takes them
            x[6, ::3] = 0
            ops.set_int4_amx(True)
            kern = make_kernel(w, dtype, bias)
            assert kern.name.endswith("(avx512-bf16 kernel), AMX tiles from 2 rows"), kern.name
            rows = (1, 2, 3, 4, 5, 7, 9, 15, 16, 17, 31, 33, 64, 150)
            ops.set_int4_amx_rows(1)  # tiles at every row count
            tiles = [kern(x[:r]) for r in rows]
            ops.set_int4_amx_rows(4096)  # FMAs in the tiles' order at every row count
            fmas = [kern(x[:r]) for r in rows]
            ops.set_int4_amx_rows(rows_before)
            split = [kern(x[:r]) for r in rows] + [kern(x[r:r + 1]) for r in range(8)]
            for r, a, b in zip(rows, tiles, fmas):
                assert torch.equal(a, b), (w.describe(), r, (a.float() - b.float()).abs().max().item())
                assert torch.equal(a, tiles[-1][:r]), (w.describe(), r)
            for r, a in enumerate(split[len(rows):]):
                assert torch.equal(a, tiles[-1][r:r + 1]), (w.describe(), r)
            ops.set_int4_amx(False)
            other = kern(x)
            scale = other.float().abs().amax(dim=1, keepdim=True) + 1e-30
            err = ((tiles[-1].float() - other.float()).abs() / scale).max().item()
            assert err < (5e-5 if dtype == torch.float32 else 8e-3), (w.describe(), err)
            assert not torch.equal(tiles[-1], other)  # another order of summation: not the same bits everywhere
            assert not torch.equal(tiles[-1], torch.zeros_like(tiles[-1]))
        with pytest.raises(RuntimeError, match="1 to 4096"):
            ops.set_int4_amx_rows(0)
    finally:
        ops.set_int4_amx_rows(rows_before)
        ops.set_int4_amx(before)


def test_speculation_on_amx_int4_gives_the_plain_tokens(checkpoints, tmp_path):
    """With int4 on AMX tiles, a GGUF Q4_1 model's decode rows (one a step) and verification rows (5 a step, among 9
    requests) are computed alike: greedy tokens with ngram speculation equal those without it, token for token."""
    from sieve import LLM
    from sieve.bench.gguf_export import export_gguf
    from test_spec import grounded_workload

    ops = cpu_ops()
    before = _amx_or_skip(ops)
    try:
        path = export_gguf(checkpoints["llama"], tmp_path / "m.gguf", "q4_1", log=lambda s: None)
        prompts, params = grounded_workload(9)
        plain = LLM(str(path), device="cpu", dtype="float32", num_gpu_blocks_override=256)
        names = {m.kernel_name() for m in plain.llm_engine.runner.model.modules() if hasattr(m, "kernel_name")}
        assert any("AMX" in n for n in names), names
        reference = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
        spec = LLM(str(path), device="cpu", dtype="float32", num_gpu_blocks_override=256,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 4})
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == reference
        assert spec.llm_engine.speculator.stats.num_accepted_tokens > 0
    finally:
        ops.set_int4_amx(before)


def test_sieve_int4_amx_picks_the_form_in_a_fresh_process_or_fails_closed():
    """int4 takes the tiles wherever the CPU and Linux give them (unset or 1), and SIEVE_INT4_AMX=0 keeps the other
    forms for the whole process; any other value is a ValueError at load, and so is 1 where there are no tiles."""
    import os
    import subprocess
    import sys

    ops = cpu_ops()
    if ops is None:
        pytest.skip("no native kernels here")

    def run(value: str) -> subprocess.CompletedProcess:
        code = "from sieve.kernels import cpu_ops; print(cpu_ops().int4_amx() if hasattr(cpu_ops(), 'int4_amx') else False)"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "SIEVE_INT4_AMX": value})

    out = run("yes")
    assert out.returncode != 0 and "SIEVE_INT4_AMX=yes: expected 0 or 1" in out.stderr
    assert run("0").stdout.strip() == "False"
    try:
        ops.set_int4_amx(ops.set_int4_amx(True))  # raises where the tiles cannot be had; else put back as it was
        has_amx = True
    except (RuntimeError, AttributeError):
        has_amx = False
    out = run("1")
    if has_amx:
        assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr
    else:
        assert out.returncode != 0 and "no AMX-BF16 tiles it may use" in out.stderr
    unset = subprocess.run([sys.executable, "-c", "from sieve.kernels import cpu_ops; print(getattr(cpu_ops(), 'int4_amx', bool)())"],
                           capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "SIEVE_INT4_AMX"})
    assert unset.returncode == 0 and unset.stdout.strip() == str(has_amx), unset.stderr


def test_float32_norm_rotary_and_silu_run_the_native_loops_kernels_and_keep_gradients():
    """Under float32 on CPU, RMSNorm (with and without the residual add), the rotation and silu(gate) * up call the
    kernels the C++ layer loop runs (layer_ops.cpp), whose bits differ from PyTorch's ops in the last place; a tensor
    that requires grad takes PyTorch's ops instead, whose gradients the kernels would not record."""
    from sieve.layers.activation import silu_and_mul
    from sieve.layers.norm import RMSNorm
    from sieve.layers.rotary import RotaryEmbedding, apply_rotary

    ops = cpu_ops()
    if ops is None:
        pytest.skip("no native kernels here")
    torch.manual_seed(7)
    norm = RMSNorm(96, 1e-6, torch.float32)
    norm.weight.data = torch.randn(96)
    x, res = torch.randn(20, 96), torch.randn(20, 96)
    out, total = norm(x, res)
    want, want_total = ops.add_rms_norm(x, res, norm.weight, 1e-6)
    assert torch.equal(out, want) and torch.equal(total, want_total) and torch.equal(total, x + res)
    assert torch.equal(norm(x), ops.add_rms_norm(x, None, norm.weight, 1e-6)[0])
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x + res, (96,), norm.weight, 1e-6), rtol=1e-6, atol=1e-6)

    rope = RotaryEmbedding(16, 64, 10000.0, None)
    step = rope(torch.arange(3, 23), torch.float32)
    assert step.cos is None  # prepared for the native kernel
    q = torch.randn(20, 6, 16)
    mine = apply_rotary(q.clone(), step)
    kernel = q.clone()
    ops.rotary_(kernel, step.positions, step.cos_table, step.sin_table)
    assert torch.equal(mine, kernel)
    gate_up = torch.randn(20, 64)
    assert torch.equal(silu_and_mul(gate_up), ops.silu_mul(gate_up))

    xg = x.clone().requires_grad_()
    norm(xg).square().sum().backward()
    xr = x.clone().requires_grad_()
    torch.nn.functional.rms_norm(xr, (96,), norm.weight, 1e-6).square().sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad)
    qg = q.clone().requires_grad_()
    rotated = apply_rotary(qg, step)
    torch.testing.assert_close(rotated, mine, rtol=1e-6, atol=1e-6)
    rotated.square().sum().backward()
    torch.testing.assert_close(qg.grad, 2 * q, rtol=1e-5, atol=1e-5)  # a rotation keeps norms: d|Rq|^2/dq = 2q
    gu = gate_up.clone().requires_grad_()
    silu_and_mul(gu).sum().backward()
    assert gu.grad is not None and gu.grad.abs().sum() > 0
