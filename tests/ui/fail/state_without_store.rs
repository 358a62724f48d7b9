use axum::routing::post;
use axum::Router;
use idem_axum::{idempotent, Tx};
use sqlx::{Sqlite, SqlitePool};

#[idempotent(unscoped = true)]
async fn transfer(tx: Tx<Sqlite>) {
    let _ = tx;
}

// The store belongs in the router state: a pool alone is a mismatch on the
// state, named as the store's type.
fn main() {
    let _ = |pool: SqlitePool| -> Router {
        Router::new().route("/transfer", post(transfer)).with_state(pool)
    };
}
