//! A renamed dependency (`pay = { package = "idem-axum", … }` in Cargo.toml): the
//! attribute is told the name with `crate = "…"`, and the generated code uses it.

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use pay::{idempotent, Idempotency, Tx};
use sqlx::Sqlite;

#[idempotent(crate = "pay", unscoped = true)]
async fn transfer(tx: Tx<Sqlite>) -> StatusCode {
    let _ = tx;
    StatusCode::CREATED
}

mod app {
    /// A re-export works as well.
    pub use pay as idem;
}

#[idempotent(crate = "app::idem", unscoped = true, lock = "5s")]
async fn refund(tx: Tx<Sqlite>) -> StatusCode {
    let _ = tx;
    StatusCode::CREATED
}

fn main() {
    let _ = |store: Idempotency<Sqlite>| -> Router {
        Router::new()
            .route("/transfer", post(transfer))
            .route("/refund", post(refund))
            .with_state(store)
    };
}
