//! A payments API whose `POST /payments` is exactly-once under retries.
//!
//! ```text
//! cargo run --example payments                      # SQLite file payments.db, no server needed
//! DATABASE_URL=postgres://postgres@127.0.0.1/postgres cargo run --example payments
//! DATABASE_URL=mysql://root@127.0.0.1/test cargo run --example payments
//! ```
//!
//! Environment: `DATABASE_URL` (default `sqlite://payments.db`, created and migrated
//! at start), `BIND` (default `127.0.0.1:3000`), `PROVIDER_LATENCY_MS` (default 300).
//!
//! ```text
//! # pay; run it twice: the second answer is the replay (Idempotent-Replayed: true)
//! curl -i -X POST localhost:3000/payments -H 'Authorization: Bearer alice' \
//!   -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' \
//!   -d '{"amount": 1200, "currency": "JPY", "to": "bob"}'
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
use std::str::FromStr;
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
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{MySql, MySqlConnection, PgConnection, Pool, Postgres, Row, Sqlite, SqliteConnection};

/// Every user's balance before their first payment.
const OPENING_BALANCE: i64 = 1_000_000;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "sqlite://payments.db".into());
    let bind = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let latency = match std::env::var("PROVIDER_LATENCY_MS") {
        Ok(ms) => ms
            .parse()
            .map_err(|_| format!("PROVIDER_LATENCY_MS={ms}: not a number"))?,
        Err(_) => 300,
    };
    let latency = Duration::from_millis(latency);
    let listener = tokio::net::TcpListener::bind(&bind).await?;
    let addr = listener.local_addr()?;

    let (app, backend) = if url.starts_with("postgres:") || url.starts_with("postgresql:") {
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
    } else if url.starts_with("mysql:") || url.starts_with("mariadb:") {
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
    } else if url.starts_with("sqlite:") {
        let options = SqliteConnectOptions::from_str(&url)?;
        // The provider's ledger sits beside the database, in a file of its own.
        let mut provider_path = options.get_filename().as_os_str().to_owned();
        provider_path.push("-provider");
        let pool = sqlite_pool(options, 8).await?;
        let provider = sqlite_pool(SqliteConnectOptions::new().filename(provider_path), 2).await?;
        (
            App::<Sqlite>::start(pool, provider, latency).await?,
            "SQLite",
        )
    } else {
        return Err(format!(
            "DATABASE_URL must be sqlite://…, postgres://… or mysql://…, not {url}"
        )
        .into());
    };

    println!("payments: listening on http://{addr} ({backend}, {url})");
    println!("try:");
    println!(
        "  curl -i -X POST http://{addr}/payments -H 'Authorization: Bearer alice' -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' -d '{{\"amount\": 1200, \"currency\": \"JPY\", \"to\": \"bob\"}}'"
    );
    println!("  curl -s http://{addr}/payments -H 'Authorization: Bearer alice'");
    axum::serve(listener, app).await?;
    Ok(())
}

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
#[idempotent(scope = "user_id", ttl = "24h", lock = "30s", required = true)]
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

ledger!(
    Postgres,
    PgConnection,
    "BIGSERIAL PRIMARY KEY",
    "now()::text"
);
ledger!(
    Sqlite,
    SqliteConnection,
    "INTEGER PRIMARY KEY AUTOINCREMENT",
    "datetime('now')"
);

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
