//! axum integration: an extractor that buffers and identifies the request, and the
//! conversions between the engine's responses and axum's.
//!
//! The `#[idempotent]` attribute generates calls to this module; it can also be used
//! by hand, as below.
//!
//! # Examples
//!
//! ```rust,no_run
//! # #[cfg(feature = "sqlite")]
//! # mod example {
//! use axum::{Router, extract::FromRef, http::StatusCode, response::IntoResponse, routing::post};
//! use idem_runtime::axum::IdempotentRequest;
//! use idem_runtime::{Idempotency, Options};
//! use sqlx::Sqlite;
//!
//! #[derive(Clone, FromRef)]
//! struct AppState {
//!     idempotency: Idempotency<Sqlite>,
//! }
//!
//! async fn create_order(request: IdempotentRequest<Sqlite>) -> axum::response::Response {
//!     let body = request.body().clone();
//!     request
//!         .run("user-7", Options::new().required(true), move |mut tx| {
//!             Box::pin(async move {
//!                 let inserted = sqlx::query("INSERT INTO orders (body) VALUES ($1)")
//!                     .bind(body.to_vec())
//!                     .execute(&mut *tx)
//!                     .await;
//!                 match inserted {
//!                     Ok(_) => (StatusCode::CREATED, "created").into_response(),
//!                     Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
//!                 }
//!             })
//!         })
//!         .await
//! }
//!
//! # fn app(state: AppState) -> Router {
//! Router::new().route("/orders", post(create_order)).with_state(state)
//! # }
//! # }
//! ```

use axum::body::Body;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRef, FromRequest, OriginalUri, Request};
use axum::http::request::Parts;
use axum::http::{StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;

use crate::backend::Backend;
use crate::engine::{HandlerFuture, RequestIdentity};
use crate::key::IdempotencyKey;
use crate::options::Options;
use crate::problem::Problem;
use crate::store::Idempotency;

/// A buffered request with its idempotency key, ready to [`run`](Self::run).
///
/// Extracting it reads the whole body (within axum's `DefaultBodyLimit`) and parses
/// `Idempotency-Key`; the store comes from the router state through `FromRef`.
///
/// # Errors
///
/// Rejected, before anything is stored, with a problem+json answer:
/// 400 `invalid-key` for a malformed or repeated key, 413 `payload-too-large` for a
/// body over the limit; other body failures are answered as axum answers them.
#[derive(Debug)]
pub struct IdempotentRequest<DB: Backend> {
    store: Idempotency<DB>,
    key: Option<IdempotencyKey>,
    parts: Parts,
    body: Bytes,
}

impl<DB: Backend> IdempotentRequest<DB> {
    /// The request's key, if it sent one.
    pub fn key(&self) -> Option<&IdempotencyKey> {
        self.key.as_ref()
    }

    /// The request line and headers.
    pub fn parts(&self) -> &Parts {
        &self.parts
    }

    /// The buffered body, exactly as received.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// The key bound to `scope`, as the handler sees it (so that
    /// [`IdempotencyKey::derive`] is per tenant).
    pub fn scoped_key(&self, scope: &str) -> Option<IdempotencyKey> {
        self.key.clone().map(|key| key.with_scope(scope))
    }

    /// Takes the request apart, e.g. to run axum extractors on it before
    /// [`run_parts`](Self::run_parts).
    pub fn into_parts(self) -> (Idempotency<DB>, Option<IdempotencyKey>, Parts, Bytes) {
        (self.store, self.key, self.parts, self.body)
    }

    /// Runs `handler` under this request's key in `scope`; see
    /// [`Idempotency::execute`].
    pub async fn run<F>(self, scope: &str, options: Options, handler: F) -> Response
    where
        F: FnOnce(crate::Tx<DB>) -> HandlerFuture<Body> + Send + 'static,
    {
        Self::run_parts(
            &self.store,
            self.key,
            &self.parts,
            &self.body,
            scope,
            options,
            handler,
        )
        .await
    }

    /// [`run`](Self::run) on a request already taken apart.
    pub async fn run_parts<F>(
        store: &Idempotency<DB>,
        key: Option<IdempotencyKey>,
        parts: &Parts,
        body: &[u8],
        scope: &str,
        options: Options,
        handler: F,
    ) -> Response
    where
        F: FnOnce(crate::Tx<DB>) -> HandlerFuture<Body> + Send + 'static,
    {
        let request = RequestIdentity::new(key, scope, &parts.method, client_uri(parts), body)
            .with_content_type(content_type(parts));
        store
            .execute(request, options, handler)
            .await
            .map(Body::from)
    }
}

impl<S, DB> FromRequest<S> for IdempotentRequest<DB>
where
    S: Send + Sync,
    DB: Backend,
    Idempotency<DB>: FromRef<S>,
{
    type Rejection = Response;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        let store = Idempotency::<DB>::from_ref(state);
        let key = IdempotencyKey::from_headers(request.headers()).map_err(|invalid| {
            problem_response(&store, Problem::InvalidKey, &invalid.to_string())
        })?;
        let (parts, body) = request.into_parts();
        let buffered = Bytes::from_request(Request::from_parts(parts.clone(), body), state);
        let body = match tokio::time::timeout(store.body_timeout(), buffered).await {
            Ok(body) => body.map_err(|rejection| body_rejection(&store, rejection))?,
            Err(_elapsed) => {
                let detail = format!(
                    "the request body did not arrive within {} ms; nothing was claimed, send it again",
                    store.body_timeout().as_millis()
                );
                return Err(problem_response(&store, Problem::RequestTimeout, &detail));
            }
        };
        Ok(Self {
            store,
            key,
            parts,
            body,
        })
    }
}

/// The last parameter of a handler rewritten by `#[idempotent]`: the buffered
/// request, plus the user's own last extractor run on the same bytes.
///
/// The user's extractor (`Json<T>`, `Form<T>`, `Bytes`, `String`, or any
/// `FromRequestParts` type) sees the request exactly as sent; if it rejects the
/// request, its rejection is the answer and nothing is stored.
#[doc(hidden)]
#[derive(Debug)]
pub struct Buffered<DB: Backend, T> {
    request: IdempotentRequest<DB>,
    value: T,
}

impl<DB: Backend, T> Buffered<DB, T> {
    pub fn into_parts(self) -> (IdempotentRequest<DB>, T) {
        (self.request, self.value)
    }
}

/// Marks [`Buffered`]'s `FromRequest` impl; `M` is the inner extractor's marker, so
/// both body and parts extractors fit.
#[doc(hidden)]
#[derive(Debug)]
pub struct ViaBuffered;

impl<S, DB, T, M> FromRequest<S, (ViaBuffered, M)> for Buffered<DB, T>
where
    S: Send + Sync,
    DB: Backend,
    Idempotency<DB>: FromRef<S>,
    T: FromRequest<S, M>,
{
    type Rejection = Response;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        let request = IdempotentRequest::<DB>::from_request(request, state).await?;
        let copy = Request::from_parts(request.parts.clone(), Body::from(request.body.clone()));
        let value = T::from_request(copy, state)
            .await
            .map_err(IntoResponse::into_response)?;
        Ok(Self { request, value })
    }
}

/// The path and query the client sent: axum's [`OriginalUri`], which the outermost
/// `Router` records before any `nest`, `nest_service` or URI-rewriting layer inside
/// it changes `parts.uri`. Two routes nested under different prefixes (or path
/// parameters) must never share an identity.
fn client_uri(parts: &Parts) -> &Uri {
    parts
        .extensions
        .get::<OriginalUri>()
        .map_or(&parts.uri, |original| &original.0)
}

/// Every `Content-Type` header as sent, joined; empty when there is none. A value
/// that is not visible ASCII is escaped.
fn content_type(parts: &Parts) -> String {
    let mut out = String::new();
    for (i, value) in parts
        .headers
        .get_all(header::CONTENT_TYPE)
        .iter()
        .enumerate()
    {
        if i > 0 {
            out.push_str(", ");
        }
        match value.to_str() {
            Ok(text) => out.push_str(text),
            Err(_) => out.extend(value.as_bytes().escape_ascii().map(char::from)),
        }
    }
    out
}

/// Renders `problem` with the store's problem base, as an axum response.
pub fn problem_response<DB: Backend>(
    store: &Idempotency<DB>,
    problem: Problem,
    detail: &str,
) -> Response {
    store.problem(problem, detail).map(Body::from)
}

fn body_rejection<DB: Backend>(store: &Idempotency<DB>, rejection: BytesRejection) -> Response {
    if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
        let detail = "the request body is larger than this endpoint accepts";
        problem_response(store, Problem::PayloadTooLarge, detail)
    } else {
        rejection.into_response()
    }
}
