//! Talking to the workers: one forwarded request, and its answer relayed to the client.
//!
//! The upstream URL is always a configured worker's base URL plus the matched route's own path
//! (never the client's path, a header or a body field); redirects are never followed (hyper's
//! client does not); only a fixed list of request headers is forwarded.
//!
//! A streamed answer is relayed frame by frame by a body the client's connection polls and
//! that polls the worker's ([`RelayBody`]: a slow client slows its worker, not the router's
//! memory), each frame awaited at most `stream_idle_timeout`. When the worker dies or goes
//! silent mid-stream the client gets an SSE error event and the end of the stream (no
//! `[DONE]`): never a silently truncated answer. When the client leaves, the body is dropped
//! with the worker's connection, and vLLM aborts the request.
//!
//! A whole (non-streamed) answer is read before it is relayed while it is short
//! ([`read_answer`], up to [`crate::server::BUFFERED_ANSWER_BYTES`]), so a worker that breaks
//! while sending it gets the client a 502; a longer one (logprobs of a long generation run to
//! megabytes) is relayed the same way as a stream, so that clients reading slowly hold a
//! bounded amount of the router's memory each, and a worker breaking in it aborts the
//! client's connection.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;

use crate::http::Aborted;
use crate::metrics::RefreshUsage;

/// The client to the workers (pooled keep-alive connections).
pub type Upstream = Client<HttpConnector, Full<Bytes>>;

/// A client to the workers with this connect timeout (for request bodies of type `B`).
pub fn client<B>(connect_timeout: Duration) -> Client<HttpConnector, B>
where
    B: HttpBody + Send + 'static,
    B::Data: Send,
{
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(connect_timeout));
    connector.set_nodelay(true);
    Client::builder(hyper_util::rt::TokioExecutor::new()).build(connector)
}

/// A request body that says when it was handed to the connection (retention's refreshes
/// must reach the engine before the request they are sent ahead of).
pub struct SignalBody {
    data: Option<Bytes>,
    written: Option<tokio::sync::oneshot::Sender<()>>,
}

impl SignalBody {
    /// `data`, and what fires once hyper took it to write.
    pub fn new(data: Bytes) -> (Self, tokio::sync::oneshot::Receiver<()>) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        (
            Self {
                data: Some(data),
                written: Some(tx),
            },
            rx,
        )
    }
}

impl HttpBody for SignalBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let frame = self.data.take().map(|d| Ok(Frame::data(d)));
        if frame.is_none()
            && let Some(tx) = self.written.take()
        {
            let _ = tx.send(());
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.data.as_ref().map_or(0, |d| d.len() as u64))
    }
}

impl Drop for SignalBody {
    fn drop(&mut self) {
        // Written or abandoned, the request it precedes may go now.
        if let Some(tx) = self.written.take() {
            let _ = tx.send(());
        }
    }
}

/// The client retention's refreshes go through.
pub type RefreshUpstream = Client<HttpConnector, SignalBody>;

/// The usage of a completion answer: `usage.prompt_tokens`, and
/// `usage.prompt_tokens_details.cached_tokens` (vLLM sends the details with
/// `--enable-prompt-tokens-details`, and then leaves them null when nothing was cached: read
/// as 0). None without `usage.prompt_tokens`. The engine's prefix-cache counters count a
/// refresh like any request, so a measurement that compares them with its clients' own
/// `cached_tokens` takes these out (`kvroute bench`, which also checks that the clients'
/// answers carry the details).
pub fn refresh_usage(answer: &[u8]) -> Option<RefreshUsage> {
    let answer: serde_json::Value = serde_json::from_slice(answer).ok()?;
    let usage = answer.get("usage")?;
    let cached = usage
        .get("prompt_tokens_details")
        .and_then(|d| d.get("cached_tokens"));
    Some(RefreshUsage {
        prompt_tokens: usage.get("prompt_tokens")?.as_u64()?,
        cached_tokens: match cached {
            Some(n) => n.as_u64()?,
            None => 0,
        },
    })
}

/// Request headers passed on to workers: everything else is hop-by-hop or the router's own.
pub const FORWARDED_HEADERS: [HeaderName; 4] = [
    header::CONTENT_TYPE,
    HeaderName::from_static("x-request-id"),
    HeaderName::from_static("traceparent"),
    HeaderName::from_static("tracestate"),
];

/// Response headers never relayed: hop-by-hop ones, the length (the router frames the answer
/// itself) and cookies a worker sets.
const DROPPED_RESPONSE_HEADERS: [HeaderName; 7] = [
    header::CONNECTION,
    header::TRANSFER_ENCODING,
    header::CONTENT_LENGTH,
    header::SET_COOKIE,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
];

/// The headers of the forwarded request: the allowed ones of the client's (values with CR, LF
/// or NUL cannot exist in a parsed `HeaderValue`), then `authorization` if given.
pub fn forwarded_headers(client: &HeaderMap, authorization: Option<&HeaderValue>) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(FORWARDED_HEADERS.len() + 1);
    for name in &FORWARDED_HEADERS {
        if let Some(v) = client.get(name) {
            out.insert(name.clone(), v.clone());
        }
    }
    if let Some(auth) = authorization {
        out.insert(header::AUTHORIZATION, auth.clone());
    }
    out
}

/// The worker's response headers the client gets.
pub fn relayed_headers(worker: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(worker.len());
    for (name, value) in worker {
        if !DROPPED_RESPONSE_HEADERS.contains(name) {
            out.append(name.clone(), value.clone());
        }
    }
    out
}

/// The SSE event that ends a stream the worker broke.
pub fn sse_error(message: &str) -> Bytes {
    let body = serde_json::json!({
        "error": {"message": message, "type": "UpstreamError", "param": null, "code": 502}
    });
    Bytes::from(format!("data: {body}\n\n"))
}

/// How a relayed answer ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// The worker sent all of it.
    Complete,
    /// The worker's connection failed mid-answer.
    Died,
    /// The worker sent nothing for the idle timeout.
    Silent,
    /// The client left first.
    ClientLeft,
}

impl Ending {
    /// What went wrong, for an error message (`idle`: the stream idle timeout).
    pub fn problem(self, idle: Option<Duration>) -> String {
        match self {
            Ending::Complete => "none".into(),
            Ending::Died => "its connection failed".into(),
            Ending::Silent => format!("silent for {}s", idle.unwrap_or_default().as_secs_f64()),
            Ending::ClientLeft => "the client left".into(),
        }
    }
}

/// The next data frame of `body`, waiting at most `idle` (None: without limit). `Ok(None)` at
/// the end of the body; `Err` with why it broke.
async fn next_data(body: &mut Incoming, idle: Option<Duration>) -> Result<Option<Bytes>, Ending> {
    loop {
        let frame = match idle {
            Some(t) => tokio::time::timeout(t, body.frame())
                .await
                .map_err(|_| Ending::Silent)?,
            None => body.frame().await,
        };
        match frame {
            None => return Ok(None),
            Some(Err(_)) => return Err(Ending::Died),
            Some(Ok(f)) => {
                if let Ok(data) = f.into_data() {
                    return Ok(Some(data));
                }
                // Trailers carry nothing the client needs.
            }
        }
    }
}

/// Where the complete events of `data` end: after its last blank line (`\n\n` or
/// `\r\n\r\n`), 0 when it holds none.
pub fn events_end(data: &[u8]) -> usize {
    let lf = data
        .windows(2)
        .rposition(|w| w == b"\n\n")
        .map_or(0, |i| i + 2);
    let crlf = data
        .windows(4)
        .rposition(|w| w == b"\r\n\r\n")
        .map_or(0, |i| i + 4);
    lf.max(crlf)
}

/// What a relayed answer tells the request that started it: its first bytes (vLLM sends a
/// stream's head before the prefill, so they, not the head, mark the end of the prefill) and
/// how it ended (dropped unfinished, which is the client leaving, counts as
/// [`Ending::ClientLeft`]).
pub trait RelayHooks: Send + Sync {
    fn first_data(&mut self);
    fn ended(self: Box<Self>, ending: Ending);
}

/// How a [`RelayBody`] cuts what it relays, and how a broken worker shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    /// Server-sent events, whole events at a time (a worker dying mid-event never leaves the
    /// client half an event to choke on); a broken or silent worker's stream ends with an SSE
    /// error event.
    Events,
    /// Bytes as they come (a whole answer too long to hold); a broken or silent worker ends
    /// the body with [`Aborted`], which closes the client's connection short of the answer.
    Bytes,
}

/// What a [`RelayBody`] sends after the worker's last bytes.
enum Tail {
    /// The SSE error event.
    Event(Bytes),
    /// The error that aborts the client's connection.
    Abort,
}

/// A worker's answer relayed as the client's response body, framed by [`Framing`].
///
/// The client's connection polls it and it polls the worker's body: no task or channel
/// between them, so a chunk costs one wake-up, and a slow client slows its worker (hyper
/// polls for the next chunk only once it has written the last), never the router's memory.
/// The idle timeout runs while it waits for the worker, from the moment it starts to.
pub struct RelayBody {
    upstream: Incoming,
    framing: Framing,
    idle: Option<Duration>,
    /// Armed while waiting for the worker (None: not waiting, or no idle timeout).
    silence: Option<Pin<Box<tokio::time::Sleep>>>,
    waiting: bool,
    /// What was read of the answer before relaying began, sent first.
    head: Option<Bytes>,
    /// Bytes of an event not yet complete.
    pending: BytesMut,
    worker: String,
    /// Taken when the stream ends: None once it has.
    hooks: Option<Box<dyn RelayHooks>>,
    /// What is still to send after the worker's bytes, then the end.
    tail: Option<Tail>,
}

impl RelayBody {
    /// Relay the event stream `upstream` from `worker`, at most `idle` between two chunks
    /// (None: no limit).
    pub fn events(
        upstream: Incoming,
        idle: Option<Duration>,
        worker: &str,
        hooks: Box<dyn RelayHooks>,
    ) -> Self {
        Self {
            upstream,
            framing: Framing::Events,
            idle,
            silence: None,
            waiting: false,
            head: None,
            pending: BytesMut::new(),
            worker: worker.to_owned(),
            hooks: Some(hooks),
            tail: None,
        }
    }

    /// Relay a whole answer that began with `head` (already read) and goes on in `upstream`.
    pub fn bytes(
        head: Bytes,
        upstream: Incoming,
        idle: Option<Duration>,
        worker: &str,
        hooks: Box<dyn RelayHooks>,
    ) -> Self {
        let mut body = Self::events(upstream, idle, worker, hooks);
        body.framing = Framing::Bytes;
        body.head = (!head.is_empty()).then_some(head);
        body
    }

    fn end(&mut self, ending: Ending) {
        if let Some(hooks) = self.hooks.take() {
            hooks.ended(ending);
        }
        if matches!(ending, Ending::Died | Ending::Silent) {
            self.tail = Some(match self.framing {
                Framing::Events => Tail::Event(sse_error(&format!(
                    "worker {} failed mid-stream: {}",
                    self.worker,
                    ending.problem(self.idle)
                ))),
                Framing::Bytes => Tail::Abort,
            });
        }
    }

    fn ended(&self) -> bool {
        self.hooks.is_none()
    }

    /// Whether the worker has been silent for the idle timeout (arming it when the wait starts).
    fn silent_for_too_long(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(idle) = self.idle else {
            return false;
        };
        if !self.waiting {
            self.waiting = true;
            let deadline = tokio::time::Instant::now() + idle;
            match &mut self.silence {
                Some(sleep) => sleep.as_mut().reset(deadline),
                None => self.silence = Some(Box::pin(tokio::time::sleep_until(deadline))),
            }
        }
        self.silence
            .as_mut()
            .is_some_and(|sleep| sleep.as_mut().poll(cx).is_ready())
    }
}

impl HttpBody for RelayBody {
    type Data = Bytes;
    type Error = Aborted;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Aborted>>> {
        let this = &mut *self;
        if let Some(head) = this.head.take() {
            return Poll::Ready(Some(Ok(Frame::data(head))));
        }
        loop {
            if this.ended() {
                return Poll::Ready(this.tail.take().map(|tail| match tail {
                    Tail::Event(event) => Ok(Frame::data(event)),
                    Tail::Abort => Err(Aborted),
                }));
            }
            let data = match Pin::new(&mut this.upstream).poll_frame(cx) {
                Poll::Pending => {
                    if this.silent_for_too_long(cx) {
                        this.end(Ending::Silent);
                        continue;
                    }
                    return Poll::Pending;
                }
                Poll::Ready(None) => {
                    this.end(Ending::Complete);
                    // A worker that ended without a final blank line: its last bytes still go.
                    if this.pending.is_empty() {
                        return Poll::Ready(None);
                    }
                    return Poll::Ready(Some(Ok(Frame::data(this.pending.split().freeze()))));
                }
                Poll::Ready(Some(Err(_))) => {
                    this.end(Ending::Died);
                    continue;
                }
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => data,
                    Err(_) => continue, // trailers carry nothing the client needs
                },
            };
            this.waiting = false;
            if let Some(hooks) = this.hooks.as_mut() {
                hooks.first_data();
            }
            if this.framing == Framing::Bytes
                || (this.pending.is_empty() && data.ends_with(b"\n\n"))
            {
                return Poll::Ready(Some(Ok(Frame::data(data)))); // no copy
            }
            this.pending.extend_from_slice(&data);
            let cut = events_end(&this.pending);
            if cut > 0 {
                return Poll::Ready(Some(Ok(Frame::data(this.pending.split_to(cut).freeze()))));
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended() && self.tail.is_none() && self.head.is_none()
    }

    /// A whole answer's exact length while its worker declared one (hyper then sends it as
    /// `Content-Length`); a stream's is unknown (events are regrouped, an error event may come).
    fn size_hint(&self) -> SizeHint {
        let upstream = self.upstream.size_hint();
        match (self.framing, upstream.exact()) {
            (Framing::Bytes, Some(rest)) => {
                SizeHint::with_exact(rest + self.head.as_ref().map_or(0, |h| h.len() as u64))
            }
            _ => SizeHint::default(),
        }
    }
}

impl Drop for RelayBody {
    fn drop(&mut self) {
        // Dropped before the end: the client left (hyper drops the body with its connection).
        if let Some(hooks) = self.hooks.take() {
            hooks.ended(Ending::ClientLeft);
        }
    }
}

/// The whole of `body` (at most `limit` bytes; a longer one is an error), each frame awaited
/// at most `idle`.
pub async fn collect(
    mut body: Incoming,
    idle: Option<Duration>,
    limit: usize,
) -> Result<Bytes, Ending> {
    match read_answer(&mut body, idle, limit).await? {
        AnswerStart::Whole(bytes) => Ok(bytes),
        AnswerStart::Head(_) => Err(Ending::Died),
    }
}

/// What [`read_answer`] read of a whole answer.
pub enum AnswerStart {
    /// All of it (at most the limit).
    Whole(Bytes),
    /// Its first bytes, past the limit by less than one frame; the rest is still to come.
    Head(Bytes),
}

/// Read a whole answer from `body` while it stays within `limit` bytes, each frame awaited at
/// most `idle`: [`AnswerStart::Head`] as soon as it passes the limit.
pub async fn read_answer(
    body: &mut Incoming,
    idle: Option<Duration>,
    limit: usize,
) -> Result<AnswerStart, Ending> {
    let mut out = BytesMut::new();
    while let Some(data) = next_data(body, idle).await? {
        out.extend_from_slice(&data);
        if out.len() > limit {
            return Ok(AnswerStart::Head(out.freeze()));
        }
    }
    Ok(AnswerStart::Whole(out.freeze()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refresh_answers_usage_reads_null_details_as_nothing_cached() {
        let vllm = br#"{"id":"cmpl-1","choices":[{"text":"x"}],"usage":{"prompt_tokens":2033,
            "total_tokens":2034,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":2032}}}"#;
        assert_eq!(
            refresh_usage(vllm),
            Some(RefreshUsage {
                prompt_tokens: 2033,
                cached_tokens: 2032
            })
        );
        let missed = br#"{"usage":{"prompt_tokens":17,"prompt_tokens_details":null}}"#;
        assert_eq!(
            refresh_usage(missed),
            Some(RefreshUsage {
                prompt_tokens: 17,
                cached_tokens: 0
            })
        );
        assert_eq!(refresh_usage(br#"{"choices":[]}"#), None);
        assert_eq!(refresh_usage(b"not json"), None);
        assert_eq!(refresh_usage(br#"{"usage":{"prompt_tokens":-1}}"#), None);
    }

    #[test]
    fn only_the_allowed_request_headers_go_to_a_worker() {
        let mut client = HeaderMap::new();
        client.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        client.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer client"),
        );
        client.insert(header::COOKIE, HeaderValue::from_static("a=b"));
        client.insert("x-request-id", HeaderValue::from_static("r1"));
        let out = forwarded_headers(&client, None);
        assert_eq!(out.len(), 2);
        assert!(out.get(header::AUTHORIZATION).is_none());
        let key = HeaderValue::from_static("Bearer worker");
        let out = forwarded_headers(&client, Some(&key));
        assert_eq!(out[header::AUTHORIZATION], "Bearer worker");
    }

    #[test]
    fn cookies_and_hop_by_hop_headers_stay_with_the_worker() {
        let mut worker = HeaderMap::new();
        worker.insert(header::SET_COOKIE, HeaderValue::from_static("s=1"));
        worker.insert(header::CONTENT_LENGTH, HeaderValue::from_static("5"));
        worker.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        let out = relayed_headers(&worker);
        assert_eq!(out.len(), 1);
        assert_eq!(out[header::CONTENT_TYPE], "text/event-stream");
    }

    #[test]
    fn events_end_after_the_last_blank_line() {
        assert_eq!(events_end(b"data: a\n\ndata: b"), 9);
        assert_eq!(events_end(b"data: a\r\n\r\ndata: b\n\n"), 20);
        assert_eq!(events_end(b"data: half"), 0);
    }

    #[test]
    fn the_error_event_is_one_sse_data_line() {
        let e = sse_error("gone");
        let text = std::str::from_utf8(&e).unwrap();
        assert!(text.starts_with("data: {") && text.ends_with("}\n\n"));
        let v: serde_json::Value = serde_json::from_str(&text[6..]).unwrap();
        assert_eq!(v["error"]["message"], "gone");
    }
}
