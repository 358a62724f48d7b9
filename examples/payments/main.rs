//! A payments API whose `POST /payments` is exactly-once under retries.
//!
//! ```text
//! cargo run --example payments --features sqlite            # SQLite file payments.db, no server
//! DATABASE_URL=postgres://postgres@127.0.0.1/postgres \
//!   cargo run --example payments --features sqlite,postgres
//! DATABASE_URL=mysql://root@127.0.0.1/test cargo run --example payments --features sqlite,mysql
//! cargo run --example payments --features sqlite -- demo    # a storm of retries through idem_axum::client
//! ```
//!
//! Environment: `DATABASE_URL` (default `sqlite://payments.db`, created and migrated
//! at start; for `demo`, a scratch SQLite file), `BIND` (default `127.0.0.1:3000`;
//! for `demo`, any free port), `PROVIDER_LATENCY_MS` (default 300; for `demo`, 25),
//! `PROVIDER_DATABASE_URL` (where the fake provider keeps its charges, a database of
//! the same kind; default `DATABASE_URL`, or on SQLite a file beside it: a provider
//! is another company's system, and a failover of yours does not take its charges),
//! `PAYMENTS_SEAL_KEYS` (a key ring: standard base64 of 32-byte keys, the sealing key first,
//! separated by commas; recorded answers are then sealed at rest, see
//! `idem_axum::Sealing`; a malformed ring stops the start).
//!
//! SIGTERM or Ctrl-C shuts it down gracefully (`idem_axum::Shutdown`): payments in flight
//! finish and are recorded, new ones are answered 503 `shutting-down` until it exits.
//!
//! `demo` serves the API behind a flaky proxy (it refuses some requests with 503 and
//! loses the responses of some completed payments as 502) and sends it a storm of
//! payments through the retrying client, each payment sent several times at once
//! with one key, as a double-clicking user would; then it counts requests,
//! executions, replays and charges, and fails unless each payment was charged once.
//!
//! ```text
//! # pay; run it twice: the second answer is the replay (Idempotent-Replayed: true)
//! curl -i -X POST localhost:3000/payments -H 'Authorization: Bearer alice' \
//!   -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' \
//!   -d '{"amount": 1200, "currency": "JPY", "to": "bob"}'
//! # the same key twice at once: the second waits for the first (`wait = "5s"`) and
//! # answers its response as a replay; with PROVIDER_LATENCY_MS=8000 it gives up at
//! # 5 s with 409 in-flight and a Retry-After of what is left of the 30 s lock
//! # the same key with another body: 422 payload-mismatch
//! curl -i -X POST localhost:3000/payments -H 'Authorization: Bearer alice' \
//!   -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' \
//!   -d '{"amount": 9999, "currency": "JPY", "to": "bob"}'
//! curl -s localhost:3000/payments -H 'Authorization: Bearer alice'
//! curl -s localhost:3000/provider/charges
//! curl -s localhost:3000/metrics        # idem_requests_total{outcome=...} and the rest
//! curl -s localhost:3000/openapi.json   # the API's OpenAPI document, keys and replays included
//! ```
//!
//! The fake card provider stands for an external system: it commits each charge
//! through its own connection, outside the payment's transaction, deduplicates on the
//! key the handler relays (`key.derive("charge")`, unique per user and key), and
//! only then waits `PROVIDER_LATENCY_MS` before answering. A crash during that wait
//! is "the card was charged but we never heard back": the retry runs the handler
//! again, the provider returns the same charge, and the payment commits once.
//!
//! The handler calls the provider before its first write, and voids the charge when
//! the debit then finds the balance short: on SQLite the store takes the database's
//! one write lock at the transaction's first write (`write_lock_at_first_write`),
//! so payments wait for the provider side by side instead of one at a time. The
//! provider keeps its ledger in a file of its own there (`payments.db-provider`).

use std::borrow::Cow;
use std::time::Duration;

use axum::extract::{FromRef, FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idem_axum::utoipa::{KeyHeader, ReplaysWithTtl};
use idem_axum::{Idempotency, IdempotencyKey, KeyRing, Scope, Sealing, Shutdown, Tx, idempotent};
use metrics_exporter_prometheus::PrometheusBuilder;
use serde::{Deserialize, Serialize};
use sqlx::Pool;
#[cfg(feature = "mysql")]
use sqlx::{MySql, mysql::MySqlPoolOptions};
#[cfg(feature = "postgres")]
use sqlx::{Postgres, postgres::PgPoolOptions};
#[cfg(feature = "sqlite")]
use sqlx::{
    Sqlite,
    sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions},
};
use utoipa::{OpenApi as _, ToSchema};

mod demo;
mod errors;
mod ledger;

use errors::{ApiError, ApiJson};
use ledger::{Ledger, Provider};

const OPENING_BALANCE: i64 = 1_000_000;

// ---------------------------------------------------------------------------------
// State and routes: the API, with its one exactly-once endpoint

struct App<DB: Ledger> {
    idempotency: Idempotency<DB>,
    provider: Provider<DB>,
}

impl<DB: Ledger> Clone for App<DB> {
    fn clone(&self) -> Self {
        Self {
            idempotency: self.idempotency.clone(),
            provider: self.provider.clone(),
        }
    }
}

impl<DB: Ledger> FromRef<App<DB>> for Idempotency<DB> {
    fn from_ref(app: &App<DB>) -> Self {
        app.idempotency.clone()
    }
}

impl<DB: Ledger> App<DB> {
    async fn start(
        pool: Pool<DB>,
        provider: Pool<DB>,
        latency: Duration,
        sealing: Sealing,
    ) -> Result<(Router, Shutdown), sqlx::Error> {
        let idempotency = DB::settings(Idempotency::builder(pool))
            .problem_base("https://payments.example/problems/")
            .sealing(sealing)
            .build()
            .map_err(|e| sqlx::Error::Configuration(e.into()))?;
        idempotency.migrate().await?;
        DB::migrate(idempotency.pool()).await?;
        DB::migrate_provider(&provider).await?;
        let shutdown = idempotency.shutdown();
        let app = Self {
            idempotency,
            provider: Provider {
                pool: provider,
                latency,
            },
        };
        let router = Router::new()
            .route(
                "/payments",
                post(create_payment::<DB>).get(list_payments::<DB>),
            )
            .route("/payments/{id}", get(get_payment::<DB>))
            .route("/provider/charges", get(list_charges::<DB>))
            .route("/openapi.json", get(|| async { Json(ApiDoc::openapi()) }))
            .with_state(app);
        Ok((router, shutdown))
    }
}

/// The API's OpenAPI document, served at `/openapi.json`. `POST /payments` names
/// idem's `KeyHeader`; the `ReplaysWithTtl` modifier then documents, on every
/// operation that takes the key, the headers of a replayed answer and idem's own
/// 400/409/422/503 problems.
#[derive(utoipa::OpenApi)]
#[openapi(
    info(title = "payments", description = "A payments API whose POST /payments is exactly-once under retries."),
    paths(create_payment, list_payments, get_payment),
    modifiers(&ReplaysWithTtl)
)]
struct ApiDoc;

/// An error as this API and idem answer it (RFC 9457).
#[derive(ToSchema)]
#[allow(dead_code)] // documentation only: the bodies are written by `errors::problem`
struct Problem {
    r#type: String,
    title: String,
    status: u16,
    detail: String,
}

#[derive(Deserialize, ToSchema)]
struct NewPayment {
    amount: i64,
    currency: String,
    to: String,
}

#[derive(Serialize, ToSchema)]
struct Payment {
    id: i64,
    amount: i64,
    currency: String,
    to: String,
    charge_id: String,
}

#[derive(Serialize)]
struct Charge {
    id: String,
    user: String,
    amount: i64,
    currency: String,
    key: String,
}

/// Charges the card through the provider (relaying a key derived from the
/// client's), debits the balance and records the payment, all in `tx`: the payment
/// and the recorded response commit together.
#[utoipa::path(
    post,
    path = "/payments",
    params(KeyHeader),
    request_body = NewPayment,
    responses(
        (status = 201, description = "The payment, charged once", body = Payment,
            headers(("Location" = String, description = "The payment's own URL"))),
        (status = 401, description = "No `Authorization: Bearer <user>`", body = Problem,
            content_type = "application/problem+json"),
        (status = 402, description = "The balance does not cover the amount (`insufficient-funds`)",
            body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "An invalid payment (`invalid-payment`), or the key reused \
            with another request (`payload-mismatch`)", body = Problem,
            content_type = "application/problem+json"),
    )
)]
#[idempotent(
    scope = "user_id",
    ttl = "24h",
    lock = "30s",
    wait = "5s",
    required = true,
    ttl_header = true
)]
async fn create_payment<DB: Ledger>(
    State(app): State<App<DB>>,
    user_id: UserId,
    key: IdempotencyKey,
    mut tx: Tx<DB>,
    ApiJson(new): ApiJson<NewPayment>,
) -> Result<Response, ApiError> {
    new.validate()?;
    // The provider first, the writes after: SQLite's one write lock is taken at the
    // transaction's first write (`write_lock_at_first_write`), so other payments go
    // on while this one waits for the provider. The charge is an authorisation the
    // debit below confirms, or voids when the balance does not cover it.
    let charge_key = key.derive("charge");
    let charge = app
        .provider
        .charge(&user_id.0, new.amount, &new.currency, &charge_key)
        .await?;
    // A write first: a transaction that read before its first write would fail on
    // SQLite when another payment committed in between.
    let Some(_balance) = DB::debit(&mut tx, &user_id.0, new.amount).await? else {
        // The balance does not cover it: the authorisation is voided.
        app.provider.void(&charge_key).await?;
        return Err(ApiError::InsufficientFunds);
    };
    let id = DB::insert_payment(&mut tx, &user_id.0, &new, &charge).await?;
    let payment = Payment {
        id,
        amount: new.amount,
        currency: new.currency,
        to: new.to,
        charge_id: charge,
    };
    let location =
        HeaderValue::try_from(format!("/payments/{id}")).map_err(|_| ApiError::Internal)?;
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(payment),
    )
        .into_response())
}

#[utoipa::path(get, path = "/payments", responses(
    (status = 200, description = "The caller's payments and balance"),
    (status = 401, description = "No `Authorization: Bearer <user>`", body = Problem,
        content_type = "application/problem+json"),
))]
async fn list_payments<DB: Ledger>(
    State(app): State<App<DB>>,
    user_id: UserId,
) -> Result<Response, ApiError> {
    let (payments, balance) = DB::payments(app.idempotency.pool(), &user_id.0).await?;
    Ok(Json(serde_json::json!({ "payments": payments, "balance": balance })).into_response())
}

#[utoipa::path(get, path = "/payments/{id}",
    params(("id" = i64, Path, description = "The payment's id")),
    responses(
        (status = 200, description = "The payment", body = Payment),
        (status = 404, description = "No payment of the caller's has this id", body = Problem,
            content_type = "application/problem+json"),
    )
)]
async fn get_payment<DB: Ledger>(
    State(app): State<App<DB>>,
    user_id: UserId,
    Path(id): Path<i64>,
) -> Result<Response, ApiError> {
    let (payments, _) = DB::payments(app.idempotency.pool(), &user_id.0).await?;
    match payments.into_iter().find(|p| p.id == id) {
        Some(payment) => Ok(Json(payment).into_response()),
        None => Err(ApiError::NotFound),
    }
}

async fn list_charges<DB: Ledger>(State(app): State<App<DB>>) -> Result<Response, ApiError> {
    let charges = DB::charges(&app.provider.pool).await?;
    Ok(Json(serde_json::json!({ "charges": charges })).into_response())
}

impl NewPayment {
    fn validate(&self) -> Result<(), ApiError> {
        if self.amount <= 0 {
            return Err(ApiError::Invalid(
                "`amount` must be a whole number above zero",
            ));
        }
        if self.currency.len() != 3 || !self.currency.bytes().all(|b| b.is_ascii_uppercase()) {
            return Err(ApiError::Invalid(
                "`currency` must be a three-letter code such as JPY",
            ));
        }
        if self.to.trim().is_empty() || self.to.len() > 200 {
            return Err(ApiError::Invalid(
                "`to` must name the payee (1 to 200 bytes)",
            ));
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------
// Authentication (demo only: the bearer token IS the user id)

struct UserId(String);

impl<S: Send + Sync> FromRequestParts<S> for UserId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        let token = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty() && t.len() <= 200);
        token
            .map(|t| UserId(t.to_owned()))
            .ok_or(ApiError::Unauthorized)
    }
}

impl Scope for UserId {
    fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

// ---------------------------------------------------------------------------------
// Start-up: the database from `DATABASE_URL`, then serve (or run the demo)

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let demo = match std::env::args().nth(1).as_deref() {
        None => None,
        Some("demo") => Some(demo::Scratch::new()),
        Some(other) => return Err(format!("unknown mode {other:?}; usage: payments [demo]").into()),
    };
    let url = match (std::env::var("DATABASE_URL"), &demo) {
        (Ok(url), _) => url,
        (Err(_), Some(scratch)) => scratch.url(),
        (Err(_), None) => "sqlite://payments.db".into(),
    };
    let default_bind = if demo.is_some() {
        "127.0.0.1:0"
    } else {
        "127.0.0.1:3000"
    };
    let bind = std::env::var("BIND").unwrap_or_else(|_| default_bind.into());
    let latency = match std::env::var("PROVIDER_LATENCY_MS") {
        Ok(ms) => ms
            .parse()
            .map_err(|_| format!("PROVIDER_LATENCY_MS={ms}: not a number"))?,
        Err(_) if demo.is_some() => 25,
        Err(_) => 300,
    };
    let latency = Duration::from_millis(latency);
    let provider_url = std::env::var("PROVIDER_DATABASE_URL").ok();
    // Recorded answers hold card details: sealed at rest when a key ring is given
    // (standard base64 of 32-byte keys, the sealing key first, separated by commas). A
    // malformed ring stops the start, never runs unsealed.
    let sealing = match std::env::var("PAYMENTS_SEAL_KEYS").map(zeroize::Zeroizing::new) {
        Ok(keys) => Sealing::On(
            KeyRing::from_base64(&keys).map_err(|e| format!("PAYMENTS_SEAL_KEYS: {e}"))?,
        ),
        Err(std::env::VarError::NotPresent) => Sealing::Off,
        Err(error) => return Err(format!("PAYMENTS_SEAL_KEYS: {error}").into()),
    };
    let sealed = matches!(sealing, Sealing::On(_));
    let listener = tokio::net::TcpListener::bind(&bind).await?;
    let addr = listener.local_addr()?;

    // Each backend is there when the example is built with its feature.
    let scheme = url.split(':').next().unwrap_or_default();
    // idem's metrics (feature `metrics`), and the app's, in Prometheus' text format.
    let prometheus = PrometheusBuilder::new().install_recorder()?;
    let ((app, shutdown), backend) = match scheme {
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => {
            let pool = PgPoolOptions::new()
                .max_connections(32)
                .connect(&url)
                .await?;
            let provider = PgPoolOptions::new()
                .max_connections(8)
                .connect(&provider_url.unwrap_or_else(|| url.clone()))
                .await?;
            (
                App::<Postgres>::start(pool, provider, latency, sealing).await?,
                "PostgreSQL",
            )
        }
        #[cfg(feature = "mysql")]
        "mysql" | "mariadb" => {
            let url = url.replacen("mariadb:", "mysql:", 1);
            let pool = MySqlPoolOptions::new()
                .max_connections(32)
                .connect(&url)
                .await?;
            let provider = provider_url.map(|u| u.replacen("mariadb:", "mysql:", 1));
            let provider = MySqlPoolOptions::new()
                .max_connections(8)
                .connect(provider.as_deref().unwrap_or(&url))
                .await?;
            (
                App::<MySql>::start(pool, provider, latency, sealing).await?,
                "MySQL/MariaDB",
            )
        }
        #[cfg(feature = "sqlite")]
        "sqlite" => {
            use std::str::FromStr as _;
            let options = SqliteConnectOptions::from_str(&url)?;
            // The provider's ledger sits beside the database, in a file of its own.
            let provider = match provider_url {
                Some(url) => SqliteConnectOptions::from_str(&url)?,
                None => {
                    let mut path = options.get_filename().as_os_str().to_owned();
                    path.push("-provider");
                    SqliteConnectOptions::new().filename(path)
                }
            };
            let pool = sqlite_pool(options, 8).await?;
            let provider = sqlite_pool(provider, 2).await?;
            (
                App::<Sqlite>::start(pool, provider, latency, sealing).await?,
                "SQLite",
            )
        }
        other => return Err(unsupported(other, &url).into()),
    };
    let app = app.route("/metrics", get(move || async move { prometheus.render() }));

    if demo.is_some() {
        println!("payments demo on {backend}");
        return demo::run(listener, app).await;
    }
    let sealed = if sealed { ", responses sealed" } else { "" };
    println!("payments: listening on http://{addr} ({backend}, {url}{sealed})");
    println!("try:");
    println!(
        "  curl -i -X POST http://{addr}/payments -H 'Authorization: Bearer alice' -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' -d '{{\"amount\": 1200, \"currency\": \"JPY\", \"to\": \"bob\"}}'"
    );
    println!("  curl -s http://{addr}/payments -H 'Authorization: Bearer alice'");
    // SIGTERM (a deploy) or Ctrl-C: stop taking payments, let those in flight
    // finish and be recorded, cancel what is left after 25 s (within a typical 30 s
    // grace period), then exit.
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.drain_on(stop_signal()))
        .await?;
    let closed = shutdown.close(Duration::from_secs(25)).await;
    println!(
        "payments: stopped ({} in flight cancelled)",
        closed.cancelled
    );
    Ok(())
}

/// Resolves on SIGTERM or SIGINT.
async fn stop_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => {
                tokio::select! {
                    _ = terminate.recv() => {}
                    _ = interrupt => {}
                }
            }
            Err(_) => {
                let _ = interrupt.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
}

/// Why `DATABASE_URL` cannot be served by this build.
fn unsupported(scheme: &str, url: &str) -> String {
    let feature = match scheme {
        "postgres" | "postgresql" => "postgres",
        "mysql" | "mariadb" => "mysql",
        "sqlite" => "sqlite",
        _ => {
            return format!(
                "DATABASE_URL must be sqlite://…, postgres://… or mysql://…, not {url}"
            );
        }
    };
    format!("this build has no {feature} backend: run it with `--features {feature}`")
}

#[cfg(feature = "sqlite")]
async fn sqlite_pool(
    options: SqliteConnectOptions,
    size: u32,
) -> Result<Pool<Sqlite>, sqlx::Error> {
    let options = options
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(30));
    SqlitePoolOptions::new()
        .max_connections(size)
        .connect_with(options)
        .await
}
