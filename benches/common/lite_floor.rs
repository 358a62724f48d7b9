//! SQLite's hand-written floor, shared by the HTTP and CPU benches: look the key
//! up; in one write transaction (`BEGIN IMMEDIATE`), claim it with an `INSERT`
//! that does nothing on conflict, the handler's write, the record.
//!
//! The guarded floor (`hand-written-guarded`) does what idem must past that
//! (docs/backends.md, SQLite's section): the claim committed on its own before the
//! handler's transaction, so that a duplicate sees it and answers 409 at once
//! instead of queueing behind the one write lock the handler holds, and a `BEGIN`
//! before the record, refused while the handler's transaction is still open
//! ([`in_transaction`]), which tells a handler that ended its own.

#![allow(unreachable_pub, dead_code)]

/// The look-up before the transaction: the key (`?1`)'s state and body.
pub const LOOKUP: &str =
    "SELECT state, body FROM idempotency_keys WHERE scope = '' AND idempotency_key = ?1";

/// The claim: the key (`?1`) as `processing` at `?2` (milliseconds since the
/// epoch); returns its lease, or nothing when the key is taken.
pub const CLAIM: &str = "INSERT INTO idempotency_keys (scope, idempotency_key, state, lease, \
         method, path, fingerprint, locked_until, expires_at, created_at) \
     VALUES ('', ?1, 'processing', 1, 'POST', '/payments', x'00', ?2 + 30000, \
         ?2 + 86400000, ?2) \
     ON CONFLICT (scope, idempotency_key) DO NOTHING RETURNING lease";

/// The record: the key (`?1`) completed with the body `?2`.
pub const RECORD: &str = "UPDATE idempotency_keys SET state = 'completed', status = 201, \
         headers = x'', body = ?2 \
     WHERE scope = '' AND idempotency_key = ?1 AND lease = 1";

/// Now, in milliseconds since the epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Whether `error` is SQLite refusing a `BEGIN` inside a transaction: the
/// guarded floor's check that the handler's transaction is still open.
pub fn in_transaction(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .is_some_and(|error| error.message().contains("within a transaction"))
}
