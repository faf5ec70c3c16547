//! The router's workers and its one routing step (pure: fed outcomes and times, no I/O).
//!
//! Membership comes from the worker list (`--worker`, or the Python face's discovery through
//! [`Fleet::set_workers`]). A worker is available while it is healthy and not ejected:
//!
//! - **health**: a failed `GET /health` (anything but 2xx: redirects are never followed) or a
//!   refused connection takes it out and drops its index entries (the router would otherwise
//!   keep steering prefixes to a dead worker); a passing check brings it back;
//! - **outlier ejection** (Envoy's, simplified): `eject_after_failures` consecutive failed
//!   requests (first-byte or idle timeouts, deaths mid-answer, 5xx answers: a worker alive but
//!   not serving) take it out for `eject_base` times its number of ejections in a row (at most
//!   [`MAX_EJECTION_S`]); it returns at the first passing health check after that, so a worker
//!   whose `/health` answers while its generations hang does not flap back. A success resets
//!   both counts.
//!
//! Routing is `kvroute_core::routing::RoutingStep` (the simulator's step): index look-up,
//! policy, prediction and load accounting, among the available workers. The index is shared
//! with the KV-event consumer's thread (`kvroute_io`), which applies every batch to it; the
//! fleet only says which workers joined and left ([`Membership`]), and the server follows or
//! stops following their streams.

mod peers;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use kvroute_core::blocks::BlockHasher;
use kvroute_core::index::{KvIndex, MemoryBound};
use kvroute_core::policies::{Choose, Policy, WorkerState};
use kvroute_core::retention::{Refresh, Retention, RetentionConfig, RetentionStats};
use kvroute_core::routing::RoutingStep;
use kvroute_io::consumer::{SharedIndex, lock_index};

use crate::config::{ConfigError, EventSource, ServeConfig, WorkerSpec, worker_base_url};
use crate::prompt::Retained;

pub use peers::PeerRouted;

/// Longest ejection, whatever the number of ejections in a row.
pub const MAX_EJECTION_S: f64 = 300.0;

/// One worker as the router tracks it.
#[derive(Clone, Debug)]
pub struct Member {
    /// Its name in the routing step, the index, the metrics and the worker header: discovery's
    /// stable name (a pod's), or the URL.
    pub name: String,
    /// Base URL (`http://host:port`) requests go to.
    pub url: String,
    /// Where it publishes KV events (None: predicted from the router's decisions).
    pub events: Option<EventSource>,
    /// Discovery says it takes new requests.
    pub ready: bool,
    /// Its slot in the routing step.
    pub slot: usize,
    /// Passed its last health check and accepted its last connection.
    pub healthy: bool,
    /// Failed requests since the last success.
    pub consecutive_failures: u32,
    /// Ejections since the last success; each lengthens the next.
    pub ejections: u32,
    /// Monotonic seconds before which no health check brings it back.
    pub ejected_until: f64,
    /// Times it was ejected (cumulative, for the metric).
    pub ejected_total: u64,
    /// The `model` of the last token-id prompt retention saw routed here: what the refreshes
    /// sent when it falls idle name (retention tracks only prefixes it saw routed).
    pub refresh_model: Option<String>,
    /// Failed health checks (cumulative, for the metric).
    pub health_failures: u64,
    /// Its usable KV blocks as the admission guard and retention count them (None: not
    /// known yet).
    pub kv_capacity_blocks: Option<usize>,
    /// Monotonic seconds before which its engine is not asked for its capacity again.
    pub kv_capacity_retry_at: f64,
}

impl Member {
    /// May take a new request at `now`.
    pub fn available(&self, now: f64) -> bool {
        self.ready && self.healthy && now >= self.ejected_until
    }
}

/// Where one request goes.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    /// The worker's name and base URL.
    pub name: String,
    pub url: String,
    /// Its routing-step slot (what [`Fleet::first_token`] and [`Fleet::finished`] take).
    pub slot: usize,
    /// The request's ticket in the admission model (what [`Fleet::finished`] takes too).
    pub ticket: Option<u64>,
    /// Prompt tokens charged to its load until the first response byte.
    pub prefill_tokens: usize,
    /// Leading prompt blocks the index credited it with.
    pub overlap_blocks: usize,
    /// Refreshes retention sends that worker ahead of this request (their prompts).
    pub refreshes: Vec<Refresh>,
}

/// One worker as the admission guard sees it ([`Fleet::admission_figures`]).
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerAdmission<'a> {
    pub name: &'a str,
    /// The blocks the router's requests in flight pin there.
    pub pinned_blocks: usize,
}

/// Refreshes for a worker whose last request just finished ([`Fleet::finished`]).
#[derive(Clone, Debug, PartialEq)]
pub struct IdleRefreshes {
    /// The worker's name and base URL.
    pub name: String,
    pub url: String,
    /// The `model` the refreshes name (that of the last prompt retention saw routed there).
    pub model: Option<String>,
    pub refreshes: Vec<Refresh>,
}

/// What a new worker list changed: the streams to follow and those to stop following.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Membership {
    /// Workers that joined with events, or whose event sockets changed.
    pub follow: Vec<(String, EventSource)>,
    /// Workers that left, or no longer publish events, while their stream was followed.
    pub unfollow: Vec<String>,
}

/// The workers, the index, the policy and the routing step around them.
pub struct Fleet {
    members: Vec<Member>,
    routing: RoutingStep,
    index: SharedIndex,
    policy: Policy,
    eject_after_failures: u32,
    eject_base_s: f64,
    candidates: Vec<usize>,
    /// What each worker's cache keeps (None: retention off).
    retention: Option<Retention>,
    /// The configured KV capacity of every worker (None: each reports its own).
    kv_capacity_blocks: Option<usize>,
    /// The worker URLs whose refreshes this replica sends (None: all; the replica mesh
    /// names one owner per worker, see [`peers`]).
    retention_owned: Option<HashSet<String>>,
    /// How the index's lock is contended when the routing step takes it (the KV-event
    /// consumer's thread holds it while it applies a batch).
    index_lock: crate::contention::LockStats,
}

impl Fleet {
    /// A fleet of `config.workers` (all healthy until a check says otherwise), and the streams
    /// to follow for them.
    pub fn new(config: &ServeConfig) -> Result<(Self, Membership), ConfigError> {
        let hasher = BlockHasher::new(config.block_size, config.hash_seed)
            .map_err(|e| ConfigError(e.to_string()))?;
        let index = KvIndex::new(
            hasher,
            config.predicted_ttl_s,
            config.predicted_capacity_blocks,
            config.index_max_bytes.map(MemoryBound::Bytes),
        )
        .map_err(|e| ConfigError(e.0))?;
        let policy = config.policy.build(config.block_size)?;
        let mut routing = RoutingStep::new(config.block_size);
        if policy.needs_admission() {
            routing.track_admission(config.kv_capacity_blocks);
        }
        let mut fleet = Self {
            members: Vec::new(),
            routing,
            index: Arc::new(Mutex::new(index)),
            policy,
            eject_after_failures: config.eject_after_failures,
            eject_base_s: config.eject_base.as_secs_f64(),
            candidates: Vec::new(),
            retention: config.retention.map(|(mode, capacity)| {
                Retention::new(RetentionConfig::new(mode, config.block_size, capacity))
            }),
            kv_capacity_blocks: config.kv_capacity_blocks,
            retention_owned: None,
            index_lock: crate::contention::LockStats::default(),
        };
        let membership = fleet.set_workers(&config.workers)?;
        Ok((fleet, membership))
    }

    /// The index, shared with the KV-event consumer.
    pub fn index(&self) -> &SharedIndex {
        &self.index
    }

    /// How the routing step waits for the index's lock.
    pub fn index_lock(&self) -> &crate::contention::LockStats {
        &self.index_lock
    }

    /// Make the fleet match `workers` (a complete list): new workers join healthy, removed
    /// ones are forgotten by the index; the others keep their state.
    pub fn set_workers(&mut self, workers: &[WorkerSpec]) -> Result<Membership, ConfigError> {
        let wanted: Vec<WorkerSpec> = workers
            .iter()
            .map(|w| {
                let url = worker_base_url(&w.url)?;
                let name = if w.name.is_empty() {
                    url.clone()
                } else {
                    w.name.clone()
                };
                Ok(WorkerSpec {
                    url,
                    name,
                    ..w.clone()
                })
            })
            .collect::<Result<_, ConfigError>>()?;
        let mut membership = Membership::default();
        let (kept, gone): (Vec<Member>, Vec<Member>) = std::mem::take(&mut self.members)
            .into_iter()
            .partition(|m| wanted.iter().any(|w| w.name == m.name));
        for m in gone {
            if m.events.is_some() {
                membership.unfollow.push(m.name.clone());
            }
            self.routing.remove_worker(&m.name);
            lock_index(&self.index).remove_worker(&m.name);
        }
        self.members = kept;
        for spec in wanted {
            if let Some(m) = self.members.iter_mut().find(|m| m.name == spec.name) {
                m.ready = spec.ready;
                m.url = spec.url;
                if m.events != spec.events {
                    match &spec.events {
                        Some(e) => membership.follow.push((spec.name.clone(), e.clone())),
                        None => membership.unfollow.push(spec.name.clone()),
                    }
                    m.events = spec.events;
                }
                continue;
            }
            if let Some(e) = &spec.events {
                membership.follow.push((spec.name.clone(), e.clone()));
            }
            let slot = self.routing.add_worker(&spec.name);
            self.members.push(Member {
                name: spec.name,
                url: spec.url,
                events: spec.events,
                ready: spec.ready,
                slot,
                healthy: true,
                consecutive_failures: 0,
                ejections: 0,
                ejected_until: 0.0,
                ejected_total: 0,
                refresh_model: None,
                health_failures: 0,
                kv_capacity_blocks: self.kv_capacity_blocks,
                kv_capacity_retry_at: 0.0,
            });
        }
        Ok(membership)
    }

    /// Every worker, in the order they joined.
    pub fn members(&self) -> &[Member] {
        &self.members
    }

    /// Workers that may take a new request at `now`.
    pub fn available_count(&self, now: f64) -> usize {
        self.members.iter().filter(|m| m.available(now)).count()
    }

    /// Route a prompt among the available workers not in `tried` (names), at `now`
    /// (monotonic seconds); None when there is no such worker. With retention on and a
    /// token-id prompt (`retained`), a prompt cached nowhere goes where it displaces least
    /// (`Retention::room_for`), and the choice carries the refreshes to send first.
    pub fn route(
        &mut self,
        block_hashes: &[u64],
        prompt_tokens: usize,
        tried: &[String],
        now: f64,
        retained: Option<&Retained>,
    ) -> Option<Choice> {
        self.candidates.clear();
        self.candidates.extend(
            self.members
                .iter()
                .filter(|m| m.available(now) && !tried.contains(&m.name))
                .map(|m| m.slot),
        );
        if self.candidates.is_empty() {
            return None;
        }
        let mut index = self.index_lock.lock(&self.index);
        let retention = self.retention.as_mut().zip(retained);
        let room = retention.as_ref().and_then(|(r, _)| {
            r.room_for(
                &self.routing,
                Some(&mut index),
                &self.candidates,
                block_hashes,
                now,
            )
        });
        let routed = match room {
            Some(slot) => {
                self.routing
                    .route_to(Some(&mut index), slot, block_hashes, prompt_tokens, now)
            }
            None => self.routing.route(
                Some(&mut index),
                &mut self.policy,
                block_hashes,
                prompt_tokens,
                Some(&self.candidates),
                now,
            ),
        };
        let mut refreshes = Vec::new();
        let mut retained_model = None;
        let owned = self.owns_retention(routed.worker);
        if let Some((r, request)) = self.retention.as_mut().zip(retained)
            && !block_hashes.is_empty()
        {
            retained_model = Some(request.model.clone());
            let incoming = (request.ids.len() + request.output_tokens)
                .div_ceil(self.routing.block_size())
                .saturating_sub(routed.overlap);
            if owned {
                r.poll_step(
                    &self.routing,
                    Some(&mut index),
                    routed.worker,
                    incoming,
                    now,
                    &mut refreshes,
                );
            }
            r.routed(
                routed.worker,
                block_hashes,
                &request.ids,
                routed.overlap,
                request.output_tokens,
                now,
            );
        }
        drop(index);
        let member = self
            .members
            .iter_mut()
            .find(|m| m.slot == routed.worker)
            .expect("the step routes among the members' slots");
        if let Some(model) = retained_model {
            member.refresh_model = model;
        }
        Some(Choice {
            name: member.name.clone(),
            url: member.url.clone(),
            slot: routed.worker,
            ticket: routed.ticket,
            prefill_tokens: routed.prefill_tokens,
            overlap_blocks: routed.overlap,
            refreshes,
        })
    }

    /// Workers whose KV capacity the admission guard or retention needs and may ask their
    /// engine for at `now`, as `(name, url)`; each is not offered again for `retry_s` unless
    /// it answers.
    pub fn kv_capacity_wanted(&mut self, now: f64, retry_s: f64) -> Vec<(String, String)> {
        if self.routing.admission().is_none() && self.retention.is_none() {
            return Vec::new();
        }
        self.members
            .iter_mut()
            .filter(|m| m.kv_capacity_blocks.is_none() && m.kv_capacity_retry_at <= now)
            .map(|m| {
                m.kv_capacity_retry_at = now + retry_s;
                (m.name.clone(), m.url.clone())
            })
            .collect()
    }

    /// Worker `name`'s engine reported `num_gpu_blocks` KV blocks (the null block included):
    /// the admission guard and retention count that worker's cache by it.
    pub fn set_kv_capacity(&mut self, name: &str, num_gpu_blocks: usize) {
        if let Some(m) = self.members.iter_mut().find(|m| m.name == name) {
            let usable = num_gpu_blocks.saturating_sub(1);
            m.kv_capacity_blocks = Some(usable);
            self.routing.set_kv_capacity(m.slot, usable);
            if let Some(r) = &mut self.retention {
                r.set_capacity(m.slot, usable);
            }
        }
    }

    /// Any available worker's `(name, url)` (for `/v1/models`), round the list from `start`.
    pub fn any_available(&self, start: usize, now: f64) -> Option<(String, String)> {
        let n = self.members.len();
        (0..n)
            .map(|i| &self.members[(start + i) % n.max(1)])
            .find(|m| m.available(now))
            .map(|m| (m.name.clone(), m.url.clone()))
    }

    /// The request charged to `slot` got its first response byte.
    pub fn first_token(&mut self, slot: usize, prefill_tokens: usize) {
        self.routing.first_token(slot, prefill_tokens);
    }

    /// The request charged to `slot` (with `ticket`, see [`Choice`]) ended (answered, failed
    /// or abandoned) at `now`. With retention on, a worker left with no request gets the
    /// refreshes it was spared while requests were going to it idle (`Retention::poll_idle`):
    /// to send now.
    pub fn finished(
        &mut self,
        slot: usize,
        ticket: Option<u64>,
        now: f64,
    ) -> Option<IdleRefreshes> {
        self.routing.finished(slot, ticket, now);
        if !self.owns_retention(slot) {
            return None;
        }
        let retention = self.retention.as_mut()?;
        if !retention.polls_idle(&self.routing, slot) {
            return None; // most finishes: no index lock taken
        }
        let member = self
            .members
            .iter()
            .find(|m| m.slot == slot && m.available(now))?;
        let mut refreshes = Vec::new();
        let mut index = lock_index(&self.index);
        retention.poll_idle(&self.routing, Some(&mut index), slot, now, &mut refreshes);
        (!refreshes.is_empty()).then(|| IdleRefreshes {
            name: member.name.clone(),
            url: member.url.clone(),
            model: member.refresh_model.clone(),
            refreshes,
        })
    }

    fn member(&mut self, name: &str) -> Option<&mut Member> {
        self.members.iter_mut().find(|m| m.name == name)
    }

    /// A request to worker `name` succeeded: its failure and ejection counts start again.
    pub fn succeeded(&mut self, name: &str) {
        if let Some(m) = self.member(name) {
            m.consecutive_failures = 0;
            m.ejections = 0;
        }
    }

    /// A request to worker `name` failed at `now`; true when that ejected it.
    pub fn failed(&mut self, name: &str, now: f64) -> bool {
        let (after, base) = (self.eject_after_failures, self.eject_base_s);
        let Some(m) = self.member(name) else {
            return false;
        };
        m.consecutive_failures += 1;
        if after == 0 || m.consecutive_failures < after {
            return false;
        }
        m.consecutive_failures = 0;
        m.ejections += 1;
        m.ejected_total += 1;
        m.ejected_until = now + (base * f64::from(m.ejections)).min(MAX_EJECTION_S);
        // Out until a health check passes after the ejection, whatever it answered before.
        m.healthy = false;
        true
    }

    /// Worker `name` refused a connection: out of the available set, its index entries
    /// dropped.
    pub fn refused(&mut self, name: &str) {
        if let Some(m) = self.member(name) {
            m.healthy = false;
        }
        lock_index(&self.index).reset_worker(name);
    }

    /// A health check of worker `name` at `now` passed or failed.
    pub fn checked(&mut self, name: &str, passed: bool, now: f64) {
        let mut reset = false;
        if let Some(m) = self.member(name) {
            if passed {
                if now >= m.ejected_until {
                    m.healthy = true;
                }
            } else {
                m.health_failures += 1;
                reset = m.healthy;
                m.healthy = false;
            }
        }
        if reset {
            lock_index(&self.index).reset_worker(name);
        }
    }

    /// `(event-backed entries, predicted entries, evicted entries)` of the index (predicted
    /// entries as of the last routing decision).
    pub fn index_figures(&self) -> (usize, usize, u64) {
        let s = lock_index(&self.index).stats();
        (s.blocks, s.predicted, s.evicted_blocks)
    }

    /// The admission guard's view, None without one: decisions it moved (cumulative), and
    /// the blocks each worker's requests in flight pin.
    pub fn admission_figures(&self) -> Option<(u64, Vec<WorkerAdmission<'_>>)> {
        let admission = self.routing.admission()?;
        let diversions = match &self.policy {
            Policy::KvAware(p) => p.admission_diversions(),
            _ => 0,
        };
        let workers = self
            .members
            .iter()
            .map(|m| WorkerAdmission {
                name: &m.name,
                pinned_blocks: admission.pinned_blocks(m.slot),
            })
            .collect();
        Some((diversions, workers))
    }

    /// Retention's counters (None when it is off).
    pub fn retention_stats(&self) -> Option<RetentionStats> {
        self.retention.as_ref().map(Retention::stats)
    }

    /// The load accounting of `slot`: `(requests in flight, prompt tokens still to prefill)`.
    pub fn load(&self, slot: usize) -> (i64, i64) {
        let s = self.routing.state(slot);
        (s.in_flight, s.in_flight_tokens)
    }

    /// The routing step's whole view of `slot`: its name, load and cached blocks (as of the
    /// last decision whose policy looked at the overlaps), what a policy sees; for comparing
    /// the router's step with the simulator's (`tests/routing_parity.rs`).
    pub fn state(&self, slot: usize) -> &WorkerState {
        self.routing.state(slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PolicySpec;

    fn fleet(policy: &str, workers: &[&str]) -> Fleet {
        let mut spec = PolicySpec::named(policy);
        spec.seed = Some(1);
        let config = ServeConfig {
            workers: workers.iter().map(|w| WorkerSpec::url(*w)).collect(),
            policy: spec,
            block_size: 4,
            ..ServeConfig::default()
        };
        Fleet::new(&config).unwrap().0
    }

    #[test]
    fn kv_aware_sends_a_repeated_prompt_where_it_went_and_counts_the_load() {
        let mut f = fleet("kv-aware", &["http://a:1", "http://b:1/v1"]);
        let hashes = vec![11, 12, 13];
        let first = f.route(&hashes, 12, &[], 0.0, None).unwrap();
        assert_eq!(first.overlap_blocks, 0);
        f.first_token(first.slot, first.prefill_tokens);
        f.finished(first.slot, first.ticket, 0.05);
        let again = f.route(&hashes, 12, &[], 0.1, None).unwrap();
        assert_eq!(again.name, first.name);
        assert_eq!(again.url, first.url);
        assert_eq!(again.overlap_blocks, 3);
        assert_eq!(f.load(again.slot), (1, 1));
    }

    #[test]
    fn a_retry_never_goes_back_to_a_worker_it_tried() {
        let mut f = fleet("round-robin", &["http://a:1", "http://b:1"]);
        let first = f.route(&[], 0, &[], 0.0, None).unwrap();
        let second = f
            .route(&[], 0, std::slice::from_ref(&first.name), 0.0, None)
            .unwrap();
        assert_ne!(first.name, second.name);
        assert!(
            f.route(&[], 0, &[first.name, second.name], 0.0, None)
                .is_none()
        );
    }

    #[test]
    fn ejection_lasts_longer_each_time_and_needs_a_passing_check_after_it() {
        let mut f = fleet("round-robin", &["http://a:1", "http://b:1"]);
        let a = "http://a:1";
        assert!(!f.failed(a, 0.0));
        assert!(!f.failed(a, 0.0));
        assert!(f.failed(a, 0.0)); // third in a row: out for 5 s
        assert_eq!(f.available_count(1.0), 1);
        f.checked(a, true, 4.0); // before the end of the ejection: still out
        assert_eq!(f.available_count(4.0), 1);
        assert_eq!(f.available_count(6.0), 1); // over, but no check has passed since
        f.checked(a, true, 6.0);
        assert_eq!(f.available_count(6.0), 2);
        for _ in 0..3 {
            f.failed(a, 10.0);
        }
        assert_eq!(f.members()[0].ejected_until, 20.0); // the second: 2 x 5 s
        f.succeeded(a);
        assert_eq!(f.members()[0].ejections, 0);
    }

    #[test]
    fn membership_changes_keep_the_others_state() {
        let mut f = fleet("round-robin", &["http://a:1", "http://b:1"]);
        f.checked("http://b:1", false, 0.0);
        let events = |port: u16| EventSource {
            endpoint: format!("tcp://c:{port}"),
            replay_endpoint: None,
        };
        let c = WorkerSpec {
            url: "http://c:1".into(),
            name: "pod-c".into(),
            events: Some(events(5557)),
            ready: true,
        };
        let m = f
            .set_workers(&[WorkerSpec::url("http://b:1"), c.clone()])
            .unwrap();
        assert_eq!(m.follow, [("pod-c".to_owned(), events(5557))]);
        assert!(m.unfollow.is_empty());
        let names: Vec<_> = f.members().iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["http://b:1", "pod-c"]);
        assert!(!f.members()[0].healthy);
        // The same list again changes nothing; c leaving stops its stream.
        assert_eq!(
            f.set_workers(&[WorkerSpec::url("http://b:1"), c]).unwrap(),
            Membership::default()
        );
        let m = f.set_workers(&[WorkerSpec::url("http://b:1")]).unwrap();
        assert_eq!(m.unfollow, ["pod-c"]);
        assert!(f.set_workers(&[WorkerSpec::url("ftp://x")]).is_err());
    }
}
