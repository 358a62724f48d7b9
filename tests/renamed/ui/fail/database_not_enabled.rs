//! This crate enables idem-axum's `sqlite` feature only: an app on PostgreSQL is
//! told which feature to enable, once for its handler and once where it builds
//! the store; naming `Idempotency<Postgres>` elsewhere is no error of its own.

use pay::{idempotent, Idempotency, Tx};
use sqlx::{PgPool, Postgres};

#[idempotent(crate = "pay", unscoped = true)]
async fn transfer(tx: Tx<Postgres>) {
    let _ = tx;
}

fn app(store: Idempotency<Postgres>) -> axum::Router {
    axum::Router::new()
        .route("/transfer", axum::routing::post(transfer))
        .with_state(store)
}

async fn serve(pool: PgPool) -> axum::Router {
    let store = Idempotency::new(pool);
    app(store)
}

fn main() {
    let _ = serve;
}
