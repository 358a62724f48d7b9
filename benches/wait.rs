//! How soon a duplicate that `wait`s gets its answer once the first request is done.
//!
//! ```text
//! cargo bench --all-features --bench wait           # 10 rounds per backend
//! cargo bench --all-features --bench wait -- 50     # 50 rounds
//! ```
//!
//! Each round: a first request whose handler takes 100 ms, and 49 duplicates sent
//! 20 ms later with `wait = "5s"`. Reported: how long after the first answered each
//! duplicate answered (p50, p99, max), and that all 50 got the same 2xx.
//!
//! Then, without `wait`: 16 callers send duplicates of a request whose handler runs
//! for 3 s, for 2 s, and the rate and latency of their 409 answers (each one reads
//! what is left of the holder's lock for `Retry-After`) are reported.
//!
//! Servers are found as in the test suite (`IDEM_TEST_POSTGRES_URL`,
//! `IDEM_TEST_MYSQL_URL`); an unreachable one is skipped.

#![allow(missing_docs)]

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use idem_axum::{Backend, HandlerFuture, Idempotency, Options, Tx};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, MySql, Postgres, Sqlite};

use common::identity;

const DUPLICATES: usize = 49;

fn held<DB: Backend>(_tx: Tx<DB>) -> HandlerFuture<Full<Bytes>> {
    Box::pin(async {
        tokio::time::sleep(Duration::from_secs(3)).await;
        common::ok_response()
    })
}

/// 409 answers per second, and their p50/p99 latency, while one holder runs.
async fn conflicts<DB: Backend>(backend: &str, store: Idempotency<DB>) -> String {
    let holder = {
        let store = store.clone();
        tokio::spawn(async move {
            store
                .execute(identity("held"), Options::new(), held::<DB>)
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let until = Instant::now() + Duration::from_secs(2);
    let callers: Vec<_> = (0..16)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                while Instant::now() < until {
                    let started = Instant::now();
                    let response = store
                        .execute(identity("held"), Options::new(), held::<DB>)
                        .await;
                    assert_eq!(response.status(), 409, "a duplicate while held");
                    assert!(response.headers().contains_key("retry-after"));
                    latencies.push(started.elapsed());
                }
                latencies
            })
        })
        .collect();
    let mut all = Vec::new();
    for caller in callers {
        all.extend(caller.await.expect("caller"));
    }
    let held = holder.await.expect("holder");
    assert_eq!(held.status(), 201);
    all.sort();
    let pick = |q: f64| all[((all.len() as f64 * q) as usize).min(all.len() - 1)];
    format!(
        "| {backend} | {:.0} | {:.2} | {:.2} |",
        all.len() as f64 / 2.0,
        pick(0.5).as_secs_f64() * 1e3,
        pick(0.99).as_secs_f64() * 1e3,
    )
}

fn slow<DB: Backend>(_tx: Tx<DB>) -> HandlerFuture<Full<Bytes>> {
    Box::pin(async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        common::ok_response()
    })
}

async fn rounds<DB: Backend>(
    backend: &str,
    store: Idempotency<DB>,
    rounds: usize,
    in_flight: &mut Vec<String>,
) {
    let options = Options::new().wait(Duration::from_secs(5));
    let mut after = Vec::new();
    for round in 0..rounds {
        let key = format!("wait-{round}");
        let first = {
            let (store, request) = (store.clone(), identity(&key));
            tokio::spawn(async move {
                let response = store.execute(request, options, slow::<DB>).await;
                (response, Instant::now())
            })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        let duplicates: Vec<_> = (0..DUPLICATES)
            .map(|_| {
                let (store, request) = (store.clone(), identity(&key));
                tokio::spawn(async move {
                    let response = store.execute(request, options, slow::<DB>).await;
                    (response, Instant::now())
                })
            })
            .collect();
        let (first, done) = first.await.expect("first");
        assert_eq!(first.status(), 201, "{backend}: the first");
        for duplicate in duplicates {
            let (response, at) = duplicate.await.expect("duplicate");
            assert_eq!(response.status(), 201, "{backend}: a duplicate");
            assert_eq!(response.body(), first.body(), "{backend}: the same answer");
            after.push(at.saturating_duration_since(done));
        }
    }
    after.sort();
    let pick = |q: f64| after[((after.len() as f64 * q) as usize).min(after.len() - 1)];
    println!(
        "| {backend} | {} | {:.2} | {:.2} | {:.2} |",
        after.len(),
        pick(0.5).as_secs_f64() * 1e3,
        pick(0.99).as_secs_f64() * 1e3,
        pick(1.0).as_secs_f64() * 1e3,
    );
    in_flight.push(conflicts(backend, store).await);
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let count = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(10);
    println!("\n{count} rounds of 1 first request (100 ms) + {DUPLICATES} waiting duplicates\n");
    println!("| backend | duplicates | p50 ms after the first | p99 ms | max ms |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    let mut in_flight = Vec::new();

    let url = std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let options: PgConnectOptions = url.parse().expect("postgres url");
    let schema = format!("idem_bench_wait_{}", std::process::id());
    match PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options.clone())
        .await
    {
        Ok(admin) => {
            sqlx::raw_sql(AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
                .execute(&admin)
                .await
                .expect("schema");
            let pool = PgPoolOptions::new()
                .max_connections(8)
                .connect_with(options.options([("search_path", schema.as_str())]))
                .await
                .expect("pool");
            let store = common::prepare::<Postgres>(&pool, "BIGSERIAL PRIMARY KEY").await;
            rounds("postgres", store, count, &mut in_flight).await;
            pool.close().await;
            let _ = sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
                .execute(&admin)
                .await;
        }
        Err(error) => eprintln!("PostgreSQL not reachable at {url} ({error}): skipped"),
    }

    let url = std::env::var("IDEM_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    let options: MySqlConnectOptions = url.parse().expect("mysql url");
    match MySqlPoolOptions::new()
        .max_connections(1)
        .connect_with(options.clone())
        .await
    {
        Ok(admin) => {
            sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {schema}")))
                .execute(&admin)
                .await
                .expect("database");
            let pool = MySqlPoolOptions::new()
                .max_connections(8)
                .connect_with(options.database(&schema))
                .await
                .expect("pool");
            let store = common::prepare::<MySql>(&pool, "BIGINT AUTO_INCREMENT PRIMARY KEY").await;
            rounds("mysql", store, count, &mut in_flight).await;
            pool.close().await;
            let _ = sqlx::raw_sql(AssertSqlSafe(format!("DROP DATABASE {schema}")))
                .execute(&admin)
                .await;
        }
        Err(error) => eprintln!("MySQL/MariaDB not reachable at {url} ({error}): skipped"),
    }

    let path = std::env::temp_dir().join(format!("{schema}.db"));
    let pool = common::sqlite_pool(&path).await;
    let store = common::prepare::<Sqlite>(&pool, "INTEGER PRIMARY KEY AUTOINCREMENT").await;
    rounds("sqlite", store, count, &mut in_flight).await;
    pool.close().await;
    common::remove_sqlite(&path);
    println!("\n16 callers sending duplicates of a held key, 2 s, no wait\n");
    println!("| backend | 409 answers/s | p50 ms | p99 ms |");
    println!("| --- | ---: | ---: | ---: |");
    for row in in_flight {
        println!("{row}");
    }
}
