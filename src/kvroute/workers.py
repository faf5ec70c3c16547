"""The workers ``kvroute experiment`` measures (a fleet of W): emulated workers in a child process,
real ``vllm serve`` processes, or servers the user already runs.

The emulated fleet runs ``kvroute emulate --workers N --port 0`` as a child process (so the
workers use the second core while the benchmark client uses the first) and reads the URLs it
prints. Closing the fleet always stops the child and its ports — on normal exit, on Ctrl-C
(the child also gets the terminal's SIGINT and stops itself) and when the child crashed.

The vLLM fleet starts N ``vllm serve`` processes (from the venv of ``kvroute setup-vllm``) at
once — each takes 66–112 s to become healthy on CPU, mostly torch.compile — on free loopback
ports, each with its own folder for its log (under ``--out``) and a private scratch folder for
caches and IPC sockets under the system temp dir (short and absolute, whatever ``--out`` is). Every server runs in a process group of its
own, so closing the fleet (SIGTERM, then SIGKILL) also ends the engine-core and worker
processes vLLM forks; on Linux a server also gets SIGTERM if kvroute itself dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from kvroute.errors import UserError

_WORKER_LINE = re.compile(
    r"^\s*worker (\d+): (http://\S+?)/v1\b"
    r"(?:\s+kv-events (\S+)(?: \(replay (\S+)\))?)?"
)


@dataclass
class Workers:
    """Worker base URLs (``http://host:port``) and what was launched for them: the emulator's
    process, or one ``VllmServer`` per URL (nothing for servers the user runs)."""

    urls: list[str]
    process: asyncio.subprocess.Process | None = None
    log: list[str] = field(default_factory=list)
    servers: list[VllmServer] = field(default_factory=list)
    #: Per URL, the worker's KV events endpoint and replay endpoint (None: no events).
    kv_events: list[tuple[str, str | None] | None] = field(default_factory=list)

    @property
    def addresses(self) -> list[tuple[str, int]]:
        out = []
        for url in self.urls:
            host, _, port = url.removeprefix("http://").rstrip("/").rpartition(":")
            out.append((host.strip("[]"), int(port)))
        return out

    async def wait_crash(self) -> int:
        """Return a child's exit status when one exits (never returns for external URLs)."""
        if self.servers:
            while True:
                for server in self.servers:
                    if (code := server.process.poll()) is not None:
                        return code
                await asyncio.sleep(0.5)
        if self.process is None:
            await asyncio.Event().wait()
        return await self.process.wait()

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stop what was launched (SIGTERM, then SIGKILL after ``timeout_s``); idempotent."""
        if self.servers:
            # Blocking on purpose: on Ctrl-C this runs while the loop is being cancelled, and
            # nothing else needs the loop while the fleet goes down.
            terminate_servers(self.servers, max(timeout_s, VLLM_STOP_TIMEOUT_S))
        proc = self.process
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def launch_emulated(workers: int, emulate_args: list[str], startup_timeout_s: float = 60.0) -> Workers:
    """Start ``workers`` emulated workers on ephemeral loopback ports.

    Args:
        emulate_args: extra ``kvroute emulate`` flags (timing, time scale, KV memory…).
    """
    cmd = [
        sys.executable, "-m", "kvroute", "emulate", "--workers", str(workers),
        "--host", "127.0.0.1", "--port", "0", "--enable-prompt-tokens-details", *emulate_args,
    ]
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        preexec_fn=_parent_death_signal(),  # noqa: PLW1509 (a killed kvroute leaves no workers)
    )
    fleet = Workers(urls=[], process=proc)
    try:
        urls = await asyncio.wait_for(_read_urls(proc, workers, fleet.log), startup_timeout_s)
    except TimeoutError:
        await fleet.close()
        raise UserError(
            f"emulated workers did not start within {startup_timeout_s:.0f} s: "
            + " | ".join(fleet.log[-3:])
        ) from None
    except BaseException:
        await fleet.close()
        raise
    fleet.urls = [url for url, _ in urls]
    fleet.kv_events = [events for _, events in urls]
    # Keep draining the child's output so it never blocks on a full pipe.
    asyncio.get_running_loop().create_task(_drain(proc, fleet.log))
    return fleet


async def _read_urls(
    proc: asyncio.subprocess.Process, workers: int, log: list[str]
) -> list[tuple[str, tuple[str, str | None] | None]]:
    """Each worker's URL and KV events endpoints, from the lines ``kvroute emulate`` prints."""
    urls: dict[int, tuple[str, tuple[str, str | None] | None]] = {}
    while len(urls) < workers:
        line = await proc.stdout.readline()
        if not line:
            code = await proc.wait()
            raise UserError(
                f"kvroute emulate exited with status {code} before serving: " + " | ".join(log[-3:])
            )
        text = line.decode(errors="replace").rstrip()
        log.append(text)
        m = _WORKER_LINE.match(text)
        if m:
            events = (m.group(3), m.group(4)) if m.group(3) else None
            urls[int(m.group(1))] = (m.group(2), events)
    return [urls[i] for i in sorted(urls)]


async def _drain(proc: asyncio.subprocess.Process, log: list[str]) -> None:
    while line := await proc.stdout.readline():
        log.append(line.decode(errors="replace").rstrip())
        del log[:-50]


def external(urls: list[str]) -> Workers:
    """A fleet of servers the user runs (``--engine urls --worker URL``)."""
    cleaned = []
    for url in urls:
        url = url.rstrip("/").removesuffix("/v1")
        if not re.match(r"^http://[^/\s]+:\d+$", url):
            raise UserError(f"bad --worker {url!r}: expected http://HOST:PORT")
        cleaned.append(url)
    if not cleaned:
        raise UserError("--engine urls needs at least one --worker URL")
    return Workers(urls=cleaned)


# -- real vLLM ------------------------------------------------------------------------------

#: vLLM shuts its engine core down on SIGTERM in a few seconds; then SIGKILL.
VLLM_STOP_TIMEOUT_S = 15.0
#: ``kvroute emulate`` answers ``/health`` at once; vLLM on CPU needs 66–112 s, more when
#: several start together on few cores.
VLLM_STARTUP_TIMEOUT_S = 600.0
#: Prefix of each server's private scratch folder (caches, temporary files, IPC sockets),
#: made under the system temporary directory: vLLM's ZMQ IPC paths must stay under the
#: kernel's 107-character limit for a Unix socket path, whatever ``--out`` is.
SCRATCH_PREFIX = "kvroute-vllm-"
#: Beyond this the system temp dir is too deep for socket paths (``<dir>/<8>/rpc/<uuid>``).
_MAX_TEMP_DIR_CHARS = 48


@dataclass(frozen=True)
class VllmServeOptions:
    """The ``vllm serve`` flags of every server of a fleet (docs/vllm.md's working set).

    Args:
        model_dir: the model to serve (``kvroute setup-vllm`` builds the tiny one).
        served_model_names: names the API accepts; the first is what ``/v1/models`` lists first.
        max_model_len: context length; vLLM refuses to start unless the KV cache holds one
            request of this length.
        kv_cache_memory_bytes: KV memory per server. On CPU the tiny model's KV costs 512 B a
            token in 128-token blocks (64 KiB), so 4 MiB is 64 blocks (one is the null block).
        prompt_tokens_details: ``--enable-prompt-tokens-details`` (``cached_tokens`` in usage).
        kv_events: publish KV cache events (ZMQ PUB on ``tcp://*:PORT``) with a replay socket.
        enforce_eager: skip torch.compile: starts ~30 % sooner, decodes 30–45 % slower.
        extra_args: more ``vllm serve`` flags, passed as given.
    """

    model_dir: Path
    served_model_names: tuple[str, ...] = ("tiny",)
    max_model_len: int = 4096
    kv_cache_memory_bytes: int = 4 * 2**20
    prompt_tokens_details: bool = True
    kv_events: bool = True
    enforce_eager: bool = False
    extra_args: tuple[str, ...] = ()


@dataclass
class VllmServer:
    """One running ``vllm serve`` process and where to reach it.

    ``events_endpoint`` is where a subscriber connects (the server binds ``tcp://*:PORT``);
    ``replay_endpoint`` is its replay ROUTER socket, bound on loopback.
    """

    index: int
    url: str
    events_endpoint: str | None
    replay_endpoint: str | None
    work_dir: Path
    process: subprocess.Popen
    #: Caches, temporary files and IPC sockets (removed when the server stops).
    scratch_dir: Path | None = None

    @property
    def log_path(self) -> Path:
        return self.work_dir / "vllm.log"

    def log_tail(self, lines: int = 12) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


#: Where the kernel draws the ports of sockets bound to port 0 (Linux's default range when
#: the system does not say).
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: The lowest port :func:`free_ports` hands out (below it, well-known and registered services).
_LOWEST_PORT = 10000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 when it cannot be read)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports that are free now, for servers that bind them later.

    They are drawn below the kernel's ephemeral range: a port handed out there could be
    taken before the server binds it by any socket bound to port 0 meanwhile (a vLLM server
    starting beside it picks its internal ports so, and binds its KV-event socket only after
    loading its model), while no process gets a port below the range without asking for it.
    Each is bound to check it is free, and they are held open together so none repeats; where
    no such port is free, the kernel's own pick is taken.
    """
    rng = random.Random()
    candidates = range(_LOWEST_PORT, max(_LOWEST_PORT + 1, _ephemeral_low()))
    socks: list[socket.socket] = []
    try:
        for port in rng.sample(candidates, min(len(candidates), 64 * count)):
            if len(socks) == count:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        while len(socks) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds so far of ``pid`` and its live descendants (all threads), from
    Linux /proc: what a server costs, helpers it forked included (benchmarks)."""
    user, system = cpu_times(pid)
    return user + system


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds so far of ``pid`` and its live descendants, as
    ``cpu_seconds``. The system share is the kernel's work on the process's behalf (sockets,
    polling, scheduling): for a relay, the part no user-space code can make cheaper."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        fields = raw[raw.rfind(b")") + 2:].split()
        # fields[0] is state (stat field 3): ppid is field 4, utime 14, stime 15.
        stats[int(entry)] = (int(fields[1]), int(fields[11]) / tick, int(fields[12]) / tick)
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, _, _) in stats.items():
            if ppid == parent and child not in tree:
                tree.add(child)
                frontier.append(child)
    mine = [stats[p] for p in tree if p in stats]
    return sum(s[1] for s in mine), sum(s[2] for s in mine)


def cpu_binding(index: int, workers: int, cpus: Sequence[int]) -> str:
    """The cores server ``index`` of ``workers`` runs its OpenMP threads on.

    Left alone, every vLLM CPU server binds the same first core(s) ("auto" binding), so N
    servers would share one core while the others idle. Each gets an equal slice of the
    allowed cores instead, or one core each, round robin, when there are fewer cores than
    servers. Returns ``VLLM_CPU_OMP_THREADS_BIND``'s syntax: ``"4,5,6,7"`` or ``"3"``.
    """
    cpus = sorted(cpus)
    if workers > len(cpus):
        return str(cpus[index % len(cpus)])
    share = len(cpus) // workers
    mine = cpus[index * share : (index + 1) * share]
    return str(mine[0]) if len(mine) == 1 else ",".join(str(c) for c in mine)


def vllm_serve_command(vllm: Path, options: VllmServeOptions, port: int,
                       events_port: int | None, replay_port: int | None) -> list[str]:
    """The command line of one server."""
    cmd = [
        str(vllm), "serve", str(options.model_dir),
        "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", *options.served_model_names,
        "--max-model-len", str(options.max_model_len),
        "--enable-prefix-caching",
        "--kv-cache-memory-bytes", str(options.kv_cache_memory_bytes),
    ]
    if options.prompt_tokens_details:
        cmd.append("--enable-prompt-tokens-details")
    if options.enforce_eager:
        cmd.append("--enforce-eager")
    if events_port is not None:
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            # vLLM binds only a wildcard host (it connects to an explicit one); the replay
            # socket always binds, so it can stay on loopback.
            "endpoint": f"tcp://*:{events_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
            "topic": "kv-events",
        }
        cmd += ["--kv-events-config", json.dumps(config)]
    return cmd + list(options.extra_args)


def scratch_root() -> Path:
    """Where each server's scratch folder goes: the system temp dir, or ``/tmp`` when that is
    too deep for the IPC socket paths vLLM makes in it."""
    base = Path(tempfile.gettempdir()).resolve()
    if len(str(base)) > _MAX_TEMP_DIR_CHARS and Path("/tmp").is_dir():
        base = Path("/tmp")
    return base


def make_scratch_dir() -> Path:
    """A new private (mode 0700) scratch folder with a short absolute path."""
    return Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=scratch_root()))


def vllm_env(scratch_dir: Path, cpu_bind: str | None) -> dict[str, str]:
    """The environment of one server: offline, no telemetry, every cache, temporary file and
    IPC socket in ``scratch_dir`` (torch.compile leaves ~150 MB there; removed when it stops).

    The paths are absolute: vLLM runs in its own work folder, so a relative one would nest.
    """
    env = dict(os.environ)
    # Whole GiB that would override --kv-cache-memory-bytes (and the KV pressure with it).
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    scratch_dir = Path(scratch_dir).resolve()
    dirs = {name: scratch_dir / name for name in ("vllm-cache", "inductor", "tmp", "rpc")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_TARGET_DEVICE="cpu",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        # /reset_prefix_cache, which the bench calls between trials, exists only in dev mode.
        VLLM_SERVER_DEV_MODE="1",
        VLLM_CACHE_ROOT=str(dirs["vllm-cache"]),
        TORCHINDUCTOR_CACHE_DIR=str(dirs["inductor"]),
        TMPDIR=str(dirs["tmp"]),
        VLLM_RPC_BASE_PATH=str(dirs["rpc"]),
    )
    if cpu_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
    return env


def _parent_death_signal() -> Callable[[], None] | None:
    """A function for ``preexec_fn`` that makes the child get SIGTERM when the thread that
    started it dies (Linux ``prctl(PR_SET_PDEATHSIG)``), so a killed kvroute leaves no server
    running. libc is loaded here, in the parent: the child only makes the system call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def set_death_signal() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM))

    return set_death_signal


def start_vllm_server(index: int, vllm: Path, options: VllmServeOptions, work_dir: Path,
                      cpu_bind: str | None = None) -> VllmServer:
    """Start one ``vllm serve`` (returns at once; see :func:`wait_healthy`).

    Its log goes to ``work_dir/vllm.log``; its caches and sockets to a private scratch folder
    under the system temp dir (:func:`make_scratch_dir`).
    """
    work_dir = Path(work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    port, events_port, replay_port = free_ports(3)
    if not options.kv_events:
        events_port = replay_port = None
    cmd = vllm_serve_command(vllm, options, port, events_port, replay_port)
    scratch_dir = make_scratch_dir()
    try:
        env = vllm_env(scratch_dir, cpu_bind)
        with (work_dir / "vllm.log").open("wb") as log:  # the child holds its own copy
            process = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                cwd=work_dir, start_new_session=True,
                # Only a prctl system call runs in the child: safe with threads around.
                preexec_fn=_parent_death_signal(),  # noqa: PLW1509
            )
    except BaseException:
        shutil.rmtree(scratch_dir, ignore_errors=True)
        raise
    return VllmServer(
        index=index,
        url=f"http://127.0.0.1:{port}",
        events_endpoint=None if events_port is None else f"tcp://127.0.0.1:{events_port}",
        replay_endpoint=None if replay_port is None else f"tcp://127.0.0.1:{replay_port}",
        work_dir=work_dir,
        process=process,
        scratch_dir=scratch_dir,
    )


async def wait_healthy(
    servers: Sequence[VllmServer],
    timeout_s: float = VLLM_STARTUP_TIMEOUT_S,
    on_progress: Callable[[int, int, float], None] | None = None,
) -> None:
    """Poll every server's ``/health`` until all answer 200.

    Args:
        on_progress: called about once a second with (healthy, total, seconds waited).

    Raises:
        UserError: a server exited, or not all were healthy within ``timeout_s``; the message
            has the end of that server's log.
    """
    started = time.monotonic()
    healthy: set[int] = set()
    timeout = aiohttp.ClientTimeout(total=2)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while True:
            for server in servers:
                if server.index in healthy:
                    continue
                code = server.process.poll()
                if code is not None:
                    raise UserError(
                        f"vllm serve #{server.index} exited with status {code} while starting "
                        f"(log: {server.log_path}):\n{server.log_tail()}"
                    )
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(f"{server.url}/health") as r:
                        if r.status == 200:
                            healthy.add(server.index)
            waited = time.monotonic() - started
            if on_progress is not None:
                on_progress(len(healthy), len(servers), waited)
            if len(healthy) == len(servers):
                return
            if waited > timeout_s:
                late = next(s for s in servers if s.index not in healthy)
                raise UserError(
                    f"vllm serve #{late.index} was not healthy after {timeout_s:.0f} s "
                    f"(log: {late.log_path}):\n{late.log_tail()}"
                )
            await asyncio.sleep(1.0)


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def terminate_servers(servers: Sequence[VllmServer], timeout_s: float = VLLM_STOP_TIMEOUT_S) -> None:
    """SIGTERM every server's process group, SIGKILL what is left after ``timeout_s``, reap
    the processes and delete their scratch folders, keeping the logs (blocking). Idempotent,
    and safe while they are still starting."""
    for server in servers:
        _signal_group(server.process, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(s.process.poll() is None for s in servers):
        time.sleep(0.2)
    for server in servers:
        # The whole group: the engine core and its workers may outlive the API process.
        _signal_group(server.process, signal.SIGKILL)
        server.process.wait()
        if server.scratch_dir is not None:
            shutil.rmtree(server.scratch_dir, ignore_errors=True)


def start_vllm_servers(count: int, vllm: Path, options: VllmServeOptions, work_dir: Path,
                       first_index: int = 0) -> list[VllmServer]:
    """Start ``count`` servers at once (returns at once; see :func:`wait_healthy`), each with
    its own slice of the CPUs and its folder ``work_dir/worker-<i>``.

    Call it from the thread that will outlive the servers: on Linux they are tied to it.
    """
    if not Path(vllm).exists():
        raise UserError(f"{vllm} does not exist: run `kvroute setup-vllm` first")
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    servers: list[VllmServer] = []
    try:
        for i in range(first_index, first_index + count):
            bind = cpu_binding(i - first_index, count, cpus)
            servers.append(start_vllm_server(i, vllm, options, Path(work_dir) / f"worker-{i}", bind))
    except BaseException:
        terminate_servers(servers)
        raise
    return servers


async def launch_vllm(
    workers: int,
    vllm: Path,
    options: VllmServeOptions,
    work_dir: Path,
    startup_timeout_s: float = VLLM_STARTUP_TIMEOUT_S,
    on_progress: Callable[[int, int, float], None] | None = None,
) -> Workers:
    """Start ``workers`` real vLLM servers together and wait until all are healthy.

    Args:
        vllm: the ``vllm`` command (``VllmInstall.vllm``).
        work_dir: each server's log (``vllm.log``) and caches go to ``work_dir/worker-<i>``.
        on_progress: see :func:`wait_healthy`.

    Any failure, Ctrl-C included, stops every server started before raising.
    """
    if workers < 1:
        raise UserError("a vLLM fleet needs at least one worker")
    servers = start_vllm_servers(workers, vllm, options, work_dir)
    try:
        await wait_healthy(servers, startup_timeout_s, on_progress)
    except BaseException:
        terminate_servers(servers)
        raise
    return Workers(
        urls=[s.url for s in servers],
        servers=servers,
        kv_events=[
            (s.events_endpoint, s.replay_endpoint) if s.events_endpoint else None for s in servers
        ],
    )
