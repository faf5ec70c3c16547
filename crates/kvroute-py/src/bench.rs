//! Native timings for the benchmarks, built only with the cargo feature `bench` (the wheel
//! leaves them out): the index's ingest and look-up (`benchmarks/index_speed.py`) and the
//! floor under the KV-event consumer's CPU per batch (`benchmarks/kv_events_consume.py`).
//! Build them in with `MATURIN_PEP517_ARGS="--features bench" pip install -e .`.

use std::time::{Duration, Instant};

use kvroute_core::blocks;
use kvroute_core::index::{self, MemoryBound};
use kvroute_core::kvevents::events::{BlockRemoved, BlockStored, KvCacheEvent};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

/// Prompts a benchmark worker's cache holds.
const RESIDENT_PROMPTS: usize = 4;

/// One benchmark worker's events: ``prompts`` distinct prompts of ``blocks`` 16-token blocks
/// (in events of ``per`` blocks, chained, engine hashes from another seed) into a cache of
/// [`RESIDENT_PROMPTS`] prompts, the oldest evicted block by block, tail first, as vLLM does.
fn bench_events(w: usize, prompts: usize, blocks: usize, per: usize) -> (Vec<KvCacheEvent>, u64) {
    let bs = 16;
    let engine = blocks::BlockHasher::new(bs, 987_654_321).expect("16");
    let mut events = Vec::new();
    let mut block_events = 0u64;
    let mut resident: std::collections::VecDeque<Vec<u64>> = Default::default();
    for p in 0..prompts {
        let start = ((w * prompts + p) * blocks * bs) as u32;
        let tokens: Vec<u32> = (start..start + (blocks * bs) as u32).collect();
        let hashes = engine.hash_blocks(&tokens, None, 0, None);
        for first in (0..blocks).step_by(per) {
            let stop = (first + per).min(blocks);
            events.push(KvCacheEvent::Stored(BlockStored::plain(
                hashes[first..stop].to_vec(),
                first.checked_sub(1).map(|i| hashes[i]),
                tokens[first * bs..stop * bs]
                    .iter()
                    .map(|&t| t as i64)
                    .collect(),
                bs,
            )));
        }
        block_events += blocks as u64;
        resident.push_back(hashes);
        if resident.len() > RESIDENT_PROMPTS {
            let old = resident.pop_front().expect("non-empty");
            for &h in old.iter().rev() {
                events.push(KvCacheEvent::Removed(BlockRemoved::plain(vec![h])));
            }
            block_events += old.len() as u64;
        }
    }
    (events, block_events)
}

/// Native ingest speed, for ``benchmarks/index_speed.py``: ``workers`` workers' events
/// (see the stream above) are built natively, one worker at a time just before they are
/// applied (as a decoder hands over a batch it has just decoded, still in cache), and only
/// ``KvIndex::apply`` is timed. Returns ``(block_events, seconds, evicted_blocks)``.
#[pyfunction]
#[pyo3(signature = (workers = 64, prompts = 40, blocks = 150, blocks_per_event = 16, max_blocks = None))]
fn bench_index_ingest(
    py: Python<'_>,
    workers: usize,
    prompts: usize,
    blocks: usize,
    blocks_per_event: usize,
    max_blocks: Option<usize>,
) -> (u64, f64, u64) {
    let own = blocks::BlockHasher::new(16, blocks::DEFAULT_HASH_SEED).expect("16");
    py.detach(|| {
        let mut index =
            index::KvIndex::new(own, Some(2.0), None, max_blocks.map(MemoryBound::Blocks))
                .expect("valid");
        let (mut total, mut seconds) = (0u64, 0.0);
        for w in 0..workers {
            let (events, n) = bench_events(w, prompts, blocks, blocks_per_event.max(1));
            let name = format!("worker-{w}");
            let t0 = Instant::now();
            index.apply(&name, &events);
            seconds += t0.elapsed().as_secs_f64();
            total += n;
        }
        let stats = index.stats();
        if max_blocks.is_none() {
            assert_eq!((stats.orphan_blocks, stats.unknown_removals), (0, 0));
        }
        (total, seconds, stats.evicted_blocks)
    })
}

/// Native look-up speed: ``workers`` workers, each holding a distinct depth of one
/// ``blocks``-block prompt, the whole prompt looked up ``repeat`` times over all of them.
/// Returns seconds per look-up.
#[pyfunction]
#[pyo3(signature = (workers = 64, blocks = 150, repeat = 100_000))]
fn bench_index_lookup(
    py: Python<'_>,
    workers: usize,
    blocks: usize,
    repeat: usize,
) -> PyResult<f64> {
    let bs = 16;
    let own = blocks::BlockHasher::new(bs, blocks::DEFAULT_HASH_SEED).expect("16");
    let tokens: Vec<u32> = (0..(blocks * bs) as u32).collect();
    let hashes = own.hash_blocks(&tokens, None, 0, None);
    Ok(py.detach(|| {
        let mut index = index::KvIndex::new(own, Some(2.0), None, None).expect("valid");
        let mut ids = Vec::new();
        for w in 0..workers {
            let name = format!("worker-{w}");
            // Everyone holds the whole prompt: the worst case, every block matched by all.
            let stored = KvCacheEvent::Stored(BlockStored::plain(
                hashes.clone(),
                None,
                tokens.iter().map(|&t| t as i64).collect(),
                bs,
            ));
            index.apply(&name, &[stored]);
            ids.push(index.worker_id(&name));
        }
        let mut out = Vec::new();
        let t0 = Instant::now();
        for _ in 0..repeat {
            index.overlaps_into(&hashes, &ids, 0.0, &mut out);
        }
        let per = t0.elapsed().as_secs_f64() / repeat as f64;
        assert!(out.iter().all(|&o| o == blocks));
        per
    }))
}

/// CPU nanoseconds the calling thread has run (Linux's schedstat: exact, where /proc's
/// per-thread ticks are 10 ms).
fn thread_runtime_ns() -> std::io::Result<u64> {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat")?;
    stat.split_whitespace()
        .next()
        .and_then(|t| t.parse().ok())
        .ok_or_else(|| std::io::Error::other("unreadable schedstat"))
}

/// The floor under the consumer's CPU per batch, for ``benchmarks/kv_events_consume.py``: a
/// thread that does only what every gathering turn must (sleep ``coalesce_s``, then read one
/// TCP socket until it would block), fed ``batches`` messages of ``payload_bytes`` at ``rate``
/// per second by a sender thread over 127.0.0.1. Nothing is decoded or applied. Returns
/// ``(CPU seconds of the reading thread per message, messages per wake-up)``.
#[pyfunction]
#[pyo3(signature = (rate = 1500.0, batches = 6000, payload_bytes = 420, coalesce_s = 0.002))]
fn bench_wake_floor(
    py: Python<'_>,
    rate: f64,
    batches: usize,
    payload_bytes: usize,
    coalesce_s: f64,
) -> PyResult<(f64, f64)> {
    use std::io::{ErrorKind, Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::time::Instant;
    if !(rate > 0.0 && coalesce_s >= 0.0 && payload_bytes > 0) {
        return Err(PyValueError::new_err(
            "rate and payload_bytes must be > 0, coalesce_s >= 0",
        ));
    }
    py.detach(|| {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let address = listener.local_addr()?;
        let sender = std::thread::spawn(move || -> std::io::Result<()> {
            let (mut socket, _) = listener.accept()?;
            socket.set_nodelay(true)?;
            let message = vec![7u8; payload_bytes];
            let start = Instant::now();
            for i in 0..batches {
                socket.write_all(&message)?;
                let due = start + Duration::from_secs_f64((i + 1) as f64 / rate);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
            }
            Ok(())
        });
        let mut socket = TcpStream::connect(address)?;
        socket.set_nonblocking(true)?;
        let mut buffer = vec![0u8; 64 << 10];
        let (total, mut got, mut wakes) = (batches * payload_bytes, 0, 0u64);
        let (mut started, mut counted_from) = (None, 0);
        while got < total {
            std::thread::sleep(Duration::from_secs_f64(coalesce_s));
            wakes += 1;
            loop {
                match socket.read(&mut buffer) {
                    Ok(0) => return Err(std::io::Error::other("the sender closed early")),
                    Ok(n) => {
                        got += n;
                        if n < buffer.len() {
                            break;
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) => return Err(e),
                }
            }
            if started.is_none() && got > 0 {
                // From the first message on, as the benchmark counts the consumer.
                started = Some((thread_runtime_ns()?, wakes));
                counted_from = got;
            }
        }
        let (cpu0, wakes0) = started.expect("messages came");
        let cpu = thread_runtime_ns()? - cpu0;
        sender
            .join()
            .map_err(|_| std::io::Error::other("the sender panicked"))??;
        let messages = (total - counted_from) as f64 / payload_bytes as f64;
        Ok((
            cpu as f64 * 1e-9 / messages,
            messages / (wakes - wakes0) as f64,
        ))
    })
    .map_err(|e: std::io::Error| PyRuntimeError::new_err(e.to_string()))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(bench_index_ingest, m)?)?;
    m.add_function(wrap_pyfunction!(bench_index_lookup, m)?)?;
    m.add_function(wrap_pyfunction!(bench_wake_floor, m)?)?;
    Ok(())
}
