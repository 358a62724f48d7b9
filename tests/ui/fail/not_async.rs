use axum::http::StatusCode;
use idem_axum::{idempotent, Tx};
use sqlx::Sqlite;

#[idempotent(unscoped = true)]
fn pay(tx: Tx<Sqlite>) -> StatusCode {
    let _ = tx;
    StatusCode::CREATED
}

// Routed as usual: the route adds no error of its own.
fn main() {
    let _ = |store: idem_axum::Idempotency<sqlx::Sqlite>| -> axum::Router {
        axum::Router::new()
            .route("/", axum::routing::post(pay))
            .with_state(store)
    };
}
