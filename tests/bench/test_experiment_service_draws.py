"""The Service topology sees the simulator's random draws in every trial, the first one
included: the bench asks whether its target is a kvroute router (a GET through the balancer,
which takes one of its draws) before the trials, not inside the first one. That GET used to
come between the first trial's warmup and its window, shifting every draw of the window by
one, so the first point measured e.g. 17.7% beside the simulator's 16.9%."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_every_service_trial_hits_exactly_as_its_prediction(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "kvroute", "experiment", "--topology", "service", "--workers", "3", "-K", "12",
         "-c", "1", "--requests", "60", "--trials", "2", "--time-scale", "20", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    measured = summary["points"]
    predicted = {(p["workers"], p["prefixes"], p["concurrency"]): p for p in summary["meta"]["sim"]["points"]}
    for point in measured:
        sim = predicted[(point["workers"], point["prefixes"], point["concurrency"])]
        assert [t["hits"] for t in point["per_trial"]] == [t["hits"] for t in sim["per_trial"]]
