//! A `Tx` owns its connection, so moving it into a spawned task compiles; the
//! engine catches it at run time (500, rolled back, nothing recorded), which the
//! conformance suite's `escaped_transactions_are_rolled_back` proves.

use axum::extract::FromRef;
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use idem_axum::{idempotent, Idempotency, Tx};
use sqlx::Sqlite;

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Idempotency<Sqlite>,
}

#[idempotent(unscoped = true)]
async fn detach(mut tx: Tx<Sqlite>) -> StatusCode {
    tokio::spawn(async move {
        let _ = sqlx::query("INSERT INTO late (at) VALUES (1)").execute(&mut *tx).await;
    });
    StatusCode::ACCEPTED
}

fn main() {
    let _app = |state: AppState| -> Router {
        Router::new().route("/detach", post(detach)).with_state(state)
    };
}
