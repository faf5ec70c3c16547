"""EndpointSliceDiscovery against a local stand-in for the Kubernetes API server.

The stub on 127.0.0.1 answers the two requests the discovery makes — LIST and WATCH of
``/apis/discovery.k8s.io/v1/namespaces/<ns>/endpointslices`` — with EndpointSlice objects in the
API's wire format (what ``kubectl get endpointslice -o json`` shows for a headless Service in
front of vLLM pods), and streams watch events one line each, as the API server does. The tests
play a pod's life: ADDED (starting, then ready) → MODIFIED (terminating) → gone, and a watch
whose resourceVersion expired (410 Gone), and check the endpoint lists the discovery yields; the
last test puts a real router in front of emulated workers and checks it forgets a worker's index
entries when the worker's slice is deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from lightkube import KubeConfig
from lightkube.models.discovery_v1 import EndpointSlice as SliceModel
from support.fake_kube import END, FakeKubeApi, Handler

from kvroute.errors import UserError
from kvroute.router.discovery import Endpoint
from kvroute.router.k8s import EndpointSliceDiscovery, endpoints_from_slices

NS = "llm"
SERVICE = "kv-kvroute-workers-headless"
PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"
TOKEN = "service-account-token"

# One slice of the chart's headless Service as the API server returns it, with two vLLM pods.
RECORDED_SLICE = {
    "kind": "EndpointSlice",
    "apiVersion": "discovery.k8s.io/v1",
    "metadata": {
        "name": f"{SERVICE}-x7k2p",
        "generateName": f"{SERVICE}-",
        "namespace": NS,
        "uid": "5f0c7a52-0f61-4d8e-9a43-3c1f2b6a9d10",
        "resourceVersion": "18211",
        "generation": 4,
        "creationTimestamp": "2026-11-29T08:12:44Z",
        "labels": {
            "app.kubernetes.io/component": "worker",
            "app.kubernetes.io/instance": "kv",
            "app.kubernetes.io/name": "kvroute",
            "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            "kubernetes.io/service-name": SERVICE,
            "service.kubernetes.io/headless": "",
        },
        "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2026-11-29T08:14:02Z"},
        "ownerReferences": [{
            "apiVersion": "v1", "kind": "Service", "name": SERVICE,
            "uid": "0b7d5d1e-93a8-4c1c-a1f7-6a2d1c9a0e55", "controller": True, "blockOwnerDeletion": True,
        }],
    },
    "addressType": "IPv4",
    "endpoints": [
        {
            "addresses": ["10.244.1.17"],
            "conditions": {"ready": True, "serving": True, "terminating": False},
            "nodeName": "gpu-node-a",
            "targetRef": {"kind": "Pod", "namespace": NS, "name": "kv-kvroute-worker-6d9f8-abcde",
                          "uid": "a3f1c9e0-2b7d-4f5e-8c61-0d9e4b2a7f11"},
            "zone": "zone-a",
        },
        {
            "addresses": ["10.244.2.9"],
            "conditions": {"ready": True, "serving": True, "terminating": False},
            "nodeName": "gpu-node-b",
            "targetRef": {"kind": "Pod", "namespace": NS, "name": "kv-kvroute-worker-6d9f8-fghij",
                          "uid": "c81e0f57-6a0d-4b39-9e2e-5f7d3c1b8a22"},
            "zone": "zone-b",
        },
    ],
    "ports": [
        {"name": "kv-events", "protocol": "TCP", "port": 5557},
        {"name": "http", "protocol": "TCP", "port": 8000},
        {"name": "kv-replay", "protocol": "TCP", "port": 5558},
    ],
}
POD_A, POD_B = (e["targetRef"]["name"] for e in RECORDED_SLICE["endpoints"])
URL_A, URL_B = "http://10.244.1.17:8000", "http://10.244.2.9:8000"


def make_slice(name: str, version: int, endpoints: list[dict], ports: list[dict] | None = None) -> dict:
    """The recorded slice with other endpoints (and ports), as the controller rewrites it."""
    eps = copy.deepcopy(RECORDED_SLICE)
    eps["metadata"]["name"] = name
    eps["metadata"]["resourceVersion"] = str(version)
    eps["endpoints"] = copy.deepcopy(endpoints)
    if ports is not None:
        eps["ports"] = ports
    return eps


def pod(index: int, *, ready: bool = True, terminating: bool = False, address: str | None = None) -> dict:
    """Endpoint ``index`` of the recorded slice in the given state."""
    ep = copy.deepcopy(RECORDED_SLICE["endpoints"][index])
    ep["conditions"] = {"ready": ready, "serving": ready or terminating, "terminating": terminating}
    if address is not None:
        ep["addresses"] = [address]
    return ep


def slice_list(version: int, *slices: dict) -> dict:
    return {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
            "metadata": {"resourceVersion": str(version)}, "items": list(slices)}


def event(kind: str, obj: dict) -> dict:
    return {"type": kind, "object": obj}


def expired(version: int) -> dict:
    """The ERROR event the API server sends when a watch's resourceVersion is too old."""
    return event("ERROR", {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                           "message": f"too old resource version: {version} (18500)",
                           "reason": "Expired", "code": 410})


class FakeApiServer(FakeKubeApi):
    """LIST answers come from ``lists`` in order (a body, or an HTTP status to fail with); a
    WATCH request fails with the next status of ``watch_failures`` if any, else opens a new
    stream fed from ``watches[i]``."""

    def __init__(self) -> None:
        super().__init__()
        self.lists: list[dict | int] = []
        self.watch_failures: list[int] = []
        self.requests: list[dict[str, str]] = []

    def routes(self) -> dict[str, Handler]:
        return {PATH: self._endpointslices}

    async def _endpointslices(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append(query)
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"kind": "Status", "code": 401}, status=401)
        if query.get("watch") != "true":
            answer = self.lists.pop(0)
            if isinstance(answer, int):
                return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                          "message": "injected", "code": answer}, status=answer)
            return web.json_response(answer)
        if self.watch_failures:
            status = self.watch_failures.pop(0)
            return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                      "message": "injected", "code": status}, status=status)
        return await self.stream_watch(request)


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer()
    await server.start()
    yield server
    await server.close()


def discovery_for(api: FakeApiServer, **kwargs) -> EndpointSliceDiscovery:
    config = KubeConfig.from_dict({
        "apiVersion": "v1", "kind": "Config", "current-context": "stub",
        "clusters": [{"name": "stub", "cluster": {"server": api.url}}],
        "users": [{"name": "router", "user": {"token": TOKEN}}],
        "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "router", "namespace": NS}}],
    })
    kwargs.setdefault("retry_initial_s", 0.01)
    return EndpointSliceDiscovery(SERVICE, config=config, **kwargs)


class Follower:
    """Follows a discovery's watch in a task, as the router's pool does, keeping every list."""

    def __init__(self, discovery: EndpointSliceDiscovery) -> None:
        self.discovery = discovery
        self.lists: asyncio.Queue[list[Endpoint]] = asyncio.Queue()
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        async for endpoints in self.discovery.watch():
            self.lists.put_nowait(endpoints)

    async def next(self, timeout: float = 5.0) -> list[Endpoint]:
        return await asyncio.wait_for(self.lists.get(), timeout)

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


# --- translation of slices to endpoints ---------------------------------------------------------


def models(*slices: dict) -> list[SliceModel]:
    return [SliceModel.from_dict(s) for s in slices]


def test_recorded_slice_gives_one_ready_endpoint_per_pod_on_the_named_port():
    assert endpoints_from_slices(models(RECORDED_SLICE)) == [
        Endpoint(URL_A, POD_A, True), Endpoint(URL_B, POD_B, True),
    ]


def test_numeric_port_overrides_the_slice_ports_and_missing_named_port_skips_the_slice():
    assert [e.url for e in endpoints_from_slices(models(RECORDED_SLICE), port=9000)] == [
        "http://10.244.1.17:9000", "http://10.244.2.9:9000",
    ]
    no_http = make_slice("s", 1, [pod(0)], ports=[{"name": "kv-events", "protocol": "TCP", "port": 5557}])
    assert endpoints_from_slices(models(no_http)) == []


def test_conditions_ipv6_and_names_without_pods():
    terminating = make_slice("a", 1, [pod(0, ready=False, terminating=True)])
    v6 = make_slice("b", 1, [pod(1, address="fd00::9")])
    v6["addressType"] = "IPv6"
    bare = make_slice("c", 1, [{"addresses": ["10.0.0.5"], "hostname": "worker-5"},
                               {"addresses": ["10.0.0.6"]}])
    got = endpoints_from_slices(models(terminating, v6, bare))
    # Sorted by name. No conditions: ready, per the API. No pod and no hostname: named by URL.
    assert got == [
        Endpoint("http://10.0.0.6:8000", "http://10.0.0.6:8000", True),
        Endpoint(URL_A, POD_A, False),
        Endpoint("http://[fd00::9]:8000", POD_B, True),
        Endpoint("http://10.0.0.5:8000", "worker-5", True),
    ]


def test_an_endpoint_in_two_slices_counts_once_and_ready_wins():
    old = make_slice("old", 1, [pod(0, ready=False)])
    new = make_slice("new", 2, [pod(0, ready=True)])
    assert endpoints_from_slices(models(old, new)) == [Endpoint(URL_A, POD_A, True)]
    assert endpoints_from_slices(models(new, old)) == [Endpoint(URL_A, POD_A, True)]


# --- the watch against the stub API server ------------------------------------------------------


async def test_a_pod_lifecycle_ready_terminating_gone(api):
    api.lists.append(slice_list(18000))
    watch = Follower(discovery_for(api))
    try:
        assert await watch.next() == []
        stream = await api.watch_stream(0)
        name = RECORDED_SLICE["metadata"]["name"]

        stream.put_nowait(event("ADDED", make_slice(name, 18001, [pod(0, ready=False)])))
        assert await watch.next() == [Endpoint(URL_A, POD_A, ready=False)]  # starting

        stream.put_nowait(event("MODIFIED", make_slice(name, 18002, [pod(0), pod(1)])))
        assert await watch.next() == [Endpoint(URL_A, POD_A, True), Endpoint(URL_B, POD_B, True)]

        stream.put_nowait(event("MODIFIED", make_slice(name, 18003, [pod(0, ready=False, terminating=True), pod(1)])))
        assert await watch.next() == [Endpoint(URL_A, POD_A, False), Endpoint(URL_B, POD_B, True)]

        stream.put_nowait(event("MODIFIED", make_slice(name, 18004, [pod(1)])))
        assert await watch.next() == [Endpoint(URL_B, POD_B, True)]

        stream.put_nowait(event("DELETED", make_slice(name, 18005, [pod(1)])))
        assert await watch.next() == []
    finally:
        await watch.close()

    list_query, watch_query = api.requests[:2]
    assert list_query["labelSelector"] == f"kubernetes.io/service-name={SERVICE}"
    assert "watch" not in list_query
    # The watch starts where the list ended: nothing between them is missed.
    assert watch_query["watch"] == "true"
    assert watch_query["resourceVersion"] == "18000"
    assert watch_query["labelSelector"] == f"kubernetes.io/service-name={SERVICE}"


async def test_an_unchanged_endpoint_list_is_not_yielded_again(api):
    name = RECORDED_SLICE["metadata"]["name"]
    api.lists.append(slice_list(18000, make_slice(name, 18000, [pod(0)])))
    watch = Follower(discovery_for(api))
    try:
        assert await watch.next() == [Endpoint(URL_A, POD_A, True)]
        stream = await api.watch_stream(0)
        # A new resourceVersion with the same endpoints (e.g. a zone hint changed): no news.
        stream.put_nowait(event("MODIFIED", make_slice(name, 18001, [pod(0)])))
        stream.put_nowait(event("MODIFIED", make_slice(name, 18002, [pod(0), pod(1)])))
        assert await watch.next() == [Endpoint(URL_A, POD_A, True), Endpoint(URL_B, POD_B, True)]
    finally:
        await watch.close()


@pytest.mark.parametrize("how", ["event", "status"])
async def test_expired_watch_lists_again_at_once_and_drops_what_was_deleted_meanwhile(api, how):
    """410 Gone arrives as an ERROR event in the stream, or as the watch request's status."""
    first = make_slice("slice-1", 18000, [pod(0)])
    second = make_slice("slice-2", 18000, [pod(1)])
    api.lists.append(slice_list(18000, first, second))
    # While the watch was down, slice-1 was deleted: no DELETED event will ever say so.
    api.lists.append(slice_list(18600, second))
    if how == "status":
        api.watch_failures.append(410)
    # An expiry is no failure: a backoff this long would time the test out.
    watch = Follower(discovery_for(api, retry_initial_s=60.0))
    try:
        assert await watch.next() == [Endpoint(URL_A, POD_A, True), Endpoint(URL_B, POD_B, True)]
        if how == "event":
            (await api.watch_stream(0)).put_nowait(expired(18000))
        assert await watch.next() == [Endpoint(URL_B, POD_B, True)]
        await api.watch_stream(0 if how == "status" else 1)
    finally:
        await watch.close()
    lists = [q for q in api.requests if q.get("watch") != "true"]
    watches = [q for q in api.requests if q.get("watch") == "true"]
    assert len(lists) == 2
    assert [q["resourceVersion"] for q in watches] == ["18000", "18600"]


async def test_api_errors_are_retried_and_keep_the_last_list(api):
    api.lists += [503, slice_list(18000, make_slice("s", 18000, [pod(0)])), 403,
                  slice_list(18100, make_slice("s", 18100, [pod(1)]))]
    watch = Follower(discovery_for(api))
    try:
        # The first list fails: no workers yet (the router answers 503), then the retry works.
        assert await watch.next() == []
        assert await watch.next() == [Endpoint(URL_A, POD_A, True)]
        # The server ends the watch (its timeout): the client resumes from the last version,
        # that fails, the next list is refused too: the list stays until one succeeds.
        stream = await api.watch_stream(0)
        api.watch_failures.append(500)
        stream.put_nowait(END)
        assert await watch.next() == [Endpoint(URL_B, POD_B, True)]
        assert watch.lists.empty()
    finally:
        await watch.close()
    assert [q.get("resourceVersion") for q in api.requests if q.get("watch") == "true"] == [
        "18000", "18000", "18100"]
    assert sum(q.get("watch") != "true" for q in api.requests) == 4


# --- a router following the slices ---------------------------------------------------------------


async def test_router_drops_a_workers_index_entries_when_its_pod_leaves(api):
    """Two emulated workers behind the router, discovered through the stub; the worker that
    served a prompt holds index entries (from its KV events); once terminating it gets no new
    requests, and when its slice is deleted its entries go."""
    from kvroute.emulator import EmulatorConfig, start_workers
    from kvroute.router import EventsSettings, EventsSource, RouterConfig, start_router

    config = EmulatorConfig.for_model(
        "qwen3-0.6b", timing="instant", max_model_len=512,
        kv_events_config=json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                     "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*",
                                     "topic": "kv-events"}),
    )
    workers = await start_workers(config, 2)
    names = ["kv-kvroute-worker-0", "kv-kvroute-worker-1"]
    # One slice per worker: on one host the workers differ by port, and a slice has one port set.
    slices = [
        make_slice(f"slice-{i}", 100 + i,
                   [{"addresses": ["127.0.0.1"], "conditions": {"ready": True},
                     "targetRef": {"kind": "Pod", "namespace": NS, "name": names[i]}}],
                   ports=[{"name": "http", "protocol": "TCP", "port": w.port}])
        for i, w in enumerate(workers)
    ]
    api.lists.append(slice_list(200, *slices))
    events = EventsSettings(topic="kv-events", per_worker={
        names[i]: EventsSource(w.kv_events_endpoint, w.kv_events_replay_endpoint) for i, w in enumerate(workers)
    })
    router_config = RouterConfig(discovery=discovery_for(api), policy="kv-aware", events=events,
                                 block_size=config.block_size, health_interval_s=0)
    try:
        async with start_router(router_config) as router:
            stream = await api.watch_stream(0)
            prompt = list(range(1000, 1000 + 8 * config.block_size))
            async with aiohttp.ClientSession() as session:
                served = None
                # PUB/SUB drops what is published before a subscriber is connected: send until
                # the index has the served worker's blocks from its events.
                for _ in range(100):
                    async with session.post(f"{router.url}/v1/completions",
                                            json={"model": config.model_name, "prompt": prompt,
                                                  "max_tokens": 1}) as resp:
                        assert resp.status == 200
                        served = resp.headers["x-kvroute-worker"]
                    # Event-backed entries (predicted ones appear at once, without events).
                    if router.index.stats().blocks >= 8:
                        break
                    await asyncio.sleep(0.05)
            assert served in names
            assert router.index.stats().blocks >= 8

            gone = names.index(served)
            # Terminating: the worker still holds the prefix, but new requests go elsewhere.
            leaving = copy.deepcopy(slices[gone])
            leaving["endpoints"][0]["conditions"] = {"ready": False, "serving": True, "terminating": True}
            stream.put_nowait(event("MODIFIED", leaving))
            for _ in range(100):
                if not router.worker_statuses()[served].ready:
                    break
                await asyncio.sleep(0.02)
            async with aiohttp.ClientSession() as session:
                async with session.post(f"{router.url}/v1/completions",
                                        json={"model": config.model_name, "prompt": prompt, "max_tokens": 1}) as resp:
                    assert resp.status == 200
                    assert resp.headers["x-kvroute-worker"] == names[1 - gone]
            assert router.index.worker_blocks(served) >= 8  # its cache still exists: entries stay

            stream.put_nowait(event("DELETED", leaving))
            for _ in range(100):
                if served not in router.worker_statuses():
                    break
                await asyncio.sleep(0.02)
            assert set(router.worker_statuses()) == {names[1 - gone]}
            assert router.index.worker_blocks(served) == 0
            assert router.index.stats().workers == 1  # only the remaining worker is indexed
    finally:
        await asyncio.gather(*(w.close() for w in workers))


def test_without_credentials_the_error_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(UserError, match="no Kubernetes API credentials.*--dns NAME:PORT"):
        EndpointSliceDiscovery(SERVICE)


@pytest.mark.parametrize("spec, expected", [
    ("llm/kv-kvroute-workers-headless:http", ("llm", "kv-kvroute-workers-headless", "http")),
    ("vllm-headless", ("default-ns", "vllm-headless", "http")),
    ("team-a/vllm:8000", ("team-a", "vllm", 8000)),
])
def test_k8s_service_flag(spec, expected):
    config = KubeConfig.from_server("http://127.0.0.1:1", namespace="default-ns")
    discovery = EndpointSliceDiscovery.from_spec(spec, config=config)
    assert (discovery.namespace, discovery.service, discovery.port) == expected


@pytest.mark.parametrize("spec", ["", "a/b/c", "vllm:0", "vllm:", "Vllm", "llm/", "vllm:http_port"])
def test_bad_k8s_service_flag(spec):
    config = KubeConfig.from_server("http://127.0.0.1:1", namespace="default-ns")
    with pytest.raises(UserError, match=r"bad --k8s-service .*\[NAMESPACE/\]SERVICE\[:PORT\]"):
        EndpointSliceDiscovery.from_spec(spec, config=config)


async def test_peer_replicas_from_endpointslices_are_followed_and_let_go(api):
    """``--peer-k8s-service``: a router follows the routers' EndpointSlices as it follows workers'
    and subscribes to each ready pod's mesh port; a pod gone from the slice is let go."""
    from kvroute.router import RouterConfig, start_router

    def config(**kwargs) -> RouterConfig:
        return RouterConfig(workers=["http://127.0.0.1:9"], policy="kv-aware", retention="off",
                            health_interval_s=0, mesh_bind="127.0.0.1:0", **kwargs)

    def peers_live(router) -> float:
        return sum(float(line.split()[-1]) for line in router.metrics_text().splitlines()
                   if line.startswith("kvroute_mesh_peers_live"))

    async def until(check, limit_s: float) -> None:
        for _ in range(int(limit_s / 0.05)):
            if check():
                return
            await asyncio.sleep(0.05)
        raise AssertionError("not within the limit")

    async with start_router(config()) as a:
        port = int(a.mesh_address.rpartition(":")[2])
        peer = make_slice("routers-1", 10, [pod(0, address="127.0.0.1")],
                          ports=[{"name": "mesh", "protocol": "TCP", "port": port}])
        api.lists.append(slice_list(10))
        async with start_router(config(peer_discovery=discovery_for(api, port="mesh"))) as b:
            stream = await api.watch_stream(0)
            await stream.put(event("ADDED", peer))
            await until(lambda: peers_live(b) == 1, 5.0)
            await stream.put(event("DELETED", peer))
            # Let go: no more heartbeats heard, gone after the liveness window (3 s).
            await until(lambda: peers_live(b) == 0, 8.0)


def test_peer_k8s_service_needs_mesh_bind_and_a_good_spec(capsys):
    from kvroute.cli import main

    assert main(["serve", "--worker", "http://127.0.0.1:9", "--peer-k8s-service", "llm/routers"]) == 2
    assert "need --mesh-bind" in capsys.readouterr().err
    assert main(["serve", "--worker", "http://127.0.0.1:9", "--mesh-bind", "127.0.0.1:0",
                 "--peer-k8s-service", "Bad_Name"]) == 2
    err = capsys.readouterr().err
    assert "bad --peer-k8s-service" in err and "Traceback" not in err
