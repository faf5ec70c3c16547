//! kvroute's native data plane: the OpenAI-compatible HTTP router of `kvroute serve`, on tokio
//! and hyper.
//!
//! Why native: parsing HTTP and relaying every streamed chunk through an interpreter costs
//! more than the routing itself, and an interpreter's one loop is where one client's large
//! body stalls every other client. Here every request runs on a multi-threaded runtime, and the Python face only parses the
//! command line, builds a [`ServeConfig`] and starts a [`Server`] (as sglang-router's launcher
//! does).
//!
//! Per generation request (`/v1/completions`, `/v1/chat/completions`):
//!
//! 1. the edge ([`edge`]): a connection limit answered with 503, a request-head timeout, a body
//!    limit checked before the body is read (413), a body timeout (408), no request-body
//!    decompression (415), the API key;
//! 2. the prompt ([`prompt`]): token ids as given, text through the engines' tokenizer, chats
//!    rendered with its chat template ([`chat`]), hashed into the engines' chained block
//!    hashes (`kvroute_core::blocks`);
//! 3. the routing step ([`fleet`]): `kvroute_core`'s index look-up, policy, prediction and load
//!    accounting, among the workers that are healthy and not ejected;
//! 4. the relay ([`relay`]): the client's bytes forwarded unchanged to the chosen worker's
//!    route, the answer relayed frame by frame with the `x-kvroute-worker` header; a worker that
//!    does not answer (refused connection, first-byte timeout) is retried on another one, only
//!    before the first byte; one that dies or goes silent mid-stream ends the client's stream
//!    with an SSE error event (mid-answer: a 502 while the answer is short enough to hold,
//!    the client's connection closed short of it when longer).
//!
//! Pure decisions live apart from the I/O: [`prompt`] (body → prompt), [`fleet`] (membership,
//! health, ejection and routing, fed outcomes and times), [`metrics`] (counters and their text).
//! The answers every part writes (the response [`http::Body`], OpenAI-style errors) are
//! [`http`]'s, a leaf the others import.

pub mod capacity;
pub mod chat;
pub mod config;
pub mod connections;
pub mod contention;
pub mod edge;
pub mod fleet;
pub mod http;
pub mod mesh;
pub mod metrics;
pub mod models;
pub mod prompt;
pub mod relay;
pub mod server;

pub use config::{ConfigError, EventSource, PolicySpec, ServeConfig, WorkerSpec};
pub use server::{Router, Server, WorkerView};
