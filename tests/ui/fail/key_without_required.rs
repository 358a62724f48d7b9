use axum::http::StatusCode;
use idem_axum::{idempotent, Tx};
use sqlx::Sqlite;

use idem_axum::IdempotencyKey;

#[idempotent(unscoped = true, required = false)]
async fn pay(key: IdempotencyKey, tx: Tx<Sqlite>) -> StatusCode {
    let _ = (key, tx);
    StatusCode::CREATED
}

fn main() {}
