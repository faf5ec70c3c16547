"""Tokenizers: turning prompts into the token ids that KV blocks are made of.

A router can only predict which worker holds a prompt's blocks if it tokenizes exactly as the
engine does: same vocabulary, same pre-tokenization, same chat template, same special tokens.
This module gives the rest of kvroute one small interface (:class:`Tokenizer`) with two
implementations:

* :class:`HFTokenizer` loads a local Hugging Face tokenizer directory (``tokenizer.json`` +
  ``tokenizer_config.json``) with the ``tokenizers`` library, offline, and renders chat
  templates natively (``kvroute._native.ChatTemplate``, minijinja set up as ``transformers``
  sets up jinja2 for ``apply_chat_template``, which is what vLLM calls; the native router
  renders through the same code).
* :class:`SyntheticTokenizer` is a deterministic word-level tokenizer with no files, for the
  emulator and the simulator when no real tokenizer is given.

How vLLM tokenizes (and so how callers should use this interface):

* ``/v1/completions`` with a text prompt: ``tokenizer(prompt, add_special_tokens=True)``; what
  "special tokens" means is up to the tokenizer's post-processor (Qwen's adds none, Llama's
  adds BOS). A prompt given as token ids is used as is.
* ``/v1/chat/completions``: the chat template is rendered to text (``tokenize=False``), then
  encoded with ``add_special_tokens=False`` because the template already wrote them.

:func:`safe_vocabulary` finds token ids that can be concatenated freely, which lets the
benchmark build text prompts of exact token lengths.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import tokenizers

from kvroute import _native
from kvroute._native import ChatTemplate
from kvroute.errors import UserError

#: Special tokens of the ChatML format used by Qwen (and by kvroute's own tiny model and
#: synthetic tokenizer): end of text (also the padding token), start and end of a message.
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
CHATML_SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

#: ChatML chat template (Qwen3's layout without tools or thinking): one
#: ``<|im_start|>ROLE\nCONTENT<|im_end|>\n`` per message, then ``<|im_start|>assistant\n`` when a
#: reply is wanted. No default system prompt, so a conversation's rendered text is a prefix of
#: the next turn's rendered text (what makes multi-turn chats reuse cached blocks).
CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


@runtime_checkable
class Tokenizer(Protocol):
    """What kvroute needs from a tokenizer.

    Attributes:
        name: what to call it in logs and reports.
        vocab_size: number of token ids, special tokens included (ids are ``[0, vocab_size)``).
        eos_token_id: the id that ends generation, or None if the tokenizer has none.
    """

    name: str
    vocab_size: int
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` as in ``transformers`` (and vLLM)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens written out."""
        ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat rendered to text; encode it with ``add_special_tokens=False``."""
        ...


def message_text(role: str, content: str | list | None) -> str | None:
    """A message's content as the one string vLLM's "string" content format hands a template:
    the text parts joined by newlines, empty ones skipped, a system text's Claude Code
    billing-header line dropped (``vllm/renderers/chat_utils.py``); None when a part is not
    text. The rule is ``kvroute_serve::chat::content_text``, the router's own.

    Raises:
        ValueError: a string with a lone surrogate.
    """
    return _native.message_text(role, content)


def flatten_message_content(messages: list[dict]) -> list[dict]:
    """Messages with their content as plain strings, as vLLM passes a template that reads
    ``message['content']`` as a string (its "string" content format, which ChatML and Qwen
    templates are detected as): :func:`message_text`.

    Raises:
        UserError: for a content part that is not text (this tokenizer layer is text-only).
    """
    flat = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, (str, list)):
            text = message_text(message.get("role", ""), content)
            if text is None:
                part = next(p for p in content if not isinstance(p, dict) or p.get("type") != "text")
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise UserError(f"unsupported chat content part {kind!r}: only text parts")
            message = {**message, "content": text}
        flat.append(message)
    return flat


class SyntheticTokenizer:
    """A deterministic word-level tokenizer that needs no files.

    Ids ``[0, num_special)`` are the ChatML special tokens; every other id decodes to its own
    pseudo-word made of consonant-vowel syllables ("ba", "ke", ...), numbered in bijective base
    so that every id has a distinct word. Decoding joins words with single spaces, and encoding
    splits text into special tokens, words (runs of Unicode letters, digits and ``_``) and
    single other non-space characters, so ``encode(decode(ids)) == ids`` for any ids. Text that
    is not one of the pseudo-words (real prose) still tokenizes stably: each unknown word maps
    to an id by its xxhash.

    The rules are ``kvroute_tokenize::synthetic``'s (``kvroute._native.SyntheticTokenizer``), the
    one implementation the router without ``--tokenizer``, the emulator and the simulator share.
    Like Qwen's tokenizer it adds no BOS/EOS, so ``add_special_tokens`` changes nothing.

    Args:
        vocab_size: number of ids, special tokens included.
    """

    def __init__(self, vocab_size: int = 32000) -> None:
        self._native = _native.SyntheticTokenizer(vocab_size)
        self.special_tokens = CHATML_SPECIAL_TOKENS
        self.num_special = len(self.special_tokens)
        self.name = f"synthetic-{vocab_size}"
        self.vocab_size = vocab_size
        self.eos_token_id: int | None = self.special_tokens.index(IM_END)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._native.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._native.decode([int(i) for i in ids])

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """ChatML, rendered exactly as :data:`CHATML_TEMPLATE` renders it."""
        pairs = [(m["role"], m["content"]) for m in flatten_message_content(messages)]
        return _native.SyntheticTokenizer.chat_text(pairs, add_generation_prompt)


def _token_content(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string, or a serialized
    ``AddedToken`` (``{"content": ...}``), or null."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A Hugging Face fast tokenizer from a local directory, used the way vLLM uses it.

    Encoding goes straight to the ``tokenizers`` library (what ``PreTrainedTokenizerFast``
    calls), so ``add_special_tokens`` adds whatever the tokenizer's post-processor adds.
    Decoding keeps special tokens.

    Args:
        tokenizer: the loaded ``tokenizers.Tokenizer``.
        name: what to call it (``from_dir`` uses the directory's path).
        chat_template: Jinja source of the chat template, or None if the tokenizer has none.
        special_tokens: ``bos_token``/``eos_token``/``pad_token``/``unk_token`` (and
            ``additional_special_tokens``) as in ``tokenizer_config.json``; passed to the chat
            template as ``transformers`` does.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        name: str,
        chat_template: str | None = None,
        special_tokens: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_tokens = dict(special_tokens or {})
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id = tokenizer.token_to_id(eos) if eos else None
        self.chat_template = chat_template
        # Compiled in transformers' environment, natively (see the kvroute_chat crate's docs).
        self._template = ChatTemplate(chat_template, self.special_tokens) if chat_template else None

    @classmethod
    def from_dir(cls, path: str | Path) -> HFTokenizer:
        """Load ``tokenizer.json`` and ``tokenizer_config.json`` from ``path``, offline.

        The chat template is taken from ``tokenizer_config.json`` (a string, or a list of named
        templates of which "default" is used) or, as newer ``transformers`` saves it, from
        ``chat_template.jinja`` beside it.

        Raises:
            UserError: when the directory or a file is missing or does not parse.
        """
        directory = Path(path)
        if not directory.is_dir():
            raise UserError(f"tokenizer directory {str(directory)!r} does not exist")
        for required in ("tokenizer.json", "tokenizer_config.json"):
            if not (directory / required).is_file():
                raise UserError(
                    f"{str(directory)!r} has no {required}: expected a Hugging Face tokenizer "
                    "directory (e.g. a model folder saved with save_pretrained)"
                )
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as exc:  # the Rust side raises plain Exception with the parse error
            raise UserError(f"cannot load {directory / 'tokenizer.json'}: {exc}") from None
        try:
            config = json.loads((directory / "tokenizer_config.json").read_text("utf-8"))
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read {directory / 'tokenizer_config.json'}: {exc}") from None
        if not isinstance(config, dict):
            raise UserError(f"{directory / 'tokenizer_config.json'} is not a JSON object")

        template = config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is None and (directory / "chat_template.jinja").is_file():
            template = (directory / "chat_template.jinja").read_text("utf-8")
        if template is not None and not isinstance(template, str):
            raise UserError(f"{directory}: chat_template is not a string")

        special_tokens: dict[str, Any] = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            content = _token_content(config.get(key))
            if content is not None:
                special_tokens[key] = content
        extra = [_token_content(t) for t in config.get("additional_special_tokens") or ()]
        if extra:
            special_tokens["additional_special_tokens"] = [t for t in extra if t is not None]
        try:
            return cls(tokenizer, str(directory.resolve()), template, special_tokens)
        except ValueError as exc:  # ChatTemplate's refusal of a template that does not parse
            raise UserError(f"{directory}: chat template does not parse: {exc}") from None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The "fast" batch entry point skips computing character offsets, which nobody here
        # needs; that is about a quarter of the time of a plain encode for long prompts.
        return self._tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[
            0
        ].ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """``encode`` of many texts at once (in parallel in the Rust library)."""
        encodings = self._tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def decode_batch(self, sequences: list[Sequence[int]]) -> list[str]:
        """``decode`` of many sequences at once."""
        return self._tokenizer.decode_batch([list(s) for s in sequences], skip_special_tokens=False)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` with the tokenizer's chat template, as ``transformers`` does
        with ``tokenize=False`` (content-part lists are first joined as vLLM does).

        Args:
            messages: OpenAI-style messages (``role``, ``content``, ...).
            add_generation_prompt: end with the header of an assistant reply.
            template_kwargs: extra template variables (vLLM's ``chat_template_kwargs``, e.g.
                ``enable_thinking``); they override special tokens of the same name, as in
                ``transformers``.

        Raises:
            UserError: when the tokenizer has no chat template, the template raises or fails,
                or a kwarg names ``messages``, ``tools``, ``documents`` or
                ``add_generation_prompt``.
            TypeError: for a message value that is not JSON-like.
        """
        if self._template is None:
            raise UserError(f"tokenizer {self.name} has no chat template")
        try:
            return self._template.render(
                flatten_message_content(messages), add_generation_prompt, template_kwargs
            )
        except ValueError as exc:  # the template raised or failed to render
            raise UserError(f"chat template of {self.name} failed: {exc}") from None


    def render_chat_request(self, body: dict) -> str | None:
        """The prompt text of a ``/v1/chat/completions`` body as vLLM builds it (its messages
        as vLLM's conversation, ``tools``, ``documents``, ``chat_template_kwargs``,
        ``reasoning_effort``), which is what ``kvroute serve`` hashes; None where the router
        routes it untokenized (see ``kvroute_serve::chat``).

        Raises:
            UserError: when the tokenizer has no chat template.
        """
        if self._template is None:
            raise UserError(f"tokenizer {self.name} has no chat template")
        try:
            return self._template.render_request(json.dumps(body))
        except ValueError:  # a string serde_json refuses (a lone surrogate)
            return None


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """The tokenizer in directory ``path``, or a :class:`SyntheticTokenizer` when None."""
    if path is None:
        return SyntheticTokenizer()
    return HFTokenizer.from_dir(path)


#: safe_vocabulary results, computed once per tokenizer object (it encodes the whole vocabulary).
_safe_vocabulary_cache: weakref.WeakKeyDictionary[Any, np.ndarray] = weakref.WeakKeyDictionary()

#: Seeds of the shuffled concatenations that test tokens next to each other.
_ADJACENCY_CHECK_SEEDS = (0, 1, 2)


def safe_vocabulary(tokenizer: Tokenizer, limit: int | None = None) -> np.ndarray:
    """Token ids that can be concatenated freely, in ascending order.

    Any sequence ``s`` of the returned ids satisfies
    ``tokenizer.encode(tokenizer.decode(s), add_special_tokens=False) == s``. That is what lets
    the benchmark send a text prompt of an exact token length and know that no merge happens
    across the boundary between a shared prefix and a unique suffix.

    For :class:`SyntheticTokenizer` these are all non-special ids. For other tokenizers they
    are the word pieces that decode to a space followed by ASCII letters (byte-level BPE's
    ``Ġword``): pre-tokenizers split text before every such word, so they never merge with
    their neighbours. That argument is checked, not assumed: each candidate must re-encode to
    itself alone and doubled, and shuffled concatenations of all of them must re-encode exactly
    (any id next to a mismatch is dropped and the check repeated).

    Args:
        tokenizer: the tokenizer.
        limit: return at most this many (the lowest ids).

    Raises:
        UserError: when the tokenizer has no such tokens.
    """
    ids = _safe_vocabulary_cache.get(tokenizer)
    if ids is None:
        if isinstance(tokenizer, SyntheticTokenizer):
            ids = np.arange(tokenizer.num_special, tokenizer.vocab_size, dtype=np.int64)
        else:
            ids = _verified_word_pieces(tokenizer)
        ids.setflags(write=False)
        _safe_vocabulary_cache[tokenizer] = ids
    return ids if limit is None else ids[:limit]


def _decode_each(tokenizer: Tokenizer, sequences: list[list[int]]) -> list[str]:
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.decode_batch(sequences)
    return [tokenizer.decode(s) for s in sequences]


def _encode_each(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.encode_batch(texts, add_special_tokens=False)
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def _verified_word_pieces(tokenizer: Tokenizer) -> np.ndarray:
    texts = _decode_each(tokenizer, [[i] for i in range(tokenizer.vocab_size)])
    candidates = [
        i
        for i, text in enumerate(texts)
        if len(text) >= 2 and text[0] == " " and text[1:].isascii() and text[1:].isalpha()
    ]
    # Each candidate must re-encode to itself, alone and repeated (a token is never next to
    # itself in the shuffled concatenations below).
    alone = _encode_each(tokenizer, [texts[i] for i in candidates])
    doubled = _encode_each(tokenizer, _decode_each(tokenizer, [[i, i] for i in candidates]))
    safe = {
        i for i, once, twice in zip(candidates, alone, doubled) if once == [i] and twice == [i, i]
    }

    for seed in _ADJACENCY_CHECK_SEEDS:
        # One long shuffled concatenation checks every adjacent pair in it at the cost of a
        # single encode; on a mismatch, drop the ids around it and check again.
        order = [int(i) for i in np.random.default_rng(seed).permutation(sorted(safe))]
        while order:
            encoded = tokenizer.encode(tokenizer.decode(order), add_special_tokens=False)
            if encoded == order:
                break
            k = next(
                (j for j, (a, b) in enumerate(zip(encoded, order)) if a != b),
                min(len(encoded), len(order)),
            )
            for j in range(max(0, k - 1), min(len(order), k + 2)):
                safe.discard(order[j])
            order = [i for i in order if i in safe]
    if not safe:
        raise UserError(
            f"tokenizer {tokenizer.name} has no word-piece tokens that re-encode exactly; "
            "exact-length text prompts cannot be built with it"
        )
    return np.array(sorted(safe), dtype=np.int64)
