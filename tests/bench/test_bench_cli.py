"""`kvroute bench` as a command: flags, errors, output files and Ctrl-C."""

from __future__ import annotations

import asyncio
import csv
import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from kvroute.cli import main
from kvroute.emulator import EmulatorConfig, start_workers


class _WorkersInThread:
    """Emulated workers on their own event loop in a thread, so the command under test can
    run its own loop (in-process) or be a separate process."""

    def __init__(self, n: int, **config) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        cfg = EmulatorConfig.for_model("qwen3-0.6b", enable_prompt_tokens_details=True, **config)
        self.workers = asyncio.run_coroutine_threadsafe(start_workers(cfg, n=n), self.loop).result(30)
        self.urls = [w.url for w in self.workers]

    def close(self) -> None:
        async def stop():
            for w in self.workers:
                await w.close()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def instant_workers():
    workers = _WorkersInThread(2, timing="instant")
    yield workers
    workers.close()


def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def test_unreachable_url_and_bad_flags_give_one_line_errors(capsys, tmp_path):
    err = _one_line_error(capsys, ["bench", "--url", "http://127.0.0.1:9", "--out", str(tmp_path)])
    assert "cannot reach http://127.0.0.1:9" in err
    assert "--concurrency" in _one_line_error(capsys, ["bench", "--url", "http://127.0.0.1:9", "-c", "0"])
    assert "--prefixes" in _one_line_error(capsys, ["bench", "--url", "http://127.0.0.1:9", "-K", "two"])
    assert "twice" in _one_line_error(
        capsys, ["bench", "--url", "http://127.0.0.1:9", "--metrics-url", "http://a:1,http://a:1"]
    )
    # Before any connection: credentials in the URL would not be sent.
    assert "--api-key" in _one_line_error(capsys, ["bench", "--url", "http://me:pw@127.0.0.1:9"])


def test_cli_writes_every_report(instant_workers, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["bench", "--url", instant_workers.urls[0], "--out", str(out), "-K", "2,3", "-c", "1,2",
            "--trials", "2", "--requests", "12", "--prefix-tokens", "128", "--suffix-tokens", "20",
            "--output-tokens", "3", "--compare-sim", "--sim-timing", "instant"]
    for url in instant_workers.urls:
        args += ["--metrics-url", url]
    assert main(args) == 0
    stdout = capsys.readouterr().out
    assert "1. Request hit rate" in stdout and "4. Throughput" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["model"] == "Qwen/Qwen3-0.6B"
    assert summary["meta"]["capacity_from"] == "vllm:cache_config_info"
    assert summary["meta"]["num_blocks"] == 585 and summary["meta"]["workers"] == 2
    points = summary["points"]
    assert len(points) == 4 and {p["policy"] for p in points} == {"service"}
    # The same point contract as `kvroute sim --json`.
    assert {"workers", "prefixes", "concurrency", "request_hit_rate", "token_hit_rate",
            "metrics_token_hit_rate", "per_trial"} <= set(points[0])
    assert all(abs(p["metrics_token_hit_rate"] - p["token_hit_rate"]) < 1e-3 for p in points)
    assert len(summary["meta"]["sim"]["points"]) == 4
    with open(out / "points.csv") as f:
        assert len(list(csv.DictReader(f))) == 4
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    measured = [r for r in records if not r["warmup"]]
    assert len(measured) == 4 * 2 * 12 and len(records) - len(measured) == 2 * (2 + 3) * 2
    assert {"send_time", "prefix_id", "prompt_tokens", "cached_tokens", "ttft_s", "itl_s", "e2e_s",
            "output_tokens", "status", "error", "worker"} <= set(measured[0])
    assert len(measured[0]["itl_s"]) == 2
    for name in ("hit_rate_vs_k.png", "ttft_cdf.png", "ttft_vs_concurrency.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 3 and "Request hit rate" in page


def test_ctrl_c_saves_what_was_measured_and_exits_130(tmp_path):
    # Slow workers (the reference GPU timing) so the run is still going when interrupted.
    workers = _WorkersInThread(1)  # about 0.14 s per request: a trial of 40 at c=2 takes ~3 s
    try:
        out = tmp_path / "run"
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvroute", "bench", "--url", workers.urls[0], "--metrics-url", workers.urls[0],
             "-K", "2", "-c", "2", "--trials", "3", "--requests", "40", "--output-tokens", "16",
             "--out", str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            # A suite started in the background by a shell without job control inherits SIGINT
            # ignored, and so would the bench (Python then installs no KeyboardInterrupt).
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        deadline = time.monotonic() + 20
        while not (out / "records.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.1)  # the first trial is written
        time.sleep(1.5)  # the second trial's warmup and part of its window
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=20)
    finally:
        workers.close()
    assert proc.returncode == 130, output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["partial"] is True
    [point] = summary["points"]
    assert point["per_trial"][0]["requests"] == 40
    assert len(point["per_trial"]) == 2 and 0 < point["per_trial"][1]["requests"] < 40
    lines = (out / "records.jsonl").read_text().splitlines()
    assert any(json.loads(line).get("partial") for line in lines)
