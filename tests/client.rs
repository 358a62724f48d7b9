//! The retrying client (`idem_axum::client`, feature `client`) against a real idem server
//! over loopback HTTP, on SQLite: what it retries, what it never retries, and that
//! the business write happens once however many attempts it takes.

#![allow(missing_docs)]

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idem_axum::client::{Receipt, Retry, RetryLayer, RetryPolicy};
use idem_axum::{Idempotency, Tx, idempotent};
use sqlx::Sqlite;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use tower::{Layer as _, Service as _, ServiceExt as _};

type Http = Retry<Client<HttpConnector, Full<Bytes>>>;

/// What the server is told to do to the next requests, through its state.
#[derive(Clone)]
struct App {
    store: Idempotency<Sqlite>,
    /// Executions left to fail with 500 (rolled back, key released).
    fail: Arc<AtomicU32>,
    /// Statuses the next executions answer after writing, in order: a handler's
    /// own "not executed, try later" (rolled back, key released).
    refuse: Arc<std::sync::Mutex<Vec<u16>>>,
    /// Completed executions whose response is lost on the way back (the proxy
    /// answers 502 although the payment committed).
    lose: Arc<AtomicU32>,
    /// Told when `slow` has written, so a test knows the key is held.
    started: Arc<tokio::sync::Notify>,
}

impl axum::extract::FromRef<App> for Idempotency<Sqlite> {
    fn from_ref(app: &App) -> Self {
        app.store.clone()
    }
}

#[idempotent(unscoped = true, lock = "2s")]
async fn pay(State(app): State<App>, mut tx: Tx<Sqlite>, body: String) -> Response {
    let failing = app
        .fail
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok();
    let refused = app.refuse.lock().ok().and_then(|mut left| left.pop());
    let inserted = sqlx::query("INSERT INTO payments (body) VALUES (?1) RETURNING id")
        .bind(&body)
        .fetch_one(&mut *tx)
        .await;
    match inserted {
        _ if failing => (StatusCode::INTERNAL_SERVER_ERROR, "provider down").into_response(),
        _ if refused.is_some() => {
            let status = refused
                .and_then(|s| StatusCode::from_u16(s).ok())
                .unwrap_or(StatusCode::TOO_MANY_REQUESTS);
            (status, [(header::RETRY_AFTER, "0")], "later").into_response()
        }
        Ok(row) => {
            let id: i64 = sqlx::Row::get(&row, 0);
            (StatusCode::CREATED, format!(r#"{{"id":{id}}}"#)).into_response()
        }
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

#[idempotent(unscoped = true, lock = "2s")]
async fn slow(State(app): State<App>, mut tx: Tx<Sqlite>, body: String) -> Response {
    let inserted = sqlx::query("INSERT INTO payments (body) VALUES (?1)")
        .bind(&body)
        .execute(&mut *tx)
        .await;
    app.started.notify_one();
    tokio::time::sleep(Duration::from_millis(800)).await;
    match inserted {
        Ok(_) => (StatusCode::CREATED, "slow").into_response(),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

/// A proxy that loses the response of a committed execution (never of a replay).
async fn lossy(State(app): State<App>, request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    let executed =
        response.status().is_success() && !response.headers().contains_key("idempotent-replayed");
    if executed
        && app
            .lose
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    {
        return StatusCode::BAD_GATEWAY.into_response();
    }
    response
}

struct Server {
    app: App,
    pool: sqlx::SqlitePool,
    path: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm"] {
            let mut file = self.path.clone().into_os_string();
            file.push(suffix);
            let _ = std::fs::remove_file(file);
        }
    }
}

impl Server {
    async fn new() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let path = std::env::temp_dir().join(format!(
            "idem_test_client_{}_{nanos}.db",
            std::process::id()
        ));
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(
                SqliteConnectOptions::new()
                    .filename(&path)
                    .create_if_missing(true)
                    .journal_mode(SqliteJournalMode::Wal)
                    .busy_timeout(Duration::from_secs(10)),
            )
            .await
            .expect("open sqlite");
        sqlx::raw_sql("CREATE TABLE payments (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")
            .execute(&pool)
            .await
            .expect("create payments");
        let store = Idempotency::new(pool.clone());
        store.migrate().await.expect("migrate");
        let app = App {
            store,
            fail: Arc::default(),
            refuse: Arc::default(),
            lose: Arc::default(),
            started: Arc::default(),
        };
        Self { app, pool, path }
    }

    fn router(&self) -> Router {
        Router::new()
            .route("/pay", post(pay))
            .route("/slow", post(slow))
            .layer(middleware::from_fn_with_state(self.app.clone(), lossy))
            .with_state(self.app.clone())
    }

    /// Serves on `listener` until the test ends.
    fn serve(&self, listener: tokio::net::TcpListener) {
        let router = self.router();
        tokio::spawn(async move { axum::serve(listener, router).await });
    }

    async fn keys(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
            .fetch_one(&self.pool)
            .await
            .expect("count keys")
    }

    async fn payments(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM payments")
            .fetch_one(&self.pool)
            .await
            .expect("count payments")
    }
}

fn client(policy: RetryPolicy) -> Http {
    let http = Client::builder(TokioExecutor::new()).build_http();
    RetryLayer::new(policy).layer(http)
}

fn quick() -> RetryPolicy {
    RetryPolicy::new()
        .max_attempts(6)
        .base_delay(Duration::from_millis(20))
        .max_backoff(Duration::from_millis(200))
}

struct Answer {
    status: u16,
    body: Bytes,
    receipt: Receipt,
}

async fn post_to<S>(client: &mut S, addr: &str, path: &str, body: &str) -> Answer
where
    S: tower::Service<http::Request<Full<Bytes>>, Response = http::Response<Incoming>>,
    S::Error: std::fmt::Debug,
{
    let request = http::Request::post(format!("http://{addr}{path}"))
        .body(Full::new(Bytes::from(body.to_owned())))
        .expect("request");
    let response = client
        .ready()
        .await
        .expect("ready")
        .call(request)
        .await
        .expect("an answer within the attempts");
    let receipt = response
        .extensions()
        .get::<Receipt>()
        .cloned()
        .expect("a receipt");
    let status = response.status().as_u16();
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    Answer {
        status,
        body,
        receipt,
    }
}

async fn listen() -> (tokio::net::TcpListener, String) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    (listener, addr)
}

/// The server is not up yet: the first attempt is refused, and the server comes
/// up just before the second, whatever pause the jitter picked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_errors_are_retried_until_the_server_answers() {
    let server = Server::new().await;
    let (listener, addr) = listen().await;
    // Nothing accepts on `addr` until the listener is re-bound below.
    drop(listener);
    let router = server.router();
    let sent = Arc::new(AtomicU32::new(0));
    let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let inner = tower::service_fn({
        let (addr, sent) = (addr.clone(), sent.clone());
        move |request: http::Request<Full<Bytes>>| {
            let (http, router, addr, sent) =
                (http.clone(), router.clone(), addr.clone(), sent.clone());
            async move {
                if sent.fetch_add(1, Ordering::SeqCst) == 1 {
                    let listener = tokio::net::TcpListener::bind(&addr).await.expect("rebind");
                    tokio::spawn(async move { axum::serve(listener, router).await });
                }
                http.request(request).await
            }
        }
    });
    let mut retrying = RetryLayer::new(quick()).layer(inner);
    let answer = post_to(&mut retrying, &addr, "/pay", "a").await;
    assert_eq!(answer.status, 201);
    assert_eq!(answer.receipt.attempts(), 2, "{:?}", answer.receipt);
    assert_eq!(sent.load(Ordering::SeqCst), 2);
    assert!(!answer.receipt.replayed());
    assert_eq!(server.payments().await, 1);
}

/// 5xx: the attempt was rolled back and its key released; the retry, same key,
/// runs the handler again, and only that one commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_are_retried_with_the_same_key() {
    let server = Server::new().await;
    let (listener, addr) = listen().await;
    server.serve(listener);
    server.app.fail.store(2, Ordering::SeqCst);
    let mut http = client(quick());
    let answer = post_to(&mut http, &addr, "/pay", "b").await;
    assert_eq!(answer.status, 201);
    assert_eq!(answer.receipt.attempts(), 3);
    assert!(!answer.receipt.replayed());
    assert_eq!(
        server.payments().await,
        1,
        "the failed attempts left nothing"
    );
    assert_eq!(server.keys().await, 1, "one key across all attempts");
}

/// 408, 425 and 429 mean "not executed, try later": the server recorded none
/// (the write the handler made first was rolled back, the key released), and the
/// client sends again with the same key until it executes, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_executed_answers_are_retried_with_the_same_key() {
    let server = Server::new().await;
    let (listener, addr) = listen().await;
    server.serve(listener);
    // Popped from the end: 429 first.
    *server.app.refuse.lock().expect("refuse") = vec![408, 425, 429];
    let mut http = client(quick());
    let answer = post_to(&mut http, &addr, "/pay", "later").await;
    assert_eq!(answer.status, 201);
    assert_eq!(answer.receipt.attempts(), 4, "{:?}", answer.receipt);
    assert!(!answer.receipt.replayed());
    assert_eq!(
        server.payments().await,
        1,
        "the refused attempts left nothing"
    );
    assert_eq!(server.keys().await, 1, "one key across all attempts");
}

/// The payment committed but its response was lost: the retry gets the recorded
/// response as a replay, and the receipt says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_response_is_recovered_as_a_replay() {
    let server = Server::new().await;
    let (listener, addr) = listen().await;
    server.serve(listener);
    server.app.lose.store(1, Ordering::SeqCst);
    let mut http = client(quick());
    let answer = post_to(&mut http, &addr, "/pay", "c").await;
    assert_eq!(answer.status, 201);
    assert_eq!(answer.receipt.attempts(), 2);
    assert!(answer.receipt.replayed());
    assert_eq!(server.payments().await, 1);
    let id: i64 = sqlx::query_scalar("SELECT id FROM payments")
        .fetch_one(&server.pool)
        .await
        .expect("the payment");
    assert_eq!(answer.body, format!(r#"{{"id":{id}}}"#));
}

/// 409 while the first attempt runs: the client waits the `Retry-After` the server
/// derived from the holder's lock, then gets the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicts_are_retried_after_their_retry_after() {
    let server = Server::new().await;
    let (listener, addr) = listen().await;
    server.serve(listener);
    let key = "\"client-conflict\"";
    // Another client's attempt, holding the key for 800 ms.
    let first = {
        let addr = addr.clone();
        tokio::spawn(async move {
            let mut plain = client(RetryPolicy::new().max_attempts(1));
            let request = http::Request::post(format!("http://{addr}/slow"))
                .header("idempotency-key", key)
                .body(Full::new(Bytes::from_static(b"d")))
                .expect("request");
            plain.ready().await.expect("ready").call(request).await
        })
    };
    server.app.started.notified().await;
    let mut http = client(quick());
    let request = http::Request::post(format!("http://{addr}/slow"))
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(b"d")))
        .expect("request");
    let started = Instant::now();
    let response = http
        .ready()
        .await
        .expect("ready")
        .call(request)
        .await
        .expect("answer");
    let receipt = response
        .extensions()
        .get::<Receipt>()
        .cloned()
        .expect("receipt");
    assert_eq!(response.status(), 201);
    assert_eq!(receipt.key(), Some(key), "the caller's own key is kept");
    assert_eq!(receipt.attempts(), 2, "{receipt:?}");
    assert!(receipt.replayed());
    // The lock is 2 s, so Retry-After was 2: no retry came sooner.
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    let first = first.await.expect("first").expect("first answer");
    assert_eq!(first.status(), 201);
    assert_eq!(server.payments().await, 1);
}

/// 4xx other than 409 is final: a key reused with another body is sent once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_client_errors_are_never_retried() {
    let server = Server::new().await;
    let (listener, addr) = listen().await;
    server.serve(listener);
    let mut http = client(quick());
    let send = |body: &'static str| {
        http::Request::post(format!("http://{addr}/pay"))
            .header("idempotency-key", "reused")
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .expect("request")
    };
    let first = http
        .ready()
        .await
        .expect("ready")
        .call(send("e"))
        .await
        .expect("first");
    assert_eq!(first.status(), 201);
    let other = http
        .ready()
        .await
        .expect("ready")
        .call(send("f"))
        .await
        .expect("other");
    assert_eq!(other.status(), 422);
    let receipt = other
        .extensions()
        .get::<Receipt>()
        .cloned()
        .expect("receipt");
    assert_eq!(receipt.attempts(), 1);
    assert_eq!(server.payments().await, 1);
}

/// A new key per logical request: two payments with equal bodies are two payments.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_logical_request_gets_its_own_key() {
    let server = Server::new().await;
    let (listener, addr) = listen().await;
    server.serve(listener);
    let mut http = client(quick());
    let one = post_to(&mut http, &addr, "/pay", "same").await;
    let two = post_to(&mut http, &addr, "/pay", "same").await;
    assert_eq!((one.status, two.status), (201, 201));
    assert_ne!(one.receipt.key(), two.receipt.key());
    assert!(!two.receipt.replayed());
    assert_eq!(server.payments().await, 2);
}

/// The same policy as `reqwest-middleware` middleware (feature `reqwest`).
#[cfg(feature = "reqwest")]
mod reqwest_client {
    use super::*;
    use idem_axum::client::reqwest::RetryMiddleware;
    use idem_axum::client::reqwest::reqwest_middleware::{
        ClientBuilder, ClientWithMiddleware, reqwest,
    };

    fn client() -> ClientWithMiddleware {
        ClientBuilder::new(reqwest::Client::new())
            .with(RetryMiddleware::new(quick()))
            .build()
    }

    async fn post(client: &ClientWithMiddleware, addr: &str, path: &str, body: &str) -> Answer {
        let response = client
            .post(format!("http://{addr}{path}"))
            .body(body.to_owned())
            .send()
            .await
            .expect("an answer within the attempts");
        let receipt = response
            .extensions()
            .get::<Receipt>()
            .cloned()
            .expect("a receipt");
        let status = response.status().as_u16();
        let body = response.bytes().await.expect("body");
        Answer {
            status,
            body,
            receipt,
        }
    }

    /// 5xx twice, then the write: one key for all three attempts, one payment.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reqwest_retries_server_errors_with_the_same_key() {
        let server = Server::new().await;
        let (listener, addr) = listen().await;
        server.serve(listener);
        server.app.fail.store(2, Ordering::SeqCst);
        let answer = post(&client(), &addr, "/pay", "b").await;
        assert_eq!(answer.status, 201);
        assert_eq!(answer.receipt.attempts(), 3);
        assert!(answer.receipt.key().is_some_and(|k| k.len() == 34));
        assert_eq!(server.payments().await, 1);
        assert_eq!(server.keys().await, 1, "one key across all attempts");
    }

    /// A committed payment whose answer was lost comes back as a replay.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reqwest_recovers_a_lost_response_as_a_replay() {
        let server = Server::new().await;
        let (listener, addr) = listen().await;
        server.serve(listener);
        server.app.lose.store(1, Ordering::SeqCst);
        let answer = post(&client(), &addr, "/pay", "c").await;
        assert_eq!(answer.status, 201);
        assert_eq!(answer.receipt.attempts(), 2);
        assert!(answer.receipt.replayed());
        assert_eq!(server.payments().await, 1);
    }

    /// Nobody listens at first: connection errors are retried until a server
    /// accepts; a 4xx is final.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reqwest_retries_connection_errors_but_never_other_4xx() {
        let server = Server::new().await;
        let (listener, addr) = listen().await;
        drop(listener);
        let router = server.router();
        let late = {
            let addr = addr.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(150)).await;
                let listener = tokio::net::TcpListener::bind(&addr).await.expect("rebind");
                axum::serve(listener, router).await
            })
        };
        let policy = quick()
            .max_attempts(30)
            .max_backoff(Duration::from_millis(50));
        let patient = ClientBuilder::new(reqwest::Client::new())
            .with(RetryMiddleware::new(policy))
            .build();
        let answer = post(&patient, &addr, "/pay", "d").await;
        assert_eq!(answer.status, 201);
        assert!(answer.receipt.attempts() > 1, "{:?}", answer.receipt);
        assert_eq!(server.payments().await, 1);
        let missing = post(&client(), &addr, "/nowhere", "e").await;
        assert_eq!((missing.status, missing.receipt.attempts()), (404, 1));
        late.abort();
    }
}
