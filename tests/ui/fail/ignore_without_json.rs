use axum::http::StatusCode;
use idem_axum::{idempotent, Tx};
use sqlx::Sqlite;

#[idempotent(unscoped = true, ignore = ["/sent_at"])]
async fn pay(tx: Tx<Sqlite>, body: String) -> StatusCode {
    let _ = (tx, body);
    StatusCode::CREATED
}

fn main() {}
