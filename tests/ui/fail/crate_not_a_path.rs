use idem_axum::{idempotent, Tx};
use sqlx::Postgres;

#[idempotent(crate = "idem axum", unscoped = true)]
async fn transfer(tx: Tx<Postgres>) {
    let _ = tx;
}

fn main() {}
