"""The reference the native chat-template renderer is checked against: jinja2 set up exactly as
``transformers.utils.chat_template_utils._compile_jinja_template`` sets it up (what vLLM's
``apply_chat_template`` renders with), and ``render_jinja_template``'s context.

Test-only: kvroute itself renders through ``kvroute._native.ChatTemplate``.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` as ``transformers``' ``AssistantTracker``
    renders it when it is not collecting assistant masks: the body, unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _render(caller: Any) -> str:
        return caller()


def compile_reference(source: str, now: datetime | None = None) -> jinja2.Template:
    """``source`` compiled in ``transformers``' environment; ``strftime_now`` formats ``now``
    (the clock's time when None).

    Raises:
        jinja2.TemplateSyntaxError: when the template does not parse.
    """

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format: str) -> str:
        return (now or datetime.now()).strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def render_reference(
    template: jinja2.Template,
    messages: list[dict],
    add_generation_prompt: bool,
    special_tokens: dict[str, Any],
    kwargs: dict[str, Any] | None = None,
    tools: list[dict] | None = None,
) -> str:
    """``render_jinja_template``'s call: kwargs override special tokens
    (``{**special_tokens_map, **kwargs}`` in ``apply_chat_template``)."""
    return template.render(
        messages=messages,
        tools=tools,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **{**special_tokens, **(kwargs or {})},
    )
