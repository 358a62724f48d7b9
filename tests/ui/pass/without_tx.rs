//! Handlers that take no transaction name their store's database with `db`; one
//! without any parameter, one with an optional key and a `Json` body.

use axum::extract::FromRef;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use idem_axum::{idempotent, Idempotency, IdempotencyKey};
use serde::Deserialize;
use sqlx::Postgres;

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Idempotency<Postgres>,
}

#[derive(Deserialize)]
struct Ping {
    message: String,
}

#[idempotent(unscoped = true, db = Postgres)]
async fn touch() -> StatusCode {
    StatusCode::NO_CONTENT
}

#[idempotent(unscoped = true, db = sqlx::Postgres, ttl = "3d")]
async fn echo(key: Option<IdempotencyKey>, Json(ping): Json<Ping>) -> impl IntoResponse {
    let relayed = key.map(|k| k.derive("echo")).unwrap_or_default();
    (StatusCode::OK, format!("{} {relayed}", ping.message))
}

fn main() {
    let _ = |state: AppState| -> Router {
        Router::new()
            .route("/touch", post(touch))
            .route("/echo", post(echo))
            .with_state(state)
    };
}
