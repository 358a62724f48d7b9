//! The scenarios: each runs against one backend and fills one row of the table.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::db::{Backend, Fresh};
use crate::proc::{Answer, Proc, await_started, client, get_json, post};

/// How big a run is: `IDEM_FAULTS=full` for the long form.
pub struct Scale {
    pub crash_keys: u64,
    pub storm_keys: u64,
    pub storm_duplicates: u64,
}

impl Scale {
    pub fn from_env() -> Self {
        if std::env::var("IDEM_FAULTS").is_ok_and(|v| v == "full") {
            Self {
                crash_keys: 120,
                storm_keys: 1000,
                storm_duplicates: 10,
            }
        } else {
            Self {
                crash_keys: 24,
                storm_keys: 200,
                storm_duplicates: 10,
            }
        }
    }
}

/// One line of the table.
pub struct Row {
    pub scenario: &'static str,
    pub backend: Backend,
    pub requests: u64,
    pub effects: u64,
    pub charges: Option<u64>,
    pub doubles: u64,
    pub problems: Vec<String>,
    pub note: String,
    /// The failover scenario's figures.
    pub failover: Option<crate::failover::Figures>,
}

impl Row {
    pub fn new(scenario: &'static str, backend: Backend) -> Self {
        Self {
            scenario,
            backend,
            requests: 0,
            effects: 0,
            charges: None,
            doubles: 0,
            problems: Vec::new(),
            note: String::new(),
            failover: None,
        }
    }

    /// "ok", or "FAILED" when the run found a problem.
    pub fn result(&self) -> &'static str {
        if self.problems.is_empty() {
            "ok"
        } else {
            "FAILED"
        }
    }

    pub fn check(&mut self, ok: bool, problem: impl FnOnce() -> String) {
        if !ok {
            self.problems.push(problem());
        }
    }

    fn expect_effects(&mut self, expected: u64) {
        let effects = self.effects;
        self.check(effects == expected, || {
            format!("{effects} effects, expected {expected}")
        });
    }

    /// Counts an answer's attempts and expects it to be 201.
    fn expect_created(&mut self, what: &str, sent: Result<Answer, String>) {
        match sent {
            Ok(answer) => {
                self.requests += u64::from(answer.attempts);
                self.check(answer.status == 201, || {
                    format!("{what}: {} {}", answer.status, answer.text())
                });
            }
            Err(error) => self.problems.push(format!("{what}: {error}")),
        }
    }

    pub fn failed(mut self, problem: String) -> Self {
        self.problems.push(problem);
        self
    }
}

/// What a request cut off by a database fault must get: 500 (the handler's own
/// database error) or 503 (idem's), as problem+json, never a success.
fn is_refusal(answer: &Answer) -> bool {
    matches!(answer.status, 500 | 503) && is_problem_json(answer)
}

fn is_problem_json(answer: &Answer) -> bool {
    answer
        .content_type
        .as_deref()
        .is_some_and(|t| t.starts_with("application/problem+json"))
}

// ---------------------------------------------------------------------------------
// The payments example, killed

fn payment(i: u64) -> (String, String, String) {
    let user = format!("crash-u{}", i % 4);
    let key = format!("crash-{i}");
    let body = format!(
        r#"{{"amount": {}, "currency": "JPY", "to": "shop"}}"#,
        100 + i
    );
    (user, key, body)
}

pub fn pay_headers(user: &str, key: &str) -> Vec<(&'static str, String)> {
    vec![
        ("authorization", format!("Bearer {user}")),
        ("idempotency-key", key.to_owned()),
        ("content-type", "application/json".to_owned()),
    ]
}

/// Scenario 1: The payments example killed with SIGKILL while its handlers are inside their
/// transactions and their provider calls are in flight; the suite's server killed in
/// the narrow window after a commit and before the response; both restarted; every
/// client retries with its key. Exactly one payment and one charge per key,
/// balances consistent, and the narrow window's retry is a replay.
pub async fn crash(db: &Fresh, scale: &Scale) -> Row {
    let mut row = Row::new("crash (SIGKILL, payments example)", db.backend);
    let once = client(1);

    let mut app = match Proc::payments(&db.url, 400, &[]).await {
        Ok(app) => app,
        Err(error) => return row.failed(error),
    };
    let mut in_flight = JoinSet::new();
    for i in 0..scale.crash_keys {
        let (user, key, body) = payment(i);
        let (once, addr) = (once.clone(), app.addr.clone());
        in_flight.spawn(async move {
            post(&once, &addr, "/payments", &pay_headers(&user, &key), body).await
        });
    }
    // Inside their transactions, waiting for the provider (which already charged).
    tokio::time::sleep(Duration::from_millis(200)).await;
    app.kill();
    let mut before = 0;
    while let Some(sent) = in_flight.join_next().await {
        row.requests += 1;
        if matches!(sent, Ok(Ok(ref a)) if a.status == 201) {
            before += 1;
        }
    }

    // The narrow window, on the suite's server: committed, then dead before
    // answering; restarted, the retry must be a replay of the one execution.
    if let Err(error) = narrow_window(db, &mut row).await {
        return row.failed(error);
    }

    // Restarted; every client retries with its own key.
    let app = match Proc::payments(&db.url, 50, &[]).await {
        Ok(app) => app,
        Err(error) => return row.failed(error),
    };
    let retrying = client(25);
    let mut retries = JoinSet::new();
    for i in 0..scale.crash_keys {
        let (user, key, body) = payment(i);
        let (retrying, addr) = (retrying.clone(), app.addr.clone());
        retries.spawn(async move {
            (
                key.clone(),
                post(
                    &retrying,
                    &addr,
                    "/payments",
                    &pay_headers(&user, &key),
                    body,
                )
                .await,
            )
        });
    }
    while let Some(joined) = retries.join_next().await {
        let Ok((key, sent)) = joined else {
            row.problems.push("a retry task failed".into());
            continue;
        };
        match sent {
            Ok(answer) => {
                row.requests += u64::from(answer.attempts);
                row.check(answer.status == 201, || {
                    format!("{key}: {} {}", answer.status, answer.text())
                });
            }
            Err(error) => row.problems.push(format!("{key}: {error}")),
        }
    }

    // What the databases hold.
    if let Err(error) = check_ledger(&mut row, &app.addr, "crash-u", 4, scale.crash_keys).await {
        return row.failed(error);
    }
    row.note = format!("{before} answered before the kill; narrow window replayed");
    row
}

/// Checks what the payments example's databases hold for the users `prefix0` to
/// `prefix{users - 1}`: `expected` payments and charges, each charge paid once,
/// balances that add up.
pub async fn check_ledger(
    row: &mut Row,
    addr: &str,
    prefix: &str,
    users: u64,
    expected: u64,
) -> Result<(), String> {
    let all = get_json(addr, "/provider/charges", None).await?;
    let charges = all["charges"].as_array().cloned().unwrap_or_default();
    let charged: HashSet<String> = charges
        .iter()
        .filter(|c| c["user"].as_str().is_some_and(|u| u.starts_with(prefix)))
        .filter_map(|c| c["id"].as_str().map(str::to_owned))
        .collect();
    row.charges = Some(charged.len() as u64);
    let mut paid: BTreeMap<String, u64> = BTreeMap::new();
    for n in 0..users {
        let user = format!("{prefix}{n}");
        let ledger = get_json(addr, "/payments", Some(&user)).await?;
        let payments = ledger["payments"].as_array().cloned().unwrap_or_default();
        let spent: i64 = payments.iter().filter_map(|p| p["amount"].as_i64()).sum();
        let balance = ledger["balance"].as_i64().unwrap_or_default();
        row.check(balance == 1_000_000 - spent, || {
            format!("{user}: balance {balance} after spending {spent}")
        });
        for p in &payments {
            if let Some(charge) = p["charge_id"].as_str() {
                *paid.entry(charge.to_owned()).or_default() += 1;
            }
        }
        row.effects += payments.len() as u64;
    }
    row.doubles = paid.values().filter(|n| **n > 1).count() as u64;
    row.expect_effects(expected);
    row.check(charged.len() as u64 == expected, || {
        format!("{} charges for {expected} keys", charged.len())
    });
    let unpaid = charged.iter().filter(|c| !paid.contains_key(*c)).count();
    row.check(unpaid == 0, || {
        format!("{unpaid} charges without a payment")
    });
    Ok(())
}

/// Scenario 2: SIGTERM to the payments example while its payments wait at the card
/// provider, as a deploy sends it. Each payment answers 201 before the process
/// exits, or (refused while it drains) its retry after the restart succeeds within
/// 2 s; one payment and one charge per key.
pub async fn sigterm(db: &Fresh) -> Row {
    let mut row = Row::new("sigterm (graceful, payments example)", db.backend);
    let once = client(1);
    let keys = 6;
    let payment = |i: u64| {
        let user = format!("term-u{}", i % 4);
        let body = format!(
            r#"{{"amount": {}, "currency": "JPY", "to": "shop"}}"#,
            100 + i
        );
        (user, format!("term-{i}"), body)
    };
    let mut app = match Proc::payments(&db.url, 800, &[]).await {
        Ok(app) => app,
        Err(error) => return row.failed(error),
    };
    let mut in_flight = JoinSet::new();
    for i in 0..keys {
        let (user, key, body) = payment(i);
        let (once, addr) = (once.clone(), app.addr.clone());
        in_flight.spawn(async move {
            let sent = post(&once, &addr, "/payments", &pay_headers(&user, &key), body).await;
            (key, sent)
        });
    }
    // At the provider, inside their transactions.
    tokio::time::sleep(Duration::from_millis(300)).await;
    app.signal("TERM");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (user, late_key, body) = payment(keys);
    let late = post(
        &once,
        &app.addr,
        "/payments",
        &pay_headers(&user, &late_key),
        body,
    )
    .await;
    row.requests += 1;
    row.check(
        late.as_ref().map_or(true, |a| {
            a.status == 503 && a.text().contains("shutting-down")
        }),
        || format!("a payment sent while draining: {late:?}"),
    );
    let mut retry = vec![late_key];
    let mut answered = 0;
    while let Some(joined) = in_flight.join_next().await {
        let Ok((key, sent)) = joined else {
            row.problems.push("a payment task failed".into());
            continue;
        };
        row.requests += 1;
        match sent {
            Ok(answer) if answer.status == 201 => answered += 1,
            _ => retry.push(key),
        }
    }
    for _ in 0..800 {
        if app.exited() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    row.check(app.exited(), || {
        "the process did not exit after SIGTERM".into()
    });
    drop(app);

    let app = match Proc::payments(&db.url, 0, &[]).await {
        Ok(app) => app,
        Err(error) => return row.failed(error),
    };
    let retrying = client(5);
    for key in &retry {
        let i: u64 = key.trim_start_matches("term-").parse().unwrap_or(0);
        let (user, _, body) = payment(i);
        let started = std::time::Instant::now();
        let sent = post(
            &retrying,
            &app.addr,
            "/payments",
            &pay_headers(&user, key),
            body,
        )
        .await;
        let took = started.elapsed();
        match sent {
            Ok(answer) => {
                row.requests += u64::from(answer.attempts);
                row.check(
                    answer.status == 201 && took < Duration::from_secs(2),
                    || format!("{key}: {} after {took:?}: {}", answer.status, answer.text()),
                );
            }
            Err(error) => row.problems.push(format!("{key}: {error}")),
        }
    }
    if let Err(error) = check_ledger(&mut row, &app.addr, "term-u", 4, keys + 1).await {
        return row.failed(error);
    }
    row.note = format!(
        "{answered} of {keys} answered 201 before exiting; the rest and 1 sent while draining retried after the restart"
    );
    row
}

/// The suite's server dies right after committing one keyed request, before its
/// answer; restarted, the client's retry is a replay and the work was done once.
async fn narrow_window(db: &Fresh, row: &mut Row) -> Result<(), String> {
    let key = "crash-narrow";
    let headers = [("idempotency-key", key.to_owned())];
    let dying = Proc::server(&db.url, &[("ABORT_AFTER_COMMIT", key)]).await?;
    let lost = post(&client(1), &dying.addr, "/effects", &headers, key.into()).await;
    row.requests += 1;
    row.check(lost.is_err(), || {
        format!("the dying process answered: {lost:?}")
    });
    let mut dying = dying;
    for _ in 0..100 {
        if dying.exited() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    row.check(dying.exited(), || {
        "the process did not die after its commit".into()
    });
    drop(dying);
    let server = Proc::server(&db.url, &[]).await?;
    let retry = post(&client(25), &server.addr, "/effects", &headers, key.into()).await?;
    row.requests += u64::from(retry.attempts);
    row.check(retry.status == 201 && retry.replayed, || {
        format!(
            "the narrow window's retry: {} replayed={}",
            retry.status, retry.replayed
        )
    });
    let stats = get_json(&server.addr, "/stats", None).await?;
    row.check(stats["effects"] == 1 && stats["doubles"] == 0, || {
        format!("the narrow window's work, done {}", stats["effects"])
    });
    Ok(())
}

// ---------------------------------------------------------------------------------
// The suite's server

pub fn effect_headers(key: &str, extra: &[(&'static str, u64)]) -> Vec<(&'static str, String)> {
    let mut headers = vec![("idempotency-key", key.to_owned())];
    headers.extend(extra.iter().map(|(name, value)| (*name, value.to_string())));
    headers
}

async fn stats(row: &mut Row, addr: &str) {
    match get_json(addr, "/stats", None).await {
        Ok(stats) => {
            row.effects = stats["effects"].as_u64().unwrap_or(u64::MAX);
            row.doubles = stats["doubles"].as_u64().unwrap_or(u64::MAX);
        }
        Err(error) => row.problems.push(format!("stats: {error}")),
    }
}

/// Scenario 2: An executor frozen (SIGSTOP) past its lock on instance A; a retry on instance
/// B takes over and completes; A thaws and must fail to commit.
pub async fn hang(db: &Fresh) -> Row {
    let mut row = Row::new("hang (SIGSTOP past the lock)", db.backend);
    let (a, b) = match (
        Proc::server(&db.url, &[]).await,
        Proc::server(&db.url, &[]).await,
    ) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(error), _) | (_, Err(error)) => return row.failed(error),
    };
    let headers = effect_headers("hang-1", &[("x-lock-ms", 1500), ("x-sleep-ms", 400)]);
    let first = {
        let (once, addr, headers) = (client(1), a.addr.clone(), headers.clone());
        tokio::spawn(async move { post(&once, &addr, "/effects", &headers, "hang-1".into()).await })
    };
    if let Err(error) = await_started(&a.addr, "hang-1").await {
        return row.failed(error);
    }
    a.signal("STOP");
    // Past the lock, and past MySQL's whole-second wait_timeout.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let second = {
        let (retrying, addr, headers) = (client(20), b.addr.clone(), headers.clone());
        tokio::spawn(
            async move { post(&retrying, &addr, "/effects", &headers, "hang-1".into()).await },
        )
    };
    // PostgreSQL and MySQL ended the frozen executor's session at its lock: B takes
    // over while A is still frozen. SQLite cannot: A holds the only writer lock.
    let took_over_frozen = db.backend != Backend::Sqlite;
    let second = if took_over_frozen {
        let second = tokio::time::timeout(Duration::from_secs(30), second).await;
        a.signal("CONT");
        second.ok()
    } else {
        tokio::time::sleep(Duration::from_millis(500)).await;
        a.signal("CONT");
        tokio::time::timeout(Duration::from_secs(60), second)
            .await
            .ok()
    };
    row.requests = 1;
    match second {
        Some(Ok(Ok(answer))) => {
            row.requests += u64::from(answer.attempts);
            row.check(answer.status == 201, || {
                format!("B answered {} {}", answer.status, answer.text())
            });
        }
        other => row.problems.push(format!("B: {other:?}")),
    }
    match first.await {
        Ok(Ok(answer)) => {
            row.check(answer.status == 503 && is_problem_json(&answer), || {
                format!(
                    "the thawed executor answered {} {}",
                    answer.status,
                    answer.text()
                )
            });
        }
        other => row.problems.push(format!("A: {other:?}")),
    }
    stats(&mut row, &b.addr).await;
    row.expect_effects(1);
    row.note = if took_over_frozen {
        "taken over while frozen; thawed one refused".into()
    } else {
        "takeover waited for the thaw (one writer)".into()
    };
    row
}

/// Scenario 3a: The executor's database session killed mid-transaction from outside.
pub async fn session_killed(db: &Fresh) -> Row {
    let mut row = Row::new("db: session killed mid-transaction", db.backend);
    if db.backend == Backend::Sqlite {
        row.note = "n/a: embedded, no session to kill".into();
        return row;
    }
    let a = match Proc::server(&db.url, &[]).await {
        Ok(a) => a,
        Err(error) => return row.failed(error),
    };
    let headers = effect_headers("killed-1", &[("x-lock-ms", 10_000), ("x-sleep-ms", 1500)]);
    let first = {
        let (once, addr, headers) = (client(1), a.addr.clone(), headers.clone());
        tokio::spawn(
            async move { post(&once, &addr, "/effects", &headers, "killed-1".into()).await },
        )
    };
    if let Err(error) = await_started(&a.addr, "killed-1").await {
        return row.failed(error);
    }
    // MariaDB's INNODB_TRX is a snapshot up to 0.1 s old.
    tokio::time::sleep(Duration::from_millis(250)).await;
    let killed = db.kill_open_transactions().await.unwrap_or(0);
    row.check(killed >= 1, || "no open transaction to kill".into());
    row.requests = 1;
    match first.await {
        Ok(Ok(answer)) => row.check(is_refusal(&answer), || {
            format!(
                "the killed executor answered {} {}",
                answer.status,
                answer.text()
            )
        }),
        other => row.problems.push(format!("first: {other:?}")),
    }
    // The same instance recovers: the retry, and a new key, both complete.
    for (key, extra) in [("killed-1", 1500), ("killed-2", 0)] {
        let headers = effect_headers(key, &[("x-lock-ms", 10_000), ("x-sleep-ms", extra)]);
        let sent = post(&client(10), &a.addr, "/effects", &headers, key.into()).await;
        row.expect_created(key, sent);
    }
    stats(&mut row, &a.addr).await;
    row.expect_effects(2);
    row.note = format!("{killed} session(s) killed; 500/503, then recovered without restart");
    row
}

/// Scenario 3b: More concurrent requests than connections: some wait past the acquire
/// timeout and are answered 503 problem+json; their retries complete.
pub async fn pool_exhausted(db: &Fresh) -> Row {
    let mut row = Row::new("db: pool exhausted", db.backend);
    let a = match Proc::server(&db.url, &[("POOL", "2"), ("ACQUIRE_MS", "300")]).await {
        Ok(a) => a,
        Err(error) => return row.failed(error),
    };
    let keys: Vec<String> = (0..12).map(|i| format!("pool-{i}")).collect();
    let mut first = JoinSet::new();
    for key in &keys {
        let (once, addr, key) = (client(1), a.addr.clone(), key.clone());
        first.spawn(async move {
            let headers = effect_headers(&key, &[("x-sleep-ms", 800)]);
            (
                key.clone(),
                post(&once, &addr, "/effects", &headers, key).await,
            )
        });
    }
    let mut refused = Vec::new();
    while let Some(joined) = first.join_next().await {
        row.requests += 1;
        match joined {
            Ok((_, Ok(answer))) if answer.status == 201 => {}
            Ok((key, Ok(answer))) => {
                row.check(answer.status == 503 && is_problem_json(&answer), || {
                    format!("{key}: {} {}", answer.status, answer.text())
                });
                refused.push(key);
            }
            other => row.problems.push(format!("{other:?}")),
        }
    }
    row.check(!refused.is_empty(), || "the pool never ran out".into());
    for key in &refused {
        let headers = effect_headers(key, &[("x-sleep-ms", 800)]);
        let sent = post(&client(20), &a.addr, "/effects", &headers, key.clone()).await;
        row.expect_created(key, sent);
    }
    stats(&mut row, &a.addr).await;
    row.expect_effects(keys.len() as u64);
    row.note = format!("{} answered 503, then completed on retry", refused.len());
    row
}

/// Scenario 4: Two instances on one database, every key sent many times at once, spread over both.
pub async fn two_instances(db: &Fresh, scale: &Scale) -> Row {
    let mut row = Row::new("storm over two instances", db.backend);
    let (a, b) = match (
        Proc::server(&db.url, &[]).await,
        Proc::server(&db.url, &[]).await,
    ) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(error), _) | (_, Err(error)) => return row.failed(error),
    };
    let retrying = client(10);
    let gate = Arc::new(Semaphore::new(64));
    let mut sent = JoinSet::new();
    for k in 0..scale.storm_keys {
        for d in 0..scale.storm_duplicates {
            let addr = if (k + d) % 2 == 0 {
                a.addr.clone()
            } else {
                b.addr.clone()
            };
            let (retrying, gate) = (retrying.clone(), Arc::clone(&gate));
            sent.spawn(async move {
                let _permit = gate.acquire_owned().await;
                let key = format!("storm-{k}");
                let headers = effect_headers(&key, &[("x-wait-ms", 10_000), ("x-sleep-ms", 5)]);
                (
                    k,
                    post(&retrying, &addr, "/effects", &headers, key.clone()).await,
                )
            });
        }
    }
    let mut answers: BTreeMap<u64, Value> = BTreeMap::new();
    while let Some(joined) = sent.join_next().await {
        match joined {
            Ok((k, Ok(answer))) => {
                row.requests += u64::from(answer.attempts);
                row.check(answer.status == 201, || {
                    format!("storm-{k}: {} {}", answer.status, answer.text())
                });
                let body: Value = serde_json::from_slice(&answer.body).unwrap_or(Value::Null);
                let first = answers.entry(k).or_insert_with(|| body.clone());
                row.check(*first == body, || {
                    format!("storm-{k}: two different answers")
                });
            }
            other => row.problems.push(format!("{other:?}")),
        }
    }
    stats(&mut row, &a.addr).await;
    row.expect_effects(scale.storm_keys);
    row.note = format!(
        "{} keys x {} duplicates",
        scale.storm_keys, scale.storm_duplicates
    );
    row
}

// ---------------------------------------------------------------------------------
// Hostile input, over raw TCP

/// One answer read off the wire (the request asked to close the connection).
struct Wire {
    status: u16,
    head: String,
    body: String,
}

impl Wire {
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.eq_ignore_ascii_case(name).then_some(v.trim())
        })
    }

    fn problem(&self) -> Option<String> {
        let json: Value = serde_json::from_str(&self.body).ok()?;
        let kind = json["type"].as_str()?;
        Some(kind.rsplit(':').next().unwrap_or(kind).to_owned())
    }
}

/// Sends `head` (request line and headers, without the blank line) and `body`,
/// the body in `chunks` pieces `pause` apart; reads the whole answer.
async fn wire(
    addr: &str,
    head: &[u8],
    body: &[u8],
    chunks: usize,
    pause: Duration,
) -> Result<Wire, String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let mut request = head.to_vec();
    request.extend_from_slice(
        format!(
            "\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        )
        .as_bytes(),
    );
    stream
        .write_all(&request)
        .await
        .map_err(|e| e.to_string())?;
    let piece = body.len().div_ceil(chunks.max(1)).max(1);
    for (i, chunk) in body.chunks(piece).enumerate() {
        if i > 0 {
            tokio::time::sleep(pause).await;
        }
        // The server may answer (408) and close before the rest is sent.
        if stream.write_all(chunk).await.is_err() {
            break;
        }
    }
    let mut raw = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut raw)).await;
    if !matches!(read, Ok(Ok(_))) && raw.is_empty() {
        return Err(format!("no answer: {read:?}"));
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("not HTTP: {text:?}"))?;
    Ok(Wire {
        status,
        head: head.to_owned(),
        body: body.to_owned(),
    })
}

/// Request line and headers for `POST path`, with `keys` as `Idempotency-Key`
/// headers (raw bytes) and `extra` headers.
fn head(path: &str, keys: &[&[u8]], extra: &[(&str, &str)]) -> Vec<u8> {
    let mut out = format!("POST {path} HTTP/1.1\r\nhost: localhost").into_bytes();
    for key in keys {
        out.extend_from_slice(b"\r\nidempotency-key: ");
        out.extend_from_slice(key);
    }
    for (name, value) in extra {
        out.extend_from_slice(format!("\r\n{name}: {value}").as_bytes());
    }
    out
}

/// What a hostile key is, the keys sent, the status and problem slug expected.
type KeyCase<'a> = (&'a str, Vec<&'a [u8]>, u16, Option<&'a str>);
/// What is sent, under which key, with which headers, and the status expected.
type Sent<'a> = (&'a str, &'a [u8], &'a [(&'a str, &'a str)], u16);

/// Scenario 5: hostile keys, colliding scopes, oversized and trickling bodies,
/// oversized responses: each gets a clear answer and loses nothing.
pub async fn hostile(db: &Fresh) -> Row {
    let mut row = Row::new("hostile input", db.backend);
    let env = [
        ("BODY_LIMIT", "1024"),
        ("BODY_TIMEOUT_MS", "800"),
        ("MAX_RESPONSE", "4096"),
    ];
    let a = match Proc::server(&db.url, &env).await {
        Ok(a) => a,
        Err(error) => return row.failed(error),
    };
    let quick = Duration::ZERO;
    let long = "k".repeat(255);
    let too_long = "k".repeat(256);
    let huge = "k".repeat(64 * 1024);
    // (what, keys, expected status, expected problem slug, or none for any 4xx body)
    let keys: Vec<KeyCase<'_>> = vec![
        ("empty key", vec![b""], 400, Some("invalid-key")),
        ("1-byte key", vec![b"a"], 201, None),
        ("255-byte key", vec![long.as_bytes()], 201, None),
        (
            "256-byte key",
            vec![too_long.as_bytes()],
            400,
            Some("invalid-key"),
        ),
        (
            "64 KiB key",
            vec![huge.as_bytes()],
            400,
            Some("invalid-key"),
        ),
        ("control character", vec![b"ab\x01c"], 400, None),
        ("tab inside", vec![b"a\tb"], 400, Some("invalid-key")),
        (
            "non-ASCII",
            vec!["ключ".as_bytes()],
            400,
            Some("invalid-key"),
        ),
        ("two headers", vec![b"x1", b"x2"], 400, Some("invalid-key")),
        (
            "the same header twice",
            vec![b"x3", b"x3"],
            400,
            Some("invalid-key"),
        ),
        ("bad quoting", vec![b"\"open"], 400, Some("invalid-key")),
        (
            "SQL-looking, quoted",
            vec![b"\"'; DROP TABLE effects; --\""],
            201,
            None,
        ),
        (
            "SQL-looking, bare",
            vec![b"';DROP/**/TABLE/**/effects;--"],
            201,
            None,
        ),
    ];
    let mut created = 0;
    for (what, keys, status, slug) in keys {
        let note = format!("note {what}");
        let got = wire(
            &a.addr,
            &head("/effects", &keys, &[]),
            note.as_bytes(),
            1,
            quick,
        )
        .await;
        row.requests += 1;
        match got {
            Ok(got) => {
                // A 64 KiB header may be refused by the HTTP layer (431) first.
                let status_ok = got.status == status || (what == "64 KiB key" && got.status == 431);
                row.check(status_ok, || format!("{what}: {} {}", got.status, got.body));
                if let (Some(slug), 400) = (slug, got.status) {
                    row.check(got.problem().as_deref() == Some(slug), || {
                        format!("{what}: {}", got.body)
                    });
                }
                created += u64::from(got.status == 201);
            }
            Err(error) => row.problems.push(format!("{what}: {error}")),
        }
    }

    // Quoted and bare forms name the same key: the second is a replay.
    for (i, key) in [&b"qb-1"[..], &b"\"qb-1\""[..]].into_iter().enumerate() {
        let got = wire(
            &a.addr,
            &head("/effects", &[key], &[]),
            b"quoted or bare",
            1,
            quick,
        )
        .await;
        row.requests += 1;
        match got {
            Ok(got) => {
                row.check(got.status == 201, || format!("quoted/bare: {}", got.status));
                let replayed = got.header("idempotent-replayed") == Some("true");
                row.check(replayed == (i == 1), || {
                    format!("quoted/bare #{i}: replayed {replayed}")
                });
                created += u64::from(i == 0);
            }
            Err(error) => row.problems.push(format!("quoted/bare: {error}")),
        }
    }

    // "a:b" + "c" and "a" + "b:c": two requests, two executions, two answers.
    let mut bodies = Vec::new();
    for (scope, key) in [("a:b", &b"c"[..]), ("a", &b"b:c"[..])] {
        let got = wire(
            &a.addr,
            &head("/effects", &[key], &[("x-scope", scope)]),
            b"collide",
            1,
            quick,
        )
        .await;
        row.requests += 1;
        match got {
            Ok(got) => {
                row.check(
                    got.status == 201 && got.header("idempotent-replayed").is_none(),
                    || {
                        format!(
                            "scope {scope}: {} {:?}",
                            got.status,
                            got.header("idempotent-replayed")
                        )
                    },
                );
                bodies.push(got.body);
                created += 1;
            }
            Err(error) => row.problems.push(format!("scope {scope}: {error}")),
        }
    }
    row.check(bodies.len() == 2 && bodies[0] != bodies[1], || {
        "colliding scopes shared an answer".into()
    });

    // Over the body limit: 413, nothing stored; under it, the same key works.
    let big = vec![b'x'; 2048];
    let checks: [(&str, &[u8], u16, Option<&str>); 2] = [
        ("over the limit", &big, 413, Some("payload-too-large")),
        ("within the limit", b"small", 201, None),
    ];
    for (what, body, status, slug) in checks {
        let got = wire(&a.addr, &head("/small", &[b"limit-1"], &[]), body, 1, quick).await;
        row.requests += 1;
        match got {
            Ok(got) => {
                row.check(got.status == status, || {
                    format!("{what}: {} {}", got.status, got.body)
                });
                if let Some(slug) = slug {
                    row.check(got.problem().as_deref() == Some(slug), || {
                        format!("{what}: {}", got.body)
                    });
                }
                created += u64::from(got.status == 201);
            }
            Err(error) => row.problems.push(format!("{what}: {error}")),
        }
    }

    // A body trickling in slower than the body timeout: 408 before any claim; the
    // same key sent properly then executes (not a replay).
    let body = vec![b'y'; 64];
    let got = wire(
        &a.addr,
        &head("/effects", &[b"trickle-1"], &[]),
        &body,
        8,
        Duration::from_millis(300),
    )
    .await;
    row.requests += 1;
    match got {
        Ok(got) => {
            row.check(got.status == 408, || {
                format!("trickle: {} {}", got.status, got.body)
            });
            row.check(got.problem().as_deref() == Some("request-timeout"), || {
                format!("trickle: {}", got.body)
            });
        }
        Err(error) => row.problems.push(format!("trickle: {error}")),
    }
    // A response larger than the store keeps: 500, rolled back, key free again.
    let sends: [Sent<'_>; 3] = [
        ("trickle retry", b"trickle-1", &[], 201),
        ("oversized response", b"big-1", &[("x-big", "10000")], 500),
        ("after the oversized response", b"big-1", &[], 201),
    ];
    for (what, key, extra, status) in sends {
        let body = if key == b"trickle-1" {
            &body[..]
        } else {
            b"big"
        };
        let got = wire(&a.addr, &head("/effects", &[key], extra), body, 1, quick).await;
        row.requests += 1;
        match got {
            Ok(got) => {
                row.check(got.status == status, || {
                    format!("{what}: {} {}", got.status, got.body)
                });
                row.check(got.header("idempotent-replayed").is_none(), || {
                    format!("{what}: a replay")
                });
                if status == 500 {
                    row.check(
                        got.problem().as_deref() == Some("response-too-large"),
                        || format!("{what}: {}", got.body),
                    );
                }
                created += u64::from(got.status == 201);
            }
            Err(error) => row.problems.push(format!("{what}: {error}")),
        }
    }

    stats(&mut row, &a.addr).await;
    row.expect_effects(created);
    row.note = format!("{created} executed; every refusal stored nothing");
    row
}

// ---------------------------------------------------------------------------------
// The database server restarted

/// Scenario 3c: the database server restarted while requests run; the app, not
/// restarted, answers 503 meanwhile and completes every key once, on retries.
/// Restarting the machine's database is opt-in (`IDEM_FAULTS_RESTART=1`, which
/// `.ci/run` sets); otherwise the row says it was skipped.
pub async fn restart(db: &Fresh) -> Row {
    let mut row = Row::new("db: server restarted under load", db.backend);
    if db.backend == Backend::Sqlite {
        row.note = "n/a: embedded, no server".into();
        return row;
    }
    if !std::env::var("IDEM_FAULTS_RESTART").is_ok_and(|v| v == "1") {
        row.note = "SKIPPED: IDEM_FAULTS_RESTART=1 lets the suite restart the server".into();
        return row;
    }
    let a = match Proc::server(&db.url, &[("ACQUIRE_MS", "2000")]).await {
        Ok(a) => a,
        Err(error) => return row.failed(error),
    };
    let keys = 40;
    let retrying = client(40);
    let gate = Arc::new(Semaphore::new(4));
    let mut sent = JoinSet::new();
    for k in 0..keys {
        let (retrying, gate, addr) = (retrying.clone(), Arc::clone(&gate), a.addr.clone());
        sent.spawn(async move {
            let _permit = gate.acquire_owned().await;
            let key = format!("restart-{k}");
            let headers = effect_headers(&key, &[("x-sleep-ms", 300)]);
            // Sent once first, to see what the outage answers; then retried.
            let first = post(&client(1), &addr, "/effects", &headers, key.clone()).await;
            let retried = match &first {
                Ok(answer) if answer.status == 201 => None,
                _ => Some(post(&retrying, &addr, "/effects", &headers, key.clone()).await),
            };
            (k, first, retried)
        });
    }
    // Restarted once the load flows: a key of the second wave has reached its
    // handler, so the pool is connected and the next 35 keys, four at a time and
    // 300 ms each inside a transaction (about 2.6 s), are still to run. A fixed
    // pause met no request when the app's first connections were slow to open;
    // at 100 ms a key (0.9 s in all) every request once finished before
    // `pg_ctlcluster restart` reached the sessions.
    if let Err(error) = await_started(&a.addr, "restart-4").await {
        row.problems.push(error);
    }
    if let Err(error) = crate::db::restart_server(db.backend).await {
        row.problems.push(format!("restart: {error}"));
    }
    let mut retried = 0;
    while let Some(joined) = sent.join_next().await {
        let Ok((k, first, again)) = joined else {
            row.problems.push("a request task failed".into());
            continue;
        };
        row.requests += 1;
        let last = match (first, again) {
            (first, None) => first,
            (first, Some(again)) => {
                retried += 1;
                row.requests += 1;
                match &first {
                    Ok(answer) => row.check(is_refusal(answer), || {
                        format!(
                            "restart-{k} in the outage: {} {}",
                            answer.status,
                            answer.text()
                        )
                    }),
                    Err(error) => row.problems.push(format!("restart-{k}: {error}")),
                }
                again
            }
        };
        match last {
            Ok(answer) => {
                row.requests += u64::from(answer.attempts) - 1;
                row.check(answer.status == 201, || {
                    format!("restart-{k}: {} {}", answer.status, answer.text())
                });
            }
            Err(error) => row.problems.push(format!("restart-{k}: {error}")),
        }
    }
    row.check(retried > 0, || "no request met the restart".into());
    // Recovered without restarting the app: a new key completes at once.
    match post(
        &client(1),
        &a.addr,
        "/effects",
        &effect_headers("restart-after", &[]),
        "restart-after".into(),
    )
    .await
    {
        Ok(answer) => {
            row.requests += 1;
            row.check(answer.status == 201, || {
                format!("after the restart: {} {}", answer.status, answer.text())
            });
        }
        Err(error) => row.problems.push(format!("after the restart: {error}")),
    }
    stats(&mut row, &a.addr).await;
    row.expect_effects(keys + 1);
    row.note = format!(
        "{retried} of {keys} keys answered 500/503 problem+json in the outage, then completed"
    );
    row
}

/// Scenario 3d: another session holds the business table locked (a migration, a
/// backup) for longer than the endpoint's lock: requests meanwhile end in 500 or 503
/// with their work rolled back and their keys released, and complete once it is free.
pub async fn table_locked(db: &Fresh) -> Row {
    let mut row = Row::new("db: table locked by another session", db.backend);
    // SQLite: give up on the writer lock after 500 ms instead of 30 s.
    let a = match Proc::server(&db.url, &[("BUSY_MS", "500")]).await {
        Ok(a) => a,
        Err(error) => return row.failed(error),
    };
    // The table must exist before another session can lock it.
    if let Err(error) = get_json(&a.addr, "/stats", None).await {
        return row.failed(error);
    }
    let holder = match db.lock_effects(Duration::from_millis(2500)).await {
        Ok(holder) => holder,
        Err(error) => return row.failed(format!("lock: {error}")),
    };
    let keys: Vec<String> = (0..5).map(|i| format!("locked-{i}")).collect();
    let mut first = JoinSet::new();
    for key in &keys {
        let (once, addr, key) = (client(1), a.addr.clone(), key.clone());
        first.spawn(async move {
            let headers = effect_headers(&key, &[("x-lock-ms", 800)]);
            (
                key.clone(),
                post(&once, &addr, "/effects", &headers, key).await,
            )
        });
    }
    while let Some(joined) = first.join_next().await {
        row.requests += 1;
        match joined {
            Ok((key, Ok(answer))) => row.check(is_refusal(&answer), || {
                format!("{key} while locked: {} {}", answer.status, answer.text())
            }),
            other => row.problems.push(format!("{other:?}")),
        }
    }
    let _ = holder.await;
    for key in &keys {
        let headers = effect_headers(key, &[("x-lock-ms", 800)]);
        let sent = post(&client(10), &a.addr, "/effects", &headers, key.clone()).await;
        row.expect_created(key, sent);
    }
    stats(&mut row, &a.addr).await;
    row.expect_effects(keys.len() as u64);
    row.note = "refused while locked, rolled back; completed once free".into();
    row
}
