"""Trace files: Mooncake's JSONL format and kvroute's own, windows, token synthesis, replay.

Two formats, detected from the first request line of a file (every line must then match):

* **Mooncake** (FAST'25, ``kvcache-ai/Mooncake/FAST25-release/traces``): ``timestamp`` (ms
  from the start), ``input_length``, ``output_length``, ``hash_ids`` (remapped hashes of the
  prompt's 512-token blocks, the last one possibly partial; equal ids mean equal content *and*
  an equal prefix before it, so two requests sharing their first 12 ids share 6,144 tokens).
* **kvroute** (what ``kvroute bench --trace`` has always read): ``timestamp`` (seconds; only
  differences matter), the prompt as ``prompt`` (text or token ids), ``prompt_token_ids`` or
  ``token_ids``, ``output_tokens`` or ``max_tokens``, optionally ``session_id`` and
  ``prefix_id``. Token-id prompts get hash ids too (chained hashes of their 512-token blocks),
  so the reuse analysis reads both formats; text prompts can only be replayed.

**Sessions.** A window or a sample keeps sessions whole. A kvroute line's session is its
``session_id``. A Mooncake trace carries none, so kvroute derives one from the data: the
*common head* is the longest run of hash ids that every request of the file starts with (one
block, id 0, in the conversation trace: every request there starts with the same system
prompt; none in the synthetic trace), and a request's session is its first hash id after that
head — with Mooncake's prefix-consistent ids, that one id names the whole prefix up to it.
Requests sharing it continue the same conversation or document. Synthetic trace: 2,211
sessions of 3,993 requests; conversation trace: 7,373 sessions of 12,031.

**Tokens.** ``block_tokens(hash_id)`` is a pure function: 512 token ids drawn from the
vocabulary by a SplitMix64 hash of ``(seed, hash_id, position)``. A prompt is the
concatenation of its ids' blocks, cut to ``input_length``. Equal ids therefore give equal
tokens, and — blocks being aligned at multiples of 512 — equal engine blocks at any engine
block size dividing 512 (16 on GPU, 128 on CPU). Nothing is stored per request: a trace is its
hash-id chains, and tokens are made when a request is sent.

**Replay.** ``Trace.replay(time_scale)`` yields ``ReplayRequest`` objects in arrival order:
``at_s`` (seconds from the first request, divided by ``time_scale``: kvroute's convention,
as ``kvroute emulate --time-scale``, is "that many times faster than real time"), ``prompt()``
(the token ids, made on demand), ``prompt_tokens``, ``output_tokens``, ``hash_ids`` and
``session``. That is what an open-loop simulator or client consumes; ``Trace.arrays()`` gives
the same as flat numpy arrays (hash-id chains with offsets) for a simulator in Rust.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import xxhash

from kvroute import _native
from kvroute.errors import UNDECODABLE, UserError
from kvroute.workload import DEFAULT_VOCAB

#: Tokens per hash id in Mooncake's traces.
BLOCK_TOKENS = 512

FORMATS = ("mooncake", "kvroute")


def block_tokens(hash_id: int, vocab: np.ndarray | None = None, seed: int = 0) -> np.ndarray:
    """The 512 token ids of hash id ``hash_id``: ``vocab[splitmix64(key + position) % len(vocab)]``
    with ``key = splitmix64(seed · 2^32 + hash_id) · 512`` (uint64 wrapping). Pure: the same id,
    vocabulary and seed always give the same tokens (uint32)."""
    return blocks_tokens([hash_id], vocab, seed)[0]


def blocks_tokens(hash_ids: Sequence[int], vocab: np.ndarray | None = None, seed: int = 0) -> np.ndarray:
    """``block_tokens`` of many ids in one native pass (``kvroute_core::trace``, the formula
    above): shape (len(hash_ids), 512), uint32."""
    vocab = DEFAULT_VOCAB if vocab is None else vocab
    raw = _native.trace_blocks_tokens([int(h) for h in hash_ids], np.asarray(vocab, dtype=np.uint32),
                                      seed & 0xFFFFFFFF)
    return np.frombuffer(raw, dtype=np.uint32).reshape(len(hash_ids), BLOCK_TOKENS)


@dataclass(slots=True)
class TraceRequest:
    """One line of a trace.

    Attributes:
        line: its line number in the file (1-based), for messages.
        arrival_s: arrival time in seconds from the trace's first request.
        input_length: prompt tokens (0 for a text prompt: the server counts it).
        output_length: tokens to generate.
        hash_ids: the prompt's 512-token block ids (None for a text prompt).
        session: the session key (see the module docs), None when unknown.
        prompt_ids: a kvroute line's own token ids (None for Mooncake: synthesized).
        prompt_text: a kvroute line's text prompt.
        prefix_id: a kvroute line's ``prefix_id``.
    """

    line: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] | None
    session: str | None = None
    prompt_ids: np.ndarray | None = field(default=None, repr=False)
    prompt_text: str | None = field(default=None, repr=False)
    prefix_id: int | None = None

    def block_sizes(self) -> list[int]:
        """Tokens of the prompt in each hash block: 512 but the last, cut to input_length."""
        if not self.hash_ids:
            return []
        sizes = [BLOCK_TOKENS] * len(self.hash_ids)
        sizes[-1] = self.input_length - BLOCK_TOKENS * (len(self.hash_ids) - 1)
        return sizes


@dataclass(slots=True)
class ReplayRequest:
    """One request of an open-loop replay (what ``Trace.replay`` yields).

    Attributes:
        index: position in the replay.
        at_s: send time in seconds from the replay's start.
        prompt_tokens: prompt length (0 for a text prompt).
        output_tokens: tokens to generate (``max_tokens`` with ``ignore_eos``).
        hash_ids: the 512-token block ids, for analysis and routing keys.
        session: session key.
        source: the trace line it replays.
    """

    index: int
    at_s: float
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] | None
    session: str | None
    source: TraceRequest = field(repr=False)
    _trace: Trace = field(repr=False, default=None)  # type: ignore[assignment]

    def prompt(self) -> np.ndarray:
        """The prompt's token ids (uint32), made now; raises for a text prompt."""
        return self._trace.prompt_tokens(self.source)


@dataclass
class Trace:
    """A parsed trace: requests in arrival order and how to make their tokens.

    Attributes:
        path: where it was read from (for messages).
        format: ``mooncake`` or ``kvroute``.
        requests: in arrival order (equal times keep file order).
        common_head: hash ids every request of the *file* starts with (see the module docs).
        vocab: token ids prompts are drawn from (``kvroute.workload.DEFAULT_VOCAB`` unless a
            tokenizer's safe vocabulary is given).
        seed: token synthesis seed.
    """

    path: str
    format: str
    requests: list[TraceRequest]
    common_head: int = 0
    vocab: np.ndarray = field(default_factory=lambda: DEFAULT_VOCAB, repr=False)
    seed: int = 0
    #: hash id -> its 512 synthesized tokens: requests share most of their blocks (that is what
    #: a trace measures), so each block is drawn once. 2 KiB per distinct id.
    _blocks: dict[int, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    def sessions(self) -> dict[str | None, list[int]]:
        """Request indices per session key, in first-arrival order of the sessions; requests
        without a session each form their own (keyed ``None`` is never returned for them)."""
        out: dict[str | None, list[int]] = {}
        for i, r in enumerate(self.requests):
            key = r.session if r.session is not None else f"\0line{r.line}"
            out.setdefault(key, []).append(i)
        return out

    def select(
        self, start_s: float = 0.0, duration_s: float | None = None, max_requests: int | None = None,
        cut_sessions: bool = False,
    ) -> Trace:
        """A window or sample that keeps sessions whole, its clock restarted at its first request.

        A session is in when its *first* request arrives in ``[start_s, start_s + duration_s)``
        (seconds from the trace's first request; no end when ``duration_s`` is None); all its
        requests come with it, later ones included. ``max_requests`` then keeps whole sessions
        in order of first arrival, skipping any that would not fit, up to that many requests.
        With ``cut_sessions``, a plain time window instead: the requests arriving in it, the
        first ``max_requests`` of them.
        """
        if start_s < 0 or not math.isfinite(start_s):
            raise UserError(f"--start must be a finite number of seconds >= 0, got {start_s}")
        if duration_s is not None and (duration_s <= 0 or not math.isfinite(duration_s)):
            raise UserError(f"--duration must be > 0 seconds, got {duration_s}")
        if max_requests is not None and max_requests < 1:
            raise UserError(f"--max-requests must be >= 1, got {max_requests}")
        end = math.inf if duration_s is None else start_s + duration_s
        keep: list[int] = []
        if cut_sessions:
            keep = [i for i, r in enumerate(self.requests) if start_s <= r.arrival_s < end][:max_requests]
        for members in [] if cut_sessions else self.sessions().values():
            first = self.requests[members[0]].arrival_s
            if not start_s <= first < end:
                continue
            if max_requests is not None and len(keep) + len(members) > max_requests:
                continue
            keep.extend(members)
        if not keep:
            raise UserError(
                f"{self.path}: no session starts in the window [{start_s:g} s, {end:g} s) "
                f"(the trace spans {self.duration_s:.1f} s)"
                + (f" with at most {max_requests} requests" if max_requests is not None else "")
            )
        keep.sort()
        chosen = [self.requests[i] for i in keep]
        t0 = chosen[0].arrival_s
        rebased = [
            TraceRequest(r.line, r.arrival_s - t0, r.input_length, r.output_length, r.hash_ids,
                         r.session, r.prompt_ids, r.prompt_text, r.prefix_id)
            for r in chosen
        ]
        return Trace(self.path, self.format, rebased, self.common_head, self.vocab, self.seed)

    def prompt_tokens(self, request: TraceRequest) -> np.ndarray:
        """The prompt's token ids: a kvroute line's own, else its hash ids' synthesized blocks
        cut to ``input_length``."""
        if request.prompt_ids is not None:
            return request.prompt_ids
        if request.hash_ids is None:
            raise UserError(f"{self.path}:{request.line}: a text prompt has no token ids")
        if not request.hash_ids:
            return np.zeros(0, dtype=np.uint32)
        cache = self._blocks
        missing = [h for h in dict.fromkeys(request.hash_ids) if h not in cache]
        if missing:
            cache.update(zip(missing, blocks_tokens(missing, self.vocab, self.seed)))
        return np.concatenate([cache[h] for h in request.hash_ids])[: request.input_length]

    def replay(self, time_scale: float = 1.0) -> Iterator[ReplayRequest]:
        """Open-loop replay in arrival order, ``time_scale`` times faster than recorded:
        ``at_s = arrival_s / time_scale`` (10 plays an hour in 6 minutes, for workers started
        with ``--time-scale 10``)."""
        if not time_scale > 0 or not math.isfinite(time_scale):
            raise UserError(f"--time-scale must be a finite number > 0, got {time_scale}")
        for i, r in enumerate(self.requests):
            yield ReplayRequest(i, r.arrival_s / time_scale, r.input_length, r.output_length,
                                r.hash_ids, r.session, r, self)

    def arrays(self) -> dict[str, np.ndarray]:
        """The trace as flat arrays, for a simulator in another language (no per-request
        objects, no tokens): ``arrival_s`` (float64), ``input_length``, ``output_length``,
        ``hash_offsets`` (int64, requests + 1: request i's ids are
        ``hash_ids[hash_offsets[i]:hash_offsets[i + 1]]``), ``hash_ids`` (int64, flat) and
        ``session`` (int64: sessions numbered in order of first arrival). Tokens of id h are
        ``block_tokens(h, vocab, seed)``; a text prompt has no ids (an empty range)."""
        offsets = [0]
        flat: list[int] = []
        numbering: dict[str, int] = {}
        sessions = []
        for r in self.requests:
            flat.extend(r.hash_ids or ())
            offsets.append(len(flat))
            key = r.session if r.session is not None else f"\0line{r.line}"
            sessions.append(numbering.setdefault(key, len(numbering)))
        return {
            "arrival_s": np.asarray([r.arrival_s for r in self.requests], dtype=np.float64),
            "input_length": np.asarray([r.input_length for r in self.requests], dtype=np.int64),
            "output_length": np.asarray([r.output_length for r in self.requests], dtype=np.int64),
            "hash_offsets": np.asarray(offsets, dtype=np.int64),
            "hash_ids": np.asarray(flat, dtype=np.int64),
            "session": np.asarray(sessions, dtype=np.int64),
        }

    def summary(self) -> dict:
        """Counts and means for reports."""
        n = len(self.requests)
        return {
            "path": self.path,
            "format": self.format,
            "requests": n,
            "sessions": len(self.sessions()),
            "duration_s": round(self.duration_s, 3),
            "common_head_blocks": self.common_head,
            "mean_input_tokens": sum(r.input_length for r in self.requests) / n if n else 0.0,
            "max_input_tokens": max((r.input_length for r in self.requests), default=0),
            "mean_output_tokens": sum(r.output_length for r in self.requests) / n if n else 0.0,
        }


class _MooncakeLine(msgspec.Struct, forbid_unknown_fields=False):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


class _KvrouteLine(msgspec.Struct, forbid_unknown_fields=False):
    timestamp: float
    output_tokens: int | None = None
    max_tokens: int | None = None
    prompt: str | list[int] | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    session_id: str | int | None = None
    prefix_id: int | None = None


def _detect(raw: bytes, where: str) -> str:
    try:
        obj = msgspec.json.decode(raw)
    except UNDECODABLE as exc:
        raise UserError(f"{where}: bad trace line: {exc}") from None
    if not isinstance(obj, dict):
        raise UserError(f"{where}: bad trace line: expected a JSON object")
    return "mooncake" if "hash_ids" in obj or "input_length" in obj else "kvroute"


def _mooncake(line: _MooncakeLine, where: str) -> tuple[float, int, int, tuple[int, ...]]:
    ids = tuple(line.hash_ids)
    n = line.input_length
    if n < 0 or line.output_length < 0:
        raise UserError(f"{where}: negative input_length or output_length")
    if not math.isfinite(line.timestamp):
        raise UserError(f"{where}: timestamp is not a finite number")
    if not (BLOCK_TOKENS * (len(ids) - 1) < n <= BLOCK_TOKENS * len(ids)) and (ids or n):
        raise UserError(
            f"{where}: {len(ids)} hash ids do not cover input_length {n} "
            f"(each id is {BLOCK_TOKENS} tokens, the last one partial)"
        )
    if len(set(ids)) != len(ids):
        raise UserError(f"{where}: a hash id repeats within the request (ids name prefixes)")
    if ids and (min(ids) < 0 or max(ids) >= 2**64):
        raise UserError(f"{where}: hash ids must be integers from 0 to 2^64 - 1")
    return line.timestamp / 1000.0, n, line.output_length, ids


class _Chainer:
    """Hash ids for token-id prompts: chained xxh3 of each 512-token block, renumbered 0, 1, …"""

    def __init__(self) -> None:
        self.ids: dict[int, int] = {}

    def __call__(self, tokens: np.ndarray) -> tuple[int, ...]:
        out = []
        parent = 0
        data = np.asarray(tokens, dtype=np.uint32)
        for start in range(0, len(data), BLOCK_TOKENS):
            parent = xxhash.xxh3_64_intdigest(data[start : start + BLOCK_TOKENS].tobytes(), parent)
            out.append(self.ids.setdefault(parent, len(self.ids)))
        return tuple(out)


def parse_trace(lines: list[bytes], path: str = "<trace>", default_output_tokens: int = 64) -> Trace:
    """Parse the lines of a trace file (blank lines skipped); see the module docs.

    Raises:
        UserError: ``PATH:LINE: reason`` for the first bad line; a file without requests.
    """
    numbered = [(i, raw) for i, raw in enumerate(lines, 1) if raw.strip()]
    if not numbered:
        raise UserError(f"trace {path} has no requests")
    fmt = _detect(numbered[0][1], f"{path}:{numbered[0][0]}")
    requests: list[TraceRequest] = []
    if fmt == "mooncake":
        decoder = msgspec.json.Decoder(_MooncakeLine)
        for number, raw in numbered:
            where = f"{path}:{number}"
            try:
                line = decoder.decode(raw)
            except UNDECODABLE as exc:
                raise UserError(f"{where}: bad Mooncake trace line: {exc}") from None
            t, n, out, ids = _mooncake(line, where)
            requests.append(TraceRequest(number, t, n, out, ids))
    else:
        decoder = msgspec.json.Decoder(_KvrouteLine)
        chain = _Chainer()
        for number, raw in numbered:
            where = f"{path}:{number}"
            try:
                line = decoder.decode(raw)
            except UNDECODABLE as exc:
                raise UserError(f"{where}: bad trace line: {exc}") from None
            ids = line.prompt_token_ids or line.token_ids or (
                line.prompt if isinstance(line.prompt, list) else None
            )
            text = line.prompt if isinstance(line.prompt, str) else None
            if ids is None and text is None:
                raise UserError(f"{where}: trace line has no prompt, prompt_token_ids or token_ids")
            if not math.isfinite(line.timestamp):
                raise UserError(f"{where}: timestamp is not a finite number")
            output = line.output_tokens or line.max_tokens or default_output_tokens
            tokens = None if ids is None else np.asarray(ids, dtype=np.int64)
            if tokens is not None and len(tokens) and (tokens.min() < 0 or tokens.max() >= 2**32):
                raise UserError(f"{where}: token ids must be in [0, 2^32)")
            session = None if line.session_id is None else str(line.session_id)
            requests.append(
                TraceRequest(
                    number, line.timestamp, 0 if tokens is None else len(tokens), output,
                    None if tokens is None else chain(tokens), session,
                    None if tokens is None else tokens.astype(np.uint32), text, line.prefix_id,
                )
            )
    requests.sort(key=lambda r: r.arrival_s)  # stable: equal times keep file order
    t0 = requests[0].arrival_s
    for r in requests:
        r.arrival_s -= t0
    head = 0
    if fmt == "mooncake":
        head = _common_head([r.hash_ids for r in requests if r.hash_ids is not None])
        for r in requests:
            ids = r.hash_ids or ()
            r.session = str(ids[min(head, len(ids) - 1)]) if ids else f"\0line{r.line}"
    return Trace(path, fmt, requests, head)


def _common_head(chains: list[tuple[int, ...]]) -> int:
    """Length of the prefix every chain starts with, kept one block short of the shortest
    chain of more than one block so that sessions stay distinguishable."""
    if len(chains) < 2:
        return 0
    first = chains[0]
    head = min(len(c) for c in chains)
    for c in chains[1:]:
        n = 0
        while n < head and c[n] == first[n]:
            n += 1
        head = n
        if head == 0:
            break
    return head if head < max(len(c) for c in chains) else max(head - 1, 0)


#: Traces shipped inside the package (``data/``, with their licence), by the name ``--trace`` takes.
SHIPPED_TRACES = {"synthetic": Path(__file__).parent / "data" / "synthetic_trace.jsonl"}
#: Where Mooncake's traces are published (the conversation and tool&agent traces are not shipped).
MOONCAKE_TRACES_URL = "https://github.com/kvcache-ai/Mooncake/tree/main/FAST25-release/traces"


def trace_path(text: str) -> Path:
    """A ``--trace`` value as a path: a shipped trace's name (``synthetic``) or its file name
    when no such file is here (``synthetic_trace.jsonl``, as the Mooncake docs name it) gives
    the shipped file; anything else is a path."""
    if text in SHIPPED_TRACES:
        return SHIPPED_TRACES[text]
    path = Path(text)
    if not path.exists() and path.parent == Path("."):
        for shipped in SHIPPED_TRACES.values():
            if shipped.name == path.name:
                return shipped
    return path


def missing_trace(path: Path | str, reason: str = "no such file") -> UserError:
    """The error for a trace that cannot be read, saying where traces come from."""
    shipped = ", ".join(f"--trace {name}" for name in SHIPPED_TRACES)
    return UserError(
        f"cannot read trace {path}: {reason}. Shipped with kvroute: {shipped} (Mooncake's synthetic "
        f"trace); Mooncake's conversation and tool&agent traces: {MOONCAKE_TRACES_URL}"
    )


def load_trace(path: Path | str, default_output_tokens: int = 64) -> Trace:
    """Read and parse a trace file (``parse_trace``)."""
    try:
        with open(path, "rb") as f:
            lines = f.readlines()
    except OSError as exc:
        raise missing_trace(path, (exc.strerror or str(exc)).lower()) from None
    return parse_trace(lines, str(path), default_output_tokens)
