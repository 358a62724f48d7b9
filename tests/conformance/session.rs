//! A handler may change its session's state inside its transaction: the tenant's
//! schema or database, its role, the settings its queries rely on. What idem
//! runs after the handler (the record, the release, the next request's claim on
//! the same connection) must not depend on any of it: every answer is recorded
//! with its writes, once, in idem's own table, and the session goes back to the
//! pool as idem can use it again.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use axum::Router;
use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use futures_util::FutureExt as _;
use idem::axum::IdempotentRequest;
use idem::{Idempotency, Options, Outcome};

use crate::BODY;
use crate::app::{Req, send};
use crate::harness::{Harness, SessionChange};

/// Where a case's statements say the handler writes its effect; last when absent.
pub const EFFECT: &str = "EFFECT";

struct SessionApp<H: Harness> {
    store: Idempotency<H::DB>,
    cases: Arc<Vec<SessionChange>>,
}

impl<H: Harness> Clone for SessionApp<H> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            cases: self.cases.clone(),
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
    request
        .run(&scope.clone(), Options::new(), move |mut tx| {
            Box::pin(async move {
                let mut id = 0;
                for statement in &statements {
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
                .with_state(SessionApp::<H> {
                    store,
                    cases: cases.clone(),
                });
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
