//! One request at the gateway, as its ext_proc stream: the request's headers and body read as
//! `kvroute serve` reads a body (the same limit, budget, timeout and refusals, answered as
//! immediate responses), the prompt parsed and routed by serve's pipeline, the chosen worker
//! named to the gateway, then the response followed (its status; the stream's end is the
//! request's end) to hold the load the decision put on the worker until then.
//!
//! The response's body is the gateway's to leave out (`response_body_mode: NONE`, with
//! response trailers `SEND` so that Envoy keeps the stream open to the response's end): Envoy
//! ignores an ext_proc server's `mode_override` whenever a body mode is
//! `FULL_DUPLEX_STREAMED`, which GIE requires of the request. A gateway that streams the
//! response body anyway gets each chunk back unchanged (counted).

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Message;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpHeaders, ProcessingRequest, ProcessingResponse,
};
use http_body_util::BodyExt;
use hyper::StatusCode;
use kvroute_serve::edge::{self, Body};
use kvroute_serve::prompt::Route;
use kvroute_serve::server::pipeline::unmet_expectation;
use kvroute_serve::server::{Attempt, InFlight, Pipeline};
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tonic::{Status, Streaming};

use crate::counters::Counters;
use crate::protocol::{self, Part};

/// Request body chunks handed back to the gateway per message.
const BODY_CHUNK: usize = 64 << 10;

/// What every exchange shares.
pub struct Picker {
    pub pipeline: Pipeline,
    pub counters: Arc<Counters>,
    /// Rotates requests without a prompt over the workers.
    next: AtomicUsize,
}

impl Picker {
    pub fn new(pipeline: Pipeline, counters: Arc<Counters>) -> Self {
        Self {
            pipeline,
            counters,
            next: AtomicUsize::new(0),
        }
    }

    /// Names of the workers the subset hint leaves out (none without a hint).
    fn excluded(&self, subset: Option<&[String]>) -> Vec<String> {
        let Some(subset) = subset else {
            return Vec::new();
        };
        let fleet = self.pipeline.fleet();
        fleet
            .members()
            .iter()
            .filter(|m| {
                protocol::endpoint_of(&m.url).is_none_or(|e| !subset.iter().any(|s| s == e))
            })
            .map(|m| m.name.clone())
            .collect()
    }

    /// An available worker not `excluded`, rotating (requests without a prompt): its endpoint.
    fn rotate(&self, excluded: &[String]) -> Option<String> {
        let now = self.pipeline.now();
        let fleet = self.pipeline.fleet();
        let eligible: Vec<&str> = fleet
            .members()
            .iter()
            .filter(|m| m.available(now) && !excluded.contains(&m.name))
            .filter_map(|m| protocol::endpoint_of(&m.url))
            .collect();
        if eligible.is_empty() {
            return None;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % eligible.len();
        Some(eligible[i].to_owned())
    }
}

/// The request body as the gateway streams it on the ext_proc stream, read in place by serve's
/// body reader (no task or channel between them): each body message's bytes, until one marks
/// the body's end or the request's trailers come.
struct StreamedBody<'a> {
    inbound: &'a mut Streaming<ProcessingRequest>,
    /// The body is whole.
    ended: bool,
    /// It ended with the request's trailers (the gateway waits for their answer too).
    trailers: bool,
    /// The stream ended, or broke, before the body was whole.
    gone: bool,
}

impl<'a> StreamedBody<'a> {
    fn new(inbound: &'a mut Streaming<ProcessingRequest>) -> Self {
        Self {
            inbound,
            ended: false,
            trailers: false,
            gone: false,
        }
    }
}

/// The ext_proc stream ended before the request's body was whole.
#[derive(Debug)]
struct StreamGone;

impl std::fmt::Display for StreamGone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the gateway's stream ended before the request body was whole")
    }
}

impl std::error::Error for StreamGone {}

impl hyper::body::Body for StreamedBody<'_> {
    type Data = Bytes;
    type Error = StreamGone;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, StreamGone>>> {
        while !self.ended {
            match std::task::ready!(Pin::new(&mut *self.inbound).poll_next(cx)) {
                Some(Ok(ProcessingRequest {
                    request: Some(Message::RequestBody(body)),
                    ..
                })) => {
                    self.ended = body.end_of_stream;
                    if !body.body.is_empty() {
                        let data = Bytes::from(body.body);
                        return Poll::Ready(Some(Ok(hyper::body::Frame::data(data))));
                    }
                }
                Some(Ok(ProcessingRequest {
                    request: Some(Message::RequestTrailers(_)),
                    ..
                })) => {
                    self.trailers = true;
                    self.ended = true;
                }
                Some(Ok(_)) => {}
                None | Some(Err(_)) => {
                    self.gone = true;
                    return Poll::Ready(Some(Err(StreamGone)));
                }
            }
        }
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }
}

/// Where the exchange's answers go.
type Outbox = mpsc::Sender<Result<ProcessingResponse, Status>>;

/// The generation routes, as serve routes them (`POST` only).
fn generation_route(method: &str, path: &str) -> Option<(Route, &'static str)> {
    if method != "POST" {
        return None;
    }
    match path.split('?').next().unwrap_or(path) {
        "/v1/completions" => Some((Route::Completions, "/v1/completions")),
        "/v1/chat/completions" => Some((Route::Chat, "/v1/chat/completions")),
        _ => None,
    }
}

/// serve's answer as the gateway sends it instead: its status as the protocol gives it
/// ([`protocol::gateway_status`]: 429 for shedding), its content type, `Retry-After` and body.
async fn immediate_of(response: hyper::Response<Body>) -> (u16, ProcessingResponse) {
    let shed = edge::shed_of(&response);
    let (parts, body) = response.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let headers: Vec<(String, String)> = parts
        .headers
        .iter()
        .filter(|(k, _)| *k == hyper::header::CONTENT_TYPE || *k == hyper::header::RETRY_AFTER)
        .filter_map(|(k, v)| Some((k.as_str().to_owned(), v.to_str().ok()?.to_owned())))
        .collect();
    let status = protocol::gateway_status(parts.status.as_u16(), shed);
    (status, protocol::immediate(status, &headers, body.to_vec()))
}

/// Answer the request with serve's `response` (counted by the status the gateway sends).
async fn refuse(picker: &Picker, out: &Outbox, label: &str, response: hyper::Response<Body>) {
    let (status, answer) = immediate_of(response).await;
    picker.counters.immediate(status);
    picker.pipeline.metrics().request(label, status);
    let _ = out.send(Ok(answer)).await;
}

fn unavailable(message: &str) -> hyper::Response<Body> {
    edge::error(
        StatusCode::SERVICE_UNAVAILABLE,
        message,
        "ServiceUnavailable",
        None,
    )
}

/// How the request's body ended: its bytes and whether trailers came after them, or the
/// answer refusing it, or the stream's end before it was whole.
enum BodyEnd {
    Read(Bytes, bool, edge::BodyReservation),
    Refused(hyper::Response<Body>),
    Gone,
}

/// Read the request's body from the stream's body messages with serve's body reader, until the
/// body ends or the reader refuses it.
async fn read_body(
    picker: &Picker,
    inbound: &mut Streaming<ProcessingRequest>,
    head: hyper::HeaderMap,
) -> BodyEnd {
    let mut body = StreamedBody::new(inbound);
    let mut request = hyper::Request::new(&mut body);
    *request.headers_mut() = head;
    let read = picker.pipeline.read_body(request).await;
    match read {
        _ if body.gone => BodyEnd::Gone,
        Ok((raw, reservation)) => BodyEnd::Read(raw, body.trailers, reservation),
        Err(refusal) => BodyEnd::Refused(refusal),
    }
}

/// Serve one ext_proc stream to its end.
pub async fn exchange(picker: Arc<Picker>, mut inbound: Streaming<ProcessingRequest>, out: Outbox) {
    let _open = picker.counters.open();
    let Ok(Some(first)) = inbound.message().await else {
        picker.counters.stream_error();
        return;
    };
    // A gateway streaming the response body full-duplex needs each chunk sent back.
    let response_body_mode = first
        .protocol_config
        .as_ref()
        .map_or(BodySendMode::None as i32, |c| c.response_body_mode);
    let subset = protocol::subset_hint(first.metadata_context.as_ref());
    let Some(Message::RequestHeaders(headers)) = first.request else {
        picker.counters.stream_error();
        let _ = out
            .send(Err(Status::invalid_argument(
                "the first message of a stream must carry the request headers",
            )))
            .await;
        return;
    };
    let Some(picked) = decide(&picker, &mut inbound, &out, &headers, subset.as_deref()).await
    else {
        return;
    };
    follow(&picker, &mut inbound, &out, picked, response_body_mode).await;
}

/// A request the EPP named a worker for: the load its decision holds (none without a prompt),
/// the request in flight, and its metric label.
struct Picked {
    attempt: Option<Attempt>,
    _in_flight: InFlight,
    label: &'static str,
}

/// Read the request, choose its worker and tell the gateway; None when the request was answered
/// (immediate response) or its stream ended.
async fn decide(
    picker: &Picker,
    inbound: &mut Streaming<ProcessingRequest>,
    out: &Outbox,
    headers: &HttpHeaders,
    subset: Option<&[String]>,
) -> Option<Picked> {
    let pipeline = &picker.pipeline;
    let (head, path, method) = protocol::request_head(headers);
    let route = generation_route(&method, &path);
    let label = route.map_or("other", |r| r.1);
    if pipeline.draining() {
        refuse(picker, out, label, unavailable("draining")).await;
        return None;
    }
    if let Some(refusal) = unmet_expectation(&head) {
        refuse(picker, out, label, refusal).await;
        return None;
    }
    let excluded = picker.excluded(subset);
    let no_endpoint = || unavailable("no worker available");
    if headers.end_of_stream {
        // No body (a GET): any eligible worker.
        let Some(endpoint) = picker.rotate(&excluded) else {
            refuse(picker, out, label, no_endpoint()).await;
            return None;
        };
        picker.counters.picked(false);
        send(out, protocol::destination(&endpoint, None)).await?;
        return Some(Picked {
            attempt: None,
            _in_flight: pipeline.in_flight(),
            label,
        });
    }
    if route.is_some()
        && let Some(refusal) = pipeline.refuse_early(&head)
    {
        refuse(picker, out, label, refusal).await;
        return None;
    }
    let (raw, trailers, _reservation) = match read_body(picker, inbound, head).await {
        BodyEnd::Read(raw, trailers, reservation) => (raw, trailers, reservation),
        BodyEnd::Refused(refusal) => {
            refuse(picker, out, label, refusal).await;
            return None;
        }
        BodyEnd::Gone => {
            picker.counters.stream_error();
            return None;
        }
    };
    let (endpoint, attempt) = match route {
        Some((route, _)) => {
            let admitted = match pipeline.prompt(route, &raw).await {
                Ok(a) => a,
                Err(refusal) => {
                    refuse(picker, out, label, refusal).await;
                    return None;
                }
            };
            // A worker whose URL names no port cannot be a gateway's destination.
            let mut excluded = excluded;
            let mut found = None;
            while let Some(d) = pipeline.decide(&admitted, &excluded, false).await {
                match protocol::endpoint_of(&d.dispatch.url) {
                    Some(e) => {
                        found = Some((e.to_owned(), d));
                        break;
                    }
                    None => excluded.push(d.dispatch.name.clone()),
                }
            }
            let Some((endpoint, attempt)) = found else {
                refuse(picker, out, label, no_endpoint()).await;
                return None;
            };
            picker.counters.picked(true);
            (endpoint, Some(attempt))
        }
        None => {
            let Some(endpoint) = picker.rotate(&excluded) else {
                refuse(picker, out, label, no_endpoint()).await;
                return None;
            };
            picker.counters.picked(false);
            (endpoint, None)
        }
    };
    let in_flight = pipeline.in_flight();
    send(out, protocol::destination(&endpoint, Some(raw.len()))).await?;
    let mut chunks = raw.chunks(BODY_CHUNK).peekable();
    if chunks.peek().is_none() {
        send(out, protocol::body_back(&[], true, true)).await?;
    }
    while let Some(chunk) = chunks.next() {
        send(
            out,
            protocol::body_back(chunk, chunks.peek().is_none(), true),
        )
        .await?;
    }
    if trailers {
        send(out, protocol::carry_on(Part::RequestTrailers)).await?;
    }
    Some(Picked {
        attempt,
        _in_flight: in_flight,
        label,
    })
}

async fn send(out: &Outbox, response: ProcessingResponse) -> Option<()> {
    out.send(Ok(response)).await.ok()
}

/// Follow the response until the stream ends: its status counts for the worker as serve counts
/// an answer's, its headers end the prompt's prefill charge, the stream's end ends the load.
async fn follow(
    picker: &Picker,
    inbound: &mut Streaming<ProcessingRequest>,
    out: &Outbox,
    mut picked: Picked,
    response_body_mode: i32,
) {
    loop {
        let message = match inbound.message().await {
            Ok(Some(m)) => m,
            Ok(None) => return,
            Err(_) => {
                picker.counters.stream_error();
                return;
            }
        };
        let answer = match message.request {
            Some(Message::ResponseHeaders(h)) => {
                // The gateway holds the response's first byte until this answer: answer, then
                // count.
                if send(out, protocol::carry_on(Part::ResponseHeaders))
                    .await
                    .is_none()
                {
                    return;
                }
                let status = protocol::response_status(&h);
                picker.pipeline.metrics().request(picked.label, status);
                if let Some(d) = &mut picked.attempt {
                    if let Ok(s) = StatusCode::from_u16(status) {
                        picker.pipeline.answered(&d.dispatch.name, s);
                    }
                    d.load.first_byte();
                }
                continue;
            }
            Some(Message::ResponseBody(b)) => {
                picker.counters.response_chunk();
                if response_body_mode == BodySendMode::FullDuplexStreamed as i32 {
                    protocol::body_back(&b.body, b.end_of_stream, false)
                } else {
                    protocol::carry_on(Part::ResponseBody)
                }
            }
            Some(Message::ResponseTrailers(_)) => protocol::carry_on(Part::ResponseTrailers),
            Some(Message::RequestTrailers(_)) => protocol::carry_on(Part::RequestTrailers),
            _ => continue,
        };
        if send(out, answer).await.is_none() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Answer;
    use kvroute_serve::metrics::Metrics;

    use super::*;

    /// Headers as `(name, value)`.
    type Headers = Vec<(String, Vec<u8>)>;

    /// The immediate response's status, its headers and its body.
    fn parts(answer: &ProcessingResponse) -> (i32, Headers, Vec<u8>) {
        let Some(Answer::ImmediateResponse(r)) = &answer.response else {
            panic!("an immediate response");
        };
        let headers = r.headers.as_ref().unwrap().set_headers.iter();
        let headers = headers
            .map(|h| h.header.as_ref().unwrap())
            .map(|h| (h.key.clone(), h.raw_value.clone()))
            .collect();
        (r.status.as_ref().unwrap().code, headers, r.body.clone())
    }

    #[tokio::test]
    async fn a_full_body_budget_is_answered_429_with_retry_after_and_serve_s_message() {
        let mut request = hyper::Request::new(http_body_util::Full::new(Bytes::from_static(
            b"{\"prompt\": [1, 2, 3]}",
        )));
        request
            .headers_mut()
            .insert(hyper::header::CONTENT_LENGTH, "20".parse().unwrap());
        let full = edge::BodyBudget::new(0);
        let metrics = Metrics::default();
        let refused = edge::read_body(request, 1 << 20, Duration::from_secs(5), &full, &metrics)
            .await
            .unwrap_err();
        assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE); // serve's own answer
        let (status, answer) = immediate_of(refused).await;
        assert_eq!(status, 429);
        let (code, headers, body) = parts(&answer);
        assert_eq!(code, 429);
        assert!(headers.contains(&("retry-after".to_owned(), b"1".to_vec())));
        let message: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert!(
            message["error"]["message"]
                .as_str()
                .unwrap()
                .contains("--max-buffered-body-bytes")
        );
    }

    #[tokio::test]
    async fn no_eligible_endpoint_stays_503() {
        let (status, answer) = immediate_of(unavailable("no worker available")).await;
        assert_eq!(status, 503);
        assert_eq!(parts(&answer).0, 503);
    }
}
