"""The README's real-vLLM command, run exactly as a new user types it (the ``vllm`` tier).

``kvroute experiment --engine vllm --workers 2 --quick --requests 60`` with the default
``--out`` (a relative ``kvroute-results/experiment-<time>`` folder) in a fresh working
directory: the command once failed there because vLLM's scratch and IPC paths were given
relative to kvroute's directory while vLLM ran in its own, or were too long for a Unix socket.
It starts its own two servers (about 2 minutes on CPU) and measures 12 points of 60 requests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvroute.vllm_setup import VllmInstall

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

README_COMMAND = ["experiment", "--engine", "vllm", "--workers", "2", "--quick", "--requests", "60"]


def test_readme_real_vllm_command_runs_as_written(tmp_path, capsys):
    if (why := VllmInstall.at().missing()) is not None:
        pytest.skip(f"real vLLM tier: {why}")
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "kvroute", *README_COMMAND], cwd=tmp_path, capture_output=True, text=True,
        timeout=3600, env={**os.environ, "COLUMNS": "160"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Traceback" not in out and "1. Request hit rate" in out, out[-4000:]
    (run,) = (tmp_path / "kvroute-results").iterdir()
    for name in ("summary.json", "report.html", "records.jsonl", "windows.jsonl"):
        assert (run / name).exists(), name
    # The servers' logs stay under --out; their scratch folders are gone.
    logs = sorted(run.glob("vllm/W2/worker-*/vllm.log"))
    assert len(logs) == 2 and not list(run.glob("vllm/W2/worker-*/scratch"))
    with capsys.disabled():
        print(f"\nREADME real-vLLM command: {time.monotonic() - started:.0f} s, rc 0, results in {run}")
