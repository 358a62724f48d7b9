//! Orders from a RabbitMQ queue, each charged exactly once, however often the
//! queue delivers it.
//!
//! ```text
//! cargo run --example orders_consumer --features sqlite,lapin -- demo   # the demo below
//! cargo run --example orders_consumer --features sqlite,lapin           # a consumer
//! ```
//!
//! Environment: `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`),
//! `QUEUE` (default `orders`), `DATABASE_URL` (default `sqlite://orders.db`,
//! created and migrated at start; for `demo`, a scratch SQLite file), `LOCK_SECS`
//! (how long a run may take before another consumer may take its order over:
//! default 30; for `demo`, 5).
//!
//! The consumer runs `charge` through `idem_axum::rabbitmq::Consumer`: the
//! charge row and the recorded result commit in one transaction, and the
//! delivery is acknowledged only after that commit. SIGTERM or Ctrl-C stops it
//! gracefully: it finishes and acknowledges the orders under way.
//!
//! `demo` starts a consumer as a process of its own, publishes 100 orders,
//! most of them twice and some three times (a retrying publisher), kills the
//! consumer with SIGKILL mid-stream and starts another, which is delivered
//! again everything the first had not acknowledged: the orders it had charged
//! and committed among them. Then it prints, per order, how many times the
//! handler started (`executions`, counted outside the transaction: a run cut
//! by the kill counts, its charge rolled back) and how many charges there are,
//! and fails unless every order was charged exactly once.

use std::error::Error;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::str::FromStr as _;
use std::time::{Duration, Instant};

use idem_axum::rabbitmq::Consumer;
use idem_axum::{Idempotency, Options, Retries};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use serde::Deserialize;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{Pool, Sqlite};

const ORDERS: i64 = 100;

/// An order as published.
#[derive(Deserialize)]
struct Order {
    id: i64,
    amount: i64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let amqp = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    match std::env::args().nth(1).as_deref() {
        None => {
            let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "sqlite://orders.db".into());
            let queue = std::env::var("QUEUE").unwrap_or_else(|_| "orders".into());
            consume(&amqp, &url, &queue).await
        }
        Some("demo") => demo(&amqp).await,
        Some(other) => Err(format!("unknown mode {other:?}; usage: orders_consumer [demo]").into()),
    }
}

/// The orders' database at `url`, and the card provider's beside it (a file
/// of its own: SQLite has one writer per file, which the handler's transaction
/// holds while it calls the provider).
async fn databases(url: &str) -> Result<(Pool<Sqlite>, Pool<Sqlite>), Box<dyn Error>> {
    let orders = database(
        url,
        "CREATE TABLE IF NOT EXISTS charges (order_id INTEGER NOT NULL, amount INTEGER NOT NULL)",
    )
    .await?;
    let provider = database(
        &format!("{url}-provider"),
        "CREATE TABLE IF NOT EXISTS executions (order_id INTEGER NOT NULL)",
    )
    .await?;
    Ok((orders, provider))
}

async fn database(url: &str, schema: &'static str) -> Result<Pool<Sqlite>, Box<dyn Error>> {
    let options = SqliteConnectOptions::from_str(url)?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(30));
    let pool = SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await?;
    sqlx::raw_sql(schema).execute(&pool).await?;
    Ok(pool)
}

/// Consumes `queue` until SIGTERM or Ctrl-C.
async fn consume(amqp: &str, url: &str, queue: &str) -> Result<(), Box<dyn Error>> {
    let (pool, provider) = databases(url).await?;
    let store = Idempotency::new(pool);
    let lock = match std::env::var("LOCK_SECS") {
        Ok(secs) => Duration::from_secs(secs.parse()?),
        Err(_) => Duration::from_secs(30),
    };
    store.migrate().await?;
    let connection = Connection::connect(amqp, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    declare(&channel, queue).await?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let stop = async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    };
    println!("consuming {queue}");
    Consumer::new(store, queue)
        .options(
            Options::new()
                .lock(lock)
                .ttl(Duration::from_secs(7 * 86_400)),
        )
        .retries(Retries::new(5))
        .dead_letter(format!("{queue}.dead"))
        .run_until(&channel, stop, move |message, mut tx| {
            let provider = provider.clone();
            async move {
                let order: Order =
                    serde_json::from_slice(&message.data).map_err(|e| e.to_string())?;
                // Outside the transaction, as a call to the card provider is.
                sqlx::query("INSERT INTO executions (order_id) VALUES (?)")
                    .bind(order.id)
                    .execute(&provider)
                    .await
                    .map_err(|e| e.to_string())?;
                tokio::time::sleep(Duration::from_millis(15)).await;
                sqlx::query("INSERT INTO charges (order_id, amount) VALUES (?, ?)")
                    .bind(order.id)
                    .bind(order.amount)
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok::<_, String>(format!("ch_{}", order.id))
            }
        })
        .await?;
    connection.close(200, "stopped".into()).await?;
    println!("stopped");
    Ok(())
}

async fn declare(channel: &lapin::Channel, queue: &str) -> Result<(), lapin::Error> {
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.into(), durable, FieldTable::default())
        .await?;
    Ok(())
}

/// A consumer process on the demo's database and queue.
fn spawn_consumer(amqp: &str, url: &str, queue: &str) -> Result<Child, Box<dyn Error>> {
    Ok(Command::new(std::env::current_exe()?)
        .env("AMQP_URL", amqp)
        .env("DATABASE_URL", url)
        .env("QUEUE", queue)
        .env("LOCK_SECS", "5")
        .spawn()?)
}

/// Charged orders: distinct, and in all.
async fn charged(pool: &Pool<Sqlite>) -> Result<(i64, i64), sqlx::Error> {
    sqlx::query_as("SELECT COUNT(DISTINCT order_id), COUNT(*) FROM charges")
        .fetch_one(pool)
        .await
}

async fn demo(amqp: &str) -> Result<(), Box<dyn Error>> {
    let scratch = Scratch::new();
    let url = scratch.url();
    let (pool, provider) = databases(&url).await?;
    Idempotency::new(pool.clone()).migrate().await?;
    let queue = format!("orders-demo-{}", std::process::id());
    let connection = Connection::connect(amqp, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    declare(&channel, &queue).await?;

    let mut consumer = spawn_consumer(amqp, &url, &queue)?;
    let mut published = 0;
    for id in 1..=ORDERS {
        let copies = if id % 10 == 0 {
            3
        } else if id % 4 == 0 {
            1
        } else {
            2
        };
        let payload = format!("{{\"id\":{id},\"amount\":{}}}", 100 * id);
        for _ in 0..copies {
            let properties = BasicProperties::default()
                .with_message_id(format!("order-{id}").into())
                .with_content_type("application/json".into())
                .with_delivery_mode(2);
            channel
                .basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    payload.as_bytes(),
                    properties,
                )
                .await?
                .await?;
            published += 1;
        }
    }
    println!("published {published} messages for {ORDERS} orders");

    // Mid-stream: SIGKILL, as an OOM killer or a node loss would.
    let start = Instant::now();
    while charged(&pool).await?.0 < ORDERS / 3 && start.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    consumer.kill()?;
    consumer.wait()?;
    println!(
        "killed the consumer with {} orders charged",
        charged(&pool).await?.0
    );
    let mut consumer = spawn_consumer(amqp, &url, &queue)?;

    let start = Instant::now();
    while charged(&pool).await?.0 < ORDERS && start.elapsed() < Duration::from_secs(120) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The last duplicates: through the delay queue, a few seconds at most.
    tokio::time::sleep(Duration::from_secs(3)).await;
    Command::new("kill")
        .arg("-TERM")
        .arg(consumer.id().to_string())
        .status()?;
    consumer.wait()?;

    let mut rows = Vec::new();
    for id in 1..=ORDERS {
        let executions: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM executions WHERE order_id = ?")
                .bind(id)
                .fetch_one(&provider)
                .await?;
        let charges: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM charges WHERE order_id = ?")
            .bind(id)
            .fetch_one(&pool)
            .await?;
        rows.push((id, executions, charges));
    }
    println!("order  executions  charges");
    for (id, executions, charges) in &rows {
        if *executions != 1 || *charges != 1 {
            println!("{id:>5}  {executions:>10}  {charges:>7}");
        }
    }
    let once = rows.iter().filter(|(_, _, charges)| *charges == 1).count();
    let rerun = rows
        .iter()
        .filter(|(_, executions, _)| *executions > 1)
        .count();
    println!(
        "{ORDERS} orders, {published} messages: {once} charged exactly once, \
         {rerun} started again after a run the kill cut short (rolled back)"
    );
    for name in [queue.clone(), format!("{queue}.dead")] {
        let _ = channel
            .queue_delete(
                name.as_str().into(),
                lapin::options::QueueDeleteOptions::default(),
            )
            .await;
    }
    if i64::try_from(once)? != ORDERS {
        return Err("some order was not charged exactly once".into());
    }
    println!("every order charged exactly once");
    Ok(())
}

/// The demo's SQLite file, removed when it ends.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let name = format!("orders-demo-{}-{nanos}.db", std::process::id());
        Self(std::env::temp_dir().join(name))
    }

    fn url(&self) -> String {
        format!("sqlite://{}", self.0.display())
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for suffix in [
            "",
            "-wal",
            "-shm",
            "-provider",
            "-provider-wal",
            "-provider-shm",
        ] {
            let mut file = self.0.clone().into_os_string();
            file.push(suffix);
            let _ = std::fs::remove_file(file);
        }
    }
}
