//! The engine model: a vLLM v1 scheduler over a `BlockPool`, with a cost model for time.
//!
//! Pure by design: no clock, no I/O. A driver hands it requests and the current time and asks
//! it to run a step; it answers what happened and how long the step took. The simulator drives
//! it on virtual time, the emulator on the wall clock.
//!
//! Scheduling follows `vllm/v1/core/sched/scheduler.py`:
//!
//! * Continuous batching under a token budget (`max_num_batched_tokens`) and a sequence cap
//!   (`max_num_seqs`).
//! * Running requests first, in order; one that cannot get a block for its next tokens
//!   preempts the most recently admitted running request (its blocks are freed and it goes
//!   back to the front of the waiting queue, to be recomputed later). If it has to preempt
//!   itself, nothing more runs this step, and no waiting request is admitted in a step that
//!   preempted.
//! * Then waiting requests, first come first served: look up the longest cached prefix (at
//!   most `num_tokens - 1` tokens, so a fully cached prompt still recomputes its last token),
//!   then allocate slots for the uncached part (a chunk of it under the budget: chunked
//!   prefill); if the blocks are not there the request keeps waiting and so does everyone
//!   behind it. Prefix-cache statistics are recorded at admission (an unadmitted lookup is
//!   not counted), separately for a preempted request coming back.
//! * Blocks become cached as soon as they are full and scheduled, before the step runs (a
//!   request admitted in the next step already hits them), generated tokens included.
//! * A finished request frees its blocks tail-first.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::engine::cost::CostModel;
use crate::engine::pool::{BlockId, BlockPool, TokenSeq};
use crate::hash_events::HashEvents;
use kvroute_core::blocks::{BlockHasher, BlockKeys};
use kvroute_core::kvevents::events::EventBatch;

/// A request's handle inside one engine, given by `Engine::add_request`. Handles of finished
/// or aborted requests are reused.
pub type RequestKey = usize;

/// A request as a driver hands it to the engine.
#[derive(Clone, Debug)]
pub struct NewRequest {
    /// The prompt's head when other requests share it (a simulator's common prefix): held
    /// once for all of them and never copied into a request; empty when there is none.
    pub prompt_head: Arc<[u32]>,
    /// The rest of the prompt (all of it when there is no shared head).
    pub prompt: Vec<u32>,
    /// The tokens the "sampler" will produce, in order (shared: a simulator gives every
    /// request the same ones).
    pub output: Arc<[u32]>,
    /// The request finishes after this many tokens (at most `output.len()`, at least 1).
    pub max_tokens: usize,
    /// When the engine received it (after any front-end delay), seconds.
    pub arrival_time: f64,
    /// Hashes of the prompt's first full blocks if the caller already has them (the
    /// simulator memoizes shared prefixes); the engine extends them as blocks fill.
    pub block_hashes: Vec<u64>,
    /// Its LoRA adapter and cache salt, which key its block hashes as vLLM's do.
    pub keys: BlockKeys,
    /// Its adapter's id (vLLM's `lora_int_id`, in `BlockStored.lora_id`); None without one.
    pub lora_id: Option<i64>,
}

/// The state of one request inside the engine.
#[derive(Clone, Debug)]
pub struct Request {
    /// Unique per engine, for telling a request from a later one in a reused slot.
    serial: u64,
    /// The prompt's shared head (see `NewRequest::prompt_head`).
    pub prompt_head: Arc<[u32]>,
    /// The rest of the prompt.
    pub prompt: Vec<u32>,
    /// The tokens it generates, in order.
    pub output: Arc<[u32]>,
    /// Tokens it generates before finishing.
    pub max_tokens: usize,
    /// When the engine received it.
    pub arrival_time: f64,
    /// Chained hashes of its full blocks, as far as computed (under `keys`).
    pub block_hashes: Vec<u64>,
    /// Its LoRA adapter and cache salt (see [`NewRequest::keys`]).
    pub keys: BlockKeys,
    /// Its adapter's id (see [`NewRequest::lora_id`]).
    pub lora_id: Option<i64>,
    /// Tokens generated so far.
    pub num_output: usize,
    /// Tokens whose KV is computed (or found cached).
    pub num_computed_tokens: usize,
    /// Prompt tokens found in the prefix cache at its first admission; -1 before.
    pub num_cached_tokens: i64,
    /// Its first blocks that hold cached hashes (hits, or its own filled blocks).
    pub num_cached_blocks: usize,
    /// Times it was preempted.
    pub num_preemptions: u32,
    /// Its KV blocks, in sequence order.
    pub blocks: Vec<BlockId>,
    /// End of the step that produced its first token.
    pub first_token_time: Option<f64>,
    /// End of the step that produced its last token.
    pub finish_time: Option<f64>,
}

impl Request {
    /// Prompt plus generated tokens.
    pub fn num_tokens(&self) -> usize {
        self.prompt_len() + self.num_output
    }

    /// Prompt tokens (the shared head and the rest).
    pub fn prompt_len(&self) -> usize {
        self.prompt_head.len() + self.prompt.len()
    }

    /// A copy of the figures a driver records.
    pub fn summary(&self) -> RequestSummary {
        RequestSummary {
            num_output: self.num_output,
            num_computed_tokens: self.num_computed_tokens,
            num_cached_tokens: self.num_cached_tokens,
            num_cached_blocks: self.num_cached_blocks,
            num_preemptions: self.num_preemptions,
            first_token_time: self.first_token_time,
            finish_time: self.finish_time,
        }
    }

    fn tokens(&self) -> TokenSeq<'_> {
        TokenSeq {
            prompt_head: &self.prompt_head,
            prompt: &self.prompt,
            output: &self.output[..self.num_output.min(self.output.len())],
            keys: &self.keys,
            lora_id: self.lora_id,
        }
    }
}

/// What a driver records of a request (its state after the step that reported it).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RequestSummary {
    /// Tokens generated so far.
    pub num_output: usize,
    /// Tokens whose KV is computed (or found cached).
    pub num_computed_tokens: usize,
    /// Prompt tokens found cached at its first admission; -1 before.
    pub num_cached_tokens: i64,
    /// Its first blocks that hold cached hashes.
    pub num_cached_blocks: usize,
    /// Times it was preempted.
    pub num_preemptions: u32,
    /// End of the step that produced its first token.
    pub first_token_time: Option<f64>,
    /// End of the step that produced its last token.
    pub finish_time: Option<f64>,
}

/// What one step produced for one request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RequestOutput {
    /// The request (already released if `finished`).
    pub key: RequestKey,
    /// The token sampled for it.
    pub new_token_id: u32,
    /// This is its first token.
    pub first_token: bool,
    /// This was its last token: it left the engine and freed its blocks.
    pub finished: bool,
    /// Its state after the step.
    pub summary: RequestSummary,
}

/// One engine step: scheduled at `start`, outputs ready at `end`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepResult {
    /// When the step was scheduled.
    pub start: f64,
    /// When its outputs are ready (`start` + the cost model's step time).
    pub end: f64,
    /// Prompt tokens computed in the step (chunks included).
    pub prefill_tokens: usize,
    /// Decoding sequences in the step.
    pub decode_seqs: usize,
    /// Requests scheduled and their token counts, in batch order.
    pub scheduled: Vec<(RequestKey, usize)>,
    /// Requests preempted while scheduling (now waiting again).
    pub preempted: Vec<RequestKey>,
    /// Requests that produced a token.
    pub outputs: Vec<RequestOutput>,
    /// The step's KV events (only when the engine emits them and there were any).
    pub events: Option<EventBatch>,
    /// The step's KV events instead, when the engine emits them as hash events
    /// ([`Engine::set_hash_events`]); empty otherwise.
    pub hash_events: HashEvents,
}

/// vLLM's prefix-cache counters (tokens), cumulative.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Requests admitted for the first time.
    pub requests: u64,
    /// Their tokens looked up (prompt and any generated tokens).
    pub queries: u64,
    /// Of those, tokens found cached.
    pub hits: u64,
    /// Re-admissions of preempted requests (vLLM counts them apart).
    pub preempted_requests: u64,
    /// Their tokens looked up.
    pub preempted_queries: u64,
    /// Of those, tokens found cached.
    pub preempted_hits: u64,
}

impl PrefixCacheStats {
    /// The counts accumulated since `before`.
    pub fn since(&self, before: &Self) -> Self {
        Self {
            requests: self.requests - before.requests,
            queries: self.queries - before.queries,
            hits: self.hits - before.hits,
            preempted_requests: self.preempted_requests - before.preempted_requests,
            preempted_queries: self.preempted_queries - before.preempted_queries,
            preempted_hits: self.preempted_hits - before.preempted_hits,
        }
    }
}

/// Why a request was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RequestError {
    /// `max_tokens` (after capping at the given output) is 0.
    NoOutput,
    /// The hasher's block size is not the engine's.
    HasherBlockSize,
}

impl std::fmt::Display for RequestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::NoOutput => "a request must generate at least one token",
            Self::HasherBlockSize => "hasher block size differs from the engine's",
        })
    }
}

impl std::error::Error for RequestError {}

/// One vLLM worker: a `BlockPool`, a scheduler and a cost model.
#[derive(Clone, Debug)]
pub struct Engine {
    pool: BlockPool,
    block_size: usize,
    cost: CostModel,
    hasher: BlockHasher,
    slots: Vec<Option<Request>>,
    free_slots: Vec<RequestKey>,
    next_serial: u64,
    waiting: VecDeque<RequestKey>,
    running: Vec<RequestKey>,
    stats: PrefixCacheStats,
    /// The waiting head's last failed admission: (its serial, pool version, token budget).
    /// Until a block is freed or cached its admission fails again with a budget no larger.
    blocked: Option<(u64, u64, usize)>,
    num_preemptions: u64,
    prompt_tokens_total: u64,
    generation_tokens_total: u64,
    /// LoRA adapters: slots and load time (None: adapters are not modelled).
    lora: Option<LoraSlots>,
}

/// vLLM's `--max-loras`: a batch holds requests of at most `max_loras` adapters (a waiting
/// request of another one is skipped, as vLLM's scheduler skips it), and the adapters sit in
/// that many slots, least recently used replaced first; a step that brings an adapter into a
/// slot takes `load_s` longer for each one it brings.
#[derive(Clone, Debug)]
pub struct LoraSlots {
    pub max_loras: usize,
    pub load_s: f64,
    /// The adapter ids in the slots, least recently scheduled first.
    loaded: Vec<i64>,
    /// Adapters brought into a slot (cumulative).
    pub loads: u64,
}

impl LoraSlots {
    /// `max_loras` slots (at least 1), each load taking `load_s` seconds.
    pub fn new(max_loras: usize, load_s: f64) -> Self {
        Self {
            max_loras: max_loras.max(1),
            load_s: load_s.max(0.0),
            loaded: Vec::new(),
            loads: 0,
        }
    }

    /// Whether adapter `id` sits in a slot.
    pub fn is_loaded(&self, id: i64) -> bool {
        self.loaded.contains(&id)
    }

    /// Mark `id` as just scheduled; true when it had to be loaded.
    fn use_adapter(&mut self, id: i64) -> bool {
        if let Some(i) = self.loaded.iter().position(|&l| l == id) {
            let l = self.loaded.remove(i);
            self.loaded.push(l);
            return false;
        }
        if self.loaded.len() >= self.max_loras {
            self.loaded.remove(0);
        }
        self.loaded.push(id);
        self.loads += 1;
        true
    }
}

impl Engine {
    /// An engine of `num_blocks` KV blocks (null block included) of `hasher.block_size()`
    /// tokens, timed by `cost`.
    pub fn new(
        num_blocks: usize,
        cost: CostModel,
        hasher: BlockHasher,
        enable_caching: bool,
        emit_events: bool,
    ) -> Self {
        let block_size = hasher.block_size();
        Self {
            pool: BlockPool::new(num_blocks, block_size, enable_caching, emit_events),
            block_size,
            cost,
            hasher,
            slots: Vec::new(),
            free_slots: Vec::new(),
            next_serial: 0,
            waiting: VecDeque::new(),
            running: Vec::new(),
            stats: PrefixCacheStats::default(),
            blocked: None,
            num_preemptions: 0,
            prompt_tokens_total: 0,
            generation_tokens_total: 0,
            lora: None,
        }
    }

    /// Model LoRA adapters with `slots` (see [`LoraSlots`]).
    pub fn set_lora_slots(&mut self, slots: LoraSlots) {
        self.lora = Some(slots);
    }

    /// The LoRA slots, when adapters are modelled.
    pub fn lora_slots(&self) -> Option<&LoraSlots> {
        self.lora.as_ref()
    }

    // -- queries ---------------------------------------------------------------------------

    /// The block pool (read-only: the engine owns its state).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }
    /// Emit KV events (when the engine emits any) as [`HashEvents`] in
    /// `StepResult::hash_events` (`on`) or as full events in `StepResult::events`; see
    /// `BlockPool::set_hash_events`.
    pub fn set_hash_events(&mut self, on: bool) {
        self.pool.set_hash_events(on);
    }
    /// The events the pool collected outside a step (a reset on an idle engine).
    pub fn take_pool_events(&mut self) -> Vec<kvroute_core::kvevents::events::KvCacheEvent> {
        self.pool.take_events()
    }
    /// The cost model.
    pub fn cost(&self) -> &CostModel {
        &self.cost
    }
    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    /// The hasher of its block hashes.
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }
    /// Whether any request is running or waiting.
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }
    /// Requests in the running batch.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }
    /// Requests waiting for admission.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    /// Running requests, in admission order.
    pub fn running(&self) -> &[RequestKey] {
        &self.running
    }
    /// Waiting requests, head first.
    pub fn waiting(&self) -> impl Iterator<Item = RequestKey> + '_ {
        self.waiting.iter().copied()
    }
    /// The prefix-cache counters.
    pub fn stats(&self) -> PrefixCacheStats {
        self.stats
    }
    /// Preemptions so far.
    pub fn num_preemptions(&self) -> u64 {
        self.num_preemptions
    }
    /// Prompt tokens of admitted requests (first admissions only), as vLLM counts them.
    pub fn prompt_tokens_total(&self) -> u64 {
        self.prompt_tokens_total
    }
    /// Tokens generated so far.
    pub fn generation_tokens_total(&self) -> u64 {
        self.generation_tokens_total
    }
    /// A request still in the engine.
    pub fn request(&self, key: RequestKey) -> Option<&Request> {
        self.slots.get(key).and_then(Option::as_ref)
    }

    // -- driver API --------------------------------------------------------------------------

    /// Queue a request; returns its key.
    pub fn add_request(&mut self, new: NewRequest) -> Result<RequestKey, RequestError> {
        let max_tokens = new.max_tokens.min(new.output.len());
        if max_tokens < 1 {
            return Err(RequestError::NoOutput);
        }
        let num_blocks =
            (new.prompt_head.len() + new.prompt.len() + max_tokens).div_ceil(self.block_size);
        let mut request = Request {
            serial: self.next_serial,
            prompt_head: new.prompt_head,
            prompt: new.prompt,
            output: new.output,
            max_tokens,
            arrival_time: new.arrival_time,
            block_hashes: new.block_hashes,
            keys: new.keys,
            lora_id: new.lora_id,
            num_output: 0,
            num_computed_tokens: 0,
            num_cached_tokens: -1,
            num_cached_blocks: 0,
            num_preemptions: 0,
            // Every block it will hold, so that taking them never regrows the vector.
            blocks: Vec::with_capacity(num_blocks),
            first_token_time: None,
            finish_time: None,
        };
        self.next_serial += 1;
        let full = request.prompt_len() / self.block_size;
        extend_hashes(&self.hasher, &mut request, full);
        let key = match self.free_slots.pop() {
            Some(k) => {
                self.slots[k] = Some(request);
                k
            }
            None => {
                self.slots.push(Some(request));
                self.slots.len() - 1
            }
        };
        self.waiting.push_back(key);
        Ok(key)
    }

    /// Drop a request (its client went away); its blocks are freed like a finished one's.
    /// Returns its last state, or None if it is not in the engine.
    pub fn abort_request(&mut self, key: RequestKey) -> Option<RequestSummary> {
        self.request(key)?;
        if let Some(i) = self.running.iter().position(|&k| k == key) {
            self.running.remove(i);
            self.free(key);
        } else if let Some(i) = self.waiting.iter().position(|&k| k == key) {
            self.waiting.remove(i);
        }
        Some(self.release(key).summary())
    }

    /// Forget every cached block, as `/reset_prefix_cache` does (refused while requests hold
    /// blocks). Its `AllBlocksCleared` event comes with the next step, or from
    /// `take_pool_events`.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset_prefix_cache()
    }

    /// Schedule and run one step starting at `now`.
    pub fn step(&mut self, now: f64) -> StepResult {
        let mut result = StepResult::default();
        self.step_into(now, &mut result);
        result
    }

    /// `step`, writing into `result` (cleared first) so a driver that steps millions of
    /// times reuses its vectors instead of allocating them per step.
    pub fn step_into(&mut self, now: f64, result: &mut StepResult) {
        result.start = now;
        result.end = now;
        result.prefill_tokens = 0;
        result.decode_seqs = 0;
        result.scheduled.clear();
        result.preempted.clear();
        result.outputs.clear();
        result.events = None;
        result.hash_events.clear();
        let result = &mut *result;
        self.schedule(result);
        for &(key, n) in &result.scheduled {
            let r = self.req(key);
            if r.num_computed_tokens >= r.prompt_len() {
                result.decode_seqs += 1;
            } else {
                result.prefill_tokens += n;
            }
        }
        let mut loads = 0;
        if let Some(lora) = &mut self.lora {
            for &(key, _) in &result.scheduled {
                let r = self.slots[key].as_ref().expect("a live request");
                if let Some(id) = r.lora_id {
                    loads += usize::from(lora.use_adapter(id));
                }
            }
        }
        let lora_s = self.lora.as_ref().map_or(0.0, |l| l.load_s * loads as f64);
        let end = now
            + self
                .cost
                .step_time(result.prefill_tokens, result.decode_seqs)
            + lora_s;
        result.end = end;
        self.update(result);
        if self.pool.hash_events_on() {
            self.pool.take_hash_events_into(&mut result.hash_events);
        } else if self.pool.emit_events() && self.pool.has_events() {
            result.events = Some(EventBatch {
                ts: end,
                events: self.pool.take_events(),
                data_parallel_rank: None,
            });
        }
    }

    // -- scheduling --------------------------------------------------------------------------

    fn req(&self, key: RequestKey) -> &Request {
        self.slots[key].as_ref().expect("a live request")
    }

    fn release(&mut self, key: RequestKey) -> Request {
        self.free_slots.push(key);
        self.slots[key].take().expect("a live request")
    }

    fn schedule(&mut self, result: &mut StepResult) {
        let bs = self.block_size;
        let mut budget = self.cost.max_num_batched_tokens;
        let mut i = 0;
        'running: while i < self.running.len() && budget > 0 {
            let key = self.running[i];
            let r = self.req(key);
            let computed = r.num_computed_tokens;
            let n = (r.num_tokens() - computed).min(budget);
            if n == 1
                && computed < r.blocks.len() * bs
                && (computed + 1) / bs == r.num_cached_blocks
            {
                // The common decode step: its slot exists and it completes no block.
                result.scheduled.push((key, 1));
                budget -= 1;
                i += 1;
                continue;
            }
            while !self.allocate(key, n, &[]) {
                let victim = self.running.pop().expect("the request itself is running");
                self.preempt(victim);
                result.preempted.push(victim);
                if victim == key {
                    break 'running; // preempted itself: nothing more can run this step
                }
            }
            result.scheduled.push((key, n));
            budget -= n;
            i += 1;
        }
        if !result.preempted.is_empty() {
            return;
        }
        // The adapters of the batch so far (vLLM's `scheduled_loras`).
        let mut batch_loras: Vec<i64> = match &self.lora {
            Some(_) => {
                let mut ids: Vec<i64> = self
                    .running
                    .iter()
                    .filter_map(|&k| self.req(k).lora_id)
                    .collect();
                ids.sort_unstable();
                ids.dedup();
                ids
            }
            None => Vec::new(),
        };
        let mut at = 0;
        while let Some(&key) = self.waiting.get(at) {
            if budget == 0 || self.running.len() >= self.cost.max_num_seqs {
                break;
            }
            if let (Some(lora), Some(id)) = (&self.lora, self.req(key).lora_id)
                && !batch_loras.contains(&id)
            {
                if batch_loras.len() >= lora.max_loras {
                    at += 1; // another adapter would exceed --max-loras: it waits
                    continue;
                }
                batch_loras.push(id);
            }
            let serial = self.req(key).serial;
            if let Some((s, version, b)) = self.blocked
                && s == serial
                && version == self.pool.version()
                && budget >= b
            {
                break; // nothing that could admit it has happened since it last failed
            }
            let mut hit = Vec::new();
            let slot = self.slots[key].as_mut().expect("a live request");
            let num_tokens = slot.num_tokens();
            if slot.num_computed_tokens == 0 {
                let max_blocks = (num_tokens - 1) / bs;
                if self.pool.enable_caching() {
                    extend_hashes(&self.hasher, slot, num_tokens / bs);
                    hit = self
                        .pool
                        .find_longest_hit_memo(&slot.block_hashes, max_blocks);
                }
            }
            let num_hit = hit.len() * bs;
            let n = (num_tokens - num_hit).min(budget);
            if !self.allocate(key, n, &hit) {
                self.blocked = Some((serial, self.pool.version(), budget));
                break;
            }
            self.waiting.remove(at);
            let r = self.slots[key].as_mut().expect("a live request");
            if r.num_preemptions > 0 {
                self.stats.preempted_requests += 1;
                self.stats.preempted_queries += num_tokens as u64;
                self.stats.preempted_hits += num_hit as u64;
            } else {
                self.stats.requests += 1;
                self.stats.queries += num_tokens as u64;
                self.stats.hits += num_hit as u64;
                self.prompt_tokens_total += r.prompt_len() as u64;
            }
            if r.num_cached_tokens < 0 {
                r.num_cached_tokens = num_hit as i64;
            }
            r.num_computed_tokens = num_hit;
            self.running.push(key);
            result.scheduled.push((key, n));
            budget -= n;
        }
    }

    /// vLLM's `allocate_slots`: room for `num_new` more tokens after the hit blocks; false
    /// (and no change) if the free queue cannot supply them.
    fn allocate(&mut self, key: RequestKey, num_new: usize, hit: &[BlockId]) -> bool {
        let bs = self.block_size;
        let pool = &mut self.pool;
        let r = self.slots[key].as_mut().expect("a live request");
        let num_computed = r.num_computed_tokens + hit.len() * bs;
        let required = (num_computed + num_new).div_ceil(bs);
        let need = required as i64 - r.blocks.len() as i64 - hit.len() as i64;
        let evictable = if hit.is_empty() {
            0
        } else {
            pool.num_evictable(hit)
        };
        if need > pool.num_free_blocks() as i64 - evictable as i64 {
            return false;
        }
        if !hit.is_empty() {
            pool.touch(hit);
            r.blocks.extend_from_slice(hit);
            r.num_cached_blocks = r.blocks.len();
        }
        if need > 0 {
            pool.take_into(need as usize, &mut r.blocks);
        }
        let num_full = (num_computed + num_new).min(r.num_tokens()) / bs;
        if num_full > r.num_cached_blocks {
            if pool.enable_caching() {
                extend_hashes(&self.hasher, r, num_full);
                pool.cache_full_blocks(
                    &r.blocks,
                    &r.block_hashes,
                    r.num_cached_blocks,
                    num_full,
                    r.tokens(),
                );
            }
            r.num_cached_blocks = num_full;
        }
        true
    }

    /// Free a request's blocks tail-first.
    fn free(&mut self, key: RequestKey) {
        let r = self.slots[key].as_mut().expect("a live request");
        self.pool.free_blocks(r.blocks.iter().rev().copied());
        r.blocks.clear();
        r.num_cached_blocks = 0;
    }

    fn preempt(&mut self, key: RequestKey) {
        self.free(key);
        let r = self.slots[key].as_mut().expect("a live request");
        r.num_computed_tokens = 0;
        r.num_preemptions += 1;
        self.num_preemptions += 1;
        self.waiting.push_front(key);
    }

    fn update(&mut self, result: &mut StepResult) {
        let end = result.end;
        for &(key, n) in &result.scheduled {
            let r = self.slots[key].as_mut().expect("a live request");
            r.num_computed_tokens += n;
            if r.num_computed_tokens < r.num_tokens() {
                continue; // a prefill chunk that does not reach the end samples nothing
            }
            let token = r.output[r.num_output];
            r.num_output += 1;
            self.generation_tokens_total += 1;
            let first = r.first_token_time.is_none();
            if first {
                r.first_token_time = Some(end);
            }
            let finished = r.num_output >= r.max_tokens;
            if finished {
                r.finish_time = Some(end);
                let i = self
                    .running
                    .iter()
                    .position(|&k| k == key)
                    .expect("running");
                self.running.remove(i);
                self.free(key);
            }
            let summary = self.req(key).summary();
            if finished {
                self.release(key);
            }
            result.outputs.push(RequestOutput {
                key,
                new_token_id: token,
                first_token: first,
                finished,
                summary,
            });
        }
    }
}

/// Make sure `r.block_hashes` covers its first `num_full` blocks, hashing only the tokens of
/// the blocks it lacks (a decode step completes one block of a long sequence). The tokens are
/// read in place from the part of the sequence (shared head, own prompt, output) that holds
/// them; only a window across two parts is gathered.
fn extend_hashes(hasher: &BlockHasher, r: &mut Request, num_full: usize) {
    let have = r.block_hashes.len();
    if have >= num_full {
        return;
    }
    let bs = hasher.block_size();
    let (lo, hi) = (have * bs, num_full * bs);
    let parent = r.block_hashes.last().copied();
    let mut at = 0;
    for part in [&r.prompt_head[..], &r.prompt[..], &r.output[..]] {
        if lo >= at && hi <= at + part.len() {
            hasher.extend_chain_keyed(
                &part[lo - at..hi - at],
                parent,
                have,
                &r.keys,
                &mut r.block_hashes,
            );
            return;
        }
        at += part.len();
    }
    let mut window = Vec::with_capacity(hi - lo);
    let mut at = 0;
    for part in [&r.prompt_head[..], &r.prompt[..], &r.output[..]] {
        let end = at + part.len();
        if lo < end && hi > at {
            window.extend_from_slice(&part[lo.max(at) - at..hi.min(end) - at]);
        }
        at = end;
    }
    hasher.extend_chain_keyed(&window, parent, have, &r.keys, &mut r.block_hashes);
}

#[cfg(test)]
mod tests {
    //! As the engine half of tests/unit/test_engine_pool.py.
    use super::*;
    use kvroute_core::blocks::DEFAULT_HASH_SEED;
    use kvroute_core::kvevents::events::KvCacheEvent;

    const BS: usize = 4;

    fn engine(num_blocks: usize) -> Engine {
        Engine::new(
            num_blocks,
            CostModel::instant(),
            BlockHasher::new(BS, DEFAULT_HASH_SEED).unwrap(),
            true,
            true,
        )
    }

    fn req(
        prompt: impl IntoIterator<Item = u32>,
        output: impl IntoIterator<Item = u32>,
    ) -> NewRequest {
        let output: Arc<[u32]> = output.into_iter().collect();
        NewRequest {
            prompt_head: Arc::default(),
            prompt: prompt.into_iter().collect(),
            max_tokens: output.len(),
            output,
            arrival_time: 0.0,
            block_hashes: vec![],
            keys: BlockKeys::default(),
            lora_id: None,
        }
    }

    fn run(e: &mut Engine) -> Vec<RequestOutput> {
        let mut out = vec![];
        while e.has_work() {
            out.extend(e.step(0.0).outputs);
        }
        out
    }

    fn cached_of(outputs: &[RequestOutput]) -> i64 {
        outputs
            .iter()
            .find(|o| o.finished)
            .unwrap()
            .summary
            .num_cached_tokens
    }

    #[test]
    fn hits_whole_blocks_and_recomputes_the_last_token_of_a_full_hit() {
        let mut e = engine(64);
        e.add_request(req(1..13, [7, 8])).unwrap();
        run(&mut e);
        e.add_request(req(1..13, [7, 8])).unwrap();
        assert_eq!(cached_of(&run(&mut e)), 8);
        e.add_request(req(1..16, [9])).unwrap();
        assert_eq!(cached_of(&run(&mut e)), 12);
        assert_eq!((e.stats().queries, e.stats().hits), (12 + 12 + 15, 8 + 12));
    }

    #[test]
    fn adapters_and_salts_key_the_cache_and_its_events_as_vllms() {
        let mut e = engine(64);
        let keyed = |salt: Option<&str>, lora: Option<&str>| NewRequest {
            keys: BlockKeys::new(lora, salt),
            lora_id: lora.map(|_| 1),
            ..req(1..14, [7])
        };
        e.add_request(keyed(Some("t1"), None)).unwrap();
        run(&mut e);
        // Another tenant's salt, the same tenant under an adapter, no salt: no hit.
        for (salt, lora) in [(Some("t2"), None), (Some("t1"), Some("a")), (None, None)] {
            e.add_request(keyed(salt, lora)).unwrap();
            assert_eq!(cached_of(&run(&mut e)), 0, "{salt:?} {lora:?}");
        }
        e.add_request(keyed(Some("t1"), None)).unwrap();
        assert_eq!(cached_of(&run(&mut e)), 12);
        // The events name the adapter and carry each block's keys; the index hashes them as
        // the router hashes the request.
        e.add_request(keyed(Some("t9"), Some("sql"))).unwrap();
        let mut stored = vec![];
        while e.has_work() {
            if let Some(batch) = e.step(0.0).events {
                stored.extend(batch.events);
            }
        }
        let KvCacheEvent::Stored(s) = &stored[0] else {
            panic!("{stored:?}")
        };
        assert_eq!((s.lora_id, s.lora_name.as_deref()), (Some(1), Some("sql")));
        let keys = s.extra_keys.as_ref().unwrap();
        assert_eq!(keys.len(), 3);
        let text = |k: &Option<Vec<u8>>| {
            kvroute_core::kvevents::codec::text_extra_keys(k.as_deref().unwrap())
                .unwrap()
                .join(",")
        };
        assert_eq!(
            (text(&keys[0]), text(&keys[1])),
            ("sql,t9".into(), "sql".into())
        );
        let mut index = kvroute_core::index::KvIndex::new(
            BlockHasher::new(BS, 1).unwrap(),
            Some(1.0),
            None,
            None,
        )
        .unwrap();
        index.apply("w", &stored);
        let mine = BlockHasher::new(BS, 1).unwrap().hash_blocks_keyed(
            &(1..14).collect::<Vec<u32>>(),
            None,
            0,
            None,
            &BlockKeys::new(Some("sql"), Some("t9")),
        );
        assert_eq!(index.overlaps(&mine, &["w"], 0.0), vec![3]);
    }

    #[test]
    fn max_loras_holds_back_another_adapter_and_loading_one_takes_time() {
        let mut e = engine(64);
        e.set_lora_slots(LoraSlots::new(1, 0.5));
        let lora = |id: i64, start: u32| NewRequest {
            keys: BlockKeys::new(Some(&format!("a{id}")), None),
            lora_id: Some(id),
            ..req(start..start + 5, [7, 8, 9])
        };
        e.add_request(lora(1, 1)).unwrap();
        e.add_request(lora(2, 100)).unwrap();
        e.add_request(req(200..205, [7, 8, 9])).unwrap(); // no adapter: never held back
        let first = e.step(0.0);
        let ids: Vec<Option<i64>> = first
            .scheduled
            .iter()
            .map(|&(k, _)| e.req(k).lora_id)
            .collect();
        assert_eq!(ids, vec![Some(1), None], "adapter 2 waits for a slot");
        // The instant cost model: every second of a step is a load.
        assert_eq!(first.end, 0.5);
        let mut t = first.end;
        while e.has_work() {
            t = e.step(t).end;
        }
        assert_eq!((e.lora_slots().unwrap().loads, t), (2, 1.0));
    }

    #[test]
    fn generated_tokens_fill_and_cache_blocks() {
        let mut e = engine(64);
        e.add_request(req(1..7, 100..106)).unwrap();
        let mut tokens = vec![];
        while e.has_work() {
            if let Some(batch) = e.step(0.0).events {
                for ev in batch.events {
                    if let KvCacheEvent::Stored(s) = ev {
                        tokens.extend(s.token_ids);
                    }
                }
            }
        }
        assert_eq!(tokens, vec![1, 2, 3, 4, 5, 6, 100, 101]);
    }

    /// An engine emitting hash events emits, step by step, exactly the hashes of the full
    /// events a twin emitting full events does, evictions and preemptions included.
    #[test]
    fn hash_events_are_the_full_events_reduced() {
        let (mut full, mut hashed) = (engine(7), engine(7));
        hashed.set_hash_events(true);
        let mut steps_with_removals = 0;
        for round in 0..6u32 {
            for e in [&mut full, &mut hashed] {
                e.add_request(req((round % 3) * 100..(round % 3) * 100 + 8, 10..20))
                    .unwrap();
                e.add_request(req(500 + round * 40..508 + round * 40, 10..20))
                    .unwrap();
            }
            while full.has_work() {
                let (a, b) = (full.step(0.0), hashed.step(0.0));
                let events = a.events.map(|batch| batch.events).unwrap_or_default();
                assert_eq!(HashEvents::from_events(&events), b.hash_events);
                assert!(b.events.is_none() && a.hash_events.is_empty());
                steps_with_removals +=
                    events.iter().any(|e| matches!(e, KvCacheEvent::Removed(_))) as usize;
            }
            assert!(!hashed.has_work());
        }
        assert!(
            steps_with_removals > 0 && full.num_preemptions() > 0,
            "{steps_with_removals} {}",
            full.num_preemptions()
        );
        assert!(full.reset_prefix_cache() && hashed.reset_prefix_cache());
        hashed.set_hash_events(false);
        assert_eq!(full.take_pool_events(), vec![KvCacheEvent::AllCleared]);
        assert!(
            hashed.take_pool_events().is_empty(),
            "dropped on switching back"
        );
    }

    #[test]
    fn a_waiting_request_is_admitted_when_blocks_free_up() {
        let mut e = engine(5);
        let a = e.add_request(req(1..13, [1, 2, 3])).unwrap();
        e.add_request(req(50..62, [1, 2, 3])).unwrap();
        let first = e.step(0.0);
        assert_eq!(
            first.outputs.iter().map(|o| o.key).collect::<Vec<_>>(),
            vec![a]
        );
        assert_eq!((e.num_waiting(), e.num_running()), (1, 1));
        let done = run(&mut e).iter().filter(|o| o.finished).count();
        assert_eq!(done, 2);
        assert_eq!(e.stats().requests, 2);
    }

    #[test]
    fn preemption_frees_the_last_admitted_request() {
        let mut e = engine(7);
        e.add_request(req(1..9, 10..20)).unwrap();
        e.add_request(req(50..58, 10..20)).unwrap();
        let out = run(&mut e);
        assert!(e.num_preemptions() >= 1);
        assert_eq!(out.iter().filter(|o| o.finished).count(), 2);
        assert_eq!(e.pool().num_free_blocks(), 6);
        assert_eq!(e.stats().requests, 2);
        assert_eq!(e.stats().preempted_requests, e.num_preemptions());
    }

    #[test]
    fn chunked_prefill_splits_a_prompt_under_the_budget() {
        let mut cost = CostModel::new("t", 1.0, 0.0, 0.0, 0.0);
        cost.max_num_batched_tokens = 8;
        let mut e = Engine::new(64, cost, BlockHasher::new(BS, 1).unwrap(), true, false);
        e.add_request(req(1..21, [5, 6])).unwrap();
        let steps: Vec<_> = (0..3)
            .map(|_| e.step(0.0))
            .map(|s| (s.prefill_tokens, s.outputs.len()))
            .collect();
        assert_eq!(steps, vec![(8, 0), (8, 0), (4, 1)]);
    }

    #[test]
    fn abort_frees_blocks() {
        let mut e = engine(64);
        let a = e.add_request(req(1..9, 10..20)).unwrap();
        e.step(0.0);
        assert!(e.abort_request(a).is_some());
        assert_eq!(e.pool().num_free_blocks(), 63);
        assert!(!e.has_work());
        assert!(e.abort_request(a).is_none());
    }

    #[test]
    fn a_request_must_generate_a_token() {
        let mut e = engine(8);
        assert_eq!(
            e.add_request(req(1..3, [])).unwrap_err(),
            RequestError::NoOutput
        );
    }
}
