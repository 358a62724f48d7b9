use axum::http::StatusCode;
use idem_axum::{idempotent, Tx};
use sqlx::Sqlite;

#[idempotent(unscoped = true, release_on = [408, 429, 408])]
async fn pay(tx: Tx<Sqlite>) -> StatusCode {
    let _ = tx;
    StatusCode::CREATED
}

fn main() {}
