//! The price of exactly-once over HTTP, side by side with the alternatives, on
//! PostgreSQL, MySQL/MariaDB and SQLite.
//!
//! ```text
//! cargo bench --all-features --bench http                            # 3 rounds, 5 s per variant, 32 connections
//! cargo bench --all-features --bench http -- --backends mysql,sqlite   # default: postgres,mysql,sqlite
//! cargo bench --all-features --bench http -- --secs 2 --connections 16 --rounds 1
//! cargo bench --all-features --bench http -- --only idem-first,idem-replay   # and `bare`
//! cargo bench --all-features --bench http -- --growth              # also with 10^4, 10^6, 10^7 keys stored
//! cargo bench --all-features --bench http -- --paired hand-written,idem-first   # both at once
//! cargo bench --all-features --bench http -- --only idem-first,idem-first-sealed,idem-replay-uncached,idem-replay-sealed
//! cargo bench --all-features --bench http -- --ceiling             # replays and `static` under wrk
//! cargo bench --all-features --bench http -- --ceiling --together  # both loads at once
//! ```
//!
//! Each backend is measured on its own, every run in a schema (PostgreSQL), a
//! database (MySQL/MariaDB) or a file (SQLite, WAL, `synchronous = NORMAL`) of its
//! own. The cold replays, the peer crate, pgbench and the growth runs exist for
//! PostgreSQL only so far. PostgreSQL's schemas are open to every role, as `public`
//! is, so that idem records through its record function (upgrade 4);
//! `IDEM_BENCH_PRIVATE_SCHEMA=1` closes them, and idem sends the session's restore
//! and the record as two statements, as before that upgrade. On MySQL/MariaDB,
//! `IDEM_BENCH_GALERA=1` runs idem in its cluster mode (the claim committed before
//! the handler, as on a Galera cluster) on whichever server `IDEM_TEST_MYSQL_URL`
//! names, `=0` in its standalone design; unset, as the server says.
//! `IDEM_BENCH_MYSQL_SECOND_URL` names a second server of the same cluster (a
//! Galera node; its database part is ignored): every variant then runs two
//! instances, one through each server, and each connection sends its requests to
//! them in turn, so that a storm's duplicates of a key reach both at once. The
//! first instance completes the replays' keys and takes the counted pass (the
//! second reads each key it replays from the table once); CPU is summed over
//! both, peak RSS is the larger. `IDEM_BENCH_SHOW_ERRORS=1` prints every 5xx
//! answer the load gets, with its key and body.
//!
//! Every variant serves the same handler (JSON in, one business INSERT in a
//! transaction, JSON out) from a server process of its own (this binary, re-run
//! with `IDEM_BENCH_ROLE=server` and `BACKEND`), driven by the same load: keep-alive HTTP/1.1
//! connections on loopback, one request in flight each, once the database server
//! is idle again after the previous run (up to 5 s), a one-second warm-up, then a
//! fixed duration. Rounds run every variant in turn; ratios to `bare` are taken
//! within a round, and the round with the median ratio is reported.
//!
//! - `bare`: the handler with a sqlx transaction, no idempotency;
//! - `hand-written`: the floor of idem's design on that backend for a new key, by
//!   hand behind axum. PostgreSQL: in the round trip of `BEGIN` the transaction's
//!   timeouts, the key's advisory try-lock and the handler's savepoint, then a
//!   statement that reads the key and claims it if the lock was granted, the
//!   write, the record (`hand-written-minimal`, only when `--paired` or `--only`
//!   names it: without the timeouts and the savepoint, the try-lock in the
//!   claim; `hand-written-guarded`, likewise: with the two guarantees idem gives
//!   past the claim, its session lock and session saves, `common/pg_floor.rs`).
//!   MySQL: in
//!   the round trip of `BEGIN` the session's timeouts set, the key's
//!   `GET_LOCK(…, 0)` and, before the `BEGIN`, a check that fails unless it was
//!   taken and the key has no row, the write, the record inserted, the lock freed
//!   and the timeouts restored with the COMMIT (`hand-written-guarded`: with
//!   idem's guarantees past the claim, `common/my_floor.rs`;
//!   `hand-written-previous`, for `--paired` only: the
//!   row read after `BEGIN` instead of the check; `hand-written-minimal`: the
//!   write and the record alone, a bound on any design; `hand-written-parts`:
//!   that bound plus the floor's parts named in `IDEM_BENCH_FLOOR_PARTS`, of
//!   `timeouts`, `lock`, `check`, `maria`, `autocommit`, `readonly` (as idem sets
//!   them), and `onetrip` (the record sent as text in the
//!   COMMIT's round trip); `hand-written-row`: the claim as the key's row,
//!   held by the transaction, instead of the named lock and the check; these
//!   three run only when `--only` or `--paired` names them). SQLite: a look-up,
//!   then in one `BEGIN IMMEDIATE` transaction the claim, the write, the record
//!   (`hand-written-guarded`, when `--only` or `--paired` names it: the claim
//!   committed before that transaction, and a refused `BEGIN` before the record,
//!   `common/lite_floor.rs`);
//! - `idem-first`: `#[idempotent]`, every request a new key;
//! - `idem-replay`: `#[idempotent]`, every request a key this instance completed;
//! - `static`: the answer a replay gives (status, JSON body, `Idempotent-Replayed`)
//!   from a handler with the same extractors and no idem, sent the replays' keys:
//!   what a replay from memory could at best be;
//! - `idem-replay-cold`: every request a stored key this instance never saw (as
//!   when another instance served it);
//! - `idem-first-sealed`, and `idem-replay-uncached` / `idem-replay-sealed`
//!   (replays read from the table, without the replay cache), sealing off and on:
//!   only when `--only` names them;
//! - `idem-storm`: `#[idempotent]`, keys sent 8 times each by concurrent connections;
//! - `naive-cache`: the cached-response pattern (look the key up in Redis, run the
//!   handler, store the response after the fact), with Redis at 127.0.0.1:6379;
//! - `axum-idempotent`, `axum-idempotent-storm`: the peer crate from crates.io
//!   (sessions in PostgreSQL), served by `benches/peer` once it is built:
//!   `cargo build --release --manifest-path benches/peer/Cargo.toml --target-dir target`.
//!
//! Reported per variant: requests/s, p50/p99 latency, ratio to `bare`, the server
//! process's CPU time per request and peak RSS, the database server's CPU time per
//! request (its processes on this machine, by `/proc`; not on SQLite), statements per request (sqlx's
//! events) and round trips per request (data segments the server sent to
//! PostgreSQL, MySQL and Redis, by `ss`, none on SQLite, which runs in the server;
//! sqlx sends BEGIN alone and its pool checks a connection with a round trip when
//! it is taken and when it is given back), both counted in a separate short pass,
//! and for the storms how many keys executed more than once (the handlers'
//! executions per key, counted outside the transaction and summed over the
//! instances, or the business rows written twice, whichever shows more; a key
//! run again after a 5xx told its client that nothing was committed is counted
//! apart). Then `pgbench`'s rate
//! for the bare transaction, as the database's own reference. A Markdown table goes
//! to stdout, every row as JSON to `target/idem-bench-http.json` (`backend`,
//! `variant`, `req_s`, `x_bare`, `p50_ms`, `p99_ms`, `keys_run_twice`,
//! `keys_rerun_after_5xx`, `server_cpu_us`, `database_cpu_us`), and a chart
//! of × bare to `target/idem-bench-http.svg`, a variant that ran keys twice drawn
//! red with its count. Run with no `--bench` argument (as `cargo test --bench http`
//! does) it takes a short setting, to check that it runs.

#![allow(missing_docs)]

#[path = "common/lite_floor.rs"]
mod lite_floor;
#[path = "common/my_floor.rs"]
#[macro_use]
mod my_floor;
use my_floor::hex;
#[path = "common/pg_floor.rs"]
mod pg_floor;
#[path = "common/shop.rs"]
mod shop;

use std::collections::HashMap;
use std::str::FromStr as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::rt::TokioIo;
use idem_axum::{Idempotency, KeyRing, Sealing, Tx, idempotent};
use sqlx::mysql::{MySqlConnection, MySqlPoolOptions};
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{AssertSqlSafe, MySql, MySqlPool, PgPool, Pool, Postgres, Sqlite};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::TcpStream;
use tokio::sync::Mutex;

use shop::{NewPayment, Payment, Shop, failed, key_of};

const ROLE: &str = "IDEM_BENCH_ROLE";
const STORM_DUPLICATES: u64 = 8;
const BODY: &str = r#"{"amount":100,"currency":"JPY"}"#;

// ---------------------------------------------------------------------------------
// The server

struct App<DB: idem_axum::Backend> {
    pool: Pool<DB>,
    idempotency: Idempotency<DB>,
    redis: Arc<Redis>,
}

impl<DB: idem_axum::Backend> Clone for App<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            idempotency: self.idempotency.clone(),
            redis: Arc::clone(&self.redis),
        }
    }
}

impl<DB: idem_axum::Backend> axum::extract::FromRef<App<DB>> for Pool<DB> {
    fn from_ref(app: &App<DB>) -> Self {
        app.pool.clone()
    }
}

impl<DB: idem_axum::Backend> axum::extract::FromRef<App<DB>> for Idempotency<DB> {
    fn from_ref(app: &App<DB>) -> Self {
        app.idempotency.clone()
    }
}

#[idempotent(unscoped = true, required = true)]
async fn idem<DB: idem_axum::Backend + Shop>(
    key: idem_axum::IdempotencyKey,
    mut tx: Tx<DB>,
    axum::Json(new): axum::Json<NewPayment>,
) -> Response {
    shop::provider(key.as_str()).await;
    match DB::insert(&mut tx, key.as_str(), &new).await {
        Ok(payment) => (StatusCode::CREATED, axum::Json(payment)).into_response(),
        Err(error) => failed(error),
    }
}

/// `static`: what a replay answers (the status, the JSON body, the replay's
/// header), from a handler with the same extractors and no idem: the limit of a
/// replay from memory.
async fn static_payment(
    key: idem_axum::IdempotencyKey,
    axum::Json(new): axum::Json<NewPayment>,
) -> Response {
    let _ = key;
    (
        StatusCode::CREATED,
        [("idempotent-replayed", "true")],
        axum::Json(Payment::of(1, &new)),
    )
        .into_response()
}

/// What a hand-written floor answers: the status and the JSON body.
type Floor = Result<(StatusCode, Vec<u8>), sqlx::Error>;

/// The outer shape every hand-written floor shares: parse the body, run the
/// backend's statements, answer.
async fn by_hand<F, Fut>(headers: &HeaderMap, body: &Bytes, run: F) -> Response
where
    F: FnOnce(String, NewPayment) -> Fut,
    Fut: Future<Output = Floor>,
{
    let Ok(new) = serde_json::from_slice::<NewPayment>(body) else {
        return StatusCode::UNPROCESSABLE_ENTITY.into_response();
    };
    match run(key_of(headers), new).await {
        Ok((status, body)) => {
            (status, [("content-type", "application/json")], body).into_response()
        }
        Err(error) => failed(error),
    }
}

/// What a floor's look-up answers by itself: the stored response of a completed
/// key, 409 for one in flight, nothing for a new key.
fn answer_stored(found: Option<(String, Option<Vec<u8>>)>) -> Option<(StatusCode, Vec<u8>)> {
    match found {
        Some((state, stored)) if state == "completed" => {
            Some((StatusCode::CREATED, stored.unwrap_or_default()))
        }
        Some(_) => Some((StatusCode::CONFLICT, Vec::new())),
        None => None,
    }
}

/// Which of PostgreSQL's hand-written floors a request runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum PgFloor {
    /// `hand-written-minimal`: without the savepoint and the timeouts, the
    /// try-lock in the claim.
    Minimal,
    /// `hand-written`.
    Plain,
    /// `hand-written-guarded`: also the two guarantees idem gives past the claim
    /// (see `pg_floor`).
    Guarded,
}

/// PostgreSQL's floor for a new key: in the round trip of `BEGIN`, the
/// transaction's timeouts, the key's advisory try-lock (its outcome in a setting
/// the claim reads) and the handler's savepoint; one statement that reads the key
/// and, when absent and locked, claims it; the write; the record. See [`PgFloor`]
/// for the others.
async fn hand_written<const FAITHFUL: bool>(
    State(app): State<App<Postgres>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let floor = if FAITHFUL {
        PgFloor::Plain
    } else {
        PgFloor::Minimal
    };
    by_hand(&headers, &body, |key, new| async move {
        floor_postgres(&app, key, new, floor).await
    })
    .await
}

/// [`PgFloor::Guarded`].
async fn hand_written_guarded(
    State(app): State<App<Postgres>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    by_hand(&headers, &body, |key, new| async move {
        floor_postgres(&app, key, new, PgFloor::Guarded).await
    })
    .await
}

async fn floor_postgres(
    app: &App<Postgres>,
    key: String,
    new: NewPayment,
    floor: PgFloor,
) -> Floor {
    let guarded = floor == PgFloor::Guarded;
    let mut seed = 0;
    let (mut tx, locked) = if floor == PgFloor::Minimal {
        (
            app.pool.begin().await?,
            "pg_try_advisory_xact_lock(hashtext($1))",
        )
    } else {
        seed = pg_floor::seed(&key);
        let tx = app
            .pool
            .begin_with(AssertSqlSafe(pg_floor::begin(seed, guarded)))
            .await?;
        (tx, "current_setting('idem.locked', true) = 'true'")
    };
    // The claim's lease, or what is stored: state and response body.
    type Seen = (Option<i64>, Option<String>, Option<Vec<u8>>);
    let seen: Result<Seen, _> = sqlx::query_as(AssertSqlSafe(format!(
        "WITH found AS MATERIALIZED ( \
             SELECT state, body FROM idempotency_keys WHERE scope = '' AND idempotency_key = $1), \
         claimed AS ( \
             INSERT INTO idempotency_keys (scope, idempotency_key, state, lease, method, path, \
                 fingerprint, locked_until, expires_at, created_at) \
             SELECT '', $1, 'processing', 1, 'POST', '/payments', '\\x00', \
                 clock_timestamp() + interval '30 seconds', clock_timestamp() + interval '1 day', \
                 clock_timestamp() \
             WHERE NOT EXISTS (SELECT 1 FROM found) AND {locked} \
             RETURNING lease) \
         SELECT (SELECT lease FROM claimed), found.state, found.body \
         FROM (SELECT 1) AS one LEFT JOIN found ON true"
    )))
    .bind(&key)
    .fetch_one(&mut *tx)
    .await;
    let answer = match seen {
        Ok((Some(_), _, _)) => None,
        Ok((None, Some(state), stored)) if state == "completed" => {
            Some((StatusCode::CREATED, stored.unwrap_or_default()))
        }
        _ => Some((StatusCode::CONFLICT, Vec::new())),
    };
    if let Some(answer) = answer {
        if guarded {
            // Not claimed: the session lock, if taken, would outlive the rollback.
            let (high, low) = pg_floor::halves(seed);
            sqlx::raw_sql("ROLLBACK TO SAVEPOINT handler")
                .execute(&mut *tx)
                .await?;
            sqlx::query(
                "SELECT CASE WHEN current_setting('idem.locked', true) = 'true' \
                 THEN pg_advisory_unlock($1, $2) END",
            )
            .bind(high)
            .bind(low)
            .execute(&mut *tx)
            .await?;
        }
        return Ok(answer);
    }
    let payment = Postgres::insert(&mut tx, &key, &new).await?;
    let out = serde_json::to_vec(&payment).unwrap_or_default();
    let mut record = sqlx::query(AssertSqlSafe(pg_floor::record(guarded)))
        .bind(&key)
        .bind(&out);
    if guarded {
        let (high, low) = pg_floor::halves(seed);
        record = record.bind(high).bind(low);
    }
    let done = record.execute(&mut *tx).await?;
    if done.rows_affected() != 1 {
        return Ok((StatusCode::INTERNAL_SERVER_ERROR, Vec::new()));
    }
    tx.commit().await?;
    Ok((StatusCode::CREATED, out))
}

/// MySQL's floor (`common/my_floor.rs`). A key found stored or locked is read and
/// answered then. `ONE_TRIP = false` (`hand-written-previous`): the design before
/// the check rode on `BEGIN`, the row read after it.
async fn hand_written_mysql<const ONE_TRIP: bool>(
    State(app): State<App<MySql>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    by_hand(&headers, &body, |key, new| async move {
        let mut conn = app.pool.acquire().await?;
        let begin = my_floor::begin(&key, ONE_TRIP);
        let finish = my_floor::FINISH;
        let read = sqlx::query_as(my_floor::READ).bind(&key);
        let error = match sqlx::Connection::begin_with(&mut *conn, AssertSqlSafe(begin)).await {
            Ok(tx) => return mysql_new_key::<ONE_TRIP>(tx, read, finish, &key, new).await,
            Err(error) => error,
        };
        let taken =
            matches!(&error, sqlx::Error::Database(e) if e.code().as_deref() == Some(my_floor::TAKEN));
        if !(ONE_TRIP && taken) {
            return Err(error);
        }
        // The text stopped at the check, before its `BEGIN`.
        mysql_answer_taken(&mut conn, read, finish).await
    })
    .await
}

/// A MySQL floor's answer for a key found taken: `read`, then `ROLLBACK` with
/// `finish`, then the stored answer or a 409.
async fn mysql_answer_taken(
    conn: &mut MySqlConnection,
    read: MySqlRead<'_>,
    finish: &str,
) -> Floor {
    let (_, state, stored) = read.fetch_one(&mut *conn).await?;
    sqlx::raw_sql(AssertSqlSafe(format!("ROLLBACK; {finish}")))
        .execute(&mut *conn)
        .await?;
    let found = state.map(|state| (state, stored));
    Ok(answer_stored(found).unwrap_or((StatusCode::CONFLICT, Vec::new())))
}

/// MySQL's guarded floor (`common/my_floor.rs`): the floor with idem's
/// guarantees past the claim. A key found stored or locked is read and answered.
async fn hand_written_guarded_mysql(
    State(app): State<App<MySql>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    by_hand(&headers, &body, |key, new| async move {
        let mut conn = app.pool.acquire().await?;
        let begin = my_floor::begin_guarded(&key);
        let error = match sqlx::Connection::begin_with(&mut *conn, AssertSqlSafe(begin)).await {
            Ok(tx) => return mysql_guarded_new_key(tx, &key, new).await,
            Err(error) => error,
        };
        if !my_floor::taken_guarded(&error) {
            return Err(error);
        }
        let read = sqlx::query_as(my_floor::READ).bind(&key);
        mysql_answer_taken(&mut conn, read, &my_floor::restore_guarded()).await
    })
    .await
}

/// The rest of MySQL's guarded floor once the claim's row is in: the write, the
/// record, the COMMIT with the restore.
async fn mysql_guarded_new_key(
    mut tx: sqlx::Transaction<'_, MySql>,
    key: &str,
    new: NewPayment,
) -> Floor {
    let payment = MySql::insert(&mut tx, key, &new).await?;
    let out = serde_json::to_vec(&payment).unwrap_or_default();
    let done = sqlx::query(my_floor::RECORD_GUARDED)
        .bind(&out)
        .bind(key)
        .execute(&mut *tx)
        .await?;
    if done.rows_affected() != 1 {
        return Ok((StatusCode::INTERNAL_SERVER_ERROR, Vec::new()));
    }
    let commit = format!("COMMIT; {}", my_floor::restore_guarded());
    sqlx::raw_sql(AssertSqlSafe(commit))
        .execute(&mut *tx)
        .await?;
    // The server committed; sqlx's guard sends a ROLLBACK that does nothing.
    drop(tx);
    Ok((StatusCode::CREATED, out))
}

/// The read of MySQL's floor: whether the lock was taken, and the key's row.
type MySqlRead<'q> = sqlx::query::QueryAs<
    'q,
    MySql,
    (i64, Option<String>, Option<Vec<u8>>),
    sqlx::mysql::MySqlArguments,
>;

/// The rest of MySQL's floor once `BEGIN` went through: the read (without the
/// check), the write, the record, the COMMIT with `finish`.
async fn mysql_new_key<const ONE_TRIP: bool>(
    mut tx: sqlx::Transaction<'_, MySql>,
    read: MySqlRead<'_>,
    finish: &'static str,
    key: &str,
    new: NewPayment,
) -> Floor {
    if !ONE_TRIP {
        let (locked, state, stored) = read.fetch_one(&mut *tx).await?;
        if locked != 1 || state.is_some() {
            sqlx::raw_sql(AssertSqlSafe(finish))
                .execute(&mut *tx)
                .await?;
            let found = state.map(|state| (state, stored));
            return Ok(answer_stored(found).unwrap_or((StatusCode::CONFLICT, Vec::new())));
        }
    }
    let payment = MySql::insert(&mut tx, key, &new).await?;
    let out = serde_json::to_vec(&payment).unwrap_or_default();
    sqlx::query(my_floor::RECORD_LOCKED)
        .bind(key)
        .bind(&out)
        .execute(&mut *tx)
        .await?;
    let commit = format!("COMMIT; {finish}");
    sqlx::raw_sql(AssertSqlSafe(commit))
        .execute(&mut *tx)
        .await?;
    // The server committed; sqlx's guard sends a ROLLBACK that does nothing.
    drop(tx);
    Ok((StatusCode::CREATED, out))
}

/// Which of MySQL's floor's parts a bound sends (`hand-written-minimal`: none;
/// `hand-written-parts`: those named in `IDEM_BENCH_FLOOR_PARTS`, of `timeouts`,
/// `lock`, `check`, `maria`, `autocommit` and `readonly`), to tell what each one
/// costs. `onetrip` changes how the
/// record goes out: as text with the COMMIT, failing (1690) when it wrote nothing,
/// one round trip and one command fewer than the floor's.
#[derive(Clone, Copy, Default)]
struct FloorParts {
    timeouts: bool,
    lock: bool,
    check: bool,
    onetrip: bool,
    /// MariaDB's idle and statement timeouts, saved, set and restored as idem's
    /// claim does.
    maria: bool,
    /// `autocommit` saved, 0 for the claim, restored.
    autocommit: bool,
    /// Later transactions read-only after `BEGIN`, read-write again after COMMIT.
    readonly: bool,
}

impl FloorParts {
    /// Read once per server, not per request.
    fn from_env() -> Self {
        static PARTS: std::sync::OnceLock<FloorParts> = std::sync::OnceLock::new();
        *PARTS.get_or_init(|| {
            let named = std::env::var("IDEM_BENCH_FLOOR_PARTS").unwrap_or_default();
            let has = |part| named.split(',').any(|named| named.trim() == part);
            Self {
                timeouts: has("timeouts"),
                lock: has("lock"),
                check: has("check"),
                onetrip: has("onetrip"),
                maria: has("maria"),
                autocommit: has("autocommit"),
                readonly: has("readonly"),
            }
        })
    }
}

/// MySQL's bounds, new keys only: the write and the record between `BEGIN` and
/// `COMMIT`, plus the floor's `parts`. With none (`hand-written-minimal`) it is the
/// least any design that records in the handler's transaction sends, though not
/// one idem could ship: a duplicate waits on the first one's row, then fails on
/// its key. The check here never fails, so that it costs what the floor's costs
/// without the lock.
async fn floor_parts_mysql(
    app: &App<MySql>,
    key: String,
    new: NewPayment,
    parts: FloorParts,
) -> Floor {
    let mut conn = app.pool.acquire().await?;
    let mut set = Vec::new();
    let mut finish = Vec::new();
    if parts.timeouts {
        set.push(
            "@wait = @@SESSION.wait_timeout, @lock_wait = @@SESSION.innodb_lock_wait_timeout, \
             SESSION wait_timeout = 30, SESSION innodb_lock_wait_timeout = 30"
                .to_owned(),
        );
        finish.push("SESSION wait_timeout = @wait, innodb_lock_wait_timeout = @lock_wait");
    }
    if parts.lock {
        let lock = format!("MD5(X'{}')", hex(key.as_bytes()));
        set.push(format!("@lock = {lock}, @locked = GET_LOCK({lock}, 0)"));
        finish.push("@released = RELEASE_LOCK(@lock)");
    }
    if parts.maria {
        for name in [
            "idle_transaction_timeout",
            "idle_write_transaction_timeout",
            "idle_readonly_transaction_timeout",
            "max_statement_time",
        ] {
            set.push(format!("@{name} = @@SESSION.{name}, SESSION {name} = 30"));
        }
        finish.push(
            "SESSION idle_transaction_timeout = @idle_transaction_timeout, \
             idle_write_transaction_timeout = @idle_write_transaction_timeout, \
             idle_readonly_transaction_timeout = @idle_readonly_transaction_timeout, \
             max_statement_time = @max_statement_time",
        );
    }
    if parts.autocommit {
        set.push("@autocommit = @@SESSION.autocommit, SESSION autocommit = 0".to_owned());
        finish.push("SESSION autocommit = @autocommit");
    }
    let mut begin = if set.is_empty() {
        String::new()
    } else {
        format!("SET {}; ", set.join(", "))
    };
    if parts.check {
        begin.push_str(&format!(
            "COMMIT; SELECT 18446744073709551614 + EXISTS (SELECT 1 FROM idempotency_keys \
                 WHERE scope = '' AND idempotency_key = X'{}'); ",
            hex(key.as_bytes())
        ));
    }
    begin.push_str("BEGIN");
    if parts.readonly {
        begin.push_str("; SET SESSION TRANSACTION READ ONLY");
    }
    let mut tx = sqlx::Connection::begin_with(&mut *conn, AssertSqlSafe(begin)).await?;
    let payment = MySql::insert(&mut tx, &key, &new).await?;
    let out = serde_json::to_vec(&payment).unwrap_or_default();
    let record = if parts.lock {
        my_floor::RECORD_LOCKED
    } else {
        mysql_record!()
    };
    if parts.onetrip {
        // A failed statement ends the text: nothing written, no COMMIT.
        let record = record
            .replacen('?', &format!("X'{}'", hex(key.as_bytes())), 1)
            .replacen('?', &format!("X'{}'", hex(&out)), 1);
        let mut text = format!("{record}; SELECT 18446744073709551615 + (ROW_COUNT() = 0); COMMIT");
        if !finish.is_empty() {
            text.push_str(&format!("; SET {}", finish.join(", ")));
        }
        sqlx::raw_sql(AssertSqlSafe(text)).execute(&mut *tx).await?;
        // As in the floor: sqlx's guard sends a ROLLBACK that does nothing.
        drop(tx);
        return Ok((StatusCode::CREATED, out));
    }
    sqlx::query(record)
        .bind(&key)
        .bind(&out)
        .execute(&mut *tx)
        .await?;
    if finish.is_empty() && !parts.readonly {
        tx.commit().await?;
    } else {
        let readonly = if parts.readonly {
            "SET SESSION TRANSACTION READ WRITE; "
        } else {
            ""
        };
        let restore = if finish.is_empty() {
            String::new()
        } else {
            format!("SET {}", finish.join(", "))
        };
        let commit = format!("COMMIT; {readonly}{restore}");
        sqlx::raw_sql(AssertSqlSafe(commit))
            .execute(&mut *tx)
            .await?;
        // As in the floor: sqlx's guard sends a ROLLBACK that does nothing.
        drop(tx);
    }
    Ok((StatusCode::CREATED, out))
}

/// MySQL's `hand-written-row` (`--only` and `--paired` only): a design whose
/// claim is the key's row itself, held by the transaction, where the floor takes
/// a named lock and reads. In the round trip of `BEGIN`, `wait_timeout` set to the
/// lock (saved) and the row inserted as `processing` with no lock wait (MariaDB's
/// `SET STATEMENT`: a duplicate of a key in flight fails at once, not after the
/// handler's own lock waits); the write; the record as an `UPDATE`; the COMMIT
/// with the restore. InnoDB frees the row's lock with the transaction, so there is
/// no lock to release.
async fn row_mysql(State(app): State<App<MySql>>, headers: HeaderMap, body: Bytes) -> Response {
    by_hand(&headers, &body, |key, new| async move {
        let mut conn = app.pool.acquire().await?;
        let begin = format!(
            "SET @wait = @@SESSION.wait_timeout, SESSION wait_timeout = 30; BEGIN; \
             SET STATEMENT innodb_lock_wait_timeout = 0 FOR \
             INSERT INTO idempotency_keys (scope, idempotency_key, state, lease, method, path, \
                 fingerprint, locked_until, expires_at, created_at) \
             VALUES ('', X'{}', 'processing', 1, 'POST', '/payments', REPEAT(x'00', 32), \
                 UTC_TIMESTAMP(6) + INTERVAL 30 SECOND, UTC_TIMESTAMP(6) + INTERVAL 30 SECOND, \
                 UTC_TIMESTAMP(6))",
            hex(key.as_bytes())
        );
        let mut tx = sqlx::Connection::begin_with(&mut *conn, AssertSqlSafe(begin)).await?;
        let payment = MySql::insert(&mut tx, &key, &new).await?;
        let out = serde_json::to_vec(&payment).unwrap_or_default();
        sqlx::query(
            "UPDATE idempotency_keys SET state = 'completed', status = 201, headers = '', \
                 body = ?, expires_at = UTC_TIMESTAMP(6) + INTERVAL 1 DAY \
             WHERE scope = '' AND idempotency_key = ? AND lease = 1",
        )
        .bind(&out)
        .bind(&key)
        .execute(&mut *tx)
        .await?;
        sqlx::raw_sql("COMMIT; SET SESSION wait_timeout = @wait")
            .execute(&mut *tx)
            .await?;
        drop(tx);
        Ok((StatusCode::CREATED, out))
    })
    .await
}

async fn minimal_mysql(State(app): State<App<MySql>>, headers: HeaderMap, body: Bytes) -> Response {
    by_hand(&headers, &body, |key, new| async move {
        floor_parts_mysql(&app, key, new, FloorParts::default()).await
    })
    .await
}

async fn parts_mysql(State(app): State<App<MySql>>, headers: HeaderMap, body: Bytes) -> Response {
    by_hand(&headers, &body, |key, new| async move {
        floor_parts_mysql(&app, key, new, FloorParts::from_env()).await
    })
    .await
}

/// SQLite's floor for a new key: look the key up; in one write transaction
/// (`BEGIN IMMEDIATE`), claim it with an INSERT that does nothing on conflict, the
/// write, the record. `GUARDED` (`hand-written-guarded`, `common/lite_floor.rs`):
/// the claim committed before the handler's transaction, and the check that the
/// handler did not end it before the record.
async fn hand_written_sqlite<const GUARDED: bool>(
    State(app): State<App<Sqlite>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    by_hand(&headers, &body, |key, new| async move {
        let mut conn = app.pool.acquire().await?;
        let found: Option<(String, Option<Vec<u8>>)> = sqlx::query_as(lite_floor::LOOKUP)
            .bind(&key)
            .fetch_optional(&mut *conn)
            .await?;
        if let Some(answer) = answer_stored(found) {
            return Ok(answer);
        }
        let claim = || {
            sqlx::query_scalar::<_, i64>(lite_floor::CLAIM)
                .bind(&key)
                .bind(lite_floor::now_ms())
        };
        let mut claimed = None;
        if GUARDED {
            claimed = claim().fetch_optional(&mut *conn).await?;
            if claimed.is_none() {
                return Ok((StatusCode::CONFLICT, Vec::new()));
            }
        }
        let mut tx = sqlx::Connection::begin_with(&mut *conn, "BEGIN IMMEDIATE").await?;
        if !GUARDED {
            claimed = claim().fetch_optional(&mut *tx).await?;
        }
        if claimed.is_none() {
            return Ok((StatusCode::CONFLICT, Vec::new()));
        }
        let payment = Sqlite::insert(&mut tx, &key, &new).await?;
        let out = serde_json::to_vec(&payment).unwrap_or_default();
        if GUARDED {
            match sqlx::raw_sql("BEGIN").execute(&mut *tx).await {
                Err(error) if lite_floor::in_transaction(&error) => {}
                _ => return Ok((StatusCode::INTERNAL_SERVER_ERROR, Vec::new())),
            }
        }
        sqlx::query(lite_floor::RECORD)
            .bind(&key)
            .bind(&out)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok((StatusCode::CREATED, out))
    })
    .await
}

/// The cached-response pattern: look up, run, store after the fact. Two requests
/// with one key that arrive together both miss, and both run.
async fn naive_cache<DB: idem_axum::Backend + Shop>(
    State(app): State<App<DB>>,
    headers: HeaderMap,
    json: axum::Json<NewPayment>,
) -> Response {
    let key = format!("idem:{}", key_of(&headers));
    match app.redis.command(&[b"GET", key.as_bytes()]).await {
        Ok(Some(cached)) => {
            return (
                StatusCode::CREATED,
                [("content-type", "application/json")],
                cached,
            )
                .into_response();
        }
        Ok(None) => {}
        Err(error) => return (StatusCode::SERVICE_UNAVAILABLE, error).into_response(),
    }
    let response = shop::pay::<DB>(State(app.pool.clone()), headers, json).await;
    let (parts, body) = response.into_parts();
    let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    if parts.status.is_success() {
        let _ = app
            .redis
            .command(&[b"SET", key.as_bytes(), &body, b"EX", b"86400"])
            .await;
    }
    Response::from_parts(parts, axum::body::Body::from(body))
}

async fn serve() -> Result<(), Box<dyn std::error::Error>> {
    match std::env::var("BACKEND").as_deref() {
        Ok("mysql") => {
            let size: u32 = std::env::var("POOL")?.parse()?;
            let _ = tracing::subscriber::set_global_default(shop::StatementCounter);
            let pool = MySqlPoolOptions::new()
                .max_connections(size)
                .min_connections(size)
                .connect(&std::env::var("DATABASE_URL")?)
                .await?;
            serve_on(
                pool,
                size as usize,
                vec![
                    ("hand-written", post(hand_written_mysql::<true>)),
                    ("hand-written-guarded", post(hand_written_guarded_mysql)),
                    ("hand-written-previous", post(hand_written_mysql::<false>)),
                    ("hand-written-minimal", post(minimal_mysql)),
                    ("hand-written-parts", post(parts_mysql)),
                    ("hand-written-row", post(row_mysql)),
                ],
            )
            .await
        }
        Ok("sqlite") => {
            let size: u32 = std::env::var("POOL")?.parse()?;
            let _ = tracing::subscriber::set_global_default(shop::StatementCounter);
            let options = SqliteConnectOptions::from_str(&std::env::var("DATABASE_URL")?)?
                .journal_mode(SqliteJournalMode::Wal)
                .synchronous(SqliteSynchronous::Normal)
                .busy_timeout(Duration::from_secs(30));
            let pool = SqlitePoolOptions::new()
                .max_connections(size)
                .min_connections(size)
                .connect_with(options)
                .await?;
            serve_on(
                pool,
                size as usize,
                vec![
                    ("hand-written", post(hand_written_sqlite::<false>)),
                    ("hand-written-guarded", post(hand_written_sqlite::<true>)),
                ],
            )
            .await
        }
        _ => {
            let (pool, size) = shop::pool_from_env().await?;
            let floors = vec![
                ("hand-written", post(hand_written::<true>)),
                ("hand-written-minimal", post(hand_written::<false>)),
                ("hand-written-guarded", post(hand_written_guarded)),
            ];
            serve_on(pool, size, floors).await
        }
    }
}

/// A backend's store settings from the bench's environment.
trait Tune: idem_axum::Backend {
    fn tune(builder: idem_axum::Builder<Self>) -> idem_axum::Builder<Self> {
        builder
    }
}

impl Tune for Postgres {}

impl Tune for MySql {
    /// `IDEM_BENCH_GALERA=1`: the cluster mode, also on a standalone server
    /// (on a Galera node it is on by itself); `=0`: never.
    fn tune(builder: idem_axum::Builder<Self>) -> idem_axum::Builder<Self> {
        match std::env::var("IDEM_BENCH_GALERA").as_deref() {
            Ok("1") => builder.galera(true),
            Ok("0") => builder.galera(false),
            _ => builder,
        }
    }
}

impl Tune for Sqlite {
    /// `IDEM_BENCH_SQLITE_DEFERRED=1`: the write lock at the handler's first write.
    fn tune(builder: idem_axum::Builder<Self>) -> idem_axum::Builder<Self> {
        if std::env::var_os("IDEM_BENCH_SQLITE_DEFERRED").is_some() {
            builder.write_lock_at_first_write()
        } else {
            builder
        }
    }
}

/// Serves the variant `VARIANT` asks for; `floors`: that backend's hand-written ones, by name.
async fn serve_on<DB: idem_axum::Backend + Shop + Tune>(
    pool: Pool<DB>,
    size: usize,
    floors: Vec<(&str, MethodRouter<App<DB>>)>,
) -> Result<(), Box<dyn std::error::Error>> {
    // `IDEM_BENCH_REPLAY_CACHE=0` (inherited from the bench) measures without it,
    // and so does the growth runs' `idem-uncached`.
    let variant = std::env::var("VARIANT")?;
    let mut idempotency = Idempotency::builder(pool.clone());
    if let Some(bytes) = std::env::var("IDEM_BENCH_REPLAY_CACHE")
        .ok()
        .and_then(|bytes| bytes.parse().ok())
    {
        idempotency = idempotency.replay_cache(bytes);
    }
    if variant == "idem-uncached" {
        idempotency = idempotency.replay_cache(0);
    }
    if variant.starts_with("idem-sealed") {
        let ring = KeyRing::from_keys([&[7; 32]])?;
        idempotency = idempotency.sealing(Sealing::On(ring));
    }
    if variant == "idem-sealed-uncached" {
        idempotency = idempotency.replay_cache(0);
    }
    let idempotency = DB::tune(idempotency);
    let app = App {
        idempotency: idempotency.build()?,
        pool,
        redis: Arc::new(Redis::new("127.0.0.1:6379", size)),
    };
    let handler = match variant.as_str() {
        "bare" => post(shop::pay::<DB>),
        floor if floor.starts_with("hand-written") => floors
            .into_iter()
            .find_map(|(name, handler)| (name == floor).then_some(handler))
            .ok_or("no such hand-written floor for this backend")?,
        "naive-cache" => post(naive_cache::<DB>),
        "static" => post(static_payment),
        _ => post(idem::<DB>),
    };
    let router = Router::new()
        .route("/payments", handler)
        .route("/counting", post(shop::counting))
        .route("/stats", get(shop::stats::<DB>))
        .route("/executions", get(shop::executions))
        .layer(axum::middleware::from_fn(shop::note_failures))
        .with_state(app);
    shop::serve(router).await
}

impl Shop for MySql {
    async fn insert(
        conn: &mut MySqlConnection,
        note: &str,
        new: &NewPayment,
    ) -> Result<Payment, sqlx::Error> {
        let done = sqlx::query("INSERT INTO payments (note, amount, currency) VALUES (?, ?, ?)")
            .bind(note)
            .bind(new.amount)
            .bind(&new.currency)
            .execute(conn)
            .await?;
        Ok(Payment::of(
            i64::try_from(done.last_insert_id()).unwrap_or(i64::MAX),
            new,
        ))
    }

    async fn counts(pool: &Pool<Self>) -> Result<(i64, i64), sqlx::Error> {
        sqlx::query_as(shop::COUNTS).fetch_one(pool).await
    }
}

impl Shop for Sqlite {
    async fn insert(
        conn: &mut SqliteConnection,
        note: &str,
        new: &NewPayment,
    ) -> Result<Payment, sqlx::Error> {
        let id = sqlx::query_scalar(
            "INSERT INTO payments (note, amount, currency) VALUES (?1, ?2, ?3) RETURNING id",
        )
        .bind(note)
        .bind(new.amount)
        .bind(&new.currency)
        .fetch_one(conn)
        .await?;
        Ok(Payment::of(id, new))
    }

    async fn counts(pool: &Pool<Self>) -> Result<(i64, i64), sqlx::Error> {
        sqlx::query_as(shop::COUNTS).fetch_one(pool).await
    }
}

// ---------------------------------------------------------------------------------
// Redis, by hand: GET and SET over RESP are all the pattern needs.

struct Redis {
    addr: &'static str,
    idle: Mutex<Vec<BufReader<TcpStream>>>,
}

impl Redis {
    fn new(addr: &'static str, size: usize) -> Self {
        Self {
            addr,
            idle: Mutex::new(Vec::with_capacity(size)),
        }
    }

    /// Runs one command; a bulk-string reply comes back as `Some`, nil as `None`.
    async fn command(&self, args: &[&[u8]]) -> Result<Option<Vec<u8>>, String> {
        let idle = self.idle.lock().await.pop();
        let mut conn = match idle {
            Some(conn) => conn,
            None => BufReader::new(
                TcpStream::connect(self.addr)
                    .await
                    .map_err(|e| e.to_string())?,
            ),
        };
        let mut out = format!("*{}\r\n", args.len()).into_bytes();
        for arg in args {
            out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
            out.extend_from_slice(arg);
            out.extend_from_slice(b"\r\n");
        }
        conn.get_mut()
            .write_all(&out)
            .await
            .map_err(|e| e.to_string())?;
        let mut line = String::new();
        conn.read_line(&mut line).await.map_err(|e| e.to_string())?;
        let reply = match line.as_bytes().first() {
            Some(b'$') => match line[1..].trim().parse::<i64>() {
                Ok(len) if len >= 0 => {
                    let mut value = vec![0; usize::try_from(len).unwrap_or(0) + 2];
                    conn.read_exact(&mut value)
                        .await
                        .map_err(|e| e.to_string())?;
                    value.truncate(value.len() - 2);
                    Some(value)
                }
                _ => None,
            },
            Some(b'+' | b':') => None,
            _ => return Err(format!("redis: {line}")),
        };
        self.idle.lock().await.push(conn);
        Ok(reply)
    }
}

// ---------------------------------------------------------------------------------
// The load

struct Settings {
    secs: u64,
    connections: usize,
    rounds: u64,
}

struct Server {
    child: std::process::Child,
    addr: String,
    /// The database server's port (a cluster's nodes each have their own).
    database_port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    async fn start(variant: &str, target: &Target, url: &str, schema: &str, pool: usize) -> Server {
        Self::start_counting(variant, target, url, schema, pool, false).await
    }

    /// As [`Server::start`]; `count_executions` has the handlers count their
    /// executions per key (`GET /executions`), as the storms need.
    async fn start_counting(
        variant: &str,
        target: &Target,
        url: &str,
        schema: &str,
        pool: usize,
        count_executions: bool,
    ) -> Server {
        let exe = if variant == "peer" {
            peer_exe()
        } else {
            std::env::current_exe().expect("bench exe")
        };
        let mut child = std::process::Command::new(exe)
            .env(ROLE, "server")
            .env("VARIANT", variant)
            .env("BACKEND", target.name())
            .env("DATABASE_URL", url)
            .env("SCHEMA", schema)
            .env("POOL", pool.to_string())
            .env(
                "IDEM_BENCH_COUNT_EXECUTIONS",
                if count_executions { "1" } else { "0" },
            )
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("server process");
        let stdout = child.stdout.take().expect("stdout");
        let stdout = tokio::process::ChildStdout::from_std(stdout).expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let first = lines
            .next_line()
            .await
            .expect("read")
            .expect("the server exited");
        let addr = first.split("http://").nth(1).expect("address").to_owned();
        // `scheme://user@host:port/database`: the port, if the URL names one.
        let database_port = url
            .split_once("://")
            .map_or("", |(_, rest)| rest)
            .split('/')
            .next()
            .and_then(|authority| authority.rsplit_once(':'))
            .and_then(|(_, port)| port.parse().ok())
            .unwrap_or(0);
        Server {
            child,
            addr,
            database_port,
        }
    }

    /// CPU seconds the process has used (user + system).
    fn cpu_seconds(&self) -> f64 {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap_or_default();
        stat_cpu_seconds(stat.rsplit_once(')').map_or("", |(_, rest)| rest))
    }

    /// Data segments the process has sent to its database server and Redis, by
    /// the kernel's count (`ss`): a client flushes each request whole, so one per
    /// round trip. SQLite runs in the process: none.
    fn segments_out(&self) -> u64 {
        let ports = format!("( dport = :{} or dport = :6379 )", self.database_port);
        let Ok(out) = std::process::Command::new("ss")
            .args(["-tinpH", &ports])
            .output()
        else {
            return 0;
        };
        let text = String::from_utf8_lossy(&out.stdout);
        let owner = format!("pid={},", self.child.id());
        let mut total = 0;
        let mut ours = false;
        for line in text.lines() {
            if line.contains("users:(") {
                ours = line.contains(&owner);
            } else if ours {
                total += line
                    .split_whitespace()
                    .find_map(|f| f.strip_prefix("data_segs_out:"))
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0);
            }
        }
        total
    }

    /// Peak resident set, MiB.
    fn peak_rss_mib(&self) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|kb| kb.parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    }
}

/// User + system CPU seconds from the fields of `/proc/<pid>/stat` after the
/// command name (utime and stime are the 12th and 13th there).
fn stat_cpu_seconds(after_comm: &str) -> f64 {
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

/// One keep-alive HTTP/1.1 connection.
struct Conn {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    /// The session the peer variant's clients share.
    cookie: Option<http::HeaderValue>,
}

impl Conn {
    async fn open(addr: &str) -> Conn {
        let stream = TcpStream::connect(addr).await.expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .expect("handshake");
        tokio::spawn(connection);
        Conn {
            sender,
            cookie: None,
        }
    }

    async fn get(&mut self, path: &str) -> http::Response<hyper::body::Incoming> {
        let request = http::Request::get(path)
            .header("host", "bench")
            .body(Full::new(Bytes::new()))
            .expect("request");
        self.sender.ready().await.expect("ready");
        self.sender.send_request(request).await.expect("response")
    }

    /// Opens a session on the peer's server (`GET /session`); later requests carry it.
    async fn open_session(&mut self) {
        let response = self.get("/session").await;
        let cookie = response
            .headers()
            .get("set-cookie")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .and_then(|v| http::HeaderValue::from_str(v).ok());
        assert!(cookie.is_some(), "the peer's server opened no session");
        self.cookie = cookie;
    }

    async fn post(&mut self, path: &str, key: Option<&str>, body: &'static str) -> (u16, Bytes) {
        let mut request = http::Request::post(path)
            .header("host", "bench")
            .header("content-type", "application/json");
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        if let Some(cookie) = &self.cookie {
            request = request.header("cookie", cookie);
        }
        let request = request
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .expect("request");
        self.sender.ready().await.expect("ready");
        let response = self.sender.send_request(request).await.expect("response");
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        (status, body)
    }
}

/// The peer crate's server (`benches/peer`), where its build puts it.
fn peer_exe() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/release/idem-bench-peer")
}

/// Which key request `n` of a variant carries; `run` keeps keys apart across runs
/// (Redis outlives them).
fn key_for(run: &str, variant: &str, n: u64, replay_keys: u64) -> Option<String> {
    match variant {
        "bare" => None,
        "idem-replay" | "idem-replay-uncached" | "idem-replay-sealed" | "static" => {
            Some(format!("{run}-replay-{}", n % replay_keys))
        }
        // Each stored key once, by an instance that has not seen it.
        "idem-replay-cold" => Some(format!("{run}-replay-{n}")),
        "idem-storm" | "naive-cache-storm" | "axum-idempotent-storm" => {
            Some(format!("{run}-storm-{}", n / STORM_DUPLICATES))
        }
        _ => Some(format!("{run}-first-{n}")),
    }
}

/// One variant's load: connections that each send one request at a time,
/// keyed as `variant` wants, from `warm_until` on counted, until `until`. With
/// several servers (instances on the nodes of a cluster), each connection holds
/// one to each and sends request `n` to server `n` mod their number, so that a
/// storm's duplicates of a key reach every instance.
struct Load {
    addrs: Vec<String>,
    run: String,
    variant: &'static str,
    replay_keys: u64,
    /// The session the peer variant's clients share.
    cookie: Option<http::HeaderValue>,
}

/// What one connection of a load saw: latencies and statuses after the warm-up.
type Seen = (Vec<Duration>, HashMap<u16, u64>);

impl Load {
    fn start(
        &self,
        connections: usize,
        counter: &Arc<AtomicU64>,
        warm_until: Instant,
        until: Instant,
    ) -> Vec<tokio::task::JoinHandle<Seen>> {
        (0..connections)
            .map(|_| {
                let (counter, addrs, run) =
                    (Arc::clone(counter), self.addrs.clone(), self.run.clone());
                let (variant, replay_keys, cookie) =
                    (self.variant, self.replay_keys, self.cookie.clone());
                tokio::spawn(async move {
                    let mut conns = Vec::with_capacity(addrs.len());
                    for addr in &addrs {
                        let mut conn = Conn::open(addr).await;
                        conn.cookie.clone_from(&cookie);
                        conns.push(conn);
                    }
                    let mut latencies = Vec::new();
                    let mut statuses: HashMap<u16, u64> = HashMap::new();
                    loop {
                        let started = Instant::now();
                        if started >= until {
                            break;
                        }
                        let n = counter.fetch_add(1, Ordering::Relaxed);
                        let key = key_for(&run, variant, n, replay_keys);
                        let to = (n % conns.len() as u64) as usize;
                        let conn = &mut conns[to];
                        let (status, body) = conn.post("/payments", key.as_deref(), BODY).await;
                        if status >= 500 && std::env::var_os("IDEM_BENCH_SHOW_ERRORS").is_some() {
                            let body = String::from_utf8_lossy(&body);
                            eprintln!("{variant} {key:?}: {status} {body}");
                        }
                        if started >= warm_until {
                            latencies.push(started.elapsed());
                            *statuses.entry(status).or_default() += 1;
                        }
                    }
                    (latencies, statuses)
                })
            })
            .collect()
    }

    async fn finish(workers: Vec<tokio::task::JoinHandle<Seen>>) -> Seen {
        let mut all = Vec::new();
        let mut statuses: HashMap<u16, u64> = HashMap::new();
        for worker in workers {
            let (latencies, seen) = worker.await.expect("worker");
            all.extend(latencies);
            for (status, n) in seen {
                *statuses.entry(status).or_default() += n;
            }
        }
        (all, statuses)
    }
}

struct Row {
    variant: &'static str,
    prefill: u64,
    /// Rows in the key table at the end, and its size with indexes per million.
    keys: i64,
    mib_per_million: Option<f64>,
    requests: u64,
    rate: f64,
    p50: Duration,
    p99: Duration,
    cpu_us: f64,
    /// The database server's CPU per request (not on SQLite).
    db_cpu_us: Option<f64>,
    rss_mib: f64,
    statements: f64,
    round_trips: f64,
    statuses: HashMap<u16, u64>,
    doubled: Option<i64>,
    /// Storm keys run again after a 5xx told their client that nothing was
    /// committed (on a cluster, a transaction another node's write aborted).
    rerun: u64,
    /// Requests/s relative to `bare` in the same round.
    ratio: f64,
    /// Served with the replay cache off.
    uncached: bool,
}

async fn run_variant(
    settings: &Settings,
    variant: &'static str,
    serves: &'static str,
    target: &Target,
    prefill: u64,
    round: u64,
) -> Row {
    let schema = format!(
        "idem_bench_http_{}_{}_{}_{prefill}_{round}",
        std::process::id(),
        target.name(),
        variant.replace('-', "_")
    );
    let cold = variant == "idem-replay-cold";
    // Enough stored keys for every request of the run to replay one of its own.
    let stored = if cold {
        prefill.max(settings.secs * 50_000 + 20_000)
    } else {
        prefill
    };
    let url = target.prepare(&schema, stored).await;
    let on = Run {
        url: &url,
        schema: &schema,
        tag: &schema,
        stored,
        first_key: 0,
    };
    let mut row = measure(settings, variant, serves, target, &on).await;
    row.prefill = prefill;
    target.drop_run(&schema).await;
    row
}

/// Where a measured run goes: its server's database, the schema (or database,
/// or file) holding `stored` completed keys, the tag its new keys carry, and the
/// first stored key its replays send (runs that share a table replay keys of
/// their own).
struct Run<'a> {
    url: &'a str,
    schema: &'a str,
    tag: &'a str,
    stored: u64,
    first_key: u64,
}

/// One variant's run on `on`, served as `serves` says: a server of its own, a
/// short counted pass, then the load.
async fn measure(
    settings: &Settings,
    variant: &'static str,
    serves: &'static str,
    target: &Target,
    on: &Run<'_>,
) -> Row {
    let Run {
        url,
        schema,
        tag,
        stored,
        first_key,
    } = *on;
    let cold = variant == "idem-replay-cold";
    // What the last run left the server to do (its dropped database, purge) is not
    // this one's to pay for.
    target.settle().await;
    let storm = variant.ends_with("storm");
    let start = |url: String| async move {
        Server::start_counting(serves, target, &url, schema, settings.connections, storm).await
    };
    // On a cluster, a second instance through its second server; the first
    // takes the counted pass, the load goes to both.
    let mut servers = vec![start(url.to_owned()).await];
    if let Some(second) = target.second_url(schema) {
        servers.push(start(second).await);
    }
    let server = &servers[0];
    let path = "/payments";
    // One session for all of the peer's clients, as for one user's retries.
    let cookie = if serves == "peer" {
        let mut conn = Conn::open(&server.addr).await;
        conn.open_session().await;
        conn.cookie
    } else {
        None
    };

    // Keys to replay, completed beforehand.
    let replay_keys = if stored > 0 { stored } else { 1000 };
    if variant.starts_with("idem-replay") && !variant.ends_with("-cold") && stored == 0 {
        let mut conn = Conn::open(&server.addr).await;
        for n in 0..replay_keys {
            let key = key_for(schema, variant, n, replay_keys);
            conn.post(path, key.as_deref(), BODY).await;
        }
    }

    // Statements per request, from a short counted pass on keys of its own.
    let mut conn = Conn::open(&server.addr).await;
    conn.cookie.clone_from(&cookie);
    conn.post("/counting", None, "on").await;
    let segments_before = server.segments_out();
    let sample = 200;
    for n in 0..sample {
        // Replays replay the keys above; the rest use keys of the pass's own.
        let run = if variant.contains("-replay") {
            schema.to_owned()
        } else {
            format!("{tag}-count")
        };
        let key = key_for(&run, variant, n, replay_keys);
        conn.post(path, key.as_deref(), BODY).await;
    }
    // The pool checks a released connection in a task of its own: let the last finish.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let segments = server.segments_out().saturating_sub(segments_before);
    let (_, counted) = conn.post("/counting", None, "off").await;
    let round_trips = segments as f64 / sample as f64;
    let statements = String::from_utf8_lossy(&counted)
        .parse::<f64>()
        .unwrap_or(0.0)
        / sample as f64;

    // The cold replays' counted pass used the first keys.
    let counter = Arc::new(AtomicU64::new(first_key + if cold { sample } else { 0 }));
    let warm_until = Instant::now() + Duration::from_secs(1);
    let until = warm_until + Duration::from_secs(settings.secs);
    let load = Load {
        addrs: servers.iter().map(|server| server.addr.clone()).collect(),
        run: if variant.contains("-replay") {
            schema.to_owned()
        } else {
            tag.to_owned()
        },
        variant,
        replay_keys,
        cookie: cookie.clone(),
    };
    let workers = load.start(settings.connections, &counter, warm_until, until);
    let cpu_seconds = || servers.iter().map(Server::cpu_seconds).sum::<f64>();
    tokio::time::sleep_until(warm_until.into()).await;
    let cpu_start = cpu_seconds();
    let db_cpu_start = target.database_cpu_seconds();
    tokio::time::sleep_until(until.into()).await;
    let cpu_used = cpu_seconds() - cpu_start;
    let db_cpu_used = db_cpu_start
        .zip(target.database_cpu_seconds())
        .map(|(start, end)| end - start);
    let (mut all, statuses) = Load::finish(workers).await;
    all.sort();
    let pick = |q: f64| all[((all.len() as f64 * q) as usize).min(all.len().saturating_sub(1))];
    let requests = all.len() as u64;
    let (doubled, rerun) = if storm {
        let (doubled, rerun) = keys_run_twice(&servers).await;
        (Some(doubled), rerun)
    } else {
        (None, 0)
    };
    let (bytes, keys) = target.inspect(schema).await;
    if cold && u64::try_from(keys).unwrap_or(0) > stored {
        eprintln!("{variant}: ran out of stored keys; the table grew to {keys}");
    }
    let row = Row {
        variant,
        prefill: stored,
        keys,
        mib_per_million: bytes
            .filter(|_| keys > 0)
            .map(|bytes| bytes as f64 / 1_048_576.0 / keys as f64 * 1e6),
        requests,
        rate: requests as f64 / settings.secs as f64,
        p50: pick(0.5),
        p99: pick(0.99),
        cpu_us: cpu_used * 1e6 / requests.max(1) as f64,
        db_cpu_us: db_cpu_used.map(|used| used * 1e6 / requests.max(1) as f64),
        rss_mib: servers.iter().map(Server::peak_rss_mib).fold(0.0, f64::max),
        statements,
        round_trips,
        statuses,
        doubled,
        rerun,
        ratio: 1.0,
        uncached: serves == "idem-uncached",
    };
    drop(servers);
    row
}

/// Keys a storm ran more than once: by the handlers' executions on every
/// instance, or by the business rows written twice, whichever shows more; and
/// apart, keys run again only after a 5xx (nothing committed, retry: a
/// transaction another node's write aborted, on a cluster), each execution
/// after the first begun after a 5xx for the key that followed the one before.
async fn keys_run_twice(servers: &[Server]) -> (i64, u64) {
    async fn text(addr: &str, path: &str) -> String {
        let response = Conn::open(addr).await.get(path).await;
        let body = response.into_body().collect().await.expect("body");
        String::from_utf8_lossy(&body.to_bytes()).into_owned()
    }
    // Per key, (µs, ran) for every execution (`true`) and 5xx answer.
    let mut events: HashMap<String, Vec<(u128, bool)>> = HashMap::new();
    for server in servers {
        for line in text(&server.addr, "/executions").await.lines() {
            let mut fields = line.split(' ');
            let (Some(event), Some(key), Some(Ok(at))) =
                (fields.next(), fields.next(), fields.next().map(str::parse))
            else {
                continue;
            };
            events
                .entry(key.to_owned())
                .or_default()
                .push((at, event == "ran"));
        }
    }
    let (mut twice, mut rerun) = (0, 0);
    for events in events.values_mut() {
        events.sort_unstable();
        let runs = events.iter().filter(|(_, ran)| *ran).count();
        if runs < 2 {
            continue;
        }
        // Between two executions, a 5xx must have been answered.
        let mut failed_since_run = true;
        let mut clean = true;
        for &(_, ran) in events.iter().skip_while(|(_, ran)| !ran) {
            if ran {
                clean &= failed_since_run;
                failed_since_run = false;
            } else {
                failed_since_run = true;
            }
        }
        if clean {
            rerun += 1;
        } else {
            twice += 1;
        }
    }
    // One database behind every instance: any of them counts its rows.
    let rows_twice: i64 = text(&servers[0].addr, "/stats")
        .await
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    (rows_twice.max(twice), rerun)
}

/// A database the bench runs on, and how it gives each run one of its own: a
/// schema on PostgreSQL, a database on MySQL/MariaDB, a file on SQLite.
enum Target {
    Postgres {
        url: String,
        admin: PgPool,
    },
    /// `second`: a second server of the same cluster (`IDEM_BENCH_MYSQL_SECOND_URL`),
    /// where every variant gets a second instance.
    MySql {
        url: String,
        admin: MySqlPool,
        second: Option<String>,
    },
    Sqlite {
        dir: std::path::PathBuf,
    },
}

impl Target {
    fn name(&self) -> &'static str {
        match self {
            Self::Postgres { .. } => "postgres",
            Self::MySql { .. } => "mysql",
            Self::Sqlite { .. } => "sqlite",
        }
    }

    fn label(&self) -> &'static str {
        match self {
            Self::Postgres { .. } => "PostgreSQL",
            Self::MySql { .. } => "MySQL/MariaDB",
            Self::Sqlite { .. } => "SQLite",
        }
    }

    /// CPU seconds (user + system) the database server's processes on this machine
    /// have used; `None` on SQLite, which runs inside the server process.
    fn database_cpu_seconds(&self) -> Option<f64> {
        let names: &[&str] = match self {
            Self::Postgres { .. } => &["postgres"],
            Self::MySql { .. } => &["mariadbd", "mysqld"],
            Self::Sqlite { .. } => return None,
        };
        let mut total = 0.0;
        for entry in std::fs::read_dir("/proc").ok()?.flatten() {
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            let Some((head, rest)) = stat.rsplit_once(')') else {
                continue;
            };
            let comm = head.split_once('(').map_or("", |(_, comm)| comm);
            if names.contains(&comm) {
                total += stat_cpu_seconds(rest);
            }
        }
        Some(total)
    }

    /// Waits, up to 5 s, until the database server is idle: under 5% of a core
    /// for a quarter of a second.
    async fn settle(&self) {
        let quarter = Duration::from_millis(250);
        let give_up = Instant::now() + Duration::from_secs(5);
        while let Some(before) = self.database_cpu_seconds() {
            tokio::time::sleep(quarter).await;
            let used = self.database_cpu_seconds().unwrap_or(before) - before;
            if used < 0.05 * quarter.as_secs_f64() || Instant::now() >= give_up {
                break;
            }
        }
    }

    /// `Err` when the server cannot be reached (the caller says so).
    async fn connect(name: &str) -> Result<Self, String> {
        match name {
            "postgres" => {
                let url = std::env::var("IDEM_TEST_POSTGRES_URL")
                    .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
                let admin = PgPoolOptions::new()
                    .max_connections(1)
                    .connect(&url)
                    .await
                    .map_err(|e| format!("PostgreSQL not reachable at {url}: {e}"))?;
                Ok(Self::Postgres { url, admin })
            }
            "mysql" => {
                let url = std::env::var("IDEM_TEST_MYSQL_URL")
                    .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
                let admin = MySqlPoolOptions::new()
                    .max_connections(1)
                    .connect(&url)
                    .await
                    .map_err(|e| format!("MySQL not reachable at {url}: {e}"))?;
                let second = std::env::var("IDEM_BENCH_MYSQL_SECOND_URL").ok();
                Ok(Self::MySql { url, admin, second })
            }
            "sqlite" => Ok(Self::Sqlite {
                dir: std::env::temp_dir(),
            }),
            other => Err(format!("unknown backend {other:?}")),
        }
    }

    /// Creates the run's schema, database or file with the business table and the
    /// key table, `stored` completed keys in it (PostgreSQL only); the URL its
    /// server connects to.
    async fn prepare(&self, schema: &str, stored: u64) -> String {
        let payments = "CREATE TABLE payments (id {id}, note TEXT NOT NULL, amount BIGINT NOT NULL, \
             currency TEXT NOT NULL)";
        match self {
            Self::Postgres { url, admin } => {
                create_schema(admin, schema).await;
                let migration = idem_axum::Idempotency::new(admin.clone()).migration_sql();
                sqlx::raw_sql(AssertSqlSafe(format!(
                    "SET search_path = {schema}; {migration}"
                )))
                .execute(admin)
                .await
                .expect("migrate");
                if stored > 0 {
                    prefill(admin, schema, stored).await;
                }
                url.clone()
            }
            Self::MySql { url, admin, .. } => {
                assert_eq!(stored, 0, "stored keys are prefilled on PostgreSQL only");
                sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {schema}")))
                    .execute(admin)
                    .await
                    .expect("database");
                let url = match url.rsplit_once('/') {
                    Some((server, _)) => format!("{server}/{schema}"),
                    None => format!("{url}/{schema}"),
                };
                let pool = MySqlPoolOptions::new()
                    .max_connections(1)
                    .connect(&url)
                    .await
                    .expect("the run's database");
                let create = payments.replace("{id}", "BIGINT AUTO_INCREMENT PRIMARY KEY");
                sqlx::raw_sql(AssertSqlSafe(create))
                    .execute(&pool)
                    .await
                    .expect("payments");
                Idempotency::new(pool.clone())
                    .migrate()
                    .await
                    .expect("migrate");
                pool.close().await;
                url
            }
            Self::Sqlite { dir } => {
                assert_eq!(stored, 0, "stored keys are prefilled on PostgreSQL only");
                let file = dir.join(format!("{schema}.db"));
                let options = SqliteConnectOptions::new()
                    .filename(&file)
                    .create_if_missing(true)
                    .journal_mode(SqliteJournalMode::Wal);
                let pool = SqlitePoolOptions::new()
                    .max_connections(1)
                    .connect_with(options)
                    .await
                    .expect("the run's file");
                let create = payments.replace("{id}", "INTEGER PRIMARY KEY AUTOINCREMENT");
                sqlx::raw_sql(AssertSqlSafe(create))
                    .execute(&pool)
                    .await
                    .expect("payments");
                Idempotency::new(pool.clone())
                    .migrate()
                    .await
                    .expect("migrate");
                pool.close().await;
                format!("sqlite://{}", file.display())
            }
        }
    }

    /// Vacuums and analyzes the run's key table (PostgreSQL only: the others are
    /// never prefilled).
    async fn vacuum(&self, schema: &str) {
        if let Self::Postgres { admin, .. } = self {
            // One statement each: a text of several is one transaction, which
            // VACUUM refuses.
            for statement in [
                format!("VACUUM (ANALYZE) {schema}.idempotency_keys"),
                "CHECKPOINT".to_owned(),
            ] {
                sqlx::raw_sql(AssertSqlSafe(statement))
                    .execute(admin)
                    .await
                    .expect("vacuum");
            }
        }
    }

    /// The run's database through the cluster's second server, when there is one.
    fn second_url(&self, schema: &str) -> Option<String> {
        let Self::MySql {
            second: Some(second),
            ..
        } = self
        else {
            return None;
        };
        let server = second
            .rsplit_once('/')
            .map_or(second.as_str(), |(server, _)| server);
        Some(format!("{server}/{schema}"))
    }

    /// The key table's size in bytes with its indexes (not on SQLite), and its rows.
    async fn inspect(&self, schema: &str) -> (Option<i64>, i64) {
        match self {
            Self::Postgres { admin, .. } => {
                let (bytes, keys): (i64, i64) = sqlx::query_as(AssertSqlSafe(format!(
                    "SELECT pg_total_relation_size('{schema}.idempotency_keys'), \
                            (SELECT count(*) FROM {schema}.idempotency_keys)"
                )))
                .fetch_one(admin)
                .await
                .unwrap_or((0, 0));
                (Some(bytes), keys)
            }
            Self::MySql { admin, .. } => {
                let keys: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
                    "SELECT count(*) FROM {schema}.idempotency_keys"
                )))
                .fetch_one(admin)
                .await
                .unwrap_or(0);
                (None, keys)
            }
            Self::Sqlite { dir } => {
                let file = dir.join(format!("{schema}.db"));
                let options = SqliteConnectOptions::new().filename(&file);
                let Ok(pool) = SqlitePoolOptions::new().connect_with(options).await else {
                    return (None, 0);
                };
                let keys: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
                    .fetch_one(&pool)
                    .await
                    .unwrap_or(0);
                pool.close().await;
                (None, keys)
            }
        }
    }

    async fn drop_run(&self, schema: &str) {
        match self {
            Self::Postgres { admin, .. } => {
                let _ = sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
                    .execute(admin)
                    .await;
            }
            Self::MySql { admin, .. } => {
                let _ = sqlx::raw_sql(AssertSqlSafe(format!("DROP DATABASE {schema}")))
                    .execute(admin)
                    .await;
            }
            Self::Sqlite { dir } => {
                for suffix in ["", "-wal", "-shm"] {
                    let _ = std::fs::remove_file(dir.join(format!("{schema}.db{suffix}")));
                }
            }
        }
    }
}

/// Completed keys already in the table, written by no server: the ones the
/// growth runs and `idem-replay-cold` replay.
async fn prefill(admin: &PgPool, schema: &str, stored: u64) {
    let response = br#"{"id":1,"amount":100,"currency":"JPY"}"#;
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {schema}.idempotency_keys (scope, idempotency_key, state, lease, method, \
             path, fingerprint, status, headers, body, locked_until, expires_at, created_at) \
         SELECT '', $1 || g, 'completed', g, 'POST', '/payments', $2, 201, \
             'content-type: application/json\r\n'::bytea, $3, now(), \
             now() + interval '1 day', now() \
         FROM generate_series(0, $4 - 1) AS g"
    )))
    .bind(format!("{schema}-replay-"))
    .bind(&idem_axum::fingerprint(BODY.as_bytes())[..])
    .bind(&response[..])
    .bind(i64::try_from(stored).unwrap_or(i64::MAX))
    .execute(admin)
    .await
    .expect("prefill");
    sqlx::raw_sql(AssertSqlSafe(format!("ANALYZE {schema}.idempotency_keys")))
        .execute(admin)
        .await
        .expect("analyze");
}

/// A fresh schema holding the business table, for one run. Open to every role, as
/// the `public` schema is, so that idem records through its record function;
/// `IDEM_BENCH_PRIVATE_SCHEMA=1` closes it, and idem sends the two statements.
async fn create_schema(admin: &PgPool, schema: &str) {
    let open = if std::env::var("IDEM_BENCH_PRIVATE_SCHEMA").is_ok_and(|v| v == "1") {
        String::new()
    } else {
        format!("GRANT USAGE ON SCHEMA {schema} TO PUBLIC; ")
    };
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE SCHEMA {schema}; {open}SET search_path = {schema}; \
         CREATE TABLE payments (id BIGSERIAL PRIMARY KEY, note TEXT NOT NULL, amount BIGINT NOT NULL, currency TEXT NOT NULL);"
    )))
    .execute(admin)
    .await
    .expect("schema");
}

/// The bare transaction (BEGIN; the INSERT; COMMIT) driven by `pgbench` over the
/// simple protocol with as many clients: what PostgreSQL alone does on this machine.
/// `None` when pgbench is not installed.
async fn pgbench(settings: &Settings, url: &str, admin: &PgPool) -> Option<f64> {
    let schema = format!("idem_bench_http_{}_pgbench", std::process::id());
    create_schema(admin, &schema).await;
    let script = std::env::temp_dir().join(format!("{schema}.sql"));
    let written = std::fs::write(
        &script,
        "\\set n random(1, 1000000000)\nBEGIN;\n\
         INSERT INTO payments (note, amount, currency) VALUES ('pgbench-' || :n, 100, 'JPY') RETURNING id;\n\
         COMMIT;\n",
    );
    let clients = settings.connections.to_string();
    let secs = (settings.secs + 1).to_string();
    let ran = written.ok().and_then(|()| {
        std::process::Command::new("pgbench")
            .args([
                "-n", "-M", "simple", "-c", &clients, "-j", "2", "-T", &secs, "-f",
            ])
            .arg(&script)
            .arg(url)
            .env("PGOPTIONS", format!("-c search_path={schema}"))
            .output()
            .ok()
    });
    let _ = std::fs::remove_file(&script);
    let _ = sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(admin)
        .await;
    let out = String::from_utf8_lossy(&ran?.stdout).into_owned();
    out.lines()
        .find_map(|l| l.strip_prefix("tps = "))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// idem-first and idem-replay with 10^4, 10^6 and 10^7 completed keys in the table
/// (bulk-loaded in one `INSERT … SELECT` over `generate_series`, then vacuumed so
/// that no run pays for setting the rows' hint bits), each with the replay cache
/// on and off. Every size's table is loaded once and shared by its runs, which
/// alternate in rounds (cache on first, then off first), each replaying stored
/// keys no earlier run read.
async fn growth(settings: &Settings, target: &Target) {
    let mut rows = Vec::new();
    let variants = [
        ("idem-first", "idem"),
        ("idem-first", "idem-uncached"),
        ("idem-replay", "idem"),
        ("idem-replay", "idem-uncached"),
    ];
    for prefill in [10_000_u64, 1_000_000, 10_000_000] {
        let schema = format!(
            "idem_bench_http_{}_{}_growth_{prefill}",
            std::process::id(),
            target.name()
        );
        let url = target.prepare(&schema, prefill).await;
        target.vacuum(&schema).await;
        let runs = settings.rounds * variants.len() as u64;
        let mut run = 0;
        for round in 0..settings.rounds {
            // Pairs of one variant with the cache on and off, in either order.
            for pair in variants.chunks(2) {
                let order: Vec<_> = if round % 2 == 0 {
                    pair.iter().collect()
                } else {
                    pair.iter().rev().collect()
                };
                for &(variant, serves) in order {
                    let tag = format!("{schema}-{run}");
                    let on = Run {
                        url: &url,
                        schema: &schema,
                        tag: &tag,
                        stored: prefill,
                        first_key: prefill / runs * run,
                    };
                    let mut row = measure(settings, variant, serves, target, &on).await;
                    row.prefill = prefill;
                    rows.push((round, row));
                    run += 1;
                }
            }
        }
        target.drop_run(&schema).await;
    }
    println!(
        "\nGrowth: the same load with completed keys already in the table, the replay cache on and off, {} round(s)\n",
        settings.rounds
    );
    println!(
        "| keys before | variant | cache | round | req/s | × cache off, same round | p50 ms | p99 ms | keys after | table + indexes, bytes per key |"
    );
    println!("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (round, row) in &rows {
        let off = rows
            .iter()
            .find(|(r, other)| {
                r == round
                    && other.uncached
                    && other.prefill == row.prefill
                    && other.variant == row.variant
            })
            .map_or(row.rate, |(_, other)| other.rate);
        println!(
            "| {} | {} | {} | {round} | {:.0} | {:.2} | {:.2} | {:.2} | {} | {:.0} |",
            row.prefill,
            row.variant,
            if row.uncached { "off" } else { "on" },
            row.rate,
            row.rate / off,
            row.p50.as_secs_f64() * 1e3,
            row.p99.as_secs_f64() * 1e3,
            row.keys,
            row.mib_per_million.unwrap_or(0.0) * 1_048_576.0 / 1e6,
        );
    }
}

/// Every row as JSON, one object per backend and variant.
fn json(backend: &str, rows: &[Row]) -> String {
    let rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|row| {
            serde_json::json!({
                "backend": backend,
                "variant": row.variant,
                "req_s": (row.rate * 10.0).round() / 10.0,
                "x_bare": (row.ratio * 1000.0).round() / 1000.0,
                "p50_ms": (row.p50.as_secs_f64() * 1e5).round() / 100.0,
                "p99_ms": (row.p99.as_secs_f64() * 1e5).round() / 100.0,
                "keys_run_twice": row.doubled,
                "keys_rerun_after_5xx": row.doubled.map(|_| row.rerun),
                "server_cpu_us": row.cpu_us.round(),
                "database_cpu_us": row.db_cpu_us.map(f64::round),
            })
        })
        .collect();
    serde_json::to_string_pretty(&rows).unwrap_or_default()
}

/// Requests/s as a multiple of `bare`, one group of bars per backend; a variant
/// that ran keys twice is drawn red and says how many, since its speed was bought
/// with double charges. Every label stays inside the picture.
fn chart(groups: &[(&str, &[Row])]) -> String {
    let max = groups
        .iter()
        .flat_map(|(_, rows)| rows.iter())
        .map(|r| r.ratio)
        .fold(1.0, f64::max);
    let (bar, gap, head) = (24.0, 8.0, 30.0);
    let (left, width, label) = (190.0, 420.0, 290.0);
    let bars: usize = groups.iter().map(|(_, rows)| rows.len()).sum();
    let height = 40.0 + groups.len() as f64 * head + bars as f64 * (bar + gap) + 20.0;
    let total = left + width + label;
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{total}\" height=\"{height}\" \
         viewBox=\"0 0 {total} {height}\" font-family=\"sans-serif\" font-size=\"13\">\n\
         <text x=\"10\" y=\"22\" font-weight=\"bold\">idem over HTTP: requests/s as a multiple of bare (1.0, dashed)</text>\n"
    );
    let one = left + width / max;
    let mut y = 40.0;
    for (backend, rows) in groups {
        svg.push_str(&format!(
            "<text x=\"10\" y=\"{:.1}\" font-weight=\"bold\">{backend}</text>\n",
            y + 18.0
        ));
        let top = y + head;
        y = top;
        for row in *rows {
            let w = (row.ratio / max * width).max(1.0);
            let doubled = row.doubled.unwrap_or(0);
            let (fill, note) = if doubled > 0 {
                ("#c0392b", format!(" ({doubled} keys run twice)"))
            } else {
                ("#3b6ea8", String::new())
            };
            let text_y = y + bar * 0.68;
            svg.push_str(&format!(
                "<text x=\"10\" y=\"{text_y:.1}\">{}</text>\
                 <rect x=\"{left}\" y=\"{y:.1}\" width=\"{w:.1}\" height=\"{bar}\" fill=\"{fill}\"/>\
                 <text x=\"{:.1}\" y=\"{text_y:.1}\">×{:.2}, {:.0}/s{note}</text>\n",
                row.variant,
                left + w + 6.0,
                row.ratio,
                row.rate,
            ));
            y += bar + gap;
        }
        svg.push_str(&format!(
            "<line x1=\"{one:.1}\" y1=\"{top:.1}\" x2=\"{one:.1}\" y2=\"{:.1}\" stroke=\"#333\" stroke-dasharray=\"4 3\"/>\n",
            y - gap
        ));
    }
    svg.push_str("</svg>\n");
    svg
}

fn main() {
    if std::env::var_os(ROLE).is_some() {
        let runtime = tokio::runtime::Runtime::new().expect("runtime");
        if let Err(error) = runtime.block_on(serve()) {
            eprintln!("server: {error}");
            std::process::exit(1);
        }
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    let full = args.iter().any(|a| a == "--bench");
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse::<u64>().ok())
    };
    let settings = Settings {
        secs: flag("--secs").unwrap_or(if full { 5 } else { 1 }),
        connections: flag("--connections").map_or(if full { 32 } else { 4 }, |c| c as usize),
        rounds: flag("--rounds").unwrap_or(if full { 3 } else { 1 }).max(1),
    };
    let backends: Vec<String> = args
        .iter()
        .position(|a| a == "--backends")
        .and_then(|i| args.get(i + 1))
        .map_or("postgres,mysql,sqlite", String::as_str)
        .split(',')
        .map(str::to_owned)
        .collect();
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
        let mut groups: Vec<(&'static str, Vec<Row>)> = Vec::new();
        let mut json_rows = Vec::new();
        let mut doubled_storms = 0;
        for backend in &backends {
            let target = match Target::connect(backend).await {
                Ok(target) => target,
                Err(error) => {
                    assert!(!ci, "{error}");
                    eprintln!("{error}: skipped");
                    continue;
                }
            };
            if args.iter().any(|a| a == "--ceiling") {
                let together = args.iter().any(|a| a == "--together");
                ceiling(&settings, &target, together).await;
                continue;
            }
            if let Some(pair) = args
                .iter()
                .position(|a| a == "--paired")
                .and_then(|i| args.get(i + 1))
            {
                paired(&settings, &target, pair).await;
                continue;
            }
            let (rows, doubled) = bench_backend(&settings, &target, &args).await;
            doubled_storms += doubled;
            json_rows.push(json(target.name(), &rows));
            if full && let Target::Postgres { url, admin } = &target {
                let bare = rows.first().map_or(1.0, |row| row.rate);
                match pgbench(&settings, url, admin).await {
                    Some(tps) => println!(
                        "\npgbench, the bare transaction over the simple protocol, {} clients: {tps:.0} transactions/s (bare is {:.2}× that)",
                        settings.connections,
                        bare / tps
                    ),
                    None => eprintln!("pgbench did not run: no reference rate"),
                }
            }
            if args.iter().any(|a| a == "--growth") && matches!(target, Target::Postgres { .. }) {
                growth(&settings, &target).await;
            }
            groups.push((target.label(), rows));
        }
        let target = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
        let _ = std::fs::create_dir_all(&target);
        let svg = target.join("idem-bench-http.svg");
        let charted: Vec<(&str, &[Row])> = groups
            .iter()
            .map(|(label, rows)| (*label, rows.as_slice()))
            .collect();
        match std::fs::write(&svg, chart(&charted)) {
            Ok(()) => println!("\nchart: {}", svg.display()),
            Err(error) => eprintln!("chart: {error}"),
        }
        let data = target.join("idem-bench-http.json");
        match std::fs::write(&data, format!("[{}]\n", json_rows.join(","))) {
            Ok(()) => println!("rows: {}", data.display()),
            Err(error) => eprintln!("rows: {error}"),
        }
        // The storm's promise: each key once, in every round, on every backend.
        assert!(doubled_storms == 0, "idem-storm ran keys twice in {doubled_storms} round(s)");
    });
}

/// `--paired a,b`: the two variants served at once, each by its own server with
/// half the connections, so that whatever the machine does meanwhile lands on
/// both; `b`'s rate over `a`'s, per round, and each server's CPU time per request.
/// New keys only (`bare`, `hand-written`, `idem-first`, `idem-first-sealed` with
/// sealing on; on PostgreSQL also
/// `hand-written-minimal`, the floor without the savepoint and the timeouts, and
/// `hand-written-guarded`, the floor with idem's session lock and saves; on
/// MySQL and SQLite `hand-written-guarded`, the floor with idem's guarantees past
/// the claim; on MySQL
/// `hand-written-previous`, the floor of the design before the claim's
/// check rode on `BEGIN`, `hand-written-minimal`, the write and the record
/// alone, `hand-written-parts` and `hand-written-row`).
async fn paired(settings: &Settings, target: &Target, pair: &str) {
    let serves = |variant: &str| match variant {
        "bare" => Some(("bare", "bare")),
        "hand-written" => Some(("hand-written", "hand-written")),
        "hand-written-minimal" => Some(("hand-written-minimal", "hand-written-minimal")),
        "hand-written-guarded" => Some(("hand-written-guarded", "hand-written-guarded")),
        "hand-written-previous" => Some(("hand-written-previous", "hand-written-previous")),
        "hand-written-parts" => Some(("hand-written-parts", "hand-written-parts")),
        "hand-written-row" => Some(("hand-written-row", "hand-written-row")),
        "idem-first" => Some(("idem-first", "idem")),
        "idem-first-sealed" => Some(("idem-first-sealed", "idem-sealed")),
        _ => None,
    };
    let Some((a, b)) = pair
        .split_once(',')
        .and_then(|(a, b)| serves(a).zip(serves(b)))
    else {
        eprintln!(
            "--paired takes two of bare, hand-written, hand-written-minimal (PostgreSQL, MySQL), \
             hand-written-guarded, hand-written-previous, hand-written-parts, hand-written-row (MySQL), \
             idem-first, idem-first-sealed: {pair:?}"
        );
        return;
    };
    let half = (settings.connections / 2).max(1);
    let mut ratios = Vec::new();
    println!(
        "\n{}: {} and {} at once, {half} connections each, {} s after 1 s warm-up\n",
        target.label(),
        a.0,
        b.0,
        settings.secs
    );
    println!(
        "| round | {} req/s | {} req/s | {} / {} | {} server CPU µs/req | {} server CPU µs/req |",
        a.0, b.0, b.0, a.0, a.0, b.0
    );
    println!("| ---: | ---: | ---: | ---: | ---: | ---: |");
    for round in 0..settings.rounds {
        let mut servers = Vec::new();
        for (n, (variant, serves)) in [a, b].into_iter().enumerate() {
            let schema = format!(
                "idem_bench_http_{}_{}_paired_{n}_{round}",
                std::process::id(),
                target.name()
            );
            let url = target.prepare(&schema, 0).await;
            let server = Server::start(serves, target, &url, &schema, half).await;
            servers.push((variant, schema, server));
        }
        target.settle().await;
        let warm_until = Instant::now() + Duration::from_secs(1);
        let until = warm_until + Duration::from_secs(settings.secs);
        let loads: Vec<_> = servers
            .iter()
            .map(|(variant, schema, server)| {
                let load = Load {
                    addrs: vec![server.addr.clone()],
                    run: schema.clone(),
                    variant,
                    replay_keys: 0,
                    cookie: None,
                };
                load.start(half, &Arc::new(AtomicU64::new(0)), warm_until, until)
            })
            .collect();
        tokio::time::sleep_until(warm_until.into()).await;
        let cpu_before: Vec<f64> = servers.iter().map(|(_, _, s)| s.cpu_seconds()).collect();
        let mut rates = Vec::new();
        let mut cpu_us = Vec::new();
        for (workers, ((_, _, server), before)) in
            loads.into_iter().zip(servers.iter().zip(cpu_before))
        {
            let (latencies, statuses) = Load::finish(workers).await;
            // New keys only: any other answer would be counted as served.
            assert!(
                statuses.keys().all(|status| *status == 201),
                "{}: answers {statuses:?}",
                server.addr
            );
            let served = latencies.len().max(1) as f64;
            cpu_us.push((server.cpu_seconds() - before) * 1e6 / served);
            rates.push(latencies.len() as f64 / settings.secs as f64);
        }
        let ratio = rates[1] / rates[0].max(1.0);
        println!(
            "| {round} | {:.0} | {:.0} | {ratio:.2} | {:.0} | {:.0} |",
            rates[0], rates[1], cpu_us[0], cpu_us[1]
        );
        ratios.push(ratio);
        for (_, schema, server) in servers {
            drop(server);
            target.drop_run(&schema).await;
        }
    }
    ratios.sort_by(f64::total_cmp);
    println!(
        "\n{} / {}: median {:.2} ({:.2}–{:.2}) over {} round(s)",
        b.0,
        a.0,
        ratios[ratios.len() / 2],
        ratios[0],
        ratios[ratios.len() - 1],
        ratios.len()
    );
}

/// The wrk script of `--ceiling`: every connection sends the body with one of
/// `keys` keys in turn, the requests written once, before the load.
const WRK_SCRIPT: &str = r#"
local requests = {}
local n = 0
init = function(args)
  local prefix, keys, body = args[1], tonumber(args[2]), args[3]
  for i = 0, keys - 1 do
    requests[i + 1] = wrk.format("POST", "/payments",
      { ["Content-Type"] = "application/json", ["Idempotency-Key"] = prefix .. i }, body)
  end
end
request = function()
  n = n + 1
  return requests[n % #requests + 1]
end
"#;

/// `--ceiling`: replays from memory against their limit, `static` (the same
/// answer from a handler with the same extractors and no idem), both loaded by
/// wrk (one thread, `--connections`): at these rates the bench's own client
/// would be what is measured. Both servers run throughout; rounds alternate
/// which one goes first. With `together`, both servers are loaded at once, by
/// two wrk processes, sharing one CPU (when pinned): a slow spell of a shared
/// machine then lands on both, and the ratio of their rates is that of the CPU
/// each spends on a request. Replays cycle over 1000 keys completed beforehand
/// (past the store's 30 s `replay_cache_refresh`, each is read from the table
/// once more, in whichever round that lands).
async fn ceiling(settings: &Settings, target: &Target, together: bool) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
    let script = dir.join("idem-bench-wrk.lua");
    if let Err(error) =
        std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&script, WRK_SCRIPT))
    {
        eprintln!("{}: {error}", script.display());
        return;
    }
    let schema = format!(
        "idem_bench_http_{}_{}_ceiling",
        std::process::id(),
        target.name()
    );
    let url = target.prepare(&schema, 0).await;
    let keys = 1000;
    let idem = Server::start("idem", target, &url, &schema, settings.connections).await;
    let plain = Server::start("static", target, &url, &schema, settings.connections).await;
    let mut conn = Conn::open(&idem.addr).await;
    for n in 0..keys {
        let key = key_for(&schema, "idem-replay", n, keys);
        conn.post("/payments", key.as_deref(), BODY).await;
    }
    // The servers on one CPU, wrk on another (when `taskset` is there and the
    // machine has two): where the scheduler puts them otherwise moves each run's
    // CPU per request by a third.
    let pinned = pin(&[&idem, &plain]);
    target.settle().await;
    println!(
        "\n{}: replays from memory and their limit, wrk -t1 -c{} -d{}s each, {} round(s){}\n",
        target.label(),
        settings.connections,
        settings.secs,
        settings.rounds,
        match (pinned, together) {
            (true, true) => ", both at once: the servers on CPU 0 and wrk on the last",
            (true, false) => ", the servers on CPU 0 and wrk on the last",
            (false, true) => ", both at once",
            (false, false) => "",
        }
    );
    println!(
        "| round | static req/s | replay req/s | replay / static | static p99 ms | replay p99 ms | static server CPU µs/req | replay server CPU µs/req |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let mut ratios = Vec::new();
    let servers = [&plain, &idem];
    let prefix = format!("{schema}-replay-");
    for round in 0..settings.rounds {
        let mut measured = [None, None];
        // Each group's runs go at once; the groups one after the other.
        let groups: &[&[usize]] = match (together, round % 2) {
            (true, _) => &[&[0, 1]],
            (false, 0) => &[&[1], &[0]],
            (false, _) => &[&[0], &[1]],
        };
        for group in groups {
            let before = servers.map(Server::cpu_seconds);
            let running: Vec<_> = group
                .iter()
                .map(|&i| {
                    (
                        i,
                        wrk_start(settings, pinned, &script, servers[i], &prefix, keys),
                    )
                })
                .collect();
            for (i, run) in running {
                measured[i] = run.and_then(wrk_end).map(|(rate, p99, requests)| {
                    let cpu_us = (servers[i].cpu_seconds() - before[i]) * 1e6 / requests.max(1.0);
                    (rate, p99, cpu_us)
                });
            }
        }
        let [Some(plain), Some(replay)] = measured else {
            eprintln!("wrk did not run (apt-get install wrk)");
            break;
        };
        let ratio = replay.0 / plain.0.max(1.0);
        println!(
            "| {round} | {:.0} | {:.0} | {ratio:.2} | {:.2} | {:.2} | {:.1} | {:.1} |",
            plain.0, replay.0, plain.1, replay.1, plain.2, replay.2
        );
        ratios.push(ratio);
    }
    drop((idem, plain));
    target.drop_run(&schema).await;
    if !ratios.is_empty() {
        ratios.sort_by(f64::total_cmp);
        println!(
            "\nreplay / static: median {:.2} ({:.2}–{:.2})",
            ratios[ratios.len() / 2],
            ratios[0],
            ratios[ratios.len() - 1]
        );
    }
}

/// Starts one wrk run against `server`; `None` if wrk is missing.
fn wrk_start(
    settings: &Settings,
    pinned: bool,
    script: &std::path::Path,
    server: &Server,
    prefix: &str,
    keys: u64,
) -> Option<std::process::Child> {
    let mut wrk = if pinned {
        let mut taskset = std::process::Command::new("taskset");
        taskset.args(["-c", &last_cpu().to_string(), "wrk"]);
        taskset
    } else {
        std::process::Command::new("wrk")
    };
    wrk.args(["-t1", "--latency"])
        .arg(format!("-c{}", settings.connections))
        .arg(format!("-d{}s", settings.secs))
        .arg("-s")
        .arg(script)
        .arg(format!("http://{}/payments", server.addr))
        .args(["--", prefix, &keys.to_string(), BODY])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .ok()
}

/// Waits for a wrk run: requests/s, p99 in ms and requests. Any answer but 201
/// fails the bench: a fast error is no replay.
fn wrk_end(run: std::process::Child) -> Option<(f64, f64, f64)> {
    let out = run.wait_with_output().ok()?;
    let out = String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.contains("Non-2xx"),
        "wrk saw other answers than 201:\n{out}"
    );
    let value = |prefix: &str| {
        out.lines()
            .find_map(|line| line.trim_start().strip_prefix(prefix))
            .and_then(|rest| rest.split_whitespace().next().map(str::to_owned))
    };
    let rate = value("Requests/sec:")?.parse().ok()?;
    // "N requests in 4.00s, …"
    let requests = out
        .lines()
        .find(|line| line.contains(" requests in "))
        .and_then(|line| line.split_whitespace().next())
        .and_then(|n| n.parse().ok())?;
    let p99 = value("99%")?;
    let p99_ms = if let Some(us) = p99.strip_suffix("us") {
        us.parse::<f64>().ok()? / 1e3
    } else if let Some(ms) = p99.strip_suffix("ms") {
        ms.parse().ok()?
    } else {
        p99.strip_suffix('s')?.parse::<f64>().ok()? * 1e3
    };
    Some((rate, p99_ms, requests))
}

fn last_cpu() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from) - 1
}

/// Pins every thread of `servers` to CPU 0; whether it could (two CPUs or more,
/// `taskset` installed).
fn pin(servers: &[&Server]) -> bool {
    last_cpu() > 0
        && servers.iter().all(|server| {
            std::process::Command::new("taskset")
                .args(["-a", "-p", "-c", "0", &server.child.id().to_string()])
                .stdout(std::process::Stdio::null())
                .status()
                .is_ok_and(|status| status.success())
        })
}

/// Every variant on one backend, in rounds; the median round's rows, and the
/// number of rounds in which `idem-storm` ran a key twice.
async fn bench_backend(settings: &Settings, target: &Target, args: &[String]) -> (Vec<Row>, usize) {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
    let postgres = matches!(target, Target::Postgres { .. });
    let redis_up = TcpStream::connect("127.0.0.1:6379").await.is_ok();
    let mut variants: Vec<(&'static str, &'static str)> = vec![
        ("bare", "bare"),
        ("hand-written", "hand-written"),
        ("idem-first", "idem"),
        ("idem-replay", "idem"),
        ("static", "static"),
    ];
    // Replays of keys stored by no server are prefilled on PostgreSQL only.
    if postgres {
        variants.push(("idem-replay-cold", "idem"));
    }
    variants.push(("idem-storm", "idem"));
    if redis_up {
        variants.push(("naive-cache", "naive-cache"));
        variants.push(("naive-cache-storm", "naive-cache"));
    } else {
        assert!(!ci, "Redis not reachable at 127.0.0.1:6379");
        eprintln!("Redis not reachable at 127.0.0.1:6379: naive-cache skipped");
    }
    // The peer crate keeps its sessions in PostgreSQL.
    if postgres && peer_exe().exists() {
        variants.push(("axum-idempotent", "peer"));
        variants.push(("axum-idempotent-storm", "peer"));
    } else if postgres {
        assert!(!ci, "the peer crate's server is not built");
        eprintln!(
            "axum-idempotent skipped: build it with \
             `cargo build --release --manifest-path benches/peer/Cargo.toml --target-dir target`"
        );
    }
    // `--only a,b`: those variants (and `bare`, the yardstick).
    if let Some(only) = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
    {
        let only: Vec<&str> = only.split(',').collect();
        // Bounds rather than designs: run only when asked for.
        if only.contains(&"hand-written-minimal") && !matches!(target, Target::Sqlite { .. }) {
            variants.insert(2, ("hand-written-minimal", "hand-written-minimal"));
        }
        if only.contains(&"hand-written-guarded") {
            variants.insert(2, ("hand-written-guarded", "hand-written-guarded"));
        }
        // Sealing on and off, same run: first executions, and replays read from
        // the table (no replay cache), which open a sealed record each.
        for (variant, serves) in [
            ("idem-first-sealed", "idem-sealed"),
            ("idem-replay-uncached", "idem-uncached"),
            ("idem-replay-sealed", "idem-sealed-uncached"),
        ] {
            if only.contains(&variant) {
                variants.push((variant, serves));
            }
        }
        for bound in ["hand-written-parts", "hand-written-row"] {
            if only.contains(&bound) && matches!(target, Target::MySql { .. }) {
                variants.insert(2, (bound, bound));
            }
        }
        variants.retain(|(variant, _)| *variant == "bare" || only.contains(variant));
    }
    // Rounds run every variant in turn, so a slow spell of the machine (a
    // checkpoint, a neighbour) lands on all of them; ratios are taken within a round.
    let mut by_variant: Vec<Vec<Row>> = variants.iter().map(|_| Vec::new()).collect();
    for round in 0..settings.rounds {
        let mut rows = Vec::new();
        for &(variant, serves) in &variants {
            rows.push(run_variant(settings, variant, serves, target, 0, round).await);
        }
        let bare = rows.first().map_or(1.0, |r| r.rate);
        for (mut row, runs) in rows.into_iter().zip(&mut by_variant) {
            row.ratio = row.rate / bare;
            runs.push(row);
        }
    }
    let doubled_storms = by_variant
        .iter()
        .flatten()
        .filter(|r| r.variant == "idem-storm" && r.doubled != Some(0))
        .count();
    // Per variant, the round with the median ratio, and the spread of ratios.
    let rows: Vec<(Row, f64, f64)> = by_variant
        .into_iter()
        .map(|mut runs| {
            runs.sort_by(|a, b| a.ratio.total_cmp(&b.ratio));
            let (low, high) = (runs[0].ratio, runs[runs.len() - 1].ratio);
            (runs.swap_remove(runs.len() / 2), low, high)
        })
        .collect();
    println!(
        "\n{}: {} connections, {} s per variant after 1 s warm-up, {} round(s) (the median round's numbers; × bare within each round, low–high); statements counted over 200 requests\n",
        target.label(),
        settings.connections,
        settings.secs,
        settings.rounds
    );
    println!(
        "| variant | requests | req/s | × bare | × bare, low–high | p50 ms | p99 ms | server CPU µs/req | database CPU µs/req | peak RSS MiB | statements/req | round trips/req | answers | keys run twice |"
    );
    println!(
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"
    );
    for (row, low, high) in &rows {
        let mut statuses: Vec<_> = row.statuses.iter().collect();
        statuses.sort();
        let answers = statuses
            .iter()
            .map(|(s, n)| format!("{s}×{n}"))
            .collect::<Vec<_>>()
            .join(" ");
        let round_trips = if matches!(target, Target::Sqlite { .. }) {
            "-".to_owned()
        } else {
            format!("{:.1}", row.round_trips)
        };
        println!(
            "| {} | {} | {:.0} | {:.2} | {:.2}–{:.2} | {:.2} | {:.2} | {:.0} | {} | {:.1} | {:.1} | {} | {} | {} |",
            row.variant,
            row.requests,
            row.rate,
            row.ratio,
            low,
            high,
            row.p50.as_secs_f64() * 1e3,
            row.p99.as_secs_f64() * 1e3,
            row.cpu_us,
            row.db_cpu_us
                .map_or("-".to_owned(), |us| format!("{us:.0}")),
            row.rss_mib,
            row.statements,
            round_trips,
            answers,
            match (row.doubled, row.rerun) {
                (None, _) => "-".to_owned(),
                (Some(d), 0) => d.to_string(),
                (Some(d), rerun) => format!("{d} (+{rerun} after a 5xx)"),
            },
        );
    }
    let rate = |variant: &str| {
        rows.iter()
            .find(|(row, _, _)| row.variant == variant)
            .map(|(row, _, _)| row.rate)
    };
    if let (Some(replay), Some(limit)) = (rate("idem-replay"), rate("static")) {
        println!(
            "\nidem-replay / static: {:.2} (the same answer from a handler without idem; `--ceiling` measures it under wrk)",
            replay / limit
        );
    }
    (
        rows.into_iter().map(|(row, _, _)| row).collect(),
        doubled_storms,
    )
}
