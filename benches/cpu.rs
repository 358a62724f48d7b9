//! What a first execution costs the database's CPU, against the hand-written floor.
//!
//! ```text
//! cargo bench --all-features --bench cpu                  # 25 rounds of 500 requests, every backend
//! cargo bench --all-features --bench cpu -- --backends mysql --rounds 40 --requests 1000
//! cargo bench --all-features --bench cpu -- --only floor,idem-first
//! ```
//!
//! Throughput on this kind of machine swings by a tenth from one run to the next;
//! CPU time per request swings less, and says where a gap is. So each variant runs
//! on a pool of one connection, requests one after another, and the server behind
//! that connection is measured by its own CPU time (`/proc/<pid>/schedstat`), as is
//! this process. Rounds alternate the variants; the medians and quartiles of the
//! rounds are reported.
//!
//! - PostgreSQL (`synchronous_commit` off: nothing waits for the disk): the
//!   connection's backend process, pinned to CPU 1; this process should be pinned
//!   to CPU 0 (`taskset -c 0`), so that neither moves.
//! - MySQL/MariaDB: every thread of the server process (the connection's, and
//!   the background work it leaves, such as purging old row versions), unpinned;
//!   the server's own durability settings apply.
//! - SQLite (a WAL file, sqlx's `synchronous = FULL`; `NORMAL` made the rounds'
//!   CPU swing by half here): the database runs in this process, whose CPU time
//!   is the database's.
//!
//! Variants:
//! - `bare`: the business write in a transaction;
//! - `floor`: the hand-written floor of the HTTP bench (`hand-written`;
//!   `common/pg_floor.rs`, `common/my_floor.rs`, `common/lite_floor.rs`);
//! - `floor-guarded`: the same with the guarantees idem gives
//!   past the claim (the HTTP bench's `hand-written-guarded`). PostgreSQL: the
//!   key's session lock, taken in `BEGIN`'s round trip and let go in the
//!   record's, and the session state saved there and checked by the record.
//!   MySQL: the claim's row written in the transaction before the handler runs,
//!   later transactions read-only, `autocommit` off, MariaDB's timeouts set to
//!   the lock (`common/my_floor.rs`). SQLite: the claim committed before the
//!   handler's transaction, and a refused `BEGIN` before the record
//!   (`common/lite_floor.rs`);
//! - `idem-first`: `Idempotency::execute`, a new key per request (on PostgreSQL
//!   through the table's functions, upgrade 4, its schema open to every role);
//! - `idem-statements` (PostgreSQL): the same, on a schema closed to other roles,
//!   so the store sends the statements the functions stand for.
//!
//! PostgreSQL comes from `IDEM_TEST_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`), MySQL from
//! `IDEM_TEST_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`); each is
//! skipped if unreachable, and everything off Linux. Run with no `--bench` argument
//! (as `cargo test --benches` does) it takes a short setting, to check that it runs.

#![allow(missing_docs)]

use std::collections::BTreeMap;
use std::time::Duration;

use idem_axum::Outcome;
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{AssertSqlSafe, MySqlPool, PgPool, SqlitePool};

mod common;
use common::{INSERT, execute_insert, lite_floor, my_floor, pg_floor, prepare};

/// Every variant, in the order rounds run them; a backend runs those it has.
const VARIANTS: [&str; 5] = [
    "bare",
    "floor",
    "floor-guarded",
    "idem-first",
    "idem-statements",
];

/// The response body every floor records.
const ANSWER: &[u8] = br#"{"ok":true}"#;

/// CPU time a process has run, in nanoseconds; with `threads`, summed over its
/// threads (the main thread's alone otherwise); `None` off Linux.
fn cpu_ns(pid: &str, threads: bool) -> Option<u64> {
    let read = |path: String| -> Option<u64> {
        std::fs::read_to_string(path)
            .ok()?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    if !threads {
        return read(format!("/proc/{pid}/schedstat"));
    }
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    Some(
        tasks
            .flatten()
            .filter_map(|task| read(format!("{}/schedstat", task.path().display())))
            .sum(),
    )
}

/// Each variant's rounds: the database's and this process's CPU µs per request.
#[derive(Default)]
struct Seen(BTreeMap<&'static str, (Vec<f64>, Vec<f64>)>);

impl Seen {
    fn add(&mut self, variant: &'static str, requests: u64, db: (u64, u64), app: (u64, u64)) {
        let per = |(from, to): (u64, u64)| to.saturating_sub(from) as f64 / 1e3 / requests as f64;
        let entry = self.0.entry(variant).or_default();
        entry.0.push(per(db));
        entry.1.push(per(app));
    }

    fn print(&self, backend: &str, rounds: usize, requests: u64) {
        println!(
            "\n{backend}: {rounds} rounds of {requests} requests per variant, one connection\n"
        );
        println!(
            "| variant | database CPU µs/req (q1–q3) | this process µs/req | database × floor |"
        );
        println!("| --- | ---: | ---: | ---: |");
        let floor = self
            .0
            .get("floor")
            .map_or(f64::NAN, |s| quartiles(s.0.clone()).1);
        for variant in VARIANTS {
            let Some((db, app)) = self.0.get(variant) else {
                continue;
            };
            let (q1, median, q3) = quartiles(db.clone());
            let app = quartiles(app.clone()).1;
            println!(
                "| {variant} | {median:.0} ({q1:.0}–{q3:.0}) | {app:.0} | {:.2} |",
                median / floor
            );
        }
    }
}

/// What the command line asks for.
struct Run {
    rounds: usize,
    requests: u64,
    only: Option<String>,
}

impl Run {
    /// `backend`'s variants in the order rounds run them, as `--only` leaves them.
    fn variants(&self, backend: &[&'static str]) -> Vec<&'static str> {
        VARIANTS
            .into_iter()
            .filter(|variant| backend.contains(variant))
            .filter(|variant| {
                self.only
                    .as_deref()
                    .is_none_or(|only| only.split(',').any(|name| name == *variant))
            })
            .collect()
    }
}

fn quartiles(mut values: Vec<f64>) -> (f64, f64, f64) {
    values.sort_by(f64::total_cmp);
    let at = |q: usize| {
        values
            .get(values.len() * q / 4)
            .copied()
            .unwrap_or(f64::NAN)
    };
    (at(1), at(2), at(3))
}

async fn pg_bare(pool: &PgPool) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query(INSERT).execute(&mut *tx).await?;
    tx.commit().await
}

/// The HTTP bench's PostgreSQL floor, on the engine bench's tables; `guarded`,
/// with idem's session lock and saves (`hand-written-guarded`).
async fn pg_floor(pool: &PgPool, key: &str, guarded: bool) -> Result<(), sqlx::Error> {
    let seed = pg_floor::seed(key);
    let mut tx = pool
        .begin_with(AssertSqlSafe(pg_floor::begin(seed, guarded)))
        .await?;
    let claimed: Option<i64> = sqlx::query_scalar(
        "WITH found AS MATERIALIZED ( \
             SELECT state, body FROM idempotency_keys WHERE scope = '' AND idempotency_key = $1), \
         claimed AS ( \
             INSERT INTO idempotency_keys (scope, idempotency_key, state, lease, method, path, \
                 fingerprint, locked_until, expires_at, created_at) \
             SELECT '', $1, 'processing', 1, 'POST', '/effects', '\\x00', \
                 clock_timestamp() + interval '30 seconds', clock_timestamp() + interval '1 day', \
                 clock_timestamp() \
             WHERE NOT EXISTS (SELECT 1 FROM found) \
               AND current_setting('idem.locked', true) = 'true' \
             RETURNING lease) \
         SELECT (SELECT lease FROM claimed) FROM (SELECT 1) AS one LEFT JOIN found ON true",
    )
    .bind(key)
    .fetch_one(&mut *tx)
    .await?;
    assert!(claimed.is_some(), "the floor claimed {key}");
    sqlx::query(INSERT).execute(&mut *tx).await?;
    let mut record = sqlx::query(AssertSqlSafe(pg_floor::record(guarded)))
        .bind(key)
        .bind(ANSWER);
    if guarded {
        let (high, low) = pg_floor::halves(seed);
        record = record.bind(high).bind(low);
    }
    let done = record.execute(&mut *tx).await?;
    assert_eq!(done.rows_affected(), 1, "the floor recorded {key}");
    tx.commit().await
}

/// Creates schema `name`, open to every role or not.
async fn create_schema(admin: &PgPool, name: &str, open: bool) -> Result<(), sqlx::Error> {
    let grant = if open {
        format!("; GRANT USAGE ON SCHEMA {name} TO PUBLIC")
    } else {
        String::new()
    };
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE SCHEMA {name}{grant}")))
        .execute(admin)
        .await
        .map(drop)
}

/// A pool of one connection, kept, whose `search_path` is `schema`.
async fn pool_in(options: &PgConnectOptions, schema: &str) -> Result<PgPool, sqlx::Error> {
    PgPoolOptions::new()
        .max_connections(1)
        .min_connections(1)
        .idle_timeout(None)
        .max_lifetime(None)
        .connect_with(
            options
                .clone()
                .options([("search_path", schema), ("synchronous_commit", "off")]),
        )
        .await
}

/// MySQL's floor (`common/my_floor.rs`), on the engine bench's tables;
/// `guarded`, with idem's guarantees past the claim (`hand-written-guarded`).
async fn my_floor(pool: &MySqlPool, key: &str, guarded: bool) -> Result<(), sqlx::Error> {
    let mut conn = pool.acquire().await?;
    let begin = if guarded {
        my_floor::begin_guarded(key)
    } else {
        my_floor::begin(key, true)
    };
    let mut tx = sqlx::Connection::begin_with(&mut *conn, AssertSqlSafe(begin)).await?;
    sqlx::query(INSERT).execute(&mut *tx).await?;
    let record = if guarded {
        sqlx::query(my_floor::RECORD_GUARDED).bind(ANSWER).bind(key)
    } else {
        sqlx::query(my_floor::RECORD_LOCKED).bind(key).bind(ANSWER)
    };
    let done = record.execute(&mut *tx).await?;
    assert_eq!(done.rows_affected(), 1, "the floor recorded {key}");
    let commit = if guarded {
        format!("COMMIT; {}", my_floor::restore_guarded())
    } else {
        format!("COMMIT; {}", my_floor::FINISH)
    };
    sqlx::raw_sql(AssertSqlSafe(commit))
        .execute(&mut *tx)
        .await?;
    // The server committed; sqlx's guard sends a ROLLBACK that does nothing.
    drop(tx);
    Ok(())
}

/// SQLite's floor (`common/lite_floor.rs`), on the engine bench's tables;
/// `guarded`, the claim committed before the transaction and the check that it is
/// still open before the record (`hand-written-guarded`).
async fn lite_floor(pool: &SqlitePool, key: &str, guarded: bool) -> Result<(), sqlx::Error> {
    let mut conn = pool.acquire().await?;
    let found: Option<(String, Option<Vec<u8>>)> = sqlx::query_as(lite_floor::LOOKUP)
        .bind(key)
        .fetch_optional(&mut *conn)
        .await?;
    assert!(found.is_none(), "{key} is new");
    let claim = || {
        sqlx::query_scalar::<_, i64>(lite_floor::CLAIM)
            .bind(key)
            .bind(lite_floor::now_ms())
    };
    let claimed = if guarded {
        claim().fetch_optional(&mut *conn).await?
    } else {
        None
    };
    let mut tx = sqlx::Connection::begin_with(&mut *conn, "BEGIN IMMEDIATE").await?;
    let claimed = match claimed {
        Some(lease) => Some(lease),
        None => claim().fetch_optional(&mut *tx).await?,
    };
    assert!(claimed.is_some(), "the floor claimed {key}");
    sqlx::query(INSERT).execute(&mut *tx).await?;
    if guarded {
        let refused = sqlx::raw_sql("BEGIN").execute(&mut *tx).await;
        assert!(
            refused.as_ref().is_err_and(lite_floor::in_transaction),
            "the transaction is open: {refused:?}"
        );
    }
    sqlx::query(lite_floor::RECORD)
        .bind(key)
        .bind(ANSWER)
        .execute(&mut *tx)
        .await?;
    tx.commit().await
}

/// `run`'s rounds of `variants`, one `request(variant, key)` after another, a new
/// key each; the database's CPU is process `db`'s, every thread of it, this
/// process's its main thread's. `None` without `/proc/<pid>/task`.
async fn rounds<F, Fut>(
    run: &Run,
    variants: &[&'static str],
    db: &str,
    mut request: F,
) -> Option<Seen>
where
    F: FnMut(&'static str, String) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let me = std::process::id().to_string();
    let mut seen = Seen::default();
    let mut n = 0u64;
    for _ in 0..run.rounds {
        for &variant in variants {
            let (Some(db0), Some(app0)) = (cpu_ns(db, true), cpu_ns(&me, false)) else {
                eprintln!("no /proc/<pid>/schedstat here: skipped");
                return None;
            };
            for _ in 0..run.requests {
                n += 1;
                request(variant, format!("k-{n}")).await;
            }
            let db1 = cpu_ns(db, true).unwrap_or(db0);
            let app1 = cpu_ns(&me, false).unwrap_or(app0);
            seen.add(variant, run.requests, (db0, db1), (app0, app1));
        }
    }
    Some(seen)
}

async fn postgres(run: &Run) {
    let url = std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let options: PgConnectOptions = url.parse().expect("postgres url");
    let Ok(admin) = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options.clone())
        .await
    else {
        eprintln!("PostgreSQL not reachable at {url}: skipped");
        return;
    };
    let id = std::process::id();
    let (open, closed) = (format!("idem_cpu_{id}"), format!("idem_cpu_{id}_closed"));
    create_schema(&admin, &open, true).await.expect("schema");
    create_schema(&admin, &closed, false).await.expect("schema");
    let pools = [
        pool_in(&options, &open).await.expect("pool"),
        pool_in(&options, &closed).await.expect("pool"),
        // The floor and `bare` on the open schema's tables, on a connection of
        // their own.
        pool_in(&options, &open).await.expect("pool"),
    ];
    let store = prepare(&pools[0], "BIGSERIAL PRIMARY KEY").await;
    let closed_store = prepare(&pools[1], "BIGSERIAL PRIMARY KEY").await;
    let me = id.to_string();
    let mut seen = Seen::default();
    let mut n = 0u64;
    let variants = run.variants(&VARIANTS);
    for _ in 0..run.rounds {
        for &variant in &variants {
            let pool = match variant {
                "idem-first" => &pools[0],
                "idem-statements" => &pools[1],
                _ => &pools[2],
            };
            let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(pool)
                .await
                .expect("pid");
            let backend = backend.to_string();
            let _ = std::process::Command::new("taskset")
                .args(["-pc", "1", &backend])
                .output();
            let (Some(db0), Some(app0)) = (cpu_ns(&backend, false), cpu_ns(&me, false)) else {
                eprintln!("no /proc/<pid>/schedstat here: skipped");
                return;
            };
            for _ in 0..run.requests {
                n += 1;
                let key = format!("k-{n}");
                match variant {
                    "bare" => pg_bare(pool).await.expect("bare"),
                    "floor" => pg_floor(pool, &key, false).await.expect("floor"),
                    "floor-guarded" => pg_floor(pool, &key, true).await.expect("floor"),
                    "idem-first" => {
                        execute_insert(&store, &key, Duration::ZERO, Outcome::Executed).await;
                    }
                    _ => {
                        let expect = Outcome::Executed;
                        execute_insert(&closed_store, &key, Duration::ZERO, expect).await;
                    }
                }
            }
            let db1 = cpu_ns(&backend, false).unwrap_or(db0);
            let app1 = cpu_ns(&me, false).unwrap_or(app0);
            seen.add(variant, run.requests, (db0, db1), (app0, app1));
        }
    }
    seen.print("PostgreSQL", run.rounds, run.requests);
    for pool in &pools {
        pool.close().await;
    }
    for name in [&open, &closed] {
        let _ = sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {name} CASCADE")))
            .execute(&admin)
            .await;
    }
}

/// The MySQL or MariaDB server's process id, as the server reports its pid file.
async fn mysql_pid(admin: &MySqlPool) -> Option<String> {
    let file: String = sqlx::query_scalar("SELECT @@pid_file")
        .fetch_one(admin)
        .await
        .ok()?;
    Some(std::fs::read_to_string(file).ok()?.trim().to_owned())
}

async fn mysql(run: &Run) {
    let url = std::env::var("IDEM_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    let options: MySqlConnectOptions = url.parse().expect("mysql url");
    let Ok(admin) = MySqlPoolOptions::new()
        .max_connections(1)
        .connect_with(options.clone())
        .await
    else {
        eprintln!("MySQL not reachable at {url}: skipped");
        return;
    };
    let Some(server) = mysql_pid(&admin).await else {
        eprintln!("the MySQL server's pid file is not readable here: skipped");
        return;
    };
    let database = format!("idem_cpu_{}", std::process::id());
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {database}")))
        .execute(&admin)
        .await
        .expect("database");
    let pool = || {
        MySqlPoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_with(options.clone().database(&database))
    };
    // The floor and `bare` on the store's tables, on a connection of their own.
    let (idem, floor) = (pool().await.expect("pool"), pool().await.expect("pool"));
    let store = prepare(&idem, "BIGINT AUTO_INCREMENT PRIMARY KEY").await;
    let variants = run.variants(&["bare", "floor", "floor-guarded", "idem-first"]);
    let (floor, store) = (&floor, &store);
    let seen = rounds(run, &variants, &server, |variant, key| async move {
        match variant {
            "bare" => {
                let mut tx = floor.begin().await.expect("bare");
                sqlx::query(INSERT).execute(&mut *tx).await.expect("bare");
                tx.commit().await.expect("bare");
            }
            "floor" => my_floor(floor, &key, false).await.expect("floor"),
            "floor-guarded" => my_floor(floor, &key, true).await.expect("floor"),
            _ => execute_insert(store, &key, Duration::ZERO, Outcome::Executed).await,
        }
    })
    .await;
    let Some(seen) = seen else {
        return;
    };
    seen.print(
        "MySQL/MariaDB (every server thread)",
        run.rounds,
        run.requests,
    );
    idem.close().await;
    floor.close().await;
    let _ = sqlx::raw_sql(AssertSqlSafe(format!("DROP DATABASE {database}")))
        .execute(&admin)
        .await;
}

async fn sqlite(run: &Run) {
    let path = std::env::temp_dir().join(format!("idem-cpu-{}.db", std::process::id()));
    common::remove_sqlite(&path);
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(
            SqliteConnectOptions::new()
                .filename(&path)
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .busy_timeout(Duration::from_secs(30)),
        )
        .await
        .expect("sqlite");
    let store = prepare(&pool, "INTEGER PRIMARY KEY").await;
    let variants = run.variants(&["bare", "floor", "floor-guarded", "idem-first"]);
    let (pool, store) = (&pool, &store);
    // The database is this process: every thread of it (sqlx runs SQLite on a
    // worker thread of its own).
    let me = std::process::id().to_string();
    let seen = rounds(run, &variants, &me, |variant, key| async move {
        match variant {
            "bare" => {
                let mut tx = pool.begin().await.expect("bare");
                sqlx::query(INSERT).execute(&mut *tx).await.expect("bare");
                tx.commit().await.expect("bare");
            }
            "floor" => lite_floor(pool, &key, false).await.expect("floor"),
            "floor-guarded" => lite_floor(pool, &key, true).await.expect("floor"),
            _ => execute_insert(store, &key, Duration::ZERO, Outcome::Executed).await,
        }
    })
    .await;
    let Some(seen) = seen else {
        return;
    };
    seen.print(
        "SQLite (this process, every thread)",
        run.rounds,
        run.requests,
    );
    pool.close().await;
    common::remove_sqlite(&path);
}

fn main() {
    let (mut rounds, mut requests) = (None, None);
    let (mut only, mut long) = (None, false);
    let mut backends = "postgres,mysql,sqlite".to_owned();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            // Passed by `cargo bench` after the arguments given to it.
            "--bench" => long = true,
            "--rounds" => rounds = args.next().and_then(|v| v.parse().ok()),
            "--requests" => requests = args.next().and_then(|v| v.parse().ok()),
            "--only" => only = args.next(),
            "--backends" => backends = args.next().unwrap_or(backends),
            _ => {}
        }
    }
    let run = Run {
        rounds: rounds.unwrap_or(if long { 25 } else { 3 }),
        requests: requests.unwrap_or(if long { 500 } else { 50 }),
        only,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        for backend in backends.split(',') {
            match backend {
                "postgres" => postgres(&run).await,
                "mysql" => mysql(&run).await,
                "sqlite" => sqlite(&run).await,
                other => eprintln!("unknown backend {other}: skipped"),
            }
        }
    });
}
