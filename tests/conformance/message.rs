//! Messages through the engine's second front door (`Idempotency::process`,
//! docs/contract.md "Messages"): a message delivered again and again, at once or
//! later, through one instance or two, runs its handler once; every later
//! delivery gets the recorded result back; a handler's error, panic or a
//! mismatched payload leaves nothing behind. Counted on the `effects` table.

use std::time::Duration;

use idem_axum::{
    Aborted, Action, Delivery, Idempotency, KeyRing, Options, Processed, Refused, Sealing, Stuck,
};

use crate::app::{Req, router_on, send, serializable_run};
use crate::harness::Harness;
use crate::start;

const SOURCE: &str = "orders.charge";

fn delivery(id: &str, payload: &str) -> Delivery {
    Delivery::new(Some(id), "shop", SOURCE, payload.as_bytes())
}

/// Processes `delivery` on `store`: the handler writes one effect and returns
/// its id as text; `fail` makes it return an error after writing, `panic`
/// panic after writing, `slow` wait 600 ms before writing.
///
/// On a run whose database defaults to SERIALIZABLE, a delivery that failed to
/// serialize is delivered again, as a broker would (see
/// [`retrying_serialization`](crate::app::retrying_serialization)).
async fn charge<H: Harness>(
    store: &Idempotency<H::DB>,
    delivery: Delivery,
    options: Options,
    behave: &'static str,
) -> Processed<String, String> {
    let mut failed = false;
    for tries in 1..=50 {
        let processed = charge_once::<H>(store, delivery.clone(), options, behave).await;
        let serialization = match &processed {
            Processed::Failed(error) => error.contains("could not serialize"),
            Processed::Unavailable => true,
            _ => false,
        };
        let again = serialization || (failed && matches!(processed, Processed::InFlight { .. }));
        if !(serializable_run() && again) {
            return processed;
        }
        eprintln!("delivered again after {processed:?}");
        failed |= serialization;
        tokio::time::sleep(Duration::from_millis(5 * tries)).await;
    }
    panic!("still failing to serialize after 50 deliveries");
}

async fn charge_once<H: Harness>(
    store: &Idempotency<H::DB>,
    delivery: Delivery,
    options: Options,
    behave: &'static str,
) -> Processed<String, String> {
    store
        .process(delivery, options, move |mut tx| async move {
            if behave == "slow" {
                // Before the write: SQLite's writers would otherwise wait in turn.
                tokio::time::sleep(Duration::from_millis(600)).await;
            }
            let id = H::insert_effect(&mut tx, "shop", "charge")
                .await
                .map_err(|error| error.to_string())?;
            match behave {
                "fail" => Err("card declined".to_owned()),
                "panic" => panic!("the handler panics"),
                _ => Ok(format!("charge-{id}")),
            }
        })
        .await
}

/// One message delivered four times in turn, then with another payload, then
/// a failing, a panicking and an id-less one: each outcome as the contract says,
/// and the effects table holds exactly the runs that committed.
pub async fn deliveries_run_once_and_give_back_their_result<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let store = h.store();
    let options = Options::new();
    let first = charge::<H>(store, delivery("m-1", "{\"order\":1}"), options, "ok").await;
    let Processed::Ran(result) = first else {
        panic!("the first delivery runs: {first:?}");
    };
    for n in 0..3 {
        // Through the replay cache, and through the table.
        let instance = if n == 0 {
            store.clone()
        } else {
            h.another_instance()
        };
        let again = charge::<H>(&instance, delivery("m-1", "{\"order\":1}"), options, "ok").await;
        match again {
            Processed::Done(ref kept) => assert_eq!(kept, &result, "the recorded result"),
            other => panic!("a redelivery is done: {other:?}"),
        }
        assert_eq!(again.action(), Action::Ack);
    }
    assert_eq!(h.effects("shop").await, 1, "ran once");

    let other = charge::<H>(store, delivery("m-1", "{\"order\":2}"), options, "ok").await;
    assert!(
        matches!(other, Processed::Mismatch { part: "payload" }),
        "{other:?}"
    );
    assert_eq!(other.action(), Action::DeadLetter);
    let elsewhere = Delivery::new(Some("m-1"), "shop", "refunds", b"{\"order\":1}");
    let moved = charge::<H>(store, elsewhere, options, "ok").await;
    assert!(
        matches!(moved, Processed::Mismatch { part: "source" }),
        "{moved:?}"
    );

    // A failing handler's writes are rolled back and its message runs again.
    let failed = charge::<H>(store, delivery("m-2", "{}"), options, "fail").await;
    assert!(matches!(failed, Processed::Failed(ref e) if e == "card declined"));
    assert_eq!(failed.action(), Action::Retry(None));
    let panicked = charge::<H>(store, delivery("m-2", "{}"), options, "panic").await;
    assert!(
        matches!(panicked, Processed::Aborted(Aborted::Panicked)),
        "{panicked:?}"
    );
    assert_eq!(h.effects("shop").await, 1, "nothing of either kept");
    let retried = charge::<H>(store, delivery("m-2", "{}"), options, "ok").await;
    assert!(matches!(retried, Processed::Ran(_)), "{retried:?}");

    // No id, or one that is no key: never run, and counted as refused.
    let refusing = crate::harness::unique("orders.refused");
    crate::sealing::metrics_text(); // the recorder, installed before they count
    let none = Delivery::new(None, "shop", &*refusing, b"{}");
    let refused = charge::<H>(store, none, options, "ok").await;
    assert!(
        matches!(refused, Processed::Refused(Refused::NoId)),
        "{refused:?}"
    );
    let control = Delivery::new(Some("m\n3"), "shop", &*refusing, b"{}");
    let refused = charge::<H>(store, control, options, "ok").await;
    assert!(
        matches!(refused, Processed::Refused(Refused::InvalidId(_))),
        "{refused:?}"
    );
    assert_eq!(refused.action(), Action::DeadLetter);
    assert_eq!(h.effects("shop").await, 2, "m-1 and m-2, once each");
    let counted = format!("idem_requests_total{{outcome=\"refused\",endpoint=\"{refusing}\"}} 2");
    let text = crate::sealing::metrics_text();
    assert!(
        text.lines().any(|line| line == counted),
        "{counted} in:\n{text}"
    );
    h.finish().await;
}

/// Redeliveries at once, as a broker makes them after an ack wait or to a
/// second consumer: 12 messages, each delivered 4 times at once over two
/// instances. Each runs once; every delivery is `Ran`, `Done` or `InFlight`
/// (told to come back after a second at least, never at once); once all have
/// settled, a further delivery of each is `Done` with the first's result.
pub async fn redeliveries_at_once_run_each_message_once<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let stores = [h.store().clone(), h.another_instance()];
    let options = Options::new().lock(Duration::from_secs(10));
    let mut runs = Vec::new();
    for n in 0..12 {
        for copy in 0..4 {
            let store = stores[copy % 2].clone();
            let id = format!("m-{n}");
            runs.push(tokio::spawn(async move {
                let processed = charge::<H>(&store, delivery(&id, "{}"), options, "slow").await;
                (id, processed)
            }));
        }
    }
    let mut results = std::collections::HashMap::new();
    for run in runs {
        let (id, processed) = run.await.expect("a delivery");
        match processed {
            Processed::Ran(result) => {
                assert!(results.insert(id, result).is_none(), "ran twice");
            }
            Processed::Done(_) => {}
            Processed::InFlight { retry_after } => {
                assert!(retry_after >= Duration::from_secs(1), "{retry_after:?}");
                assert!(retry_after <= Duration::from_secs(10), "{retry_after:?}");
            }
            other => panic!("{id}: {other:?}"),
        }
    }
    assert_eq!(results.len(), 12, "every message ran");
    assert_eq!(h.effects("shop").await, 12, "once each");
    for (id, result) in &results {
        let again = charge::<H>(&stores[1], delivery(id, "{}"), options, "ok").await;
        assert!(
            matches!(again, Processed::Done(ref r) if r == result),
            "{again:?}"
        );
    }
    assert_eq!(h.effects("shop").await, 12);
    h.finish().await;
}

/// A message's id and an HTTP request's key never answer one another, in one
/// scope: an HTTP request with a message's id is 422 (another method), and a
/// message with an HTTP key is a mismatch of kind; neither runs.
pub async fn messages_and_requests_never_share_a_key<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let store = h.store();
    let app = router_on::<H>(store.clone());
    let ran = charge::<H>(
        store,
        Delivery::new(Some("k-1"), "alice", SOURCE, b"{}"),
        Options::new(),
        "ok",
    )
    .await;
    assert!(matches!(ran, Processed::Ran(_)), "{ran:?}");
    let http = send(&app, &Req::post("alice", "k-1", "{}")).await;
    assert_eq!(http.status, 422, "{}", http.text());
    let posted = send(&app, &Req::post("alice", "k-2", "{}")).await;
    assert_eq!(posted.status, 201);
    let message = charge::<H>(
        store,
        Delivery::new(Some("k-2"), "alice", SOURCE, b"{}"),
        Options::new(),
        "ok",
    )
    .await;
    assert!(
        matches!(message, Processed::Mismatch { part: "kind" }),
        "{message:?}"
    );
    assert_eq!(h.effects("alice").await, 1, "the request ran");
    assert_eq!(h.effects("shop").await, 1, "the message ran");
    h.finish().await;
}

/// A sealing store seals a message's record as it seals a response: the table
/// holds neither the result nor the payload's digest, and another instance with
/// the ring gives the result back; one without the key never runs it again.
pub async fn message_records_are_sealed<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let ring =
        || KeyRing::from_base64("3q2+7wAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=").expect("a ring");
    let sealed = |sealing| -> Idempotency<H::DB> {
        h.instance_on(h.store().pool().clone())
            .replay_cache(0)
            .sealing(sealing)
            .build()
            .expect("a store")
    };
    let store = sealed(Sealing::On(ring()));
    let ran = charge::<H>(&store, delivery("m-s", "{}"), Options::new(), "ok").await;
    let Processed::Ran(result) = ran else {
        panic!("runs: {ran:?}")
    };
    let rows = h.key_rows("shop").await;
    let (_, row) = rows.iter().find(|(k, _)| k == "m-s").expect("its row");
    assert_eq!(row.status, Some(0), "sealed");
    let body = row.body.as_deref().expect("the sealed record");
    assert!(!body.windows(result.len()).any(|w| w == result.as_bytes()));
    let again = charge::<H>(
        &sealed(Sealing::On(ring())),
        delivery("m-s", "{}"),
        Options::new(),
        "ok",
    )
    .await;
    assert!(
        matches!(again, Processed::Done(ref r) if *r == result),
        "{again:?}"
    );
    let other =
        KeyRing::from_base64("AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyA=").expect("a ring");
    let blind = charge::<H>(
        &sealed(Sealing::On(other)),
        delivery("m-s", "{}"),
        Options::new(),
        "ok",
    )
    .await;
    assert!(
        matches!(blind, Processed::Stuck(Stuck::Unreadable)),
        "{blind:?}"
    );
    assert_eq!(blind.action(), Action::DeadLetter);
    assert_eq!(h.effects("shop").await, 1);
    h.finish().await;
}

/// An order as a broker delivers it: its id, and its bytes as received.
#[derive(Clone)]
struct Order {
    id: Option<String>,
    shop: String,
    bytes: Vec<u8>,
}

impl Order {
    fn new(id: &str, bytes: &str) -> Self {
        Self {
            id: Some(id.to_owned()),
            shop: "shop".to_owned(),
            bytes: bytes.as_bytes().to_vec(),
        }
    }
}

/// The attribute on a message handler: the id, the scope and the payload are
/// expressions over its arguments; `decline` fails it after its write.
#[idem_axum::idempotent(
    message,
    key = order.id.as_deref(),
    scope = order.shop,
    payload = &order.bytes,
    fingerprint = "json",
    lock = "10s",
    db = H::DB
)]
async fn settle<H: Harness>(
    order: Order,
    decline: bool,
    mut tx: idem_axum::Tx<H::DB>,
) -> Result<String, String> {
    tokio::time::sleep(Duration::from_millis(50)).await;
    let id = H::insert_effect(&mut tx, &order.shop, "settle")
        .await
        .map_err(|error| error.to_string())?;
    if decline {
        return Err("card declined".to_owned());
    }
    Ok(format!("charge-{id}"))
}

/// `settle` until it comes to more than `InFlight` (or, on a SERIALIZABLE
/// run, a lost serialization race), as a broker delivers again.
async fn settle_until<H: Harness>(
    store: &Idempotency<H::DB>,
    order: Order,
    decline: bool,
) -> Processed<String, String> {
    for tries in 1..=200 {
        let processed = settle::<H>(store, order.clone(), decline).await;
        let again = match &processed {
            Processed::InFlight { retry_after } => {
                assert!(*retry_after >= Duration::from_secs(1), "{retry_after:?}");
                true
            }
            Processed::Failed(error) => serializable_run() && error.contains("could not serialize"),
            Processed::Unavailable => serializable_run(),
            _ => false,
        };
        if !again {
            return processed;
        }
        tokio::time::sleep(Duration::from_millis(5 * tries.min(20))).await;
    }
    panic!("still not settled after 200 deliveries");
}

/// `#[idempotent(message, …)]` keeps the contract of `process`: 16 orders
/// delivered 4 times at once over two instances run once each, and every
/// delivery gets the first's result; the same order with its JSON keys in
/// another order is the same message, with another amount a mismatch; a
/// declined order leaves nothing and runs again; an order without an id never
/// runs. Counted on the `effects` table.
pub async fn message_attribute_runs_each_message_once<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let stores = [h.store().clone(), h.another_instance()];
    let mut runs = Vec::new();
    for n in 0..16 {
        for copy in 0..4 {
            let store = stores[copy % 2].clone();
            let order = Order::new(
                &format!("o-{n}"),
                &format!(r#"{{"order":{n},"amount":100}}"#),
            );
            runs.push(tokio::spawn(async move {
                let processed = settle_until::<H>(&store, order.clone(), false).await;
                (order.id, processed)
            }));
        }
    }
    let mut results = std::collections::HashMap::new();
    for run in runs {
        let (id, processed) = run.await.expect("a delivery");
        let (Processed::Ran(result) | Processed::Done(result)) = processed else {
            panic!("{id:?}: {processed:?}");
        };
        let first = results.entry(id).or_insert_with(|| result.clone());
        assert_eq!(first, &result, "every delivery gets the first's result");
    }
    assert_eq!(results.len(), 16, "every order settled");
    assert_eq!(h.effects("shop").await, 16, "once each");

    let respelled = Order::new("o-3", r#"{ "amount": 100, "order": 3 }"#);
    let again = settle_until::<H>(&stores[1], respelled, false).await;
    assert!(
        matches!(again, Processed::Done(ref r) if Some(r) == results.get(&Some("o-3".to_owned()))),
        "{again:?}"
    );
    let changed = Order::new("o-3", r#"{"order":3,"amount":999}"#);
    let changed = settle_until::<H>(&stores[0], changed, false).await;
    assert!(
        matches!(changed, Processed::Mismatch { part: "payload" }),
        "{changed:?}"
    );
    assert_eq!(changed.action(), Action::DeadLetter);

    let declined = settle_until::<H>(&stores[0], Order::new("o-99", "{}"), true).await;
    assert!(matches!(declined, Processed::Failed(ref e) if e == "card declined"));
    assert_eq!(
        h.effects("shop").await,
        16,
        "the declined write rolled back"
    );
    let retried = settle_until::<H>(&stores[1], Order::new("o-99", "{}"), false).await;
    assert!(matches!(retried, Processed::Ran(_)), "{retried:?}");

    let mut anonymous = Order::new("unused", "{}");
    anonymous.id = None;
    let refused = settle_until::<H>(&stores[0], anonymous, false).await;
    assert!(
        matches!(refused, Processed::Refused(Refused::NoId)),
        "{refused:?}"
    );
    assert_eq!(h.effects("shop").await, 17, "16 orders and o-99, once each");
    h.finish().await;
}
