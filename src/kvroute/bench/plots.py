"""A bench run's plots (matplotlib, Agg): ``hit_rate_vs_k.png``, ``ttft_cdf.png`` and
``ttft_vs_concurrency.png``; for an open-loop replay (a trace), ``hit_rate_over_time.png`` and
``worker_load_over_time.png`` instead of the plots against K and concurrency."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvroute.bench.samples import PointSamples, Timelines
from kvroute.errors import UserError
from kvroute.plotting import pyplot
from kvroute.records import Point, RequestRecord


def _report_concurrency(points: list[Point], preferred: int = 8) -> int:
    levels = sorted({p.concurrency for p in points})
    return preferred if preferred in levels else levels[len(levels) // 2]


#: One colour per topology in every plot: the Service (and the simulator's random balancing,
#: which models it) orange, the router (and its kv-aware policy) blue.
TOPOLOGY_COLORS = {
    "service": "tab:orange", "random": "tab:orange",
    "router": "tab:blue", "kv-aware": "tab:blue",
    "prefix-hash": "tab:green", "round-robin": "tab:purple", "least-loaded": "tab:brown",
}
_SPARE_COLORS = ("tab:red", "tab:pink", "tab:olive", "tab:gray", "tab:cyan")


def _colors(topologies: list[str]) -> dict[str, str]:
    """Each topology's colour: the fixed one when known, else a spare one, never repeated."""
    out: dict[str, str] = {}
    spare = iter(_SPARE_COLORS * (1 + len(topologies)))
    for name in topologies:
        out[name] = TOPOLOGY_COLORS.get(name) or next(spare)
    return out


def _topology_order(name: str) -> tuple[bool, str]:
    """Sort key of topology names: the Service (or random) first, then the rest by name."""
    return TOPOLOGY_COLORS.get(name, "~") != "tab:orange", name


def _topologies(points: list[Point]) -> list[str]:
    """Topology names in a stable order: the Service (or random) first, then the rest."""
    return sorted({p.policy for p in points}, key=_topology_order)


def _load_label(c: int) -> str:
    return f"concurrency {c}" if c else "open loop"


def _grid(plt, rows: int, cols: int, width: float = 3.4, height: float = 2.7, **kw):
    fig, axes = plt.subplots(rows, cols, figsize=(0.6 + width * cols, 0.9 + height * rows),
                             squeeze=False, **kw)
    return fig, axes


#: Inches a legend entry of the 8-point font takes: its line handle and gap, and per character.
_LEGEND_HANDLE_IN, _LEGEND_CHAR_IN = 0.45, 0.068


def _title_and_legend(fig, title: str, handles, labels, ncol: int) -> None:
    """The figure's title, then one legend for all its panels in a band below it (never over
    the data), then the panels. At most ``ncol`` columns, fewer where the labels would not
    fit the figure's width side by side."""
    longest = max((len(label) for label in labels), default=0)
    fits = int(fig.get_figwidth() // (_LEGEND_HANDLE_IN + _LEGEND_CHAR_IN * longest))
    ncol = max(1, min(ncol, fits))
    height = fig.get_figheight()
    fig.suptitle(title, y=1 - 0.08 / height, va="top", fontsize=11)
    fig.legend(handles, labels, loc="upper center", ncol=ncol, fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.34 / height))
    rows = -(-len(labels) // ncol)
    fig.tight_layout(rect=(0, 0, 1, 1 - (0.12 + 0.18 * rows) / height))


def _short_number(v: float) -> str:
    """A tick label: 30, 300, 3k, 300k, 3M (``1e+06`` and ``300000`` crowd each other)."""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(v) >= scale:
            return f"{v / scale:g}{suffix}"
    return f"{v:g}"


#: Log-axis tick values per decade, densest first: the densest whose labels do not crowd is
#: used (a view of hits at 40-90 ms gets 40, 50, 60, 80; a wide one 20, 50, 100, 200, 500, 1k).
_LOG_TICK_STEPS = ((1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0), (1.0, 2.0, 3.0, 5.0), (1.0, 2.0, 5.0), (1.0,))
#: Fewest pixels between two tick labels' centres: along x, along y.
_TICK_SPACING_PX = {"x": 26.0, "y": 15.0}


#: A view ending at most this many decades short of a tick is widened to it, so that the
#: lowest and highest curves sit beside a labelled value (a p50 of 55 ms beside 50).
_REACH_DECADES = 0.1


def _plain_log_ticks(axis) -> None:
    """Log-scale ticks as plain numbers (20, 50, 100, 200, 500, 1k), as dense as the axis's
    length allows, chosen from its view once the data are drawn; the view is widened to a
    tick just beyond either end."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    low, high = sorted(axis.get_view_interval())
    if not low > 0:
        return
    box = axis.axes.get_window_extent()
    name = axis.axis_name
    length_px = box.width if name == "x" else box.height
    px_per_decade = length_px / max(np.log10(high / low), 1e-9)
    reach = 10.0 ** _REACH_DECADES
    for steps in _LOG_TICK_STEPS:
        decades = range(int(np.floor(np.log10(low))) - 1, int(np.ceil(np.log10(high))) + 2)
        candidates = [m * 10.0 ** e for e in decades for m in steps]
        inside = [t for t in candidates if low <= t <= high]
        below = [t for t in candidates if low / reach <= t < low] if not inside or inside[0] > low * 1.05 else []
        above = [t for t in candidates if high < t <= high * reach] if not inside or inside[-1] < high / 1.05 else []
        ticks = below[-1:] + inside + above[:1]
        gaps = np.diff(np.log10(ticks)) * px_per_decade if len(ticks) > 1 else [np.inf]
        if min(gaps) >= _TICK_SPACING_PX[name]:
            break
    if ticks:
        set_limits = axis.axes.set_xlim if name == "x" else axis.axes.set_ylim
        set_limits(min(low, ticks[0]), max(high, ticks[-1]))
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(lambda v, _: _short_number(v)))
    axis.set_minor_locator(NullLocator())
    axis.set_minor_formatter(NullFormatter())


#: Below this many samples a CDF is drawn as its points joined by lines: as a staircase a
#: handful of misses reads as a few flat steps.
_FEW_SAMPLES = 20


def plot_hit_rate(points: list[Point], capacity: float | None, reference: list[Point] | None = None):
    """Request hit rate vs K, one panel per fleet size: the topologies measured (colour),
    the simulator's prediction (crosses), min(1, C/K) and the routing bound min(1, W·C/K)."""
    from matplotlib.lines import Line2D

    plt = pyplot()
    c = _report_concurrency(points)
    chosen = [p for p in points if p.concurrency == c]
    fleets = sorted({p.workers for p in chosen}, reverse=True)
    names = _topologies(chosen)
    colors = _colors(names)
    ks = sorted({p.prefixes for p in chosen})
    fig, axes = _grid(plt, 1, len(fleets), width=4.0, height=3.2, sharey=True)
    for ax, w in zip(axes[0], fleets):
        for name in names:
            series = sorted((p.prefixes, p.median("request_hit_rate")) for p in chosen
                            if (p.workers, p.policy) == (w, name))
            if series:
                ax.plot([k for k, _ in series], [v for _, v in series], "o-", color=colors[name], lw=2)
            ref = sorted((r.prefixes, r.median("request_hit_rate")) for r in reference or []
                         if (r.workers, r.policy, r.concurrency) == (w, name, c))
            if ref:
                ax.plot([k for k, _ in ref], [v for _, v in ref], "x", color=colors[name], ms=9, mew=2)
        if capacity is not None and ks:
            grid = np.linspace(max(1.0, min(ks) * 0.8), max(ks) * 1.1, 200)
            ax.plot(grid, np.minimum(1, capacity / grid), "--", color="0.45", lw=1)
            ax.plot(grid, np.minimum(1, w * capacity / grid), ":", color="0.2", lw=1.2)
        ax.set_title(f"{w} workers", fontsize=10)
        ax.set_xlabel("K (distinct prefixes)")
        ax.set_xticks(ks)
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("request hit rate")
    handles = [Line2D([], [], color=colors[n], marker="o", lw=2) for n in names]
    labels = [f"{n} (measured)" for n in names]
    if reference:
        handles.append(Line2D([], [], color="0.3", marker="x", ls="", ms=8, mew=2))
        labels.append("simulator")
    if capacity is not None:
        handles += [Line2D([], [], color="0.45", ls="--"), Line2D([], [], color="0.2", ls=":")]
        labels += ["min(1, C/K)", "min(1, W·C/K)"]
    caption = f"Request hit rate vs K ({_load_label(c)})" + (f", C = {capacity:.2f}" if capacity is not None else "")
    _title_and_legend(fig, caption, handles, labels, ncol=min(len(labels), 3))
    return fig


def plot_ttft_cdf(points: list[Point], samples: dict[tuple[int, int, int, str], PointSamples]):
    """TTFT CDFs at the lowest load level, one panel per fleet size (rows) and K (columns):
    the topology is the colour, hits solid and misses dashed."""
    from matplotlib.lines import Line2D

    plt = pyplot()
    c = min(p.concurrency for p in points)
    keys = [k for k in samples if k[2] == c]
    fleets = sorted({k[0] for k in keys}, reverse=True) or [0]
    ks = sorted({k[1] for k in keys}) or [0]
    names = _topologies([p for p in points if p.concurrency == c])
    colors = _colors(names)
    fig, axes = _grid(plt, len(fleets), len(ks), width=max(3.4, 6.0 / len(ks)), sharex=True, sharey=True)
    for i, w in enumerate(fleets):
        for j, k in enumerate(ks):
            ax = axes[i][j]
            for name in names:
                point = samples.get((w, k, c, name))
                if point is None:
                    continue
                for values, style in ((point.hit, "-"), (point.miss, "--")):
                    if not values:
                        continue
                    xs = np.sort(np.asarray(values)) * 1000
                    ys = np.arange(1, len(xs) + 1) / len(xs)
                    if len(xs) < _FEW_SAMPLES:
                        ax.plot(xs, ys, style, marker="o", ms=3.5, color=colors[name], lw=1.2)
                    else:
                        ax.step(xs, ys, style, color=colors[name], where="post", lw=1.6)
            ax.set_title(f"{w} workers, K = {k}" if k else f"{w} workers", fontsize=9)  # K 0: a trace
            ax.set_xscale("log")
            ax.grid(alpha=0.3, which="both")
            if i == len(fleets) - 1:
                ax.set_xlabel("TTFT (ms)")
            if j == 0:
                ax.set_ylabel("fraction of requests")
    _plain_log_ticks(axes[0][0].xaxis)  # shared by every panel, so set once the data are in
    handles = [Line2D([], [], color=colors[n], lw=2) for n in names]
    handles += [Line2D([], [], color="0.3", ls="-"), Line2D([], [], color="0.3", ls="--")]
    labels = [*names, "hit", "miss"]
    _title_and_legend(fig, f"TTFT CDF, hits vs misses ({_load_label(c)})", handles, labels, ncol=len(labels))
    return fig


def plot_ttft_vs_concurrency(points: list[Point]):
    """TTFT p50 (solid) and p99 (dashed) vs concurrency, one panel per fleet size (rows) and K
    (columns), the topology as the colour; concurrency levels are categories, evenly spaced."""
    from matplotlib.lines import Line2D

    plt = pyplot()
    fleets = sorted({p.workers for p in points}, reverse=True)
    ks = sorted({p.prefixes for p in points})
    levels = sorted({p.concurrency for p in points})
    at = {c: i for i, c in enumerate(levels)}
    names = _topologies(points)
    colors = _colors(names)
    fig, axes = _grid(plt, len(fleets), len(ks), sharex=True, sharey=True)
    for i, w in enumerate(fleets):
        for j, k in enumerate(ks):
            ax = axes[i][j]
            for name in names:
                series = sorted((p for p in points if (p.workers, p.prefixes, p.policy) == (w, k, name)),
                                key=lambda p: p.concurrency)
                xs = [at[p.concurrency] for p in series]
                ax.plot(xs, [p.median("ttft_p50_ms") for p in series], "o-", color=colors[name], lw=1.8)
                ax.plot(xs, [p.median("ttft_p99_ms") for p in series], "s--", color=colors[name], lw=1.2,
                        ms=4)
            ax.set_title(f"{w} workers, K = {k}", fontsize=9)
            ax.set_yscale("log")
            ax.set_xticks(range(len(levels)), [str(c) for c in levels])
            ax.set_xlim(-0.4, len(levels) - 0.6)
            ax.grid(alpha=0.3)
            if i == len(fleets) - 1:
                ax.set_xlabel("concurrency")
            if j == 0:
                ax.set_ylabel("TTFT (ms)")
    _plain_log_ticks(axes[0][0].yaxis)  # shared by every panel
    handles = [Line2D([], [], color=colors[n], lw=2) for n in names]
    handles += [Line2D([], [], color="0.3", ls="-", marker="o"), Line2D([], [], color="0.3", ls="--", marker="s", ms=4)]
    labels = [*names, "p50", "p99"]
    _title_and_legend(fig, "TTFT p50 / p99 vs concurrency", handles, labels, ncol=len(labels))
    return fig


def write_plots(
    out: Path,
    points: list[Point],
    samples: dict[tuple[int, int, int, str], PointSamples],
    capacity: float | None,
    reference: list[Point] | None = None,
    timelines: Timelines | None = None,
    reference_timelines: Timelines | None = None,
    timelines_source: str = "measured",
) -> list[Path]:
    """The PNGs: against K and concurrency for closed-loop points; for an open-loop replay with
    ``timelines`` (a trace), the hit rate and each worker's load over time instead (with the
    simulator's replay of the same requests, ``reference_timelines``, beside the hit rate);
    the TTFT CDFs by hit and miss for both."""
    if not points:
        return []
    plt = pyplot()
    figures = []
    if timelines:
        figures.append(("hit_rate_over_time.png",
                        plot_hit_rate_over_time(timelines, reference_timelines, timelines_source)))
        # Only replays whose responses name their worker (the router's header, the simulator):
        # behind a Service the client cannot tell which worker answered.
        named = {k: v for k, v in timelines.items() if any(r.worker is not None for r in v)}
        if named:
            figures.append(("worker_load_over_time.png", plot_worker_load_over_time(named)))
    else:
        figures.append(("hit_rate_vs_k.png", plot_hit_rate(points, capacity, reference)))
    figures.append(("ttft_cdf.png", plot_ttft_cdf(points, samples)))
    if any(p.concurrency > 0 for p in points):
        figures.append(("ttft_vs_concurrency.png", plot_ttft_vs_concurrency([p for p in points if p.concurrency > 0])))
    paths = []
    for name, fig in figures:
        path = out / name
        try:
            fig.savefig(path, dpi=110)
        except OSError as exc:
            raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
        finally:
            plt.close(fig)
        paths.append(path)
    return paths


def _time_bins(timelines: Timelines) -> np.ndarray:
    """Bin edges (seconds) over every replay's send times: about 20 requests a bin on
    average, between 10 and 60 bins."""
    sends = [r.send_time for records in timelines.values() for r in records]
    lo, hi = min(sends, default=0.0), max(sends, default=1.0)
    runs = max(1, len(timelines))
    bins = int(np.clip(len(sends) / runs / 20, 10, 60))
    return np.linspace(lo, hi if hi > lo else lo + 1.0, bins + 1)


def _minutes_or_seconds(edges: np.ndarray) -> tuple[float, str]:
    return (60.0, "minutes") if edges[-1] - edges[0] >= 300 else (1.0, "seconds")


def _token_hit_by_bin(records: list[RequestRecord], edges: np.ndarray) -> np.ndarray:
    """Per send-time bin, cached ÷ prompt tokens of the requests sent in it (NaN if none);
    a failed request counts as a miss, as in the tables."""
    sends = np.array([r.send_time for r in records])
    prompt = np.array([r.prompt_tokens for r in records], dtype=float)
    cached = np.array([(r.cached_tokens or 0) if r.ok else 0 for r in records], dtype=float)
    at = np.clip(np.searchsorted(edges, sends, side="right") - 1, 0, len(edges) - 2)
    num = np.bincount(at, cached, minlength=len(edges) - 1)
    den = np.bincount(at, prompt, minlength=len(edges) - 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / den, np.nan)


def plot_hit_rate_over_time(timelines: Timelines, reference: Timelines | None = None, source: str = "measured"):
    """Token hit ratio of the requests sent in each time bin, one panel per fleet size, the
    topology as the colour (the simulator's replay dashed); the whole-run ratio in the legend.
    ``source`` names where ``timelines`` come from (``measured``, or ``simulated``)."""
    from matplotlib.lines import Line2D

    plt = pyplot()
    edges = _time_bins({**(reference or {}), **timelines})
    unit, unit_name = _minutes_or_seconds(edges)
    mids = (edges[:-1] + edges[1:]) / 2 / unit
    fleets = sorted({w for w, _ in timelines}, reverse=True)
    names = sorted({n for _, n in timelines}, key=_topology_order)
    colors = _colors(names)
    fig, axes = _grid(plt, 1, len(fleets), width=5.6, height=3.2, sharey=True)
    handles, labels = [], []
    for ax, w in zip(axes[0], fleets):
        for name in names:
            for runs, style, tag in ((timelines, "-", source), (reference or {}, "--", "simulator")):
                records = runs.get((w, name))
                if not records:
                    continue
                ax.plot(mids, _token_hit_by_bin(records, edges), style, color=colors[name],
                        lw=2 if style == "-" else 1.3)
                whole = sum((r.cached_tokens or 0) for r in records if r.ok) / max(1, sum(r.prompt_tokens for r in records))
                handles.append(Line2D([], [], color=colors[name], ls=style, lw=2))
                labels.append(f"{name} ({tag}), W={w}: {whole:.1%} overall")
        ax.set_title(f"{w} workers", fontsize=10)
        ax.set_xlabel(f"time ({unit_name})")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("token hit ratio (per time bin)")
    _title_and_legend(fig, "Token hit ratio over time", handles, labels, ncol=min(len(labels), 2))
    return fig


def _mean_in_flight(records: list[RequestRecord], workers: list[str], edges: np.ndarray) -> np.ndarray:
    """Requests in flight (sent, not yet finished) of each of ``workers``, averaged over each
    time bin: shape (len(workers), bins). One pass over the records: each request's overlap
    with every bin, summed per worker."""
    row = {name: i for i, name in enumerate(workers)}
    mine = [r for r in records if r.worker in row]
    start = np.array([r.send_time for r in mine], dtype=float)
    end = start + np.array([r.e2e_s or 0.0 for r in mine], dtype=float)
    overlap = np.clip(np.minimum(edges[1:], end[:, None]) - np.maximum(edges[:-1], start[:, None]), 0.0, None)
    total = np.zeros((len(workers), len(edges) - 1))
    np.add.at(total, np.array([row[r.worker] for r in mine], dtype=np.intp), overlap)
    return total / np.diff(edges)


def plot_worker_load_over_time(timelines: Timelines):
    """Each worker's requests in flight over time (averaged per time bin), one panel per replay
    (fleet size and topology), one line per worker: a hotspot is one line far above the
    others; the panel's title gives the busiest worker's requests ÷ the mean."""
    plt = pyplot()
    edges = _time_bins(timelines)
    unit, unit_name = _minutes_or_seconds(edges)
    mids = (edges[:-1] + edges[1:]) / 2 / unit
    keys = sorted(timelines, key=lambda k: (-k[0], _topology_order(k[1])))
    cols = min(3, len(keys))
    rows = -(-len(keys) // cols)
    # Each panel its own scale: a hotspot's queue (hundreds) would flatten an even fleet's lines.
    fig, axes = _grid(plt, rows, cols, width=4.4, height=2.8, sharex=True)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    cmap = plt.get_cmap("tab10" if max(k[0] for k in keys) <= 10 else "tab20")
    for ax, (w, name) in zip(axes.flat, keys):
        records = timelines[(w, name)]
        workers = sorted({r.worker for r in records if r.worker is not None})
        served = [sum(1 for r in records if r.worker == n) for n in workers]
        for i, in_flight in enumerate(_mean_in_flight(records, workers, edges)):
            ax.plot(mids, in_flight, color=cmap(i % cmap.N), lw=1.2)
        busiest = max(served) * w / sum(served) if served else 0.0  # idle workers count in the mean
        idle = f", {w - len(workers)} idle" if len(workers) < w else ""
        ax.set_title(f"{name}, {w} workers: busiest {busiest:.2f}× the mean{idle}", fontsize=9)
        ax.set_xlabel(f"time ({unit_name})")
        ax.set_ylabel("requests in flight (bin mean)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    fig.suptitle("Requests in flight per worker (one line each)", fontsize=11)
    fig.tight_layout()
    return fig
