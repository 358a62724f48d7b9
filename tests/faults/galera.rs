//! A node of a multi-primary MariaDB Galera cluster killed (SIGKILL) while keys
//! are sent through instances on every node: idem's cluster mode on the cluster
//! `.ci/galera` brings up (SQL on 127.0.0.1:3311-3313, its files under
//! `IDEM_GALERA_DIR`, default `/tmp/idem-galera`). Opt-in, as the failover
//! scenario: `IDEM_FAULTS_ONLY=galera`.
//!
//! Durability relies on the cluster's settings as `.ci/galera` leaves them, the
//! server's defaults: `innodb_flush_log_at_trx_commit = 1`, `sync_binlog = 0`. A
//! commit is acknowledged once certified, when every node holds its write set:
//! the surviving nodes keep it whatever the killed one had flushed.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use sqlx::{AssertSqlSafe, Connection as _, MySqlConnection};
use tokio::task::JoinSet;

use crate::db::Backend;
use crate::proc::{Proc, client, post};
use crate::scenarios::Row;

const NODES: [u16; 3] = [3311, 3312, 3313];
/// The node killed: the second.
const KILLED: usize = 1;

fn url(port: u16, database: &str) -> String {
    format!("mysql://root@127.0.0.1:{port}/{database}")
}

async fn node(port: u16) -> Result<MySqlConnection, String> {
    MySqlConnection::connect(&url(port, "mysql"))
        .await
        .map_err(|e| {
            format!("Galera node on {port} not reachable ({e}); start it with `bash .ci/galera`")
        })
}

/// Runs `sql` on the node, after it has applied what the cluster committed.
async fn on_node(port: u16, sql: &str) -> Result<Vec<(String, i64)>, String> {
    let mut conn = node(port).await?;
    sqlx::raw_sql("SET SESSION wsrep_sync_wait = 1")
        .execute(&mut conn)
        .await
        .map_err(|e| e.to_string())?;
    sqlx::query_as(AssertSqlSafe(sql.to_owned()))
        .fetch_all(&mut conn)
        .await
        .map_err(|e| format!("{sql}: {e}"))
}

/// A database of the scenario's own, created through node 1 and waited for on
/// every node; the connection to node 1 that created it.
async fn create_database(database: &str) -> Result<MySqlConnection, String> {
    let mut first = node(NODES[0]).await?;
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {database}")))
        .execute(&mut first)
        .await
        .map_err(|e| e.to_string())?;
    // Every node has the database before an instance connects to it.
    for port in NODES {
        let sql = format!(
            "SELECT SCHEMA_NAME, 1 FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = '{database}'"
        );
        match on_node(port, &sql).await {
            Ok(found) if found.len() == 1 => {}
            other => return Err(format!("the database on {port}: {other:?}")),
        }
    }
    Ok(first)
}

/// How many keys a scenario sends: `bounded`, or `full` with `IDEM_FAULTS=full`.
fn scaled(bounded: u64, full: u64) -> u64 {
    if std::env::var("IDEM_FAULTS").is_ok_and(|v| v == "full") {
        full
    } else {
        bounded
    }
}

/// The scenario's database (`create_database`) and an instance on every node.
async fn on_every_node(database: &str) -> Result<(MySqlConnection, Vec<Proc>), String> {
    let first = create_database(database).await?;
    Ok((first, instances_on(&NODES, database).await?))
}

/// An instance of the suite's server on each node of `ports`.
async fn instances_on(ports: &[u16], database: &str) -> Result<Vec<Proc>, String> {
    let mut instances = Vec::new();
    for port in ports {
        // `IDEM_FAULTS_GALERA=0` runs the standalone design instead, which must
        // fail these scenarios: the proof that they can.
        let galera = std::env::var("IDEM_FAULTS_GALERA").unwrap_or_default();
        let env = [("ACQUIRE_MS", "3000"), ("GALERA", galera.as_str())];
        instances.push(Proc::server(&url(*port, database), &env).await?);
    }
    Ok(instances)
}

/// One client's keys: what each got (attempts, or why not), and the answers of
/// each instance that were failures (500, 503 or no answer).
type Sent = (u64, Result<u32, String>, Vec<u32>);

/// Sends keys `{prefix}-{k}` (a 200 ms handler under a 4 s lock), one every
/// 20 ms so that a fault lands mid-storm, each through every instance at once;
/// a client whose instance fails (its node died or was cut off: 503, or no
/// answer) or is busy (409) tries the next one.
fn storm(addrs: &[String], keys: u64, prefix: &'static str) -> JoinSet<Sent> {
    let once = client(1);
    let mut sent = JoinSet::new();
    for k in 0..keys {
        for start in 0..addrs.len() {
            let (once, addrs) = (once.clone(), addrs.to_vec());
            sent.spawn(async move {
                tokio::time::sleep(Duration::from_millis(k * 20)).await;
                let key = format!("{prefix}-{k}");
                let headers = crate::scenarios::effect_headers(
                    &key,
                    &[("x-sleep-ms", 200), ("x-lock-ms", 4000)],
                );
                let mut failed = vec![0; addrs.len()];
                let mut attempts: u32 = 0;
                let mut through = start;
                let deadline = Instant::now() + Duration::from_secs(90);
                while Instant::now() < deadline {
                    attempts += 1;
                    let answer =
                        post(&once, &addrs[through], "/effects", &headers, key.clone()).await;
                    match answer {
                        Ok(answer) if answer.status == 201 => return (k, Ok(attempts), failed),
                        Ok(answer) if answer.status == 409 => {}
                        Ok(answer) if matches!(answer.status, 500 | 503) => failed[through] += 1,
                        Ok(answer) => {
                            let problem = format!("{} {}", answer.status, answer.text());
                            return (k, Err(problem), failed);
                        }
                        Err(_) => failed[through] += 1,
                    }
                    through = (through + 1) % addrs.len();
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                (k, Err("never answered 201 within 90 s".to_owned()), failed)
            });
        }
    }
    sent
}

/// The storm's answers: how many clients of each key got a 201, and each
/// instance's failures; requests and problems go to `row`.
async fn collect(
    row: &mut Row,
    mut sent: JoinSet<Sent>,
    prefix: &str,
) -> (BTreeMap<u64, u32>, Vec<u32>) {
    let mut answered: BTreeMap<u64, u32> = BTreeMap::new();
    let mut failed = Vec::new();
    while let Some(joined) = sent.join_next().await {
        match joined {
            Ok((k, got, failures)) => {
                failed.resize(failures.len().max(failed.len()), 0);
                for (sum, n) in failed.iter_mut().zip(failures) {
                    *sum += n;
                }
                match got {
                    Ok(attempts) => {
                        row.requests += u64::from(attempts);
                        *answered.entry(k).or_default() += 1;
                    }
                    Err(problem) => row.problems.push(format!("{prefix}-{k}: {problem}")),
                }
            }
            Err(error) => row.problems.push(error.to_string()),
        }
    }
    (answered, failed)
}

/// What every node holds: one effect per key, every key completed, no claim
/// left behind.
async fn every_node_holds(row: &mut Row, database: &str, keys: u64) {
    for port in NODES {
        let effects =
            format!("SELECT note, COUNT(*) FROM {database}.effects GROUP BY note ORDER BY note");
        match on_node(port, &effects).await {
            Ok(notes) => {
                let doubles = notes.iter().filter(|(_, n)| *n > 1).count() as u64;
                row.doubles = row.doubles.max(doubles);
                row.check(notes.len() as u64 == keys, || {
                    format!(
                        "node {port}: {} keys with an effect, of {keys}",
                        notes.len()
                    )
                });
                if port == NODES[0] {
                    row.effects = notes.iter().map(|(_, n)| *n as u64).sum();
                }
            }
            Err(error) => row.problems.push(error),
        }
        let states =
            format!("SELECT state, COUNT(*) FROM {database}.idempotency_keys GROUP BY state");
        match on_node(port, &states).await {
            Ok(states) => row.check(states == [("completed".to_owned(), keys as i64)], || {
                format!("node {port}: keys {states:?}, expected {keys} completed")
            }),
            Err(error) => row.problems.push(error),
        }
    }
}

/// One run of the handler: when it started and ended (µs), and whether its
/// transaction committed.
type Run = (u128, u128, bool);

/// Every run of the handler, by note and in order, from every instance (`GET
/// /runs`). Problems of `row`'s: a key that ran twice at once, and a key that
/// ran again after a run that committed (a key runs again only after a run that
/// was cut: its node died, or its transaction was aborted).
async fn runs_at_once(row: &mut Row, addrs: &[String]) -> BTreeMap<String, Vec<Run>> {
    let mut runs: BTreeMap<String, Vec<Run>> = BTreeMap::new();
    for addr in addrs {
        match crate::proc::get_json(addr, "/runs", None).await {
            Ok(serde_json::Value::Array(all)) => {
                for run in all {
                    let note = run[0].as_str().unwrap_or_default().to_owned();
                    let (began, ended) = (run[1].as_u64(), run[2].as_u64());
                    let committed = run[3].as_bool();
                    if let (Some(began), Some(ended), Some(committed)) = (began, ended, committed) {
                        runs.entry(note).or_default().push((
                            u128::from(began),
                            u128::from(ended),
                            committed,
                        ));
                    }
                }
            }
            other => row.problems.push(format!("runs from {addr}: {other:?}")),
        }
    }
    let (mut at_once, mut after_commit) = (Vec::new(), Vec::new());
    for (note, times) in &mut runs {
        times.sort_unstable();
        if times.windows(2).any(|two| two[1].0 < two[0].1) {
            at_once.push(note.clone());
        }
        if times
            .iter()
            .rev()
            .skip(1)
            .any(|(_, _, committed)| *committed)
        {
            after_commit.push(note.clone());
        }
    }
    row.check(at_once.is_empty(), || {
        format!("{} keys run twice at once: {at_once:?}", at_once.len())
    });
    row.check(after_commit.is_empty(), || {
        format!(
            "{} keys ran again after a run that committed: {after_commit:?}",
            after_commit.len()
        )
    });
    runs
}

/// The keys sent: each to every instance at once; a client whose instance fails
/// (its node died: 503, or no answer) or is busy (409) tries the next one.
pub async fn node_killed() -> Row {
    let mut row = Row::new("Galera node killed (SIGKILL)", Backend::MySql);
    let dir = PathBuf::from(
        std::env::var("IDEM_GALERA_DIR").unwrap_or_else(|_| "/tmp/idem-galera".to_owned()),
    );
    let database = format!("idem_faults_galera_{}", std::process::id());
    let keys = scaled(150, 600);
    let (mut first, instances) = match on_every_node(&database).await {
        Ok(set) => set,
        Err(error) => return row.failed(error),
    };
    let addrs: Vec<String> = instances.iter().map(|i| i.addr.clone()).collect();

    let started = Instant::now();
    let sent = storm(&addrs, keys, "galera");
    // Mid-storm: the second node dies at once, as a machine does.
    tokio::time::sleep(Duration::from_millis(keys * 20 / 2)).await;
    let pid = std::fs::read_to_string(dir.join(format!("node{}", KILLED + 1)).join("mysqld.pid"))
        .ok()
        .and_then(|pid| pid.trim().parse::<u32>().ok());
    let Some(pid) = pid else {
        return row.failed(format!(
            "no pid file for node {} under {}",
            KILLED + 1,
            dir.display()
        ));
    };
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status();
    let killed_at = started.elapsed();
    // It rejoins a few seconds later, while the storm still runs.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let rejoin = tokio::process::Command::new("bash")
        .args([".ci/galera", "node", &(KILLED + 1).to_string()])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status();

    let (answered, _) = collect(&mut row, sent, "galera").await;
    match rejoin.await {
        Ok(status) if status.success() => {}
        other => row
            .problems
            .push(format!("node {} did not rejoin: {other:?}", KILLED + 1)),
    }
    row.check(answered.len() as u64 == keys, || {
        format!("{} of {keys} keys answered 201", answered.len())
    });

    // What every node holds, the rejoined one included.
    every_node_holds(&mut row, &database, keys).await;
    // The handler's runs, from every instance: never two of a key at once. (A
    // run whose node died is followed by another once its claim's lock passed.)
    let runs = runs_at_once(&mut row, &addrs).await;
    let again = runs.values().filter(|times| times.len() > 1).count();
    drop(instances);
    let _ = sqlx::raw_sql(AssertSqlSafe(format!("DROP DATABASE {database}")))
        .execute(&mut first)
        .await;
    row.note = format!(
        "{keys} keys x 3 instances on 3 nodes; node 2 killed at {:.1} s, rejoined; \
         {again} keys run again after a cut run; {} s in all",
        killed_at.as_secs_f64(),
        started.elapsed().as_secs()
    );
    row
}

/// How far ahead the skewed node's clock runs.
const SKEW_SECS: u64 = 3;
/// The node whose clock is skewed: the third.
const SKEWED: usize = 2;

/// Node 3's wall clock `SKEW_SECS` ahead (libfaketime on its `mariadbd`, the
/// monotonic clock untouched), as when a node's NTP fails. Each key goes to an
/// instance on node 1, and 300 ms later to one on node 3, whose client retries
/// every 409 at once (no Retry-After) until it gets an answer: a handler of 4 s
/// under a 5 s lock, longer than the skew. Node 3 reads node 1's deadlines as if
/// they were `SKEW_SECS` nearer; no key may run on both nodes at once. Then two
/// keys with a ttl of 6 s: the one looked up through node 1 never expires early,
/// the one through node 3 by no more than the skew.
pub async fn clock_skewed() -> Row {
    let mut row = Row::new("Galera node clock 3 s ahead", Backend::MySql);
    let database = format!("idem_faults_skew_{}", std::process::id());
    let keys = scaled(20, 60);
    let skewed = NODES[SKEWED];
    if let Err(error) = galera_cli(&["skew", &(SKEWED + 1).to_string(), &format!("+{SKEW_SECS}")]) {
        return row.failed(error);
    }
    let ran = skewed_storm(&mut row, &database, keys).await;
    // The node's clock back, whatever happened.
    if let Err(error) = galera_cli(&["node", &(SKEWED + 1).to_string()]) {
        row.problems.push(error);
    }
    if let Err(error) = ran {
        row.problems.push(error);
    }
    if let Ok(mut first) = node(NODES[0]).await {
        let _ = sqlx::raw_sql(AssertSqlSafe(format!("DROP DATABASE {database}")))
            .execute(&mut first)
            .await;
    }
    row.note = format!(
        "{keys} keys through node 1, then node {} ({skewed}); {}",
        SKEWED + 1,
        row.note
    );
    row
}

/// `bash .ci/galera ARGS`, from the repository.
fn galera_cli(args: &[&str]) -> Result<(), String> {
    let status = std::process::Command::new("bash")
        .arg(".ci/galera")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .map_err(|e| e.to_string())?;
    if status.success() {
        Ok(())
    } else {
        Err(format!(".ci/galera {args:?}: {status}"))
    }
}

async fn skewed_storm(row: &mut Row, database: &str, keys: u64) -> Result<(), String> {
    // The skew as the two nodes' clocks show it, read one after the other.
    let read = "SELECT 'now', CAST(UNIX_TIMESTAMP(UTC_TIMESTAMP(6)) * 1000 AS SIGNED)";
    let ahead = on_node(NODES[SKEWED], read).await?[0].1 - on_node(NODES[0], read).await?[0].1;
    if ahead < (SKEW_SECS * 1000 - 500) as i64 {
        return Err(format!("node {} is only {ahead} ms ahead", SKEWED + 1));
    }
    create_database(database).await?;
    let instances = instances_on(&[NODES[0], NODES[SKEWED]], database).await?;
    let addrs: Vec<String> = instances.iter().map(|i| i.addr.clone()).collect();
    let once = client(1);
    let started = Instant::now();
    let mut sent = JoinSet::new();
    for k in 0..keys {
        for (through, delay) in [(0, 0), (1, 300)] {
            let (once, addr) = (once.clone(), addrs[through].clone());
            sent.spawn(async move {
                tokio::time::sleep(Duration::from_millis(k * 150 + delay)).await;
                let key = format!("skew-{k}");
                let headers = crate::scenarios::effect_headers(
                    &key,
                    &[("x-sleep-ms", 4000), ("x-lock-ms", 5000)],
                );
                let mut attempts: u32 = 0;
                let deadline = Instant::now() + Duration::from_secs(40);
                while Instant::now() < deadline {
                    attempts += 1;
                    match post(&once, &addr, "/effects", &headers, key.clone()).await {
                        Ok(answer) if answer.status == 201 => return (k, Ok(attempts)),
                        Ok(answer) if answer.status == 409 => {}
                        Ok(answer) => {
                            return (k, Err(format!("{} {}", answer.status, answer.text())));
                        }
                        Err(error) => return (k, Err(error)),
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                (k, Err("never answered 201 within 40 s".to_owned()))
            });
        }
    }
    let mut answered: BTreeMap<u64, u32> = BTreeMap::new();
    while let Some(joined) = sent.join_next().await {
        match joined {
            Ok((k, Ok(attempts))) => {
                row.requests += u64::from(attempts);
                *answered.entry(k).or_default() += 1;
            }
            Ok((k, Err(problem))) => row.problems.push(format!("skew-{k}: {problem}")),
            Err(error) => row.problems.push(error.to_string()),
        }
    }
    let both = answered.values().filter(|n| **n == 2).count();
    row.check(both as u64 == keys, || {
        format!("{both} of {keys} keys answered 201 on both nodes")
    });
    every_node_holds(row, database, keys).await;
    let runs = runs_at_once(row, &addrs).await;
    let again = runs.values().filter(|times| times.len() > 1).count();
    row.check(again == 0, || format!("{again} keys ran more than once"));

    // Expiry: a ttl of 6 s, read through each node until the key runs anew.
    let ttl = Duration::from_secs(6);
    let mut early = Vec::new();
    for (through, key) in [(0, "skew-ttl-1"), (1, "skew-ttl-3")] {
        let headers = crate::scenarios::effect_headers(
            key,
            &[("x-ttl-ms", ttl.as_millis() as u64), ("x-lock-ms", 2000)],
        );
        let sent_at = Instant::now();
        let first = post(&once, &addrs[0], "/effects", &headers, key.to_owned()).await?;
        if first.status != 201 {
            return Err(format!("{key}: {} {}", first.status, first.text()));
        }
        let anew = loop {
            let answer = post(&once, &addrs[through], "/effects", &headers, key.to_owned()).await?;
            if answer.status == 201 && !answer.replayed {
                break sent_at.elapsed();
            }
            if sent_at.elapsed() > ttl * 3 {
                return Err(format!("{key} never expired"));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        early.push(anew);
    }
    let skew = Duration::from_secs(SKEW_SECS);
    row.check(early[0] >= ttl, || {
        format!(
            "expired after {:?} through node 1, its ttl {ttl:?}",
            early[0]
        )
    });
    row.check(early[1] + skew >= ttl, || {
        format!(
            "expired after {:?} through node 3, earlier than its ttl less the skew",
            early[1]
        )
    });
    drop(instances);
    row.note = format!(
        "node 3 {ahead} ms ahead; a ttl of 6 s expired after {:.1} s through node 1, {:.1} s \
         through node 3; {} s in all",
        early[0].as_secs_f64(),
        early[1].as_secs_f64(),
        started.elapsed().as_secs()
    );
    Ok(())
}

/// The node cut off: the third.
const CUT: usize = 2;

/// Node 3 cut off from the other two by a packet filter (`.ci/galera partition
/// 3`) mid-storm, with instances on all three nodes, then let back: the cut-off
/// node goes non-primary and refuses queries, so requests through it get 503 and
/// their clients' retries through another node succeed. Once the partition has
/// healed and the node has rejoined: every key answered 201 on every client, one
/// effect per key on every node, every key completed (none stuck), no key run
/// twice at once, nor again after a run that committed.
pub async fn partitioned() -> Row {
    let mut row = Row::new("Galera node cut off (partition)", Backend::MySql);
    let database = format!("idem_faults_partition_{}", std::process::id());
    let keys = scaled(300, 600);
    let (mut first, instances) = match on_every_node(&database).await {
        Ok(set) => set,
        Err(error) => return row.failed(error),
    };
    let addrs: Vec<String> = instances.iter().map(|i| i.addr.clone()).collect();
    let started = Instant::now();
    let sent = storm(&addrs, keys, "cut");
    // A second in, node 3 is cut off; what it says of itself once it knows.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let cut_at = started.elapsed();
    if let Err(error) = galera_cli(&["partition", &(CUT + 1).to_string()]) {
        row.problems.push(error);
    }
    let mut status = String::new();
    let until = Instant::now() + Duration::from_secs(30);
    while Instant::now() < until {
        let read = on_cut_node("SHOW STATUS LIKE 'wsrep_cluster_status'").await;
        if let Ok(Some(now)) = read {
            status = now;
            if status == "non-Primary" {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let refused = refuses_queries().await;
    let non_primary_at = started.elapsed();
    // The storm's requests through node 3 may hang until it knows it is cut
    // off (a suspect timeout, or the longer inactive one) and finish after the
    // heal; a request sent through it now is refused at once.
    let probe = probe_cut_node(&addrs, keys).await;
    // Cut for a few seconds more, while the storm goes on through the others.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let healed_at = started.elapsed();
    if let Err(error) = galera_cli(&["heal"]) {
        row.problems.push(error);
    }
    let (answered, failed) = collect(&mut row, sent, "cut").await;
    // Rejoined and synced (IST) before its data is read.
    let rejoined = tokio::process::Command::new("bash")
        .args([".ci/galera", "node-synced", &(CUT + 1).to_string()])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .await;
    row.check(matches!(rejoined, Ok(s) if s.success()), || {
        format!("node {} did not rejoin: {rejoined:?}", CUT + 1)
    });
    row.check(status == "non-Primary", || {
        format!("node {} said it was {status:?} while cut off", CUT + 1)
    });
    row.check(refused.is_ok(), || format!("node {} {refused:?}", CUT + 1));
    row.check(probe.is_ok(), || {
        format!("node {} while cut off: {probe:?}", CUT + 1)
    });
    row.check(
        answered.len() as u64 == keys && answered.values().all(|n| *n == 3),
        || {
            format!(
                "{} of {keys} keys answered 201 on every client",
                answered.len()
            )
        },
    );
    // The storm's keys and the probe's.
    every_node_holds(&mut row, &database, keys + 1).await;
    let runs = runs_at_once(&mut row, &addrs).await;
    let again = runs.values().filter(|times| times.len() > 1).count();
    drop(instances);
    let _ = sqlx::raw_sql(AssertSqlSafe(format!("DROP DATABASE {database}")))
        .execute(&mut first)
        .await;
    row.note = format!(
        "{keys} keys x 3 instances on 3 nodes; node 3 cut off at {:.1} s, non-primary by \
         {:.1} s, let back at {:.1} s; failed answers per instance {failed:?}; {again} keys \
         run again after a cut run; {} s in all",
        cut_at.as_secs_f64(),
        non_primary_at.as_secs_f64(),
        healed_at.as_secs_f64(),
        started.elapsed().as_secs()
    );
    row
}

/// One more key, `cut-{keys}`, sent through the cut-off node's instance once
/// that node is non-primary: answered 503 within seconds (its claim refused,
/// nothing run), then 201 through node 1's once the rest of the cluster has
/// settled.
async fn probe_cut_node(addrs: &[String], keys: u64) -> Result<(), String> {
    let once = client(1);
    let key = format!("cut-{keys}");
    let headers = crate::scenarios::effect_headers(&key, &[("x-lock-ms", 4000)]);
    let through_cut = post(&once, &addrs[CUT], "/effects", &headers, key.clone());
    match tokio::time::timeout(Duration::from_secs(10), through_cut).await {
        Ok(Ok(answer)) if answer.status == 503 => {}
        Ok(Ok(answer)) => return Err(format!("answered {} {}", answer.status, answer.text())),
        Ok(Err(error)) => return Err(error),
        Err(_) => return Err("no answer within 10 s".to_owned()),
    }
    // The primary component may still be settling its new membership: retried
    // as the storm's clients retry, 503 or 409 meaning later.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let retried = post(&once, &addrs[0], "/effects", &headers, key.clone()).await?;
        match retried.status {
            201 => return Ok(()),
            409 | 503 if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            status => return Err(format!("the retry through node 1 answered {status}")),
        }
    }
}

/// A status line of the cut-off node, read without waiting for the cluster (a
/// non-primary node answers `SHOW STATUS`, and nothing that reads data).
async fn on_cut_node(sql: &str) -> Result<Option<String>, String> {
    let mut conn = node(NODES[CUT]).await?;
    let rows: Vec<(String, String)> = sqlx::query_as(AssertSqlSafe(sql.to_owned()))
        .fetch_all(&mut conn)
        .await
        .map_err(|e| e.to_string())?;
    Ok(rows.into_iter().next().map(|(_, value)| value))
}

/// The cut-off node refuses a read of data: 1047, "WSREP has not yet prepared
/// node for application use".
async fn refuses_queries() -> Result<(), String> {
    let mut conn = node(NODES[CUT]).await?;
    match sqlx::raw_sql("SELECT COUNT(*) FROM mysql.user")
        .fetch_all(&mut conn)
        .await
    {
        Err(sqlx::Error::Database(error)) if error.code().as_deref() == Some("08S01") => Ok(()),
        Err(error) => Err(format!("refused a read with another error: {error}")),
        Ok(_) => Err("answered a read while cut off".to_owned()),
    }
}
