"""The Kubernetes deployment: the Helm chart rendered by Helm itself, offline, and checked
against the Kubernetes API schemas; the Grafana dashboard against the metrics that really exist;
the bench Job's script and the Dockerfile.

Rendering uses helm-python-sdk (Helm's Go SDK behind a C ABI, bundled in the wheel: no helm
binary, no cluster); validation uses kubernetes-validate (the API's JSON schemas, bundled).
"""

from __future__ import annotations

import argparse
import copy
import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading

import helm_python as helm
import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml
from lightkube import KubeConfig
from support.paths import DATA, ROOT

from kvroute.router.k8s import EndpointSliceDiscovery

CHART = ROOT / "deploy" / "helm" / "kvroute"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvroute.json"
RELEASE, NAMESPACE = "kv", "llm"
#: The oldest Kubernetes the chart allows (Chart.yaml kubeVersion) and the newest schemas known.
KUBE_VERSIONS = ("1.25.0", kubernetes_validate.utils.latest_version())
#: Kinds whose schema is a CRD, not part of Kubernetes: checked structurally below.
CRD_KINDS = {"ServiceMonitor", "InferencePool", "HTTPRoute"}
#: The InferencePool CRD's schema (the Gateway API Inference Extension's, shipped in tests/data).
INFERENCE_POOL_CRD = DATA / "inferencepool-crd.yaml"
GATEWAY_ON = {"gateway": {"enabled": True}}


def merge(base: dict, override: dict) -> dict:
    """Helm's rule for several values files: maps merge key by key, anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def values_file(name: str) -> dict:
    return yaml.safe_load((CHART / name).read_text())


def render(*layers: dict) -> list[dict]:
    """The chart's objects for these values layers (like ``helm template -f a -f b``)."""
    values: dict = {}
    for layer in layers:
        values = merge(values, layer)
    with helm.Chart.load(str(CHART)) as chart:
        rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [doc for path, text in sorted(rendered.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict], kind: str, name_suffix: str = "") -> dict:
    found = [o for o in by_kind(objects, kind) if o["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"{kind} *{name_suffix}: {[o['metadata']['name'] for o in found]}"
    return found[0]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def serve_config(args: list[str], *, epp: bool = False):
    """The RouterConfig `kvroute serve` (or `kvroute epp`) makes of ``args`` (its real parser)."""
    from kvroute.commands import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser, epp=epp)
    return serve.config_from_args(parser.parse_args(args))


EVERYTHING_ON = {"bench": {"enabled": True, "persistence": {"enabled": True}},
                 "serviceMonitor": {"enabled": True}}
CONFIGURATIONS = {
    "default": [],
    "default, all options": [EVERYTHING_ON, {"router": {"discovery": "k8s"}}],
    "default, bench on the router": [{"bench": {"enabled": True, "target": "router"}}],
    "3 workers": [values_file("values-3-workers.yaml")],
    "3 workers, bench": [values_file("values-3-workers.yaml"), EVERYTHING_ON],
    "6 workers": [values_file("values-6-workers.yaml")],
    "6 workers, bench on the router, dns": [values_file("values-6-workers.yaml"), EVERYTHING_ON,
                                           {"bench": {"target": "router"}, "router": {"discovery": "dns"}}],
    "gateway mode": [GATEWAY_ON],
    "gateway mode alone, k8s discovery": [values_file("values-3-workers.yaml"), GATEWAY_ON,
                                          {"router": {"enabled": False, "discovery": "k8s"}}],
    "gateway mode, 3 meshed EPPs": [values_file("values-6-workers.yaml"),
                                    {"gateway": {"enabled": True, "replicas": 3}}],
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(values_file("values.yaml"), *layers) for name, layers in CONFIGURATIONS.items()}


def test_chart_lints_without_warnings():
    for values in ({}, values_file("values-3-workers.yaml"), values_file("values-6-workers.yaml")):
        report = helm.lint(str(CHART), values, strict=True)
        assert report["errors"] == []
        assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("config", CONFIGURATIONS)
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_manifests_validate_against_the_kubernetes_schemas(rendered, config, kube_version):
    objects = rendered[config]
    assert objects
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            continue
        # strict: an unknown field (a typo, a misplaced key) is an error too.
        kubernetes_validate.validate(obj, kube_version, strict=True)
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("config", CONFIGURATIONS)
def test_every_selector_finds_its_pods_and_every_pod_is_probed_and_sized(rendered, config):
    objects = rendered[config]
    workloads = by_kind(objects, "Deployment") + by_kind(objects, "Job")
    pods = {o["metadata"]["name"]: o["spec"]["template"] for o in workloads}
    for svc in by_kind(objects, "Service"):
        matched = [n for n, t in pods.items() if selects(svc["spec"]["selector"], t["metadata"]["labels"])]
        assert len(matched) == 1, svc["metadata"]["name"]
        container_ports = {p["name"] for c in pods[matched[0]]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= container_ports
    for pdb in by_kind(objects, "PodDisruptionBudget"):
        assert any(selects(pdb["spec"]["selector"]["matchLabels"], t["metadata"]["labels"]) for t in pods.values())
    for deploy in by_kind(objects, "Deployment"):
        assert selects(deploy["spec"]["selector"]["matchLabels"], deploy["spec"]["template"]["metadata"]["labels"])
        for container in deploy["spec"]["template"]["spec"]["containers"]:
            assert {"readinessProbe", "livenessProbe"} <= container.keys()
            assert container["resources"]["requests"].keys() >= {"cpu", "memory"}
    for job in by_kind(objects, "Job"):
        assert job["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]


@pytest.mark.parametrize("file, workers", [("values-3-workers.yaml", 3), ("values-6-workers.yaml", 6)])
def test_reference_topologies(file, workers):
    objects = render(values_file("values.yaml"), values_file(file))
    worker = one(objects, "Deployment", "-worker")
    assert worker["spec"]["replicas"] == workers
    container = worker["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "startupProbe" in container
    args = container["args"]
    assert args[0] == "/models/Qwen3-0.6B"
    # The reference engine arguments (docs/experiment.md): 1 GiB of KV, prompt token details, events.
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(args)
    assert flag(args, "--kv-cache-memory-bytes") == str(1 << 30)
    assert flag(args, "--max-model-len") == "4096"
    events = json.loads(flag(args, "--kv-events-config"))
    assert events == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                      "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "kv-events": 5557, "kv-replay": 5558}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["VLLM_SERVER_DEV_MODE"] == "1"  # kvroute bench resets caches between trials

    router = one(objects, "Deployment", "-router")
    assert router["spec"]["replicas"] >= 2
    router_args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert router_args[0] == "serve"
    assert flag(router_args, "--tokenizer") == "/models/Qwen3-0.6B"
    # Routers and workers see the same files.
    volumes = [v for t in (worker, router) for v in t["spec"]["template"]["spec"]["volumes"] if v["name"] == "models"]
    assert [v["persistentVolumeClaim"]["claimName"] for v in volumes] == ["models", "models"]


@pytest.mark.parametrize("discovery", ["dns", "k8s"])
def test_router_discovers_workers_through_the_headless_service(discovery):
    objects = render({"router": {"discovery": discovery}})
    headless = one(objects, "Service", "-workers-headless")
    plain = one(objects, "Service", "-workers")
    assert headless["spec"]["clusterIP"] == "None"
    assert "clusterIP" not in plain["spec"]  # kube-proxy's virtual IP: the baseline
    assert [p["name"] for p in headless["spec"]["ports"]] == ["http", "kv-events", "kv-replay"]

    router = one(objects, "Deployment", "-router")
    pod = router["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[0] == "serve"
    roles = by_kind(objects, "Role")
    if discovery == "dns":
        # `kvroute serve`'s own parser reads the chart's command line.
        config = serve_config(args[1:])
        assert (config.discovery.host, config.discovery.port) == (
            f"{headless['metadata']['name']}.{NAMESPACE}.svc.cluster.local", 8000)
        assert (config.host, config.port, config.policy) == ("0.0.0.0", 8080, "kv-aware")
        events = config.events
        assert (events.port, events.replay_port, events.topic) == (5557, 5558, "kv-events")
        assert pod["automountServiceAccountToken"] is False
        assert roles == []  # no API access at all
        return
    # The EndpointSlice flag: the headless Service in the release's namespace, port "http".
    spec = flag(args, "--k8s-service")
    stub = KubeConfig.from_server("http://127.0.0.1:1", namespace="elsewhere")
    slices = EndpointSliceDiscovery.from_spec(spec, config=stub)
    assert (slices.namespace, slices.service, slices.port) == (NAMESPACE, headless["metadata"]["name"], "http")
    assert "http" in {p["name"] for p in headless["spec"]["ports"]}
    # Every other flag is one `kvroute serve` knows.
    others = args[1:args.index("--k8s-service")] + args[args.index("--k8s-service") + 2:]
    config = serve_config([*others, "--dns", "placeholder:8000"])
    assert (config.host, config.port, config.events.port, config.events.replay_port) == ("0.0.0.0", 8080, 5557, 5558)
    assert pod["automountServiceAccountToken"] is True
    (role,) = roles
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    binding = one(objects, "RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                    "namespace": NAMESPACE}]
    assert one(objects, "ServiceAccount")["metadata"]["name"] == pod["serviceAccountName"]


def test_router_replicas_share_their_decisions_through_a_headless_service():
    objects = render({})
    mesh = one(objects, "Service", "-router-mesh")
    assert mesh["spec"]["clusterIP"] == "None" and mesh["spec"]["publishNotReadyAddresses"] is True
    assert [(p["name"], p["port"], p["targetPort"]) for p in mesh["spec"]["ports"]] == [("mesh", 5600, "mesh")]
    router = one(objects, "Deployment", "-router")
    assert selects(mesh["spec"]["selector"], router["spec"]["template"]["metadata"]["labels"])
    container = router["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "mesh", "containerPort": 5600} in container["ports"]
    # `kvroute serve`'s own parser reads the chart's command line.
    config = serve_config(container["args"][1:])
    assert config.mesh_bind == "0.0.0.0:5600"
    assert config.peers == (f"{mesh['metadata']['name']}.{NAMESPACE}.svc.cluster.local:5600",)

    alone = render({"router": {"mesh": {"enabled": False}}})
    assert not [s for s in by_kind(alone, "Service") if s["metadata"]["name"].endswith("-router-mesh")]
    args = one(alone, "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--mesh-bind" not in args and "--peer" not in args


def test_service_monitor_is_optional_and_scrapes_each_worker_once():
    assert by_kind(render({}), "ServiceMonitor") == []
    objects = render({"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}})
    monitor = one(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped = sorted(s["metadata"]["name"] for s in by_kind(objects, "Service")
                     if selects(selector, s["metadata"]["labels"]))
    # The headless Service (one target per pod) and the routers; the plain Service would scrape
    # the same pods a second time.
    assert scraped == [f"{RELEASE}-kvroute-router", f"{RELEASE}-kvroute-workers-headless"]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    for svc in by_kind(objects, "Service"):
        if svc["metadata"]["name"] in scraped:
            assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}


@pytest.mark.parametrize("target, url", [("service", "http://kv-kvroute-workers:8000"),
                                         ("router", "http://kv-kvroute-router:8080")])
def test_bench_job_measures_the_chosen_service(target, url):
    objects = render(values_file("values-6-workers.yaml"), {"bench": {"enabled": True, "target": target}})
    job = one(objects, "Job")
    assert job["metadata"]["name"] == f"kv-kvroute-bench-{target}"
    assert job["spec"]["backoffLimit"] == 0
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["BENCH_URL"] == url
    assert env["BENCH_LABEL"] == target
    assert env["WORKERS"] == "6"
    assert env["WORKERS_HOST"] == f"kv-kvroute-workers-headless.{NAMESPACE}.svc.cluster.local"
    if target == "router":  # every replica's refreshes summed
        assert (env["ROUTERS_HOST"], env["ROUTER_PORT"], env["ROUTERS"]) == (
            f"kv-kvroute-router-mesh.{NAMESPACE}.svc.cluster.local", "8080", "2")
    else:
        assert "ROUTERS_HOST" not in env
    assert container["args"] == ["--prefixes", "2,7,12,24", "--concurrency", "4,8,16", "--trials", "3"]
    # What the Job's script adds plus the chart's arguments: a command line `kvroute bench` takes.
    from kvroute.commands import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    parsed = parser.parse_args(["--url", env["BENCH_URL"], "--label", target, "--workers", "6", "--out", "/results/x",
                                "--metrics-url", "http://10.0.0.1:8000",
                                "--router-metrics-url", "http://10.0.0.2:8080", *container["args"]])
    assert (parsed.prefixes, parsed.concurrency, parsed.trials) == ("2,7,12,24", "4,8,16", 3)
    # The script the Job runs is the chart's file, verbatim.
    script = one(objects, "ConfigMap", f"-bench-{target}")["data"]["run-bench.py"]
    assert script == (CHART / "files" / "run-bench.py").read_text()
    claim = one(objects, "PersistentVolumeClaim")
    results = next(v for v in pod["volumes"] if v["name"] == "results")
    assert results["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]


def test_bench_job_without_persistence_keeps_results_in_the_pod():
    job = one(render({"bench": {"enabled": True}}), "Job")
    results = next(v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "results")
    assert results == {"name": "results", "emptyDir": {}}


@pytest.mark.parametrize("values, message", [
    ({"bench": {"enabled": True, "target": "pods"}}, "bench.target must be service or router"),
    ({"bench": {"enabled": True, "target": "router"}, "router": {"enabled": False}}, "needs router.enabled=true"),
    ({"router": {"replicas": 1}}, "router.replicas must be at least 2"),
    ({"router": {"discovery": "consul"}}, "router.discovery must be dns, k8s or pool"),
])
def test_bad_values_fail_with_a_message(values, message):
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render(values)


# --- Grafana dashboard ------------------------------------------------------------------------------


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]


def metric_names(exprs: list[str]) -> set[str]:
    return {m for e in exprs for m in re.findall(r"\b((?:vllm:|kvroute_)[a-z_:]+)\b", e)}


def exposition_names(text: str) -> set[str]:
    """Sample names of a Prometheus text exposition (with _total, _bucket, ... suffixes)."""
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def declared_names(text: str) -> set[str]:
    """Sample names of every family a Prometheus text exposition declares (``# TYPE``)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
            names |= {name + suffix for suffix in suffixes}
    return names


async def test_dashboard_queries_only_metrics_that_exist():
    """Every vllm:* series the dashboard reads is one the vLLM-compatible emulator exports, and
    every kvroute_* series one the router exports."""
    import aiohttp

    from kvroute.emulator import EmulatorConfig, start_workers
    from kvroute.router import EventsSettings, EventsSource, RouterConfig, start_router

    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"})
    config = EmulatorConfig.for_model("qwen3-0.6b", timing="instant", max_model_len=512, kv_events_config=events)
    (worker,) = await start_workers(config, 1)
    try:
        per_worker = {worker.url: EventsSource(worker.kv_events_endpoint)}
        router_config = RouterConfig(workers=[worker.url], events=EventsSettings(per_worker=per_worker),
                                     health_interval_s=0)
        async with start_router(router_config) as router, aiohttp.ClientSession() as session:
            async with session.post(f"{router.url}/v1/completions",
                                    json={"prompt": list(range(100, 200)), "max_tokens": 1}) as resp:
                assert resp.status == 200
            async with session.get(f"{worker.url}/metrics") as resp:
                exported = exposition_names(await resp.text())
            # A labelled family has no sample until a child exists (an upstream error, say):
            # the router declares every family it has.
            exported |= declared_names(router.metrics_text())
    finally:
        await worker.close()

    exprs = dashboard_exprs()
    used = metric_names(exprs)
    assert {"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
            "vllm:time_to_first_token_seconds_bucket", "kvroute_router_decisions_total",
            "kvroute_router_overlap_blocks_sum", "kvroute_router_routing_seconds_bucket"} <= used
    assert used - exported == set()


def test_dashboard_hit_ratio_is_per_worker_from_token_counters():
    dashboard = json.loads(DASHBOARD.read_text())
    panel = next(p for p in dashboard["panels"] if p["title"] == "Token hit ratio per worker")
    (target,) = panel["targets"]
    compact = re.sub(r"\s+", "", target["expr"])
    assert compact.startswith("sumby(pod)(rate(vllm:prefix_cache_hits_total{")
    assert "/sumby(pod)(rate(vllm:prefix_cache_queries_total{" in compact
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for expr in dashboard_exprs():
        assert set(re.findall(r"\$(\w+)", expr)) - {"__rate_interval"} <= variables


# --- the bench Job's script and the image ---------------------------------------------------------


@pytest.fixture
def models_server():
    """A server on 127.0.0.1 answering GET /v1/models, as the measured Service does when ready."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def run_bench_script(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHART / "files" / "run-bench.py"), *args],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=60)


def test_bench_job_script_passes_every_worker_and_ends_with_the_summary(tmp_path, models_server):
    """Run the Job's script with a stand-in `kvroute` on PATH that records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "kvroute"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, sys, pathlib\n"
        "args = sys.argv[1:]\n"
        "out = pathlib.Path(args[args.index('--out') + 1]); out.mkdir(parents=True)\n"
        "(out / 'argv.json').write_text(json.dumps(args))\n"
        "(out / 'summary.json').write_text(json.dumps({'points': [{'hit_rate': 0.95}]}, indent=2))\n"
        "print('tables')\n"
    )
    fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "BENCH_URL": models_server, "BENCH_LABEL": "service",
           "WORKERS_HOST": "localhost", "WORKER_PORT": "8000", "WORKERS": "1", "WAIT_SECONDS": "5",
           "RESULTS_DIR": str(tmp_path / "results"),
           "ROUTERS_HOST": "localhost", "ROUTER_PORT": "8080", "ROUTERS": "1"}
    done = run_bench_script(env, "--prefixes", "2", "-c", "8")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"points": [{"hit_rate": 0.95}]}
    (run,) = (tmp_path / "results").iterdir()
    assert run.name.startswith("service-")
    argv = json.loads((run / "argv.json").read_text())
    assert argv[:5] == ["bench", "--url", models_server, "--label", "service"]
    metrics = [argv[i + 1] for i, a in enumerate(argv) if a == "--metrics-url"]
    assert metrics and all(re.fullmatch(r"http://(127\.0\.0\.1|\[::1\]):8000", m) for m in metrics)
    assert flag(argv, "--workers") == str(len(metrics))
    routers = [argv[i + 1] for i, a in enumerate(argv) if a == "--router-metrics-url"]
    assert routers and all(re.fullmatch(r"http://(127\.0\.0\.1|\[::1\]):8080", m) for m in routers)
    assert argv[-4:] == ["--prefixes", "2", "-c", "8"]


def test_bench_job_script_gives_up_when_workers_or_the_target_do_not_answer(tmp_path, models_server):
    env = {"BENCH_URL": models_server, "BENCH_LABEL": "service", "WORKERS_HOST": "localhost",
           "WORKER_PORT": "8000", "WORKERS": "99", "WAIT_SECONDS": "0", "RESULTS_DIR": str(tmp_path)}
    done = run_bench_script(env)
    assert done.returncode == 1
    assert "of 99 workers resolve as localhost" in done.stderr
    # The workers are there but the measured Service does not answer (a router not ready yet).
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    done = run_bench_script({**env, "WORKERS": "1", "BENCH_URL": closed})
    assert done.returncode == 1
    assert f"{closed}/v1/models does not answer" in done.stderr
    assert not any(tmp_path.iterdir())  # kvroute bench never ran


def test_dockerfile_copies_what_the_package_build_reads():
    dockerfile = (ROOT / "Dockerfile").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    readme = re.search(r'^readme\s*=\s*"([^"]+)"', pyproject, re.M).group(1)
    copied = {p for line in re.findall(r"^COPY\s+(.+)$", dockerfile, re.M) for p in line.split()[:-1]}
    # The wheel's native core is built from the cargo workspace.
    assert {"pyproject.toml", readme, "src", "Cargo.toml", "Cargo.lock", "crates"} <= copied
    assert re.search(r'^ENTRYPOINT \["kvroute"\]$', dockerfile, re.M)
    # The chart runs its pods as this user.
    values = values_file("values.yaml")
    assert "--uid 10001" in dockerfile and "USER 10001" in dockerfile
    assert values["router"]["port"] == int(re.search(r"^EXPOSE (\d+)$", dockerfile, re.M).group(1))


def test_gateway_mode_is_an_inference_pool_its_endpoint_picker_and_a_route():
    import jsonschema

    objects = render(values_file("values.yaml"), values_file("values-3-workers.yaml"), GATEWAY_ON,
                     {"router": {"enabled": False, "discovery": "k8s"}})
    pool = one(objects, "InferencePool")
    crd = yaml.safe_load(INFERENCE_POOL_CRD.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert pool["apiVersion"] == f"{crd['spec']['group']}/v1"
    jsonschema.validate(pool, v1["schema"]["openAPIV3Schema"])
    worker = one(objects, "Deployment", "-worker")
    assert selects(pool["spec"]["selector"]["matchLabels"], worker["spec"]["template"]["metadata"]["labels"])
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["failureMode"] == "FailClose"
    epp_service = one(objects, "Service", "-epp")
    assert ref["name"] == epp_service["metadata"]["name"]
    assert ref["port"]["number"] in {p["port"] for p in epp_service["spec"]["ports"]}
    epp = one(objects, "Deployment", "-epp")
    container = epp["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[0] == "epp" and flag(args, "--grpc-port") == "9002" and flag(args, "--port") == "9090"
    assert flag(args, "--k8s-service").endswith("-workers-headless:http")
    assert flag(args, "--kv-events-port") == "5557"
    assert container["readinessProbe"]["grpc"] == {"port": 9002, "service": "readiness"}
    assert container["livenessProbe"]["grpc"] == {"port": 9002, "service": "liveness"}
    # EndpointSlice discovery: the EPP runs as the account the Role is bound to.
    role_binding = one(objects, "RoleBinding")
    assert epp["spec"]["template"]["spec"]["serviceAccountName"] == role_binding["subjects"][0]["name"]
    # No router: the gateway is the only hop.
    assert {o["metadata"]["name"] for o in by_kind(objects, "Deployment")} == {
        epp["metadata"]["name"], worker["metadata"]["name"]}
    route = one(objects, "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": pool["metadata"]["name"]}]
    assert route["spec"]["parentRefs"][0]["name"] == "inference-gateway"


def test_epp_replicas_share_their_decisions_through_a_headless_service():
    objects = render(values_file("values.yaml"), {"gateway": {"enabled": True, "replicas": 3}})
    mesh = one(objects, "Service", "-epp-mesh")
    assert mesh["spec"]["clusterIP"] == "None" and mesh["spec"]["publishNotReadyAddresses"] is True
    assert [(p["name"], p["port"], p["targetPort"]) for p in mesh["spec"]["ports"]] == [("mesh", 5600, "mesh")]
    epp = one(objects, "Deployment", "-epp")
    assert epp["spec"]["replicas"] == 3
    assert selects(mesh["spec"]["selector"], epp["spec"]["template"]["metadata"]["labels"])
    # Only the EPPs: the routers have a mesh of their own.
    router = one(objects, "Deployment", "-router")
    assert not selects(mesh["spec"]["selector"], router["spec"]["template"]["metadata"]["labels"])
    container = epp["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "mesh", "containerPort": 5600} in container["ports"]
    # `kvroute epp`'s own parser reads the chart's command line.
    args = container["args"]
    assert args[0] == "epp"
    config = serve_config(args[1:], epp=True)
    assert config.grpc_port == 9002
    assert config.mesh_bind == "0.0.0.0:5600"
    assert config.peers == (f"{mesh['metadata']['name']}.{NAMESPACE}.svc.cluster.local:5600",)

    alone = render(values_file("values.yaml"), {"gateway": {"enabled": True, "mesh": {"enabled": False}}})
    assert not [s for s in by_kind(alone, "Service") if s["metadata"]["name"].endswith("-epp-mesh")]
    args = one(alone, "Deployment", "-epp")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--mesh-bind" not in args and "--peer" not in args


def test_gateway_failure_mode_is_checked():
    with pytest.raises(Exception, match="FailOpen or FailClose"):
        render(values_file("values.yaml"), {"gateway": {"enabled": True, "failureMode": "Sometimes"}})
    pool = one(render(values_file("values.yaml"), {"gateway": {"enabled": True, "failureMode": "FailOpen"}}),
               "InferencePool")
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"


def test_gateway_mode_can_follow_the_inference_pool_itself():
    objects = render(values_file("values.yaml"), GATEWAY_ON, {"router": {"enabled": False, "discovery": "pool"}})
    pool = one(objects, "InferencePool")
    epp = one(objects, "Deployment", "-epp")
    spec = epp["spec"]["template"]["spec"]
    assert flag(spec["containers"][0]["args"], "--pool") == f"{NAMESPACE}/{pool['metadata']['name']}"
    assert spec["automountServiceAccountToken"] is True
    rules = one(objects, "Role")["rules"]
    assert rules == [
        {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    ]
    for obj in objects:
        if obj["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(obj, KUBE_VERSIONS[-1], strict=True)
    with pytest.raises(Exception, match="set gateway.enabled=true"):
        render(values_file("values.yaml"), {"router": {"discovery": "pool"}})
