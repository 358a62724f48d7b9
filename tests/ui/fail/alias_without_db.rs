use axum::http::StatusCode;
use idem_axum::{idempotent, Tx};
use sqlx::Sqlite;

type LiteTx = Tx<Sqlite>;

#[idempotent(unscoped = true)]
async fn pay(tx: LiteTx) -> StatusCode {
    let _ = tx;
    StatusCode::CREATED
}

fn main() {}
