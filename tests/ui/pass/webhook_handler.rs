//! Webhook receivers: the key where the sender puts it (a header of its own, in
//! any case; a member of the body), and the sender's signature checked first by
//! a verifier taken from the router's state.

use axum::extract::{FromRef, Json};
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use idem_axum::webhook::{StandardWebhooks, StripeSignature};
use idem_axum::{idempotent, Idempotency, Tx};
use serde::Deserialize;
use sqlx::Sqlite;

#[derive(Clone)]
struct AppState {
    store: Idempotency<Sqlite>,
    svix: StandardWebhooks,
    stripe: StripeSignature,
}

impl FromRef<AppState> for Idempotency<Sqlite> {
    fn from_ref(state: &AppState) -> Self {
        state.store.clone()
    }
}

impl FromRef<AppState> for StandardWebhooks {
    fn from_ref(state: &AppState) -> Self {
        state.svix.clone()
    }
}

impl FromRef<AppState> for StripeSignature {
    fn from_ref(state: &AppState) -> Self {
        state.stripe.clone()
    }
}

#[derive(Deserialize)]
struct Event {
    #[serde(rename = "type")]
    kind: String,
}

#[idempotent(unscoped = true, key = header("Webhook-Id"), verify = StandardWebhooks, ttl = "3d")]
async fn svix(mut tx: Tx<Sqlite>, Json(event): Json<Event>) -> StatusCode {
    let booked = sqlx::query("INSERT INTO refunds (kind) VALUES (?)")
        .bind(event.kind)
        .execute(&mut *tx)
        .await;
    if booked.is_ok() { StatusCode::OK } else { StatusCode::INTERNAL_SERVER_ERROR }
}

#[idempotent(unscoped = true, key = json("/data/object/id"), verify = StripeSignature, required = true)]
async fn stripe(tx: Tx<Sqlite>, body: String) -> (StatusCode, String) {
    let _ = tx;
    (StatusCode::OK, body)
}

// Unsigned: the key from a header alone.
#[idempotent(unscoped = true, key = header("x-github-delivery"))]
async fn github(tx: Tx<Sqlite>) -> StatusCode {
    let _ = tx;
    StatusCode::NO_CONTENT
}

fn main() {
    let _: Router<AppState> = Router::new()
        .route("/webhooks/svix", post(svix))
        .route("/webhooks/stripe", post(stripe))
        .route("/webhooks/github", post(github));
}
