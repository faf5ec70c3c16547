//! The router's KV-event consumer: one thread owns every worker's sockets, follows each
//! stream's sequence with the core's
//! [`SequenceTracker`](kvroute_core::kvevents::sequence::SequenceTracker), decodes batches
//! with the core's codec and applies them to the shared KV index, so no batch wakes Python.
//!
//! One message vLLM publishes is the multipart `[topic, seq (8 bytes, big-endian), payload]`
//! on a PUB socket; its replay side is a ROUTER that answers a DEALER's `[b"", start seq]` with
//! `[b"", (topic,) seq, payload]` per buffered batch and an end marker of seq −1 (see
//! `vllm/distributed/kv_events.py` and `docs/vllm.md`). Per stream the thread does what the
//! tracker says:
//!
//! * **catch-up** on subscribing: the engine's whole buffer is replayed before any live batch,
//!   so a router started beside idle engines knows their caches at once;
//! * a **gap** asks the replay socket for the missing batches; the stream's live connections
//!   are not read meanwhile (the tracker wants the answer first; the kernel's and the
//!   publisher's queues hold what comes), the other streams are;
//! * a **restart**, a **failed replay** or a **malformed** batch reset the worker's entries in
//!   the index (what it stored or removed meanwhile is unknown);
//! * **duplicates** (a replay ahead of the live stream) are skipped.
//!
//! The thread speaks ZeroMQ's wire protocol itself ([`crate::zmtp`], ZMTP 3.0 with the NULL
//! mechanism) over non-blocking TCP and Unix sockets, as a SUB towards the engine's PUB and a
//! DEALER towards its replay ROUTER: there is no libzmq I/O thread, which wakes once per TCP
//! segment (one per batch, costing more CPU than decoding and applying it). The thread blocks in `poll` while every stream is idle; once batches come it takes
//! what every socket holds, applies all of it under one lock of the index, and then sleeps
//! the gathering window (`coalesce`) before it looks again, so a busy fleet costs one wake-up
//! per window, not one per batch. That wake-up is the floor of the thread's cost
//! (`benchmarks/kv_events_consume.py` measures it), so a gathering turn
//! whose streams are all in traffic skips the poll and reads each connection at once. What
//! libzmq does for a consumer it does too: connect without blocking and reconnect,
//! backing off (an engine that dies or restarts is followed again when it is back; the
//! tracker sees the restart or the gap), bind and accept several publishers (`bind`), and
//! bound its memory (a message over [`MAX_MESSAGE`] bytes or a framing error is counted as
//! malformed and its connection reset). Replays never block the thread either: a replay's
//! connection is polled with the live ones, with a deadline per awaited message
//! (`replay_timeout`).
//!
//! Python is woken only for what it must see: the rare conditions above, as [`Notice`]s for its
//! log (and, in outbox mode, every item, for `kvroute.kvevents.KVEventSubscriber`), through a
//! socket pair whose read end it watches. Counters ([`CounterSnapshot`]) are atomics read when
//! `/metrics` is scraped.
//!
//! The index is shared as `Arc<Mutex<KvIndex>>` ([`SharedIndex`]): this thread locks it once
//! per turn to apply what the turn decoded (decoding happens outside the lock), the routing
//! step once per decision. A decision waits at most for one turn's applies (a few batches);
//! a channel of batches drained by the routing step would instead put every apply on the
//! request path and grow without bound while no request comes.
//!
//! Shutdown is bounded: the thread never blocks outside `poll` (whose timeout it sets) and the
//! gathering sleep, and [`Consumer::close`] waits for it at most the time it is given.
//!
//! The parts, in the order they depend on each other: `shared` (what the thread and its handle
//! share: subscriptions, notices, counters, the index), `sockets` (endpoints, listeners, one
//! ZMTP connection, the reconnect schedule), `replay` (one replay conversation), `index_sink`
//! (where a stream's items go), `engine_stream` (one engine's stream, followed as its tracker
//! says), `subscription_loop` (the thread's loop over every stream) and `handle` ([`Consumer`]).

mod engine_stream;
mod handle;
mod index_sink;
mod replay;
mod shared;
mod sockets;
mod subscription_loop;

pub use handle::Consumer;
pub use shared::{CounterSnapshot, Item, Notice, SharedIndex, Subscription, lock_index};
pub use sockets::MAX_MESSAGE;

#[cfg(test)]
mod tests;
