//! What every connection and task of a router shares: the fleet, the prompts, the metrics,
//! the KV-event consumer, the upstream clients and the mesh link ([`super::router`] owns it
//! and its runtime).

use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use hyper::header::HeaderValue;
use kvroute_io::consumer::{Consumer, CounterSnapshot, Subscription};
use tokio::sync::Notify;

use super::limits::EVENTS_COALESCE;
use super::mesh_link::MeshLink;
use crate::config::{ConfigError, ServeConfig};
use crate::connections::Registry;
use crate::edge;
use crate::fleet::{Fleet, Membership};
use crate::metrics::exposition::Exposition;
use crate::metrics::{Metrics, OpenCounts};
use crate::prompt::Prompts;
use crate::relay::{Ending, RefreshUpstream, Upstream};

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
                    ConfigError::new(format!("cannot start the KV event consumer: {e}"))
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
                    .map_err(|e| ConfigError::new(format!("worker {url}: {e}")))?;
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
        let open = OpenCounts {
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
        let mut out = Exposition::new();
        self.metrics
            .render(&mut out, &self.fleet(), now, &events, open);
        if let Some(mesh) = &self.mesh {
            mesh.render(&mut out, now);
        }
        let fleet = self.fleet();
        crate::contention::render(
            &mut out,
            &[("fleet", &self.fleet_lock), ("index", fleet.index_lock())],
        );
        out.finish()
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
