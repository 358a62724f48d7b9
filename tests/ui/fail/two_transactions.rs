use axum::http::StatusCode;
use idem_axum::{idempotent, Tx};
use sqlx::Sqlite;

#[idempotent(unscoped = true)]
async fn pay(tx: Tx<Sqlite>, other: Tx<Sqlite>) -> StatusCode {
    let _ = (tx, other);
    StatusCode::CREATED
}

fn main() {}
