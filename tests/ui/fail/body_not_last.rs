use axum::http::StatusCode;
use axum::Json;
use idem_axum::{idempotent, Tx};
use sqlx::Sqlite;

#[derive(serde::Deserialize)]
struct Transfer {
    amount: i64,
}

#[idempotent(unscoped = true)]
async fn transfer(Json(t): Json<Transfer>, tx: Tx<Sqlite>) -> StatusCode {
    let _ = (t.amount, tx);
    StatusCode::CREATED
}

// Routed as usual: the route adds no error of its own.
fn main() {
    let _ = |store: idem_axum::Idempotency<sqlx::Sqlite>| -> axum::Router {
        axum::Router::new()
            .route("/", axum::routing::post(transfer))
            .with_state(store)
    };
}
