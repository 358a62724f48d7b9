//! Messages a broker delivers at least once, run once (docs/contract.md,
//! "Messages"): the second front door of the engine, beside HTTP. A delivery's
//! identity is its message id, the consumer it is for and its payload; the
//! handler's result is recorded with its writes and handed back to every later
//! delivery of the same message, which never runs the handler.

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;

use crate::backend::{Backend, Differs};
use crate::engine::{Failure, Outcome, Refusal, RequestIdentity, Settled, Stored, Verdict, Work};
use crate::key::{IdempotencyKey, InvalidKey};
use crate::options::Options;
use crate::store::Idempotency;
use crate::tx::Tx;

type BoxError = Box<dyn StdError + Send + Sync>;

/// The shortest wait a redelivery of a message in flight is told: never an
/// immediate redelivery, which would come back in flight again at once.
pub const MIN_RETRY_AFTER: Duration = Duration::from_secs(1);

/// One delivery of a message, as idem identifies it: the message's id (its
/// key), the scope ids are unique within, the consumer it is delivered to, and
/// its payload's fingerprint.
///
/// `source` names the consumer, and must stay the same for every delivery of a
/// message: not the queue a redelivery came through (a retry or dead-letter
/// queue), which would make the redelivery another message's.
///
/// # Examples
///
/// ```
/// # extern crate idem_runtime as idem_axum;
/// use idem_axum::{Delivery, Options};
///
/// let payload = br#"{"order":42,"amount":1000}"#;
/// let delivery = Delivery::new(Some("ord-42"), "shop-1", "orders.charge", payload);
/// assert_eq!(delivery.id().map(|id| id.as_str()), Some("ord-42"));
///
/// // A JSON payload compared by its value, not its bytes.
/// let options = Options::new().json_fingerprint(&[]);
/// let spaced = br#"{ "amount": 1000, "order": 42 }"#;
/// let a = Delivery::new(Some("ord-42"), "shop-1", "orders.charge", b"")
///     .with_payload(&options, "application/json", payload);
/// let b = Delivery::new(Some("ord-42"), "shop-1", "orders.charge", b"")
///     .with_payload(&options, "application/json", spaced);
/// assert_eq!(a.fingerprint(), b.fingerprint());
/// ```
#[derive(Debug, Clone)]
pub struct Delivery {
    identity: RequestIdentity,
    invalid: Option<InvalidKey>,
}

impl Delivery {
    /// A delivery of the message `id` (`None`: the message carries none, and
    /// is refused) to the consumer `source`, in `scope`, fingerprinted by the
    /// bytes of `payload`. The id is taken exactly as it is
    /// ([`IdempotencyKey::from_id`]).
    pub fn new(
        id: Option<&str>,
        scope: impl Into<String>,
        source: impl Into<String>,
        payload: &[u8],
    ) -> Self {
        let (key, invalid) = match id.map(IdempotencyKey::from_id) {
            Some(Ok(key)) => (Some(key), None),
            Some(Err(invalid)) => (None, Some(invalid)),
            None => (None, None),
        };
        let identity = RequestIdentity::message(key, scope.into(), source.into()).with_body(
            &Options::new(),
            "",
            payload,
        );
        Self { identity, invalid }
    }

    /// Sets the payload's content type and fingerprints it as `options` say: a
    /// JSON payload by its value under [`Options::json_fingerprint`], any other
    /// by its bytes. A payload that is not the JSON the options fingerprint is
    /// refused, never run.
    #[must_use]
    pub fn with_payload(
        mut self,
        options: &Options,
        content_type: impl Into<String>,
        payload: &[u8],
    ) -> Self {
        self.identity = self.identity.with_body(options, content_type, payload);
        self
    }

    /// The message's id as its key, bound to the scope; `None` when it has
    /// none, or none that is usable.
    pub fn id(&self) -> Option<&IdempotencyKey> {
        self.identity.key()
    }

    /// The payload's fingerprint; `None` when it could not be taken.
    pub fn fingerprint(&self) -> Option<[u8; 32]> {
        self.identity.fingerprint()
    }
}

/// What a message handler's `key = …` gives: the message's id, or `None` when
/// the message carries none (it is then refused, never run).
///
/// Implemented for strings, the integer types, and `Option` of any of these.
///
/// # Examples
///
/// ```
/// # extern crate idem_runtime as idem_axum;
/// use idem_axum::MessageId;
///
/// assert_eq!(42_u64.message_id().as_deref(), Some("42"));
/// assert_eq!("ord-42".message_id().as_deref(), Some("ord-42"));
/// assert_eq!(None::<&str>.message_id(), None);
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a message id",
    label = "`key = …` must give a message id",
    note = "give a string, an integer or an `Option` of one: `key = order.id`, \
            `key = delivery.properties.message_id().as_ref().map(|id| id.as_str())`"
)]
pub trait MessageId {
    /// The id as text, or `None` when there is none.
    fn message_id(&self) -> Option<String>;
}

impl MessageId for str {
    fn message_id(&self) -> Option<String> {
        Some(self.to_owned())
    }
}

impl MessageId for String {
    fn message_id(&self) -> Option<String> {
        Some(self.clone())
    }
}

impl<T: MessageId + ?Sized> MessageId for &T {
    fn message_id(&self) -> Option<String> {
        (**self).message_id()
    }
}

impl<T: MessageId> MessageId for Option<T> {
    fn message_id(&self) -> Option<String> {
        self.as_ref().and_then(MessageId::message_id)
    }
}

macro_rules! integer_ids {
    ($($t:ty),*) => {$(
        impl MessageId for $t {
            fn message_id(&self) -> Option<String> {
                Some(self.to_string())
            }
        }
    )*};
}
integer_ids!(u16, u32, u64, u128, usize, i16, i32, i64, i128, isize);

/// A handler's result as a delivery's record holds it, and as later
/// deliveries of the same message get it back.
///
/// Implemented for `()`, [`Bytes`], `Vec<u8>` and `String`, and, with the
/// `serde` feature, for [`JsonRecord`].
///
/// # Examples
///
/// ```
/// # extern crate idem_runtime as idem_axum;
/// use bytes::Bytes;
/// use idem_axum::Replayable;
///
/// /// A charge's id, recorded as its text.
/// struct ChargeId(u64);
///
/// impl Replayable for ChargeId {
///     const CONTENT_TYPE: &'static str = "text/plain";
///
///     fn to_record(&self) -> Result<Bytes, Box<dyn std::error::Error + Send + Sync>> {
///         Ok(Bytes::from(self.0.to_string()))
///     }
///
///     fn from_record(record: Bytes) -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
///         Ok(Self(std::str::from_utf8(&record)?.parse()?))
///     }
/// }
///
/// let record = ChargeId(42).to_record().unwrap();
/// assert_eq!(ChargeId::from_record(record).unwrap().0, 42);
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be recorded as a message's result",
    label = "not `Replayable`",
    note = "return `()`, `String`, `Vec<u8>` or `Bytes`, wrap a serde type in `JsonRecord` \
            (feature `serde`), or implement `Replayable` for `{Self}`"
)]
pub trait Replayable: Sized + Send + 'static {
    /// The content type it is recorded under (what `idem show` prints).
    const CONTENT_TYPE: &'static str;

    /// Its bytes, as recorded.
    ///
    /// # Errors
    /// It cannot be encoded: the handler's work is then rolled back.
    fn to_record(&self) -> Result<Bytes, BoxError>;

    /// It again, from what was recorded.
    ///
    /// # Errors
    /// The record does not decode (the type changed since it was recorded).
    fn from_record(record: Bytes) -> Result<Self, BoxError>;
}

impl Replayable for () {
    const CONTENT_TYPE: &'static str = "application/octet-stream";

    fn to_record(&self) -> Result<Bytes, BoxError> {
        Ok(Bytes::new())
    }

    fn from_record(_: Bytes) -> Result<Self, BoxError> {
        Ok(())
    }
}

impl Replayable for Bytes {
    const CONTENT_TYPE: &'static str = "application/octet-stream";

    fn to_record(&self) -> Result<Bytes, BoxError> {
        Ok(self.clone())
    }

    fn from_record(record: Bytes) -> Result<Self, BoxError> {
        Ok(record)
    }
}

impl Replayable for Vec<u8> {
    const CONTENT_TYPE: &'static str = "application/octet-stream";

    fn to_record(&self) -> Result<Bytes, BoxError> {
        Ok(Bytes::copy_from_slice(self))
    }

    fn from_record(record: Bytes) -> Result<Self, BoxError> {
        Ok(record.to_vec())
    }
}

impl Replayable for String {
    const CONTENT_TYPE: &'static str = "text/plain; charset=utf-8";

    fn to_record(&self) -> Result<Bytes, BoxError> {
        Ok(Bytes::copy_from_slice(self.as_bytes()))
    }

    fn from_record(record: Bytes) -> Result<Self, BoxError> {
        Ok(String::from_utf8(record.to_vec())?)
    }
}

/// A result recorded as JSON (feature `serde`).
///
/// ```
/// # extern crate idem_runtime as idem_axum;
/// use idem_axum::{JsonRecord, Replayable};
///
/// let charge = JsonRecord(serde_json::json!({ "charge": "ch_1", "amount": 1000 }));
/// let record = charge.to_record().unwrap();
/// let again = <JsonRecord<serde_json::Value>>::from_record(record).unwrap();
/// assert_eq!(again.0["charge"], "ch_1");
/// ```
#[cfg(feature = "serde")]
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonRecord<T>(pub T);

#[cfg(feature = "serde")]
impl<T> Replayable for JsonRecord<T>
where
    T: serde::Serialize + serde::de::DeserializeOwned + Send + 'static,
{
    const CONTENT_TYPE: &'static str = "application/json";

    fn to_record(&self) -> Result<Bytes, BoxError> {
        Ok(Bytes::from(serde_json::to_vec(&self.0)?))
    }

    fn from_record(record: Bytes) -> Result<Self, BoxError> {
        Ok(Self(serde_json::from_slice(&record)?))
    }
}

/// What one delivery came to, and so what the consumer does with the message
/// ([`action`](Self::action)).
///
/// # Examples
///
/// ```
/// # extern crate idem_runtime as idem_axum;
/// use std::time::Duration;
/// use idem_axum::{Action, Processed};
///
/// let done: Processed<String, ()> = Processed::Done("ch_42".to_owned());
/// assert_eq!(done.action(), Action::Ack);
/// let busy: Processed<String, ()> = Processed::InFlight { retry_after: Duration::from_secs(3) };
/// assert_eq!(busy.action(), Action::Retry(Some(Duration::from_secs(3))));
/// let declined: Processed<String, &str> = Processed::Failed("card declined");
/// assert_eq!(declined.action(), Action::Retry(None));
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum Processed<T, E> {
    /// The handler ran, and its result committed with its writes: acknowledge.
    Ran(T),
    /// An earlier delivery ran it: its recorded result, the handler not run.
    /// Acknowledge.
    Done(T),
    /// Another delivery is running it now (another consumer, or an earlier
    /// delivery whose acknowledgement the broker stopped waiting for):
    /// deliver it again after `retry_after`, what is left of that run's lock
    /// ([`MIN_RETRY_AFTER`] at least), never at once. With
    /// [`Options::wait`] the delivery first waits for that run up to its bound.
    InFlight {
        /// When the run holding it has completed or been given up.
        retry_after: Duration,
    },
    /// The id was first used with another payload (or another content type,
    /// or by another consumer): nothing ran, and it never will under this id.
    /// Dead-letter it, with `part` as the reason.
    Mismatch {
        /// What differs: `payload`, `content-type`, `source`, or `kind` (the id
        /// was first an HTTP request's key).
        part: &'static str,
    },
    /// The handler returned an error: its writes were rolled back and the
    /// message is free to run again. Deliver it again with a backoff, and
    /// dead-letter it after as many attempts as the consumer allows.
    Failed(E),
    /// The handler panicked, ran past its lock, was cancelled by a shutdown, or
    /// its result could not be recorded: rolled back, the message free to run
    /// again. Deliver it again with a backoff, as for [`Failed`](Self::Failed).
    Aborted(Aborted),
    /// The database failed, or the store is shutting down: either nothing was
    /// claimed, or what ran is settled by the next delivery (a commit whose
    /// answer was lost is found done). Deliver it again later.
    Unavailable,
    /// Never run: the message has no usable id, its payload is not the JSON
    /// the options fingerprint, or the options contradict one another.
    /// Dead-letter it.
    Refused(Refused),
    /// Its record cannot be given back: nothing runs, now or later. Dead-letter
    /// it and alert an operator (`idem show`).
    Stuck(Stuck),
}

/// Why a run was rolled back without an error of the handler's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Aborted {
    /// The handler panicked.
    Panicked,
    /// It ran past its lock, and was cancelled: another delivery may take it
    /// over.
    TimedOut,
    /// The store's shutdown cancelled it.
    Cancelled,
    /// Its `Tx` outlived it (moved into a task of its own).
    Escaped,
    /// Its result is larger than the store records.
    TooLarge,
    /// Its result could not be encoded ([`Replayable::to_record`]).
    Unencodable,
}

/// Why a delivery was never run.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refused {
    /// The message carries no id.
    NoId,
    /// Its id is not usable as a key ([`IdempotencyKey::from_id`]).
    InvalidId(InvalidKey),
    /// Its payload is not the JSON the options fingerprint.
    InvalidPayload(String),
    /// The options contradict one another.
    InvalidOptions(String),
}

/// Why a delivery's record cannot be given back.
#[derive(Debug)]
#[non_exhaustive]
pub enum Stuck {
    /// The database committed the handler's writes without its record (the
    /// handler ended its transaction itself): it never runs again under this
    /// id, and what it wrote needs reconciling.
    Ended,
    /// The record is sealed under a key the store's ring does not hold, or was
    /// changed (`docs/deployment.md`, "Sealing recorded responses").
    Unreadable,
    /// The record does not decode as the handler's result type.
    Undecodable(BoxError),
}

/// What a consumer does with a delivered message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Acknowledge it: it is done.
    Ack,
    /// Deliver it again: after this long where it is known, else after a
    /// backoff of the consumer's own, and dead-letter it once the consumer's
    /// attempts are spent.
    Retry(Option<Duration>),
    /// Dead-letter it: no delivery of it will ever run.
    DeadLetter,
}

impl<T, E> Processed<T, E> {
    /// What the consumer does with the message.
    pub fn action(&self) -> Action {
        match self {
            Self::Ran(_) | Self::Done(_) => Action::Ack,
            Self::InFlight { retry_after } => Action::Retry(Some(*retry_after)),
            Self::Failed(_) | Self::Aborted(_) | Self::Unavailable => Action::Retry(None),
            Self::Mismatch { .. } | Self::Refused(_) | Self::Stuck(_) => Action::DeadLetter,
        }
    }
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoId => f.write_str("the message carries no id"),
            Self::InvalidId(invalid) => write!(f, "the message's id is not usable: {invalid}"),
            Self::InvalidPayload(why) => write!(f, "the payload is not JSON: {why}"),
            Self::InvalidOptions(why) => write!(f, "the consumer's options: {why}"),
        }
    }
}

/// A message handler as the engine's [`Work`]: its result recorded when it
/// is `Ok`, the transaction rolled back and the key released when it is not.
struct MessageWork<F> {
    handler: F,
}

impl<DB, F, Fut, T, E> Work<DB> for MessageWork<F>
where
    DB: Backend,
    F: FnOnce(Tx<DB>) -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, E>> + Send + 'static,
    T: Replayable,
    E: Send + 'static,
{
    type Answer = Result<T, E>;

    async fn run(self, tx: Tx<DB>, limit: Option<usize>) -> Verdict<Result<T, E>> {
        let value = match (self.handler)(tx).await {
            Ok(value) => value,
            Err(error) => return Verdict::Release(Err(error)),
        };
        let body = match value.to_record() {
            Ok(body) => body,
            Err(error) => {
                tracing::error!(%error, "the message's result does not encode; rolled back");
                return Verdict::Unrecordable(Failure::AnswerFailed);
            }
        };
        if let Some(limit) = limit
            && body.len() > limit
        {
            return Verdict::Unrecordable(Failure::TooLarge { limit });
        }
        let stored = Stored {
            status: 200,
            headers: format!("content-type: {}", T::CONTENT_TYPE).into_bytes(),
            body,
        };
        Verdict::Record {
            stored,
            answer: Ok(value),
        }
    }
}

impl<DB: Backend> Idempotency<DB> {
    /// Runs `handler` for one delivery of a message, at most once per message
    /// id: the handler gets a [`Tx`] to write through, and its `Ok` result is
    /// recorded in the same transaction as its writes. Every later delivery of
    /// the message gets that result back without running the handler; one
    /// that arrives while another runs it is told when to come back. The
    /// returned [`Processed`] says which, and [`Processed::action`] what to do
    /// with the message: acknowledge it only once this has returned.
    ///
    /// `options` apply as on an endpoint: `lock` bounds the handler, `ttl` how
    /// long a message's record is kept (longer than the broker may deliver it
    /// again), `wait` how long a delivery waits for another that runs it.
    ///
    /// # Examples
    ///
    /// ```rust,no_run
    /// # extern crate idem_runtime as idem_axum;
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo(store: idem_axum::Idempotency<sqlx::Sqlite>, id: &str, payload: &[u8]) {
    /// use std::time::Duration;
    /// use idem_axum::{Action, Delivery, Options, Processed};
    ///
    /// let delivery = Delivery::new(Some(id), "shop-1", "orders.charge", payload);
    /// let options = Options::new().ttl(Duration::from_secs(7 * 86_400));
    /// let processed: Processed<String, sqlx::Error> = store
    ///     .process(delivery, options, |mut tx| async move {
    ///         sqlx::query("INSERT INTO charges (order_id) VALUES (42)")
    ///             .execute(&mut *tx)
    ///             .await?;
    ///         Ok("ch_42".to_owned())
    ///     })
    ///     .await;
    /// match processed.action() {
    ///     Action::Ack => { /* ack */ }
    ///     Action::Retry(after) => { /* requeue, after `after` or a backoff */ }
    ///     Action::DeadLetter => { /* dead-letter, with `processed` as the reason */ }
    /// }
    /// # }
    /// ```
    pub async fn process<T, E, F, Fut>(
        &self,
        delivery: Delivery,
        options: Options,
        handler: F,
    ) -> Processed<T, E>
    where
        T: Replayable,
        E: Send + 'static,
        F: FnOnce(Tx<DB>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
    {
        let Delivery {
            mut identity,
            invalid,
        } = delivery;
        let label = identity.take_endpoint();
        if invalid.is_some() || identity.key().is_none() {
            // Counted as the engine counts the requests it refuses.
            crate::metrics::request(Outcome::Refused.as_str(), label);
            return Processed::Refused(invalid.map_or(Refused::NoId, Refused::InvalidId));
        }
        if let Some(kept) = self.kept_settled(&identity, options) {
            crate::metrics::request(kept.outcome().as_str(), label);
            return processed(kept);
        }
        let span = tracing::debug_span!(
            "idem",
            method = "@message",
            path = identity.path(),
            key = identity.key().map(IdempotencyKey::as_str),
            outcome = tracing::field::Empty,
        );
        let answer = |_: &Self, settled: Settled<Result<T, E>>, label: String| {
            let outcome = settled.outcome();
            tracing::Span::current().record("outcome", outcome.as_str());
            crate::metrics::request(outcome.as_str(), label);
            processed(settled)
        };
        match self
            .settle(
                identity,
                options,
                MessageWork { handler },
                span,
                label,
                answer,
            )
            .await
        {
            Some(Ok(processed)) => processed,
            Some(Err(())) | None => Processed::Unavailable,
        }
    }
}

/// A settlement as a consumer acts on it.
fn processed<T: Replayable, E>(settled: Settled<Result<T, E>>) -> Processed<T, E> {
    match settled {
        Settled::Ran {
            answer: Ok(value), ..
        }
        | Settled::Unkeyed(Ok(Ok(value))) => Processed::Ran(value),
        Settled::Ran {
            answer: Err(error), ..
        }
        | Settled::Unkeyed(Ok(Err(error))) => Processed::Failed(error),
        Settled::Replayed { body, .. } => match T::from_record(body) {
            Ok(value) => Processed::Done(value),
            Err(error) => Processed::Stuck(Stuck::Undecodable(error)),
        },
        Settled::Ended { .. } => Processed::Stuck(Stuck::Ended),
        Settled::Unreadable => Processed::Stuck(Stuck::Unreadable),
        Settled::InFlight { lock_left } => Processed::InFlight {
            retry_after: lock_left.unwrap_or(MIN_RETRY_AFTER).max(MIN_RETRY_AFTER),
        },
        Settled::Mismatch(differs) => Processed::Mismatch {
            part: match differs {
                Differs::Method => "kind",
                Differs::Path | Differs::Query => "source",
                Differs::ContentType => "content-type",
                Differs::Body => "payload",
            },
        },
        Settled::Released(failure) | Settled::Unkeyed(Err(failure)) => match failure {
            Failure::Answer(Err(error)) => Processed::Failed(error),
            // Not recorded although `Ok`: only where its `Tx` escaped.
            Failure::Answer(Ok(_)) | Failure::Escaped => Processed::Aborted(Aborted::Escaped),
            Failure::TooLarge { .. } => Processed::Aborted(Aborted::TooLarge),
            Failure::AnswerFailed => Processed::Aborted(Aborted::Unencodable),
            Failure::Panicked => Processed::Aborted(Aborted::Panicked),
            Failure::TimedOut | Failure::LeaseExpired => Processed::Aborted(Aborted::TimedOut),
            Failure::Cancelled => Processed::Aborted(Aborted::Cancelled),
        },
        Settled::Refused(refusal) => Processed::Refused(match refusal {
            Refusal::InvalidOptions(why) => Refused::InvalidOptions(why),
            Refusal::MissingKey => Refused::NoId,
            Refusal::InvalidJson(why) | Refusal::InvalidMultipart(why) => {
                Refused::InvalidPayload(why)
            }
        }),
        Settled::StoreFailed { .. } | Settled::ShuttingDown => Processed::Unavailable,
    }
}
