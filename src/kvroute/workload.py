"""Workloads: the reference experiment's request generator and its extensions.

The reference workload (docs/experiment.md): K shared prefixes of 2,032 tokens (127 full blocks of
16), each request one prefix plus a unique 339-token suffix (mean prompt 2,371 tokens), 64
output tokens, max(200, 20·K) measured requests with every prefix equally often, the order
shuffled by a fixed seed, and one warmup request per prefix before measuring.

Extensions: Zipf(α) prefix popularity, and mixed prefix/suffix lengths drawn from a
``LengthDist``. Everything is built as token ids from a seed, so lengths are exact and the
same seed gives the same requests, in the same order, on every run and every topology.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import repeat

import numpy as np

from kvroute.errors import UserError

#: Token ids used when no tokenizer vocabulary is given: clear of the small ids tokenizers
#: reserve for special tokens.
DEFAULT_VOCAB = np.arange(1000, 30000, dtype=np.uint32)


@dataclass(frozen=True)
class LengthDist:
    """A token length: fixed, uniform over ``[low, high]``, or a choice among listed values.

    Parsed from ``"2032"``, ``"1000:4000"`` (uniform, inclusive) or ``"512,2032,4096"``.
    """

    low: int
    high: int
    choices: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str | int) -> LengthDist:
        if isinstance(text, int):
            return cls.fixed(text)
        s = str(text).strip()
        try:
            if ":" in s:
                lo, hi = (int(x) for x in s.split(":"))
                dist = cls(lo, hi)
            elif "," in s:
                values = tuple(int(x) for x in s.split(","))
                dist = cls(min(values), max(values), values)
            else:
                dist = cls.fixed(int(s))
        except ValueError:
            raise UserError(
                f"bad length {text!r}: use N, LOW:HIGH (uniform) or A,B,C (choices)"
            ) from None
        if dist.low < 0 or dist.high < dist.low:
            raise UserError(f"bad length {text!r}: lengths must be >= 0 and LOW <= HIGH")
        return dist

    @classmethod
    def fixed(cls, n: int) -> LengthDist:
        return cls(n, n)

    @property
    def is_fixed(self) -> bool:
        return self.low == self.high

    @property
    def mean(self) -> float:
        return float(np.mean(self.choices)) if self.choices else (self.low + self.high) / 2

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.choices:
            return rng.choice(np.asarray(self.choices), size=n)
        if self.is_fixed:
            return np.full(n, self.low, dtype=np.int64)
        return rng.integers(self.low, self.high + 1, size=n)

    def __str__(self) -> str:
        if self.choices:
            return ",".join(map(str, self.choices))
        return str(self.low) if self.is_fixed else f"{self.low}:{self.high}"


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate.

    Args:
        prefixes: K, the number of distinct shared prefixes.
        prefix_tokens: length of each prefix (drawn once per prefix).
        suffix_tokens: length of each request's unique suffix (drawn per request).
        output_tokens: tokens each request generates.
        requests: measured requests; default max(200, 20·K).
        zipf_alpha: 0 for the reference's uniform mix (each prefix equally often), else prefix
            ranked i (1-based) is drawn with probability ∝ i^-α.
        seed: fixes tokens, popularity draws and order.
        adapters: tenants served by LoRA adapters (0: none). Each prefix (a tenant's system
            prompt) belongs to one adapter, drawn once per prefix with adapter ranked j
            (1-based) weighted j^-``adapter_zipf``; its requests name that adapter as
            ``model`` (:func:`adapter_name`).
        adapter_zipf: the adapters' popularity skew (0: each equally likely per prefix).
        salted: each tenant's requests also carry its ``cache_salt`` (:func:`tenant_salt`;
            with no adapters, a prefix is its own tenant).
    """

    prefixes: int
    prefix_tokens: LengthDist = LengthDist.fixed(2032)
    suffix_tokens: LengthDist = LengthDist.fixed(339)
    output_tokens: int = 64
    requests: int | None = None
    zipf_alpha: float = 0.0
    seed: int = 0
    adapters: int = 0
    adapter_zipf: float = 0.0
    salted: bool = False

    def __post_init__(self) -> None:
        if self.prefixes < 1:
            raise UserError(f"need at least one prefix, got {self.prefixes}")
        if self.output_tokens < 1:
            raise UserError(f"output tokens must be >= 1, got {self.output_tokens}")
        if self.requests is not None and self.requests < 1:
            raise UserError(f"requests must be >= 1, got {self.requests}")
        if self.zipf_alpha < 0:
            raise UserError(f"Zipf alpha must be >= 0, got {self.zipf_alpha}")
        if self.adapters < 0 or self.adapter_zipf < 0:
            raise UserError("--adapters and --adapter-zipf must be >= 0")

    def adapter_of_prefix(self) -> list[int | None]:
        """The adapter (index) each prefix's requests run under; None for all when there
        are no adapters. Drawn from a stream of its own, so the tokens and the order are the
        workload's without adapters."""
        if self.adapters == 0:
            return [None] * self.prefixes
        w = np.arange(1, self.adapters + 1, dtype=float) ** -self.adapter_zipf
        rng = np.random.default_rng([self.seed, 0x10A])
        return rng.choice(self.adapters, size=self.prefixes, p=w / w.sum()).tolist()

    def tenant_of(self, prefix_id: int, adapters: list[int | None]) -> tuple[str | None, str | None]:
        """``(model, cache_salt)`` of a request of ``prefix_id`` (None: the default)."""
        adapter = adapters[prefix_id]
        model = None if adapter is None else adapter_name(adapter)
        salt = None
        if self.salted:
            salt = tenant_salt(prefix_id if adapter is None else adapter)
        return model, salt

    @property
    def num_requests(self) -> int:
        return self.requests if self.requests is not None else max(200, 20 * self.prefixes)

    def popularity(self) -> np.ndarray:
        """Probability of each prefix (index = prefix id = popularity rank - 1)."""
        if self.zipf_alpha == 0:
            return np.full(self.prefixes, 1.0 / self.prefixes)
        w = np.arange(1, self.prefixes + 1, dtype=float) ** -self.zipf_alpha
        return w / w.sum()


@dataclass(slots=True)
class RequestSpec:
    """One request to send: a shared prefix (by reference, not copied) and its own suffix."""

    index: int
    prefix_id: int
    prefix: np.ndarray
    suffix: np.ndarray
    output_tokens: int
    warmup: bool = False
    session_id: str | None = None

    @property
    def prefix_len(self) -> int:
        return len(self.prefix)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prefix) + len(self.suffix)

    @property
    def prompt_token_ids(self) -> np.ndarray:
        """The exact prompt, built on demand so a million requests do not each hold a copy
        of their prefix. (A tuple, not a list: numpy takes a list of arrays through its
        generic sequence conversion, four times slower here.)"""
        return np.concatenate((self.prefix, self.suffix))


@dataclass
class Workload:
    """Generated requests: ``warmup`` (one per prefix, not measured) then ``requests``."""

    spec: WorkloadSpec
    prefixes: list[np.ndarray]
    warmup: list[RequestSpec]
    requests: list[RequestSpec]
    vocab: np.ndarray = field(repr=False, default_factory=lambda: DEFAULT_VOCAB)

    @property
    def mean_prompt_tokens(self) -> float:
        return float(np.mean([r.prompt_tokens for r in self.requests]))


def adapter_name(index: int) -> str:
    """The LoRA module name of adapter ``index`` (what workers list and requests send)."""
    return f"adapter-{index}"


def emulated_lora_args(adapters: int, max_loras: int) -> list[str]:
    """``kvroute emulate`` flags that serve adapters ``0 .. adapters-1`` (by
    :func:`adapter_name`, as vLLM's ``--enable-lora --lora-modules NAME=PATH``; the emulator
    reads no path) in ``max_loras`` LoRA slots; none without adapters."""
    if adapters < 1:
        return []
    modules = [f"{adapter_name(i)}=/adapters/{adapter_name(i)}" for i in range(adapters)]
    return ["--enable-lora", "--max-loras", str(max_loras), "--lora-modules", *modules]


def tenant_salt(index: int) -> str:
    """Tenant ``index``'s ``cache_salt``."""
    return f"tenant-{index}"


def _prefix_order(spec: WorkloadSpec, rng: np.random.Generator) -> np.ndarray:
    n, k = spec.num_requests, spec.prefixes
    if spec.zipf_alpha == 0:
        # Each prefix equally often (the first n mod k prefixes once more when k ∤ n).
        order = np.arange(n) % k
    else:
        order = rng.choice(k, size=n, p=spec.popularity())
    rng.shuffle(order)
    return order


#: Suffix tokens drawn per numpy call (256 KiB of uint32, ~190 reference requests): big enough
#: that the per-call cost vanishes, small enough that the arrays come from the heap rather than
#: fresh pages (chunks of millions of tokens measured slower: page faults).
_SUFFIX_CHUNK_TOKENS = 1 << 16


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside: for loops that build a million acyclic objects
    (requests, records). Each object allocated counts towards the collector's thresholds, so
    such a loop sets off collections that walk every tracked object, the ones just built
    included, again and again: measured, a third of generating 10⁶ requests and two thirds of
    building their records. Reference counting still frees everything as usual."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _token_drawer(rng: np.random.Generator, vocab: np.ndarray) -> Callable[[int], np.ndarray]:
    """``draw(n)``: the next ``n`` tokens of ``rng``'s stream, ``vocab[rng.integers(0,
    len(vocab), n)]``. Drawn as ``uint32`` (numpy draws the same values from the same stream
    for any integer dtype whose range holds them: a bounded draw below 2³² always takes its
    32-bit path), and for a vocabulary of consecutive ids (the default) offset in place
    instead of gathered: half the time of the ``int64`` draw and the gather."""
    n = len(vocab)
    if n <= 1 << 32:
        first = int(vocab[0])
        if n > 1 and np.array_equal(vocab, np.arange(first, first + n, dtype=vocab.dtype)):
            offset = np.uint32(first)

            def draw(count: int) -> np.ndarray:
                tokens = rng.integers(0, n, size=count, dtype=np.uint32)
                tokens += offset
                return tokens

            return draw
        return lambda count: vocab[rng.integers(0, n, size=count, dtype=np.uint32)]
    return lambda count: vocab[rng.integers(0, n, size=count)]


def generate(spec: WorkloadSpec, vocab: np.ndarray | None = None) -> Workload:
    """Build the workload for ``spec``; deterministic in ``spec.seed``.

    Args:
        vocab: token ids to draw from (a tokenizer's safe vocabulary when prompts will be sent
            as text and must re-tokenize exactly); default ``DEFAULT_VOCAB``.
    """
    vocab = DEFAULT_VOCAB if vocab is None else np.asarray(vocab, dtype=np.uint32)
    if len(vocab) < 2:
        raise UserError("the token vocabulary needs at least 2 ids")
    rng = np.random.default_rng(spec.seed)
    prefix_lens = spec.prefix_tokens.sample(rng, spec.prefixes)
    prefixes = [vocab[rng.integers(0, len(vocab), size=int(n))] for n in prefix_lens]
    order = _prefix_order(spec, rng)
    total = spec.prefixes + len(order)
    suffix_lens = spec.suffix_tokens.sample(rng, total)
    prefix_ids = [*range(spec.prefixes), *order.tolist()]
    empty = (suffix_lens == 0) & (np.asarray([len(p) for p in prefixes])[prefix_ids] == 0)
    if empty.any():
        raise UserError("a prompt needs at least one token (prefix + suffix lengths are 0)")
    ends_arr = np.cumsum(suffix_lens)
    starts_arr = ends_arr - suffix_lens
    ends, starts = ends_arr.tolist(), starts_arr.tolist()
    # Every suffix is drawn from the same stream in request order. Drawing them a chunk of
    # requests at a time gives the very same tokens as one call per request (a bounded
    # draw's values do not depend on how the calls are split), and each suffix becomes a
    # view of its chunk: per request, a slice instead of two array operations. A chunk ends
    # before the first request that would take it past _SUFFIX_CHUNK_TOKENS (each chunk
    # holds at least one request).
    bounds = [0]
    while bounds[-1] < total:
        i = bounds[-1]
        j = int(np.searchsorted(ends_arr, starts[i] + _SUFFIX_CHUNK_TOKENS, side="right"))
        bounds.append(max(j, i + 1))
    indices = [*range(spec.prefixes), *range(len(order))]
    flags = [True] * spec.prefixes + [False] * len(order)
    outputs = repeat(spec.output_tokens)
    draw = _token_drawer(rng, vocab)
    out: list[RequestSpec] = []
    with gc_paused():
        for i, j in zip(bounds, bounds[1:]):
            base = starts[i]
            tokens = draw(ends[j - 1] - base)
            out.extend(map(
                RequestSpec, indices[i:j], prefix_ids[i:j], [prefixes[p] for p in prefix_ids[i:j]],
                [tokens[a - base : b - base] for a, b in zip(starts[i:j], ends[i:j])], outputs, flags[i:j],
            ))
    return Workload(spec, prefixes, out[: spec.prefixes], out[spec.prefixes :], vocab)


_INT_LIST = re.compile(r"^\s*-?\d+(\s*,\s*-?\d+)*\s*$")


def parse_int_list(text: str, what: str) -> list[int]:
    """``"2,7,12"`` → ``[2, 7, 12]``; a UserError naming ``what`` otherwise."""
    if not _INT_LIST.match(str(text)):
        raise UserError(f"bad {what} {text!r}: expected a number or a comma list like 2,7,12")
    values = [int(x) for x in str(text).split(",")]
    if any(v < 1 for v in values):
        raise UserError(f"bad {what} {text!r}: values must be >= 1")
    return values
