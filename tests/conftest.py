"""Fixtures shared across test files: the real-vLLM fleet of the ``vllm`` tier.

``vllm_fleet`` starts real ``vllm serve`` processes once per session, and only when a test
marked ``vllm`` asks for it (the default run deselects those tests, see pyproject's addopts):

* two workers with the reference experiment's flags scaled to CPU (prefix caching, prompt
  token details, KV events with replay, a small KV budget), serving the tiny model as
  ``test-model`` and ``alias-model``: what the bench, the KV-event and the tokenizer checks
  use, and what a router test can put itself in front of;
* one more server started without ``--enable-prompt-tokens-details`` (and without
  torch.compile, it only answers a few requests), for the API test of that pitfall.

They start together (1–3 minutes on two cores) and stop when the session ends. The tier is
skipped with the reason when ``kvroute setup-vllm`` has not been run.

Run it: ``python -m pytest -q -m vllm`` (after ``kvroute setup-vllm``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web
from hypothesis import settings

from kvroute.bench.runner import server_cache_config
from kvroute.experiment import ExperimentPlan
from kvroute.tinymodel import TinyModelConfig
from kvroute.vllm_setup import VllmInstall
from kvroute.workers import (
    VllmServeOptions,
    VllmServer,
    Workers,
    start_vllm_servers,
    terminate_servers,
    wait_healthy,
)
from kvroute.workload import LengthDist, WorkloadSpec

# Property tests check behaviour, not speed: hypothesis's default 200 ms deadline per example
# fails them on a loaded shared machine (CI's two cores), so no example has a deadline.
settings.register_profile("kvroute", deadline=None)
settings.load_profile("kvroute")

#: The tier's scale: KV blocks are 128 tokens × 512 B = 64 KiB on CPU, so 3 MiB is 48 blocks
#: (47 usable). Prompts of a 1,792-token prefix + 128-token suffix fill 15 blocks, so a worker
#: holds about 3 of the 4 prefixes (C ≈ 3.1 < K): there are hits and evictions.
VLLM_TIER_KV_BYTES = 3 * 2**20
VLLM_TIER_MAX_MODEL_LEN = 2048
VLLM_TIER_MODEL = "test-model"
VLLM_TIER_WORKERS = 2
VLLM_STARTUP_TIMEOUT_S = 900.0


@dataclass
class RealVllmFleet:
    """The tier's running servers and what tests may assume about them.

    ``fleet`` is a :class:`kvroute.workers.Workers` of the two workers that its users must not
    close (the session does); ``plain`` is the server without prompt token details.
    """

    fleet: Workers
    plain: VllmServer
    install: VllmInstall
    model: str
    block_size: int
    max_model_len: int
    kv_cache_memory_bytes: int

    @property
    def servers(self) -> list[VllmServer]:
        return self.fleet.servers


def _reporter(config: pytest.Config) -> Callable[[str], None]:
    """Startup takes minutes: say what is happening, past pytest's output capture."""
    terminal = config.pluginmanager.get_plugin("terminalreporter")

    def report(message: str) -> None:
        if terminal is not None:
            terminal.write_line(f"[vllm tier] {message}")
        else:
            print(f"[vllm tier] {message}", file=sys.__stderr__, flush=True)

    return report


@pytest.fixture(scope="session")
def vllm_fleet(pytestconfig: pytest.Config) -> Iterator[RealVllmFleet]:
    """Two real vLLM workers (plus the plain server), started once for the whole session."""
    report = _reporter(pytestconfig)
    install = VllmInstall.at()
    if (why := install.missing()) is not None:
        pytest.skip(f"real vLLM tier: {why}")
    # Not pytest's tmp_path: a later pytest run (of another checkout, say) deletes all but the
    # last three of those, and the servers keep their sockets and caches here for minutes.
    work = Path(tempfile.mkdtemp(prefix="kvroute-vllm-tier-"))
    options = VllmServeOptions(
        model_dir=install.model_dir,
        served_model_names=(VLLM_TIER_MODEL, "alias-model"),
        max_model_len=VLLM_TIER_MAX_MODEL_LEN,
        kv_cache_memory_bytes=VLLM_TIER_KV_BYTES,
    )
    plain_options = VllmServeOptions(
        model_dir=install.model_dir,
        served_model_names=(VLLM_TIER_MODEL,),
        max_model_len=VLLM_TIER_MAX_MODEL_LEN,
        kv_cache_memory_bytes=VLLM_TIER_KV_BYTES,
        prompt_tokens_details=False,
        kv_events=False,
        enforce_eager=True,
        # tests/vllm/test_chat_requests.py names the template in its /tokenize bodies.
        extra_args=("--trust-request-chat-template",),
    )
    # Started from this (the main) thread: the servers are tied to the thread that forks them.
    servers = start_vllm_servers(VLLM_TIER_WORKERS, install.vllm, options, work)
    servers += start_vllm_servers(1, install.vllm, plain_options, work, first_index=VLLM_TIER_WORKERS)
    report(f"starting {len(servers)} vLLM servers, logs in {work}/worker-<i>/vllm.log")
    last = [-1]

    def on_progress(healthy: int, total: int, waited: float) -> None:
        if healthy != last[0] or int(waited) % 30 == 0:
            last[0] = healthy
            report(f"{healthy}/{total} healthy after {waited:.0f} s")

    async def ready() -> list[tuple[int, int]]:
        await wait_healthy(servers, VLLM_STARTUP_TIMEOUT_S, on_progress)
        return await server_cache_config([f"{s.url}/metrics" for s in servers])

    # A loop of its own in a helper thread: this fixture may be set up from inside a test's
    # running event loop (an async fixture asking for it).
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        geometry = pool.submit(asyncio.run, ready()).result()
        report(f"all healthy; (num_gpu_blocks, block_size) per server: {geometry}")
    except BaseException:
        # First stop the servers (on Ctrl-C too): the helper's wait then ends at once.
        terminate_servers(servers)
        raise
    finally:
        pool.shutdown()
    fleet = Workers(urls=[s.url for s in servers[:VLLM_TIER_WORKERS]], servers=servers[:VLLM_TIER_WORKERS])
    try:
        yield RealVllmFleet(
            fleet=fleet,
            plain=servers[-1],
            install=install,
            model=VLLM_TIER_MODEL,
            block_size=geometry[0][1],
            max_model_len=VLLM_TIER_MAX_MODEL_LEN,
            kv_cache_memory_bytes=VLLM_TIER_KV_BYTES,
        )
    finally:
        terminate_servers(servers)
        report(f"stopped the vLLM servers (logs kept in {work})")


@pytest.fixture
def tier_plan(vllm_fleet: RealVllmFleet) -> Callable[..., ExperimentPlan]:
    """The tier's small experiment on the session fleet: K = 4 prefixes of 1,792 tokens (14
    blocks of 128) plus 128 unique tokens, 16 output tokens, 40 requests at concurrency 2, one
    trial; ``make(**overrides)`` sets other ExperimentPlan fields (e.g. topologies)."""

    def make(**overrides) -> ExperimentPlan:
        spec = WorkloadSpec(
            prefixes=4,
            prefix_tokens=LengthDist.fixed(1792),
            suffix_tokens=LengthDist.fixed(128),
            output_tokens=16,
            requests=40,
            seed=0,
        )
        return ExperimentPlan(
            workers=(len(vllm_fleet.servers),), specs=(spec,), concurrency=(2,), trials=1,
            timing="cpu-tiny", vocab_size=TinyModelConfig().vocab_size, **overrides,
        )

    return make


#: The folders whose tests start servers on 127.0.0.1 (emulated workers, the router, Envoy) and
#: talk to them over sockets: their tests are marked ``live``, so a quick local run can leave them
#: out with ``python -m pytest -q -m 'not vllm and not live'`` (tests/unit and tests/deploy are pure).
LIVE_FOLDERS = frozenset({"serve", "gateway", "emulator", "bench", "docs"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).resolve().parent
    for item in items:
        parts = item.path.resolve().relative_to(tests).parts
        if len(parts) > 1 and parts[0] in LIVE_FOLDERS:
            item.add_marker(pytest.mark.live)


def pytest_report_header(config: pytest.Config) -> str | None:
    if "vllm" not in str(config.getoption("markexpr", "")) or "not vllm" in str(config.getoption("markexpr", "")):
        return None
    install = VllmInstall.at()
    why = install.missing()
    return f"real vLLM tier: {why or f'{install.vllm} serving {install.model_dir}'}"




@pytest.fixture
def serve_app() -> Callable[[web.Application], contextlib.AbstractAsyncContextManager[str]]:
    """``async with serve_app(app) as url``: serve an aiohttp app on 127.0.0.1 (an ephemeral
    port) for the block's duration; ``url`` is its base URL."""

    @contextlib.asynccontextmanager
    async def serve(app: web.Application) -> AsyncIterator[str]:
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            yield f"http://127.0.0.1:{runner.addresses[0][1]}"
        finally:
            await runner.cleanup()

    return serve
