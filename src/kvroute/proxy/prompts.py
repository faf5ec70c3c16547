"""From an OpenAI request body to the chained block hashes of its prompt, as the engine sees it.

The router can only match a request against the blocks a worker holds if it produces the
engine's token ids: same tokenizer, same chat template, same special tokens (see
:mod:`kvroute.tokens`). Three inputs:

* a completion prompt given as token ids: used as is (exact, and the cheapest);
* a completion prompt given as text: ``encode(text, add_special_tokens=True)``;
* chat messages: the chat template rendered to text, encoded with
  ``add_special_tokens=False`` (the template wrote the special tokens).

**Exact** when the router is given the engine's tokenizer directory. Without one it uses
kvroute's built-in synthetic tokenizer: exact against emulated workers that also run without
a tokenizer, only **approximate** against a real engine (its token ids differ, so blocks match
only by accident and the kv-aware policy degrades towards its load term).

Tokenizing is by far the largest CPU cost of routing a long prompt (on this machine a real
byte-level BPE spends ~5 µs per token in its pre-tokenizer regex). Two caches remove the
repeated work exactly:

* **segments**: Hugging Face tokenizers cut the input at special tokens *before* normalizing
  and pre-tokenizing, so the text between two special tokens tokenizes the same wherever it
  appears. A chat prompt is cut there and each piece looked up in an LRU cache: a shared
  system prompt or conversation history is tokenized once, only the new message each time.
* **prefix hashes**: the block hashes of everything before the last piece are cached by that
  text, so only the last piece's blocks are hashed per request.

A completion prompt given as text has no special tokens to cut at; for byte-level BPE
tokenizers it is cut instead where the pre-tokenizer provably cuts (between words) and the
pieces cached the same way (:mod:`kvroute.proxy.chunks`). Other tokenizers encode it whole
(cached only when the identical text repeats).
"""

from __future__ import annotations

import re
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvroute.blocks import BlockHasher
from kvroute.errors import UserError
from kvroute.proxy.chunks import text_chunker
from kvroute.tokens import HFTokenizer, SyntheticTokenizer, Tokenizer, flatten_message_content


class BadRequest(ValueError):
    """The body cannot be routed as it stands (the client's mistake: answered with a 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class PromptInfo:
    """What routing needs from a prompt: its length and its full blocks' chained hashes."""

    num_tokens: int
    block_hashes: list[int]


#: Memory bound of a router's tokenization caches together (``--prompt-cache-bytes``): a
#: quarter for message segments, a quarter for prompt heads' hashes, half for the text pieces
#: of :mod:`kvroute.proxy.chunks`.
DEFAULT_PROMPT_CACHE_BYTES = 64 << 20
#: An entry larger than this share of its cache's bound is not cached: one client's huge
#: prompt must not flush everyone's shared prefixes.
_LARGEST_ENTRY_SHARE = 8
#: Bytes per cached block hash: a list slot and a Python int.
_HASH_BYTES = 8 + 32


class ByteLRU:
    """A mapping bounded in bytes: least recently used entries are dropped once the sizes
    ``size_of(key, value)`` sum past ``max_bytes``; an entry over ``max_bytes`` /
    :data:`_LARGEST_ENTRY_SHARE` is not kept at all."""

    __slots__ = ("_data", "_size_of", "evictions", "max_bytes", "nbytes")

    def __init__(self, max_bytes: int, size_of: Callable[[Any, Any], int]) -> None:
        self.max_bytes = max_bytes
        self._size_of = size_of
        self._data: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self.nbytes = 0
        self.evictions = 0

    def get(self, key: Any) -> Any:
        entry = self._data.get(key)
        if entry is None:
            return None
        self._data.move_to_end(key)
        return entry[0]

    def put(self, key: Any, value: Any) -> None:
        size = self._size_of(key, value)
        if size * _LARGEST_ENTRY_SHARE > self.max_bytes:
            return
        old = self._data.pop(key, None)
        if old is not None:
            self.nbytes -= old[1]
        self._data[key] = (value, size)
        self.nbytes += size
        while self.nbytes > self.max_bytes and self._data:
            _, (_, dropped) = self._data.popitem(last=False)
            self.nbytes -= dropped
            self.evictions += 1

    def __len__(self) -> int:
        return len(self._data)


def _segment_size(key: str, ids: np.ndarray) -> int:
    return sys.getsizeof(key) + ids.nbytes + 112  # the array object, the dict slot


def _prefix_size(key: tuple[str, str], value: PromptInfo | tuple[np.ndarray, list[int]]) -> int:
    if isinstance(value, PromptInfo):
        hashes, ids_bytes = value.block_hashes, 0
    else:
        hashes, ids_bytes = value[1], value[0].nbytes
    return sys.getsizeof(key[1]) + ids_bytes + _HASH_BYTES * len(hashes) + 200


#: Token ids converted per numpy call: each call holds the GIL, so a long prompt parsed on
#: the offload thread lets the event loop run between slices (~5 ms each).
_IDS_SLICE = 1 << 16


#: Bytes of a body's id list parsed per numpy call by :func:`parse_large_ids`.
_RAW_IDS_SLICE = 1 << 20
_ID_LIST_BYTES = b"0123456789, \t\r\n"


def _next_comma(view: memoryview, start: int) -> int:
    """The first comma in ``view`` at or after ``start``, or its length."""
    while start < len(view):
        found = bytes(view[start:start + 4096]).find(b",")
        if found >= 0:
            return start + found
        start += 4096
    return len(view)


def _longest_digit_run(data: bytes) -> int:
    chars = np.frombuffer(data, dtype=np.uint8)
    others = np.flatnonzero((chars < 48) | (chars > 57))
    bounds = np.concatenate(([-1], others, [len(chars)]))
    return int(np.diff(bounds).max()) - 1


def parse_large_ids(raw: bytes) -> dict | None:
    """A completion body whose ``prompt`` is one flat list of token ids, decoded without a
    Python int per id: the other fields decoded as usual, the ids parsed from the body's bytes
    in 1 MiB slices (each numpy call holds the GIL a few ms, where decoding 7.5M ids at once
    held it 1.2 s). None when the body is not of that shape (the caller decodes it whole).

    Raises:
        msgspec.DecodeError: the body is not a JSON object.
    """
    import msgspec  # the router's decoder; imported here to keep this module's imports light

    fields = msgspec.json.decode(raw, type=dict[str, msgspec.Raw])
    prompt = fields.get("prompt")
    if prompt is None:
        return None
    # A view, not a copy: the list is most of a large body.
    view = memoryview(prompt)
    first, last = bytes(view[:64]), bytes(view[-64:])
    head = len(first) - len(first.lstrip())
    tail = len(view) - (len(last) - len(last.rstrip()))
    if tail - head < 3 or view[head] != ord("[") or view[tail - 1] != ord("]"):
        return None
    inner = view[head + 1:tail - 1]
    parts = []
    start = 0
    while start < len(inner):
        stop = _next_comma(inner, start + _RAW_IDS_SLICE)
        piece = bytes(inner[start:stop])
        # Digits, commas and spaces only (the decoder checked it is valid JSON, so a flat list
        # of non-negative integers), none over ten digits (beyond 2^32 anyway).
        if piece.translate(None, _ID_LIST_BYTES) or _longest_digit_run(piece) > 10:
            return None
        ids = np.fromstring(piece, dtype=np.int64, sep=",")  # text mode: not deprecated
        if len(ids) != piece.count(b",") + 1 or (len(ids) and ids.max() > 0xFFFFFFFF):
            return None
        parts.append(ids.astype(np.uint32))  # in range: the hasher reads uint32 8x faster
        start = stop + 1
    body = {key: msgspec.json.decode(value) for key, value in fields.items() if key != "prompt"}
    body["prompt"] = np.concatenate(parts) if len(parts) > 1 else parts[0]
    return body


def _token_ids(prompt: list) -> np.ndarray | None:
    """``prompt`` as an array of token ids, or None unless it is a flat list of integers in
    ``[0, 2^32)`` (one vectorized check per slice instead of a loop over the ids: a float, a
    string or an overflowing int makes another dtype)."""
    parts = []
    for start in range(0, len(prompt), _IDS_SLICE):
        try:
            ids = np.asarray(prompt[start:start + _IDS_SLICE])
        except (TypeError, ValueError, OverflowError):
            return None
        if ids.dtype.kind not in "iu" or ids.ndim != 1 or (ids < 0).any() or (ids > 0xFFFFFFFF).any():
            return None
        parts.append(ids.astype(np.uint32))  # in range: the hasher reads uint32 8x faster
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


#: Longest prompt text tokenized when the tokenizer states no maximum length: 4 Mi characters
#: are ~1M tokens, beyond today's longest context windows.
DEFAULT_MAX_TEXT_BYTES = 4 << 20
#: Longest token-id prompt hashed when the tokenizer states no maximum length (1Mi tokens).
DEFAULT_MAX_PROMPT_TOKENS = 1 << 20


def max_text_bytes(max_length: int | None, longest_token_bytes: int | None) -> int:
    """The longest prompt text worth tokenizing. A text of ``b`` characters has at least
    ``b / (longest token's characters)`` tokens, so beyond ``max_length * longest_token_bytes``
    characters it is longer than the engine accepts whatever it says: the engine refuses it,
    and the router need not tokenize it to route it there. :data:`DEFAULT_MAX_TEXT_BYTES`
    when either is unknown."""
    if not max_length or not longest_token_bytes:
        return DEFAULT_MAX_TEXT_BYTES
    return max_length * longest_token_bytes


#: Characters of text the synthetic tokenizer encodes per call (see :func:`_encode`).
_TEXT_SLICE = 1 << 16
_WHITESPACE = re.compile(r"\s")


def _encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> np.ndarray:
    """``tokenizer.encode`` as a uint32 array. The synthetic tokenizer (pure Python, whose one
    regex call over a 50 MB text holds the GIL for seconds) encodes a long text in slices cut
    at whitespace, which none of its tokens contains (it matches special tokens, ``\\w+`` runs
    and single punctuation characters, skipping whitespace): the same ids, and an event loop
    that runs between slices while the offload thread encodes."""
    if not isinstance(tokenizer, SyntheticTokenizer) or len(text) <= _TEXT_SLICE:
        return np.asarray(tokenizer.encode(text, add_special_tokens=add_special_tokens), dtype=np.uint32)
    parts = []
    start = 0
    while start < len(text):
        space = _WHITESPACE.search(text, start + _TEXT_SLICE) if start + _TEXT_SLICE < len(text) else None
        stop = space.start() if space is not None else len(text)
        parts.append(np.asarray(tokenizer.encode(text[start:stop], add_special_tokens=False), dtype=np.uint32))
        start = stop
    return np.concatenate(parts)


def _special_cut_tokens(tokenizer: Tokenizer) -> dict[str, int]:
    """Special tokens at which the tokenizer cuts its input, with their ids.

    Only tokens the tokenizer really matches literally qualify: for a Hugging Face tokenizer,
    added special tokens without ``lstrip``/``rstrip``/``single_word`` (those swallow
    neighbouring whitespace, so cutting the text beside them would change the result).
    """
    if isinstance(tokenizer, SyntheticTokenizer):
        return {t: tokenizer.encode(t)[0] for t in tokenizer.special_tokens}
    if isinstance(tokenizer, HFTokenizer):
        cuts = {}
        for token_id, added in tokenizer._tokenizer.get_added_tokens_decoder().items():
            if added.special and not (added.lstrip or added.rstrip or added.single_word):
                cuts[added.content] = token_id
        return cuts
    return {}


class PromptHasher:
    """Tokenizes request prompts as the engine does and hashes their full blocks.

    Every cache is bounded in bytes (:class:`ByteLRU`; the text pieces' in
    :class:`kvroute.proxy.chunks.TextChunker`), together ``cache_bytes``: many distinct
    large prompts cost evictions, not memory.

    Args:
        tokenizer: the engine's tokenizer (or the synthetic fallback).
        hasher: the router's block hasher (same block size and seed as the index).
        cache_bytes: memory bound of the caches together (see
            :data:`DEFAULT_PROMPT_CACHE_BYTES` for the shares).
        segment_cache_entries / prefix_cache_entries: entry
            bounds on top (tests use small ones to see evictions).
        max_text_bytes: longer prompt texts are not tokenized (routed with no prefix match,
            see :func:`max_text_bytes`): the bound on each request's tokenization work.
        max_prompt_tokens: longer token-id prompts are not hashed (the same, for ids; the
            tokenizer's maximum length, else :data:`DEFAULT_MAX_PROMPT_TOKENS`).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        hasher: BlockHasher,
        segment_cache_entries: int | None = None,
        prefix_cache_entries: int | None = None,
        *,
        cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES,
        max_text_bytes: int | None = None,
        max_prompt_tokens: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.hasher = hasher
        self._cut_ids = _special_cut_tokens(tokenizer)
        self._cut = (
            re.compile("(" + "|".join(re.escape(t) for t in sorted(self._cut_ids, key=len, reverse=True)) + ")")
            if self._cut_ids
            else None
        )
        self.max_text_bytes = max_text_bytes if max_text_bytes is not None else DEFAULT_MAX_TEXT_BYTES
        self.max_prompt_tokens = max_prompt_tokens if max_prompt_tokens is not None else DEFAULT_MAX_PROMPT_TOKENS
        #: Prompts routed untokenized for being longer than ``max_text_bytes``.
        self.untokenized = 0
        self._segments = ByteLRU(cache_bytes // 4, _segment_size)
        self._prefixes = ByteLRU(cache_bytes // 4, _prefix_size)
        self._segment_entries = segment_cache_entries
        self._prefix_entries = prefix_cache_entries
        #: Piecewise exact encoder of text prompts, or None when the tokenizer does not qualify.
        self.text_chunker = text_chunker(tokenizer, max_bytes=cache_bytes // 2)

    def cache_stats(self) -> tuple[int, int]:
        """Bytes the caches hold, and entries they dropped to stay within their bounds."""
        nbytes = self._segments.nbytes + self._prefixes.nbytes
        evictions = self._segments.evictions + self._prefixes.evictions
        if self.text_chunker is not None:
            nbytes += self.text_chunker.nbytes
            evictions += self.text_chunker.evictions
        return nbytes, evictions

    def _put(self, cache: ByteLRU, entries: int | None, key: Any, value: Any) -> None:
        cache.put(key, value)
        if entries is not None:
            while len(cache) > entries:
                _, (_, size) = cache._data.popitem(last=False)
                cache.nbytes -= size
                cache.evictions += 1

    # --- request bodies -----------------------------------------------------------------------

    def completion(self, body: dict) -> PromptInfo:
        """The prompt of a ``/v1/completions`` body (the first one of a batch).

        Raises:
            BadRequest: no prompt, or one that is neither text nor token ids.
        """
        prompt = body.get("prompt")
        if isinstance(prompt, (list, np.ndarray)) and len(prompt) > self.max_prompt_tokens:
            return self._untokenized(len(prompt))  # more ids than the engine accepts
        if isinstance(prompt, np.ndarray):  # ids parsed straight from the body (parse_large_ids)
            return PromptInfo(len(prompt), self.hasher.hash_blocks(prompt))
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch: vLLM serves them in order; route by the first
        if isinstance(prompt, str):
            return self.text(prompt)
        if isinstance(prompt, list) and prompt:
            ids = _token_ids(prompt)
            if ids is None:
                raise BadRequest("prompt: token ids must be integers in [0, 2^32)", "prompt")
            return PromptInfo(len(ids), self.hasher.hash_blocks(ids))
        raise BadRequest(
            "prompt: expected a string, a list of token ids, or a list of those", "prompt"
        )

    def chat(self, body: dict) -> PromptInfo:
        """The templated prompt of a ``/v1/chat/completions`` body.

        Raises:
            BadRequest: messages missing or not a list of objects with a role.
        """
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages: expected a non-empty list", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages.{i}: expected an object with a role", "messages")
            if m.get("content") is None:
                messages[i] = {**m, "content": ""}
        add_generation_prompt = body.get("add_generation_prompt", True)
        kwargs = body.get("chat_template_kwargs")
        try:
            flat = flatten_message_content(messages)
            # Longer than any accepted prompt before the template even adds to it: not rendered.
            if sum(len(m["content"]) for m in flat if isinstance(m.get("content"), str)) > self.max_text_bytes:
                return self._untokenized()
            if isinstance(self.tokenizer, HFTokenizer) and isinstance(kwargs, dict):
                text = self.tokenizer.apply_chat_template(
                    flat, add_generation_prompt=bool(add_generation_prompt), **kwargs
                )
            else:
                text = self.tokenizer.apply_chat_template(
                    flat, add_generation_prompt=bool(add_generation_prompt)
                )
        except (UserError, TypeError, KeyError):
            # Content the router cannot render (images, a template that refuses these
            # messages): route without a prefix match and let the worker judge the request.
            return PromptInfo(0, [])
        if len(text) > self.max_text_bytes:
            return self._untokenized()
        return self._templated(text)

    def _untokenized(self, num_tokens: int = 0) -> PromptInfo:
        self.untokenized += 1
        return PromptInfo(num_tokens, [])

    # --- tokenizing and hashing ---------------------------------------------------------------

    def text(self, text: str) -> PromptInfo:
        """A completion prompt given as text (special tokens added as the engine adds them)."""
        if len(text) > self.max_text_bytes:
            return self._untokenized()
        cached = self._prefixes.get(("text", text))
        if cached is None:
            if self.text_chunker is not None:
                ids = self.text_chunker.encode(text)
            else:
                ids = _encode(self.tokenizer, text, add_special_tokens=True)
            cached = PromptInfo(len(ids), self.hasher.hash_blocks(ids))
            self._put(self._prefixes, self._prefix_entries, ("text", text), cached)
        return cached

    def _segment_ids(self, piece: str) -> np.ndarray:
        ids = self._segments.get(piece)
        if ids is None:
            if self.text_chunker is not None:
                # A new message: only its words not seen before go through the library.
                ids = self.text_chunker.encode(piece, add_special_tokens=False)
            else:
                ids = _encode(self.tokenizer, piece, add_special_tokens=False)
            self._put(self._segments, self._segment_entries, piece, ids)
        return ids

    def _templated(self, text: str) -> PromptInfo:
        """A chat template's output, cut at special tokens (see the module docstring)."""
        if self._cut is None:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            return PromptInfo(len(ids), self.hasher.hash_blocks(ids))
        pieces = self._cut.split(text)
        # The head: everything up to the last non-special piece. Its ids and hashes are
        # cached by its text; the last piece (usually the new user message) is per request.
        last = len(pieces) - 1
        while last > 0 and (not pieces[last] or pieces[last] in self._cut_ids):
            last -= 1
        head_text = "".join(pieces[:last])
        head = self._prefixes.get(("head", head_text))
        if head is None:
            head_ids = self._ids_of(pieces[:last])
            head = (head_ids, self.hasher.hash_blocks(head_ids))
            self._put(self._prefixes, self._prefix_entries, ("head", head_text), head)
        head_ids, head_hashes = head
        tail_ids = self._ids_of(pieces[last:])
        ids = np.concatenate((head_ids, tail_ids)) if len(tail_ids) else head_ids
        hashes = list(head_hashes)
        n_head_blocks = len(head_ids) // self.hasher.block_size
        # The block straddling head and tail is hashed again with the tail.
        del hashes[n_head_blocks:]
        self.hasher.extend(hashes, ids)
        return PromptInfo(len(ids), hashes)

    def _ids_of(self, pieces: Sequence[str]) -> np.ndarray:
        parts = []
        for piece in pieces:
            if not piece:
                continue
            special = self._cut_ids.get(piece)
            if special is not None:
                parts.append(np.array([special], dtype=np.uint32))
            else:
                parts.append(self._segment_ids(piece))
        if not parts:
            return np.zeros(0, dtype=np.uint32)
        return np.concatenate(parts) if len(parts) > 1 else parts[0]
