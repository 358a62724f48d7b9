//! The fake card provider, and the example's SQL: once for PostgreSQL and SQLite
//! (SQLite reads `$1` as the first parameter too), and again for MySQL, which has
//! `?`, no `RETURNING` and no `ON CONFLICT`.

use std::future::Future;
use std::time::Duration;

use idem_axum::{Backend, Builder};
#[cfg(feature = "mysql")]
use sqlx::{MySql, MySqlConnection};
#[cfg(feature = "postgres")]
use sqlx::{PgConnection, Postgres};
use sqlx::{Pool, Row};
#[cfg(feature = "sqlite")]
use sqlx::{Sqlite, SqliteConnection};

use crate::errors::ApiError;
use crate::{Charge, NewPayment, OPENING_BALANCE, Payment};

pub(crate) struct Provider<DB: Backend> {
    pub(crate) pool: Pool<DB>,
    pub(crate) latency: Duration,
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
    pub(crate) async fn charge(
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

    /// Cancels the charge made under `key`, if any.
    pub(crate) async fn void(&self, key: &str) -> Result<(), ApiError> {
        DB::void(&self.pool, key).await.map_err(|error| {
            eprintln!("payments: provider error: {error}");
            ApiError::Provider
        })
    }
}

/// The store's settings for one backend.
pub(crate) trait Settings: Backend {
    fn settings(builder: Builder<Self>) -> Builder<Self> {
        builder
    }
}

#[cfg(feature = "postgres")]
impl Settings for Postgres {}

#[cfg(feature = "mysql")]
impl Settings for MySql {}

/// SQLite has one write lock: taken at a handler's first write rather than before
/// it runs, the provider's answer is awaited without it (see `create_payment`).
#[cfg(feature = "sqlite")]
impl Settings for Sqlite {
    fn settings(builder: Builder<Self>) -> Builder<Self> {
        builder.write_lock_at_first_write()
    }
}

// ---------------------------------------------------------------------------------
// SQL, once for PostgreSQL and SQLite (SQLite reads `$1` as the first parameter
// too), and again for MySQL, which has `?`, no `RETURNING` and no `ON CONFLICT`

/// The example's queries, implemented for PostgreSQL and SQLite.
pub(crate) trait Ledger: Settings {
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
    /// The balance as last committed (the opening balance for a new account).
    fn balance(
        pool: &Pool<Self>,
        user: &str,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send;
    fn charge(
        pool: &Pool<Self>,
        user: &str,
        amount: i64,
        currency: &str,
        key: &str,
    ) -> impl Future<Output = Result<String, sqlx::Error>> + Send;
    fn charges(pool: &Pool<Self>) -> impl Future<Output = Result<Vec<Charge>, sqlx::Error>> + Send;
    fn void(pool: &Pool<Self>, key: &str) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
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
                Ok((payments, Self::balance(pool, user).await?))
            }

            async fn balance(pool: &Pool<Self>, user: &str) -> Result<i64, sqlx::Error> {
                let balance: Option<i64> = sqlx::query_scalar("SELECT balance FROM accounts WHERE user_id = $1")
                    .bind(user)
                    .fetch_optional(pool)
                    .await?;
                Ok(balance.unwrap_or(OPENING_BALANCE))
            }

            async fn void(pool: &Pool<Self>, key: &str) -> Result<(), sqlx::Error> {
                sqlx::query("DELETE FROM provider_charges WHERE idempotency_key = $1")
                    .bind(key)
                    .execute(pool)
                    .await?;
                Ok(())
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
        Ok((payments, Self::balance(pool, user).await?))
    }

    async fn balance(pool: &Pool<Self>, user: &str) -> Result<i64, sqlx::Error> {
        let balance: Option<i64> =
            sqlx::query_scalar("SELECT balance FROM accounts WHERE user_id = ?")
                .bind(user)
                .fetch_optional(pool)
                .await?;
        Ok(balance.unwrap_or(OPENING_BALANCE))
    }

    async fn void(pool: &Pool<Self>, key: &str) -> Result<(), sqlx::Error> {
        sqlx::query("DELETE FROM provider_charges WHERE idempotency_key = ?")
            .bind(key)
            .execute(pool)
            .await?;
        Ok(())
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
