//! NATS JetStream consumers through async-nats (feature `async-nats`;
//! docs/contract.md, "Messages"): the loop a consumer would otherwise write, on
//! [`Idempotency::process`]. A delivery is acknowledged (and the server's
//! receipt awaited) only after its run committed; one to come back later is
//! negatively acknowledged with the wait; a long run tells the server it is in
//! progress, so that its ack wait does not hand the message to another
//! consumer meanwhile; a message that must never run is published to a
//! dead-letter subject with its reason, then terminated.

use std::fmt;
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::header::NATS_MESSAGE_ID;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::consumer::pull::MessagesErrorKind;
use async_nats::jetstream::{AckKind, Context, Message};
use futures_util::StreamExt;
use futures_util::future::{Either, select};

use crate::backend::Backend;
use crate::consumer::{Retries, Step, step};
use crate::message::{Delivery, Replayable};
use crate::options::Options;
use crate::store::Idempotency;
use crate::tx::Tx;

/// The header that says why a message was dead-lettered.
pub const REASON_HEADER: &str = "Idem-Reason";
/// The header that carries a dead-lettered message's id (its `Nats-Msg-Id`
/// is not copied: the dead-letter stream would drop it as a duplicate).
pub const ID_HEADER: &str = "Idem-Message-Id";
/// The header that names the stream sequence a dead-lettered message had.
pub const SEQUENCE_HEADER: &str = "Idem-Stream-Sequence";

type KeyOf = dyn Fn(&Message) -> Option<String> + Send + Sync;
type ScopeOf = dyn Fn(&Message) -> String + Send + Sync;

/// A consumer of one JetStream pull consumer whose handler runs once per
/// message id.
///
/// The id is the message's `Nats-Msg-Id` header unless [`key`](Self::key)
/// says otherwise; the scope is the consumer's name unless
/// [`scope`](Self::scope) says otherwise, so that consumers that each take
/// every message run it once each. The stream's and the consumer's names are
/// the delivery's source.
///
/// Every delivery of a message counts as one of its attempts (JetStream
/// counts them, deferred ones included): allow [`Retries`] more attempts than
/// failures, and a `max_deliver` on the consumer above them.
///
/// # Examples
///
/// ```rust,no_run
/// # extern crate idem_runtime as idem_axum;
/// # #[cfg(feature = "sqlite")]
/// # async fn demo(store: idem_axum::Idempotency<sqlx::Sqlite>) -> Result<(), async_nats::Error> {
/// use std::time::Duration;
/// use async_nats::jetstream::{self, consumer::pull};
/// use idem_axum::{Options, jetstream::Consumer};
///
/// let js = jetstream::new(async_nats::connect("127.0.0.1:4222").await?);
/// let stream = js.get_stream("ORDERS").await?;
/// let orders = stream
///     .get_or_create_consumer("charge", pull::Config {
///         durable_name: Some("charge".into()),
///         ack_wait: Duration::from_secs(30),
///         ..Default::default()
///     })
///     .await?;
/// Consumer::new(store)
///     .options(Options::new().lock(Duration::from_secs(30)).ttl(Duration::from_secs(7 * 86_400)))
///     .dead_letter("orders.dead")
///     .run(&js, &orders, |message, mut tx| async move {
///         sqlx::query("INSERT INTO charges (payload) VALUES (?)")
///             .bind(message.payload.to_vec())
///             .execute(&mut *tx)
///             .await?;
///         Ok::<_, sqlx::Error>(())
///     })
///     .await
/// # }
/// ```
pub struct Consumer<DB: Backend> {
    store: Idempotency<DB>,
    options: Options,
    retries: Retries,
    dead_letter: Option<String>,
    batch: usize,
    progress: Option<Option<Duration>>,
    key: Arc<KeyOf>,
    scope: Option<Arc<ScopeOf>>,
}

impl<DB: Backend> fmt::Debug for Consumer<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("options", &self.options)
            .field("retries", &self.retries)
            .field("dead_letter", &self.dead_letter)
            .field("batch", &self.batch)
            .field("progress", &self.progress)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> Consumer<DB> {
    /// A consumer on `store`, with the default [`Options`] and [`Retries`],
    /// ten messages in hand at once, progress told every third of the ack
    /// wait, and dead-lettered messages terminated.
    pub fn new(store: Idempotency<DB>) -> Self {
        Self {
            store,
            options: Options::new(),
            retries: Retries::default(),
            dead_letter: None,
            batch: 10,
            progress: None,
            key: Arc::new(|message| {
                let headers = message.headers.as_ref()?;
                Some(headers.get(NATS_MESSAGE_ID)?.as_str().to_owned())
            }),
            scope: None,
        }
    }

    /// The options each message runs under: `lock` bounds the handler, `ttl`
    /// must outlast every redelivery of a message, `wait` lets a delivery
    /// wait for another that runs the same message (telling the server it is
    /// in progress meanwhile).
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

    /// Publishes each dead-lettered message to `subject` (which a stream of
    /// yours keeps), with its reason in [`REASON_HEADER`], before
    /// terminating it.
    #[must_use]
    pub fn dead_letter(mut self, subject: impl Into<String>) -> Self {
        self.dead_letter = Some(subject.into());
        self
    }

    /// How many messages the consumer pulls and runs at once (ten by default).
    #[must_use]
    pub fn batch(mut self, batch: usize) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// How often a delivery being run tells the server it is in progress;
    /// `None`: never, and a run longer than the ack wait sees its message
    /// delivered again (to find it in flight). By default a third of the
    /// consumer's ack wait.
    #[must_use]
    pub fn progress(mut self, every: Option<Duration>) -> Self {
        self.progress = Some(every);
        self
    }

    /// Takes a message's id from elsewhere than `Nats-Msg-Id`: another
    /// header, a field of the payload. `None`: the message has none, and is
    /// dead-lettered unrun.
    #[must_use]
    pub fn key(mut self, key: impl Fn(&Message) -> Option<String> + Send + Sync + 'static) -> Self {
        self.key = Arc::new(key);
        self
    }

    /// The scope a message's id is unique within (the consumer's name by
    /// default). Consumers that each take every message need scopes of their
    /// own: one id in one scope runs once, whichever consumer it reaches.
    #[must_use]
    pub fn scope(mut self, scope: impl Fn(&Message) -> String + Send + Sync + 'static) -> Self {
        self.scope = Some(Arc::new(scope));
        self
    }

    /// Pulls from `consumer` until it is deleted or the connection closes,
    /// running `handler` once per message: with the message, and a [`Tx`]
    /// whose writes commit with the handler's recorded result. `js` publishes
    /// dead-lettered copies.
    ///
    /// # Errors
    /// The pull could not start, or the consumer is gone. A message not
    /// acknowledged is delivered again after its ack wait, and a run that
    /// committed is then acknowledged unrun.
    pub async fn run<T, E, F, Fut>(
        &self,
        js: &Context,
        consumer: &PullConsumer,
        handler: F,
    ) -> Result<(), async_nats::Error>
    where
        T: Replayable,
        E: fmt::Display + Send + 'static,
        F: Fn(Arc<Message>, Tx<DB>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
    {
        self.run_until(js, consumer, std::future::pending(), handler)
            .await
    }

    /// As [`run`](Self::run), until `stop` completes too: then it pulls no
    /// more, settles and acknowledges the messages it is running, and
    /// returns. Messages pulled but not started are delivered again after
    /// their ack wait.
    ///
    /// # Errors
    /// As for [`run`](Self::run).
    pub async fn run_until<T, E, F, Fut>(
        &self,
        js: &Context,
        consumer: &PullConsumer,
        stop: impl Future<Output = ()>,
        handler: F,
    ) -> Result<(), async_nats::Error>
    where
        T: Replayable,
        E: fmt::Display + Send + 'static,
        F: Fn(Arc<Message>, Tx<DB>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
    {
        let info = consumer.cached_info();
        let source = format!("{}/{}", info.stream_name, info.name);
        let progress = self.progress.unwrap_or_else(|| {
            let wait = info.config.ack_wait;
            (!wait.is_zero()).then(|| wait / 3)
        });
        let handler = Arc::new(handler);
        let messages = consumer
            .stream()
            .max_messages_per_batch(self.batch)
            .messages()
            .await?;
        let mut ended = None;
        messages
            .take_until(stop)
            .take_while(|item| {
                let go_on = match item {
                    Ok(_) => true,
                    Err(error) => {
                        let fatal = matches!(
                            error.kind(),
                            MessagesErrorKind::ConsumerDeleted
                                | MessagesErrorKind::PushBasedConsumer
                                | MessagesErrorKind::RequestLimitExceeded
                        );
                        if fatal {
                            ended = Some(error.to_string());
                        } else {
                            tracing::debug!(%error, "pulling");
                        }
                        !fatal
                    }
                };
                std::future::ready(go_on)
            })
            .filter_map(|item| std::future::ready(item.ok()))
            .for_each_concurrent(self.batch, |message| {
                let handler = Arc::clone(&handler);
                let source = source.as_str();
                async move { self.handle(js, source, progress, message, handler).await }
            })
            .await;
        match ended {
            Some(why) => Err(why.into()),
            None => Ok(()),
        }
    }

    async fn handle<T, E, F, Fut>(
        &self,
        js: &Context,
        source: &str,
        progress: Option<Duration>,
        message: Message,
        handler: Arc<F>,
    ) where
        T: Replayable,
        E: fmt::Display + Send + 'static,
        F: Fn(Arc<Message>, Tx<DB>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
    {
        let message = Arc::new(message);
        let (attempt, sequence) = message.info().map_or((1, 0), |info| {
            (
                u32::try_from(info.delivered).unwrap_or(u32::MAX),
                info.stream_sequence,
            )
        });
        let id = (self.key)(&message);
        let scope = self.scope.as_ref().map_or_else(
            || source.rsplit('/').next().unwrap_or(source).to_owned(),
            |scope| scope(&message),
        );
        let content_type = message
            .headers
            .as_ref()
            .and_then(|headers| headers.get("Content-Type"))
            .map_or("", |value| value.as_str());
        let identity = Delivery::new(id.as_deref(), scope, source, b"").with_payload(
            &self.options,
            content_type,
            &message.payload,
        );
        let handed = Arc::clone(&message);
        let mut processing = pin!(
            self.store
                .process(identity, self.options, move |tx| handler(handed, tx))
        );
        let processed = match progress {
            None => processing.await,
            Some(every) => loop {
                let tick = pin!(tokio::time::sleep(every));
                match select(processing.as_mut(), tick).await {
                    Either::Left((processed, _)) => break processed,
                    Either::Right(_) => {
                        if let Err(error) = message.ack_with(AckKind::Progress).await {
                            tracing::debug!(%error, "progress not told");
                        }
                    }
                }
            },
        };
        let acked = match step(&processed, attempt, &self.retries) {
            Step::Ack => message.double_ack().await,
            Step::Later { after, .. } => {
                tracing::debug!(source, id, ?after, attempt, "delivered again later");
                message.ack_with(AckKind::Nak(Some(after))).await
            }
            Step::DeadLetter(reason) => {
                tracing::warn!(source, id, reason, "dead-lettered");
                match self.publish_dead(js, &message, id, sequence, reason).await {
                    Ok(()) => message.ack_with(AckKind::Term).await,
                    Err(error) => {
                        tracing::error!(%error, "not dead-lettered; delivered again later");
                        let after = self.retries.delay(1);
                        message.ack_with(AckKind::Nak(Some(after))).await
                    }
                }
            }
        };
        if let Err(error) = acked {
            // Delivered again after the ack wait: found done, or run anew.
            tracing::debug!(source, %error, "not acknowledged");
        }
    }

    /// Publishes `message` to the dead-letter subject, if there is one, and
    /// awaits the stream's receipt.
    async fn publish_dead(
        &self,
        js: &Context,
        message: &Message,
        id: Option<String>,
        sequence: u64,
        reason: String,
    ) -> Result<(), async_nats::Error> {
        let Some(subject) = &self.dead_letter else {
            return Ok(());
        };
        let mut headers = HeaderMap::new();
        if let Some(original) = &message.headers {
            for (name, values) in original.iter() {
                if *name != NATS_MESSAGE_ID {
                    for value in values {
                        headers.append(name.clone(), value.clone());
                    }
                }
            }
        }
        headers.insert(REASON_HEADER, reason.as_str());
        headers.insert(SEQUENCE_HEADER, sequence.to_string().as_str());
        if let Some(id) = id {
            headers.insert(ID_HEADER, id.as_str());
        }
        js.publish_with_headers(subject.clone(), headers, message.payload.clone())
            .await?
            .await?;
        Ok(())
    }
}
