//! The fence a handler starts behind, where the claim commits before the handler's
//! transaction begins (SQLite, MySQL's cluster mode): a claim whose commit
//! stalled past its lock (a slow node, flow control, a paused process, a `BEGIN`
//! kept waiting for a writer) never starts its handler, whether another
//! instance took the key over meanwhile or nobody did.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::http::{Method, Response, StatusCode, Uri};
use bytes::Bytes;
use http_body_util::Full;
use idem_axum::{Idempotency, IdempotencyKey, Options, Outcome, RequestIdentity, Tx};

use crate::harness::Harness;

/// The lock of the stalled claims: short, so that the tests wait little past it.
const LOCK: Duration = Duration::from_millis(1000);

/// One answer, with its outcome.
struct Sent {
    status: StatusCode,
    outcome: Outcome,
    body: Bytes,
}

/// Sends `key` through `store`; the handler counts its start in `runs` (what it
/// would do outside the database: the card provider's call), then writes its
/// effect through its `Tx`.
async fn send<H: Harness>(store: &Idempotency<H::DB>, key: &str, runs: &Arc<AtomicUsize>) -> Sent {
    let uri = Uri::from_static("/effects");
    let key = IdempotencyKey::parse(key.as_bytes()).ok();
    let request = RequestIdentity::new(key, "alice", &Method::POST, &uri, b"{}");
    let runs = Arc::clone(runs);
    let response = store
        .execute(
            request,
            Options::new().lock(LOCK),
            move |mut tx: Tx<H::DB>| {
                Box::pin(async move {
                    let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    let written = H::insert_effect(&mut tx, "alice", "effect").await;
                    let mut response = Response::new(Full::new(Bytes::from(format!("run {run}"))));
                    *response.status_mut() = match written {
                        Ok(_) => StatusCode::CREATED,
                        Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
                    };
                    response
                })
            },
        )
        .await;
    let outcome = *response.extensions().get::<Outcome>().expect("an outcome");
    Sent {
        status: response.status(),
        outcome,
        body: response.into_body(),
    }
}

/// Sends `key` through `store` in a task of its own, once its claim is held
/// (`held` says so).
async fn held_send<H: Harness>(
    store: &Idempotency<H::DB>,
    key: &str,
    runs: &Arc<AtomicUsize>,
    held: tokio::sync::oneshot::Receiver<()>,
) -> tokio::task::JoinHandle<Sent> {
    let (store, key, runs) = (store.clone(), key.to_owned(), Arc::clone(runs));
    let sent = tokio::spawn(async move { send::<H>(&store, &key, &runs).await });
    tokio::time::timeout(Duration::from_secs(30), held)
        .await
        .expect("the claim is held")
        .expect("the hold's sender");
    sent
}

/// A claim held after its commit until another instance (on a cluster, through
/// another node) has taken the key over and run it: released, it never runs its
/// handler and answers the new owner's response. Held past its lock with nobody
/// taking over, it does not run either: the key is free again, and a retry runs.
pub async fn stalled_claims_never_start_beside_a_takeover<H: Harness>() {
    let Some(h) = crate::start::<H>().await else {
        return;
    };
    let runs = Arc::new(AtomicUsize::new(0));
    let first = h.store().clone();
    let other = h.another_instance();
    // MySQL learns its mode at a store's first request.
    let warm = send::<H>(&first, &format!("k-warm-{}", crate::unique_suffix()), &runs).await;
    assert_eq!(warm.status, 201);
    let base = runs.load(Ordering::SeqCst);
    let Some((held, release)) = first.hold_after_claim() else {
        assert!(
            !h.claims_commit_first(),
            "a backend whose claim commits first can hold it"
        );
        h.finish().await;
        return;
    };
    assert!(h.claims_commit_first(), "only committed claims have a gap");

    // 1. Taken over while the claim was held.
    let key = format!("k-stalled-{}", crate::unique_suffix());
    let stalled = held_send::<H>(&first, &key, &runs, held).await;
    let until = Instant::now() + Duration::from_secs(30);
    let took = loop {
        let sent = send::<H>(&other, &key, &runs).await;
        if sent.status == 201 {
            break sent;
        }
        assert_eq!(sent.status, 409, "{:?}", sent.body);
        assert!(Instant::now() < until, "the key was never taken over");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(took.outcome, Outcome::TakenOver);
    assert_eq!(runs.load(Ordering::SeqCst), base + 1);
    let _ = release.send(());
    let stalled = stalled.await.expect("the stalled request");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        base + 1,
        "the stalled claim's handler never started"
    );
    assert_eq!(stalled.status, 201, "{:?}", stalled.body);
    assert_eq!(stalled.outcome, Outcome::Replayed);
    assert_eq!(stalled.body, took.body, "the new owner's answer");
    assert_eq!(h.effects("alice").await, 2, "the warm-up's and the taker's");

    // 2. Held past its lock, taken over by nobody.
    let (held, release) = first.hold_after_claim().expect("armed again");
    let key = format!("k-lapsed-{}", crate::unique_suffix());
    let lapsed = held_send::<H>(&first, &key, &runs, held).await;
    tokio::time::sleep(LOCK + Duration::from_millis(300)).await;
    let _ = release.send(());
    let lapsed = lapsed.await.expect("the lapsed request");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        base + 1,
        "a claim past its lock never starts its handler"
    );
    assert_eq!(lapsed.status, 409, "{:?}", lapsed.body);
    assert_eq!(lapsed.outcome, Outcome::InFlight);
    assert!(
        h.key_rows("alice")
            .await
            .iter()
            .all(|(stored, _)| *stored != key),
        "its claim was released"
    );
    let retry = send::<H>(&first, &key, &runs).await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert_eq!(retry.outcome, Outcome::Executed);
    assert_eq!(runs.load(Ordering::SeqCst), base + 2);
    assert_eq!(h.effects("alice").await, 3);
    h.finish().await;
}
