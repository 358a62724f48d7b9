//! The handler's transaction: a connection with an open transaction, lent to the
//! handler by the engine and handed back when the handler drops it.

use std::fmt;
use std::ops::{Deref, DerefMut};

use sqlx::pool::PoolConnection;
use sqlx::{Database, Transaction};
use sqlx_core::transaction::TransactionManager as _;
use tokio::sync::oneshot;

/// The transaction a handler writes through; the response is recorded in it.
///
/// It dereferences to the backend's connection, so it is used like a
/// [`sqlx::Transaction`]: `query.execute(&mut *tx)`. Do not commit or roll back
/// through it: idem commits the handler's writes together with the recorded response
/// when the handler answers below 500, and rolls both back otherwise.
///
/// It owns its connection and names no lifetime, so helpers and aliases spell it the
/// way handlers do. With the `executor` feature (on by default) `&mut Tx<DB>` is
/// itself an sqlx executor: a helper that takes `tx: &mut Tx<DB>` writes
/// `.execute(tx)` or `.execute(&mut *tx)`, and a handler passes it `&mut tx`, as it
/// does to a helper that takes any executor (`impl PgExecutor<'_>`). Without the
/// feature, `&mut **tx` reaches the connection, and a helper may take the connection
/// itself (`&mut PgConnection`). An alias (`type PgTx = Tx<Postgres>`) hides the database from `#[idempotent]`, which
/// reads it from a parameter written `Tx<DB>`: a handler that takes the alias names
/// it, `#[idempotent(db = Postgres, …)]` (the compile error says so). It is an axum extractor, valid only as a parameter of an
/// `#[idempotent]` handler, which hands it the transaction once the key is claimed;
/// anywhere else, extracting it answers 500 `handler-failed`. It belongs to the
/// handler: when the handler ends, the engine takes the connection back to record
/// the response. A `Tx` moved somewhere that outlives the handler (a spawned task)
/// is a bug the engine catches: the request is answered 500 `handler-failed`, its
/// writes are rolled back and nothing is recorded.
///
/// # Examples
///
/// ```rust,no_run
/// # extern crate idem_runtime as idem_axum;
/// use idem_axum::Tx;
/// use sqlx::Postgres;
///
/// type PgTx = Tx<Postgres>;
///
/// // With the `executor` feature (on by default).
/// # #[cfg(feature = "executor")]
/// async fn debit(tx: &mut PgTx, user: &str, amount: i64) -> Result<(), sqlx::Error> {
///     sqlx::query("UPDATE accounts SET balance = balance - $1 WHERE id = $2")
///         .bind(amount)
///         .bind(user)
///         .execute(tx)
///         .await?;
///     Ok(())
/// }
///
/// // Without it, through the connection.
/// async fn credit(tx: &mut PgTx, user: &str, amount: i64) -> Result<(), sqlx::Error> {
///     sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
///         .bind(amount)
///         .bind(user)
///         .execute(&mut **tx)
///         .await?;
///     Ok(())
/// }
/// ```
pub struct Tx<DB: Database> {
    lent: Option<Lent<DB>>,
}

/// The connection and the way home.
struct Lent<DB: Database> {
    open: Open<DB>,
    home: oneshot::Sender<Open<DB>>,
}

impl<DB: Database> Tx<DB> {
    /// Lends `open` until the returned receiver gets it back.
    pub(crate) fn lend(open: Open<DB>) -> (Self, oneshot::Receiver<Open<DB>>) {
        let (home, back) = oneshot::channel();
        let tx = Self {
            lent: Some(Lent { open, home }),
        };
        (tx, back)
    }

    /// A `Tx` extracted for a handler, waiting for the transaction the engine
    /// opens once the key is claimed.
    #[cfg(feature = "axum")]
    pub(crate) fn waiting() -> Self {
        Self { lent: None }
    }

    /// Takes over the transaction `from` holds; `false` if it holds none.
    #[cfg(feature = "axum")]
    pub(crate) fn take_from(&mut self, from: &mut Self) -> bool {
        match from.lent.take() {
            Some(lent) => {
                self.lent = Some(lent);
                true
            }
            None => false,
        }
    }

    // A handler's body runs only once its `Tx` holds the transaction (the
    // generated code answers 500 before the body otherwise), and `lent` is taken
    // only when the `Tx` is dropped: without one, there is no connection to give.
    fn open(&self) -> &Open<DB> {
        match &self.lent {
            Some(lent) => &lent.open,
            None => unreachable!("a Tx is used without its transaction"),
        }
    }

    /// Whether statements may be prepared on the transaction's connection.
    #[cfg(feature = "sea-orm")]
    pub(crate) fn statements_prepared(&self) -> bool {
        self.open().prepared
    }

    fn open_mut(&mut self) -> &mut Open<DB> {
        match &mut self.lent {
            Some(lent) => &mut lent.open,
            None => unreachable!("a Tx is used without its transaction"),
        }
    }
}

impl<DB: Database> Drop for Tx<DB> {
    fn drop(&mut self) {
        if let Some(Lent { open, home }) = self.lent.take() {
            // The engine stopped waiting: the transaction is dropped, which closes
            // its connection.
            let _ = home.send(open);
        }
    }
}

impl<DB: Database> Deref for Tx<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &Self::Target {
        self.open()
    }
}

impl<DB: Database> DerefMut for Tx<DB> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.open_mut()
    }
}

impl<DB: Database> fmt::Debug for Tx<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tx").field("backend", &DB::NAME).finish()
    }
}

/// `&mut Tx<DB>` as an executor, so that a helper taking `tx: &mut Tx<DB>` passes
/// `tx` to sqlx as a handler passes `&mut tx`. Written per backend: a blanket impl
/// over `DB` sends trait resolution in circles. Every required method hands over to
/// the connection's own executor.
#[cfg(all(
    feature = "executor",
    any(feature = "mysql", feature = "postgres", feature = "sqlite")
))]
macro_rules! executor_for_tx {
    ($db:ty) => {
        const _: () = {
            use futures_util::future::BoxFuture;
            use futures_util::stream::BoxStream;
            use sqlx::{Database, Either, Execute};
            use sqlx_core::{describe::Describe, sql_str::SqlStr};

            impl<'c> sqlx::Executor<'c> for &'c mut Tx<$db> {
                type Database = $db;

                fn fetch_many<'e, 'q: 'e, E>(
                    self,
                    query: E,
                ) -> BoxStream<
                    'e,
                    Result<
                        Either<<$db as Database>::QueryResult, <$db as Database>::Row>,
                        sqlx::Error,
                    >,
                >
                where
                    'c: 'e,
                    E: 'q + Execute<'q, $db>,
                {
                    sqlx::Executor::fetch_many(&mut **self, query)
                }

                fn fetch_optional<'e, 'q: 'e, E>(
                    self,
                    query: E,
                ) -> BoxFuture<'e, Result<Option<<$db as Database>::Row>, sqlx::Error>>
                where
                    'c: 'e,
                    E: 'q + Execute<'q, $db>,
                {
                    sqlx::Executor::fetch_optional(&mut **self, query)
                }

                fn prepare_with<'e>(
                    self,
                    sql: SqlStr,
                    parameters: &'e [<$db as Database>::TypeInfo],
                ) -> BoxFuture<'e, Result<<$db as Database>::Statement, sqlx::Error>>
                where
                    'c: 'e,
                {
                    sqlx::Executor::prepare_with(&mut **self, sql, parameters)
                }

                fn describe<'e>(
                    self,
                    sql: SqlStr,
                ) -> BoxFuture<'e, Result<Describe<$db>, sqlx::Error>>
                where
                    'c: 'e,
                {
                    sqlx::Executor::describe(&mut **self, sql)
                }
            }
        };
    };
}

#[cfg(all(feature = "executor", feature = "mysql"))]
executor_for_tx!(sqlx::MySql);
#[cfg(all(feature = "executor", feature = "postgres"))]
executor_for_tx!(sqlx::Postgres);
#[cfg(all(feature = "executor", feature = "sqlite"))]
executor_for_tx!(sqlx::Sqlite);

/// A pooled connection inside a transaction the engine opened, owned so that it can
/// be lent to the handler. Dropped without [`commit`](Self::commit) or
/// [`rollback`](Self::rollback), it closes the connection: the server rolls back
/// and frees whatever the session held (MySQL's named locks).
pub(crate) struct Open<DB: Database> {
    conn: Option<PoolConnection<DB>>,
    /// Whether statements may be prepared on it: not through a transaction
    /// pooler, whose server connections do not keep them. Read by
    /// `Tx::sea_orm` (`sea.rs`).
    #[cfg_attr(not(feature = "sea-orm"), allow(dead_code))]
    prepared: bool,
}

impl<DB: Database> Open<DB> {
    /// Takes over `tx`, a transaction a backend began on `conn`. sqlx's guard
    /// would roll back when dropped; from here on this one ends the transaction, so
    /// the guard is forgotten (it holds only a borrow of `conn`).
    pub(crate) fn adopt(tx: Transaction<'_, DB>) -> Adopted {
        std::mem::forget(tx);
        Adopted { lock_from: None }
    }

    /// The connection `adopt` left inside its transaction; `prepared`, whether
    /// statements may be prepared on it.
    pub(crate) fn new(conn: PoolConnection<DB>, _adopted: Adopted, prepared: bool) -> Self {
        Self {
            conn: Some(conn),
            prepared,
        }
    }

    fn conn(&mut self) -> &mut PoolConnection<DB> {
        match &mut self.conn {
            Some(conn) => conn,
            None => unreachable!("an Open is used after it ended"),
        }
    }

    /// Commits; the connection comes back either way, to be finished or closed.
    pub(crate) async fn commit(mut self) -> (PoolConnection<DB>, Result<(), sqlx::Error>) {
        let result = DB::TransactionManager::commit(self.conn()).await;
        (self.release(), result)
    }

    /// Rolls back; `false` when that failed and the connection is suspect.
    pub(crate) async fn rollback(mut self) -> (PoolConnection<DB>, bool) {
        let clean = match DB::TransactionManager::rollback(self.conn()).await {
            Ok(()) => true,
            Err(error) => {
                tracing::warn!(%error, "rollback failed");
                false
            }
        };
        (self.release(), clean)
    }

    /// The connection, still inside the transaction a backend's own commit ends
    /// (see `Backend::idem_commit`).
    pub(crate) fn into_conn(self) -> PoolConnection<DB> {
        self.release()
    }

    fn release(mut self) -> PoolConnection<DB> {
        match self.conn.take() {
            Some(conn) => conn,
            None => unreachable!("an Open is ended twice"),
        }
    }
}

/// Proof that a transaction was handed to [`Open`]: sqlx counts it open on the
/// connection, and its guard is gone.
pub struct Adopted {
    lock_from: Option<std::time::Instant>,
}

impl Adopted {
    /// Says from when the claim's lock runs, on this process's clock, where the
    /// backend knows it better than the engine (it sent its claim again, or held
    /// it before the handler's transaction began).
    #[cfg(any(feature = "mysql", feature = "sqlite"))]
    pub(crate) fn lock_from(self, at: std::time::Instant) -> Self {
        Self {
            lock_from: Some(at),
        }
    }

    /// From when the claim's lock runs, if the backend said.
    pub(crate) fn lock_runs_from(&self) -> Option<std::time::Instant> {
        self.lock_from
    }
}

impl<DB: Database> Deref for Open<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &Self::Target {
        match &self.conn {
            Some(conn) => conn,
            None => unreachable!("an Open is used after it ended"),
        }
    }
}

impl<DB: Database> DerefMut for Open<DB> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.conn()
    }
}

impl<DB: Database> Drop for Open<DB> {
    fn drop(&mut self) {
        if let Some(conn) = &mut self.conn {
            conn.close_on_drop();
        }
    }
}
