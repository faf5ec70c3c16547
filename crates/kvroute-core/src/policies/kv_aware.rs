//! `kv-aware`: the worker that leaves the least work, under the bounded-load, bounded-share
//! and (optional) bounded-admission-wait guards; see [`KvAware`].

use super::choose::{Choose, PolicyError};
use super::ties::weight;
use super::view::{RequestView, WorkerState};
use crate::pyrandom::PyRandom;

/// Options of [`KvAware`] (see its documentation for what each does and why the defaults),
/// read by serde by their field names, absent ones as in `Default` (their one owner).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvAwareConfig {
    /// Tokens per KV block; must be the index's.
    pub block_size: usize,
    /// Weight of the new request's prefill against the load terms.
    pub overlap_weight: f64,
    /// Prefill-token equivalent of one request in flight.
    pub request_weight: f64,
    /// ε of the bounded-load guard; None turns it off.
    pub load_factor: Option<f64>,
    /// δ of the bounded-share guard; None turns it off.
    pub share_factor: Option<f64>,
    /// The share's averaging window, in decisions per worker.
    pub share_window: f64,
    /// When placing a copy, request-in-flight equivalents charged per fair share.
    pub share_weight: f64,
    /// The KV-admission guard: the longest expected wait for KV blocks (a fraction of a
    /// typical request's duration) the cheapest worker may make the request wait before it
    /// goes where it waits less; None (the default) turns the guard off.
    pub admission_wait: Option<f64>,
    /// Prefill-token equivalent of sending a request to a worker whose full LoRA slots (the
    /// router's model of them) hold other adapters than its own.
    pub adapter_weight: f64,
}

impl Default for KvAwareConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            overlap_weight: 3.0,
            request_weight: 128.0,
            load_factor: Some(1.5),
            share_factor: Some(0.35),
            share_window: 24.0,
            share_weight: 4.0,
            admission_wait: None,
            adapter_weight: ADAPTER_WEIGHT,
        }
    }
}

/// The default [`KvAwareConfig::adapter_weight`].
pub const ADAPTER_WEIGHT: f64 = 512.0;

impl KvAwareConfig {
    /// The options, or what is wrong with them (the messages `kvroute serve` prints).
    pub fn validate(&self) -> Result<(), PolicyError> {
        if self.block_size < 1 {
            return Err(PolicyError(format!(
                "block size must be >= 1, got {}",
                self.block_size
            )));
        }
        if self.overlap_weight < 0.0
            || self.request_weight < 0.0
            || self.share_weight < 0.0
            || self.adapter_weight.is_nan()
            || self.adapter_weight < 0.0
        {
            return Err(PolicyError("kv-aware weights must be >= 0".into()));
        }
        if let Some(lf) = self.load_factor
            && lf < 0.0
        {
            return Err(PolicyError(format!("load factor must be >= 0, got {lf}")));
        }
        if let Some(sf) = self.share_factor
            && sf < 0.0
        {
            return Err(PolicyError(format!("share factor must be >= 0, got {sf}")));
        }
        if let Some(w) = self.admission_wait
            && (w.is_nan() || w < 0.0)
        {
            return Err(PolicyError(format!("admission wait must be >= 0, got {w}")));
        }
        if self.share_window < 1.0 {
            return Err(PolicyError(format!(
                "share window must be >= 1 decision per worker, got {}",
                self.share_window
            )));
        }
        Ok(())
    }
}

/// Send each request where it leaves the least work, without piling onto one worker.
///
/// Cost of worker *i*, in prefill-token equivalents (lower is better):
/// `overlap_weight · max(prompt_tokens − overlap_i · block_size, 1) + in_flight_tokens_i +
/// request_weight · in_flight_i`: the prefill the request would cost there after its cached
/// prefix, the prefill still queued there, and each request in flight's decode steps and the
/// KV blocks it pins (Dynamo's shape, with the load from the router's own accounting);
/// plus `adapter_weight` where the request's LoRA adapter would displace another from the
/// worker's full LoRA slots (the router's model of them, `WorkerState::adapters`): vLLM runs a
/// batch of at most `max_loras` adapters, so such a request waits for the other adapter's
/// requests to leave the batch, then for its own loading.
///
/// Two guards decide which workers may take the request; the cheapest of those wins (an
/// owner a guard refuses loses to the next best worker, which thereby gets a copy):
///
/// * **bounded load now**: `in_flight_i + 1 ≤ ceil((1 + load_factor) · max(1, (Σ in_flight +
///   1) / W))`, which catches bursts;
/// * **bounded share over time**: a worker with requests in flight may take the request only
///   while its share of the recent decisions (an exponential moving average over
///   `share_window · W` decisions, a running average from a prior of `share_window / 6`
///   decisions per worker at the fair share until then) is at most `(1 + share_factor)` times
///   the mean share. In-flight counts cannot see a worker that keeps serving more than its
///   share at low concurrency (K = 2 on 6 workers); the share can. An idle worker is exempt.
///   When this guard refuses every worker caching as much of the prompt as the best-cached
///   one the load guard allows (it is copying the prefix), the copy goes to the allowed
///   worker with the cheapest one's overlap whose `cost + share_weight · request_weight ·
///   share_i / mean(share)` is lowest: the worker sent the least lately holds the blocks
///   least in demand.
///
/// A third guard, **bounded admission wait** (off unless `admission_wait` is set), watches KV
/// memory rather than counts: when the cheapest allowed worker could not admit the request
/// now (its requests in flight pin too many blocks, `crate::admission`) and none of them is
/// expected to end within `admission_wait` of a typical request's duration, the request goes
/// to the cheapest worker where it would wait no longer and that runs fewer requests, if there
/// is one. A hit that waits out a request costs hundreds of milliseconds where a miss
/// elsewhere costs one prefill; this bounds the tail at high concurrency, at the price of the
/// copies it makes, which on an overloaded fleet cost more hits than the tail it saves (see
/// `docs/router.md`): hence off by default.
///
/// Ties go to the emptiest cache (`cached_blocks`), then to the highest `xxh3(worker name,
/// seed = the prompt's last block hash)`: different from request to request, the same on
/// every replica. A prompt without a full block breaks its ties with the rng.
///
/// State: the recent shares, keyed by worker name; a worker absent from a call is forgotten
/// and comes back at the fair share. The defaults were chosen on the simulator (reference
/// workload at K = 2…24, Zipf α = 1.2); `kvroute.routing.policies` documents the sweep.
#[derive(Clone, Debug)]
pub struct KvAware {
    config: KvAwareConfig,
    /// For prompts shorter than a block only.
    pub rng: PyRandom,
    /// Names and shares of the workers of the last decision, aligned.
    share_names: Vec<String>,
    share_values: Vec<f64>,
    decisions: u64,
    /// Decisions the admission guard moved off a worker where the request would have waited.
    admission_diversions: u64,
}

impl KvAware {
    /// A kv-aware policy with these options.
    pub fn new(config: KvAwareConfig, rng: PyRandom) -> Result<Self, PolicyError> {
        config.validate()?;
        Ok(Self {
            config,
            rng,
            share_names: Vec::new(),
            share_values: Vec::new(),
            decisions: 0,
            admission_diversions: 0,
        })
    }

    /// The options.
    pub fn config(&self) -> &KvAwareConfig {
        &self.config
    }

    /// Decisions the admission guard moved off a worker where the request would have waited
    /// for KV blocks (cumulative).
    pub fn admission_diversions(&self) -> u64 {
        self.admission_diversions
    }

    /// Each worker's cost, aligned with `workers`.
    pub fn costs(&self, request: &RequestView<'_>, workers: &[&WorkerState]) -> Vec<f64> {
        let c = &self.config;
        let bs = c.block_size as i64;
        let prompt = request.prompt_tokens as i64;
        let overlap = request.overlap_blocks.filter(|o| !o.is_empty());
        workers
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let o = overlap.map_or(0, |o| o[i]) as i64;
                let cost = c.overlap_weight * (prompt - o * bs).max(1) as f64
                    + w.in_flight_tokens as f64
                    + c.request_weight * w.in_flight as f64;
                match request.adapter {
                    Some(a) if w.displaces_adapter(a) => cost + c.adapter_weight,
                    _ => cost,
                }
            })
            .collect()
    }

    /// Each worker's share of the recent decisions (the fair share 1/W for one the policy
    /// has not decided for yet).
    pub fn shares(&self, workers: &[&WorkerState]) -> Vec<f64> {
        let fair = 1.0 / workers.len() as f64;
        let aligned = self.share_names.len() == workers.len()
            && self
                .share_names
                .iter()
                .zip(workers)
                .all(|(n, w)| *n == w.name);
        if aligned {
            return self.share_values.clone();
        }
        workers
            .iter()
            .map(|w| {
                self.share_names
                    .iter()
                    .position(|n| *n == w.name)
                    .map_or(fair, |p| self.share_values[p])
            })
            .collect()
    }

    /// Replace the recent shares (a replica taking over another's state; tests), and, when
    /// given, the count of decisions they averaged (which sets how fast they move on).
    pub fn restore_shares(
        &mut self,
        shares: impl IntoIterator<Item = (String, f64)>,
        decisions: Option<u64>,
    ) {
        (self.share_names, self.share_values) = shares.into_iter().unzip();
        if let Some(n) = decisions {
            self.decisions = n;
        }
    }

    /// The decisions the recent shares have counted (this replica's and those observed).
    pub fn share_decisions(&self) -> u64 {
        self.decisions
    }

    /// The recent shares by worker name.
    pub fn recent_shares(&self) -> impl Iterator<Item = (&str, f64)> {
        self.share_names
            .iter()
            .map(String::as_str)
            .zip(self.share_values.iter().copied())
    }

    /// Workers the guards let take one more request.
    pub fn eligible(&self, workers: &[&WorkerState]) -> Vec<usize> {
        self.guards(workers, &self.shares(workers)).1
    }

    /// (workers the bounded-load guard allows, those the bounded-share guard allows too).
    fn guards(&self, workers: &[&WorkerState], shares: &[f64]) -> (Vec<usize>, Vec<usize>) {
        let n = workers.len();
        let mut by_load: Vec<usize> = (0..n).collect();
        if let Some(lf) = self.config.load_factor {
            let total: i64 = workers.iter().map(|w| w.in_flight).sum();
            let mean = f64::max(1.0, (total + 1) as f64 / n as f64);
            let limit = ((1.0 + lf) * mean - 1e-9).ceil();
            by_load.retain(|&i| ((workers[i].in_flight + 1) as f64) <= limit);
        }
        let Some(sf) = self.config.share_factor else {
            return (by_load.clone(), by_load);
        };
        let sum: f64 = shares.iter().sum();
        let limit = (1.0 + sf) * sum / shares.len() as f64;
        let steady: Vec<usize> = by_load
            .iter()
            .copied()
            .filter(|&i| shares[i] <= limit || workers[i].in_flight == 0)
            .collect();
        if steady.is_empty() {
            (by_load.clone(), by_load)
        } else {
            (by_load, steady)
        }
    }

    /// The KV-admission guard: when a cheapest one of the `candidates` would make the request
    /// wait for KV blocks longer than `admission_wait`, only those where it would wait no
    /// longer and that run fewer requests than it may take it (if there are any; `by_load` is
    /// cut to them too, so that a copy is placed among them). The load condition keeps the
    /// guard from moving work on a fleet where every worker is as full: there a miss elsewhere
    /// queues as long and adds a prefill.
    fn admission_guard(
        &mut self,
        request: &RequestView<'_>,
        workers: &[&WorkerState],
        costs: &[f64],
        by_load: Vec<usize>,
        candidates: Vec<usize>,
    ) -> (Vec<usize>, Vec<usize>) {
        let (Some(limit), Some(waits)) = (
            self.config.admission_wait,
            request.admission_wait.filter(|w| !w.is_empty()),
        ) else {
            return (by_load, candidates);
        };
        let best = candidates
            .iter()
            .map(|&i| costs[i])
            .fold(f64::INFINITY, f64::min);
        let fits = |i: &usize| waits[*i] <= limit;
        let Some(blocked_load) = candidates
            .iter()
            .filter(|i| costs[**i] == best && !fits(i))
            .map(|&i| workers[i].in_flight)
            .min()
        else {
            return (by_load, candidates);
        };
        let fits = |i: &usize| fits(i) && workers[*i].in_flight < blocked_load;
        let allowed: Vec<usize> = candidates.iter().copied().filter(fits).collect();
        if allowed.is_empty() {
            return (by_load, candidates);
        }
        self.admission_diversions += 1;
        (by_load.into_iter().filter(fits).collect(), allowed)
    }

    fn decide(
        &mut self,
        request: &RequestView<'_>,
        workers: &[&WorkerState],
        shares: &[f64],
    ) -> usize {
        let costs = self.costs(request, workers);
        let (by_load, candidates) = self.guards(workers, shares);
        let (by_load, candidates) =
            self.admission_guard(request, workers, &costs, by_load, candidates);
        let best = candidates
            .iter()
            .map(|&i| costs[i])
            .fold(f64::INFINITY, f64::min);
        let mut tied: Vec<usize> = candidates
            .iter()
            .copied()
            .filter(|&i| costs[i] == best)
            .collect();
        let overlap = request.overlap_blocks.filter(|o| !o.is_empty());
        let refused = candidates.len() < by_load.len();
        if refused && let Some(overlap) = overlap {
            let best_allowed = candidates.iter().map(|&i| overlap[i]).max().unwrap_or(0);
            let best_loadable = by_load.iter().map(|&i| overlap[i]).max().unwrap_or(0);
            if best_allowed < best_loadable {
                // The share guard refused the best-cached workers: it is copying the prefix.
                // Place the copy where recent demand is lowest.
                let sum: f64 = shares.iter().sum();
                let per_share =
                    self.config.share_weight * self.config.request_weight * shares.len() as f64
                        / sum;
                let level = overlap[tied[0]];
                let copy: Vec<(usize, f64)> = candidates
                    .iter()
                    .copied()
                    .filter(|&i| overlap[i] == level)
                    .map(|i| (i, costs[i] + per_share * shares[i]))
                    .collect();
                let best = copy.iter().map(|c| c.1).fold(f64::INFINITY, f64::min);
                tied = copy.iter().filter(|c| c.1 == best).map(|c| c.0).collect();
            }
        }
        if tied.len() > 1 {
            let fewest = tied
                .iter()
                .map(|&i| workers[i].cached_blocks)
                .min()
                .unwrap_or(0);
            tied.retain(|&i| workers[i].cached_blocks == fewest);
        }
        if tied.len() == 1 {
            return tied[0];
        }
        let Some(&seed) = request.block_hashes.last() else {
            return self.rng.choice(&tied);
        };
        let mut chosen = tied[0];
        let mut top = weight(&workers[chosen].name, seed);
        for &i in &tied[1..] {
            let w = weight(&workers[i].name, seed);
            if w > top {
                (chosen, top) = (i, w);
            }
        }
        chosen
    }

    /// Move the recent shares one decision on.
    fn record(&mut self, workers: &[&WorkerState], shares: Vec<f64>, chosen: usize) {
        let n = workers.len() as f64;
        self.decisions += 1;
        let prior = self.config.share_window / 6.0 * n;
        let rate = f64::max(
            1.0 / (self.config.share_window * n),
            1.0 / (self.decisions as f64 + prior),
        );
        let keep = 1.0 - rate;
        let aligned = self.share_names.len() == workers.len()
            && self
                .share_names
                .iter()
                .zip(workers)
                .all(|(a, w)| *a == w.name);
        if !aligned {
            self.share_names = workers.iter().map(|w| w.name.clone()).collect();
        }
        self.share_values = shares.into_iter().map(|s| s * keep).collect();
        self.share_values[chosen] += rate;
    }
}

impl Choose for KvAware {
    fn name(&self) -> &str {
        "kv-aware"
    }
    fn needs_overlap(&self) -> bool {
        true
    }
    fn needs_admission(&self) -> bool {
        self.config.admission_wait.is_some()
    }
    fn choose(&mut self, request: &RequestView<'_>, workers: &[&WorkerState]) -> usize {
        let shares = self.shares(workers);
        let chosen = self.decide(request, workers, &shares);
        self.record(workers, shares, chosen);
        chosen
    }
    fn observe(&mut self, workers: &[&WorkerState], chosen: usize) {
        let shares = self.shares(workers);
        self.record(workers, shares, chosen);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::view::{adapter_id, idle_fleet};

    #[test]
    fn a_replica_that_observes_anothers_decisions_keeps_its_shares() {
        let workers = idle_fleet(3);
        let refs: Vec<&WorkerState> = workers.iter().collect();
        let mut deciding = KvAware::new(KvAwareConfig::default(), PyRandom::from_seed(0)).unwrap();
        let mut observing = KvAware::new(KvAwareConfig::default(), PyRandom::from_seed(9)).unwrap();
        let hashes = [1u64, 2, 3];
        for i in 0..40 {
            let overlap = [usize::from(i % 3 == 0) * 3, 0, usize::from(i % 5 == 0)];
            let view = RequestView {
                block_hashes: &hashes,
                prompt_tokens: 64,
                overlap_blocks: Some(&overlap),
                admission_wait: None,
                adapter: None,
            };
            let chosen = deciding.choose(&view, &refs);
            Choose::observe(&mut observing, &refs, chosen);
        }
        assert_eq!(deciding.shares(&refs), observing.shares(&refs));
        assert_ne!(deciding.shares(&refs), vec![1.0 / 3.0; 3]);
    }

    #[test]
    fn a_replica_restored_from_anothers_shares_decides_as_it_does() {
        let mut workers = idle_fleet(3);
        let hashes = [1u64, 2, 3];
        let mut old = KvAware::new(KvAwareConfig::default(), PyRandom::from_seed(0)).unwrap();
        let choose = |p: &mut KvAware, workers: &[WorkerState], i: usize| {
            // Worker 0 holds the prefix most of the time, and every worker is busy: the share
            // guard decides when it must be copied.
            let overlap = [3, usize::from(i % 4 == 0) * 3, 0];
            let view = RequestView {
                block_hashes: &hashes,
                prompt_tokens: 64,
                overlap_blocks: Some(&overlap),
                admission_wait: None,
                adapter: None,
            };
            let refs: Vec<&WorkerState> = workers.iter().collect();
            p.choose(&view, &refs)
        };
        for w in &mut workers {
            w.in_flight = 1;
        }
        for i in 0..30 {
            choose(&mut old, &workers, i);
        }
        let shares: Vec<(String, f64)> = old.recent_shares().map(|(n, s)| (n.into(), s)).collect();
        let mut new = KvAware::new(KvAwareConfig::default(), PyRandom::from_seed(9)).unwrap();
        new.restore_shares(shares, Some(old.share_decisions()));
        let mut fresh = KvAware::new(KvAwareConfig::default(), PyRandom::from_seed(9)).unwrap();
        let (mut same, mut fresh_same) = (0, 0);
        for i in 30..90 {
            let a = choose(&mut old, &workers, i);
            same += usize::from(a == choose(&mut new, &workers, i));
            fresh_same += usize::from(a == choose(&mut fresh, &workers, i));
        }
        assert_eq!(same, 60, "restored, it decides as the original");
        assert!(fresh_same < 60, "from the fair share it does not");
    }

    #[test]
    fn kv_aware_costs_and_longest_prefix() {
        let config = KvAwareConfig {
            overlap_weight: 2.0,
            request_weight: 100.0,
            load_factor: None,
            ..KvAwareConfig::default()
        };
        let p = KvAware::new(config, PyRandom::from_seed(0)).unwrap();
        let mut b = WorkerState::new("b");
        b.in_flight = 2;
        b.in_flight_tokens = 70;
        let workers = [WorkerState::new("a"), b, WorkerState::new("c")];
        let refs: Vec<&WorkerState> = workers.iter().collect();
        let overlap = [0, 3, 3];
        let view = RequestView {
            block_hashes: &[1, 2, 3],
            prompt_tokens: 50,
            overlap_blocks: Some(&overlap),
            admission_wait: None,
            adapter: None,
        };
        assert_eq!(p.costs(&view, &refs), vec![100.0, 274.0, 4.0]);
        assert_eq!(view.tokens_to_prefill(1, 16), 2);
        let mut p = KvAware::new(KvAwareConfig::default(), PyRandom::from_seed(0)).unwrap();
        let w = idle_fleet(6);
        let refs: Vec<&WorkerState> = w.iter().collect();
        let overlap = [0, 3, 9, 0, 10, 0];
        let view = RequestView {
            block_hashes: &[5; 10],
            prompt_tokens: 165,
            overlap_blocks: Some(&overlap),
            admission_wait: None,
            adapter: None,
        };
        assert_eq!(p.choose(&view, &refs), 4);
    }

    #[test]
    fn kv_aware_charges_a_worker_without_the_requests_adapter() {
        let (a, b) = (adapter_id("sql"), adapter_id("chat"));
        let mut w = idle_fleet(2);
        // w0 runs a request of adapter `sql`, w1 is idle with `chat` in its only slot.
        w.iter_mut().for_each(|w| w.lora_slots = 1);
        w[0].in_flight = 1;
        w[0].in_flight_tokens = 10;
        w[0].use_adapter(a);
        w[1].use_adapter(b);
        let refs: Vec<&WorkerState> = w.iter().collect();
        let overlap = [0, 0];
        let view = |adapter| RequestView {
            block_hashes: &[5, 6],
            prompt_tokens: 40,
            overlap_blocks: Some(&overlap),
            admission_wait: None,
            adapter,
        };
        let p = KvAware::new(KvAwareConfig::default(), PyRandom::from_seed(0)).unwrap();
        assert_eq!(p.costs(&view(None), &refs), vec![258.0, 120.0]);
        assert_eq!(
            p.costs(&view(Some(a)), &refs),
            vec![258.0, 120.0 + ADAPTER_WEIGHT]
        );
        // Where the adapter sits wins over an idle worker that would have to load it ...
        let mut p = KvAware::new(KvAwareConfig::default(), PyRandom::from_seed(0)).unwrap();
        assert_eq!(p.choose(&view(Some(a)), &refs), 0);
        // ... but not without the term, nor for a base-model request.
        let off = KvAwareConfig {
            adapter_weight: 0.0,
            ..KvAwareConfig::default()
        };
        let mut p = KvAware::new(off, PyRandom::from_seed(0)).unwrap();
        assert_eq!(p.choose(&view(Some(a)), &refs), 1);
        let mut p = KvAware::new(KvAwareConfig::default(), PyRandom::from_seed(0)).unwrap();
        assert_eq!(p.choose(&view(None), &refs), 1);
        let bad = KvAwareConfig {
            adapter_weight: -1.0,
            ..KvAwareConfig::default()
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn kv_aware_sends_a_request_that_would_wait_long_for_blocks_where_it_waits_less() {
        let on = KvAwareConfig {
            admission_wait: Some(0.2),
            ..KvAwareConfig::default()
        };
        let mut p = KvAware::new(on, PyRandom::from_seed(0)).unwrap();
        assert!(p.needs_admission());
        let mut w = idle_fleet(3);
        w[1].in_flight = 2;
        let refs: Vec<&WorkerState> = w.iter().collect();
        // w1 holds the prompt; w2 holds part of it.
        let overlap = [0, 10, 4];
        let view = |waits| RequestView {
            block_hashes: &[5; 10],
            prompt_tokens: 165,
            overlap_blocks: Some(&overlap),
            admission_wait: waits,
            adapter: None,
        };
        assert_eq!(p.choose(&view(None), &refs), 1);
        // w1 could admit it only after a whole request's time: the best of the others.
        assert_eq!(p.choose(&view(Some(&[0.0, 0.9, 0.0])), &refs), 2);
        // Its oldest request is about to end (within the bound): w1 keeps it.
        assert_eq!(p.choose(&view(Some(&[0.0, 0.1, 0.0])), &refs), 1);
        // Nowhere waits less: the cheapest, as without the guard.
        assert_eq!(p.choose(&view(Some(&[0.9, 0.9, 0.9])), &refs), 1);
        assert_eq!(p.admission_diversions(), 1);
        // Where the others run as many requests, it stays.
        let mut busy = idle_fleet(3);
        busy.iter_mut().for_each(|w| w.in_flight = 2);
        let busy: Vec<&WorkerState> = busy.iter().collect();
        assert_eq!(p.choose(&view(Some(&[0.0, 0.9, 0.0])), &busy), 1);
        // Off (the default): the wait is not read.
        let mut p = KvAware::new(KvAwareConfig::default(), PyRandom::from_seed(0)).unwrap();
        assert!(!p.needs_admission());
        assert_eq!(p.choose(&view(Some(&[0.0, 0.9, 0.0])), &refs), 1);
    }

    #[test]
    fn options_are_checked() {
        let bad = KvAwareConfig {
            admission_wait: Some(f64::NAN),
            ..KvAwareConfig::default()
        };
        assert!(bad.validate().unwrap_err().0.contains("admission wait"));
        let bad = KvAwareConfig {
            share_window: 0.0,
            ..KvAwareConfig::default()
        };
        assert!(bad.validate().unwrap_err().0.contains("share window"));
        let bad = KvAwareConfig {
            load_factor: Some(-1.0),
            ..KvAwareConfig::default()
        };
        assert!(bad.validate().is_err());
    }
}
