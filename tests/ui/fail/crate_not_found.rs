use idem_axum::{idempotent, Tx};
use sqlx::Postgres;

// The generated code names the crate exactly as told.
#[idempotent(crate = "payments", unscoped = true)]
async fn transfer(tx: Tx<Postgres>) {
    let _ = tx;
}

fn main() {}
