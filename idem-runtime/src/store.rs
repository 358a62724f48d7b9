//! The store handle users keep in their application state.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use sqlx::Pool;

use crate::backend::{Applied, Backend, Layout};
use crate::cache::ReplayCache;
use crate::seal::Sealing;
use crate::shutdown::{Lifecycle, Shutdown};
use crate::signal::Signals;

/// Name of the key table unless [`Builder::table`] says otherwise.
pub const DEFAULT_TABLE: &str = "idempotency_keys";

/// Default base of problem `type` URIs: `urn:idem:problem:in-flight` and so on.
pub const DEFAULT_PROBLEM_BASE: &str = "urn:idem:problem:";

/// Default largest response body kept for replay: 1 MiB.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 1024 * 1024;

/// The default [`Builder::body_timeout`]: 30 seconds for the whole request body.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// Default bound of the completed responses a store keeps in memory: 8 MiB.
pub const DEFAULT_REPLAY_CACHE_BYTES: usize = 8 * 1024 * 1024;

/// Default longest time a response kept in memory is replayed before the table is
/// read again: 30 seconds.
pub const DEFAULT_REPLAY_CACHE_REFRESH: Duration = Duration::from_secs(30);

/// The idempotency store: a connection pool of your own database plus store-wide
/// settings. Cheap to clone; put it in your axum state and reach it with `FromRef`.
///
/// # Examples
///
/// ```rust,no_run
/// # extern crate idem_runtime as idem_axum;
/// # #[cfg(feature = "sqlite")]
/// # mod example {
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use idem_axum::Idempotency;
/// use sqlx::sqlite::SqlitePool;
///
/// let pool = SqlitePool::connect("sqlite://payments.db?mode=rwc").await?;
/// let idempotency = Idempotency::builder(pool)
///     .table("api_idempotency_keys")
///     .problem_base("https://api.example.com/problems/")
///     .max_response_bytes(256 * 1024)
///     .build()?;
/// idempotency.migrate().await?;
/// # Ok(()) }
/// # }
/// ```
pub struct Idempotency<DB> {
    built: Arc<dyn Built<DB>>,
}

/// A built store's state, behind a trait object so that the type
/// `Idempotency<Postgres>` can be named (in an app's state, a router's type)
/// without idem-axum's `postgres` feature: only building one needs it, and a
/// build without it is reported there, once, with the fix.
trait Built<DB>: Send + Sync {
    fn inner(&self) -> &Inner<DB>
    where
        DB: Backend;
}

impl<DB: Backend> Built<DB> for Inner<DB> {
    fn inner(&self) -> &Inner<DB> {
        self
    }
}

pub(crate) struct Inner<DB: Backend> {
    pub(crate) pool: Pool<DB>,
    pub(crate) table: Box<str>,
    pub(crate) problem_base: Arc<str>,
    pub(crate) max_response_bytes: usize,
    pub(crate) body_timeout: Duration,
    pub(crate) partitioned: bool,
    pub(crate) transaction_pooled: bool,
    /// Where `wait`'s listener takes its connection, when not from `pool`.
    pub(crate) listen_pool: Option<Pool<DB>>,
    pub(crate) sql: DB::IdemSql,
    /// Completed responses kept in process, opened; `None` when turned off.
    pub(crate) replay_cache: Option<ReplayCache>,
    pub(crate) sealing: Sealing,
    pub(crate) signals: Signals,
    pub(crate) lifecycle: Arc<Lifecycle>,
    /// What `testing::ExactlyOnce` steers and watches.
    #[cfg(feature = "testing")]
    pub(crate) hooks: crate::hooks::Hooks,
}

impl<DB> Clone for Idempotency<DB> {
    fn clone(&self) -> Self {
        Self {
            built: Arc::clone(&self.built),
        }
    }
}

impl<DB: Backend> fmt::Debug for Idempotency<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("backend", &DB::NAME)
            .field("table", &self.inner().table)
            .field("problem_base", &self.inner().problem_base)
            .field("max_response_bytes", &self.inner().max_response_bytes)
            .field("body_timeout", &self.inner().body_timeout)
            .field(
                "replay_cache_bytes",
                &self.inner().replay_cache.as_ref().map(ReplayCache::weight),
            )
            .field("sealing", &self.inner().sealing)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> Idempotency<DB> {
    /// The store's state.
    pub(crate) fn inner(&self) -> &Inner<DB> {
        self.built.inner()
    }

    /// A store on `pool` with the default settings: table `idempotency_keys`,
    /// problem types under `urn:idem:problem:`, responses up to 1 MiB.
    ///
    /// # Examples
    ///
    /// ```rust,no_run
    /// # extern crate idem_runtime as idem_axum;
    /// # #[cfg(feature = "postgres")]
    /// # mod example {
    /// # async fn demo() -> Result<(), sqlx::Error> {
    /// use idem_axum::Idempotency;
    ///
    /// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/app").await?;
    /// let idempotency = Idempotency::new(pool);
    /// idempotency.migrate().await?;
    /// # Ok(()) }
    /// # }
    /// ```
    pub fn new(pool: Pool<DB>) -> Self {
        Self::builder(pool).build_unchecked()
    }

    /// Starts a store with non-default settings.
    pub fn builder(pool: Pool<DB>) -> Builder<DB> {
        Builder {
            pool,
            table: DEFAULT_TABLE.into(),
            problem_base: DEFAULT_PROBLEM_BASE.into(),
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            replay_cache_bytes: DEFAULT_REPLAY_CACHE_BYTES,
            replay_cache_refresh: DEFAULT_REPLAY_CACHE_REFRESH,
            partitioned: false,
            transaction_pooled: false,
            deferred: false,
            galera: None,
            listen_pool: None,
            sealing: Sealing::Off,
        }
    }

    /// The pool the store (and the handlers' transactions) draw connections from.
    pub fn pool(&self) -> &Pool<DB> {
        &self.inner().pool
    }

    /// The key table's name.
    pub fn table(&self) -> &str {
        &self.inner().table
    }

    /// The base of problem `type` URIs.
    pub fn problem_base(&self) -> &str {
        &self.inner().problem_base
    }

    /// The largest response body the store keeps for replay.
    pub fn max_response_bytes(&self) -> usize {
        self.inner().max_response_bytes
    }

    /// How long the axum extractor waits for a whole request body.
    pub fn body_timeout(&self) -> Duration {
        self.inner().body_timeout
    }

    /// The SQL that creates the key table and applies every upgrade since, for this
    /// backend and table name. The same files, for the default name, are in
    /// `migrations/<backend>/` of the repository, to copy in order into your own
    /// migration tool.
    ///
    /// # Examples
    ///
    /// ```rust,no_run
    /// # extern crate idem_runtime as idem_axum;
    /// # fn demo<DB: idem_axum::Backend>(idempotency: idem_axum::Idempotency<DB>) {
    /// println!("{}", idempotency.migration_sql());
    /// # }
    /// ```
    pub fn migration_sql(&self) -> String {
        migration_sql::<DB>(&self.inner().table, self.inner().partitioned)
    }

    /// This store's migrations, in order, for its table.
    fn migrations(&self) -> Vec<(String, Applied)> {
        migrations::<DB>(&self.inner().table, self.inner().partitioned)
            .into_iter()
            .map(|(_, sql, applied)| (sql, applied))
            .collect()
    }

    /// Whether records fail on purpose (`testing::ExactlyOnce`'s first check).
    pub(crate) fn records_fail(&self) -> bool {
        #[cfg(feature = "testing")]
        return self.inner().hooks.records_fail();
        #[cfg(not(feature = "testing"))]
        false
    }

    /// The handle that shuts this store down gracefully: see [`Shutdown`].
    pub fn shutdown(&self) -> Shutdown {
        Shutdown::new(Arc::clone(&self.inner().lifecycle))
    }

    /// Whether the table uses the partitioned layout.
    pub fn is_partitioned(&self) -> bool {
        self.inner().partitioned
    }

    /// Creates the key table and its index if they do not exist, and upgrades a
    /// table an earlier release created, in place, keeping its keys. Safe to call
    /// from every instance at start-up.
    ///
    /// This does not go through `sqlx::migrate!`: that would record idem's version
    /// in your `_sqlx_migrations` table, and your own migrator would then refuse to
    /// run, finding an applied migration it does not know. To manage the table with
    /// your own tool instead, copy [`migration_sql`](Self::migration_sql) (or the
    /// repository's `migrations/<backend>/` file) into it and skip this call.
    ///
    /// # Errors
    ///
    /// Any database error.
    pub async fn migrate(&self) -> Result<(), sqlx::Error> {
        let mut conn = self.inner().pool.acquire().await?;
        DB::idem_migrate(
            &mut conn,
            &self.inner().sql,
            &self.inner().table,
            &self.migrations(),
        )
        .await
    }
}

/// Settings for an [`Idempotency`] store; see [`Idempotency::builder`].
#[derive(Debug)]
#[must_use]
pub struct Builder<DB: Backend> {
    pool: Pool<DB>,
    table: Box<str>,
    problem_base: Box<str>,
    max_response_bytes: usize,
    body_timeout: Duration,
    replay_cache_bytes: usize,
    replay_cache_refresh: Duration,
    partitioned: bool,
    transaction_pooled: bool,
    deferred: bool,
    galera: Option<bool>,
    listen_pool: Option<Pool<DB>>,
    sealing: Sealing,
}

impl<DB: Backend> Builder<DB> {
    /// The key table: a plain SQL identifier (letters, digits, `_`, at most 48
    /// characters, not starting with a digit). Choose the schema through the
    /// connection's search path.
    pub fn table(mut self, table: &str) -> Self {
        self.table = table.into();
        self
    }

    /// The base that problem `type` URIs start with, e.g.
    /// `https://api.example.com/problems/`.
    pub fn problem_base(mut self, base: &str) -> Self {
        self.problem_base = base.into();
        self
    }

    /// The largest response body kept for replay. A larger response is not
    /// recorded: its transaction is rolled back, the key released, and the client
    /// gets 500 `response-too-large`; a partial record is never kept.
    pub fn max_response_bytes(mut self, max: usize) -> Self {
        self.max_response_bytes = max;
        self
    }

    /// How long the axum extractor waits for the whole request body (default
    /// [`DEFAULT_BODY_TIMEOUT`]). A body that trickles in slower is answered 408
    /// `request-timeout` before anything is claimed, so the client may simply send
    /// it again; a slow client cannot hold a handler, a key or a connection.
    pub fn body_timeout(mut self, timeout: Duration) -> Self {
        self.body_timeout = timeout;
        self
    }

    /// The memory, in bytes, for completed responses kept in process (default
    /// [`DEFAULT_REPLAY_CACHE_BYTES`]; 0 turns the cache off). A retry of a
    /// completed key is then answered from memory, replayed or refused 422 as the
    /// table would, without a database round trip; concurrent retries of one key
    /// that is not kept read the table once between them. Least used entries go
    /// first when it is full; the memory held stays within the bound whatever the
    /// responses' shape (a body is copied out of the buffer it came in, so a slice
    /// of a large one does not keep it alive). A response enters only once its
    /// transaction has committed, and is never replayed past its key's ttl.
    ///
    /// An entry may weigh up to 97% of an eighth of `max_bytes` (its body, headers
    /// and request identity, and about 380 bytes more), whatever the host's cores:
    /// about 990 KiB of body with the default 8 MiB, against the 1 MiB the default
    /// `max_response_bytes` stores. A heavier one is replayed from the table.
    ///
    /// # Examples
    ///
    /// ```rust,no_run
    /// # extern crate idem_runtime as idem_axum;
    /// # fn demo<DB: idem_axum::Backend>(pool: sqlx::Pool<DB>) -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use idem_axum::Idempotency;
    ///
    /// let idempotency = Idempotency::builder(pool)
    ///     .replay_cache(64 * 1024 * 1024)
    ///     .replay_cache_refresh(Duration::from_secs(5))
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn replay_cache(mut self, max_bytes: usize) -> Self {
        self.replay_cache_bytes = max_bytes;
        self
    }

    /// The longest a response kept in memory is replayed before the table is read
    /// again (default [`DEFAULT_REPLAY_CACHE_REFRESH`]; zero turns the cache off).
    /// This bounds how long a running instance may keep replaying a key after an
    /// operator deleted it (`idem forget`, or [`Idempotency::forget`] on another
    /// instance).
    pub fn replay_cache_refresh(mut self, refresh: Duration) -> Self {
        self.replay_cache_refresh = refresh;
        self
    }

    /// Whether recorded responses are sealed and fingerprints keyed, and with
    /// which key ring (default [`Sealing::Off`]). Sealed records are opened when
    /// read, before the replay cache keeps them: replays from memory decrypt
    /// nothing.
    ///
    /// # Examples
    ///
    /// ```rust,no_run
    /// # extern crate idem_runtime as idem_axum;
    /// # fn demo<DB: idem_axum::Backend>(pool: sqlx::Pool<DB>) -> Result<(), Box<dyn std::error::Error>> {
    /// use idem_axum::{Idempotency, KeyRing, Sealing};
    ///
    /// let ring = KeyRing::from_base64(&std::env::var("SEAL_KEYS")?)?;
    /// let idempotency = Idempotency::builder(pool).sealing(Sealing::On(ring)).build()?;
    /// # Ok(()) }
    /// ```
    pub fn sealing(mut self, sealing: Sealing) -> Self {
        self.sealing = sealing;
        self
    }

    /// Builds the store.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] when the table name is not a plain identifier.
    pub fn build(self) -> Result<Idempotency<DB>, ConfigError> {
        let valid = !self.table.is_empty()
            && self.table.len() <= 48
            && !self.table.starts_with(|c: char| c.is_ascii_digit())
            && self
                .table
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid {
            return Err(ConfigError { table: self.table });
        }
        Ok(self.build_unchecked())
    }

    fn build_unchecked(self) -> Idempotency<DB> {
        let layout = Layout {
            partitioned: self.partitioned,
            transaction_pooled: self.transaction_pooled,
            deferred: self.deferred,
            galera: self.galera,
        };
        let sql = DB::idem_sql(&self.table, layout, &self.pool);
        Idempotency {
            built: Arc::new(Inner {
                pool: self.pool,
                table: self.table,
                problem_base: self.problem_base.into(),
                max_response_bytes: self.max_response_bytes,
                body_timeout: self.body_timeout,
                partitioned: self.partitioned,
                transaction_pooled: self.transaction_pooled,
                listen_pool: self.listen_pool,
                sql,
                replay_cache: ReplayCache::new(self.replay_cache_bytes, self.replay_cache_refresh),
                sealing: self.sealing,
                signals: Signals::new(),
                lifecycle: Arc::new(Lifecycle::new()),
                #[cfg(feature = "testing")]
                hooks: crate::hooks::Hooks::default(),
            }),
        }
    }
}

#[cfg(feature = "postgres")]
impl Builder<sqlx::Postgres> {
    /// Uses the PostgreSQL layout partitioned by day of expiry: expired days are
    /// dropped whole by [`Idempotency::maintain_partitions`] instead of deleted row
    /// by row. Claims then take one more round trip (the advisory lock, before a
    /// check for an existing row in any partition), since the primary key must
    /// include the partition column and no longer keeps (scope, key) unique alone.
    ///
    /// # Examples
    ///
    /// ```rust,no_run
    /// # extern crate idem_runtime as idem_axum;
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// use idem_axum::Idempotency;
    ///
    /// let idempotency = Idempotency::builder(pool).partitioned_by_day().build()?;
    /// idempotency.migrate().await?;
    /// idempotency.maintain_partitions(7).await?;
    /// # Ok(()) }
    /// ```
    pub fn partitioned_by_day(mut self) -> Self {
        self.partitioned = true;
        self
    }

    /// Declares that the pool's connections go through a pooler in transaction
    /// mode (PgBouncer's `pool_mode = transaction`, or any pooler that hands a
    /// server connection to a client for one transaction at a time). idem then
    /// sends every statement of its own unprepared and inside a transaction: a
    /// named prepared statement does not exist on the next transaction's server
    /// connection, and an unnamed one sent outside a transaction can be answered
    /// with another client's result.
    ///
    /// `wait` needs `LISTEN`, which a transaction pooler cannot carry: give its
    /// listener a direct pool with [`listen_pool`](Self::listen_pool), or waiting
    /// duplicates look again at intervals (25 ms doubling to 500 ms) instead of
    /// being woken across instances. Your handlers' own statements need the same
    /// care (`.persistent(false)`; they run inside idem's transaction). See
    /// `docs/deployment.md`.
    ///
    /// # Examples
    ///
    /// ```rust,no_run
    /// # extern crate idem_runtime as idem_axum;
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use idem_axum::Idempotency;
    /// use sqlx::PgPool;
    ///
    /// let through_pgbouncer = PgPool::connect("postgres://app@127.0.0.1:6432/app").await?;
    /// let direct = PgPool::connect("postgres://app@127.0.0.1:5432/app").await?;
    /// let idempotency = Idempotency::builder(through_pgbouncer)
    ///     .transaction_pooled()
    ///     .listen_pool(direct)
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn transaction_pooled(mut self) -> Self {
        self.transaction_pooled = true;
        self
    }

    /// The pool `wait`'s listener takes its one connection from, instead of the
    /// store's own: a direct connection to PostgreSQL when the store's pool goes
    /// through a transaction pooler (see
    /// [`transaction_pooled`](Self::transaction_pooled)).
    pub fn listen_pool(mut self, pool: sqlx::PgPool) -> Self {
        self.listen_pool = Some(pool);
        self
    }
}

#[cfg(feature = "sqlite")]
impl Builder<sqlx::Sqlite> {
    /// Begins each handler's transaction deferred: SQLite's one write lock is
    /// taken at the handler's first write instead of before the handler runs, so
    /// that what a handler waits for before it writes (a provider's answer)
    /// overlaps with other keys' handlers instead of queueing them all.
    ///
    /// The handler must then write before it reads, or read nothing it depends
    /// on: in WAL mode a transaction that read and then writes fails with
    /// `SQLITE_BUSY` (a stale snapshot) when another writer committed in between,
    /// and no waiting fixes that. Such a failure rolls back and frees the key, as
    /// any error does; a handler that wrote nothing still has its answer recorded.
    /// See the repository's `docs/backends.md`, "SQLite".
    ///
    /// # Examples
    ///
    /// ```rust,no_run
    /// # extern crate idem_runtime as idem_axum;
    /// # async fn demo(pool: sqlx::SqlitePool) -> Result<(), Box<dyn std::error::Error>> {
    /// use idem_axum::Idempotency;
    ///
    /// let idempotency = Idempotency::builder(pool).write_lock_at_first_write().build()?;
    /// # Ok(()) }
    /// ```
    pub fn write_lock_at_first_write(mut self) -> Self {
        self.deferred = true;
        self
    }
}

#[cfg(feature = "mysql")]
impl Builder<sqlx::MySql> {
    /// Whether the server is a node of a multi-primary cluster (MariaDB Galera
    /// Cluster, Percona XtraDB Cluster), with instances writing through several
    /// nodes. By default idem asks the server (`@@wsrep_on`) once, at
    /// [`migrate`](Idempotency::migrate) or at the first keyed request; this
    /// setting answers instead.
    ///
    /// On such a cluster a named lock or a row lock holds on one node only, and
    /// the one exclusion across nodes is the certification of committed writes. A
    /// claim is then a row committed (and certified) before the handler runs,
    /// with a lease that the handler's transaction must still hold to record its
    /// answer, as on SQLite: a duplicate on any node finds the claim or loses
    /// certification, and never runs. A first execution commits twice (the
    /// claim, then the handler's transaction): measured on one server, about 1.45
    /// times the standalone design's time. `true` forces it on a standalone
    /// server too (useful to test it there); `false` keeps the standalone design
    /// on a cluster, which is correct only while every instance writes through one
    /// node. See the repository's `docs/deployment.md`.
    ///
    /// # Examples
    ///
    /// ```rust,no_run
    /// # extern crate idem_runtime as idem_axum;
    /// # async fn demo(pool: sqlx::MySqlPool) -> Result<(), Box<dyn std::error::Error>> {
    /// use idem_axum::Idempotency;
    ///
    /// let idempotency = Idempotency::builder(pool).galera(true).build()?;
    /// idempotency.migrate().await?;
    /// # Ok(()) }
    /// ```
    pub fn galera(mut self, cluster: bool) -> Self {
        self.galera = Some(cluster);
        self
    }
}

/// A store setting was refused by [`Builder::build`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    table: Box<str>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid idempotency table name {:?}: use letters, digits and `_`, at most 48 characters, not starting with a digit",
            self.table
        )
    }
}

impl std::error::Error for ConfigError {}

/// The SQL that creates the key table `table` on backend `DB` and applies every
/// upgrade since (`partitioned`: PostgreSQL's layout partitioned by day), with no
/// database at hand: for a migration of your own tool. The `idem migration`
/// command prints it.
///
/// # Examples
///
/// ```rust
/// # extern crate idem_runtime as idem_axum;
/// # #[cfg(feature = "postgres")]
/// # {
/// let sql = idem_axum::migration_sql::<sqlx::Postgres>("api_keys", false);
/// assert!(sql.contains("CREATE TABLE IF NOT EXISTS api_keys"));
/// # }
/// ```
pub fn migration_sql<DB: Backend>(table: &str, partitioned: bool) -> String {
    migrations::<DB>(table, partitioned)
        .into_iter()
        .map(|(_, sql, _)| sql)
        .collect::<Vec<_>>()
        .join("\n")
}

/// [`migration_sql`] one migration at a time: each one's version (the number of its
/// file in the repository's `migrations/<backend>/`, from 1; a layout skips the
/// upgrades that are not for it, as PostgreSQL's plain layout skips 3) and its SQL,
/// in order.
/// A migration folder of your own that holds the versions up to `n` needs only
/// those after it (`idem migration --since n`).
///
/// # Examples
///
/// ```rust
/// # extern crate idem_runtime as idem_axum;
/// # #[cfg(feature = "sqlite")]
/// # {
/// let steps = idem_axum::migration_steps::<sqlx::Sqlite>("api_keys", false);
/// assert_eq!(steps[0].0, 1);
/// assert!(steps[0].1.contains("CREATE TABLE IF NOT EXISTS api_keys"));
/// let new_since_1: Vec<_> = steps.iter().filter(|(version, _)| *version > 1).collect();
/// assert!(!new_since_1.is_empty());
/// # }
/// ```
pub fn migration_steps<DB: Backend>(table: &str, partitioned: bool) -> Vec<(u32, String)> {
    migrations::<DB>(table, partitioned)
        .into_iter()
        .map(|(version, sql, _)| (version, sql))
        .collect()
}

/// The backend's migrations, in order, for `table`.
fn migrations<DB: Backend>(table: &str, partitioned: bool) -> Vec<(u32, String, Applied)> {
    let layout = Layout {
        partitioned,
        ..Layout::default()
    };
    DB::idem_migrations(layout)
        .iter()
        .map(|m| (m.version, m.sql.replace(DEFAULT_TABLE, table), m.applied))
        .collect()
}
