"""What the bench sends: seeded workloads turned into ready-to-send HTTP requests.

Three sources of requests, all deterministic so that every trial and every topology receives
exactly the same requests in exactly the same order (docs/experiment.md rule 2):

* the reference workload and its extensions (Zipf, mixed lengths) from ``kvroute.workload``;
* multi-turn sessions: each turn repeats the whole previous conversation (system prefix, user
  turns and assistant replies) and adds a new user turn, so turn t reuses turn t-1's blocks.
  The assistant replies written into the history are seeded tokens, not the server's actual
  output: the requests must not depend on what one topology answered;
* trace replay from JSONL (``kvroute.trace``: Mooncake's format or kvroute's): one request per
  line with its send time.

A prompt is a list of ``(role, token ids)`` segments. ``PromptEncoder`` renders it for the wire,
once, before the measured window (so the hot path only sends pre-encoded bytes):

* ``ids`` — ``/v1/completions`` with the token ids as the prompt: exact lengths, no tokenizer;
* ``text`` — ``/v1/completions`` with ``decode(ids)``; the ids come from
  ``tokens.safe_vocabulary`` so re-tokenization gives back exactly the same ids (no merge
  across the prefix/suffix boundary);
* ``chat`` — ``/v1/chat/completions``, one message per segment, rendered by the server with its
  chat template; lengths are counted with the same template locally.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np

from kvroute.errors import UserError
from kvroute.tokens import Tokenizer
from kvroute.trace import Trace, load_trace
from kvroute.workload import LengthDist, Workload, WorkloadSpec, generate

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
PROMPT_FORMATS = ("ids", "text", "chat")

#: A prompt as the conversation it represents: (role, token ids) per segment.
Segments = list[tuple[str, np.ndarray]]
#: A request's ``(model, cache_salt)``: None keeps the served model, and sends no salt.
Tenant = tuple[str | None, str | None]


@dataclass(slots=True)
class BenchRequest:
    """One request, ready to send.

    Attributes:
        index: position in its list (warmup and measured lists are numbered separately).
        prefix_id: the shared prefix it starts with (None for a trace line without one).
        session_id: the conversation it belongs to, if any.
        prompt_tokens: prompt length as the server will count it; 0 when unknown (a text
            prompt from a trace without a tokenizer); the usage reported back replaces it.
        output_tokens: tokens requested (``max_tokens`` with ``ignore_eos``).
        path: ``/v1/completions`` or ``/v1/chat/completions``.
        body: the JSON body, encoded once.
        warmup: not measured.
        after: index of the request that must complete before this one is sent (the previous
            turn of its session); a later turn is sent only once the earlier one is answered.
        at_s: send time relative to the window's start (trace replay and open loop).
    """

    index: int
    prefix_id: int | None
    session_id: str | None
    prompt_tokens: int
    output_tokens: int
    path: str
    body: bytes
    warmup: bool = False
    after: int | None = None
    at_s: float | None = None


@dataclass
class BenchWorkload:
    """The requests of one sweep point's K.

    Attributes:
        prefixes: K, for labelling the point.
        warmup: one request per prefix, sent one at a time before measuring.
        requests: the measured requests, in their seeded order.
        spec: the generator spec when the workload is the reference one (so the simulator can
            predict the same configuration); None for sessions and traces.
        prefix_tokens, suffix_tokens, output_tokens: mean lengths, for the capacity formula.
        trace: the replayed window when the workload is a trace (``kvroute.trace.Trace``).
    """

    prefixes: int
    warmup: list[BenchRequest]
    requests: list[BenchRequest]
    spec: WorkloadSpec | None = None
    prefix_tokens: float = 0.0
    suffix_tokens: float = 0.0
    output_tokens: float = 0.0
    source: Workload | None = field(default=None, repr=False)
    trace: Trace | None = field(default=None, repr=False)


class PromptEncoder:
    """Renders prompts as request bodies in one of ``PROMPT_FORMATS``.

    Args:
        prompt_format: ``ids``, ``text`` or ``chat``.
        model: the served model name to put in each body.
        tokenizer: needed for ``text`` and ``chat`` (to decode ids and count templated tokens).
        ignore_eos: ask the server to generate exactly ``max_tokens`` (a vLLM extension; a
            random-weight model would otherwise stop early and shift the measured load).
    """

    def __init__(
        self, prompt_format: str, model: str, tokenizer: Tokenizer | None = None, ignore_eos: bool = True
    ) -> None:
        if prompt_format not in PROMPT_FORMATS:
            raise UserError(f"bad prompt format {prompt_format!r}: choose from {', '.join(PROMPT_FORMATS)}")
        if prompt_format != "ids" and tokenizer is None:
            raise UserError(f"prompt format {prompt_format!r} needs a tokenizer")
        self.prompt_format = prompt_format
        self.model = model
        self.tokenizer = tokenizer
        self.ignore_eos = ignore_eos
        self._encode = msgspec.json.Encoder()

    @property
    def path(self) -> str:
        return CHAT_PATH if self.prompt_format == "chat" else COMPLETIONS_PATH

    def _body(
        self, prompt_field: str, prompt: object, output_tokens: int, tenant: Tenant = (None, None)
    ) -> bytes:
        model, salt = tenant
        body = {
            "model": model or self.model,
            prompt_field: prompt,
            "max_tokens": output_tokens,
            "temperature": 0.0,
            "stream": True,
            # The final chunk then carries usage, including prompt_tokens_details.cached_tokens.
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if salt is not None:
            body["cache_salt"] = salt
        return self._encode.encode(body)

    def encode(
        self, segments: Segments, output_tokens: int, tenant: Tenant = (None, None)
    ) -> tuple[bytes, int]:
        """``(body, prompt tokens)`` of a prompt made of ``segments``, for ``tenant``
        (``(model, cache_salt)``: None keeps the served model, and sends no salt)."""
        if self.prompt_format == "ids":
            ids = np.concatenate([s for _, s in segments]) if segments else np.zeros(0, np.int64)
            return self._body("prompt", ids.tolist(), output_tokens, tenant), len(ids)
        tok = self.tokenizer
        assert tok is not None
        if self.prompt_format == "text":
            ids = np.concatenate([s for _, s in segments])
            text = tok.decode(ids.tolist())
            return self._body("prompt", text, output_tokens, tenant), len(tok.encode(text, add_special_tokens=True))
        messages = [{"role": role, "content": tok.decode(ids.tolist())} for role, ids in segments]
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True)
        return (
            self._body("messages", messages, output_tokens, tenant),
            len(tok.encode(rendered, add_special_tokens=False)),
        )

    def encode_text(self, text: str, output_tokens: int) -> tuple[bytes, int]:
        """A prompt given as text (trace replay); its length is counted when a tokenizer is
        known, else left 0 for the server's usage to fill in."""
        tok = self.tokenizer
        if self.prompt_format == "chat":
            messages = [{"role": "user", "content": text}]
            n = len(tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)) if tok else 0
            return self._body("messages", messages, output_tokens), n
        n = len(tok.encode(text, add_special_tokens=True)) if tok else 0
        return self._body("prompt", text, output_tokens), n


def _segments(prefix: np.ndarray, suffix: np.ndarray) -> Segments:
    # The shared prefix plays the system prompt, the unique suffix the user's message.
    return [("system", prefix), ("user", suffix)]


def _request(
    encoder: PromptEncoder, index: int, prefix_id: int | None, session: str | None,
    segments: Segments, output_tokens: int, warmup: bool = False, after: int | None = None,
    tenant: Tenant = (None, None),
) -> BenchRequest:
    body, n = encoder.encode(segments, output_tokens, tenant)
    return BenchRequest(index, prefix_id, session, n, output_tokens, encoder.path, body, warmup, after)


def reference_workload(spec: WorkloadSpec, encoder: PromptEncoder, vocab: np.ndarray | None = None) -> BenchWorkload:
    """The reference workload (or its Zipf / mixed-length variants) for one K."""
    wl = generate(spec, vocab)
    adapters = spec.adapter_of_prefix()

    def convert(r, warmup: bool) -> BenchRequest:
        segments = _segments(r.prompt_token_ids[: r.prefix_len], r.prompt_token_ids[r.prefix_len :])
        tenant = spec.tenant_of(r.prefix_id, adapters)
        return _request(encoder, r.index, r.prefix_id, r.session_id, segments, r.output_tokens, warmup,
                        tenant=tenant)

    return BenchWorkload(
        prefixes=spec.prefixes,
        warmup=[convert(r, True) for r in wl.warmup],
        requests=[convert(r, False) for r in wl.requests],
        spec=spec,
        prefix_tokens=float(np.mean([len(p) for p in wl.prefixes])),
        suffix_tokens=float(np.mean([r.prompt_tokens - r.prefix_len for r in wl.requests])),
        output_tokens=float(spec.output_tokens),
        source=wl,
    )


@dataclass(frozen=True)
class SessionSpec:
    """Multi-turn conversations.

    Args:
        sessions: number of conversations; each starts with one of the K prefixes (drawn by
            the workload's popularity) and the workload's suffix as its first user message.
        turns: requests per conversation.
        turn_tokens: length of each later user message.
    """

    sessions: int
    turns: int
    turn_tokens: LengthDist = field(default_factory=lambda: LengthDist.fixed(64))

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.turns < 1:
            raise UserError("--sessions and --turns must be >= 1")


def session_workload(
    spec: WorkloadSpec, sessions: SessionSpec, encoder: PromptEncoder, vocab: np.ndarray | None = None
) -> BenchWorkload:
    """Multi-turn sessions over the K prefixes of ``spec``.

    The measured order interleaves conversations (a seeded shuffle of each session's id
    repeated ``turns`` times, the i-th occurrence being turn i), so turns of one conversation
    arrive between other traffic, as with real users; ``after`` keeps each conversation's
    turns in order.
    """
    wl = generate(spec, vocab)
    rng = np.random.default_rng([spec.seed, 0x5E55])
    vocab = wl.vocab
    starts = rng.choice(spec.prefixes, size=sessions.sessions, p=spec.popularity())
    order = np.repeat(np.arange(sessions.sessions), sessions.turns)
    rng.shuffle(order)
    history: list[Segments | None] = [None] * sessions.sessions
    last_index: list[int | None] = [None] * sessions.sessions
    requests: list[BenchRequest] = []
    suffix_lens = spec.suffix_tokens.sample(rng, sessions.sessions)

    def draw(n: int) -> np.ndarray:
        return vocab[rng.integers(0, len(vocab), size=int(n))]

    for s in order:
        s = int(s)
        prefix_id = int(starts[s])
        if history[s] is None:
            segments = _segments(wl.prefixes[prefix_id], draw(suffix_lens[s]))
        else:
            # The previous turn's reply (seeded, see the module docstring), then a new message.
            reply = draw(spec.output_tokens)
            user = draw(sessions.turn_tokens.sample(rng, 1)[0])
            segments = history[s] + [("assistant", reply), ("user", user)]
        history[s] = segments
        index = len(requests)
        requests.append(
            _request(encoder, index, prefix_id, f"s{s}", segments, spec.output_tokens, after=last_index[s])
        )
        last_index[s] = index
    warmup = [
        _request(encoder, r.index, r.prefix_id, None,
                 _segments(r.prompt_token_ids[: r.prefix_len], r.prompt_token_ids[r.prefix_len :]),
                 r.output_tokens, warmup=True)
        for r in wl.warmup
    ]
    return BenchWorkload(
        prefixes=spec.prefixes,
        warmup=warmup,
        requests=requests,
        prefix_tokens=float(np.mean([len(p) for p in wl.prefixes])),
        suffix_tokens=float(np.mean([r.prompt_tokens for r in requests])) - float(np.mean([len(p) for p in wl.prefixes])),
        output_tokens=float(spec.output_tokens),
        source=wl,
    )


def trace_workload(
    path: Path,
    encoder: PromptEncoder,
    default_output_tokens: int = 64,
    *,
    time_scale: float = 1.0,
    start_s: float = 0.0,
    duration_s: float | None = None,
    max_requests: int | None = None,
    cut_sessions: bool = False,
    closed_loop: bool = False,
    vocab: np.ndarray | None = None,
) -> BenchWorkload:
    """Replay a JSONL trace (``kvroute.trace``: Mooncake's format or kvroute's, auto-detected).

    kvroute's format: one object per line with ``timestamp`` (seconds; only differences
    matter), the prompt as ``prompt`` (text or token ids), ``prompt_token_ids`` or
    ``token_ids``, ``output_tokens`` (or ``max_tokens``; default ``default_output_tokens``),
    and optionally ``session_id`` and ``prefix_id``; a line with a session id is held until
    that session's previous line has been answered. Mooncake's: ``timestamp`` (ms),
    ``input_length``, ``output_length``, ``hash_ids``; prompts are synthesized as token ids per
    hash id (``kvroute.trace.format``), from ``vocab`` when given (a tokenizer's safe
    vocabulary), and sent as open-loop arrivals with no session hold.

    Requests are sent at their recorded offsets from the window's first request divided by
    ``time_scale`` (workers that many times faster than real time), or, with ``closed_loop``,
    in trace order by the bench's closed-loop clients. ``start_s``, ``duration_s`` and
    ``max_requests`` cut a window of whole sessions, or with ``cut_sessions`` a plain time
    window (``Trace.select``). No warmup: a trace is
    replayed as recorded.
    """
    trace = load_trace(path, default_output_tokens).select(start_s, duration_s, max_requests, cut_sessions)
    if vocab is not None:
        trace.vocab = np.asarray(vocab, dtype=np.uint32)
    hold_sessions = trace.format == "kvroute"
    requests: list[BenchRequest] = []
    last_of_session: dict[str, int] = {}
    for r in trace.replay(time_scale):
        line = r.source
        if line.prompt_text is not None and line.prompt_ids is None:
            body, n = encoder.encode_text(line.prompt_text, r.output_tokens)
        else:
            body, n = encoder.encode([("user", trace.prompt_tokens(line))], r.output_tokens)
        session = r.session if hold_sessions else None
        requests.append(
            BenchRequest(
                r.index, line.prefix_id, r.session, n, r.output_tokens, encoder.path, body,
                after=last_of_session.get(session) if session is not None else None,
                at_s=None if closed_loop else r.at_s,
            )
        )
        if session is not None:
            last_of_session[session] = r.index
    sessions = {r.session_id for r in requests if r.session_id is not None}
    prefixes = len({r.prefix_id for r in requests if r.prefix_id is not None}) or len(sessions) or 1
    return BenchWorkload(
        prefixes=prefixes,
        warmup=[],
        requests=requests,
        # The formula's C counts a whole prompt's blocks per request (no known shared prefix);
        # at least 1 token so that text prompts of unknown length still give a C.
        suffix_tokens=max(float(np.mean([r.prompt_tokens for r in requests])), 1.0),
        output_tokens=float(np.mean([r.output_tokens for r in requests])),
        trace=trace,
    )


def poisson_schedule(n: int, rate: float, seed: int) -> np.ndarray:
    """Send offsets (seconds) of ``n`` Poisson arrivals at ``rate`` per second, fixed by
    ``seed`` so every trial and topology gets the same schedule."""
    if rate <= 0:
        raise UserError(f"--rate must be > 0, got {rate}")
    gaps = np.random.default_rng([seed, 0xA77]).exponential(1.0 / rate, size=n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if n else np.zeros(0)
