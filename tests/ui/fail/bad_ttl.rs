use axum::http::StatusCode;
use idem_axum::{idempotent, Tx};
use sqlx::Sqlite;

#[idempotent(unscoped = true, ttl = "24x")]
async fn pay(tx: Tx<Sqlite>) -> StatusCode {
    let _ = tx;
    StatusCode::CREATED
}

fn main() {}
