use idem_axum::{idempotent, Tx};
use sqlx::Sqlite;

#[idempotent(message, key = id, scope = "orders", payload = &body)]
async fn charge(id: String, body: Vec<u8>, tx: Tx<Sqlite>) -> Option<String> {
    let _ = (body, tx);
    Some(id)
}

fn main() {}
