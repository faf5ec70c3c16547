"""``kvroute bench`` beside ``vllm bench serve``: the same server, request shape and rate.

Both clients load the same emulated worker (``kvroute emulate`` in a child process), one after
the other, interleaved over several rounds (the client order rotates each round, so neither
always runs first after a quiet spell). Each run is the real command line as a user runs it:

* ``vllm bench serve`` from the cached vLLM venv (``kvroute setup-vllm``), random dataset: one
  shared random prefix of ``--prefix-tokens`` plus ``--suffix-tokens`` distinct tokens, text
  prompts, ``--ignore-eos``, Poisson arrivals at the rate; it pools connections (keep-alive);
* ``kvroute bench`` with the same shape (``-K 1``, text prompts built with the same tokenizer),
  once with a new TCP connection per request (its default) and once with ``--keep-alive``
  (vLLM's way, for a like-for-like ratio).

Both take TTFT from just before the POST to the first chunk that carries generated text, so
their TTFTs measure the same interval. The emulator tokenizes the text with the same tokenizer,
so both send prompts of the same token length (checked from the usage each server reports).

Scenarios:

* ``instant`` — no model time: every millisecond of TTFT is HTTP, JSON, tokenization and
  scheduling latency (client, server and the OS), i.e. an upper bound of client overhead;
* ``reference-gpu`` — the reference experiment's cost model (``--time-scale`` to speed it
  up): the true TTFT of an isolated prefix hit is known from the cost model,
  ``frontend_s + step_base_s + prefill_token_s · suffix`` (≈ 39.9 ms at time scale 1).

Besides each client's TTFT p50/p99, every run reports the server's own mean TTFT (from its
``vllm:time_to_first_token_seconds`` histogram: handler start to first token; it includes
each client's single warmup request, a miss) and, from the two means, the client's mean
overhead (client mean TTFT − server mean TTFT: connecting, sending, the response's way back
and the client's parsing and wake-up), plus the 1-minute load average, because this machine is
shared and loaded, and latency tails follow the load.

    python benchmarks/bench_vs_vllm.py [--rounds 3] [--rate 50] [--requests 500] \
        [--gpu-rate 20] [--gpu-requests 200] [--time-scale 1]

The default instant rate is 50/s, not the 200/s of ``bench_client_overhead.py``: here the
prompts are text (vLLM's random dataset sends nothing else), so the emulator tokenizes every
one, and on a 2-core machine shared with other work, server plus client then saturate near
100–200 requests/s and TTFT turns into queueing (seconds) for both clients alike.

Needs the vLLM venv (``kvroute setup-vllm``); nothing leaves loopback (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvroute.engine.cost import get_preset
from kvroute.vllm_setup import VllmInstall

MODEL = "tiny"

#: Environment for every child: no hub, no telemetry, nothing off this machine.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "NO_PROXY": "127.0.0.1,localhost",
}


@dataclass
class Scenario:
    """One emulator timing preset and the load put on it."""

    timing: str
    rate: float
    requests: int
    time_scale: float = 1.0

    def isolated_hit_ttft_s(self, suffix_tokens: int) -> float:
        """The cost model's TTFT of a request whose prefix is cached and that runs alone:
        the front-end time, then one prefill step over the uncached suffix."""
        cost = get_preset(self.timing).scaled(self.time_scale)
        return cost.frontend_s + cost.step_time(suffix_tokens, 0)


@dataclass
class Run:
    """One client's measured window."""

    client: str
    ttft_s: list[float]
    failed: int
    prompt_tokens: set[int]
    server_mean_ttft_s: float
    load_before: float
    load_after: float
    wall_s: float
    extra: dict = field(default_factory=dict)

    def mean_overhead_ms(self) -> float:
        """Client mean TTFT minus the server's mean TTFT over the same window."""
        return (float(np.mean(self.ttft_s)) - self.server_mean_ttft_s) * 1e3 if self.ttft_s else float("nan")

    def pct_ms(self, q: float) -> float:
        return float(np.percentile(self.ttft_s, q)) * 1e3 if self.ttft_s else float("nan")


# -- the server --------------------------------------------------------------------------------


class Emulator:
    """``kvroute emulate`` in a child process on a free port (its output goes to a file, which
    is read for the URL it prints, so a full pipe can never stall it)."""

    def __init__(self, scenario: Scenario, tokenizer: Path, workdir: Path) -> None:
        self.log = workdir / f"emulate-{scenario.timing}.log"
        self._log_file = self.log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvroute", "emulate", "--port", "0", "--timing", scenario.timing,
             "--time-scale", str(scenario.time_scale), "--enable-prompt-tokens-details",
             "--served-model-name", MODEL, "--tokenizer", str(tokenizer)],
            stdout=self._log_file, stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE_ENV},
        )
        self.url = self._wait_url()

    def _wait_url(self, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = re.search(r"worker 0: (http://[\d.]+:\d+)", self.log.read_text())
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"emulator did not start; its output:\n{self.log.read_text()}")

    def ttft_sum_count(self) -> tuple[float, float]:
        """The server's ``vllm:time_to_first_token_seconds`` histogram sum and count."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        values = {}
        for suffix in ("sum", "count"):
            m = re.search(rf"^vllm:time_to_first_token_seconds_{suffix}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
            values[suffix] = float(m.group(1)) if m else 0.0
        return values["sum"], values["count"]

    def reset_prefix_cache(self) -> None:
        req = urllib.request.Request(self.url + "/reset_prefix_cache", data=b"", method="POST")
        urllib.request.urlopen(req, timeout=10).close()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log_file.close()


# -- the clients -------------------------------------------------------------------------------


def _checked(cmd: list[str], cwd: Path, what: str) -> None:
    proc = subprocess.run(cmd, check=False, cwd=cwd, env={**os.environ, **OFFLINE_ENV}, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{' '.join(cmd)}\n{tail}")


def run_vllm(vllm: Path, emulator: Emulator, scenario: Scenario, args, workdir: Path) -> dict:
    """``vllm bench serve``; returns TTFTs, failures and prompt lengths from its result JSON."""
    emulator.reset_prefix_cache()
    result = workdir / "vllm-result.json"
    result.unlink(missing_ok=True)
    _checked([
        str(vllm), "bench", "serve", "--backend", "openai", "--base-url", emulator.url,
        "--endpoint", "/v1/completions", "--model", MODEL, "--tokenizer", str(args.tokenizer),
        "--dataset-name", "random", "--random-prefix-len", str(args.prefix_tokens),
        "--random-input-len", str(args.suffix_tokens), "--random-output-len", str(args.output_tokens),
        "--random-range-ratio", "0", "--ignore-eos", "--num-prompts", str(scenario.requests),
        "--request-rate", str(scenario.rate), "--seed", str(args.seed), "--num-warmups", "1",
        "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(workdir),
        "--result-filename", result.name,
    ], workdir, "vllm bench serve")
    data = json.loads(result.read_text())
    ok = [t for t, err in zip(data["ttfts"], data["errors"]) if not err]
    return {"ttft_s": ok, "failed": int(data["failed"]), "prompt_tokens": set(data["input_lens"])}


def run_kvroute(emulator: Emulator, scenario: Scenario, args, workdir: Path, keep_alive: bool) -> dict:
    """``kvroute bench`` (open loop, one trial); returns the measured window's records."""
    out = Path(tempfile.mkdtemp(prefix="kvroute-", dir=workdir))  # fresh: bench appends records
    _checked([
        sys.executable, "-m", "kvroute", "bench", "--url", emulator.url, "--metrics-url", emulator.url,
        "--model", MODEL, "--rate", str(scenario.rate), "--trials", "1", "-K", "1",
        "--prefix-tokens", str(args.prefix_tokens), "--suffix-tokens", str(args.suffix_tokens),
        "--output-tokens", str(args.output_tokens), "--requests", str(scenario.requests),
        "--seed", str(args.seed), "--tokenizer", str(args.tokenizer), "--prompt-format", "text",
        "--out", str(out), *(["--keep-alive"] if keep_alive else []),
    ], workdir, "kvroute bench")
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines() if line]
    measured = [r for r in records if not r["warmup"]]
    ok = [r for r in measured if r["status"] == 200 and r["error"] is None and r["ttft_s"] is not None]
    return {"ttft_s": [r["ttft_s"] for r in ok], "failed": len(measured) - len(ok),
            "prompt_tokens": {r["prompt_tokens"] for r in ok}}


CLIENTS = ("vllm", "kvroute", "kvroute-keepalive")


def measure(client: str, emulator: Emulator, scenario: Scenario, args, workdir: Path) -> Run:
    sum0, count0 = emulator.ttft_sum_count()
    load0, t0 = os.getloadavg()[0], time.monotonic()
    if client == "vllm":
        got = run_vllm(args.vllm, emulator, scenario, args, workdir)
    else:
        got = run_kvroute(emulator, scenario, args, workdir, keep_alive=client == "kvroute-keepalive")
    wall, load1 = time.monotonic() - t0, os.getloadavg()[0]
    sum1, count1 = emulator.ttft_sum_count()
    server = (sum1 - sum0) / (count1 - count0) if count1 > count0 else float("nan")
    return Run(client, got["ttft_s"], got["failed"], got["prompt_tokens"], server, load0, load1, wall)


# -- main --------------------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else float("nan")


def main() -> None:
    install = VllmInstall.at()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default %(default)s)")
    parser.add_argument("--rate", type=float, default=50.0, help="instant scenario: requests/s (default %(default)s)")
    parser.add_argument("--requests", type=int, default=500, help="instant scenario: requests per run (default %(default)s)")
    parser.add_argument("--gpu-rate", type=float, default=20.0, help="reference-gpu scenario: requests/s (default %(default)s)")
    parser.add_argument("--gpu-requests", type=int, default=200, help="reference-gpu scenario: requests per run (default %(default)s)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="reference-gpu speed-up (default %(default)s)")
    parser.add_argument("--scenarios", default="instant,reference-gpu", help="which scenarios (default %(default)s)")
    parser.add_argument("--prefix-tokens", type=int, default=2032, help="shared prefix (default %(default)s)")
    parser.add_argument("--suffix-tokens", type=int, default=339, help="distinct suffix (default %(default)s)")
    parser.add_argument("--output-tokens", type=int, default=16, help="tokens per reply (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", type=Path, default=install.model_dir,
                        help="local tokenizer dir, e.g. from `kvroute make-tiny-model` (default %(default)s)")
    parser.add_argument("--vllm", type=Path, default=install.vllm, help="vllm executable (default %(default)s)")
    args = parser.parse_args()
    for path, hint in ((args.vllm, "kvroute setup-vllm"), (args.tokenizer / "tokenizer.json", "kvroute make-tiny-model DIR")):
        if not path.exists():
            sys.exit(f"{path} not found (run `{hint}`)")

    every = {
        "instant": Scenario("instant", args.rate, args.requests),
        "reference-gpu": Scenario("reference-gpu", args.gpu_rate, args.gpu_requests, args.time_scale),
    }
    scenarios = [every[name] for name in args.scenarios.split(",")]
    summary: dict = {"prompt_tokens": args.prefix_tokens + args.suffix_tokens, "output_tokens": args.output_tokens}
    with tempfile.TemporaryDirectory(prefix="bench-vs-vllm-") as tmp:
        workdir = Path(tmp)
        for scenario in scenarios:
            known_ms = scenario.isolated_hit_ttft_s(args.suffix_tokens) * 1e3
            print(f"\n== {scenario.timing} (time scale {scenario.time_scale:g}): {scenario.requests} requests "
                  f"at {scenario.rate:g}/s; cost-model TTFT of an isolated hit {known_ms:.2f} ms", flush=True)
            emulator = Emulator(scenario, args.tokenizer, workdir)
            runs: dict[str, list[Run]] = {c: [] for c in CLIENTS}
            try:
                for rnd in range(args.rounds):
                    order = CLIENTS[rnd % len(CLIENTS):] + CLIENTS[:rnd % len(CLIENTS)]
                    for client in order:
                        run = measure(client, emulator, scenario, args, workdir)
                        runs[client].append(run)
                        print(f"round {rnd} {client:18s} TTFT p50 {run.pct_ms(50):7.2f} p99 {run.pct_ms(99):7.2f} ms"
                              f"  server mean {run.server_mean_ttft_s * 1e3:6.2f} ms  overhead {run.mean_overhead_ms():6.2f} ms"
                              f"  n={len(run.ttft_s)}"
                              f" failed={run.failed} prompt_tokens={sorted(run.prompt_tokens)}"
                              f"  load {run.load_before:.2f}->{run.load_after:.2f}  ({run.wall_s:.0f} s)", flush=True)
            finally:
                emulator.stop()

            entry: dict = {"known_isolated_hit_ttft_ms": known_ms, "rate": scenario.rate,
                           "requests": scenario.requests, "time_scale": scenario.time_scale}
            for client, rs in runs.items():
                entry[client] = {
                    "ttft_p50_ms": _median([r.pct_ms(50) for r in rs]),
                    "ttft_p99_ms": _median([r.pct_ms(99) for r in rs]),
                    "server_mean_ttft_ms": _median([r.server_mean_ttft_s * 1e3 for r in rs]),
                    "mean_overhead_ms": _median([r.mean_overhead_ms() for r in rs]),
                    "failed": sum(r.failed for r in rs),
                    "load_1min": [round(r.load_before, 2) for r in rs],
                    "per_round_p50_p99_ms": [(round(r.pct_ms(50), 2), round(r.pct_ms(99), 2)) for r in rs],
                }
            print(f"-- {scenario.timing}: medians over {args.rounds} rounds (ms)")
            print(f"{'client':18s} {'p50':>8s} {'p99':>8s} {'p50/vllm':>9s} {'p99/vllm':>9s} {'p50-known':>10s}"
                  f" {'server':>8s} {'overhead':>9s} {'ovh/vllm':>9s}")
            base = entry["vllm"]
            for client in CLIENTS:
                e = entry[client]
                e["ratio_p50_vs_vllm"] = e["ttft_p50_ms"] / base["ttft_p50_ms"]
                e["ratio_p99_vs_vllm"] = e["ttft_p99_ms"] / base["ttft_p99_ms"]
                e["ratio_overhead_vs_vllm"] = e["mean_overhead_ms"] / base["mean_overhead_ms"]
                print(f"{client:18s} {e['ttft_p50_ms']:8.2f} {e['ttft_p99_ms']:8.2f} {e['ratio_p50_vs_vllm']:9.2f}"
                      f" {e['ratio_p99_vs_vllm']:9.2f} {e['ttft_p50_ms'] - known_ms:10.2f} {e['server_mean_ttft_ms']:8.2f}"
                      f" {e['mean_overhead_ms']:9.2f} {e['ratio_overhead_vs_vllm']:9.2f}",
                      flush=True)
            summary[scenario.timing] = entry
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
