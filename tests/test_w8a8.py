"""W8A8: int8 weights per channel against int8 activations per token (sieve/quant/w8a8.py): the arithmetic against
hand figures and a float reference of the same integers, and the engine against transformers with the same
quantization applied (fake-quantized weights and per-token activations) on a trained checkpoint."""

from __future__ import annotations

import pytest
import torch

from sieve.quant.formats import ChannelScaledWeight, concat_rows, narrow_cols, narrow_rows, quantize, same_layout
from sieve.quant.kernels import make_kernel
from sieve.quant.w8a8 import W8A8Kernel, int8_matmul, quantize_tokens


def test_tokens_quantize_per_row_symmetrically_rounding_half_to_even():
    x = torch.tensor([[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0], [127.0, 0.5, 1.5, -2.5]])
    q, s = quantize_tokens(x)
    # row 0: 127 / 2 = 63.5 per unit: 63.5 -> 64 (half to even), -127, 31.75 -> 32; row 1: all zero, scale 0;
    # row 2: one unit per step: 0.5 -> 0, 1.5 -> 2, -2.5 -> -2
    assert q.tolist() == [[64, -127, 32, 0], [0, 0, 0, 0], [127, 0, 2, -2]]
    assert s.tolist() == pytest.approx([2 / 127, 0.0, 1.0])
    assert q.dtype == torch.int8 and s.dtype == torch.float32


@pytest.mark.parametrize("rows", [1, 3, 17, 64])
@pytest.mark.parametrize("n, k", [(48, 160), (40, 161)])  # whole blocks and quads, and a short last block and quad
def test_the_kernel_is_the_integer_arithmetic_exactly(rows, n, k):
    """The int32 sums equal int64 ones (exact), and the output is (float(sum) x token scale) x channel scale + bias,
    bit for bit, in float32 and bfloat16, whichever kernel this CPU build runs (AVX512-VNNI's where it has it: it
    must); a row's result does not depend on the rows beside it."""
    from sieve.kernels import cpu_ops

    g = torch.Generator().manual_seed(rows + k)
    w = quantize(torch.randn(n, k, generator=g), "w8a8")
    bias = torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4
    x[0, : k // 2] = 0.0  # a row's zeros, and (rows 1 on) a zero row's scale of 0
    if rows > 1:
        x[1] = 0.0
    q, s = quantize_tokens(x)
    acc = int8_matmul(q, w.q)
    assert acc.dtype == torch.int32 and torch.equal(acc.long(), q.long() @ w.q.long().t())
    kernel = make_kernel(w, torch.float32, bias)
    assert isinstance(kernel, W8A8Kernel) and "w8a8" in kernel.name
    ops = cpu_ops()
    assert (kernel.native is not None) == bool(ops is not None and ops.w8a8_native())
    assert torch.equal(kernel.codes().q, w.q) and torch.equal(kernel.codes().scale, w.scale)
    want = acc.float() * s[:, None] * w.scale[None, :] + bias
    assert torch.equal(kernel(x), want)
    assert torch.equal(make_kernel(w, torch.bfloat16, bias)(x.bfloat16()), (acc_of(x.bfloat16(), w) + bias).bfloat16())
    assert torch.equal(kernel(x)[-1:], kernel(x[-1:]))


@pytest.mark.parametrize("rows", [1, 8, 16, 17, 40])
@pytest.mark.parametrize("n, k", [(48, 192), (40, 256)])  # whole tile steps of 64 inputs; a short last block
def test_amx_tiles_give_the_same_bits_as_vpdpbusd(rows, n, k):
    """Where the CPU has AMX-INT8 tiles and Linux grants them, W8A8 calls from w8a8_amx_rows() rows multiply on them
    (the load log's kernel name says so): the same outputs, bit for bit, as vpdpbusd and as the integer arithmetic,
    from any row count (the threshold set to 1 here), float32 and bfloat16. Elsewhere asking for the tiles fails
    with a message, and the kernel name does not claim them."""
    from sieve.kernels import cpu_ops

    g = torch.Generator().manual_seed(rows * k)
    w = quantize(torch.randn(n, k, generator=g), "w8a8")
    bias = torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g) * 3
    ops = cpu_ops()
    if ops is None or not ops.w8a8_native():
        assert W8A8Kernel(w, torch.float32, bias).native is None
        return
    if not ops.w8a8_amx():
        assert "AMX" not in ops.w8a8_kernel()
        with pytest.raises(RuntimeError, match="AMX"):
            ops.set_w8a8_amx(True)
        return
    assert "AMX-INT8" in make_kernel(w, torch.float32, bias).name
    before = ops.set_w8a8_amx_rows(1)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            kernel, xd = make_kernel(w, dtype, bias), x.to(dtype)
            tiles = kernel(xd)
            ops.set_w8a8_amx(False)
            try:
                assert torch.equal(tiles, kernel(xd))
            finally:
                ops.set_w8a8_amx(True)
            assert torch.equal(tiles, (acc_of(xd, w) + bias).to(dtype))
    finally:
        ops.set_w8a8_amx_rows(before)


def acc_of(x: torch.Tensor, w: ChannelScaledWeight) -> torch.Tensor:
    q, s = quantize_tokens(x)
    return int8_matmul(q, w.q).float() * s[:, None] * w.scale[None, :]


def test_the_format_keeps_its_activations_through_stacks_and_slices():
    a, b = quantize(torch.randn(16, 64), "w8a8"), quantize(torch.randn(8, 64), "w8a8")
    assert a.acts == "int8" and a.describe() == "w8a8 (int8 per channel, int8 activations per token)"
    assert same_layout([a, b]) and not same_layout([a, quantize(torch.randn(8, 64), "int8")])
    stacked = concat_rows([a, b])
    assert stacked.acts == "int8" and stacked.q.shape == (24, 64)
    assert narrow_rows(stacked, 16, 8).acts == "int8" and narrow_cols(stacked, 0, 32).acts == "int8"
    assert a.to("cpu").acts == "int8"
    with pytest.raises(ValueError, match="per output channel"):
        W8A8Kernel(ChannelScaledWeight(a.q, torch.ones(16, 2, dtype=torch.float16), "int8"), torch.float32)


def test_the_engine_matches_transformers_with_the_same_quantization(stories_dir):
    """stories260K (trained), float32, teacher-forced on a story: sieve's `--quantization w8a8` logits against
    transformers' with every decoder linear's weight replaced by its int8 round trip and its input by its per-token
    int8 round trip (the same arithmetic in float).

    Rounding codes is chaotic: a float difference of one part in 10^6 (integer sums against float ones) flips a
    code at a boundary, the flip moves the K/V of every later position, and those flip more. So the two agree to
    float rounding at the first position and, over the story, as closely as transformers' W8A8 agrees with itself
    when its inputs are nudged by 2^-22: measured 3.6e-4 against 3.3e-4 (KL), where W8A8 itself costs 1.3e-3."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sieve import LLM
    from sieve.layers.linear import Linear

    text = (stories_dir.parents[1] / "data" / "tinystories_valid_sample.txt").read_text()[:2000]
    ids = AutoTokenizer.from_pretrained(stories_dir)(text).input_ids[:200]
    llm = LLM(str(stories_dir), dtype="float32", device="cpu", quantization="w8a8", num_gpu_blocks_override=64)
    layers = llm.llm_engine.runner.model.layers
    assert all("w8a8" in m.kernel_name() for m in layers.modules() if isinstance(m, Linear))
    ours = llm.llm_engine.score(ids)

    def reference(nudge: float) -> torch.Tensor:
        hf = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            for layer in hf.model.layers:
                for lin in [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]:
                    lin.weight.copy_(quantize(lin.weight, "w8a8").dequantize())
                    lin.register_forward_pre_hook(lambda m, args: (fake_quant(args[0] * (1 + nudge)),))
            return hf(torch.tensor([ids])).logits[0]

    def kl(p: torch.Tensor, q: torch.Tensor) -> float:  # KL(p || q), mean over positions
        return F.kl_div(F.log_softmax(q, -1), F.log_softmax(p, -1), log_target=True, reduction="none").sum(-1).mean().item()

    ref, nudged = reference(0.0), reference(2**-22)
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()(torch.tensor([ids])).logits[0]
    assert (ours[0] - ref[0]).abs().max() < 1e-4
    assert kl(ours, ref) < 2 * kl(nudged, ref) and kl(ours, ref) < 0.5 * kl(ref, plain)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.97


def fake_quant(x: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    q, s = quantize_tokens(x.reshape(-1, shape[-1]))
    return (q.float() * s[:, None]).reshape(shape)
