//! The operator's calls (`idem forget`, `show`, `list`, `sweep`) against keys in
//! flight, on every backend: none waits for an executor, none deletes what an
//! executor is about to commit, and each says the key is in flight.

use std::time::Duration;

use idem_axum::{Forgotten, Outcome, Sweep};

use crate::app::{Req, open_gate, router, send};
use crate::harness::Harness;
use crate::{BODY, await_started, start, unique_suffix};

/// What the operator's calls answered while an executor was held at its gate.
struct Looked {
    forgotten: Forgotten,
    in_flight: bool,
    listed: bool,
    swept: u64,
}

/// Runs every operator's call on `key` of `scope` while its executor is held,
/// within a bound far shorter than the executor's lock: a call that waited for
/// the executor would wait for the gate, which opens only after this returns.
async fn look_while_held<H: Harness>(h: &H, scope: &str, key: &str) -> Looked {
    let store = h.store();
    let looked = tokio::time::timeout(Duration::from_secs(10), async {
        let forgotten = store.forget(scope, key).await.expect("forget");
        let in_flight = store.in_flight(scope, key).await.expect("in_flight");
        let claims = store.claims(Some(scope), false, 50).await.expect("claims");
        let swept = if H::SWEEPS_BESIDE_HANDLERS {
            store.sweep(Sweep::new()).await.expect("sweep").deleted
        } else {
            0
        };
        Looked {
            forgotten,
            in_flight: in_flight.is_some(),
            listed: claims
                .iter()
                .any(|c| c.key == key && c.state == "processing"),
            swept,
        }
    })
    .await;
    open_gate(key);
    looked.expect("an operator's call waited for the executor")
}

fn assert_seen_in_flight<H: Harness>(looked: &Looked, what: &str) {
    assert_eq!(looked.forgotten, Forgotten::InFlight, "{what}: forget");
    assert!(looked.in_flight, "{what}: in_flight");
    assert_eq!(
        looked.listed,
        H::CLAIMS_READABLE_IN_FLIGHT,
        "{what}: listed among the claims"
    );
    assert_eq!(looked.swept, 0, "{what}: the sweep deleted a key in flight");
}

/// I1 for operators: `forget` during an execution (a new key, and an expired one
/// being run again) answers `InFlight` at once and deletes nothing, so the record
/// the executor commits is replayed to the client's retry: one business row. Once
/// completed, `forget` deletes it and the retry runs again.
pub async fn operators_never_delete_or_wait_for_a_key_in_flight<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    let store = h.store().clone();

    // A new key.
    let key = format!("k-op-new-{}", unique_suffix());
    let new_req = Req::post("alice", &key, BODY).header("x-lock-ms", 20_000);
    let first = {
        let (app, req) = (app.clone(), new_req.clone().header("x-gate", &key));
        tokio::spawn(async move { send(&app, &req).await })
    };
    await_started(&key).await;
    let looked = look_while_held(&h, "alice", &key).await;
    let first = first.await.expect("first request");
    assert_seen_in_flight::<H>(&looked, "a new key");
    assert_eq!(first.outcome, Some(Outcome::Executed), "{}", first.text());
    let retry = send(&app, &new_req).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed), "{}", retry.text());
    assert_eq!(retry.body, first.body);
    assert_eq!(h.effects("alice").await, 1, "one business row");
    assert!(
        store
            .in_flight("alice", &key)
            .await
            .expect("in_flight")
            .is_none(),
        "completed, not in flight"
    );

    // An expired record, run again under its key: its row is the executor's now.
    // (Gates and started handlers are the process's: keys are unique to the test.)
    let prefix = format!("k-op-old-{}-", unique_suffix());
    h.insert_expired("bob", &prefix, 1, true).await;
    let old = format!("{prefix}1");
    let req = Req::post("bob", &old, BODY).header("x-lock-ms", 20_000);
    let again = {
        let (app, req) = (app.clone(), req.clone().header("x-gate", &old));
        tokio::spawn(async move { send(&app, &req).await })
    };
    await_started(&old).await;
    let looked = look_while_held(&h, "bob", &old).await;
    let again = again.await.expect("request on an expired key");
    assert_seen_in_flight::<H>(&looked, "an expired key run again");
    assert!(
        matches!(again.outcome, Some(Outcome::Executed | Outcome::TakenOver)),
        "{}",
        again.text()
    );
    let retry = send(&app, &req).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed), "{}", retry.text());
    assert_eq!(retry.body, again.body);
    assert_eq!(h.effects("bob").await, 1, "one business row");

    // Completed: deleted, and the retry runs again; then there is nothing left.
    assert_eq!(
        store.forget("alice", &key).await.expect("forget"),
        Forgotten::Deleted
    );
    let rerun = send(&app, &new_req).await;
    assert_eq!(rerun.outcome, Some(Outcome::Executed), "{}", rerun.text());
    assert_eq!(h.effects("alice").await, 2);
    let unknown = format!("k-op-unknown-{}", unique_suffix());
    assert_eq!(
        store.forget("alice", &unknown).await.expect("forget"),
        Forgotten::NotFound
    );
    assert!(
        store
            .in_flight("alice", &unknown)
            .await
            .expect("in_flight")
            .is_none()
    );
    h.finish().await;
}
