//! The message adapters under broker and database faults (docs/contract.md §8):
//! 300 orders, each published twice, consumed by three consumers that reconnect
//! as a deployment's do, while the broker is restarted the way `.ci/run` starts
//! it, and then the database is made unreachable for a few seconds (its server
//! restarted; SQLite's file held by another writer). A publisher that loses its
//! broker publishes again until it is confirmed. Every order must end with one
//! committed effect, and the broker must hold nothing, ready or unacknowledged.
//!
//! Counted: `requests` are publishes (retries included), `charges` the
//! handler's runs as a provider outside the transaction sees them (a run the
//! outage rolled back counts, and runs again), `effects` the committed ones.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, stream};
use idem_axum::{Idempotency, Options, Retries, Tx};
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use sqlx::{MySql, Pool, Postgres, Sqlite};
use tokio::sync::watch;

use crate::db::{Backend, Fresh};
use crate::scenarios::Row;

const ORDERS: usize = 300;
const COPIES: usize = 2;
const CONSUMERS: usize = 3;
/// Every wait of the scenario ends: a hang is a failure, not a stuck CI.
const SETTLE: Duration = Duration::from_secs(120);

fn amqp_url() -> String {
    std::env::var("IDEM_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

fn nats_url() -> String {
    std::env::var("IDEM_TEST_NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".to_owned())
}

#[derive(Clone, Copy, PartialEq)]
pub enum Broker {
    RabbitMq,
    JetStream,
}

impl Broker {
    fn name(self) -> &'static str {
        match self {
            Self::RabbitMq => "rabbitmq: broker and database restarted mid-stream",
            Self::JetStream => "jetstream: broker and database restarted mid-stream",
        }
    }
}

/// Runs the scenario on `broker` with `db`'s backend.
pub async fn restarted(db: &Fresh, broker: Broker) -> Row {
    let mut row = Row::new(broker.name(), db.backend);
    if !std::env::var("IDEM_FAULTS_RESTART").is_ok_and(|v| v == "1") {
        row.note = "SKIPPED: IDEM_FAULTS_RESTART=1 lets the suite restart the servers".into();
        return row;
    }
    let setup = async {
        match db.backend {
            Backend::Postgres => {
                let pool = Pool::<Postgres>::connect(&db.url).await?;
                Ok::<_, sqlx::Error>(Stores::Postgres(prepare(pool).await?))
            }
            Backend::MySql => {
                let pool = Pool::<MySql>::connect(&db.url).await?;
                Ok(Stores::MySql(prepare(pool).await?))
            }
            Backend::Sqlite => {
                let options: sqlx::sqlite::SqliteConnectOptions = db.url.parse()?;
                let options = options
                    .create_if_missing(true)
                    .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                    .busy_timeout(Duration::from_secs(30));
                let pool = sqlx::sqlite::SqlitePoolOptions::new()
                    .max_connections(8)
                    .connect_with(options)
                    .await?;
                Ok(Stores::Sqlite(prepare(pool).await?))
            }
        }
    };
    let stores = match setup.await {
        Ok(stores) => stores,
        Err(error) => return row.failed(format!("setup: {error}")),
    };
    match stores {
        Stores::Postgres(store) => {
            run(
                db,
                broker,
                store,
                "INSERT INTO effects (note) VALUES ($1)",
                &mut row,
            )
            .await
        }
        Stores::MySql(store) => {
            run(
                db,
                broker,
                store,
                "INSERT INTO effects (note) VALUES (?)",
                &mut row,
            )
            .await
        }
        Stores::Sqlite(store) => {
            run(
                db,
                broker,
                store,
                "INSERT INTO effects (note) VALUES (?)",
                &mut row,
            )
            .await
        }
    }
    row
}

enum Stores {
    Postgres(Idempotency<Postgres>),
    MySql(Idempotency<MySql>),
    Sqlite(Idempotency<Sqlite>),
}

async fn prepare<DB: idem_axum::Backend>(pool: Pool<DB>) -> Result<Idempotency<DB>, sqlx::Error>
where
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
{
    sqlx::raw_sql("CREATE TABLE effects (note VARCHAR(64) NOT NULL)")
        .execute(&pool)
        .await?;
    let store = Idempotency::new(pool);
    store.migrate().await?;
    Ok(store)
}

/// What the consumers share: the runs a provider saw, per order.
#[derive(Default)]
struct Provider {
    runs: std::sync::Mutex<HashMap<String, u64>>,
}

async fn run<DB: idem_axum::Backend>(
    db: &Fresh,
    broker: Broker,
    store: Idempotency<DB>,
    insert: &'static str,
    row: &mut Row,
) where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'a> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    String: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    i64: for<'r> sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    (i64,): for<'r> sqlx::FromRow<'r, DB::Row>,
{
    let provider = Arc::new(Provider::default());
    let handler = {
        let provider = Arc::clone(&provider);
        move |id: String, mut tx: Tx<DB>| {
            let provider = Arc::clone(&provider);
            async move {
                *provider
                    .runs
                    .lock()
                    .expect("runs")
                    .entry(id.clone())
                    .or_default() += 1;
                // About ten runs are inside their transactions at any time
                // (orders arrive at about 50 a second): the database's fault
                // ends some of them.
                tokio::time::sleep(Duration::from_millis(200)).await;
                sqlx::query(insert)
                    .bind(id.clone())
                    .execute(&mut *tx)
                    .await
                    .map_err(|error| error.to_string())?;
                Ok::<_, String>(format!("charge-{id}"))
            }
        }
    };
    let (stop, stopped) = watch::channel(false);
    let published = Arc::new(AtomicU64::new(0));
    let name = format!("idem_faults_{}_{}", std::process::id(), row.backend.name());
    let name: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();

    let effects = || async {
        let sql = "SELECT COUNT(*) FROM effects";
        sqlx::query_as::<_, (i64,)>(sql)
            .fetch_one(store.pool())
            .await
            .map_or(-1, |(n,)| n)
    };
    let mut consumers = Vec::new();
    let publisher;
    match broker {
        Broker::RabbitMq => {
            if let Err(error) = declare(&name).await {
                row.problems.push(format!("the queue: {error}"));
                return;
            }
            for _ in 0..CONSUMERS {
                consumers.push(tokio::spawn(rabbit_worker(
                    store.clone(),
                    name.clone(),
                    stopped.clone(),
                    handler.clone(),
                )));
            }
            publisher = tokio::spawn(rabbit_publish(name.clone(), Arc::clone(&published)));
        }
        Broker::JetStream => {
            let js = match jet_stream(&name).await {
                Ok(js) => js,
                Err(error) => {
                    row.problems.push(format!("the stream: {error}"));
                    return;
                }
            };
            for _ in 0..CONSUMERS {
                consumers.push(tokio::spawn(jet_worker(
                    store.clone(),
                    name.clone(),
                    stopped.clone(),
                    handler.clone(),
                )));
            }
            publisher = tokio::spawn(jet_publish(js, name.clone(), Arc::clone(&published)));
        }
    }

    // The broker restarted once the stream flows, the database once it flows again.
    let flowing = |at: i64| async move {
        let began = Instant::now();
        while effects().await < at {
            if began.elapsed() > SETTLE {
                return Err(format!("fewer than {at} effects after {SETTLE:?}"));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    };
    let mut at = (0, 0);
    let faults = async {
        flowing(40).await?;
        at.0 = effects().await;
        match broker {
            Broker::RabbitMq => restart_rabbitmq().await?,
            Broker::JetStream => restart_nats().await?,
        }
        flowing(effects().await.max(0) + 40).await?;
        at.1 = effects().await;
        if at.1 >= ORDERS as i64 {
            return Err(format!(
                "every order ran before the database's outage ({})",
                at.1
            ));
        }
        match db.backend {
            Backend::Sqlite => {
                let holder = db.lock_effects(Duration::from_secs(3)).await?;
                holder.await.map_err(|e| e.to_string())?;
            }
            backend => crate::db::restart_server(backend).await?,
        }
        Ok::<_, String>(())
    };
    if let Err(error) = faults.await {
        row.problems.push(error);
    }
    match tokio::time::timeout(SETTLE, publisher).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(error))) => row.problems.push(format!("publisher: {error}")),
        Ok(Err(error)) => row.problems.push(format!("publisher: {error}")),
        Err(_) => row
            .problems
            .push(format!("publisher not done after {SETTLE:?}")),
    }
    row.requests = published.load(Ordering::Relaxed);

    // Settled: every order's effect, and nothing left in the broker.
    let began = Instant::now();
    let mut left = u64::MAX;
    while began.elapsed() < SETTLE {
        left = match broker {
            Broker::RabbitMq => rabbit_left(&name).await,
            Broker::JetStream => jet_left(&name).await,
        };
        if left == 0 && effects().await >= ORDERS as i64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Stopping settles what each consumer runs; on SQLite under load that once
    // took more than 30 s, so the bound is the scenario's own, and how long it
    // took goes into the row.
    let _ = stop.send(true);
    let stopping = Instant::now();
    for consumer in consumers {
        let left = SETTLE.saturating_sub(stopping.elapsed());
        if tokio::time::timeout(left, consumer).await.is_err() {
            row.problems
                .push(format!("a consumer did not stop within {SETTLE:?}"));
        }
    }
    let stopped_in = stopping.elapsed();
    let after = match broker {
        Broker::RabbitMq => rabbit_left(&name).await,
        Broker::JetStream => jet_left(&name).await,
    };
    row.check(left == 0 && after == 0, || {
        format!("left in the broker: {left} while consuming, {after} once stopped")
    });

    let pool = store.pool();
    let count = |sql: &'static str| async move {
        sqlx::query_as::<_, (i64,)>(sql)
            .fetch_one(pool)
            .await
            .map(|(n,)| n)
    };
    let counted = match count("SELECT COUNT(*) FROM effects").await {
        Ok(all) => count("SELECT COUNT(DISTINCT note) FROM effects")
            .await
            .map(|distinct| (all, distinct)),
        Err(error) => Err(error),
    };
    match counted {
        Ok((all, distinct)) => {
            row.effects = u64::try_from(all).unwrap_or(0);
            row.doubles = u64::try_from(all - distinct).unwrap_or(0);
            row.check(distinct == ORDERS as i64, || {
                format!("{distinct} orders with an effect, expected {ORDERS}")
            });
        }
        Err(error) => row.problems.push(format!("counting: {error}")),
    }
    let (charges, again) = {
        let runs = provider.runs.lock().expect("runs");
        (
            runs.values().sum(),
            runs.values().filter(|n| **n > 1).count(),
        )
    };
    row.charges = Some(charges);
    row.note = format!(
        "broker restarted at {} effects, database at {}; {again} orders ran again after a \
         rollback; consumers stopped in {:.1} s",
        at.0,
        at.1,
        stopped_in.as_secs_f64()
    );
    match broker {
        Broker::RabbitMq => delete_queue(&name).await,
        Broker::JetStream => {
            if let Ok(client) = async_nats::connect(nats_url()).await {
                let _ = jetstream::new(client).delete_stream(&name).await;
            }
        }
    }
    store.pool().close().await;
}

/// Stops RabbitMQ (`rabbitmqctl stop`) and starts it as `.ci/run` does
/// (`service rabbitmq-server start`); returns once its port takes connections
/// again. Not `service rabbitmq-server restart`: its stop waits for a pid file
/// that a server started otherwise never wrote.
async fn restart_rabbitmq() -> Result<(), String> {
    let run = |program: &'static str, args: &'static [&'static str]| async move {
        let status = tokio::process::Command::new(program)
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .status();
        match tokio::time::timeout(Duration::from_secs(120), status).await {
            Ok(Ok(status)) if status.success() => Ok(()),
            Ok(Ok(status)) => Err(format!("{program} {args:?}: {status}")),
            Ok(Err(error)) => Err(format!("{program}: {error}")),
            Err(_) => Err(format!("{program} {args:?}: still running after 120 s")),
        }
    };
    run("rabbitmqctl", &["stop"]).await?;
    for _ in 0..100 {
        if Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .is_err()
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    run("service", &["rabbitmq-server", "start"]).await?;
    for _ in 0..120 {
        if Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .is_ok()
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err("RabbitMQ did not come back within 60 s".into())
}

/// Stops the running nats-server and starts it again with the same command
/// line (as `.ci/run` starts it when it is down); returns once it answers.
async fn restart_nats() -> Result<(), String> {
    // The live one: an earlier instance may linger as a zombie, with no command line.
    let found = std::process::Command::new("pgrep")
        .args(["-x", "nats-server"])
        .output()
        .map_err(|e| format!("pgrep: {e}"))?;
    let (pid, argv) = String::from_utf8_lossy(&found.stdout)
        .split_whitespace()
        .find_map(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let argv: Vec<String> = cmdline
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            (!argv.is_empty()).then(|| (pid.to_owned(), argv))
        })
        .ok_or("no nats-server running")?;
    let _ = std::process::Command::new("kill").arg(&pid).status();
    for _ in 0..100 {
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (program, args) = argv.split_first().ok_or("an empty command line")?;
    // Its own session, so that it outlives this test.
    std::process::Command::new("setsid")
        .arg(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("starting nats-server again: {e}"))?;
    for _ in 0..120 {
        if async_nats::connect(nats_url()).await.is_ok() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err("NATS did not come back within 60 s".into())
}

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    }
}

async fn declare(queue: &str) -> Result<(), lapin::Error> {
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .queue_declare(queue.into(), durable(), FieldTable::default())
        .await?;
    connection.close(200, "".into()).await
}

/// The delay queues the adapter may have made for `queue`.
fn delay_queues(queue: &str) -> impl Iterator<Item = String> + '_ {
    [1, 2, 5, 10, 30, 60]
        .into_iter()
        .map(move |secs| format!("{queue}.idem-delay.{secs}s"))
}

/// Messages in `queue` and its delay queues, ready or unacknowledged, as
/// `rabbitmqctl` counts them (`u64::MAX` when it cannot tell).
async fn rabbit_left(queue: &str) -> u64 {
    let listed = tokio::process::Command::new("rabbitmqctl")
        .args([
            "list_queues",
            "-q",
            "--no-table-headers",
            "name",
            "messages",
        ])
        .output()
        .await;
    let Ok(listed) = listed else { return u64::MAX };
    if !listed.status.success() {
        return u64::MAX;
    }
    let ours: Vec<String> = std::iter::once(queue.to_owned())
        .chain(delay_queues(queue))
        .collect();
    String::from_utf8_lossy(&listed.stdout)
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (name, count) = (fields.next()?, fields.next()?);
            ours.iter()
                .any(|q| q == name)
                .then(|| count.parse::<u64>().ok())?
        })
        .sum()
}

async fn delete_queue(queue: &str) {
    let Ok(connection) = Connection::connect(&amqp_url(), ConnectionProperties::default()).await
    else {
        return;
    };
    if let Ok(channel) = connection.create_channel().await {
        for name in std::iter::once(queue.to_owned()).chain(delay_queues(queue)) {
            let _ = channel
                .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
    }
    let _ = connection.close(200, "".into()).await;
}

/// Publishes every order `COPIES` times, each publish again until the broker
/// confirms it, on a connection made again whenever it is lost.
async fn rabbit_publish(queue: String, published: Arc<AtomicU64>) -> Result<(), String> {
    let mut channel: Option<(Connection, lapin::Channel)> = None;
    let began = Instant::now();
    for copy in 0..COPIES {
        for n in 0..ORDERS {
            let id = format!("order-{n}");
            let payload = format!("{{\"order\":{n}}}");
            loop {
                if began.elapsed() > SETTLE {
                    return Err(format!("{id} not confirmed within {SETTLE:?}"));
                }
                if channel.is_none() {
                    channel = open_publisher().await.ok();
                }
                let Some((_, open)) = &channel else {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                };
                published.fetch_add(1, Ordering::Relaxed);
                let properties = BasicProperties::default()
                    .with_message_id(id.as_str().into())
                    .with_delivery_mode(2);
                let sent = open
                    .basic_publish(
                        "".into(),
                        queue.as_str().into(),
                        BasicPublishOptions::default(),
                        payload.as_bytes(),
                        properties,
                    )
                    .await;
                let confirmed = match sent {
                    Ok(confirm) => tokio::time::timeout(Duration::from_secs(5), confirm).await,
                    Err(error) => Ok(Err(error)),
                };
                match confirmed {
                    Ok(Ok(confirmation)) if confirmation.is_ack() => break,
                    _ => {
                        channel = None;
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
            // About 50 a second at first: the stream outlasts the faults' start.
            if n % 5 == 0 && copy == 0 {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    if let Some((connection, _)) = channel {
        let _ = connection.close(200, "".into()).await;
    }
    Ok(())
}

async fn open_publisher() -> Result<(Connection, lapin::Channel), lapin::Error> {
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok((connection, channel))
}

/// A consumer as a deployment runs one: connected again whenever its
/// connection is lost, until `stopped`.
async fn rabbit_worker<DB, H, Fut>(
    store: Idempotency<DB>,
    queue: String,
    stopped: watch::Receiver<bool>,
    handler: H,
) where
    DB: idem_axum::Backend,
    H: Fn(String, Tx<DB>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<String, String>> + Send + 'static,
{
    while !*stopped.borrow() {
        let Ok((connection, channel)) = open_publisher().await else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        let consumer = idem_axum::rabbitmq::Consumer::new(store.clone(), &queue)
            .options(Options::new().lock(Duration::from_secs(5)))
            .retries(Retries::new(20).backoff(Duration::from_millis(200), Duration::from_secs(1)));
        let handler = handler.clone();
        let mut stop = stopped.clone();
        let until = async move {
            let _ = stop.wait_for(|stopped| *stopped).await;
        };
        let running = consumer.run_until(&channel, until, move |message, tx| {
            let id = message
                .properties
                .message_id()
                .as_ref()
                .map_or_else(String::new, |id| id.as_str().to_owned());
            handler(id, tx)
        });
        // A connection the broker dropped may leave the consumer waiting on it.
        tokio::select! {
            _ = running => {}
            () = lost(&connection) => {}
        }
        let _ =
            tokio::time::timeout(Duration::from_secs(2), connection.close(200, "".into())).await;
        if !*stopped.borrow() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// Resolves once `connection` is no longer connected.
async fn lost(connection: &Connection) {
    while connection.status().connected() {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn jet_stream(name: &str) -> Result<jetstream::Context, String> {
    let client = async_nats::connect(nats_url())
        .await
        .map_err(|e| e.to_string())?;
    let js = jetstream::new(client);
    let stream = js
        .get_or_create_stream(stream::Config {
            name: name.to_owned(),
            subjects: vec![format!("{name}.>")],
            // Copies arrive, as a retrying publisher's beyond the window do.
            duplicate_window: Duration::from_millis(100),
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    stream
        .get_or_create_consumer(
            "charge",
            pull::Config {
                durable_name: Some("charge".to_owned()),
                ack_wait: Duration::from_secs(5),
                ..Default::default()
            },
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok(js)
}

async fn jet_publish(
    mut js: jetstream::Context,
    name: String,
    published: Arc<AtomicU64>,
) -> Result<(), String> {
    let began = Instant::now();
    let subject = format!("{name}.orders");
    for copy in 0..COPIES {
        for n in 0..ORDERS {
            let id = format!("order-{n}");
            let payload = format!("{{\"order\":{n}}}");
            loop {
                if began.elapsed() > SETTLE {
                    return Err(format!("{id} not stored within {SETTLE:?}"));
                }
                published.fetch_add(1, Ordering::Relaxed);
                let mut headers = async_nats::HeaderMap::new();
                headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
                let sent = js
                    .publish_with_headers(subject.clone(), headers, payload.clone().into())
                    .await;
                let stored = match sent {
                    Ok(ack) => tokio::time::timeout(Duration::from_secs(5), ack)
                        .await
                        .map_err(|_| "no ack".to_owned())
                        .and_then(|ack| ack.map(drop).map_err(|e| e.to_string())),
                    Err(error) => Err(error.to_string()),
                };
                if stored.is_ok() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
                if let Ok(client) = async_nats::connect(nats_url()).await {
                    js = jetstream::new(client);
                }
            }
            if n % 5 == 0 && copy == 0 {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        // Past the duplicate window: the second copies reach the consumers.
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    Ok(())
}

/// Messages of the stream not yet delivered or not yet acknowledged
/// (`u64::MAX` when the server cannot tell).
async fn jet_left(name: &str) -> u64 {
    let Ok(client) = async_nats::connect(nats_url()).await else {
        return u64::MAX;
    };
    let js = jetstream::new(client);
    let Ok(stream) = js.get_stream(name).await else {
        return u64::MAX;
    };
    let Ok(mut consumer) = stream.get_consumer::<pull::Config>("charge").await else {
        return u64::MAX;
    };
    match consumer.info().await {
        Ok(info) => info.num_pending + info.num_ack_pending as u64,
        Err(_) => u64::MAX,
    }
}

async fn jet_worker<DB, H, Fut>(
    store: Idempotency<DB>,
    name: String,
    stopped: watch::Receiver<bool>,
    handler: H,
) where
    DB: idem_axum::Backend,
    H: Fn(String, Tx<DB>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<String, String>> + Send + 'static,
{
    while !*stopped.borrow() {
        let connected = async {
            let client = async_nats::connect(nats_url()).await.ok()?;
            let js = jetstream::new(client);
            let stream = js.get_stream(&name).await.ok()?;
            let consumer = stream.get_consumer::<pull::Config>("charge").await.ok()?;
            Some((js, consumer))
        };
        let Some((js, consumer)) = connected.await else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        let idem = idem_axum::jetstream::Consumer::new(store.clone())
            .options(Options::new().lock(Duration::from_secs(5)))
            .retries(Retries::new(20).backoff(Duration::from_millis(200), Duration::from_secs(1)));
        let handler = handler.clone();
        let mut stop = stopped.clone();
        let until = async move {
            let _ = stop.wait_for(|stopped| *stopped).await;
        };
        let _ = idem
            .run_until(&js, &consumer, until, move |message, tx| {
                let id = message
                    .headers
                    .as_ref()
                    .and_then(|headers| headers.get(async_nats::header::NATS_MESSAGE_ID))
                    .map_or_else(String::new, |id| id.as_str().to_owned());
                handler(id, tx)
            })
            .await;
        if !*stopped.borrow() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}
