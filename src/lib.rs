//! Exactly-once HTTP handlers, with the state kept in your own SQL database.
//!
//! Clients retry: a phone loses signal, a browser submits twice, a load balancer
//! replays. `idem` makes a non-idempotent handler (a payment, a transfer, an order)
//! safe to retry under an `Idempotency-Key`: the handler's writes and its recorded
//! response commit in ONE transaction of your database, a completed request is
//! replayed byte for byte, a concurrent duplicate is answered 409 instead of running
//! a second time, and a crashed or hung executor is taken over without ever
//! committing late.
//!
//! | situation | answer |
//! | --- | --- |
//! | no key, endpoint not `required` | the handler runs, nothing is stored |
//! | no key, endpoint `required` | 400 `missing-key` |
//! | malformed or repeated key | 400 `invalid-key` |
//! | first request for (scope, key) | the handler runs; its response is recorded with its writes |
//! | same key and request, completed | the stored response, plus `Idempotent-Replayed: true` |
//! | same key and request, in flight | 409 `in-flight`, `Retry-After: 1` |
//! | same key, another method, path or body | 422 `payload-mismatch` |
//! | handler answers ≥ 500, panics, or outlives its `lock` | rolled back, key released: a retry runs it again |
//! | key older than its `ttl` | treated as never seen |
//!
//! Every answer idem gives itself is an RFC 9457 `application/problem+json` body
//! whose `type` ends with the slug above (see [`Problem`]).
//!
//! # Backends
//!
//! - PostgreSQL (feature `postgres`): the claim lives inside the handler's
//!   transaction, guarded by a transaction-scoped advisory try-lock, so a duplicate
//!   answers 409 at once and a dead executor's claim vanishes with its connection.
//!   See [`Backend`] for what each backend relies on.
//! - SQLite (feature `sqlite`): a committed claim with a lease, then the handler's
//!   `BEGIN IMMEDIATE` transaction. One writer at a time: a handler holds SQLite's
//!   write lock for as long as its transaction is open.
//!
//! # Using it by hand
//!
//! The `#[idempotent]` attribute is the usual way in; without it, the axum
//! extractor [`axum::IdempotentRequest`] runs a closure under the engine:
//!
//! ```rust,no_run
//! use axum::{Router, extract::FromRef, http::StatusCode, response::IntoResponse, routing::post};
//! use idem::axum::IdempotentRequest;
//! use idem::{Idempotency, Options};
//! use sqlx::Sqlite;
//!
//! #[derive(Clone, FromRef)]
//! struct AppState {
//!     idempotency: Idempotency<Sqlite>,
//! }
//!
//! async fn transfer(request: IdempotentRequest<Sqlite>) -> axum::response::Response {
//!     let body = request.body().clone();
//!     request
//!         .run("user-7", Options::new().required(true), move |mut tx| {
//!             Box::pin(async move {
//!                 let moved = sqlx::query("INSERT INTO transfers (body) VALUES ($1)")
//!                     .bind(body.to_vec())
//!                     .execute(&mut *tx)
//!                     .await;
//!                 match moved {
//!                     Ok(_) => (StatusCode::CREATED, "done").into_response(),
//!                     Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
//!                 }
//!             })
//!         })
//!         .await
//! }
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::SqlitePool::connect("sqlite://app.db?mode=rwc").await?;
//! let idempotency = Idempotency::new(pool);
//! idempotency.migrate().await?;
//! let app: Router = Router::new()
//!     .route("/transfers", post(transfer))
//!     .with_state(AppState { idempotency });
//! # Ok(()) }
//! ```

pub use idem_macros::idempotent;
pub use idem_runtime::{
    Backend, Builder, ConfigError, DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_PROBLEM_BASE, DEFAULT_TABLE,
    HandlerFuture, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, Idempotency, IdempotencyKey, InvalidKey,
    MAX_KEY_LEN, Options, Outcome, Problem, RequestIdentity, Scope, Tx, fingerprint,
};

#[cfg(feature = "axum")]
pub use idem_runtime::axum;

/// Not public API: the paths generated code reaches the runtime through.
#[doc(hidden)]
#[cfg(feature = "axum")]
pub mod __private {
    pub use idem_runtime::__macro_support::*;
}
