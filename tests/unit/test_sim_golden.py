"""The simulator reproduces, request for request, the golden traces recorded from the Python
simulator before the native core replaced it (tests/data/golden/record_sim.py): the reference
sweep for every policy, Zipf and mixed-length workloads, and small caches that evict, preempt
and chunk prefills. Worker, cached tokens, send time, TTFT and end-to-end latency must be equal
to the last bit, and so must each worker's prefix-cache counters over the measured window."""

import gzip
import importlib.util
import json

import pytest
from support.paths import DATA

GOLDEN = DATA / "golden"
_spec = importlib.util.spec_from_file_location("record_sim", GOLDEN / "record_sim.py")
record_sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(record_sim)

TRACES = {t["name"]: t for t in json.loads(gzip.open(GOLDEN / "sim_traces.json.gz", "rt").read())["traces"]}
CASES = {case[0]: case for case in record_sim.cases()}


def test_every_case_has_a_trace():
    assert set(CASES) == set(TRACES)


@pytest.mark.parametrize("name", sorted(TRACES))
def test_simulator_reproduces_the_golden_trace(name):
    want = TRACES[name]
    got = record_sim.record(*CASES[name])
    assert got["window"] == want["window"]
    mismatched = [(w, g) for w, g in zip(want["records"], got["records"]) if w != g]
    assert not mismatched, f"{len(mismatched)} of {len(want['records'])} requests differ, first: {mismatched[0]}"
    assert len(got["records"]) == len(want["records"])
    assert got["duration"] == want["duration"]
