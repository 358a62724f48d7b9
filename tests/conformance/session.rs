//! A handler may change its session's state inside its transaction: the tenant's
//! schema or database, its role, the settings its queries rely on. What idem
//! runs after the handler (the record, the release, the next request's claim on
//! the same connection) must not depend on any of it: every answer is recorded
//! with its writes, once, in idem's own table, and the session goes back to the
//! pool as idem can use it again.
//!
//! The same handler serves the neighbouring cases of the database acting behind
//! the handler's back: a transaction the handler ends itself (`COMMIT`,
//! `ROLLBACK`), and session timeouts shorter than the endpoint's lock.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use futures_util::FutureExt as _;
use idem_axum::axum::IdempotentRequest;
use idem_axum::{Forgotten, Idempotency, Options, Outcome};
use tokio::sync::Notify;

use crate::BODY;
use crate::app::{Got, Req, send};
use crate::harness::{Harness, SessionChange};

/// Where a case's statements say the handler writes its effect; last when absent.
pub const EFFECT: &str = "EFFECT";

/// `SLEEP <ms>` in a case's statements: the handler waits that long, inside its
/// transaction, sending nothing (a card provider answering slowly).
pub const SLEEP: &str = "SLEEP ";

/// `PAUSE` in a case's statements: the handler tells the test it got there
/// ([`Gate::reached`]) and waits until the test lets it go on ([`Gate::resume`]).
pub const PAUSE: &str = "PAUSE";

/// Where a handler pauses; a permit is kept when nobody waits yet.
#[derive(Default)]
struct Gate {
    reached: Notify,
    resume: Notify,
}

struct SessionApp<H: Harness> {
    store: Idempotency<H::DB>,
    cases: Arc<Vec<SessionChange>>,
    gate: Arc<Gate>,
}

impl<H: Harness> SessionApp<H> {
    fn new(store: Idempotency<H::DB>, cases: Arc<Vec<SessionChange>>) -> Self {
        Self {
            store,
            cases,
            gate: Arc::default(),
        }
    }
}

impl<H: Harness> Clone for SessionApp<H> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            cases: self.cases.clone(),
            gate: self.gate.clone(),
        }
    }
}

impl<H: Harness> FromRef<SessionApp<H>> for Idempotency<H::DB> {
    fn from_ref(app: &SessionApp<H>) -> Self {
        app.store.clone()
    }
}

/// Sends the statements of case `x-case` (none when absent) around its write,
/// and answers `x-status` (201 by default). A statement that fails is a broken
/// case, answered 599.
async fn handler<H: Harness>(
    State(app): State<SessionApp<H>>,
    request: IdempotentRequest<H::DB>,
) -> Response {
    let headers = request.parts().headers.clone();
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let scope = header("x-scope").unwrap_or_default();
    let statements: Vec<String> = header("x-case")
        .and_then(|n| n.parse::<usize>().ok())
        .and_then(|n| app.cases.get(n))
        .map(|case| {
            let mut statements: Vec<String> = case
                .statements
                .iter()
                .map(|s| s.replace("{scope}", &scope))
                .collect();
            if !statements.iter().any(|s| s == EFFECT) {
                statements.push(EFFECT.to_owned());
            }
            statements
        })
        .unwrap_or_else(|| vec![EFFECT.to_owned()]);
    let status = header("x-status")
        .and_then(|s| s.parse::<u16>().ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::CREATED);
    let panics = header("x-panic").is_some();
    let gate = app.gate.clone();
    request
        .run(&scope.clone(), Options::new(), move |mut tx| {
            Box::pin(async move {
                let mut id = 0;
                for statement in &statements {
                    if let Some(ms) = statement.strip_prefix(SLEEP) {
                        let ms = ms.trim().parse().unwrap_or(0);
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                        continue;
                    }
                    if statement == PAUSE {
                        gate.reached.notify_one();
                        gate.resume.notified().await;
                        continue;
                    }
                    let done = if statement == EFFECT {
                        H::insert_effect(&mut tx, &scope, "session").await.map(|n| {
                            id = n;
                        })
                    } else {
                        H::exec(&mut *tx, statement, &[]).await.map(drop)
                    };
                    if let Err(error) = done {
                        let status = StatusCode::from_u16(599).unwrap_or(StatusCode::BAD_GATEWAY);
                        return (status, format!("{statement}: {error}")).into_response();
                    }
                }
                assert!(!panics, "the handler panics after its statements");
                (status, format!("effect {id} of {scope}")).into_response()
            })
        })
        .await
}

async fn one_case<H: Harness>(
    h: &H,
    app: &Router,
    pool: &sqlx::Pool<H::DB>,
    n: usize,
    case: &SessionChange,
    status: u16,
) {
    let name = format!("{} then {status}", case.name);
    let scope = format!("session-{n}-{status}");
    let key = "k-session";
    let req = Req::post(&scope, key, BODY);
    let first = send(
        app,
        &req.clone().header("x-case", n).header("x-status", status),
    )
    .await;
    assert_eq!(first.status, status, "{name}: {}", first.text());
    // The retry sends no statement: were it run, it would write once more.
    let retry = send(app, &req).await;
    // The next request on the session the handler left: a new key, run and replayed.
    let next = Req::post(&scope, "k-next", BODY);
    let next_first = send(app, &next).await;
    let next_replay = send(app, &next).await;
    if status < 500 {
        assert_eq!(first.outcome, Some(Outcome::Executed), "{name}");
        assert_eq!(
            retry.outcome,
            Some(Outcome::Replayed),
            "{name}: {}",
            retry.text()
        );
        assert_eq!(retry.body, first.body, "{name}: the replay is the answer");
        assert_eq!(h.effects(&scope).await, 2, "{name}: one write per key");
    } else {
        assert_eq!(
            retry.outcome,
            Some(Outcome::Executed),
            "{name}: {}",
            retry.text()
        );
        assert_eq!(retry.status, 201, "{name}: {}", retry.text());
        assert_eq!(
            h.effects(&scope).await,
            2,
            "{name}: the 500's write rolled back, the retry's kept"
        );
    }
    assert_eq!(
        next_first.outcome,
        Some(Outcome::Executed),
        "{name}: the next request on the session: {}",
        next_first.text()
    );
    assert_eq!(
        next_replay.outcome,
        Some(Outcome::Replayed),
        "{name}: {}",
        next_replay.text()
    );
    let rows = h.key_rows(&scope).await;
    let states: Vec<(&str, &str, Option<i32>)> = rows
        .iter()
        .map(|(key, row)| (key.as_str(), row.state.as_str(), row.status))
        .collect();
    let expected = if status < 500 { status } else { 201 };
    assert_eq!(
        states,
        [
            ("k-next", "completed", Some(201)),
            (key, "completed", Some(i32::from(expected)))
        ],
        "{name}: idem's table holds both keys"
    );
    if let Some(shadow) = &case.shadow {
        let mut conn = pool.acquire().await.expect("the store's session");
        match H::exec(&mut *conn, shadow, &[]).await {
            Ok(written) => assert_eq!(written, 0, "{name}: idem wrote where the handler pointed"),
            // A temporary table rolled back with the transaction that created it.
            Err(_) if status >= 500 => {}
            Err(error) => panic!("{name}: the shadow table: {error}"),
        }
    }
}

/// Every change of session state a handler can make inside its transaction on
/// this backend, each followed by a 201 and by a 500, on a store whose pool has
/// one connection: the record finds idem's own table and role, and the next
/// request on that session claims, runs and replays as on a fresh one.
pub async fn handler_session_changes_never_reach_idem<H: Harness>() {
    let Some(h) = crate::start::<H>().await else {
        return;
    };
    let cases = Arc::new(h.session_changes().await);
    assert!(!cases.is_empty(), "every backend lists its changes");
    // Every case runs, and the failures are reported together.
    let mut failed = Vec::new();
    for status in [201, 500] {
        for (n, case) in cases.iter().enumerate() {
            // A pool per case, so that each case meets a clean session.
            let (pool, store) = h.one_session_store().await;
            let app = Router::new()
                .route("/effects", post(handler::<H>))
                .with_state(SessionApp::<H>::new(store, cases.clone()));
            let ran = AssertUnwindSafe(one_case(&h, &app, &pool, n, case, status))
                .catch_unwind()
                .await;
            if ran.is_err() {
                failed.push(format!("{} then {status}", case.name));
            }
            pool.close().await;
        }
    }
    h.finish().await;
    assert!(failed.is_empty(), "failed (see above): {failed:#?}");
}

/// A handler that ends its own transaction (`COMMIT`, `ROLLBACK` and their
/// kin), with a write before it and one after, answering 201 or 500, or
/// panicking: some of what it wrote may be committed, outside the record. The key keeps 500
/// `transaction-ended` and its retry never runs the handler again, whatever
/// committed.
pub async fn handlers_that_end_their_own_transaction_never_run_twice<H: Harness>() {
    let Some(h) = crate::start::<H>().await else {
        return;
    };
    let cases = Arc::new(ending_cases(H::ENDING_STATEMENTS, &[]));
    let app = Router::new()
        .route("/effects", post(handler::<H>))
        .with_state(SessionApp::<H>::new(h.store().clone(), cases.clone()));
    let mut failed = Vec::new();
    // Also over a crashed executor's claim, taken over: a rollback undoes the
    // takeover too.
    for (end, stale) in [
        ("201", false),
        ("500", false),
        ("panic", false),
        ("500", true),
    ] {
        for (n, case) in cases.iter().enumerate() {
            let over = if stale { ", taken over" } else { "" };
            let name = format!("{} then {end}{over}", case.name);
            let scope = format!("ends-{n}-{end}-{stale}");
            let req = Req::post(&scope, "k-ends", BODY);
            if stale {
                h.insert_stale_claim(&scope, "k-ends", "POST", "/effects", BODY.as_bytes())
                    .await;
            }
            let first = req.clone().header("x-case", n);
            let first = match end {
                "panic" => first.header("x-panic", 1),
                status => first.header("x-status", status),
            };
            let ran = AssertUnwindSafe(async {
                let first = send(&app, &first).await;
                ended_for_good(&h, &app, &req, &first, &scope, &name).await;
            })
            .catch_unwind()
            .await;
            if ran.is_err() {
                failed.push(name);
            }
        }
    }
    assert_eq!(
        crate::transactions_left(&h).await,
        0,
        "a session left in a transaction"
    );
    h.finish().await;
    assert!(failed.is_empty(), "failed (see above): {failed:#?}");
}

/// A handler that ends its own transaction and then goes on working (a write
/// after a `ROLLBACK` commits on its own): a duplicate that arrives meanwhile
/// never runs. It is answered 409 `in-flight` (or, where the database committed
/// the key's ended mark with the handler's `COMMIT`, 500 `transaction-ended`),
/// an operator's `forget` meanwhile answers `InFlight` and deletes nothing, and
/// once the handler is done the key keeps `transaction-ended`.
pub async fn duplicates_never_run_while_a_handler_has_ended_its_transaction<H: Harness>() {
    let Some(h) = crate::start::<H>().await else {
        return;
    };
    // Through a transaction pooler, PostgreSQL's hold on a key lives in the
    // transaction (docs/deployment.md): there, only the statements that commit
    // the claim with the handler's writes keep duplicates out.
    let holds = h.holds_keys_past_their_transaction();
    let statements: Vec<&str> = H::ENDING_STATEMENTS
        .iter()
        .copied()
        .filter(|s| holds || s.starts_with("COMMIT") || *s == "END")
        .collect();
    let cases = ending_cases(&statements, &[PAUSE]);
    let state = SessionApp::<H>::new(h.store().clone(), Arc::new(cases.clone()));
    let gate = state.gate.clone();
    let app = Router::new()
        .route("/effects", post(handler::<H>))
        .with_state(state);
    let mut failed = Vec::new();
    for (n, case) in cases.iter().enumerate() {
        let name = &case.name;
        let scope = format!("window-{n}");
        let req = Req::post(&scope, "k-window", BODY);
        let first = req.clone().header("x-case", n).header("x-status", 201);
        let first = tokio::spawn({
            let app = app.clone();
            async move { send(&app, &first).await }
        });
        let reached = tokio::time::timeout(Duration::from_secs(30), gate.reached.notified()).await;
        assert!(
            reached.is_ok(),
            "{name}: the handler never got past its statement"
        );
        let ran = AssertUnwindSafe(async {
            let before = h.effects(&scope).await;
            // Were it run, the duplicate would write and commit once more.
            let duplicate = send(&app, &req).await;
            assert_eq!(h.effects(&scope).await, before, "{name}: the duplicate ran");
            let answer = (duplicate.status, duplicate.problem());
            assert!(
                answer == (409, Some("in-flight".to_owned()))
                    || answer == (500, Some("transaction-ended".to_owned())),
                "{name}: the duplicate: {} {}",
                duplicate.status,
                duplicate.text()
            );
            // Nor does an operator free it: what the handler committed may be its
            // ended mark, which its executor still holds.
            let forgotten = tokio::time::timeout(
                Duration::from_secs(10),
                h.store().forget(&scope, "k-window"),
            )
            .await;
            let forgotten = forgotten.expect("forget waited for the executor");
            assert_eq!(
                forgotten.expect("forget"),
                Forgotten::InFlight,
                "{name}: forget"
            );
        })
        .catch_unwind()
        .await;
        gate.resume.notify_one();
        let first = first.await.expect("the first request");
        let ran = ran.is_ok()
            && AssertUnwindSafe(ended_for_good(&h, &app, &req, &first, &scope, name))
                .catch_unwind()
                .await
                .is_ok();
        if !ran {
            failed.push(name.clone());
        }
    }
    assert_eq!(
        crate::transactions_left(&h).await,
        0,
        "a session left in a transaction"
    );
    h.finish().await;
    assert!(failed.is_empty(), "failed (see above): {failed:#?}");
}

/// A case per statement that ends the handler's transaction: a write, the
/// statement, then `between` and a second write.
fn ending_cases(statements: &[&str], between: &[&str]) -> Vec<SessionChange> {
    statements
        .iter()
        .map(|statement| {
            let mut statements = vec![EFFECT.to_owned(), (*statement).to_owned()];
            statements.extend(between.iter().map(|s| (*s).to_owned()));
            statements.push(EFFECT.to_owned());
            SessionChange {
                name: (*statement).to_owned(),
                statements,
                shadow: None,
            }
        })
        .collect()
}

/// After a first answer `first` whose handler ended its own transaction: it was
/// answered `transaction-ended`, its retry replays that and never runs the handler
/// (which would write once more), and the key's row is a completed 500.
async fn ended_for_good<H: Harness>(
    h: &H,
    app: &Router,
    req: &Req,
    first: &Got,
    scope: &str,
    name: &str,
) {
    assert_eq!(
        first.outcome,
        Some(Outcome::TransactionEnded),
        "{name}: {}",
        first.text()
    );
    let after_first = h.effects(scope).await;
    let retry = send(app, req).await;
    assert_eq!(h.effects(scope).await, after_first, "{name}: ran again");
    assert_eq!(
        (retry.status, retry.problem().as_deref()),
        (500, Some("transaction-ended")),
        "{name}: {}",
        retry.text()
    );
    let rows = h.key_rows(scope).await;
    assert_eq!(rows.len(), 1, "{name}");
    assert_eq!(
        (rows[0].1.state.as_str(), rows[0].1.status),
        ("completed", Some(500)),
        "{name}"
    );
}

/// PostgreSQL: every timeout a DBA may set shorter than an endpoint's `lock`
/// (1.5 s here, as a role's or database's default; the lock is 30 s), against a
/// handler that takes 2.5 s (a statement that long, or a wait between statements):
/// the keyed transaction lives as long as its lock, and the answer is recorded
/// once. `transaction_timeout` exists from PostgreSQL 17 on (CI runs 18).
#[cfg(feature = "postgres")]
async fn session_timeouts_shorter_than_the_lock<H: Harness<DB = sqlx::Postgres>>() {
    use sqlx::postgres::PgPoolOptions;

    let Some(h) = crate::start::<H>().await else {
        return;
    };
    let version: i32 = sqlx::query_scalar("SELECT current_setting('server_version_num')::int")
        .fetch_one(h.direct_pool())
        .await
        .expect("server version");
    let mut timeouts = vec![
        ("statement_timeout", "SELECT pg_sleep(2.5)"),
        ("idle_in_transaction_session_timeout", "SLEEP 2500"),
        ("lock_timeout", "SLEEP 2500"),
    ];
    if version >= 170_000 {
        timeouts.push(("transaction_timeout", "SLEEP 2500"));
    } else {
        eprintln!("PostgreSQL {version} has no transaction_timeout: that case runs on 17+");
    }
    let mut failed = Vec::new();
    for (n, (setting, wait)) in timeouts.iter().enumerate() {
        // Straight to the server: a startup option is what a role's or database's
        // default looks like to the session (a transaction pooler drops it).
        let options = (*h.direct_pool().connect_options())
            .clone()
            .options([(*setting, "1500ms")]);
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .expect("a pool with a short timeout");
        let store = h.instance_on(pool.clone()).build().expect("store");
        let name = format!("{setting} = 1500ms, handler {wait}");
        if !outlives(&h, store, &name, wait, n).await {
            failed.push(name);
        }
        pool.close().await;
    }
    h.finish().await;
    assert!(failed.is_empty(), "failed (see above): {failed:#?}");
}

/// Runs one key whose handler writes, then does `wait`, on `store`: `false`
/// (and the failure printed) unless it is answered 201, once, and replayed.
#[cfg(any(feature = "postgres", feature = "mysql"))]
async fn outlives<H: Harness>(
    h: &H,
    store: Idempotency<H::DB>,
    name: &str,
    wait: &str,
    n: usize,
) -> bool {
    let case = SessionChange {
        name: name.to_owned(),
        statements: vec![EFFECT.to_owned(), wait.to_owned()],
        shadow: None,
    };
    let app = Router::new()
        .route("/effects", post(handler::<H>))
        .with_state(SessionApp::<H>::new(store, Arc::new(vec![case])));
    let scope = format!("timeout-{n}");
    let req = Req::post(&scope, "k-slow", BODY).header("x-case", 0);
    AssertUnwindSafe(async {
        let first = send(&app, &req).await;
        assert_eq!(first.status, 201, "{name}: {}", first.text());
        let replay = send(&app, &req).await;
        assert_eq!(replay.outcome, Some(Outcome::Replayed), "{name}");
        assert_eq!(replay.body, first.body, "{name}");
        assert_eq!(h.effects(&scope).await, 1, "{name}");
    })
    .catch_unwind()
    .await
    .is_ok()
}

/// MariaDB: every session timeout that can end a keyed transaction, set to 1 s as
/// an application's or server's default, against a handler that takes 2 s (a
/// wait between statements, or one statement that long): each is raised to the
/// endpoint's lock for the claim, and the answer recorded once.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_session_timeouts_shorter_than_the_lock() {
    use crate::harness::My;

    let Some(h) = crate::start::<My>().await else {
        return;
    };
    let timeouts: [(&'static str, &str); 7] = [
        ("SET SESSION wait_timeout = 1", "SLEEP 2000"),
        ("SET SESSION interactive_timeout = 1", "SLEEP 2000"),
        ("SET SESSION idle_transaction_timeout = 1", "SLEEP 2000"),
        (
            "SET SESSION idle_write_transaction_timeout = 1",
            "SLEEP 2000",
        ),
        (
            "SET SESSION idle_readonly_transaction_timeout = 1",
            "SLEEP 2000",
        ),
        ("SET SESSION max_statement_time = 1", "SELECT SLEEP(2)"),
        ("SET SESSION innodb_lock_wait_timeout = 1", "SLEEP 2000"),
    ];
    let mut failed = Vec::new();
    for (n, (setting, wait)) in timeouts.iter().enumerate() {
        let (pool, store) = h.store_with_session(setting).await;
        let name = format!("{setting}, handler {wait}");
        if !outlives(&h, store, &name, wait, n).await {
            failed.push(name);
        } else {
            // The session's own value is back once the claim has ended.
            let variable = setting
                .trim_start_matches("SET SESSION ")
                .split(' ')
                .next()
                .unwrap_or_default();
            let value: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT CAST(@@SESSION.{variable} AS SIGNED)"
            )))
            .fetch_one(&pool)
            .await
            .expect("the session's value");
            if value != 1 {
                eprintln!("{name}: the session's value is {value} after the request, not 1");
                failed.push(name);
            }
        }
        pool.close().await;
    }
    h.finish().await;
    assert!(failed.is_empty(), "failed (see above): {failed:#?}");
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_session_timeouts_shorter_than_the_lock() {
    session_timeouts_shorter_than_the_lock::<crate::harness::Pg>().await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_partitioned_session_timeouts_shorter_than_the_lock() {
    session_timeouts_shorter_than_the_lock::<crate::harness::PgParted>().await;
}
