//! The router's state and lifetime, without a front: the fleet, the prompts, the metrics, the
//! KV-event consumer and the background loops on one tokio runtime. `kvroute serve`'s HTTP
//! front ([`super::Server`]) and the Endpoint Picker's gRPC front drive it through its
//! [`Pipeline`].

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use hyper::header::HeaderValue;
use kvroute_core::blocks::BlockHasher;
use kvroute_io::consumer::{Consumer, CounterSnapshot, Subscription};
use tokio::sync::{Notify, watch};

use super::background::{health_loop, kv_capacity_loop, notice_loop};
use super::mesh::MeshLink;
use super::pipeline::Pipeline;
use super::{EVENTS_COALESCE, LARGE_BODIES};
use crate::config::{ConfigError, ServeConfig, WorkerSpec};
use crate::connections::Registry;
use crate::edge;
use crate::fleet::{Fleet, Membership};
use crate::metrics::{Metrics, Open};
use crate::prompt::Prompts;
use crate::relay::{self, Ending, RefreshUpstream, Upstream};

/// How long the consumer waits for each message of a replay.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(1);

/// What every connection and task shares.
pub(super) struct Shared {
    pub(super) config: ServeConfig,
    /// `config.max_body_bytes`, or what it is derived from the tokenizer.
    pub(super) body_limit: edge::BodyLimit,
    /// The request body bytes held at once ([`edge::BodyBudget`]).
    pub(super) body_budget: edge::BodyBudget,
    pub(super) fleet: Mutex<Fleet>,
    /// How the fleet's lock is contended ([`crate::contention`]).
    pub(super) fleet_lock: crate::contention::LockStats,
    pub(super) prompts: Prompts,
    pub(super) metrics: Metrics,
    pub(super) upstream: Upstream,
    /// Retention's refreshes, on connections of their own.
    pub(super) refresh_upstream: RefreshUpstream,
    /// Refreshes open per worker name.
    pub(super) refreshes_open: Mutex<std::collections::HashMap<String, usize>>,
    /// `Bearer <worker key>`, or None.
    pub(super) worker_authorization: Option<HeaderValue>,
    pub(super) draining: AtomicBool,
    pub(super) in_flight: AtomicUsize,
    pub(super) idle: Notify,
    /// Rotates `/v1/models` over the workers.
    pub(super) models_next: AtomicUsize,
    /// The KV-event consumer, made with the first worker that publishes events.
    pub(super) consumer: Mutex<Option<Consumer>>,
    /// Every open client connection.
    pub(super) connections: Registry,
    /// Permits for bodies over `offload_bytes` in memory at once.
    pub(super) large_bodies: tokio::sync::Semaphore,
    /// The replica mesh, when `config.mesh` asks for one.
    pub(super) mesh: Option<MeshLink>,
}

impl Shared {
    /// The routing step's clock: `CLOCK_MONOTONIC` seconds, Python's `time.monotonic()`, so
    /// that index look-ups from Python (tests, the inspection API) see the same times.
    pub(super) fn now(&self) -> f64 {
        monotonic_seconds()
    }

    pub(super) fn fleet(&self) -> MutexGuard<'_, Fleet> {
        self.fleet_lock.lock(&self.fleet)
    }

    /// Follow and stop following the event streams a membership change names.
    pub(super) fn apply(&self, membership: Membership) -> Result<(), ConfigError> {
        let mut consumer = self.consumer.lock().unwrap_or_else(|p| p.into_inner());
        for url in membership.unfollow {
            if let Some(c) = consumer.as_ref() {
                c.remove_worker(&url);
            }
        }
        for (url, source) in membership.follow {
            if consumer.is_none() {
                let index = self.fleet().index().clone();
                *consumer = Some(Consumer::start(Some(index), EVENTS_COALESCE).map_err(|e| {
                    ConfigError(format!("cannot start the KV event consumer: {e}"))
                })?);
            }
            let subscription = Subscription {
                endpoint: source.endpoint,
                replay_endpoint: source.replay_endpoint,
                topic: self.config.events_topic.as_bytes().to_vec(),
                bind: false,
                replay_timeout: REPLAY_TIMEOUT,
                catch_up: true,
            };
            if let Some(c) = consumer.as_ref() {
                c.add_worker(&url, subscription)
                    .map_err(|e| ConfigError(format!("worker {url}: {e}")))?;
            }
        }
        Ok(())
    }

    /// The consumer's counters per followed worker.
    pub(super) fn event_counters(&self) -> Vec<(String, CounterSnapshot)> {
        let consumer = self.consumer.lock().unwrap_or_else(|p| p.into_inner());
        consumer.as_ref().map_or_else(Vec::new, Consumer::counters)
    }

    /// Worker `name`'s answer broke after its first byte (`kind`: `stream` or `body`).
    /// Silence is a strike towards ejection; a dropped connection is not (a dead worker's next
    /// connection is refused, which takes it out at once).
    pub(super) fn broke(&self, name: &str, kind: &str, ending: Ending) {
        self.metrics.upstream_error(name, kind);
        if ending == Ending::Silent {
            self.fleet().failed(name, self.now());
        }
    }

    pub(super) fn metrics_text(&self) -> String {
        let events = self.event_counters();
        let open = Open {
            connections: self.connections.len(),
            refreshes: self
                .refreshes_open
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .values()
                .sum(),
            body_bytes: self.body_budget.held_bytes(),
            body_budget_bytes: self.body_budget.bytes(),
        };
        let now = self.now();
        let mut out = self.metrics.render(&self.fleet(), now, &events, open);
        if let Some(mesh) = &self.mesh {
            mesh.render(&mut out, now);
        }
        let fleet = self.fleet();
        crate::contention::render(
            &mut out,
            &[("fleet", &self.fleet_lock), ("index", fleet.index_lock())],
        );
        out
    }
}

/// One worker's state, as the inspection API shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerView {
    pub name: String,
    pub url: String,
    /// Discovery says it takes new requests.
    pub ready: bool,
    /// Passed its last health check and accepted its last connection.
    pub healthy: bool,
    /// May take a new request (healthy and not ejected).
    pub available: bool,
    /// Requests routed to it and not finished; their prompt tokens still to prefill.
    pub in_flight: i64,
    pub in_flight_tokens: i64,
    /// Times it was ejected, and failed requests since its last success.
    pub ejections: u64,
    pub consecutive_failures: u32,
}

/// `CLOCK_MONOTONIC` in seconds.
pub fn monotonic_seconds() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

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
            .map_err(|e| ConfigError(e.to_string()))?;
        let prompts = Prompts::new(
            hasher,
            config.tokenizer.as_deref(),
            config.prompt_cache_bytes,
            config.max_json_depth,
            config.retention.is_some(),
        )?;
        let (mut fleet, membership) = Fleet::new(&config)?;
        fleet.set_adapter_names(prompts.adapter_names());
        let worker_authorization =
            match &config.worker_api_key {
                Some(key) => Some(HeaderValue::from_str(&format!("Bearer {key}")).map_err(
                    |_| ConfigError("the worker API key is not a valid header value".into()),
                )?),
                None => None,
            };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.threads)
            .thread_name("kvroute-serve")
            .enable_all()
            .build()
            .map_err(|e| ConfigError(format!("cannot start the runtime: {e}")))?;
        let upstream = runtime.block_on(async { relay::client(config.connect_timeout) });
        let refresh_upstream = runtime.block_on(async { relay::client(config.connect_timeout) });
        let body_limit = edge::BodyLimit::new(config.max_body_bytes, prompts.tokenizer_limits());
        if config.max_buffered_body_bytes < body_limit.bytes {
            return Err(ConfigError(format!(
                "max buffered body bytes ({}) is below the body limit ({} bytes, {}): a body \
                 that large could never be read",
                config.max_buffered_body_bytes, body_limit.bytes, body_limit.source
            )));
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
