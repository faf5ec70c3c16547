"""docs/operations.md's generated tables say what the code does: the flag tables equal what
``scripts/operations_doc.py`` builds from the parsers now, and the metrics table names exactly
the metrics a live router (in front of an emulated worker) describes on /metrics."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import urllib.request

from support.paths import ROOT


def _script():
    spec = importlib.util.spec_from_file_location("operations_doc", ROOT / "scripts" / "operations_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flag_tables_are_current() -> None:
    script = _script()
    doc = script.DOC.read_text()
    assert script.generated(doc, None) == doc, "run: python scripts/operations_doc.py --write"


def _start(args: list[str]) -> tuple[subprocess.Popen, str]:
    """Start a kvroute command that prints its URL on its first lines; return it and the URL."""
    proc = subprocess.Popen([sys.executable, "-m", "kvroute", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    for _ in range(5):
        line = proc.stdout.readline()
        if match := re.search(r"(http://127\.0\.0\.1:\d+)", line):
            return proc, match[1]
    proc.kill()
    raise AssertionError(f"no URL in kvroute {args[0]}'s first lines")


def test_metrics_table_names_the_routers_metrics() -> None:
    worker, worker_url = _start(["emulate", "--port", "0", "--timing", "instant"])
    try:
        router, url = _start(["serve", "--port", "0", "--worker", worker_url, "--threads", "1"])
        try:
            body = json.dumps({"prompt": "one request so that every series exists", "max_tokens": 2}).encode()
            request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
            urllib.request.urlopen(request, timeout=30).read()
            live = set(re.findall(r"^# HELP (\S+)", urllib.request.urlopen(f"{url}/metrics", timeout=30)
                                  .read().decode(), re.M))
        finally:
            router.terminate()
            router.wait(30)
    finally:
        worker.terminate()
        worker.wait(30)
    doc = (ROOT / "docs" / "operations.md").read_text()
    table = doc.split("<!-- generated:metrics -->")[1].split("<!-- /generated:metrics -->")[0]
    documented = set(re.findall(r"^\| `([a-z_:]+)`", table, re.M))
    assert live and documented == live, (
        f"missing from the doc: {sorted(live - documented)}; gone from /metrics: {sorted(documented - live)}"
    )
