"""Both data planes hash prompts as the engine's tokenizer sees them (or, without one, as kvroute's
synthetic tokenizer does): text completions, and
chats rendered with the tokenizer's chat template (content parts joined, template kwargs),
the same block hashes as ``kvroute.proxy.prompts.PromptHasher`` computes (each request's
routing records its blocks in the index as predicted entries, which is what this reads)."""

from __future__ import annotations

import time

import aiohttp
import pytest
from aiohttp import web

from kvroute.blocks import DEFAULT_HASH_SEED, BlockHasher
from kvroute.proxy import RouterConfig, start_router
from kvroute.proxy.prompts import PromptHasher
from kvroute.tokens import load_tokenizer

pytestmark = pytest.mark.usefixtures("data_plane")

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


async def _routes_as(hasher: PromptHasher, config_for, bodies) -> None:
    """Send each body through a router made by ``config_for(url)``; each must have recorded
    exactly ``hasher``'s block hashes for it."""
    runner, url = await _worker()
    try:
        async with start_router(config_for(url)) as router, aiohttp.ClientSession() as s:
            for path, body in bodies:
                expected = (hasher.chat if "chat" in path else hasher.completion)(dict(body))
                assert len(expected.block_hashes) >= 4, path
                async with s.post(router.url + path, json=body) as r:
                    assert r.status == 200
                held = router.index.overlaps(expected.block_hashes, [url], time.monotonic())[0]
                assert held == len(expected.block_hashes), (path, body)
    finally:
        await runner.cleanup()


async def test_text_and_chat_prompts_hash_as_the_engine_tokenizes_them(tiny_model_dir):
    hasher = PromptHasher(load_tokenizer(str(tiny_model_dir)), BlockHasher(BS, DEFAULT_HASH_SEED))
    await _routes_as(hasher, lambda url: RouterConfig(
        workers=[url], tokenizer=str(tiny_model_dir), block_size=BS, health_interval_s=0, predicted_ttl_s=600.0,
    ), BODIES)


async def test_without_a_tokenizer_prompts_hash_as_the_synthetic_tokenizer_does():
    """What emulated workers started without a tokenizer tokenize with (kvroute's built-in
    synthetic tokenizer): pseudo-words, other words, punctuation, ChatML chats."""
    tokenizer = load_tokenizer(None)
    words = tokenizer.decode(list(range(3, 3 + 120)))
    hasher = PromptHasher(tokenizer, BlockHasher(BS, DEFAULT_HASH_SEED))
    bodies = [("/v1/completions", {"prompt": words + " plus, some real words_2 and 数据!"}),
              *((path, body) for path, body in BODIES if "chat" in path)]
    await _routes_as(hasher, lambda url: RouterConfig(
        workers=[url], block_size=BS, health_interval_s=0, predicted_ttl_s=600.0,
    ), bodies)
