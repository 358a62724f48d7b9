use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use idem_axum::{idempotent, Idempotency, Scope, Tx};
use sqlx::Sqlite;

struct User(String);

impl Scope for User {
    fn scope(&self) -> std::borrow::Cow<'_, str> {
        self.0.as_str().into()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for User {
    type Rejection = StatusCode;

    async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        Ok(User("u".into()))
    }
}

// A scope must be there: an anonymous caller has no key space of its own.
#[idempotent(scope = "user")]
async fn pay(user: Option<User>, tx: Tx<Sqlite>) -> StatusCode {
    let _ = (user, tx);
    StatusCode::CREATED
}

fn main() {
    let _ = |store: Idempotency<Sqlite>| -> Router { Router::new().route("/pay", post(pay)).with_state(store) };
}
