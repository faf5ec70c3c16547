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
"""

from __future__ import annotations

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
    """

    block_hashes: list[int]
    prompt_tokens: int


@dataclass(slots=True)
class WorkerState:
    """What a policy may know about a worker: its name and the router's own load accounting."""

    name: str
    in_flight: int = 0
    in_flight_tokens: int = 0


class Policy(Protocol):
    name: str

    def choose(self, request: RequestView, workers: Sequence[WorkerState]) -> int:
        """Index into ``workers`` of the worker to send ``request`` to."""
        ...


class RandomPolicy:
    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def choose(self, request: RequestView, workers: Sequence[WorkerState]) -> int:
        return self.rng.randrange(len(workers))


class RoundRobinPolicy:
    name = "round-robin"

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


POLICIES: dict[str, type] = {
    p.name: p for p in (RandomPolicy, RoundRobinPolicy, LeastLoadedPolicy, PrefixHashPolicy)
}


def make_policy(name: str, rng: random.Random | None = None, **options) -> Policy:
    """A fresh policy object by name (``kvroute sim --policy`` / ``kvroute serve --policy``)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise UserError(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}") from None
    return cls(rng=rng, **options)
