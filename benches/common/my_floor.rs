//! MySQL's hand-written floor, shared by the HTTP and CPU benches: in the round
//! trip of `BEGIN`, the session's timeouts set (their values saved), the key's
//! named try-lock (`GET_LOCK(…, 0)`), a `COMMIT` and a `SELECT`, before the
//! `BEGIN`, that fails unless the lock was taken and the key has no row; the
//! handler's write; the record inserted while the lock is held; the `COMMIT` with
//! the timeouts' restore and the lock's release.

#![allow(unreachable_pub, dead_code)]

/// The record: a completed row for the key (the first parameter), its response
/// body the second.
#[macro_export]
macro_rules! mysql_record {
    () => {
        "INSERT INTO idempotency_keys (scope, idempotency_key, state, lease, method, path, \
             fingerprint, status, headers, body, locked_until, expires_at, created_at) \
         SELECT '', ?, 'completed', 1, 'POST', '/payments', REPEAT(x'00', 32), 201, '', ?, \
             UTC_TIMESTAMP(6) + INTERVAL 30 SECOND, UTC_TIMESTAMP(6) + INTERVAL 1 DAY, \
             UTC_TIMESTAMP(6) \
         FROM DUAL"
    };
}

/// The record written only while this session holds the key's named lock.
pub const RECORD_LOCKED: &str = concat!(
    mysql_record!(),
    " WHERE IS_USED_LOCK(@lock) = CONNECTION_ID()"
);

/// What frees what `begin` took: the timeouts back, the lock released.
pub const FINISH: &str = "SET SESSION wait_timeout = @wait, innodb_lock_wait_timeout = @lock_wait, \
                          @released = RELEASE_LOCK(@lock)";

/// The check's error when the key is locked or stored: out of range (1690).
pub const TAKEN: &str = "22003";

/// What goes out with `BEGIN`; `check`, the `SELECT` that stops the text before
/// it unless the key is new (else the row is read after `BEGIN`).
pub fn begin(key: &str, check: bool) -> String {
    let key = hex(key.as_bytes());
    let lock = format!("MD5(X'{key}')");
    let check = if check {
        format!(
            "COMMIT; SELECT 18446744073709551615 + IF(@locked <=> 1, 0, 1) + EXISTS (SELECT 1 \
                 FROM idempotency_keys WHERE scope = '' AND idempotency_key = X'{key}'); "
        )
    } else {
        String::new()
    };
    format!(
        "SET @wait = @@SESSION.wait_timeout, @lock_wait = @@SESSION.innodb_lock_wait_timeout, \
             SESSION wait_timeout = 30, SESSION innodb_lock_wait_timeout = 30, \
             @lock = {lock}, @locked = GET_LOCK({lock}, 0); \
         {check}BEGIN"
    )
}

/// Lowercase hex of `bytes`, for a literal in a text query.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
