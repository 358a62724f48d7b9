//! What retention costs: table size per million keys, sweep throughput, and the
//! sweep's effect on first requests running beside it.
//!
//! ```text
//! cargo bench --all-features --bench retention                 # 100 000 expired keys per backend
//! cargo bench --all-features --bench retention -- --rows 1000000 --secs 3
//! cargo bench --all-features --bench retention -- --reseal     # re-sealing instead
//! ```
//!
//! With `--reseal`: the same keys, in plain text, are sealed by `reseal` (what
//! turning sealing on does), then the key is rotated and every record is sealed
//! anew under the new key (opened and sealed again) while first requests run
//! beside it, against the same load alone before.
//!
//! Each backend gets `--rows` expired, completed keys of a realistic size (a
//! 32-byte fingerprint, 64 bytes of headers, a 100-byte body). Then: idem-first
//! load alone; the same load while a sweep (default batches) deletes them; and, on
//! PostgreSQL's partitioned layout, dropping a day partition of the same keys.
//! Servers come from `IDEM_TEST_POSTGRES_URL` and `IDEM_TEST_MYSQL_URL` (skipped
//! if unreachable); SQLite uses a temporary file.

use std::time::{Duration, Instant};

use idem_axum::{Backend, Idempotency, KeyRing, Outcome, Reseal, ResealReport, Sealing, Sweep};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, MySql, Pool, Postgres, Sqlite};

mod common;
use common::{Settings, execute_insert, measure, prepare};

struct Report {
    backend: &'static str,
    bytes_per_million: f64,
    after_sweep_per_million: f64,
    alone: (f64, Duration, Duration),
    beside: (f64, Duration, Duration),
    sweep_rate: f64,
    beside_sweep_rate: f64,
    drop: Option<Duration>,
}

/// Backend-specific SQL: fill `$1` expired keys, and the key table's size.
trait Retention: Backend {
    /// Run before `FILL` on the same connection.
    const BEFORE_FILL: &'static str = "SELECT 1";
    const FILL: &'static str;
    const SIZE: &'static str;
}

impl Retention for Postgres {
    const FILL: &'static str = "INSERT INTO idempotency_keys (scope, idempotency_key, state, lease, \
        method, path, fingerprint, status, headers, body, locked_until, expires_at, created_at) \
        SELECT 'bench', 'old-' || g, 'completed', 1, 'POST', '/effects', \
            decode(md5(g::text) || md5(g::text), 'hex'), 201, convert_to(repeat('h', 64), 'UTF8'), \
            convert_to(repeat('b', 100), 'UTF8'), now() - interval '2 hours', \
            now() - interval '1 second', now() - interval '2 hours' \
        FROM generate_series(1, $1) AS g";
    const SIZE: &'static str = "SELECT pg_total_relation_size('idempotency_keys')::bigint";
}

impl Retention for MySql {
    // MariaDB's name; MySQL 8 calls it cte_max_recursion_depth.
    const BEFORE_FILL: &'static str = "SET SESSION max_recursive_iterations = 100000000";
    const FILL: &'static str = "INSERT INTO idempotency_keys (scope, idempotency_key, state, lease, \
        method, path, fingerprint, status, headers, body, locked_until, expires_at, created_at) \
        WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < ?) \
        SELECT 'bench', CONCAT('old-', n), 'completed', 1, 'POST', '/effects', \
            UNHEX(SHA2(n, 256)), 201, REPEAT('h', 64), REPEAT('b', 100), \
            UTC_TIMESTAMP(6) - INTERVAL 2 HOUR, UTC_TIMESTAMP(6) - INTERVAL 1 SECOND, \
            UTC_TIMESTAMP(6) - INTERVAL 2 HOUR FROM g";
    const SIZE: &'static str = "SELECT CAST(data_length + index_length AS SIGNED) \
        FROM information_schema.TABLES \
        WHERE table_schema = DATABASE() AND table_name = 'idempotency_keys'";
}

impl Retention for Sqlite {
    const FILL: &'static str = "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < ?1) \
        INSERT INTO idempotency_keys (scope, idempotency_key, state, lease, method, path, \
            fingerprint, status, headers, body, locked_until, expires_at, created_at) \
        SELECT 'bench', 'old-' || n, 'completed', 1, 'POST', '/effects', randomblob(32), 201, \
            CAST(substr(hex(zeroblob(64)), 1, 64) AS BLOB), \
            CAST(substr(hex(zeroblob(100)), 1, 100) AS BLOB), 0, 1, 0 FROM g";
    const SIZE: &'static str = "SELECT CAST(sum(pgsize) AS INTEGER) FROM dbstat \
        WHERE name = 'idempotency_keys' OR name LIKE 'sqlite_autoindex_idempotency_keys%' \
           OR name = 'idempotency_keys_expires_at_idx'";
}

async fn size<DB: Retention>(pool: &Pool<DB>) -> i64
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'a> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    i64: sqlx::Type<DB> + for<'r> sqlx::Decode<'r, DB>,
    Option<i64>: sqlx::Type<DB> + for<'r> sqlx::Decode<'r, DB>,
    (Option<i64>,): for<'r> sqlx::FromRow<'r, DB::Row>,
{
    let mut conn = pool.acquire().await.expect("connection");
    if DB::NAME == "MySQL" {
        sqlx::query("ANALYZE TABLE idempotency_keys")
            .execute(&mut *conn)
            .await
            .expect("analyze");
    }
    let (bytes,): (Option<i64>,) = sqlx::query_as(DB::SIZE)
        .fetch_one(&mut *conn)
        .await
        .expect("table size");
    bytes.unwrap_or(0)
}

async fn fill<DB: Retention>(pool: &Pool<DB>, rows: i64)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    i64: sqlx::Type<DB> + for<'e> sqlx::Encode<'e, DB>,
    for<'a> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
{
    let mut conn = pool.acquire().await.expect("connection");
    sqlx::raw_sql(DB::BEFORE_FILL)
        .execute(&mut *conn)
        .await
        .expect("before fill");
    sqlx::query(DB::FILL)
        .bind(rows)
        .execute(&mut *conn)
        .await
        .expect("fill expired keys");
}

async fn first_requests<DB: Backend>(
    settings: &Settings,
    store: &Idempotency<DB>,
    prefix: &'static str,
) -> (f64, Duration, Duration)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'a> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
{
    let store = store.clone();
    let (_, rate, p50, p99) = measure(settings, move |_, n| {
        let store = store.clone();
        async move {
            let key = format!("{prefix}-{n}");
            execute_insert(&store, &key, Duration::ZERO, Outcome::Executed).await;
        }
    })
    .await;
    (rate, p50, p99)
}

async fn run<DB: Retention>(
    settings: &Settings,
    backend: &'static str,
    pool: Pool<DB>,
    id_column: &str,
    rows: i64,
) -> Report
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'a> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    i64: sqlx::Type<DB> + for<'e> sqlx::Encode<'e, DB> + for<'r> sqlx::Decode<'r, DB>,
    Option<i64>: sqlx::Type<DB> + for<'r> sqlx::Decode<'r, DB>,
    (Option<i64>,): for<'r> sqlx::FromRow<'r, DB::Row>,
{
    let store = prepare(&pool, id_column).await;
    let empty = size(&pool).await;
    fill(&pool, rows).await;
    let full = size(&pool).await;
    let bytes_per_million = (full - empty) as f64 * 1e6 / rows as f64;
    // A sweep alone: its own speed, and what the table occupies once the keys are
    // gone (the space is reused by new keys; only VACUUM or OPTIMIZE TABLE returns
    // it to the system).
    let alone_sweep = store
        .sweep(Sweep::new().budget(Duration::from_secs(600)))
        .await
        .expect("sweep");
    let after = size(&pool).await;
    assert_eq!(alone_sweep.deleted, rows as u64);

    fill(&pool, rows).await;
    let alone = first_requests(settings, &store, "alone").await;
    let sweeper = {
        let store = store.clone();
        tokio::spawn(async move {
            store
                .sweep(Sweep::new().budget(Duration::from_secs(600)))
                .await
                .expect("sweep")
        })
    };
    let beside = first_requests(settings, &store, "beside").await;
    let report = sweeper.await.expect("sweep task");
    assert_eq!(report.deleted, rows as u64);
    Report {
        backend,
        bytes_per_million,
        after_sweep_per_million: (after - empty) as f64 * 1e6 / rows as f64,
        alone,
        beside,
        sweep_rate: alone_sweep.deleted as f64 / alone_sweep.elapsed.as_secs_f64(),
        beside_sweep_rate: report.deleted as f64 / report.elapsed.as_secs_f64(),
        drop: None,
    }
}

/// Re-sealing `rows` keys: what the first requests beside it keep.
struct ResealRun {
    backend: &'static str,
    /// Records in plain text sealed, records/s.
    plain_rate: f64,
    /// After a rotation: sealed anew, records/s, while first requests run beside.
    rotation_rate: f64,
    alone: (f64, Duration, Duration),
    beside: (f64, Duration, Duration),
}

fn ring(keys: &[&[u8; 32]]) -> KeyRing {
    KeyRing::from_keys(keys.iter().copied()).expect("a ring")
}

async fn run_reseal<DB: Retention>(
    settings: &Settings,
    backend: &'static str,
    pool: Pool<DB>,
    id_column: &str,
    rows: i64,
) -> ResealRun
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'a> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    i64: sqlx::Type<DB> + for<'e> sqlx::Encode<'e, DB>,
{
    let (old, new) = ([1; 32], [2; 32]);
    let _ = prepare(&pool, id_column).await;
    fill(&pool, rows).await;
    let sealing = |sealing| {
        Idempotency::builder(pool.clone())
            .sealing(sealing)
            .build()
            .expect("store")
    };
    let first = sealing(Sealing::SealsNew(ring(&[&old])));
    let all = Reseal::new().budget(Duration::from_secs(3600));
    let plain = first.reseal(all.plain(true)).await.expect("reseal");
    assert_eq!((plain.resealed, plain.caught_up), (rows as u64, true));

    let rotated = sealing(Sealing::On(ring(&[&new, &old])));
    let alone = first_requests(settings, &rotated, "alone").await;
    let resealer = {
        let rotated = rotated.clone();
        tokio::spawn(async move { rotated.reseal(all).await.expect("reseal") })
    };
    let beside = first_requests(settings, &rotated, "beside").await;
    let rotation: ResealReport = resealer.await.expect("reseal task");
    assert!(
        rotation.caught_up && rotation.unreadable == 0,
        "{rotation:?}"
    );
    assert_eq!(rotation.resealed, rows as u64, "{rotation:?}");
    ResealRun {
        backend,
        plain_rate: plain.resealed as f64 / plain.elapsed.as_secs_f64(),
        rotation_rate: rotation.resealed as f64 / rotation.elapsed.as_secs_f64(),
        alone,
        beside,
    }
}

/// On the partitioned layout: the same keys in a day partition that has ended,
/// dropped by maintenance.
async fn partition_drop(pool: &Pool<Postgres>, rows: i64) -> Duration {
    let store = Idempotency::builder(pool.clone())
        .table("parted_keys")
        .partitioned_by_day()
        .build()
        .expect("store");
    store.migrate().await.expect("migrate");
    sqlx::raw_sql(
        "CREATE TABLE parted_keys_p20000101 PARTITION OF parted_keys \
             FOR VALUES FROM ('2000-01-01 00:00:00+00') TO ('2000-01-02 00:00:00+00')",
    )
    .execute(pool)
    .await
    .expect("an ended day");
    let fill = Postgres::FILL
        .replace("idempotency_keys", "parted_keys")
        .replace("now() - interval '1 second'", "'2000-01-01 12:00:00+00'");
    sqlx::query(AssertSqlSafe(fill))
        .bind(rows)
        .execute(pool)
        .await
        .expect("fill");
    let started = Instant::now();
    let changed = store.maintain_partitions(0).await.expect("maintenance");
    let took = started.elapsed();
    assert!(changed.dropped.iter().any(|p| p == "parted_keys_p20000101"));
    took
}

fn main() {
    let mut settings = Settings {
        secs: 3,
        workers: 16,
    };
    let mut rows: i64 = 100_000;
    let mut reseal = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--reseal" {
            reseal = true;
            continue;
        }
        let value = args.next();
        match (arg.as_str(), value.and_then(|v| v.parse::<u64>().ok())) {
            ("--secs", Some(v)) => settings.secs = v,
            ("--workers", Some(v)) => settings.workers = v as usize,
            ("--rows", Some(v)) => rows = v as i64,
            _ => {} // cargo bench passes --bench
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (reports, reseals) = runtime.block_on(async {
        let mut reports = Vec::new();
        let mut reseals = Vec::new();
        let id = std::process::id();

        let url = std::env::var("IDEM_TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
        let options: PgConnectOptions = url.parse().expect("postgres url");
        if let Ok(admin) = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(options.clone())
            .await
        {
            let schema = format!("idem_retention_{id}");
            sqlx::raw_sql(AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
                .execute(&admin)
                .await
                .expect("schema");
            let pool = PgPoolOptions::new()
                .max_connections(settings.workers as u32 + 2)
                .connect_with(options.options([("search_path", schema.as_str())]))
                .await
                .expect("pool");
            let id_column = "BIGSERIAL PRIMARY KEY";
            if reseal {
                reseals
                    .push(run_reseal(&settings, "postgres", pool.clone(), id_column, rows).await);
            } else {
                let mut report = run(&settings, "postgres", pool.clone(), id_column, rows).await;
                report.drop = Some(partition_drop(&pool, rows).await);
                reports.push(report);
            }
            pool.close().await;
            let _ = sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
                .execute(&admin)
                .await;
        } else {
            eprintln!("PostgreSQL not reachable at {url}: skipped");
        }

        let url = std::env::var("IDEM_TEST_MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
        let options: MySqlConnectOptions = url.parse().expect("mysql url");
        if let Ok(admin) = MySqlPoolOptions::new()
            .max_connections(1)
            .connect_with(options.clone())
            .await
        {
            let database = format!("idem_retention_{id}");
            sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {database}")))
                .execute(&admin)
                .await
                .expect("database");
            let pool = MySqlPoolOptions::new()
                .max_connections(settings.workers as u32 + 2)
                .connect_with(options.database(&database))
                .await
                .expect("pool");
            let id_column = "BIGINT AUTO_INCREMENT PRIMARY KEY";
            if reseal {
                reseals.push(run_reseal(&settings, "mysql", pool.clone(), id_column, rows).await);
            } else {
                reports.push(run(&settings, "mysql", pool.clone(), id_column, rows).await);
            }
            pool.close().await;
            let _ = sqlx::raw_sql(AssertSqlSafe(format!("DROP DATABASE {database}")))
                .execute(&admin)
                .await;
        } else {
            eprintln!("MySQL/MariaDB not reachable at {url}: skipped");
        }

        let path = std::env::temp_dir().join(format!("idem_retention_{id}.db"));
        let pool: Pool<Sqlite> = common::sqlite_pool(&path).await;
        let id_column = "INTEGER PRIMARY KEY AUTOINCREMENT";
        if reseal {
            reseals.push(run_reseal(&settings, "sqlite", pool.clone(), id_column, rows).await);
        } else {
            reports.push(run(&settings, "sqlite", pool.clone(), id_column, rows).await);
        }
        pool.close().await;
        common::remove_sqlite(&path);
        (reports, reseals)
    });
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    if reseal {
        println!(
            "\n{rows} records per backend; first requests from {} workers for {} s\n",
            settings.workers, settings.secs
        );
        println!(
            "| backend | plain sealed, records/s | rotation: sealed anew, records/s | first req/s alone (p50 / p99 ms) | beside the rotation (p50 / p99 ms) |"
        );
        println!("| --- | ---: | ---: | ---: | ---: |");
        for r in &reseals {
            println!(
                "| {} | {:.0} | {:.0} | {:.0} ({:.1} / {:.1}) | {:.0}, {:.2}× ({:.1} / {:.1}) |",
                r.backend,
                r.plain_rate,
                r.rotation_rate,
                r.alone.0,
                ms(r.alone.1),
                ms(r.alone.2),
                r.beside.0,
                r.beside.0 / r.alone.0,
                ms(r.beside.1),
                ms(r.beside.2),
            );
        }
        return;
    }

    println!(
        "\n{rows} expired keys per backend; first requests from {} workers for {} s\n",
        settings.workers, settings.secs
    );
    println!(
        "| backend | MB per million keys | after a sweep | sweep rows/s alone | first req/s alone (p50 / p99 ms) | beside a sweep (p50 / p99 ms) | sweep rows/s beside | partition drop |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in &reports {
        println!(
            "| {} | {:.0} | {:.0} | {:.0} | {:.0} ({:.1} / {:.1}) | {:.0}, {:.2}× ({:.1} / {:.1}) | {:.0} | {} |",
            r.backend,
            r.bytes_per_million / 1e6,
            r.after_sweep_per_million / 1e6,
            r.sweep_rate,
            r.alone.0,
            ms(r.alone.1),
            ms(r.alone.2),
            r.beside.0,
            r.beside.0 / r.alone.0,
            ms(r.beside.1),
            ms(r.beside.2),
            r.beside_sweep_rate,
            r.drop
                .map_or("-".to_owned(), |d| format!("{:.1} ms", ms(d))),
        );
    }
}
