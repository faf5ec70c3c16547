//! How much the router's threads wait for each other: the two locks every request takes (the
//! fleet's, around the routing step, and the index's, which the KV-event consumer's thread
//! takes too) counted as they are taken, so `/metrics` shows where more `--threads` stop
//! helping (`benchmarks/router_threads.py`).
//!
//! A lock is first tried without waiting; only when that fails is the wait timed, so an
//! uncontended acquisition costs one atomic increment more than a plain `lock()`.

use crate::metrics::exposition::{Exposition, Kind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::time::Instant;

/// One lock's counters.
#[derive(Default)]
pub struct LockStats {
    /// Times it was taken.
    pub acquired: AtomicU64,
    /// Times it was held by another thread when asked for.
    pub contended: AtomicU64,
    /// Nanoseconds spent waiting for it, over those times.
    pub wait_ns: AtomicU64,
}

impl LockStats {
    /// Take `mutex` (a poisoned one too: its holder panicked, the data is still the best
    /// there is), counting the acquisition and any wait.
    pub fn lock<'a, T>(&self, mutex: &'a Mutex<T>) -> MutexGuard<'a, T> {
        self.acquired.fetch_add(1, Ordering::Relaxed);
        match mutex.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => {
                let started = Instant::now();
                let guard = mutex.lock().unwrap_or_else(|p| p.into_inner());
                self.contended.fetch_add(1, Ordering::Relaxed);
                self.wait_ns.fetch_add(
                    u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX),
                    Ordering::Relaxed,
                );
                guard
            }
        }
    }

    /// `(acquired, contended, seconds waited)` now.
    pub fn snapshot(&self) -> (u64, u64, f64) {
        (
            self.acquired.load(Ordering::Relaxed),
            self.contended.load(Ordering::Relaxed),
            self.wait_ns.load(Ordering::Relaxed) as f64 * 1e-9,
        )
    }
}

/// The locks' counters, one label value per lock.
pub fn render(out: &mut Exposition, locks: &[(&str, &LockStats)]) {
    type Pick = fn((u64, u64, f64)) -> f64;
    let rows: [(&str, &str, Pick); 3] = [
        (
            "kvroute_router_lock_acquisitions",
            "Times a router lock was taken",
            |s| s.0 as f64,
        ),
        (
            "kvroute_router_lock_contentions",
            "Times a router lock was held by another thread when asked for",
            |s| s.1 as f64,
        ),
        (
            "kvroute_router_lock_wait_seconds",
            "Seconds threads waited for a router lock",
            |s| s.2,
        ),
    ];
    for (name, help, pick) in rows {
        let samples = locks
            .iter()
            .map(|(lock, stats)| (vec![*lock], pick(stats.snapshot())));
        out.labelled(name, Kind::Counter, help, &["lock"], samples);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_wait_behind_another_holder_is_counted_and_timed() {
        let stats = Arc::new(LockStats::default());
        let mutex = Arc::new(Mutex::new(0));
        drop(stats.lock(&mutex));
        assert_eq!(stats.snapshot(), (1, 0, 0.0));
        let held = mutex.lock().unwrap();
        let (s, m) = (stats.clone(), mutex.clone());
        let waiter = std::thread::spawn(move || *s.lock(&m) += 1);
        std::thread::sleep(Duration::from_millis(30));
        drop(held);
        waiter.join().unwrap();
        let (acquired, contended, waited) = stats.snapshot();
        assert_eq!((acquired, contended, *mutex.lock().unwrap()), (2, 1, 1));
        assert!(waited >= 0.02, "{waited}");
    }
}
