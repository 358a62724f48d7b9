//! Messages per second through a consumer's handler, three ways, paired in one
//! run on each backend: a bare at-least-once consumer (the business write in a
//! transaction, duplicates run again), a hand-written inbox (the message id
//! inserted in the same transaction, a duplicate found by its key: the floor),
//! and idem's `Idempotency::process`.
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
//! alternate the variants; the ratio idem / inbox is taken within each round,
//! and its median reported. Servers are found as in the test suite
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

const WORKERS: usize = 8;
const PAYLOAD: &[u8] = br#"{"order":42,"amount":1000}"#;

#[derive(Clone, Copy, PartialEq)]
enum Variant {
    Bare,
    Inbox,
    Idem,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Self::Bare => "bare",
            Self::Inbox => "inbox",
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

/// The hand-written inbox's statement, in each backend's dialect.
trait Inbox: Backend {
    /// Inserts `id` into the inbox unless it is there: whether it was new.
    fn insert_id<'a>(
        conn: &'a mut <Self as sqlx::Database>::Connection,
        id: String,
    ) -> BoxFuture<'a, bool>;
}

impl Inbox for Postgres {
    fn insert_id<'a>(conn: &'a mut sqlx::PgConnection, id: String) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            let sql = "INSERT INTO inbox (id) VALUES ($1) ON CONFLICT DO NOTHING";
            let done = sqlx::query(sql).bind(id).execute(conn).await;
            done.expect("inbox").rows_affected() == 1
        })
    }
}

impl Inbox for MySql {
    fn insert_id<'a>(conn: &'a mut sqlx::MySqlConnection, id: String) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            let sql = "INSERT IGNORE INTO inbox (id) VALUES (?)";
            let done = sqlx::query(sql).bind(id).execute(conn).await;
            done.expect("inbox").rows_affected() == 1
        })
    }
}

impl Inbox for Sqlite {
    fn insert_id<'a>(conn: &'a mut sqlx::SqliteConnection, id: String) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            let sql = "INSERT INTO inbox (id) VALUES (?) ON CONFLICT DO NOTHING";
            let done = sqlx::query(sql).bind(id).execute(conn).await;
            done.expect("inbox").rows_affected() == 1
        })
    }
}

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
            if DB::insert_id(&mut tx, id).await {
                sqlx::query(INSERT).execute(&mut *tx).await.expect("insert");
            }
            tx.commit().await.expect("commit");
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
        let mut rates = [Vec::new(), Vec::new(), Vec::new()];
        let mut ratios = Vec::new();
        for round in 0..rounds {
            // Each round starts with another variant, so that none always runs on
            // the warmest (or the most bloated) table.
            let mut order = [Variant::Bare, Variant::Inbox, Variant::Idem];
            order.rotate_left(round % 3);
            let mut this = [0.0; 3];
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
            ratios.push(this[Variant::Idem as usize] / this[Variant::Inbox as usize]);
        }
        let median = |values: &mut Vec<f64>| {
            values.sort_by(f64::total_cmp);
            values[values.len() / 2]
        };
        let (low, high) = (
            ratios.iter().copied().fold(f64::MAX, f64::min),
            ratios.iter().copied().fold(0.0, f64::max),
        );
        table.push(format!(
            "| {backend} | {redelivered} % | {:.0} | {:.0} | {:.0} | {:.2} ({low:.2}–{high:.2}) |",
            median(&mut rates[0]),
            median(&mut rates[1]),
            median(&mut rates[2]),
            median(&mut ratios),
        ));
    }
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
    let inbox_ddl = "CREATE TABLE inbox (id VARCHAR(255) PRIMARY KEY)";

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
            sqlx::raw_sql(inbox_ddl)
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
            sqlx::raw_sql(inbox_ddl)
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
    sqlx::raw_sql(inbox_ddl)
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
    println!("| backend | redelivered | bare | inbox | idem | idem / inbox |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    for row in table {
        println!("{row}");
    }
}
