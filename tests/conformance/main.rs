//! The conformance suite: the contract of `docs/contract.md` (§2–§6, cited below as
//! §N) and its invariants I1–I4, written once and run on every backend against a
//! real database (one private schema or file per test).
//!
//! PostgreSQL is found at `IDEM_TEST_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`), MySQL/MariaDB at
//! `IDEM_TEST_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`); when a server
//! cannot be reached its tests say SKIPPED, except under `CI=true`, where they fail.

#![allow(missing_docs, unreachable_pub)]
// Built without a backend, the suite is the one failing test below.
#![cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code, unused_imports, unused_macros)
)]

#[cfg(not(any(feature = "postgres", feature = "mysql", feature = "sqlite")))]
#[test]
fn a_backend_is_enabled() {
    panic!(
        "the conformance suite runs on the backends it is built with: \
         `cargo test --all-features`, or one alone (`--features sqlite`)"
    );
}

mod app;
mod bank;
#[cfg(all(feature = "lapin", feature = "async-nats"))]
mod broker;
mod cache;
#[cfg(feature = "mysql")]
mod cluster;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod deadlock;
mod edges;
#[cfg(feature = "mysql")]
mod ended;
mod fence;
mod harness;
mod json;
mod kit;
mod message;
mod operator;
#[cfg(feature = "postgres")]
mod partitions;
mod realistic;
mod sealing;
#[cfg(feature = "sea-orm")]
mod seaorm;
mod session;
mod upload;
#[cfg(feature = "webhooks")]
mod webhook;
#[cfg(feature = "sqlite")]
mod writer;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::Method;
use idem_axum::{Outcome, Sweep};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::Barrier;

use app::{Got, Req, router, send};
use cache::{
    a_failed_database_ends_the_copies, completed_keys_are_replayed_from_memory,
    forgotten_keys_run_again, kept_responses_end_with_their_key, only_committed_responses_are_kept,
};
use edges::{
    any_legal_scope_and_key_finds_its_own_row, content_type_is_part_of_the_identity,
    content_types_compare_as_media_types, expired_key_duplicates_answer_at_once,
    inconsistent_options_are_refused, migrate_upgrades_a_table_of_the_previous_release,
    mismatches_name_the_part_that_differs, the_table_holds_legal_requests_and_responses,
};
use fence::stalled_claims_never_start_beside_a_takeover;
use harness::Harness;
#[cfg(feature = "mysql")]
use harness::My;
#[cfg(feature = "sqlite")]
use harness::{Lite, LiteDeferred};
#[cfg(feature = "postgres")]
use harness::{Pg, PgParted};
use json::{browser_sent_keys_are_keys, json_fingerprints_compare_values_not_bytes};
use kit::the_testing_kit_proves_handlers_exactly_once;
use message::{
    deliveries_run_once_and_give_back_their_result, message_attribute_runs_each_message_once,
    message_records_are_sealed, messages_and_requests_never_share_a_key,
    redeliveries_at_once_run_each_message_once,
};
use operator::operators_never_delete_or_wait_for_a_key_in_flight;
use realistic::{
    caught_database_errors_are_recorded, handler_savepoints_keep_working,
    idem_extractors_work_in_any_handler, kept_replays_skip_the_last_extractor,
    nested_routes_keep_their_identity, storms_across_instances_charge_each_key_once,
    storms_over_two_instances_execute_each_key_once,
};
use sealing::{
    audit_counts_what_each_key_still_holds, changed_records_are_never_replayed,
    downgraded_records_are_never_replayed, fingerprints_of_a_retired_key_are_never_another_body,
    records_open_only_in_their_context, reseal_lets_an_old_key_leave_the_ring,
    rotation_keeps_every_key_answered, rotation_rolled_out_never_answers_500,
    sealed_records_replay_and_hold_no_plaintext, sealing_turns_on_and_off_without_losing_keys,
};
use session::{
    duplicates_never_run_while_a_handler_has_ended_its_transaction,
    handler_session_changes_never_reach_idem,
    handlers_that_end_their_own_transaction_never_run_twice,
};
use upload::{multipart_keys_of_earlier_releases_still_replay, uploads_are_retried_by_their_parts};
#[cfg(feature = "webhooks")]
use webhook::{
    a_forged_delivery_claims_nothing_and_the_real_one_runs_once,
    webhook_duplicates_at_once_run_each_event_once,
    webhook_keys_replay_and_refuse_as_the_header_does,
};

const BODY: &str = r#"{"amount":100,"currency":"JPY"}"#;

/// Runs one suite test on backend `H`, sized for the default response limit.
async fn start<H: Harness>() -> Option<H> {
    H::start(idem_axum::DEFAULT_MAX_RESPONSE_BYTES).await
}

async fn send_all(app: &axum::Router, reqs: Vec<Req>) -> Vec<Got> {
    let barrier = Arc::new(Barrier::new(reqs.len()));
    let tasks: Vec<_> = reqs
        .into_iter()
        .map(|req| {
            let app = app.clone();
            let barrier = Arc::clone(&barrier);
            tokio::spawn(async move {
                barrier.wait().await;
                send(&app, &req).await
            })
        })
        .collect();
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.expect("request task"));
    }
    out
}

/// Waits until the handler of `key` has started (its claim is held).
pub async fn await_started(key: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !app::started(key) {
        assert!(
            Instant::now() < deadline,
            "the handler of {key} never started"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Waits until `scope` holds `count` completed keys; fails if claims stay stuck.
async fn await_completed<H: Harness>(h: &H, scope: &str, count: usize) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let rows = h.key_rows(scope).await;
        if rows.len() == count && rows.iter().all(|(_, r)| r.state == "completed") {
            return;
        }
        assert!(Instant::now() < deadline, "claims stuck: {rows:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sessions still inside a transaction once the traffic is over, after up to
/// 5 s: a connection's rollback and return to the pool may run in a task of its
/// own after the answer is out, which a loaded machine runs late; a transaction
/// left open stays open.
async fn transactions_left<H: Harness>(h: &H) -> i64 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let open = h.open_transactions().await;
        if open == 0 || Instant::now() >= deadline {
            return open;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// 409 `in-flight`, with `Retry-After` whole seconds within the longest lock the
/// suite gives (30 s); returns them.
fn assert_in_flight(got: &Got) -> u64 {
    assert_eq!(got.status, 409, "{}", got.text());
    assert_eq!(got.problem().as_deref(), Some("in-flight"));
    let seconds: u64 = got
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("Retry-After in whole seconds");
    assert!((1..=30).contains(&seconds), "Retry-After {seconds}");
    seconds
}

/// 409 `in-flight` while a holder with a `lock_secs` lock has only just started:
/// `Retry-After` is what is left of that lock, not a constant.
fn assert_in_flight_for(got: &Got, lock_secs: u64) {
    let seconds = assert_in_flight(got);
    assert!(
        seconds > lock_secs / 2 && seconds <= lock_secs,
        "Retry-After {seconds} for a fresh {lock_secs} s lock"
    );
}

/// I1, §4.1: of 50 identical requests released together, one executes; the other
/// 49 are told 409 at once, all while the winner is still held at a gate (so none
/// of them waited for it, and none could be a replay).
async fn concurrent_duplicates_execute_once<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    let key = format!("storm-{}", unique_suffix());
    let req = Req::post("alice", &key, BODY)
        .header("x-gate", &key)
        .header("x-lock-ms", 30_000);
    let barrier = Arc::new(Barrier::new(50));
    let mut requests = tokio::task::JoinSet::new();
    for _ in 0..50 {
        let (app, req, barrier) = (app.clone(), req.clone(), Arc::clone(&barrier));
        requests.spawn(async move {
            barrier.wait().await;
            send(&app, &req).await
        });
    }
    let mut early = Vec::new();
    // Far longer than answering takes, far shorter than SQLite's 30 s busy timeout.
    let waited = tokio::time::timeout(Duration::from_secs(10), async {
        while early.len() < 49 {
            early.push(requests.join_next().await.expect("task").expect("request"));
        }
    })
    .await;
    app::open_gate(&key);
    assert!(
        waited.is_ok(),
        "a duplicate waited for the executor: {early:?}"
    );
    for got in &early {
        assert_in_flight_for(got, 30);
    }
    let winner = requests.join_next().await.expect("task").expect("request");
    assert_eq!(winner.status, 201, "{}", winner.text());
    assert_eq!(winner.outcome, Some(Outcome::Executed));
    assert_eq!(h.effects("alice").await, 1, "one business row");

    let after = send(&app, &Req::post("alice", &key, BODY)).await;
    assert_eq!(after.outcome, Some(Outcome::Replayed));
    assert_eq!(after.body, winner.body);
    assert_eq!(h.effects("alice").await, 1);
    let rows = h.key_rows("alice").await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].1.state, "completed");
    h.finish().await;
}

/// §4.1: while one execution holds the key, every duplicate is answered 409 at
/// once: none waits for it (the executor is held at a gate until all have answered).
async fn duplicates_in_flight_answer_at_once<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    let key = format!("k-gated-{}", unique_suffix());
    let req = Req::post("alice", &key, BODY).header("x-lock-ms", 20_000);
    let first = {
        let (app, req) = (app.clone(), req.clone().header("x-gate", &key));
        tokio::spawn(async move { send(&app, &req).await })
    };
    await_started(&key).await;
    let duplicates = tokio::time::timeout(
        Duration::from_secs(10),
        send_all(&app, vec![req.clone(); 30]),
    )
    .await;
    app::open_gate(&key);
    let duplicates = duplicates.expect("a duplicate waited for the executor");
    for got in &duplicates {
        assert_in_flight_for(got, 20);
    }
    let first = first.await.expect("first request");
    assert_eq!(first.outcome, Some(Outcome::Executed));
    let replay = send(&app, &req).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.body, first.body);
    assert_eq!(h.effects("alice").await, 1);
    h.finish().await;
}

/// `wait`: 50 duplicates released together while the first is held at a gate wait
/// for it instead of answering 409, without holding database connections while
/// they wait, and all answer its response: one execution, 50 identical 2xx.
async fn waiting_duplicates_all_get_the_response<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    let key = format!("k-wait-{}", unique_suffix());
    let req = Req::post("alice", &key, BODY)
        .header("x-wait-ms", 20_000)
        .header("x-lock-ms", 25_000);
    let first = {
        let (app, req) = (app.clone(), req.clone().header("x-gate", &key));
        tokio::spawn(async move { send(&app, &req).await })
    };
    await_started(&key).await;
    let duplicates = {
        let app = app.clone();
        let reqs = vec![req.clone(); 49];
        tokio::spawn(async move { send_all(&app, reqs).await })
    };
    // Let every duplicate look once and settle into waiting.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Connections in use, at their fewest: the executor's, and at most a look or
    // two in progress. Had waiters kept theirs, the pool (smaller than 49) would
    // stay full for their whole wait. Sampled until it is seen, for up to 5 s: on
    // a loaded runner the duplicates' first looks may still be going on.
    let pool = h.store().pool();
    let mut fewest = u32::MAX;
    let sampled_until = Instant::now() + Duration::from_secs(5);
    while fewest > 3 && Instant::now() < sampled_until {
        let in_use = pool.size() - u32::try_from(pool.num_idle()).unwrap_or(0);
        fewest = fewest.min(in_use);
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    assert!(
        fewest <= 3,
        "{fewest} connections held by waiting duplicates"
    );
    assert!(
        !duplicates.is_finished(),
        "duplicates answered before the first"
    );
    app::open_gate(&key);

    let first = first.await.expect("first request");
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!(first.outcome, Some(Outcome::Executed));
    let duplicates = duplicates.await.expect("duplicates");
    for got in &duplicates {
        assert_eq!(got.status, 201, "{}", got.text());
        assert_eq!(got.outcome, Some(Outcome::Replayed));
        assert_eq!(got.body, first.body);
        assert_eq!(got.header("location"), first.header("location"));
    }
    assert_eq!(h.effects("alice").await, 1, "one execution");
    h.finish().await;
}

/// I1 across instances: each answers from the rows alone, whatever it saw itself.
/// A key held by one is 409 on another, one completed by one is replayed byte for
/// byte by another, and duplicates spread over three instances execute once.
async fn instances_share_keys<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let one = router(&h);
    let two = app::router_on::<H>(h.another_instance());
    let three = app::router_on::<H>(h.another_instance());

    let key = format!("k-shared-{}", unique_suffix());
    let req = Req::post("alice", &key, BODY).header("x-lock-ms", 20_000);
    let first = {
        let (app, req) = (one.clone(), req.clone().header("x-gate", &key));
        tokio::spawn(async move { send(&app, &req).await })
    };
    await_started(&key).await;
    assert_in_flight_for(&send(&two, &req).await, 20);
    app::open_gate(&key);
    let first = first.await.expect("first request");
    assert_eq!(first.outcome, Some(Outcome::Executed), "{}", first.text());
    let replay = send(&three, &req).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed), "{}", replay.text());
    assert_eq!(replay.status, first.status);
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header("location"), first.header("location"));
    let other_body = Req::post("alice", &key, r#"{"amount":999,"currency":"JPY"}"#);
    assert_eq!(send(&two, &other_body).await.status, 422);
    assert_eq!(h.effects("alice").await, 1);

    // 10 keys × 12 duplicates, released together, spread over the instances, each
    // waiting for whoever executes: one execution per key, one answer per key.
    let apps = [one, two, three];
    let barrier = Arc::new(Barrier::new(120));
    let mut requests = tokio::task::JoinSet::new();
    for n in 0..120 {
        let key = format!("k-spread-{n_key}-{key}", n_key = n % 10);
        let req = Req::post("bob", &key, BODY)
            .header("x-wait-ms", 20_000)
            .header("x-lock-ms", 25_000);
        let (app, barrier) = (apps[n % 3].clone(), Arc::clone(&barrier));
        requests.spawn(async move {
            barrier.wait().await;
            (key, send(&app, &req).await)
        });
    }
    let mut answers: std::collections::HashMap<String, Vec<Got>> = Default::default();
    while let Some(done) = requests.join_next().await {
        let (key, got) = done.expect("request");
        answers.entry(key).or_default().push(got);
    }
    assert_eq!(answers.len(), 10);
    for (key, got) in &answers {
        let executed: Vec<_> = got
            .iter()
            .filter(|g| g.outcome == Some(Outcome::Executed))
            .collect();
        assert_eq!(executed.len(), 1, "{key}: {got:?}");
        for g in got {
            assert_eq!(g.status, 201, "{key}: {}", g.text());
            assert_eq!(g.body, executed[0].body, "{key}");
        }
    }
    assert_eq!(h.effects("bob").await, 10, "one execution per key");
    h.finish().await;
}

/// `wait` is a bound: a duplicate still waiting when it passes is answered 409,
/// with `Retry-After` from what is left of the holder's lock.
async fn waiting_ends_in_409_at_its_bound<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    let key = format!("k-wait-bound-{}", unique_suffix());
    let req = Req::post("alice", &key, BODY)
        .header("x-wait-ms", 300)
        .header("x-lock-ms", 20_000);
    let first = {
        let (app, req) = (app.clone(), req.clone().header("x-gate", &key));
        tokio::spawn(async move { send(&app, &req).await })
    };
    await_started(&key).await;
    let waited = Instant::now();
    let duplicate = send(&app, &req).await;
    let waited = waited.elapsed();
    app::open_gate(&key);
    assert_in_flight_for(&duplicate, 20);
    assert!(
        waited >= Duration::from_millis(300),
        "answered after {waited:?}"
    );
    let first = first.await.expect("first request");
    assert_eq!(first.outcome, Some(Outcome::Executed));
    assert_eq!(h.effects("alice").await, 1);
    h.finish().await;
}

/// `wait`, when the first execution fails: its work is rolled back and the key
/// released, one waiting duplicate claims it and executes, the rest replay that.
async fn waiting_duplicates_take_over_a_failed_first<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    let key = format!("k-wait-fail-{}", unique_suffix());
    let req = Req::post("alice", &key, BODY).header("x-wait-ms", 20_000);
    let first = {
        let req = req.clone().header("x-gate", &key).header("x-status", 500);
        let app = app.clone();
        tokio::spawn(async move { send(&app, &req).await })
    };
    await_started(&key).await;
    let duplicates = {
        let app = app.clone();
        let reqs = vec![req.clone(); 10];
        tokio::spawn(async move { send_all(&app, reqs).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    app::open_gate(&key);

    let first = first.await.expect("first request");
    assert_eq!(first.status, 500);
    assert_eq!(first.outcome, Some(Outcome::Released));
    let duplicates = duplicates.await.expect("duplicates");
    let executed: Vec<_> = duplicates
        .iter()
        .filter(|g| g.outcome == Some(Outcome::Executed))
        .collect();
    assert_eq!(executed.len(), 1, "{duplicates:?}");
    for got in &duplicates {
        assert_eq!(got.status, 201, "{}", got.text());
        assert_eq!(got.body, executed[0].body);
    }
    assert_eq!(h.effects("alice").await, 1, "the failed first left nothing");
    h.finish().await;
}

/// `ttl_header`: the recorded response says how long its key is kept, and every
/// replay repeats it; without the option no such header is sent.
async fn ttl_header_is_recorded_and_replayed<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    let req = Req::post("alice", "k-ttl-header", BODY)
        .header("x-ttl-ms", 3_600_000)
        .header("x-ttl-header", 1);
    let first = send(&app, &req).await;
    assert_eq!(first.status, 201);
    assert_eq!(first.header("idempotency-key-ttl"), Some("3600"));
    let replay = send(&app, &req).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.header("idempotency-key-ttl"), Some("3600"));
    let plain = send(&app, &Req::post("alice", "k-no-ttl-header", BODY)).await;
    assert_eq!(plain.status, 201);
    assert_eq!(plain.header("idempotency-key-ttl"), None);
    h.finish().await;
}

pub fn unique_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// I2: the replay carries status, stored headers and body bytes; never Set-Cookie.
async fn replay_is_byte_identical_without_cookies<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    let req = Req::post("alice", "\"quoted-key\"", BODY);
    let first = send(&app, &req).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!(first.outcome, Some(Outcome::Executed));
    assert!(first.header("set-cookie").is_some());
    assert!(first.header("idempotent-replayed").is_none());

    // The same key, bare instead of quoted, is the same key.
    let replay = send(&app, &Req::post("alice", "quoted-key", BODY)).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.status, 201);
    assert_eq!(replay.body, first.body, "body byte for byte");
    assert!(
        first.text().starts_with(r#"{"z":1,"id":"#),
        "key order kept"
    );
    // The handler's own caching is replayed as it answered: only idem's problems
    // are `no-store`.
    assert_eq!(first.header("cache-control"), Some("private, max-age=60"));
    for name in ["content-type", "x-custom", "location", "cache-control"] {
        assert_eq!(replay.header(name), first.header(name), "{name}");
    }
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert!(
        replay.header("set-cookie").is_none(),
        "cookies are not stored"
    );
    let stored = &h.key_rows("alice").await[0].1;
    let headers = String::from_utf8_lossy(stored.headers.as_deref().unwrap_or_default());
    assert!(!headers.to_ascii_lowercase().contains("set-cookie"));
    assert_eq!(h.effects("alice").await, 1);
    h.finish().await;
}

/// §2, §3: another body, method, path or query under a used key is 422, and the
/// stored record does not change.
async fn mismatch_is_refused_and_record_untouched<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    let req = Req::post("alice", "k-mismatch", BODY);
    let first = send(&app, &req).await;
    assert_eq!(first.status, 201);
    let before = h.key_rows("alice").await;

    let others = [
        req.clone().body(r#"{"amount":999,"currency":"JPY"}"#),
        req.clone().method(Method::PUT),
        req.clone().path("/other"),
        req.clone().path("/effects?dry_run=1"),
    ];
    for other in &others {
        let got = send(&app, other).await;
        assert_eq!(got.status, 422, "{other:?}: {}", got.text());
        assert_eq!(got.problem().as_deref(), Some("payload-mismatch"));
        assert_eq!(got.outcome, Some(Outcome::Mismatch));
    }
    assert_eq!(h.key_rows("alice").await, before, "record untouched");
    assert_eq!(h.effects("alice").await, 1);
    let replay = send(&app, &req).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.body, first.body);
    h.finish().await;
}

/// I3: the same key under two scopes is two requests; neither sees the other's answer.
async fn scopes_are_isolated<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    let pairs = [("alice", "k-1"), ("bob", "k-1"), ("a:b", "c"), ("a", "b:c")];
    let mut firsts = Vec::new();
    for (scope, key) in pairs {
        let got = send(&app, &Req::post(scope, key, BODY)).await;
        assert_eq!(got.outcome, Some(Outcome::Executed), "{scope}/{key}");
        firsts.push(got);
    }
    for (i, (scope, key)) in pairs.iter().enumerate() {
        let replay = send(&app, &Req::post(scope, key, BODY)).await;
        assert_eq!(replay.outcome, Some(Outcome::Replayed));
        assert_eq!(replay.body, firsts[i].body, "{scope} sees its own response");
        for (j, other) in firsts.iter().enumerate() {
            if i != j {
                assert_ne!(replay.body, other.body);
            }
        }
        assert_eq!(h.effects(scope).await, 1);
    }
    h.finish().await;
}

/// §4.4, I1, I4: ≥ 500 and panics roll back and release at once; < 500 is recorded.
async fn failures_roll_back_and_release_the_key<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    let req = Req::post("alice", "k-fail", BODY);

    let failed = send(&app, &req.clone().header("x-status", 503)).await;
    assert_eq!(failed.status, 503);
    assert_eq!(failed.outcome, Some(Outcome::Released));
    assert_eq!(h.effects("alice").await, 0, "business write rolled back");
    assert!(h.key_rows("alice").await.is_empty(), "claim released");

    let panicked = send(&app, &req.clone().header("x-panic", 1)).await;
    assert_eq!(panicked.status, 500);
    assert_eq!(panicked.problem().as_deref(), Some("handler-failed"));
    assert_eq!(h.effects("alice").await, 0);
    assert!(h.key_rows("alice").await.is_empty());

    let retry = send(&app, &req).await;
    assert_eq!(retry.outcome, Some(Outcome::Executed), "{}", retry.text());
    assert_eq!(h.effects("alice").await, 1);

    // A 4xx is an answer like any other: recorded with its writes, then replayed.
    let declined = Req::post("alice", "k-402", BODY).header("x-status", 402);
    let first = send(&app, &declined).await;
    assert_eq!(
        (first.status, first.outcome),
        (402, Some(Outcome::Executed))
    );
    let again = send(&app, &Req::post("alice", "k-402", BODY)).await;
    assert_eq!(
        (again.status, again.outcome),
        (402, Some(Outcome::Replayed))
    );
    assert_eq!(again.body, first.body);
    assert_eq!(h.effects("alice").await, 2);
    h.finish().await;
}

/// §4.4: an answer that means "not executed, try later" (408, 425, 429 by default,
/// or the endpoint's own set) is answered but never recorded: the handler's writes
/// roll back and the key is free at once, so the retry runs the handler instead of
/// replaying the refusal for the whole ttl. Every other 4xx is recorded; so is
/// every default status once an endpoint lists its own. Without a key the writes
/// roll back too: the handler's effect does not depend on the client's key.
async fn not_executed_answers_release_the_key<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    // (status, the endpoint's `x-release-on`, released?)
    let cases: &[(u16, Option<&str>, bool)] = &[
        (408, None, true),
        (425, None, true),
        (429, None, true),
        (400, None, false),
        (404, None, false),
        (409, None, false),
        (422, None, false),
        (409, Some("409,429"), true),
        (429, Some("409,429"), true),
        (408, Some("409,429"), false),
        (429, Some(""), false),
    ];
    let mut effects = 0;
    for (n, &(status, release_on, released)) in cases.iter().enumerate() {
        let case = format!("{status} with release_on = {release_on:?}");
        let key = format!("k-release-{n}");
        let mut req = Req::post("alice", &key, BODY);
        if let Some(list) = release_on {
            req = req.header("x-release-on", list);
        }
        let first = send(&app, &req.clone().header("x-status", status)).await;
        assert_eq!(first.status, status, "{case}: the handler's own answer");
        let retry = send(&app, &req).await;
        if released {
            assert_eq!(first.outcome, Some(Outcome::Released), "{case}");
            assert_eq!(
                retry.outcome,
                Some(Outcome::Executed),
                "{case}: {}",
                retry.text()
            );
            assert_eq!(retry.status, 201, "{case}");
            effects += 1;
        } else {
            assert_eq!(first.outcome, Some(Outcome::Executed), "{case}");
            assert_eq!(retry.outcome, Some(Outcome::Replayed), "{case}");
            assert_eq!((retry.status, &retry.body), (status, &first.body), "{case}");
            effects += 1;
        }
        assert_eq!(
            h.effects("alice").await,
            effects,
            "{case}: one write kept per key"
        );
        let rows = h.key_rows("alice").await;
        let row = rows
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, row)| row.status);
        let kept = if released { 201 } else { i32::from(status) };
        assert_eq!(row, Some(Some(kept)), "{case}: what the key holds");
    }
    // Without a key: a 429's writes roll back, a 409's commit, as with one.
    let unkeyed = |status: u16| {
        Req::post("bob", "", BODY)
            .keys(&[])
            .header("x-status", status)
    };
    assert_eq!(send(&app, &unkeyed(429)).await.status, 429);
    assert_eq!(h.effects("bob").await, 0, "an unkeyed 429 rolls back");
    assert_eq!(send(&app, &unkeyed(409)).await.status, 409);
    assert_eq!(h.effects("bob").await, 1, "an unkeyed 409 commits");
    assert!(h.key_rows("bob").await.is_empty());

    // A duplicate waiting on a first answered 429 claims the key and runs itself.
    // Gates and start marks are the process's: a key of this run's own.
    let key = &format!("k-release-wait-{}", unique_suffix());
    let req = Req::post("alice", key, BODY).header("x-wait-ms", 20_000);
    let first = {
        let (app, req) = (
            app.clone(),
            req.clone().header("x-gate", key).header("x-status", 429),
        );
        tokio::spawn(async move { send(&app, &req).await })
    };
    crate::await_started(key).await;
    let waiter = {
        let (app, req) = (app.clone(), req.clone());
        tokio::spawn(async move { send(&app, &req).await })
    };
    app::open_gate(key);
    let first = first.await.expect("first");
    let waiter = waiter.await.expect("waiter");
    assert_eq!(first.status, 429);
    assert_eq!(waiter.outcome, Some(Outcome::Executed), "{}", waiter.text());
    assert_eq!(h.effects("alice").await, effects + 1);
    h.finish().await;
}

/// §4.1, §4.5: an executor stuck at an await past its lock is cancelled and rolled
/// back; until then duplicates get 409; afterwards a retry runs.
async fn hung_executor_is_cancelled_at_its_lock<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    // Start marks are the process's: a key of this run's own.
    let key = format!("k-hang-{}", unique_suffix());
    let req = Req::post("alice", &key, BODY).header("x-lock-ms", 2000);
    let started = Instant::now();
    let hung = {
        let app = app.clone();
        let req = req.clone().header("x-sleep-ms", 60_000);
        tokio::spawn(async move { send(&app, &req).await })
    };
    // Its claim is held (a fixed pause let a loaded runner send the duplicate first).
    await_started(&key).await;
    assert_in_flight(&send(&app, &req).await);

    let hung = hung.await.expect("hung request");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "cancelled near its lock"
    );
    assert_eq!(hung.status, 503, "{}", hung.text());
    assert_eq!(hung.problem().as_deref(), Some("lease-expired"));
    assert_eq!(h.effects("alice").await, 0, "its write was rolled back");
    assert!(
        h.key_rows("alice").await.is_empty(),
        "its claim was released"
    );

    let retry = send(&app, &req).await;
    assert_eq!(retry.outcome, Some(Outcome::Executed));
    assert_eq!(h.effects("alice").await, 1);
    h.finish().await;
}

/// §4.3, §4.5, I1: an executor that wakes after its lock cannot commit, while a
/// retry that came after the lock completes; exactly one business row. The
/// retry goes through another instance (on a cluster, another node: the late
/// executor's commit then loses certification, or its record finds the row
/// taken over).
async fn late_executor_cannot_commit_after_takeover<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    let other = app::router_on::<H>(h.another_instance());
    let key = format!("k-late-{}", unique_suffix());
    let req = Req::post("alice", &key, BODY).header("x-lock-ms", 1000);
    let stalled = {
        let app = app.clone();
        let req = req.clone().header("x-block-ms", 4000);
        tokio::spawn(async move { send(&app, &req).await })
    };
    // The retry comes once the stalled executor holds the key and its lock has passed.
    await_started(&key).await;
    let takeover = h.takeover_after(Duration::from_millis(1000));
    tokio::time::sleep(takeover + Duration::from_millis(200)).await;
    let retry = send(&other, &req).await;
    if !H::STALLED_WRITER_BLOCKS_TAKEOVER {
        // The database ended the stalled executor's session at its lock, so the
        // retry took the key and finished while that executor was still asleep.
        assert!(
            !stalled.is_finished(),
            "the retry waited for the stalled executor"
        );
    }
    let stalled = stalled.await.expect("stalled request");

    assert_eq!(retry.status, 201, "{}", retry.text());
    assert!(matches!(
        retry.outcome,
        Some(Outcome::Executed | Outcome::TakenOver)
    ));
    // Fenced by its lease, or (PostgreSQL) its session already ended at the lock.
    assert_eq!(stalled.status, 503, "{}", stalled.text());
    assert_eq!(stalled.problem().as_deref(), Some("lease-expired"));
    assert_eq!(stalled.outcome, Some(Outcome::Released));
    assert_eq!(
        h.effects("alice").await,
        1,
        "the late executor's write is gone"
    );
    let replay = send(&app, &req).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.body, retry.body);
    h.finish().await;
}

/// §4.5: a claim left by a crashed executor is taken over by exactly one of many
/// concurrent retries once its lock has passed.
async fn stale_claim_is_taken_over_once<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    h.insert_stale_claim("alice", "k-crashed", "POST", "/effects", BODY.as_bytes())
        .await;
    let req = Req::post("alice", "k-crashed", BODY).header("x-sleep-ms", 200);
    let got = send_all(&app, vec![req; 20]).await;
    let took: Vec<_> = got
        .iter()
        .filter(|g| g.outcome == Some(Outcome::TakenOver))
        .collect();
    assert_eq!(took.len(), 1, "{got:?}");
    for g in &got {
        match g.status {
            201 => assert_eq!(g.body, took[0].body),
            _ => {
                assert_in_flight(g);
            }
        }
    }
    assert_eq!(h.effects("alice").await, 1);
    assert_eq!(h.key_rows("alice").await[0].1.state, "completed");

    // A claim nobody completed holds nothing once its lock has passed: a request
    // with another body is not refused, it takes the key over.
    h.insert_stale_claim("alice", "k-crashed-2", "POST", "/effects", b"{}")
        .await;
    let other = send(&app, &Req::post("alice", "k-crashed-2", BODY)).await;
    assert_eq!(other.status, 201, "{}", other.text());
    assert_eq!(other.outcome, Some(Outcome::TakenOver));
    assert_eq!(h.effects("alice").await, 2);
    let replay = send(&app, &Req::post("alice", "k-crashed-2", BODY)).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.body, other.body);
    let mismatch = send(&app, &Req::post("alice", "k-crashed-2", "{}")).await;
    assert_eq!(mismatch.status, 422, "the taker's request is the key's now");
    assert_eq!(h.effects("alice").await, 2);
    h.finish().await;
}

/// §3: a key past its ttl is treated as never seen.
async fn expired_key_executes_anew<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    let req = Req::post("alice", "k-ttl", BODY)
        .header("x-ttl-ms", 1500)
        .header("x-lock-ms", 1000);
    let first = send(&app, &req).await;
    assert_eq!(first.outcome, Some(Outcome::Executed));
    assert_eq!(send(&app, &req).await.outcome, Some(Outcome::Replayed));
    tokio::time::sleep(Duration::from_millis(1700)).await;
    let again = send(&app, &req).await;
    assert_eq!(again.outcome, Some(Outcome::Executed));
    assert_ne!(again.body, first.body);
    assert_eq!(h.effects("alice").await, 2);
    let replay = send(&app, &req).await;
    assert_eq!(replay.body, again.body);
    h.finish().await;
}

/// §4.6 over TCP: clients that hang up mid-request leave no stuck claim and no
/// transaction open; their retries get the replay.
async fn disconnected_clients_leave_no_stuck_claim<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    let server = tokio::spawn(axum::serve(listener, app.clone()).into_future());

    let keys: Vec<String> = (0..8).map(|i| format!("k-gone-{i}")).collect();
    for (i, key) in keys.iter().enumerate() {
        let req = Req::post("alice", key, BODY).header("x-sleep-ms", 400);
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        stream.write_all(&req.wire()).await.expect("send");
        // Hang up at different moments of the request's life.
        tokio::time::sleep(Duration::from_millis(20 + 40 * i as u64)).await;
        drop(stream);
    }
    await_completed(&h, "alice", keys.len()).await;
    assert_eq!(h.effects("alice").await, keys.len() as i64);
    assert_eq!(
        transactions_left(&h).await,
        0,
        "no connection left in a transaction"
    );

    for key in &keys {
        let req = Req::post("alice", key, BODY);
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        stream.write_all(&req.wire()).await.expect("send");
        let mut head = vec![0u8; 4096];
        let n = stream.read(&mut head).await.expect("read");
        let head = String::from_utf8_lossy(&head[..n]).to_ascii_lowercase();
        assert!(head.starts_with("http/1.1 201"), "{head}");
        assert!(head.contains("idempotent-replayed: true"), "{head}");
    }
    assert_eq!(h.effects("alice").await, keys.len() as i64);
    server.abort();
    h.finish().await;
}

/// §4.6 at the future level: a caller dropped while its handler runs does not stop
/// the execution; it commits, and the retry gets the replay.
async fn dropped_callers_still_complete<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    // Unique across runs: the set of started keys is process-wide.
    let ns = unique_suffix();
    let keys: Vec<String> = (0..6).map(|i| format!("k-drop-{i}-{ns}")).collect();
    for (i, key) in keys.iter().enumerate() {
        let req = Req::post("alice", key, BODY).header("x-sleep-ms", 100 + 50 * i);
        let app2 = app.clone();
        let task = tokio::spawn(async move { send(&app2, &req).await });
        await_started(key).await;
        task.abort();
        assert!(
            task.await.is_err_and(|e| e.is_cancelled()),
            "caller was dropped"
        );
    }
    await_completed(&h, "alice", keys.len()).await;
    assert_eq!(h.effects("alice").await, keys.len() as i64);
    assert_eq!(transactions_left(&h).await, 0);
    for key in &keys {
        let got = send(&app, &Req::post("alice", key, BODY)).await;
        assert_eq!(got.outcome, Some(Outcome::Replayed), "{got:?}");
    }
    assert_eq!(
        h.effects("alice").await,
        keys.len() as i64,
        "one business row per key"
    );
    h.finish().await;
}

/// §2, §3: keys are validated before anything runs; no key runs unrecorded.
async fn keys_are_validated<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    let missing = send(
        &app,
        &Req::post("alice", "x", BODY)
            .keys(&[])
            .header("x-required", 1),
    )
    .await;
    assert_eq!(missing.status, 400);
    assert_eq!(missing.problem().as_deref(), Some("missing-key"));

    let long = "k".repeat(256);
    let max = "k".repeat(255);
    for keys in [
        &["a", "b"][..],
        &[""],
        &[long.as_str()],
        &["\"open"],
        &["a b"],
    ] {
        let got = send(&app, &Req::post("alice", "x", BODY).keys(keys)).await;
        assert_eq!(got.status, 400, "{keys:?}");
        assert_eq!(got.problem().as_deref(), Some("invalid-key"), "{keys:?}");
    }
    assert_eq!(h.effects("alice").await, 0, "nothing ran");

    let longest = send(&app, &Req::post("alice", &max, BODY)).await;
    assert_eq!(longest.outcome, Some(Outcome::Executed));

    let unkeyed = Req::post("alice", "x", BODY).keys(&[]);
    for _ in 0..2 {
        let got = send(&app, &unkeyed).await;
        assert_eq!((got.status, got.outcome), (201, Some(Outcome::Unkeyed)));
    }
    assert_eq!(h.effects("alice").await, 3);
    assert_eq!(
        h.key_rows("alice").await.len(),
        1,
        "unkeyed requests store nothing"
    );
    h.finish().await;
}

/// A body over the endpoint's limit is refused with 413 problem+json before
/// anything runs or is stored; one within it runs as usual.
async fn oversized_body_is_refused<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    let big = format!(r#"{{"padding":"{}"}}"#, "x".repeat(2048));
    let got = send(&app, &Req::post("alice", "k-body", &big).path("/small")).await;
    assert_eq!(got.status, 413, "{}", got.text());
    assert_eq!(got.problem().as_deref(), Some("payload-too-large"));
    assert_eq!(h.effects("alice").await, 0);
    assert!(h.key_rows("alice").await.is_empty());
    let fits = send(&app, &Req::post("alice", "k-body", BODY).path("/small")).await;
    assert_eq!(fits.outcome, Some(Outcome::Executed));
    h.finish().await;
}

/// A response over the store's limit is never half-recorded: rolled back, released.
async fn oversized_response_is_rolled_back<H: Harness>() {
    let Some(h) = H::start(1024).await else {
        return;
    };
    let app = router(&h);
    let req = Req::post("alice", "k-big", BODY);
    let got = send(&app, &req.clone().header("x-big", 4096)).await;
    assert_eq!(got.status, 500);
    assert_eq!(got.problem().as_deref(), Some("response-too-large"));
    assert_eq!(h.effects("alice").await, 0);
    assert!(h.key_rows("alice").await.is_empty());

    let fits = send(&app, &req.clone().header("x-big", 1024)).await;
    assert_eq!(fits.outcome, Some(Outcome::Executed));
    let replay = send(&app, &req).await;
    assert_eq!(replay.body, fits.body);
    assert_eq!(h.effects("alice").await, 1);
    h.finish().await;
}

/// §6: a sweep deletes completed keys past their ttl, in batches, and nothing else:
/// not fresh keys, not claims however old; a budget of zero deletes nothing.
async fn sweep_deletes_only_expired_completed_keys<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    h.insert_expired("old", "done-", 600, true).await;
    h.insert_expired("old", "abandoned-", 5, false).await;
    for key in ["k-1", "k-2", "k-3"] {
        assert_eq!(send(&app, &Req::post("alice", key, BODY)).await.status, 201);
    }

    let idle = h.store().sweep(Sweep::new().budget(Duration::ZERO)).await;
    let idle = idle.expect("sweep");
    assert_eq!((idle.deleted, idle.batches, idle.caught_up), (0, 0, false));

    let report = h
        .store()
        .sweep(Sweep::new().batch(100))
        .await
        .expect("sweep");
    assert_eq!(report.deleted, 600);
    assert_eq!(
        report.batches, 7,
        "six full batches, then one that finds none"
    );
    assert!(report.caught_up);
    let left = h.key_rows("old").await;
    assert_eq!(left.len(), 5);
    assert!(
        left.iter().all(|(_, r)| r.state == "processing"),
        "claims stay"
    );
    assert_eq!(h.key_rows("alice").await.len(), 3, "fresh keys stay");
    let replay = send(&app, &Req::post("alice", "k-2", BODY)).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    h.finish().await;
}

/// §6: sweeping while requests run disturbs neither: every request is answered as
/// usual and the sweep deletes exactly the expired keys.
async fn sweep_runs_beside_the_hot_path<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    h.insert_expired("old", "done-", 800, true).await;
    let sweep = {
        let store = h.store().clone();
        tokio::spawn(async move {
            let gentle = Sweep::new().batch(25).pause(Duration::from_millis(1));
            store.sweep(gentle).await
        })
    };
    let reqs = (0..30)
        .map(|i| Req::post("alice", &format!("k-hot-{i}"), BODY))
        .collect();
    for got in send_all(&app, reqs).await {
        assert_eq!(got.outcome, Some(Outcome::Executed), "{}", got.text());
    }
    let report = sweep.await.expect("sweep task").expect("sweep");
    assert_eq!(report.deleted, 800);
    assert!(report.caught_up);
    assert_eq!(h.effects("alice").await, 30);
    assert_eq!(h.key_rows("alice").await.len(), 30);
    assert!(h.key_rows("old").await.is_empty());

    // The background sweeper does the same on its own.
    h.insert_expired("old", "later-", 50, true).await;
    let sweeper = h
        .store()
        .spawn_sweeper(Duration::from_millis(50), Sweep::new());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !h.key_rows("old").await.is_empty() {
        assert!(
            Instant::now() < deadline,
            "the background sweeper never swept"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sweeper.abort();
    assert_eq!(h.key_rows("alice").await.len(), 30);
    h.finish().await;
}

/// The operator's view: claims in flight and stuck ones, one key's record, and
/// which other scopes hold a key, without reading theirs.
async fn operator_view_lists_and_inspects_keys<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    // Writes first: on SQLite the gated handler below holds the only writer lock.
    h.insert_stale_claim("alice", "k-stuck", "POST", "/effects", BODY.as_bytes())
        .await;
    let done = send(&app, &Req::post("alice", "k-done", BODY)).await;
    assert_eq!(
        send(&app, &Req::post("bob", "k-done", BODY)).await.status,
        201
    );
    let gate = format!("k-live-{}", unique_suffix());
    let live = {
        let req = Req::post("alice", &gate, BODY).header("x-gate", &gate);
        let app = app.clone();
        tokio::spawn(async move { send(&app, &req).await })
    };
    await_started(&gate).await;

    let store = h.store();
    let listed = |claims: Vec<idem_axum::KeyRecord>| {
        let mut keys: Vec<String> = claims.into_iter().map(|c| c.key).collect();
        keys.sort();
        keys
    };
    // A live claim: SQLite's is a committed row, MySQL's is read uncommitted;
    // PostgreSQL's is invisible until it commits.
    let in_flight = listed(store.claims(None, false, 10).await.expect("claims"));
    assert_eq!(
        in_flight.contains(&gate),
        H::CLAIMS_READABLE_IN_FLIGHT,
        "{in_flight:?}"
    );
    assert!(in_flight.contains(&"k-stuck".to_owned()), "{in_flight:?}");
    assert!(!in_flight.contains(&"k-done".to_owned()), "{in_flight:?}");
    let stuck = store.claims(None, true, 10).await.expect("stuck claims");
    assert_eq!(stuck.len(), 1, "{stuck:?}");
    assert!(stuck[0].is_stuck() && stuck[0].key == "k-stuck");
    assert!(
        store
            .claims(Some("bob"), false, 10)
            .await
            .expect("claims")
            .is_empty()
    );

    let record = store.inspect("alice", "k-done").await.expect("inspect");
    let record = record.expect("alice's record");
    assert_eq!(
        (record.state.as_str(), record.status),
        ("completed", Some(201))
    );
    assert_eq!(record.body, done.body.to_vec());
    assert!(String::from_utf8_lossy(&record.headers).contains("content-type: application/json"));
    assert!(record.expires_in_ms > 0 && record.age_ms >= 0);
    assert!(
        store
            .inspect("carol", "k-done")
            .await
            .expect("inspect")
            .is_none()
    );
    let mut others = store.other_scopes("carol", "k-done").await.expect("scopes");
    others.sort();
    assert_eq!(others, ["alice", "bob"]);

    app::open_gate(&gate);
    assert_eq!(live.await.expect("gated request").status, 201);
    h.finish().await;
}

/// A `Tx` moved into a task of its own outlives its handler: the request is answered
/// 500 `handler-failed`, what was written through it, before and after the handler
/// answered, is rolled back, nothing is recorded, and a retry executes once.
async fn escaped_transactions_are_rolled_back<H: Harness>() {
    let Some(h) = start::<H>().await else {
        return;
    };
    let app = router(&h);
    let gate = format!("escape-{}", unique_suffix());
    let escaping = Req::post("alice", "k-escape", BODY).header("x-escape", &gate);
    let first = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, &escaping).await })
    };
    await_started("k-escape").await;
    app::open_gate(&gate);
    let first = first.await.expect("escaping request");
    assert_eq!(
        first.status,
        500,
        "{}",
        String::from_utf8_lossy(&first.body)
    );
    assert!(
        String::from_utf8_lossy(&first.body).contains("handler-failed"),
        "{}",
        String::from_utf8_lossy(&first.body)
    );
    assert_eq!(h.effects("alice").await, 0, "both writes rolled back");
    let rows = h.key_rows("alice").await;
    assert!(
        rows.iter().all(|(_, row)| row.state != "completed"),
        "nothing recorded: {rows:?}"
    );
    let retry = send(&app, &Req::post("alice", "k-escape", BODY)).await;
    assert_eq!(retry.status, 201);
    assert_eq!(retry.outcome, Some(Outcome::Executed));
    assert_eq!(h.effects("alice").await, 1);
    h.finish().await;
}

/// Graceful shutdown, drained: the keyed request in flight finishes and is recorded,
/// keyed requests that arrive after `drain` are answered 503 `shutting-down` with
/// `Retry-After` and claim nothing, and `close` then returns at once.
async fn draining_finishes_in_flight_and_refuses_new_keys<H: Harness>() {
    let Some(h) = start::<H>().await else {
        return;
    };
    let app = router(&h);
    let gate = format!("drain-{}", unique_suffix());
    let key = format!("k-drain-{}", unique_suffix());
    let first = {
        let (app, req) = (
            app.clone(),
            Req::post("alice", &key, BODY).header("x-gate", &gate),
        );
        tokio::spawn(async move { send(&app, &req).await })
    };
    await_started(&key).await;
    let shutdown = h.store().shutdown();
    shutdown.drain();
    let refused = send(&app, &Req::post("alice", "k-new", BODY)).await;
    assert_eq!(refused.status, 503);
    assert!(String::from_utf8_lossy(&refused.body).contains("shutting-down"));
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert_eq!(refused.outcome, Some(Outcome::ShuttingDown));
    app::open_gate(&gate);
    let first = first.await.expect("request in flight");
    assert_eq!(first.status, 201);
    let closed = shutdown.close(Duration::from_secs(10)).await;
    assert_eq!((closed.cancelled, closed.left), (0, 0));
    assert_eq!(h.effects("alice").await, 1);
    let rows = h.key_rows("alice").await;
    assert_eq!(
        rows.len(),
        1,
        "nothing claimed for the refused key: {rows:?}"
    );
    // An instance that stays up takes the refused key at once.
    let other = app::router_on::<H>(h.another_instance());
    let later = send(&other, &Req::post("alice", "k-new", BODY)).await;
    assert_eq!(later.outcome, Some(Outcome::Executed));
    h.finish().await;
}

/// Graceful shutdown, out of time: the execution still running at the end of the
/// grace period is cancelled, rolled back, its claim released and answered 503; its
/// retry on an instance that is up runs at once instead of waiting out `lock`.
async fn close_cancels_what_cannot_finish<H: Harness>() {
    let Some(h) = start::<H>().await else {
        return;
    };
    let app = router(&h);
    let gate = format!("stuck-{}", unique_suffix());
    let key = format!("k-stuck-{}", unique_suffix());
    let stuck = {
        let (app, req) = (
            app.clone(),
            Req::post("alice", &key, BODY).header("x-gate", &gate),
        );
        tokio::spawn(async move { send(&app, &req).await })
    };
    await_started(&key).await;
    let closed = h.store().shutdown().close(Duration::from_millis(300)).await;
    assert_eq!((closed.cancelled, closed.left), (1, 0));
    let stuck = stuck.await.expect("request in flight");
    assert_eq!(stuck.status, 503);
    assert!(String::from_utf8_lossy(&stuck.body).contains("shutting-down"));
    assert_eq!(h.effects("alice").await, 0, "rolled back");
    let other = app::router_on::<H>(h.another_instance());
    let started = Instant::now();
    let retry = send(&other, &Req::post("alice", &key, BODY)).await;
    assert_eq!(retry.outcome, Some(Outcome::Executed), "{retry:?}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the claim was released"
    );
    assert_eq!(h.effects("alice").await, 1);
    app::open_gate(&gate);
    h.finish().await;
}

macro_rules! conformance {
    // Tests that need more than a backend, in a module of their own.
    (mod $group:ident: $($test:ident),* $(,)?) => {
        mod $group {
            use super::*;
            conformance!($($test),*);
        }
    };
    ($($test:ident),* $(,)?) => {
        #[cfg(feature = "postgres")]
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $test() {
                    super::$test::<super::Pg>().await;
                }
            )*
        }
        #[cfg(feature = "postgres")]
        mod postgres_partitioned {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $test() {
                    super::$test::<super::PgParted>().await;
                }
            )*
        }
        #[cfg(feature = "sqlite")]
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $test() {
                    super::$test::<super::Lite>().await;
                }
            )*
        }
        #[cfg(feature = "sqlite")]
        mod sqlite_deferred {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $test() {
                    super::$test::<super::LiteDeferred>().await;
                }
            )*
        }
        #[cfg(feature = "mysql")]
        mod mysql {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $test() {
                    super::$test::<super::My>().await;
                }
            )*
        }
    };
}

conformance!(
    concurrent_duplicates_execute_once,
    operators_never_delete_or_wait_for_a_key_in_flight,
    json_fingerprints_compare_values_not_bytes,
    browser_sent_keys_are_keys,
    duplicates_in_flight_answer_at_once,
    waiting_duplicates_all_get_the_response,
    waiting_ends_in_409_at_its_bound,
    waiting_duplicates_take_over_a_failed_first,
    instances_share_keys,
    ttl_header_is_recorded_and_replayed,
    replay_is_byte_identical_without_cookies,
    mismatch_is_refused_and_record_untouched,
    scopes_are_isolated,
    failures_roll_back_and_release_the_key,
    not_executed_answers_release_the_key,
    hung_executor_is_cancelled_at_its_lock,
    late_executor_cannot_commit_after_takeover,
    stalled_claims_never_start_beside_a_takeover,
    stale_claim_is_taken_over_once,
    expired_key_executes_anew,
    disconnected_clients_leave_no_stuck_claim,
    dropped_callers_still_complete,
    keys_are_validated,
    oversized_body_is_refused,
    oversized_response_is_rolled_back,
    sweep_deletes_only_expired_completed_keys,
    sweep_runs_beside_the_hot_path,
    operator_view_lists_and_inspects_keys,
    nested_routes_keep_their_identity,
    caught_database_errors_are_recorded,
    handler_savepoints_keep_working,
    storms_over_two_instances_execute_each_key_once,
    storms_across_instances_charge_each_key_once,
    content_type_is_part_of_the_identity,
    content_types_compare_as_media_types,
    mismatches_name_the_part_that_differs,
    uploads_are_retried_by_their_parts,
    multipart_keys_of_earlier_releases_still_replay,
    the_table_holds_legal_requests_and_responses,
    any_legal_scope_and_key_finds_its_own_row,
    expired_key_duplicates_answer_at_once,
    inconsistent_options_are_refused,
    migrate_upgrades_a_table_of_the_previous_release,
    escaped_transactions_are_rolled_back,
    idem_extractors_work_in_any_handler,
    kept_replays_skip_the_last_extractor,
    draining_finishes_in_flight_and_refuses_new_keys,
    close_cancels_what_cannot_finish,
    completed_keys_are_replayed_from_memory,
    kept_responses_end_with_their_key,
    only_committed_responses_are_kept,
    forgotten_keys_run_again,
    a_failed_database_ends_the_copies,
    handler_session_changes_never_reach_idem,
    handlers_that_end_their_own_transaction_never_run_twice,
    duplicates_never_run_while_a_handler_has_ended_its_transaction,
    the_testing_kit_proves_handlers_exactly_once,
    sealed_records_replay_and_hold_no_plaintext,
    rotation_keeps_every_key_answered,
    changed_records_are_never_replayed,
    sealing_turns_on_and_off_without_losing_keys,
    reseal_lets_an_old_key_leave_the_ring,
    downgraded_records_are_never_replayed,
    fingerprints_of_a_retired_key_are_never_another_body,
    rotation_rolled_out_never_answers_500,
    records_open_only_in_their_context,
    audit_counts_what_each_key_still_holds,
    deliveries_run_once_and_give_back_their_result,
    redeliveries_at_once_run_each_message_once,
    messages_and_requests_never_share_a_key,
    message_records_are_sealed,
    message_attribute_runs_each_message_once,
);

// Webhooks: keys where the sender puts them, signatures checked first
// (tests/conformance/webhook.rs).
#[cfg(feature = "webhooks")]
conformance!(
    mod webhooks:
    webhook_keys_replay_and_refuse_as_the_header_does,
    a_forged_delivery_claims_nothing_and_the_real_one_runs_once,
    webhook_duplicates_at_once_run_each_event_once,
);

#[cfg(all(feature = "lapin", feature = "async-nats"))]
use broker::{
    jetstream_an_ack_wait_shorter_than_the_handler,
    jetstream_duplicates_over_three_consumers_run_once,
    jetstream_mismatches_and_failures_are_dead_lettered,
    rabbitmq_a_check_then_insert_consumer_runs_messages_twice,
    rabbitmq_a_consumer_cut_off_before_its_ack, rabbitmq_duplicates_over_three_consumers_run_once,
    rabbitmq_mismatches_and_failures_are_dead_lettered,
};

// Messages from the brokers the machine runs (tests/conformance/broker.rs).
#[cfg(all(feature = "lapin", feature = "async-nats"))]
conformance!(
    mod brokers:
    rabbitmq_duplicates_over_three_consumers_run_once,
    rabbitmq_a_consumer_cut_off_before_its_ack,
    rabbitmq_mismatches_and_failures_are_dead_lettered,
    rabbitmq_a_check_then_insert_consumer_runs_messages_twice,
    jetstream_an_ack_wait_shorter_than_the_handler,
    jetstream_duplicates_over_three_consumers_run_once,
    jetstream_mismatches_and_failures_are_dead_lettered,
);
