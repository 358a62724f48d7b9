//! PostgreSQL: the claim lives inside the handler's own transaction.
//!
//! The design and its measured cost are described in `docs/backends.md`; the SQL
//! below is all this backend runs.

use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use futures_util::future::{Either, select};
use sqlx::postgres::{PgListener, PgPool};
use sqlx::{AssertSqlSafe, Connection, PgConnection, Postgres, Row as _, Transaction};
use sqlx_core::transaction::TransactionManager as _;
use tokio::sync::broadcast::WeakSender;
use tokio::sync::oneshot;

use crate::backend::{
    Applied, Claim, Found, Identity, Layout, Migration, Opened, Recorded, Written, enabled::Driver,
    look_then_claim,
};
use crate::backend::{Forgotten, InFlight};
use crate::backend::{KeyRecord, Parts, Query, Resealed, fetch, reseal_each};
use crate::partitions::{
    BEGIN_READ_COMMITTED, Budget, Day, DaySpec, UPGRADE_3, attach_day, read_committed,
};
use crate::signal::signal_of;
use crate::tx::{Adopted, Open};

/// What a claim requires: that the keyed transaction holds the key's advisory
/// lock, as [`Sql::opening`] left it in the transaction's setting `idem.locked`.
const LOCKED: &str = "current_setting('idem.locked', true) = 'true'";

/// [`LOCKED`] as `false`, never null, where the setting may be gone (a handler
/// ended the transaction, or ran `RESET ALL`).
const STILL_HELD: &str = "coalesce(current_setting('idem.locked', true), '') = 'true'";

/// The advisory lock of key `seed` in `table`. Keyed on the table itself (its oid,
/// resolved as the statement's own table name is), so instances whose
/// `search_path` differs take the same lock for the same table, and distinct
/// tables never share one.
fn lock_id(table: &str, seed: &str) -> String {
    format!("hashint8extended({seed}, '{table}'::regclass::oid::int8)")
}

/// Milliseconds left on the lock of the claim holding advisory lock seed `$1`, for
/// an endpoint whose lock is `$2` ms. The holder's claim is not visible, but its
/// advisory lock is, and the start of its transaction to roles allowed to see it;
/// the lock counts from there (from now, when the start is hidden).
fn lock_left(table: &str) -> String {
    format!(
        "SELECT ($2 - coalesce((extract(epoch FROM clock_timestamp() - a.xact_start) * 1000)::int8, 0))::int8 \
         FROM {} \
         LEFT JOIN pg_stat_activity a ON a.pid = l.pid",
        held_lock(table, "$1", "IN (1, 2)")
    )
}

/// `pg_locks` rows `l` of the advisory lock of key `seed` in `table`, granted to
/// whichever session of this database holds it, as a `FROM` item. `forms`
/// selects by `objsubid`: 1 is the transaction lock (taken with one `int8`), 2 the
/// session lock ([`session_lock`]).
fn held_lock(table: &str, seed: &str, forms: &str) -> String {
    format!(
        "(SELECT {} AS k) s \
         JOIN pg_locks l ON l.locktype = 'advisory' AND l.granted AND l.objsubid {forms} \
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
          AND l.classid = ((s.k >> 32) & 4294967295)::oid \
          AND l.objid = (s.k & 4294967295)::oid",
        lock_id(table, seed)
    )
}

/// The arguments of the key's session lock, for lock id `key`: its 64 bits as the
/// two `int4` PostgreSQL's two-key advisory functions take. The two-key form is
/// a lock of its own (`objsubid` 2), apart from the transaction lock on the same
/// bits: a claim takes the transaction lock, then this one; a duplicate needs
/// both. The session lock outlives a transaction the handler ends itself
/// (`COMMIT`, `ROLLBACK`), so that duplicates stay out until idem has marked the
/// key `transaction-ended`; idem releases it in the last statement it sends
/// inside the claim's transaction on every path, or in its own after an end.
fn session_lock(key: &str) -> String {
    format!("(({key}) >> 32)::int4, ((({key}) << 32) >> 32)::int4")
}

/// The claim's lock id, as [`Sql::opening`] kept it in the transaction's setting
/// `idem.key` when it takes the session lock: statements after the handler find
/// it whatever `search_path` the handler left.
const KEPT_KEY: &str = "current_setting('idem.key', true)::int8";

/// Releases the key's session lock when the transaction still holds the claim's
/// (`idem.locked`), as a value; `also`, a further condition.
fn release_if_locked(also: &str) -> String {
    format!(
        "CASE WHEN {STILL_HELD}{also} \
         THEN pg_advisory_unlock({}) END",
        session_lock(KEPT_KEY)
    )
}

/// Content types in the request's identity; shared by both layouts.
const UPGRADE_2: Migration = Migration {
    version: 2,
    sql: include_str!("../migrations/postgres/0002_content_type.sql"),
    applied: Applied::HasColumn("content_type"),
};

/// The functions that open a claim's transaction and record a first execution,
/// each in one call: see the file. Shared by both layouts.
const UPGRADE_4: Migration = Migration {
    version: 4,
    sql: include_str!("../migrations/postgres/0004_record_function.sql"),
    applied: Applied::HasFunctions,
};

/// The savepoint the handler runs after: a handler that catches a database error
/// leaves PostgreSQL's transaction aborted, and rolling back to here keeps the
/// key's lock, so the claim can be taken again and the handler's own answer
/// recorded.
const HANDLER_SAVEPOINT: &str = "SAVEPOINT idem_handler";
const BACK_TO_HANDLER_SAVEPOINT: &str = "ROLLBACK TO SAVEPOINT idem_handler";

/// Saves, in settings of the transaction (`idem.<name>`), the session state idem's
/// statements after the handler depend on; [`Sql::opening`] sends it before the
/// handler runs, and [`restore_session`] reads it back: the record must find idem's
/// table (`search_path`) and may write it (the role), whatever the handler set
/// for its tenant, locally or for the session. A setting the handler changed goes
/// back to its saved value for the session, so that it does not outlive the
/// transaction either; an empty save (a `RESET ALL` in the handler cleared it)
/// keeps the current value. The authorization comes back first: it decides which
/// roles may be set (the FROM item is evaluated before the target list).
const SAVE_SESSION: &str = "\
    set_config('idem.session_authorization', current_setting('session_authorization'), true), \
    set_config('idem.role', current_setting('role'), true), \
    set_config('idem.search_path', current_setting('search_path'), true), \
    set_config('idem.default_transaction_read_only', \
        current_setting('default_transaction_read_only'), true)";

/// Whether the transaction still carries the claim's `idem.locked` (see
/// [`Sql::still_open`]); `release`, when not empty, is a second column that lets
/// the key's session lock go if it does.
fn still_locked(release: &str) -> String {
    let release = if release.is_empty() {
        String::new()
    } else {
        format!(", {release}")
    };
    format!("SELECT {STILL_HELD}{release}")
}

/// Restores what [`SAVE_SESSION`] saved (see there); the record's first statement. A
/// setting is set only when it changed: setting the authorization or the role
/// costs the server catalog look-ups and a report to the client. Its first column,
/// `held`, says whether the transaction is still the one the claim opened (see
/// [`Sql::still_open`]); `release`, when not empty, is a value computed with it
/// (the session lock let go).
fn restore_session(release: &str) -> String {
    let release = if release.is_empty() {
        String::new()
    } else {
        format!("{release}, ")
    };
    format!(
        "SELECT \
     {STILL_HELD} AS held, {release}\
     CASE WHEN current_setting('role') <> r THEN set_config('role', r, false) END, \
     CASE WHEN current_setting('search_path') <> p THEN set_config('search_path', p, false) END, \
     CASE WHEN current_setting('default_transaction_read_only') <> d \
          THEN set_config('default_transaction_read_only', d, false) END \
     FROM (SELECT \
         coalesce(nullif(current_setting('idem.role', true), ''), current_setting('role')) AS r, \
         coalesce(nullif(current_setting('idem.search_path', true), ''), \
             current_setting('search_path')) AS p, \
         coalesce(nullif(current_setting('idem.default_transaction_read_only', true), ''), \
             current_setting('default_transaction_read_only')) AS d, \
         CASE WHEN current_setting('session_authorization') <> a \
              THEN set_config('session_authorization', a, false) END \
         FROM (SELECT coalesce(nullif(current_setting('idem.session_authorization', true), ''), \
             current_setting('session_authorization')) AS a) AS authorized) AS saved"
    )
}

#[doc(hidden)]
#[derive(Debug)]
pub struct Sql {
    lookup: Arc<str>,
    claim_new: Arc<str>,
    claim_over: Arc<str>,
    record: Arc<str>,
    /// `record` that also announces the completion to waiters on every instance.
    record_announced: Arc<str>,
    sweep: Arc<str>,
    lock_left: Arc<str>,
    /// The layout partitioned by day: its claim checks for an existing row itself.
    partitioned: bool,
    /// Plain layout only: the lookup that also claims the key when it finds nothing.
    open: Option<Arc<str>>,
    /// Statements stay prepared on their connection: not through a transaction
    /// pooler, where every statement is sent unprepared and inside a transaction.
    prepared: bool,
    /// Claims also take the key's session lock ([`session_lock`]): whenever the
    /// connection is the session's own, i.e. not through a transaction pooler,
    /// which would hand a lock that outlives a transaction to another client.
    /// Then the statements above that claim release it when they do not.
    session: bool,
    /// [`restore_session`]; with the session lock, released.
    restore: Arc<str>,
    /// [`still_locked`]; with the session lock, released.
    still_locked: Arc<str>,
    /// Whether the session holds the key's transaction lock (seed `$1`), and with
    /// the session lock, releases that when it does.
    still_open: Arc<str>,
    table: Box<str>,
    /// The table's functions (upgrade 4) every role may call, once looked up by
    /// [`Sql::find_functions`].
    functions: OnceLock<Functions>,
    /// Set when a call of the open function failed for want of the function or
    /// of the right to call it (dropped, revoked since the look-up): from then on
    /// this store opens with the statement.
    open_call_failed: AtomicBool,
    /// The same for the record function: from then on this store sends the two
    /// statements.
    record_call_failed: AtomicBool,
}

/// What [`Sql::find_functions`] found of upgrade 4.
#[derive(Debug)]
struct Functions {
    /// The open function's schema-qualified name.
    open: Option<Box<str>>,
    /// The statement that restores the session and records in one round trip.
    record: Option<Arc<str>>,
}

/// The plain layout's migrations.
const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        sql: include_str!("../migrations/postgres/0001_idempotency_keys.sql"),
        applied: Applied::TableExists,
    },
    UPGRADE_2,
    UPGRADE_4,
];

/// The partitioned layout's. Once its table exists, the first script is skipped: it
/// would create a default partition again after maintenance retired it.
const PARTITIONED_MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        sql: include_str!("../migrations/postgres/partitioned/0001_idempotency_keys.sql"),
        applied: Applied::TableExists,
    },
    UPGRADE_2,
    UPGRADE_3,
    UPGRADE_4,
];

impl Driver for Postgres {
    type IdemSql = Sql;

    fn idem_migrations(layout: Layout) -> &'static [Migration] {
        if layout.partitioned {
            PARTITIONED_MIGRATIONS
        } else {
            MIGRATIONS
        }
    }

    fn idem_sql(table: &str, layout: Layout, _pool: &PgPool) -> Sql {
        let partitioned = layout.partitioned;
        // Plain layout: the primary key keeps (scope, key) unique. Partitioned: the
        // key includes `expires_at`, so the claim, which reads after the lock was
        // taken, inserts only if no partition holds the key.
        let new_guard = if partitioned {
            format!(
                "{LOCKED} AND NOT EXISTS \
                 (SELECT 1 FROM {table} WHERE scope = $1 AND idempotency_key = $2)"
            )
        } else {
            LOCKED.to_owned()
        };
        let columns = "state, method, path, content_type, fingerprint, status::int8 AS status, \
                       headers, body, \
                       (locked_until > clock_timestamp())::int::int8 AS live, \
                       ceil(extract(epoch FROM expires_at - clock_timestamp()) * 1000)::int8 \
                         AS ttl_left_ms";
        let lookup =
            format!("SELECT {columns} FROM {table} WHERE scope = $1 AND idempotency_key = $2");
        let insert = format!(
            "INSERT INTO {table} (scope, idempotency_key, state, lease, method, path, \
                    fingerprint, locked_until, expires_at, created_at, content_type) \
             SELECT $1, $2, 'processing', $3, $4, $5, $6, \
                    clock_timestamp() + $7::float8 * interval '1 millisecond', \
                    clock_timestamp() + $8::float8 * interval '1 millisecond', \
                    clock_timestamp(), $9"
        );
        let session = !layout.transaction_pooled;
        // With the session lock, a statement that could claim lets the lock go
        // when it did not.
        let release = |claimed: &str| {
            if session {
                let not_claimed = format!(" AND NOT EXISTS (SELECT 1 FROM {claimed})");
                format!(", {} AS released", release_if_locked(&not_claimed))
            } else {
                String::new()
            }
        };
        let open = (!partitioned).then(|| {
            format!(
                "WITH found AS MATERIALIZED ({lookup}), \
                 claimed AS ({insert} \
                    WHERE NOT EXISTS (SELECT 1 FROM found) AND {LOCKED} \
                    RETURNING lease) \
                 SELECT (SELECT lease FROM claimed) AS claimed{}, found.* \
                 FROM (VALUES (1)) AS one (x) LEFT JOIN found ON true",
                release("claimed")
            )
            .into()
        });
        let claiming = |claim: String| -> Arc<str> {
            if session {
                format!(
                    "WITH claimed AS ({claim} RETURNING lease) \
                     SELECT (SELECT lease FROM claimed) AS lease{}",
                    release("claimed")
                )
            } else {
                format!("{claim} RETURNING lease")
            }
            .into()
        };
        let released = if session {
            release_if_locked("")
        } else {
            String::new()
        };
        let held_here = format!(
            "SELECT EXISTS (SELECT 1 FROM {} WHERE l.pid = pg_backend_pid())",
            held_lock(table, "$1", "= 1")
        );
        let record = format!(
            "UPDATE {table} SET state = 'completed', status = $4, headers = $5, body = $6 \
             WHERE scope = $1 AND idempotency_key = $2 AND lease = $3 \
               AND state = 'processing' AND locked_until > clock_timestamp()"
        );
        Sql {
            partitioned,
            open,
            prepared: !layout.transaction_pooled,
            session,
            restore: restore_session(&released).into(),
            still_locked: still_locked(&released).into(),
            still_open: if session {
                format!(
                    "SELECT held, CASE WHEN held THEN pg_advisory_unlock({}) END \
                     FROM ({held_here}) AS open (held)",
                    session_lock(&lock_id(table, "$1"))
                )
            } else {
                held_here
            }
            .into(),
            table: table.into(),
            functions: OnceLock::new(),
            open_call_failed: AtomicBool::new(false),
            record_call_failed: AtomicBool::new(false),
            lock_left: lock_left(table).into(),
            lookup: lookup.into(),
            claim_new: claiming(format!("{insert} WHERE {new_guard}")),
            claim_over: claiming(format!(
                "UPDATE {table} SET state = 'processing', lease = $3, method = $4, path = $5, \
                        fingerprint = $6, content_type = $9, status = NULL, headers = NULL, \
                        body = NULL, \
                        locked_until = clock_timestamp() + $7::float8 * interval '1 millisecond', \
                        expires_at = clock_timestamp() + $8::float8 * interval '1 millisecond', \
                        created_at = clock_timestamp() \
                 WHERE scope = $1 AND idempotency_key = $2 \
                   AND (expires_at <= clock_timestamp() \
                        OR (state = 'processing' AND locked_until <= clock_timestamp())) \
                   AND {LOCKED}"
            )),
            record: record.as_str().into(),
            // NOTIFY is delivered at commit, and only then: a waiter woken by it
            // finds the record.
            record_announced: format!(
                "WITH done AS ({record} RETURNING pg_notify('{CHANNEL}', $7)) \
                 SELECT count(*) FROM done"
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

    async fn idem_migrate(
        conn: &mut PgConnection,
        _sql: &Sql,
        table: &str,
        scripts: &[(String, Applied)],
    ) -> Result<(), sqlx::Error> {
        // READ COMMITTED: the checks below must see what an instance that held the
        // lock before committed.
        let mut tx = read_committed(conn).await?;
        // Serialises instances that start together: concurrent CREATE TABLE IF NOT
        // EXISTS can still collide in the catalog. Simple protocol: nothing is
        // prepared, so a transaction pooler is fine.
        sqlx::raw_sql("SELECT pg_advisory_xact_lock(7306086953163416933)")
            .execute(&mut *tx)
            .await?;
        // DDL is transactional: every script applies, or none.
        for (script, applied) in scripts {
            let in_place = match applied {
                Applied::Rerun => false,
                Applied::TableExists => {
                    sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
                        .persistent(false)
                        .bind(table)
                        .fetch_one(&mut *tx)
                        .await?
                }
                Applied::HasColumn(column) => {
                    sqlx::query_scalar(
                        "SELECT EXISTS (SELECT 1 FROM pg_attribute \
                         WHERE attrelid = to_regclass($1) AND attname = $2 AND NOT attisdropped)",
                    )
                    .persistent(false)
                    .bind(table)
                    .bind(*column)
                    .fetch_one(&mut *tx)
                    .await?
                }
                Applied::HasFunctions => sqlx::query_scalar(
                    "SELECT to_regprocedure($1) IS NOT NULL AND to_regprocedure($2) IS NOT NULL",
                )
                .persistent(false)
                .bind(open_function(table))
                .bind(record_function(table))
                .fetch_one(&mut *tx)
                .await?,
            };
            if !in_place {
                sqlx::raw_sql(AssertSqlSafe(script.clone()))
                    .execute(&mut *tx)
                    .await?;
            }
        }
        tx.commit().await
    }

    async fn idem_lookup(
        conn: &mut PgConnection,
        sql: &Sql,
        id: &Identity<'_>,
    ) -> Result<Option<Found>, sqlx::Error> {
        if sql.prepared {
            return Found::load::<Postgres>(conn, &sql.lookup, id, true).await;
        }
        // Through a transaction pooler an unprepared statement must not stand
        // alone; the rollback goes out with the connection's next use.
        let mut tx = read_committed(conn).await?;
        Found::load::<Postgres>(&mut tx, &sql.lookup, id, false).await
    }

    async fn idem_claim<'c>(
        conn: &'c mut PgConnection,
        sql: &'c Sql,
        id: &'c Identity<'c>,
        claim: Claim,
    ) -> Result<Option<Adopted>, sqlx::Error> {
        // A plain INSERT when the key was free: ON CONFLICT's speculative insertion
        // cost ~8% of throughput here. A row committed between the lookup and the
        // advisory lock then shows up as a unique violation: the race was lost.
        sql.find_functions(conn).await?;
        let mut tx = sql.opening(conn, id, claim.lock_ms).await?;
        match sql.take(&mut tx, id, claim).await {
            Ok(true) => Ok(Some(Open::adopt(tx))),
            // The statement let the session lock go.
            Ok(false) => {
                tx.rollback().await?;
                Ok(None)
            }
            Err(error) if lost_race(&error) => {
                sql.give_up(tx, id).await?;
                Ok(None)
            }
            Err(error) => {
                // The session must not keep the key's lock: the error goes back
                // to the engine, which may pool the connection again.
                if let Err(release) = sql.give_up(tx, id).await {
                    tracing::debug!(%release, "could not let a failed claim go");
                }
                Err(error)
            }
        }
    }

    async fn idem_open<'c>(
        conn: &'c mut PgConnection,
        sql: &'c Sql,
        id: &'c Identity<'c>,
        claim: Claim,
    ) -> Result<Opened<'c, Postgres>, sqlx::Error> {
        // A completed key this process committed or read lately is answered from
        // its replay cache before this; any other is probably new, so it is
        // claimed in the statement that reads it.
        let Some(open) = &sql.open else {
            return look_then_claim(conn, sql, id, claim).await;
        };
        sql.find_functions(conn).await?;
        let mut tx = sql.opening(conn, id, claim.lock_ms).await?;
        let row = claim
            .bind(id, sqlx::query(AssertSqlSafe(open.clone())))
            .persistent(sql.prepared)
            .fetch_one(&mut *tx)
            .await;
        let row = match row {
            Ok(row) => row,
            Err(error) if lost_race(&error) => {
                sql.give_up(tx, id).await?;
                return Ok(Opened::Lost);
            }
            Err(error) => {
                if let Err(release) = sql.give_up(tx, id).await {
                    tracing::debug!(%release, "could not let a failed claim go");
                }
                return Err(error);
            }
        };
        if row.try_get::<Option<i64>, _>("claimed")?.is_some() {
            return Ok(Opened::Claimed(tx));
        }
        // Nothing was written, and the statement let the session lock go: the
        // rollback goes out at the connection's next use (for a replay, the
        // pool's check on release, after the answer) instead of delaying the answer.
        drop(tx);
        if row.try_get::<Option<String>, _>("state")?.is_none() {
            // Not visible yet, and the lock is taken: another executor is at work.
            return Ok(Opened::Lost);
        }
        Found::decode(&row).map(Opened::Found)
    }

    async fn idem_repair(
        conn: &mut PgConnection,
        sql: &Sql,
        error: &sqlx::Error,
        ttl_ms: i64,
    ) -> Result<bool, sqlx::Error> {
        // Partitioned layout: a key whose day has no partition (maintenance is
        // late, or its days ahead fall short of this ttl) fails its check; the
        // claim attaches the day itself, as maintenance would.
        let missing_day = sql.partitioned
            && matches!(error, sqlx::Error::Database(e) if e.code().as_deref() == Some("23514"));
        if !missing_day {
            return Ok(false);
        }
        let (name, day) = attach_day(
            conn,
            &sql.table,
            DaySpec::ExpiryAfterMs(ttl_ms),
            Budget::Claim,
        )
        .await?;
        if day == Day::Created {
            tracing::info!(partition = %name, "attached a missing day partition for a claim");
        }
        Ok(day != Day::InDefault)
    }

    async fn idem_begin(conn: &mut PgConnection) -> Result<Transaction<'_, Postgres>, sqlx::Error> {
        conn.begin().await
    }

    async fn idem_record<'c>(
        conn: &'c mut PgConnection,
        sql: &'c Sql,
        id: &'c Identity<'c>,
        claim: Claim,
        response: Recorded<'c>,
        announce: Option<u64>,
    ) -> Result<Written, sqlx::Error> {
        // The session comes back as the claim saw it (and, with the session lock,
        // that lets it go: the transaction lock holds the key until the commit),
        // then the record; in one statement where the record function can be used.
        // `Some(-1)`: the transaction is no longer the claim's; `Some(n)`: recorded
        // `n` rows; `None`: restored, the record is still to send.
        let restored = match sql.record_call() {
            Some(call) => record_in_one(conn, sql, call, id, claim.lease, &response, announce)
                .await
                .inspect_err(|error| sql.record_call_failed(error))
                .map(Some),
            None => sqlx::query(AssertSqlSafe(sql.restore.clone()))
                .persistent(sql.prepared)
                .fetch_one(&mut *conn)
                .await
                .and_then(|row| row.try_get::<bool, _>("held"))
                .map(|held| (!held).then_some(-1)),
        };
        match restored {
            Ok(Some(recorded)) if recorded >= 0 => return Ok(Written::held(recorded == 1)),
            Ok(Some(_)) => {
                if !sql.still_open(conn, id).await? {
                    sql.ended(conn, id, claim.lease, claim.ttl_ms).await?;
                    return Ok(Written::Ended);
                }
            }
            Ok(None) => {}
            // The handler caught a database error and answered anyway: what it
            // wrote is void, as PostgreSQL voids an aborted transaction's writes.
            // The claim, taken after the savepoint, went with it, but the key's
            // lock, taken before, still holds: nobody else can have claimed the
            // key meanwhile, so it is claimed again, as it was. Whatever the
            // handler set after the savepoint is undone with it.
            Err(sqlx::Error::Database(error)) if error.code().as_deref() == Some("25P02") => {
                sqlx::raw_sql(BACK_TO_HANDLER_SAVEPOINT)
                    .execute(&mut *conn)
                    .await?;
                if !sql.take(conn, id, claim).await? {
                    return Ok(Written::LeaseLost);
                }
                sql.release(conn, id).await?;
            }
            Err(error) => return Err(error),
        }
        record(conn, sql, id, claim.lease, &response, announce)
            .await
            .map(Written::held)
    }

    async fn idem_rollback(
        conn: &mut PgConnection,
        sql: &Sql,
        id: &Identity<'_>,
        claim: Claim,
    ) -> Result<bool, sqlx::Error> {
        // Only a transaction that is still the claim's is rolled back; one the
        // handler ended itself may have committed some of its writes.
        // With the session lock, these let it go when the transaction is ours.
        let held = sqlx::query(AssertSqlSafe(sql.still_locked.clone()))
            .persistent(sql.prepared)
            .fetch_one(&mut *conn)
            .await
            .and_then(|row| row.try_get::<bool, _>(0));
        let (ours, released) = match held {
            Ok(true) => (true, true),
            // Aborted by a failed statement: still the claim's transaction.
            Err(sqlx::Error::Database(error)) if error.code().as_deref() == Some("25P02") => {
                (true, false)
            }
            Ok(false) => (sql.still_open(conn, id).await?, true),
            Err(error) => return Err(error),
        };
        if ours {
            <Postgres as sqlx::Database>::TransactionManager::rollback(conn).await?;
            if !released {
                sql.release(conn, id).await?;
            }
            return Ok(false);
        }
        sql.ended(conn, id, claim.lease, claim.ttl_ms).await?;
        Ok(true)
    }

    async fn idem_lock_left(
        conn: &mut PgConnection,
        sql: &Sql,
        id: &Identity<'_>,
        lock_ms: i64,
    ) -> Result<Option<i64>, sqlx::Error> {
        let query = sqlx::query_scalar(AssertSqlSafe(sql.lock_left.clone()))
            .persistent(sql.prepared)
            .bind(advisory_key(id))
            .bind(lock_ms);
        if sql.prepared {
            return query.fetch_optional(conn).await;
        }
        let mut tx = read_committed(conn).await?;
        query.fetch_optional(&mut *tx).await
    }

    fn idem_watch(pool: &PgPool, signals: WeakSender<u64>, stop: oneshot::Receiver<()>) {
        tokio::spawn(relay_announcements(pool.clone(), signals, stop));
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
        // READ COMMITTED whatever the default: at SERIALIZABLE a sweep would take
        // part in conflict tracking, fail, and fail the claims it overlapped.
        let mut tx = read_committed(conn).await?;
        let done = sqlx::query(AssertSqlSafe(sql.sweep.clone()))
            .persistent(sql.prepared)
            .bind(limit)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(done.rows_affected())
    }

    async fn idem_forget(
        conn: &mut PgConnection,
        sql: &Sql,
        scope: &str,
        key: &str,
        digest: &[u8; 32],
    ) -> Result<Forgotten, sqlx::Error> {
        // One transaction, so that it is safe through a transaction pooler; at READ
        // COMMITTED, so that the read after the lock sees every commit before it.
        let mut tx = read_committed(conn).await?;
        // The key is taken as a claim takes it, with a try-lock that never waits;
        // a claim whose handler ended its own transaction still holds the key's
        // session lock until idem has marked it.
        let free: bool = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT pg_try_advisory_xact_lock({}) \
                    AND NOT EXISTS (SELECT 1 FROM {} WHERE l.pid <> pg_backend_pid())",
            lock_id(&sql.table, "$1"),
            held_lock(&sql.table, "$1", "= 2"),
        )))
        .persistent(false)
        .bind(advisory_seed(digest))
        .fetch_one(&mut *tx)
        .await?;
        // Whatever is not deleted lets the key's lock go at once, not when the
        // pool next pings the connection.
        if !free {
            tx.rollback().await?;
            return Ok(Forgotten::InFlight);
        }
        // A row a transaction has locked (an expired record being run again) is
        // in flight: NOWAIT answers at once instead of waiting for its commit.
        let read: Result<Vec<(i64, String)>, _> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT lease, state FROM {} WHERE scope = $1 AND idempotency_key = $2 \
             FOR UPDATE NOWAIT",
            sql.table
        )))
        .persistent(false)
        .bind(scope)
        .bind(key)
        .fetch_all(&mut *tx)
        .await;
        let kept = match read {
            // lock_not_available
            Err(sqlx::Error::Database(error)) if error.code().as_deref() == Some("55P03") => {
                Forgotten::InFlight
            }
            Err(error) => return Err(error),
            Ok(rows) if rows.is_empty() => Forgotten::NotFound,
            Ok(rows) if rows.iter().any(|(_, state)| state != "completed") => Forgotten::InFlight,
            Ok(rows) => {
                let leases: Vec<i64> = rows.iter().map(|(lease, _)| *lease).collect();
                sqlx::query(AssertSqlSafe(format!(
                    "DELETE FROM {} WHERE scope = $1 AND idempotency_key = $2 \
                       AND state = 'completed' AND lease = ANY($3)",
                    sql.table
                )))
                .persistent(false)
                .bind(scope)
                .bind(key)
                .bind(leases)
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
                return Ok(Forgotten::Deleted);
            }
        };
        tx.rollback().await?;
        Ok(kept)
    }

    async fn idem_in_flight(
        conn: &mut PgConnection,
        sql: &Sql,
        _scope: &str,
        _key: &str,
        digest: &[u8; 32],
    ) -> Result<Option<InFlight>, sqlx::Error> {
        // The claim is not visible before it commits; its advisory lock is, in
        // either form (the session lock outlives a transaction the handler ended).
        let mut tx = conn.begin().await?;
        let held: Option<(i64, Option<i64>)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT l.pid::int8, \
                    (extract(epoch FROM clock_timestamp() - a.xact_start) * 1000)::int8 \
             FROM {} LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE l.pid <> pg_backend_pid() ORDER BY l.objsubid LIMIT 1",
            held_lock(&sql.table, "$1", "IN (1, 2)")
        )))
        .persistent(false)
        .bind(advisory_seed(digest))
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(held.map(|(pid, age_ms)| InFlight {
            session: Some(pid),
            age_ms,
            lock_left_ms: None,
        }))
    }

    async fn idem_inspect(
        conn: &mut PgConnection,
        sql: &Sql,
        query: &Query<'_>,
    ) -> Result<Vec<KeyRecord>, sqlx::Error> {
        let Parts {
            filter,
            order,
            limit,
            payload,
            params,
        } = query.parts(|n| format!("${n}"), "clock_timestamp()");
        let stored = if payload {
            "coalesce(headers, ''::bytea) AS headers, coalesce(body, ''::bytea) AS body"
        } else {
            "''::bytea AS headers, ''::bytea AS body"
        };
        let sql = format!(
            "SELECT scope, idempotency_key, state, method, path, status::bigint AS status, lease, \
                    content_type, fingerprint, {stored}, \
                    (extract(epoch FROM locked_until - clock_timestamp()) * 1000)::bigint AS lock_left_ms, \
                    (extract(epoch FROM expires_at - clock_timestamp()) * 1000)::bigint AS expires_in_ms, \
                    (extract(epoch FROM clock_timestamp() - created_at) * 1000)::bigint AS age_ms \
             FROM {} WHERE {filter} ORDER BY {order} LIMIT {limit}",
            sql.table
        );
        // In a transaction, so that it is safe through a transaction pooler.
        let mut tx = conn.begin().await?;
        fetch::<Postgres>(&mut tx, sql, params).await
    }

    async fn idem_reseal(
        conn: &mut PgConnection,
        sql: &Sql,
        writes: &[Resealed<'_>],
    ) -> Result<u64, sqlx::Error> {
        // At READ COMMITTED: safe through a pooler, and never a serialization
        // failure at SERIALIZABLE for the requests beside it. Rows of completed
        // records only, which no claim waits for unless it takes one over.
        let mut tx = read_committed(conn).await?;
        let statement = format!(
            "UPDATE {} SET fingerprint = $1, status = 0, headers = ''::bytea, body = $2 \
             WHERE scope = $3 AND idempotency_key = $4 AND lease = $5 AND state = 'completed'",
            sql.table
        );
        let changed = sqlx::postgres::PgQueryResult::rows_affected;
        let written = reseal_each::<Postgres>(&mut tx, &statement, writes, changed).await?;
        tx.commit().await?;
        Ok(written)
    }
}

impl Sql {
    /// Opens a keyed transaction in the round trip of its `BEGIN`, which sqlx sends
    /// alone anyway: the timeouts that end the transaction at its lock (`lock_ms`)
    /// even if the application is frozen; the key's advisory try-lock, which never
    /// waits, its outcome kept for the claim in the transaction's setting
    /// `idem.locked` (`LOCKED`); and the handler's savepoint. All of it holds until
    /// the transaction ends. Where the table's open function can be used (upgrade
    /// 4), it does all of it in one call. The literals are integers and the
    /// configured table name, never request data. The partitioned layout's claim
    /// must see every row committed before the lock was granted, which only READ
    /// COMMITTED guarantees: a snapshot taken by the statement that takes the lock
    /// predates it.
    async fn opening<'c>(
        &self,
        conn: &'c mut PgConnection,
        id: &Identity<'_>,
        lock_ms: i64,
    ) -> Result<Transaction<'c, Postgres>, sqlx::Error> {
        let begin = if self.partitioned {
            BEGIN_READ_COMMITTED
        } else {
            "BEGIN"
        };
        // PostgreSQL 17's `transaction_timeout` is armed when the transaction
        // begins: a shorter default would end every keyed transaction before its
        // lock, however often it is retried. Set to 0 first, it is disarmed; set
        // again, it counts the lock from now.
        let whole = conn.server_version_num().is_some_and(|v| v >= 170_000);
        if let Some(open) = self.open_call() {
            // The same in a call: a statement this short costs the server little to
            // parse and plan on every claim, unlike the one below.
            let seed = advisory_key(id);
            let session = self.session;
            return conn
                .begin_with(AssertSqlSafe(format!(
                    "{begin}; SELECT {open}('{seed}'::int8, {lock_ms}, {whole}, {session}); \
                     {HANDLER_SAVEPOINT}"
                )))
                .await
                .inspect_err(|error| self.open_call_failed(error));
        }
        let lock = lock_id(&self.table, &format!("'{}'::int8", advisory_key(id)));
        let whole = if whole {
            format!(
                "set_config('transaction_timeout', '0', true), \
                 set_config('transaction_timeout', '{lock_ms}', true), "
            )
        } else {
            String::new()
        };
        // The session lock is tried only once the transaction lock is held, so
        // that a claim holds both or neither.
        let locked = if self.session {
            format!(
                "set_config('idem.key', key.k::text, true), \
                 set_config('idem.locked', (CASE WHEN pg_try_advisory_xact_lock(key.k) \
                     THEN pg_try_advisory_lock({}) ELSE false END)::text, true)",
                session_lock("key.k")
            )
        } else {
            "set_config('idem.locked', pg_try_advisory_xact_lock(key.k)::text, true)".to_owned()
        };
        conn.begin_with(AssertSqlSafe(format!(
            "{begin}; \
             SELECT set_config('statement_timeout', '{lock_ms}', true), \
                    set_config('idle_in_transaction_session_timeout', '{lock_ms}', true), \
                    {whole}\
                    {locked}, \
                    {SAVE_SESSION} \
             FROM (SELECT {lock} AS k) AS key; \
             {HANDLER_SAVEPOINT}"
        )))
        .await
    }

    /// Looks, once per store, for the table's functions (upgrade 4) in the table's
    /// own schema, each usable only if every role may call it: a handler may have
    /// switched to any role before the record is called, which is resolved before
    /// it restores the session; the open function is held to the same rule, so
    /// that both are used or given up alike. Asked before a claim's transaction,
    /// on the session as the pool gave it, so that the table is the one the
    /// claims find.
    async fn find_functions(&self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        if self.functions.get().is_some() {
            return Ok(());
        }
        let query = sqlx::query_as::<_, (Option<String>, Option<String>)>(
            "WITH usable AS ( \
                SELECT p.oid, format('%I.%I', n.nspname, p.proname) AS name \
                FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace \
                WHERE p.oid IN (to_regprocedure($1), to_regprocedure($2)) \
                  AND p.pronamespace = \
                      (SELECT relnamespace FROM pg_class WHERE oid = to_regclass($3)) \
                  AND has_schema_privilege('public', n.oid, 'USAGE') \
                  AND has_function_privilege('public', p.oid, 'EXECUTE')) \
             SELECT (SELECT name FROM usable WHERE oid = to_regprocedure($1)), \
                    (SELECT name FROM usable WHERE oid = to_regprocedure($2))",
        )
        .persistent(false)
        .bind(open_function(&self.table))
        .bind(record_function(&self.table))
        .bind(&*self.table);
        let (open, record) = if self.prepared {
            query.fetch_one(conn).await?
        } else {
            // Through a transaction pooler, not a statement alone.
            let mut tx = read_committed(conn).await?;
            query.fetch_one(&mut *tx).await?
        };
        let release = if self.session { "true" } else { "false" };
        let record = record.map(|function| {
            format!("SELECT {function}($1, $2, $3, $4, $5, $6, {release}, $7)").into()
        });
        if open.is_none() || record.is_none() {
            tracing::info!(
                table = %self.table,
                "no open and record functions every role may call (upgrade 4): claims \
                 send the statements they stand for"
            );
        }
        // Another claim may have looked meanwhile: it found the same.
        let _ = self.functions.set(Functions {
            open: open.map(String::into_boxed_str),
            record,
        });
        Ok(())
    }

    /// The open function's name, unless there is none or its call failed for good.
    fn open_call(&self) -> Option<&str> {
        if self.open_call_failed.load(Ordering::Relaxed) {
            return None;
        }
        self.functions.get()?.open.as_deref()
    }

    /// The record function's call, unless there is none or it failed for good.
    fn record_call(&self) -> Option<&Arc<str>> {
        if self.record_call_failed.load(Ordering::Relaxed) {
            return None;
        }
        self.functions.get()?.record.as_ref()
    }

    /// Gives the open function up when its call failed because it is gone or may
    /// no longer be called (see [`function_gone`]): the request answers 503 with
    /// nothing begun, and its retry opens with the statement.
    fn open_call_failed(&self, error: &sqlx::Error) {
        if function_gone(error) && !self.open_call_failed.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                table = %self.table,
                %error,
                "the open function can no longer be called; opening claims with a statement"
            );
        }
    }

    /// Gives the record function up when its call failed because it is gone or
    /// may no longer be called (see [`function_gone`]): the request answers 503
    /// with nothing committed, and its retry is recorded with the two statements.
    fn record_call_failed(&self, error: &sqlx::Error) {
        if function_gone(error) && !self.record_call_failed.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                table = %self.table,
                %error,
                "the record function can no longer be called; recording with two statements"
            );
        }
    }

    /// Whether the session still holds the key's transaction lock, i.e. is still in
    /// the transaction the claim opened: asked when its setting `idem.locked` is
    /// gone, which a handler's `COMMIT` or `ROLLBACK` ends, and so does a `RESET
    /// ALL`. If it is, the session lock is let go.
    async fn still_open(
        &self,
        conn: &mut PgConnection,
        id: &Identity<'_>,
    ) -> Result<bool, sqlx::Error> {
        sqlx::query(AssertSqlSafe(self.still_open.clone()))
            .persistent(false)
            .bind(advisory_key(id))
            .fetch_one(conn)
            .await?
            .try_get(0)
    }

    /// Lets the key's session lock go, if this session holds it: after a
    /// statement that would have done so failed. Rare paths only: the lock is
    /// looked up in `pg_locks`.
    async fn release(&self, conn: &mut PgConnection, id: &Identity<'_>) -> Result<(), sqlx::Error> {
        if self.session {
            sqlx::raw_sql(AssertSqlSafe(self.releasing(id)))
                .execute(conn)
                .await?;
        }
        Ok(())
    }

    /// The statement of [`release`](Self::release); its literals are integers and
    /// the configured table name.
    fn releasing(&self, id: &Identity<'_>) -> String {
        format!(
            "SELECT pg_advisory_unlock({}) FROM {} WHERE l.pid = pg_backend_pid()",
            session_lock("s.k"),
            held_lock(&self.table, &format!("'{}'::int8", advisory_key(id)), "= 2")
        )
    }

    /// Rolls back a claim's transaction whose claim statement failed, and lets the
    /// key's session lock go: back to the savepoint taken before the claim, so
    /// that the transaction takes statements again, in one round trip.
    async fn give_up(
        &self,
        mut tx: Transaction<'_, Postgres>,
        id: &Identity<'_>,
    ) -> Result<(), sqlx::Error> {
        if self.session {
            sqlx::raw_sql(AssertSqlSafe(format!(
                "{BACK_TO_HANDLER_SAVEPOINT}; {}",
                self.releasing(id)
            )))
            .execute(&mut *tx)
            .await?;
        }
        tx.rollback().await
    }

    /// The handler ended the claim's transaction itself (`COMMIT`, `ROLLBACK`, `END`,
    /// `ABORT`, `… AND CHAIN`): what it wrote before may be committed, and what it
    /// wrote after committed statement by statement. The key must never run again:
    /// its row becomes a completed 500 with no body (`transaction-ended`), in a
    /// transaction of idem's own under the key's lock. When another executor holds
    /// the key by now (the lock went with the transaction), its row is left to it.
    async fn ended(
        &self,
        conn: &mut PgConnection,
        id: &Identity<'_>,
        lease: i64,
        ttl_ms: i64,
    ) -> Result<(), sqlx::Error> {
        tracing::error!("the handler ended its own transaction; the key keeps transaction-ended");
        let lock = lock_id(&self.table, &format!("'{}'::int8", advisory_key(id)));
        // With the session lock still held, no other executor can hold the key:
        // the transaction lock is waited for (a duplicate holds it only while it
        // finds the session lock taken). Without, it is only tried.
        let locked = if self.session {
            format!(
                "SET LOCAL lock_timeout = '{ENDED_LOCK_WAIT_MS}'; \
                 SELECT set_config('idem.locked', 'true', true), \
                        set_config('idem.key', ({lock})::text, true) \
                 FROM (SELECT pg_advisory_xact_lock({lock})) AS taken"
            )
        } else {
            format!(
                "SELECT set_config('idem.locked', pg_try_advisory_xact_lock({lock})::text, true)"
            )
        };
        // A chained transaction (`COMMIT AND CHAIN`) is ended first; then the
        // transaction sqlx still counts is idem's own, and its commit ends it.
        sqlx::raw_sql(AssertSqlSafe(format!(
            "ROLLBACK; {BEGIN_READ_COMMITTED}; {locked}"
        )))
        .execute(&mut *conn)
        .await?;
        let table = &self.table;
        let mark = format!(
            "UPDATE {table} SET state = 'completed', status = 500, headers = NULL, body = NULL \
             WHERE scope = $1 AND idempotency_key = $2 AND lease = $3 AND {LOCKED}"
        );
        let marked = sqlx::query(AssertSqlSafe(mark.clone()))
            .persistent(false)
            .bind(id.scope)
            .bind(id.key)
            .bind(lease)
            .execute(&mut *conn)
            .await?
            .rows_affected();
        // No row of this claim: the handler rolled it back, then went on writing.
        // The key is claimed again (over the expired or abandoned row a takeover
        // had replaced, or anew) and marked; a live row is another executor's.
        if marked == 0 {
            let over = Claim {
                lease,
                lock_ms: 1,
                ttl_ms,
                replace: true,
            };
            let taken = self.take(conn, id, over).await?
                || match self
                    .take(
                        conn,
                        id,
                        Claim {
                            replace: false,
                            ..over
                        },
                    )
                    .await
                {
                    Ok(taken) => taken,
                    Err(error) if lost_race(&error) => false,
                    Err(error) => return Err(error),
                };
            if taken {
                sqlx::query(AssertSqlSafe(mark))
                    .persistent(false)
                    .bind(id.scope)
                    .bind(id.key)
                    .bind(lease)
                    .execute(&mut *conn)
                    .await?;
            }
        }
        <Postgres as sqlx::Database>::TransactionManager::commit(&mut *conn).await?;
        // Only now that the mark is committed may a duplicate look.
        self.release(conn, id).await
    }

    /// Claims the key in a transaction [`opening`](Self::opening) opened: `false`
    /// when another executor holds its lock (or, partitioned, a row holds it).
    async fn take(
        &self,
        conn: &mut PgConnection,
        id: &Identity<'_>,
        claim: Claim,
    ) -> Result<bool, sqlx::Error> {
        let statement = if claim.replace {
            &self.claim_over
        } else {
            &self.claim_new
        };
        let claimed = claim
            .bind(id, sqlx::query(AssertSqlSafe(statement.clone())))
            .persistent(self.prepared)
            .fetch_optional(conn)
            .await?;
        // With the session lock, one row whose lease is null when nothing was claimed.
        match claimed {
            Some(row) => Ok(row.try_get::<Option<i64>, _>(0)?.is_some()),
            None => Ok(false),
        }
    }
}

/// A claim that failed because another executor took the key since this
/// statement's snapshot: a unique violation. Not a serialization failure: at
/// SERIALIZABLE one also comes from a conflict with another key (predicate locks
/// are taken per index page), and answering 409 `in-flight` for a key nobody holds
/// would be false; it is answered 503, "nothing was committed, retry".
fn lost_race(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(error) if error.is_unique_violation())
}

/// The recording statement; `true` when it completed this executor's claim.
async fn record(
    conn: &mut PgConnection,
    sql: &Sql,
    id: &Identity<'_>,
    lease: i64,
    response: &Recorded<'_>,
    announce: Option<u64>,
) -> Result<bool, sqlx::Error> {
    let statement = if announce.is_some() {
        &sql.record_announced
    } else {
        &sql.record
    };
    let query = recording(statement, sql, id, lease, response);
    let recorded = match announce {
        Some(signal) => {
            let count: i64 = query
                .bind(signal.to_string())
                .fetch_one(conn)
                .await?
                .try_get(0)?;
            count
        }
        None => {
            let done = query.execute(conn).await?;
            i64::try_from(done.rows_affected()).unwrap_or(i64::MAX)
        }
    };
    Ok(recorded == 1)
}

/// The record function's name for `table` with its argument types, as
/// `to_regprocedure` takes it (see upgrade 4).
fn record_function(table: &str) -> String {
    format!("{table}_record(text, text, bigint, smallint, bytea, bytea, boolean, text)")
}

/// The open function's, likewise.
fn open_function(table: &str) -> String {
    format!("{table}_open(bigint, bigint, boolean, boolean)")
}

/// Whether a function's call failed because it is gone or may no longer be called:
/// undefined function, insufficient privilege, no such schema.
fn function_gone(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(e)
        if matches!(e.code().as_deref(), Some("42883" | "42501" | "3F000")))
}

/// Restores the session and records through the table's record function (upgrade
/// 4), `call`: the rows recorded, or -1 when the transaction is no longer the
/// claim's (nothing written).
async fn record_in_one(
    conn: &mut PgConnection,
    sql: &Sql,
    call: &Arc<str>,
    id: &Identity<'_>,
    lease: i64,
    response: &Recorded<'_>,
    announce: Option<u64>,
) -> Result<i64, sqlx::Error> {
    recording(call, sql, id, lease, response)
        .bind(announce.map(|signal| signal.to_string()))
        .fetch_one(conn)
        .await?
        .try_get(0)
}

/// `statement`, a record (`$1`–`$6`: scope, key, lease, status, headers, body)
/// with its answer bound; an announcement's payload, when it takes one, is `$7`.
fn recording<'q>(
    statement: &Arc<str>,
    sql: &Sql,
    id: &Identity<'q>,
    lease: i64,
    response: &Recorded<'q>,
) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(AssertSqlSafe(statement.clone()))
        .persistent(sql.prepared)
        .bind(id.scope)
        .bind(id.key)
        .bind(lease)
        .bind(i16::try_from(response.status).unwrap_or(i16::MAX))
        .bind(response.headers)
        .bind(response.body)
}

/// The seed of the advisory lock taken with a claim: the key's 64-bit signal; the
/// SQL mixes in the table's oid. A collision between two live keys only makes one of
/// them answer 409 for a moment.
fn advisory_key(id: &Identity<'_>) -> i64 {
    advisory_seed(&id.digest)
}

/// [`advisory_key`] from the key's digest alone.
fn advisory_seed(digest: &[u8; 32]) -> i64 {
    i64::from_be_bytes(signal_of(digest).to_be_bytes())
}

/// How long idem waits for a key's transaction lock to mark it `transaction-ended`
/// (see [`Sql::ended`]): a duplicate holds it for a moment only.
const ENDED_LOCK_WAIT_MS: u32 = 30_000;

/// The channel completions of waiting endpoints are announced on; the payload is the
/// key's signal in decimal.
const CHANNEL: &str = "idem_completed";

/// Relays announcements from every instance into this store's signals, on one
/// pooled connection held from the first `wait` until the store or the pool goes.
async fn relay_announcements(
    pool: PgPool,
    signals: WeakSender<u64>,
    mut stop: oneshot::Receiver<()>,
) {
    loop {
        let listened = async {
            let mut listener = PgListener::connect_with(&pool).await?;
            listener.listen(CHANNEL).await?;
            loop {
                let notification = listener.recv().await?;
                let Some(signals) = signals.upgrade() else {
                    return Ok::<(), sqlx::Error>(());
                };
                if let Ok(signal) = notification.payload().parse::<u64>() {
                    // No receiver: nobody waits on this instance.
                    let _ = signals.send(signal);
                }
            }
        };
        match select(&mut stop, pin!(listened)).await {
            Either::Right((Err(error), _)) if !pool.is_closed() => {
                tracing::warn!(%error, "listening for completions failed");
            }
            _ => return,
        }
        // Waiters still look again on their own meanwhile.
        let pause = tokio::time::sleep(std::time::Duration::from_secs(1));
        if let Either::Left(_) = select(&mut stop, pin!(pause)).await {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use bytes::Bytes;
    use http::{Method, Response, Uri};
    use http_body_util::Full;

    use crate::{HandlerFuture, Idempotency, IdempotencyKey, Options, RequestIdentity, Tx};

    /// The test server and a pool on it; `None` (SKIPPED) when it is down outside CI.
    async fn admin() -> Option<(String, PgPool)> {
        let url = std::env::var("IDEM_TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
        match sqlx::PgPool::connect(&url).await {
            Ok(admin) => Some((url, admin)),
            Err(error) if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") => {
                panic!("PostgreSQL not reachable at {url}: {error}")
            }
            Err(error) => {
                eprintln!("SKIPPED: PostgreSQL not reachable at {url} ({error})");
                None
            }
        }
    }

    /// Closes `pool` and drops the `schema` it was on.
    async fn drop_schema(pool: PgPool, admin: &PgPool, schema: &str) {
        pool.close().await;
        sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
            .execute(admin)
            .await
            .expect("drop schema");
    }

    /// A handler that writes nothing and answers `done`.
    fn done(_tx: Tx<Postgres>) -> HandlerFuture<Full<Bytes>> {
        Box::pin(async { Response::new(Full::new(Bytes::from_static(b"done"))) })
    }

    /// `POST /p` with `key` in scope `s`.
    fn keyed(key: &str) -> RequestIdentity {
        RequestIdentity::new(
            IdempotencyKey::parse(key.as_bytes()).ok(),
            "s",
            &Method::POST,
            &Uri::from_static("/p"),
            b"body",
        )
    }

    /// A pool on a fresh `schema` (dropped first if a failed run left it).
    async fn schema_pool(url: &str, admin: &PgPool, schema: &str) -> PgPool {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
        )))
        .execute(admin)
        .await
        .expect("schema");
        let options: sqlx::postgres::PgConnectOptions = url.parse().expect("url");
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect_with(options.options([("search_path", schema)]))
            .await
            .expect("pool")
    }

    /// A claim whose lookup missed a row that committed meanwhile, with an expiry
    /// on another day: in the plain layout the primary key refuses it; in the
    /// partitioned layout, where the key includes `expires_at`, only the check made
    /// after the lock does. Either way the claim is lost and one row remains (I1).
    #[tokio::test]
    async fn a_claim_after_a_missed_lookup_never_duplicates_the_key() {
        let Some((url, admin)) = admin().await else {
            return;
        };
        for partitioned in [false, true] {
            let schema = format!("idem_unit_{}_{partitioned}", std::process::id());
            let pool = schema_pool(&url, &admin, &schema).await;
            let mut builder = Idempotency::builder(pool.clone());
            if partitioned {
                builder = builder.partitioned_by_day();
            }
            let store = builder.build().expect("store");
            store.migrate().await.expect("migrate");
            if partitioned {
                store.maintain_partitions(3).await.expect("partitions");
            }
            // The row a concurrent request committed: expiring in two days.
            sqlx::query(
                "INSERT INTO idempotency_keys (scope, idempotency_key, state, lease, method, \
                     path, fingerprint, status, headers, body, locked_until, expires_at, created_at) \
                 VALUES ('s', 'k', 'completed', 1, 'POST', '/p', $1, 201, '', 'first', now(), \
                     now() + interval '49 hours', now())",
            )
            .bind(&crate::fingerprint(b"body")[..])
            .execute(&pool)
            .await
            .expect("the committed row");

            // This request's lookup ran before that commit: it claims a free key,
            // with a one-hour ttl (another day, another partition).
            let fingerprint = crate::fingerprint(b"body");
            let id = Identity {
                scope: "s",
                key: "k",
                method: "POST",
                path: "/p",
                content_type: "",
                json_body: false,
                fingerprint,
                body_digest: &fingerprint,
                bytes_fingerprint: None,
                digest: crate::signal::key_digest("idempotency_keys", "s", "k"),
            };
            let options = Options::new();
            let claim = Claim {
                lease: 2,
                lock_ms: options.lock_millis(),
                ttl_ms: 3_600_000,
                replace: false,
            };
            {
                let mut conn = pool.acquire().await.expect("connection");
                let lost = Postgres::idem_claim(&mut conn, &store.inner().sql, &id, claim)
                    .await
                    .expect("claim")
                    .is_none();
                assert!(lost, "partitioned = {partitioned}: the claim must be lost");
            }
            let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
                .fetch_one(&pool)
                .await
                .expect("count");
            assert_eq!(rows, 1, "partitioned = {partitioned}");
            drop_schema(pool, &admin, &schema).await;
        }
    }

    /// The functions of upgrade 4 are used only where every role may call them, and
    /// are found in the table's schema; the record's NOTIFY is on idem's channel.
    #[tokio::test]
    async fn the_functions_are_used_where_every_role_may_call_them() {
        assert!(UPGRADE_4.sql.contains(&format!("pg_notify('{CHANNEL}'")));
        let Some((url, admin)) = admin().await else {
            return;
        };
        let schema = format!("idem_unit_{}_record", std::process::id());
        let pool = schema_pool(&url, &admin, &schema).await;
        let found = |store: Idempotency<Postgres>| {
            let pool = pool.clone();
            async move {
                let mut conn = pool.acquire().await.expect("connection");
                let sql = &store.inner().sql;
                sql.find_functions(&mut conn).await.expect("look-up");
                let open = sql.open_call().map(str::to_owned);
                let record = sql.record_call().map(|call| call.to_string());
                // Both or neither.
                assert_eq!(open.is_some(), record.is_some(), "{open:?} {record:?}");
                open.zip(record)
            }
        };
        let store = Idempotency::new(pool.clone());
        store.migrate().await.expect("migrate");
        // A new schema is closed to other roles, unlike `public`.
        assert_eq!(found(store).await, None, "private schema");

        let admin_runs = |statement: String| {
            let admin = admin.clone();
            async move {
                sqlx::raw_sql(AssertSqlSafe(statement))
                    .execute(&admin)
                    .await
                    .expect("admin statement");
            }
        };
        let function = format!("{schema}.{}", record_function("idempotency_keys"));
        admin_runs(format!("GRANT USAGE ON SCHEMA {schema} TO PUBLIC")).await;
        assert_eq!(
            found(Idempotency::new(pool.clone())).await,
            Some((
                format!("{schema}.idempotency_keys_open"),
                format!(
                    "SELECT {schema}.idempotency_keys_record($1, $2, $3, $4, $5, $6, true, $7)"
                )
            )),
            "open schema"
        );

        admin_runs(format!("REVOKE EXECUTE ON FUNCTION {function} FROM PUBLIC")).await;
        admin_runs(format!(
            "REVOKE EXECUTE ON FUNCTION {schema}.{} FROM PUBLIC",
            open_function("idempotency_keys")
        ))
        .await;
        assert_eq!(
            found(Idempotency::new(pool.clone())).await,
            None,
            "no EXECUTE"
        );

        // A table migrated before upgrade 4, or by a tool that skipped it.
        admin_runs(format!("DROP FUNCTION {function}")).await;
        admin_runs(format!(
            "DROP FUNCTION {schema}.{}",
            open_function("idempotency_keys")
        ))
        .await;
        assert_eq!(
            found(Idempotency::new(pool.clone())).await,
            None,
            "no function"
        );
        // `migrate()` creates it again.
        let store = Idempotency::new(pool.clone());
        store.migrate().await.expect("migrate again");
        assert!(found(store).await.is_some(), "migrated again");

        drop_schema(pool, &admin, &schema).await;
    }

    /// A function of upgrade 4 dropped under a running store fails one request
    /// (503, nothing committed); its retry, and every request after it, sends the
    /// statements the function stood for.
    #[tokio::test]
    async fn functions_dropped_under_a_running_store_are_given_up() {
        let Some((url, admin)) = admin().await else {
            return;
        };
        let schema = format!("idem_unit_{}_dropped", std::process::id());
        let pool = schema_pool(&url, &admin, &schema).await;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "GRANT USAGE ON SCHEMA {schema} TO PUBLIC"
        )))
        .execute(&admin)
        .await
        .expect("grant");
        let store = Idempotency::new(pool.clone());
        store.migrate().await.expect("migrate");
        let options = Options::new();
        let first = store.execute(keyed("k1"), options, done).await;
        assert_eq!(first.status(), 200);
        // The record function first, then the open function (still used after the
        // record function was given up).
        type InUse = fn(&Sql) -> bool;
        let cases: [(String, InUse, [&str; 2]); 2] = [
            (
                record_function("idempotency_keys"),
                |sql| sql.record_call().is_some(),
                ["k2", "k3"],
            ),
            (
                open_function("idempotency_keys"),
                |sql| sql.open_call().is_some(),
                ["k4", "k5"],
            ),
        ];
        for (function, in_use, [failing, next]) in cases {
            assert!(in_use(&store.inner().sql), "{function} is used");
            sqlx::raw_sql(AssertSqlSafe(format!("DROP FUNCTION {schema}.{function}")))
                .execute(&admin)
                .await
                .expect("drop");
            let failed = store.execute(keyed(failing), options, done).await;
            assert_eq!(failed.status(), 503, "{function}");
            assert!(!in_use(&store.inner().sql), "{function} given up");
            for key in [failing, next] {
                let answer = store.execute(keyed(key), options, done).await;
                assert_eq!(answer.status(), 200, "{key}");
            }
        }
        let rows: Vec<(String, String)> =
            sqlx::query_as("SELECT idempotency_key, state FROM idempotency_keys ORDER BY 1")
                .fetch_all(&pool)
                .await
                .expect("rows");
        let completed = |key: &str| (key.to_owned(), "completed".to_owned());
        assert_eq!(
            rows,
            ["k1", "k2", "k3", "k4", "k5"].map(completed),
            "every key once, none left claimed"
        );

        drop_schema(pool, &admin, &schema).await;
    }

    /// `wait` across instances: a completion on one store reaches the waiters of
    /// another store on the same database through `NOTIFY`, which the second relays.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn completions_reach_the_waiters_of_other_instances() {
        let Some((url, admin)) = admin().await else {
            return;
        };
        let schema = format!("idem_unit_{}_relay", std::process::id());
        let pool = schema_pool(&url, &admin, &schema).await;
        let first = Idempotency::new(pool.clone());
        first.migrate().await.expect("migrate");
        let second = Idempotency::new(pool.clone());
        let (signals, stop) = second.inner().signals.watch_once().expect("first watch");
        Postgres::idem_watch(&pool, signals, stop);
        let mut heard = second.inner().signals.subscribe();

        // The relay may not be listening yet when the first completion commits:
        // complete keys until one is heard.
        let waiting = Options::new().wait(std::time::Duration::from_secs(1));
        let mut relayed = false;
        for attempt in 0..40 {
            let key = format!("k{attempt}");
            let response = first.execute(keyed(&key), waiting, done).await;
            assert_eq!(response.status(), 200);
            let signal = signal_of(&crate::signal::key_digest("idempotency_keys", "s", &key));
            let heard_it = tokio::time::timeout(std::time::Duration::from_millis(500), async {
                while heard.recv().await != Ok(signal) {}
            })
            .await;
            if heard_it.is_ok() {
                relayed = true;
                break;
            }
        }
        assert!(relayed, "no completion of one store reached the other");
        drop((first, second));
        drop_schema(pool, &admin, &schema).await;
    }
}
