//! SQLite: a committed claim with a lease, then the handler's own transaction.
//!
//! The design and its measured cost are described in `docs/backends.md`; the SQL
//! below is all this backend runs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::{AssertSqlSafe, Connection, Row, Sqlite, SqliteConnection, Transaction};
use sqlx_core::transaction::TransactionManager as _;

use crate::backend::{
    Again, Applied, Claim, Found, Identity, Layout, Migration, Recorded, Written, enabled::Driver,
};
use crate::backend::{Forgotten, InFlight};
use crate::backend::{KeyRecord, Parts, Query, Resealed, fetch, reseal_each};
use crate::lease::{self, Dialect, Statements};
use crate::tx::{Adopted, Open};

const NOW_MS: &str = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)";

/// Set right after the handler's transaction begins: it lives as long as that
/// transaction, so releasing it before the record fails ("no such savepoint")
/// when the handler ended the transaction, whether or not it began one of its
/// own since. Savepoints the handler sets nest inside it.
const HANDLER_SAVEPOINT: &str = "idem_handler";

/// Times are integer milliseconds since the Unix epoch.
const DIALECT: Dialect = Dialect {
    now: NOW_MS,
    ms_until: |column| format!("{column} - {NOW_MS}"),
    ms_since: |column| format!("{NOW_MS} - {column}"),
    // The write lock, as every writer takes it; WAL never blocks a reader.
    begin: "BEGIN IMMEDIATE",
    reads_in_transaction: false,
    // One database file, one machine's clock: the lock itself.
    takeover_at: "locked_until",
};

#[doc(hidden)]
#[derive(Debug)]
pub struct Sql {
    lookup: Arc<str>,
    claim: Arc<str>,
    /// What follows the claim: the record, the release, the operator's reads.
    lease: Statements,
    sweep: Arc<str>,
    /// How the handler's transaction begins.
    begin: &'static str,
    /// `testing::ExactlyOnce` begins it deferred for a while (see
    /// `Driver::idem_testing_deferred`).
    #[cfg(feature = "testing")]
    deferred_now: std::sync::atomic::AtomicBool,
    /// The claim held after its commit, for the fence's tests.
    #[cfg(feature = "testing")]
    stall: crate::hooks::Stall,
    /// The key table, in the `main` schema: a temporary table or view of the
    /// same name, which a handler may create, comes before `main` otherwise.
    table: Box<str>,
}

impl Driver for Sqlite {
    type IdemSql = Sql;

    fn idem_migrations(_layout: Layout) -> &'static [Migration] {
        &[
            Migration {
                version: 1,
                sql: include_str!("../migrations/sqlite/0001_idempotency_keys.sql"),
                applied: Applied::TableExists,
            },
            Migration {
                version: 2,
                sql: include_str!("../migrations/sqlite/0002_content_type.sql"),
                applied: Applied::HasColumn("content_type"),
            },
        ]
    }

    fn idem_sql(table: &str, layout: Layout, _pool: &sqlx::SqlitePool) -> Sql {
        let name = table;
        let table = format!("main.{name}");
        Sql {
            begin: if layout.deferred {
                "BEGIN DEFERRED"
            } else {
                "BEGIN IMMEDIATE"
            },
            lookup: format!(
                "SELECT state, method, path, content_type, fingerprint, status, headers, body, \
                        locked_until > {NOW_MS} AS live, expires_at - {NOW_MS} AS ttl_left_ms \
                 FROM {table} WHERE scope = ?1 AND idempotency_key = ?2"
            )
            .into(),
            claim: format!(
                "INSERT INTO {table} (scope, idempotency_key, state, lease, method, path, \
                        fingerprint, locked_until, expires_at, created_at, content_type) \
                 VALUES (?1, ?2, 'processing', ?3, ?4, ?5, ?6, {NOW_MS} + ?7, {NOW_MS} + ?8, \
                        {NOW_MS}, ?9) \
                 ON CONFLICT (scope, idempotency_key) DO UPDATE SET \
                        state = 'processing', lease = excluded.lease, method = excluded.method, \
                        path = excluded.path, fingerprint = excluded.fingerprint, \
                        content_type = excluded.content_type, status = NULL, \
                        headers = NULL, body = NULL, locked_until = excluded.locked_until, \
                        expires_at = excluded.expires_at, created_at = excluded.created_at \
                 WHERE {name}.expires_at <= {NOW_MS} \
                    OR ({name}.state = 'processing' AND {name}.locked_until <= {NOW_MS}) \
                 RETURNING lease"
            )
            .into(),
            sweep: format!(
                "DELETE FROM {table} WHERE rowid IN ( \
                    SELECT rowid FROM {table} \
                    WHERE state = 'completed' AND expires_at <= {NOW_MS} \
                    ORDER BY expires_at LIMIT ?1)"
            )
            .into(),
            lease: Statements::new(&DIALECT, &table),
            table: table.into(),
            #[cfg(feature = "testing")]
            deferred_now: std::sync::atomic::AtomicBool::new(false),
            #[cfg(feature = "testing")]
            stall: crate::hooks::Stall::default(),
        }
    }

    async fn idem_migrate(
        conn: &mut SqliteConnection,
        _sql: &Sql,
        table: &str,
        scripts: &[(String, Applied)],
    ) -> Result<(), sqlx::Error> {
        // The write lock serialises instances; DDL is transactional here.
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
        for (script, applied) in scripts {
            let probe = match applied {
                Applied::Rerun | Applied::HasFunctions => None,
                Applied::TableExists => Some(
                    sqlx::query_scalar::<_, i64>(
                        "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1",
                    )
                    .bind(table),
                ),
                Applied::HasColumn(column) => Some(
                    sqlx::query_scalar::<_, i64>(
                        "SELECT count(*) FROM pragma_table_info(?1) WHERE name = ?2",
                    )
                    .bind(table)
                    .bind(*column),
                ),
            };
            if let Some(probe) = probe
                && probe.fetch_one(&mut *tx).await? > 0
            {
                continue;
            }
            sqlx::raw_sql(AssertSqlSafe(script.clone()))
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await
    }

    async fn idem_lookup(
        conn: &mut SqliteConnection,
        sql: &Sql,
        id: &Identity<'_>,
    ) -> Result<Option<Found>, sqlx::Error> {
        Found::load::<Sqlite>(conn, &sql.lookup, id, true).await
    }

    async fn idem_claim<'c>(
        conn: &'c mut SqliteConnection,
        sql: &'c Sql,
        id: &'c Identity<'c>,
        claim: Claim,
    ) -> Result<Option<Adopted>, sqlx::Error> {
        let Some((patience, sent)) = claim_row(conn, sql, id, claim).await? else {
            return Ok(None);
        };
        #[cfg(feature = "testing")]
        if let Some(hold) = sql.stall.take() {
            hold.wait(std::time::Duration::from_secs(60)).await;
        }
        // The handler starts only while the claim holds (`lease::holds`). A
        // takeover needs the claim's lock to have passed by the wall clock this
        // process shares with the database file; while well under it has passed
        // since the claim was sent, none can have happened, and the fence costs
        // nothing (a read under the write lock cost 15% of first executions'
        // throughput). Past that, the fence is read. A `BEGIN IMMEDIATE` may wait
        // for another writer up to the busy timeout, so its fence is read after
        // it, under the write lock no takeover gets past. A deferred `BEGIN`
        // waits for nobody, and a read inside it would start the handler's
        // snapshot before its first write (which then fails if anyone wrote
        // meanwhile): its fence is read just before.
        let lock = Duration::from_millis(claim.lock_ms.unsigned_abs());
        let stale = || sent.elapsed() >= lock / 2;
        let immediate = sql.begin() == "BEGIN IMMEDIATE";
        let mut left = None;
        if !immediate && stale() {
            let read = Instant::now();
            left = fence(conn, sql, id, claim).await?.map(|left| (read, left));
            if left.is_none() {
                let restore = format!("PRAGMA busy_timeout = {patience}");
                sqlx::query(AssertSqlSafe(restore))
                    .execute(&mut *conn)
                    .await?;
                Self::idem_finish(conn, sql, id, claim.lease, false).await?;
                return Ok(None);
            }
        }
        // The busy timeout comes back in the same round trip as the `BEGIN`, which
        // must wait for the writer as configured; the savepoint goes with it. If
        // this fails the claim is committed: the engine releases it.
        let begin = format!(
            "PRAGMA busy_timeout = {patience}; {}; SAVEPOINT {HANDLER_SAVEPOINT}",
            sql.begin()
        );
        let adopted = Open::adopt(conn.begin_with(AssertSqlSafe(begin)).await?);
        if immediate && stale() {
            let read = Instant::now();
            let held = fence(conn, sql, id, claim).await;
            left = held
                .as_ref()
                .ok()
                .copied()
                .flatten()
                .map(|left| (read, left));
            if left.is_none() {
                <Sqlite as sqlx::Database>::TransactionManager::rollback(&mut *conn).await?;
                held?;
                Self::idem_finish(conn, sql, id, claim.lease, false).await?;
                return Ok(None);
            }
        }
        // The handler has what the lock has left: from the claim's statement, or
        // as the fence read it by the database's clock.
        let from = match left {
            None => sent,
            Some((read, left)) => {
                let left = Duration::from_millis(left.unsigned_abs());
                read.checked_sub(lock.saturating_sub(left)).unwrap_or(read)
            }
        };
        Ok(Some(adopted.lock_from(from)))
    }

    async fn idem_begin(
        conn: &mut SqliteConnection,
    ) -> Result<Transaction<'_, Sqlite>, sqlx::Error> {
        conn.begin_with("BEGIN IMMEDIATE").await
    }

    async fn idem_record<'c>(
        conn: &'c mut SqliteConnection,
        sql: &'c Sql,
        id: &'c Identity<'c>,
        claim: Claim,
        response: Recorded<'c>,
        _announce: Option<u64>,
    ) -> Result<Written, sqlx::Error> {
        if !handlers_transaction(conn).await? {
            ended_behind(conn, sql, id, claim.lease).await?;
            return Ok(Written::Ended);
        }
        let record = || {
            sqlx::query(AssertSqlSafe(sql.lease.record.clone()))
                .bind(response.status)
                .bind(response.headers)
                .bind(response.body)
                .bind(id.scope)
                .bind(id.key)
                .bind(claim.lease)
        };
        let done = match record().execute(&mut *conn).await {
            // A deferred transaction whose snapshot went stale before its first
            // write (517, SQLITE_BUSY_SNAPSHOT). It holds no write, or it would
            // hold the lock: begun again as a writer, it loses nothing.
            Err(sqlx::Error::Database(error)) if error.code().as_deref() == Some("517") => {
                sqlx::raw_sql("ROLLBACK; BEGIN IMMEDIATE")
                    .execute(&mut *conn)
                    .await?;
                record().execute(&mut *conn).await?
            }
            Err(error) if read_only(&error) => {
                writable(conn).await?;
                record().execute(&mut *conn).await?
            }
            done => done?,
        };
        Ok(Written::held(done.rows_affected() == 1))
    }

    async fn idem_rollback(
        conn: &mut SqliteConnection,
        sql: &Sql,
        id: &Identity<'_>,
        claim: Claim,
    ) -> Result<bool, sqlx::Error> {
        if !handlers_transaction(conn).await? {
            ended_behind(conn, sql, id, claim.lease).await?;
            return Ok(true);
        }
        <Sqlite as sqlx::Database>::TransactionManager::rollback(conn).await?;
        Ok(false)
    }

    async fn idem_lock_left(
        conn: &mut SqliteConnection,
        sql: &Sql,
        id: &Identity<'_>,
        _lock_ms: i64,
    ) -> Result<Option<i64>, sqlx::Error> {
        lease::lock_left::<Sqlite>(conn, &sql.lease, id.scope, id.key).await
    }

    async fn idem_finish(
        conn: &mut SqliteConnection,
        sql: &Sql,
        id: &Identity<'_>,
        lease: i64,
        committed: bool,
    ) -> Result<(), sqlx::Error> {
        if committed {
            return Ok(());
        }
        let release = || {
            sqlx::query(AssertSqlSafe(sql.lease.release.clone()))
                .bind(id.scope)
                .bind(id.key)
                .bind(lease)
        };
        match release().execute(&mut *conn).await {
            Err(error) if read_only(&error) => {
                writable(conn).await?;
                release().execute(&mut *conn).await?;
            }
            done => {
                done?;
            }
        }
        Ok(())
    }

    #[cfg(feature = "testing")]
    fn idem_testing_deferred(sql: &Sql, on: bool) {
        sql.deferred_now
            .store(on, std::sync::atomic::Ordering::SeqCst);
    }

    #[cfg(feature = "testing")]
    fn idem_testing_stall(sql: &Sql) -> Option<&crate::hooks::Stall> {
        Some(&sql.stall)
    }

    fn idem_finish_again(_sql: &Sql, error: &sqlx::Error) -> Again {
        // Another writer held the write lock past the busy timeout.
        if is_busy(error) {
            Again::Later
        } else {
            Again::Never
        }
    }

    async fn idem_sweep(
        conn: &mut SqliteConnection,
        sql: &Sql,
        limit: i64,
    ) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(AssertSqlSafe(sql.sweep.clone()))
            .bind(limit)
            .execute(conn)
            .await?;
        Ok(done.rows_affected())
    }

    async fn idem_forget(
        conn: &mut SqliteConnection,
        sql: &Sql,
        scope: &str,
        key: &str,
        _digest: &[u8; 32],
    ) -> Result<Forgotten, sqlx::Error> {
        // WAL never blocks the read, even while the claim's executor holds the
        // write lock; the deletion takes that lock as every writer does.
        lease::forget::<Sqlite>(conn, &sql.lease, scope, key).await
    }

    async fn idem_in_flight(
        conn: &mut SqliteConnection,
        sql: &Sql,
        scope: &str,
        key: &str,
        _digest: &[u8; 32],
    ) -> Result<Option<InFlight>, sqlx::Error> {
        lease::in_flight::<Sqlite>(conn, &sql.lease, scope, key).await
    }

    async fn idem_inspect(
        conn: &mut SqliteConnection,
        sql: &Sql,
        query: &Query<'_>,
    ) -> Result<Vec<KeyRecord>, sqlx::Error> {
        let Parts {
            filter,
            order,
            limit,
            payload,
            params,
        } = query.parts(|n| format!("?{n}"), NOW_MS);
        let stored = if payload {
            "coalesce(headers, x'') AS headers, coalesce(body, x'') AS body"
        } else {
            "x'' AS headers, x'' AS body"
        };
        let sql = format!(
            "SELECT scope, idempotency_key, state, method, path, status, lease, content_type, \
                    fingerprint, {stored}, \
                    locked_until - {NOW_MS} AS lock_left_ms, expires_at - {NOW_MS} AS expires_in_ms, \
                    {NOW_MS} - created_at AS age_ms \
             FROM {} WHERE {filter} ORDER BY {order} LIMIT {limit}",
            sql.table
        );
        fetch::<Sqlite>(conn, sql, params).await
    }

    async fn idem_reseal(
        conn: &mut SqliteConnection,
        sql: &Sql,
        writes: &[Resealed<'_>],
    ) -> Result<u64, sqlx::Error> {
        // The write lock for the batch's updates and one commit: each update is a
        // row by its primary key, so the hot path waits less than it would for a
        // commit per row.
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
        let statement = format!(
            "UPDATE {} SET fingerprint = ?1, status = 0, headers = x'', body = ?2 \
             WHERE scope = ?3 AND idempotency_key = ?4 AND lease = ?5 AND state = 'completed'",
            sql.table
        );
        let changed = sqlx::sqlite::SqliteQueryResult::rows_affected;
        let written = reseal_each::<Sqlite>(&mut tx, &statement, writes, changed).await?;
        tx.commit().await?;
        Ok(written)
    }
}

impl Sql {
    /// How the handler's transaction begins now.
    fn begin(&self) -> &'static str {
        #[cfg(feature = "testing")]
        if self.deferred_now.load(std::sync::atomic::Ordering::SeqCst) {
            return "BEGIN DEFERRED";
        }
        self.begin
    }
}

/// Claims with the upsert, without queueing behind another key's writer when the
/// writer is this key's own executor.
///
/// The upsert needs the write lock. While a handler of the *same* key holds it, a
/// duplicate must answer 409 at once, not wait out the busy timeout and then
/// replay; while another key's handler holds it, waiting is right. So the upsert
/// runs with `busy_timeout = 0`, and on `SQLITE_BUSY` a read (which WAL never
/// blocks) tells the two apart: a live claim or a fresh record of this key ends
/// the attempt (`false`: the engine answers from it), anything else backs off and
/// retries until the connection's own busy timeout has passed.
///
/// One upsert covers a free key and a takeover: with one writer there is no
/// speculative insertion to avoid.
///
/// Returns the connection's busy timeout (ms) when the row was claimed, for the
/// caller to restore with its `BEGIN`, and when the statement that claimed it
/// was sent (its lock runs from then); otherwise the timeout is restored here.
async fn claim_row(
    conn: &mut SqliteConnection,
    sql: &Sql,
    id: &Identity<'_>,
    claim: Claim,
) -> Result<Option<(i64, Instant)>, sqlx::Error> {
    // Read and clear in one round trip: the first row is the value before.
    let before = sqlx::raw_sql("PRAGMA busy_timeout; PRAGMA busy_timeout = 0")
        .fetch_all(&mut *conn)
        .await?;
    let patience: i64 = match before.first() {
        Some(row) => row.try_get(0)?,
        None => return Err(sqlx::Error::RowNotFound),
    };
    let deadline = Instant::now() + Duration::from_millis(patience.max(0).unsigned_abs());
    let mut pause = Duration::from_millis(1);
    let outcome = loop {
        let sent = Instant::now();
        let upsert = claim
            .bind(id, sqlx::query(AssertSqlSafe(sql.claim.clone())))
            .fetch_optional(&mut *conn)
            .await;
        match upsert {
            Ok(Some(_)) => return Ok(Some((patience, sent))),
            Ok(None) => break Ok(None),
            Err(error) if is_busy(&error) => {
                match Sqlite::idem_lookup(conn, sql, id).await {
                    Ok(Some(found)) if found.fresh() && (found.completed || found.live) => {
                        break Ok(None);
                    }
                    Ok(_) if Instant::now() < deadline => {}
                    Ok(_) => break Err(error),
                    Err(error) => break Err(error),
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(20));
            }
            Err(error) => break Err(error),
        }
    };
    let restore = format!("PRAGMA busy_timeout = {patience}");
    sqlx::query(AssertSqlSafe(restore))
        .execute(&mut *conn)
        .await?;
    outcome
}

/// What is left of the claim's lock while it still holds its key
/// (`lease::holds`).
async fn fence(
    conn: &mut SqliteConnection,
    sql: &Sql,
    id: &Identity<'_>,
    claim: Claim,
) -> Result<Option<i64>, sqlx::Error> {
    lease::holds::<Sqlite>(conn, &sql.lease, id.scope, id.key, claim.lease).await
}

/// Marks the key `transaction-ended` once the handler has ended the transaction
/// idem began (its savepoint is gone: `COMMIT`, `END`, `ROLLBACK`, or SQLite's own
/// rollback). SQLite then ran what the handler sent next statement by statement, so
/// some of its writes may be committed, outside the record; what it sent inside a
/// transaction it began since is rolled back, as nothing of it can be recorded
/// with the answer. The claim's row (committed before the handler ran) becomes a
/// completed 500 with no body, answered `transaction-ended` for the key's ttl, in a
/// transaction sqlx counts as the handler's and commits: the key never runs again.
async fn ended_behind(
    conn: &mut SqliteConnection,
    sql: &Sql,
    id: &Identity<'_>,
    lease: i64,
) -> Result<(), sqlx::Error> {
    match sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await {
        Err(sqlx::Error::Database(error)) if error.message().contains("no transaction") => {}
        rolled => {
            rolled?;
        }
    }
    sqlx::raw_sql("BEGIN").execute(&mut *conn).await?;
    tracing::error!("the handler ended its own transaction; the key keeps transaction-ended");
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {} SET state = 'completed', status = 500, headers = NULL, body = NULL \
         WHERE scope = ?1 AND idempotency_key = ?2 AND lease = ?3 AND state = 'processing'",
        sql.table
    )))
    .bind(id.scope)
    .bind(id.key)
    .bind(lease)
    .execute(&mut *conn)
    .await?;
    <Sqlite as sqlx::Database>::TransactionManager::commit(conn).await
}

/// Whether the transaction idem began for the handler is still open: its
/// savepoint, released here, is refused ("no such savepoint") once the handler
/// ended it. A `BEGIN` used to tell, refused inside a transaction: inside one the
/// handler began after ending idem's too, whose writes then went into the record's
/// commit as if nothing had ended.
async fn handlers_transaction(conn: &mut SqliteConnection) -> Result<bool, sqlx::Error> {
    let release = format!("RELEASE {HANDLER_SAVEPOINT}");
    match sqlx::raw_sql(AssertSqlSafe(release)).execute(conn).await {
        Ok(_) => Ok(true),
        Err(sqlx::Error::Database(error)) if error.message().contains("no such savepoint") => {
            Ok(false)
        }
        Err(error) => Err(error),
    }
}

/// A write refused because the session is read-only (`SQLITE_READONLY`): the
/// handler set `PRAGMA query_only`, which lasts as long as the connection.
fn read_only(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(error) => error.code().as_deref() == Some("8"),
        _ => false,
    }
}

/// Lets idem write its record or release on a session the handler made
/// `query_only`; the session stays writable, as idem found it at the claim.
async fn writable(conn: &mut SqliteConnection) -> Result<(), sqlx::Error> {
    sqlx::raw_sql("PRAGMA query_only = 0").execute(conn).await?;
    Ok(())
}

/// `SQLITE_BUSY` or one of its extended codes.
fn is_busy(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(error) => error
            .code()
            .and_then(|code| code.parse::<i32>().ok())
            .is_some_and(|code| code & 0xff == 5),
        _ => false,
    }
}
