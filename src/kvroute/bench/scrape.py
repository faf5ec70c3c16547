"""The workers' own account of cache hits: Prometheus counters scraped around a window.

docs/experiment.md rule 4 measures hits two ways; this is the second. Each worker's ``/metrics``
is scraped just before and just after the measured window, and the deltas of
``vllm:prefix_cache_hits_total`` and ``vllm:prefix_cache_queries_total`` (both in tokens,
summed over label sets: one engine per set) give the window's token hit ratio. Counters
restart at zero when a server restarts; a negative delta is reported, not hidden.

Also read here: ``vllm:cache_config_info`` (what the server really has: ``num_gpu_blocks``,
``block_size``), and ``POST /reset_prefix_cache`` between trials so every trial starts cold.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvroute.errors import UserError

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
CACHE_CONFIG = "vllm:cache_config_info"


def metrics_endpoint(url: str) -> tuple[str, str]:
    """``(base URL, metrics URL)`` of a worker given as ``http://host:port`` or with a path.

    A bare base gets ``/metrics`` appended; a URL with a path is used as is and its base is
    scheme + host + port (where ``/reset_prefix_cache`` lives).
    """
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UserError(f"bad --metrics-url {url!r}: expected http://HOST:PORT[/metrics]")
    base = urlunsplit((parts.scheme, parts.netloc, "", "", ""))
    path = parts.path if parts.path not in ("", "/") else "/metrics"
    return base, base + path


@dataclass(frozen=True)
class CacheSample:
    """One scrape of one worker."""

    url: str
    hits: float
    queries: float
    num_gpu_blocks: int | None = None
    block_size: int | None = None


@dataclass(frozen=True)
class CacheDelta:
    """Counter deltas of one worker over a window."""

    url: str
    hits: float
    queries: float

    @property
    def token_hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None


def parse_metrics(url: str, text: str) -> CacheSample:
    """Sum the prefix-cache counters over every label set; read the cache config."""
    hits = queries = 0.0
    blocks = block_size = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == HITS:
                hits += sample.value
            elif sample.name == QUERIES:
                queries += sample.value
            elif sample.name == CACHE_CONFIG:
                labels = sample.labels
                if "num_gpu_blocks" in labels and labels["num_gpu_blocks"] not in ("", "None"):
                    blocks = int(float(labels["num_gpu_blocks"]))
                if "block_size" in labels and labels["block_size"] not in ("", "None"):
                    block_size = int(float(labels["block_size"]))
    return CacheSample(url, hits, queries, blocks, block_size)


class MetricsScraper:
    """Scrapes a fixed list of worker metrics URLs (concurrently, one pooled session).

    Args:
        urls: worker URLs as given by ``--metrics-url``.
        timeout_s: per scrape.
    """

    def __init__(self, urls: list[str], timeout_s: float = 10.0) -> None:
        endpoints = [metrics_endpoint(u) for u in urls]
        self.bases = [b for b, _ in endpoints]
        self.urls = [m for _, m in endpoints]
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))

    async def close(self) -> None:
        await self.session.close()

    async def _scrape_one(self, url: str) -> CacheSample:
        try:
            async with self.session.get(url) as resp:
                if resp.status != 200:
                    raise UserError(f"metrics {url}: HTTP {resp.status}")
                text = await resp.text()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise UserError(f"cannot scrape {url}: {type(exc).__name__}: {exc}") from None
        sample = parse_metrics(url, text)
        return sample

    async def scrape(self) -> list[CacheSample]:
        return list(await asyncio.gather(*(self._scrape_one(u) for u in self.urls)))

    async def reset_prefix_caches(self) -> list[str]:
        """POST /reset_prefix_cache to every worker; returns a message per worker that did not
        accept it (a real vLLM serves the route only with ``VLLM_SERVER_DEV_MODE=1``)."""

        async def one(base: str) -> str | None:
            try:
                async with self.session.post(base + "/reset_prefix_cache") as resp:
                    if resp.status != 200:
                        return f"{base}: HTTP {resp.status}"
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                return f"{base}: {type(exc).__name__}: {exc}"
            return None

        results = await asyncio.gather(*(one(b) for b in self.bases))
        return [r for r in results if r is not None]


def deltas(before: list[CacheSample], after: list[CacheSample]) -> list[CacheDelta]:
    return [CacheDelta(a.url, a.hits - b.hits, a.queries - b.queries) for b, a in zip(before, after)]


def window_token_hit_rate(
    window: list[CacheDelta], other_queries: float = 0.0, other_hits: float = 0.0
) -> float | None:
    """Hits ÷ queries over all workers (token-weighted, like the per-request measure), less
    ``other_queries`` and ``other_hits`` the workers also counted for requests that were not
    the bench's (a router's retention refreshes)."""
    queries = sum(d.queries for d in window) - other_queries
    return (sum(d.hits for d in window) - other_hits) / queries if queries > 0 else None
