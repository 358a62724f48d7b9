//! The committed claim with a lease: the design of the databases that have no
//! lock every writer sees. SQLite has no advisory locks at all; on a multi-primary
//! MySQL cluster (Galera) named locks and row locks stay on their node, and the
//! only exclusion across nodes is certification of committed writes.
//!
//! A claim is a `processing` row committed before the handler runs, under a random
//! lease and a lock deadline by the database clock. The handler's own transaction
//! completes that row only while the lease is its own and the lock still ahead,
//! so an executor whose key was taken over never records; a claim whose
//! transaction was not recorded is deleted by its lease and frees the key. How a
//! database writes the claim itself (SQLite's one writer upserts; a cluster inserts
//! and lets certification pick one winner) stays with its backend: the statements
//! after the claim, and the operator's reads and deletion, are here, spelled by a
//! [`Dialect`]. See `docs/backends.md`.

use std::sync::Arc;

use sqlx::{AssertSqlSafe, Connection as _, Database};

use crate::backend::{Forgotten, InFlight};

/// How a database spells the clock and the times the key table holds.
pub(crate) struct Dialect {
    /// The database clock, in the type of `locked_until` and `expires_at`.
    pub(crate) now: &'static str,
    /// Signed 64-bit milliseconds from `now` to the time column named.
    pub(crate) ms_until: fn(&str) -> String,
    /// Signed 64-bit milliseconds from the time column named to `now`.
    pub(crate) ms_since: fn(&str) -> String,
    /// How a transaction of idem's own outside a claim begins: an operator's
    /// deletion, and every read where a plain statement would open a transaction
    /// that nothing ends (MySQL's sessions with `autocommit = 0`).
    pub(crate) begin: &'static str,
    /// Reads run inside such a transaction (`begin`), else on their own.
    pub(crate) reads_in_transaction: bool,
    /// When a claim in flight may be taken over, in the type of `locked_until`:
    /// what `Statements::lock_left` counts down to.
    pub(crate) takeover_at: &'static str,
}

/// The statements of a committed claim's life after it is taken, for one table.
/// Parameters are positional (`?`), in the order each statement names.
#[derive(Debug)]
pub(crate) struct Statements {
    /// Completes the claim with the response, inside the handler's transaction,
    /// while `lease` holds it and its lock is ahead: status, headers, body, scope,
    /// key, lease. One row changed: recorded.
    pub(crate) record: Arc<str>,
    /// Deletes a claim that was not recorded, if `lease` still holds it: scope,
    /// key, lease.
    pub(crate) release: Arc<str>,
    /// The milliseconds left on the claim's lock, when `lease` still holds it and
    /// its lock is ahead: the fence a handler starts behind (scope, key, lease).
    /// The cluster mode's is its ended mark (`mysql::cluster`).
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) holds: Arc<str>,
    /// Milliseconds left until the key's claim may be taken over (its lock,
    /// and in a cluster the margin `Dialect::takeover_at` adds): scope, key.
    pub(crate) lock_left: Arc<str>,
    /// Age and lock left of the key's claim: scope, key.
    in_flight: Box<str>,
    /// The row an operator would delete: scope, key.
    forget_read: Box<str>,
    /// Deletes the completed row read under its lease: scope, key, lease.
    forget_delete: Box<str>,
    begin: &'static str,
    reads_in_transaction: bool,
}

impl Statements {
    /// The statements for `table`, named as the SQL must name it.
    pub(crate) fn new(dialect: &Dialect, table: &str) -> Self {
        let now = dialect.now;
        // A duplicate is told to come back when a takeover may happen; an
        // operator is shown the lock itself, as every backend's listing shows it.
        let takeover_left = (dialect.ms_until)(dialect.takeover_at);
        let lock_left = (dialect.ms_until)("locked_until");
        let age = (dialect.ms_since)("created_at");
        let key = "scope = ? AND idempotency_key = ?";
        // A completed row without a body is the mark of a transaction ended behind
        // idem's back; while its lock is ahead its executor may still be finding
        // that out: as much in flight as a claim.
        let held = format!("(state = 'processing' OR (body IS NULL AND locked_until > {now}))");
        Self {
            record: format!(
                "UPDATE {table} SET state = 'completed', status = ?, headers = ?, body = ? \
                 WHERE {key} AND lease = ? AND state = 'processing' AND locked_until > {now}"
            )
            .into(),
            release: format!(
                "DELETE FROM {table} WHERE {key} AND lease = ? AND state = 'processing'"
            )
            .into(),
            holds: format!(
                "SELECT {lock_left} FROM {table} \
                 WHERE {key} AND lease = ? AND state = 'processing' AND locked_until > {now}"
            )
            .into(),
            lock_left: format!(
                "SELECT {takeover_left} FROM {table} WHERE {key} AND state = 'processing'"
            )
            .into(),
            in_flight: format!(
                "SELECT {age}, {lock_left} FROM {table} WHERE {key} AND state = 'processing'"
            )
            .into(),
            forget_read: format!(
                "SELECT lease, CASE WHEN {held} THEN 1 ELSE 0 END FROM {table} WHERE {key}"
            )
            .into(),
            forget_delete: format!("DELETE FROM {table} WHERE {key} AND lease = ? AND NOT {held}")
                .into(),
            begin: dialect.begin,
            reads_in_transaction: dialect.reads_in_transaction,
        }
    }
}

/// What a statement's result says it changed.
pub(crate) trait Changed {
    fn rows(&self) -> u64;
}

#[cfg(feature = "mysql")]
impl Changed for sqlx::mysql::MySqlQueryResult {
    fn rows(&self) -> u64 {
        self.rows_affected()
    }
}

#[cfg(feature = "sqlite")]
impl Changed for sqlx::sqlite::SqliteQueryResult {
    fn rows(&self) -> u64 {
        self.rows_affected()
    }
}

/// Runs `read` (scope, key) as the dialect reads: on its own, or in a transaction
/// of its own that it ends. `prepared` for the reads of the request path, which
/// run often enough to keep in the connection's statement cache.
async fn read_one<DB, O>(
    conn: &mut DB::Connection,
    statements: &Statements,
    (read, prepared): (&str, bool),
    scope: &str,
    key: &str,
) -> Result<Option<O>, sqlx::Error>
where
    DB: Database + sqlx::database::HasStatementCache,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'a> DB::Arguments: sqlx::IntoArguments<DB>,
    for<'e> &'e str: sqlx::Encode<'e, DB> + sqlx::Type<DB>,
    O: for<'r> sqlx::FromRow<'r, DB::Row> + Send + Unpin,
{
    let query = sqlx::query_as::<_, O>(AssertSqlSafe(read.to_owned()))
        .persistent(prepared)
        .bind(scope)
        .bind(key);
    if !statements.reads_in_transaction {
        return query.fetch_optional(conn).await;
    }
    let mut tx = conn
        .begin_with(AssertSqlSafe(statements.begin.to_owned()))
        .await?;
    let row = query.fetch_optional(&mut *tx).await?;
    tx.commit().await?;
    Ok(row)
}

/// The milliseconds left on (scope, key)'s claim when `lease` still holds it
/// with its lock ahead, else `None`: a claim committed before the handler's
/// transaction may have lost both in between (its process paused, its `BEGIN`
/// kept waiting for a writer), and the handler must then not start beside the
/// executor that took the key over; when it does start, it has what is left.
#[cfg(feature = "sqlite")]
pub(crate) async fn holds<DB>(
    conn: &mut DB::Connection,
    statements: &Statements,
    scope: &str,
    key: &str,
    lease: i64,
) -> Result<Option<i64>, sqlx::Error>
where
    DB: Database + sqlx::database::HasStatementCache,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'a> DB::Arguments: sqlx::IntoArguments<DB>,
    for<'e> &'e str: sqlx::Encode<'e, DB> + sqlx::Type<DB>,
    for<'e> i64: sqlx::Encode<'e, DB> + sqlx::Type<DB>,
    (i64,): for<'r> sqlx::FromRow<'r, DB::Row>,
{
    let left = sqlx::query_as::<_, (i64,)>(AssertSqlSafe(statements.holds.to_string()))
        .bind(scope)
        .bind(key)
        .bind(lease)
        .fetch_optional(conn)
        .await?;
    Ok(left.map(|(ms,)| ms))
}

/// Milliseconds left on the lock of the key's claim; `None` when it has none.
pub(crate) async fn lock_left<DB>(
    conn: &mut DB::Connection,
    statements: &Statements,
    scope: &str,
    key: &str,
) -> Result<Option<i64>, sqlx::Error>
where
    DB: Database + sqlx::database::HasStatementCache,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'a> DB::Arguments: sqlx::IntoArguments<DB>,
    for<'e> &'e str: sqlx::Encode<'e, DB> + sqlx::Type<DB>,
    (i64,): for<'r> sqlx::FromRow<'r, DB::Row>,
{
    let left = read_one::<DB, (i64,)>(conn, statements, (&statements.lock_left, true), scope, key);
    Ok(left.await?.map(|(ms,)| ms))
}

/// Whether an executor holds (scope, key): its claim is a committed row, read
/// without waiting for anyone.
pub(crate) async fn in_flight<DB>(
    conn: &mut DB::Connection,
    statements: &Statements,
    scope: &str,
    key: &str,
) -> Result<Option<InFlight>, sqlx::Error>
where
    DB: Database + sqlx::database::HasStatementCache,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'a> DB::Arguments: sqlx::IntoArguments<DB>,
    for<'e> &'e str: sqlx::Encode<'e, DB> + sqlx::Type<DB>,
    (i64, i64): for<'r> sqlx::FromRow<'r, DB::Row>,
{
    let read = (&*statements.in_flight, false);
    let claim = read_one::<DB, (i64, i64)>(conn, statements, read, scope, key);
    Ok(claim.await?.map(|(age_ms, lock_left_ms)| InFlight {
        session: None,
        age_ms: Some(age_ms),
        lock_left_ms: Some(lock_left_ms),
    }))
}

/// Deletes (scope, key)'s completed record, the one read and no other, unless an
/// executor holds the key: the row is read without waiting, then deleted under
/// the lease read in a transaction of idem's own (`Dialect::begin`, as the
/// database's writers take their lock), so that a claim taken meanwhile is never
/// deleted.
pub(crate) async fn forget<DB>(
    conn: &mut DB::Connection,
    statements: &Statements,
    scope: &str,
    key: &str,
) -> Result<Forgotten, sqlx::Error>
where
    DB: Database + sqlx::database::HasStatementCache,
    DB::QueryResult: Changed,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'a> DB::Arguments: sqlx::IntoArguments<DB>,
    for<'e> &'e str: sqlx::Encode<'e, DB> + sqlx::Type<DB>,
    for<'e> i64: sqlx::Encode<'e, DB> + sqlx::Type<DB>,
    (i64, i64): for<'r> sqlx::FromRow<'r, DB::Row>,
{
    let read = || {
        sqlx::query_as::<_, (i64, i64)>(AssertSqlSafe(statements.forget_read.to_string()))
            .persistent(false)
            .bind(scope)
            .bind(key)
    };
    // Read before the transaction where reads need none (no write lock is taken
    // for a key that is not to be deleted), else in it.
    let before = if statements.reads_in_transaction {
        None
    } else {
        match read().fetch_optional(&mut *conn).await? {
            None => return Ok(Forgotten::NotFound),
            Some((_, 1)) => return Ok(Forgotten::InFlight),
            Some((lease, _)) => Some(lease),
        }
    };
    let mut tx = conn
        .begin_with(AssertSqlSafe(statements.begin.to_owned()))
        .await?;
    let lease = match before {
        Some(lease) => lease,
        None => match read().fetch_optional(&mut *tx).await? {
            None => {
                tx.commit().await?;
                return Ok(Forgotten::NotFound);
            }
            Some((_, 1)) => {
                tx.commit().await?;
                return Ok(Forgotten::InFlight);
            }
            Some((lease, _)) => lease,
        },
    };
    let deleted = sqlx::query(AssertSqlSafe(statements.forget_delete.to_string()))
        .persistent(false)
        .bind(scope)
        .bind(key)
        .bind(lease)
        .execute(&mut *tx)
        .await?
        .rows();
    if deleted == 1 {
        tx.commit().await?;
        return Ok(Forgotten::Deleted);
    }
    let now = read().fetch_optional(&mut *tx).await?;
    tx.rollback().await?;
    Ok(match now {
        None => Forgotten::NotFound,
        Some((_, 1)) => Forgotten::InFlight,
        Some(_) => Forgotten::Changed,
    })
}
