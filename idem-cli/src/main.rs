//! `idem`: the operator's view of an idempotency-key table.
//!
//! ```text
//! idem list --stuck                      # claims whose lock has passed
//! idem show --scope user-7 order-42      # one key's record in one scope
//! idem forget --scope user-7 order-42    # its next request runs again
//! idem sweep --batch 500                 # delete expired keys now
//! idem --partitioned partitions --ahead 7   # PostgreSQL, partitioned layout
//! idem migration postgres > migrations/20261201_idempotency_keys.sql
//! ```

use std::fmt::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use idem_runtime::{Backend, DEFAULT_TABLE, Idempotency, KeyRecord, Sweep, migration_sql};
use sqlx::{MySql, Pool, Postgres, Sqlite};

/// The operator's view of an idempotency-key table.
#[derive(Parser)]
#[command(name = "idem", version)]
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
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Claims in flight (processing), oldest first.
    ///
    /// Scope, key, method, path, age, and the time left on the lock (negative: the
    /// lock has passed and the next retry takes the key over). On PostgreSQL and
    /// MySQL a claim whose transaction is still open is not visible yet.
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
    /// One key's record in one scope.
    ///
    /// State, request, status, times, stored headers and body. Another scope's
    /// record is never shown: if other scopes hold the same key, they are only named.
    Show {
        /// The scope the key belongs to.
        #[arg(long)]
        scope: String,
        /// The Idempotency-Key.
        key: String,
    },
    /// Delete one completed key, so that its next request runs the handler again.
    ///
    /// For a response that must not be replayed any more. A claim in flight is never
    /// deleted. Running instances keep replaying their copy in memory until their
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
    /// `--partitioned` on PostgreSQL). Needs no database.
    Migration {
        /// The database the SQL is for.
        backend: BackendName,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum BackendName {
    Postgres,
    Mysql,
    Sqlite,
}

/// A failure worth a message and exit status 2.
struct Fail(String);

impl<E: std::fmt::Display> From<E> for Fail {
    fn from(error: E) -> Self {
        Fail(error.to_string())
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("idem: {error}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(output) => {
            print!("{output}");
            ExitCode::SUCCESS
        }
        Err(Fail(message)) => {
            eprintln!("idem: {message}");
            ExitCode::from(2)
        }
    }
}

async fn run(cli: Cli) -> Result<String, Fail> {
    let Cli {
        database_url,
        table,
        partitioned,
        command,
    } = cli;
    if let Command::Migration { backend } = command {
        let sql = match backend {
            BackendName::Postgres => migration_sql::<Postgres>(&table, partitioned),
            BackendName::Mysql if partitioned => {
                return Err(Fail("only PostgreSQL has the partitioned layout".into()));
            }
            BackendName::Mysql => migration_sql::<MySql>(&table, false),
            BackendName::Sqlite if partitioned => {
                return Err(Fail("only PostgreSQL has the partitioned layout".into()));
            }
            BackendName::Sqlite => migration_sql::<Sqlite>(&table, false),
        };
        return Ok(format!("{}\n", sql.trim_end()));
    }
    let url = database_url
        .ok_or_else(|| Fail("no database: pass --database-url or set DATABASE_URL".into()))?;
    if url.starts_with("postgres:") || url.starts_with("postgresql:") {
        let pool = Pool::<Postgres>::connect(&url).await?;
        let mut builder = Idempotency::builder(pool).table(&table);
        if partitioned {
            builder = builder.partitioned_by_day();
        }
        let store = builder.build()?;
        if let Command::Partitions { ahead } = command {
            if !partitioned {
                return Err(Fail(
                    "partitions work on tables of the partitioned layout: pass --partitioned"
                        .into(),
                ));
            }
            return partitions(&store, ahead).await;
        }
        dispatch(&store, command).await
    } else if url.starts_with("mysql:") || url.starts_with("mariadb:") {
        let pool = Pool::<MySql>::connect(&url.replacen("mariadb:", "mysql:", 1)).await?;
        let store = Idempotency::builder(pool).table(&table).build()?;
        dispatch(&store, command).await
    } else if url.starts_with("sqlite:") {
        let pool = Pool::<Sqlite>::connect(&url).await?;
        let store = Idempotency::builder(pool).table(&table).build()?;
        dispatch(&store, command).await
    } else {
        Err(Fail(format!(
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
        Command::Partitions { .. } => Err(Fail(
            "partitions need a PostgreSQL table of the partitioned layout".into(),
        )),
        Command::Migration { .. } => Err(Fail("migration needs no database".into())),
    }
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
            "no stuck claims\n"
        } else {
            "no claims in flight\n"
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
    if store.forget(scope, key).await? {
        return Ok(format!(
            "forgot {key} in scope {scope}: its next request runs the handler again \
             (running instances may replay it until their replay cache refreshes, \
             30 s by default)\n"
        ));
    }
    match store.inspect(scope, key).await? {
        Some(record) if record.state == "processing" => Err(Fail(format!(
            "{key} in scope {scope} is in flight, not completed: not deleted"
        ))),
        _ => Err(Fail(format!(
            "no completed record of {key} in scope {scope}"
        ))),
    }
}

async fn show<DB: Backend>(
    store: &Idempotency<DB>,
    scope: &str,
    key: &str,
) -> Result<String, Fail> {
    let mut out = String::new();
    match store.inspect(scope, key).await? {
        Some(record) => describe(&mut out, &record),
        None => {
            let _ = writeln!(out, "scope {scope:?} holds no key {key:?}");
        }
    }
    let others = store.other_scopes(scope, key).await?;
    if !others.is_empty() {
        let _ = writeln!(
            out,
            "note: {} other scope(s) hold a key {key:?} (not shown): {}",
            others.len(),
            others.join(", ")
        );
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
    let _ = writeln!(out, "age:         {}", millis(record.age_ms));
    let _ = writeln!(out, "lock left:   {}", millis(record.lock_left_ms));
    let _ = writeln!(out, "expires in:  {}", millis(record.expires_in_ms));
    if !record.headers.is_empty() {
        out.push_str("headers:\n");
        for line in String::from_utf8_lossy(&record.headers).lines() {
            let _ = writeln!(out, "  {line}");
        }
    }
    if record.state == "completed" {
        let _ = writeln!(out, "body ({} bytes):", record.body.len());
        let _ = writeln!(out, "  {}", String::from_utf8_lossy(&record.body));
    }
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
