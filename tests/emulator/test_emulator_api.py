"""The emulator's OpenAI-compatible API, exercised with the official ``openai`` client.

The tests talk to a server only through HTTP and read what they need to know about it from the
``engine_server`` fixture (base URL, model name, block size, flags), so the same functions run
against a real vLLM server too: the server fixtures are parameterized over the engine,
``emulator`` and ``vllm`` (the real-engine tier's shared fleet, see conftest.py; marked
``vllm``, so only ``pytest -m vllm`` runs it). Tests that need the emulator's internals or
emulator-only behaviour say so in their name (``test_emulator_...``) and run on the emulator
only.

Prompts are token ids drawn at random from a range valid in every vocabulary kvroute uses
(the built-in tokenizer's 32,000 and the tiny CPU model's 8,192), with a fresh random prefix
per test so no test depends on what an earlier one left in the cache.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import numpy as np
import openai
import pytest

from kvroute.emulator import EmulatorConfig, start_workers

MAX_MODEL_LEN = 1024


@dataclass
class EngineServer:
    """A running server and what the tests may assume about it."""

    base_url: str  # http://host:port (no /v1)
    model: str
    block_size: int
    max_model_len: int
    prompt_tokens_details: bool

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="x", max_retries=0)


async def _emulator(details: bool, **overrides) -> AsyncIterator[EngineServer]:
    settings = dict(
        served_model_name=("test-model", "alias-model"),
        max_model_len=MAX_MODEL_LEN,
        timing="instant",
        enable_prompt_tokens_details=details,
    )
    config = EmulatorConfig.for_model("qwen3-0.6b", **{**settings, **overrides})
    (worker,) = await start_workers(config, 1)
    try:
        yield EngineServer(worker.url, "test-model", config.block_size, MAX_MODEL_LEN, details)
    finally:
        await worker.close()


ENGINES = ["emulator", pytest.param("vllm", marks=pytest.mark.vllm)]


def _real_vllm(request: pytest.FixtureRequest, details: bool) -> EngineServer:
    if request.node.name.startswith("test_emulator_"):
        pytest.skip("emulator-only behaviour")
    real = request.getfixturevalue("vllm_fleet")
    url = real.servers[0].url if details else real.plain.url
    return EngineServer(url, real.model, real.block_size, real.max_model_len, details)


@pytest.fixture(params=ENGINES)
async def engine_server(request: pytest.FixtureRequest) -> AsyncIterator[EngineServer]:
    """A server started with ``--enable-prompt-tokens-details``."""
    if request.param == "vllm":
        yield _real_vllm(request, details=True)
        return
    async for server in _emulator(details=True):
        yield server


@pytest.fixture(params=ENGINES)
async def plain_engine_server(request: pytest.FixtureRequest) -> AsyncIterator[EngineServer]:
    """A server started without ``--enable-prompt-tokens-details``."""
    if request.param == "vllm":
        yield _real_vllm(request, details=False)
        return
    async for server in _emulator(details=False):
        yield server


@pytest.fixture
def rng() -> np.random.Generator:
    # A different stream per test (and per run), so prefixes never collide across tests.
    return np.random.default_rng()


def random_ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(1000, 8000, size=n).tolist()


# -- listing, health, tokenize -----------------------------------------------------------------


async def test_models_lists_served_names_with_max_model_len(engine_server: EngineServer):
    async with engine_server.client() as client:
        models = await client.models.list()
    ids = [m.id for m in models.data]
    assert ids[0] == engine_server.model
    assert models.data[0].owned_by == "vllm"
    assert models.data[0].model_extra["max_model_len"] == engine_server.max_model_len


async def test_health_is_200_with_empty_body(engine_server: EngineServer):
    async with aiohttp.ClientSession() as s, s.get(f"{engine_server.base_url}/health") as r:
        assert r.status == 200
        assert await r.read() == b""


async def test_tokenize_counts_the_prompt_the_completion_uses(engine_server: EngineServer):
    text = "the quick brown fox jumps over the lazy dog"
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{engine_server.base_url}/tokenize", json={"model": engine_server.model, "prompt": text}
        ) as r:
            assert r.status == 200
            tok = await r.json()
    assert tok["count"] == len(tok["tokens"]) > 0
    assert tok["max_model_len"] == engine_server.max_model_len
    async with engine_server.client() as client:
        done = await client.completions.create(model=engine_server.model, prompt=text, max_tokens=2)
    assert done.usage.prompt_tokens == tok["count"]


# -- completions --------------------------------------------------------------------------------


async def test_completion_generates_exactly_max_tokens(engine_server: EngineServer, rng):
    async with engine_server.client() as client:
        done = await client.completions.create(
            model=engine_server.model,
            prompt=random_ids(rng, 50),
            max_tokens=7,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    assert done.id.startswith("cmpl-")
    assert done.object == "text_completion"
    assert done.model == engine_server.model
    (choice,) = done.choices
    assert choice.finish_reason == "length"
    assert choice.text
    assert done.usage.prompt_tokens == 50
    assert done.usage.completion_tokens == 7
    assert done.usage.total_tokens == 57


async def test_completion_default_max_tokens_is_16(engine_server: EngineServer, rng):
    async with engine_server.client() as client:
        done = await client.completions.create(
            model=engine_server.model, prompt=random_ids(rng, 20), extra_body={"ignore_eos": True}
        )
    assert done.usage.completion_tokens == 16


async def test_completion_accepts_an_alias_name(engine_server: EngineServer, rng):
    if engine_server.model != "test-model":
        pytest.skip("the emulator fixture serves two names")
    async with engine_server.client() as client:
        done = await client.completions.create(model="alias-model", prompt=random_ids(rng, 20), max_tokens=1)
    # vLLM names the first served name in the response, whichever alias was asked for.
    assert done.model == "test-model"


async def test_completion_stream_matches_non_stream_and_reports_usage(engine_server: EngineServer, rng):
    prompt = random_ids(rng, 40)
    kwargs = dict(model=engine_server.model, prompt=prompt, max_tokens=9, temperature=0,
                  extra_body={"ignore_eos": True})
    async with engine_server.client() as client:
        whole = await client.completions.create(**kwargs)
        stream = await client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.prompt_tokens == 40
    assert usage_chunk.usage.completion_tokens == 9
    assert len({c.id for c in chunks}) == 1


async def test_stream_without_include_usage_sends_no_usage(engine_server: EngineServer, rng):
    async with engine_server.client() as client:
        stream = await client.completions.create(
            model=engine_server.model, prompt=random_ids(rng, 30), max_tokens=4, stream=True
        )
        chunks = [c async for c in stream]
    assert chunks and all(c.choices for c in chunks)
    assert all(c.usage is None for c in chunks)


async def test_stream_ends_with_done_marker(engine_server: EngineServer, rng):
    body = {"model": engine_server.model, "prompt": random_ids(rng, 30), "max_tokens": 3,
            "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{engine_server.base_url}/v1/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            raw = (await r.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    usage = json.loads(events[-2][len("data: "):])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3


async def test_second_request_with_shared_prefix_reports_cached_tokens(engine_server: EngineServer, rng):
    bs = engine_server.block_size
    prefix = random_ids(rng, 3 * bs)
    async with engine_server.client() as client:
        first = await client.completions.create(
            model=engine_server.model, prompt=prefix + random_ids(rng, 10), max_tokens=2
        )
        second = await client.completions.create(
            model=engine_server.model, prompt=prefix + random_ids(rng, 10), max_tokens=2
        )
    # vLLM leaves prompt_tokens_details out when nothing was cached.
    details = first.usage.prompt_tokens_details
    assert details is None or not details.cached_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == 3 * bs


async def test_streamed_usage_reports_cached_tokens(engine_server: EngineServer, rng):
    bs = engine_server.block_size
    prefix = random_ids(rng, 2 * bs)
    async with engine_server.client() as client:
        await client.completions.create(model=engine_server.model, prompt=prefix + [7], max_tokens=1)
        stream = await client.completions.create(
            model=engine_server.model, prompt=prefix + [9, 9], max_tokens=2, stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 2 * bs


async def test_fully_cached_prompt_still_recomputes_its_last_block(engine_server: EngineServer, rng):
    bs = engine_server.block_size
    prompt = random_ids(rng, 4 * bs)
    async with engine_server.client() as client:
        for _ in range(2):
            done = await client.completions.create(model=engine_server.model, prompt=prompt, max_tokens=1)
    # At most num_tokens - 1 tokens can hit, and only whole blocks: 3 of the 4.
    assert done.usage.prompt_tokens_details.cached_tokens == 3 * bs


async def test_cached_tokens_absent_without_the_flag(plain_engine_server: EngineServer, rng):
    server = plain_engine_server
    prefix = random_ids(rng, 3 * server.block_size)
    async with server.client() as client:
        for _ in range(2):
            done = await client.completions.create(model=server.model, prompt=prefix + [5], max_tokens=1)
        stream = await client.completions.create(
            model=server.model, prompt=prefix + [6], max_tokens=1, stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
    assert done.usage.prompt_tokens_details is None
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens_details is None


# -- chat -------------------------------------------------------------------------------------


def _chat(rng, system_words: int) -> tuple[list[dict], list[dict]]:
    system = " ".join(f"w{int(x)}" for x in rng.integers(0, 10**6, size=system_words))
    return (
        [{"role": "system", "content": system}, {"role": "user", "content": "first question"}],
        [{"role": "system", "content": system}, {"role": "user", "content": "another one"}],
    )


async def test_chat_completion_non_stream(engine_server: EngineServer, rng):
    messages, _ = _chat(rng, 20)
    async with engine_server.client() as client:
        done = await client.chat.completions.create(
            model=engine_server.model, messages=messages, max_tokens=5
        )
    assert done.id.startswith("chatcmpl-")
    assert done.object == "chat.completion"
    (choice,) = done.choices
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert done.usage.completion_tokens == 5


async def test_chat_stream_starts_with_role_and_matches_non_stream(engine_server: EngineServer, rng):
    messages, _ = _chat(rng, 20)
    kwargs = dict(model=engine_server.model, messages=messages, max_tokens=6, temperature=0,
                  extra_body={"ignore_eos": True})
    async with engine_server.client() as client:
        whole = await client.chat.completions.create(**kwargs)
        stream = await client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


async def _tokens_per_word(server: EngineServer, text: str) -> float:
    """How many tokens the server's tokenizer makes of a word of ``text``: the emulator's and
    the tiny CPU model's tokenizers split ``w123456`` very differently."""
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{server.base_url}/tokenize", json={"model": server.model, "prompt": text}) as r:
            assert r.status == 200
            return (await r.json())["count"] / len(text.split())


async def test_chat_shared_system_prompt_is_cached(engine_server: EngineServer, rng):
    probe, _ = _chat(rng, 50)
    rate = await _tokens_per_word(engine_server, probe[0]["content"])
    # A system message of about 8 blocks.
    first, second = _chat(rng, int(8 * engine_server.block_size / rate))
    async with engine_server.client() as client:
        a = await client.chat.completions.create(model=engine_server.model, messages=first, max_tokens=1)
        b = await client.chat.completions.create(model=engine_server.model, messages=second, max_tokens=1)
    cached = b.usage.prompt_tokens_details.cached_tokens
    assert cached % engine_server.block_size == 0
    # The system message is most of the prompt, so all but the last block or two hit.
    assert a.usage.prompt_tokens - 2 * engine_server.block_size <= cached < b.usage.prompt_tokens


async def test_chat_default_max_tokens_fills_the_context(engine_server: EngineServer, rng):
    messages, _ = _chat(rng, 10)
    async with engine_server.client() as client:
        done = await client.chat.completions.create(
            model=engine_server.model, messages=messages, extra_body={"ignore_eos": True}
        )
    assert done.usage.total_tokens == engine_server.max_model_len


# -- errors -------------------------------------------------------------------------------------


async def _post_raw(server: EngineServer, path: str, data: bytes, content_type="application/json"):
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{server.base_url}{path}", data=data,
                          headers={"Content-Type": content_type}) as r:
            return r.status, await r.json()


def _assert_error_object(body: dict, status: int) -> None:
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert error["code"] == status
    assert "param" in error


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
async def test_malformed_json_is_400(engine_server: EngineServer, path):
    status, body = await _post_raw(engine_server, path, b'{"model": "x", "prompt": ')
    assert status == 400
    _assert_error_object(body, 400)


async def _raw_http(server: EngineServer, request: bytes) -> bytes:
    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


def _raw_post(path: bytes, body: bytes, headers: bytes = b"") -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\n" + headers + b"Content-Length: %d\r\n\r\n" % len(body) + body)


@pytest.mark.parametrize(
    "path, body",
    [
        (b"/v1/completions", b'{"model": "test-model", "prompt": [1180591620717411303424], "max_tokens": 1}'),
        (b"/v1/completions", b'{"model": "test-model", "prompt": [[5, -1180591620717411303424]]}'),
        (b"/v1/completions", b'{"model": "test-model", "prompt": "\\ud800", "max_tokens": 1}'),
        (b"/v1/completions", b'{"model": "test-model", "prompt": "hi \xed\xa0\x80", "max_tokens": 1}'),
        (b"/v1/chat/completions", b'{"model": "test-model", "messages": [{"role": "user", "content": "\\udfff"}]}'),
        (b"/tokenize", b'{"model": "test-model", "prompt": "\\ud800"}'),
    ],
    ids=["token-id-2**70", "nested-token-id", "lone-surrogate-escape", "surrogate-bytes", "chat-surrogate",
         "tokenize-surrogate"],
)
async def test_emulator_answers_hostile_values_with_a_quiet_400(engine_server: EngineServer, path, body, caplog):
    reply = await _raw_http(engine_server, _raw_post(path, body))
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    _assert_error_object(json.loads(reply.split(b"\r\n\r\n", 1)[1]), 400)
    assert not [r for r in caplog.records if r.levelno >= 40], [r.getMessage() for r in caplog.records]


async def test_emulator_keeps_valid_escaped_text_and_ignores_odd_expect_headers(engine_server: EngineServer, caplog):
    # A surrogate *pair* is one valid character (what ensure_ascii JSON sends for an emoji).
    reply = await _raw_http(engine_server, _raw_post(
        b"/v1/completions", b'{"model": "test-model", "prompt": "hi \\ud83d\\ude00", "max_tokens": 1}'))
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    # A non-ASCII Expect is ignored as uvicorn does (aiohttp's own handler failed with a 500).
    for expect in (b"\xff", b"100-continue\xe9"):
        reply = await _raw_http(engine_server, _raw_post(
            b"/v1/completions", b'{"model": "test-model", "prompt": "hi", "max_tokens": 1}', b"Expect: " + expect + b"\r\n"))
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    assert not [r for r in caplog.records if r.levelno >= 40]


@pytest.mark.parametrize("request_bytes", [b"GARBAGE\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nContent-Length: x\r\n\r\n",
                                           b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"])
async def test_emulator_logs_no_traceback_for_malformed_http(engine_server: EngineServer, request_bytes, caplog):
    reply = await _raw_http(engine_server, request_bytes)
    assert reply.startswith(b"HTTP/1.") and b" 400 " in reply.split(b"\r\n")[0], reply[:200]
    assert not [r for r in caplog.records if r.name == "aiohttp.server" and r.levelno >= 30]


async def test_non_object_json_is_400(engine_server: EngineServer):
    status, body = await _post_raw(engine_server, "/v1/completions", b"[1, 2, 3]")
    assert status == 400
    _assert_error_object(body, 400)


async def test_wrong_content_type_is_400(engine_server: EngineServer):
    status, body = await _post_raw(
        engine_server, "/v1/completions", b'{"prompt": "hi"}', content_type="text/plain"
    )
    assert status == 400
    _assert_error_object(body, 400)


async def test_missing_prompt_is_400(engine_server: EngineServer):
    async with engine_server.client() as client:
        with pytest.raises(openai.BadRequestError) as err:
            await client.completions.create(model=engine_server.model, prompt=None, max_tokens=1)
    assert err.value.status_code == 400


async def test_missing_messages_is_400(engine_server: EngineServer):
    status, body = await _post_raw(
        engine_server, "/v1/chat/completions", json.dumps({"model": engine_server.model}).encode()
    )
    assert status == 400
    _assert_error_object(body, 400)


async def test_mistyped_field_is_400(engine_server: EngineServer):
    data = json.dumps({"model": engine_server.model, "prompt": "hi", "max_tokens": "many"}).encode()
    status, body = await _post_raw(engine_server, "/v1/completions", data)
    assert status == 400
    _assert_error_object(body, 400)


async def test_prompt_longer_than_max_model_len_is_400(engine_server: EngineServer, rng):
    async with engine_server.client() as client:
        with pytest.raises(openai.BadRequestError) as err:
            await client.completions.create(
                model=engine_server.model,
                prompt=random_ids(rng, engine_server.max_model_len + 1),
                max_tokens=1,
            )
    assert err.value.status_code == 400
    assert "maximum context length" in err.value.body["message"]


async def test_max_tokens_past_the_context_is_cut_to_fit(engine_server: EngineServer, rng):
    # vLLM 0.32 generates what the context window leaves (older versions refused with a 400).
    async with engine_server.client() as client:
        done = await client.completions.create(
            model=engine_server.model, prompt=random_ids(rng, 100),
            max_tokens=engine_server.max_model_len, extra_body={"ignore_eos": True},
        )
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == engine_server.max_model_len - 100


async def test_zero_max_tokens_is_400(engine_server: EngineServer, rng):
    async with engine_server.client() as client:
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model=engine_server.model, prompt=random_ids(rng, 5), max_tokens=0)


async def test_unknown_model_is_404(engine_server: EngineServer, rng):
    async with engine_server.client() as client:
        names = ", ".join(m.id for m in (await client.models.list()).data)
        with pytest.raises(openai.NotFoundError) as err:
            await client.completions.create(model="no-such-model", prompt=random_ids(rng, 5), max_tokens=1)
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=1
            )
    assert err.value.status_code == 404
    assert err.value.body["type"] == "NotFoundError"
    # vLLM names every served alias (OpenAIServing._check_model).
    assert err.value.body["message"] == f"The model `no-such-model` does not exist. Valid aliases: {names}."


async def test_stream_options_without_stream_is_400(engine_server: EngineServer, rng):
    async with engine_server.client() as client:
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(
                model=engine_server.model, prompt=random_ids(rng, 5), max_tokens=1,
                stream_options={"include_usage": True},
            )


async def test_out_of_vocabulary_token_id_is_400(engine_server: EngineServer):
    async with engine_server.client() as client:
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model=engine_server.model, prompt=[1, 2, 10**9], max_tokens=1)


async def test_emulator_refuses_prompt_batches(engine_server: EngineServer, rng):
    async with engine_server.client() as client:
        with pytest.raises(openai.BadRequestError) as err:
            await client.completions.create(
                model=engine_server.model, prompt=[random_ids(rng, 5), random_ids(rng, 5)], max_tokens=1
            )
        one = await client.completions.create(
            model=engine_server.model, prompt=[random_ids(rng, 5)], max_tokens=1
        )
    assert "one prompt per request" in err.value.body["message"]
    assert one.usage.prompt_tokens == 5


async def test_json_booleans_in_token_ids_count_as_0_and_1(engine_server: EngineServer, rng):
    # vLLM validates requests with pydantic's lax mode, which takes true/false as ints.
    async with engine_server.client() as client:
        done = await client.completions.create(
            model=engine_server.model, prompt=[True, *random_ids(rng, 9)], max_tokens=1
        )
    assert done.usage.prompt_tokens == 10


async def test_unknown_path_is_404_json(engine_server: EngineServer):
    async with aiohttp.ClientSession() as s, s.get(f"{engine_server.base_url}/v1/nothing") as r:
        assert r.status == 404
        assert await r.json() == {"detail": "Not Found"}


# vLLM 0.32's scale-out routes; `vllm serve` without --enable-scale-out (the tier's servers and
# the emulator) answers each with 403. vllm-router probes /v1/completions/render first.
SCALE_OUT_PATHS = [
    "/v1/completions/render", "/v1/chat/completions/render", "/v1/messages/render",
    "/v1/responses/render", "/v1/completions/derender", "/v1/chat/completions/derender",
    "/inference/v1/generate", "/inference/v1/abort_requests",
]


@pytest.mark.parametrize("path", SCALE_OUT_PATHS)
async def test_scale_out_routes_are_403_without_enable_scale_out(engine_server: EngineServer, path):
    body = json.dumps({"model": engine_server.model, "prompt": "Hello there"}).encode()
    for data, content_type in ((body, "application/json"), (b"not json", "text/plain")):
        status, answer = await _post_raw(engine_server, path, data, content_type)
        assert status == 403, (path, answer)
        _assert_error_object(answer, 403)
        assert answer["error"]["type"] == "PermissionDeniedError"
        assert "--enable-scale-out" in answer["error"]["message"]
    if path == "/v1/responses/render":
        # A GET there is vLLM's Responses API retrieving response id "render" (404), an API the
        # emulator does not serve: nothing to compare.
        return
    async with aiohttp.ClientSession() as s, s.get(f"{engine_server.base_url}{path}") as r:
        assert r.status == 405  # mounted for POST only


#: The top-level fields of vLLM 0.32's GenerateRequest, as `vllm launch render` answers them.
GENERATE_REQUEST_FIELDS = {
    "request_id", "token_ids", "token_offsets", "features", "content_parts", "sampling_params",
    "model", "reasoning_ended", "reasoning_parser_kwargs", "return_token_ids", "output_mode",
    "stream", "stream_options", "cache_salt", "priority", "kv_transfer_params", "ec_transfer_params",
}


async def test_emulator_render_with_scale_out_gives_the_tokens_generation_uses(rng):
    async for server in _emulator(details=True, enable_scale_out=True):
        text = " ".join(f"w{i}" for i in random_ids(rng, 40))
        body = {"model": "alias-model", "prompt": text, "max_tokens": 3, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        status, rendered = await _post_raw(server, "/v1/completions/render", json.dumps(body).encode())
        assert status == 200 and isinstance(rendered, list) and len(rendered) == 1
        (item,) = rendered
        assert set(item) == GENERATE_REQUEST_FIELDS
        assert item["request_id"].startswith("cmpl-") and item["model"] == "test-model"
        assert item["stream"] is True and item["output_mode"] == "tokens"
        assert item["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
        params = item["sampling_params"]
        assert params["max_tokens"] == 3 and params["ignore_eos"] is True
        assert params["temperature"] == 0.0 and "top_p" not in params  # greedy
        assert params["output_kind"] == 1  # DELTA, streamed
        _, tokenized = await _post_raw(server, "/tokenize", json.dumps({"prompt": text}).encode())
        assert item["token_ids"] == tokenized["tokens"]
        async with server.client() as client:
            done = await client.completions.create(model=server.model, prompt=text, max_tokens=1)
        assert done.usage.prompt_tokens == len(item["token_ids"])

        chat = {"model": server.model, "messages": [{"role": "user", "content": text}]}
        status, rendered = await _post_raw(server, "/v1/chat/completions/render", json.dumps(chat).encode())
        assert status == 200 and set(rendered) == GENERATE_REQUEST_FIELDS
        assert rendered["request_id"].startswith("chatcmpl-")
        # Chat without max_tokens gets what the context leaves, as vLLM's render says.
        assert rendered["sampling_params"]["max_tokens"] == MAX_MODEL_LEN - len(rendered["token_ids"])
        assert rendered["sampling_params"]["output_kind"] == 2  # FINAL_ONLY
        _, tokenized = await _post_raw(server, "/tokenize", json.dumps({"messages": chat["messages"]}).encode())
        assert rendered["token_ids"] == tokenized["tokens"]

        status, answer = await _post_raw(server, "/v1/completions/render", b'{"model": "nope", "prompt": "x"}')
        assert status == 404 and answer["error"]["type"] == "NotFoundError"
        status, answer = await _post_raw(server, "/v1/completions/render", b'{"model": "test-model"}')
        assert status == 400
        # Scale-out routes it does not model say so, instead of pretending to be disabled.
        status, answer = await _post_raw(server, "/inference/v1/generate", b"{}")
        assert status == 501 and answer["error"]["type"] == "NotImplementedError"


async def test_server_survives_bad_requests(engine_server: EngineServer, rng):
    for data in (b"", b"null", b'{"prompt": {}}', b'{"prompt": [1.5]}', b'{"messages": "x"}'):
        for path in ("/v1/completions", "/v1/chat/completions"):
            status, body = await _post_raw(engine_server, path, data)
            assert 400 <= status < 500, (path, data, body)
    async with engine_server.client() as client:
        done = await client.completions.create(model=engine_server.model, prompt=random_ids(rng, 5), max_tokens=1)
    assert done.usage.completion_tokens == 1


# -- disconnects --------------------------------------------------------------------------------


async def _running(base_url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as s, s.get(f"{base_url}/metrics") as r:
        text = await r.text()
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:num_requests_running":
            return sum(s.value for s in family.samples)
    raise AssertionError("no vllm:num_requests_running")


async def test_emulator_client_disconnect_aborts_the_request(rng):
    # Real time (about 6 ms per decode step): 1,000 tokens would take ~6 s.
    async for server in _emulator(details=True, timing="reference-gpu", time_scale=1.0):
        body = {"model": server.model, "prompt": random_ids(rng, 20), "max_tokens": 1000, "stream": True}
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{server.base_url}/v1/completions", json=body) as r:
                assert r.status == 200
                await r.content.readuntil(b"\n\n")
                assert await _running(server.base_url) == 1
        for _ in range(100):
            if await _running(server.base_url) == 0:
                break
            await asyncio.sleep(0.02)
        assert await _running(server.base_url) == 0
