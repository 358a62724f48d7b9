//! MySQL and MariaDB on a multi-primary cluster (MariaDB Galera Cluster, Percona
//! XtraDB Cluster): the committed claim with a lease (`crate::lease`), since a
//! named lock or a row lock holds on its own node only.
//!
//! The cluster's one exclusion across nodes is certification: of two committed
//! transactions that wrote the same primary key on two nodes, the first wins and
//! the other fails its `COMMIT` with 1213, rolled back. So the claim is a row
//! committed before the handler runs (a duplicate on any node sees it, or loses
//! certification), and the handler's transaction writes that row twice: at its
//! `BEGIN`, the ended mark (`super::begin_text`'s, for the same reason), and the
//! response at the record, both under the claim's lease. A takeover on another
//! node then conflicts with the executor it replaces, and at most one of them
//! commits. Nothing here is refused by Percona XtraDB Cluster's strict mode: no
//! named lock, no `LOCK TABLES`, no SERIALIZABLE. The design and its cost are in
//! `docs/backends.md`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::{AssertSqlSafe, MySql, MySqlConnection, Row as _};
use sqlx_core::transaction::TransactionManager as _;

use super::{
    LATER_READ_ONLY, MARIADB_TIMEOUTS_BACK, READ_COMMITTED_ONCE, error_number, key_filter,
    mariadb_timeouts,
};
use crate::backend::{Claim, Found, Identity, Opened};
use crate::key::to_hex;
use crate::lease::{Dialect, Statements};
use crate::tx::{Adopted, Open};

/// When another node may take a claim over: once its lock has passed twice, by
/// that node's clock. The deadline is written by the claiming node's clock and
/// compared by another's, and node clocks differ (by milliseconds under NTP,
/// by seconds when it fails or a paused machine resumes): a takeover at the lock
/// itself would start beside an executor still running whenever the taking
/// node's clock runs ahead. Waiting one more lock (the claim's own: its
/// `locked_until` less its `created_at`) leaves any difference under the lock
/// harmless; the executor's own checks (the fence, the record) compare on its
/// own node, against its own clock. `docs/deployment.md`, "Clocks".
const TAKEOVER_AT: &str =
    "locked_until + INTERVAL TIMESTAMPDIFF(MICROSECOND, created_at, locked_until) MICROSECOND";

/// Times are `DATETIME(6)` in UTC.
const DIALECT: Dialect = Dialect {
    now: "UTC_TIMESTAMP(6)",
    ms_until: |column| {
        format!("CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), {column}) DIV 1000 AS SIGNED)")
    },
    ms_since: |column| {
        format!("CAST(TIMESTAMPDIFF(MICROSECOND, {column}, UTC_TIMESTAMP(6)) DIV 1000 AS SIGNED)")
    },
    begin: super::BEGIN_READ_COMMITTED,
    reads_in_transaction: true,
    takeover_at: TAKEOVER_AT,
};

/// Room a write set needs beyond the response it carries: the claim's row and
/// the handler's own writes. A response that leaves less is refused.
const WRITE_SET_ROOM: u64 = 1 << 20;

/// How many times a response's size its write set carries. The row holds it
/// once; MariaDB annotates each row event with the statement's text
/// (`binlog_annotate_row_events`, on by default), where the bound body appears
/// again, escaped (up to two bytes a byte): a 1.5 MiB text body made a 3 MiB
/// write set, measured.
const WRITE_SET_COPIES: u64 = 3;

/// How long a new key's claim is tried again while a row lock that is no
/// claim's holds it up (see `open`).
const BUSY_PATIENCE: Duration = Duration::from_secs(1);

/// What the cluster mode sends, for one table.
#[derive(Debug)]
pub(crate) struct Sql {
    pub(super) lease: Statements,
    /// The columns a lookup selects: a claim is live until `TAKEOVER_AT`.
    columns: Box<str>,
    /// Completes the ended mark with the response, in the handler's transaction.
    pub(super) record: Arc<str>,
    /// `COMMIT`, then the session's own settings back.
    commit: Arc<str>,
    /// `ROLLBACK`, then the same.
    rollback: Arc<str>,
    /// The server knows `wsrep_sync_wait` (a Galera node, or a MariaDB built with
    /// wsrep support): decisive reads wait for the writes the cluster committed.
    sync_wait: bool,
    /// The largest response a write set carries (`wsrep_max_ws_size`, less
    /// `WRITE_SET_ROOM`, over `WRITE_SET_COPIES`).
    pub(crate) max_response: Option<usize>,
}

impl Sql {
    pub(super) fn new(table: &str, sync_wait: bool, max_write_set: Option<u64>) -> Self {
        let restore = restore(sync_wait);
        Self {
            lease: Statements::new(&DIALECT, table),
            columns: super::columns(TAKEOVER_AT).into(),
            record: format!(
                "UPDATE {table} SET status = ?, headers = ?, body = ? \
                 WHERE scope = ? AND idempotency_key = ? AND lease = ? \
                   AND state = 'completed' AND body IS NULL AND locked_until > UTC_TIMESTAMP(6)"
            )
            .into(),
            commit: format!("COMMIT; {restore}").into(),
            rollback: format!("ROLLBACK; {restore}").into(),
            sync_wait,
            max_response: max_write_set.map(|max| {
                let carried = max.saturating_sub(WRITE_SET_ROOM) / WRITE_SET_COPIES;
                usize::try_from(carried).unwrap_or(usize::MAX)
            }),
        }
    }

    /// Makes the session's next reads wait until this node has applied every
    /// write the cluster committed before them (a row committed on another node a
    /// moment ago is otherwise missing from a first read, measured 1 in 1,000).
    fn sync_on(&self) -> &'static str {
        if self.sync_wait {
            "SET SESSION wsrep_sync_wait = @@SESSION.wsrep_sync_wait | 1; "
        } else {
            ""
        }
    }

    /// The session's own `wsrep_sync_wait` back.
    fn sync_back(&self) -> &'static str {
        if self.sync_wait {
            "SET SESSION wsrep_sync_wait = @idem_sync_wait; "
        } else {
            ""
        }
    }
}

/// The session's own settings back, as `super::Sql::rollback`'s but with no named
/// lock to release, and `wsrep_sync_wait` where the server has it.
fn restore(sync_wait: bool) -> String {
    let sync = if sync_wait {
        ", wsrep_sync_wait = CAST(COALESCE(@idem_sync_wait, @@SESSION.wsrep_sync_wait) AS UNSIGNED)"
    } else {
        ""
    };
    format!(
        "SET SESSION TRANSACTION READ WRITE; SET SESSION \
            autocommit = COALESCE(@idem_autocommit, @@SESSION.autocommit), \
            wait_timeout = CAST(COALESCE(@idem_wait_timeout, @@SESSION.wait_timeout) AS UNSIGNED), \
            innodb_lock_wait_timeout = CAST(COALESCE(@idem_lock_wait_timeout, \
                @@SESSION.innodb_lock_wait_timeout) AS UNSIGNED) \
            {MARIADB_TIMEOUTS_BACK}{sync}"
    )
}

/// What the claim takes on the session, as `super::claim_text` does, but no named
/// lock: its settings saved and set (row lock waits not at all, until the
/// handler's transaction, which gets the lock's), the claim's times by the
/// database clock, and a `COMMIT` that ends a transaction the session may hold.
fn session_text(cluster: &Sql, claim: Claim) -> String {
    // The server ends a hung executor's session at the lock, as in the
    // standalone design: its row lock on the claim would otherwise keep a
    // takeover on this node out. The claim it leaves is released by another
    // session (`Again::Now`), or taken over.
    let wait_secs = claim.lock_ms.saturating_add(999) / 1000;
    let lock_us = claim.lock_ms.saturating_mul(1000);
    let sync = if cluster.sync_wait {
        ", @idem_sync_wait = @@SESSION.wsrep_sync_wait"
    } else {
        ""
    };
    // A row another claim of this node holds locked is busy: it waits for
    // nobody (MySQL's minimum is one second; MariaDB's is none).
    format!(
        "SET @idem_wait_timeout = @@SESSION.wait_timeout, \
             @idem_lock_wait_timeout = @@SESSION.innodb_lock_wait_timeout, \
             @idem_autocommit = @@SESSION.autocommit{sync}, SESSION autocommit = 0, \
             SESSION wait_timeout = {wait_secs}, SESSION innodb_lock_wait_timeout = 0 \
             {}, \
             @idem_at = UTC_TIMESTAMP(6), \
             @idem_until = UTC_TIMESTAMP(6) + INTERVAL {lock_us} MICROSECOND; \
         COMMIT",
        mariadb_timeouts(wait_secs)
    )
}

/// After the claim's `COMMIT`: the handler's transaction, with the ended mark in
/// it (see `super::begin_text`) and later transactions read-only.
///
/// The mark is also the fence the handler starts behind: it changes the row only
/// while the claim's lease holds it and its lock is ahead. A claim whose commit
/// stalled past its lock (flow control, a slow node, a paused process) may have
/// been taken over on another node meanwhile; the mark then changes nothing, and
/// the text fails (1690) before the handler could run beside the new owner.
fn begin_text(sql: &super::Sql, id: &Identity<'_>, claim: Claim) -> String {
    let wait_secs = claim.lock_ms.saturating_add(999) / 1000;
    format!(
        "SET SESSION innodb_lock_wait_timeout = {wait_secs}; BEGIN; \
         UPDATE {} SET state = 'completed', status = 500 \
         WHERE {} AND lease = {} AND state = 'processing' \
           AND locked_until > UTC_TIMESTAMP(6); \
         SELECT 18446744073709551615 + (ROW_COUNT() = 0); \
         {LATER_READ_ONLY}",
        sql.table,
        key_filter(id),
        claim.lease,
    )
}

/// A claim's row but its scope and key, column by column.
fn claim_row(id: &Identity<'_>, claim: Claim) -> [(&'static str, String); 12] {
    let ttl_us = claim.ttl_ms.saturating_mul(1000);
    [
        ("state", "'processing'".to_owned()),
        ("lease", claim.lease.to_string()),
        ("method", format!("X'{}'", to_hex(id.method.as_bytes()))),
        ("path", format!("X'{}'", to_hex(id.path.as_bytes()))),
        ("fingerprint", format!("X'{}'", to_hex(&id.fingerprint))),
        (
            "content_type",
            format!("X'{}'", to_hex(id.content_type.as_bytes())),
        ),
        ("status", "NULL".to_owned()),
        ("headers", "NULL".to_owned()),
        ("body", "NULL".to_owned()),
        ("locked_until", "@idem_until".to_owned()),
        (
            "expires_at",
            format!("@idem_at + INTERVAL {ttl_us} MICROSECOND"),
        ),
        ("created_at", "@idem_at".to_owned()),
    ]
}

/// Whether a claim's statement failed because another claim has the key: its row
/// is there (1690 from the check, 1062 from the insert), another claim of this
/// node holds it locked (1205), or another node's claim committed first (1213).
fn lost(error: &sqlx::Error) -> bool {
    matches!(error_number(error), Some(1690 | 1062 | 1205 | 1213))
}

/// A new key's claim: the check (a consistent read that waits for the cluster's
/// earlier writes) stops the text when the key has a row; the insert and its
/// `COMMIT` claim it, certified on every node.
fn insert_text(sql: &super::Sql, cluster: &Sql, id: &Identity<'_>, claim: Claim) -> String {
    let row = claim_row(id, claim);
    let columns: Vec<&str> = row.iter().map(|(column, _)| *column).collect();
    let values: Vec<&str> = row.iter().map(|(_, value)| value.as_str()).collect();
    format!(
        "{}; {}{READ_COMMITTED_ONCE}; \
         SELECT 18446744073709551615 + EXISTS (SELECT 1 FROM {} WHERE {}); \
         {}INSERT INTO {} (scope, idempotency_key, {}) VALUES (X'{}', X'{}', {}); \
         COMMIT",
        session_text(cluster, claim),
        cluster.sync_on(),
        sql.table,
        key_filter(id),
        cluster.sync_back(),
        sql.table,
        columns.join(", "),
        to_hex(id.scope.as_bytes()),
        to_hex(id.key.as_bytes()),
        values.join(", "),
    )
}

/// Claims a new key in one round trip: the claim (`insert_text`), then the
/// handler's transaction behind its fence (`begin_text`).
pub(super) async fn open<'c>(
    conn: &'c mut MySqlConnection,
    sql: &'c super::Sql,
    cluster: &'c Sql,
    id: &'c Identity<'c>,
    claim: Claim,
) -> Result<Opened<'c, MySql>, sqlx::Error> {
    #[cfg(feature = "testing")]
    if let Some(hold) = sql.stall.take() {
        return open_stalled(conn, sql, cluster, id, claim, hold).await;
    }
    let text = format!(
        "{}; {}",
        insert_text(sql, cluster, id, claim),
        begin_text(sql, id, claim),
    );
    // A row lock is not only a claim's: a sweep's deletions or an index gap may
    // hold up the insert for a moment. Busy (1205, never waited for) with no row
    // to show for it is no duplicate: the claim is tried again, for a while.
    let deadline = Instant::now() + BUSY_PATIENCE;
    let mut pause = Duration::from_millis(1);
    loop {
        // The lock runs from the text's start (`session_text`), this attempt's.
        let sent = Instant::now();
        // Adopted at once, so that the connection is free for the lost arm.
        let begun = sqlx::Connection::begin_with(&mut *conn, AssertSqlSafe(text.as_str()))
            .await
            .map(Open::adopt);
        let error = match begun {
            Ok(adopted) => return Ok(Opened::Adopted(adopted.lock_from(sent))),
            Err(error) if lost(&error) => error,
            Err(error) => return Err(error),
        };
        let found = read(conn, sql, cluster, id, claim.lease).await?;
        if found.is_some() || error_number(&error) != Some(1205) || Instant::now() >= deadline {
            return Ok(found.map_or(Opened::Lost, Opened::Found));
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// `open` with the claim held between its `COMMIT` and the handler's `BEGIN`
/// (`Idempotency::hold_after_claim`): two round trips where `open` sends one.
#[cfg(feature = "testing")]
async fn open_stalled<'c>(
    conn: &'c mut MySqlConnection,
    sql: &'c super::Sql,
    cluster: &'c Sql,
    id: &'c Identity<'c>,
    claim: Claim,
    hold: crate::hooks::StallHold,
) -> Result<Opened<'c, MySql>, sqlx::Error> {
    let text = insert_text(sql, cluster, id, claim);
    let sent = Instant::now();
    match sqlx::raw_sql(AssertSqlSafe(text)).execute(&mut *conn).await {
        Ok(_) => {}
        Err(error) if lost(&error) => {
            let found = read(conn, sql, cluster, id, claim.lease).await?;
            return Ok(found.map_or(Opened::Lost, Opened::Found));
        }
        Err(error) => return Err(error),
    }
    stall(conn, hold).await?;
    begin_fenced(conn, sql, cluster, id, claim, sent).await
}

/// Holds a committed claim's session as a stalled commit would: busy, so that
/// the server's idle timeout (`wait_timeout`, the lock) does not end it.
#[cfg(feature = "testing")]
async fn stall(
    conn: &mut MySqlConnection,
    hold: crate::hooks::StallHold,
) -> Result<(), sqlx::Error> {
    let mut released = hold.reached();
    for _ in 0..240 {
        let tick = Duration::from_millis(250);
        if tokio::time::timeout(tick, &mut released).await.is_ok() {
            break;
        }
        sqlx::raw_sql("DO 0").execute(&mut *conn).await?;
    }
    Ok(())
}

/// The handler's transaction after a claim committed in a round trip of its own
/// (sent at `sent`, when its lock began to run): `Adopted` behind its fence
/// (`begin_text`), else what the key holds now.
async fn begin_fenced<'c>(
    conn: &'c mut MySqlConnection,
    sql: &'c super::Sql,
    cluster: &'c Sql,
    id: &'c Identity<'c>,
    claim: Claim,
    sent: Instant,
) -> Result<Opened<'c, MySql>, sqlx::Error> {
    let begin = begin_text(sql, id, claim);
    // Adopted at once, so that the connection is free for the fenced arm.
    let begun = sqlx::Connection::begin_with(&mut *conn, AssertSqlSafe(begin))
        .await
        .map(Open::adopt);
    match begun {
        Ok(adopted) => Ok(Opened::Adopted(adopted.lock_from(sent))),
        Err(error) if error_number(&error) == Some(1690) => {
            let found = read(conn, sql, cluster, id, claim.lease).await?;
            Ok(found.map_or(Opened::Lost, Opened::Found))
        }
        Err(error) => Err(error),
    }
}

/// Takes over a row the engine found expired, or a claim past its lock, with one
/// conditional statement whose row count decides (never a read, then a write:
/// between the two another node may have taken it).
pub(super) async fn take_over<'c>(
    conn: &'c mut MySqlConnection,
    sql: &'c super::Sql,
    cluster: &'c Sql,
    id: &'c Identity<'c>,
    claim: Claim,
) -> Result<Option<Adopted>, sqlx::Error> {
    let set: Vec<String> = claim_row(id, claim)
        .iter()
        .map(|(column, value)| format!("{column} = {value}"))
        .collect();
    // Two round trips (a takeover is rare): the handler's transaction begins
    // only once the claim has committed.
    let text = format!(
        "{}; {READ_COMMITTED_ONCE}; \
         UPDATE {} SET {} WHERE {} AND (expires_at <= UTC_TIMESTAMP(6) \
                OR (state = 'processing' AND {TAKEOVER_AT} <= UTC_TIMESTAMP(6))); \
         SELECT 18446744073709551615 + (ROW_COUNT() = 0); \
         COMMIT",
        session_text(cluster, claim),
        sql.table,
        set.join(", "),
        key_filter(id),
    );
    let sent = Instant::now();
    match sqlx::raw_sql(AssertSqlSafe(text)).execute(&mut *conn).await {
        Ok(_) => {}
        Err(error) if lost(&error) => {
            read(conn, sql, cluster, id, claim.lease).await?;
            return Ok(None);
        }
        Err(error) => return Err(error),
    }
    #[cfg(feature = "testing")]
    if let Some(hold) = sql.stall.take() {
        stall(conn, hold).await?;
    }
    Ok(
        match begin_fenced(conn, sql, cluster, id, claim, sent).await? {
            Opened::Adopted(adopted) => Some(adopted),
            _ => None,
        },
    )
}

/// After a claim lost: rolls back what it began, reads what is stored (waiting for
/// the cluster's writes), and gives the session its settings back, in one round
/// trip. Had the claim's own row committed before a later statement failed, it
/// is released, and the key answers as in flight this once.
async fn read(
    conn: &mut MySqlConnection,
    sql: &super::Sql,
    cluster: &Sql,
    id: &Identity<'_>,
    lease: i64,
) -> Result<Option<Found>, sqlx::Error> {
    let text = format!(
        "ROLLBACK; {}{READ_COMMITTED_ONCE}; \
         SELECT CAST(scope IS NOT NULL AS SIGNED) AS stored, \
                CAST(COALESCE(lease = {lease}, 0) AS SIGNED) AS ours, {} \
         FROM (SELECT 1 AS one) AS o LEFT JOIN {} ON {}; \
         {}",
        cluster.sync_on(),
        cluster.columns,
        sql.table,
        key_filter(id),
        cluster.rollback,
    );
    // The failed claim may hold a lock on the winner's row (InnoDB keeps one on a
    // duplicate it found): a write set that the node applies to that row aborts
    // the transaction, and the server reports it (1213) at the next statement,
    // this one's `ROLLBACK`. Rolled back by then, it is read again.
    let rows = match sqlx::raw_sql(AssertSqlSafe(text.as_str()))
        .fetch_all(&mut *conn)
        .await
    {
        Err(error) if error_number(&error) == Some(1213) => {
            sqlx::raw_sql(AssertSqlSafe(text.as_str()))
                .fetch_all(&mut *conn)
                .await?
        }
        rows => rows?,
    };
    let Some(row) = rows.first() else {
        return Err(sqlx::Error::RowNotFound);
    };
    if row.try_get::<i64, _>("ours")? == 1 {
        release(conn, cluster, id, lease).await?;
        return Ok(None);
    }
    if row.try_get::<i64, _>("stored")? == 1 {
        return Found::decode(row).map(Some);
    }
    Ok(None)
}

/// Reads (scope, key) outside any transaction, after the cluster's earlier writes.
pub(super) async fn lookup(
    conn: &mut MySqlConnection,
    sql: &super::Sql,
    cluster: &Sql,
    id: &Identity<'_>,
) -> Result<Option<Found>, sqlx::Error> {
    let text = format!(
        "SET @idem_sync_wait = {}; {}{READ_COMMITTED_ONCE}; SELECT {} FROM {} WHERE {}; COMMIT; {}",
        if cluster.sync_wait {
            "@@SESSION.wsrep_sync_wait"
        } else {
            "NULL"
        },
        cluster.sync_on(),
        cluster.columns,
        sql.table,
        key_filter(id),
        cluster.sync_back(),
    );
    let rows = sqlx::raw_sql(AssertSqlSafe(text)).fetch_all(conn).await?;
    rows.first().map(Found::decode).transpose()
}

/// Commits the handler's transaction and gives the session its settings back. A
/// `COMMIT` that loses certification (1213) fails here, its writes rolled back;
/// the engine answers 503 and `finish` releases the claim.
pub(super) async fn commit(conn: &mut MySqlConnection, cluster: &Sql) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(AssertSqlSafe(cluster.commit.clone()))
        .execute(&mut *conn)
        .await?;
    <MySql as sqlx::Database>::TransactionManager::start_rollback(conn);
    Ok(())
}

/// After a transaction that was not committed: the session's settings back, and
/// the claim deleted if its lease still holds it, so the key is free at once.
pub(super) async fn finish(
    conn: &mut MySqlConnection,
    cluster: &Sql,
    id: &Identity<'_>,
    lease: i64,
) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(AssertSqlSafe(cluster.rollback.clone()))
        .execute(&mut *conn)
        .await?;
    release(conn, cluster, id, lease).await
}

/// Deletes the claim of `lease`, committed whatever the session's `autocommit`,
/// waiting a second at most for a row lock (a takeover's, an operator's): a
/// failure is tried again (`Again::Now`).
async fn release(
    conn: &mut MySqlConnection,
    cluster: &Sql,
    id: &Identity<'_>,
    lease: i64,
) -> Result<(), sqlx::Error> {
    let mut tx = sqlx::Connection::begin_with(
        &mut *conn,
        "SET @idem_lock_wait_timeout = @@SESSION.innodb_lock_wait_timeout, \
             SESSION innodb_lock_wait_timeout = 1; \
         BEGIN",
    )
    .await?;
    sqlx::query(AssertSqlSafe(cluster.lease.release.clone()))
        .bind(id.scope)
        .bind(id.key)
        .bind(lease)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    sqlx::raw_sql("SET SESSION innodb_lock_wait_timeout = @idem_lock_wait_timeout")
        .execute(conn)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{Sql, WRITE_SET_ROOM};

    #[test]
    fn responses_leave_room_in_the_write_set() {
        let carried = |max| Sql::new("t", true, max).max_response;
        assert_eq!(carried(None), None);
        assert_eq!(carried(Some(7 << 20)), Some(2 << 20));
        // A write set too small for any response refuses every one, never wraps.
        assert_eq!(carried(Some(WRITE_SET_ROOM / 2)), Some(0));
        assert_eq!(
            carried(Some(2_147_483_647)),
            Some((2_147_483_647 - (1 << 20)) / 3)
        );
    }
}
