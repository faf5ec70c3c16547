"""The router's index: which worker holds which KV block, keyed by kvroute's own block hashes.

Two sources feed it:

* **Events** (authoritative). Each worker's KV cache events (``kvroute.engine.events``, decoded
  from vLLM's ZMQ stream by ``kvroute.kvevents`` or emitted by the engine model) say exactly
  which blocks it stored and evicted. The index never trusts the engine's block hashes as keys:
  they depend on ``--prefix-caching-hash-algo`` and a seed the router cannot know. It hashes
  the events' ``token_ids`` itself with :class:`kvroute.blocks.BlockHasher` (the same function
  the router applies to prompts) and keeps, per worker, a map engine hash → own hash so that a
  ``BlockRemoved``, which carries engine hashes only, can be applied.
* **Predictions** (a bridge). When the router sends a prompt to a worker it records the
  prompt's blocks there at once (:meth:`KvIndex.record_routed`): the worker will hold them a
  few milliseconds later, but its ``BlockStored`` arrives only after the prefill step. Without
  the bridge a burst of requests for a new prefix would be spread over every worker before the
  first event lands. A predicted entry lives ``predicted_ttl`` seconds (events replace it
  sooner) and each worker keeps at most ``predicted_capacity_blocks`` of them, least recently
  routed evicted first (for engines without events: set it to the worker's KV blocks and the
  TTL to None, and the index models the worker's LRU cache).

Rules, and why:

* **Counts per (worker, block).** vLLM does not deduplicate: two requests computing the same
  block at once both store it, and each copy is removed with its own event. A block leaves a
  worker only when its count returns to zero.
* **Orphans are skipped.** A ``BlockStored`` whose ``parent_block_hash`` this worker never
  stored (the index joined the stream late, a replay gap was lost, or the parent was itself
  skipped) cannot be given own hashes: a block's own hash chains every token before it, and the
  event carries only its own blocks' tokens. Those blocks are counted in
  ``IndexStats.orphan_blocks`` and left out, so they cost a missed opportunity, never a false
  hit. Their later removals are unknown engine hashes and are ignored
  (``IndexStats.unknown_removals``).
* **Blocks a token-only hash cannot name are skipped** (``IndexStats.skipped_blocks``): blocks of
  another block size (a CPU offload tier), of a LoRA adapter, or with extra keys (multimodal
  inputs, cache salt): a plain prompt hashed by the router never matches them in the engine.
  Malformed ones (fewer tokens than blocks, ids that are not uint32) are skipped the same way.
* ``AllBlocksCleared`` (and :meth:`reset_worker`, for restarts and failed replays) forgets
  everything known about that worker, predicted entries included.

Lookup speed: every block maps to one int, a bitmask of the workers holding it (one bit per
worker). :meth:`overlaps` ANDs the masks along the prompt's chain and stops as soon as no worker
is left, so a lookup costs one or two dict reads per matched block whatever the number of
workers (``benchmarks/index_speed.py``). Memory is bounded by the blocks the workers hold plus
the predicted entries alive; keys that churn are deleted when their count or mask reaches zero.

``now`` arguments are seconds on one monotonic clock (``time.monotonic()`` in the router,
virtual time in the simulator) and must not go backwards.
"""

from __future__ import annotations

import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvroute.blocks import BlockHasher
from kvroute.engine.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

#: The array typecode of a 4-byte unsigned int (token ids are hashed as uint32).
_UINT32 = next(code for code in "IL" if array.array(code).itemsize == 4)


@dataclass(frozen=True, slots=True)
class IndexStats:
    """Size and health of the index.

    ``blocks`` counts (worker, block) pairs backed by events, ``predicted`` the predicted
    (worker, block) entries alive at the last call given a ``now``; the last three are
    cumulative counts of blocks or removals the index had to leave out (see the module
    docstring).
    """

    workers: int
    blocks: int
    predicted: int
    orphan_blocks: int = 0
    skipped_blocks: int = 0
    unknown_removals: int = 0


class _Worker:
    """Everything the index knows about one worker."""

    __slots__ = ("name", "bit", "blocks", "engine", "engine_dups", "own_dups", "predicted")

    def __init__(self, name: str, bit: int) -> None:
        self.name = name
        self.bit = bit
        #: Distinct own hashes held according to events.
        self.blocks = 0
        #: engine hash -> own hash, for removals and for chaining a child's own hash.
        self.engine: dict[int, int] = {}
        # The count of (worker, own hash) is the number of stored copies: one per engine hash
        # mapped to it, plus that engine hash's extra copies. Both extras are rare (vLLM's
        # duplicate blocks; two engine hashes with the same tokens, e.g. GPU and CPU copies of
        # one block), so they live apart and the common path touches one dict per block.
        #: engine hash -> copies beyond the first.
        self.engine_dups: dict[int, int] = {}
        #: own hash -> engine hashes mapped to it beyond the first.
        self.own_dups: dict[int, int] = {}
        #: own hash -> expiry time, least recently routed first.
        self.predicted: OrderedDict[int, float] = OrderedDict()


class KvIndex:
    """Which worker holds which block, keyed by kvroute's OWN chained block hashes.

    Args:
        hasher: the router's block hasher; prompts must be hashed with the same one
            (``hasher.hash_blocks(prompt_token_ids)``), and its block size must be the engines'.
        predicted_ttl: seconds a predicted entry lives; None keeps it until evicted by capacity
            (no-events mode).
        predicted_capacity_blocks: at most this many predicted entries per worker, least
            recently routed evicted first; None for no per-worker limit (the TTL bounds them).
    """

    def __init__(
        self,
        hasher: BlockHasher,
        *,
        predicted_ttl: float | None = 2.0,
        predicted_capacity_blocks: int | None = None,
    ) -> None:
        if predicted_ttl is None and predicted_capacity_blocks is None:
            raise ValueError("predicted entries need a TTL or a per-worker capacity (else they grow without bound)")
        if predicted_ttl is not None and predicted_ttl < 0:
            raise ValueError(f"predicted_ttl must be >= 0, got {predicted_ttl}")
        if predicted_capacity_blocks is not None and predicted_capacity_blocks < 0:
            raise ValueError(f"predicted_capacity_blocks must be >= 0, got {predicted_capacity_blocks}")
        self.hasher = hasher
        self.predicted_ttl = predicted_ttl
        self.predicted_capacity_blocks = predicted_capacity_blocks
        self._workers: dict[str, _Worker] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        #: own hash -> bitmask of workers holding it according to events.
        self._held: dict[int, int] = {}
        #: own hash -> bitmask of workers holding it according to predictions.
        self._predicted: dict[int, int] = {}
        #: (expiry, worker, own hash) in expiry order; stale items (refreshed or dropped
        #: entries) are skipped when popped and compacted away when they dominate.
        self._expiry: deque[tuple[float, _Worker, int]] = deque()
        #: worker lists -> _layout() answers; cleared whenever a worker comes or goes.
        self._layouts: dict[tuple[str, ...], tuple[int, dict[int, int]]] = {}
        self._orphan_blocks = 0
        self._skipped_blocks = 0
        self._unknown_removals = 0

    # -- workers ----------------------------------------------------------------------------

    def _worker(self, name: str) -> _Worker:
        w = self._workers.get(name)
        if w is None:
            if self._free_bits:
                bit = self._free_bits.pop()
            else:
                bit = 1 << self._next_bit
                self._next_bit += 1
            w = self._workers[name] = _Worker(name, bit)
            self._layouts.clear()
        return w

    def reset_worker(self, worker: str) -> None:
        """Forget what ``worker`` holds (engine restart, AllBlocksCleared, lost events); it
        stays known and starts again from an empty cache."""
        w = self._workers.get(worker)
        if w is not None:
            self._clear(w)

    def remove_worker(self, worker: str) -> None:
        """Forget ``worker`` entirely (it left the pool); its bit is reused by a later worker."""
        w = self._workers.pop(worker, None)
        if w is not None:
            self._clear(w)
            self._free_bits.append(w.bit)
            self._layouts.clear()

    def _clear(self, w: _Worker) -> None:
        keep = ~w.bit
        # Several engine hashes can map to one own hash: the second visit finds it cleared.
        for table, keys in ((self._held, w.engine.values()), (self._predicted, w.predicted)):
            for h in keys:
                m = table.get(h, 0) & keep
                if m:
                    table[h] = m
                elif h in table:
                    del table[h]
        w.blocks = 0
        w.engine.clear()
        w.engine_dups.clear()
        w.own_dups.clear()
        w.predicted.clear()

    # -- events -----------------------------------------------------------------------------

    def apply(self, worker: str, events: Iterable[KVCacheEvent]) -> None:
        """Apply one worker's KV cache events, in the order the engine emitted them."""
        w = self._worker(worker)
        for event in events:
            cls = type(event)
            if cls is BlockRemoved or (cls is not BlockStored and isinstance(event, BlockRemoved)):
                # Inlined: vLLM sends one BlockRemoved per evicted block, so half of all block
                # events are these and a call per event would dominate the ingest cost.
                engine = w.engine
                held = self._held
                for eh in event.block_hashes:
                    oh = engine.pop(eh, None)
                    if oh is None:
                        self._unknown_removals += 1
                        continue
                    if w.engine_dups and self._drop_copy(w.engine_dups, eh):
                        engine[eh] = oh  # another copy of this engine block is still stored
                        continue
                    if w.own_dups and self._drop_copy(w.own_dups, oh):
                        continue  # another engine hash still vouches for these tokens
                    w.blocks -= 1
                    m = held[oh] & ~w.bit
                    if m:
                        held[oh] = m
                    else:
                        del held[oh]
            elif cls is BlockStored or isinstance(event, BlockStored):
                self._store(w, event)
            elif isinstance(event, AllBlocksCleared):
                self._clear(w)

    def _store(self, w: _Worker, event: BlockStored) -> None:
        engine_hashes = event.block_hashes
        n = len(engine_hashes)
        bs = self.hasher.block_size
        if (
            event.block_size != bs
            or event.lora_id is not None
            or event.lora_name is not None
            or (event.extra_keys and any(k is not None for k in event.extra_keys))
            or len(event.token_ids) < n * bs
        ):
            self._skipped_blocks += n
            return
        parent = event.parent_block_hash
        parent_own = None
        if parent is not None:
            parent_own = w.engine.get(parent)
            if parent_own is None:
                self._orphan_blocks += n
                return
        tokens = event.token_ids
        if isinstance(tokens, list):
            # array.array converts a list of ints 4x faster than numpy; hash_blocks reads it
            # as uint32 without another copy.
            try:
                tokens = array.array(_UINT32, tokens)
            except (OverflowError, TypeError):  # not token ids: nothing to hash
                self._skipped_blocks += n
                return
        own_hashes = self.hasher.hash_blocks(tokens, parent_hash=parent_own, stop_block=n)
        engine = w.engine
        held = self._held
        predicted = w.predicted
        bit = w.bit
        for eh, oh in zip(engine_hashes, own_hashes):
            if eh in engine:
                w.engine_dups[eh] = w.engine_dups.get(eh, 0) + 1
                continue
            engine[eh] = oh
            m = held.get(oh, 0)
            if m & bit:
                w.own_dups[oh] = w.own_dups.get(oh, 0) + 1
                continue
            held[oh] = m | bit
            w.blocks += 1
            if predicted and oh in predicted:
                # The event now vouches for this block: the prediction has served its purpose.
                del predicted[oh]
                self._drop_predicted_bit(oh, bit)

    @staticmethod
    def _drop_copy(dups: dict[int, int], key: int) -> bool:
        """Take one extra copy of ``key`` off ``dups``; False when it had none."""
        d = dups.get(key)
        if not d:
            return False
        if d == 1:
            del dups[key]
        else:
            dups[key] = d - 1
        return True

    # -- predictions ------------------------------------------------------------------------

    def record_routed(self, worker: str, block_hashes: Sequence[int], now: float) -> None:
        """The router sent a prompt with these own block hashes to ``worker`` at ``now``."""
        w = self._worker(worker)
        self._expire(now)
        expires = float("inf") if self.predicted_ttl is None else now + self.predicted_ttl
        predicted = w.predicted
        table = self._predicted
        bit = w.bit
        track = self.predicted_ttl is not None
        # Tail first: vLLM frees a finished request's blocks in reverse so its tail is evicted
        # first; inserting in that order makes the LRU below evict the same way.
        held = self._held
        for h in reversed(block_hashes):
            if held.get(h, 0) & bit:
                continue  # events already vouch for it
            if h in predicted:
                predicted.move_to_end(h)
            else:
                table[h] = table.get(h, 0) | bit
            predicted[h] = expires
            if track:
                self._expiry.append((expires, w, h))
        cap = self.predicted_capacity_blocks
        if cap is not None:
            while len(predicted) > cap:
                h, _ = predicted.popitem(last=False)
                self._drop_predicted_bit(h, bit)
        if track and len(self._expiry) > 1024 and len(self._expiry) > 2 * self._num_predicted():
            self._compact_expiry()

    def _drop_predicted_bit(self, h: int, bit: int) -> None:
        m = self._predicted[h] & ~bit
        if m:
            self._predicted[h] = m
        else:
            del self._predicted[h]

    def _expire(self, now: float) -> None:
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            expires, w, h = expiry.popleft()
            if w.predicted.get(h) == expires:
                del w.predicted[h]
                self._drop_predicted_bit(h, w.bit)

    def _num_predicted(self) -> int:
        return sum(len(w.predicted) for w in self._workers.values())

    def _compact_expiry(self) -> None:
        """Rebuild the expiry queue from the live entries (refreshes leave stale items behind;
        this keeps the queue's memory proportional to the entries alive)."""
        live = [(exp, w, h) for w in self._workers.values() for h, exp in w.predicted.items()]
        live.sort(key=lambda item: item[0])
        self._expiry = deque(live)

    # -- queries ----------------------------------------------------------------------------

    def overlaps(self, block_hashes: Sequence[int], workers: Sequence[str], now: float) -> list[int]:
        """Number of leading blocks of the prompt each worker holds, aligned with ``workers``
        (distinct names; a worker the index has never heard of holds nothing)."""
        self._expire(now)
        result = [0] * len(workers)
        alive, position = self._layout(workers)
        if not alive:
            return result
        held = self._held.get
        predicted = self._predicted.get if self._predicted else None
        depth = 0
        for h in block_hashes:
            m = held(h, 0) & alive
            if m != alive and predicted is not None:
                m |= predicted(h, 0) & alive
            if m != alive:
                if depth:
                    _assign(result, position, alive & ~m, depth)
                alive = m
                if not alive:
                    return result
            depth += 1
        _assign(result, position, alive, depth)
        return result

    def _layout(self, workers: Sequence[str]) -> tuple[int, dict[int, int]]:
        """(bitmask of the known workers among ``workers``, bit -> position in ``workers``),
        memoized: a router asks with the same worker list request after request."""
        key = tuple(workers)
        cached = self._layouts.get(key)
        if cached is not None:
            return cached
        position: dict[int, int] = {}
        alive = 0
        for i, name in enumerate(workers):
            w = self._workers.get(name)
            if w is not None:
                position[w.bit] = i
                alive |= w.bit
        if len(self._layouts) >= 8:
            self._layouts.clear()
        self._layouts[key] = (alive, position)
        return alive, position

    def worker_blocks(self, worker: str) -> int:
        """Blocks the index attributes to ``worker`` (event-backed plus predicted)."""
        w = self._workers.get(worker)
        return w.blocks + len(w.predicted) if w is not None else 0

    def stats(self) -> IndexStats:
        return IndexStats(
            workers=len(self._workers),
            blocks=sum(w.blocks for w in self._workers.values()),
            predicted=self._num_predicted(),
            orphan_blocks=self._orphan_blocks,
            skipped_blocks=self._skipped_blocks,
            unknown_removals=self._unknown_removals,
        )


def _assign(result: list[int], position: dict[int, int], bits: int, depth: int) -> None:
    while bits:
        low = bits & -bits
        result[position[low]] = depth
        bits ^= low
