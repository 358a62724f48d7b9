//! MySQL and MariaDB, one database per test.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_axum::{Builder, Idempotency, Tx};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{MySql, MySqlPool, Row};

use super::*;
use crate::session::EFFECT;

pub struct My {
    admin: MySqlPool,
    /// The application's pool, with the run's session settings; the store's.
    pool: MySqlPool,
    /// The test database without them, for the harness's own reads and fixtures.
    plain: MySqlPool,
    store: Idempotency<MySql>,
    database: String,
    /// The run's session settings, which `pool` sets on every session.
    settings: String,
    /// The test database through another node of a cluster, with the same
    /// settings (`IDEM_TEST_MYSQL_OTHER_URL`).
    other: Option<MySqlPool>,
    /// The store runs the cluster mode: the server is a Galera node, or
    /// `IDEM_TEST_MYSQL_GALERA=1` forced it.
    galera: bool,
    _leftover: Leftover,
}

impl My {
    /// A store on a pool of one connection whose sessions start with `init` (the
    /// application's own session settings).
    pub async fn store_with_session(&self, init: &'static str) -> (MySqlPool, Idempotency<MySql>) {
        let options = (*self.plain.connect_options()).clone();
        let pool = pool_running(options, 1, init.to_owned()).await;
        let store = builder(pool.clone()).build().expect("store");
        (pool, store)
    }

    /// A store whose pool is configured for the test's database, but whose
    /// sessions `USE` another one as they connect, of the test's own, which holds
    /// the application's table `effects` and nothing of idem's: the session's
    /// database is not the pool's. Returns that database's name too.
    pub async fn store_moved_by_session(&self) -> (Idempotency<MySql>, String) {
        let elsewhere = format!("{}_moved", self.database);
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE DATABASE {elsewhere}; CREATE TABLE {elsewhere}.effects LIKE {}.effects",
            self.database
        )))
        .execute(&self.admin)
        .await
        .expect("another database");
        let pool = self.store_moved_by_session_pool(&elsewhere).await;
        (builder(pool).build().expect("store"), elsewhere)
    }

    /// A pool configured for the test's database whose sessions `USE` `elsewhere`.
    pub async fn store_moved_by_session_pool(&self, elsewhere: &str) -> MySqlPool {
        let options = (*self.plain.connect_options()).clone();
        pool_running(options, 2, format!("USE {elsewhere}")).await
    }

    /// Holds (`scope`, `key`) in the default table as an executor in flight of a
    /// `POST /effects` with the suite's `BODY` would, until [`HeldKey::release`]: the named lock that every release of idem
    /// takes for the key, on a session of its own in the test's database (freed at
    /// that session's end if the test fails first); in the cluster mode, a live
    /// claim's committed row.
    pub async fn hold_key(&self, scope: &str, key: &str) -> HeldKey {
        if self.galera {
            sqlx::query(
                "INSERT INTO idempotency_keys (scope, idempotency_key, state, lease, method, \
                     path, fingerprint, locked_until, expires_at, created_at) \
                 VALUES (?, ?, 'processing', 42, 'POST', '/effects', ?, \
                     UTC_TIMESTAMP(6) + INTERVAL 1 HOUR, UTC_TIMESTAMP(6) + INTERVAL 1 DAY, \
                     UTC_TIMESTAMP(6))",
            )
            .bind(scope)
            .bind(key)
            .bind(&idem_axum::fingerprint(crate::BODY.as_bytes())[..])
            .execute(&self.plain)
            .await
            .expect("a claim's row");
            return HeldKey::Row {
                pool: self.plain.clone(),
                scope: scope.to_owned(),
                key: key.to_owned(),
            };
        }
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
        HeldKey::Lock { conn, name }
    }

    /// A pool on the test's database, with the run's session settings, that
    /// notes the server's id of every session it opens.
    pub async fn pool_noting_sessions(&self) -> (MySqlPool, Arc<Mutex<Vec<u64>>>) {
        let sessions = Arc::new(Mutex::new(Vec::new()));
        let noted = Arc::clone(&sessions);
        let settings = self.settings.clone();
        let pool = MySqlPoolOptions::new()
            .max_connections(8)
            .after_connect(move |conn, _| {
                let (noted, settings) = (Arc::clone(&noted), settings.clone());
                Box::pin(async move {
                    if !settings.is_empty() {
                        sqlx::raw_sql(sqlx::AssertSqlSafe(settings))
                            .execute(&mut *conn)
                            .await?;
                    }
                    let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
                        .fetch_one(&mut *conn)
                        .await?;
                    noted.lock().expect("sessions").push(id);
                    Ok(())
                })
            })
            .connect_with((*self.plain.connect_options()).clone())
            .await
            .expect("connect to the test database");
        (pool, sessions)
    }

    /// What the application's pools send on every new session (the run's
    /// settings), empty when the run has none.
    pub fn session_settings(&self) -> &str {
        &self.settings
    }

    /// The server's own pool, outside the test's database (`mysql.*`, globals).
    pub fn admin(&self) -> &MySqlPool {
        &self.admin
    }
}

/// A key held by the test (see [`My::hold_key`]).
pub enum HeldKey {
    Lock {
        conn: sqlx::pool::PoolConnection<MySql>,
        name: String,
    },
    Row {
        pool: MySqlPool,
        scope: String,
        key: String,
    },
}

impl HeldKey {
    /// Frees the key and waits for the server to say so: a closed session's
    /// locks are freed only once the server has noticed the close.
    pub async fn release(self) {
        match self {
            Self::Lock { mut conn, name } => {
                let freed: Option<i64> = sqlx::query_scalar("SELECT RELEASE_LOCK(?)")
                    .bind(&name)
                    .fetch_one(&mut *conn)
                    .await
                    .expect("RELEASE_LOCK");
                assert_eq!(freed, Some(1), "the lock was this session's");
            }
            Self::Row { pool, scope, key } => {
                let deleted = sqlx::query(
                    "DELETE FROM idempotency_keys WHERE scope = ? AND idempotency_key = ? \
                       AND lease = 42",
                )
                .bind(scope)
                .bind(key)
                .execute(&pool)
                .await
                .expect("delete the claim's row");
                assert_eq!(deleted.rows_affected(), 1, "the claim was the test's");
            }
        }
    }
}

impl Harness for My {
    type DB = MySql;

    fn claims_commit_first(&self) -> bool {
        self.galera
    }

    fn takeover_after(&self, lock: Duration) -> Duration {
        if self.galera { lock * 2 } else { lock }
    }

    // MariaDB's INNODB_TRX showed a waiting transaction as RUNNING, or not at all;
    // a statement blocked on a row stays in the `Updating` state.
    const LOCK_WAITS: &'static str = "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
         WHERE DB = DATABASE() AND LOWER(STATE) = 'updating'";

    const ROW_LOCK_WAITS: &'static str = "SELECT COUNT(*) FROM information_schema.INNODB_TRX t \
         JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id \
         WHERE t.trx_state = 'LOCK WAIT' AND p.DB = DATABASE()";

    // The whole class, each kind and answer, is `ended.rs`'s.
    const ENDING_STATEMENTS: &'static [&'static str] = &["COMMIT", "BEGIN"];

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
        let settings = settings.join("; ");
        let pool = pool_running(options.clone().database(&database), 24, settings.clone()).await;
        // On a cluster, the read-backs wait for this node to have applied what
        // the cluster committed (through the other node too): a count read
        // without it may miss a commit made there a moment ago.
        let causal = std::env::var_os("IDEM_TEST_MYSQL_OTHER_URL").is_some();
        let plain = MySqlPoolOptions::new()
            .max_connections(8)
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    if causal {
                        sqlx::raw_sql("SET SESSION wsrep_sync_wait = 1")
                            .execute(conn)
                            .await?;
                    }
                    Ok(())
                })
            })
            .connect_with(options.database(&database))
            .await
            .expect("connect to test database");
        let other = match std::env::var("IDEM_TEST_MYSQL_OTHER_URL") {
            Ok(url) => {
                let options: MySqlConnectOptions = url.parse().expect("IDEM_TEST_MYSQL_OTHER_URL");
                // The database created through the first node exists on this one
                // once the node has applied what the cluster committed before.
                let mut node = sqlx::MySqlConnection::connect_with(&options)
                    .await
                    .expect("connect to the other node");
                sqlx::raw_sql("SET SESSION wsrep_sync_wait = 1")
                    .execute(&mut node)
                    .await
                    .expect("wsrep_sync_wait");
                let there: i64 = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = ?",
                )
                .bind(&database)
                .fetch_one(&mut node)
                .await
                .expect("the other node's databases");
                assert_eq!(there, 1, "the test database on the other node");
                Some(pool_running(options.database(&database), 24, settings.clone()).await)
            }
            Err(_) => None,
        };
        sqlx::raw_sql(
            "CREATE TABLE effects (id BIGINT AUTO_INCREMENT PRIMARY KEY, scope VARCHAR(255) NOT NULL, note TEXT NOT NULL)",
        )
        .execute(&pool)
        .await
        .expect("create effects");
        let store = builder(pool.clone())
            .max_response_bytes(max_response_bytes)
            .build()
            .expect("store");
        store.migrate().await.expect("migrate");
        let wsrep_on: Result<i64, _> = sqlx::query_scalar("SELECT CAST(@@wsrep_on AS SIGNED)")
            .fetch_one(&admin)
            .await;
        let galera = match std::env::var("IDEM_TEST_MYSQL_GALERA").as_deref() {
            Ok("1") => true,
            Ok("0") => false,
            _ => wsrep_on.is_ok_and(|on| on == 1),
        };
        let leftover = Leftover::statement::<sqlx::MySqlConnection>(
            url,
            format!(
                "DROP DATABASE IF EXISTS {database}; DROP DATABASE IF EXISTS {database}_tenant; \
                 DROP DATABASE IF EXISTS {database}_bare; DROP DATABASE IF EXISTS {database}_moved"
            ),
        );
        Some(Self {
            admin,
            pool,
            plain,
            store,
            database,
            settings,
            other,
            galera,
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
                .execute(tx)
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
             VALUES (?, ?, 'processing', 42, ?, ?, ?, UTC_TIMESTAMP(6) - INTERVAL 31 SECOND, \
                 UTC_TIMESTAMP(6) + INTERVAL 1 HOUR, UTC_TIMESTAMP(6) - INTERVAL 61 SECOND)",
        )
        .bind(scope)
        .bind(key)
        .bind(method)
        .bind(path)
        .bind(&idem_axum::fingerprint(body)[..])
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
        .bind(&idem_axum::fingerprint(body)[..])
        .bind(&idem_axum::fingerprint(body)[..])
        .execute(&self.plain)
        .await
        .expect("legacy rows");
    }

    fn instance_on(&self, pool: MySqlPool) -> Builder<MySql> {
        builder(pool).max_response_bytes(self.store.max_response_bytes())
    }

    /// On a cluster (`IDEM_TEST_MYSQL_OTHER_URL`), another instance writes through
    /// another node, as instances behind a load balancer do.
    fn another_instance(&self) -> Idempotency<MySql> {
        let Some(pool) = &self.other else {
            return self.instance_on(self.pool.clone()).build().expect("store");
        };
        self.instance_on(pool.clone()).build().expect("store")
    }

    fn store_on(&self, table: &str) -> Idempotency<MySql> {
        builder(self.pool.clone())
            .table(table)
            .build()
            .expect("store")
    }

    async fn session_changes(&self) -> Vec<SessionChange> {
        let db = &self.database;
        let (tenant, bare) = (format!("{db}_tenant"), format!("{db}_bare"));
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE DATABASE {tenant}; CREATE DATABASE {bare}; \
             CREATE TABLE {tenant}.idempotency_keys LIKE {db}.idempotency_keys; \
             CREATE TABLE {tenant}.effects LIKE {db}.effects"
        )))
        .execute(&self.admin)
        .await
        .expect("a tenant's database");
        let shadow = Some(format!("DELETE FROM {tenant}.idempotency_keys"));
        let case = |name: &str, statements: &[&str], shadow: &Option<String>| SessionChange {
            name: name.to_owned(),
            statements: statements.iter().map(|s| (*s).to_owned()).collect(),
            shadow: shadow.clone(),
        };
        let use_tenant = format!("USE {tenant}");
        let use_bare = format!("USE {bare}");
        vec![
            case(
                "USE a tenant's database with a table of idem's name",
                &[EFFECT, &use_tenant],
                &shadow,
            ),
            case("USE a database without tables", &[EFFECT, &use_bare], &None),
            case(
                "SET SESSION sql_mode, ANSI quotes and no backslash escapes",
                &[
                    "SET SESSION sql_mode = 'ANSI_QUOTES,PIPES_AS_CONCAT,NO_BACKSLASH_ESCAPES,\
                   STRICT_ALL_TABLES,ONLY_FULL_GROUP_BY,NO_ZERO_DATE,NO_UNSIGNED_SUBTRACTION'",
                ],
                &None,
            ),
            case(
                "SET SESSION sql_mode to none",
                &["SET SESSION sql_mode = ''"],
                &None,
            ),
            case(
                "SET time_zone ahead of UTC",
                &["SET SESSION time_zone = '+13:00'"],
                &None,
            ),
            case(
                "SET time_zone behind UTC",
                &["SET time_zone = '-11:00'"],
                &None,
            ),
            case(
                "SET SESSION sql_select_limit = 0",
                &["SET SESSION sql_select_limit = 0"],
                &None,
            ),
            case(
                "SET SESSION max_join_size = 1",
                &["SET SESSION max_join_size = 1"],
                &None,
            ),
            case("SET NAMES latin1", &["SET NAMES latin1"], &None),
            case(
                "SET SESSION TRANSACTION ISOLATION LEVEL READ UNCOMMITTED",
                &["SET SESSION TRANSACTION ISOLATION LEVEL READ UNCOMMITTED"],
                &None,
            ),
            case(
                "SET SESSION TRANSACTION ISOLATION LEVEL SERIALIZABLE",
                &["SET SESSION TRANSACTION ISOLATION LEVEL SERIALIZABLE"],
                &None,
            ),
            case(
                "SET SESSION TRANSACTION READ ONLY",
                &["SET SESSION TRANSACTION READ ONLY"],
                &None,
            ),
            case(
                "SET SESSION autocommit = 0",
                &["SET SESSION autocommit = 0"],
                &None,
            ),
            case(
                "safe updates, no key checks, no division digits",
                &[
                    "SET SESSION sql_safe_updates = 1",
                    "SET SESSION foreign_key_checks = 0",
                    "SET SESSION unique_checks = 0",
                    "SET SESSION div_precision_increment = 0",
                ],
                &None,
            ),
            case(
                "shorter lock waits",
                &[
                    "SET SESSION innodb_lock_wait_timeout = 1",
                    "SET SESSION lock_wait_timeout = 1",
                ],
                &None,
            ),
        ]
    }

    async fn one_session_store(&self) -> (MySqlPool, Idempotency<MySql>) {
        let options = (*self.pool.connect_options()).clone();
        let pool = pool_running(options, 1, self.settings.clone()).await;
        let store = self.instance_on(pool.clone()).build().expect("store");
        (pool, store)
    }

    async fn open_transactions(&self) -> i64 {
        // INNODB_TRX is a cache refreshed at most every 0.1 s (idem's own
        // `Retry-After` query fills it too): a transaction it lists may have ended
        // since, and a connection given back to the pool is rolled back by a task
        // of sqlx's, late on a loaded machine (a CI run once saw one still open
        // after 1.5 s). One left open stays listed however long this waits.
        let mut open = 0;
        for _ in 0..40 {
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
        if let Some(other) = &self.other {
            other.close().await;
        }
        self.pool.close().await;
        self.plain.close().await;
        self.admin.close().await;
    }
}

/// A store's settings on `pool`: with `IDEM_TEST_MYSQL_GALERA=1`, the cluster
/// mode even on a standalone server (on a cluster the server says so itself);
/// with `=0`, the standalone design even on a cluster (which must fail there:
/// the proof that the cluster's tests can).
fn builder(pool: MySqlPool) -> Builder<MySql> {
    let store = Idempotency::builder(pool);
    match std::env::var("IDEM_TEST_MYSQL_GALERA").as_deref() {
        Ok("1") => store.galera(true),
        Ok("0") => store.galera(false),
        _ => store,
    }
}

/// A pool on `options` whose sessions run `init` (statements; none when empty) as
/// they connect: an application's own session settings.
async fn pool_running(options: MySqlConnectOptions, max: u32, init: String) -> MySqlPool {
    MySqlPoolOptions::new()
        .max_connections(max)
        .after_connect(move |conn, _| {
            let init = init.clone();
            Box::pin(async move {
                if !init.is_empty() {
                    sqlx::raw_sql(sqlx::AssertSqlSafe(init))
                        .execute(conn)
                        .await?;
                }
                Ok(())
            })
        })
        .connect_with(options)
        .await
        .expect("connect to the test database")
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
