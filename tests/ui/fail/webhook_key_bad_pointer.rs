use axum::http::StatusCode;
use idem_axum::{idempotent, Tx};
use sqlx::Sqlite;

#[idempotent(unscoped = true, key = json("id"))]
async fn refund(tx: Tx<Sqlite>) -> StatusCode {
    let _ = tx;
    StatusCode::OK
}

fn main() {}
