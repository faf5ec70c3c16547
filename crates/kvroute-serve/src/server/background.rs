//! The router's background loops: workers' health checks, their engines' KV capacity, and
//! the KV-event consumer's notices.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper::header::AUTHORIZATION;
use kvroute_io::consumer::{Consumer, Item};
use tokio::sync::watch;

use super::limits::{MAX_ANSWER_BYTES, UNHEALTHY_CHECKS_PER_INTERVAL};
use super::shared::Shared;
use crate::models::ServedModels;

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
        // The first round runs at once: it learns the workers' models before most requests.
        if round > 0 {
            tokio::select! {
                _ = tokio::time::sleep(tick) => {},
                _ = stopped.changed() => return,
            }
        }
        round = round.wrapping_add(1);
        let now = shared.now();
        // A worker whose models are not known yet is checked as often as an unhealthy one:
        // until then its requests are hashed without their adapter's key.
        let due: Vec<(String, String)> = shared
            .fleet()
            .members()
            .iter()
            .filter(|m| {
                !m.available(now)
                    || m.models.is_none()
                    || round % UNHEALTHY_CHECKS_PER_INTERVAL == 0
            })
            .map(|m| (m.name.clone(), m.url.clone()))
            .collect();
        for (name, url) in due {
            let shared = shared.clone();
            tokio::spawn(async move {
                let passed = check(&shared, &url).await;
                let now = shared.now();
                shared.fleet().checked(&name, passed, now);
                if passed && let Some(models) = served_models(&shared, &url).await {
                    shared.fleet().set_models(&name, models);
                }
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

/// The models and adapters the worker at `url` lists in `GET /v1/models` (a 2xx within the
/// health-check timeout, at most [`super::MAX_ANSWER_BYTES`]), or None.
async fn served_models(shared: &Shared, url: &str) -> Option<ServedModels> {
    let uri = format!("{url}/v1/models").parse::<hyper::Uri>().ok()?;
    let mut request = Request::get(uri);
    if let Some(auth) = &shared.worker_authorization {
        request = request.header(AUTHORIZATION, auth.clone());
    }
    let request = request.body(Full::new(Bytes::new())).ok()?;
    tokio::time::timeout(shared.config.health_timeout, async {
        let response = shared.upstream.request(request).await.ok()?;
        if !response.status().is_success() {
            return None;
        }
        let body = http_body_util::Limited::new(response.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .ok()?;
        ServedModels::parse(&body.to_bytes())
    })
    .await
    .ok()?
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
/// the consumer has already made), and workers leaving or rejoining the available set.
pub(super) async fn notice_loop(shared: Arc<Shared>, mut stopped: watch::Receiver<bool>) {
    let mut out: HashSet<String> = HashSet::new();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(NOTICE_INTERVAL) => {},
            _ = stopped.changed() => return,
        }
        for line in availability_changes(&shared, &mut out) {
            eprintln!("{line}");
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
                // Expected 0: the router had none of this worker's batches yet (it subscribed
                // after the engine's replay buffer wrapped), so nothing it knew is lost.
                Item::ReplayFailed {
                    expected: 0, got, ..
                } => eprintln!(
                    "kvroute serve: worker {worker}: joined its KV event stream at batch {got} (older ones are \
                     past its replay buffer); blocks it cached before then count once it stores them again"
                ),
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

/// The log lines for workers that left or rejoined the available set since the last call
/// (`out`: the workers reported out): an operator sees a dead worker in the log, not only as
/// a 502 and a 503 on `/health`.
fn availability_changes(shared: &Shared, out: &mut HashSet<String>) -> Vec<String> {
    let now = shared.now();
    let fleet = shared.fleet();
    let total = fleet.members().len();
    let available = fleet.available_count(now);
    let mut lines = Vec::new();
    for m in fleet.members() {
        let is_out = !m.available(now);
        if is_out && out.insert(m.name.clone()) {
            let why = if !m.ready {
                "discovery says it no longer takes requests".to_string()
            } else if now < m.ejected_until {
                format!(
                    "ejected for {:.0} s after failed requests in a row",
                    m.ejected_until - now
                )
            } else {
                "its health check (GET /health) failed or it refused a connection; checked again every few seconds".to_string()
            };
            lines.push(format!(
                "kvroute serve: worker {} is out: {why} ({available} of {total} workers available)",
                m.name
            ));
        } else if !is_out && out.remove(&m.name) {
            lines.push(format!(
                "kvroute serve: worker {} is back ({available} of {total} workers available)",
                m.name
            ));
        }
    }
    out.retain(|name| fleet.members().iter().any(|m| &m.name == name));
    lines
}
