//! The application under test: one business write per execution, steered by headers
//! that are not part of the request's identity.

use std::collections::HashSet;
use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Body;
use axum::extract::{FromRef, State};
use axum::http::{HeaderMap, Method, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, post};
use bytes::Bytes;
use http_body_util::BodyExt as _;
use idem_axum::axum::IdempotentRequest;
use idem_axum::{Idempotency, Options, Outcome};
use tower::ServiceExt as _;

use crate::harness::Harness;

/// Keys whose handler has started, i.e. whose claim is held: tests that drop a
/// caller wait for this so the drop lands mid-execution.
static STARTED: Mutex<Option<HashSet<String>>> = Mutex::new(None);

pub fn started(key: &str) -> bool {
    STARTED
        .lock()
        .map(|set| set.as_ref().is_some_and(|set| set.contains(key)))
        .unwrap_or(false)
}

/// Gates a handler waits at (header `x-gate`) until the test opens them.
static OPEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);

pub fn open_gate(gate: &str) {
    if let Ok(mut set) = OPEN.lock() {
        set.get_or_insert_with(HashSet::new).insert(gate.to_owned());
    }
}

/// Returns once `gate` is open.
pub async fn wait_for_gate(gate: &str) {
    while !gate_is_open(gate) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn gate_is_open(gate: &str) -> bool {
    OPEN.lock()
        .map(|set| set.as_ref().is_some_and(|set| set.contains(gate)))
        .unwrap_or(true)
}

pub fn mark_started(key: String) {
    if let Ok(mut set) = STARTED.lock() {
        set.get_or_insert_with(HashSet::new).insert(key);
    }
}

pub struct App<H: Harness> {
    store: Idempotency<H::DB>,
}

impl<H: Harness> Clone for App<H> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
        }
    }
}

impl<H: Harness> FromRef<App<H>> for Idempotency<H::DB> {
    fn from_ref(app: &App<H>) -> Self {
        app.store.clone()
    }
}

pub fn router<H: Harness>(harness: &H) -> Router {
    router_on::<H>(harness.store().clone())
}

/// The same app on a store of its own: another instance, sharing the database.
pub fn router_on<H: Harness>(store: Idempotency<H::DB>) -> Router {
    Router::new()
        .route("/effects", post(effect::<H>).put(effect::<H>))
        .route("/other", post(effect::<H>))
        .route("/any", any(effect::<H>))
        .route(
            "/small",
            post(effect::<H>).layer(axum::extract::DefaultBodyLimit::max(1024)),
        )
        .with_state(App::<H> { store })
}

fn number(headers: &HeaderMap, name: &str) -> u64 {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

async fn effect<H: Harness>(
    State(_): State<App<H>>,
    request: IdempotentRequest<H::DB>,
) -> Response {
    let headers = request.parts().headers.clone();
    let scope = headers
        .get("x-scope")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("anonymous")
        .to_owned();
    let mut options = Options::new().required(headers.contains_key("x-required"));
    if let n @ 1.. = number(&headers, "x-lock-ms") {
        options = options.lock(Duration::from_millis(n));
    }
    if let n @ 1.. = number(&headers, "x-ttl-ms") {
        options = options.ttl(Duration::from_millis(n));
    }
    if let n @ 1.. = number(&headers, "x-wait-ms") {
        options = options.wait(Duration::from_millis(n));
    }
    options = options.ttl_header(headers.contains_key("x-ttl-header"));
    if headers.contains_key("x-json-fingerprint") {
        options = options.json_fingerprint(&[]);
    }
    // A pointer without its leading `/`: options `check` refuses.
    if headers.contains_key("x-bad-pointer") {
        options = options.json_fingerprint(&["/sent_at", "sent_at"]);
    }
    // `x-release-on: 409,429` (empty: none) replaces the statuses left unrecorded.
    if let Some(list) = headers.get("x-release-on").and_then(|v| v.to_str().ok()) {
        let statuses: Vec<u16> = list
            .split(',')
            .filter_map(|s| s.trim().parse().ok())
            .collect();
        options = options.release_on(&statuses);
    }
    let sleep = Duration::from_millis(number(&headers, "x-sleep-ms"));
    let block = Duration::from_millis(number(&headers, "x-block-ms"));
    let big = usize::try_from(number(&headers, "x-big")).unwrap_or(0);
    let big_headers = usize::try_from(number(&headers, "x-big-headers")).unwrap_or(0);
    let status = StatusCode::from_u16(u16::try_from(number(&headers, "x-status")).unwrap_or(0))
        .unwrap_or(StatusCode::CREATED);
    let panics = headers.contains_key("x-panic");
    let note = String::from_utf8_lossy(request.body()).into_owned();
    let key = request.key().map(|k| k.as_str().to_owned());
    let gate = headers
        .get("x-gate")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let escape = headers
        .get("x-escape")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    // A handler that waits (on `x-gate`) before it writes, reads first, or writes
    // nothing at all.
    let wait_first = headers.contains_key("x-wait-before-write");
    let read_first = headers.contains_key("x-read-first");
    let no_write = headers.contains_key("x-no-write");

    request
        .run(&scope.clone(), options, move |mut tx| {
            Box::pin(async move {
                if read_first {
                    let read = H::exec(&mut *tx, "SELECT count(*) FROM effects", &[]).await;
                    if let Err(error) = read {
                        return (StatusCode::INTERNAL_SERVER_ERROR, error.to_string())
                            .into_response();
                    }
                }
                if wait_first {
                    if let Some(key) = key.clone() {
                        mark_started(key);
                    }
                    if let Some(gate) = &gate {
                        wait_for_gate(gate).await;
                    }
                }
                if no_write {
                    return (status, "wrote nothing").into_response();
                }
                let id = match H::insert_effect(&mut tx, &scope, &note).await {
                    Ok(id) => id,
                    Err(error) => {
                        return (StatusCode::INTERNAL_SERVER_ERROR, error.to_string())
                            .into_response();
                    }
                };
                if let Some(key) = key {
                    mark_started(key);
                }
                if let Some(escape) = escape {
                    // A bug the engine must catch: the transaction is moved into a
                    // task that writes through it after the handler has answered.
                    tokio::spawn(async move {
                        let mut tx = tx;
                        wait_for_gate(&escape).await;
                        let _ = H::insert_effect(&mut tx, &scope, "after the handler").await;
                    });
                    return (StatusCode::CREATED, "answered early").into_response();
                }
                if let Some(gate) = gate {
                    while !gate_is_open(&gate) {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
                if !sleep.is_zero() {
                    tokio::time::sleep(sleep).await;
                }
                if !block.is_zero() {
                    // A stall no timer can interrupt: the executor wakes after its lock.
                    // (block_in_place hands this worker's other tasks to the rest, so
                    // the stall holds up this executor only.)
                    tokio::task::block_in_place(|| std::thread::sleep(block));
                }
                assert!(!panics, "handler asked to panic");
                let nonce = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos());
                let body = if big > 0 {
                    "x".repeat(big)
                } else {
                    // Keys out of order: a JSON column would reorder them.
                    format!(r#"{{"z":1,"id":{id},"nonce":"{nonce}","a":2}}"#)
                };
                let mut response = Response::builder();
                // Response headers of `big_headers` bytes in all, 8 KiB a header.
                for (n, chunk) in (0..big_headers).step_by(8192).enumerate() {
                    let len = (big_headers - chunk).min(8192);
                    response = response.header(format!("x-big-{n}"), "h".repeat(len));
                }
                response
                    .status(status)
                    .header("content-type", "application/json")
                    .header("x-custom", "kept")
                    .header("cache-control", "private, max-age=60")
                    .header("set-cookie", "session=abc; HttpOnly")
                    .header("location", format!("/effects/{id}"))
                    .body(Body::from(body))
                    .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
            })
        })
        .await
}

/// One request as a test client sends it.
#[derive(Clone, Debug)]
pub struct Req {
    pub method: Method,
    pub path: String,
    pub scope: String,
    pub keys: Vec<String>,
    pub body: String,
    pub extra: Vec<(String, String)>,
}

impl Req {
    pub fn post(scope: &str, key: &str, body: &str) -> Self {
        Self {
            method: Method::POST,
            path: "/effects".to_owned(),
            scope: scope.to_owned(),
            keys: vec![key.to_owned()],
            body: body.to_owned(),
            extra: Vec::new(),
        }
    }

    pub fn header(mut self, name: &str, value: impl ToString) -> Self {
        self.extra.push((name.to_owned(), value.to_string()));
        self
    }

    pub fn method(mut self, method: Method) -> Self {
        self.method = method;
        self
    }

    pub fn path(mut self, path: &str) -> Self {
        self.path = path.to_owned();
        self
    }

    pub fn keys(mut self, keys: &[&str]) -> Self {
        self.keys = keys.iter().map(|k| (*k).to_owned()).collect();
        self
    }

    pub fn body(mut self, body: &str) -> Self {
        self.body = body.to_owned();
        self
    }

    pub fn build(&self) -> Request<Body> {
        let mut builder = Request::builder()
            .method(self.method.clone())
            .uri(&self.path)
            .header("x-scope", &self.scope);
        for key in &self.keys {
            builder = builder.header("idempotency-key", key);
        }
        for (name, value) in &self.extra {
            builder = builder.header(name, value);
        }
        builder
            .body(Body::from(self.body.clone()))
            .expect("valid request")
    }

    /// The raw HTTP/1.1 bytes, for tests that talk TCP.
    pub fn wire(&self) -> Vec<u8> {
        let mut out = format!(
            "{} {} HTTP/1.1\r\nhost: localhost\r\nx-scope: {}\r\ncontent-length: {}\r\n",
            self.method,
            self.path,
            self.scope,
            self.body.len()
        );
        for key in &self.keys {
            out.push_str(&format!("idempotency-key: {key}\r\n"));
        }
        for (name, value) in &self.extra {
            out.push_str(&format!("{name}: {value}\r\n"));
        }
        out.push_str("\r\n");
        out.push_str(&self.body);
        out.into_bytes()
    }
}

/// A response as the client saw it.
#[derive(Clone, Debug)]
pub struct Got {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub outcome: Option<Outcome>,
}

impl Got {
    /// Reads a whole response. Every problem idem answers, in every test, is one
    /// no cache in between may keep.
    pub async fn read(response: Response) -> Self {
        let outcome = response.extensions().get::<Outcome>().copied();
        let (parts, body) = response.into_parts();
        if parts
            .headers
            .get("content-type")
            .is_some_and(|v| v == "application/problem+json")
        {
            assert_eq!(
                parts
                    .headers
                    .get("cache-control")
                    .and_then(|v| v.to_str().ok()),
                Some("no-store"),
                "{} problem without Cache-Control: no-store",
                parts.status
            );
        }
        Self {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body: body.collect().await.expect("body").to_bytes(),
            outcome,
        }
    }

    /// Whether the answer is a replay of a recorded one.
    pub fn replayed(&self) -> bool {
        self.headers.contains_key("idempotent-replayed")
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The problem `type` slug of a problem+json answer.
    pub fn problem(&self) -> Option<String> {
        if self.header("content-type") != Some("application/problem+json") {
            return None;
        }
        let text = self.text();
        let start =
            text.find(r#""type":"urn:idem:problem:"#)? + r#""type":"urn:idem:problem:"#.len();
        let end = text[start..].find('"')? + start;
        Some(text[start..end].to_owned())
    }
}

/// Sends `req` once; on a run whose database defaults to SERIALIZABLE, again after
/// a serialization failure (see [`retrying_serialization`]).
pub async fn send(app: &Router, req: &Req) -> Got {
    retrying_serialization(|| send_once(app, req)).await
}

/// Runs `once` until its answer is not a serialization failure (the handler's 500
/// or idem's 503, nothing committed) on a run whose database defaults to
/// SERIALIZABLE, as a client of such a database must; elsewhere, once. A 409 right
/// after such a failure is tried again too, as a client would: each retry is
/// printed, so that a failing test shows what came before its answer.
pub async fn retrying_serialization<F: Future<Output = Got>>(mut once: impl FnMut() -> F) -> Got {
    let mut tries = 0;
    let mut failed = false;
    loop {
        let got = once().await;
        tries += 1;
        if tries > 1 {
            eprintln!("retry {tries}: {} {}", got.status, got.text());
        }
        let serialization = is_serialization_failure(got.status, &got.body);
        let again = serialization || (failed && got.status == 409);
        if !(serializable_run() && again) || tries > 50 {
            return got;
        }
        failed |= serialization;
        tokio::time::sleep(Duration::from_millis(5 * tries)).await;
    }
}

/// Whether this run's PostgreSQL defaults to SERIALIZABLE (a CI configuration).
pub fn serializable_run() -> bool {
    std::env::var("IDEM_TEST_POSTGRES_ISOLATION").is_ok_and(|level| level == "serializable")
}

/// A 5xx that says the database refused to serialize the transaction.
pub fn is_serialization_failure(status: u16, body: &[u8]) -> bool {
    let text = String::from_utf8_lossy(body);
    status >= 500
        && (text.contains("could not serialize") || text.contains("serialization failure"))
}

/// Sends `req` once, whatever the answer.
pub async fn send_once(app: &Router, req: &Req) -> Got {
    let response = app
        .clone()
        .oneshot(req.build())
        .await
        .expect("router is infallible");
    Got::read(response).await
}
