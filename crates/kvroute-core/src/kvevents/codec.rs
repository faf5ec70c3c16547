//! vLLM's KV-event payloads, byte for byte: msgpack in, [`KvCacheEvent`]s out, and back.
//!
//! One published message is the ZeroMQ multipart `[topic, seq, payload]`; `payload` is the
//! msgpack encoding of vLLM's `EventBatch` (msgspec Structs in
//! `vllm/distributed/kv_events.py`). Two event shapes exist in the wild:
//!
//! * **map** (current vLLM): the batch is `[ts, events, data_parallel_rank]` and every event a
//!   map tagged by `"type"`, its defaulted `None` fields (`extra_keys`, `kv_cache_spec_kind`,
//!   the sliding window, locality, ownership, session id) left out;
//! * **array** (older vLLM, `array_like=True` events): every event a positional array with the
//!   tag first, every declared field written (trailing `None`s included).
//!
//! [`decode_batch`] accepts both, even mixed in one batch, plus a batch encoded as a map. It
//! ignores fields it does not know and trailing array items (newer vLLMs append some), takes
//! the oldest events' missing trailing fields as absent, reads block hashes sent as bytes
//! (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`) as the low 64 bits of the big-endian digest, as
//! vLLM's `maybe_convert_block_hash` does, and counts events of an unknown type instead of
//! failing, so a router keeps working across vLLM upgrades.
//!
//! Decoding walks the bytes once with `rmp`'s decoders, straight into the event types,
//! without a generic value tree (`rmpv`'s): it runs for every batch a router receives. Values it does not interpret (unknown
//! fields, unknown events, `extra_keys` entries) are skipped without recursion, and nesting
//! deeper than [`MAX_NESTING`] is a [`DecodeError`], so a hostile payload costs neither the
//! stack nor more memory than its own size.
//!
//! [`encode_batch`] writes, with `rmp`'s encoders, the bytes vLLM's msgspec encoder writes for the same batch, in
//! either shape (the emulator's publisher speaks both); `tests/data/golden/kvevents_payloads.json`
//! holds payloads recorded from that encoder, and the tests compare them byte for byte.

use std::fmt;

use rmp::Marker;
use rmp::decode::bytes::BytesReadError;
use rmp::decode::{self, Bytes, NumValueReadError, ValueReadError};
use rmp::encode;

use crate::kvevents::events::{BlockRemoved, BlockStored, EventBatch, ExtraKey, KvCacheEvent};

/// The deepest msgpack nesting a payload may have (the batch is level 1, its event list 2, an
/// event 3, an `extra_keys` entry 5). vLLM's payloads never pass 7; anything deeper is
/// malformed rather than something to recurse into.
pub const MAX_NESTING: usize = 32;

/// The two shapes vLLM has published events in (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WireFormat {
    /// Current vLLM: events are maps tagged by `"type"`.
    Map,
    /// Older vLLM: events are positional arrays, tag first.
    Array,
}

impl WireFormat {
    /// The names the CLI and configs use: `"map"` and `"array"`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "map" => Some(Self::Map),
            "array" => Some(Self::Array),
            _ => None,
        }
    }
}

/// One decoded payload.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DecodedBatch {
    /// The engine step's time, seconds (vLLM's `time.time()`).
    pub ts: f64,
    /// The events of known types, in order.
    pub events: Vec<KvCacheEvent>,
    /// The engine's data-parallel rank, None without data parallelism.
    pub data_parallel_rank: Option<i64>,
    /// Events whose type tag this decoder does not know (a newer vLLM), skipped; the other
    /// events of the batch are kept.
    pub unknown_events: usize,
}

/// Why a payload is not a vLLM event batch (bad msgpack, a wrong envelope, or a known event
/// with missing or mistyped fields). An unknown event type is not an error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DecodeError {}

type Result<T> = std::result::Result<T, DecodeError>;

fn err<T>(message: impl Into<String>) -> Result<T> {
    Err(DecodeError(message.into()))
}

/// A cursor over a payload, read with `rmp`'s decoders: every read checks the bounds, and a
/// read of one kind of value meeting another consumes nothing (the caller tries the next
/// kind, as msgspec accepts several for some fields).
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// What an `rmp` decoder reading a payload slice fails with.
type ReadError = ValueReadError<BytesReadError>;

fn end_of_data<T>() -> Result<T> {
    err("unexpected end of data")
}

impl<'a> Reader<'a> {
    /// The bytes not read yet.
    #[inline]
    fn rest(&self) -> &'a [u8] {
        &self.buf[self.pos..]
    }

    /// The bytes not read yet, for an `rmp` decoder.
    #[inline]
    fn bytes(&self) -> Bytes<'a> {
        Bytes::new(self.rest())
    }

    /// Continue after what a decoder left of [`Reader::bytes`].
    #[inline]
    fn resume(&mut self, rest: Bytes<'a>) {
        self.pos = self.buf.len() - rest.remaining_slice().len();
    }

    /// The next value's marker, not consumed.
    #[inline]
    fn marker(&self) -> Result<Marker> {
        match self.buf.get(self.pos) {
            Some(&b) => Ok(Marker::from_u8(b)),
            None => end_of_data(),
        }
    }

    /// `read` (an `rmp` decoder) on the rest: its value, or None (nothing consumed) if the
    /// next value is of another kind.
    #[inline]
    fn read<T>(
        &mut self,
        read: impl FnOnce(&mut Bytes<'a>) -> std::result::Result<T, ReadError>,
    ) -> Result<Option<T>> {
        let mut rest = self.bytes();
        match read(&mut rest) {
            Ok(v) => {
                self.resume(rest);
                Ok(Some(v))
            }
            Err(ValueReadError::TypeMismatch(_)) => Ok(None),
            Err(_) => end_of_data(),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let bytes = &self.buf[self.pos..end];
                self.pos = end;
                Ok(bytes)
            }
            None => end_of_data(),
        }
    }

    /// A big-endian length of `n` bytes (after an `rmp` marker).
    fn be(&mut self, n: usize) -> Result<u64> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    /// The length of an array, or None (nothing consumed) if the next value is not one.
    fn array_len(&mut self) -> Result<Option<usize>> {
        Ok(self.read(decode::read_array_len)?.map(|n| n as usize))
    }

    /// The number of pairs of a map, or None (nothing consumed) if the next value is not one.
    fn map_len(&mut self) -> Result<Option<usize>> {
        Ok(self.read(decode::read_map_len)?.map(|n| n as usize))
    }

    /// A string's raw bytes, or None (nothing consumed) if the next value is not a string.
    fn str_bytes(&mut self) -> Result<Option<&'a [u8]>> {
        match self.read(decode::read_str_len)? {
            Some(len) => self.take(len as usize).map(Some),
            None => Ok(None),
        }
    }

    /// A UTF-8 string, or None (nothing consumed) if the next value is not a string.
    fn str(&mut self) -> Result<Option<&'a str>> {
        match self.str_bytes()? {
            Some(bytes) => match std::str::from_utf8(bytes) {
                Ok(s) => Ok(Some(s)),
                Err(_) => err("invalid UTF-8 in a string"),
            },
            None => Ok(None),
        }
    }

    /// A binary value, or None (nothing consumed) if the next value is not one.
    fn bin(&mut self) -> Result<Option<&'a [u8]>> {
        match self.read(decode::read_bin_len)? {
            Some(len) => self.take(len as usize).map(Some),
            None => Ok(None),
        }
    }

    /// An integer (any msgpack width; `i128` holds them all), or None (nothing consumed) if
    /// the next value is not one. Booleans are not integers, as for msgspec.
    fn int(&mut self) -> Result<Option<i128>> {
        let mut rest = self.bytes();
        match decode::read_int::<i128, _>(&mut rest) {
            Ok(v) => {
                self.resume(rest);
                Ok(Some(v))
            }
            Err(NumValueReadError::TypeMismatch(_)) => Ok(None),
            Err(_) => end_of_data(),
        }
    }

    /// True (and consumed) if the next value is nil.
    fn nil(&mut self) -> Result<bool> {
        if self.marker()? == Marker::Null {
            self.pos += 1;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    /// Skip one value of any kind, `depth` being the nesting level it sits at. No recursion:
    /// a stack of the items left per open container, bounded by [`MAX_NESTING`].
    fn skip(&mut self, depth: usize) -> Result<()> {
        let mut open: Vec<u64> = Vec::new();
        let mut left_here: u64 = 1;
        loop {
            while left_here == 0 {
                match open.pop() {
                    Some(outer) => left_here = outer,
                    None => return Ok(()),
                }
            }
            left_here -= 1;
            let marker = self.marker()?;
            self.pos += 1;
            // Bytes after the marker: a length of `header` bytes, then that many and `extra`.
            let (header, extra): (usize, usize) = match marker {
                Marker::FixPos(_)
                | Marker::FixNeg(_)
                | Marker::Null
                | Marker::True
                | Marker::False => (0, 0),
                Marker::FixMap(n) => {
                    self.open(depth, &mut open, &mut left_here, 2 * u64::from(n))?;
                    continue;
                }
                Marker::FixArray(n) => {
                    self.open(depth, &mut open, &mut left_here, u64::from(n))?;
                    continue;
                }
                Marker::Array16 | Marker::Array32 | Marker::Map16 | Marker::Map32 => {
                    let wide = matches!(marker, Marker::Array32 | Marker::Map32);
                    let n = self.be(if wide { 4 } else { 2 })?;
                    let pairs = matches!(marker, Marker::Map16 | Marker::Map32);
                    self.open(
                        depth,
                        &mut open,
                        &mut left_here,
                        if pairs { 2 * n } else { n },
                    )?;
                    continue;
                }
                Marker::FixStr(n) => {
                    self.take(usize::from(n))?;
                    (0, 0)
                }
                Marker::Str8 | Marker::Bin8 => (1, 0),
                Marker::Str16 | Marker::Bin16 => (2, 0),
                Marker::Str32 | Marker::Bin32 => (4, 0),
                Marker::Ext8 => (1, 1),
                Marker::Ext16 => (2, 1),
                Marker::Ext32 => (4, 1),
                Marker::U8 | Marker::I8 => (0, 1),
                Marker::U16 | Marker::I16 | Marker::FixExt1 => (0, 2),
                Marker::FixExt2 => (0, 3),
                Marker::U32 | Marker::I32 | Marker::F32 => (0, 4),
                Marker::FixExt4 => (0, 5),
                Marker::U64 | Marker::I64 | Marker::F64 => (0, 8),
                Marker::FixExt8 => (0, 9),
                Marker::FixExt16 => (0, 17),
                Marker::Reserved => return err("reserved msgpack byte 0xc1"),
            };
            let len = if header > 0 {
                self.be(header)? as usize
            } else {
                0
            };
            self.take(len.saturating_add(extra))?;
        }
    }

    /// Enter a container of `children` items while skipping (see [`Reader::skip`]).
    fn open(
        &self,
        depth: usize,
        open: &mut Vec<u64>,
        left_here: &mut u64,
        children: u64,
    ) -> Result<()> {
        if children == 0 {
            return Ok(());
        }
        if depth + open.len() + 1 >= MAX_NESTING {
            return err(format!("msgpack nested deeper than {MAX_NESTING} levels"));
        }
        open.push(*left_here);
        *left_here = children;
        Ok(())
    }

    /// The next value's raw bytes, skipped (see [`Reader::skip`]).
    fn raw(&mut self, depth: usize) -> Result<&'a [u8]> {
        let start = self.pos;
        self.skip(depth)?;
        Ok(&self.buf[start..self.pos])
    }
}

/// What a field must be, for error messages.
fn expected(field: &str, what: &str) -> DecodeError {
    DecodeError(format!("{field}: expected {what}"))
}

fn read_f64(r: &mut Reader<'_>, field: &str) -> Result<f64> {
    let float = match r.marker()? {
        Marker::F64 => r.read(decode::read_f64)?,
        Marker::F32 => r.read(decode::read_f32)?.map(f64::from),
        // msgspec takes an integer for a float field.
        _ => r.int()?.map(|v| v as f64),
    };
    float.ok_or_else(|| expected(field, "a number"))
}

fn read_i64(r: &mut Reader<'_>, field: &str) -> Result<i64> {
    match r.int()? {
        Some(v) => i64::try_from(v).map_err(|_| expected(field, "an int64")),
        None => Err(expected(field, "an int")),
    }
}

fn read_opt_i64(r: &mut Reader<'_>, field: &str) -> Result<Option<i64>> {
    if r.nil()? {
        return Ok(None);
    }
    read_i64(r, field).map(Some)
}

fn read_opt_string(r: &mut Reader<'_>, field: &str) -> Result<Option<String>> {
    if r.nil()? {
        return Ok(None);
    }
    match r.str()? {
        Some(s) => Ok(Some(s.to_owned())),
        None => Err(expected(field, "a str or null")),
    }
}

/// A block hash sent as an int (vLLM's default; a negative one is taken modulo 2^64) or as
/// its digest's bytes (the low 64 bits of the big-endian number, as vLLM converts them).
fn read_hash(r: &mut Reader<'_>, field: &str) -> Result<u64> {
    if let Some(v) = r.int()? {
        return Ok(v as u64);
    }
    match r.bin()? {
        Some(bytes) => {
            let tail = &bytes[bytes.len().saturating_sub(8)..];
            Ok(tail.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
        }
        None => Err(expected(field, "an int or bytes hash")),
    }
}

fn read_opt_hash(r: &mut Reader<'_>, field: &str) -> Result<Option<u64>> {
    if r.nil()? {
        return Ok(None);
    }
    read_hash(r, field).map(Some)
}

/// A length from the wire, capped by the bytes left so a forged header cannot make a big
/// allocation (every item takes at least one byte).
fn capacity(r: &Reader<'_>, len: usize) -> usize {
    len.min(r.buf.len() - r.pos)
}

fn read_hashes(r: &mut Reader<'_>, field: &str) -> Result<Vec<u64>> {
    let Some(len) = r.array_len()? else {
        return Err(expected(field, "an array"));
    };
    let mut out = Vec::with_capacity(capacity(r, len));
    for _ in 0..len {
        out.push(read_hash(r, field)?);
    }
    Ok(out)
}

/// Token ids; an id above `i64::MAX` (msgspec accepts up to 2^64 - 1) is kept as `i64::MAX`,
/// which the index skips like every id that is not a `u32`.
fn read_token_ids(r: &mut Reader<'_>) -> Result<Vec<i64>> {
    let Some(len) = r.array_len()? else {
        return Err(expected("token_ids", "an array"));
    };
    let mut out = Vec::with_capacity(capacity(r, len));
    let mut rest = r.bytes();
    for _ in 0..len {
        out.push(match decode::read_int::<i64, _>(&mut rest) {
            Ok(id) => id,
            Err(NumValueReadError::OutOfRange) => i64::MAX,
            Err(NumValueReadError::TypeMismatch(_)) => return Err(expected("token_ids", "ints")),
            Err(_) => return end_of_data(),
        });
    }
    r.resume(rest);
    Ok(out)
}

fn read_block_size(r: &mut Reader<'_>) -> Result<usize> {
    match r.int()? {
        Some(v) => usize::try_from(v).map_err(|_| expected("block_size", "a non-negative int")),
        None => Err(expected("block_size", "an int")),
    }
}

/// `extra_keys`: null, or one entry per block, each null or an opaque msgpack value (vLLM
/// sends tuples) kept as its bytes.
fn read_extra_keys(r: &mut Reader<'_>, depth: usize) -> Result<Option<Vec<ExtraKey>>> {
    if r.nil()? {
        return Ok(None);
    }
    let Some(len) = r.array_len()? else {
        return Err(expected("extra_keys", "an array or null"));
    };
    let mut out = Vec::with_capacity(capacity(r, len));
    for _ in 0..len {
        if r.nil()? {
            out.push(None);
        } else {
            out.push(Some(r.raw(depth + 1)?.to_vec()));
        }
    }
    Ok(Some(out))
}

fn read_group(r: &mut Reader<'_>) -> Result<i64> {
    // An absent group means vLLM's single KV cache group, which kvroute numbers 0.
    Ok(read_opt_i64(r, "group_idx")?.unwrap_or(0))
}

/// The fields of a BlockStored as they are read, in vLLM's declaration order.
#[derive(Default)]
struct StoredFields {
    block_hashes: Option<Vec<u64>>,
    parent_block_hash: Option<Option<u64>>,
    token_ids: Option<Vec<i64>>,
    block_size: Option<usize>,
    lora_id: Option<i64>,
    medium: Option<String>,
    lora_name: Option<String>,
    extra_keys: Option<Vec<ExtraKey>>,
    group_idx: i64,
    kv_cache_spec_kind: Option<String>,
}

/// BlockStored's fields in wire order; the first four are required.
const STORED_FIELDS: [&str; 10] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
];
const STORED_REQUIRED: usize = 4;

impl StoredFields {
    /// Read field `index` of [`STORED_FIELDS`] (a valid index).
    fn read(&mut self, index: usize, r: &mut Reader<'_>, depth: usize) -> Result<()> {
        match index {
            0 => self.block_hashes = Some(read_hashes(r, "block_hashes")?),
            1 => self.parent_block_hash = Some(read_opt_hash(r, "parent_block_hash")?),
            2 => self.token_ids = Some(read_token_ids(r)?),
            3 => self.block_size = Some(read_block_size(r)?),
            4 => self.lora_id = read_opt_i64(r, "lora_id")?,
            5 => self.medium = read_opt_string(r, "medium")?,
            6 => self.lora_name = read_opt_string(r, "lora_name")?,
            7 => self.extra_keys = read_extra_keys(r, depth)?,
            8 => self.group_idx = read_group(r)?,
            _ => self.kv_cache_spec_kind = read_opt_string(r, "kv_cache_spec_kind")?,
        }
        Ok(())
    }

    fn finish(self) -> Result<BlockStored> {
        let missing = |name: &str| DecodeError(format!("missing required field {name}"));
        Ok(BlockStored {
            block_hashes: self.block_hashes.ok_or_else(|| missing("block_hashes"))?,
            parent_block_hash: self
                .parent_block_hash
                .ok_or_else(|| missing("parent_block_hash"))?,
            token_ids: self.token_ids.ok_or_else(|| missing("token_ids"))?,
            block_size: self.block_size.ok_or_else(|| missing("block_size"))?,
            lora_id: self.lora_id,
            medium: self.medium,
            lora_name: self.lora_name,
            extra_keys: self.extra_keys,
            group_idx: self.group_idx,
            kv_cache_spec_kind: self.kv_cache_spec_kind,
        })
    }
}

/// BlockRemoved's fields in wire order; the first is required.
const REMOVED_FIELDS: [&str; 3] = ["block_hashes", "medium", "group_idx"];

#[derive(Default)]
struct RemovedFields {
    block_hashes: Option<Vec<u64>>,
    medium: Option<String>,
    group_idx: i64,
}

impl RemovedFields {
    fn read(&mut self, index: usize, r: &mut Reader<'_>) -> Result<()> {
        match index {
            0 => self.block_hashes = Some(read_hashes(r, "block_hashes")?),
            1 => self.medium = read_opt_string(r, "medium")?,
            _ => self.group_idx = read_group(r)?,
        }
        Ok(())
    }

    fn finish(self) -> Result<BlockRemoved> {
        Ok(BlockRemoved {
            block_hashes: self
                .block_hashes
                .ok_or_else(|| DecodeError("missing required field block_hashes".into()))?,
            medium: self.medium,
            group_idx: self.group_idx,
        })
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Tag {
    Stored,
    Removed,
    Cleared,
}

fn known_tag(tag: &[u8]) -> Option<Tag> {
    match tag {
        b"BlockStored" => Some(Tag::Stored),
        b"BlockRemoved" => Some(Tag::Removed),
        b"AllBlocksCleared" => Some(Tag::Cleared),
        _ => None,
    }
}

/// A type tag's bytes: a known one as is (ASCII), any other checked to be UTF-8 (a tag that
/// is not text is a malformed payload, as for msgspec).
fn tag_of(tag: &[u8]) -> Result<Option<Tag>> {
    match known_tag(tag) {
        Some(tag) => Ok(Some(tag)),
        None => match std::str::from_utf8(tag) {
            Ok(_) => Ok(None),
            Err(_) => err("invalid UTF-8 in a string"),
        },
    }
}

/// Depth of an event's own fields (batch 1, event list 2, event 3).
const FIELD_DEPTH: usize = 4;

/// A positional event of `len` items (tag first); None for an unknown type.
fn array_event(r: &mut Reader<'_>, len: usize) -> Result<Option<KvCacheEvent>> {
    let skip_rest = |r: &mut Reader<'_>, n: usize| -> Result<()> {
        for _ in 0..n {
            r.skip(FIELD_DEPTH)?;
        }
        Ok(())
    };
    if len == 0 {
        return Ok(None);
    }
    let (tag, rest) = match r.str_bytes()? {
        Some(tag) => (tag_of(tag)?, len - 1),
        None => (None, len), // a tag that is not a string: skip it too
    };
    let Some(tag) = tag else {
        // A tag we have never heard of (or none): a newer vLLM's event type.
        skip_rest(r, rest)?;
        return Ok(None);
    };
    let values = len - 1;
    let event = match tag {
        Tag::Stored => {
            if values < STORED_REQUIRED {
                return err(format!(
                    "{values} fields, at least {STORED_REQUIRED} required"
                ));
            }
            let mut fields = StoredFields::default();
            let known = values.min(STORED_FIELDS.len());
            for index in 0..known {
                fields.read(index, r, FIELD_DEPTH)?;
            }
            skip_rest(r, values - known)?;
            KvCacheEvent::Stored(fields.finish()?)
        }
        Tag::Removed => {
            if values < 1 {
                return err("no block_hashes");
            }
            let mut fields = RemovedFields::default();
            let known = values.min(REMOVED_FIELDS.len());
            for index in 0..known {
                fields.read(index, r)?;
            }
            skip_rest(r, values - known)?;
            KvCacheEvent::Removed(fields.finish()?)
        }
        Tag::Cleared => {
            skip_rest(r, values)?;
            KvCacheEvent::AllCleared
        }
    };
    Ok(Some(event))
}

/// The `"type"` of a map event of `pairs` pairs starting at the reader's position, which is
/// left unchanged: `Ok(None)` if it has none or a non-string one.
fn map_event_tag<'a>(r: &mut Reader<'a>, pairs: usize) -> Result<Option<&'a [u8]>> {
    let start = r.pos;
    let mut found = None;
    for _ in 0..pairs {
        // A key that is not a string is skipped here; the field pass judges it.
        let is_type = match r.str_bytes()? {
            Some(key) => key == b"type",
            None => {
                r.skip(FIELD_DEPTH)?;
                false
            }
        };
        if is_type {
            found = r.str_bytes()?;
            break;
        }
        r.skip(FIELD_DEPTH)?;
    }
    r.pos = start;
    Ok(found)
}

/// A map event of `pairs` pairs (the header consumed); None for an unknown type.
fn map_event(r: &mut Reader<'_>, pairs: usize) -> Result<Option<KvCacheEvent>> {
    let start = r.pos;
    let tag = match map_event_tag(r, pairs)? {
        Some(tag) => tag_of(tag)?,
        None => None,
    };
    let Some(tag) = tag else {
        for _ in 0..pairs {
            r.skip(FIELD_DEPTH)?;
            r.skip(FIELD_DEPTH)?;
        }
        return Ok(None);
    };
    debug_assert_eq!(r.pos, start);
    let mut stored = StoredFields::default();
    let mut removed = RemovedFields::default();
    for _ in 0..pairs {
        // Names are compared as bytes: a name that is not UTF-8 matches none and is skipped.
        let Some(key) = r.str_bytes()? else {
            return err("a field name that is not a string");
        };
        let field = match tag {
            Tag::Stored => STORED_FIELDS.iter().position(|f| f.as_bytes() == key),
            Tag::Removed => REMOVED_FIELDS.iter().position(|f| f.as_bytes() == key),
            Tag::Cleared => None,
        };
        match (tag, field) {
            (Tag::Stored, Some(index)) => stored.read(index, r, FIELD_DEPTH)?,
            (Tag::Removed, Some(index)) => removed.read(index, r)?,
            // "type" itself, and fields this decoder does not know.
            _ => r.skip(FIELD_DEPTH)?,
        }
    }
    Ok(Some(match tag {
        Tag::Stored => KvCacheEvent::Stored(stored.finish()?),
        Tag::Removed => KvCacheEvent::Removed(removed.finish()?),
        Tag::Cleared => KvCacheEvent::AllCleared,
    }))
}

fn tag_name(tag: Tag) -> &'static str {
    match tag {
        Tag::Stored => "BlockStored",
        Tag::Removed => "BlockRemoved",
        Tag::Cleared => "AllBlocksCleared",
    }
}

/// One event of either shape; None means "unknown type, skipped".
fn event(r: &mut Reader<'_>, index: usize) -> Result<Option<KvCacheEvent>> {
    let start = r.pos;
    let result = if let Some(pairs) = r.map_len()? {
        map_event(r, pairs)
    } else if let Some(len) = r.array_len()? {
        array_event(r, len)
    } else {
        return err(format!("event {index} is neither a map nor an array"));
    };
    result.map_err(|e| {
        // Name the event's type when it has a known one, as the reason's first words.
        let mut again = Reader {
            buf: r.buf,
            pos: start,
        };
        let tag = match again.map_len() {
            Ok(Some(pairs)) => map_event_tag(&mut again, pairs).ok().flatten(),
            _ => match again.array_len() {
                Ok(Some(len)) if len > 0 => again.str_bytes().ok().flatten(),
                _ => None,
            },
        };
        match tag.and_then(known_tag) {
            Some(tag) => DecodeError(format!(
                "event {index} ({}) is malformed: {e}",
                tag_name(tag)
            )),
            None => DecodeError(format!("event {index} is malformed: {e}")),
        }
    })
}

fn events(r: &mut Reader<'_>, batch: &mut DecodedBatch) -> Result<()> {
    let Some(len) = r.array_len()? else {
        return Err(expected("events", "an array"));
    };
    batch.events.reserve(capacity(r, len));
    for index in 0..len {
        match event(r, index)? {
            Some(e) => batch.events.push(e),
            None => batch.unknown_events += 1,
        }
    }
    Ok(())
}

/// Decode a published payload of any known shape (see the module docs).
pub fn decode_batch(payload: &[u8]) -> Result<DecodedBatch> {
    if payload.is_empty() {
        return err("empty payload");
    }
    let mut r = Reader {
        buf: payload,
        pos: 0,
    };
    let mut batch = DecodedBatch::default();
    let envelope = |e: DecodeError| DecodeError(format!("not a KV event batch: {e}"));
    if let Some(len) = r.array_len().map_err(envelope)? {
        if len < 2 {
            return Err(envelope(DecodeError(format!(
                "an array of {len} items, at least 2 (ts, events) required"
            ))));
        }
        batch.ts = read_f64(&mut r, "ts").map_err(envelope)?;
        events(&mut r, &mut batch).map_err(|e| {
            if e.0.starts_with("event ") {
                e
            } else {
                envelope(e)
            }
        })?;
        if len >= 3 {
            batch.data_parallel_rank =
                read_opt_i64(&mut r, "data_parallel_rank").map_err(envelope)?;
            for _ in 3..len {
                r.skip(2).map_err(envelope)?;
            }
        }
    } else if let Some(pairs) = r.map_len().map_err(envelope)? {
        let (mut has_ts, mut has_events) = (false, false);
        for _ in 0..pairs {
            let key = r
                .str()
                .map_err(envelope)?
                .ok_or_else(|| envelope(DecodeError("a field name that is not a string".into())))?;
            match key {
                "ts" => {
                    batch.ts = read_f64(&mut r, "ts").map_err(envelope)?;
                    has_ts = true;
                }
                "events" => {
                    batch.events.clear();
                    batch.unknown_events = 0;
                    events(&mut r, &mut batch).map_err(|e| {
                        if e.0.starts_with("event ") {
                            e
                        } else {
                            envelope(e)
                        }
                    })?;
                    has_events = true;
                }
                "data_parallel_rank" => {
                    batch.data_parallel_rank =
                        read_opt_i64(&mut r, "data_parallel_rank").map_err(envelope)?
                }
                _ => r.skip(2).map_err(envelope)?,
            }
        }
        if !has_ts || !has_events {
            return Err(envelope(DecodeError(
                "a map without ts or events".to_string(),
            )));
        }
    } else {
        return Err(envelope(DecodeError(format!(
            "first byte 0x{:02x} is not an array or map",
            payload[0]
        ))));
    }
    if r.pos != payload.len() {
        return err(format!(
            "not a KV event batch: {} trailing bytes",
            payload.len() - r.pos
        ));
    }
    Ok(batch)
}

// --- Encoding ----------------------------------------------------------------------------------
// msgspec writes every integer in its smallest msgpack form (unsigned markers for non-negative
// values), floats as float64, strings and containers with the smallest length header: so do
// `rmp`'s writers, so the bytes match vLLM's.

/// A write into a `Vec`, which cannot fail.
fn written<T, E: fmt::Debug>(result: std::result::Result<T, E>) {
    result.expect("writing into a Vec cannot fail");
}

fn write_uint(out: &mut Vec<u8>, v: u64) {
    written(encode::write_uint(out, v));
}

fn write_int(out: &mut Vec<u8>, v: i64) {
    written(encode::write_sint(out, v));
}

fn write_array_len(out: &mut Vec<u8>, len: usize) {
    written(encode::write_array_len(out, len as u32));
}

fn write_map_len(out: &mut Vec<u8>, len: usize) {
    written(encode::write_map_len(out, len as u32));
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    written(encode::write_str(out, s));
}

fn write_nil(out: &mut Vec<u8>) {
    written(encode::write_nil(out));
}

fn write_opt_str(out: &mut Vec<u8>, s: &Option<String>) {
    match s {
        Some(s) => write_str(out, s),
        None => write_nil(out),
    }
}

fn write_opt_int(out: &mut Vec<u8>, v: Option<i64>) {
    match v {
        Some(v) => write_int(out, v),
        None => write_nil(out),
    }
}

fn write_hashes(out: &mut Vec<u8>, hashes: &[u64]) {
    write_array_len(out, hashes.len());
    for &h in hashes {
        write_uint(out, h);
    }
}

fn write_extra_keys(out: &mut Vec<u8>, keys: &[ExtraKey]) {
    write_array_len(out, keys.len());
    for key in keys {
        match key {
            Some(raw) => out.extend_from_slice(raw),
            None => write_nil(out),
        }
    }
}

fn write_stored(out: &mut Vec<u8>, e: &BlockStored, format: WireFormat) {
    let key = |out: &mut Vec<u8>, name: &str| {
        if format == WireFormat::Map {
            write_str(out, name);
        }
    };
    match format {
        WireFormat::Map => {
            // omit_defaults: extra_keys and kv_cache_spec_kind only when set; group_idx is
            // always an int here; the fields kvroute does not model are None and left out.
            let pairs = 9
                + usize::from(e.extra_keys.is_some())
                + usize::from(e.kv_cache_spec_kind.is_some());
            write_map_len(out, pairs);
            write_str(out, "type");
        }
        WireFormat::Array => write_array_len(out, 15),
    }
    write_str(out, "BlockStored");
    key(out, "block_hashes");
    write_hashes(out, &e.block_hashes);
    key(out, "parent_block_hash");
    match e.parent_block_hash {
        Some(h) => write_uint(out, h),
        None => write_nil(out),
    }
    key(out, "token_ids");
    write_array_len(out, e.token_ids.len());
    for &t in &e.token_ids {
        write_int(out, t);
    }
    key(out, "block_size");
    write_uint(out, e.block_size as u64);
    key(out, "lora_id");
    write_opt_int(out, e.lora_id);
    key(out, "medium");
    write_opt_str(out, &e.medium);
    key(out, "lora_name");
    write_opt_str(out, &e.lora_name);
    match (&e.extra_keys, format) {
        (Some(keys), _) => {
            key(out, "extra_keys");
            write_extra_keys(out, keys);
        }
        (None, WireFormat::Array) => write_nil(out),
        (None, WireFormat::Map) => {}
    }
    key(out, "group_idx");
    write_int(out, e.group_idx);
    match (&e.kv_cache_spec_kind, format) {
        (Some(kind), _) => {
            key(out, "kv_cache_spec_kind");
            write_str(out, kind);
        }
        (None, WireFormat::Array) => write_nil(out),
        (None, WireFormat::Map) => {}
    }
    if format == WireFormat::Array {
        // kv_cache_spec_sliding_window, locality, ownership, session_id
        (0..4).for_each(|_| write_nil(out));
    }
}

fn write_removed(out: &mut Vec<u8>, e: &BlockRemoved, format: WireFormat) {
    match format {
        WireFormat::Map => {
            write_map_len(out, 4);
            write_str(out, "type");
            write_str(out, "BlockRemoved");
            write_str(out, "block_hashes");
            write_hashes(out, &e.block_hashes);
            write_str(out, "medium");
            write_opt_str(out, &e.medium);
            write_str(out, "group_idx");
            write_int(out, e.group_idx);
        }
        WireFormat::Array => {
            write_array_len(out, 6);
            write_str(out, "BlockRemoved");
            write_hashes(out, &e.block_hashes);
            write_opt_str(out, &e.medium);
            write_int(out, e.group_idx);
            // locality, ownership
            write_nil(out);
            write_nil(out);
        }
    }
}

/// Append the msgpack payload vLLM would publish for `batch` to `out`.
pub fn encode_batch_into(out: &mut Vec<u8>, batch: &EventBatch, format: WireFormat) {
    write_array_len(out, 3);
    written(encode::write_f64(out, batch.ts));
    write_array_len(out, batch.events.len());
    for event in &batch.events {
        match event {
            KvCacheEvent::Stored(e) => write_stored(out, e, format),
            KvCacheEvent::Removed(e) => write_removed(out, e, format),
            KvCacheEvent::AllCleared => {
                match format {
                    WireFormat::Map => {
                        write_map_len(out, 1);
                        write_str(out, "type");
                    }
                    WireFormat::Array => write_array_len(out, 1),
                }
                write_str(out, "AllBlocksCleared");
            }
        }
    }
    write_opt_int(out, batch.data_parallel_rank);
}

/// The msgpack payload vLLM would publish for `batch`, in `format`'s event shape.
pub fn encode_batch(batch: &EventBatch, format: WireFormat) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + 16 * batch.events.len());
    encode_batch_into(&mut out, batch, format);
    out
}

/// The strings of an `extra_keys` entry that is a tuple of strings only (what a text request
/// has: its LoRA adapter's name, its cache salt), in order; None for any other entry
/// (multimodal identifiers with their offsets, prompt-embedding digests, malformed bytes):
/// keys kvroute cannot derive from a prompt.
pub fn text_extra_keys(raw: &[u8]) -> Option<Vec<&str>> {
    let mut r = Reader { buf: raw, pos: 0 };
    let len = r.array_len().ok()??;
    let mut keys = Vec::with_capacity(len.min(raw.len()));
    for _ in 0..len {
        keys.push(r.str().ok()??);
    }
    (r.pos == raw.len()).then_some(keys)
}

/// The msgpack bytes of an `extra_keys` entry holding `keys` (a tuple of strings), as vLLM's
/// msgspec encoder writes it; the inverse of [`text_extra_keys`].
pub fn encode_text_extra_keys(keys: &[&str]) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + keys.iter().map(|k| 5 + k.len()).sum::<usize>());
    write_array_len(&mut out, keys.len());
    for key in keys {
        write_str(&mut out, key);
    }
    out
}

#[cfg(test)]
mod tests;
