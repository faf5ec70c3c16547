//! `kvroute serve`'s routes: the API key, `/v1/completions` and `/v1/chat/completions`
//! ([`super::forward`]), `/v1/models` relayed from one worker, `/health` and `/metrics`.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};

use super::answers::{answered, draining, no_worker};
use super::forward::generate;
use super::limits::MAX_ANSWER_BYTES;
use super::pipeline::unmet_expectation;
use super::shared::Shared;
use crate::edge::{self, Body};
use crate::prompt::Route;
use crate::relay;

/// Routes a client may name (a metric label: never the raw path).
fn route_label(path: &str) -> &'static str {
    match path {
        "/v1/completions" => "/v1/completions",
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/models" => "/v1/models",
        "/health" => "/health",
        "/metrics" => "/metrics",
        _ => "other",
    }
}

pub(super) async fn handle(shared: Arc<Shared>, request: Request<Incoming>) -> Response<Body> {
    let label = route_label(request.uri().path());
    let response = dispatch(&shared, request, label).await;
    shared.metrics.request(label, response.status().as_u16());
    response
}

async fn dispatch(
    shared: &Arc<Shared>,
    request: Request<Incoming>,
    label: &'static str,
) -> Response<Body> {
    let method = request.method().clone();
    if let Some(refusal) = unmet_expectation(request.headers()) {
        return refusal;
    }
    let open = label == "/health" || (label == "/metrics" && shared.config.metrics_public);
    if label != "other"
        && !open
        && let Some(key) = &shared.config.api_key
        && !edge::bearer_matches(request.headers().get(AUTHORIZATION), key.as_bytes())
    {
        return edge::error(
            StatusCode::UNAUTHORIZED,
            "missing or wrong API key",
            "AuthenticationError",
            None,
        );
    }
    match (label, &method) {
        ("/v1/completions", &Method::POST) => generate(shared, request, Route::Completions).await,
        ("/v1/chat/completions", &Method::POST) => generate(shared, request, Route::Chat).await,
        ("/v1/models", &Method::GET) => models(shared).await,
        ("/health", &Method::GET) => health(shared),
        ("/metrics", &Method::GET) => {
            let text = shared.metrics_text();
            let mut response = Response::new(edge::full(text));
            response.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            response
        }
        ("other", _) => edge::error(StatusCode::NOT_FOUND, "not found", "NotFoundError", None),
        _ => edge::error(
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed",
            "MethodNotAllowed",
            None,
        ),
    }
}

fn health(shared: &Shared) -> Response<Body> {
    let now = shared.now();
    if shared.draining.load(Ordering::SeqCst) {
        return draining();
    }
    if shared.fleet().available_count(now) == 0 {
        return no_worker();
    }
    Response::new(edge::full(Bytes::new()))
}

/// `GET /v1/models` from one available worker, relayed whole.
async fn models(shared: &Arc<Shared>) -> Response<Body> {
    let start = shared.models_next.fetch_add(1, Ordering::Relaxed);
    let Some((name, url)) = shared.fleet().any_available(start, shared.now()) else {
        return no_worker();
    };
    let Ok(uri) = format!("{url}/v1/models").parse::<hyper::Uri>() else {
        return no_worker();
    };
    let mut request = Request::get(uri);
    if let Some(auth) = &shared.worker_authorization {
        request = request.header(AUTHORIZATION, auth.clone());
    }
    let Ok(request) = request.body(Full::new(Bytes::new())) else {
        return no_worker();
    };
    let timeout = shared
        .config
        .first_byte_timeout
        .unwrap_or(Duration::from_secs(600));
    match tokio::time::timeout(timeout, shared.upstream.request(request)).await {
        Ok(Ok(answer)) => {
            let (parts, body) = answer.into_parts();
            match relay::collect(body, shared.config.stream_idle_timeout, MAX_ANSWER_BYTES).await {
                Ok(bytes) => answered(parts.status, &parts.headers, edge::full(bytes), &name),
                Err(_) => bad_gateway(),
            }
        }
        _ => bad_gateway(),
    }
}

fn bad_gateway() -> Response<Body> {
    edge::error(
        StatusCode::BAD_GATEWAY,
        "the worker failed before answering",
        "UpstreamError",
        None,
    )
}
