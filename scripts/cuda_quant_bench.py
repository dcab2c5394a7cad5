"""CUDA: a linear at 1 and 32 rows (4864x896 and 8192x8192), bf16 weights against each quantized format:
the kernel sieve picks, and the dequantize-per-call path it replaces. GPU time per call: 20 calls
captured in a CUDA graph and replayed (no Python or launch cost), median of 7 timings; also the
plain per-call time from Python (launches included). Run on a CUDA machine: python3 scripts/cuda_quant_bench.py"""
import json
import statistics

import torch
import torch.nn.functional as F

from sieve.quant.formats import ChannelScaledWeight, quantize_fp8, quantize_int4, quantize_int8
from sieve.quant.kernels import DequantKernel, make_kernel


def q8_0(w):
    n, k = w.shape
    s = (w.view(n, k // 32, 32).abs().amax(-1) / 127).half()
    return ChannelScaledWeight(torch.round(w.view(n, k // 32, 32) / s.float()[..., None]).clamp(-127, 127).to(torch.int8).view(n, k), s)


def time_it(f, x, reps=200):
    for _ in range(20): f(x)
    torch.cuda.synchronize()
    ts = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps): f(x)
        b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) / reps * 1e3)
    return statistics.median(ts)


def graph_time(f, x, calls=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): f(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls): f(x)
    ts = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) / calls * 1e3)
    return statistics.median(ts)


def main() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    res = {}
    for n, k in ((4864, 896), (8192, 8192)):
        w = torch.randn(n, k) * 0.02
        wb = w.to(dev, torch.bfloat16)
        fmts = [(name, q.to(dev)) for name, q in (("int8", quantize_int8(w)), ("q8_0", q8_0(w)), ("int4 g128", quantize_int4(w, 128)),
                                                  ("int4 g32", quantize_int4(w, 32)), ("fp8", quantize_fp8(w)))]
        for rows in (1, 32):
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            for name, f, nbytes in [("bf16", lambda x: F.linear(x, wb), n * k * 2)] + \
                    [(f"{nm} [{make_kernel(q, torch.bfloat16).name}]", make_kernel(q, torch.bfloat16), q.nbytes) for nm, q in fmts] + \
                    [(f"{nm} [dequantize per call]", DequantKernel(q, torch.bfloat16), q.nbytes) for nm, q in fmts]:
                gpu = graph_time(f, x)
                res[f"{n}x{k} rows={rows} {name}"] = {"gpu_us": gpu, "per_call_us": time_it(f, x), "GB/s": nbytes / gpu / 1e3}
    for key, v in res.items():
        print(f"{v['gpu_us']:9.1f} us GPU ({v['GB/s']:7.0f} GB/s of weights) {v['per_call_us']:8.1f} us per Python call  {key}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
