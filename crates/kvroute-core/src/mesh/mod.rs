//! The replica mesh: router replicas tell each other what KV events don't carry.
//!
//! A worker's KV events tell every replica what the worker caches, but not which replica sent
//! what where: a replica sees its own decisions only. Its load accounting (requests in flight,
//! prompt tokens still to prefill), its predicted index entries (between a decision and the
//! worker's first event) and its retention model of each worker's free queue (a refresh or a
//! hit touches cached blocks, which emits no event) then see a fleet that carries its share
//! of the traffic, not the whole. So each replica publishes its decisions (the prompt's block
//! chain, the worker, prompt and output tokens, the overlap credited, then first token and
//! end) and its retention refreshes, and applies its peers' to its own state as if it had
//! made them (by the routing operation's rule, `kvroute_core::routing::Router::apply_peer`,
//! which the simulator's replicas follow too).
//!
//! [`Mesh`] is the pure state machine of that exchange (time passed in, messages and effects
//! as data; the sockets are the serving crate's): numbering outgoing messages, counting what
//! was lost (gaps in a peer's sequence) and how late it arrived, keeping each peer decision
//! applied here until its end, and expiring what will not end (a lost `Finished`, a peer gone
//! silent): a lost message costs a prediction or some load accounting for a while, never a
//! wrong answer. It also names each worker's retention owner ([`Mesh::owner`]): rendezvous
//! hashing over the live replicas (this one and every peer heard within the liveness window),
//! so that one replica refreshes a worker's prefixes and a replica that leaves hands its
//! workers over when its peers stop hearing it (or at once when the connection to it closes:
//! a killed replica's requests broke with it).
//!
//! A replica that has just started rebuilds its index from the workers' KV-event replay, but
//! not what only the replicas know: [`adopt`] has it ask its peers for a [`Snapshot`] of it
//! (the policy's recent shares, the decisions still open) and adopt the first that arrives.

pub mod adopt;
pub mod message;

use std::collections::{HashMap, HashSet};

use xxhash_rust::xxh3::xxh3_64;

use crate::routing::step::Decision;

pub use message::{DecodeError, MeshBody, MeshMessage, OpenEntry, Snapshot};

/// The mesh's knobs (by field name in a configuration, absent ones as in `Default`).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MeshConfig {
    /// A peer not heard from for this long is gone: its open decisions are released and it no
    /// longer owns workers. Replicas send a heartbeat at a third of it when quiet.
    pub liveness_s: f64,
    /// A peer decision without its `Finished` after this long is released (its message was
    /// lost, or the request is longer than any should be).
    pub decision_ttl_s: f64,
    /// Most peer decisions held open at once (over all peers); a new one beyond it is not
    /// applied (counted), so a flood cannot grow the state without bound.
    pub max_open: usize,
}

impl Default for MeshConfig {
    fn default() -> Self {
        Self {
            liveness_s: 3.0,
            decision_ttl_s: 600.0,
            max_open: 65_536,
        }
    }
}

/// One peer as this replica knows it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PeerView {
    /// Its instance.
    pub instance: String,
    /// Monotonic seconds when this replica last heard from it.
    pub last_heard: f64,
    /// Messages received from it.
    pub received: u64,
    /// Messages it sent that never arrived (gaps in its sequence).
    pub lost: u64,
    /// Its last message's lag: receipt minus sending, on the two wall clocks.
    pub lag_s: f64,
    /// The connection its messages came on last (0: none yet, known from a snapshot).
    link: u64,
    /// Its last sequence number seen (None: none yet).
    last_seq: Option<u64>,
}

/// The mesh's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MeshStats {
    /// Messages numbered for sending.
    pub sent: u64,
    /// Messages received from peers (this replica's own echoes excluded).
    pub received: u64,
    /// Messages peers sent that did not arrive (sequence gaps).
    pub lost: u64,
    /// Peer decisions not applied: over [`MeshConfig::max_open`], or a worker not known here.
    pub refused: u64,
    /// Peer decisions released without their `Finished` (expired or their peer gone).
    pub expired: u64,
    /// Snapshots of this replica's state sent to peers that had just started.
    pub snapshots_sent: u64,
    /// Snapshots adopted (at most one per start) and the open decisions they brought.
    pub snapshots_adopted: u64,
    pub adopted_decisions: u64,
}

/// What a peer's decision carries that the routing state needs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PeerDecision<'a> {
    /// The prompt's block hashes.
    pub block_hashes: &'a [u64],
    /// The prompt's tokens (empty when the peer did not send them: no retention update).
    pub prompt: &'a [u32],
    /// The prompt's length in tokens.
    pub prompt_tokens: usize,
    /// The output budget.
    pub output_tokens: usize,
    /// Blocks of the prompt the peer's index credited the worker with.
    pub overlap: usize,
    /// The request's LoRA adapter (`crate::policies::adapter_id`): None as decoded, since
    /// only the receiver knows whether the body's `model` names an adapter; it sets it.
    pub adapter: Option<u64>,
}

/// What a received message asks of the router's state.
#[derive(Debug, PartialEq)]
pub enum Received<'a> {
    /// Nothing (a heartbeat, this replica's own message, an end already expired).
    Nothing,
    /// Apply a peer's decision as if made here, then give the result to [`Mesh::opened`].
    Routed {
        peer: String,
        decision: u64,
        worker: &'a str,
        /// What the routing state needs of it (`kvroute_core::routing::Router::apply_peer`).
        routed: PeerDecision<'a>,
        /// The body's `model` and `cache_salt` (empty: none), which refreshes of its prefix
        /// carry.
        model: &'a str,
        cache_salt: &'a str,
    },
    /// A peer decision applied here (its handle) got its first token.
    FirstToken(&'a mut DecisionHandle),
    /// A peer decision applied here ended: release its handle.
    Finished(DecisionHandle),
    /// A peer refreshed this prefix on `worker`: apply it to the retention model.
    Refreshed {
        worker: &'a str,
        block_hashes: &'a [u64],
    },
    /// A peer that has just started asks for this replica's state: publish
    /// [`Mesh::snapshot`].
    SnapshotWanted,
    /// This replica, just started, adopts a peer's state: restore the policy's shares, apply
    /// each open decision (`kvroute_core::routing::Router::adopt_open`), then give them to
    /// [`Mesh::adopted`].
    Adopt {
        /// kv-aware's recent shares by worker URL, and the decisions they counted.
        shares: Vec<(String, f64)>,
        share_decisions: u64,
        /// Decisions in flight not known here yet.
        open: Vec<OpenEntry>,
    },
}

/// A peer decision as the router applied it (the worker's slot, the prompt tokens charged to
/// its load until the first token, its admission ticket), and whether its first token came.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecisionHandle {
    pub decision: Decision,
    /// Whether its first token came (its prefill tokens were released then).
    pub first_token: bool,
}

struct OpenDecision {
    handle: DecisionHandle,
    expires: f64,
    /// What a snapshot says of it: the worker's URL, the prompt's length and its block
    /// hashes (dropped at the first token).
    worker: String,
    prompt_tokens: u32,
    block_hashes: Vec<u64>,
}

/// Where a replica stands with adopting a peer's snapshot ([`adopt`]).
#[derive(Debug, Default)]
struct Adoption {
    /// When it first asked (its start), on the monotonic and the wall clock.
    started: Option<f64>,
    started_unix: Option<f64>,
    /// When it adopted a snapshot, since its start.
    adopted_after: Option<f64>,
    last_asked: Option<f64>,
    last_answered: Option<f64>,
    /// Peer decisions whose end came before any snapshot: not to be opened from one.
    ended: HashSet<(String, u64)>,
}

/// The mesh's state (see the module docs).
pub struct Mesh {
    me: String,
    config: MeshConfig,
    peers: HashMap<String, PeerView>,
    open: HashMap<(String, u64), OpenDecision>,
    /// This replica's own decisions not ended, as a snapshot carries them.
    own: HashMap<u64, OpenEntry>,
    adoption: Adoption,
    seq: u64,
    next_decision: u64,
    last_sent: f64,
    stats: MeshStats,
    /// The message being applied, kept so [`Received`] can borrow from it.
    current: Option<MeshMessage>,
}

impl Mesh {
    /// The mesh of the replica `me` (its instance), no peer heard yet.
    pub fn new(me: impl Into<String>, config: MeshConfig) -> Self {
        Self {
            me: me.into(),
            config,
            peers: HashMap::new(),
            open: HashMap::new(),
            own: HashMap::new(),
            adoption: Adoption::default(),
            seq: 0,
            next_decision: 0,
            last_sent: f64::NEG_INFINITY,
            stats: MeshStats::default(),
            current: None,
        }
    }

    /// This replica's instance.
    pub fn me(&self) -> &str {
        &self.me
    }

    /// The counters.
    pub fn stats(&self) -> MeshStats {
        self.stats
    }

    /// The peers heard from (live or not yet expired from the table).
    pub fn peers(&self) -> impl Iterator<Item = &PeerView> {
        self.peers.values()
    }

    /// Peers heard within the liveness window at `now`.
    pub fn live_peers(&self, now: f64) -> usize {
        self.peers
            .values()
            .filter(|p| now - p.last_heard <= self.config.liveness_s)
            .count()
    }

    /// Peer decisions applied here and not ended.
    pub fn open_decisions(&self) -> usize {
        self.open.len()
    }

    /// A new number for a decision of this replica's.
    pub fn next_decision(&mut self) -> u64 {
        self.next_decision += 1;
        self.next_decision
    }

    /// `body` as the next message to publish, at `now` (monotonic) and `now_unix` (wall).
    /// This replica's decisions are kept from their `Routed` to their `Finished`, for the
    /// snapshots it may send (at most [`MeshConfig::max_open`]).
    pub fn message(&mut self, body: MeshBody, now: f64, now_unix: f64) -> MeshMessage {
        match &body {
            MeshBody::Routed {
                decision,
                worker,
                block_hashes,
                prompt_tokens,
                ..
            } if self.own.len() < self.config.max_open => {
                let entry = OpenEntry {
                    replica: self.me.clone(),
                    decision: *decision,
                    worker: worker.clone(),
                    prompt_tokens: *prompt_tokens,
                    first_token: false,
                    block_hashes: block_hashes.clone(),
                };
                self.own.insert(*decision, entry);
            }
            MeshBody::FirstToken { decision } => {
                if let Some(entry) = self.own.get_mut(decision) {
                    entry.first_token = true;
                    entry.block_hashes = Vec::new();
                }
            }
            MeshBody::Finished { decision } => {
                self.own.remove(decision);
            }
            _ => {}
        }
        self.seq += 1;
        self.stats.sent += 1;
        self.last_sent = now;
        MeshMessage {
            sender: self.me.clone(),
            seq: self.seq,
            sent_unix_s: now_unix,
            body,
        }
    }

    /// A heartbeat to publish when this replica has been quiet for a third of the liveness
    /// window (None otherwise).
    pub fn heartbeat(&mut self, now: f64, now_unix: f64) -> Option<MeshMessage> {
        (now - self.last_sent >= self.config.liveness_s / 3.0)
            .then(|| self.message(MeshBody::Heartbeat, now, now_unix))
    }

    /// Take in a peer's message, which came on connection `link`, at `now` (monotonic) and
    /// `now_unix` (wall): count it, and say what it asks of the router ([`Received`]).
    pub fn receive(
        &mut self,
        link: u64,
        message: MeshMessage,
        now: f64,
        now_unix: f64,
    ) -> Received<'_> {
        if message.sender == self.me {
            return Received::Nothing;
        }
        self.stats.received += 1;
        let peer = self
            .peers
            .entry(message.sender.clone())
            .or_insert_with(|| PeerView {
                instance: message.sender.clone(),
                ..PeerView::default()
            });
        peer.link = link;
        peer.last_heard = now;
        peer.received += 1;
        peer.lag_s = (now_unix - message.sent_unix_s).max(0.0);
        if let Some(last) = peer.last_seq
            && message.seq > last + 1
        {
            let lost = message.seq - last - 1;
            peer.lost += lost;
            self.stats.lost += lost;
        }
        peer.last_seq = Some(peer.last_seq.map_or(message.seq, |l| l.max(message.seq)));
        let sender = message.sender.clone();
        if !matches!(
            message.body,
            MeshBody::Routed { .. } | MeshBody::Refreshed { .. }
        ) {
            return self.control(sender, message.body, now);
        }
        let message = self.current.insert(message);
        match &message.body {
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
            } => {
                if self.open.len() >= self.config.max_open {
                    self.stats.refused += 1;
                    return Received::Nothing;
                }
                Received::Routed {
                    peer: sender,
                    decision: *decision,
                    worker,
                    routed: PeerDecision {
                        block_hashes,
                        prompt,
                        prompt_tokens: *prompt_tokens as usize,
                        output_tokens: *output_tokens as usize,
                        overlap: *overlap as usize,
                        adapter: None,
                    },
                    model,
                    cache_salt,
                }
            }
            MeshBody::Refreshed {
                worker,
                block_hashes,
            } => Received::Refreshed {
                worker,
                block_hashes,
            },
            _ => Received::Nothing,
        }
    }

    /// A peer's message that asks nothing of the routing state but a handle's release, or of
    /// this replica a snapshot sent or adopted.
    fn control(&mut self, sender: String, body: MeshBody, now: f64) -> Received<'_> {
        match body {
            MeshBody::FirstToken { decision } => match self.open.get_mut(&(sender, decision)) {
                Some(open) if !open.handle.first_token => {
                    open.handle.first_token = true;
                    open.block_hashes = Vec::new();
                    Received::FirstToken(&mut open.handle)
                }
                _ => Received::Nothing,
            },
            MeshBody::Finished { decision } => {
                match self.open.remove(&(sender.clone(), decision)) {
                    Some(open) => Received::Finished(open.handle),
                    None => {
                        self.ended_unseen(sender, decision, now);
                        Received::Nothing
                    }
                }
            }
            MeshBody::SnapshotWanted { started_unix_s } if self.answers(now, started_unix_s) => {
                Received::SnapshotWanted
            }
            MeshBody::Snapshot(snapshot) => self.adopt(snapshot, now),
            _ => Received::Nothing,
        }
    }

    /// The router applied `peer`'s `decision` as `handle` at `now` (None: it could not, the
    /// worker is not one it knows): held until its `Finished` or expiry.
    pub fn opened(
        &mut self,
        peer: String,
        decision: u64,
        handle: Option<DecisionHandle>,
        now: f64,
    ) {
        let Some(handle) = handle else {
            self.stats.refused += 1;
            return;
        };
        // What a snapshot will say of it, from the message being applied.
        let (worker, prompt_tokens, block_hashes) = match self.current.as_ref() {
            Some(MeshMessage {
                sender,
                body:
                    MeshBody::Routed {
                        decision: d,
                        worker,
                        prompt_tokens,
                        block_hashes,
                        ..
                    },
                ..
            }) if *sender == peer && *d == decision => {
                (worker.clone(), *prompt_tokens, block_hashes.clone())
            }
            _ => Default::default(),
        };
        let open = OpenDecision {
            handle,
            expires: now + self.config.decision_ttl_s,
            worker,
            prompt_tokens,
            block_hashes,
        };
        self.open.insert((peer, decision), open);
    }

    /// Release, at `now`, the peer decisions past their TTL and those of peers not heard
    /// within the liveness window (whose peers are then forgotten); the router releases what
    /// each handle charged.
    pub fn expire(&mut self, now: f64) -> Vec<DecisionHandle> {
        let liveness = self.config.liveness_s;
        let gone: Vec<String> = self
            .peers
            .values()
            .filter(|p| now - p.last_heard > liveness)
            .map(|p| p.instance.clone())
            .collect();
        self.release(&gone, now)
    }

    /// The connection `link` to a peer's PUB socket closed at `now`: the peers heard on it
    /// are gone (a killed replica's connection closes with it; a live one that only lost its
    /// connection is heard again at its next message), their open decisions released.
    pub fn link_closed(&mut self, link: u64, now: f64) -> Vec<DecisionHandle> {
        let gone: Vec<String> = self
            .peers
            .values()
            .filter(|p| p.link == link && link != 0)
            .map(|p| p.instance.clone())
            .collect();
        self.release(&gone, now)
    }

    /// Forget the peers `gone` and release their decisions and those past their TTL.
    fn release(&mut self, gone: &[String], now: f64) -> Vec<DecisionHandle> {
        for g in gone {
            self.peers.remove(g);
        }
        let mut released = Vec::new();
        self.open.retain(|(peer, _), open| {
            let keep = open.expires > now && !gone.contains(peer);
            if !keep {
                released.push(open.handle);
            }
            keep
        });
        self.stats.expired += released.len() as u64;
        released
    }

    /// The replica that owns `worker`'s retention at `now`: of this one and the peers heard
    /// within the liveness window, the one whose hash with the worker is highest (rendezvous
    /// hashing: a replica that joins or leaves moves only the workers it wins or held).
    pub fn owner(&self, worker: &str, now: f64) -> &str {
        let live = self
            .peers
            .values()
            .filter(|p| now - p.last_heard <= self.config.liveness_s)
            .map(|p| p.instance.as_str());
        retention_owner(worker, std::iter::once(self.me.as_str()).chain(live))
            .expect("this replica is always a candidate")
    }

    /// Whether this replica owns `worker`'s retention at `now`.
    pub fn owns(&self, worker: &str, now: f64) -> bool {
        self.owner(worker, now) == self.me
    }
}

/// Of `replicas` (instances), the one that owns `worker`'s retention: the highest rendezvous
/// hash with the worker (ties by name). None when there is no replica.
pub fn retention_owner<'a>(
    worker: &str,
    replicas: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    replicas
        .into_iter()
        .max_by_key(|r| (rendezvous(r, worker), *r))
}

/// Replica `replica`'s weight for `worker`.
fn rendezvous(replica: &str, worker: &str) -> u64 {
    let mut key = Vec::with_capacity(replica.len() + worker.len() + 1);
    key.extend_from_slice(replica.as_bytes());
    key.push(0);
    key.extend_from_slice(worker.as_bytes());
    xxh3_64(&key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routed(sender: &str, seq: u64, decision: u64) -> MeshMessage {
        MeshMessage {
            sender: sender.into(),
            seq,
            sent_unix_s: 100.0,
            body: MeshBody::Routed {
                decision,
                worker: "w0".into(),
                block_hashes: vec![1, 2],
                prompt_tokens: 40,
                output_tokens: 8,
                overlap: 1,
                prompt: vec![9; 17],
                model: String::new(),
                cache_salt: String::new(),
            },
        }
    }

    fn end(sender: &str, seq: u64, decision: u64) -> MeshMessage {
        MeshMessage {
            sender: sender.into(),
            seq,
            sent_unix_s: 100.5,
            body: MeshBody::Finished { decision },
        }
    }

    const HANDLE: DecisionHandle = DecisionHandle {
        decision: Decision {
            worker: 0,
            overlap: 0,
            prefill_tokens: 24,
            ticket: None,
        },
        first_token: false,
    };

    #[test]
    fn a_peer_decision_is_applied_then_released_at_its_end() {
        let mut mesh = Mesh::new("me", MeshConfig::default());
        match mesh.receive(1, routed("p", 1, 7), 10.0, 100.25) {
            Received::Routed {
                peer,
                decision,
                worker,
                routed,
                ..
            } => {
                assert_eq!((peer.as_str(), decision, worker), ("p", 7, "w0"));
                assert_eq!((routed.block_hashes, routed.overlap), (&[1u64, 2][..], 1));
            }
            other => panic!("{other:?}"),
        }
        mesh.opened("p".into(), 7, Some(HANDLE), 10.0);
        let first = MeshMessage {
            body: MeshBody::FirstToken { decision: 7 },
            ..end("p", 2, 7)
        };
        assert!(matches!(
            mesh.receive(1, first.clone(), 10.1, 100.3),
            Received::FirstToken(h) if h.decision.prefill_tokens == 24
        ));
        // A first token said twice is released once.
        assert_eq!(mesh.receive(1, first, 10.1, 100.3), Received::Nothing);
        let Received::Finished(h) = mesh.receive(1, end("p", 3, 7), 10.2, 100.5) else {
            panic!("the end releases the decision")
        };
        assert!(h.first_token);
        assert_eq!(mesh.open_decisions(), 0);
        assert_eq!(
            mesh.receive(1, end("p", 4, 7), 10.3, 100.6),
            Received::Nothing
        );
        let peer = mesh.peers().next().unwrap();
        assert_eq!((peer.received, peer.lost), (5, 0));
        assert!((peer.lag_s - 0.1).abs() < 1e-9);
    }

    #[test]
    fn its_own_messages_echoed_back_are_ignored() {
        let mut mesh = Mesh::new("me", MeshConfig::default());
        let mine = mesh.message(MeshBody::Heartbeat, 0.0, 0.0);
        assert_eq!(mine.seq, 1);
        assert_eq!(mesh.receive(1, mine, 0.0, 0.0), Received::Nothing);
        assert_eq!(mesh.stats().received, 0);
        assert_eq!(mesh.live_peers(0.0), 0);
    }

    #[test]
    fn gaps_in_a_peers_sequence_count_as_lost() {
        let mut mesh = Mesh::new("me", MeshConfig::default());
        let _ = mesh.receive(1, end("p", 5, 1), 0.0, 0.0); // joined mid-stream: no loss counted
        let _ = mesh.receive(1, end("p", 9, 2), 0.0, 0.0);
        assert_eq!(mesh.stats().lost, 3);
    }

    #[test]
    fn a_lost_end_expires_and_a_silent_peers_decisions_are_released() {
        let config = MeshConfig {
            liveness_s: 3.0,
            decision_ttl_s: 60.0,
            max_open: 2,
        };
        let mut mesh = Mesh::new("me", config);
        let _ = mesh.receive(1, routed("p", 1, 1), 0.0, 0.0);
        mesh.opened("p".into(), 1, Some(HANDLE), 0.0);
        let _ = mesh.receive(1, routed("q", 1, 1), 0.0, 0.0);
        mesh.opened("q".into(), 1, Some(HANDLE), 0.0);
        // Over max_open: refused, not applied.
        assert_eq!(
            mesh.receive(1, routed("q", 2, 2), 0.0, 0.0),
            Received::Nothing
        );
        assert_eq!(mesh.stats().refused, 1);
        // p keeps talking (heartbeats), q goes silent.
        let beat = MeshMessage {
            body: MeshBody::Heartbeat,
            ..end("p", 2, 0)
        };
        let _ = mesh.receive(1, beat.clone(), 2.5, 0.0);
        assert_eq!(mesh.expire(4.0).len(), 1, "q's decision goes with q");
        assert_eq!(mesh.live_peers(4.0), 1);
        for t in [5.0, 7.5, 10.0, 12.5, 15.0, 17.5, 20.0] {
            let _ = mesh.receive(1, beat.clone(), t, 0.0);
            assert!(mesh.expire(t).is_empty());
        }
        let _ = mesh.receive(1, beat, 60.0, 0.0);
        assert_eq!(mesh.expire(60.0).len(), 1, "p's decision outlived its TTL");
        assert_eq!(mesh.stats().expired, 2);
    }

    #[test]
    fn one_owner_per_worker_and_a_leaving_replica_hands_its_workers_over() {
        let workers: Vec<String> = (0..60).map(|i| format!("http://w{i}:8000")).collect();
        let names = ["a", "b", "c"];
        let mut meshes: Vec<Mesh> = names
            .iter()
            .map(|n| Mesh::new(*n, MeshConfig::default()))
            .collect();
        for mesh in &mut meshes {
            for (seq, n) in names.iter().enumerate() {
                let _ = mesh.receive(1, end(n, seq as u64 + 1, 0), 0.0, 0.0);
            }
        }
        for w in &workers {
            let owners: Vec<&str> = meshes.iter().map(|m| m.owner(w, 1.0)).collect();
            assert!(owners.iter().all(|o| *o == owners[0]), "they agree on {w}");
            assert_eq!(meshes.iter().filter(|m| m.owns(w, 1.0)).count(), 1);
        }
        let per: Vec<usize> = meshes
            .iter()
            .map(|m| workers.iter().filter(|w| m.owns(w, 1.0)).count())
            .collect();
        assert!(
            per.iter().all(|&n| n >= 10),
            "spread over the three: {per:?}"
        );
        // "c" stops; a and b keep hearing each other. c's workers move, the rest stay.
        let before: Vec<String> = workers
            .iter()
            .map(|w| meshes[0].owner(w, 1.0).to_owned())
            .collect();
        for (i, mesh) in meshes.iter_mut().take(2).enumerate() {
            let other = names[1 - i];
            let _ = mesh.receive(1, end(other, 10, 0), 4.0, 0.0);
        }
        for (w, was) in workers.iter().zip(&before) {
            let now_a = meshes[0].owner(w, 5.0);
            assert_eq!(now_a, meshes[1].owner(w, 5.0));
            if was != "c" {
                assert_eq!(now_a, was, "a worker of a live replica stays put");
            } else {
                assert_ne!(now_a, "c");
            }
        }
    }

    #[test]
    fn a_closed_connection_lets_its_peer_go_at_once() {
        let mut mesh = Mesh::new("me", MeshConfig::default());
        let _ = mesh.receive(1, routed("p", 1, 1), 0.0, 0.0);
        mesh.opened("p".into(), 1, Some(HANDLE), 0.0);
        let _ = mesh.receive(2, routed("q", 1, 1), 0.0, 0.0);
        mesh.opened("q".into(), 1, Some(HANDLE), 0.0);
        assert!(mesh.link_closed(3, 0.5).is_empty(), "no peer came on it");
        assert_eq!(
            mesh.link_closed(1, 0.5).len(),
            1,
            "p's decision goes with p"
        );
        assert_eq!((mesh.live_peers(0.5), mesh.open_decisions()), (1, 1));
        // p heard again (a new connection): a peer again; its old decision's end is a no-op.
        assert_eq!(mesh.receive(4, end("p", 2, 1), 0.6, 0.0), Received::Nothing);
        assert_eq!(mesh.live_peers(0.6), 2);
    }

    #[test]
    fn a_quiet_replica_sends_heartbeats_at_a_third_of_the_window() {
        let mut mesh = Mesh::new("me", MeshConfig::default());
        assert!(mesh.heartbeat(0.0, 0.0).is_some());
        assert!(mesh.heartbeat(0.5, 0.0).is_none());
        assert!(mesh.heartbeat(1.0, 0.0).is_some());
    }
}
