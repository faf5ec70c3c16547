"""What a bench run leaves in its output folder.

* ``records.jsonl`` — one line per request (warmup ones flagged), with its point's labels;
  written trial by trial, so an interrupted run keeps everything it measured;
* ``windows.jsonl`` — per trial and worker, the Prometheus counter deltas of the window;
* ``summary.json`` — the points, in the JSON contract ``kvroute sim --json`` writes;
* ``points.csv`` — one row per point (medians over trials);
* ``hit_rate_vs_k.png``, ``ttft_cdf.png``, ``ttft_vs_concurrency.png`` — matplotlib (Agg);
* ``report.html`` — a single file with the four tables and the plots embedded.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvroute.bench.runner import TrialResult, TrialSink
from kvroute.commands.sim import write_points_json
from kvroute.errors import UserError
from kvroute.records import MEDIAN_FIELDS, Point

RECORDS = "records.jsonl"
WINDOWS = "windows.jsonl"
SUMMARY = "summary.json"
CSV = "points.csv"
HTML = "report.html"


@dataclass
class PointSamples:
    """TTFTs of one point's measured requests (all trials), split by hit and miss, for the
    CDF plot."""

    hit: list[float] = field(default_factory=list)
    miss: list[float] = field(default_factory=list)


class ResultsWriter(TrialSink):
    """Writes trials as they finish and the reports at the end.

    Args:
        out: the output folder (created).
    """

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create {self.out}: {exc.strerror or exc}") from None
        self.samples: dict[tuple[int, int, int, str], PointSamples] = {}
        self.trials_written = 0

    def _append(self, name: str, lines: list[dict]) -> None:
        try:
            with open(self.out / name, "a", encoding="utf-8") as f:
                for line in lines:
                    f.write(json.dumps(line, separators=(",", ":")) + "\n")
        except OSError as exc:
            raise UserError(f"cannot write {self.out / name}: {exc.strerror or exc}") from None

    def trial_done(self, result: TrialResult) -> None:
        target = result.target
        labels = {
            "topology": target.label,
            "workers": target.num_workers,
            "prefixes": result.prefixes,
            "concurrency": result.concurrency,
            "trial": result.trial,
        }
        if result.partial:
            labels["partial"] = True
        lines = [{**labels, "warmup": True, **r.to_json()} for r in result.warmup]
        lines += [{**labels, "warmup": False, **r.to_json()} for r in result.records]
        self._append(RECORDS, lines)
        if result.window:
            self._append(WINDOWS, [
                {**labels, "url": d.url, "hits": d.hits, "queries": d.queries, "token_hit_rate": d.token_hit_rate}
                for d in result.window
            ])
        key = (target.num_workers, result.prefixes, result.concurrency, target.label)
        samples = self.samples.setdefault(key, PointSamples())
        for r in result.records:
            if r.ok and r.ttft_s is not None:
                (samples.hit if r.hit else samples.miss).append(r.ttft_s)
        self.trials_written += 1

    def logs(self) -> list[Path]:
        """The per-request and per-window logs written so far (``records.jsonl``,
        ``windows.jsonl``), for the final "wrote …" line."""
        return [p for p in (self.out / RECORDS, self.out / WINDOWS) if p.exists()]

    def write_reports(
        self,
        points: list[Point],
        meta: dict,
        capacity: float | None,
        tables_html: str,
        reference: list[Point] | None = None,
    ) -> list[Path]:
        """Summary JSON, CSV, plots and the HTML report; returns the paths written."""
        summary = self.out / SUMMARY
        write_points_json(summary, points, meta)
        written = [summary, write_csv(self.out / CSV, points)]
        pngs = write_plots(self.out, points, self.samples, capacity, reference)
        written += pngs
        written.append(write_html(self.out / HTML, meta, tables_html, pngs))
        return written


def write_csv(path: Path, points: list[Point]) -> Path:
    """One row per point: its labels and the medians over trials."""
    columns = ["workers", "prefixes", "concurrency", "policy", "source", "trials", *MEDIAN_FIELDS]
    try:
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            for p in points:
                writer.writerow(p.to_json())
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


# -- plots ------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    return plt


def _report_concurrency(points: list[Point], preferred: int = 8) -> int:
    levels = sorted({p.concurrency for p in points})
    return preferred if preferred in levels else levels[len(levels) // 2]


def plot_hit_rate(points: list[Point], capacity: float | None, reference: list[Point] | None = None):
    """Request hit rate vs K per topology, with min(1, C/K) and the routing bound min(1, W·C/K)."""
    plt = _pyplot()
    c = _report_concurrency(points)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    chosen = [p for p in points if p.concurrency == c]
    ks = sorted({p.prefixes for p in chosen})
    for w, pol in sorted({(p.workers, p.policy) for p in chosen}):
        series = sorted((p.prefixes, p.median("request_hit_rate")) for p in chosen if (p.workers, p.policy) == (w, pol))
        ax.plot([k for k, _ in series], [v for _, v in series], "o-", label=f"{w}w {pol} (measured)")
    for p_ref in [r for r in (reference or []) if r.concurrency == c]:
        ax.plot([p_ref.prefixes], [p_ref.median("request_hit_rate")], "x", color="gray")
    if reference:
        ax.plot([], [], "x", color="gray", label="simulator")
    if capacity is not None and ks:
        grid = np.linspace(max(1.0, min(ks) * 0.8), max(ks) * 1.1, 200)
        ax.plot(grid, np.minimum(1, capacity / grid), "--", color="tab:cyan", label="min(1, C/K)")
        for w in sorted({p.workers for p in chosen}, reverse=True):
            ax.plot(grid, np.minimum(1, w * capacity / grid), ":", label=f"min(1, {w}·C/K)")
    ax.set_xlabel("K (prefix kinds)")
    ax.set_ylabel("request hit rate")
    ax.set_ylim(0, 1.05)
    title = f"Hit rate vs K (concurrency {c})" if c else "Hit rate vs K (open loop)"
    ax.set_title(title + (f", C = {capacity:.2f}" if capacity is not None else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def plot_ttft_cdf(points: list[Point], samples: dict[tuple[int, int, int, str], PointSamples]):
    """TTFT CDFs at the lowest load level, hit (solid) and miss (dashed) per K."""
    plt = _pyplot()
    c = min(p.concurrency for p in points)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    keys = sorted(k for k in samples if k[2] == c)
    for i, key in enumerate(keys):
        w, k, _, pol = key
        color = colors[i % len(colors)]
        for values, style, what in ((samples[key].hit, "-", "hit"), (samples[key].miss, "--", "miss")):
            if values:
                xs = np.sort(np.asarray(values)) * 1000
                ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), style, color=color, where="post",
                        label=f"{w}w {pol} K={k} {what} (n={len(xs)})")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF, hit vs miss ({'concurrency ' + str(c) if c else 'open loop'})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def plot_ttft_vs_concurrency(points: list[Point]):
    """TTFT p50 (solid) and p99 (dashed) vs concurrency, per topology and K."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    groups = sorted({(p.workers, p.policy, p.prefixes) for p in points})
    for i, (w, pol, k) in enumerate(groups):
        series = sorted((p for p in points if (p.workers, p.policy, p.prefixes) == (w, pol, k)), key=lambda p: p.concurrency)
        cs = [p.concurrency for p in series]
        color = colors[i % len(colors)]
        ax.plot(cs, [p.median("ttft_p50_ms") for p in series], "o-", color=color, label=f"{w}w {pol} K={k} p50")
        ax.plot(cs, [p.median("ttft_p99_ms") for p in series], "s--", color=color, label=f"{w}w {pol} K={k} p99")
    ax.set_xlabel("concurrency")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title("TTFT p50 / p99 vs concurrency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def write_plots(
    out: Path,
    points: list[Point],
    samples: dict[tuple[int, int, int, str], PointSamples],
    capacity: float | None,
    reference: list[Point] | None = None,
) -> list[Path]:
    """The three PNGs (the concurrency plot only for closed-loop points)."""
    if not points:
        return []
    plt = _pyplot()
    figures = [
        ("hit_rate_vs_k.png", plot_hit_rate(points, capacity, reference)),
        ("ttft_cdf.png", plot_ttft_cdf(points, samples)),
    ]
    if any(p.concurrency > 0 for p in points):
        figures.append(("ttft_vs_concurrency.png", plot_ttft_vs_concurrency([p for p in points if p.concurrency > 0])))
    paths = []
    for name, fig in figures:
        path = out / name
        try:
            fig.tight_layout()
            fig.savefig(path, dpi=110)
        except OSError as exc:
            raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
        finally:
            plt.close(fig)
        paths.append(path)
    return paths


# -- HTML -------------------------------------------------------------------------------------


def write_html(path: Path, meta: dict, tables_html: str, pngs: list[Path]) -> Path:
    """One self-contained page: run settings, the tables (as rendered in the terminal, with
    their colours) and the plots as base64 PNGs."""
    images = "\n".join(
        f'<figure><img alt="{html.escape(p.stem)}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}"><figcaption>{html.escape(p.name)}</figcaption></figure>'
        for p in pngs
    )
    settings = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(json.dumps(v) if not isinstance(v, str) else v)}</td></tr>"
        for k, v in meta.items()
    )
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>kvroute bench report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 80em; }}
table.meta th {{ text-align: left; padding-right: 1em; }}
pre {{ font-size: 13px; line-height: 1.25; }}
figure {{ display: inline-block; margin: 0 1em 1em 0; }}
img {{ max-width: 42em; }}
</style></head>
<body>
<h1>kvroute bench report</h1>
<table class="meta">{settings}</table>
<h2>Tables</h2>
{tables_html}
<h2>Plots</h2>
{images}
</body></html>
"""
    try:
        path.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


def tables_as_html(render) -> str:
    """Run ``render(console)`` on a recording rich console and return the output as an HTML
    fragment with inline styles (so the page needs no stylesheet)."""
    from rich.console import Console

    console = Console(record=True, file=io.StringIO(), width=140, force_terminal=True)
    render(console)
    return console.export_html(inline_styles=True, code_format="<pre>{code}</pre>")
