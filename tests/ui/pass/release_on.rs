//! `release_on` takes a list of 4xx statuses, or none, beside the other options.

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use idem_axum::{idempotent, Idempotency, Tx};
use sqlx::Postgres;

#[idempotent(unscoped = true, lock = "30s", release_on = [409, 429])]
async fn transfer(tx: Tx<Postgres>) -> StatusCode {
    let _ = tx;
    StatusCode::CREATED
}

#[idempotent(unscoped = true, release_on = [])]
async fn record_every_answer(tx: Tx<Postgres>) -> StatusCode {
    let _ = tx;
    StatusCode::TOO_MANY_REQUESTS
}

fn main() {
    let _ = |store: Idempotency<Postgres>| -> Router {
        Router::new()
            .route("/transfer", post(transfer))
            .route("/any", post(record_every_answer))
            .with_state(store)
    };
}
