//! Identity, table and configuration edges: content types, requests and responses
//! the table must hold whole, expired keys under a storm, inconsistent options,
//! and tables created by an earlier release.

use std::sync::Arc;
use std::time::Duration;

use axum::http::Method;
use idem_axum::Outcome;
use tokio::sync::Barrier;

use crate::app::{self, Req, router, router_on, send};
use crate::harness::Harness;
#[cfg(feature = "mysql")]
use crate::harness::My;
use crate::{BODY, assert_in_flight, start, unique_suffix};

/// Contract §2: the body's Content-Type belongs to the identity: the same bytes sent
/// as JSON and as a form are two requests.
pub async fn content_type_is_part_of_the_identity<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    let json = Req::post("alice", "k-ct", BODY).header("content-type", "application/json");
    let first = send(&app, &json).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let form = Req::post("alice", "k-ct", BODY)
        .header("content-type", "application/x-www-form-urlencoded");
    let other = send(&app, &form).await;
    assert_eq!(other.status, 422, "{}", other.text());
    assert!(other.text().contains("Content-Type"), "{}", other.text());
    let none = send(&app, &Req::post("alice", "k-ct", BODY)).await;
    assert_eq!(none.status, 422, "no content type is another one");
    let again = send(&app, &json).await;
    assert_eq!(again.outcome, Some(Outcome::Replayed));
    assert_eq!(again.body, first.body);
    assert_eq!(h.effects("alice").await, 1);
    h.finish().await;
}

/// Contract §2: a retry's `Content-Type` is compared as a media type, on the
/// store that recorded the key (its replay cache) and on another instance (the
/// database's row): another spelling of the same type replays, another type or
/// charset is refused 422, and where the body is JSON its `charset` is no part
/// of it.
pub async fn content_types_compare_as_media_types<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let apps = [router(&h), router_on::<H>(h.another_instance())];
    let typed = |key: &str, content_type: &str| {
        Req::post("alice", key, BODY).header("content-type", content_type.to_owned())
    };
    // (key, first Content-Type, retries that replay, retries refused 422)
    let cases: [(&str, &str, &[&str], &[&str]); 3] = [
        (
            "k-json",
            "application/json",
            &[
                "Application/JSON",
                "application/json; charset=utf-8",
                "application/json;charset=\"UTF-8\"",
            ],
            &[
                "application/x-www-form-urlencoded",
                "application/json; v=2",
                "",
            ],
        ),
        (
            "k-text",
            "text/plain; charset=utf-8; format=flowed",
            &[
                "TEXT/Plain; Format=\"flowed\"; charset=UTF-8",
                "text/plain;format=flowed;charset=utf-8",
            ],
            &[
                "text/plain; charset=latin1; format=flowed",
                "text/plain; format=flowed",
            ],
        ),
        (
            "k-problem",
            "application/problem+json; charset=utf-8",
            &[
                "application/problem+json",
                "APPLICATION/PROBLEM+JSON; CHARSET=utf-16",
            ],
            &["application/json"],
        ),
    ];
    for (key, first, same, other) in cases {
        let recorded = send(&apps[0], &typed(key, first)).await;
        assert_eq!(recorded.status, 201, "{first}: {}", recorded.text());
        for app in &apps {
            for retry in same {
                let got = send(app, &typed(key, retry)).await;
                assert_eq!(got.outcome, Some(Outcome::Replayed), "{first} then {retry}");
                assert_eq!(got.body, recorded.body);
            }
            for retry in other {
                let req = if retry.is_empty() {
                    Req::post("alice", key, BODY)
                } else {
                    typed(key, retry)
                };
                let got = send(app, &req).await;
                assert_eq!(got.status, 422, "{first} then {retry:?}: {}", got.text());
                assert!(got.text().contains("Content-Type"), "{}", got.text());
            }
        }
    }
    // Where the endpoint fingerprints JSON, a charset means nothing, on any type.
    let json = |content_type: &str| typed("k-any", content_type).header("x-json-fingerprint", 1);
    let recorded = send(&apps[0], &json("text/plain; charset=utf-8")).await;
    assert_eq!(recorded.status, 201, "{}", recorded.text());
    for app in &apps {
        let got = send(app, &json("text/plain; charset=latin1")).await;
        assert_eq!(got.outcome, Some(Outcome::Replayed), "{}", got.text());
        assert_eq!(send(app, &json("text/html")).await.status, 422);
    }
    assert_eq!(h.effects("alice").await, 4);
    h.finish().await;
}

/// Contract §2: a 422 names the first part of the request that differs from the
/// key's first use (`mismatch`: method, path, query, content-type, body) and
/// shows nothing of what that first request held.
pub async fn mismatches_name_the_part_that_differs<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    let first = Req::post("alice", "k-parts", BODY)
        .path("/any?secret=s3cr3t")
        .header("content-type", "application/json");
    assert_eq!(send(&app, &first).await.status, 201);
    let cases = [
        ("method", first.clone().method(Method::PUT)),
        ("path", first.clone().path("/effects?secret=s3cr3t")),
        ("query", first.clone().path("/any?secret=other")),
        ("query", first.clone().path("/any")),
        (
            "content-type",
            first.clone().header("content-type", "text/plain"),
        ),
        (
            "body",
            Req::post("alice", "k-parts", "{}")
                .path("/any?secret=s3cr3t")
                .header("content-type", "application/json"),
        ),
    ];
    for (part, req) in cases {
        let got = send(&app, &req).await;
        assert_eq!(got.status, 422, "{part}: {}", got.text());
        let problem: serde_json::Value = serde_json::from_slice(&got.body).expect("JSON");
        assert_eq!(problem["mismatch"], part, "{problem}");
        assert!(!got.text().contains("s3cr3t"), "{}", got.text());
        assert!(!got.text().contains("/any"), "{}", got.text());
    }
    assert_eq!(h.effects("alice").await, 1);
    h.finish().await;
}

/// A legal request or response is stored whole, never refused by a column: an
/// extension method of 40 characters, a 6 KiB query, 100 KiB of response headers.
pub async fn the_table_holds_legal_requests_and_responses<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    let method = Method::from_bytes(b"RECONCILE-LEDGER-ENTRIES-FOR-THE-QUARTER").expect("token");
    let long = Req::post("alice", "k-method", BODY)
        .path("/any")
        .method(method.clone());
    let first = send(&app, &long).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let replay = send(&app, &long).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed), "{}", replay.text());
    assert_eq!(replay.body, first.body);

    let query = format!("/any?filter={}", "q".repeat(6 * 1024));
    let long_path = Req::post("alice", "k-path", BODY).path(&query);
    assert_eq!(send(&app, &long_path).await.status, 201);
    let replay = send(&app, &long_path).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed), "{}", replay.text());

    let big = Req::post("alice", "k-headers", BODY).header("x-big-headers", 100 * 1024);
    let first = send(&app, &big).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let replay = send(&app, &big).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed), "{}", replay.text());
    assert!(first.headers.contains_key("x-big-12"), "100 KiB of headers");
    for (name, value) in &first.headers {
        if name != "set-cookie" {
            assert_eq!(replay.headers.get(name), Some(value), "{name}");
        }
    }
    assert_eq!(h.effects("alice").await, 3);
    h.finish().await;
}

/// Scopes and keys reach SQL as bound parameters and, in MySQL's claim, as hex
/// literals written into its text: every kind of byte a scope or key may hold
/// finds its own row. Each pair is raced by duplicates over three instances (one
/// execution), then replayed by an instance that never saw it (the database's
/// row, not a replay cache), then refused with another body.
pub async fn any_legal_scope_and_key_finds_its_own_row<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let apps = [
        router(&h),
        router_on::<H>(h.another_instance()),
        router_on::<H>(h.another_instance()),
    ];
    let scopes = [
        "O'Brien",
        r"back\slash",
        r#"quote"d"#,
        "50%_off",
        "x'); DELETE FROM effects; --",
    ];
    // Raw header values: bare keys take any visible ASCII but the comma; a quoted
    // one holds spaces, commas and escaped quotes.
    let keys = [
        "k-case",
        "K-CASE",
        "it's",
        r"a\b",
        "50%_",
        "0x41",
        "X'41'",
        r#""a \"quoted\" key, too""#,
    ];
    let mut requests = tokio::task::JoinSet::new();
    let barrier = Arc::new(Barrier::new(scopes.len() * keys.len() * apps.len()));
    for scope in scopes {
        for key in keys {
            let req = Req::post(scope, "unused", BODY)
                .keys(&[key])
                .header("x-wait-ms", 20_000);
            for app in &apps {
                let (app, req, barrier) = (app.clone(), req.clone(), Arc::clone(&barrier));
                requests.spawn(async move {
                    barrier.wait().await;
                    ((scope, key), send(&app, &req).await)
                });
            }
        }
    }
    let mut answers = std::collections::HashMap::<_, Vec<_>>::new();
    while let Some(done) = requests.join_next().await {
        let (pair, got) = done.expect("request");
        assert_eq!(got.status, 201, "{pair:?}: {}", got.text());
        answers.entry(pair).or_default().push(got);
    }
    let mut bodies = std::collections::HashSet::new();
    for (pair, got) in &answers {
        let executed = got
            .iter()
            .filter(|g| g.outcome == Some(Outcome::Executed))
            .count();
        assert_eq!(executed, 1, "{pair:?} executed once");
        assert!(
            got.iter().all(|g| g.body == got[0].body),
            "{pair:?}: one answer"
        );
        assert!(
            bodies.insert(got[0].body.clone()),
            "{pair:?} has a body of its own"
        );
    }
    for scope in scopes {
        assert_eq!(h.effects(scope).await, keys.len() as i64, "{scope}");
    }
    let cold = router_on::<H>(h.another_instance());
    for ((scope, key), got) in &answers {
        let req = Req::post(scope, "unused", BODY).keys(&[key]);
        let replay = send(&cold, &req).await;
        assert_eq!(
            replay.outcome,
            Some(Outcome::Replayed),
            "{scope:?} {key:?}: {}",
            replay.text()
        );
        assert_eq!(replay.body, got[0].body, "{scope:?} {key:?}");
        let other = send(&cold, &req.body(r#"{"amount":7,"currency":"JPY"}"#)).await;
        assert_eq!(other.status, 422, "{scope:?} {key:?}: {}", other.text());
    }
    for scope in scopes {
        assert_eq!(
            h.effects(scope).await,
            keys.len() as i64,
            "{scope}: nothing ran again"
        );
    }
    h.finish().await;
}

/// §4.1 for a key whose ttl has passed: duplicates of it are answered 409 at once
/// while the first holds it, as for a new key, and never queue on its row holding
/// pooled connections: an unrelated request completes meanwhile.
pub async fn expired_key_duplicates_answer_at_once<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    h.insert_expired("alice", "k-expired-", 1, true).await;
    let key = "k-expired-1";
    let gate = format!("gate-{}", unique_suffix());
    let req = Req::post("alice", key, BODY)
        .header("x-gate", &gate)
        .header("x-lock-ms", 30_000);
    let barrier = Arc::new(Barrier::new(40));
    let mut requests = tokio::task::JoinSet::new();
    for _ in 0..40 {
        let (app, req, barrier) = (app.clone(), req.clone(), Arc::clone(&barrier));
        requests.spawn(async move {
            barrier.wait().await;
            send(&app, &req).await
        });
    }
    let mut early = Vec::new();
    // The holder stays at its gate: a duplicate queued behind it could only answer
    // after its 30 s lock, far beyond this bound.
    let answered = tokio::time::timeout(Duration::from_secs(10), async {
        while early.len() < 39 {
            early.push(requests.join_next().await.expect("task").expect("request"));
        }
        // SQLite has one writer, which the holder keeps: nothing else can write.
        if !H::STALLED_WRITER_BLOCKS_TAKEOVER {
            let unrelated = send(&app, &Req::post("alice", "k-unrelated", BODY)).await;
            assert_eq!(unrelated.status, 201, "{}", unrelated.text());
        }
    })
    .await;
    app::open_gate(&gate);
    answered.expect("duplicates of an expired key queued behind its holder");
    for got in &early {
        assert_in_flight(got);
    }
    let winner = requests.join_next().await.expect("task").expect("request");
    assert_eq!(winner.status, 201, "{}", winner.text());
    let unrelated = i64::from(!H::STALLED_WRITER_BLOCKS_TAKEOVER);
    assert_eq!(
        h.effects("alice").await,
        1 + unrelated,
        "the expired key once"
    );
    h.finish().await;
}

/// `Options` built by hand are held to the attribute's rule, `lock` < `ttl`:
/// otherwise 500 `invalid-options`, and nothing runs or is stored.
pub async fn inconsistent_options_are_refused<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    let req = Req::post("alice", "k-options", BODY)
        .header("x-ttl-ms", 1_000)
        .header("x-lock-ms", 5_000);
    let got = send(&app, &req).await;
    assert_eq!(got.status, 500, "{}", got.text());
    assert_eq!(got.problem().as_deref(), Some("invalid-options"));
    assert!(got.text().contains("lock"), "{}", got.text());
    let pointer = Req::post("alice", "k-pointer", BODY).header("x-bad-pointer", 1);
    let got = send(&app, &pointer).await;
    assert_eq!(got.status, 500, "{}", got.text());
    assert_eq!(got.problem().as_deref(), Some("invalid-options"));
    assert!(
        got.text().contains("\\\"sent_at\\\" is not a JSON Pointer"),
        "{}",
        got.text()
    );
    assert_eq!(h.effects("alice").await, 0);
    assert!(h.key_rows("alice").await.is_empty());
    h.finish().await;
}

/// A table created by the previous release, with live keys in it, is upgraded in
/// place by `migrate()`: its completed key still replays, its stale claim is taken
/// over, and new keys get the new identity rules; migrating again changes nothing.
pub async fn migrate_upgrades_a_table_of_the_previous_release<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let table = "legacy_keys";
    h.legacy_table(table, BODY.as_bytes()).await;
    let store = h.store_on(table);
    store.migrate().await.expect("upgrade");
    store.migrate().await.expect("again");
    let app = router_on::<H>(store);

    // Recorded before content types were stored: any content type replays it.
    let old = Req::post("alice", "k-old", BODY).header("content-type", "text/plain");
    let replay = send(&app, &old).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed), "{}", replay.text());
    assert_eq!(replay.text(), "old-body");
    assert_eq!(replay.header("content-type"), Some("application/json"));

    let stale = send(&app, &Req::post("alice", "k-stale", BODY)).await;
    assert_eq!(stale.outcome, Some(Outcome::TakenOver), "{}", stale.text());

    let json = Req::post("alice", "k-new", BODY).header("content-type", "application/json");
    assert_eq!(send(&app, &json).await.status, 201);
    let form = Req::post("alice", "k-new", BODY).header("content-type", "text/plain");
    assert_eq!(send(&app, &form).await.status, 422);
    let long = Req::post("alice", "k-long", BODY)
        .path("/any")
        .method(Method::from_bytes(b"A-METHOD-LONGER-THAN-SIXTEEN").expect("token"));
    assert_eq!(send(&app, &long).await.status, 201);
    assert_eq!(h.effects("alice").await, 3);
    assert_eq!(
        h.count(&format!("SELECT count(*) FROM {table}"), &[]).await,
        4
    );
    h.finish().await;
}

/// MySQL/MariaDB: a key's claim takes the named lock every release of idem takes
/// for it in the pool's database, so instances of two releases exclude each other
/// during a rolling deploy; also when the session has moved to another database
/// than its pool's, where the key stays in the pool's database's table. (In the
/// cluster mode the key is held by its committed claim row instead, which the
/// test writes in the pool's database: `My::hold_key`.)
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_claims_take_the_lock_every_release_takes() {
    let Some(h) = start::<My>().await else { return };
    let (moved, elsewhere) = h.store_moved_by_session().await;
    // The app writes its effects in the session's database; idem its keys in the
    // pool's, always.
    let effects = async || {
        let there = format!("SELECT COUNT(*) FROM {elsewhere}.effects WHERE scope = 'alice'");
        h.effects("alice").await + h.count(&there, &[]).await
    };
    for (n, store) in [h.store().clone(), moved].into_iter().enumerate() {
        let app = router_on::<My>(store);
        let key = format!("k-lock-{n}");
        let held = h.hold_key("alice", &key).await;
        let busy = send(&app, &Req::post("alice", &key, BODY)).await;
        assert_in_flight(&busy);
        assert_eq!(effects().await, i64::try_from(n).expect("small"));
        held.release().await;
        let free = send(&app, &Req::post("alice", &key, BODY)).await;
        assert_eq!(free.status, 201, "{}", free.text());
        assert_eq!(effects().await, i64::try_from(n + 1).expect("small"));
        let replay = send(&app, &Req::post("alice", &key, BODY)).await;
        assert_eq!(replay.outcome, Some(Outcome::Replayed), "{}", replay.text());
    }
    let keys: Vec<String> = h
        .key_rows("alice")
        .await
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(
        keys,
        ["k-lock-0", "k-lock-1"],
        "both in the pool's database"
    );
    // `migrate()` on such a session creates the table there too, and leaves the
    // session where the application put it.
    let pool = h.store_moved_by_session_pool(&elsewhere).await;
    let store = idem_axum::Idempotency::builder(pool.clone())
        .table("moved_keys")
        .build()
        .expect("store");
    store.migrate().await.expect("migrate");
    let in_pool_database = "SELECT COUNT(*) FROM information_schema.TABLES \
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'moved_keys'";
    assert_eq!(h.count(in_pool_database, &[]).await, 1);
    let session: Option<String> = sqlx::query_scalar("SELECT DATABASE()")
        .fetch_one(&pool)
        .await
        .expect("the session's database");
    assert_eq!(session.as_deref(), Some(elsewhere.as_str()));
    pool.close().await;
    h.finish().await;
}

/// MySQL/MariaDB with `autocommit = 0` sessions (an application's choice): a
/// statement outside a transaction opens one implicitly and nothing ends it, so a
/// claim that read before its `BEGIN` would read an old snapshot on a pooled
/// connection and miss a key another instance completed since. Every claim reads
/// in a transaction it began after the lock: the key is replayed, never run again.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_sessions_without_autocommit_see_every_commit() {
    let Some(h) = start::<My>().await else { return };
    let (pool, store) = h.store_with_session("SET SESSION autocommit = 0").await;
    let manual = router_on::<My>(store);
    let other = router(&h);
    for n in 0..3 {
        // A key the other instance completed, found stored: the claim fails and
        // reads (and the one connection goes back to the pool).
        let seen = format!("k-seen-{n}");
        assert_eq!(
            send(&other, &Req::post("alice", &seen, BODY)).await.status,
            201
        );
        let replay = send(&manual, &Req::post("alice", &seen, BODY)).await;
        assert_eq!(replay.outcome, Some(Outcome::Replayed), "{}", replay.text());
        // Completed by the other instance after that read.
        let later = format!("k-later-{n}");
        let first = send(&other, &Req::post("alice", &later, BODY)).await;
        assert_eq!(first.status, 201, "{}", first.text());
        let again = send(&manual, &Req::post("alice", &later, BODY)).await;
        assert_eq!(again.outcome, Some(Outcome::Replayed), "{}", again.text());
        assert_eq!(again.body, first.body);
        assert_eq!(h.effects("alice").await, 2 * (n + 1), "each key ran once");
        // And a new key on such a session commits.
        let own = send(&manual, &Req::post("bob", &format!("k-own-{n}"), BODY)).await;
        assert_eq!(own.outcome, Some(Outcome::Executed), "{}", own.text());
        assert_eq!(h.effects("bob").await, n + 1);
    }
    // A duplicate that waits looks the key up again and again on that session: it
    // sees the other instance's commit.
    let key = format!("k-waited-{}", unique_suffix());
    let first = {
        let (other, req) = (
            other.clone(),
            Req::post("carol", &key, BODY).header("x-gate", &key),
        );
        tokio::spawn(async move { send(&other, &req).await })
    };
    crate::await_started(&key).await;
    let waiting = {
        let req = Req::post("carol", &key, BODY).header("x-wait-ms", 20_000);
        tokio::spawn(async move { send(&manual, &req).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    app::open_gate(&key);
    let first = first.await.expect("first");
    let waited = waiting.await.expect("waiting duplicate");
    assert_eq!(waited.outcome, Some(Outcome::Replayed), "{}", waited.text());
    assert_eq!(waited.body, first.body);
    assert_eq!(h.effects("carol").await, 1);
    pool.close().await;
    h.finish().await;
}

/// MySQL/MariaDB with `autocommit = 0` sessions: what idem runs outside a claim's
/// transaction (the look after a lost claim, an operator's look and deletion, the
/// sweeper) ends the transaction its statement opened. A deletion is committed, not
/// lost with the session or left holding its rows' locks, and no pooled connection
/// keeps a snapshot that would hold back InnoDB's purge and the application's next
/// read.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_sessions_without_autocommit_are_left_without_a_transaction() {
    let Some(h) = start::<My>().await else { return };
    let (pool, store) = h.store_with_session("SET SESSION autocommit = 0").await;
    let manual = router_on::<My>(store.clone());
    let other = router(&h);

    // A duplicate of a key in flight: its claim fails, then it looks the key up.
    let held = h.hold_key("alice", "k-busy").await;
    let busy = send(&manual, &Req::post("alice", "k-busy", BODY)).await;
    assert_in_flight(&busy);
    held.release().await;
    assert_eq!(h.open_transactions().await, 0, "after a lost claim's look");

    // An operator's look and deletion of a completed key.
    let done = send(&manual, &Req::post("alice", "k-done", BODY)).await;
    assert_eq!(done.outcome, Some(Outcome::Executed), "{}", done.text());
    let seen = store.inspect("alice", "k-done").await.expect("inspect");
    assert_eq!(seen.map(|r| r.state), Some("completed".to_owned()));
    assert_eq!(h.open_transactions().await, 0, "after an operator's look");
    assert_eq!(
        store.forget("alice", "k-done").await.expect("forget"),
        idem_axum::Forgotten::Deleted
    );
    assert_eq!(h.open_transactions().await, 0, "after a deletion");
    assert!(
        h.key_rows("alice")
            .await
            .iter()
            .all(|(key, _)| key != "k-done")
    );
    let again = send(&other, &Req::post("alice", "k-done", BODY)).await;
    assert_eq!(again.outcome, Some(Outcome::Executed), "{}", again.text());
    assert_eq!(h.effects("alice").await, 2, "forgotten, so run again");

    // The sweeper's deletions.
    h.insert_expired("old", "done-", 30, true).await;
    let report = store
        .sweep(idem_axum::Sweep::new().batch(10))
        .await
        .expect("sweep");
    assert_eq!(report.deleted, 30);
    assert_eq!(h.open_transactions().await, 0, "after a sweep");
    assert!(
        h.key_rows("old").await.is_empty(),
        "every deletion committed"
    );
    pool.close().await;
    h.finish().await;
}

/// MySQL/MariaDB: the session settings idem changes for a claim (`wait_timeout`,
/// `innodb_lock_wait_timeout`) come back to the application's own values, not the
/// server's defaults, after every kind of request.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_session_settings_are_restored() {
    let Some(h) = start::<My>().await else { return };
    let init = "SET SESSION wait_timeout = 12345, innodb_lock_wait_timeout = 77";
    let (pool, store) = h.store_with_session(init).await;
    let app = router_on::<My>(store);
    h.insert_expired("alice", "k-exp-", 1, true).await;
    for req in [
        Req::post("alice", "k-new", BODY),
        Req::post("alice", "k-new", BODY),
        Req::post("alice", "k-exp-1", BODY),
        Req::post("alice", "k-fail", BODY).header("x-status", 500),
    ] {
        let got = send(&app, &req).await;
        assert!(matches!(got.status, 201 | 500), "{}", got.text());
        let (wait, lock): (i64, i64) = sqlx::query_as(
            "SELECT CAST(@@SESSION.wait_timeout AS SIGNED), \
                        CAST(@@SESSION.innodb_lock_wait_timeout AS SIGNED)",
        )
        .fetch_one(&pool)
        .await
        .expect("session settings");
        assert_eq!((wait, lock), (12345, 77), "after {:?}", req.keys);
    }
    pool.close().await;
    h.finish().await;
}
