//! The retention state machine: per worker, a model of the free queue fed with the router's
//! own routing, polled for the refreshes to send (see the module docs of `crate::retention`).

use std::sync::Arc;

use super::config::{RetentionConfig, RetentionMode};
use super::free_queue::{RECENT, SMOOTHING, Tracked, WorkerModel};
use super::homes::Homes;
use super::payoff::Payoff;
use crate::index::KvIndex;
use crate::policies::WorkerState;
use crate::routing::step::RoutingStep;

/// A refresh to send: to `worker`, a prompt of the prefix's tokens plus one, `max_tokens` 1.
#[derive(Clone, Debug, PartialEq)]
pub struct Refresh {
    /// The worker's slot.
    pub worker: usize,
    /// The prompt: the prefix's `blocks` full blocks of tokens, then one token more (so the
    /// engine's "compute at least the last token" rule recomputes that one, not a block).
    pub prompt: Arc<[u32]>,
    /// The prefix's block hashes (kvroute's own), `blocks` of them.
    pub block_hashes: Arc<[u64]>,
    /// Blocks the refresh keeps.
    pub blocks: usize,
}

/// What retention did, summed over workers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RetentionStats {
    /// Refreshes issued.
    pub refreshes: u64,
    /// Blocks they touched.
    pub refreshed_blocks: u64,
    /// Refreshes not sent because the index held too little of the prefix.
    pub skipped_evicted: u64,
    /// Refreshes of a prefix's leading blocks only (the index held no more of it).
    pub partial: u64,
    /// Refreshes `auto` held back because the worker had a prefill waiting.
    pub deferred_busy: u64,
    /// Refreshes `auto` held back from a request to an idle worker: written ahead of it, they
    /// would reach the idle engine first and make a step of their own, which the request
    /// would wait behind. They go when the worker next falls idle ([`Retention::poll_idle`]).
    pub deferred_idle: u64,
    /// Refreshes not sent because, pinned for their step beside the running requests, their
    /// blocks could keep a request from being admitted.
    pub deferred_full: u64,
    /// Refreshes `auto` did not send because they would not pay (too little saved).
    pub declined_value: u64,
    /// Polls `auto` skipped because the prefixes that fit carry too little of the demand.
    pub declined_coverage: u64,
    /// Refreshes `auto` did not send because another worker holds as much of the prefix.
    pub declined_held_elsewhere: u64,
    /// Polls `auto` skipped because refreshes do not pay (see
    /// [`RetentionConfig::min_payoff_tokens`] and [`RetentionConfig::pressure_tokens`]).
    pub declined_payoff: u64,
    /// Prefix blocks requests found held that the workers' plain LRUs would have evicted
    /// (what the refreshes bought, in the model).
    pub saved_blocks: u64,
    /// Prefix blocks of the tracked prefixes' uses that the plain LRUs would have evicted.
    pub lost_blocks: u64,
}

/// The retention state machine: one model per worker slot (see the module docs).
#[derive(Clone, Debug)]
pub struct Retention {
    config: RetentionConfig,
    workers: Vec<WorkerModel>,
    homes: Homes,
    payoff: Payoff,
    stats: RetentionStats,
}

impl Retention {
    /// Retention with `config`, no worker seen yet.
    pub fn new(config: RetentionConfig) -> Self {
        Self {
            config,
            workers: Vec::new(),
            homes: Homes::default(),
            payoff: Payoff::default(),
            stats: RetentionStats::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &RetentionConfig {
        &self.config
    }

    /// What it did so far.
    pub fn stats(&self) -> RetentionStats {
        self.stats
    }

    /// Prefixes tracked on a worker slot.
    pub fn tracked(&self, worker: usize) -> usize {
        self.workers.get(worker).map_or(0, |m| m.tracked.len())
    }

    /// Forget a worker slot (it left, or its cache was reset); its capacity stays.
    pub fn reset_worker(&mut self, worker: usize) {
        if let Some(m) = self.workers.get_mut(worker) {
            *m = WorkerModel {
                capacity: m.capacity,
                ..WorkerModel::default()
            };
        }
        self.homes.forget_slot(worker);
    }

    /// Worker `worker`'s usable KV blocks, as its engine reported them (in place of
    /// [`RetentionConfig::capacity_blocks`] for it).
    pub fn set_capacity(&mut self, worker: usize, blocks: usize) {
        if self.workers.len() <= worker {
            self.workers.resize_with(worker + 1, WorkerModel::default);
        }
        self.workers[worker].capacity = Some(blocks);
    }

    /// Worker `worker`'s usable KV blocks: its own if reported, else the configured ones.
    pub fn capacity(&self, worker: usize) -> usize {
        self.workers
            .get(worker)
            .and_then(|m| m.capacity)
            .unwrap_or(self.config.capacity_blocks)
    }

    /// A request was routed to `worker`: a prompt of these own block hashes and tokens, of
    /// which the index credited the worker with the leading `overlap` blocks, generating up to
    /// `output_tokens` tokens.
    pub fn routed(
        &mut self,
        worker: usize,
        block_hashes: &[u64],
        prompt: &[u32],
        overlap: usize,
        output_tokens: usize,
        _now: f64,
    ) {
        let bs = self.config.block_size;
        let capacity = self.capacity(worker);
        let min_blocks = self.config.min_prefix_blocks.max(1);
        let max_tracked = self.config.max_tracked.max(1);
        if block_hashes.len() >= min_blocks {
            self.homes.routed(block_hashes[min_blocks - 1], worker);
        }
        if self.workers.len() <= worker {
            self.workers.resize_with(worker + 1, WorkerModel::default);
        }
        let m = &mut self.workers[worker];
        m.requests += 1;
        let overlap = overlap.min(block_hashes.len()).min(prompt.len() / bs);
        // What refreshes bought this request: the longest tracked prefix it uses, as far as
        // the worker held it (the index's credit) against what the plain LRU would hold.
        if self.config.mode != RetentionMode::Off
            && let Some((&used, t)) = m
                .tracked
                .iter()
                .filter(|&(&tk, t)| {
                    t.blocks <= block_hashes.len() && block_hashes[t.blocks - 1] == tk
                })
                .max_by_key(|&(_, t)| t.blocks)
        {
            let plain = m.shadow.holds(used).min(t.blocks);
            let saved = overlap.min(t.blocks).saturating_sub(plain);
            self.payoff.used(saved, t.blocks - plain);
            self.stats.saved_blocks += saved as u64;
            self.stats.lost_blocks += (t.blocks - plain) as u64;
        }
        self.payoff.decay();
        let total = (prompt.len() + output_tokens).div_ceil(bs);
        let new_blocks = total.saturating_sub(overlap);
        m.new_blocks = if m.requests == 1 {
            new_blocks as f64
        } else {
            (1.0 - SMOOTHING) * m.new_blocks + SMOOTHING * new_blocks as f64
        };
        let mut key = (overlap >= min_blocks).then(|| block_hashes[overlap - 1]);
        if let Some(k) = key
            && !m.tracked.contains_key(&k)
        {
            // A shorter hit on a longer tracked prefix (its tail was evicted): a use of that
            // prefix, which this request's prefill makes whole again.
            if let Some((&longer, _)) = m.tracked.iter().find(|(_, t)| {
                t.blocks > overlap
                    && t.blocks <= block_hashes.len()
                    && t.hashes[overlap - 1] == k
                    && block_hashes[t.blocks - 1] == t.hashes[t.blocks - 1]
            }) {
                key = Some(longer);
            }
        }
        let key_blocks = key.map_or(0, |k| m.tracked.get(&k).map_or(overlap, |t| t.blocks));
        // Shorter tracked prefixes inside this one (a conversation's earlier turns) are this
        // one now: their blocks are its blocks.
        let mut inherited_gap: Option<f64> = None;
        if let Some(k) = key {
            let inside: Vec<u64> = m
                .tracked
                .iter()
                .filter(|&(&tk, t)| {
                    tk != k && t.blocks <= key_blocks && block_hashes[t.blocks - 1] == tk
                })
                .map(|(&tk, _)| tk)
                .collect();
            for tk in inside {
                if let Some(t) = m.tracked.remove(&tk) {
                    inherited_gap = Some(inherited_gap.map_or(t.gap, |g: f64| g.min(t.gap)));
                }
                m.queue.take(tk);
                m.shadow.take(tk);
            }
            m.queue.take(k);
            m.shadow.take(k);
        }
        let requests = m.requests;
        if m.recent.len() == RECENT {
            m.recent.pop_front();
        }
        m.recent
            .push_back((key, key_blocks, total.saturating_sub(key_blocks)));
        // The request's blocks go to the tail: the prefix's (just taken out of the queue) and
        // its own new ones, taken from the head. A prefix newly learned was counted as its
        // first request's garbage: the surplus goes from the head too.
        for q in [&mut m.queue, &mut m.shadow] {
            q.allocate(total, capacity);
            match key {
                Some(k) => {
                    q.push_tail(None, total.saturating_sub(key_blocks));
                    q.push_tail(Some(k), key_blocks);
                }
                None => q.push_tail(None, total),
            }
        }
        if let Some(k) = key {
            {
                let tracked_count = m.tracked.len();
                match m.tracked.get_mut(&k) {
                    Some(t) => {
                        let gap = requests.saturating_sub(t.last_use) as f64;
                        t.gap = (1.0 - SMOOTHING) * t.gap + SMOOTHING * gap;
                        t.last_use = requests;
                        t.last_touch = requests;
                        t.reuses += 1;
                        t.gone = false;
                    }
                    None => {
                        let mut tokens = Vec::with_capacity(key_blocks * bs + 1);
                        tokens.extend_from_slice(&prompt[..key_blocks * bs]);
                        // One token past the last full block: the engine then finds every block
                        // cached and computes just this one.
                        tokens.push(prompt.get(key_blocks * bs).copied().unwrap_or(prompt[0]));
                        m.tracked.insert(
                            k,
                            Tracked {
                                blocks: key_blocks,
                                prompt: tokens.into(),
                                hashes: block_hashes[..key_blocks].into(),
                                last_use: requests,
                                gap: inherited_gap.unwrap_or((tracked_count + 1) as f64),
                                reuses: 1,
                                extends: inherited_gap.is_some(),
                                gone: false,
                                last_touch: requests,
                            },
                        );
                        if m.tracked.len() > max_tracked {
                            let coldest = m
                                .tracked
                                .iter()
                                .filter(|&(&tk, _)| tk != k)
                                .max_by(|a, b| {
                                    a.1.interval(requests).total_cmp(&b.1.interval(requests))
                                })
                                .map(|(&tk, _)| tk);
                            if let Some(tk) = coldest {
                                m.tracked.remove(&tk);
                                m.queue.forget(tk);
                                m.shadow.forget(tk);
                            }
                        }
                    }
                }
            }
        }
    }

    /// Another router replica, owner of `worker`'s retention, refreshed there the prefix of
    /// these leading block hashes: the model moves that prefix to the tail as its own refresh
    /// would have (without counting it in this replica's stats, which count what it sent).
    /// False when no tracked prefix starts with them (the refresh taught this model nothing).
    pub fn refreshed_elsewhere(&mut self, worker: usize, block_hashes: &[u64]) -> bool {
        let Some(m) = self.workers.get_mut(worker) else {
            return false;
        };
        let held = block_hashes.len();
        let Some((&k, t)) = m
            .tracked
            .iter_mut()
            .find(|(_, t)| held > 0 && t.blocks >= held && t.hashes[..held] == *block_hashes)
        else {
            return false;
        };
        t.last_touch = m.requests;
        t.gone = false;
        m.queue.take(k);
        m.queue.push_tail(Some(k), held);
        true
    }

    /// Where among `slots` a prompt of these block hashes goes, or None where the policy
    /// decides: a prompt of at least `min_prefix_blocks` blocks that the index finds cached on
    /// none of them goes to the slot that is home to the fewest prefix families (its own
    /// family's home counting it one less), among those running at most
    /// `room_slack_requests` more than the mean; then one whose LoRA slots (the step's model,
    /// `WorkerState::adapters`) hold the prompt's `adapter`, so that a tenant's prefixes
    /// gather where its adapter is loaded; then the least loaded, then the first (see the
    /// module docs). The policy is not asked: it would see only part of the fleet, and a
    /// policy that keeps state per worker (kv-aware's recent shares) forgets the others.
    pub fn room_for(
        &self,
        step: &RoutingStep,
        index: Option<&mut KvIndex>,
        slots: &[usize],
        block_hashes: &[u64],
        adapter: Option<u64>,
        now: f64,
    ) -> Option<usize> {
        let min_blocks = self.config.min_prefix_blocks.max(1);
        if self.config.mode == RetentionMode::Off
            || slots.len() < 2
            || block_hashes.len() < min_blocks
        {
            return None;
        }
        let index = index?;
        let ids: Vec<_> = slots
            .iter()
            .map(|&w| index.worker_id(&step.state(w).name))
            .collect();
        let mut overlaps = Vec::with_capacity(ids.len());
        index.overlaps_into(&block_hashes[..min_blocks], &ids, now, &mut overlaps);
        if overlaps.iter().any(|&o| o >= min_blocks) {
            return None;
        }
        // Only while the fleet can keep every family in recent use, with room to spare for the
        // running requests' own blocks: where it cannot (more prefixes than room), a miss costs
        // a miss wherever it goes, and sending it past the least loaded worker only costs
        // latency.
        let (sum, n) = self
            .workers
            .iter()
            .flat_map(|m| m.tracked.values())
            .fold((0usize, 0usize), |(s, n), t| (s + t.blocks, n + 1));
        let fleet = slots.iter().map(|&w| self.capacity(w)).sum::<usize>() as f64;
        // Before any prefix is tracked (a warmup), the prompt's own blocks stand for the size.
        let size = if n == 0 {
            block_hashes.len() as f64
        } else {
            sum as f64 / n as f64
        };
        let fit = (self.config.room_max_fill * fleet / size.max(1.0)) as usize;
        if self
            .homes
            .recent_exceed(slots.len() as u64 * RECENT as u64, fit)
        {
            return None;
        }
        let mean =
            slots.iter().map(|&w| step.state(w).in_flight).sum::<i64>() as f64 / slots.len() as f64;
        let limit = mean + self.config.room_slack_requests;
        // The family's own home counts it one less: a tie sends it back there.
        let own = self.homes.home(block_hashes[min_blocks - 1]);
        slots
            .iter()
            .copied()
            .filter(|&w| step.state(w).in_flight as f64 <= limit)
            .min_by_key(|&w| {
                let homed = self.homes.count(w);
                let homed = if own == Some(w) {
                    homed.saturating_sub(1)
                } else {
                    homed
                };
                let state = step.state(w);
                let displaces = adapter.is_some_and(|a| state.displaces_adapter(a));
                (homed, displaces, state.in_flight)
            })
    }

    /// [`Retention::poll`] for a routing step's slot `worker`, the index (if any) answering
    /// what it still holds; each refresh is recorded in the index as routed there (it makes
    /// the worker touch those blocks).
    pub fn poll_step(
        &mut self,
        step: &RoutingStep,
        mut index: Option<&mut KvIndex>,
        worker: usize,
        incoming_blocks: usize,
        now: f64,
        out: &mut Vec<Refresh>,
    ) {
        if self.config.mode == RetentionMode::Off || worker >= step.slot_count() {
            return;
        }
        let state = step.state(worker);
        let from = out.len();
        let id = index.as_deref().and_then(|ix| ix.worker_id(&state.name));
        // This worker first, then (for `auto`'s copy test) the other live ones.
        let others = self.config.mode == RetentionMode::Auto;
        let ids: Vec<Option<_>> = index.as_deref().map_or(Vec::new(), |ix| {
            std::iter::once(id)
                .chain(
                    step.live_slots()
                        .iter()
                        .filter(|&&w| others && w != worker)
                        .map(|&w| ix.worker_id(&step.state(w).name)),
                )
                .collect()
        });
        let mut scratch = Vec::with_capacity(ids.len());
        let mut held = |hashes: &[u64]| match (index.as_deref_mut(), id) {
            (Some(ix), Some(_)) => {
                ix.overlaps_into(hashes, &ids, now, &mut scratch);
                let elsewhere = scratch[1..].iter().copied().max().unwrap_or(0);
                (scratch[0], elsewhere)
            }
            _ => (0, 0),
        };
        self.poll(worker, state, &mut held, incoming_blocks, now, out);
        if let (Some(ix), Some(id)) = (index, id) {
            for r in &out[from..] {
                ix.record_routed_to(id, &r.block_hashes, now);
            }
        }
    }

    /// [`Retention::poll_step`] for a worker whose last request just finished (call it after
    /// the routing step counted that, at `now`): `auto`'s refreshes that find it idle, each on
    /// its own (`incoming_blocks` 0), make a step nobody waits behind unless a request comes
    /// in the few milliseconds it takes. Nothing while the worker still runs requests, nor in
    /// the other modes (`on` sends its refreshes ahead of the requests, whatever the load).
    pub fn poll_idle(
        &mut self,
        step: &RoutingStep,
        index: Option<&mut KvIndex>,
        worker: usize,
        now: f64,
        out: &mut Vec<Refresh>,
    ) {
        if self.polls_idle(step, worker) {
            self.poll_step(step, index, worker, 0, now, out);
        }
    }

    /// Whether [`Retention::poll_idle`] would poll `worker` now (`auto`, and no request
    /// running there): a caller can skip taking the index's lock when it would not.
    pub fn polls_idle(&self, step: &RoutingStep, worker: usize) -> bool {
        self.config.mode == RetentionMode::Auto
            && worker < step.slot_count()
            && step.state(worker).in_flight <= 0
    }

    /// The refreshes to send to `worker` now, appended to `out`. `load` is the routing step's
    /// accounting of the worker; `held_blocks(hashes)` answers how many leading blocks of a
    /// prefix the index (events and predictions) says the worker still holds, and the most any
    /// other live worker holds (read by `auto` only; [`Retention::poll_step`] asks the index
    /// for it only then).
    pub fn poll(
        &mut self,
        worker: usize,
        load: &WorkerState,
        held_blocks: &mut dyn FnMut(&[u64]) -> (usize, usize),
        incoming_blocks: usize,
        _now: f64,
        out: &mut Vec<Refresh>,
    ) {
        let mode = self.config.mode;
        if mode == RetentionMode::Off || worker >= self.workers.len() {
            return;
        }
        let bs = self.config.block_size;
        let capacity = self.capacity(worker);
        let margin_requests = self.config.margin_requests;
        let value_floor = self.config.refresh_cost_tokens * self.config.value_ratio;
        let stats = &mut self.stats;
        let m = &mut self.workers[worker];
        if m.tracked.is_empty() {
            return;
        }
        let requests = m.requests;
        // Which prefixes deserve their blocks: the most demanded first, while they fit beside
        // the running requests' own blocks.
        let in_flight = load.in_flight.max(0) as f64;
        let reserve = (self.config.reserve_factor * in_flight * m.new_blocks).ceil() as usize;
        let budget = capacity.saturating_sub(reserve);
        let mut retained = retained_by_demand(m, requests, budget);
        if retained.is_empty() {
            return;
        }
        if mode == RetentionMode::Auto {
            if !self.payoff.pays(
                bs,
                self.config.min_payoff_tokens,
                self.config.pressure_tokens,
            ) {
                stats.declined_payoff += 1;
                return;
            }
            let (kept, total) = demand_kept(m, requests, &retained);
            if kept < self.config.min_coverage * total {
                stats.declined_coverage += 1;
                return;
            }
            // A cold prefix (a copy placed here once) is not worth its blocks, nor one not yet
            // seen reused.
            let horizon = self.config.max_turnovers * capacity as f64 / m.new_blocks.max(1.0);
            let min_reuses = self.config.min_reuses;
            retained.retain(|&(k, interval)| {
                interval <= horizon
                    && m.tracked
                        .get(&k)
                        .is_some_and(|t| !t.extends || t.reuses >= min_reuses)
            });
        }
        let margin = incoming_blocks as f64 + margin_requests * m.new_blocks.max(1.0);
        let uncached = capacity.saturating_sub(m.queue.held()) as f64;
        let refresh_after = self.config.refresh_after_requests;
        let min_blocks = self.config.min_prefix_blocks.max(1);
        // What the running requests pin (the one just routed is counted by the load but not
        // yet told: an older one stands in for it), and the new request's own blocks.
        let (running_pinned, running) = m.running(load.in_flight);
        let running_pinned = running_pinned + incoming_blocks;
        loop {
            let danger = Danger {
                uncached,
                margin,
                refresh_after,
                requests,
            };
            let Some(k) = danger.next(m, &retained) else {
                break;
            };
            retained.retain(|&(r, _)| r != k);
            let t = m
                .tracked
                .get_mut(&k)
                .expect("retained prefixes are tracked");
            if mode == RetentionMode::Auto && incoming_blocks == 0 && load.in_flight_tokens > 0 {
                // A refresh sent on its own makes a step (no request comes with it): only
                // when the worker has nothing to prefill anyway.
                stats.deferred_busy += 1;
                continue;
            }
            if mode == RetentionMode::Auto && incoming_blocks > 0 && load.in_flight == 1 {
                // Ahead of a request to an idle worker (the load counts that request alone): the
                // refresh would reach the idle engine first and step alone, and the request
                // would wait out that step (the emulator's 6 ms base; a forward pass on a
                // GPU). A busy worker takes both into its next step instead.
                stats.deferred_idle += 1;
                continue;
            }
            // The leading blocks the worker still holds: a prefix whose tail was evicted is
            // refreshed as far as it is held (its next use recomputes only the tail).
            let (held, elsewhere) = held_blocks(&t.hashes);
            let held = held.min(t.blocks);
            if held < min_blocks {
                t.gone = true;
                stats.skipped_evicted += 1;
                m.queue.take(k);
                m.shadow.take(k);
                continue;
            }
            if mode == RetentionMode::Auto && elsewhere >= held {
                // Another worker holds as much of it: this one is a copy (placed by a guard's
                // spill), and its loss costs no miss, since the policy sends the prefix where
                // it is held. Refreshing copies only kept rarely used duplicates alive and took
                // room from the prefixes this worker is the one holder of.
                stats.declined_held_elsewhere += 1;
                continue;
            }
            if mode == RetentionMode::Auto {
                // Refreshes until its next use, each keeping it one trigger longer.
                let every = if refresh_after > 0 {
                    (refresh_after as f64).min(margin_requests)
                } else {
                    margin_requests
                };
                let remaining = (t.gap - requests.saturating_sub(t.last_use) as f64).max(1.0);
                let refreshes_needed = (remaining / every.max(0.5)).max(1.0);
                let value = (held * bs) as f64 / refreshes_needed;
                if value < value_floor {
                    stats.declined_value += 1;
                    continue;
                }
            }
            // A refresh pins its prefix for one step: beside what the running requests pin,
            // that must leave the worker room to admit them, or a client request waits behind
            // the refresh for blocks.
            // A prefix one of them pins adds nothing (and the oldest of them, which stands in
            // for the request just routed, may have ended: its prefix is then in the queue).
            let extra = if running.contains(&Some(k)) { 0 } else { held };
            if running_pinned + extra > capacity {
                stats.deferred_full += 1;
                continue;
            }
            let (prompt, hashes) = if held == t.blocks {
                (t.prompt.clone(), t.hashes.clone())
            } else {
                let mut p = Vec::with_capacity(held * bs + 1);
                p.extend_from_slice(&t.prompt[..held * bs]);
                p.push(t.prompt[held * bs]);
                stats.partial += 1;
                (p.into(), t.hashes[..held].into())
            };
            out.push(Refresh {
                worker,
                prompt,
                block_hashes: hashes,
                blocks: held,
            });
            stats.refreshes += 1;
            stats.refreshed_blocks += held as u64;
            t.last_touch = requests;
            self.payoff.refreshes += 1.0;
            m.queue.take(k);
            m.queue.push_tail(Some(k), held);
        }
    }
}

/// The tracked prefixes of `m` that deserve their blocks, as `(key, interval)`: the most
/// demanded first (the shortest interval between uses), while they fit in `budget` blocks
/// beside the running requests' own.
fn retained_by_demand(m: &WorkerModel, requests: u64, budget: usize) -> Vec<(u64, f64)> {
    let mut ranked: Vec<(f64, u64, usize)> = m
        .tracked
        .iter()
        .map(|(&k, t)| (t.interval(requests), k, t.blocks))
        .collect();
    ranked.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut used = 0usize;
    let mut retained = Vec::new();
    for (interval, k, blocks) in ranked {
        if used + blocks > budget {
            break;
        }
        used += blocks;
        retained.push((k, interval));
    }
    retained
}

/// `m`'s demand (uses per request) that the `retained` prefixes carry, and over every
/// tracked prefix.
fn demand_kept(m: &WorkerModel, requests: u64, retained: &[(u64, f64)]) -> (f64, f64) {
    let demand = |interval: f64| 1.0 / interval;
    let total: f64 = m
        .tracked
        .values()
        .map(|t| demand(t.interval(requests)))
        .sum();
    let kept: f64 = retained.iter().map(|&(_, i)| demand(i)).sum();
    (kept, total)
}

/// When a retained prefix is in danger of eviction (see [`Danger::next`]).
struct Danger {
    /// Blocks of the cache not yet filled (allocations take them before they evict).
    uncached: f64,
    /// How many blocks from the head of the free queue count as near it.
    margin: f64,
    /// A prefix untouched for this many requests is refreshed once the cache is full (0: off).
    refresh_after: u64,
    /// The worker's requests so far.
    requests: u64,
}

impl Danger {
    /// The retained prefix nearest the head of `m`'s free queue, if it is within the margin;
    /// else one the model lost track of, or one left untouched too long while the cache is
    /// full (allocations evict: where the free queue still has room, nothing is).
    fn next(&self, m: &WorkerModel, retained: &[(u64, f64)]) -> Option<u64> {
        let mut distance = self.uncached;
        for s in &m.queue.segments {
            if let Some(k) = s.key
                && retained.iter().any(|&(r, _)| r == k)
                && distance < self.margin
            {
                return Some(k);
            }
            distance += s.blocks as f64;
        }
        retained.iter().map(|&(k, _)| k).find(|k| {
            let t = &m.tracked[k];
            !t.gone
                && (m.queue.holds(*k) == 0
                    || (self.refresh_after > 0
                        && self.uncached < self.margin
                        && self.requests.saturating_sub(t.last_touch) >= self.refresh_after))
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;

    const BS: usize = 4;

    fn prompt(prefix: u32, prefix_blocks: usize, suffix: usize, salt: u32) -> (Vec<u32>, Vec<u64>) {
        let mut tokens: Vec<u32> = (0..prefix_blocks * BS)
            .map(|i| prefix * 1000 + i as u32)
            .collect();
        tokens.extend((0..suffix).map(|i| 500_000 + salt * 100 + i as u32));
        // Toy chained hashes: block i's hash is a function of the tokens so far.
        let mut hashes = Vec::new();
        let mut h = 0u64;
        for chunk in tokens.chunks_exact(BS) {
            for &t in chunk {
                h = h.wrapping_mul(1_000_003).wrapping_add(t as u64 + 1);
            }
            hashes.push(h);
        }
        (tokens, hashes)
    }

    fn idle() -> WorkerState {
        WorkerState::new("w")
    }

    fn held_all(_: &[u64]) -> (usize, usize) {
        (usize::MAX, 0)
    }

    /// Route `n` requests cycling over `prefixes` prefixes of 10 blocks, each with 2 blocks of
    /// suffix and 1 of output, to worker 0, polling after each; returns the refreshes.
    fn drive(r: &mut Retention, prefixes: u32, n: u32, load: &WorkerState) -> Vec<Refresh> {
        let mut refreshes = Vec::new();
        for i in 0..n {
            let p = i % prefixes;
            let (tokens, hashes) = prompt(p, 10, 2 * BS, i);
            // The first use of a prefix has no overlap; later ones are credited with it.
            let overlap = if i < prefixes { 0 } else { 10 };
            r.routed(0, &hashes, &tokens, overlap, BS, i as f64);
            r.poll(0, load, &mut held_all, 3, i as f64, &mut refreshes);
        }
        refreshes
    }

    #[test]
    fn off_never_refreshes() {
        let mut r = Retention::new(RetentionConfig::new(RetentionMode::Off, BS, 45));
        assert!(drive(&mut r, 4, 200, &idle()).is_empty());
        assert_eq!(r.stats(), RetentionStats::default());
    }

    #[test]
    fn a_peers_refreshes_keep_a_replicas_model_where_its_own_would() {
        // Two replicas see the same routing (the mesh shares it); only the owner polls. The
        // other, told of each refresh, models the worker's free queue as the owner does; one
        // that is not told models a queue the refreshes never reordered.
        let load = idle();
        let (mut owner, mut told, mut untold) = (
            Retention::new(RetentionConfig::new(RetentionMode::On, BS, 45)),
            Retention::new(RetentionConfig::new(RetentionMode::On, BS, 45)),
            Retention::new(RetentionConfig::new(RetentionMode::On, BS, 45)),
        );
        let mut sent = 0;
        for i in 0..60u32 {
            let p = i % 4;
            let (tokens, hashes) = prompt(p, 10, 2 * BS, i);
            let overlap = if i < 4 { 0 } else { 10 };
            for r in [&mut owner, &mut told, &mut untold] {
                r.routed(0, &hashes, &tokens, overlap, BS, f64::from(i));
            }
            let mut out = Vec::new();
            owner.poll(0, &load, &mut held_all, 3, f64::from(i), &mut out);
            for refresh in &out {
                assert!(told.refreshed_elsewhere(0, &refresh.block_hashes));
            }
            sent += out.len();
        }
        assert!(sent > 0, "4 prefixes of 10 blocks overflow 45 blocks");
        let queue = |r: &Retention| format!("{:?}", r.workers[0].queue);
        assert_eq!(queue(&told), queue(&owner));
        assert_ne!(queue(&untold), queue(&owner));
        assert_eq!(
            told.stats().refreshes,
            0,
            "a peer's refreshes are not counted as sent"
        );
        assert!(!told.refreshed_elsewhere(0, &[1, 2, 3]));
    }

    #[test]
    fn everything_fits_nothing_is_refreshed() {
        // 2 prefixes of 10 blocks on 200 blocks: the garbage goes long before either prefix.
        let mut r = Retention::new(RetentionConfig::new(RetentionMode::On, BS, 200));
        assert!(drive(&mut r, 2, 200, &idle()).is_empty());
        assert_eq!(r.tracked(0), 2);
    }

    /// vLLM's free queue at block granularity, for the tests: blocks are named by their hash
    /// (a prefix's) or a unique id (a request's own), the head is evicted first.
    struct ReferenceLru {
        capacity: usize,
        queue: VecDeque<u64>,
    }

    impl ReferenceLru {
        /// Run a request: returns whether all `prefix` blocks were cached. Its own `own` blocks
        /// are allocated from the head; then everything is freed in reverse (own blocks first,
        /// the prefix's first block last: the MRU end).
        fn request(&mut self, prefix: &[u64], own: &[u64]) -> bool {
            let hit = prefix.iter().all(|h| self.queue.contains(h));
            self.queue.retain(|b| !prefix.contains(b));
            while self.queue.len() + prefix.len() + own.len() > self.capacity {
                self.queue.pop_front();
            }
            for &b in own.iter().rev() {
                self.queue.push_back(b);
            }
            for &b in prefix.iter().rev() {
                self.queue.push_back(b);
            }
            hit
        }
    }

    /// Hits of `n` requests cycling over 4 prefixes of 10 blocks (2 blocks of suffix and 1 of
    /// output each) on a 45-block worker, with retention in `mode` sending its refreshes
    /// ahead of each request.
    fn reference_hits(mode: RetentionMode, n: u32) -> (u32, u64) {
        let (hits, stats) = reference_run(RetentionConfig::new(mode, BS, 45), n);
        (hits, stats.refreshes)
    }

    /// [`reference_hits`] with `config`: the hits and the stats.
    fn reference_run(config: RetentionConfig, n: u32) -> (u32, RetentionStats) {
        let mut r = Retention::new(config);
        let mut lru = ReferenceLru {
            capacity: 45,
            queue: VecDeque::new(),
        };
        let mut hits = 0;
        let mut order = crate::pyrandom::PyRandom::from_seed(7);
        for i in 0..n {
            let p = order.randbelow(4) as u32;
            let (tokens, hashes) = prompt(p, 10, 2 * BS, i);
            let prefix = &hashes[..10];
            let own: Vec<u64> = (0..3).map(|j| (1u64 << 60) + (i as u64) * 8 + j).collect();
            let overlap = if prefix.iter().all(|h| lru.queue.contains(h)) {
                10
            } else {
                0
            };
            let mut out = Vec::new();
            let mut held =
                |hs: &[u64]| (hs.iter().take_while(|h| lru.queue.contains(h)).count(), 0);
            r.poll(0, &idle(), &mut held, 13 - overlap, 0.0, &mut out);
            for f in &out {
                lru.request(&f.block_hashes, &[]);
            }
            if lru.request(prefix, &own) {
                hits += 1;
            }
            r.routed(0, &hashes, &tokens, overlap, BS, 0.0);
        }
        (hits, r.stats())
    }

    #[test]
    fn auto_keeps_refreshing_where_the_plain_lru_would_lose_the_prefixes() {
        let mut cfg = RetentionConfig::new(RetentionMode::Auto, BS, 45);
        cfg.refresh_cost_tokens = 1.0;
        cfg.pressure_tokens = 4.0;
        cfg.min_payoff_tokens = 2.0;
        let (hits, stats) = reference_run(cfg, 400);
        let (off, _) = reference_hits(RetentionMode::Off, 400);
        assert!(hits >= 380, "auto keeps them: {hits} of 400 (off: {off})");
        // Measured against the LRU without refreshes: they saved prefills, and it went on.
        assert!(stats.saved_blocks > 0 && stats.lost_blocks >= stats.saved_blocks);
    }

    #[test]
    fn auto_stops_where_the_plain_lru_loses_nothing() {
        // 3 prefixes of 10 blocks in turn and 3 own blocks a request on 45 blocks: the model
        // puts each near the head between its uses (on refreshes it), but the LRU evicts only
        // the requests' own blocks before its next use, so a refresh buys nothing.
        let run = |mode: RetentionMode| {
            let mut cfg = RetentionConfig::new(mode, BS, 45);
            cfg.refresh_cost_tokens = 1.0;
            let mut r = Retention::new(cfg);
            let mut late = 0;
            for i in 0..200u32 {
                let (tokens, hashes) = prompt(i % 3, 10, 2 * BS, i);
                let mut out = Vec::new();
                r.poll(0, &idle(), &mut held_all, 3, 0.0, &mut out);
                if i >= 100 {
                    late += out.len();
                }
                r.routed(0, &hashes, &tokens, if i < 3 { 0 } else { 10 }, BS, 0.0);
            }
            (late, r.stats())
        };
        let (on, stats) = run(RetentionMode::On);
        assert!(on > 0, "on refreshes them");
        assert_eq!(stats.lost_blocks, 0, "the plain LRU keeps them");
        let (auto, stats) = run(RetentionMode::Auto);
        assert_eq!(auto, 0, "auto stops once it saw the uses");
        assert!(stats.declined_payoff > 0);
    }

    #[test]
    fn prefixes_that_would_age_out_are_refreshed() {
        // 4 prefixes of 10 blocks and 3 own blocks a request on 45 blocks: they fit, but the
        // LRU keeps the last requests' own blocks and evicts a prefix idle for a few requests.
        let (off, none) = reference_hits(RetentionMode::Off, 400);
        let (on, refreshes) = reference_hits(RetentionMode::On, 400);
        assert_eq!(none, 0);
        assert!(off < 330, "the LRU alone loses prefixes: {off} of 400");
        assert!(
            on >= 380,
            "retention keeps them (all but the first uses): {on} of 400 (off: {off})"
        );
        assert!(refreshes > 0);
    }

    /// Four 10-block prefixes in turn on one 45-block worker (reused from the fifth request
    /// on), polled after each with the index holding only `held` leading blocks of any.
    fn four_prefixes_with_index_holding(held: usize) -> (Retention, Vec<Refresh>) {
        let mut r = Retention::new(RetentionConfig::new(RetentionMode::On, BS, 45));
        let mut out = Vec::new();
        for i in 0..40u32 {
            let p = i % 4;
            let (tokens, hashes) = prompt(p, 10, 2 * BS, i);
            r.routed(0, &hashes, &tokens, if i < 4 { 0 } else { 10 }, BS, 0.0);
            r.poll(0, &idle(), &mut |_| (held, 0), 3, 0.0, &mut out);
        }
        (r, out)
    }

    #[test]
    fn a_prefix_the_index_lost_is_not_refreshed() {
        // One block left: less than a refresh is worth (min_prefix_blocks 2).
        let (r, out) = four_prefixes_with_index_holding(1);
        assert!(out.is_empty());
        assert!(r.stats().skipped_evicted > 0);
    }

    #[test]
    fn a_prefix_whose_tail_was_evicted_is_refreshed_as_far_as_it_is_held() {
        let (r, out) = four_prefixes_with_index_holding(3);
        assert!(!out.is_empty());
        for f in &out {
            // The 3 held blocks and one token more: a full hit on what is left, one token
            // computed, and those blocks moved to the free queue's tail.
            assert_eq!(
                (f.blocks, f.block_hashes.len(), f.prompt.len()),
                (3, 3, 3 * BS + 1)
            );
        }
        assert_eq!(r.stats().partial, out.len() as u64);
    }

    #[test]
    fn auto_sends_a_refresh_alone_only_when_the_worker_has_slack() {
        let mut busy = idle();
        busy.in_flight = 2;
        busy.in_flight_tokens = 300;
        let mut cfg = RetentionConfig::new(RetentionMode::Auto, BS, 45);
        cfg.refresh_cost_tokens = 1.0;
        let run = |load: &WorkerState, incoming: usize| {
            let mut r = Retention::new(cfg.clone());
            let mut out = Vec::new();
            for i in 0..60u32 {
                let p = i % 4;
                let (tokens, hashes) = prompt(p, 10, 2 * BS, i);
                r.poll(0, load, &mut held_all, incoming, 0.0, &mut out);
                r.routed(0, &hashes, &tokens, if i < 4 { 0 } else { 10 }, BS, 0.0);
            }
            (out.len(), r.stats())
        };
        // On its own (no request going there) while prefills wait: held back.
        let (sent, stats) = run(&busy, 0);
        assert_eq!(sent, 0);
        assert!(stats.deferred_busy > 0);
        // Ahead of a request (it rides in that request's step), or on an idle worker: sent.
        assert!(run(&busy, 3).0 > 0);
        assert!(run(&idle(), 0).0 > 0);
    }

    #[test]
    fn auto_sends_nothing_ahead_of_a_request_to_an_idle_worker_but_once_it_is_idle() {
        use crate::blocks::{BlockHasher, DEFAULT_HASH_SEED};
        // Four prefixes cycling on 45 blocks, each request routed to an idle worker and done
        // before the next: the refreshes wait for the worker to fall idle.
        let hasher = BlockHasher::new(BS, DEFAULT_HASH_SEED).unwrap();
        let mut index = KvIndex::new(hasher, Some(1e9), None, None).unwrap();
        let mut step = RoutingStep::new(BS);
        step.add_worker("w");
        let mut cfg = RetentionConfig::new(RetentionMode::Auto, BS, 45);
        cfg.refresh_cost_tokens = 1.0;
        let mut r = Retention::new(cfg);
        let (mut ahead, mut idle_sent) = (Vec::new(), Vec::new());
        for i in 0..60u32 {
            let (tokens, _) = prompt(i % 4, 10, 2 * BS, i);
            let hashes = hasher.hash_blocks(&tokens, None, 0, None);
            let routed = step.route_to(Some(&mut index), 0, &hashes, tokens.len(), None, 0.0);
            r.poll_step(&step, Some(&mut index), 0, 3, 0.0, &mut ahead);
            r.routed(0, &hashes, &tokens, routed.overlap, BS, 0.0);
            // Still running: nothing.
            let before = idle_sent.len();
            r.poll_idle(&step, Some(&mut index), 0, 0.0, &mut idle_sent);
            assert_eq!(idle_sent.len(), before);
            step.first_token(0, routed.prefill_tokens);
            step.finished(0, routed.ticket, 0.0);
            r.poll_idle(&step, Some(&mut index), 0, 0.0, &mut idle_sent);
        }
        assert!(ahead.is_empty());
        assert!(r.stats().deferred_idle > 0);
        assert!(!idle_sent.is_empty());
    }

    #[test]
    fn no_refresh_that_would_keep_the_running_requests_from_their_blocks() {
        // 3 requests of 13 blocks running on 45 blocks: a 10-block refresh pinned beside them
        // leaves no room for the next one, which would wait behind the refresh.
        let mut crowded = idle();
        crowded.in_flight = 3;
        let mut r = Retention::new(RetentionConfig::new(RetentionMode::On, BS, 45));
        for i in 0..100u32 {
            let (tokens, hashes) = prompt(i % 4, 10, 2 * BS, i);
            r.routed(0, &hashes, &tokens, if i < 4 { 0 } else { 10 }, BS, 0.0);
            let mut sent = Vec::new();
            r.poll(0, &crowded, &mut held_all, 3, 0.0, &mut sent);
            // What goes out is a prefix the running requests (the last 3 routed) pin anyway.
            for f in &sent {
                let running: Vec<u64> = (0..3)
                    .map(|back| prompt((i + 4 - back) % 4, 10, 0, 0).1[9])
                    .collect();
                assert!(running.contains(&f.block_hashes[9]), "request {i}");
            }
        }
        assert!(r.stats().deferred_full > 0);
        let mut r = Retention::new(RetentionConfig::new(RetentionMode::On, BS, 45));
        let mut two = idle();
        two.in_flight = 2;
        assert!(
            !drive(&mut r, 4, 100, &two).is_empty(),
            "2 × 13 + 10 blocks fit"
        );
    }

    #[test]
    fn a_prompt_cached_nowhere_goes_where_the_fewest_families_live() {
        use crate::blocks::{BlockHasher, DEFAULT_HASH_SEED};
        let hasher = BlockHasher::new(BS, DEFAULT_HASH_SEED).unwrap();
        let mut index = KvIndex::new(hasher, Some(1e9), None, None).unwrap();
        let mut step = RoutingStep::new(BS);
        for i in 0..3 {
            step.add_worker(&format!("w{i}"));
        }
        let slots = [0, 1, 2];
        let mut r = Retention::new(RetentionConfig::new(RetentionMode::Auto, BS, 45));
        let family = |p: u32| hasher.hash_blocks(&prompt(p, 10, BS, p).0, None, 0, None);
        // A sequential warmup of 6 families is dealt out two a worker, whatever the policy.
        for p in 0..6u32 {
            let hashes = family(p);
            let w = r
                .room_for(&step, Some(&mut index), &slots, &hashes, None, 0.0)
                .expect("cached nowhere");
            let routed = step.route_to(Some(&mut index), w, &hashes, 44, None, 0.0);
            assert_eq!(routed.overlap, 0);
            step.finished(w, routed.ticket, 0.0);
            r.routed(w, &hashes, &prompt(p, 10, BS, p).0, 0, BS, 0.0);
        }
        assert_eq!(
            (0..3).map(|w| r.homes.count(w)).collect::<Vec<_>>(),
            [2, 2, 2]
        );
        // Held somewhere (the prediction of that routing): the policy decides.
        assert_eq!(
            r.room_for(&step, Some(&mut index), &slots, &family(0), None, 0.0),
            None
        );
        // Evicted everywhere: back to its own home, which counts it one less.
        index = KvIndex::new(hasher, Some(1e9), None, None).unwrap();
        let home = r.homes.home(family(4)[1]).unwrap();
        assert_eq!(
            r.room_for(&step, Some(&mut index), &slots, &family(4), None, 0.0),
            Some(home)
        );
        // Unless that worker runs more than 2 requests above the mean: the next fewest.
        for _ in 0..4 {
            step.route_to(None, home, &[], 1, None, 0.0);
        }
        let other = r
            .room_for(&step, Some(&mut index), &slots, &family(4), None, 0.0)
            .unwrap();
        assert_ne!(other, home);
        // Off, or a prompt shorter than a tracked prefix: the policy decides.
        let off = Retention::new(RetentionConfig::new(RetentionMode::Off, BS, 45));
        assert_eq!(
            off.room_for(&step, Some(&mut index), &slots, &family(4), None, 0.0),
            None
        );
        assert_eq!(
            r.room_for(&step, Some(&mut index), &slots, &family(4)[..1], None, 0.0),
            None
        );
    }

    #[test]
    fn auto_leaves_a_copy_to_the_lru_and_on_refreshes_it() {
        // Four prefixes cycling on 45 blocks are in danger; another worker holds them all.
        let run = |mode: RetentionMode| {
            let mut cfg = RetentionConfig::new(mode, BS, 45);
            cfg.refresh_cost_tokens = 1.0;
            let mut r = Retention::new(cfg);
            let mut out = Vec::new();
            for i in 0..60u32 {
                let (tokens, hashes) = prompt(i % 4, 10, 2 * BS, i);
                r.poll(0, &idle(), &mut |h| (h.len(), h.len()), 3, 0.0, &mut out);
                r.routed(0, &hashes, &tokens, if i < 4 { 0 } else { 10 }, BS, 0.0);
            }
            (out.len(), r.stats())
        };
        let (sent, stats) = run(RetentionMode::Auto);
        assert_eq!(sent, 0);
        assert!(stats.declined_held_elsewhere > 0);
        assert!(run(RetentionMode::On).0 > 0);
    }

    #[test]
    fn auto_declines_a_refresh_worth_less_than_it_costs() {
        // A 10-block prefix of 4-token blocks saves 40 tokens: less than a 200-token refresh.
        let mut r = Retention::new(RetentionConfig::new(RetentionMode::Auto, BS, 45));
        assert!(drive(&mut r, 4, 100, &idle()).is_empty());
        assert!(r.stats().declined_value > 0);
    }

    #[test]
    fn a_longer_turn_subsumes_the_shorter_prefix() {
        let mut r = Retention::new(RetentionConfig::new(RetentionMode::On, BS, 1000));
        let (t1, h1) = prompt(1, 10, 0, 0);
        r.routed(0, &h1, &t1, 10, BS, 0.0);
        assert_eq!(r.tracked(0), 1);
        // The next turn: the same 10 blocks and 5 more, credited with 15.
        let mut t2 = t1.clone();
        t2.extend((0..5 * BS as u32).map(|i| 900_000 + i));
        let (_, h2full) = prompt(1, 10, 5 * BS, 0);
        let _ = h2full;
        let mut hashes = h1.clone();
        let mut h = *h1.last().unwrap();
        for chunk in t2[10 * BS..].chunks_exact(BS) {
            for &t in chunk {
                h = h.wrapping_mul(1_000_003).wrapping_add(t as u64 + 1);
            }
            hashes.push(h);
        }
        r.routed(0, &hashes, &t2, 15, BS, 1.0);
        assert_eq!(r.tracked(0), 1, "the earlier turn is part of the later one");
    }
}
