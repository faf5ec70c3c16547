//! The mesh's one message, as msgpack: what a router replica tells its peers.
//!
//! An envelope `[version, sender, seq, sent_unix_s, kind, ...]` then the body's fields.
//! Block hashes travel as one binary of little-endian `u64`s and token ids as one of
//! little-endian `u32`s (8 and 4 bytes each, no per-item tag): a decision of a 2,435-token
//! prompt is about 11 KB with its token ids (which retention needs, to model the worker's
//! queue and refresh the prefix) and 1.3 KB without.

use std::fmt;

use rmpv::Value;

/// The envelope's version; a message of another version is refused, not guessed at.
pub const VERSION: u64 = 1;

/// What a replica says.
#[derive(Clone, Debug, PartialEq)]
pub enum MeshBody {
    /// Nothing new: the sender is alive (sent when it has been quiet for a while).
    Heartbeat,
    /// The sender routed a request (`decision`: its own number for it) to `worker`.
    Routed {
        decision: u64,
        worker: String,
        /// The prompt's block hashes (kvroute's own chain).
        block_hashes: Vec<u64>,
        prompt_tokens: u32,
        /// The request's output budget (`max_tokens`), 0 when retention does not see it.
        output_tokens: u32,
        /// Leading blocks the sender's index credited the worker with.
        overlap: u32,
        /// The prompt's token ids, which retention models the worker's queue with and
        /// refreshes its prefix from; empty for a prompt retention does not follow.
        prompt: Vec<u32>,
        /// The body's `model`, which refreshes of its prefix name (empty: none).
        model: String,
        /// The body's `cache_salt`, which refreshes of its prefix carry (empty: none).
        cache_salt: String,
    },
    /// The request `decision` got its first response byte.
    FirstToken { decision: u64 },
    /// The request `decision` ended (answered, failed or abandoned).
    Finished { decision: u64 },
    /// The sender, owner of `worker`'s retention, refreshed this prefix there.
    Refreshed {
        worker: String,
        block_hashes: Vec<u64>,
    },
    /// The sender has just started (at `started_unix_s`, its wall clock) and asks its peers
    /// for their state ([`Snapshot`]).
    SnapshotWanted { started_unix_s: f64 },
    /// The sender's routing state that KV-event replay cannot rebuild, for a replica that has
    /// just started.
    Snapshot(Snapshot),
}

/// What a newcomer cannot rebuild from the workers' KV-event replay: the policy's recent
/// shares and the decisions still open, each with the replica that made it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    /// kv-aware's share of the recent decisions per worker URL (empty for other policies).
    pub shares: Vec<(String, f64)>,
    /// The decisions those shares have counted (their averaging rate depends on it).
    pub share_decisions: u64,
    /// The replicas the sender hears (itself first, 0 s ago) and how long ago it last heard
    /// each, in seconds.
    pub replicas: Vec<(String, f64)>,
    /// Decisions not ended yet, the sender's and those it applied from its peers.
    pub open: Vec<OpenEntry>,
}

/// One decision in flight as a [`Snapshot`] carries it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OpenEntry {
    /// The instance of the replica that made it, and that replica's number for it.
    pub replica: String,
    pub decision: u64,
    /// The worker's URL.
    pub worker: String,
    pub prompt_tokens: u32,
    /// Whether its first token came (its prefill left the worker's load).
    pub first_token: bool,
    /// The prompt's block hashes, for the index's prediction (empty once the first token
    /// came: the worker's own events then tell).
    pub block_hashes: Vec<u64>,
}

/// One message: who sent it, its place in the sender's sequence, when, and what.
#[derive(Clone, Debug, PartialEq)]
pub struct MeshMessage {
    /// The sender's instance (new at each start of the process).
    pub sender: String,
    /// The sender's message counter: a gap is messages lost.
    pub seq: u64,
    /// The sender's wall clock (Unix seconds) when it sent it: the receiver's lag.
    pub sent_unix_s: f64,
    pub body: MeshBody,
}

/// A payload that is not a mesh message of this version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "bad mesh message: {}", self.0)
    }
}

impl std::error::Error for DecodeError {}

fn u64s_to_bin(values: &[u64]) -> Value {
    Value::Binary(values.iter().flat_map(|v| v.to_le_bytes()).collect())
}

fn u32s_to_bin(values: &[u32]) -> Value {
    Value::Binary(values.iter().flat_map(|v| v.to_le_bytes()).collect())
}

impl MeshMessage {
    /// The message as msgpack bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut fields = vec![
            Value::from(VERSION),
            Value::from(self.sender.as_str()),
            Value::from(self.seq),
            Value::F64(self.sent_unix_s),
        ];
        match &self.body {
            MeshBody::Heartbeat => fields.push(Value::from(0u8)),
            MeshBody::Routed {
                decision,
                worker,
                block_hashes,
                prompt_tokens,
                output_tokens,
                overlap,
                prompt,
                model,
                cache_salt,
            } => fields.extend([
                Value::from(1u8),
                Value::from(*decision),
                Value::from(worker.as_str()),
                u64s_to_bin(block_hashes),
                Value::from(*prompt_tokens),
                Value::from(*output_tokens),
                Value::from(*overlap),
                u32s_to_bin(prompt),
                Value::from(model.as_str()),
                Value::from(cache_salt.as_str()),
            ]),
            MeshBody::FirstToken { decision } => {
                fields.extend([Value::from(2u8), Value::from(*decision)]);
            }
            MeshBody::Finished { decision } => {
                fields.extend([Value::from(3u8), Value::from(*decision)]);
            }
            MeshBody::Refreshed {
                worker,
                block_hashes,
            } => fields.extend([
                Value::from(4u8),
                Value::from(worker.as_str()),
                u64s_to_bin(block_hashes),
            ]),
            MeshBody::SnapshotWanted { started_unix_s } => {
                fields.extend([Value::from(5u8), Value::F64(*started_unix_s)]);
            }
            MeshBody::Snapshot(snapshot) => {
                fields.push(Value::from(6u8));
                snapshot.encode_into(&mut fields);
            }
        }
        let mut out = Vec::with_capacity(64);
        rmpv::encode::write_value(&mut out, &Value::Array(fields))
            .expect("writing to a Vec cannot fail");
        out
    }

    /// A message from msgpack bytes.
    pub fn decode(mut payload: &[u8]) -> Result<Self, DecodeError> {
        let value = rmpv::decode::read_value(&mut payload)
            .map_err(|e| DecodeError(format!("not msgpack: {e}")))?;
        if !payload.is_empty() {
            return Err(DecodeError("trailing bytes".into()));
        }
        let Value::Array(fields) = value else {
            return Err(DecodeError("not an array".into()));
        };
        let mut f = Fields(fields.into_iter(), 0);
        let version = f.u64()?;
        if version != VERSION {
            return Err(DecodeError(format!(
                "version {version}, this router speaks {VERSION}"
            )));
        }
        let sender = f.string()?;
        let seq = f.u64()?;
        let sent_unix_s = f.f64()?;
        let body = match f.u64()? {
            0 => MeshBody::Heartbeat,
            1 => MeshBody::Routed {
                decision: f.u64()?,
                worker: f.string()?,
                block_hashes: f.u64s()?,
                prompt_tokens: f.u32()?,
                output_tokens: f.u32()?,
                overlap: f.u32()?,
                prompt: f.u32s()?,
                model: f.string()?,
                cache_salt: f.string()?,
            },
            2 => MeshBody::FirstToken { decision: f.u64()? },
            3 => MeshBody::Finished { decision: f.u64()? },
            4 => MeshBody::Refreshed {
                worker: f.string()?,
                block_hashes: f.u64s()?,
            },
            5 => MeshBody::SnapshotWanted {
                started_unix_s: f.f64()?,
            },
            6 => MeshBody::Snapshot(Snapshot::decode_from(&mut f)?),
            kind => return Err(DecodeError(format!("unknown kind {kind}"))),
        };
        if f.0.next().is_some() {
            return Err(DecodeError("extra fields".into()));
        }
        Ok(Self {
            sender,
            seq,
            sent_unix_s,
            body,
        })
    }
}

impl Snapshot {
    /// Its fields: `[[url, share]...]`, the count, `[[instance, heard_ago_s]...]`, then
    /// `[[replica, decision, worker, prompt_tokens, first_token, hashes]...]`.
    fn encode_into(&self, fields: &mut Vec<Value>) {
        let pair =
            |(name, x): &(String, f64)| Value::Array(vec![name.as_str().into(), Value::F64(*x)]);
        fields.extend([
            Value::Array(self.shares.iter().map(pair).collect()),
            Value::from(self.share_decisions),
            Value::Array(self.replicas.iter().map(pair).collect()),
            Value::Array(
                self.open
                    .iter()
                    .map(|e| {
                        Value::Array(vec![
                            e.replica.as_str().into(),
                            e.decision.into(),
                            e.worker.as_str().into(),
                            e.prompt_tokens.into(),
                            e.first_token.into(),
                            u64s_to_bin(&e.block_hashes),
                        ])
                    })
                    .collect(),
            ),
        ]);
    }

    fn decode_from(f: &mut Fields) -> Result<Self, DecodeError> {
        let pairs = |f: &mut Fields| -> Result<Vec<(String, f64)>, DecodeError> {
            f.array()?
                .map(|mut p| Ok((p.string()?, p.f64()?)))
                .collect()
        };
        Ok(Self {
            shares: pairs(f)?,
            share_decisions: f.u64()?,
            replicas: pairs(f)?,
            open: f
                .array()?
                .map(|mut e| {
                    Ok(OpenEntry {
                        replica: e.string()?,
                        decision: e.u64()?,
                        worker: e.string()?,
                        prompt_tokens: e.u32()?,
                        first_token: e.bool()?,
                        block_hashes: e.u64s()?,
                    })
                })
                .collect::<Result<_, DecodeError>>()?,
        })
    }
}

/// The envelope's fields in order, each read once (the count is for the error messages).
struct Fields(std::vec::IntoIter<Value>, usize);

impl Fields {
    fn next(&mut self) -> Result<Value, DecodeError> {
        self.1 += 1;
        self.0
            .next()
            .ok_or_else(|| DecodeError(format!("field {} missing", self.1)))
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        let n = self.1 + 1;
        self.next()?
            .as_u64()
            .ok_or_else(|| DecodeError(format!("field {n} is not an unsigned integer")))
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        let n = self.1 + 1;
        u32::try_from(self.u64()?).map_err(|_| DecodeError(format!("field {n} exceeds u32")))
    }

    fn bool(&mut self) -> Result<bool, DecodeError> {
        let n = self.1 + 1;
        self.next()?
            .as_bool()
            .ok_or_else(|| DecodeError(format!("field {n} is not a boolean")))
    }

    /// The next field, an array, as the fields of each of its items (themselves arrays).
    fn array(&mut self) -> Result<std::vec::IntoIter<Fields>, DecodeError> {
        let n = self.1 + 1;
        let Value::Array(items) = self.next()? else {
            return Err(DecodeError(format!("field {n} is not an array")));
        };
        items
            .into_iter()
            .map(|item| match item {
                Value::Array(inner) => Ok(Fields(inner.into_iter(), 0)),
                _ => Err(DecodeError(format!("an item of field {n} is not an array"))),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Vec::into_iter)
    }

    fn f64(&mut self) -> Result<f64, DecodeError> {
        let n = self.1 + 1;
        self.next()?
            .as_f64()
            .ok_or_else(|| DecodeError(format!("field {n} is not a number")))
    }

    fn string(&mut self) -> Result<String, DecodeError> {
        let n = self.1 + 1;
        match self.next()? {
            Value::String(s) => s
                .into_str()
                .ok_or_else(|| DecodeError(format!("field {n} is not UTF-8"))),
            _ => Err(DecodeError(format!("field {n} is not a string"))),
        }
    }

    fn bin(&mut self, width: usize) -> Result<Vec<u8>, DecodeError> {
        let n = self.1 + 1;
        match self.next()? {
            Value::Binary(b) if b.len() % width == 0 => Ok(b),
            _ => Err(DecodeError(format!(
                "field {n} is not a binary of {width}-byte items"
            ))),
        }
    }

    fn u64s(&mut self) -> Result<Vec<u64>, DecodeError> {
        let b = self.bin(8)?;
        Ok(b.chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect())
    }

    fn u32s(&mut self) -> Result<Vec<u32>, DecodeError> {
        let b = self.bin(4)?;
        Ok(b.chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(body: MeshBody) -> MeshMessage {
        MeshMessage {
            sender: "1f-2e".into(),
            seq: 41,
            sent_unix_s: 1_700_000_000.25,
            body,
        }
    }

    #[test]
    fn every_kind_round_trips() {
        for body in [
            MeshBody::Heartbeat,
            MeshBody::Routed {
                decision: 7,
                worker: "http://w0:8000".into(),
                block_hashes: vec![u64::MAX, 1, 2],
                prompt_tokens: 2435,
                output_tokens: 40,
                overlap: 2,
                prompt: vec![5, 6, u32::MAX],
                model: "Qwen/Qwen3-0.6B".into(),
                cache_salt: "tenant-a".into(),
            },
            MeshBody::FirstToken { decision: 7 },
            MeshBody::Finished { decision: 7 },
            MeshBody::Refreshed {
                worker: "http://w1:8000".into(),
                block_hashes: vec![3, 4],
            },
            MeshBody::SnapshotWanted {
                started_unix_s: 1_700_000_000.5,
            },
            MeshBody::Snapshot(Snapshot::default()),
            MeshBody::Snapshot(Snapshot {
                shares: vec![
                    ("http://w0:8000".into(), 0.25),
                    ("http://w1:8000".into(), 0.75),
                ],
                share_decisions: 1234,
                replicas: vec![("1f-2e".into(), 0.0), ("3a-4b".into(), 0.5)],
                open: vec![
                    OpenEntry {
                        replica: "3a-4b".into(),
                        decision: 9,
                        worker: "http://w1:8000".into(),
                        prompt_tokens: 2435,
                        first_token: false,
                        block_hashes: vec![u64::MAX, 0, 7],
                    },
                    OpenEntry {
                        replica: "1f-2e".into(),
                        decision: 10,
                        worker: "http://w0:8000".into(),
                        prompt_tokens: 12,
                        first_token: true,
                        block_hashes: Vec::new(),
                    },
                ],
            }),
        ] {
            let m = message(body);
            assert_eq!(MeshMessage::decode(&m.encode()), Ok(m));
        }
    }

    #[test]
    fn a_decision_costs_eight_bytes_a_block_and_four_a_token() {
        let m = message(MeshBody::Routed {
            decision: 1,
            worker: "http://10.0.0.5:8000".into(),
            block_hashes: vec![0; 152],
            prompt_tokens: 2435,
            output_tokens: 40,
            overlap: 125,
            prompt: vec![0; 2435],
            model: "Qwen/Qwen3-0.6B".into(),
            cache_salt: String::new(),
        });
        let len = m.encode().len();
        assert!(len < 152 * 8 + 2435 * 4 + 100, "{len} bytes");
    }

    #[test]
    fn what_is_not_a_message_of_this_version_is_refused() {
        let mut other = message(MeshBody::Heartbeat).encode();
        other[1] = 2; // version 2 (a positive fixint after the array header)
        assert!(
            MeshMessage::decode(&other)
                .unwrap_err()
                .0
                .contains("version 2")
        );
        assert!(MeshMessage::decode(b"\x93\x01").is_err());
        assert!(MeshMessage::decode(&[0xc1]).is_err());
        let mut bad = message(MeshBody::Finished { decision: 1 }).encode();
        bad.push(0);
        assert!(MeshMessage::decode(&bad).is_err());
        let odd = rmpv::Value::Array(vec![
            1u64.into(),
            "a".into(),
            1u64.into(),
            rmpv::Value::F64(0.0),
            4u64.into(),
            "w".into(),
            rmpv::Value::Binary(vec![0; 7]),
        ]);
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &odd).unwrap();
        assert!(
            MeshMessage::decode(&bytes)
                .unwrap_err()
                .0
                .contains("8-byte")
        );
    }
}
