//! SQLite's one write lock, taken at a handler's first write
//! (`Builder::write_lock_at_first_write`, the `LiteDeferred` harness): what a
//! handler waits for before it writes overlaps other keys' handlers, and the
//! documented hazard of reading before writing costs an error, never an invariant;
//! and another writer holding the lock past the busy timeout never leaves a key
//! claimed once its execution has ended.

use std::time::{Duration, Instant};

use idem_axum::Outcome;
use sqlx::Connection as _;
use sqlx::sqlite::{SqliteConnection, SqlitePoolOptions};

use crate::app::{Got, Req, open_gate, router, router_on, send};
use crate::harness::{Harness, LiteDeferred};
use crate::{BODY, await_started, start, unique_suffix};

/// Two keys whose handlers wait before writing are both waiting at once; with the
/// lock taken at `BEGIN` the second could not start until the first committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiting_before_the_first_write_overlaps() {
    let Some(h) = start::<LiteDeferred>().await else {
        return;
    };
    let app = router(&h);
    let suffix = unique_suffix();
    let (one, two) = (format!("k-wait-1-{suffix}"), format!("k-wait-2-{suffix}"));
    let mut running = Vec::new();
    for key in [&one, &two] {
        let req = Req::post("alice", key, BODY)
            .header("x-wait-before-write", 1)
            .header("x-gate", key)
            .header("x-lock-ms", 20_000);
        let app = app.clone();
        running.push(tokio::spawn(async move { send(&app, &req).await }));
    }
    // Both reach their gate, neither having written: a liveness check, bounded
    // far above what it takes.
    tokio::time::timeout(Duration::from_secs(20), async {
        await_started(&one).await;
        await_started(&two).await;
    })
    .await
    .expect("both handlers waiting side by side");
    open_gate(&one);
    open_gate(&two);
    for got in running {
        let got = got.await.expect("request");
        assert_eq!(got.outcome, Some(Outcome::Executed), "{}", got.text());
    }
    assert_eq!(h.effects("alice").await, 2);
    h.finish().await;
}

/// Sends `req` (a handler that reads first and waits on its gate), commits another
/// key's write while it waits, then lets it go on; its answer.
async fn interleaved(app: &axum::Router, key: &str, req: &Req) -> Got {
    let first = {
        let (app, req) = (app.clone(), req.clone().header("x-gate", key));
        tokio::spawn(async move { send(&app, &req).await })
    };
    await_started(key).await;
    let other = send(app, &Req::post("bob", &format!("{key}-other"), BODY)).await;
    assert_eq!(other.status, 201, "{}", other.text());
    open_gate(key);
    first.await.expect("first")
}

/// A handler that read, then writes after another key's commit: SQLite refuses
/// the stale write; the handler's 500 rolls back and frees the key, and the retry
/// runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reading_before_writing_fails_cleanly() {
    let Some(h) = start::<LiteDeferred>().await else {
        return;
    };
    let app = router(&h);
    let key = format!("k-read-first-{}", unique_suffix());
    let req = Req::post("alice", &key, BODY)
        .header("x-read-first", 1)
        .header("x-wait-before-write", 1)
        .header("x-lock-ms", 20_000);
    let first = interleaved(&app, &key, &req).await;
    assert_eq!(first.status, 500, "{}", first.text());
    assert_eq!(first.outcome, Some(Outcome::Released));
    assert_eq!(h.effects("alice").await, 0, "rolled back");
    let retried = send(&app, &req).await;
    assert_eq!(
        retried.outcome,
        Some(Outcome::Executed),
        "{}",
        retried.text()
    );
    assert_eq!(h.effects("alice").await, 1);
    h.finish().await;
}

/// A handler that read and wrote nothing still has its answer recorded when
/// another key committed meanwhile: its transaction, holding no write, is begun
/// again as a writer for the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_that_writes_nothing_is_recorded() {
    let Some(h) = start::<LiteDeferred>().await else {
        return;
    };
    let app = router(&h);
    let key = format!("k-no-write-{}", unique_suffix());
    let req = Req::post("alice", &key, BODY)
        .header("x-read-first", 1)
        .header("x-wait-before-write", 1)
        .header("x-no-write", 1)
        .header("x-lock-ms", 20_000);
    let first = interleaved(&app, &key, &req).await;
    assert_eq!(first.outcome, Some(Outcome::Executed), "{}", first.text());
    assert_eq!(first.status, 201);
    let rows = h.key_rows("alice").await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].1.state, "completed");
    assert_eq!(rows[0].1.body.as_deref(), Some(&b"wrote nothing"[..]));
    h.finish().await;
}

/// SQLite's write lock held by another writer (another process, a migration, a
/// long batch) for 3 s, past the store's 1 s busy timeout, while a handler that
/// wrote nothing ends: answering 500 (its claim's release must write), or 201
/// (its record must write, fails, and the release too). Either way the answer goes
/// out, and the key is free as soon as the writer lets go, not when its 20 s lock
/// passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_busy_database_never_keeps_an_ended_key_claimed() {
    let Some(h) = start::<LiteDeferred>().await else {
        return;
    };
    let options = (*h.store().pool().connect_options()).clone();
    let impatient = SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options.clone().busy_timeout(Duration::from_secs(1)))
        .await
        .expect("a pool with a 1 s busy timeout");
    let app = router_on::<LiteDeferred>(h.instance_on(impatient.clone()).build().expect("store"));
    for (status, answered) in [(500, 500), (201, 503)] {
        let key = format!("k-busy-{status}-{}", unique_suffix());
        let req = Req::post("alice", &key, BODY)
            .header("x-wait-before-write", 1)
            .header("x-no-write", 1)
            .header("x-lock-ms", 20_000);
        let first = {
            let req = req
                .clone()
                .header("x-gate", &key)
                .header("x-status", status);
            let app = app.clone();
            tokio::spawn(async move { send(&app, &req).await })
        };
        await_started(&key).await;
        // The claim is committed; now another writer takes the lock.
        let mut writer = SqliteConnection::connect_with(&options)
            .await
            .expect("another writer");
        sqlx::raw_sql(
            "BEGIN IMMEDIATE; INSERT INTO effects (scope, note) VALUES ('writer', 'held')",
        )
        .execute(&mut writer)
        .await
        .expect("the write lock");
        open_gate(&key);
        let first = first.await.expect("first");
        assert_eq!(first.status, answered, "{status}: {}", first.text());
        tokio::time::sleep(Duration::from_secs(3)).await;
        sqlx::raw_sql("COMMIT")
            .execute(&mut writer)
            .await
            .expect("commit");
        let freed = Instant::now();
        // Free as soon as the writer is: the retry runs, far before the lock ends.
        let retry = loop {
            let retry = send(&app, &req).await;
            if retry.outcome != Some(Outcome::InFlight) || freed.elapsed() > Duration::from_secs(8)
            {
                break retry;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(
            retry.outcome,
            Some(Outcome::Executed),
            "{status}: the key stayed claimed {:?} after the writer let go: {}",
            freed.elapsed(),
            retry.text()
        );
        writer.close().await.expect("close");
    }
    impatient.close().await;
    h.finish().await;
}
