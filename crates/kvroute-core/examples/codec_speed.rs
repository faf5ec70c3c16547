//! Decode and encode time of one vLLM-format KV event batch (a BlockStored of N blocks of 16
//! tokens and N one-block BlockRemoved, map format), best of 7 rounds: `cargo run --release
//! -p kvroute-core --example codec_speed`. Compare builds by running each in turn.
use std::time::Instant;

use kvroute_core::kvevents::codec::{WireFormat, decode_batch, encode_batch};
use kvroute_core::kvevents::events::{BlockRemoved, BlockStored, EventBatch, KvCacheEvent};

fn main() {
    for blocks in [4usize, 64] {
        let hashes: Vec<u64> = (0..blocks as u64).map(|i| i * 0x9E37_79B9 + 7).collect();
        let tokens: Vec<i64> = (0..(blocks * 16) as i64)
            .map(|t| (t * 7919) % 150_000)
            .collect();
        let mut events = vec![KvCacheEvent::Stored(BlockStored::plain(
            hashes.clone(),
            Some(1),
            tokens,
            16,
        ))];
        events.extend(
            hashes
                .iter()
                .map(|&h| KvCacheEvent::Removed(BlockRemoved::plain(vec![h + 1]))),
        );
        let batch = EventBatch {
            ts: 1.5,
            events,
            data_parallel_rank: None,
        };
        let payload = encode_batch(&batch, WireFormat::Map);
        let n = 200_000 / blocks;
        let (mut dec, mut enc) = (f64::MAX, f64::MAX);
        for _ in 0..7 {
            let t = Instant::now();
            for _ in 0..n {
                std::hint::black_box(decode_batch(std::hint::black_box(&payload)).unwrap());
            }
            dec = dec.min(t.elapsed().as_secs_f64() / n as f64);
            let t = Instant::now();
            for _ in 0..n {
                std::hint::black_box(encode_batch(std::hint::black_box(&batch), WireFormat::Map));
            }
            enc = enc.min(t.elapsed().as_secs_f64() / n as f64);
        }
        println!(
            "{blocks} blocks ({} bytes): decode {:.2} us, encode {:.2} us",
            payload.len(),
            dec * 1e6,
            enc * 1e6
        );
    }
}
