"""The CUDA decode attention (sieve/layers/attention_triton.py): equal to the PyTorch reference, and each row's output
the same bits whatever else is in the batch (alone, next to longer rows, as one of a sequence's drafted rows).

On this CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: Triton reads the variable
when the kernel is defined); tests/test_cuda.py runs the same checks compiled, on a GPU. Also: a model off the CPU
never asks for the CPU kernels (a minute's build on a fresh GPU machine)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _case(device, dtype, cache_dtype, H, KVH, D, bs, lens, windows=None, seed=0):
    from sieve.layers import attention_triton
    from sieve.layers.attention import AttentionMetadata, KVCacheLayer, decode_attention_reference

    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-L // bs) for L in lens) + 3
    k = torch.randn(nb, bs, KVH, D, generator=g).to(device, cache_dtype)
    v = torch.randn(nb, bs, KVH, D, generator=g).to(device, cache_dtype)
    perm = torch.randperm(nb, generator=g).tolist()
    tables, at = [], 0
    for i, L in enumerate(lens):
        if i and L == lens[i - 1] + 1 and -(-L // bs) <= len(tables[-1]):  # a drafted row of the sequence before
            tables.append(tables[-1])
            continue
        n = -(-L // bs)
        tables.append(perm[at: at + n])
        at += n
    width = max(len(t) for t in tables) + 2  # padded wider than any row needs
    tab = torch.tensor([t + [perm[-1]] * (width - len(t)) for t in tables], dtype=torch.int64, device=device)
    ctx = torch.tensor(lens, dtype=torch.int64, device=device)
    first = None if windows is None else torch.tensor(windows, dtype=torch.int64, device=device)
    q = torch.randn(len(lens), H, D, generator=g).to(device, dtype)
    assert attention_triton.supports(q, k, v, quantized=False)
    got = attention_triton.paged_decode_attention(q, k, v, tab, ctx, D**-0.5, first)
    assert got.dtype == dtype and got.shape == q.shape
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64, device=device), len(lens), tab, ctx, [], first)
    ref = decode_attention_reference(q.float(), KVCacheLayer(k.float(), v.float()), meta, D**-0.5)
    tol = 1e-5 if dtype == torch.float32 and cache_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)
    for r in range(len(lens)):  # alone, its table cut to what it needs: the same bits
        need = -(-lens[r] // bs)
        alone = attention_triton.paged_decode_attention(q[r: r + 1], k, v, tab[r: r + 1, :need], ctx[r: r + 1], D**-0.5,
                                                         None if first is None else first[r: r + 1])
        assert torch.equal(alone[0], got[r]), r
    return got


def check_paged_decode(device: str) -> None:
    """Every case on `device`: SmolLM2's head shape (9 heads over 3 KV heads, 64 dims) in float32 and bfloat16, a
    bf16 cache under float32 queries, one head per KV head, sliding-window rows, and a sequence's drafted rows
    (lengths L .. L + 3 over one table) next to a long row."""
    lens = [1, 17, 50, 16, 33, 34, 35, 36, 200]
    _case(device, torch.float32, torch.float32, 9, 3, 64, 16, lens)
    _case(device, torch.bfloat16, torch.bfloat16, 9, 3, 64, 16, lens, seed=1)
    _case(device, torch.float32, torch.bfloat16, 9, 3, 64, 16, lens, seed=2)
    _case(device, torch.float16, torch.float16, 4, 4, 32, 8, [5, 9, 64, 3], seed=3)
    _case(device, torch.float32, torch.float32, 6, 2, 32, 16, [40, 41, 20, 90], windows=[7, 8, 0, 15], seed=4)


def run_interpreted(module: str, check: str, arg: str = "cpu") -> None:
    """`module.check(arg)` (a module of tests/) in a subprocess under Triton's interpreter, which must pass."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    code = f"from {module} import {check}; {check}({arg!r}); print('ok')"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-4000:]


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (the Makefile installs it)")


@needs_triton
def test_triton_decode_attention_under_the_interpreter():
    run_interpreted("test_attention_triton", "check_paged_decode")


def test_a_cpu_query_without_the_interpreter_is_not_taken(monkeypatch):
    from sieve.layers import attention_triton

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k = torch.zeros(1, 2, 8), torch.zeros(4, 16, 2, 8)
    assert not attention_triton.supports(q, k, k, quantized=False)
    odd = torch.zeros(4, 12, 2, 8)  # a block size that is not a power of two
    assert not attention_triton.supports(q.cuda() if torch.cuda.is_available() else q, odd, odd, quantized=False)
    assert not attention_triton.supports(q, k, k, quantized=True)


def test_a_model_off_the_cpu_does_not_build_the_cpu_kernels(monkeypatch):
    """Loading on a GPU asked for the CPU kernels (a minute's build on a fresh machine, then unused): the greedy
    heads and the C++ layer loop now look at the device first. The meta device stands in for a GPU here."""
    from types import SimpleNamespace

    from sieve.layers import greedy_head
    from sieve.models import decoder

    def no_build():
        raise AssertionError("cpu_ops() asked for a model that is not on the CPU")

    monkeypatch.setattr(greedy_head, "cpu_ops", no_build)
    monkeypatch.setattr(decoder, "cpu_ops", no_build)
    w = torch.empty(64, 32, dtype=torch.bfloat16, device="meta")
    head = SimpleNamespace(weight=w, native=None, qkernel=object(), bias=None, dtype=torch.float32)
    assert not greedy_head.GreedyHead.supported(head, None)
    assert not greedy_head.GreedyHeadQ8.supported(head, None)
    layer = SimpleNamespace(input_layernorm=SimpleNamespace(weight=torch.empty(32, device="meta")))
    assert decoder.DecoderModel._build_native(SimpleNamespace(arch=None, layers=[layer])) is None
