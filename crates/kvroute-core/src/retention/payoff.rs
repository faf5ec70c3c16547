//! What the refreshes bought, measured fleet-wide against the workers' plain LRUs: the
//! evidence `auto` refreshes on.

/// What the refreshes bought, over about the fleet's last [`PAYOFF_WINDOW`] requests (each
/// count decays by `1 - 1 / PAYOFF_WINDOW` a request): measured at each use of a tracked
/// prefix against its worker's plain LRU ([`WorkerModel::shadow`](super::free_queue::WorkerModel::shadow)). Counted fleet-wide: a
/// refresh saves a prefill about once in 20 where retention pays (the reference workload),
/// too rarely to judge one worker's few.
#[derive(Clone, Debug, Default)]
pub(super) struct Payoff {
    /// Prefix blocks requests found held that the plain LRU would have evicted.
    pub(super) saved: f64,
    /// Prefix blocks of the tracked prefixes' uses the plain LRU would have evicted: the
    /// pressure on the cache, what retention could save at most.
    pub(super) lost: f64,
    /// Refreshes sent.
    pub(super) refreshes: f64,
    /// Uses of tracked prefixes.
    pub(super) uses: f64,
    /// Requests routed (the weight the counts above are over).
    pub(super) requests: f64,
}

/// Requests over which [`Payoff`] counts.
pub(super) const PAYOFF_WINDOW: f64 = 256.0;

/// Refreshes [`Payoff`] must count before it judges what they buy: below it (at the start, or
/// once the count has decayed after `auto` stopped) `auto` refreshes, as a probe.
pub(super) const PAYOFF_SAMPLE: f64 = 128.0;

/// Uses of tracked prefixes [`Payoff`] must count before it judges the pressure.
pub(super) const PAYOFF_USES: f64 = 32.0;

impl Payoff {
    pub(super) fn used(&mut self, saved: usize, lost: usize) {
        self.saved += saved as f64;
        self.lost += lost as f64;
        self.uses += 1.0;
    }

    /// A request was routed: older counts weigh less.
    pub(super) fn decay(&mut self) {
        let keep = 1.0 - 1.0 / PAYOFF_WINDOW;
        self.saved *= keep;
        self.lost *= keep;
        self.refreshes *= keep;
        self.uses *= keep;
        self.requests = self.requests * keep + 1.0;
    }

    /// Whether refreshing pays (blocks of `block_size` tokens): the plain LRUs lose at least
    /// `pressure_tokens` a use (once enough uses were seen to tell), and the refreshes sent
    /// saved at least `min_tokens` each (once enough were sent).
    pub(super) fn pays(&self, block_size: usize, min_tokens: f64, pressure_tokens: f64) -> bool {
        let bs = block_size as f64;
        let pressure = self.uses < PAYOFF_USES || self.lost * bs >= pressure_tokens * self.uses;
        let bought =
            self.refreshes < PAYOFF_SAMPLE || self.saved * bs >= min_tokens * self.refreshes;
        pressure && bought
    }
}
