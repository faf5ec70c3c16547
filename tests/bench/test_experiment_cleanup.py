"""`kvroute experiment` leaves no process and no listening port behind: after a normal exit,
after Ctrl-C, after a worker crashes mid-run, and after it is killed itself.

Every process the experiment starts inherits a unique environment tag, so the test finds them
(and the TCP ports they listen on) through /proc whatever their names or ports are.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")

_TAG_VAR = "KVROUTE_CLEANUP_TEST_TAG"


def _tagged_pids(tag: str) -> set[int]:
    """PIDs of live processes whose environment carries ``tag``."""
    needle = f"{_TAG_VAR}={tag}".encode()
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and needle in env.split(b"\0"):
            pids.add(int(entry.name))
    return pids


def _listeners(pids: set[int]) -> set[tuple[int, str]]:
    """``(port, socket inode)`` of the TCP sockets in LISTEN state owned by any of ``pids``:
    the inode tells the socket apart from a later one of another process on the same port."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    return {(port, inode) for port, inode in _listen_table() if inode in inodes}


def _listen_table() -> list[tuple[int, str]]:
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                rows.append((int(fields[1].rsplit(":", 1)[1], 16), fields[9]))
    return rows


def _start(tmp_path: Path, tag: str, *extra: str) -> subprocess.Popen:
    env = {**os.environ, _TAG_VAR: tag, "COLUMNS": "120"}
    cmd = [
        sys.executable, "-m", "kvroute", "experiment", "--workers", "2", "--prefixes", "2",
        "--concurrency", "2", "--trials", "1", "--timing", "instant",
        "--out", str(tmp_path / "out"), *extra,
    ]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )


def _wait_for_children(proc: subprocess.Popen, tag: str, timeout_s: float = 60.0) -> set[tuple[int, str]]:
    """Wait until the experiment's workers listen on ports; return their listeners."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
        children = _tagged_pids(tag) - {proc.pid}
        listeners = _listeners(children)
        if len(listeners) >= 2:
            return listeners
        time.sleep(0.2)
    raise AssertionError("the experiment's workers never started listening")


def _assert_nothing_left(tag: str, listeners: set[tuple[int, str]]) -> None:
    deadline = time.monotonic() + 10.0
    while _tagged_pids(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _tagged_pids(tag)
    assert not left, f"processes left behind: {left}"
    # The sockets themselves, not their port numbers: once released, a port may be taken by
    # any process on the machine (a busy one runs other suites beside this one).
    still = set(_listen_table()) & listeners
    assert not still, f"ports still listening: {sorted(port for port, _ in still)}"


def test_normal_exit_leaves_nothing(tmp_path):
    tag = uuid.uuid4().hex
    proc = _start(tmp_path, tag, "--requests", "400", "--time-scale", "1")
    listeners = _wait_for_children(proc, tag)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out.decode(errors="replace")
    _assert_nothing_left(tag, listeners)
    assert (tmp_path / "out").is_dir()


def test_ctrl_c_leaves_nothing(tmp_path):
    tag = uuid.uuid4().hex
    # Many requests at real-time GPU timing: still running when interrupted.
    proc = _start(tmp_path, tag, "--requests", "5000", "--timing", "reference-gpu", "--time-scale", "1")
    listeners = _wait_for_children(proc, tag)
    time.sleep(1.0)
    # Ctrl-C in a terminal signals the whole foreground process group.
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    text = out.decode(errors="replace")
    assert proc.returncode != 0
    assert "Traceback" not in text, text
    _assert_nothing_left(tag, listeners)


def test_worker_crash_leaves_nothing(tmp_path):
    tag = uuid.uuid4().hex
    proc = _start(tmp_path, tag, "--requests", "5000", "--timing", "reference-gpu", "--time-scale", "1")
    listeners = _wait_for_children(proc, tag)
    time.sleep(1.0)
    workers = _tagged_pids(tag) - {proc.pid}
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    text = out.decode(errors="replace")
    assert proc.returncode != 0
    assert "Traceback" not in text, text
    _assert_nothing_left(tag, listeners)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux's")
def test_killed_experiment_leaves_no_workers(tmp_path):
    """SIGKILL (an OOM kill, a `kill -9`) gives the experiment no chance to clean up: the
    workers it started must end on their own when it dies."""
    tag = uuid.uuid4().hex
    proc = _start(tmp_path, tag, "--requests", "5000", "--timing", "reference-gpu", "--time-scale", "1")
    listeners = _wait_for_children(proc, tag)
    os.kill(proc.pid, signal.SIGKILL)  # the experiment alone, not its process group
    proc.communicate(timeout=30)
    _assert_nothing_left(tag, listeners)


def test_sigterm_is_handled_like_ctrl_c(tmp_path):
    """`kill` (or a job scheduler, a container stop) signals the experiment alone: it closes
    its workers and still writes the tables and reports of what was measured."""
    tag = uuid.uuid4().hex
    # Two concurrencies: signalled as the first point's trial ends, during the second one's.
    proc = _start(tmp_path, tag, "--requests", "2000", "--concurrency", "1,2", "--topology", "service")
    listeners = _wait_for_children(proc, tag)
    out_dir = tmp_path / "out"
    deadline = time.monotonic() + 120
    while not (out_dir / "windows.jsonl").exists():  # written when the first trial ends
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read().decode(errors="replace")
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    text = out.decode(errors="replace")
    assert proc.returncode == 130, text
    assert "Traceback" not in text, text
    assert "stopped early" in text and "windows.jsonl" in text, text
    for name in ("summary.json", "points.csv", "report.html", "records.jsonl"):
        assert (out_dir / name).exists(), name
    _assert_nothing_left(tag, listeners)
