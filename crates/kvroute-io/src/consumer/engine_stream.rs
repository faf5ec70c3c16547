//! One engine's stream: its live connections, its replay and its sequence tracker, followed
//! as the tracker says.

use std::time::Instant;

use kvroute_core::kvevents::sequence::{self, Action, SequenceTracker};
use rustix::event::{PollFd, PollFlags};

use super::index_sink::IndexSink;
use super::replay::{Progress, Purpose, Replay};
use super::shared::Subscription;
use super::sockets::{Address, Closed, Conn, Dialer, Listener, MAX_ACCEPTED, ReadOutcome};
use crate::zmtp::{Event, ProtocolError, SocketType};

/// One engine's stream.
pub(super) struct EngineStream {
    pub(super) subscription: Subscription,
    pub(super) tracker: SequenceTracker,
    pub(super) sink: IndexSink,
    /// Live connections: the dialer's one, or the publishers a listener accepted.
    pub(super) conns: Vec<Conn>,
    pub(super) dialer: Option<Dialer>,
    pub(super) listener: Option<Listener>,
    pub(super) replay: Option<Replay>,
    /// The live payload that showed a gap, handed over once the replay answered.
    pub(super) held: Option<Vec<u8>>,
    /// A replay ended this turn: the live bytes already buffered are taken again.
    pub(super) resume: bool,
    /// The catch-up replay is still to be asked for (see [`EngineStream::start`]).
    pub(super) catch_up_pending: bool,
}

/// A descriptor in one turn's poll set.
#[derive(Clone, Copy, Debug)]
pub(super) enum Token {
    Control,
    Listener(usize),
    Live(usize, usize),
    Replay(usize),
}

impl EngineStream {
    /// Start following: forget what the index knew (a catch-up replays every store again),
    /// connect, and ask for the catch-up replay: at once when publishers connect to us, else
    /// once the live connection's handshake is done and its subscription sent. A replay asked
    /// before could be answered before the subscription reaches the engine, and a batch
    /// published in between would be in neither (found only when the next one shows the gap).
    pub(super) fn start(&mut self, now: Instant) {
        self.sink.reset();
        self.catch_up_pending =
            self.subscription.catch_up && self.subscription.replay_endpoint.is_some();
        if self.dialer.is_some() {
            self.connect_live(now);
        } else {
            self.catch_up(now);
        }
    }

    /// Ask for the catch-up replay if it is still to be asked for.
    fn catch_up(&mut self, now: Instant) {
        if std::mem::take(&mut self.catch_up_pending) {
            // A replay that cannot even be asked for leaves everything to the live stream
            // (the tracker makes nothing of an empty catch-up).
            let _ = self.start_replay(0, Purpose::CatchUp, now);
        }
    }

    fn connect_live(&mut self, now: Instant) {
        let Some(dialer) = self.dialer.as_mut() else {
            return;
        };
        dialer.retry_at = None;
        match dialer.address.connect(SocketType::Sub) {
            Ok(mut conn) => {
                conn.codec.subscribe(&self.subscription.topic);
                match conn.flush() {
                    Ok(()) => self.conns.push(conn),
                    Err(_) => self.retry_later(now),
                }
            }
            Err(_) => self.retry_later(now),
        }
    }

    fn retry_later(&mut self, now: Instant) {
        if let Some(dialer) = self.dialer.as_mut() {
            dialer.failures = dialer.failures.saturating_add(1);
            dialer.retry_at = Some(now + Dialer::backoff(dialer.failures));
        }
    }

    /// Live connection `j` is closed: a protocol error resets the worker (its batches were
    /// lost with the framing); the dialer reconnects after its backoff.
    pub(super) fn live_closed(&mut self, j: usize, why: Closed, now: Instant) {
        self.conns.remove(j);
        if let Closed::Protocol(error) = why {
            let endpoint = self.subscription.endpoint.clone();
            self.sink
                .malformed(None, format!("{endpoint}: {error}; connection reset"));
        }
        if self.conns.is_empty() {
            self.retry_later(now);
        }
    }

    pub(super) fn poll_items<'a>(
        &'a self,
        i: usize,
        paused: bool,
        fds: &mut Vec<PollFd<'a>>,
        tokens: &mut Vec<Token>,
    ) {
        if let Some(listener) = &self.listener {
            fds.push(PollFd::new(&listener.socket, PollFlags::IN));
            tokens.push(Token::Listener(i));
        }
        if let Some(conn) = self.replay.as_ref().and_then(|r| r.conn.as_ref()) {
            fds.push(PollFd::new(&conn.socket, conn.interest(true)));
            tokens.push(Token::Replay(i));
        }
        // A handshake goes on during a replay (or a pause): only messages wait.
        let read = self.replay.is_none() && !paused;
        for (j, conn) in self.conns.iter().enumerate() {
            let flags = conn.interest(read || !conn.codec.is_ready());
            if !flags.is_empty() {
                fds.push(PollFd::new(&conn.socket, flags));
                tokens.push(Token::Live(i, j));
            }
        }
    }

    /// Nothing but live connections in traffic to read: no replay, no listener, no timer,
    /// no handshake or bytes to send (the gathering turn may read it without polling).
    pub(super) fn steady(&self) -> bool {
        self.replay.is_none()
            && self.listener.is_none()
            && !self.conns.is_empty()
            && self
                .conns
                .iter()
                .all(|c| c.connected && c.codec.is_ready() && c.codec.outgoing().is_empty())
    }

    /// When a timer of this stream runs out (a reconnect, a replay's retry or deadline).
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        let reconnect = self
            .dialer
            .as_ref()
            .filter(|_| self.conns.is_empty())
            .and_then(|d| d.retry_at);
        let replay = self.replay.as_ref().map(|r| match r.retry_at {
            Some(retry) if r.conn.is_none() => retry.min(r.deadline),
            _ => r.deadline,
        });
        reconnect.into_iter().chain(replay).min()
    }

    pub(super) fn on_timers(&mut self, now: Instant, actions: &mut Vec<Action>) {
        let reconnect = self
            .dialer
            .as_ref()
            .is_some_and(|d| d.retry_at.is_some_and(|t| t <= now));
        if reconnect && self.conns.is_empty() {
            self.connect_live(now);
        }
        let Some(replay) = self.replay.as_mut() else {
            return;
        };
        if replay.deadline <= now {
            let seconds = replay.timeout.as_secs_f64();
            let reason = format!(
                "no reply from replay endpoint {} within {seconds}s",
                replay.endpoint
            );
            self.finish_replay(actions, Some(reason), now);
        } else if replay.conn.is_none() && replay.retry_at.is_some_and(|t| t <= now) {
            replay.connect(now);
        }
    }

    pub(super) fn accept_all(&mut self) {
        let Some(listener) = &self.listener else {
            return;
        };
        while let Ok(Some(mut conn)) = listener.accept() {
            if self.conns.len() >= MAX_ACCEPTED {
                continue; // closed at once
            }
            conn.codec.subscribe(&self.subscription.topic);
            if conn.flush().is_ok() {
                self.conns.push(conn);
            }
        }
    }

    /// Live connection `j` is ready (`revents`): finish its connect, send what waits, take
    /// what it holds (`budget` bytes at most). True if it may hold more.
    pub(super) fn service_live(
        &mut self,
        j: usize,
        revents: PollFlags,
        budget: &mut usize,
        actions: &mut Vec<Action>,
    ) -> Result<bool, Closed> {
        if !self.conns[j].connected {
            if !revents.intersects(PollFlags::OUT | PollFlags::ERR | PollFlags::HUP) {
                return Ok(false);
            }
            self.conns[j].finish_connect()?;
        }
        self.conns[j].flush()?;
        if !revents.intersects(PollFlags::IN | PollFlags::ERR | PollFlags::HUP) {
            return Ok(false);
        }
        loop {
            if self.replay.is_some() && self.conns[j].codec.is_ready() {
                return Ok(false); // a gap: the live side waits for the replay's answer
            }
            let outcome = self.conns[j].read_once(budget)?;
            self.pump_live(j, actions)?;
            self.conns[j].flush()?; // PONGs
            match outcome {
                ReadOutcome::Drained => return Ok(false),
                ReadOutcome::Full if *budget == 0 => return Ok(true),
                ReadOutcome::Full => {}
            }
        }
    }

    /// Take the whole messages live connection `j` has buffered, until none is left or a gap
    /// starts a replay.
    fn pump_live(
        &mut self,
        j: usize,
        actions: &mut Vec<Action>,
    ) -> Result<(), ProtocolError> {
        loop {
            if self.replay.is_some() && self.conns[j].codec.is_ready() {
                return Ok(()); // the handshake's READY is taken, messages wait
            }
            let frames: Vec<Vec<u8>> = {
                let message = match self.conns[j].codec.next_event()? {
                    None => return Ok(()),
                    Some(Event::Ready { .. }) => {
                        if let Some(dialer) = self.dialer.as_mut() {
                            dialer.failures = 0;
                        }
                        // The subscription goes out with this turn's flush, ahead of the
                        // catch-up's request (whose connection has its handshake to do).
                        self.catch_up(Instant::now());
                        continue;
                    }
                    Some(Event::Message(message)) => message,
                };
                // A PUB filters by topic itself; this keeps a peer that does not from
                // feeding other topics in.
                if !message.frame(0).starts_with(&self.subscription.topic) {
                    continue;
                }
                // The fast path: the batch after the last one.
                if message.len() == 3
                    && let Some(seq) = sequence::parse_seq(message.frame(1))
                    && self.tracker.in_order(seq)
                {
                    self.sink.deliver(seq, message.frame(2), false);
                    continue;
                }
                message.frames().map(<[u8]>::to_vec).collect()
            };
            self.live_message(frames, actions);
        }
    }

    /// A live message off the fast path: what the tracker says of it.
    fn live_message(&mut self, mut frames: Vec<Vec<u8>>, actions: &mut Vec<Action>) {
        let payload = if frames.len() == 3 {
            let refs: [&[u8]; 3] = [&frames[0], &frames[1], &frames[2]];
            self.tracker.live_message(&refs, actions);
            frames.pop()
        } else {
            // Wrong framing (what the tracker says of it, without handing it every frame).
            actions.push(Action::MalformedFrames {
                frame_lengths: frames.iter().map(Vec::len).collect(),
            });
            None
        };
        self.follow(actions, payload.as_deref(), &[], Instant::now());
    }

    /// Take the live messages already buffered (after a replay ended); closes the
    /// connections whose bytes break the protocol.
    pub(super) fn pump_all(&mut self, actions: &mut Vec<Action>, now: Instant) {
        let mut j = 0;
        while j < self.conns.len() {
            match self.pump_live(j, actions) {
                Ok(()) => j += 1,
                Err(error) => self.live_closed(j, Closed::Protocol(error), now),
            }
        }
    }

    /// Do what the tracker said (`actions`, drained): hand batches over, report conditions,
    /// start the replay it asks for.
    fn follow(
        &mut self,
        actions: &mut Vec<Action>,
        live: Option<&[u8]>,
        replayed: &[(u64, Vec<u8>)],
        now: Instant,
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
            if let Err(reason) = self.start_replay(from, Purpose::Gap, now) {
                self.finish_replay_with(actions, Purpose::Gap, Vec::new(), Some(reason), now);
            }
        }
    }

    /// Ask the replay socket for every buffered batch from `from` on.
    fn start_replay(
        &mut self,
        from: u64,
        purpose: Purpose,
        now: Instant,
    ) -> Result<(), String> {
        let Some(endpoint) = &self.subscription.replay_endpoint else {
            return Err("no replay endpoint configured".into());
        };
        let address = Address::parse(endpoint, false)
            .map_err(|e| format!("replay endpoint {endpoint}: {e}"))?;
        let mut replay = Replay {
            endpoint: endpoint.clone(),
            address,
            from,
            conn: None,
            retry_at: None,
            purpose,
            received: Vec::new(),
            received_bytes: 0,
            timeout: self.subscription.replay_timeout,
            deadline: now + self.subscription.replay_timeout,
        };
        replay.connect(now);
        self.replay = Some(replay);
        Ok(())
    }

    pub(super) fn service_replay(
        &mut self,
        revents: PollFlags,
        actions: &mut Vec<Action>,
        now: Instant,
    ) {
        let Some(replay) = self.replay.as_mut() else {
            return;
        };
        match replay.service(revents, now) {
            Progress::Pending => {}
            Progress::Ended => self.finish_replay(actions, None, now),
            Progress::Failed(reason) => self.finish_replay(actions, Some(reason), now),
        }
    }

    fn finish_replay(
        &mut self,
        actions: &mut Vec<Action>,
        failure: Option<String>,
        now: Instant,
    ) {
        let replay = self.replay.take().expect("a replay is running");
        self.finish_replay_with(actions, replay.purpose, replay.received, failure, now);
    }

    /// The replay's answer to the tracker, and what it says to do.
    fn finish_replay_with(
        &mut self,
        actions: &mut Vec<Action>,
        purpose: Purpose,
        received: Vec<(u64, Vec<u8>)>,
        failure: Option<String>,
        now: Instant,
    ) {
        match purpose {
            // A failed catch-up leaves the rest to the live stream: what came is used.
            Purpose::CatchUp => self.tracker.catch_up_done(&received, actions),
            Purpose::Gap => self.tracker.replay_done(&received, failure, actions),
        }
        let held = self.held.take();
        self.follow(actions, held.as_deref(), &received, now);
        self.resume = true;
    }
}
