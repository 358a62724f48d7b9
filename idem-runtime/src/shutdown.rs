//! Graceful shutdown: stop taking keys, let executions in flight finish and record,
//! and cancel (roll back, release) what cannot finish in time.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::time::Instant;

/// Shuts a store down gracefully, for a deploy or a restart: from
/// [`Idempotency::shutdown`](crate::Idempotency::shutdown). It names no database,
/// so an application with several stores can hold one per store.
///
/// [`drain`](Self::drain) stops taking requests (keyed or not): each is answered 503
/// `shutting-down` with `Retry-After: 1`, before anything is claimed, so its retry
/// goes to an instance that is up. Executions already in flight go on, and are
/// recorded as usual. [`close`](Self::close) then waits for them, up to a grace
/// period; those still running at its end are cancelled: rolled back, their claims
/// released (SQLite's committed claim row too), and answered 503 `shutting-down`,
/// so that a retry after the restart runs at once instead of waiting out `lock`.
///
/// # Examples
///
/// ```rust,no_run
/// # extern crate idem_runtime as idem_axum;
/// # #[cfg(feature = "sqlite")]
/// # mod example {
/// use std::time::Duration;
/// use idem_axum::Idempotency;
///
/// # async fn serve(app: axum::Router, idempotency: Idempotency<sqlx::Sqlite>) -> std::io::Result<()> {
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
/// let shutdown = idempotency.shutdown();
/// // Ctrl-C here; SIGTERM too in a deployment (see the payments example).
/// let signal = async {
///     let _ = tokio::signal::ctrl_c().await;
/// };
/// axum::serve(listener, app)
///     .with_graceful_shutdown(shutdown.drain_on(signal))
///     .await?;
/// // Within the orchestrator's grace period, minus a margin.
/// let closed = shutdown.close(Duration::from_secs(20)).await;
/// println!("{} executions cancelled", closed.cancelled);
/// # Ok(())
/// # }
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Shutdown {
    lifecycle: Arc<Lifecycle>,
}

/// What [`Shutdown::close`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Closed {
    /// Executions still running at the end of the grace period, cancelled.
    pub cancelled: usize,
    /// Executions still not done after cancelling: a handler that ignores being
    /// dropped (blocking code); their claims end with `lock` or their connection.
    pub left: usize,
}

/// How long cancelled executions get to roll back and release their claims.
const CLEANUP: Duration = Duration::from_secs(5);

impl Shutdown {
    pub(crate) fn new(lifecycle: Arc<Lifecycle>) -> Self {
        Self { lifecycle }
    }

    /// Stops taking requests; executions in flight go on.
    pub fn drain(&self) {
        self.lifecycle.draining.store(true, Ordering::SeqCst);
    }

    /// Whether [`drain`](Self::drain) was called.
    pub fn is_draining(&self) -> bool {
        self.lifecycle.draining.load(Ordering::SeqCst)
    }

    /// Resolves when `signal` does, having begun the drain: the future to hand to
    /// axum's `with_graceful_shutdown`, so that the server stops accepting
    /// connections as the store stops taking keys.
    pub fn drain_on<F>(&self, signal: F) -> impl Future<Output = ()> + Send + 'static
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let this = self.clone();
        async move {
            signal.await;
            this.drain();
        }
    }

    /// Drains, waits up to `grace` for the executions in flight, then cancels the
    /// rest and waits for their rollback. Call it after the server has stopped, and
    /// before the process exits.
    pub async fn close(&self, grace: Duration) -> Closed {
        self.drain();
        let lifecycle = &self.lifecycle;
        if lifecycle.idle_by(Instant::now() + grace).await {
            return Closed {
                cancelled: 0,
                left: 0,
            };
        }
        let cancelled = lifecycle.running.load(Ordering::SeqCst);
        tracing::warn!(cancelled, "shutdown: cancelling executions still in flight");
        lifecycle.cancel.send_replace(true);
        lifecycle.idle_by(Instant::now() + CLEANUP).await;
        Closed {
            cancelled,
            left: lifecycle.running.load(Ordering::SeqCst),
        }
    }
}

/// A store's executions in flight, and whether it is shutting down.
#[derive(Debug)]
pub(crate) struct Lifecycle {
    draining: AtomicBool,
    running: AtomicUsize,
    idle: Notify,
    cancel: watch::Sender<bool>,
}

impl Lifecycle {
    pub(crate) fn new() -> Self {
        Self {
            draining: AtomicBool::new(false),
            running: AtomicUsize::new(0),
            idle: Notify::new(),
            cancel: watch::Sender::new(false),
        }
    }

    /// Counts an execution in; `None` once draining. Counted before the check, so
    /// `close` never misses an execution that got past it.
    pub(crate) fn enter(self: &Arc<Self>) -> Option<Running> {
        self.running.fetch_add(1, Ordering::SeqCst);
        let running = Running(Arc::clone(self));
        (!self.draining.load(Ordering::SeqCst)).then_some(running)
    }

    pub(crate) fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Executions counted in and not yet done.
    #[cfg(feature = "testing")]
    pub(crate) fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }

    /// Resolves once `close` cancels the executions in flight.
    pub(crate) fn cancelled(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut cancel = self.cancel.subscribe();
        async move {
            // An error means the store is gone, and nothing will cancel.
            if cancel.wait_for(|cancelled| *cancelled).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Whether nothing is in flight by `deadline`.
    async fn idle_by(&self, deadline: Instant) -> bool {
        loop {
            let mut notified = pin!(self.idle.notified());
            notified.as_mut().enable();
            if self.running.load(Ordering::SeqCst) == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.running.load(Ordering::SeqCst) == 0;
            }
        }
    }
}

/// One execution in flight; counted out when dropped.
#[derive(Debug)]
pub(crate) struct Running(Arc<Lifecycle>);

impl Drop for Running {
    fn drop(&mut self) {
        if self.0.running.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}
