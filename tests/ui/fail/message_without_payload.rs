use idem_axum::{idempotent, Tx};
use sqlx::Sqlite;

#[idempotent(message, key = id, scope = "orders")]
async fn charge(id: String, tx: Tx<Sqlite>) -> Result<(), sqlx::Error> {
    let _ = (id, tx);
    Ok(())
}

fn main() {}
