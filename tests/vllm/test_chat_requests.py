"""The router renders a chat body as a real vLLM does (the ``vllm`` tier).

``ChatTemplate.render_request`` is the text ``kvroute serve`` tokenizes and hashes for a
``/v1/chat/completions`` body (``kvroute_serve::chat``). For random bodies with tools, tool
calls (arguments valid JSON, not JSON, not an object, empty), reasoning, tool and developer
messages, names, content-part lists with empty parts and Claude Code's billing header, it must
give the token ids vLLM's own ``/tokenize`` gives for the same body, on the plain server (which
runs with ``--trust-request-chat-template``, so the body can name the template): a template that
writes the whole context out as JSON, and three that render tools and tool calls as models do.
A body vLLM refuses needs no match (the worker answers 400 whatever the router hashed).
"""

from __future__ import annotations

import json
import random

import aiohttp
import pytest
from support.chat_templates import LLAMA3_STYLE, QWEN3_STYLE, TOOL_CALLS_STYLE

from kvroute._native import ChatTemplate
from kvroute.tokens import load_tokenizer

pytestmark = pytest.mark.vllm

#: Every key of the context the template sees, in order.
CONTEXT_AS_JSON = "{{ messages | tojson }}\n{{ tools | tojson }}\n{{ add_generation_prompt }}"
TEMPLATES = {"context": CONTEXT_AS_JSON, "tool-calls-style": TOOL_CALLS_STYLE, "qwen3-style": QWEN3_STYLE,
             "llama3-style": LLAMA3_STYLE}
BODIES = 120

_PIECES = ["", " ", "\n", "héllo", "<think>a</think>b", "x-anthropic-billing-header: v\nrest",
           "x-anthropic-billing-header: v", '{"a": 1}', "tool", "'q'"]
_ARGUMENTS = ["", "{}", '{"x": 1, "b": [1, 2.5, null]}', "not json", "[1]", '{"u": "é"}']


def _shuffled(rng: random.Random, d: dict) -> dict:
    items = list(d.items())
    rng.shuffle(items)
    return dict(items)


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 3)))


def _content(rng: random.Random, role: str) -> str | list | None:
    r = rng.random()
    if r < 0.15 and role == "assistant":
        return None
    if r < 0.6:
        return _text(rng)
    return [{"type": "text", "text": _text(rng)} for _ in range(rng.randint(0, 3))]


def _tool_call(rng: random.Random, i: int) -> dict:
    call = {"id": f"c{i}", "type": "function",
            "function": {"name": rng.choice("fg"), "arguments": rng.choice(_ARGUMENTS)}}
    if rng.random() < 0.2:
        call["index"] = i
    return _shuffled(rng, call)


def _message(rng: random.Random) -> dict:
    role = rng.choice(["system", "user", "assistant", "tool", "developer", "user", "assistant"])
    m: dict = {"role": role, "content": _content(rng, role)}
    if role == "assistant":
        if rng.random() < 0.5:
            m["tool_calls"] = [_tool_call(rng, i) for i in range(rng.randint(0, 2))]
        if rng.random() < 0.3:
            m["reasoning"] = _text(rng)
        if rng.random() < 0.2:
            m["reasoning_content"] = _text(rng)
    if role == "tool" and rng.random() < 0.7:
        m["tool_call_id"] = "c0"
    if rng.random() < 0.2:
        m["name"] = "n"
    if rng.random() < 0.1:
        m["extra"] = 1
    return _shuffled(rng, m)


def _tool(rng: random.Random) -> dict:
    function: dict = {"name": rng.choice("fg")}
    if rng.random() < 0.5:
        function["description"] = _text(rng)
    if rng.random() < 0.5:
        function["parameters"] = {"type": "object", "properties": {"x": {"type": "integer"}}}
    if rng.random() < 0.2:
        function["strict"] = rng.choice([True, False, None])
    tool = {"type": "function", "function": function}
    if rng.random() < 0.1:
        tool["defer_loading"] = rng.choice([True, False])
    return tool


def random_body(rng: random.Random) -> dict:
    body: dict = {"messages": [_message(rng) for _ in range(rng.randint(1, 5))]}
    if rng.random() < 0.6:
        body["tools"] = [_tool(rng) for _ in range(rng.randint(0, 2))]
    if rng.random() < 0.3:
        body["add_generation_prompt"] = False
    return body


async def test_router_renders_chat_bodies_as_vllm_does(vllm_fleet):
    tokenizer = load_tokenizer(str(vllm_fleet.install.model_dir))
    compiled = {name: ChatTemplate(source) for name, source in TEMPLATES.items()}
    rng = random.Random(20261204)
    matched = refused = 0
    with_tools = with_calls = 0
    async with aiohttp.ClientSession() as session:
        for _ in range(BODIES):
            body = random_body(rng)
            for name, source in TEMPLATES.items():
                request = {**body, "model": vllm_fleet.model, "chat_template": source}
                async with session.post(f"{vllm_fleet.plain.url}/tokenize", json=request) as r:
                    answer = await r.json()
                if r.status == 400:
                    refused += 1
                    continue
                assert r.status == 200, answer
                ours = compiled[name].render_request(json.dumps(body))
                assert ours is not None, f"{name}: vLLM rendered what the router would not: {body}"
                assert tokenizer.encode(ours, add_special_tokens=False) == answer["tokens"], (
                    f"{name}: {json.dumps(body)}\nrouter: {ours!r}"
                )
                matched += 1
                with_tools += bool(body.get("tools"))
                with_calls += any(m.get("tool_calls") for m in body["messages"])
    print(f"\nchat bodies rendered as vLLM renders them: {matched} (with tools {with_tools}, with "
          f"tool calls {with_calls}); {refused} refused by vLLM")
    assert matched >= BODIES and with_tools >= BODIES // 4 and with_calls >= BODIES // 8
