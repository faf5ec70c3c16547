"""Chat-template render time per request: the native renderer (``kvroute._native.ChatTemplate``,
minijinja set up as ``transformers`` sets up jinja2) against jinja2 itself (the reference
model in tests/support/jinja_reference.py, what ``transformers`` and vLLM render with).

The router renders every ``/v1/chat/completions`` request before it tokenizes it, so this is
per-request CPU. Both renderers get the same compiled template and the same messages (a
conversation of ``--turns`` user/assistant turns after a system prompt, ``--chars`` characters
per message); only ``render`` is timed, with the Python-to-template conversion of the messages
included on the native side, as the router pays it. Templates: kvroute's ChatML (what
``make-tiny-model`` writes), and the Qwen3- and Llama-3-style templates of
tests/unit/test_chat_template.py (thinking, namespaces, string methods, strftime_now).

    python benchmarks/chat_template_speed.py [--turns 8] [--chars 400] [--seconds 1]

CPU time of this process is printed beside wall time: on a shared machine it is the fairer
measure. Each renderer's output is checked to be identical before it is timed.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.chat_templates import LLAMA3_STYLE, QWEN3_STYLE, SPECIAL_TOKENS  # noqa: E402
from support.jinja_reference import compile_reference, render_reference  # noqa: E402

from kvroute._native import ChatTemplate  # noqa: E402
from kvroute.tokens import CHATML_TEMPLATE  # noqa: E402

TEMPLATES = {"chatml": CHATML_TEMPLATE, "qwen3-style": QWEN3_STYLE, "llama3-style": LLAMA3_STYLE}


def conversation(turns: int, chars: int) -> list[dict]:
    words = ("lorem ipsum dolor sit amet consectetur adipiscing elit " * (chars // 8 + 1))[:chars]
    messages = [{"role": "system", "content": "You are a helpful assistant. " + words}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"question {i}: {words}"})
        messages.append({"role": "assistant", "content": f"answer {i}: {words}"})
    messages.append({"role": "user", "content": "and finally? " + words})
    return messages


def per_call(fn, seconds: float) -> tuple[float, float]:
    """Mean (wall, CPU) microseconds per call of ``fn`` over about ``seconds``."""
    for _ in range(20):
        fn()
    n = 0
    wall0, cpu0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - wall0 < seconds:
        for _ in range(50):
            fn()
        n += 50
    return (
        (time.perf_counter() - wall0) / n * 1e6,
        (time.process_time() - cpu0) / n * 1e6,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--chars", type=int, default=400)
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()
    messages = conversation(args.turns, args.chars)
    now = datetime.now()
    print(
        f"{len(messages)} messages of ~{args.chars} chars; µs per render (wall / CPU), "
        "lower is better"
    )
    print(f"{'template':<14}{'native':>18}{'jinja2':>18}{'jinja2/native (CPU)':>22}")
    for name, source in TEMPLATES.items():
        native = ChatTemplate(source, SPECIAL_TOKENS)
        reference = compile_reference(source, now=now)
        render_native = partial(native.render, messages, True, {}, now.isoformat())
        render_jinja = partial(render_reference, reference, messages, True, SPECIAL_TOKENS)

        if render_native() != render_jinja():
            raise SystemExit(f"{name}: the renderers disagree; not timing them")
        n_wall, n_cpu = per_call(render_native, args.seconds)
        j_wall, j_cpu = per_call(render_jinja, args.seconds)
        print(
            f"{name:<14}{n_wall:>9.1f} / {n_cpu:>6.1f}{j_wall:>9.1f} / {j_cpu:>6.1f}"
            f"{j_cpu / n_cpu:>21.1f}x"
        )


if __name__ == "__main__":
    main()
