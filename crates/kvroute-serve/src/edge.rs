//! The client-facing edge: what one client may send or hold before routing sees its request.
//!
//! - a body limit checked against `Content-Length` before anything is read (413), and again
//!   while a chunked body arrives;
//! - a body timeout from the end of the head (408);
//! - a budget of body bytes held in memory at once, across all requests ([`BodyBudget`]): a
//!   body that would exceed it is answered 503 as soon as it would, instead of letting many
//!   large bodies at once take the process's memory;
//! - `Content-Encoding` other than `identity` refused (415): a 60 KB deflate body would
//!   otherwise expand to 60 MB past every limit;
//! - the API key, compared in constant time.
//!
//! The head's own timeout and the connection limit are the server's ([`crate::server`]):
//! hyper's `header_read_timeout`, and a count of open connections past which a new one is
//! answered 503 and closed instead of left to exhaust the file descriptors.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::header::{CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE, HeaderValue};
use hyper::{Request, Response, StatusCode};

use crate::metrics::Metrics;

// The server names the shared HTTP answers through the edge (`edge::error`, `edge::Body`...).
pub use crate::http::{Aborted, Body, canned, error, full};

/// Request bodies without a tokenizer maximum length to derive a limit from.
pub const DEFAULT_MAX_BODY_BYTES: usize = 64 << 20;
/// Bytes of request body outside the prompt a derived limit allows: sampling parameters,
/// message wrappers, tool definitions.
pub const BODY_ENVELOPE_BYTES: usize = 1 << 20;

/// The request body limit and where it came from (for the start-up line).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BodyLimit {
    pub bytes: usize,
    pub source: String,
}

impl BodyLimit {
    /// `given` (`--max-body-bytes`), else derived from the tokenizer's `(maximum length, longest
    /// token's bytes)` ([`derived_max_body_bytes`]), else [`DEFAULT_MAX_BODY_BYTES`].
    pub fn new(given: Option<usize>, tokenizer: Option<(usize, usize)>) -> Self {
        let (bytes, source) = match (given, tokenizer) {
            (Some(bytes), _) => (bytes, "--max-body-bytes".to_owned()),
            (None, Some((max_length, longest))) => (
                derived_max_body_bytes(max_length, longest),
                format!(
                    "derived: {max_length} tokens x max(3 x {longest}, 12) bytes + {} MiB",
                    BODY_ENVELOPE_BYTES >> 20
                ),
            ),
            (None, None) => (
                DEFAULT_MAX_BODY_BYTES,
                "default: the tokenizer states no maximum length".to_owned(),
            ),
        };
        Self { bytes, source }
    }
}

/// The largest body a prompt of `max_length` tokens can need, plus an envelope.
///
/// One token takes at most its longest vocabulary entry's bytes as text, three times that
/// when a client escapes non-ASCII text as `\uXXXX` (a 2-byte character becomes 6 bytes, a
/// 4-byte one 12), or 12 bytes as a token id (ten digits, a comma, a space):
/// `max_length * max(3 * longest_token_bytes, 12) + BODY_ENVELOPE_BYTES`, capped at
/// [`DEFAULT_MAX_BODY_BYTES`]. A batch of prompts counts as their sum (raise
/// `--max-body-bytes` for large batches).
pub fn derived_max_body_bytes(max_length: usize, longest_token_bytes: usize) -> usize {
    let per_token = (3 * longest_token_bytes).max(12);
    max_length
        .saturating_mul(per_token)
        .saturating_add(BODY_ENVELOPE_BYTES)
        .min(DEFAULT_MAX_BODY_BYTES)
}

/// Why a body was not read: the response to send instead.
pub fn too_large(limit: usize) -> Response<Body> {
    error(
        StatusCode::PAYLOAD_TOO_LARGE,
        &format!("request body larger than {limit} bytes (--max-body-bytes)"),
        "BadRequestError",
        None,
    )
}

/// The body length a request declares.
pub fn declared_length(headers: &hyper::HeaderMap) -> Option<u64> {
    headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// The answer refusing a generation request from its head alone, before its body is read:
/// 413 for a declared length over `limit` (whatever it claims to be), 400 for a
/// `Content-Type` other than JSON.
pub fn refuse_early(
    headers: &hyper::HeaderMap,
    limit: usize,
    metrics: &Metrics,
) -> Option<Response<Body>> {
    if declared_length(headers).is_some_and(|n| n > limit as u64) {
        metrics.rejected("body_too_large");
        return Some(too_large(limit));
    }
    let json = headers.get(CONTENT_TYPE).is_some_and(|v| {
        let essence = v
            .as_bytes()
            .split(|&b| b == b';')
            .next()
            .unwrap_or_default();
        essence
            .trim_ascii()
            .eq_ignore_ascii_case(b"application/json")
    });
    (!json).then(|| {
        error(
            StatusCode::BAD_REQUEST,
            "Content-Type must be application/json",
            "BadRequestError",
            None,
        )
    })
}

/// Bytes a body reserves before its first byte is read (then twice as much each time it
/// outgrows its reservation).
const FIRST_BODY_RESERVATION: usize = 16 * 1024;

/// The request body bytes all requests may hold in memory at once, from before a body is read
/// until its request has been forwarded (the body is kept for retries until a worker answers).
/// A body's reservation grows with what has arrived (doubling, up to its declared length), not
/// with what it declares: a client that declares 64 MiB and sends slowly holds what it sent,
/// and cannot lock other bodies out with promises.
#[derive(Clone, Debug)]
pub struct BodyBudget {
    /// One permit per KiB.
    kib: Arc<tokio::sync::Semaphore>,
    bytes: usize,
}

/// A body's share of the [`BodyBudget`], given back when dropped.
#[derive(Debug)]
pub struct BodyReservation {
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl BodyBudget {
    /// A budget of `bytes` (rounded up to whole KiB).
    pub fn new(bytes: usize) -> Self {
        let kib = bytes
            .div_ceil(1024)
            .min(tokio::sync::Semaphore::MAX_PERMITS);
        Self {
            kib: Arc::new(tokio::sync::Semaphore::new(kib)),
            bytes,
        }
    }

    /// The budget, in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Bytes reserved by the bodies held now.
    pub fn held_bytes(&self) -> usize {
        (self.bytes.div_ceil(1024) - self.kib.available_permits()) * 1024
    }

    /// `bytes` more for `reservation`, if the budget has them now.
    fn grow(&self, reservation: &mut BodyReservation, bytes: usize) -> bool {
        let want = u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX);
        let Ok(permit) = self.kib.clone().try_acquire_many_owned(want) else {
            return false;
        };
        match &mut reservation.permit {
            Some(held) => held.merge(permit),
            None => reservation.permit = Some(permit),
        }
        true
    }
}

/// Marks a refusal that sheds load — no room now, retry later — rather than one refusing the
/// request for what it is. The edge sets it in the refusing response's extensions
/// ([`over_budget`]); serve answers such a response as it stands (503 with `Retry-After`, a
/// proxy's overload answer), and a front whose protocol gives shedding a status of its own
/// (the Endpoint Picker's 429) reads this mark, not the message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shed {
    /// `--max-buffered-body-bytes` is full.
    BodyBudget,
}

/// Why `response` was refused for want of room, None when it was not ([`Shed`]).
pub fn shed_of<B>(response: &Response<B>) -> Option<Shed> {
    response.extensions().get::<Shed>().copied()
}

/// The 503 for a body the [`BodyBudget`] has no room for, marked [`Shed::BodyBudget`].
fn over_budget(budget: &BodyBudget, metrics: &Metrics) -> Response<Body> {
    metrics.rejected("body_budget");
    let mut response = error(
        StatusCode::SERVICE_UNAVAILABLE,
        &format!(
            "the router holds {} bytes of request bodies at most (--max-buffered-body-bytes) and \
             has no room for this one now; retry",
            budget.bytes()
        ),
        "ServiceUnavailableError",
        None,
    );
    response
        .headers_mut()
        .insert(hyper::header::RETRY_AFTER, HeaderValue::from_static("1"));
    response.extensions_mut().insert(Shed::BodyBudget);
    response
}

/// The whole request body and its reservation in `budget` (keep it while the body is held),
/// or the response that refuses it (counted in `metrics`); its head has passed
/// [`refuse_early`]. Any body: a serve connection's, or the chunks a gateway streams to the
/// Endpoint Picker.
pub async fn read_body<B>(
    request: Request<B>,
    limit: usize,
    timeout: Duration,
    budget: &BodyBudget,
    metrics: &Metrics,
) -> Result<(Bytes, BodyReservation), Response<Body>>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let headers = request.headers();
    if let Some(encoding) = headers.get(CONTENT_ENCODING)
        && !encoding.as_bytes().eq_ignore_ascii_case(b"identity")
    {
        metrics.rejected("content_encoding");
        return Err(error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "compressed request bodies are not accepted (send it uncompressed)",
            "BadRequestError",
            None,
        ));
    }
    // A declared length over the limit was refused before (`refuse_early`); Limited stops
    // a chunked body at the limit.
    let most = declared_length(headers)
        .and_then(|n| usize::try_from(n).ok())
        .unwrap_or(limit)
        .min(limit);
    let mut reservation = BodyReservation { permit: None };
    let mut reserved = most.min(FIRST_BODY_RESERVATION);
    if !budget.grow(&mut reservation, reserved) {
        return Err(over_budget(budget, metrics));
    }
    let mut body = Limited::new(request.into_body(), limit);
    let read = async {
        let mut data = bytes::BytesMut::with_capacity(reserved);
        while let Some(frame) = body.frame().await {
            let Ok(chunk) = frame?.into_data() else {
                continue; // trailers
            };
            if data.len() + chunk.len() > reserved {
                let need = data.len() + chunk.len();
                let more = need.max(2 * reserved).min(most.max(need)) - reserved;
                if !budget.grow(&mut reservation, more) {
                    return Ok(None);
                }
                reserved += more;
            }
            data.extend_from_slice(&chunk);
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(Some(data.freeze()))
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(Ok(None)) => Err(over_budget(budget, metrics)),
        Err(_) => {
            metrics.client_timeout("body");
            Err(error(
                StatusCode::REQUEST_TIMEOUT,
                "request body not received in time (--body-timeout)",
                "RequestTimeout",
                None,
            ))
        }
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            metrics.rejected("body_too_large");
            Err(too_large(limit))
        }
        Ok(Err(_)) => Err(error(
            StatusCode::BAD_REQUEST,
            "request body could not be read",
            "BadRequestError",
            None,
        )),
        Ok(Ok(Some(data))) => Ok((data, reservation)),
    }
}

/// Whether `header` (an `Authorization` value) carries the bearer `key`: the scheme
/// case-insensitive (RFC 7235), the token without surrounding whitespace, compared in constant
/// time in the key's length.
pub fn bearer_matches(header: Option<&HeaderValue>, key: &[u8]) -> bool {
    let Some(given) = header.map(HeaderValue::as_bytes) else {
        return false;
    };
    let Some((scheme, token)) = given.split_at_checked(6) else {
        return false;
    };
    if !scheme.eq_ignore_ascii_case(b"bearer")
        || !token.first().is_some_and(u8::is_ascii_whitespace)
    {
        return false;
    }
    let token = token.trim_ascii();
    if token.len() != key.len() {
        return false;
    }
    token.iter().zip(key).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_limit_is_given_derived_from_the_tokenizer_or_the_default() {
        assert_eq!(derived_max_body_bytes(8192, 22), 8192 * 66 + (1 << 20));
        assert_eq!(derived_max_body_bytes(8192, 2), 8192 * 12 + (1 << 20)); // ids: 12 bytes each
        assert_eq!(
            derived_max_body_bytes(1_000_000, 100),
            DEFAULT_MAX_BODY_BYTES
        ); // capped
        assert_eq!(
            derived_max_body_bytes(usize::MAX, 100),
            DEFAULT_MAX_BODY_BYTES
        );
        let derived = BodyLimit::new(None, Some((8192, 22)));
        assert_eq!(derived.bytes, 8192 * 66 + (1 << 20));
        assert!(
            derived
                .source
                .starts_with("derived: 8192 tokens x max(3 x 22, 12)")
        );
        assert_eq!(BodyLimit::new(Some(5), Some((8192, 22))).bytes, 5);
        assert_eq!(BodyLimit::new(None, None).bytes, DEFAULT_MAX_BODY_BYTES);
    }

    #[test]
    fn the_bearer_token_must_match_exactly() {
        let key = b"s3cret";
        let v = |s: &'static str| HeaderValue::from_static(s);
        assert!(bearer_matches(Some(&v("Bearer s3cret")), key));
        assert!(bearer_matches(Some(&v("bearer  s3cret ")), key));
        assert!(!bearer_matches(Some(&v("Bearers3cret")), key));
        assert!(!bearer_matches(Some(&v("Bearer s3cre")), key));
        assert!(!bearer_matches(Some(&v("Bearer s3cretx")), key));
        assert!(!bearer_matches(Some(&v("Basic s3cret")), key));
        assert!(!bearer_matches(None, key));
    }

    fn post(body: &'static [u8]) -> Request<http_body_util::Full<Bytes>> {
        let mut request = Request::new(http_body_util::Full::new(Bytes::from_static(body)));
        request.headers_mut().insert(
            CONTENT_LENGTH,
            HeaderValue::from_str(&body.len().to_string()).unwrap(),
        );
        request
    }

    #[tokio::test]
    async fn a_body_the_budget_has_no_room_for_is_shed_and_marked_so() {
        let m = Metrics::default();
        let full = BodyBudget::new(0);
        let t = Duration::from_secs(5);
        let refused = read_body(post(b"{\"prompt\": 1}"), 100, t, &full, &m)
            .await
            .unwrap_err();
        assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(refused.headers()[hyper::header::RETRY_AFTER], "1");
        assert_eq!(shed_of(&refused), Some(Shed::BodyBudget));
        // A refusal of the request itself is no shedding.
        let roomy = BodyBudget::new(1 << 20);
        let too_large = read_body(post(b"{\"prompt\": 1}"), 4, t, &roomy, &m)
            .await
            .unwrap_err();
        assert_eq!(too_large.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(shed_of(&too_large), None);
        assert!(read_body(post(b"{}"), 100, t, &roomy, &m).await.is_ok());
    }

    #[test]
    fn only_json_bodies_of_a_declared_length_within_the_limit_are_read() {
        let m = Metrics::default();
        let head = |ct: &'static str, len: &'static str| {
            let mut h = hyper::HeaderMap::new();
            h.insert(CONTENT_TYPE, HeaderValue::from_static(ct));
            h.insert(CONTENT_LENGTH, HeaderValue::from_static(len));
            h
        };
        assert!(refuse_early(&head("application/json", "10"), 100, &m).is_none());
        assert!(refuse_early(&head("Application/JSON; charset=utf-8", "10"), 100, &m).is_none());
        let r = refuse_early(&head("text/plain", "10"), 100, &m).unwrap();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        let r = refuse_early(&head("text/plain", "1000"), 100, &m).unwrap();
        assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE); // the size first
    }
}
