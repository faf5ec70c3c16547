"""A tiny Qwen3-style model directory that vLLM can serve, made offline from a seed.

Measuring prefix-cache behaviour needs a real engine but not a good model: what matters is
that vLLM loads it, tokenizes prompts with a real byte-level BPE tokenizer and chat template,
and stores real KV blocks. This module writes such a directory with nothing downloaded:

* ``config.json``: ``Qwen3ForCausalLM`` with hidden size 128, 2 layers, 4 query heads, 2 KV
  heads of dimension 32 (512 bytes of bf16 KV per token), tied embeddings;
* ``model.safetensors``: random bf16 weights, written directly in the safetensors format (no
  torch needed), named and shaped as vLLM's ``Qwen3ForCausalLM.load_weights`` expects;
* ``generation_config.json``: BOS/EOS/pad ids only, so vLLM's defaults apply to sampling;
* ``tokenizer.json`` + ``tokenizer_config.json``: a byte-level BPE tokenizer with Qwen2's
  pre-tokenizer, trained on generated pseudo-text, with ChatML special tokens and template,
  loadable by ``transformers``' ``AutoTokenizer`` (as ``PreTrainedTokenizerFast``) and by
  :class:`kvroute.tokens.HFTokenizer`.

Everything is a function of the seed: the same seed gives byte-identical files.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from kvroute.errors import UserError
from kvroute.tokens import CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE, ENDOFTEXT, IM_END

#: Qwen2/Qwen3's pre-tokenization pattern (GPT-4 style, digits split one by one): every word
#: carries its leading space, so text splits before each " word".
QWEN_PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: Files written by :func:`build_tiny_model`, in the order they are written.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

#: Smallest vocabulary that leaves room for merges after the 256 byte symbols and specials.
MIN_VOCAB_SIZE = 512


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape of the tiny model; the defaults are the one described in docs/vllm.md."""

    vocab_size: int = 8192
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 8192
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    #: Standard deviation of the random projection and embedding weights (HF's default).
    initializer_range: float = 0.02

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the checkpoint with its shape, in Hugging Face naming.

        Linear weights are ``[out_features, in_features]``. vLLM stacks ``q/k/v_proj`` into
        ``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj`` while loading; Qwen3's
        per-head RMSNorms ``q_norm``/``k_norm`` have ``head_dim`` weights. With tied
        embeddings there is no ``lm_head.weight`` (vLLM skips it and reuses the embedding).
        """
        h, i = self.hidden_size, self.intermediate_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for layer in range(self.num_hidden_layers):
            p = f"model.layers.{layer}"
            shapes.update(
                {
                    f"{p}.input_layernorm.weight": (h,),
                    f"{p}.self_attn.q_proj.weight": (q, h),
                    f"{p}.self_attn.k_proj.weight": (kv, h),
                    f"{p}.self_attn.v_proj.weight": (kv, h),
                    f"{p}.self_attn.o_proj.weight": (h, q),
                    f"{p}.self_attn.q_norm.weight": (self.head_dim,),
                    f"{p}.self_attn.k_norm.weight": (self.head_dim,),
                    f"{p}.post_attention_layernorm.weight": (h,),
                    f"{p}.mlp.gate_proj.weight": (i, h),
                    f"{p}.mlp.up_proj.weight": (i, h),
                    f"{p}.mlp.down_proj.weight": (h, i),
                }
            )
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def hf_config(self, bos_token_id: int, eos_token_id: int) -> dict:
        """``config.json``, with the keys and layout of Qwen3's published configs."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": self.initializer_range,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "model_type": "qwen3",
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": self.rope_theta,
            "sliding_window": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": self.vocab_size,
        }


def float32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (as uint16) of finite ``values``, rounded to nearest even.

    bfloat16 is the upper half of a float32. Adding 0x7FFF plus the lowest kept bit before
    truncating rounds to nearest with ties to even, as torch's conversion does.
    """
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return ((bits + rounding) >> np.uint32(16)).astype(np.uint16)


def write_bf16_safetensors(
    path: Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> None:
    """Write float tensors as a bf16 safetensors file.

    The format: an 8-byte little-endian header length, a JSON header mapping each name to
    ``dtype``, ``shape`` and ``data_offsets`` (relative to the end of the header) plus an
    optional ``__metadata__`` of strings, then the raw little-endian bytes of every tensor,
    back to back. The header is padded with spaces to a multiple of 8 bytes so the data
    starts aligned, as the reference writer does.
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    blobs = []
    offset = 0
    for name, array in tensors.items():
        blob = float32_to_bf16_bits(array).astype("<u2").tobytes()
        header[name] = {
            "dtype": "BF16",
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for blob in blobs:
            f.write(blob)


def random_weights(config: TinyModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Weights for ``config`` drawn from ``seed``: normal(0, initializer_range) for embeddings
    and projections, ones for RMSNorm scales (the usual initialisation, which keeps
    activations in range so vLLM computes ordinary numbers)."""
    rng = np.random.default_rng([seed, 1])
    weights = {}
    for name, shape in config.weight_shapes().items():
        if name.endswith("norm.weight"):
            weights[name] = np.ones(shape, dtype=np.float32)
        else:
            weights[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(
                config.initializer_range
            )
    return weights


class PseudoTextCorpus:
    """Deterministic text to train the tokenizer on: sentences of pseudo-words.

    Word frequencies follow a Zipf law over a lexicon several times larger than the target
    vocabulary, so BPE finds common whole words, frequent syllables and rare leftovers, as in
    real text; capitals, punctuation, digits and newlines give the other pre-token classes
    some merges too.

    Args:
        seed: the randomness.
        lexicon_size: number of distinct words.
        num_words: length of the corpus in words.
    """

    _ONSETS = (
        "",
        *"b c d f g h j k l m n p r s t v w y z br ch cl dr fl gr pl pr sh st th tr".split(),
    )
    _NUCLEI = tuple("a e i o u ai ea ee ou oo y".split())
    _CODAS = ("", "", "", *"n r s t l m ng nd st ck x".split())
    #: Words of 1-4 syllables, short ones commoner.
    _SYLLABLE_COUNT_PROBABILITIES = (0.35, 0.35, 0.2, 0.1)
    _SENTENCE_ENDS = (".", ".", ".", "?", "!")
    _CLAUSE_MARKS = (",", ",", ";", ":")

    def __init__(self, seed: int, lexicon_size: int, num_words: int) -> None:
        self.rng = np.random.default_rng([seed, 0])
        self.lexicon = self._make_lexicon(lexicon_size)
        ranks = np.arange(1, len(self.lexicon) + 1, dtype=np.float64)
        weights = 1.0 / (ranks + 2.7)
        self.probabilities = weights / weights.sum()
        self.num_words = num_words

    def _make_lexicon(self, size: int) -> list[str]:
        rng = self.rng
        words: dict[str, None] = {}
        while len(words) < size:
            n = 1 + int(rng.choice(4, p=self._SYLLABLE_COUNT_PROBABILITIES))
            parts = []
            for _ in range(n):
                parts.append(self._ONSETS[rng.integers(len(self._ONSETS))])
                parts.append(self._NUCLEI[rng.integers(len(self._NUCLEI))])
                parts.append(self._CODAS[rng.integers(len(self._CODAS))])
            words.setdefault("".join(parts))
        return list(words)

    def paragraphs(self) -> Iterator[str]:
        """The corpus, one paragraph (a few sentences) at a time."""
        rng = self.rng
        picks = rng.choice(len(self.lexicon), size=self.num_words, p=self.probabilities)
        position = 0
        while position < self.num_words:
            sentences = []
            for _ in range(int(rng.integers(1, 6))):
                length = int(rng.integers(4, 18))
                words = [self.lexicon[j] for j in picks[position : position + length]]
                position += length
                if not words:
                    break
                words[0] = words[0].capitalize()
                if rng.random() < 0.15:
                    words.insert(int(rng.integers(len(words) + 1)), str(rng.integers(0, 10_000)))
                if len(words) > 3 and rng.random() < 0.3:
                    k = int(rng.integers(1, len(words) - 1))
                    words[k] += self._CLAUSE_MARKS[rng.integers(len(self._CLAUSE_MARKS))]
                sentences.append(
                    " ".join(words) + self._SENTENCE_ENDS[rng.integers(len(self._SENTENCE_ENDS))]
                )
            yield " ".join(sentences) + "\n"


def train_tokenizer(vocab_size: int, seed: int) -> Tokenizer:
    """A byte-level BPE tokenizer of exactly ``vocab_size`` ids, ChatML specials first.

    Laid out like Qwen2's ``tokenizer.json``: NFC normalizer, the Qwen split pattern then
    byte-level mapping, byte-level decoder, and a post-processor that adds no special tokens
    (so ``add_special_tokens=True`` adds nothing, as with Qwen).
    """
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(CHATML_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # A lexicon several times the vocabulary, and enough words that most of it occurs at
    # least twice, leave BPE more candidate merges than it needs to fill the vocabulary.
    corpus = PseudoTextCorpus(seed, lexicon_size=4 * vocab_size, num_words=60 * vocab_size)
    tokenizer.train_from_iterator(corpus.paragraphs(), trainer)
    if tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(
            f"tokenizer training stopped at {tokenizer.get_vocab_size()} ids, not {vocab_size}: "
            "the generated corpus has too few distinct merges"
        )
    return tokenizer


def tokenizer_config(max_length: int) -> dict:
    """``tokenizer_config.json`` in Qwen's layout, as a plain fast tokenizer.

    ``PreTrainedTokenizerFast`` makes ``transformers`` use ``tokenizer.json`` exactly as
    written (a model-specific class could rebuild parts of it); vLLM loads it the same way.
    """
    added = {
        str(i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(CHATML_SPECIAL_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in CHATML_SPECIAL_TOKENS if t != ENDOFTEXT],
        "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": max_length,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_tiny_model(
    directory: str | Path,
    seed: int = 0,
    config: TinyModelConfig | None = None,
    force: bool = False,
) -> list[Path]:
    """Write the tiny model into ``directory`` (created if needed).

    Args:
        directory: where to write.
        seed: the randomness of the tokenizer corpus and of the weights.
        config: the model's shape (default :class:`TinyModelConfig`).
        force: write into a non-empty directory, replacing the files of :data:`MODEL_FILES`.

    Returns:
        The paths written, in the order of :data:`MODEL_FILES`.

    Raises:
        UserError: when ``directory`` is a file, is not empty (without ``force``), or the
            configuration is impossible.
    """
    config = config or TinyModelConfig()
    path = Path(directory)
    if config.vocab_size < MIN_VOCAB_SIZE:
        raise UserError(f"vocab size must be at least {MIN_VOCAB_SIZE}, got {config.vocab_size}")
    if config.num_attention_heads % config.num_key_value_heads:
        raise UserError("attention heads must be a multiple of KV heads")
    if seed < 0:
        raise UserError(f"seed must be non-negative, got {seed}")
    if path.exists() and not path.is_dir():
        raise UserError(f"{str(path)!r} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not force:
        raise UserError(f"{str(path)!r} is not empty; pass --force to overwrite the model files")
    path.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer(config.vocab_size, seed)
    endoftext = tokenizer.token_to_id(ENDOFTEXT)
    im_end = tokenizer.token_to_id(IM_END)

    written = [path / name for name in MODEL_FILES]
    _write_json(written[0], config.hf_config(bos_token_id=endoftext, eos_token_id=im_end))
    _write_json(
        written[1],
        {"bos_token_id": endoftext, "eos_token_id": [im_end, endoftext], "pad_token_id": endoftext},
    )
    write_bf16_safetensors(written[2], random_weights(config, seed), metadata={"format": "pt"})
    tokenizer.save(str(written[3]), pretty=True)
    _write_json(written[4], tokenizer_config(config.max_position_embeddings))
    return written


#: The files of a LoRA adapter in PEFT's layout (what ``vllm serve --lora-modules NAME=DIR`` reads).
LORA_FILES = ("adapter_config.json", "adapter_model.safetensors")

#: The projections the tiny adapters adapt, and their rank (vLLM's ``--max-lora-rank``
#: defaults to 16).
LORA_TARGETS = ("q_proj", "v_proj")
LORA_RANK = 8


def lora_weight_shapes(config: TinyModelConfig, rank: int = LORA_RANK) -> dict[str, tuple[int, ...]]:
    """Every tensor of a LoRA adapter of ``config`` in PEFT's naming: for each adapted
    projection of shape ``[out, in]``, ``lora_A`` ``[rank, in]`` and ``lora_B`` ``[out, rank]``."""
    base = config.weight_shapes()
    shapes: dict[str, tuple[int, ...]] = {}
    for layer in range(config.num_hidden_layers):
        for target in LORA_TARGETS:
            name = f"model.layers.{layer}.self_attn.{target}"
            out, inp = base[f"{name}.weight"]
            shapes[f"base_model.model.{name}.lora_A.weight"] = (rank, inp)
            shapes[f"base_model.model.{name}.lora_B.weight"] = (out, rank)
    return shapes


def build_tiny_lora(
    directory: str | Path, base_model: str, seed: int, index: int = 0,
    config: TinyModelConfig | None = None,
) -> list[Path]:
    """Write a LoRA adapter for the tiny model into ``directory`` (created; must be empty or
    absent): PEFT's ``adapter_config.json`` and random bf16 ``lora_A``/``lora_B`` weights
    (normal, the model's initializer range; PEFT starts ``lora_B`` at zero, but an adapter that
    changes nothing would not tell adapters apart). ``base_model`` is recorded as
    ``base_model_name_or_path``. The weights depend on ``seed`` and ``index`` (the adapter's
    number) only. Returns the paths written, in :data:`LORA_FILES` order."""
    config = config or TinyModelConfig()
    path = Path(directory)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise UserError(f"{str(path)!r} exists and is not an empty directory")
    path.mkdir(parents=True, exist_ok=True)
    written = [path / name for name in LORA_FILES]
    _write_json(written[0], {
        "base_model_name_or_path": base_model,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "lora_alpha": 2 * LORA_RANK,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": LORA_RANK,
        "target_modules": list(LORA_TARGETS),
        "task_type": "CAUSAL_LM",
    })
    rng = np.random.default_rng([seed, 2, index])
    weights = {
        name: rng.standard_normal(shape, dtype=np.float32) * np.float32(config.initializer_range)
        for name, shape in lora_weight_shapes(config).items()
    }
    write_bf16_safetensors(written[1], weights, metadata={"format": "pt"})
    return written


def parameter_count(config: TinyModelConfig) -> int:
    """Number of weights in the checkpoint (tied embeddings counted once)."""
    return sum(math.prod(shape) for shape in config.weight_shapes().values())
