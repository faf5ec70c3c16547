//! ZMTP 3.0 (RFC 23) with the NULL mechanism, as a pure state machine: bytes in, frames and
//! handshake events out, bytes to send queued, and no socket anywhere (the h11 style), so the
//! consumer's thread can own plain non-blocking TCP and Unix sockets and wake once per
//! gathering window instead of once per TCP segment, as libzmq's own I/O thread did.
//!
//! One [`Codec`] is one connection's protocol state. It starts by queueing this side's
//! greeting ([`Codec::outgoing`]); the caller writes those bytes, reads what the peer sends
//! into [`Codec::read_space`] ([`Codec::filled`]), takes [`Event`]s with [`Codec::next_event`]
//! until it returns None, and writes what got queued meanwhile. This side's READY (and
//! whatever the caller queued before) goes out only once the peer's greeting is in, as libzmq
//! itself does: libzmq 4.3.5 stalls for good when a peer's READY arrives in the same segment as
//! its greeting (measured against pyzmq's PUB: no subscription ever taken).
//!
//! * the peer's 64-byte greeting is checked as it arrives (signature, version ≥ 3, mechanism
//!   NULL), so an HTTP server or a CURVE peer is refused with a clear [`ProtocolError`];
//! * its READY command must name a socket type this side can talk to (a SUB talks to PUB and
//!   XPUB, a DEALER to ROUTER, DEALER and REP), as libzmq checks;
//! * then multipart messages ([`Event::Message`], frames borrowed from the receive buffer:
//!   no copy, no allocation per message), with PING answered by PONG (ZMTP 3.1 heartbeats,
//!   which a 3.1 peer may send) and ERROR turned into an error.
//!
//! Memory is bounded: a frame or message longer than the limit given to [`Codec::new`], or a
//! message of more than [`MAX_FRAMES`] frames, is an error before its bytes are buffered.
//! After an error the connection is useless (framing is lost); the caller drops it.
//!
//! This side announces ZMTP 3.0, so a 3.1 peer (libzmq ≥ 4.3) speaks 3.0 to it; a SUB's
//! subscription is then the 3.0 message `\x01topic` ([`Codec::subscribe`]), which every libzmq
//! 4.x PUB accepts (and 4.3's accepts from 3.1 peers too, beside the 3.1 SUBSCRIBE command).

use std::fmt;

/// The greeting's length in bytes (signature 10, version 2, mechanism 20, as-server 1,
/// filler 31).
pub const GREETING_LEN: usize = 64;
/// Frames one message may have; more is an error (vLLM's longest message has 4).
pub const MAX_FRAMES: usize = 16;
/// Bytes the receive buffer offers to one read at least.
const READ_CHUNK: usize = 64 * 1024;

/// Frame flag: more frames of this message follow.
const FLAG_MORE: u8 = 0x01;
/// Frame flag: the size is 8 bytes (big-endian), not 1.
const FLAG_LONG: u8 = 0x02;
/// Frame flag: a command, not a message frame.
const FLAG_COMMAND: u8 = 0x04;

/// A ZeroMQ socket type this crate speaks (the peers' types are named in their READY).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SocketType {
    /// Subscriber: the consumer's live side.
    Sub,
    /// Dealer: the consumer's replay requests to vLLM's ROUTER.
    Dealer,
    /// Publisher (tests stand in for an engine with it).
    Pub,
    /// Router (tests stand in for an engine's replay socket with it).
    Router,
}

impl SocketType {
    /// The name READY carries.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sub => "SUB",
            Self::Dealer => "DEALER",
            Self::Pub => "PUB",
            Self::Router => "ROUTER",
        }
    }

    /// The peer socket types this one may talk to (ZMTP's compatibility table, RFC 23).
    fn peers(self) -> &'static [&'static str] {
        match self {
            Self::Sub => &["PUB", "XPUB"],
            Self::Dealer => &["ROUTER", "DEALER", "REP"],
            Self::Pub => &["SUB", "XSUB"],
            Self::Router => &["DEALER", "REQ", "ROUTER"],
        }
    }
}

/// Why a connection's bytes cannot be followed any more.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProtocolError {
    /// The first bytes are not a ZMTP 3 signature (`0xFF`, 8 bytes, `0x7F`).
    NotZmtp,
    /// The peer speaks a ZMTP version before 3.0.
    Version {
        /// Its major version.
        major: u8,
        /// Its minor version.
        minor: u8,
    },
    /// The peer wants a security mechanism other than NULL (e.g. CURVE).
    Mechanism(String),
    /// The peer's READY names a socket type this side cannot talk to.
    SocketType {
        /// This side's type.
        ours: &'static str,
        /// The peer's, as it named it.
        theirs: String,
    },
    /// A malformed or unexpected command during the handshake.
    Handshake(String),
    /// A frame or message longer than the limit.
    TooLarge {
        /// Its size so far, in bytes.
        size: u64,
        /// The limit.
        limit: usize,
    },
    /// A message of more than [`MAX_FRAMES`] frames.
    TooManyFrames,
    /// The peer sent an ERROR command.
    Peer(String),
}

impl fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotZmtp => write!(f, "the peer is not a ZMTP 3 peer (bad greeting signature)"),
            Self::Version { major, minor } => {
                write!(
                    f,
                    "the peer speaks ZMTP {major}.{minor}; 3.0 or later is needed"
                )
            }
            Self::Mechanism(m) => write!(
                f,
                "the peer wants security mechanism {m:?}; only NULL is supported"
            ),
            Self::SocketType { ours, theirs } => {
                write!(
                    f,
                    "a {ours} socket cannot talk to the peer's {theirs:?} socket"
                )
            }
            Self::Handshake(what) => write!(f, "bad ZMTP handshake: {what}"),
            Self::TooLarge { size, limit } => {
                write!(f, "a message of {size} bytes or more (limit {limit})")
            }
            Self::TooManyFrames => write!(f, "a message of more than {MAX_FRAMES} frames"),
            Self::Peer(reason) => write!(f, "the peer reported an error: {reason}"),
        }
    }
}

impl std::error::Error for ProtocolError {}

/// What the peer's bytes said.
#[derive(Debug)]
pub enum Event<'a> {
    /// The handshake is done (the peer's READY arrived): messages follow.
    Ready {
        /// The peer's socket type.
        socket_type: &'a [u8],
    },
    /// One whole multipart message.
    Message(Message<'a>),
}

/// A multipart message, its frames borrowed from the codec's receive buffer.
#[derive(Debug, Clone, Copy)]
pub struct Message<'a> {
    buf: &'a [u8],
    parts: &'a [(usize, usize)],
}

impl<'a> Message<'a> {
    /// Its number of frames.
    pub fn len(&self) -> usize {
        self.parts.len()
    }

    /// True if it has no frames (never, for a message the codec returns).
    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// Frame `i`.
    pub fn frame(&self, i: usize) -> &'a [u8] {
        let (start, len) = self.parts[i];
        &self.buf[start..start + len]
    }

    /// Its frames in order.
    pub fn frames(&self) -> impl Iterator<Item = &'a [u8]> + '_ {
        (0..self.len()).map(|i| self.frame(i))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Waiting for (the rest of) the peer's greeting.
    Greeting,
    /// Waiting for the peer's READY.
    Handshake,
    /// Messages.
    Traffic,
}

/// One connection's ZMTP state (see the module docs).
pub struct Codec {
    ours: SocketType,
    max_message: usize,
    phase: Phase,
    /// Received bytes; unread ones are `buf[start..end]`.
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// Frames of the message being returned: (offset, length) in `buf`.
    parts: Vec<(usize, usize)>,
    /// Bytes to send, from `out_start` on.
    out: Vec<u8>,
    out_start: usize,
    /// What waits for the peer's greeting before it is sent (READY, early messages).
    after_greeting: Vec<u8>,
    /// The first error, repeated by every later call.
    failed: Option<ProtocolError>,
}

impl Codec {
    /// A connection of socket type `ours`, messages limited to `max_message` bytes; this
    /// side's greeting is queued at once, its READY (with an empty Identity for a DEALER or
    /// ROUTER, as libzmq sends) once the peer's greeting is in.
    pub fn new(ours: SocketType, max_message: usize) -> Self {
        let mut codec = Self {
            ours,
            max_message,
            phase: Phase::Greeting,
            buf: Vec::new(),
            start: 0,
            end: 0,
            parts: Vec::new(),
            out: Vec::with_capacity(128),
            out_start: 0,
            after_greeting: Vec::new(),
            failed: None,
        };
        codec.out.extend_from_slice(&greeting());
        let mut ready = Vec::with_capacity(48);
        ready.push(5);
        ready.extend_from_slice(b"READY");
        push_property(&mut ready, b"Socket-Type", ours.name().as_bytes());
        if matches!(ours, SocketType::Dealer | SocketType::Router) {
            push_property(&mut ready, b"Identity", b"");
        }
        codec.push_frame(FLAG_COMMAND, &ready);
        codec
    }

    /// Queue a SUB's subscription to messages whose first frame starts with `topic` (the
    /// ZMTP 3.0 form: a one-frame message `\x01topic`).
    pub fn subscribe(&mut self, topic: &[u8]) {
        let mut body = Vec::with_capacity(1 + topic.len());
        body.push(1);
        body.extend_from_slice(topic);
        self.push_frame(0, &body);
    }

    /// Queue a multipart message.
    pub fn send_message(&mut self, frames: &[&[u8]]) {
        for (i, frame) in frames.iter().enumerate() {
            let more = if i + 1 < frames.len() { FLAG_MORE } else { 0 };
            self.push_frame(more, frame);
        }
    }

    /// Queue an ERROR command (a peer that breaks the protocol is told why before the close).
    pub fn send_error(&mut self, reason: &str) {
        let reason = &reason.as_bytes()[..reason.len().min(255)];
        let mut body = Vec::with_capacity(7 + reason.len());
        body.push(5);
        body.extend_from_slice(b"ERROR");
        body.push(reason.len() as u8);
        body.extend_from_slice(reason);
        self.push_frame(FLAG_COMMAND, &body);
    }

    fn push_frame(&mut self, flags: u8, body: &[u8]) {
        let out = if self.phase == Phase::Greeting {
            &mut self.after_greeting
        } else {
            &mut self.out
        };
        if body.len() <= 255 {
            out.push(flags);
            out.push(body.len() as u8);
        } else {
            out.push(flags | FLAG_LONG);
            out.extend_from_slice(&(body.len() as u64).to_be_bytes());
        }
        out.extend_from_slice(body);
    }

    /// The bytes waiting to be sent (write them, then call [`Codec::sent`]).
    pub fn outgoing(&self) -> &[u8] {
        &self.out[self.out_start..]
    }

    /// `n` bytes of [`Codec::outgoing`] were written.
    pub fn sent(&mut self, n: usize) {
        self.out_start = self.out_start.saturating_add(n);
        if self.out_start >= self.out.len() {
            self.out.clear();
            self.out_start = 0;
        }
    }

    /// True once the peer's READY was taken.
    pub fn is_ready(&self) -> bool {
        self.phase == Phase::Traffic
    }

    /// Free space at the end of the receive buffer (at least 64 KiB) to read the peer's bytes
    /// into; say how many came with [`Codec::filled`].
    pub fn read_space(&mut self) -> &mut [u8] {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            if self.buf.len() > 4 * READ_CHUNK {
                // A big message passed: give the memory back.
                self.buf = Vec::new();
            }
        }
        if self.buf.len() - self.end < READ_CHUNK {
            if self.start > 0 {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            }
            if self.buf.len() - self.end < READ_CHUNK {
                let len = (self.end + READ_CHUNK).max(2 * self.buf.len());
                self.buf.resize(len, 0);
            }
        }
        &mut self.buf[self.end..]
    }

    /// `n` bytes were read into [`Codec::read_space`].
    pub fn filled(&mut self, n: usize) {
        self.end += n;
        debug_assert!(self.end <= self.buf.len());
    }

    /// Take `data` as received (a copy into the buffer; for tests and small inputs).
    pub fn receive(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            let space = self.read_space();
            let n = space.len().min(data.len());
            space[..n].copy_from_slice(&data[..n]);
            self.filled(n);
            data = &data[n..];
        }
    }

    /// The next thing the received bytes say, None if more bytes are needed first.
    pub fn next_event(&mut self) -> Result<Option<Event<'_>>, ProtocolError> {
        if let Some(error) = &self.failed {
            return Err(error.clone());
        }
        match self.step() {
            Ok(Some(Step::Ready(start, len))) => Ok(Some(Event::Ready {
                socket_type: &self.buf[start..start + len],
            })),
            Ok(Some(Step::Message)) => Ok(Some(Event::Message(Message {
                buf: &self.buf,
                parts: &self.parts,
            }))),
            Ok(None) => Ok(None),
            Err(error) => {
                self.failed = Some(error.clone());
                Err(error)
            }
        }
    }

    fn step(&mut self) -> Result<Option<Step>, ProtocolError> {
        loop {
            match self.phase {
                Phase::Greeting => {
                    if !self.take_greeting()? {
                        return Ok(None);
                    }
                }
                Phase::Handshake | Phase::Traffic => {
                    let Some(frames) = self.scan_message()? else {
                        return Ok(None);
                    };
                    match frames {
                        Scanned::Command { start, len, end } => {
                            self.start = end;
                            if let Some(step) = self.command(start, len)? {
                                return Ok(Some(step));
                            }
                        }
                        Scanned::Message { end } => {
                            if self.phase == Phase::Handshake {
                                return Err(ProtocolError::Handshake(
                                    "a message before the peer's READY".into(),
                                ));
                            }
                            self.start = end;
                            return Ok(Some(Step::Message));
                        }
                    }
                }
            }
        }
    }

    /// Check what arrived of the peer's greeting; true once all of it was taken.
    fn take_greeting(&mut self) -> Result<bool, ProtocolError> {
        let got = &self.buf[self.start..self.end];
        if !got.is_empty() && got[0] != 0xff {
            return Err(ProtocolError::NotZmtp);
        }
        // libzmq's test: the last signature byte's low bit tells a versioned (ZMTP ≥ 2) peer.
        if got.len() >= 10 && got[9] & 1 == 0 {
            return Err(ProtocolError::NotZmtp);
        }
        if got.len() >= 12 && got[10] < 3 {
            return Err(ProtocolError::Version {
                major: got[10],
                minor: got[11],
            });
        }
        if got.len() < GREETING_LEN {
            return Ok(false);
        }
        let mechanism = &got[12..32];
        let name_len = mechanism.iter().position(|&b| b == 0).unwrap_or(20);
        if &mechanism[..name_len] != b"NULL" || mechanism[name_len..].iter().any(|&b| b != 0) {
            let name = String::from_utf8_lossy(&mechanism[..name_len]).into_owned();
            return Err(ProtocolError::Mechanism(name));
        }
        self.start += GREETING_LEN;
        self.phase = Phase::Handshake;
        let after = std::mem::take(&mut self.after_greeting);
        self.out.extend_from_slice(&after);
        Ok(true)
    }

    /// Find the next whole command or message in the buffer, recording a message's frames in
    /// `parts`; None if it has not all arrived.
    fn scan_message(&mut self) -> Result<Option<Scanned>, ProtocolError> {
        self.parts.clear();
        let mut pos = self.start;
        let mut total: u64 = 0;
        loop {
            let got = &self.buf[pos..self.end];
            let Some(&flags) = got.first() else {
                return Ok(None);
            };
            let (size, header) = if flags & FLAG_LONG != 0 {
                if got.len() < 9 {
                    return Ok(None);
                }
                let size = u64::from_be_bytes(got[1..9].try_into().expect("8 bytes"));
                (size, 9)
            } else {
                if got.len() < 2 {
                    return Ok(None);
                }
                (u64::from(got[1]), 2)
            };
            total = total.saturating_add(size);
            if total > self.max_message as u64 {
                return Err(ProtocolError::TooLarge {
                    size: total,
                    limit: self.max_message,
                });
            }
            let size = size as usize; // ≤ max_message
            if got.len() < header + size {
                return Ok(None);
            }
            let body = pos + header;
            let end = body + size;
            if flags & FLAG_COMMAND != 0 {
                if !self.parts.is_empty() || flags & FLAG_MORE != 0 {
                    return Err(ProtocolError::Handshake(
                        "a command inside a multipart message".into(),
                    ));
                }
                return Ok(Some(Scanned::Command {
                    start: body,
                    len: size,
                    end,
                }));
            }
            if self.parts.len() == MAX_FRAMES {
                return Err(ProtocolError::TooManyFrames);
            }
            self.parts.push((body, size));
            pos = end;
            if flags & FLAG_MORE == 0 {
                return Ok(Some(Scanned::Message { end }));
            }
        }
    }

    /// Act on the command in `buf[start..start + len]`.
    fn command(&mut self, start: usize, len: usize) -> Result<Option<Step>, ProtocolError> {
        let body = &self.buf[start..start + len];
        let bad = |what: &str| ProtocolError::Handshake(what.to_string());
        let name_len = *body.first().ok_or_else(|| bad("an empty command"))? as usize;
        if body.len() < 1 + name_len {
            return Err(bad("a truncated command name"));
        }
        let name = &body[1..1 + name_len];
        let data = &body[1 + name_len..];
        let data_start = start + 1 + name_len;
        if name.eq_ignore_ascii_case(b"ERROR") {
            let reason = data
                .split_first()
                .map(|(&n, rest)| &rest[..(n as usize).min(rest.len())])
                .unwrap_or_default();
            return Err(ProtocolError::Peer(
                String::from_utf8_lossy(reason).into_owned(),
            ));
        }
        match self.phase {
            Phase::Handshake => {
                if !name.eq_ignore_ascii_case(b"READY") {
                    return Err(ProtocolError::Handshake(format!(
                        "expected READY, got {:?}",
                        String::from_utf8_lossy(name)
                    )));
                }
                let (type_start, type_len) =
                    socket_type_property(data).ok_or_else(|| bad("READY without a Socket-Type"))?;
                let theirs = &data[type_start..type_start + type_len];
                let compatible = self
                    .ours
                    .peers()
                    .iter()
                    .any(|p| p.as_bytes().eq_ignore_ascii_case(theirs));
                if !compatible {
                    return Err(ProtocolError::SocketType {
                        ours: self.ours.name(),
                        theirs: String::from_utf8_lossy(theirs).into_owned(),
                    });
                }
                self.phase = Phase::Traffic;
                Ok(Some(Step::Ready(data_start + type_start, type_len)))
            }
            Phase::Traffic => {
                if name.eq_ignore_ascii_case(b"PING") {
                    // PING: TTL (2 bytes), then a context the PONG echoes (≤ 16 bytes).
                    let context = data.get(2..).unwrap_or_default();
                    let context = context[..context.len().min(16)].to_vec();
                    let mut pong = Vec::with_capacity(5 + context.len());
                    pong.push(4);
                    pong.extend_from_slice(b"PONG");
                    pong.extend_from_slice(&context);
                    self.push_frame(FLAG_COMMAND, &pong);
                }
                // PONG, SUBSCRIBE/CANCEL (a PUB's business, not ours) and unknown commands:
                // nothing to do.
                Ok(None)
            }
            Phase::Greeting => unreachable!("commands come after the greeting"),
        }
    }
}

enum Step {
    /// The peer's READY; its Socket-Type value at (offset, length) in `buf`.
    Ready(usize, usize),
    /// A message, its frames in `parts`.
    Message,
}

enum Scanned {
    Command {
        start: usize,
        len: usize,
        end: usize,
    },
    Message {
        end: usize,
    },
}

/// This side's greeting: ZMTP 3.0, NULL, not as-server. The signature's padding is libzmq's
/// (an empty routing id's length + 1, for ZMTP 1.0 peers' sake).
fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xff;
    g[8] = 1;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

fn push_property(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(name.len() as u8);
    out.extend_from_slice(name);
    out.extend_from_slice(&(value.len() as u32).to_be_bytes());
    out.extend_from_slice(value);
}

/// The Socket-Type value's (offset, length) in READY's property list, None if absent or if
/// the list is malformed.
fn socket_type_property(mut data: &[u8]) -> Option<(usize, usize)> {
    let mut offset = 0;
    let mut found = None;
    while !data.is_empty() {
        let name_len = data[0] as usize;
        let name = data.get(1..1 + name_len)?;
        let value_len =
            u32::from_be_bytes(data.get(1 + name_len..5 + name_len)?.try_into().ok()?) as usize;
        let value_start = 5 + name_len;
        data.get(value_start..value_start + value_len)?;
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            found = Some((offset + value_start, value_len));
        }
        let consumed = value_start + value_len;
        data = &data[consumed..];
        offset += consumed;
    }
    found
}

#[cfg(test)]
mod tests;
