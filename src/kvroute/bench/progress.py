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
    as lines (``kvroute.progress.sweep_progress``)."""

    def __init__(self, progress: Progress | LineProgress, console: Console, total_trials: int) -> None:
        self.progress = progress
        self.console = console
        self.sweep = progress.add_task("sweep", total=total_trials)
        self.phase_task = progress.add_task("", total=1)
        self.failed = 0
        self.refused_too_long = 0
        self._trials_started = 0

    def trial_started(self, target, workload, concurrency, trial) -> None:
        if self._trials_started:
            self.progress.advance(self.sweep)
        self._trials_started += 1
        load = f"c={concurrency}" if concurrency else "open loop"
        self.progress.update(self.sweep, description=f"{target.label} K={workload.prefixes} {load} trial {trial + 1}")

    def phase(self, description: str, total: int) -> None:
        self.progress.reset(self.phase_task, total=total, description=description)

    def request_done(self, record: RequestRecord) -> None:
        if not record.ok:
            self.failed += 1
            if refused_for_length(record):
                self.refused_too_long += 1
        self.progress.advance(self.phase_task)

    def warning(self, message: str) -> None:
        self.console.print(f"[yellow]warning:[/yellow] {message}")

    def finish(self) -> None:
        self.progress.update(self.sweep, completed=self.progress.tasks[self.sweep].total)
