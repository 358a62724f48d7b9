//! §5 "Replays from memory": completed responses an instance keeps in process.
//! What reaches the database is counted as the connections the instance's pool
//! hands out: a replay from memory takes none.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_axum::{Forgotten, Idempotency, Outcome};
use sqlx::pool::PoolOptions;
use tokio::sync::Barrier;

use crate::app::{Got, Req, router_on, send};
use crate::harness::Harness;
use crate::{BODY, start, unique_suffix};

/// Another instance whose pool counts the connections it hands out. Its sessions
/// start as the driver's defaults (the harness's own session settings are not
/// carried over): only reads of the key table go through it.
fn counted<H: Harness>(h: &H, refresh: Duration) -> (Idempotency<H::DB>, Arc<AtomicUsize>) {
    counted_on(h, refresh, 8, Duration::from_secs(10))
}

/// [`counted`] with a pool of `size` connections, which waits at most `wait` for one.
fn counted_on<H: Harness>(
    h: &H,
    refresh: Duration,
    size: u32,
    wait: Duration,
) -> (Idempotency<H::DB>, Arc<AtomicUsize>) {
    let options = h.another_instance().pool().connect_options();
    let acquired = Arc::new(AtomicUsize::new(0));
    let (opened, reused) = (Arc::clone(&acquired), Arc::clone(&acquired));
    let pool = PoolOptions::<H::DB>::new()
        .max_connections(size)
        .acquire_timeout(wait)
        .after_connect(move |_, _| {
            opened.fetch_add(1, Ordering::SeqCst);
            Box::pin(async { Ok(()) })
        })
        .before_acquire(move |_, _| {
            reused.fetch_add(1, Ordering::SeqCst);
            Box::pin(async { Ok(true) })
        })
        .connect_lazy_with((*options).clone());
    let store = h
        .instance_on(pool)
        .replay_cache_refresh(refresh)
        .build()
        .expect("counted instance");
    (store, acquired)
}

/// The pool's connection once it is idle, within 10 s.
async fn idle_connection<DB: sqlx::Database>(
    pool: &sqlx::Pool<DB>,
) -> sqlx::pool::PoolConnection<DB> {
    for _ in 0..200 {
        if let Some(conn) = pool.try_acquire() {
            return conn;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no idle connection within 10 s");
}

/// Sends every request at once; the answers in the order sent.
async fn storm(app: &axum::Router, reqs: &[Req]) -> Vec<Got> {
    let barrier = Arc::new(Barrier::new(reqs.len()));
    let mut tasks = Vec::new();
    for req in reqs {
        let (app, req, barrier) = (app.clone(), req.clone(), Arc::clone(&barrier));
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            send(&app, &req).await
        }));
    }
    let mut got = Vec::new();
    for task in tasks {
        got.push(task.await.expect("request"));
    }
    got
}

fn assert_replays(got: &[Got], first: &Got) {
    for g in got {
        assert_eq!(g.outcome, Some(Outcome::Replayed), "{}", g.text());
        assert_eq!(g.status, first.status);
        assert_eq!(g.body, first.body, "byte for byte");
        for name in ["content-type", "location", "x-custom"] {
            assert_eq!(g.header(name), first.header(name), "{name}");
        }
    }
}

/// A storm of duplicates of completed keys reaches the database at most once per
/// key per instance: never on the instance that committed the key, once on one
/// that had not seen it. A different request under a kept key is still 422, and
/// nothing it sends changes the record.
pub async fn completed_keys_are_replayed_from_memory<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let (one, one_acquired) = counted(&h, Duration::from_secs(60));
    let (two, two_acquired) = counted(&h, Duration::from_secs(60));
    let (one, two) = (router_on::<H>(one), router_on::<H>(two));
    let suffix = unique_suffix();

    let keys: Vec<String> = (0..10).map(|n| format!("k-mem-{n}-{suffix}")).collect();
    let mut firsts = HashMap::new();
    for key in &keys {
        let first = send(&one, &Req::post("alice", key, BODY)).await;
        assert_eq!(first.outcome, Some(Outcome::Executed), "{}", first.text());
        firsts.insert(key.clone(), first);
    }

    // 8 duplicates of each key on the instance that committed them: none reaches
    // the database.
    let before = one_acquired.load(Ordering::SeqCst);
    let reqs: Vec<Req> = keys
        .iter()
        .flat_map(|key| std::iter::repeat_n(Req::post("alice", key, BODY), 8))
        .collect();
    let got = storm(&one, &reqs).await;
    for (req, g) in reqs.iter().zip(&got) {
        assert_replays(std::slice::from_ref(g), &firsts[&req.keys[0]]);
    }
    assert_eq!(
        one_acquired.load(Ordering::SeqCst),
        before,
        "no connection taken"
    );

    // The same storm on an instance that has not seen the keys: one read each.
    let got = storm(&two, &reqs).await;
    for (req, g) in reqs.iter().zip(&got) {
        assert_replays(std::slice::from_ref(g), &firsts[&req.keys[0]]);
    }
    let reads = two_acquired.load(Ordering::SeqCst);
    assert_eq!(reads, keys.len(), "one read per key on the second instance");
    let again = storm(&two, &reqs).await;
    assert_eq!(again.len(), reqs.len());
    assert_eq!(two_acquired.load(Ordering::SeqCst), reads, "then none");

    // Another request under a kept key: 422 from memory, the record untouched.
    let stored = h.key_rows("alice").await;
    let other = Req::post("alice", &keys[0], r#"{"amount":999,"currency":"JPY"}"#);
    for app in [&one, &two] {
        let got = send(app, &other).await;
        assert_eq!(got.status, 422, "{}", got.text());
        assert_eq!(got.outcome, Some(Outcome::Mismatch));
        let moved = send(app, &Req::post("alice", &keys[0], BODY).path("/other")).await;
        assert_eq!(moved.status, 422, "{}", moved.text());
    }
    assert_eq!(two_acquired.load(Ordering::SeqCst), reads);
    assert_eq!(h.key_rows("alice").await, stored, "records unchanged");
    assert_eq!(h.effects("alice").await, 10, "one execution per key");
    h.finish().await;
}

/// A kept response is never replayed past its key's ttl: the next request runs
/// the handler again, on the instance that committed it and on one that read it.
pub async fn kept_responses_end_with_their_key<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let (one, _) = counted(&h, Duration::from_secs(600));
    let (two, _) = counted(&h, Duration::from_secs(600));
    let (one, two) = (router_on::<H>(one), router_on::<H>(two));
    let key = format!("k-mem-ttl-{}", unique_suffix());
    let req = Req::post("alice", &key, BODY)
        .header("x-ttl-ms", 1500)
        .header("x-lock-ms", 1000);
    let first = send(&one, &req).await;
    assert_eq!(first.outcome, Some(Outcome::Executed), "{}", first.text());
    assert_replays(&[send(&one, &req).await, send(&two, &req).await], &first);

    tokio::time::sleep(Duration::from_millis(1600)).await;
    let again = send(&two, &req).await;
    assert_eq!(again.outcome, Some(Outcome::Executed), "{}", again.text());
    assert_ne!(again.body, first.body);
    // The first instance's copy ended too: it replays the new execution.
    assert_replays(&[send(&one, &req).await], &again);
    assert_eq!(h.effects("alice").await, 2);
    h.finish().await;
}

/// Only what committed is kept: a handler that failed, or a key taken while its
/// first request runs, is never answered from memory.
pub async fn only_committed_responses_are_kept<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let (store, _) = counted(&h, Duration::from_secs(60));
    let app = router_on::<H>(store);
    let key = format!("k-mem-fail-{}", unique_suffix());
    let failing = Req::post("alice", &key, BODY).header("x-status", 500);
    assert_eq!(send(&app, &failing).await.status, 500);
    let retried = send(&app, &Req::post("alice", &key, BODY)).await;
    assert_eq!(
        retried.outcome,
        Some(Outcome::Executed),
        "{}",
        retried.text()
    );
    assert_eq!(
        h.effects("alice").await,
        1,
        "the failed run was rolled back"
    );

    let gated = format!("k-mem-gate-{}", unique_suffix());
    let req = Req::post("alice", &gated, BODY).header("x-lock-ms", 20_000);
    let first = {
        let (app, req) = (app.clone(), req.clone().header("x-gate", &gated));
        tokio::spawn(async move { send(&app, &req).await })
    };
    crate::await_started(&gated).await;
    assert_eq!(send(&app, &req).await.status, 409, "in flight, not kept");
    crate::app::open_gate(&gated);
    let first = first.await.expect("first");
    assert_eq!(first.outcome, Some(Outcome::Executed), "{}", first.text());
    assert_replays(&[send(&app, &req).await], &first);
    h.finish().await;
}

/// An operator's deletion (`idem forget`): the instance that deleted runs the key
/// again at once; another replays its copy until its refresh has passed, then
/// reads the table again. A claim is never deleted, nor another scope's key.
pub async fn forgotten_keys_run_again<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let refresh = Duration::from_millis(800);
    let (one, _) = counted(&h, refresh);
    let (two, two_acquired) = counted(&h, refresh);
    let operator = one.clone();
    let (one, two) = (router_on::<H>(one), router_on::<H>(two));
    let key = format!("k-forget-{}", unique_suffix());
    let req = Req::post("alice", &key, BODY);
    let first = send(&one, &req).await;
    assert_eq!(first.outcome, Some(Outcome::Executed), "{}", first.text());
    assert_replays(&[send(&two, &req).await], &first);
    let read = two_acquired.load(Ordering::SeqCst);

    assert_eq!(
        operator.forget("alice", &key).await.expect("forget"),
        Forgotten::Deleted
    );
    assert!(h.key_rows("alice").await.is_empty(), "deleted");
    let again = send(&one, &req).await;
    assert_eq!(again.outcome, Some(Outcome::Executed), "{}", again.text());
    assert_ne!(again.body, first.body);
    // Within its refresh the other instance still has the first response...
    assert_replays(&[send(&two, &req).await], &first);
    assert_eq!(two_acquired.load(Ordering::SeqCst), read, "from memory");
    // ...and after it, the table's.
    tokio::time::sleep(refresh).await;
    assert_replays(&[send(&two, &req).await], &again);
    assert_eq!(h.effects("alice").await, 2);

    // A claim is never deleted: here one whose executor crashed.
    let stale = format!("k-forget-stale-{}", unique_suffix());
    h.insert_stale_claim("bob", &stale, "POST", "/effects", BODY.as_bytes())
        .await;
    assert_eq!(
        operator.forget("bob", &stale).await.expect("forget"),
        Forgotten::InFlight,
        "a stuck claim is still a claim"
    );
    let rows = h.key_rows("bob").await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].1.state, "processing", "still claimed");
    assert_eq!(
        operator.forget("bob", &key).await.expect("forget"),
        Forgotten::NotFound,
        "scoped"
    );
    assert_eq!(h.key_rows("alice").await.len(), 1);
    h.finish().await;
}

/// When the database fails (here: no connection to be had), an instance trusts
/// none of its copies any more: after a failover the table may lack a commit it
/// kept, and a retry must then run again.
pub async fn a_failed_database_ends_the_copies<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let (store, acquired) = counted_on(&h, Duration::from_secs(60), 1, Duration::from_secs(2));
    let app = router_on::<H>(store.clone());
    let key = format!("k-mem-fail-db-{}", unique_suffix());
    let req = Req::post("alice", &key, BODY);
    let first = send(&app, &req).await;
    assert_eq!(first.outcome, Some(Outcome::Executed), "{}", first.text());
    let before = acquired.load(Ordering::SeqCst);
    assert_replays(&[send(&app, &req).await], &first);
    assert_eq!(acquired.load(Ordering::SeqCst), before, "from memory");

    // Handing a connection back takes a ping: on a loaded machine longer than
    // a bound short enough for a starved request to wait out.
    let held = idle_connection(store.pool()).await;
    let starved = send(&app, &Req::post("alice", &format!("{key}-new"), BODY)).await;
    assert_eq!(starved.status, 503, "{}", starved.text());
    assert_eq!(starved.outcome, Some(Outcome::StoreFailed));
    drop(held);
    let read = acquired.load(Ordering::SeqCst);
    assert_replays(&[send(&app, &req).await], &first);
    assert_eq!(
        acquired.load(Ordering::SeqCst),
        read + 1,
        "read from the table"
    );
    assert_replays(&[send(&app, &req).await], &first);
    assert_eq!(acquired.load(Ordering::SeqCst), read + 1, "and kept again");
    assert_eq!(h.effects("alice").await, 1);
    h.finish().await;
}
