//! A retrying client for idempotent endpoints: a [`tower`](https://docs.rs/tower)
//! layer around any HTTP client service (feature `client`).
//!
//! [`RetryLayer`] gives each logical request an `Idempotency-Key` (unless it already
//! has one) and sends it again, with the same key and body, after:
//!
//! - a transport error of the inner service (connection refused, reset, timed out);
//! - `409 Conflict` (the first attempt is still in flight on the server), no sooner
//!   than its `Retry-After`;
//! - `408 Request Timeout`, `425 Too Early` and `429 Too Many Requests` (not
//!   executed, try later: an idem server records none of them by default, see
//!   [`Options::release_on`](crate::Options::release_on)), no sooner than their `Retry-After` if they have one;
//! - any `5xx` (the server rolled the attempt back, or could not tell), no sooner
//!   than its `Retry-After` if it has one;
//!
//! each time after an exponential backoff with full jitter: a random pause between
//! zero and `base × 2^(attempt − 1)`, capped. It never retries another `4xx`: those
//! answers are final and, from an idem server, recorded. The [`Receipt`] on the
//! final response says which key was used, how many attempts it took, and whether
//! the answer was a replay of an earlier attempt's (`Idempotent-Replayed: true`).
//! With feature `reqwest`, [`reqwest::RetryMiddleware`] does the same for a
//! `reqwest-middleware` client.
//!
//! # Examples
//!
//! ```rust
//! # extern crate idem_runtime as idem_axum;
//! use std::time::Duration;
//! use idem_axum::client::{Receipt, RetryLayer, RetryPolicy};
//! use tower::{Layer, Service, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), std::convert::Infallible> {
//! // Any tower HTTP client works, e.g. hyper-util's; here a stand-in that answers 201.
//! let http = service_fn(|request: http::Request<String>| async move {
//!     assert!(request.headers().contains_key("idempotency-key"));
//!     Ok::<_, std::convert::Infallible>(http::Response::builder().status(201).body(()).unwrap())
//! });
//! let policy = RetryPolicy::new().max_attempts(4).base_delay(Duration::from_millis(50));
//! let mut client = RetryLayer::new(policy).layer(http);
//!
//! let request = http::Request::post("http://127.0.0.1:3000/payments")
//!     .body(r#"{"amount":1200}"#.to_owned())
//!     .unwrap();
//! let response = client.ready().await?.call(request).await?;
//! let receipt = response.extensions().get::<Receipt>().unwrap();
//! assert_eq!(receipt.attempts(), 1);
//! assert!(!receipt.replayed());
//! # Ok(())
//! # }
//! ```

use std::fmt;
use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, header};
use tower_layer::Layer;
use tower_service::Service;

use crate::key::IDEMPOTENCY_KEY;
use crate::random::random_u64;
use crate::record::IDEMPOTENT_REPLAYED;

#[cfg(feature = "reqwest")]
pub mod reqwest;

/// When and how often [`Retry`] sends a request again.
///
/// # Examples
///
/// ```
/// # extern crate idem_runtime as idem_axum;
/// use std::time::Duration;
/// use idem_axum::client::RetryPolicy;
///
/// let patient = RetryPolicy::new()
///     .max_attempts(8)
///     .base_delay(Duration::from_millis(200))
///     .max_delay(Duration::from_secs(10));
/// assert_eq!(patient.attempts(), 8);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    max_attempts: u32,
    base_delay: Duration,
    max_backoff: Duration,
    max_delay: Duration,
}

impl RetryPolicy {
    /// Defaults: 5 attempts, backoff from 100 ms doubling up to 5 s, and no single
    /// pause longer than 30 s.
    pub const fn new() -> Self {
        Self {
            max_attempts: 5,
            base_delay: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            max_delay: Duration::from_secs(30),
        }
    }

    /// How many times a request is sent at most, the first included (at least 1).
    #[must_use]
    pub const fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = if attempts == 0 { 1 } else { attempts };
        self
    }

    /// The backoff before the first retry is up to this long; each retry doubles it.
    #[must_use]
    pub const fn base_delay(mut self, delay: Duration) -> Self {
        self.base_delay = delay;
        self
    }

    /// The backoff never grows past this.
    #[must_use]
    pub const fn max_backoff(mut self, cap: Duration) -> Self {
        self.max_backoff = cap;
        self
    }

    /// The longest single pause: an answer whose `Retry-After` asks for more is
    /// returned to the caller instead of waited for.
    #[must_use]
    pub const fn max_delay(mut self, delay: Duration) -> Self {
        self.max_delay = delay;
        self
    }

    /// See [`max_attempts`](Self::max_attempts).
    pub const fn attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The backoff before retry number `retry` (1-based): uniformly random between
    /// zero and `base × 2^(retry − 1)`, capped ("full jitter", so that clients that
    /// failed together do not retry together).
    fn backoff(&self, retry: u32) -> Duration {
        let ceiling = self
            .base_delay
            .saturating_mul(1u32 << retry.saturating_sub(1).min(20))
            .min(self.max_backoff);
        let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        match nanos.checked_add(1) {
            Some(span) => Duration::from_nanos(random_u64() % span),
            None => ceiling,
        }
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self::new()
    }
}

/// What [`Retry`] did for one logical request: a response extension.
///
/// # Examples
///
/// ```
/// # extern crate idem_runtime as idem_axum;
/// # fn show(response: http::Response<()>) {
/// use idem_axum::client::Receipt;
///
/// if let Some(receipt) = response.extensions().get::<Receipt>() {
///     println!("{} attempt(s), replayed: {}", receipt.attempts(), receipt.replayed());
/// }
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Receipt {
    key: Option<HeaderValue>,
    attempts: u32,
    replayed: bool,
}

impl Receipt {
    /// The `Idempotency-Key` every attempt carried (generated unless the request
    /// had one); `None` for a method that needs none (`GET`, `PUT`, `DELETE`, ...).
    pub fn key(&self) -> Option<&str> {
        self.key.as_ref().and_then(|k| k.to_str().ok())
    }

    /// How many times the request was sent.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Whether the server answered from its record of an earlier attempt
    /// (`Idempotent-Replayed: true`) rather than by running the request now.
    pub fn replayed(&self) -> bool {
        self.replayed
    }
}

/// Wraps a service in [`Retry`].
#[derive(Debug, Clone, Copy, Default)]
pub struct RetryLayer {
    policy: RetryPolicy,
}

impl RetryLayer {
    /// A layer retrying under `policy`.
    pub const fn new(policy: RetryPolicy) -> Self {
        Self { policy }
    }
}

impl<S> Layer<S> for RetryLayer {
    type Service = Retry<S>;

    fn layer(&self, inner: S) -> Retry<S> {
        Retry {
            inner,
            policy: self.policy,
        }
    }
}

/// An HTTP client service that keys and retries requests: see the [module
/// docs](self). The request body type must be `Clone` (e.g. `Full<Bytes>`, `String`),
/// since each attempt sends it again.
#[derive(Clone)]
pub struct Retry<S> {
    inner: S,
    policy: RetryPolicy,
}

impl<S> fmt::Debug for Retry<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Retry")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl<S> Retry<S> {
    /// Wraps `inner`.
    pub const fn new(inner: S, policy: RetryPolicy) -> Self {
        Self { inner, policy }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S, B, R> Service<Request<B>> for Retry<S>
where
    S: Service<Request<B>, Response = Response<R>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    B: Clone + Send + 'static,
    R: Send + 'static,
{
    type Response = Response<R>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<R>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        // The service made ready by `poll_ready` serves the first attempt; the clone
        // left behind serves the next caller.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let policy = self.policy;
        let method = request.method().clone();
        let key = key_for(&method, request.headers_mut());
        Box::pin(async move {
            let mut attempts = 1;
            let mut sent = inner.call(copy(&request)).await;
            loop {
                let pause = match &sent {
                    Ok(response) => {
                        match pause_after(response.status(), response.headers(), attempts, &policy)
                        {
                            Some(pause) => pause,
                            None => break,
                        }
                    }
                    Err(_) => policy.backoff(attempts),
                };
                if attempts >= policy.max_attempts {
                    break;
                }
                tokio::time::sleep(pause).await;
                attempts += 1;
                sent = match poll_fn(|cx| inner.poll_ready(cx)).await {
                    Ok(()) => inner.call(copy(&request)).await,
                    Err(error) => Err(error),
                };
            }
            sent.map(|mut response| {
                let receipt = Receipt::of(key, attempts, response.headers());
                response.extensions_mut().insert(receipt);
                response
            })
        })
    }
}

impl Receipt {
    /// What the final answer, with `headers`, says after `attempts` under `key`.
    fn of(key: Option<HeaderValue>, attempts: u32, headers: &HeaderMap) -> Self {
        let replayed = headers
            .get(IDEMPOTENT_REPLAYED)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
        Self {
            key,
            attempts,
            replayed,
        }
    }
}

/// The request's key, after giving a non-idempotent request without one a fresh
/// key: 128 random bits, sent as a structured-field string as the IETF draft has it.
fn key_for(method: &Method, headers: &mut HeaderMap) -> Option<HeaderValue> {
    if let Some(key) = headers.get(IDEMPOTENCY_KEY) {
        return Some(key.clone());
    }
    if !matches!(*method, Method::POST | Method::PATCH) {
        return None;
    }
    let key = format!("\"{:016x}{:016x}\"", random_u64(), random_u64());
    let value = HeaderValue::try_from(key).ok()?;
    headers.insert(IDEMPOTENCY_KEY, value.clone());
    Some(value)
}

/// The pause before sending again after an answer of `status` with `headers`, or
/// `None` to return it.
fn pause_after(
    status: StatusCode,
    headers: &HeaderMap,
    attempts: u32,
    policy: &RetryPolicy,
) -> Option<Duration> {
    let later = matches!(
        status,
        StatusCode::CONFLICT
            | StatusCode::REQUEST_TIMEOUT
            | StatusCode::TOO_EARLY
            | StatusCode::TOO_MANY_REQUESTS
    );
    if !later && !status.is_server_error() {
        return None;
    }
    let asked = headers
        .get(header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs);
    let pause = match asked {
        Some(asked) if asked > policy.max_delay => return None,
        Some(asked) => asked.max(policy.backoff(attempts)),
        None => policy.backoff(attempts),
    };
    Some(pause.min(policy.max_delay))
}

/// The same request again; `http` requests are not `Clone` because bodies often
/// are not, but ours must be.
fn copy<B: Clone>(request: &Request<B>) -> Request<B> {
    let mut copy = Request::new(request.body().clone());
    *copy.method_mut() = request.method().clone();
    *copy.uri_mut() = request.uri().clone();
    *copy.version_mut() = request.version();
    *copy.headers_mut() = request.headers().clone();
    *copy.extensions_mut() = request.extensions().clone();
    copy
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_jittered_below_a_doubling_capped_ceiling() {
        let policy = RetryPolicy::new()
            .base_delay(Duration::from_millis(100))
            .max_backoff(Duration::from_millis(350));
        for _ in 0..200 {
            assert!(policy.backoff(1) <= Duration::from_millis(100));
            assert!(policy.backoff(2) <= Duration::from_millis(200));
            assert!(policy.backoff(3) <= Duration::from_millis(350));
            assert!(policy.backoff(40) <= Duration::from_millis(350));
        }
        // Full jitter: the pauses spread over the range rather than sit at its top.
        let spread: Vec<_> = (0..200).map(|_| policy.backoff(3)).collect();
        assert!(spread.iter().any(|d| *d < Duration::from_millis(175)));
        assert!(spread.iter().any(|d| *d > Duration::from_millis(175)));
    }

    fn pause_after_answer(
        answer: &Response<()>,
        attempts: u32,
        policy: &RetryPolicy,
    ) -> Option<Duration> {
        pause_after(answer.status(), answer.headers(), attempts, policy)
    }

    fn answer(status: u16, retry_after: Option<&str>) -> Response<()> {
        let mut response = Response::new(());
        *response.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::IM_A_TEAPOT);
        if let Some(seconds) = retry_after {
            response.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from_str(seconds).unwrap_or(HeaderValue::from_static("x")),
            );
        }
        response
    }

    #[test]
    fn only_conflicts_and_server_errors_are_retried() {
        let policy = RetryPolicy::new().base_delay(Duration::from_millis(10));
        for final_status in [200, 201, 204, 302, 400, 401, 402, 404, 413, 422] {
            assert_eq!(
                pause_after_answer(&answer(final_status, None), 1, &policy),
                None,
                "{final_status}"
            );
        }
        for retried in [408, 409, 425, 429, 500, 502, 503, 504] {
            assert!(
                pause_after_answer(&answer(retried, None), 1, &policy).is_some(),
                "{retried}"
            );
        }
    }

    #[test]
    fn retry_after_is_a_floor_and_too_long_a_wait_is_returned() {
        let policy = RetryPolicy::new()
            .base_delay(Duration::from_millis(10))
            .max_delay(Duration::from_secs(5));
        assert_eq!(
            pause_after_answer(&answer(409, Some("3")), 1, &policy),
            Some(Duration::from_secs(3))
        );
        assert_eq!(
            pause_after_answer(&answer(409, Some("6")), 1, &policy),
            None
        );
        // Unparseable (an HTTP date, say): the backoff alone.
        let pause = pause_after_answer(&answer(503, Some("soon")), 1, &policy);
        assert!(pause.is_some_and(|p| p <= Duration::from_millis(10)));
    }

    fn key_of<B>(request: &mut Request<B>) -> Option<HeaderValue> {
        let method = request.method().clone();
        key_for(&method, request.headers_mut())
    }

    #[test]
    fn keys_are_generated_for_post_and_patch_only_and_kept() {
        let mut post = Request::post("/p").body(()).unwrap_or_default();
        let key = key_of(&mut post).expect("a key for POST");
        let text = key.to_str().unwrap_or_default().to_owned();
        assert_eq!(text.len(), 34, "{text}");
        assert!(text.starts_with('"') && text.ends_with('"'));
        assert!(crate::IdempotencyKey::parse(key.as_bytes()).is_ok());
        assert_eq!(post.headers().get(IDEMPOTENCY_KEY), Some(&key));
        assert_eq!(key_of(&mut post), Some(key.clone()), "kept, not replaced");

        let mut other = Request::post("/p").body(()).unwrap_or_default();
        assert_ne!(key_of(&mut other), Some(key), "a key per logical request");
        let mut get = Request::get("/p").body(()).unwrap_or_default();
        assert_eq!(key_of(&mut get), None);
        assert!(get.headers().get(IDEMPOTENCY_KEY).is_none());
    }
}
