//! `fingerprint = "json"` with pointers to leave out, on a `Json<T>` handler, and
//! the default spelled out.

use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem_axum::{idempotent, Idempotency, Tx};
use serde::Deserialize;
use sqlx::Sqlite;

#[derive(Deserialize)]
struct Payment {
    amount: i64,
}

#[idempotent(unscoped = true, fingerprint = "json", ignore = ["/sent_at", "/meta/a~1b", "/items/0"])]
async fn pay(tx: Tx<Sqlite>, Json(payment): Json<Payment>) -> StatusCode {
    let _ = (tx, payment.amount);
    StatusCode::CREATED
}

#[idempotent(unscoped = true, fingerprint = "bytes")]
async fn refund(tx: Tx<Sqlite>, body: String) -> StatusCode {
    let _ = (tx, body);
    StatusCode::CREATED
}

fn main() {
    let _app = |store: Idempotency<Sqlite>| -> Router {
        Router::new()
            .route("/payments", post(pay))
            .route("/refunds", post(refund))
            .with_state(store)
    };
}
