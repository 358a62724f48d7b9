//! Wake-ups for duplicates that `wait` for an executor (see [`Options::wait`]).
//!
//! An executor of a waiting endpoint announces, once its claim has ended, the
//! 64-bit signal of its (table, scope, key): in process through a broadcast
//! channel, and on PostgreSQL also through `NOTIFY` in its own transaction, which a
//! listener turns back into the same broadcast. A waiter never relies on the
//! announcement alone: it also looks again at growing intervals, so a missed one
//! costs latency, never correctness.
//!
//! The same signals tell PostgreSQL's backend which keys its store handled lately,
//! so that it can guess which statement to send first.
//!
//! [`Options::wait`]: crate::Options::wait

use std::sync::Mutex;
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::sync::{broadcast, oneshot};
use tokio::time::Instant;

/// The first pause before a waiter looks again without having been woken.
pub(crate) const FIRST_PAUSE: Duration = Duration::from_millis(25);
/// The longest such pause.
pub(crate) const MAX_PAUSE: Duration = Duration::from_millis(500);

/// Announcements kept for slow waiters; one that falls further behind looks again.
const CAPACITY: usize = 1024;

pub(crate) struct Signals {
    sender: broadcast::Sender<u64>,
    /// Ends the database watcher, if one was started, when the store is dropped.
    _stop: oneshot::Sender<()>,
    stopped: Mutex<Option<oneshot::Receiver<()>>>,
}

impl Signals {
    pub(crate) fn new() -> Self {
        let (stop, stopped) = oneshot::channel();
        Self {
            sender: broadcast::channel(CAPACITY).0,
            _stop: stop,
            stopped: Mutex::new(Some(stopped)),
        }
    }

    pub(crate) fn subscribe(&self) -> broadcast::Receiver<u64> {
        self.sender.subscribe()
    }

    pub(crate) fn publish(&self, signal: u64) {
        // No receiver: nobody waits, nothing to do.
        let _ = self.sender.send(signal);
    }

    /// What a database watcher needs, the first time only: a handle that does not
    /// keep the channel open, and the receiver that ends when the store goes.
    pub(crate) fn watch_once(&self) -> Option<(broadcast::WeakSender<u64>, oneshot::Receiver<()>)> {
        let stopped = self.stopped.lock().ok()?.take()?;
        Some((self.sender.downgrade(), stopped))
    }
}

/// SHA-256 over (table, scope, key), each length-prefixed so no two triples meet.
pub(crate) fn key_digest(table: &str, scope: &str, key: &str) -> [u8; 32] {
    let mut hash = Sha256::new();
    for part in [table, scope, key] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part.as_bytes());
    }
    hash.finalize().into()
}

/// The signal of one key: the first 64 bits of its [`key_digest`]. Two keys that
/// share one only wake each other's waiters for an extra look.
pub(crate) fn signal_of(digest: &[u8; 32]) -> u64 {
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

/// Returns when `signal` is announced, when announcements were missed, or at `until`.
pub(crate) async fn announced(
    receiver: &mut broadcast::Receiver<u64>,
    signal: u64,
    until: Instant,
) {
    loop {
        match tokio::time::timeout_at(until, receiver.recv()).await {
            Ok(Ok(got)) if got == signal => return,
            Ok(Ok(_)) => {}
            Ok(Err(broadcast::error::RecvError::Lagged(_))) | Err(_) => return,
            Ok(Err(broadcast::error::RecvError::Closed)) => {
                tokio::time::sleep_until(until).await;
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_separate_scope_from_key() {
        // Length prefixes: "a:b" + "c" and "a" + "b:c" must not meet.
        let signal = |table, scope, key| signal_of(&key_digest(table, scope, key));
        assert_ne!(signal("t", "a:b", "c"), signal("t", "a", "b:c"));
        assert_ne!(signal("t", "ab", "c"), signal("t", "a", "bc"));
        assert_ne!(signal("t1", "a", "b"), signal("t2", "a", "b"));
        assert_eq!(signal("t", "a", "b"), signal("t", "a", "b"));
    }

    #[tokio::test]
    async fn waiters_wake_on_their_own_signal_only() {
        let signals = Signals::new();
        let mut receiver = signals.subscribe();
        signals.publish(1);
        signals.publish(2);
        let far = Instant::now() + Duration::from_secs(60);
        // Skips 1, returns on 2 long before `far`.
        tokio::time::timeout(Duration::from_secs(5), announced(&mut receiver, 2, far))
            .await
            .expect("woken by its own signal");
        let soon = Instant::now() + Duration::from_millis(20);
        announced(&mut receiver, 3, soon).await;
        assert!(Instant::now() >= soon, "returned before its deadline");
        assert!(signals.watch_once().is_some());
        assert!(signals.watch_once().is_none(), "only one watcher");
    }
}
