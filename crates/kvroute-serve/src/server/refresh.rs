//! Retention's refreshes: the prompts a worker is sent so that the blocks it should keep stay
//! recent, on connections of their own, straight from the router to the worker.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::header::{AUTHORIZATION, CONTENT_TYPE};
use hyper::{Request, StatusCode};

use super::limits::MAX_REFRESHES_OPEN;
use super::shared::Shared;
use crate::fleet::{IdleRefreshes, RefreshTenant};
use crate::relay::{self, SignalBody};

/// A refresh's whole answer (one token) must come within this, or it counts as an error.
const REFRESH_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest a client request waits for its refreshes to be written ahead of it.
const REFRESH_WRITE_WAIT: Duration = Duration::from_millis(20);

/// Send `worker` its refreshes (the prefix's ids plus one, `max_tokens` 1), each on a task
/// of its own, and return once their bodies are handed to their connections (at most
/// [`REFRESH_WRITE_WAIT`]): the client request goes after them. A worker already holding
/// [`MAX_REFRESHES_OPEN`] gets no more (counted); errors are counted, never retried.
pub(super) async fn send_refreshes(
    shared: &Arc<Shared>,
    worker: &str,
    url: &str,
    refreshes: &[kvroute_core::retention::Refresh],
    tenants: &[RefreshTenant],
) {
    let mut written = Vec::with_capacity(refreshes.len());
    for (refresh, tenant) in refreshes.iter().zip(tenants) {
        {
            let mut open = shared
                .refreshes_open
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let n = open.entry(worker.to_owned()).or_insert(0);
            if *n >= MAX_REFRESHES_OPEN {
                shared.metrics.refresh_dropped(worker);
                continue;
            }
            *n += 1;
        }
        let mut body = serde_json::json!({"prompt": &*refresh.prompt, "max_tokens": 1});
        if let Some(m) = &tenant.model {
            body["model"] = serde_json::Value::from(m.as_str());
        }
        if let Some(salt) = &tenant.cache_salt {
            body["cache_salt"] = serde_json::Value::from(salt.as_str());
        }
        let (body, done) = SignalBody::new(Bytes::from(body.to_string()));
        written.push(done);
        shared.metrics.refresh_sent(worker, refresh.prompt.len());
        let (s, worker, uri) = (
            shared.clone(),
            worker.to_owned(),
            format!("{url}/v1/completions"),
        );
        tokio::spawn(async move {
            let mut request = Request::post(uri.as_str()).header(CONTENT_TYPE, "application/json");
            if let Some(auth) = &s.worker_authorization {
                request = request.header(AUTHORIZATION, auth.clone());
            }
            let ok = match request.body(body) {
                Ok(request) => tokio::time::timeout(REFRESH_TIMEOUT, async {
                    let answer = s.refresh_upstream.request(request).await.ok()?;
                    let status = answer.status();
                    let body = http_body_util::Limited::new(answer.into_body(), 1 << 20)
                        .collect()
                        .await
                        .ok()?
                        .to_bytes();
                    if status != StatusCode::OK {
                        return Some(false);
                    }
                    if let Some(usage) = relay::refresh_usage(&body) {
                        s.metrics.refresh_answered(usage);
                    }
                    Some(true)
                })
                .await
                .ok()
                .flatten()
                .unwrap_or(false),
                Err(_) => false,
            };
            if !ok {
                s.metrics.refresh_failed(&worker);
            }
            let mut open = s.refreshes_open.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(n) = open.get_mut(&worker) {
                *n = n.saturating_sub(1);
            }
        });
    }
    let all = async {
        for done in written {
            let _ = done.await;
        }
    };
    if tokio::time::timeout(REFRESH_WRITE_WAIT, all).await.is_err() {
        shared
            .metrics
            .refreshes_late
            .fetch_add(1, Ordering::Relaxed);
    }
}

/// Send the refreshes retention kept back for a worker that fell idle (`idle`), from a task of
/// their own on `runtime`: the request whose end made it idle does not wait for them.
pub(super) fn spawn_idle_refreshes(
    runtime: &tokio::runtime::Handle,
    shared: Arc<Shared>,
    idle: IdleRefreshes,
) {
    runtime.spawn(async move {
        send_refreshes(
            &shared,
            &idle.name,
            &idle.url,
            &idle.refreshes,
            &idle.tenants,
        )
        .await;
    });
}
