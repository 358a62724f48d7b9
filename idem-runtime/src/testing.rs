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
//! 2. **concurrent duplicates run it once**: the first request's execution is held
//!    in flight by the store, its handler done and its writes not yet committed,
//!    while duplicates with its key arrive; they move the count as much as one
//!    execution does, and are answered the first answer or 409. However fast the
//!    handler, however small the pool, the duplicates overlap it for real
//!    ([`Report::overlapped`]), or the check fails saying why;
//! 3. **a retry replays byte for byte**: the same status and body, with
//!    `Idempotent-Replayed: true`, and the count does not move;
//! 4. **another body with the key is refused**: 422, and the count does not move.
//!
//! It also names what is not a check's failure but a setup's: a request that
//! never reaches the store ([`Failure::NotIdempotent`]: no `#[idempotent]`, or a
//! router whose state holds another store), and a handler that waits for a
//! connection of the pool while its `Tx` holds the last one
//! ([`Failure::WaitsForPool`], after [`ExactlyOnce::patience`]: what a handler
//! that uses the pool does on a one-connection pool, such as an in-memory SQLite
//! database's). On SQLite, the handler's transaction begins without the write lock
//! during the first request and check 1, so that a write through the pool commits
//! and is counted instead of waiting for that lock.
//!
//! # What to count
//!
//! Count the rows the handler writes in its own tables (orders, payments, ledger
//! lines): what a second execution would write again. Do not count calls to an
//! external provider to which the handler relays its key
//! ([`IdempotencyKey::derive`](crate::IdempotencyKey::derive)): the provider
//! deduplicates them itself, so check 1 sees the call made although the record
//! failed, and reports it as a write outside the `Tx`, which it is not.
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
//! // The rows create_order writes: what a second execution would write again.
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
//! // A failure prints its sentence, e.g. "WroteOutsideTx: the count moved by 1 …".
//! let report = ExactlyOnce::new(app, &store, request, orders)
//!     .check()
//!     .await
//!     .expect("create_order runs exactly once");
//! assert!(report.overlapped > 0);
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, Request, StatusCode};
use futures_util::future::{Either, join_all, select};
use http_body_util::BodyExt as _;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tower_service::Service as _;

use crate::hooks::Hooks;
use crate::{Backend, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, Idempotency};

type Count = Box<dyn Fn() -> Pin<Box<dyn Future<Output = i64> + Send>> + Send + Sync>;

/// How often a duplicate answered 503 is sent again before it counts as answered.
const RETRIES_OF_A_503: usize = 3;

/// How long the kit waits for the first of the duplicates to be held in flight,
/// and then for the duplicates to reach the store, before it says it could not
/// make them overlap.
const OVERLAP_BOUND: Duration = Duration::from_secs(10);

/// How often a pending request's store is looked at.
const LOOK_EVERY: Duration = Duration::from_millis(25);

/// A check that a handler runs exactly once per key; see the [module](self).
pub struct ExactlyOnce {
    router: Router,
    request: Box<dyn Fn() -> Request<Body> + Send + Sync>,
    count: Count,
    store: Box<dyn Probe>,
    duplicates: usize,
    other_body: Option<Bytes>,
    patience: Duration,
}

impl fmt::Debug for ExactlyOnce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExactlyOnce")
            .field("duplicates", &self.duplicates)
            .field("patience", &self.patience)
            .finish_non_exhaustive()
    }
}

/// Why a handler is not exactly-once, with what was seen. Its `Debug` is its
/// sentence, after the variant's name, so that `.expect(…)` prints it.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Failure {
    /// One request moved nothing: the count given does not count what the handler
    /// writes, and nothing else can be checked.
    NothingCounted,
    /// A keyed request never reached the store given to the kit: the handler is
    /// not `#[idempotent]` (nor runs through `IdempotentRequest`), or the router's
    /// state holds another store.
    NotIdempotent,
    /// The handler wrote although its record failed, so nothing was committed in
    /// its transaction: it writes outside its `Tx` (through the pool, or another
    /// connection), and a retry would write again.
    WroteOutsideTx {
        /// How much the count moved.
        moved: i64,
    },
    /// A request did not answer within [`ExactlyOnce::patience`] while its `Tx`
    /// held every connection of the pool: the handler waits for a connection of
    /// the pool, so it uses the pool instead of its `Tx`, and what it writes there
    /// would commit outside the transaction.
    WaitsForPool {
        /// The pool's connections, all out.
        connections: u32,
        /// How long the request had waited.
        waited: Duration,
    },
    /// The duplicates could not be made to overlap the first execution.
    NotConcurrent {
        /// What happened instead.
        why: &'static str,
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

impl Failure {
    fn name(&self) -> &'static str {
        match self {
            Self::NothingCounted => "NothingCounted",
            Self::NotIdempotent => "NotIdempotent",
            Self::WroteOutsideTx { .. } => "WroteOutsideTx",
            Self::WaitsForPool { .. } => "WaitsForPool",
            Self::NotConcurrent { .. } => "NotConcurrent",
            Self::Unexpected { .. } => "Unexpected",
            Self::RanMoreThanOnce { .. } => "RanMoreThanOnce",
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NothingCounted => f.write_str(
                "one request did not move the count: give a count of what the handler writes",
            ),
            Self::NotIdempotent => f.write_str(
                "a keyed request never reached the store given to the kit: the handler is \
                 not #[idempotent], or its router's state holds another store",
            ),
            Self::WroteOutsideTx { moved } => write!(
                f,
                "the count moved by {moved} although the record failed and the transaction \
                 rolled back: the handler writes outside its Tx (through the pool?), so a \
                 retry writes again"
            ),
            Self::WaitsForPool {
                connections,
                waited,
            } => write!(
                f,
                "the handler writes outside its Tx: a request waited {:.1} s while its Tx \
                 held every connection of the pool ({connections}), so the handler waits for \
                 one, i.e. it uses the pool instead of its Tx; what it writes there commits \
                 outside the transaction, and a retry writes again (a handler that is only \
                 slow needs more `ExactlyOnce::patience`)",
                waited.as_secs_f64()
            ),
            Self::NotConcurrent { why } => {
                write!(f, "concurrent duplicates were not tested: {why}")
            }
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

impl fmt::Debug for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {self}", self.name())
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
    /// Of the concurrent duplicates, how many reached the store while the first
    /// execution was held in flight: all of them, unless the check failed.
    pub overlapped: usize,
}

impl ExactlyOnce {
    /// A check of the handler `router` routes `request` to, on `store` (the one in
    /// the router's state), with `count` counting what the handler writes (rows of
    /// its business tables: see [What to count](self#what-to-count)). `request`
    /// builds the request without a key: the check gives each step a key of its own.
    pub fn new<DB, R, C, F>(router: Router, store: &Idempotency<DB>, request: R, count: C) -> Self
    where
        DB: Backend,
        R: Fn() -> Request<Body> + Send + Sync + 'static,
        C: Fn() -> F + Send + Sync + 'static,
        F: Future<Output = i64> + Send + 'static,
    {
        store.inner().hooks.watch();
        Self {
            router,
            request: Box::new(request),
            count: Box::new(move || Box::pin(count())),
            store: Box::new(store.clone()),
            duplicates: 8,
            other_body: None,
            patience: Duration::from_secs(2),
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

    /// How long a request may go unanswered while its `Tx` holds every connection
    /// of the pool before the check concludes that the handler waits for the pool
    /// ([`Failure::WaitsForPool`]); 2 seconds by default. Raise it for a handler
    /// that is slow on purpose (a provider's latency) on a one-connection pool.
    pub fn patience(mut self, patience: Duration) -> Self {
        self.patience = patience;
        self
    }

    /// Runs the checks of the [module](self), in order; the first that fails is
    /// returned.
    pub async fn check(self) -> Result<Report, Failure> {
        let once = self.one_execution().await?;
        self.writes_go_through_the_tx().await?;
        let (answer, conflicts, overlapped) = self.duplicates_run_once(once).await?;
        self.retries_replay(&answer, once).await?;
        self.other_bodies_are_refused(&answer.key, once).await?;
        Ok(Report {
            once,
            conflicts,
            overlapped,
        })
    }

    async fn one_execution(&self) -> Result<i64, Failure> {
        let arrived = self.store.hooks().arrivals();
        self.store.defer_write_lock(true);
        let counted = self.counted(&fresh_key(), None).await;
        self.store.defer_write_lock(false);
        let (answer, once) = counted?;
        if self.store.hooks().arrivals() == arrived {
            return Err(Failure::NotIdempotent);
        }
        if !answer.status.is_success() {
            return Err(answer.unexpected(if self.store.backend() == "SQLite" {
                "one request, expected a 2xx (on SQLite, a handler that writes through the \
                 pool while its Tx holds the write lock fails with `database is locked`)"
            } else {
                "one request, expected a 2xx"
            }));
        }
        if once == 0 {
            return Err(Failure::NothingCounted);
        }
        Ok(once)
    }

    async fn writes_go_through_the_tx(&self) -> Result<(), Failure> {
        self.store.hooks().fail_records(true);
        self.store.defer_write_lock(true);
        let counted = self.counted(&fresh_key(), None).await;
        self.store.defer_write_lock(false);
        self.store.hooks().fail_records(false);
        let (answer, moved) = counted?;
        if moved != 0 {
            return Err(Failure::WroteOutsideTx { moved });
        }
        if !answer.status.is_server_error() {
            return Err(answer.unexpected("a request whose record failed, expected a 5xx"));
        }
        Ok(())
    }

    /// Holds the first request's execution in flight until every duplicate has
    /// reached the store (or been answered), then lets it record.
    async fn duplicates_run_once(&self, once: i64) -> Result<(Answer, usize, usize), Failure> {
        let key = fresh_key();
        let before = (self.count)().await;
        let hooks = self.store.hooks();
        let (reached, release) = hooks.hold_next();
        let arrived = hooks.arrivals();
        let mut first = pin!(self.send(&key, None));
        let waiting = pin!(tokio::time::timeout(OVERLAP_BOUND, reached));
        match select(first.as_mut(), waiting).await {
            Either::Right((Ok(Ok(())), _)) => {}
            Either::Left((answer, _)) => {
                hooks.unhold();
                if !answer.status.is_success() {
                    return Err(
                        answer.unexpected("the first of concurrent duplicates, expected a 2xx")
                    );
                }
                return Err(Failure::NotConcurrent {
                    why: "the first request was answered without executing",
                });
            }
            Either::Right(_) => {
                hooks.unhold();
                return Err(Failure::NotConcurrent {
                    why: "the first request was not executing after 10 s",
                });
            }
        }
        let others = self.duplicates - 1;
        let mut sends = pin!(join_all((0..others).map(|_| self.send(&key, None))));
        let until = Instant::now() + OVERLAP_BOUND;
        let mut answered = None;
        while hooks.arrivals() - arrived < 1 + others as u64 && Instant::now() < until {
            if let Ok(answers) = tokio::time::timeout(LOOK_EVERY, sends.as_mut()).await {
                answered = Some(answers);
                break;
            }
        }
        // The first arrived too.
        let overlapped = hooks.arrivals().saturating_sub(arrived + 1);
        let overlapped = usize::try_from(overlapped).unwrap_or(usize::MAX);
        let _ = release.send(());
        let first = first.await;
        let mut answers = match answered {
            Some(answers) => answers,
            None => sends.await,
        };
        // A duplicate the database would not serialize beside the first (at
        // SERIALIZABLE) is answered 503, retry with the same key: sent again, as
        // a client does, and judged by what it gets then.
        for answer in &mut answers {
            for _ in 0..RETRIES_OF_A_503 {
                if answer.status != StatusCode::SERVICE_UNAVAILABLE {
                    break;
                }
                *answer = self.send(&key, None).await;
            }
        }
        let moved = (self.count)().await - before;
        if moved != once {
            return Err(Failure::RanMoreThanOnce {
                what: "concurrent duplicates",
                once,
                moved,
            });
        }
        if overlapped < others {
            return Err(Failure::NotConcurrent {
                why: "the duplicates did not reach the store within 10 s of the first's execution",
            });
        }
        if !first.status.is_success() {
            return Err(first.unexpected("the first of concurrent duplicates, expected a 2xx"));
        }
        let mut conflicts = 0;
        for answer in answers {
            if answer.status == StatusCode::CONFLICT {
                conflicts += 1;
                continue;
            }
            if !answer.status.is_success() {
                return Err(answer.unexpected("a concurrent duplicate, expected a 2xx or 409"));
            }
            if answer.status != first.status || answer.body != first.body {
                return Err(
                    answer.unexpected("a concurrent duplicate, expected the first answer again")
                );
            }
        }
        Ok((first, conflicts, overlapped))
    }

    async fn retries_replay(&self, first: &Answer, once: i64) -> Result<(), Failure> {
        let (replay, moved) = self.counted(&first.key, None).await?;
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
        let (other, moved) = self.counted(key, Some(body)).await?;
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

    /// Sends one request with `key` (and `body` in place of the request's), alone:
    /// its answer, and how much it moved the count.
    async fn counted(&self, key: &str, body: Option<Bytes>) -> Result<(Answer, i64), Failure> {
        let before = (self.count)().await;
        let answer = self.send_alone(key, body).await?;
        Ok((answer, (self.count)().await - before))
    }

    /// [`send`](Self::send), watching the store meanwhile: a request that waits
    /// while its `Tx` holds every connection of the pool is a handler waiting for
    /// the pool, which would wait until the pool's acquire timeout.
    async fn send_alone(&self, key: &str, body: Option<Bytes>) -> Result<Answer, Failure> {
        let began = Instant::now();
        let mut starved_since = None;
        let mut answer = pin!(self.send(key, body));
        loop {
            if let Ok(answer) = tokio::time::timeout(LOOK_EVERY, answer.as_mut()).await {
                return Ok(answer);
            }
            let starved = self.store.starved().filter(|_| self.store.running() > 0);
            match (starved, starved_since) {
                (None, _) => starved_since = None,
                (Some(_), None) => starved_since = Some(Instant::now()),
                (Some(connections), Some(since)) if since.elapsed() >= self.patience => {
                    return Err(Failure::WaitsForPool {
                        connections,
                        waited: began.elapsed(),
                    });
                }
                (Some(_), Some(_)) => {}
            }
        }
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

/// What the kit steers and watches in a store, whatever its database.
trait Probe: Send + Sync {
    fn hooks(&self) -> &Hooks;
    fn defer_write_lock(&self, on: bool);
    /// Executions in flight.
    fn running(&self) -> usize;
    /// The pool's connections when every one it may open is out.
    fn starved(&self) -> Option<u32>;
    fn backend(&self) -> &'static str;
}

impl<DB: Backend> Probe for Idempotency<DB> {
    fn hooks(&self) -> &Hooks {
        &self.inner().hooks
    }

    fn defer_write_lock(&self, on: bool) {
        DB::idem_testing_deferred(&self.inner().sql, on);
    }

    fn running(&self) -> usize {
        self.inner().lifecycle.running()
    }

    fn starved(&self) -> Option<u32> {
        let pool = &self.inner().pool;
        let most = pool.options().get_max_connections();
        (pool.size() >= most && pool.num_idle() == 0).then_some(most)
    }

    fn backend(&self) -> &'static str {
        DB::NAME
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
        crate::random::random_u64()
    )
}

impl<DB: Backend> Idempotency<DB> {
    /// Holds this store's next claim between its commit and the handler's
    /// transaction, as a stalled commit or a paused process would: the first
    /// receiver says it is held, the sender lets it go. `None` where the claim is
    /// part of the handler's transaction (PostgreSQL, standalone MySQL) or the
    /// mode is not known yet (MySQL, before the store's first request).
    #[doc(hidden)]
    pub fn hold_after_claim(&self) -> Option<(oneshot::Receiver<()>, oneshot::Sender<()>)> {
        DB::idem_testing_stall(&self.inner().sql).map(crate::hooks::Stall::arm)
    }
}
