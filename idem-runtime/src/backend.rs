//! What the engine needs from a database; one implementation per backend module.
//!
//! Items here are `pub` only so the sealed trait may name them; none is re-exported.
//!
//! # Adding a backend
//!
//! A fourth database joins by keeping the contract (`docs/contract.md`) the way the
//! three do; this list is what that took for them.
//!
//! 1. A module `<name>.rs` behind a cargo feature `<name>` (in `idem-runtime`, in
//!    `idem-macros`, whose `DATABASES` lists the sqlx type, and in the `idem-axum`
//!    facade), implementing [`enabled::Driver`]. All of its SQL lives in that
//!    module, built once per store in `IdemSql`.
//! 2. `migrations/<name>/0001_*.sql`, and `idem_migrations` naming how `migrate()`
//!    tells each file is in place ([`Applied`]); an upgrade is a new file, never an
//!    edit of a shipped one.
//! 3. A claim of which exactly one of many concurrent requests wins, with the
//!    others told at once (a try-lock, never a wait on the winner's row); a record
//!    conditional on the claim still being held, by the database's clock; a claim
//!    freed when its transaction or session ends, or once `lock` has passed. A
//!    database without a lock every writer sees (no advisory locks, or locks that
//!    stay on one node of a cluster) takes the committed claim with a lease of
//!    `lease.rs`, as SQLite and MySQL's cluster mode do: it writes its claim and
//!    spells a `lease::Dialect`.
//! 4. Correct under every isolation level the database lets a user choose as a
//!    default, or a refusal to start that names the setting; through the poolers
//!    its deployments use.
//! 5. A harness in `tests/conformance/harness.rs`, added to the `conformance!`
//!    macro, and the fault suite (`tests/faults`) run against it; `.ci/run` starts
//!    its server and builds the feature alone.
//! 6. A section in `docs/backends.md` (design and measured costs), a column in
//!    `docs/guarantees.md`, and what it needs in `docs/deployment.md`.
#![allow(unreachable_pub)]

use std::fmt;
use std::future::Future;

use sqlx::{Database, Transaction};

use crate::seal::{KeyId, KeyRing, Unreadable};
use crate::tx::Adopted;

/// A database idem can keep its keys in: [`sqlx::Postgres`] (feature `postgres`),
/// [`sqlx::MySql`] (feature `mysql`, for MySQL and MariaDB) or [`sqlx::Sqlite`]
/// (feature `sqlite`).
///
/// Each keeps the same contract (`docs/contract.md` in the repository), each in its
/// own way: where a claim lives, how a duplicate is told at once, what ends a stuck
/// executor. The [`idem-axum`](https://docs.rs/idem-axum) crate's documentation compares them
/// guarantee by guarantee (`docs/guarantees.md` in the repository); the designs, and
/// what they cost measured on this project's machines, are in `docs/backends.md`,
/// and what each needs from its configuration in `docs/deployment.md`.
///
/// The trait is sealed; its methods are the engine's and not part of the API. A
/// database it is not implemented for is reported with the feature to enable.
// Every public bound is on this trait, so its message is the one rustc shows
// (tests/renamed/ui/fail/database_not_enabled.stderr).
#[diagnostic::on_unimplemented(
    message = "idem-axum was built without `{Self}`: enable its feature",
    label = "a database idem-axum was not built for",
    note = "in Cargo.toml: `idem-axum = {{ version = \"0.1\", features = [\"postgres\"] }}` \
            (or \"mysql\", \"sqlite\"); no database is enabled by default, as in sqlx. \
            idem-axum 0.1 is built on sqlx 0.9 and axum 0.8: a `{Self}` of another sqlx \
            version is another type (`cargo tree -d` lists duplicates)"
)]
pub trait Backend: Database + enabled::Driver {}

impl<DB: Database + enabled::Driver> Backend for DB {}

/// The request identity the engine hands to a backend.
#[derive(Debug)]
pub struct Identity<'a> {
    pub scope: &'a str,
    pub key: &'a str,
    pub method: &'a str,
    pub path: &'a str,
    /// The request body's `Content-Type`, empty when it had none.
    pub content_type: &'a str,
    /// The endpoint fingerprints the body's JSON value: its `Content-Type`'s
    /// `charset` is not compared either (see `crate::media`).
    pub json_body: bool,
    /// The fingerprint a claim stores: the body's digest, keyed when the store
    /// seals (`crate::seal`).
    pub fingerprint: [u8; 32],
    /// The body's digest, unkeyed: what a stored fingerprint is compared with,
    /// never stored where the store seals.
    pub body_digest: &'a [u8; 32],
    /// A multipart body's SHA-256 of its bytes, the fingerprint earlier releases
    /// recorded for it: a row of theirs matches by it.
    pub bytes_fingerprint: Option<&'a [u8; 32]>,
    /// SHA-256 of (table, scope, key), computed once: the seed of the backends'
    /// locks and of `wait`'s signal.
    pub digest: [u8; 32],
}

/// What a lookup found under (scope, key).
#[derive(Debug, Clone)]
pub struct Found {
    pub completed: bool,
    /// `locked_until` is still ahead, by the database clock.
    pub live: bool,
    /// Milliseconds until `expires_at`, by the database clock, rounded up.
    pub ttl_left_ms: i64,
    pub method: String,
    pub path: String,
    /// `None` in rows recorded before content types were stored: matches any.
    pub content_type: Option<String>,
    pub fingerprint: Vec<u8>,
    pub status: Option<i32>,
    pub headers: Option<bytes::Bytes>,
    pub body: Option<bytes::Bytes>,
    /// Why the stored response is not replayed, if it is not: set when the row is
    /// read (`Idempotency::readable`, engine.rs), never by a backend.
    pub(crate) unreadable: Option<Unreadable>,
}

impl Found {
    /// Decodes a lookup row. Every backend's lookup selects the same shape: `state`,
    /// `method`, `path`, `content_type` (nullable) as text; `fingerprint`,
    /// `headers`, `body` as bytes; `status`, `live`, `ttl_left_ms` as 64-bit integers.
    #[cfg(any(feature = "mysql", feature = "postgres", feature = "sqlite"))]
    pub(crate) fn decode<R>(row: &R) -> Result<Self, sqlx::Error>
    where
        R: sqlx::Row,
        for<'a> &'a str: sqlx::ColumnIndex<R>,
        for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        for<'r> Option<i64>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        for<'r> Option<Vec<u8>>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    {
        let ttl_left_ms: i64 = row.try_get("ttl_left_ms")?;
        Ok(Self {
            completed: row.try_get::<String, _>("state")? == "completed",
            live: row.try_get::<i64, _>("live")? != 0,
            ttl_left_ms,
            method: row.try_get("method")?,
            path: row.try_get("path")?,
            content_type: row.try_get("content_type")?,
            fingerprint: row.try_get("fingerprint")?,
            status: row
                .try_get::<Option<i64>, _>("status")?
                .and_then(|s| i32::try_from(s).ok()),
            headers: row
                .try_get::<Option<Vec<u8>>, _>("headers")?
                .map(bytes::Bytes::from),
            body: row
                .try_get::<Option<Vec<u8>>, _>("body")?
                .map(bytes::Bytes::from),
            unreadable: None,
        })
    }

    /// Runs a backend's lookup statement (parameters: scope, key) and decodes the
    /// row it finds; the SQL is each backend's, the binding and decoding are not.
    /// `prepared`: whether the statement is kept prepared on the connection.
    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    pub(crate) async fn load<DB>(
        conn: &mut DB::Connection,
        sql: &std::sync::Arc<str>,
        id: &Identity<'_>,
        prepared: bool,
    ) -> Result<Option<Self>, sqlx::Error>
    where
        DB: Database + sqlx::database::HasStatementCache,
        for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
        for<'a> DB::Arguments: sqlx::IntoArguments<DB>,
        for<'e> &'e str: sqlx::Encode<'e, DB> + sqlx::Type<DB>,
        for<'a> &'a str: sqlx::ColumnIndex<DB::Row>,
        for<'r> String: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
        for<'r> Option<String>: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
        for<'r> i64: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
        for<'r> Option<i64>: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
        for<'r> Vec<u8>: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
        for<'r> Option<Vec<u8>>: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    {
        let row = sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
            .persistent(prepared)
            .bind(id.scope)
            .bind(id.key)
            .fetch_optional(conn)
            .await?;
        row.as_ref().map(Self::decode).transpose()
    }

    /// A claim's row that the database committed with the handler's transaction
    /// before idem recorded its answer (see [`Written::Ended`]): completed, with no
    /// body stored. Every recorded response has one, empty or not.
    pub(crate) fn ended(&self) -> bool {
        self.completed && self.body.is_none()
    }

    /// `expires_at` is still ahead, by the database clock.
    pub(crate) fn fresh(&self) -> bool {
        self.ttl_left_ms > 0
    }

    /// The row holds its key no more: it expired, or it is a claim nobody
    /// completed whose lock has passed. A claim may replace it.
    pub(crate) fn replaceable(&self) -> bool {
        !self.fresh() || (!self.completed && !self.live)
    }

    /// The record of an answer (`status`, `headers` as stored, `body`), which this
    /// process has just committed for `id` with a ttl of `ttl_ms`, as a lookup
    /// right after its claim would find it.
    pub(crate) fn recorded(
        id: &Identity<'_>,
        status: u16,
        headers: Vec<u8>,
        body: bytes::Bytes,
        ttl_ms: i64,
    ) -> Self {
        Self {
            completed: true,
            live: false,
            ttl_left_ms: ttl_ms,
            method: id.method.to_owned(),
            path: id.path.to_owned(),
            content_type: Some(id.content_type.to_owned()),
            fingerprint: id.fingerprint.to_vec(),
            status: Some(i32::from(status)),
            headers: Some(bytes::Bytes::from(headers)),
            body: Some(body),
            unreadable: None,
        }
    }

    /// Whether the stored response is sealed (`crate::seal`): its status is 0,
    /// which no response has, and its body the sealed record.
    pub(crate) fn sealed(&self) -> bool {
        self.completed && self.status == Some(0) && self.body.is_some()
    }

    /// The first part of the request that differs from the one recorded, if any;
    /// `ring` opens keyed fingerprints.
    pub(crate) fn differs(&self, id: &Identity<'_>, ring: Option<&KeyRing>) -> Option<Differs> {
        let (path, query) = split_query(&self.path);
        let (id_path, id_query) = split_query(id.path);
        if self.method != id.method {
            Some(Differs::Method)
        } else if path != id_path {
            Some(Differs::Path)
        } else if query != id_query {
            Some(Differs::Query)
        } else if !self.same_content_type(id) {
            Some(Differs::ContentType)
        } else if !self.same_body(id, ring) {
            Some(Differs::Body)
        } else {
            None
        }
    }

    /// Whether the stored fingerprint is the request's body: keyed under a key
    /// of `ring`, or unkeyed (rows written without sealing, which a store turning
    /// sealing on or off still reads; a record in plain text is refused where
    /// sealing is on, whatever its fingerprint).
    pub(crate) fn same_body(&self, id: &Identity<'_>, ring: Option<&KeyRing>) -> bool {
        let stored = self.fingerprint.as_slice();
        let owner = crate::seal::Owner {
            scope: id.scope,
            key: id.key,
        };
        let is = |digest: &[u8; 32]| match ring.and_then(|ring| ring.matches(stored, owner, digest))
        {
            Some(matches) => matches,
            None => stored == digest.as_slice(),
        };
        is(id.body_digest) || id.bytes_fingerprint.is_some_and(is)
    }

    /// Whether the stored `Content-Type` is the request's as a media type; a row
    /// recorded before content types were stored has none and matches any.
    pub(crate) fn same_content_type(&self, id: &Identity<'_>) -> bool {
        self.content_type.as_deref().is_none_or(|stored| {
            stored == id.content_type
                || crate::media::canonical(stored, id.json_body)
                    == crate::media::canonical(id.content_type, id.json_body)
        })
    }
}

/// The path, and the query with its `?` (`None`: no `?` at all).
fn split_query(path: &str) -> (&str, Option<&str>) {
    match path.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (path, None),
    }
}

/// The part of a request in which a key's later use differs from its first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Differs {
    Method,
    Path,
    Query,
    ContentType,
    Body,
}

impl Differs {
    /// Its name in a problem's `mismatch` member, and in prose.
    pub(crate) fn names(self) -> (&'static str, &'static str) {
        match self {
            Self::Method => ("method", "method"),
            Self::Path => ("path", "path"),
            Self::Query => ("query", "query string"),
            Self::ContentType => ("content-type", "Content-Type"),
            Self::Body => ("body", "request body"),
        }
    }
}

/// One claim attempt.
#[derive(Debug, Clone, Copy)]
pub struct Claim {
    /// The new executor's fencing token.
    pub lease: i64,
    pub lock_ms: i64,
    pub ttl_ms: i64,
    /// The lookup found a row (expired, or a claim past its lock) to take over.
    pub replace: bool,
}

impl Claim {
    /// Binds `$1`..`$9`, the parameters PostgreSQL's and SQLite's claims start with:
    /// scope, key, lease, method, path, fingerprint, lock (ms), ttl (ms), content type.
    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    pub(crate) fn bind<'q, DB>(
        &self,
        id: &Identity<'_>,
        query: sqlx::query::Query<'q, DB, DB::Arguments>,
    ) -> sqlx::query::Query<'q, DB, DB::Arguments>
    where
        DB: Database,
        for<'e> &'e str: sqlx::Encode<'e, DB> + sqlx::Type<DB>,
        for<'e> &'e [u8]: sqlx::Encode<'e, DB> + sqlx::Type<DB>,
        for<'e> i64: sqlx::Encode<'e, DB> + sqlx::Type<DB>,
    {
        query
            .bind(id.scope)
            .bind(id.key)
            .bind(self.lease)
            .bind(id.method)
            .bind(id.path)
            .bind(&id.fingerprint[..])
            .bind(self.lock_ms)
            .bind(self.ttl_ms)
            .bind(id.content_type)
    }
}

/// What the first look at (scope, key) came to.
pub enum Opened<'c, DB: Database> {
    /// The key was free and is claimed: the transaction the handler runs in.
    Claimed(Transaction<'c, DB>),
    /// Claimed, by a driver that let go of the transaction's guard so that it could
    /// use the connection again when the claim failed (MySQL's `idem_open`).
    Adopted(Adopted),
    /// A row is stored under the key; no transaction is left open.
    Found(Found),
    /// The key looked free, but another executor holds it or completed it meanwhile.
    Lost,
}

impl<DB: Database> Opened<'_, DB> {
    /// What was found stored. A claim's transaction is dropped (rolled back); an
    /// adopted one is not, so the engine matches claims before it calls this.
    pub(crate) fn found(self) -> Option<Found> {
        match self {
            Self::Found(found) => Some(found),
            Self::Claimed(_) | Self::Adopted(_) | Self::Lost => None,
        }
    }
}

/// Reads (scope, key) outside any transaction, and claims it only if absent: one
/// round trip for a key that is stored, an extra one for a new key.
pub(crate) async fn look_then_claim<'c, DB: enabled::Driver>(
    conn: &'c mut DB::Connection,
    sql: &'c DB::IdemSql,
    id: &'c Identity<'c>,
    claim: Claim,
) -> Result<Opened<'c, DB>, sqlx::Error> {
    if let Some(found) = DB::idem_lookup(&mut *conn, sql, id).await? {
        return Ok(Opened::Found(found));
    }
    Ok(match DB::idem_claim(conn, sql, id, claim).await? {
        Some(adopted) => Opened::Adopted(adopted),
        None => Opened::Lost,
    })
}

/// Store settings that change the SQL a backend sends.
#[derive(Debug, Clone, Copy, Default)]
pub struct Layout {
    /// PostgreSQL: the layout partitioned by day of expiry.
    pub partitioned: bool,
    /// PostgreSQL: connections go through a pooler in transaction mode: statements
    /// are sent unprepared, and only inside transactions.
    pub transaction_pooled: bool,
    /// SQLite: the handler's transaction takes the write lock at its first write,
    /// not at `BEGIN`.
    pub deferred: bool,
    /// MySQL: claims committed before the handler runs, as a multi-primary
    /// (Galera) cluster needs (`Some(true)`), or never (`Some(false)`); `None`:
    /// as the server says (`@@wsrep_on`).
    pub galera: Option<bool>,
}

/// One file of `migrations/<backend>/`.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// The number of its file, as upgrades are numbered across a backend's
    /// layouts: a layout may skip one that is not for it.
    pub version: u32,
    /// The script, for the default table name.
    pub sql: &'static str,
    /// How `migrate()` tells that the table already has it.
    pub applied: Applied,
}

/// When a migration is already in place, so that `migrate()` skips it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Never: the script is safe to run again.
    Rerun,
    /// It creates the table: in place once the table exists.
    TableExists,
    /// It adds this column last: in place once the table has it.
    HasColumn(&'static str),
    /// PostgreSQL: it creates the table's functions (`<table>_open`,
    /// `<table>_record`): in place once both exist.
    HasFunctions,
}

/// Whether a claim's finish that failed is tried again (see `Driver::idem_finish_again`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Again {
    /// The failure is final: the claim stays until its lock passes.
    Never,
    /// The database was only busy: again in the background, on another
    /// connection, until the claim's lock passes.
    Later,
    /// The claim is a row any session may release by its lease: at once on
    /// another connection, before the answer (a retry sent on it then finds the
    /// key free), then as `Later`.
    Now,
}

/// What a record attempt came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// The response is written into the handler's transaction: commit it.
    Recorded,
    /// The claim's lease or lock was lost: roll back.
    LeaseLost,
    /// The database had already ended the handler's transaction and committed
    /// what it held, the claim's row included (a statement that commits
    /// implicitly, or a `COMMIT` the handler sent). Some of the handler's writes
    /// may be committed: the key keeps its `transaction-ended` answer and is never
    /// run again. Nothing is left to roll back.
    Ended,
}

impl Written {
    /// `Recorded` if the claim still `held` the key when written, else `LeaseLost`.
    #[cfg(any(feature = "mysql", feature = "postgres", feature = "sqlite"))]
    pub(crate) fn held(held: bool) -> Self {
        if held {
            Self::Recorded
        } else {
            Self::LeaseLost
        }
    }
}

/// A response ready to be recorded.
pub struct Recorded<'a> {
    pub status: i32,
    pub headers: &'a [u8],
    pub body: &'a [u8],
    /// The endpoint's ttl, for a backend that must write the record anew.
    pub ttl_ms: i64,
}

/// Sealed (nothing outside this crate can name it), and named for what an error
/// about it means: the drivers this build of idem-axum has enabled.
pub mod enabled {
    use super::*;

    /// What the engine needs of one database: its SQL for a table (built once per
    /// store) and the statements it runs. Every backend's choices live in its own
    /// module; the engine sees only these.
    pub trait Driver: Database {
        /// Prepared statement texts for `table`.
        #[doc(hidden)]
        type IdemSql: Send + Sync + 'static;

        /// The statements for `table` in the store's `layout`, on `pool`.
        #[doc(hidden)]
        fn idem_sql(table: &str, layout: Layout, pool: &sqlx::Pool<Self>) -> Self::IdemSql;

        /// The backend's migrations in order, for the default table name, in
        /// `layout`.
        #[doc(hidden)]
        fn idem_migrations(layout: Layout) -> &'static [Migration];

        /// Applies the migrations `table` lacks under a lock, so instances starting
        /// together agree; `scripts` are [`Migration::sql`] for this table.
        #[doc(hidden)]
        fn idem_migrate<'c>(
            conn: &'c mut Self::Connection,
            sql: &'c Self::IdemSql,
            table: &'c str,
            scripts: &'c [(String, Applied)],
        ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'c;

        /// Reads (scope, key) outside any transaction.
        #[doc(hidden)]
        fn idem_lookup<'c>(
            conn: &'c mut Self::Connection,
            sql: &'c Self::IdemSql,
            id: &'c Identity<'c>,
        ) -> impl Future<Output = Result<Option<Found>, sqlx::Error>> + Send + 'c;

        /// Takes (scope, key) under `claim.lease` and opens the transaction the
        /// handler runs in, adopted (`Open::adopt`: a driver may need the
        /// connection again when the claim turns out lost after its `BEGIN`).
        /// `None`: another executor holds it, or it completed meanwhile.
        #[doc(hidden)]
        fn idem_claim<'c>(
            conn: &'c mut Self::Connection,
            sql: &'c Self::IdemSql,
            id: &'c Identity<'c>,
            claim: Claim,
        ) -> impl Future<Output = Result<Option<Adopted>, sqlx::Error>> + Send + 'c;

        /// Claims (scope, key) if it is free (`claim.replace` is `false`), else
        /// reports what is stored. By default [`look_then_claim`].
        #[doc(hidden)]
        fn idem_open<'c>(
            conn: &'c mut Self::Connection,
            sql: &'c Self::IdemSql,
            id: &'c Identity<'c>,
            claim: Claim,
        ) -> impl Future<Output = Result<Opened<'c, Self>, sqlx::Error>> + Send + 'c {
            look_then_claim(conn, sql, id, claim)
        }

        /// Repairs, if it can, what made a claim fail with `error`; `true` when the
        /// claim should be tried again. By default nothing can be repaired.
        /// `ttl_ms`: the failed claim's ttl.
        #[doc(hidden)]
        fn idem_repair<'c>(
            conn: &'c mut Self::Connection,
            sql: &'c Self::IdemSql,
            error: &'c sqlx::Error,
            ttl_ms: i64,
        ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'c {
            let _ = (conn, sql, error, ttl_ms);
            std::future::ready(Ok(false))
        }

        /// Opens the transaction for a request that carries no key.
        #[doc(hidden)]
        fn idem_begin(
            conn: &mut Self::Connection,
        ) -> impl Future<Output = Result<Transaction<'_, Self>, sqlx::Error>> + Send + '_;

        /// Completes the row inside the handler's transaction, if `claim`'s lease still
        /// holds it by the database clock (see [`Written`]). A backend whose database
        /// can end a transaction behind the engine's back finds out here, and records
        /// the answer in a transaction of its own when nothing of the handler's
        /// committed.
        /// `announce`: the key's signal, for a backend that tells other instances'
        /// waiters when the transaction commits (see [`idem_watch`](Self::idem_watch)).
        #[doc(hidden)]
        fn idem_record<'c>(
            conn: &'c mut Self::Connection,
            sql: &'c Self::IdemSql,
            id: &'c Identity<'c>,
            claim: Claim,
            response: Recorded<'c>,
            announce: Option<u64>,
        ) -> impl Future<Output = Result<Written, sqlx::Error>> + Send + 'c;

        /// Rolls back the handler's transaction, which is not to be recorded. `true`
        /// when the database had already committed it behind the engine's back (see
        /// [`Written::Ended`]): the key keeps its `transaction-ended` answer. By
        /// default the rollback alone.
        #[doc(hidden)]
        fn idem_rollback<'c>(
            conn: &'c mut Self::Connection,
            sql: &'c Self::IdemSql,
            id: &'c Identity<'c>,
            claim: Claim,
        ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'c {
            let _ = (sql, id, claim);
            async move {
                <Self::TransactionManager as sqlx_core::transaction::TransactionManager>::rollback(
                    conn,
                )
                .await?;
                Ok(false)
            }
        }

        /// Milliseconds left on the lock of whoever holds (scope, key) now, by the
        /// database clock; `None` when nobody visibly holds it. `lock_ms` is the
        /// endpoint's lock, for backends that only know when the holder started.
        #[doc(hidden)]
        fn idem_lock_left<'c>(
            conn: &'c mut Self::Connection,
            sql: &'c Self::IdemSql,
            id: &'c Identity<'c>,
            lock_ms: i64,
        ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send + 'c;

        /// Starts relaying other instances' announcements into `signals` until
        /// `stop` ends; backends without cross-instance announcements do nothing.
        #[doc(hidden)]
        fn idem_watch(
            pool: &sqlx::Pool<Self>,
            signals: tokio::sync::broadcast::WeakSender<u64>,
            stop: tokio::sync::oneshot::Receiver<()>,
        ) {
            let _ = (pool, signals, stop);
        }

        /// Commits the handler's transaction, its recorded response included. A
        /// backend may end the claim's session state in the same round trip; its
        /// `idem_finish` then has nothing left to do once `committed`.
        #[doc(hidden)]
        fn idem_commit<'c>(
            conn: &'c mut Self::Connection,
            sql: &'c Self::IdemSql,
            id: &'c Identity<'c>,
        ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'c {
            let _ = (sql, id);
            <Self::TransactionManager as sqlx_core::transaction::TransactionManager>::commit(conn)
        }

        /// Runs after the handler's transaction ended (`committed` or rolled back):
        /// frees a claim that outlives the transaction (SQLite's committed row, after
        /// a rollback, if `lease` still holds it) and session state the claim took
        /// (MySQL's named lock). An error leaves the session suspect.
        #[doc(hidden)]
        fn idem_finish<'c>(
            conn: &'c mut Self::Connection,
            sql: &'c Self::IdemSql,
            id: &'c Identity<'c>,
            lease: i64,
            committed: bool,
        ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'c;

        /// `testing::ExactlyOnce`: while `on`, handlers' transactions begin
        /// without taking a lock another connection's write would wait for
        /// (SQLite's write lock), so that a write a handler makes through the pool
        /// commits and is counted instead of waiting for the handler's own
        /// transaction. Elsewhere nothing.
        #[cfg(feature = "testing")]
        #[doc(hidden)]
        fn idem_testing_deferred(sql: &Self::IdemSql, on: bool) {
            let _ = (sql, on);
        }

        /// Where a claim committed before the handler's transaction can be held
        /// between the two (`Idempotency::hold_after_claim`); `None` where the
        /// claim is inside that transaction and there is no gap.
        #[cfg(feature = "testing")]
        #[doc(hidden)]
        fn idem_testing_stall(sql: &Self::IdemSql) -> Option<&crate::hooks::Stall> {
            let _ = sql;
            None
        }

        /// The largest response the database can record, when it is less than
        /// any store's `max_response_bytes` could be (a Galera write set's limit).
        #[doc(hidden)]
        fn idem_max_response(sql: &Self::IdemSql) -> Option<usize> {
            let _ = sql;
            None
        }

        /// Whether a finish that failed with `error` may succeed if tried again,
        /// and where. By default never.
        #[doc(hidden)]
        fn idem_finish_again(sql: &Self::IdemSql, error: &sqlx::Error) -> Again {
            let _ = (sql, error);
            Again::Never
        }

        /// Deletes up to `limit` completed rows whose `expires_at` has passed, in
        /// one short statement; returns how many went.
        #[doc(hidden)]
        fn idem_sweep<'c>(
            conn: &'c mut Self::Connection,
            sql: &'c Self::IdemSql,
            limit: i64,
        ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'c;

        /// Deletes (scope, key)'s completed record, the one it reads and no
        /// other, unless an executor holds the key; never waits for one (see
        /// `admin.rs`). `digest` is the key's [`Identity::digest`].
        #[doc(hidden)]
        fn idem_forget<'c>(
            conn: &'c mut Self::Connection,
            sql: &'c Self::IdemSql,
            scope: &'c str,
            key: &'c str,
            digest: &'c [u8; 32],
        ) -> impl Future<Output = Result<Forgotten, sqlx::Error>> + Send + 'c;

        /// Whether an executor holds (scope, key) now, from what the database
        /// shows of it (see `admin.rs`); never waits.
        #[doc(hidden)]
        fn idem_in_flight<'c>(
            conn: &'c mut Self::Connection,
            sql: &'c Self::IdemSql,
            scope: &'c str,
            key: &'c str,
            digest: &'c [u8; 32],
        ) -> impl Future<Output = Result<Option<InFlight>, sqlx::Error>> + Send + 'c;

        /// Operator's view: rows matching `query` (see `admin.rs`).
        #[doc(hidden)]
        fn idem_inspect<'c>(
            conn: &'c mut Self::Connection,
            sql: &'c Self::IdemSql,
            query: &'c Query<'c>,
        ) -> impl Future<Output = Result<Vec<KeyRecord>, sqlx::Error>> + Send + 'c;

        /// Writes each record's response sealed anew, in one short transaction,
        /// a row only while it is still that completed record (its lease); how
        /// many were.
        #[doc(hidden)]
        fn idem_reseal<'c>(
            conn: &'c mut Self::Connection,
            sql: &'c Self::IdemSql,
            writes: &'c [Resealed<'c>],
        ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'c;
    }
}

/// One stored key, as an operator sees it. Times are relative to the database
/// clock at the moment of the query.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyRecord {
    /// The scope the key belongs to.
    pub scope: String,
    /// The key.
    pub key: String,
    /// `processing` (claimed) or `completed` (response stored).
    pub state: String,
    /// Method of the request that claimed it.
    pub method: String,
    /// Path and query of the request that claimed it.
    pub path: String,
    /// The stored status, once completed.
    pub status: Option<i32>,
    /// Milliseconds until the claim's lock passes; negative once it has.
    pub lock_left_ms: i64,
    /// Milliseconds until the key expires; negative once it has.
    pub expires_in_ms: i64,
    /// Milliseconds since it was claimed.
    pub age_ms: i64,
    /// The stored headers (`name: value` lines), once completed; opened, where the
    /// record is sealed and the store's ring opens it.
    pub headers: Vec<u8>,
    /// The stored body, once completed; opened, as `headers`.
    pub body: Vec<u8>,
    /// The request's `Content-Type` as stored (`None` in rows from before
    /// content types were stored).
    pub content_type: Option<String>,
    /// The key the stored response is sealed under, where it is sealed.
    pub sealed_by: Option<KeyId>,
    /// Why the store would not replay the stored response (see
    /// [`Sealing`](crate::Sealing)); `status`, `headers` and `body` are then empty
    /// where it is sealed and does not open.
    pub unreadable: Option<String>,
    /// The claim's fencing token: a re-seal writes over this record only.
    pub(crate) lease: i64,
    /// The fingerprint as stored.
    pub(crate) fingerprint: Vec<u8>,
}

impl KeyRecord {
    /// A `processing` row whose lock has passed: its executor is gone or hung, and
    /// the next retry takes it over.
    pub fn is_stuck(&self) -> bool {
        self.state == "processing" && self.lock_left_ms <= 0
    }

    /// The row's identity, as its sealed record is bound to it.
    pub(crate) fn sealed_row(&self) -> crate::seal::Sealed<'_> {
        crate::seal::Sealed {
            scope: &self.scope,
            key: &self.key,
            method: &self.method,
            path: &self.path,
            content_type: self.content_type.as_deref(),
            fingerprint: &self.fingerprint,
        }
    }
}

/// What [`Idempotency::forget`](crate::Idempotency::forget) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Forgotten {
    /// The completed record was deleted: the next request with the key runs the
    /// handler again.
    Deleted,
    /// An executor holds the key (a claim, live or stuck, or a transaction that
    /// has not ended): nothing was deleted. Once it has completed, forget again.
    InFlight,
    /// The scope holds no record of the key: nothing was deleted.
    NotFound,
    /// The record read was replaced before it could be deleted (the key expired
    /// and ran again meanwhile): nothing was deleted. Look at it again.
    Changed,
}

impl fmt::Display for Forgotten {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Deleted => "deleted",
            Self::InFlight => "in flight, not deleted",
            Self::NotFound => "no record, nothing deleted",
            Self::Changed => "replaced while being deleted, not deleted",
        })
    }
}

/// A key an executor holds right now, as [`Idempotency::in_flight`](crate::Idempotency::in_flight) finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct InFlight {
    /// The database session executing it: PostgreSQL's backend process id,
    /// MySQL's connection id (`KILL` ends it); `None` on SQLite, whose claim is a
    /// committed row.
    pub session: Option<i64>,
    /// Milliseconds since it was claimed: on PostgreSQL and MySQL, since its
    /// transaction began, where the database shows it (PostgreSQL: to roles
    /// allowed to see that session; MySQL: to users with the `PROCESS` privilege).
    pub age_ms: Option<i64>,
    /// Milliseconds left on its lock; negative once it has passed (stuck). Known
    /// where the claim's row can be read before it commits: SQLite, MySQL.
    pub lock_left_ms: Option<i64>,
}

/// A record sealed anew, to write over the one read.
#[derive(Debug)]
pub struct Resealed<'a> {
    pub record: &'a KeyRecord,
    pub fingerprint: [u8; 32],
    pub body: Vec<u8>,
}

/// What to look up; built by `Idempotency::claims` and `Idempotency::inspect`.
#[doc(hidden)]
#[derive(Debug)]
#[allow(unreachable_pub)]
pub enum Query<'a> {
    /// `processing` rows, oldest first.
    Claims {
        scope: Option<&'a str>,
        stuck_only: bool,
        limit: u32,
    },
    /// One (scope, key).
    Key { scope: &'a str, key: &'a str },
    /// The scopes other than `scope` holding `key` (up to 100).
    OtherScopes { scope: &'a str, key: &'a str },
    /// Completed rows with a stored response, in (scope, key) order, after
    /// `after`: a re-seal's batch.
    Completed {
        after: Option<(&'a str, &'a str)>,
        limit: u32,
    },
    /// Committed rows with no stored response (claims, and transaction-ended
    /// marks), in (scope, key) order, after `after`: an audit's batch.
    Unanswered {
        after: Option<(&'a str, &'a str)>,
        limit: u32,
    },
}

/// Runs a backend's inspection query with its text parameters and decodes the rows.
#[cfg(any(feature = "mysql", feature = "postgres", feature = "sqlite"))]
pub(crate) async fn fetch<DB>(
    conn: &mut DB::Connection,
    sql: String,
    params: Vec<&str>,
) -> Result<Vec<KeyRecord>, sqlx::Error>
where
    DB: sqlx::Database + sqlx::database::HasStatementCache,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'a> DB::Arguments: sqlx::IntoArguments<DB>,
    for<'e> &'e str: sqlx::Encode<'e, DB> + sqlx::Type<DB>,
    for<'a> &'a str: sqlx::ColumnIndex<DB::Row>,
    for<'r> String: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> Option<String>: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> i64: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> Option<i64>: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> Vec<u8>: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
{
    // Unprepared: an operator's query is rare, and must work through a pooler.
    let mut statement = sqlx::query(sqlx::AssertSqlSafe(sql)).persistent(false);
    for param in params {
        statement = statement.bind(param);
    }
    let rows = statement.fetch_all(conn).await?;
    rows.iter().map(decode).collect()
}

/// Runs `statement` (parameters: fingerprint, body, scope, key, lease) once for
/// each re-sealed record, on `conn` (a transaction); how many rows it changed, as
/// `changed` reads a result.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) async fn reseal_each<DB>(
    conn: &mut DB::Connection,
    statement: &str,
    writes: &[Resealed<'_>],
    changed: fn(&DB::QueryResult) -> u64,
) -> Result<u64, sqlx::Error>
where
    DB: sqlx::Database + sqlx::database::HasStatementCache,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'a> DB::Arguments: sqlx::IntoArguments<DB>,
    for<'e> &'e [u8]: sqlx::Encode<'e, DB> + sqlx::Type<DB>,
    for<'e> &'e str: sqlx::Encode<'e, DB> + sqlx::Type<DB>,
    for<'e> i64: sqlx::Encode<'e, DB> + sqlx::Type<DB>,
{
    let mut written = 0;
    for write in writes {
        let done = sqlx::query(sqlx::AssertSqlSafe(statement))
            .persistent(false)
            .bind(&write.fingerprint[..])
            .bind(&write.body[..])
            .bind(write.record.scope.as_str())
            .bind(write.record.key.as_str())
            .bind(write.record.lease)
            .execute(&mut *conn)
            .await?;
        written += changed(&done);
    }
    Ok(written)
}

/// Decodes the columns every backend's inspection query selects, in one shape:
/// `scope`, `idempotency_key`, `state`, `method`, `path` and `content_type`
/// (nullable) as text, `status`, `lease` and the three `*_ms` as 64-bit integers,
/// `fingerprint`, `headers` and `body` as bytes (empty if none).
#[cfg(any(feature = "mysql", feature = "postgres", feature = "sqlite"))]
fn decode<R>(row: &R) -> Result<KeyRecord, sqlx::Error>
where
    R: sqlx::Row,
    for<'a> &'a str: sqlx::ColumnIndex<R>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<i64>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    Ok(KeyRecord {
        scope: row.try_get("scope")?,
        key: row.try_get("idempotency_key")?,
        state: row.try_get("state")?,
        method: row.try_get("method")?,
        path: row.try_get("path")?,
        status: row
            .try_get::<Option<i64>, _>("status")?
            .and_then(|s| i32::try_from(s).ok()),
        lock_left_ms: row.try_get("lock_left_ms")?,
        expires_in_ms: row.try_get("expires_in_ms")?,
        age_ms: row.try_get("age_ms")?,
        headers: row.try_get("headers")?,
        body: row.try_get("body")?,
        content_type: row.try_get("content_type")?,
        sealed_by: None,
        unreadable: None,
        lease: row.try_get("lease")?,
        fingerprint: row.try_get("fingerprint")?,
    })
}

impl Query<'_> {
    /// The `WHERE` clause (with `placeholder(n)` for the n-th parameter and `now`
    /// for the database clock), the `ORDER BY` list, the row limit, whether stored
    /// responses are read, and the parameters in order (each placeholder is used
    /// once).
    #[cfg(any(feature = "mysql", feature = "postgres", feature = "sqlite"))]
    pub(crate) fn parts(&self, placeholder: impl Fn(usize) -> String, now: &str) -> Parts<'_> {
        let by_age = "created_at";
        let (filter, limit, payload, params) = match *self {
            Query::Claims {
                scope,
                stuck_only,
                limit,
            } => {
                let mut filter = "state = 'processing'".to_owned();
                let mut params = Vec::new();
                if let Some(scope) = scope {
                    filter.push_str(&format!(" AND scope = {}", placeholder(1)));
                    params.push(scope);
                }
                if stuck_only {
                    filter.push_str(&format!(" AND locked_until <= {now}"));
                }
                (filter, limit, false, params)
            }
            Query::Completed { after, limit } => {
                let rows = "state = 'completed' AND body IS NOT NULL";
                return Self::batch(rows, after, limit, true, placeholder);
            }
            Query::Unanswered { after, limit } => {
                return Self::batch("body IS NULL", after, limit, false, placeholder);
            }
            Query::Key { scope, key } => (
                format!(
                    "scope = {} AND idempotency_key = {}",
                    placeholder(1),
                    placeholder(2)
                ),
                1,
                true,
                vec![scope, key],
            ),
            Query::OtherScopes { scope, key } => (
                format!(
                    "idempotency_key = {} AND scope <> {}",
                    placeholder(1),
                    placeholder(2)
                ),
                100,
                false,
                vec![key, scope],
            ),
        };
        Parts {
            filter,
            order: by_age,
            limit,
            payload,
            params,
        }
    }

    /// A batch of the rows matching `rows` after `after`, in (scope, key) order;
    /// with their stored responses where `payload`.
    #[cfg(any(feature = "mysql", feature = "postgres", feature = "sqlite"))]
    fn batch<'p>(
        rows: &str,
        after: Option<(&'p str, &'p str)>,
        limit: u32,
        payload: bool,
        placeholder: impl Fn(usize) -> String,
    ) -> Parts<'p> {
        let mut filter = rows.to_owned();
        let mut params = Vec::new();
        if let Some((scope, key)) = after {
            filter.push_str(&format!(
                " AND (scope > {} OR (scope = {} AND idempotency_key > {}))",
                placeholder(1),
                placeholder(2),
                placeholder(3)
            ));
            params.extend([scope, scope, key]);
        }
        Parts {
            filter,
            order: "scope, idempotency_key",
            limit,
            payload,
            params,
        }
    }
}

/// An inspection query's parts (see [`Query::parts`]).
#[cfg(any(feature = "mysql", feature = "postgres", feature = "sqlite"))]
pub(crate) struct Parts<'a> {
    pub(crate) filter: String,
    pub(crate) order: &'static str,
    pub(crate) limit: u32,
    /// Whether stored responses are read.
    pub(crate) payload: bool,
    pub(crate) params: Vec<&'a str>,
}
