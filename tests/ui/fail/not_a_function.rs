use axum::http::StatusCode;
use idem_axum::{idempotent, Tx};
use sqlx::Sqlite;

#[idempotent]
struct Payment {
    amount: u64,
}

fn main() {
    let _ = (Payment { amount: 1 }.amount, StatusCode::OK, std::marker::PhantomData::<Tx<Sqlite>>);
}
