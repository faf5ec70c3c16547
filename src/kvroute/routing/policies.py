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
  the prefill it would cost there after its cached prefix, weighted, plus the prefill queued
  there and a charge per request in flight (``kvroute_core::policies::KvAware::costs``, quoted
  in docs/router.md; weights 3 and 128 by default), lowest wins among the workers two guards
  allow: bounded load now (``in_flight + 1 ≤ ceil((1+ε)·max(1, mean))``, ε = 1.5) and over
  time (a busy worker's share of the policy's recent decisions ≤ (1+δ)·the mean share,
  δ = 0.35, whose copies go where recent demand is lowest); ties go to the emptiest cache, then
  to a per-request hash draw that every replica repeats. Details and the reasons for the
  defaults: :class:`KvAwarePolicy`.

Every policy has ``name`` and ``needs_overlap``: when the latter is True the caller fills
``RequestView.overlap_blocks`` from ``KvIndex.overlaps`` before calling ``choose``, and records
the decision with ``KvIndex.record_routed`` after it; :class:`kvroute.routing.RoutingStep` does
all of that (and the load accounting) in one native call, for the simulator and the router.

The policies are native (``kvroute_core::policies``): the classes here name them and their
options. Their random draws replay CPython's ``random.Random`` from the state of the ``rng``
given, so a seed names the same choices it always did.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from kvroute._native import Policy as _NativePolicy
from kvroute._native import RequestView, WorkerState
from kvroute._native import policy_defaults as _native_policy_defaults
from kvroute.errors import UserError

__all__ = [
    "POLICIES", "KvAwarePolicy", "LeastLoadedPolicy", "Policy", "PrefixHashPolicy", "RandomPolicy",
    "RequestView", "RoundRobinPolicy", "WorkerState", "make_policy", "policy_defaults",
    "policy_parameters",
]


class Policy(Protocol):
    name: str
    needs_overlap: bool

    def choose(self, request: RequestView, workers: Sequence[WorkerState]) -> int:
        """Index into ``workers`` of the worker to send ``request`` to."""
        ...


class RandomPolicy(_NativePolicy):
    """Uniform per request."""

    name = "random"
    needs_overlap = False

    def __new__(cls, rng: random.Random | None = None):
        return super().__new__(cls, cls.name, rng)


class RoundRobinPolicy(_NativePolicy):
    """Cycle through the workers."""

    name = "round-robin"
    needs_overlap = False

    def __new__(cls, rng: random.Random | None = None):
        return super().__new__(cls, cls.name, rng)


class LeastLoadedPolicy(_NativePolicy):
    """Fewest requests in flight, ties broken at random."""

    name = "least-loaded"
    needs_overlap = False

    def __new__(cls, rng: random.Random | None = None):
        return super().__new__(cls, cls.name, rng)


class PrefixHashPolicy(_NativePolicy):
    """Options (defaults: :func:`policy_defaults`):
        key_blocks: how many leading blocks identify a prefix (1: prompts that share their
            first block share an owner).
        load_factor: ε of bounded-load hashing; None never spills.
    """

    name = "prefix-hash"
    needs_overlap = False

    def __new__(cls, rng: random.Random | None = None, **options: float | None):
        return _make(cls, rng, options)


class KvAwarePolicy(_NativePolicy):
    """Send each request where it leaves the least work, without piling onto one worker.

    Cost of worker *i*, in prefill-token equivalents (lower is better), three terms weighted by
    ``overlap_weight`` and ``request_weight`` (the rule is ``kvroute_core::policies::KvAware::costs``,
    quoted in docs/router.md). The first term is the prefill the request would cost there after its cached prefix; the
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

    * **Bounded admission wait** (off by default; KV memory, not counts): when the cheapest allowed worker
      could not admit the request now, because its requests in flight pin too many of its KV
      blocks (a shared prefix counted once; the router's model in ``kvroute_core::admission``,
      kept by the routing step when it knows the workers' capacity), and none of them is
      expected to end within ``admission_wait`` of a typical request's duration, the
      request goes to the cheapest worker where it would wait no longer and that runs fewer
      requests (if there is one).
      vLLM admits a request only when its prompt's blocks are free; a hit that waits out a
      running request costs hundreds of milliseconds, a miss elsewhere one prefill. At high
      concurrency this wait is the TTFT tail: with 2,000-token prefixes only three different
      ones fit a 585-block worker at once.

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

    Args (the options; their defaults: :func:`policy_defaults`):
        rng: for prompts shorter than a block only.
        block_size: tokens per KV block; must be the index's.
        overlap_weight: weight of the new request's prefill against the load terms.
        request_weight: prefill-token equivalent of one request in flight.
        load_factor: ε of the bounded-load guard; None turns it off.
        share_factor: δ of the bounded-share guard; None turns it off.
        share_window: the share's averaging window, in decisions per worker.
        share_weight: when placing a copy, the request-in-flight equivalents charged per
            fair share of recent decisions.
        admission_wait: the admission guard's bound, a fraction of a typical request's
            duration (routed to finished); None (the default) turns it off. 0.2 is about a
            miss's extra prefill on the reference fleet.
        adapter_weight: prefill-token equivalent charged to a worker whose full LoRA slots (the
            routing step's model, ``RoutingStep(max_loras=)``) hold other adapters than the
            request's (``docs/router.md``, adapter affinity).

    Why the defaults (:func:`policy_defaults`; chosen on the simulator's reference and Zipf
    workloads, figures in docs/results.md, "The kv-aware policy's defaults"): a weight above 1
    on the new prefill charges a miss for the cached blocks it evicts as well as for its
    compute, so a cached owner keeps its prefix while it has a prefill or two queued. ε = 1.5
    lets the load guard fire on a real burst but not on the in-flight noise of uniform traffic.
    δ must stay well under 0.5 (four busy workers of six is exactly 1.5 × the mean) and above
    the share noise of uniform and Zipf traffic. A window of 24 decisions per worker averages
    out uniform traffic's clumps without letting a skew last long. Placing the guard's copies by
    recent share rather than by load alone puts them where demand is lowest. The admission
    guard trades hits for tail, so it is off by default (docs/router.md).
    """

    name = "kv-aware"
    needs_overlap = True

    def __new__(cls, rng: random.Random | None = None, **options: float | None):
        return _make(cls, rng, options)


def _make(cls: type, rng: random.Random | None, options: dict[str, float | None]) -> _NativePolicy:
    """The native policy ``cls`` names, with ``options`` (absent ones at the native defaults,
    their one owner: ``kvroute_core::policies``, read by ``kvroute_serve::PolicySpec``)."""
    try:
        return _NativePolicy.__new__(cls, cls.name, rng, **options)
    except ValueError as exc:
        raise UserError(f"policy {cls.name!r}: {exc}") from None


POLICIES: dict[str, type] = {
    p.name: p
    for p in (RandomPolicy, RoundRobinPolicy, LeastLoadedPolicy, PrefixHashPolicy, KvAwarePolicy)
}


def policy_defaults(name: str) -> dict[str, float | None]:
    """The options policy ``name`` takes, with their defaults (the native policies' own,
    ``kvroute._native.policy_defaults``); empty for a policy without options or an unknown
    name."""
    return dict(_native_policy_defaults(name)) if name in POLICIES else {}


def policy_parameters(name: str) -> set[str]:
    """The options policy ``name`` takes; empty for an unknown name."""
    return set(policy_defaults(name))


def _check_numbers(name: str, options: dict[str, object]) -> None:
    """Refuse text (or a boolean) given for an option, naming the option, before the native
    policy sees it: every policy option is a number (or none, where the option is a guard
    that none turns off, which the native reader checks)."""
    for key, value in options.items():
        if isinstance(value, (str, bool)):
            raise UserError(f"policy {name!r}: option {key} takes a number, got {value!r}")


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
    _check_numbers(name, options)
    return cls(rng=rng, **options)
