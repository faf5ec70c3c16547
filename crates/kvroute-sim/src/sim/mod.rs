//! The simulator's event loop: engine models on a virtual clock, fed by closed-loop clients
//! (or by a trace of arrival times), with a [`Placement`] deciding where each request goes.
//!
//! This is the loop `kvroute.sim` runs (through the bindings):
//!
//! * A trial ([`Simulation::run_trial`]; [`Trial::run`] on fresh workers) = the warmup (one
//!   request per prefix, sent one at a time through the same placement, not measured), then
//!   the measured requests in their order from `concurrency` closed-loop clients: each client
//!   sends its next request when its previous one completes.
//! * A request reaches its worker's engine `frontend_s` after it is sent; TTFT is from send to
//!   the end of the step that produced the first token, e2e to the end of the step that
//!   produced its last.
//! * A worker steps whenever it has work; a step's outputs and KV events take effect at its
//!   end: the events go to the placement first (only when it [`Placement::wants_events`]: the
//!   engines then emit them), then each output in batch order (`first_token`, then `finished`
//!   callbacks; a finished request's client sends its next request at once).
//! * Events with the same time run in the order they were scheduled (a `(time, sequence)`
//!   heap, exactly as `sim.py`'s `heapq` of `(t, seq, ...)`).
//!
//! In the open-loop mode ([`Simulation::run_open_loop`]) each request is sent at its own time
//! (trace replay) instead of when a client frees up; a send due at the same time as a queued
//! event goes first.
//!
//! Inputs are cheap to pass for a million requests: shared prefixes are token arrays held
//! once, each request is a prefix id, a slice of one concatenated suffix array and an output
//! length ([`RequestSet`]); the block hashes of each prefix are computed once and reused
//! (as `kvroute.blocks.PrefixHashCache` does).

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::sync::Arc;

use crate::engine::cost::CostModel;
use crate::engine::scheduler::{Engine, NewRequest, PrefixCacheStats, StepResult};
use kvroute_core::blocks::{BlockHasher, BlockKeys};
use kvroute_core::policies::adapter_id;
use kvroute_core::retention::Refresh;
use kvroute_core::routing::Decision;

pub mod placement;
pub mod replicas;

use placement::{Placed, Placement};

/// One simulated worker's configuration (every worker has the same).
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// KV blocks, the null block included.
    pub num_blocks: usize,
    /// The step-time model and scheduler limits.
    pub cost: CostModel,
    /// The block hasher (its block size is the workers').
    pub hasher: BlockHasher,
    /// Prefix caching on.
    pub enable_caching: bool,
}

/// Requests to send: request `i` is prefix `prefix_ids[i]` followed by
/// `suffix_tokens[suffix_offsets[i]..suffix_offsets[i + 1]]`, and generates
/// `output_tokens[i]` tokens.
#[derive(Clone, Debug, Default)]
pub struct RequestSet {
    /// Index into the simulation's prefixes, per request.
    pub prefix_ids: Vec<u32>,
    /// Every request's own tokens, concatenated.
    pub suffix_tokens: Vec<u32>,
    /// `len() + 1` offsets into `suffix_tokens`.
    pub suffix_offsets: Vec<usize>,
    /// Tokens each request generates (at least 1).
    pub output_tokens: Vec<u32>,
}

impl RequestSet {
    /// Number of requests.
    pub fn len(&self) -> usize {
        self.prefix_ids.len()
    }
    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.prefix_ids.is_empty()
    }
    fn suffix(&self, i: usize) -> &[u32] {
        &self.suffix_tokens[self.suffix_offsets[i]..self.suffix_offsets[i + 1]]
    }
}

/// The tenant a prefix's requests run under: the adapter and salt that key their block
/// hashes (vLLM's extra keys, see [`BlockKeys`]) and the adapter's id, which takes one of the
/// engine's LoRA slots (`crate::engine::scheduler::LoraSlots`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tenant {
    /// The adapter's name and the salt, hashed into the request's blocks.
    pub keys: BlockKeys,
    /// The adapter's id (vLLM's `lora_int_id`); None without an adapter.
    pub lora_id: Option<i64>,
}

/// One measured request, as `kvroute.records.RequestRecord` holds it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RequestRecord {
    /// Position in its request set.
    pub index: usize,
    /// Its prefix.
    pub prefix_id: u32,
    /// When it was sent, relative to the start of its run (seconds).
    pub send_time: f64,
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Prompt tokens found cached at its first admission.
    pub cached_tokens: usize,
    /// Send to first token.
    pub ttft_s: f64,
    /// Send to last token.
    pub e2e_s: f64,
    /// Tokens generated.
    pub output_tokens: usize,
    /// The worker it ran on.
    pub worker: usize,
}

/// A trial's outcome.
#[derive(Clone, Debug, PartialEq)]
pub struct TrialResult {
    /// The measured requests' records, in request order.
    pub records: Vec<RequestRecord>,
    /// From the start of the measured run to its last event.
    pub duration_s: f64,
    /// Per worker prefix-cache counters over the measured window (warmup excluded).
    pub window_stats: Vec<PrefixCacheStats>,
    /// Retention's refreshes over the measured window.
    pub refreshes: RefreshStats,
}

/// What retention's refreshes cost the engines (see `kvroute_core::retention`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RefreshStats {
    /// Refresh requests sent.
    pub requests: u64,
    /// Prompt tokens the engines computed for them (cached blocks are not computed).
    pub computed_tokens: u64,
    /// Engine seconds they added: per step, its time less its time without them.
    pub engine_s: f64,
}

impl RefreshStats {
    /// The difference `self − before`.
    pub fn since(&self, before: &Self) -> Self {
        Self {
            requests: self.requests - before.requests,
            computed_tokens: self.computed_tokens - before.computed_tokens,
            engine_s: self.engine_s - before.engine_s,
        }
    }
}

/// `Sent::pos` of a refresh (not one of the request set's).
const REFRESH: usize = usize::MAX;

/// Why a simulation could not run or finish.
#[derive(Clone, Debug, PartialEq)]
pub enum SimError {
    /// A request needs more blocks than an empty worker has: it would wait forever.
    DoesNotFit {
        /// The request's position in its set.
        index: usize,
        /// Blocks its prompt and output need.
        blocks: usize,
        /// Usable blocks of a worker.
        capacity: usize,
    },
    /// Malformed input (a bad prefix id, offsets, a zero output, unsorted send times).
    BadInput(String),
    /// The event loop ran out of events with requests unfinished.
    Unfinished(usize),
}

impl std::fmt::Display for SimError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::DoesNotFit {
                index,
                blocks,
                capacity,
            } => write!(
                f,
                "request {index} needs {blocks} KV blocks but a worker has only {capacity}: give workers more KV memory"
            ),
            Self::BadInput(what) => write!(f, "bad simulation input: {what}"),
            Self::Unfinished(n) => write!(f, "simulation ended with {n} requests unfinished"),
        }
    }
}

impl std::error::Error for SimError {}

/// What a heap entry does when its time comes.
enum Event {
    /// A request reaches its worker's engine: `arrivals[slot]` holds it.
    Arrive { slot: usize },
    /// Worker `worker`'s step in flight ends.
    StepEnd { worker: usize },
}

struct Entry {
    t: f64,
    seq: u64,
    event: Event,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Entry {
    /// Reversed, so that `BinaryHeap` pops the earliest `(t, seq)` first.
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .t
            .total_cmp(&self.t)
            .then_with(|| other.seq.cmp(&self.seq))
    }
}

/// A request on its way: where it went and when it was sent.
#[derive(Clone, Copy)]
struct Sent {
    pos: usize,
    send_time: f64,
    placed: Placed,
}

/// Workers, a placement and a virtual clock; runs request sets one after the other on the
/// same workers (warmup, then measured), as `kvroute.sim.Simulation` does.
pub struct Simulation<'p> {
    config: WorkerConfig,
    engines: Vec<Engine>,
    placement: &'p mut dyn Placement,
    wants_events: bool,
    /// The engines emit their events as hash events (see `Placement::wants_hash_events`).
    hash_events: bool,
    prefixes: Vec<Arc<[u32]>>,
    /// Per prefix id, the tenant its requests run under (none listed: plain).
    tenants: Vec<Tenant>,
    prefix_hashes: Vec<Option<Vec<u64>>>,
    output: Arc<[u32]>,
    now: f64,
    heap: BinaryHeap<Entry>,
    seq: u64,
    busy: Vec<bool>,
    /// Requests on their way to an engine (kept out of the heap so its entries stay small),
    /// and the free slots among them.
    arrivals: Vec<Option<(Sent, NewRequest)>>,
    free_arrivals: Vec<usize>,
    /// Per worker, its step in flight (reused from step to step; None only while taken out).
    /// Boxed, so that taking it out for a step moves a pointer, not the ~250-byte result
    /// (twice a step, every step).
    in_step: Vec<Option<Box<StepResult>>>,
    /// Per worker, the send records of its step in flight's outputs (aligned with them).
    step_sents: Vec<Vec<Sent>>,
    /// Per worker, per engine request key: the request's send record.
    sent: Vec<Vec<Option<Sent>>>,
    /// Refreshes the placement asked for (reused buffer), those not finished, and their cost.
    refresh_buf: Vec<Refresh>,
    refreshes_open: usize,
    refresh_stats: RefreshStats,
}

impl<'p> Simulation<'p> {
    /// `workers` fresh workers of `config`, requests placed by `placement`, prompts built on
    /// `prefixes` (by prefix id); every request generates the first tokens of `output`.
    pub fn new(
        workers: usize,
        config: WorkerConfig,
        placement: &'p mut dyn Placement,
        prefixes: Vec<Arc<[u32]>>,
        output: Arc<[u32]>,
    ) -> Self {
        let wants_events = placement.wants_events();
        let engines = (0..workers)
            .map(|_| {
                Engine::new(
                    config.num_blocks,
                    config.cost.clone(),
                    config.hasher,
                    config.enable_caching,
                    wants_events,
                )
            })
            .collect();
        Self::with_engines(engines, 0.0, config, placement, prefixes, output)
    }

    /// A simulation over existing `engines` whose clock reads `now`: how a driver that keeps
    /// its engines between runs (the Python `kvroute.sim.Simulation`) continues. The engines
    /// must be idle, and emit KV events exactly when `placement` wants them.
    pub fn with_engines(
        engines: Vec<Engine>,
        now: f64,
        config: WorkerConfig,
        placement: &'p mut dyn Placement,
        prefixes: Vec<Arc<[u32]>>,
        output: Arc<[u32]>,
    ) -> Self {
        let workers = engines.len();
        let wants_events = placement.wants_events();
        let hash_events = wants_events && placement.wants_hash_events();
        let mut engines = engines;
        for e in &mut engines {
            e.set_hash_events(hash_events);
        }
        let n = prefixes.len();
        Self {
            config,
            engines,
            placement,
            wants_events,
            hash_events,
            prefixes,
            tenants: Vec::new(),
            prefix_hashes: vec![None; n],
            output,
            now,
            heap: BinaryHeap::new(),
            seq: 0,
            busy: vec![false; workers],
            arrivals: Vec::new(),
            free_arrivals: Vec::new(),
            in_step: (0..workers).map(|_| Some(Box::default())).collect(),
            step_sents: vec![Vec::new(); workers],
            sent: vec![Vec::new(); workers],
            refresh_buf: Vec::new(),
            refreshes_open: 0,
            refresh_stats: RefreshStats::default(),
        }
    }

    /// Run each prefix's requests under its tenant (by prefix id; a prefix past the end of
    /// `tenants` runs plain): their blocks hash under its keys for the placement and the
    /// engine alike, as the live router and vLLM hash them, and its adapter takes a LoRA slot.
    pub fn set_tenants(&mut self, tenants: Vec<Tenant>) {
        self.tenants = tenants;
        self.prefix_hashes.iter_mut().for_each(|h| *h = None);
    }

    /// The engines back, and the clock, once the runs are over.
    pub fn into_engines(mut self) -> (Vec<Engine>, f64) {
        for e in &mut self.engines {
            e.set_hash_events(false);
        }
        (self.engines, self.now)
    }

    /// The virtual clock (seconds since the simulation started).
    pub fn now(&self) -> f64 {
        self.now
    }

    /// The workers' engines.
    pub fn engines(&self) -> &[Engine] {
        &self.engines
    }

    /// Retention's refreshes so far and what they cost.
    pub fn refresh_stats(&self) -> RefreshStats {
        self.refresh_stats
    }

    /// Each worker's prefix-cache counters so far.
    pub fn stats(&self) -> Vec<PrefixCacheStats> {
        self.engines.iter().map(Engine::stats).collect()
    }

    /// One trial on these engines, the one driver of `kvroute.sim.run_trial` (through the
    /// bindings) and [`Trial::run`]: `warmup` sent one at a time (unmeasured), the placement
    /// settled ([`Placement::settle`]), then `measured` from `concurrency` closed-loop clients;
    /// the measured requests' records, the window's duration, and the workers' counters and
    /// the refreshes over it (the deltas from the warmup's end).
    pub fn run_trial(
        &mut self,
        warmup: &RequestSet,
        measured: &RequestSet,
        concurrency: usize,
    ) -> Result<TrialResult, SimError> {
        if !warmup.is_empty() {
            self.run_closed_loop(warmup, 1)?;
            self.placement.settle();
        }
        let before = self.stats();
        let refreshes_before = self.refresh_stats();
        let t0 = self.now();
        let records = self.run_closed_loop(measured, concurrency)?;
        let window_stats = self
            .stats()
            .iter()
            .zip(&before)
            .map(|(a, b)| a.since(b))
            .collect();
        Ok(TrialResult {
            records,
            duration_s: self.now() - t0,
            window_stats,
            refreshes: self.refresh_stats().since(&refreshes_before),
        })
    }

    /// Send `requests` from `concurrency` closed-loop clients; returns their records in
    /// request order once all have finished.
    pub fn run_closed_loop(
        &mut self,
        requests: &RequestSet,
        concurrency: usize,
    ) -> Result<Vec<RequestRecord>, SimError> {
        self.check(requests)?;
        self.run(requests, Clients::Closed(concurrency.max(1)))
    }

    /// Send request `i` of `requests` at `send_times[i]` (seconds on this simulation's clock,
    /// non-decreasing, none before `now()`), whatever is in flight; returns their records.
    pub fn run_open_loop(
        &mut self,
        requests: &RequestSet,
        send_times: &[f64],
    ) -> Result<Vec<RequestRecord>, SimError> {
        self.check(requests)?;
        if send_times.len() != requests.len() {
            return Err(SimError::BadInput("one send time per request".into()));
        }
        if send_times.first().is_some_and(|&t| t < self.now)
            || send_times.iter().any(|t| t.is_nan())
            || send_times.windows(2).any(|w| w[1] < w[0])
        {
            return Err(SimError::BadInput(
                "send times must be non-decreasing and not before now".into(),
            ));
        }
        self.run(requests, Clients::Open(send_times))
    }

    fn check(&self, requests: &RequestSet) -> Result<(), SimError> {
        let n = requests.len();
        if requests.suffix_offsets.len() != n + 1
            || requests.output_tokens.len() != n
            || requests.suffix_offsets.windows(2).any(|w| w[0] > w[1])
            || requests
                .suffix_offsets
                .last()
                .is_some_and(|&e| e > requests.suffix_tokens.len())
        {
            return Err(SimError::BadInput(
                "offsets or output lengths do not match the requests".into(),
            ));
        }
        let bs = self.config.hasher.block_size();
        let capacity = self.config.num_blocks - 1;
        for i in 0..n {
            let pid = requests.prefix_ids[i] as usize;
            let Some(prefix) = self.prefixes.get(pid) else {
                return Err(SimError::BadInput(format!(
                    "request {i} has unknown prefix {pid}"
                )));
            };
            let out = requests.output_tokens[i] as usize;
            if out == 0 || out > self.output.len() {
                return Err(SimError::BadInput(format!(
                    "request {i} generates {out} tokens; 1 to {} possible",
                    self.output.len()
                )));
            }
            let prompt = prefix.len() + requests.suffix(i).len();
            if prompt == 0 {
                return Err(SimError::BadInput(format!(
                    "request {i} has an empty prompt"
                )));
            }
            let blocks = (prompt + out).div_ceil(bs);
            if blocks > capacity {
                return Err(SimError::DoesNotFit {
                    index: i,
                    blocks,
                    capacity,
                });
            }
        }
        Ok(())
    }

    fn push(&mut self, t: f64, event: Event) {
        self.seq += 1;
        self.heap.push(Entry {
            t,
            seq: self.seq,
            event,
        });
    }

    /// Place request `pos` now and schedule its arrival at its worker.
    fn send(&mut self, requests: &RequestSet, pos: usize) {
        let pid = requests.prefix_ids[pos] as usize;
        // The engine holds the prefix by reference (a count, not a copy).
        let prefix = Arc::clone(&self.prefixes[pid]);
        let suffix = requests.suffix(pos);
        let hasher = self.config.hasher;
        let tenant = self.tenants.get(pid);
        let keys = tenant.map_or(&BlockKeys::PLAIN, |t| &t.keys);
        let shared = self.prefix_hashes[pid].get_or_insert_with(|| {
            let full = Some(prefix.len() / hasher.block_size());
            hasher.hash_blocks_keyed(&prefix, None, 0, full, keys)
        });
        let bs = hasher.block_size();
        let prompt_len = prefix.len() + suffix.len();
        let out = requests.output_tokens[pos] as usize;
        // Room for every block the request will fill, generated tokens included: the engine
        // extends this vector as blocks fill, and growing it would copy it twice.
        let mut hashes = Vec::with_capacity((prompt_len + out).div_ceil(bs));
        hashes.extend_from_slice(shared);
        // The prompt's blocks after the prefix's full ones: the prefix's partial tail, then
        // the suffix (the prefix itself is shared with the engine, never copied).
        let (first, parent) = (shared.len(), hashes.last().copied());
        let tail = &prefix[first * bs..];
        if tail.is_empty() {
            hasher.extend_chain_keyed(suffix, parent, first, keys, &mut hashes);
        } else if tail.len() + suffix.len() >= bs {
            let mut window = Vec::with_capacity(tail.len() + suffix.len());
            window.extend_from_slice(tail);
            window.extend_from_slice(suffix);
            hasher.extend_chain_keyed(&window, parent, first, keys, &mut hashes);
        }
        let (keys, lora_id) =
            tenant.map_or((BlockKeys::PLAIN, None), |t| (t.keys.clone(), t.lora_id));
        let adapter = keys.lora_name.as_deref().map(adapter_id);
        let placed = self
            .placement
            .place_request(&hashes, &prefix, suffix, out, adapter, self.now);
        // Refreshes the placement sends ahead of this request reach the engine first.
        self.send_refreshes();
        let arrival = self.now + self.config.cost.frontend_s;
        let request = NewRequest {
            prompt_head: prefix,
            prompt: suffix.to_vec(),
            output: self.output.clone(),
            max_tokens: out,
            arrival_time: arrival,
            block_hashes: hashes,
            keys,
            lora_id,
        };
        let sent = Sent {
            pos,
            send_time: self.now,
            placed,
        };
        let slot = match self.free_arrivals.pop() {
            Some(slot) => {
                self.arrivals[slot] = Some((sent, request));
                slot
            }
            None => {
                self.arrivals.push(Some((sent, request)));
                self.arrivals.len() - 1
            }
        };
        self.push(arrival, Event::Arrive { slot });
    }

    /// Send the refreshes the placement asks for now: each reaches its worker's engine
    /// `frontend_s` later, as a request of its prompt with `max_tokens` 1.
    fn send_refreshes(&mut self) {
        let mut buf = std::mem::take(&mut self.refresh_buf);
        self.placement.refreshes(self.now, &mut buf);
        for r in buf.drain(..) {
            let mut hashes = Vec::with_capacity(r.block_hashes.len() + 1);
            hashes.extend_from_slice(&r.block_hashes);
            let request = NewRequest {
                prompt_head: Arc::default(),
                prompt: r.prompt.to_vec(),
                output: self.output.clone(),
                max_tokens: 1,
                arrival_time: self.now + self.config.cost.frontend_s,
                block_hashes: hashes,
                keys: BlockKeys::default(),
                lora_id: None,
            };
            let sent = Sent {
                pos: REFRESH,
                send_time: self.now,
                placed: Placed::new(Decision {
                    worker: r.worker,
                    overlap: 0,
                    prefill_tokens: 1,
                    ticket: None,
                }),
            };
            self.arrivals.push(Some((sent, request)));
            let slot = self.arrivals.len() - 1;
            self.refreshes_open += 1;
            self.refresh_stats.requests += 1;
            self.push(
                self.now + self.config.cost.frontend_s,
                Event::Arrive { slot },
            );
        }
        self.refresh_buf = buf;
    }

    /// Run worker `w`'s next step from now.
    fn start_step(&mut self, w: usize) {
        self.busy[w] = true;
        let mut result = self.in_step[w].take().unwrap_or_default();
        self.engines[w].step_into(self.now, &mut result);
        let end = result.end;
        if self.refreshes_open > 0 {
            // What the step's refreshes added: its time less its time without them.
            let (mut tokens, mut seqs) = (0usize, 0usize);
            for &(key, n) in &result.scheduled {
                if self.sent[w][key].is_some_and(|s| s.pos == REFRESH) {
                    tokens += n;
                    seqs += 1;
                }
            }
            if seqs > 0 {
                let cost = &self.config.cost;
                let with = cost.step_time(result.prefill_tokens, result.decode_seqs);
                let without = cost.step_time(
                    result.prefill_tokens - tokens.min(result.prefill_tokens),
                    result.decode_seqs,
                );
                self.refresh_stats.computed_tokens += tokens as u64;
                self.refresh_stats.engine_s += with - without;
            }
        }
        // The engine releases a finished request's key at once, and an arrival before this
        // step ends may reuse it: take the send records of this step's outputs now.
        let mut sents = std::mem::take(&mut self.step_sents[w]);
        sents.clear();
        for out in &result.outputs {
            let slot = &mut self.sent[w][out.key];
            sents.push(if out.finished { slot.take() } else { *slot }.expect("a sent request"));
        }
        self.step_sents[w] = sents;
        self.in_step[w] = Some(result);
        self.push(end, Event::StepEnd { worker: w });
    }

    fn run(
        &mut self,
        requests: &RequestSet,
        clients: Clients<'_>,
    ) -> Result<Vec<RequestRecord>, SimError> {
        let n = requests.len();
        let start = self.now;
        let mut records: Vec<Option<RequestRecord>> = vec![None; n];
        let mut next = 0; // the next request to send
        if let Clients::Closed(c) = clients {
            while next < n.min(c) {
                self.send(requests, next);
                next += 1;
            }
            self.send_refreshes();
        }
        loop {
            if let Clients::Open(times) = clients
                && next < n
                && self.heap.peek().is_none_or(|e| times[next] <= e.t)
            {
                self.now = times[next];
                self.send(requests, next);
                next += 1;
                self.send_refreshes();
                continue;
            }
            let Some(Entry { t, event, .. }) = self.heap.pop() else {
                break;
            };
            self.now = t;
            match event {
                Event::Arrive { slot } => {
                    let (sent, request) = self.arrivals[slot].take().expect("an arrival");
                    self.free_arrivals.push(slot);
                    let w = sent.placed.worker();
                    let key = self.engines[w]
                        .add_request(request)
                        .map_err(|e| SimError::BadInput(e.to_string()))?;
                    let table = &mut self.sent[w];
                    if table.len() <= key {
                        table.resize(key + 1, None);
                    }
                    table[key] = Some(sent);
                    // An idle engine steps at once, whatever arrived: a refresh sent ahead of a
                    // request (same time, earlier in the heap) starts a step of its own, which
                    // the request waits behind, as vLLM's engine loop would.
                    if !self.busy[w] {
                        self.start_step(w);
                    }
                }
                Event::StepEnd { worker: w } => {
                    self.busy[w] = false;
                    let mut result = self.in_step[w].take().expect("a step in flight");
                    if self.hash_events {
                        if !result.hash_events.is_empty() {
                            self.placement
                                .apply_hash_events(w, &result.hash_events, self.now);
                        }
                    } else if self.wants_events
                        && let Some(batch) = result.events.take()
                    {
                        self.placement.apply_events(w, &batch.events, self.now);
                    }
                    let sents = std::mem::take(&mut self.step_sents[w]);
                    for (out, &sent) in result.outputs.iter().zip(&sents) {
                        if sent.pos == REFRESH {
                            // Not the placement's: it never routed it, and no client waits.
                            if out.finished {
                                self.refreshes_open -= 1;
                            }
                            continue;
                        }
                        if out.first_token {
                            // Prefill done: what the live router learns from the first byte.
                            self.placement.first_token(sent.placed);
                        }
                        if !out.finished {
                            continue;
                        }
                        self.placement.finished(sent.placed, self.now);
                        let s = &out.summary;
                        let pos = sent.pos;
                        records[pos] = Some(RequestRecord {
                            index: pos,
                            prefix_id: requests.prefix_ids[pos],
                            send_time: sent.send_time - start,
                            prompt_tokens: self.prefixes[requests.prefix_ids[pos] as usize].len()
                                + requests.suffix(pos).len(),
                            cached_tokens: s.num_cached_tokens.max(0) as usize,
                            ttft_s: s.first_token_time.expect("finished") - sent.send_time,
                            e2e_s: s.finish_time.expect("finished") - sent.send_time,
                            output_tokens: s.num_output,
                            worker: w,
                        });
                        if matches!(clients, Clients::Closed(_)) && next < n {
                            self.send(requests, next);
                            next += 1;
                        }
                    }
                    self.step_sents[w] = sents;
                    self.in_step[w] = Some(result);
                    if self.engines[w].has_work() {
                        self.start_step(w);
                    }
                    self.send_refreshes();
                }
            }
        }
        let missing = records.iter().filter(|r| r.is_none()).count();
        if missing > 0 {
            return Err(SimError::Unfinished(missing));
        }
        Ok(records.into_iter().map(|r| r.expect("checked")).collect())
    }
}

/// Who sends the requests.
#[derive(Clone, Copy)]
enum Clients<'a> {
    /// This many closed-loop clients.
    Closed(usize),
    /// Each request at its own time.
    Open(&'a [f64]),
}

/// One trial's inputs: fresh workers, the warmup sent one at a time, then the measured
/// requests from `concurrency` closed-loop clients (the Rust tests' and examples' way to run
/// [`Simulation::run_trial`] on fresh workers).
#[derive(Clone, Debug)]
pub struct Trial {
    /// Number of workers.
    pub workers: usize,
    /// Every worker's configuration.
    pub config: WorkerConfig,
    /// Shared prefixes' tokens, by prefix id.
    pub prefixes: Vec<Arc<[u32]>>,
    /// The tokens every request generates (request `i` the first `output_tokens[i]`).
    pub output: Arc<[u32]>,
    /// Sent one at a time before the measured window (one per prefix in the reference).
    pub warmup: RequestSet,
    /// The measured requests, in sending order.
    pub measured: RequestSet,
    /// Closed-loop clients of the measured window.
    pub concurrency: usize,
}

impl Trial {
    /// Run the trial ([`Simulation::run_trial`]) on fresh workers with `placement` (fresh,
    /// or reset by the caller).
    pub fn run(&self, placement: &mut dyn Placement) -> Result<TrialResult, SimError> {
        let mut sim = Simulation::new(
            self.workers,
            self.config.clone(),
            placement,
            self.prefixes.clone(),
            self.output.clone(),
        );
        sim.run_trial(&self.warmup, &self.measured, self.concurrency)
    }
}

#[cfg(test)]
mod tests {
    //! Against `tests/data/golden/sim_round_robin.txt`: recorded round-robin runs (see
    //! `tests/data/golden/sim_round_robin.py` for the format and the token formula rebuilt
    //! here).
    use super::*;
    use kvroute_core::blocks::DEFAULT_HASH_SEED;
    use kvroute_core::kvevents::events::KvCacheEvent;

    /// The recorded runs, read from the repository at test time.
    fn golden() -> String {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/data/golden/sim_round_robin.txt"
        );
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }
    const SUFFIX_BASE: u64 = 1 << 40;

    fn splitmix64(x: u64) -> u64 {
        let mut x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^ (x >> 31)
    }

    fn tokens(stream: u64, n: usize) -> Vec<u32> {
        (0..n as u64)
            .map(|i| {
                1000 + (splitmix64(stream.wrapping_mul(1_000_003).wrapping_add(i)) % 29000) as u32
            })
            .collect()
    }

    /// The round-robin policy: cycle through workers, charging the whole prompt.
    struct RoundRobin {
        workers: usize,
        next: usize,
        in_flight: Vec<i64>,
        events_seen: usize,
        wants_events: bool,
    }

    impl Placement for RoundRobin {
        fn wants_events(&self) -> bool {
            self.wants_events
        }
        fn place(&mut self, _hashes: &[u64], prompt_tokens: usize, _now: f64) -> Placed {
            let worker = self.next % self.workers;
            self.next = worker + 1;
            self.in_flight[worker] += 1;
            Placed::new(Decision {
                worker,
                overlap: 0,
                prefill_tokens: prompt_tokens.max(1),
                ticket: None,
            })
        }
        fn first_token(&mut self, _placed: Placed) {}
        fn finished(&mut self, placed: Placed, _now: f64) {
            self.in_flight[placed.worker()] -= 1;
        }
        fn apply_events(&mut self, _worker: usize, events: &[KvCacheEvent], _now: f64) {
            self.events_seen += events.len();
        }
    }

    struct Golden {
        name: String,
        workers: usize,
        concurrency: usize,
        config: WorkerConfig,
        prefixes: Vec<Arc<[u32]>>,
        warmup: RequestSet,
        measured: RequestSet,
        max_output: usize,
        duration: f64,
        window: Vec<PrefixCacheStats>,
        records: Vec<RequestRecord>,
    }

    fn request_set(line: &str, first: u64) -> RequestSet {
        let mut set = RequestSet {
            suffix_offsets: vec![0],
            ..RequestSet::default()
        };
        for (j, item) in line.split_whitespace().enumerate() {
            let v: Vec<usize> = item.split(':').map(|x| x.parse().unwrap()).collect();
            set.prefix_ids.push(v[0] as u32);
            set.suffix_tokens
                .extend(tokens(SUFFIX_BASE + first + j as u64, v[1]));
            set.suffix_offsets.push(set.suffix_tokens.len());
            set.output_tokens.push(v[2] as u32);
        }
        set
    }

    fn parse() -> Vec<Golden> {
        let mut out = Vec::new();
        let golden = golden();
        let mut lines = golden.lines();
        while let Some(line) = lines.next() {
            let name = line.strip_prefix("run ").expect("a run").to_string();
            let c: Vec<&str> = lines.next().unwrap().split_whitespace().skip(1).collect();
            let f = |i: usize| c[i].parse::<f64>().unwrap();
            let u = |i: usize| c[i].parse::<usize>().unwrap();
            let mut cost = CostModel::new("golden", f(4), f(5), f(6), f(7));
            cost.max_num_batched_tokens = u(8);
            cost.max_num_seqs = u(9);
            let config = WorkerConfig {
                num_blocks: u(2),
                cost,
                hasher: BlockHasher::new(u(3), DEFAULT_HASH_SEED).unwrap(),
                enable_caching: true,
            };
            let prefixes: Vec<Arc<[u32]>> = lines
                .next()
                .unwrap()
                .split_whitespace()
                .skip(1)
                .enumerate()
                .map(|(p, n)| tokens(p as u64, n.parse().unwrap()).into())
                .collect();
            let warmup = request_set(lines.next().unwrap().strip_prefix("warmup").unwrap(), 0);
            let measured = request_set(
                lines.next().unwrap().strip_prefix("requests").unwrap(),
                warmup.len() as u64,
            );
            let max_output = warmup
                .output_tokens
                .iter()
                .chain(&measured.output_tokens)
                .copied()
                .max()
                .unwrap() as usize;
            let mut g = Golden {
                name,
                workers: u(0),
                concurrency: u(1),
                config,
                prefixes,
                warmup,
                measured,
                max_output,
                duration: 0.0,
                window: vec![],
                records: vec![],
            };
            for line in lines.by_ref() {
                let v: Vec<&str> = line.split_whitespace().collect();
                match v[0] {
                    "duration" => g.duration = v[1].parse().unwrap(),
                    "window" => {
                        let n: Vec<u64> = v[1..].iter().map(|x| x.parse().unwrap()).collect();
                        g.window.push(PrefixCacheStats {
                            requests: n[0],
                            queries: n[1],
                            hits: n[2],
                            preempted_requests: n[3],
                            preempted_queries: n[4],
                            preempted_hits: n[5],
                        });
                    }
                    "rec" => g.records.push(RequestRecord {
                        index: v[1].parse().unwrap(),
                        prefix_id: v[2].parse().unwrap(),
                        send_time: v[3].parse().unwrap(),
                        prompt_tokens: v[4].parse().unwrap(),
                        cached_tokens: v[5].parse().unwrap(),
                        ttft_s: v[6].parse().unwrap(),
                        e2e_s: v[7].parse().unwrap(),
                        output_tokens: v[8].parse().unwrap(),
                        worker: v[9].parse().unwrap(),
                    }),
                    "end" => break,
                    other => panic!("unexpected line {other}"),
                }
            }
            out.push(g);
        }
        out
    }

    fn run(g: &Golden, wants_events: bool) -> (TrialResult, usize) {
        let mut rr = RoundRobin {
            workers: g.workers,
            next: 0,
            in_flight: vec![0; g.workers],
            events_seen: 0,
            wants_events,
        };
        let output: Arc<[u32]> = (1000..1000 + g.max_output as u32).collect();
        let trial = Trial {
            workers: g.workers,
            config: g.config.clone(),
            prefixes: g.prefixes.clone(),
            output,
            warmup: g.warmup.clone(),
            measured: g.measured.clone(),
            concurrency: g.concurrency,
        };
        let result = trial.run(&mut rr).unwrap();
        assert!(
            rr.in_flight.iter().all(|&n| n == 0),
            "{}: load accounting returns to zero",
            g.name
        );
        (result, rr.events_seen)
    }

    #[test]
    fn round_robin_trials_equal_the_python_simulator() {
        let runs = parse();
        assert_eq!(runs.len(), 11);
        for g in &runs {
            let (result, _) = run(g, false);
            assert_eq!(result.records.len(), g.records.len(), "{}", g.name);
            for (got, want) in result.records.iter().zip(&g.records) {
                assert_eq!(got, want, "{}", g.name);
            }
            assert_eq!(result.window_stats, g.window, "{}", g.name);
            assert_eq!(result.duration_s, g.duration, "{}", g.name);
        }
    }

    #[test]
    fn emitting_events_changes_nothing_but_feeds_the_placement() {
        let runs = parse();
        let g = runs.iter().find(|g| g.name == "small_kv_mixed").unwrap();
        let (quiet, none) = run(g, false);
        let (loud, seen) = run(g, true);
        assert_eq!(quiet, loud);
        assert_eq!(none, 0);
        assert!(seen > 0);
    }

    #[test]
    fn open_loop_sends_at_the_given_times() {
        let runs = parse();
        let g = runs.iter().find(|g| g.name == "chunked_seqcap").unwrap();
        let mut rr = RoundRobin {
            workers: 2,
            next: 0,
            in_flight: vec![0; 2],
            events_seen: 0,
            wants_events: false,
        };
        let output: Arc<[u32]> = (1000..1000 + g.max_output as u32).collect();
        let mut sim = Simulation::new(2, g.config.clone(), &mut rr, g.prefixes.clone(), output);
        let times: Vec<f64> = (0..g.measured.len()).map(|i| 0.05 * i as f64).collect();
        let records = sim.run_open_loop(&g.measured, &times).unwrap();
        for (r, t) in records.iter().zip(&times) {
            assert_eq!(r.send_time, *t);
            assert!(r.ttft_s >= g.config.cost.frontend_s && r.e2e_s >= r.ttft_s);
        }
        // Sparse arrivals meet idle workers: each request's TTFT is its own prefill alone.
        let widely: Vec<f64> = (0..g.measured.len())
            .map(|i| 1000.0 + 10.0 * i as f64)
            .collect();
        let records = sim.run_open_loop(&g.measured, &widely).unwrap();
        let cost = &g.config.cost;
        for r in &records {
            let uncached = r.prompt_tokens - r.cached_tokens;
            if uncached <= cost.max_num_batched_tokens {
                assert_eq!(
                    r.ttft_s,
                    (1000.0
                        + 10.0 * r.index as f64
                        + cost.frontend_s
                        + cost.step_time(uncached, 0))
                        - (1000.0 + 10.0 * r.index as f64)
                );
            }
        }
        assert!(
            sim.run_open_loop(&g.measured, &times).is_err(),
            "times before now are refused"
        );
    }

    #[test]
    fn a_request_that_cannot_fit_is_refused() {
        let runs = parse();
        let g = &runs[0];
        let mut config = g.config.clone();
        config.num_blocks = 10;
        let mut rr = RoundRobin {
            workers: 1,
            next: 0,
            in_flight: vec![0],
            events_seen: 0,
            wants_events: false,
        };
        let mut sim = Simulation::new(1, config, &mut rr, g.prefixes.clone(), (0..64).collect());
        assert!(matches!(
            sim.run_closed_loop(&g.measured, 1),
            Err(SimError::DoesNotFit { .. })
        ));
    }

    #[test]
    fn a_prefix_under_another_tenant_is_another_block_chain() {
        let g = &parse()[0];
        let prefix: Arc<[u32]> = tokens(7, 64).into();
        // Prefixes 0, 1, 2: the same tokens under salt "a", salt "b", adapter "x" with "a".
        let tenants = vec![
            Tenant {
                keys: BlockKeys::new(None, Some("a")),
                lora_id: None,
            },
            Tenant {
                keys: BlockKeys::new(None, Some("b")),
                lora_id: None,
            },
            Tenant {
                keys: BlockKeys::new(Some("x"), Some("a")),
                lora_id: Some(1),
            },
        ];
        let cached = |order: &[u32]| {
            let mut rr = RoundRobin {
                workers: 1,
                next: 0,
                in_flight: vec![0],
                events_seen: 0,
                wants_events: false,
            };
            let output: Arc<[u32]> = (1000..1004).collect();
            let prefixes = vec![Arc::clone(&prefix); 3];
            let mut sim = Simulation::new(1, g.config.clone(), &mut rr, prefixes, output);
            sim.set_tenants(tenants.clone());
            let set = RequestSet {
                prefix_ids: order.to_vec(),
                suffix_tokens: tokens(8, 5 * order.len()),
                suffix_offsets: (0..=order.len()).map(|i| 5 * i).collect(),
                output_tokens: vec![4; order.len()],
            };
            let records = sim.run_closed_loop(&set, 1).unwrap();
            records.iter().map(|r| r.cached_tokens).collect::<Vec<_>>()
        };
        let bs = g.config.hasher.block_size();
        let full = 64 / bs * bs;
        assert!(full > 0);
        assert_eq!(cached(&[0, 0]), [0, full]);
        assert_eq!(cached(&[0, 1]), [0, 0]);
        assert_eq!(cached(&[0, 2]), [0, 0]);
        assert_eq!(cached(&[2, 2]), [0, full]);
    }

    #[test]
    fn the_adapter_term_keeps_each_adapter_on_one_worker() {
        use crate::engine::scheduler::LoraSlots;
        use kvroute_core::policies::{KvAware, KvAwareConfig, Policy};
        use kvroute_core::pyrandom::PyRandom;
        use kvroute_core::routing::{Router, RoutingStep};
        use placement::RouterPlacement;

        let g = &parse()[0];
        // Eight prefixes of two tenants (adapters a0, a1 in turn) on two workers with one LoRA
        // slot each, drawn at random three at a time: the LoRA loads the engines made.
        let loads = |adapter_weight: f64| {
            let config = KvAwareConfig {
                adapter_weight,
                ..KvAwareConfig::default()
            };
            let policy = Policy::KvAware(Box::new(
                KvAware::new(config, PyRandom::from_seed(0)).unwrap(),
            ));
            let mut step = RoutingStep::new(g.config.hasher.block_size());
            step.track_adapters(Some(1));
            step.add_worker("w0");
            step.add_worker("w1");
            let mut router = Router::new(step, policy, None);
            let mut placement = RouterPlacement::new(&mut router, None);
            let engines = (0..2)
                .map(|_| {
                    let c = &g.config;
                    let mut e = Engine::new(
                        c.num_blocks,
                        c.cost.clone(),
                        c.hasher,
                        c.enable_caching,
                        false,
                    );
                    e.set_lora_slots(LoraSlots::new(1, 0.01));
                    e
                })
                .collect();
            let prefixes: Vec<Arc<[u32]>> = (0..8).map(|i| tokens(20 + i, 64).into()).collect();
            let output: Arc<[u32]> = (1000..1004).collect();
            let mut sim = Simulation::with_engines(
                engines,
                0.0,
                g.config.clone(),
                &mut placement,
                prefixes,
                output,
            );
            sim.set_tenants(
                (0..8)
                    .map(|i| Tenant {
                        keys: BlockKeys::new(Some(&format!("a{}", i % 2)), None),
                        lora_id: Some(i % 2 + 1),
                    })
                    .collect(),
            );
            let n = 40;
            let set = RequestSet {
                prefix_ids: (0..n as u64).map(|i| (splitmix64(i) % 8) as u32).collect(),
                suffix_tokens: tokens(9, 5 * n),
                suffix_offsets: (0..=n).map(|i| 5 * i).collect(),
                output_tokens: vec![4; n],
            };
            sim.run_closed_loop(&set, 3).unwrap();
            sim.engines()
                .iter()
                .map(|e| e.lora_slots().unwrap().loads)
                .sum::<u64>()
        };
        let (with, without) = (loads(KvAwareConfig::default().adapter_weight), loads(0.0));
        // Each adapter loaded once per worker it starts on, then kept there.
        assert!(with <= 3, "{with} loads with the term");
        assert!(
            without >= 4 * with,
            "{without} loads without it: adapters move"
        );
    }
}
