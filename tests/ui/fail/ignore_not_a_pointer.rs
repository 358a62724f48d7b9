use axum::http::StatusCode;
use idem_axum::{idempotent, Tx};
use sqlx::Sqlite;

#[idempotent(
    unscoped = true,
    fingerprint = "json",
    ignore = ["sent_at", "/meta/a~2", "", "/ok", "/ok", 5]
)]
async fn pay(tx: Tx<Sqlite>, body: String) -> StatusCode {
    let _ = (tx, body);
    StatusCode::CREATED
}

fn main() {}
