"""The router hashes prompts as the engine's tokenizer sees them (or, without one, as kvroute's
synthetic tokenizer does): text completions encoded with special tokens, and chats rendered
with the tokenizer's chat template (content parts joined, template kwargs) and encoded
without, as vLLM (and the emulator) do. Each request's routing records its blocks in the
index as predicted entries, which is what this reads."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from support.chat_templates import TOOL_CALLS_STYLE
from support.jinja_reference import compile_reference

from kvroute.blocks import DEFAULT_HASH_SEED, BlockHasher
from kvroute.emulator import EmulatorConfig, start_workers
from kvroute.router import RouterConfig, start_router
from kvroute.tokens import HFTokenizer, Tokenizer, flatten_message_content, load_tokenizer

BS = 16
SYSTEM = "You are a careful assistant. " * 12 + "Réponds en français, s'il te plaît: naïve café."
USER = "Summarise the following notes in three bullet points. " * 6 + "数据 and émojis 🙂 too."
BODIES = [
    ("/v1/completions", {"prompt": SYSTEM + " " + USER}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]}),
    ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": [{"type": "text", "text": SYSTEM}, {"type": "text", "text": USER}]}],
        "add_generation_prompt": False,
    }),
    ("/v1/chat/completions", {
        "messages": [{"role": "system", "content": None}, {"role": "user", "content": USER}],
        "chat_template_kwargs": {"enable_thinking": False},
    }),
]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from kvroute.tinymodel import build_tiny_model

    path = tmp_path_factory.mktemp("tiny")
    build_tiny_model(str(path))
    return path


async def _worker() -> tuple[web.AppRunner, str]:
    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"id": "x", "choices": []})

    app = web.Application(client_max_size=2**24)
    app.router.add_post("/v1/completions", answer)
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def _engine_block_hashes(tokenizer: Tokenizer, path: str, body: dict) -> list[int]:
    """The block hashes of the tokens the engine computes for ``body``."""
    if "chat" in path:
        # kvroute's synthetic tokenizer renders ChatML, which reads no template kwargs.
        kwargs = body.get("chat_template_kwargs", {}) if isinstance(tokenizer, HFTokenizer) else {}
        # A null content renders as empty text, content parts joined by newlines.
        messages = flatten_message_content([{**m, "content": m["content"] or ""} for m in body["messages"]])
        text = tokenizer.apply_chat_template(messages, body.get("add_generation_prompt", True), **kwargs)
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = tokenizer.encode(body["prompt"])
    return BlockHasher(BS, DEFAULT_HASH_SEED).hash_blocks(ids)


async def _routes_as(tokenizer: Tokenizer, config_for, bodies) -> None:
    """Send each body through a router made by ``config_for(url)``; each must have recorded
    exactly the block hashes of the engine's tokens for it."""
    runner, url = await _worker()
    try:
        async with start_router(config_for(url)) as router, aiohttp.ClientSession() as s:
            for path, body in bodies:
                expected = _engine_block_hashes(tokenizer, path, body)
                assert len(expected) >= 4, path
                async with s.post(router.url + path, json=body) as r:
                    assert r.status == 200
                held = router.index.overlaps(expected, [url], time.monotonic())[0]
                assert held == len(expected), (path, body)
    finally:
        await runner.cleanup()


async def test_text_and_chat_prompts_hash_as_the_engine_tokenizes_them(tiny_model_dir):
    await _routes_as(load_tokenizer(str(tiny_model_dir)), lambda url: RouterConfig(
        workers=[url], tokenizer=str(tiny_model_dir), block_size=BS, health_interval_s=0, predicted_ttl_s=600.0,
    ), BODIES)


async def test_without_a_tokenizer_prompts_hash_as_the_synthetic_tokenizer_does():
    """What emulated workers started without a tokenizer tokenize with (kvroute's built-in
    synthetic tokenizer): pseudo-words, other words, punctuation, ChatML chats."""
    tokenizer = load_tokenizer(None)
    words = tokenizer.decode(list(range(3, 3 + 120)))
    bodies = [("/v1/completions", {"prompt": words + " plus, some real words_2 and 数据!"}),
              *((path, body) for path, body in BODIES if "chat" in path)]
    await _routes_as(tokenizer, lambda url: RouterConfig(
        workers=[url], block_size=BS, health_interval_s=0, predicted_ttl_s=600.0,
    ), bodies)


def _with_chat_template(model_dir: Path, copy: Path, template: Callable[[str], str | list[dict]]) -> Path:
    """A copy of ``model_dir`` whose ``tokenizer_config.json`` has ``template(its own
    chat_template)`` as its chat template (a string, or a list of named templates)."""
    shutil.copytree(model_dir, copy)
    config_file = copy / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = template(config["chat_template"])
    config_file.write_text(json.dumps(config))
    return copy


async def test_a_chat_with_tools_hashes_as_vllm_renders_it(tiny_model_dir, tmp_path):
    """A tokenizer whose templates are named (``default``, and ``tool_use`` for requests with
    tools, as transformers picks them): the router renders a chat with tools and tool calls as
    vLLM does, its conversation built here by hand and rendered by jinja2 (tool call arguments
    parsed from their JSON string, keys in pydantic's order, the client's extra keys dropped)."""
    model = _with_chat_template(tiny_model_dir, tmp_path / "named-templates", lambda default: [
        {"name": "default", "template": default}, {"name": "tool_use", "template": TOOL_CALLS_STYLE}])
    tokenizer = load_tokenizer(str(model))
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Find a note",
                                               "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
    call = {"type": "function", "function": {"name": "lookup", "arguments": '{"q": "café", "n": 3}'}, "id": "call-1"}
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER, "extra": 1},
                         {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "content": "note 1: " + USER, "tool_call_id": "call-1"}],
            "tools": tools}
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "call-1", "function": {"arguments": {"q": "café", "n": 3}, "name": "lookup"},
                         "type": "function"}]},
                    {"role": "tool", "content": "note 1: " + USER, "tool_call_id": "call-1"}]
    dumped = [{"type": "function", "function": {**tools[0]["function"]}}]
    text = compile_reference(TOOL_CALLS_STYLE).render(messages=conversation, tools=dumped, documents=None,
                                                 add_generation_prompt=True)
    assert "<tools>" in text and "\"arguments\": {\"q\": \"café\", \"n\": 3}" in text, text
    expected = BlockHasher(BS, DEFAULT_HASH_SEED).hash_blocks(tokenizer.encode(text, add_special_tokens=False))
    runner, url = await _worker()
    try:
        config = RouterConfig(workers=[url], tokenizer=str(model), block_size=BS, health_interval_s=0,
                              predicted_ttl_s=600.0)
        async with start_router(config) as router, aiohttp.ClientSession() as s:
            async with s.post(router.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
            assert router.index.overlaps(expected, [url], time.monotonic())[0] == len(expected)
    finally:
        await runner.cleanup()


async def test_a_tool_conversation_hits_its_own_blocks_on_emulated_workers(tiny_model_dir, tmp_path):
    """End to end, the router and emulated workers with the same tool-use tokenizer: each
    turn of a tool conversation goes to the worker that served the one before and finds it
    cached there, the tool call and its parsed arguments included: both render the chat as
    vLLM does, so the blocks the router predicts are those the worker stored."""
    model = _with_chat_template(tiny_model_dir, tmp_path / "tool-use", lambda _default: TOOL_CALLS_STYLE)
    tokenizer = load_tokenizer(str(model))
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    turn = {"messages": first, "tools": tools, "max_tokens": 1}
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "notes"}'}}]}
    answer = {"role": "tool", "content": "three notes", "tool_call_id": "c1"}
    second = {"messages": [*first, call, answer], "tools": tools, "max_tokens": 1}
    workers = await start_workers(EmulatorConfig.for_model(
        "qwen3-0.6b", timing="instant", max_model_len=4096, tokenizer=str(model),
        enable_prompt_tokens_details=True), 3)
    try:
        router_config = RouterConfig(workers=[w.url for w in workers], tokenizer=str(model), block_size=BS,
                                     health_interval_s=0, predicted_ttl_s=600.0)
        async with start_router(router_config) as router, aiohttp.ClientSession() as s:
            async def send(body: dict) -> dict:
                async with s.post(router.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    return await r.json()

            await send(turn)
            await send(second)
            third = {**second, "messages": [*second["messages"], {"role": "assistant", "content": "Done."},
                                             {"role": "user", "content": "Thanks; and the fourth?"}]}
            got = await send(third)
        text = tokenizer.render_chat_request(second)
        assert "<tools>" in text and '"arguments": {"q": "notes"}' in text
        # The third prompt extends the second: the full blocks they share (as vLLM renders
        # them, the tool call included) were cached where the router sent it, and only those.
        second_ids = tokenizer.encode(text, add_special_tokens=False)
        third_ids = tokenizer.encode(tokenizer.render_chat_request(third), add_special_tokens=False)
        shared = next((i for i, (a, b) in enumerate(zip(second_ids, third_ids, strict=False)) if a != b),
                      min(len(second_ids), len(third_ids)))
        assert shared > len(tokenizer.encode(tokenizer.render_chat_request(turn), add_special_tokens=False))
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == shared // BS * BS
    finally:
        await asyncio.gather(*(w.close() for w in workers))
