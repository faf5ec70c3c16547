"""Entry point of the chart's bench Job: find the worker pods, run `kvroute bench`, print the
summary.

kvroute bench needs every worker's own URL (for the Prometheus counters and the cache resets
between trials), not just the Service's. The headless Service's DNS name resolves to one address
per ready pod, so the Job waits until all WORKERS of them resolve and the measured URL answers
GET /v1/models (a router is ready a few seconds after its workers), passes each worker as
--metrics-url, and ends its log with summary.json on one line (`kubectl logs job/... | tail -n 1`).

Measuring the router replicas, the Job also waits for all ROUTERS of them to resolve as
ROUTERS_HOST (the router mesh's headless Service) and passes each as --router-metrics-url, so
that their retention refreshes are summed.

Environment (set by the chart): BENCH_URL, BENCH_LABEL, WORKERS_HOST, WORKER_PORT, WORKERS,
WAIT_SECONDS, RESULTS_DIR; with the router target, ROUTERS_HOST, ROUTER_PORT, ROUTERS.
Arguments: passed on to kvroute bench.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def worker_addresses(host: str, port: int) -> list[str]:
    """Addresses the headless Service's name resolves to now (one per ready pod)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return sorted({info[4][0] for info in infos})


def wait_for_workers(host: str, port: int, expected: int, deadline: float, what: str = "workers") -> list[str]:
    while True:
        addresses = worker_addresses(host, port)
        if len(addresses) >= expected:
            return addresses
        if time.monotonic() > deadline:
            sys.exit(f"only {len(addresses)} of {expected} {what} resolve as {host}")
        print(f"waiting for {what}: {len(addresses)}/{expected} ready", flush=True)
        time.sleep(5)


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_for_target(url: str, deadline: float) -> None:
    while not answers(url):
        if time.monotonic() > deadline:
            sys.exit(f"{url}/v1/models does not answer")
        print(f"waiting for {url} to answer", flush=True)
        time.sleep(2)


def url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def main(bench_args: list[str]) -> int:
    env = os.environ
    port = int(env["WORKER_PORT"])
    expected = int(env["WORKERS"])
    deadline = time.monotonic() + float(env["WAIT_SECONDS"])
    addresses = wait_for_workers(env["WORKERS_HOST"], port, expected, deadline)
    wait_for_target(env["BENCH_URL"], deadline)
    label = env["BENCH_LABEL"]
    out = Path(env["RESULTS_DIR"]) / f"{label}-{time.strftime('%Y%m%d-%H%M%S')}"
    command = ["kvroute", "bench", "--url", env["BENCH_URL"], "--label", label,
               "--workers", str(len(addresses)), "--out", str(out)]
    for address in addresses:
        command += ["--metrics-url", f"http://{url_host(address)}:{port}"]
    if env.get("ROUTERS_HOST"):
        router_port = int(env["ROUTER_PORT"])
        for address in wait_for_workers(env["ROUTERS_HOST"], router_port, int(env["ROUTERS"]), deadline, "routers"):
            command += ["--router-metrics-url", f"http://{url_host(address)}:{router_port}"]
    command += bench_args
    print("running:", " ".join(command), flush=True)
    code = subprocess.call(command)
    summary = out / "summary.json"
    if summary.is_file():
        print(json.dumps(json.loads(summary.read_text())), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
