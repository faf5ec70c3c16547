"""Where the workers are: a static list, a watched file, or a DNS name.

Every source implements one protocol, :class:`Discovery`: an async iterator that yields the
*complete* current endpoint list at start and again whenever it changes. The worker pool diffs
consecutive lists itself, so a source never has to report additions and removals separately
(and a missed update cannot leave the pool inconsistent: the next list is the whole truth).

* :class:`StaticDiscovery` — the ``--worker URL`` flags; yields once.
* :class:`FileDiscovery` — a file with one URL per line (``#`` comments), re-read when its
  modification time or size changes; what a ConfigMap mounted into a pod gives.
* :class:`DnsDiscovery` — a host name re-resolved every few seconds, one endpoint per address;
  what a Kubernetes headless Service gives (one A record per ready pod).

The router contacts only the endpoints a discovery source yields.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

from kvroute.errors import UserError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Endpoint:
    """One worker as discovery sees it.

    Attributes:
        url: ``http://host:port`` of the worker's OpenAI server (no path).
        name: stable worker name: the URL unless the source knows better (a pod name).
        ready: False while the worker terminates: no new requests, in-flight ones finish.
    """

    url: str
    name: str
    ready: bool = True


class Discovery(Protocol):
    def watch(self) -> AsyncIterator[list[Endpoint]]:
        """Yield the complete current endpoint list at start and whenever it changes."""
        ...


def normalize_worker_url(text: str) -> str:
    """``http://host:port`` from a worker URL as a user writes it.

    Accepts a trailing slash or ``/v1`` (what OpenAI clients are given) and a missing scheme;
    refuses anything with another path, a query, or no port, because the router appends the
    API paths itself and must not guess a port.

    Raises:
        UserError: when the URL is not of that form.
    """
    raw = text.strip()
    candidate = raw if "://" in raw else f"http://{raw}"
    parts = urlsplit(candidate)
    path = parts.path.rstrip("/")
    if path == "/v1":
        path = ""
    try:
        port = parts.port
    except ValueError:
        port = None
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or port is None
        or path
        or parts.query
        or parts.fragment
    ):
        raise UserError(
            f"bad worker URL {text!r}: expected http://HOST:PORT (optionally ending in /v1)"
        )
    host = parts.hostname
    if ":" in host:  # an IPv6 literal needs its brackets back
        host = f"[{host}]"
    return f"{parts.scheme}://{host}:{port}"


def url_host(url: str) -> str:
    """The host part of a normalized worker URL (IPv6 literals without brackets)."""
    host = urlsplit(url).hostname
    assert host is not None
    return host


class StaticDiscovery:
    """A fixed list of worker URLs.

    Raises:
        UserError: on a malformed or duplicate URL.
    """

    def __init__(self, urls: Sequence[str]) -> None:
        endpoints = [_endpoint(u) for u in urls]
        seen: set[str] = set()
        for e in endpoints:
            if e.url in seen:
                raise UserError(f"worker {e.url} is given twice")
            seen.add(e.url)
        self.endpoints = endpoints

    async def watch(self) -> AsyncIterator[list[Endpoint]]:
        yield list(self.endpoints)


def _endpoint(url: str) -> Endpoint:
    normalized = normalize_worker_url(url)
    return Endpoint(normalized, normalized)


def parse_worker_file(text: str, origin: str) -> list[Endpoint]:
    """Endpoints of a worker file: one URL per line; blank lines and ``#`` comments ignored;
    duplicates kept once.

    Raises:
        UserError: naming the line of a malformed URL.
    """
    endpoints: dict[str, Endpoint] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        try:
            endpoint = _endpoint(entry)
        except UserError as exc:
            raise UserError(f"{origin}:{lineno}: {exc}") from None
        endpoints.setdefault(endpoint.url, endpoint)
    return list(endpoints.values())


class FileDiscovery:
    """Workers listed in a file, one URL per line, re-read when the file changes.

    The file is polled (modification time and size) every ``interval_s``: portable, and a
    ConfigMap update (an atomic symlink swap) is seen like any rewrite. A file that is missing
    or malformed after the first read keeps the last good list and logs a warning, so a
    half-written edit never empties the pool.

    Args:
        path: the file.
        interval_s: seconds between checks.

    Raises:
        UserError: from ``watch`` when the file cannot be read or parsed the first time.
    """

    def __init__(self, path: str | os.PathLike, interval_s: float = 1.0) -> None:
        self.path = Path(path)
        self.interval_s = interval_s

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def check(self) -> list[Endpoint]:
        """Read the file once, as the first step of ``watch`` does, so that a command can
        refuse to start on a missing or malformed file.

        Raises:
            UserError: when the file cannot be read or parsed.
        """
        return self._read()

    def _read(self) -> list[Endpoint]:
        try:
            text = self.path.read_text("utf-8")
        except OSError as exc:
            raise UserError(f"cannot read worker file {str(self.path)!r}: {exc.strerror or exc}") from None
        return parse_worker_file(text, str(self.path))

    async def watch(self) -> AsyncIterator[list[Endpoint]]:
        stamp = self._stamp()
        current = self._read()
        yield current
        while True:
            await asyncio.sleep(self.interval_s)
            new_stamp = self._stamp()
            if new_stamp == stamp:
                continue
            stamp = new_stamp
            try:
                endpoints = self._read()
            except UserError as exc:
                logger.warning("%s; keeping the previous %d workers", exc, len(current))
                continue
            if endpoints != current:
                current = endpoints
                yield current


#: A resolver: host name and port to the set of IP addresses currently behind it.
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every IPv4/IPv6 address ``host`` resolves to now (the system resolver, off the loop)."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    return sorted({info[4][0] for info in infos})


class DnsDiscovery:
    """One worker per address a DNS name resolves to, re-resolved every ``interval_s``.

    A Kubernetes headless Service (``clusterIP: None``) answers with one A record per ready
    pod, so re-resolving follows scale-ups, restarts and terminations. A failed lookup keeps
    the last list (a resolver hiccup must not empty the pool); an answer with no addresses is
    believed (the Service really has no ready pods).

    Args:
        host: the name (e.g. ``vllm-headless.default.svc.cluster.local``).
        port: the workers' HTTP port.
        interval_s: seconds between lookups.
        resolver: ``async (host, port) -> addresses``; the system resolver by default (tests
            inject a fake).
        scheme: ``http`` or ``https``.
    """

    def __init__(
        self,
        host: str,
        port: int,
        interval_s: float = 5.0,
        resolver: Resolver | None = None,
        scheme: str = "http",
    ) -> None:
        self.host = host
        self.port = port
        self.interval_s = interval_s
        self.resolver = resolver or resolve_addresses
        self.scheme = scheme

    @classmethod
    def from_spec(cls, spec: str, interval_s: float = 5.0) -> DnsDiscovery:
        """From ``HOST:PORT`` (``--dns`` flag).

        Raises:
            UserError: when the port is missing or not a number.
        """
        host, sep, port = spec.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise UserError(f"bad --dns {spec!r}: expected NAME:PORT, e.g. vllm-headless:8000")
        return cls(host.strip("[]"), int(port), interval_s)

    def _url(self, address: str) -> str:
        try:
            v6 = ipaddress.ip_address(address).version == 6
        except ValueError:
            v6 = False
        host = f"[{address}]" if v6 else address
        return f"{self.scheme}://{host}:{self.port}"

    async def _lookup(self) -> list[Endpoint] | None:
        try:
            addresses = await self.resolver(self.host, self.port)
        except OSError as exc:
            logger.warning("cannot resolve %s: %s", self.host, exc)
            return None
        urls = sorted({self._url(a) for a in addresses})
        return [Endpoint(u, u) for u in urls]

    async def watch(self) -> AsyncIterator[list[Endpoint]]:
        current = await self._lookup()
        yield current or []
        while True:
            await asyncio.sleep(self.interval_s)
            endpoints = await self._lookup()
            if endpoints is not None and endpoints != current:
                current = endpoints
                yield current
