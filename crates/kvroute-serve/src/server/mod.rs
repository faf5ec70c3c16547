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
//! One concept a module, each using only those listed before it: [`limits`] (bounds and
//! names), [`shared`] (what every connection and task shares), `mesh_link` (this replica's
//! end of the replica mesh), `refresh` (retention's refreshes), [`pipeline`] (a request up to
//! its decision, shared with the Endpoint Picker), `mesh` (peers' decisions applied),
//! `background` (health checks, KV capacity, notices), [`router`] (the router without a
//! front: its runtime and lifetime), `answers` (the responses serve's routes build),
//! `forward` (serve's relay of a decided request), `routes`, `accept` (connections).

mod accept;
mod answers;
mod background;
mod forward;
pub mod limits;
mod mesh;
mod mesh_link;
pub mod pipeline;
mod refresh;
pub mod router;
mod routes;
pub mod shared;

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;

pub use limits::{
    BUFFERED_ANSWER_BYTES, EVENTS_COALESCE, LARGE_BODIES, MAX_ANSWER_BYTES, MAX_REFRESHES_OPEN,
    UNHEALTHY_CHECKS_PER_INTERVAL, WORKER_HEADER,
};
pub use pipeline::{Admitted, Attempt, InFlight, Pipeline, RequestLoad};
pub use router::Router;
pub use shared::{WorkerView, monotonic_seconds};

use crate::config::{ConfigError, ServeConfig, WorkerSpec};
use crate::edge;

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
            .map_err(|e| ConfigError::new(format!("cannot listen on {host}:{port}: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| ConfigError::new(e.to_string()))?;
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
