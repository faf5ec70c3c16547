//! `kvroute.workload.generate` for what the engine goldens' scenarios use (fixed or uniform
//! lengths, uniform or Zipf popularity, the default vocabulary): the same prefixes, suffixes
//! and order from the same seed, drawn in the same sequence from numpy's generator.

use crate::numpy_random::{self, Generator};

/// The default vocabulary: token ids `1000..30000`.
const VOCAB_FIRST: u32 = 1000;
pub const VOCAB_LEN: u32 = 29_000;

/// A length, fixed (`"2032"`) or uniform over an inclusive range (`"300:600"`).
#[derive(Clone, Copy, Debug)]
pub struct LengthDist {
    low: u64,
    high: u64,
}

impl LengthDist {
    pub fn parse(text: &str) -> Self {
        let num = |s: &str| s.parse::<u64>().expect("a length");
        match text.split_once(':') {
            Some((low, high)) => Self {
                low: num(low),
                high: num(high),
            },
            None => Self {
                low: num(text),
                high: num(text),
            },
        }
    }

    fn sample(self, rng: &mut Generator, n: usize) -> Vec<usize> {
        if self.low == self.high {
            return vec![self.low as usize; n];
        }
        (0..n)
            .map(|_| rng.integers(self.low, self.high) as usize)
            .collect()
    }
}

pub struct WorkloadSpec {
    pub prefixes: usize,
    pub prefix_tokens: LengthDist,
    pub suffix_tokens: LengthDist,
    pub requests: usize,
    pub zipf_alpha: f64,
    pub seed: u32,
}

/// One request: a shared prefix (by id) and its own suffix.
pub struct RequestSpec {
    pub prefix_id: usize,
    pub suffix: Vec<u32>,
}

pub struct Workload {
    pub prefixes: Vec<Vec<u32>>,
    /// One request per prefix, in prefix order.
    pub warmup: Vec<RequestSpec>,
    pub requests: Vec<RequestSpec>,
}

impl Workload {
    pub fn prompt(&self, r: &RequestSpec) -> Vec<u32> {
        [&self.prefixes[r.prefix_id][..], &r.suffix[..]].concat()
    }
}

fn tokens(rng: &mut Generator, n: usize) -> Vec<u32> {
    (0..n)
        .map(|_| VOCAB_FIRST + rng.integers(0, u64::from(VOCAB_LEN) - 1) as u32)
        .collect()
}

/// The prefix of each measured request: each equally often (the first `n mod k` once more),
/// or drawn by Zipf popularity; then shuffled.
fn prefix_order(spec: &WorkloadSpec, rng: &mut Generator) -> Vec<usize> {
    let (n, k) = (spec.requests, spec.prefixes);
    let mut order = if spec.zipf_alpha == 0.0 {
        (0..n).map(|i| i % k).collect()
    } else {
        let w: Vec<f64> = (1..=k).map(|i| (i as f64).powf(-spec.zipf_alpha)).collect();
        let total = numpy_random::sum(&w);
        let p: Vec<f64> = w.iter().map(|x| x / total).collect();
        rng.choice(&p, n)
    };
    rng.shuffle(&mut order);
    order
}

pub fn generate(spec: &WorkloadSpec) -> Workload {
    let mut rng = Generator::new(spec.seed);
    let prefix_lens = spec.prefix_tokens.sample(&mut rng, spec.prefixes);
    let prefixes: Vec<Vec<u32>> = prefix_lens.iter().map(|&n| tokens(&mut rng, n)).collect();
    let order = prefix_order(spec, &mut rng);
    let prefix_ids: Vec<usize> = (0..spec.prefixes).chain(order).collect();
    let suffix_lens = spec.suffix_tokens.sample(&mut rng, prefix_ids.len());
    let mut all = prefix_ids
        .into_iter()
        .zip(suffix_lens)
        .map(|(prefix_id, len)| RequestSpec {
            prefix_id,
            suffix: tokens(&mut rng, len),
        });
    let warmup = all.by_ref().take(spec.prefixes).collect();
    let requests = all.collect();
    Workload {
        prefixes,
        warmup,
        requests,
    }
}
