"""The reference experiment's four tables, rendered the same way for sim, bench and experiment.

1. Request hit rate by K and topology (at one concurrency), beside the formula min(1, C/K)
   and the routing bound min(1, W·C/K), and the two token-level hit measures.
2. TTFT split by hit and miss (p50/p90 with counts) at the lowest concurrency, largest fleet.
3. Overall TTFT p50/p99 by K and concurrency.
4. Throughput (requests/s) by K and concurrency.

A "topology" is a (workers, policy) pair: ``6w random``, ``3w service``, ``6w router``…
``reference`` points (e.g. the simulator's prediction for a measured run, labelled with the
measured topology's policy name) are shown beside the measured ones when given.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

from rich.console import Console
from rich.table import Table

from kvroute.records import Point, busiest_share


def topology(point: Point) -> str:
    return f"{point.workers}w {point.policy}"


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "—" if v is None else format(v, spec)


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.1f}%"


#: Width of the tables when the output is not a terminal (a file, a pipe, CI logs): rich would
#: otherwise wrap them at 80 columns.
PIPED_WIDTH = 160


def output_console() -> Console:
    """The console the commands print their tables on: the terminal's width on a terminal,
    else ``$COLUMNS`` or :data:`PIPED_WIDTH`, so saved output keeps each table row on one line."""
    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return Console()
    return Console(width=PIPED_WIDTH)


def _pick_concurrency(points: list[Point], preferred: int) -> int:
    levels = sorted({p.concurrency for p in points})
    return preferred if preferred in levels else levels[len(levels) // 2]


def _index(points: Iterable[Point]) -> dict[tuple[int, int, int, str], Point]:
    return {(p.workers, p.prefixes, p.concurrency, p.policy): p for p in points}


def hit_rate_table(
    points: list[Point],
    capacity_requests: float | None,
    concurrency: int = 8,
    reference: list[Point] | None = None,
    reference_label: str = "sim",
    zipf_alpha: float = 0.0,
) -> Table:
    """Table 1. The formulas' columns hold for equally popular prefixes only: under Zipf
    popularity (``zipf_alpha`` > 0) they are left out and the caption says why."""
    c = _pick_concurrency(points, concurrency)
    formulas = capacity_requests is not None and not zipf_alpha
    chosen = [p for p in points if p.concurrency == c]
    topologies = sorted({(p.workers, p.policy) for p in chosen}, key=lambda t: (-t[0], t[1]))
    fleet_sizes = sorted({w for w, _ in topologies}, reverse=True)
    ref = _index(reference or [])
    table = Table(title=f"1. Request hit rate by K and topology (concurrency {c}, median of trials)")
    table.add_column("K", justify="right")
    for w, pol in topologies:
        table.add_column(f"{w}w {pol}", justify="right")
        if reference:
            table.add_column(f"{reference_label}", justify="right", style="dim")
    if formulas:
        table.add_column("min(1, C/K)", justify="right", style="cyan")
        for w in fleet_sizes:
            table.add_column(f"min(1, {w}·C/K)", justify="right", style="cyan")
    by = _index(chosen)
    above_bound = False
    for k in sorted({p.prefixes for p in chosen}):
        row = [str(k)]
        for w, pol in topologies:
            p = by.get((w, k, c, pol))
            cell = _pct(p.median("request_hit_rate")) if p else "—"
            if p and formulas and (p.median("request_hit_rate") or 0) > min(1.0, w * capacity_requests / k) + 0.0005:
                above_bound = True
                cell += "*"
            row.append(cell)
            if reference:
                r = ref.get((w, k, c, pol))
                row.append(_pct(r.median("request_hit_rate")) if r else "—")
        if formulas:
            row.append(_pct(min(1.0, capacity_requests / k)))
            row.extend(_pct(min(1.0, w * capacity_requests / k)) for w in fleet_sizes)
        table.add_row(*row)
    notes = []
    if capacity_requests is not None:
        notes.append(f"C = {capacity_requests:.2f}: the requests one worker's KV cache holds (its blocks ÷ a "
                     "request's prompt and output blocks); K = the number of distinct shared prefixes")
    if zipf_alpha:
        notes.append(f"min(1, C/K) and min(1, W·C/K) assume equally popular prefixes: not shown for Zipf "
                     f"α = {zipf_alpha:g} (kvroute predict --zipf {zipf_alpha:g} gives Che's LRU approximation)")
    if above_bound:
        notes.append("* above min(1, W·C/K): C counts a whole request's blocks, but only the shared prefix is "
                     "reused; a worker fits more prefixes than requests, and retention keeps them while each "
                     "request's own blocks go first")
    notes.append(hit_measures_agreement(points))
    table.caption = "\n".join(notes)
    return table


def headline(points: list[Point], capacity_requests: float | None = None, concurrency: int = 8) -> str | None:
    """The answer in one sentence, for the top of a report: each topology's request hit rate
    at the largest fleet and K measured (at ``concurrency``, else the middle level), beside the
    formulas when the prefixes are equally popular, e.g. "At K = 24 on 6 workers (concurrency
    8), 95.4% of requests hit the prefix cache through router and 16.9% through service"."""
    closed = [p for p in points if p.concurrency > 0 and p.median("request_hit_rate") is not None]
    if not closed:
        return None
    c = _pick_concurrency(closed, concurrency)
    w = max(p.workers for p in closed if p.concurrency == c)
    k = max(p.prefixes for p in closed if (p.concurrency, p.workers) == (c, w))
    chosen = sorted((p for p in closed if (p.concurrency, p.workers, p.prefixes) == (c, w, k)),
                    key=lambda p: -(p.median("request_hit_rate") or 0))
    rates = [f"{_pct(p.median('request_hit_rate'))} through {p.policy}" for p in chosen]
    said = rates[0] if len(rates) == 1 else ", ".join(rates[:-1]) + f" and {rates[-1]}"
    said = said.replace(" through", " of requests hit the prefix cache through", 1)
    line = f"At K = {k} on {w} workers (concurrency {c}), {said}"
    if capacity_requests is not None:
        line += (f"; min(1, C/K) = {_pct(min(1.0, capacity_requests / k))}, the routing bound "
                 f"min(1, {w}·C/K) = {_pct(min(1.0, w * capacity_requests / k))} (uniform popularity)")
    return line + "."


def hit_measures_agreement(points: list[Point]) -> str:
    """How far the token hit ratio from per-request ``cached_tokens`` is from the one from the
    workers' Prometheus counters (docs/experiment.md rule 4), over every trial."""
    diffs = [
        abs(t.metrics_token_hit_rate - t.token_hit_rate)
        for p in points
        for t in p.trials
        if t.metrics_token_hit_rate is not None
    ]
    if not diffs:
        if any(t.refreshes for p in points for t in p.trials):
            return ("token hit ratio: per-request measure only (the simulated workers' counters count "
                    "retention's refreshes too, so they are not compared)")
        return "token hit ratio: per-request measure only (no worker metrics scraped)"
    refreshed = any(t.refreshes for p in points for t in p.trials if t.metrics_token_hit_rate is not None)
    left_out = sum(1 for p in points for t in p.trials if t.refreshes and t.metrics_token_hit_rate is None)
    return (
        f"token hit ratio, per-request usage vs worker counters: max |Δ| = {max(diffs):.4f} "
        f"over {len(diffs)} trial{'s' if len(diffs) != 1 else ''}"
        + (" (the router's retention refreshes, as it measured them, taken out of the workers' counters)"
           if refreshed else "")
        + (f"; {left_out} trial{'s' if left_out != 1 else ''} with retention's refreshes not compared (the simulated workers' "
           "counters count the refreshes too)" if left_out else "")
    )


def ttft_split_table(points: list[Point]) -> Table:
    c = min(p.concurrency for p in points)
    w = max(p.workers for p in points)
    chosen = sorted(
        (p for p in points if p.concurrency == c and p.workers == w),
        key=lambda p: (p.policy, p.prefixes),
    )
    table = Table(title=f"2. TTFT on hit vs miss, ms (concurrency {c}, {w} workers)")
    for name in ("topology", "K", "hit p50", "hit p90", "hits", "miss p50", "miss p90", "misses"):
        table.add_column(name, justify="right" if name != "topology" else "left")
    for p in chosen:
        hits = p.median("hits")
        requests = p.median("requests")
        misses = None if hits is None or requests is None else requests - hits
        table.add_row(
            topology(p),
            str(p.prefixes),
            _fmt(p.median("ttft_hit_p50_ms")),
            _fmt(p.median("ttft_hit_p90_ms")),
            _fmt(hits, ".0f"),
            _fmt(p.median("ttft_miss_p50_ms")),
            _fmt(p.median("ttft_miss_p90_ms")),
            _fmt(misses, ".0f"),
        )
    return table


def _by_concurrency_table(points: list[Point], title: str, cell) -> Table:
    levels = sorted({p.concurrency for p in points})
    table = Table(title=title)
    table.add_column("topology")
    table.add_column("K", justify="right")
    for c in levels:
        table.add_column(f"c={c}", justify="right")
    by = _index(points)
    for w, pol in sorted({(p.workers, p.policy) for p in points}, key=lambda t: (-t[0], t[1])):
        for k in sorted({p.prefixes for p in points if (p.workers, p.policy) == (w, pol)}):
            row = [f"{w}w {pol}", str(k)]
            for c in levels:
                p = by.get((w, k, c, pol))
                row.append(cell(p) if p else "—")
            table.add_row(*row)
    return table


def _ttft_cell(p: Point) -> str:
    return f"{_fmt(p.median('ttft_p50_ms'), '.0f')} / {_fmt(p.median('ttft_p99_ms'), '.0f')}"


def ttft_table(points: list[Point]) -> Table:
    return _by_concurrency_table(
        points,
        "3. TTFT p50 / p99, ms, by K and concurrency",
        _ttft_cell,
    )


def throughput_table(points: list[Point]) -> Table:
    return _by_concurrency_table(
        points,
        "4. Throughput, requests/s",
        lambda p: _fmt(p.median("throughput_rps")),
    )


def failures_line(points: list[Point]) -> str | None:
    failed = sum(int(p.median("failed") or 0) for p in points)
    if not failed:
        return None
    worst = max(points, key=lambda p: p.median("failed") or 0)
    return (
        f"{failed} failed requests (median per point, counted as misses); worst: "
        f"{topology(worst)} K={worst.prefixes} c={worst.concurrency}"
    )


def print_tables(
    points: list[Point],
    capacity_requests: float | None,
    console: Console | None = None,
    reference: list[Point] | None = None,
    reference_label: str = "sim",
    zipf_alpha: float = 0.0,
) -> None:
    """Print the four tables (and a failure summary when requests failed)."""
    console = console or Console()
    if not points:
        console.print("no points to report")
        return
    print_hit_rate_table(points, capacity_requests, console, reference, reference_label, zipf_alpha)
    print_latency_tables(points, console)


def print_hit_rate_table(
    points: list[Point],
    capacity_requests: float | None,
    console: Console,
    reference: list[Point] | None = None,
    reference_label: str = "sim",
    zipf_alpha: float = 0.0,
) -> None:
    """Table 1, the answer: the request hit rate by K and topology, its notes as lines below it
    (as a caption they would wrap to the table's width, not the console's)."""
    table = hit_rate_table(points, capacity_requests, reference=reference, reference_label=reference_label,
                           zipf_alpha=zipf_alpha)
    notes, table.caption = table.caption, None
    console.print(table)
    for note in str(notes or "").splitlines():
        console.print(note, highlight=False)


def trace_replay_table(points: list[Point], reference: list[Point] | None = None,
                       reference_label: str = "sim") -> Table:
    """Table 1 of a trace replay (one open-loop point per fleet size and topology): the token
    hit ratio from the responses and from the workers' counters, the simulator's replay of the
    same requests beside it, the request hit rate, TTFT and how even the load was. The token
    ratio is the figure: in a trace every request of a session hits its shared head."""
    ref = {(r.workers, r.policy): r for r in reference or []}
    table = Table(title="1. Trace replay by topology (open loop, the trace's own timestamps)")
    columns = ["topology", "requests", "failed", "token hit", "counters", reference_label, "request hit",
               reference_label, "TTFT p50 / p99 ms", reference_label, "busiest ÷ mean"]
    for name in columns:
        table.add_column(name, justify="left" if name == "topology" else "right")
    for p in sorted(points, key=lambda p: (-p.workers, p.policy)):
        r = ref.get((p.workers, p.policy))
        # Behind a Service no response names its worker: no counts, no figure.
        busiest = busiest_share(p.trials[0], p.workers) if p.trials and p.trials[0].worker_requests else None
        table.add_row(
            topology(p), _fmt(p.median("requests"), ".0f"), _fmt(p.median("failed"), ".0f"),
            _pct(p.median("token_hit_rate")), _pct(p.median("metrics_token_hit_rate")),
            _pct(r.median("token_hit_rate")) if r else "—",
            _pct(p.median("request_hit_rate")), _pct(r.median("request_hit_rate")) if r else "—",
            _ttft_cell(p), _ttft_cell(r) if r else "—", _fmt(busiest, ".2f"),
        )
    return table


def print_trace_tables(points: list[Point], console: Console, reference: list[Point] | None = None) -> None:
    """A trace replay's tables: the replay by topology, the two hit measures' agreement, TTFT
    on hit vs miss, and the failures."""
    console.print(trace_replay_table(points, reference))
    console.print(hit_measures_agreement(points))
    print_latency_tables(points, console, by_load=False)


def print_latency_tables(points: list[Point], console: Console, by_load: bool = True) -> None:
    """Tables 2-4 (TTFT on hit vs miss, TTFT by concurrency, throughput) and the failures;
    ``by_load`` False leaves out the two by K and concurrency (a trace replay has one point)."""
    console.print(ttft_split_table(points))
    if by_load:
        console.print(ttft_table(points))
        console.print(throughput_table(points))
    line = failures_line(points)
    if line:
        console.print(f"[red]{line}[/red]")
