//! Stored records sealed anew under the ring's newest key, so that an older key
//! can leave the ring (see `Sealing` in `seal.rs`).

use std::time::{Duration, Instant};

use crate::backend::{Backend, KeyRecord, Query, Resealed};
use crate::seal::{KeyId, KeyRing, Plain, Sealed};
use crate::store::Idempotency;

/// Settings for [`Idempotency::reseal`]: batches read in (scope, key) order, and
/// each batch written back in one short transaction.
///
/// # Examples
///
/// ```
/// # extern crate idem_runtime as idem_axum;
/// use std::time::Duration;
/// use idem_axum::Reseal;
///
/// let gentle = Reseal::new().batch(200).pause(Duration::from_millis(50));
/// ```
#[derive(Debug, Clone, Copy)]
#[must_use]
pub struct Reseal {
    batch: u32,
    pause: Duration,
    budget: Duration,
    plain: bool,
}

impl Default for Reseal {
    fn default() -> Self {
        Self::new()
    }
}

impl Reseal {
    /// Batches of 100 records, no pause, ten minutes at most, records in plain
    /// text left as they are.
    pub fn new() -> Self {
        Self {
            batch: 100,
            pause: Duration::ZERO,
            budget: Duration::from_secs(600),
            plain: false,
        }
    }

    /// Records read, and written back in one transaction, per batch (at least
    /// 1): a larger batch commits less often and holds its rows' locks (on
    /// SQLite, the write lock) a little longer.
    pub fn batch(mut self, batch: u32) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// The pause between batches, for a table whose writes must not be crowded.
    pub fn pause(mut self, pause: Duration) -> Self {
        self.pause = pause;
        self
    }

    /// How long the whole run may take; it stops after the batch that passes it.
    pub fn budget(mut self, budget: Duration) -> Self {
        self.budget = budget;
        self
    }

    /// Also seals the records stored in plain text, keying their fingerprints:
    /// for a deployment turning sealing on, once every instance seals new records
    /// ([`Sealing::SealsNew`](crate::Sealing::SealsNew)). Only where those records
    /// are known to be idem's own: a record planted in the table would be sealed
    /// as genuine.
    pub fn plain(mut self, plain: bool) -> Self {
        self.plain = plain;
        self
    }
}

/// What [`Idempotency::reseal`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ResealReport {
    /// Completed records read.
    pub read: u64,
    /// Records sealed anew under the newest key, their fingerprints keyed anew.
    pub resealed: u64,
    /// Records already sealed, and keyed, under the newest key.
    pub current: u64,
    /// Records in plain text, left as they are (see [`Reseal::plain`]).
    pub plain: u64,
    /// Sealed records that do not open with the ring (a key no longer in it, or
    /// changed), left as they are: they answer 500 `record-unreadable`.
    pub unreadable: u64,
    /// Records that ran again while being read (their key expired), left to the
    /// record that replaced them.
    pub changed: u64,
    /// Whether every record was read; `false` when the budget ran out first.
    pub caught_up: bool,
    /// How long it took.
    pub elapsed: Duration,
}

/// What a record needs.
enum Next {
    Current,
    Plain,
    Unreadable,
    Write {
        fingerprint: [u8; 32],
        body: Vec<u8>,
    },
}

impl<DB: Backend> Idempotency<DB> {
    /// Seals every completed record anew under the ring's newest key, and keys its
    /// fingerprint under it, so that once it has caught up (and no claim in flight
    /// is older than the newest key: a claim's fingerprint is keyed when it is
    /// made) the older keys can leave the ring. Records are read in batches that
    /// lock nothing, and each batch is written back in one short transaction, a
    /// record only while it is still the one that was read: requests go on
    /// beside it, and only a request taking over one of the batch's expired
    /// records would wait for its commit. Run it again to go on
    /// where a budget stopped it; records already current are skipped. The
    /// `idem reseal` command calls this.
    ///
    /// # Errors
    ///
    /// A store that does not seal ([`Sealing::On`](crate::Sealing::On) or
    /// [`Sealing::SealsNew`](crate::Sealing::SealsNew)): a configuration error,
    /// nothing read; any database error, after which what was written stays.
    ///
    /// # Examples
    ///
    /// ```rust,no_run
    /// # extern crate idem_runtime as idem_axum;
    /// # async fn demo<DB: idem_axum::Backend>(pool: sqlx::Pool<DB>) -> Result<(), Box<dyn std::error::Error>> {
    /// use idem_axum::{Idempotency, KeyRing, Reseal, Sealing};
    ///
    /// // After a rotation: the new key first, the old one still there.
    /// let ring = KeyRing::from_base64(&std::env::var("SEAL_KEYS")?)?;
    /// let store = Idempotency::builder(pool).sealing(Sealing::On(ring)).build()?;
    /// let report = store.reseal(Reseal::new()).await?;
    /// assert!(report.caught_up && report.unreadable == 0);
    /// # Ok(()) }
    /// ```
    pub async fn reseal(&self, settings: Reseal) -> Result<ResealReport, sqlx::Error> {
        let Some(ring) = self.inner().sealing.writer() else {
            return Err(sqlx::Error::Configuration(
                "re-sealing needs a store that seals (Sealing::On or Sealing::SealsNew)".into(),
            ));
        };
        let started = Instant::now();
        let mut report = ResealReport::default();
        let sql = &self.inner().sql;
        let mut after: Option<(String, String)> = None;
        loop {
            let query = Query::Completed {
                after: after.as_ref().map(|(s, k)| (s.as_str(), k.as_str())),
                limit: settings.batch,
            };
            let batch = {
                let mut conn = self.inner().pool.acquire().await?;
                DB::idem_inspect(&mut conn, sql, &query).await?
            };
            let mut writes = Vec::new();
            for record in &batch {
                report.read += 1;
                match next(ring, record, settings.plain)? {
                    Next::Current => report.current += 1,
                    Next::Plain => report.plain += 1,
                    Next::Unreadable => report.unreadable += 1,
                    Next::Write { fingerprint, body } => writes.push(Resealed {
                        record,
                        fingerprint,
                        body,
                    }),
                }
            }
            if !writes.is_empty() {
                let mut conn = self.inner().pool.acquire().await?;
                let written = DB::idem_reseal(&mut conn, sql, &writes).await?;
                report.resealed += written;
                report.changed += writes.len() as u64 - written;
            }
            let done = batch.len() < settings.batch as usize;
            after = batch.last().map(|r| (r.scope.clone(), r.key.clone()));
            if done {
                report.caught_up = true;
                break;
            }
            if started.elapsed() >= settings.budget {
                break;
            }
            if !settings.pause.is_zero() {
                tokio::time::sleep(settings.pause).await;
            }
        }
        report.elapsed = started.elapsed();
        Ok(report)
    }
}

/// What `record` needs to be current under `ring`'s newest key.
fn next(ring: &KeyRing, record: &KeyRecord, plain: bool) -> Result<Next, sqlx::Error> {
    let newest: Option<KeyId> = ring.ids().next();
    let row = record.sealed_row();
    let owner = crate::seal::Owner {
        scope: row.scope,
        key: row.key,
    };
    let opened;
    let (status, digest, headers, body) = if record.status == Some(0) {
        let Ok(open) = ring.open(&row, &record.body) else {
            return Ok(Next::Unreadable);
        };
        // Current: sealed under the first key in this release's envelope (with
        // the ring's context), its fingerprint keyed as this release keys it.
        if newest == crate::seal::sealed_by(&record.body)
            && crate::seal::current_envelope(ring, &record.body)
            && record.fingerprint[..] == ring.fingerprint(owner, &open.digest)[..]
        {
            return Ok(Next::Current);
        }
        opened = open;
        (
            opened.status,
            opened.digest,
            &opened.headers[..],
            &opened.body[..],
        )
    } else {
        if !plain {
            return Ok(Next::Plain);
        }
        // A record in plain text stores its body's digest bare: that is what is
        // keyed, and sealed inside.
        let (Some(status), Ok(digest)) = (
            record.status.and_then(|s| u16::try_from(s).ok()),
            <[u8; 32]>::try_from(&record.fingerprint[..]),
        ) else {
            return Ok(Next::Unreadable);
        };
        (status, digest, &record.headers[..], &record.body[..])
    };
    let fingerprint = ring.fingerprint(owner, &digest);
    let row = Sealed {
        fingerprint: &fingerprint,
        ..row
    };
    let response = Plain {
        status,
        digest: &digest,
        headers,
        body,
    };
    let body = ring
        .seal(&row, &response)
        .map_err(|error| sqlx::Error::Encode(Box::new(error)))?;
    Ok(Next::Write { fingerprint, body })
}
