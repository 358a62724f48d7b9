//! Proves, in your own tests, that an `#[idempotent]` handler runs exactly once
//! (feature `testing`).
//!
//! [`ExactlyOnce`] drives your router as clients do and checks, against a count of
//! what the handler writes that you give it:
//!
//! 1. **every write goes through the `Tx`**: with the store's record made to fail
//!    on purpose, the request is answered 5xx and the count does not move. A handler
//!    that writes through the pool instead of its `Tx` fails here: its write
//!    commits although nothing was recorded, and the client's retry would write
//!    again;
//! 2. **concurrent duplicates run it once**: requests sent together with one key
//!    move the count as much as one execution does, and are answered the first
//!    answer or 409 while it runs;
//! 3. **a retry replays byte for byte**: the same status and body, with
//!    `Idempotent-Replayed: true`, and the count does not move;
//! 4. **another body with the key is refused**: 422, and the count does not move.
//!
//! Give it a store no other test uses meanwhile: for the first check, every record
//! of that store fails, whoever sends the request.
//!
//! # Examples
//!
//! ```rust,no_run
//! # extern crate idem_runtime as idem_axum;
//! # #[cfg(feature = "sqlite")]
//! # async fn demo(app: axum::Router, store: idem_axum::Idempotency<sqlx::Sqlite>, pool: sqlx::SqlitePool) {
//! use axum::body::Body;
//! use axum::http::Request;
//! use idem_axum::testing::ExactlyOnce;
//!
//! let orders = move || {
//!     let pool = pool.clone();
//!     async move {
//!         sqlx::query_scalar("SELECT count(*) FROM orders")
//!             .fetch_one(&pool)
//!             .await
//!             .expect("count orders")
//!     }
//! };
//! let request = || {
//!     Request::post("/orders")
//!         .header("x-user", "alice")
//!         .header("content-type", "application/json")
//!         .body(Body::from(r#"{"item": "book", "quantity": 2}"#))
//!         .expect("request")
//! };
//! ExactlyOnce::new(app, &store, request, orders)
//!     .check()
//!     .await
//!     .expect("create_order runs exactly once");
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, Request, StatusCode};
use http_body_util::BodyExt as _;
use tower_service::Service as _;

use crate::{Backend, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, Idempotency};

type Count = Box<dyn Fn() -> Pin<Box<dyn Future<Output = i64> + Send>> + Send + Sync>;

/// A check that a handler runs exactly once per key; see the [module](self).
pub struct ExactlyOnce {
    router: Router,
    request: Box<dyn Fn() -> Request<Body> + Send + Sync>,
    count: Count,
    fail_records: Box<dyn Fn(bool) + Send + Sync>,
    duplicates: usize,
    other_body: Option<Bytes>,
}

impl fmt::Debug for ExactlyOnce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExactlyOnce")
            .field("duplicates", &self.duplicates)
            .finish_non_exhaustive()
    }
}

/// Why a handler is not exactly-once, with what was seen.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Failure {
    /// One request moved nothing: the count given does not count what the handler
    /// writes, and nothing else can be checked.
    NothingCounted,
    /// The handler wrote although its record failed, so nothing was committed in
    /// its transaction: it writes outside its `Tx` (through the pool, or another
    /// connection), and a retry would write again.
    WroteOutsideTx {
        /// How much the count moved.
        moved: i64,
    },
    /// An answer that should not be: `what` names the step.
    Unexpected {
        /// The step and what it expected.
        what: &'static str,
        /// The status answered.
        status: u16,
        /// The body answered, lossily as text.
        body: String,
    },
    /// The count moved by `moved` where one execution moves it by `once`.
    RanMoreThanOnce {
        /// The step.
        what: &'static str,
        /// How much one execution moves the count.
        once: i64,
        /// How much it moved.
        moved: i64,
    },
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NothingCounted => f.write_str(
                "one request did not move the count: give a count of what the handler writes",
            ),
            Self::WroteOutsideTx { moved } => write!(
                f,
                "the count moved by {moved} although the record failed and the transaction \
                 rolled back: the handler writes outside its Tx (through the pool?), so a \
                 retry writes again"
            ),
            Self::Unexpected { what, status, body } => {
                write!(f, "{what}: answered {status}: {body}")
            }
            Self::RanMoreThanOnce { what, once, moved } => write!(
                f,
                "{what}: the count moved by {moved}, one execution moves it by {once}: the \
                 handler ran more than once"
            ),
        }
    }
}

impl std::error::Error for Failure {}

/// What the checks saw, when they passed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Report {
    /// How much one execution moves the count.
    pub once: i64,
    /// Of the concurrent duplicates, how many were answered 409 while the first ran.
    pub conflicts: usize,
}

impl ExactlyOnce {
    /// A check of the handler `router` routes `request` to, on `store` (the one in
    /// the router's state), with `count` counting what the handler writes (rows of
    /// its business table). `request` builds the request without a key: the check
    /// gives each step a key of its own.
    pub fn new<DB, R, C, F>(router: Router, store: &Idempotency<DB>, request: R, count: C) -> Self
    where
        DB: Backend,
        R: Fn() -> Request<Body> + Send + Sync + 'static,
        C: Fn() -> F + Send + Sync + 'static,
        F: Future<Output = i64> + Send + 'static,
    {
        let store = store.clone();
        Self {
            router,
            request: Box::new(request),
            count: Box::new(move || Box::pin(count())),
            fail_records: Box::new(move |on| store.fail_records(on)),
            duplicates: 8,
            other_body: None,
        }
    }

    /// How many requests are sent together with one key (8 by default).
    pub fn duplicates(mut self, n: usize) -> Self {
        self.duplicates = n.max(2);
        self
    }

    /// The body sent with a used key, which must be refused 422. By default the
    /// request's body with a space appended (still the same JSON, another body).
    pub fn other_body(mut self, body: impl Into<Bytes>) -> Self {
        self.other_body = Some(body.into());
        self
    }

    /// Runs the checks of the [module](self), in order; the first that fails is
    /// returned.
    pub async fn check(self) -> Result<Report, Failure> {
        let once = self.one_execution().await?;
        self.writes_go_through_the_tx().await?;
        let (answer, conflicts) = self.duplicates_run_once(once).await?;
        self.retries_replay(&answer, once).await?;
        self.other_bodies_are_refused(&answer.key, once).await?;
        Ok(Report { once, conflicts })
    }

    async fn one_execution(&self) -> Result<i64, Failure> {
        let (answer, once) = self.counted(&fresh_key(), None).await;
        if !answer.status.is_success() {
            return Err(answer.unexpected("one request, expected a 2xx"));
        }
        if once == 0 {
            return Err(Failure::NothingCounted);
        }
        Ok(once)
    }

    async fn writes_go_through_the_tx(&self) -> Result<(), Failure> {
        (self.fail_records)(true);
        let (answer, moved) = self.counted(&fresh_key(), None).await;
        (self.fail_records)(false);
        if moved != 0 {
            return Err(Failure::WroteOutsideTx { moved });
        }
        if !answer.status.is_server_error() {
            return Err(answer.unexpected("a request whose record failed, expected a 5xx"));
        }
        Ok(())
    }

    async fn duplicates_run_once(&self, once: i64) -> Result<(Answer, usize), Failure> {
        let key = fresh_key();
        let before = (self.count)().await;
        let sends = (0..self.duplicates).map(|_| self.send(&key, None));
        let answers = futures_util::future::join_all(sends).await;
        let moved = (self.count)().await - before;
        if moved != once {
            return Err(Failure::RanMoreThanOnce {
                what: "concurrent duplicates",
                once,
                moved,
            });
        }
        let mut first: Option<Answer> = None;
        let mut conflicts = 0;
        for answer in answers {
            if answer.status == StatusCode::CONFLICT {
                conflicts += 1;
                continue;
            }
            if !answer.status.is_success() {
                return Err(answer.unexpected("a concurrent duplicate, expected a 2xx or 409"));
            }
            match &first {
                None => first = Some(answer),
                Some(first) if first.status == answer.status && first.body == answer.body => {}
                Some(_) => {
                    return Err(answer
                        .unexpected("a concurrent duplicate, expected the first answer again"));
                }
            }
        }
        let Some(answer) = first else {
            return Err(Failure::Unexpected {
                what: "concurrent duplicates, expected one answered 2xx",
                status: StatusCode::CONFLICT.as_u16(),
                body: String::new(),
            });
        };
        Ok((answer, conflicts))
    }

    async fn retries_replay(&self, first: &Answer, once: i64) -> Result<(), Failure> {
        let (replay, moved) = self.counted(&first.key, None).await;
        if moved != 0 {
            return Err(Failure::RanMoreThanOnce {
                what: "a retry",
                once,
                moved,
            });
        }
        if replay.status != first.status || replay.body != first.body || !replay.replayed {
            return Err(replay.unexpected("a retry, expected the first answer replayed"));
        }
        Ok(())
    }

    /// `key`: one whose request was executed and recorded.
    async fn other_bodies_are_refused(&self, key: &str, once: i64) -> Result<(), Failure> {
        let body = match &self.other_body {
            Some(body) => body.clone(),
            None => {
                let mut body = self.body().await.to_vec();
                body.push(b' ');
                Bytes::from(body)
            }
        };
        let (other, moved) = self.counted(key, Some(body)).await;
        if moved != 0 {
            return Err(Failure::RanMoreThanOnce {
                what: "another body with a used key",
                once,
                moved,
            });
        }
        if other.status != StatusCode::UNPROCESSABLE_ENTITY {
            return Err(other.unexpected("another body with a used key, expected 422"));
        }
        Ok(())
    }

    /// Sends one request with `key` (and `body` in place of the request's): its
    /// answer, and how much it moved the count.
    async fn counted(&self, key: &str, body: Option<Bytes>) -> (Answer, i64) {
        let before = (self.count)().await;
        let answer = self.send(key, body).await;
        (answer, (self.count)().await - before)
    }

    /// The body `request` builds.
    async fn body(&self) -> Bytes {
        let body = (self.request)().into_body();
        body.collect()
            .await
            .map(|collected| collected.to_bytes())
            .unwrap_or_default()
    }

    async fn send(&self, key: &str, body: Option<Bytes>) -> Answer {
        let mut request = (self.request)();
        if let Some(body) = body {
            *request.body_mut() = Body::from(body);
        }
        if let Ok(value) = HeaderValue::from_str(&format!("\"{key}\"")) {
            request.headers_mut().insert(IDEMPOTENCY_KEY, value);
        }
        let mut router = self.router.clone();
        let ready = std::future::poll_fn(|cx| {
            tower_service::Service::<Request<Body>>::poll_ready(&mut router, cx)
        })
        .await;
        let response = match ready {
            Ok(()) => router.call(request).await,
            Err(never) => match never {},
        };
        let response = match response {
            Ok(response) => response,
            Err(never) => match never {},
        };
        let status = response.status();
        let replayed = response.headers().contains_key(IDEMPOTENT_REPLAYED);
        let body = response
            .into_body()
            .collect()
            .await
            .map(|collected| collected.to_bytes())
            .unwrap_or_default();
        Answer {
            key: key.to_owned(),
            status,
            body,
            replayed,
        }
    }
}

/// One response, read whole.
struct Answer {
    key: String,
    status: StatusCode,
    body: Bytes,
    replayed: bool,
}

impl Answer {
    fn unexpected(&self, what: &'static str) -> Failure {
        Failure::Unexpected {
            what,
            status: self.status.as_u16(),
            body: String::from_utf8_lossy(&self.body).into_owned(),
        }
    }
}

/// A key no other check of this process uses.
fn fresh_key() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!(
        "idem-testing-{}-{n}-{:016x}",
        std::process::id(),
        crate::engine::random_u64()
    )
}
