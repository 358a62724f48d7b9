//! The claim → execute → record state machine (`docs/contract.md` §4).

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::{Pin, pin};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::FutureExt as _;
use futures_util::future::{Either, select};
use http::{HeaderValue, Method, Response, Uri, header};
use http_body::Body;
use http_body_util::{BodyExt as _, Limited};
use sqlx::pool::PoolConnection;
use tokio::time::Instant as TokioInstant;
use tracing::Instrument as _;

use crate::backend::{Again, Backend, Claim, Differs, Found, Identity, Opened, Recorded, Written};
use crate::cache::{Filler, Looked, ReplayCache};
use crate::digest::fingerprint;
use crate::json::InvalidJson;
use crate::key::IdempotencyKey;
use crate::metrics;
use crate::multipart::InvalidMultipart;
use crate::options::Options;
use crate::problem::Problem;
use crate::record::{IDEMPOTENCY_KEY_TTL, encode_headers, replay};
use crate::seal::{Owner, Plain, SealError, Sealed, Sealing, Unreadable, sealed_by};
use crate::signal::{FIRST_PAUSE, MAX_PAUSE, announced, key_digest, signal_of};
use crate::store::Idempotency;
use crate::tx::{Open, Tx};

/// How long a claim released by its lease (`Again::Now`) is tried again in the
/// background, when that outlasts its lock.
const FINISH_GRACE: Duration = Duration::from_secs(5);

/// The future a handler closure returns; it owns the [`Tx`] it was given.
pub type HandlerFuture<B> = Pin<Box<dyn Future<Output = Response<B>> + Send>>;

type BoxError = Box<dyn StdError + Send + Sync>;

/// Everything that identifies one request to the engine: its key (if any), its
/// scope, method, path and query, body content type, and the fingerprint of its body.
///
/// # Examples
///
/// ```
/// # extern crate idem_runtime as idem_axum;
/// use http::{Method, Uri};
/// use idem_axum::{IdempotencyKey, RequestIdentity};
///
/// let key = IdempotencyKey::parse(b"order-42").ok();
/// let uri: Uri = "/payments?dry=0".parse().unwrap();
/// let request = RequestIdentity::new(key, "user-7", &Method::POST, &uri, br#"{"amount":100}"#);
/// assert_eq!(request.path(), "/payments?dry=0");
/// assert_eq!(request.key().unwrap().scope(), Some("user-7"));
///
/// // The same bytes sent as a form are another request.
/// let json = request.clone().with_content_type("application/json");
/// assert_eq!(json.content_type(), "application/json");
/// ```
#[derive(Debug, Clone)]
pub struct RequestIdentity {
    key: Option<IdempotencyKey>,
    scope: String,
    method: Verb,
    path: String,
    content_type: String,
    /// `Err` when the body cannot be fingerprinted as the endpoint and its
    /// `Content-Type` say (not JSON, not the multipart body announced): refused.
    fingerprint: Result<[u8; 32], InvalidBody>,
    /// The SHA-256 of a multipart body's bytes, which releases before parts were
    /// compared recorded: a key of theirs matches its retry by it.
    bytes_fingerprint: Option<[u8; 32]>,
    endpoint: Option<String>,
}

/// What a request's identity names as its method.
#[derive(Debug, Clone)]
pub(crate) enum Verb {
    Http(Method),
    /// A message's delivery (`crate::message`).
    Message,
}

impl Verb {
    /// As the table stores it: an HTTP method, or, for a message, a name no
    /// HTTP method can have (`@` is no token character), so that a key is never
    /// a request's and a message's at once.
    fn as_str(&self) -> &str {
        match self {
            Self::Http(method) => method.as_str(),
            Self::Message => "@message",
        }
    }
}

/// A keyed body that cannot be fingerprinted: refused 400 before anything runs.
#[derive(Debug, Clone)]
pub(crate) enum InvalidBody {
    Json(InvalidJson),
    Multipart(InvalidMultipart),
}

impl RequestIdentity {
    /// Identifies a request; `body` is hashed, not kept.
    pub fn new(
        key: Option<IdempotencyKey>,
        scope: impl Into<String>,
        method: &Method,
        uri: &Uri,
        body: &[u8],
    ) -> Self {
        Self::fingerprinted(key, scope, method, uri, fingerprint(body))
    }

    /// Identifies a request by a fingerprint of its body computed beforehand, such
    /// as [`Options::fingerprint`]'s.
    pub fn fingerprinted(
        key: Option<IdempotencyKey>,
        scope: impl Into<String>,
        method: &Method,
        uri: &Uri,
        fingerprint: [u8; 32],
    ) -> Self {
        Self::identified(key, scope, method, uri, Ok(fingerprint))
    }

    /// As [`fingerprinted`](Self::fingerprinted), or, for a body the endpoint
    /// cannot fingerprint, a request the engine refuses 400 `invalid-json` when it
    /// is keyed, as it refuses any other, before anything runs.
    pub(crate) fn identified(
        key: Option<IdempotencyKey>,
        scope: impl Into<String>,
        method: &Method,
        uri: &Uri,
        fingerprint: Result<[u8; 32], InvalidBody>,
    ) -> Self {
        Self::of_parts(key, scope.into(), method.clone(), path_of(uri), fingerprint)
    }

    /// [`identified`](Self::identified) from owned parts; `path` as [`path_of`] gives it.
    pub(crate) fn of_parts(
        key: Option<IdempotencyKey>,
        scope: String,
        method: Method,
        path: String,
        fingerprint: Result<[u8; 32], InvalidBody>,
    ) -> Self {
        Self {
            key: key.map(|k| k.with_scope(&scope)),
            scope,
            method: Verb::Http(method),
            path,
            content_type: String::new(),
            fingerprint,
            bytes_fingerprint: None,
            endpoint: None,
        }
    }

    /// A message's delivery to the consumer `source`, its id as the key.
    pub(crate) fn message(key: Option<IdempotencyKey>, scope: String, source: String) -> Self {
        let mut identity = Self::of_parts(key, scope, Method::POST, String::new(), Ok([0; 32]));
        identity.method = Verb::Message;
        identity.endpoint = Some(source.clone());
        identity.path = source;
        identity
    }

    /// The endpoint's label in metrics, taken: its route, else its method
    /// (empty without the `metrics` feature).
    pub(crate) fn take_endpoint(&mut self) -> String {
        if !cfg!(feature = "metrics") {
            return String::new();
        }
        self.endpoint
            .take()
            .unwrap_or_else(|| self.method.as_str().to_owned())
    }

    /// Names the endpoint in metrics (feature `metrics`), e.g. `POST /payments/{id}`:
    /// a route, not a path, so that the label keeps few values. The axum
    /// integration sets it from the matched route.
    #[must_use]
    pub fn with_endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.endpoint = Some(endpoint.into());
        self
    }

    /// Sets the body's `Content-Type` as the client sent it (none: empty). The same
    /// key with the same bytes under another content type is a payload mismatch.
    #[must_use]
    pub fn with_content_type(mut self, content_type: impl Into<String>) -> Self {
        self.content_type = content_type.into();
        self
    }

    /// Sets the body's `Content-Type` and fingerprints `body` as the endpoint's
    /// `options` and that type say, as the axum integration does: a multipart body
    /// by its parts (a client's new boundary for a retry changes nothing), a JSON
    /// body by its value under [`Options::json_fingerprint`], any other by its
    /// bytes. A body that is not what its type announces is refused 400
    /// (`invalid-multipart`, `invalid-json`) when the request is keyed, before
    /// anything runs.
    ///
    /// # Examples
    ///
    /// ```
    /// # extern crate idem_runtime as idem_axum;
    /// use http::{Method, Uri};
    /// use idem_axum::{IdempotencyKey, Options, RequestIdentity};
    ///
    /// let upload = |boundary: &str| {
    ///     let body = format!(
    ///         "--{boundary}\r\nContent-Disposition: form-data; name=\"amount\"\r\n\r\n100\r\n--{boundary}--"
    ///     );
    ///     let key = IdempotencyKey::parse(b"order-42").ok();
    ///     let uri = Uri::from_static("/payments");
    ///     RequestIdentity::new(key, "user-7", &Method::POST, &uri, b"").with_body(
    ///         &Options::new(),
    ///         format!("multipart/form-data; boundary={boundary}"),
    ///         body.as_bytes(),
    ///     )
    /// };
    /// // One form, two boundaries: one request.
    /// assert_eq!(upload("a1").fingerprint(), upload("b2").fingerprint());
    /// ```
    #[must_use]
    pub fn with_body(
        mut self,
        options: &Options,
        content_type: impl Into<String>,
        body: &[u8],
    ) -> Self {
        self.content_type = content_type.into();
        self.bytes_fingerprint = None;
        // Under a JSON fingerprint a multipart body is no JSON, and refused so.
        let parts = if options.fingerprints_json() {
            None
        } else {
            crate::multipart::fingerprint(&self.content_type, body)
        };
        self.fingerprint = match parts {
            Some(parts) => {
                self.bytes_fingerprint = Some(fingerprint(body));
                parts.map_err(InvalidBody::Multipart)
            }
            None => options.fingerprint(body).map_err(InvalidBody::Json),
        };
        self
    }

    /// The fingerprint of the body, as the key's later uses must match it;
    /// `None` when the body could not be fingerprinted.
    pub fn fingerprint(&self) -> Option<[u8; 32]> {
        self.fingerprint.as_ref().ok().copied()
    }

    /// The body's `Content-Type`, empty when the request had none.
    pub fn content_type(&self) -> &str {
        &self.content_type
    }

    /// The key, bound to the scope (so [`IdempotencyKey::derive`] is per tenant).
    pub fn key(&self) -> Option<&IdempotencyKey> {
        self.key.as_ref()
    }

    /// The scope keys are unique within.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The request's path and query.
    pub fn path(&self) -> &str {
        &self.path
    }
}

/// How the engine answered one request; attached to every response it returns as
/// an extension, and named in its `tracing` event.
///
/// # Examples
///
/// ```
/// # extern crate idem_runtime as idem_axum;
/// # fn demo(response: http::Response<bytes::Bytes>) {
/// use idem_axum::Outcome;
///
/// if response.extensions().get::<Outcome>() == Some(&Outcome::Replayed) {
///     // count replays
/// }
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// The handler ran; its writes and response committed together.
    Executed,
    /// The handler ran after taking over a claim whose executor was gone.
    TakenOver,
    /// The stored response was replayed; the handler did not run.
    Replayed,
    /// Another execution holds the key: 409 `in-flight`.
    InFlight,
    /// The key was first used with another request: 422 `payload-mismatch`.
    Mismatch,
    /// The handler ran but its work was rolled back and the key released: it
    /// answered ≥ 500, panicked, ran past its lock, or its response could not be stored.
    Released,
    /// No key on an endpoint that does not require one: the handler ran, nothing stored.
    Unkeyed,
    /// Missing key (400), a body that is not the JSON the endpoint fingerprints
    /// (400 `invalid-json`), or the endpoint's options are inconsistent (500
    /// `invalid-options`): nothing ran.
    Refused,
    /// The database failed: 503 `store-unavailable`.
    StoreFailed,
    /// The store is shutting down: 503 `shutting-down`, nothing ran or was kept.
    ShuttingDown,
    /// The database ended the handler's transaction and committed some of its
    /// writes before the answer was recorded (a statement that commits implicitly,
    /// or a `COMMIT` the handler sent): 500 `transaction-ended`, which the key
    /// keeps for its `ttl`; the handler never runs again under it.
    TransactionEnded,
    /// The stored response could not be opened (see [`Sealing`](crate::Sealing)):
    /// 500 `record-unreadable`, nothing ran or was replayed.
    RecordUnreadable,
}

impl Outcome {
    /// A stable lowercase name, as logged.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Executed => "executed",
            Self::TakenOver => "taken_over",
            Self::Replayed => "replayed",
            Self::InFlight => "in_flight",
            Self::Mismatch => "mismatch",
            Self::Released => "released",
            Self::Unkeyed => "unkeyed",
            Self::Refused => "refused",
            Self::StoreFailed => "store_failed",
            Self::ShuttingDown => "shutting_down",
            Self::TransactionEnded => "transaction_ended",
            Self::RecordUnreadable => "record_unreadable",
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

enum Decision<A> {
    /// Free, expired (`replace`), or a claim past its lock (`takeover`).
    Claim {
        replace: bool,
        takeover: bool,
    },
    Answer(Settled<A>),
    /// Another executor holds it.
    InFlight,
}

/// What the state machine settled for one request, before a front door words it
/// (HTTP: [`Idempotency::respond`]); `A` is the door's own answer, which the
/// work returned.
pub(crate) enum Settled<A> {
    /// The work ran and its record committed with its writes; `takeover`: after
    /// taking over a claim whose lock had passed.
    Ran { answer: A, takeover: bool },
    /// No key: the work ran in a plain transaction, committed or rolled back.
    Unkeyed(Result<A, Failure<A>>),
    /// A completed record, opened: replayed, the work not run.
    Replayed {
        status: i32,
        headers: Bytes,
        body: Bytes,
    },
    /// The key keeps `transaction-ended`: found so, or (`now`) this execution's
    /// transaction was ended behind the engine's back.
    Ended { now: bool },
    /// Another execution holds the key: what is left of its lock, where known.
    InFlight { lock_left: Option<Duration> },
    /// The key was first used with another request: which part differs.
    Mismatch(Differs),
    /// The stored record cannot be opened here; nothing ran.
    Unreadable,
    /// The work's transaction was rolled back and its key released.
    Released(Failure<A>),
    /// Nothing ran: the request or the endpoint cannot be taken.
    Refused(Refusal),
    /// The database failed (`serialization`: it refused to serialize the
    /// transaction, which committed nothing), or the runtime cut the task short.
    StoreFailed {
        serialization: bool,
        interrupted: bool,
    },
    /// The store is shutting down: nothing ran or was kept.
    ShuttingDown,
}

/// Why a claimed (or unkeyed) execution was rolled back.
pub(crate) enum Failure<A> {
    /// The work's own answer, which is not to be recorded (an HTTP 5xx).
    Answer(A),
    /// Its answer was larger than the store records.
    TooLarge {
        limit: usize,
    },
    /// Its answer failed while being read (an HTTP body's error).
    AnswerFailed,
    Panicked,
    /// It ran past its lock and was cancelled.
    TimedOut,
    /// Its `Tx` outlived it.
    Escaped,
    /// The store's shutdown cancelled it.
    Cancelled,
    /// Its claim's lease was lost before the record, or the database ended its
    /// session at the lock.
    LeaseExpired,
}

/// Why a request was refused before anything ran.
pub(crate) enum Refusal {
    /// The endpoint's options contradict one another.
    InvalidOptions(String),
    /// No key, where one is required.
    MissingKey,
    /// A body that is not the JSON the endpoint fingerprints.
    InvalidJson(String),
    /// A multipart body that cannot be read.
    InvalidMultipart(String),
}

impl<A> Settled<A> {
    /// The outcome it counts as, in metrics and logs.
    pub(crate) fn outcome(&self) -> Outcome {
        match self {
            Self::Ran {
                takeover: false, ..
            } => Outcome::Executed,
            Self::Ran { takeover: true, .. } => Outcome::TakenOver,
            Self::Unkeyed(_) => Outcome::Unkeyed,
            // A key found ended answers as its record would: a replay.
            Self::Replayed { .. } | Self::Ended { now: false } => Outcome::Replayed,
            Self::Ended { now: true } => Outcome::TransactionEnded,
            Self::InFlight { .. } => Outcome::InFlight,
            Self::Mismatch(_) => Outcome::Mismatch,
            Self::Unreadable => Outcome::RecordUnreadable,
            Self::Released(_) => Outcome::Released,
            Self::Refused(_) => Outcome::Refused,
            Self::StoreFailed { .. } => Outcome::StoreFailed,
            Self::ShuttingDown => Outcome::ShuttingDown,
        }
    }
}

/// How one attempt ended.
enum Step<F, A> {
    Done(Settled<A>),
    /// Another executor holds the key; the handler did not run and comes back.
    InFlight(F),
    /// The claim failed for a reason the backend has just repaired (a day
    /// partition was missing): look again at once, this once.
    Again(F),
}

impl<F, A> From<Settled<A>> for Step<F, A> {
    fn from(settled: Settled<A>) -> Self {
        Self::Done(settled)
    }
}

/// What a front door runs under a claim (or, without a key, in a plain
/// transaction): the handler, and what turns its answer into a record.
pub(crate) trait Work<DB: Backend>: Send + 'static {
    /// The door's own answer.
    type Answer: Send + 'static;

    /// Runs on `tx` and says whether its answer is recorded; `limit`: the
    /// largest answer the store records, `None` where nothing is (no key).
    fn run(
        self,
        tx: Tx<DB>,
        limit: Option<usize>,
    ) -> impl Future<Output = Verdict<Self::Answer>> + Send;
}

/// What a [`Work`] came to.
pub(crate) enum Verdict<A> {
    /// Record `stored` with the work's writes, then answer `answer`.
    Record { stored: Stored, answer: A },
    /// Roll back and release the key, then answer this.
    Release(A),
    /// Its answer cannot be recorded: roll back and release the key.
    Unrecordable(Failure<A>),
}

/// An answer as the table stores it: status, header lines, body.
pub(crate) struct Stored {
    pub(crate) status: u16,
    pub(crate) headers: Vec<u8>,
    pub(crate) body: Bytes,
}

/// An HTTP handler as a [`Work`]: its body buffered (up to the store's limit),
/// and recorded where the endpoint's options record its status.
struct HttpWork<F> {
    handler: F,
    options: Options,
}

impl<DB, F, B> Work<DB> for HttpWork<F>
where
    DB: Backend,
    F: FnOnce(Tx<DB>) -> HandlerFuture<B> + Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Answer = Response<Bytes>;

    async fn run(self, tx: Tx<DB>, limit: Option<usize>) -> Verdict<Response<Bytes>> {
        let (parts, body) = (self.handler)(tx).await.into_parts();
        let collected = match limit {
            Some(limit) => Limited::new(body, limit).collect().await,
            None => body.collect().await.map_err(Into::into),
        };
        let mut response = match collected {
            Ok(collected) => Response::from_parts(parts, collected.to_bytes()),
            Err(error) if error.is::<http_body_util::LengthLimitError>() => {
                let limit = limit.unwrap_or_default();
                return Verdict::Unrecordable(Failure::TooLarge { limit });
            }
            Err(error) => {
                tracing::error!(%error, "response body failed; rolled back");
                return Verdict::Unrecordable(Failure::AnswerFailed);
            }
        };
        let options = self.options;
        if !options.records(response.status()) {
            return Verdict::Release(response);
        }
        if limit.is_none() {
            // Nothing is recorded without a key: committed as it is.
            let stored = Stored {
                status: response.status().as_u16(),
                headers: Vec::new(),
                body: Bytes::new(),
            };
            return Verdict::Record {
                stored,
                answer: response,
            };
        }
        if options.advertises_ttl() {
            let seconds = options.ttl_duration().as_secs();
            response
                .headers_mut()
                .insert(IDEMPOTENCY_KEY_TTL, HeaderValue::from(seconds));
        }
        let stored = Stored {
            status: response.status().as_u16(),
            headers: encode_headers(response.headers()),
            body: response.body().clone(),
        };
        Verdict::Record {
            stored,
            answer: response,
        }
    }
}

/// The work's result, once it is over.
enum Ran<A> {
    Done(Verdict<A>),
    Panicked(String),
    TimedOut,
    /// The handler's `Tx` outlived it (moved into a task of its own).
    Escaped,
    /// The store's shutdown cancelled the handler.
    Cancelled,
}

impl<A> Ran<A> {
    /// The failure a run that is not recorded ends in, logged as an operator
    /// needs it.
    fn failure(self) -> Failure<A> {
        match self {
            Ran::Done(Verdict::Release(answer)) => Failure::Answer(answer),
            // Not released, but not recorded either (the record was not reached).
            Ran::Done(Verdict::Record { answer, .. }) => Failure::Answer(answer),
            Ran::Done(Verdict::Unrecordable(failure)) => {
                if let Failure::TooLarge { limit } = failure {
                    tracing::error!(limit, "response too large to store; rolled back");
                }
                failure
            }
            Ran::Panicked(message) => {
                tracing::error!(panic = %message, "handler panicked; rolled back");
                Failure::Panicked
            }
            Ran::Cancelled => {
                tracing::warn!("handler cancelled by the shutdown; rolled back");
                Failure::Cancelled
            }
            Ran::Escaped => Failure::Escaped,
            Ran::TimedOut => {
                tracing::warn!("handler ran past its lock; cancelled and rolled back");
                Failure::TimedOut
            }
        }
    }
}

impl<DB: Backend> Idempotency<DB> {
    /// Runs `handler` under the request's idempotency key.
    ///
    /// The handler gets a [`Tx`] to write through and returns a response. A new key
    /// is claimed, the handler runs, and its response is recorded in the same
    /// transaction as its writes. A completed key is replayed without running the
    /// handler, an in-flight one is answered 409, a key reused with another request
    /// 422. Without a key the handler runs in a plain transaction (or, if
    /// `options.is_required()`, the answer is 400 `missing-key`).
    ///
    /// A claim and what follows it run in a task of their own: if the caller's
    /// future is dropped (the client went away), it still ends with a commit, or
    /// with a rollback and the key released. (A replay of a completed key this
    /// store keeps in memory claims nothing and is answered at once.) A handler
    /// still running when its `lock` runs out is dropped and rolled back.
    ///
    /// Every failure is answered with a problem+json response (see [`Problem`]); the
    /// [`Outcome`] extension of the response says what happened.
    ///
    /// # Examples
    ///
    /// ```rust,no_run
    /// # extern crate idem_runtime as idem_axum;
    /// # #[cfg(feature = "sqlite")]
    /// # mod example {
    /// use bytes::Bytes;
    /// use http::{Method, Response, StatusCode, Uri};
    /// use http_body_util::Full;
    /// use idem_axum::{Idempotency, IdempotencyKey, Options, RequestIdentity};
    /// use sqlx::Sqlite;
    ///
    /// async fn pay(store: Idempotency<Sqlite>, key: IdempotencyKey, body: Bytes) -> Response<Bytes> {
    ///     let uri = Uri::from_static("/payments");
    ///     let request = RequestIdentity::new(Some(key), "user-7", &Method::POST, &uri, &body);
    ///     store
    ///         .execute(request, Options::new(), move |mut tx| {
    ///             Box::pin(async move {
    ///                 let inserted = sqlx::query("INSERT INTO payments (body) VALUES (?1)")
    ///                     .bind(body.to_vec())
    ///                     .execute(&mut *tx)
    ///                     .await;
    ///                 let mut response = Response::new(Full::new(Bytes::from_static(b"{}")));
    ///                 *response.status_mut() = match inserted {
    ///                     Ok(_) => StatusCode::CREATED,
    ///                     Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
    ///                 };
    ///                 response
    ///             })
    ///         })
    ///         .await
    /// }
    /// # }
    /// ```
    pub async fn execute<F, B>(
        &self,
        mut request: RequestIdentity,
        options: Options,
        handler: F,
    ) -> Response<Bytes>
    where
        F: FnOnce(Tx<DB>) -> HandlerFuture<B> + Send + 'static,
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        match self.kept(&request, options) {
            Some(kept) => self.answer_kept(&mut request, kept),
            None => self.claim_and_run(request, options, handler).await,
        }
    }

    /// What this process's copy of the key's completed record answers `request`
    /// (a replay, or a mismatch), if it keeps one: nothing is claimed, so there is
    /// no task to spawn and nothing a disconnect could cut short. Given with
    /// [`answer_kept`](Self::answer_kept). `None` while the store shuts down, as
    /// `claim_and_run` then answers.
    pub(crate) fn kept(
        &self,
        request: &RequestIdentity,
        options: Options,
    ) -> Option<(Outcome, Response<Bytes>)> {
        let settled = self.kept_settled(request, options)?;
        Some((settled.outcome(), self.respond(settled)))
    }

    /// What [`kept`](Self::kept) found, before a front door words it.
    pub(crate) fn kept_settled<A>(
        &self,
        request: &RequestIdentity,
        options: Options,
    ) -> Option<Settled<A>> {
        #[cfg(feature = "testing")]
        if request.key.is_some() {
            self.inner().hooks.arrived();
        }
        // Nothing is claimed, so nothing for `close` to wait for: only refused.
        if self.inner().lifecycle.is_draining() {
            return None;
        }
        let cache = self.inner().replay_cache.as_ref()?;
        let key = request.key.as_ref()?;
        let fingerprint = request.fingerprint.as_ref().ok()?;
        options.check().ok()?;
        let id = self.identity(request, options, key, fingerprint);
        match self.decide(Some(&cache.kept(&id.digest)?.found), &id) {
            Decision::Answer(settled) => Some(settled),
            Decision::Claim { .. } | Decision::InFlight => None,
        }
    }

    /// Gives what [`kept`](Self::kept) found: its span, metric and `Outcome`.
    pub(crate) fn answer_kept(
        &self,
        request: &mut RequestIdentity,
        (outcome, response): (Outcome, Response<Bytes>),
    ) -> Response<Bytes> {
        let endpoint = endpoint_of(request);
        answered(&span_of(request), outcome, response, endpoint)
    }

    /// [`execute`](Self::execute) past the replay cache: claims and executes in a
    /// task of its own, or answers from the table.
    pub(crate) async fn claim_and_run<F, B>(
        &self,
        mut request: RequestIdentity,
        options: Options,
        handler: F,
    ) -> Response<Bytes>
    where
        F: FnOnce(Tx<DB>) -> HandlerFuture<B> + Send + 'static,
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let span = span_of(&request);
        let endpoint = endpoint_of(&mut request);
        let work = HttpWork { handler, options };
        let answer = |store: &Self, settled: Settled<Response<Bytes>>, label| {
            let outcome = settled.outcome();
            let response = store.respond(settled);
            answered(&tracing::Span::current(), outcome, response, label)
        };
        let label = endpoint.clone();
        let settled = match self
            .settle(request, options, work, span, label, answer)
            .await
        {
            Some(Ok(response)) => return response,
            Some(Err(())) => Settled::StoreFailed {
                serialization: false,
                interrupted: true,
            },
            None => Settled::ShuttingDown,
        };
        let outcome = settled.outcome();
        let mut response = self.respond(settled);
        response.extensions_mut().insert(outcome);
        metrics::request(outcome.as_str(), endpoint);
        response
    }

    /// Runs `work` for `request` in a task of its own, counted in by the store's
    /// lifecycle, and gives what `answer` makes of what it settled (inside the
    /// task: a caller dropped meanwhile still has its metric and span). `None`
    /// when the store shuts down (nothing was claimed); `Err` when the runtime
    /// cut the task short.
    pub(crate) async fn settle<W, R>(
        &self,
        request: RequestIdentity,
        options: Options,
        work: W,
        span: tracing::Span,
        label: String,
        answer: impl FnOnce(&Self, Settled<W::Answer>, String) -> R + Send + 'static,
    ) -> Option<Result<R, ()>>
    where
        W: Work<DB>,
        R: Send + 'static,
    {
        // Counted in before anything is claimed: a store shutting down takes nothing
        // new, and waits for what it took (see `Shutdown`).
        let running = self.inner().lifecycle.enter()?;
        let store = self.clone();
        // Boxed where it is built, and instrumented once boxed: the state machine
        // is about 10 KiB, which would otherwise be copied by every move, into the
        // span's wrapper and through every frame of `spawn`.
        let task = tokio::spawn(
            Box::pin(async move {
                let settled = store.run(request, options, work, &label).await;
                drop(running);
                answer(&store, settled, label)
            })
            .instrument(span),
        );
        Some(task.await.map_err(|error| {
            // Only when the runtime shuts down under the task.
            tracing::error!(%error, "idempotent request task ended abnormally");
        }))
    }

    fn identity<'a>(
        &self,
        request: &'a RequestIdentity,
        options: Options,
        key: &'a IdempotencyKey,
        fingerprint: &'a [u8; 32],
    ) -> Identity<'a> {
        // Keyed where the store seals: the bare digest is then never stored.
        let owner = Owner {
            scope: &request.scope,
            key: key.as_str(),
        };
        let stored = match self.inner().sealing.writer() {
            Some(ring) => ring.fingerprint(owner, fingerprint),
            None => *fingerprint,
        };
        Identity {
            scope: &request.scope,
            key: key.as_str(),
            method: request.method.as_str(),
            path: &request.path,
            content_type: &request.content_type,
            json_body: options.fingerprints_json(),
            fingerprint: stored,
            body_digest: fingerprint,
            bytes_fingerprint: request.bytes_fingerprint.as_ref(),
            digest: key_digest(&self.inner().table, &request.scope, key.as_str()),
        }
    }

    async fn run<W: Work<DB>>(
        &self,
        request: RequestIdentity,
        options: Options,
        work: W,
        endpoint: &str,
    ) -> Settled<W::Answer> {
        if let Err(invalid) = options.check() {
            tracing::error!(%invalid, "endpoint options refused");
            return Settled::Refused(Refusal::InvalidOptions(invalid.to_string()));
        }
        let Some(key) = &request.key else {
            if options.is_required() {
                return Settled::Refused(Refusal::MissingKey);
            }
            return match self.inner().pool.acquire().await {
                Ok(conn) => self.run_unkeyed(conn, work, &options).await,
                Err(error) => self.store_failed(&error),
            };
        };
        let fingerprint = match &request.fingerprint {
            Ok(fingerprint) => fingerprint,
            Err(InvalidBody::Json(invalid)) => {
                return Settled::Refused(Refusal::InvalidJson(invalid.to_string()));
            }
            Err(InvalidBody::Multipart(invalid)) => {
                return Settled::Refused(Refusal::InvalidMultipart(invalid.to_string()));
            }
        };
        let id = self.identity(&request, options, key, fingerprint);
        let signal = signal_of(&id.digest);
        let wait = options.wait_duration();
        // Subscribed before the first look, so an announcement between a look and
        // the wait that follows it is not lost.
        let mut waiting = (!wait.is_zero()).then(|| {
            // Through a transaction pooler LISTEN cannot work: only a pool of its
            // own carries it; without one, waiters look again on their own.
            let listen = match &self.inner().listen_pool {
                Some(pool) => Some(pool),
                None => (!self.inner().transaction_pooled).then_some(&self.inner().pool),
            };
            if let Some(pool) = listen
                && let Some((signals, stop)) = self.inner().signals.watch_once()
            {
                DB::idem_watch(pool, signals, stop);
            }
            (self.inner().signals.subscribe(), TokioInstant::now() + wait)
        });
        let mut pause = FIRST_PAUSE;
        let mut work = work;
        let mut repaired = false;
        loop {
            work = match self
                .attempt(&id, &options, signal, work, !repaired, endpoint)
                .await
            {
                Step::Done(settled) => return settled,
                Step::InFlight(work) => work,
                Step::Again(again) => {
                    repaired = true;
                    work = again;
                    continue;
                }
            };
            match &mut waiting {
                // A draining store's waiters stop waiting: their retry goes to an
                // instance that stays up.
                _ if self.inner().lifecycle.is_draining() => {
                    return Settled::ShuttingDown;
                }
                Some((receiver, deadline)) if TokioInstant::now() < *deadline => {
                    // No connection is held while waiting.
                    let until = (*deadline).min(TokioInstant::now() + pause);
                    announced(receiver, signal, until).await;
                    pause = (pause * 2).min(MAX_PAUSE);
                }
                _ => {
                    let lock_left = self.lock_left(&id, &options).await;
                    return Settled::InFlight { lock_left };
                }
            }
        }
    }

    /// One look at (scope, key): answer from what is stored, or claim and execute;
    /// `InFlight` hands the work back when another executor holds the key.
    async fn attempt<W: Work<DB>>(
        &self,
        id: &Identity<'_>,
        options: &Options,
        signal: u64,
        work: W,
        may_repair: bool,
        endpoint: &str,
    ) -> Step<W, W::Answer> {
        let began = Instant::now();
        let cache = self.inner().replay_cache.as_ref();
        // When the database is read or claimed from, for what the cache keeps.
        let read = (began, cache.map_or(0, ReplayCache::epoch));
        // A completed key this process keeps is answered here; one it does not is
        // looked up by one request of this process at a time (`filler`).
        let mut filler = None;
        if let Some(cache) = cache {
            match cache.look(&id.digest).await {
                Looked::Hit(entry) => {
                    if let Decision::Answer(settled) = self.decide(Some(&entry.found), id) {
                        return Step::Done(settled);
                    }
                }
                Looked::Miss(miss) => filler = miss,
            }
        }
        let mut conn = match self.inner().pool.acquire().await {
            Ok(conn) => conn,
            Err(error) => return self.store_failed(&error).into(),
        };
        let sql = &self.inner().sql;
        let lease = crate::random::new_lease();
        let claim = Claim {
            lease,
            lock_ms: options.lock_millis(),
            ttl_ms: options.ttl_millis(),
            replace: false,
        };
        // A failed claim's cause may be repaired once (`Step::Again`).
        let repair = may_repair.then_some(claim.ttl_ms);
        let lock = Duration::from_millis(claim.lock_ms.unsigned_abs());
        // When the claim that took the key was sent: its lock runs from about
        // then on the database's clock, however long its commit took (a backend
        // that sent it again, or read its lock later, says so: `Adopted`).
        let mut sent = Instant::now();
        let (adopted, takeover, claim) = match DB::idem_open(&mut conn, sql, id, claim).await {
            Ok(Opened::Claimed(tx)) => (Open::adopt(tx), false, claim),
            Ok(Opened::Adopted(adopted)) => (adopted, false, claim),
            // `other` takes the whole result, so `conn` is free again below.
            other => match other.map(|opened| opened.found().map(|f| self.readable(f, id))) {
                Ok(Some(found)) => {
                    if let Some(cache) = cache {
                        cache.keep(id.digest, &found, read, filler.take());
                    }
                    let (replace, takeover) = match self.decide(Some(&found), id) {
                        Decision::Claim { replace, takeover } => (replace, takeover),
                        Decision::Answer(settled) => return Step::Done(settled),
                        Decision::InFlight => return Step::InFlight(work),
                    };
                    let claim = Claim { replace, ..claim };
                    sent = Instant::now();
                    match DB::idem_claim(&mut conn, sql, id, claim).await {
                        Ok(Some(adopted)) => (adopted, takeover, claim),
                        other => {
                            let error = other.err();
                            return self
                                .claim_lost(&mut conn, id, lease, error, work, repair, filler, lock)
                                .await;
                        }
                    }
                }
                Ok(None) => {
                    return self
                        .claim_lost(&mut conn, id, lease, None, work, None, filler, lock)
                        .await;
                }
                Err(error) => {
                    return self
                        .claim_lost(
                            &mut conn,
                            id,
                            lease,
                            Some(error),
                            work,
                            repair,
                            filler,
                            lock,
                        )
                        .await;
                }
            },
        };
        // Claimed: whoever waits to look the key up may look now (and find it in
        // flight) instead of waiting for the handler.
        drop(filler);
        if takeover {
            tracing::info!("taking over a claim whose lock had passed");
        }
        metrics::claimed(began.elapsed(), endpoint);
        let _held = metrics::Held::new();

        let claimed_at = adopted.lock_runs_from().unwrap_or(sent);
        let open = Open::new(conn, adopted, !self.inner().transaction_pooled);
        let waits = !options.wait_duration().is_zero();
        let limit = self.response_limit();
        let cancelled = self.inner().lifecycle.cancelled();
        // The handler is cancelled when the claim's lock passes, not a lock after
        // it started: past that, another executor may take the key over.
        let left = lock.saturating_sub(claimed_at.elapsed());
        let (ran, open) = run_handler(open, work, Some(left), Some(limit), lock, cancelled).await;
        let Some(mut open) = open else {
            // The connection is still out: whoever holds it closes it when done, and
            // the claim goes with it (SQLite's row once `lock` has passed).
            return Step::Done(Settled::Released(ran.failure()));
        };
        // `testing::ExactlyOnce` holds one execution here, the handler done and its
        // writes not yet committed, while it sends duplicates.
        #[cfg(feature = "testing")]
        self.inner().hooks.hold_here(lock / 2).await;
        let clean;
        let mut committed = false;
        let (settled, mut conn) = match ran {
            Ran::Done(Verdict::Record { stored, answer }) => {
                let mut seal_failed = None;
                let sealed = self
                    .seal(id, stored.status, &stored.headers, &stored.body)
                    .and_then(|sealed| sealed.map_err(|error| seal_failed = Some(error)).ok());
                let recorded = match &sealed {
                    Some(sealed) => Recorded {
                        status: 0,
                        headers: &[],
                        body: sealed,
                        ttl_ms: options.ttl_millis(),
                    },
                    None => Recorded {
                        status: i32::from(stored.status),
                        headers: &stored.headers,
                        body: &stored.body,
                        ttl_ms: options.ttl_millis(),
                    },
                };
                let announce = waits.then_some(signal);
                let recording = Instant::now();
                let written = if self.records_fail() {
                    Err(sqlx::Error::Protocol(
                        "the record fails on purpose (testing)".into(),
                    ))
                } else if let Some(error) = seal_failed {
                    // Never recorded in plain text instead: rolled back below.
                    Err(sqlx::Error::Encode(Box::new(error)))
                } else {
                    DB::idem_record(&mut open, sql, id, claim, recorded, announce).await
                };
                match written {
                    Ok(Written::Recorded) => match DB::idem_commit(&mut open, sql, id).await {
                        Ok(()) => {
                            let conn = open.into_conn();
                            metrics::recorded(recording.elapsed(), endpoint);
                            if let Some(cache) = cache {
                                let ttl_ms = options.ttl_millis();
                                let Stored {
                                    status,
                                    headers,
                                    body,
                                } = stored;
                                let found = Found::recorded(id, status, headers, body, ttl_ms);
                                cache.committed(id.digest, found, read);
                            }
                            clean = true;
                            committed = true;
                            (Settled::Ran { answer, takeover }, conn)
                        }
                        // The commit may or may not have happened: a retry finds out.
                        Err(error) => {
                            let conn = open.into_conn();
                            clean = false;
                            (self.store_failed(&error), conn)
                        }
                    },
                    Ok(Written::LeaseLost) => {
                        tracing::warn!("the claim's lease was lost before the record; rolled back");
                        let conn;
                        (conn, clean) = open.rollback().await;
                        (Settled::Released(Failure::LeaseExpired), conn)
                    }
                    Ok(Written::Ended) => {
                        clean = true;
                        (self.ended(), open.into_conn())
                    }
                    Err(error) => {
                        let conn;
                        let ended;
                        (conn, clean, ended) = abort(open, sql, id, claim).await;
                        let settled = if ended {
                            self.ended()
                        } else if claimed_at.elapsed() >= lock {
                            // The server ended the session at its lock (PostgreSQL).
                            tracing::warn!(%error, "session ended after the lock passed");
                            Settled::Released(Failure::LeaseExpired)
                        } else {
                            self.store_failed(&error)
                        };
                        (settled, conn)
                    }
                }
            }
            ran => {
                let (conn, ended);
                (conn, clean, ended) = abort(open, sql, id, claim).await;
                let settled = if ended {
                    self.ended()
                } else {
                    Settled::Released(ran.failure())
                };
                (settled, conn)
            }
        };
        let finished = DB::idem_finish(&mut conn, sql, id, lease, committed).await;
        if finished.is_err() || !clean {
            // Session state left behind, or whatever state the session is in after
            // a failure, is not handed to the next request.
            conn.close_on_drop();
        }
        // Given back first: finishing elsewhere may need a connection of the pool.
        drop(conn);
        if let Err(error) = finished {
            self.finish_elsewhere(error, id, lease, claimed_at + lock, true)
                .await;
        }
        if waits {
            self.inner().signals.publish(signal);
        }
        Step::Done(settled)
    }

    /// A claim whose `finish` failed keeps its key busy until its lock passes, when
    /// a retry takes it over, unless the backend says the finish may succeed
    /// elsewhere (`Again`). Where the claim is a row any session may release
    /// (`Again::Now`), that is done at once on a connection of the pool, before the
    /// answer; where the failure was the database being busy (SQLite's one write
    /// lock, held by another writer for longer than the busy timeout), in the
    /// background, until it succeeds or `until` (the claim's lock) has passed: the
    /// key is free as soon as the database lets go, not at the end of the lock.
    /// `may_wait`: the caller holds no connection of the pool, so the one for
    /// `Again::Now` may be waited for (a second at most); else only an idle one
    /// is taken, and without one the finish is left to the background.
    async fn finish_elsewhere(
        &self,
        error: sqlx::Error,
        id: &Identity<'_>,
        lease: i64,
        mut until: Instant,
        may_wait: bool,
    ) {
        let sql = &self.inner().sql;
        match DB::idem_finish_again(sql, &error) {
            Again::Never => {
                tracing::warn!(%error, "could not finish the claim");
                return;
            }
            Again::Later => {}
            Again::Now => {
                let pool = &self.inner().pool;
                let conn = if may_wait {
                    tokio::time::timeout(Duration::from_secs(1), pool.acquire())
                        .await
                        .ok()
                        .and_then(Result::ok)
                } else {
                    pool.try_acquire()
                };
                if let Some(mut conn) = conn {
                    match DB::idem_finish(&mut conn, sql, id, lease, false).await {
                        Ok(()) => return,
                        Err(_) => conn.close_on_drop(),
                    }
                }
                // Released by its lease, the claim may be let go past its lock.
                until = until.max(Instant::now() + FINISH_GRACE);
            }
        }
        tracing::info!(%error, "finishing the claim when the database lets go");
        let store = self.clone();
        let held = HeldKey::of(id);
        tokio::spawn(async move {
            let mut pause = Duration::from_millis(5);
            while Instant::now() < until {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(250));
                let mut conn = match store.inner().pool.acquire().await {
                    Ok(conn) => conn,
                    Err(error) => {
                        tracing::warn!(%error, "could not finish the claim");
                        return;
                    }
                };
                let id = held.id();
                let sql = &store.inner().sql;
                match DB::idem_finish(&mut conn, sql, &id, lease, false).await {
                    Ok(()) => return,
                    Err(error) if DB::idem_finish_again(sql, &error) != Again::Never => {}
                    Err(error) => {
                        conn.close_on_drop();
                        tracing::warn!(%error, "could not finish the claim");
                        return;
                    }
                }
            }
            tracing::warn!("could not finish the claim before its lock passed");
        });
    }

    /// Answers a request whose claim failed: from what the winner left (409 while it
    /// runs), or 503 when the database failed. `repair`: the claim's ttl (ms), when
    /// the backend may repair the cause of an error (see `Step::Again`).
    #[allow(clippy::too_many_arguments)]
    async fn claim_lost<W: Work<DB>>(
        &self,
        conn: &mut PoolConnection<DB>,
        id: &Identity<'_>,
        lease: i64,
        error: Option<sqlx::Error>,
        work: W,
        repair: Option<i64>,
        filler: Option<Filler<'_>>,
        lock: Duration,
    ) -> Step<W, W::Answer> {
        let sql = &self.inner().sql;
        if let Some(error) = error {
            if let Some(ttl_ms) = repair {
                match DB::idem_repair(conn, sql, &error, ttl_ms).await {
                    Ok(true) => return Step::Again(work),
                    Ok(false) => {}
                    Err(repair) => {
                        tracing::warn!(%repair, %error, "could not repair a failed claim")
                    }
                }
            }
            // A backend may have committed its claim before failing; and the
            // session may be left in any state, so it is not reused.
            conn.close_on_drop();
            if let Err(finish) = DB::idem_finish(conn, sql, id, lease, false).await {
                // `conn` is still the caller's: no waiting for another.
                self.finish_elsewhere(finish, id, lease, Instant::now() + lock, false)
                    .await;
            }
            return self.store_failed(&error).into();
        }
        let cache = self.inner().replay_cache.as_ref();
        let read = (Instant::now(), cache.map_or(0, ReplayCache::epoch));
        match DB::idem_lookup(conn, sql, id).await {
            Ok(found) => {
                let found = found.map(|found| self.readable(found, id));
                if let (Some(cache), Some(found)) = (cache, &found) {
                    cache.keep(id.digest, found, read, filler);
                }
                match self.decide(found.as_ref(), id) {
                    Decision::Answer(settled) => Step::Done(settled),
                    Decision::Claim { .. } | Decision::InFlight => Step::InFlight(work),
                }
            }
            Err(error) => self.store_failed(&error).into(),
        }
    }

    async fn run_unkeyed<W: Work<DB>>(
        &self,
        mut conn: PoolConnection<DB>,
        work: W,
        options: &Options,
    ) -> Settled<W::Answer> {
        let adopted = match DB::idem_begin(&mut conn).await {
            Ok(tx) => Open::adopt(tx),
            Err(error) => return self.store_failed(&error),
        };
        let open = Open::new(conn, adopted, !self.inner().transaction_pooled);
        let cancelled = self.inner().lifecycle.cancelled();
        let wait = options.lock_duration();
        let (ran, open) = run_handler(open, work, None, None, wait, cancelled).await;
        let Some(open) = open else {
            return Settled::Unkeyed(Err(ran.failure()));
        };
        let (mut conn, settled, clean) = match ran {
            Ran::Done(Verdict::Record { answer, .. }) => match open.commit().await {
                (_, Ok(())) => return Settled::Unkeyed(Ok(answer)),
                (conn, Err(error)) => (conn, self.store_failed(&error), false),
            },
            ran => {
                let (conn, clean) = open.rollback().await;
                (conn, Settled::Unkeyed(Err(ran.failure())), clean)
            }
        };
        if !clean {
            conn.close_on_drop();
        }
        settled
    }

    /// What a lookup means for this request.
    fn decide<A>(&self, found: Option<&Found>, id: &Identity<'_>) -> Decision<A> {
        let Some(found) = found else {
            return Decision::Claim {
                replace: false,
                takeover: false,
            };
        };
        if found.replaceable() {
            // An expired key is treated as never seen. A fresh claim nobody
            // completed whose lock has passed holds nothing: it is taken over by
            // whatever request comes, never a reason to refuse one.
            return Decision::Claim {
                replace: true,
                takeover: found.fresh(),
            };
        }
        if let Some(why) = found.unreadable {
            tracing::error!(
                scope = id.scope,
                key = id.key,
                "not replayed: {why} (docs/deployment.md, sealing)"
            );
            return Decision::Answer(Settled::Unreadable);
        }
        if let Sealing::On(ring) = &self.inner().sealing
            && !found.completed
            && !ring.keyed(&found.fingerprint)
            && !found.same_body(id, None)
        {
            // A claim in flight keyed under a key this ring lacks: whether it
            // is this request cannot be told, and it is in flight either way.
            return Decision::InFlight;
        }
        if let Some(differs) = found.differs(id, self.inner().sealing.ring()) {
            return Decision::Answer(Settled::Mismatch(differs));
        }
        if found.ended() {
            Decision::Answer(Settled::Ended { now: false })
        } else if found.completed {
            Decision::Answer(Settled::Replayed {
                status: found.status.unwrap_or(500),
                headers: found.headers.clone().unwrap_or_default(),
                body: found.body.clone().unwrap_or_default(),
            })
        } else {
            Decision::InFlight
        }
    }

    /// The sealed record of a response, where the store seals: bound to the row
    /// the claim wrote.
    fn seal(
        &self,
        id: &Identity<'_>,
        status: u16,
        headers: &[u8],
        body: &[u8],
    ) -> Option<Result<Vec<u8>, SealError>> {
        let ring = self.inner().sealing.writer()?;
        let row = Sealed {
            scope: id.scope,
            key: id.key,
            method: id.method,
            path: id.path,
            content_type: Some(id.content_type),
            fingerprint: &id.fingerprint,
        };
        let response = Plain {
            status,
            digest: id.body_digest,
            headers,
            body,
        };
        Some(ring.seal(&row, &response))
    }

    /// `found` as this store may replay it: a sealed record opened, or marked
    /// `unreadable` with why it is refused. Claims and ended marks hold no
    /// response and pass as they are.
    fn readable(&self, mut found: Found, id: &Identity<'_>) -> Found {
        if !found.completed {
            return found;
        }
        let sealing = &self.inner().sealing;
        if let Sealing::On(ring) = sealing
            && !ring.keyed(&found.fingerprint)
            && !found.same_body(id, None)
        {
            // Keyed under a key that left the ring (a transaction-ended row,
            // which `reseal` cannot key anew, outlived it): never "another body",
            // which would invite the client to pay again under a new key.
            found.unreadable = Some(Unreadable::UnknownFingerprint);
            return found;
        }
        if found.ended() {
            return found;
        }
        let body = found.body.as_deref().unwrap_or_default();
        let why = match (found.sealed(), sealing.ring()) {
            (false, Some(ring)) if ring.keyed(&found.fingerprint) => Unreadable::Downgraded,
            (false, ring) if sealing.opens_plain() => {
                if ring.is_some() {
                    // Turning sealing on or off: expected until the longest ttl
                    // has passed, and worth seeing.
                    tracing::info!(scope = id.scope, key = id.key, "replayed in plain text");
                    metrics::plain_replayed();
                }
                return found;
            }
            (false, _) => Unreadable::Plain,
            (true, None) => Unreadable::Sealed(sealed_by(body)),
            (true, Some(ring)) => {
                let row = Sealed {
                    scope: id.scope,
                    key: id.key,
                    method: &found.method,
                    path: &found.path,
                    content_type: found.content_type.as_deref(),
                    fingerprint: &found.fingerprint,
                };
                match ring.open(&row, body) {
                    Ok(opened) => {
                        found.status = Some(i32::from(opened.status));
                        found.headers = Some(Bytes::from(opened.headers));
                        found.body = Some(Bytes::from(opened.body));
                        return found;
                    }
                    Err(unsealable) => Unreadable::Unsealable(unsealable),
                }
            }
        };
        found.unreadable = Some(why);
        found
    }

    pub(crate) fn problem(&self, problem: Problem, detail: &str) -> Response<Bytes> {
        problem.to_response(&self.inner().problem_base, detail)
    }

    /// What is left of the lock of the execution holding `id`'s key, by the
    /// database's clock: by then the key is completed or free. `None` when it
    /// cannot be read.
    async fn lock_left(&self, id: &Identity<'_>, options: &Options) -> Option<Duration> {
        let left = match self.inner().pool.acquire().await {
            Ok(mut conn) => {
                DB::idem_lock_left(&mut conn, &self.inner().sql, id, options.lock_millis()).await
            }
            Err(error) => Err(error),
        };
        match left {
            // Clamped: MySQL's transaction start has whole seconds only.
            Ok(Some(ms)) => Some(Duration::from_millis(
                ms.clamp(0, options.lock_millis()).unsigned_abs(),
            )),
            Ok(None) => None,
            Err(error) => {
                tracing::debug!(%error, "could not read the holder's lock");
                None
            }
        }
    }

    /// This execution's key keeps `transaction-ended` (see `Written::Ended`).
    fn ended<A>(&self) -> Settled<A> {
        tracing::error!(
            "the database ended the handler's transaction behind idem's back and committed \
             some of it; the key keeps 500 transaction-ended (docs/deployment.md)"
        );
        Settled::Ended { now: true }
    }

    fn store_failed<A>(&self, error: &sqlx::Error) -> Settled<A> {
        tracing::warn!(%error, "idempotency store failed");
        // The database may have failed over to a replica that lacks commits this
        // process kept: its retries must read the table again.
        if let Some(cache) = &self.inner().replay_cache {
            cache.distrust();
        }
        // SERIALIZABLE (or REPEATABLE READ) refused the transaction: it committed
        // nothing, and saying so spares a client the doubt.
        let serialization = matches!(error, sqlx::Error::Database(e)
            if matches!(e.code().as_deref(), Some("40001" | "40P01")));
        Settled::StoreFailed {
            serialization,
            interrupted: false,
        }
    }

    /// The largest response body this store records: its `max_response_bytes`,
    /// or less where the database carries less (a Galera write set).
    fn response_limit(&self) -> usize {
        let most = self.inner().max_response_bytes;
        DB::idem_max_response(&self.inner().sql).map_or(most, |carried| carried.min(most))
    }

    /// The HTTP answer to what the state machine settled: the handler's own
    /// response, a replay, or a problem.
    pub(crate) fn respond(&self, settled: Settled<Response<Bytes>>) -> Response<Bytes> {
        match settled {
            Settled::Ran { answer, .. } | Settled::Unkeyed(Ok(answer)) => answer,
            Settled::Unkeyed(Err(failure)) | Settled::Released(failure) => self.failed(failure),
            Settled::Replayed {
                status,
                headers,
                body,
            } => replay(status, &headers, body),
            Settled::Ended { now: true } => self.transaction_ended(),
            Settled::Ended { now: false } => {
                // As the record would replay it: through the header lines.
                let ended = self.transaction_ended();
                let headers = encode_headers(ended.headers());
                replay(ended.status().as_u16().into(), &headers, ended.into_body())
            }
            Settled::InFlight { lock_left } => {
                // Whole seconds, rounded up; one when unknown.
                let seconds = lock_left.map_or(1, |left| {
                    u64::try_from(left.as_millis().div_ceil(1000))
                        .unwrap_or(u64::MAX)
                        .max(1)
                });
                let detail =
                    "a request with this Idempotency-Key is still being processed; retry later";
                let mut response = self.problem(Problem::InFlight, detail);
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
                response
            }
            Settled::Mismatch(differs) => {
                // Which part differs, never what the first request held: the key
                // may be another client's, guessed.
                let (member, named) = differs.names();
                let detail = format!(
                    "this Idempotency-Key was first used with another {named}; nothing ran"
                );
                Problem::PayloadMismatch.to_response_with(
                    &self.inner().problem_base,
                    &detail,
                    &[("mismatch", member)],
                )
            }
            Settled::Unreadable => {
                let detail = "the response recorded under this Idempotency-Key cannot be opened \
                              by this server; nothing ran, and the key will not run again";
                self.problem(Problem::RecordUnreadable, detail)
            }
            Settled::Refused(Refusal::InvalidOptions(invalid)) => {
                let detail = format!("this endpoint is misconfigured: {invalid}; nothing was run");
                self.problem(Problem::InvalidOptions, &detail)
            }
            Settled::Refused(Refusal::MissingKey) => self.problem(
                Problem::MissingKey,
                "this endpoint requires an Idempotency-Key header",
            ),
            Settled::Refused(Refusal::InvalidJson(detail)) => {
                self.problem(Problem::InvalidJson, &detail)
            }
            Settled::Refused(Refusal::InvalidMultipart(detail)) => {
                self.problem(Problem::InvalidMultipart, &detail)
            }
            Settled::StoreFailed { interrupted, .. } if interrupted => self.problem(
                Problem::StoreUnavailable,
                "the request was interrupted; retry with the same key",
            ),
            Settled::StoreFailed { serialization, .. } => {
                let detail = if serialization {
                    "the database could not serialize this request with concurrent ones \
                     (serialization failure); nothing was committed: retry with the same key"
                } else {
                    "the idempotency store failed; retry with the same key"
                };
                self.problem(Problem::StoreUnavailable, detail)
            }
            Settled::ShuttingDown => self.shutting_down(),
        }
    }

    /// 503 `shutting-down`: nothing of this request is kept; retry elsewhere.
    fn shutting_down(&self) -> Response<Bytes> {
        let detail = "this server is shutting down; nothing of this request was kept: \
                      retry with the same key";
        self.problem(Problem::ShuttingDown, detail)
    }

    /// 500 `transaction-ended`: what a key keeps once the database committed its
    /// handler's transaction behind the engine's back (see `Written::Ended`).
    fn transaction_ended(&self) -> Response<Bytes> {
        let detail = "the database ended this request's transaction before its answer was \
                      recorded, and committed some of its writes (a statement that commits \
                      implicitly, or a COMMIT sent by the handler): it will not run again \
                      under this key, and what it wrote needs reconciling";
        self.problem(Problem::TransactionEnded, detail)
    }

    /// The answer for a handler whose work was rolled back.
    fn failed(&self, failure: Failure<Response<Bytes>>) -> Response<Bytes> {
        let lease_expired =
            "the request ran past its lock and was rolled back; retry with the same key";
        match failure {
            Failure::Answer(response) => response,
            Failure::TooLarge { limit } => {
                let detail = format!(
                    "the response exceeded the {limit} bytes the idempotency store keeps, so the request was rolled back"
                );
                self.problem(Problem::ResponseTooLarge, &detail)
            }
            Failure::AnswerFailed => self.problem(
                Problem::HandlerFailed,
                "the response body failed; the request was rolled back",
            ),
            Failure::Panicked => self.problem(
                Problem::HandlerFailed,
                "the handler failed; the request was rolled back",
            ),
            Failure::Cancelled => self.shutting_down(),
            Failure::Escaped => self.problem(
                Problem::HandlerFailed,
                "the handler's transaction outlived it (a Tx moved into a task of its own); \
                 its writes were rolled back and nothing was recorded",
            ),
            Failure::TimedOut | Failure::LeaseExpired => {
                self.problem(Problem::LeaseExpired, lease_expired)
            }
        }
    }
}

/// Lends `open` to the work, catching panics and, with `lock`, dropping it at the
/// deadline, or when `cancelled` resolves. Gives the transaction back when the
/// work has dropped its `Tx`; a `Tx` that outlives it is waited for up to
/// `escaped_wait`, and the run is `Escaped` either way.
async fn run_handler<DB: Backend, W: Work<DB>>(
    open: Open<DB>,
    work: W,
    lock: Option<Duration>,
    limit: Option<usize>,
    escaped_wait: Duration,
    cancelled: impl Future<Output = ()>,
) -> (Ran<W::Answer>, Option<Open<DB>>) {
    let started = TokioInstant::now();
    let (tx, mut back) = Tx::lend(open);
    let work = AssertUnwindSafe(work.run(tx, limit)).catch_unwind();
    let bounded = async {
        match lock {
            Some(lock) => tokio::time::timeout(lock, work).await.ok(),
            None => Some(work.await),
        }
    };
    let caught = match select(pin!(bounded), pin!(cancelled)).await {
        Either::Left((caught, _)) => Some(caught),
        Either::Right(((), _)) => None,
    };
    let ran = match caught {
        None => Ran::Cancelled,
        Some(None) => Ran::TimedOut,
        Some(Some(Ok(verdict))) => Ran::Done(verdict),
        Some(Some(Err(panic))) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic payload".to_owned());
            Ran::Panicked(message)
        }
    };
    // The handler's future is gone, and the `Tx` with it unless it was moved out.
    if let Ok(open) = back.try_recv() {
        return (ran, Some(open));
    }
    tracing::error!("the handler's Tx outlived the handler; its writes will be rolled back");
    let deadline = started + escaped_wait;
    match tokio::time::timeout_at(deadline, back).await {
        Ok(Ok(open)) => (Ran::Escaped, Some(open)),
        _ => (Ran::Escaped, None),
    }
}

/// Rolls back a claim's transaction that is not to be recorded: the connection,
/// whether it is clean, and whether the database had committed the transaction
/// behind the engine's back (the key then keeps `transaction-ended`).
async fn abort<DB: Backend>(
    mut open: Open<DB>,
    sql: &DB::IdemSql,
    id: &Identity<'_>,
    claim: Claim,
) -> (PoolConnection<DB>, bool, bool) {
    match DB::idem_rollback(&mut open, sql, id, claim).await {
        Ok(ended) => (open.into_conn(), true, ended),
        Err(error) => {
            tracing::warn!(%error, "rollback failed");
            (open.into_conn(), false, false)
        }
    }
}

/// A request's identity, owned: for a finish left to the background.
struct HeldKey {
    scope: String,
    key: String,
    method: String,
    path: String,
    content_type: String,
    json_body: bool,
    fingerprint: [u8; 32],
    body_digest: [u8; 32],
    digest: [u8; 32],
}

impl HeldKey {
    fn of(id: &Identity<'_>) -> Self {
        Self {
            scope: id.scope.to_owned(),
            key: id.key.to_owned(),
            method: id.method.to_owned(),
            path: id.path.to_owned(),
            content_type: id.content_type.to_owned(),
            json_body: id.json_body,
            fingerprint: id.fingerprint,
            body_digest: *id.body_digest,
            digest: id.digest,
        }
    }

    fn id(&self) -> Identity<'_> {
        Identity {
            scope: &self.scope,
            key: &self.key,
            method: &self.method,
            path: &self.path,
            content_type: &self.content_type,
            json_body: self.json_body,
            fingerprint: self.fingerprint,
            body_digest: &self.body_digest,
            // A finish compares nothing.
            bytes_fingerprint: None,
            digest: self.digest,
        }
    }
}

/// The path and query of `uri`, as a request's identity holds them.
pub(crate) fn path_of(uri: &Uri) -> String {
    uri.path_and_query()
        .map_or_else(|| uri.path().to_owned(), |pq| pq.as_str().to_owned())
}

/// One span a request, at DEBUG as tower-http's are; only what an operator must
/// act on (takeovers, lost leases, store errors) is logged above it.
fn span_of(request: &RequestIdentity) -> tracing::Span {
    tracing::debug_span!(
        "idem",
        method = request.method.as_str(),
        path = %request.path,
        key = request.key.as_ref().map(IdempotencyKey::as_str),
        outcome = tracing::field::Empty,
        status = tracing::field::Empty,
    )
}

/// The endpoint's label in metrics: its route, else its method.
fn endpoint_of(request: &mut RequestIdentity) -> String {
    request.take_endpoint()
}

/// Notes `outcome` on the request's `span`, its metric and the response.
fn answered(
    span: &tracing::Span,
    outcome: Outcome,
    mut response: Response<Bytes>,
    endpoint: String,
) -> Response<Bytes> {
    if !span.is_disabled() {
        span.record("outcome", outcome.as_str());
        span.record("status", response.status().as_u16());
        span.in_scope(|| tracing::debug!("idempotent request answered"));
    }
    metrics::request(outcome.as_str(), endpoint);
    response.extensions_mut().insert(outcome);
    response
}
