//! What exactly-once costs at the engine level, without HTTP in the way.
//!
//! ```text
//! cargo bench --all-features --bench engine                # 5 s per variant, 32 workers
//! cargo bench --all-features --bench engine -- --secs 2 --workers 16
//! ```
//!
//! Every variant makes the same business write (one INSERT in a transaction):
//! - `bare`: the write alone, `pool.begin()` … `commit()`;
//! - `hand-written` (PostgreSQL): the design floor for a new key, written by hand:
//!   in one transaction, a statement that reads the key and claims it under an
//!   advisory try-lock, the write, the record;
//! - `idem-first`: `Idempotency::execute` with a new key per request;
//! - `idem-replay`: `Idempotency::execute` on keys already completed;
//! - `idem-first +Nms` (SQLite): the handler also waits N ms inside its
//!   transaction, as a handler calling a payment provider would: SQLite's single
//!   writer makes that wait serial.
//!
//! PostgreSQL comes from `IDEM_TEST_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`), MySQL/MariaDB from
//! `IDEM_TEST_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`); either is
//! skipped if unreachable.

use std::time::Duration;

use idem_axum::{Backend, Idempotency, Outcome};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Pool, Sqlite};

mod common;
use common::{INSERT, Settings, execute_insert, measure, prepare};

struct Row {
    backend: &'static str,
    variant: String,
    requests: u64,
    rate: f64,
    p50: Duration,
    p99: Duration,
}

/// `idem-first` and `idem-replay` for one backend.
async fn idem_variants<DB: Backend>(
    settings: &Settings,
    backend: &'static str,
    store: Idempotency<DB>,
    wait: Duration,
    rows: &mut Vec<Row>,
) where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'a> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
{
    // Every request must have done what its variant measures.
    let run = move |store: Idempotency<DB>, key: String, expect: Outcome| async move {
        execute_insert(&store, &key, wait, expect).await;
    };

    let suffix = if wait.is_zero() {
        String::new()
    } else {
        format!(" +{}ms", wait.as_millis())
    };
    // Keys of their own per variant: a key another variant completed would replay.
    let prefix = format!("first{}", suffix.trim());
    let first = {
        let (store, prefix) = (store.clone(), prefix.clone());
        measure(settings, move |_, n| {
            run(store.clone(), format!("{prefix}-{n}"), Outcome::Executed)
        })
        .await
    };
    rows.push(Row {
        backend,
        variant: format!("idem-first{suffix}"),
        requests: first.0,
        rate: first.1,
        p50: first.2,
        p99: first.3,
    });
    if !wait.is_zero() {
        return;
    }
    // Replays of the keys the first run completed.
    let completed = first.0.max(1);
    let replay = {
        let store = store.clone();
        measure(settings, move |_, n| {
            let key = format!("{prefix}-{}", n % completed);
            run(store.clone(), key, Outcome::Replayed)
        })
        .await
    };
    rows.push(Row {
        backend,
        variant: "idem-replay".into(),
        requests: replay.0,
        rate: replay.1,
        p50: replay.2,
        p99: replay.3,
    });
}

async fn bare<DB: Backend>(
    settings: &Settings,
    backend: &'static str,
    pool: Pool<DB>,
    rows: &mut Vec<Row>,
) where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'a> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
{
    let (requests, rate, p50, p99) = measure(settings, move |_, _| {
        let pool = pool.clone();
        async move {
            let mut tx = pool.begin().await.expect("begin");
            sqlx::query(INSERT).execute(&mut *tx).await.expect("insert");
            tx.commit().await.expect("commit");
        }
    })
    .await;
    rows.push(Row {
        backend,
        variant: "bare".into(),
        requests,
        rate,
        p50,
        p99,
    });
}

async fn postgres(settings: &Settings, rows: &mut Vec<Row>) {
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
    let schema = format!("idem_bench_{}", std::process::id());
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await
        .expect("schema");
    let pool = PgPoolOptions::new()
        .max_connections(settings.workers as u32)
        .connect_with(options.options([("search_path", schema.as_str())]))
        .await
        .expect("pool");
    let store = prepare(&pool, "BIGSERIAL PRIMARY KEY").await;

    bare(settings, "postgres", pool.clone(), rows).await;

    let hand = pool.clone();
    let (requests, rate, p50, p99) = measure(settings, move |_, n| {
        let pool = hand.clone();
        async move {
            let key = format!("hand-{n}");
            let mut tx = pool.begin().await.expect("begin");
            let claimed: Option<i64> = sqlx::query_scalar(
                "WITH found AS MATERIALIZED ( \
                     SELECT state FROM idempotency_keys \
                     WHERE scope = 'hand' AND idempotency_key = $1), \
                 claimed AS ( \
                     INSERT INTO idempotency_keys (scope, idempotency_key, state, lease, method, \
                         path, fingerprint, locked_until, expires_at, created_at) \
                     SELECT 'hand', $1, 'processing', 1, 'POST', '/effects', '\\x00', \
                         clock_timestamp() + interval '30 seconds', \
                         clock_timestamp() + interval '1 day', clock_timestamp() \
                     WHERE CASE WHEN EXISTS (SELECT 1 FROM found) THEN false \
                                ELSE pg_try_advisory_xact_lock(hashtext($1)) END \
                     RETURNING lease) \
                 SELECT lease FROM claimed",
            )
            .bind(&key)
            .fetch_optional(&mut *tx)
            .await
            .expect("claim");
            assert!(claimed.is_some());
            sqlx::query(INSERT).execute(&mut *tx).await.expect("insert");
            sqlx::query(
                "UPDATE idempotency_keys SET state = 'completed', status = 201, headers = '\\x00', \
                     body = '\\x00' WHERE scope = 'hand' AND idempotency_key = $1 AND lease = 1",
            )
            .bind(&key)
            .execute(&mut *tx)
            .await
            .expect("record");
            tx.commit().await.expect("commit");
        }
    })
    .await;
    rows.push(Row {
        backend: "postgres",
        variant: "hand-written".into(),
        requests,
        rate,
        p50,
        p99,
    });

    idem_variants(settings, "postgres", store, Duration::ZERO, rows).await;
    pool.close().await;
    let _ = sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&admin)
        .await;
}

async fn mysql(settings: &Settings, rows: &mut Vec<Row>) {
    let url = std::env::var("IDEM_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    let options: MySqlConnectOptions = url.parse().expect("mysql url");
    let Ok(admin) = MySqlPoolOptions::new()
        .max_connections(1)
        .connect_with(options.clone())
        .await
    else {
        eprintln!("MySQL/MariaDB not reachable at {url}: skipped");
        return;
    };
    let database = format!("idem_bench_{}", std::process::id());
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {database}")))
        .execute(&admin)
        .await
        .expect("database");
    let pool = MySqlPoolOptions::new()
        .max_connections(settings.workers as u32)
        .connect_with(options.database(&database))
        .await
        .expect("pool");
    let store = prepare(&pool, "BIGINT AUTO_INCREMENT PRIMARY KEY").await;
    bare(settings, "mysql", pool.clone(), rows).await;
    idem_variants(settings, "mysql", store, Duration::ZERO, rows).await;
    pool.close().await;
    let _ = sqlx::raw_sql(AssertSqlSafe(format!("DROP DATABASE {database}")))
        .execute(&admin)
        .await;
}

async fn sqlite(settings: &Settings, rows: &mut Vec<Row>) {
    let path = std::env::temp_dir().join(format!("idem_bench_{}.db", std::process::id()));
    let pool: Pool<Sqlite> = common::sqlite_pool(&path).await;
    let store = prepare(&pool, "INTEGER PRIMARY KEY AUTOINCREMENT").await;

    bare(settings, "sqlite", pool.clone(), rows).await;
    idem_variants(settings, "sqlite", store.clone(), Duration::ZERO, rows).await;
    for ms in [2, 10] {
        idem_variants(
            settings,
            "sqlite",
            store.clone(),
            Duration::from_millis(ms),
            rows,
        )
        .await;
    }
    pool.close().await;
    common::remove_sqlite(&path);
}

fn main() {
    let mut settings = Settings {
        secs: 5,
        workers: 32,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().and_then(|v| v.parse().ok());
        match arg.as_str() {
            "--secs" => settings.secs = value().unwrap_or(settings.secs),
            "--workers" => settings.workers = value().map_or(settings.workers, |v: u64| v as usize),
            _ => {} // cargo bench passes --bench
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut rows = Vec::new();
    runtime.block_on(async {
        postgres(&settings, &mut rows).await;
        mysql(&settings, &mut rows).await;
        sqlite(&settings, &mut rows).await;
    });

    println!(
        "\n{} workers, {} s per variant (after 1 s warm-up)\n",
        settings.workers, settings.secs
    );
    println!("| backend | variant | requests | req/s | p50 ms | p99 ms | × bare |");
    println!("| --- | --- | ---: | ---: | ---: | ---: | ---: |");
    for row in &rows {
        let bare = rows
            .iter()
            .find(|r| r.backend == row.backend && r.variant == "bare")
            .map_or(f64::NAN, |r| r.rate);
        println!(
            "| {} | {} | {} | {:.0} | {:.2} | {:.2} | {:.2} |",
            row.backend,
            row.variant,
            row.requests,
            row.rate,
            row.p50.as_secs_f64() * 1e3,
            row.p99.as_secs_f64() * 1e3,
            row.rate / bare
        );
    }
}
