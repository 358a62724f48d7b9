//! This crate enables idem-axum's `sqlite` feature only: a PostgreSQL handler and
//! store are told which feature to enable.

use pay::{idempotent, Idempotency, Tx};
use sqlx::Postgres;

#[idempotent(crate = "pay", unscoped = true)]
async fn transfer(tx: Tx<Postgres>) {
    let _ = tx;
}

fn main() {
    let _ = |store: Idempotency<Postgres>| {
        axum::Router::new()
            .route("/transfer", axum::routing::post(transfer))
            .with_state(store)
    };
}
