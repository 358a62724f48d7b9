use axum::http::StatusCode;
use idem_axum::{idempotent, Tx};
use sqlx::Sqlite;

struct Account {
    id: u64,
}

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Account {
    type Rejection = StatusCode;

    async fn from_request_parts(_: &mut axum::http::request::Parts, _: &S) -> Result<Self, StatusCode> {
        Ok(Account { id: 1 })
    }
}

#[idempotent(scope = "account")]
async fn pay(account: Account, tx: Tx<Sqlite>) -> StatusCode {
    let _ = (account.id, tx);
    StatusCode::CREATED
}

fn main() {}
