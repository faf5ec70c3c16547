//! The consumer against scripted engines on 127.0.0.1 ephemeral ports, speaking ZMTP through
//! this crate's codec in the engine's roles: a PUB that tells a test when a subscription
//! arrived, and a ROUTER answering replays from a buffer in current vLLM's framing. (Interop
//! with libzmq itself, pyzmq's PUB and ROUTER as vLLM uses them, is tested from Python:
//! tests/emulator/test_kvevents.py, tests/serve/test_serve_events.py, tests/serve/test_faults.py.)

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use kvroute_core::blocks::{BlockHasher, DEFAULT_HASH_SEED};
use kvroute_core::index::KvIndex;
use kvroute_core::kvevents::codec::{WireFormat, encode_batch};
use kvroute_core::kvevents::events::{BlockStored, EventBatch, KvCacheEvent};
use kvroute_core::kvevents::sequence;

use super::replay::END_SEQ;
use super::shared::lock;
use super::sockets::{Dialer, RECONNECT_IVL, RECONNECT_MAX, RECONNECT_QUICK_ATTEMPTS};
use super::*;
use crate::zmtp::{Codec, Event, SocketType};

const BS: usize = 16;

/// The batches an engine keeps for replay: `(seq, payload)`.
type ReplayBuffer = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

/// Messages (frames copied) read from `stream` through `codec` until `done` says enough.
fn read_until(
    stream: &mut TcpStream,
    codec: &mut Codec,
    mut done: impl FnMut(&[Vec<u8>]) -> bool,
) -> Option<Vec<Vec<u8>>> {
    let mut buf = [0u8; 4096];
    loop {
        loop {
            match codec.next_event() {
                Ok(Some(Event::Message(m))) => {
                    let frames: Vec<Vec<u8>> = m.frames().map(<[u8]>::to_vec).collect();
                    if done(&frames) {
                        // What the peer's bytes released goes out first: a greeting, READY
                        // and subscription read in one go leave this side's READY queued,
                        // and a consumer never sent it would never start its catch-up.
                        return flush(stream, codec).then_some(frames);
                    }
                }
                Ok(Some(Event::Ready { .. })) => {}
                Ok(None) => break,
                Err(_) => return None,
            }
        }
        if !flush(stream, codec) {
            return None;
        }
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return None,
            Ok(n) => codec.receive(&buf[..n]),
        }
    }
}

fn flush(stream: &mut TcpStream, codec: &mut Codec) -> bool {
    let ok = stream.write_all(codec.outgoing()).is_ok();
    codec.sent(usize::MAX);
    ok
}

/// Accept connections on `listener` until `stop`, handing each to `serve` on its own thread.
fn accept_loop(
    listener: TcpListener,
    stop: Arc<AtomicBool>,
    serve: impl Fn(TcpStream) + Send + Sync + 'static,
) -> thread::JoinHandle<()> {
    listener.set_nonblocking(true).unwrap();
    let serve = Arc::new(serve);
    thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            match listener.accept() {
                Ok((stream, _)) => {
                    stream.set_nonblocking(false).unwrap();
                    let serve = serve.clone();
                    thread::spawn(move || serve(stream));
                }
                Err(_) => thread::sleep(Duration::from_millis(5)),
            }
        }
    })
}

/// A scripted engine: a PUB and a ROUTER replay socket, each served by threads.
struct Engine {
    port: u16,
    replay_endpoint: String,
    /// Subscribed connections of the PUB.
    subscribers: Arc<Mutex<Vec<(TcpStream, Codec)>>>,
    buffer: ReplayBuffer,
    /// False: the ROUTER never answers.
    answering: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    threads: Vec<thread::JoinHandle<()>>,
}

impl Engine {
    fn new() -> Self {
        Self::on_port(0)
    }

    fn on_port(port: u16) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let publisher = TcpListener::bind(("127.0.0.1", port)).unwrap();
        let port = publisher.local_addr().unwrap().port();
        let subscribers: Arc<Mutex<Vec<(TcpStream, Codec)>>> = Arc::default();
        let subs = subscribers.clone();
        let pub_thread = accept_loop(publisher, stop.clone(), move |mut stream| {
            let mut codec = Codec::new(SocketType::Pub, MAX_MESSAGE);
            if !flush(&mut stream, &mut codec) {
                return;
            }
            // The subscription: a one-frame message starting with 1.
            if read_until(&mut stream, &mut codec, |f| {
                f.len() == 1 && f[0].first() == Some(&1)
            })
            .is_some()
            {
                lock(&subs).push((stream, codec));
            }
        });
        let router = TcpListener::bind("127.0.0.1:0").unwrap();
        let replay_endpoint = format!("tcp://{}", router.local_addr().unwrap());
        let buffer: ReplayBuffer = Arc::default();
        let answering = Arc::new(AtomicBool::new(true));
        let (b, a) = (buffer.clone(), answering.clone());
        let router_thread = accept_loop(router, stop.clone(), move |mut stream| {
            let mut codec = Codec::new(SocketType::Router, MAX_MESSAGE);
            if !flush(&mut stream, &mut codec) {
                return;
            }
            let Some(request) = read_until(&mut stream, &mut codec, |_| true) else {
                return;
            };
            assert_eq!(request.len(), 2, "a DEALER's request is [b\"\", seq]");
            assert!(request[0].is_empty());
            if !a.load(Ordering::Relaxed) {
                let _ = read_until(&mut stream, &mut codec, |_| false); // until closed
                return;
            }
            let start = sequence::parse_seq(&request[1]).unwrap();
            for (seq, payload) in lock(&b).iter().filter(|(s, _)| *s >= start) {
                codec.send_message(&[b"", b"", &seq.to_be_bytes(), payload]);
            }
            codec.send_message(&[b"", b"", &END_SEQ, b""]);
            flush(&mut stream, &mut codec);
            let _ = read_until(&mut stream, &mut codec, |_| false);
        });
        Self {
            port,
            replay_endpoint,
            subscribers,
            buffer,
            answering,
            stop,
            threads: vec![pub_thread, router_thread],
        }
    }

    fn wait_subscribed(&self) {
        until("a subscription", || !lock(&self.subscribers).is_empty());
    }

    /// Publish `payload` as batch `seq` (live unless `live` is false) and keep it for replay.
    fn send(&self, seq: u64, payload: &[u8], live: bool) {
        lock(&self.buffer).push((seq, payload.to_vec()));
        if live {
            self.send_frames(&[b"", &seq.to_be_bytes(), payload]);
        }
    }

    /// Publish several batches in one write (and keep them for replay).
    fn send_together(&self, batches: &[(u64, Vec<u8>)]) {
        lock(&self.buffer).extend(batches.iter().cloned());
        for (stream, codec) in lock(&self.subscribers).iter_mut() {
            for (seq, payload) in batches {
                codec.send_message(&[b"", &seq.to_be_bytes(), payload]);
            }
            flush(stream, codec);
        }
    }

    fn send_frames(&self, frames: &[&[u8]]) {
        for (stream, codec) in lock(&self.subscribers).iter_mut() {
            codec.send_message(frames);
            flush(stream, codec);
        }
    }

    fn subscription(&self) -> Subscription {
        Subscription {
            endpoint: format!("tcp://127.0.0.1:{}", self.port),
            replay_endpoint: Some(self.replay_endpoint.clone()),
            topic: Vec::new(),
            bind: false,
            // Long enough for a test engine starved of CPU (CI runs the tests in parallel on
            // two cores): these tests expect their replays answered; the ones about a silent
            // replay set their own.
            replay_timeout: Duration::from_secs(3),
            catch_up: true,
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for (stream, _) in lock(&self.subscribers).drain(..) {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
        for thread in self.threads.drain(..) {
            thread.join().unwrap();
        }
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
fn a_batch_behind_a_gap_in_the_same_read_waits_for_the_replay_then_follows() {
    let engine = Engine::new();
    let index = index();
    let consumer = Consumer::start(Some(index.clone()), Duration::from_millis(5)).unwrap();
    consumer.add_worker("w", engine.subscription()).unwrap();
    engine.wait_subscribed();
    engine.send(0, &stored(100, 1, 1000, None), true);
    until("batch 0", || counts(&consumer).batches == 1);
    engine.send(1, &stored(116, 1, 1001, Some(1000)), false); // lost on the way
    // 2 and 3 in one write: 2 shows the gap, 3 is already in the connection's buffer while
    // the replay runs, and must be taken once it answered (no more bytes come to wake it).
    engine.send_together(&[
        (2, stored(132, 1, 1002, Some(1001))),
        (3, stored(148, 1, 1003, Some(1002))),
    ]);
    // The index, not the counters: a turn counts its batches as it decodes them and applies
    // them to the index at its end.
    until("batch 3 in the index", || held(&index, 100, 4) == 4);
    let c = counts(&consumer);
    assert_eq!(c.batches, 4);
    assert_eq!((c.gaps, c.replay_failures, c.restarts), (1, 0, 0));
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
fn an_engine_that_dies_and_comes_back_on_its_port_is_followed_again() {
    let engine = Engine::new();
    let port = engine.port;
    let index = index();
    let consumer = Consumer::start(Some(index.clone()), Duration::from_millis(1)).unwrap();
    let mut subscription = engine.subscription();
    subscription.replay_endpoint = None;
    consumer.add_worker("w", subscription).unwrap();
    engine.wait_subscribed();
    engine.send(0, &stored(100, 2, 1000, None), true);
    engine.send(1, &stored(132, 2, 1002, Some(1001)), true);
    until("batches 0 and 1", || counts(&consumer).batches == 2);
    drop(engine); // the connection closes; the consumer retries (refused) with backoff
    thread::sleep(Duration::from_millis(400));
    let engine = Engine::on_port(port);
    engine.wait_subscribed();
    engine.send(0, &stored(900, 3, 2000, None), true);
    until("the new engine's batch", || held(&index, 900, 3) == 3);
    assert_eq!(held(&index, 100, 2), 0, "the restart reset the worker");
    assert_eq!(counts(&consumer).restarts, 1);
    assert!(consumer.close(Duration::from_secs(2)));
}

/// A steady stream read by gathering turns that skip the poll: every batch reaches the index,
/// an engine that dies between two windows is noticed by the read (the peer's close) and
/// followed again, and a close while batches flow is bounded.
#[test]
fn gathering_turns_without_a_poll_take_every_batch_and_notice_a_close() {
    let engine = Engine::new();
    let port = engine.port;
    let index = index();
    let consumer = Consumer::start(Some(index.clone()), Duration::from_millis(3)).unwrap();
    let mut subscription = engine.subscription();
    subscription.replay_endpoint = None;
    consumer.add_worker("w", subscription).unwrap();
    engine.wait_subscribed();
    let mut parent = None;
    for seq in 0..60u64 {
        // One block per batch, each chained onto the last, a few per window.
        engine.send(
            seq,
            &stored(100 + 16 * seq as u32, 1, 1000 + seq, parent),
            true,
        );
        parent = Some(1000 + seq);
        thread::sleep(Duration::from_micros(700));
    }
    until("all 60 chained blocks", || held(&index, 100, 60) == 60);
    drop(engine);
    thread::sleep(Duration::from_millis(300));
    let engine = Engine::on_port(port);
    engine.wait_subscribed();
    engine.send(0, &stored(5000, 2, 9000, None), true);
    until("the new engine's batch", || held(&index, 5000, 2) == 2);
    assert_eq!(counts(&consumer).restarts, 1);
    for seq in 1..30u64 {
        engine.send(
            seq,
            &stored(6000 + 32 * seq as u32, 2, 9000 + 2 * seq, None),
            true,
        );
        thread::sleep(Duration::from_micros(500));
    }
    let started = Instant::now();
    assert!(consumer.close(Duration::from_secs(2)));
    assert!(started.elapsed() < Duration::from_secs(1));
}

#[test]
fn a_peer_that_is_not_zmtp_is_counted_and_its_connection_reset() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let server = accept_loop(listener, stop.clone(), |mut stream| {
        let _ = stream.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        thread::sleep(Duration::from_millis(200));
    });
    let consumer = Consumer::start(Some(index()), Duration::ZERO).unwrap();
    let subscription = Subscription {
        endpoint: endpoint.clone(),
        replay_endpoint: None,
        topic: Vec::new(),
        bind: false,
        replay_timeout: Duration::from_secs(1),
        catch_up: false,
    };
    consumer.add_worker("w", subscription).unwrap();
    until("the refusal", || counts(&consumer).malformed >= 1);
    let notices = consumer.take_notices();
    match &notices[0].item {
        Item::Malformed { seq: None, error } => {
            assert!(error.contains("not a ZMTP 3 peer"), "{error}");
            assert!(error.contains(&endpoint), "{error}");
        }
        other => panic!("{other:?}"),
    }
    until("a reconnect, refused again", || {
        counts(&consumer).malformed >= 2
    });
    assert!(consumer.close(Duration::from_secs(2)));
    stop.store(true, Ordering::Relaxed);
    server.join().unwrap();
}

#[test]
fn outbox_mode_posts_every_item_and_a_silent_replay_times_out() {
    let engine = Engine::new();
    engine.answering.store(false, Ordering::Relaxed);
    let consumer = Consumer::start(None, Duration::ZERO).unwrap();
    let mut subscription = engine.subscription();
    subscription.replay_timeout = Duration::from_millis(300);
    consumer.add_worker("w", subscription).unwrap();
    engine.wait_subscribed();
    thread::sleep(Duration::from_millis(400)); // the catch-up times out (300 ms)
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
fn a_bound_consumer_accepts_publishers_that_connect() {
    let consumer = Consumer::start(None, Duration::ZERO).unwrap();
    let subscription = Subscription {
        endpoint: "tcp://127.0.0.1:*".into(),
        replay_endpoint: None,
        topic: b"kv".to_vec(),
        bind: true,
        replay_timeout: Duration::from_secs(1),
        catch_up: false,
    };
    let endpoint = consumer.add_worker("w", subscription).unwrap();
    let address = endpoint.strip_prefix("tcp://").unwrap();
    assert!(
        !address.ends_with(":0") && !address.ends_with(":*"),
        "{endpoint}"
    );
    let mut stream = TcpStream::connect(address).unwrap();
    let mut codec = Codec::new(SocketType::Pub, MAX_MESSAGE);
    flush(&mut stream, &mut codec);
    let subscription = read_until(&mut stream, &mut codec, |_| true).unwrap();
    assert_eq!(subscription, vec![b"\x01kv".to_vec()]);
    codec.send_message(&[b"other", &0u64.to_be_bytes(), &stored(1, 1, 1, None)]);
    codec.send_message(&[b"kv", &0u64.to_be_bytes(), &stored(1, 1, 1, None)]);
    flush(&mut stream, &mut codec);
    let mut items = Vec::new();
    until("the batch", || {
        items.extend(consumer.take_notices().into_iter().map(|n| n.item));
        !items.is_empty()
    });
    thread::sleep(Duration::from_millis(50));
    items.extend(consumer.take_notices().into_iter().map(|n| n.item));
    assert_eq!(items.len(), 1, "the other topic is not taken: {items:?}");
    assert!(matches!(items[0], Item::Batch { seq: 0, .. }));
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
fn reconnecting_is_quick_at_first_then_backs_off() {
    assert_eq!(Dialer::backoff(1), RECONNECT_IVL);
    assert_eq!(Dialer::backoff(RECONNECT_QUICK_ATTEMPTS), RECONNECT_IVL);
    assert_eq!(
        Dialer::backoff(RECONNECT_QUICK_ATTEMPTS + 1),
        2 * RECONNECT_IVL
    );
    assert_eq!(Dialer::backoff(u32::MAX), RECONNECT_MAX);
}

#[test]
fn a_malformed_address_fails_at_once() {
    let consumer = Consumer::start(None, Duration::ZERO).unwrap();
    for (endpoint, why) in [
        ("localhost:5557", "expected tcp://HOST:PORT or ipc://PATH"),
        ("tcp://127.0.0.1", "expected tcp://HOST:PORT"),
        ("tcp://127.0.0.1:99999", "bad port"),
        ("tcp://*:5557", "can only be bound"),
        ("inproc://kv", "within one process"),
    ] {
        let bad = Subscription {
            endpoint: endpoint.into(),
            replay_endpoint: None,
            topic: Vec::new(),
            bind: false,
            replay_timeout: Duration::from_secs(1),
            catch_up: false,
        };
        let error = consumer.add_worker("w", bad).unwrap_err();
        assert!(
            error.contains(&format!("cannot subscribe to {endpoint}")) && error.contains(why),
            "{error}"
        );
    }
}
