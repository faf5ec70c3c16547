//! The consumer thread's loop over every subscription: poll (or, for a busy fleet, read at
//! once), read, follow, apply under one lock, and gather for a window before the next turn.

use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use kvroute_core::kvevents::sequence::{Action, SequenceTracker};
use rustix::event::{PollFd, PollFlags, Timespec};

use super::engine_stream::{EngineStream, Token};
use super::index_sink::IndexSink;
use super::shared::{Counters, Shared, SharedIndex, Subscription, drain_pipe, lock_index};
use super::sockets::{BYTES_PER_TURN, Closed, Dialer, LiveSource};

/// How often a loop with paused streams looks whether the outbox drained.
const PAUSED_POLL: Duration = Duration::from_millis(20);

pub(super) enum Command {
    Add {
        worker: String,
        live: LiveSource,
        subscription: Subscription,
        counters: Arc<Counters>,
    },
    Remove {
        worker: String,
    },
    Stop,
}

/// The thread's state.
pub(super) struct SubscriptionLoop {
    /// Read end of the wake-up pipe (a byte per command).
    pub(super) control: UnixStream,
    pub(super) commands: mpsc::Receiver<Command>,
    pub(super) streams: Vec<EngineStream>,
    pub(super) shared: Arc<Shared>,
    pub(super) index: Option<SharedIndex>,
    pub(super) actions: Vec<Action>,
    /// How long batches gather after a turn that took some (see [`Consumer::start`]).
    pub(super) coalesce: Duration,
}

impl SubscriptionLoop {
    pub(super) fn run(&mut self) {
        let mut ready: Vec<(Token, PollFlags)> = Vec::new();
        let mut closing: Vec<(usize, usize, Closed)> = Vec::new();
        let mut gathering = false;
        loop {
            if gathering {
                // Let the next batches gather: a wake-up costs far more than a batch (see
                // `Consumer::start`).
                std::thread::sleep(self.coalesce);
            }
            let paused = self.index.is_none() && self.shared.outbox_full();
            let now = Instant::now();
            let mut deadline = self
                .streams
                .iter()
                .filter_map(EngineStream::next_deadline)
                .min();
            if paused {
                deadline = Some(deadline.map_or(now + PAUSED_POLL, |d| d.min(now + PAUSED_POLL)));
            }
            let timeout = if gathering {
                Some(Duration::ZERO)
            } else {
                deadline.map(|d| d.saturating_duration_since(now))
            };
            ready.clear();
            if gathering && !paused && self.streams.iter().all(EngineStream::steady) {
                // The usual turn of a busy fleet: every connection is past its handshake and
                // nothing else waits, so each is read at once (a read that finds nothing
                // costs less than a poll over every socket), and commands are taken below as
                // on every turn. A wake-up's fixed cost dominates at a few batches per window.
                for (i, stream) in self.streams.iter().enumerate() {
                    ready.extend(
                        (0..stream.conns.len()).map(|j| (Token::Live(i, j), PollFlags::IN)),
                    );
                }
            } else {
                let mut fds = Vec::with_capacity(1 + 2 * self.streams.len());
                let mut tokens = Vec::with_capacity(fds.capacity());
                fds.push(PollFd::new(&self.control, PollFlags::IN));
                tokens.push(Token::Control);
                for (i, stream) in self.streams.iter().enumerate() {
                    stream.poll_items(i, paused, &mut fds, &mut tokens);
                }
                let timespec = timeout.map(|d| Timespec {
                    tv_sec: d.as_secs() as i64,
                    tv_nsec: i64::from(d.subsec_nanos()),
                });
                match rustix::event::poll(&mut fds, timespec.as_ref()) {
                    Ok(_) => {}
                    Err(rustix::io::Errno::INTR) => {
                        gathering = false;
                        continue;
                    }
                    Err(error) => panic!("poll failed: {error}"),
                }
                for (fd, &token) in fds.iter().zip(&tokens) {
                    let revents = fd.revents();
                    if !revents.is_empty() {
                        ready.push((token, revents));
                    }
                }
            }
            let (mut backlog, mut control) = (false, false);
            let taken_before = self.taken();
            let now = Instant::now();
            for &(token, revents) in &ready {
                match token {
                    Token::Control => control = true,
                    Token::Listener(i) => self.streams[i].accept_all(),
                    Token::Live(i, j) => {
                        let mut budget = BYTES_PER_TURN;
                        let stream = &mut self.streams[i];
                        match stream.service_live(j, revents, &mut budget, &mut self.actions) {
                            Ok(more) => backlog |= more,
                            Err(why) => closing.push((i, j, why)),
                        }
                    }
                    Token::Replay(i) => {
                        self.streams[i].service_replay(revents, &mut self.actions, now);
                    }
                }
            }
            // Connections close after every token was served (their indices stay valid).
            closing.sort_by_key(|&(i, j, _)| std::cmp::Reverse((i, j)));
            for (i, j, why) in closing.drain(..) {
                self.streams[i].live_closed(j, why, now);
            }
            for stream in &mut self.streams {
                if std::mem::take(&mut stream.resume) {
                    stream.pump_all(&mut self.actions, now);
                }
                stream.on_timers(now, &mut self.actions);
                if std::mem::take(&mut stream.resume) {
                    stream.pump_all(&mut self.actions, now); // a replay timed out
                }
            }
            self.apply_pending();
            if control {
                drain_pipe(&self.control);
            }
            while let Ok(command) = self.commands.try_recv() {
                match command {
                    Command::Add {
                        worker,
                        live,
                        subscription,
                        counters,
                    } => self.add(worker, live, subscription, counters),
                    Command::Remove { worker } => self.remove(&worker),
                    Command::Stop => return,
                }
            }
            self.apply_pending();
            // Only after batches (a handshake or a replay's progress waits for nothing), and
            // not while a socket still holds bytes, so the window never caps the rate.
            let received = self.taken() != taken_before;
            gathering = received && !backlog && !self.coalesce.is_zero();
        }
    }

    /// Batches (good or malformed) taken so far, over every stream.
    fn taken(&self) -> u64 {
        let count = |c: &AtomicU64| c.load(Ordering::Relaxed);
        self.streams
            .iter()
            .map(|s| count(&s.sink.counters.batches) + count(&s.sink.counters.malformed))
            .sum()
    }

    /// Apply what every stream decoded this turn, under one lock of the index.
    fn apply_pending(&mut self) {
        let Some(index) = &self.index else {
            return;
        };
        if self.streams.iter().all(|s| s.sink.pending.is_empty()) {
            return;
        }
        let mut index = lock_index(index);
        for stream in &mut self.streams {
            stream.sink.apply(&mut index);
        }
    }

    fn add(
        &mut self,
        worker: String,
        live: LiveSource,
        subscription: Subscription,
        counters: Arc<Counters>,
    ) {
        self.streams.retain(|s| s.sink.worker != worker);
        let (dialer, listener) = match live {
            LiveSource::Dial(address) => (
                Some(Dialer {
                    address,
                    retry_at: None,
                    failures: 0,
                }),
                None,
            ),
            LiveSource::Listen(listener) => (None, Some(listener)),
        };
        let mut stream = EngineStream {
            subscription,
            tracker: SequenceTracker::new(),
            sink: IndexSink {
                worker,
                index: self.index.clone(),
                counters,
                shared: self.shared.clone(),
                pending: Vec::new(),
                id: None,
            },
            conns: Vec::new(),
            dialer,
            listener,
            replay: None,
            held: None,
            resume: false,
            catch_up_pending: false,
        };
        stream.start(Instant::now());
        self.streams.push(stream);
    }

    pub(super) fn remove(&mut self, worker: &str) {
        let mut stream = self
            .streams
            .iter()
            .position(|s| s.sink.worker == worker)
            .map(|at| self.streams.remove(at));
        if let Some(index) = &self.index {
            let mut index = lock_index(index);
            if let Some(stream) = stream.as_mut() {
                stream.sink.apply(&mut index);
            }
            index.remove_worker(worker);
        }
    }
}
