//! SeaORM on the handler's transaction (feature `sea-orm`): [`Tx::sea_orm`] lends
//! the transaction to SeaORM as a connection, so that entities, active models and
//! raw statements commit with the recorded response or roll back with it.
//!
//! SeaORM has no public way to wrap a connection it did not open, so this is a
//! connection of its own: SeaORM's statements are bound by the binder SeaORM
//! uses (`sea-query-sqlx`), run on the transaction's connection, and their rows
//! and results go back through SeaORM's own conversions from sqlx's, so columns
//! read as SeaORM reads them on a pool. `begin` opens a savepoint, as sqlx's
//! `Transaction::begin` does on a connection already in a transaction; nothing
//! here commits or rolls back idem's own transaction.

use std::sync::{Arc, Mutex as StdMutex, PoisonError};

use futures_util::future::BoxFuture;
use sea_orm::{
    AccessMode, ConnectionTrait, DbBackend, DbErr, ExecResult, IsolationLevel, QueryResult,
    RuntimeErr, Statement, TransactionError, TransactionOptions, TransactionSession,
    TransactionTrait,
};
use sqlx::Database;
use sqlx_core::transaction::TransactionManager as _;
use tokio::sync::Mutex;

use crate::Tx;

/// The databases SeaORM runs on through idem: what differs between them is
/// only the types sqlx returns, which SeaORM converts itself.
pub trait SeaDriver: Database + sealed::Sealed {
    #[doc(hidden)]
    const BACKEND: DbBackend;

    #[doc(hidden)]
    fn execute<'c>(
        conn: &'c mut Self::Connection,
        statement: &'c Statement,
        prepared: bool,
    ) -> BoxFuture<'c, Result<ExecResult, sqlx::Error>>;

    #[doc(hidden)]
    fn execute_unprepared<'c>(
        conn: &'c mut Self::Connection,
        sql: &'c str,
    ) -> BoxFuture<'c, Result<ExecResult, sqlx::Error>>;

    #[doc(hidden)]
    fn query_one<'c>(
        conn: &'c mut Self::Connection,
        statement: &'c Statement,
        prepared: bool,
    ) -> BoxFuture<'c, Result<Option<QueryResult>, sqlx::Error>>;

    #[doc(hidden)]
    fn query_all<'c>(
        conn: &'c mut Self::Connection,
        statement: &'c Statement,
        prepared: bool,
    ) -> BoxFuture<'c, Result<Vec<QueryResult>, sqlx::Error>>;
}

mod sealed {
    pub trait Sealed {}
}

macro_rules! driver {
    ($feature:literal, $db:ty, $backend:expr) => {
        #[cfg(feature = $feature)]
        impl sealed::Sealed for $db {}

        #[cfg(feature = $feature)]
        impl SeaDriver for $db {
            const BACKEND: DbBackend = $backend;

            fn execute<'c>(
                conn: &'c mut Self::Connection,
                statement: &'c Statement,
                prepared: bool,
            ) -> BoxFuture<'c, Result<ExecResult, sqlx::Error>> {
                Box::pin(async move { Ok(bound(statement, prepared).execute(conn).await?.into()) })
            }

            fn execute_unprepared<'c>(
                conn: &'c mut Self::Connection,
                sql: &'c str,
            ) -> BoxFuture<'c, Result<ExecResult, sqlx::Error>> {
                Box::pin(async move {
                    Ok(sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                        .execute(conn)
                        .await?
                        .into())
                })
            }

            fn query_one<'c>(
                conn: &'c mut Self::Connection,
                statement: &'c Statement,
                prepared: bool,
            ) -> BoxFuture<'c, Result<Option<QueryResult>, sqlx::Error>> {
                Box::pin(async move {
                    Ok(bound(statement, prepared)
                        .fetch_optional(conn)
                        .await?
                        .map(QueryResult::from))
                })
            }

            fn query_all<'c>(
                conn: &'c mut Self::Connection,
                statement: &'c Statement,
                prepared: bool,
            ) -> BoxFuture<'c, Result<Vec<QueryResult>, sqlx::Error>> {
                Box::pin(async move {
                    let rows = bound(statement, prepared).fetch_all(conn).await?;
                    Ok(rows.into_iter().map(QueryResult::from).collect())
                })
            }
        }
    };
}

driver!("postgres", sqlx::Postgres, DbBackend::Postgres);
driver!("mysql", sqlx::MySql, DbBackend::MySql);
driver!("sqlite", sqlx::Sqlite, DbBackend::Sqlite);

/// `statement` with its values bound, as SeaORM binds them on a pool; prepared
/// unless the store goes through a transaction pooler.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
fn bound<DB>(
    statement: &Statement,
    prepared: bool,
) -> sqlx::query::Query<'_, DB, sea_query_sqlx::SqlxValues>
where
    DB: Database + sqlx_core::database::HasStatementCache,
    sea_query_sqlx::SqlxValues: sqlx::IntoArguments<DB>,
{
    let values = statement
        .values
        .clone()
        .unwrap_or_else(|| sea_orm::Values(Vec::new()));
    sqlx::query_with(
        sqlx::AssertSqlSafe(statement.sql.as_str()),
        sea_query_sqlx::SqlxValues(values),
    )
    .persistent(prepared)
}

impl<DB: SeaDriver> Tx<DB> {
    /// The transaction as a SeaORM connection: entities, active models and raw
    /// statements run through it commit with the recorded response, or roll back
    /// with it (feature `sea-orm`).
    ///
    /// SeaORM's `begin` on it opens a savepoint inside idem's transaction, whose
    /// `commit` and `rollback` act on that savepoint alone; a savepoint dropped
    /// without either is rolled back, as SeaORM's own transactions are. Nothing
    /// reached from here commits idem's transaction. The connection borrows the
    /// `Tx`: drop it (or let it go out of scope) to use the `Tx` with sqlx again.
    ///
    /// # Examples
    ///
    /// ```rust,no_run
    /// # extern crate idem_runtime as idem_axum;
    /// # #[cfg(feature = "postgres")]
    /// # mod example {
    /// use idem_axum::Tx;
    /// use sea_orm::{ConnectionTrait, DbErr, Statement, TransactionSession, TransactionTrait};
    /// use sqlx::Postgres;
    ///
    /// async fn transfer(mut tx: Tx<Postgres>) -> Result<(), DbErr> {
    ///     let db = tx.sea_orm();
    ///     let debit = Statement::from_sql_and_values(
    ///         db.get_database_backend(),
    ///         "UPDATE accounts SET balance = balance - $1 WHERE id = $2",
    ///         [100.into(), "alice".into()],
    ///     );
    ///     db.execute_raw(debit).await?;
    ///     // A savepoint: rolled back alone, the debit above stays.
    ///     let fee = db.begin().await?;
    ///     fee.execute_unprepared("INSERT INTO fees (amount) VALUES (1)").await?;
    ///     fee.rollback().await?;
    ///     Ok(())
    /// }
    /// # }
    /// ```
    pub fn sea_orm(&mut self) -> SeaConnection<'_, DB> {
        let prepared = self.statements_prepared();
        SeaConnection {
            shared: Arc::new(Shared {
                prepared,
                conn: Mutex::new(&mut **self),
                levels: StdMutex::new(Levels::default()),
            }),
        }
    }
}

/// The handler's transaction as a SeaORM connection, from [`Tx::sea_orm`]. It
/// implements SeaORM's `ConnectionTrait` (every `.exec(db)`, `.one(db)`,
/// `.all(db)`) and `TransactionTrait`, whose transactions are savepoints
/// ([`SeaSavepoint`]); it has no `commit`.
pub struct SeaConnection<'t, DB: SeaDriver> {
    shared: Arc<Shared<'t, DB>>,
}

/// A savepoint inside idem's transaction, opened by SeaORM's `begin` on a
/// [`SeaConnection`] (or on another savepoint). `commit` releases it, `rollback`
/// rolls back to it; dropped with neither, it is rolled back.
pub struct SeaSavepoint<'t, DB: SeaDriver> {
    shared: Arc<Shared<'t, DB>>,
    /// Its place among the savepoints opened here: 1 for the outermost.
    level: usize,
    open: bool,
}

struct Shared<'t, DB: SeaDriver> {
    conn: Mutex<&'t mut DB::Connection>,
    /// Whether statements are prepared (see `bound`).
    prepared: bool,
    levels: StdMutex<Levels>,
}

/// The savepoints opened here, counted as they will be once what was queued on
/// the connection has run: sqlx's own count lags behind on SQLite, whose
/// rollbacks queued from `drop` run later on its worker thread.
#[derive(Default)]
struct Levels {
    open: usize,
    /// Levels dropped open while the connection was busy: rolled back before the
    /// connection's next statement, or when the last handle goes.
    abandoned: Vec<usize>,
}

impl Levels {
    /// Queues the rollback of every savepoint from `level` in: sent before the
    /// connection's next statement, whoever sends it (idem's record included).
    fn roll_back_to<DB: SeaDriver>(&mut self, conn: &mut DB::Connection, level: usize) {
        while self.open >= level.max(1) {
            <DB::TransactionManager>::start_rollback(conn);
            self.open -= 1;
        }
    }

    fn roll_back_abandoned<DB: SeaDriver>(&mut self, conn: &mut DB::Connection) {
        if let Some(outermost) = std::mem::take(&mut self.abandoned).into_iter().min() {
            self.roll_back_to::<DB>(conn, outermost);
        }
    }
}

impl<'t, DB: SeaDriver> Shared<'t, DB> {
    fn levels(&self) -> std::sync::MutexGuard<'_, Levels> {
        self.levels.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The connection, with every abandoned savepoint rolled back first.
    async fn conn(&self) -> tokio::sync::MutexGuard<'_, &'t mut DB::Connection> {
        let mut conn = self.conn.lock().await;
        self.levels().roll_back_abandoned::<DB>(&mut conn);
        conn
    }

    async fn begin(self: &Arc<Self>) -> Result<SeaSavepoint<'t, DB>, DbErr> {
        let mut conn = self.conn().await;
        // Outside a transaction sqlx would send `BEGIN`, which MySQL answers by
        // committing whatever is open: a savepoint or nothing.
        if <DB::TransactionManager>::get_transaction_depth(&conn) == 0 {
            return Err(DbErr::Custom(
                "the handler's transaction has ended: no savepoint can be opened".to_owned(),
            ));
        }
        <DB::TransactionManager>::begin(&mut conn, None)
            .await
            .map_err(exec_error)?;
        let mut levels = self.levels();
        levels.open += 1;
        Ok(SeaSavepoint {
            shared: Arc::clone(self),
            level: levels.open,
            open: true,
        })
    }
}

impl<DB: SeaDriver> Drop for Shared<'_, DB> {
    fn drop(&mut self) {
        let levels = self
            .levels
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        levels.roll_back_abandoned::<DB>(self.conn.get_mut());
    }
}

impl<DB: SeaDriver> Drop for SeaSavepoint<'_, DB> {
    fn drop(&mut self) {
        if !self.open {
            return;
        }
        let mut levels = self.shared.levels();
        match self.shared.conn.try_lock() {
            Ok(mut conn) => levels.roll_back_to::<DB>(&mut conn, self.level),
            Err(_) => levels.abandoned.push(self.level),
        }
    }
}

impl<DB: SeaDriver> SeaSavepoint<'_, DB> {
    /// Ends this savepoint: `commit` releases it, otherwise it is rolled back to.
    /// Savepoints opened inside it and still open are rolled back first.
    async fn end(mut self, commit: bool) -> Result<(), DbErr> {
        // Until the savepoint's own statement goes, dropping this future (a
        // handler's timeout) leaves `self` open: `drop` rolls it back.
        let mut conn = self.shared.conn().await;
        {
            let mut levels = self.shared.levels();
            if levels.open < self.level {
                self.open = false;
                return Err(DbErr::Custom(
                    "this SeaORM transaction was already rolled back with one it is nested in"
                        .to_owned(),
                ));
            }
            levels.roll_back_to::<DB>(&mut conn, self.level + 1);
            levels.open -= 1;
        }
        self.open = false;
        let ended = if commit {
            <DB::TransactionManager>::commit(&mut conn).await
        } else {
            <DB::TransactionManager>::rollback(&mut conn).await
        };
        ended.map_err(exec_error)
    }
}

fn exec_error(error: sqlx::Error) -> DbErr {
    DbErr::Exec(RuntimeErr::SqlxError(Arc::new(error)))
}

fn query_error(error: sqlx::Error) -> DbErr {
    DbErr::Query(RuntimeErr::SqlxError(Arc::new(error)))
}

/// A savepoint cannot change what its transaction was begun with.
fn plain(
    isolation_level: Option<IsolationLevel>,
    access_mode: Option<AccessMode>,
) -> Result<(), DbErr> {
    if isolation_level.is_some() || access_mode.is_some() {
        return Err(DbErr::Custom(
            "inside idem's transaction, SeaORM's `begin` opens a savepoint, which keeps the \
             transaction's isolation level and access mode: begin it without them"
                .to_owned(),
        ));
    }
    Ok(())
}

macro_rules! connection {
    ($ty:ident) => {
        #[async_trait::async_trait]
        impl<DB: SeaDriver> ConnectionTrait for $ty<'_, DB> {
            fn get_database_backend(&self) -> DbBackend {
                DB::BACKEND
            }

            async fn execute_raw(&self, statement: Statement) -> Result<ExecResult, DbErr> {
                let mut conn = self.shared.conn().await;
                DB::execute(&mut conn, &statement, self.shared.prepared)
                    .await
                    .map_err(exec_error)
            }

            async fn execute_unprepared(&self, sql: &str) -> Result<ExecResult, DbErr> {
                let mut conn = self.shared.conn().await;
                DB::execute_unprepared(&mut conn, sql)
                    .await
                    .map_err(exec_error)
            }

            async fn query_one_raw(
                &self,
                statement: Statement,
            ) -> Result<Option<QueryResult>, DbErr> {
                let mut conn = self.shared.conn().await;
                DB::query_one(&mut conn, &statement, self.shared.prepared)
                    .await
                    .map_err(query_error)
            }

            async fn query_all_raw(&self, statement: Statement) -> Result<Vec<QueryResult>, DbErr> {
                let mut conn = self.shared.conn().await;
                DB::query_all(&mut conn, &statement, self.shared.prepared)
                    .await
                    .map_err(query_error)
            }
        }

        #[async_trait::async_trait]
        impl<'t, DB: SeaDriver> TransactionTrait for $ty<'t, DB> {
            type Transaction = SeaSavepoint<'t, DB>;

            async fn begin(&self) -> Result<Self::Transaction, DbErr> {
                self.shared.begin().await
            }

            async fn begin_with_config(
                &self,
                isolation_level: Option<IsolationLevel>,
                access_mode: Option<AccessMode>,
            ) -> Result<Self::Transaction, DbErr> {
                plain(isolation_level, access_mode)?;
                self.begin().await
            }

            async fn begin_with_options(
                &self,
                options: TransactionOptions,
            ) -> Result<Self::Transaction, DbErr> {
                plain(options.isolation_level, options.access_mode)?;
                self.begin().await
            }

            async fn transaction<F, T, E>(&self, callback: F) -> Result<T, TransactionError<E>>
            where
                F: for<'c> FnOnce(
                        &'c Self::Transaction,
                    ) -> std::pin::Pin<
                        Box<dyn std::future::Future<Output = Result<T, E>> + Send + 'c>,
                    > + Send,
                T: Send,
                E: std::fmt::Display + std::fmt::Debug + Send,
            {
                let savepoint = self.begin().await.map_err(TransactionError::Connection)?;
                match callback(&savepoint).await {
                    Ok(value) => {
                        savepoint
                            .commit()
                            .await
                            .map_err(TransactionError::Connection)?;
                        Ok(value)
                    }
                    Err(error) => {
                        savepoint
                            .rollback()
                            .await
                            .map_err(TransactionError::Connection)?;
                        Err(TransactionError::Transaction(error))
                    }
                }
            }

            async fn transaction_with_config<F, T, E>(
                &self,
                callback: F,
                isolation_level: Option<IsolationLevel>,
                access_mode: Option<AccessMode>,
            ) -> Result<T, TransactionError<E>>
            where
                F: for<'c> FnOnce(
                        &'c Self::Transaction,
                    ) -> std::pin::Pin<
                        Box<dyn std::future::Future<Output = Result<T, E>> + Send + 'c>,
                    > + Send,
                T: Send,
                E: std::fmt::Display + std::fmt::Debug + Send,
            {
                plain(isolation_level, access_mode).map_err(TransactionError::Connection)?;
                self.transaction(callback).await
            }
        }
    };
}

connection!(SeaConnection);
connection!(SeaSavepoint);

#[async_trait::async_trait]
impl<DB: SeaDriver> TransactionSession for SeaSavepoint<'_, DB> {
    async fn commit(self) -> Result<(), DbErr> {
        self.end(true).await
    }

    async fn rollback(self) -> Result<(), DbErr> {
        self.end(false).await
    }
}

impl<DB: SeaDriver> std::fmt::Debug for SeaConnection<'_, DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeaConnection")
            .field("backend", &DB::BACKEND)
            .finish_non_exhaustive()
    }
}

impl<DB: SeaDriver> std::fmt::Debug for SeaSavepoint<'_, DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeaSavepoint")
            .field("backend", &DB::BACKEND)
            .field("level", &self.level)
            .finish_non_exhaustive()
    }
}
