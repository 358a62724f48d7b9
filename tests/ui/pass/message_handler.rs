//! Message handlers: the key, the scope and the payload are expressions over the
//! arguments; the result is any `Replayable`, under `Result` or an alias of it.

use idem_axum::{idempotent, Idempotency, JsonRecord, Processed, Tx};
use serde::{Deserialize, Serialize};
use sqlx::{Postgres, Sqlite};

#[derive(Deserialize)]
struct Order {
    id: u64,
    shop: String,
}

#[derive(Serialize, Deserialize)]
struct Receipt {
    charge: String,
}

#[idempotent(message, key = order.id, scope = order.shop, payload = &body, ttl = "7d", lock = "10s")]
async fn charge(
    body: Vec<u8>,
    order: Order,
    mut tx: Tx<Postgres>,
) -> Result<JsonRecord<Receipt>, sqlx::Error> {
    sqlx::query("INSERT INTO charges (order_id) VALUES ($1)")
        .bind(order.id as i64)
        .execute(&mut *tx)
        .await?;
    Ok(JsonRecord(Receipt { charge: format!("ch_{}", order.id) }))
}

type Outcome<T> = Result<T, std::io::Error>;

/// An id that may be missing, a fixed scope, a JSON fingerprint, an early return.
#[idempotent(message, key = id.as_deref(), scope = "refunds", payload = payload,
             fingerprint = "json", ignore = ["/sent_at"], wait = "2s")]
pub async fn refund(id: Option<String>, payload: String, tx: Tx<Sqlite>) -> Outcome<String> {
    if payload.is_empty() {
        return Ok(String::new());
    }
    drop(tx);
    Ok(payload)
}

async fn consume(pg: &Idempotency<Postgres>, lite: &Idempotency<Sqlite>) {
    let order = Order { id: 7, shop: "shop-1".into() };
    let processed: Processed<JsonRecord<Receipt>, sqlx::Error> =
        charge(pg, br#"{"id":7}"#.to_vec(), order).await;
    let _ = processed.action();
    let again: Processed<String, std::io::Error> =
        refund(lite, Some("r-1".into()), r#"{"amount":1}"#.into()).await;
    let _ = again;
}

fn main() {
    let _ = consume;
}
