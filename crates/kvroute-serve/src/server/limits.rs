//! The server's fixed bounds, intervals and names, shared by its parts (a leaf: it uses
//! none of them).

use std::time::Duration;

/// Response header naming the worker that served the request.
pub const WORKER_HEADER: &str = "x-kvroute-worker";
/// The largest `/v1/models` answer relayed (read whole; vLLM's are a few hundred bytes a model).
pub const MAX_ANSWER_BYTES: usize = 64 << 20;
/// Whole answers up to this size are read before they are relayed, so that a worker breaking
/// while it sends one gets the client a 502 (vLLM's are kilobytes); longer ones (logprobs of a
/// long generation run to megabytes) are relayed as they come, so that clients that read them
/// slowly each hold at most about this much of the router's memory, not the whole answer.
pub const BUFFERED_ANSWER_BYTES: usize = 64 << 10;
/// How many times as often as a healthy worker one out of the available set is checked.
pub const UNHEALTHY_CHECKS_PER_INTERVAL: u32 = 4;
/// How long the event consumer lets batches gather after taking some: one wake-up of its
/// thread for several engine steps, beside engine steps of tens of milliseconds (the index
/// learns of a batch at most this much later; `benchmarks/kv_events_consume.py`).
pub const EVENTS_COALESCE: Duration = Duration::from_millis(2);
/// Bodies over `--offload-bytes` parsed at once; the others wait once read.
pub const LARGE_BODIES: usize = 2;
/// Refreshes open at once per worker; more are dropped (counted), never queued.
pub const MAX_REFRESHES_OPEN: usize = 4;
