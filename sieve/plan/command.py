"""`sieve plan`: print (or emit as JSON, or plot) the roofline plan for a model on a device."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from sieve.plan.devices import Device, device_from_spec, get_device
from sieve.plan.roofline import Plan, Workload, decode_point, disaggregation, ladder, plan
from sieve.plan.shape import KV_FORMATS, WEIGHT_FORMATS, ModelShape, shape_from_config


def add_plan_args(p) -> None:
    p.add_argument("--model", required=True, help="checkpoint folder, config.json path, or hub id")
    p.add_argument("--device", default="h100", help="device name from the built-in table, or 'cpu' (measured now)")
    p.add_argument("--device-spec", default=None, help='custom device: JSON file or inline {"memory_gb":..,"bandwidth_gbps":..,"tflops":{"bf16":..}}')
    p.add_argument("--weights", default="bf16", choices=WEIGHT_FORMATS)
    p.add_argument("--kv", default="bf16", choices=KV_FORMATS)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--output-tokens", type=int, default=512)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--spec-tokens", type=int, default=0)
    p.add_argument("--acceptance", type=float, default=0.7)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over N devices of one node (their link bandwidth from the device table)")
    p.add_argument("--pd-link-gbps", type=float, default=None,
                   help="prefill/decode disaggregation over a link of this many GB/s: KV transfer time against the prefill stall it removes")
    p.add_argument("--ladder", action="store_true", help="users per device, one technique at a time")
    p.add_argument("--compare", default=None, help="a second model to put side by side")
    p.add_argument("--plot", default=None, help="write the roofline with the workload's points to this PNG")
    p.add_argument("--json", action="store_true")


def load_shape(model: str) -> ModelShape:
    from sieve.models.gguf import is_gguf

    path = Path(model)
    if path.is_file() and not is_gguf(path):
        name = path.parent.name if path.name == "config.json" else path.stem
        return shape_from_config(json.loads(path.read_text()), name)
    from sieve.models.loader import read_config, resolve_model_path

    folder = resolve_model_path(model)
    return shape_from_config(read_config(folder), folder.stem if folder.is_file() else folder.name)


def run_plan(args) -> int:
    if not 0 <= args.acceptance <= 1:
        raise SystemExit("error: --acceptance must be in [0, 1]")
    dev: Device = device_from_spec(args.device_spec) if args.device_spec else get_device(args.device)
    if args.tensor_parallel_size < 1:
        raise SystemExit("error: --tensor-parallel-size must be >= 1")
    w = Workload(args.weights, args.kv, args.context, args.output_tokens, args.slo_tpot_ms, args.slo_ttft_ms,
                 args.spec_tokens, args.acceptance, tensor_parallel=args.tensor_parallel_size)
    if w.tensor_parallel > 1 and dev.link_gbps <= 0:
        raise SystemExit(f"error: {dev.name} has no device-to-device link in the table (give link_gbps in --device-spec)")
    models = [load_shape(args.model)] + ([load_shape(args.compare)] if args.compare else [])
    plans = [plan(m, dev, w) for m in models]
    ladders = [ladder(m, dev, w, args.spec_tokens or 4, args.acceptance) for m in models] if args.ladder else None
    if args.json:
        out = asdict(plans[0])
        out["device_spec"] = asdict(dev)
        if ladders:
            out["ladder"] = [asdict(r) for r in ladders[0]]
        if args.pd_link_gbps:
            out["disaggregation"] = asdict(disaggregation(models[0], dev, w, args.pd_link_gbps))
        if args.compare:
            out["compare"] = asdict(plans[1])
        print(json.dumps(out, indent=2))
    else:
        print_plans(plans, dev, w)
        if args.pd_link_gbps:
            d = disaggregation(models[0], dev, w, args.pd_link_gbps)
            print(f"prefill/decode disaggregation over {d.link_gbps:g} GB/s: KV of one {w.context}-token prompt {_gb(d.kv_bytes)}, "
                  f"transfer {d.transfer_ms:,.1f} ms against {d.prefill_ms:,.1f} ms of prefill it takes off the decode device "
                  f"(ratio {d.transfer_per_prefill:.2f}: " + ("P/D pays" if d.transfer_per_prefill < 0.5 else
                                                          "the transfer costs about as much TTFT as it saves" if d.transfer_per_prefill < 2 else
                                                          "the link is too slow for P/D") + ")")
        if ladders:
            for m, rungs in zip(models, ladders):
                print_ladder(m, dev, w, rungs)
    if args.plot:
        plot_roofline(models[0], dev, w, plans[0], args.plot)
    return 0


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB"


def print_plans(plans: list[Plan], dev: Device, w: Workload) -> None:
    print(f"device {dev.name}: {dev.memory_gb:g} GB, {dev.bandwidth_gbps:,.0f} GB/s, "
          + ", ".join(f"{k} {v:,.1f} TFLOP/s" for k, v in dev.tflops.items()) + (f"  [{dev.source}]" if dev.source else ""))
    print(f"workload: {w.weights} weights, {w.kv} KV, context {w.context}, {w.output_tokens} output tokens, "
          f"SLO TPOT {w.slo_tpot_ms:g} ms / TTFT {w.slo_ttft_ms:g} ms" + (f", speculation k={w.spec_tokens} a={w.acceptance:g}" if w.spec_tokens else "")
          + (f", tensor parallel over {w.tensor_parallel} devices ({dev.link_gbps:g} GB/s links): figures per group"
             if w.tensor_parallel > 1 else ""))
    rows = [
        ("parameters (total / active)", lambda p: f"{p.total_params / 1e9:,.2f}B / {p.active_params / 1e9:,.2f}B"),
        ("weight bytes", lambda p: _gb(p.weight_bytes)),
        ("KV bytes per token", lambda p: f"{p.kv_bytes_per_token / 1024:,.1f} KiB"),
        ("KV bytes per sequence", lambda p: f"{p.kv_bytes_per_sequence / 2**20:,.1f} MiB"),
        ("ridge point", lambda p: f"{p.ridge_flop_per_byte:,.0f} FLOP/byte"),
        ("decode intensity, batch 1", lambda p: f"{p.decode_intensity_b1:,.2f} FLOP/byte"),
        ("decode intensity, at users", lambda p: f"{p.decode_intensity_at_users:,.1f} FLOP/byte"),
        ("prefill intensity", lambda p: f"{p.prefill_intensity:,.0f} FLOP/byte"),
        ("decode step floor, batch 1", lambda p: f"{p.decode_step_ms:,.2f} ms ({p.decode_bound_b1}-bound) = {p.tokens_per_s_b1:,.1f} tok/s"),
        ("prefill (TTFT) floor", lambda p: f"{p.prefill_ms:,.0f} ms" + ("" if p.meets_ttft_slo else "  (misses the TTFT SLO)")),
        ("sequences that fit in KV memory", lambda p: f"{p.sequences_that_fit:,}"),
        ("largest batch within TPOT SLO", lambda p: f"{p.max_batch_within_slo:,}"),
        ("users per device" if w.tensor_parallel == 1 else f"users per {w.tensor_parallel}-device group",
         lambda p: f"{p.users_per_device:,}  (bound: {p.binding})"),
        ("tokens/s per user / total there", lambda p: f"{p.tokens_per_s_total_at_users / max(p.max_batch_within_slo, 1):,.1f} / {p.tokens_per_s_total_at_users:,.0f}"),
    ]
    names = [p.model for p in plans]
    width = max(len(r[0]) for r in rows) + 2
    if len(plans) > 1:
        print(" " * width + "".join(f"{n:<42}" for n in names))
    for label, fmt in rows:
        print(f"{label:<{width}}" + "".join(f"{fmt(p):<42}" for p in plans))


def print_ladder(m: ModelShape, dev: Device, w: Workload, rungs) -> None:
    print(f"\nusers per {dev.name} for {m.name} at TPOT <= {w.slo_tpot_ms:g} ms, context {w.context} + {w.output_tokens}:")
    print(f"  {'rung':<48}{'users':>8}{'x naive':>10}{'TPOT ms':>10}  bound")
    for r in rungs:
        print(f"  {r.name:<48}{r.users:>8,}{r.factor:>10.1f}{r.tpot_ms:>10.2f}  {r.binding}")


def plot_roofline(m: ModelShape, dev: Device, w: Workload, p: Plan, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from sieve.plan.roofline import compute_dtype

    peak = dev.flops(compute_dtype(dev, w.weights))
    bw = dev.bandwidth_gbps * 1e9
    x = np.logspace(-1, 4, 200)
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.loglog(x, np.minimum(peak, bw * x) / 1e12, "k-", lw=2, label=f"{dev.name} roofline ({dev.bandwidth_gbps:,.0f} GB/s, {peak / 1e12:,.0f} TFLOP/s)")
    ax.axvline(p.ridge_flop_per_byte, color="gray", ls=":", label=f"ridge {p.ridge_flop_per_byte:,.0f} FLOP/byte")
    batches = sorted({1, 8, 32, max(p.max_batch_within_slo, 1)})
    for b in batches:
        pt = decode_point(m, dev, w, b)
        ai = pt.flops_per_step / pt.bytes_per_step
        ax.plot(ai, min(peak, bw * ai) / 1e12, "o", ms=8, label=f"decode, batch {b}: {pt.step_ms:.1f} ms/step")
    ax.plot(p.prefill_intensity, min(peak, bw * p.prefill_intensity) / 1e12, "s", ms=9, label=f"prefill of {w.context} tokens")
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_title(f"{m.name} on {dev.name}: {w.weights} weights, {w.kv} KV, context {w.context}")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
