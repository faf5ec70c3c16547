"""Mistakes a newcomer makes get one clear line (no traceback), and what a command prints is
true: serve's option values and port, emulate's own port clashes and its connect-or-bind
banner, serve's log of a dead worker, bench's base URL with /v1 and its label,
sim_speed.py with a missing trace, router_overhead.py and router_threads.py with too few
requests or streams, and mesh_lag.py with one replica."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from support.paths import ROOT


def kvroute(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvroute", *args], capture_output=True, text=True, timeout=timeout)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    return proc.stderr


def test_serve_names_the_policy_option_whose_value_is_not_a_number() -> None:
    line = one_error_line(kvroute("serve", "--port", "0", "--worker", "http://127.0.0.1:9",
                                  "--policy-option", "admission_wait=abc"))
    assert '--policy-option kv-aware: option admission_wait: invalid type: string "abc"' in line


def test_serve_refuses_a_port_past_65535() -> None:
    line = one_error_line(kvroute("serve", "--port", "99999", "--worker", "http://127.0.0.1:9"))
    assert "--port must be a port 0-65535" in line


def test_emulate_names_its_own_worker_when_workers_would_share_a_port() -> None:
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": "tcp://*:45557", "replay_endpoint": "tcp://*:45558"})
    line = one_error_line(kvroute("emulate", "--workers", "2", "--port", "0", "--kv-events-config", config))
    assert "worker 1's KV-event endpoint tcp://*:45558" in line and "worker 0's replay endpoint" in line


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvroute", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _lines_until(stream, pattern: str, limit: int = 10) -> list[str]:
    lines = []
    for _ in range(limit):
        lines.append(stream.readline())
        if re.search(pattern, lines[-1]):
            return lines
    raise AssertionError(f"no {pattern!r} in {lines}")


def test_emulate_says_a_concrete_host_connects_and_warns_that_serve_cannot_receive() -> None:
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:45600"})
    proc = _start(["emulate", "--port", "0", "--timing", "instant", "--kv-events-config", config])
    try:
        banner = _lines_until(proc.stdout, r"worker 0:")
        warning = proc.stderr.readline()
    finally:
        proc.terminate()
        proc.wait(30)
    assert "kv-events tcp://127.0.0.1:45600 — connects to it" in banner[-1]
    assert "warning" in warning and "kvroute serve connects" in warning and "tcp://*:PORT" in warning


def test_serve_logs_a_dead_worker_and_bench_takes_the_v1_url_and_labels_a_router(tmp_path: Path) -> None:
    worker = _start(["emulate", "--port", "0", "--timing", "instant", "--enable-prompt-tokens-details"])
    try:
        worker_url = re.search(r"(http://127\.0\.0\.1:\d+)/v1", _lines_until(worker.stdout, r"worker 0:")[-1])[1]
        dead = "http://127.0.0.1:9"  # discard: nothing listens
        router = _start(["serve", "--port", "0", "--threads", "1", "--health-interval", "0.4",
                         "--worker", worker_url, "--worker", dead])
        try:
            url = re.search(r"listening on (http://\S+),", router.stdout.readline())[1]
            deadline = time.monotonic() + 30
            logged = ""
            while "is out" not in logged and time.monotonic() < deadline:
                logged = router.stderr.readline()
            assert f"worker {dead} is out: its health check" in logged and "(1 of 2 workers available)" in logged
            bench = kvroute("bench", "--url", f"{url}/v1", "--metrics-url", worker_url, "-K", "2", "-c", "1",
                            "--requests", "4", "--trials", "1", "--out", str(tmp_path / "bench"), timeout=180)
            assert bench.returncode == 0, bench.stdout + bench.stderr
            summary = json.loads((tmp_path / "bench" / "summary.json").read_text())
            assert summary["meta"]["label"] == "router" and summary["meta"]["url"] == url
        finally:
            router.terminate()
            router.wait(30)
    finally:
        worker.terminate()
        worker.wait(30)


def test_sim_speed_with_a_missing_trace_exits_with_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sim_speed.py"), "--trace",
                           str(tmp_path / "missing.jsonl")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "cannot read trace" in proc.stderr


def test_router_benchmarks_refuse_too_few_requests_streams_or_replicas_with_one_line() -> None:
    def bench(script: str, *args: str) -> str:
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                              capture_output=True, text=True, timeout=60)
        return one_error_line(proc)

    # 40 requests are all latency pairs: none would be left to measure the CPU with.
    assert "--requests (40) must exceed --latency-requests (100)" in bench("router_overhead.py", "--requests", "40")
    assert "--concurrency must be >= 1" in bench("router_overhead.py", "--concurrency", "0")
    assert "--requests must be >= 1" in bench("router_threads.py", "--requests", "0")
    assert "--concurrency (1) must be at least --clients (2)" in bench("router_threads.py", "--concurrency", "1")
    assert "--threads takes a comma list" in bench("router_threads.py", "--threads", "1,x")
    assert "a mesh needs at least 2 replicas" in bench("mesh_lag.py", "--replicas", "1,2")
