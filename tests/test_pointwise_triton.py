"""The CUDA layer's fused pointwise kernels (sieve/layers/pointwise_triton.py): residual add + RMSNorm and SiLU x mul
against PyTorch's ops, and each row's result the same bits alone and in a batch (what a padded CUDA-graph bucket
needs). On this CPU under Triton's interpreter, in a subprocess (Triton reads TRITON_INTERPRET when the kernel is
defined); tests/test_cuda.py runs the same checks compiled."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from test_attention_triton import needs_triton, run_interpreted


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference in units of the dtype's last place at the reference's magnitude."""
    eps = torch.finfo(want.dtype).eps
    return ((got.float() - want.float()).abs() / (want.float().abs().clamp_min(1e-3) * eps)).max().item()


def check_pointwise(device: str) -> None:
    from sieve.layers import pointwise_triton

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for T, H in ((1, 64), (5, 576), (17, 2048), (3, 100)):  # 576: SmolLM2's width; 100: not a power of two
            x = (torch.randn(T, H, generator=g) * 3).to(device, dtype)
            r = torch.randn(T, H, generator=g).to(device, dtype)
            w = (1 + 0.1 * torch.randn(H, generator=g)).to(device, dtype)
            assert pointwise_triton.supports(x)
            out, total = pointwise_triton.add_rms_norm(x, r, w, 1e-5)
            if device == "cuda" or dtype != torch.bfloat16:
                assert torch.equal(total, x + r)
            else:  # Triton's interpreter rounds float32 to bfloat16 toward zero, a GPU to nearest
                assert _ulps(total, x + r) <= 2
            want = F.rms_norm(x + r, (H,), w, 1e-5)
            # float32: the sum of squares in another order (a few last places over 2,048 terms), exp's last bits;
            # 16-bit: a rounding step or two (the interpreter rounds bfloat16 otherwise than a GPU does)
            bound = 8 if dtype == torch.float32 else 3
            assert out.dtype == dtype and _ulps(out, want) <= bound, (dtype, T, H, _ulps(out, want))
            alone = pointwise_triton.add_rms_norm(x, None, w, 1e-5)
            assert _ulps(alone, F.rms_norm(x, (H,), w, 1e-5)) <= bound
            for i in range(T):  # a row alone: the same bits
                assert torch.equal(pointwise_triton.add_rms_norm(x[i:i + 1], r[i:i + 1], w, 1e-5)[0][0], out[i])
            gu = (torch.randn(T, 2 * H, generator=g) * 4).to(device, dtype)
            act = pointwise_triton.silu_and_mul(gu)
            gate, up = gu.chunk(2, dim=-1)
            assert act.shape == (T, H) and _ulps(act, F.silu(gate) * up) <= bound
            for i in range(T):
                assert torch.equal(pointwise_triton.silu_and_mul(gu[i:i + 1])[0], act[i])
    wide = torch.randn(2, 2 * 2560, generator=g).to(device)  # more than one column block
    torch.testing.assert_close(pointwise_triton.silu_and_mul(wide), F.silu(wide[:, :2560]) * wide[:, 2560:])


@needs_triton
def test_fused_pointwise_kernels_under_the_interpreter():
    run_interpreted("test_pointwise_triton", "check_pointwise")


def test_the_cpu_keeps_its_native_kernels(monkeypatch):
    """Off CUDA without the interpreter (or with SIEVE_FUSED_POINTWISE=0) nothing here is taken."""
    from sieve.layers import pointwise_triton

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not pointwise_triton.supports(torch.zeros(2, 8))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SIEVE_FUSED_POINTWISE", "0")
    assert not pointwise_triton.supports(torch.zeros(2, 8))
