//! The failover scenario: two instances of the payments example on a replicated
//! PostgreSQL behind HAProxy (see `cluster.rs`), a storm of keyed payments retried
//! by `idem_axum::client`; the primary's WAL sender stalls for a moment, then the
//! primary's postmaster is SIGKILLed and Patroni promotes the replica. Run once
//! with synchronous replication and once with asynchronous: the commits of that
//! moment are what the two modes decide differently.
//!
//! The card provider keeps its charges in a database outside the cluster (a fresh
//! one on the machine's own PostgreSQL): it stands for another company's system,
//! which a failover of ours does not roll back.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::cluster::Cluster;
use crate::db::{Backend, Fresh};
use crate::proc::{Proc, client, get_json, post};
use crate::scenarios::{Row, check_ledger, pay_headers};

/// Users the payments are spread over (each payment locks its user's balance).
const USERS: u64 = 8;
const PREFIX: &str = "fo-u";
/// How long the storm runs before the kill.
const BEFORE_KILL: Duration = Duration::from_secs(3);
/// How long before the kill the primary stops sending WAL: the commits of that
/// moment are the ones the replication mode decides about.
const STALL: Duration = Duration::from_millis(500);
/// How long it goes on once payments succeed again.
const AFTER_RECOVERY: Duration = Duration::from_secs(4);

/// What one run measured, for the failover table.
#[derive(Debug, Clone, Default)]
pub struct Figures {
    pub acknowledged: u64,
    pub lost: u64,
    pub keys: u64,
    pub replays: u64,
    pub identical: u64,
    pub first_success: Option<Duration>,
    /// One payment and one charge per key, each charge paid once.
    pub one_each: bool,
}

struct Sent {
    key: String,
    user: String,
    body: String,
}

fn payment(i: u64, probe: bool) -> Sent {
    let user = format!("{PREFIX}{}", i % USERS);
    let key = if probe {
        format!("fo-probe-{i}")
    } else {
        format!("fo-{i}")
    };
    let body = format!(
        r#"{{"amount": {}, "currency": "JPY", "to": "shop"}}"#,
        100 + i % 500
    );
    Sent { key, user, body }
}

/// The first 201 each key was answered, as its clients saw it, and the keys a
/// later 201 answered differently (a double submit's other copy).
#[derive(Clone, Default)]
struct Acks(Arc<Mutex<Acknowledged>>);

type Acknowledged = (BTreeMap<String, Bytes>, HashSet<String>);

impl Acks {
    fn acknowledge(&self, key: &str, body: &Bytes) {
        if let Ok(mut acks) = self.0.lock() {
            let (first, changed) = &mut *acks;
            let acked = first.entry(key.to_owned()).or_insert_with(|| body.clone());
            if acked != body {
                changed.insert(key.to_owned());
            }
        }
    }

    fn take(&self) -> Acknowledged {
        self.0.lock().map(|acks| acks.clone()).unwrap_or_default()
    }
}

pub async fn failover(synchronous: bool) -> Row {
    let name = if synchronous {
        "failover (Patroni, synchronous)"
    } else {
        "failover (Patroni, asynchronous)"
    };
    let mut row = Row::new(name, Backend::Postgres);
    let provider = match Fresh::new(Backend::Postgres, "failover").await {
        Ok(db) => db,
        Err(error) => return row.failed(format!("the provider's database: {error}")),
    };
    let began = Instant::now();
    let mut cluster = match Cluster::start(synchronous).await {
        Ok(cluster) => cluster,
        Err(error) => {
            provider.drop_all().await;
            return row.failed(format!("the cluster: {error}"));
        }
    };
    eprintln!(
        "failover: cluster up in {:.1} s",
        began.elapsed().as_secs_f64()
    );
    run(&mut row, &cluster, &provider.url, synchronous).await;
    cluster.keep = !row.problems.is_empty();
    drop(cluster);
    provider.drop_all().await;
    row
}

async fn run(row: &mut Row, cluster: &Cluster, provider: &str, synchronous: bool) {
    let env = [("PROVIDER_DATABASE_URL", provider)];
    let url = cluster.url();
    let mut apps = match (
        Proc::payments(&url, 50, &env).await,
        Proc::payments(&url, 50, &env).await,
    ) {
        (Ok(a), Ok(b)) => [a, b],
        (Err(error), _) | (_, Err(error)) => return row.problems.push(error),
    };
    let addrs = [apps[0].addr.clone(), apps[1].addr.clone()];
    let acks = Acks::default();
    let retrying = client(200);
    let gate = Arc::new(Semaphore::new(24));
    let mut storm = JoinSet::new();
    let mut keys: Vec<Sent> = Vec::new();
    let began = Instant::now();
    let mut stalled: Option<String> = None;
    let mut killed: Option<(Instant, usize)> = None;
    let mut recovered: Option<Instant> = None;
    let mut probes = JoinSet::new();
    // What single attempts were answered after the kill, by status and problem.
    let mut seen: BTreeMap<String, u64> = BTreeMap::new();
    let mut i = 0;
    loop {
        let now = Instant::now();
        if stalled.is_none() && now - began >= BEFORE_KILL - STALL {
            match cluster.stall_replication().await {
                Ok(pid) => stalled = Some(pid),
                Err(error) => return row.problems.push(error),
            }
        }
        if killed.is_none() && now - began >= BEFORE_KILL {
            match cluster.kill_primary(stalled.as_deref()).await {
                Ok(node) => killed = Some((Instant::now(), node)),
                Err(error) => return row.problems.push(error),
            }
        }
        if let Some((at, _)) = killed {
            // One fresh payment, sent once, every 100 ms: the first to succeed
            // says when the system took payments again.
            while let Some(Ok((answered, done))) = probes.try_join_next() {
                *seen.entry(answered).or_default() += 1;
                if let Some(done) = done {
                    recovered = Some(recovered.map_or(done, |r: Instant| r.min(done)));
                }
            }
            if recovered.is_some_and(|r| now - r >= AFTER_RECOVERY) {
                break;
            }
            if now - at > Duration::from_secs(60) {
                return row
                    .problems
                    .push("no payment succeeded within 60 s of the kill".into());
            }
            let probe = payment(i, true);
            let (once, addr, acks) = (client(1), addrs[(i % 2) as usize].clone(), acks.clone());
            let (key, headers, body) = (
                probe.key.clone(),
                pay_headers(&probe.user, &probe.key),
                probe.body.clone(),
            );
            probes.spawn(async move {
                let sent = post(&once, &addr, "/payments", &headers, body);
                match tokio::time::timeout(Duration::from_secs(10), sent).await {
                    Ok(Ok(answer)) if answer.status == 201 => {
                        acks.acknowledge(&key, &answer.body);
                        ("201".to_owned(), Some(Instant::now()))
                    }
                    Ok(Ok(answer)) => {
                        let problem: serde_json::Value =
                            serde_json::from_slice(&answer.body).unwrap_or_default();
                        let kind = problem["type"].as_str().unwrap_or_default();
                        let kind = kind.rsplit('/').next().unwrap_or_default();
                        (format!("{} {kind}", answer.status), None)
                    }
                    Ok(Err(_)) => ("no answer".to_owned(), None),
                    Err(_) => ("over 10 s".to_owned(), None),
                }
            });
            keys.push(probe);
        }
        // The storm: a new key every 50 ms, every third one also double-submitted
        // to the other instance, each retried until it succeeds.
        let sent = payment(i, false);
        let copies: &[usize] = if i % 3 == 0 { &[0, 1] } else { &[0] };
        for &copy in copies {
            let addr = addrs[((i as usize) + copy) % 2].clone();
            let (retrying, gate, acks) = (retrying.clone(), gate.clone(), acks.clone());
            let (key, headers, body) = (
                sent.key.clone(),
                pay_headers(&sent.user, &sent.key),
                sent.body.clone(),
            );
            storm.spawn(async move {
                let _permit = gate.acquire_owned().await;
                let answer = post(&retrying, &addr, "/payments", &headers, body).await;
                if let Ok(answer) = &answer
                    && answer.status == 201
                {
                    acks.acknowledge(&key, &answer.body);
                }
                (key, answer)
            });
        }
        keys.push(sent);
        i += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let Some((killed_at, old)) = killed else {
        return;
    };
    row.failover = Some(Figures {
        first_success: recovered.map(|r| r - killed_at),
        ..Figures::default()
    });
    while let Some(joined) = storm.join_next().await {
        match joined {
            Ok((key, Ok(answer))) => {
                row.requests += u64::from(answer.attempts);
                row.check(answer.status == 201, || {
                    format!("{key}: {} {}", answer.status, answer.text())
                });
            }
            Ok((key, Err(error))) => row.problems.push(format!("{key}: {error}")),
            Err(error) => row.problems.push(error.to_string()),
        }
    }
    while let Some(joined) = probes.join_next().await {
        if let Ok((answered, _)) = joined {
            *seen.entry(answered).or_default() += 1;
        }
    }
    let probed = seen
        .iter()
        .map(|(answer, n)| format!("{n}x {answer}"))
        .collect::<Vec<_>>()
        .join(", ");
    row.requests += keys
        .iter()
        .filter(|k| k.key.starts_with("fo-probe"))
        .count() as u64;

    // The cluster settles: the old primary rejoins as a replica.
    if let Err(error) = cluster.settled(old, synchronous).await {
        row.problems.push(error);
    }
    eprintln!(
        "failover: settled {:.1} s after the kill",
        killed_at.elapsed().as_secs_f64()
    );
    for app in &mut apps {
        row.check(!app.exited(), || "an instance exited".into());
    }
    check_after(row, cluster, &addrs, &keys, &acks, synchronous).await;
    row.note = format!("{}; single attempts after the kill: {probed}", row.note);
}

/// What the new primary holds, what retries get, and what the operator sees.
async fn check_after(
    row: &mut Row,
    cluster: &Cluster,
    addrs: &[String; 2],
    keys: &[Sent],
    acks: &Acks,
    synchronous: bool,
) {
    let (acks, changed) = acks.take();
    // Acknowledged payments that the new primary does not hold.
    let mut held: HashSet<(i64, String)> = HashSet::new();
    for n in 0..USERS {
        match get_json(&addrs[0], "/payments", Some(&format!("{PREFIX}{n}"))).await {
            Ok(ledger) => {
                for p in ledger["payments"].as_array().into_iter().flatten() {
                    if let (Some(id), Some(charge)) = (p["id"].as_i64(), p["charge_id"].as_str()) {
                        held.insert((id, charge.to_owned()));
                    }
                }
            }
            Err(error) => row.problems.push(format!("reading the ledger: {error}")),
        }
    }
    let mut lost = HashSet::new();
    for (key, body) in &acks {
        let payment: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
        let id = payment["id"].as_i64().unwrap_or(-1);
        let charge = payment["charge_id"].as_str().unwrap_or_default().to_owned();
        if !held.contains(&(id, charge)) {
            lost.insert(key.clone());
        }
    }

    // Two copies of one payment answered differently: only if the first answer's
    // commit was lost and the other copy's retry executed it again.
    for key in changed.difference(&lost) {
        row.problems
            .push(format!("{key}: two different 201s, the first one kept"));
    }

    // Every key once more, as a client that never heard back would: a replay of
    // the acknowledged answer, byte for byte, wherever that commit survived.
    let retrying = client(200);
    let (mut replays, mut identical) = (0, 0);
    for (n, sent) in keys.iter().enumerate() {
        let addr = &addrs[n % 2];
        let headers = pay_headers(&sent.user, &sent.key);
        let answer = match post(&retrying, addr, "/payments", &headers, sent.body.clone()).await {
            Ok(answer) => answer,
            Err(error) => {
                row.problems
                    .push(format!("{} after the failover: {error}", sent.key));
                continue;
            }
        };
        row.requests += u64::from(answer.attempts);
        row.check(answer.status == 201, || {
            format!(
                "{} after the failover: {} {}",
                sent.key,
                answer.status,
                answer.text()
            )
        });
        let Some(acked) = acks.get(&sent.key) else {
            continue;
        };
        if lost.contains(&sent.key) {
            // Executed again; the provider answers with the charge it made for
            // the relayed key the first time.
            let charge = |body: &[u8]| {
                serde_json::from_slice::<serde_json::Value>(body).unwrap_or_default()["charge_id"]
                    .as_str()
                    .map(str::to_owned)
            };
            row.check(charge(&answer.body) == charge(acked), || {
                format!(
                    "{}: lost {}, executed again as {}",
                    sent.key,
                    String::from_utf8_lossy(acked),
                    answer.text()
                )
            });
            continue;
        }
        replays += 1;
        if answer.replayed && answer.body == *acked {
            identical += 1;
        } else {
            row.problems.push(format!(
                "{}: acknowledged {}, replayed ({}) {}",
                sent.key,
                String::from_utf8_lossy(acked),
                answer.replayed,
                answer.text()
            ));
        }
    }

    // One payment and one charge per key, balances that add up.
    let before = row.problems.len();
    if let Err(error) = check_ledger(row, &addrs[0], PREFIX, USERS, keys.len() as u64).await {
        row.problems.push(error);
    }
    let one_each = row.problems.len() == before && row.doubles == 0;
    if synchronous {
        row.check(lost.is_empty(), || {
            format!(
                "{} acknowledged payments lost with synchronous replication",
                lost.len()
            )
        });
    }
    operator_view(row, cluster, keys, &acks, &lost).await;
    // Waiting duplicates are woken through LISTEN: each instance listens again,
    // on the new primary.
    match listeners(cluster).await {
        Ok(n) => row.check(n == 2, || {
            format!("{n} instances listen on the new primary")
        }),
        Err(error) => row.problems.push(error),
    }

    let figures = row.failover.get_or_insert_with(Figures::default);
    figures.acknowledged = acks.len() as u64;
    figures.lost = lost.len() as u64;
    figures.keys = keys.len() as u64;
    figures.replays = replays;
    figures.identical = identical;
    figures.one_each = one_each;
    row.note = format!(
        "{} keys, {} acknowledged before the final retries, {} of them lost; first payment {} after the kill",
        keys.len(),
        acks.len(),
        lost.len(),
        figures
            .first_success
            .map_or("never".to_owned(), |d| format!("{:.1} s", d.as_secs_f64()))
    );
}

/// `idem list` and `idem show` through HAProxy: no claim left in flight or stuck,
/// and an acknowledged key that survived shows its recorded 201.
async fn operator_view(
    row: &mut Row,
    cluster: &Cluster,
    keys: &[Sent],
    acks: &BTreeMap<String, Bytes>,
    lost: &HashSet<String>,
) {
    let url = cluster.url();
    let run = |args: Vec<String>| {
        let url = url.clone();
        tokio::task::spawn_blocking(move || {
            let output = std::process::Command::new(crate::example::cli())
                .args(&args)
                .env("DATABASE_URL", &url)
                .output()
                .map_err(|e| e.to_string())?;
            let text = String::from_utf8_lossy(&output.stdout).into_owned();
            if output.status.success() {
                Ok(text)
            } else {
                Err(format!(
                    "idem {}: {}{}",
                    args.join(" "),
                    text,
                    String::from_utf8_lossy(&output.stderr)
                ))
            }
        })
    };
    // The table holds no claim, and on PostgreSQL neither does any open
    // transaction: no session holds an advisory lock in one.
    for (args, expected) in [
        (
            vec!["list".to_owned()],
            [
                "no claim in the table is in flight",
                "so no claim is in flight",
            ],
        ),
        (
            vec!["list".to_owned(), "--stuck".to_owned()],
            ["no stuck claim in the table", "so no claim is in flight"],
        ),
    ] {
        match run(args).await {
            Ok(Ok(text)) => row.check(expected.iter().all(|e| text.contains(e)), || {
                format!("idem list after the failover: {text}")
            }),
            Ok(Err(error)) => row.problems.push(error),
            Err(error) => row.problems.push(error.to_string()),
        }
    }
    let survivor = keys
        .iter()
        .find(|k| acks.contains_key(&k.key) && !lost.contains(&k.key));
    if let Some(sent) = survivor {
        let args = ["show", "--scope", &sent.user, &sent.key].map(str::to_owned);
        match run(args.to_vec()).await {
            Ok(Ok(text)) => row.check(text.contains("status:      201"), || {
                format!("idem show {} after the failover: {text}", sent.key)
            }),
            Ok(Err(error)) => row.problems.push(error),
            Err(error) => row.problems.push(error.to_string()),
        }
    }
}

/// Sessions on the primary listening for completions.
async fn listeners(cluster: &Cluster) -> Result<i64, String> {
    let pool = sqlx::PgPool::connect(&cluster.url())
        .await
        .map_err(|e| e.to_string())?;
    let n = sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN %'")
        .fetch_one(&pool)
        .await
        .map_err(|e| e.to_string());
    pool.close().await;
    n
}

/// The failover table: one line per replication mode.
pub fn print_table(rows: &[Row]) {
    let rows: Vec<(&Row, &Figures)> = rows
        .iter()
        .filter_map(|row| row.failover.as_ref().map(|f| (row, f)))
        .collect();
    if rows.is_empty() {
        return;
    }
    println!(
        "\n| replication | keys | acknowledged | acknowledged but lost | payments per key | charges per key | replays byte-identical | first payment after the kill |"
    );
    println!("| --- | ---: | ---: | ---: | --- | --- | ---: | ---: |");
    for (row, f) in rows {
        let mode = if row.scenario.contains("asynchronous") {
            "asynchronous"
        } else {
            "synchronous"
        };
        let per_key = if f.one_each { "1" } else { "NOT 1" };
        println!(
            "| {mode} | {} | {} | {} | {per_key} | {per_key} | {} of {} | {} |",
            f.keys,
            f.acknowledged,
            f.lost,
            f.identical,
            f.replays,
            f.first_success
                .map_or("never".to_owned(), |d| format!("{:.1} s", d.as_secs_f64()))
        );
    }
}
