//! `NativeRouter` for Python: the native data plane (`kvroute_serve`) that `kvroute serve`
//! starts, or the same router behind the Endpoint Picker's gRPC front (`kvroute_epp`) that
//! `kvroute epp` starts. Python parses the command line and hands the values over;
//! everything per request runs on the server's own threads, without the GIL.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use kvroute_core::mesh::MeshConfig;
use kvroute_core::retention::RetentionMode;
use kvroute_epp::Epp;
use kvroute_serve::mesh::MeshSettings;
use kvroute_serve::{EventSource, PolicySpec, Router, ServeConfig, Server, WorkerSpec};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::index::PyKvIndex;
use crate::retention::retention_stats_dict;

fn seconds(value: f64, name: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value)
        .map_err(|_| PyValueError::new_err(format!("{name} must be >= 0 seconds, got {value}")))
}

fn positive(value: f64, name: &str) -> PyResult<Duration> {
    if value <= 0.0 {
        return Err(PyValueError::new_err(format!(
            "{name} must be positive, got {value}"
        )));
    }
    seconds(value, name)
}

/// A limit that None turns off.
fn limit(value: Option<f64>, name: &str) -> PyResult<Option<Duration>> {
    value
        .map(|v| {
            positive(v, name).map_err(|_| {
                PyValueError::new_err(format!(
                    "{name} must be positive (or None for no limit), got {v}"
                ))
            })
        })
        .transpose()
}

/// `policy`'s options from a dict of ``name: value`` (None turns a guard off).
fn policy_spec(
    name: &str,
    options: Option<&Bound<'_, PyDict>>,
    seed: Option<u64>,
) -> PyResult<PolicySpec> {
    let mut spec = PolicySpec::named(name);
    spec.seed = seed;
    let Some(options) = options else {
        return Ok(spec);
    };
    for (key, value) in options.iter() {
        let key: String = key.extract()?;
        let number: Option<f64> = value.extract()?;
        let need = || {
            number
                .ok_or_else(|| PyValueError::new_err(format!("policy option {key} needs a number")))
        };
        match (name, key.as_str()) {
            ("kv-aware", "overlap_weight") => spec.kv_aware.overlap_weight = need()?,
            ("kv-aware", "request_weight") => spec.kv_aware.request_weight = need()?,
            ("kv-aware", "load_factor") => spec.kv_aware.load_factor = number,
            ("kv-aware", "share_factor") => spec.kv_aware.share_factor = number,
            ("kv-aware", "share_window") => spec.kv_aware.share_window = need()?,
            ("kv-aware", "share_weight") => spec.kv_aware.share_weight = need()?,
            ("kv-aware", "admission_wait") => spec.kv_aware.admission_wait = number,
            ("kv-aware", "adapter_weight") => spec.kv_aware.adapter_weight = need()?,
            ("prefix-hash", "load_factor") => spec.prefix_hash.load_factor = number,
            ("prefix-hash", "key_blocks") => spec.prefix_hash.key_blocks = need()? as usize,
            // The router's own block size is the policy's.
            (_, "block_size") => {}
            _ => {
                return Err(PyValueError::new_err(format!(
                    "policy {name} takes no option {key}"
                )));
            }
        }
    }
    Ok(spec)
}

/// Worker specs from URLs or ``(url, name, events_endpoint | None, replay_endpoint | None,
/// ready)`` tuples.
fn worker_specs(workers: &Bound<'_, PyAny>) -> PyResult<Vec<WorkerSpec>> {
    let mut out = Vec::new();
    for item in workers.try_iter()? {
        let item = item?;
        if let Ok(url) = item.extract::<String>() {
            out.push(WorkerSpec::url(url));
            continue;
        }
        let (url, name, endpoint, replay_endpoint, ready): (
            String,
            String,
            Option<String>,
            Option<String>,
            bool,
        ) = item.extract()?;
        out.push(WorkerSpec {
            url,
            name,
            events: endpoint.map(|endpoint| EventSource {
                endpoint,
                replay_endpoint,
            }),
            ready,
        });
    }
    Ok(out)
}

/// The native router, serving from the moment it is made (see ``kvroute.router.server``).
/// Every argument is required: ``kvroute.router.server.native_arguments`` passes them all, with
/// the defaults ``serve_defaults`` reports.
///
/// Raises:
///     ValueError: a bad configuration, or the address cannot be bound (the message says which).
#[pyclass(module = "kvroute._native", frozen)]
pub struct NativeRouter {
    server: Mutex<Option<Front>>,
    host: String,
    port: u16,
    grpc_port: Option<u16>,
}

/// The router's front: serve's HTTP proxy, or the Endpoint Picker.
enum Front {
    Serve(Server),
    Epp(Epp),
}

impl Front {
    fn router(&self) -> &Router {
        match self {
            Front::Serve(s) => s.router(),
            Front::Epp(e) => e.router(),
        }
    }
}

impl NativeRouter {
    fn with<T>(&self, f: impl FnOnce(&Front) -> T) -> PyResult<T> {
        let guard = self.server.lock().unwrap_or_else(|p| p.into_inner());
        guard
            .as_ref()
            .map(f)
            .ok_or_else(|| PyRuntimeError::new_err("the router is closed"))
    }
}

#[pymethods]
impl NativeRouter {
    #[new]
    #[pyo3(signature = (
        workers, *, host, port, threads, policy, policy_options, seed, block_size, hash_seed,
        tokenizer, prompt_cache_bytes, predicted_ttl_s, predicted_capacity_blocks, index_max_bytes,
        max_body_bytes, max_buffered_body_bytes, max_json_depth, offload_bytes, header_timeout_s,
        keepalive_timeout_s, send_timeout_s, body_timeout_s, max_connections, connect_timeout_s,
        first_byte_timeout_s, stream_idle_timeout_s, max_attempts, health_interval_s,
        health_timeout_s, eject_after_failures, eject_base_s, api_key, metrics_public,
        worker_api_key, forward_authorization, events_topic, retention, retention_capacity_blocks,
        kv_capacity_blocks, grpc_port = None, mesh_bind = None, peers = Vec::new(),
        mesh_liveness_s = 3.0, max_loras = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        workers: &Bound<'_, PyAny>,
        host: String,
        port: u16,
        threads: usize,
        policy: String,
        policy_options: Option<&Bound<'_, PyDict>>,
        seed: Option<u64>,
        block_size: usize,
        hash_seed: u64,
        tokenizer: Option<PathBuf>,
        prompt_cache_bytes: usize,
        predicted_ttl_s: Option<f64>,
        predicted_capacity_blocks: Option<usize>,
        index_max_bytes: Option<usize>,
        max_body_bytes: Option<usize>,
        max_buffered_body_bytes: usize,
        max_json_depth: usize,
        offload_bytes: usize,
        header_timeout_s: f64,
        keepalive_timeout_s: f64,
        send_timeout_s: Option<f64>,
        body_timeout_s: f64,
        max_connections: usize,
        connect_timeout_s: f64,
        first_byte_timeout_s: Option<f64>,
        stream_idle_timeout_s: Option<f64>,
        max_attempts: usize,
        health_interval_s: f64,
        health_timeout_s: f64,
        eject_after_failures: u32,
        eject_base_s: f64,
        api_key: Option<String>,
        metrics_public: bool,
        worker_api_key: Option<String>,
        forward_authorization: bool,
        events_topic: String,
        retention: Option<String>,
        retention_capacity_blocks: usize,
        kv_capacity_blocks: Option<usize>,
        grpc_port: Option<u16>,
        mesh_bind: Option<String>,
        peers: Vec<String>,
        mesh_liveness_s: f64,
        max_loras: Option<usize>,
    ) -> PyResult<Self> {
        if max_loras == Some(0) {
            return Err(PyValueError::new_err("max_loras must be >= 1, got 0"));
        }
        let mesh = match mesh_bind {
            Some(bind) => Some(MeshSettings {
                bind,
                peers,
                config: MeshConfig {
                    liveness_s: positive(mesh_liveness_s, "mesh_liveness_s")?.as_secs_f64(),
                    ..MeshConfig::default()
                },
            }),
            None if !peers.is_empty() => {
                return Err(PyValueError::new_err(
                    "peers need a mesh address of this replica's own (mesh_bind)",
                ));
            }
            None => None,
        };
        let mode = match retention.as_deref() {
            None => RetentionMode::Off,
            Some(name) => name.parse().map_err(PyValueError::new_err)?,
        };
        let retention = (mode != RetentionMode::Off).then_some((mode, retention_capacity_blocks));
        let config = ServeConfig {
            host: host.clone(),
            port,
            threads,
            workers: worker_specs(workers)?,
            events_topic,
            policy: policy_spec(&policy, policy_options, seed)?,
            block_size,
            hash_seed,
            tokenizer,
            prompt_cache_bytes,
            predicted_ttl_s,
            predicted_capacity_blocks,
            index_max_bytes,
            max_body_bytes,
            max_buffered_body_bytes,
            max_json_depth,
            offload_bytes,
            header_timeout: positive(header_timeout_s, "header_timeout_s")?,
            keepalive_timeout: positive(keepalive_timeout_s, "keepalive_timeout_s")?,
            send_timeout: limit(send_timeout_s, "send_timeout_s")?,
            body_timeout: positive(body_timeout_s, "body_timeout_s")?,
            max_connections,
            connect_timeout: positive(connect_timeout_s, "connect_timeout_s")?,
            first_byte_timeout: limit(first_byte_timeout_s, "first_byte_timeout_s")?,
            stream_idle_timeout: limit(stream_idle_timeout_s, "stream_idle_timeout_s")?,
            max_attempts,
            health_interval: if health_interval_s > 0.0 {
                Some(seconds(health_interval_s, "health_interval_s")?)
            } else {
                None
            },
            health_timeout: positive(health_timeout_s, "health_timeout_s")?,
            eject_after_failures,
            eject_base: seconds(eject_base_s, "eject_base_s")?,
            api_key,
            metrics_public,
            worker_api_key,
            forward_authorization,
            retention,
            kv_capacity_blocks,
            max_loras,
            mesh,
        };
        // With a gRPC port: the Endpoint Picker (`port` serves its /metrics).
        let front = py
            .detach(|| match grpc_port {
                None => Server::start(config).map(Front::Serve),
                Some(grpc) => Epp::start(config, grpc).map(Front::Epp),
            })
            .map_err(|e| PyValueError::new_err(e.0))?;
        let (port, grpc_port) = match &front {
            Front::Serve(s) => (s.local_addr().port(), None),
            Front::Epp(e) => (e.http_addr().port(), Some(e.grpc_addr().port())),
        };
        Ok(Self {
            server: Mutex::new(Some(front)),
            host,
            port,
            grpc_port,
        })
    }

    /// The Endpoint Picker's ext_proc port (None for serve's HTTP router).
    #[getter]
    fn grpc_port(&self) -> Option<u16> {
        self.grpc_port
    }

    /// The address it listens on.
    #[getter]
    fn host(&self) -> &str {
        &self.host
    }

    /// The port it listens on (the one bound when asked for port 0).
    #[getter]
    fn port(&self) -> u16 {
        self.port
    }

    /// Replace the worker list (a discovery source's complete list): URLs, or
    /// ``(url, name, events_endpoint | None, replay_endpoint | None, ready)`` tuples.
    fn set_workers(&self, workers: &Bound<'_, PyAny>) -> PyResult<()> {
        let specs = worker_specs(workers)?;
        self.with(|f| match f {
            Front::Serve(s) => s.set_workers(&specs),
            Front::Epp(e) => e.set_workers(&specs),
        })?
        .map_err(|e| PyValueError::new_err(e.0))
    }

    /// ``host:port`` of the replica mesh's PUB socket (the one bound when asked for port 0);
    /// None without a mesh.
    #[getter]
    fn mesh_address(&self) -> PyResult<Option<String>> {
        self.with(|s| s.router().mesh_addr().map(|a| a.to_string()))
    }

    /// Replace the replica mesh's peers (``host:port`` each: discovery's list).
    fn set_peers(&self, peers: Vec<String>) -> PyResult<()> {
        self.with(|s| s.router().set_peers(peers))
    }

    /// The text ``GET /metrics`` answers.
    fn metrics_text(&self) -> PyResult<String> {
        self.with(|f| match f {
            Front::Serve(s) => s.metrics_text(),
            Front::Epp(e) => e.metrics_text(),
        })
    }

    /// The index the routing step reads (a ``KvIndex`` sharing the router's).
    #[getter]
    fn index(&self, py: Python<'_>) -> PyResult<PyKvIndex> {
        let shared = self.with(|f| f.router().index())?;
        PyKvIndex::from_shared(py, shared)
    }

    /// Every worker's state: a list of dicts with ``name``, ``url``, ``ready``, ``healthy``, ``available``,
    /// ``in_flight``, ``in_flight_tokens``, ``ejections`` and ``consecutive_failures``.
    fn workers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for w in self.with(|f| f.router().workers())? {
            let d = PyDict::new(py);
            d.set_item("name", w.name)?;
            d.set_item("url", w.url)?;
            d.set_item("ready", w.ready)?;
            d.set_item("healthy", w.healthy)?;
            d.set_item("available", w.available)?;
            d.set_item("in_flight", w.in_flight)?;
            d.set_item("in_flight_tokens", w.in_flight_tokens)?;
            d.set_item("ejections", w.ejections)?;
            d.set_item("consecutive_failures", w.consecutive_failures)?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// Retention's counters as ``kvroute._native.Retention.stats`` gives them; None when off.
    fn retention_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(stats) = self.with(|f| f.router().retention_stats())? else {
            return Ok(None);
        };
        Ok(Some(retention_stats_dict(py, &stats)?))
    }

    /// The request body limit (bytes): as given, else derived from the tokenizer.
    #[getter]
    fn max_body_bytes(&self) -> PyResult<usize> {
        self.with(|f| f.router().body_limit().bytes)
    }

    /// Where :attr:`max_body_bytes` came from, for the start-up line.
    #[getter]
    fn max_body_source(&self) -> PyResult<String> {
        self.with(|f| f.router().body_limit().source.clone())
    }

    /// Requests in flight.
    #[getter]
    fn in_flight(&self) -> PyResult<usize> {
        self.with(|f| f.router().in_flight())
    }

    /// Refuse new requests and wait up to ``timeout_s`` for those in flight; True when they
    /// all finished.
    fn drain(&self, py: Python<'_>, timeout_s: f64) -> PyResult<bool> {
        let timeout = seconds(timeout_s, "timeout_s")?;
        py.detach(|| {
            self.with(|f| match f {
                Front::Serve(s) => s.drain(timeout),
                Front::Epp(e) => e.drain(timeout),
            })
        })
    }

    /// Stop serving (idempotent).
    fn close(&self, py: Python<'_>) {
        let server = self.server.lock().unwrap_or_else(|p| p.into_inner()).take();
        match server {
            Some(Front::Serve(s)) => py.detach(|| s.shutdown()),
            Some(Front::Epp(e)) => py.detach(|| e.shutdown()),
            None => {}
        }
    }
}

/// `ServeConfig::default()` in the units `NativeRouter` takes (seconds as floats, sizes in
/// bytes, None for a limit that is off): `kvroute.router.config` takes its defaults from here,
/// so that they are written once, in the data plane.
#[pyfunction]
fn serve_defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = ServeConfig::default();
    let secs = |t: Duration| t.as_secs_f64();
    let out = PyDict::new(py);
    out.set_item("host", d.host)?;
    out.set_item("threads", d.threads)?;
    out.set_item("prompt_cache_bytes", d.prompt_cache_bytes)?;
    out.set_item("predicted_capacity_blocks", d.predicted_capacity_blocks)?;
    out.set_item("index_max_bytes", d.index_max_bytes)?;
    out.set_item("max_buffered_body_bytes", d.max_buffered_body_bytes)?;
    out.set_item("max_json_depth", d.max_json_depth)?;
    out.set_item("offload_bytes", d.offload_bytes)?;
    out.set_item("header_timeout_s", secs(d.header_timeout))?;
    out.set_item("keepalive_timeout_s", secs(d.keepalive_timeout))?;
    out.set_item("send_timeout_s", d.send_timeout.map(secs))?;
    out.set_item("body_timeout_s", secs(d.body_timeout))?;
    out.set_item("connect_timeout_s", secs(d.connect_timeout))?;
    out.set_item("first_byte_timeout_s", d.first_byte_timeout.map(secs))?;
    out.set_item("stream_idle_timeout_s", d.stream_idle_timeout.map(secs))?;
    out.set_item("max_attempts", d.max_attempts)?;
    out.set_item("health_interval_s", d.health_interval.map_or(0.0, secs))?;
    out.set_item("health_timeout_s", secs(d.health_timeout))?;
    out.set_item("eject_after_failures", d.eject_after_failures)?;
    out.set_item("eject_base_s", secs(d.eject_base))?;
    Ok(out)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(serve_defaults, m)?)?;
    m.add(
        "DEFAULT_MAX_BODY_BYTES",
        kvroute_serve::edge::DEFAULT_MAX_BODY_BYTES,
    )?;
    m.add(
        "BODY_ENVELOPE_BYTES",
        kvroute_serve::edge::BODY_ENVELOPE_BYTES,
    )?;
    m.add(
        "EVENTS_COALESCE_S",
        kvroute_serve::server::EVENTS_COALESCE.as_secs_f64(),
    )?;
    m.add("DEFAULT_GRPC_PORT", kvroute_epp::DEFAULT_GRPC_PORT)?;
    m.add_class::<NativeRouter>()
}
