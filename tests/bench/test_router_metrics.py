"""The bench's reading of router replicas' refresh counters (issue 44).

Two real routers (in this process, each on its own port) behind the Service balancer: read
through the balancer, ``/metrics`` answers from one replica or the other, so the reader must
say so and count nothing; read replica by replica (``--router-metrics-url``), the counts add
up; two URLs that reach one router are refused (its refreshes would count twice)."""

from __future__ import annotations

import contextlib

import pytest

from kvroute.bench.router_metrics import (
    RouterMetricsReader,
    RouterReading,
    RouterRefreshes,
    parse_router_metrics,
    router_metrics_url,
)
from kvroute.errors import UserError
from kvroute.router import RouterConfig, start_router
from kvroute.service import TcpBalancer

PAGE = """# TYPE kvroute_router_info gauge
kvroute_router_info{instance="1a-2b"} 1
kvroute_retention_refreshes_total{worker="http://w0"} 3.0
kvroute_retention_refreshes_total{worker="http://w1"} 4.0
kvroute_retention_refreshes_open 1.0
kvroute_retention_refresh_prompt_tokens_total 70.0
"""


def test_a_page_gives_its_instance_and_refreshes_summed_over_workers():
    reading = parse_router_metrics(PAGE)
    assert reading == RouterReading("1a-2b", RouterRefreshes(sent=7, open=1, prompt_tokens=70))
    assert parse_router_metrics("vllm:prefix_cache_hits_total 3\n") is None


def test_metrics_urls_from_a_base_a_v1_base_or_the_page_itself():
    assert router_metrics_url("http://r0:8000") == "http://r0:8000/metrics"
    assert router_metrics_url("http://r0:8000/v1/") == "http://r0:8000/metrics"
    assert router_metrics_url("r0:8000/metrics") == "http://r0:8000/metrics"


def test_a_window_over_which_a_replica_restarted_is_not_counted():
    warnings: list[str] = []
    reader = RouterMetricsReader(("http://r0:1", "http://r1:1"), "http://lb:1", warn=warnings.append)
    before = [RouterReading("a", RouterRefreshes(sent=5)), RouterReading("b", RouterRefreshes(sent=2))]
    after = [RouterReading("a", RouterRefreshes(sent=9)), RouterReading("b", RouterRefreshes(sent=3))]
    assert reader.window(before, after) == RouterRefreshes(sent=5)
    restarted = [after[0], RouterReading("c", RouterRefreshes(sent=1))]
    assert reader.window(before, restarted) is None
    assert len(warnings) == 1 and "restarted" in warnings[0]


@contextlib.asynccontextmanager
async def _two_replicas():
    """Two routers (no worker answers: their pages are all that is read) behind the balancer."""
    config = RouterConfig(workers=["http://127.0.0.1:9"], health_interval_s=0)
    async with start_router(config) as r0, start_router(config) as r1:
        balancer = TcpBalancer([("127.0.0.1", r0.native.port), ("127.0.0.1", r1.native.port)])
        await balancer.start()
        try:
            yield f"http://127.0.0.1:{balancer.port}", (r0.url, r1.url)
        finally:
            await balancer.close()


async def test_through_a_balancer_the_reader_says_so_and_counts_nothing():
    async with _two_replicas() as (url, _):
        warnings: list[str] = []
        reader = RouterMetricsReader((), url, warn=warnings.append)
        assert await reader.read() is None
        assert len(warnings) == 1 and "--router-metrics-url" in warnings[0]


async def test_every_replica_read_and_summed():
    async with _two_replicas() as (url, replicas):
        reader = RouterMetricsReader(replicas, url)
        before = await reader.read()
        assert before is not None and len({r.instance for r in before}) == 2
        assert reader.window(before, await reader.read()) == RouterRefreshes()


async def test_two_urls_of_one_router_are_refused():
    async with _two_replicas() as (_, (r0, _r1)):
        other_name = r0.replace("127.0.0.1", "localhost")
        reader = RouterMetricsReader((r0, other_name), r0)
        with pytest.raises(UserError, match="same router"):
            await reader.read()
