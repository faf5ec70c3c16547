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
//! policy, prediction and load accounting, among the available workers that serve the
//! request's model: each worker's models and LoRA adapters come from its `GET /v1/models`
//! ([`Fleet::set_models`], [`crate::models`]); a worker whose list is not known yet may take
//! any model, and a model no worker lists while every list is known is refused
//! ([`Fleet::unknown_model`]). The index is shared
//! with the KV-event consumer's thread (`kvroute_io`), which applies every batch to it; the
//! fleet only says which workers joined and left ([`Membership`]), and the server follows or
//! stops following their streams.

mod peers;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use kvroute_core::blocks::usable_blocks;
use kvroute_core::policies::{Choose, Policy, WorkerState, adapter_id};
use kvroute_core::retention::{Refresh, Retention, RetentionConfig, RetentionStats};
use kvroute_core::routing::RoutingStep;
use kvroute_io::consumer::{SharedIndex, lock_index};

use crate::config::{ConfigError, EventSource, ServeConfig, WorkerSpec, worker_base_url};
use crate::models::{AdapterNames, ServedModels};
use crate::prompt::Retained;

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
    /// Failed health checks (cumulative, for the metric).
    pub health_failures: u64,
    /// Its usable KV blocks as the admission guard and retention count them (None: not
    /// known yet).
    pub kv_capacity_blocks: Option<usize>,
    /// Monotonic seconds before which its engine is not asked for its capacity again.
    pub kv_capacity_retry_at: f64,
    /// The models and adapters it serves (None: not known yet, so any).
    pub models: Option<ServedModels>,
}

impl Member {
    /// May take a new request at `now`.
    pub fn available(&self, now: f64) -> bool {
        self.ready && self.healthy && now >= self.ejected_until
    }

    /// May take a request for `model` (None: the engine's default), as far as the router
    /// knows.
    pub fn serves(&self, model: Option<&str>) -> bool {
        match (model, &self.models) {
            (Some(model), Some(served)) => served.serves(model),
            _ => true,
        }
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
    /// Whose prefix each refresh keeps (its `model` and `cache_salt`), in the same order.
    pub refresh_tenants: Vec<RefreshTenant>,
}

/// What a refresh's body names besides its prompt: the `model` and `cache_salt` of the
/// requests whose prefix it keeps, so that it warms the blocks those requests hit (vLLM keys
/// them by adapter and salt).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RefreshTenant {
    pub model: Option<String>,
    pub cache_salt: Option<String>,
}

impl RefreshTenant {
    /// The tenant a peer replica's decision names (its `model` and `cache_salt`; empty: none).
    pub fn named(model: &str, cache_salt: &str) -> Self {
        let given = |v: &str| (!v.is_empty()).then(|| v.to_owned());
        Self {
            model: given(model),
            cache_salt: given(cache_salt),
        }
    }
}

/// Most prefixes whose tenant the fleet remembers for refreshes; past it the memory starts
/// over (a refresh of a forgotten prefix names no model and no salt).
const MAX_REFRESH_TENANTS: usize = 1 << 16;

/// Whether a replica owning the retention of the worker URLs `owned` (None: all) sends
/// `slot`'s refreshes (a free function, so the routing step can ask while it holds the
/// fleet's retention).
fn owns(owned: &Option<HashSet<String>>, members: &[Member], slot: usize) -> bool {
    match owned {
        None => true,
        Some(owned) => members
            .iter()
            .find(|m| m.slot == slot)
            .is_some_and(|m| owned.contains(&m.url)),
    }
}

/// Remember that the prefix starting with block `first_block` is `tenant`'s, for the
/// refreshes that keep it (bounded by [`MAX_REFRESH_TENANTS`]).
fn remember_tenant(
    tenants: &mut HashMap<u64, RefreshTenant>,
    first_block: u64,
    tenant: RefreshTenant,
) {
    if tenants.len() >= MAX_REFRESH_TENANTS {
        tenants.clear();
    }
    tenants.insert(first_block, tenant);
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
    pub refreshes: Vec<Refresh>,
    /// Whose prefix each refresh keeps, in the same order.
    pub tenants: Vec<RefreshTenant>,
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
    /// The adapters the workers serve, shared with the prompt parser.
    adapters: AdapterNames,
    /// The tenant of each prefix retention saw routed, by its first block's hash (which
    /// the adapter and the salt key already).
    tenants: HashMap<u64, RefreshTenant>,
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
        let index = config.index()?;
        let policy = config.policy.build(config.block_size)?;
        let mut routing = RoutingStep::new(config.block_size);
        if policy.needs_admission() {
            routing.track_admission(config.kv_capacity_blocks);
        }
        routing.track_adapters(config.max_loras);
        let mut fleet = Self {
            members: Vec::new(),
            routing,
            index: Arc::new(Mutex::new(index)),
            policy,
            eject_after_failures: config.eject_after_failures,
            eject_base_s: config.eject_base.as_secs_f64(),
            candidates: Vec::new(),
            retention: config.retention().map(|(mode, capacity)| {
                Retention::new(RetentionConfig::new(mode, config.block_size, capacity))
            }),
            kv_capacity_blocks: config.kv_capacity_blocks,
            adapters: AdapterNames::default(),
            tenants: HashMap::new(),
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
                health_failures: 0,
                kv_capacity_blocks: self.kv_capacity_blocks,
                kv_capacity_retry_at: 0.0,
                models: None,
            });
        }
        self.share_adapters();
        Ok(membership)
    }

    /// The adapter id of a request for `model`, when `model` names a LoRA adapter some
    /// worker serves (None: a base model, or none named).
    pub fn adapter_of(&self, model: Option<&str>) -> Option<u64> {
        model.filter(|m| self.adapters.contains(m)).map(adapter_id)
    }

    /// Keep `adapters` (the prompt parser's) equal to the adapters the workers serve.
    pub fn set_adapter_names(&mut self, adapters: AdapterNames) {
        self.adapters = adapters;
        self.share_adapters();
    }

    /// Worker `name` answered `GET /v1/models` with `models`.
    pub fn set_models(&mut self, name: &str, models: ServedModels) {
        let Some(m) = self.members.iter_mut().find(|m| m.name == name) else {
            return;
        };
        if m.models.as_ref() != Some(&models) {
            m.models = Some(models);
            self.share_adapters();
        }
    }

    fn share_adapters(&self) {
        let names = self
            .members
            .iter()
            .filter_map(|m| m.models.as_ref())
            .flat_map(|s| s.adapters.iter().cloned())
            .collect();
        self.adapters.set(names);
    }

    /// Whether a request for `model` names nothing the fleet serves: every worker's list is
    /// known and none has it (vLLM answers such a request with a 404).
    pub fn unknown_model(&self, model: &str) -> bool {
        !self.members.is_empty()
            && self
                .members
                .iter()
                .all(|m| m.models.as_ref().is_some_and(|s| !s.serves(model)))
    }

    /// Every worker, in the order they joined.
    pub fn members(&self) -> &[Member] {
        &self.members
    }

    /// Workers that may take a new request at `now`.
    pub fn available_count(&self, now: f64) -> usize {
        self.members.iter().filter(|m| m.available(now)).count()
    }

    /// Route a prompt for `model` among the available workers that serve it and are not in
    /// `tried` (names), at `now` (monotonic seconds); None when there is no such worker. With
    /// retention on and a token-id prompt (`retained`), a prompt cached nowhere goes where it
    /// displaces least (`Retention::room_for`), and the choice carries the refreshes to send
    /// first, each with the tenant of the prefix it keeps.
    pub fn route(
        &mut self,
        block_hashes: &[u64],
        prompt_tokens: usize,
        tried: &[String],
        now: f64,
        retained: Option<&Retained>,
        model: Option<&str>,
    ) -> Option<Choice> {
        self.candidates.clear();
        self.candidates.extend(
            self.members
                .iter()
                .filter(|m| m.available(now) && m.serves(model) && !tried.contains(&m.name))
                .map(|m| m.slot),
        );
        if self.candidates.is_empty() {
            return None;
        }
        let adapter = self.adapter_of(model);
        let mut index = self.index_lock.lock(&self.index);
        let retention = self.retention.as_mut().zip(retained);
        let room = retention.as_ref().and_then(|(r, _)| {
            r.room_for(
                &self.routing,
                Some(&mut index),
                &self.candidates,
                block_hashes,
                adapter,
                now,
            )
        });
        let routed = match room {
            Some(slot) => self.routing.route_to(
                Some(&mut index),
                slot,
                block_hashes,
                prompt_tokens,
                adapter,
                now,
            ),
            None => self.routing.route(
                Some(&mut index),
                &mut self.policy,
                block_hashes,
                prompt_tokens,
                adapter,
                Some(&self.candidates),
                now,
            ),
        };
        let mut refreshes = Vec::new();
        let owned = owns(&self.retention_owned, &self.members, routed.worker);
        if let Some((r, request)) = retention
            && !block_hashes.is_empty()
        {
            let tenant = RefreshTenant {
                model: request.model.clone(),
                cache_salt: request.cache_salt.clone(),
            };
            remember_tenant(&mut self.tenants, block_hashes[0], tenant);
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
        let refresh_tenants = self.tenants_of(&refreshes);
        let member = self
            .members
            .iter()
            .find(|m| m.slot == routed.worker)
            .expect("the step routes among the members' slots");
        Some(Choice {
            name: member.name.clone(),
            url: member.url.clone(),
            slot: routed.worker,
            ticket: routed.ticket,
            prefill_tokens: routed.prefill_tokens,
            overlap_blocks: routed.overlap,
            refreshes,
            refresh_tenants,
        })
    }

    /// The tenant of each refresh's prefix.
    fn tenants_of(&self, refreshes: &[Refresh]) -> Vec<RefreshTenant> {
        refreshes
            .iter()
            .map(|r| {
                r.block_hashes
                    .first()
                    .and_then(|h| self.tenants.get(h))
                    .cloned()
                    .unwrap_or_default()
            })
            .collect()
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
            let usable = usable_blocks(num_gpu_blocks);
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
        drop(index);
        let (name, url) = (member.name.clone(), member.url.clone());
        (!refreshes.is_empty()).then(|| IdleRefreshes {
            name,
            url,
            tenants: self.tenants_of(&refreshes),
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
    use crate::prompt::Prompts;
    use kvroute_core::blocks::{BlockHasher, BlockKeys};
    use kvroute_core::kvevents::codec::encode_text_extra_keys;
    use kvroute_core::kvevents::events::{BlockStored, KvCacheEvent};

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
        let first = f.route(&hashes, 12, &[], 0.0, None, None).unwrap();
        assert_eq!(first.overlap_blocks, 0);
        f.first_token(first.slot, first.prefill_tokens);
        f.finished(first.slot, first.ticket, 0.05);
        let again = f.route(&hashes, 12, &[], 0.1, None, None).unwrap();
        assert_eq!(again.name, first.name);
        assert_eq!(again.url, first.url);
        assert_eq!(again.overlap_blocks, 3);
        assert_eq!(f.load(again.slot), (1, 1));
    }

    #[test]
    fn a_retry_never_goes_back_to_a_worker_it_tried() {
        let mut f = fleet("round-robin", &["http://a:1", "http://b:1"]);
        let first = f.route(&[], 0, &[], 0.0, None, None).unwrap();
        let second = f
            .route(&[], 0, std::slice::from_ref(&first.name), 0.0, None, None)
            .unwrap();
        assert_ne!(first.name, second.name);
        assert!(
            f.route(&[], 0, &[first.name, second.name], 0.0, None, None)
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
    /// The `BlockStored` vLLM sends for `tokens` (whole 4-token blocks) computed under `keys`:
    /// its own hashes (another seed), the adapter's name and id, one key tuple per block.
    fn stored(tokens: &[u32], keys: &BlockKeys) -> KvCacheEvent {
        let engine = BlockHasher::new(4, 99).unwrap();
        let extra = (0..tokens.len() / 4)
            .map(|i| {
                let k = keys.for_block(i);
                (!k.is_empty()).then(|| encode_text_extra_keys(&k))
            })
            .collect();
        KvCacheEvent::Stored(BlockStored {
            lora_id: keys.lora_name.as_ref().map(|_| 1),
            lora_name: keys.lora_name.clone(),
            extra_keys: Some(extra),
            ..BlockStored::plain(
                engine.hash_blocks_keyed(tokens, None, 0, None, keys),
                None,
                tokens.iter().map(|&t| i64::from(t)).collect(),
                4,
            )
        })
    }

    /// A kv-aware fleet of `n` workers whose prompts are parsed by the returned [`Prompts`].
    fn multi_tenant(n: usize) -> (Fleet, Prompts, Vec<String>) {
        let urls: Vec<String> = (0..n).map(|i| format!("http://w{i}:1")).collect();
        let refs: Vec<&str> = urls.iter().map(String::as_str).collect();
        let mut f = fleet("kv-aware", &refs);
        let prompts =
            Prompts::new(BlockHasher::new(4, 0).unwrap(), None, 1 << 20, 8, false).unwrap();
        f.set_adapter_names(prompts.adapter_names());
        let names = f.members().iter().map(|m| m.name.clone()).collect();
        (f, prompts, names)
    }

    fn parse(prompts: &Prompts, body: &str) -> crate::prompt::Prompt {
        prompts
            .parse(crate::prompt::Route::Completions, body.as_bytes())
            .unwrap()
    }

    const PROMPT: &str = "[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16]";

    #[test]
    fn a_salted_request_is_never_routed_on_a_hit_it_cannot_get() {
        let (mut f, prompts, names) = multi_tenant(2);
        let tokens: Vec<u32> = (1..=16).collect();
        lock_index(f.index()).apply(&names[0], &[stored(&tokens, &BlockKeys::default())]);
        let plain = parse(&prompts, &format!(r#"{{"prompt": {PROMPT}}}"#));
        let salted = parse(
            &prompts,
            &format!(r#"{{"prompt": {PROMPT}, "cache_salt": "t"}}"#),
        );
        let workers: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut index = lock_index(f.index());
        assert_eq!(
            index.overlaps(&plain.block_hashes, &workers, 0.0),
            vec![4, 0]
        );
        // The unsalted copy on w0 is no hit for a salted request: vLLM would compute it all.
        assert_eq!(
            index.overlaps(&salted.block_hashes, &workers, 0.0),
            vec![0, 0]
        );
        drop(index);
        let choice = f
            .route(&salted.block_hashes, 16, &[], 0.0, None, None)
            .unwrap();
        assert_eq!(choice.overlap_blocks, 0);
    }

    #[test]
    fn tenants_with_the_same_prompt_find_only_their_own_cache() {
        let (mut f, prompts, names) = multi_tenant(3);
        let tokens: Vec<u32> = (1..=16).collect();
        for (worker, salt) in [(0, "tenant-1"), (1, "tenant-2")] {
            let keys = BlockKeys::new(None, Some(salt));
            lock_index(f.index()).apply(&names[worker], &[stored(&tokens, &keys)]);
        }
        let workers: Vec<&str> = names.iter().map(String::as_str).collect();
        for (worker, salt) in [(0, "tenant-1"), (1, "tenant-2")] {
            let body = format!(r#"{{"prompt": {PROMPT}, "cache_salt": "{salt}"}}"#);
            let p = parse(&prompts, &body);
            let mut want = vec![0; 3];
            want[worker] = 4;
            let got = lock_index(f.index()).overlaps(&p.block_hashes, &workers, 0.0);
            assert_eq!(got, want);
            let choice = f.route(&p.block_hashes, 16, &[], 0.0, None, None).unwrap();
            assert_eq!(
                (choice.name.as_str(), choice.overlap_blocks),
                (workers[worker], 4)
            );
        }
        assert_eq!(lock_index(f.index()).stats().skipped_blocks, 0);
    }

    #[test]
    fn one_adapters_cache_never_counts_for_another() {
        let (mut f, prompts, names) = multi_tenant(2);
        let served = ServedModels::parse(
            br#"{"data":[{"id":"base","parent":null},{"id":"A","parent":"base"},{"id":"B","parent":"base"}]}"#,
        )
        .unwrap();
        for name in &names {
            f.set_models(name, served.clone());
        }
        let tokens: Vec<u32> = (1..=16).collect();
        let a = BlockKeys::new(Some("A"), Some("s"));
        lock_index(f.index()).apply(&names[0], &[stored(&tokens, &a)]);
        let workers: Vec<&str> = names.iter().map(String::as_str).collect();
        let overlaps = |f: &Fleet, model: &str, salt: &str| {
            let body =
                format!(r#"{{"prompt": {PROMPT}, "model": "{model}", "cache_salt": "{salt}"}}"#);
            let p = parse(&prompts, &body);
            lock_index(f.index()).overlaps(&p.block_hashes, &workers, 0.0)
        };
        assert_eq!(overlaps(&f, "A", "s"), vec![4, 0]);
        assert_eq!(overlaps(&f, "B", "s"), vec![0, 0]);
        assert_eq!(overlaps(&f, "A", "other"), vec![0, 0]);
        assert_eq!(overlaps(&f, "base", "s"), vec![0, 0]);
    }

    #[test]
    fn a_tenant_stays_where_its_adapter_is_loaded_and_a_peers_decision_counts() {
        let mut spec = PolicySpec::named("kv-aware");
        spec.seed = Some(1);
        let config = ServeConfig {
            workers: vec![
                WorkerSpec::url("http://w0:1"),
                WorkerSpec::url("http://w1:1"),
            ],
            policy: spec,
            block_size: 4,
            max_loras: Some(1),
            ..ServeConfig::default()
        };
        let mut f = Fleet::new(&config).unwrap().0;
        let prompts =
            Prompts::new(BlockHasher::new(4, 0).unwrap(), None, 1 << 20, 8, false).unwrap();
        f.set_adapter_names(prompts.adapter_names());
        let served = ServedModels::parse(
            br#"{"data":[{"id":"base","parent":null},{"id":"A","parent":"base"},{"id":"B","parent":"base"}]}"#,
        )
        .unwrap();
        let names: Vec<String> = f.members().iter().map(|m| m.name.clone()).collect();
        for name in &names {
            f.set_models(name, served.clone());
        }
        // A peer replica sent a request for adapter B to w1, which has ended: w1's one slot
        // holds B.
        let peer = kvroute_core::mesh::PeerDecision {
            block_hashes: &[50, 51],
            prompt: &[],
            prompt_tokens: 8,
            output_tokens: 4,
            overlap: 0,
            adapter: None,
        };
        let tenant = RefreshTenant::named("B", "");
        let (handle, _) = f.apply_peer_routed(&names[1], &peer, tenant, 0.0);
        f.peer_finished(handle.expect("w1 is known"), 0.01);
        // Requests for A go to w0, the second although w0 is busy and w1 idle: on w1, A would
        // displace B.
        for (i, hashes) in [[1, 2], [3, 4]].iter().enumerate() {
            let a = f.route(hashes, 8, &[], 0.02, None, Some("A")).unwrap();
            assert_eq!(a.name, names[0], "request {i} for A");
        }
        // A base-model request takes no slot: it goes to the idle w1.
        let base = f.route(&[5, 6], 8, &[], 0.03, None, Some("base")).unwrap();
        assert_eq!(base.name, names[1]);
    }

    #[test]
    fn a_model_is_routed_only_among_the_workers_that_serve_it() {
        let (mut f, _, names) = multi_tenant(6);
        let base = ServedModels::parse(br#"{"data":[{"id":"base","parent":null}]}"#).unwrap();
        let b = ServedModels::parse(br#"{"data":[{"id":"B","parent":null}]}"#).unwrap();
        assert!(
            !f.unknown_model("C"),
            "lists not known yet: any model may be served"
        );
        for (i, name) in names.iter().enumerate() {
            f.set_models(name, if i >= 4 { b.clone() } else { base.clone() });
        }
        let mut seen = std::collections::HashSet::new();
        for r in 0..60u64 {
            let hashes = [r, r + 1000];
            let choice = f.route(&hashes, 8, &[], 0.0, None, Some("B")).unwrap();
            assert!(
                names[4..].contains(&choice.name),
                "{} serves no B",
                choice.name
            );
            seen.insert(choice.name.clone());
            let other = f.route(&hashes, 8, &[], 0.0, None, Some("base")).unwrap();
            assert!(names[..4].contains(&other.name));
        }
        assert_eq!(seen.len(), 2, "both B workers take B's load");
        // Both B workers tried: nowhere else to go.
        assert!(
            f.route(&[1], 4, &names[4..], 0.0, None, Some("B"))
                .is_none()
        );
        assert!(f.unknown_model("C") && !f.unknown_model("B") && !f.unknown_model("base"));
    }
}
