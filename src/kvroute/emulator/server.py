"""The HTTP face of an emulated worker: vLLM's OpenAI-compatible routes on aiohttp.

This layer is thin I/O: it reads bodies, calls ``protocol`` to validate and shape, hands
requests to the ``EmulatedWorker`` and writes what comes back. Routes (as vLLM serves them):

* ``POST /v1/completions``, ``POST /v1/chat/completions`` — streamed (SSE) or not;
* ``GET /v1/models``, ``GET /health``, ``POST /tokenize``, ``POST /reset_prefix_cache``,
  ``GET /metrics``;
* the scale-out routes (``SCALE_OUT_PATHS``) answer 403, as ``vllm serve`` without
  ``--enable-scale-out`` does; with it (``EmulatorConfig.enable_scale_out``)
  ``POST /v1/completions/render`` and ``POST /v1/chat/completions/render`` answer a prompt's
  token ids in vLLM's ``GenerateRequest`` shape, and the scale-out routes the emulator does not
  model answer 501. vllm-router's ``kv_aware`` takes a text prompt's tokens from
  ``/v1/completions/render`` only: a 403 leaves it routing blind (a 404 sends it to
  ``/tokenize``).

A client mistake is always a 4xx with an OpenAI-style error object, never a 500. A client
that disconnects aborts its request in the engine (aiohttp cancels the handler).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus

from aiohttp import web

from kvroute.emulator.config import EmulatorConfig
from kvroute.emulator.protocol import (
    ApiError,
    GenerationRequest,
    ResponseWriter,
    ServingContext,
    dumps,
    models_json,
    parse_chat,
    parse_completion,
    parse_json_body,
    parse_tokenize,
    render_chat,
    render_completion,
    validation_error,
)
from kvroute.emulator.worker import EmulatedWorker, make_output_generator
from kvroute.errors import UserError
from kvroute.logfilters import quiet_aiohttp_client_errors
from kvroute.tokens import load_tokenizer

#: Largest request body accepted (a 4k-token prompt as a JSON id list is ~30 kB; long chats
#: and big max_model_len need more than aiohttp's 1 MiB default).
MAX_BODY_BYTES = 64 * 1024 * 1024

_JSON = "application/json"
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
_DONE = b"data: [DONE]\n\n"

#: vLLM 0.32's scale-out routes (``entrypoints/scale_out``: render, derender and token-in
#: token-out). ``vllm serve`` without ``--enable-scale-out`` mounts each of them (POST) on a
#: handler that answers 403 whatever the body (``register_scale_out_api_routers``).
SCALE_OUT_PATHS = (
    "/v1/chat/completions/render",
    "/v1/messages/render",
    "/v1/completions/render",
    "/v1/responses/render",
    "/v1/chat/completions/derender",
    "/v1/completions/derender",
    "/inference/v1/generate",
    "/inference/v1/abort_requests",
)
#: The scale-out routes ``--enable-scale-out`` serves here (the others answer 501).
RENDER_PATHS = ("/v1/completions/render", "/v1/chat/completions/render")
_SCALE_OUT_DISABLED = ApiError(
    "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them.",
    HTTPStatus.FORBIDDEN,
    "PermissionDeniedError",
)


def _error(exc: ApiError) -> web.Response:
    return web.Response(status=int(exc.status), body=exc.body(), content_type=_JSON)


async def _json_body(request: web.Request) -> dict:
    # vLLM's routes depend on validate_json_request: anything but application/json is a 400.
    if request.content_type != _JSON:
        raise validation_error("Unsupported Media Type: Only 'application/json' is allowed")
    return parse_json_body(await request.read())


async def _expect(request: web.Request) -> None:
    """``Expect: 100-continue`` gets its interim response; any other expectation is ignored,
    as uvicorn (vLLM's server) does. (aiohttp's own handler answers 417 and echoes the value,
    which fails with a 500 when the header is not ASCII.)"""
    if request.version >= (1, 1) and request.headers.get("Expect", "").lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")


class EmulatorApp:
    """The aiohttp application of one worker.

    Args:
        worker: the emulated worker behind the routes.
    """

    def __init__(self, worker: EmulatedWorker) -> None:
        self.worker = worker
        self.context: ServingContext = worker.context
        self.details = worker.config.enable_prompt_tokens_details
        self.created = int(time.time())
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        self.app.add_routes(
            [
                web.post("/v1/completions", self.completions, expect_handler=_expect),
                web.post("/v1/chat/completions", self.chat_completions, expect_handler=_expect),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.post("/tokenize", self.tokenize, expect_handler=_expect),
                web.post("/reset_prefix_cache", self.reset_prefix_cache, expect_handler=_expect),
                web.get("/metrics", self.metrics),
            ]
        )
        if worker.config.enable_scale_out:
            self.app.add_routes([
                web.post("/v1/completions/render", self.render_completion, expect_handler=_expect),
                web.post("/v1/chat/completions/render", self.render_chat, expect_handler=_expect),
            ])
            unmodelled = [path for path in SCALE_OUT_PATHS if path not in RENDER_PATHS]
            self.app.add_routes([web.post(path, self.scale_out_not_emulated) for path in unmodelled])
        else:
            self.app.add_routes([web.post(path, self.scale_out_disabled) for path in SCALE_OUT_PATHS])

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        """Unknown paths and methods answer as FastAPI (vLLM's framework) does; an error
        object raised anywhere becomes its response."""
        try:
            return await handler(request)
        except ApiError as exc:
            return _error(exc)
        except web.HTTPRequestEntityTooLarge:
            return _error(ApiError("Request body too large", web.HTTPRequestEntityTooLarge.status_code))
        except web.HTTPException as exc:
            if exc.status in (404, 405):
                return web.Response(
                    status=exc.status, body=dumps({"detail": exc.reason}), content_type=_JSON
                )
            raise

    # -- generation ----------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat)

    async def _generate(self, request: web.Request, parse: Callable) -> web.StreamResponse:
        received_at = asyncio.get_running_loop().time()
        body = await _json_body(request)
        try:
            gen: GenerationRequest = parse(body, self.context)
        except UserError as exc:  # a chat template that refuses the messages
            raise ApiError(str(exc)) from None
        worker = self.worker
        stream = await worker.generate(
            gen.prompt_token_ids, gen.max_tokens, gen.request_id, received_at,
            lora_name=gen.lora_name, cache_salt=gen.cache_salt,
        )
        writer = ResponseWriter(gen, worker.textgen, self.details)
        try:
            if gen.stream:
                return await self._stream(request, stream, writer)
            tokens: list[int] = []
            finished = False
            while not finished:
                chunk, finished = await stream.next_tokens()
                tokens.extend(chunk)
            return web.Response(
                body=writer.full_response(tokens, stream.num_cached_tokens), content_type=_JSON
            )
        finally:
            if not stream.finished:
                worker.abort(gen.request_id)

    async def _stream(self, request: web.Request, stream, writer: ResponseWriter) -> web.StreamResponse:
        gen = writer.request
        response = web.StreamResponse(headers=_SSE_HEADERS)
        await response.prepare(request)
        try:
            if gen.kind == "chat":
                await response.write(writer.role_chunk())
            generated = 0
            finished = False
            while not finished:
                tokens, finished = await stream.next_tokens()
                if not tokens:
                    break
                generated += len(tokens)
                await response.write(writer.token_chunk(tokens, finished, generated))
            if gen.include_usage:
                await response.write(writer.usage_chunk(generated, stream.num_cached_tokens))
            await response.write(_DONE)
            await response.write_eof()
        except (ConnectionResetError, ConnectionError):
            pass  # the client left; the caller aborts the request
        return response

    # -- other routes --------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        body = models_json(self.context, self.created, self.context.model_name)
        return web.Response(body=dumps(body), content_type=_JSON)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        try:
            result = parse_tokenize(body, self.context)
        except UserError as exc:
            raise ApiError(str(exc)) from None
        return web.Response(body=dumps(result), content_type=_JSON)

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        # vLLM answers 200 even when the reset is refused (requests still hold blocks).
        self.worker.reset_prefix_cache()
        return web.Response(status=200)

    async def render_completion(self, request: web.Request) -> web.Response:
        return await self._render(request, render_completion)

    async def render_chat(self, request: web.Request) -> web.Response:
        return await self._render(request, render_chat)

    async def _render(self, request: web.Request, render: Callable) -> web.Response:
        body = await _json_body(request)
        try:
            result = render(body, self.context)
        except UserError as exc:  # a chat template that refuses the messages
            raise ApiError(str(exc)) from None
        return web.Response(body=dumps(result), content_type=_JSON)

    async def scale_out_not_emulated(self, request: web.Request) -> web.Response:
        raise ApiError(f"{request.path} is not emulated (kvroute emulate serves only the render "
                       f"routes of --enable-scale-out)", HTTPStatus.NOT_IMPLEMENTED, "NotImplementedError")

    async def scale_out_disabled(self, request: web.Request) -> web.Response:
        # vLLM's handler takes no body, so it answers 403 before any validation.
        return _error(_SCALE_OUT_DISABLED)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.worker.metrics.render(),
            headers={"Content-Type": self.worker.metrics.content_type},
        )


@dataclass
class RunningWorker:
    """A worker serving HTTP on ``host:port``."""

    worker: EmulatedWorker
    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def kv_events_endpoint(self) -> str | None:
        return self.worker.publisher.endpoint if self.worker.publisher else None

    @property
    def kv_events_replay_endpoint(self) -> str | None:
        return self.worker.publisher.replay_endpoint if self.worker.publisher else None

    async def close(self) -> None:
        """Stop serving (in-flight handlers are cancelled), then stop the engine and release
        the KV event sockets."""
        await self.runner.cleanup()
        await self.worker.close()


async def serve_worker(worker: EmulatedWorker, host: str = "127.0.0.1", port: int = 0) -> RunningWorker:
    """Start ``worker`` and serve it on ``host:port`` (0: an ephemeral port).

    Raises:
        UserError: the port cannot be bound.
    """
    await worker.start()
    quiet_aiohttp_client_errors()  # vLLM answers malformed HTTP with a 400 and logs nothing
    app = EmulatorApp(worker)
    # handler_cancellation: a client disconnect cancels its handler, which aborts the request.
    runner = web.AppRunner(
        app.app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        await worker.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    bound_port = runner.addresses[0][1]
    return RunningWorker(worker, runner, host, bound_port)


async def start_workers(
    config: EmulatorConfig, n: int = 1, host: str = "127.0.0.1", base_port: int = 0
) -> list[RunningWorker]:
    """Start ``n`` emulated workers, each with its own cache, metrics and KV event publisher
    (worker i's event endpoints are the configured ones moved by i ports).

    Args:
        config: settings shared by all workers.
        n: number of workers.
        host: address to listen on.
        base_port: worker i listens on ``base_port + i``; 0 gives each an ephemeral port.

    Raises:
        UserError: bad settings, or a port that cannot be bound (workers already started are
            closed again).
    """
    if n < 1:
        raise UserError(f"--workers must be at least 1, got {n}")
    config.validate()
    tokenizer = load_tokenizer(config.tokenizer)
    textgen = make_output_generator(tokenizer)
    running: list[RunningWorker] = []
    try:
        for i in range(n):
            worker = EmulatedWorker(config, index=i, tokenizer=tokenizer, textgen=textgen)
            running.append(await serve_worker(worker, host, base_port + i if base_port else 0))
    except BaseException:
        await asyncio.gather(*(w.close() for w in running), return_exceptions=True)
        raise
    return running
