use idem_axum::{idempotent, Tx};
use sqlx::Sqlite;

struct Receipt {
    charge: String,
}

#[idempotent(message, key = id, scope = "orders", payload = &body)]
async fn charge(id: String, body: Vec<u8>, tx: Tx<Sqlite>) -> Result<Receipt, sqlx::Error> {
    let _ = (body, tx);
    Ok(Receipt { charge: id })
}

fn main() {}
