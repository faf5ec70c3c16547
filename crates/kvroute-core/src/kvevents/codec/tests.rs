//! The codec against payloads recorded from vLLM's msgspec encoder, and hand-built ones.

use super::*;

/// `tests/data/golden/kvevents_payloads.json`, read from the repository at test time.
fn golden() -> serde_json::Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/data/golden/kvevents_payloads.json"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// The recorded cases of one part (`encode` or `decode`).
fn cases(part: &str) -> Vec<serde_json::Value> {
    golden()[part].as_array().unwrap().clone()
}

fn payload(case: &serde_json::Value) -> Vec<u8> {
    unhex(case["payload"].as_str().unwrap())
}

/// `(wire_format, payload)` of every recorded `encode` case.
fn golden_encoded() -> Vec<(WireFormat, Vec<u8>)> {
    cases("encode")
        .iter()
        .map(|c| {
            let format = WireFormat::from_name(c["wire_format"].as_str().unwrap()).unwrap();
            (format, payload(c))
        })
        .collect()
}

fn golden_decode_payloads() -> Vec<Vec<u8>> {
    cases("decode").iter().map(payload).collect()
}

#[test]
fn re_encoding_a_recorded_payload_gives_msgspecs_bytes() {
    let cases = golden_encoded();
    assert_eq!(cases.len(), 28);
    for (format, payload) in cases {
        let decoded = decode_batch(&payload).unwrap();
        assert_eq!(decoded.unknown_events, 0);
        let batch = EventBatch {
            ts: decoded.ts,
            events: decoded.events,
            data_parallel_rank: decoded.data_parallel_rank,
        };
        assert_eq!(
            encode_batch(&batch, format),
            payload,
            "{format:?} {batch:?}"
        );
    }
}

#[test]
fn every_recorded_hand_built_payload_decodes() {
    let payloads = golden_decode_payloads();
    assert_eq!(payloads.len(), 13);
    for p in payloads {
        decode_batch(&p).unwrap();
    }
}

fn full_stored() -> BlockStored {
    BlockStored {
        block_hashes: vec![u64::MAX, 12345678901234567890],
        parent_block_hash: Some(42),
        token_ids: (0..8).collect(),
        block_size: 4,
        lora_id: Some(3),
        medium: Some("CPU".into()),
        lora_name: Some("adapter-a".into()),
        // ("mm-hash", 7) as msgspec writes a tuple
        extra_keys: Some(vec![Some(b"\x92\xa7mm-hash\x07".to_vec()), None]),
        group_idx: 1,
        kv_cache_spec_kind: Some("sliding_window".into()),
    }
}

fn sample_batch(rank: Option<i64>) -> EventBatch {
    EventBatch {
        ts: 1757500000.25,
        events: vec![
            KvCacheEvent::Stored(full_stored()),
            KvCacheEvent::Stored(BlockStored {
                kv_cache_spec_kind: None,
                ..BlockStored::plain(vec![7], None, vec![9, 8, 7, 6], 4)
            }),
            KvCacheEvent::Removed(BlockRemoved {
                block_hashes: vec![u64::MAX, 5],
                medium: Some("GPU".into()),
                group_idx: 2,
            }),
            KvCacheEvent::AllCleared,
        ],
        data_parallel_rank: rank,
    }
}

#[test]
fn round_trip_keeps_every_field_in_both_shapes() {
    for format in [WireFormat::Map, WireFormat::Array] {
        for rank in [None, Some(0), Some(5)] {
            let batch = sample_batch(rank);
            let decoded = decode_batch(&encode_batch(&batch, format)).unwrap();
            assert_eq!(decoded.ts, batch.ts);
            assert_eq!(decoded.events, batch.events);
            assert_eq!(decoded.data_parallel_rank, rank);
            assert_eq!(decoded.unknown_events, 0);
        }
    }
}

/// A tiny msgpack writer for hand-built payloads.
#[derive(Clone)]
enum V {
    Nil,
    I(i64),
    U(u64),
    F(f64),
    S(&'static str),
    B(Vec<u8>),
    A(Vec<V>),
    M(Vec<(V, V)>),
}

fn pack(v: &V, out: &mut Vec<u8>) {
    match v {
        V::Nil => out.push(0xc0),
        V::I(i) => write_int(out, *i),
        V::U(u) => write_uint(out, *u),
        V::F(f) => {
            out.push(0xcb);
            out.extend_from_slice(&f.to_bits().to_be_bytes());
        }
        V::S(s) => write_str(out, s),
        V::B(b) => {
            out.extend_from_slice(&[0xc4, b.len() as u8]);
            out.extend_from_slice(b);
        }
        V::A(items) => {
            write_array_len(out, items.len());
            items.iter().for_each(|i| pack(i, out));
        }
        V::M(pairs) => {
            write_map_len(out, pairs.len());
            for (k, v) in pairs {
                pack(k, out);
                pack(v, out);
            }
        }
    }
}

fn bytes(v: V) -> Vec<u8> {
    let mut out = Vec::new();
    pack(&v, &mut out);
    out
}

fn ints(values: &[i64]) -> V {
    V::A(values.iter().map(|&i| V::I(i)).collect())
}

#[test]
fn mixed_shapes_unknown_types_and_bytes_hashes_in_one_batch() {
    let mut digest = vec![1u8; 24];
    digest.extend_from_slice(&77u64.to_be_bytes());
    let payload = bytes(V::A(vec![
        V::F(2.5),
        V::A(vec![
            V::M(vec![
                (V::S("type"), V::S("BlockRemoved")),
                (V::S("block_hashes"), ints(&[1])),
                (V::S("medium"), V::S("GPU")),
                (V::S("group_idx"), V::I(1)),
            ]),
            V::M(vec![
                (V::S("type"), V::S("BlockPinned")),
                (V::S("block_hashes"), ints(&[1])),
            ]),
            // an old vLLM: no medium and later
            V::A(vec![
                V::S("BlockStored"),
                ints(&[9]),
                V::Nil,
                ints(&[1, 2]),
                V::I(2),
                V::Nil,
            ]),
            V::A(vec![V::S("SomethingNew"), V::I(1), V::I(2)]),
            V::M(vec![
                (V::S("type"), V::S("AllBlocksCleared")),
                (V::S("locality"), V::S("L")),
            ]),
            V::A(vec![
                V::S("BlockRemoved"),
                V::A(vec![V::B(digest), V::B(vec![7])]),
            ]),
            V::A(vec![]),
            V::A(vec![V::I(5), V::I(6)]),
            V::M(vec![(V::S("type"), V::I(7))]),
            V::M(vec![(V::I(1), V::I(2))]),
            // the tag after the fields, a field name that is not a string in an unknown event
            V::M(vec![
                (V::S("block_hashes"), ints(&[3])),
                (V::S("type"), V::S("BlockRemoved")),
            ]),
        ]),
    ]));
    let decoded = decode_batch(&payload).unwrap();
    assert_eq!(decoded.ts, 2.5);
    assert_eq!(decoded.data_parallel_rank, None);
    assert_eq!(decoded.unknown_events, 6);
    assert_eq!(
        decoded.events,
        vec![
            KvCacheEvent::Removed(BlockRemoved {
                block_hashes: vec![1],
                medium: Some("GPU".into()),
                group_idx: 1
            }),
            KvCacheEvent::Stored(BlockStored {
                block_hashes: vec![9],
                parent_block_hash: None,
                token_ids: vec![1, 2],
                block_size: 2,
                lora_id: None,
                medium: None,
                lora_name: None,
                extra_keys: None,
                group_idx: 0,
                kv_cache_spec_kind: None,
            }),
            KvCacheEvent::AllCleared,
            KvCacheEvent::Removed(BlockRemoved {
                block_hashes: vec![77, 7],
                medium: None,
                group_idx: 0
            }),
            KvCacheEvent::Removed(BlockRemoved {
                block_hashes: vec![3],
                medium: None,
                group_idx: 0
            }),
        ]
    );
}

#[test]
fn a_batch_encoded_as_a_map_with_unknown_fields_is_accepted() {
    let payload = bytes(V::M(vec![
        (
            V::S("extra"),
            V::A(vec![V::I(1), V::M(vec![(V::S("a"), V::I(2))])]),
        ),
        (
            V::S("events"),
            V::A(vec![V::M(vec![(V::S("type"), V::S("AllBlocksCleared"))])]),
        ),
        (V::S("ts"), V::I(3)),
        (V::S("data_parallel_rank"), V::I(0)),
    ]));
    let decoded = decode_batch(&payload).unwrap();
    assert_eq!(
        decoded,
        DecodedBatch {
            ts: 3.0,
            events: vec![KvCacheEvent::AllCleared],
            data_parallel_rank: Some(0),
            unknown_events: 0
        }
    );
}

#[test]
fn trailing_items_and_newer_fields_are_ignored() {
    let payload = bytes(V::A(vec![
        V::F(1.0),
        V::A(vec![V::A(vec![
            V::S("BlockRemoved"),
            ints(&[6]),
            V::S("GPU"),
            V::Nil,
            V::S("L"),
            V::A(vec![V::I(1), V::A(vec![V::I(2)])]),
        ])]),
        V::I(-1),
        V::S("newer"),
        V::A(vec![V::I(1)]),
    ]));
    let decoded = decode_batch(&payload).unwrap();
    assert_eq!(decoded.data_parallel_rank, Some(-1));
    assert_eq!(
        decoded.events,
        vec![KvCacheEvent::Removed(BlockRemoved {
            block_hashes: vec![6],
            medium: Some("GPU".into()),
            group_idx: 0
        })]
    );
}

fn malformed(payload: &[u8]) -> String {
    match decode_batch(payload) {
        Err(DecodeError(reason)) => reason,
        Ok(batch) => panic!("decoded {batch:?} from {payload:02x?}"),
    }
}

#[test]
fn malformed_payloads_are_errors_with_a_reason() {
    let cleared = || V::M(vec![(V::S("type"), V::S("AllBlocksCleared"))]);
    let good = bytes(V::A(vec![V::F(1.0), V::A(vec![cleared()])]));
    let mut trailing = bytes(V::A(vec![V::F(1.0), V::A(vec![])]));
    trailing.push(0);
    let bad_utf8 = |v: V| {
        let mut b = bytes(v);
        let at = b.windows(9).position(|w| w == b"AllBlocks").unwrap();
        b[at] = 0x80;
        b
    };
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (vec![], "empty"),
        (vec![0xc1], "0xc1"),
        (good[..good.len() - 3].to_vec(), "end of data"),
        (bytes(V::S("not a batch")), "not an array or map"),
        (bytes(V::A(vec![V::F(1.0)])), "at least 2"),
        (
            bytes(V::A(vec![V::F(1.0), V::S("events")])),
            "events: expected an array",
        ),
        (
            bytes(V::A(vec![V::S("ts"), V::A(vec![])])),
            "ts: expected a number",
        ),
        (
            bytes(V::A(vec![V::F(1.0), V::A(vec![V::I(7)])])),
            "neither a map nor an array",
        ),
        (
            bytes(V::A(vec![
                V::F(1.0),
                V::A(vec![V::M(vec![
                    (V::S("type"), V::S("BlockStored")),
                    (V::S("block_hashes"), ints(&[1])),
                ])]),
            ])),
            "event 0 (BlockStored) is malformed: missing required field parent_block_hash",
        ),
        (
            bytes(V::A(vec![
                V::F(1.0),
                V::A(vec![V::A(vec![V::S("BlockRemoved"), V::S("x")])]),
            ])),
            "event 0 (BlockRemoved) is malformed: block_hashes: expected an array",
        ),
        (
            bytes(V::A(vec![
                V::F(1.0),
                V::A(vec![V::A(vec![V::S("BlockRemoved")])]),
            ])),
            "(BlockRemoved) is malformed",
        ),
        (
            bytes(V::A(vec![
                V::F(1.0),
                V::A(vec![V::A(vec![
                    V::S("BlockStored"),
                    ints(&[1]),
                    V::Nil,
                    ints(&[1]),
                    V::I(-1),
                ])]),
            ])),
            "block_size: expected a non-negative int",
        ),
        (
            bytes(V::A(vec![
                V::F(1.0),
                V::A(vec![V::M(vec![
                    (V::S("type"), V::S("BlockRemoved")),
                    (V::I(1), V::I(2)),
                ])]),
            ])),
            "not a string",
        ),
        (
            bytes(V::A(vec![V::F(1.0), V::A(vec![]), V::U(u64::MAX)])),
            "data_parallel_rank: expected an int64",
        ),
        (trailing, "1 trailing bytes"),
        (
            bad_utf8(V::A(vec![V::F(1.0), V::A(vec![cleared()])])),
            "UTF-8",
        ),
        (
            bad_utf8(V::A(vec![
                V::F(1.0),
                V::A(vec![V::A(vec![V::S("AllBlocksCleared")])]),
            ])),
            "UTF-8",
        ),
        (
            bytes(V::M(vec![(V::S("events"), V::A(vec![]))])),
            "without ts",
        ),
    ];
    for (payload, reason) in cases {
        let got = malformed(&payload);
        assert!(got.contains(reason), "{got:?} does not say {reason:?}");
    }
}

/// `depth` nested one-item arrays around a nil.
fn nested(depth: usize) -> Vec<u8> {
    let mut out = vec![0x91; depth];
    out.push(0xc0);
    out
}

#[test]
fn msgpack_nested_ten_thousand_deep_is_malformed_wherever_it_is() {
    let deep = nested(10_000);
    let wrap = |prefix: &[u8], suffix: &[u8]| {
        let mut p = prefix.to_vec();
        p.extend_from_slice(&deep);
        p.extend_from_slice(suffix);
        p
    };
    let removed_tag = bytes(V::S("BlockRemoved"));
    let mut unknown_field = vec![0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x83];
    unknown_field.extend(bytes(V::S("type")));
    unknown_field.extend(&removed_tag);
    unknown_field.extend(bytes(V::S("block_hashes")));
    unknown_field.extend(bytes(ints(&[1])));
    unknown_field.extend(bytes(V::S("future")));
    let mut extra_keys = vec![0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x99];
    extra_keys.extend(bytes(V::S("BlockStored")));
    extra_keys.extend(bytes(ints(&[1])));
    extra_keys.extend([0xc0]);
    extra_keys.extend(bytes(ints(&[1])));
    extra_keys.extend([0x01, 0xc0, 0xc0, 0xc0, 0x91]);
    let cases = [
        deep.clone(),                                                     // the batch itself
        wrap(&[0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0], &[]),                 // the events
        wrap(&[0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91], &[]),           // one event
        wrap(&[0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x92], &[0x01]), // an unknown event's tag
        wrap(&unknown_field, &[]),
        wrap(&extra_keys, &[]),
        wrap(&[0x94, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x90, 0xc0], &[]), // a trailing batch item
    ];
    let reasons: Vec<String> = cases.iter().map(|p| malformed(p)).collect();
    // The ones that reach a value the decoder skips say why; the others fail on a wrong type.
    assert!(
        reasons[1..].iter().all(|r| r.contains("nested deeper")),
        "{reasons:?}"
    );
    // Just inside the bound is fine: an extra_keys entry nested to the limit.
    let mut ok = extra_keys.clone();
    ok.extend(nested(MAX_NESTING - 6));
    assert_eq!(decode_batch(&ok).unwrap().events.len(), 1);
}

#[test]
fn forged_lengths_fail_without_allocating_them() {
    // An array32 of 2^32 - 1 token ids in a 40-byte payload.
    let mut p = vec![0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x95];
    p.extend(bytes(V::S("BlockStored")));
    p.extend(bytes(ints(&[1])));
    p.push(0xc0);
    p.extend([0xdd, 0xff, 0xff, 0xff, 0xff, 0x01]);
    assert!(malformed(&p).contains("end of data"));
    // A map32 header claiming 2^32 - 1 pairs, and a str32 of 4 GiB.
    assert!(malformed(&[0xdf, 0xff, 0xff, 0xff, 0xff]).contains("end of data"));
    let tag32 = [
        0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x91, 0xdb, 0xff, 0xff, 0xff, 0xff,
    ];
    assert!(malformed(&tag32).contains("end of data"));
}

#[test]
fn integers_take_msgspecs_smallest_form() {
    let cases: [(i64, &[u8]); 12] = [
        (0, &[0x00]),
        (127, &[0x7f]),
        (128, &[0xcc, 0x80]),
        (256, &[0xcd, 0x01, 0x00]),
        (65536, &[0xce, 0, 1, 0, 0]),
        (1 << 32, &[0xcf, 0, 0, 0, 1, 0, 0, 0, 0]),
        (-1, &[0xff]),
        (-32, &[0xe0]),
        (-33, &[0xd0, 0xdf]),
        (-129, &[0xd1, 0xff, 0x7f]),
        (-32769, &[0xd2, 0xff, 0xff, 0x7f, 0xff]),
        (i64::MIN, &[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0]),
    ];
    for (value, want) in cases {
        let mut out = Vec::new();
        write_int(&mut out, value);
        assert_eq!(out, want, "{value}");
        let mut r = Reader { buf: &out, pos: 0 };
        assert_eq!(r.int().unwrap(), Some(i128::from(value)));
    }
}

#[test]
fn token_ids_beyond_i64_are_kept_as_i64_max() {
    let mut p = vec![0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x95];
    p.extend(bytes(V::S("BlockStored")));
    p.extend(bytes(ints(&[1])));
    p.push(0xc0);
    p.extend(bytes(V::A(vec![V::U(u64::MAX), V::I(-3), V::I(70000)])));
    p.push(0x03);
    let KvCacheEvent::Stored(stored) = &decode_batch(&p).unwrap().events[0] else {
        panic!("not a BlockStored");
    };
    assert_eq!(stored.token_ids, vec![i64::MAX, -3, 70000]);
}

#[test]
fn text_extra_keys_read_string_tuples_only() {
    // ("adapter-a", "salt") as msgspec writes a tuple of two strings.
    let raw = b"\x92\xa9adapter-a\xa4salt";
    assert_eq!(text_extra_keys(raw), Some(vec!["adapter-a", "salt"]));
    assert_eq!(encode_text_extra_keys(&["adapter-a", "salt"]), raw.to_vec());
    let long = "x".repeat(40);
    let enc = encode_text_extra_keys(&[&long]);
    assert_eq!(text_extra_keys(&enc), Some(vec![long.as_str()]));
    // A multimodal key (an identifier with its offset), bytes, trailing data, a bare string.
    assert_eq!(text_extra_keys(b"\x92\xa7mm-hash\x07"), None);
    assert_eq!(text_extra_keys(b"\x91\x92\xa1a\x00"), None);
    assert_eq!(text_extra_keys(b"\x91\xc4\x01a"), None);
    assert_eq!(text_extra_keys(b"\x91\xa1a\xa1b"), None);
    assert_eq!(text_extra_keys(b"\xa1a"), None);
    assert_eq!(text_extra_keys(b"\x92\xa1a"), None);
}
