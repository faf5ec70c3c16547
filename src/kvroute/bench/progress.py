"""Progress of the bench's sweeps (``kvroute bench`` and ``kvroute experiment``)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import Progress

from kvroute.bench.runner import SweepHooks
from kvroute.progress import LineProgress
from kvroute.records import RequestRecord

#: What vLLM (and the emulator) answer for a prompt past max-model-len, in its several versions.
_TOO_LONG = ("maximum context length", "max_model_len", "maximum model length", "longer than the maximum")


def refused_for_length(record: RequestRecord) -> bool:
    """Whether a failed request was refused for the server's max-model-len (an HTTP 400)."""
    error = (record.error or "").lower()
    return record.status == 400 and any(marker in error for marker in _TOO_LONG)


class ProgressHooks(SweepHooks):
    """The whole sweep and the phase (warmup / measure) of the current trial, as rich bars or
    as lines (``kvroute.progress.sweep_progress``). A trial counts as done when its last
    measured request is (not when the next trial starts: between two fleets that is a fleet's
    start-up later)."""

    def __init__(self, progress: Progress | LineProgress, console: Console, total_trials: int) -> None:
        self.progress = progress
        self.console = console
        self.sweep = progress.add_task("sweep", total=total_trials)
        self.phase_task = progress.add_task("", total=1)
        self.failed = 0
        self.refused_too_long = 0
        self._measuring = False
        self._measure_left = 0
        self._trial_open = False

    def trial_started(self, target, workload, concurrency, trial) -> None:
        self._close_trial()  # one that ended without its window's last request (interrupted)
        self._trial_open = True
        load = f"c={concurrency}" if concurrency else "open loop"
        self.progress.update(self.sweep, description=f"{target.label} K={workload.prefixes} {load} trial {trial + 1}")

    def phase(self, description: str, total: int) -> None:
        self._measuring = description == "measure"
        self._measure_left = total
        self.progress.reset(self.phase_task, total=total, description=description)

    def request_done(self, record: RequestRecord) -> None:
        if not record.ok:
            self.failed += 1
            if refused_for_length(record):
                self.refused_too_long += 1
        self.progress.advance(self.phase_task)
        if self._measuring:
            self._measure_left -= 1
            if self._measure_left <= 0:
                self._close_trial()

    def _close_trial(self) -> None:
        if self._trial_open:
            self._trial_open = False
            self._measuring = False
            self.progress.advance(self.sweep)

    def warning(self, message: str) -> None:
        self.console.print(f"[yellow]warning:[/yellow] {message}")

    def finish(self) -> None:
        self._trial_open = False
        self.progress.update(self.sweep, completed=self.progress.tasks[self.sweep].total)
