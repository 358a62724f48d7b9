//! The HTTP benchmark's peer variant: the crate axum-idempotent in front of the
//! handler every variant serves, with its sessions in the same PostgreSQL schema
//! (its Redis store needs Redis 7.4's hash-field expiry; this machine has 7.0).
//!
//! It answers from a response cached in the caller's session, keyed by the
//! `Idempotency-Key` header, and caches only for a caller that already has a
//! session: `GET /session` opens one (the bench's clients all share it, as one
//! user's retries would). Started by `benches/http.rs` with the same environment
//! as its own server role.

use std::sync::Arc;

use axum::Router;
use axum::routing::{get, post};
use axum_idempotent::{IdempotentLayer, IdempotentOptions};
use ruts::store::Ttl;
use ruts::store::postgres::{PostgresStore, PostgresStoreBuilder};
use ruts::{CookieOptions, Session, SessionLayer};
use sqlx::Postgres;
use tower_cookies::CookieManagerLayer;

#[allow(dead_code)]
#[path = "../../common/shop.rs"]
mod shop;

type Store = PostgresStore;

/// Opens a session: the middleware never does.
async fn open_session(session: Session<Store>) -> String {
    let Ok(ttl) = Ttl::new(86_400) else {
        return "no session: ttl".to_owned();
    };
    match session.set("user", &1_i64, ttl, None).await {
        Ok(_) => "ok".to_owned(),
        Err(error) => format!("no session: {error}"),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (pool, size) = shop::pool_from_env().await?;
    let sessions = sqlx08::postgres::PgPoolOptions::new()
        .max_connections(u32::try_from(size)?)
        .connect(&std::env::var("DATABASE_URL")?)
        .await?;
    let store = PostgresStoreBuilder::new(sessions)
        .schema_name(std::env::var("SCHEMA")?)?
        .create_table(true)
        .build()
        .await?;
    let store = Arc::new(store);
    let options = IdempotentOptions::default()
        .use_idempotency_key_header(Some("idempotency-key"), true)
        .expire_after(86_400);
    let payments = Router::new()
        .route("/payments", post(shop::pay::<Postgres>))
        .layer(IdempotentLayer::<Store>::new(options));
    let router = payments
        .route("/session", get(open_session))
        .layer(
            SessionLayer::new(store).with_cookie_options(
                CookieOptions::build()
                    .name("session")
                    .max_age(86_400)
                    .path("/"),
            ),
        )
        .layer(CookieManagerLayer::new())
        .route("/counting", post(shop::counting))
        .route("/stats", get(shop::stats::<Postgres>))
        .route("/executions", get(shop::executions))
        .layer(axum::middleware::from_fn(shop::note_failures))
        .with_state(pool);
    shop::serve(router).await
}
