"""Progress of long commands: rich bars on a terminal, plain lines elsewhere.

On a terminal ``kvroute experiment``, ``bench`` and ``sim`` draw rich's bars, redrawn in place
and cleared when done. In a pipe, a file, CI or a Kubernetes Job's log those bars print
nothing at all, so a 20-minute sweep looked hung. :class:`LineProgress` takes the bars' place
there: the same calls, written as lines that say what is done and what is left: one when a
unit of the first task (a trial, a simulated point) finishes, at most one every
``min_gap_s``, and a heartbeat every ``heartbeat_s`` while nothing else was written (a fleet
starting, a long trial), so a reader never waits more than that for a line.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

#: Seconds between heartbeat lines while no other progress line was written.
HEARTBEAT_S = 20.0
#: Fewest seconds between two lines for finished units (a fast sweep finishes many a second).
MIN_GAP_S = 2.0


def sweep_progress(console: Console, title: str = "") -> Progress | LineProgress:
    """Bars on a terminal (description, bar, done/total, elapsed; cleared when finished),
    else :class:`LineProgress` writing to ``console``. ``title`` prefixes every description."""
    if console.is_terminal:
        prefix = f"[bold]{title}[/bold] " if title else ""
        return Progress(TextColumn(prefix + "{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=True)
    return LineProgress(console, title)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


@dataclass
class LineTask:
    """One task's state, as rich's ``Task`` exposes it (``total``, ``completed``)."""

    description: str
    total: float | None
    completed: float = 0.0

    def state(self) -> str:
        if self.total is None:
            return self.description
        return f"{self.description} {self.completed:.0f}/{self.total:.0f}".strip()


class LineProgress:
    """rich ``Progress``'s calls used by kvroute (``add_task``, ``update``, ``advance``,
    ``reset``, ``remove_task``, ``tasks``; a context manager), written as lines.

    The first task added is the sweep: each time it advances a line says how many of its units
    are done, what just finished, the time so far and an estimate of the time left. Between
    those a heartbeat every ``heartbeat_s`` gives every task's state (``measure 120/200``).
    """

    def __init__(self, console: Console, title: str = "", heartbeat_s: float = HEARTBEAT_S,
                 min_gap_s: float = MIN_GAP_S) -> None:
        self.console = console
        self.title = title
        self.heartbeat_s = heartbeat_s
        self.min_gap_s = min_gap_s
        self.tasks: dict[int, LineTask] = {}
        self._next_id = 0
        self._sweep: int | None = None
        self._lock = threading.RLock()
        self._started = time.monotonic()
        self._last_line = self._started
        self._last_done_line = self._started - min_gap_s
        self._last_reported = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> LineProgress:
        self._started = self._last_line = time.monotonic()
        self._last_done_line = self._started - self.min_gap_s
        self._thread = threading.Thread(target=self._heartbeat, name="kvroute-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            sweep = self.tasks.get(self._sweep) if self._sweep is not None else None
            if sweep is not None and sweep.completed > self._last_reported:
                self._write(self._sweep_line(sweep, finished=""))

    # rich Progress's interface
    def add_task(self, description: str, total: float | None = 100.0, **_: object) -> int:
        with self._lock:
            task_id = self._next_id
            self._next_id += 1
            self.tasks[task_id] = LineTask(description, total)
            if self._sweep is None:
                self._sweep = task_id
            return task_id

    def update(self, task_id: int, *, description: str | None = None, total: float | None = None,
               completed: float | None = None, advance: float | None = None, **_: object) -> None:
        with self._lock:
            task = self.tasks[task_id]
            finished = task.description
            if total is not None:
                task.total = total
            if completed is not None:
                task.completed = completed
            if advance:
                task.completed += advance
            if task_id == self._sweep:
                self._report(task, finished)
            if description is not None:
                task.description = description

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def reset(self, task_id: int, *, total: float | None = None, description: str | None = None,
              **_: object) -> None:
        with self._lock:
            task = self.tasks[task_id]
            task.completed = 0
            if total is not None:
                task.total = total
            if description is not None:
                task.description = description

    def remove_task(self, task_id: int) -> None:
        with self._lock:
            self.tasks.pop(task_id, None)

    # lines
    def _report(self, sweep: LineTask, finished: str) -> None:
        """A line for finished units of the sweep, unless such a line was written under
        ``min_gap_s`` ago (the next line or the heartbeat then covers them)."""
        if sweep.completed <= self._last_reported:
            return
        if time.monotonic() - self._last_done_line < self.min_gap_s and sweep.completed < (sweep.total or 0):
            return
        self._last_done_line = time.monotonic()
        self._write(self._sweep_line(sweep, finished))

    def _sweep_line(self, sweep: LineTask, finished: str) -> str:
        self._last_reported = sweep.completed
        elapsed = time.monotonic() - self._started
        line = f"{sweep.completed:.0f}/{sweep.total:.0f} done" if sweep.total else f"{sweep.completed:.0f} done"
        if finished:
            line += f" (last: {finished})"
        line += f", {_duration(elapsed)} so far"
        if sweep.total and 0 < sweep.completed < sweep.total:
            left = elapsed / sweep.completed * (sweep.total - sweep.completed)
            line += f", ~{_duration(left)} left"
        return line

    def _heartbeat(self) -> None:
        while not self._stop.wait(1.0):
            with self._lock:
                if time.monotonic() - self._last_line < self.heartbeat_s or not self.tasks:
                    continue
                self._write(self._working_line())

    def _working_line(self) -> str:
        """What is running now: the sweep's current unit with the other tasks' states, and
        how far the sweep is."""
        sweep = self.tasks.get(self._sweep) if self._sweep is not None else None
        others = [t.state() for i, t in self.tasks.items() if i != self._sweep and (t.description or t.total)]
        line = f"working on {sweep.description}" if sweep and sweep.description else "working"
        if others:
            line += f" ({'; '.join(others)})"
        if sweep is not None and sweep.total:
            line += f"; {sweep.completed:.0f}/{sweep.total:.0f} done"
        return line + f", {_duration(time.monotonic() - self._started)} so far"

    def _write(self, line: str) -> None:
        self._last_line = time.monotonic()
        prefix = f"{self.title}: " if self.title else ""
        self.console.print(prefix + line, highlight=False, markup=False, soft_wrap=True)
