//! The server side the HTTP benchmark's processes share (its own, and the peer
//! crate's in `benches/peer`): the payment handler without idempotency, the
//! statement counter, the duplicate count, and PostgreSQL's pool from the
//! environment. The HTTP bench adds the other backends' [`Shop`]s.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgConnection, PgPool, Pool, Postgres};

#[derive(Deserialize)]
pub(crate) struct NewPayment {
    pub(crate) amount: i64,
    pub(crate) currency: String,
}

#[derive(Serialize)]
pub(crate) struct Payment {
    pub(crate) id: i64,
    pub(crate) amount: i64,
    pub(crate) currency: String,
}

/// The request's key, as the business row's note: duplicates show as notes twice.
pub(crate) fn key_of(headers: &HeaderMap) -> String {
    headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_owned()
}

/// A database the shop runs on: its business write and its duplicate count.
pub(crate) trait Shop: sqlx::Database {
    /// The business write: one row in `payments`.
    fn insert(
        conn: &mut Self::Connection,
        note: &str,
        new: &NewPayment,
    ) -> impl Future<Output = Result<Payment, sqlx::Error>> + Send;

    /// `(business rows, notes written more than once)`.
    fn counts(pool: &Pool<Self>) -> impl Future<Output = Result<(i64, i64), sqlx::Error>> + Send;
}

/// Both counts in one statement every backend understands.
pub(crate) const COUNTS: &str = "SELECT count(*), (SELECT count(*) FROM (SELECT note FROM \
     payments GROUP BY note HAVING count(*) > 1) d) FROM payments";

impl Shop for Postgres {
    async fn insert(
        conn: &mut PgConnection,
        note: &str,
        new: &NewPayment,
    ) -> Result<Payment, sqlx::Error> {
        let id = sqlx::query_scalar(
            "INSERT INTO payments (note, amount, currency) VALUES ($1, $2, $3) RETURNING id",
        )
        .bind(note)
        .bind(new.amount)
        .bind(&new.currency)
        .fetch_one(conn)
        .await?;
        Ok(Payment::of(id, new))
    }

    async fn counts(pool: &PgPool) -> Result<(i64, i64), sqlx::Error> {
        sqlx::query_as(COUNTS).fetch_one(pool).await
    }
}

impl Payment {
    pub(crate) fn of(id: i64, new: &NewPayment) -> Self {
        Self {
            id,
            amount: new.amount,
            currency: new.currency.clone(),
        }
    }
}

pub(crate) fn failed(error: sqlx::Error) -> Response {
    (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response()
}

/// Per key, when the bench asks (`IDEM_BENCH_COUNT_EXECUTIONS=1`, for the
/// storms): the handler's executions, counted outside any transaction as a
/// provider would count its charges (a rolled-back second execution shows here,
/// not in the table), and the 5xx answers, each with the wall clock's time in
/// microseconds (the instances of a cluster run on this one machine).
static EXECUTIONS: std::sync::LazyLock<Option<std::sync::Mutex<HashMap<String, Events>>>> =
    std::sync::LazyLock::new(|| {
        std::env::var("IDEM_BENCH_COUNT_EXECUTIONS")
            .is_ok_and(|on| on == "1")
            .then(Default::default)
    });

/// What a handler does before its write: the provider's charge for `key`,
/// counted when asked, and its answer's wait, the milliseconds in
/// `IDEM_BENCH_HANDLER_WAIT_MS` (none by default).
pub(crate) async fn provider(key: &str) {
    note(key, Event::Ran);
    static WAIT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let ms = *WAIT.get_or_init(|| {
        std::env::var("IDEM_BENCH_HANDLER_WAIT_MS")
            .ok()
            .and_then(|ms| ms.parse().ok())
            .unwrap_or(0)
    });
    if ms > 0 {
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    }
}

/// The handler every variant serves: JSON in, the write in a transaction, JSON out.
pub(crate) async fn pay<DB: Shop>(
    State(pool): State<Pool<DB>>,
    headers: HeaderMap,
    axum::Json(new): axum::Json<NewPayment>,
) -> Response {
    let run = async {
        let key = key_of(&headers);
        provider(&key).await;
        let mut tx = pool.begin().await?;
        let payment = DB::insert(&mut tx, &key, &new).await?;
        tx.commit().await?;
        Ok::<_, sqlx::Error>(payment)
    };
    match run.await {
        Ok(payment) => (StatusCode::CREATED, axum::Json(payment)).into_response(),
        Err(error) => failed(error),
    }
}

/// Statements the server's pool ran while counting was on.
static COUNTING: AtomicBool = AtomicBool::new(false);
static STATEMENTS: AtomicU64 = AtomicU64::new(0);

/// Counts sqlx's per-statement events, only while asked to: a disabled check is
/// one atomic load per statement.
pub(crate) struct StatementCounter;

impl tracing::Subscriber for StatementCounter {
    fn register_callsite(
        &self,
        meta: &'static tracing::Metadata<'static>,
    ) -> tracing::subscriber::Interest {
        if meta.target() == "sqlx::query" {
            tracing::subscriber::Interest::sometimes()
        } else {
            tracing::subscriber::Interest::never()
        }
    }

    fn enabled(&self, meta: &tracing::Metadata<'_>) -> bool {
        meta.target() == "sqlx::query" && COUNTING.load(Ordering::Relaxed)
    }

    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, _: &tracing::Event<'_>) {
        STATEMENTS.fetch_add(1, Ordering::Relaxed);
    }

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}

/// `on` starts counting from zero; anything else stops. Answers the count.
pub(crate) async fn counting(body: String) -> String {
    match body.as_str() {
        "on" => {
            STATEMENTS.store(0, Ordering::Relaxed);
            COUNTING.store(true, Ordering::Relaxed);
        }
        _ => COUNTING.store(false, Ordering::Relaxed),
    }
    STATEMENTS.load(Ordering::Relaxed).to_string()
}

/// `<business rows> <notes written more than once>`.
pub(crate) async fn stats<DB: Shop>(State(pool): State<Pool<DB>>) -> Response {
    match DB::counts(&pool).await {
        Ok((rows, doubled)) => format!("{rows} {doubled}").into_response(),
        Err(error) => failed(error),
    }
}

#[derive(Clone, Copy)]
enum Event {
    Ran,
    Failed,
}

type Events = Vec<(Event, u128)>;

fn note(key: &str, event: Event) {
    let Some(executions) = &*EXECUTIONS else {
        return;
    };
    let at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_micros());
    let mut executions = executions
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    executions
        .entry(key.to_owned())
        .or_default()
        .push((event, at));
}

/// Notes the key of every 5xx answer (a middleware, outermost); passes the
/// request through untouched unless counting.
pub(crate) async fn note_failures(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if EXECUTIONS.is_none() {
        return next.run(request).await;
    }
    let key = key_of(request.headers());
    let response = next.run(request).await;
    if response.status().is_server_error() {
        note(&key, Event::Failed);
    }
    response
}

/// `ran <key> <µs>` and `failed <key> <µs>` lines, for every key this process's
/// handlers ran or answered 5xx (`GET /executions`); empty unless counting.
pub(crate) async fn executions() -> String {
    let Some(executions) = &*EXECUTIONS else {
        return String::new();
    };
    let executions = executions
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let mut lines = String::new();
    for (key, events) in executions.iter() {
        for (event, at) in events {
            let event = match event {
                Event::Ran => "ran",
                Event::Failed => "failed",
            };
            lines.push_str(&format!("{event} {key} {at}\n"));
        }
    }
    lines
}

/// The pool the bench asked for (`DATABASE_URL`, `SCHEMA`, `POOL`), with the
/// statement counter installed; and its size.
pub(crate) async fn pool_from_env() -> Result<(PgPool, usize), Box<dyn std::error::Error>> {
    let _ = tracing::subscriber::set_global_default(StatementCounter);
    let url = std::env::var("DATABASE_URL")?;
    let schema = std::env::var("SCHEMA")?;
    let size: u32 = std::env::var("POOL")?.parse()?;
    let options: PgConnectOptions = url.parse()?;
    let pool = PgPoolOptions::new()
        .max_connections(size)
        .min_connections(size)
        .connect_with(options.options([("search_path", schema.as_str())]))
        .await?;
    Ok((pool, size as usize))
}

/// Serves `router` on a loopback port, announced on stdout for the bench to read.
pub(crate) async fn serve(router: Router) -> Result<(), Box<dyn std::error::Error>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, router).await?;
    Ok(())
}
