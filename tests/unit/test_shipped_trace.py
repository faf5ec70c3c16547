"""Mooncake's synthetic trace ships with kvroute (``--trace synthetic``), and a trace that is
not there gets one line saying where traces come from."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvroute.errors import UserError
from kvroute.trace.format import MOONCAKE_TRACES_URL, SHIPPED_TRACES, load_trace, trace_path


def test_the_synthetic_trace_is_shipped_with_its_licence_and_found_by_name(tmp_path, monkeypatch) -> None:
    shipped = SHIPPED_TRACES["synthetic"]
    assert "Apache License" in (shipped.parent / "LICENSE-Apache-2.0").read_text()
    monkeypatch.chdir(tmp_path)  # no synthetic_trace.jsonl here
    assert trace_path("synthetic") == shipped
    assert trace_path("synthetic_trace.jsonl") == shipped  # the name the Mooncake docs use
    assert len(load_trace(trace_path("synthetic"))) == 3993
    local = tmp_path / "synthetic_trace.jsonl"
    local.write_text('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [0]}\n')
    assert trace_path("synthetic_trace.jsonl") == local.relative_to(tmp_path)  # a file here wins


def test_a_missing_trace_says_where_traces_come_from(tmp_path) -> None:
    with pytest.raises(UserError) as caught:
        load_trace(tmp_path / "conversation_trace.jsonl")
    message = str(caught.value)
    assert "no such file or directory" in message and "--trace synthetic" in message
    assert MOONCAKE_TRACES_URL in message


def test_predict_with_a_missing_trace_prints_one_line(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvroute", "predict", "--trace", str(tmp_path / "missing.jsonl")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and MOONCAKE_TRACES_URL in proc.stderr, proc.stderr
