//! What a first execution costs PostgreSQL's CPU, against the hand-written floor.
//!
//! ```text
//! cargo bench --features postgres --bench cpu                      # 25 rounds of 500 requests
//! cargo bench --features postgres --bench cpu -- --rounds 40 --requests 1000
//! cargo bench --features postgres --bench cpu -- --only floor,idem-first
//! ```
//!
//! Throughput on this kind of machine swings by a tenth from one run to the next;
//! CPU time per request swings less, and says where a gap is. So each variant runs
//! on a pool of one connection, requests one after another (`synchronous_commit`
//! off: nothing waits for the disk), and the server process behind that connection
//! is measured by its own CPU time (`/proc/<pid>/schedstat`), as is this process.
//! Rounds alternate the variants; the medians and quartiles of the rounds are
//! reported. The backend is pinned to CPU 1 and this process should be pinned to
//! CPU 0 (`taskset -c 0`), so that neither moves.
//!
//! - `bare`: the business write in a transaction;
//! - `floor`: the hand-written floor of the HTTP bench (`hand-written`): in the
//!   round trip of `BEGIN` the timeouts, the key's advisory try-lock and a
//!   savepoint; a statement that reads the key and claims it; the write; the
//!   record;
//! - `floor-guarded`: the same with the two guarantees idem gives past the claim
//!   (the HTTP bench's `hand-written-guarded`): the key's session lock, taken in
//!   `BEGIN`'s round trip and let go in the record's, and the session state saved
//!   there and checked by the record;
//! - `idem-first`: `Idempotency::execute`, a new key per request, through the
//!   table's functions (upgrade 4), its schema open to every role;
//! - `idem-statements`: the same, on a schema closed to other roles, so the store
//!   sends the statements the functions stand for.
//!
//! PostgreSQL comes from `IDEM_TEST_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`; skipped if unreachable), on
//! Linux. Run with no `--bench` argument (as `cargo test --bench cpu` does) it
//! takes a short setting, to check that it runs.

#![allow(missing_docs)]

use std::collections::BTreeMap;
use std::time::Duration;

use idem_axum::Outcome;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};

mod common;
use common::{INSERT, execute_insert, pg_floor, prepare};

const VARIANTS: [&str; 5] = [
    "bare",
    "floor",
    "floor-guarded",
    "idem-first",
    "idem-statements",
];

/// CPU time a process has run, in nanoseconds; `None` off Linux.
fn cpu_ns(pid: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/schedstat"))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

async fn bare(pool: &PgPool) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query(INSERT).execute(&mut *tx).await?;
    tx.commit().await
}

/// The HTTP bench's PostgreSQL floor, on the engine bench's tables; `guarded`,
/// with idem's session lock and saves (`hand-written-guarded`).
async fn floor(pool: &PgPool, key: &str, guarded: bool) -> Result<(), sqlx::Error> {
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
        .bind(br#"{"ok":true}"#.as_slice());
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

fn main() {
    let (mut rounds, mut requests) = (3usize, 50u64);
    let mut only: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().and_then(|v| v.parse().ok());
        match arg.as_str() {
            "--bench" => (rounds, requests) = (25, 500),
            "--rounds" => rounds = value().unwrap_or(rounds as u64) as usize,
            "--requests" => requests = value().unwrap_or(requests),
            "--only" => only = args.next(),
            _ => {}
        }
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
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
        let mut seen: BTreeMap<&str, (Vec<f64>, Vec<f64>)> = BTreeMap::new();
        let mut n = 0u64;
        for _ in 0..rounds {
            let chosen = |variant: &str| {
                only.as_deref()
                    .is_none_or(|only| only.split(',').any(|name| name == variant))
            };
            for variant in VARIANTS.into_iter().filter(|v| chosen(v)) {
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
                let (Some(db0), Some(app0)) = (cpu_ns(&backend), cpu_ns(&me)) else {
                    eprintln!("no /proc/<pid>/schedstat here: skipped");
                    return;
                };
                for _ in 0..requests {
                    n += 1;
                    let key = format!("k-{n}");
                    match variant {
                        "bare" => bare(pool).await.expect("bare"),
                        "floor" => floor(pool, &key, false).await.expect("floor"),
                        "floor-guarded" => floor(pool, &key, true).await.expect("floor"),
                        "idem-first" => {
                            execute_insert(&store, &key, Duration::ZERO, Outcome::Executed).await;
                        }
                        _ => {
                            let expect = Outcome::Executed;
                            execute_insert(&closed_store, &key, Duration::ZERO, expect).await;
                        }
                    }
                }
                let (db1, app1) = (cpu_ns(&backend), cpu_ns(&me));
                let per = |from: u64, to: Option<u64>| {
                    to.unwrap_or(from).saturating_sub(from) as f64 / 1e3 / requests as f64
                };
                let entry = seen.entry(variant).or_default();
                entry.0.push(per(db0, db1));
                entry.1.push(per(app0, app1));
            }
        }
        println!("\n{rounds} rounds of {requests} requests per variant, one connection\n");
        println!(
            "| variant | database CPU µs/req (q1–q3) | this process µs/req | database × floor |"
        );
        println!("| --- | ---: | ---: | ---: |");
        let floor_db = seen
            .get("floor")
            .map_or(f64::NAN, |s| quartiles(s.0.clone()).1);
        for variant in VARIANTS {
            let Some((db, app)) = seen.get(variant) else {
                continue;
            };
            let (q1, median, q3) = quartiles(db.clone());
            let app = quartiles(app.clone()).1;
            println!(
                "| {variant} | {median:.0} ({q1:.0}–{q3:.0}) | {app:.0} | {:.2} |",
                median / floor_db
            );
        }
        for pool in &pools {
            pool.close().await;
        }
        for name in [&open, &closed] {
            let _ = sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {name} CASCADE")))
                .execute(&admin)
                .await;
        }
    });
}
