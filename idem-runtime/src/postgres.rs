//! PostgreSQL: the claim lives inside the handler's own transaction.
//!
//! The design and its measured cost are described in `docs/backends.md` (rendered
//! on [`Backend`](crate::Backend)); the SQL below is all this backend runs.

use std::sync::Arc;

use sha2::{Digest, Sha256};
use sqlx::{AssertSqlSafe, Connection, PgConnection, Postgres, Row, Transaction};

use crate::backend::{Claim, Found, Identity, Recorded, sealed::Store};

/// Taken with every claim: the advisory try-lock (never waits), and the timeouts
/// that end the transaction at `lock` even if the application is frozen. Both hold
/// until the transaction ends; `set_config(.., true)` is `SET LOCAL` without a round
/// trip of its own.
const LOCK_AND_TIMEOUTS: &str = "pg_try_advisory_xact_lock(hashtextextended(current_schema(), $9)) \
     AND set_config('statement_timeout', $10, true) IS NOT NULL \
     AND set_config('idle_in_transaction_session_timeout', $10, true) IS NOT NULL";

#[doc(hidden)]
#[derive(Debug)]
pub struct Sql {
    table: Arc<str>,
    lookup: Arc<str>,
    claim_new: Arc<str>,
    claim_over: Arc<str>,
    record: Arc<str>,
    sweep: Arc<str>,
}

impl Store for Postgres {
    type IdemSql = Sql;

    const IDEM_MIGRATION: &'static str =
        include_str!("../../migrations/postgres/0001_idempotency_keys.sql");

    fn idem_sql(table: &str) -> Sql {
        Sql {
            table: table.into(),
            lookup: format!(
                "SELECT state, method, path, fingerprint, status, headers, body, \
                        locked_until > clock_timestamp() AS live, \
                        expires_at > clock_timestamp() AS fresh \
                 FROM {table} WHERE scope = $1 AND idempotency_key = $2"
            )
            .into(),
            claim_new: format!(
                "INSERT INTO {table} (scope, idempotency_key, state, lease, method, path, \
                        fingerprint, locked_until, expires_at, created_at) \
                 SELECT $1, $2, 'processing', $3, $4, $5, $6, \
                        clock_timestamp() + $7::float8 * interval '1 millisecond', \
                        clock_timestamp() + $8::float8 * interval '1 millisecond', \
                        clock_timestamp() \
                 WHERE {LOCK_AND_TIMEOUTS} \
                 RETURNING lease"
            )
            .into(),
            claim_over: format!(
                "UPDATE {table} SET state = 'processing', lease = $3, method = $4, path = $5, \
                        fingerprint = $6, status = NULL, headers = NULL, body = NULL, \
                        locked_until = clock_timestamp() + $7::float8 * interval '1 millisecond', \
                        expires_at = clock_timestamp() + $8::float8 * interval '1 millisecond', \
                        created_at = clock_timestamp() \
                 WHERE scope = $1 AND idempotency_key = $2 \
                   AND (expires_at <= clock_timestamp() \
                        OR (state = 'processing' AND locked_until <= clock_timestamp())) \
                   AND {LOCK_AND_TIMEOUTS} \
                 RETURNING lease"
            )
            .into(),
            record: format!(
                "UPDATE {table} SET state = 'completed', status = $4, headers = $5, body = $6 \
                 WHERE scope = $1 AND idempotency_key = $2 AND lease = $3 \
                   AND state = 'processing' AND locked_until > clock_timestamp()"
            )
            .into(),
            // SKIP LOCKED: a row a claim is taking over right now is left for the
            // next sweep instead of making either wait.
            sweep: format!(
                "DELETE FROM {table} WHERE (scope, idempotency_key) IN ( \
                    SELECT scope, idempotency_key FROM {table} \
                    WHERE state = 'completed' AND expires_at <= clock_timestamp() \
                    ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED)"
            )
            .into(),
        }
    }

    async fn idem_migrate(conn: &mut PgConnection, script: &str) -> Result<(), sqlx::Error> {
        let mut tx = conn.begin().await?;
        // Serialises instances that start together: concurrent CREATE TABLE IF NOT
        // EXISTS can still collide in the catalog.
        sqlx::query("SELECT pg_advisory_xact_lock(7306086953163416933)")
            .execute(&mut *tx)
            .await?;
        sqlx::raw_sql(AssertSqlSafe(script.to_owned()))
            .execute(&mut *tx)
            .await?;
        tx.commit().await
    }

    async fn idem_lookup(
        conn: &mut PgConnection,
        sql: &Sql,
        id: &Identity<'_>,
    ) -> Result<Option<Found>, sqlx::Error> {
        let row = sqlx::query(AssertSqlSafe(sql.lookup.clone()))
            .bind(id.scope)
            .bind(id.key)
            .fetch_optional(conn)
            .await?;
        row.map(|row| {
            Ok(Found {
                completed: row.try_get::<&str, _>("state")? == "completed",
                live: row.try_get("live")?,
                fresh: row.try_get("fresh")?,
                method: row.try_get("method")?,
                path: row.try_get("path")?,
                fingerprint: row.try_get("fingerprint")?,
                status: row.try_get::<Option<i16>, _>("status")?.map(i32::from),
                headers: row.try_get("headers")?,
                body: row.try_get("body")?,
            })
        })
        .transpose()
    }

    async fn idem_claim<'c>(
        conn: &'c mut PgConnection,
        sql: &'c Sql,
        id: &'c Identity<'c>,
        claim: Claim,
    ) -> Result<Option<Transaction<'c, Postgres>>, sqlx::Error> {
        // A plain INSERT when the key was free: ON CONFLICT's speculative insertion
        // cost ~8% of throughput here. A row committed between the lookup and the
        // advisory lock then shows up as a unique violation: the race was lost.
        let statement = if claim.replace {
            &sql.claim_over
        } else {
            &sql.claim_new
        };
        let mut tx = conn.begin().await?;
        let claimed = claim
            .bind(id, sqlx::query(AssertSqlSafe(statement.clone())))
            .bind(advisory_key(&sql.table, id))
            .bind(claim.lock_ms.to_string())
            .fetch_optional(&mut *tx)
            .await;
        match claimed {
            Ok(Some(_)) => Ok(Some(tx)),
            Ok(None) => {
                tx.rollback().await?;
                Ok(None)
            }
            Err(sqlx::Error::Database(error)) if error.is_unique_violation() => {
                tx.rollback().await?;
                Ok(None)
            }
            Err(error) => Err(error),
        }
    }

    async fn idem_begin(conn: &mut PgConnection) -> Result<Transaction<'_, Postgres>, sqlx::Error> {
        conn.begin().await
    }

    async fn idem_record<'c>(
        conn: &'c mut PgConnection,
        sql: &'c Sql,
        id: &'c Identity<'c>,
        lease: i64,
        response: Recorded<'c>,
    ) -> Result<bool, sqlx::Error> {
        let status = i16::try_from(response.status).unwrap_or(i16::MAX);
        let done = sqlx::query(AssertSqlSafe(sql.record.clone()))
            .bind(id.scope)
            .bind(id.key)
            .bind(lease)
            .bind(status)
            .bind(response.headers)
            .bind(response.body)
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn idem_finish(
        _conn: &mut PgConnection,
        _sql: &Sql,
        _id: &Identity<'_>,
        _lease: i64,
        _committed: bool,
    ) -> Result<(), sqlx::Error> {
        // The claim and its advisory lock ended with the transaction.
        Ok(())
    }

    async fn idem_sweep(
        conn: &mut PgConnection,
        sql: &Sql,
        limit: i64,
    ) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(AssertSqlSafe(sql.sweep.clone()))
            .bind(limit)
            .execute(conn)
            .await?;
        Ok(done.rows_affected())
    }
}

/// The seed of the advisory lock taken with a claim: 64 bits of SHA-256 over (table,
/// scope, key); the SQL mixes in the schema. A collision between two live keys only
/// makes one of them answer 409 for a moment.
fn advisory_key(table: &str, id: &Identity<'_>) -> i64 {
    let mut hash = Sha256::new();
    for part in [table, id.scope, id.key] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part.as_bytes());
    }
    let digest = hash.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}
