//! One fresh database per test, on each backend, and the SQL the suite needs there.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use idem_axum::{Backend, Builder, Idempotency, Tx};
use sqlx::Connection;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What one stored key row holds, read back raw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRow {
    pub state: String,
    pub method: String,
    pub path: String,
    pub fingerprint: Vec<u8>,
    pub status: Option<i32>,
    pub headers: Option<Vec<u8>>,
    pub body: Option<Vec<u8>>,
}

/// A change a handler makes to its session inside its transaction.
#[derive(Debug, Clone)]
pub struct SessionChange {
    pub name: String,
    /// In order; `session::EFFECT` marks where the handler writes its effect
    /// (last when absent), `{scope}` stands for the request's scope.
    pub statements: Vec<String>,
    /// Deletes, on the store's session, what idem would have written where the
    /// change pointed it (a table of idem's name elsewhere): it must delete nothing.
    pub shadow: Option<String>,
}

/// A backend under test: a private database, the business table `effects`, and
/// read-backs of what the database holds.
pub trait Harness: Send + Sync + Sized + 'static {
    type DB: Backend;

    /// SQLite's single writer: a stalled executor's open transaction holds the
    /// write lock, so a takeover can only happen once it wakes and rolls back.
    const STALLED_WRITER_BLOCKS_TAKEOVER: bool = false;

    /// PostgreSQL: a failed statement aborts the whole transaction, so a handler
    /// that catches the error keeps none of its writes; elsewhere only the failed
    /// statement is undone.
    const ERROR_VOIDS_TRANSACTION: bool = false;

    /// Whether a claim can be read (`Idempotency::claims`) before its transaction
    /// commits: SQLite's is a committed row, MySQL's is read uncommitted;
    /// PostgreSQL has no such read.
    const CLAIMS_READABLE_IN_FLIGHT: bool = true;

    /// Whether a sweep can run while a handler's transaction is open: SQLite's one
    /// write lock is that handler's until it ends.
    const SWEEPS_BESIDE_HANDLERS: bool = true;

    /// Whether a claim commits before the handler's transaction begins (SQLite;
    /// MySQL's cluster mode), leaving a gap between the two.
    fn claims_commit_first(&self) -> bool {
        false
    }

    /// How long after its claim a crashed executor's key may be taken over: its
    /// lock, and in MySQL's cluster mode once more (node clocks differ).
    fn takeover_after(&self, lock: std::time::Duration) -> std::time::Duration {
        lock
    }

    /// `None` when the backend is not reachable outside CI (the caller says so).
    fn start(max_response_bytes: usize) -> impl Future<Output = Option<Self>> + Send;

    fn store(&self) -> &Idempotency<Self::DB>;

    /// A store on the same database and table: another app instance, which has
    /// seen none of this one's keys.
    fn another_instance(&self) -> Idempotency<Self::DB> {
        self.instance_on(self.store().pool().clone())
            .build()
            .expect("another instance")
    }

    /// The settings of this harness's stores (layout, pooler, response limit) on
    /// `pool`, for a test to add its own.
    fn instance_on(&self, pool: sqlx::Pool<Self::DB>) -> Builder<Self::DB> {
        Idempotency::builder(pool).max_response_bytes(self.store().max_response_bytes())
    }

    /// The business write a handler makes: one row in `effects`, returning its id.
    fn insert_effect<'a>(
        tx: &'a mut Tx<Self::DB>,
        scope: &'a str,
        note: &'a str,
    ) -> BoxFuture<'a, Result<i64, sqlx::Error>>;

    fn effects(&self, scope: &str) -> impl Future<Output = i64> + Send;

    /// Runs one statement (placeholders `$1`, `$2`, ... in order of use) with text
    /// arguments on a handler's connection; the rows it changed.
    fn exec<'a>(
        conn: &'a mut <Self::DB as sqlx::Database>::Connection,
        sql: &'a str,
        args: &'a [&'a str],
    ) -> BoxFuture<'a, Result<u64, sqlx::Error>>;

    /// A `SELECT count(*)` (placeholders as in [`exec`](Self::exec)), through the pool.
    fn count(&self, sql: &str, args: &[&str]) -> impl Future<Output = i64> + Send;

    /// Runs a script of several statements through the pool: an app's schema.
    fn script(&self, sql: &str) -> impl Future<Output = ()> + Send;

    fn key_rows(&self, scope: &str) -> impl Future<Output = Vec<(String, KeyRow)>> + Send;

    /// Overwrites the row of `scope`'s `key` with `row`, as someone with write
    /// access to the table could.
    fn rewrite_row(&self, scope: &str, key: &str, row: &KeyRow) -> impl Future<Output = ()> + Send;

    /// What a crashed executor leaves: a `processing` row whose lock ran out
    /// (in MySQL's cluster mode, twice: see `takeover_after`).
    fn insert_stale_claim(
        &self,
        scope: &str,
        key: &str,
        method: &str,
        path: &str,
        body: &[u8],
    ) -> impl Future<Output = ()> + Send;

    /// `count` keys `{prefix}{n}` whose ttl has passed: completed, or (abandoned)
    /// processing ones. At most 1000 (MySQL's recursion depth).
    fn insert_expired(
        &self,
        scope: &str,
        prefix: &str,
        count: i64,
        completed: bool,
    ) -> impl Future<Output = ()> + Send;

    /// A key table named `table` as the first release created it
    /// (`migrations/<backend>/0001_*`, in this harness's layout), holding, in scope
    /// `alice`, a completed key `k-old` (`POST /effects` with `body`, answered 201
    /// `old-body`) and a crashed executor's stale claim `k-stale`.
    fn legacy_table(&self, table: &str, body: &[u8]) -> impl Future<Output = ()> + Send;

    /// A store in this harness's layout on another `table` of the same database.
    fn store_on(&self, table: &str) -> Idempotency<Self::DB>;

    /// A pool straight to this test's database (not through a pooler).
    fn direct_pool(&self) -> &sqlx::Pool<Self::DB>;

    /// `SELECT count(*)` of this test's sessions waiting for a row lock.
    const LOCK_WAITS: &'static str;

    /// [`LOCK_WAITS`](Self::LOCK_WAITS) and nothing else: on MySQL that one also
    /// counts sessions running an UPDATE that waits for nothing.
    const ROW_LOCK_WAITS: &'static str = Self::LOCK_WAITS;

    /// Begins a transaction at READ COMMITTED, whatever the run's default.
    const BEGIN_READ_COMMITTED: &'static str;

    /// Run inside a transaction so that a deadlock it joins is broken in the other
    /// session. PostgreSQL aborts whichever session checks first, after its
    /// `deadlock_timeout`; under load the later waiter can check first.
    const OUTLAST_DEADLOCKS: Option<&'static str> = None;

    /// Creates what the cases need (another schema or database holding tables of
    /// idem's names, a tenant's role) and lists every change of session state a
    /// handler can make inside its transaction on this backend (see `session.rs`).
    fn session_changes(&self) -> impl Future<Output = Vec<SessionChange>> + Send;

    /// A store of this harness's settings on a pool of its own with one
    /// connection: what a handler leaves on its session, the next request meets.
    fn one_session_store(
        &self,
    ) -> impl Future<Output = (sqlx::Pool<Self::DB>, Idempotency<Self::DB>)> + Send {
        let options = (*self.store().pool().connect_options()).clone();
        async move {
            let pool = sqlx::pool::PoolOptions::<Self::DB>::new()
                .max_connections(1)
                .connect_with(options)
                .await
                .expect("a pool of one connection");
            let store = self.instance_on(pool.clone()).build().expect("store");
            (pool, store)
        }
    }

    /// Statements a handler may send that end its own transaction (a commit or a
    /// rollback), after which the database runs what it sends next outside it.
    /// MySQL's whole class is `ended.rs`'s.
    const ENDING_STATEMENTS: &'static [&'static str];

    /// Whether a key stays held after a handler ended its transaction itself
    /// (see `session::duplicates_never_run_while_a_handler_has_ended_its_transaction`).
    fn holds_keys_past_their_transaction(&self) -> bool {
        true
    }

    /// Connections of this test's database still inside a transaction.
    fn open_transactions(&self) -> impl Future<Output = i64> + Send;

    /// Closes the pools; the schema, database or file goes when `self` is dropped.
    fn finish(self) -> impl Future<Output = ()> + Send;
}

/// The harness's `exec`, `count` and `script` for one backend: `$conn` its
/// connection type, `$pool` the field reads go through, `$sql` what makes a
/// statement written with `$1`, `$2`, ... the backend's own.
macro_rules! dynamic_sql {
    ($conn:ty, $pool:ident, $sql:path) => {
        fn exec<'a>(
            conn: &'a mut $conn,
            sql: &'a str,
            args: &'a [&'a str],
        ) -> BoxFuture<'a, Result<u64, sqlx::Error>> {
            Box::pin(async move {
                // Unprepared, as statements must be through a transaction pooler.
                let mut query = sqlx::query(sqlx::AssertSqlSafe($sql(sql))).persistent(false);
                for arg in args {
                    query = query.bind(*arg);
                }
                Ok(query.execute(conn).await?.rows_affected())
            })
        }

        async fn count(&self, sql: &str, args: &[&str]) -> i64 {
            let mut query = sqlx::query_scalar(sqlx::AssertSqlSafe($sql(sql)));
            for arg in args {
                query = query.bind(*arg);
            }
            query.fetch_one(&self.$pool).await.expect("count")
        }

        async fn script(&self, sql: &str) {
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
                .execute(&self.$pool)
                .await
                .expect("script");
        }

        async fn rewrite_row(&self, scope: &str, key: &str, row: &KeyRow) {
            let sql = "UPDATE idempotency_keys SET state = $1, method = $2, path = $3, \
                           fingerprint = $4, status = $5, headers = $6, body = $7 \
                       WHERE scope = $8 AND idempotency_key = $9";
            let done = sqlx::query(sqlx::AssertSqlSafe($sql(sql)))
                .persistent(false)
                .bind(&row.state)
                .bind(&row.method)
                .bind(&row.path)
                .bind(&row.fingerprint)
                .bind(row.status)
                .bind(&row.headers)
                .bind(&row.body)
                .bind(scope)
                .bind(key)
                .execute(&self.$pool)
                .await
                .expect("rewrite a row");
            assert_eq!(done.rows_affected(), 1, "{scope} {key}");
        }
    };
}

pub fn unique(prefix: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "{prefix}_{}_{}_{nanos}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Removes a test's schema, database or file when its harness is dropped, so a
/// failed test leaves nothing behind either. Runs on a thread of its own: it may be
/// dropped while a panic unwinds through the test's runtime.
struct Leftover(Option<Box<dyn FnOnce() + Send + Sync>>);

impl Leftover {
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    fn statement<C>(url: String, statement: String) -> Self
    where
        C: Connection,
        for<'c> &'c mut C: sqlx::Executor<'c>,
    {
        Self(Some(Box::new(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            runtime.block_on(async {
                if let Ok(mut conn) = C::connect(&url).await {
                    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
                        .execute(&mut conn)
                        .await;
                    let _ = conn.close().await;
                }
            });
        })))
    }
}

impl Drop for Leftover {
    fn drop(&mut self) {
        if let Some(cleanup) = self.0.take() {
            let _ = std::thread::spawn(cleanup).join();
        }
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

// ---------------------------------------------------------------------------------

// One module per backend, after `dynamic_sql!`, which they use.
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;
#[cfg(feature = "mysql")]
pub use mysql::My;
#[cfg(feature = "postgres")]
pub use postgres::{Pg, PgParted};
#[cfg(feature = "sqlite")]
pub use sqlite::{Lite, LiteDeferred};
