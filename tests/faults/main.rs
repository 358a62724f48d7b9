//! The fault suite: the invariants under crashes, hangs and database faults, with
//! real processes and real databases.
//!
//! ```text
//! cargo test --all-features --test faults                    # the bounded form CI runs
//! IDEM_FAULTS=full cargo test --all-features --test faults   # more keys, longer storms
//! IDEM_FAULTS_ONLY=hang cargo test --all-features --test faults   # one scenario: crash, sigterm, hang,
//!                                                  # killed, locked, pool, storm,
//!                                                  # hostile, rabbitmq, jetstream or restart
//! IDEM_FAULTS_RESTART=1 ...                   # lets it restart the database servers
//! IDEM_FAULTS_ONLY=failover cargo test --all-features --test faults
//!                  # PostgreSQL under Patroni, failed over (opt-in: needs root and
//!                  # the packages patroni, etcd-server and haproxy)
//! IDEM_FAULTS_ONLY=galera cargo test --all-features --test faults
//!                  # a Galera node killed mid-storm, a node cut off by a
//!                  # partition (`galera-partition` alone) and a node's clock
//!                  # 3 s ahead (`galera-skew` alone) (opt-in: needs the
//!                  # cluster that `bash .ci/galera` starts, and root)
//! ```
//!
//! Each scenario runs on PostgreSQL, MySQL/MariaDB and SQLite, each in a database of
//! its own, and fills one row of the table printed at the end: requests sent (every
//! attempt counted), business effects, provider charges, double effects. The run
//! fails on any double effect, lost record or unexpected answer. A server that
//! cannot be reached is SKIPPED, except under `CI=true`, where that fails too.
//!
//! The failover scenario (`failover.rs`) runs only when named: it builds a
//! replicated PostgreSQL of its own, once with synchronous replication and once
//! with asynchronous, and prints a table of its own.

#![allow(missing_docs, unreachable_pub)]

#[path = "../support/example.rs"]
mod example;

mod brokers;
mod cluster;
mod db;
mod failover;
mod galera;
mod proc;
mod scenarios;
mod server;

use std::process::ExitCode;
use std::time::Instant;

use db::{Backend, Fresh};
use scenarios::{Row, Scale};

fn main() -> ExitCode {
    if std::env::var_os(server::ROLE).is_some() {
        return server::main();
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("faults: {error}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(run())
}

#[derive(Clone, Copy)]
enum Scenario {
    Crash,
    Sigterm,
    Hang,
    SessionKilled,
    PoolExhausted,
    TwoInstances,
    Hostile,
    TableLocked,
    RabbitMq,
    JetStream,
    Restart,
}

impl Scenario {
    fn tag(self) -> &'static str {
        match self {
            Self::Crash => "crash",
            Self::Sigterm => "sigterm",
            Self::Hang => "hang",
            Self::SessionKilled => "killed",
            Self::PoolExhausted => "pool",
            Self::TwoInstances => "storm",
            Self::Hostile => "hostile",
            Self::TableLocked => "locked",
            Self::RabbitMq => "rabbitmq",
            Self::JetStream => "jetstream",
            Self::Restart => "restart",
        }
    }
}

async fn run_one(scenario: Scenario, backend: Backend, scale: &Scale) -> Option<Row> {
    let db = match Fresh::new(backend, scenario.tag()).await {
        Ok(db) => db,
        Err(error) => {
            let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
            if ci {
                let mut row = Row::new("setup", backend);
                row.problems.push(error);
                return Some(row);
            }
            eprintln!(
                "SKIPPED {}: {error}; CI=true makes this a failure",
                backend.name()
            );
            return None;
        }
    };
    let row = match scenario {
        Scenario::Crash => scenarios::crash(&db, scale).await,
        Scenario::Sigterm => scenarios::sigterm(&db).await,
        Scenario::Hang => scenarios::hang(&db).await,
        Scenario::SessionKilled => scenarios::session_killed(&db).await,
        Scenario::PoolExhausted => scenarios::pool_exhausted(&db).await,
        Scenario::TwoInstances => scenarios::two_instances(&db, scale).await,
        Scenario::Hostile => scenarios::hostile(&db).await,
        Scenario::TableLocked => scenarios::table_locked(&db).await,
        Scenario::RabbitMq => brokers::restarted(&db, brokers::Broker::RabbitMq).await,
        Scenario::JetStream => brokers::restarted(&db, brokers::Broker::JetStream).await,
        Scenario::Restart => scenarios::restart(&db).await,
    };
    db.drop_all().await;
    Some(row)
}

/// Runs a scenario (`None`: not on this machine), says how it went and in how
/// long, and keeps its row.
async fn timed(rows: &mut Vec<Row>, scenario: impl Future<Output = Option<Row>>) {
    let began = Instant::now();
    if let Some(row) = scenario.await {
        eprintln!(
            "{} on {}: {} in {:.1} s",
            row.scenario,
            row.backend.name(),
            row.result(),
            began.elapsed().as_secs_f64()
        );
        rows.push(row);
    }
}

async fn run() -> ExitCode {
    let scale = Scale::from_env();
    let only = std::env::var("IDEM_FAULTS_ONLY").ok();
    let started = Instant::now();
    let mut rows = Vec::new();
    if only.as_deref() == Some("failover") {
        for synchronous in [true, false] {
            timed(&mut rows, async {
                Some(failover::failover(synchronous).await)
            })
            .await;
        }
    } else {
        eprintln!(
            "failover: not run (IDEM_FAULTS_ONLY=failover runs it; needs patroni, etcd-server, haproxy)"
        );
    }
    if only.as_deref() == Some("galera") {
        timed(&mut rows, async { Some(galera::node_killed().await) }).await;
    }
    if matches!(only.as_deref(), Some("galera" | "galera-partition")) {
        timed(&mut rows, async { Some(galera::partitioned().await) }).await;
    }
    if matches!(only.as_deref(), Some("galera" | "galera-skew")) {
        timed(&mut rows, async { Some(galera::clock_skewed().await) }).await;
    }
    if !only
        .as_deref()
        .is_some_and(|only| only.starts_with("galera"))
    {
        eprintln!("galera: not run (IDEM_FAULTS_ONLY=galera runs it; needs `bash .ci/galera`)");
    }
    for scenario in [
        Scenario::Crash,
        Scenario::Sigterm,
        Scenario::Hang,
        Scenario::SessionKilled,
        Scenario::TableLocked,
        Scenario::PoolExhausted,
        Scenario::TwoInstances,
        Scenario::Hostile,
        // These restart the brokers and the database servers the others use.
        Scenario::RabbitMq,
        Scenario::JetStream,
        Scenario::Restart,
    ] {
        if only.as_deref().is_some_and(|only| only != scenario.tag()) {
            continue;
        }
        for backend in Backend::ALL {
            timed(&mut rows, run_one(scenario, backend, &scale)).await;
        }
    }

    println!(
        "\n| scenario | backend | requests | effects | charges | double effects | result | note |"
    );
    println!("| --- | --- | ---: | ---: | ---: | ---: | --- | --- |");
    for row in &rows {
        let charges = row.charges.map_or("-".to_owned(), |c| c.to_string());
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            row.scenario,
            row.backend.name(),
            row.requests,
            row.effects,
            charges,
            row.doubles,
            row.result(),
            row.note
        );
    }
    failover::print_table(&rows);
    println!(
        "\n{} rows in {:.0} s",
        rows.len(),
        started.elapsed().as_secs_f64()
    );
    let mut failed = false;
    for row in &rows {
        for problem in &row.problems {
            failed = true;
            println!(
                "FAILED {} on {}: {problem}",
                row.scenario,
                row.backend.name()
            );
        }
        if row.doubles > 0 {
            failed = true;
            println!(
                "FAILED {} on {}: {} double effects",
                row.scenario,
                row.backend.name(),
                row.doubles
            );
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
