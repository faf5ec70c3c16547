//! The simulator and the native router route alike: one routing operation
//! (`kvroute_core::routing::Router`: the step, the policy, retention), and the router's glue
//! around it ([`Fleet`]: its candidates, its index built from the serve configuration, the
//! load it charges, the refreshes it sends, and the KV events as its consumer applies them)
//! adds nothing the simulator lacks.
//!
//! The simulator runs a workload with its routing step's journal on and an index (so the
//! router, which always has one, sees the same events); the journal (requests with their
//! time, first tokens, finishes, each worker's KV events) is then replayed through a
//! [`Fleet`] configured as `kvroute serve` configures it with KV events. Each batch of
//! events is encoded as vLLM publishes it (the core's codec), then decoded and applied to
//! the fleet's index as the native consumer (`kvroute_io::consumer`) does with every batch it
//! receives. The fleet must choose every request's worker and charge every prefill as the
//! simulator did, and end with the same per-worker state and the same index. With retention
//! on (serve's default, `kv-aware+retain-auto`), the simulator's placement is watched too
//! ([`Recorder`]: each request's tokens and output budget, and the refreshes each decision
//! and each finish called for, which the simulator sent to its engines), and the fleet, given
//! the same prompts, must send the same refreshes at the same moments.
//!
//! This is the native router's form of `tests/unit/test_routing_step.py`'s replay through the
//! aiohttp router's glue (`Router._choose`, `_Load`, the pool's event feed), which retires
//! with that router; the cases are that test's.

use std::collections::HashSet;
use std::sync::Arc;

use kvroute_core::blocks::{BlockHasher, DEFAULT_HASH_SEED};
use kvroute_core::index::KvIndex;
use kvroute_core::kvevents::codec::{self, WireFormat};
use kvroute_core::kvevents::events::{EventBatch, KvCacheEvent};
use kvroute_core::policies::{Choose, KvAwareConfig, Policy, PrefixHashConfig, WorkerState};
use kvroute_core::pyrandom::PyRandom;
use kvroute_core::retention::{Refresh, Retention, RetentionConfig, RetentionMode};
use kvroute_core::routing::{JournalEntry, Router, RoutingStep};
use kvroute_io::consumer::lock_index;
use kvroute_serve::fleet::Fleet;
use kvroute_serve::prompt::Retained;
use kvroute_serve::{EventSource, PolicySpec, ServeConfig, WorkerSpec};
use kvroute_sim::engine::cost::CostModel;
use kvroute_sim::hash_events::{HashEvents, trust_engine_hashes};
use kvroute_sim::sim::placement::{Placed, Placement, RouterPlacement};
use kvroute_sim::sim::{RequestSet, Simulation, WorkerConfig};

/// The reference experiment's fleet: 6 workers of 585 blocks of 16 tokens.
const WORKERS: usize = 6;
const NUM_BLOCKS: usize = 585;
const BLOCK_SIZE: usize = 16;
/// The reference workload's shapes (`kvroute.workload`'s defaults): a shared prefix of
/// 2,032 tokens (127 blocks), a unique 339-token suffix, 64 output tokens; ~3 prompts fit in
/// one worker's cache, so the workloads below evict and the events remove blocks too.
const PREFIX_TOKENS: usize = 2032;
const SUFFIX_TOKENS: usize = 339;
const OUTPUT_TOKENS: u32 = 64;
/// The token ids drawn (`kvroute.workload.DEFAULT_VOCAB`: clear of special tokens).
const VOCAB: std::ops::Range<u32> = 1000..30000;

/// One trial: the policy and its seed, the workload and the clients.
#[derive(Clone, Copy, Debug)]
struct Case {
    policy: &'static str,
    seed: u64,
    prefixes: usize,
    /// 0: every prefix equally often; else prefix ranked i drawn ∝ i^-α.
    zipf_alpha: f64,
    workload_seed: u64,
    concurrency: usize,
    /// Retention's mode (None: off).
    retention: Option<RetentionMode>,
}

impl Case {
    /// Measured requests: `kvroute.workload`'s default, max(200, 20·K).
    fn requests(&self) -> usize {
        (20 * self.prefixes).max(200)
    }
}

/// Prefixes, the warmup (one request per prefix) and the measured requests, deterministic
/// in the case's workload seed: `kvroute.workload.generate`'s shapes with the workspace's
/// seeded generator (`PyRandom`) instead of numpy's.
fn workload(case: &Case) -> (Vec<Arc<[u32]>>, RequestSet, RequestSet) {
    let mut rng = PyRandom::from_seed(case.workload_seed.into());
    let span = (VOCAB.end - VOCAB.start) as usize;
    let mut draw = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| VOCAB.start + rng.randrange(span) as u32)
            .collect()
    };
    let prefixes: Vec<Arc<[u32]>> = (0..case.prefixes)
        .map(|_| draw(PREFIX_TOKENS).into())
        .collect();
    let mut request_set = |ids: &[u32]| {
        let mut set = RequestSet {
            suffix_offsets: vec![0],
            ..RequestSet::default()
        };
        for &p in ids {
            set.prefix_ids.push(p);
            set.suffix_tokens.extend(draw(SUFFIX_TOKENS));
            set.suffix_offsets.push(set.suffix_tokens.len());
            set.output_tokens.push(OUTPUT_TOKENS);
        }
        set
    };
    let warmup_ids: Vec<u32> = (0..case.prefixes as u32).collect();
    let warmup = request_set(&warmup_ids);
    let mut order_rng = PyRandom::from_seed(i128::from(case.workload_seed) + 1);
    let n = case.requests();
    let mut order: Vec<u32> = if case.zipf_alpha == 0.0 {
        (0..n).map(|i| (i % case.prefixes) as u32).collect()
    } else {
        let mut cumulative = Vec::with_capacity(case.prefixes);
        let mut total = 0.0;
        for rank in 1..=case.prefixes {
            total += (rank as f64).powf(-case.zipf_alpha);
            cumulative.push(total);
        }
        (0..n)
            .map(|_| {
                let r = order_rng.random() * total;
                cumulative
                    .partition_point(|&c| c <= r)
                    .min(case.prefixes - 1) as u32
            })
            .collect()
    };
    for i in (1..order.len()).rev() {
        order.swap(i, order_rng.randrange(i + 1));
    }
    let measured = request_set(&order);
    (prefixes, warmup, measured)
}

/// What the simulator's placement was asked, and the refreshes it answered with.
#[derive(Clone, Debug, PartialEq)]
enum Recorded {
    /// A request was placed: its tokens, its output budget, the refreshes sent ahead of it.
    Placed {
        prompt: Vec<u32>,
        output_tokens: usize,
        refreshes: Vec<Refresh>,
    },
    /// A request finished: the refreshes of the worker it left idle.
    Finished { refreshes: Vec<Refresh> },
}

/// The simulator's placement, watched: each request and each finish is recorded with the
/// refreshes it called for, which are then handed on to the simulator as the placement would.
struct Recorder<'a> {
    inner: RouterPlacement<'a, Policy>,
    log: Vec<Recorded>,
    pending: Vec<Refresh>,
}

impl Recorder<'_> {
    /// The refreshes the inner placement produced since the last call, kept for the
    /// simulator too.
    fn new_refreshes(&mut self, now: f64) -> Vec<Refresh> {
        let mut out = Vec::new();
        self.inner.refreshes(now, &mut out);
        self.pending.extend(out.iter().cloned());
        out
    }
}

impl Placement for Recorder<'_> {
    fn wants_events(&self) -> bool {
        self.inner.wants_events()
    }

    fn place(&mut self, block_hashes: &[u64], prompt_tokens: usize, now: f64) -> Placed {
        self.inner.place(block_hashes, prompt_tokens, now)
    }

    fn place_request(
        &mut self,
        block_hashes: &[u64],
        prompt_head: &[u32],
        prompt_tail: &[u32],
        output_tokens: usize,
        adapter: Option<u64>,
        now: f64,
    ) -> Placed {
        let placed = self.inner.place_request(
            block_hashes,
            prompt_head,
            prompt_tail,
            output_tokens,
            adapter,
            now,
        );
        let refreshes = self.new_refreshes(now);
        self.log.push(Recorded::Placed {
            prompt: [prompt_head, prompt_tail].concat(),
            output_tokens,
            refreshes,
        });
        placed
    }

    fn first_token(&mut self, placed: Placed) {
        self.inner.first_token(placed);
    }

    fn finished(&mut self, placed: Placed, now: f64) {
        self.inner.finished(placed, now);
        let refreshes = self.new_refreshes(now);
        self.log.push(Recorded::Finished { refreshes });
    }

    fn apply_events(&mut self, worker: usize, events: &[KvCacheEvent], now: f64) {
        self.inner.apply_events(worker, events, now);
    }

    fn wants_hash_events(&self) -> bool {
        self.inner.wants_hash_events()
    }

    fn apply_hash_events(&mut self, worker: usize, events: &HashEvents, now: f64) {
        self.inner.apply_hash_events(worker, events, now);
    }

    fn refreshes(&mut self, _now: f64, out: &mut Vec<Refresh>) {
        out.append(&mut self.pending);
    }
}

/// What the simulator's routing step saw and where it ended.
struct Simulated {
    journal: Vec<JournalEntry>,
    /// The placement's requests and finishes, in order, with their refreshes.
    log: Vec<Recorded>,
    states: Vec<WorkerState>,
    index: KvIndex,
    names: Vec<String>,
}

/// The case's trial (warmup one at a time, then the measured requests from `concurrency`
/// closed-loop clients), routed by the simulator's step with an index fed by the engines'
/// events, its journal on.
fn simulate(case: &Case) -> Simulated {
    let hasher = BlockHasher::new(BLOCK_SIZE, DEFAULT_HASH_SEED).unwrap();
    let config = WorkerConfig {
        num_blocks: NUM_BLOCKS,
        cost: CostModel::reference_gpu(),
        hasher,
        enable_caching: true,
    };
    // `kvroute.sim`'s index: `KvIndex(hasher)` (predicted entries live 2 s, no per-worker
    // cap, no memory bound), taking the engine model's hashes as its own as `kvroute.sim`
    // does (the engines hash with the same hasher). The router's index does neither: the
    // same answers must come from its other path.
    let mut index = KvIndex::new(hasher, Some(2.0), None, None).unwrap();
    assert!(trust_engine_hashes(&mut index));
    let kv_aware = KvAwareConfig {
        block_size: BLOCK_SIZE,
        ..KvAwareConfig::default()
    };
    let policy = Policy::from_name(
        case.policy,
        PyRandom::from_seed(case.seed.into()),
        kv_aware,
        PrefixHashConfig::default(),
    )
    .unwrap();
    let names: Vec<String> = (0..WORKERS).map(|i| format!("worker-{i}")).collect();
    let mut step = RoutingStep::new(BLOCK_SIZE);
    if policy.needs_admission() {
        step.track_admission(Some(NUM_BLOCKS - 1));
    }
    for name in &names {
        step.add_worker(name);
    }
    step.set_journal(true);
    let (prefixes, warmup, measured) = workload(case);
    let output: Arc<[u32]> = (VOCAB.start..VOCAB.start + OUTPUT_TOKENS).collect();
    let retention = case
        .retention
        .map(|mode| Retention::new(RetentionConfig::new(mode, BLOCK_SIZE, NUM_BLOCKS - 1)));
    let mut router = Router::new(step, policy, retention);
    let log = {
        let mut placement = Recorder {
            inner: RouterPlacement::new(&mut router, Some(&mut index)),
            log: Vec::new(),
            pending: Vec::new(),
        };
        let mut sim = Simulation::new(WORKERS, config, &mut placement, prefixes, output);
        sim.run_closed_loop(&warmup, 1).unwrap();
        sim.run_closed_loop(&measured, case.concurrency).unwrap();
        drop(sim);
        placement.log
    };
    let states = (0..WORKERS)
        .map(|i| router.step().state(i).clone())
        .collect();
    Simulated {
        journal: router.step_mut().set_journal(false),
        log,
        states,
        index,
        names,
    }
}

/// One request's load on the fleet as the server's guard holds it (`server::RequestLoad`): its
/// prefill until the first byte, the request until it ends (its admission ticket, which
/// numbers requests as the simulator's step does).
struct Load {
    slot: usize,
    ticket: Option<u64>,
    prefill_tokens: Option<usize>,
}

/// A fleet built as `kvroute serve` builds it for these workers with KV events: predicted
/// entries live 2 s (the events replace them), no per-worker cap on them, the case's policy
/// and seed. Its hash seed is the simulator's (`DEFAULT_HASH_SEED`, what the Python face
/// passes; `ServeConfig::default()` has 0): the journal's prompt hashes are the simulator's,
/// while the fleet hashes the events' tokens itself, so both must be one chain.
fn serve_fleet(case: &Case, names: &[String]) -> Fleet {
    let workers = names
        .iter()
        .enumerate()
        .map(|(i, name)| WorkerSpec {
            url: format!("http://127.0.0.1:{}", 9000 + i),
            name: name.clone(),
            events: Some(EventSource {
                endpoint: format!("tcp://127.0.0.1:{}", 5557 + i),
                replay_endpoint: Some(format!("tcp://127.0.0.1:{}", 5657 + i)),
            }),
            ready: true,
        })
        .collect();
    let config = ServeConfig {
        workers,
        policy: PolicySpec {
            seed: Some(case.seed),
            ..PolicySpec::named(case.policy)
        },
        block_size: BLOCK_SIZE,
        hash_seed: DEFAULT_HASH_SEED,
        predicted_ttl_s: Some(2.0),
        predicted_capacity_blocks: None,
        kv_capacity_blocks: Some(NUM_BLOCKS - 1),
        retention_mode: case.retention.unwrap_or_default(),
        retention_capacity_blocks: NUM_BLOCKS - 1,
        health_interval: None,
        ..ServeConfig::default()
    };
    config.validate().unwrap();
    let (fleet, membership) = Fleet::new(&config).unwrap();
    assert_eq!(
        membership.follow.len(),
        WORKERS,
        "every worker's events followed"
    );
    fleet
}

/// Refreshes the fleet sent as the simulator did.
#[derive(Clone, Copy, Debug, Default)]
struct Sent {
    /// Ahead of a request.
    ahead: usize,
    /// To a worker fallen idle.
    idle: usize,
    /// Requests retention made room for (not the policy's choice).
    room: usize,
}

/// Replay the simulator's journal through a fleet; returns it, how many requests it routed
/// and the refreshes it sent. Panics at the first request routed, charged or refreshed
/// otherwise than the simulator did.
fn replay(case: &Case, sim: &Simulated) -> (Fleet, usize, Sent) {
    let mut fleet = serve_fleet(case, &sim.names);
    // The simulator's slot i is worker `names[i]`; the fleet's slots are its own.
    let slots: Vec<usize> = sim
        .names
        .iter()
        .map(|n| fleet.members().iter().find(|m| &m.name == n).unwrap().slot)
        .collect();
    let mut pending: Vec<Vec<Load>> = (0..WORKERS).map(|_| Vec::new()).collect();
    let (mut routed_count, mut batches) = (0, 0);
    let mut payload = Vec::new();
    let mut log = sim.log.iter();
    let mut sent = Sent::default();
    // A refresh as the fleet names its worker.
    let in_fleet = |refreshes: &[Refresh]| -> Vec<Refresh> {
        refreshes
            .iter()
            .map(|r| Refresh {
                worker: slots[r.worker],
                ..r.clone()
            })
            .collect()
    };
    for entry in &sim.journal {
        match entry {
            JournalEntry::Route {
                block_hashes,
                prompt_tokens,
                candidates,
                adapter,
                now,
                decision: routed,
            } => {
                // The simulator routes among every worker, except where retention made room.
                assert!(
                    candidates.is_none() || case.retention.is_some(),
                    "{candidates:?}"
                );
                assert_eq!(*adapter, None, "the cases run base-model requests");
                let Some(Recorded::Placed {
                    prompt,
                    output_tokens,
                    refreshes,
                }) = log.next()
                else {
                    panic!("request {routed_count}: the placement recorded no request");
                };
                assert_eq!(prompt.len(), *prompt_tokens);
                let retained = Retained {
                    ids: prompt.clone(),
                    output_tokens: *output_tokens,
                    model: None,
                    cache_salt: None,
                };
                let choice = fleet
                    .route(
                        block_hashes,
                        *prompt_tokens,
                        &[],
                        *now,
                        Some(&retained),
                        None,
                    )
                    .expect("every worker is available");
                assert_eq!(
                    (
                        choice.name.as_str(),
                        choice.decision.prefill_tokens,
                        choice.decision.overlap
                    ),
                    (
                        sim.names[routed.worker].as_str(),
                        routed.prefill_tokens,
                        routed.overlap
                    ),
                    "{case:?}: request {routed_count} at t={now}: the fleet's (worker, prefill, \
                     overlap), then the simulator's"
                );
                assert_eq!(choice.decision.worker, slots[routed.worker]);
                assert_eq!(choice.decision.ticket, routed.ticket);
                assert_eq!(
                    choice.refreshes,
                    in_fleet(refreshes),
                    "{case:?}: request {routed_count} at t={now}: the refreshes sent ahead of it"
                );
                sent.ahead += refreshes.len();
                sent.room += usize::from(candidates.is_some());
                pending[routed.worker].push(Load {
                    slot: choice.decision.worker,
                    ticket: choice.decision.ticket,
                    prefill_tokens: Some(choice.decision.prefill_tokens),
                });
                routed_count += 1;
            }
            JournalEntry::FirstToken {
                worker,
                prefill_tokens,
            } => {
                let load = pending[*worker]
                    .iter_mut()
                    .find(|l| l.prefill_tokens == Some(*prefill_tokens))
                    .expect("a first token of a request in prefill");
                let tokens = load.prefill_tokens.take().unwrap();
                fleet.first_token(load.slot, tokens);
            }
            JournalEntry::Finished {
                worker,
                ticket,
                now,
            } => {
                let at = pending[*worker]
                    .iter()
                    .position(|l| {
                        l.prefill_tokens.is_none() && (ticket.is_none() || l.ticket == *ticket)
                    })
                    .expect("a finish of a request past its first token");
                let load = pending[*worker].remove(at);
                let Some(Recorded::Finished { refreshes }) = log.next() else {
                    panic!("a finish at t={now}: the placement recorded none");
                };
                let idle = fleet.finished(load.slot, load.ticket, *now);
                assert_eq!(
                    idle.map(|i| i.refreshes).unwrap_or_default(),
                    in_fleet(refreshes),
                    "{case:?}: a finish on {worker} at t={now}: the refreshes of the idle worker"
                );
                sent.idle += refreshes.len();
            }
            JournalEntry::Events {
                worker,
                events,
                now,
            } => {
                // Both shapes vLLM has published in, alternately: the consumer takes either.
                let format = if batches % 2 == 0 {
                    WireFormat::Map
                } else {
                    WireFormat::Array
                };
                batches += 1;
                let batch = EventBatch {
                    ts: *now,
                    events: events.clone(),
                    data_parallel_rank: None,
                };
                payload.clear();
                codec::encode_batch_into(&mut payload, &batch, format);
                // The consumer's path for a received batch (`Sink::deliver`, then
                // `Sink::apply` under the index's lock): decode, then apply to the worker's
                // id in the shared index. Those two are private to the consumer's thread, so
                // the public calls they make are made here.
                let decoded = codec::decode_batch(&payload).expect("a batch vLLM would send");
                assert_eq!(decoded.unknown_events, 0);
                assert_eq!(&decoded.events, events, "the wire keeps every event");
                let mut index = lock_index(fleet.index());
                let id = index.ensure_worker(&sim.names[*worker]);
                index.apply_to(id, &decoded.events);
            }
        }
    }
    assert!(pending.iter().all(Vec::is_empty), "every request ended");
    assert_eq!(log.next(), None, "every request and finish replayed");
    (fleet, routed_count, sent)
}

/// Simulate `case`, replay it through a fleet, and compare where they ended.
fn check(case: Case) {
    let sim = simulate(&case);
    let routes: Vec<_> = sim
        .journal
        .iter()
        .filter_map(|e| match e {
            JournalEntry::Route {
                block_hashes,
                now,
                decision: routed,
                ..
            } => Some((block_hashes, *now, routed.worker)),
            _ => None,
        })
        .collect();
    assert_eq!(routes.len(), case.requests() + case.prefixes);
    let used: HashSet<usize> = routes.iter().map(|r| r.2).collect();
    assert_eq!(used.len(), WORKERS, "every worker took requests");
    let (fleet, routed, sent) = replay(&case, &sim);
    assert_eq!(routed, routes.len());
    if case.retention.is_some() {
        // Else the case would not show that both send the same refreshes.
        assert!(
            sent.ahead + sent.idle > 0 && sent.room > 0,
            "{case:?}: retention sent nothing: {sent:?}"
        );
    }
    let slots: Vec<usize> = sim
        .names
        .iter()
        .map(|n| fleet.members().iter().find(|m| &m.name == n).unwrap().slot)
        .collect();
    let states: Vec<WorkerState> = slots.iter().map(|&s| fleet.state(s).clone()).collect();
    assert_eq!(states, sim.states);
    assert!(
        sim.states
            .iter()
            .all(|s| s.in_flight == 0 && s.in_flight_tokens == 0),
        "nothing left in flight: {:?}",
        sim.states
    );
    for &slot in &slots {
        assert_eq!(fleet.load(slot), (0, 0));
    }
    let mut sim_index = sim.index;
    let mut index = lock_index(fleet.index());
    let stats = index.stats();
    assert_eq!(stats, sim_index.stats());
    assert!(stats.blocks > 0, "the events reached the index: {stats:?}");
    let (hashes, now, _) = routes.last().unwrap();
    let names: Vec<&str> = sim.names.iter().map(String::as_str).collect();
    let overlaps = index.overlaps(hashes, &names, *now);
    assert_eq!(overlaps, sim_index.overlaps(hashes, &names, *now));
}

#[test]
fn kv_aware_over_7_prefixes_routes_as_the_simulator_did() {
    check(Case {
        policy: "kv-aware",
        seed: 0,
        prefixes: 7,
        zipf_alpha: 0.0,
        workload_seed: 0,
        concurrency: 8,
        retention: None,
    });
}

#[test]
fn kv_aware_over_64_skewed_prefixes_routes_as_the_simulator_did() {
    check(Case {
        policy: "kv-aware",
        seed: 3,
        prefixes: 64,
        zipf_alpha: 1.2,
        workload_seed: 1,
        concurrency: 16,
        retention: None,
    });
}

#[test]
fn random_routes_as_the_simulator_did() {
    check(Case {
        policy: "random",
        seed: 5,
        prefixes: 7,
        zipf_alpha: 0.0,
        workload_seed: 2,
        concurrency: 8,
        retention: None,
    });
}

#[test]
fn prefix_hash_over_24_prefixes_routes_as_the_simulator_did() {
    check(Case {
        policy: "prefix-hash",
        seed: 1,
        prefixes: 24,
        zipf_alpha: 0.0,
        workload_seed: 0,
        concurrency: 8,
        retention: None,
    });
}

#[test]
fn least_loaded_over_12_prefixes_routes_as_the_simulator_did() {
    check(Case {
        policy: "least-loaded",
        seed: 2,
        prefixes: 12,
        zipf_alpha: 0.0,
        workload_seed: 3,
        concurrency: 16,
        retention: None,
    });
}

#[test]
fn kv_aware_retaining_auto_over_7_prefixes_routes_and_refreshes_as_the_simulator_did() {
    check(Case {
        policy: "kv-aware",
        seed: 0,
        prefixes: 7,
        zipf_alpha: 0.0,
        workload_seed: 0,
        concurrency: 8,
        retention: Some(RetentionMode::Auto),
    });
}

#[test]
fn kv_aware_retaining_auto_over_64_skewed_prefixes_routes_and_refreshes_as_the_simulator_did() {
    check(Case {
        policy: "kv-aware",
        seed: 3,
        prefixes: 64,
        zipf_alpha: 1.2,
        workload_seed: 1,
        concurrency: 16,
        retention: Some(RetentionMode::Auto),
    });
}

#[test]
fn kv_aware_retaining_on_over_24_prefixes_routes_and_refreshes_as_the_simulator_did() {
    check(Case {
        policy: "kv-aware",
        seed: 1,
        prefixes: 24,
        zipf_alpha: 0.0,
        workload_seed: 0,
        concurrency: 8,
        retention: Some(RetentionMode::On),
    });
}
