//! The server: a tokio runtime of `threads` threads, the accept loop, the routes, the
//! per-request flow (edge → prompt → routing step → relay), health checks and drain.
//!
//! Failure rules: a worker that refuses the connection, drops it before
//! answering, or misses `first_byte_timeout` is taken out (refused) or charged a failure, and
//! the request goes to another worker, only before the first response byte, so nothing is ever
//! sent twice to the client. After it, a worker that dies or stays silent ends the client's
//! stream with an SSE error event, or a non-streamed request with a 502. No available worker
//! is a 503. While draining (SIGTERM) new requests get 503 and `/health` fails; in-flight ones
//! finish.
//!
//! One concept a module: [`state`] (the router without a front: its state, runtime and
//! lifetime), [`pipeline`] (a request up to its decision, shared with the Endpoint Picker),
//! [`forward`] (serve's relay of a decided request), [`routes`], [`accept`] (connections),
//! [`background`] (health checks, KV capacity, notices), [`refresh`] (retention's refreshes).

mod accept;
mod background;
mod forward;
mod mesh;
pub mod pipeline;
mod refresh;
mod routes;
pub mod state;

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;

pub use pipeline::{Admitted, Decision, InFlight, Load, Pipeline};
pub use state::{Router, WorkerView, monotonic_seconds};

use crate::config::{ConfigError, ServeConfig, WorkerSpec};
use crate::edge;

/// Response header naming the worker that served the request.
pub const WORKER_HEADER: &str = "x-kvroute-worker";
/// The largest `/v1/models` answer relayed (read whole; vLLM's are a few hundred bytes a model).
pub const MAX_ANSWER_BYTES: usize = 64 << 20;
/// Whole answers up to this size are read before they are relayed, so that a worker breaking
/// while it sends one gets the client a 502 (vLLM's are kilobytes); longer ones (logprobs of a
/// long generation run to megabytes) are relayed as they come, so that clients that read them
/// slowly each hold at most about this much of the router's memory, not the whole answer.
pub const BUFFERED_ANSWER_BYTES: usize = 64 << 10;
/// How many times as often as a healthy worker one out of the available set is checked.
pub const UNHEALTHY_CHECKS_PER_INTERVAL: u32 = 4;
/// How long the event consumer lets batches gather after taking some: one wake-up of its
/// thread for several engine steps, beside engine steps of tens of milliseconds (the index
/// learns of a batch at most this much later; `benchmarks/kv_events_consume.py`).
pub const EVENTS_COALESCE: Duration = Duration::from_millis(2);
/// Bodies over `--offload-bytes` parsed at once; the others wait once read.
pub const LARGE_BODIES: usize = 2;
/// Refreshes open at once per worker; more are dropped (counted), never queued.
pub const MAX_REFRESHES_OPEN: usize = 4;

/// `kvroute serve`: a [`Router`] behind the OpenAI-compatible HTTP front. Dropping it stops
/// it (without a drain).
pub struct Server {
    router: Router,
    addr: SocketAddr,
}

impl Server {
    /// Validate `config`, bind its address and start serving.
    pub fn start(config: ServeConfig) -> Result<Self, ConfigError> {
        let (host, port) = (config.host.clone(), config.port);
        let router = Router::start(config)?;
        let listener = router
            .runtime()
            .block_on(TcpListener::bind((host.as_str(), port)))
            .map_err(|e| ConfigError(format!("cannot listen on {host}:{port}: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| ConfigError(e.to_string()))?;
        router.runtime().spawn(accept::accept_loop(
            listener,
            router.shared(),
            router.stopped(),
        ));
        Ok(Self { router, addr })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The router behind the front.
    pub fn router(&self) -> &Router {
        &self.router
    }

    /// Replace the worker list (discovery's complete list).
    pub fn set_workers(&self, workers: &[WorkerSpec]) -> Result<(), ConfigError> {
        self.router.set_workers(workers)
    }

    /// The text of `/metrics`.
    pub fn metrics_text(&self) -> String {
        self.router.metrics_text()
    }

    /// The index the routing step reads (shared with the KV-event consumer).
    pub fn index(&self) -> kvroute_io::consumer::SharedIndex {
        self.router.index()
    }

    /// Every worker's state now.
    pub fn workers(&self) -> Vec<WorkerView> {
        self.router.workers()
    }

    /// Retention's counters (None when it is off).
    pub fn retention_stats(&self) -> Option<kvroute_core::retention::RetentionStats> {
        self.router.retention_stats()
    }

    /// The request body limit and where it came from.
    pub fn body_limit(&self) -> &edge::BodyLimit {
        self.router.body_limit()
    }

    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        self.router.in_flight()
    }

    /// Refuse new requests (503, `/health` failing) and wait up to `timeout` for the ones in
    /// flight; true when they all finished.
    pub fn drain(&self, timeout: Duration) -> bool {
        self.router.drain(timeout)
    }

    /// Stop listening and end every connection.
    pub fn shutdown(self) {
        self.router.shutdown();
    }
}
