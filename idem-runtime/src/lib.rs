//! The runtime behind the `idem` crate: key parsing, request fingerprints, the
//! claim → execute → record engine and its SQL stores.
//!
//! Most users depend on `idem` and never name this crate; its items are re-exported
//! there.

#[cfg(feature = "axum")]
pub mod axum;
mod backend;
mod engine;
mod key;
mod options;
mod problem;
mod record;
mod store;

#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

pub use backend::Backend;
pub use engine::{HandlerFuture, Outcome, RequestIdentity, Tx, fingerprint};
pub use key::{IDEMPOTENCY_KEY, IdempotencyKey, InvalidKey, MAX_KEY_LEN};
pub use options::Options;
pub use problem::Problem;
pub use record::IDEMPOTENT_REPLAYED;
pub use store::{
    Builder, ConfigError, DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_PROBLEM_BASE, DEFAULT_TABLE,
    Idempotency,
};
