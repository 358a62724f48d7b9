use axum::http::StatusCode;
use idem::{idempotent, Tx};
use sqlx::Sqlite;

use idem::IdempotencyKey;

#[idempotent(unscoped = true, required = false)]
async fn pay(key: IdempotencyKey, tx: Tx<Sqlite>) -> StatusCode {
    let _ = (key, tx);
    StatusCode::CREATED
}

fn main() {}
