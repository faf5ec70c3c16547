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

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;
    use hyper::HeaderMap;
    use hyper::header::{CONNECTION, CONTENT_TYPE, TRANSFER_ENCODING};

    use super::*;

    #[test]
    fn a_relayed_answer_keeps_the_workers_status_and_headers_and_names_the_worker() {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        headers.insert(CONNECTION, HeaderValue::from_static("keep-alive"));
        headers.insert(TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        let response = answered(
            StatusCode::TOO_MANY_REQUESTS,
            &headers,
            edge::full(bytes::Bytes::from_static(b"{}")),
            "http://10.0.0.5:8000",
        );
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[CONTENT_TYPE], "text/event-stream");
        assert_eq!(response.headers()[WORKER_HEADER], "http://10.0.0.5:8000");
        // Hop-by-hop headers are the worker's connection's, not the client's.
        assert!(!response.headers().contains_key(CONNECTION));
        assert!(!response.headers().contains_key(TRANSFER_ENCODING));
    }

    #[test]
    fn a_worker_name_that_is_no_header_value_is_left_out_not_a_panic() {
        let response = with_worker(draining(), "bad\nname");
        assert!(!response.headers().contains_key(WORKER_HEADER));
    }

    #[tokio::test]
    async fn the_routers_own_refusals_are_503s_in_openais_error_shape() {
        for (response, message) in [
            (draining(), "draining"),
            (no_worker(), "no worker available"),
        ] {
            assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
            let body = response.into_body().collect().await.unwrap().to_bytes();
            let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(json["error"]["message"], message);
            assert_eq!(json["error"]["type"], "ServiceUnavailable");
        }
    }
}
