"""Deterministic output tokens for the emulator, and their text.

A real model samples its output; the emulator has no model, so it derives the output from the
prompt instead. The same prompt always yields the same tokens (a multi-turn client that sends
the answer back gets the same conversation on every run), different prompts yield different
tokens, and every token comes from the tokenizer's *safe vocabulary* (ids that decode to plain
words and re-encode to themselves, never EOS), so the output never stops early: the emulator
always generates exactly ``max_tokens`` tokens, as vLLM does with ``ignore_eos: true``.

Text is streamed as vLLM's incremental detokenizer does: each chunk carries what the new
tokens add to the decoded output, and the chunks concatenate to ``decode(all tokens)``. Rather
than re-decoding the whole output at every step, the generator learns once how the tokenizer
joins two safe tokens (a byte-level BPE word piece already starts with its space; the built-in
tokenizer puts one space between words) and then builds text from memoized per-token pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import xxhash

from kvroute.blocks import as_token_array

#: SplitMix64 constants: a cheap bijective mixer, vectorized over positions with numpy.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)

#: How many token pairs are checked to learn the tokenizer's separator.
_SEPARATOR_SAMPLES = 64


def _splitmix64(x: np.ndarray) -> np.ndarray:
    # uint64 arithmetic wraps silently on arrays, which is what SplitMix64 wants.
    z = (x ^ (x >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


class OutputTokenGenerator:
    """Maps a prompt to its output tokens, and output tokens to text.

    Args:
        vocabulary: the token ids outputs are drawn from (``kvroute.tokens.safe_vocabulary``).
        decode: the tokenizer's ``decode``.

    Raises:
        ValueError: the vocabulary is empty, or its tokens do not decode with one constant
            separator between neighbours (text could then not be streamed piece by piece).
    """

    def __init__(self, vocabulary: np.ndarray, decode: Callable[[Sequence[int]], str]) -> None:
        vocab = np.asarray(vocabulary, dtype=np.uint32)
        if vocab.size == 0:
            raise ValueError("the output vocabulary is empty")
        self.vocabulary = vocab
        self._decode = decode
        self._pieces: dict[int, str] = {}
        self.separator = self._learn_separator()

    def _learn_separator(self) -> str:
        rng = np.random.default_rng(0)
        pairs = rng.choice(self.vocabulary, size=(_SEPARATOR_SAMPLES, 2))
        separator = None
        for a, b in pairs.tolist():
            joined = self._decode([a, b])
            left, right = self.piece(a), self.piece(b)
            if not (joined.startswith(left) and joined.endswith(right)):
                separator = None
                break
            sep = joined[len(left) : len(joined) - len(right)]
            if separator is None:
                separator = sep
            elif sep != separator or len(left) + len(sep) + len(right) != len(joined):
                separator = None
                break
        if separator is None:
            raise ValueError(
                "the tokenizer does not decode output tokens piece by piece; "
                "its safe vocabulary cannot be streamed"
            )
        return separator

    def tokens(self, prompt_token_ids: Sequence[int] | np.ndarray, count: int) -> np.ndarray:
        """The first ``count`` output tokens for this prompt (uint32 array)."""
        prompt = as_token_array(prompt_token_ids)
        seed = np.uint64(xxhash.xxh3_64_intdigest(memoryview(prompt).cast("B")))
        positions = np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN + seed
        picks = _splitmix64(positions) % np.uint64(len(self.vocabulary))
        return self.vocabulary[picks.astype(np.int64)]

    def piece(self, token_id: int) -> str:
        """Text of one output token on its own (memoized: outputs reuse a small vocabulary)."""
        text = self._pieces.get(token_id)
        if text is None:
            text = self._pieces[token_id] = self._decode([token_id])
        return text

    def text(self, token_ids: Sequence[int], first: bool = True) -> str:
        """What ``token_ids`` add to the output text; ``first`` when they start the output.

        Chunks concatenate to ``decode(all output tokens)``.
        """
        piece = self.piece
        sep = self.separator
        text = sep.join([piece(t) for t in token_ids])
        return text if first or not text else sep + text
