"""InferencePoolDiscovery (``--pool``) against a local stand-in for the Kubernetes API server:
the pool (``inference.networking.k8s.io/v1``, its selector and target ports) is read, then its
pods are listed and watched; only ready pods are workers, one per pod and target port."""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from lightkube import KubeConfig
from support.fake_kube import FakeKubeApi, Handler

from kvroute.errors import UserError
from kvroute.router.discovery import Endpoint
from kvroute.router.k8s import InferencePoolDiscovery

NS, POOL = "llm", "kv-kvroute-pool"
TOKEN = "service-account-token"
LABELS = {"app.kubernetes.io/name": "kvroute", "app.kubernetes.io/component": "worker"}
POOL_OBJECT = {
    "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
    "metadata": {"name": POOL, "namespace": NS, "resourceVersion": "700"},
    "spec": {"selector": {"matchLabels": LABELS}, "targetPorts": [{"number": 8000}],
             "endpointPickerRef": {"name": "kv-kvroute-epp", "port": {"number": 9002}, "failureMode": "FailClose"}},
}


def pod(name: str, ip: str | None, *, ready: bool = True, deleting: bool = False) -> dict:
    """A vLLM pod as the API server returns it (the parts discovery reads, and some others)."""
    obj = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": dict(LABELS), "resourceVersion": "800"},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0"}]},
        "status": {"phase": "Running", "conditions": [
            {"type": "Initialized", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
            {"type": "ContainersReady", "status": "True" if ready else "False"},
        ]},
    }
    if ip:
        obj["status"]["podIP"] = ip
    if deleting:
        obj["metadata"]["deletionTimestamp"] = "2026-12-04T10:00:00Z"
    return obj


class FakeApiServer(FakeKubeApi):
    """Answers GET of the pool, LIST of pods (the next of ``lists``) and WATCH of pods (a stream
    fed from a queue per watch); records each pod request's query."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = copy.deepcopy(POOL_OBJECT)
        self.lists: list[list[dict]] = []
        self.pod_queries: list[dict] = []

    def routes(self) -> dict[str, Handler]:
        return {
            f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools/{POOL}": self._pool,
            f"/api/v1/namespaces/{NS}/pods": self._pods,
        }

    async def _pool(self, request: web.Request) -> web.Response:
        assert request.headers.get("Authorization") == f"Bearer {TOKEN}"
        return web.json_response(self.pool)

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.pod_queries.append(query)
        if query.get("watch") != "true":
            return web.json_response({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "900"},
                                      "items": self.lists.pop(0)})
        return await self.stream_watch(request)


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer()
    await server.start()
    yield server
    await server.close()


def discovery_for(api: FakeApiServer) -> InferencePoolDiscovery:
    config = KubeConfig.from_dict({
        "apiVersion": "v1", "kind": "Config", "current-context": "stub",
        "clusters": [{"name": "stub", "cluster": {"server": api.url}}],
        "users": [{"name": "epp", "user": {"token": TOKEN}}],
        "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "epp", "namespace": NS}}],
    })
    return InferencePoolDiscovery.from_spec(f"{NS}/{POOL}", config=config, retry_initial_s=0.01)


class Follower:
    """Follows a discovery's watch in a task, as the router does, keeping every list."""

    def __init__(self, discovery: InferencePoolDiscovery) -> None:
        self.lists: asyncio.Queue[list[Endpoint]] = asyncio.Queue()
        self.task = asyncio.ensure_future(self._run(discovery))

    async def _run(self, discovery: InferencePoolDiscovery) -> None:
        async for endpoints in discovery.watch():
            self.lists.put_nowait(endpoints)

    async def next(self) -> list[Endpoint]:
        return await asyncio.wait_for(self.lists.get(), 5)

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def test_the_pools_ready_pods_are_followed(api):
    api.lists.append([pod("w-a", "10.244.1.17"), pod("w-b", "10.244.2.9", ready=False), pod("w-c", None)])
    lists = Follower(discovery_for(api))
    try:
        assert await lists.next() == [Endpoint("http://10.244.1.17:8000", "w-a", True)]
        # The pods were selected by the pool's labels.
        selector = api.pod_queries[0]["labelSelector"]
        assert set(selector.split(",")) == {f"{k}={v}" for k, v in LABELS.items()}
        watch = await api.watch_stream(0)
        watch.put_nowait({"type": "MODIFIED", "object": pod("w-b", "10.244.2.9")})
        assert [e.name for e in await lists.next()] == ["w-a", "w-b"]
        # Terminating (deletionTimestamp set): no new requests; then gone.
        watch.put_nowait({"type": "MODIFIED", "object": pod("w-a", "10.244.1.17", deleting=True)})
        assert [e.name for e in await lists.next()] == ["w-b"]
        watch.put_nowait({"type": "DELETED", "object": pod("w-a", "10.244.1.17", deleting=True)})
        watch.put_nowait({"type": "ADDED", "object": pod("w-d", "fd00::7")})
        assert await lists.next() == [
            Endpoint("http://10.244.2.9:8000", "w-b", True), Endpoint("http://[fd00::7]:8000", "w-d", True)]
    finally:
        await lists.close()


async def test_each_target_port_is_a_worker(api):
    api.pool["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8001}]
    api.lists.append([pod("w-a", "10.244.1.17")])
    lists = Follower(discovery_for(api))
    try:
        assert await lists.next() == [
            Endpoint("http://10.244.1.17:8000", "w-a:8000", True), Endpoint("http://10.244.1.17:8001", "w-a:8001", True)]
    finally:
        await lists.close()


@pytest.mark.parametrize("spec", ["", "Bad_Name", "a/b/c", "ns/"])
def test_a_bad_pool_spec_is_one_clear_error(spec):
    with pytest.raises(UserError, match="bad --pool"):
        InferencePoolDiscovery.from_spec(spec, config=KubeConfig.from_server("http://127.0.0.1:1"))
