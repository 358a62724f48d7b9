//! Webhooks (docs/contract.md, "Webhooks"): the key where the sender puts it (a
//! header of its own, a member of the body), and the sender's signature checked
//! before anything is claimed, so that a forged delivery that carries a real
//! event's id takes nothing from the real one. Counted on the `effects` table.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::{FromRef, Json, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use base64::Engine as _;
use hmac::{Hmac, KeyInit as _, Mac as _};
use idem_axum::webhook::{StandardWebhooks, StripeSignature, Verifier as _};
use idem_axum::{Idempotency, Tx, idempotent};
use serde::Deserialize;
use sha2::Sha256;

use crate::app::{Got, Req, send};
use crate::harness::{Harness, unique};
use crate::start;

/// The Standard Webhooks sender's secret (24 random bytes, base64).
const STANDARD_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const STRIPE_SECRET: &str = "whsec_test_secret";

struct Hooks<H: Harness> {
    store: Idempotency<H::DB>,
    standard: StandardWebhooks,
    stripe: StripeSignature,
}

impl<H: Harness> Clone for Hooks<H> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            standard: self.standard.clone(),
            stripe: self.stripe.clone(),
        }
    }
}

impl<H: Harness> FromRef<Hooks<H>> for Idempotency<H::DB> {
    fn from_ref(hooks: &Hooks<H>) -> Self {
        hooks.store.clone()
    }
}

impl<H: Harness> FromRef<Hooks<H>> for StandardWebhooks {
    fn from_ref(hooks: &Hooks<H>) -> Self {
        hooks.standard.clone()
    }
}

impl<H: Harness> FromRef<Hooks<H>> for StripeSignature {
    fn from_ref(hooks: &Hooks<H>) -> Self {
        hooks.stripe.clone()
    }
}

/// An event as both senders send it: its id, and the shop the test counts
/// effects under.
#[derive(Deserialize)]
struct Event {
    shop: String,
    #[serde(rename = "type")]
    kind: String,
}

/// One refund booked per event: an effect, and the event's type as the answer.
async fn book<H: Harness>(tx: &mut Tx<H::DB>, event: &Event) -> (StatusCode, String) {
    match H::insert_effect(tx, &event.shop, &event.kind).await {
        Ok(id) => (StatusCode::OK, format!("refund {id}")),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()),
    }
}

/// POST /hooks/standard: Standard Webhooks, keyed by `webhook-id`.
#[idempotent(unscoped = true, key = header("webhook-id"), verify = StandardWebhooks,
             required = true, db = H::DB, ttl = "3d", lock = "10s")]
async fn standard<H: Harness>(mut tx: Tx<H::DB>, Json(event): Json<Event>) -> (StatusCode, String) {
    book::<H>(&mut tx, &event).await
}

/// POST /hooks/stripe: Stripe's signature, keyed by the event's `/id`.
#[idempotent(unscoped = true, key = json("/id"), verify = StripeSignature,
             required = true, db = H::DB, ttl = "3d", lock = "10s")]
async fn stripe<H: Harness>(mut tx: Tx<H::DB>, Json(event): Json<Event>) -> (StatusCode, String) {
    book::<H>(&mut tx, &event).await
}

/// POST /hooks/inside: the control, as users without `verify` write it: the
/// signature checked in the handler, after the key is claimed.
#[idempotent(unscoped = true, key = json("/id"), required = true, db = H::DB,
             ttl = "3d", lock = "10s")]
async fn inside<H: Harness>(
    State(stripe): State<StripeSignature>,
    headers: HeaderMap,
    mut tx: Tx<H::DB>,
    body: bytes::Bytes,
) -> (StatusCode, String) {
    if stripe.verify(&headers, &body).is_err() {
        return (StatusCode::UNAUTHORIZED, "forged".to_owned());
    }
    match serde_json::from_slice::<Event>(&body) {
        Ok(event) => book::<H>(&mut tx, &event).await,
        Err(error) => (StatusCode::BAD_REQUEST, error.to_string()),
    }
}

fn router<H: Harness>(store: Idempotency<H::DB>) -> Router {
    Router::new()
        .route("/hooks/standard", post(standard::<H>))
        .route("/hooks/stripe", post(stripe::<H>))
        .route("/hooks/inside", post(inside::<H>))
        .with_state(Hooks::<H> {
            store,
            standard: StandardWebhooks::new(STANDARD_SECRET).expect("secret"),
            stripe: StripeSignature::new(STRIPE_SECRET).expect("secret"),
        })
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs())
}

fn hmac(key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("any key length");
    for part in parts {
        mac.update(part);
    }
    mac.finalize().into_bytes().to_vec()
}

/// A Standard Webhooks delivery of `body` with the id `id`, signed with `secret`
/// (the scheme's `whsec_` form).
fn standard_delivery(id: &str, body: &str, secret: &str) -> Req {
    let key = base64::engine::general_purpose::STANDARD
        .decode(secret.trim_start_matches("whsec_"))
        .expect("base64 secret");
    let ts = now().to_string();
    let signed = hmac(
        &key,
        &[id.as_bytes(), b".", ts.as_bytes(), b".", body.as_bytes()],
    );
    let signature = base64::engine::general_purpose::STANDARD.encode(signed);
    Req::post("", "", body)
        .keys(&[])
        .path("/hooks/standard")
        .header("content-type", "application/json")
        .header("webhook-id", id)
        .header("webhook-timestamp", &ts)
        .header("webhook-signature", format!("v1,{signature}"))
}

/// A Stripe delivery of `body` to `path`, signed with `secret`.
fn stripe_delivery(path: &str, body: &str, secret: &str) -> Req {
    let ts = now().to_string();
    let signed = hmac(secret.as_bytes(), &[ts.as_bytes(), b".", body.as_bytes()]);
    let hex: String = signed.iter().map(|b| format!("{b:02x}")).collect();
    Req::post("", "", body)
        .keys(&[])
        .path(path)
        .header("content-type", "application/json")
        .header("stripe-signature", format!("t={ts},v1={hex}"))
}

/// The id an event's body carries.
fn id_of(body: &str) -> String {
    let start = body.find(r#""id":""#).map_or(0, |at| at + 6);
    body[start..]
        .split('"')
        .next()
        .unwrap_or_default()
        .to_owned()
}

fn event(id: &str, shop: &str, kind: &str) -> String {
    format!(r#"{{"id":"{id}","shop":"{shop}","type":"{kind}"}}"#)
}

fn assert_problem(got: &Got, status: u16, slug: &str) {
    assert_eq!(got.status, status, "{}", got.text());
    assert_eq!(got.problem().as_deref(), Some(slug), "{}", got.text());
}

/// Each key source replays and refuses as `Idempotency-Key` does: a retry is the
/// first answer replayed, another body under the id is 422, a malformed or
/// missing key 400; and a request whose signature does not verify is 401 before
/// any of these.
pub async fn webhook_keys_replay_and_refuse_as_the_header_does<H: Harness>() {
    let Some(harness) = start::<H>().await else {
        return;
    };
    let app = router::<H>(harness.store().clone());
    let shop = unique("hooks");
    let id = unique("msg");

    // A header of the sender's own.
    let body = event("ignored", &shop, "charge.refunded");
    let first = send(&app, &standard_delivery(&id, &body, STANDARD_SECRET)).await;
    assert_eq!(first.status, 200, "{}", first.text());
    assert!(!first.replayed());
    let again = send(&app, &standard_delivery(&id, &body, STANDARD_SECRET)).await;
    assert_eq!((again.status, &again.body), (200, &first.body));
    assert!(again.replayed(), "a retry is the first answer, replayed");
    let other = event("ignored", &shop, "charge.disputed");
    let mismatch = send(&app, &standard_delivery(&id, &other, STANDARD_SECRET)).await;
    assert_problem(&mismatch, 422, "payload-mismatch");
    let long = "m".repeat(256);
    let too_long = send(&app, &standard_delivery(&long, &body, STANDARD_SECRET)).await;
    assert_problem(&too_long, 400, "invalid-key");
    assert!(
        too_long.text().contains("webhook-id"),
        "{}",
        too_long.text()
    );
    assert_eq!(harness.effects(&shop).await, 1);

    // A member of the body.
    let stripe_id = unique("evt");
    let body = event(&stripe_id, &shop, "charge.refunded");
    let first = send(
        &app,
        &stripe_delivery("/hooks/stripe", &body, STRIPE_SECRET),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.text());
    let again = send(
        &app,
        &stripe_delivery("/hooks/stripe", &body, STRIPE_SECRET),
    )
    .await;
    assert_eq!((again.status, &again.body), (200, &first.body));
    assert!(again.replayed());
    let other = event(&stripe_id, &shop, "charge.disputed");
    let mismatch = send(
        &app,
        &stripe_delivery("/hooks/stripe", &other, STRIPE_SECRET),
    )
    .await;
    assert_problem(&mismatch, 422, "payload-mismatch");
    for (refused, status, slug) in [
        (
            format!(r#"{{"shop":"{shop}","type":"x"}}"#),
            400,
            "missing-key",
        ),
        (
            format!(r#"{{"id":{{"n":1}},"shop":"{shop}","type":"x"}}"#),
            400,
            "invalid-key",
        ),
        (
            format!(r#"{{"id":"","shop":"{shop}","type":"x"}}"#),
            400,
            "invalid-key",
        ),
        ("id=evt_1".to_owned(), 400, "invalid-json"),
    ] {
        let got = send(
            &app,
            &stripe_delivery("/hooks/stripe", &refused, STRIPE_SECRET),
        )
        .await;
        assert_problem(&got, status, slug);
    }
    assert_eq!(harness.effects(&shop).await, 2);

    // Unverified, before the key is looked at: a wrong secret, a changed body, a
    // stale timestamp, no signature.
    let wrong = send(
        &app,
        &standard_delivery(&id, &body, "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"),
    )
    .await;
    assert_problem(&wrong, 401, "unverified");
    let mut changed = stripe_delivery("/hooks/stripe", &body, STRIPE_SECRET);
    changed.body = event(&stripe_id, &shop, "charge.refunded ");
    assert_problem(&send(&app, &changed).await, 401, "unverified");
    let stale = standard_delivery(&id, &body, STANDARD_SECRET);
    let stale = Req {
        extra: stale
            .extra
            .into_iter()
            .map(|(name, value)| match name.as_str() {
                "webhook-timestamp" => (name, (now() - 600).to_string()),
                _ => (name, value),
            })
            .collect(),
        ..stale
    };
    let got = send(&app, &stale).await;
    assert_problem(&got, 401, "unverified");
    assert!(got.text().contains("old"), "{}", got.text());
    let unsigned = Req::post("", "", &body).keys(&[]).path("/hooks/stripe");
    assert_problem(&send(&app, &unsigned).await, 401, "unverified");
    // Not even a replay is given to a request that does not verify.
    let mut replay = standard_delivery(
        &id,
        &event("ignored", &shop, "charge.refunded"),
        STANDARD_SECRET,
    );
    replay.extra.retain(|(name, _)| name != "webhook-signature");
    replay = replay.header("webhook-signature", "v1,AAAA");
    assert_problem(&send(&app, &replay).await, 401, "unverified");
    assert_eq!(harness.effects(&shop).await, 2);
}

/// The trap verification first closes: a forgery carrying a real event's id,
/// sent before the real event, claims nothing, and the real one, retried as
/// senders retry, runs once. The control checks the signature inside the
/// handler, after the key is claimed: there the forgery's answer is recorded
/// under the real id, and the real event gets 422 and is never booked.
pub async fn a_forged_delivery_claims_nothing_and_the_real_one_runs_once<H: Harness>() {
    let Some(harness) = start::<H>().await else {
        return;
    };
    let app = router::<H>(harness.store().clone());
    let shop = unique("forged");
    for path in ["/hooks/stripe", "/hooks/inside"] {
        let id = unique("evt");
        let real = event(&id, &shop, "charge.refunded");
        let forged_body = event(&id, &shop, "charge.refunded.forged");
        let forged = stripe_delivery(path, &forged_body, "whsec_guessed");
        let got = send(&app, &forged).await;
        assert_eq!(got.status, 401, "{path}: {}", got.text());
        let answers: Vec<u16> = {
            let mut answers = Vec::new();
            for _ in 0..3 {
                let got = send(&app, &stripe_delivery(path, &real, STRIPE_SECRET)).await;
                answers.push(got.status);
            }
            answers
        };
        if path == "/hooks/stripe" {
            assert_eq!(
                answers,
                [200, 200, 200],
                "verified first: the real event runs"
            );
        } else {
            assert_eq!(
                answers,
                [422, 422, 422],
                "the control: the forgery took the key"
            );
        }
    }
    assert_eq!(
        harness.effects(&shop).await,
        1,
        "one refund: the verified endpoint's"
    );
}

/// 50 events, each delivered 4 times at once, as senders retry: one effect
/// each. A delivery answered 409 (its twin in flight) or 5xx is sent again, as
/// a sender does until it gets a 2xx.
pub async fn webhook_duplicates_at_once_run_each_event_once<H: Harness>() {
    let Some(harness) = start::<H>().await else {
        return;
    };
    let app = router::<H>(harness.store().clone());
    let shop = unique("storm");
    let mut deliveries = Vec::new();
    for n in 0..50 {
        let id = unique(&format!("evt{n}-"));
        for _ in 0..4 {
            let app = app.clone();
            let body = event(&id, &shop, "charge.refunded");
            deliveries.push(tokio::spawn(async move {
                for _ in 0..200 {
                    // Half the events keyed by a header, half by the body.
                    let req = if n % 2 == 0 {
                        standard_delivery(&id_of(&body), &body, STANDARD_SECRET)
                    } else {
                        stripe_delivery("/hooks/stripe", &body, STRIPE_SECRET)
                    };
                    let got = send(&app, &req).await;
                    match got.status {
                        200 => return got.body,
                        409 | 500..=599 => {
                            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                        }
                        other => panic!("{other}: {}", got.text()),
                    }
                }
                panic!("no 2xx after 200 deliveries");
            }));
        }
    }
    let mut bodies = Vec::new();
    for delivery in deliveries {
        bodies.push(delivery.await.expect("delivery"));
    }
    for event in bodies.chunks(4) {
        assert!(
            event.iter().all(|body| body == &event[0]),
            "every copy gets the first answer"
        );
    }
    assert_eq!(harness.effects(&shop).await, 50);
}
