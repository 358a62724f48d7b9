//! MySQL and MariaDB, one database per test.

use std::time::Duration;

use idem::{Idempotency, Tx};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{MySql, MySqlPool, Row};

use super::*;

pub struct My {
    admin: MySqlPool,
    /// The application's pool, with the run's session settings; the store's.
    pool: MySqlPool,
    /// The test database without them, for the harness's own reads and fixtures.
    plain: MySqlPool,
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

    /// A store whose pool is configured for the URL's own database, but whose
    /// sessions `USE` the test's: the session's database is not the pool's.
    pub async fn store_moved_by_session(&self) -> Idempotency<MySql> {
        let url = std::env::var("IDEM_TEST_MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
        let options: MySqlConnectOptions = url.parse().expect("IDEM_TEST_MYSQL_URL");
        let moved = format!("USE {}", self.database);
        let pool = MySqlPoolOptions::new()
            .max_connections(2)
            .after_connect(move |conn, _| {
                let moved = moved.clone();
                Box::pin(async move {
                    sqlx::raw_sql(sqlx::AssertSqlSafe(moved))
                        .execute(conn)
                        .await?;
                    Ok(())
                })
            })
            .connect_with(options)
            .await
            .expect("connect, then move to the test database");
        Idempotency::new(pool)
    }

    /// Takes, on a session of its own in the test's database, the named lock that
    /// every release of idem takes for (`scope`, `key`) in the default table; held
    /// until [`NamedLock::release`] (or, if the test fails first, the session's end).
    pub async fn hold_named_lock(&self, scope: &str, key: &str) -> NamedLock {
        use sha2::{Digest as _, Sha256};
        let mut seed = Sha256::new();
        for part in ["idempotency_keys", scope, key] {
            seed.update((part.len() as u64).to_be_bytes());
            seed.update(part.as_bytes());
        }
        let seed: String = seed.finalize().iter().map(|b| format!("{b:02x}")).collect();
        let mut conn = self.plain.acquire().await.expect("a session");
        let name: String = sqlx::query_scalar(
            "SELECT CONCAT('idem:', LEFT(SHA2(CONCAT(COALESCE(DATABASE(), ''), ':', ?), 256), 40))",
        )
        .bind(seed)
        .fetch_one(&mut *conn)
        .await
        .expect("the lock's name");
        let taken: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 0)")
            .bind(&name)
            .fetch_one(&mut *conn)
            .await
            .expect("GET_LOCK");
        assert_eq!(taken, Some(1), "nobody else holds the key's lock");
        conn.close_on_drop();
        NamedLock { conn, name }
    }
}

/// A key's named lock, held by a session of the test's.
pub struct NamedLock {
    conn: sqlx::pool::PoolConnection<MySql>,
    name: String,
}

impl NamedLock {
    /// Frees the lock and waits for the server to say so: a closed session's
    /// locks are freed only once the server has noticed the close.
    pub async fn release(mut self) {
        let freed: Option<i64> = sqlx::query_scalar("SELECT RELEASE_LOCK(?)")
            .bind(&self.name)
            .fetch_one(&mut *self.conn)
            .await
            .expect("RELEASE_LOCK");
        assert_eq!(freed, Some(1), "the lock was this session's");
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
        // `READ COMMITTED`) and `sql_mode` (`IDEM_TEST_MYSQL_SQL_MODE`), as an
        // application would set them on every session.
        let mut settings = Vec::new();
        if let Ok(level) = std::env::var("IDEM_TEST_MYSQL_ISOLATION") {
            settings.push(format!("SET SESSION TRANSACTION ISOLATION LEVEL {level}"));
        }
        if let Ok(mode) = std::env::var("IDEM_TEST_MYSQL_SQL_MODE") {
            settings.push(format!("SET SESSION sql_mode = '{mode}'"));
        }
        // `IDEM_TEST_MYSQL_AUTOCOMMIT=0`: every statement outside a transaction
        // opens one, which only a COMMIT, ROLLBACK or BEGIN ends.
        if let Ok(autocommit) = std::env::var("IDEM_TEST_MYSQL_AUTOCOMMIT") {
            settings.push(format!("SET SESSION autocommit = {}", autocommit == "1"));
        }
        let pool = MySqlPoolOptions::new()
            .max_connections(24)
            .after_connect(move |conn, _| {
                let settings = settings.join("; ");
                Box::pin(async move {
                    if !settings.is_empty() {
                        sqlx::raw_sql(sqlx::AssertSqlSafe(settings))
                            .execute(conn)
                            .await?;
                    }
                    Ok(())
                })
            })
            .connect_with(options.clone().database(&database))
            .await
            .expect("connect to test database");
        let plain = MySqlPoolOptions::new()
            .max_connections(8)
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
            plain,
            store,
            database,
            _leftover: leftover,
        })
    }

    fn store(&self) -> &Idempotency<MySql> {
        &self.store
    }

    fn insert_effect<'a>(
        tx: &'a mut Tx<MySql>,
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
            .fetch_one(&self.plain)
            .await
            .expect("count effects")
    }

    dynamic_sql!(sqlx::MySqlConnection, plain, question_marks);

    async fn key_rows(&self, scope: &str) -> Vec<(String, KeyRow)> {
        let rows = sqlx::query(
            "SELECT idempotency_key, state, method, path, fingerprint, status, headers, body \
             FROM idempotency_keys WHERE scope = ? ORDER BY idempotency_key",
        )
        .bind(scope)
        .fetch_all(&self.plain)
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
        .execute(&self.plain)
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
        .execute(&self.plain)
        .await
        .expect("insert expired keys");
    }

    async fn legacy_table(&self, table: &str, body: &[u8]) {
        let first =
            include_str!("../../../idem-runtime/migrations/mysql/0001_idempotency_keys.sql");
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
        .execute(&self.plain)
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
        self.plain.close().await;
        self.admin.close().await;
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
