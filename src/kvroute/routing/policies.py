"""Balancing policies: one pure interface shared by the simulator and the live router.

A policy sees a ``RequestView`` (what the router knows about the request: its block hashes)
and the ``WorkerState`` of every worker (what the router knows about load), and returns the
index of the worker to use. Policies hold no clock and do no I/O, so the object that routes in
the live proxy is the object the simulator runs.

* ``random`` — uniform per request; what a Kubernetes Service does when every request opens
  a new connection.
* ``round-robin`` — cycle through workers.
* ``least-loaded`` — fewest requests in flight, ties broken at random.
* ``prefix-hash`` — each prefix has one owner: rendezvous (highest-random-weight) hashing of
  the prompt's first block(s) over worker names, so owners move only for the prefixes of
  workers that come or go. With ``load_factor`` ε set, an owner already holding more than
  (1+ε)·mean in-flight requests spills to the next worker in the prefix's rendezvous order
  (consistent hashing with bounded loads).
* ``kv-aware`` — the worker that leaves the least work, from the router's index of cached
  blocks (``kvroute.routing.index``) and its own load accounting:
  ``cost = overlap_weight·max(prompt − overlap·block_size, 1) + in_flight_tokens +
  request_weight·in_flight`` (defaults 3 and 128), lowest wins among the workers two guards
  allow: bounded load now (``in_flight + 1 ≤ ceil((1+ε)·max(1, mean))``, ε = 1.5) and over
  time (a busy worker's share of the policy's recent decisions ≤ (1+δ)·the mean share,
  δ = 0.35, whose copies go where recent demand is lowest); ties go to the emptiest cache, then
  to a per-request hash draw that every replica repeats. Details and the reasons for the
  defaults: :class:`KvAwarePolicy`.

Every policy has ``name`` and ``needs_overlap``: when the latter is True the caller fills
``RequestView.overlap_blocks`` from ``KvIndex.overlaps`` before calling ``choose``, and records
the decision with ``KvIndex.record_routed`` after it.
"""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import xxhash

from kvroute.errors import UserError


@dataclass(slots=True)
class RequestView:
    """What a policy may know about a request.

    Args:
        block_hashes: chained hashes of the prompt's full blocks (``kvroute.blocks``).
        prompt_tokens: prompt length in tokens.
        overlap_blocks: leading blocks of the prompt each worker holds, aligned with the
            ``workers`` passed to ``choose``; filled only for policies that ``needs_overlap``.
    """

    block_hashes: list[int]
    prompt_tokens: int
    overlap_blocks: list[int] | None = None

    def tokens_to_prefill(self, worker: int, block_size: int) -> int:
        """Prompt tokens worker ``worker`` would still compute: those after its cached
        overlap, and at least one (vLLM recomputes the last token of a fully cached prompt).
        What the caller adds to ``WorkerState.in_flight_tokens`` when it sends the request."""
        cached = self.overlap_blocks[worker] * block_size if self.overlap_blocks else 0
        return max(self.prompt_tokens - cached, 1)


@dataclass(slots=True)
class WorkerState:
    """What a policy may know about a worker: its name and the router's own load accounting.

    Args:
        name: the worker's stable name (the index's key).
        in_flight: requests sent and not finished.
        in_flight_tokens: prompt tokens of those requests still to prefill: the caller adds
            ``RequestView.tokens_to_prefill`` on sending and subtracts it at the first token.
        cached_blocks: blocks the router's index attributes to the worker
            (``KvIndex.worker_blocks``); kv-aware places a new prefix on the emptiest cache
            among otherwise equal workers. 0 when unknown.
    """

    name: str
    in_flight: int = 0
    in_flight_tokens: int = 0
    cached_blocks: int = 0


class Policy(Protocol):
    name: str
    needs_overlap: bool

    def choose(self, request: RequestView, workers: Sequence[WorkerState]) -> int:
        """Index into ``workers`` of the worker to send ``request`` to."""
        ...


class RandomPolicy:
    name = "random"
    needs_overlap = False

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def choose(self, request: RequestView, workers: Sequence[WorkerState]) -> int:
        return self.rng.randrange(len(workers))


class RoundRobinPolicy:
    name = "round-robin"
    needs_overlap = False

    def __init__(self, rng: random.Random | None = None) -> None:
        self._next = 0

    def choose(self, request: RequestView, workers: Sequence[WorkerState]) -> int:
        i = self._next % len(workers)
        self._next = i + 1
        return i


def least_loaded(workers: Sequence[WorkerState], rng: random.Random, among: Sequence[int] | None = None) -> int:
    """Index of a worker with the fewest requests in flight; ties broken at random so equal
    workers share new work instead of the first one taking all of it."""
    candidates = range(len(workers)) if among is None else among
    low = min(workers[i].in_flight for i in candidates)
    return rng.choice([i for i in candidates if workers[i].in_flight == low])


class LeastLoadedPolicy:
    name = "least-loaded"
    needs_overlap = False

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def choose(self, request: RequestView, workers: Sequence[WorkerState]) -> int:
        return least_loaded(workers, self.rng)


class PrefixHashPolicy:
    """Args:
        key_blocks: how many leading blocks identify a prefix (1: prompts that share their
            first block share an owner).
        load_factor: ε of bounded-load hashing; None never spills.
    """

    name = "prefix-hash"
    needs_overlap = False

    def __init__(
        self,
        rng: random.Random | None = None,
        key_blocks: int = 1,
        load_factor: float | None = None,
    ) -> None:
        self.rng = rng or random.Random()
        self.key_blocks = key_blocks
        self.load_factor = load_factor

    def ranking(self, request: RequestView, workers: Sequence[WorkerState]) -> list[int]:
        """Workers in this request's rendezvous order (owner first)."""
        if not request.block_hashes:
            return sorted(range(len(workers)), key=lambda i: self.rng.random())
        key = request.block_hashes[min(self.key_blocks, len(request.block_hashes)) - 1]
        return sorted(
            range(len(workers)),
            key=lambda i: xxhash.xxh3_64_intdigest(workers[i].name.encode(), key),
            reverse=True,
        )

    def choose(self, request: RequestView, workers: Sequence[WorkerState]) -> int:
        order = self.ranking(request, workers)
        if self.load_factor is None:
            return order[0]
        # +1 counts the request being placed, so an idle fleet never spills.
        mean = (sum(w.in_flight for w in workers) + 1) / len(workers)
        limit = (1 + self.load_factor) * mean
        for i in order:
            if workers[i].in_flight + 1 <= limit:
                return i
        return order[0]


class KvAwarePolicy:
    """Send each request where it leaves the least work, without piling onto one worker.

    Cost of worker *i*, in prefill-token equivalents (lower is better)::

        cost_i = overlap_weight · max(prompt_tokens − overlap_blocks_i · block_size, 1)
                 + in_flight_tokens_i
                 + request_weight · in_flight_i

    The first term is the prefill the request would cost there after its cached prefix; the
    second is the prefill still queued there (tokens the router itself sent and has not seen a
    first token for); the third charges each request in flight for its decode steps and the KV
    blocks it pins, which crowd cached prefixes out. The shape is Dynamo's (its overlap weight
    also scales the queued prefill; here it scales only the new request's, which is what
    trades cache reuse against load), with the load read from the router's own accounting,
    never from a scrape that can read zero.

    Two guards against hotspots decide which workers may take the request; the cheapest of
    those wins. An owner that a guard refuses loses to the next best worker even though that
    one must recompute the prefix: the prefix is thereby copied onto another worker, and from
    then on the cost spreads its requests over all the workers holding it (the least loaded
    holder wins).

    * **Bounded load now**: ``in_flight_i + 1 ≤ ceil((1 + load_factor) · max(1, (Σ in_flight
      + 1) / W))``. The mean counts the request being placed and is floored at one request, so
      a nearly idle fleet (a burst starting) does not spill from an owner holding a single
      request. This catches bursts (a Zipf head arriving all at once).
    * **Bounded share over time**: a worker with requests in flight may take the request only
      while ``share_i ≤ (1 + share_factor) · mean(share)``, where ``share_i`` is its share of
      this policy's recent decisions: an average of "decision went to *i*" over the last
      ``share_window · W`` decisions (an exponential moving average; until it has seen that
      many, a running average seeded with ``share_window / 6`` decisions' worth of the fair
      share 1/W per worker, so that a fleet that starts skewed, as K = 2 does from its warmup
      on, is caught within a few decisions instead of after a whole window). Why it is needed:
      a hotspot is a worker that keeps serving more than its share, and in-flight counts
      cannot see that at low concurrency. With 2 prefixes on 6 workers at concurrency 8, the
      four holders of the two prefixes sit at two requests each and the two others at none,
      for good: that state is 1.5 × the mean per holder in requests served, yet each new
      request finds a holder at one or two requests in flight, which no in-flight bound can
      refuse without also refusing the everyday state of uniform traffic (24 prefixes, 1.33
      requests per worker on average, two or three on some worker at any moment). A tighter
      ``load_factor`` therefore fixes K = 2 only by copying prefixes on noise at K = 24
      (ε = 0.5: hit rate 0.88 → 0.59, the copies evict other prefixes). The share is what the
      hotspot criterion measures, averaged over enough decisions that uniform traffic stays
      inside the bound (in the simulator's K = 24 runs it changes no decision at all) while a
      lasting skew crosses it and gets its prefix copied. A worker with nothing in flight is
      exempt: sending it the request queues behind nothing, and copying its prefix elsewhere
      would cost a miss for no shorter queue (requests that arrive one at a time stay on their
      prefix's owner however many there are).
    * **Where the share guard's copy goes**: when the bounded-share guard has refused every
      worker that caches as much of the prompt as the best-cached worker the load guard
      allows (it is copying the prefix), the copy goes to the worker, among the allowed ones
      with the cheapest worker's overlap, whose ``cost + share_weight · request_weight ·
      share_i / mean(share)`` is lowest. The copy evicts that worker's least recently used
      blocks; the worker the policy has sent the least to lately holds the blocks least in
      demand, and needs the load. Copies the cost or the load guard make are placed by cost
      alone, as before: where the share guard does not fire, the policy decides exactly as
      it would without it.

    Ties (equal cost, e.g. an idle fleet and a new prefix) go first to the worker whose cache
    holds the fewest blocks (``WorkerState.cached_blocks``: new prefixes spread over empty
    caches), then to the highest ``xxh3(worker name, seed = the prompt's last block hash)``: a
    draw that differs from request to request, so ties do not always land on one worker, yet
    is the same on every router replica that sees the same request and the same events. A
    prompt without a full block has no cache value and no hash to draw from; its ties use the
    policy's ``rng``.

    State: the recent shares, keyed by worker name, are the only state; they derive from the
    policy's own decisions, like the in-flight counts the router keeps. Two replicas fed the
    same requests, events and loads therefore make the same decisions. A worker absent from a
    call (it left, or a retry excludes it) is forgotten and comes back at the fair share.

    Args:
        rng: for prompts shorter than a block only.
        block_size: tokens per KV block; must be the index's.
        overlap_weight: weight of the new request's prefill against the load terms.
        request_weight: prefill-token equivalent of one request in flight.
        load_factor: ε of the bounded-load guard; None turns it off.
        share_factor: δ of the bounded-share guard; None turns it off.
        share_window: the share's averaging window, in decisions per worker.
        share_weight: when placing a copy, the request-in-flight equivalents charged per
            fair share of recent decisions.

    Defaults (block_size 16, overlap_weight 3, request_weight 128, load_factor 1.5,
    share_factor 0.35, share_window 24, share_weight 4), chosen on the simulator (reference
    workload at K = 2, 7, 12, 24 on 6 and 3 workers at concurrency 4, 8 and 16, its
    concurrency-16 TTFT p99, and Zipf α = 1.2 over 64 prefixes, several workload seeds): a
    weight above 1 on the new prefill charges a miss for the cached blocks it evicts as well
    as for its compute, so a cached owner keeps its prefix while it has a prefill or two
    queued; weight 1 (TTFT alone) copied prefixes whenever an owner was busy and lost ~10
    points of hit rate to the evictions. ε = 1.5 lets the guard fire on a real burst but not
    on the in-flight noise of uniform traffic (ε ≤ 1.25 spilled there and cost 6 points at
    K = 24). δ must stay well under 0.5 (four busy workers of six is exactly 1.5 × the mean)
    and above the share noise of uniform and Zipf traffic: at 0.35 no worker served more
    than 1.32 × the mean in those sweeps; 0.25–0.3 also fired at K = 24 (−0.3 to −0.6 points
    of hit rate) and on Zipf's popular prefixes (about −1 point), 0.45 let K = 2 reach 1.5. A
    window of 24 decisions per worker averages out uniform traffic's clumps (16 fired on them
    at K = 24); 32 let skews last longer (1.38 × the mean). Placing the guard's copies by
    recent share rather than by load alone won back ~0.4 points of Zipf hit rate (placing
    every copy so reshuffled K = 24's hits by ±1 point per seed, for nothing on average).
    """

    name = "kv-aware"
    needs_overlap = True

    def __init__(
        self,
        rng: random.Random | None = None,
        block_size: int = 16,
        overlap_weight: float = 3.0,
        request_weight: float = 128.0,
        load_factor: float | None = 1.5,
        share_factor: float | None = 0.35,
        share_window: float = 24.0,
        share_weight: float = 4.0,
    ) -> None:
        if block_size < 1:
            raise UserError(f"block size must be >= 1, got {block_size}")
        if overlap_weight < 0 or request_weight < 0 or share_weight < 0:
            raise UserError("kv-aware weights must be >= 0")
        if load_factor is not None and load_factor < 0:
            raise UserError(f"load factor must be >= 0, got {load_factor}")
        if share_factor is not None and share_factor < 0:
            raise UserError(f"share factor must be >= 0, got {share_factor}")
        if share_window < 1:
            raise UserError(f"share window must be >= 1 decision per worker, got {share_window}")
        self.rng = rng or random.Random()
        self.block_size = block_size
        self.overlap_weight = overlap_weight
        self.request_weight = request_weight
        self.load_factor = load_factor
        self.share_factor = share_factor
        self.share_window = share_window
        self.share_weight = share_weight
        #: Each worker's share of the recent decisions (see the class docstring).
        self._shares: dict[str, float] = {}
        self._decisions = 0

    def costs(self, request: RequestView, workers: Sequence[WorkerState]) -> list[float]:
        """Each worker's cost (the formula above), aligned with ``workers``."""
        overlap = request.overlap_blocks or [0] * len(workers)
        if len(overlap) != len(workers):
            raise ValueError("overlap_blocks is not aligned with workers")
        bs = self.block_size
        prompt = request.prompt_tokens
        ow, rw = self.overlap_weight, self.request_weight
        return [
            ow * max(prompt - o * bs, 1) + w.in_flight_tokens + rw * w.in_flight
            for o, w in zip(overlap, workers)
        ]

    def shares(self, workers: Sequence[WorkerState]) -> list[float]:
        """Each worker's share of the recent decisions, aligned with ``workers`` (the fair
        share 1/W for a worker the policy has not decided for yet)."""
        fair = 1.0 / len(workers)
        return [self._shares.get(w.name, fair) for w in workers]

    def eligible(self, workers: Sequence[WorkerState]) -> list[int]:
        """Workers the guards let take one more request: the bounded-load guard's, less the
        busy ones above their bounded share (unless that would leave none)."""
        return self._guards(workers, self.shares(workers))[1]

    def _guards(self, workers: Sequence[WorkerState], shares: list[float]) -> tuple[list[int], list[int]]:
        """(workers the bounded-load guard allows, those of them the bounded-share guard
        allows as well)."""
        by_load = list(range(len(workers)))
        if self.load_factor is not None:
            mean = max(1.0, (sum(w.in_flight for w in workers) + 1) / len(workers))
            limit = math.ceil((1 + self.load_factor) * mean - 1e-9)
            by_load = [i for i in by_load if workers[i].in_flight + 1 <= limit]
        if self.share_factor is None:
            return by_load, by_load
        limit = (1 + self.share_factor) * sum(shares) / len(shares)
        steady = [i for i in by_load if shares[i] <= limit or not workers[i].in_flight]
        return by_load, steady or by_load

    def choose(self, request: RequestView, workers: Sequence[WorkerState]) -> int:
        shares = self.shares(workers)
        chosen = self._choose(request, workers, shares)
        self._record(workers, shares, chosen)
        return chosen

    def _choose(self, request: RequestView, workers: Sequence[WorkerState], shares: list[float]) -> int:
        costs = self.costs(request, workers)
        by_load, candidates = self._guards(workers, shares)
        best = min(costs[i] for i in candidates)
        tied = [i for i in candidates if costs[i] == best]
        overlap = request.overlap_blocks
        refused = len(candidates) < len(by_load)
        if refused and overlap and max(overlap[i] for i in candidates) < max(overlap[i] for i in by_load):
            # The share guard refused the best-cached workers: it is copying the prefix.
            # Place the copy where recent demand is lowest (the class docstring says why).
            per_share = self.share_weight * self.request_weight * len(shares) / sum(shares)
            level = overlap[tied[0]]
            copy_cost = {i: costs[i] + per_share * shares[i] for i in candidates if overlap[i] == level}
            best = min(copy_cost.values())
            tied = [i for i, c in copy_cost.items() if c == best]
        if len(tied) > 1:
            fewest = min(workers[i].cached_blocks for i in tied)
            tied = [i for i in tied if workers[i].cached_blocks == fewest]
        if len(tied) == 1:
            return tied[0]
        if not request.block_hashes:
            return self.rng.choice(tied)
        seed = request.block_hashes[-1]
        return max(tied, key=lambda i: xxhash.xxh3_64_intdigest(workers[i].name.encode(), seed))

    def _record(self, workers: Sequence[WorkerState], shares: list[float], chosen: int) -> None:
        """Move the recent shares one decision on: an exponential moving average over
        ``share_window · W`` decisions, a running average (from a prior of
        ``share_window / 6`` decisions per worker at the fair share) until then."""
        n = len(workers)
        self._decisions += 1
        prior = self.share_window / 6 * n
        rate = max(1.0 / (self.share_window * n), 1.0 / (self._decisions + prior))
        keep = 1.0 - rate
        self._shares = {w.name: s * keep for w, s in zip(workers, shares)}
        self._shares[workers[chosen].name] += rate


POLICIES: dict[str, type] = {
    p.name: p
    for p in (RandomPolicy, RoundRobinPolicy, LeastLoadedPolicy, PrefixHashPolicy, KvAwarePolicy)
}


def policy_parameters(name: str) -> set[str]:
    """The options policy ``name`` takes (its class's keyword arguments but ``rng``); empty
    for an unknown name."""
    cls = POLICIES.get(name)
    return set(inspect.signature(cls).parameters) - {"rng"} if cls is not None else set()


def make_policy(name: str, rng: random.Random | None = None, **options) -> Policy:
    """A fresh policy object by name (``kvroute sim --policy`` / ``kvroute serve --policy``);
    ``options`` are the policy class's keyword arguments (e.g. ``load_factor``)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise UserError(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}") from None
    accepted = policy_parameters(name)
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise UserError(
            f"policy {name!r} takes no option {', '.join(unknown)}"
            f" (it takes: {', '.join(sorted(accepted)) or 'none'})"
        )
    try:
        return cls(rng=rng, **options)
    except TypeError as exc:  # a text where a number belongs, and the like
        raise UserError(f"policy {name!r}: an option value has the wrong type ({exc})") from None
