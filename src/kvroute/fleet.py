"""Fleets of workers for ``kvroute experiment``: emulated workers in a child process, or
servers the user already runs.

The emulated fleet runs ``kvroute emulate --workers N --port 0`` as a child process (so the
workers use the second core while the benchmark client uses the first) and reads the URLs it
prints. Closing the fleet always stops the child and its ports — on normal exit, on Ctrl-C
(the child also gets the terminal's SIGINT and stops itself) and when the child crashed.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import sys
from dataclasses import dataclass, field

from kvroute.errors import UserError

_WORKER_LINE = re.compile(r"^\s*worker (\d+): (http://\S+?)/v1\b")


@dataclass
class Fleet:
    """Worker base URLs (``http://host:port``) and, for a launched fleet, its process."""

    urls: list[str]
    process: asyncio.subprocess.Process | None = None
    log: list[str] = field(default_factory=list)

    @property
    def addresses(self) -> list[tuple[str, int]]:
        out = []
        for url in self.urls:
            host, _, port = url.removeprefix("http://").rstrip("/").rpartition(":")
            out.append((host.strip("[]"), int(port)))
        return out

    async def wait_crash(self) -> int:
        """Return the child's exit status when it exits (never returns for external URLs)."""
        if self.process is None:
            await asyncio.Event().wait()
        return await self.process.wait()

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stop the child (SIGTERM, then SIGKILL after ``timeout_s``); idempotent."""
        proc = self.process
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def launch_emulated(workers: int, emulate_args: list[str], startup_timeout_s: float = 60.0) -> Fleet:
    """Start ``workers`` emulated workers on ephemeral loopback ports.

    Args:
        emulate_args: extra ``kvroute emulate`` flags (timing, time scale, KV memory…).
    """
    cmd = [
        sys.executable, "-m", "kvroute", "emulate", "--workers", str(workers),
        "--host", "127.0.0.1", "--port", "0", "--enable-prompt-tokens-details", *emulate_args,
    ]
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    fleet = Fleet(urls=[], process=proc)
    try:
        urls = await asyncio.wait_for(_read_urls(proc, workers, fleet.log), startup_timeout_s)
    except asyncio.TimeoutError:
        await fleet.close()
        raise UserError(
            f"emulated workers did not start within {startup_timeout_s:.0f} s: "
            + " | ".join(fleet.log[-3:])
        ) from None
    except BaseException:
        await fleet.close()
        raise
    fleet.urls = urls
    # Keep draining the child's output so it never blocks on a full pipe.
    asyncio.get_running_loop().create_task(_drain(proc, fleet.log))
    return fleet


async def _read_urls(proc: asyncio.subprocess.Process, workers: int, log: list[str]) -> list[str]:
    urls: dict[int, str] = {}
    while len(urls) < workers:
        line = await proc.stdout.readline()
        if not line:
            code = await proc.wait()
            raise UserError(
                f"kvroute emulate exited with status {code} before serving: " + " | ".join(log[-3:])
            )
        text = line.decode(errors="replace").rstrip()
        log.append(text)
        m = _WORKER_LINE.match(text)
        if m:
            urls[int(m.group(1))] = m.group(2)
    return [urls[i] for i in sorted(urls)]


async def _drain(proc: asyncio.subprocess.Process, log: list[str]) -> None:
    while line := await proc.stdout.readline():
        log.append(line.decode(errors="replace").rstrip())
        del log[:-50]


def external(urls: list[str]) -> Fleet:
    """A fleet of servers the user runs (``--engine urls --worker URL``)."""
    cleaned = []
    for url in urls:
        url = url.rstrip("/").removesuffix("/v1")
        if not re.match(r"^http://[^/\s]+:\d+$", url):
            raise UserError(f"bad --worker {url!r}: expected http://HOST:PORT")
        cleaned.append(url)
    if not cleaned:
        raise UserError("--engine urls needs at least one --worker URL")
    return Fleet(urls=cleaned)
