use axum::http::StatusCode;
use idem_axum::{idempotent, Tx};
use sqlx::Sqlite;

#[idempotent(unscoped = true, key = json("/id"), verify = String)]
async fn refund(tx: Tx<Sqlite>, body: String) -> StatusCode {
    let _ = (tx, body);
    StatusCode::OK
}

fn main() {}
