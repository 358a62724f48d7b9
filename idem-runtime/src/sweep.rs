//! Retention (`docs/contract.md` §6): deleting expired keys in small batches.

use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use crate::backend::Backend;
use crate::store::Idempotency;

/// How a sweep deletes expired keys: in batches of `batch` rows, one short
/// statement each, until none are left or `budget` has been spent.
///
/// Only completed keys whose `ttl` has passed are deleted. A `processing` row is
/// never touched, however old: it belongs to an execution, and a retry takes it
/// over once its lock has passed.
///
/// # Examples
///
/// ```
/// # extern crate idem_runtime as idem_axum;
/// use std::time::Duration;
/// use idem_axum::Sweep;
///
/// let gentle = Sweep::new().batch(200).pause(Duration::from_millis(5));
/// assert_eq!(gentle.batch_size(), 200);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sweep {
    batch: u32,
    budget: Duration,
    pause: Duration,
}

impl Sweep {
    /// Defaults: batches of 500 rows, at most 10 seconds, no pause between batches.
    pub const fn new() -> Self {
        Self {
            batch: 500,
            budget: Duration::from_secs(10),
            pause: Duration::ZERO,
        }
    }

    /// Rows per batch (at least 1): what one statement deletes, and so how long it
    /// holds its locks.
    #[must_use]
    pub const fn batch(mut self, rows: u32) -> Self {
        self.batch = if rows == 0 { 1 } else { rows };
        self
    }

    /// The longest one sweep runs; the rest waits for the next.
    #[must_use]
    pub const fn budget(mut self, budget: Duration) -> Self {
        self.budget = budget;
        self
    }

    /// A pause between batches, leaving the database to the hot path.
    #[must_use]
    pub const fn pause(mut self, pause: Duration) -> Self {
        self.pause = pause;
        self
    }

    /// See [`batch`](Self::batch).
    pub const fn batch_size(&self) -> u32 {
        self.batch
    }
}

impl Default for Sweep {
    fn default() -> Self {
        Self::new()
    }
}

/// What one sweep did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct SweepReport {
    /// Rows deleted.
    pub deleted: u64,
    /// Statements run.
    pub batches: u32,
    /// `true` when the last batch came back short: nothing expired is left.
    pub caught_up: bool,
    /// Time spent.
    pub elapsed: Duration,
}

impl<DB: Backend> Idempotency<DB> {
    /// Deletes expired keys now, in batches; see [`Sweep`].
    ///
    /// # Errors
    ///
    /// A database error; rows deleted by earlier batches stay deleted.
    ///
    /// # Examples
    ///
    /// ```rust,no_run
    /// # extern crate idem_runtime as idem_axum;
    /// # async fn demo<DB: idem_axum::Backend>(idempotency: idem_axum::Idempotency<DB>) -> Result<(), sqlx::Error> {
    /// use idem_axum::Sweep;
    ///
    /// let report = idempotency.sweep(Sweep::new()).await?;
    /// println!("deleted {} expired keys in {:?}", report.deleted, report.elapsed);
    /// # Ok(()) }
    /// ```
    pub async fn sweep(&self, sweep: Sweep) -> Result<SweepReport, sqlx::Error> {
        let started = Instant::now();
        let mut report = SweepReport {
            deleted: 0,
            batches: 0,
            caught_up: false,
            elapsed: Duration::ZERO,
        };
        let limit = i64::from(sweep.batch);
        while started.elapsed() < sweep.budget {
            // A connection per batch: between batches the pool is the hot path's.
            let mut conn = self.inner().pool.acquire().await?;
            let deleted = DB::idem_sweep(&mut conn, &self.inner().sql, limit).await?;
            drop(conn);
            report.deleted += deleted;
            crate::metrics::swept(deleted);
            report.batches += 1;
            if deleted < u64::from(sweep.batch) {
                report.caught_up = true;
                break;
            }
            if !sweep.pause.is_zero() {
                tokio::time::sleep(sweep.pause).await;
            }
        }
        report.elapsed = started.elapsed();
        Ok(report)
    }

    /// Runs [`sweep`](Self::sweep) every `every`, in a task of its own, until the
    /// returned handle is aborted (or the runtime shuts down). Failures are logged
    /// and retried at the next tick.
    ///
    /// # Examples
    ///
    /// ```rust,no_run
    /// # extern crate idem_runtime as idem_axum;
    /// # async fn demo<DB: idem_axum::Backend>(idempotency: idem_axum::Idempotency<DB>) {
    /// use std::time::Duration;
    /// use idem_axum::Sweep;
    ///
    /// let sweeper = idempotency.spawn_sweeper(Duration::from_secs(60), Sweep::new());
    /// // ... on shutdown:
    /// sweeper.abort();
    /// # }
    /// ```
    pub fn spawn_sweeper(&self, every: Duration, sweep: Sweep) -> JoinHandle<()> {
        let store = self.clone();
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(every.max(Duration::from_millis(1)));
            ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                match store.sweep(sweep).await {
                    Ok(report) => tracing::debug!(
                        deleted = report.deleted,
                        batches = report.batches,
                        caught_up = report.caught_up,
                        elapsed_ms = report.elapsed.as_millis() as u64,
                        "idempotency sweep"
                    ),
                    Err(error) => tracing::warn!(%error, "idempotency sweep failed"),
                }
            }
        })
    }
}
