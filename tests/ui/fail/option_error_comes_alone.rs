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

#[idempotent(unscoped = true, ttl = "24 hours")]
async fn pay(tx: Tx<Sqlite>, body: String) -> StatusCode {
    let _ = (tx, body);
    StatusCode::CREATED
}

fn main() {
    let _app = |state: AppState| -> Router {
        Router::new().route("/pay", post(pay)).with_state(state)
    };
}
