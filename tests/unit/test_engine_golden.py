"""The engine reproduces, exactly, the golden traces recorded from the pure-Python engine it
replaced: every request's cached tokens, first-token and finish time and preemptions, every
step's prefill tokens, decoding sequences and KV events, and the final counters.

The scenarios and their driver live in ``tests/data/golden/engine_scenarios.py`` (which also
re-records them); see its docstring for what each one exercises. Here the engine is driven
through the Python bindings; ``crates/kvroute-sim/tests/engine_golden`` replays the same
traces against the Rust engine under ``cargo nextest``.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from support.paths import DATA

_PATH = DATA / "golden" / "engine_scenarios.py"
_spec = importlib.util.spec_from_file_location("engine_scenarios", _PATH)
scenarios = importlib.util.module_from_spec(_spec)
sys.modules["engine_scenarios"] = scenarios  # dataclasses look their module up
_spec.loader.exec_module(scenarios)


@pytest.mark.parametrize("scenario", scenarios.SCENARIOS, ids=lambda s: s.name)
def test_engine_reproduces_the_golden_trace(scenario):
    golden = json.loads(scenarios.path_of(scenario).read_text())
    trace = scenarios.run(scenario)
    for i, (got, want) in enumerate(zip(trace["steps"], golden["steps"])):
        assert got == want, f"step {i} differs: {got} != {want}"
    assert len(trace["steps"]) == len(golden["steps"])
    assert trace["records"] == golden["records"]
    assert trace["resets"] == golden["resets"]
    assert trace["stats"] == golden["stats"]
    assert trace["totals"] == golden["totals"]
    assert trace["free_blocks"] == golden["free_blocks"]


def test_the_traces_exercise_what_they_are_for():
    """Preemptions, aborts, a successful and a refused reset, chunked prefill and hits on
    generated tokens all occur somewhere (a trace that never preempts guards nothing there)."""
    traces = {s.name: json.loads(scenarios.path_of(s).read_text()) for s in scenarios.SCENARIOS}
    assert sum(t["totals"][0] for t in traces.values()) > 50
    assert any(r[0] == "aborted" for t in traces.values() for r in t["records"].values())
    resets = [ok for t in traces.values() for _, ok in t["resets"]]
    assert True in resets and False in resets
    assert traces["multi_turn"]["stats"][2] > 0.8 * traces["multi_turn"]["stats"][1]
    assert any(step[1] == 0 and step[0] == 512 for step in traces["zipf_mixed_chunked"]["steps"])


def _load_sim_golden():
    path = DATA / "golden" / "sim_round_robin.py"
    spec = importlib.util.spec_from_file_location("sim_round_robin", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sim_round_robin"] = module
    spec.loader.exec_module(module)
    return module


sim_golden = _load_sim_golden()


@pytest.mark.parametrize("run", sim_golden.RUNS, ids=lambda r: r[0])
def test_the_simulator_reproduces_its_golden_round_robin_runs(run):
    """``kvroute.sim`` on the native engine gives the records the Python engine gave (the
    same file the Rust event loop's tests read)."""
    text = (DATA / "golden" / "sim_round_robin.txt").read_text()
    block = text.split(f"run {run[0]}\n", 1)[1].split("\nend\n", 1)[0]
    assert sim_golden.record(run)[5:-1] == block.splitlines()[4:]
