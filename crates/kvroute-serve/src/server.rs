//! The server: a tokio runtime of `threads` threads, the accept loop, the routes, the
//! per-request flow (edge → prompt → routing step → relay), health checks and drain.
//!
//! Failure rules: a worker that refuses the connection, drops it before
//! answering, or misses `first_byte_timeout` is taken out (refused) or charged a failure, and
//! the request goes to another worker, only before the first response byte, so nothing is ever
//! sent twice to the client. After it, a worker that dies or stays silent ends the client's
//! stream with an SSE error event, or a non-streamed request with a 502. No available worker
//! is a 503. While draining (SIGTERM) new requests get 503 and `/health` fails; in-flight ones
//! finish.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{AUTHORIZATION, CACHE_CONTROL, CONTENT_TYPE, EXPECT, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use kvroute_core::blocks::BlockHasher;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};

use kvroute_io::consumer::{Consumer, CounterSnapshot, Item, Subscription};

use crate::config::{ConfigError, ServeConfig, WorkerSpec};
use crate::connections::{self, ConnState, Expiry, Registry, WatchedIo};
use crate::edge::{self, Body};
use crate::fleet::{Fleet, Membership, RefreshTenant};
use crate::metrics::{Metrics, Open};
use crate::models::ServedModels;
use crate::prompt::{Prompt, Prompts, Route};
use crate::relay::{self, AnswerStart, Ending, RefreshUpstream, RelayBody, SignalBody, Upstream};

/// Response header naming the worker that served the request.
pub const WORKER_HEADER: &str = "x-kvroute-worker";
/// The largest `/v1/models` answer relayed (read whole; vLLM's are a few hundred bytes a model).
pub const MAX_ANSWER_BYTES: usize = 64 << 20;
/// Whole answers up to this size are read before they are relayed, so that a worker breaking
/// while it sends one gets the client a 502 (vLLM's are kilobytes); longer ones (logprobs of a
/// long generation run to megabytes) are relayed as they come, so that clients that read them
/// slowly each hold at most about this much of the router's memory, not the whole answer.
pub const BUFFERED_ANSWER_BYTES: usize = 64 << 10;
/// How long a connection hyper is done with waits for its client to close ([`linger`]).
const LINGER_TIME: Duration = Duration::from_secs(5);
/// How much a lingering connection reads and discards at most.
const LINGER_BYTES: usize = 64 << 20;
/// How many times as often as a healthy worker one out of the available set is checked.
pub const UNHEALTHY_CHECKS_PER_INTERVAL: u32 = 4;
/// How long the event consumer lets batches gather after taking some: one wake-up of its
/// thread for several engine steps, beside engine steps of tens of milliseconds (the index
/// learns of a batch at most this much later; `benchmarks/kv_events_consume.py`).
pub const EVENTS_COALESCE: Duration = Duration::from_millis(2);
/// How long the consumer waits for each message of a replay.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(1);
/// How often the consumer's notices (each a worker reset) are logged.
const NOTICE_INTERVAL: Duration = Duration::from_millis(200);
/// Bodies over `--offload-bytes` parsed at once; the others wait once read.
pub const LARGE_BODIES: usize = 2;
/// Refreshes open at once per worker; more are dropped (counted), never queued.
pub const MAX_REFRESHES_OPEN: usize = 4;
/// A refresh's whole answer (one token) must come within this, or it counts as an error.
const REFRESH_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest a client request waits for its refreshes to be written ahead of it.
const REFRESH_WRITE_WAIT: Duration = Duration::from_millis(20);
/// How often the router looks for workers whose KV capacity the admission guard still needs,
/// and how long it waits before asking an engine that did not say again.
const KV_CAPACITY_TICK: Duration = Duration::from_millis(250);
const KV_CAPACITY_RETRY_S: f64 = 30.0;
/// The most of a worker's `/metrics` read for its capacity.
const MAX_METRICS_BYTES: usize = 4 << 20;
/// The answer to a connection whose request head did not arrive in time.
static HEAD_TIMEOUT: LazyLock<Vec<u8>> = LazyLock::new(|| {
    edge::canned(
        StatusCode::REQUEST_TIMEOUT,
        "",
        "request head not received in time",
        "RequestTimeout",
    )
});
/// The answer to a connection past `max_connections`, written before it is closed.
static REFUSED: LazyLock<Vec<u8>> = LazyLock::new(|| {
    edge::canned(
        StatusCode::SERVICE_UNAVAILABLE,
        "Retry-After: 1\r\n",
        "too many connections; retry",
        "ServiceUnavailable",
    )
});

/// What every connection and task shares.
struct Shared {
    config: ServeConfig,
    /// `config.max_body_bytes`, or what it is derived from the tokenizer.
    body_limit: edge::BodyLimit,
    /// The request body bytes held at once ([`edge::BodyBudget`]).
    body_budget: edge::BodyBudget,
    fleet: Mutex<Fleet>,
    prompts: Prompts,
    metrics: Metrics,
    upstream: Upstream,
    /// Retention's refreshes, on connections of their own.
    refresh_upstream: RefreshUpstream,
    /// Refreshes open per worker name.
    refreshes_open: Mutex<std::collections::HashMap<String, usize>>,
    /// `Bearer <worker key>`, or None.
    worker_authorization: Option<HeaderValue>,
    draining: AtomicBool,
    in_flight: AtomicUsize,
    idle: Notify,
    /// Rotates `/v1/models` over the workers.
    models_next: AtomicUsize,
    /// The KV-event consumer, made with the first worker that publishes events.
    consumer: Mutex<Option<Consumer>>,
    /// Every open client connection.
    connections: Registry,
    /// Permits for bodies over `offload_bytes` in memory at once.
    large_bodies: tokio::sync::Semaphore,
}

impl Shared {
    /// The routing step's clock: `CLOCK_MONOTONIC` seconds, Python's `time.monotonic()`, so
    /// that index look-ups from Python (tests, the inspection API) see the same times.
    fn now(&self) -> f64 {
        monotonic_seconds()
    }

    fn fleet(&self) -> MutexGuard<'_, Fleet> {
        self.fleet.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Follow and stop following the event streams a membership change names.
    fn apply(&self, membership: Membership) -> Result<(), ConfigError> {
        let mut consumer = self.consumer.lock().unwrap_or_else(|p| p.into_inner());
        for url in membership.unfollow {
            if let Some(c) = consumer.as_ref() {
                c.remove_worker(&url);
            }
        }
        for (url, source) in membership.follow {
            if consumer.is_none() {
                let index = self.fleet().index().clone();
                *consumer = Some(Consumer::start(Some(index), EVENTS_COALESCE).map_err(|e| {
                    ConfigError(format!("cannot start the KV event consumer: {e}"))
                })?);
            }
            let subscription = Subscription {
                endpoint: source.endpoint,
                replay_endpoint: source.replay_endpoint,
                topic: self.config.events_topic.as_bytes().to_vec(),
                bind: false,
                replay_timeout: REPLAY_TIMEOUT,
                catch_up: true,
            };
            if let Some(c) = consumer.as_ref() {
                c.add_worker(&url, subscription)
                    .map_err(|e| ConfigError(format!("worker {url}: {e}")))?;
            }
        }
        Ok(())
    }

    /// The consumer's counters per followed worker.
    fn event_counters(&self) -> Vec<(String, CounterSnapshot)> {
        let consumer = self.consumer.lock().unwrap_or_else(|p| p.into_inner());
        consumer.as_ref().map_or_else(Vec::new, Consumer::counters)
    }

    /// Worker `name`'s answer broke after its first byte (`kind`: `stream` or `body`).
    /// Silence is a strike towards ejection; a dropped connection is not (a dead worker's next
    /// connection is refused, which takes it out at once).
    fn broke(&self, name: &str, kind: &str, ending: Ending) {
        self.metrics.upstream_error(name, kind);
        if ending == Ending::Silent {
            self.fleet().failed(name, self.now());
        }
    }

    fn metrics_text(&self) -> String {
        let events = self.event_counters();
        let open = Open {
            connections: self.connections.len(),
            refreshes: self
                .refreshes_open
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .values()
                .sum(),
            body_bytes: self.body_budget.held_bytes(),
            body_budget_bytes: self.body_budget.bytes(),
        };
        let now = self.now();
        self.metrics.render(&self.fleet(), now, &events, open)
    }
}

/// One worker's state, as the inspection API shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerView {
    pub name: String,
    pub url: String,
    /// Discovery says it takes new requests.
    pub ready: bool,
    /// Passed its last health check and accepted its last connection.
    pub healthy: bool,
    /// May take a new request (healthy and not ejected).
    pub available: bool,
    /// Requests routed to it and not finished; their prompt tokens still to prefill.
    pub in_flight: i64,
    pub in_flight_tokens: i64,
    /// Times it was ejected, and failed requests since its last success.
    pub ejections: u64,
    pub consecutive_failures: u32,
}

/// `CLOCK_MONOTONIC` in seconds.
pub fn monotonic_seconds() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// A running native router. Dropping it stops it (without a drain).
pub struct Server {
    runtime: Option<tokio::runtime::Runtime>,
    shared: Arc<Shared>,
    addr: SocketAddr,
    stop: watch::Sender<bool>,
}

impl Server {
    /// Validate `config`, bind its address and start serving.
    pub fn start(config: ServeConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let hasher = BlockHasher::new(config.block_size, config.hash_seed)
            .map_err(|e| ConfigError(e.to_string()))?;
        let prompts = Prompts::new(
            hasher,
            config.tokenizer.as_deref(),
            config.prompt_cache_bytes,
            config.max_json_depth,
            config.retention.is_some(),
        )?;
        let (mut fleet, membership) = Fleet::new(&config)?;
        fleet.set_adapter_names(prompts.adapter_names());
        let worker_authorization =
            match &config.worker_api_key {
                Some(key) => Some(HeaderValue::from_str(&format!("Bearer {key}")).map_err(
                    |_| ConfigError("the worker API key is not a valid header value".into()),
                )?),
                None => None,
            };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.threads)
            .thread_name("kvroute-serve")
            .enable_all()
            .build()
            .map_err(|e| ConfigError(format!("cannot start the runtime: {e}")))?;
        let listener = runtime
            .block_on(TcpListener::bind((config.host.as_str(), config.port)))
            .map_err(|e| {
                ConfigError(format!(
                    "cannot listen on {}:{}: {e}",
                    config.host, config.port
                ))
            })?;
        let addr = listener
            .local_addr()
            .map_err(|e| ConfigError(e.to_string()))?;
        let upstream = runtime.block_on(async { relay::client(config.connect_timeout) });
        let refresh_upstream = runtime.block_on(async { relay::client(config.connect_timeout) });
        let body_limit = edge::BodyLimit::new(config.max_body_bytes, prompts.tokenizer_limits());
        if config.max_buffered_body_bytes < body_limit.bytes {
            return Err(ConfigError(format!(
                "max buffered body bytes ({}) is below the body limit ({} bytes, {}): a body \
                 that large could never be read",
                config.max_buffered_body_bytes, body_limit.bytes, body_limit.source
            )));
        }
        let shared = Arc::new(Shared {
            body_budget: edge::BodyBudget::new(config.max_buffered_body_bytes),
            body_limit,
            fleet: Mutex::new(fleet),
            prompts,
            metrics: Metrics::default(),
            upstream,
            refresh_upstream,
            refreshes_open: Mutex::new(std::collections::HashMap::new()),
            worker_authorization,
            draining: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            idle: Notify::new(),
            models_next: AtomicUsize::new(0),
            consumer: Mutex::new(None),
            connections: Registry::default(),
            large_bodies: tokio::sync::Semaphore::new(LARGE_BODIES),
            config,
        });
        shared.apply(membership)?;
        let (stop, stopped) = watch::channel(false);
        runtime.spawn(accept_loop(listener, shared.clone(), stopped.clone()));
        if let Some(interval) = shared.config.health_interval {
            runtime.spawn(health_loop(shared.clone(), interval, stopped.clone()));
        }
        runtime.spawn(kv_capacity_loop(shared.clone(), stopped.clone()));
        runtime.spawn(notice_loop(shared.clone(), stopped));
        Ok(Self {
            runtime: Some(runtime),
            shared,
            addr,
            stop,
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Replace the worker list (discovery's complete list).
    pub fn set_workers(&self, workers: &[WorkerSpec]) -> Result<(), ConfigError> {
        let membership = self.shared.fleet().set_workers(workers)?;
        self.shared.apply(membership)
    }

    /// The text of `/metrics`.
    pub fn metrics_text(&self) -> String {
        self.shared.metrics_text()
    }

    /// The index the routing step reads (shared with the KV-event consumer).
    pub fn index(&self) -> kvroute_io::consumer::SharedIndex {
        self.shared.fleet().index().clone()
    }

    /// Every worker's state now.
    pub fn workers(&self) -> Vec<WorkerView> {
        let now = self.shared.now();
        let fleet = self.shared.fleet();
        fleet
            .members()
            .iter()
            .map(|m| {
                let (in_flight, in_flight_tokens) = fleet.load(m.slot);
                WorkerView {
                    name: m.name.clone(),
                    url: m.url.clone(),
                    ready: m.ready,
                    healthy: m.healthy,
                    available: m.available(now),
                    in_flight,
                    in_flight_tokens,
                    ejections: m.ejected_total,
                    consecutive_failures: m.consecutive_failures,
                }
            })
            .collect()
    }

    /// Retention's counters (None when it is off).
    pub fn retention_stats(&self) -> Option<kvroute_core::retention::RetentionStats> {
        self.shared.fleet().retention_stats()
    }

    /// The request body limit and where it came from.
    pub fn body_limit(&self) -> &edge::BodyLimit {
        &self.shared.body_limit
    }

    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::SeqCst)
    }

    /// Refuse new requests (503, `/health` failing) and wait up to `timeout` for the ones in
    /// flight; true when they all finished.
    pub fn drain(&self, timeout: Duration) -> bool {
        self.shared.draining.store(true, Ordering::SeqCst);
        let shared = self.shared.clone();
        let Some(runtime) = &self.runtime else {
            return true;
        };
        runtime.block_on(async move {
            let wait = async {
                loop {
                    let notified = shared.idle.notified();
                    if shared.in_flight.load(Ordering::SeqCst) == 0 {
                        return;
                    }
                    notified.await;
                }
            };
            tokio::time::timeout(timeout, wait).await.is_ok()
        })
    }

    /// Stop listening and end every connection.
    pub fn shutdown(mut self) {
        self.stop_runtime();
    }

    fn stop_runtime(&mut self) {
        let _ = self.stop.send(true);
        let consumer = self
            .shared
            .consumer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(c) = consumer {
            c.close(Duration::from_secs(5));
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop_runtime();
    }
}

/// Accept connections until stopped. At `max_connections` a new one sheds the connection
/// waiting longest for a request head, or, when none waits, is answered 503 and closed.
async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    mut stopped: watch::Receiver<bool>,
) {
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(c) => c,
                // Out of descriptors or a connection reset while queued: keep serving.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            _ = stopped.changed() => return,
        };
        if shared.connections.len() >= shared.config.max_connections {
            if shared.connections.shed_one() {
                shared.metrics.client_timeout("shed");
            } else {
                shared
                    .metrics
                    .connections_refused
                    .fetch_add(1, Ordering::Relaxed);
                tokio::spawn(refuse(stream));
                continue;
            }
        }
        let _ = stream.set_nodelay(true);
        tokio::spawn(serve_connection(shared.clone(), stream));
    }
}

/// Serve one client connection under its watchdog ([`crate::connections`]).
async fn serve_connection(shared: Arc<Shared>, stream: TcpStream) {
    // A second handle on the socket, for the watchdog's 408 while hyper owns the first.
    let Ok((stream, raw)) = split_handle(stream) else {
        return;
    };
    let (id, state) = shared.connections.open();
    let service = {
        let (shared, state) = (shared.clone(), state.clone());
        service_fn(move |request| {
            let (shared, state) = (shared.clone(), state.clone());
            state.request_started();
            async move {
                let response = handle(shared, request).await;
                // The connection waits for its next head once the answer's body is done.
                Ok::<_, std::convert::Infallible>(
                    response.map(|body| TrackedBody { inner: body, state }.boxed()),
                )
            }
        })
    };
    let limits = connections::Limits {
        header_timeout: shared.config.header_timeout,
        keepalive_timeout: shared.config.keepalive_timeout,
        send_timeout: shared.config.send_timeout,
    };
    // Whether hyper ended the connection (true) or the watchdog did; hyper's side of it is
    // dropped at the end of the block.
    let by_hyper = {
        let connection = http1::Builder::new()
            .timer(TokioTimer::new())
            .serve_connection(TokioIo::new(WatchedIo::new(stream, state.clone())), service);
        tokio::pin!(connection);
        loop {
            let notified = state.changed.notified();
            if state.shed.load(Ordering::Acquire) {
                break false;
            }
            let (phase, since) = state.phase();
            let stalled = state.stalled();
            let limit = connections::deadline(phase, since, stalled, &limits);
            let wait = limit.map(|(at, _)| at.saturating_sub(state.now()));
            tokio::select! {
                _ = &mut connection => break true,
                _ = notified => continue,
                _ = sleep_or_never(wait) => {
                    // The phase may have moved on, or the stall ended, since the deadline
                    // was read.
                    let Some((_, expiry)) = limit else { continue };
                    if state.phase() != (phase, since) || state.stalled() != stalled {
                        continue;
                    }
                    match expiry {
                        Expiry::Timeout408 => {
                            shared.metrics.client_timeout("header");
                            answer_and_close(&raw, &HEAD_TIMEOUT);
                        }
                        Expiry::Close(kind) => shared.metrics.client_timeout(kind),
                    }
                    break false;
                }
            }
        }
    };
    if by_hyper {
        linger(raw, &state).await;
    } else {
        let _ = raw.shutdown(std::net::Shutdown::Both);
    }
    shared.connections.close(id);
}

/// Close a connection hyper is done with the way nginx's `lingering_close` does: end the
/// sending side (the answer, then FIN), then read and discard what the client still sends
/// until it closes, for at most [`LINGER_TIME`] and [`LINGER_BYTES`], or until a new
/// connection at the limit sheds it. Closing a socket with unread bytes resets the connection,
/// and a client still sending a body the router refused (413, or 503 over the body budget)
/// would see the reset instead of the answer.
async fn linger(raw: std::net::TcpStream, state: &ConnState) {
    use tokio::io::AsyncReadExt;
    state.lingering();
    let _ = raw.shutdown(std::net::Shutdown::Write);
    if raw.set_nonblocking(true).is_err() {
        return;
    }
    let Ok(mut stream) = TcpStream::from_std(raw) else {
        return;
    };
    let deadline = tokio::time::Instant::now() + LINGER_TIME;
    // Small: every lingering connection has one (4,096 of them hold 32 MiB).
    let mut buf = [0u8; 8 << 10];
    let mut discarded = 0;
    while discarded < LINGER_BYTES && !state.shed.load(Ordering::Acquire) {
        let shed = state.changed.notified();
        tokio::select! {
            read = tokio::time::timeout_at(deadline, stream.read(&mut buf)) => match read {
                Ok(Ok(n)) if n > 0 => discarded += n,
                _ => return, // the client closed, failed or took too long: close
            },
            _ = shed => {}
        }
    }
}

/// `stream` and a second (std) handle on its socket.
fn split_handle(stream: TcpStream) -> std::io::Result<(TcpStream, std::net::TcpStream)> {
    let std_stream = stream.into_std()?;
    let raw = std_stream.try_clone()?;
    Ok((TcpStream::from_std(std_stream)?, raw))
}

/// Write a canned answer on a connection waiting for its head (its send buffer is empty, so a
/// non-blocking write takes it whole or the client is gone anyway), then close it.
fn answer_and_close(raw: &std::net::TcpStream, answer: &[u8]) {
    use std::io::Write;
    let mut raw = raw;
    let _ = raw.write_all(answer);
    let _ = raw.shutdown(std::net::Shutdown::Both);
}

async fn sleep_or_never(wait: Option<Duration>) {
    match wait {
        Some(w) => tokio::time::sleep(w).await,
        None => std::future::pending().await,
    }
}

/// A response body that tells its connection when the answer is done (dropped by hyper
/// once written, or when the client left).
struct TrackedBody {
    inner: Body,
    state: Arc<ConnState>,
}

impl hyper::body::Body for TrackedBody {
    type Data = Bytes;
    type Error = edge::Aborted;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        std::pin::Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for TrackedBody {
    fn drop(&mut self) {
        self.state.answer_ended();
    }
}

/// Answer a connection over the limit with a 503 and close it (at most a second spent).
async fn refuse(mut stream: TcpStream) {
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = stream.write_all(&REFUSED).await;
        let _ = stream.shutdown().await;
    })
    .await;
}

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

async fn handle(shared: Arc<Shared>, request: Request<Incoming>) -> Response<Body> {
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
    if let Some(expect) = request.headers().get(EXPECT)
        && !expect.as_bytes().eq_ignore_ascii_case(b"100-continue")
    {
        return edge::error(
            StatusCode::EXPECTATION_FAILED,
            "only 'Expect: 100-continue' is supported",
            "BadRequestError",
            None,
        );
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

fn draining() -> Response<Body> {
    edge::error(
        StatusCode::SERVICE_UNAVAILABLE,
        "draining",
        "ServiceUnavailable",
        None,
    )
}

fn no_worker() -> Response<Body> {
    edge::error(
        StatusCode::SERVICE_UNAVAILABLE,
        "no worker available",
        "ServiceUnavailable",
        None,
    )
}

fn bad_gateway() -> Response<Body> {
    edge::error(
        StatusCode::BAD_GATEWAY,
        "the worker failed before answering",
        "UpstreamError",
        None,
    )
}

/// A worker's answer as the client gets it: its status and relayed headers, the body, and
/// the worker header.
fn answered(
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
fn with_worker(mut response: Response<Body>, worker: &str) -> Response<Body> {
    if let Ok(v) = HeaderValue::from_str(worker) {
        response.headers_mut().insert(WORKER_HEADER, v);
    }
    response
}

/// Counts a request in flight from routing until its answer ends (a drain waits for zero).
struct InFlight(Arc<Shared>);

impl InFlight {
    fn new(shared: &Arc<Shared>) -> Self {
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
struct Load {
    shared: Arc<Shared>,
    slot: usize,
    ticket: Option<u64>,
    prefill_tokens: Option<usize>,
}

impl Load {
    fn first_byte(&mut self) {
        if let Some(tokens) = self.prefill_tokens.take() {
            self.shared.fleet().first_token(self.slot, tokens);
        }
    }
}

impl Drop for Load {
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
        if let (Some(idle), false, Ok(runtime)) =
            (idle, draining, tokio::runtime::Handle::try_current())
        {
            let shared = self.shared.clone();
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
    load: Load,
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

async fn generate(
    shared: &Arc<Shared>,
    request: Request<Incoming>,
    route: Route,
) -> Response<Body> {
    if shared.draining.load(Ordering::SeqCst) {
        return draining();
    }
    let client_headers = request.headers().clone();
    if let Some(refusal) =
        edge::refuse_early(&client_headers, shared.body_limit.bytes, &shared.metrics)
    {
        return refusal;
    }
    // The reservation lives until this function returns: the body is held until then.
    let (raw, _reservation) = match edge::read_body(
        request,
        shared.body_limit.bytes,
        shared.config.body_timeout,
        &shared.body_budget,
        &shared.metrics,
    )
    .await
    {
        Ok(read) => read,
        Err(response) => return response,
    };
    // Parsing a large body takes a multiple of its size (its JSON tree, its tokens): at most
    // LARGE_BODIES are parsed at once, the others wait, read (the body budget bounds those).
    // Waiting for a slot only once the body is in, a client that sends slowly holds none.
    let large = raw.len() > shared.config.offload_bytes;
    let large_permit = if large {
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
                return edge::error(
                    StatusCode::BAD_REQUEST,
                    "the body could not be parsed",
                    "BadRequestError",
                    None,
                );
            }
        }
    } else {
        shared.prompts.parse(route, &raw)
    };
    let prompt = match prompt {
        Ok(p) => p,
        Err(bad) => {
            if bad.too_deep {
                shared.metrics.rejected("json_too_deep");
            }
            return edge::error(
                StatusCode::BAD_REQUEST,
                &bad.message,
                "BadRequestError",
                bad.param,
            );
        }
    };
    if prompt.untokenized {
        shared.metrics.untokenized.fetch_add(1, Ordering::Relaxed);
    }
    let in_flight = InFlight::new(shared);
    let authorization = shared.worker_authorization.clone().or_else(|| {
        shared
            .config
            .forward_authorization
            .then(|| client_headers.get(AUTHORIZATION).cloned())
            .flatten()
    });
    let headers = relay::forwarded_headers(&client_headers, authorization.as_ref());
    drop(large_permit);
    forward(shared, route, &prompt, raw, headers, in_flight, started).await
}

/// Send the request to the chosen worker, and to another one while none has answered.
async fn forward(
    shared: &Arc<Shared>,
    route: Route,
    prompt: &Prompt,
    raw: Bytes,
    headers: hyper::HeaderMap,
    in_flight: InFlight,
    started: Instant,
) -> Response<Body> {
    let model = prompt.model.as_deref();
    if let Some(model) = model
        && shared.fleet().unknown_model(model)
    {
        return edge::error(
            StatusCode::NOT_FOUND,
            &format!("The model `{model}` does not exist."),
            "NotFoundError",
            Some("model"),
        );
    }
    let mut tried: Vec<String> = Vec::new();
    for attempt in 0..shared.config.max_attempts {
        let now = shared.now();
        let choice = shared.fleet().route(
            &prompt.block_hashes,
            prompt.tokens,
            &tried,
            now,
            prompt.retained.as_ref(),
            model,
        );
        let Some(choice) = choice else {
            break;
        };
        if attempt > 0 {
            shared.metrics.retries.fetch_add(1, Ordering::Relaxed);
        } else {
            shared.metrics.routing_took(started.elapsed().as_secs_f64());
        }
        shared
            .metrics
            .decision(&shared.config.policy.name, &choice.name);
        shared
            .metrics
            .routed(choice.overlap_blocks, prompt.block_hashes.len());
        let mut load = Load {
            shared: shared.clone(),
            slot: choice.slot,
            ticket: choice.ticket,
            prefill_tokens: Some(choice.prefill_tokens),
        };
        if !choice.refreshes.is_empty() {
            let waited = Instant::now();
            let (refreshes, tenants) = (&choice.refreshes, &choice.refresh_tenants);
            send_refreshes(shared, &choice.name, &choice.url, refreshes, tenants).await;
            shared.metrics.refresh_wait(waited.elapsed().as_secs_f64());
        }
        let Ok(uri) = format!("{}{}", choice.url, route.path()).parse::<hyper::Uri>() else {
            tried.push(choice.name);
            continue;
        };
        let mut upstream_request = Request::post(uri);
        if let Some(h) = upstream_request.headers_mut() {
            *h = headers.clone();
        }
        let Ok(upstream_request) = upstream_request.body(Full::new(raw.clone())) else {
            tried.push(choice.name);
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
                    .upstream_error(&choice.name, "first_byte_timeout");
                shared.fleet().failed(&choice.name, shared.now());
                tried.push(choice.name);
                continue;
            }
            // Refused, or no connection in time: the worker is gone. A connection dropped
            // before the answer may be a benign keep-alive race (or a worker that just died,
            // whose next connection is refused): only a retry.
            Some(Err(e)) => {
                shared.metrics.upstream_error(&choice.name, "connect");
                if e.is_connect() {
                    shared.fleet().refused(&choice.name);
                }
                tried.push(choice.name);
                continue;
            }
        };
        let (parts, body) = answer.into_parts();
        {
            let now = shared.now();
            let mut fleet = shared.fleet();
            if parts.status.is_server_error() {
                fleet.failed(&choice.name, now);
            } else {
                fleet.succeeded(&choice.name);
            }
        }
        let idle = shared.config.stream_idle_timeout;
        let event_stream = parts
            .headers
            .get(CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        if event_stream {
            let hooks = Box::new(Relayed {
                shared: shared.clone(),
                worker: choice.name.clone(),
                kind: "stream",
                load,
                _in_flight: in_flight,
            });
            let body = RelayBody::events(body, idle, &choice.name, hooks);
            let mut response = answered(parts.status, &parts.headers, body.boxed(), &choice.name);
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
                &choice.name,
            ),
            Ok(AnswerStart::Head(head)) => {
                let hooks = Box::new(Relayed {
                    shared: shared.clone(),
                    worker: choice.name.clone(),
                    kind: "body",
                    load,
                    _in_flight: in_flight,
                });
                let body = RelayBody::bytes(head, body, idle, &choice.name, hooks);
                answered(parts.status, &parts.headers, body.boxed(), &choice.name)
            }
            Err(ending) => {
                shared.broke(&choice.name, "body", ending);
                let message = format!(
                    "worker {} failed while answering: {}",
                    choice.name,
                    ending.problem(idle)
                );
                let response =
                    edge::error(StatusCode::BAD_GATEWAY, &message, "UpstreamError", None);
                with_worker(response, &choice.name)
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

/// Check every worker's `GET /health` each `interval` (one out of the available set
/// [`UNHEALTHY_CHECKS_PER_INTERVAL`] times as often); only a 2xx passes (a redirect fails).
async fn health_loop(shared: Arc<Shared>, interval: Duration, mut stopped: watch::Receiver<bool>) {
    let tick = interval / UNHEALTHY_CHECKS_PER_INTERVAL;
    let mut round: u32 = 0;
    loop {
        // The first round runs at once: it learns the workers' models before most requests.
        if round > 0 {
            tokio::select! {
                _ = tokio::time::sleep(tick) => {},
                _ = stopped.changed() => return,
            }
        }
        round = round.wrapping_add(1);
        let now = shared.now();
        // A worker whose models are not known yet is checked as often as an unhealthy one:
        // until then its requests are hashed without their adapter's key.
        let due: Vec<(String, String)> = shared
            .fleet()
            .members()
            .iter()
            .filter(|m| {
                !m.available(now)
                    || m.models.is_none()
                    || round % UNHEALTHY_CHECKS_PER_INTERVAL == 0
            })
            .map(|m| (m.name.clone(), m.url.clone()))
            .collect();
        for (name, url) in due {
            let shared = shared.clone();
            tokio::spawn(async move {
                let passed = check(&shared, &url).await;
                let now = shared.now();
                shared.fleet().checked(&name, passed, now);
                if passed && let Some(models) = served_models(&shared, &url).await {
                    shared.fleet().set_models(&name, models);
                }
            });
        }
    }
}

async fn check(shared: &Shared, url: &str) -> bool {
    let Ok(uri) = format!("{url}/health").parse::<hyper::Uri>() else {
        return false;
    };
    let Ok(request) = Request::get(uri).body(Full::new(Bytes::new())) else {
        return false;
    };
    let answer = tokio::time::timeout(shared.config.health_timeout, async {
        let response = shared.upstream.request(request).await.ok()?;
        let passed = response.status().is_success();
        // Read (a bounded part of) the body so the connection can be reused.
        let _ = http_body_util::Limited::new(response.into_body(), 64 * 1024)
            .collect()
            .await;
        Some(passed)
    })
    .await;
    matches!(answer, Ok(Some(true)))
}

/// The models and adapters the worker at `url` lists in `GET /v1/models` (a 2xx within the
/// health-check timeout, at most [`MAX_ANSWER_BYTES`]), or None.
async fn served_models(shared: &Shared, url: &str) -> Option<ServedModels> {
    let uri = format!("{url}/v1/models").parse::<hyper::Uri>().ok()?;
    let mut request = Request::get(uri);
    if let Some(auth) = &shared.worker_authorization {
        request = request.header(AUTHORIZATION, auth.clone());
    }
    let request = request.body(Full::new(Bytes::new())).ok()?;
    tokio::time::timeout(shared.config.health_timeout, async {
        let response = shared.upstream.request(request).await.ok()?;
        if !response.status().is_success() {
            return None;
        }
        let body = http_body_util::Limited::new(response.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .ok()?;
        ServedModels::parse(&body.to_bytes())
    })
    .await
    .ok()?
}

/// Ask each worker whose KV capacity the admission guard or retention needs for its engine's
/// `/metrics` (`crate::capacity`): once it answers, never again; one that does not is asked
/// again after [`KV_CAPACITY_RETRY_S`]. Nothing is asked when neither runs, or when the
/// capacity was configured.
async fn kv_capacity_loop(shared: Arc<Shared>, mut stopped: watch::Receiver<bool>) {
    loop {
        let wanted = shared
            .fleet()
            .kv_capacity_wanted(shared.now(), KV_CAPACITY_RETRY_S);
        for (name, url) in wanted {
            let shared = shared.clone();
            tokio::spawn(async move {
                if let Some(blocks) = engine_kv_blocks(&shared, &url).await {
                    shared.fleet().set_kv_capacity(&name, blocks);
                }
            });
        }
        tokio::select! {
            _ = tokio::time::sleep(KV_CAPACITY_TICK) => {},
            _ = stopped.changed() => return,
        }
    }
}

/// `num_gpu_blocks` from the engine at `url`'s `/metrics` (a 2xx within the health-check
/// timeout, at most [`MAX_METRICS_BYTES`]), or None.
async fn engine_kv_blocks(shared: &Shared, url: &str) -> Option<usize> {
    let uri = format!("{url}/metrics").parse::<hyper::Uri>().ok()?;
    let request = Request::get(uri).body(Full::new(Bytes::new())).ok()?;
    let text = tokio::time::timeout(shared.config.health_timeout, async {
        let response = shared.upstream.request(request).await.ok()?;
        if !response.status().is_success() {
            return None;
        }
        let body = http_body_util::Limited::new(response.into_body(), MAX_METRICS_BYTES)
            .collect()
            .await
            .ok()?;
        String::from_utf8(body.to_bytes().to_vec()).ok()
    })
    .await
    .ok()??;
    crate::capacity::num_gpu_blocks(&text)
}

/// Log what the KV-event consumer reports (each a reset of a worker's index entries, which
/// the consumer has already made).
async fn notice_loop(shared: Arc<Shared>, mut stopped: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(NOTICE_INTERVAL) => {},
            _ = stopped.changed() => return,
        }
        let notices = {
            let consumer = shared.consumer.lock().unwrap_or_else(|p| p.into_inner());
            consumer
                .as_ref()
                .map_or_else(Vec::new, Consumer::take_notices)
        };
        for notice in notices {
            let worker = notice.worker;
            match notice.item {
                Item::ReplayFailed {
                    expected,
                    got,
                    reason,
                } => eprintln!(
                    "kvroute serve: worker {worker}: KV events {expected}..{} lost ({reason}); its index entries are reset",
                    got.saturating_sub(1)
                ),
                Item::Restarted { .. } => {
                    eprintln!(
                        "kvroute serve: worker {worker}: engine restarted; its index entries are reset"
                    )
                }
                Item::Malformed { seq, error } => eprintln!(
                    "kvroute serve: worker {worker}: malformed KV event batch {seq:?}: {error}; its index entries are reset"
                ),
                Item::Crashed { error } => {
                    eprintln!(
                        "kvroute serve: the KV event consumer stopped: {error}; the index gets no more events"
                    )
                }
                Item::Batch { .. } | Item::Gap { .. } => {}
            }
        }
    }
}

/// Send `worker` its refreshes (the prefix's ids plus one, `max_tokens` 1), each on a task
/// of its own, and return once their bodies are handed to their connections (at most
/// [`REFRESH_WRITE_WAIT`]): the client request goes after them. A worker already holding
/// [`MAX_REFRESHES_OPEN`] gets no more (counted); errors are counted, never retried.
async fn send_refreshes(
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
