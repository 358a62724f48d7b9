use axum::http::StatusCode;
use idem_axum::{idempotent, IdempotencyKey, Tx};
use sqlx::Sqlite;

#[idempotent(unscoped = true, key = header("webhook-id"))]
async fn refund(key: IdempotencyKey, tx: Tx<Sqlite>) -> StatusCode {
    let _ = (key, tx);
    StatusCode::OK
}

fn main() {}
