//! `idem`: the operator's view of an idempotency-key table.
//!
//! ```text
//! idem list --stuck                      # claims whose lock has passed
//! idem show --scope user-7 order-42      # one key's record in one scope
//! idem forget --scope user-7 order-42    # its next request runs again
//! idem sweep --batch 500                 # delete expired keys now
//! IDEM_SEAL_KEYS=... idem reseal         # sealed records under the ring's first key
//! IDEM_SEAL_KEYS=... idem audit          # rows that still need each key of the ring
//! idem --partitioned partitions --ahead 7   # PostgreSQL, partitioned layout
//! idem migration postgres > migrations/20261201_idempotency_keys.sql
//! idem migration --since 1 postgres      # only what came after your first one
//! ```
//!
//! `DATABASE_URL` comes from `--database-url`, the environment, or a `.env` file in
//! the current directory or one above it, read as sqlx-cli reads it (`dotenvy`).
//! A key ring, for stores that seal their records, comes from `IDEM_SEAL_KEYS` or
//! the file `--seal-keys-file` names (never from the command line, which other
//! users of the machine can read): standard base64 of 32-byte keys, the sealing key first,
//! separated by commas, as `KeyRing::from_base64` reads it; a file's one trailing
//! newline is dropped.
//! Exit status: 0 done; 1 failed (the database could not be reached or refused, or
//! the key has no record to show or forget); 2 the command line was wrong; 3
//! `forget` deleted nothing because the key is in flight (or its record changed
//! while it ran): try again once it has completed.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use zeroize::Zeroizing;

use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use idem_runtime::{
    Backend, DEFAULT_TABLE, Forgotten, Idempotency, InFlight, KeyRecord, KeyRing, Reseal, Sealing,
    Sweep, migration_steps,
};
use sqlx::pool::PoolOptions;
use sqlx::{Connection, Database, MySql, Pool, Postgres, Sqlite};

/// The operator's view of an idempotency-key table.
#[derive(Parser)]
#[command(
    name = "idem",
    version,
    after_help = "DATABASE_URL is also read from a .env file in the current directory or one \
                  above it.\nExit status: 0 done; 1 failed (the database could not be reached \
                  or refused, or the key has no record to show or forget); 2 the command line \
                  was wrong; 3 forget deleted nothing: the key is in flight (or changed while \
                  it ran), try again once it has completed."
)]
struct Cli {
    /// postgres://, mysql:// or sqlite://
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,
    /// The key table.
    #[arg(long, default_value = DEFAULT_TABLE, global = true)]
    table: String,
    /// The table uses PostgreSQL's layout partitioned by day.
    #[arg(long, global = true)]
    partitioned: bool,
    /// A file holding the key ring that opens sealed records (else
    /// `IDEM_SEAL_KEYS`).
    #[arg(long, global = true, value_name = "PATH")]
    seal_keys_file: Option<PathBuf>,
    /// The context the service's key ring binds its records to
    /// (`KeyRing::with_context`), if it names one.
    #[arg(long, global = true, env = "IDEM_SEAL_CONTEXT", value_name = "NAME")]
    seal_context: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Claims in flight (processing), oldest first.
    ///
    /// Scope, key, method, path, age, and the time left on the lock (negative: the
    /// lock has passed and the next retry takes the key over). SQLite's claims are
    /// committed rows; MySQL's are read before they commit, while their named lock
    /// is held. PostgreSQL's cannot be read before they commit: the list then says
    /// what can be known (how many claims are held in open transactions, and the
    /// oldest's age).
    List {
        /// Only claims whose lock has passed.
        #[arg(long)]
        stuck: bool,
        /// Only this scope.
        #[arg(long)]
        scope: Option<String>,
        /// At most this many rows.
        #[arg(long, default_value_t = 50)]
        limit: u32,
    },
    /// One key's record in one scope, and whether it is in flight.
    ///
    /// State, request, status, times, stored headers and body; for a key in flight,
    /// the database session executing it. Another scope's record is never shown: if
    /// other scopes hold the same key, they are only named.
    Show {
        /// The scope the key belongs to.
        #[arg(long)]
        scope: String,
        /// The Idempotency-Key.
        key: String,
    },
    /// Delete one completed key, so that its next request runs the handler again.
    ///
    /// For a response that must not be replayed any more. Only the completed record
    /// it reads goes: a key in flight is never deleted, nor waited for (exit status
    /// 3, at once). Running instances keep replaying their copy in memory until their
    /// replay cache's refresh has passed (30 seconds by default).
    Forget {
        /// The scope the key belongs to.
        #[arg(long)]
        scope: String,
        /// The Idempotency-Key.
        key: String,
    },
    /// Delete expired keys now.
    ///
    /// Completed keys whose ttl has passed go in batches; claims in flight are
    /// never deleted.
    Sweep {
        /// Rows a batch deletes.
        #[arg(long, default_value_t = 500)]
        batch: u32,
        /// Seconds the whole sweep may take.
        #[arg(long, default_value_t = 60)]
        budget: u64,
        /// Milliseconds between batches.
        #[arg(long, default_value_t = 0)]
        pause: u64,
    },
    /// Seal stored records anew under the key ring's first key.
    ///
    /// After a rotation (the new key promoted first in the ring, the old ones
    /// after it): every completed record is sealed anew, and its fingerprint
    /// keyed anew, under the first key: read in batches that lock nothing, each written back
    /// in one short transaction, beside the running service. Once it has caught up, with no record
    /// left unreadable, the old keys can leave the ring. Needs the ring
    /// (`IDEM_SEAL_KEYS` or `--seal-keys-file`).
    Reseal {
        /// Records read, and written back in one transaction, per batch.
        #[arg(long, default_value_t = 100)]
        batch: u32,
        /// Seconds the whole run may take.
        #[arg(long, default_value_t = 600)]
        budget: u64,
        /// Milliseconds between batches.
        #[arg(long, default_value_t = 0)]
        pause: u64,
        /// Also seal records stored in plain text (turning sealing on, once every
        /// instance seals new records): only where they are known to be idem's.
        #[arg(long)]
        plain: bool,
    },
    /// Count, per key of the ring, the stored rows that still need it.
    ///
    /// Completed records sealed under a key or with their fingerprint keyed
    /// under it (`reseal` moves them to the first key), committed claims, and
    /// rows a transaction ended behind idem's back (they hold no response to
    /// key anew from, and leave when they expire); then records in plain text.
    /// A key may leave the ring only once nothing needs it. Reads every row,
    /// locks and writes nothing. Needs the ring (`IDEM_SEAL_KEYS` or
    /// `--seal-keys-file`).
    Audit {
        /// Rows read per batch.
        #[arg(long, default_value_t = 500)]
        batch: u32,
    },
    /// Create the days ahead and drop ended days (PostgreSQL, partitioned layout).
    ///
    /// Creates the day partitions for today and the next days and drops every day
    /// partition whose day has ended. Needs `--partitioned`.
    Partitions {
        /// Days to create ahead of today.
        #[arg(long, default_value_t = 7)]
        ahead: u32,
    },
    /// Print the key table's SQL, for a migration of your own tool.
    ///
    /// The table and every upgrade since, in order, for `--table` (and
    /// `--partitioned` on PostgreSQL), each headed by its version. Needs no database.
    Migration {
        /// The database the SQL is for.
        backend: BackendName,
        /// Only the versions after this one: what to add to a folder whose latest
        /// idem migration is this version.
        #[arg(long, value_name = "VERSION")]
        since: Option<u32>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum BackendName {
    Postgres,
    Mysql,
    Sqlite,
}

/// Why a command did not do its work, with its message.
enum Fail {
    /// The database, or what it holds: exit status 1.
    Failed(String),
    /// The command line asks for something that cannot be: exit status 2.
    Usage(String),
    /// The key is busy: nothing was done, and trying again later may do it: exit
    /// status 3.
    Busy(String),
}

impl From<sqlx::Error> for Fail {
    fn from(error: sqlx::Error) -> Self {
        Fail::Failed(database_error(&error))
    }
}

impl From<idem_runtime::ConfigError> for Fail {
    fn from(error: idem_runtime::ConfigError) -> Self {
        Fail::Usage(error.to_string())
    }
}

/// A database error as an operator reads it: the server's message without its
/// source position, and what to do about a missing table.
fn database_error(error: &sqlx::Error) -> String {
    let sqlx::Error::Database(database) = error else {
        return error.to_string();
    };
    let missing_table = matches!(database.code().as_deref(), Some("42P01" | "42S02"))
        || database.message().contains("no such table");
    if missing_table {
        return format!(
            "{}: the key table is not in this database; run the app's \
             `Idempotency::migrate()` once, or apply `idem migration <backend>` with your \
             migration tool (check --table and the database in the URL)",
            database.message()
        );
    }
    database.message().to_owned()
}

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let mut cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(error) => error.exit(),
    };
    let mut source = match matches.value_source("database_url") {
        Some(ValueSource::EnvVariable) => "the environment's DATABASE_URL".to_owned(),
        _ => "--database-url".to_owned(),
    };
    if cli.database_url.is_none() {
        match dotenv_database_url() {
            Ok(Some((url, file))) => {
                cli.database_url = Some(url);
                source = format!("DATABASE_URL in {}", file.display());
            }
            Ok(None) => {}
            // `migration` needs no database, nor a readable `.env`.
            Err(_) if matches!(cli.command, Command::Migration { .. }) => {}
            Err(message) => {
                eprintln!("idem: {message}");
                return ExitCode::from(2);
            }
        }
    }
    let database = cli
        .database_url
        .as_deref()
        .map(|url| format!("{} (from {source})", redacted(url)));
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("idem: {error}");
            return ExitCode::from(1);
        }
    };
    let (code, message) = match runtime.block_on(run(cli)) {
        Ok(output) => {
            print!("{output}");
            return ExitCode::SUCCESS;
        }
        Err(Fail::Failed(message)) => (1, message),
        Err(Fail::Usage(message)) => (2, message),
        Err(Fail::Busy(message)) => (3, message),
    };
    eprintln!("idem: {message}");
    if code != 2
        && let Some(database) = database
    {
        eprintln!("idem: database: {database}");
    }
    ExitCode::from(code)
}

/// `DATABASE_URL` from the first `.env` file in the current directory or above it,
/// parsed as sqlx-cli parses it (quotes, escapes, multi-line values, `${VAR}`
/// expansion), with the file it came from. The environment is left as it is.
fn dotenv_database_url() -> Result<Option<(String, PathBuf)>, String> {
    let Ok(start) = std::env::current_dir() else {
        return Ok(None);
    };
    let Some(file) = start
        .ancestors()
        .map(|dir| dir.join(".env"))
        .find(|path| path.is_file())
    else {
        return Ok(None);
    };
    let unreadable = |error: dotenvy::Error| format!("{}: {error}", file.display());
    for item in dotenvy::from_path_iter(&file).map_err(unreadable)? {
        let (name, value) = item.map_err(unreadable)?;
        if name == "DATABASE_URL" {
            return Ok(Some((value, file)));
        }
    }
    Ok(None)
}

/// `url` with its password elided, for messages: in the authority
/// (`user:secret@host`) and in a `password=` parameter.
fn redacted(url: &str) -> String {
    let mut out = url.to_owned();
    if let Some(start) = out.find("://").map(|at| at + 3) {
        let end = out[start..]
            .find(['/', '?'])
            .map_or(out.len(), |at| start + at);
        if let Some(at) = out[start..end].rfind('@').map(|at| start + at)
            && let Some(colon) = out[start..at].find(':').map(|c| start + c)
        {
            out.replace_range(colon + 1..at, "***");
        }
    }
    if let Some(query) = out.find('?') {
        let mut params: Vec<String> = out[query + 1..].split('&').map(str::to_owned).collect();
        for param in &mut params {
            if param.starts_with("password=") {
                *param = "password=***".to_owned();
            }
        }
        out = format!("{}?{}", &out[..query], params.join("&"));
    }
    out
}

/// A pool on `url`, after one connection was made: a server that refuses or does
/// not answer fails at once, not after the pool's acquire timeout.
async fn connect<DB: Database>(url: &str) -> Result<Pool<DB>, Fail> {
    const CONNECT: Duration = Duration::from_secs(10);
    let unreachable =
        |message: String| Fail::Failed(format!("cannot reach the database: {message}"));
    match tokio::time::timeout(CONNECT, DB::Connection::connect(url)).await {
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
        }
        Ok(Err(error)) => return Err(unreachable(database_error(&error))),
        Err(_) => {
            return Err(unreachable(format!(
                "no answer within {} s",
                CONNECT.as_secs()
            )));
        }
    }
    Ok(PoolOptions::<DB>::new()
        .max_connections(2)
        .acquire_timeout(CONNECT)
        .connect(url)
        .await?)
}

async fn run(cli: Cli) -> Result<String, Fail> {
    let Cli {
        database_url,
        table,
        partitioned,
        seal_keys_file,
        seal_context,
        command,
    } = cli;
    if let Command::Migration { backend, since } = command {
        let steps = match backend {
            BackendName::Postgres => migration_steps::<Postgres>(&table, partitioned),
            BackendName::Mysql | BackendName::Sqlite if partitioned => {
                return Err(Fail::Usage(
                    "only PostgreSQL has the partitioned layout".into(),
                ));
            }
            BackendName::Mysql => migration_steps::<MySql>(&table, false),
            BackendName::Sqlite => migration_steps::<Sqlite>(&table, false),
        };
        let since = since.unwrap_or(0);
        let latest = steps.last().map_or(0, |(version, _)| *version);
        if since > latest {
            return Err(Fail::Usage(format!(
                "--since {since}: the latest version is {latest}"
            )));
        }
        let mut out = String::new();
        for (version, sql) in steps.iter().filter(|(version, _)| *version > since) {
            let _ = writeln!(out, "-- idem migration {version:04}\n{}\n", sql.trim_end());
        }
        if out.is_empty() {
            let _ = writeln!(out, "-- nothing after version {since:04}: up to date");
        }
        return Ok(out);
    }
    let ring = key_ring(seal_keys_file.as_deref())?
        .map(|ring| ring.with_context(seal_context.unwrap_or_default()));
    // `reseal` writes under the ring's first key; every other command only opens.
    let sealing = match (ring, &command) {
        (Some(ring), Command::Reseal { .. }) => Sealing::On(ring),
        (Some(ring), _) => Sealing::OpensSealed(ring),
        (None, Command::Reseal { .. } | Command::Audit { .. }) => {
            return Err(Fail::Usage(
                "reseal and audit need the key ring: set IDEM_SEAL_KEYS, or pass \
                 --seal-keys-file"
                    .into(),
            ));
        }
        (None, _) => Sealing::Off,
    };
    let url = database_url.ok_or_else(|| {
        Fail::Usage("no database: pass --database-url, or set DATABASE_URL (or in .env)".into())
    })?;
    if url.starts_with("postgres:") || url.starts_with("postgresql:") {
        let pool = connect::<Postgres>(&url).await?;
        let mut builder = Idempotency::builder(pool).table(&table).sealing(sealing);
        if partitioned {
            builder = builder.partitioned_by_day();
        }
        let store = builder.build()?;
        if let Command::Partitions { ahead } = command {
            if !partitioned {
                return Err(Fail::Usage(
                    "partitions work on tables of the partitioned layout: pass --partitioned"
                        .into(),
                ));
            }
            return partitions(&store, ahead).await;
        }
        let listing = matches!(command, Command::List { .. });
        let mut out = dispatch(&store, command).await?;
        if listing {
            out.push_str(&open_claims(store.pool()).await?);
        }
        Ok(out)
    } else if url.starts_with("mysql:") || url.starts_with("mariadb:") {
        let pool = connect::<MySql>(&url.replacen("mariadb:", "mysql:", 1)).await?;
        let store = Idempotency::builder(pool)
            .table(&table)
            .sealing(sealing)
            .build()?;
        dispatch(&store, command).await
    } else if url.starts_with("sqlite:") {
        let pool = connect::<Sqlite>(&url).await?;
        let store = Idempotency::builder(pool)
            .table(&table)
            .sealing(sealing)
            .build()?;
        dispatch(&store, command).await
    } else {
        Err(Fail::Usage(format!(
            "unsupported database URL {url}: postgres://, mysql:// or sqlite://"
        )))
    }
}

async fn dispatch<DB: Backend>(store: &Idempotency<DB>, command: Command) -> Result<String, Fail> {
    match command {
        Command::List {
            stuck,
            scope,
            limit,
        } => list(store, stuck, scope.as_deref(), limit).await,
        Command::Show { scope, key } => show(store, &scope, &key).await,
        Command::Forget { scope, key } => forget(store, &scope, &key).await,
        Command::Sweep {
            batch,
            budget,
            pause,
        } => {
            let settings = Sweep::new()
                .batch(batch)
                .budget(Duration::from_secs(budget))
                .pause(Duration::from_millis(pause));
            sweep(store, settings).await
        }
        Command::Reseal {
            batch,
            budget,
            pause,
            plain,
        } => {
            let settings = Reseal::new()
                .batch(batch)
                .budget(Duration::from_secs(budget))
                .pause(Duration::from_millis(pause))
                .plain(plain);
            reseal(store, settings).await
        }
        Command::Audit { batch } => audit(store, batch).await,
        Command::Partitions { .. } => Err(Fail::Usage(
            "partitions need a PostgreSQL table of the partitioned layout".into(),
        )),
        Command::Migration { .. } => Err(Fail::Usage("migration needs no database".into())),
    }
}

/// What PostgreSQL lets `list` know of claims it cannot show: a claim lives in its
/// transaction until it commits, and only its advisory locks are visible meanwhile
/// (not which key they lock). A claim takes a key's transaction lock and, unless
/// the store goes through a transaction pooler, its session lock on the same 64
/// bits: a session holding both is idem's. Other advisory locks are counted apart.
async fn open_claims(pool: &Pool<Postgres>) -> Result<String, Fail> {
    let (claims, others, oldest): (i64, i64, Option<f64>) = sqlx::query_as(
        "WITH held AS ( \
             SELECT l.pid, l.classid, l.objid, l.objsubid, \
                    extract(epoch FROM clock_timestamp() - a.xact_start)::float8 AS open \
             FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE l.locktype = 'advisory' AND l.granted AND l.pid <> pg_backend_pid() \
               AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
               AND a.xact_start IS NOT NULL), \
         claims AS ( \
             SELECT t.pid, t.open FROM held t JOIN held s \
               ON s.pid = t.pid AND s.classid = t.classid AND s.objid = t.objid \
              AND t.objsubid = 1 AND s.objsubid = 2) \
         SELECT (SELECT count(*) FROM claims), \
                (SELECT count(DISTINCT pid) FROM held WHERE pid NOT IN (SELECT pid FROM claims)), \
                (SELECT max(open) FROM held)",
    )
    .fetch_one(pool)
    .await?;
    let mut out = String::from(
        "PostgreSQL keeps a claim in its transaction until it commits: the table shows \
         committed claims only.\n",
    );
    if claims + others == 0 {
        out.push_str(
            "In flight now: no session of this database holds an advisory lock in a \
             transaction, so no claim is in flight.\n",
        );
        return Ok(out);
    }
    let oldest = millis((oldest.unwrap_or(0.0) * 1000.0) as i64);
    let _ = writeln!(
        out,
        "In flight now: {claims} claim(s) (a key's transaction and session locks held \
         together); {others} other session(s) of this database hold advisory locks in an \
         open transaction (through a transaction pooler a claim takes only the transaction \
         lock, so it is counted there). The oldest transaction has been open for {oldest}. \
         The server ends a claim's transaction at its lock, so one open longer than your \
         longest `lock` is not idem's; `idem show` tells whether one key is in flight."
    );
    Ok(out)
}

async fn list<DB: Backend>(
    store: &Idempotency<DB>,
    stuck: bool,
    scope: Option<&str>,
    limit: u32,
) -> Result<String, Fail> {
    let claims = store.claims(scope, stuck, limit).await?;
    let mut out = String::new();
    if claims.is_empty() {
        out.push_str(if stuck {
            "no stuck claim in the table\n"
        } else {
            "no claim in the table is in flight\n"
        });
        return Ok(out);
    }
    let _ = writeln!(
        out,
        "{:<20} {:<36} {:<7} {:<24} {:>10} {:>12}",
        "SCOPE", "KEY", "METHOD", "PATH", "AGE", "LOCK LEFT"
    );
    for claim in &claims {
        let _ = writeln!(
            out,
            "{:<20} {:<36} {:<7} {:<24} {:>10} {:>12}{}",
            claim.scope,
            claim.key,
            claim.method,
            claim.path,
            millis(claim.age_ms),
            millis(claim.lock_left_ms),
            if claim.is_stuck() { "  stuck" } else { "" },
        );
    }
    Ok(out)
}

async fn forget<DB: Backend>(
    store: &Idempotency<DB>,
    scope: &str,
    key: &str,
) -> Result<String, Fail> {
    match store.forget(scope, key).await? {
        Forgotten::Deleted => Ok(format!(
            "forgot {key} in scope {scope}: its next request runs the handler again \
             (running instances may replay it until their replay cache refreshes, \
             30 s by default)\n"
        )),
        Forgotten::NotFound => Err(Fail::Failed(format!(
            "scope {scope:?} holds no record of {key:?}: nothing deleted"
        ))),
        Forgotten::InFlight => {
            let holder = store.in_flight(scope, key).await?;
            let mut message = format!("{key} in scope {scope} is in flight: nothing deleted");
            if let Some(holder) = &holder {
                let _ = write!(message, " ({})", executing(holder));
            }
            message.push_str(
                ". Forget it once it has completed (`idem show` tells); its executor's \
                 record must not be deleted under it.",
            );
            Err(Fail::Busy(message))
        }
        Forgotten::Changed => Err(Fail::Busy(format!(
            "{key} in scope {scope} was recorded anew while being deleted: nothing \
             deleted. Look at it again with `idem show`."
        ))),
        other => Err(Fail::Busy(format!("{key} in scope {scope}: {other}"))),
    }
}

/// What is known of the executor holding a key, as a phrase.
fn executing(holder: &InFlight) -> String {
    let mut parts = Vec::new();
    if let Some(session) = holder.session {
        parts.push(format!("executing in database session {session}"));
    }
    match holder.age_ms {
        Some(age) => parts.push(format!("for {}", millis(age))),
        None if holder.session.is_some() => {
            parts.push("for a time the database does not show this role".to_owned());
        }
        None => {}
    }
    match holder.lock_left_ms {
        Some(left) if left <= 0 => parts.push(format!(
            "its lock passed {} ago: stuck, the next request takes it over",
            millis(-left)
        )),
        Some(left) => parts.push(format!("lock left {}", millis(left))),
        None => {}
    }
    if parts.is_empty() {
        "claimed".to_owned()
    } else {
        parts.join(", ")
    }
}

async fn show<DB: Backend>(
    store: &Idempotency<DB>,
    scope: &str,
    key: &str,
) -> Result<String, Fail> {
    let mut out = String::new();
    let record = store.inspect(scope, key).await?;
    let holder = store.in_flight(scope, key).await?;
    if let Some(record) = &record {
        describe(&mut out, record);
    }
    if let Some(holder) = &holder {
        if record.is_none() {
            let _ = writeln!(out, "scope:       {scope}");
            let _ = writeln!(out, "key:         {key}");
        }
        let _ = writeln!(out, "in flight:   yes, {}", executing(holder));
        match &record {
            None => {
                out.push_str("             its record is written when its transaction commits\n")
            }
            Some(record) if record.state == "completed" && record.expires_in_ms <= 0 => {
                out.push_str("             the record above expired: this execution replaces it\n")
            }
            Some(_) => {}
        }
    }
    let others = store.other_scopes(scope, key).await?;
    let note = (!others.is_empty()).then(|| {
        format!(
            "note: {} other scope(s) hold a key {key:?} (not shown): {}",
            others.len(),
            others.join(", ")
        )
    });
    if record.is_none() && holder.is_none() {
        let mut message = format!("scope {scope:?} holds no key {key:?}, and none is in flight");
        if let Some(note) = note {
            message = format!("{message}\n{note}");
        }
        return Err(Fail::Failed(message));
    }
    if let Some(note) = note {
        let _ = writeln!(out, "{note}");
    }
    Ok(out)
}

fn describe(out: &mut String, record: &KeyRecord) {
    let _ = writeln!(out, "scope:       {}", record.scope);
    let _ = writeln!(out, "key:         {}", record.key);
    let _ = writeln!(
        out,
        "state:       {}{}",
        record.state,
        if record.is_stuck() {
            " (stuck: lock passed)"
        } else {
            ""
        }
    );
    let _ = writeln!(out, "request:     {} {}", record.method, record.path);
    if let Some(status) = record.status {
        let _ = writeln!(out, "status:      {status}");
    }
    if let Some(id) = record.sealed_by {
        let _ = writeln!(out, "sealed:      under key {id}");
    }
    if let Some(why) = &record.unreadable {
        let _ = writeln!(out, "not replayed: {why}");
        if record.sealed_by.is_some() && record.body.is_empty() {
            out.push_str(
                "             (IDEM_SEAL_KEYS or --seal-keys-file give the ring that opens it)\n",
            );
        }
    }
    let _ = writeln!(out, "age:         {}", millis(record.age_ms));
    // A lock means something only while the key is claimed.
    if record.state == "processing" {
        let _ = writeln!(out, "lock left:   {}", millis(record.lock_left_ms));
    }
    let _ = writeln!(out, "expires in:  {}", millis(record.expires_in_ms));
    if !record.headers.is_empty() {
        out.push_str("headers:\n");
        for line in String::from_utf8_lossy(&record.headers).lines() {
            let _ = writeln!(out, "  {line}");
        }
    }
    let unopened = record.sealed_by.is_some() && record.unreadable.is_some();
    if record.state == "completed" && !unopened {
        let _ = writeln!(out, "body ({} bytes):", record.body.len());
        let _ = writeln!(out, "  {}", String::from_utf8_lossy(&record.body));
    }
}

/// The key ring from `--seal-keys-file` or `IDEM_SEAL_KEYS`, if either is given.
/// Its text is cleared from memory once the ring is built.
fn key_ring(file: Option<&std::path::Path>) -> Result<Option<KeyRing>, Fail> {
    let text = match file {
        Some(path) => {
            private(path)?;
            let text =
                Zeroizing::new(std::fs::read_to_string(path).map_err(|e| {
                    Fail::Usage(format!("--seal-keys-file {}: {e}", path.display()))
                })?);
            // The one newline an editor or `echo` leaves; anything else is refused.
            let trimmed = text.strip_suffix('\n').unwrap_or(&text);
            Some(Zeroizing::new(
                trimmed.strip_suffix('\r').unwrap_or(trimmed).to_owned(),
            ))
        }
        None => match std::env::var("IDEM_SEAL_KEYS") {
            Ok(text) => Some(Zeroizing::new(text)),
            Err(std::env::VarError::NotPresent) => None,
            Err(error) => return Err(Fail::Usage(format!("IDEM_SEAL_KEYS: {error}"))),
        },
    };
    text.map(|text| KeyRing::from_base64(&text).map_err(|e| Fail::Usage(e.to_string())))
        .transpose()
}

/// A key file others can read is refused, as ssh refuses a private key: the keys
/// must be the owner's alone (`chmod 600`).
#[cfg(unix)]
fn private(path: &std::path::Path) -> Result<(), Fail> {
    use std::os::unix::fs::PermissionsExt as _;
    let mode = std::fs::metadata(path)
        .map_err(|e| Fail::Usage(format!("--seal-keys-file {}: {e}", path.display())))?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        return Err(Fail::Usage(format!(
            "--seal-keys-file {}: its permissions {:04o} let others read the keys; \
             make it the owner's alone (chmod 600)",
            path.display(),
            mode & 0o7777
        )));
    }
    Ok(())
}

#[cfg(not(unix))]
fn private(_path: &std::path::Path) -> Result<(), Fail> {
    Ok(())
}

async fn reseal<DB: Backend>(store: &Idempotency<DB>, settings: Reseal) -> Result<String, Fail> {
    let report = store.reseal(settings).await?;
    let mut out = format!(
        "read {} records: {} sealed anew, {} already current, {} in plain text left, \
         {} unreadable left, {} replaced meanwhile; {:.1} s\n",
        report.read,
        report.resealed,
        report.current,
        report.plain,
        report.unreadable,
        report.changed,
        report.elapsed.as_secs_f64(),
    );
    if !report.caught_up {
        out.push_str("budget spent: more remain, run it again\n");
    } else if report.unreadable > 0 {
        out.push_str(
            "records that do not open with this ring remain: keep the old keys until they \
             expire, or restore the key they name (idem show)\n",
        );
    } else {
        out.push_str("caught up: `idem audit` tells which of the other keys may leave the ring\n");
    }
    Ok(out)
}

async fn audit<DB: Backend>(store: &Idempotency<DB>, batch: u32) -> Result<String, Fail> {
    let audit = store.audit(batch).await?;
    let mut out = String::new();
    for (n, used) in audit.keys.iter().enumerate() {
        let place = match (n, used.in_ring) {
            (0, true) => "first in the ring",
            (_, true) => "in the ring",
            (_, false) => "not in the ring",
        };
        let _ = write!(
            out,
            "key {} ({place}): {} records, {} claims, {} ended",
            used.id, used.records, used.claims, used.ended
        );
        if let Some(left) = used.ended_expire_within {
            let _ = write!(out, " (the last expires in {} s)", left.as_secs());
        }
        out.push_str(match (n, used.in_ring, used.unused()) {
            (0, true, _) => "\n",
            (_, true, true) => ": may leave once the longest lock has passed\n",
            (_, true, false) if used.records > 0 => ": needed; run idem reseal\n",
            (_, true, false) => ": needed until its claims end and its ended rows expire\n",
            // Nothing here can open or move them.
            (_, false, _) => {
                ": its records answer record-unreadable until it is back in the ring or they \
                 expire\n"
            }
        });
    }
    let _ = writeln!(
        out,
        "{} records in plain text; {} rows without a response keyed under no key of the ring; \
         read {} rows in {:.1} s",
        audit.plain,
        audit.unkeyed,
        audit.read,
        audit.elapsed.as_secs_f64()
    );
    Ok(out)
}

async fn sweep<DB: Backend>(store: &Idempotency<DB>, settings: Sweep) -> Result<String, Fail> {
    let report = store.sweep(settings).await?;
    Ok(format!(
        "deleted {} expired keys in {} batches, {:.1} s{}\n",
        report.deleted,
        report.batches,
        report.elapsed.as_secs_f64(),
        if report.caught_up {
            ""
        } else {
            " (budget spent: more remain)"
        }
    ))
}

async fn partitions(store: &Idempotency<Postgres>, ahead: u32) -> Result<String, Fail> {
    let changed = store.maintain_partitions(ahead).await?;
    let mut out = String::new();
    for name in &changed.created {
        let _ = writeln!(out, "created {name}");
    }
    for name in &changed.dropped {
        let _ = writeln!(out, "dropped {name}");
    }
    if out.is_empty() {
        out.push_str("partitions already in shape\n");
    }
    Ok(out)
}

fn millis(ms: i64) -> String {
    let sign = if ms < 0 { "-" } else { "" };
    let ms = ms.unsigned_abs();
    if ms < 1_000 {
        format!("{sign}{ms}ms")
    } else if ms < 120_000 {
        format!("{sign}{:.1}s", ms as f64 / 1e3)
    } else if ms < 7_200_000 {
        format!("{sign}{}m", ms / 60_000)
    } else {
        format!("{sign}{}h", ms / 3_600_000)
    }
}
