//! N router replicas behind a Service-like balancer, as the simulator's [`Placement`]: what
//! each replica's own view (and the replica mesh's lag) does to the fleet's cache hits.
//!
//! Each replica has its own routing step, index, policy and retention model. The balancer
//! sends each request to a replica drawn at random (seeded), as the Service in front of the
//! live replicas does. All replicas read the same KV events (the engines'). Without the mesh a
//! replica knows only its own decisions and refreshes; with it (`mesh_lag` given), every
//! decision, its first token and end, and every refresh reach the other replicas `mesh_lag`
//! seconds later and are applied there by the rule the live router follows
//! (`kvroute_core::routing::Router::apply_peer`), and each worker's retention is sent by one
//! replica only: its owner by rendezvous hashing over the replicas
//! (`kvroute_core::mesh::retention_owner`).
//!
//! A run ends with [`Placement::settle`]: the messages still in flight are applied, and the
//! balancer's draws start again from its seed, so that a trial's measured requests draw the
//! same replicas whatever its warmup.
//!
//! Deliveries due by a callback's time are applied at its start (a callback without a time,
//! the first token, uses the last time seen, which is at most one engine step old).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use kvroute_core::kvevents::events::KvCacheEvent;
use kvroute_core::mesh::retention_owner;
use kvroute_core::mesh::{DecisionHandle, PeerDecision};
use kvroute_core::policies::Choose;
use kvroute_core::pyrandom::PyRandom;
use kvroute_core::retention::Refresh;
use kvroute_core::routing::Request;

use crate::hash_events::HashEvents;

use super::placement::{Placed, Placement, RouterPlacement, joined_for};

/// A message on its way between replicas.
enum Delivery {
    Routed {
        decision: u64,
        worker: usize,
        block_hashes: Vec<u64>,
        prompt: Vec<u32>,
        output_tokens: usize,
        overlap: usize,
        adapter: Option<u64>,
    },
    FirstToken {
        decision: u64,
    },
    Finished {
        decision: u64,
    },
    Refreshed {
        worker: usize,
        block_hashes: Arc<[u64]>,
    },
}

/// N replicas behind a random balancer (see the module docs), each a router with its index.
pub struct ReplicaPlacement<'a, P> {
    replicas: Vec<RouterPlacement<'a, P>>,
    /// The mesh's delivery lag (None: no mesh).
    mesh_lag: Option<f64>,
    balancer: PyRandom,
    /// The balancer's seed: its draws start from it at each run.
    seed: u64,
    /// Messages in flight: when due, from which replica, what.
    queue: VecDeque<(f64, usize, Delivery)>,
    /// Per open decision: the replica that made it.
    origin: HashMap<u64, usize>,
    /// Per (replica, decision): the peer decision as that replica applied it.
    applied: HashMap<(usize, u64), DecisionHandle>,
    next_decision: u64,
    clock: f64,
    pending: Vec<Refresh>,
}

impl<'a, P: Choose> ReplicaPlacement<'a, P> {
    /// `replicas` (at least one, each with slots for the same `workers`, named alike) behind a
    /// balancer seeded with `seed`; `mesh_lag` the mesh's delivery lag in seconds (None: no
    /// mesh, each replica alone). Each replica's router owns the retention of every worker
    /// without the mesh (each alone, as live replicas without one), of the workers it is the
    /// owner of with it.
    pub fn new(
        mut replicas: Vec<RouterPlacement<'a, P>>,
        mesh_lag: Option<f64>,
        seed: u64,
    ) -> Self {
        assert!(!replicas.is_empty(), "at least one replica");
        let names: Vec<String> = (0..replicas.len())
            .map(|i| format!("replica-{i}"))
            .collect();
        let step = replicas[0].router.step();
        let owners: Vec<usize> = (0..step.slot_count())
            .map(|slot| {
                let worker = &step.state(slot).name;
                let owner =
                    retention_owner(worker, names.iter().map(String::as_str)).expect("a replica");
                names.iter().position(|n| n == owner).expect("one of them")
            })
            .collect();
        for (r, replica) in replicas.iter_mut().enumerate() {
            let owned = mesh_lag.map(|_| {
                (0..owners.len())
                    .filter(|&slot| owners[slot] == r)
                    .collect::<HashSet<usize>>()
            });
            replica.router.set_retention_owned(owned);
        }
        Self {
            replicas,
            mesh_lag,
            balancer: PyRandom::from_seed(i128::from(seed)),
            seed,
            queue: VecDeque::new(),
            origin: HashMap::new(),
            applied: HashMap::new(),
            next_decision: 0,
            clock: 0.0,
            pending: Vec::new(),
        }
    }

    /// Publish `delivery` from replica `from` at `now` (nothing without the mesh).
    fn publish(&mut self, from: usize, delivery: Delivery, now: f64) {
        if let Some(lag) = self.mesh_lag
            && self.replicas.len() > 1
        {
            self.queue.push_back((now + lag, from, delivery));
        }
    }

    /// Publish the refreshes replica `from` added to `pending` since `start`.
    fn publish_refreshes(&mut self, from: usize, start: usize, now: f64) {
        for i in start..self.pending.len() {
            let (worker, block_hashes) =
                (self.pending[i].worker, self.pending[i].block_hashes.clone());
            self.publish(
                from,
                Delivery::Refreshed {
                    worker,
                    block_hashes,
                },
                now,
            );
        }
    }

    /// Apply every delivery due by `now` to every replica but its sender.
    fn deliver(&mut self, now: f64) {
        self.clock = self.clock.max(now);
        while self.queue.front().is_some_and(|(due, _, _)| *due <= now) {
            let (due, from, delivery) = self.queue.pop_front().expect("checked");
            for to in (0..self.replicas.len()).filter(|&r| r != from) {
                self.apply(to, &delivery, due);
            }
        }
    }

    fn apply(&mut self, to: usize, delivery: &Delivery, now: f64) {
        let start = self.pending.len();
        let p = &mut self.replicas[to];
        match delivery {
            Delivery::Routed {
                decision,
                worker,
                block_hashes,
                prompt,
                output_tokens,
                overlap,
                adapter,
            } => {
                let candidates = p.router.step().live_slots().to_vec();
                let handle = p.router.apply_peer(
                    p.index.as_deref_mut(),
                    *worker,
                    &candidates,
                    &PeerDecision {
                        block_hashes,
                        prompt,
                        prompt_tokens: prompt.len(),
                        output_tokens: *output_tokens,
                        overlap: *overlap,
                        adapter: *adapter,
                    },
                    now,
                    &mut self.pending,
                );
                self.applied.insert((to, *decision), handle);
            }
            Delivery::FirstToken { decision } => {
                if let Some(h) = self.applied.get_mut(&(to, *decision)) {
                    p.router.peer_first_token(h);
                    h.first_token = true;
                }
            }
            Delivery::Finished { decision } => {
                if let Some(h) = self.applied.remove(&(to, *decision)) {
                    p.router.peer_finished(h, now);
                }
            }
            Delivery::Refreshed {
                worker,
                block_hashes,
            } => {
                p.router
                    .apply_peer_refresh(p.index.as_deref_mut(), *worker, block_hashes, now);
            }
        }
        // What the peer decision asked of this replica as its worker's owner goes out too.
        self.publish_refreshes(to, start, now);
    }
}

impl<P: Choose> Placement for ReplicaPlacement<'_, P> {
    fn wants_events(&self) -> bool {
        self.replicas.iter().any(|r| r.wants_events())
    }

    fn place(&mut self, block_hashes: &[u64], prompt_tokens: usize, now: f64) -> Placed {
        self.place_request(block_hashes, &[], &vec![0; prompt_tokens], 1, None, now)
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
        self.deliver(now);
        let n = self.replicas.len();
        let to = if n > 1 { self.balancer.randrange(n) } else { 0 };
        self.next_decision += 1;
        let serial = self.next_decision;
        let start = self.pending.len();
        let replica = &mut self.replicas[to];
        // The prompt's tokens travel (and are joined) only when retention needs them.
        let prompt = joined_for(replica.router, prompt_head, prompt_tail);
        let request = Request {
            block_hashes,
            prompt: &prompt,
            prompt_tokens: prompt_head.len() + prompt_tail.len(),
            output_tokens,
            adapter,
        };
        let r = replica.router.route(
            replica.index.as_deref_mut(),
            &request,
            None,
            now,
            &mut self.pending,
        );
        self.origin.insert(serial, to);
        self.publish_refreshes(to, start, now);
        self.publish(
            to,
            Delivery::Routed {
                decision: serial,
                worker: r.worker,
                block_hashes: block_hashes.to_vec(),
                prompt,
                output_tokens,
                overlap: r.overlap,
                adapter,
            },
            now,
        );
        Placed {
            decision: r,
            serial,
        }
    }

    fn first_token(&mut self, placed: Placed) {
        let now = self.clock;
        self.deliver(now);
        let Some(&r) = self.origin.get(&placed.serial) else {
            return;
        };
        self.replicas[r].first_token(placed);
        self.publish(
            r,
            Delivery::FirstToken {
                decision: placed.serial,
            },
            now,
        );
    }

    fn finished(&mut self, placed: Placed, now: f64) {
        self.deliver(now);
        let Some(r) = self.origin.remove(&placed.serial) else {
            return;
        };
        let start = self.pending.len();
        let replica = &mut self.replicas[r];
        replica.finished(placed, now);
        replica.refreshes(now, &mut self.pending);
        self.publish_refreshes(r, start, now);
        self.publish(
            r,
            Delivery::Finished {
                decision: placed.serial,
            },
            now,
        );
    }

    fn apply_events(&mut self, worker: usize, events: &[KvCacheEvent], now: f64) {
        self.deliver(now);
        for r in &mut self.replicas {
            r.apply_events(worker, events, now);
        }
    }

    fn wants_hash_events(&self) -> bool {
        self.replicas.iter().all(|r| r.wants_hash_events())
    }

    fn apply_hash_events(&mut self, worker: usize, events: &HashEvents, now: f64) {
        self.deliver(now);
        for r in &mut self.replicas {
            r.apply_hash_events(worker, events, now);
        }
    }

    fn refreshes(&mut self, now: f64, out: &mut Vec<Refresh>) {
        self.deliver(now);
        out.append(&mut self.pending);
    }

    fn settle(&mut self) {
        let clock = self.clock;
        self.deliver(f64::INFINITY);
        self.clock = clock;
        self.pending.clear();
        self.balancer = PyRandom::from_seed(i128::from(self.seed));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cost::CostModel;
    use crate::sim::{RequestSet, Trial, TrialResult, WorkerConfig};
    use kvroute_core::blocks::{BlockHasher, DEFAULT_HASH_SEED};
    use kvroute_core::index::KvIndex;
    use kvroute_core::policies::{KvAware, KvAwareConfig, Policy};
    use kvroute_core::retention::{Retention, RetentionConfig, RetentionMode};
    use kvroute_core::routing::{Router, RoutingStep};

    const BS: usize = 16;
    const WORKERS: usize = 6;
    const BLOCKS: usize = 200;

    /// 24 prefixes of 480 tokens on 6 workers that hold ~6 prefixes' worth each, 480 requests
    /// from 16 clients: where each prefix lives matters, and so does knowing it before the
    /// worker's events say so.
    fn trial() -> Trial {
        let hasher = BlockHasher::new(BS, DEFAULT_HASH_SEED).unwrap();
        let prefixes: Vec<Arc<[u32]>> = (0..24u32)
            .map(|p| (0..480).map(|i| 1000 + p * 1000 + i).collect())
            .collect();
        let mut rng = PyRandom::from_seed(7);
        let set = |ids: Vec<u32>, first: u32| {
            let mut s = RequestSet {
                suffix_offsets: vec![0],
                ..RequestSet::default()
            };
            for (j, id) in ids.into_iter().enumerate() {
                s.prefix_ids.push(id);
                let base = 100_000 + (first + j as u32) * 40;
                s.suffix_tokens.extend(base..base + 24);
                s.suffix_offsets.push(s.suffix_tokens.len());
                s.output_tokens.push(8);
            }
            s
        };
        let measured: Vec<u32> = (0..480).map(|_| rng.randrange(24) as u32).collect();
        Trial {
            workers: WORKERS,
            config: WorkerConfig {
                num_blocks: BLOCKS,
                cost: CostModel::new("test", 0.004, 0.000_05, 0.000_2, 0.001),
                hasher,
                enable_caching: true,
            },
            prefixes,
            output: (0..64).collect(),
            warmup: set((0..24).collect(), 0),
            measured: set(measured, 24),
            concurrency: 16,
        }
    }

    /// Each replica's own router (step, kv-aware policy, optionally retention) and index.
    struct Parts {
        routers: Vec<Router>,
        indexes: Vec<KvIndex>,
    }

    fn parts(n: usize, retention: bool) -> Parts {
        let hasher = BlockHasher::new(BS, DEFAULT_HASH_SEED).unwrap();
        let mut p = Parts {
            routers: vec![],
            indexes: vec![],
        };
        for r in 0..n {
            let mut step = RoutingStep::new(BS);
            for w in 0..WORKERS {
                step.add_worker(&format!("worker-{w}"));
            }
            let policy = Policy::KvAware(Box::new(
                KvAware::new(KvAwareConfig::default(), PyRandom::from_seed(r as i128)).unwrap(),
            ));
            let retention = retention
                .then(|| Retention::new(RetentionConfig::new(RetentionMode::On, BS, BLOCKS - 1)));
            p.routers.push(Router::new(step, policy, retention));
            let mut index = KvIndex::new(hasher, Some(2.0), None, None).unwrap();
            crate::hash_events::trust_engine_hashes(&mut index);
            p.indexes.push(index);
        }
        p
    }

    fn run(n: usize, mesh_lag: Option<f64>, retention: bool, seed: u64) -> TrialResult {
        let mut p = parts(n, retention);
        let replicas = p
            .routers
            .iter_mut()
            .zip(&mut p.indexes)
            .map(|(router, index)| RouterPlacement::new(router, Some(index)))
            .collect();
        let mut placement = ReplicaPlacement::new(replicas, mesh_lag, seed);
        let result = trial().run(&mut placement).unwrap();
        placement.settle();
        drop(placement);
        for router in &p.routers {
            for w in 0..WORKERS {
                let s = router.step().state(w);
                assert_eq!(s.in_flight, 0, "every replica's load returns to zero");
                assert_eq!(s.in_flight_tokens, 0);
            }
        }
        result
    }

    fn hit_rate(r: &TrialResult) -> f64 {
        let cached: usize = r.records.iter().map(|x| x.cached_tokens).sum();
        let prompt: usize = r.records.iter().map(|x| x.prompt_tokens).sum();
        cached as f64 / prompt as f64
    }

    /// The mean hit rate over 8 balancer seeds.
    fn mean_hit_rate(n: usize, mesh_lag: Option<f64>, retention: bool) -> f64 {
        (0..8)
            .map(|seed| hit_rate(&run(n, mesh_lag, retention, seed)))
            .sum::<f64>()
            / 8.0
    }

    #[test]
    fn one_replica_is_todays_placement_exactly() {
        for retention in [false, true] {
            let mut p = parts(1, retention);
            let mut placement = RouterPlacement::new(&mut p.routers[0], Some(&mut p.indexes[0]));
            let today = trial().run(&mut placement).unwrap();
            for mesh in [None, Some(0.001)] {
                assert_eq!(run(1, mesh, retention, 3), today, "retention {retention}");
            }
        }
    }

    #[test]
    fn replicas_without_the_mesh_lose_hits_and_the_mesh_wins_them_back() {
        for retention in [false, true] {
            let one = mean_hit_rate(1, None, retention);
            let alone = mean_hit_rate(3, None, retention);
            let meshed = mean_hit_rate(3, Some(0.001), retention);
            assert!(
                alone < one - 0.005,
                "retention {retention}: 3 replicas alone {alone:.3} vs one {one:.3}"
            );
            assert!(
                meshed > alone + 0.005 && (one - meshed).abs() < one - alone,
                "retention {retention}: meshed {meshed:.3}, alone {alone:.3}, one {one:.3}"
            );
        }
    }
}
