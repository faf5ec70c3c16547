//! The one routing step, used by the simulator and the live router alike (through the
//! routing operation, `Router`, which owns it beside the policy and retention).
//!
//! Per request: look the prompt up in the index (when the policy needs the overlap: every
//! candidate's, with each one's cached blocks; otherwise, after the decision, the chosen
//! worker's), ask the policy, record the decision in the index as predicted entries, and
//! charge the chosen worker's load: one request in flight, and the prompt tokens it still
//! has to prefill after the overlap the index credits it with (at least one) until its first
//! token. One step for both, so the simulator's prediction and the router cannot drift apart.
//!
//! Workers are slots: [`RoutingStep::add_worker`] gives a worker (by name) a slot that stays
//! its own until [`RoutingStep::remove_worker`]; a worker that comes back gets a fresh slot,
//! so the late first tokens and finishes of requests sent to its former self cannot skew its
//! new load. The index keeps its own ids; the step re-resolves them when the index's worker
//! set changes.
//!
//! With [`RoutingStep::track_adapters`], the step also models each worker's LoRA slots: the
//! last `max_loras` distinct adapters its requests (this router's and, through
//! [`RoutingStep::route_to`], a peer replica's) ran under, in `WorkerState::adapters`, and
//! shows the policy the request's adapter (`RequestView::adapter`).
//!
//! With a journal on, the step records its inputs ([`JournalEntry`]): replaying them through
//! another step (another replica, the live router's code) must give the same decisions.

use std::collections::HashMap;

use crate::admission::Admission;
use crate::index::{KvIndex, WorkerId};
use crate::kvevents::events::KvCacheEvent;
use crate::policies::{Choose, RequestView, WorkerState};

/// One request as the routing step and the routing operation see it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Request<'a> {
    /// The prompt's own block hashes (adapter and salt keyed in).
    pub block_hashes: &'a [u64],
    /// The prompt's token ids (empty where the front does not know them: retention then
    /// leaves the request out).
    pub prompt: &'a [u32],
    /// The prompt's length in tokens.
    pub prompt_tokens: usize,
    /// Its output budget (what retention's model allocates beside the prompt).
    pub output_tokens: usize,
    /// Its LoRA adapter (`crate::policies::adapter_id`; None: the base model).
    pub adapter: Option<u64>,
}

/// A routing decision: the one name for it wherever it is made (the step, the routing
/// operation, the simulator's placements, the live router); what carries more around it is
/// named for that.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    /// The chosen worker's slot.
    pub worker: usize,
    /// Leading prompt blocks the index credits the chosen worker with.
    pub overlap: usize,
    /// Prompt tokens charged to its load until the first token (at least 1).
    pub prefill_tokens: usize,
    /// Its ticket in the step's KV-admission model (None when the step keeps none): what
    /// [`RoutingStep::finished`] takes back.
    pub ticket: Option<u64>,
}

/// One input the step saw, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum JournalEntry {
    /// A request was routed (and what the step chose).
    Route {
        block_hashes: Vec<u64>,
        prompt_tokens: usize,
        candidates: Option<Vec<usize>>,
        /// The request's adapter (`crate::policies::adapter_id`), if any.
        adapter: Option<u64>,
        now: f64,
        decision: Decision,
    },
    /// A request's first token.
    FirstToken {
        worker: usize,
        prefill_tokens: usize,
    },
    /// A request finished.
    Finished {
        worker: usize,
        ticket: Option<u64>,
        now: f64,
    },
    /// A worker's KV events were applied.
    Events {
        worker: usize,
        events: Vec<KvCacheEvent>,
        now: f64,
    },
}

#[derive(Clone, Debug)]
struct Slot {
    state: WorkerState,
    live: bool,
    index_id: Option<WorkerId>,
}

/// The routing step's state: the workers and their load accounting.
#[derive(Clone, Debug)]
pub struct RoutingStep {
    block_size: usize,
    slots: Vec<Slot>,
    by_name: HashMap<String, usize>,
    live: Vec<usize>,
    /// The index epoch the slots' `index_id`s were resolved at.
    resolved_epoch: Option<u64>,
    journal: Option<Vec<JournalEntry>>,
    ids: Vec<Option<WorkerId>>,
    overlaps: Vec<usize>,
    /// What each worker's requests in flight pin of its KV blocks (when the capacity is known).
    admission: Option<Admission>,
    waits: Vec<f64>,
    /// LoRA slots per worker, when the step models them.
    max_loras: Option<usize>,
}

impl RoutingStep {
    /// A step for engines with `block_size`-token KV blocks (what an overlap is worth).
    pub fn new(block_size: usize) -> Self {
        Self {
            block_size,
            slots: Vec::new(),
            by_name: HashMap::new(),
            live: Vec::new(),
            resolved_epoch: None,
            journal: None,
            ids: Vec::new(),
            overlaps: Vec::new(),
            admission: None,
            waits: Vec::new(),
            max_loras: None,
        }
    }

    /// Model each worker's LoRA slots as the last `max_loras` (at least 1) distinct adapters
    /// routed there (vLLM's `--max-loras`), and show the policy each request's adapter; None
    /// stops (the policy then sees no adapter, and the model is dropped).
    pub fn track_adapters(&mut self, max_loras: Option<usize>) {
        self.max_loras = max_loras.map(|n| n.max(1));
        for s in &mut self.slots {
            s.state.lora_slots = self.max_loras.unwrap_or(0);
            if max_loras.is_none() {
                s.state.adapters.clear();
            }
        }
    }

    /// The LoRA slots per worker the step models (None: it models none).
    pub fn max_loras(&self) -> Option<usize> {
        self.max_loras
    }

    /// Keep a KV-admission model (`crate::admission`) for policies that
    /// [`Choose::needs_admission`], of workers with `capacity_blocks` usable KV blocks each
    /// unless [`RoutingStep::set_kv_capacity`] says otherwise (None: unknown until then);
    /// call it before routing. Each routed request then costs a hash-map entry per prompt
    /// block until it finishes, so the simulator keeps one only for such a policy.
    pub fn track_admission(&mut self, capacity_blocks: Option<usize>) {
        self.admission = Some(Admission::new(self.block_size, capacity_blocks));
    }

    /// Set `slot`'s usable KV blocks (what its engine reported), if the step keeps a
    /// KV-admission model.
    pub fn set_kv_capacity(&mut self, slot: usize, blocks: usize) {
        if let Some(a) = &mut self.admission {
            a.set_capacity(slot, blocks);
        }
    }

    /// The KV-admission model, if the step keeps one.
    pub fn admission(&self) -> Option<&Admission> {
        self.admission.as_ref()
    }

    /// Tokens per KV block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Start (or stop, returning what was recorded) the journal.
    pub fn set_journal(&mut self, on: bool) -> Vec<JournalEntry> {
        let old = self.journal.take().unwrap_or_default();
        self.journal = on.then(Vec::new);
        old
    }

    /// What the journal recorded so far.
    pub fn journal(&self) -> &[JournalEntry] {
        self.journal.as_deref().unwrap_or(&[])
    }

    /// Whether the journal is on.
    pub fn is_journaling(&self) -> bool {
        self.journal.is_some()
    }

    /// The slot of worker `name`, adding it (idle) if it is not in the step.
    pub fn add_worker(&mut self, name: &str) -> usize {
        if let Some(&slot) = self.by_name.get(name) {
            return slot;
        }
        let slot = self.slots.len();
        let mut state = WorkerState::new(name);
        state.lora_slots = self.max_loras.unwrap_or(0);
        self.slots.push(Slot {
            state,
            live: true,
            index_id: None,
        });
        self.by_name.insert(name.to_owned(), slot);
        self.live.push(slot);
        self.resolved_epoch = None;
        slot
    }

    /// Take worker `name` out of the step (it left the pool).
    pub fn remove_worker(&mut self, name: &str) {
        if let Some(slot) = self.by_name.remove(name) {
            self.slots[slot].live = false;
            self.live.retain(|&s| s != slot);
        }
    }

    /// The slot of a worker in the step.
    pub fn slot(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// Slots handed out so far (removed workers' included).
    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// The workers in the step, in the order they were added.
    pub fn live_slots(&self) -> &[usize] {
        &self.live
    }

    /// The load accounting of a slot (also of a removed worker's).
    pub fn state(&self, slot: usize) -> &WorkerState {
        &self.slots[slot].state
    }

    fn resolve(&mut self, index: &KvIndex) {
        if self.resolved_epoch == Some(index.epoch()) {
            return;
        }
        for s in &mut self.slots {
            s.index_id = if s.live {
                index.worker_id(&s.state.name)
            } else {
                None
            };
        }
        self.resolved_epoch = Some(index.epoch());
    }

    /// Route `request` (its block hashes, its length and its LoRA adapter; its tokens and
    /// output budget are retention's, not the step's) among `candidates` (slots, in the order
    /// the policy sees them; None: every worker in the step), at `now`. Panics when there is
    /// no candidate.
    pub fn route(
        &mut self,
        mut index: Option<&mut KvIndex>,
        policy: &mut dyn Choose,
        request: &Request<'_>,
        candidates: Option<&[usize]>,
        now: f64,
    ) -> Decision {
        let Request {
            block_hashes,
            prompt_tokens,
            adapter,
            ..
        } = *request;
        let seen_adapter = adapter.filter(|_| self.max_loras.is_some());
        let all;
        let cands: &[usize] = match candidates {
            Some(c) => c,
            None => {
                all = self.live.clone();
                &all
            }
        };
        assert!(!cands.is_empty(), "routing needs at least one worker");
        let (i, overlap) = match index.as_deref_mut() {
            Some(ix) if policy.needs_overlap() => {
                self.resolve(ix);
                self.ids.clear();
                self.ids
                    .extend(cands.iter().map(|&c| self.slots[c].index_id));
                ix.overlaps_into(block_hashes, &self.ids, now, &mut self.overlaps);
                for (&c, id) in cands.iter().zip(&self.ids) {
                    self.slots[c].state.cached_blocks =
                        id.map_or(0, |id| ix.worker_blocks_of(id)) as i64;
                }
                let waits = match &self.admission {
                    Some(a) if policy.needs_admission() => {
                        self.waits.clear();
                        self.waits.extend(
                            cands
                                .iter()
                                .map(|&c| a.expected_wait(c, block_hashes, prompt_tokens, now)),
                        );
                        Some(self.waits.as_slice())
                    }
                    _ => None,
                };
                let refs: Vec<&WorkerState> = cands.iter().map(|&c| &self.slots[c].state).collect();
                let view = RequestView {
                    block_hashes,
                    prompt_tokens,
                    overlap_blocks: Some(&self.overlaps),
                    admission_wait: waits,
                    adapter: seen_adapter,
                };
                let i = policy.choose(&view, &refs);
                (i, self.overlaps[i])
            }
            maybe_index => {
                let refs: Vec<&WorkerState> = cands.iter().map(|&c| &self.slots[c].state).collect();
                let view = RequestView {
                    block_hashes,
                    prompt_tokens,
                    overlap_blocks: None,
                    admission_wait: None,
                    adapter: seen_adapter,
                };
                let i = policy.choose(&view, &refs);
                (i, self.overlap_of(maybe_index, cands[i], block_hashes, now))
            }
        };
        self.commit(index, cands[i], overlap, request, candidates, now)
    }

    /// Route one request to `worker`, chosen by the caller rather than the policy (which
    /// neither sees nor learns of it: retention's placement of a prompt cached nowhere, see
    /// `Retention::room_for`; a peer replica's decision), with the step's accounting as
    /// [`RoutingStep::route`] does it.
    pub fn route_to(
        &mut self,
        mut index: Option<&mut KvIndex>,
        worker: usize,
        block_hashes: &[u64],
        prompt_tokens: usize,
        adapter: Option<u64>,
        now: f64,
    ) -> Decision {
        let overlap = self.overlap_of(index.as_deref_mut(), worker, block_hashes, now);
        let request = Request {
            block_hashes,
            prompt_tokens,
            adapter,
            ..Request::default()
        };
        self.commit(index, worker, overlap, &request, Some(&[worker]), now)
    }

    /// The leading blocks of the prompt the index credits `worker` with (0 without one).
    fn overlap_of(
        &mut self,
        index: Option<&mut KvIndex>,
        worker: usize,
        block_hashes: &[u64],
        now: f64,
    ) -> usize {
        match index {
            Some(ix) if !block_hashes.is_empty() => {
                self.resolve(ix);
                let id = self.slots[worker].index_id;
                ix.overlaps_into(block_hashes, &[id], now, &mut self.overlaps);
                self.overlaps[0]
            }
            _ => 0,
        }
    }

    /// Count a decision for `request` (to `worker`, credited with `overlap` blocks): the
    /// prediction in the index, the load, the LoRA slots, the journal.
    fn commit(
        &mut self,
        index: Option<&mut KvIndex>,
        worker: usize,
        overlap: usize,
        request: &Request<'_>,
        candidates: Option<&[usize]>,
        now: f64,
    ) -> Decision {
        let Request {
            block_hashes,
            prompt_tokens,
            adapter,
            ..
        } = *request;
        if let Some(ix) = index {
            let id = match self.slots[worker].index_id {
                Some(id) if self.resolved_epoch == Some(ix.epoch()) => id,
                _ => ix.ensure_worker(&self.slots[worker].state.name),
            };
            ix.record_routed_to(id, block_hashes, now);
        }
        let prefill_tokens = prompt_tokens
            .saturating_sub(overlap * self.block_size)
            .max(1);
        let state = &mut self.slots[worker].state;
        state.in_flight += 1;
        state.in_flight_tokens += prefill_tokens as i64;
        if let (Some(_), Some(a)) = (self.max_loras, adapter) {
            state.use_adapter(a);
        }
        let ticket = self
            .admission
            .as_mut()
            .map(|a| a.routed(worker, block_hashes, prompt_tokens, now));
        let decision = Decision {
            worker,
            overlap,
            prefill_tokens,
            ticket,
        };
        if let Some(j) = &mut self.journal {
            j.push(JournalEntry::Route {
                block_hashes: block_hashes.to_vec(),
                prompt_tokens,
                candidates: candidates.map(<[usize]>::to_vec),
                adapter,
                now,
                decision,
            });
        }
        decision
    }

    /// The request routed to `worker` with `prefill_tokens` produced its first token.
    pub fn first_token(&mut self, worker: usize, prefill_tokens: usize) {
        self.slots[worker].state.in_flight_tokens -= prefill_tokens as i64;
        if let Some(j) = &mut self.journal {
            j.push(JournalEntry::FirstToken {
                worker,
                prefill_tokens,
            });
        }
    }

    /// A request routed to `worker` (with `ticket`, see [`Decision`]) finished at `now`.
    pub fn finished(&mut self, worker: usize, ticket: Option<u64>, now: f64) {
        self.slots[worker].state.in_flight -= 1;
        if let (Some(a), Some(t)) = (&mut self.admission, ticket) {
            a.finished(t, now);
        }
        if let Some(j) = &mut self.journal {
            j.push(JournalEntry::Finished {
                worker,
                ticket,
                now,
            });
        }
    }

    /// Apply `worker`'s KV events to the index (at `now`, for the journal).
    pub fn apply_events(
        &mut self,
        index: &mut KvIndex,
        worker: usize,
        events: &[KvCacheEvent],
        now: f64,
    ) {
        let name = &self.slots[worker].state.name;
        index.apply(name, events);
        if let Some(j) = &mut self.journal {
            j.push(JournalEntry::Events {
                worker,
                events: events.to_vec(),
                now,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::{BlockHasher, DEFAULT_HASH_SEED};
    use crate::policies::{KvAware, KvAwareConfig, Policy};
    use crate::pyrandom::PyRandom;

    #[test]
    fn a_request_that_would_wait_for_blocks_goes_where_it_fits() {
        let hasher = BlockHasher::new(16, DEFAULT_HASH_SEED).unwrap();
        let run = |admission: bool| {
            let mut index = KvIndex::new(hasher, Some(100.0), None, None).unwrap();
            let guarded = KvAwareConfig {
                admission_wait: Some(0.2),
                ..KvAwareConfig::default()
            };
            let mut policy = Policy::KvAware(Box::new(
                KvAware::new(guarded, PyRandom::from_seed(0)).unwrap(),
            ));
            let mut step = RoutingStep::new(16);
            if admission {
                step.track_admission(Some(150));
            }
            let (a, b) = (step.add_worker("a"), step.add_worker("b"));
            let cached: Vec<u32> = (0..1600).collect();
            let running: Vec<u32> = (5000..6600).collect();
            let cached_hashes = hasher.hash_blocks(&cached, None, 0, None);
            let running_hashes = hasher.hash_blocks(&running, None, 0, None);
            // `a` served `cached` in 1 s (a typical request), then took `running`, which pins
            // 100 of its 150 blocks.
            let r = step.route_to(Some(&mut index), a, &cached_hashes, 1600, None, 0.0);
            step.first_token(a, r.prefill_tokens);
            step.finished(a, r.ticket, 1.0);
            step.route_to(Some(&mut index), a, &running_hashes, 1600, None, 1.0);
            if admission {
                assert_eq!(step.admission().unwrap().pinned_blocks(a), 100);
            }
            // `cached` again: a full hit on `a`, where its 100 blocks do not fit beside the
            // running request's, expected to run 0.9 s more.
            let r = step.route(
                Some(&mut index),
                &mut policy,
                &Request {
                    block_hashes: &cached_hashes,
                    prompt_tokens: 1600,
                    adapter: None,
                    ..Request::default()
                },
                None,
                1.1,
            );
            (r.worker == b, r.ticket)
        };
        assert_eq!(run(false), (false, None));
        assert_eq!(run(true), (true, Some(2)));
    }

    #[test]
    fn the_step_models_lora_slots_from_its_own_and_its_peers_decisions() {
        use crate::policies::adapter_id;
        let hasher = BlockHasher::new(16, DEFAULT_HASH_SEED).unwrap();
        let mut index = KvIndex::new(hasher, Some(100.0), None, None).unwrap();
        let mut policy = Policy::KvAware(Box::new(
            KvAware::new(KvAwareConfig::default(), PyRandom::from_seed(0)).unwrap(),
        ));
        let mut step = RoutingStep::new(16);
        step.track_adapters(Some(1));
        let (a, b) = (step.add_worker("a"), step.add_worker("b"));
        let (sql, chat) = (Some(adapter_id("sql")), Some(adapter_id("chat")));
        let prompt = |start: u32| {
            hasher.hash_blocks(&(start..start + 64).collect::<Vec<_>>(), None, 0, None)
        };
        // A peer replica sent an `sql` request to `a` (still running), and a `chat` one to `b`
        // (finished): their only slots hold `sql` and `chat`.
        step.route_to(Some(&mut index), a, &prompt(0), 64, sql, 0.0);
        let r = step.route_to(Some(&mut index), b, &prompt(500), 64, chat, 0.0);
        step.first_token(b, r.prefill_tokens);
        step.finished(b, r.ticket, 0.05);
        assert_eq!(step.state(a).adapters, vec![sql.unwrap()]);
        // A new `sql` prompt goes to `a` though `b` is idle: there it would displace `chat`.
        let r = step.route(
            Some(&mut index),
            &mut policy,
            &Request {
                block_hashes: &prompt(1000),
                prompt_tokens: 64,
                adapter: sql,
                ..Request::default()
            },
            None,
            0.1,
        );
        assert_eq!(r.worker, a);
        // A `chat` prompt goes to `b`, which still holds `chat` only.
        let r = step.route(
            Some(&mut index),
            &mut policy,
            &Request {
                block_hashes: &prompt(2000),
                prompt_tokens: 64,
                adapter: chat,
                ..Request::default()
            },
            None,
            0.2,
        );
        assert_eq!(r.worker, b);
        assert_eq!(step.state(b).adapters, vec![chat.unwrap()]);
        // Without the slots modelled, the policy sees no adapter: the idle worker wins.
        step.track_adapters(None);
        assert!(step.state(a).adapters.is_empty());
        let r = step.route(
            Some(&mut index),
            &mut policy,
            &Request {
                block_hashes: &prompt(3000),
                prompt_tokens: 64,
                adapter: sql,
                ..Request::default()
            },
            None,
            0.3,
        );
        assert_eq!(r.worker, b);
    }
}
