//! The router's counters and their Prometheus text ([`exposition`], the one writer of it),
//! under the metric names the dashboards (`deploy/grafana`) and `kvroute bench` read.
//!
//! Labels come only from fixed sets (routes, statuses, kinds, reasons) or the configured
//! workers: a client can never mint a label value.

pub mod exposition;

use std::sync::atomic::{AtomicU64, Ordering};

use kvroute_io::consumer::CounterSnapshot;

use crate::fleet::Fleet;
use exposition::{Exposition, Family, Histogram, Kind};

/// Blocks of overlap and of prompts: 0 .. 1024.
const BLOCK_BUCKETS: [f64; 12] = [
    0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
];
/// Routing work in seconds: 10 µs .. 100 ms.
const SECONDS_BUCKETS: [f64; 12] = [
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1,
];

/// What the engine reports of one answered refresh: its prompt tokens and how many of them
/// it found in its prefix cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RefreshUsage {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

/// What is open now, as the gauges show it (read from its owners when `/metrics` renders).
#[derive(Clone, Copy, Debug, Default)]
pub struct OpenCounts {
    /// Client connections.
    pub connections: usize,
    /// Refreshes sent and not answered.
    pub refreshes: usize,
    /// Request body bytes held now, and the most that may be ([`crate::edge::BodyBudget`]).
    pub body_bytes: usize,
    pub body_budget_bytes: usize,
}

/// Every counter the native router keeps.
pub struct Metrics {
    overlap_blocks: Histogram,
    prompt_blocks: Histogram,
    routing_seconds: Histogram,
    refresh_wait_seconds: Histogram,
    requests: Family,
    decisions: Family,
    upstream_errors: Family,
    client_disconnects: Family,
    client_timeouts: Family,
    rejected: Family,
    refreshes: Family,
    refresh_errors: Family,
    refreshes_dropped: Family,
    pub refresh_prompt_tokens: AtomicU64,
    refresh_answered_prompt_tokens: AtomicU64,
    refresh_cached_tokens: AtomicU64,
    pub refreshes_late: AtomicU64,
    pub retries: AtomicU64,
    pub connections_refused: AtomicU64,
    pub untokenized: AtomicU64,
    pub offloaded: AtomicU64,
    /// This router process's identity ([`new_instance_id`]).
    instance: String,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            overlap_blocks: Histogram::new(&BLOCK_BUCKETS),
            prompt_blocks: Histogram::new(&BLOCK_BUCKETS),
            routing_seconds: Histogram::new(&SECONDS_BUCKETS),
            refresh_wait_seconds: Histogram::new(&SECONDS_BUCKETS),
            requests: Family::default(),
            decisions: Family::default(),
            upstream_errors: Family::default(),
            client_disconnects: Family::default(),
            client_timeouts: Family::default(),
            rejected: Family::default(),
            refreshes: Family::default(),
            refresh_errors: Family::default(),
            refreshes_dropped: Family::default(),
            refresh_prompt_tokens: AtomicU64::new(0),
            refresh_answered_prompt_tokens: AtomicU64::new(0),
            refresh_cached_tokens: AtomicU64::new(0),
            refreshes_late: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            connections_refused: AtomicU64::new(0),
            untokenized: AtomicU64::new(0),
            offloaded: AtomicU64::new(0),
            instance: new_instance_id(),
        }
    }
}

/// A name for this router process that no other replica and no earlier run of it has: the
/// process id and the wall clock's nanoseconds at start, in hex. `/metrics` shows it
/// (`kvroute_router_info{instance=...}`), so a reader that meets two instances behind one URL
/// knows it is reading through a balancer, and one whose instance changed knows the counters
/// restarted.
pub fn new_instance_id() -> String {
    let nanos = jiff::Timestamp::now().as_nanosecond();
    format!("{:x}-{:x}", std::process::id(), nanos as u64)
}

impl Metrics {
    /// This router process's identity (see [`new_instance_id`]).
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// One routing decision's figures: the chosen worker's overlap and the prompt's blocks.
    pub fn routed(&self, overlap_blocks: usize, prompt_blocks: usize) {
        self.overlap_blocks.observe(overlap_blocks as f64);
        self.prompt_blocks.observe(prompt_blocks as f64);
    }

    /// The router's own work on a request before forwarding it (parse, tokenize, hash,
    /// index, choose), in seconds.
    pub fn routing_took(&self, seconds: f64) {
        self.routing_seconds.observe(seconds);
    }

    /// How long a client request waited for the refreshes sent ahead of it to be written.
    pub fn refresh_wait(&self, seconds: f64) {
        self.refresh_wait_seconds.observe(seconds);
    }

    /// A request answered on `route` (a fixed route name) with `status`.
    pub fn request(&self, route: &str, status: u16) {
        self.requests.inc(&[route, &status.to_string()]);
    }

    /// A routing decision by `policy` for `worker`.
    pub fn decision(&self, policy: &str, worker: &str) {
        self.decisions.inc(&[policy, worker]);
    }

    /// A failure talking to `worker`: `connect` or `first_byte_timeout` (before the first
    /// byte, retried), `body` or `stream` (after it).
    pub fn upstream_error(&self, worker: &str, kind: &str) {
        self.upstream_errors.inc(&[worker, kind]);
    }

    /// A client left before the answer from `worker` was written to it.
    pub fn client_disconnect(&self, worker: &str) {
        self.client_disconnects.inc(&[worker]);
    }

    /// A client connection or request closed for being too slow (`header`, `body`, `idle`,
    /// `shed`, `send`).
    pub fn client_timeout(&self, kind: &str) {
        self.client_timeouts.inc(&[kind]);
    }

    /// A refresh sent to `worker` (`tokens` prompt tokens).
    pub fn refresh_sent(&self, worker: &str, tokens: usize) {
        self.refreshes.inc(&[worker]);
        self.refresh_prompt_tokens
            .fetch_add(tokens as u64, Ordering::Relaxed);
    }

    /// A refresh answered with its usage (what the engine's prefix-cache counters counted).
    pub fn refresh_answered(&self, usage: RefreshUsage) {
        self.refresh_answered_prompt_tokens
            .fetch_add(usage.prompt_tokens, Ordering::Relaxed);
        self.refresh_cached_tokens
            .fetch_add(usage.cached_tokens, Ordering::Relaxed);
    }

    /// A refresh to `worker` failed (not retried).
    pub fn refresh_failed(&self, worker: &str) {
        self.refresh_errors.inc(&[worker]);
    }

    /// A refresh to `worker` not sent: it already had the most refreshes open.
    pub fn refresh_dropped(&self, worker: &str) {
        self.refreshes_dropped.inc(&[worker]);
    }

    /// The `kvroute_retention_*` metrics (rendered only with retention on).
    fn write_retention(&self, out: &mut Exposition, refreshes_open: usize) {
        out.family(
            "kvroute_retention_refreshes",
            "Refresh requests sent (prefix + 1 token, max_tokens 1)",
            &["worker"],
            &self.refreshes,
        );
        out.family(
            "kvroute_retention_refresh_errors",
            "Refreshes that failed (not retried)",
            &["worker"],
            &self.refresh_errors,
        );
        out.family(
            "kvroute_retention_refreshes_dropped",
            "Refreshes not sent: the worker already had the most refreshes open",
            &["worker"],
            &self.refreshes_dropped,
        );
        let load = |v: &AtomicU64| v.load(Ordering::Relaxed) as f64;
        let counters = [
            (
                "kvroute_retention_refresh_prompt_tokens",
                "Prompt tokens of the refreshes sent",
                &self.refresh_prompt_tokens,
            ),
            (
                "kvroute_retention_refresh_answered_prompt_tokens",
                "Prompt tokens of the refreshes answered with their usage",
                &self.refresh_answered_prompt_tokens,
            ),
            (
                "kvroute_retention_refresh_cached_tokens",
                "Cached prompt tokens the engines reported for those refreshes",
                &self.refresh_cached_tokens,
            ),
            (
                "kvroute_retention_refreshes_late",
                "Client requests forwarded before their refreshes were written (waited the limit)",
                &self.refreshes_late,
            ),
        ];
        for (name, help, value) in counters {
            out.scalar(name, Kind::Counter, help, load(value));
        }
        out.histogram(
            "kvroute_retention_refresh_wait_seconds",
            "Time a client request waited for the refreshes sent ahead of it to be written",
            &self.refresh_wait_seconds,
        );
        out.scalar(
            "kvroute_retention_refreshes_open",
            Kind::Gauge,
            "Refreshes sent and not answered yet",
            refreshes_open as f64,
        );
    }

    /// A request refused before routing (`body_too_large`, `content_encoding`,
    /// `json_too_deep`, `body_budget`).
    pub fn rejected(&self, reason: &str) {
        self.rejected.inc(&[reason]);
    }

    /// The router's part of `/metrics`, with the KV-event consumer's counters per followed
    /// worker.
    pub fn render(
        &self,
        out: &mut Exposition,
        fleet: &Fleet,
        now: f64,
        events: &[(String, CounterSnapshot)],
        open: OpenCounts,
    ) {
        out.labelled(
            "kvroute_router_info",
            Kind::Gauge,
            "This router process (its instance is new at every start)",
            &["instance"],
            [(vec![self.instance.as_str()], 1.0)],
        );
        if fleet.retention_stats().is_some() {
            self.write_retention(out, open.refreshes);
        }
        write_events(out, events);
        self.write_requests(out);
        self.write_front(out, open);
        write_index(out, fleet);
        write_workers(out, fleet, now);
    }

    /// What the router did with requests: answers, decisions, failures, refusals, and the
    /// routing work's figures.
    fn write_requests(&self, out: &mut Exposition) {
        let families: [(&str, &str, &[&str], &Family); 6] = [
            (
                "kvroute_router_requests",
                "Requests answered, by route and status",
                &["route", "status"],
                &self.requests,
            ),
            (
                "kvroute_router_decisions",
                "Routing decisions",
                &["policy", "worker"],
                &self.decisions,
            ),
            (
                "kvroute_router_upstream_errors",
                "Failures talking to a worker (connect, first_byte_timeout: before the first byte, retried; body, stream: after it)",
                &["worker", "kind"],
                &self.upstream_errors,
            ),
            (
                "kvroute_router_client_disconnects",
                "Streams whose client left before the router had written all of them",
                &["worker"],
                &self.client_disconnects,
            ),
            (
                "kvroute_router_client_timeouts",
                "Client connections or requests closed for being too slow: header, body, idle, shed, send",
                &["kind"],
                &self.client_timeouts,
            ),
            (
                "kvroute_router_rejected_requests",
                "Requests refused before routing: body_too_large (413), content_encoding (415), json_too_deep (400), body_budget (503; 429 through the Endpoint Picker)",
                &["reason"],
                &self.rejected,
            ),
        ];
        for (name, help, labels, family) in families {
            out.family(name, help, labels, family);
        }
        out.histogram(
            "kvroute_router_overlap_blocks",
            "Leading prompt blocks the chosen worker already held (index view) per decision",
            &self.overlap_blocks,
        );
        out.histogram(
            "kvroute_router_prompt_blocks",
            "Full blocks of each routed prompt",
            &self.prompt_blocks,
        );
        out.histogram(
            "kvroute_router_routing_seconds",
            "Router work per request before forwarding: parse, tokenize, hash, index, choose",
            &self.routing_seconds,
        );
    }

    /// The client side: retries, connections, bodies held, offloaded and untokenized prompts.
    fn write_front(&self, out: &mut Exposition, open: OpenCounts) {
        let load = |v: &AtomicU64| v.load(Ordering::Relaxed) as f64;
        let rows = [
            (
                "kvroute_router_retries",
                Kind::Counter,
                "Requests sent again to another worker before any response byte",
                load(&self.retries),
            ),
            (
                "kvroute_router_connections_refused",
                Kind::Counter,
                "Client connections answered 503 and closed at --max-connections",
                load(&self.connections_refused),
            ),
            (
                "kvroute_router_client_connections",
                Kind::Gauge,
                "Open client connections",
                open.connections as f64,
            ),
            (
                "kvroute_router_buffered_body_bytes",
                Kind::Gauge,
                "Request body bytes held in memory now (reserved per body, in KiB steps)",
                open.body_bytes as f64,
            ),
            (
                "kvroute_router_max_buffered_body_bytes",
                Kind::Gauge,
                "Request body bytes the router holds at most (--max-buffered-body-bytes; more get 503, 429 through the Endpoint Picker)",
                open.body_budget_bytes as f64,
            ),
            (
                "kvroute_router_offloaded_requests",
                Kind::Counter,
                "Requests whose parsing, tokenization and hashing ran on a blocking thread (bodies over --offload-bytes)",
                load(&self.offloaded),
            ),
            (
                "kvroute_router_untokenized_prompts",
                Kind::Gauge,
                "Prompts routed without tokenizing (no prefix match; cumulative)",
                load(&self.untokenized),
            ),
        ];
        for (name, kind, help, value) in rows {
            out.scalar(name, kind, help, value);
        }
    }
}

/// The KV-event consumer's counters, per followed worker.
fn write_events(out: &mut Exposition, events: &[(String, CounterSnapshot)]) {
    type Pick = fn(&CounterSnapshot) -> u64;
    let event_counters: [(&str, &str, Pick); 6] = [
        (
            "kvroute_router_kv_events",
            "KV cache events applied to the index",
            |c| c.events,
        ),
        (
            "kvroute_router_kv_events_malformed",
            "KV event batches that could not be decoded",
            |c| c.malformed,
        ),
        (
            "kvroute_router_kv_events_unknown",
            "KV events of a type this router does not know (skipped; the rest of the batch applied)",
            |c| c.unknown_events,
        ),
        (
            "kvroute_router_kv_event_gaps",
            "Sequence gaps seen on a worker's event stream",
            |c| c.gaps,
        ),
        (
            "kvroute_router_kv_event_replay_failures",
            "Gaps that replay could not fill (the worker's index entries were dropped)",
            |c| c.replay_failures,
        ),
        (
            "kvroute_router_engine_restarts",
            "Event sequence restarts (new engine process)",
            |c| c.restarts,
        ),
    ];
    for (name, help, pick) in event_counters {
        let rows = events.iter().map(|(w, c)| (w.as_str(), pick(c) as f64));
        out.per_worker(name, Kind::Counter, help, rows);
    }
}

/// The index's size and what its memory bound dropped.
fn write_index(out: &mut Exposition, fleet: &Fleet) {
    let (blocks, predicted, evicted) = fleet.index_figures();
    let rows = [
        (
            "kvroute_router_index_blocks",
            "Event-backed (worker, block) entries in the index",
            blocks,
        ),
        (
            "kvroute_router_index_predicted_entries",
            "Predicted (routed, not yet confirmed) entries",
            predicted,
        ),
        (
            "kvroute_router_index_evicted_blocks",
            "Index entries dropped by its memory bound (cumulative)",
            evicted as usize,
        ),
    ];
    for (name, help, value) in rows {
        out.scalar(name, Kind::Gauge, help, value as f64);
    }
}

/// The workers: how many are available, their KV capacity and pinned blocks, ejections and
/// failed health checks.
fn write_workers(out: &mut Exposition, fleet: &Fleet, now: f64) {
    out.scalar(
        "kvroute_router_workers_available",
        Kind::Gauge,
        "Workers healthy and not ejected",
        fleet.available_count(now) as f64,
    );
    out.per_worker(
        "kvroute_router_worker_kv_capacity_blocks",
        Kind::Gauge,
        "Usable KV blocks of a worker: configured, or read from its engine's /metrics for \
         the admission guard and retention",
        fleet
            .members()
            .iter()
            .filter_map(|m| Some((m.name.as_str(), m.kv_capacity_blocks? as f64))),
    );
    if let Some((diversions, workers)) = fleet.admission_figures() {
        out.scalar(
            "kvroute_router_admission_diversions",
            Kind::Counter,
            "Requests kv-aware's admission guard sent elsewhere than the cheapest worker, \
             where they would have waited for KV blocks",
            diversions as f64,
        );
        out.per_worker(
            "kvroute_router_worker_pinned_blocks",
            Kind::Gauge,
            "KV blocks the router's requests in flight pin on a worker, as the router counts them",
            workers.iter().map(|w| (w.name, w.pinned_blocks as f64)),
        );
    }
    let members = fleet.members();
    out.per_worker(
        "kvroute_router_ejections",
        Kind::Counter,
        "Workers taken out after consecutive failed requests (outlier ejection)",
        members
            .iter()
            .map(|m| (m.name.as_str(), m.ejected_total as f64)),
    );
    out.per_worker(
        "kvroute_router_health_check_failures",
        Kind::Counter,
        "Failed /health checks",
        members
            .iter()
            .map(|m| (m.name.as_str(), m.health_failures as f64)),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ServeConfig;

    #[test]
    fn counters_render_under_the_routers_names() {
        let m = Metrics::default();
        m.request("/v1/completions", 200);
        m.request("/v1/completions", 200);
        m.rejected("body_too_large");
        m.upstream_error("http://a:1", "connect");
        m.routed(3, 5);
        m.routed(0, 5);
        let config = ServeConfig {
            workers: vec![crate::config::WorkerSpec::url("http://a:1")],
            ..ServeConfig::default()
        };
        let mut out = Exposition::new();
        m.render(
            &mut out,
            &Fleet::new(&config).unwrap().0,
            0.0,
            &[],
            OpenCounts::default(),
        );
        let text = out.finish();
        assert!(text.contains(
            "kvroute_router_requests_total{route=\"/v1/completions\",status=\"200\"} 2.0"
        ));
        assert!(
            text.contains("kvroute_router_rejected_requests_total{reason=\"body_too_large\"} 1.0")
        );
        assert!(text.contains(
            "kvroute_router_upstream_errors_total{worker=\"http://a:1\",kind=\"connect\"} 1.0"
        ));
        assert!(text.contains("kvroute_router_workers_available 1.0"));
        assert!(text.contains("kvroute_router_overlap_blocks_bucket{le=\"0.0\"} 1.0"));
        assert!(text.contains("kvroute_router_overlap_blocks_bucket{le=\"4.0\"} 2.0"));
        assert!(text.contains("kvroute_router_overlap_blocks_count 2.0"));
        assert!(text.contains("kvroute_router_prompt_blocks_sum 10.0"));
    }
}
