//! Renamed in Cargo.toml, but the attribute is not told: the generated code looks
//! for `idem_axum`, and the error says so.

use pay::{idempotent, Tx};
use sqlx::Sqlite;

#[idempotent(unscoped = true)]
async fn transfer(tx: Tx<Sqlite>) {
    let _ = tx;
}

fn main() {}
