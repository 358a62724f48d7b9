//! A handler generic over the database, instantiated for SQLite.

use axum::extract::{FromRef, FromRequestParts};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use idem_axum::{idempotent, Backend, Idempotency, Tx};
use sqlx::Sqlite;

struct UserId(u64);

impl<S: Send + Sync> FromRequestParts<S> for UserId {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        parts
            .headers
            .get("x-user")
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .map(UserId)
            .ok_or(StatusCode::UNAUTHORIZED)
    }
}

impl idem_axum::Scope for UserId {
    fn scope(&self) -> std::borrow::Cow<'_, str> {
        self.0.to_string().into()
    }
}

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Idempotency<Sqlite>,
}

/// Doc comments and attributes stay on the rewritten handler.
#[idempotent(scope = "user", ttl = "1h", lock = "10s")]
#[allow(clippy::unused_async)]
pub async fn record<DB: Backend>(user: UserId, tx: Tx<DB>, body: Bytes) -> (StatusCode, String) {
    let _ = &tx;
    (StatusCode::CREATED, format!("{} sent {} bytes", user.0, body.len()))
}

fn app(idempotency: Idempotency<Sqlite>) -> Router {
    Router::new()
        .route("/records", post(record::<Sqlite>))
        .with_state(AppState { idempotency })
}

fn main() {
    let _ = app;
}
