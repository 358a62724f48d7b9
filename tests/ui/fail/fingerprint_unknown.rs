use axum::http::StatusCode;
use idem_axum::{idempotent, Tx};
use sqlx::Sqlite;

#[idempotent(unscoped = true, fingerprint = "canonical")]
async fn pay(tx: Tx<Sqlite>, body: String) -> StatusCode {
    let _ = (tx, body);
    StatusCode::CREATED
}

fn main() {}
