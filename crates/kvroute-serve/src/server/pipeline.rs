//! The request pipeline every front shares, up to the decision: a body checked and read
//! as the edge bounds it, parsed into a prompt (large ones on a blocking thread), routed by
//! the fleet's routing step with retention's refreshes sent first, and the load that
//! decision puts on its worker, held until the request ends. What carries the request to the
//! worker is the front's: serve relays it (`super::forward`), the Endpoint Picker names the
//! worker to a gateway.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use bytes::Bytes;
use hyper::{Request, Response, StatusCode};

use super::refresh::{send_refreshes, spawn_idle_refreshes};
use super::shared::Shared;
use crate::edge::{self, Body, BodyReservation};
use crate::fleet::{Dispatch, Fleet};
use crate::metrics::Metrics;
use crate::prompt::{Prompt, Route};
use crate::relay::Ending;

/// The 417 for an `Expect` other than `100-continue` (any route), or None.
pub fn unmet_expectation(headers: &hyper::HeaderMap) -> Option<Response<Body>> {
    let expect = headers.get(hyper::header::EXPECT)?;
    (!expect.as_bytes().eq_ignore_ascii_case(b"100-continue")).then(|| {
        edge::error(
            StatusCode::EXPECTATION_FAILED,
            "only 'Expect: 100-continue' is supported",
            "BadRequestError",
            None,
        )
    })
}

/// A front's handle on the pipeline (cheap to clone).
#[derive(Clone)]
pub struct Pipeline {
    shared: Arc<Shared>,
}

/// A prompt ready to route, and when its parse began (the routing time measured from it).
pub struct Admitted {
    pub prompt: Prompt,
    pub started: Instant,
}

/// Where one attempt of a request goes, and the load it puts there until dropped.
pub struct Attempt {
    pub dispatch: Dispatch,
    pub load: RequestLoad,
}

impl Pipeline {
    pub(super) fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }

    /// Whether the router refuses new requests (a drain began).
    pub fn draining(&self) -> bool {
        self.shared.draining.load(Ordering::SeqCst)
    }

    /// The counters every front reports in.
    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    /// The request body limit in bytes.
    pub fn body_limit(&self) -> usize {
        self.shared.body_limit.bytes
    }

    /// The answer refusing a generation request from its head alone ([`edge::refuse_early`]).
    pub fn refuse_early(&self, headers: &hyper::HeaderMap) -> Option<Response<Body>> {
        edge::refuse_early(headers, self.shared.body_limit.bytes, &self.shared.metrics)
    }

    /// The whole body of `request` within the limit, the body timeout and the body budget
    /// ([`edge::read_body`]), or the answer refusing it; keep the reservation while the body
    /// is held.
    pub async fn read_body<B>(
        &self,
        request: Request<B>,
    ) -> Result<(Bytes, BodyReservation), Response<Body>>
    where
        B: hyper::body::Body<Data = Bytes> + Unpin,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let shared = &self.shared;
        edge::read_body(
            request,
            shared.body_limit.bytes,
            shared.config.body_timeout,
            &shared.body_budget,
            &shared.metrics,
        )
        .await
    }

    /// The prompt of a `route` body, or the 400 refusing it. Parsing a large body takes a
    /// multiple of its size (its JSON tree, its tokens): at most [`super::limits::LARGE_BODIES`] are
    /// parsed at once, on blocking threads, the others wait, read (the body budget bounds
    /// those). Waiting for a slot only once the body is in, a client that sends slowly holds
    /// none.
    pub async fn prompt(&self, route: Route, raw: &Bytes) -> Result<Admitted, Response<Body>> {
        let shared = &self.shared;
        let large = raw.len() > shared.config.offload_bytes;
        let _large_permit = if large {
            shared.large_bodies.acquire().await.ok()
        } else {
            None
        };
        let started = Instant::now();
        let prompt = if large {
            shared.metrics.offloaded.fetch_add(1, Ordering::Relaxed);
            let (s, r) = (shared.clone(), raw.clone());
            match tokio::task::spawn_blocking(move || s.prompts.parse(route, &r)).await {
                Ok(parsed) => parsed,
                Err(_) => {
                    return Err(edge::error(
                        StatusCode::BAD_REQUEST,
                        "the body could not be parsed",
                        "BadRequestError",
                        None,
                    ));
                }
            }
        } else {
            shared.prompts.parse(route, raw)
        };
        let prompt = match prompt {
            Ok(p) => p,
            Err(bad) => {
                if bad.too_deep {
                    shared.metrics.rejected("json_too_deep");
                }
                return Err(edge::error(
                    StatusCode::BAD_REQUEST,
                    &bad.message,
                    "BadRequestError",
                    bad.param,
                ));
            }
        };
        if prompt.untokenized {
            shared.metrics.untokenized.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(model) = prompt.model.as_deref()
            && shared.fleet().unknown_model(model)
        {
            return Err(edge::error(
                StatusCode::NOT_FOUND,
                &format!("The model `{model}` does not exist."),
                "NotFoundError",
                Some("model"),
            ));
        }
        Ok(Admitted { prompt, started })
    }

    /// Count a request in flight until the returned guard drops (a drain waits for zero).
    pub fn in_flight(&self) -> InFlight {
        InFlight::new(&self.shared)
    }

    /// Route `admitted`'s prompt among the available workers not `excluded` (names), counting
    /// the decision (a `retry` counts as one, a first attempt its routing time), and send the
    /// chosen worker the refreshes retention keeps ahead of it; None when no worker is
    /// eligible.
    pub async fn decide(
        &self,
        admitted: &Admitted,
        excluded: &[String],
        retry: bool,
    ) -> Option<Attempt> {
        let shared = &self.shared;
        let prompt = &admitted.prompt;
        let now = shared.now();
        let dispatch = shared.fleet().route(
            &prompt.block_hashes,
            prompt.tokens,
            excluded,
            now,
            prompt.retained.as_ref(),
            prompt.model.as_deref(),
        )?;
        if retry {
            shared.metrics.retries.fetch_add(1, Ordering::Relaxed);
        } else {
            shared
                .metrics
                .routing_took(admitted.started.elapsed().as_secs_f64());
        }
        shared
            .metrics
            .decision(&shared.config.policy.name, &dispatch.name);
        shared
            .metrics
            .routed(dispatch.decision.overlap, prompt.block_hashes.len());
        let load = RequestLoad {
            shared: shared.clone(),
            slot: dispatch.decision.worker,
            ticket: dispatch.decision.ticket,
            prefill_tokens: Some(dispatch.decision.prefill_tokens),
            decision: shared
                .mesh
                .as_ref()
                .map(|m| m.routed(&dispatch, prompt, now)),
        };
        if !dispatch.refreshes.is_empty() {
            if let Some(mesh) = &shared.mesh {
                mesh.refreshed(&dispatch.url, &dispatch.refreshes, now);
            }
            let waited = Instant::now();
            let (refreshes, tenants) = (&dispatch.refreshes, &dispatch.refresh_tenants);
            send_refreshes(shared, &dispatch.name, &dispatch.url, refreshes, tenants).await;
            shared.metrics.refresh_wait(waited.elapsed().as_secs_f64());
        }
        Some(Attempt { dispatch, load })
    }

    /// One available worker `(name, url)`, rotating over them (requests without a prompt).
    pub fn any_available(&self) -> Option<(String, String)> {
        let start = self.shared.models_next.fetch_add(1, Ordering::Relaxed);
        self.shared.fleet().any_available(start, self.shared.now())
    }

    /// The fleet (members, health), locked.
    pub fn fleet(&self) -> std::sync::MutexGuard<'_, Fleet> {
        self.shared.fleet()
    }

    /// Worker `name` answered with `status`: a 5xx is a strike towards ejection, anything
    /// else clears its strikes.
    pub fn answered(&self, name: &str, status: StatusCode) {
        let now = self.shared.now();
        let mut fleet = self.shared.fleet();
        if status.is_server_error() {
            fleet.failed(name, now);
        } else {
            fleet.succeeded(name);
        }
    }

    /// Worker `name`'s answer broke after its first byte (`Shared::broke`).
    pub fn broke(&self, name: &str, kind: &str, ending: Ending) {
        self.shared.broke(name, kind, ending);
    }

    /// The text of serve's `/metrics` (the fronts add their own).
    pub fn metrics_text(&self) -> String {
        self.shared.metrics_text()
    }

    /// The monotonic clock the routing step reads.
    pub fn now(&self) -> f64 {
        self.shared.now()
    }
}

/// Counts a request in flight from routing until its answer ends (a drain waits for zero).
pub struct InFlight(Arc<Shared>);

impl InFlight {
    pub(super) fn new(shared: &Arc<Shared>) -> Self {
        shared.in_flight.fetch_add(1, Ordering::SeqCst);
        Self(shared.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// One routed request's load on its worker: the prefill tokens until the first byte, the
/// request until its answer ends, whatever path ends it (a dropped future included). The
/// worker's last request ending sends it the refreshes retention kept back while it was idle.
pub struct RequestLoad {
    shared: Arc<Shared>,
    slot: usize,
    ticket: Option<u64>,
    prefill_tokens: Option<usize>,
    /// Its number in the replica mesh (None: no mesh), whose peers hear of its first byte
    /// and end.
    decision: Option<u64>,
}

impl RequestLoad {
    /// The worker sent its first byte: the prompt's prefill is done.
    pub fn first_byte(&mut self) {
        if let Some(tokens) = self.prefill_tokens.take() {
            self.shared.fleet().first_token(self.slot, tokens);
            if let (Some(mesh), Some(d)) = (&self.shared.mesh, self.decision) {
                mesh.first_token(d, self.shared.now());
            }
        }
    }
}

impl Drop for RequestLoad {
    fn drop(&mut self) {
        let now = self.shared.now();
        let idle = {
            let mut fleet = self.shared.fleet();
            if let Some(tokens) = self.prefill_tokens.take() {
                fleet.first_token(self.slot, tokens);
            }
            fleet.finished(self.slot, self.ticket, now)
        };
        // A draining router starts no new work upstream.
        let draining = self.shared.draining.load(Ordering::SeqCst);
        if let (Some(mesh), Some(d)) = (&self.shared.mesh, self.decision) {
            mesh.finished(d, now);
            if let (Some(idle), false) = (&idle, draining) {
                mesh.refreshed(&idle.url, &idle.refreshes, now);
            }
        }
        if let (Some(idle), false, Ok(runtime)) =
            (idle, draining, tokio::runtime::Handle::try_current())
        {
            spawn_idle_refreshes(&runtime, self.shared.clone(), idle);
        }
    }
}

#[cfg(test)]
mod tests {
    use hyper::HeaderMap;
    use hyper::header::{EXPECT, HeaderValue};

    use super::*;

    #[test]
    fn only_an_expectation_other_than_100_continue_is_refused() {
        let mut headers = HeaderMap::new();
        assert!(unmet_expectation(&headers).is_none());
        headers.insert(EXPECT, HeaderValue::from_static("100-Continue"));
        assert!(
            unmet_expectation(&headers).is_none(),
            "the comparison ignores case (RFC 9110)"
        );
        headers.insert(EXPECT, HeaderValue::from_static("something-else"));
        let refusal = unmet_expectation(&headers).expect("refused");
        assert_eq!(refusal.status(), StatusCode::EXPECTATION_FAILED);
    }
}
