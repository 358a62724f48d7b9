//! MySQL and MariaDB: the claim lives inside the handler's own transaction, behind
//! a named lock.
//!
//! The design, what differs from PostgreSQL and why, are described in
//! `docs/backends.md`; the SQL below is all this backend runs.

mod cluster;

use std::fmt::Write as _;
use std::sync::{Arc, OnceLock};

use sha2::{Digest as _, Sha256};
use sqlx::mysql::MySqlDatabaseError;
use sqlx::{AssertSqlSafe, Connection, MySql, MySqlConnection, Row as _, Transaction};
use sqlx_core::transaction::TransactionManager as _;

use crate::backend::{
    Again, Applied, Claim, Found, Identity, Layout, Migration, Opened, Recorded, Written,
    enabled::Driver,
};
use crate::backend::{Forgotten, InFlight};
use crate::backend::{KeyRecord, Parts, Query, Resealed, fetch};
use crate::key::to_hex;
use crate::lease;
use crate::tx::{Adopted, Open};

/// The claim's named lock, from its seed: 45 characters, within MySQL's 64. Named
/// locks are the server's, not a database's: the database is part of the name
/// (the pool's, see `lock_name`). Every release of idem names a key's lock the
/// same for a session in that database, so instances of two releases exclude each
/// other during a rolling deploy.
const LOCK_NAME: &str =
    "CONCAT('idem:', LEFT(SHA2(CONCAT(COALESCE(DATABASE(), ''), ':', ?), 256), 40))";

/// What a row written over an expired or abandoned one of the same key sets.
const REPLACE_ALL: &str = "state = VALUES(state), lease = VALUES(lease), \
        method = VALUES(method), path = VALUES(path), fingerprint = VALUES(fingerprint), \
        content_type = VALUES(content_type), status = VALUES(status), \
        headers = VALUES(headers), body = VALUES(body), locked_until = VALUES(locked_until), \
        expires_at = VALUES(expires_at), created_at = VALUES(created_at)";

#[doc(hidden)]
#[derive(Debug)]
pub struct Sql {
    /// The columns a lookup selects, in the shape `Found::decode` reads.
    columns: Box<str>,
    /// Completes the claim's row (see `begin_text`) in the handler's transaction.
    record: Arc<str>,
    /// Writes the record whole, for a transaction of its own (see `idem_record`).
    record_alone: Arc<str>,
    lock_left: Arc<str>,
    /// `COMMIT`, then what frees what the claim took on the session: the named
    /// lock, and the session's own `autocommit`, timeouts and read-write mode back.
    commit: Arc<str>,
    /// `ROLLBACK`, then the same: ends a claim that did not take the key, or whose
    /// transaction was not recorded, and the transaction its reads opened.
    rollback: Arc<str>,
    /// The table, for the statements written out per key: in the pool's
    /// database, when the pool names one (see `idem_sql`).
    table: Box<str>,
    /// The table's name as configured, which keys' digests are computed with.
    name: Box<str>,
    /// The database the pool connects to (empty: none), for `lock_name`.
    database: Box<str>,
    sweep: Arc<str>,
    /// `Builder::galera`: the cluster mode forced on or off.
    galera: Option<bool>,
    /// The cluster mode's statements once the server was asked (`mode`); `None`
    /// inside: the standalone design.
    mode: OnceLock<Option<cluster::Sql>>,
    /// The cluster mode's claim held after its commit, for the fence's tests.
    #[cfg(feature = "testing")]
    stall: crate::hooks::Stall,
}

impl Sql {
    /// The cluster mode's statements, or `None` for the standalone design: as
    /// `Builder::galera` says, else as the server says, asked once per store.
    async fn mode(&self, conn: &mut MySqlConnection) -> Result<Option<&cluster::Sql>, sqlx::Error> {
        if let Some(mode) = self.mode.get() {
            return Ok(mode.as_ref());
        }
        // `wsrep_*` exist on a Galera node and on a MariaDB built with wsrep
        // support; MySQL without Galera has none (1193).
        let asked =
            sqlx::raw_sql("SELECT CAST(@@wsrep_on AS SIGNED), CAST(@@wsrep_max_ws_size AS SIGNED)")
                .fetch_optional(&mut *conn)
                .await;
        let (on, max_write_set) = match asked {
            Ok(Some(row)) => (
                row.try_get::<i64, _>(0)? == 1,
                Some(row.try_get::<i64, _>(1)?),
            ),
            Ok(None) => (false, None),
            Err(error) if error_number(&error) == Some(1193) => (false, None),
            Err(error) => return Err(error),
        };
        let cluster = self.galera.unwrap_or(on);
        if cluster {
            tracing::info!(
                wsrep_on = on,
                "idem: claims commit before handlers run (multi-primary cluster mode)"
            );
        }
        let mode = cluster.then(|| {
            cluster::Sql::new(
                &self.table,
                max_write_set.is_some(),
                max_write_set.and_then(|max| u64::try_from(max).ok()),
            )
        });
        Ok(self.mode.get_or_init(|| mode).as_ref())
    }

    /// The mode once known, for the steps after a claim (which asked).
    fn known(&self) -> Option<&cluster::Sql> {
        self.mode.get().and_then(Option::as_ref)
    }
}

/// The columns a lookup selects, in the shape `Found::decode` reads: a claim is
/// live until `deadline`, the time a takeover waits for.
fn columns(deadline: &str) -> String {
    format!(
        "state, method, path, content_type, fingerprint, \
         CAST(status AS SIGNED) AS status, headers, body, \
         CAST({deadline} > UTC_TIMESTAMP(6) AS SIGNED) AS live, \
         CAST(CEIL(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) / 1000) \
              AS SIGNED) AS ttl_left_ms"
    )
}

/// The server's error number of `error`, if it is the server's.
fn error_number(error: &sqlx::Error) -> Option<u16> {
    error
        .as_database_error()
        .and_then(|error| error.try_downcast_ref::<MySqlDatabaseError>())
        .map(MySqlDatabaseError::number)
}

/// Makes the next transaction, and it alone, read committed rows only. idem's
/// reads of the key table run outside the handler's transaction, each a
/// transaction of its own: under a session at READ UNCOMMITTED they would see a
/// claim's row, or its record, before it commits (or when it never does).
const READ_COMMITTED_ONCE: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED";

/// A transaction of idem's own outside a claim (sweep, operator's look and
/// deletion) at READ COMMITTED: its reads do not lock (SERIALIZABLE would make them
/// wait for a claim's row, which an executor holds locked until it answers), its
/// deletions lock no gaps, and it sees committed rows only. The `COMMIT` ends the
/// transaction a session with `autocommit = 0` may hold, in which the isolation
/// could not be set.
const BEGIN_READ_COMMITTED: &str = "COMMIT; SET TRANSACTION ISOLATION LEVEL READ COMMITTED; BEGIN";

/// An operator's look at claims in flight, whose rows are not committed yet: a
/// read of uncommitted rows takes no lock and waits for none.
const BEGIN_READ_UNCOMMITTED: &str =
    "COMMIT; SET TRANSACTION ISOLATION LEVEL READ UNCOMMITTED; BEGIN";

/// Rows one sweep's `DELETE` names: two parameters each, well within the
/// protocol's 65,535.
const SWEEP_CHUNK: usize = 500;

/// Whether `error` is a row lock refused by `NOWAIT`: MariaDB reports a lock wait
/// timeout (1205), MySQL 8 its own error (3572).
fn lock_refused(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(|error| error.try_downcast_ref::<MySqlDatabaseError>())
        .is_some_and(|error| matches!(error.number(), 1205 | 3572))
}

/// Once the handler's transaction has begun: every later transaction of the
/// session is read-only until `finish`. A statement that commits implicitly
/// (DDL, `LOCK TABLES`, a `COMMIT` or `BEGIN` the handler sends) ends the
/// handler's transaction; the writes after it then fail (error 1792) instead of
/// committing on their own, and so does the record, which is how idem learns of
/// it. A transaction the database rolls back (a deadlock) leaves the session
/// read-write until its next explicit end; what the handler writes after it
/// waits uncommitted instead, since the claim turned `autocommit` off, and is
/// rolled back.
const LATER_READ_ONLY: &str = "SET SESSION TRANSACTION READ ONLY";

/// MariaDB's timeouts that would end a keyed transaction before its lock: the
/// idle-in-transaction ones (which close the connection) and `max_statement_time`
/// (which interrupts a statement). The claim saves each and sets it to `secs`,
/// the lock, as it does `wait_timeout`, in an executable comment that only
/// MariaDB 10.3+ runs, since MySQL has none of them; `MARIADB_TIMEOUTS_BACK`
/// restores them.
fn mariadb_timeouts(secs: i64) -> String {
    format!(
        "/*M!100300 \
         , @idem_idle_timeout = @@SESSION.idle_transaction_timeout \
         , @idem_idle_write_timeout = @@SESSION.idle_write_transaction_timeout \
         , @idem_idle_read_timeout = @@SESSION.idle_readonly_transaction_timeout \
         , @idem_statement_time = @@SESSION.max_statement_time \
         , SESSION idle_transaction_timeout = {secs} \
         , SESSION idle_write_transaction_timeout = {secs} \
         , SESSION idle_readonly_transaction_timeout = {secs} \
         , SESSION max_statement_time = {secs} */"
    )
}

/// `finish`'s part of `mariadb_timeouts`: each back to its saved value (on a
/// session that saved none, where the cluster mode releases a claim, its own: a
/// user variable never set is a string, which `+ 0e0` makes a number again).
const MARIADB_TIMEOUTS_BACK: &str = "/*M!100300 \
    , idle_transaction_timeout = CAST(COALESCE(@idem_idle_timeout, \
        @@SESSION.idle_transaction_timeout) AS UNSIGNED) \
    , idle_write_transaction_timeout = CAST(COALESCE(@idem_idle_write_timeout, \
        @@SESSION.idle_write_transaction_timeout) AS UNSIGNED) \
    , idle_readonly_transaction_timeout = CAST(COALESCE(@idem_idle_read_timeout, \
        @@SESSION.idle_readonly_transaction_timeout) AS UNSIGNED) \
    , max_statement_time = COALESCE(@idem_statement_time, @@SESSION.max_statement_time) + 0e0 */";

/// MySQL's "Cannot execute statement in a READ ONLY transaction".
const READ_ONLY_TRANSACTION: u16 = 1792;

impl Driver for MySql {
    type IdemSql = Sql;

    fn idem_migrations(_layout: Layout) -> &'static [Migration] {
        &[
            Migration {
                version: 1,
                sql: include_str!("../migrations/mysql/0001_idempotency_keys.sql"),
                applied: Applied::TableExists,
            },
            Migration {
                version: 2,
                sql: include_str!("../migrations/mysql/0002_content_type_and_sizes.sql"),
                applied: Applied::HasColumn("content_type"),
            },
        ]
    }

    fn idem_sql(table: &str, layout: Layout, pool: &sqlx::MySqlPool) -> Sql {
        let name = table;
        // The session's own settings back. Setting `autocommit` back to 1 would
        // commit an open transaction: it runs only once the handler's has ended.
        let restore = format!(
            "SET SESSION TRANSACTION READ WRITE; SET SESSION \
                autocommit = COALESCE(@idem_autocommit, @@SESSION.autocommit), \
                wait_timeout = CAST(COALESCE(@idem_wait_timeout, @@SESSION.wait_timeout) AS UNSIGNED), \
                innodb_lock_wait_timeout = CAST(COALESCE(@idem_lock_wait_timeout, \
                    @@SESSION.innodb_lock_wait_timeout) AS UNSIGNED) \
                {MARIADB_TIMEOUTS_BACK}, \
                @idem_released = RELEASE_LOCK(@idem_lock)"
        );
        let options = pool.connect_options();
        let database = options.get_database().unwrap_or_default();
        // The key table and the key's lock belong to the pool's database, not to
        // whichever one the session is in: a handler may `USE` its tenant's
        // database, and a session may stay there after it. Without a database in
        // the pool's options, the session's own is the only one there is.
        let table = if database.is_empty() {
            table.to_owned()
        } else {
            format!("`{}`.`{table}`", database.replace('`', "``"))
        };
        let table = table.as_str();
        let session_database = if database.is_empty() {
            "COALESCE(DATABASE(), '')".to_owned()
        } else {
            format!("X'{}'", to_hex(database.as_bytes()))
        };
        // Whether the claim still holds the key: its named lock, before the lock's
        // end by the database clock.
        let held = "@idem_until > UTC_TIMESTAMP(6) AND IS_USED_LOCK(@idem_lock) = CONNECTION_ID()";
        Sql {
            columns: columns("locked_until").into(),
            record: format!(
                "UPDATE {table} SET status = ?, headers = ?, body = ? \
                 WHERE scope = ? AND idempotency_key = ? AND lease = ? AND {held}"
            )
            .into(),
            // Only while this session holds the key's named lock, taken before the
            // row was read (so the key is free, or its row expired or abandoned).
            record_alone: format!(
                "INSERT INTO {table} (scope, idempotency_key, state, lease, method, path, \
                        fingerprint, content_type, status, headers, body, locked_until, \
                        expires_at, created_at) \
                 SELECT ?, ?, 'completed', ?, ?, ?, ?, ?, ?, ?, ?, @idem_until, \
                        @idem_at + INTERVAL (? * 1000) MICROSECOND, @idem_at \
                 FROM DUAL WHERE {held} \
                 ON DUPLICATE KEY UPDATE {REPLACE_ALL}"
            )
            .into(),
            // The holder's claim is not visible, but its named lock is, and the start
            // of its transaction usually (INNODB_TRX needs the PROCESS privilege and
            // is a snapshot up to 0.1 s old). Unknown start: the whole lock is left.
            lock_left: format!(
                "SELECT CAST(? - COALESCE((SELECT TIMESTAMPDIFF(MICROSECOND, t.trx_started, NOW(6)) / 1000 \
                                           FROM information_schema.INNODB_TRX t \
                                           WHERE t.trx_mysql_thread_id = h.holder), 0) AS SIGNED) \
                 FROM (SELECT IS_USED_LOCK({}) AS holder) h WHERE h.holder IS NOT NULL",
                LOCK_NAME.replace("COALESCE(DATABASE(), '')", &session_database)
            )
            .into(),
            sweep: format!(
                "SELECT scope, idempotency_key FROM {table} \
                 WHERE state = 'completed' AND expires_at <= UTC_TIMESTAMP(6) \
                 ORDER BY expires_at LIMIT ? FOR UPDATE SKIP LOCKED"
            )
            .into(),
            commit: format!("COMMIT; {restore}").into(),
            rollback: format!("ROLLBACK; {restore}").into(),
            table: table.into(),
            name: name.into(),
            database: database.into(),
            galera: layout.galera,
            mode: OnceLock::new(),
            #[cfg(feature = "testing")]
            stall: crate::hooks::Stall::default(),
        }
    }

    async fn idem_migrate(
        conn: &mut MySqlConnection,
        sql: &Sql,
        table: &str,
        scripts: &[(String, Applied)],
    ) -> Result<(), sqlx::Error> {
        // The table goes where every statement looks for it, the pool's database,
        // also from a session the application moved to another (moved back after).
        let mut moved = None;
        if !sql.database.is_empty() {
            let current: Option<String> = sqlx::query_scalar("SELECT DATABASE()")
                .fetch_one(&mut *conn)
                .await?;
            if current.as_deref() != Some(&*sql.database) {
                use_database(conn, &sql.database).await?;
                moved = current;
            }
        }
        // On a cluster, no named lock (it holds on one node, and Percona XtraDB
        // Cluster refuses it): DDL runs in the same order on every node, and a
        // script another instance applied meanwhile is found applied (`apply`).
        if sql.mode(conn).await?.is_some() {
            let migrated = apply(conn, table, scripts).await;
            if let Some(database) = moved {
                use_database(conn, &database).await?;
            }
            return migrated;
        }
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
        if let Some(database) = moved {
            use_database(conn, &database).await?;
        }
        migrated
    }

    async fn idem_lookup(
        conn: &mut MySqlConnection,
        sql: &Sql,
        id: &Identity<'_>,
    ) -> Result<Option<Found>, sqlx::Error> {
        if let Some(cluster) = sql.mode(conn).await? {
            return cluster::lookup(conn, sql, cluster, id).await;
        }
        // Outside any transaction, where a session with `autocommit = 0` opens one
        // that nothing else would end: the `COMMIT` rides in the same round trip.
        let text = format!(
            "{READ_COMMITTED_ONCE}; SELECT {} FROM {} WHERE {}; COMMIT",
            sql.columns,
            sql.table,
            key_filter(id)
        );
        let rows = sqlx::raw_sql(AssertSqlSafe(text)).fetch_all(conn).await?;
        rows.first().map(Found::decode).transpose()
    }

    async fn idem_open<'c>(
        conn: &'c mut MySqlConnection,
        sql: &'c Sql,
        id: &'c Identity<'c>,
        claim: Claim,
    ) -> Result<Opened<'c, MySql>, sqlx::Error> {
        if let Some(cluster) = sql.mode(conn).await? {
            return cluster::open(conn, sql, cluster, id, claim).await;
        }
        // A completed key this process kept was answered from its replay cache
        // before this; any other is probably new, so the claim is one round trip,
        // whose `BEGIN` opens the handler's transaction and whose claim row, inserted
        // only if the key's lock is taken and it has no row (`begin_text` with
        // `New::Only`), fails the text otherwise.
        let text = claim_text(sql, id, claim, true);
        match conn.begin_with(AssertSqlSafe(text)).await {
            // Adopted here, so that the connection is free for the arm below.
            Ok(tx) => return Ok(Opened::Adopted(Open::adopt(tx))),
            Err(error) if taken(&error) => {}
            Err(error) => return Err(error),
        }
        // Stored, or its lock busy: the text stopped at the claim row, in the
        // transaction its `BEGIN` opened, which the read ends. What is stored is
        // read, then, in the same round trip, the claim frees what it took (and
        // ends the transaction a session with `autocommit = 0` opened for the
        // read). (A row swept between the claim and the read answers as in
        // flight: the retry claims the key.)
        let (_, found) = read(conn, sql, id, Some(&sql.rollback)).await?;
        Ok(found.map_or(Opened::Lost, Opened::Found))
    }

    async fn idem_claim<'c>(
        conn: &'c mut MySqlConnection,
        sql: &'c Sql,
        id: &'c Identity<'c>,
        claim: Claim,
    ) -> Result<Option<Adopted>, sqlx::Error> {
        if let Some(cluster) = sql.mode(conn).await? {
            return cluster::take_over(conn, sql, cluster, id, claim).await;
        }
        // A row the engine found expired or abandoned, read again under the lock:
        // whoever took the lock meanwhile may have recorded it since.
        let text = claim_text(sql, id, claim, false);
        sqlx::raw_sql(AssertSqlSafe(text))
            .execute(&mut *conn)
            .await?;
        let (locked, found) = read(conn, sql, id, None).await?;
        if locked && found.as_ref().is_none_or(Found::replaceable) {
            let text = begin_text(sql, id, claim, New::OrReplace);
            let tx = conn.begin_with(AssertSqlSafe(text)).await?;
            return Ok(Some(Open::adopt(tx)));
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
    ) -> Result<Written, sqlx::Error> {
        let cluster = sql.known();
        let status = i16::try_from(response.status).unwrap_or(i16::MAX);
        // Over the claim's row in the handler's transaction: the ended mark
        // `begin_text` (or, in the cluster mode, `cluster::begin_text`) wrote.
        let over = cluster.map_or(&sql.record, |cluster| &cluster.record);
        let completed = sqlx::query(AssertSqlSafe(over.clone()))
            .bind(status)
            .bind(response.headers)
            .bind(response.body)
            .bind(id.scope)
            .bind(id.key)
            .bind(claim.lease)
            .execute(&mut *conn)
            .await;
        match completed {
            Ok(done) if done.rows_affected() > 0 => return Ok(Written::Recorded),
            // The claim's row is gone, or its lock: the transaction may have ended.
            Ok(_) => {}
            Err(error) if read_only(&error) => {}
            Err(error) => return Err(error),
        }
        if ended(conn, sql, id, claim.lease, cluster.is_some()).await? {
            return Ok(Written::Ended);
        }
        // The database rolled the handler's transaction back (a deadlock, a lock
        // wait timeout with `innodb_rollback_on_timeout`, a `ROLLBACK` sent by the
        // handler): what the handler wrote after that waited in a transaction of
        // its own, since the claim turned `autocommit` off, and `ended` rolled it
        // back. Nothing of the handler's is left, and its answer is recorded alone,
        // as PostgreSQL records an answer given after an error voided the
        // transaction, if the claim still holds the key: over the committed claim
        // in the cluster mode, else as the whole row, under the named lock.
        <MySql as sqlx::Database>::TransactionManager::begin(conn, None).await?;
        let alone = match cluster {
            Some(cluster) => sqlx::query(AssertSqlSafe(cluster.lease.record.clone()))
                .bind(status)
                .bind(response.headers)
                .bind(response.body)
                .bind(id.scope)
                .bind(id.key)
                .bind(claim.lease),
            None => sqlx::query(AssertSqlSafe(sql.record_alone.clone()))
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
                .bind(response.ttl_ms),
        };
        let done = alone.execute(&mut *conn).await?;
        // One row inserted, or an expired one replaced (two, as MySQL counts it).
        Ok(Written::held(done.rows_affected() > 0))
    }

    async fn idem_rollback<'c>(
        conn: &'c mut MySqlConnection,
        sql: &'c Sql,
        id: &'c Identity<'c>,
        claim: Claim,
    ) -> Result<bool, sqlx::Error> {
        ended(conn, sql, id, claim.lease, sql.known().is_some()).await
    }

    async fn idem_lock_left(
        conn: &mut MySqlConnection,
        sql: &Sql,
        id: &Identity<'_>,
        lock_ms: i64,
    ) -> Result<Option<i64>, sqlx::Error> {
        if let Some(cluster) = sql.mode(conn).await? {
            return lease::lock_left::<MySql>(conn, &cluster.lease, id.scope, id.key).await;
        }
        sqlx::query_scalar(AssertSqlSafe(sql.lock_left.clone()))
            .bind(lock_ms)
            .bind(lock_seed(&id.digest))
            .fetch_optional(conn)
            .await
    }

    async fn idem_commit(
        conn: &mut MySqlConnection,
        sql: &Sql,
        _id: &Identity<'_>,
    ) -> Result<(), sqlx::Error> {
        if let Some(cluster) = sql.known() {
            return cluster::commit(conn, cluster).await;
        }
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
        id: &Identity<'_>,
        lease: i64,
        committed: bool,
    ) -> Result<(), sqlx::Error> {
        if let Some(cluster) = sql.known() {
            if committed {
                return Ok(());
            }
            return cluster::finish(conn, cluster, id, lease).await;
        }
        // The row needs nothing: the claim was part of the transaction. After a
        // commit, `idem_commit` has finished already.
        if committed {
            return Ok(());
        }
        finish(conn, sql).await
    }

    #[cfg(feature = "testing")]
    fn idem_testing_stall(sql: &Sql) -> Option<&crate::hooks::Stall> {
        // Only the cluster mode commits its claim before the handler's
        // transaction; known after the store's first request.
        sql.known().map(|_| &sql.stall)
    }

    fn idem_max_response(sql: &Sql) -> Option<usize> {
        sql.known().and_then(|cluster| cluster.max_response)
    }

    fn idem_finish_again(sql: &Sql, _error: &sqlx::Error) -> Again {
        // A cluster's claim is a committed row: whatever ended the claim's session
        // (the handler's `KILL`, the server's timeout at the lock), another
        // session releases it by its lease. The standalone claim ends with its
        // session.
        if sql.known().is_some() {
            Again::Now
        } else {
            Again::Never
        }
    }

    async fn idem_sweep(
        conn: &mut MySqlConnection,
        sql: &Sql,
        limit: i64,
    ) -> Result<u64, sqlx::Error> {
        // In a transaction of its own, so that a session with `autocommit = 0`
        // commits it too. The rows are locked first, skipping those a claim holds
        // (an expired key being run again): a plain `DELETE` would wait for that
        // claim's transaction, whose row is then no longer expired.
        let mut tx = conn.begin_with(BEGIN_READ_COMMITTED).await?;
        let expired: Vec<(Vec<u8>, Vec<u8>)> = sqlx::query_as(AssertSqlSafe(sql.sweep.clone()))
            .bind(limit)
            .fetch_all(&mut *tx)
            .await?;
        let mut deleted = 0;
        // Rows this transaction holds: deleting them waits for nobody.
        for batch in expired.chunks(SWEEP_CHUNK) {
            // A row constructor list: a range on the primary key (measured on
            // MariaDB 10.11, 500 rows: 10.6 ms, against 15 to 19 ms for the same
            // rows as `OR`ed conditions and 8.4 ms for the plain `DELETE`).
            let rows = vec!["(?, ?)"; batch.len()].join(", ");
            let mut delete = sqlx::query(AssertSqlSafe(format!(
                "DELETE FROM {} WHERE (scope, idempotency_key) IN ({rows})",
                sql.table
            )));
            for (scope, key) in batch {
                delete = delete.bind(scope).bind(key);
            }
            deleted += delete.execute(&mut *tx).await?.rows_affected();
        }
        tx.commit().await?;
        Ok(deleted)
    }

    async fn idem_forget(
        conn: &mut MySqlConnection,
        sql: &Sql,
        scope: &str,
        key: &str,
        digest: &[u8; 32],
    ) -> Result<Forgotten, sqlx::Error> {
        if let Some(cluster) = sql.mode(conn).await? {
            return lease::forget::<MySql>(conn, &cluster.lease, scope, key).await;
        }
        // As the sweep: committed whatever the session's `autocommit`. A row a
        // claim's transaction holds (a new key's, or an expired one's being run
        // again) is in flight: NOWAIT answers at once, where a plain `DELETE`
        // would wait for that transaction and then delete what it recorded.
        let mut tx = conn.begin_with(BEGIN_READ_COMMITTED).await?;
        let lock = lock_name_of(sql, digest);
        let read = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT lease, state, CAST(body IS NULL AS SIGNED), \
                    CAST(IS_USED_LOCK({lock}) IS NOT NULL AS SIGNED) \
             FROM {} WHERE scope = ? AND idempotency_key = ? FOR UPDATE NOWAIT",
            sql.table
        )))
        .persistent(false)
        .bind(scope)
        .bind(key)
        .fetch_all(&mut *tx)
        .await;
        let rows: Vec<(i64, String, i64, i64)> = match read {
            Err(error) if lock_refused(&error) => {
                tx.rollback().await?;
                return Ok(Forgotten::InFlight);
            }
            rows => rows?,
        };
        let Some((lease, state, no_body, held)) = rows.into_iter().next() else {
            // No row yet: a claim that has the key's lock but not its row is in
            // flight too.
            let held: Option<i64> =
                sqlx::query_scalar(AssertSqlSafe(format!("SELECT IS_USED_LOCK({lock})")))
                    .persistent(false)
                    .fetch_one(&mut *tx)
                    .await?;
            tx.commit().await?;
            return Ok(if held.is_some() {
                Forgotten::InFlight
            } else {
                Forgotten::NotFound
            });
        };
        // A row without a body whose key's lock is held: a handler's transaction
        // committed behind idem's back, and its executor is still marking it
        // `transaction-ended`; deleting it would free a key whose writes committed.
        if state != "completed" || (no_body == 1 && held == 1) {
            tx.rollback().await?;
            return Ok(Forgotten::InFlight);
        }
        sqlx::query(AssertSqlSafe(format!(
            "DELETE FROM {} WHERE scope = ? AND idempotency_key = ? AND lease = ? \
               AND state = 'completed'",
            sql.table
        )))
        .persistent(false)
        .bind(scope)
        .bind(key)
        .bind(lease)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Forgotten::Deleted)
    }

    async fn idem_in_flight(
        conn: &mut MySqlConnection,
        sql: &Sql,
        scope: &str,
        key: &str,
        digest: &[u8; 32],
    ) -> Result<Option<InFlight>, sqlx::Error> {
        if let Some(cluster) = sql.mode(conn).await? {
            return lease::in_flight::<MySql>(conn, &cluster.lease, scope, key).await;
        }
        let lock = lock_name_of(sql, digest);
        let holder: Option<i64> =
            sqlx::query_scalar(AssertSqlSafe(format!("SELECT IS_USED_LOCK({lock})")))
                .persistent(false)
                .fetch_one(&mut *conn)
                .await?;
        let Some(holder) = holder else {
            return Ok(None);
        };
        // The start of its transaction needs the PROCESS privilege: unknown
        // without it.
        let age_ms: Option<i64> = sqlx::query_scalar(
            "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, trx_started, NOW(6)) DIV 1000 AS SIGNED) \
             FROM information_schema.INNODB_TRX WHERE trx_mysql_thread_id = ?",
        )
        .persistent(false)
        .bind(holder)
        .fetch_optional(&mut *conn)
        .await
        .unwrap_or(None);
        // The claim's row, before it commits: a read of uncommitted rows.
        let mut tx = conn.begin_with(BEGIN_READ_UNCOMMITTED).await?;
        let lock_left_ms: Option<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), locked_until) DIV 1000 \
                    AS SIGNED) \
             FROM {} WHERE scope = ? AND idempotency_key = ? AND body IS NULL",
            sql.table
        )))
        .persistent(false)
        .bind(scope)
        .bind(key)
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Some(InFlight {
            session: Some(holder),
            age_ms,
            lock_left_ms,
        }))
    }

    async fn idem_inspect(
        conn: &mut MySqlConnection,
        sql: &Sql,
        query: &Query<'_>,
    ) -> Result<Vec<KeyRecord>, sqlx::Error> {
        if let Query::Claims {
            scope,
            stuck_only,
            limit,
        } = *query
            && sql.mode(conn).await?.is_none()
        {
            return claims_in_flight(conn, sql, scope, stuck_only, limit).await;
        }
        let Parts {
            filter,
            order,
            limit,
            payload,
            params,
        } = query.parts(|_| "?".to_owned(), "UTC_TIMESTAMP(6)");
        let stored = if payload {
            "COALESCE(headers, '') AS headers, COALESCE(body, '') AS body"
        } else {
            "CAST('' AS BINARY) AS headers, CAST('' AS BINARY) AS body"
        };
        let sql = format!(
            "SELECT {INSPECTED}, {stored} FROM {} WHERE {filter} ORDER BY {order} LIMIT {limit}",
            sql.table
        );
        // In a transaction of its own: a fresh snapshot, which a session with
        // `autocommit = 0` does not leave open when the connection goes back.
        let mut tx = conn.begin_with(BEGIN_READ_COMMITTED).await?;
        let records = fetch::<MySql>(&mut tx, sql, params).await?;
        tx.commit().await?;
        Ok(records)
    }

    async fn idem_reseal(
        conn: &mut MySqlConnection,
        sql: &Sql,
        writes: &[Resealed<'_>],
    ) -> Result<u64, sqlx::Error> {
        // A transaction of its own, committed at once whatever the session's
        // `autocommit`; rows by their primary key, of completed records only,
        // which no claim waits for unless it takes one over. As text, several
        // updates a round trip (as the engine records), in scripts of a few MiB.
        const SCRIPT_BYTES: usize = 4 << 20;
        let mut tx = conn.begin_with(BEGIN_READ_COMMITTED).await?;
        let mut written = 0;
        let mut script = String::new();
        for (n, write) in writes.iter().enumerate() {
            let _ = write!(
                script,
                "UPDATE {} SET fingerprint = X'{}', status = 0, headers = '', body = X'{}' \
                 WHERE scope = X'{}' AND idempotency_key = X'{}' AND lease = {} \
                   AND state = 'completed'; ",
                sql.table,
                to_hex(&write.fingerprint),
                to_hex(&write.body),
                to_hex(write.record.scope.as_bytes()),
                to_hex(write.record.key.as_bytes()),
                write.record.lease,
            );
            if script.len() >= SCRIPT_BYTES || n + 1 == writes.len() {
                let sent = std::mem::take(&mut script);
                written += sqlx::raw_sql(AssertSqlSafe(sent))
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
            }
        }
        tx.commit().await?;
        Ok(written)
    }
}

/// The columns an operator's look selects but the stored response, in the shape
/// `backend::fetch` decodes.
const INSPECTED: &str = "CAST(scope AS CHAR) AS scope, \
    CAST(idempotency_key AS CHAR) AS idempotency_key, state, method, path, \
    CAST(status AS SIGNED) AS status, lease, CAST(content_type AS CHAR) AS content_type, \
    fingerprint, \
    CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), locked_until) DIV 1000 AS SIGNED) AS lock_left_ms, \
    CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) DIV 1000 AS SIGNED) AS expires_in_ms, \
    CAST(TIMESTAMPDIFF(MICROSECOND, created_at, UTC_TIMESTAMP(6)) DIV 1000 AS SIGNED) AS age_ms";

/// Claims in flight, oldest first: on MySQL a claim's row is written inside its
/// executor's transaction (`begin_text`), so they are read uncommitted, which waits
/// for no lock; such a row is a claim while its key's named lock is held. Rows
/// without a body are the candidates (an uncommitted claim looks like a committed
/// one whose transaction ended behind idem's back), newest first, since a claim in
/// flight is younger than its lock and an ended record may be as old as its ttl.
async fn claims_in_flight(
    conn: &mut MySqlConnection,
    sql: &Sql,
    scope: Option<&str>,
    stuck_only: bool,
    limit: u32,
) -> Result<Vec<KeyRecord>, sqlx::Error> {
    let mut filter = "(state = 'processing' OR (state = 'completed' AND body IS NULL))".to_owned();
    if scope.is_some() {
        filter.push_str(" AND scope = ?");
    }
    if stuck_only {
        filter.push_str(" AND locked_until <= UTC_TIMESTAMP(6)");
    }
    let candidates = limit.saturating_add(1_000);
    let text = format!(
        "SELECT {INSPECTED}, CAST('' AS BINARY) AS headers, CAST('' AS BINARY) AS body FROM {} \
         WHERE {filter} ORDER BY created_at DESC LIMIT {candidates}",
        sql.table
    );
    let mut tx = conn.begin_with(BEGIN_READ_UNCOMMITTED).await?;
    let mut rows = fetch::<MySql>(&mut tx, text, scope.into_iter().collect()).await?;
    tx.commit().await?;
    let mut held = Vec::with_capacity(rows.len());
    for batch in rows.chunks(100) {
        let locks: Vec<String> = batch
            .iter()
            .map(|row| {
                let digest = crate::signal::key_digest(&sql.name, &row.scope, &row.key);
                format!(
                    "CAST(IS_USED_LOCK({}) IS NOT NULL AS SIGNED)",
                    lock_name_of(sql, &digest)
                )
            })
            .collect();
        let row = sqlx::raw_sql(AssertSqlSafe(format!("SELECT {}", locks.join(", "))))
            .fetch_one(&mut *conn)
            .await?;
        for n in 0..batch.len() {
            held.push(row.try_get::<i64, _>(n)? == 1);
        }
    }
    // A committed `processing` row (a claim of a release that committed them) is a
    // claim whoever holds the lock.
    let mut held = held.into_iter();
    rows.retain(|row| held.next().unwrap_or(false) || row.state == "processing");
    for row in &mut rows {
        "processing".clone_into(&mut row.state);
    }
    rows.reverse();
    rows.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
    Ok(rows)
}

/// Makes `database` the session's.
async fn use_database(conn: &mut MySqlConnection, database: &str) -> Result<(), sqlx::Error> {
    let quoted = database.replace('`', "``");
    sqlx::raw_sql(AssertSqlSafe(format!("USE `{quoted}`")))
        .execute(conn)
        .await?;
    Ok(())
}

/// Applies the scripts `table` lacks. A script that changes an existing table adds
/// its marker column last, in the same statement as the rest.
async fn apply(
    conn: &mut MySqlConnection,
    table: &str,
    scripts: &[(String, Applied)],
) -> Result<(), sqlx::Error> {
    for (script, applied) in scripts {
        if in_place(conn, table, *applied).await? {
            continue;
        }
        let run = sqlx::raw_sql(AssertSqlSafe(script.clone()))
            .execute(&mut *conn)
            .await;
        // Applied by another instance meanwhile, on a cluster (no named lock there).
        if let Err(error) = run
            && !in_place(conn, table, *applied).await?
        {
            return Err(error);
        }
    }
    Ok(())
}

/// Whether `table` already has what a script marked `applied` adds.
async fn in_place(
    conn: &mut MySqlConnection,
    table: &str,
    applied: Applied,
) -> Result<bool, sqlx::Error> {
    let probe = match applied {
        Applied::Rerun | Applied::HasFunctions => return Ok(false),
        Applied::TableExists => sqlx::query_scalar::<_, i64>(
            "SELECT COUNT(*) FROM information_schema.TABLES \
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
        )
        .bind(table),
        Applied::HasColumn(column) => sqlx::query_scalar::<_, i64>(
            "SELECT COUNT(*) FROM information_schema.COLUMNS \
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? AND COLUMN_NAME = ?",
        )
        .bind(table)
        .bind(column),
    };
    Ok(probe.fetch_one(conn).await? > 0)
}

/// What the claim takes on the session, as one text: the session's timeouts set
/// to its lock and `autocommit` to 0 (their own values saved, for `finish` to
/// restore), the key's named lock tried and the claim's times by the database
/// clock; a `COMMIT`, which ends a transaction that a session with `autocommit = 0`
/// may hold open, whose snapshot could predate the lock; then, for a key that is
/// probably `new`, the handler's transaction with the claim's row in it
/// (`begin_text` with `New::Only`), which fails the text unless the lock was taken
/// and the key has no row. A row of the key is found by the insert itself, which
/// sees every row committed before the lock's last holder let it go; it used to be
/// a `SELECT` of its own before the `BEGIN` (docs/backends.md, "First executions against the floor").
fn claim_text(sql: &Sql, id: &Identity<'_>, claim: Claim, new: bool) -> String {
    let wait_secs = claim.lock_ms.saturating_add(999) / 1000;
    let lock_us = claim.lock_ms.saturating_mul(1000);
    let lock = lock_name(sql, id);
    let then = if new {
        format!("; {}", begin_text(sql, id, claim, New::Only))
    } else {
        String::new()
    };
    // One SET evaluates every value before it assigns any: the saved timeouts are
    // the session's own, and the lock's name is stored before the lock is tried.
    format!(
        "SET @idem_wait_timeout = @@SESSION.wait_timeout, \
             @idem_lock_wait_timeout = @@SESSION.innodb_lock_wait_timeout, \
             @idem_autocommit = @@SESSION.autocommit, SESSION autocommit = 0, \
             SESSION wait_timeout = {wait_secs}, SESSION innodb_lock_wait_timeout = {wait_secs} \
             {}, \
             @idem_lock = {lock}, @idem_locked = GET_LOCK({lock}, 0), \
             @idem_at = UTC_TIMESTAMP(6), \
             @idem_until = UTC_TIMESTAMP(6) + INTERVAL {lock_us} MICROSECOND; \
         COMMIT{then}",
        mariadb_timeouts(wait_secs)
    )
}

/// Which rows of the key the claim's row may meet.
#[derive(Clone, Copy)]
enum New {
    /// None: the insert fails on a stored row (1062) and, before it looks, on a
    /// lock not taken (1690, see `taken`).
    Only,
    /// An expired or abandoned one, read under the lock: replaced whole.
    OrReplace,
}

/// Opens the handler's transaction with the claim's row in it: completed, with no
/// body (what `Found::ended` recognizes), never seen by another session unless the
/// database commits the transaction before idem records the answer over it. Then
/// every later transaction of the session is made read-only (`LATER_READ_ONLY`).
/// So a handler whose transaction was committed behind idem's back leaves a row
/// that answers `transaction-ended` for the key's ttl, even if its process dies
/// before it answers: the key is never run twice. Scope, key and the rest are
/// written as hex, which cannot end the literal.
fn begin_text(sql: &Sql, id: &Identity<'_>, claim: Claim, new: New) -> String {
    let ttl_us = claim.ttl_ms.saturating_mul(1000);
    // The largest `BIGINT UNSIGNED` plus 1 is error 1690 whatever the `sql_mode`,
    // raised before the insert looks for the key; a plain `SELECT` of the key
    // before the `BEGIN` did this, for about 60 µs of the server's CPU.
    let (guard, replace) = match new {
        New::Only => (
            " WHERE 18446744073709551615 + IF(@idem_locked <=> 1, 0, 1) > 0",
            String::new(),
        ),
        New::OrReplace => ("", format!(" ON DUPLICATE KEY UPDATE {REPLACE_ALL}")),
    };
    format!(
        "BEGIN; \
         INSERT INTO {} (scope, idempotency_key, state, lease, method, path, fingerprint, \
                content_type, status, headers, body, locked_until, expires_at, created_at) \
         SELECT X'{}', X'{}', 'completed', {}, X'{}', X'{}', X'{}', X'{}', 500, NULL, NULL, \
                @idem_until, @idem_at + INTERVAL {ttl_us} MICROSECOND, @idem_at \
         FROM DUAL{guard}{replace}; \
         {LATER_READ_ONLY}",
        sql.table,
        to_hex(id.scope.as_bytes()),
        to_hex(id.key.as_bytes()),
        claim.lease,
        to_hex(id.method.as_bytes()),
        to_hex(id.path.as_bytes()),
        to_hex(&id.fingerprint),
        to_hex(id.content_type.as_bytes()),
    )
}

/// Rolls back the handler's transaction and reports whether the database had
/// committed it already, the claim's row included (`begin_text`). The session is
/// read-write again, and holds no table lock a `LOCK TABLES` of the handler's
/// took. sqlx still counts the transaction: its `ROLLBACK` does nothing now and
/// goes out with the connection's next statement.
async fn ended(
    conn: &mut MySqlConnection,
    sql: &Sql,
    id: &Identity<'_>,
    lease: i64,
    cluster: bool,
) -> Result<bool, sqlx::Error> {
    // A cluster has no table lock to let go of (a handler must take none there,
    // docs/deployment.md), and Percona XtraDB Cluster refuses the statement.
    let unlock = if cluster { "" } else { "UNLOCK TABLES; " };
    let text = format!(
        "ROLLBACK; SET SESSION TRANSACTION READ WRITE; {unlock}{READ_COMMITTED_ONCE}; \
         SELECT COUNT(*) FROM {} WHERE {} AND lease = {lease} AND state = 'completed' \
                AND body IS NULL; \
         COMMIT",
        sql.table,
        key_filter(id),
    );
    let rows = sqlx::raw_sql(AssertSqlSafe(text))
        .fetch_all(&mut *conn)
        .await?;
    <MySql as sqlx::Database>::TransactionManager::start_rollback(conn);
    let kept: i64 = match rows.first() {
        Some(row) => row.try_get(0)?,
        None => 0,
    };
    Ok(kept > 0)
}

/// Whether `error` is a write refused because the transaction is read-only: the
/// handler's had ended before it (see `LATER_READ_ONLY`).
fn read_only(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(|error| error.try_downcast_ref::<MySqlDatabaseError>())
        .is_some_and(|error| error.number() == READ_ONLY_TRANSACTION)
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

/// Whether `error` is the claim's row refused (`New::Only`): the key's lock is
/// busy (1690) or the key is stored (1062, a duplicate key).
fn taken(error: &sqlx::Error) -> bool {
    matches!(error_number(error), Some(1690 | 1062))
}

/// Reads after the claim's lock, outside the handler's transaction (see
/// `claim_text`), in one statement: whether the lock was taken and what is
/// stored, committed rows only (`READ_COMMITTED_ONCE`); `then`, sent after it in
/// the same round trip. The `ROLLBACK` ends the transaction a refused claim row
/// was tried in (and the one a session with `autocommit = 0` opens), which wrote
/// nothing: a transaction's isolation cannot be set while one is open, and a
/// `COMMIT` there cost the server more (the cold replays of the HTTP bench, 250
/// µs of the server's CPU each before the claim row became the check, 335 after
/// with a `COMMIT`, about 300 with this `ROLLBACK`).
async fn read(
    conn: &mut MySqlConnection,
    sql: &Sql,
    id: &Identity<'_>,
    then: Option<&str>,
) -> Result<(bool, Option<Found>), sqlx::Error> {
    let then = then.map(|then| format!("; {then}")).unwrap_or_default();
    let text = format!(
        "ROLLBACK; {READ_COMMITTED_ONCE}; \
         SELECT CAST(@idem_locked AS SIGNED) AS locked, \
                CAST(scope IS NOT NULL AS SIGNED) AS stored, {} \
         FROM (SELECT 1 AS one) AS o LEFT JOIN {} ON {}{then}",
        sql.columns,
        sql.table,
        key_filter(id),
    );
    let rows = sqlx::raw_sql(AssertSqlSafe(text))
        .fetch_all(&mut *conn)
        .await?;
    let Some(row) = rows.first() else {
        return Err(sqlx::Error::RowNotFound);
    };
    let locked: Option<i64> = row.try_get("locked")?;
    let stored: i64 = row.try_get("stored")?;
    let found = if stored == 1 {
        Some(Found::decode(row)?)
    } else {
        None
    };
    Ok((locked == Some(1), found))
}

/// The key's named lock as an SQL expression: `LOCK_NAME` for the pool's
/// database, computed here (the server's `SHA2` costs more than the rest of the
/// claim's `SET`, about 20 µs a time, measured on MariaDB 10.11). Only a pool that
/// names no database leaves the name to the server, from the session's.
fn lock_name(sql: &Sql, id: &Identity<'_>) -> String {
    lock_name_of(sql, &id.digest)
}

/// [`lock_name`] from the key's digest alone.
fn lock_name_of(sql: &Sql, digest: &[u8; 32]) -> String {
    // The seed is hex digits: it can go into the text.
    let seed = lock_seed(digest);
    if sql.database.is_empty() {
        return LOCK_NAME.replacen('?', &format!("'{seed}'"), 1);
    }
    let digest = Sha256::digest(format!("{}:{seed}", sql.database));
    format!("'idem:{}'", &to_hex(&digest)[..40])
}

/// Hex SHA-256 over (table, scope, key); the SQL mixes in the database name and
/// keeps 40 hex digits, within MySQL's 64-character limit on lock names.
fn lock_seed(digest: &[u8; 32]) -> String {
    to_hex(digest)
}

/// Frees what `claim_text` took on the session (see `Sql::rollback`). Whatever
/// transaction is still open is rolled back first, so that nothing the claim left
/// in it commits when `autocommit` comes back.
async fn finish(conn: &mut MySqlConnection, sql: &Sql) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(AssertSqlSafe(sql.rollback.clone()))
        .execute(conn)
        .await?;
    Ok(())
}
