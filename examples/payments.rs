//! A payments API whose `POST /payments` is exactly-once under retries.
//!
//! ```text
//! cargo run --example payments --features sqlite            # SQLite file payments.db, no server
//! DATABASE_URL=postgres://postgres@127.0.0.1/postgres \
//!   cargo run --example payments --features sqlite,postgres
//! DATABASE_URL=mysql://root@127.0.0.1/test cargo run --example payments --features sqlite,mysql
//! cargo run --example payments --features sqlite -- demo    # a storm of retries through idem::client
//! ```
//!
//! Environment: `DATABASE_URL` (default `sqlite://payments.db`, created and migrated
//! at start; for `demo`, a scratch SQLite file), `BIND` (default `127.0.0.1:3000`;
//! for `demo`, any free port), `PROVIDER_LATENCY_MS` (default 300; for `demo`, 25).
//!
//! `FAULT_ABORT_AFTER_COMMIT=<key>` is for the fault suite (`tests/faults`): the
//! process dies right after the payment under that `Idempotency-Key` commits, before
//! its response is written.
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
//! ```
//!
//! The fake card provider stands for an external system: it commits each charge
//! through its own connection, outside the payment's transaction, deduplicates on the
//! key the handler relays (`key.derive("charge")`, unique per user and key), and
//! only then waits `PROVIDER_LATENCY_MS` before answering. A crash during that wait
//! is "the card was charged but we never heard back": the retry runs the handler
//! again, the provider returns the same charge, and the payment commits once.
//!
//! On SQLite the provider keeps its ledger in its own file (`payments.db-provider`):
//! the payment's transaction holds the application database's only write lock
//! while it waits for the provider, so SQLite runs one payment at a time.

use std::borrow::Cow;
use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRef, FromRequest, FromRequestParts, Path, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idem::{Backend, Idempotency, IdempotencyKey, Scope, Tx, idempotent};
use serde::{Deserialize, Serialize};
#[cfg(feature = "mysql")]
use sqlx::{MySql, MySqlConnection, mysql::MySqlPoolOptions};
#[cfg(feature = "postgres")]
use sqlx::{PgConnection, Postgres, postgres::PgPoolOptions};
use sqlx::{Pool, Row};
#[cfg(feature = "sqlite")]
use sqlx::{
    Sqlite, SqliteConnection,
    sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions},
};

/// Every user's balance before their first payment.
const OPENING_BALANCE: i64 = 1_000_000;

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
    let listener = tokio::net::TcpListener::bind(&bind).await?;
    let addr = listener.local_addr()?;

    // Each backend is there when the example is built with its feature.
    let scheme = url.split(':').next().unwrap_or_default();
    let (app, backend) = match scheme {
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => {
            let pool = PgPoolOptions::new()
                .max_connections(32)
                .connect(&url)
                .await?;
            let provider = PgPoolOptions::new()
                .max_connections(8)
                .connect(&url)
                .await?;
            (
                App::<Postgres>::start(pool, provider, latency).await?,
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
            let provider = MySqlPoolOptions::new()
                .max_connections(8)
                .connect(&url)
                .await?;
            (
                App::<MySql>::start(pool, provider, latency).await?,
                "MySQL/MariaDB",
            )
        }
        #[cfg(feature = "sqlite")]
        "sqlite" => {
            use std::str::FromStr as _;
            let options = SqliteConnectOptions::from_str(&url)?;
            // The provider's ledger sits beside the database, in a file of its own.
            let mut provider_path = options.get_filename().as_os_str().to_owned();
            provider_path.push("-provider");
            let pool = sqlite_pool(options, 8).await?;
            let provider =
                sqlite_pool(SqliteConnectOptions::new().filename(provider_path), 2).await?;
            (
                App::<Sqlite>::start(pool, provider, latency).await?,
                "SQLite",
            )
        }
        other => return Err(unsupported(other, &url).into()),
    };

    let app = if std::env::var_os("FAULT_ABORT_AFTER_COMMIT").is_some() {
        app.layer(axum::middleware::from_fn(abort_after_commit))
    } else {
        app
    };
    if demo.is_some() {
        println!("payments demo on {backend}");
        return demo::run(listener, app).await;
    }
    println!("payments: listening on http://{addr} ({backend}, {url})");
    println!("try:");
    println!(
        "  curl -i -X POST http://{addr}/payments -H 'Authorization: Bearer alice' -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' -d '{{\"amount\": 1200, \"currency\": \"JPY\", \"to\": \"bob\"}}'"
    );
    println!("  curl -s http://{addr}/payments -H 'Authorization: Bearer alice'");
    axum::serve(listener, app).await?;
    Ok(())
}

/// Fault injection: dies once the payment keyed `FAULT_ABORT_AFTER_COMMIT` has
/// committed, before answering: the narrow window in which only the stored record
/// can tell the client's retry what happened.
async fn abort_after_commit(request: Request, next: axum::middleware::Next) -> Response {
    let target = std::env::var("FAULT_ABORT_AFTER_COMMIT").ok();
    let key = request
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let response = next.run(request).await;
    let executed = matches!(
        response.extensions().get::<idem::Outcome>(),
        Some(idem::Outcome::Executed | idem::Outcome::TakenOver)
    );
    if executed && key.is_some() && key == target {
        eprintln!("payments: FAULT_ABORT_AFTER_COMMIT: dying before answering");
        std::process::abort();
    }
    response
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

// ---------------------------------------------------------------------------------
// State and routes

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
    ) -> Result<Router, sqlx::Error> {
        let idempotency = Idempotency::builder(pool)
            .problem_base("https://payments.example/problems/")
            .build()
            .map_err(|e| sqlx::Error::Configuration(e.into()))?;
        idempotency.migrate().await?;
        DB::migrate(idempotency.pool()).await?;
        DB::migrate_provider(&provider).await?;
        let app = Self {
            idempotency,
            provider: Provider {
                pool: provider,
                latency,
            },
        };
        Ok(Router::new()
            .route(
                "/payments",
                post(create_payment::<DB>).get(list_payments::<DB>),
            )
            .route("/payments/{id}", get(get_payment::<DB>))
            .route("/provider/charges", get(list_charges::<DB>))
            .with_state(app))
    }
}

#[derive(Deserialize)]
struct NewPayment {
    amount: i64,
    currency: String,
    to: String,
}

#[derive(Serialize)]
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
    let Some(_balance) = DB::debit(&mut tx, &user_id.0, new.amount).await? else {
        return Err(ApiError::InsufficientFunds);
    };
    let charge = app
        .provider
        .charge(&user_id.0, new.amount, &new.currency, &key.derive("charge"))
        .await?;
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

async fn list_payments<DB: Ledger>(
    State(app): State<App<DB>>,
    user_id: UserId,
) -> Result<Response, ApiError> {
    let (payments, balance) = DB::payments(app.idempotency.pool(), &user_id.0).await?;
    Ok(Json(serde_json::json!({ "payments": payments, "balance": balance })).into_response())
}

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
// Errors as problem+json

/// `Json<T>` whose rejections are problem+json too.
struct ApiJson<T>(T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = Response;

    async fn from_request(request: Request, state: &S) -> Result<Self, Response> {
        match Json::<T>::from_request(request, state).await {
            Ok(Json(value)) => Ok(Self(value)),
            Err(rejection) => Err(problem(
                rejection.status(),
                "invalid-body",
                "Invalid request body",
                &rejection_detail(&rejection),
            )),
        }
    }
}

fn rejection_detail(rejection: &JsonRejection) -> String {
    rejection.body_text()
}

enum ApiError {
    Unauthorized,
    Invalid(&'static str),
    InsufficientFunds,
    NotFound,
    Provider,
    Internal,
    Database(sqlx::Error),
}

impl From<sqlx::Error> for ApiError {
    fn from(error: sqlx::Error) -> Self {
        Self::Database(error)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            Self::Unauthorized => {
                let mut response = problem(
                    StatusCode::UNAUTHORIZED,
                    "unauthorized",
                    "Authentication required",
                    "send `Authorization: Bearer <user>`",
                );
                response
                    .headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                response
            }
            Self::Invalid(detail) => problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid-payment",
                "Invalid payment",
                detail,
            ),
            Self::InsufficientFunds => problem(
                StatusCode::PAYMENT_REQUIRED,
                "insufficient-funds",
                "Insufficient funds",
                "the balance does not cover this amount",
            ),
            Self::NotFound => problem(
                StatusCode::NOT_FOUND,
                "not-found",
                "No such payment",
                "no payment of yours has this id",
            ),
            Self::Provider => problem(
                StatusCode::BAD_GATEWAY,
                "provider-failed",
                "Card provider failed",
                "the charge could not be confirmed; retry with the same key",
            ),
            Self::Internal => problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "Internal error",
                "retry with the same key",
            ),
            Self::Database(error) => {
                eprintln!("payments: database error: {error}");
                problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "database",
                    "Database unavailable",
                    "retry with the same key",
                )
            }
        }
    }
}

fn problem(status: StatusCode, slug: &str, title: &str, detail: &str) -> Response {
    let body = serde_json::json!({
        "type": format!("https://payments.example/problems/{slug}"),
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut response = (status, Json(body)).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

// ---------------------------------------------------------------------------------
// The fake card provider

struct Provider<DB: Backend> {
    pool: Pool<DB>,
    latency: Duration,
}

impl<DB: Backend> Clone for Provider<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            latency: self.latency,
        }
    }
}

impl<DB: Ledger> Provider<DB> {
    /// Commits the charge on the provider's own connection, or finds the one made
    /// earlier under `key`; then takes `latency` to answer.
    async fn charge(
        &self,
        user: &str,
        amount: i64,
        currency: &str,
        key: &str,
    ) -> Result<String, ApiError> {
        let charge = DB::charge(&self.pool, user, amount, currency, key)
            .await
            .map_err(|error| {
                eprintln!("payments: provider error: {error}");
                ApiError::Provider
            })?;
        tokio::time::sleep(self.latency).await;
        Ok(charge)
    }
}

// ---------------------------------------------------------------------------------
// SQL, once for PostgreSQL and SQLite (SQLite reads `$1` as the first parameter
// too), and again for MySQL, which has `?`, no `RETURNING` and no `ON CONFLICT`

/// The example's queries, implemented for PostgreSQL and SQLite.
trait Ledger: Backend {
    fn migrate(pool: &Pool<Self>) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    fn migrate_provider(pool: &Pool<Self>) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// Debits `amount` if the balance covers it; the new balance, or `None`.
    fn debit(
        conn: &mut Self::Connection,
        user: &str,
        amount: i64,
    ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send;
    fn insert_payment(
        conn: &mut Self::Connection,
        user: &str,
        payment: &NewPayment,
        charge: &str,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send;
    fn payments(
        pool: &Pool<Self>,
        user: &str,
    ) -> impl Future<Output = Result<(Vec<Payment>, i64), sqlx::Error>> + Send;
    fn charge(
        pool: &Pool<Self>,
        user: &str,
        amount: i64,
        currency: &str,
        key: &str,
    ) -> impl Future<Output = Result<String, sqlx::Error>> + Send;
    fn charges(pool: &Pool<Self>) -> impl Future<Output = Result<Vec<Charge>, sqlx::Error>> + Send;
}

#[cfg(any(feature = "postgres", feature = "sqlite"))]
macro_rules! ledger {
    ($db:ty, $conn:ty, $id:literal, $now:literal) => {
        impl Ledger for $db {
            async fn migrate(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
                sqlx::raw_sql(concat!(
                    "CREATE TABLE IF NOT EXISTS accounts (user_id TEXT PRIMARY KEY, balance BIGINT NOT NULL);",
                    "CREATE TABLE IF NOT EXISTS payments (id ", $id, ", user_id TEXT NOT NULL, ",
                    "amount BIGINT NOT NULL, currency TEXT NOT NULL, payee TEXT NOT NULL, ",
                    "charge_id TEXT NOT NULL, created_at TEXT NOT NULL DEFAULT (", $now, "));",
                ))
                .execute(pool)
                .await?;
                Ok(())
            }

            async fn migrate_provider(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
                sqlx::raw_sql(concat!(
                    "CREATE TABLE IF NOT EXISTS provider_charges (id ", $id, ", user_id TEXT NOT NULL, ",
                    "amount BIGINT NOT NULL, currency TEXT NOT NULL, idempotency_key TEXT NOT NULL UNIQUE, ",
                    "created_at TEXT NOT NULL DEFAULT (", $now, "));",
                ))
                .execute(pool)
                .await?;
                Ok(())
            }

            async fn debit(conn: &mut $conn, user: &str, amount: i64) -> Result<Option<i64>, sqlx::Error> {
                sqlx::query("INSERT INTO accounts (user_id, balance) VALUES ($1, $2) ON CONFLICT (user_id) DO NOTHING")
                    .bind(user)
                    .bind(OPENING_BALANCE)
                    .execute(&mut *conn)
                    .await?;
                sqlx::query_scalar(
                    "UPDATE accounts SET balance = balance - $2 WHERE user_id = $1 AND balance >= $2 RETURNING balance",
                )
                .bind(user)
                .bind(amount)
                .fetch_optional(&mut *conn)
                .await
            }

            async fn insert_payment(
                conn: &mut $conn,
                user: &str,
                payment: &NewPayment,
                charge: &str,
            ) -> Result<i64, sqlx::Error> {
                sqlx::query_scalar(
                    "INSERT INTO payments (user_id, amount, currency, payee, charge_id) \
                     VALUES ($1, $2, $3, $4, $5) RETURNING id",
                )
                .bind(user)
                .bind(payment.amount)
                .bind(&payment.currency)
                .bind(&payment.to)
                .bind(charge)
                .fetch_one(&mut *conn)
                .await
            }

            async fn payments(pool: &Pool<Self>, user: &str) -> Result<(Vec<Payment>, i64), sqlx::Error> {
                let rows = sqlx::query(
                    "SELECT id, amount, currency, payee, charge_id FROM payments WHERE user_id = $1 ORDER BY id",
                )
                .bind(user)
                .fetch_all(pool)
                .await?;
                let payments = rows
                    .iter()
                    .map(|row| {
                        Ok(Payment {
                            id: row.try_get("id")?,
                            amount: row.try_get("amount")?,
                            currency: row.try_get("currency")?,
                            to: row.try_get("payee")?,
                            charge_id: row.try_get("charge_id")?,
                        })
                    })
                    .collect::<Result<_, sqlx::Error>>()?;
                let balance: Option<i64> = sqlx::query_scalar("SELECT balance FROM accounts WHERE user_id = $1")
                    .bind(user)
                    .fetch_optional(pool)
                    .await?;
                Ok((payments, balance.unwrap_or(OPENING_BALANCE)))
            }

            async fn charge(
                pool: &Pool<Self>,
                user: &str,
                amount: i64,
                currency: &str,
                key: &str,
            ) -> Result<String, sqlx::Error> {
                // Autocommit: durable before the provider answers.
                sqlx::query(
                    "INSERT INTO provider_charges (user_id, amount, currency, idempotency_key) \
                     VALUES ($1, $2, $3, $4) ON CONFLICT (idempotency_key) DO NOTHING",
                )
                .bind(user)
                .bind(amount)
                .bind(currency)
                .bind(key)
                .execute(pool)
                .await?;
                let id: i64 = sqlx::query_scalar("SELECT id FROM provider_charges WHERE idempotency_key = $1")
                    .bind(key)
                    .fetch_one(pool)
                    .await?;
                Ok(format!("ch_{id}"))
            }

            async fn charges(pool: &Pool<Self>) -> Result<Vec<Charge>, sqlx::Error> {
                let rows = sqlx::query(
                    "SELECT id, user_id, amount, currency, idempotency_key FROM provider_charges ORDER BY id",
                )
                .fetch_all(pool)
                .await?;
                rows.iter()
                    .map(|row| {
                        Ok(Charge {
                            id: format!("ch_{}", row.try_get::<i64, _>("id")?),
                            user: row.try_get("user_id")?,
                            amount: row.try_get("amount")?,
                            currency: row.try_get("currency")?,
                            key: row.try_get("idempotency_key")?,
                        })
                    })
                    .collect()
            }
        }
    };
}

#[cfg(feature = "postgres")]
ledger!(
    Postgres,
    PgConnection,
    "BIGSERIAL PRIMARY KEY",
    "now()::text"
);
#[cfg(feature = "sqlite")]
ledger!(
    Sqlite,
    SqliteConnection,
    "INTEGER PRIMARY KEY AUTOINCREMENT",
    "datetime('now')"
);

#[cfg(feature = "mysql")]
impl Ledger for MySql {
    async fn migrate(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
        // Binary collation: user ids compare exactly, as on the other backends.
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS accounts (user_id VARCHAR(255) COLLATE utf8mb4_bin PRIMARY KEY, \
                 balance BIGINT NOT NULL); \
             CREATE TABLE IF NOT EXISTS payments (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
                 user_id VARCHAR(255) COLLATE utf8mb4_bin NOT NULL, amount BIGINT NOT NULL, \
                 currency VARCHAR(3) NOT NULL, payee TEXT NOT NULL, charge_id VARCHAR(64) NOT NULL, \
                 created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6));",
        )
        .execute(pool)
        .await?;
        Ok(())
    }

    async fn migrate_provider(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS provider_charges (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
                 user_id VARCHAR(255) COLLATE utf8mb4_bin NOT NULL, amount BIGINT NOT NULL, \
                 currency VARCHAR(3) NOT NULL, \
                 idempotency_key VARCHAR(255) COLLATE utf8mb4_bin NOT NULL UNIQUE, \
                 created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6));",
        )
        .execute(pool)
        .await?;
        Ok(())
    }

    async fn debit(
        conn: &mut MySqlConnection,
        user: &str,
        amount: i64,
    ) -> Result<Option<i64>, sqlx::Error> {
        sqlx::query(
            "INSERT INTO accounts (user_id, balance) VALUES (?, ?) \
             ON DUPLICATE KEY UPDATE user_id = user_id",
        )
        .bind(user)
        .bind(OPENING_BALANCE)
        .execute(&mut *conn)
        .await?;
        let debited = sqlx::query(
            "UPDATE accounts SET balance = balance - ? WHERE user_id = ? AND balance >= ?",
        )
        .bind(amount)
        .bind(user)
        .bind(amount)
        .execute(&mut *conn)
        .await?;
        if debited.rows_affected() == 0 {
            return Ok(None);
        }
        sqlx::query_scalar("SELECT balance FROM accounts WHERE user_id = ?")
            .bind(user)
            .fetch_optional(&mut *conn)
            .await
    }

    async fn insert_payment(
        conn: &mut MySqlConnection,
        user: &str,
        payment: &NewPayment,
        charge: &str,
    ) -> Result<i64, sqlx::Error> {
        let done = sqlx::query(
            "INSERT INTO payments (user_id, amount, currency, payee, charge_id) VALUES (?, ?, ?, ?, ?)",
        )
        .bind(user)
        .bind(payment.amount)
        .bind(&payment.currency)
        .bind(&payment.to)
        .bind(charge)
        .execute(&mut *conn)
        .await?;
        i64::try_from(done.last_insert_id()).map_err(|e| sqlx::Error::Decode(e.into()))
    }

    async fn payments(pool: &Pool<Self>, user: &str) -> Result<(Vec<Payment>, i64), sqlx::Error> {
        let rows = sqlx::query(
            "SELECT id, amount, currency, payee, charge_id FROM payments WHERE user_id = ? ORDER BY id",
        )
        .bind(user)
        .fetch_all(pool)
        .await?;
        let payments = rows
            .iter()
            .map(|row| {
                Ok(Payment {
                    id: row.try_get("id")?,
                    amount: row.try_get("amount")?,
                    currency: row.try_get("currency")?,
                    to: row.try_get("payee")?,
                    charge_id: row.try_get("charge_id")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()?;
        let balance: Option<i64> =
            sqlx::query_scalar("SELECT balance FROM accounts WHERE user_id = ?")
                .bind(user)
                .fetch_optional(pool)
                .await?;
        Ok((payments, balance.unwrap_or(OPENING_BALANCE)))
    }

    async fn charge(
        pool: &Pool<Self>,
        user: &str,
        amount: i64,
        currency: &str,
        key: &str,
    ) -> Result<String, sqlx::Error> {
        sqlx::query(
            "INSERT INTO provider_charges (user_id, amount, currency, idempotency_key) \
             VALUES (?, ?, ?, ?) ON DUPLICATE KEY UPDATE id = id",
        )
        .bind(user)
        .bind(amount)
        .bind(currency)
        .bind(key)
        .execute(pool)
        .await?;
        let id: i64 =
            sqlx::query_scalar("SELECT id FROM provider_charges WHERE idempotency_key = ?")
                .bind(key)
                .fetch_one(pool)
                .await?;
        Ok(format!("ch_{id}"))
    }

    async fn charges(pool: &Pool<Self>) -> Result<Vec<Charge>, sqlx::Error> {
        let rows = sqlx::query(
            "SELECT id, user_id, amount, currency, idempotency_key FROM provider_charges ORDER BY id",
        )
        .fetch_all(pool)
        .await?;
        rows.iter()
            .map(|row| {
                Ok(Charge {
                    id: format!("ch_{}", row.try_get::<i64, _>("id")?),
                    user: row.try_get("user_id")?,
                    amount: row.try_get("amount")?,
                    currency: row.try_get("currency")?,
                    key: row.try_get("idempotency_key")?,
                })
            })
            .collect()
    }
}

// ---------------------------------------------------------------------------------
// `demo`: a storm of retries through the client

mod demo {
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
    use idem::Outcome;
    use idem::client::{Receipt, RetryLayer, RetryPolicy};
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
    pub(super) struct Scratch(PathBuf);

    impl Scratch {
        pub(super) fn new() -> Self {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let name = format!("payments-demo-{}-{nanos}.db", std::process::id());
            Self(std::env::temp_dir().join(name))
        }

        pub(super) fn url(&self) -> String {
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

    pub(super) async fn run(
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
        let mut fetch =
            async |path: String, user: Option<String>| -> Result<Value, Box<dyn Error>> {
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
}
