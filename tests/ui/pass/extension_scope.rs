//! The usual axum auth pattern: a layer inserts the user, and the handler scopes
//! its keys by the `Extension` as it is or destructured.

use std::borrow::Cow;

use axum::http::StatusCode;
use axum::routing::post;
use axum::{Extension, Router};
use idem_axum::{idempotent, Idempotency, Scope, Tx};
use sqlx::Postgres;

#[derive(Clone)]
struct CurrentUser {
    id: u64,
}

impl Scope for CurrentUser {
    fn scope(&self) -> Cow<'_, str> {
        self.id.scope()
    }
}

#[idempotent(scope = "user")]
async fn pay(user: Extension<CurrentUser>, tx: Tx<Postgres>) -> StatusCode {
    let _ = (user.id, tx);
    StatusCode::CREATED
}

#[idempotent(scope = "user")]
async fn refund(Extension(user): Extension<CurrentUser>, tx: Tx<Postgres>) -> StatusCode {
    let _ = (user.id, tx);
    StatusCode::CREATED
}

fn main() {
    let _ = |store: Idempotency<Postgres>| -> Router {
        Router::new()
            .route("/pay", post(pay))
            .route("/refund", post(refund))
            .layer(Extension(CurrentUser { id: 7 }))
            .with_state(store)
    };
}
