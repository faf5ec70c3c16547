//! Every case of the subscriber's sequence logic, without sockets.

use super::*;

fn payload(seq: u64) -> Vec<u8> {
    format!("batch {seq}").into_bytes()
}

/// Feed live `seq` (its usual payload) through the fast path, else the full one.
fn live(t: &mut SequenceTracker, seq: u64) -> Vec<Action> {
    live_bytes(t, seq, &payload(seq))
}

fn live_bytes(t: &mut SequenceTracker, seq: u64, bytes: &[u8]) -> Vec<Action> {
    if t.in_order(seq) {
        return vec![Action::Live { seq }];
    }
    let mut out = Vec::new();
    t.live(seq, bytes, &mut out);
    out
}

fn answer(seqs: &[u64]) -> Vec<(u64, Vec<u8>)> {
    seqs.iter().map(|&s| (s, payload(s))).collect()
}

fn replay_done(t: &mut SequenceTracker, seqs: &[u64], failure: Option<&str>) -> Vec<Action> {
    let mut out = Vec::new();
    t.replay_done(&answer(seqs), failure.map(String::from), &mut out);
    out
}

fn catch_up(t: &mut SequenceTracker, seqs: &[u64]) -> Vec<Action> {
    let mut out = Vec::new();
    t.catch_up_done(&answer(seqs), &mut out);
    out
}

use Action::*;

#[test]
fn in_order_batches_take_the_fast_path() {
    let mut t = SequenceTracker::new();
    assert_eq!(t.last_seq(), None);
    for seq in 0..5 {
        assert!(t.in_order(seq));
    }
    assert_eq!(t.last_seq(), Some(4));
    assert!(!t.in_order(4) && !t.in_order(6) && !t.in_order(0));
    assert_eq!(t.last_seq(), Some(4)); // a refused message changes nothing
}

#[test]
fn a_gap_is_filled_by_replay_and_duplicates_are_skipped() {
    let mut t = SequenceTracker::new();
    assert_eq!(live(&mut t, 0), [Live { seq: 0 }]);
    assert_eq!(
        live(&mut t, 3),
        [
            Gap {
                expected: 1,
                got: 3
            },
            Replay { from: 1 }
        ]
    );
    assert!(t.awaiting_replay() && !t.in_order(1));
    // The engine already published 4 when it answers.
    assert_eq!(
        replay_done(&mut t, &[1, 2, 3, 4], None),
        [
            Replayed { seq: 1, index: 0 },
            Replayed { seq: 2, index: 1 },
            Live { seq: 3 },
            Replayed { seq: 4, index: 3 }
        ]
    );
    assert_eq!(live(&mut t, 4), []); // the live copy of a replayed batch
    assert_eq!(live(&mut t, 5), [Live { seq: 5 }]);
    assert_eq!(t.last_seq(), Some(5));
}

#[test]
fn a_gap_without_replay_reports_replay_failed_then_continues() {
    let mut t = SequenceTracker::new();
    live(&mut t, 0);
    assert_eq!(
        live(&mut t, 2),
        [
            Gap {
                expected: 1,
                got: 2
            },
            Replay { from: 1 }
        ]
    );
    assert_eq!(
        replay_done(&mut t, &[], Some("no replay endpoint configured")),
        [
            ReplayFailed {
                expected: 1,
                got: 2,
                reason: "no replay endpoint configured".into()
            },
            Live { seq: 2 }
        ]
    );
    assert_eq!(live(&mut t, 3), [Live { seq: 3 }]);
}

#[test]
fn a_failure_after_part_of_the_answer_delivers_none_of_it() {
    let mut t = SequenceTracker::new();
    live(&mut t, 0);
    live(&mut t, 5);
    let out = replay_done(&mut t, &[1, 2], Some("no reply within 1s"));
    assert_eq!(
        out,
        [
            ReplayFailed {
                expected: 1,
                got: 5,
                reason: "no reply within 1s".into()
            },
            Live { seq: 5 }
        ]
    );
}

#[test]
fn a_replay_that_does_not_cover_the_gap_says_why() {
    let cases: [(&[u64], &str); 4] = [
        (&[3], "replay buffer starts at 3, not 1"),
        (&[], "replay returned nothing older than the live batch"),
        (&[1, 3], "replay skipped sequence numbers"),
        (&[1, 2], "replay skipped sequence numbers"), // 3 missing
    ];
    for (seqs, reason) in cases {
        let mut t = SequenceTracker::new();
        live(&mut t, 0);
        live(&mut t, 4);
        let out = replay_done(&mut t, seqs, None);
        assert_eq!(
            out[0],
            ReplayFailed {
                expected: 1,
                got: 4,
                reason: reason.into()
            },
            "{seqs:?}"
        );
        assert_eq!(out[1], Live { seq: 4 });
        assert_eq!(t.last_seq(), Some(4));
    }
}

#[test]
fn after_a_failed_replay_newer_replayed_batches_still_come_once() {
    let mut t = SequenceTracker::new();
    live(&mut t, 0);
    live(&mut t, 4);
    let out = replay_done(&mut t, &[3, 4, 5, 6], None);
    assert_eq!(
        out[1..],
        [
            Live { seq: 4 },
            Replayed { seq: 5, index: 2 },
            Replayed { seq: 6, index: 3 }
        ]
    );
    assert_eq!(live(&mut t, 5), []);
    assert_eq!(live(&mut t, 6), []);
    assert_eq!(live(&mut t, 7), [Live { seq: 7 }]);
}

#[test]
fn the_sequence_going_back_is_a_restart() {
    let mut t = SequenceTracker::new();
    for seq in 0..6 {
        live(&mut t, seq);
    }
    assert_eq!(
        live(&mut t, 0),
        [
            Restarted {
                last_seq: Some(5),
                new_seq: 0
            },
            Live { seq: 0 }
        ]
    );
    assert_eq!(live(&mut t, 1), [Live { seq: 1 }]);
    // Back to a seq above 0: a restart, then the new engine's gap.
    assert_eq!(
        live(&mut t, 0),
        [
            Restarted {
                last_seq: Some(1),
                new_seq: 0
            },
            Live { seq: 0 }
        ]
    );
    live(&mut t, 1);
    live(&mut t, 2);
    assert_eq!(
        live(&mut t, 1),
        [
            Restarted {
                last_seq: Some(2),
                new_seq: 1
            },
            Gap {
                expected: 0,
                got: 1
            },
            Replay { from: 0 }
        ]
    );
}

#[test]
fn catch_up_hands_over_the_buffer_and_skips_its_live_copies() {
    let mut t = SequenceTracker::new();
    assert_eq!(
        catch_up(&mut t, &[0, 1, 2]),
        [
            Replayed { seq: 0, index: 0 },
            Replayed { seq: 1, index: 1 },
            Replayed { seq: 2, index: 2 }
        ]
    );
    assert_eq!(live(&mut t, 2), []);
    assert_eq!(live(&mut t, 3), [Live { seq: 3 }]);
}

#[test]
fn an_engine_restarted_after_the_catch_up_is_not_taken_for_duplicates() {
    let mut t = SequenceTracker::new();
    catch_up(&mut t, &[0, 1, 2]);
    assert_eq!(
        live_bytes(&mut t, 0, b"the new engine's batch 0"),
        [
            Restarted {
                last_seq: Some(2),
                new_seq: 0
            },
            Live { seq: 0 }
        ]
    );
    assert_eq!(live(&mut t, 1), [Live { seq: 1 }]);
}

#[test]
fn catch_up_from_a_wrapped_buffer_reports_the_loss_then_delivers_the_rest() {
    let mut t = SequenceTracker::new();
    assert_eq!(
        catch_up(&mut t, &[5, 6]),
        [
            ReplayFailed {
                expected: 0,
                got: 5,
                reason: "replay buffer starts at 5, not 0".into()
            },
            Replayed { seq: 5, index: 0 },
            Replayed { seq: 6, index: 1 }
        ]
    );
    assert_eq!(live(&mut t, 7), [Live { seq: 7 }]);
}

#[test]
fn catch_up_stops_at_a_hole_and_an_empty_one_changes_nothing() {
    let mut t = SequenceTracker::new();
    assert_eq!(catch_up(&mut t, &[]), []);
    assert_eq!(t.last_seq(), None);
    assert_eq!(catch_up(&mut t, &[0, 1, 3]).len(), 2);
    assert_eq!(
        live(&mut t, 4),
        [
            Gap {
                expected: 2,
                got: 4
            },
            Replay { from: 2 }
        ]
    );
}

#[test]
fn jumps_of_any_size_cost_nothing_and_do_not_overflow() {
    let mut t = SequenceTracker::new();
    live(&mut t, 0);
    assert_eq!(
        live(&mut t, 1_000_000_000),
        [
            Gap {
                expected: 1,
                got: 1_000_000_000
            },
            Replay { from: 1 }
        ]
    );
    replay_done(&mut t, &[], None);
    assert_eq!(
        live(&mut t, u64::MAX),
        [
            Gap {
                expected: 1_000_000_001,
                got: u64::MAX
            },
            Replay {
                from: 1_000_000_001
            }
        ]
    );
    let out = replay_done(&mut t, &[1_000_000_001, 1_000_000_002], None);
    assert_eq!(
        out,
        [
            ReplayFailed {
                expected: 1_000_000_001,
                got: u64::MAX,
                reason: "replay skipped sequence numbers".into()
            },
            Live { seq: u64::MAX }
        ]
    );
    assert_eq!(t.last_seq(), Some(u64::MAX));
    assert!(!t.in_order(u64::MAX));
    // Nothing follows 2^64 - 1: the same seq again can only be a new engine.
    assert_eq!(
        live(&mut t, u64::MAX),
        [
            Restarted {
                last_seq: Some(u64::MAX),
                new_seq: u64::MAX
            },
            Gap {
                expected: 0,
                got: u64::MAX
            },
            Replay { from: 0 }
        ]
    );
    // A replay answer that covers a huge gap is checked by walking the answer only.
    let mut t = SequenceTracker::new();
    live(&mut t, 0);
    live(&mut t, 1 << 40);
    let out = replay_done(&mut t, &[(1 << 40) - 1], None);
    assert!(
        matches!(&out[0], ReplayFailed { reason, .. } if reason.starts_with("replay buffer starts at"))
    );
    assert_eq!(
        std::mem::size_of::<SequenceTracker>(),
        std::mem::size_of_val(&t)
    );
    assert!(t.replayed.is_empty());
}

#[test]
fn malformed_framing_is_reported_and_changes_nothing() {
    let mut t = SequenceTracker::new();
    live(&mut t, 0);
    let mut out = Vec::new();
    t.live_message(&[b"", b"short"], &mut out);
    t.live_message(&[b"kv", b"1234567", b"x"], &mut out);
    assert_eq!(
        out,
        [
            MalformedFrames {
                frame_lengths: vec![0, 5]
            },
            MalformedFrames {
                frame_lengths: vec![2, 7, 1]
            }
        ]
    );
    out.clear();
    let seq = 1u64.to_be_bytes();
    t.live_message(&[b"kv", &seq, b"batch 1"], &mut out);
    assert_eq!(out, [Live { seq: 1 }]);
    assert_eq!(parse_seq(&u64::MAX.to_be_bytes()), Some(u64::MAX));
    assert_eq!(parse_seq(b"short"), None);
}

#[test]
#[should_panic(expected = "a replay's answer is awaited")]
fn feeding_live_batches_while_a_replay_is_pending_is_a_bug() {
    let mut t = SequenceTracker::new();
    live(&mut t, 0);
    live(&mut t, 2);
    live(&mut t, 3);
}
