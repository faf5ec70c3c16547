"""The router's prompt hashing is exact: segment-cached tokenization of chat prompts equals
tokenizing the rendered template whole, for a real BPE tokenizer and the synthetic one."""

from __future__ import annotations

import json

import pytest

from kvroute.blocks import BlockHasher
from kvroute.proxy.prompts import BadRequest, PromptHasher
from kvroute.tinymodel import TinyModelConfig, tokenizer_config, train_tokenizer
from kvroute.tokens import HFTokenizer, SyntheticTokenizer, flatten_message_content

BS = 16


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory) -> HFTokenizer:
    """The tiny model's byte-level BPE tokenizer and ChatML template (no weights needed)."""
    directory = tmp_path_factory.mktemp("tiny")
    config = TinyModelConfig()
    train_tokenizer(config.vocab_size, seed=0).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(config.max_position_embeddings)))
    return HFTokenizer.from_dir(directory)


@pytest.fixture(params=["hf", "synthetic"])
def tokenizer(request, hf_tokenizer):
    return hf_tokenizer if request.param == "hf" else SyntheticTokenizer()


def words(n: int, start: int) -> str:
    return " ".join(f"w{(start + i) % 97}x{i % 7}" for i in range(n))


CONVERSATIONS = [
    [{"role": "system", "content": words(300, 0)}, {"role": "user", "content": words(40, 5)}],
    [{"role": "system", "content": words(300, 0)}, {"role": "user", "content": words(41, 9)}],
    [
        {"role": "system", "content": words(300, 0)},
        {"role": "user", "content": words(40, 5)},
        {"role": "assistant", "content": "Sure, here it is."},
        {"role": "user", "content": [{"type": "text", "text": "and"}, {"type": "text", "text": words(30, 2)}]},
    ],
]


def test_chat_hashes_equal_whole_template_tokenization(tokenizer):
    hasher = BlockHasher(BS)
    prompts = PromptHasher(tokenizer, hasher)
    for messages in CONVERSATIONS * 2:  # the second pass runs entirely from the caches
        info = prompts.chat({"messages": messages})
        text = tokenizer.apply_chat_template(flatten_message_content(messages), add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert info.num_tokens == len(ids)
        assert info.block_hashes == hasher.hash_blocks(ids)
        assert len(info.block_hashes) >= 10


def test_shared_system_prompt_is_tokenized_once(tokenizer):
    prompts = PromptHasher(tokenizer, BlockHasher(BS))
    prompts.chat({"messages": CONVERSATIONS[0]})
    before = len(prompts._segments)
    prompts.chat({"messages": CONVERSATIONS[1]})
    # Only the new user message was a new piece of text.
    assert len(prompts._segments) == before + 1


def test_add_generation_prompt_false_is_honoured(tokenizer):
    prompts = PromptHasher(tokenizer, BlockHasher(BS))
    with_prompt = prompts.chat({"messages": CONVERSATIONS[0]})
    without = prompts.chat({"messages": CONVERSATIONS[0], "add_generation_prompt": False})
    assert without.num_tokens < with_prompt.num_tokens


def test_text_completion_matches_the_engine_encoding(tokenizer):
    hasher = BlockHasher(BS)
    prompts = PromptHasher(tokenizer, hasher)
    text = words(200, 3)
    ids = tokenizer.encode(text, add_special_tokens=True)
    for body in ({"prompt": text}, {"prompt": [text]}):
        info = prompts.completion(body)
        assert (info.num_tokens, info.block_hashes) == (len(ids), hasher.hash_blocks(ids))


def test_token_id_prompts_are_hashed_as_given():
    hasher = BlockHasher(BS)
    prompts = PromptHasher(SyntheticTokenizer(), hasher)
    ids = list(range(10, 90))
    assert prompts.completion({"prompt": ids}).block_hashes == hasher.hash_blocks(ids)
    assert prompts.completion({"prompt": [ids, [1, 2]]}).num_tokens == 80  # a batch: the first


@pytest.mark.parametrize(
    "body",
    [{}, {"prompt": 3}, {"prompt": []}, {"prompt": [1, "a"]}, {"prompt": [-5]}, {"prompt": [2**40]},
     {"prompt": [1.5, 2]}, {"prompt": [2**70]}],
)
def test_unroutable_completion_prompts_are_bad_requests(body):
    with pytest.raises(BadRequest):
        PromptHasher(SyntheticTokenizer(), BlockHasher(BS)).completion(body)


@pytest.mark.parametrize("messages", [None, [], "hi", [{"content": "no role"}], ["text"]])
def test_malformed_messages_are_bad_requests(messages):
    with pytest.raises(BadRequest):
        PromptHasher(SyntheticTokenizer(), BlockHasher(BS)).chat({"messages": messages})


def test_content_the_router_cannot_render_routes_without_a_match():
    prompts = PromptHasher(SyntheticTokenizer(), BlockHasher(BS))
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    info = prompts.chat({"messages": image})
    assert (info.num_tokens, info.block_hashes) == (0, [])


def test_caches_are_bounded():
    prompts = PromptHasher(SyntheticTokenizer(), BlockHasher(BS), segment_cache_entries=8, prefix_cache_entries=4)
    for i in range(50):
        prompts.chat({"messages": [{"role": "system", "content": words(20, i)}, {"role": "user", "content": words(5, i)}]})
        prompts.completion({"prompt": words(30, i)})
    assert len(prompts._segments) <= 8
    assert len(prompts._prefixes) <= 4
