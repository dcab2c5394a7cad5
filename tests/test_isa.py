"""The kernels built for AVX2 + FMA + F16C (SIEVE_CPU_ISA=avx2, what a CPU without AVX-512 runs), on this
machine: each weight format against the PyTorch reference at every batch size, and the engine's output
with and without the forced instruction set. Each check runs in a child process, so that the variable
is set before PyTorch's own kernels start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from sieve.kernels import cpu_isa


def run_with_isa(isa: str, code: str, **extra: str) -> dict:
    """Run `code` (which prints one JSON line last) in a child process built for `isa`."""
    env = {**os.environ, "SIEVE_CPU_ISA": isa, **extra}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=900,
                       cwd=os.path.dirname(__file__))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def avx2():
    """Skips where the CPU lacks AVX2 + FMA + F16C (not on any machine this project runs on)."""
    saved = os.environ.pop("SIEVE_CPU_ISA", None)
    os.environ["SIEVE_CPU_ISA"] = "avx2"
    try:
        cpu_isa()
    except ValueError as e:
        pytest.skip(f"this CPU cannot run the AVX2 build: {e}")
    finally:
        os.environ.pop("SIEVE_CPU_ISA", None)
        if saved is not None:
            os.environ["SIEVE_CPU_ISA"] = saved


def test_avx2_kernels_match_the_pytorch_reference_at_every_batch_size(avx2):
    out = run_with_isa("avx2", """
        import json, torch
        import torch.nn.functional as F
        from sieve.kernels import cpu_ops
        from sieve.quant.formats import ChannelScaledWeight, Int4Weight, quantize_fp8, quantize_int4, quantize_int8
        from sieve.quant.kernels import BlockedKernel, make_kernel

        ops = cpu_ops()
        torch.manual_seed(0)

        def q8_0(w):
            n, k = w.shape
            s = (w.view(n, k // 32, 32).abs().amax(-1) / 127).half()
            q = torch.round(w.view(n, k // 32, 32) / s.float()[..., None]).clamp(-127, 127).to(torch.int8).view(n, k)
            return ChannelScaledWeight(q, s)

        def q4_0(w):
            q = quantize_int4(w, 32)
            return Int4Weight(q.packed, q.scale, None, 32, q.k)

        formats = {  # odd sizes pad rows to 16 and inputs to the format's unit
            "int8": (quantize_int8, [(256, 256), (200, 131)]),
            "fp8": (quantize_fp8, [(256, 256), (200, 131)]),
            "q8_0": (q8_0, [(256, 256), (200, 96)]),
            "int4 g32": (lambda w: quantize_int4(w, 32), [(256, 256), (200, 200)]),
            "int4 g128": (lambda w: quantize_int4(w, 128), [(256, 256), (200, 300)]),
            "q4_0": (q4_0, [(256, 256), (200, 96)]),
        }
        worst, names = {}, set()
        for name, (quant, shapes) in formats.items():
            for n, k in shapes:
                qw = quant(torch.randn(n, k) * 0.05)
                ref_w = qw.dequantize()
                for dtype in (torch.float32, torch.bfloat16):
                    bias = torch.randn(n).to(dtype)
                    kern = make_kernel(qw, dtype, bias)
                    assert isinstance(kern, BlockedKernel)
                    names.add(kern.name)
                    for rows in (1, 2, 3, 4, 5, 7, 8, 16, 33, 100, 2048):
                        x = torch.randn(rows, k).to(dtype)
                        got = kern(x)
                        assert got.dtype == dtype and got.shape == (rows, n)
                        if rows > 1:  # one row decodes on the fly, more rows from a panel: the same sums, bit for bit
                            assert torch.equal(kern(x[1:2]), got[1:2]), f"{name} {dtype}: row 1 alone differs from row 1 of {rows}"
                        want = F.linear(x.float(), ref_w, bias.float())
                        key = f"{name} {str(dtype)[6:]}"
                        err = ((got.float() - want).abs().max() / want.abs().max()).item()
                        worst[key] = max(worst.get(key, 0.0), err)
        x = torch.randn(3, 131).bfloat16()  # the bf16 GEMV, 1-4 rows, an odd input size
        w = torch.randn(200, 131).bfloat16()
        for rows in (1, 2, 3):
            got = ops.gemv_bf16(x[:rows], w, None).float()
            want = F.linear(x[:rows].float(), w.float())
            worst["bf16 gemv"] = max(worst.get("bf16 gemv", 0.0), ((got - want).abs().max() / want.abs().max()).item())
        for n, k in ((256, 256), (200, 131), (37, 576)):  # plain bf16 weights at every batch: GEMV, then float32 panels
            w, bias = (torch.randn(n, k) * 0.05).bfloat16(), torch.randn(n).bfloat16()
            lin = ops.NativeLinear(ops.LINEAR_BF16, w, None, None, None, False, 0, n, k, bias)
            for rows in (1, 4, 5, 7, 8, 16, 33, 100, 2048):
                x = torch.randn(rows, k).bfloat16()
                got = lin(x)
                assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
                want = F.linear(x.float(), w.float(), bias.float())
                worst["bf16 linear"] = max(worst.get("bf16 linear", 0.0), ((got.float() - want).abs().max() / want.abs().max()).item())
        print(json.dumps({"isa": ops.isa, "worst": worst, "names": sorted(names)}))
    """)
    assert out["isa"] == "avx2"
    assert all("(avx2 kernel)" in n for n in out["names"])
    for key, err in out["worst"].items():
        # float32: exact weights times float32 inputs, sums in another order; bf16: the output's rounding
        assert err <= (1e-5 if "float32" in key else 1e-2), f"{key}: relative error {err}"


def test_avx2_attention_widens_every_fp8_code_exactly(avx2):
    """The AVX2 build's fp8 loads (float16 bits, one conversion): every finite e4m3 code reads back as PyTorch's
    conversion times the pool's scale, bit for bit (tests/test_kernels.py holds the check)."""
    out = run_with_isa("avx2", """
        import json, torch
        from sieve.kernels import cpu_ops
        from test_kernels import fp8_codes_read_back
        got, want = fp8_codes_read_back()
        print(json.dumps({"isa": cpu_ops().isa, "equal": torch.equal(got, want), "max": (got - want).abs().max().item()}))
    """)
    assert out["isa"] == "avx2" and out["equal"], out


def test_avx2_w8a8_kernel_is_the_integer_arithmetic_exactly(avx2):
    """The AVX2 build multiplies W8A8 itself (vpmaddubsw with the sign trick, no int8 dot-product instruction): the
    same bits as torch._int_mm's exact sums and the two scalings, at every row count and on short blocks and quads
    (tests/test_w8a8.py holds the check), and the load log names that kernel."""
    out = run_with_isa("avx2", """
        import json, torch
        from sieve.kernels import cpu_ops
        from sieve.quant.formats import quantize
        from sieve.quant.kernels import make_kernel
        from test_w8a8 import test_the_kernel_is_the_integer_arithmetic_exactly as check
        for rows in (1, 3, 5, 17, 64):
            for n, k in ((48, 160), (40, 161), (8, 4)):
                check(rows, n, k)
        name = make_kernel(quantize(torch.randn(32, 64), "w8a8"), torch.float32, None).name
        print(json.dumps({"isa": cpu_ops().isa, "native": cpu_ops().w8a8_native(), "name": name}))
    """)
    assert out["isa"] == "avx2" and out["native"] and "AVX2 vpmaddubsw" in out["name"], out


def test_engine_output_with_and_without_the_forced_isa(avx2, checkpoints, tmp_path):
    """float32 where the arithmetic is PyTorch's (a Hugging Face checkpoint, a GGUF file dequantized):
    the same tokens and logprobs. The native quantized kernels differ by design (AVX512-BF16 rounds their
    inputs to bf16, AVX2 multiplies float32 inputs), so there: the same first token and logprobs within
    the tolerance the kernel tests use. On a CPU whose own build is AVX2, the other side is the PyTorch path."""
    from sieve.bench.gguf_export import export_gguf

    gguf = export_gguf(checkpoints["qwen2"], tmp_path / "q.gguf", "q8_0", log=lambda s: None)
    code = f"""
        import json
        from sieve import LLM, SamplingParams
        from sieve.kernels import cpu_ops
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
        prompts = [{{"prompt_token_ids": [5, 99, 1234, 7, 300]}}, {{"prompt_token_ids": list(range(40, 75))}}]
        res = {{}}
        for label, model, kw in (("hf", {str(checkpoints["llama"])!r}, {{}}), ("dequantized", {str(gguf)!r}, {{"dequantize": True}}),
                                 ("native q8_0", {str(gguf)!r}, {{}})):
            outs = LLM(model, dtype="float32", num_gpu_blocks_override=64, **kw).generate(prompts, params)
            res[label] = [[o.outputs[0].token_ids, [{{str(k): v.logprob for k, v in d.items()}} for d in o.outputs[0].logprobs]] for o in outs]
        print(json.dumps({{"isa": cpu_ops().isa if cpu_ops() else "pytorch", "res": res}}))
    """
    # the other side: this CPU's own build, or where that is AVX2 already (a CPU without AVX-512, as CI's),
    # the PyTorch path that SIEVE_NO_NATIVE=1 selects
    other = {"SIEVE_NO_NATIVE": "1"} if cpu_isa() == "avx2" else {}
    forced, native = run_with_isa("avx2", code), run_with_isa("", code, **other)
    assert forced["isa"] == "avx2" and native["isa"] != "avx2"
    for label in ("hf", "dequantized"):
        for (t1, lp1), (t2, lp2) in zip(forced["res"][label], native["res"][label]):
            assert t1 == t2, label
            for a, b in zip(lp1, lp2):
                for tok in a.keys() & b.keys():
                    assert a[tok] == pytest.approx(b[tok], abs=1e-4), label
    for (t1, lp1), (t2, lp2) in zip(forced["res"]["native q8_0"], native["res"]["native q8_0"]):
        assert t1[0] == t2[0]
        first = str(t1[0])
        assert lp1[0][first] == pytest.approx(lp2[0][first], abs=0.05)
