"""The plots and report.html a bench or experiment run writes: small multiples that keep one
colour per topology and one legend outside the data, categorical concurrency ticks, and a page
that opens with the hit-rate table and plot and folds its settings away (checked in a real
browser, headless Chromium, when the machine has one).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvroute.bench.plots import plot_hit_rate, plot_ttft_cdf, plot_ttft_vs_concurrency, write_plots
from kvroute.bench.report_html import write_html
from kvroute.bench.samples import PointSamples
from kvroute.engine import get_preset
from kvroute.records import Point
from kvroute.report import print_hit_rate_table, print_latency_tables
from kvroute.sim import WorkerConfig, run_point, sweep_points
from kvroute.workload import WorkloadSpec, generate

WORKERS, PREFIXES, LEVELS, TOPOLOGIES = (4, 2), (2, 8), (2, 4), ("random", "kv-aware")
CAPACITY = 3.84


@pytest.fixture(scope="module")
def sweep() -> tuple[list[Point], dict]:
    """A small real sweep from the simulator, labelled as the experiment labels its topologies,
    and TTFT samples for each of its points."""
    config = WorkerConfig(num_blocks=585, block_size=16, cost=get_preset("reference-gpu"))
    workloads = {k: generate(WorkloadSpec(prefixes=k, requests=40, seed=1)) for k in PREFIXES}
    names = {"random": "service", "kv-aware": "router"}
    points = []
    for sp in sweep_points(WORKERS, PREFIXES, LEVELS, TOPOLOGIES):
        p = run_point(sp, workloads[sp.prefixes], config, 1, 0)
        p.policy = names[p.policy]
        points.append(p)
    rng = np.random.default_rng(0)
    samples = {
        (p.workers, p.prefixes, p.concurrency, p.policy): PointSamples(
            hit=list(rng.lognormal(-3, 0.3, 30)), miss=list(rng.lognormal(-2, 0.3, 10))
        )
        for p in points
    }
    return points, samples


def _check_small_multiples(fig, rows: int, cols: int) -> None:
    axes = fig.get_axes()
    assert len(axes) == rows * cols
    # One legend for the figure, none inside a panel, and it covers no panel.
    assert len(fig.legends) == 1 and not any(ax.get_legend() for ax in axes)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend_box = fig.legends[0].get_window_extent(renderer)
    title_box = fig._suptitle.get_window_extent(renderer)
    for ax in axes:
        panel = ax.get_window_extent(renderer)
        assert not legend_box.overlaps(panel) and not title_box.overlaps(panel)
    assert not legend_box.overlaps(title_box)
    # The figure holds its legend.
    assert legend_box.x0 >= 0 and legend_box.x1 <= fig.bbox.width and legend_box.y1 <= fig.bbox.height


def _colours_by_topology(fig) -> dict[str, set]:
    """Colour of every drawn line, per topology, read back through the figure legend."""
    legend = fig.legends[0]
    return {
        text.get_text().split(" ")[0]: handle.get_color()
        for text, handle in zip(legend.get_texts(), legend.legend_handles)
    }


def test_ttft_vs_concurrency_is_one_panel_per_fleet_and_k_with_categorical_ticks(sweep):
    points, _ = sweep
    fig = plot_ttft_vs_concurrency(points)
    _check_small_multiples(fig, len(WORKERS), len(PREFIXES))
    colours = _colours_by_topology(fig)
    assert colours["service"] != colours["router"]
    fig.canvas.draw()
    for i, ax in enumerate(fig.get_axes()):
        # Evenly spaced categories, labelled with the levels (on the bottom row: shared x).
        assert list(ax.get_xticks()) == list(range(len(LEVELS)))
        if i >= (len(WORKERS) - 1) * len(PREFIXES):
            assert [t.get_text() for t in ax.get_xticklabels()] == [str(c) for c in LEVELS]
        lines = ax.get_lines()
        assert len(lines) == 2 * len(TOPOLOGIES)  # p50 and p99 per topology
        # Colour says topology, style says percentile: each colour once solid, once dashed.
        assert {(line.get_color(), line.get_linestyle()) for line in lines} == {
            (colours[n], style) for n in ("service", "router") for style in ("-", "--")
        }


def test_ttft_cdf_is_one_panel_per_fleet_and_k(sweep):
    points, samples = sweep
    fig = plot_ttft_cdf(points, samples)
    _check_small_multiples(fig, len(WORKERS), len(PREFIXES))
    colours = _colours_by_topology(fig)
    for ax in fig.get_axes():
        assert {line.get_color() for line in ax.get_lines()} == {colours["service"], colours["router"]}
        assert {line.get_linestyle() for line in ax.get_lines()} == {"-", "--"}  # hit, miss


def test_hit_rate_is_one_panel_per_fleet_with_the_bounds(sweep):
    points, _ = sweep
    fig = plot_hit_rate(points, CAPACITY, reference=points)
    _check_small_multiples(fig, 1, len(WORKERS))
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["service (measured)", "router (measured)", "simulator", "min(1, C/K)", "min(1, W·C/K)"]


def _report(tmp_path: Path, points: list[Point], samples: dict) -> Path:
    from kvroute.bench.report_html import tables_as_html

    pngs = write_plots(tmp_path, points, samples, CAPACITY, points)
    meta = {"command": "experiment", "engine": "emulator", "workers": list(WORKERS),
            "topologies": ["service", "router"], "trials": 1, "capacity_requests": CAPACITY,
            "partial": False, "sim": {"points": [p.to_json() for p in points] * 20}}
    lead = tables_as_html(lambda c: print_hit_rate_table(points, CAPACITY, c, points))
    rest = tables_as_html(lambda c: print_latency_tables(points, c))
    return write_html(tmp_path / "report.html", meta, rest, pngs, lead)


def test_report_leads_with_the_answer_and_folds_the_settings(sweep, tmp_path):
    page = _report(tmp_path, *sweep).read_text()
    assert "<title>kvroute experiment report</title>" in page
    answer = page.index('id="answer"')
    assert answer < page.index("1. Request hit rate") < page.index('title="hit_rate_vs_k.png"') < page.index("2. TTFT")
    assert page.index("2. TTFT") < page.index('title="ttft_cdf.png"') < page.index('id="settings"')
    settings = page[page.index('<details id="settings">'):]
    assert "<details id=\"settings\"><summary>" in page  # collapsed: no `open`
    # The simulator's points are summarized, not dumped (they are in summary.json).
    assert f"{len(sweep[0]) * 20} points (in summary.json)" in settings
    assert len(settings) < 5_000


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(CHROMIUM is None, reason="needs a Chromium (Debian: apt-get install chromium)")
def test_report_in_a_real_browser_shows_the_answer_on_the_first_screen(sweep, tmp_path):
    """Lay the page out in headless Chromium: a script measures where the hit-rate table and
    plot land and whether the settings take any room, and writes it into the DOM; a
    screenshot of the first screen is kept beside the report."""
    report = _report(tmp_path, *sweep)
    probe = tmp_path / "probe.html"
    probe.write_text(report.read_text().replace("</body>", """<script>
const box = (q) => document.querySelector(q).getBoundingClientRect();
const out = {table: box("#answer pre").top, plot: box('#answer img').top,
             plotHeight: box('#answer img').height, settings: box("#settings").height,
             width: document.documentElement.scrollWidth};
document.body.setAttribute("data-layout", JSON.stringify(out));
</script></body>"""))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1400,1000"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", probe.as_uri()], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    match = re.search(r'data-layout="([^"]+)"', dom)
    assert match, dom[:500]
    import html
    import json

    layout = json.loads(html.unescape(match.group(1)))
    assert layout["table"] < 200  # the hit-rate table right under the title
    assert layout["plotHeight"] > 200 and layout["plot"] + layout["plotHeight"] < 1000  # whole plot, first screen
    assert layout["settings"] < 40  # folded: one summary line
    assert layout["width"] <= 1400  # nothing runs off the side
    shot = tmp_path / "report-first-screen.png"
    subprocess.run([CHROMIUM, *flags, f"--screenshot={shot}", report.as_uri()], capture_output=True,
                   timeout=120, check=True)
    assert shot.read_bytes()[:4] == b"\x89PNG"


def test_hit_measures_agreement_says_when_refreshes_were_taken_out_of_the_worker_counters() -> None:
    from dataclasses import replace

    from kvroute.records import TrialStats
    from kvroute.report import hit_measures_agreement

    plain = TrialStats(10, 0, 8, 0.8, 0.7, None, None, None, None, None, None, 1.0, 1.0,
                       metrics_token_hit_rate=0.72)
    quiet = hit_measures_agreement([Point(6, 24, 8, "router", [plain])])
    assert "max |Δ| = 0.0200 over 1 trial" in quiet and "refreshes" not in quiet
    refreshed = hit_measures_agreement([Point(6, 24, 8, "router", [replace(plain, refreshes=5)])])
    assert "refreshes, as it measured them, taken out of the workers' counters" in refreshed

    simulated = hit_measures_agreement([Point(6, 24, 8, "kv-aware", [plain]),
                                        Point(6, 24, 8, "kv-aware+retain-auto",
                                              [replace(plain, refreshes=5, metrics_token_hit_rate=None)])])
    assert "over 1 trial; 1 trial with retention's refreshes not compared" in simulated
    assert "taken out" not in simulated


def _hit_table_text(points: list[Point], capacity: float, **kwargs) -> str:
    from rich.console import Console

    from kvroute.report import print_hit_rate_table

    console = Console(width=400, record=True)
    print_hit_rate_table(points, capacity, console, **kwargs)
    return console.export_text()


def test_hit_rate_table_marks_a_rate_above_the_routing_bound_and_explains_it() -> None:
    from kvroute.records import TrialStats

    def point(policy: str, hit: float) -> Point:
        return Point(6, 24, 8, policy, [TrialStats(10, 0, 8, hit, hit, None, None, None, None, None, None, 1.0, 1.0)])

    text = _hit_table_text([point("router", 0.983), point("service", 0.169)], 3.84)
    assert "98.3%*" in text and "16.9%*" not in text and "96.0%" in text  # min(1, 6·3.84/24)
    assert "* above min(1, W·C/K)" in text and "C = 3.84: the requests one worker's KV cache holds" in text
    plain = _hit_table_text([point("router", 0.90)], 3.84)
    assert "*" not in plain


def test_hit_rate_table_leaves_the_uniform_formulas_out_under_zipf() -> None:
    from kvroute.records import TrialStats

    p = Point(6, 64, 8, "kv-aware", [TrialStats(10, 0, 8, 0.746, 0.7, None, None, None, None, None, None, 1.0, 1.0)])
    text = _hit_table_text([p], 3.84, zipf_alpha=1.2)
    assert "min(1, 6·C/K)" not in text and "36.0%" not in text
    assert "assume equally popular prefixes: not shown for Zipf α = 1.2" in text


def test_headline_says_the_answer_in_one_sentence() -> None:
    from kvroute.records import TrialStats
    from kvroute.report import headline

    def point(policy: str, k: int, hit: float) -> Point:
        return Point(6, k, 8, policy, [TrialStats(10, 0, 8, hit, hit, None, None, None, None, None, None, 1.0, 1.0)])

    text = headline([point("router", 24, 0.954), point("service", 24, 0.169), point("router", 2, 0.98)], 3.84)
    assert text.startswith("At K = 24 on 6 workers (concurrency 8), 95.4% of requests hit the prefix cache "
                           "through router and 16.9% through service; min(1, C/K) = 16.0%")


def test_report_opens_with_the_headline_and_captions_its_plots(tmp_path: Path) -> None:
    from kvroute.bench.report_html import PLOT_CAPTIONS, write_html

    png = tmp_path / "ttft_cdf.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n")
    page = write_html(tmp_path / "report.html", {"command": "experiment", "capacity_requests": 3.84}, "<pre></pre>",
                      [png], None, "At K = 24 on 6 workers (concurrency 8), 95.4% of requests hit.").read_text()
    assert '<p class="headline">At K = 24 on 6 workers' in page
    assert f"<figcaption>{PLOT_CAPTIONS['ttft_cdf.png']}</figcaption>" in page
    assert "<figcaption>ttft_cdf.png</figcaption>" not in page
    assert "C = 3.84 requests fit in one worker&#x27;s KV cache" in page


def test_log_axes_label_plain_ticks_as_dense_as_the_axis_allows() -> None:
    from kvroute.bench.plots import _plain_log_ticks
    from kvroute.plotting import pyplot

    plt = pyplot()
    cases = (((40, 90), 4.0, [40, 50, 60, 80, 100]),  # hits only (the old ticks: none); widened to 100
             ((28, 600), 3.4, [30, 50, 100, 200, 300, 500]),
             ((15, 1200), 3.4, [20, 50, 100, 200, 500, 1000]),
             ((15, 1200), 8.0, [20, 30, 50, 100, 200, 300, 500, 1000]),  # a wide panel: denser
             ((15, 1200), 1.2, [100, 1000]))  # a narrow one: sparser
    for (low, high), width, expected in cases:
        fig, ax = plt.subplots(figsize=(width, 2.7))
        ax.set_xscale("log")
        ax.plot([low, high], [0, 1])
        ax.set_xlim(low, high)
        _plain_log_ticks(ax.xaxis)
        ticks = list(ax.xaxis.get_major_locator()())
        assert [round(t) for t in ticks] == expected, (low, high, width)
        assert ax.xaxis.get_major_formatter()(1000.0, 0) == "1k"
        plt.close(fig)
