//! The router's background loops: workers' health checks, their engines' KV capacity, and
//! the KV-event consumer's notices.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use kvroute_io::consumer::{Consumer, Item};
use tokio::sync::watch;

use super::UNHEALTHY_CHECKS_PER_INTERVAL;
use super::state::Shared;

/// How often the consumer's notices (each a worker reset) are logged.
const NOTICE_INTERVAL: Duration = Duration::from_millis(200);
/// How often the router looks for workers whose KV capacity the admission guard still needs,
/// and how long it waits before asking an engine that did not say again.
const KV_CAPACITY_TICK: Duration = Duration::from_millis(250);
const KV_CAPACITY_RETRY_S: f64 = 30.0;
/// The most of a worker's `/metrics` read for its capacity.
const MAX_METRICS_BYTES: usize = 4 << 20;

/// Check every worker's `GET /health` each `interval` (one out of the available set
/// [`UNHEALTHY_CHECKS_PER_INTERVAL`] times as often); only a 2xx passes (a redirect fails).
pub(super) async fn health_loop(
    shared: Arc<Shared>,
    interval: Duration,
    mut stopped: watch::Receiver<bool>,
) {
    let tick = interval / UNHEALTHY_CHECKS_PER_INTERVAL;
    let mut round: u32 = 0;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(tick) => {},
            _ = stopped.changed() => return,
        }
        round = round.wrapping_add(1);
        let now = shared.now();
        let due: Vec<(String, String)> = shared
            .fleet()
            .members()
            .iter()
            .filter(|m| !m.available(now) || round % UNHEALTHY_CHECKS_PER_INTERVAL == 0)
            .map(|m| (m.name.clone(), m.url.clone()))
            .collect();
        for (name, url) in due {
            let shared = shared.clone();
            tokio::spawn(async move {
                let passed = check(&shared, &url).await;
                let now = shared.now();
                shared.fleet().checked(&name, passed, now);
            });
        }
    }
}

async fn check(shared: &Shared, url: &str) -> bool {
    let Ok(uri) = format!("{url}/health").parse::<hyper::Uri>() else {
        return false;
    };
    let Ok(request) = Request::get(uri).body(Full::new(Bytes::new())) else {
        return false;
    };
    let answer = tokio::time::timeout(shared.config.health_timeout, async {
        let response = shared.upstream.request(request).await.ok()?;
        let passed = response.status().is_success();
        // Read (a bounded part of) the body so the connection can be reused.
        let _ = http_body_util::Limited::new(response.into_body(), 64 * 1024)
            .collect()
            .await;
        Some(passed)
    })
    .await;
    matches!(answer, Ok(Some(true)))
}

/// Ask each worker whose KV capacity the admission guard or retention needs for its engine's
/// `/metrics` (`crate::capacity`): once it answers, never again; one that does not is asked
/// again after [`KV_CAPACITY_RETRY_S`]. Nothing is asked when neither runs, or when the
/// capacity was configured.
pub(super) async fn kv_capacity_loop(shared: Arc<Shared>, mut stopped: watch::Receiver<bool>) {
    loop {
        let wanted = shared
            .fleet()
            .kv_capacity_wanted(shared.now(), KV_CAPACITY_RETRY_S);
        for (name, url) in wanted {
            let shared = shared.clone();
            tokio::spawn(async move {
                if let Some(blocks) = engine_kv_blocks(&shared, &url).await {
                    shared.fleet().set_kv_capacity(&name, blocks);
                }
            });
        }
        tokio::select! {
            _ = tokio::time::sleep(KV_CAPACITY_TICK) => {},
            _ = stopped.changed() => return,
        }
    }
}

/// `num_gpu_blocks` from the engine at `url`'s `/metrics` (a 2xx within the health-check
/// timeout, at most [`MAX_METRICS_BYTES`]), or None.
async fn engine_kv_blocks(shared: &Shared, url: &str) -> Option<usize> {
    let uri = format!("{url}/metrics").parse::<hyper::Uri>().ok()?;
    let request = Request::get(uri).body(Full::new(Bytes::new())).ok()?;
    let text = tokio::time::timeout(shared.config.health_timeout, async {
        let response = shared.upstream.request(request).await.ok()?;
        if !response.status().is_success() {
            return None;
        }
        let body = http_body_util::Limited::new(response.into_body(), MAX_METRICS_BYTES)
            .collect()
            .await
            .ok()?;
        String::from_utf8(body.to_bytes().to_vec()).ok()
    })
    .await
    .ok()??;
    crate::capacity::num_gpu_blocks(&text)
}

/// Log what the KV-event consumer reports (each a reset of a worker's index entries, which
/// the consumer has already made).
pub(super) async fn notice_loop(shared: Arc<Shared>, mut stopped: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(NOTICE_INTERVAL) => {},
            _ = stopped.changed() => return,
        }
        let notices = {
            let consumer = shared.consumer.lock().unwrap_or_else(|p| p.into_inner());
            consumer
                .as_ref()
                .map_or_else(Vec::new, Consumer::take_notices)
        };
        for notice in notices {
            let worker = notice.worker;
            match notice.item {
                Item::ReplayFailed {
                    expected,
                    got,
                    reason,
                } => eprintln!(
                    "kvroute serve: worker {worker}: KV events {expected}..{} lost ({reason}); its index entries are reset",
                    got.saturating_sub(1)
                ),
                Item::Restarted { .. } => {
                    eprintln!(
                        "kvroute serve: worker {worker}: engine restarted; its index entries are reset"
                    )
                }
                Item::Malformed { seq, error } => eprintln!(
                    "kvroute serve: worker {worker}: malformed KV event batch {seq:?}: {error}; its index entries are reset"
                ),
                Item::Crashed { error } => {
                    eprintln!(
                        "kvroute serve: the KV event consumer stopped: {error}; the index gets no more events"
                    )
                }
                Item::Batch { .. } | Item::Gap { .. } => {}
            }
        }
    }
}
