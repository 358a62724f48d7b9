//! `idem`: the operator's view of an idempotency-key table.
//!
//! ```text
//! idem list --stuck                      # claims whose lock has passed
//! idem show --scope user-7 order-42      # one key's record in one scope
//! idem sweep --batch 500                 # delete expired keys now
//! idem partitions --ahead 7              # PostgreSQL, partitioned layout
//! ```

use std::fmt::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use idem_runtime::{Backend, Idempotency, KeyRecord, Sweep};
use sqlx::{MySql, Pool, Postgres, Sqlite};

const USAGE: &str = "\
idem: the operator's view of an idempotency-key table

usage: idem [--database-url URL] [--table NAME] [--partitioned] <command> [options]

commands:
  list         claims in flight (processing), oldest first
  show         one key's record in one scope
  sweep        delete expired keys now
  partitions   create the days ahead and drop ended days (PostgreSQL, partitioned layout)

global options:
  --database-url URL   postgres://, mysql:// or sqlite:// (default: $DATABASE_URL)
  --table NAME         the key table (default: idempotency_keys)
  --partitioned        the table uses the PostgreSQL layout partitioned by day
  -h, --help           this text; `idem <command> --help` for a command's
";

const LIST: &str = "\
usage: idem list [--stuck] [--scope SCOPE] [--limit N]

Lists claims in flight (processing rows), oldest first: scope, key, method, path,
age, and the time left on the lock (negative: the lock has passed and the next
retry takes the key over). On PostgreSQL and MySQL a claim whose transaction is
still open is not visible yet.

  --stuck          only claims whose lock has passed
  --scope SCOPE    only this scope
  --limit N        at most N rows (default 50)
";

const SHOW: &str = "\
usage: idem show --scope SCOPE KEY

Shows what SCOPE holds under KEY: state, request, status, times, stored headers
and body. Another scope's record is never shown: if other scopes hold the same
key, they are only named.
";

const SWEEP: &str = "\
usage: idem sweep [--batch N] [--budget SECONDS] [--pause MS]

Deletes completed keys whose ttl has passed, in batches (default 500 rows, for at
most 60 seconds). Claims in flight are never deleted.
";

const PARTITIONS: &str = "\
usage: idem --partitioned partitions [--ahead DAYS]

Creates the day partitions for today and the next DAYS days (default 7) and drops
every day partition whose day has ended. PostgreSQL tables of the partitioned
layout only.
";

/// A failure worth a message and exit status 2.
struct Fail(String);

impl<E: std::fmt::Display> From<E> for Fail {
    fn from(error: E) -> Self {
        Fail(error.to_string())
    }
}

struct Global {
    url: Option<String>,
    table: String,
    partitioned: bool,
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
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
    match runtime.block_on(run(args)) {
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

async fn run(args: Vec<String>) -> Result<String, Fail> {
    let mut global = Global {
        url: std::env::var("DATABASE_URL").ok(),
        table: idem_runtime::DEFAULT_TABLE.to_owned(),
        partitioned: false,
    };
    let mut rest = args.into_iter();
    let command = loop {
        match rest.next().as_deref() {
            None | Some("-h" | "--help" | "help") => return Ok(USAGE.to_owned()),
            Some("--database-url") => global.url = Some(value(&mut rest, "--database-url")?),
            Some("--table") => global.table = value(&mut rest, "--table")?,
            Some("--partitioned") => global.partitioned = true,
            Some(other) if other.starts_with('-') => {
                return Err(Fail(format!("unknown option {other}\n\n{USAGE}")));
            }
            Some(command) => break command.to_owned(),
        }
    };
    let args: Vec<String> = rest.collect();
    let help = match command.as_str() {
        "list" => LIST,
        "show" => SHOW,
        "sweep" => SWEEP,
        "partitions" => PARTITIONS,
        other => return Err(Fail(format!("unknown command {other}\n\n{USAGE}"))),
    };
    if args.iter().any(|a| a == "-h" || a == "--help") {
        return Ok(help.to_owned());
    }
    let url = global
        .url
        .clone()
        .ok_or_else(|| Fail("no database: pass --database-url or set DATABASE_URL".into()))?;
    if url.starts_with("postgres:") || url.starts_with("postgresql:") {
        let pool = Pool::<Postgres>::connect(&url).await?;
        let mut builder = Idempotency::builder(pool).table(&global.table);
        if global.partitioned {
            builder = builder.partitioned_by_day();
        }
        let store = builder.build()?;
        if command == "partitions" {
            if !global.partitioned {
                return Err(Fail(
                    "partitions work on tables of the partitioned layout: pass --partitioned"
                        .into(),
                ));
            }
            return partitions(&store, &args, help).await;
        }
        dispatch(&store, &command, &args, help).await
    } else if url.starts_with("mysql:") || url.starts_with("mariadb:") {
        let pool = Pool::<MySql>::connect(&url.replacen("mariadb:", "mysql:", 1)).await?;
        let store = Idempotency::builder(pool).table(&global.table).build()?;
        dispatch(&store, &command, &args, help).await
    } else if url.starts_with("sqlite:") {
        let pool = Pool::<Sqlite>::connect(&url).await?;
        let store = Idempotency::builder(pool).table(&global.table).build()?;
        dispatch(&store, &command, &args, help).await
    } else {
        Err(Fail(format!(
            "unsupported database URL {url}: postgres://, mysql:// or sqlite://"
        )))
    }
}

fn value(args: &mut impl Iterator<Item = String>, option: &str) -> Result<String, Fail> {
    args.next()
        .ok_or_else(|| Fail(format!("{option} needs a value")))
}

fn number(args: &mut impl Iterator<Item = String>, option: &str) -> Result<u64, Fail> {
    let text = value(args, option)?;
    text.parse()
        .map_err(|_| Fail(format!("{option} takes a whole number, not {text:?}")))
}

async fn dispatch<DB: Backend>(
    store: &Idempotency<DB>,
    command: &str,
    args: &[String],
    help: &str,
) -> Result<String, Fail> {
    match command {
        "list" => list(store, args, help).await,
        "show" => show(store, args, help).await,
        "sweep" => sweep(store, args, help).await,
        _ => Err(Fail(
            "partitions need a PostgreSQL table of the partitioned layout".into(),
        )),
    }
}

async fn list<DB: Backend>(
    store: &Idempotency<DB>,
    args: &[String],
    help: &str,
) -> Result<String, Fail> {
    let (mut stuck, mut scope, mut limit) = (false, None, 50);
    let mut args = args.iter().cloned();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--stuck" => stuck = true,
            "--scope" => scope = Some(value(&mut args, "--scope")?),
            "--limit" => limit = u32::try_from(number(&mut args, "--limit")?).unwrap_or(u32::MAX),
            other => return Err(Fail(format!("unexpected {other}\n\n{help}"))),
        }
    }
    let claims = store.claims(scope.as_deref(), stuck, limit).await?;
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

async fn show<DB: Backend>(
    store: &Idempotency<DB>,
    args: &[String],
    help: &str,
) -> Result<String, Fail> {
    let (mut scope, mut key) = (None, None);
    let mut args = args.iter().cloned();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--scope" => scope = Some(value(&mut args, "--scope")?),
            other if !other.starts_with('-') && key.is_none() => key = Some(other.to_owned()),
            other => return Err(Fail(format!("unexpected {other}\n\n{help}"))),
        }
    }
    let (Some(scope), Some(key)) = (scope, key) else {
        return Err(Fail(format!("show needs --scope and a key\n\n{help}")));
    };
    let mut out = String::new();
    match store.inspect(&scope, &key).await? {
        Some(record) => describe(&mut out, &record),
        None => {
            let _ = writeln!(out, "scope {scope:?} holds no key {key:?}");
        }
    }
    let others = store.other_scopes(&scope, &key).await?;
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

async fn sweep<DB: Backend>(
    store: &Idempotency<DB>,
    args: &[String],
    help: &str,
) -> Result<String, Fail> {
    let mut settings = Sweep::new().budget(Duration::from_secs(60));
    let mut args = args.iter().cloned();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--batch" => {
                let rows = number(&mut args, "--batch")?;
                settings = settings.batch(u32::try_from(rows).unwrap_or(u32::MAX));
            }
            "--budget" => {
                settings = settings.budget(Duration::from_secs(number(&mut args, "--budget")?))
            }
            "--pause" => {
                settings = settings.pause(Duration::from_millis(number(&mut args, "--pause")?))
            }
            other => return Err(Fail(format!("unexpected {other}\n\n{help}"))),
        }
    }
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

async fn partitions(
    store: &Idempotency<Postgres>,
    args: &[String],
    help: &str,
) -> Result<String, Fail> {
    let mut ahead = 7;
    let mut args = args.iter().cloned();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--ahead" => ahead = u32::try_from(number(&mut args, "--ahead")?).unwrap_or(u32::MAX),
            other => return Err(Fail(format!("unexpected {other}\n\n{help}"))),
        }
    }
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
