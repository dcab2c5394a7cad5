"""Plots of serving sweeps: latency percentiles and goodput against load, one line per engine."""

from __future__ import annotations

import math


def plot_sweeps(results: dict[str, dict], path: str, title: str, slo_ttft_s: float | None = None,
                slo_tpot_s: float | None = None) -> None:
    """`results` maps an engine label to a `sweep` result. Four panels: TTFT, TPOT, output tokens/s,
    goodput; the x axis is the load that was swept (users at once, or requests per second)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (ax_ttft, ax_tpot), (ax_thr, ax_good) = axes
    xlabel = "requests per second (Poisson arrivals)"
    for (label, res), color in zip(results.items(), ["tab:blue", "tab:orange", "tab:green", "tab:red"]):
        runs = res["runs"]
        key = "concurrency" if "concurrency" in runs[0] else "request_rate"
        if key == "concurrency":
            xlabel = "concurrent users (each sends its next request when the last one finishes)"
        xs = [r[key] if math.isfinite(r[key]) else 2 * max(v for v in (q[key] for q in runs) if math.isfinite(v)) for r in runs]
        for ax, metric in ((ax_ttft, "ttft_s"), (ax_tpot, "tpot_s")):
            ax.plot(xs, [r[metric]["p50"] * 1e3 for r in runs], "o-", color=color, label=f"{label} p50")
            ax.plot(xs, [r[metric]["p99"] * 1e3 for r in runs], "s--", color=color, alpha=0.7, label=f"{label} p99")
        ax_thr.plot(xs, [r["output_token_throughput"] for r in runs], "o-", color=color, label=label)
        ax_good.plot(xs, [r["goodput"] for r in runs], "o-", color=color, label=label)
    for ax, slo in ((ax_ttft, slo_ttft_s), (ax_tpot, slo_tpot_s)):
        if slo is not None:
            ax.axhline(slo * 1e3, color="grey", linestyle=":", label=f"SLO {slo * 1e3:g} ms")
    ax_ttft.set(title="Time to first token", ylabel="ms (log scale)", yscale="log")
    ax_tpot.set(title="Time per output token after the first", ylabel="ms")
    ax_thr.set(title="Output throughput", ylabel="output tokens / s")
    slo_text = " and ".join(f"{n} ≤ {v * 1e3:g} ms" for n, v in (("TTFT", slo_ttft_s), ("TPOT", slo_tpot_s)) if v is not None)
    ax_good.set(title=f"Goodput ({slo_text or 'no SLO given'})", ylabel="requests / s meeting the SLO")
    for ax in axes.flat:
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
