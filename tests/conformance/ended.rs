//! MySQL and MariaDB end a transaction behind the caller's back: every statement
//! that commits implicitly (DDL, `LOCK TABLES`, a `COMMIT` or `BEGIN` the handler
//! sends, a procedure that commits) commits what the handler wrote before it, and
//! a `ROLLBACK` the handler sends undoes it. Whatever the handler writes next, and
//! however it ends (an answer, a panic, its session killed), a retry never runs it
//! again once any of its writes committed, and nothing uncommitted is answered.

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idem_axum::axum::IdempotentRequest;
use idem_axum::{Idempotency, Options, Outcome};

use crate::BODY;
use crate::app::{Req, router_on, send};
use crate::harness::{Harness, My};

/// Statements a handler may send that end its transaction, and whether what the
/// handler wrote before them is committed (`START TRANSACTION READ WRITE` also
/// opens a read-write transaction of its own, which then carries what follows).
const STATEMENTS: &[(&str, bool)] = &[
    ("CREATE TABLE IF NOT EXISTS ended_new (id INT)", true),
    ("CREATE TABLE ended_other (id INT)", true),
    ("TRUNCATE TABLE ended_side", true),
    ("ALTER TABLE ended_side ADD COLUMN extra INT", true),
    ("CREATE INDEX ended_idx ON ended_side (id)", true),
    ("DROP TABLE IF EXISTS ended_absent", true),
    ("RENAME TABLE ended_side TO ended_renamed", true),
    ("CREATE OR REPLACE VIEW ended_view AS SELECT 1 AS one", true),
    ("DROP USER IF EXISTS 'idem_ended_nobody'@'localhost'", true),
    ("ANALYZE TABLE ended_side", true),
    ("OPTIMIZE TABLE ended_side", true),
    ("CHECK TABLE ended_side", true),
    ("FLUSH TABLES", true),
    ("LOCK TABLES ended_side WRITE", true),
    ("CALL ended_commits()", true),
    ("COMMIT", true),
    ("BEGIN", true),
    ("START TRANSACTION", true),
    ("START TRANSACTION READ WRITE", true),
    ("SET autocommit = 1", true),
    ("ROLLBACK", false),
];

/// How the handler ends, after its statement and one more write.
#[derive(Clone, Copy, Debug)]
enum End {
    /// Answers 500: idem would release the key.
    ServerError,
    /// Answers 201: idem would record it.
    Created,
    Panic,
    /// Its session is killed before it answers, as when its process dies.
    Killed,
}

impl End {
    fn name(self) -> &'static str {
        match self {
            Self::ServerError => "500",
            Self::Created => "201",
            Self::Panic => "panic",
            Self::Killed => "killed",
        }
    }
}

/// Writes an effect, sends the statement `x-stmt` names (index in `STATEMENTS`,
/// none when absent), writes another, and ends as `x-end` says.
async fn handler(
    State(store): State<Idempotency<<My as Harness>::DB>>,
    headers: HeaderMap,
    request: IdempotentRequest<<My as Harness>::DB>,
) -> Response {
    let _ = store;
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let statement = header("x-stmt")
        .and_then(|n| n.parse::<usize>().ok())
        .and_then(|n| STATEMENTS.get(n))
        .map(|(sql, _)| *sql);
    let end = header("x-end").unwrap_or_default();
    request
        .run("alice", Options::new(), move |mut tx| {
            Box::pin(async move {
                if let Err(error) = My::insert_effect(&mut tx, "alice", "before").await {
                    return (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response();
                }
                if let Some(sql) = statement {
                    // What it answers does not matter: the handler goes on.
                    let _ = My::exec(&mut tx, sql, &[]).await;
                }
                let _ = My::insert_effect(&mut tx, "alice", "after").await;
                match end.as_str() {
                    "panic" => panic!("the handler fails after its statement"),
                    "killed" => {
                        let _ = My::exec(&mut tx, "KILL CONNECTION_ID()", &[]).await;
                        (StatusCode::CREATED, "created").into_response()
                    }
                    "201" => (StatusCode::CREATED, "created").into_response(),
                    _ => (StatusCode::INTERNAL_SERVER_ERROR, "failed").into_response(),
                }
            })
        })
        .await
}

async fn one_case(statement: usize, end: End) {
    let (sql, commits) = STATEMENTS[statement];
    let Some(h) = crate::start::<My>().await else {
        return;
    };
    h.script(
        "CREATE TABLE ended_side (id INT NOT NULL); \
         INSERT INTO ended_side (id) VALUES (1); \
         CREATE PROCEDURE ended_commits() COMMIT",
    )
    .await;
    let app = Router::new()
        .route("/ended", post(handler))
        .with_state(h.store().clone());
    let case = format!("{sql} then {}", end.name());
    let key = format!("k-ended-{statement}-{}", end.name());
    let req = Req::post("alice", &key, BODY).path("/ended");
    let first = send(
        &app,
        &req.clone()
            .header("x-stmt", statement)
            .header("x-end", end.name()),
    )
    .await;
    let after_first = h.effects("alice").await;
    // The retry sends no statement: were it run, it would write and commit.
    let retry = send(&app, &req.clone().header("x-end", "201")).await;
    let after_retry = h.effects("alice").await;
    let rows = h.key_rows("alice").await;

    if sql == "START TRANSACTION READ WRITE" && matches!(end, End::Created) {
        // Everything it wrote committed, in two transactions: the one the
        // statement ended, and its own, which the record went into. Once.
        assert_eq!(first.status, 201, "{case}: {}", first.text());
        assert_eq!(
            retry.outcome,
            Some(Outcome::Replayed),
            "{case}: {}",
            retry.text()
        );
        assert_eq!((after_first, after_retry), (2, 2), "{case}");
    } else if commits {
        assert!(
            after_first >= 1,
            "{case}: the write before the statement is committed ({after_first})"
        );
        assert_eq!(
            after_retry, after_first,
            "{case}: the retry ran the handler again"
        );
        assert_eq!(
            retry.outcome,
            Some(Outcome::Replayed),
            "{case}: {}",
            retry.text()
        );
        assert_eq!(retry.status, 500, "{case}: {}", retry.text());
        assert_eq!(
            retry.problem().as_deref(),
            Some("transaction-ended"),
            "{case}: {}",
            retry.text()
        );
        if !matches!(end, End::Killed) {
            assert_eq!(
                first.outcome,
                Some(Outcome::TransactionEnded),
                "{case}: {}",
                first.text()
            );
            assert_eq!(
                first.body, retry.body,
                "{case}: the first answer is the one replayed"
            );
        }
        assert_eq!(rows.len(), 1, "{case}");
        assert_eq!(rows[0].1.state, "completed", "{case}");
        assert_eq!(rows[0].1.status, Some(500), "{case}");
    } else {
        assert_eq!(
            after_first, 0,
            "{case}: nothing of the handler's is committed"
        );
        match end {
            End::Created => {
                // The handler's own answer, recorded alone, as after a deadlock.
                assert_eq!(first.status, 201, "{case}: {}", first.text());
                assert_eq!(
                    retry.outcome,
                    Some(Outcome::Replayed),
                    "{case}: {}",
                    retry.text()
                );
                assert_eq!(after_retry, 0, "{case}");
            }
            _ => {
                // Released: the retry runs the handler whole, once.
                assert_eq!(
                    retry.outcome,
                    Some(Outcome::Executed),
                    "{case}: {}",
                    retry.text()
                );
                assert_eq!(after_retry, 2, "{case}: the retry's two writes");
            }
        }
    }
    assert_eq!(
        crate::transactions_left(&h).await,
        0,
        "{case}: a session left in a transaction"
    );
    h.finish().await;
}

/// Every statement of the class, answered 500: the key keeps `transaction-ended`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_statements_that_end_the_transaction_never_run_a_key_twice() {
    for statement in 0..STATEMENTS.len() {
        one_case(statement, End::ServerError).await;
    }
}

/// The same statements, with the handler answering 201 afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_statements_that_end_the_transaction_are_never_recorded_as_success() {
    for statement in 0..STATEMENTS.len() {
        one_case(statement, End::Created).await;
    }
}

/// A panic, and a session killed (a crash) after the statement and the write.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_statements_that_end_the_transaction_then_a_panic_or_a_crash() {
    let ddl = 0;
    let commit = STATEMENTS
        .iter()
        .position(|(s, _)| *s == "COMMIT")
        .unwrap_or(0);
    let rollback = STATEMENTS.len() - 1;
    for statement in [ddl, commit, rollback] {
        one_case(statement, End::Panic).await;
        one_case(statement, End::Killed).await;
    }
}

/// Sessions at READ UNCOMMITTED (a setting idem does not choose): a duplicate
/// that looks while the executor's transaction is open sees it in flight, never
/// its uncommitted row, and keeps nothing of it: once the executor rolled back,
/// the duplicate's instance runs the key, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_read_uncommitted_sessions_never_answer_what_did_not_commit() {
    let Some(h) = crate::start::<My>().await else {
        return;
    };
    let dirty = "SET SESSION TRANSACTION ISOLATION LEVEL READ UNCOMMITTED";
    let (pool_a, a) = h.store_with_session(dirty).await;
    let (pool_b, b) = h.store_with_session(dirty).await;
    let (a, b) = (router_on::<My>(a), router_on::<My>(b));
    let key = format!("k-dirty-{}", crate::unique_suffix());
    let req = Req::post("alice", &key, BODY);
    let first = {
        let req = req.clone().header("x-gate", &key).header("x-status", 500);
        tokio::spawn(async move { send(&a, &req).await })
    };
    crate::await_started(&key).await;
    let duplicate = send(&b, &req).await;
    assert_eq!(
        duplicate.outcome,
        Some(Outcome::InFlight),
        "{}",
        duplicate.text()
    );
    crate::app::open_gate(&key);
    let first = first.await.expect("first");
    assert_eq!(first.status, 500, "{}", first.text());
    assert_eq!(h.effects("alice").await, 0, "rolled back");
    assert!(h.key_rows("alice").await.is_empty(), "released");
    let retry = send(&b, &req).await;
    assert_eq!(retry.outcome, Some(Outcome::Executed), "{}", retry.text());
    assert_eq!(h.effects("alice").await, 1);
    pool_a.close().await;
    pool_b.close().await;
    h.finish().await;
}
