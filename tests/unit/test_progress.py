"""Progress when output is not a terminal: lines saying what is done and what is left, a
heartbeat while nothing finishes, and a real experiment piped through ``cat`` printing them."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import time

from rich.console import Console

from kvroute.progress import LineProgress, sweep_progress


def _piped_console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=160, force_terminal=False), out


def test_a_console_that_is_no_terminal_gets_lines_not_bars() -> None:
    console, _ = _piped_console()
    assert isinstance(sweep_progress(console, "bench"), LineProgress)


def test_lines_say_what_finished_how_many_are_left_and_a_heartbeat_fills_the_silences() -> None:
    console, out = _piped_console()
    with LineProgress(console, "experiment", heartbeat_s=0.3, min_gap_s=0.0) as progress:
        sweep = progress.add_task("sweep", total=3)
        phase = progress.add_task("", total=1)
        progress.update(sweep, description="service K=2 c=4 trial 1")
        progress.reset(phase, total=200, description="measure")
        for _ in range(120):
            progress.advance(phase)
        time.sleep(1.5)  # a long trial: heartbeats, with the phase's state
        progress.advance(sweep)
        progress.update(sweep, description="router K=2 c=4 trial 1")
        progress.advance(sweep)
        progress.update(sweep, completed=3)
    lines = out.getvalue().splitlines()
    assert any(re.fullmatch(r"experiment: working on service K=2 c=4 trial 1 \(measure 120/200\); 0/3 done, \d+ s so far",
                            line) for line in lines), lines
    done = [line for line in lines if re.match(r"experiment: \d+/3 done", line)]
    assert re.fullmatch(r"experiment: 1/3 done \(last: service K=2 c=4 trial 1\), \d+ s so far, ~\d+ s left",
                        done[0]), done
    assert done[1].startswith("experiment: 2/3 done (last: router K=2 c=4 trial 1)")
    assert done[-1].startswith("experiment: 3/3 done") and "left" not in done[-1]


def test_a_piped_experiment_prints_a_line_per_finished_trial(tmp_path) -> None:
    """``kvroute experiment ... | cat``: the trials' lines come before the tables."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvroute", "experiment", "--workers", "2", "-K", "2,4", "-c", "2",
         "--requests", "20", "--trials", "1", "--time-scale", "20", "--topology", "service",
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert re.search(r"^experiment: 2/2 done \(last: service K=4 c=2 trial 1\)", out, re.M), out
    assert out.index("experiment: 2/2 done") < out.index("1. Request hit rate")


def test_a_trial_counts_as_done_when_its_last_measured_request_is() -> None:
    """Not when the next trial starts: between two fleet sizes that is a fleet's start-up later."""
    from types import SimpleNamespace

    from kvroute.bench.progress import ProgressHooks

    console, out = _piped_console()
    target, workload = SimpleNamespace(label="router"), SimpleNamespace(prefixes=24)
    record = SimpleNamespace(ok=True)
    with LineProgress(console, "experiment", heartbeat_s=60, min_gap_s=0.0) as progress:
        hooks = ProgressHooks(progress, console, total_trials=2)
        hooks.trial_started(target, workload, 8, 0)
        hooks.phase("warmup", 2)
        hooks.request_done(record)
        hooks.request_done(record)
        hooks.phase("measure", 3)
        for _ in range(3):
            hooks.request_done(record)
        assert "experiment: 1/2 done (last: router K=24 c=8 trial 1)" in out.getvalue()
        hooks.trial_started(target, workload, 8, 1)
        assert "2/2" not in out.getvalue()
        hooks.finish()
    assert "experiment: 2/2 done (last: router K=24 c=8 trial 2)" in out.getvalue()
