use idem_axum::{idempotent, Tx};
use sqlx::Sqlite;

#[idempotent(message, key = id, scope = "shop", payload = &body)]
async fn charge(shop: String, id: String, body: Vec<u8>, tx: Tx<Sqlite>) -> Result<(), sqlx::Error> {
    let _ = (shop, id, body, tx);
    Ok(())
}

fn main() {}
