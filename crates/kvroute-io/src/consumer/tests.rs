//! The consumer against libzmq peers on 127.0.0.1 ephemeral ports: an XPUB standing for the
//! engine's PUB (so a test knows when the subscription arrived) and a ROUTER answering replays
//! from a buffer, in current vLLM's framing. (Interop with pyzmq and the emulator's publisher
//! is tested from Python: tests/test_kvevents.py, tests/test_proxy_events.py.)

use std::sync::atomic::AtomicBool;
use std::thread;

use kvroute_core::blocks::{BlockHasher, DEFAULT_HASH_SEED};
use kvroute_core::engine::events::{BlockStored, EventBatch, KvCacheEvent};
use kvroute_core::kvevents::codec::{WireFormat, encode_batch};

use super::*;

const BS: usize = 16;

/// The batches an engine keeps for replay: `(seq, payload)`.
type ReplayBuffer = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

/// A scripted engine: XPUB live socket and a ROUTER replay socket served by a thread.
struct Engine {
    ctx: zmq::Context,
    publisher: zmq::Socket,
    endpoint: String,
    replay_endpoint: String,
    buffer: ReplayBuffer,
    /// False: the ROUTER never answers.
    answering: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    server: Option<thread::JoinHandle<()>>,
}

impl Engine {
    fn new() -> Self {
        let ctx = zmq::Context::new();
        let publisher = ctx.socket(zmq::XPUB).unwrap();
        publisher.set_linger(0).unwrap();
        publisher.bind("tcp://127.0.0.1:*").unwrap();
        let endpoint = publisher.get_last_endpoint().unwrap().unwrap();
        let router = ctx.socket(zmq::ROUTER).unwrap();
        router.set_linger(0).unwrap();
        router.bind("tcp://127.0.0.1:*").unwrap();
        let replay_endpoint = router.get_last_endpoint().unwrap().unwrap();
        let buffer: ReplayBuffer = Arc::default();
        let answering = Arc::new(AtomicBool::new(true));
        let stop = Arc::new(AtomicBool::new(false));
        let (b, a, s) = (buffer.clone(), answering.clone(), stop.clone());
        let server = thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                if router.poll(zmq::POLLIN, 20).unwrap() == 0 {
                    continue;
                }
                let frames = router.recv_multipart(0).unwrap();
                if !a.load(Ordering::Relaxed) {
                    continue;
                }
                let start = sequence::parse_seq(&frames[2]).unwrap();
                for (seq, payload) in lock(&b).iter().filter(|(s, _)| *s >= start) {
                    let reply: [&[u8]; 5] = [&frames[0], b"", b"", &seq.to_be_bytes(), payload];
                    router.send_multipart(reply, 0).unwrap();
                }
                let end: [&[u8]; 5] = [&frames[0], b"", b"", &END_SEQ, b""];
                router.send_multipart(end, 0).unwrap();
            }
        });
        Self {
            ctx,
            publisher,
            endpoint,
            replay_endpoint,
            buffer,
            answering,
            stop,
            server: Some(server),
        }
    }

    fn wait_subscribed(&self) {
        assert!(
            self.publisher.poll(zmq::POLLIN, 5000).unwrap() > 0,
            "no subscription"
        );
        let subscription = self.publisher.recv_bytes(0).unwrap();
        assert_eq!(subscription[0], 1);
    }

    /// Publish `payload` as batch `seq` (live unless `live` is false) and keep it for replay.
    fn send(&self, seq: u64, payload: &[u8], live: bool) {
        lock(&self.buffer).push((seq, payload.to_vec()));
        if live {
            let frames: [&[u8]; 3] = [b"", &seq.to_be_bytes(), payload];
            self.publisher.send_multipart(frames, 0).unwrap();
        }
    }

    fn subscription(&self) -> Subscription {
        Subscription {
            endpoint: self.endpoint.clone(),
            replay_endpoint: Some(self.replay_endpoint.clone()),
            topic: Vec::new(),
            bind: false,
            replay_timeout: Duration::from_millis(300),
            catch_up: true,
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(server) = self.server.take() {
            server.join().unwrap();
        }
        let _ = &self.ctx;
    }
}

/// A batch storing `blocks` chained blocks of tokens from `first_token` (engine hashes from
/// `first_hash`, chained onto `parent`).
fn stored(first_token: u32, blocks: usize, first_hash: u64, parent: Option<u64>) -> Vec<u8> {
    let tokens: Vec<i64> = (first_token..first_token + (blocks * BS) as u32)
        .map(i64::from)
        .collect();
    let hashes = (first_hash..first_hash + blocks as u64).collect();
    let event = KvCacheEvent::Stored(BlockStored::plain(hashes, parent, tokens, BS));
    let batch = EventBatch {
        ts: 0.0,
        events: vec![event],
        data_parallel_rank: None,
    };
    encode_batch(&batch, WireFormat::Map)
}

fn index() -> SharedIndex {
    let hasher = BlockHasher::new(BS, DEFAULT_HASH_SEED).unwrap();
    Arc::new(Mutex::new(
        KvIndex::new(hasher, Some(2.0), None, None).unwrap(),
    ))
}

/// Leading blocks of the prompt `first_token..` (`blocks` long) that `worker` holds.
fn held(index: &SharedIndex, first_token: u32, blocks: usize) -> usize {
    let hasher = BlockHasher::new(BS, DEFAULT_HASH_SEED).unwrap();
    let tokens: Vec<u32> = (first_token..first_token + (blocks * BS) as u32).collect();
    let hashes = hasher.hash_blocks(&tokens, None, 0, None);
    lock_index(index).overlaps(&hashes, &["w"], 0.0)[0]
}

fn until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !condition() {
        assert!(Instant::now() < deadline, "not reached in time: {what}");
        thread::sleep(Duration::from_millis(5));
    }
}

fn counts(consumer: &Consumer) -> CounterSnapshot {
    consumer
        .counters()
        .into_iter()
        .find(|(w, _)| w == "w")
        .map(|(_, c)| c)
        .unwrap_or_default()
}

#[test]
fn catch_up_live_and_a_gap_filled_by_replay_reach_the_index() {
    let engine = Engine::new();
    engine.send(0, &stored(100, 2, 1000, None), false); // before the router: replayed
    let index = index();
    let consumer = Consumer::start(Some(index.clone()), Duration::from_millis(1)).unwrap();
    consumer.add_worker("w", engine.subscription()).unwrap();
    engine.wait_subscribed();
    until("the catch-up", || held(&index, 100, 2) == 2);
    engine.send(1, &stored(132, 2, 1002, Some(1001)), false); // dropped on the way
    engine.send(2, &stored(900, 3, 2000, None), true);
    until("the live batch after the gap", || held(&index, 900, 3) == 3);
    assert_eq!(
        held(&index, 100, 4),
        4,
        "the replayed batch chained onto the first"
    );
    let c = counts(&consumer);
    assert_eq!(
        (c.batches, c.events, c.gaps, c.replay_failures),
        (3, 3, 1, 0)
    );
    assert!(
        consumer.take_notices().is_empty(),
        "nothing reset the worker"
    );
    assert!(consumer.close(Duration::from_secs(2)));
}

#[test]
fn a_restart_and_a_malformed_batch_reset_the_worker_and_are_posted() {
    let engine = Engine::new();
    let index = index();
    let consumer = Consumer::start(Some(index.clone()), Duration::ZERO).unwrap();
    consumer.add_worker("w", engine.subscription()).unwrap();
    engine.wait_subscribed();
    engine.send(0, &stored(100, 2, 1000, None), true);
    until("batch 0", || held(&index, 100, 2) == 2);
    lock(&engine.buffer).clear(); // the new engine's buffer
    engine.send(0, &stored(900, 3, 2000, None), true);
    until("the new engine's batch", || held(&index, 900, 3) == 3);
    assert_eq!(held(&index, 100, 2), 0);
    engine.send(1, b"\xc1 not msgpack", true);
    until("the malformed batch", || counts(&consumer).malformed == 1);
    assert_eq!(held(&index, 900, 3), 0);
    let notices = consumer.take_notices();
    assert!(matches!(
        notices[0].item,
        Item::Restarted {
            last_seq: Some(0),
            new_seq: 0
        }
    ));
    assert!(matches!(
        notices[1].item,
        Item::Malformed { seq: Some(1), .. }
    ));
    assert_eq!(counts(&consumer).restarts, 1);
}

#[test]
fn outbox_mode_posts_every_item_and_a_silent_replay_times_out() {
    let engine = Engine::new();
    engine.answering.store(false, Ordering::Relaxed);
    let consumer = Consumer::start(None, Duration::ZERO).unwrap();
    consumer.add_worker("w", engine.subscription()).unwrap();
    engine.wait_subscribed();
    engine.send(0, &stored(100, 1, 1000, None), true);
    engine.send(5, &stored(200, 1, 1001, None), true);
    let mut items = Vec::new();
    until("four items", || {
        items.extend(consumer.take_notices().into_iter().map(|n| n.item));
        items.len() >= 4
    });
    assert!(matches!(
        items[0],
        Item::Batch {
            seq: 0,
            replayed: false,
            ..
        }
    ));
    assert!(matches!(
        items[1],
        Item::Gap {
            expected: 1,
            got: 5
        }
    ));
    match &items[2] {
        Item::ReplayFailed {
            expected: 1,
            got: 5,
            reason,
        } => {
            assert!(reason.contains("no reply"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        items[3],
        Item::Batch {
            seq: 5,
            replayed: false,
            ..
        }
    ));
}

#[test]
fn close_is_bounded_with_a_replay_pending_and_an_unreachable_engine() {
    let engine = Engine::new();
    engine.answering.store(false, Ordering::Relaxed);
    let consumer = Consumer::start(Some(index()), Duration::ZERO).unwrap();
    let mut silent = engine.subscription();
    silent.replay_timeout = Duration::from_secs(3600);
    consumer.add_worker("w", silent).unwrap();
    let nowhere = Subscription {
        endpoint: "tcp://127.0.0.1:9".into(),
        replay_endpoint: Some("tcp://127.0.0.1:9".into()),
        ..engine.subscription()
    };
    consumer.add_worker("gone", nowhere).unwrap();
    engine.wait_subscribed();
    let started = Instant::now();
    assert!(consumer.close(Duration::from_secs(2)));
    assert!(started.elapsed() < Duration::from_millis(500));
    assert!(consumer.close(Duration::from_secs(2)), "idempotent");
    assert!(
        consumer.add_worker("late", engine.subscription()).is_err(),
        "a stopped consumer refuses workers"
    );
}

#[test]
fn a_malformed_address_fails_at_once() {
    let consumer = Consumer::start(None, Duration::ZERO).unwrap();
    let bad = Subscription {
        endpoint: "localhost:5557".into(),
        replay_endpoint: None,
        topic: Vec::new(),
        bind: false,
        replay_timeout: Duration::from_secs(1),
        catch_up: false,
    };
    let error = consumer.add_worker("w", bad).unwrap_err();
    assert!(
        error.contains("cannot subscribe to localhost:5557"),
        "{error}"
    );
}
