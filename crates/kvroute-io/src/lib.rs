//! kvroute's I/O around the pure core (`kvroute-core` has no clock and no sockets).
//!
//! * [`consumer`]: the router's KV-event consumer, one thread that owns every worker's ZeroMQ
//!   SUB socket and replay DEALERs, runs the core's sequence tracker on what arrives, decodes
//!   with the core's codec and applies each batch to the shared KV index, without Python.
//!
//! ZeroMQ is libzmq itself (the `zmq` crate; `zmq-sys` builds libzmq 4.3 from source with the
//! `cc` crate), the library vLLM's publisher and pyzmq use, so the socket semantics (reconnect,
//! high-water marks, linger) are the ones the engines were written against.

pub mod consumer;

pub use consumer::{
    Consumer, CounterSnapshot, Item, Notice, SharedIndex, Subscription, lock_index,
};
