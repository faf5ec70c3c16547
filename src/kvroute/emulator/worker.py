"""The engine model on the wall clock: one emulated vLLM worker.

``EmulatedWorker`` owns a pure ``Engine`` and drives it from a single asyncio task, the way
vLLM's engine core loop drives its scheduler:

* A request reaches the engine after the cost model's ``frontend_s`` (HTTP, tokenization and
  detokenizer start in a real server), then waits in the engine's queue.
* The loop runs ``Engine.step(now)`` whenever there is work, sleeps until the step's end,
  then hands every output token to its request's stream and publishes the step's KV events.
  While busy, the next step starts exactly where the last one ended (engine time does not
  drift behind the wall clock by the loop's wake-up latency); after an idle spell, or when the
  process fell far behind, it restarts from the present.
* With the ``instant`` preset steps take no time; the loop still yields between steps so HTTP
  handlers keep running.
* A request whose client went away is aborted in the engine, freeing its blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import numpy as np

from kvroute.emulator.config import EmulatorConfig
from kvroute.emulator.metrics import WorkerMetrics
from kvroute.emulator.protocol import ServingContext
from kvroute.emulator.textgen import OutputTokenGenerator
from kvroute.engine import Engine, EngineRequest, EventBatch, StepResult
from kvroute.kvevents import KVEventPublisher, KVEventsConfig
from kvroute.tokens import Tokenizer, load_tokenizer, safe_vocabulary

#: When the loop is this far behind the engine's own clock (seconds), it stops catching up
#: and restarts engine time from the present (an overloaded host, a debugger pause).
MAX_LAG_S = 0.25


def make_output_generator(tokenizer: Tokenizer) -> OutputTokenGenerator:
    return OutputTokenGenerator(safe_vocabulary(tokenizer), tokenizer.decode)


def _worker_events_config(config: KVEventsConfig, index: int) -> KVEventsConfig:
    """Worker ``index``'s event endpoints: the configured ports moved by ``index``. An
    ephemeral port (``tcp://host:*``) stays as is; every worker binds its own."""
    if config.endpoint.endswith(":*") and (
        config.replay_endpoint is None or config.replay_endpoint.endswith(":*")
    ):
        return config
    return config.with_port_offset(index)


class RequestStream:
    """The output tokens of one request, as the engine loop produces them.

    The loop pushes tokens; the HTTP handler takes whatever has accumulated since it last
    looked (a slow reader gets several tokens in one chunk, like vLLM's output collector).
    """

    __slots__ = ("request", "received_at", "first_token_at", "finished", "_pending", "_waiter")

    def __init__(self, request: EngineRequest, received_at: float) -> None:
        self.request = request
        self.received_at = received_at
        self.first_token_at: float | None = None
        self.finished = False
        self._pending: list[int] = []
        self._waiter: asyncio.Future | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache at admission (0 before admission)."""
        return max(self.request.num_cached_tokens, 0)

    def push(self, token_id: int, finished: bool) -> None:
        self._pending.append(token_id)
        if finished:
            self.finished = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_tokens(self) -> tuple[list[int], bool]:
        """Tokens produced since the last call (waits for at least one), and whether they are
        the last ones. Returns ``([], True)`` once everything has been taken."""
        while not self._pending:
            if self.finished:
                return [], True
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        tokens, self._pending = self._pending, []
        return tokens, self.finished


class EmulatedWorker:
    """One emulated vLLM worker: engine model, engine loop, metrics and KV event publisher.

    Args:
        config: the worker's settings.
        index: position in a ``--workers N`` group; moves the KV event ports by ``index``.
        tokenizer: shared tokenizer (default: loaded from ``config.tokenizer``).
        textgen: shared output generator (default: built from the tokenizer).

    Call :meth:`start` inside the event loop before use and :meth:`close` at the end.
    """

    def __init__(
        self,
        config: EmulatorConfig,
        index: int = 0,
        tokenizer: Tokenizer | None = None,
        textgen: OutputTokenGenerator | None = None,
    ) -> None:
        config.validate()
        self.config = config
        self.index = index
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer)
        self.textgen = textgen if textgen is not None else make_output_generator(self.tokenizer)
        self.cost = config.cost
        self.events_config: KVEventsConfig | None = None
        if config.kv_events_config:
            self.events_config = _worker_events_config(
                KVEventsConfig.from_json(config.kv_events_config), index
            )
        publishes = self.events_config is not None and self.events_config.publishes
        self.engine = Engine(
            config.num_gpu_blocks,
            config.block_size,
            self.cost,
            enable_caching=config.enable_prefix_caching,
            emit_events=publishes,
        )
        if config.enable_lora:
            self.engine.set_lora_slots(config.max_loras, config.lora_load_s / config.time_scale)
        self.metrics = WorkerMetrics(self.engine, config)
        self.context = ServingContext(
            config.served_model_name, config.max_model_len, self.tokenizer, config.lora_modules
        )
        self.publisher: KVEventPublisher | None = None
        self._streams: dict[str, RequestStream] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self.engine.pool.emit_events:
            self.publisher = KVEventPublisher(
                self.events_config, wire_format=self.config.kv_events_wire_format
            )
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name=f"engine-loop-{self.index}")

    async def close(self) -> None:
        """Stop the engine loop and release the KV event sockets (their ports are free when
        this returns)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._streams.clear()
        if self.publisher is not None:
            # close() waits up to a second for queued batches; keep the loop responsive.
            await asyncio.get_running_loop().run_in_executor(None, self.publisher.close)
            self.publisher = None

    # -- requests ------------------------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        request_id: str,
        received_at: float | None = None,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Submit a request; returns its stream once the request is in the engine.

        ``lora_name`` (a ``--lora-modules`` name) and ``cache_salt`` key its block hashes and
        KV events as vLLM's.

        The request enters the engine ``frontend_s`` after ``received_at`` (the loop time the
        server started handling it; default now). The cost model's front-end time stands for
        all the work a real server does before its engine sees a request, so the time this
        server actually spent reading and tokenizing is taken out of the wait, not added to
        it. Cancelling while waiting submits nothing.
        """
        loop = asyncio.get_running_loop()
        if received_at is None:
            received_at = loop.time()
        wait = received_at + self.cost.frontend_s - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)
        prompt = np.asarray(prompt_token_ids, dtype=np.uint32)
        request = EngineRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            output_token_ids=self.textgen.tokens(prompt, max_tokens),
            arrival_time=loop.time(),
            max_tokens=max_tokens,
            lora_name=lora_name,
            lora_id=None if lora_name is None else self.context.lora_id(lora_name),
            cache_salt=cache_salt,
        )
        stream = RequestStream(request, received_at)
        self.engine.add_request(request)
        self._streams[request_id] = stream
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """The client went away: drop the request and free its blocks."""
        if self._streams.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)
            self._wake.set()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (refused while requests hold blocks, like vLLM)."""
        ok = self.engine.reset_prefix_cache()
        if ok and self.publisher is not None:
            # The engine only hands out events when it steps; an idle worker must still tell
            # subscribers at once that its cache is empty.
            events = self.engine.pool.take_events()
            if events:
                self.publisher.publish(EventBatch(ts=time.time(), events=events))
        return ok

    # -- engine loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        wake = self._wake
        clock = loop.time()
        busy = False
        while True:
            if not engine.has_work:
                busy = False
                wake.clear()
                await wake.wait()
                continue
            now = loop.time()
            if not busy or now - clock > MAX_LAG_S:
                clock = now
            result = engine.step(clock)
            if result.prefill_tokens == 0 and result.decode_seqs == 0:
                # Nothing could be scheduled (waiting requests need blocks that only an abort
                # or a finish will free): sleep until something changes instead of spinning.
                busy = False
                wake.clear()
                await wake.wait()
                continue
            busy = True
            clock = result.end
            delay = clock - loop.time()
            # Even a zero-time step yields, so handlers run between instant steps.
            await asyncio.sleep(delay if delay > 0 else 0)
            self._deliver(result, loop.time())

    def _deliver(self, result: StepResult, now: float) -> None:
        streams = self._streams
        metrics = self.metrics
        for out in result.outputs:
            stream = streams.get(out.request.request_id)
            if stream is None:
                continue
            if out.first_token:
                stream.first_token_at = now
                metrics.observe_first_token(now - stream.received_at)
            stream.push(out.new_token_id, out.finished)
            if out.finished:
                del streams[stream.request_id]
                metrics.observe_finished(now - stream.received_at)
        if result.events is not None and self.publisher is not None:
            # vLLM stamps a batch with the wall-clock time it was made, not engine time.
            self.publisher.publish(EventBatch(ts=time.time(), events=result.events.events))
