//! The `idem` binary against a key in flight, on every backend and layout: while a
//! payment's handler is held at a gate, `forget` answers at once (exit status 3)
//! and deletes nothing, `show` says the key is in flight and `list` lists it where
//! the database can show it; once the payment commits, its retry is a replay, one
//! business row is stored, and `forget` then deletes the record.
//!
//! PostgreSQL is found at `IDEM_TEST_POSTGRES_URL`, MySQL/MariaDB at
//! `IDEM_TEST_MYSQL_URL` (defaults as in the workspace's README); each test makes a
//! database of its own. An unreachable server is SKIPPED, except under `CI=true`.

mod support;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Response, StatusCode, Uri};
use idem_runtime::{Backend, Idempotency, IdempotencyKey, Options, Outcome, RequestIdentity};
use sqlx::{Connection, MySql, Pool, Postgres, Row as _, Sqlite};
use support::{Run, idem};
use tokio::sync::{Notify, oneshot};

const SCOPE: &str = "alice";
const BODY: &[u8] = br#"{"amount":1200,"to":"bob"}"#;

/// A store on a private database, the CLI's arguments to reach it, and what to
/// drop once done.
struct Target<DB: Backend> {
    store: Idempotency<DB>,
    /// `--database-url` and, for the partitioned layout, `--partitioned`.
    args: Vec<String>,
    /// Whether `list` can show a claim before it commits.
    lists_claims: bool,
    /// Removes the database, however the test ends.
    _drop: Option<Dropped>,
}

/// A statement run on a fresh connection when dropped.
struct Dropped(Box<dyn FnOnce() + Send>);

impl Drop for Dropped {
    fn drop(&mut self) {
        let cleanup = std::mem::replace(&mut self.0, Box::new(|| {}));
        let _ = std::thread::spawn(cleanup).join();
    }
}

/// A store that keeps no replays in memory: a retry after `idem forget` (another
/// process) reads the table.
fn fresh<DB: Backend>(pool: Pool<DB>) -> Idempotency<DB> {
    Idempotency::builder(pool)
        .replay_cache(0)
        .build()
        .expect("store")
}

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{prefix}_{}_{nanos}", std::process::id())
}

/// Runs `idem <args…> <command>` on a thread of its own, so the runtime keeps
/// serving the payment in flight; fails if it does not answer while the payment
/// is still held (it would be waiting for it).
async fn cli<DB: Backend>(target: &Target<DB>, command: &[&str]) -> Run {
    let mut args: Vec<String> = target.args[1..].to_vec();
    args.extend(command.iter().map(|s| (*s).to_owned()));
    let url = target.args[0].clone();
    let run = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        idem(&url, &args)
    });
    tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .expect("idem answers while the payment is held")
        .expect("idem ran")
}

/// A payment: one row in `payments` through the handler's `Tx`, then a wait at
/// `gate` once `started` is sent; answers 201.
async fn pay<DB>(
    store: &Idempotency<DB>,
    key: &str,
    held: Option<(oneshot::Sender<()>, Arc<Notify>)>,
) -> Response<Bytes>
where
    DB: Backend,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let key = IdempotencyKey::parse(key.as_bytes()).expect("a key");
    let uri = Uri::from_static("/payments");
    let request = RequestIdentity::new(Some(key), SCOPE, &Method::POST, &uri, BODY);
    let options = Options::new().lock(Duration::from_secs(60));
    store
        .execute(request, options, move |mut tx| {
            Box::pin(async move {
                let written = sqlx::raw_sql("INSERT INTO payments (note) VALUES ('paid')")
                    .execute(&mut *tx)
                    .await;
                if let Some((started, gate)) = held {
                    let _ = started.send(());
                    gate.notified().await;
                }
                let mut response = Response::new(http_body_util::Full::new(Bytes::from(format!(
                    "{{\"paid\":{}}}",
                    written.is_ok()
                ))));
                *response.status_mut() = if written.is_ok() {
                    StatusCode::CREATED
                } else {
                    StatusCode::INTERNAL_SERVER_ERROR
                };
                response
            })
        })
        .await
}

async fn payments<DB>(pool: &Pool<DB>) -> i64
where
    DB: Backend,
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
    i64: sqlx::Type<DB> + for<'r> sqlx::Decode<'r, DB>,
{
    let row = sqlx::raw_sql("SELECT count(*) FROM payments")
        .fetch_one(pool)
        .await
        .expect("count payments");
    row.try_get(0).expect("a count")
}

fn outcome(response: &Response<Bytes>) -> Option<Outcome> {
    response.extensions().get::<Outcome>().copied()
}

/// The whole story on one target: see the file's head.
async fn forget_never_touches_a_payment_in_flight<DB>(target: Target<DB>)
where
    DB: Backend,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
    i64: sqlx::Type<DB> + for<'r> sqlx::Decode<'r, DB>,
{
    let store = target.store.clone();
    store.migrate().await.expect("migrate");
    sqlx::raw_sql("CREATE TABLE payments (note VARCHAR(16) NOT NULL)")
        .execute(store.pool())
        .await
        .expect("the business table");

    let (started, is_started) = oneshot::channel();
    let gate = Arc::new(Notify::new());
    let first = {
        let (store, gate) = (store.clone(), Arc::clone(&gate));
        tokio::spawn(async move { pay(&store, "fg-1", Some((started, gate))).await })
    };
    is_started.await.expect("the payment started");

    let forget = cli(&target, &["forget", "--scope", SCOPE, "fg-1"]).await;
    assert_eq!(forget.code, 3, "{}", forget.stderr);
    assert!(
        forget
            .stderr
            .contains("fg-1 in scope alice is in flight: nothing deleted"),
        "{}",
        forget.stderr
    );
    let show = cli(&target, &["show", "--scope", SCOPE, "fg-1"]).await;
    assert_eq!(show.code, 0, "{}", show.stderr);
    assert!(show.stdout.contains("in flight:   yes"), "{}", show.stdout);
    let list = cli(&target, &["list"]).await;
    assert_eq!(list.code, 0, "{}", list.stderr);
    if target.lists_claims {
        assert!(
            list.stdout.contains("fg-1") && list.stdout.contains("/payments"),
            "{}",
            list.stdout
        );
    } else {
        assert!(list.stdout.contains("1 claim(s)"), "{}", list.stdout);
    }

    gate.notify_one();
    let first = first.await.expect("the payment");
    assert_eq!(first.status(), StatusCode::CREATED);
    assert_eq!(outcome(&first), Some(Outcome::Executed));
    let retry = pay(&store, "fg-1", None).await;
    assert_eq!(outcome(&retry), Some(Outcome::Replayed));
    assert_eq!(retry.body(), first.body());
    assert_eq!(payments(store.pool()).await, 1, "one payment");

    let show = cli(&target, &["show", "--scope", SCOPE, "fg-1"]).await;
    assert_eq!(show.code, 0, "{}", show.stderr);
    assert!(
        show.stdout.contains("state:       completed")
            && show.stdout.contains(r#"{"paid":true}"#)
            && !show.stdout.contains("lock left")
            && !show.stdout.contains("in flight"),
        "a completed key has no lock: {}",
        show.stdout
    );
    let list = cli(&target, &["list"]).await;
    assert!(
        list.stdout.contains("no claim in the table"),
        "{}",
        list.stdout
    );

    let forget = cli(&target, &["forget", "--scope", SCOPE, "fg-1"]).await;
    assert_eq!(forget.code, 0, "{}", forget.stderr);
    assert!(
        forget.stdout.starts_with("forgot fg-1 in scope alice"),
        "{}",
        forget.stdout
    );
    let again = cli(&target, &["forget", "--scope", SCOPE, "fg-1"]).await;
    assert_eq!(again.code, 1, "{}", again.stderr);
    assert!(again.stderr.contains("holds no record"), "{}", again.stderr);
    let rerun = pay(&store, "fg-1", None).await;
    assert_eq!(outcome(&rerun), Some(Outcome::Executed));
    assert_eq!(payments(store.pool()).await, 2, "forgotten, so run again");
    store.pool().close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_forget_never_touches_a_payment_in_flight() {
    let dir = std::env::temp_dir().join(unique("idem_cli_in_flight"));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let path = dir.join("app.db");
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal);
    let pool = Pool::<Sqlite>::connect_with(options).await.expect("sqlite");
    let target = Target {
        store: fresh(pool),
        args: vec![format!("sqlite://{}", path.display())],
        lists_claims: true,
        _drop: Some(Dropped(Box::new(move || {
            let _ = std::fs::remove_dir_all(dir);
        }))),
    };
    forget_never_touches_a_payment_in_flight(target).await;
}

/// A database of its own on the server at `$var` (default `default`): the
/// server's URL, the new database's URL and its name; `None` (SKIPPED) when the
/// server cannot be reached outside CI.
async fn private_database<C>(var: &str, default: &str) -> Option<(String, String, String)>
where
    C: Connection,
    for<'c> &'c mut C: sqlx::Executor<'c>,
{
    let base = std::env::var(var).unwrap_or_else(|_| default.to_owned());
    let mut admin = match C::connect(&base).await {
        Ok(conn) => conn,
        Err(error) if !in_ci() => {
            eprintln!("SKIPPED: no database server at {base}: {error}");
            return None;
        }
        Err(error) => panic!("no database server at {base}: {error}"),
    };
    let database = unique("idem_cli");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
        .execute(&mut admin)
        .await
        .expect("create database");
    let _ = admin.close().await;
    let (head, _) = base.rsplit_once('/').expect("a database in the URL");
    let url = format!("{head}/{database}");
    Some((base, url, database))
}

/// A PostgreSQL target in the plain or the partitioned layout.
async fn postgres(partitioned: bool) -> Option<Target<Postgres>> {
    let (base, url, database) = private_database::<sqlx::PgConnection>(
        "IDEM_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/postgres",
    )
    .await?;
    let pool = Pool::<Postgres>::connect(&url).await.expect("its pool");
    // No replay cache: a retry after `idem forget` reads the table.
    let mut builder = Idempotency::builder(pool).replay_cache(0);
    let mut args = vec![url];
    if partitioned {
        builder = builder.partitioned_by_day();
        args.push("--partitioned".to_owned());
    }
    let drop = format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)");
    Some(Target {
        store: builder.build().expect("store"),
        args,
        lists_claims: false,
        _drop: Some(Dropped(Box::new(move || {
            drop_with::<sqlx::PgConnection>(base, drop);
        }))),
    })
}

fn drop_with<C>(url: String, statement: String)
where
    C: Connection,
    for<'c> &'c mut C: sqlx::Executor<'c>,
{
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_forget_never_touches_a_payment_in_flight() {
    if let Some(target) = postgres(false).await {
        forget_never_touches_a_payment_in_flight(target).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_partitioned_forget_never_touches_a_payment_in_flight() {
    if let Some(target) = postgres(true).await {
        forget_never_touches_a_payment_in_flight(target).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_forget_never_touches_a_payment_in_flight() {
    let Some((base, url, database)) = private_database::<sqlx::MySqlConnection>(
        "IDEM_TEST_MYSQL_URL",
        "mysql://root@127.0.0.1:3306/test",
    )
    .await
    else {
        return;
    };
    let pool = Pool::<MySql>::connect(&url).await.expect("its pool");
    let drop = format!("DROP DATABASE IF EXISTS {database}");
    let target = Target {
        store: fresh(pool),
        args: vec![url],
        lists_claims: true,
        _drop: Some(Dropped(Box::new(move || {
            drop_with::<sqlx::MySqlConnection>(base, drop);
        }))),
    };
    forget_never_touches_a_payment_in_flight(target).await;
}
