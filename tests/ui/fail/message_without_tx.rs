use idem_axum::idempotent;

#[idempotent(message, key = id, scope = "orders", payload = &body, db = sqlx::Sqlite)]
async fn charge(id: String, body: Vec<u8>) -> Result<(), sqlx::Error> {
    let _ = (id, body);
    Ok(())
}

fn main() {}
