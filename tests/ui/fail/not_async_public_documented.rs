//! A crate that denies missing docs: the attribute's error comes alone.
#![deny(missing_docs)]

use axum::http::StatusCode;
use idem_axum::{idempotent, Tx};
use sqlx::Sqlite;

/// Pays.
#[idempotent(unscoped = true)]
pub fn pay(tx: Tx<Sqlite>) -> StatusCode {
    let _ = tx;
    StatusCode::CREATED
}

fn main() {}
