//! `NativeRouter` for Python: the native data plane (`kvroute_serve`) that `kvroute serve`
//! starts, or the same router behind the Endpoint Picker's gRPC front (`kvroute_epp`) that
//! `kvroute epp` starts. Python parses the command line and hands the configuration over
//! whole (a dict of `ServeConfig`'s fields, read by serde and checked once by
//! `ServeConfig::validate`); everything per request runs on the server's own threads,
//! without the GIL.

use std::sync::Mutex;
use std::time::Duration;

use crate::config::{config_error, read_config};
use crate::index::PyKvIndex;
use crate::retention::retention_stats_dict;
use kvroute_epp::Epp;
use kvroute_serve::{Router, ServeConfig, Server, WorkerSpec};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// The native router, serving from the moment it is made (see ``kvroute.router.server``,
/// whose ``native_config`` builds its configuration).
///
/// Raises:
///     ValueError: a bad configuration (arguments ``(field, message)``), or one the router
///         cannot start with, such as an address it cannot bind (the message).
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
    /// Start a router with ``config`` (a dict of ``ServeConfig``'s fields; absent ones at
    /// ``serve_defaults()``), behind the Endpoint Picker's gRPC front on ``grpc_port`` when
    /// given (``port`` then serves its ``/metrics`` and ``/health`` only).
    #[new]
    #[pyo3(signature = (config, *, grpc_port = None))]
    fn new(py: Python<'_>, config: &Bound<'_, PyAny>, grpc_port: Option<u16>) -> PyResult<Self> {
        let config: ServeConfig = read_config(config)?;
        let host = config.host.clone();
        let front = py
            .detach(|| match grpc_port {
                None => Server::start(config).map(Front::Serve),
                Some(grpc) => Epp::start(config, grpc).map(Front::Epp),
            })
            .map_err(config_error)?;
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

    /// Replace the worker list (a discovery source's complete list): dicts of
    /// ``WorkerSpec``'s fields (``url``; ``name``, ``events`` as ``{endpoint,
    /// replay_endpoint}``, ``ready``).
    fn set_workers(&self, workers: &Bound<'_, PyAny>) -> PyResult<()> {
        let specs: Vec<WorkerSpec> = read_config(workers)?;
        self.with(|f| match f {
            Front::Serve(s) => s.set_workers(&specs),
            Front::Epp(e) => e.set_workers(&specs),
        })?
        .map_err(config_error)
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
        let timeout = Duration::try_from_secs_f64(timeout_s).map_err(|_| {
            PyValueError::new_err(format!("timeout_s must be >= 0 seconds, got {timeout_s}"))
        })?;
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

/// Read and check ``config`` as ``NativeRouter`` would, without starting anything: the CLI
/// refuses a bad setting before it binds a port or follows a discovery source.
///
/// Raises:
///     ValueError: as ``NativeRouter`` does.
#[pyfunction]
fn check_serve_config(config: &Bound<'_, PyAny>) -> PyResult<()> {
    let config: ServeConfig = read_config(config)?;
    config.validate().map_err(config_error)
}

/// `ServeConfig::default()` as ``NativeRouter`` takes a configuration (seconds as floats,
/// sizes in bytes, None for a limit that is off): `kvroute.router.config` takes its defaults
/// from here, so that they are written once, in the data plane.
#[pyfunction]
fn serve_defaults(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    pythonize::pythonize(py, &ServeConfig::default())
        .map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(serve_defaults, m)?)?;
    m.add_function(wrap_pyfunction!(check_serve_config, m)?)?;
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
