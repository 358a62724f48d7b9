use axum::Extension;
use axum::http::StatusCode;
use idem_axum::{idempotent, Tx};
use sqlx::Sqlite;

#[idempotent(scope = "user_id")]
async fn pay(user: Extension<String>, tx: Tx<Sqlite>) -> StatusCode {
    let _ = (user, tx);
    StatusCode::CREATED
}

fn main() {}
