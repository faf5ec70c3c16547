//! The KV-event subscriber's sequence logic as a state machine (the h11 style): fed the live
//! socket's messages and the replay socket's answers, it says what to do, and never does I/O.
//!
//! vLLM numbers its batches per engine process from 0 (`seq`, 8 bytes big-endian). An index fed
//! by the stream must act on three conditions besides the batches themselves:
//!
//! * a **gap** (`seq > last + 1`): the SUB socket dropped messages (slow consumer, reconnect,
//!   late start). The tracker asks for a replay from the first missing seq
//!   ([`Action::Replay`]) and, given the answer ([`SequenceTracker::replay_done`]), delivers
//!   the missing batches in order, or reports [`Action::ReplayFailed`] when they are not all
//!   there: the index then drops that worker, since it missed stores or removals;
//! * a **restart** (`seq` going back, normally to 0): a new engine process with an empty cache
//!   ([`Action::Restarted`]);
//! * **duplicates**: a replay can run ahead of the live stream, so a live batch at a seq the
//!   replay already gave is skipped when it is the same bytes, and is a restart when not (an
//!   engine that restarted between a catch-up replay and its next batch).
//!
//! vLLM's protocol has no publisher identity, so a restarted engine whose first seen `seq` is
//! still above the old one's looks like a gap; nothing can tell those apart.
//!
//! Memory does not depend on the size of a jump: a gap from 1 to 2^64 − 1 is two numbers, and
//! checking that a replay covers it walks the replay's answer, never the range. The only
//! per-batch state is the digest of each replayed batch whose live copy may still come
//! (bounded by the engine's replay buffer), dropped as the live stream passes it.
//!
//! Decoding is not the tracker's business: delivered batches stay bytes, and a payload that
//! does not decode is the consumer's to report (`MalformedPayload`), with its seq.

use std::collections::VecDeque;

use xxhash_rust::xxh3::xxh3_64;

/// What the I/O layer must do next, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Hand over the live batch `seq` (the payload fed with it).
    Live { seq: u64 },
    /// Hand over the batch at `index` of the replay answer just given (its seq is `seq`).
    Replayed { seq: u64, index: usize },
    /// Live `got` arrived while `expected` was next; an [`Action::Replay`] follows.
    Gap { expected: u64, got: u64 },
    /// Ask the replay socket for every buffered batch from `from` on, then call
    /// [`SequenceTracker::replay_done`] with the answer. Nothing else may be fed meanwhile.
    Replay { from: u64 },
    /// Batches `expected..got` are lost for good; the consumer should drop the worker's state.
    /// The batches from `got` on follow as usual.
    ReplayFailed {
        expected: u64,
        got: u64,
        reason: String,
    },
    /// The sequence went back from `last_seq` to `new_seq`: a new engine process.
    Restarted { last_seq: Option<u64>, new_seq: u64 },
    /// A live message that is not `[topic, 8-byte seq, payload]`; nothing else changes.
    MalformedFrames { frame_lengths: Vec<usize> },
}

/// A gap waiting for its replay's answer.
#[derive(Clone, Copy, Debug)]
struct PendingGap {
    expected: u64,
    got: u64,
}

/// The sequence state of one engine's event stream (see the module docs).
#[derive(Clone, Debug, Default)]
pub struct SequenceTracker {
    /// The last seq handed over (batch or not), None before the first and after a restart.
    last: Option<u64>,
    /// The highest seq seen on the live socket.
    last_live: Option<u64>,
    /// `(seq, digest of the payload)` of replayed batches whose live copy may still come, in
    /// increasing seq order.
    replayed: VecDeque<(u64, u64)>,
    /// A gap whose replay has been asked for.
    pending: Option<PendingGap>,
}

/// The digest that tells a live batch from the replayed one at the same seq.
fn digest(payload: &[u8]) -> u64 {
    xxh3_64(payload)
}

/// The sequence number of a live or replayed message's 8-byte big-endian frame.
pub fn parse_seq(frame: &[u8]) -> Option<u64> {
    let bytes: [u8; 8] = frame.try_into().ok()?;
    Some(u64::from_be_bytes(bytes))
}

impl SequenceTracker {
    /// A tracker expecting batch 0 first.
    pub fn new() -> Self {
        Self::default()
    }

    /// The seq of the last batch handed over, None before the first.
    pub fn last_seq(&self) -> Option<u64> {
        self.last
    }

    /// True while a replay's answer is awaited.
    pub fn awaiting_replay(&self) -> bool {
        self.pending.is_some()
    }

    fn next_expected(&self) -> Option<u64> {
        match self.last {
            None => Some(0),
            Some(last) => last.checked_add(1),
        }
    }

    /// The fast path: if live `seq` simply follows the last batch, take it and return true
    /// (hand it over as live); otherwise change nothing and return false, and the message goes
    /// to [`SequenceTracker::live`].
    pub fn in_order(&mut self, seq: u64) -> bool {
        if self.pending.is_some()
            || self.next_expected() != Some(seq)
            || self.last_live.is_some_and(|live| seq <= live)
        {
            return false;
        }
        self.forget_replayed_through(seq);
        self.last_live = Some(seq);
        self.last = Some(seq);
        true
    }

    /// A live message as its frames; checks the framing, then as [`SequenceTracker::live`].
    pub fn live_message(&mut self, frames: &[&[u8]], out: &mut Vec<Action>) {
        match frames {
            [_, seq, payload] if seq.len() == 8 => {
                self.live(parse_seq(seq).unwrap_or_default(), payload, out)
            }
            _ => out.push(Action::MalformedFrames {
                frame_lengths: frames.iter().map(|f| f.len()).collect(),
            }),
        }
    }

    /// A live batch `seq` with its payload: append what to do to `out`.
    ///
    /// # Panics
    /// While a replay's answer is awaited (the I/O layer must call
    /// [`SequenceTracker::replay_done`] first).
    pub fn live(&mut self, seq: u64, payload: &[u8], out: &mut Vec<Action>) {
        assert!(self.pending.is_none(), "a replay's answer is awaited");
        let replayed_copy = self
            .replayed
            .binary_search_by_key(&seq, |&(s, _)| s)
            .ok()
            .map(|i| self.replayed[i].1);
        self.forget_replayed_through(seq);
        if self.last_live.is_some_and(|live| seq <= live) {
            self.restarted(seq, out);
        } else if self.last.is_some_and(|last| seq <= last) {
            if replayed_copy == Some(digest(payload)) {
                // Already handed over from a replay that ran ahead of the live stream.
                self.last_live = Some(seq);
                return;
            }
            // Not the batch the replay gave for this seq: a new engine counting from 0 again.
            self.restarted(seq, out);
        }
        self.last_live = Some(seq);
        let expected = self
            .next_expected()
            .expect("seq > last, so last < u64::MAX");
        if seq == expected {
            self.last = Some(seq);
            out.push(Action::Live { seq });
            return;
        }
        out.push(Action::Gap { expected, got: seq });
        out.push(Action::Replay { from: expected });
        self.pending = Some(PendingGap { expected, got: seq });
    }

    /// The replay's answer for the pending gap: `(seq, payload)` of every batch received, and
    /// why the replay stopped early, if it did. Appends the replayed batches, or the loss, then
    /// the live batch that showed the gap, then replayed batches newer than it.
    ///
    /// # Panics
    /// If no replay was asked for.
    pub fn replay_done<P: AsRef<[u8]>>(
        &mut self,
        replayed: &[(u64, P)],
        failure: Option<String>,
        out: &mut Vec<Action>,
    ) {
        let PendingGap { expected, got } = self.pending.take().expect("no replay was asked for");
        let missing = || replayed.iter().enumerate().filter(|(_, (s, _))| *s < got);
        let failure =
            failure.or_else(|| coverage_problem(missing().map(|(_, (s, _))| *s), expected, got));
        match failure {
            None => {
                for (index, (seq, payload)) in missing() {
                    self.deliver_replayed(*seq, index, payload.as_ref(), out);
                }
            }
            Some(reason) => out.push(Action::ReplayFailed {
                expected,
                got,
                reason,
            }),
        }
        self.last = Some(got);
        out.push(Action::Live { seq: got });
        // Batches newer than the live one that the replay already brought: now, in order;
        // their live copies will be skipped as duplicates.
        for (index, (seq, payload)) in replayed.iter().enumerate() {
            if self.next_expected() == Some(*seq) {
                self.deliver_replayed(*seq, index, payload.as_ref(), out);
            }
        }
    }

    /// The catch-up replay on subscribing (asked from 0 before any live batch): hand over
    /// its first run of consecutive batches, after a [`Action::ReplayFailed`] if that run
    /// does not start at 0 (the engine's buffer has wrapped). A hole, a failure or an empty
    /// answer leave the rest to the live stream, whose first gap asks again.
    pub fn catch_up_done<P: AsRef<[u8]>>(&mut self, replayed: &[(u64, P)], out: &mut Vec<Action>) {
        let Some((first, _)) = replayed.first() else {
            return;
        };
        let first = *first;
        if first != 0 {
            out.push(Action::ReplayFailed {
                expected: 0,
                got: first,
                reason: format!("replay buffer starts at {first}, not 0"),
            });
        }
        let mut next = Some(first);
        for (index, (seq, payload)) in replayed.iter().enumerate() {
            if next != Some(*seq) {
                break;
            }
            self.deliver_replayed(*seq, index, payload.as_ref(), out);
            next = seq.checked_add(1);
        }
    }

    fn deliver_replayed(&mut self, seq: u64, index: usize, payload: &[u8], out: &mut Vec<Action>) {
        self.last = Some(seq);
        self.replayed.push_back((seq, digest(payload)));
        out.push(Action::Replayed { seq, index });
    }

    fn restarted(&mut self, seq: u64, out: &mut Vec<Action>) {
        out.push(Action::Restarted {
            last_seq: self.last,
            new_seq: seq,
        });
        self.last = None;
        self.last_live = None;
        self.replayed.clear();
    }

    /// The live stream is at `seq`: replayed batches up to it will not come live again.
    fn forget_replayed_through(&mut self, seq: u64) {
        while self.replayed.front().is_some_and(|&(s, _)| s <= seq) {
            self.replayed.pop_front();
        }
    }
}

/// Why the replayed seqs (those below `got`, in the order received) do not fill
/// `expected..got` exactly, or None. Walks the seqs, never the range.
fn coverage_problem(seqs: impl Iterator<Item = u64>, expected: u64, got: u64) -> Option<String> {
    let mut next = expected;
    let mut first = None;
    for seq in seqs {
        first.get_or_insert(seq);
        if seq != next {
            return Some(if first == Some(seq) {
                // The ring buffer already dropped the oldest missing batches.
                format!("replay buffer starts at {seq}, not {expected}")
            } else {
                "replay skipped sequence numbers".to_string()
            });
        }
        next += 1; // < got <= u64::MAX
    }
    match (first, next == got) {
        (_, true) => None,
        (None, false) => Some("replay returned nothing older than the live batch".to_string()),
        (Some(_), false) => Some("replay skipped sequence numbers".to_string()),
    }
}

#[cfg(test)]
mod tests;
