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

/// What the stored rows still hold under each key: what [`Idempotency::audit`]
/// found. A key may leave the ring once [`KeyUse::unused`] says so.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SealAudit {
    /// Each key of the ring in its order, then each key that sealed a stored
    /// record and is not in the ring.
    pub keys: Vec<KeyUse>,
    /// Completed records in plain text.
    pub plain: u64,
    /// Rows holding no response whose fingerprint no key of the ring keyed:
    /// written while nothing was sealed, or keyed under a key that has left.
    pub unkeyed: u64,
    /// Completed rows past their expiry, which need no key: their next
    /// request runs anew, and the sweep deletes them.
    pub expired: u64,
    /// Rows read.
    pub read: u64,
    /// How long it took.
    pub elapsed: Duration,
}

impl SealAudit {
    /// What the rows hold under `id`, if it is in the ring or sealed a record.
    pub fn key(&self, id: KeyId) -> Option<&KeyUse> {
        self.keys.iter().find(|used| used.id == id)
    }

    fn entry(&mut self, id: KeyId) -> &mut KeyUse {
        let at = match self.keys.iter().position(|used| used.id == id) {
            Some(at) => at,
            None => {
                self.keys.push(KeyUse::new(id, false));
                self.keys.len() - 1
            }
        };
        &mut self.keys[at]
    }
}

/// The rows that still need one key (see [`SealAudit`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyUse {
    /// The key.
    pub id: KeyId,
    /// Whether the audited ring holds it.
    pub in_ring: bool,
    /// Completed records sealed under it, or whose fingerprint it keyed:
    /// [`Idempotency::reseal`] moves them to the ring's first key.
    pub records: u64,
    /// Committed claims whose fingerprint it keyed; they end within their
    /// lock. Claims whose transaction has not committed (on PostgreSQL and
    /// standalone MySQL, every claim in flight) are not seen.
    pub claims: u64,
    /// Rows whose transaction the database ended behind idem's back
    /// (`transaction-ended`) with their fingerprint keyed under it: they hold
    /// no response to key anew from, and leave when they expire.
    pub ended: u64,
    /// How long until the last of those `ended` rows expires.
    pub ended_expire_within: Option<Duration>,
}

impl KeyUse {
    fn new(id: KeyId, in_ring: bool) -> Self {
        Self {
            id,
            in_ring,
            records: 0,
            claims: 0,
            ended: 0,
            ended_expire_within: None,
        }
    }

    /// Whether no row read needs this key: it may leave the ring, once no claim
    /// in flight is older than the audit (wait out the longest `lock`).
    pub fn unused(&self) -> bool {
        self.records == 0 && self.claims == 0 && self.ended == 0
    }
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

impl<DB: Backend> Idempotency<DB> {
    /// Counts, for each key of the store's ring, the stored rows that still
    /// need it, and the rows in plain text: a key may leave the ring only once
    /// no row needs it ([`KeyUse::unused`]). Reads every row in batches of
    /// `batch` that lock nothing, and writes nothing. The `idem audit` command
    /// calls this.
    ///
    /// # Errors
    ///
    /// A store without a ring ([`Sealing::Off`](crate::Sealing::Off)): a
    /// configuration error, nothing read; any database error.
    ///
    /// # Examples
    ///
    /// ```rust,no_run
    /// # extern crate idem_runtime as idem_axum;
    /// # async fn demo<DB: idem_axum::Backend>(pool: sqlx::Pool<DB>) -> Result<(), Box<dyn std::error::Error>> {
    /// use idem_axum::{Idempotency, KeyRing, Sealing};
    ///
    /// // After `reseal`: may the old key (second in the ring) leave?
    /// let ring = KeyRing::from_base64(&std::env::var("SEAL_KEYS")?)?;
    /// let old = ring.ids().nth(1).ok_or("a ring of one key")?;
    /// let store = Idempotency::builder(pool).sealing(Sealing::On(ring)).build()?;
    /// let audit = store.audit(500).await?;
    /// let leaving = audit.key(old).ok_or("not in the ring")?;
    /// if !leaving.unused() {
    ///     println!("{} rows still need it", leaving.records + leaving.claims + leaving.ended);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn audit(&self, batch: u32) -> Result<SealAudit, sqlx::Error> {
        let Some(ring) = self.inner().sealing.ring() else {
            return Err(sqlx::Error::Configuration(
                "an audit needs the key ring: a store built with Builder::sealing".into(),
            ));
        };
        let started = Instant::now();
        let batch = batch.max(1);
        let mut audit = SealAudit {
            keys: ring.ids().map(|id| KeyUse::new(id, true)).collect(),
            ..SealAudit::default()
        };
        for answered in [true, false] {
            let mut after: Option<(String, String)> = None;
            loop {
                let after_ref = after.as_ref().map(|(s, k)| (s.as_str(), k.as_str()));
                let query = if answered {
                    Query::Completed {
                        after: after_ref,
                        limit: batch,
                    }
                } else {
                    Query::Unanswered {
                        after: after_ref,
                        limit: batch,
                    }
                };
                let rows = {
                    let mut conn = self.inner().pool.acquire().await?;
                    DB::idem_inspect(&mut conn, &self.inner().sql, &query).await?
                };
                for record in &rows {
                    audit.read += 1;
                    count(&mut audit, ring, record, answered);
                }
                if rows.len() < batch as usize {
                    break;
                }
                after = rows.last().map(|r| (r.scope.clone(), r.key.clone()));
            }
        }
        audit.elapsed = started.elapsed();
        Ok(audit)
    }
}

/// Adds `record` (one holding a response where `answered`) to `audit`.
fn count(audit: &mut SealAudit, ring: &KeyRing, record: &KeyRecord, answered: bool) {
    if record.state == "completed" && record.expires_in_ms <= 0 {
        audit.expired += 1;
        return;
    }
    let keyed_by = ring
        .keyed(&record.fingerprint)
        .then(|| KeyId::try_from(&record.fingerprint[..8]).ok())
        .flatten();
    if answered {
        let sealed_by = (record.status == Some(0))
            .then(|| crate::seal::sealed_by(&record.body))
            .flatten();
        if sealed_by.is_none() {
            audit.plain += 1;
        }
        for id in [sealed_by, keyed_by.filter(|id| Some(*id) != sealed_by)]
            .into_iter()
            .flatten()
        {
            audit.entry(id).records += 1;
        }
        return;
    }
    let Some(id) = keyed_by else {
        audit.unkeyed += 1;
        return;
    };
    let used = audit.entry(id);
    if record.state == "processing" {
        used.claims += 1;
    } else {
        used.ended += 1;
        let left = Duration::from_millis(u64::try_from(record.expires_in_ms).unwrap_or(0));
        used.ended_expire_within = used.ended_expire_within.max(Some(left));
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
