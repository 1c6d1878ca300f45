"""PNG plots (matplotlib, headless Agg backend, imported only when a plot is written). Without
matplotlib a plot is skipped with a warning: the numbers are already saved by then."""
from __future__ import annotations

import sys
from typing import Any

from common.tools.bench.stats import describe


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        print("warning: matplotlib is not installed, no PNG written (pip install matplotlib)", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_png(path: str, ttft_s: list[float], tpot_ms: list[float], title: str) -> None:
    """Histograms of TTFT and TPOT with their mean, p50, p95 and p99 marked."""
    plt = _pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, values, name, unit in ((axes[0], ttft_s, "TTFT", "s"), (axes[1], tpot_ms, "TPOT", "ms")):
        _hist(ax, values, f"{name} ({unit})")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def accept_histogram_png(path: str, hist: list[int], title: str) -> None:
    """Verify steps by number of accepted drafts (the summed accept histogram)."""
    plt = _pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.bar(range(len(hist)), hist, color="tab:blue")
    ax.set_xlabel("drafts accepted in a verify step (k)")
    ax.set_ylabel("verify steps")
    ax.set_xticks(range(len(hist)))
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _hist(ax: Any, values: list[float], label: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel(label)
    ax.set_ylabel("requests")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if not values:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    ax.hist(values, bins=min(30, max(5, len(values) // 2)), color="tab:blue", alpha=0.75)
    d = describe(values)
    for key, style in (("mean", "-"), ("p50", "--"), ("p95", "-."), ("p99", ":")):
        ax.axvline(d[key], color="black", linestyle=style, linewidth=1, label=f"{key} {d[key]:.3g}")
    ax.legend(fontsize=8)
