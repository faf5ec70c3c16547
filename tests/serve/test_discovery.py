"""Worker discovery: URL normalization, the watched file, DNS re-resolution (with an injected
resolver), and the router following membership changes."""

from __future__ import annotations

import asyncio
import os
import time

import aiohttp
import pytest

from kvroute.emulator import EmulatorConfig, start_workers
from kvroute.errors import UserError
from kvroute.router import (
    WORKER_HEADER,
    DnsDiscovery,
    Endpoint,
    FileDiscovery,
    RouterConfig,
    StaticDiscovery,
    start_router,
)
from kvroute.router.discovery import normalize_worker_url


@pytest.mark.parametrize(
    "text, url",
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000"),
        ("10.0.0.5:8001", "http://10.0.0.5:8001"),
        ("http://[::1]:8000/v1/", "http://[::1]:8000"),
    ],
)
def test_worker_urls_are_normalized(text, url):
    assert normalize_worker_url(text) == url


@pytest.mark.parametrize("text", ["http://host", "http://host:80/api", "ftp://h:1", "http://h:99999", "http://h:1?x=1"])
def test_bad_worker_urls_are_user_errors(text):
    with pytest.raises(UserError):
        normalize_worker_url(text)


def test_static_discovery_refuses_duplicates():
    with pytest.raises(UserError, match="twice"):
        StaticDiscovery(["http://a:1", "http://a:1/v1"])


async def next_list(watch, timeout: float = 3.0) -> list[str]:
    return [e.url for e in await asyncio.wait_for(watch.__anext__(), timeout)]


async def test_file_discovery_follows_edits_and_survives_bad_ones(tmp_path):
    path = tmp_path / "workers.txt"
    path.write_text("# fleet\nhttp://10.0.0.1:8000\n\n10.0.0.2:8000  # second\n")
    watch = FileDiscovery(path, interval_s=0.02).watch()
    assert await next_list(watch) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    # A malformed edit keeps the last good list; the next good edit is taken.
    path.write_text("http://10.0.0.1\n")
    pending = asyncio.ensure_future(next_list(watch))
    await asyncio.sleep(0.15)
    assert not pending.done()
    path.write_text("http://10.0.0.3:8000\n")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert await pending == ["http://10.0.0.3:8000"]


async def test_file_discovery_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="cannot read"):
        await FileDiscovery(tmp_path / "nope").watch().__anext__()


async def test_dns_discovery_yields_changes_only_and_keeps_the_list_on_lookup_errors():
    answers = [["10.0.0.2", "10.0.0.1"], ["10.0.0.1", "10.0.0.2"], OSError("SERVFAIL"), ["10.0.0.1", "fd00::5"]]

    async def resolver(host: str, port: int):
        assert (host, port) == ("vllm-headless", 8000)
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    watch = DnsDiscovery("vllm-headless", 8000, interval_s=0.01, resolver=resolver).watch()
    assert await next_list(watch) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    # The same set again and the failed lookup yield nothing; the change does.
    assert await next_list(watch) == ["http://10.0.0.1:8000", "http://[fd00::5]:8000"]


def test_dns_spec_parsing():
    d = DnsDiscovery.from_spec("vllm.default.svc:8000")
    assert (d.host, d.port) == ("vllm.default.svc", 8000)
    with pytest.raises(UserError):
        DnsDiscovery.from_spec("vllm")


async def test_router_follows_dns_membership():
    config = EmulatorConfig.for_model("qwen3-0.6b", timing="instant", max_model_len=512)
    # Two workers on the same port of two loopback addresses, as pods behind a Service.
    (a,) = await start_workers(config, 1, host="127.0.0.1")
    (b,) = await start_workers(config, 1, host="127.0.0.2", base_port=a.port)
    addresses = {"now": ["127.0.0.1"]}

    async def resolver(host: str, port: int):
        return addresses["now"]

    discovery = DnsDiscovery("workers", a.port, interval_s=0.02, resolver=resolver)
    try:
        async with start_router(RouterConfig(discovery=discovery, policy="round-robin")) as router, \
                aiohttp.ClientSession() as s:

            async def served_by() -> str:
                async with s.post(f"{router.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}) as r:
                    assert r.status == 200
                    return r.headers[WORKER_HEADER]

            assert {await served_by() for _ in range(3)} == {a.url}
            addresses["now"] = ["127.0.0.1", "127.0.0.2"]
            while len(router.worker_statuses()) < 2:
                await asyncio.sleep(0.01)
            assert {await served_by() for _ in range(4)} == {a.url, b.url}
            router.index.record_routed(a.url, [11, 12], time.monotonic())
            addresses["now"] = ["127.0.0.2"]
            while a.url in router.worker_statuses():
                await asyncio.sleep(0.01)
            assert {await served_by() for _ in range(3)} == {b.url}
            assert router.index.worker_blocks(a.url) == 0
    finally:
        await asyncio.gather(a.close(), b.close())


async def test_not_ready_endpoints_get_no_new_requests():
    config = EmulatorConfig.for_model("qwen3-0.6b", timing="instant", max_model_len=512)
    a, b = await start_workers(config, 2)

    class Switchable:
        def __init__(self) -> None:
            self.lists: asyncio.Queue = asyncio.Queue()

        async def watch(self):
            while True:
                yield await self.lists.get()

    discovery = Switchable()
    discovery.lists.put_nowait([Endpoint(a.url, "pod-a"), Endpoint(b.url, "pod-b")])
    try:
        async with start_router(RouterConfig(discovery=discovery, policy="round-robin")) as router, \
                aiohttp.ClientSession() as s:
            discovery.lists.put_nowait([Endpoint(a.url, "pod-a", ready=False), Endpoint(b.url, "pod-b")])
            while len(router.available_workers()) != 1:
                await asyncio.sleep(0.01)
            for _ in range(3):
                async with s.post(f"{router.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}) as r:
                    assert r.headers[WORKER_HEADER] == "pod-b"
    finally:
        await asyncio.gather(a.close(), b.close())
