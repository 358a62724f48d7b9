//! RabbitMQ consumers through lapin (feature `lapin`; docs/contract.md,
//! "Messages"): the loop a consumer would otherwise write, on
//! [`Idempotency::process`]. Each delivery is acknowledged only after its run
//! committed; a delivery to come back later is published, with publisher
//! confirms, to a delay queue that dead-letters it back once its wait is over
//! (RabbitMQ has no delayed requeue, and an immediate one would come straight
//! back); a message that must never run is dead-lettered with its reason.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{StreamExt, TryStreamExt};
use lapin::message::Delivery as AmqpDelivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    BasicRejectOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel};

use crate::backend::Backend;
use crate::consumer::{Retries, Step, step};
use crate::message::{Delivery, Replayable};
use crate::options::Options;
use crate::store::Idempotency;
use crate::tx::Tx;

/// The header that counts a message's failed attempts, on the copies this
/// consumer publishes.
pub const ATTEMPTS_HEADER: &str = "x-idem-attempts";
/// The header that says why a message was dead-lettered.
pub const REASON_HEADER: &str = "x-idem-reason";
/// The header that names the queue a dead-lettered message was consumed from.
pub const QUEUE_HEADER: &str = "x-idem-queue";

/// The waits a delay queue exists for: a wait is rounded up to the next, so
/// that a queue holds messages of one wait only (a queue expires messages
/// from its head alone) and a consumer declares a handful of queues.
const DELAYS: [u64; 11] = [1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600];

type KeyOf = dyn Fn(&AmqpDelivery) -> Option<String> + Send + Sync;
type ScopeOf = dyn Fn(&AmqpDelivery) -> String + Send + Sync;

/// A consumer of one RabbitMQ queue whose handler runs once per message id.
///
/// The id is the message's `message_id` property unless [`key`](Self::key)
/// says otherwise; the scope is the queue's name unless [`scope`](Self::scope)
/// says otherwise, so that queues bound to one exchange (a fan-out) each run
/// every message once. The queue's name is the delivery's source.
///
/// # Examples
///
/// ```rust,no_run
/// # extern crate idem_runtime as idem_axum;
/// # #[cfg(feature = "sqlite")]
/// # async fn demo(store: idem_axum::Idempotency<sqlx::Sqlite>) -> Result<(), lapin::Error> {
/// use std::time::Duration;
/// use idem_axum::{Options, Retries, rabbitmq::Consumer};
/// use lapin::{Connection, ConnectionProperties};
///
/// let connection =
///     Connection::connect("amqp://127.0.0.1:5672/%2f", ConnectionProperties::default()).await?;
/// let channel = connection.create_channel().await?;
/// Consumer::new(store, "orders")
///     .options(Options::new().lock(Duration::from_secs(30)).ttl(Duration::from_secs(7 * 86_400)))
///     .retries(Retries::new(5))
///     .dead_letter("orders.dead")
///     .run(&channel, |message, mut tx| async move {
///         sqlx::query("INSERT INTO charges (payload) VALUES (?)")
///             .bind(message.data.clone())
///             .execute(&mut *tx)
///             .await?;
///         Ok::<_, sqlx::Error>(())
///     })
///     .await
/// # }
/// ```
pub struct Consumer<DB: Backend> {
    store: Idempotency<DB>,
    queue: String,
    options: Options,
    retries: Retries,
    dead_letter: Option<String>,
    prefetch: u16,
    key: Arc<KeyOf>,
    scope: Arc<ScopeOf>,
}

impl<DB: Backend> fmt::Debug for Consumer<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("queue", &self.queue)
            .field("options", &self.options)
            .field("retries", &self.retries)
            .field("dead_letter", &self.dead_letter)
            .field("prefetch", &self.prefetch)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> Consumer<DB> {
    /// A consumer of `queue` on `store`, with the default [`Options`] and
    /// [`Retries`], ten deliveries in hand at once, and messages refused
    /// without requeueing when they are dead-lettered (the queue's own
    /// dead-letter exchange, if it has one, takes them).
    pub fn new(store: Idempotency<DB>, queue: impl Into<String>) -> Self {
        let queue = queue.into();
        let scope = queue.clone();
        Self {
            store,
            queue,
            options: Options::new(),
            retries: Retries::default(),
            dead_letter: None,
            prefetch: 10,
            key: Arc::new(|delivery| {
                delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|id| id.as_str().to_owned())
            }),
            scope: Arc::new(move |_| scope.clone()),
        }
    }

    /// The options each message runs under: `lock` bounds the handler, `ttl`
    /// must outlast every redelivery of a message, `wait` lets a delivery
    /// wait for another that runs the same message.
    #[must_use]
    pub fn options(mut self, options: Options) -> Self {
        self.options = options;
        self
    }

    /// How often a failing message is tried, and how long apart.
    #[must_use]
    pub fn retries(mut self, retries: Retries) -> Self {
        self.retries = retries;
        self
    }

    /// Dead-letters into `queue` (declared durable), each message with its
    /// reason in [`REASON_HEADER`], instead of refusing it.
    #[must_use]
    pub fn dead_letter(mut self, queue: impl Into<String>) -> Self {
        self.dead_letter = Some(queue.into());
        self
    }

    /// How many deliveries the consumer holds and runs at once (ten by
    /// default).
    #[must_use]
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch.max(1);
        self
    }

    /// Takes a message's id from elsewhere than its `message_id`: a header, a
    /// field of the payload. `None`: the message has none, and is
    /// dead-lettered unrun.
    #[must_use]
    pub fn key(
        mut self,
        key: impl Fn(&AmqpDelivery) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.key = Arc::new(key);
        self
    }

    /// The scope a message's id is unique within (the queue's name by
    /// default). Queues that each take every message (a fan-out) need scopes
    /// of their own: one id in one scope runs once, whichever queue it
    /// arrives through.
    #[must_use]
    pub fn scope(
        mut self,
        scope: impl Fn(&AmqpDelivery) -> String + Send + Sync + 'static,
    ) -> Self {
        self.scope = Arc::new(scope);
        self
    }

    /// Consumes the queue on `channel` until the consumer is cancelled or the
    /// channel closes or fails, running `handler` once per message: with the
    /// message, and a [`Tx`] whose writes commit with the handler's recorded
    /// result. Every delivery is acknowledged once its outcome is settled:
    /// after the commit, after the copy that comes back later is confirmed,
    /// or after the dead-lettered copy is. Puts `channel` in confirm mode.
    ///
    /// When it returns, every delivery it did not acknowledge is delivered
    /// again by the broker once the channel is gone, and a run that committed
    /// is then acknowledged unrun: run it again, on a new channel if the old
    /// one closed.
    ///
    /// # Errors
    /// The channel failed.
    pub async fn run<T, E, F, Fut>(&self, channel: &Channel, handler: F) -> Result<(), lapin::Error>
    where
        T: Replayable,
        E: fmt::Display + Send + 'static,
        F: Fn(Arc<AmqpDelivery>, Tx<DB>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
    {
        self.run_until(channel, std::future::pending(), handler)
            .await
    }

    /// As [`run`](Self::run), until `stop` completes too: then it takes no
    /// more deliveries, settles and acknowledges those it is running, and
    /// returns. What it holds unstarted goes back to the queue when the
    /// channel closes.
    ///
    /// # Errors
    /// As for [`run`](Self::run).
    pub async fn run_until<T, E, F, Fut>(
        &self,
        channel: &Channel,
        stop: impl Future<Output = ()>,
        handler: F,
    ) -> Result<(), lapin::Error>
    where
        T: Replayable,
        E: fmt::Display + Send + 'static,
        F: Fn(Arc<AmqpDelivery>, Tx<DB>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
    {
        channel
            .basic_qos(self.prefetch, BasicQosOptions::default())
            .await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        if let Some(dead) = &self.dead_letter {
            channel
                .queue_declare(dead.as_str().into(), durable(), FieldTable::default())
                .await?;
        }
        let handler = Arc::new(handler);
        channel
            .basic_consume(
                self.queue.as_str().into(),
                ShortString::from(""),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?
            .take_until(stop)
            .try_for_each_concurrent(usize::from(self.prefetch), |delivery| {
                let handler = Arc::clone(&handler);
                async move { self.handle(channel, delivery, handler).await }
            })
            .await
    }

    async fn handle<T, E, F, Fut>(
        &self,
        channel: &Channel,
        delivery: AmqpDelivery,
        handler: Arc<F>,
    ) -> Result<(), lapin::Error>
    where
        T: Replayable,
        E: fmt::Display + Send + 'static,
        F: Fn(Arc<AmqpDelivery>, Tx<DB>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
    {
        let delivery = Arc::new(delivery);
        let id = (self.key)(&delivery);
        let content_type = delivery
            .properties
            .content_type()
            .as_ref()
            .map_or("", ShortString::as_str);
        let identity = Delivery::new(id.as_deref(), (self.scope)(&delivery), &*self.queue, b"")
            .with_payload(&self.options, content_type, &delivery.data);
        let message = Arc::clone(&delivery);
        let processed = self
            .store
            .process(identity, self.options, move |tx| handler(message, tx))
            .await;
        let attempt = attempts(&delivery).saturating_add(1);
        match step(&processed, attempt, &self.retries) {
            Step::Ack => {}
            Step::Later { after, failed } => {
                let spent = if failed { attempt } else { attempt - 1 };
                tracing::debug!(
                    queue = self.queue,
                    id,
                    ?after,
                    spent,
                    "delivered again later"
                );
                let queue = self.delay_queue(channel, after).await?;
                let properties = with_headers(&delivery.properties, |headers| {
                    headers.insert(ATTEMPTS_HEADER.into(), AMQPValue::LongLongInt(spent.into()));
                });
                if !self
                    .publish(channel, &queue, &delivery.data, properties)
                    .await?
                {
                    // Not taken: back to the queue after the wait, never at once.
                    tokio::time::sleep(after).await;
                    let requeue = BasicNackOptions {
                        requeue: true,
                        ..BasicNackOptions::default()
                    };
                    delivery.acker.nack(requeue).await?;
                    return Ok(());
                }
            }
            Step::DeadLetter(reason) => {
                tracing::warn!(queue = self.queue, id, reason, "dead-lettered");
                let Some(dead) = &self.dead_letter else {
                    let refuse = BasicRejectOptions { requeue: false };
                    delivery.acker.reject(refuse).await?;
                    return Ok(());
                };
                let properties = with_headers(&delivery.properties, |headers| {
                    let reason = LongString::from(reason.into_bytes());
                    headers.insert(REASON_HEADER.into(), AMQPValue::LongString(reason));
                    let queue = LongString::from(self.queue.as_bytes().to_vec());
                    headers.insert(QUEUE_HEADER.into(), AMQPValue::LongString(queue));
                });
                if !self
                    .publish(channel, dead, &delivery.data, properties)
                    .await?
                {
                    let refuse = BasicRejectOptions { requeue: false };
                    delivery.acker.reject(refuse).await?;
                    return Ok(());
                }
            }
        }
        if !delivery.acker.ack(BasicAckOptions::default()).await? {
            // The channel is gone: the broker delivers it again, found done.
            tracing::debug!(queue = self.queue, id, "not acknowledged: channel closed");
        }
        Ok(())
    }

    /// Declares the queue that holds messages for `after` (rounded up to one
    /// of [`DELAYS`]) and then dead-letters them back to this consumer's
    /// queue; it deletes itself once unused for a while.
    async fn delay_queue(
        &self,
        channel: &Channel,
        after: Duration,
    ) -> Result<String, lapin::Error> {
        let wanted = after.as_secs() + u64::from(after.subsec_nanos() > 0);
        let secs = DELAYS
            .into_iter()
            .find(|&delay| delay >= wanted)
            .unwrap_or(DELAYS[DELAYS.len() - 1]);
        let name = format!("{}.idem-delay.{secs}s", self.queue);
        let mut arguments = FieldTable::default();
        let millis = i64::try_from(secs * 1000).unwrap_or(i64::MAX);
        arguments.insert("x-message-ttl".into(), AMQPValue::LongLongInt(millis));
        arguments.insert(
            "x-expires".into(),
            AMQPValue::LongLongInt(millis * 2 + 60_000),
        );
        let back = LongString::from(self.queue.as_bytes().to_vec());
        arguments.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(LongString::from(Vec::new())),
        );
        arguments.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(back),
        );
        channel
            .queue_declare(name.as_str().into(), durable(), arguments)
            .await?;
        Ok(name)
    }

    /// Publishes a copy to `queue` through the default exchange; whether the
    /// broker confirmed it.
    async fn publish(
        &self,
        channel: &Channel,
        queue: &str,
        payload: &[u8],
        properties: BasicProperties,
    ) -> Result<bool, lapin::Error> {
        let confirmation = channel
            .basic_publish(
                ShortString::from(""),
                queue.into(),
                BasicPublishOptions::default(),
                payload,
                properties,
            )
            .await?
            .await?;
        if !confirmation.is_ack() {
            tracing::error!(queue, "the broker did not take a copy");
        }
        Ok(confirmation.is_ack())
    }
}

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    }
}

/// The failed attempts `delivery` has behind it, as its copies count them.
fn attempts(delivery: &AmqpDelivery) -> u32 {
    let value = delivery
        .properties
        .headers()
        .as_ref()
        .and_then(|headers| headers.inner().get(ATTEMPTS_HEADER));
    match value {
        Some(AMQPValue::LongLongInt(n)) => u32::try_from(*n).unwrap_or(0),
        _ => 0,
    }
}

/// `properties` with its headers changed by `change`, persistent.
fn with_headers(
    properties: &BasicProperties,
    change: impl FnOnce(&mut FieldTable),
) -> BasicProperties {
    let mut headers = properties.headers().clone().unwrap_or_default();
    change(&mut headers);
    properties
        .clone()
        .with_headers(headers)
        .with_delivery_mode(2)
}
