//! Balancing policies: one pure interface shared by the simulator and the live router.
//!
//! A policy sees a [`RequestView`] (what the router knows about the request: its block hashes,
//! and for policies that [`Choose::needs_overlap`] each worker's cached overlap from the index)
//! and the [`WorkerState`] of every candidate worker (the router's own load accounting), and
//! returns the index of the worker to use. Policies hold no clock and do no I/O.
//!
//! * `random`: uniform per request (a Kubernetes Service with a new connection per request).
//! * `round-robin`: cycle through the workers.
//! * `least-loaded`: fewest requests in flight, ties at random.
//! * `prefix-hash`: rendezvous hashing of the prompt's key block over worker names (owners
//!   move only for the prefixes of workers that come or go), with an optional bounded-load
//!   spill to the next worker in the prefix's order.
//! * `kv-aware`: the worker that leaves the least work, under a bounded-load and a
//!   bounded-share guard; see [`KvAware`].
//!
//! Every random draw goes through [`PyRandom`] in the order the former Python policies drew,
//! and every float is computed in the same order of operations (Python 3.11's left-to-right
//! `sum`), so a seed names the same decisions it always did.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::pyrandom::PyRandom;

/// What a policy may know about a request.
#[derive(Clone, Copy, Debug)]
pub struct RequestView<'a> {
    /// Chained hashes of the prompt's full blocks.
    pub block_hashes: &'a [u64],
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Leading blocks of the prompt each worker holds, aligned with the workers; filled only
    /// for policies that need it (None or empty: unknown, counted as 0).
    pub overlap_blocks: Option<&'a [usize]>,
    /// How long the request would wait for KV blocks on each worker, aligned with the
    /// workers (`crate::admission`: 0 when it fits now, else a fraction of a typical
    /// request's duration); filled only for policies that [`Choose::needs_admission`] and
    /// a step that knows the workers' capacity.
    pub admission_wait: Option<&'a [f64]>,
    /// The LoRA adapter the request runs under ([`adapter_id`] of its name), when the step
    /// models the workers' LoRA slots (`WorkerState::adapters`); None for a request of a base
    /// model, or when the slots are not modelled.
    pub adapter: Option<u64>,
}

/// The id the router knows a LoRA adapter by: `xxh3_64` of its name (the request's `model`),
/// the same on every replica and in the simulator.
pub fn adapter_id(name: &str) -> u64 {
    xxh3_64_with_seed(name.as_bytes(), 0)
}

impl RequestView<'_> {
    /// Prompt tokens worker `worker` would still compute: those after its cached overlap,
    /// and at least one (vLLM recomputes the last token of a fully cached prompt).
    pub fn tokens_to_prefill(&self, worker: usize, block_size: usize) -> usize {
        let cached = match self.overlap_blocks {
            Some(o) if !o.is_empty() => o[worker] * block_size,
            _ => 0,
        };
        self.prompt_tokens.saturating_sub(cached).max(1)
    }
}

/// What a policy may know about a worker: its name and the router's own load accounting.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerState {
    /// The worker's stable name (the index's key, and the rendezvous hash's input).
    pub name: String,
    /// Requests sent and not finished.
    pub in_flight: i64,
    /// Prompt tokens of those requests still to prefill (added on sending, subtracted at
    /// the first token).
    pub in_flight_tokens: i64,
    /// Blocks the index attributes to the worker (0 when unknown).
    pub cached_blocks: i64,
    /// The router's model of the adapters in the worker's LoRA slots ([`adapter_id`]s, least
    /// recently routed first): the last `lora_slots` distinct adapters sent there, as vLLM
    /// keeps the adapters it last scheduled (empty when the slots are not modelled).
    pub adapters: Vec<u64>,
    /// The worker's LoRA slots (vLLM's `--max-loras`; 0: not modelled).
    pub lora_slots: usize,
}

impl WorkerState {
    /// An idle worker named `name`.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            ..Self::default()
        }
    }

    /// Whether the router's model has `adapter` in the worker's LoRA slots.
    pub fn has_adapter(&self, adapter: u64) -> bool {
        self.adapters.contains(&adapter)
    }

    /// Whether a request under `adapter` would take a slot another adapter holds: it is not
    /// in the slots, and they are full (vLLM then runs it only once that adapter's requests
    /// have left the batch, and loads it).
    pub fn displaces_adapter(&self, adapter: u64) -> bool {
        !self.has_adapter(adapter) && self.adapters.len() >= self.lora_slots
    }

    /// A request under `adapter` was sent to the worker: it becomes the most recent, the
    /// least recent leaves when the slots are full.
    pub fn use_adapter(&mut self, adapter: u64) {
        if let Some(i) = self.adapters.iter().position(|&a| a == adapter) {
            self.adapters.remove(i);
        } else if self.adapters.len() >= self.lora_slots.max(1) {
            self.adapters.remove(0);
        }
        self.adapters.push(adapter);
    }
}

/// A balancing policy.
pub trait Choose {
    /// The policy's name (`kvroute serve --policy`).
    fn name(&self) -> &str;
    /// Whether `choose` reads `RequestView::overlap_blocks` (the caller then fills it from
    /// the index and fills `WorkerState::cached_blocks`).
    fn needs_overlap(&self) -> bool;
    /// Whether `choose` reads `RequestView::admission_wait`.
    fn needs_admission(&self) -> bool {
        false
    }
    /// Index into `workers` (non-empty) of the worker to send `request` to.
    fn choose(&mut self, request: &RequestView<'_>, workers: &[&WorkerState]) -> usize;
    /// Another router replica sent a request to `workers[chosen]` (the replica mesh): a
    /// policy whose state follows its decisions (kv-aware's recent shares) counts it as its
    /// own, so that replicas seeing the same decisions keep the same state. None keeps state
    /// by default.
    fn observe(&mut self, _workers: &[&WorkerState], _chosen: usize) {}
}

/// A policy option out of range; the message is the one users see.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyError(pub String);

impl std::fmt::Display for PolicyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PolicyError {}

/// `xxh3_64(name, seed)`: the rendezvous weight of a worker for a key.
fn weight(name: &str, seed: u64) -> u64 {
    xxh3_64_with_seed(name.as_bytes(), seed)
}

/// Index of a worker with the fewest requests in flight among `among`; ties broken at random
/// so equal workers share new work.
pub fn least_loaded(workers: &[&WorkerState], rng: &mut PyRandom, among: &[usize]) -> usize {
    let low = among
        .iter()
        .map(|&i| workers[i].in_flight)
        .min()
        .expect("candidates");
    let tied: Vec<usize> = among
        .iter()
        .copied()
        .filter(|&i| workers[i].in_flight == low)
        .collect();
    rng.choice(&tied)
}

/// Options of [`PrefixHash`] (read by serde by their field names, absent ones as in
/// `Default`: `kvroute serve --policy-option` and the Python policies name them so).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefixHashConfig {
    /// How many leading blocks identify a prefix.
    pub key_blocks: usize,
    /// ε of bounded-load hashing; None never spills.
    pub load_factor: Option<f64>,
}

impl Default for PrefixHashConfig {
    fn default() -> Self {
        Self {
            key_blocks: 1,
            load_factor: None,
        }
    }
}

/// Rendezvous hashing of the prompt's key block, with an optional bounded-load spill.
#[derive(Clone, Debug)]
pub struct PrefixHash {
    /// The options.
    pub config: PrefixHashConfig,
    /// Orders the workers of a prompt without a full block.
    pub rng: PyRandom,
}

impl PrefixHash {
    /// Workers in this request's rendezvous order (owner first).
    pub fn ranking(&mut self, request: &RequestView<'_>, workers: &[&WorkerState]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..workers.len()).collect();
        let hashes = request.block_hashes;
        if hashes.is_empty() {
            let keys: Vec<f64> = (0..workers.len()).map(|_| self.rng.random()).collect();
            order.sort_by(|&a, &b| keys[a].total_cmp(&keys[b]));
            return order;
        }
        let key = hashes[self.config.key_blocks.min(hashes.len()).max(1) - 1];
        let weights: Vec<u64> = workers.iter().map(|w| weight(&w.name, key)).collect();
        // Stable and descending, as Python's sorted(reverse=True).
        order.sort_by(|&a, &b| weights[b].cmp(&weights[a]));
        order
    }
}

impl Choose for PrefixHash {
    fn name(&self) -> &str {
        "prefix-hash"
    }
    fn needs_overlap(&self) -> bool {
        false
    }
    fn choose(&mut self, request: &RequestView<'_>, workers: &[&WorkerState]) -> usize {
        let order = self.ranking(request, workers);
        let Some(lf) = self.config.load_factor else {
            return order[0];
        };
        // +1 counts the request being placed, so an idle fleet never spills.
        let total: i64 = workers.iter().map(|w| w.in_flight).sum();
        let mean = (total + 1) as f64 / workers.len() as f64;
        let limit = (1.0 + lf) * mean;
        order
            .iter()
            .copied()
            .find(|&i| ((workers[i].in_flight + 1) as f64) <= limit)
            .unwrap_or(order[0])
    }
}

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

/// Every native policy, by kind.
#[derive(Clone, Debug)]
pub enum Policy {
    /// Uniform per request.
    Random(PyRandom),
    /// Cycle through the workers; holds the next position.
    RoundRobin(usize),
    /// Fewest in flight, ties at random.
    LeastLoaded(PyRandom),
    /// Rendezvous hashing of the prompt's key block.
    PrefixHash(PrefixHash),
    /// Least work left, under the load and share guards.
    KvAware(Box<KvAware>),
}

/// The names of the native policies, in the order `kvroute serve --help` lists them.
pub const POLICY_NAMES: [&str; 5] = [
    "random",
    "round-robin",
    "least-loaded",
    "prefix-hash",
    "kv-aware",
];

impl Policy {
    /// The policy called `name` (one of [`POLICY_NAMES`]) with these options (each kind reads
    /// its own: kv-aware `kv_aware`, prefix-hash `prefix_hash`) and random draws from `rng`.
    pub fn from_name(
        name: &str,
        rng: PyRandom,
        kv_aware: KvAwareConfig,
        prefix_hash: PrefixHashConfig,
    ) -> Result<Self, PolicyError> {
        Ok(match name {
            "random" => Policy::Random(rng),
            "round-robin" => Policy::RoundRobin(0),
            "least-loaded" => Policy::LeastLoaded(rng),
            "prefix-hash" => {
                if prefix_hash.key_blocks < 1 {
                    return Err(PolicyError(format!(
                        "key blocks must be >= 1, got {}",
                        prefix_hash.key_blocks
                    )));
                }
                Policy::PrefixHash(PrefixHash {
                    config: prefix_hash,
                    rng,
                })
            }
            "kv-aware" => Policy::KvAware(Box::new(KvAware::new(kv_aware, rng)?)),
            other => return Err(PolicyError(format!("unknown policy {other:?}"))),
        })
    }
}

impl Choose for Policy {
    fn name(&self) -> &str {
        match self {
            Policy::Random(_) => "random",
            Policy::RoundRobin(_) => "round-robin",
            Policy::LeastLoaded(_) => "least-loaded",
            Policy::PrefixHash(p) => p.name(),
            Policy::KvAware(p) => p.name(),
        }
    }
    fn needs_overlap(&self) -> bool {
        matches!(self, Policy::KvAware(_))
    }
    fn needs_admission(&self) -> bool {
        match self {
            Policy::KvAware(p) => p.needs_admission(),
            _ => false,
        }
    }
    fn choose(&mut self, request: &RequestView<'_>, workers: &[&WorkerState]) -> usize {
        match self {
            Policy::Random(rng) => rng.randrange(workers.len()),
            Policy::RoundRobin(next) => {
                let i = *next % workers.len();
                *next = i + 1;
                i
            }
            Policy::LeastLoaded(rng) => {
                let all: Vec<usize> = (0..workers.len()).collect();
                least_loaded(workers, rng, &all)
            }
            Policy::PrefixHash(p) => p.choose(request, workers),
            Policy::KvAware(p) => p.choose(request, workers),
        }
    }
    fn observe(&mut self, workers: &[&WorkerState], chosen: usize) {
        if let Policy::KvAware(p) = self {
            p.observe(workers, chosen);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet(n: usize) -> Vec<WorkerState> {
        (0..n).map(|i| WorkerState::new(format!("w{i}"))).collect()
    }

    #[test]
    fn a_replica_that_observes_anothers_decisions_keeps_its_shares() {
        let workers = fleet(3);
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
        let mut workers = fleet(3);
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
        let w = fleet(6);
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
        let mut w = fleet(2);
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
    fn a_workers_lora_slots_keep_the_last_adapters_sent_there() {
        let mut w = WorkerState::new("w");
        w.lora_slots = 2;
        w.use_adapter(adapter_id("a"));
        // A free slot: `b` displaces nothing.
        assert!(!w.displaces_adapter(adapter_id("b")));
        for name in ["b", "a", "c"] {
            w.use_adapter(adapter_id(name));
        }
        // `b` was the least recently used of the two when `c` came.
        assert_eq!(w.adapters, vec![adapter_id("a"), adapter_id("c")]);
        assert!(w.displaces_adapter(adapter_id("b")));
        assert!(!w.displaces_adapter(adapter_id("a")));
    }

    #[test]
    fn kv_aware_sends_a_request_that_would_wait_long_for_blocks_where_it_waits_less() {
        let on = KvAwareConfig {
            admission_wait: Some(0.2),
            ..KvAwareConfig::default()
        };
        let mut p = KvAware::new(on, PyRandom::from_seed(0)).unwrap();
        assert!(p.needs_admission());
        let mut w = fleet(3);
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
        let mut busy = fleet(3);
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

    #[test]
    fn prefix_hash_spills_to_the_next_in_its_order() {
        let mut p = PrefixHash {
            config: PrefixHashConfig {
                key_blocks: 1,
                load_factor: Some(0.25),
            },
            rng: PyRandom::from_seed(0),
        };
        let mut w = fleet(4);
        let view = RequestView {
            block_hashes: &[42, 43],
            prompt_tokens: 32,
            overlap_blocks: None,
            admission_wait: None,
            adapter: None,
        };
        let owner = p.choose(&view, &w.iter().collect::<Vec<_>>());
        w[owner].in_flight = 6;
        let refs: Vec<&WorkerState> = w.iter().collect();
        let order = p.ranking(&view, &refs);
        assert_eq!(order[0], owner);
        assert_eq!(p.choose(&view, &refs), order[1]);
    }
}
