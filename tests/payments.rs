//! The examples, run as real processes and driven over HTTP: the payments
//! example's contract (README and `examples/payments/main.rs`) on SQLite,
//! PostgreSQL and MySQL, and the quick start's.

#![allow(missing_docs)]

#[path = "support/example.rs"]
mod example;
#[path = "support/openapi.rs"]
mod openapi;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::sync::Barrier;

struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn start(database_url: &str, dir: &std::path::Path) -> Server {
    let command = {
        let url = database_url.to_owned();
        move || {
            let mut command = Command::new(example::binary());
            command
                .env("DATABASE_URL", url)
                .env("PROVIDER_LATENCY_MS", "150");
            command
        }
    };
    let (server, first) = launch(command, dir).await;
    let backend = match database_url.split(':').next() {
        Some("postgres") => "PostgreSQL",
        Some("mysql") => "MySQL",
        _ => "SQLite",
    };
    assert!(first.contains(backend), "{first}");
    server
}

/// Starts an example on any free port in `dir`; returns it with its first line.
async fn launch(
    command: impl FnOnce() -> Command + Send + 'static,
    dir: &std::path::Path,
) -> (Server, String) {
    let child = tokio::task::spawn_blocking({
        let dir = dir.to_owned();
        move || {
            command()
                .env("BIND", "127.0.0.1:0")
                .current_dir(dir)
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("start the example")
        }
    })
    .await
    .expect("spawn");
    // Owned by the guard from here on: a failed assertion below still kills it.
    let mut server = Server {
        child,
        addr: String::new(),
    };
    let stdout = server.child.stdout.take().expect("stdout");
    let stdout = tokio::process::ChildStdout::from_std(stdout).expect("async stdout");
    let mut lines = BufReader::new(stdout).lines();
    let first = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
        .await
        .expect("the example printed nothing within 60 s")
        .expect("read stdout")
        .expect("the example exited");
    server.addr = first
        .split("http://")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address in {first:?}"))
        .to_owned();
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (server, first)
}

#[derive(Debug)]
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    fn problem(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        let kind = self.json()["type"].as_str().unwrap_or_default().to_owned();
        kind.rsplit('/').next().unwrap_or_default().to_owned()
    }
}

/// One HTTP/1.1 request on its own connection.
async fn call(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Reply {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(body);
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.expect("read");
    let text = String::from_utf8(raw).expect("utf-8 response");
    let (head, body) = text.split_once("\r\n\r\n").expect("head and body");
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .expect("status line");
    let headers = lines
        .filter_map(|l| l.split_once(": "))
        .map(|(n, v)| (n.to_ascii_lowercase(), v.to_owned()))
        .collect();
    Reply {
        status,
        headers,
        body: body.to_owned(),
    }
}

const JSON: (&str, &str) = ("content-type", "application/json");

async fn pay(addr: &str, user: &str, key: &str, body: &str) -> Reply {
    let auth = format!("Bearer {user}");
    call(
        addr,
        "POST",
        "/payments",
        &[("authorization", &auth), ("idempotency-key", key), JSON],
        body,
    )
    .await
}

async fn ledger(addr: &str, user: &str) -> Value {
    let auth = format!("Bearer {user}");
    call(addr, "GET", "/payments", &[("authorization", &auth)], "")
        .await
        .json()
}

async fn charges(addr: &str) -> Vec<Value> {
    let reply = call(addr, "GET", "/provider/charges", &[], "").await;
    reply.json()["charges"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

async fn contract(addr: &str) {
    let body = r#"{"amount": 1200, "currency": "JPY", "to": "bob"}"#;

    let anonymous = call(
        addr,
        "POST",
        "/payments",
        &[("idempotency-key", "k1"), JSON],
        body,
    )
    .await;
    assert_eq!(anonymous.status, 401);
    let keyless = call(
        addr,
        "POST",
        "/payments",
        &[("authorization", "Bearer alice"), JSON],
        body,
    )
    .await;
    assert_eq!(
        (keyless.status, keyless.problem()),
        (400, "missing-key".into())
    );
    let bad = pay(addr, "alice", "k1", r#"{"amount": "lots"}"#).await;
    assert_eq!(bad.status, 422, "{bad:?}");
    let negative = pay(
        addr,
        "alice",
        "k-neg",
        r#"{"amount": -5, "currency": "JPY", "to": "bob"}"#,
    )
    .await;
    assert_eq!(negative.status, 422);
    assert!(
        charges(addr).await.is_empty(),
        "no charge for refused requests"
    );

    let first = pay(addr, "alice", "k1", body).await;
    assert_eq!(first.status, 201, "{first:?}");
    let payment = first.json();
    for field in ["id", "amount", "currency", "to", "charge_id"] {
        assert!(!payment[field].is_null(), "{field} in {payment}");
    }
    assert_eq!(payment["amount"], 1200);
    let id = payment["id"].as_i64().expect("numeric id");
    assert_eq!(
        first.header("location"),
        Some(format!("/payments/{id}").as_str())
    );

    let again = pay(addr, "alice", "\"k1\"", body).await;
    assert_eq!(again.status, 201);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body, "replayed byte for byte");
    assert_eq!(again.header("location"), first.header("location"));
    assert_eq!(first.header("idempotency-key-ttl"), Some("86400"));
    assert_eq!(again.header("idempotency-key-ttl"), Some("86400"));

    let other = r#"{"amount": 9999, "currency": "JPY", "to": "bob"}"#;
    let mismatch = pay(addr, "alice", "k1", other).await;
    assert_eq!(
        (mismatch.status, mismatch.problem()),
        (422, "payload-mismatch".into())
    );

    let huge = r#"{"amount": 5000000, "currency": "JPY", "to": "bob"}"#;
    let broke = pay(addr, "alice", "k-huge", huge).await;
    assert_eq!(
        (broke.status, broke.problem()),
        (402, "insufficient-funds".into())
    );
    let broke_again = pay(addr, "alice", "k-huge", huge).await;
    assert_eq!(broke_again.status, 402);
    assert_eq!(broke_again.header("idempotent-replayed"), Some("true"));
    assert_eq!(broke_again.body, broke.body);

    let mine = ledger(addr, "alice").await;
    assert_eq!(mine["balance"], 1_000_000 - 1200);
    assert_eq!(mine["payments"].as_array().map(Vec::len), Some(1));
    assert_eq!(ledger(addr, "nobody").await["balance"], 1_000_000);
    let path = format!("/payments/{id}");
    let own = call(addr, "GET", &path, &[("authorization", "Bearer alice")], "").await;
    assert_eq!(own.status, 200);
    let foreign = call(
        addr,
        "GET",
        &path,
        &[("authorization", "Bearer mallory")],
        "",
    )
    .await;
    assert_eq!(foreign.status, 404);

    // The same key from another user is another payment, with its own charge.
    let bob = pay(addr, "bob", "k1", body).await;
    assert_eq!(bob.status, 201);
    assert!(bob.header("idempotent-replayed").is_none());
    let all = charges(addr).await;
    assert_eq!(all.len(), 2, "{all:?}");
    assert_ne!(all[0]["key"], all[1]["key"], "relayed keys differ per user");
}

/// Many concurrent retries of one payment: one payment, one charge, one debit; and
/// since the endpoint waits for an in-flight first request, no 409: every one of
/// them gets the payment.
async fn storm(addr: &str) {
    let body = r#"{"amount": 700, "currency": "JPY", "to": "erin"}"#;
    let barrier = Arc::new(Barrier::new(20));
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let (addr, barrier) = (addr.to_owned(), Arc::clone(&barrier));
            tokio::spawn(async move {
                barrier.wait().await;
                pay(&addr, "storm", "k-storm", body).await
            })
        })
        .collect();
    let mut created = Vec::new();
    for task in tasks {
        let reply = task.await.expect("request");
        match reply.status {
            201 => created.push(reply.body),
            other => panic!("unexpected {other}: {reply:?}"),
        }
    }
    assert_eq!(created.len(), 20);
    assert!(
        created.iter().all(|b| *b == created[0]),
        "one answer for every 2xx"
    );
    let mine = ledger(addr, "storm").await;
    assert_eq!(mine["payments"].as_array().map(Vec::len), Some(1));
    assert_eq!(mine["balance"], 1_000_000 - 700);
    let storm_charges = charges(addr)
        .await
        .into_iter()
        .filter(|c| c["user"] == "storm")
        .count();
    assert_eq!(storm_charges, 1);
}

fn scratch_dir() -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!("idem_payments_{}_{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn payments_example_on_sqlite_default() {
    let dir = scratch_dir();
    // The default DATABASE_URL: payments.db in the working directory.
    let server = {
        let url = "sqlite://payments.db";
        start(url, &dir).await
    };
    assert!(
        dir.join("payments.db").exists(),
        "created in the working directory"
    );
    let started = Instant::now();
    contract(&server.addr).await;
    storm(&server.addr).await;
    eprintln!("sqlite payments contract: {:?}", started.elapsed());
    documented(&server.addr).await;
    metrics_count_what_happened(&server.addr).await;
    drop(server);
    // The demo's default: a scratch database of its own, removed when it ends.
    let pid = demo(None, &dir).await;
    let scratch = std::fs::read_dir(std::env::temp_dir())
        .expect("temp dir")
        .filter_map(Result::ok)
        .filter(|entry| {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            name.starts_with("payments-demo-") && name.contains(&format!("-{pid}-"))
        })
        .count();
    assert_eq!(scratch, 0, "the demo removes its scratch database");
    let _ = std::fs::remove_dir_all(dir);
}

/// The example's OpenAPI document (utoipa, with idem's `KeyHeader` and
/// `ReplaysWithTtl`): valid, and telling clients that `POST /payments` takes a key,
/// may answer a replay, and what idem answers by itself; the reads take no key.
async fn documented(addr: &str) {
    let reply = call(addr, "GET", "/openapi.json", &[], "").await;
    assert_eq!(reply.status, 200, "{reply:?}");
    let document = reply.json();
    openapi::validate("payments", &document);
    let paths = &document["paths"];
    openapi::assert_keyed(&document, &paths["/payments"]["post"], "201", true, true);
    openapi::assert_unkeyed(&paths["/payments"]["get"]);
    openapi::assert_unkeyed(&paths["/payments/{id}"]["get"]);
    let body = &paths["/payments"]["post"]["requestBody"]["content"]["application/json"];
    assert!(body["schema"].is_object(), "{body:#}");
}

/// `payments demo` (on `url`, or its own scratch SQLite file): every logical payment
/// charged once, and said so on stdout. Returns the demo's process id.
async fn demo(url: Option<&str>, dir: &std::path::Path) -> u32 {
    let mut command = tokio::process::Command::new(example::binary());
    command
        .arg("demo")
        .current_dir(dir)
        .env_remove("DATABASE_URL");
    if let Some(url) = url {
        command.env("DATABASE_URL", url);
    }
    let child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start the demo");
    let pid = child.id().expect("a running demo");
    let output = tokio::time::timeout(Duration::from_secs(120), child.wait_with_output())
        .await
        .expect("the demo ended within 120 s")
        .expect("demo output");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let count = |label: &str| -> u64 {
        stdout
            .lines()
            .find_map(|line| line.trim().strip_prefix(label))
            .and_then(|rest| rest.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {label:?} in {stdout}"))
    };
    assert_eq!(count("payments recorded"), 40, "{stdout}");
    assert_eq!(count("provider charges"), 40, "{stdout}");
    assert_eq!(count("executions (handler ran)"), 40, "{stdout}");
    assert!(count("responses lost after commit (502)") > 0, "{stdout}");
    assert!(count("replays of a recorded response") > 0, "{stdout}");
    assert!(
        count("requests sent, every attempt counted") > 200,
        "{stdout}"
    );
    pid
}

/// Runs the contract and the storm against a fresh database on the server at
/// `$env` (default `fallback`); SKIPPED when unreachable, a failure under CI=true.
async fn on_server<DB>(env: &str, fallback: &str, drop_suffix: &str)
where
    DB: sqlx::Database,
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
{
    let base = std::env::var(env).unwrap_or_else(|_| fallback.to_owned());
    let admin = match sqlx::Pool::<DB>::connect(&base).await {
        Ok(admin) => admin,
        Err(error) if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") => {
            panic!("{} not reachable at {base}: {error}", DB::NAME)
        }
        Err(error) => {
            eprintln!(
                "SKIPPED: {} not reachable at {base} ({error}); CI=true makes this a failure",
                DB::NAME
            );
            return;
        }
    };
    let database = format!("idem_payments_{}", std::process::id());
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
        .execute(&admin)
        .await
        .expect("create database");
    let url = match base.rsplit_once('/') {
        Some((server, _)) => format!("{server}/{database}"),
        None => panic!("no database in {base}"),
    };
    let dir = scratch_dir();
    let server = start(&url, &dir).await;
    contract(&server.addr).await;
    storm(&server.addr).await;
    drop(server);
    demo(Some(&url), &dir).await;
    let drop_db = format!("DROP DATABASE {database}{drop_suffix}");
    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(drop_db))
        .execute(&admin)
        .await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn payments_example_on_postgres() {
    let fallback = "postgres://postgres@127.0.0.1:5432/postgres";
    on_server::<sqlx::Postgres>("IDEM_TEST_POSTGRES_URL", fallback, " WITH (FORCE)").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn payments_example_on_mysql() {
    let fallback = "mysql://root@127.0.0.1:3306/test";
    on_server::<sqlx::MySql>("IDEM_TEST_MYSQL_URL", fallback, "").await;
}

/// The quick start, as a user copies it: one order per (user, key) however often it
/// is sent, the same 201 replayed, and the same key from another user is another
/// order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn quickstart_example_orders_once() {
    let dir = scratch_dir();
    let (server, _) = launch(|| Command::new(example::quickstart()), &dir).await;
    let order = |user: &'static str| {
        let addr = server.addr.clone();
        async move {
            let headers = [("x-user", user), ("idempotency-key", "order-1"), JSON];
            let body = r#"{"item": "book", "quantity": 2}"#;
            call(&addr, "POST", "/orders", &headers, body).await
        }
    };
    let first = order("alice").await;
    assert_eq!(first.status, 201, "{first:?}");
    let again = order("alice").await;
    assert_eq!(
        (again.status, again.body.as_str()),
        (201, first.body.as_str())
    );
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    let bob = order("bob").await;
    assert_eq!(bob.status, 201);
    assert!(bob.header("idempotent-replayed").is_none());
    let pen = r#"{"item": "pen", "quantity": 1}"#;
    let keyless = call(
        &server.addr,
        "POST",
        "/orders",
        &[("x-user", "alice"), JSON],
        pen,
    )
    .await;
    assert_eq!(keyless.status, 400, "{keyless:?}");
    let list = call(&server.addr, "GET", "/orders", &[("x-user", "alice")], "").await;
    assert_eq!(list.json().as_array().map(Vec::len), Some(1), "{list:?}");
    drop(server);
    let _ = std::fs::remove_dir_all(dir);
}

/// The value of the Prometheus sample whose line starts with `name{` and holds
/// every label of `labels`.
fn sample(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|line| {
            line.starts_with(&format!("{name}{{")) || line.starts_with(&format!("{name} "))
        })
        .find(|line| labels.iter().all(|label| line.contains(label)))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
}

/// `/metrics` (feature `metrics`, Prometheus text): requests by outcome and
/// endpoint (the route, not the path), claim and record latency, claims in flight.
async fn metrics_count_what_happened(addr: &str) {
    let text = call(addr, "GET", "/metrics", &[], "").await.body;
    let route = r#"endpoint="POST /payments""#;
    let executed = sample(
        &text,
        "idem_requests_total",
        &[route, r#"outcome="executed""#],
    );
    assert!(executed.is_some_and(|n| n >= 1.0), "{text}");
    let replayed = sample(
        &text,
        "idem_requests_total",
        &[route, r#"outcome="replayed""#],
    );
    assert!(replayed.is_some_and(|n| n >= 1.0), "{text}");
    let mismatch = sample(
        &text,
        "idem_requests_total",
        &[route, r#"outcome="mismatch""#],
    );
    assert!(mismatch.is_some_and(|n| n >= 1.0), "{text}");
    let claims = sample(&text, "idem_claim_duration_seconds_count", &[route]);
    assert!(
        claims.is_some_and(|n| n >= executed.unwrap_or_default()),
        "{text}"
    );
    assert!(
        sample(&text, "idem_record_duration_seconds_count", &[route]).is_some(),
        "{text}"
    );
    assert_eq!(
        sample(&text, "idem_claims_in_flight", &[]),
        Some(0.0),
        "{text}"
    );
}
