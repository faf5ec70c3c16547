//! A replica that has just started takes its peers' routing state.
//!
//! The workers' KV-event replay rebuilds a new replica's index, but not what only the
//! replicas know: the policy's recent shares (kv-aware's share guard and the placement of its
//! copies read them) and the decisions in flight (the load guard's counts, the predictions).
//! Without them a restarted replica decides from a fair share and an idle fleet while its
//! peers do not, and they disagree until the difference wears off.
//!
//! So a replica asks ([`MeshBody::SnapshotWanted`], every [`ASK_INTERVAL_S`]) while it is
//! *fresh*: it has adopted nothing yet and started less than two liveness windows ago. A peer
//! answers with a [`Snapshot`] (at most one per [`ANSWER_INTERVAL_S`]: one broadcast serves
//! every newcomer) when it is not fresh itself or started before the asker (by their wall
//! clocks: state flows from older replicas to younger, never round in a circle); the
//! newcomer adopts the first that arrives, once, and ignores the rest. A snapshot is bounded ([`MAX_DECISIONS`],
//! [`MAX_BLOCKS`]); a lost or late one costs agreement for a while (the shares converge as
//! decisions are observed, open decisions end), never a wrong answer.
//!
//! What a snapshot's decisions become here: those of replicas the sender heard within the
//! liveness window, not already open here (their `Routed` came first) and not already ended
//! (their `Finished` came first: kept while fresh), each applied as a peer decision and held
//! until its end, its replica counted live as the sender saw it.

use std::collections::HashSet;

use super::message::{MeshBody, MeshMessage, OpenEntry, Snapshot};
use super::{DecisionHandle, Mesh, OpenDecision, PeerView, Received};

/// How often a fresh replica asks for a snapshot, in seconds.
pub const ASK_INTERVAL_S: f64 = 0.2;
/// The least time between two snapshots a replica sends, in seconds.
pub const ANSWER_INTERVAL_S: f64 = 0.1;
/// Open decisions a snapshot carries at most.
pub const MAX_DECISIONS: usize = 4096;
/// Block hashes a snapshot carries at most (2 MiB); decisions past it travel without theirs.
pub const MAX_BLOCKS: usize = 1 << 18;

impl Mesh {
    /// Whether this replica would still adopt a snapshot at `now`.
    pub fn fresh(&self, now: f64) -> bool {
        let a = &self.adoption;
        a.adopted_after.is_none()
            && a.started
                .is_none_or(|s| now - s <= 2.0 * self.config.liveness_s)
    }

    /// Seconds from this replica's start to its adopting a snapshot (None: not adopted).
    pub fn adopted_after(&self) -> Option<f64> {
        self.adoption.adopted_after
    }

    /// While fresh, a request for a snapshot every [`ASK_INTERVAL_S`] (the first call starts
    /// the clock); None otherwise.
    pub fn ask_snapshot(&mut self, now: f64, now_unix: f64) -> Option<MeshMessage> {
        self.adoption.started.get_or_insert(now);
        let started_unix_s = *self.adoption.started_unix.get_or_insert(now_unix);
        if !self.fresh(now) {
            self.adoption.ended = HashSet::new();
            return None;
        }
        if self
            .adoption
            .last_asked
            .is_some_and(|t| now - t < ASK_INTERVAL_S)
        {
            return None;
        }
        self.adoption.last_asked = Some(now);
        Some(self.message(MeshBody::SnapshotWanted { started_unix_s }, now, now_unix))
    }

    /// Whether a peer that started at `their_start_unix` (wall clock) is answered at `now`:
    /// when this replica is not fresh or started before it, at most once per
    /// [`ANSWER_INTERVAL_S`].
    pub(super) fn answers(&self, now: f64, their_start_unix: f64) -> bool {
        let older = self
            .adoption
            .started_unix
            .is_some_and(|mine| mine < their_start_unix);
        (older || !self.fresh(now))
            && self
                .adoption
                .last_answered
                .is_none_or(|t| now - t >= ANSWER_INTERVAL_S)
    }

    /// A peer decision ended that is not open here: while fresh, remembered so that a
    /// snapshot sent before that end does not open it (bounded like the open decisions).
    pub(super) fn ended_unseen(&mut self, peer: String, decision: u64, now: f64) {
        if self.fresh(now) && self.adoption.ended.len() < self.config.max_open {
            self.adoption.ended.insert((peer, decision));
        }
    }

    /// This replica's state as a snapshot message, with the policy's `shares` (by worker
    /// URL) and the decisions they counted; bounded by [`MAX_DECISIONS`] and [`MAX_BLOCKS`].
    pub fn snapshot(
        &mut self,
        shares: Vec<(String, f64)>,
        share_decisions: u64,
        now: f64,
        now_unix: f64,
    ) -> MeshMessage {
        let liveness = self.config.liveness_s;
        let mut replicas = vec![(self.me.clone(), 0.0)];
        replicas.extend(
            self.peers
                .values()
                .map(|p| (p.instance.clone(), now - p.last_heard))
                .filter(|(_, ago)| *ago <= liveness),
        );
        let live: HashSet<&str> = replicas.iter().map(|(r, _)| r.as_str()).collect();
        let peers_open = self
            .open
            .iter()
            .filter(|((peer, _), _)| live.contains(peer.as_str()))
            .map(|((peer, decision), o)| OpenEntry {
                replica: peer.clone(),
                decision: *decision,
                worker: o.worker.clone(),
                prompt_tokens: o.prompt_tokens,
                first_token: o.handle.first_token,
                block_hashes: o.block_hashes.clone(),
            });
        let mut open = Vec::new();
        let mut blocks = 0;
        for mut entry in self.own.values().cloned().chain(peers_open) {
            if open.len() == MAX_DECISIONS {
                break;
            }
            if blocks + entry.block_hashes.len() > MAX_BLOCKS {
                entry.block_hashes = Vec::new();
            }
            blocks += entry.block_hashes.len();
            open.push(entry);
        }
        let snapshot = Snapshot {
            shares,
            share_decisions,
            replicas,
            open,
        };
        self.adoption.last_answered = Some(now);
        self.stats.snapshots_sent += 1;
        self.message(MeshBody::Snapshot(snapshot), now, now_unix)
    }

    /// A peer's snapshot at `now`: adopted when this replica is fresh (see the module docs),
    /// ignored otherwise.
    pub(super) fn adopt(&mut self, snapshot: Snapshot, now: f64) -> Received<'_> {
        if !self.fresh(now) {
            return Received::Nothing;
        }
        let started = *self.adoption.started.get_or_insert(now);
        self.adoption.adopted_after = Some(now - started);
        self.stats.snapshots_adopted += 1;
        let liveness = self.config.liveness_s;
        let mut live = HashSet::new();
        for (instance, ago) in snapshot.replicas {
            if instance == self.me || !(0.0..=liveness).contains(&ago) {
                continue;
            }
            let heard = now - ago;
            let peer = self
                .peers
                .entry(instance.clone())
                .or_insert_with(|| PeerView {
                    instance: instance.clone(),
                    last_heard: heard,
                    ..PeerView::default()
                });
            peer.last_heard = peer.last_heard.max(heard);
            live.insert(instance);
        }
        let ended = std::mem::take(&mut self.adoption.ended);
        let room = self.config.max_open.saturating_sub(self.open.len());
        let mut seen = HashSet::new();
        let open: Vec<OpenEntry> = snapshot
            .open
            .into_iter()
            .filter(|e| {
                let key = (e.replica.clone(), e.decision);
                live.contains(&e.replica)
                    && !self.open.contains_key(&key)
                    && !ended.contains(&key)
                    && seen.insert(key)
            })
            .take(room)
            .collect();
        Received::Adopt {
            shares: snapshot.shares,
            share_decisions: snapshot.share_decisions,
            open,
        }
    }

    /// The router applied the decisions of an adopted snapshot at `now`, each as its handle
    /// (None: a worker it does not know): held until their `Finished` or expiry.
    pub fn adopted(
        &mut self,
        applied: impl IntoIterator<Item = (OpenEntry, Option<DecisionHandle>)>,
        now: f64,
    ) {
        for (entry, handle) in applied {
            let Some(handle) = handle else {
                self.stats.refused += 1;
                continue;
            };
            self.stats.adopted_decisions += 1;
            let open = OpenDecision {
                handle,
                expires: now + self.config.decision_ttl_s,
                worker: entry.worker,
                prompt_tokens: entry.prompt_tokens,
                block_hashes: entry.block_hashes,
            };
            self.open.insert((entry.replica, entry.decision), open);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::MeshConfig;
    use super::*;

    fn message(sender: &str, seq: u64, body: MeshBody) -> MeshMessage {
        MeshMessage {
            sender: sender.into(),
            seq,
            sent_unix_s: 0.0,
            body,
        }
    }

    fn wanted(started_unix_s: f64) -> MeshBody {
        MeshBody::SnapshotWanted { started_unix_s }
    }

    fn routed(decision: u64, worker: &str) -> MeshBody {
        MeshBody::Routed {
            decision,
            worker: worker.into(),
            block_hashes: vec![decision, 2],
            prompt_tokens: 40,
            output_tokens: 8,
            overlap: 0,
            prompt: Vec::new(),
            model: String::new(),
            cache_salt: String::new(),
        }
    }

    fn handle(slot: usize) -> DecisionHandle {
        DecisionHandle {
            decision: crate::routing::Decision {
                worker: slot,
                overlap: 0,
                prefill_tokens: 40,
                ticket: None,
            },
            first_token: false,
        }
    }

    /// `old`'s state after it made decisions 1 and 2 (2 got its first token), applied `p`'s
    /// decision 7 and `gone`'s decision 9, then stopped hearing `gone` at 10 s.
    fn settled_peer() -> Mesh {
        let mut old = Mesh::new("old", MeshConfig::default());
        assert!(old.ask_snapshot(0.0, 0.0).is_some());
        for body in [
            routed(1, "http://w0"),
            routed(2, "http://w1"),
            MeshBody::FirstToken { decision: 2 },
        ] {
            old.message(body, 1.0, 1.0);
        }
        for (peer, d) in [("p", 7), ("gone", 9)] {
            let Received::Routed { peer, decision, .. } =
                old.receive(2, message(peer, 1, routed(d, "http://w2")), 5.0, 5.0)
            else {
                panic!("a peer decision")
            };
            old.opened(peer, decision, Some(handle(2)), 5.0);
        }
        let _ = old.receive(2, message("p", 2, MeshBody::Heartbeat), 10.0, 10.0);
        old
    }

    #[test]
    fn a_settled_replica_answers_with_its_own_and_its_live_peers_open_decisions() {
        let mut old = settled_peer();
        assert!(!old.fresh(10.0), "two liveness windows after its start");
        assert!(
            old.ask_snapshot(10.0, 10.0).is_none(),
            "a settled replica asks nothing"
        );
        assert_eq!(
            old.receive(3, message("new", 1, wanted(9.0)), 10.0, 10.0),
            Received::SnapshotWanted
        );
        let reply = old.snapshot(vec![("http://w0".into(), 0.5)], 80, 10.0, 10.0);
        let MeshBody::Snapshot(s) = &reply.body else {
            panic!("a snapshot")
        };
        let mut open: Vec<(&str, u64, bool, usize)> = s
            .open
            .iter()
            .map(|e| {
                let hashes = e.block_hashes.len();
                (e.replica.as_str(), e.decision, e.first_token, hashes)
            })
            .collect();
        open.sort();
        // Decision 2's hashes went at its first token; "gone" (silent for 5 s) is left out.
        assert_eq!(
            open,
            [
                ("old", 1, false, 2),
                ("old", 2, true, 0),
                ("p", 7, false, 2)
            ]
        );
        let mut replicas: Vec<&str> = s.replicas.iter().map(|(r, _)| r.as_str()).collect();
        replicas.sort();
        assert_eq!(replicas, ["new", "old", "p"]);
        assert_eq!(old.stats().snapshots_sent, 1);
        // One broadcast serves the requests of the next 100 ms.
        assert_eq!(
            old.receive(3, message("new", 2, wanted(9.0)), 10.05, 10.05),
            Received::Nothing
        );
    }

    #[test]
    fn a_fresh_replica_adopts_the_first_snapshot_once_without_what_it_has_seen() {
        let mut old = settled_peer();
        let mut new = Mesh::new("new", MeshConfig::default());
        assert!(new.fresh(20.0));
        assert!(new.ask_snapshot(20.0, 20.0).is_some());
        assert!(
            new.ask_snapshot(20.1, 20.1).is_none(),
            "one request per 200 ms"
        );
        // A fresh replica does not answer one that started before it, but one after it.
        assert_eq!(
            new.receive(5, message("older", 1, wanted(19.0)), 20.1, 20.1),
            Received::Nothing
        );
        assert_eq!(
            new.receive(6, message("younger", 1, wanted(20.05)), 20.1, 20.1),
            Received::SnapshotWanted
        );
        // Before the snapshot: old's decision 1 ended (its Finished came first).
        old.message(MeshBody::Finished { decision: 1 }, 10.0, 10.0);
        let _ = new.receive(
            1,
            message("old", 1, MeshBody::Finished { decision: 1 }),
            20.2,
            20.2,
        );
        let mut reply = old.snapshot(vec![("http://w0".into(), 0.5)], 80, 10.0, 10.0);
        // A stale snapshot taken before that end still lists it: it must not open here.
        if let MeshBody::Snapshot(s) = &mut reply.body {
            s.open.push(OpenEntry {
                replica: "old".into(),
                decision: 1,
                worker: "http://w0".into(),
                ..OpenEntry::default()
            });
        }
        reply.seq = 2;
        let Received::Adopt {
            shares,
            share_decisions,
            open,
        } = new.receive(1, reply.clone(), 20.3, 20.3)
        else {
            panic!("adopted")
        };
        assert_eq!((shares.len(), share_decisions), (1, 80));
        let mut keys: Vec<(String, u64)> = open
            .iter()
            .map(|e| (e.replica.clone(), e.decision))
            .collect();
        keys.sort();
        assert_eq!(keys, [("old".into(), 2), ("p".into(), 7)]);
        assert!((new.adopted_after().unwrap() - 0.3).abs() < 1e-9);
        new.adopted(open.into_iter().map(|e| (e, Some(handle(0)))), 20.3);
        assert_eq!(new.open_decisions(), 2);
        assert_eq!(new.stats().adopted_decisions, 2);
        // "p", unheard here yet, is live as old saw it: its end releases its decision.
        assert!(new.peers().any(|p| p.instance == "p"));
        let end = message("p", 5, MeshBody::Finished { decision: 7 });
        assert!(matches!(
            new.receive(4, end, 20.4, 20.4),
            Received::Finished(_)
        ));
        // Once only.
        reply.seq = 3;
        assert_eq!(new.receive(1, reply, 20.5, 20.5), Received::Nothing);
        assert_eq!(new.stats().snapshots_adopted, 1);
        assert!(!new.fresh(20.5));
    }

    #[test]
    fn a_late_snapshot_is_ignored() {
        let mut old = settled_peer();
        let mut new = Mesh::new("new", MeshConfig::default());
        assert!(new.ask_snapshot(0.0, 0.0).is_some());
        assert!(
            new.ask_snapshot(6.5, 6.5).is_none(),
            "past two liveness windows"
        );
        let reply = old.snapshot(Vec::new(), 0, 10.0, 10.0);
        assert_eq!(new.receive(1, reply, 6.5, 6.5), Received::Nothing);
        assert_eq!(new.open_decisions(), 0);
    }

    #[test]
    fn a_snapshot_is_bounded() {
        let mut old = Mesh::new("old", MeshConfig::default());
        for d in 0..(MAX_DECISIONS as u64 + 10) {
            let mut body = routed(d, "http://w0");
            if let MeshBody::Routed { block_hashes, .. } = &mut body {
                *block_hashes = vec![d; 100];
            }
            old.message(body, 0.0, 0.0);
        }
        let reply = old.snapshot(Vec::new(), 0, 0.0, 0.0);
        let MeshBody::Snapshot(s) = &reply.body else {
            panic!("a snapshot")
        };
        assert_eq!(s.open.len(), MAX_DECISIONS);
        let blocks: usize = s.open.iter().map(|e| e.block_hashes.len()).sum();
        assert!(blocks <= MAX_BLOCKS, "{blocks}");
        assert!(reply.encode().len() < 4 << 20);
    }
}
