//! The suite's own server, run as a separate process (this binary, re-executed
//! with `IDEM_FAULTS_ROLE=server`): one business write per execution, steered by
//! headers that are not part of the request's identity.
//!
//! Environment: `DATABASE_URL`; `POOL` (connections, default 16); `ACQUIRE_MS`
//! (pool acquire timeout, default 30000); `BODY_LIMIT` (bytes `/small` accepts,
//! default 1024); `BODY_TIMEOUT_MS` and `MAX_RESPONSE` (the store's settings);
//! `BUSY_MS` (SQLite's busy timeout, default 30000); `ABORT_AFTER_COMMIT=<key>`
//! (the process dies right after the request under that `Idempotency-Key`
//! commits, before its response is written); `GALERA` (`1` or `0`: MySQL's
//! cluster mode forced on or off, `Builder::galera`).
//! Prints `listening on http://ADDR` first.
//!
//! Routes: `POST /effects` and `POST /small` (headers `x-scope`, `x-lock-ms`,
//! `x-ttl-ms`, `x-wait-ms`, `x-sleep-ms`, `x-big` (response bytes); the body is the note
//! written), `GET /stats` (`{"effects":N,"doubles":M}`: rows, and notes written
//! more than once), `GET /started/{note}` (200 once a handler writing that note has
//! made its write, 404 before), `GET /runs` (every run of the handler in this
//! process, whatever became of its transaction: `[[note, started µs, ended µs,
//! committed]]`, by the wall clock, which every process on the machine shares).

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use idem_axum::axum::IdempotentRequest;
use idem_axum::{Backend, Idempotency, Options, Outcome, Tx};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{MySql, Pool, Postgres, Sqlite};

pub const ROLE: &str = "IDEM_FAULTS_ROLE";

/// Notes whose handler has written them (uncommitted, maybe): the suite waits for
/// this before it freezes or cuts an executor, so the fault lands mid-transaction.
static STARTED: Mutex<Option<HashSet<String>>> = Mutex::new(None);

/// Every run of the handler: note, when it started and ended (µs since the Unix
/// epoch), and whether its transaction committed (the request's outcome said
/// executed or taken over).
static RUNS: Mutex<Vec<(String, u128, u128, bool)>> = Mutex::new(Vec::new());

fn now_us() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_micros())
}

type Boxed<'a, T> = Pin<Box<dyn Future<Output = Result<T, sqlx::Error>> + Send + 'a>>;

/// The business table, per backend.
pub trait Effects: Backend {
    const CREATE: &'static str;
    fn insert<'a>(tx: &'a mut Tx<Self>, note: &'a str) -> Boxed<'a, i64>;
    fn stats(pool: &Pool<Self>) -> Boxed<'_, (i64, i64)>;
}

const STATS: &str = "SELECT (SELECT count(*) FROM effects), \
     (SELECT count(*) FROM (SELECT note FROM effects GROUP BY note HAVING count(*) > 1) d)";

macro_rules! effects {
    ($db:ty, $create:literal, $insert:literal) => {
        impl Effects for $db {
            const CREATE: &'static str = $create;

            fn insert<'a>(tx: &'a mut Tx<Self>, note: &'a str) -> Boxed<'a, i64> {
                Box::pin(async move {
                    let done = sqlx::query($insert).bind(note).execute(tx).await?;
                    Ok(i64::try_from(done.rows_affected()).unwrap_or(0))
                })
            }

            fn stats(pool: &Pool<Self>) -> Boxed<'_, (i64, i64)> {
                Box::pin(async move { sqlx::query_as(STATS).fetch_one(pool).await })
            }
        }
    };
}

effects!(
    Postgres,
    "CREATE TABLE IF NOT EXISTS effects (id BIGSERIAL PRIMARY KEY, note TEXT NOT NULL)",
    "INSERT INTO effects (note) VALUES ($1)"
);
effects!(
    MySql,
    "CREATE TABLE IF NOT EXISTS effects (id BIGINT AUTO_INCREMENT PRIMARY KEY, note VARCHAR(255) NOT NULL)",
    "INSERT INTO effects (note) VALUES (?)"
);
effects!(
    Sqlite,
    "CREATE TABLE IF NOT EXISTS effects (id INTEGER PRIMARY KEY AUTOINCREMENT, note TEXT NOT NULL)",
    "INSERT INTO effects (note) VALUES (?1)"
);

/// How this app answers its own database failures: 500 problem+json, as a careful
/// application would (idem then rolls the work back and releases the key).
fn database_error(error: &sqlx::Error) -> Response {
    let body = serde_json::json!({
        "type": "urn:faults:database",
        "title": "Database error",
        "status": 500,
        "detail": error.to_string(),
    });
    (
        StatusCode::INTERNAL_SERVER_ERROR,
        [("content-type", "application/problem+json")],
        body.to_string(),
    )
        .into_response()
}

fn number(headers: &HeaderMap, name: &str) -> u64 {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

async fn effect<DB: Effects>(
    State(_): State<Idempotency<DB>>,
    request: IdempotentRequest<DB>,
) -> Response {
    let headers = request.parts().headers.clone();
    let mut options = Options::new();
    if let n @ 1.. = number(&headers, "x-lock-ms") {
        options = options.lock(Duration::from_millis(n));
    }
    if let n @ 1.. = number(&headers, "x-ttl-ms") {
        options = options.ttl(Duration::from_millis(n));
    }
    if let n @ 1.. = number(&headers, "x-wait-ms") {
        options = options.wait(Duration::from_millis(n));
    }
    let sleep = Duration::from_millis(number(&headers, "x-sleep-ms"));
    let big = usize::try_from(number(&headers, "x-big")).unwrap_or(0);
    let scope = headers
        .get("x-scope")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("faults")
        .to_owned();
    let note = String::from_utf8_lossy(request.body()).into_owned();
    // When the handler started and ended, if it ran: it ends when its future
    // does, run to its end or dropped (cancelled at its lock), not when the
    // request is answered, which may be long after on a database that stalls.
    let times: Arc<Mutex<(Option<u128>, Option<u128>)>> = Arc::default();
    let run = Arc::clone(&times);
    let noted = note.clone();
    let response = request
        .run(&scope.clone(), options, move |mut tx| {
            Box::pin(async move {
                if let Ok(mut times) = run.lock() {
                    times.0 = Some(now_us());
                }
                let _ran = Ran(run);
                // Per scope: the same body under two scopes is two notes.
                if let Err(error) = DB::insert(&mut tx, &format!("{scope}|{note}")).await {
                    return database_error(&error);
                }
                if let Ok(mut started) = STARTED.lock() {
                    started
                        .get_or_insert_with(HashSet::new)
                        .insert(note.clone());
                }
                tokio::time::sleep(sleep).await;
                let body =
                    serde_json::json!({ "scope": scope, "note": note, "pad": "x".repeat(big) });
                (StatusCode::CREATED, body.to_string()).into_response()
            })
        })
        .await;
    let committed = matches!(
        response.extensions().get::<Outcome>(),
        Some(Outcome::Executed | Outcome::TakenOver)
    );
    if let Ok((Some(began), ended)) = times.lock().map(|times| *times)
        && let Ok(mut runs) = RUNS.lock()
    {
        runs.push((noted, began, ended.unwrap_or_else(now_us), committed));
    }
    response
}

/// Marks a handler's run ended when dropped: as its future ends, or is dropped.
struct Ran(Arc<Mutex<(Option<u128>, Option<u128>)>>);

impl Drop for Ran {
    fn drop(&mut self) {
        if let Ok(mut times) = self.0.lock() {
            times.1 = Some(now_us());
        }
    }
}

async fn started(Path(note): Path<String>) -> StatusCode {
    let started = STARTED
        .lock()
        .is_ok_and(|set| set.as_ref().is_some_and(|set| set.contains(&note)));
    if started {
        StatusCode::OK
    } else {
        StatusCode::NOT_FOUND
    }
}

async fn runs() -> Response {
    let runs = RUNS.lock().map(|runs| runs.clone()).unwrap_or_default();
    serde_json::json!(runs).to_string().into_response()
}

async fn stats<DB: Effects>(State(store): State<Idempotency<DB>>) -> Response {
    match DB::stats(store.pool()).await {
        Ok((effects, doubles)) => serde_json::json!({ "effects": effects, "doubles": doubles })
            .to_string()
            .into_response(),
        Err(error) => (StatusCode::SERVICE_UNAVAILABLE, error.to_string()).into_response(),
    }
}

/// The store's settings a backend adds (`GALERA` on MySQL).
type Tune<DB> = fn(idem_axum::Builder<DB>) -> idem_axum::Builder<DB>;

async fn serve<DB: Effects>(
    pool: Pool<DB>,
    tune: Tune<DB>,
) -> Result<(), Box<dyn std::error::Error>>
where
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
{
    sqlx::raw_sql(DB::CREATE).execute(&pool).await?;
    let setting = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    let mut store = Idempotency::builder(pool);
    if let Some(ms) = setting("BODY_TIMEOUT_MS") {
        store = store.body_timeout(Duration::from_millis(ms));
    }
    if let Some(bytes) = setting("MAX_RESPONSE") {
        store = store.max_response_bytes(usize::try_from(bytes)?);
    }
    let store = tune(store).build()?;
    store.migrate().await?;
    let limit = usize::try_from(setting("BODY_LIMIT").unwrap_or(1024))?;
    let router = Router::new()
        .route("/effects", post(effect::<DB>))
        .route(
            "/small",
            post(effect::<DB>).layer(axum::extract::DefaultBodyLimit::max(limit)),
        )
        .route("/stats", get(stats::<DB>))
        .route("/started/{note}", get(started))
        .route("/runs", get(runs))
        .with_state(store);
    let router = match std::env::var("ABORT_AFTER_COMMIT") {
        Ok(key) => router.layer(axum::middleware::from_fn(move |request, next| {
            abort_after_commit(key.clone(), request, next)
        })),
        Err(_) => router,
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, router).await?;
    Ok(())
}

/// Dies once the request keyed `target` has committed, before answering: the narrow
/// window in which only the stored record can tell the client's retry what happened.
async fn abort_after_commit(
    target: String,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let key = request.headers().get("idempotency-key").cloned();
    let response = next.run(request).await;
    let executed = matches!(
        response.extensions().get::<idem_axum::Outcome>(),
        Some(idem_axum::Outcome::Executed | idem_axum::Outcome::TakenOver)
    );
    if executed && key.is_some_and(|key| key.as_bytes() == target.as_bytes()) {
        eprintln!("faults server: ABORT_AFTER_COMMIT: dying before answering");
        std::process::abort();
    }
    response
}

async fn start() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")?;
    let size = std::env::var("POOL")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16);
    let acquire = std::env::var("ACQUIRE_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(Duration::from_secs(30), Duration::from_millis);
    if url.starts_with("postgres:") {
        let pool = PgPoolOptions::new()
            .max_connections(size)
            .acquire_timeout(acquire)
            .connect_with(PgConnectOptions::from_str(&url)?)
            .await?;
        serve(pool, |store| store).await
    } else if url.starts_with("mysql:") {
        let pool = MySqlPoolOptions::new()
            .max_connections(size)
            .acquire_timeout(acquire)
            .connect_with(MySqlConnectOptions::from_str(&url)?)
            .await?;
        serve(pool, galera).await
    } else {
        let busy = std::env::var("BUSY_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(Duration::from_secs(30), Duration::from_millis);
        let options = SqliteConnectOptions::from_str(&url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(busy);
        let pool = SqlitePoolOptions::new()
            .max_connections(size)
            .acquire_timeout(acquire)
            .connect_with(options)
            .await?;
        serve(pool, |store| store).await
    }
}

/// `GALERA=1` or `0`: MySQL's cluster mode forced on or off.
fn galera(store: idem_axum::Builder<MySql>) -> idem_axum::Builder<MySql> {
    match std::env::var("GALERA").as_deref() {
        Ok("1") => store.galera(true),
        Ok("0") => store.galera(false),
        _ => store,
    }
}

pub fn main() -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("server: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(start()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("server: {error}");
            ExitCode::FAILURE
        }
    }
}
