"""The engine model: a vLLM v1 scheduler over a BlockPool, with a cost model for time.

Pure by design (sans-I/O): no clock, no sockets, no asyncio. A driver hands it requests and the
current time and asks it to run a step; it answers what happened and how long the step took.
The simulator drives it on virtual time, the emulator on the wall clock.

Scheduling follows ``vllm/v1/core/sched/scheduler.py``:

* Continuous batching under a token budget (``max_num_batched_tokens``) and a sequence cap.
* Running requests first, in order; one that cannot get a block for its next token preempts
  the most recently admitted running request (its blocks are freed and it goes back to the
  front of the waiting queue, to be recomputed later).
* Then waiting requests, first come first served: look up the longest cached prefix (at most
  ``num_tokens - 1`` tokens, so a fully cached prompt still recomputes its last token), then
  allocate slots for the uncached part; if the blocks are not there the request keeps waiting
  and so does everyone behind it. Prefix-cache statistics are recorded at admission (an
  unadmitted lookup is not counted), and not for a preempted request coming back.
* Blocks become cached as soon as they are full and scheduled, before the step runs (a request
  admitted in the next step already hits them), generated tokens included.
* A finished request frees its blocks tail-first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate, repeat

import numpy as np

from kvroute.blocks import BlockHasher, as_token_array
from kvroute.engine.cost import CostModel
from kvroute.engine.events import EventBatch
from kvroute.engine.pool import BlockPool


@dataclass(slots=True, eq=False)
class EngineRequest:
    """One request inside the engine.

    Args:
        request_id: unique id.
        prompt_token_ids: the prompt.
        output_token_ids: the tokens the "sampler" will produce, in order; the request finishes
            after ``max_tokens`` of them (or all of them, if fewer are given).
        arrival_time: when the engine received it (after any front-end delay).
        block_hashes: hashes of the prompt's full blocks, if the caller already has them
            (the simulator memoizes shared prefixes); extended as blocks fill.
    """

    request_id: str
    prompt_token_ids: np.ndarray
    output_token_ids: np.ndarray
    arrival_time: float
    block_hashes: list[int] = field(default_factory=list)
    max_tokens: int = -1
    # -- state, owned by the engine --
    num_output: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    num_cached_blocks: int = 0
    num_preemptions: int = 0
    blocks: list[int] = field(default_factory=list)
    first_token_time: float | None = None
    finish_time: float | None = None
    admitted_time: float | None = None

    def __post_init__(self) -> None:
        self.prompt_token_ids = as_token_array(self.prompt_token_ids)
        self.output_token_ids = as_token_array(self.output_token_ids)
        if self.max_tokens < 0 or self.max_tokens > len(self.output_token_ids):
            self.max_tokens = len(self.output_token_ids)
        if self.max_tokens < 1:
            raise ValueError("a request must generate at least one token")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.num_output

    def token_ids(self, stop: int | None = None) -> np.ndarray:
        """Prompt plus the tokens generated so far (up to ``stop``)."""
        n = self.num_tokens if stop is None else stop
        if n <= len(self.prompt_token_ids):
            return self.prompt_token_ids[:n]
        return np.concatenate(
            (self.prompt_token_ids, self.output_token_ids[: n - len(self.prompt_token_ids)])
        )


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request: EngineRequest
    new_token_id: int
    first_token: bool
    finished: bool


@dataclass(slots=True)
class StepResult:
    """One engine step: scheduled at ``start``, outputs ready at ``end``."""

    start: float
    end: float
    prefill_tokens: int
    decode_seqs: int
    outputs: list[RequestOutput]
    events: EventBatch | None = None


@dataclass(slots=True)
class PrefixCacheStats:
    """vLLM's prefix-cache counters (tokens), cumulative."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0


class Engine:
    """One vLLM worker: a BlockPool, a scheduler and a cost model.

    Args:
        num_blocks: KV blocks including the null block.
        block_size: tokens per block.
        cost: the step-time model.
        hash_seed: root of the block-hash chain (see ``kvroute.blocks``).
        enable_caching: prefix caching on (vLLM's default in v1).
        emit_events: collect KV events per step (the emulator publishes them).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        cost: CostModel,
        hasher: BlockHasher | None = None,
        enable_caching: bool = True,
        emit_events: bool = False,
    ) -> None:
        # The engine tells the pool which hash each freed block holds (see ``_free``).
        self.pool = BlockPool(
            num_blocks, block_size, enable_caching, emit_events, track_block_hashes=False
        )
        self.block_size = block_size
        self.cost = cost
        self.hasher = hasher or BlockHasher(block_size)
        if self.hasher.block_size != block_size:
            raise ValueError("hasher block size differs from the engine's")
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.requests: dict[str, EngineRequest] = {}
        self.stats = PrefixCacheStats()
        # The waiting head's last failed admission: (request, pool.version, token budget).
        self._blocked: tuple[EngineRequest, int, int] | None = None
        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # -- driver API --------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def add_request(self, request: EngineRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self._extend_hashes(request, request.num_prompt_tokens // self.block_size)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> bool:
        """Drop a request (client went away); its blocks are freed like a finished one's."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if request in self.running:
            self.running.remove(request)
            self._free(request)
        else:
            self.waiting.remove(request)
        return True

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def step(self, now: float) -> StepResult:
        """Schedule and run one step starting at ``now``."""
        scheduled = self._schedule()
        prefill_tokens = 0
        decode_seqs = 0
        for request, n in scheduled:
            if request.num_computed_tokens >= request.num_prompt_tokens:
                decode_seqs += 1
            else:
                prefill_tokens += n
        end = now + self.cost.step_time(prefill_tokens, decode_seqs)
        outputs = self._update(scheduled, end)
        events = None
        if self.pool.emit_events:
            taken = self.pool.take_events()
            if taken:
                events = EventBatch(ts=end, events=taken)
        return StepResult(now, end, prefill_tokens, decode_seqs, outputs, events)

    def decode_run_length(self) -> int:
        """How many identical decode-only steps could run back to back from here, or 0.

        Eligible when every running request is decoding, the blocks all of them need for the
        run are free (so no step would preempt), and the waiting queue's head, if any, provably
        stays unadmitted in every step of the run (``_head_stays_blocked``); the run stops at
        the step in which the first request finishes. Running those steps at once with
        ``run_decode_steps`` leaves the cache exactly as stepping one at a time would (a
        request's new blocks are taken together rather than interleaved with other requests',
        which changes only which block ids they get and the order of events; so runs are not
        offered while events are being collected).

        Runs with a blocked waiting head matter for speed: a worker whose cache is full keeps
        decoding with a queue in front of it, and those steps were most of a large simulation.
        """
        running = self.running
        if not running or self.pool.emit_events:
            return 0
        if len(running) > self.cost.max_num_batched_tokens:
            return 0
        for r in running:
            # Decoding: one token to compute, and not the last token of a chunked prefill
            # (that step is a prefill, costed as one, and produces the first token).
            if not r.num_output:
                return 0
            if r.num_computed_tokens != len(r.prompt_token_ids) + r.num_output - 1:
                return 0
        steps = min(r.max_tokens - r.num_output for r in running)
        if steps < 2:
            return 0
        bs = self.block_size
        need = 0
        for r in running:
            need += -(-(r.num_computed_tokens + steps) // bs) - len(r.blocks)
        if need > self.pool.num_free_blocks:
            return 0
        if self.waiting and not self._head_stays_blocked(steps):
            return 0
        return steps

    def _waiting_budget(self, num_running: int) -> int:
        """Token budget left for the waiting queue after ``num_running`` decodes, or 0 when
        ``_schedule`` would not look at the waiting queue at all."""
        if num_running >= self.cost.max_num_seqs:
            return 0
        return max(0, self.cost.max_num_batched_tokens - num_running)

    def _head_stays_blocked(self, steps: int) -> bool:
        """True if the waiting head fails admission in each of the next ``steps`` decode steps.

        During such a run nothing is freed or touched; the running requests only take blocks
        from the free queue (possibly evicting the head's hit blocks) and cache the blocks
        their generated tokens fill. With ``T`` the head's tokens, ``h`` its hit blocks, ``E``
        how many of them are free and ``B`` the token budget left, ``_allocate`` refuses it
        when ``min(ceil(T/bs) - h, ceil(B/bs)) + E > free``. Taking a block never lowers
        ``ceil(T/bs) - h + E - free`` (an evicted hit block shortens the hit by at least as
        many blocks as it removes from ``E``), and ``ceil(B/bs) + E - free`` is at least
        ``ceil(B/bs) - free_now``; so if both bounds exceed the free blocks now, and no block
        cached during the run carries one of the head's hashes (which could lengthen its hit),
        every step refuses it. Only the head's hashes up to its first uncached one matter
        there: its hit is the longest cached run of its hashes and only shrinks by eviction,
        so growing it at any step takes caching one of those. A cheap sufficient test, not an
        exact one: when it fails the caller just steps one at a time.
        """
        budget = self._waiting_budget(len(self.running))
        if budget == 0:
            return True  # the waiting queue is not even looked at
        head = self.waiting[0]
        if head.num_computed_tokens or head.blocks:
            return False  # not a fresh admission (never the case in a waiting queue today)
        bs = self.block_size
        pool = self.pool
        hit: list[int] = []
        num_tokens = len(head.prompt_token_ids) + head.num_output
        max_blocks = (num_tokens - 1) // bs
        if pool.enable_caching:
            if len(head.block_hashes) < num_tokens // bs:
                self._extend_hashes(head, num_tokens // bs)
            hit = pool.find_longest_hit(head.block_hashes, max_blocks)
        lower_bound = min(
            -(-num_tokens // bs) - len(hit) + (pool.num_evictable(hit) if hit else 0),
            -(-budget // bs),
        )
        if lower_bound <= pool.num_free_blocks:
            return False
        if pool.enable_caching:
            # The hashes are needed by the run anyway; computing them now costs nothing extra.
            new_hashes: set[int] = set()
            for r in self.running:
                num_full = (r.num_computed_tokens + steps) // bs
                if num_full > r.num_cached_blocks:
                    if len(r.block_hashes) < num_full:
                        self._extend_hashes(r, num_full)
                    new_hashes.update(r.block_hashes[r.num_cached_blocks : num_full])
            if new_hashes and not new_hashes.isdisjoint(
                head.block_hashes[: min(len(hit) + 1, max_blocks)]
            ):
                return False
        return True

    def decode_step_time(self) -> float:
        return self.cost.step_time(0, len(self.running))

    def decode_step_ends(self, start: float, steps: int) -> list[float]:
        """End times of the next ``steps`` decode steps from ``start``, summed one step at a
        time as a driver of single steps does (``end = now + step time``), so that a run and
        single steps agree to the last bit and a driver can tell exactly which step an
        arrival falls in."""
        ends = list(accumulate(repeat(self.decode_step_time(), steps), initial=start))
        del ends[0]
        return ends

    def run_decode_steps(self, now: float, steps: int) -> StepResult:
        """Run ``steps`` decode steps at once (at most ``decode_run_length()``); only requests
        that finish produce an output."""
        bs = self.block_size
        pool = self.pool
        batch = len(self.running)
        end = self.decode_step_ends(now, steps)[-1]
        for r in self.running:
            computed = r.num_computed_tokens + steps
            need = -(-computed // bs) - len(r.blocks)
            if need > 0:
                r.blocks.extend(pool.get_new_blocks(need))
            num_full = computed // bs
            if num_full > r.num_cached_blocks:
                self._extend_hashes(r, num_full)
                pool.cache_full_blocks(r.blocks, r.block_hashes, r.num_cached_blocks, num_full, None)
                r.num_cached_blocks = num_full
            r.num_computed_tokens = computed
            r.num_output += steps
            self.generation_tokens_total += steps
        self._note_head_blocked(batch)
        outputs = []
        for r in [r for r in self.running if r.num_output >= r.max_tokens]:
            r.finish_time = end
            self.running.remove(r)
            self._free(r)
            del self.requests[r.request_id]
            outputs.append(RequestOutput(r, int(r.output_token_ids[r.num_output - 1]), False, True))
        return StepResult(now, end, 0, batch, outputs)

    def _note_head_blocked(self, num_running: int) -> None:
        """Leave ``_blocked`` as the skipped admission checks of a decode run would have: the
        last step that tried the waiting head (after the run's last cache change, before any
        request finished) recorded it as blocked at the current pool version."""
        budget = self._waiting_budget(num_running)
        if not self.waiting or budget == 0:
            return
        head = self.waiting[0]
        blocked = self._blocked
        version = self.pool.version
        if not (blocked and blocked[0] is head and blocked[1] == version and budget >= blocked[2]):
            self._blocked = (head, version, budget)

    # -- scheduling --------------------------------------------------------------------------

    def _schedule(self) -> list[tuple[EngineRequest, int]]:
        budget = self.cost.max_num_batched_tokens
        scheduled: list[tuple[EngineRequest, int]] = []
        preempted = False

        bs = self.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            computed = request.num_computed_tokens
            n = min(len(request.prompt_token_ids) + request.num_output - computed, budget)
            if (
                n == 1
                and computed < len(request.blocks) * bs
                and (computed + 1) // bs == request.num_cached_blocks
            ):
                # The common decode step: its slot exists and it completes no block, so
                # allocate_slots would change nothing.
                scheduled.append((request, 1))
                budget -= 1
                i += 1
                continue
            while not self._allocate(request, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled.append((request, n))
                budget -= n
                i += 1
                continue
            break  # the request preempted itself: nothing more can run this step

        if preempted:
            return scheduled
        while self.waiting and budget > 0 and len(self.running) < self.cost.max_num_seqs:
            request = self.waiting[0]
            blocked = self._blocked
            if (
                blocked
                and blocked[0] is request
                and blocked[1] == self.pool.version
                and budget >= blocked[2]
            ):
                # Nothing that could admit it has happened since it last failed (no block
                # freed or newly cached, and its chunk would be no smaller): it fails again.
                break
            hit_blocks: list[int] = []
            if request.num_computed_tokens == 0:
                max_blocks = (request.num_tokens - 1) // self.block_size
                self._extend_hashes(request, request.num_tokens // self.block_size)
                hit_blocks = self.pool.find_longest_hit(request.block_hashes, max_blocks)
            num_hit = len(hit_blocks) * self.block_size
            n = min(request.num_tokens - num_hit, budget)
            if not self._allocate(request, n, hit_blocks):
                self._blocked = (request, self.pool.version, budget)
                break
            self.waiting.popleft()
            if request.num_preemptions:
                self.stats.preempted_requests += 1
                self.stats.preempted_queries += request.num_tokens
                self.stats.preempted_hits += num_hit
            else:
                self.stats.requests += 1
                self.stats.queries += request.num_tokens
                self.stats.hits += num_hit
                self.prompt_tokens_total += request.num_prompt_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.num_computed_tokens = num_hit
            self.running.append(request)
            scheduled.append((request, n))
            budget -= n
        return scheduled

    def _allocate(self, request: EngineRequest, num_new: int, hit_blocks: list[int] = ()) -> bool:
        """vLLM's ``allocate_slots``: room for ``num_new`` more tokens after the hit blocks;
        False (and no change) if the free queue cannot supply them."""
        pool = self.pool
        num_computed = request.num_computed_tokens + len(hit_blocks) * self.block_size
        required = -(-(num_computed + num_new) // self.block_size)
        need = required - len(request.blocks) - len(hit_blocks)
        if need > pool.num_free_blocks - (pool.num_evictable(hit_blocks) if hit_blocks else 0):
            return False
        if hit_blocks:
            pool.touch(hit_blocks)
            request.blocks.extend(hit_blocks)
            request.num_cached_blocks = len(request.blocks)
        if need > 0:
            request.blocks.extend(pool.get_new_blocks(need))
        num_full = min(num_computed + num_new, request.num_tokens) // self.block_size
        if num_full > request.num_cached_blocks:
            self._extend_hashes(request, num_full)
            pool.cache_full_blocks(
                request.blocks,
                request.block_hashes,
                request.num_cached_blocks,
                num_full,
                request.token_ids(num_full * self.block_size) if pool.emit_events else None,
            )
            request.num_cached_blocks = num_full
        return True

    def _extend_hashes(self, request: EngineRequest, num_full: int) -> None:
        """Make sure ``request.block_hashes`` covers its first ``num_full`` blocks, hashing
        only the tokens of the blocks it lacks (a decode step completes one block of a
        long sequence; rebuilding the whole token array for it was most of its cost)."""
        have = len(request.block_hashes)
        if have >= num_full:
            return
        bs = self.block_size
        lo, hi = have * bs, num_full * bs
        prompt = request.prompt_token_ids
        p = len(prompt)
        if hi <= p:
            window = prompt[lo:hi]
        elif lo >= p:
            window = request.output_token_ids[lo - p : hi - p]
        else:
            window = np.concatenate((prompt[lo:], request.output_token_ids[: hi - p]))
        request.block_hashes.extend(
            self.hasher.hash_blocks(window, parent_hash=request.block_hashes[-1] if have else None)
        )

    def _free(self, request: EngineRequest) -> None:
        """Free a request's blocks tail-first, telling the pool the hash each one holds: its
        first ``num_cached_blocks`` blocks hold the request's hashes at the same positions
        (prefix hits were found by them, the rest were cached from them), the others none."""
        blocks = request.blocks
        held = request.block_hashes[: request.num_cached_blocks] if self.pool.enable_caching else []
        if len(blocks) > len(held):
            held += repeat(None, len(blocks) - len(held))
        held.reverse()
        self.pool.free_blocks(blocks[::-1], held)
        request.blocks = []
        request.num_cached_blocks = 0

    def _preempt(self, request: EngineRequest) -> None:
        self._free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _update(self, scheduled: list[tuple[EngineRequest, int]], end: float) -> list[RequestOutput]:
        outputs = []
        for request, n in scheduled:
            request.num_computed_tokens += n
            if request.num_computed_tokens < len(request.prompt_token_ids) + request.num_output:
                continue  # a prefill chunk that does not reach the end samples nothing
            token = int(request.output_token_ids[request.num_output])
            request.num_output += 1
            self.generation_tokens_total += 1
            first = request.first_token_time is None
            if first:
                request.first_token_time = end
            finished = request.num_output >= request.max_tokens
            if finished:
                request.finish_time = end
                self.running.remove(request)
                self._free(request)
                del self.requests[request.request_id]
            outputs.append(RequestOutput(request, token, first, finished))
        return outputs
