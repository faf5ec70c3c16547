//! A replay in progress: the DEALER conversation with an engine's replay ROUTER that fills a
//! gap or catches up, bounded in messages, bytes and time.

use std::io;
use std::time::{Duration, Instant};

use kvroute_core::kvevents::sequence;
use rustix::event::PollFlags;

use super::sockets::{Address, BYTES_PER_TURN, Conn, ReadOutcome};
use crate::zmtp::{Event, Message, SocketType};

/// Batches one replay may bring (vLLM buffers 10,000 steps by default).
const MAX_REPLAYED: usize = 1_000_000;

/// Payload bytes one replay may bring.
const MAX_REPLAYED_BYTES: usize = 1 << 30;

/// Wait before a replay's next connection attempt (within its deadline).
const REPLAY_RETRY: Duration = Duration::from_millis(50);

/// The replay stream's end marker: seq −1 as a signed 8-byte big-endian integer.
pub(super) const END_SEQ: [u8; 8] = [0xff; 8];

/// Why a replay was asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Purpose {
    CatchUp,
    Gap,
}

/// A replay in progress: its DEALER connection (None between two connection attempts), what
/// it brought so far, and when it gives up.
pub(super) struct Replay {
    pub(super) endpoint: String,
    pub(super) address: Address,
    /// The first seq asked for.
    pub(super) from: u64,
    pub(super) conn: Option<Conn>,
    /// When to try connecting again (a refused or lost connection before any answer).
    pub(super) retry_at: Option<Instant>,
    pub(super) purpose: Purpose,
    pub(super) received: Vec<(u64, Vec<u8>)>,
    pub(super) received_bytes: usize,
    /// The longest wait for each message.
    pub(super) timeout: Duration,
    pub(super) deadline: Instant,
}

/// How a replay stands after its connection was serviced.
pub(super) enum Progress {
    Pending,
    Ended,
    Failed(String),
}

impl Replay {
    /// Connect (a fresh connection per request: a late answer to a timed-out request can never
    /// be taken for the next one's) and queue the request `[b"", from]`.
    pub(super) fn connect(&mut self, now: Instant) {
        self.retry_at = None;
        match self.address.connect(SocketType::Dealer) {
            Ok(mut conn) => {
                conn.codec.send_message(&[b"", &self.from.to_be_bytes()]);
                match conn.flush() {
                    Ok(()) => self.conn = Some(conn),
                    Err(_) => self.retry_at = Some(now + REPLAY_RETRY),
                }
            }
            Err(_) => self.retry_at = Some(now + REPLAY_RETRY),
        }
    }

    /// The connection went: try again if nothing came yet (the engine may be starting), else
    /// the replay failed.
    fn lost(&mut self, error: &io::Error, now: Instant) -> Progress {
        self.conn = None;
        if self.received.is_empty() {
            self.retry_at = Some(now + REPLAY_RETRY);
            Progress::Pending
        } else {
            Progress::Failed(format!("replay endpoint {}: {error}", self.endpoint))
        }
    }

    pub(super) fn service(&mut self, revents: PollFlags, now: Instant) -> Progress {
        let Some(conn) = self.conn.as_mut() else {
            return Progress::Pending;
        };
        if !conn.connected {
            if !revents.intersects(PollFlags::OUT | PollFlags::ERR | PollFlags::HUP) {
                return Progress::Pending;
            }
            if let Err(error) = conn.finish_connect() {
                return self.lost(&error, now);
            }
        }
        if let Err(error) = conn.flush() {
            return self.lost(&error, now);
        }
        if !revents.intersects(PollFlags::IN | PollFlags::ERR | PollFlags::HUP) {
            return Progress::Pending;
        }
        let mut budget = 4 * BYTES_PER_TURN;
        loop {
            let outcome = match conn.read_once(&mut budget) {
                Ok(outcome) => outcome,
                Err(error) => return self.lost(&error, now),
            };
            loop {
                let message = match conn.codec.next_event() {
                    Ok(None) => break,
                    Ok(Some(Event::Ready { .. })) => continue,
                    Ok(Some(Event::Message(message))) => message,
                    Err(error) => {
                        return Progress::Failed(format!(
                            "replay endpoint {}: {error}",
                            self.endpoint
                        ));
                    }
                };
                match take_reply(message) {
                    Ok(Some((seq, payload))) => {
                        self.received_bytes += payload.len();
                        self.received.push((seq, payload.to_vec()));
                        if self.received.len() > MAX_REPLAYED
                            || self.received_bytes > MAX_REPLAYED_BYTES
                        {
                            return Progress::Failed(format!(
                                "replay endpoint {}: more than {MAX_REPLAYED} batches or \
                                 {MAX_REPLAYED_BYTES} bytes",
                                self.endpoint
                            ));
                        }
                        self.deadline = now + self.timeout;
                    }
                    Ok(None) => return Progress::Ended,
                    Err(reason) => return Progress::Failed(reason),
                }
            }
            // What the greeting released (READY, the request), PONGs.
            if let Err(error) = conn.flush() {
                return self.lost(&error, now);
            }
            if matches!(outcome, ReadOutcome::Drained) || budget == 0 {
                return Progress::Pending;
            }
        }
    }
}

/// One replayed batch `(seq, payload)`, or None for the end marker. Current vLLM sends
/// `[b"", topic, seq, payload]`; before the topic frame was added, `[b"", seq, payload]`. The
/// end marker has seq −1 and an empty payload in both.
fn take_reply(message: Message<'_>) -> Result<Option<(u64, &[u8])>, String> {
    let n = message.len();
    if !(n == 3 || n == 4) || !message.frame(0).is_empty() || message.frame(n - 2).len() != 8 {
        return Err(format!("unexpected replay reply of {n} frames"));
    }
    if message.frame(n - 2) == END_SEQ {
        return Ok(None);
    }
    let seq = sequence::parse_seq(message.frame(n - 2)).expect("8 bytes");
    Ok(Some((seq, message.frame(n - 1))))
}
