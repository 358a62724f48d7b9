//! Day partitions of the PostgreSQL partitioned layout: created ahead by
//! [`Idempotency::maintain_partitions`], or by the first claim that needs one, and
//! dropped whole once their day has ended.
//!
//! PostgreSQL scans a table it attaches as a partition, and the default partition,
//! to prove that no row is in the wrong place, under an `ACCESS EXCLUSIVE` lock that
//! every lookup waits for. Nothing here lets such a scan grow with the table:
//!
//! - a new day's table is created empty, so scanning it is free;
//! - the default partition (of tables created by the first release; it catches keys
//!   whose day had no partition) is bounded by a `CHECK (expires_at < bound)`,
//!   added `NOT VALID` by upgrade 3 and validated here under `SHARE UPDATE
//!   EXCLUSIVE`, which lets claims go on. A valid bound proves the default holds
//!   nothing for a later day, so attaching one does not scan it. Days before the
//!   bound stay in the default partition, which keeps taking their keys; once it
//!   is empty it is dropped, and every key has a day partition.
//!
//! No change may queue the hot path. A lock request that waits queues every later
//! request for the same table behind it, and a keyed transaction holds its locks
//! for as long as its handler runs; so every change that needs a lock a lookup
//! conflicts with asks for it for 20 ms at most (`lock_timeout`), then gives way
//! and tries again 50–250 ms later, until its budget is spent: claims wait 20 ms at
//! worst, once per try. Without a default partition (tables created by this release,
//! and older ones once theirs is retired) an ended day is detached with
//! `DETACH PARTITION … CONCURRENTLY` (PostgreSQL 14+), which takes no lock a lookup
//! waits for: it waits, without queueing anyone, for the transactions that may
//! still read the day to end, then drops it. Every other change runs in a short
//! transaction of its own under a per-table advisory lock, so that maintenance run
//! twice at once, or a claim creating a day, never races it. Statements are
//! unprepared: they work through a transaction pooler too.

use std::time::Duration;

use sqlx::{AssertSqlSafe, Connection, PgConnection, Row as _};

use crate::backend::{Applied, Migration};
use crate::store::{DEFAULT_TABLE, Idempotency};

/// What [`Idempotency::maintain_partitions`] changed (feature `postgres`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Partitions {
    /// Partitions created, by name.
    pub created: Vec<String>,
    /// Partitions detached and dropped, by name: ended days, and the default
    /// partition once it is empty.
    pub dropped: Vec<String>,
}

/// Where a day's keys go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Day {
    /// Its partition was attached now.
    Created,
    /// It had one already.
    Exists,
    /// The default partition still takes it (the day is before its bound).
    InDefault,
}

impl Idempotency<sqlx::Postgres> {
    /// Keeps a table of the partitioned layout (see
    /// [`Builder::partitioned_by_day`](crate::Builder::partitioned_by_day)) in shape:
    /// drops every day partition whose day (UTC) has ended, since every key in it
    /// has expired; creates the partitions for today and the next `days_ahead` days
    /// that are missing; and retires the default partition of a table created by
    /// the first release once it has emptied.
    ///
    /// Run it daily, with `days_ahead` at least your longest `ttl` in days, from
    /// one instance or several: it is correct whenever it runs, late, after days
    /// missed, twice at once. A key whose day has no partition yet is not refused:
    /// the claim that needs the day creates it (which needs the privileges that
    /// `ALTER TABLE ... ATTACH PARTITION` does). It never queues the hot path:
    /// each lock a lookup could wait behind is asked for 20 ms at a time, retried
    /// for up to 30 s, and an ended day is detached `CONCURRENTLY` (PostgreSQL 14+,
    /// once the table has no default partition), which waits for the keyed
    /// transactions still in flight without blocking any. A step that fails does
    /// not keep the others from running, and the next run retries it.
    ///
    /// # Errors
    ///
    /// `sqlx::Error::Configuration` if the store is not partitioned; otherwise the
    /// first database error among the steps (a lock timeout, say), returned after
    /// every other step has run.
    ///
    /// # Examples
    ///
    /// ```rust,no_run
    /// # extern crate idem_runtime as idem_axum;
    /// # async fn demo(idempotency: idem_axum::Idempotency<sqlx::Postgres>) {
    /// match idempotency.maintain_partitions(2).await {
    ///     Ok(changed) => println!("created {:?}, dropped {:?}", changed.created, changed.dropped),
    ///     Err(error) => eprintln!("partition maintenance: {error} (retried by the next run)"),
    /// }
    /// # }
    /// ```
    pub async fn maintain_partitions(&self, days_ahead: u32) -> Result<Partitions, sqlx::Error> {
        if !self.is_partitioned() {
            return Err(sqlx::Error::Configuration(
                "maintain_partitions needs a store built with partitioned_by_day()".into(),
            ));
        }
        let table = self.table();
        let mut conn = self.pool().acquire().await?;
        let mut changed = Partitions::default();
        let mut first_error = None;
        let mut failed = |step: &str, error: sqlx::Error| {
            tracing::warn!(%error, step, "idempotency partition maintenance step failed");
            first_error.get_or_insert(error);
        };

        // Retired first, so that the days after it are detached concurrently.
        match retire_default(&mut conn, table).await {
            Ok(Some(name)) => changed.dropped.push(name),
            Ok(None) => {}
            Err(error) => failed("bound or retire the default partition", error),
        }
        // The days ahead before any detach: a claim never waits to create its day
        // behind a detach that waits for a long handler.
        for offset in 0..=i64::from(days_ahead) {
            match attach_day(
                &mut conn,
                table,
                DaySpec::Offset(offset),
                Budget::Maintenance,
            )
            .await
            {
                Ok((name, Day::Created)) => changed.created.push(name),
                Ok(_) => {}
                Err(error) => failed("create a day", error),
            }
        }
        match ended_days(&mut conn, table).await {
            Ok(ended) => {
                for name in ended {
                    match drop_day(&mut conn, table, &name).await {
                        Ok(true) => changed.dropped.push(name),
                        Ok(false) => {}
                        Err(error) => failed("drop an ended day", error),
                    }
                }
            }
            Err(error) => failed("list ended days", error),
        }
        if !changed.created.is_empty() || !changed.dropped.is_empty() {
            tracing::info!(
                created = changed.created.len(),
                dropped = changed.dropped.len(),
                "idempotency partitions maintained"
            );
        }
        match first_error {
            Some(error) => Err(error),
            None => Ok(changed),
        }
    }
}

/// Which day to attach.
#[derive(Debug, Clone, Copy)]
pub(crate) enum DaySpec {
    /// Today (UTC) plus this many days.
    Offset(i64),
    /// The day a key claimed now with this ttl (ms) expires on.
    ExpiryAfterMs(i64),
}

/// Opens a maintenance transaction that serialises with every other change to this
/// table's partitions (waiting up to 2 s for the advisory lock, which only those
/// changes take), then asks for every later lock for 20 ms at most: see the module.
async fn begin<'c>(
    conn: &'c mut PgConnection,
    table: &str,
) -> Result<sqlx::Transaction<'c, sqlx::Postgres>, sqlx::Error> {
    let mut tx = read_committed(conn).await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "SET LOCAL lock_timeout = '2s'; \
         SELECT pg_advisory_xact_lock(hashint8extended(7306086953163416934, '{table}'::regclass::oid::int8)); \
         SET LOCAL lock_timeout = '{LOCK_TRY_MS}ms'"
    )))
    .execute(&mut *tx)
    .await?;
    Ok(tx)
}

/// How long one try waits for a lock a lookup may be queued behind.
const LOCK_TRY_MS: u64 = 20;

/// How long a change keeps trying: maintenance runs in the background and can wait
/// for a gap between keyed transactions; a claim creating its day cannot wait long.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Budget {
    Maintenance,
    Claim,
}

impl Budget {
    fn duration(self) -> Duration {
        match self {
            Self::Maintenance => Duration::from_secs(30),
            Self::Claim => Duration::from_secs(2),
        }
    }
}

/// Whether `error` is a lock request that gave way (`lock_timeout`).
fn gave_way(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(e) if e.code().as_deref() == Some("55P03"))
}

/// The tries of one change: after a try that gave way to a lock, [`again`](Self::again)
/// waits 50–250 ms (so that a lookup is queued behind at most one 20 ms try at a
/// time) and says whether to try once more, until the budget is spent.
struct Tries {
    deadline: tokio::time::Instant,
    count: u32,
}

impl Tries {
    fn new(budget: Budget) -> Self {
        Self {
            deadline: tokio::time::Instant::now() + budget.duration(),
            count: 0,
        }
    }

    async fn again(&mut self, error: &sqlx::Error) -> bool {
        if !gave_way(error) || tokio::time::Instant::now() >= self.deadline {
            if self.count > 0 {
                tracing::debug!(tries = self.count, %error, "partition change gave way until its budget");
            }
            return false;
        }
        self.count += 1;
        let spread = crate::random::random_u64() % 200;
        tokio::time::sleep(Duration::from_millis(50 + spread)).await;
        true
    }
}

/// `step` (an expression giving a future), tried until it does not give way to a
/// lock or `budget` is spent: see [`Tries`].
macro_rules! tried {
    ($budget:expr, $step:expr) => {{
        let mut tries = Tries::new($budget);
        loop {
            match $step.await {
                Err(error) if tries.again(&error).await => {}
                done => break done,
            }
        }
    }};
}

/// `BEGIN` at READ COMMITTED, whatever the default.
pub(crate) const BEGIN_READ_COMMITTED: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

/// A transaction at READ COMMITTED, whatever the default: a statement that checks
/// the catalog after taking a lock must see what the lock's last holder committed,
/// and at REPEATABLE READ the snapshot would predate the lock.
pub(crate) async fn read_committed(
    conn: &mut PgConnection,
) -> Result<sqlx::Transaction<'_, sqlx::Postgres>, sqlx::Error> {
    conn.begin_with(BEGIN_READ_COMMITTED).await
}

/// Attaches the partition of one day unless it exists or the default partition
/// still takes that day, trying until `budget` is spent. Returns the partition's
/// name.
pub(crate) async fn attach_day(
    conn: &mut PgConnection,
    table: &str,
    day: DaySpec,
    budget: Budget,
) -> Result<(String, Day), sqlx::Error> {
    tried!(budget, attach_day_once(conn, table, day))
}

async fn attach_day_once(
    conn: &mut PgConnection,
    table: &str,
    day: DaySpec,
) -> Result<(String, Day), sqlx::Error> {
    let mut tx = begin(conn, table).await?;
    let date = match day {
        DaySpec::Offset(days) => format!("(now() AT TIME ZONE 'UTC')::date + {days}"),
        DaySpec::ExpiryAfterMs(ms) => format!(
            "((clock_timestamp() + {ms}::float8 * interval '1 millisecond') AT TIME ZONE 'UTC')::date"
        ),
    };
    // The day, whether it is attached, and where the default partition stands.
    let row = sqlx::query(AssertSqlSafe(format!(
        "WITH d AS (SELECT {date} AS day), \
              b AS (SELECT k.convalidated AS valid, \
                           substring(pg_get_constraintdef(k.oid) FROM '''([^'']*)''')::timestamptz AS bound \
                    FROM pg_constraint k \
                    WHERE k.conrelid = to_regclass('{table}_default') \
                      AND k.conname = '{table}_default_bound') \
         SELECT to_char(d.day, 'YYYYMMDD') AS stamp, to_char(d.day, 'YYYY-MM-DD') AS first, \
                to_char(d.day + 1, 'YYYY-MM-DD') AS next, \
                EXISTS (SELECT 1 FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
                        WHERE i.inhparent = '{table}'::regclass \
                          AND c.relname = '{table}_p' || to_char(d.day, 'YYYYMMDD')) AS attached, \
                to_regclass('{table}_default') IS NOT NULL AS has_default, \
                coalesce((SELECT (d.day::timestamp AT TIME ZONE 'UTC') < b.bound FROM b), true) \
                    AS default_takes_it, \
                coalesce((SELECT b.valid FROM b), false) AS bound_valid \
         FROM d"
    )))
    .persistent(false)
    .fetch_one(&mut *tx)
    .await?;
    let stamp: String = row.try_get("stamp")?;
    let first: String = row.try_get("first")?;
    let next: String = row.try_get("next")?;
    let name = format!("{table}_p{stamp}");
    if row.try_get::<bool, _>("attached")? {
        return Ok((name, Day::Exists));
    }
    let has_default: bool = row.try_get("has_default")?;
    if has_default && row.try_get::<bool, _>("default_takes_it")? {
        return Ok((name, Day::InDefault));
    }
    let mut script = String::new();
    if has_default && !row.try_get::<bool, _>("bound_valid")? {
        // Scans the default partition, but under SHARE UPDATE EXCLUSIVE: claims
        // and lookups go on. Usually done already by `retire_default`.
        script.push_str(&format!(
            "ALTER TABLE {table}_default VALIDATE CONSTRAINT {table}_default_bound; "
        ));
    }
    // Created empty, so attaching scans nothing; the default partition's valid
    // bound proves it holds nothing for this day, so it is not scanned either. The
    // parent's lock conflicts with no lookup; a default partition's (ACCESS
    // EXCLUSIVE) does, hence the tries.
    script.push_str(&format!(
        "CREATE TABLE {name} (LIKE {table} INCLUDING DEFAULTS INCLUDING CONSTRAINTS); \
         ALTER TABLE {table} ATTACH PARTITION {name} \
             FOR VALUES FROM ('{first} 00:00:00+00') TO ('{next} 00:00:00+00')"
    ));
    sqlx::raw_sql(AssertSqlSafe(script))
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok((name, Day::Created))
}

/// Day partitions whose day (UTC) has ended, and day tables beside the key table
/// that a detach left behind (detached, then not dropped: the drop gave way).
async fn ended_days(conn: &mut PgConnection, table: &str) -> Result<Vec<String>, sqlx::Error> {
    let mut tx = read_committed(conn).await?;
    let names = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT c.relname::text FROM pg_class c \
         WHERE c.relnamespace = (SELECT relnamespace FROM pg_class WHERE oid = '{table}'::regclass) \
           AND c.relkind = 'r' AND c.relname ~ '^{table}_p[0-9]{{8}}$' \
           AND to_date(right(c.relname, 8), 'YYYYMMDD') + 1 <= (now() AT TIME ZONE 'UTC')::date \
         ORDER BY 1"
    )))
    .persistent(false)
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(names)
}

/// Where partition `name` stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Attached {
    /// Attached.
    Yes,
    /// A `DETACH … CONCURRENTLY` began and did not finish (it was cancelled, or is
    /// still waiting in another session).
    Pending,
    /// Not a partition of the table (any more).
    No,
}

async fn attached(
    conn: &mut PgConnection,
    table: &str,
    name: &str,
) -> Result<Attached, sqlx::Error> {
    // Detaching concurrently, and the catalog column for it, came with 14.
    let pending = match conn.server_version_num().is_some_and(|v| v >= 140_000) {
        true => "i.inhdetachpending",
        false => "false",
    };
    let pending: Option<bool> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT {pending} FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = '{table}'::regclass AND c.relname = '{name}'"
    )))
    .persistent(false)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(match pending {
        Some(false) => Attached::Yes,
        Some(true) => Attached::Pending,
        None => Attached::No,
    })
}

/// Detaches and drops one ended day, if it is still attached.
async fn drop_day(conn: &mut PgConnection, table: &str, name: &str) -> Result<bool, sqlx::Error> {
    // Read inside a transaction, as every statement here: through a transaction
    // pooler an unprepared statement outside one may be bound on another server.
    let (concurrently, state) = {
        let recent = conn.server_version_num().is_some_and(|v| v >= 140_000);
        let mut tx = read_committed(conn).await?;
        let concurrently = recent && !has_default(&mut tx, table).await?;
        let state = attached(&mut tx, table, name).await?;
        tx.commit().await?;
        (concurrently, state)
    };
    // `CONCURRENTLY` runs outside any transaction block. Its locks conflict with no
    // lookup; it waits for the transactions that may still read the day, which
    // queues nobody. A second maintenance detaching the same day at once fails
    // here, and the day is the first one's.
    let detach = match (state, concurrently) {
        // A day table an earlier detach left behind.
        (Attached::No, _) => return tried!(Budget::Maintenance, drop_detached(conn, table, name)),
        // Cancelled before it finished (or still running elsewhere): complete it.
        (Attached::Pending, _) => format!("ALTER TABLE {table} DETACH PARTITION {name} FINALIZE"),
        (Attached::Yes, true) => {
            format!("ALTER TABLE {table} DETACH PARTITION {name} CONCURRENTLY")
        }
        // A default partition (or PostgreSQL before 14) forbids `CONCURRENTLY`: one
        // plain detach, tried gently.
        (Attached::Yes, false) => {
            return tried!(Budget::Maintenance, detach_plainly(conn, table, name));
        }
    };
    if let Err(error) = sqlx::raw_sql(AssertSqlSafe(detach))
        .execute(&mut *conn)
        .await
    {
        let mut tx = read_committed(conn).await?;
        let now = attached(&mut tx, table, name).await?;
        tx.commit().await?;
        return match now {
            Attached::No => Ok(false),
            _ => Err(error),
        };
    }
    // Nobody reads a detached day; the lock is asked for gently all the same.
    tried!(Budget::Maintenance, drop_detached(conn, table, name))
}

async fn detach_plainly(
    conn: &mut PgConnection,
    table: &str,
    name: &str,
) -> Result<bool, sqlx::Error> {
    let mut tx = begin(conn, table).await?;
    if attached(&mut tx, table, name).await? != Attached::Yes {
        return Ok(false);
    }
    detach_and_drop(tx, table, name).await?;
    Ok(true)
}

async fn drop_detached(
    conn: &mut PgConnection,
    table: &str,
    name: &str,
) -> Result<bool, sqlx::Error> {
    let mut tx = begin(conn, table).await?;
    if attached(&mut tx, table, name).await? != Attached::No {
        return Ok(false);
    }
    let exists: bool = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT to_regclass('{name}') IS NOT NULL"
    )))
    .persistent(false)
    .fetch_one(&mut *tx)
    .await?;
    if !exists {
        return Ok(false);
    }
    sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {name}")))
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(true)
}

async fn has_default(conn: &mut PgConnection, table: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT to_regclass('{table}_default') IS NOT NULL"
    )))
    .persistent(false)
    .fetch_one(&mut *conn)
    .await
}

/// Detaches and drops partition `name` (taking ACCESS EXCLUSIVE on the table, for
/// at most one try's wait), and commits.
async fn detach_and_drop(
    mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
    table: &str,
    name: &str,
) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "ALTER TABLE {table} DETACH PARTITION {name}; DROP TABLE {name}"
    )))
    .execute(&mut *tx)
    .await?;
    tx.commit().await
}

/// Bounds the default partition if upgrade 3 did not (a table migrated by hand),
/// validates the bound, and drops the partition once it is empty: its name then.
async fn retire_default(
    conn: &mut PgConnection,
    table: &str,
) -> Result<Option<String>, sqlx::Error> {
    let name = format!("{table}_default");
    let (present, valid) = {
        let mut tx = read_committed(conn).await?;
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT to_regclass('{name}') IS NOT NULL AS present, \
                    (SELECT k.convalidated FROM pg_constraint k \
                     WHERE k.conrelid = to_regclass('{name}') \
                       AND k.conname = '{table}_default_bound') AS valid"
        )))
        .persistent(false)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        (
            row.try_get::<bool, _>("present")?,
            row.try_get::<Option<bool>, _>("valid")?,
        )
    };
    if !present {
        return Ok(None);
    }
    if valid.is_none() {
        // A table migrated by hand, without upgrade 3: what it would have done
        // (`ADD CONSTRAINT … NOT VALID` takes a lock lookups wait for: tried gently).
        let bound = UPGRADE_3.sql.replace(DEFAULT_TABLE, table);
        tried!(Budget::Maintenance, run_script(conn, table, &bound))?;
    }
    if valid != Some(true) {
        // A scan, under SHARE UPDATE EXCLUSIVE: claims and lookups go on.
        let validate = format!("ALTER TABLE {name} VALIDATE CONSTRAINT {table}_default_bound");
        tried!(Budget::Maintenance, run_script(conn, table, &validate))?;
    }
    // Empty: no key of it is left to replay. A first look blocks nothing; the
    // second, under the lock that detaching takes anyway, makes sure no claim in
    // flight has put a row there meanwhile. It reads a table with no live row.
    // Every lookup reads this partition, so the lock is asked for gently.
    tried!(Budget::Maintenance, drop_if_empty(conn, table, &name))
}

/// Runs `script` in a maintenance transaction and commits.
async fn run_script(conn: &mut PgConnection, table: &str, script: &str) -> Result<(), sqlx::Error> {
    let mut tx = begin(conn, table).await?;
    sqlx::raw_sql(AssertSqlSafe(script.to_owned()))
        .execute(&mut *tx)
        .await?;
    tx.commit().await
}

async fn drop_if_empty(
    conn: &mut PgConnection,
    table: &str,
    name: &str,
) -> Result<Option<String>, sqlx::Error> {
    let mut tx = begin(conn, table).await?;
    let empty = format!("SELECT NOT EXISTS (SELECT 1 FROM {name})");
    let looks_empty: bool = sqlx::query_scalar(AssertSqlSafe(empty.clone()))
        .persistent(false)
        .fetch_one(&mut *tx)
        .await?;
    if !looks_empty {
        return Ok(None);
    }
    sqlx::raw_sql(AssertSqlSafe(format!(
        "LOCK TABLE {name} IN ACCESS EXCLUSIVE MODE"
    )))
    .execute(&mut *tx)
    .await?;
    let empty: bool = sqlx::query_scalar(AssertSqlSafe(empty))
        .persistent(false)
        .fetch_one(&mut *tx)
        .await?;
    if !empty {
        return Ok(None);
    }
    detach_and_drop(tx, table, name).await?;
    Ok(Some(name.to_owned()))
}

/// Bounds the default partition of a table the first release created.
pub(crate) const UPGRADE_3: Migration = Migration {
    version: 3,
    sql: include_str!("../migrations/postgres/partitioned/0003_bounded_default.sql"),
    applied: Applied::Rerun,
};
