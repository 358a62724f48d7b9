//! Exactly-once HTTP handlers, with the state kept in your own SQL database.
//!
//! Clients retry: a phone loses signal, a browser submits twice, a load balancer
//! replays. `idem` makes a non-idempotent handler (a payment, a transfer, an order)
//! safe to retry under an `Idempotency-Key`: the handler's writes and its recorded
//! response commit in ONE transaction of your database, a completed request is
//! replayed (its status, body bytes and headers, but cookies and a few that
//! describe one connection), a concurrent duplicate is answered 409 instead of running
//! a second time, and a crashed or hung executor is taken over without ever
//! committing late.
//!
#![doc = include_str!("../docs/outcomes.md")]
//!
//! Each problem's `type` ends with the slug above (see [`Problem`]).
//!
//! # The attribute
//!
//! [`idempotent`] rewrites an axum handler so that its body runs inside the
//! engine, on a transaction it writes through:
//!
//! ```rust,no_run
//! # #[cfg(feature = "postgres")]
//! # mod example {
//! use axum::{Json, Router, extract::FromRef, http::StatusCode, routing::post};
//! use idem_axum::{Idempotency, IdempotencyKey, Tx, idempotent};
//! use sqlx::Postgres;
//! # use axum::{extract::FromRequestParts, http::request::Parts};
//! # /// The authenticated user, from a real auth layer in your application.
//! # struct User(String);
//! # impl<S: Send + Sync> FromRequestParts<S> for User {
//! #     type Rejection = StatusCode;
//! #     async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
//! #         let user = parts.headers.get("x-user").and_then(|v| v.to_str().ok());
//! #         user.map(|u| User(u.to_owned())).ok_or(StatusCode::UNAUTHORIZED)
//! #     }
//! # }
//! # impl idem_axum::Scope for User {
//! #     fn scope(&self) -> std::borrow::Cow<'_, str> {
//! #         self.0.as_str().into()
//! #     }
//! # }
//!
//! #[derive(Clone, FromRef)]
//! struct AppState {
//!     idempotency: Idempotency<Postgres>,
//! }
//!
//! #[derive(serde::Deserialize)]
//! struct Transfer {
//!     to: String,
//!     amount: i64,
//! }
//!
//! #[idempotent(scope = "user", ttl = "24h", lock = "30s", required = true)]
//! async fn transfer(
//!     user: User,
//!     key: IdempotencyKey,
//!     mut tx: Tx<Postgres>,
//!     Json(t): Json<Transfer>,
//! ) -> Result<StatusCode, StatusCode> {
//!     sqlx::query("INSERT INTO transfers (owner, payee, amount, ref) VALUES ($1, $2, $3, $4)")
//!         .bind(&user.0)
//!         .bind(&t.to)
//!         .bind(t.amount)
//!         .bind(key.derive("ledger"))
//!         .execute(&mut *tx)
//!         .await
//!         .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
//!     Ok(StatusCode::CREATED)
//! }
//!
//! fn app(state: AppState) -> Router {
//!     Router::new().route("/transfers", post(transfer)).with_state(state)
//! }
//! # }
//! ```
//!
//! See [`idempotent`] for its options and parameters.
//!
//! # Features
//!
//! No database driver is compiled by default, as in sqlx: enable the backend your
//! application uses.
//!
//! | feature | what it adds |
//! | --- | --- |
//! | `axum` (default) | the `#[idempotent]` attribute, `axum::IdempotentRequest` for handlers written by hand |
//! | `executor` (default) | `&mut Tx<DB>` as an sqlx `Executor`, so helpers write `.execute(tx)`; turns on sqlx's `macros` (one of sqlx's defaults) |
//! | `postgres` | the PostgreSQL backend, and `Partitions` for its partitioned layout |
//! | `mysql` | the MySQL / MariaDB backend |
//! | `sqlite` | the SQLite backend |
//! | `client` | `idem_axum::client`, the retrying tower layer for callers |
//! | `reqwest` | `idem_axum::client::reqwest`, the same retries as `reqwest-middleware` middleware |
//! | `metrics` | counters, histograms and a gauge through the `metrics` facade (below) |
//! | `testing` | `idem_axum::testing::ExactlyOnce`, which proves in your tests that a handler runs exactly once and writes only through its `Tx` (a dev-dependency feature) |
//! | `aide` | OpenAPI through aide: `#[idempotent]` handlers document their key header, replays and idem's problems by themselves; `idem_axum::aide` |
//! | `utoipa` | OpenAPI through utoipa: `idem_axum::utoipa::KeyHeader` for `params(…)`, `Problems` for `responses(…)`, the `Replays` modifier |
//! | `sea-orm` | SeaORM 2 on the handler's transaction: `tx.sea_orm()` is a SeaORM connection whose `begin` opens a savepoint |
//! | `lapin` | `idem_axum::rabbitmq::Consumer`, the consumer's loop on RabbitMQ through lapin |
//! | `async-nats` | `idem_axum::jetstream::Consumer`, the consumer's loop on NATS JetStream through async-nats |
//! | `serde` | `JsonRecord`, a message handler's result recorded as JSON |
//! | `webhooks` | `idem_axum::webhook::{StandardWebhooks, StripeSignature}`, the senders' signatures `verify = …` checks before a webhook's key is claimed |
//!
//! ```toml
//! [dependencies]
//! idem-axum = { version = "0.1", features = ["postgres"] }
//! ```
//!
//! # Metrics
//!
//! With feature `metrics`, idem reports through the `metrics` facade to whatever
//! recorder the application installs (`metrics-exporter-prometheus`, say; the
//! payments example serves them at `/metrics`):
//!
//! | name | kind | labels | what |
//! | --- | --- | --- | --- |
//! | `idem_requests_total` | counter | `outcome`, `endpoint` | requests that reached idem, by [`Outcome`] (`executed`, `replayed`, `in_flight`, ...) |
//! | `idem_claim_duration_seconds` | histogram | `endpoint` | from the first look at a key to holding its claim |
//! | `idem_record_duration_seconds` | histogram | `endpoint` | recording the response and committing, after the handler |
//! | `idem_claims_in_flight` | gauge | | claims this process holds now |
//! | `idem_sweep_deleted_total` | counter | | expired keys the sweeper deleted |
//! | `idem_plain_replays_total` | counter | | records in plain text replayed by a store with a key ring (`Sealing::OpensSealed` or `SealsNew`, while sealing turns on or off) |
//!
//! `endpoint` is the method and the matched route (`POST /payments/{id}`), so that
//! it takes few values; see [`RequestIdentity::with_endpoint`] when calling the
//! engine by hand. Logs go through `tracing`: one span a request at DEBUG, named
//! `idem`, with its method, path, key, and once answered its outcome and status;
//! INFO for a takeover and for a record replayed in plain text by a store with a
//! key ring, WARN for a lost lease, a store error or a cancelled run.
//!
//! # Backends
//!
//! - PostgreSQL (feature `postgres`): the claim lives inside the handler's
//!   transaction, guarded by a transaction-scoped advisory try-lock, so a duplicate
//!   answers 409 at once and a dead executor's claim vanishes with its connection.
//! - MySQL and MariaDB (feature `mysql`): the same design, with `GET_LOCK(name, 0)`
//!   as the try-lock (released after every commit or rollback) and the session's
//!   `wait_timeout` ending a frozen executor.
//! - SQLite (feature `sqlite`): a committed claim with a lease, then the handler's
//!   `BEGIN IMMEDIATE` transaction. One writer at a time: a handler holds SQLite's
//!   write lock for as long as its transaction is open.
//!
//! [`Backend`] describes how each keeps the contract and what that costs, measured.
//!
//! # Retries
//!
//! The policy, on both ends of the wire:
//!
//! - A duplicate of an in-flight request is answered 409 `in-flight` with
//!   `Retry-After` set to the whole seconds left on the first request's `lock` (at
//!   least 1): by then that request has completed, or failed and freed the key, so
//!   the retry is answered for good. With `wait = "5s"` the duplicate first waits up
//!   to that long for the first request, holding no database connection, and then
//!   answers its response as a replay (see [`Options::wait`]).
//! - With `ttl_header = true`, recorded responses carry [`IDEMPOTENCY_KEY_TTL`]
//!   (`Idempotency-Key-TTL: 86400`): how long the key is kept, counted from its first
//!   request. The IETF draft has no such header yet; it is stored with the response,
//!   so replays repeat it byte for byte.
//! - The client side: with feature `client`, `idem_axum::client::RetryLayer` wraps any tower
//!   HTTP client so that each logical request gets one key for all its attempts and
//!   is retried on connection errors, 409 and 5xx, never on other 4xx; with feature
//!   `reqwest`, `idem_axum::client::reqwest::RetryMiddleware` does the same for a
//!   `reqwest-middleware` client.
//!
//! # Using it by hand
//!
//! The `#[idempotent]` attribute is the usual way in; without it, the axum
//! extractor [`axum::IdempotentRequest`] runs a closure under the engine:
//!
//! ```rust,no_run
//! # #[cfg(feature = "sqlite")]
//! # mod example {
//! use axum::{Router, extract::FromRef, http::StatusCode, response::IntoResponse, routing::post};
//! use idem_axum::axum::IdempotentRequest;
//! use idem_axum::{Idempotency, Options};
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
//! # }
//! ```
#![doc = include_str!("../docs/guarantees.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

/// Makes an axum handler exactly-once under the `Idempotency-Key` header.
///
/// ```text
/// #[idempotent(scope = "user_id", ttl = "24h", lock = "30s", required = true)]
/// ```
///
/// # Options
///
/// | option | value | default |
/// | --- | --- | --- |
/// | `scope` | the name of a parameter whose value scopes keys, e.g. the authenticated user; its type implements [`Scope`] | required, unless `unscoped = true` |
/// | `unscoped` | `true`: one key space shared by every client, for endpoints with no caller to tell apart (webhooks) | `false` |
/// | `ttl` | how long a key is remembered: `"500ms"`, `"30s"`, `"15m"`, `"24h"`, `"3d"` | `"24h"` |
/// | `lock` | the longest one execution may hold the key; shorter than `ttl` | `"30s"` |
/// | `wait` | how long a duplicate waits for an in-flight first request, then replays its response (holding no connection meanwhile); 409 at the bound | none: 409 at once |
/// | `required` | refuse requests without a key with 400 `missing-key` | `false` |
/// | `ttl_header` | recorded responses carry `Idempotency-Key-TTL: <seconds of ttl>`, replayed with them | `false` |
/// | `release_on` | the 4xx statuses that mean "not executed, try later": answered, rolled back and the key released like a 5xx, never recorded; `[]` records every answer below 500 | `[408, 425, 429]` |
/// | `fingerprint` | `"json"`: a key's later uses must carry the same JSON value, not the same bytes (member order, whitespace, `1.0` for `1` do not count; RFC 8785's canonical form); a keyed body that is not JSON is 400 `invalid-json`. `"bytes"`: the SHA-256 of the raw body; a `multipart/*` body's of its parts (names, filenames, content types, bytes), never its boundary | `"bytes"` |
/// | `ignore` | with `fingerprint = "json"`, JSON Pointers to members left out of the fingerprint, such as a time the client stamps into each send: `["/sent_at", "/meta/trace"]` | none |
/// | `db` | the database type (`Postgres`, `Sqlite`), needed only without a `Tx` parameter | taken from `Tx<DB>` |
/// | `crate` | the path your code names this crate by: a re-export of it (`crate = "my_app::idem"`), as the attribute reads a renamed dependency (`pay = { package = "idem-axum", … }`) from `Cargo.toml` itself | the name `Cargo.toml` gives `idem-axum` |
///
/// Every handler says whose keys it keeps apart: `scope` names the parameter that
/// identifies the caller, so the same key from two users is two requests. Leaving it
/// out is a compile error, because one shared key space lets anyone who guesses a
/// key (`order-1`) read the response recorded for another client. An endpoint that
/// truly has no caller to tell apart, such as a provider's webhook whose keys are
/// the provider's event ids, writes `unscoped = true`.
///
/// # Parameters
///
/// Every parameter is an ordinary axum extractor, and the function as written is
/// valid Rust: `#[axum::debug_handler]` works above or below the attribute, and
/// the rewritten function is routed as usual (`post(handler)`), taking the same
/// parameters in the same places. Two of them come from idem:
///
/// - `tx: Tx<DB>` (or an alias of it): the transaction the response is recorded
///   in, handed over once the key is claimed. Write through it
///   (`query.execute(&mut *tx)`), or pass it to helpers as `&mut Tx<DB>`; the
///   handler's writes commit with the response when it answers below 500 (and
///   not with a status of `release_on`), and are rolled back otherwise. Moved into a task that outlives the handler, it is
///   caught: 500 `handler-failed`, rolled back, nothing recorded.
/// - `key: IdempotencyKey` (requests without a key are answered 400
///   `missing-key`) or `key: Option<IdempotencyKey>`: the client's key, bound to
///   the scope, for relay to downstream providers; [`IdempotencyKey::derive`] gives
///   stable sub-keys.
///
/// The store's database is read from a parameter written `Tx<DB>`; a handler
/// without one (or with an alias of it) names it with `db = Postgres`.
///
/// The last extractor (`Json<T>`, `Form<T>`, `Bytes`, `String`, or any other) is
/// handed the body as received, after it is buffered (within axum's
/// `DefaultBodyLimit`; over it, 413 `payload-too-large`; slower than the store's
/// [`body_timeout`](Builder::body_timeout), 408 `request-timeout`) and
/// fingerprinted. If it rejects the request, its rejection is the answer and
/// nothing is stored. A retry answered from the replay cache does not run it: a
/// replay runs nothing of the handler, and the body it answers for is the one the
/// extractor accepted the first time (same bytes, same `Content-Type`). The other
/// extractors run on every request, the scope's first; so does the last one when
/// it is the scope.
///
/// The handler's body, attributes, doc comments, visibility and generics are kept;
/// `?` and `return` behave as written. It runs in its own task, so a client that
/// disconnects cannot cut it short between claim and commit; its captured values
/// must be `Send + 'static`, as axum's handlers already are.
///
/// # Errors
///
/// Misuse is a compile error spanned on the offending tokens: an unknown or
/// repeated option, a malformed or zero duration, `lock` not shorter than `ttl`,
/// neither `scope` nor `unscoped = true`, `scope` naming no parameter or a type
/// that is not a [`Scope`], a function that is not `async`, two `Tx` parameters, a
/// non-boolean `required`. An attribute error comes alone: the function is still
/// emitted as written, so its uses report nothing more. A handler on a database
/// this build lacks (`Tx<Postgres>` without the `postgres` feature) is one error
/// on that type, naming the feature; the app gets one more where it builds the
/// store (`Idempotency::new`), none where it only names `Idempotency<Postgres>`.
///
/// The router state is checked where the route is added, by rustc, which reports
/// it there: a state without the store is a mismatch between `MethodRouter<YourState>`
/// and `MethodRouter<Idempotency<Postgres>>`, or, when another extractor of the
/// handler fixes the state's type, an unsatisfied `Handler<…, YourState>`. Either
/// way the fix is to make the store reachable from the state: an
/// `Idempotency<Postgres>` field of a `#[derive(Clone, FromRef)]` state.
///
/// At run time, every answer idem gives itself is listed in the crate docs' table.
///
/// # Message handlers
///
/// `#[idempotent(message, key = …, scope = …, payload = …)]` makes an `async fn`
/// that takes a [`Tx`] and returns `Result<T, E>` a message handler, run once per
/// message id through [`Idempotency::process`]: `key` (a [`MessageId`]), `scope`
/// (anything with `to_string`) and `payload` (the message's bytes) are
/// expressions over its arguments. The rewritten function takes the store first,
/// then the other arguments, and returns [`Processed<T, E>`](Processed); `T` is
/// [`Replayable`]. `ttl`, `lock`, `wait`, `fingerprint` and `ignore` apply;
/// `required`, `ttl_header`, `release_on` and `unscoped` are for axum handlers.
/// The function's name is the delivery's source (docs/contract.md, §8).
///
/// ```rust,no_run
/// # #[cfg(feature = "sqlite")]
/// # mod example {
/// use idem_axum::{Action, Idempotency, Tx, idempotent};
/// use sqlx::Sqlite;
///
/// struct Order {
///     id: u64,
///     amount: i64,
/// }
///
/// #[idempotent(message, key = order.id, scope = "orders", payload = &bytes, ttl = "7d")]
/// async fn charge(bytes: Vec<u8>, order: Order, mut tx: Tx<Sqlite>) -> Result<String, sqlx::Error> {
///     sqlx::query("INSERT INTO charges (order_id, amount) VALUES (?, ?)")
///         .bind(order.id as i64)
///         .bind(order.amount)
///         .execute(&mut *tx)
///         .await?;
///     Ok(format!("ch_{}", order.id))
/// }
///
/// async fn consume(store: &Idempotency<Sqlite>, bytes: Vec<u8>, order: Order) {
///     match charge(store, bytes, order).await.action() {
///         Action::Ack => { /* acknowledge: ran and committed, or done before */ }
///         Action::Retry(after) => { /* deliver again, after `after` if given */ }
///         Action::DeadLetter => { /* never to run: another payload, no id */ }
///     }
/// }
/// # }
/// ```
///
/// # Examples
///
/// ```rust,no_run
/// # #[cfg(feature = "sqlite")]
/// # mod example {
/// use axum::{Json, http::StatusCode};
/// use idem_axum::{IdempotencyKey, idempotent};
///
/// #[derive(serde::Deserialize)]
/// struct Ping {
///     message: String,
/// }
///
/// // No transaction: the store's database is named with `db`. No caller to tell
/// // apart: keys are the sender's own event ids.
/// #[idempotent(unscoped = true, db = sqlx::Sqlite, ttl = "1h", lock = "5s")]
/// async fn ping(key: Option<IdempotencyKey>, Json(ping): Json<Ping>) -> (StatusCode, String) {
///     let reference = key.map(|k| k.derive("ping")).unwrap_or_default();
///     (StatusCode::OK, format!("{} {reference}", ping.message))
/// }
/// # }
/// ```
pub use idem_macros::idempotent;
#[cfg(feature = "serde")]
pub use idem_runtime::JsonRecord;
pub use idem_runtime::{
    Aborted, Action, Delivery, MIN_RETRY_AFTER, MessageId, Processed, Refused, Replayable, Retries,
    Stuck,
};
pub use idem_runtime::{
    Backend, Builder, Closed, ConfigError, DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_PROBLEM_BASE, DEFAULT_REPLAY_CACHE_BYTES, DEFAULT_REPLAY_CACHE_REFRESH, DEFAULT_TABLE,
    Forgotten, HandlerFuture, IDEMPOTENCY_KEY, IDEMPOTENCY_KEY_TTL, IDEMPOTENT_REPLAYED,
    Idempotency, IdempotencyKey, InFlight, InvalidJson, InvalidKey, InvalidOptions, InvalidSource,
    KeyId, KeyRecord, KeyRing, KeyRingError, KeySource, KeyUse, MAX_KEY_LEN, Options, Outcome,
    Problem, RequestIdentity, Reseal, ResealReport, Scope, SealAudit, Sealing, Shutdown, Sweep,
    SweepReport, Tx, UnreadKey, fingerprint, json_fingerprint, migration_sql, migration_steps,
};

#[cfg(feature = "postgres")]
pub use idem_runtime::Partitions;
#[cfg(feature = "aide")]
pub use idem_runtime::aide;
#[cfg(feature = "axum")]
pub use idem_runtime::axum;
#[cfg(feature = "client")]
pub use idem_runtime::client;
#[cfg(feature = "async-nats")]
pub use idem_runtime::jetstream;
#[cfg(feature = "lapin")]
pub use idem_runtime::rabbitmq;
#[cfg(feature = "testing")]
pub use idem_runtime::testing;
#[cfg(feature = "utoipa")]
pub use idem_runtime::utoipa;
pub use idem_runtime::webhook;
#[cfg(feature = "sea-orm")]
pub use idem_runtime::{SeaConnection, SeaDriver, SeaSavepoint};

/// Not public API: the paths generated code reaches the runtime through.
#[doc(hidden)]
pub mod __private {
    pub use idem_runtime::__macro_support::*;
}
