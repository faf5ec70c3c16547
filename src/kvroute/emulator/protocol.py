"""vLLM's OpenAI-compatible protocol, without I/O: request parsing and validation, response
and stream-chunk shapes, error objects.

Shapes follow vLLM's ``vllm/entrypoints/openai`` (protocol, serving_completion, serving_chat,
api_server). The facts that matter to clients and to kvroute:

* Errors are ``{"error": {"message", "type", "param", "code"}}`` with ``code`` the HTTP
  status. Body validation failures (malformed JSON, missing or mistyped fields) say
  ``"type": "Bad Request"`` (vLLM's handler for FastAPI's validation error); checks made while
  serving say ``"BadRequestError"``; an unknown model is a 404 ``"NotFoundError"``.
* ``usage.prompt_tokens_details`` is set only with ``--enable-prompt-tokens-details`` *and*
  a non-zero cached count (vLLM tests ``num_cached_tokens`` for truth): a miss reads
  ``null`` in a non-streamed response and is absent from the streamed usage chunk.
* A streamed usage chunk (``stream_options.include_usage``) has ``"choices": []`` and drops
  null fields; the stream ends with ``data: [DONE]``.
* Completions default to 16 output tokens; chat defaults to the rest of the context window
  (``max_model_len`` minus the prompt).
* Every served name is accepted as ``model``; responses always name the first one. With
  ``--enable-lora`` a ``--lora-modules`` name is accepted too: the request runs under that
  adapter (its name keys every block hash), and the response names the adapter.
* ``cache_salt`` (both endpoints): a non-empty string that keys the prompt's first block
  hash, so only requests with the same salt share its cache (vLLM's
  ``check_cache_salt_support``).

The emulator always generates exactly ``max_tokens`` tokens, so ``finish_reason`` is
``"length"``. Sampling fields (temperature, top_p, seed, stop, ignore_eos, ...) are accepted
and have no effect.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import numpy as np

from kvroute.emulator.textgen import OutputTokenGenerator
from kvroute.tokens import HFTokenizer, message_text

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
#: vLLM's default output length for completions (SamplingParams.max_tokens).
COMPLETION_DEFAULT_MAX_TOKENS = 16


class ApiError(Exception):
    """An error answered to the client as an OpenAI-style error object."""

    def __init__(
        self,
        message: str,
        status: HTTPStatus = HTTPStatus.BAD_REQUEST,
        err_type: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type
        self.param = param

    def to_json(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": int(self.status),
            }
        }

    def body(self) -> bytes:
        return _dumps(self.to_json()).encode()


def validation_error(message: str, param: str | None = None) -> ApiError:
    """A malformed body: what vLLM's RequestValidationError handler answers."""
    return ApiError(message, HTTPStatus.BAD_REQUEST, HTTPStatus.BAD_REQUEST.phrase, param)


def random_request_id() -> str:
    return uuid.uuid4().hex


# -- request parsing -----------------------------------------------------------------------


@dataclass(slots=True)
class ServingContext:
    """What parsing needs to know about the server."""

    served_model_names: tuple[str, ...]
    max_model_len: int
    tokenizer: Any  # kvroute.tokens.Tokenizer
    #: ``--lora-modules`` as (name, path), in order: an adapter's id is its position + 1, as
    #: vLLM numbers them (``lora_int_id``).
    lora_modules: tuple[tuple[str, str], ...] = ()

    def lora_id(self, name: str) -> int | None:
        """The id of the adapter called ``name``, or None when it is none."""
        for i, (module, _) in enumerate(self.lora_modules):
            if module == name:
                return i + 1
        return None

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


@dataclass(slots=True)
class GenerationRequest:
    """A validated completion or chat request, tokenized."""

    kind: str  # "completion" | "chat"
    prompt_token_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    model: str
    request_id: str
    #: The LoRA adapter it runs under (``model`` naming a ``--lora-modules`` entry).
    lora_name: str | None = None
    #: Its ``cache_salt``.
    cache_salt: str | None = None


def parse_json_body(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 like vLLM's.

    A lone UTF-16 surrogate (``"\\ud800"``, or its bytes ``ED A0 80``, which ``json.loads``
    lets through) is not text any tokenizer can encode: a 400 here, not a 500 later.
    """
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise validation_error(f"JSON decode error: {exc}") from None
    if not isinstance(body, dict):
        raise validation_error("Input should be a valid dictionary or object to extract fields from")
    # Only a body with a \u escape or an ED lead byte can hold a surrogate: the walk is rare.
    if (b"\\u" in raw or b"\xed" in raw) and _has_lone_surrogate(body):
        raise validation_error("Input should be valid Unicode text: found a lone surrogate")
    return body


def _has_lone_surrogate(value: Any) -> bool:
    """Whether any string in a decoded JSON value (keys included) is not encodable UTF-8."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _field(body: dict, name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    # bool is an int subclass: JSON true must not pass as a number.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise validation_error(f"{name}: Input should be a valid {kinds[0].__name__}", name)
    return value


def _check_model(body: dict, ctx: ServingContext) -> str:
    """The ``model`` a response names: any served name is accepted, but vLLM answers with the
    first one (``OpenAIServingModels.model_name``), whichever alias the request used."""
    model = _field(body, "model", (str,))
    if model is not None and ctx.lora_id(model) is not None:
        return model
    if model is not None and model not in ctx.served_model_names:
        raise ApiError(
            f"The model `{model}` does not exist. Valid aliases: {', '.join(ctx.served_model_names)}.",
            HTTPStatus.NOT_FOUND,
            "NotFoundError",
            "model",
        )
    return ctx.model_name


def _cache_salt(body: dict) -> str | None:
    """The body's ``cache_salt``: absent or null is none; anything but a non-empty string is
    refused, as vLLM refuses it."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise validation_error(
            "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt"
        )
    return salt


def _keyed(gen: GenerationRequest, body: dict, ctx: ServingContext) -> GenerationRequest:
    """``gen`` with its adapter (when ``model`` names one) and its cache salt."""
    gen.cache_salt = _cache_salt(body)
    if ctx.lora_id(gen.model) is not None:
        gen.lora_name = gen.model
    return gen


def _stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    options = _field(body, "stream_options", (dict,))
    if options is None:
        return False, False
    if not stream:
        raise ApiError(
            "Stream options can only be defined when `stream=True`.", param="stream_options"
        )
    include = _field(options, "include_usage", (bool,))
    continuous = _field(options, "continuous_usage_stats", (bool,))
    return include is not False, bool(continuous)


def _max_tokens(body: dict, names: tuple[str, ...], default: int | None) -> int | None:
    for name in names:
        value = _field(body, name, (int,))
        if value is not None:
            if value < 1:
                raise ApiError(f"max_tokens must be at least 1, got {value}.", param=name)
            return value
    return default


def _check_length(prompt_len: int, max_tokens: int | None, ctx: ServingContext) -> int:
    """vLLM's length rules (``get_max_tokens``): the prompt must leave room for at least one
    output token; ``max_tokens`` past the context window is not an error but is cut to what
    the window leaves (vLLM 0.32; older versions refused it with a 400)."""
    n = ctx.max_model_len
    if prompt_len >= n:
        raise ApiError(
            f"This model's maximum context length is {n} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input messages."
        )
    if max_tokens is None:
        return n - prompt_len
    return min(max_tokens, n - prompt_len)


def _check_n(body: dict) -> None:
    n = _field(body, "n", (int,))
    if n is not None and n != 1:
        raise ApiError("n must be 1: the emulator generates one choice per request.", param="n")


def _token_ids(values: list, ctx: ServingContext) -> list[int]:
    # One vectorized check instead of a Python loop: prompts are thousands of ids long.
    # (The caller has made sure every item is an int; JSON true/false become 1/0 here.)
    try:
        ids = np.asarray(values, dtype=np.int64)
    except OverflowError:  # an id past 64 bits, e.g. 2**70
        first = next(v for v in values if not -(2**63) <= v < 2**63)
        raise ApiError(f"Token id {first} is out of vocabulary", param="prompt") from None
    bad = (ids < 0) | (ids >= ctx.tokenizer.vocab_size)
    if bad.any():
        raise ApiError(f"Token id {int(ids[bad.argmax()])} is out of vocabulary", param="prompt")
    return ids.tolist()


def _completion_prompt(prompt: Any, ctx: ServingContext) -> list[int]:
    """A completion prompt is text, token ids, or a batch of either; batches of more than one
    prompt are refused (one request, one choice)."""
    if isinstance(prompt, str):
        return ctx.tokenizer.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, list):
        if not prompt:
            raise ApiError("Prompt cannot be empty.", param="prompt")
        # vLLM validates with pydantic's lax mode, which takes JSON true/false as the ints 1/0.
        if all(isinstance(t, int) for t in prompt):
            return _token_ids(prompt, ctx)
        if all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) > 1:
                raise ApiError(
                    "The emulator serves one prompt per request; send batched prompts as "
                    "separate requests.",
                    param="prompt",
                )
            return _completion_prompt(prompt[0], ctx)
    raise validation_error(
        "prompt: Input should be a string, a list of token ids, or a list of those", "prompt"
    )


def _generation_options(body: dict, ctx: ServingContext) -> tuple[str, bool, bool, bool]:
    """The fields completions and chat share: (model, stream, include_usage, continuous usage)."""
    model = _check_model(body, ctx)
    stream = bool(_field(body, "stream", (bool,), False))
    include_usage, continuous = _stream_options(body, stream)
    _check_n(body)
    return model, stream, include_usage, continuous


def parse_completion(body: dict, ctx: ServingContext) -> GenerationRequest:
    """Validate a ``/v1/completions`` body and tokenize its prompt."""
    if "prompt" not in body or body["prompt"] is None:
        raise validation_error("Field required: prompt", "prompt")
    model, stream, include_usage, continuous = _generation_options(body, ctx)
    max_tokens = _max_tokens(body, ("max_tokens",), COMPLETION_DEFAULT_MAX_TOKENS)
    prompt = _completion_prompt(body["prompt"], ctx)
    if not prompt:
        raise ApiError("Prompt cannot be empty.", param="prompt")
    max_tokens = _check_length(len(prompt), max_tokens, ctx)
    gen = GenerationRequest(
        "completion", prompt, max_tokens, stream, include_usage, continuous, model,
        f"cmpl-{random_request_id()}",
    )
    return _keyed(gen, body, ctx)


def _message_text(message: Any, index: int) -> dict:
    """One chat message with its content flattened to text, as vLLM's "string" content
    format does (:func:`kvroute.tokens.message_text`, the router's rule)."""
    if not isinstance(message, dict):
        raise validation_error(f"messages.{index}: Input should be a valid dictionary", "messages")
    role = message.get("role")
    if not isinstance(role, str):
        raise validation_error(f"messages.{index}.role: Field required", "messages")
    content = message.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise validation_error(f"messages.{index}.content: Input should be a valid string", "messages")
    text = message_text(role, content)
    if text is None:
        raise ApiError(f"messages.{index}.content: the emulator accepts only text parts", param="messages")
    return {"role": role, "content": text}


def chat_prompt_ids(body: dict, ctx: ServingContext) -> list[int]:
    """Apply the chat template and tokenize without adding special tokens again (the
    template already holds them), as vLLM does. A tokenizer's own template gets what vLLM
    gives it (its conversation, tools, kwargs: :meth:`kvroute.tokens.HFTokenizer.
    render_chat_request`, the router's renderer); the synthetic tokenizer's ChatML reads roles
    and contents alone."""
    messages = body["messages"]
    if not isinstance(messages, list):
        raise validation_error("messages: Input should be a valid list", "messages")
    if not messages:
        raise ApiError("messages must not be empty", param="messages")
    # Every message is checked (with vLLM's errors) whichever renderer reads it.
    flat = [_message_text(m, i) for i, m in enumerate(messages)]
    tokenizer = ctx.tokenizer
    add_generation_prompt = _field(body, "add_generation_prompt", (bool,), True)
    if not isinstance(tokenizer, HFTokenizer):
        text = tokenizer.apply_chat_template(flat, add_generation_prompt=add_generation_prompt)
        return tokenizer.encode(text, add_special_tokens=False)
    text = tokenizer.render_chat_request(body)
    if text is None:
        # The template's own refusal, if that is why (raises UserError with its message).
        tokenizer.apply_chat_template(flat, add_generation_prompt=add_generation_prompt)
        raise ApiError(
            "the emulator renders what vLLM renders from text, and not this chat's tools or "
            "tool calls (malformed), its own chat_template, or continue_final_message",
            param="messages",
        )
    return tokenizer.encode(text, add_special_tokens=False)


def parse_chat(body: dict, ctx: ServingContext) -> GenerationRequest:
    """Validate a ``/v1/chat/completions`` body and tokenize its templated messages."""
    if "messages" not in body or body["messages"] is None:
        raise validation_error("Field required: messages", "messages")
    model, stream, include_usage, continuous = _generation_options(body, ctx)
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), None)
    prompt = chat_prompt_ids(body, ctx)
    max_tokens = _check_length(len(prompt), max_tokens, ctx)
    gen = GenerationRequest(
        "chat", prompt, max_tokens, stream, include_usage, continuous, model,
        f"chatcmpl-{random_request_id()}",
    )
    return _keyed(gen, body, ctx)


def parse_tokenize(body: dict, ctx: ServingContext) -> dict:
    """``POST /tokenize``: a completion-style ``prompt`` or chat ``messages``."""
    _check_model(body, ctx)
    if "messages" in body:
        tokens = chat_prompt_ids(body, ctx)
    elif "prompt" in body:
        prompt = _field(body, "prompt", (str,))
        if prompt is None:
            raise validation_error("Field required: prompt", "prompt")
        add_special = _field(body, "add_special_tokens", (bool,), True)
        tokens = ctx.tokenizer.encode(prompt, add_special_tokens=add_special)
    else:
        raise validation_error("Field required: prompt or messages", "prompt")
    return {"count": len(tokens), "max_model_len": ctx.max_model_len, "tokens": list(tokens), "token_strs": None}


# -- render (vllm serve --enable-scale-out) ---------------------------------------------------


def _number(body: dict, name: str, default: float) -> float:
    return float(_field(body, name, (float, int), default))


def _render_sampling_params(body: dict, gen: GenerationRequest, max_tokens: int | None) -> dict:
    """``GenerateRequest.sampling_params`` as vLLM 0.32's render dumps it for the fields the
    emulator reads (checked against ``vllm launch render``): greedy (temperature 0) drops
    ``top_p``/``min_p``, ``max_tokens`` and ``seed`` appear only when the request set them,
    ``ignore_eos`` only when true; ``output_kind`` is 1 (DELTA) streamed, 2 (FINAL_ONLY) not."""
    temperature = _number(body, "temperature", 1.0)
    params: dict[str, Any] = {
        "presence_penalty": _number(body, "presence_penalty", 0.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0),
        "temperature": temperature,
    }
    if temperature != 0.0:
        params["top_p"] = _number(body, "top_p", 1.0)
        params["min_p"] = _number(body, "min_p", 0.0)
    seed = _field(body, "seed", (int,))
    if seed is not None:
        params["seed"] = seed
    stop = _field(body, "stop", (list, str), [])
    params["stop"] = [stop] if isinstance(stop, str) else list(stop)
    params["stop_token_ids"] = list(_field(body, "stop_token_ids", (list,), []))
    if _field(body, "ignore_eos", (bool,), False):
        params["ignore_eos"] = True
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    params.update(output_kind=1 if gen.stream else 2, skip_clone=True, bad_words=[],
                  skip_reading_prefix_cache=False)
    return params


def _generate_request(body: dict, gen: GenerationRequest, max_tokens: int | None) -> dict:
    """One ``GenerateRequest`` (``entrypoints/scale_out/token_in_token_out/protocol.py``) as
    render answers it: the prompt's token ids, what generation would compute from."""
    stream_options = None
    if gen.stream and _field(body, "stream_options", (dict,)) is not None:
        stream_options = {"include_usage": gen.include_usage, "continuous_usage_stats": gen.continuous_usage}
    return {
        "request_id": gen.request_id,
        "token_ids": list(gen.prompt_token_ids),
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": _render_sampling_params(body, gen, max_tokens),
        "model": gen.model,
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": _field(body, "return_token_ids", (bool,)),
        "output_mode": "tokens",
        "stream": gen.stream,
        "stream_options": stream_options,
        "cache_salt": gen.cache_salt,
        "priority": 0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


def render_completion(body: dict, ctx: ServingContext) -> list[dict]:
    """``POST /v1/completions/render``: the ``GenerateRequest`` list the completion would run
    (one per prompt; the emulator takes one prompt), validated and tokenized exactly as
    ``/v1/completions`` does, so its token ids are the ones the KV events hash."""
    gen = parse_completion(body, ctx)
    return [_generate_request(body, gen, _max_tokens(body, ("max_tokens",), None))]


def render_chat(body: dict, ctx: ServingContext) -> dict:
    """``POST /v1/chat/completions/render``: one ``GenerateRequest`` for the templated messages
    (chat's ``max_tokens`` is always set: what the context leaves when the request gives none)."""
    gen = parse_chat(body, ctx)
    return _generate_request(body, gen, gen.max_tokens)


# -- responses -----------------------------------------------------------------------------


def usage_json(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int, details: bool
) -> dict:
    """vLLM's UsageInfo (field order as vLLM serializes it)."""
    usage: dict = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }
    if details and cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


class ResponseWriter:
    """Builds one request's response bodies and SSE chunks.

    Streamed chunks are formatted from a prefix and suffix computed once per request, so a
    token costs one small string encode rather than a dict and a full ``json.dumps``.
    """

    def __init__(self, request: GenerationRequest, textgen: OutputTokenGenerator, details: bool) -> None:
        self.request = request
        self.textgen = textgen
        self.details = details
        self.created = int(time.time())
        head = (
            f'{{"id":"{request.request_id}","object":"%s","created":{self.created},'
            f'"model":{_dumps(request.model)},"choices":['
        )
        if request.kind == "completion":
            self._head = head % "text_completion"
            self._text_head = self._head + '{"index":0,"text":'
        else:
            self._head = head % "chat.completion.chunk"
            self._text_head = self._head + '{"index":0,"delta":{"content":'

    # -- streaming --

    def role_chunk(self) -> bytes:
        """The chat stream's first chunk: the assistant role with empty content."""
        return (
            f'data: {self._head}{{"index":0,"delta":{{"role":"assistant","content":""}},'
            '"logprobs":null,"finish_reason":null}]}\n\n'
        ).encode()

    def token_chunk(self, token_ids: list[int], finished: bool, num_generated: int) -> bytes:
        """One streamed chunk carrying the text of ``token_ids``."""
        text = _dumps(self.textgen.text(token_ids, first=num_generated == len(token_ids)))
        finish = '"length"' if finished else "null"
        usage = ""
        if self.request.continuous_usage:
            p = len(self.request.prompt_token_ids)
            usage = (
                f',"usage":{{"prompt_tokens":{p},"total_tokens":{p + num_generated},'
                f'"completion_tokens":{num_generated}}}'
            )
        if self.request.kind == "completion":
            tail = f',"logprobs":null,"finish_reason":{finish},"stop_reason":null}}]{usage}}}'
        else:
            stop = ',"stop_reason":null' if finished else ""
            tail = f'}},"logprobs":null,"finish_reason":{finish}{stop}}}]{usage}}}'
        return f"data: {self._text_head}{text}{tail}\n\n".encode()

    def usage_chunk(self, num_generated: int, cached_tokens: int) -> bytes:
        """The final usage chunk: no choices, null fields dropped."""
        usage = usage_json(len(self.request.prompt_token_ids), num_generated, cached_tokens, self.details)
        if usage["prompt_tokens_details"] is None:
            del usage["prompt_tokens_details"]
        return f'data: {self._head}],"usage":{_dumps(usage)}}}\n\n'.encode()

    # -- whole responses --

    def full_response(self, token_ids: list[int], cached_tokens: int) -> bytes:
        req = self.request
        text = self.textgen.text(token_ids)
        usage = usage_json(len(req.prompt_token_ids), len(token_ids), cached_tokens, self.details)
        if req.kind == "completion":
            body = {
                "id": req.request_id,
                "object": "text_completion",
                "created": self.created,
                "model": req.model,
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": "length",
                        "stop_reason": None,
                        "prompt_logprobs": None,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": None,
                "usage": usage,
                "kv_transfer_params": None,
            }
        else:
            body = {
                "id": req.request_id,
                "object": "chat.completion",
                "created": self.created,
                "model": req.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": text,
                            "refusal": None,
                            "annotations": None,
                            "audio": None,
                            "function_call": None,
                            "tool_calls": [],
                            "reasoning_content": None,
                        },
                        "logprobs": None,
                        "finish_reason": "length",
                        "stop_reason": None,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": None,
                "usage": usage,
                "prompt_logprobs": None,
                "kv_transfer_params": None,
            }
        return _dumps(body).encode()


def _permission(created: int) -> dict:
    return {
        "id": f"modelperm-{random_request_id()}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


def models_json(ctx: ServingContext, created: int, root: str) -> dict:
    """``GET /v1/models``: one card per served name, then one per LoRA module (its path as
    ``root``, the base model as ``parent``, no ``max_model_len``), as vLLM lists them."""
    adapters = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": path,
            "parent": ctx.model_name,
            "max_model_len": None,
            "permission": [_permission(created)],
        }
        for name, path in ctx.lora_modules
    ]
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": root,
                "parent": None,
                "max_model_len": ctx.max_model_len,
                "permission": [_permission(created)],
            }
            for name in ctx.served_model_names
        ]
        + adapters,
    }


def dumps(obj: Any) -> bytes:
    return _dumps(obj).encode()
