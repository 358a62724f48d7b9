//! A handler that catches a deadlock, the database error a busy app meets most.
//! PostgreSQL aborts the handler's transaction; MySQL and MariaDB roll it back
//! whole, idem's claim row included, and what follows waits uncommitted outside
//! it, for idem to roll back.

use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idem_axum::axum::IdempotentRequest;
use idem_axum::{Idempotency, Options, Outcome};

use crate::app::{self, Req, send};
use crate::harness::Harness;
#[cfg(feature = "mysql")]
use crate::harness::My;
#[cfg(feature = "postgres")]
use crate::harness::{Pg, PgParted};
use crate::{BODY, await_started, start};

struct Shop<H: Harness>(Idempotency<H::DB>);

impl<H: Harness> Clone for Shop<H> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<H: Harness> FromRef<Shop<H>> for Idempotency<H::DB> {
    fn from_ref(shop: &Shop<H>) -> Self {
        shop.0.clone()
    }
}

/// Moves stock from row 1 to row 2; a deadlock is answered as the handler's own
/// 409, after an audit row written once the transaction has failed.
async fn move_stock<H: Harness>(
    State(_): State<Shop<H>>,
    request: IdempotentRequest<H::DB>,
) -> Response {
    let key = request
        .key()
        .map(|k| k.as_str().to_owned())
        .unwrap_or_default();
    request
        .run("alice", Options::new(), move |mut tx| {
            Box::pin(async move {
                let first = "UPDATE stock SET n = n + 1 WHERE id = 1";
                if let Err(error) = H::exec(&mut tx, first, &[]).await {
                    return (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response();
                }
                app::mark_started(key.clone());
                app::wait_for_gate(&key).await;
                let second = "UPDATE stock SET n = n - 1 WHERE id = 2";
                match H::exec(&mut tx, second, &[]).await {
                    Ok(_) => (StatusCode::CREATED, "moved").into_response(),
                    Err(error) => {
                        // Fails on PostgreSQL (the transaction is aborted); on MySQL
                        // it waits uncommitted, and idem rolls it back.
                        let audit = "INSERT INTO stock_audit (what) VALUES ($1)";
                        let _ = H::exec(&mut tx, audit, &["deadlock"]).await;
                        let body = format!(
                            r#"{{"error":"busy","cause":"{}"}}"#,
                            error.to_string().len()
                        );
                        Response::builder()
                            .status(StatusCode::CONFLICT)
                            .body(Body::from(body))
                            .unwrap_or_else(|_| StatusCode::CONFLICT.into_response())
                    }
                }
            })
        })
        .await
}

/// The handler's own answer to a deadlock it caught is recorded and replayed, on
/// every backend that has deadlocks; none of what the database undid comes back,
/// and a retry does not write again.
async fn caught_deadlocks_are_recorded<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    h.script(
        "CREATE TABLE stock (id INT PRIMARY KEY, n INT NOT NULL); \
         CREATE TABLE stock_audit (what VARCHAR(32) NOT NULL); \
         INSERT INTO stock (id, n) VALUES (1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (6, 0), \
             (7, 0), (8, 0), (9, 0), (10, 0), (11, 0), (12, 0)",
    )
    .await;
    let shop = Router::new()
        .route("/stock", post(move_stock::<H>))
        .with_state(Shop::<H>(h.store().clone()));
    let key = format!("k-deadlock-{}", crate::unique_suffix());
    let req = Req::post("alice", &key, BODY).path("/stock");
    let first = {
        let (shop, req) = (shop.clone(), req.clone());
        tokio::spawn(async move { app::send_once(&shop, &req).await })
    };
    await_started(&key).await;

    // Another session takes row 2 and more (InnoDB rolls back the transaction
    // that did less), then row 1, after the handler waits for row 2.
    // READ COMMITTED: on a SERIALIZABLE run it must not be the one refused.
    let mut other = h
        .direct_pool()
        .begin_with(H::BEGIN_READ_COMMITTED)
        .await
        .expect("begin");
    if let Some(outlast) = H::OUTLAST_DEADLOCKS {
        H::exec(&mut other, outlast, &[]).await.expect(outlast);
    }
    H::exec(&mut other, "UPDATE stock SET n = n + 10 WHERE id >= 2", &[])
        .await
        .expect("rows 2..12");
    app::open_gate(&key);
    let deadline = Instant::now() + Duration::from_secs(10);
    while h.count(H::LOCK_WAITS, &[]).await == 0 {
        assert!(
            Instant::now() < deadline,
            "the handler never waited for row 2"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    H::exec(&mut other, "UPDATE stock SET n = n + 100 WHERE id = 1", &[])
        .await
        .expect("row 1, once the handler's transaction is gone");
    other.commit().await.expect("commit");

    let got = first.await.expect("request");
    if app::serializable_run() && app::is_serialization_failure(got.status, &got.body) {
        // SERIALIZABLE may refuse the commit of the transaction the deadlock broke:
        // nothing of it committed, and the client's retry runs the handler whole.
        let retry = send(&shop, &req).await;
        assert_eq!(retry.status, 201, "{}", retry.text());
        let row1 = h
            .count("SELECT count(*) FROM stock WHERE id = 1 AND n = 101", &[])
            .await;
        assert_eq!(row1, 1, "the other session's 100 and the retry's 1");
        assert_eq!(h.count("SELECT count(*) FROM stock_audit", &[]).await, 0);
        h.finish().await;
        return;
    }
    assert_eq!(got.status, 409, "{}", got.text());
    assert_eq!(
        got.problem(),
        None,
        "the handler's own answer: {}",
        got.text()
    );
    let retry = send(&shop, &req).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed), "{}", retry.text());
    assert_eq!(retry.body, got.body);
    let row1 = h
        .count("SELECT count(*) FROM stock WHERE id = 1 AND n = 100", &[])
        .await;
    assert_eq!(
        row1, 1,
        "the handler's increment was undone with its transaction"
    );
    let audits = h.count("SELECT count(*) FROM stock_audit", &[]).await;
    assert_eq!(
        audits, 0,
        "written after the deadlock, outside the transaction idem records in: never committed"
    );
    let rows = h.key_rows("alice").await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].1.status, Some(409));
    h.finish().await;
}

// SQLite has one writer, hence no deadlock.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_caught_deadlocks_are_recorded() {
    caught_deadlocks_are_recorded::<Pg>().await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_partitioned_caught_deadlocks_are_recorded() {
    caught_deadlocks_are_recorded::<PgParted>().await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_caught_deadlocks_are_recorded() {
    caught_deadlocks_are_recorded::<My>().await;
}
