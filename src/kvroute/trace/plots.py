"""Plots of a trace's reuse (``kvroute predict --trace``): matplotlib, files only."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvroute.plotting import pyplot
from kvroute.trace.reuse import CURVE_CAPACITIES, POLICIES, TraceReuse, _fmt_tokens

_COLORS = {"random": "tab:red", "prefix-affine": "tab:blue", "pooled": "tab:green"}
_LABELS = {
    "random": "random balancing (a Service)",
    "prefix-affine": "prefix-affine routing",
    "pooled": "one pooled cache of W·X",
}


def _name(reuse: TraceReuse) -> str:
    return Path(reuse.summary["path"]).name


def plot_lru_curve(reuse: TraceReuse):
    """LRU hit ratio against one cache's capacity in tokens (the paper's Figure 9)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.4))
    grid = np.logspace(4, 8, 161)
    ax.plot(grid, reuse.single.token_hit(grid), "-", color="tab:blue", lw=2, label="LRU, tokens hit")
    ax.plot(grid, reuse.single.full_block_hit(grid), "--", color="tab:purple", lw=1,
            label="LRU, full 512-token blocks hit")
    best = reuse.infinite["token_hit_ratio"]
    ax.axhline(best, color="gray", ls=":", label=f"infinite cache: {best:.1%} of tokens")
    x = reuse.capacity_tokens
    y = float(reuse.single.token_hit(x))
    ax.plot([x], [y], "o", color="black")
    ax.annotate(f"{_fmt_tokens(x)} tokens: {y:.1%}\n= {reuse.fraction_of_max(x):.0%} of max",
                (x, y), textcoords="offset points", xytext=(-95, 18), fontsize=9,
                arrowprops={"arrowstyle": "-", "color": "black"})
    ax.set_xscale("log")
    ax.set_xlim(grid[0], grid[-1])
    ax.set_ylim(0, max(0.05, best * 1.25))
    ax.set_xlabel("cache capacity (tokens)")
    ax.set_ylabel("prefix-cache hit ratio")
    ax.set_title(f"{_name(reuse)}: one LRU cache ({reuse.summary['requests']:,} requests)")
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:.0%}"))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def plot_fleet(reuse: TraceReuse):
    """Per fleet size: hit ratio against each worker's capacity X, the three policies."""
    plt = pyplot()
    n = len(reuse.fleets)
    cols = min(n, 2)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.6 * cols, 4.4 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    grid = CURVE_CAPACITIES
    best = reuse.infinite["token_hit_ratio"]
    x = reuse.capacity_tokens
    for ax, f in zip(axes.flat, reuse.fleets):
        for policy in POLICIES:
            y = float(f.curves[policy].token_hit(x))
            label = _LABELS[policy].replace("W·X", f"{f.workers}·X") + f": {y:.1%}"
            ax.plot(grid, f.curves[policy].token_hit(grid), "-", color=_COLORS[policy], lw=2, label=label)
            ax.plot([x], [y], "o", color=_COLORS[policy])
        ax.plot(grid, reuse.single.token_hit(grid), ":", color="gray", label="one worker alone (all traffic)")
        ax.axhline(best, color="gray", ls="--", lw=0.8, label=f"infinite cache: {best:.1%}")
        ax.axvline(x, color="black", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlim(grid[0], grid[-1])
        ax.set_ylim(0, max(0.05, best * 1.25))
        ax.set_xlabel("KV capacity per worker X (tokens)")
        ax.set_ylabel("token hit ratio")
        ax.set_title(f"{_name(reuse)}: {f.workers} workers; hit ratios at X = {_fmt_tokens(x)}")
        ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:.0%}"))
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def write_plots(reuse: TraceReuse, out: Path) -> list[Path]:
    """``lru_hit_vs_capacity.png`` and ``fleet_hit_vs_capacity.png`` in ``out``."""
    plt = pyplot()
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, make in (("lru_hit_vs_capacity.png", plot_lru_curve), ("fleet_hit_vs_capacity.png", plot_fleet)):
        fig = make(reuse)
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
