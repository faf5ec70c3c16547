//! The router's HTTP answers, shared by the edge, the relay and the server: the [`Body`] every
//! response carries, the [`Aborted`] error a relayed body stops with, and OpenAI-style errors
//! (as a response, or as a whole HTTP/1.1 answer written to a connection the router closes).
//! A leaf: it imports no other module of the crate.

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::{Response, StatusCode};

/// What the router answers with: whole bodies and relayed streams alike.
pub type Body = BoxBody<Bytes, Aborted>;

/// Why a response body stopped short: its worker broke in the middle of an answer too long to
/// hold ([`crate::relay::Framing::Bytes`]). hyper then closes the client's connection without
/// ending the message, so the client sees the answer incomplete rather than cut short quietly.
#[derive(Debug)]
pub struct Aborted;

impl std::fmt::Display for Aborted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the worker broke mid-answer")
    }
}

impl std::error::Error for Aborted {}

/// A whole body.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).map_err(never).boxed()
}

/// The error of a body that cannot fail, as the router's [`Body`] error.
pub fn never(never: Infallible) -> Aborted {
    match never {}
}

/// The body of an OpenAI-style error.
pub fn error_json(status: StatusCode, message: &str, err_type: &str, param: Option<&str>) -> Bytes {
    let body = serde_json::json!({
        "error": {"message": message, "type": err_type, "param": param, "code": status.as_u16()}
    });
    Bytes::from(body.to_string())
}

/// A whole HTTP/1.1 answer carrying an OpenAI-style error, for a connection the router writes
/// to itself and closes (`extra_headers`: more `Name: value\r\n` lines).
pub fn canned(status: StatusCode, extra_headers: &str, message: &str, err_type: &str) -> Vec<u8> {
    let body = error_json(status, message, err_type, None);
    let mut out = format!(
        "HTTP/1.1 {} {}\r\nConnection: close\r\n{extra_headers}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out
}

/// An OpenAI-style error response.
pub fn error(
    status: StatusCode,
    message: &str,
    err_type: &str,
    param: Option<&str>,
) -> Response<Body> {
    let mut response = Response::new(full(error_json(status, message, err_type, param)));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_canned_answer_declares_its_body_length() {
        let answer = canned(
            StatusCode::SERVICE_UNAVAILABLE,
            "Retry-After: 1\r\n",
            "busy",
            "ServiceUnavailable",
        );
        let text = String::from_utf8(answer).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 503 Service Unavailable\r\n"));
        assert!(head.contains("Retry-After: 1\r\n"));
        assert!(head.ends_with(&format!("Content-Length: {}", body.len())));
        assert!(body.contains("\"busy\""));
    }

    #[test]
    fn errors_are_openai_shaped() {
        let body = error_json(
            StatusCode::BAD_REQUEST,
            "bad \"x\"",
            "BadRequestError",
            Some("prompt"),
        );
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["message"], "bad \"x\"");
        assert_eq!(v["error"]["param"], "prompt");
        assert_eq!(v["error"]["code"], 400);
    }
}
