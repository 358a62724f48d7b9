//! `demo`: the API behind a flaky proxy, and a storm of retries through the client.

use std::error::Error;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::{BodyExt as _, Empty, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idem_axum::Outcome;
use idem_axum::client::{Receipt, RetryLayer, RetryPolicy};
use serde_json::Value;
use tower::{Layer as _, Service as _, ServiceExt as _};

/// Logical payments, the users making them, and how many times each is sent at once.
const PAYMENTS: u64 = 40;
const USERS: u64 = 8;
const SENDERS: u64 = 5;
/// The proxy refuses every `REFUSE_EVERY`-th request and loses the response of
/// every `LOSE_EVERY`-th execution.
const REFUSE_EVERY: u64 = 7;
const LOSE_EVERY: u64 = 3;

/// The SQLite files of a demo run without `DATABASE_URL`, removed when it ends.
pub(crate) struct Scratch(PathBuf);

impl Scratch {
    pub(crate) fn new() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let name = format!("payments-demo-{}-{nanos}.db", std::process::id());
        Self(std::env::temp_dir().join(name))
    }

    pub(crate) fn url(&self) -> String {
        format!("sqlite://{}", self.0.display())
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for suffix in [
            "",
            "-wal",
            "-shm",
            "-provider",
            "-provider-wal",
            "-provider-shm",
        ] {
            let mut file = self.0.clone().into_os_string();
            file.push(suffix);
            let _ = std::fs::remove_file(file);
        }
    }
}

/// What the proxy saw of `POST /payments`.
#[derive(Default)]
struct Tally {
    requests: AtomicU64,
    refused: AtomicU64,
    executed: AtomicU64,
    lost: AtomicU64,
    replayed: AtomicU64,
    in_flight: AtomicU64,
}

/// A flaky proxy in front of the API, counting what idem did with each request.
async fn proxy(State(tally): State<Arc<Tally>>, request: Request, next: Next) -> Response {
    if request.method() != Method::POST {
        return next.run(request).await;
    }
    let n = tally.requests.fetch_add(1, Ordering::Relaxed) + 1;
    if n % REFUSE_EVERY == 0 {
        tally.refused.fetch_add(1, Ordering::Relaxed);
        return (StatusCode::SERVICE_UNAVAILABLE, "proxy: try again").into_response();
    }
    let response = next.run(request).await;
    match response.extensions().get::<Outcome>() {
        Some(Outcome::Executed | Outcome::TakenOver) => {
            let executed = tally.executed.fetch_add(1, Ordering::Relaxed) + 1;
            if executed % LOSE_EVERY == 0 {
                // Committed, but the client never hears of it.
                tally.lost.fetch_add(1, Ordering::Relaxed);
                return (StatusCode::BAD_GATEWAY, "proxy: upstream reset").into_response();
            }
        }
        Some(Outcome::Replayed) => {
            tally.replayed.fetch_add(1, Ordering::Relaxed);
        }
        Some(Outcome::InFlight) => {
            tally.in_flight.fetch_add(1, Ordering::Relaxed);
        }
        _ => {}
    }
    response
}

pub(crate) async fn run(
    listener: tokio::net::TcpListener,
    app: Router,
) -> Result<(), Box<dyn Error>> {
    let addr = listener.local_addr()?;
    let tally = Arc::new(Tally::default());
    let app = app.layer(middleware::from_fn_with_state(Arc::clone(&tally), proxy));
    tokio::spawn(async move { axum::serve(listener, app).await });

    let policy = RetryPolicy::new()
        .max_attempts(10)
        .base_delay(std::time::Duration::from_millis(20))
        .max_backoff(std::time::Duration::from_millis(500));
    let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let client = RetryLayer::new(policy).layer(http);
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let user = |payment: u64| format!("demo-{run}-{}", payment % USERS);

    let mut senders = tokio::task::JoinSet::new();
    for payment in 0..PAYMENTS {
        // One key per logical payment, shared by its concurrent sends.
        let key = format!("\"demo-{run}-{payment}\"");
        let body = format!(
            r#"{{"amount": {}, "currency": "JPY", "to": "shop"}}"#,
            100 + payment
        );
        for _ in 0..SENDERS {
            let request = http::Request::post(format!("http://{addr}/payments"))
                .header("authorization", format!("Bearer {}", user(payment)))
                .header("idempotency-key", &key)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body.clone())))?;
            let mut client = client.clone();
            senders.spawn(async move {
                let response = client.ready().await?.call(request).await?;
                let receipt = response.extensions().get::<Receipt>().cloned();
                let status = response.status();
                let body = response.into_body().collect().await?.to_bytes();
                Ok::<_, Box<dyn Error + Send + Sync>>((payment, status, body, receipt))
            });
        }
    }
    let mut attempts = 0u64;
    let mut answers: Vec<Option<Bytes>> = vec![None; usize::try_from(PAYMENTS)?];
    let mut failures = Vec::new();
    while let Some(sent) = senders.join_next().await {
        let (payment, status, body, receipt) = sent?.map_err(|e| e.to_string())?;
        attempts += u64::from(receipt.map_or(1, |r| r.attempts()));
        let first = &mut answers[usize::try_from(payment)?];
        match first {
            _ if status != StatusCode::CREATED => failures.push(format!(
                "payment {payment}: {status} {}",
                String::from_utf8_lossy(&body)
            )),
            Some(first) if *first != body => {
                failures.push(format!("payment {payment}: two different answers"));
            }
            Some(_) => {}
            None => *first = Some(body),
        }
    }

    let mut get = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let mut fetch = async |path: String, user: Option<String>| -> Result<Value, Box<dyn Error>> {
        let mut request = http::Request::get(format!("http://{addr}{path}"));
        if let Some(user) = user {
            request = request.header("authorization", format!("Bearer {user}"));
        }
        let response = get.call(request.body(Empty::new())?).await?;
        let body = response.into_body().collect().await?.to_bytes();
        Ok(serde_json::from_slice(&body)?)
    };
    let charges = fetch("/provider/charges".into(), None).await?;
    let charges = charges["charges"].as_array().map_or(0, |all| {
        all.iter()
            .filter(|c| {
                c["user"]
                    .as_str()
                    .is_some_and(|u| u.starts_with(&format!("demo-{run}-")))
            })
            .count()
    });
    let mut recorded = 0;
    for n in 0..USERS {
        let ledger = fetch("/payments".into(), Some(user(n))).await?;
        recorded += ledger["payments"].as_array().map_or(0, Vec::len);
    }

    let count = |n: &AtomicU64| n.load(Ordering::Relaxed);
    println!(
        "{PAYMENTS} payments by {USERS} users, each sent {SENDERS} times at once with one key,"
    );
    println!(
        "through a proxy that refuses 1 request in {REFUSE_EVERY} (503) and loses 1 executed response in {LOSE_EVERY} (502)\n"
    );
    let rows = [
        ("requests sent, every attempt counted", attempts),
        ("refused by the proxy (503)", count(&tally.refused)),
        ("executions (handler ran)", count(&tally.executed)),
        ("responses lost after commit (502)", count(&tally.lost)),
        ("replays of a recorded response", count(&tally.replayed)),
        ("in flight at the wait bound (409)", count(&tally.in_flight)),
        ("payments recorded", u64::try_from(recorded)?),
        ("provider charges", u64::try_from(charges)?),
    ];
    for (what, n) in rows {
        println!("  {what:<36} {n:>5}");
    }
    let expected = usize::try_from(PAYMENTS)?;
    if failures.is_empty() && recorded == expected && charges == expected {
        println!(
            "\nexactly once: {PAYMENTS} payments, {PAYMENTS} charges; all {} senders got their payment's 201",
            PAYMENTS * SENDERS
        );
        Ok(())
    } else {
        for failure in &failures {
            println!("  {failure}");
        }
        Err(format!(
            "expected {expected} payments and charges, got {recorded} and {charges}, {} failed senders",
            failures.len()
        )
        .into())
    }
}
