//! The codec against itself and against hand-written bytes: partial reads, every frame size
//! class, and the refusals (bad greeting, old version, other mechanisms, wrong peer type).

use super::*;

const LIMIT: usize = 1 << 20;

/// Move everything `from` queued into `to`, `chunk` bytes at a time, taking `to`'s events after
/// each chunk; returns the messages `to` produced (frames copied) and whether it became ready.
fn pump(from: &mut Codec, to: &mut Codec, chunk: usize) -> (Vec<Vec<Vec<u8>>>, bool) {
    let bytes = from.outgoing().to_vec();
    from.sent(bytes.len());
    let mut messages = Vec::new();
    let mut ready = false;
    for piece in bytes.chunks(chunk.max(1)) {
        to.receive(piece);
        while let Some(event) = to.next_event().unwrap() {
            match event {
                Event::Ready { .. } => ready = true,
                Event::Message(m) => messages.push(m.frames().map(<[u8]>::to_vec).collect()),
            }
        }
    }
    (messages, ready)
}

/// A SUB and a PUB past their handshake.
fn pair_with(limit: usize) -> (Codec, Codec) {
    let mut sub = Codec::new(SocketType::Sub, limit);
    let mut publisher = Codec::new(SocketType::Pub, limit);
    assert!(!pump(&mut sub, &mut publisher, 4096).1, "a greeting alone");
    assert!(pump(&mut publisher, &mut sub, 4096).1);
    assert!(pump(&mut sub, &mut publisher, 4096).1);
    (sub, publisher)
}

fn pair() -> (Codec, Codec) {
    pair_with(LIMIT)
}

/// `codec`'s bytes once it has the peer's greeting (its READY then follows its greeting).
fn greeted(mut codec: Codec) -> Vec<u8> {
    codec.receive(&greeting());
    assert!(codec.next_event().unwrap().is_none());
    codec.outgoing().to_vec()
}

#[test]
fn greeting_and_ready_are_what_libzmq_expects() {
    let codec = Codec::new(SocketType::Sub, LIMIT);
    assert_eq!(
        codec.outgoing().len(),
        GREETING_LEN,
        "READY waits for the peer's greeting"
    );
    let out = &greeted(codec)[..];
    assert_eq!(&out[..10], b"\xff\0\0\0\0\0\0\0\x01\x7f");
    assert_eq!(&out[10..12], &[3, 0], "ZMTP 3.0");
    assert_eq!(&out[12..32], b"NULL\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0");
    assert!(out[32..64].iter().all(|&b| b == 0));
    let ready = &out[64..];
    assert_eq!(ready[0], FLAG_COMMAND);
    assert_eq!(ready[1] as usize, ready.len() - 2);
    assert_eq!(&ready[2..], b"\x05READY\x0bSocket-Type\0\0\0\x03SUB");
    let dealer = greeted(Codec::new(SocketType::Dealer, LIMIT));
    assert!(dealer.ends_with(b"\x06DEALER\x08Identity\0\0\0\0"));
}

#[test]
fn a_handshake_byte_by_byte_then_messages_of_every_size_class() {
    let mut sub = Codec::new(SocketType::Sub, LIMIT);
    let mut publisher = Codec::new(SocketType::Pub, LIMIT);
    sub.subscribe(b"kv"); // queued behind READY, both behind the peer's greeting
    assert_eq!(sub.outgoing().len(), GREETING_LEN);
    pump(&mut sub, &mut publisher, 1);
    let (none, ready) = pump(&mut publisher, &mut sub, 1);
    assert!(ready && none.is_empty() && sub.is_ready());
    let (subscriptions, ready) = pump(&mut sub, &mut publisher, 1);
    assert!(ready && publisher.is_ready());
    assert_eq!(subscriptions, vec![vec![b"\x01kv".to_vec()]]);
    // Empty, short (1 and 255 bytes: one size byte) and long (256 bytes on: eight) frames.
    for size in [0usize, 1, 255, 256, 70_000] {
        let payload: Vec<u8> = (0..size).map(|i| i as u8).collect();
        let seq = 7u64.to_be_bytes();
        publisher.send_message(&[b"kv", &seq, &payload]);
        for chunk in [1, 3, 4096, usize::MAX] {
            publisher.send_message(&[b"kv", &seq, &payload]);
            let (messages, _) = pump(&mut publisher, &mut sub, chunk);
            let expected = vec![b"kv".to_vec(), seq.to_vec(), payload.clone()];
            assert_eq!(
                messages.len(),
                if chunk == 1 { 2 } else { 1 },
                "size {size}"
            );
            assert!(
                messages.iter().all(|m| *m == expected),
                "size {size}, chunk {chunk}"
            );
        }
    }
}

#[test]
fn a_long_size_for_a_short_frame_is_read_too() {
    // RFC 23 lets a sender use the 8-byte size for any frame.
    let (mut sub, _) = pair();
    sub.receive(b"\x03\0\0\0\0\0\0\0\x02kv\x02\0\0\0\0\0\0\0\x01!");
    match sub.next_event().unwrap() {
        Some(Event::Message(m)) => {
            assert_eq!(m.frames().collect::<Vec<_>>(), vec![&b"kv"[..], &b"!"[..]]);
        }
        other => panic!("{other:?}"),
    }
    assert!(sub.next_event().unwrap().is_none());
}

#[test]
fn not_zmtp_is_refused_at_the_first_byte() {
    let mut sub = Codec::new(SocketType::Sub, LIMIT);
    sub.receive(b"HTTP/1.1 400 Bad Request\r\n");
    let error = sub.next_event().unwrap_err();
    assert_eq!(error, ProtocolError::NotZmtp);
    assert!(error.to_string().contains("not a ZMTP 3 peer"));
    assert_eq!(sub.next_event().unwrap_err(), error, "the error sticks");
    let mut sub = Codec::new(SocketType::Sub, LIMIT);
    sub.receive(b"\xff\0\0\0\0\0\0\0\x01\x7e"); // a ZMTP 1.0 signature
    assert_eq!(sub.next_event().unwrap_err(), ProtocolError::NotZmtp);
}

#[test]
fn an_old_version_and_another_mechanism_are_refused_clearly() {
    let mut greeting = Codec::new(SocketType::Pub, LIMIT).outgoing()[..64].to_vec();
    greeting[10] = 2;
    greeting[11] = 1;
    let mut sub = Codec::new(SocketType::Sub, LIMIT);
    sub.receive(&greeting[..12]); // known as soon as the version bytes are in
    assert_eq!(
        sub.next_event().unwrap_err(),
        ProtocolError::Version { major: 2, minor: 1 }
    );
    let mut greeting = Codec::new(SocketType::Pub, LIMIT).outgoing()[..64].to_vec();
    greeting[12..32].copy_from_slice(b"CURVE\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0");
    let mut sub = Codec::new(SocketType::Sub, LIMIT);
    sub.receive(&greeting[..63]);
    assert!(sub.next_event().unwrap().is_none(), "not all there yet");
    sub.receive(&greeting[63..]);
    let error = sub.next_event().unwrap_err();
    assert_eq!(error, ProtocolError::Mechanism("CURVE".into()));
    assert!(error.to_string().contains("only NULL"), "{error}");
}

#[test]
fn a_3_1_peer_is_spoken_to_as_3_0() {
    let mut greeting = greeted(Codec::new(SocketType::Pub, LIMIT));
    greeting[11] = 1;
    let mut sub = Codec::new(SocketType::Sub, LIMIT);
    sub.receive(&greeting);
    assert!(matches!(
        sub.next_event().unwrap(),
        Some(Event::Ready {
            socket_type: b"PUB"
        })
    ));
}

#[test]
fn a_peer_of_the_wrong_type_or_without_ready_is_refused() {
    let mut sub = Codec::new(SocketType::Sub, LIMIT);
    sub.receive(&greeted(Codec::new(SocketType::Router, LIMIT)));
    let error = sub.next_event().unwrap_err();
    assert_eq!(
        error,
        ProtocolError::SocketType {
            ours: "SUB",
            theirs: "ROUTER".into()
        }
    );
    let mut sub = Codec::new(SocketType::Sub, LIMIT);
    sub.receive(&greeting());
    sub.receive(b"\x00\x02hi"); // a message before READY
    assert!(matches!(
        sub.next_event().unwrap_err(),
        ProtocolError::Handshake(_)
    ));
    let mut sub = Codec::new(SocketType::Sub, LIMIT);
    sub.receive(&greeting());
    sub.receive(b"\x04\x06\x05READY"); // no Socket-Type
    assert!(
        sub.next_event()
            .unwrap_err()
            .to_string()
            .contains("Socket-Type")
    );
}

#[test]
fn oversized_frames_and_messages_fail_before_their_bytes_arrive() {
    let (mut sub, _) = pair_with(1000);
    // One frame announcing 2^40 bytes: refused from its header alone.
    sub.receive(b"\x02\0\0\x01\0\0\0\0\0");
    assert!(matches!(
        sub.next_event().unwrap_err(),
        ProtocolError::TooLarge { limit: 1000, .. }
    ));
    let (mut sub, mut publisher) = pair_with(1000);
    let half = [0u8; 600];
    publisher.send_message(&[&half, &half]);
    let bytes = publisher.outgoing().to_vec();
    sub.receive(&bytes[..700]);
    assert!(matches!(
        sub.next_event().unwrap_err(),
        ProtocolError::TooLarge { size: 1200, .. }
    ));
}

#[test]
fn too_many_frames_is_an_error() {
    let (mut sub, mut publisher) = pair();
    let frames = vec![&b"x"[..]; MAX_FRAMES];
    publisher.send_message(&frames);
    assert_eq!(
        pump(&mut publisher, &mut sub, 4096).0.len(),
        1,
        "MAX_FRAMES is fine"
    );
    let frames = vec![&b"x"[..]; MAX_FRAMES + 1];
    publisher.send_message(&frames);
    sub.receive(publisher.outgoing());
    assert_eq!(sub.next_event().unwrap_err(), ProtocolError::TooManyFrames);
}

#[test]
fn ping_is_answered_and_error_ends_the_connection() {
    let (mut sub, _) = pair();
    sub.sent(usize::MAX);
    sub.receive(b"\x04\x09\x04PING\0\x0aab"); // TTL 10, context "ab"
    assert!(sub.next_event().unwrap().is_none());
    assert_eq!(sub.outgoing(), b"\x04\x07\x04PONGab");
    sub.receive(b"\x04\x0e\x05ERROR\x07go away");
    assert_eq!(
        sub.next_event().unwrap_err(),
        ProtocolError::Peer("go away".into())
    );
}

#[test]
fn the_receive_buffer_is_reused_and_shrinks_after_a_big_message() {
    let (mut sub, mut publisher) = pair();
    let big = vec![9u8; 2 * LIMIT / 3];
    publisher.send_message(&[&big]);
    assert_eq!(pump(&mut publisher, &mut sub, 10_000).0, vec![vec![big]]);
    let _ = sub.read_space();
    assert!(sub.buf.len() <= 2 * READ_CHUNK, "{}", sub.buf.len());
}
