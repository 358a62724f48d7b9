//! MySQL's hand-written floor, shared by the HTTP and CPU benches: in the round
//! trip of `BEGIN`, the session's timeouts set (their values saved), the key's
//! named try-lock (`GET_LOCK(…, 0)`), a `COMMIT` and a `SELECT`, before the
//! `BEGIN`, that fails unless the lock was taken and the key has no row; the
//! handler's write; the record inserted while the lock is held; the `COMMIT` with
//! the timeouts' restore and the lock's release.
//!
//! The guarded floor (`hand-written-guarded`) adds what idem guarantees past the
//! claim (docs/backends.md, MySQL's section): the claim's row written inside the
//! transaction before the handler runs, so that a transaction committed behind
//! the handler's back (DDL, `LOCK TABLES`, its own `COMMIT`) leaves the key
//! answered, never free; later transactions read-only, so that nothing written
//! after such a commit commits; `autocommit` off, so that what is written after a
//! deadlock's rollback waits, uncommitted; MariaDB's idle and statement timeouts
//! set to the lock, so that the server ends an executor there, not before. The
//! claim's row is the check (a duplicate key, or error 1690 when the lock is
//! busy), and the record completes it.

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

/// The read of a key found taken: whether the lock was taken, the key's state
/// and body (the key is the parameter).
pub const READ: &str = "SELECT CAST(@locked AS SIGNED), r.state, r.body FROM (SELECT 1 AS one) AS o \
     LEFT JOIN idempotency_keys AS r ON r.scope = '' AND r.idempotency_key = ?";

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

/// MariaDB's timeouts idem sets to the lock (in comments only MariaDB runs).
const MARIADB: [&str; 4] = [
    "idle_transaction_timeout",
    "idle_write_transaction_timeout",
    "idle_readonly_transaction_timeout",
    "max_statement_time",
];

/// The guarded floor's text with `BEGIN`: the saves and settings, the lock, then
/// the transaction with the claim's row in it, which fails the text (1062 or
/// 1690, [`taken_guarded`]) unless the key is new and the lock taken.
pub fn begin_guarded(key: &str) -> String {
    let hex_key = hex(key.as_bytes());
    let lock = format!("MD5(X'{hex_key}')");
    let maria: String = MARIADB
        .iter()
        .map(|name| format!(", @{name} = @@SESSION.{name}, SESSION {name} = 30"))
        .collect();
    format!(
        "SET @wait = @@SESSION.wait_timeout, @lock_wait = @@SESSION.innodb_lock_wait_timeout, \
             @autocommit = @@SESSION.autocommit, SESSION autocommit = 0, \
             SESSION wait_timeout = 30, SESSION innodb_lock_wait_timeout = 30 \
             /*M!100300 {maria} */, \
             @lock = {lock}, @locked = GET_LOCK({lock}, 0); \
         COMMIT; BEGIN; \
         INSERT INTO idempotency_keys (scope, idempotency_key, state, lease, method, path, \
             fingerprint, status, locked_until, expires_at, created_at) \
         SELECT '', X'{hex_key}', 'completed', 1, 'POST', '/payments', REPEAT(x'00', 32), 500, \
             UTC_TIMESTAMP(6) + INTERVAL 30 SECOND, UTC_TIMESTAMP(6) + INTERVAL 1 DAY, \
             UTC_TIMESTAMP(6) \
         FROM DUAL WHERE 18446744073709551615 + IF(@locked <=> 1, 0, 1) > 0; \
         SET SESSION TRANSACTION READ ONLY"
    )
}

/// Whether the guarded floor's claim was refused: a stored key (1062) or a busy
/// lock (1690).
pub fn taken_guarded(error: &sqlx::Error) -> bool {
    matches!(
        error.as_database_error().and_then(|e| e.code()).as_deref(),
        Some("23000" | TAKEN)
    )
}

/// The guarded record: the claim's row completed with the body (the first
/// parameter) for the key (the second), while the lock is held.
pub const RECORD_GUARDED: &str = "UPDATE idempotency_keys SET status = 201, headers = '', body = ? \
     WHERE scope = '' AND idempotency_key = ? AND lease = 1 \
       AND IS_USED_LOCK(@lock) = CONNECTION_ID()";

/// What ends the guarded floor's claim after its `COMMIT` or `ROLLBACK`:
/// everything back and the lock released.
pub fn restore_guarded() -> String {
    let maria: String = MARIADB
        .iter()
        .map(|name| format!(", {name} = @{name}"))
        .collect();
    format!(
        "SET SESSION TRANSACTION READ WRITE; \
         SET SESSION autocommit = @autocommit, wait_timeout = @wait, \
             innodb_lock_wait_timeout = @lock_wait /*M!100300 {maria} */, \
             @released = RELEASE_LOCK(@lock)"
    )
}

/// Lowercase hex of `bytes`, for a literal in a text query.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
