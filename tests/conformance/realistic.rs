//! The suite on the bank app (`bank.rs`): identities through nesting and rewriting,
//! handlers that catch database errors or open savepoints, and storms over two
//! instances whose sessions differ.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::http::Request;
use bytes::Bytes;
use http_body_util::BodyExt as _;
use idem_axum::Outcome;
use tower::ServiceExt as _;

use crate::app::{Got, retrying_serialization};
use crate::bank::{self, Service};
use crate::harness::Harness;
use crate::start;

/// Sends a request; on a SERIALIZABLE run, again after a serialization failure.
async fn call(app: &Service, request: Request<axum::body::Body>) -> Got {
    call_counting(app, request, &AtomicUsize::new(0)).await
}

/// [`call`], adding to `retried` the attempts it sent again after a serialization
/// failure: each committed nothing, and its handler may have run.
async fn call_counting(
    app: &Service,
    request: Request<axum::body::Body>,
    retried: &AtomicUsize,
) -> Got {
    let (parts, body) = request.into_parts();
    let body = body.collect().await.expect("request body").to_bytes();
    let mut attempts = 0;
    retrying_serialization(|| {
        attempts += 1;
        if attempts > 1 {
            retried.fetch_add(1, Ordering::SeqCst);
        }
        let attempt = Request::from_parts(parts.clone(), axum::body::Body::from(body.clone()));
        async move {
            let response = app.clone().oneshot(attempt).await.expect("infallible");
            Got::read(response).await
        }
    })
    .await
}

async fn pay(app: &Service, path: &str, user: &str, key: &str) -> Got {
    call(app, bank::request(path, user, key, r#"{"amount":100}"#)).await
}

async fn start_bank<H: Harness>() -> Option<(H, Service)> {
    let h = start::<H>().await?;
    h.script(bank::SCHEMA).await;
    let app = bank::app::<H>(h.store().clone());
    Some((h, app))
}

async fn transfers<H: Harness>(h: &H, account: &str) -> i64 {
    h.count(
        "SELECT count(*) FROM transfers WHERE account = $1",
        &[account],
    )
    .await
}

/// Contract §2: the identity is the path and query the client sent. One key sent to
/// routes that differ only in a path parameter, a version prefix, a service mounted
/// with `nest_service`, or behind a middleware that rewrites the URI the handler
/// sees, is a payload mismatch there, never a replay of another account's answer.
pub async fn nested_routes_keep_their_identity<H: Harness>() {
    let Some((h, app)) = start_bank::<H>().await else {
        return;
    };
    let first = pay(&app, "/v1/accounts/A/transfers", "alice", "k1").await;
    assert_eq!(first.status, 201, "{first:?}");
    for path in [
        "/v1/accounts/B/transfers",
        "/v2/accounts/A/transfers",
        "/legacy/accounts/A/transfers",
        "/internal/accounts/A/transfers",
        "/v1/accounts/A/transfers?dry_run=1",
    ] {
        let other = pay(&app, path, "alice", "k1").await;
        assert_eq!(other.status, 422, "{path}: {other:?}");
        assert_eq!(other.problem().as_deref(), Some("payload-mismatch"));
    }
    // A trailing slash is trimmed before routing: the same request, replayed.
    let slash = pay(&app, "/v1/accounts/A/transfers/", "alice", "k1").await;
    assert!(slash.replayed(), "{slash:?}");
    assert_eq!(slash.body, first.body);

    // Behind the rewriting middleware every handler sees one URI; two accounts
    // still have two identities.
    let a = pay(&app, "/internal/accounts/A/transfers", "alice", "k2").await;
    assert_eq!(a.status, 201, "{a:?}");
    let b = pay(&app, "/internal/accounts/B/transfers", "alice", "k2").await;
    assert_eq!(b.status, 422, "{b:?}");

    // Fresh keys execute on every mount, each once.
    for (n, path) in [
        "/v1/accounts/B/transfers",
        "/v2/accounts/B/transfers",
        "/legacy/accounts/B/transfers",
    ]
    .iter()
    .enumerate()
    {
        let key = format!("k-b-{n}");
        assert_eq!(pay(&app, path, "alice", &key).await.status, 201);
        assert!(pay(&app, path, "alice", &key).await.replayed());
    }
    assert_eq!(transfers(&h, "A").await, 2, "k1 and k2 on A");
    assert_eq!(transfers(&h, "B").await, 3, "one per fresh key on B");

    // Without credentials the auth layer answers before anything is claimed.
    let mut anonymous = bank::request("/v1/accounts/C/transfers", "x", "k9", "{}");
    anonymous.headers_mut().remove("authorization");
    assert_eq!(call(&app, anonymous).await.status, 401);
    assert_eq!(
        h.count(
            "SELECT count(*) FROM idempotency_keys WHERE idempotency_key = $1",
            &["k9"]
        )
        .await,
        0
    );
    h.finish().await;
}

/// Contract §4.3–4.4: a handler that catches a database error (a unique violation) and
/// answers its own 409 has that answer recorded and replayed on every backend,
/// concurrent duplicates included, and runs once per key meanwhile (on PostgreSQL
/// its claim is taken again after the aborted transaction), again only after an
/// attempt that committed nothing (a serialization failure); what it wrote follows
/// the database's own rules (PostgreSQL voids an aborted transaction's writes, the
/// others only the failed statement's).
pub async fn caught_database_errors_are_recorded<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    h.script(bank::SCHEMA).await;
    let (app, counts) = bank::app_counting::<H>(h.store().clone());
    let sign_ups = counts.sign_ups;
    let retried = Arc::new(AtomicUsize::new(0));
    let body = r#"{"email":"ann@example.com"}"#;
    let request = bank::request("/v1/users", "alice", "s1", body);
    let created = call_counting(&app, request, &retried).await;
    assert_eq!(created.status, 201, "{created:?}");

    let dups = (0..6).map(|_| {
        let (app, retried) = (app.clone(), retried.clone());
        let request = bank::request("/v1/users", "bob", "s2", body);
        tokio::spawn(async move { call_counting(&app, request, &retried).await })
    });
    let mut answers = Vec::new();
    for dup in dups {
        answers.push(dup.await.expect("request"));
    }
    let taken: Vec<_> = answers
        .iter()
        .filter(|a| a.status == 409 && a.problem().is_none())
        .collect();
    assert!(!taken.is_empty(), "{answers:?}");
    for answer in &answers {
        match answer.problem() {
            None => {
                assert_eq!(answer.status, 409);
                assert_eq!(answer.body, taken[0].body, "I2");
            }
            Some(problem) => assert_eq!(problem, "in-flight", "{answer:?}"),
        }
    }
    let retry = call(&app, bank::request("/v1/users", "bob", "s2", body)).await;
    assert!(
        retry.replayed(),
        "the handler's own 409 is replayed: {retry:?}"
    );
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(retry.body, taken[0].body);

    // A storm: duplicates that retry while the key is in flight, so that some
    // arrive while the executor records after its aborted transaction.
    let keys = 16;
    let storm = (0..keys).flat_map(|k| (0..4).map(move |_| (k, format!("s-storm-{k}"))));
    let storm = storm.map(|(k, key)| {
        let (app, retried) = (app.clone(), retried.clone());
        tokio::spawn(async move {
            for _ in 0..2_000 {
                let request = bank::request("/v1/users", "bob", &key, body);
                let got = call_counting(&app, request, &retried).await;
                if got.problem().as_deref() != Some("in-flight") {
                    return (k, got);
                }
                tokio::task::yield_now().await;
            }
            panic!("{key} stayed in flight");
        })
    });
    let mut answers = Vec::new();
    for client in storm.collect::<Vec<_>>() {
        answers.push(client.await.expect("client"));
    }
    for (k, answer) in &answers {
        assert_eq!(answer.status, 409, "key {k}: {answer:?}");
        assert_eq!(answer.body, taken[0].body, "key {k}: I2");
    }
    let (ran, retried) = (
        sign_ups.load(Ordering::SeqCst),
        retried.load(Ordering::SeqCst),
    );
    assert!(
        (2 + keys..=2 + keys + retried).contains(&ran),
        "the handler ran {ran} times for {} keys, {retried} attempts retried",
        2 + keys
    );

    let audit = h
        .count("SELECT count(*) FROM audit WHERE owner = $1", &["bob"])
        .await;
    let expected = if H::ERROR_VOIDS_TRANSACTION {
        0
    } else {
        1 + i64::try_from(keys).expect("few")
    };
    assert_eq!(
        audit, expected,
        "bob's audit rows, written before the violation"
    );
    assert_eq!(
        h.count(
            "SELECT count(*) FROM users WHERE email = $1",
            &["ann@example.com"]
        )
        .await,
        1
    );
    let rows = h.key_rows("bob").await;
    assert_eq!(rows.len(), 1 + keys);
    for (key, row) in &rows {
        assert_eq!(row.state, "completed", "{key}");
        assert_eq!(row.status, Some(409), "{key}");
    }
    assert_eq!(crate::transactions_left(&h).await, 0);
    h.finish().await;
}

/// A handler's own savepoint (`begin()` on its transaction) keeps working inside
/// idem's: rolled back on a unique violation, the rest of the handler commits.
pub async fn handler_savepoints_keep_working<H: Harness>() {
    let Some((h, app)) = start_bank::<H>().await else {
        return;
    };
    let body = r#"{"item":"tea","coupon":"WELCOME"}"#;
    let first = call(&app, bank::request("/v1/orders", "alice", "o1", body)).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(String::from_utf8_lossy(&first.body).contains(r#""discounted":true"#));
    let second = call(&app, bank::request("/v1/orders", "alice", "o2", body)).await;
    assert_eq!(second.status, 201, "{second:?}");
    assert!(String::from_utf8_lossy(&second.body).contains(r#""discounted":false"#));
    let again = call(&app, bank::request("/v1/orders", "alice", "o2", body)).await;
    assert!(again.replayed());
    assert_eq!(again.body, second.body);
    assert_eq!(
        h.count("SELECT count(*) FROM orders WHERE owner = $1", &["alice"])
            .await,
        2
    );
    assert_eq!(
        h.count(
            "SELECT count(*) FROM coupons_used WHERE code = $1",
            &["WELCOME"]
        )
        .await,
        1
    );
    h.finish().await;
}

/// I1 under the session settings a deployment chooses (isolation level, search
/// path; CI runs it under each): 150 keys × 6 duplicates spread over two instances,
/// retried like a client until each has its answer, execute each key exactly once.
pub async fn storms_over_two_instances_execute_each_key_once<H: Harness>() {
    const KEYS: usize = 150;
    const DUPLICATES: usize = 6;
    let Some((h, one)) = start_bank::<H>().await else {
        return;
    };
    let two = bank::app::<H>(h.another_instance());
    let mut tasks = tokio::task::JoinSet::new();
    for key in 0..KEYS {
        for dup in 0..DUPLICATES {
            let app = if dup % 2 == 0 {
                one.clone()
            } else {
                two.clone()
            };
            tasks.spawn(async move {
                let path = format!("/v1/accounts/acct-{key}/transfers");
                let key = format!("storm-{key}");
                for _ in 0..400 {
                    let answer = pay(&app, &path, "alice", &key).await;
                    match answer.status {
                        201 => return (key, answer),
                        // In flight, or the store refused for a moment (a
                        // serialization failure at commit): retry as a client does.
                        409 | 503 => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
                        _ => panic!("{key}: {answer:?}"),
                    }
                }
                panic!("{key} never completed");
            });
        }
    }
    let mut answers: HashMap<String, Bytes> = HashMap::new();
    while let Some(done) = tasks.join_next().await {
        let (key, answer) = done.expect("storm request");
        let first = answers
            .entry(key.clone())
            .or_insert_with(|| answer.body.clone());
        assert_eq!(*first, answer.body, "I2 for {key}");
    }
    assert_eq!(answers.len(), KEYS);
    let twice = h
        .count(
            "SELECT count(*) FROM (SELECT account FROM transfers GROUP BY account \
             HAVING count(*) > 1) AS t",
            &[],
        )
        .await;
    let total = h.count("SELECT count(*) FROM transfers", &[]).await;
    println!(
        "storm on {}: {KEYS} keys, {total} transfers, {twice} keys executed twice",
        std::any::type_name::<H>()
    );
    assert_eq!(twice, 0, "keys executed twice");
    assert_eq!(total, i64::try_from(KEYS).expect("small"));
    h.finish().await;
}

/// I1 where it costs money: keys each sent four times at once, twice to each of
/// two instances (on a cluster, through two nodes: `IDEM_TEST_MYSQL_OTHER_URL`),
/// to a handler that charges a card at a provider outside the database and then
/// books the charge, slow enough that the duplicates overlap; clients retry 409
/// and 5xx until answered. The provider, which sees every run whichever instance
/// made it and whatever became of its transaction, is never asked twice for a
/// key at once, and asked again only after a run whose transaction did not
/// commit (its client answered 5xx, the key released): once per key, unless the
/// database aborted a run.
pub async fn storms_across_instances_charge_each_key_once<H: Harness>() {
    // One writer at a time (SQLite) runs a slow handler after another.
    let keys: usize = if H::STALLED_WRITER_BLOCKS_TAKEOVER {
        20
    } else {
        200
    };
    let Some(h) = start::<H>().await else {
        return;
    };
    h.script(bank::SCHEMA).await;
    let (one, one_counts) = bank::app_counting::<H>(h.store().clone());
    let (two, two_counts) = bank::app_counting::<H>(h.another_instance());
    let barrier = Arc::new(tokio::sync::Barrier::new(keys * 4));
    let mut tasks = tokio::task::JoinSet::new();
    for key in 0..keys {
        for send in 0..4 {
            let app = if send % 2 == 0 {
                one.clone()
            } else {
                two.clone()
            };
            let barrier = Arc::clone(&barrier);
            tasks.spawn(async move {
                let path = format!("/v1/accounts/acct-{key}/charges");
                let key = format!("charge-{key}");
                barrier.wait().await;
                let mut failed = Vec::new();
                // Attempts sent again after a serialization failure (SERIALIZABLE
                // runs): each committed nothing, and its handler may have run.
                let retried = AtomicUsize::new(0);
                for _ in 0..1_000 {
                    let request = bank::request(&path, "alice", &key, r#"{"amount":100}"#);
                    let answer = call_counting(&app, request, &retried).await;
                    match answer.status {
                        201 => return (key, answer, failed, retried.into_inner()),
                        // A payment client retries any 5xx with the same key.
                        409 => {}
                        500 | 503 => failed.push(answer),
                        _ => panic!("{key}: {answer:?}"),
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                panic!("{key} never completed");
            });
        }
    }
    let mut answers: HashMap<String, Bytes> = HashMap::new();
    let mut failures: HashMap<String, Vec<Got>> = HashMap::new();
    let mut retries: HashMap<String, usize> = HashMap::new();
    while let Some(done) = tasks.join_next().await {
        let (key, answer, failed, retried) = done.expect("storm request");
        *retries.entry(key.clone()).or_default() += retried;
        let first = answers
            .entry(key.clone())
            .or_insert_with(|| answer.body.clone());
        assert_eq!(*first, answer.body, "I2 for {key}");
        failures.entry(key).or_default().extend(failed);
    }
    assert_eq!(answers.len(), keys);
    let mut runs: HashMap<String, Vec<(Instant, Instant)>> = HashMap::new();
    for counts in [&one_counts, &two_counts] {
        for (account, times) in counts.charged.lock().expect("charges").iter() {
            runs.entry(account.replace("acct-", "charge-"))
                .or_default()
                .extend(times);
        }
    }
    let mut at_once = Vec::new();
    let mut again = Vec::new();
    for (key, times) in &mut runs {
        times.sort();
        if times.windows(2).any(|two| two[1].0 < two[0].1) {
            at_once.push(key.clone());
        }
        // Runs whose transaction did not commit: rolled back (`Released`), or
        // refused at the commit (`StoreFailed`, retried in `call_counting` when
        // it was a serialization failure).
        let released = failures.get(key).map_or(0, |failed| {
            failed
                .iter()
                .filter(|got| matches!(got.outcome, Some(Outcome::Released | Outcome::StoreFailed)))
                .count()
        }) + retries.get(key).copied().unwrap_or(0);
        if times.len() > 1 + released {
            again.push((key.clone(), times.len(), failures.get(key).cloned()));
        }
    }
    let total = h.count("SELECT count(*) FROM transfers", &[]).await;
    println!(
        "charge storm on {}: {keys} keys, {} charges, {} keys charged twice or more \
         ({} of them at once), {total} rows",
        std::any::type_name::<H>(),
        runs.values().map(Vec::len).sum::<usize>(),
        runs.values().filter(|times| times.len() > 1).count(),
        at_once.len(),
    );
    assert_eq!(runs.len(), keys, "every key was charged");
    assert!(
        at_once.is_empty(),
        "keys charged twice at once: {at_once:?}"
    );
    assert!(
        again.is_empty(),
        "keys charged again without a rolled-back run: {again:?}"
    );
    assert_eq!(total, i64::try_from(keys).expect("small"));
    h.finish().await;
}

async fn audits<H: Harness>(h: &H, what: &str) -> i64 {
    let like = format!("{what}%");
    h.count("SELECT count(*) FROM audit WHERE what LIKE $1", &[&like])
        .await
}

fn problem_type(got: &Got) -> String {
    let body = String::from_utf8_lossy(&got.body);
    body.split("\"type\":\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .unwrap_or_default()
        .to_owned()
}

/// `Tx` and `IdempotencyKey` are ordinary extractors: behind an alias (with the
/// database named by `db`) the transaction commits with the response and the key
/// is bound to the caller's scope; a key-taking handler answers 400 without one;
/// a `Tx` outside an `#[idempotent]` handler, inside another extractor, or taken
/// twice is refused with 500 before anything is written or claimed.
pub async fn idem_extractors_work_in_any_handler<H: Harness>() {
    let Some((h, app)) = start_bank::<H>().await else {
        return;
    };
    let gift = |user: &str, key: &str| bank::request("/v1/gifts", user, key, r#"{"to":"bob"}"#);
    let first = call(&app, gift("alice", "g1")).await;
    assert_eq!(first.status, 201, "{first:?}");
    let again = call(&app, gift("alice", "g1")).await;
    assert_eq!(again.outcome, Some(Outcome::Replayed));
    assert_eq!(again.body, first.body);
    let other = call(&app, gift("carol", "g1")).await;
    assert_eq!(other.status, 201);
    assert_ne!(other.body, first.body, "the relayed key is per caller");
    assert_eq!(audits(&h, "gift to bob").await, 2, "one write per caller");

    let mut keyless = gift("alice", "unused");
    keyless.headers_mut().remove("idempotency-key");
    let keyless = call(&app, keyless).await;
    assert_eq!(keyless.status, 400);
    assert!(
        problem_type(&keyless).ends_with("missing-key"),
        "{keyless:?}"
    );

    for path in ["/v1/plain", "/v1/wrapped", "/v1/two"] {
        let got = call(&app, bank::request(path, "alice", "t1", "")).await;
        assert_eq!(got.status, 500, "{path}: {got:?}");
        assert!(
            problem_type(&got).ends_with("handler-failed"),
            "{path}: {got:?}"
        );
    }
    for what in ["plain", "wrapped", "two"] {
        assert_eq!(audits(&h, what).await, 0, "{what} wrote nothing");
    }
    let rows = h.key_rows("alice").await;
    assert!(
        rows.iter()
            .all(|(key, row)| key == "g1" && row.state == "completed"),
        "only the gift is stored: {rows:?}"
    );
    h.finish().await;
}

/// Contract §3: a replay runs nothing of the handler. A retry answered from the
/// replay cache does not run the last extractor (the body it answers for is the
/// one that extractor accepted); any other retry runs it first, so a body it
/// refuses gets its rejection, as on any handler, before a mismatch is told. A
/// scope given by the last parameter is extracted on every request.
pub async fn kept_replays_skip_the_last_extractor<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    h.script(bank::SCHEMA).await;
    let (app, counts) = bank::app_counting::<H>(h.store().clone());
    let retried = AtomicUsize::new(0);
    let extracted = || counts.extracted.load(Ordering::SeqCst) - retried.load(Ordering::SeqCst);
    let counted = |key: &str, body: &str| bank::request("/v1/counted", "alice", key, body);

    let first = call_counting(&app, counted("c1", r#"{"amount":7}"#), &retried).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(extracted(), 1);
    for _ in 0..3 {
        let again = call_counting(&app, counted("c1", r#"{"amount":7}"#), &retried).await;
        assert_eq!(again.outcome, Some(Outcome::Replayed), "{again:?}");
        assert_eq!(again.body, first.body);
    }
    assert_eq!(extracted(), 1, "kept replays run no extractor");

    let refused = call_counting(&app, counted("c1", "{not json"), &retried).await;
    assert_eq!(
        refused.status, 400,
        "the extractor's rejection: {refused:?}"
    );
    assert_eq!(refused.outcome, None);
    let other = call_counting(&app, counted("c1", r#"{"amount":8}"#), &retried).await;
    assert_eq!(other.status, 422, "{other:?}");
    assert_eq!(extracted(), 3);

    // An instance that keeps no copy reads the table, after the extractor ran.
    let (two, two_counts) = bank::app_counting::<H>(h.another_instance());
    let read = call(&two, counted("c1", r#"{"amount":7}"#)).await;
    assert_eq!(read.outcome, Some(Outcome::Replayed), "{read:?}");
    assert_eq!(read.body, first.body);
    assert_eq!(two_counts.extracted.load(Ordering::SeqCst), 1);

    let last = |key: &str| bank::request("/v1/scope-last", "bob", key, "");
    let first_last = call_counting(&app, last("s1"), &retried).await;
    assert_eq!(first_last.status, 201, "{first_last:?}");
    let again_last = call_counting(&app, last("s1"), &retried).await;
    assert_eq!(
        again_last.outcome,
        Some(Outcome::Replayed),
        "{again_last:?}"
    );
    assert_eq!(again_last.body, first_last.body);
    assert_eq!(extracted(), 5, "the scope is extracted every time");

    assert_eq!(audits(&h, "counted").await, 1, "one execution");
    assert_eq!(audits(&h, "scope last").await, 1, "one execution");
    h.finish().await;
}
