//! The router's lifetime, without a front: `Shared` on one tokio runtime with its
//! background loops and the mesh. `kvroute serve`'s HTTP front ([`super::Server`]) and the
//! Endpoint Picker's gRPC front drive it through its [`Pipeline`].

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper::header::HeaderValue;
use kvroute_core::blocks::BlockHasher;
use tokio::sync::{Notify, watch};

use super::background::{health_loop, kv_capacity_loop, notice_loop};
use super::limits::LARGE_BODIES;
use super::mesh_link::MeshLink;
use super::pipeline::Pipeline;
use super::shared::{Shared, WorkerView};
use crate::config::{ConfigError, ServeConfig, WorkerSpec};
use crate::connections::Registry;
use crate::edge;
use crate::fleet::Fleet;
use crate::metrics::Metrics;
use crate::prompt::Prompts;
use crate::relay::{self};

/// A running router without a front. Dropping it stops it (without a drain).
pub struct Router {
    runtime: Option<tokio::runtime::Runtime>,
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    stopped: watch::Receiver<bool>,
}

impl Router {
    /// Validate `config` and start everything but a front: the runtime, the fleet and its
    /// event streams, and the background loops (health checks, KV capacity, notices).
    pub fn start(config: ServeConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let hasher = BlockHasher::new(config.block_size, config.hash_seed)
            .map_err(|e| ConfigError::new(e.to_string()))?;
        let prompts = Prompts::new(
            hasher,
            config.tokenizer.as_deref(),
            config.prompt_cache_bytes,
            config.max_json_depth,
            config.retention().is_some(),
        )?;
        let (mut fleet, membership) = Fleet::new(&config)?;
        fleet.set_adapter_names(prompts.adapter_names());
        let worker_authorization =
            match &config.worker_api_key {
                Some(key) => Some(HeaderValue::from_str(&format!("Bearer {key}")).map_err(
                    |_| ConfigError::field("worker_api_key", "is not a valid header value"),
                )?),
                None => None,
            };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.threads)
            .thread_name("kvroute-serve")
            .enable_all()
            .build()
            .map_err(|e| ConfigError::new(format!("cannot start the runtime: {e}")))?;
        let upstream = runtime.block_on(async { relay::client(config.connect_timeout) });
        let refresh_upstream = runtime.block_on(async { relay::client(config.connect_timeout) });
        let body_limit = edge::BodyLimit::new(config.max_body_bytes, prompts.tokenizer_limits());
        if config.max_buffered_body_bytes < body_limit.bytes {
            return Err(ConfigError::field(
                "max_buffered_body_bytes",
                format!(
                    "({}) is below the body limit ({} bytes, {}): a body that large could never \
                     be read",
                    config.max_buffered_body_bytes, body_limit.bytes, body_limit.source
                ),
            ));
        }
        let (stop, stopped) = watch::channel(false);
        let metrics = Metrics::default();
        let mesh = match &config.mesh {
            Some(settings) => Some(MeshLink::bind(
                settings,
                metrics.instance(),
                &runtime,
                stopped.clone(),
            )?),
            None => None,
        };
        let shared = Arc::new(Shared {
            body_budget: edge::BodyBudget::new(config.max_buffered_body_bytes),
            body_limit,
            fleet: Mutex::new(fleet),
            fleet_lock: crate::contention::LockStats::default(),
            prompts,
            metrics,
            upstream,
            refresh_upstream,
            refreshes_open: Mutex::new(std::collections::HashMap::new()),
            worker_authorization,
            draining: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            idle: Notify::new(),
            models_next: AtomicUsize::new(0),
            consumer: Mutex::new(None),
            connections: Registry::default(),
            large_bodies: tokio::sync::Semaphore::new(LARGE_BODIES),
            mesh,
            config,
        });
        shared.apply(membership)?;
        super::mesh::start(&shared, &runtime, stopped.clone());
        if let Some(interval) = shared.config.health_interval {
            runtime.spawn(health_loop(shared.clone(), interval, stopped.clone()));
        }
        runtime.spawn(kv_capacity_loop(shared.clone(), stopped.clone()));
        runtime.spawn(notice_loop(shared.clone(), stopped.clone()));
        Ok(Self {
            runtime: Some(runtime),
            shared,
            stop,
            stopped,
        })
    }

    /// The runtime its tasks run on (a front spawns its own there).
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        self.runtime
            .as_ref()
            .expect("the runtime lives until the router stops")
            .handle()
    }

    /// Becomes true when the router stops (a front ends its own tasks then).
    pub fn stopped(&self) -> watch::Receiver<bool> {
        self.stopped.clone()
    }

    /// The state the fronts of this crate share.
    pub(super) fn shared(&self) -> Arc<Shared> {
        self.shared.clone()
    }

    /// The request pipeline a front drives.
    pub fn pipeline(&self) -> Pipeline {
        Pipeline::new(self.shared.clone())
    }

    /// Replace the worker list (discovery's complete list).
    pub fn set_workers(&self, workers: &[WorkerSpec]) -> Result<(), ConfigError> {
        let membership = self.shared.fleet().set_workers(workers)?;
        self.shared.apply(membership)
    }

    /// The text of `/metrics`.
    pub fn metrics_text(&self) -> String {
        self.shared.metrics_text()
    }

    /// Where the replica mesh's PUB socket listens (None: no mesh).
    pub fn mesh_addr(&self) -> Option<std::net::SocketAddr> {
        self.shared.mesh.as_ref().map(MeshLink::local_addr)
    }

    /// Replace the mesh's peers (`host:port` each; discovery's list). No mesh: nothing.
    pub fn set_peers(&self, peers: Vec<String>) {
        if let Some(mesh) = &self.shared.mesh {
            mesh.set_peers(peers);
        }
    }

    /// The index the routing step reads (shared with the KV-event consumer).
    pub fn index(&self) -> kvroute_io::consumer::SharedIndex {
        self.shared.fleet().index().clone()
    }

    /// Every worker's state now.
    pub fn workers(&self) -> Vec<WorkerView> {
        let now = self.shared.now();
        let fleet = self.shared.fleet();
        fleet
            .members()
            .iter()
            .map(|m| {
                let (in_flight, in_flight_tokens) = fleet.load(m.slot);
                WorkerView {
                    name: m.name.clone(),
                    url: m.url.clone(),
                    ready: m.ready,
                    healthy: m.healthy,
                    available: m.available(now),
                    in_flight,
                    in_flight_tokens,
                    ejections: m.ejected_total,
                    consecutive_failures: m.consecutive_failures,
                }
            })
            .collect()
    }

    /// Retention's counters (None when it is off).
    pub fn retention_stats(&self) -> Option<kvroute_core::retention::RetentionStats> {
        self.shared.fleet().retention_stats()
    }

    /// The request body limit and where it came from.
    pub fn body_limit(&self) -> &edge::BodyLimit {
        &self.shared.body_limit
    }

    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::SeqCst)
    }

    /// Refuse new requests (503, `/health` failing) and wait up to `timeout` for the ones in
    /// flight; true when they all finished.
    pub fn drain(&self, timeout: Duration) -> bool {
        self.shared.draining.store(true, Ordering::SeqCst);
        let shared = self.shared.clone();
        let Some(runtime) = &self.runtime else {
            return true;
        };
        runtime.block_on(async move {
            let wait = async {
                loop {
                    let notified = shared.idle.notified();
                    if shared.in_flight.load(Ordering::SeqCst) == 0 {
                        return;
                    }
                    notified.await;
                }
            };
            tokio::time::timeout(timeout, wait).await.is_ok()
        })
    }

    /// Stop the background loops and every task of the fronts.
    pub fn shutdown(mut self) {
        self.stop_runtime();
    }

    fn stop_runtime(&mut self) {
        let _ = self.stop.send(true);
        let consumer = self
            .shared
            .consumer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(c) = consumer {
            c.close(Duration::from_secs(5));
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        self.stop_runtime();
    }
}
