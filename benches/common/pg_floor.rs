//! PostgreSQL's hand-written floors, shared by the HTTP and CPU benches: the
//! statements around the claim, with or without the two guarantees idem gives
//! past it (docs/backends.md, PostgreSQL's section): the key's session
//! lock, which keeps duplicates out after a handler's own `COMMIT`, and the
//! session state saved in the transaction, which the record checks before it
//! writes.

#![allow(unreachable_pub)]

use std::sync::LazyLock;

/// The session state idem saves in the transaction (idem-runtime/src/postgres.rs,
/// `SAVE_SESSION`), one setting each.
const SAVED: [&str; 4] = [
    "session_authorization",
    "role",
    "search_path",
    "default_transaction_read_only",
];

/// The key's advisory lock seed, computed as idem computes its own: no request
/// text in the SQL.
pub fn seed(key: &str) -> i64 {
    let digest = <sha2::Sha256 as sha2::Digest>::digest(key.as_bytes());
    i64::from_be_bytes(digest[..8].try_into().unwrap_or_default())
}

/// The session lock's arguments: the seed's two halves.
pub fn halves(seed: i64) -> (i32, i32) {
    ((seed >> 32) as i32, seed as i32)
}

/// What the floor sends in the round trip of `BEGIN`: the transaction's
/// timeouts, the key's advisory try-lock (its outcome in `idem.locked`, which the
/// claim reads) and the handler's savepoint; `guarded`, also the session lock,
/// tried once the transaction lock is held, and the saves.
pub fn begin(seed: i64, guarded: bool) -> String {
    let mut lock = format!("pg_try_advisory_xact_lock('{seed}'::int8)");
    let mut saves = String::new();
    if guarded {
        let (high, low) = halves(seed);
        lock = format!("CASE WHEN {lock} THEN pg_try_advisory_lock({high}, {low}) ELSE false END");
        for name in SAVED {
            saves.push_str(&format!(
                ", set_config('idem.{name}', current_setting('{name}'), true)"
            ));
        }
    }
    format!(
        "BEGIN; SELECT set_config('statement_timeout', '30000', true), \
                set_config('idle_in_transaction_session_timeout', '30000', true), \
                set_config('idem.locked', ({lock})::text, true){saves}; \
         SAVEPOINT handler"
    )
}

/// The record: the key (`$1`) completed with the body `$2`. `guarded`, in the
/// same round trip, as idem's: the transaction still the claim's, the session as
/// saved (the common case; a handler that changed it would need a statement
/// more), the session lock (`$3`, `$4`: [`halves`]) let go. Built once, as a
/// hand-written statement would be.
pub fn record(guarded: bool) -> &'static str {
    static GUARDED: LazyLock<String> = LazyLock::new(|| {
        let (current, saved): (Vec<_>, Vec<_>) = SAVED
            .iter()
            .map(|name| {
                (
                    format!("current_setting('{name}')"),
                    format!("current_setting('idem.{name}', true)"),
                )
            })
            .unzip();
        format!(
            "WITH guard AS (SELECT ({}) IS NOT DISTINCT FROM ({}) AND \
                 CASE WHEN current_setting('idem.locked', true) = 'true' \
                      THEN pg_advisory_unlock($3, $4) ELSE false END AS ours) \
             {UPDATE} AND (SELECT ours FROM guard)",
            current.join(", "),
            saved.join(", ")
        )
    });
    if guarded { &GUARDED } else { UPDATE }
}

/// The plain floor's record.
const UPDATE: &str = "UPDATE idempotency_keys SET state = 'completed', status = 201, \
                      headers = '', body = $2 WHERE scope = '' AND idempotency_key = $1 \
                      AND lease = 1";
