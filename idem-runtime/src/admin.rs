//! The operator's view of the key table: what is in flight, what is stuck, and
//! what one key holds.

use crate::backend::{Backend, Forgotten, InFlight, KeyRecord, Query};
use crate::seal::{Unreadable, sealed_by};
use crate::signal::key_digest;
use crate::store::Idempotency;

impl<DB: Backend> Idempotency<DB> {
    /// Claims in flight (`processing` rows), oldest first: all of them, one
    /// scope's, or only the stuck ones (lock passed).
    ///
    /// SQLite's claims are committed rows. MySQL's are written inside their
    /// executor's transaction: they are read uncommitted (a read that takes and
    /// waits for no lock) and listed while their key's named lock is held.
    /// PostgreSQL cannot read a row before it commits: its claims in flight are not
    /// listed (see [`in_flight`](Self::in_flight) for one key).
    ///
    /// # Errors
    ///
    /// Any database error.
    ///
    /// # Examples
    ///
    /// ```rust,no_run
    /// # extern crate idem_runtime as idem_axum;
    /// # async fn demo<DB: idem_axum::Backend>(idempotency: idem_axum::Idempotency<DB>) -> Result<(), sqlx::Error> {
    /// for claim in idempotency.claims(None, true, 50).await? {
    ///     println!("stuck: {} {} since {} ms", claim.scope, claim.key, claim.age_ms);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn claims(
        &self,
        scope: Option<&str>,
        stuck_only: bool,
        limit: u32,
    ) -> Result<Vec<KeyRecord>, sqlx::Error> {
        let query = Query::Claims {
            scope,
            stuck_only,
            limit,
        };
        self.run_inspect(&query).await
    }

    /// What `scope` holds under `key`, including its stored response.
    ///
    /// # Errors
    ///
    /// Any database error.
    pub async fn inspect(&self, scope: &str, key: &str) -> Result<Option<KeyRecord>, sqlx::Error> {
        let found = self.run_inspect(&Query::Key { scope, key }).await?;
        Ok(found.into_iter().next())
    }

    /// The other scopes (up to 100) that hold `key`; their records are not read.
    /// Scans the table: an operator's call, not one for the hot path.
    ///
    /// # Errors
    ///
    /// Any database error.
    pub async fn other_scopes(&self, scope: &str, key: &str) -> Result<Vec<String>, sqlx::Error> {
        let found = self.run_inspect(&Query::OtherScopes { scope, key }).await?;
        Ok(found.into_iter().map(|record| record.scope).collect())
    }

    /// Whether an executor holds `scope`'s `key` right now, and what the database
    /// shows of it; never waits. A key in flight has no record yet on PostgreSQL and
    /// MySQL (its claim is inside the executor's open transaction), so
    /// [`inspect`](Self::inspect) shows nothing there, or the record it replaces.
    ///
    /// What tells it, per backend: PostgreSQL, the key's advisory lock held by
    /// another session; MySQL/MariaDB, the key's named lock (`IS_USED_LOCK`); SQLite,
    /// a `processing` row, whose lock may have passed (stuck: its executor is gone
    /// or hung, and the next request takes it over).
    ///
    /// # Errors
    ///
    /// Any database error.
    ///
    /// # Examples
    ///
    /// ```rust,no_run
    /// # extern crate idem_runtime as idem_axum;
    /// # async fn demo<DB: idem_axum::Backend>(idempotency: idem_axum::Idempotency<DB>) -> Result<(), sqlx::Error> {
    /// if let Some(holder) = idempotency.in_flight("user-7", "order-42").await? {
    ///     println!("in flight for {:?} ms, session {:?}", holder.age_ms, holder.session);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn in_flight(&self, scope: &str, key: &str) -> Result<Option<InFlight>, sqlx::Error> {
        let digest = key_digest(&self.inner().table, scope, key);
        let mut conn = self.inner().pool.acquire().await?;
        DB::idem_in_flight(&mut conn, &self.inner().sql, scope, key, &digest).await
    }

    /// Deletes `scope`'s completed record of `key`, so that the next request with
    /// it runs the handler again; says what it did.
    ///
    /// It deletes only the record it read, and only while no executor holds the
    /// key: a key in flight (claimed, or held by a transaction that has not ended,
    /// such as an expired record being run again) is never deleted, and the call
    /// never waits for it: it answers [`Forgotten::InFlight`] at once, because the
    /// record its executor is about to commit must not go with it. For the moment
    /// the deletion takes, it holds the key: on PostgreSQL with the key's advisory
    /// lock, as a claim does (a request that would claim the key then is answered
    /// 409 `in-flight`); on MySQL with the row's lock (such a request waits for
    /// it). On SQLite it queues for the database's one write lock like any write
    /// (up to the busy timeout), and deletes the row only if it still holds the
    /// lease it read. Replays of the record go on until it is gone.
    ///
    /// This store's copy in memory goes at once; other running instances replay
    /// theirs until their [`replay_cache_refresh`](crate::Builder::replay_cache_refresh)
    /// has passed (30 seconds by default). The `idem forget` command calls this.
    ///
    /// # Errors
    ///
    /// Any database error; nothing was deleted unless the error struck the commit.
    ///
    /// # Examples
    ///
    /// ```rust,no_run
    /// # extern crate idem_runtime as idem_axum;
    /// # async fn demo<DB: idem_axum::Backend>(idempotency: idem_axum::Idempotency<DB>) -> Result<(), sqlx::Error> {
    /// use idem_axum::Forgotten;
    ///
    /// match idempotency.forget("user-7", "order-42").await? {
    ///     Forgotten::Deleted => println!("the next request with order-42 runs again"),
    ///     Forgotten::InFlight => println!("still executing: nothing deleted, try later"),
    ///     other => println!("nothing deleted: {other}"),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn forget(&self, scope: &str, key: &str) -> Result<Forgotten, sqlx::Error> {
        let digest = key_digest(&self.inner().table, scope, key);
        let mut conn = self.inner().pool.acquire().await?;
        let forgotten = DB::idem_forget(&mut conn, &self.inner().sql, scope, key, &digest).await?;
        if forgotten == Forgotten::Deleted
            && let Some(cache) = &self.inner().replay_cache
        {
            cache.forget(&digest);
        }
        Ok(forgotten)
    }

    async fn run_inspect(&self, query: &Query<'_>) -> Result<Vec<KeyRecord>, sqlx::Error> {
        let mut conn = self.inner().pool.acquire().await?;
        let mut records = DB::idem_inspect(&mut conn, &self.inner().sql, query).await?;
        for record in &mut records {
            self.open_record(record);
        }
        Ok(records)
    }

    /// A record's response as this store would replay it: a sealed one opened
    /// with the store's ring, or emptied and `unreadable` with why; one in plain
    /// text kept, and marked where the store would refuse it.
    fn open_record(&self, record: &mut KeyRecord) {
        let sealing = &self.inner().sealing;
        if record.state != "completed" {
            return;
        }
        // A sealed record is never empty; an ended mark has no response at all.
        let sealed = record.status == Some(0) && !record.body.is_empty();
        let has_response = !record.body.is_empty() || !record.headers.is_empty();
        let why = if sealed {
            record.sealed_by = sealed_by(&record.body);
            match sealing.ring() {
                None => Unreadable::Sealed(record.sealed_by),
                Some(ring) => match ring.open(&record.sealed_row(), &record.body) {
                    Ok(opened) => {
                        record.status = Some(i32::from(opened.status));
                        record.headers = opened.headers;
                        record.body = opened.body;
                        return;
                    }
                    Err(unsealable) => Unreadable::Unsealable(unsealable),
                },
            }
        } else if has_response && !sealing.opens_plain() {
            // Shown as it is: an operator may need to see what was planted.
            record.unreadable = Some(Unreadable::Plain.to_string());
            return;
        } else {
            return;
        };
        record.unreadable = Some(why.to_string());
        record.status = None;
        record.headers.clear();
        record.body.clear();
    }
}
