//! One fresh database per test, on each backend, and the SQL the suite needs there.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem::{Backend, Idempotency, Tx};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{Connection, MySql, MySqlPool, PgPool, Postgres, Row, Sqlite, SqlitePool};

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

    /// `None` when the backend is not reachable outside CI (the caller says so).
    fn start(max_response_bytes: usize) -> impl Future<Output = Option<Self>> + Send;

    fn store(&self) -> &Idempotency<Self::DB>;

    /// A store on the same database and table: another app instance, which has
    /// seen none of this one's keys.
    fn another_instance(&self) -> Idempotency<Self::DB> {
        Idempotency::builder(self.store().pool().clone())
            .max_response_bytes(self.store().max_response_bytes())
            .build()
            .expect("another instance")
    }

    /// The business write a handler makes: one row in `effects`, returning its id.
    fn insert_effect<'a>(
        tx: &'a mut Tx<'_, Self::DB>,
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

    /// What a crashed executor leaves: a `processing` row whose lock ran out.
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

    /// Begins a transaction at READ COMMITTED, whatever the run's default.
    const BEGIN_READ_COMMITTED: &'static str;

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
    };
}

fn unique(prefix: &str) -> String {
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

/// `$1`, `$2`, ... as MySQL's `?`, for statements that use each placeholder once,
/// in order.
fn question_marks(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '$' && chars.peek().is_some_and(char::is_ascii_digit) {
            while chars.peek().is_some_and(char::is_ascii_digit) {
                chars.next();
            }
            out.push('?');
        } else {
            out.push(c);
        }
    }
    out
}

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

// ---------------------------------------------------------------------------------

/// PostgreSQL, in the plain layout (`Pg`) or partitioned by day (`PgParted`).
pub struct PgLayout<const PARTITIONED: bool> {
    admin: PgPool,
    /// The stores' pool: through PgBouncer on a pooler run.
    pool: PgPool,
    /// Straight to the server, for the suite's own reads and writes.
    direct: PgPool,
    /// Set on a pooler run: the stores are built `transaction_pooled`.
    pooled: bool,
    /// Another instance's pool: its `search_path` starts with an empty schema of
    /// its own, so `current_schema()` differs while the tables are the same.
    other_pool: PgPool,
    store: Idempotency<Postgres>,
    schema: String,
    _leftover: Leftover,
}

/// The isolation level a CI configuration set as the database's or role's default
/// (`IDEM_TEST_POSTGRES_ISOLATION`, e.g. `repeatable read`): checked, so that a
/// run meant for it cannot pass at another.
fn expected_pg_isolation() -> Option<String> {
    std::env::var("IDEM_TEST_POSTGRES_ISOLATION").ok()
}

pub type Pg = PgLayout<false>;
pub type PgParted = PgLayout<true>;

impl<const PARTITIONED: bool> Harness for PgLayout<PARTITIONED> {
    type DB = Postgres;

    // This test's sessions: every pool of a test carries its schema's name.
    const LOCK_WAITS: &'static str = "SELECT count(*) FROM pg_stat_activity \
         WHERE wait_event_type = 'Lock' \
           AND application_name = current_setting('application_name')";

    const BEGIN_READ_COMMITTED: &'static str = "BEGIN ISOLATION LEVEL READ COMMITTED";

    fn direct_pool(&self) -> &PgPool {
        &self.direct
    }

    const ERROR_VOIDS_TRANSACTION: bool = true;

    async fn start(max_response_bytes: usize) -> Option<Self> {
        let url = std::env::var("IDEM_TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
        let options: PgConnectOptions = url.parse().expect("IDEM_TEST_POSTGRES_URL");
        let admin = match PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options.clone())
            .await
        {
            Ok(admin) => admin,
            Err(error) if !in_ci() => {
                eprintln!(
                    "SKIPPED: PostgreSQL not reachable at {url} ({error}); CI=true makes this a failure"
                );
                return None;
            }
            Err(error) => panic!("PostgreSQL not reachable at {url}: {error}"),
        };
        let schema = unique("idem_test");
        let pooler = std::env::var("IDEM_TEST_POSTGRES_POOLER_URL").ok();
        let (pool, direct, other_pool, leftover) = match &pooler {
            None => {
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                    "CREATE SCHEMA {schema}; CREATE SCHEMA {schema}_other"
                )))
                .execute(&admin)
                .await
                .expect("create schema");
                let options = options.application_name(&schema);
                let pool = PgPoolOptions::new()
                    .max_connections(24)
                    .connect_with(options.clone().options([("search_path", schema.as_str())]))
                    .await
                    .expect("connect to test schema");
                let other_path = format!("{schema}_other, {schema}");
                let other_pool = PgPoolOptions::new()
                    .max_connections(24)
                    .connect_with(options.options([("search_path", other_path.as_str())]))
                    .await
                    .expect("connect with another search path");
                let leftover = Leftover::statement::<sqlx::PgConnection>(
                    url,
                    format!(
                        "DROP SCHEMA IF EXISTS {schema} CASCADE; \
                         DROP SCHEMA IF EXISTS {schema}_other CASCADE"
                    ),
                );
                (pool.clone(), pool, other_pool, leftover)
            }
            // Through a transaction pooler no session setting sticks, so each test
            // gets a database of its own; both instances go through the pooler.
            Some(pooler_url) => {
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {schema}")))
                    .execute(&admin)
                    .await
                    .expect("create database");
                let leftover = Leftover::statement::<sqlx::PgConnection>(
                    url,
                    format!("DROP DATABASE IF EXISTS {schema} WITH (FORCE)"),
                );
                let direct = PgPoolOptions::new()
                    .max_connections(4)
                    .connect_with(options.database(&schema).application_name(&schema))
                    .await
                    .expect("connect to test database");
                let through: PgConnectOptions =
                    pooler_url.parse().expect("IDEM_TEST_POSTGRES_POOLER_URL");
                let through = through.database(&schema).application_name(&schema);
                let pool = PgPoolOptions::new()
                    .max_connections(24)
                    .connect_with(through.clone())
                    .await
                    .expect("connect through the pooler");
                let other_pool = PgPoolOptions::new()
                    .max_connections(24)
                    .connect_with(through)
                    .await
                    .expect("connect through the pooler");
                (pool, direct, other_pool, leftover)
            }
        };
        let pooled = pooler.is_some();
        if let Some(expected) = expected_pg_isolation() {
            let level: String = sqlx::query_scalar("SHOW default_transaction_isolation")
                .fetch_one(&direct)
                .await
                .expect("isolation level");
            assert_eq!(level, expected, "the default isolation level of this run");
        }
        sqlx::raw_sql(
            "CREATE TABLE effects (id BIGSERIAL PRIMARY KEY, scope TEXT NOT NULL, note TEXT NOT NULL)",
        )
        .execute(&direct)
        .await
        .expect("create effects");
        let mut builder = Idempotency::builder(pool.clone()).max_response_bytes(max_response_bytes);
        if PARTITIONED {
            builder = builder.partitioned_by_day();
        }
        if pooled {
            builder = builder.transaction_pooled().listen_pool(direct.clone());
        }
        let store = builder.build().expect("store");
        store.migrate().await.expect("migrate");
        if PARTITIONED {
            store.maintain_partitions(3).await.expect("partitions");
        }
        Some(Self {
            admin,
            pool,
            direct,
            pooled,
            other_pool,
            store,
            schema,
            _leftover: leftover,
        })
    }

    fn store(&self) -> &Idempotency<Postgres> {
        &self.store
    }

    fn another_instance(&self) -> Idempotency<Postgres> {
        let mut builder = Idempotency::builder(self.other_pool.clone())
            .max_response_bytes(self.store.max_response_bytes());
        if PARTITIONED {
            builder = builder.partitioned_by_day();
        }
        if self.pooled {
            // No listen pool: this instance's waiters look again on their own.
            builder = builder.transaction_pooled();
        }
        builder.build().expect("another instance")
    }

    fn insert_effect<'a>(
        tx: &'a mut Tx<'_, Postgres>,
        scope: &'a str,
        note: &'a str,
    ) -> BoxFuture<'a, Result<i64, sqlx::Error>> {
        Box::pin(async move {
            // Unprepared, as statements must be through a transaction pooler.
            sqlx::query_scalar("INSERT INTO effects (scope, note) VALUES ($1, $2) RETURNING id")
                .persistent(false)
                .bind(scope)
                .bind(note)
                .fetch_one(&mut **tx)
                .await
        })
    }

    async fn effects(&self, scope: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE scope = $1")
            .bind(scope)
            .fetch_one(&self.direct)
            .await
            .expect("count effects")
    }

    dynamic_sql!(sqlx::PgConnection, direct, str::to_owned);

    async fn key_rows(&self, scope: &str) -> Vec<(String, KeyRow)> {
        let rows = sqlx::query(
            "SELECT idempotency_key, state, method, path, fingerprint, status, headers, body \
             FROM idempotency_keys WHERE scope = $1 ORDER BY idempotency_key",
        )
        .bind(scope)
        .fetch_all(&self.direct)
        .await
        .expect("read keys");
        rows.iter()
            .map(|row| {
                (
                    row.get("idempotency_key"),
                    KeyRow {
                        state: row.get("state"),
                        method: row.get("method"),
                        path: row.get("path"),
                        fingerprint: row.get("fingerprint"),
                        status: row.get::<Option<i16>, _>("status").map(i32::from),
                        headers: row.get("headers"),
                        body: row.get("body"),
                    },
                )
            })
            .collect()
    }

    async fn insert_stale_claim(
        &self,
        scope: &str,
        key: &str,
        method: &str,
        path: &str,
        body: &[u8],
    ) {
        sqlx::query(
            "INSERT INTO idempotency_keys (scope, idempotency_key, state, lease, method, path, \
                 fingerprint, locked_until, expires_at, created_at) \
             VALUES ($1, $2, 'processing', 42, $3, $4, $5, now() - interval '1 second', \
                 now() + interval '1 hour', now() - interval '31 seconds')",
        )
        .bind(scope)
        .bind(key)
        .bind(method)
        .bind(path)
        .bind(&idem::fingerprint(body)[..])
        .execute(&self.direct)
        .await
        .expect("insert stale claim");
    }

    async fn insert_expired(&self, scope: &str, prefix: &str, count: i64, completed: bool) {
        let state = if completed { "completed" } else { "processing" };
        sqlx::query(
            "INSERT INTO idempotency_keys (scope, idempotency_key, state, lease, method, path, \
                 fingerprint, status, headers, body, locked_until, expires_at, created_at) \
             SELECT $1, $2 || g, $3, 7, 'POST', '/effects', '\\x00', 201, '', 'old', \
                 now() - interval '2 hours', now() - interval '1 second', now() - interval '2 hours' \
             FROM generate_series(1, $4) AS g",
        )
        .bind(scope)
        .bind(prefix)
        .bind(state)
        .bind(count)
        .execute(&self.direct)
        .await
        .expect("insert expired keys");
    }

    async fn legacy_table(&self, table: &str, body: &[u8]) {
        let first = if PARTITIONED {
            include_str!("../../migrations/postgres/partitioned/0001_idempotency_keys.sql")
        } else {
            include_str!("../../migrations/postgres/0001_idempotency_keys.sql")
        };
        self.script(&first.replace("idempotency_keys", table)).await;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {table} (scope, idempotency_key, state, lease, method, path, \
                 fingerprint, status, headers, body, locked_until, expires_at, created_at) \
             VALUES ('alice', 'k-old', 'completed', 1, 'POST', '/effects', $1, 201, \
                     'content-type: application/json\r\n'::bytea, 'old-body'::bytea, \
                     now(), now() + interval '1 hour', now()), \
                    ('alice', 'k-stale', 'processing', 2, 'POST', '/effects', $1, NULL, \
                     NULL, NULL, now() - interval '1 second', now() + interval '1 hour', now())"
        )))
        .bind(&idem::fingerprint(body)[..])
        .execute(&self.direct)
        .await
        .expect("legacy rows");
    }

    fn store_on(&self, table: &str) -> Idempotency<Postgres> {
        let mut builder = Idempotency::builder(self.pool.clone()).table(table);
        if PARTITIONED {
            builder = builder.partitioned_by_day();
        }
        if self.pooled {
            builder = builder.transaction_pooled();
        }
        builder.build().expect("store")
    }

    async fn open_transactions(&self) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE (application_name = $1 OR datname = $1) \
               AND state LIKE 'idle in transaction%'",
        )
        .bind(&self.schema)
        .fetch_one(&self.admin)
        .await
        .expect("read pg_stat_activity")
    }

    async fn finish(self) {
        self.pool.close().await;
        self.other_pool.close().await;
        self.direct.close().await;
        self.admin.close().await;
    }
}

// ---------------------------------------------------------------------------------

pub struct Lite {
    pool: SqlitePool,
    store: Idempotency<Sqlite>,
    path: PathBuf,
    _leftover: Leftover,
}

impl Lite {
    fn connect_options(path: &PathBuf) -> SqliteConnectOptions {
        SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(30))
    }
}

impl Harness for Lite {
    type DB = Sqlite;

    // One writer: nobody waits for a row.
    const LOCK_WAITS: &'static str = "SELECT 0";

    const BEGIN_READ_COMMITTED: &'static str = "BEGIN";

    fn direct_pool(&self) -> &SqlitePool {
        &self.pool
    }

    const STALLED_WRITER_BLOCKS_TAKEOVER: bool = true;

    async fn start(max_response_bytes: usize) -> Option<Self> {
        let path = std::env::temp_dir().join(format!("{}.db", unique("idem_test")));
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .connect_with(Self::connect_options(&path))
            .await
            .expect("open sqlite");
        sqlx::raw_sql(
            "CREATE TABLE effects (id INTEGER PRIMARY KEY AUTOINCREMENT, scope TEXT NOT NULL, note TEXT NOT NULL)",
        )
        .execute(&pool)
        .await
        .expect("create effects");
        let store = Idempotency::builder(pool.clone())
            .max_response_bytes(max_response_bytes)
            .build()
            .expect("store");
        store.migrate().await.expect("migrate");
        let files = path.clone();
        let leftover = Leftover(Some(Box::new(move || {
            for suffix in ["", "-wal", "-shm"] {
                let mut file = files.clone().into_os_string();
                file.push(suffix);
                let _ = std::fs::remove_file(file);
            }
        })));
        Some(Self {
            pool,
            store,
            path,
            _leftover: leftover,
        })
    }

    fn store(&self) -> &Idempotency<Sqlite> {
        &self.store
    }

    fn insert_effect<'a>(
        tx: &'a mut Tx<'_, Sqlite>,
        scope: &'a str,
        note: &'a str,
    ) -> BoxFuture<'a, Result<i64, sqlx::Error>> {
        Box::pin(async move {
            sqlx::query_scalar("INSERT INTO effects (scope, note) VALUES ($1, $2) RETURNING id")
                .bind(scope)
                .bind(note)
                .fetch_one(&mut **tx)
                .await
        })
    }

    async fn effects(&self, scope: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE scope = $1")
            .bind(scope)
            .fetch_one(&self.pool)
            .await
            .expect("count effects")
    }

    dynamic_sql!(sqlx::SqliteConnection, pool, str::to_owned);

    async fn key_rows(&self, scope: &str) -> Vec<(String, KeyRow)> {
        let rows = sqlx::query(
            "SELECT idempotency_key, state, method, path, fingerprint, status, headers, body \
             FROM idempotency_keys WHERE scope = $1 ORDER BY idempotency_key",
        )
        .bind(scope)
        .fetch_all(&self.pool)
        .await
        .expect("read keys");
        rows.iter()
            .map(|row| {
                (
                    row.get("idempotency_key"),
                    KeyRow {
                        state: row.get("state"),
                        method: row.get("method"),
                        path: row.get("path"),
                        fingerprint: row.get("fingerprint"),
                        status: row.get("status"),
                        headers: row.get("headers"),
                        body: row.get("body"),
                    },
                )
            })
            .collect()
    }

    async fn insert_stale_claim(
        &self,
        scope: &str,
        key: &str,
        method: &str,
        path: &str,
        body: &[u8],
    ) {
        let now_ms = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)";
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO idempotency_keys (scope, idempotency_key, state, lease, method, path, \
                 fingerprint, locked_until, expires_at, created_at) \
             VALUES ($1, $2, 'processing', 42, $3, $4, $5, {now_ms} - 1000, {now_ms} + 3600000, \
                 {now_ms} - 31000)"
        )))
        .bind(scope)
        .bind(key)
        .bind(method)
        .bind(path)
        .bind(&idem::fingerprint(body)[..])
        .execute(&self.pool)
        .await
        .expect("insert stale claim");
    }

    async fn insert_expired(&self, scope: &str, prefix: &str, count: i64, completed: bool) {
        let state = if completed { "completed" } else { "processing" };
        let now_ms = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)";
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < $4) \
             INSERT INTO idempotency_keys (scope, idempotency_key, state, lease, method, path, \
                 fingerprint, status, headers, body, locked_until, expires_at, created_at) \
             SELECT $1, $2 || n, $3, 7, 'POST', '/effects', x'00', 201, x'', x'6f6c64', \
                 {now_ms} - 7200000, {now_ms} - 1000, {now_ms} - 7200000 FROM g"
        )))
        .bind(scope)
        .bind(prefix)
        .bind(state)
        .bind(count)
        .execute(&self.pool)
        .await
        .expect("insert expired keys");
    }

    async fn legacy_table(&self, table: &str, body: &[u8]) {
        let first = include_str!("../../migrations/sqlite/0001_idempotency_keys.sql");
        self.script(&first.replace("idempotency_keys", table)).await;
        let now_ms = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)";
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {table} (scope, idempotency_key, state, lease, method, path, \
                 fingerprint, status, headers, body, locked_until, expires_at, created_at) \
             VALUES ('alice', 'k-old', 'completed', 1, 'POST', '/effects', ?1, 201, \
                     CAST('content-type: application/json' || char(13, 10) AS BLOB), \
                     CAST('old-body' AS BLOB), {now_ms}, {now_ms} + 3600000, {now_ms}), \
                    ('alice', 'k-stale', 'processing', 2, 'POST', '/effects', ?1, NULL, \
                     NULL, NULL, {now_ms} - 1000, {now_ms} + 3600000, {now_ms})"
        )))
        .bind(&idem::fingerprint(body)[..])
        .execute(&self.pool)
        .await
        .expect("legacy rows");
    }

    fn store_on(&self, table: &str) -> Idempotency<Sqlite> {
        Idempotency::builder(self.pool.clone())
            .table(table)
            .build()
            .expect("store")
    }

    async fn open_transactions(&self) -> i64 {
        // SQLite cannot list other connections' transactions, but a writer that was
        // left open holds the write lock: try to take it without waiting.
        let mut probe = sqlx::SqliteConnection::connect_with(
            &Self::connect_options(&self.path).busy_timeout(Duration::ZERO),
        )
        .await
        .expect("open probe connection");
        let held = match probe.begin_with("BEGIN IMMEDIATE").await {
            Ok(tx) => {
                tx.rollback().await.expect("rollback probe");
                0
            }
            Err(_) => 1,
        };
        let _ = probe.close().await;
        held
    }

    async fn finish(self) {
        self.pool.close().await;
    }
}

// ---------------------------------------------------------------------------------

pub struct My {
    admin: MySqlPool,
    pool: MySqlPool,
    store: Idempotency<MySql>,
    database: String,
    _leftover: Leftover,
}

impl My {
    /// A store on a pool of one connection whose sessions start with `init` (the
    /// application's own session settings).
    pub async fn store_with_session(&self, init: &'static str) -> (MySqlPool, Idempotency<MySql>) {
        let url = std::env::var("IDEM_TEST_MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
        let options: MySqlConnectOptions = url.parse().expect("IDEM_TEST_MYSQL_URL");
        let pool = MySqlPoolOptions::new()
            .max_connections(1)
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    sqlx::raw_sql(init).execute(conn).await?;
                    Ok(())
                })
            })
            .connect_with(options.database(&self.database))
            .await
            .expect("connect with session settings");
        let store = Idempotency::new(pool.clone());
        (pool, store)
    }
}

impl Harness for My {
    type DB = MySql;

    // MariaDB's INNODB_TRX showed a waiting transaction as RUNNING, or not at all;
    // a statement blocked on a row stays in the `Updating` state.
    const LOCK_WAITS: &'static str = "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
         WHERE DB = DATABASE() AND LOWER(STATE) = 'updating'";

    const BEGIN_READ_COMMITTED: &'static str =
        "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";

    fn direct_pool(&self) -> &MySqlPool {
        &self.pool
    }

    async fn start(max_response_bytes: usize) -> Option<Self> {
        let url = std::env::var("IDEM_TEST_MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
        let options: MySqlConnectOptions = url.parse().expect("IDEM_TEST_MYSQL_URL");
        let admin = match MySqlPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options.clone())
            .await
        {
            Ok(admin) => admin,
            Err(error) if !in_ci() => {
                eprintln!(
                    "SKIPPED: MySQL/MariaDB not reachable at {url} ({error}); CI=true makes this a failure"
                );
                return None;
            }
            Err(error) => panic!("MySQL/MariaDB not reachable at {url}: {error}"),
        };
        let database = unique("idem_test");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
            .execute(&admin)
            .await
            .expect("create database");
        // A CI configuration's isolation level (`IDEM_TEST_MYSQL_ISOLATION`, e.g.
        // `READ COMMITTED`), as an application would set it on every session.
        let isolation = std::env::var("IDEM_TEST_MYSQL_ISOLATION").ok();
        let pool = MySqlPoolOptions::new()
            .max_connections(24)
            .after_connect(move |conn, _| {
                let isolation = isolation.clone();
                Box::pin(async move {
                    if let Some(level) = isolation {
                        let set = format!("SET SESSION TRANSACTION ISOLATION LEVEL {level}");
                        sqlx::raw_sql(sqlx::AssertSqlSafe(set))
                            .execute(conn)
                            .await?;
                    }
                    Ok(())
                })
            })
            .connect_with(options.database(&database))
            .await
            .expect("connect to test database");
        sqlx::raw_sql(
            "CREATE TABLE effects (id BIGINT AUTO_INCREMENT PRIMARY KEY, scope VARCHAR(255) NOT NULL, note TEXT NOT NULL)",
        )
        .execute(&pool)
        .await
        .expect("create effects");
        let store = Idempotency::builder(pool.clone())
            .max_response_bytes(max_response_bytes)
            .build()
            .expect("store");
        store.migrate().await.expect("migrate");
        let leftover = Leftover::statement::<sqlx::MySqlConnection>(
            url,
            format!("DROP DATABASE IF EXISTS {database}"),
        );
        Some(Self {
            admin,
            pool,
            store,
            database,
            _leftover: leftover,
        })
    }

    fn store(&self) -> &Idempotency<MySql> {
        &self.store
    }

    fn insert_effect<'a>(
        tx: &'a mut Tx<'_, MySql>,
        scope: &'a str,
        note: &'a str,
    ) -> BoxFuture<'a, Result<i64, sqlx::Error>> {
        Box::pin(async move {
            let done = sqlx::query("INSERT INTO effects (scope, note) VALUES (?, ?)")
                .bind(scope)
                .bind(note)
                .execute(&mut **tx)
                .await?;
            i64::try_from(done.last_insert_id()).map_err(|e| sqlx::Error::Decode(e.into()))
        })
    }

    async fn effects(&self, scope: &str) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM effects WHERE scope = ?")
            .bind(scope)
            .fetch_one(&self.pool)
            .await
            .expect("count effects")
    }

    dynamic_sql!(sqlx::MySqlConnection, pool, question_marks);

    async fn key_rows(&self, scope: &str) -> Vec<(String, KeyRow)> {
        let rows = sqlx::query(
            "SELECT idempotency_key, state, method, path, fingerprint, status, headers, body \
             FROM idempotency_keys WHERE scope = ? ORDER BY idempotency_key",
        )
        .bind(scope)
        .fetch_all(&self.pool)
        .await
        .expect("read keys");
        rows.iter()
            .map(|row| {
                let key: Vec<u8> = row.get("idempotency_key");
                (
                    String::from_utf8_lossy(&key).into_owned(),
                    KeyRow {
                        state: row.get("state"),
                        method: row.get("method"),
                        path: row.get("path"),
                        fingerprint: row.get("fingerprint"),
                        status: row.get::<Option<i16>, _>("status").map(i32::from),
                        headers: row.get("headers"),
                        body: row.get("body"),
                    },
                )
            })
            .collect()
    }

    async fn insert_stale_claim(
        &self,
        scope: &str,
        key: &str,
        method: &str,
        path: &str,
        body: &[u8],
    ) {
        sqlx::query(
            "INSERT INTO idempotency_keys (scope, idempotency_key, state, lease, method, path, \
                 fingerprint, locked_until, expires_at, created_at) \
             VALUES (?, ?, 'processing', 42, ?, ?, ?, UTC_TIMESTAMP(6) - INTERVAL 1 SECOND, \
                 UTC_TIMESTAMP(6) + INTERVAL 1 HOUR, UTC_TIMESTAMP(6) - INTERVAL 31 SECOND)",
        )
        .bind(scope)
        .bind(key)
        .bind(method)
        .bind(path)
        .bind(&idem::fingerprint(body)[..])
        .execute(&self.pool)
        .await
        .expect("insert stale claim");
    }

    async fn insert_expired(&self, scope: &str, prefix: &str, count: i64, completed: bool) {
        let state = if completed { "completed" } else { "processing" };
        sqlx::query(
            "INSERT INTO idempotency_keys (scope, idempotency_key, state, lease, method, path, \
                 fingerprint, status, headers, body, locked_until, expires_at, created_at) \
             WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < ?) \
             SELECT ?, CONCAT(?, n), ?, 7, 'POST', '/effects', UNHEX(REPEAT('00', 32)), 201, '', 'old', \
                 UTC_TIMESTAMP(6) - INTERVAL 2 HOUR, UTC_TIMESTAMP(6) - INTERVAL 1 SECOND, \
                 UTC_TIMESTAMP(6) - INTERVAL 2 HOUR FROM g",
        )
        .bind(count)
        .bind(scope)
        .bind(prefix)
        .bind(state)
        .execute(&self.pool)
        .await
        .expect("insert expired keys");
    }

    async fn legacy_table(&self, table: &str, body: &[u8]) {
        let first = include_str!("../../migrations/mysql/0001_idempotency_keys.sql");
        self.script(&first.replace("idempotency_keys", table)).await;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {table} (scope, idempotency_key, state, lease, method, path, \
                 fingerprint, status, headers, body, locked_until, expires_at, created_at) \
             VALUES ('alice', 'k-old', 'completed', 1, 'POST', '/effects', ?, 201, \
                     CONCAT('content-type: application/json', CHAR(13), CHAR(10)), 'old-body', \
                     UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 1 HOUR, UTC_TIMESTAMP(6)), \
                    ('alice', 'k-stale', 'processing', 2, 'POST', '/effects', ?, NULL, NULL, \
                     NULL, UTC_TIMESTAMP(6) - INTERVAL 1 SECOND, UTC_TIMESTAMP(6) + INTERVAL 1 HOUR, \
                     UTC_TIMESTAMP(6))"
        )))
        .bind(&idem::fingerprint(body)[..])
        .bind(&idem::fingerprint(body)[..])
        .execute(&self.pool)
        .await
        .expect("legacy rows");
    }

    fn store_on(&self, table: &str) -> Idempotency<MySql> {
        Idempotency::builder(self.pool.clone())
            .table(table)
            .build()
            .expect("store")
    }

    async fn open_transactions(&self) -> i64 {
        // INNODB_TRX is a cache refreshed at most every 0.1 s (idem's own
        // `Retry-After` query fills it too): a transaction it lists may have ended
        // since. One left open is still listed after the cache has been renewed.
        let mut open = 0;
        for _ in 0..10 {
            open = sqlx::query_scalar(
                "SELECT COUNT(*) FROM information_schema.innodb_trx t \
                 JOIN information_schema.processlist p ON t.trx_mysql_thread_id = p.id \
                 WHERE p.db = ?",
            )
            .bind(&self.database)
            .fetch_one(&self.admin)
            .await
            .expect("read innodb_trx");
            if open == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        open
    }

    async fn finish(self) {
        self.pool.close().await;
        self.admin.close().await;
    }
}
