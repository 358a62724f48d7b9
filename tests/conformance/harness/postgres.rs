//! PostgreSQL, in both layouts.

use std::time::Duration;

use idem_axum::{Idempotency, Tx};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres, Row};

use super::*;
use crate::session::EFFECT;

/// PostgreSQL, in the plain layout (`Pg`) or partitioned by day (`PgParted`).
pub struct PgLayout<const PARTITIONED: bool> {
    admin: PgPool,
    /// The stores' pool: through PgBouncer on a pooler run.
    pool: PgPool,
    /// Straight to the server, for the suite's own reads and writes.
    direct: PgPool,
    /// `direct` at READ COMMITTED, for the suite's read-backs: on a SERIALIZABLE
    /// run a read-back beside a storm may be refused (40001), and the reads are
    /// not what is under test.
    reader: PgPool,
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

    // Superuser-only; the tests connect as one.
    const OUTLAST_DEADLOCKS: Option<&'static str> = Some("SET LOCAL deadlock_timeout = '60s'");

    fn direct_pool(&self) -> &PgPool {
        &self.direct
    }

    const ERROR_VOIDS_TRANSACTION: bool = true;

    const CLAIMS_READABLE_IN_FLIGHT: bool = false;

    // A session-level lock cannot outlive a transaction through a pooler.
    fn holds_keys_past_their_transaction(&self) -> bool {
        !self.pooled
    }

    const ENDING_STATEMENTS: &'static [&'static str] = &[
        "COMMIT",
        "END",
        "COMMIT AND CHAIN",
        "ROLLBACK",
        "ABORT",
        "ROLLBACK AND CHAIN",
    ];

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
                // Every role may use the schema, as the `public` schema's default
                // is: records then go through the record function (upgrade 4). A
                // schema closed to other roles makes idem send the restore and the
                // record as two statements: `IDEM_TEST_POSTGRES_PRIVATE_SCHEMA=1`.
                let open_to_all =
                    if std::env::var("IDEM_TEST_POSTGRES_PRIVATE_SCHEMA").is_ok_and(|v| v == "1") {
                        String::new()
                    } else {
                        format!("GRANT USAGE ON SCHEMA {schema} TO PUBLIC;")
                    };
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                    "CREATE SCHEMA {schema}; CREATE SCHEMA {schema}_other; {open_to_all}"
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
                         DROP SCHEMA IF EXISTS {schema}_other CASCADE; \
                         DROP SCHEMA IF EXISTS {schema}_tenant CASCADE; \
                         DROP SCHEMA IF EXISTS {schema}_bare CASCADE"
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
        let reader = (*direct.connect_options())
            .clone()
            .options([("default_transaction_isolation", "read committed")]);
        let reader = PgPoolOptions::new()
            .max_connections(2)
            .connect_with(reader)
            .await
            .expect("connect the reader");
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
            reader,
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
        self.instance_on(self.other_pool.clone())
            .build()
            .expect("another instance")
    }

    fn instance_on(&self, pool: PgPool) -> Builder<Postgres> {
        let mut builder =
            Idempotency::builder(pool).max_response_bytes(self.store.max_response_bytes());
        if PARTITIONED {
            builder = builder.partitioned_by_day();
        }
        if self.pooled {
            // No listen pool: this instance's waiters look again on their own.
            builder = builder.transaction_pooled();
        }
        builder
    }

    fn insert_effect<'a>(
        tx: &'a mut Tx<Postgres>,
        scope: &'a str,
        note: &'a str,
    ) -> BoxFuture<'a, Result<i64, sqlx::Error>> {
        Box::pin(async move {
            // Unprepared, as statements must be through a transaction pooler.
            sqlx::query_scalar("INSERT INTO effects (scope, note) VALUES ($1, $2) RETURNING id")
                .persistent(false)
                .bind(scope)
                .bind(note)
                .fetch_one(tx)
                .await
        })
    }

    async fn effects(&self, scope: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE scope = $1")
            .bind(scope)
            .fetch_one(&self.reader)
            .await
            .expect("count effects")
    }

    dynamic_sql!(sqlx::PgConnection, reader, str::to_owned);

    async fn key_rows(&self, scope: &str) -> Vec<(String, KeyRow)> {
        let rows = sqlx::query(
            "SELECT idempotency_key, state, method, path, fingerprint, status, headers, body \
             FROM idempotency_keys WHERE scope = $1 ORDER BY idempotency_key",
        )
        .bind(scope)
        .fetch_all(&self.reader)
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
        .bind(&idem_axum::fingerprint(body)[..])
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
            include_str!(
                "../../../idem-runtime/migrations/postgres/partitioned/0001_idempotency_keys.sql"
            )
        } else {
            include_str!("../../../idem-runtime/migrations/postgres/0001_idempotency_keys.sql")
        };
        self.script(&first.replace("idempotency_keys", table)).await;
        if PARTITIONED {
            // The first release's table had a default partition, which took these.
            self.script(&format!(
                "CREATE TABLE {table}_default PARTITION OF {table} DEFAULT"
            ))
            .await;
        }
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {table} (scope, idempotency_key, state, lease, method, path, \
                 fingerprint, status, headers, body, locked_until, expires_at, created_at) \
             VALUES ('alice', 'k-old', 'completed', 1, 'POST', '/effects', $1, 201, \
                     'content-type: application/json\r\n'::bytea, 'old-body'::bytea, \
                     now(), now() + interval '1 hour', now()), \
                    ('alice', 'k-stale', 'processing', 2, 'POST', '/effects', $1, NULL, \
                     NULL, NULL, now() - interval '1 second', now() + interval '1 hour', now())"
        )))
        .bind(&idem_axum::fingerprint(body)[..])
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

    async fn session_changes(&self) -> Vec<SessionChange> {
        // The tables live in `home`: the test's schema, or `public` of the test's
        // database on a pooler run. A tenant's schema holds a table of idem's name.
        let home: String = sqlx::query_scalar("SELECT current_schema()")
            .fetch_one(&self.direct)
            .await
            .expect("the test's schema");
        let (tenant, bare) = (
            format!("{}_tenant", self.schema),
            format!("{}_bare", self.schema),
        );
        // A tenant's role, as row-level security setups switch to: it may write
        // its own rows of `effects`, and nothing of idem's. Roles are the
        // cluster's: one name for every test, created once.
        sqlx::raw_sql(
            "DO $$ BEGIN CREATE ROLE idem_test_tenant NOLOGIN; \
             EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$",
        )
        .execute(&self.admin)
        .await
        .expect("the tenant's role");
        self.script(&format!(
            "CREATE SCHEMA {tenant}; CREATE SCHEMA {bare}; \
             CREATE TABLE {tenant}.idempotency_keys (LIKE {home}.idempotency_keys INCLUDING ALL); \
             GRANT USAGE ON SCHEMA {home} TO idem_test_tenant; \
             GRANT SELECT, INSERT ON {home}.effects TO idem_test_tenant; \
             GRANT USAGE ON SEQUENCE {home}.effects_id_seq TO idem_test_tenant; \
             ALTER TABLE {home}.effects ENABLE ROW LEVEL SECURITY; \
             CREATE POLICY effects_of_the_tenant ON {home}.effects TO idem_test_tenant \
                 USING (scope = current_setting('app.tenant', true)) \
                 WITH CHECK (scope = current_setting('app.tenant', true))"
        ))
        .await;
        let shadow = Some(format!("DELETE FROM {tenant}.idempotency_keys"));
        let case = |name: &str, statements: &[&str], shadow: &Option<String>| SessionChange {
            name: name.to_owned(),
            statements: statements.iter().map(|s| (*s).to_owned()).collect(),
            shadow: shadow.clone(),
        };
        let tenant_first = format!("SET LOCAL search_path = {tenant}, {home}");
        let tenant_session = format!("SET search_path = {tenant}, {home}");
        let bare_local = format!("SELECT set_config('search_path', '{bare}', true)");
        vec![
            case(
                "SET LOCAL search_path, a tenant's schema with a table of idem's name first",
                &[&tenant_first],
                &shadow,
            ),
            case(
                "SET search_path for the session",
                &[&tenant_session],
                &shadow,
            ),
            case(
                "set_config('search_path', …, true) to a schema without tables",
                &[EFFECT, &bare_local],
                &None,
            ),
            case(
                "SET LOCAL ROLE and a tenant's setting for row-level security",
                &[
                    "SET LOCAL ROLE idem_test_tenant",
                    "SELECT set_config('app.tenant', '{scope}', true)",
                ],
                &None,
            ),
            case(
                "SET ROLE for the session",
                &[
                    "SET ROLE idem_test_tenant",
                    "SELECT set_config('app.tenant', '{scope}', false)",
                ],
                &None,
            ),
            case(
                "SET LOCAL SESSION AUTHORIZATION",
                &[
                    "SET LOCAL SESSION AUTHORIZATION idem_test_tenant",
                    "SELECT set_config('app.tenant', '{scope}', true)",
                ],
                &None,
            ),
            case(
                "SET SESSION AUTHORIZATION for the session",
                &[
                    "SET SESSION AUTHORIZATION idem_test_tenant",
                    "SELECT set_config('app.tenant', '{scope}', false)",
                ],
                &None,
            ),
            case("RESET ALL", &[EFFECT, "RESET ALL"], &None),
            case(
                "SET default_transaction_read_only for the session",
                &[EFFECT, "SET default_transaction_read_only = on"],
                &None,
            ),
            case(
                "output formats, date style and time zone",
                &[
                    "SET LOCAL bytea_output = 'escape'",
                    "SET LOCAL DateStyle = 'SQL, DMY'",
                    "SET LOCAL IntervalStyle = 'iso_8601'",
                    "SET LOCAL TimeZone = 'Pacific/Kiritimati'",
                    "SET LOCAL extra_float_digits = -15",
                ],
                &None,
            ),
            case(
                "session_replication_role = replica",
                &["SET LOCAL session_replication_role = replica"],
                &None,
            ),
            case(
                "shorter statement, lock and idle timeouts",
                &[
                    "SET LOCAL statement_timeout = '5s'",
                    "SET LOCAL lock_timeout = '1ms'",
                    "SET LOCAL idle_in_transaction_session_timeout = '5s'",
                ],
                &None,
            ),
        ]
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
        // A key's session lock left on a pooled connection would hold that key
        // for the connection's life: once every answer is out, none is held by a
        // session outside a transaction. (Inside one, a claim may still be at work.)
        let left: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND a.state = 'idle' \
               AND (a.application_name = $1 OR a.datname = $1)",
        )
        .bind(&self.schema)
        .fetch_one(&self.admin)
        .await
        .expect("read pg_locks");
        assert_eq!(left, 0, "sessions keep a key's session lock");
        self.pool.close().await;
        self.other_pool.close().await;
        self.direct.close().await;
        self.reader.close().await;
        self.admin.close().await;
    }
}
