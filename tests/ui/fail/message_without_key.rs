use idem_axum::{idempotent, Tx};
use sqlx::Sqlite;

#[idempotent(message, scope = "orders", payload = &body)]
async fn charge(body: Vec<u8>, tx: Tx<Sqlite>) -> Result<(), sqlx::Error> {
    let _ = (body, tx);
    Ok(())
}

fn main() {}
