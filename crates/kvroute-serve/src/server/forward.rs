//! `kvroute serve`'s own end of a generation request: the pipeline's decision carried out,
//! the client's bytes forwarded to the chosen worker and its answer relayed, retried on
//! another worker while none has answered.

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{AUTHORIZATION, CACHE_CONTROL, CONTENT_TYPE, HeaderValue};
use hyper::{Request, Response, StatusCode};

use super::answers::{answered, draining, no_worker, with_worker};
use super::limits::BUFFERED_ANSWER_BYTES;
use super::pipeline::{Admitted, Attempt, InFlight, Pipeline, RequestLoad};
use super::shared::Shared;
use crate::edge::{self, Body};
use crate::prompt::Route;
use crate::relay::{self, AnswerStart, Ending, RelayBody};

/// A generation request (`/v1/completions`, `/v1/chat/completions`): the shared pipeline up
/// to its prompt, then [`forward`].
pub(super) async fn generate(
    shared: &Arc<Shared>,
    request: Request<Incoming>,
    route: Route,
) -> Response<Body> {
    let pipeline = Pipeline::new(shared.clone());
    if pipeline.draining() {
        return draining();
    }
    let client_headers = request.headers().clone();
    if let Some(refusal) = pipeline.refuse_early(&client_headers) {
        return refusal;
    }
    // The reservation lives until this function returns: the body is held until then.
    let (raw, _reservation) = match pipeline.read_body(request).await {
        Ok(read) => read,
        Err(response) => return response,
    };
    let admitted = match pipeline.prompt(route, &raw).await {
        Ok(a) => a,
        Err(response) => return response,
    };
    let in_flight = pipeline.in_flight();
    let authorization = shared.worker_authorization.clone().or_else(|| {
        shared
            .config
            .forward_authorization
            .then(|| client_headers.get(AUTHORIZATION).cloned())
            .flatten()
    });
    let headers = relay::forwarded_headers(&client_headers, authorization.as_ref());
    forward(&pipeline, shared, route, &admitted, raw, headers, in_flight).await
}

/// Send the request to the chosen worker, and to another one while none has answered.
async fn forward(
    pipeline: &Pipeline,
    shared: &Arc<Shared>,
    route: Route,
    admitted: &Admitted,
    raw: Bytes,
    headers: hyper::HeaderMap,
    in_flight: InFlight,
) -> Response<Body> {
    let mut tried: Vec<String> = Vec::new();
    for attempt in 0..shared.config.max_attempts {
        let Some(Attempt { dispatch, mut load }) =
            pipeline.decide(admitted, &tried, attempt > 0).await
        else {
            break;
        };
        let Ok(uri) = format!("{}{}", dispatch.url, route.path()).parse::<hyper::Uri>() else {
            tried.push(dispatch.name);
            continue;
        };
        let mut upstream_request = Request::post(uri);
        if let Some(h) = upstream_request.headers_mut() {
            *h = headers.clone();
        }
        let Ok(upstream_request) = upstream_request.body(Full::new(raw.clone())) else {
            tried.push(dispatch.name);
            continue;
        };
        let sent = shared.upstream.request(upstream_request);
        let answer = match shared.config.first_byte_timeout {
            Some(t) => tokio::time::timeout(t, sent).await.ok(),
            None => Some(sent.await),
        };
        // Each failure ends this attempt: `load` is given back as the loop goes on.
        let answer = match answer {
            Some(Ok(a)) => a,
            // Ours: the worker took the request and sat on it (a strike; an ejection is
            // counted on the member, kvroute_router_ejections_total).
            None => {
                shared
                    .metrics
                    .upstream_error(&dispatch.name, "first_byte_timeout");
                shared.fleet().failed(&dispatch.name, shared.now());
                tried.push(dispatch.name);
                continue;
            }
            // Refused, or no connection in time: the worker is gone. A connection dropped
            // before the answer may be a benign keep-alive race (or a worker that just died,
            // whose next connection is refused): only a retry.
            Some(Err(e)) => {
                shared.metrics.upstream_error(&dispatch.name, "connect");
                if e.is_connect() {
                    shared.fleet().refused(&dispatch.name);
                }
                tried.push(dispatch.name);
                continue;
            }
        };
        let (parts, body) = answer.into_parts();
        pipeline.answered(&dispatch.name, parts.status);
        let idle = shared.config.stream_idle_timeout;
        let event_stream = parts
            .headers
            .get(CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        if event_stream {
            let hooks = Box::new(Relayed {
                shared: shared.clone(),
                worker: dispatch.name.clone(),
                kind: "stream",
                load,
                _in_flight: in_flight,
            });
            let body = RelayBody::events(body, idle, &dispatch.name, hooks);
            let mut response = answered(parts.status, &parts.headers, body.boxed(), &dispatch.name);
            response
                .headers_mut()
                .insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            return response;
        }
        load.first_byte();
        let mut body = body;
        return match relay::read_answer(&mut body, idle, BUFFERED_ANSWER_BYTES).await {
            Ok(AnswerStart::Whole(bytes)) => answered(
                parts.status,
                &parts.headers,
                edge::full(bytes),
                &dispatch.name,
            ),
            Ok(AnswerStart::Head(head)) => {
                let hooks = Box::new(Relayed {
                    shared: shared.clone(),
                    worker: dispatch.name.clone(),
                    kind: "body",
                    load,
                    _in_flight: in_flight,
                });
                let body = RelayBody::bytes(head, body, idle, &dispatch.name, hooks);
                answered(parts.status, &parts.headers, body.boxed(), &dispatch.name)
            }
            Err(ending) => {
                shared.broke(&dispatch.name, "body", ending);
                let message = format!(
                    "worker {} failed while answering: {}",
                    dispatch.name,
                    ending.problem(idle)
                );
                let response =
                    edge::error(StatusCode::BAD_GATEWAY, &message, "UpstreamError", None);
                with_worker(response, &dispatch.name)
            }
        };
    }
    match tried.last() {
        None => no_worker(),
        Some(last) => edge::error(
            StatusCode::BAD_GATEWAY,
            &format!("no worker accepted the request (last: {last})"),
            "UpstreamError",
            None,
        ),
    }
}

/// A relayed answer's accounting, told by its [`RelayBody`]: the load it puts on its worker
/// until it ends, how it ended, and the request in flight until then.
struct Relayed {
    shared: Arc<Shared>,
    worker: String,
    /// What broke when the worker does (`kvroute_router_upstream_errors_total{kind}`):
    /// `stream`, or `body` for a whole answer.
    kind: &'static str,
    load: RequestLoad,
    _in_flight: InFlight,
}

impl relay::RelayHooks for Relayed {
    fn first_data(&mut self) {
        self.load.first_byte();
    }

    fn ended(self: Box<Self>, ending: Ending) {
        match ending {
            Ending::Complete => {}
            Ending::ClientLeft => self.shared.metrics.client_disconnect(&self.worker),
            Ending::Died | Ending::Silent => self.shared.broke(&self.worker, self.kind, ending),
        }
        // The load and the request in flight end here, with self.
    }
}
