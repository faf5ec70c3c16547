//! numpy's `np.random.default_rng(seed)` (a `SeedSequence` seeding `PCG64`) and the few
//! `Generator` draws `kvroute.workload.generate` makes, value for value, so that the engine
//! goldens' workloads are rebuilt from their seeds here, without Python.
//!
//! Follows numpy's `_seed_sequence.pyx`, `pcg64.h` and `distributions.c`: the 32-bit draws
//! take the low then the high half of one 64-bit output, and a bounded draw below 2³² is
//! Lemire's multiply-and-reject on them whatever the integer dtype.

const MULT_A: u32 = 0x931e_8875;
const INIT_A: u32 = 0x43b0_d7e5;
const MULT_B: u32 = 0x58f3_8ded;
const INIT_B: u32 = 0x8b51_f9dd;
const MIX_MULT_L: u32 = 0xca01_f9dd;
const MIX_MULT_R: u32 = 0x4973_f715;
const POOL_SIZE: usize = 4;
const PCG_MULT: u128 = 0x2360_ED05_1FC6_5DA4_4385_DF64_9FCC_F645;

/// `SeedSequence(seed).generate_state(words)`, for a seed below 2³².
fn seed_sequence_state(seed: u32, words: usize) -> Vec<u32> {
    let mut hash_const = INIT_A;
    let mut hashmix = |value: u32| {
        let mut v = value ^ hash_const;
        hash_const = hash_const.wrapping_mul(MULT_A);
        v = v.wrapping_mul(hash_const);
        v ^ (v >> 16)
    };
    let mix = |x: u32, y: u32| {
        let r = MIX_MULT_L
            .wrapping_mul(x)
            .wrapping_sub(MIX_MULT_R.wrapping_mul(y));
        r ^ (r >> 16)
    };
    let mut pool = [0u32; POOL_SIZE];
    for (i, slot) in pool.iter_mut().enumerate() {
        *slot = hashmix(if i == 0 { seed } else { 0 });
    }
    for src in 0..POOL_SIZE {
        for dst in 0..POOL_SIZE {
            if src != dst {
                let h = hashmix(pool[src]);
                pool[dst] = mix(pool[dst], h);
            }
        }
    }
    let mut hash_const = INIT_B;
    (0..words)
        .map(|i| {
            let mut v = pool[i % POOL_SIZE] ^ hash_const;
            hash_const = hash_const.wrapping_mul(MULT_B);
            v = v.wrapping_mul(hash_const);
            v ^ (v >> 16)
        })
        .collect()
}

/// `np.random.default_rng(seed)`: PCG64 (XSL-RR) with numpy's buffered 32-bit draws.
pub struct Generator {
    state: u128,
    inc: u128,
    /// The high half of the last 64-bit output, when a 32-bit draw took only its low half.
    spare: Option<u32>,
}

impl Generator {
    pub fn new(seed: u32) -> Self {
        let w = seed_sequence_state(seed, 8);
        let word = |i: usize| u128::from(w[2 * i]) | (u128::from(w[2 * i + 1]) << 32);
        let init_state = (word(0) << 64) | word(1);
        let init_seq = (word(2) << 64) | word(3);
        let mut g = Self {
            state: 0,
            inc: (init_seq << 1) | 1,
            spare: None,
        };
        g.advance();
        g.state = g.state.wrapping_add(init_state);
        g.advance();
        g
    }

    fn advance(&mut self) {
        self.state = self.state.wrapping_mul(PCG_MULT).wrapping_add(self.inc);
    }

    fn next_u64(&mut self) -> u64 {
        self.advance();
        let s = self.state;
        (((s >> 64) as u64) ^ (s as u64)).rotate_right((s >> 122) as u32)
    }

    fn next_u32(&mut self) -> u32 {
        if let Some(high) = self.spare.take() {
            return high;
        }
        let v = self.next_u64();
        self.spare = Some((v >> 32) as u32);
        v as u32
    }

    /// `random()`: uniform in [0, 1) from 53 bits.
    pub fn random(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / 9_007_199_254_740_992.0)
    }

    /// `integers(low, high + 1)`: uniform in `[low, high]`, a span below 2³² - 1.
    pub fn integers(&mut self, low: u64, high: u64) -> u64 {
        let span = u32::try_from(high - low).expect("a 32-bit span");
        assert!(span < u32::MAX, "the full 32-bit span takes another path");
        if span == 0 {
            return low;
        }
        let excl = u64::from(span) + 1;
        let mut m = u64::from(self.next_u32()) * excl;
        if (m as u32 as u64) < excl {
            let threshold = u64::from((u32::MAX - span) % (span + 1));
            while (m as u32 as u64) < threshold {
                m = u64::from(self.next_u32()) * excl;
            }
        }
        low + (m >> 32)
    }

    /// `shuffle(x)`: Fisher-Yates from the back, each index by masked rejection.
    pub fn shuffle<T>(&mut self, x: &mut [T]) {
        for i in (1..x.len()).rev() {
            let j = self.interval(i as u64);
            x.swap(i, j as usize);
        }
    }

    /// numpy's `random_interval(max)`: uniform in `[0, max]`.
    fn interval(&mut self, max: u64) -> u64 {
        let max = u32::try_from(max).expect("a 32-bit bound");
        let mask = u32::MAX >> max.leading_zeros();
        loop {
            let v = self.next_u32() & mask;
            if v <= max {
                return u64::from(v);
            }
        }
    }

    /// `choice(len(p), size=n, p=p)`: `n` indices drawn by the weights `p`.
    pub fn choice(&mut self, p: &[f64], n: usize) -> Vec<usize> {
        let mut cdf: Vec<f64> = p
            .iter()
            .scan(0.0, |acc, &x| {
                *acc += x;
                Some(*acc)
            })
            .collect();
        let last = *cdf.last().expect("weights");
        for c in &mut cdf {
            *c /= last;
        }
        let uniforms: Vec<f64> = (0..n).map(|_| self.random()).collect();
        uniforms
            .into_iter()
            .map(|u| cdf.partition_point(|&c| c <= u))
            .collect()
    }
}

/// `np.sum` of at most 128 floats: numpy's pairwise summation (eight partial sums).
pub fn sum(a: &[f64]) -> f64 {
    if a.len() < 8 {
        return a.iter().fold(0.0, |acc, &x| acc + x);
    }
    assert!(a.len() <= 128, "longer arrays split in halves first");
    let mut r = [0.0; 8];
    r.copy_from_slice(&a[..8]);
    let whole = a.len() - a.len() % 8;
    for chunk in a[8..whole].chunks_exact(8) {
        for (acc, &x) in r.iter_mut().zip(chunk) {
            *acc += x;
        }
    }
    let mut res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for &x in &a[whole..] {
        res += x;
    }
    res
}
