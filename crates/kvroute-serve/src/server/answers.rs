//! The responses serve's routes build for the client: refusals of the router's own and a
//! worker's answer as relayed.

use hyper::header::HeaderValue;
use hyper::{Response, StatusCode};

use super::limits::WORKER_HEADER;
use crate::edge::{self, Body};
use crate::relay;

/// The router is draining (SIGTERM): it takes no new request.
pub(super) fn draining() -> Response<Body> {
    edge::error(
        StatusCode::SERVICE_UNAVAILABLE,
        "draining",
        "ServiceUnavailable",
        None,
    )
}

/// No worker is available for the request.
pub(super) fn no_worker() -> Response<Body> {
    edge::error(
        StatusCode::SERVICE_UNAVAILABLE,
        "no worker available",
        "ServiceUnavailable",
        None,
    )
}

/// A worker's answer as the client gets it: its status and relayed headers, the body, and
/// the worker header.
pub(super) fn answered(
    status: StatusCode,
    headers: &hyper::HeaderMap,
    body: Body,
    worker: &str,
) -> Response<Body> {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    *response.headers_mut() = relay::relayed_headers(headers);
    with_worker(response, worker)
}

/// `response` with the header naming the worker that served it.
pub(super) fn with_worker(mut response: Response<Body>, worker: &str) -> Response<Body> {
    if let Ok(v) = HeaderValue::from_str(worker) {
        response.headers_mut().insert(WORKER_HEADER, v);
    }
    response
}
