use idem_axum::{idempotent, Tx};
use sqlx::Sqlite;

#[idempotent(message, key = id, scope = "orders", payload = &body, verify = idem_axum::webhook::StandardWebhooks)]
async fn charge(id: String, body: Vec<u8>, tx: Tx<Sqlite>) -> Result<(), sqlx::Error> {
    let _ = (id, body, tx);
    Ok(())
}

fn main() {}
