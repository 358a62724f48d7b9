//! MySQL and MariaDB: the claim lives inside the handler's own transaction, behind
//! a named lock.
//!
//! The design, what differs from PostgreSQL and why, are described in
//! `docs/backends.md`; the SQL below is all this backend runs.

use std::sync::Arc;

use sha2::{Digest as _, Sha256};
use sqlx::mysql::MySqlDatabaseError;
use sqlx::{AssertSqlSafe, Connection, MySql, MySqlConnection, Transaction};
use sqlx_core::transaction::TransactionManager as _;

use crate::backend::{
    Applied, Claim, Found, Identity, Layout, Migration, Opened, Recorded, sealed::Driver,
};
use crate::backend::{KeyRecord, Query, delete_completed, fetch};
use crate::key::to_hex;
use crate::tx::Open;

/// The claim's named lock, from its seed: 45 characters, within MySQL's 64. Named
/// locks are the server's, not a database's: the session's database is part of
/// the name. Every release of idem names a key's lock the same, so instances of
/// two releases exclude each other during a rolling deploy.
const LOCK_NAME: &str =
    "CONCAT('idem:', LEFT(SHA2(CONCAT(COALESCE(DATABASE(), ''), ':', ?), 256), 40))";

#[doc(hidden)]
#[derive(Debug)]
pub struct Sql {
    lookup: Arc<str>,
    /// `lookup` up to its `WHERE`, for `idem_lookup` to write the key out after.
    lookup_from: Box<str>,
    /// The look at (scope, key) after the claim tried the key's named lock:
    /// whether it was taken, and whether there is a row.
    open: Arc<str>,
    record: Arc<str>,
    lock_left: Arc<str>,
    /// Frees what the claim took on the session: the named lock, and the session's
    /// own timeouts back.
    finish: Arc<str>,
    /// `COMMIT`, then `finish`, in one round trip.
    commit: Arc<str>,
    /// `ROLLBACK`, then `finish`, in one round trip: ends a claim that did not
    /// take the key, and the transaction its reads opened on a session with
    /// `autocommit = 0`.
    rollback: Arc<str>,
    /// The table, for the check `new_key_check` writes out per key.
    table: Box<str>,
    /// The database the pool connects to (empty: none), for `lock_name`.
    database: Box<str>,
    /// Whether the session's database is `database`, as SQL. `X'…'` compares as
    /// bytes: a database named with another case or collation takes the server's
    /// way, which names the lock as every release always has.
    in_database: Box<str>,
    sweep: Arc<str>,
}

impl Driver for MySql {
    type IdemSql = Sql;

    fn idem_migrations(_layout: Layout) -> &'static [Migration] {
        &[
            Migration {
                sql: include_str!("../migrations/mysql/0001_idempotency_keys.sql"),
                applied: Applied::TableExists,
            },
            Migration {
                sql: include_str!("../migrations/mysql/0002_content_type_and_sizes.sql"),
                applied: Applied::HasColumn("content_type"),
            },
        ]
    }

    fn idem_sql(table: &str, _layout: Layout, pool: &sqlx::MySqlPool) -> Sql {
        let finish = "SET SESSION \
                wait_timeout = CAST(COALESCE(@idem_wait_timeout, @@SESSION.wait_timeout) AS UNSIGNED), \
                innodb_lock_wait_timeout = CAST(COALESCE(@idem_lock_wait_timeout, \
                    @@SESSION.innodb_lock_wait_timeout) AS UNSIGNED), \
                @idem_released = RELEASE_LOCK(@idem_lock)";
        let options = pool.connect_options();
        let database = options.get_database().unwrap_or_default();
        let lookup_from = format!(
            "SELECT state, method, path, content_type, fingerprint, \
                    CAST(status AS SIGNED) AS status, headers, body, \
                    CAST(locked_until > UTC_TIMESTAMP(6) AS SIGNED) AS live, \
                    CAST(CEIL(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) / 1000) \
                         AS SIGNED) AS ttl_left_ms \
             FROM {table} WHERE"
        );
        Sql {
            lookup: format!("{lookup_from} scope = ? AND idempotency_key = ?").into(),
            lookup_from: lookup_from.into(),
            // A read after the lock (see `claim_text`): it sees every row committed
            // before the lock's last holder let it go. Only whether there is a row:
            // a new key, the common case, needs no more (every column costs its
            // description in every answer); `lookup` reads the rest when there is
            // one.
            open: format!(
                "SELECT CAST(@idem_locked AS SIGNED) AS locked, \
                        CAST(r.scope IS NOT NULL AS SIGNED) AS stored \
                 FROM (SELECT 1 AS one) AS o \
                 LEFT JOIN {table} AS r ON r.scope = ? AND r.idempotency_key = ?"
            )
            .into(),
            // Only while this session holds the key's named lock, taken before the
            // row was read (so the key is free, or its row expired or abandoned),
            // and only before the lock's end by the database clock. Also what records
            // a handler's answer after a deadlock ended its transaction: the
            // statements it ran after that committed one by one, and so does this.
            record: format!(
                "INSERT INTO {table} (scope, idempotency_key, state, lease, method, path, \
                        fingerprint, content_type, status, headers, body, locked_until, \
                        expires_at, created_at) \
                 SELECT ?, ?, 'completed', ?, ?, ?, ?, ?, ?, ?, ?, @idem_until, \
                        @idem_at + INTERVAL (? * 1000) MICROSECOND, @idem_at \
                 FROM DUAL \
                 WHERE @idem_until > UTC_TIMESTAMP(6) AND IS_USED_LOCK(@idem_lock) = CONNECTION_ID() \
                 ON DUPLICATE KEY UPDATE state = 'completed', lease = VALUES(lease), \
                        method = VALUES(method), path = VALUES(path), \
                        fingerprint = VALUES(fingerprint), content_type = VALUES(content_type), \
                        status = VALUES(status), headers = VALUES(headers), body = VALUES(body), \
                        locked_until = VALUES(locked_until), expires_at = VALUES(expires_at), \
                        created_at = VALUES(created_at)"
            )
            .into(),
            // The holder's claim is not visible, but its named lock is, and the start
            // of its transaction usually (INNODB_TRX needs the PROCESS privilege and
            // is a snapshot up to 0.1 s old). Unknown start: the whole lock is left.
            lock_left: format!(
                "SELECT CAST(? - COALESCE((SELECT TIMESTAMPDIFF(MICROSECOND, t.trx_started, NOW(6)) / 1000 \
                                           FROM information_schema.INNODB_TRX t \
                                           WHERE t.trx_mysql_thread_id = h.holder), 0) AS SIGNED) \
                 FROM (SELECT IS_USED_LOCK({LOCK_NAME}) AS holder) h WHERE h.holder IS NOT NULL"
            )
            .into(),
            sweep: format!(
                "DELETE FROM {table} \
                 WHERE state = 'completed' AND expires_at <= UTC_TIMESTAMP(6) \
                 ORDER BY expires_at LIMIT ?"
            )
            .into(),
            commit: format!("COMMIT; {finish}").into(),
            rollback: format!("ROLLBACK; {finish}").into(),
            table: table.into(),
            finish: finish.into(),
            in_database: format!("COALESCE(DATABASE(), '') = X'{}'", to_hex(database.as_bytes()))
                .into(),
            database: database.into(),
        }
    }

    async fn idem_migrate(
        conn: &mut MySqlConnection,
        table: &str,
        scripts: &[(String, Applied)],
    ) -> Result<(), sqlx::Error> {
        // DDL commits implicitly in MySQL: a named lock, not a transaction, keeps
        // instances that start together from racing.
        let locked: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK('idem:migrate', 60)")
            .fetch_one(&mut *conn)
            .await?;
        if locked != Some(1) {
            return Err(sqlx::Error::Protocol(
                "timed out waiting for the idem:migrate lock".into(),
            ));
        }
        let migrated = apply(conn, table, scripts).await;
        sqlx::query("DO RELEASE_LOCK('idem:migrate')")
            .execute(&mut *conn)
            .await?;
        migrated
    }

    async fn idem_lookup(
        conn: &mut MySqlConnection,
        sql: &Sql,
        id: &Identity<'_>,
    ) -> Result<Option<Found>, sqlx::Error> {
        // Outside any transaction, where a session with `autocommit = 0` opens one
        // that nothing else would end: the `COMMIT` rides in the same round trip.
        let text = format!("{} {}; COMMIT", sql.lookup_from, key_filter(id));
        let rows = sqlx::raw_sql(AssertSqlSafe(text)).fetch_all(conn).await?;
        rows.first().map(Found::decode).transpose()
    }

    async fn idem_open<'c>(
        conn: &'c mut MySqlConnection,
        sql: &'c Sql,
        id: &'c Identity<'c>,
        claim: Claim,
    ) -> Result<Opened<'c, MySql>, sqlx::Error> {
        // A completed key this process kept was answered from its replay cache
        // before this; any other is probably new, so the claim is one round trip,
        // whose check fails unless the key's lock is taken and it has no row
        // (`new_key_check`), and whose `BEGIN` then opens the handler's transaction.
        let text = claim_text(sql, id, claim, Some(&new_key_check(sql, id)));
        match conn.begin_with(AssertSqlSafe(text)).await {
            // Adopted here, so that the connection is free for the arm below.
            Ok(tx) => return Ok(Opened::Adopted(Open::adopt(tx))),
            Err(error) if taken(&error) => {}
            Err(error) => return Err(error),
        }
        // Stored, or its lock busy: the text stopped at the check, before its
        // `BEGIN`. What is stored is read, then the claim frees what it took (and
        // ends the transaction a session with `autocommit = 0` opened for the
        // reads). (A row swept between the check and the read answers as in flight:
        // the retry claims the key.)
        let (_, found) = read(conn, sql, id).await?;
        sqlx::raw_sql(AssertSqlSafe(sql.rollback.clone()))
            .execute(&mut *conn)
            .await?;
        Ok(found.map_or(Opened::Lost, Opened::Found))
    }

    async fn idem_claim<'c>(
        conn: &'c mut MySqlConnection,
        sql: &'c Sql,
        id: &'c Identity<'c>,
        claim: Claim,
    ) -> Result<Option<Transaction<'c, MySql>>, sqlx::Error> {
        // A row the engine found expired or abandoned, read again under the lock:
        // whoever took the lock meanwhile may have recorded it since.
        let text = claim_text(sql, id, claim, None);
        sqlx::raw_sql(AssertSqlSafe(text))
            .execute(&mut *conn)
            .await?;
        let (locked, found) = read(conn, sql, id).await?;
        if locked && found.as_ref().is_none_or(Found::replaceable) {
            return conn.begin().await.map(Some);
        }
        sqlx::raw_sql(AssertSqlSafe(sql.rollback.clone()))
            .execute(&mut *conn)
            .await?;
        Ok(None)
    }

    async fn idem_begin(conn: &mut MySqlConnection) -> Result<Transaction<'_, MySql>, sqlx::Error> {
        conn.begin().await
    }

    async fn idem_record<'c>(
        conn: &'c mut MySqlConnection,
        sql: &'c Sql,
        id: &'c Identity<'c>,
        claim: Claim,
        response: Recorded<'c>,
        _announce: Option<u64>,
    ) -> Result<bool, sqlx::Error> {
        let status = i16::try_from(response.status).unwrap_or(i16::MAX);
        let done = sqlx::query(AssertSqlSafe(sql.record.clone()))
            .bind(id.scope)
            .bind(id.key)
            .bind(claim.lease)
            .bind(id.method)
            .bind(id.path)
            .bind(&id.fingerprint[..])
            .bind(id.content_type)
            .bind(status)
            .bind(response.headers)
            .bind(response.body)
            .bind(response.ttl_ms)
            .execute(conn)
            .await?;
        // One row inserted, or an expired one replaced (two, as MySQL counts it).
        Ok(done.rows_affected() > 0)
    }

    async fn idem_lock_left(
        conn: &mut MySqlConnection,
        sql: &Sql,
        id: &Identity<'_>,
        lock_ms: i64,
    ) -> Result<Option<i64>, sqlx::Error> {
        sqlx::query_scalar(AssertSqlSafe(sql.lock_left.clone()))
            .bind(lock_ms)
            .bind(lock_seed(id))
            .fetch_optional(conn)
            .await
    }

    async fn idem_commit(
        conn: &mut MySqlConnection,
        sql: &Sql,
        _id: &Identity<'_>,
    ) -> Result<(), sqlx::Error> {
        // `finish` rides on the COMMIT, one round trip for both.
        sqlx::raw_sql(AssertSqlSafe(sql.commit.clone()))
            .execute(&mut *conn)
            .await?;
        // sqlx still counts the transaction the server has just ended; its ROLLBACK
        // does nothing now and goes out with the connection's next statement.
        <MySql as sqlx::Database>::TransactionManager::start_rollback(conn);
        Ok(())
    }

    async fn idem_finish(
        conn: &mut MySqlConnection,
        sql: &Sql,
        _id: &Identity<'_>,
        _lease: i64,
        committed: bool,
    ) -> Result<(), sqlx::Error> {
        // The row needs nothing: the claim was part of the transaction. After a
        // commit, `idem_commit` has finished already.
        if committed {
            return Ok(());
        }
        finish(conn, sql).await
    }

    async fn idem_sweep(
        conn: &mut MySqlConnection,
        sql: &Sql,
        limit: i64,
    ) -> Result<u64, sqlx::Error> {
        // In a transaction of its own, so that a session with `autocommit = 0`
        // commits it too.
        let mut tx = conn.begin().await?;
        let done = sqlx::query(AssertSqlSafe(sql.sweep.clone()))
            .bind(limit)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(done.rows_affected())
    }

    async fn idem_forget(
        conn: &mut MySqlConnection,
        table: &str,
        scope: &str,
        key: &str,
    ) -> Result<bool, sqlx::Error> {
        let placeholder = |_| "?".to_owned();
        // As the sweep: committed whatever the session's `autocommit`.
        let mut tx = conn.begin().await?;
        let done = delete_completed::<MySql>(&mut tx, table, placeholder, scope, key).await?;
        tx.commit().await?;
        Ok(done.rows_affected() > 0)
    }

    async fn idem_inspect(
        conn: &mut MySqlConnection,
        table: &str,
        query: &Query<'_>,
    ) -> Result<Vec<KeyRecord>, sqlx::Error> {
        let (filter, limit, payload, params) = query.parts(|_| "?".to_owned(), "UTC_TIMESTAMP(6)");
        let stored = if payload {
            "COALESCE(headers, '') AS headers, COALESCE(body, '') AS body"
        } else {
            "CAST('' AS BINARY) AS headers, CAST('' AS BINARY) AS body"
        };
        let sql = format!(
            "SELECT CAST(scope AS CHAR) AS scope, CAST(idempotency_key AS CHAR) AS idempotency_key, \
                    state, method, path, CAST(status AS SIGNED) AS status, {stored}, \
                    CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), locked_until) DIV 1000 AS SIGNED) AS lock_left_ms, \
                    CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) DIV 1000 AS SIGNED) AS expires_in_ms, \
                    CAST(TIMESTAMPDIFF(MICROSECOND, created_at, UTC_TIMESTAMP(6)) DIV 1000 AS SIGNED) AS age_ms \
             FROM {table} WHERE {filter} ORDER BY created_at LIMIT {limit}"
        );
        // In a transaction of its own: a fresh snapshot, which a session with
        // `autocommit = 0` does not leave open when the connection goes back.
        let mut tx = conn.begin().await?;
        let records = fetch::<MySql>(&mut tx, sql, params).await?;
        tx.commit().await?;
        Ok(records)
    }
}

/// Applies the scripts `table` lacks. A script that changes an existing table adds
/// its marker column last, in the same statement as the rest.
async fn apply(
    conn: &mut MySqlConnection,
    table: &str,
    scripts: &[(String, Applied)],
) -> Result<(), sqlx::Error> {
    for (script, applied) in scripts {
        let probe = match applied {
            Applied::Rerun => None,
            Applied::TableExists => Some(
                sqlx::query_scalar::<_, i64>(
                    "SELECT COUNT(*) FROM information_schema.TABLES \
                     WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
                )
                .bind(table),
            ),
            Applied::HasColumn(column) => Some(
                sqlx::query_scalar::<_, i64>(
                    "SELECT COUNT(*) FROM information_schema.COLUMNS \
                     WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? AND COLUMN_NAME = ?",
                )
                .bind(table)
                .bind(*column),
            ),
        };
        if let Some(probe) = probe
            && probe.fetch_one(&mut *conn).await? > 0
        {
            continue;
        }
        sqlx::raw_sql(AssertSqlSafe(script.clone()))
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

/// What the claim takes on the session, as one text: the session's timeouts set
/// to its lock (their own values saved, for `finish` to restore), the key's named
/// lock tried and the claim's times by the database clock; a `COMMIT`; then
/// `check` and a `BEGIN`, when given. The key's row is read only after the lock
/// and outside the handler's transaction: on its own, a plain `SELECT` is a
/// consistent read at every isolation level, where inside the transaction
/// SERIALIZABLE would make it a locking read, whose lock on the index's gap holds
/// up other keys' records (measured: one waited for minutes, starved by the
/// checks of the keys after it). The `COMMIT` ends a transaction that a session
/// with `autocommit = 0` may hold open, whose snapshot could predate the lock;
/// there, the reads open a transaction of their own, which the `BEGIN` or the
/// claim's `rollback` ends.
fn claim_text(sql: &Sql, id: &Identity<'_>, claim: Claim, check: Option<&str>) -> String {
    let wait_secs = claim.lock_ms.saturating_add(999) / 1000;
    let lock_us = claim.lock_ms.saturating_mul(1000);
    let lock = lock_name(sql, id);
    let then = check
        .map(|check| format!("; {check}; BEGIN"))
        .unwrap_or_default();
    // One SET evaluates every value before it assigns any: the saved timeouts are
    // the session's own, and the lock's name is stored before the lock is tried.
    format!(
        "SET @idem_wait_timeout = @@SESSION.wait_timeout, \
             @idem_lock_wait_timeout = @@SESSION.innodb_lock_wait_timeout, \
             SESSION wait_timeout = {wait_secs}, SESSION innodb_lock_wait_timeout = {wait_secs}, \
             @idem_lock = {lock}, @idem_locked = GET_LOCK({lock}, 0), \
             @idem_at = UTC_TIMESTAMP(6), \
             @idem_until = UTC_TIMESTAMP(6) + INTERVAL {lock_us} MICROSECOND; \
         COMMIT{then}"
    )
}

/// The statement of the claim that fails unless the lock was taken and the key
/// has no row: sqlx's `BEGIN` returns no rows, but its error comes back, and the
/// text stops there, before its `BEGIN`. The largest `BIGINT UNSIGNED` plus 1 for
/// a busy lock or a stored row is error 1690, whatever the `sql_mode` (which `DO`
/// would turn into a warning). It reads after the lock: its snapshot holds every
/// row committed before the lock's last holder let it go. A plain `SELECT` is a
/// consistent read, where `SET` over the same subquery would lock the index's gap
/// and hold up other keys' records. Scope and key are written as hex, which
/// cannot end the literal.
fn new_key_check(sql: &Sql, id: &Identity<'_>) -> String {
    format!(
        "SELECT 18446744073709551615 + IF(@idem_locked <=> 1, 0, 1) \
                + EXISTS (SELECT 1 FROM {} WHERE {})",
        sql.table,
        key_filter(id),
    )
}

/// `id`'s row as a condition written into a text query: scope and key as hex
/// literals, which cannot end the literal and compare as bytes.
fn key_filter(id: &Identity<'_>) -> String {
    format!(
        "scope = X'{}' AND idempotency_key = X'{}'",
        to_hex(id.scope.as_bytes()),
        to_hex(id.key.as_bytes()),
    )
}

/// Whether `error` is `new_key_check` failing: the key is locked or stored.
fn taken(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(|error| error.try_downcast_ref::<MySqlDatabaseError>())
        .is_some_and(|error| error.number() == 1690)
}

/// Reads after the claim's lock, outside the handler's transaction (see
/// `claim_text`): whether the lock was taken and what is stored (in full only
/// when there is a row). Only holders of the lock write the row, so between the
/// two reads it can only have been deleted (swept, or forgotten).
async fn read(
    conn: &mut MySqlConnection,
    sql: &Sql,
    id: &Identity<'_>,
) -> Result<(bool, Option<Found>), sqlx::Error> {
    let (locked, stored): (Option<i64>, i64) = sqlx::query_as(AssertSqlSafe(sql.open.clone()))
        .bind(id.scope)
        .bind(id.key)
        .fetch_one(&mut *conn)
        .await?;
    let found = if stored == 1 {
        Found::load::<MySql>(conn, &sql.lookup, id, true).await?
    } else {
        None
    };
    Ok((locked == Some(1), found))
}

/// The key's named lock as an SQL expression. `LOCK_NAME` costs the server more
/// than the rest of the claim's `SET` (about 20 µs a time, measured on MariaDB
/// 10.11), so the name is computed here for the pool's database, and the server
/// computes it only for a session that has moved to another one.
fn lock_name(sql: &Sql, id: &Identity<'_>) -> String {
    // The seed is hex digits, and the database is written as hex: both can go
    // into the text.
    let seed = lock_seed(id);
    let digest = Sha256::digest(format!("{}:{seed}", sql.database));
    let name = &to_hex(&digest)[..40];
    let by_server = LOCK_NAME.replacen('?', &format!("'{seed}'"), 1);
    format!("IF({}, 'idem:{name}', {by_server})", sql.in_database)
}

/// Frees what `claim_text` took on the session (see `Sql::finish`).
async fn finish(conn: &mut MySqlConnection, sql: &Sql) -> Result<(), sqlx::Error> {
    sqlx::query(AssertSqlSafe(sql.finish.clone()))
        .execute(conn)
        .await?;
    Ok(())
}

/// Hex SHA-256 over (table, scope, key); the SQL mixes in the database name and
/// keeps 40 hex digits, within MySQL's 64-character limit on lock names.
fn lock_seed(id: &Identity<'_>) -> String {
    to_hex(&id.digest)
}
