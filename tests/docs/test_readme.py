"""The README's local quick start runs as written: two emulated workers publishing KV events,
the router in front, the same request twice, the router's metrics, then both stopped.

The block between ``<!-- quickstart -->`` and ``<!-- /quickstart -->`` is run by bash
unchanged except for its port numbers, each mapped to a free one (the README's 8000-8002 and
5557-5558 may be taken on the machine running the tests; consecutive ports stay consecutive,
as ``kvroute emulate --workers 2`` needs).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import ROOT

README = ROOT / "README.md"


def quickstart_block() -> str:
    text = README.read_text()
    match = re.search(r"<!-- quickstart -->\n```sh\n(.*?)```\n<!-- /quickstart -->", text, re.S)
    assert match, "README.md has no quickstart block"
    return match[1]


def _free_run(length: int) -> int:
    """The first of ``length`` consecutive free loopback ports (bound and released)."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + length > 65535:
            continue
        sockets = []
        try:
            for port in range(first, first + length):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sockets.append(s)
                s.bind(("0.0.0.0", port))
            return first
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no run of free ports")


def with_free_ports(block: str) -> str:
    """``block`` with the README's ports moved to free ones (runs kept consecutive)."""
    router, workers, events = _free_run(1), _free_run(2), _free_run(2)
    mapping = {"8000": router, "8001": workers, "8002": workers + 1, "5557": events, "5558": events + 1}
    return re.sub(r"\b(8000|8001|8002|5557|5558)\b", lambda m: str(mapping[m[1]]), block)


@pytest.mark.skipif(shutil.which("curl") is None, reason="the quick start uses curl")
def test_readme_quickstart_runs_as_written(tmp_path: Path) -> None:
    script = with_free_ports(quickstart_block())
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.Popen(["bash", "-c", "set -e\n" + script], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything the block left running
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out
    workers = re.findall(r"x-kvroute-worker: (\S+)", out)
    cached = [0 if n == "null" else int(n.rpartition(":")[2])
              for n in re.findall(r'"prompt_tokens_details":(null|\{"cached_tokens":\d+)', out)]
    assert len(workers) == 2 and len(cached) == 2, out
    assert workers[0] == workers[1], f"the second request went elsewhere: {out}"
    assert cached[0] == 0 and cached[1] >= 192, out  # the shared prompt's full blocks, found cached
    decisions = [float(n) for n in re.findall(r"kvroute_router_decisions_total\{[^}]*\} (\S+)", out)]
    events = [float(n) for n in re.findall(r"kvroute_router_kv_events_total\{[^}]*\} (\S+)", out)]
    assert sum(decisions) >= 2 and sum(events) > 0, out
    assert "kvroute serve: stopped" in out and "kvroute emulate: stopped" in out, out
