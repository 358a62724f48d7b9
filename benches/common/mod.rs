//! What the benchmarks share: the load loop, the business write, the request.

#![allow(dead_code, unreachable_pub, missing_docs)]

pub mod lite_floor;
#[macro_use]
pub mod my_floor;
pub mod pg_floor;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Response, StatusCode, Uri};
use http_body_util::Full;
use idem_axum::{Backend, Idempotency, IdempotencyKey, Options, Outcome, RequestIdentity};
use sqlx::{AssertSqlSafe, Pool};

pub struct Settings {
    pub secs: u64,
    pub workers: usize,
}

/// Runs `op(worker, n)` from `workers` tasks for `secs` seconds (after a one-second
/// warm-up) and reports throughput and latency.
pub async fn measure<F, Fut>(settings: &Settings, op: F) -> (u64, f64, Duration, Duration)
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let op = Arc::new(op);
    let counter = Arc::new(AtomicU64::new(0));
    let warm_until = Instant::now() + Duration::from_secs(1);
    let until = warm_until + Duration::from_secs(settings.secs);
    let tasks: Vec<_> = (0..settings.workers)
        .map(|worker| {
            let op = Arc::clone(&op);
            let counter = Arc::clone(&counter);
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                loop {
                    let n = counter.fetch_add(1, Ordering::Relaxed);
                    let started = Instant::now();
                    if started >= until {
                        break;
                    }
                    op(worker, n).await;
                    if started >= warm_until {
                        latencies.push(started.elapsed());
                    }
                }
                latencies
            })
        })
        .collect();
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.expect("worker"));
    }
    all.sort();
    let pick = |q: f64| {
        all.get(((all.len() as f64 * q) as usize).min(all.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    };
    let n = all.len() as u64;
    (n, n as f64 / settings.secs as f64, pick(0.5), pick(0.99))
}

pub fn ok_response() -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(br#"{"ok":true}"#)));
    *response.status_mut() = StatusCode::CREATED;
    response
}

pub fn identity(key: &str) -> RequestIdentity {
    let key = IdempotencyKey::parse(key.as_bytes()).ok();
    let uri = Uri::from_static("/effects");
    RequestIdentity::new(key, "bench", &Method::POST, &uri, br#"{"amount":1}"#)
}

/// A request with key `key` whose handler makes the business write, then waits
/// `wait` in its transaction; asserts that idem answered it with `expect`.
pub async fn execute_insert<DB: Backend>(
    store: &Idempotency<DB>,
    key: &str,
    wait: Duration,
    expect: Outcome,
) where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'a> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
{
    let response = store
        .execute(identity(key), Options::new(), move |mut tx| {
            Box::pin(async move {
                let done = sqlx::query(INSERT).execute(&mut *tx).await;
                if !wait.is_zero() {
                    tokio::time::sleep(wait).await;
                }
                match done {
                    Ok(_) => ok_response(),
                    Err(error) => panic!("business write failed: {error}"),
                }
            })
        })
        .await;
    assert!(response.status().is_success(), "{key}: {response:?}");
    assert_eq!(
        response.extensions().get::<Outcome>(),
        Some(&expect),
        "{key}: {response:?}"
    );
}

/// A WAL-mode SQLite file pool, created if missing, as the benches use it.
pub async fn sqlite_pool(path: &std::path::Path) -> Pool<sqlx::Sqlite> {
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
    SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(
            SqliteConnectOptions::new()
                .filename(path)
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .busy_timeout(Duration::from_secs(30)),
        )
        .await
        .expect("sqlite")
}

/// Removes a SQLite database file and its WAL companions.
pub fn remove_sqlite(path: &std::path::Path) {
    for suffix in ["", "-wal", "-shm"] {
        let mut file = path.to_owned().into_os_string();
        file.push(suffix);
        let _ = std::fs::remove_file(file);
    }
}

/// The business write every variant makes.
pub const INSERT: &str = "INSERT INTO effects (note) VALUES ('x')";

/// Creates the business table (`id` declared as `id_column`) and the key table.
pub async fn prepare<DB: Backend>(pool: &Pool<DB>, id_column: &str) -> Idempotency<DB>
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let ddl = format!("CREATE TABLE effects (id {id_column}, note TEXT NOT NULL)");
    sqlx::raw_sql(AssertSqlSafe(ddl))
        .execute(&mut *pool.acquire().await.expect("connection"))
        .await
        .expect("effects");
    let store = Idempotency::new(pool.clone());
    store.migrate().await.expect("migrate");
    store
}
