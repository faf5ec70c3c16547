//! CPython's `random.Random`, draw for draw.
//!
//! The policies' random choices (random, least-loaded ties, kv-aware's sub-block ties) must be
//! the ones the Python implementation made from the same seed: recorded experiments, the
//! simulator's tables and `kvroute experiment`'s reseeded Service balancer all rely on a
//! seed naming one sequence of choices. CPython's generator is MT19937 seeded by
//! `init_by_array` over the seed's 32-bit words; its integer draws reject from `getrandbits`
//! and its floats combine two words into 53 bits. This module reproduces exactly those
//! functions (`Modules/_randommodule.c` and `Lib/random.py`), nothing more.

const N: usize = 624;
const M: usize = 397;
const MATRIX_A: u32 = 0x9908_b0df;
const UPPER_MASK: u32 = 0x8000_0000;
const LOWER_MASK: u32 = 0x7fff_ffff;

/// A Mersenne Twister in CPython's `random.Random` configuration.
#[derive(Clone)]
pub struct PyRandom {
    state: [u32; N],
    index: usize,
}

impl std::fmt::Debug for PyRandom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PyRandom")
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

/// A `getstate()` tuple that is not one of MT19937 (wrong length or position).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadState;

impl std::fmt::Display for BadState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("not a random.Random state: expected 624 words and a position <= 624")
    }
}

impl std::error::Error for BadState {}

impl PyRandom {
    /// `random.Random(seed)` for an integer seed (its absolute value is used, as CPython
    /// does).
    pub fn from_seed(seed: i128) -> Self {
        let mut n = seed.unsigned_abs();
        let mut key = Vec::with_capacity(4);
        while n != 0 {
            key.push(n as u32);
            n >>= 32;
        }
        if key.is_empty() {
            key.push(0);
        }
        Self::from_key(&key)
    }

    /// `random.Random(seed)` for a seed given as its absolute value's 32-bit words, least
    /// significant first (any size of integer; an empty key is the seed 0).
    pub fn from_key(key: &[u32]) -> Self {
        let mut r = Self {
            state: [0; N],
            index: N,
        };
        r.init_genrand(19_650_218);
        let key: &[u32] = if key.is_empty() { &[0] } else { key };
        let mut i = 1usize;
        let mut j = 0usize;
        let mt = &mut r.state;
        for _ in 0..N.max(key.len()) {
            mt[i] = (mt[i] ^ (mt[i - 1] ^ (mt[i - 1] >> 30)).wrapping_mul(1_664_525))
                .wrapping_add(key[j])
                .wrapping_add(j as u32);
            i += 1;
            j += 1;
            if i >= N {
                mt[0] = mt[N - 1];
                i = 1;
            }
            if j >= key.len() {
                j = 0;
            }
        }
        for _ in 0..N - 1 {
            mt[i] = (mt[i] ^ (mt[i - 1] ^ (mt[i - 1] >> 30)).wrapping_mul(1_566_083_941))
                .wrapping_sub(i as u32);
            i += 1;
            if i >= N {
                mt[0] = mt[N - 1];
                i = 1;
            }
        }
        mt[0] = 0x8000_0000;
        r
    }

    /// The generator a Python `random.Random` is in: `getstate()[1]` is 624 words and the
    /// position (the 625th item).
    pub fn from_state(words: &[u32], index: usize) -> Result<Self, BadState> {
        if words.len() != N || index > N {
            return Err(BadState);
        }
        let mut state = [0; N];
        state.copy_from_slice(words);
        Ok(Self { state, index })
    }

    /// The state as `getstate()[1]` has it (624 words, then the position).
    pub fn state(&self) -> (Vec<u32>, usize) {
        (self.state.to_vec(), self.index)
    }

    fn init_genrand(&mut self, s: u32) {
        let mt = &mut self.state;
        mt[0] = s;
        for i in 1..N {
            mt[i] = 1_812_433_253u32
                .wrapping_mul(mt[i - 1] ^ (mt[i - 1] >> 30))
                .wrapping_add(i as u32);
        }
        self.index = N;
    }

    /// The next 32 random bits (`genrand_uint32`).
    pub fn next_u32(&mut self) -> u32 {
        if self.index >= N {
            let mt = &mut self.state;
            let mag = |y: u32| if y & 1 == 1 { MATRIX_A } else { 0 };
            for kk in 0..N - M {
                let y = (mt[kk] & UPPER_MASK) | (mt[kk + 1] & LOWER_MASK);
                mt[kk] = mt[kk + M] ^ (y >> 1) ^ mag(y);
            }
            for kk in N - M..N - 1 {
                let y = (mt[kk] & UPPER_MASK) | (mt[kk + 1] & LOWER_MASK);
                mt[kk] = mt[kk + M - N] ^ (y >> 1) ^ mag(y);
            }
            let y = (mt[N - 1] & UPPER_MASK) | (mt[0] & LOWER_MASK);
            mt[N - 1] = mt[M - 1] ^ (y >> 1) ^ mag(y);
            self.index = 0;
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// `random()`: a float in [0, 1) with 53 random bits.
    pub fn random(&mut self) -> f64 {
        let a = (self.next_u32() >> 5) as f64;
        let b = (self.next_u32() >> 6) as f64;
        (a * 67_108_864.0 + b) * (1.0 / 9_007_199_254_740_992.0)
    }

    /// `getrandbits(k)` for `k <= 64`: words are drawn least significant first, the last one
    /// cut to the bits still wanted.
    pub fn getrandbits(&mut self, k: u32) -> u64 {
        assert!(k <= 64, "getrandbits beyond 64 bits is not needed here");
        if k == 0 {
            return 0;
        }
        if k <= 32 {
            return (self.next_u32() >> (32 - k)) as u64;
        }
        let low = self.next_u32() as u64;
        let high = (self.next_u32() >> (64 - k)) as u64;
        low | (high << 32)
    }

    /// `_randbelow(n)`: uniform in `[0, n)` by rejection, `n >= 1` (draws even for n = 1, as
    /// CPython does).
    pub fn randbelow(&mut self, n: u64) -> u64 {
        assert!(n >= 1, "randbelow needs n >= 1");
        let k = 64 - n.leading_zeros();
        loop {
            let r = self.getrandbits(k);
            if r < n {
                return r;
            }
        }
    }

    /// `randrange(n)`.
    pub fn randrange(&mut self, n: usize) -> usize {
        self.randbelow(n as u64) as usize
    }

    /// `choice(seq)`: one item of a non-empty slice.
    pub fn choice<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.randrange(items.len())]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Recorded from CPython 3.11: random.Random(s) and the draws named.
    #[test]
    fn draws_equal_cpythons() {
        let mut r = PyRandom::from_seed(12345);
        assert_eq!(
            [r.getrandbits(32), r.getrandbits(32), r.getrandbits(32)],
            [1_789_368_711, 3_146_859_322, 43_676_229]
        );
        assert_eq!(r.random(), 0.8201747225612886);
        assert_eq!(r.randrange(7), 6);
        assert_eq!(r.randrange(100), 38);
        assert_eq!(PyRandom::from_seed(-5).random(), 0.6229016948897019);
        assert_eq!(
            PyRandom::from_seed((1 << 70) + 3).random(),
            0.16339507200642456
        );
        assert_eq!(PyRandom::from_seed(0).random(), 0.8444218515250481);
    }

    #[test]
    fn state_round_trips() {
        let mut a = PyRandom::from_seed(7);
        a.random();
        let (words, index) = a.state();
        let mut b = PyRandom::from_state(&words, index).unwrap();
        assert_eq!(a.random(), b.random());
        assert!(PyRandom::from_state(&words[1..], 0).is_err());
    }
}
