//! SQLite, one file per test: handlers' transactions begun `IMMEDIATE` (`Lite`),
//! or taking the write lock at their first write (`LiteDeferred`).

use std::path::PathBuf;
use std::time::Duration;

use idem_axum::{Idempotency, Tx};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{Row, Sqlite, SqlitePool};

use super::*;
use crate::session::EFFECT;

pub struct LiteMode<const DEFERRED: bool> {
    pool: SqlitePool,
    store: Idempotency<Sqlite>,
    path: PathBuf,
    _leftover: Leftover,
}

pub type Lite = LiteMode<false>;
pub type LiteDeferred = LiteMode<true>;

impl<const DEFERRED: bool> LiteMode<DEFERRED> {
    fn connect_options(path: &PathBuf) -> SqliteConnectOptions {
        SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(30))
    }
}

impl<const DEFERRED: bool> Harness for LiteMode<DEFERRED> {
    type DB = Sqlite;

    fn claims_commit_first(&self) -> bool {
        true
    }

    // One writer: nobody waits for a row.
    const LOCK_WAITS: &'static str = "SELECT 0";

    const BEGIN_READ_COMMITTED: &'static str = "BEGIN";

    fn direct_pool(&self) -> &SqlitePool {
        &self.pool
    }

    const STALLED_WRITER_BLOCKS_TAKEOVER: bool = true;

    const SWEEPS_BESIDE_HANDLERS: bool = false;

    // Each way of ending it, and each followed by a transaction of the handler's
    // own, which idem must not take for the one it began.
    const ENDING_STATEMENTS: &'static [&'static str] = &[
        "COMMIT",
        "END",
        "ROLLBACK",
        "COMMIT; BEGIN",
        "END; BEGIN IMMEDIATE",
        "ROLLBACK; BEGIN",
    ];

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
        let mut builder = Idempotency::builder(pool.clone()).max_response_bytes(max_response_bytes);
        if DEFERRED {
            builder = builder.write_lock_at_first_write();
        }
        let store = builder.build().expect("store");
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
        tx: &'a mut Tx<Sqlite>,
        scope: &'a str,
        note: &'a str,
    ) -> BoxFuture<'a, Result<i64, sqlx::Error>> {
        Box::pin(async move {
            sqlx::query_scalar("INSERT INTO effects (scope, note) VALUES ($1, $2) RETURNING id")
                .bind(scope)
                .bind(note)
                .fetch_one(tx)
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
        .bind(&idem_axum::fingerprint(body)[..])
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
        let first =
            include_str!("../../../idem-runtime/migrations/sqlite/0001_idempotency_keys.sql");
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
        .bind(&idem_axum::fingerprint(body)[..])
        .execute(&self.pool)
        .await
        .expect("legacy rows");
    }

    async fn session_changes(&self) -> Vec<SessionChange> {
        // `ATTACH` is refused inside a transaction: a handler cannot send it.
        let case = |name: &str, statements: &[&str], shadow: Option<&str>| SessionChange {
            name: name.to_owned(),
            statements: statements.iter().map(|s| (*s).to_owned()).collect(),
            shadow: shadow.map(str::to_owned),
        };
        vec![
            case(
                "a temporary table of idem's name, which comes before main's",
                &[
                    "CREATE TEMP TABLE idempotency_keys AS SELECT * FROM main.idempotency_keys WHERE 0",
                ],
                Some("DELETE FROM temp.idempotency_keys"),
            ),
            case(
                "a temporary view of idem's name",
                &[
                    "CREATE TEMP VIEW idempotency_keys AS SELECT * FROM main.idempotency_keys WHERE 0",
                ],
                None,
            ),
            case(
                "PRAGMA query_only",
                &[EFFECT, "PRAGMA query_only = 1"],
                None,
            ),
            case(
                "PRAGMA busy_timeout = 0",
                &["PRAGMA busy_timeout = 0"],
                None,
            ),
            case(
                "pragmas that change how queries run",
                &[
                    "PRAGMA reverse_unordered_selects = 1",
                    "PRAGMA case_sensitive_like = 1",
                    "PRAGMA recursive_triggers = 1",
                    "PRAGMA defer_foreign_keys = 1",
                    "PRAGMA cache_size = 1",
                    "PRAGMA cell_size_check = 1",
                ],
                None,
            ),
        ]
    }

    fn store_on(&self, table: &str) -> Idempotency<Sqlite> {
        self.instance_on(self.pool.clone())
            .table(table)
            .build()
            .expect("store")
    }

    fn instance_on(&self, pool: SqlitePool) -> Builder<Sqlite> {
        let builder =
            Idempotency::builder(pool).max_response_bytes(self.store.max_response_bytes());
        if DEFERRED {
            builder.write_lock_at_first_write()
        } else {
            builder
        }
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
