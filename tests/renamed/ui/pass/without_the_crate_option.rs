//! Renamed in Cargo.toml (`pay = { package = "idem-axum", … }`) and the
//! attribute is not told: it reads the name from Cargo.toml, as `crate = "pay"`
//! would give it.

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use pay::{idempotent, Idempotency, Tx};
use sqlx::Sqlite;

#[idempotent(unscoped = true)]
async fn transfer(tx: Tx<Sqlite>) -> StatusCode {
    let _ = tx;
    StatusCode::CREATED
}

#[idempotent(unscoped = true, ttl = "1h", lock = "5s")]
async fn refund(tx: Tx<Sqlite>) -> StatusCode {
    let _ = tx;
    StatusCode::CREATED
}

fn main() {
    let _ = |store: Idempotency<Sqlite>| -> Router {
        Router::new()
            .route("/transfer", post(transfer))
            .route("/refund", post(refund))
            .with_state(store)
    };
}
