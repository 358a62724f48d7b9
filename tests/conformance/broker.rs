//! Messages from real brokers through idem's adapters (docs/contract.md,
//! "Messages"): RabbitMQ (`idem_axum::rabbitmq`) at `IDEM_TEST_AMQP_URL`
//! (default `amqp://guest:guest@127.0.0.1:5672/%2f`) and NATS JetStream
//! (`idem_axum::jetstream`) at `IDEM_TEST_NATS_URL` (default
//! `127.0.0.1:4222`). Every test counts the handler's effects in the database
//! and checks that the broker holds nothing unacknowledged at the end. A
//! broker that cannot be reached skips its tests, except under `CI=true`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, stream};
use idem_axum::{Options, Retries, Tx};
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use tokio::sync::Notify;

use crate::harness::{Harness, in_ci, unique};
use crate::start;

/// The scope the handlers write their effects under.
const SHOP: &str = "shop";

async fn rabbit() -> Option<Connection> {
    let url = std::env::var("IDEM_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    match Connection::connect(&url, ConnectionProperties::default()).await {
        Ok(connection) => Some(connection),
        Err(error) if !in_ci() => {
            eprintln!(
                "SKIPPED: RabbitMQ not reachable at {url} ({error}); CI=true makes this a failure"
            );
            None
        }
        Err(error) => panic!("RabbitMQ not reachable at {url}: {error}"),
    }
}

async fn nats() -> Option<jetstream::Context> {
    let url = std::env::var("IDEM_TEST_NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".to_owned());
    match async_nats::connect(&url).await {
        Ok(client) => Some(jetstream::new(client)),
        Err(error) if !in_ci() => {
            eprintln!(
                "SKIPPED: NATS not reachable at {url} ({error}); CI=true makes this a failure"
            );
            None
        }
        Err(error) => panic!("NATS not reachable at {url}: {error}"),
    }
}

/// The handler every consumer here runs: one effect noted with the message's
/// id, its result the id's charge. `hold` makes it wait for the test first.
async fn charge<H: Harness>(
    mut tx: Tx<H::DB>,
    id: String,
    hold: Option<Arc<Hold>>,
) -> Result<String, String> {
    H::insert_effect(&mut tx, SHOP, &id)
        .await
        .map_err(|error| error.to_string())?;
    if let Some(hold) = hold {
        hold.inside.notify_one();
        hold.go.notified().await;
    }
    if id.starts_with("fail") {
        return Err(format!("{id} declined"));
    }
    Ok(format!("charge-{id}"))
}

/// A handler held inside its run until the test lets it go.
#[derive(Default)]
struct Hold {
    inside: Notify,
    go: Notify,
}

/// Waits until `done` holds, for `bound` at most.
async fn until<F: Future<Output = bool>>(bound: Duration, mut done: impl FnMut() -> F) -> bool {
    let start = Instant::now();
    while start.elapsed() < bound {
        if done().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    done().await
}

/// How many of the effects name `id`, and how many effects in all.
async fn effects_of<H: Harness>(h: &H, id: &str) -> i64 {
    h.count(
        "SELECT COUNT(*) FROM effects WHERE scope = $1 AND note = $2",
        &[SHOP, id],
    )
    .await
}

async fn distinct_effects<H: Harness>(h: &H) -> i64 {
    h.count(
        "SELECT COUNT(DISTINCT note) FROM effects WHERE scope = $1",
        &[SHOP],
    )
    .await
}

/// How long one look at the broker may take. A passive declare of a missing
/// queue makes the broker close its channel, and a channel opened in the same
/// breath has been seen to wait forever for its open-ok: every look is bounded,
/// so that one never hangs a test.
const LOOK: Duration = Duration::from_secs(5);

/// RabbitMQ: messages ready in `queue` (0 when it does not exist; `u32::MAX`
/// when the broker did not answer in time, so that a caller looks again).
async fn ready(connection: &Connection, queue: &str) -> u32 {
    let Ok(Ok(channel)) = tokio::time::timeout(LOOK, connection.create_channel()).await else {
        return u32::MAX;
    };
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let declared = channel.queue_declare(queue.into(), passive, FieldTable::default());
    let count = match tokio::time::timeout(LOOK, declared).await {
        Ok(Ok(declared)) => declared.message_count(),
        Ok(Err(_)) => 0,
        Err(_) => u32::MAX,
    };
    let _ = tokio::time::timeout(LOOK, channel.close(200, "".into())).await;
    count
}

/// RabbitMQ: messages ready in `queue` and in every delay queue of its.
async fn ready_anywhere(connection: &Connection, queue: &str) -> u32 {
    let mut total = ready(connection, queue).await;
    for secs in [1, 2, 5, 10, 30, 60] {
        total =
            total.saturating_add(ready(connection, &format!("{queue}.idem-delay.{secs}s")).await);
    }
    total
}

async fn declare(connection: &Connection, queue: &str) {
    let channel = connection.create_channel().await.expect("a channel");
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.into(), durable, FieldTable::default())
        .await
        .expect("the queue");
}

/// Deletes the test's queues, each look bounded (`LOOK`): what is left behind
/// is a unique name no other run uses.
async fn delete_queues(connection: &Connection, queues: &[String]) {
    let Ok(Ok(channel)) = tokio::time::timeout(LOOK, connection.create_channel()).await else {
        eprintln!("the broker opened no channel to delete {queues:?}: left behind");
        return;
    };
    for queue in queues {
        let mut names = vec![queue.clone()];
        names.extend([1, 2, 5, 10, 30, 60].map(|secs| format!("{queue}.idem-delay.{secs}s")));
        for name in names {
            let deleted = channel.queue_delete(name.as_str().into(), QueueDeleteOptions::default());
            let _ = tokio::time::timeout(LOOK, deleted).await;
        }
    }
}

/// Publishes `payload` as `id` and waits for the broker's confirm (30 s at most).
async fn publish(connection: &Connection, queue: &str, id: &str, payload: &[u8]) {
    tokio::time::timeout(
        Duration::from_secs(30),
        publish_confirmed(connection, queue, id, payload),
    )
    .await
    .expect("published and confirmed within 30 s");
}

async fn publish_confirmed(connection: &Connection, queue: &str, id: &str, payload: &[u8]) {
    let channel = connection.create_channel().await.expect("a channel");
    channel
        .confirm_select(lapin::options::ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    let properties = BasicProperties::default()
        .with_message_id(id.into())
        .with_delivery_mode(2);
    let confirmed = channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            payload,
            properties,
        )
        .await
        .expect("published")
        .await
        .expect("confirmed");
    assert!(confirmed.is_ack());
    let _ = tokio::time::timeout(LOOK, channel.close(200, "".into())).await;
}

/// A RabbitMQ consumer running in a task of its own, on a connection of its
/// own which the test may close to cut it off.
struct Running {
    stop: tokio::sync::oneshot::Sender<()>,
    connection: Connection,
    task: tokio::task::JoinHandle<Result<(), lapin::Error>>,
}

impl Running {
    /// Stops it as a deployment does: it finishes and acknowledges what it
    /// runs, then its connection closes.
    async fn stop(self) {
        let _ = self.stop.send(());
        let ended = tokio::time::timeout(Duration::from_secs(60), self.task)
            .await
            .expect("the consumer stops within 60 s")
            .expect("the consumer's task");
        assert!(ended.is_ok(), "stopped cleanly: {ended:?}");
        let _ = tokio::time::timeout(LOOK, self.connection.close(200, "".into())).await;
    }
}

/// Starts a RabbitMQ consumer of `queue`.
async fn rabbit_consumer<H: Harness>(
    store: idem_axum::Idempotency<H::DB>,
    queue: &str,
    dead: Option<&str>,
    hold: Option<Arc<Hold>>,
) -> Running {
    let connection = rabbit().await.expect("RabbitMQ");
    let channel = connection.create_channel().await.expect("a channel");
    let mut consumer = idem_axum::rabbitmq::Consumer::new(store, queue)
        .options(Options::new().lock(Duration::from_secs(10)))
        .retries(Retries::new(3).backoff(Duration::from_millis(100), Duration::from_millis(200)));
    if let Some(dead) = dead {
        consumer = consumer.dead_letter(dead);
    }
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let stopped = async move {
            let _ = stopped.await;
        };
        consumer
            .run_until(&channel, stopped, move |message, tx| {
                let id = message
                    .properties
                    .message_id()
                    .as_ref()
                    .map_or_else(String::new, |id| id.as_str().to_owned());
                charge::<H>(tx, id, hold.clone())
            })
            .await
    });
    Running {
        stop,
        connection,
        task,
    }
}

/// Stops `consumers`, then has one more consumer take what they had been
/// given but not started (back in the queue once their connections closed)
/// until the queue and its delay queues stay empty: whatever it takes must be
/// done already, which the caller checks on the effects.
async fn stop_and_drain<H: Harness>(
    h: &H,
    publisher: &Connection,
    queue: &str,
    consumers: Vec<Running>,
) {
    for consumer in consumers {
        consumer.stop().await;
    }
    for _ in 0..3 {
        if ready_anywhere(publisher, queue).await == 0 {
            return;
        }
        let drain = rabbit_consumer::<H>(h.another_instance(), queue, None, None).await;
        until(Duration::from_secs(30), || async {
            ready_anywhere(publisher, queue).await == 0
        })
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        drain.stop().await;
    }
    assert_eq!(ready_anywhere(publisher, queue).await, 0, "drained");
}

/// (c) RabbitMQ: 200 messages each published four times, and one published
/// five times in a row by a retrying publisher, consumed by three consumers at
/// once: each runs once, every id's record is complete, and nothing is left
/// in the queue or its delay queues.
pub async fn rabbitmq_duplicates_over_three_consumers_run_once<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let Some(publisher) = rabbit().await else {
        return;
    };
    let queue = unique("idem_orders");
    declare(&publisher, &queue).await;
    let mut consumers = Vec::new();
    for _ in 0..3 {
        consumers.push(rabbit_consumer::<H>(h.another_instance(), &queue, None, None).await);
    }
    for _ in 0..5 {
        publish(&publisher, &queue, "retried", b"{\"order\":\"retried\"}").await;
    }
    for copy in 0..4 {
        for n in 0..200 {
            let id = format!("m-{n}");
            let payload = format!("{{\"order\":{n}}}");
            publish(&publisher, &queue, &id, payload.as_bytes()).await;
            if copy == 0 && n % 50 == 0 {
                tokio::task::yield_now().await;
            }
        }
    }
    let settled = until(Duration::from_secs(90), || async {
        h.effects(SHOP).await >= 201 && ready_anywhere(&publisher, &queue).await == 0
    })
    .await;
    assert!(
        settled,
        "every message consumed: {} effects",
        h.effects(SHOP).await
    );
    stop_and_drain(&h, &publisher, &queue, consumers).await;
    assert_eq!(h.effects(SHOP).await, 201, "one effect per message");
    assert_eq!(distinct_effects(&h).await, 201);
    assert_eq!(effects_of(&h, "retried").await, 1);
    delete_queues(&publisher, &[queue]).await;
    h.finish().await;
}

/// (a) RabbitMQ: a consumer cut off from the broker while its run is inside
/// the handler, which then commits: the broker hands the message to a second
/// consumer, which finds it in flight and sends it round the delay queue, then
/// finds it done and acknowledges it. One effect; nothing left unacknowledged.
pub async fn rabbitmq_a_consumer_cut_off_before_its_ack<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let Some(publisher) = rabbit().await else {
        return;
    };
    let queue = unique("idem_orders");
    declare(&publisher, &queue).await;
    let hold = Arc::new(Hold::default());
    let first =
        rabbit_consumer::<H>(h.store().clone(), &queue, None, Some(Arc::clone(&hold))).await;
    publish(&publisher, &queue, "m-1", b"{\"order\":1}").await;
    tokio::time::timeout(Duration::from_secs(10), hold.inside.notified())
        .await
        .expect("the first consumer runs it");
    // The broker sees the first consumer go, as it would on SIGKILL.
    tokio::time::timeout(LOOK, first.connection.close(320, "cut off".into()))
        .await
        .expect("closed in time")
        .expect("closed");
    let second = rabbit_consumer::<H>(h.another_instance(), &queue, None, None).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    hold.go.notify_one();
    // Its acknowledgement cannot be sent: its run ends, the message unacknowledged.
    tokio::time::timeout(Duration::from_secs(10), first.task)
        .await
        .expect("the first consumer ends")
        .expect("the first consumer's task")
        .ok();
    // The run committed all the same; the second consumer finds it in flight,
    // then done.
    let settled = until(Duration::from_secs(30), || async {
        ready_anywhere(&publisher, &queue).await == 0 && h.effects(SHOP).await == 1
    })
    .await;
    assert!(settled);
    stop_and_drain(&h, &publisher, &queue, vec![second]).await;
    assert_eq!(effects_of(&h, "m-1").await, 1, "ran once");
    delete_queues(&publisher, &[queue]).await;
    h.finish().await;
}

/// (e) RabbitMQ: the same id with another payload, and a message whose
/// handler always fails, are dead-lettered with their reasons; neither leaves
/// an effect beyond the first payload's, and nothing stays in the queue.
pub async fn rabbitmq_mismatches_and_failures_are_dead_lettered<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let Some(publisher) = rabbit().await else {
        return;
    };
    let queue = unique("idem_orders");
    let dead = format!("{queue}.dead");
    declare(&publisher, &queue).await;
    let consumer = rabbit_consumer::<H>(h.store().clone(), &queue, Some(&dead), None).await;
    publish(&publisher, &queue, "m-1", b"{\"order\":1}").await;
    assert!(
        until(Duration::from_secs(10), || async {
            h.effects(SHOP).await == 1
        })
        .await
    );
    publish(&publisher, &queue, "m-1", b"{\"order\":2}").await;
    publish(&publisher, &queue, "fail-1", b"{\"order\":3}").await;
    let dead_lettered = until(Duration::from_secs(30), || async {
        ready(&publisher, &dead).await == 2 && ready_anywhere(&publisher, &queue).await == 0
    })
    .await;
    assert!(dead_lettered, "both dead-lettered");
    stop_and_drain(&h, &publisher, &queue, vec![consumer]).await;
    let channel = publisher.create_channel().await.expect("a channel");
    let mut reasons = Vec::new();
    while let Some(message) = channel
        .basic_get(dead.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .expect("a get")
    {
        let headers = message.properties.headers().clone().unwrap_or_default();
        let reason = match headers.inner().get("x-idem-reason") {
            Some(AMQPValue::LongString(reason)) => {
                String::from_utf8_lossy(reason.as_bytes()).into_owned()
            }
            other => panic!("a reason: {other:?}"),
        };
        let id = message
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.to_string());
        reasons.push((id.unwrap_or_default(), reason));
    }
    reasons.sort();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert_eq!(reasons[0].0, "fail-1");
    assert!(
        reasons[0].1.contains("failed 3 times") && reasons[0].1.contains("declined"),
        "{reasons:?}"
    );
    assert_eq!(reasons[1].0, "m-1");
    assert!(reasons[1].1.contains("payload"), "{reasons:?}");
    assert_eq!(h.effects(SHOP).await, 1, "only the first payload's run");
    assert_eq!(ready_anywhere(&publisher, &queue).await, 0);
    delete_queues(&publisher, &[queue, dead]).await;
    h.finish().await;
}

/// The stream's duplicate window, and the pause that takes a copy past it.
const WINDOW: Duration = Duration::from_millis(100);
const PAST_WINDOW: Duration = Duration::from_millis(120);

/// A JetStream stream of its own for one test, and a durable pull consumer on
/// it with the given ack wait.
async fn jet(
    js: &jetstream::Context,
    ack_wait: Duration,
) -> (String, pull::Config, jetstream::stream::Stream) {
    let name = unique("IDEM");
    let stream = js
        .get_or_create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![format!("{name}.>")],
            // The shortest the server takes: copies published further apart
            // reach the consumer, as a publisher's retries beyond it do.
            duplicate_window: WINDOW,
            ..Default::default()
        })
        .await
        .expect("a stream");
    let config = pull::Config {
        durable_name: Some("charge".to_owned()),
        ack_wait,
        filter_subject: format!("{name}.orders"),
        ..Default::default()
    };
    (name, config, stream)
}

fn jet_consumer<H: Harness>(
    store: idem_axum::Idempotency<H::DB>,
    js: jetstream::Context,
    consumer: jetstream::consumer::PullConsumer,
    progress: Option<Option<Duration>>,
    dead: Option<String>,
) -> tokio::task::JoinHandle<Result<(), async_nats::Error>> {
    let mut idem = idem_axum::jetstream::Consumer::new(store)
        .options(Options::new().lock(Duration::from_secs(10)))
        .retries(Retries::new(3).backoff(Duration::from_millis(100), Duration::from_millis(200)));
    if let Some(every) = progress {
        idem = idem.progress(every);
    }
    if let Some(dead) = dead {
        idem = idem.dead_letter(dead);
    }
    tokio::spawn(async move {
        idem.run(&js, &consumer, |message, tx| {
            let id = message
                .headers
                .as_ref()
                .and_then(|headers| headers.get(async_nats::header::NATS_MESSAGE_ID))
                .map_or_else(String::new, |id| id.as_str().to_owned());
            let slow = id.starts_with("slow");
            async move {
                if slow {
                    tokio::time::sleep(Duration::from_millis(2500)).await;
                }
                charge::<H>(tx, id, None).await
            }
        })
        .await
    })
}

async fn jet_publish(js: &jetstream::Context, subject: String, id: &str, payload: &'static [u8]) {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(async_nats::header::NATS_MESSAGE_ID, id);
    js.publish_with_headers(subject, headers, payload.into())
        .await
        .expect("published")
        .await
        .expect("stored");
}

/// Nothing left to deliver or acknowledge on the consumer.
async fn jet_drained(consumer: &mut jetstream::consumer::PullConsumer) -> bool {
    match consumer.info().await {
        Ok(info) => info.num_pending == 0 && info.num_ack_pending == 0,
        Err(_) => false,
    }
}

/// (b) JetStream: an ack wait shorter than the handler, two consumers, no
/// progress told: the message is delivered again while the first run holds
/// it; that delivery never runs, and is delayed, not redelivered at once;
/// the first's late acknowledgement is harmless, and the message ends
/// acknowledged with one effect.
pub async fn jetstream_an_ack_wait_shorter_than_the_handler<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let Some(js) = nats().await else { return };
    let (name, config, stream) = jet(&js, Duration::from_secs(1)).await;
    let mut consumer = stream
        .get_or_create_consumer("charge", config.clone())
        .await
        .expect("a consumer");
    let tasks = [
        jet_consumer::<H>(
            h.store().clone(),
            js.clone(),
            consumer.clone(),
            Some(None),
            None,
        ),
        jet_consumer::<H>(
            h.another_instance(),
            js.clone(),
            consumer.clone(),
            Some(None),
            None,
        ),
    ];
    jet_publish(&js, format!("{name}.orders"), "slow-1", b"{\"order\":1}").await;
    let settled = until(Duration::from_secs(30), || async {
        h.effects(SHOP).await == 1 && jet_drained(&mut consumer.clone()).await
    })
    .await;
    assert!(settled, "acknowledged");
    let info = consumer.info().await.expect("info");
    assert!(
        info.num_redelivered > 0 || info.delivered.consumer_sequence > 1,
        "delivered again: {info:?}"
    );
    for task in tasks {
        task.abort();
    }
    assert_eq!(effects_of(&h, "slow-1").await, 1, "ran once");
    js.delete_stream(&name).await.expect("deleted");
    h.finish().await;
}

/// (c) JetStream: 200 messages each published four times, and one published
/// five times in a row, past the stream's duplicate window, consumed by three
/// consumers at once: each runs once, and the consumer ends with nothing
/// pending or unacknowledged.
pub async fn jetstream_duplicates_over_three_consumers_run_once<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let Some(js) = nats().await else { return };
    let (name, config, stream) = jet(&js, Duration::from_secs(5)).await;
    let mut consumer = stream
        .get_or_create_consumer("charge", config)
        .await
        .expect("a consumer");
    let tasks: Vec<_> = (0..3)
        .map(|_| {
            jet_consumer::<H>(
                h.another_instance(),
                js.clone(),
                consumer.clone(),
                None,
                None,
            )
        })
        .collect();
    let subject = format!("{name}.orders");
    for _ in 0..5 {
        tokio::time::sleep(PAST_WINDOW).await;
        jet_publish(&js, subject.clone(), "retried", b"{}").await;
    }
    for _ in 0..4 {
        tokio::time::sleep(PAST_WINDOW).await;
        for n in 0..200 {
            jet_publish(&js, subject.clone(), &format!("m-{n}"), b"{}").await;
        }
    }
    let settled = until(Duration::from_secs(90), || async {
        h.effects(SHOP).await >= 201 && jet_drained(&mut consumer.clone()).await
    })
    .await;
    assert!(
        settled,
        "every message consumed: {} effects",
        h.effects(SHOP).await
    );
    let info = stream.get_info().await.expect("stream info");
    assert!(
        info.state.messages > 201,
        "the copies reached the stream: {}",
        info.state.messages
    );
    for task in tasks {
        task.abort();
    }
    assert!(jet_drained(&mut consumer).await);
    assert_eq!(h.effects(SHOP).await, 201, "one effect per message");
    assert_eq!(distinct_effects(&h).await, 201);
    js.delete_stream(&name).await.expect("deleted");
    h.finish().await;
}

/// (e) JetStream: the same id with another payload, and a message whose
/// handler always fails, are published to the dead-letter subject with their
/// reasons and terminated; only the first payload's run has an effect.
pub async fn jetstream_mismatches_and_failures_are_dead_lettered<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let Some(js) = nats().await else { return };
    let (name, config, stream) = jet(&js, Duration::from_secs(5)).await;
    let consumer = stream
        .get_or_create_consumer("charge", config)
        .await
        .expect("a consumer");
    let dead = format!("{name}.dead");
    let task = jet_consumer::<H>(
        h.store().clone(),
        js.clone(),
        consumer.clone(),
        None,
        Some(dead.clone()),
    );
    let subject = format!("{name}.orders");
    jet_publish(&js, subject.clone(), "m-1", b"{\"order\":1}").await;
    assert!(
        until(Duration::from_secs(10), || async {
            h.effects(SHOP).await == 1
        })
        .await
    );
    tokio::time::sleep(PAST_WINDOW).await;
    jet_publish(&js, subject.clone(), "m-1", b"{\"order\":2}").await;
    jet_publish(&js, subject, "fail-1", b"{}").await;
    let reader = stream
        .get_or_create_consumer(
            "dead",
            pull::Config {
                durable_name: Some("dead".to_owned()),
                filter_subject: dead,
                ..Default::default()
            },
        )
        .await
        .expect("a reader");
    let mut reasons = Vec::new();
    let start = Instant::now();
    while reasons.len() < 2 && start.elapsed() < Duration::from_secs(30) {
        let mut batch = reader
            .fetch()
            .max_messages(2)
            .expires(Duration::from_secs(1))
            .messages()
            .await
            .expect("a fetch");
        while let Some(Ok(message)) = futures_util::StreamExt::next(&mut batch).await {
            let headers = message.headers.clone().unwrap_or_default();
            let text = |name: &str| {
                headers
                    .get(name)
                    .map(|v| v.as_str().to_owned())
                    .unwrap_or_default()
            };
            reasons.push((text("Idem-Message-Id"), text("Idem-Reason")));
            message.ack().await.expect("acked");
        }
    }
    reasons.sort();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert_eq!(reasons[0].0, "fail-1");
    assert!(
        reasons[0].1.contains("failed 3 times") && reasons[0].1.contains("declined"),
        "{reasons:?}"
    );
    assert_eq!(reasons[1].0, "m-1");
    assert!(reasons[1].1.contains("payload"), "{reasons:?}");
    assert!(
        until(Duration::from_secs(10), || async {
            jet_drained(&mut consumer.clone()).await
        })
        .await
    );
    task.abort();
    assert_eq!(h.effects(SHOP).await, 1, "only the first payload's run");
    js.delete_stream(&name).await.expect("deleted");
    h.finish().await;
}

/// The consumer the brokers' users write without idem, as the baseline the
/// tests above must catch: a `seen` table checked before the handler's
/// transaction and written after it. Under the storm of
/// [`rabbitmq_duplicates_over_three_consumers_run_once`] (its handler taking
/// 20 ms, as a provider call does) some copies pass the check together and
/// run twice: the test proves it counts them.
pub async fn rabbitmq_a_check_then_insert_consumer_runs_messages_twice<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let Some(publisher) = rabbit().await else {
        return;
    };
    h.script("CREATE TABLE seen (id VARCHAR(200) PRIMARY KEY)")
        .await;
    let queue = unique("idem_orders");
    declare(&publisher, &queue).await;
    let h = Arc::new(h);
    let mut consumers = Vec::new();
    for _ in 0..3 {
        let connection = rabbit().await.expect("RabbitMQ");
        let channel = connection.create_channel().await.expect("a channel");
        channel
            .basic_qos(10, lapin::options::BasicQosOptions::default())
            .await
            .expect("qos");
        let deliveries = channel
            .basic_consume(
                queue.as_str().into(),
                "".into(),
                lapin::options::BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("a consumer");
        let h = Arc::clone(&h);
        let task = tokio::spawn(futures_util::StreamExt::for_each_concurrent(
            deliveries,
            10,
            move |delivery| {
                let h = Arc::clone(&h);
                async move {
                    let Ok(delivery) = delivery else { return };
                    let id = delivery
                        .properties
                        .message_id()
                        .as_ref()
                        .map(|id| id.to_string())
                        .unwrap_or_default();
                    let seen = h
                        .count("SELECT COUNT(*) FROM seen WHERE id = $1", &[&id])
                        .await;
                    if seen == 0 {
                        let mut conn = h.direct_pool().acquire().await.expect("a connection");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        H::exec(
                            &mut conn,
                            "INSERT INTO effects (scope, note) VALUES ($1, $2)",
                            &[SHOP, &id],
                        )
                        .await
                        .expect("the effect");
                        // A second copy that passed the check too fails here, after its effect.
                        let _ =
                            H::exec(&mut conn, "INSERT INTO seen (id) VALUES ($1)", &[&id]).await;
                    }
                    let _ = delivery
                        .ack(lapin::options::BasicAckOptions::default())
                        .await;
                }
            },
        ));
        consumers.push((connection, task));
    }
    for n in 0..200 {
        for _ in 0..4 {
            publish(&publisher, &queue, &format!("m-{n}"), b"{}").await;
        }
    }
    let settled = until(Duration::from_secs(60), || async {
        ready(&publisher, &queue).await == 0 && distinct_effects(&*h).await == 200
    })
    .await;
    assert!(settled, "consumed");
    for (connection, task) in consumers {
        let _ = connection.close(200, "".into()).await;
        let _ = task.await;
    }
    let effects = h.effects(SHOP).await;
    eprintln!("check-then-insert: {effects} effects for 200 messages");
    assert!(
        effects > 200,
        "some messages ran twice: {effects} effects for 200 messages"
    );
    delete_queues(&publisher, &[queue]).await;
    if let Ok(h) = Arc::try_unwrap(h) {
        h.finish().await;
    }
}
