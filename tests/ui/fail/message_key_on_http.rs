use axum::http::StatusCode;
use idem_axum::{idempotent, Tx};
use sqlx::Sqlite;

#[idempotent(scope = "user", key = user)]
async fn pay(user: axum::Extension<String>, tx: Tx<Sqlite>) -> StatusCode {
    let _ = (user, tx);
    StatusCode::CREATED
}

fn main() {}
