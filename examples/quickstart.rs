//! The smallest exactly-once endpoint: `POST /orders` stores one order however often
//! the client retries it. Copy it into a project of your own to start.
//!
//! ```text
//! cargo run --example quickstart --features sqlite
//! curl -i -X POST localhost:3000/orders -H 'X-User: alice' -H 'Idempotency-Key: order-1' \
//!   -H 'Content-Type: application/json' -d '{"item": "book", "quantity": 2}'
//! # the same again: the same 201, with Idempotent-Replayed: true; one order stored
//! curl -s localhost:3000/orders -H 'X-User: alice'
//! ```
//!
//! In your project: `idem-axum = { version = "0.1", features = ["sqlite"] }` (or
//! `postgres`, `mysql`), beside axum, sqlx, serde and tokio.

use axum::extract::{FromRef, FromRequestParts, State};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::routing::post;
use axum::{Json, Router};
use idem_axum::{Idempotency, Scope, Tx, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::{Sqlite, SqlitePool};

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Idempotency<Sqlite>,
    pool: SqlitePool,
}

/// The caller. Here the `X-User` header; in your app, your authentication.
struct User(String);

impl<S: Send + Sync> FromRequestParts<S> for User {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        let user = parts.headers.get("x-user").and_then(|v| v.to_str().ok());
        user.map(|u| User(u.to_owned()))
            .ok_or(StatusCode::UNAUTHORIZED)
    }
}

/// Keys are kept per user: another user's `order-1` is another request.
impl Scope for User {
    fn scope(&self) -> std::borrow::Cow<'_, str> {
        self.0.as_str().into()
    }
}

#[derive(Deserialize)]
struct NewOrder {
    item: String,
    quantity: i64,
}

#[derive(Serialize)]
struct Order {
    id: i64,
    item: String,
    quantity: i64,
}

/// Runs once per (user, key): the order and the recorded 201 commit together, and a
/// retry gets that 201 back without running this again.
#[idempotent(scope = "user", ttl = "24h", lock = "30s", required = true)]
async fn create_order(
    user: User,
    mut tx: Tx<Sqlite>,
    Json(new): Json<NewOrder>,
) -> Result<(StatusCode, Json<Order>), StatusCode> {
    let id = sqlx::query_scalar(
        "INSERT INTO orders (owner, item, quantity) VALUES (?1, ?2, ?3) RETURNING id",
    )
    .bind(&user.0)
    .bind(&new.item)
    .bind(new.quantity)
    .fetch_one(&mut *tx)
    .await
    .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
    let (item, quantity) = (new.item, new.quantity);
    Ok((StatusCode::CREATED, Json(Order { id, item, quantity })))
}

async fn list_orders(
    State(pool): State<SqlitePool>,
    user: User,
) -> Result<Json<Vec<Order>>, StatusCode> {
    let rows: Vec<(i64, String, i64)> =
        sqlx::query_as("SELECT id, item, quantity FROM orders WHERE owner = ?1 ORDER BY id")
            .bind(&user.0)
            .fetch_all(&pool)
            .await
            .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
    let order = |(id, item, quantity)| Order { id, item, quantity };
    Ok(Json(rows.into_iter().map(order).collect()))
}

/// The app on `pool`: its tables, created if missing, and its routes; and its
/// store, which tests may steer (`idem_axum::testing::ExactlyOnce`).
async fn app(pool: SqlitePool) -> Result<(Router, Idempotency<Sqlite>), sqlx::Error> {
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, owner TEXT NOT NULL, \
         item TEXT NOT NULL, quantity INTEGER NOT NULL)",
    )
    .execute(&pool)
    .await?;
    let idempotency = Idempotency::new(pool.clone());
    idempotency.migrate().await?; // the key table, created once
    let router = Router::new()
        .route("/orders", post(create_order).get(list_orders))
        .with_state(AppState {
            idempotency: idempotency.clone(),
            pool,
        });
    Ok((router, idempotency))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pool = SqlitePool::connect("sqlite://quickstart.db?mode=rwc").await?;
    let (app, _) = app(pool).await?;
    let bind = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(bind).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}

/// A handler is tested through its router, as a client reaches it: `oneshot`
/// sends one request, here to the app on an in-memory SQLite database
/// (`cargo test --example quickstart --features sqlite`).
#[cfg(test)]
mod tests {
    use axum::body::{Body, Bytes};
    use axum::http::{Request, Response};
    use http_body_util::BodyExt as _;
    use sqlx::sqlite::SqlitePoolOptions;
    use tower::ServiceExt as _;

    use super::*;

    /// One connection: an in-memory database lives as long as its connection.
    async fn test_app() -> (Router, SqlitePool) {
        let (router, _, pool) = test_app_and_store().await;
        (router, pool)
    }

    async fn test_app_and_store() -> (Router, Idempotency<Sqlite>, SqlitePool) {
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect("sqlite::memory:")
            .await
            .expect("in-memory database");
        let (router, store) = app(pool.clone()).await.expect("app");
        (router, store, pool)
    }

    async fn order(app: &Router, key: Option<&str>, body: &str) -> (Response<Body>, Bytes) {
        let mut request = Request::post("/orders")
            .header("x-user", "alice")
            .header("content-type", "application/json");
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        let request = request.body(Body::from(body.to_owned())).expect("request");
        let response = app.clone().oneshot(request).await.expect("infallible");
        let (parts, body) = response.into_parts();
        let bytes = body.collect().await.expect("body").to_bytes();
        (Response::from_parts(parts, Body::empty()), bytes)
    }

    async fn orders(pool: &SqlitePool) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM orders")
            .fetch_one(pool)
            .await
            .expect("count")
    }

    const BOOK: &str = r#"{"item": "book", "quantity": 2}"#;

    #[tokio::test]
    async fn a_retry_gets_the_first_answer_and_orders_once() {
        let (app, pool) = test_app().await;
        let (first, first_body) = order(&app, Some("order-1"), BOOK).await;
        let (retry, retry_body) = order(&app, Some("order-1"), BOOK).await;
        assert_eq!(first.status(), StatusCode::CREATED);
        assert_eq!(retry.status(), StatusCode::CREATED);
        assert_eq!(retry.headers()["idempotent-replayed"], "true");
        assert_eq!(retry_body, first_body);
        assert_eq!(orders(&pool).await, 1);
    }

    #[tokio::test]
    async fn a_key_reused_for_another_order_is_refused() {
        let (app, pool) = test_app().await;
        order(&app, Some("order-1"), BOOK).await;
        let other = r#"{"item": "pen", "quantity": 1}"#;
        let (reused, _) = order(&app, Some("order-1"), other).await;
        assert_eq!(reused.status(), StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(orders(&pool).await, 1);
    }

    /// The testing kit (feature `testing`): duplicates sent while the first order is
    /// held in flight, a record that fails on purpose (the order must go with it), a
    /// retry and another body under a used key, counting the orders stored.
    #[tokio::test]
    async fn create_order_runs_exactly_once() {
        let (app, store, pool) = test_app_and_store().await;
        let request = || {
            Request::post("/orders")
                .header("x-user", "alice")
                .header("content-type", "application/json")
                .body(Body::from(BOOK))
                .expect("request")
        };
        let count = move || {
            let pool = pool.clone();
            async move { orders(&pool).await }
        };
        let report = idem_axum::testing::ExactlyOnce::new(app, &store, request, count)
            .check()
            .await
            .expect("create_order runs exactly once");
        assert_eq!(report.overlapped, 7, "every duplicate overlapped the first");
    }

    #[tokio::test]
    async fn an_order_without_a_key_is_refused() {
        let (app, pool) = test_app().await;
        let (refused, _) = order(&app, None, BOOK).await;
        assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
        assert_eq!(orders(&pool).await, 0);
    }
}
