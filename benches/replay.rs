//! What a replay from memory costs the application, without the network: the same
//! request sent through the router in process (tower's `oneshot`) to an
//! `#[idempotent]` handler whose key is completed, and to `static`, a handler with
//! the same extractors that returns the same answer without idem.
//!
//! ```text
//! cargo bench --features sqlite --bench replay          # 7 rounds
//! cargo bench --features sqlite --bench replay -- 15    # 15 rounds
//! ```
//!
//! Each round sends 100,000 requests to each route, on one thread, in batches of
//! 1,000 that alternate between the routes (so that a slow spell of a shared
//! machine lands on both), and reports the median round: time per request and
//! replay ÷ static. The HTTP bench's `--ceiling` measures the same pair over
//! loopback with wrk; this one leaves the kernel and the load generator out, so
//! that what idem adds shows.

#![allow(missing_docs)]

use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idem_axum::{Idempotency, IdempotencyKey, Tx, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::Sqlite;
use sqlx::sqlite::SqlitePoolOptions;
use tower::ServiceExt as _;

const BODY: &str = r#"{"amount":100,"currency":"JPY"}"#;
const KEYS: usize = 1000;
const PER_ROUND: usize = 100_000;
/// Requests sent to one route before the other gets its turn.
const BATCH: usize = 1000;

#[derive(Deserialize)]
struct NewPayment {
    amount: i64,
    currency: String,
}

#[derive(Serialize)]
struct Payment {
    id: i64,
    amount: i64,
    currency: String,
}

#[idempotent(unscoped = true, required = true)]
async fn pay(
    key: IdempotencyKey,
    mut tx: Tx<Sqlite>,
    axum::Json(new): axum::Json<NewPayment>,
) -> Response {
    let inserted = sqlx::query_scalar(
        "INSERT INTO payments (note, amount, currency) VALUES (?, ?, ?) RETURNING id",
    )
    .bind(key.as_str())
    .bind(new.amount)
    .bind(&new.currency)
    .fetch_one(&mut *tx)
    .await;
    match inserted {
        Ok(id) => {
            let payment = Payment {
                id,
                amount: new.amount,
                currency: new.currency,
            };
            (StatusCode::CREATED, axum::Json(payment)).into_response()
        }
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

/// The answer a replay gives, from the same extractors without idem.
async fn fixed(key: IdempotencyKey, axum::Json(new): axum::Json<NewPayment>) -> Response {
    let _ = key;
    let payment = Payment {
        id: 1,
        amount: new.amount,
        currency: new.currency,
    };
    (
        StatusCode::CREATED,
        [("idempotent-replayed", "true")],
        axum::Json(payment),
    )
        .into_response()
}

fn request(path: &str, key: usize) -> Request<Body> {
    Request::post(path)
        .header("content-type", "application/json")
        .header("idempotency-key", format!("replay-{key}"))
        .body(Body::from(BODY))
        .expect("a request")
}

/// Sends `count` requests to `path`, over the keys from `first` on; the time they
/// took. Every answer must be a 201 with a body.
async fn batch(app: &Router, path: &str, first: usize, count: usize) -> Duration {
    let started = Instant::now();
    for n in first..first + count {
        let response = app
            .clone()
            .oneshot(request(path, n % KEYS))
            .await
            .expect("infallible");
        assert_eq!(response.status(), StatusCode::CREATED, "{path}");
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .expect("a body");
        assert!(!body.is_empty());
    }
    started.elapsed()
}

/// One round: `PER_ROUND` requests to each route in alternating batches, the
/// replays' first when `replay_first`; the time a request took on average,
/// replay then static.
async fn round(app: &Router, replay_first: bool) -> (Duration, Duration) {
    let (mut replay, mut fixed) = (Duration::ZERO, Duration::ZERO);
    for first in (0..PER_ROUND).step_by(BATCH) {
        if replay_first {
            replay += batch(app, "/payments", first, BATCH).await;
            fixed += batch(app, "/static", first, BATCH).await;
        } else {
            fixed += batch(app, "/static", first, BATCH).await;
            replay += batch(app, "/payments", first, BATCH).await;
        }
    }
    (replay / PER_ROUND as u32, fixed / PER_ROUND as u32)
}

fn main() {
    let rounds: usize = std::env::args()
        .skip(1)
        .find_map(|arg| arg.parse().ok())
        .unwrap_or(7);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect("sqlite::memory:")
            .await
            .expect("sqlite");
        sqlx::raw_sql(
            "CREATE TABLE payments (id INTEGER PRIMARY KEY, note TEXT, amount INTEGER, currency TEXT)",
        )
        .execute(&pool)
        .await
        .expect("payments");
        let store = Idempotency::new(pool);
        store.migrate().await.expect("migrate");
        let app = Router::new()
            .route("/payments", post(pay))
            .route("/static", post(fixed))
            .with_state(store);
        // Every key completed once: from here on the route replays from memory.
        for key in 0..KEYS {
            let response = app
                .clone()
                .oneshot(request("/payments", key))
                .await
                .expect("infallible");
            assert_eq!(response.status(), StatusCode::CREATED);
        }
        let mut replays = Vec::new();
        let mut fixed = Vec::new();
        for n in 0..rounds {
            let (replay, static_) = round(&app, n % 2 == 0).await;
            replays.push(replay);
            fixed.push(static_);
        }
        let mut ratios: Vec<f64> = replays
            .iter()
            .zip(&fixed)
            .map(|(replay, fixed)| fixed.as_secs_f64() / replay.as_secs_f64())
            .collect();
        ratios.sort_by(f64::total_cmp);
        replays.sort();
        fixed.sort();
        let median = |v: &[Duration]| v[v.len() / 2];
        println!(
            "{rounds} rounds of {PER_ROUND} requests each, in process, one thread (medians):\n\
             static {:.2} µs, replay {:.2} µs a request; replay ÷ static throughput {:.2} ({:.2}–{:.2})",
            median(&fixed).as_secs_f64() * 1e6,
            median(&replays).as_secs_f64() * 1e6,
            ratios[ratios.len() / 2],
            ratios[0],
            ratios[ratios.len() - 1],
        );
    });
}
