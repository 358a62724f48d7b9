use axum::http::StatusCode;
use idem_axum::{idempotent, Tx};
use sqlx::Sqlite;

#[idempotent(unscoped = true)]
async fn pay() -> StatusCode {
    StatusCode::CREATED
}

fn main() {
    let _ = std::marker::PhantomData::<Tx<Sqlite>>;
}
