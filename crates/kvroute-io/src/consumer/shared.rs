//! What the consumer thread and its handle share: the subscriptions, the shared index, the
//! items and notices posted for Python, and each stream's counters.

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use kvroute_core::index::KvIndex;
use kvroute_core::kvevents::codec::DecodedBatch;

/// The KV index shared by the consumer thread (writes) and the routing step (look-ups).
pub type SharedIndex = Arc<Mutex<KvIndex>>;

/// Lock the shared index. A panic while it was held (a bug) does not make the router stop
/// routing: the lock is taken anyway.
pub fn lock_index(index: &SharedIndex) -> MutexGuard<'_, KvIndex> {
    index.lock().unwrap_or_else(PoisonError::into_inner)
}

pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Items the outbox may hold before outbox-mode streams stop being read (the kernel's and the
/// publisher's queues then fill and the publisher drops, which the tracker sees as gaps): a
/// consumer nobody reads stays bounded.
const OUTBOX_LIMIT: usize = 100_000;

/// Where one engine's KV events come from, and how to follow them.
#[derive(Clone, Debug)]
pub struct Subscription {
    /// The engine's PUB address (connected), or the address to bind (`bind`).
    pub endpoint: String,
    /// The engine's replay ROUTER address; None: gaps cannot be repaired.
    pub replay_endpoint: Option<String>,
    /// Subscription prefix (vLLM's `topic`; empty for all).
    pub topic: Vec<u8>,
    /// Bind the SUB socket instead of connecting it (engines with an explicit-host endpoint
    /// connect to the subscriber).
    pub bind: bool,
    /// Longest wait for each message of a replay.
    pub replay_timeout: Duration,
    /// Replay the engine's buffer before any live batch.
    pub catch_up: bool,
}

/// What happened on a stream, as the outbox hands it over.
#[derive(Debug)]
pub enum Item {
    /// A decoded batch; `replayed` if it came from the replay socket.
    Batch {
        /// Its sequence number.
        seq: u64,
        /// The decoded payload.
        batch: DecodedBatch,
        /// True if it came from the replay socket.
        replayed: bool,
    },
    /// Live `got` arrived while `expected` was next; a replay attempt follows.
    Gap {
        /// The seq that should have come.
        expected: u64,
        /// The seq that came.
        got: u64,
    },
    /// Batches `expected..got` are lost for good (the worker's entries were reset).
    ReplayFailed {
        /// First lost seq.
        expected: u64,
        /// First seq after the loss.
        got: u64,
        /// Why the replay could not fill the gap.
        reason: String,
    },
    /// The sequence went back: a new engine process (the worker's entries were reset).
    Restarted {
        /// The last seq handed over before, if any.
        last_seq: Option<u64>,
        /// The new process's first seq seen.
        new_seq: u64,
    },
    /// A message that could not be decoded (the worker's entries were reset); `seq` is None
    /// when even its framing was wrong.
    Malformed {
        /// Its seq, when the framing was right.
        seq: Option<u64>,
        /// What was wrong.
        error: String,
    },
    /// The consumer thread stopped on a bug (a panic); no stream is followed any more.
    Crashed {
        /// The panic's message.
        error: String,
    },
}

/// An [`Item`] of one worker's stream.
#[derive(Debug)]
pub struct Notice {
    /// The worker's name (as given to [`Consumer::add_worker`](super::Consumer::add_worker)).
    pub worker: String,
    /// What happened.
    pub item: Item,
}

/// Cumulative counts of one worker's stream (the router's `kvroute_router_kv_*` metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CounterSnapshot {
    /// Batches decoded and delivered.
    pub batches: u64,
    /// Events of known types in them.
    pub events: u64,
    /// Events of unknown types skipped.
    pub unknown_events: u64,
    /// Batches that could not be decoded, or messages with wrong framing.
    pub malformed: u64,
    /// Sequence gaps seen.
    pub gaps: u64,
    /// Gaps the replay could not fill.
    pub replay_failures: u64,
    /// Sequence restarts (new engine processes).
    pub restarts: u64,
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) batches: AtomicU64,
    pub(super) events: AtomicU64,
    pub(super) unknown_events: AtomicU64,
    pub(super) malformed: AtomicU64,
    pub(super) gaps: AtomicU64,
    pub(super) replay_failures: AtomicU64,
    pub(super) restarts: AtomicU64,
}

impl Counters {
    pub(super) fn snapshot(&self) -> CounterSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CounterSnapshot {
            batches: get(&self.batches),
            events: get(&self.events),
            unknown_events: get(&self.unknown_events),
            malformed: get(&self.malformed),
            gaps: get(&self.gaps),
            replay_failures: get(&self.replay_failures),
            restarts: get(&self.restarts),
        }
    }
}

pub(super) fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

/// What the thread and the handle share.
pub(super) struct Shared {
    /// Notices for Python, oldest first.
    pub(super) outbox: Mutex<VecDeque<Notice>>,
    /// Write end of the bell: one byte when the outbox stops being empty.
    pub(super) bell: UnixStream,
    /// Every followed worker's counters.
    pub(super) counters: Mutex<HashMap<String, Arc<Counters>>>,
}

impl Shared {
    pub(super) fn post(&self, notice: Notice) {
        let mut outbox = lock(&self.outbox);
        let was_empty = outbox.is_empty();
        outbox.push_back(notice);
        drop(outbox);
        if was_empty {
            // Non-blocking: a full socket buffer already holds a wake-up.
            let _ = (&self.bell).write(&[1]);
        }
    }

    pub(super) fn outbox_full(&self) -> bool {
        lock(&self.outbox).len() >= OUTBOX_LIMIT
    }
}

/// Read a non-blocking pipe empty.
pub(super) fn drain_pipe(mut pipe: &UnixStream) {
    let mut buf = [0u8; 256];
    loop {
        match pipe.read(&mut buf) {
            Ok(n) if n > 0 => continue,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            _ => break,
        }
    }
}
