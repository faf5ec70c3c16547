//! kvroute's I/O around the pure core (`kvroute-core` has no clock and no sockets).
//!
//! * [`consumer`]: the router's KV-event consumer, one thread that owns every worker's
//!   connections to the engine's PUB and replay ROUTER sockets, runs the core's sequence
//!   tracker on what arrives, decodes with the core's codec and applies each batch to the
//!   shared KV index, without Python.
//! * [`zmtp`]: ZeroMQ's wire protocol (ZMTP 3.0, NULL mechanism) as a pure state machine, which
//!   the consumer drives over its own non-blocking sockets: no libzmq, so no I/O thread of its
//!   own waking once per TCP segment (see the consumer's docs for what that cost).

pub mod consumer;
pub mod zmtp;

pub use consumer::{
    Consumer, CounterSnapshot, Item, MAX_MESSAGE, Notice, SharedIndex, Subscription, lock_index,
};
