"""Analytic model of prefix-cache hit rates in a fleet of vLLM workers.

Pure functions and dataclasses, no I/O: they turn a model's KV geometry, a worker's KV memory
and a workload's shape into the numbers docs/experiment.md reasons with, and say where each holds.

From memory to capacity (what vLLM does at start-up):

* KV bytes per token = 2 (K and V) · layers · KV heads · head_dim · dtype bytes; Qwen3-0.6B in
  bf16 → 114,688 B.
* ``num_gpu_blocks`` = memory // (block_size · bytes per token); 1 GiB at block size 16 → 585.
  Block 0 is vLLM's null block, so 584 blocks can hold KV.
* A request leaves behind the *full* blocks of every token whose KV it computed: the prompt and
  all generated tokens but the last (which is sampled, never fed back). The reference request
  (2,371 prompt + 64 output tokens) leaves 2,434 // 16 = 152 blocks: 127 of its prefix, which
  the next request with that prefix reuses, and 25 of its own suffix and output, which nobody
  reuses. So C = 584 / 152 ≈ 3.84 requests fit per worker. (docs/experiment.md's 3.95 divides
  9,362 KV tokens by the 2,371-token prompt; it ignores the output tokens and the null block.)

Four estimates of the hit rate, each valid somewhere else:

* ``formula_hit`` — min(1, C/K): random balancing, LRU, uniform popularity, equal lengths,
  K ≫ 1. Every worker sees every prefix, so each holds the ~C most recent; W cancels.
* ``routing_bound_hit`` — min(1, W·C/K): an upper bound for any router that gives each prefix
  one owner with balanced ownership (W workers hold W·C prefixes between them).
* ``first_contact_hit`` — exact when every prefix a worker is sent stays cached on it: the only
  misses are first contacts, W·K − K of them after a warmup of one request per prefix under
  random balancing (6 workers, K = 2, 200 requests → 190 hits), none under prefix affinity.
* Che's approximation — LRU under any popularity and mixed lengths. A block stays cached for a
  characteristic time T (in requests reaching its worker) after its last use; T solves

      Σ_i s_i · (1 − exp(−p_i·T)) + u · T = B

  where s_i is prefix i's reusable block count, p_i the probability a request to this worker
  carries prefix i, u the blocks of unique suffix and output one request adds, and B the usable
  blocks. Prefix i then hits with probability 1 − exp(−p_i·T). Random balancing shows each
  worker the whole mix at 1/W of the rate, and T is counted in that worker's requests, so W
  cancels again; prefix-affinity routing gives each worker its own subset of prefixes.
  It assumes independent references (each request draws its prefix afresh) and a cache large
  against one prefix; with only a few prefixes per worker, and because vLLM evicts a chain
  tail-first (leaving partial hits that the model counts as misses), it is approximate.

``predict`` applies Che to the measured window of one fleet (``window_hits``): a request hits
when its (worker, prefix) pair was used less than T ago, and before the window there is only
the warmup, so first contacts miss and the rest hit with Che's probability. At K = 2 this gives
the first-contact count; at K = 24 the steady-state rate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# Blocks that can hold KV: all but vLLM's null block (the engine model's rule, re-exported).
from kvroute.engine.pool import usable_blocks

#: Bytes per KV element by dtype name (vLLM's ``--dtype`` / ``--kv-cache-dtype`` spellings).
DTYPE_BYTES: dict[str, int] = {
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}

#: Routing policies the model knows: how each spreads a prefix's requests over workers.
POLICIES = ("random", "prefix-hash")


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name such as ``bfloat16`` or ``fp8``."""
    try:
        return DTYPE_BYTES[name.strip().lower()]
    except KeyError:
        raise ValueError(
            f"unknown dtype {name!r}; choose one of: {', '.join(DTYPE_BYTES)}"
        ) from None


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 2
) -> int:
    """KV cache bytes one token occupies: a key and a value vector per layer and KV head.

    Qwen3-0.6B (28 layers, 8 KV heads, head_dim 128, bf16) → 2·28·8·128·2 = 114,688.
    """
    for name, value in (
        ("layers", num_layers),
        ("KV heads", num_kv_heads),
        ("head_dim", head_dim),
        ("dtype bytes", dtype_bytes),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class ModelShape:
    """The KV geometry of a model, and the block size vLLM uses for it by default.

    Args:
        name: preset name or a description.
        num_layers, num_kv_heads, head_dim: from the model's config.
        dtype: KV cache dtype name (see ``DTYPE_BYTES``).
        block_size: vLLM's default KV block size where this model is usually served
            (16 on GPU, 128 on vLLM's CPU backend).
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    block_size: int = 16

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(
            self.num_layers, self.num_kv_heads, self.head_dim, dtype_bytes(self.dtype)
        )


#: The reference experiment's model, and the tiny random Qwen3-style model served by vLLM on CPU
#: in this project's tests (docs/vllm.md): 2 layers, 2 KV heads, head_dim 32 → 512 B/token.
MODEL_PRESETS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("qwen3-0.6b", num_layers=28, num_kv_heads=8, head_dim=128, block_size=16),
        ModelShape("tiny-cpu", num_layers=2, num_kv_heads=2, head_dim=32, block_size=128),
    )
}


def num_kv_blocks(kv_cache_memory_bytes: int, kv_bytes_per_token: int, block_size: int) -> int:
    """KV blocks vLLM allocates from ``--kv-cache-memory-bytes`` (its ``num_gpu_blocks``).

    vLLM's ``get_num_blocks`` computes ``memory // page_size // num_layers`` with a per-layer
    page of ``2 · block_size · kv_heads · head_dim · dtype_bytes``; nested floor divisions by
    positive integers equal one floor division by their product, so this is
    ``memory // (block_size · bytes per token)``. The count includes the null block.
    1 GiB, 114,688 B/token, block size 16 → 585.
    """
    if kv_cache_memory_bytes < 0:
        raise ValueError(f"KV cache memory must be >= 0 bytes, got {kv_cache_memory_bytes}")
    if kv_bytes_per_token < 1 or block_size < 1:
        raise ValueError("bytes per token and block size must be >= 1")
    return kv_cache_memory_bytes // (block_size * kv_bytes_per_token)


# -- workload ----------------------------------------------------------------------------


def zipf_popularity(num_prefixes: int, alpha: float) -> np.ndarray:
    """Request probability of each prefix: prefix i (0-based, rank i+1) ∝ (i+1)^-α.

    α = 0 is uniform. Matches ``kvroute.workload``: prefix 0 is the most popular.
    """
    if num_prefixes < 1:
        raise ValueError(f"need at least one prefix, got {num_prefixes}")
    if alpha < 0 or not math.isfinite(alpha):
        raise ValueError(f"Zipf alpha must be a finite number >= 0, got {alpha}")
    weights = np.arange(1, num_prefixes + 1, dtype=float) ** -alpha
    return weights / weights.sum()


@dataclass(frozen=True)
class WorkloadShape:
    """The shape of a prefix-sharing workload, as much as the model needs of it.

    Args:
        prefix_tokens: length of each of the K shared prefixes (K = its length).
        suffix_tokens: mean length of a request's unique suffix.
        output_tokens: mean generated tokens per request.
        popularity: probability of each prefix; None for uniform (each equally often).
        requests: measured requests; None for the reference rule max(200, 20·K).
        warmup: whether one unmeasured request per prefix precedes the measured window.
    """

    prefix_tokens: tuple[int, ...]
    suffix_tokens: float = 339.0
    output_tokens: float = 64.0
    popularity: tuple[float, ...] | None = None
    requests: int | None = None
    warmup: bool = True

    def __post_init__(self) -> None:
        if not self.prefix_tokens:
            raise ValueError("need at least one prefix")
        if any(n < 0 for n in self.prefix_tokens):
            raise ValueError("prefix lengths must be >= 0")
        if self.suffix_tokens < 0:
            raise ValueError(f"suffix tokens must be >= 0, got {self.suffix_tokens}")
        if self.output_tokens < 1:
            raise ValueError(f"output tokens must be >= 1, got {self.output_tokens}")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests}")
        if self.popularity is not None:
            p = np.asarray(self.popularity, dtype=float)
            if len(p) != len(self.prefix_tokens):
                raise ValueError(
                    f"popularity has {len(p)} entries for {len(self.prefix_tokens)} prefixes"
                )
            if np.any(p < 0) or not np.isfinite(p).all() or p.sum() <= 0:
                raise ValueError("popularity must be finite, >= 0 and not all zero")
        if min(self.prefix_tokens) + self.suffix_tokens < 1:
            raise ValueError("a prompt needs at least one token (prefix + suffix lengths are 0)")

    @classmethod
    def reference(
        cls,
        prefixes: int,
        prefix_tokens: int | Sequence[int] = 2032,
        suffix_tokens: float = 339.0,
        output_tokens: float = 64.0,
        zipf_alpha: float = 0.0,
        requests: int | None = None,
        warmup: bool = True,
    ) -> WorkloadShape:
        """The reference experiment's workload with K = ``prefixes``.

        ``prefix_tokens`` may be one length or several, assigned to the prefixes in turn
        (prefix i gets ``prefix_tokens[i % len]``), so one list of mixed lengths serves every K.
        """
        if prefixes < 1:
            raise ValueError(f"need at least one prefix, got {prefixes}")
        lengths = [prefix_tokens] if isinstance(prefix_tokens, int) else list(prefix_tokens)
        if not lengths:
            raise ValueError("need at least one prefix length")
        popularity = (
            None if zipf_alpha == 0 else tuple(zipf_popularity(prefixes, zipf_alpha).tolist())
        )
        return cls(
            prefix_tokens=tuple(int(lengths[i % len(lengths)]) for i in range(prefixes)),
            suffix_tokens=suffix_tokens,
            output_tokens=output_tokens,
            popularity=popularity,
            requests=requests,
            warmup=warmup,
        )

    @property
    def num_prefixes(self) -> int:
        return len(self.prefix_tokens)

    @property
    def num_requests(self) -> int:
        return self.requests if self.requests is not None else max(200, 20 * self.num_prefixes)

    @property
    def probabilities(self) -> np.ndarray:
        if self.popularity is None:
            return np.full(self.num_prefixes, 1.0 / self.num_prefixes)
        p = np.asarray(self.popularity, dtype=float)
        return p / p.sum()

    @property
    def is_uniform(self) -> bool:
        p = self.probabilities
        return bool(np.allclose(p, p[0]))

    @property
    def has_mixed_lengths(self) -> bool:
        return len(set(self.prefix_tokens)) > 1


@dataclass(frozen=True)
class BlockAccounting:
    """Per-prefix block counts of one request, from mean lengths.

    Attributes:
        prefix_blocks: s_i, the full blocks of prefix i (shared by every request carrying it;
            the block that straddles prefix and suffix is the request's own).
        hit_blocks: blocks a hit reuses: s_i, capped so the last prompt token is recomputed.
        footprint_blocks: full blocks a finished request leaves cached (prompt and output
            tokens whose KV was computed, i.e. all but the last output token).
        unique_blocks: footprint − prefix blocks, reused by nobody.
        prompt_tokens: mean prompt length per prefix.
    """

    prefix_blocks: np.ndarray
    hit_blocks: np.ndarray
    footprint_blocks: np.ndarray
    unique_blocks: np.ndarray
    prompt_tokens: np.ndarray


def block_accounting(workload: WorkloadShape, block_size: int) -> BlockAccounting:
    """How many blocks each kind of request reuses, leaves cached, and adds of its own."""
    if block_size < 1:
        raise ValueError(f"block size must be >= 1, got {block_size}")
    prefix = np.asarray(workload.prefix_tokens, dtype=float)
    prompt = prefix + workload.suffix_tokens
    prefix_blocks = np.floor(prefix / block_size)
    # vLLM never serves the whole prompt from cache: at most (prompt - 1) tokens, in blocks.
    hit_blocks = np.minimum(prefix_blocks, np.floor((prompt - 1) / block_size))
    footprint = np.floor((prompt + workload.output_tokens - 1) / block_size)
    unique = footprint - prefix_blocks
    return BlockAccounting(prefix_blocks, hit_blocks, footprint, unique, prompt)


# -- reference formulas --------------------------------------------------------------------


def capacity_requests(usable_blocks: int, blocks_per_request: float) -> float:
    """C: how many requests' cached blocks fit in one worker's usable blocks.

    With mixed lengths pass the popularity-weighted mean footprint; C/K is then one worker's
    capacity over the fleet's total volume of distinct requests, which is what matters, not K.
    """
    if blocks_per_request <= 0:
        raise ValueError(f"blocks per request must be > 0, got {blocks_per_request}")
    return usable_blocks / blocks_per_request


def capacity_for_mean_lengths(
    prefix_tokens: float, suffix_tokens: float, output_tokens: float, num_blocks: int, block_size: int
) -> float:
    """C of the formula for a workload described by its mean lengths: a worker's usable blocks
    (``num_blocks`` includes the null block) over the blocks one such request leaves cached.
    What ``kvroute sim``, ``bench`` and ``experiment`` print beside the measured hit rate."""
    shape = WorkloadShape.reference(
        prefixes=1,
        prefix_tokens=round(prefix_tokens),
        suffix_tokens=suffix_tokens,
        output_tokens=max(output_tokens, 1.0),
    )
    footprint = float(block_accounting(shape, block_size).footprint_blocks[0])
    return capacity_requests(usable_blocks(num_blocks), footprint)


def formula_hit(capacity: float, num_prefixes: int) -> float:
    """min(1, C/K): random balancing under LRU.

    Holds for uniform popularity, equal request lengths, K ≫ 1 and random (or any spreading)
    balancing: each worker sees every prefix and holds the ~C most recently used, whatever W.
    Skew raises the real hit rate above it; near K ≈ C first contacts and unique suffix blocks
    lower it.
    """
    return min(1.0, capacity / num_prefixes)


def routing_bound_hit(capacity: float, num_prefixes: int, workers: int) -> float:
    """min(1, W·C/K): the most that routing each prefix to one owner can reach.

    An upper bound, met only with balanced ownership and no room lost to unique suffix blocks;
    uneven hashing and those blocks keep a real router below it.
    """
    return min(1.0, workers * capacity / num_prefixes)


def first_contact_misses(
    workers: int, num_prefixes: int, policy: str = "random", warmup: bool = True
) -> int:
    """Misses when every prefix fits on every worker it is sent to: one per (worker, prefix)
    pair that meets, less the pairs the warmup (one request per prefix) already filled.

    Random balancing: every pair meets once the window is long enough → W·K − K (W·K without
    warmup). Prefix affinity: K pairs → 0 (K without warmup). Assumes every pair is contacted.
    """
    _check_policy(policy)
    pairs = workers * num_prefixes if policy == "random" else num_prefixes
    return pairs - (num_prefixes if warmup else 0)


def first_contact_hit(
    workers: int,
    num_prefixes: int,
    requests: int,
    policy: str = "random",
    warmup: bool = True,
) -> float:
    """Request hit rate when only first contacts miss: 6 workers, K = 2, 200 requests → 0.95;
    3 workers → 0.98. Valid only when every prefix stays cached on every worker it reaches."""
    misses = first_contact_misses(workers, num_prefixes, policy, warmup)
    return max(0.0, (requests - misses) / requests)


# -- Che's approximation ------------------------------------------------------------------


def che_characteristic_time(
    prefix_blocks: Sequence[float] | np.ndarray,
    probabilities: Sequence[float] | np.ndarray,
    unique_blocks: float,
    capacity_blocks: float,
) -> float:
    """T, in requests reaching the worker, with Σ s_i·(1 − e^{−p_i·T}) + u·T = B.

    The left side counts the distinct blocks referenced in the last T requests (what an LRU
    cache of B blocks holds); it grows strictly with T, so bisection finds the root. Returns
    ``inf`` when nothing is ever evicted (no unique blocks and all prefixes fit) and 0 for a
    cache with no room.
    """
    s = np.asarray(prefix_blocks, dtype=float)
    p = np.asarray(probabilities, dtype=float)
    if capacity_blocks <= 0:
        return 0.0
    if unique_blocks <= 0 and float(s[p > 0].sum()) <= capacity_blocks:
        return math.inf

    def occupied(t: float) -> float:
        return float(np.sum(s * -np.expm1(-p * t))) + unique_blocks * t

    # Bracket the root within a factor of two, then bisect: ~60 steps to full precision.
    hi = 1.0
    while occupied(hi) < capacity_blocks:
        hi *= 2.0
    lo = 0.0 if hi == 1.0 else hi / 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if occupied(mid) < capacity_blocks:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


def che_hit_probabilities(probabilities: np.ndarray, characteristic_time: float) -> np.ndarray:
    """Per-prefix hit probability 1 − e^{−p_i·T} (1 where T is infinite and p_i > 0)."""
    p = np.asarray(probabilities, dtype=float)
    if math.isinf(characteristic_time):
        return (p > 0).astype(float)
    return -np.expm1(-p * characteristic_time)


def prefix_hash_assignment(num_prefixes: int, workers: int) -> tuple[int, ...]:
    """Balanced ownership: prefix i → worker i mod W (the best case for hashing)."""
    return tuple(i % workers for i in range(num_prefixes))


def window_hits(
    rate: np.ndarray, length: float, characteristic_time: float, warmed: bool
) -> np.ndarray:
    """Expected hits of one (worker, prefix) pair in a measured window, Che-style.

    Requests of the pair arrive at ``rate`` per request reaching the worker, for ``length`` of
    them. A request hits when the pair was last used less than T ago; before the window there
    is nothing, or the warmup request at its start. So the first T of the window lose only the
    first contact (none if warmed), and after that each request misses with e^{−rate·T}:

        misses = (1 − e^{−rate·min(length, T)}) [unless warmed] + rate·(length − T)⁺·e^{−rate·T}

    With T infinite this is exactly the first contact, 1 − e^{−rate·length} (0 if warmed).
    """
    r = np.asarray(rate, dtype=float)
    t = characteristic_time
    seen = min(length, t)
    cold = np.zeros_like(r) if warmed else -np.expm1(-r * seen)
    steady = np.zeros_like(r) if math.isinf(t) else r * max(length - t, 0.0) * np.exp(-r * t)
    return r * length - cold - steady


@dataclass(frozen=True)
class CheEstimate:
    """Che's approximation for one fleet.

    Attributes:
        prefix_hit: steady-state hit probability of each prefix on the workers it reaches.
        window_hits: expected hits of each prefix over the measured window, first contacts
            and the warmup included.
        first_contacts: expected first contacts of each prefix in the window (pairs of a
            worker and the prefix that meet for the first time).
        characteristic_times: T per worker in that worker's requests (one shared value under
            random balancing; None for a worker that owns no prefix).
    """

    prefix_hit: np.ndarray
    window_hits: np.ndarray
    first_contacts: np.ndarray
    characteristic_times: tuple[float | None, ...]


def che_estimate(
    workload: WorkloadShape,
    accounting: BlockAccounting,
    capacity_blocks: int,
    workers: int,
    policy: str,
    assignment: Sequence[int] | None = None,
) -> CheEstimate:
    """Che's per-prefix hit probabilities under a routing policy, in steady state and over
    the workload's measured window.

    Random balancing: one equation with the whole popularity mix (W cancels); each of the W
    workers meets prefix i at rate p_i per request it receives, over N/W requests, and the
    warmup filled one of them. Prefix affinity: one equation per worker over the prefixes it
    owns, with popularity renormalised to that worker's stream (q_i = p_i / P_w), u its mean
    unique blocks per request, N·P_w requests, and the warmup filling the owner.
    """
    _check_policy(policy)
    s, u = accounting.prefix_blocks, accounting.unique_blocks
    p = workload.probabilities
    n = workload.num_requests
    warm = workload.warmup
    if policy == "random":
        t = che_characteristic_time(s, p, float(np.dot(p, u)), capacity_blocks)
        length = n / workers
        warmed = 1 if warm else 0
        hits = (workers - warmed) * window_hits(p, length, t, False)
        if warm:
            hits = hits + window_hits(p, length, t, True)
        contacts = (workers - warmed) * -np.expm1(-p * length)
        return CheEstimate(che_hit_probabilities(p, t), hits, contacts, (t,))
    owners = np.asarray(
        assignment if assignment is not None else prefix_hash_assignment(len(p), workers)
    )
    hit = np.zeros_like(p)
    hits = np.zeros_like(p)
    contacts = np.zeros_like(p)
    times: list[float | None] = []
    for w in range(workers):
        mine = owners == w
        share = float(p[mine].sum())
        if share <= 0:
            times.append(None)
            continue
        q = p[mine] / share
        t = che_characteristic_time(s[mine], q, float(np.dot(q, u[mine])), capacity_blocks)
        hit[mine] = che_hit_probabilities(q, t)
        hits[mine] = window_hits(q, n * share, t, warm)
        if not warm:
            contacts[mine] = -np.expm1(-q * n * share)
        times.append(t)
    return CheEstimate(hit, hits, contacts, tuple(times))


# -- the prediction --------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    """What the model predicts for one fleet and workload.

    Attributes:
        policy, workers, prefixes, requests: the point (W, K, measured requests N).
        usable_blocks: B, blocks per worker minus the null block.
        blocks_per_request: popularity-weighted mean footprint of a finished request.
        capacity_requests: C = B / blocks_per_request.
        formula_hit: min(1, C/K).
        bound_hit: min(1, W·C/K).
        first_contact_hit: (N − first-contact misses) / N, or None where prefixes get evicted.
        first_contact_misses: W·K − K under random balancing (0 under affinity), or None.
        che_hit: Che's steady-state request hit rate Σ p_i·(1 − e^{−p_i·T}).
        che_token_hit: the same in tokens: cached prefix tokens over prompt tokens.
        request_hit_rate: the prediction for the measured window: expected first contacts
            miss, the rest hit with Che's probability.
        token_hit_rate: the same in tokens (what vLLM's prefix_cache_hits/queries report).
        expected_first_contacts: expected first-contact misses in the window.
        characteristic_times: Che's T per worker (None: owns nothing; inf: nothing evicted).
        prefix_hit: steady-state hit probability of each prefix.
        notes: where each estimate holds, for these inputs.
    """

    policy: str
    workers: int
    prefixes: int
    requests: int
    usable_blocks: int
    block_size: int
    blocks_per_request: float
    capacity_requests: float
    formula_hit: float
    bound_hit: float
    first_contact_hit: float | None
    first_contact_misses: int | None
    che_hit: float
    che_token_hit: float
    request_hit_rate: float
    token_hit_rate: float
    expected_first_contacts: float
    characteristic_times: tuple[float | None, ...]
    prefix_hit: tuple[float, ...]
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> dict:
        """A JSON-ready dict. Characteristic times: null for a worker that owns no prefix,
        the string "inf" where nothing is ever evicted (strict JSON has no infinity)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["characteristic_times"] = [
            "inf" if t is not None and math.isinf(t) else t for t in self.characteristic_times
        ]
        out["prefix_hit"] = list(self.prefix_hit)
        out["notes"] = list(self.notes)
        return out


#: Validity statements, shown with every prediction.
NOTE_FORMULA = (
    "min(1, C/K) holds for random balancing under LRU with uniform popularity, equal lengths "
    "and K >> 1; the number of workers W does not appear."
)
NOTE_BOUND = (
    "min(1, W*C/K) is an upper bound for routing each prefix to one owner with balanced "
    "ownership; unique suffix blocks and uneven hashing keep real routers below it."
)
NOTE_CHE = (
    "Che's approximation assumes independent requests and caches large against one prefix; "
    "it is approximate when a worker holds only a few prefixes, and ignores blocks pinned by "
    "in-flight requests. It counts the partial hits left by vLLM's tail-first eviction as "
    "misses, so measured request hit rates (any cached token) can run higher; the token "
    "ratio is the closer match."
)
NOTE_WINDOW = (
    "Predicted = Che over the measured window: in the first T requests a worker receives, only "
    "first contacts miss (the warmup counts as a use); later requests hit with Che's "
    "probability."
)
NOTE_SKEW = (
    "Popularity is skewed: C/K ignores skew and understates random balancing; the Che "
    "estimate accounts for it."
)
NOTE_MIXED = (
    "Prefix lengths differ: C uses the mean cached blocks per request, so C/K compares one "
    "worker's capacity with the total volume of prefixes, not with their count."
)
NOTE_FIRST_CONTACT = (
    "First contact is exact where every prefix fits on every worker it is sent to: each "
    "(worker, prefix) pair then misses once, less the pairs the warmup filled (W*K - K under "
    "random balancing, 0 under prefix affinity), if every pair meets in the window."
)
NOTE_NO_FIRST_CONTACT = (
    "First contact does not apply where prefixes are evicted: it needs every prefix to fit on "
    "every worker it is sent to."
)


def _check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of: {', '.join(POLICIES)}")


def predict(
    workload: WorkloadShape,
    workers: int,
    blocks_per_worker: int,
    block_size: int,
    policy: str = "random",
    assignment: Sequence[int] | None = None,
) -> Prediction:
    """Predict the prefix-cache hit rates of a fleet.

    Args:
        workload: the requests' shape.
        workers: W, identical workers.
        blocks_per_worker: vLLM's ``num_gpu_blocks`` per worker, null block included
            (``num_kv_blocks`` computes it from memory).
        block_size: tokens per KV block.
        policy: ``random`` (a Service choosing per connection; any balancer that spreads each
            prefix over all workers behaves alike) or ``prefix-hash`` (each prefix one owner).
        assignment: under ``prefix-hash``, the owner of each prefix; default i mod W.

    Raises:
        ValueError: on impossible inputs, or a request too large for one worker's cache.
    """
    _check_policy(policy)
    if workers < 1:
        raise ValueError(f"need at least one worker, got {workers}")
    k = workload.num_prefixes
    if assignment is not None:
        if policy != "prefix-hash":
            raise ValueError("an assignment of prefixes to workers needs policy prefix-hash")
        if len(assignment) != k or any(not 0 <= w < workers for w in assignment):
            raise ValueError(f"the assignment needs one owner in [0, {workers}) per prefix")
    acct = block_accounting(workload, block_size)
    capacity_blocks = usable_blocks(blocks_per_worker)
    largest = int(acct.footprint_blocks.max())
    if largest > capacity_blocks:
        raise ValueError(
            f"a request leaves {largest} blocks but a worker has only {capacity_blocks} usable "
            f"blocks; give it more KV memory"
        )
    p = workload.probabilities
    n_requests = workload.num_requests
    mean_footprint = float(np.dot(p, acct.footprint_blocks))
    capacity = capacity_requests(capacity_blocks, mean_footprint)

    che = che_estimate(workload, acct, capacity_blocks, workers, policy, assignment)
    prompt_mean = float(np.dot(p, acct.prompt_tokens))
    che_hit = float(np.dot(p, che.prefix_hit))
    che_token = float(np.dot(p, che.prefix_hit * acct.hit_blocks)) * block_size / prompt_mean
    hits = che.window_hits
    request_hit = float(hits.sum()) / n_requests
    token_hit = float(np.dot(hits, acct.hit_blocks)) * block_size / (n_requests * prompt_mean)
    first_contacts = float(che.first_contacts.sum())

    # First contacts are the only misses when every worker holds all the prefixes it is sent
    # plus one request's own blocks, and Che expects under one other miss in the window.
    if policy == "random":
        loads = [float(acct.prefix_blocks.sum())]
    else:
        owners = np.asarray(
            assignment if assignment is not None else prefix_hash_assignment(k, workers)
        )
        loads = [float(acct.prefix_blocks[owners == w].sum()) for w in range(workers)]
    fits = max(loads) + float(acct.unique_blocks.max()) <= capacity_blocks
    capacity_misses = n_requests - float(hits.sum()) - first_contacts
    fc_misses = fc_hit = None
    if fits and capacity_misses < 1.0:
        fc_misses = first_contact_misses(workers, k, policy, workload.warmup)
        fc_hit = first_contact_hit(workers, k, n_requests, policy, workload.warmup)

    notes = [NOTE_FORMULA]
    if not workload.is_uniform:
        notes.append(NOTE_SKEW)
    if workload.has_mixed_lengths:
        notes.append(NOTE_MIXED)
    notes.append(NOTE_BOUND)
    notes.append(NOTE_FIRST_CONTACT if fc_hit is not None else NOTE_NO_FIRST_CONTACT)
    if fc_misses is not None and abs(first_contacts - fc_misses) >= 0.5:
        notes.append(
            f"W={workers}, K={k}: not every (worker, prefix) pair is sure to meet in "
            f"{n_requests} requests: "
            f"{first_contacts:.1f} first contacts are expected, not {fc_misses}."
        )
    notes.append(NOTE_CHE)
    notes.append(NOTE_WINDOW)

    return Prediction(
        policy=policy,
        workers=workers,
        prefixes=k,
        requests=n_requests,
        usable_blocks=capacity_blocks,
        block_size=block_size,
        blocks_per_request=mean_footprint,
        capacity_requests=capacity,
        formula_hit=formula_hit(capacity, k),
        bound_hit=routing_bound_hit(capacity, k, workers),
        first_contact_hit=fc_hit,
        first_contact_misses=fc_misses,
        che_hit=che_hit,
        che_token_hit=che_token,
        request_hit_rate=request_hit,
        token_hit_rate=token_hit,
        expected_first_contacts=first_contacts,
        characteristic_times=che.characteristic_times,
        prefix_hit=tuple(float(h) for h in che.prefix_hit),
        notes=tuple(notes),
    )
