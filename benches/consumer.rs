//! Messages per second through a consumer's handler, four ways, paired in one
//! run on each backend:
//! - `bare`: an at-least-once consumer (the business write in a transaction;
//!   duplicates run again);
//! - `inbox`: a hand-written inbox, the message id inserted in the same
//!   transaction, a duplicate found by its key (the issue's floor);
//! - `guarded`: the inbox with what idem's answers need: the payload's
//!   fingerprint stored with the id and compared on a duplicate, the result
//!   recorded with the business write and handed to the duplicate, and, on
//!   PostgreSQL, the transaction bounded by the server as a claim's lock bounds
//!   it. It still waits on the row's lock for a delivery in flight, where idem
//!   defers it, and keeps no expiry, scope or source;
//! - `idem`: `Idempotency::process`.
//!
//! ```text
//! cargo bench --all-features --bench consumer                        # 3 rounds × 3 s
//! cargo bench --all-features --bench consumer -- --rounds 5 --secs 4
//! ```
//!
//! Eight workers take messages from one stream, as a consumer with a prefetch of
//! eight does; the broker is left out, so that what is measured is what each
//! design sends to the database. A stream has 0 % or 20 % redeliveries (every
//! fifth message the id of one 200 messages earlier, done by then). Rounds
//! alternate the variants; idem / inbox and idem / guarded are taken within each
//! round, and their medians reported. Servers are found as in the test suite
//! (`IDEM_TEST_POSTGRES_URL`, `IDEM_TEST_MYSQL_URL`); an unreachable one is
//! skipped.

#![allow(missing_docs)]

mod common;

use std::future::Future;
use std::pin::Pin;

use idem_axum::{Backend, Delivery, Idempotency, Options, Processed};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, MySql, Postgres, Sqlite};

use common::{INSERT, Settings, measure};
use sha2::{Digest, Sha256};

const WORKERS: usize = 8;
const PAYLOAD: &[u8] = br#"{"order":42,"amount":1000}"#;

#[derive(Clone, Copy, PartialEq)]
enum Variant {
    Bare,
    Inbox,
    Guarded,
    Idem,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Self::Bare => "bare",
            Self::Inbox => "inbox",
            Self::Guarded => "guarded",
            Self::Idem => "idem",
        }
    }
}

/// The id of the `n`-th message of a stream with `redelivered` percent
/// redeliveries.
fn message_id(prefix: &str, n: u64, redelivered: u64) -> String {
    if redelivered > 0 && n >= 200 && n.is_multiple_of(100 / redelivered) {
        format!("{prefix}-{}", n - 200)
    } else {
        format!("{prefix}-{n}")
    }
}

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A value bound to an inbox's statement.
enum Bound {
    Text(String),
    Bytes(Vec<u8>),
}

/// The hand-written inboxes' statements, in each backend's dialect.
trait Inbox: Backend {
    /// The inboxes' tables.
    const TABLES: &'static str;
    /// Opens the guarded inbox's transaction: bounded, where the backend has
    /// settings of the transaction, as idem bounds a claim's by its lock.
    const BEGIN_GUARDED: &'static str;
    /// Inserts the id, and the payload's fingerprint for the guarded inbox, unless
    /// the id is there.
    const INSERT_ID: &'static str;
    const INSERT_GUARDED: &'static str;
    /// What a duplicate is answered from: the first delivery's fingerprint and
    /// result.
    const FOUND: &'static str;
    const RECORD: &'static str;

    /// Runs `sql` with `binds`: the rows it changed.
    fn run<'a>(
        conn: &'a mut <Self as sqlx::Database>::Connection,
        sql: &'static str,
        binds: Vec<Bound>,
    ) -> BoxFuture<'a, u64>;

    /// The fingerprint and result stored for `id`.
    fn found<'a>(
        conn: &'a mut <Self as sqlx::Database>::Connection,
        id: String,
    ) -> BoxFuture<'a, (Vec<u8>, Option<Vec<u8>>)>;
}

/// The inboxes' statements of one backend, `$n` or `?` as its placeholders.
macro_rules! inbox {
    ($db:ty, $conn:ty, tables: $tables:expr, begin: $begin:expr,
     insert: $insert:expr, guarded: $guarded:expr, found: $found:expr, record: $record:expr) => {
        impl Inbox for $db {
            const TABLES: &'static str = $tables;
            const BEGIN_GUARDED: &'static str = $begin;
            const INSERT_ID: &'static str = $insert;
            const INSERT_GUARDED: &'static str = $guarded;
            const FOUND: &'static str = $found;
            const RECORD: &'static str = $record;

            fn run<'a>(
                conn: &'a mut $conn,
                sql: &'static str,
                binds: Vec<Bound>,
            ) -> BoxFuture<'a, u64> {
                Box::pin(async move {
                    let query = binds.into_iter().fold(sqlx::query(sql), |q, b| match b {
                        Bound::Text(text) => q.bind(text),
                        Bound::Bytes(bytes) => q.bind(bytes),
                    });
                    query.execute(conn).await.expect("inbox").rows_affected()
                })
            }

            fn found<'a>(
                conn: &'a mut $conn,
                id: String,
            ) -> BoxFuture<'a, (Vec<u8>, Option<Vec<u8>>)> {
                Box::pin(async move {
                    sqlx::query_as(Self::FOUND)
                        .bind(id)
                        .fetch_one(conn)
                        .await
                        .expect("found")
                })
            }
        }
    };
}

inbox!(Postgres, sqlx::PgConnection,
    tables: "CREATE TABLE inbox (id VARCHAR(255) PRIMARY KEY); \
             CREATE TABLE guarded_inbox (id VARCHAR(255) PRIMARY KEY, \
                 fingerprint BYTEA NOT NULL, result BYTEA)",
    begin: "BEGIN; SET LOCAL statement_timeout = 30000; \
            SET LOCAL idle_in_transaction_session_timeout = 30000",
    insert: "INSERT INTO inbox (id) VALUES ($1) ON CONFLICT DO NOTHING",
    guarded: "INSERT INTO guarded_inbox (id, fingerprint) VALUES ($1, $2) ON CONFLICT DO NOTHING",
    found: "SELECT fingerprint, result FROM guarded_inbox WHERE id = $1",
    record: "UPDATE guarded_inbox SET result = $1 WHERE id = $2");

// MySQL has no setting of the transaction alone: its guarded inbox is unbounded.
inbox!(MySql, sqlx::MySqlConnection,
    tables: "CREATE TABLE inbox (id VARCHAR(255) PRIMARY KEY); \
             CREATE TABLE guarded_inbox (id VARCHAR(255) PRIMARY KEY, \
                 fingerprint VARBINARY(32) NOT NULL, result BLOB)",
    begin: "BEGIN",
    insert: "INSERT IGNORE INTO inbox (id) VALUES (?)",
    guarded: "INSERT IGNORE INTO guarded_inbox (id, fingerprint) VALUES (?, ?)",
    found: "SELECT fingerprint, result FROM guarded_inbox WHERE id = ?",
    record: "UPDATE guarded_inbox SET result = ? WHERE id = ?");

inbox!(Sqlite, sqlx::SqliteConnection,
    tables: "CREATE TABLE inbox (id VARCHAR(255) PRIMARY KEY); \
             CREATE TABLE guarded_inbox (id VARCHAR(255) PRIMARY KEY, \
                 fingerprint BLOB NOT NULL, result BLOB)",
    begin: "BEGIN",
    insert: "INSERT INTO inbox (id) VALUES (?) ON CONFLICT DO NOTHING",
    guarded: "INSERT INTO guarded_inbox (id, fingerprint) VALUES (?, ?) ON CONFLICT DO NOTHING",
    found: "SELECT fingerprint, result FROM guarded_inbox WHERE id = ?",
    record: "UPDATE guarded_inbox SET result = ? WHERE id = ?");

/// One message through `variant`.
async fn consume<DB: Inbox>(variant: Variant, store: &Idempotency<DB>, id: String)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'a> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
{
    match variant {
        Variant::Bare => {
            let mut tx = store.pool().begin().await.expect("begin");
            sqlx::query(INSERT).execute(&mut *tx).await.expect("insert");
            tx.commit().await.expect("commit");
        }
        Variant::Inbox => {
            let mut tx = store.pool().begin().await.expect("begin");
            if DB::run(&mut tx, DB::INSERT_ID, vec![Bound::Text(id)]).await == 1 {
                sqlx::query(INSERT).execute(&mut *tx).await.expect("insert");
            }
            tx.commit().await.expect("commit");
        }
        Variant::Guarded => {
            let fingerprint = Sha256::digest(PAYLOAD).to_vec();
            let mut tx = store
                .pool()
                .begin_with(DB::BEGIN_GUARDED)
                .await
                .expect("begin");
            let claim = vec![Bound::Text(id.clone()), Bound::Bytes(fingerprint.clone())];
            if DB::run(&mut tx, DB::INSERT_GUARDED, claim).await == 1 {
                sqlx::query(INSERT).execute(&mut *tx).await.expect("insert");
                // The result, as idem records `()`.
                let record = vec![Bound::Bytes(b"null".to_vec()), Bound::Text(id)];
                DB::run(&mut tx, DB::RECORD, record).await;
                tx.commit().await.expect("commit");
            } else {
                // A duplicate: the first's result, unless the payload differs; one
                // in flight waits on the row's lock, as the inbox's does.
                let (stored, result) = DB::found(&mut tx, id).await;
                assert!(stored == fingerprint && result.is_some(), "mismatch");
                tx.commit().await.expect("commit");
            }
        }
        Variant::Idem => {
            let delivery = Delivery::new(Some(&id), "bench", "orders", PAYLOAD);
            let processed: Processed<(), sqlx::Error> = store
                .process(delivery, Options::new(), |mut tx| async move {
                    sqlx::query(INSERT).execute(&mut *tx).await?;
                    Ok(())
                })
                .await;
            // In flight: a redelivery of one a worker still runs, deferred.
            assert!(
                matches!(
                    processed,
                    Processed::Ran(()) | Processed::Done(()) | Processed::InFlight { .. }
                ),
                "{processed:?}"
            );
        }
    }
}

async fn rounds<DB: Inbox>(
    backend: &str,
    store: Idempotency<DB>,
    settings: &Settings,
    rounds: usize,
    table: &mut Vec<String>,
) where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'a> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
{
    for redelivered in [0, 20] {
        let mut rates: [Vec<f64>; 4] = Default::default();
        let (mut to_inbox, mut to_guarded) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            // Each round starts with another variant, so that none always runs on
            // the warmest (or the most bloated) table.
            let mut order = [
                Variant::Bare,
                Variant::Inbox,
                Variant::Guarded,
                Variant::Idem,
            ];
            order.rotate_left(round % 4);
            let mut this = [0.0; 4];
            for variant in order {
                let prefix = format!("{}-{redelivered}-{round}", variant.name());
                let store = store.clone();
                let (_, rate, _, _) = measure(settings, move |_, n| {
                    let store = store.clone();
                    let id = message_id(&prefix, n, redelivered);
                    async move { consume(variant, &store, id).await }
                })
                .await;
                this[variant as usize] = rate;
                rates[variant as usize].push(rate);
            }
            let idem = this[Variant::Idem as usize];
            to_inbox.push(idem / this[Variant::Inbox as usize]);
            to_guarded.push(idem / this[Variant::Guarded as usize]);
        }
        let [bare, inbox, guarded, idem] = rates.map(|mut r| median(&mut r));
        table.push(format!(
            "| {backend} | {redelivered} % | {bare:.0} | {inbox:.0} | {guarded:.0} | {idem:.0} | {} | {} |",
            spread(to_inbox),
            spread(to_guarded),
        ));
    }
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The median ratio and its range over the rounds.
fn spread(mut ratios: Vec<f64>) -> String {
    let low = ratios.iter().copied().fold(f64::MAX, f64::min);
    let high = ratios.iter().copied().fold(0.0, f64::max);
    format!("{:.2} ({low:.2}–{high:.2})", median(&mut ratios))
}

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::main]
async fn main() {
    let settings = Settings {
        secs: arg("--secs", 3),
        workers: WORKERS,
    };
    let count = usize::try_from(arg("--rounds", 3)).unwrap_or(3).max(1);
    let schema = format!("idem_consumer_bench_{}", std::process::id());
    let mut table = Vec::new();

    let url = std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let options: PgConnectOptions = url.parse().expect("postgres url");
    match PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options.clone())
        .await
    {
        Ok(admin) => {
            // Open to every role, as the public schema is: otherwise idem gives up
            // its functions (upgrade 4) and sends the statements they stand for.
            sqlx::raw_sql(AssertSqlSafe(format!(
                "CREATE SCHEMA {schema}; GRANT USAGE ON SCHEMA {schema} TO PUBLIC"
            )))
            .execute(&admin)
            .await
            .expect("schema");
            let pool = PgPoolOptions::new()
                .max_connections(8)
                .connect_with(options.options([("search_path", schema.as_str())]))
                .await
                .expect("pool");
            let store = common::prepare::<Postgres>(&pool, "BIGSERIAL PRIMARY KEY").await;
            sqlx::raw_sql(<Postgres as Inbox>::TABLES)
                .execute(&pool)
                .await
                .expect("inbox");
            rounds("postgres", store, &settings, count, &mut table).await;
            pool.close().await;
            let _ = sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
                .execute(&admin)
                .await;
        }
        Err(error) => eprintln!("PostgreSQL not reachable at {url} ({error}): skipped"),
    }

    let url = std::env::var("IDEM_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    let options: MySqlConnectOptions = url.parse().expect("mysql url");
    match MySqlPoolOptions::new()
        .max_connections(1)
        .connect_with(options.clone())
        .await
    {
        Ok(admin) => {
            sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {schema}")))
                .execute(&admin)
                .await
                .expect("database");
            let pool = MySqlPoolOptions::new()
                .max_connections(8)
                .connect_with(options.database(&schema))
                .await
                .expect("pool");
            let store = common::prepare::<MySql>(&pool, "BIGINT AUTO_INCREMENT PRIMARY KEY").await;
            sqlx::raw_sql(<MySql as Inbox>::TABLES)
                .execute(&pool)
                .await
                .expect("inbox");
            rounds("mysql", store, &settings, count, &mut table).await;
            pool.close().await;
            let _ = sqlx::raw_sql(AssertSqlSafe(format!("DROP DATABASE {schema}")))
                .execute(&admin)
                .await;
        }
        Err(error) => eprintln!("MySQL/MariaDB not reachable at {url} ({error}): skipped"),
    }

    let path = std::env::temp_dir().join(format!("{schema}.db"));
    let pool = common::sqlite_pool(&path).await;
    let store = common::prepare::<Sqlite>(&pool, "INTEGER PRIMARY KEY AUTOINCREMENT").await;
    sqlx::raw_sql(<Sqlite as Inbox>::TABLES)
        .execute(&pool)
        .await
        .expect("inbox");
    rounds("sqlite", store, &settings, count, &mut table).await;
    pool.close().await;
    common::remove_sqlite(&path);

    println!(
        "\nmessages/s, {WORKERS} workers, medians of {count} rounds × {} s\n",
        settings.secs
    );
    println!(
        "| backend | redelivered | bare | inbox | guarded | idem | idem / inbox | idem / guarded |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for row in table {
        println!("{row}");
    }
}
