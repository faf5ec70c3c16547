//! How fast is the simulator's event loop? One trial of the reference shapes (2,032-token
//! prefixes, 339-token suffixes, 64 output tokens, 585 blocks of 16 tokens, reference-gpu
//! timing, prefixes in a shuffled order) with a round-robin placement; prints the wall time and µs per request.
//! The goal: 1,000,000 requests × 64 workers × K = 256 × c = 512 in < 10 s.
//!
//!     cargo run --release -p kvroute-core --example sim_speed [REQUESTS] [WORKERS] [K] [C]

use std::sync::Arc;
use std::time::Instant;

use kvroute_core::blocks::{BlockHasher, DEFAULT_HASH_SEED};
use kvroute_core::kvevents::events::KvCacheEvent;
use kvroute_core::routing::Decision;
use kvroute_sim::engine::cost::CostModel;
use kvroute_sim::sim::placement::{Placed, Placement};
use kvroute_sim::sim::{RequestSet, Trial, WorkerConfig};

/// Cycle through workers (the round-robin policy, without the routing step around it).
struct RoundRobin {
    workers: usize,
    next: usize,
}

impl Placement for RoundRobin {
    fn wants_events(&self) -> bool {
        false
    }
    fn place(&mut self, _hashes: &[u64], prompt_tokens: usize, _now: f64) -> Placed {
        let worker = self.next % self.workers;
        self.next = worker + 1;
        Placed::new(Decision {
            worker,
            overlap: 0,
            prefill_tokens: prompt_tokens.max(1),
            ticket: None,
        })
    }
    fn first_token(&mut self, _placed: Placed) {}
    fn finished(&mut self, _placed: Placed, _now: f64) {}
    fn apply_events(&mut self, _worker: usize, _events: &[KvCacheEvent], _now: f64) {}
}

/// xorshift64*: tokens and prefix draws, seeded.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn token(&mut self) -> u32 {
        1000 + (self.next() % 29000) as u32
    }
}

fn requests(rng: &mut Rng, prefix_ids: impl Iterator<Item = u32>, suffix: usize) -> RequestSet {
    let mut set = RequestSet {
        suffix_offsets: vec![0],
        ..RequestSet::default()
    };
    for pid in prefix_ids {
        set.prefix_ids.push(pid);
        set.suffix_tokens.extend((0..suffix).map(|_| rng.token()));
        set.suffix_offsets.push(set.suffix_tokens.len());
        set.output_tokens.push(64);
    }
    set
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("a number"))
        .collect();
    let n = args.first().copied().unwrap_or(1_000_000);
    let workers = args.get(1).copied().unwrap_or(64);
    let k = args.get(2).copied().unwrap_or(256);
    let c = args.get(3).copied().unwrap_or(512);
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let prefixes: Vec<Arc<[u32]>> = (0..k)
        .map(|_| (0..2032).map(|_| rng.token()).collect())
        .collect();
    let warmup = requests(&mut rng, 0..k as u32, 339);
    // Each prefix equally often, in a seeded shuffled order (as kvroute.workload does).
    let mut order: Vec<u32> = (0..n).map(|i| (i % k) as u32).collect();
    for i in (1..n).rev() {
        order.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    let measured = requests(&mut rng, order.into_iter(), 339);
    let trial = Trial {
        workers,
        config: WorkerConfig {
            num_blocks: 585,
            cost: CostModel::reference_gpu(),
            hasher: BlockHasher::new(16, DEFAULT_HASH_SEED).expect("block size"),
            enable_caching: true,
        },
        prefixes,
        output: (1000..1064).collect(),
        warmup,
        measured,
        concurrency: c,
    };
    let started = Instant::now();
    let result = trial
        .run(&mut RoundRobin { workers, next: 0 })
        .expect("the trial runs");
    let wall = started.elapsed().as_secs_f64();
    let hits = result
        .records
        .iter()
        .filter(|r| r.cached_tokens > 0)
        .count();
    println!(
        "{n} requests × {workers} workers × K={k} × c={c} (round-robin): {wall:.2} s wall, \
         {:.2} µs per request; {:.1} s simulated, request hit rate {:.3}",
        1e6 * wall / (n + k) as f64,
        result.duration_s,
        hits as f64 / n as f64
    );
}
