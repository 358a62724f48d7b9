//! `#[axum::debug_handler]` above `#[idempotent]` checks the function as written;
//! below it, the rewritten one (which keeps the same parameters, in place).

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router, debug_handler};
use idem_axum::{idempotent, Idempotency, IdempotencyKey, Tx};
use serde::Deserialize;
use sqlx::Sqlite;

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Idempotency<Sqlite>,
    bank: String,
}

#[derive(Deserialize)]
struct Order {
    item: String,
}

#[debug_handler]
#[idempotent(unscoped = true)]
async fn above(mut tx: Tx<Sqlite>, key: IdempotencyKey, Json(order): Json<Order>) -> StatusCode {
    let inserted = sqlx::query("INSERT INTO orders (item, ref) VALUES (?1, ?2)")
        .bind(&order.item)
        .bind(key.derive("order"))
        .execute(&mut *tx)
        .await;
    match inserted {
        Ok(_) => StatusCode::CREATED,
        Err(_) => StatusCode::SERVICE_UNAVAILABLE,
    }
}

#[idempotent(scope = "bank")]
#[debug_handler]
async fn below(
    State(AppState { bank, .. }): State<AppState>,
    mut tx: Tx<Sqlite>,
    body: String,
) -> StatusCode {
    let inserted = sqlx::query("INSERT INTO notes (bank, body) VALUES (?1, ?2)")
        .bind(bank)
        .bind(body)
        .execute(&mut *tx)
        .await;
    match inserted {
        Ok(_) => StatusCode::CREATED,
        Err(_) => StatusCode::SERVICE_UNAVAILABLE,
    }
}

#[idempotent(unscoped = true)]
#[debug_handler(state = AppState)]
async fn below_without_state(tx: Tx<Sqlite>, body: String) -> String {
    drop(tx);
    body
}

fn main() {
    let _app = |state: AppState| -> Router {
        Router::new()
            .route("/above", post(above))
            .route("/below", post(below))
            .route("/below-without-state", post(below_without_state))
            .with_state(state)
    };
}
