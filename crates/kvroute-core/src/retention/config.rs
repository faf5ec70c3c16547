//! Retention's configuration: the mode (when the router refreshes prefixes) and its knobs.

/// When the router refreshes prefixes (by name in a configuration: `off`, `on`, `auto`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RetentionMode {
    /// Never (the router only places requests).
    #[default]
    Off,
    /// Refresh a retained prefix as soon as the model puts it near eviction.
    On,
    /// As `On`, but only when the worker has slack, the refresh pays for itself, and the
    /// refreshes sent measurably saved prefills (see the module docs).
    Auto,
}

impl RetentionMode {
    /// Every mode, in the order the CLI lists them (the one list of names: the Python side
    /// takes it as `kvroute._native.RETENTION_MODES`).
    pub const ALL: [Self; 3] = [Self::Off, Self::On, Self::Auto];

    /// The mode's name as the CLI spells it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::On => "on",
            Self::Auto => "auto",
        }
    }
}

impl std::str::FromStr for RetentionMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                let names = Self::ALL.map(Self::name);
                let (last, rest) = names.split_last().expect("at least one mode");
                format!(
                    "unknown retention mode {s:?}: use {} or {last}",
                    rest.join(", ")
                )
            })
    }
}

/// Retention's knobs.
#[derive(Clone, Debug, PartialEq)]
pub struct RetentionConfig {
    /// The mode.
    pub mode: RetentionMode,
    /// Tokens per KV block (the engines').
    pub block_size: usize,
    /// Usable KV blocks per worker (vLLM's `num_gpu_blocks` less the null block).
    pub capacity_blocks: usize,
    /// A shared run shorter than this many blocks is not tracked (not worth a request).
    pub min_prefix_blocks: usize,
    /// A retained prefix is refreshed when fewer than this many requests' worth of new
    /// blocks stand between it and the head of the free queue.
    pub margin_requests: f64,
    /// Prefixes tracked per worker (the least demanded is forgotten beyond it).
    pub max_tracked: usize,
    /// Blocks kept back from the retained prefixes for the running requests' own blocks, in
    /// requests in flight (times their smoothed new blocks).
    pub reserve_factor: f64,
    /// `auto`: what a refresh costs the engine, in prefill tokens (its one computed token
    /// plus its share of a step); a refresh is sent only when the prefill it is expected to
    /// save is at least `value_ratio` times this.
    pub refresh_cost_tokens: f64,
    /// `auto`: see `refresh_cost_tokens`.
    pub value_ratio: f64,
    /// `auto`: refresh only while the refreshes sent saved at least this many prefix tokens
    /// each, as measured against each worker's plain LRU (modelled beside it: the same
    /// requests, no refresh), over about the fleet's last 256 requests and once 128 were
    /// sent to tell; when they stop, the count decays and they are probed again.
    pub min_payoff_tokens: f64,
    /// `auto`: refresh only while the plain LRUs lose at least this many prefix tokens a use
    /// of a tracked prefix (the caches are under pressure; none where everything fits),
    /// judged once 32 uses were seen.
    pub pressure_tokens: f64,
    /// `auto`: refresh on a worker only while the prefixes that fit (the retained ones) carry
    /// at least this share of its demand: where most of the demand cannot be kept anyway,
    /// refreshing a few only reorders the losses and costs engine time.
    pub min_coverage: f64,
    /// `auto`: a prefix used less often than once per this many turnovers of the worker's
    /// cache (capacity ÷ new blocks per request, in requests) is not worth holding.
    pub max_turnovers: f64,
    /// `auto`: a prefix that extends an earlier tracked one (a conversation's history, reused
    /// once by its next turn and then superseded) is retained only once the worker reused it
    /// this many times.
    pub min_reuses: u32,
    /// A retained prefix neither used nor refreshed for this many of the worker's requests is
    /// refreshed, once the modelled cache is full, whatever the model says of its distance to
    /// the head (the model only sees the router's side of the engine; this bounds how far it
    /// can drift). 0 turns it off.
    pub refresh_after_requests: u64,
    /// [`Retention::room_for`](super::Retention::room_for): a prompt cached nowhere may go to a worker running at most
    /// this many requests more than the fleet's mean.
    pub room_slack_requests: f64,
    /// [`Retention::room_for`](super::Retention::room_for) places only while the prefix families in recent use (as many
    /// as were routed to in the last 64 requests a worker, at the mean size of the tracked
    /// prefixes) fill at most this share of the fleet's blocks.
    pub room_max_fill: f64,
}

impl RetentionConfig {
    /// The defaults for a worker of `capacity_blocks` usable blocks of `block_size` tokens.
    pub fn new(mode: RetentionMode, block_size: usize, capacity_blocks: usize) -> Self {
        Self {
            mode,
            block_size: block_size.max(1),
            capacity_blocks,
            min_prefix_blocks: 2,
            margin_requests: 6.0,
            max_tracked: 64,
            reserve_factor: 1.0,
            refresh_cost_tokens: 200.0,
            value_ratio: 2.0,
            min_payoff_tokens: 20.0,
            pressure_tokens: 50.0,
            min_coverage: 0.6,
            max_turnovers: 2.0,
            min_reuses: 2,
            refresh_after_requests: 3,
            room_slack_requests: 2.0,
            room_max_fill: 0.9,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse() {
        assert_eq!("auto".parse::<RetentionMode>(), Ok(RetentionMode::Auto));
        assert!("sometimes".parse::<RetentionMode>().is_err());
        assert_eq!(RetentionMode::On.name(), "on");
        for mode in RetentionMode::ALL {
            assert_eq!(mode.name().parse::<RetentionMode>(), Ok(mode));
        }
    }
}
