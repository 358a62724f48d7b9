//! State, extractors before the body, the key for relay, the transaction, a `Form`
//! body, `?` on the handler's own error type and an early `return`.

use axum::extract::{FromRef, FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Form, Router};
use idem_axum::{idempotent, Idempotency, IdempotencyKey, Tx};
use serde::Deserialize;
use sqlx::Sqlite;

struct UserId(String);

impl<S: Send + Sync> FromRequestParts<S> for UserId {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        let user = parts.headers.get("x-user").and_then(|v| v.to_str().ok());
        user.map(|u| UserId(u.to_owned())).ok_or(StatusCode::UNAUTHORIZED)
    }
}

impl idem_axum::Scope for UserId {
    fn scope(&self) -> std::borrow::Cow<'_, str> {
        self.0.as_str().into()
    }
}

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Idempotency<Sqlite>,
    currency: &'static str,
}

#[derive(Deserialize)]
struct Order {
    item: String,
    quantity: u32,
}

struct AppError(sqlx::Error);

impl From<sqlx::Error> for AppError {
    fn from(error: sqlx::Error) -> Self {
        Self(error)
    }
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        (StatusCode::INTERNAL_SERVER_ERROR, self.0.to_string()).into_response()
    }
}

#[idempotent(scope = "user", ttl = "15m", lock = "500ms", required = true)]
async fn place_order(
    State(state): State<AppState>,
    headers: HeaderMap,
    user: UserId,
    key: IdempotencyKey,
    mut tx: Tx<Sqlite>,
    Form(order): Form<Order>,
) -> Result<(StatusCode, String), AppError> {
    if order.quantity == 0 {
        return Ok((StatusCode::UNPROCESSABLE_ENTITY, "empty order".to_owned()));
    }
    sqlx::query("INSERT INTO orders (user_id, item, quantity, supplier_key) VALUES (?, ?, ?, ?)")
        .bind(&user.0)
        .bind(&order.item)
        .bind(order.quantity)
        .bind(key.derive("supplier"))
        .execute(&mut *tx)
        .await?;
    let agent = headers.get("user-agent").map(|v| v.len()).unwrap_or(0);
    Ok((
        StatusCode::CREATED,
        format!("{} × {} in {} ({agent})", order.quantity, order.item, state.currency),
    ))
}

fn main() {
    let _ = |state: AppState| -> Router { Router::new().route("/orders", post(place_order)).with_state(state) };
}
