//! One worker as the fleet tracks it, and what a new worker list changed.

use crate::config::EventSource;
use crate::models::ServedModels;

/// One worker as the router tracks it.
#[derive(Clone, Debug)]
pub struct Member {
    /// Its name in the routing step, the index, the metrics and the worker header: discovery's
    /// stable name (a pod's), or the URL.
    pub name: String,
    /// Base URL (`http://host:port`) requests go to.
    pub url: String,
    /// Where it publishes KV events (None: predicted from the router's decisions).
    pub events: Option<EventSource>,
    /// Discovery says it takes new requests.
    pub ready: bool,
    /// Its slot in the routing step.
    pub slot: usize,
    /// Passed its last health check and accepted its last connection.
    pub healthy: bool,
    /// Failed requests since the last success.
    pub consecutive_failures: u32,
    /// Ejections since the last success; each lengthens the next.
    pub ejections: u32,
    /// Monotonic seconds before which no health check brings it back.
    pub ejected_until: f64,
    /// Times it was ejected (cumulative, for the metric).
    pub ejected_total: u64,
    /// Failed health checks (cumulative, for the metric).
    pub health_failures: u64,
    /// Its usable KV blocks as the admission guard and retention count them (None: not
    /// known yet).
    pub kv_capacity_blocks: Option<usize>,
    /// Monotonic seconds before which its engine is not asked for its capacity again.
    pub kv_capacity_retry_at: f64,
    /// The models and adapters it serves (None: not known yet, so any).
    pub models: Option<ServedModels>,
}

impl Member {
    /// May take a new request at `now`.
    pub fn available(&self, now: f64) -> bool {
        self.ready && self.healthy && now >= self.ejected_until
    }

    /// May take a request for `model` (None: the engine's default), as far as the router
    /// knows.
    pub fn serves(&self, model: Option<&str>) -> bool {
        match (model, &self.models) {
            (Some(model), Some(served)) => served.serves(model),
            _ => true,
        }
    }
}

/// What a new worker list changed: the streams to follow and those to stop following.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Membership {
    /// Workers that joined with events, or whose event sockets changed.
    pub follow: Vec<(String, EventSource)>,
    /// Workers that left, or no longer publish events, while their stream was followed.
    pub unfollow: Vec<String>,
}
