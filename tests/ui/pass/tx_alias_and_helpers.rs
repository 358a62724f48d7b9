//! `Tx<DB>` is one spelling everywhere: an alias of it as a parameter (the store's
//! database then named with `db`), and helpers that take `&mut Tx<DB>`, the alias or
//! any executor, and hand it to sqlx in every form a handler would.

use axum::extract::{FromRef, FromRequestParts};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem_axum::{idempotent, Idempotency, IdempotencyKey, Tx};
use serde::Deserialize;
use sqlx::{PgExecutor, Postgres};

type PgTx = Tx<Postgres>;

struct User(String);

impl<S: Send + Sync> FromRequestParts<S> for User {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        let user = parts.headers.get("x-user").and_then(|v| v.to_str().ok());
        user.map(|u| User(u.to_owned())).ok_or(StatusCode::UNAUTHORIZED)
    }
}

impl idem_axum::Scope for User {
    fn scope(&self) -> std::borrow::Cow<'_, str> {
        self.0.as_str().into()
    }
}

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Idempotency<Postgres>,
}

#[derive(Deserialize)]
struct Transfer {
    amount: i64,
}

async fn debit(tx: &mut PgTx, user: &str, amount: i64) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE accounts SET balance = balance - $1 WHERE id = $2")
        .bind(amount)
        .bind(user)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

async fn audit(tx: &mut Tx<Postgres>, reference: &str) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO audit (reference) VALUES ($1)")
        .bind(reference)
        .execute(tx)
        .await?;
    Ok(())
}

async fn balance(db: impl PgExecutor<'_>, user: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT balance FROM accounts WHERE id = $1")
        .bind(user)
        .fetch_one(db)
        .await
}

async fn owner_of(tx: &mut PgTx, account: &str) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT owner FROM accounts WHERE id = $1")
        .bind(account)
        .fetch_optional(&mut **tx)
        .await
}

#[idempotent(scope = "user", db = Postgres)]
async fn transfer(
    user: User,
    key: IdempotencyKey,
    mut tx: PgTx,
    Json(t): Json<Transfer>,
) -> Result<StatusCode, StatusCode> {
    let failed = |_| StatusCode::SERVICE_UNAVAILABLE;
    owner_of(&mut tx, &user.0).await.map_err(failed)?;
    if balance(&mut tx, &user.0).await.map_err(failed)? < t.amount {
        return Err(StatusCode::UNPROCESSABLE_ENTITY);
    }
    debit(&mut tx, &user.0, t.amount).await.map_err(failed)?;
    audit(&mut tx, &key.derive("audit")).await.map_err(failed)?;
    Ok(StatusCode::CREATED)
}

fn main() {
    let _app = |state: AppState| -> Router {
        Router::new().route("/transfers", post(transfer)).with_state(state)
    };
}
