//! axum integration: an extractor that buffers and identifies the request, and the
//! conversions between the engine's responses and axum's.
//!
//! The `#[idempotent]` attribute generates calls to this module; it can also be used
//! by hand, as below.
//!
//! # Examples
//!
//! ```rust,no_run
//! # extern crate idem_runtime as idem_axum;
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

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::RequestExt as _;
use axum::body::Body;
use axum::extract::{
    FromRef, FromRequest, FromRequestParts, MatchedPath, OptionalFromRequestParts, OriginalUri,
    Request,
};
use axum::http::request::Parts;
use axum::http::{Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::future::Either;
use http_body_util::BodyExt as _;

use crate::backend::Backend;
use crate::engine::{HandlerFuture, Outcome, RequestIdentity, path_of};
use crate::key::{IdempotencyKey, InvalidKey};
use crate::options::Options;
use crate::problem::Problem;
use crate::source::{KeySource, UnreadKey};
use crate::store::{DEFAULT_PROBLEM_BASE, Idempotency};
use crate::tx::Tx;
use crate::webhook::Verifier;

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
        let request = Seen::of(parts).identify(key, body, scope, options);
        store
            .execute(request, options, handler)
            .await
            .map(Body::from)
    }
}

/// What the engine reads of a request's line and headers, taken before its parts
/// go on to the handler's own extractor, which needs them whole.
#[derive(Debug)]
struct Seen {
    method: Method,
    /// The path and query the client sent.
    path: String,
    content_type: String,
    /// `METHOD /route` when a route matched: the metrics' endpoint.
    endpoint: Option<String>,
}

impl Seen {
    fn of(parts: &Parts) -> Self {
        Self {
            method: parts.method.clone(),
            path: path_of(client_uri(parts)),
            content_type: content_type(parts),
            // Only metrics read it.
            endpoint: cfg!(feature = "metrics")
                .then(|| parts.extensions.get::<MatchedPath>())
                .flatten()
                .map(|route| {
                    let (method, route) = (parts.method.as_str(), route.as_str());
                    let mut endpoint = String::with_capacity(method.len() + 1 + route.len());
                    endpoint.push_str(method);
                    endpoint.push(' ');
                    endpoint.push_str(route);
                    endpoint
                }),
        }
    }

    /// The request's identity. Only a keyed request is compared with another, so
    /// only its body is fingerprinted; the engine refuses a body that cannot be,
    /// and options that fail `check`, before anything else.
    fn identify(
        self,
        key: Option<IdempotencyKey>,
        body: &[u8],
        scope: impl Into<String>,
        options: Options,
    ) -> RequestIdentity {
        let keyed = key.is_some();
        let request =
            RequestIdentity::of_parts(key, scope.into(), self.method, self.path, Ok([0; 32]));
        let mut request = if keyed {
            request.with_body(&options, self.content_type, body)
        } else {
            request.with_content_type(self.content_type)
        };
        if let Some(endpoint) = self.endpoint {
            request = request.with_endpoint(endpoint);
        }
        request
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
        let key = header_key(&request).map_err(|invalid| {
            problem_response(&store, Problem::InvalidKey, &invalid.to_string())
        })?;
        let (parts, body) = buffer(&store, request).await?;
        Ok(Self {
            store,
            key,
            parts,
            body,
        })
    }
}

/// The request's `Idempotency-Key`, as the handler's `IdempotencyKey` parameter
/// parsed it if it has one.
fn header_key(request: &Request) -> Result<Option<IdempotencyKey>, InvalidKey> {
    let parsed = request
        .extensions()
        .get::<InHandler>()
        .and_then(|marked| marked.key.clone());
    match parsed {
        Some(key) => Ok(Some(key)),
        None => IdempotencyKey::from_headers(request.headers()),
    }
}

/// The request's parts and whole body.
async fn buffer<DB: Backend>(
    store: &Idempotency<DB>,
    request: Request,
) -> Result<(Parts, Bytes), Response> {
    // Read here rather than by axum's `Bytes`, which needs the parts and so a
    // copy of them; under axum's body limit all the same.
    let (parts, body) = request.with_limited_body().into_parts();
    let mut collect = std::pin::pin!(body.collect());
    // A body already at hand (small bodies usually are) needs no timer.
    let first = std::future::poll_fn(|cx| std::task::Poll::Ready(collect.as_mut().poll(cx)));
    let collected = match first.await {
        std::task::Poll::Ready(collected) => Ok(collected),
        std::task::Poll::Pending => {
            tokio::time::timeout(store.body_timeout(), collect.as_mut()).await
        }
    };
    match collected {
        Ok(body) => Ok((
            parts,
            body.map_err(|error| body_failed(store, &error))?.to_bytes(),
        )),
        Err(_elapsed) => {
            let detail = format!(
                "the request body did not arrive within {} ms; nothing was claimed, send it again",
                store.body_timeout().as_millis()
            );
            Err(problem_response(store, Problem::RequestTimeout, &detail))
        }
    }
}

/// The last parameter of a handler rewritten by `#[idempotent]`: the buffered
/// request, plus the user's own last extractor, to run on the same bytes.
///
/// The user's extractor (`Json<T>`, `Form<T>`, `Bytes`, `String`, or any
/// `FromRequestParts` type) sees the request exactly as sent; if it rejects the
/// request, its rejection is the answer and nothing is stored. It runs once the
/// request is known not to be a replay kept in memory: a replay runs nothing of
/// the handler, and parsing the body it answers for again would cost it as much
/// as the rest of the replay together.
///
/// `DOC` carries the options documentation generators read (`openapi::doc`).
#[doc(hidden)]
pub struct Buffered<DB: Backend, T, const DOC: u8 = 0> {
    call: Call<DB>,
    /// The request's `Idempotency-Key`, or why it is not one: refused only where
    /// the endpoint reads its key there.
    header_key: Result<Option<IdempotencyKey>, InvalidKey>,
    parts: Parts,
    /// Starts the user's extractor on the request's parts and body.
    start: Starting<T>,
}

type Starting<T> = Box<dyn FnOnce(Parts, Bytes) -> Extracting<T> + Send>;

impl<DB: Backend, T, const DOC: u8> Buffered<DB, T, DOC> {
    /// The request received as an endpoint that reads its key from
    /// `Idempotency-Key` and checks no signature receives it.
    ///
    /// # Errors
    ///
    /// 400 `invalid-key` for a malformed key.
    pub fn into_parts(self) -> Result<(Call<DB>, Extracting<T>), Box<Response>> {
        self.receive(KeySource::IDEMPOTENCY_KEY, None)
    }

    /// The request received as the endpoint says: the sender's signature over
    /// the body checked by `verifier` first, then the key read from `source`;
    /// nothing else happens before these.
    ///
    /// # Errors
    ///
    /// 401 `unverified` for a signature that does not verify; 400 `invalid-key`
    /// (or `invalid-json`, for a key in a body that is not JSON) for a key that
    /// cannot be read.
    pub fn receive(
        self,
        source: KeySource,
        verifier: Option<&dyn Verifier>,
    ) -> Result<(Call<DB>, Extracting<T>), Box<Response>> {
        let Self {
            mut call,
            header_key,
            parts,
            start,
        } = self;
        if let Some(verifier) = verifier
            && let Err(unverified) = verifier.verify(&parts.headers, &call.body)
        {
            tracing::info!(%unverified, "a request whose signature does not verify; nothing claimed");
            let detail = format!("{unverified}; nothing was claimed");
            let refused = problem_response(&call.store, Problem::Unverified, &detail);
            return Err(Box::new(refused));
        }
        let key = if source == KeySource::IDEMPOTENCY_KEY {
            header_key.map_err(|invalid| (Problem::InvalidKey, invalid.to_string()))
        } else {
            source.read(&parts.headers, &call.body).map_err(|unread| {
                let problem = match unread {
                    UnreadKey::NotJson(_) => Problem::InvalidJson,
                    _ => Problem::InvalidKey,
                };
                (problem, unread.to_string())
            })
        };
        call.key = match key {
            Ok(key) => key,
            Err((problem, detail)) => {
                return Err(Box::new(problem_response(&call.store, problem, &detail)));
            }
        };
        let value = start(parts, call.body.clone());
        Ok((call, value))
    }
}

impl<DB: Backend, T, const DOC: u8> std::fmt::Debug for Buffered<DB, T, DOC> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffered")
            .field("call", &self.call)
            .finish_non_exhaustive()
    }
}

/// The user's last extractor, run on the buffered request when awaited.
#[doc(hidden)]
pub struct Extracting<T>(Pin<Box<dyn Future<Output = Result<T, Response>> + Send>>);

impl<T> Extracting<T> {
    /// A value already extracted (the scope's, which is needed before the key is
    /// looked up).
    pub fn done(value: T) -> Self
    where
        T: Send + 'static,
    {
        Self(Box::pin(std::future::ready(Ok(value))))
    }
}

impl<T> Future for Extracting<T> {
    type Output = Result<T, Response>;

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        self.0.as_mut().poll(cx)
    }
}

/// What a rewritten handler runs under the engine: the request's key, identity
/// and body, its parts having gone on to the handler's last extractor.
#[doc(hidden)]
#[derive(Debug)]
pub struct Call<DB: Backend> {
    store: Idempotency<DB>,
    key: Option<IdempotencyKey>,
    seen: Seen,
    body: Bytes,
    mark: Option<InHandler>,
}

impl<DB: Backend> Call<DB> {
    /// The mark the handler's parameters left on the request.
    pub fn in_handler(&self) -> Option<InHandler> {
        self.mark.clone()
    }

    /// See [`IdempotentRequest::run`]. A replay kept in memory is answered at
    /// once, without `value`'s extractor; anything else extracts it and runs in
    /// a future of its own, which keeps the handler's future small for axum to
    /// move.
    pub fn run<T, F>(
        self,
        scope: String,
        options: Options,
        value: Extracting<T>,
        handler: F,
    ) -> Running
    where
        T: Send + 'static,
        F: FnOnce(crate::Tx<DB>, T, Arc<str>) -> HandlerFuture<Body> + Send + 'static,
    {
        let mut request = self.seen.identify(self.key, &self.body, scope, options);
        let store = self.store;
        let kept = match store.kept(&request, options) {
            Some(kept) if kept.0 == Outcome::Replayed => {
                let response = store.answer_kept(&mut request, kept);
                return Either::Left(std::future::ready(response.map(Body::from)));
            }
            kept => kept,
        };
        Either::Right(Box::pin(async move {
            // The extractor's rejection comes first, as for any handler; then
            // what the key's record says (a mismatch kept in memory included).
            let value = match value.await {
                Ok(value) => value,
                Err(rejection) => return rejection,
            };
            let response = match kept {
                Some(kept) => store.answer_kept(&mut request, kept),
                None => {
                    let scope = Arc::from(request.scope());
                    let handler = move |tx| handler(tx, value, scope);
                    store.claim_and_run(request, options, handler).await
                }
            };
            response.map(Body::from)
        }))
    }
}

/// What [`Call::run`] returns.
#[doc(hidden)]
pub type Running =
    Either<std::future::Ready<Response>, Pin<Box<dyn Future<Output = Response> + Send>>>;

/// What a handler rewritten by `#[idempotent]` returns: the response, and in its
/// type the handler's own return type `O`, for documentation generators to read
/// (aide documents `O`'s responses, with the headers of a replayed answer).
#[doc(hidden)]
pub struct Answer<O, const DOC: u8 = 0>(Response, std::marker::PhantomData<fn() -> O>);

impl<O, const DOC: u8> Answer<O, DOC> {
    pub fn new(response: Response) -> Self {
        Self(response, std::marker::PhantomData)
    }
}

impl<O, const DOC: u8> IntoResponse for Answer<O, DOC> {
    fn into_response(self) -> Response {
        self.0
    }
}

impl<O, const DOC: u8> std::fmt::Debug for Answer<O, DOC> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Answer").field(&self.0.status()).finish()
    }
}

/// Any other parameter of a handler rewritten by `#[idempotent]` but its `State`s:
/// the user's extractor, run after marking the request as inside such a handler,
/// which is what lets [`Tx`] and [`IdempotencyKey`] be extracted.
#[doc(hidden)]
#[derive(Debug)]
pub struct Arg<DB: Backend, T>(pub T, std::marker::PhantomData<fn() -> DB>);

impl<S, DB, T> FromRequestParts<S> for Arg<DB, T>
where
    S: Send + Sync,
    DB: Backend,
    Idempotency<DB>: FromRef<S>,
    T: FromRequestParts<S>,
{
    type Rejection = T::Rejection;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        InHandler::enter::<DB, S>(&mut parts.extensions, state);
        let value = T::from_request_parts(parts, state).await?;
        Ok(Self(value, std::marker::PhantomData))
    }
}

/// Marks a request as being extracted for an `#[idempotent]` handler: its store's
/// problem base, and how many `Tx` its parameters took.
#[doc(hidden)]
#[derive(Debug, Clone)]
pub struct InHandler {
    problem_base: Arc<str>,
    txs: Arc<AtomicUsize>,
    /// The key as a parameter of the handler parsed it.
    key: Option<IdempotencyKey>,
}

impl InHandler {
    /// Marks the request once, for the first of the handler's parameters.
    fn enter<DB: Backend, S>(extensions: &mut http::Extensions, state: &S)
    where
        Idempotency<DB>: FromRef<S>,
    {
        if extensions.get::<Self>().is_none() {
            let store = Idempotency::<DB>::from_ref(state);
            extensions.insert(Self {
                problem_base: Arc::clone(&store.inner().problem_base),
                txs: Arc::new(AtomicUsize::new(0)),
                key: None,
            });
        }
    }

    fn problem(&self, problem: Problem, detail: &str) -> Response {
        problem
            .to_response(&self.problem_base, detail)
            .map(Body::from)
    }
}

/// Renders `problem` with the problem base of the handler `parts` is extracted for.
fn parts_problem(parts: &Parts, problem: Problem, detail: &str) -> Response {
    let base = parts
        .extensions
        .get::<InHandler>()
        .map_or(DEFAULT_PROBLEM_BASE, |marked| &marked.problem_base);
    problem.to_response(base, detail).map(Body::from)
}

/// Extracted as a parameter of an `#[idempotent]` handler, it receives the
/// transaction once the key is claimed.
///
/// # Errors
///
/// 500 `handler-failed`, before anything is claimed, outside an `#[idempotent]`
/// handler or for a handler's second `Tx`.
impl<S: Send + Sync, DB: Backend> FromRequestParts<S> for Tx<DB> {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let Some(marked) = parts.extensions.get::<InHandler>() else {
            let detail = "a Tx is a parameter of an #[idempotent] handler; this handler is not one";
            tracing::error!("{detail}");
            return Err(parts_problem(parts, Problem::HandlerFailed, detail));
        };
        if marked.txs.fetch_add(1, Ordering::Relaxed) > 0 {
            let detail = "a handler has one transaction: this is its second Tx";
            tracing::error!("{detail}");
            return Err(marked.problem(Problem::HandlerFailed, detail));
        }
        Ok(Self::waiting())
    }
}

/// The request's `Idempotency-Key`: taking it makes the key required.
///
/// # Errors
///
/// 400 `missing-key` without one, 400 `invalid-key` for a malformed or repeated one.
impl<S: Send + Sync> FromRequestParts<S> for IdempotencyKey {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match <Self as OptionalFromRequestParts<S>>::from_request_parts(parts, state).await? {
            Some(key) => Ok(key),
            None => {
                let detail = "this endpoint requires an Idempotency-Key header";
                Err(parts_problem(parts, Problem::MissingKey, detail))
            }
        }
    }
}

/// The request's `Idempotency-Key`, if it sent one.
///
/// # Errors
///
/// 400 `invalid-key` for a malformed or repeated key.
impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotencyKey {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Option<Self>, Self::Rejection> {
        let key = Self::from_headers(&parts.headers)
            .map_err(|invalid| parts_problem(parts, Problem::InvalidKey, &invalid.to_string()))?;
        if let (Some(key), Some(marked)) = (&key, parts.extensions.get_mut::<InHandler>()) {
            marked.key = Some(key.clone());
        }
        Ok(key)
    }
}

/// What the engine hands an `#[idempotent]` handler's parameters before its body
/// runs: the transaction for its `Tx`, the scope for its key.
#[doc(hidden)]
#[derive(Debug)]
pub struct Handed<DB: Backend> {
    tx: Tx<DB>,
    scope: Arc<str>,
    marked: Option<InHandler>,
    attached: usize,
}

impl<DB: Backend> Handed<DB> {
    /// `marked`: what [`Call::in_handler`] found on the request.
    pub fn new(tx: Tx<DB>, scope: Arc<str>, marked: Option<InHandler>) -> Self {
        Self {
            tx,
            scope,
            marked,
            attached: 0,
        }
    }

    /// The answer when a `Tx` was extracted but got no transaction (it sits inside
    /// another extractor): the body must not run with it.
    pub fn refused(&self) -> Option<Response> {
        let marked = self.marked.as_ref()?;
        if marked.txs.load(Ordering::Relaxed) <= self.attached {
            return None;
        }
        let detail = "a Tx inside another extractor gets no transaction: take it as a parameter of the #[idempotent] handler itself";
        tracing::error!("{detail}");
        Some(marked.problem(Problem::HandlerFailed, detail))
    }
}

/// The verifier of a handler written with `verify = V`, taken from the router's
/// state as `State<V>` takes it; [`Buffered::receive`] runs it before anything
/// else.
#[doc(hidden)]
#[derive(Debug)]
pub struct Verifying<V>(pub V);

impl<S, V> FromRequestParts<S> for Verifying<V>
where
    S: Send + Sync,
    V: FromRef<S> + Verifier,
{
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(_: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        Ok(Self(V::from_ref(state)))
    }
}

/// Hands a parameter what it needs from the engine; see [`Inert`].
#[doc(hidden)]
pub trait Receive<DB: Backend> {
    fn idem_receive(&mut self, handed: &mut Handed<DB>);
}

impl<DB: Backend> Receive<DB> for Tx<DB> {
    fn idem_receive(&mut self, handed: &mut Handed<DB>) {
        if self.take_from(&mut handed.tx) {
            handed.attached += 1;
        }
    }
}

impl<DB: Backend> Receive<DB> for IdempotencyKey {
    fn idem_receive(&mut self, handed: &mut Handed<DB>) {
        *self = self.clone().with_shared_scope(Arc::clone(&handed.scope));
    }
}

impl<DB: Backend> Receive<DB> for Option<IdempotencyKey> {
    fn idem_receive(&mut self, handed: &mut Handed<DB>) {
        if let Some(key) = self {
            key.idem_receive(handed);
        }
    }
}

/// Every other parameter receives nothing. Generated code calls
/// `(&mut value).idem_receive(..)`: method resolution picks [`Receive`] when the
/// value's type implements it, and this trait, one auto-reference later, otherwise.
#[doc(hidden)]
pub trait Inert<DB: Backend> {
    fn idem_receive(&self, handed: &mut Handed<DB>) {
        let _ = handed;
    }
}

impl<T: ?Sized, DB: Backend> Inert<DB> for &mut T {}

/// Marks [`Buffered`]'s `FromRequest` impl; `M` is the inner extractor's marker, so
/// both body and parts extractors fit.
#[doc(hidden)]
#[derive(Debug)]
pub struct ViaBuffered;

impl<S, DB, T, M, const DOC: u8> FromRequest<S, (ViaBuffered, M)> for Buffered<DB, T, DOC>
where
    S: Clone + Send + Sync + 'static,
    DB: Backend,
    Idempotency<DB>: FromRef<S>,
    T: FromRequest<S, M> + Send + 'static,
    M: 'static,
{
    type Rejection = Response;

    async fn from_request(mut request: Request, state: &S) -> Result<Self, Self::Rejection> {
        InHandler::enter::<DB, S>(request.extensions_mut(), state);
        let store = Idempotency::<DB>::from_ref(state);
        // Refused only once the endpoint says where its key is (`receive`).
        let header_key = header_key(&request);
        let (parts, body) = buffer(&store, request).await?;
        let call = Call {
            store,
            key: None,
            seen: Seen::of(&parts),
            mark: parts.extensions.get::<InHandler>().cloned(),
            body,
        };
        // Axum's router state is `Clone` (`Router::with_state`): the extractor
        // takes its own copy, to run after this returns.
        let state = state.clone();
        let start: Starting<T> = Box::new(move |parts, body| {
            Extracting(Box::pin(async move {
                T::from_request(Request::from_parts(parts, Body::from(body)), &state)
                    .await
                    .map_err(IntoResponse::into_response)
            }))
        });
        Ok(Self {
            call,
            header_key,
            parts,
            start,
        })
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

/// A body over axum's limit is 413 `payload-too-large`; any other failure to read
/// it is answered as axum's `Bytes` answers it.
fn body_failed<DB: Backend>(store: &Idempotency<DB>, error: &axum::Error) -> Response {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(error) = cause {
        if error.is::<http_body_util::LengthLimitError>() {
            let detail = "the request body is larger than this endpoint accepts";
            return problem_response(store, Problem::PayloadTooLarge, detail);
        }
        cause = error.source();
    }
    let detail = format!("Failed to buffer the request body: {error}");
    (StatusCode::BAD_REQUEST, detail).into_response()
}
