"""Workers from the Kubernetes API: the EndpointSlices of a Service, watched.

DNS discovery (:class:`~kvroute.router.discovery.DnsDiscovery`) sees only the addresses of ready
pods, a few seconds late, and cannot tell a pod that is shutting down from one that is gone.
EndpointSlices carry each pod's conditions the moment the control plane changes them:

* ``ready`` — passes its readiness probe: gets requests;
* ``terminating`` — being deleted (``ready`` is then false): no new requests, but its in-flight
  ones finish and its events keep flowing until the pod is gone;
* absent from every slice — gone: the router forgets the worker and its index entries.

An endpoint that is neither ready nor terminating (starting, or failing its probe) is listed
with ``ready=False``: its engine, and its cache, still exist.

The watch follows the informer pattern of Kubernetes controllers: LIST the Service's slices
(label ``kubernetes.io/service-name``), then WATCH from the list's ``resourceVersion``. When the
API server says that version has expired (410 Gone, e.g. after a long disconnect) or the watch
fails, everything is LISTed again — a watch resumed from scratch would replay ADDED events but
never the DELETED ones missed meanwhile.

Client: lightkube's ``AsyncClient``. It is asyncio-native (the router's loop watches without a
thread), ships typed models of ``discovery.k8s.io/v1`` objects, and reads in-cluster service
account credentials or a kubeconfig by itself; the official ``kubernetes`` client is synchronous
and would need a thread per watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Iterable

from lightkube import ApiError, AsyncClient, ConfigError, KubeConfig
from lightkube.generic_resource import create_namespaced_resource
from lightkube.models.core_v1 import Pod as PodModel
from lightkube.models.discovery_v1 import EndpointSlice as EndpointSliceModel
from lightkube.resources.core_v1 import Pod
from lightkube.resources.discovery_v1 import EndpointSlice
from lightkube.types import OnErrorAction, OnErrorResult

from kvroute.errors import UserError
from kvroute.router.discovery import Endpoint

logger = logging.getLogger(__name__)

#: The label the EndpointSlice controller puts on every slice of a Service.
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
#: Names of Services and namespaces (RFC 1123 labels) and of Service ports (IANA service names).
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_PORT_NAME = re.compile(r"(?=.*[a-z])[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?")
#: HTTP status of a watch whose resourceVersion is older than the server keeps.
_GONE = 410
#: The base error of lightkube's HTTP library (httpx2 from lightkube 1.0 on, httpx before):
#: every API or transport failure of a list or a watch is one.
_HTTPError: type[Exception] = next(c for c in ApiError.__mro__ if c.__name__ == "HTTPError")


def _url_host(address: str, address_type: str | None) -> str:
    return f"[{address}]" if address_type == "IPv6" else address


def _slice_port(eps: EndpointSliceModel, port: int | str) -> int | None:
    """The workers' HTTP port in this slice: ``port`` itself when a number, else the number of
    the slice port of that name (None when the slice has none)."""
    if isinstance(port, int):
        return port
    for p in eps.ports or ():
        if p.name == port and p.port is not None:
            return p.port
    return None


def endpoints_from_slices(
    slices: Iterable[EndpointSliceModel], port: int | str = "http", scheme: str = "http"
) -> list[Endpoint]:
    """The workers the slices describe, sorted by name.

    Args:
        slices: the Service's EndpointSlices.
        port: the workers' HTTP port: a number, or the name of the Service port (the slices
            carry its number; a slice without that port is skipped).
        scheme: ``http`` or ``https``.

    Each endpoint is named after its pod (``targetRef``), else its hostname, else its URL. An
    address listed by two slices (the controller moves endpoints between slices) counts once,
    ready if either slice says so. A missing ``ready`` condition means ready (the API's rule).
    """
    found: dict[str, Endpoint] = {}
    for eps in slices:
        number = _slice_port(eps, port)
        if number is None:
            logger.debug("slice %s has no port %r; skipped", eps.metadata.name if eps.metadata else "?", port)
            continue
        for ep in eps.endpoints or ():
            if not ep.addresses:
                continue
            # kube-proxy too uses the first address: the others are the same pod's.
            url = f"{scheme}://{_url_host(ep.addresses[0], eps.addressType)}:{number}"
            ref = ep.targetRef
            if ref is not None and ref.kind == "Pod" and ref.name:
                name = ref.name
            else:
                name = ep.hostname or url
            ready = ep.conditions is None or ep.conditions.ready is not False
            previous = found.get(url)
            if previous is not None:
                ready = ready or previous.ready
            found[url] = Endpoint(url, name, ready)
    return sorted(found.values(), key=lambda e: (e.name, e.url))


class EndpointSliceDiscovery:
    """The pods behind a Kubernetes Service, from its EndpointSlices (list, then watch).

    Needs ``get``, ``list`` and ``watch`` on ``endpointslices`` (API group
    ``discovery.k8s.io``) in ``namespace`` — the Role the Helm chart creates.

    Args:
        service: the Service's name (the chart's headless ``<release>-kvroute-workers-headless``).
        namespace: its namespace; default: the credentials' (in a pod, the pod's own).
        port: the workers' HTTP port: a number, or the Service port's name.
        config: API server and credentials; default: the pod's service account, else
            ``$KUBECONFIG`` or ``~/.kube/config``.
        server_timeout_s: the API server ends each watch request after this long (the client
            then resumes from the last version seen): bounds how long a silently dead
            connection can go unnoticed.
        retry_initial_s / retry_max_s: backoff between attempts after a failed list or
            watch, doubling up to the maximum.
        scheme: ``http`` or ``https`` for the worker URLs.

    Raises:
        UserError: when no credentials are found.
    """

    def __init__(
        self,
        service: str,
        namespace: str | None = None,
        *,
        port: int | str = "http",
        config: KubeConfig | None = None,
        server_timeout_s: int = 300,
        retry_initial_s: float = 0.5,
        retry_max_s: float = 30.0,
        scheme: str = "http",
    ) -> None:
        if config is None:
            try:
                config = KubeConfig.from_env()
            except ConfigError as exc:
                raise UserError(
                    "no Kubernetes API credentials: not running in a pod with a service account "
                    f"token, and no kubeconfig ({exc}); use --dns NAME:PORT instead"
                ) from None
        self.service = service
        self.config = config
        self.namespace = namespace or config.get().namespace
        self.port = port
        self.server_timeout_s = server_timeout_s
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.scheme = scheme

    @classmethod
    def from_spec(cls, spec: str, flag: str = "--k8s-service", **options) -> EndpointSliceDiscovery:
        """From ``[NAMESPACE/]SERVICE[:PORT]`` (the ``--k8s-service`` flag), e.g.
        ``llm/kv-kvroute-workers-headless:http``. PORT is the workers' port number or the
        Service port's name (default ``http``); NAMESPACE defaults to the credentials' (in a pod,
        its own). ``flag`` names the flag in the error; ``options`` go to the constructor.

        Raises:
            UserError: on a malformed spec, or when no credentials are found.
        """
        text = spec.strip()
        rest, colon, port_text = text.rpartition(":")
        if not colon:
            rest, port_text = text, "http"
        namespace, _, service = rest.rpartition("/")
        port: int | str = int(port_text) if port_text.isdigit() else port_text
        if (
            not _DNS_LABEL.fullmatch(service)
            or (namespace and not _DNS_LABEL.fullmatch(namespace))
            or (isinstance(port, int) and not 0 < port <= 65535)
            or (isinstance(port, str) and not _PORT_NAME.fullmatch(port))
        ):
            raise UserError(
                f"bad {flag} {spec!r}: expected [NAMESPACE/]SERVICE[:PORT], "
                "e.g. llm/kv-kvroute-workers-headless:http"
            )
        return cls(service, namespace or None, port=port, **options)

    #: The resource listed and watched, and what its objects are called in log lines.
    _resource = EndpointSlice
    _what = "EndpointSlices"

    @property
    def _source(self) -> str:
        return f"service {self.namespace}/{self.service}"

    async def _labels(self, client: AsyncClient) -> dict[str, str]:
        """The label selector of the objects to follow (read again at each LIST)."""
        return {SERVICE_NAME_LABEL: self.service}

    def _endpoints(self, slices: dict[str, EndpointSliceModel]) -> list[Endpoint]:
        return endpoints_from_slices(slices.values(), self.port, self.scheme)

    async def _list(self, client: AsyncClient) -> tuple[dict[str, object], str, dict[str, str]]:
        labels = await self._labels(client)
        listing = client.list(self._resource, namespace=self.namespace, labels=labels)
        objects = {obj.metadata.name: obj async for obj in listing}
        return objects, listing.resourceVersion, labels

    async def watch(self) -> AsyncIterator[list[Endpoint]]:
        """Yield the complete endpoint list at start and whenever it changes.

        A failed first list yields ``[]`` (the router starts with no workers and answers 503)
        and is retried; a failure later keeps the last list until the API answers again.
        """
        client = AsyncClient(config=self.config, namespace=self.namespace)
        current: list[Endpoint] | None = None
        delay = self.retry_initial_s
        watch_error: list[Exception] = []

        def stop_on_error(exc: Exception, count: int) -> OnErrorResult:
            # Any watch failure ends this watch; the loop below re-lists.
            watch_error.append(exc)
            return OnErrorResult(OnErrorAction.STOP)

        try:
            while True:
                try:
                    slices, version, labels = await self._list(client)
                except _HTTPError as exc:
                    logger.warning(
                        "cannot list %s of %s: %s; retrying in %.1f s",
                        self._what, self._source, _describe(exc), delay,
                    )
                    if current is None:
                        current = []
                        yield current
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self.retry_max_s)
                    continue
                endpoints = self._endpoints(slices)
                if endpoints != current:
                    current = endpoints
                    yield current

                watch_error.clear()
                watch = client.watch(
                    self._resource,
                    namespace=self.namespace,
                    labels=labels,
                    resource_version=version,
                    server_timeout=self.server_timeout_s,
                    on_error=stop_on_error,
                )
                async with contextlib.aclosing(watch) as events:
                    async for kind, eps in events:
                        # A working watch, not just a working list (a watch refused right after
                        # every list must not hammer the API server), resets the backoff.
                        delay = self.retry_initial_s
                        if kind == "DELETED":
                            slices.pop(eps.metadata.name, None)
                        elif kind in ("ADDED", "MODIFIED"):
                            slices[eps.metadata.name] = eps
                        else:
                            continue
                        endpoints = self._endpoints(slices)
                        if endpoints != current:
                            current = endpoints
                            yield current

                # The watch ended: its version expired, or it failed. Re-list either way.
                exc = watch_error[0] if watch_error else None
                if exc is not None and _status_code(exc) == _GONE:
                    logger.info("%s watch of %s expired; listing again", self._what, self._source)
                    continue
                logger.warning(
                    "%s watch of %s failed: %s; listing again in %.1f s",
                    self._what, self._source, _describe(exc), delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.retry_max_s)
        finally:
            await client.close()


#: The InferencePool resource of the Gateway API Inference Extension (its v1 API).
InferencePool = create_namespaced_resource("inference.networking.k8s.io", "v1", "InferencePool", "inferencepools")


def pod_ready(pod: PodModel) -> bool:
    """Whether a pod takes requests: an IP, not being deleted, its ``Ready`` condition true."""
    status = pod.status
    if status is None or not status.podIP or (pod.metadata and pod.metadata.deletionTimestamp):
        return False
    return any(c.type == "Ready" and c.status == "True" for c in status.conditions or ())


def endpoints_from_pods(pods: Iterable[PodModel], ports: Iterable[int], scheme: str = "http") -> list[Endpoint]:
    """The ready pods as workers, one per pod and target port (an InferencePool's rule: each
    ``podIP:port`` is an endpoint), sorted by name. A pod of several ports is named
    ``POD:PORT``."""
    ports = list(ports)
    found = []
    for pod in pods:
        if not pod_ready(pod):
            continue
        host = f"[{pod.status.podIP}]" if ":" in pod.status.podIP else pod.status.podIP
        for port in ports:
            name = pod.metadata.name if len(ports) == 1 else f"{pod.metadata.name}:{port}"
            found.append(Endpoint(f"{scheme}://{host}:{port}", name, True))
    return sorted(found, key=lambda e: (e.name, e.url))


class InferencePoolDiscovery(EndpointSliceDiscovery):
    """The ready pods of a Gateway API Inference Extension ``InferencePool``
    (``inference.networking.k8s.io/v1``): its ``spec.selector.matchLabels`` picks the pods in
    its namespace, each of its ``spec.targetPorts`` makes one worker per pod. Pods are listed
    and watched as the EndpointSlices are (:class:`EndpointSliceDiscovery`); the pool itself is
    read again at every LIST (a changed selector or port is followed then).

    Needs ``get`` on ``inferencepools`` (group ``inference.networking.k8s.io``) and ``get``,
    ``list``, ``watch`` on ``pods`` in the pool's namespace.
    """

    _resource = Pod
    _what = "Pods"

    def __init__(self, pool: str, namespace: str | None = None, **options) -> None:
        super().__init__(pool, namespace, **options)
        self.ports: list[int] = []

    @classmethod
    def from_spec(cls, spec: str, **options) -> InferencePoolDiscovery:
        """From ``[NAMESPACE/]NAME`` (the ``--pool`` flag).

        Raises:
            UserError: on a malformed spec, or when no credentials are found.
        """
        namespace, _, name = spec.strip().rpartition("/")
        if not _DNS_LABEL.fullmatch(name) or (namespace and not _DNS_LABEL.fullmatch(namespace)):
            raise UserError(f"bad --pool {spec!r}: expected [NAMESPACE/]NAME, e.g. llm/kv-kvroute-pool")
        return cls(name, namespace or None, **options)

    @property
    def _source(self) -> str:
        return f"InferencePool {self.namespace}/{self.service}"

    async def _labels(self, client: AsyncClient) -> dict[str, str]:
        pool = await client.get(InferencePool, self.service, namespace=self.namespace)
        spec = pool.get("spec") or {}
        labels = (spec.get("selector") or {}).get("matchLabels") or {}
        self.ports = [int(p["number"]) for p in spec.get("targetPorts") or () if "number" in p]
        if not labels or not self.ports:
            # The API server's schema requires both: say so rather than follow every pod.
            raise UserError(f"{self._source} has no selector.matchLabels or no targetPorts")
        return dict(labels)

    def _endpoints(self, pods: dict[str, PodModel]) -> list[Endpoint]:
        return endpoints_from_pods(pods.values(), self.ports, self.scheme)


def _status_code(exc: Exception) -> int | None:
    """The HTTP status of an API failure: from the Status object the server sent in a watch
    stream (ApiError), else from the response; None for a transport failure."""
    if isinstance(exc, ApiError) and exc.status is not None and exc.status.code is not None:
        return exc.status.code
    response = getattr(exc, "response", None)  # an HTTPStatusError: the request got an answer
    return response.status_code if response is not None else None


def _describe(exc: Exception | None) -> str:
    if exc is None:
        return "the stream ended"
    code = _status_code(exc)
    if code is None:
        return str(exc) or type(exc).__name__
    message = exc.status.message if isinstance(exc, ApiError) and exc.status is not None else None
    return f"HTTP {code}" + (f" ({message})" if message else "")
