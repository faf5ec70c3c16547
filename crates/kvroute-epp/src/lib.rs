//! kvroute as an Endpoint Picker (EPP) of the Gateway API Inference Extension: a gateway
//! (Envoy Gateway, Istio, kgateway, GKE's Inference Gateway) asks it, over Envoy's ext_proc
//! gRPC protocol, which worker of an `InferencePool` serves each request, and proxies the
//! request itself. The EPP decides and never carries the traffic.
//!
//! It is `kvroute serve`'s router behind another front: the same [`kvroute_serve::Router`]
//! (fleet, index, KV-event consumer, tokenizer and chat templates, retention and its
//! refreshes sent straight to the workers, health checks, metrics) and the same request
//! pipeline up to the decision ([`kvroute_serve::server::Pipeline`]). Per request
//! ([`exchange`]): the body streamed by the gateway (`FULL_DUPLEX_STREAMED`) read within
//! serve's bounds, the prompt routed once whole, the worker named in the
//! `x-gateway-destination-endpoint` header and in `envoy.lb` dynamic metadata, serve's refusals
//! answered as immediate responses, then the response's headers followed until the stream's
//! end ends the request's load.
//!
//! Ports: ext_proc and gRPC health (`liveness`, `readiness`, the ext_proc service) on the
//! gRPC port; `/metrics` and `/health` over HTTP on serve's port.

pub mod counters;
pub mod exchange;
pub mod protocol;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use http_body_util::Full;
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::{Method, Response, StatusCode};
use kvroute_serve::{ConfigError, Router, ServeConfig, WorkerSpec};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::counters::Counters;
use crate::exchange::Picker;

/// The ext_proc service's name, also a health service name.
pub const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";
/// The gRPC port reference EPPs serve ext_proc on.
pub const DEFAULT_GRPC_PORT: u16 = 9002;
/// Answers queued per stream before the EPP waits for the gateway to take them.
const OUTBOX: usize = 8;
/// The largest gRPC message taken from the gateway beyond the body limit (a body chunk and its
/// envelope: headers, metadata).
const MESSAGE_ENVELOPE_BYTES: usize = 1 << 20;

/// The ext_proc service.
struct Service(Arc<Picker>);

#[tonic::async_trait]
impl ExternalProcessor for Service {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, tonic::Status>>;

    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Self::ProcessStream>, tonic::Status> {
        let (tx, rx) = mpsc::channel(OUTBOX);
        tokio::spawn(exchange::exchange(self.0.clone(), request.into_inner(), tx));
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}

/// A running Endpoint Picker. Dropping it stops it (without a drain).
pub struct Epp {
    router: Router,
    grpc_addr: SocketAddr,
    http_addr: SocketAddr,
    health: HealthReporter,
    /// The worker set is known and no drain began (readiness).
    ready: Arc<AtomicBool>,
    counters: Arc<Counters>,
}

impl Epp {
    /// Start serve's router on `config` (its host and port serve `/metrics`), and ext_proc with
    /// gRPC health on `config.host:grpc_port`. Readiness is SERVING once the worker set is
    /// known: at once when `config` names workers, else at the first [`Epp::set_workers`].
    pub fn start(config: ServeConfig, grpc_port: u16) -> Result<Self, ConfigError> {
        let (host, port) = (config.host.clone(), config.port);
        let known = !config.workers.is_empty();
        let router = Router::start(config)?;
        let rt = router.runtime().clone();
        let bind = |port: u16| {
            rt.block_on(TcpListener::bind((host.as_str(), port)))
                .map_err(|e| ConfigError::new(format!("cannot listen on {host}:{port}: {e}")))
        };
        let grpc = bind(grpc_port)?;
        let http = bind(port)?;
        let addr = |l: &TcpListener| l.local_addr().map_err(|e| ConfigError::new(e.to_string()));
        let (grpc_addr, http_addr) = (addr(&grpc)?, addr(&http)?);
        let counters = Arc::new(Counters::default());
        let pipeline = router.pipeline();
        let picker = Arc::new(Picker::new(pipeline.clone(), counters.clone()));
        let (health, health_service) =
            rt.block_on(async { tonic_health::server::health_reporter() });
        let body_limit = pipeline.body_limit();
        let ext_proc = ExternalProcessorServer::new(Service(picker))
            .max_decoding_message_size(body_limit.saturating_add(MESSAGE_ENVELOPE_BYTES));
        let mut stopped = router.stopped();
        rt.spawn(async move {
            let shutdown = async move {
                let _ = stopped.changed().await;
            };
            let served = tonic::transport::Server::builder()
                .http2_keepalive_interval(Some(Duration::from_secs(30)))
                .add_service(health_service)
                .add_service(ext_proc)
                // TCP_NODELAY: an answer written while the gateway's ACK is delayed would
                // otherwise wait for it (tens of milliseconds per request).
                .serve_with_incoming_shutdown(
                    TcpIncoming::from(grpc).with_nodelay(Some(true)),
                    shutdown,
                )
                .await;
            if let Err(e) = served {
                eprintln!("kvroute epp: the gRPC server stopped: {e}");
            }
        });
        let ready = Arc::new(AtomicBool::new(false));
        let front = Arc::new(MetricsFront {
            pipeline,
            counters: counters.clone(),
            ready: ready.clone(),
        });
        rt.spawn(metrics_loop(http, front, router.stopped()));
        let epp = Self {
            router,
            grpc_addr,
            http_addr,
            health,
            ready,
            counters,
        };
        epp.set_health("liveness", ServingStatus::Serving);
        epp.set_ready(known);
        Ok(epp)
    }

    fn set_health(&self, service: &str, status: ServingStatus) {
        let health = self.health.clone();
        let service = service.to_owned();
        self.router
            .runtime()
            .block_on(async move { health.set_service_status(service, status).await });
    }

    /// Readiness (and the ext_proc service's health) SERVING or NOT_SERVING.
    fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
        let status = if ready {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        self.set_health("readiness", status);
        self.set_health(EXT_PROC_SERVICE, status);
    }

    /// The ext_proc (and gRPC health) address.
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc_addr
    }

    /// The `/metrics` address.
    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    /// The router behind the front.
    pub fn router(&self) -> &Router {
        &self.router
    }

    /// Replace the worker list (discovery's complete list); the worker set is known from then.
    pub fn set_workers(&self, workers: &[WorkerSpec]) -> Result<(), ConfigError> {
        self.router.set_workers(workers)?;
        if !self.router.pipeline().draining() {
            self.set_ready(true);
        }
        Ok(())
    }

    /// The text of `/metrics`: serve's, then the EPP's own.
    pub fn metrics_text(&self) -> String {
        self.counters.scrape(self.router.metrics_text())
    }

    /// Report NOT_SERVING, answer new requests 503 and wait up to `timeout` for the ones in
    /// flight; true when they all finished.
    pub fn drain(&self, timeout: Duration) -> bool {
        self.set_ready(false);
        self.router.drain(timeout)
    }

    /// Stop serving.
    pub fn shutdown(self) {
        self.router.shutdown();
    }
}

/// What the HTTP front reads.
struct MetricsFront {
    pipeline: kvroute_serve::server::Pipeline,
    counters: Arc<Counters>,
    ready: Arc<AtomicBool>,
}

/// Serve `GET /metrics` and `GET /health` (200 once ready) until stopped.
async fn metrics_loop(
    listener: TcpListener,
    front: Arc<MetricsFront>,
    mut stopped: watch::Receiver<bool>,
) {
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((s, _)) => s,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            _ = stopped.changed() => return,
        };
        let front = front.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let front = front.clone();
                async move { Ok::<_, std::convert::Infallible>(answer(&front, &request)) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HTTP_HEAD_TIMEOUT)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            let _ = tokio::time::timeout(HTTP_CONNECTION_TIME, connection).await;
        });
    }
}

/// How long the HTTP front waits for a request head, and keeps a connection at most.
const HTTP_HEAD_TIMEOUT: Duration = Duration::from_secs(10);
const HTTP_CONNECTION_TIME: Duration = Duration::from_secs(300);

fn answer<B>(front: &MetricsFront, request: &hyper::Request<B>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::new()));
    match (request.method(), request.uri().path()) {
        (&Method::GET, "/metrics") => {
            let text = front.counters.scrape(front.pipeline.metrics_text());
            *response.body_mut() = Full::new(Bytes::from(text));
            response.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
        }
        (&Method::GET, "/health") => {
            if !front.ready.load(Ordering::SeqCst) || front.pipeline.draining() {
                *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            }
        }
        _ => *response.status_mut() = StatusCode::NOT_FOUND,
    }
    response
}
