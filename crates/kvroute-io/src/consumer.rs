//! The router's KV-event consumer: one thread owns every worker's ZeroMQ sockets, follows each
//! stream's sequence with the core's [`SequenceTracker`], decodes batches with the core's codec
//! and applies them to the shared KV index, so no batch wakes Python.
//!
//! One message vLLM publishes is the multipart `[topic, seq (8 bytes, big-endian), payload]`
//! on a PUB socket; its replay side is a ROUTER that answers a DEALER's `[b"", start seq]` with
//! `[b"", (topic,) seq, payload]` per buffered batch and an end marker of seq −1 (see
//! `vllm/distributed/kv_events.py` and `docs/vllm.md`). Per stream the thread does what the
//! tracker says:
//!
//! * **catch-up** on subscribing: the engine's whole buffer is replayed before any live batch,
//!   so a router started beside idle engines knows their caches at once;
//! * a **gap** asks the replay socket for the missing batches; the stream's live socket is not
//!   read meanwhile (the tracker wants the answer first), the other streams are;
//! * a **restart**, a **failed replay** or a **malformed** batch reset the worker's entries in
//!   the index (what it stored or removed meanwhile is unknown);
//! * **duplicates** (a replay ahead of the live stream) are skipped.
//!
//! Replays never block the thread: a replay's DEALER is polled with the SUB sockets, with a
//! deadline per awaited message (`replay_timeout`).
//!
//! Python is woken only for what it must see: the rare conditions above, as [`Notice`]s for its
//! log (and, in outbox mode, every item, for `kvroute.kvevents.KVEventSubscriber`), through a
//! socket pair whose read end it watches. Counters ([`CounterSnapshot`]) are atomics read when
//! `/metrics` is scraped.
//!
//! The index is shared as `Arc<Mutex<KvIndex>>` ([`SharedIndex`]): this thread locks it for the
//! apply of one decoded batch (decoding happens outside the lock), the routing step for one
//! decision. An uncontended lock costs tens of nanoseconds against a look-up's ~0.7 µs, and a
//! decision waits at most for one batch's apply; a channel of batches drained by the routing
//! step would instead put every apply on the request path and grow without bound while no
//! request comes.
//!
//! Shutdown is bounded: every socket has linger 0, the thread never blocks outside `zmq_poll`
//! (whose timeout it sets) and [`Consumer::close`] waits for it at most the time it is given.

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvroute_core::index::KvIndex;
use kvroute_core::kvevents::codec::{self, DecodedBatch};
use kvroute_core::kvevents::sequence::{self, Action, SequenceTracker};

/// The KV index shared by the consumer thread (writes) and the routing step (look-ups).
pub type SharedIndex = Arc<Mutex<KvIndex>>;

/// Lock the shared index. A panic while it was held (a bug) does not make the router stop
/// routing: the lock is taken anyway.
pub fn lock_index(index: &SharedIndex) -> MutexGuard<'_, KvIndex> {
    index.lock().unwrap_or_else(PoisonError::into_inner)
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Receive queue of a SUB socket in messages: vLLM's default publisher high-water mark, so a
/// busy router loses nothing the engine did not already drop.
pub const RCVHWM: i32 = 100_000;
/// Messages taken from one socket per turn of the loop, so one busy stream cannot starve the
/// others (ZeroMQ's poll is level-triggered: the rest is taken on the next turn).
const MESSAGES_PER_TURN: usize = 256;
/// Items the outbox may hold before outbox-mode streams stop being read (their SUB queues
/// then fill and drop, which the tracker sees as gaps): a consumer nobody reads stays bounded.
const OUTBOX_LIMIT: usize = 100_000;
/// How often a loop with paused streams looks whether the outbox drained.
const PAUSED_POLL_MS: i64 = 20;
/// Frames kept per message; longer messages are malformed anyway (only their lengths count).
const MAX_FRAMES: usize = 5;
/// The replay stream's end marker: seq −1 as a signed 8-byte big-endian integer.
const END_SEQ: [u8; 8] = [0xff; 8];
/// The thread's command socket (in the consumer's own ZeroMQ context).
const COMMANDS: &str = "inproc://kvroute-consumer-commands";

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
    /// The worker's name (as given to [`Consumer::add_worker`]).
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
struct Counters {
    batches: AtomicU64,
    events: AtomicU64,
    unknown_events: AtomicU64,
    malformed: AtomicU64,
    gaps: AtomicU64,
    replay_failures: AtomicU64,
    restarts: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> CounterSnapshot {
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

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

/// What the thread and the handle share.
struct Shared {
    /// Notices for Python, oldest first.
    outbox: Mutex<VecDeque<Notice>>,
    /// Write end of the bell: one byte when the outbox stops being empty.
    bell: UnixStream,
    /// Every followed worker's counters.
    counters: Mutex<HashMap<String, Arc<Counters>>>,
}

impl Shared {
    fn post(&self, notice: Notice) {
        let mut outbox = lock(&self.outbox);
        let was_empty = outbox.is_empty();
        outbox.push_back(notice);
        drop(outbox);
        if was_empty {
            // Non-blocking: a full socket buffer already holds a wake-up.
            let _ = (&self.bell).write(&[1]);
        }
    }

    fn outbox_full(&self) -> bool {
        lock(&self.outbox).len() >= OUTBOX_LIMIT
    }
}

enum Command {
    Add {
        worker: String,
        sub: zmq::Socket,
        subscription: Subscription,
        counters: Arc<Counters>,
    },
    Remove {
        worker: String,
    },
    Stop,
}

/// The consumer: a handle on its thread. Workers are added and removed by name; the thread
/// runs until [`Consumer::close`] (or the handle is dropped).
pub struct Consumer {
    ctx: zmq::Context,
    commands: mpsc::Sender<Command>,
    /// The handle's end of the command socket: a message wakes the thread.
    wake: Mutex<zmq::Socket>,
    thread: Mutex<Option<(JoinHandle<()>, mpsc::Receiver<()>)>>,
    shared: Arc<Shared>,
    /// Read end of the bell (see [`Consumer::notice_fd`]).
    bell: UnixStream,
}

impl Consumer {
    /// Start the thread. With an index, every stream's batches are applied to it and only the
    /// conditions that reset a worker are posted as notices (for the log); without one, every
    /// item is posted (the outbox mode of `KVEventSubscriber`).
    ///
    /// `coalesce`: after a turn that took messages (and left none queued), the thread sleeps
    /// this long before polling again, so the batches of several engine steps are taken in
    /// one wake-up. Waking costs ~20 µs of CPU on a shared 2-core VM against ~3 µs to decode
    /// and apply a batch; a couple of milliseconds more before the index has a batch matters
    /// little beside an engine step (and the predicted entries bridge it). Zero: poll again
    /// at once.
    pub fn start(index: Option<SharedIndex>, coalesce: Duration) -> std::io::Result<Self> {
        let ctx = zmq::Context::new();
        let zmq_err = |e: zmq::Error| std::io::Error::other(e.to_string());
        let control = ctx.socket(zmq::PAIR).map_err(zmq_err)?;
        control.set_linger(0).map_err(zmq_err)?;
        control.bind(COMMANDS).map_err(zmq_err)?;
        let wake = ctx.socket(zmq::PAIR).map_err(zmq_err)?;
        wake.set_linger(0).map_err(zmq_err)?;
        wake.connect(COMMANDS).map_err(zmq_err)?;
        let (bell_read, bell_write) = UnixStream::pair()?;
        bell_read.set_nonblocking(true)?;
        bell_write.set_nonblocking(true)?;
        let shared = Arc::new(Shared {
            outbox: Mutex::new(VecDeque::new()),
            bell: bell_write,
            counters: Mutex::new(HashMap::new()),
        });
        let (commands, receiver) = mpsc::channel();
        let (done_tx, done_rx) = mpsc::channel();
        let mut state = Loop {
            ctx: ctx.clone(),
            control,
            commands: receiver,
            streams: Vec::new(),
            shared: shared.clone(),
            index,
            actions: Vec::new(),
            coalesce,
        };
        let thread_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("kvroute-kv-events".into())
            .spawn(move || {
                let outcome = catch_unwind(AssertUnwindSafe(|| state.run()));
                drop(state); // closes every socket (linger 0) before saying it is done
                if let Err(panic) = outcome {
                    let error = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "unknown panic".into());
                    thread_shared.post(Notice {
                        worker: String::new(),
                        item: Item::Crashed { error },
                    });
                }
                let _ = done_tx.send(());
            })?;
        Ok(Self {
            ctx,
            commands,
            wake: Mutex::new(wake),
            thread: Mutex::new(Some((thread, done_rx))),
            shared,
            bell: bell_read,
        })
    }

    fn ring(&self) {
        // A full command pipe means the thread has wake-ups pending already.
        let _ = lock(&self.wake).send(&b""[..], zmq::DONTWAIT);
    }

    /// Follow `worker`'s stream (replacing a stream of that name). The SUB socket is made
    /// here, so a malformed address fails at once; returns its address (the bound one, port
    /// resolved, when binding).
    pub fn add_worker(&self, worker: &str, subscription: Subscription) -> Result<String, String> {
        let fail = |e: zmq::Error| format!("cannot subscribe to {}: {e}", subscription.endpoint);
        let sub = self.ctx.socket(zmq::SUB).map_err(fail)?;
        sub.set_linger(0).map_err(fail)?;
        sub.set_rcvhwm(RCVHWM).map_err(fail)?;
        sub.set_subscribe(&subscription.topic).map_err(fail)?;
        let endpoint = if subscription.bind {
            sub.bind(&subscription.endpoint).map_err(fail)?;
            match sub.get_last_endpoint().map_err(fail)? {
                Ok(endpoint) => endpoint,
                Err(_) => subscription.endpoint.clone(),
            }
        } else {
            sub.connect(&subscription.endpoint).map_err(fail)?;
            subscription.endpoint.clone()
        };
        let counters = Arc::new(Counters::default());
        lock(&self.shared.counters).insert(worker.to_string(), counters.clone());
        let command = Command::Add {
            worker: worker.to_string(),
            sub,
            subscription,
            counters,
        };
        self.commands
            .send(command)
            .map_err(|_| "the KV event consumer has stopped".to_string())?;
        self.ring();
        Ok(endpoint)
    }

    /// Stop following `worker` (its sockets close; in index mode its entries are dropped
    /// after its last batch, so no late batch brings it back).
    pub fn remove_worker(&self, worker: &str) {
        lock(&self.shared.counters).remove(worker);
        let _ = self.commands.send(Command::Remove {
            worker: worker.to_string(),
        });
        self.ring();
    }

    /// The counts of every followed worker, by name.
    pub fn counters(&self) -> Vec<(String, CounterSnapshot)> {
        lock(&self.shared.counters)
            .iter()
            .map(|(name, c)| (name.clone(), c.snapshot()))
            .collect()
    }

    /// A descriptor that becomes readable when notices are waiting (watch it, then call
    /// [`Consumer::take_notices`]).
    pub fn notice_fd(&self) -> RawFd {
        self.bell.as_raw_fd()
    }

    /// The notices posted since the last call, oldest first.
    pub fn take_notices(&self) -> Vec<Notice> {
        // The bell first: a notice posted after this read rings it again.
        let mut buf = [0u8; 256];
        loop {
            match (&self.bell).read(&mut buf) {
                Ok(n) if n > 0 => continue,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                _ => break,
            }
        }
        lock(&self.shared.outbox).drain(..).collect()
    }

    /// Stop the thread, waiting at most `timeout`; true if it stopped in time. Idempotent.
    /// A thread that did not stop in time (it never should: it blocks only in a poll it
    /// bounds) is left to finish on its own.
    pub fn close(&self, timeout: Duration) -> bool {
        let Some((thread, done)) = lock(&self.thread).take() else {
            return true;
        };
        let _ = self.commands.send(Command::Stop);
        self.ring();
        match done.recv_timeout(timeout) {
            Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                let _ = thread.join();
                true
            }
            Err(mpsc::RecvTimeoutError::Timeout) => false,
        }
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        self.close(Duration::from_secs(2));
    }
}

// --- the thread ----------------------------------------------------------------------------

/// Why a replay was asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Purpose {
    CatchUp,
    Gap,
}

/// A replay in progress: its DEALER, what it brought so far, and when it gives up.
struct Replay {
    dealer: zmq::Socket,
    purpose: Purpose,
    received: Vec<(u64, Vec<u8>)>,
    deadline: Instant,
}

/// Where one stream's items go.
struct Sink {
    worker: String,
    index: Option<SharedIndex>,
    counters: Arc<Counters>,
    shared: Arc<Shared>,
}

impl Sink {
    fn post(&self, item: Item) {
        self.shared.post(Notice {
            worker: self.worker.clone(),
            item,
        });
    }

    /// Decode and deliver batch `seq`: apply it (index mode) or post it.
    fn deliver(&self, seq: u64, payload: &[u8], replayed: bool) {
        match codec::decode_batch(payload) {
            Ok(batch) => {
                let c = &self.counters;
                bump(&c.batches, 1);
                bump(&c.events, batch.events.len() as u64);
                bump(&c.unknown_events, batch.unknown_events as u64);
                match &self.index {
                    Some(index) => lock_index(index).apply(&self.worker, &batch.events),
                    None => self.post(Item::Batch {
                        seq,
                        batch,
                        replayed,
                    }),
                }
            }
            Err(error) => self.malformed(Some(seq), error.0),
        }
    }

    fn reset(&self) {
        if let Some(index) = &self.index {
            lock_index(index).reset_worker(&self.worker);
        }
    }

    fn gap(&self, expected: u64, got: u64) {
        bump(&self.counters.gaps, 1);
        if self.index.is_none() {
            self.post(Item::Gap { expected, got });
        }
    }

    fn replay_failed(&self, expected: u64, got: u64, reason: String) {
        bump(&self.counters.replay_failures, 1);
        self.reset();
        self.post(Item::ReplayFailed {
            expected,
            got,
            reason,
        });
    }

    fn restarted(&self, last_seq: Option<u64>, new_seq: u64) {
        bump(&self.counters.restarts, 1);
        self.reset();
        self.post(Item::Restarted { last_seq, new_seq });
    }

    fn malformed(&self, seq: Option<u64>, error: String) {
        bump(&self.counters.malformed, 1);
        self.reset();
        self.post(Item::Malformed { seq, error });
    }
}

/// One engine's stream.
struct Stream {
    sub: zmq::Socket,
    subscription: Subscription,
    tracker: SequenceTracker,
    sink: Sink,
    replay: Option<Replay>,
    /// The live payload that showed a gap, handed over once the replay answered.
    held: Option<Vec<u8>>,
    /// The message being read (frames reused from message to message).
    frames: Vec<zmq::Message>,
}

/// Receive one multipart message into `frames` without waiting: its frame count, or None if
/// none is queued. Frames beyond [`MAX_FRAMES`] are read and counted, their bytes dropped
/// (their lengths only matter for the error message).
fn recv_message(
    socket: &zmq::Socket,
    frames: &mut Vec<zmq::Message>,
    lengths: &mut Vec<usize>,
) -> Result<Option<usize>, zmq::Error> {
    lengths.clear();
    if frames.is_empty() {
        frames.push(zmq::Message::new());
    }
    match socket.recv(&mut frames[0], zmq::DONTWAIT) {
        Ok(()) => {}
        Err(zmq::Error::EAGAIN) => return Ok(None),
        Err(e) => return Err(e),
    }
    lengths.push(frames[0].len());
    let mut n = 1;
    let mut more = frames[0].get_more();
    let mut spare = zmq::Message::new();
    while more {
        // The rest of a multipart message is delivered with its first frame.
        if n < MAX_FRAMES {
            if frames.len() == n {
                frames.push(zmq::Message::new());
            }
            socket.recv(&mut frames[n], 0)?;
            more = frames[n].get_more();
            lengths.push(frames[n].len());
        } else {
            socket.recv(&mut spare, 0)?;
            more = spare.get_more();
            lengths.push(spare.len());
        }
        n += 1;
    }
    Ok(Some(n))
}

impl Stream {
    /// Start following: forget what the index knew (a catch-up replays every store again)
    /// and ask for the catch-up replay.
    fn start(&mut self, ctx: &zmq::Context) {
        self.sink.reset();
        if self.subscription.catch_up && self.subscription.replay_endpoint.is_some() {
            // A replay that cannot even be asked for leaves everything to the live stream
            // (the tracker makes nothing of an empty catch-up).
            let _ = self.start_replay(ctx, 0, Purpose::CatchUp);
        }
    }

    /// Take what the readable socket holds (the SUB, or the replay's DEALER).
    /// True if the live socket was drained (or a replay is running).
    fn on_readable(
        &mut self,
        ctx: &zmq::Context,
        actions: &mut Vec<Action>,
        lengths: &mut Vec<usize>,
    ) -> bool {
        if self.replay.is_some() {
            self.read_replay(ctx, actions, lengths);
            true
        } else {
            self.read_live(ctx, actions, lengths)
        }
    }

    /// Take up to [`MESSAGES_PER_TURN`] live messages; true if none is left (or a replay
    /// started).
    fn read_live(
        &mut self,
        ctx: &zmq::Context,
        actions: &mut Vec<Action>,
        lengths: &mut Vec<usize>,
    ) -> bool {
        for _ in 0..MESSAGES_PER_TURN {
            if self.replay.is_some() {
                return true; // a gap: the live socket waits for the replay's answer
            }
            let n = match recv_message(&self.sub, &mut self.frames, lengths) {
                Ok(Some(n)) => n,
                Ok(None) | Err(_) => return true,
            };
            // The fast path: the batch after the last one.
            if n == 3
                && let Some(seq) = sequence::parse_seq(&self.frames[1])
                && self.tracker.in_order(seq)
            {
                self.sink.deliver(seq, &self.frames[2], false);
                continue;
            }
            let payload = (n == 3).then(|| self.frames[2].to_vec());
            if n == 3 {
                let frames: [&[u8]; 3] = [&self.frames[0], &self.frames[1], &self.frames[2]];
                self.tracker.live_message(&frames, actions);
            } else {
                // Wrong framing (what the tracker says of it, without handing it every frame).
                actions.push(Action::MalformedFrames {
                    frame_lengths: lengths.clone(),
                });
            }
            self.follow(ctx, actions, payload.as_deref(), &[]);
        }
        false
    }

    /// Do what the tracker said (`actions`, drained): hand batches over, report conditions,
    /// start the replay it asks for.
    fn follow(
        &mut self,
        ctx: &zmq::Context,
        actions: &mut Vec<Action>,
        live: Option<&[u8]>,
        replayed: &[(u64, Vec<u8>)],
    ) {
        let mut replay_from = None;
        for action in actions.drain(..) {
            match action {
                Action::Live { seq } => {
                    self.sink
                        .deliver(seq, live.expect("a live action has its payload"), false)
                }
                Action::Replayed { seq, index } => self.sink.deliver(seq, &replayed[index].1, true),
                Action::Gap { expected, got } => self.sink.gap(expected, got),
                Action::Replay { from } => replay_from = Some(from),
                Action::ReplayFailed {
                    expected,
                    got,
                    reason,
                } => self.sink.replay_failed(expected, got, reason),
                Action::Restarted { last_seq, new_seq } => self.sink.restarted(last_seq, new_seq),
                Action::MalformedFrames { frame_lengths } => self.sink.malformed(
                    None,
                    format!("expected [topic, 8-byte seq, payload], got frames of {frame_lengths:?} bytes"),
                ),
            }
        }
        // The tracker's last action of a live message, when there is a gap.
        if let Some(from) = replay_from {
            self.held = live.map(<[u8]>::to_vec);
            if let Err(reason) = self.start_replay(ctx, from, Purpose::Gap) {
                self.finish_replay_with(ctx, actions, Purpose::Gap, Vec::new(), Some(reason));
            }
        }
    }

    /// Ask the replay socket for every buffered batch from `from` on. A fresh DEALER per
    /// request: a late answer to a timed-out request can never be taken for the next one's.
    fn start_replay(
        &mut self,
        ctx: &zmq::Context,
        from: u64,
        purpose: Purpose,
    ) -> Result<(), String> {
        let Some(endpoint) = &self.subscription.replay_endpoint else {
            return Err("no replay endpoint configured".into());
        };
        let fail = |e: zmq::Error| format!("replay endpoint {endpoint}: {e}");
        let dealer = ctx.socket(zmq::DEALER).map_err(fail)?;
        dealer.set_linger(0).map_err(fail)?;
        dealer.connect(endpoint).map_err(fail)?;
        // Queued on the connecting pipe: a DEALER accepts messages before its peer is up.
        dealer
            .send(&b""[..], zmq::SNDMORE | zmq::DONTWAIT)
            .map_err(fail)?;
        dealer
            .send(&from.to_be_bytes()[..], zmq::DONTWAIT)
            .map_err(fail)?;
        self.replay = Some(Replay {
            dealer,
            purpose,
            received: Vec::new(),
            deadline: Instant::now() + self.subscription.replay_timeout,
        });
        Ok(())
    }

    fn read_replay(
        &mut self,
        ctx: &zmq::Context,
        actions: &mut Vec<Action>,
        lengths: &mut Vec<usize>,
    ) {
        for _ in 0..4 * MESSAGES_PER_TURN {
            let replay = self.replay.as_mut().expect("a replay is running");
            let n = match recv_message(&replay.dealer, &mut self.frames, lengths) {
                Ok(Some(n)) => n,
                Ok(None) => return,
                Err(e) => {
                    let endpoint = self
                        .subscription
                        .replay_endpoint
                        .clone()
                        .unwrap_or_default();
                    return self.finish_replay(
                        ctx,
                        actions,
                        Some(format!("replay endpoint {endpoint}: {e}")),
                    );
                }
            };
            // Current vLLM: [b"", topic, seq, payload]; before the topic frame was added:
            // [b"", seq, payload]. The end marker has seq -1 and an empty payload in both.
            if !(n == 3 || n == 4) || !self.frames[0].is_empty() || self.frames[n - 2].len() != 8 {
                return self.finish_replay(
                    ctx,
                    actions,
                    Some(format!("unexpected replay reply of {n} frames")),
                );
            }
            if self.frames[n - 2][..] == END_SEQ {
                return self.finish_replay(ctx, actions, None);
            }
            let seq = sequence::parse_seq(&self.frames[n - 2]).expect("8 bytes");
            replay.received.push((seq, self.frames[n - 1].to_vec()));
            replay.deadline = Instant::now() + self.subscription.replay_timeout;
        }
    }

    fn replay_timed_out(&mut self, ctx: &zmq::Context, actions: &mut Vec<Action>) {
        let endpoint = self
            .subscription
            .replay_endpoint
            .clone()
            .unwrap_or_default();
        let seconds = self.subscription.replay_timeout.as_secs_f64();
        self.finish_replay(
            ctx,
            actions,
            Some(format!(
                "no reply from replay endpoint {endpoint} within {seconds}s"
            )),
        );
    }

    fn finish_replay(
        &mut self,
        ctx: &zmq::Context,
        actions: &mut Vec<Action>,
        failure: Option<String>,
    ) {
        let replay = self.replay.take().expect("a replay is running");
        self.finish_replay_with(ctx, actions, replay.purpose, replay.received, failure);
    }

    /// The replay's answer to the tracker, and what it says to do.
    fn finish_replay_with(
        &mut self,
        ctx: &zmq::Context,
        actions: &mut Vec<Action>,
        purpose: Purpose,
        received: Vec<(u64, Vec<u8>)>,
        failure: Option<String>,
    ) {
        match purpose {
            // A failed catch-up leaves the rest to the live stream: what came is used.
            Purpose::CatchUp => self.tracker.catch_up_done(&received, actions),
            Purpose::Gap => self.tracker.replay_done(&received, failure, actions),
        }
        let held = self.held.take();
        self.follow(ctx, actions, held.as_deref(), &received);
    }
}

/// The thread's state.
struct Loop {
    ctx: zmq::Context,
    control: zmq::Socket,
    commands: mpsc::Receiver<Command>,
    streams: Vec<Stream>,
    shared: Arc<Shared>,
    index: Option<SharedIndex>,
    actions: Vec<Action>,
    /// How long batches gather after a turn that took some (see [`Consumer::start`]).
    coalesce: Duration,
}

impl Loop {
    fn run(&mut self) {
        let mut readable: Vec<usize> = Vec::new();
        let mut polled: Vec<usize> = Vec::new();
        let mut lengths: Vec<usize> = Vec::new();
        loop {
            let paused = self.index.is_none() && self.shared.outbox_full();
            let now = Instant::now();
            let mut timeout: i64 = -1;
            for stream in &self.streams {
                if let Some(replay) = &stream.replay {
                    let left = replay.deadline.saturating_duration_since(now);
                    let ms = left.as_micros().div_ceil(1000) as i64;
                    timeout = if timeout < 0 { ms } else { timeout.min(ms) };
                }
            }
            if paused {
                timeout = if timeout < 0 {
                    PAUSED_POLL_MS
                } else {
                    timeout.min(PAUSED_POLL_MS)
                };
            }
            readable.clear();
            polled.clear();
            let control_ready = {
                let mut items = Vec::with_capacity(1 + self.streams.len());
                items.push(self.control.as_poll_item(zmq::POLLIN));
                for (i, stream) in self.streams.iter().enumerate() {
                    if let Some(replay) = &stream.replay {
                        items.push(replay.dealer.as_poll_item(zmq::POLLIN));
                    } else if !paused {
                        items.push(stream.sub.as_poll_item(zmq::POLLIN));
                    } else {
                        continue;
                    }
                    polled.push(i);
                }
                match zmq::poll(&mut items, timeout) {
                    Ok(_) => {}
                    Err(zmq::Error::EINTR) => continue,
                    Err(_) => return, // the context is gone: nothing more to follow
                }
                for (item, &i) in items[1..].iter().zip(&polled) {
                    if item.is_readable() {
                        readable.push(i);
                    }
                }
                items[0].is_readable()
            };
            let (mut received, mut backlog) = (false, false);
            for &i in &readable {
                let drained =
                    self.streams[i].on_readable(&self.ctx, &mut self.actions, &mut lengths);
                received = true;
                backlog |= !drained;
            }
            // Let the next batches gather before polling again: a wake-up costs far more than
            // a batch (see `Consumer::start`). Not while a socket still holds messages, so the
            // window never caps the rate.
            if received && !backlog && !self.coalesce.is_zero() {
                std::thread::sleep(self.coalesce);
            }
            let now = Instant::now();
            for stream in &mut self.streams {
                if stream.replay.as_ref().is_some_and(|r| r.deadline <= now) {
                    stream.replay_timed_out(&self.ctx, &mut self.actions);
                }
            }
            if control_ready {
                let mut wake = zmq::Message::new();
                while self.control.recv(&mut wake, zmq::DONTWAIT).is_ok() {}
            }
            while let Ok(command) = self.commands.try_recv() {
                match command {
                    Command::Add {
                        worker,
                        sub,
                        subscription,
                        counters,
                    } => self.add(worker, sub, subscription, counters),
                    Command::Remove { worker } => self.remove(&worker),
                    Command::Stop => return,
                }
            }
        }
    }

    fn add(
        &mut self,
        worker: String,
        sub: zmq::Socket,
        subscription: Subscription,
        counters: Arc<Counters>,
    ) {
        self.streams.retain(|s| s.sink.worker != worker);
        let mut stream = Stream {
            sub,
            subscription,
            tracker: SequenceTracker::new(),
            sink: Sink {
                worker,
                index: self.index.clone(),
                counters,
                shared: self.shared.clone(),
            },
            replay: None,
            held: None,
            frames: Vec::new(),
        };
        stream.start(&self.ctx);
        self.streams.push(stream);
    }

    fn remove(&mut self, worker: &str) {
        self.streams.retain(|s| s.sink.worker != worker);
        if let Some(index) = &self.index {
            lock_index(index).remove_worker(worker);
        }
    }
}

#[cfg(test)]
mod tests;
