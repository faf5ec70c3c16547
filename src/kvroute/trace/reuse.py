"""A trace's own reuse structure, with no engine: what any cache could hit, and what LRU does.

The unit is the trace's hash block (512 tokens, the last of a prompt partial). A request's
prompt touches its blocks in order; like vLLM's prefix cache, a block counts as a hit only if
every block before it in the prompt hits too (a prefix cache cannot use block 5 without 0–4).

* **Infinite cache**: a block hits when its id was seen before. Three ratios: of tokens, of
  blocks, and of *full* blocks (the last partial block of each prompt left out).
* **LRU at capacity C tokens**: one cache of C tokens, least recently used blocks evicted
  first, every block of a prompt cached after it is served (vLLM keeps a finished request's
  blocks and frees them tail first, so a prompt's later blocks are evicted before its earlier
  ones; here a prompt's blocks are touched last to first). With that order a cached set is
  always the top of the recency stack, so a block is cached at capacity C exactly when its
  *stack distance* — the tokens of the distinct blocks touched since its last touch, itself
  included — is at most C. One pass computes every access's distance (a Fenwick tree over
  touch times); the hit ratio at every capacity then follows by sorting. Output tokens are
  not counted (the trace has no ids for them) and nothing is pinned by running requests.
* **A fleet of W workers of C tokens each**: *random* (each request to a uniformly drawn
  worker, seeded), *prefix-affine* (a hash of the request's session key, its first hash id
  after the trace's common head, picks the worker) and *pooled* (one LRU of W·C: what a shared
  KV store would hit). Each worker is an independent LRU fed its own requests.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import xxhash

from kvroute.errors import UserError
from kvroute.trace.format import BLOCK_TOKENS, Trace

#: A distance no capacity reaches: the block was never seen before (or its prefix missed).
COLD = 1 << 62

#: The capacities (tokens) of the Figure-9-style curve: 10^4 … 10^8, 10 points per decade.
CURVE_CAPACITIES = np.logspace(4, 8, 41)

POLICIES = ("random", "prefix-affine", "pooled")


@dataclass
class BlockAccesses:
    """A trace flattened into its block touches, request by request.

    Attributes:
        ids: the hash id of each touch (int64).
        sizes: tokens of the prompt in that block (512, the last block of a prompt less).
        starts: offset of each request's first touch (length requests + 1).
    """

    ids: np.ndarray
    sizes: np.ndarray
    starts: np.ndarray

    @classmethod
    def of(cls, trace: Trace) -> BlockAccesses:
        ids: list[int] = []
        sizes: list[int] = []
        starts = [0]
        for r in trace.requests:
            if r.hash_ids:
                ids.extend(r.hash_ids)
                sizes.extend(r.block_sizes())
            starts.append(len(ids))
        return cls(np.asarray(ids, np.int64), np.asarray(sizes, np.int64), np.asarray(starts, np.int64))

    @property
    def full(self) -> np.ndarray:
        return self.sizes == BLOCK_TOKENS


def infinite_cache(acc: BlockAccesses, counted: np.ndarray | None = None) -> dict[str, float]:
    """Hit ratios of a cache that never evicts: tokens, blocks, and full blocks only, over the
    ``counted`` touches (default all)."""
    seen: set[int] = set()
    hit = np.zeros(len(acc.ids), dtype=bool)
    ids = acc.ids.tolist()
    starts = acc.starts.tolist()
    for s, e in itertools.pairwise(starts):
        for j in range(s, e):
            if ids[j] not in seen:
                break
            hit[j] = True
        seen.update(ids[s:e])
    keep = np.ones(len(hit), bool) if counted is None else counted
    hit, sizes, full = hit[keep], acc.sizes[keep], acc.full[keep]
    return {
        "token_hit_ratio": float(sizes[hit].sum() / max(sizes.sum(), 1)),
        "block_hit_ratio": float(hit.sum() / max(len(hit), 1)),
        "full_block_hit_ratio": float((hit & full).sum() / max(full.sum(), 1)),
    }


def stack_distances(acc: BlockAccesses, requests: np.ndarray | None = None) -> np.ndarray:
    """Each touch's LRU stack distance in tokens (``COLD`` when never cached at any capacity),
    made prefix-exact: a touch's distance is the largest of its prompt's distances up to it,
    so a block hits at capacity C only if all blocks before it hit too.

    Args:
        acc: the trace's touches.
        requests: indices of the requests one cache sees, in order (default: all); touches of
            other requests get ``COLD``.
    """
    out = np.full(len(acc.ids), COLD, dtype=np.int64)
    starts = acc.starts.tolist()
    order = range(len(starts) - 1) if requests is None else requests.tolist()
    ids_all = acc.ids.tolist()
    sizes_all = acc.sizes.tolist()
    n = sum(starts[r + 1] - starts[r] for r in order)
    tree = [0] * (n + 1)  # Fenwick tree over touch slots 1..n: the size held at each slot
    slot_size = [0] * (n + 1)
    last: dict[int, int] = {}  # hash id -> slot of its latest touch
    total = 0
    slot = 0
    dist = out.tolist()
    for r in order:
        s, e = starts[r], starts[r + 1]
        run = 0
        for j in range(s, e):  # distances before this request touches anything
            p = last.get(ids_all[j])
            if p is None:
                break  # this block and every later one of the prompt miss at any capacity
            i = p - 1
            below = 0
            while i > 0:
                below += tree[i]
                i &= i - 1
            d = total - below
            run = max(run, d)
            dist[j] = run
        for j in range(e - 1, s - 1, -1):  # touch last block first: earlier blocks end up more recent
            x = ids_all[j]
            p = last.get(x)
            if p is not None:
                old = slot_size[p]
                i = p
                while i <= n:
                    tree[i] -= old
                    i += i & -i
                total -= old
            slot += 1
            size = sizes_all[j]
            slot_size[slot] = size
            i = slot
            while i <= n:
                tree[i] += size
                i += i & -i
            total += size
            last[x] = slot
    return np.asarray(dist, dtype=np.int64)


class HitCurve:
    """Hit ratios at any capacity from the touches' stack distances (one pass, every capacity).

    ``counted`` selects the touches that count (default all; the others still fill the cache:
    a warm-up). ``capacity_factor`` multiplies the capacity asked for before the lookup: a pooled cache of
    W workers of C tokens is the single cache at W·C, asked as ``HitCurve(d, acc, W)`` at C.
    """

    def __init__(
        self, distances: np.ndarray, acc: BlockAccesses, capacity_factor: float = 1.0,
        counted: np.ndarray | None = None,
    ) -> None:
        keep = np.ones(len(distances), bool) if counted is None else counted
        order = np.argsort(distances[keep], kind="stable")
        self._d = distances[keep][order]
        sizes = acc.sizes[keep][order]
        full = acc.full[keep][order]
        self._tokens = np.concatenate([[0], np.cumsum(sizes)])
        self._blocks = np.arange(len(order) + 1)
        self._full = np.concatenate([[0], np.cumsum(full)])
        self._total_tokens = max(int(sizes.sum()), 1)
        self._total_blocks = max(len(order), 1)
        self._total_full = max(int(full.sum()), 1)
        self._factor = capacity_factor

    def _count(self, capacity: np.ndarray | float) -> np.ndarray:
        c = np.asarray(capacity, dtype=np.float64) * self._factor
        return np.searchsorted(self._d, np.minimum(c, COLD - 1), side="right")

    def token_hit(self, capacity):
        """Hit tokens / prompt tokens at ``capacity`` tokens (scalar or array)."""
        return self._tokens[self._count(capacity)] / self._total_tokens

    def block_hit(self, capacity):
        """Hit blocks / blocks."""
        return self._blocks[self._count(capacity)] / self._total_blocks

    def full_block_hit(self, capacity):
        """Hit full blocks / full blocks (each prompt's partial last block left out)."""
        return self._full[self._count(capacity)] / self._total_full

    def at(self, capacity: float) -> dict[str, float]:
        return {
            "token_hit_ratio": float(self.token_hit(capacity)),
            "block_hit_ratio": float(self.block_hit(capacity)),
            "full_block_hit_ratio": float(self.full_block_hit(capacity)),
        }


def session_worker(session: str | None, workers: int) -> int:
    """The worker a prefix-affine router picks for a session key: xxh3 of the key mod W."""
    return xxhash.xxh3_64_intdigest((session or "").encode()) % workers


def assignments(trace: Trace, workers: int, policy: str, seed: int = 0) -> np.ndarray:
    """The worker of each request under ``random`` (seeded uniform draws) or ``prefix-affine``."""
    n = len(trace.requests)
    if policy == "random":
        return np.random.default_rng([seed, 0x7ACE]).integers(0, workers, size=n)
    if policy == "prefix-affine":
        return np.asarray([session_worker(r.session, workers) for r in trace.requests], dtype=np.int64)
    raise ValueError(f"no assignment for policy {policy!r}")


def fleet_distances(acc: BlockAccesses, assigned: np.ndarray, workers: int) -> np.ndarray:
    """Each touch's stack distance in its own worker's LRU (``HitCurve`` of it at C = every
    worker holding C tokens)."""
    out = np.full(len(acc.ids), COLD, dtype=np.int64)
    for w in range(workers):
        mine = np.flatnonzero(assigned == w)
        if len(mine):
            d = stack_distances(acc, mine)
            touched = np.concatenate([np.arange(acc.starts[r], acc.starts[r + 1]) for r in mine])
            out[touched] = d[touched]
    return out


@dataclass
class FleetCurves:
    """Hit curves of W workers under each policy, with the requests each worker served."""

    workers: int
    curves: dict[str, HitCurve]
    load: dict[str, np.ndarray]  # requests per worker (random, prefix-affine)

    def busiest_share(self, policy: str) -> float:
        """The busiest worker's requests over the mean (1.0 = perfectly even)."""
        load = self.load[policy]
        return float(load.max() / load.mean()) if load.sum() else 0.0


def fleet(
    trace: Trace, acc: BlockAccesses, single: np.ndarray, workers: int, seed: int = 0,
    counted: np.ndarray | None = None,
) -> FleetCurves:
    """The three policies' curves for W workers; ``single`` is the one-cache distances."""
    curves: dict[str, HitCurve] = {}
    load: dict[str, np.ndarray] = {}
    for policy in ("random", "prefix-affine"):
        assigned = assignments(trace, workers, policy, seed)
        load[policy] = np.bincount(assigned, minlength=workers)
        curves[policy] = HitCurve(fleet_distances(acc, assigned, workers), acc, counted=counted)
    curves["pooled"] = HitCurve(single, acc, capacity_factor=float(workers), counted=counted)
    return FleetCurves(workers, curves, load)


def _fmt_tokens(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return f"{n:g}"


@dataclass
class TraceReuse:
    """Everything ``kvroute predict --trace`` reports about one trace.

    Attributes:
        summary: the trace's counts and means (``Trace.summary``).
        infinite: infinite-cache hit ratios.
        single: the one-cache LRU curve.
        capacity_tokens: the capacity X of the fleet points (per worker).
        fleets: one ``FleetCurves`` per W.
    """

    summary: dict
    infinite: dict[str, float]
    single: HitCurve
    capacity_tokens: int
    fleets: list[FleetCurves]
    seed: int = 0

    def fraction_of_max(self, capacity: float) -> float:
        """LRU token hit ratio at ``capacity`` over the infinite cache's."""
        best = self.infinite["token_hit_ratio"]
        return float(self.single.token_hit(capacity) / best) if best else 0.0

    def to_json(self) -> dict:
        grid = CURVE_CAPACITIES
        fleets = []
        for f in self.fleets:
            fleets.append({
                "workers": f.workers,
                "capacity_tokens_per_worker": self.capacity_tokens,
                "at_capacity": {p: f.curves[p].at(self.capacity_tokens) for p in POLICIES},
                "busiest_worker_over_mean": {p: f.busiest_share(p) for p in f.load},
                "requests_per_worker": {p: f.load[p].tolist() for p in f.load},
                "curves_per_worker_capacity": {
                    "capacity_tokens": grid.tolist(),
                    **{p: f.curves[p].token_hit(grid).tolist() for p in POLICIES},
                },
            })
        return {
            "trace": self.summary,
            "block_tokens": BLOCK_TOKENS,
            "infinite_cache": self.infinite,
            "lru": {
                "capacity_tokens": self.capacity_tokens,
                "at_capacity": self.single.at(self.capacity_tokens),
                "fraction_of_max": self.fraction_of_max(self.capacity_tokens),
                "curve": {
                    "capacity_tokens": grid.tolist(),
                    "token_hit_ratio": self.single.token_hit(grid).tolist(),
                    "block_hit_ratio": self.single.block_hit(grid).tolist(),
                    "full_block_hit_ratio": self.single.full_block_hit(grid).tolist(),
                },
            },
            "fleets": fleets,
            "seed": self.seed,
            "notes": [
                ("hit ratios count prompt blocks of 512 tokens; a block hits only after all "
                "blocks before it in its prompt hit; output tokens are not cached"),
                ("random: each request to a seeded uniform worker; prefix-affine: xxh3 of the "
                "session key (first hash id after the common head) mod W; pooled: one LRU of W·X"),
            ],
        }


def analyze(
    trace: Trace, workers: list[int], capacity_tokens: int, seed: int = 0, warmup_s: float = 0.0
) -> TraceReuse:
    """The trace's reuse: infinite cache, the LRU curve, and each fleet size's three policies.

    Requests arriving in the first ``warmup_s`` seconds fill the caches but are not counted.
    """
    acc = BlockAccesses.of(trace)
    if not len(acc.ids):
        raise UserError(f"{trace.path}: no request has token ids or hash ids to analyze")
    counted = None
    if warmup_s > 0:
        arrivals = np.asarray([r.arrival_s for r in trace.requests])
        counted = np.repeat(arrivals >= warmup_s, np.diff(acc.starts))
        if not counted.any():
            raise UserError(f"--warmup {warmup_s:g} s leaves no request of {trace.path} to count")
    single = stack_distances(acc)
    fleets = [fleet(trace, acc, single, w, seed, counted) for w in workers]
    summary = {**trace.summary(), "warmup_s": warmup_s}
    return TraceReuse(summary, infinite_cache(acc, counted), HitCurve(single, acc, counted=counted),
                      capacity_tokens, fleets, seed)
