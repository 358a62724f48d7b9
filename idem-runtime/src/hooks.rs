//! What the testing kit (`crate::testing`) steers in a store's engine, and the
//! stall that holds a claim before its handler's transaction: compiled with the
//! `testing` feature only, below the store and the backends that carry them.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::oneshot;

/// What [`ExactlyOnce`](crate::testing::ExactlyOnce) steers and watches in the engine of a store.
#[derive(Debug, Default)]
pub(crate) struct Hooks {
    /// Set once a kit watches the store: until then the engine's requests pay
    /// one load here, not a shared count or a lock (benchmarks build this feature).
    watched: AtomicBool,
    failing_records: AtomicBool,
    /// Keyed requests that reached the store.
    arrivals: AtomicU64,
    /// The next execution to reach `hold_here` waits there.
    hold: Stall,
}

impl Hooks {
    /// Whether records fail as if the database had refused them: the handler's
    /// transaction then rolls back.
    pub(crate) fn records_fail(&self) -> bool {
        self.failing_records.load(Ordering::SeqCst)
    }

    pub(crate) fn fail_records(&self, on: bool) {
        self.failing_records.store(on, Ordering::SeqCst);
    }

    pub(crate) fn watch(&self) {
        self.watched.store(true, Ordering::SeqCst);
    }

    pub(crate) fn arrived(&self) {
        if self.watched.load(Ordering::Relaxed) {
            self.arrivals.fetch_add(1, Ordering::SeqCst);
        }
    }

    pub(crate) fn arrivals(&self) -> u64 {
        self.arrivals.load(Ordering::SeqCst)
    }

    /// Arms the hold for the next execution: the first receiver says it is held,
    /// the sender lets it go.
    pub(crate) fn hold_next(&self) -> (oneshot::Receiver<()>, oneshot::Sender<()>) {
        self.hold.arm()
    }

    pub(crate) fn unhold(&self) {
        self.hold.take();
    }

    /// Where the engine holds an execution, if one is asked for: until released,
    /// and never longer than `bound` (half its lock, which goes on running).
    pub(crate) async fn hold_here(&self, bound: Duration) {
        if !self.watched.load(Ordering::Relaxed) {
            return;
        }
        if let Some(hold) = self.hold.take() {
            hold.wait(bound).await;
        }
    }
}

/// One execution held where a test asks, until it is let go: a claim between its
/// commit and the handler's transaction, as a commit that stalls (a slow node,
/// flow control) holds it, to test the fence at the handler's `BEGIN` in the
/// committed-claim designs (`crate::lease`, `Idempotency::hold_after_claim`);
/// an execution in flight (`ExactlyOnce`'s hold, `crate::testing`).
#[doc(hidden)]
#[derive(Debug, Default)]
pub struct Stall(std::sync::Mutex<Option<StallHold>>);

/// An armed [`Stall`], taken by the execution it holds.
#[derive(Debug)]
pub(crate) struct StallHold {
    reached: oneshot::Sender<()>,
    release: oneshot::Receiver<()>,
}

impl Stall {
    /// Arms the stall for the next execution to reach it: the receiver says it
    /// is held, the sender lets it go (as does dropping it).
    pub(crate) fn arm(&self) -> (oneshot::Receiver<()>, oneshot::Sender<()>) {
        let (reached, is_reached) = oneshot::channel();
        let (release, released) = oneshot::channel();
        if let Ok(mut armed) = self.0.lock() {
            *armed = Some(StallHold {
                reached,
                release: released,
            });
        }
        (is_reached, release)
    }

    /// The armed stall, taken (and so disarmed).
    pub(crate) fn take(&self) -> Option<StallHold> {
        self.0.lock().ok().and_then(|mut armed| armed.take())
    }
}

impl StallHold {
    /// Says the execution is held, then waits to be let go, `bound` at most.
    pub(crate) async fn wait(self, bound: std::time::Duration) {
        let released = self.reached();
        let _ = tokio::time::timeout(bound, released).await;
    }

    /// Says the execution is held; what is returned ends when it is let go.
    pub(crate) fn reached(self) -> oneshot::Receiver<()> {
        let _ = self.reached.send(());
        self.release
    }
}
