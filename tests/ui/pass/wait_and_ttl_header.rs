//! `wait` takes a duration and `ttl_header` a bool, beside the other options.

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use idem_axum::{idempotent, Idempotency, Tx};
use sqlx::Postgres;

#[idempotent(unscoped = true, ttl = "24h", lock = "30s", wait = "5s", ttl_header = true)]
async fn pay(tx: Tx<Postgres>, body: String) -> (StatusCode, String) {
    let _ = tx;
    (StatusCode::CREATED, body)
}

fn main() {
    let _ = |store: Idempotency<Postgres>| -> Router {
        Router::new().route("/pay", post(pay)).with_state(store)
    };
}
