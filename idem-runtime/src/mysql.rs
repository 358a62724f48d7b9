//! MySQL and MariaDB: the claim lives inside the handler's own transaction, behind
//! a named lock.
//!
//! The design, what differs from PostgreSQL and why, are described in
//! `docs/backends.md`; the SQL below is all this backend runs.

use std::sync::Arc;

use sqlx::{AssertSqlSafe, Connection, MySql, MySqlConnection, Transaction};
use sqlx_core::transaction::TransactionManager as _;

use crate::backend::{
    Applied, Claim, Found, Identity, Layout, Migration, Opened, Recorded, sealed::Driver,
};
use crate::backend::{KeyRecord, Query, delete_completed, fetch};
use crate::key::to_hex;

/// The claim's named lock, from its seed: 45 characters, within MySQL's 64.
const LOCK_NAME: &str =
    "CONCAT('idem:', LEFT(SHA2(CONCAT(COALESCE(DATABASE(), ''), ':', ?), 256), 40))";

#[doc(hidden)]
#[derive(Debug)]
pub struct Sql {
    lookup: Arc<str>,
    claim_new: Arc<str>,
    claim_over: Arc<str>,
    record: Arc<str>,
    /// The record written on its own, when the server ended the transaction.
    record_alone: Arc<str>,
    lock_left: Arc<str>,
    /// The named lock alone, taken before a takeover touches the row.
    lock: Arc<str>,
    finish: Arc<str>,
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

    fn idem_sql(table: &str, _layout: Layout) -> Sql {
        // The claim's parameters as columns of `v`, in `Claim::bind` order: for the
        // `UPDATE`, whose `SET` comes before its `WHERE`.
        let params = "SELECT ? AS scope, ? AS idempotency_key, ? AS lease, ? AS method, \
                      ? AS path, ? AS fingerprint, ? AS lock_ms, ? AS ttl_ms, ? AS content_type";
        Sql {
            lookup: format!(
                "SELECT state, method, path, content_type, fingerprint, \
                        CAST(status AS SIGNED) AS status, headers, body, \
                        CAST(locked_until > UTC_TIMESTAMP(6) AS SIGNED) AS live, \
                        CAST(CEIL(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) / 1000) \
                             AS SIGNED) AS ttl_left_ms \
                 FROM {table} WHERE scope = ? AND idempotency_key = ?"
            )
            .into(),
            // Plain placeholders here, in `Claim::bind` order: a derived table would
            // be materialised as a temporary table on every claim.
            claim_new: format!(
                "INSERT INTO {table} (scope, idempotency_key, state, lease, method, path, \
                        fingerprint, locked_until, expires_at, created_at, content_type) \
                 SELECT ?, ?, 'processing', ?, ?, ?, ?, \
                        UTC_TIMESTAMP(6) + INTERVAL (? * 1000) MICROSECOND, \
                        UTC_TIMESTAMP(6) + INTERVAL (? * 1000) MICROSECOND, \
                        UTC_TIMESTAMP(6), ? \
                 FROM DUAL WHERE GET_LOCK({LOCK_NAME}, 0) = 1"
            )
            .into(),
            claim_over: format!(
                "UPDATE {table} AS r JOIN ({params}) AS v \
                   ON r.scope = v.scope AND r.idempotency_key = v.idempotency_key \
                 SET r.state = 'processing', r.lease = v.lease, r.method = v.method, \
                     r.path = v.path, r.fingerprint = v.fingerprint, \
                     r.content_type = v.content_type, r.status = NULL, \
                     r.headers = NULL, r.body = NULL, \
                     r.locked_until = UTC_TIMESTAMP(6) + INTERVAL (v.lock_ms * 1000) MICROSECOND, \
                     r.expires_at = UTC_TIMESTAMP(6) + INTERVAL (v.ttl_ms * 1000) MICROSECOND, \
                     r.created_at = UTC_TIMESTAMP(6) \
                 WHERE r.expires_at <= UTC_TIMESTAMP(6) \
                    OR (r.state = 'processing' AND r.locked_until <= UTC_TIMESTAMP(6))"
            )
            .into(),
            record: format!(
                "UPDATE {table} SET state = 'completed', status = ?, headers = ?, body = ? \
                 WHERE scope = ? AND idempotency_key = ? AND lease = ? \
                   AND state = 'processing' AND locked_until > UTC_TIMESTAMP(6)"
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
            // Only while this session holds the key's named lock, so nobody else can
            // have claimed it, and only if no row of this claim survives (a lost
            // lease leaves its row) nor anyone else's live one.
            record_alone: format!(
                "INSERT INTO {table} (scope, idempotency_key, state, lease, method, path, \
                        fingerprint, content_type, status, headers, body, locked_until, \
                        expires_at, created_at) \
                 SELECT ?, ?, 'completed', ?, ?, ?, ?, ?, ?, ?, ?, UTC_TIMESTAMP(6), \
                        UTC_TIMESTAMP(6) + INTERVAL (? * 1000) MICROSECOND, UTC_TIMESTAMP(6) \
                 FROM DUAL \
                 WHERE IS_USED_LOCK({LOCK_NAME}) = CONNECTION_ID() \
                   AND NOT EXISTS (SELECT 1 FROM {table} k \
                        WHERE k.scope = ? AND k.idempotency_key = ? \
                          AND (k.lease = ? OR (k.expires_at > UTC_TIMESTAMP(6) \
                               AND (k.state = 'completed' OR k.locked_until > UTC_TIMESTAMP(6))))) \
                 ON DUPLICATE KEY UPDATE state = 'completed', lease = VALUES(lease), \
                        method = VALUES(method), path = VALUES(path), \
                        fingerprint = VALUES(fingerprint), content_type = VALUES(content_type), \
                        status = VALUES(status), headers = VALUES(headers), body = VALUES(body), \
                        locked_until = VALUES(locked_until), expires_at = VALUES(expires_at), \
                        created_at = VALUES(created_at)"
            )
            .into(),
            lock: format!("SELECT GET_LOCK({LOCK_NAME}, 0)").into(),
            // The session's own values, saved by the claim's `BEGIN` statement; left
            // as they are when a claim failed before changing them.
            finish: format!(
                "SET SESSION wait_timeout = COALESCE(@idem_wait_timeout, @@SESSION.wait_timeout), \
                     innodb_lock_wait_timeout = \
                        COALESCE(@idem_lock_wait_timeout, @@SESSION.innodb_lock_wait_timeout), \
                     @idem_wait_timeout = NULL, @idem_lock_wait_timeout = NULL, \
                     @idem_released = RELEASE_LOCK({LOCK_NAME})"
            )
            .into(),
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
        Found::load::<MySql>(conn, &sql.lookup, id, true).await
    }

    async fn idem_open<'c>(
        conn: &'c mut MySqlConnection,
        sql: &'c Sql,
        id: &'c Identity<'c>,
        claim: Claim,
    ) -> Result<Opened<'c, MySql>, sqlx::Error> {
        // A completed key this process kept was answered from its replay cache
        // before this; any other is probably new, so it is claimed first and read
        // only if the claim fails.
        let mut tx = begin(conn, claim).await?;
        let claimed = claim
            .bind(id, sqlx::query(AssertSqlSafe(sql.claim_new.clone())))
            .bind(lock_seed(id))
            .execute(&mut *tx)
            .await;
        match claimed {
            Ok(done) if done.rows_affected() == 1 => return Ok(Opened::Claimed(tx)),
            Ok(_) => {}
            Err(sqlx::Error::Database(error)) if error.is_unique_violation() => {}
            Err(error) => {
                // The engine releases the named lock (`idem_finish`).
                return Err(error);
            }
        }
        // Taken, or its lock busy: read what is stored (a row a failed INSERT
        // found is committed; an executor's own claim is not visible), then free
        // what the attempt took. The ROLLBACK goes out with the next statement.
        let found = Found::load::<MySql>(&mut tx, &sql.lookup, id, true).await?;
        finish(&mut tx, sql, id).await?;
        drop(tx);
        Ok(found.map_or(Opened::Lost, Opened::Found))
    }

    async fn idem_claim<'c>(
        conn: &'c mut MySqlConnection,
        sql: &'c Sql,
        id: &'c Identity<'c>,
        claim: Claim,
    ) -> Result<Option<Transaction<'c, MySql>>, sqlx::Error> {
        let statement = if claim.replace {
            &sql.claim_over
        } else {
            &sql.claim_new
        };
        if claim.replace {
            // A takeover locks its row as it reads it, so the named lock decides
            // first: duplicates of an expired key are answered at once instead of
            // queueing on the row, each holding a pooled connection.
            let locked: Option<i64> = sqlx::query_scalar(AssertSqlSafe(sql.lock.clone()))
                .bind(lock_seed(id))
                .fetch_one(&mut *conn)
                .await?;
            if locked != Some(1) {
                return Ok(None);
            }
        }
        // On an error the engine releases the named lock (`idem_finish`).
        let mut tx = begin(conn, claim).await?;
        let mut query = claim.bind(id, sqlx::query(AssertSqlSafe(statement.clone())));
        if !claim.replace {
            query = query.bind(lock_seed(id));
        }
        let claimed = query.execute(&mut *tx).await;
        let lost = match claimed {
            Ok(done) if done.rows_affected() == 1 => return Ok(Some(tx)),
            Ok(_) => Ok(()),
            Err(sqlx::Error::Database(error)) if error.is_unique_violation() => Ok(()),
            Err(error) => Err(error),
        };
        // Lost: nothing of ours may stay on the session, the named lock included
        // (it is not transactional, so releasing it inside the transaction is fine).
        finish(&mut tx, sql, id).await?;
        tx.rollback().await?;
        lost.map(|()| None)
    }

    async fn idem_begin(conn: &mut MySqlConnection) -> Result<Transaction<'_, MySql>, sqlx::Error> {
        conn.begin().await
    }

    async fn idem_record<'c>(
        conn: &'c mut MySqlConnection,
        sql: &'c Sql,
        id: &'c Identity<'c>,
        lease: i64,
        response: Recorded<'c>,
        _announce: Option<u64>,
    ) -> Result<bool, sqlx::Error> {
        let status = i16::try_from(response.status).unwrap_or(i16::MAX);
        let done = sqlx::query(AssertSqlSafe(sql.record.clone()))
            .bind(status)
            .bind(response.headers)
            .bind(response.body)
            .bind(id.scope)
            .bind(id.key)
            .bind(lease)
            .execute(&mut *conn)
            .await?;
        if done.rows_affected() == 1 {
            return Ok(true);
        }
        // A deadlock rolls the whole transaction back, claim included, and what the
        // handler ran after it committed statement by statement. If that is what
        // happened (this session still holds the named lock, and no row of this
        // claim is left), the handler's answer is recorded on its own, so a retry
        // replays it instead of running the handler, and its writes, again.
        let alone = sqlx::query(AssertSqlSafe(sql.record_alone.clone()))
            .bind(id.scope)
            .bind(id.key)
            .bind(lease)
            .bind(id.method)
            .bind(id.path)
            .bind(&id.fingerprint[..])
            .bind(id.content_type)
            .bind(status)
            .bind(response.headers)
            .bind(response.body)
            .bind(response.ttl_ms)
            .bind(lock_seed(id))
            .bind(id.scope)
            .bind(id.key)
            .bind(lease)
            .execute(conn)
            .await?;
        let recorded = alone.rows_affected() > 0;
        if recorded {
            tracing::warn!(
                "the database ended the handler's transaction (a deadlock?); its answer was recorded on its own"
            );
        }
        Ok(recorded)
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
        id: &Identity<'_>,
    ) -> Result<(), sqlx::Error> {
        // `finish` rides on the COMMIT, one round trip for both: a text query, so
        // the lock's seed (hex digits) is written into it.
        let quoted = format!("'{}'", lock_seed(id));
        let commit = format!("COMMIT; {}", sql.finish.replacen('?', &quoted, 1));
        sqlx::raw_sql(AssertSqlSafe(commit))
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
        id: &Identity<'_>,
        _lease: i64,
        committed: bool,
    ) -> Result<(), sqlx::Error> {
        // The row needs nothing: the claim was part of the transaction. After a
        // commit, `idem_commit` has finished already.
        if committed {
            return Ok(());
        }
        finish(conn, sql, id).await
    }

    async fn idem_sweep(
        conn: &mut MySqlConnection,
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
        conn: &mut MySqlConnection,
        table: &str,
        scope: &str,
        key: &str,
    ) -> Result<bool, sqlx::Error> {
        let placeholder = |_| "?".to_owned();
        let done = delete_completed::<MySql>(conn, table, placeholder, scope, key).await?;
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
        fetch::<MySql>(conn, sql, params).await
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

/// Releases the claim's named lock and restores the session's timeouts.
/// Begins the claim's transaction, the session's timeouts set to its lock in the
/// same round trip; their own values are saved, to be restored by `finish`.
async fn begin(
    conn: &mut MySqlConnection,
    claim: Claim,
) -> Result<Transaction<'_, MySql>, sqlx::Error> {
    let wait_secs = claim.lock_ms.saturating_add(999) / 1000;
    let begin = format!(
        "SET @idem_wait_timeout = @@SESSION.wait_timeout, \
             @idem_lock_wait_timeout = @@SESSION.innodb_lock_wait_timeout; \
         SET SESSION wait_timeout = {wait_secs}, innodb_lock_wait_timeout = {wait_secs}; \
         BEGIN"
    );
    conn.begin_with(AssertSqlSafe(begin)).await
}

async fn finish(
    conn: &mut MySqlConnection,
    sql: &Sql,
    id: &Identity<'_>,
) -> Result<(), sqlx::Error> {
    sqlx::query(AssertSqlSafe(sql.finish.clone()))
        .bind(lock_seed(id))
        .execute(conn)
        .await?;
    Ok(())
}

/// Hex SHA-256 over (table, scope, key); the SQL mixes in the database name and
/// keeps 40 hex digits, within MySQL's 64-character limit on lock names.
fn lock_seed(id: &Identity<'_>) -> String {
    to_hex(&id.digest)
}
