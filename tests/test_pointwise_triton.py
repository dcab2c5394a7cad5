"""The CUDA layer's fused pointwise kernels (sieve/layers/pointwise_triton.py): residual add + RMSNorm, SiLU x mul, and
rotary with the K/V cache write, against PyTorch's ops, and each row's result the same bits alone and in a batch (what a padded CUDA-graph bucket
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


def check_rotary_write(device: str) -> None:
    """Rotary and the K/V write in one launch against `rotate_half_form` then `write_kv`: SmolLM2's heads (9 over 3, 64
    dims) and a smaller shape, each dtype, a bf16 cache under float32, rows at scattered positions and slots."""
    from sieve.layers import pointwise_triton
    from sieve.layers.attention import KVCacheLayer
    from sieve.layers.rotary import RopeStep, RotaryEmbedding, rotate_half_form

    g = torch.Generator().manual_seed(1)
    cases = [(dt, dt, 9, 3, 64) for dt in (torch.float32, torch.bfloat16, torch.float16)]
    cases += [(torch.float32, torch.bfloat16, 4, 2, 32)]
    for dtype, cache_dtype, H, KVH, D in cases:
        T, bs, blocks = 6, 16, 8
        rotary = RotaryEmbedding(D, 512, 10000.0, None).to(device)
        qkv = (torch.randn(T, (H + 2 * KVH) * D, generator=g) * 2).to(device, dtype)
        positions = torch.randint(0, 512, (T,), generator=g).to(device)
        slots = torch.randperm(blocks * bs, generator=g)[:T].to(device)
        caches = [torch.zeros(blocks, bs, KVH, D, dtype=cache_dtype, device=device) for _ in range(4)]
        rope = RopeStep(positions, rotary.cos, rotary.sin)
        qk = rotate_half_form(qkv[:, : (H + KVH) * D].view(T, -1, D), *rope.gathered(dtype))
        KVCacheLayer(caches[0], caches[1]).write_kv(slots, qk[:, H:], qkv[:, (H + KVH) * D:].view(T, KVH, D))
        assert pointwise_triton.supports_rotary_write(qkv, caches[2], caches[3])
        q = pointwise_triton.rotary_write_kv(qkv, positions, rotary.cos, rotary.sin, caches[2], caches[3], slots, H, KVH)
        pairs = [(q, qk[:, :H]), (caches[2], caches[0]), (caches[3], caches[1])]
        for got, want in pairs:
            if device == "cuda" or torch.bfloat16 not in (dtype, cache_dtype):
                assert torch.equal(got, want), (dtype, cache_dtype, H)
            else:  # Triton's interpreter rounds float32 to bfloat16 toward zero, a GPU to nearest: each of the three
                # roundings a step of the operands' scale at most
                scale = 3 * torch.finfo(torch.bfloat16).eps * qkv.abs().max().float()
                assert (got.float() - want.float()).abs().max() <= scale, (dtype, cache_dtype, H)


def check_fused_decoder(path: str) -> None:
    """A float32 model on the CPU (the PyTorch layer loop) under the interpreter: its decode rows take the fused rotary
    and K/V write (counted), and generate the tokens the unfused path does."""
    import os

    from sieve import LLM, SamplingParams
    from sieve.layers import pointwise_triton

    calls = []
    fused = pointwise_triton.rotary_write_kv
    pointwise_triton.rotary_write_kv = lambda *a, **k: (calls.append(1), fused(*a, **k))[1]
    llm = LLM(path, dtype="float32", device="cpu", num_gpu_blocks_override=64)
    prompts = [{"prompt_token_ids": [5 + i, 17, 33, 90 + i] * (i + 1)} for i in range(3)]
    runs = []
    for on in ("1", "0"):
        os.environ["SIEVE_FUSED_POINTWISE"] = on
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, logprobs=2))
        runs.append([(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                     for o in outs])
        # every greedy choice by a margin far past the paths' last-bit differences (on every CPU)
        margins = [abs(a - b) for o in outs for lp in o.outputs[0].logprobs for a, b in [[v.logprob for v in lp.values()]]]
        assert min(margins) > 1e-3, min(margins)
        if on == "1":
            assert calls, "the decode rows did not take the fused rotary and K/V write"
            calls.clear()
    assert not calls
    # the same tokens; logprobs within float32's last bits: the CPU's unfused rotary is its native kernel, which
    # contracts a multiply and an add into an FMA (on CUDA the unfused path is PyTorch's, the fused kernel's bits)
    for (tokens, lps), (want_tokens, want_lps) in zip(*runs):
        assert tokens == want_tokens and max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-5


def check_all(device: str) -> None:
    check_pointwise(device)
    check_rotary_write(device)


@needs_triton
def test_fused_pointwise_kernels_under_the_interpreter():
    run_interpreted("test_pointwise_triton", "check_all")


@needs_triton
def test_a_model_decodes_through_the_fused_rotary_write_under_the_interpreter(llama_dir):
    run_interpreted("test_pointwise_triton", "check_fused_decoder", str(llama_dir))


def test_the_cpu_keeps_its_native_kernels(monkeypatch):
    """Off CUDA without the interpreter (or with SIEVE_FUSED_POINTWISE=0) nothing here is taken."""
    from sieve.layers import pointwise_triton

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not pointwise_triton.supports(torch.zeros(2, 8))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SIEVE_FUSED_POINTWISE", "0")
    assert not pointwise_triton.supports(torch.zeros(2, 8))
