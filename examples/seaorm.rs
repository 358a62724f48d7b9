//! The quick start written with SeaORM: `POST /orders` stores one order however
//! often the client retries it, through a SeaORM entity on idem's transaction.
//!
//! ```text
//! cargo run --example seaorm --features sqlite,sea-orm
//! curl -i -X POST localhost:3000/orders -H 'X-User: alice' -H 'Idempotency-Key: order-1' \
//!   -H 'Content-Type: application/json' -d '{"item": "book", "quantity": 2}'
//! # the same again: the same 201, with Idempotent-Replayed: true; one order stored
//! curl -s localhost:3000/orders -H 'X-User: alice'
//! ```
//!
//! In your project: `idem-axum = { version = "0.1", features = ["sqlite", "sea-orm"] }`
//! (or `postgres`, `mysql`) beside `sea-orm = "2"` with its driver for the same
//! database, axum, sqlx, serde and tokio. The handler's writes go through
//! `tx.sea_orm()`, never through a `DatabaseConnection` of the pool: those would
//! commit on their own, before idem records the answer, and run again on a retry.

use axum::extract::{FromRef, FromRequestParts, State};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::routing::post;
use axum::{Json, Router};
use idem_axum::{Idempotency, Scope, Tx, idempotent};
use sea_orm::entity::prelude::*;
use sea_orm::{ActiveValue::Set, DatabaseConnection, QueryOrder};
use serde::Deserialize;
use sqlx::{Sqlite, SqlitePool};

/// The `orders` table as a SeaORM entity, its items public as SeaORM's derives
/// expect them.
#[allow(unreachable_pub)]
mod order {
    use sea_orm::entity::prelude::*;
    use serde::Serialize;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize)]
    #[sea_orm(table_name = "orders")]
    pub struct Model {
        #[sea_orm(primary_key)]
        pub id: i64,
        #[serde(skip)]
        pub owner: String,
        pub item: String,
        pub quantity: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Idempotency<Sqlite>,
    /// SeaORM on the same pool, for reads outside keyed handlers.
    db: DatabaseConnection,
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

/// Runs once per (user, key): the order SeaORM inserts and the recorded 201 commit
/// together, and a retry gets that 201 back without running this again.
#[idempotent(scope = "user", ttl = "24h", lock = "30s", required = true)]
async fn create_order(
    user: User,
    mut tx: Tx<Sqlite>,
    Json(new): Json<NewOrder>,
) -> Result<(StatusCode, Json<order::Model>), StatusCode> {
    let db = tx.sea_orm();
    let order = order::ActiveModel {
        owner: Set(user.0),
        item: Set(new.item),
        quantity: Set(new.quantity),
        ..Default::default()
    }
    .insert(&db)
    .await
    .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
    Ok((StatusCode::CREATED, Json(order)))
}

async fn list_orders(
    State(db): State<DatabaseConnection>,
    user: User,
) -> Result<Json<Vec<order::Model>>, StatusCode> {
    let orders = order::Entity::find()
        .filter(order::Column::Owner.eq(user.0))
        .order_by_asc(order::Column::Id)
        .all(&db)
        .await
        .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
    Ok(Json(orders))
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
            db: DatabaseConnection::from(pool),
        });
    Ok((router, idempotency))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pool = SqlitePool::connect("sqlite://seaorm.db?mode=rwc").await?;
    let (app, _) = app(pool).await?;
    let bind = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(bind).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}

/// Tested through the router, as the quick start is
/// (`cargo test --example seaorm --features sqlite,sea-orm`).
#[cfg(test)]
mod tests {
    use axum::body::{Body, Bytes};
    use axum::http::{Request, Response};
    use http_body_util::BodyExt as _;
    use sqlx::sqlite::SqlitePoolOptions;
    use tower::ServiceExt as _;

    use super::*;

    /// One connection: an in-memory database lives as long as its connection.
    async fn test_app() -> (Router, Idempotency<Sqlite>, SqlitePool) {
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect("sqlite::memory:")
            .await
            .expect("in-memory database");
        let (router, store) = app(pool.clone()).await.expect("app");
        (router, store, pool)
    }

    async fn order(app: &Router, key: &str, body: &str) -> (Response<Body>, Bytes) {
        let request = Request::post("/orders")
            .header("x-user", "alice")
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(Body::from(body.to_owned()))
            .expect("request");
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
        let (app, _, pool) = test_app().await;
        let (first, first_body) = order(&app, "order-1", BOOK).await;
        let (retry, retry_body) = order(&app, "order-1", BOOK).await;
        assert_eq!(first.status(), StatusCode::CREATED);
        assert_eq!(retry.headers()["idempotent-replayed"], "true");
        assert_eq!(retry_body, first_body);
        assert_eq!(orders(&pool).await, 1);
    }

    /// The testing kit (feature `testing`) proves the SeaORM handler exactly-once,
    /// and that its insert went through the `Tx`.
    #[tokio::test]
    async fn create_order_runs_exactly_once() {
        let (app, store, pool) = test_app().await;
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
}
