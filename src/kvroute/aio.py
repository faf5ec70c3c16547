"""Running kvroute's asyncio entry points, and a cheap timeout for the hot paths."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on uvloop when it is installed (faster HTTP and relaying), else on
    asyncio's own loop (uvloop is not available on Windows)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


class Terminated(Exception):
    """The run was stopped by SIGTERM (see :func:`stop_on_sigterm`)."""


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Within the block, SIGTERM (``kill``, a job scheduler, a container stop) cancels the
    current task as Ctrl-C does, so its ``finally`` blocks close what it started; the block
    then raises :class:`Terminated`. Use it in the main task, where Ctrl-C's cancel lands too.

    Not ``signal.signal``: a handler that raises in the middle of a loop callback breaks the
    transport it interrupts, and a job started in the background with ``&`` ignores SIGINT,
    so re-sending SIGTERM as SIGINT would do nothing there.
    """
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None, "stop_on_sigterm() needs a running task"
    received = False

    def on_sigterm() -> None:
        nonlocal received
        received = True
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        yield
    except asyncio.CancelledError:
        if received:
            task.uncancel()
            raise Terminated() from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


class WaitTimeout:
    """Cancels the task that creates it once one wait lasts ``limit_s`` seconds: what
    ``asyncio.timeout(limit_s)`` around each wait does, for a fraction of its cost.

    One timer for the task's whole life, re-armed only when it fires early; a wait is marked
    with :meth:`waiting` and :meth:`done_waiting` (a float and a flag each). Time outside the
    marked waits never counts. Created with ``waiting=True``, everything until the first
    :meth:`done_waiting` is one wait: a plain deadline.

    On CancelledError, :meth:`expired` tells whether the cancel was this timeout's (it is then
    taken back, and the task goes on to report the timeout) or someone else's (Ctrl-C, a
    client that left), which must propagate. Call :meth:`stop` when done.

    Used where a timeout scope per wait shows in the CPU profile: ``asyncio.timeout`` costs
    ~4 µs per use under uvloop, and the router's relay waits once per streamed token.
    """

    __slots__ = ("_cancelling", "_fired", "_handle", "_limit_s", "_loop", "_since", "_task", "_waiting")

    def __init__(self, limit_s: float, waiting: bool = False) -> None:
        self._limit_s = limit_s
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._cancelling = self._task.cancelling()
        self._since = self._loop.time()
        self._waiting = waiting
        self._fired = False
        self._handle = self._loop.call_at(self._since + limit_s, self._check)

    def waiting(self) -> None:
        """A wait begins."""
        self._since = self._loop.time()
        self._waiting = True

    def done_waiting(self) -> None:
        """The wait is over."""
        self._waiting = False

    def _check(self) -> None:
        now = self._loop.time()
        if not self._waiting:
            self._handle = self._loop.call_at(now + self._limit_s, self._check)
        elif now >= self._since + self._limit_s:
            self._fired = True
            self._task.cancel()
        else:
            self._handle = self._loop.call_at(self._since + self._limit_s, self._check)

    def expired(self) -> bool:
        """After a CancelledError: True if it came from this timeout alone (it is then taken
        back), False if it must propagate."""
        if not self._fired:
            return False
        self._fired = False
        # As asyncio.timeout does: only a cancel count back at its level means nobody else
        # asked for the task to stop meanwhile.
        return self._task.uncancel() <= self._cancelling

    def stop(self) -> None:
        self._handle.cancel()
