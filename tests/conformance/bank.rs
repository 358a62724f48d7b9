//! An app written the way axum users write them, with `#[idempotent]`: routers
//! nested under path parameters and versions, `merge`, `nest_service`, an auth
//! `route_layer`, URI-rewriting middleware inside and outside the router, a handler
//! that catches a unique violation, one that opens a savepoint of its own.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::FromRequestParts;
use axum::extract::{FromRef, FromRequest, Multipart, Path, Request, State};
use axum::http::request::Parts;
use axum::http::{StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use idem_axum::{Idempotency, IdempotencyKey, Scope, Tx, idempotent};
use serde::Deserialize;
use sqlx::Connection as _;
use tower::Layer as _;
use tower::util::BoxCloneSyncService;
use tower_http::normalize_path::NormalizePathLayer;

use crate::harness::Harness;

/// The bank's own tables: no generated ids, so one script fits every backend.
/// Every table has a primary key, as a Galera cluster needs (two nodes' rows of a
/// table without one may collide at certification, and Percona XtraDB Cluster
/// refuses writes to it): the handlers give each row an id of their own.
pub const SCHEMA: &str = "\
    CREATE TABLE transfers (id VARCHAR(64) PRIMARY KEY, account VARCHAR(64) NOT NULL, \
        owner VARCHAR(64) NOT NULL, amount VARCHAR(32) NOT NULL, via VARCHAR(255) NOT NULL); \
    CREATE TABLE users (email VARCHAR(255) PRIMARY KEY, owner VARCHAR(64) NOT NULL); \
    CREATE TABLE coupons_used (code VARCHAR(64) PRIMARY KEY, owner VARCHAR(64) NOT NULL); \
    CREATE TABLE orders (id VARCHAR(64) PRIMARY KEY, owner VARCHAR(64) NOT NULL, \
        item VARCHAR(64) NOT NULL, discounted VARCHAR(8) NOT NULL); \
    CREATE TABLE audit (id VARCHAR(64) PRIMARY KEY, owner VARCHAR(64) NOT NULL, \
        what VARCHAR(255) NOT NULL);";

/// A row id no other row of this process's runs has.
fn row_id() -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{}-{}",
        crate::unique_suffix(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// The caller, as the auth layer found it.
#[derive(Clone, Debug)]
pub struct User(pub String);

impl Scope for User {
    fn scope(&self) -> std::borrow::Cow<'_, str> {
        self.0.as_str().into()
    }
}

/// `Authorization: Bearer <name>`, or 401 before any handler runs.
async fn auth(mut request: Request, next: Next) -> Response {
    let user = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|name| User(name.to_owned()));
    match user {
        Some(user) => {
            request.extensions_mut().insert(user);
            next.run(request).await
        }
        None => StatusCode::UNAUTHORIZED.into_response(),
    }
}

pub struct Bank<H: Harness> {
    idempotency: Idempotency<H::DB>,
    /// Sign-ups run: what a provider called from the handler, outside the
    /// database, would have been asked for.
    sign_ups: Arc<AtomicUsize>,
    /// Runs of the app's counting extractors, [`Counted`] and [`CountedUser`].
    extracted: Arc<AtomicUsize>,
    /// The card provider's charges, by account: what it was asked from outside
    /// the database, which no rollback takes back.
    charged: Charges,
    _harness: PhantomData<fn() -> H>,
}

/// Charges a provider made, by account: when each handler run that made one
/// started and ended.
pub type Charges = Arc<Mutex<HashMap<String, Vec<(Instant, Instant)>>>>;

/// How long the provider takes to answer a charge: long enough for duplicates
/// sent at once to arrive while the first is in flight.
pub const PROVIDER_LATENCY: Duration = Duration::from_millis(300);

impl<H: Harness> Clone for Bank<H> {
    fn clone(&self) -> Self {
        Self {
            idempotency: self.idempotency.clone(),
            sign_ups: self.sign_ups.clone(),
            extracted: self.extracted.clone(),
            charged: self.charged.clone(),
            _harness: PhantomData,
        }
    }
}

/// `Json<T>`, counting its runs in the bank's `extracted`.
pub struct Counted<T>(T);

impl<H: Harness, T: serde::de::DeserializeOwned> FromRequest<Bank<H>> for Counted<T> {
    type Rejection = Response;

    async fn from_request(request: Request, bank: &Bank<H>) -> Result<Self, Response> {
        bank.extracted.fetch_add(1, Ordering::SeqCst);
        match Json::<T>::from_request(request, bank).await {
            Ok(Json(value)) => Ok(Self(value)),
            Err(rejection) => Err(rejection.into_response()),
        }
    }
}

/// The caller, counting its runs in the bank's `extracted`.
pub struct CountedUser(User);

impl Scope for CountedUser {
    fn scope(&self) -> std::borrow::Cow<'_, str> {
        self.0.scope()
    }
}

impl<H: Harness> FromRequestParts<Bank<H>> for CountedUser {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, bank: &Bank<H>) -> Result<Self, Response> {
        bank.extracted.fetch_add(1, Ordering::SeqCst);
        let Extension(user) = Extension::<User>::from_request_parts(parts, bank)
            .await
            .map_err(IntoResponse::into_response)?;
        Ok(Self(user))
    }
}

impl<H: Harness> FromRef<Bank<H>> for Idempotency<H::DB> {
    fn from_ref(bank: &Bank<H>) -> Self {
        bank.idempotency.clone()
    }
}

#[derive(Deserialize)]
pub struct NewTransfer {
    amount: i64,
}

/// POST …/accounts/{acct}/transfers: one row per execution, in `acct`.
#[idempotent(scope = "user", ttl = "1h", lock = "10s", required = true)]
async fn transfer<H: Harness>(
    Extension(user): Extension<User>,
    Path(acct): Path<String>,
    uri: Uri,
    mut tx: Tx<H::DB>,
    Json(req): Json<NewTransfer>,
) -> Response {
    let amount = req.amount.to_string();
    let via = uri.path().to_owned();
    let sql = "INSERT INTO transfers (id, account, owner, amount, via) VALUES ($1, $2, $3, $4, $5)";
    match H::exec(&mut *tx, sql, &[&row_id(), &acct, &user.0, &amount, &via]).await {
        Ok(_) => (StatusCode::CREATED, format!(r#"{{"account":"{acct}"}}"#)).into_response(),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

/// POST …/accounts/{acct}/charges: charges the card at the provider (noted in
/// the bank's `charged`, outside the database), then books one row in `acct`.
#[idempotent(scope = "user", ttl = "1h", lock = "10s", required = true)]
async fn charge<H: Harness>(
    State(bank): State<Bank<H>>,
    Extension(user): Extension<User>,
    Path(acct): Path<String>,
    mut tx: Tx<H::DB>,
    Json(req): Json<NewTransfer>,
) -> Response {
    let started = Instant::now();
    tokio::time::sleep(PROVIDER_LATENCY).await;
    let amount = req.amount.to_string();
    let sql = "INSERT INTO transfers (id, account, owner, amount, via) VALUES ($1, $2, $3, $4, $5)";
    let values = [row_id(), acct.clone(), user.0, amount, "charge".to_owned()];
    let values: Vec<&str> = values.iter().map(String::as_str).collect();
    let booked = H::exec(&mut *tx, sql, &values).await;
    if let Ok(mut charged) = bank.charged.lock() {
        let runs = charged.entry(acct.clone()).or_default();
        runs.push((started, Instant::now()));
    }
    match booked {
        Ok(_) => (StatusCode::CREATED, format!(r#"{{"charged":"{acct}"}}"#)).into_response(),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

#[derive(Deserialize)]
pub struct SignUp {
    email: String,
}

/// POST /v1/users: a taken email is this handler's own 409, caught from the
/// database's unique violation. On PostgreSQL that leaves the transaction aborted.
#[idempotent(scope = "user", ttl = "1h", lock = "10s", required = true)]
async fn sign_up<H: Harness>(
    State(bank): State<Bank<H>>,
    Extension(user): Extension<User>,
    mut tx: Tx<H::DB>,
    Json(req): Json<SignUp>,
) -> (StatusCode, String) {
    bank.sign_ups.fetch_add(1, Ordering::SeqCst);
    let audit = "INSERT INTO audit (id, owner, what) VALUES ($1, $2, $3)";
    let what = format!("sign-up attempt {}", req.email);
    if let Err(error) = H::exec(&mut *tx, audit, &[&row_id(), &user.0, &what]).await {
        return (StatusCode::INTERNAL_SERVER_ERROR, error.to_string());
    }
    let insert = "INSERT INTO users (email, owner) VALUES ($1, $2)";
    match H::exec(&mut *tx, insert, &[&req.email, &user.0]).await {
        Ok(_) => (StatusCode::CREATED, r#"{"created":true}"#.to_owned()),
        Err(sqlx::Error::Database(error)) if error.is_unique_violation() => (
            StatusCode::CONFLICT,
            format!(r#"{{"error":"email taken","email":"{}"}}"#, req.email),
        ),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()),
    }
}

#[derive(Deserialize)]
pub struct NewOrder {
    item: String,
    coupon: String,
}

/// POST /v1/orders: redeems the coupon inside a savepoint of its own; a coupon
/// already used rolls back to it and the order goes on without the discount.
#[idempotent(scope = "user", ttl = "1h", lock = "10s", required = true)]
async fn order<H: Harness>(
    Extension(user): Extension<User>,
    mut tx: Tx<H::DB>,
    Json(req): Json<NewOrder>,
) -> (StatusCode, String) {
    let discounted = match tx.begin().await {
        Ok(mut savepoint) => {
            let redeem = "INSERT INTO coupons_used (code, owner) VALUES ($1, $2)";
            match H::exec(&mut *savepoint, redeem, &[&req.coupon, &user.0]).await {
                Ok(_) => match savepoint.commit().await {
                    Ok(()) => true,
                    Err(error) => return (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()),
                },
                Err(sqlx::Error::Database(error)) if error.is_unique_violation() => {
                    if let Err(error) = savepoint.rollback().await {
                        return (StatusCode::INTERNAL_SERVER_ERROR, error.to_string());
                    }
                    false
                }
                Err(error) => return (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()),
            }
        }
        Err(error) => return (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()),
    };
    let flag = if discounted { "yes" } else { "no" };
    let insert = "INSERT INTO orders (id, owner, item, discounted) VALUES ($1, $2, $3, $4)";
    if let Err(error) = H::exec(&mut *tx, insert, &[&row_id(), &user.0, &req.item, flag]).await {
        return (StatusCode::INTERNAL_SERVER_ERROR, error.to_string());
    }
    (
        StatusCode::CREATED,
        format!(r#"{{"item":"{}","discounted":{discounted}}}"#, req.item),
    )
}

/// The app's own name for its transaction, as axum users alias theirs.
type BankTx<H> = Tx<<H as Harness>::DB>;

#[derive(Deserialize)]
pub struct Gift {
    to: String,
}

/// A helper taking the alias, as handlers pass their transaction on.
async fn note<H: Harness>(tx: &mut BankTx<H>, owner: &str, what: &str) -> Result<(), sqlx::Error> {
    let audit = "INSERT INTO audit (id, owner, what) VALUES ($1, $2, $3)";
    H::exec(&mut **tx, audit, &[&row_id(), owner, what])
        .await
        .map(drop)
}

/// POST /v1/receipts: an upload, read with axum's `Multipart`; one audit row per
/// execution naming each part (name, filename, size) in order.
#[idempotent(scope = "user", ttl = "1h", lock = "10s", required = true)]
async fn receipt<H: Harness>(
    Extension(user): Extension<User>,
    mut tx: Tx<H::DB>,
    mut form: Multipart,
) -> (StatusCode, String) {
    let mut parts = Vec::new();
    loop {
        match form.next_field().await {
            Ok(Some(field)) => {
                let name = field.name().unwrap_or_default().to_owned();
                let file = field.file_name().unwrap_or_default().to_owned();
                match field.bytes().await {
                    Ok(bytes) => parts.push(format!("{name}:{file}:{}", bytes.len())),
                    Err(error) => return (StatusCode::BAD_REQUEST, error.body_text()),
                }
            }
            Ok(None) => break,
            Err(error) => return (StatusCode::BAD_REQUEST, error.body_text()),
        }
    }
    let what = format!("receipt {}", parts.join(" "));
    match note::<H>(&mut tx, &user.0, &what[..what.len().min(255)]).await {
        Ok(()) => (
            StatusCode::CREATED,
            format!(r#"{{"parts":{}}}"#, parts.len()),
        ),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()),
    }
}

/// POST /v1/gifts: the transaction behind an alias (so the store's database is
/// named with `db`), the key taken as a plain extractor and relayed per user.
#[idempotent(scope = "user", db = H::DB, ttl = "1h", lock = "10s")]
async fn gift<H: Harness>(
    Extension(user): Extension<User>,
    key: IdempotencyKey,
    mut tx: BankTx<H>,
    Json(req): Json<Gift>,
) -> (StatusCode, String) {
    let what = format!("gift to {} ref {}", req.to, key.derive("gift"));
    match note::<H>(&mut tx, &user.0, &what).await {
        Ok(()) => (
            StatusCode::CREATED,
            format!(r#"{{"ref":"{}"}}"#, key.derive("gift")),
        ),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()),
    }
}

/// POST /v1/plain: a `Tx` in a handler that is not `#[idempotent]`.
async fn plain<H: Harness>(mut tx: Tx<H::DB>) -> StatusCode {
    let _ = note::<H>(&mut tx, "nobody", "plain").await;
    StatusCode::CREATED
}

/// POST /v1/counted: a transfer whose body goes through [`Counted`].
#[idempotent(scope = "user", ttl = "1h", lock = "10s", required = true)]
async fn counted<H: Harness>(
    Extension(user): Extension<User>,
    mut tx: Tx<H::DB>,
    Counted(req): Counted<NewTransfer>,
) -> (StatusCode, String) {
    let amount = req.amount.to_string();
    match note::<H>(&mut tx, &user.0, &format!("counted {amount}")).await {
        Ok(()) => (StatusCode::CREATED, format!("counted {amount}")),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()),
    }
}

/// POST /v1/scope-last: the scope is the last parameter, [`CountedUser`].
#[idempotent(scope = "user", ttl = "1h", lock = "10s", required = true)]
async fn scope_last<H: Harness>(mut tx: Tx<H::DB>, user: CountedUser) -> (StatusCode, String) {
    let CountedUser(User(name)) = user;
    match note::<H>(&mut tx, &name, "scope last").await {
        Ok(()) => (StatusCode::CREATED, format!("scope last for {name}")),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()),
    }
}

/// An extractor of the app's own that takes a `Tx` inside it.
pub struct Wrapped<H: Harness>(BankTx<H>);

impl<S: Send + Sync, H: Harness> FromRequestParts<S> for Wrapped<H> {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Response> {
        Ok(Self(Tx::from_request_parts(parts, state).await?))
    }
}

/// POST /v1/wrapped: its `Tx` sits inside another extractor.
#[idempotent(scope = "user", db = H::DB, ttl = "1h", lock = "10s")]
async fn wrapped<H: Harness>(Extension(user): Extension<User>, w: Wrapped<H>) -> StatusCode {
    let Wrapped(mut tx) = w;
    let _ = note::<H>(&mut tx, &user.0, "wrapped").await;
    StatusCode::CREATED
}

/// POST /v1/two: a second transaction, hidden from the attribute by an alias.
#[idempotent(scope = "user", ttl = "1h", lock = "10s")]
async fn two<H: Harness>(
    Extension(user): Extension<User>,
    mut tx: Tx<H::DB>,
    other: BankTx<H>,
) -> StatusCode {
    drop(other);
    let _ = note::<H>(&mut tx, &user.0, "two").await;
    StatusCode::CREATED
}

/// A middleware inside the router that rewrites every URI the handlers see, as
/// some apps do to strip tenant prefixes: the identity must not follow it.
async fn rewrite_uri(mut request: Request, next: Next) -> Response {
    *request.uri_mut() = Uri::from_static("/rewritten");
    next.run(request).await
}

pub type Service = BoxCloneSyncService<Request, Response, std::convert::Infallible>;

/// The whole app, behind `NormalizePath` (trailing slashes trimmed before routing).
pub fn app<H: Harness>(idempotency: Idempotency<H::DB>) -> Service {
    app_counting::<H>(idempotency).0
}

/// What [`app_counting`] counts.
pub struct Counts {
    /// Runs of the sign-up handler.
    pub sign_ups: Arc<AtomicUsize>,
    /// Runs of the counting extractors (`/v1/counted`, `/v1/scope-last`).
    pub extracted: Arc<AtomicUsize>,
    /// The provider's charges (`/v1/accounts/{acct}/charges`), by account.
    pub charged: Charges,
}

/// [`app`], and its counts.
pub fn app_counting<H: Harness>(idempotency: Idempotency<H::DB>) -> (Service, Counts) {
    let counts = Counts {
        sign_ups: Arc::new(AtomicUsize::new(0)),
        extracted: Arc::new(AtomicUsize::new(0)),
        charged: Charges::default(),
    };
    let state = Bank::<H> {
        idempotency,
        sign_ups: counts.sign_ups.clone(),
        extracted: counts.extracted.clone(),
        charged: counts.charged.clone(),
        _harness: PhantomData,
    };
    let accounts = Router::new().route("/transfers", post(transfer::<H>));
    let charges = Router::new().route("/accounts/{acct}/charges", post(charge::<H>));
    let v1 = Router::new()
        .nest("/accounts/{acct}", accounts.clone())
        .route("/orders", post(order::<H>))
        .route("/gifts", post(gift::<H>))
        .route("/plain", post(plain::<H>))
        .route("/wrapped", post(wrapped::<H>))
        .route("/two", post(two::<H>))
        .route("/counted", post(counted::<H>))
        .route("/scope-last", post(scope_last::<H>))
        .route("/receipts", post(receipt::<H>))
        .merge(Router::new().route("/users", post(sign_up::<H>)))
        .merge(charges);
    let v2 = Router::new().nest("/accounts/{acct}", accounts);
    // The same routes as a service of their own, mounted with `nest_service`.
    let legacy = Router::new()
        .route("/accounts/{acct}/transfers", post(transfer::<H>))
        .with_state(state.clone());
    let rewritten = Router::new()
        .route("/accounts/{acct}/transfers", post(transfer::<H>))
        .layer(middleware::from_fn(rewrite_uri));
    let router = Router::new()
        .nest("/v1", v1)
        .nest("/v2", v2)
        .nest("/internal", rewritten)
        .route_layer(middleware::from_fn(auth))
        .nest_service("/legacy", legacy.layer(middleware::from_fn(auth)))
        .with_state(state);
    let service = NormalizePathLayer::trim_trailing_slash().layer(router);
    (BoxCloneSyncService::new(service), counts)
}

/// Sends one request to the app; `Body` and headers as a client would.
pub fn request(path: &str, user: &str, key: &str, body: &str) -> Request {
    Request::builder()
        .method("POST")
        .uri(path)
        .header("authorization", format!("Bearer {user}"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .expect("valid request")
}
