//! `fingerprint = "json"`: a retry whose JSON a client rebuilt (member order,
//! whitespace, number spelling, a fresh `sent_at`) is a retry, a changed value is
//! still 422, and a keyed body that is not JSON is refused before anything is
//! claimed. Also the keys Firefox sends by itself (`Idempotency-Key: "<u64>"`).

use axum::Router;
use axum::extract::FromRequestParts;
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idem_axum::{Idempotency, Outcome, Scope, Tx, idempotent};

use crate::app::{Req, send};
use crate::harness::Harness;
use crate::{send_all, start};

/// The caller, from `x-scope` (as the suite's client sends it).
struct Caller(String);

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        let scope = parts.headers.get("x-scope").and_then(|v| v.to_str().ok());
        scope
            .map(|s| Caller(s.to_owned()))
            .ok_or(StatusCode::UNAUTHORIZED)
    }
}

impl Scope for Caller {
    fn scope(&self) -> std::borrow::Cow<'_, str> {
        self.0.as_str().into()
    }
}

async fn write<H: Harness>(tx: &mut Tx<H::DB>, caller: &str, body: &str) -> Response {
    match H::insert_effect(tx, caller, body).await {
        Ok(id) => (StatusCode::CREATED, format!("payment {id}")).into_response(),
        Err(error) => (StatusCode::SERVICE_UNAVAILABLE, error.to_string()).into_response(),
    }
}

/// Takes the body as text, so that what reaches idem's check is whatever was sent.
#[idempotent(scope = "caller", fingerprint = "json", ignore = ["/sent_at", "/meta/trace"])]
async fn by_value<H: Harness>(caller: Caller, mut tx: Tx<H::DB>, body: String) -> Response {
    write::<H>(&mut tx, &caller.0, &body).await
}

#[idempotent(scope = "caller")]
async fn by_bytes<H: Harness>(caller: Caller, mut tx: Tx<H::DB>, body: String) -> Response {
    write::<H>(&mut tx, &caller.0, &body).await
}

/// A route without idem, which a browser's key must not change.
async fn unkeyed<H: Harness>(
    axum::extract::State(store): axum::extract::State<Idempotency<H::DB>>,
    caller: Caller,
    body: String,
) -> Response {
    // Committed on its own, whatever the session's autocommit.
    let written = async {
        let mut tx = store.pool().begin().await?;
        let sql = "INSERT INTO effects (scope, note) VALUES ($1, $2)";
        H::exec(&mut *tx, sql, &[&caller.0, &body]).await?;
        tx.commit().await
    };
    match written.await {
        Ok(()) => StatusCode::CREATED.into_response(),
        Err(error) => (StatusCode::SERVICE_UNAVAILABLE, error.to_string()).into_response(),
    }
}

fn router<H: Harness>(h: &H) -> Router {
    Router::new()
        .route("/by-value", post(by_value::<H>))
        .route("/by-bytes", post(by_bytes::<H>))
        .route("/unkeyed", post(unkeyed::<H>))
        .with_state(h.store().clone())
}

const FIRST: &str =
    r#"{"amount":100,"currency":"JPY","sent_at":"12:00:00","meta":{"trace":"t-1"}}"#;
/// The same payment as a client that rebuilt its JSON for the retry sends it.
const REBUILT: &str = "{\n  \"meta\": {\"trace\": \"t-2\"},\n  \"currency\": \"\\u004aPY\",\n  \
                       \"amount\": 1.0e2,\n  \"sent_at\": \"12:00:07\"\n}";

pub async fn json_fingerprints_compare_values_not_bytes<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    let post = |key: &str, body: &str| Req::post("jo", key, body).path("/by-value");

    // Concurrent duplicates, each spelled its own way: one execution.
    let spellings = [FIRST, REBUILT, FIRST, REBUILT, FIRST, REBUILT];
    let reqs = spellings.iter().map(|body| post("k-json", body)).collect();
    let got = send_all(&app, reqs).await;
    let executed: Vec<_> = got.iter().filter(|g| g.status == 201).collect();
    assert!(!executed.is_empty(), "{got:?}");
    for g in &got {
        assert!(g.status == 201 || g.status == 409, "{g:?}");
        if g.status == 201 {
            assert_eq!(g.body, executed[0].body, "one answer");
        }
    }
    assert_eq!(h.effects("jo").await, 1, "one execution");
    let rows = h.key_rows("jo").await;
    assert_eq!(rows.len(), 1);

    // Rebuilt and re-stamped: a replay of the first answer.
    for body in [
        FIRST,
        REBUILT,
        r#"{"currency":"JPY","amount":100,"meta":{"trace":"x"}}"#,
    ] {
        let replay = send(&app, &post("k-json", body)).await;
        assert_eq!(
            replay.outcome,
            Some(Outcome::Replayed),
            "{body}: {replay:?}"
        );
        assert_eq!(replay.body, executed[0].body);
    }
    // A changed value, a changed member beside an ignored one, a value's type: 422.
    let changed = [
        r#"{"amount":101,"currency":"JPY"}"#,
        r#"{"amount":"100","currency":"JPY"}"#,
        r#"{"amount":100,"currency":"JPY","meta":{"trace":"t-1","hop":2}}"#,
        r#"{"amount":100,"currency":"JPY","note":null}"#,
    ];
    for body in changed {
        let got = send(&app, &post("k-json", body)).await;
        assert_eq!(got.status, 422, "{body}: {}", got.text());
        assert_eq!(got.problem().as_deref(), Some("payload-mismatch"));
    }
    assert_eq!(h.key_rows("jo").await, rows, "record untouched");

    // Not one JSON value: 400 before anything is claimed or run.
    let not_json = [
        "amount=100&currency=JPY",
        r#"{"amount":100,"amount":200}"#,
        r#"{"amount":100"#,
        "",
    ];
    for (i, body) in not_json.iter().enumerate() {
        let got = send(&app, &post(&format!("k-bad-{i}"), body)).await;
        assert_eq!(got.status, 400, "{body}: {}", got.text());
        assert_eq!(got.problem().as_deref(), Some("invalid-json"), "{body}");
        assert_eq!(got.outcome, Some(Outcome::Refused), "{body}");
    }
    // Without a key nothing is compared, so the body is the handler's business.
    let unkeyed = Req::post("jo", "", "amount=1").keys(&[]).path("/by-value");
    assert_eq!(send(&app, &unkeyed).await.status, 201);
    assert_eq!(h.effects("jo").await, 2);
    assert_eq!(
        h.key_rows("jo").await,
        rows,
        "nothing stored for the refused"
    );

    // The default still compares bytes.
    let bytes = |body: &str| Req::post("jo", "k-bytes", body).path("/by-bytes");
    assert_eq!(send(&app, &bytes(FIRST)).await.status, 201);
    assert_eq!(send(&app, &bytes(REBUILT)).await.status, 422);
    h.finish().await;
}

/// Firefox (135+, `network.http.idempotencyKey.enabled`) sends
/// `Idempotency-Key: "<decimal u64>"` with every POST, and the same key when the
/// same form is submitted again.
pub async fn browser_sent_keys_are_keys<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let app = router(&h);
    let key = format!("\"{}\"", u64::MAX - 7);
    let form = "amount=100&currency=JPY";
    let submit = |path: &str| {
        Req::post("ff", &key, form)
            .path(path)
            .header("content-type", "application/x-www-form-urlencoded")
    };

    // A keyed endpoint: the resubmitted form is a retry, answered from the record.
    let first = send(&app, &submit("/by-bytes")).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let again = send(&app, &submit("/by-bytes")).await;
    assert_eq!(again.outcome, Some(Outcome::Replayed));
    assert_eq!(again.body, first.body);
    let rows = h.key_rows("ff").await;
    assert_eq!(rows.len(), 1);
    assert_eq!(
        rows[0].0,
        (u64::MAX - 7).to_string(),
        "the key is the unquoted number"
    );
    assert_eq!(h.effects("ff").await, 1);

    // A route without idem: the header changes nothing, each submission runs.
    for _ in 0..2 {
        assert_eq!(send(&app, &submit("/unkeyed")).await.status, 201);
    }
    assert_eq!(h.effects("ff").await, 3);
    assert_eq!(h.key_rows("ff").await.len(), 1);
    h.finish().await;
}
