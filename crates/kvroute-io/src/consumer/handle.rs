//! The consumer's handle: starts the thread, adds and removes workers, hands over notices and
//! counters, and stops the thread in bounded time.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use super::shared::{
    CounterSnapshot, Counters, Item, Notice, Shared, SharedIndex, Subscription, drain_pipe, lock,
};
use super::sockets::{Address, Listener, LiveSource};
use super::subscription_loop::{Command, SubscriptionLoop};

/// The consumer: a handle on its thread. Workers are added and removed by name; the thread
/// runs until [`Consumer::close`] (or the handle is dropped).
pub struct Consumer {
    commands: mpsc::Sender<Command>,
    /// The handle's end of the thread's wake-up pipe: a byte wakes the thread.
    wake: UnixStream,
    thread: Mutex<Option<(JoinHandle<()>, mpsc::Receiver<()>)>>,
    shared: Arc<Shared>,
    /// Read end of the bell (see [`Consumer::notice_fd`]).
    bell: UnixStream,
}

impl Consumer {
    /// Start the thread. With an index, every stream's batches are applied to it and only the
    /// conditions that reset a worker are posted as notices (for the log); without one, every
    /// item is posted (the outbox mode of `KVEventSubscriber`).
    ///
    /// `coalesce`: after a turn that took messages (and left none waiting), the thread sleeps
    /// this long before polling again, so the batches of several engine steps are taken in
    /// one wake-up. Waking costs about ten times the CPU of decoding and applying a batch; a
    /// couple of milliseconds more before the index has a batch matters
    /// little beside an engine step (and the predicted entries bridge it). Zero: poll again
    /// at once.
    pub fn start(index: Option<SharedIndex>, coalesce: Duration) -> io::Result<Self> {
        let (control, wake) = UnixStream::pair()?;
        control.set_nonblocking(true)?;
        wake.set_nonblocking(true)?;
        let (bell_read, bell_write) = UnixStream::pair()?;
        bell_read.set_nonblocking(true)?;
        bell_write.set_nonblocking(true)?;
        let shared = Arc::new(Shared {
            outbox: Mutex::new(VecDeque::new()),
            bell: bell_write,
            counters: Mutex::new(HashMap::new()),
        });
        let (commands, receiver) = mpsc::channel();
        let (done_tx, done_rx) = mpsc::channel();
        let mut state = SubscriptionLoop {
            control,
            commands: receiver,
            streams: Vec::new(),
            shared: shared.clone(),
            index,
            actions: Vec::new(),
            coalesce,
        };
        let thread_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("kvroute-kv-events".into())
            .spawn(move || {
                let outcome = catch_unwind(AssertUnwindSafe(|| state.run()));
                drop(state); // closes every socket before saying it is done
                if let Err(panic) = outcome {
                    let error = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "unknown panic".into());
                    thread_shared.post(Notice {
                        worker: String::new(),
                        item: Item::Crashed { error },
                    });
                }
                let _ = done_tx.send(());
            })?;
        Ok(Self {
            commands,
            wake,
            thread: Mutex::new(Some((thread, done_rx))),
            shared,
            bell: bell_read,
        })
    }

    fn ring(&self) {
        // Non-blocking: a full pipe means the thread has wake-ups pending already.
        let _ = (&self.wake).write(&[1]);
    }

    /// Follow `worker`'s stream (replacing a stream of that name). The address is checked
    /// here, and a bound one bound here, so a malformed or taken address fails at once;
    /// returns its address (the bound one, port resolved, when binding). Connecting happens on
    /// the thread, and is retried while the engine is not there.
    pub fn add_worker(&self, worker: &str, subscription: Subscription) -> Result<String, String> {
        let fail = |e: String| format!("cannot subscribe to {}: {e}", subscription.endpoint);
        let address = Address::parse(&subscription.endpoint, subscription.bind).map_err(fail)?;
        if let Some(replay) = &subscription.replay_endpoint {
            Address::parse(replay, false)
                .map_err(|e| format!("bad replay endpoint {replay}: {e}"))?;
        }
        let (live, endpoint) = if subscription.bind {
            let listener = Listener::bind(&address).map_err(|e| fail(e.to_string()))?;
            let endpoint = listener.endpoint.clone();
            (LiveSource::Listen(listener), endpoint)
        } else {
            (LiveSource::Dial(address), subscription.endpoint.clone())
        };
        let counters = Arc::new(Counters::default());
        lock(&self.shared.counters).insert(worker.to_string(), counters.clone());
        let command = Command::Add {
            worker: worker.to_string(),
            live,
            subscription,
            counters,
        };
        self.commands
            .send(command)
            .map_err(|_| "the KV event consumer has stopped".to_string())?;
        self.ring();
        Ok(endpoint)
    }

    /// Stop following `worker` (its sockets close; in index mode its entries are dropped
    /// after its last batch, so no late batch brings it back).
    pub fn remove_worker(&self, worker: &str) {
        lock(&self.shared.counters).remove(worker);
        let _ = self.commands.send(Command::Remove {
            worker: worker.to_string(),
        });
        self.ring();
    }

    /// The counts of every followed worker, by name.
    pub fn counters(&self) -> Vec<(String, CounterSnapshot)> {
        lock(&self.shared.counters)
            .iter()
            .map(|(name, c)| (name.clone(), c.snapshot()))
            .collect()
    }

    /// A descriptor that becomes readable when notices are waiting (watch it, then call
    /// [`Consumer::take_notices`]).
    pub fn notice_fd(&self) -> RawFd {
        self.bell.as_raw_fd()
    }

    /// The notices posted since the last call, oldest first.
    pub fn take_notices(&self) -> Vec<Notice> {
        // The bell first: a notice posted after this read rings it again.
        drain_pipe(&self.bell);
        lock(&self.shared.outbox).drain(..).collect()
    }

    /// Stop the thread, waiting at most `timeout`; true if it stopped in time. Idempotent.
    /// A thread that did not stop in time (it never should: it blocks only in a poll it
    /// bounds) is left to finish on its own.
    pub fn close(&self, timeout: Duration) -> bool {
        let Some((thread, done)) = lock(&self.thread).take() else {
            return true;
        };
        let _ = self.commands.send(Command::Stop);
        self.ring();
        match done.recv_timeout(timeout) {
            Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                let _ = thread.join();
                true
            }
            Err(mpsc::RecvTimeoutError::Timeout) => false,
        }
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        self.close(Duration::from_secs(2));
    }
}
