"""The routers' own account of retention refreshes, read from every replica's ``/metrics``.

A kvroute router counts the refreshes it sends (``kvroute_retention_refreshes_total`` and the
tokens they carried); the workers' prefix-cache counters count those refreshes like any
request, so the bench reads the routers' counters around a window to take them out and to
report refreshes per client request.

With N router replicas behind a balancer, each replica counts only its own refreshes, and a
``/metrics`` read through the balancer lands on one replica chosen per connection: a window read
"before" on one replica and "after" on another gives a difference of two unrelated counters
(negative ones too). Every router shows its process's identity
(``kvroute_router_info{instance="..."}``, new at each start), so :class:`RouterMetricsReader`

* with ``--router-metrics-url`` for every replica, reads each one and sums them, refusing two
  URLs that reach the same router (its refreshes would count twice) and not counting a window
  over which a replica restarted (its counters began again);
* without it, reads the bench's ``--url``, and when that answers from more than one router (a
  balancer in front of replicas) says so and counts nothing rather than a wrong figure.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass

import aiohttp

from kvroute.errors import UserError

INFO = "kvroute_router_info"

#: ``/metrics`` reads of ``--url`` the first time it is asked, when the first shows a kvroute
#: router, to see whether more than one answers there: a balancer choosing uniformly among
#: N >= 2 replicas shows one replica to all of them with probability at most
#: 2**-(PROBE_READS - 1).
PROBE_READS = 16


@dataclass(frozen=True)
class RouterRefreshes:
    """What a kvroute router's ``/metrics`` says of its retention refreshes so far: the
    refreshes sent (``kvroute_retention_refreshes_total``, summed over workers), those still
    open, the prompt tokens sent, and of the refreshes answered with their usage, the prompt
    tokens and the cached tokens the engines reported. The workers' prefix-cache counters
    count refreshes like any request; these let the bench take them out."""

    sent: float = 0.0
    open: float = 0.0
    prompt_tokens: float = 0.0
    answered_prompt_tokens: float = 0.0
    cached_tokens: float = 0.0

    def since(self, earlier: RouterRefreshes) -> RouterRefreshes:
        """The counts between ``earlier`` and this reading (the open gauge's change too)."""
        return RouterRefreshes(*(a - b for a, b in zip(astuple(self), astuple(earlier))))

    def __add__(self, other: RouterRefreshes) -> RouterRefreshes:
        return RouterRefreshes(*(a + b for a, b in zip(astuple(self), astuple(other))))


#: ``RouterRefreshes``' fields, by the metric each is read from.
_REFRESH_METRICS = {
    "kvroute_retention_refreshes_total": "sent",
    "kvroute_retention_refreshes_open": "open",
    "kvroute_retention_refresh_prompt_tokens_total": "prompt_tokens",
    "kvroute_retention_refresh_answered_prompt_tokens_total": "answered_prompt_tokens",
    "kvroute_retention_refresh_cached_tokens_total": "cached_tokens",
}


@dataclass(frozen=True)
class RouterReading:
    """One read of one router's ``/metrics``: which process answered (None: a router too old
    to say) and its refreshes so far."""

    instance: str | None
    refreshes: RouterRefreshes


def parse_router_metrics(metrics_text: str) -> RouterReading | None:
    """:class:`RouterReading` from a ``/metrics`` page; refreshes all zero for a kvroute router
    that sent none (or runs without retention), None for a page that is not a kvroute
    router's."""
    values = dict.fromkeys(_REFRESH_METRICS.values(), 0.0)
    instance = None
    for line in metrics_text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _REFRESH_METRICS:
            values[_REFRESH_METRICS[name]] += float(line.rsplit(None, 1)[-1])
        elif name == INFO and 'instance="' in line:
            instance = line.split('instance="', 1)[1].split('"', 1)[0]
    if instance is None and "kvroute_router_decisions" not in metrics_text and not any(values.values()):
        return None
    return RouterReading(instance, RouterRefreshes(**values))


def router_metrics_url(url: str) -> str:
    """The ``/metrics`` URL of a router given by its base (``http://host:port``, optionally
    ending in ``/v1``) or by its ``/metrics`` URL itself."""
    base = url.strip().rstrip("/")
    if "://" not in base:
        base = f"http://{base}"
    if base.endswith("/metrics"):
        return base
    return base.removesuffix("/v1") + "/metrics"


async def read_router(url: str, api_key: str | None = None, timeout_s: float = 5.0) -> RouterReading | None:
    """:func:`parse_router_metrics` of the page at ``url`` (a ``/metrics`` URL), on a new
    connection; None when it is not a kvroute router (a worker) or does not answer."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s, \
                s.get(url, headers=headers) as r:
            if r.status != 200:
                return None
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError, ValueError):
        return None
    return parse_router_metrics(text)


class RouterMetricsReader:
    """Reads the routers' refresh counters around a window.

    Args:
        replica_urls: each router replica's base or ``/metrics`` URL (``--router-metrics-url``);
            empty: read ``target_url`` and count only if exactly one router answers there.
        target_url: the bench's ``--url``.
        api_key: bearer token for ``/metrics`` (a router started with ``--api-key``).
        warn: how to tell the user why refreshes are not counted (once per reason).
    """

    def __init__(self, replica_urls: tuple[str, ...], target_url: str, api_key: str | None = None,
                 warn: Callable[[str], None] = lambda message: None) -> None:
        self.explicit = bool(replica_urls)
        self.urls = [router_metrics_url(u) for u in replica_urls] or [router_metrics_url(target_url)]
        if len(set(self.urls)) != len(self.urls):
            raise UserError("a --router-metrics-url is given twice: its refreshes would count twice")
        self.api_key = api_key
        self._warn = warn
        self._warned: set[str] = set()
        #: None: not checked yet; False: nothing to count (not a router, or a balancer).
        self._countable: bool | None = None

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            self._warn(message)

    async def _check(self) -> bool:
        """Whether the URLs can be counted: explicit ones must each be a distinct router (else
        :class:`UserError`); the bench's ``--url`` must be one router or none."""
        if self.explicit:
            readings = await asyncio.gather(*(read_router(u, self.api_key) for u in self.urls))
            seen: dict[str, str] = {}
            for url, reading in zip(self.urls, readings):
                if reading is None:
                    raise UserError(f"--router-metrics-url {url} is not a kvroute router's /metrics "
                                    "(or does not answer)")
                if reading.instance is not None:
                    if reading.instance in seen:
                        raise UserError(f"--router-metrics-url {seen[reading.instance]} and {url} reach the "
                                        f"same router (instance {reading.instance}): its refreshes would "
                                        "count twice; give each replica's own address, not the balancer's")
                    seen[reading.instance] = url
            return True
        first = await read_router(self.urls[0], self.api_key)
        if first is None:
            return False  # a worker, or a balancer of workers: no router refreshes to take out
        readings = [first] + [await read_router(self.urls[0], self.api_key) for _ in range(PROBE_READS - 1)]
        instances = {r.instance for r in readings if r is not None}
        if len(instances) > 1 or any(r is None for r in readings):
            self._warn_balancer(instances)
            return False
        return True

    def _warn_balancer(self, instances: set[str | None]) -> None:
        self._warn_once(
            f"--url's /metrics answers from {len(instances)} different kvroute routers (a balancer in "
            "front of replicas): their retention refreshes are not counted (each replica counts its "
            "own); give every replica's address with --router-metrics-url to count them")

    async def prepare(self) -> None:
        """Find out once whether the routers' refreshes can be counted (:meth:`_check`). Call it
        before the traffic to measure: behind a Service, reading ``--url`` is a connection that
        takes one of the balancer's random draws."""
        if self._countable is None:
            self._countable = await self._check()

    async def read(self) -> list[RouterReading] | None:
        """Every router's reading once settled (:meth:`_settled`), or None when refreshes are
        not to be counted."""
        await self.prepare()
        if not self._countable:
            return None
        readings = await asyncio.gather(*(self._settled(u) for u in self.urls))
        if any(r is None for r in readings):
            self._warn_once("a router's /metrics did not answer: this window's refreshes are not counted")
            return None
        return list(readings)

    def window(self, before: list[RouterReading] | None, after: list[RouterReading] | None) -> RouterRefreshes | None:
        """The refreshes between two :meth:`read` results summed over the routers, or None when
        they cannot be counted (a router restarted between them, or another answered)."""
        if before is None or after is None:
            return None
        total = RouterRefreshes()
        for url, b, a in zip(self.urls, before, after):
            if b.instance != a.instance:
                if self.explicit:
                    self._warn_once(f"the router at {url} restarted during a window (its counters began "
                                    "again): that window's refreshes are not counted")
                else:
                    self._warn_balancer({b.instance, a.instance})
                    self._countable = False
                return None
            total = total + a.refreshes.since(b.refreshes)
        return total

    async def _settled(self, url: str, limit_s: float = 5.0, poll_s: float = 0.05) -> RouterReading | None:
        """The router's reading once it has no refresh open and sent none since the previous
        look (a worker falling idle sends its refreshes from a task of their own, just after
        its last answer), or after ``limit_s``: read with the workers' counters after it, both
        count the same refreshes."""
        deadline = time.monotonic() + limit_s
        last = await read_router(url, self.api_key)
        while last is not None and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
            now = await read_router(url, self.api_key)
            if now is None or now.instance != last.instance:
                return now
            if now.refreshes.open == 0 and now.refreshes.sent == last.refreshes.sent:
                return now
            last = now
        return last
