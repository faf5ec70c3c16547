//! The cost model: how long one engine step takes, and the fixed front-end time of a request.
//!
//! A vLLM step runs one forward pass over a batch that mixes prefill chunks and decodes. On the
//! small models and short contexts of the reference experiment its time is close to linear in
//! the prefill tokens and in the number of decoding sequences:
//!
//! ```text
//! step_s = step_base_s + prefill_token_s * prefill_tokens + decode_seq_s * decode_seqs
//! ```
//!
//! A request also pays `frontend_s` once before it reaches the engine (HTTP, tokenization,
//! detokenizer start), which is why a fully cached prompt still sees tens of milliseconds of
//! TTFT. Each preset's docs say what it was calibrated against.

/// Linear step-time model; all times in seconds. Also carries the scheduler's limits, as
/// vLLM's `--max-num-batched-tokens` and `--max-num-seqs` go with the timing they produce.
#[derive(Clone, Debug, PartialEq)]
pub struct CostModel {
    /// The preset's name (`reference-gpu`, …), or any label.
    pub name: String,
    /// Fixed time of a step that runs anything.
    pub step_base_s: f64,
    /// Time per prefill token in the batch.
    pub prefill_token_s: f64,
    /// Time per decoding sequence in the batch.
    pub decode_seq_s: f64,
    /// Time before a request reaches the engine (HTTP, tokenization).
    pub frontend_s: f64,
    /// Token budget of one step (chunked prefill splits prompts over steps by it).
    pub max_num_batched_tokens: usize,
    /// At most this many requests run at once.
    pub max_num_seqs: usize,
}

/// A time scale that is not a positive number.
#[derive(Clone, Debug, PartialEq)]
pub struct BadTimeScale(pub f64);

impl std::fmt::Display for BadTimeScale {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "time scale must be positive, got {}", self.0)
    }
}

impl std::error::Error for BadTimeScale {}

/// vLLM's default `--max-num-batched-tokens` on the reference setup.
pub const DEFAULT_MAX_NUM_BATCHED_TOKENS: usize = 8192;
/// vLLM's default `--max-num-seqs`.
pub const DEFAULT_MAX_NUM_SEQS: usize = 256;

impl CostModel {
    /// A model with vLLM's default scheduler limits.
    pub fn new(
        name: &str,
        step_base_s: f64,
        prefill_token_s: f64,
        decode_seq_s: f64,
        frontend_s: f64,
    ) -> Self {
        Self {
            name: name.to_string(),
            step_base_s,
            prefill_token_s,
            decode_seq_s,
            frontend_s,
            max_num_batched_tokens: DEFAULT_MAX_NUM_BATCHED_TOKENS,
            max_num_seqs: DEFAULT_MAX_NUM_SEQS,
        }
    }

    /// Duration of a step with this batch; an empty step takes no time. The terms are summed
    /// in this order (base, prefill, decode) so results match the Python model bit for bit.
    pub fn step_time(&self, prefill_tokens: usize, decode_seqs: usize) -> f64 {
        if prefill_tokens == 0 && decode_seqs == 0 {
            return 0.0;
        }
        self.step_base_s
            + self.prefill_token_s * prefill_tokens as f64
            + self.decode_seq_s * decode_seqs as f64
    }

    /// The same model running `factor` times faster (the emulator's time scaling).
    pub fn scaled(&self, factor: f64) -> Result<Self, BadTimeScale> {
        if factor.is_nan() || factor <= 0.0 {
            return Err(BadTimeScale(factor));
        }
        Ok(Self {
            name: self.name.clone(),
            step_base_s: self.step_base_s / factor,
            prefill_token_s: self.prefill_token_s / factor,
            decode_seq_s: self.decode_seq_s / factor,
            frontend_s: self.frontend_s / factor,
            ..self.clone()
        })
    }

    /// `reference-gpu`: the reference experiment's Qwen3-0.6B on shared 8–24 GB GPUs, chosen
    /// so that the simulator at concurrency 4 on 6 workers gives TTFT p50 ≈ 40 ms on a hit
    /// (339 uncached tokens: 22.6 + 6 + 339·0.0334 ms) and ≈ 105–113 ms on a miss (2,371
    /// tokens), as measured there.
    pub fn reference_gpu() -> Self {
        Self::new("reference-gpu", 0.006, 0.0000334, 0.0002, 0.0226)
    }

    /// `cpu-tiny`: vLLM on a 2-core machine with the tiny Qwen3-style model: a hit of 451
    /// uncached tokens ≈ 30 + 5.5 + 451·0.185 ≈ 119 ms, a miss (2,371) ≈ 474 ms, one decoding
    /// stream 1 / (5.5 + 0.2) ms ≈ 175 tokens/s.
    pub fn cpu_tiny() -> Self {
        Self {
            max_num_batched_tokens: 4096,
            ..Self::new("cpu-tiny", 0.0055, 0.000185, 0.0002, 0.030)
        }
    }

    /// `instant`: every step takes zero time; for protocol tests and router soak runs.
    pub fn instant() -> Self {
        Self::new("instant", 0.0, 0.0, 0.0, 0.0)
    }

    /// Every preset, in the order they are listed to users.
    pub fn presets() -> Vec<Self> {
        vec![Self::reference_gpu(), Self::cpu_tiny(), Self::instant()]
    }

    /// The preset called `name`.
    pub fn preset(name: &str) -> Option<Self> {
        Self::presets().into_iter().find(|m| m.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reference_preset_gives_the_measured_hit_and_miss() {
        let m = CostModel::reference_gpu();
        let hit = m.frontend_s + m.step_time(339, 0);
        let miss = m.frontend_s + m.step_time(2371, 0);
        assert!((hit - 0.0399).abs() < 1e-3, "{hit}");
        assert!((miss - 0.1078).abs() < 1e-3, "{miss}");
        assert_eq!(m.step_time(0, 0), 0.0);
    }

    #[test]
    fn scaling_divides_times_and_keeps_limits() {
        let m = CostModel::cpu_tiny();
        let s = m.scaled(4.0).unwrap();
        assert_eq!(s.step_base_s, m.step_base_s / 4.0);
        assert_eq!(s.max_num_batched_tokens, 4096);
        assert!(m.scaled(0.0).is_err());
        assert!(m.scaled(f64::NAN).is_err());
    }

    #[test]
    fn presets_are_found_by_name() {
        assert_eq!(CostModel::preset("instant"), Some(CostModel::instant()));
        assert_eq!(CostModel::preset("nope"), None);
    }
}
