"""The built-in device table for `sieve plan`: memory, bandwidth and dense FLOP/s per dtype.

Figures are vendors' published dense (not 2:4 sparse) peaks; sources beside each entry. `cpu` is
not in the table: it is measured on the spot (`measure_cpu`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Device:
    name: str
    memory_gb: float  # 1e9 bytes
    bandwidth_gbps: float  # 1e9 bytes/s
    tflops: dict[str, float] = field(default_factory=dict)  # dense TFLOP/s by compute dtype: bf16, fp16, fp8, int8
    source: str = ""
    # Between devices of one node (tensor parallelism): bandwidth per device per direction, and the fixed cost of one
    # all-reduce of a small message (NCCL's is ~10 us over NVLink; an estimate, not a datasheet figure). 0: no link.
    link_gbps: float = 0.0
    link_latency_us: float = 10.0

    def flops(self, dtype: str) -> float:
        """Dense FLOP/s for `dtype`, falling back to 16-bit where the device has no faster path."""
        t = self.tflops.get(dtype) or self.tflops.get("bf16") or self.tflops.get("fp16")
        return t * 1e12

    def has(self, dtype: str) -> bool:
        return dtype in self.tflops


DEVICES = {
    d.name: d
    for d in [
        # NVIDIA A100 datasheet (2021): 40 GB HBM2 1,555 GB/s; 80 GB HBM2e 2,039 GB/s (SXM); BF16/FP16 312 TF, INT8 624 TOPS dense.
        # Links: NVLink 3 600 GB/s (300 each way) on A100 SXM; NVLink 4 900 (450) on H100/H200 SXM; NVLink 5 1,800 (900) on
        # B200; PCIe Gen5 x16 64 GB/s each way (H100 PCIe), Gen4 32 (L4, L40S); MI300X Infinity Fabric 7 x 64 GB/s each way.
        Device("a100-40gb", 40, 1555, {"bf16": 312, "fp16": 312, "int8": 624}, "NVIDIA A100 datasheet", 300),
        Device("a100-80gb", 80, 2039, {"bf16": 312, "fp16": 312, "int8": 624}, "NVIDIA A100 datasheet (SXM)", 300),
        # NVIDIA H100 datasheet: SXM 80 GB HBM3 3.35 TB/s, BF16 989.4 TF, FP8/INT8 1,978.9 dense;
        # PCIe 80 GB HBM2e 2.0 TB/s, BF16 756 TF, FP8 1,513 dense.
        Device("h100-sxm", 80, 3350, {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "int8": 1978.9}, "NVIDIA H100 datasheet (SXM)", 450),
        Device("h100-pcie", 80, 2000, {"bf16": 756, "fp16": 756, "fp8": 1513, "int8": 1513}, "NVIDIA H100 datasheet (PCIe)", 64),
        # NVIDIA H200 datasheet: 141 GB HBM3e 4.8 TB/s; same Hopper compute as H100 SXM.
        Device("h200", 141, 4800, {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "int8": 1978.9}, "NVIDIA H200 datasheet", 450),
        # NVIDIA DGX B200 datasheet: 1,440 GB and 64 TB/s for 8 GPUs (180 GB, 8 TB/s each); FP8 72 PF and
        # FP16/BF16 36 PF per 8 GPUs with sparsity, so 4.5 and 2.25 PF dense per GPU.
        Device("b200", 180, 8000, {"bf16": 2250, "fp16": 2250, "fp8": 4500, "int8": 4500}, "NVIDIA DGX B200 datasheet", 900),
        # NVIDIA L4 datasheet: 24 GB GDDR6 300 GB/s; BF16 242 TF and FP8 485 TF with sparsity (121 / 242.5 dense).
        Device("l4", 24, 300, {"bf16": 121, "fp16": 121, "fp8": 242.5, "int8": 242.5}, "NVIDIA L4 datasheet", 32),
        # NVIDIA L40S datasheet: 48 GB GDDR6 864 GB/s; BF16 362 TF, FP8 733 TF dense.
        Device("l40s", 48, 864, {"bf16": 362.05, "fp16": 362.05, "fp8": 733, "int8": 733}, "NVIDIA L40S datasheet", 32),
        # AMD Instinct MI300X datasheet: 192 GB HBM3 5.3 TB/s; BF16 1,307.4 TF, FP8 2,614.9 TF dense.
        Device("mi300x", 192, 5300, {"bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9, "int8": 2614.9}, "AMD MI300X datasheet", 448),
        # Apple M3 Max (16-core CPU / 40-core GPU): up to 128 GB unified memory at 400 GB/s (Apple, 2023);
        # Apple publishes no FLOP/s: ~14.2 TF FP32 GPU is the common estimate, FP16 runs at the same rate.
        Device("m3-max", 128, 400, {"bf16": 14.2, "fp16": 14.2}, "Apple M3 Max press release; FLOP/s estimated"),
    ]
}
ALIASES = {"a100": "a100-80gb", "h100": "h100-sxm"}


def get_device(name: str) -> Device:
    if name == "cpu":
        return measure_cpu()
    key = ALIASES.get(name, name)
    if key not in DEVICES:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(sorted([*DEVICES, *ALIASES, 'cpu']))} (or --device-spec)")
    return DEVICES[key]


def device_from_spec(spec: str) -> Device:
    """A custom device: a JSON file path or inline JSON with memory_gb, bandwidth_gbps, tflops {dtype: TF}."""
    text = open(spec).read() if not spec.lstrip().startswith("{") else spec
    d = json.loads(text)
    try:
        return Device(d.get("name", "custom"), float(d["memory_gb"]), float(d["bandwidth_gbps"]),
                      {k: float(v) for k, v in d["tflops"].items()}, d.get("source", "--device-spec"),
                      float(d.get("link_gbps", 0.0)), float(d.get("link_latency_us", 10.0)))
    except KeyError as e:
        raise ValueError(f"--device-spec needs memory_gb, bandwidth_gbps and tflops; missing {e}") from e


def measure_cpu() -> Device:
    """This machine, measured now: memory from /proc/meminfo, bandwidth (best of STREAM copy and
    triad, as `sieve bench bandwidth` reports) and bf16/fp32 matmul FLOP/s."""
    import time

    import torch

    from sieve.bench.bandwidth import measure_bandwidth

    bw = measure_bandwidth("cpu")
    mem = 0.0
    try:
        mem = next(int(line.split()[1]) * 1024 / 1e9 for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        pass

    def matmul_tflops(dtype, n: int, seconds: float) -> float:
        a = torch.randn(n, n, dtype=dtype)
        b = torch.randn(n, n, dtype=dtype)
        a @ b
        k, t = 0, time.perf_counter()
        while k < 3 or time.perf_counter() - t < seconds:
            a @ b
            k += 1
        return k * 2 * n**3 / (time.perf_counter() - t) / 1e12

    # 1024-square products for at least 0.3 s. A CPU without native bf16 arithmetic multiplies bf16 about 100x
    # slower than float32 (1 GFLOP/s on an AVX2 host: 7 s for three products), so three 256-square products
    # tell first whether the big ones are worth timing.
    tflops = {"fp32": matmul_tflops(torch.float32, 1024, 0.3)}
    bf16_native = matmul_tflops(torch.bfloat16, 256, 0.0)
    if bf16_native > tflops["fp32"] / 4:
        bf16_native = matmul_tflops(torch.bfloat16, 1024, 0.3)
    # without native bf16 arithmetic (AVX2 only) PyTorch's bf16 product is far slower than float32, and sieve's
    # kernels compute a bf16 model's products in float32 there: the faster of the two is what a bf16 model gets
    tflops["bf16"] = max(bf16_native, tflops["fp32"])
    tflops["fp16"] = tflops["bf16"]
    return Device("cpu", mem, bw.best_gbps, tflops, f"measured now: {bw.threads} threads, copy {bw.copy_gbps:.1f} / triad "
                  f"{bw.triad_gbps:.1f} GB/s; PyTorch bf16 matmul {bf16_native * 1e3:.1f} GFLOP/s")
