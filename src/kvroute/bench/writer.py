"""What a bench run leaves in its output folder.

* ``records.jsonl`` — one line per request (warmup ones flagged), with its point's labels;
  written trial by trial, so an interrupted run keeps everything it measured;
* ``windows.jsonl`` — per trial and worker, the Prometheus counter deltas of the window;
* ``summary.json`` — the points, in the JSON contract ``kvroute sim --json`` writes;
* ``points.csv`` — one row per point (medians over trials);
* the plots (:mod:`kvroute.bench.plots`) and ``report.html``, a single page with the tables
  and the plots embedded (:mod:`kvroute.bench.report_html`).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import TYPE_CHECKING

from kvroute.bench.plots import write_plots
from kvroute.bench.report_html import write_html
from kvroute.bench.samples import PointSamples, Timelines
from kvroute.errors import UserError
from kvroute.records import MEDIAN_FIELDS, Point, write_points_json
from kvroute.report import headline

if TYPE_CHECKING:
    from kvroute.bench.runner import TrialResult

RECORDS = "records.jsonl"
WINDOWS = "windows.jsonl"
SUMMARY = "summary.json"
CSV = "points.csv"
HTML = "report.html"


class ResultsWriter:
    """Writes trials as they finish and the reports at the end (a ``runner.TrialSink``: its
    ``trial_done`` is the one the runner calls; not a subclass, so that writing a simulator's
    reports does not import the benchmark's HTTP client).

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
        self.timelines: Timelines = {}
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
        self.samples.setdefault(key, PointSamples()).add(result.records)
        if result.concurrency == 0:
            self.timelines.setdefault((target.num_workers, target.label), list(result.records))
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
        lead_html: str | None = None,
        reference_timelines: Timelines | None = None,
    ) -> list[Path]:
        """Summary JSON, CSV, plots and the HTML report; returns the paths written.

        ``lead_html``: the hit-rate table alone, to open the page (``tables_html`` then holds
        the other tables); without it ``tables_html`` holds them all and opens the page.
        ``reference_timelines``: the simulator's replay of a trace, beside the measured one."""
        summary = self.out / SUMMARY
        write_points_json(summary, points, meta)
        written = [summary, write_csv(self.out / CSV, points)]
        pngs = write_plots(self.out, points, self.samples, capacity, reference, self.timelines, reference_timelines)
        written += pngs
        written.append(write_html(self.out / HTML, meta, tables_html, pngs, lead_html,
                                  headline(points, capacity) if not self.timelines else None))
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
