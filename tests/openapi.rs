//! The OpenAPI documents an app gets for its `#[idempotent]` handlers: each is
//! checked by a real validator (Python's `openapi-spec-validator`, which `.ci/run`
//! installs), and for what a generated client must learn from it: the key header,
//! the headers of a replayed answer, and idem's own problem answers, on keyed
//! operations only.

#[path = "support/openapi.rs"]
mod openapi;

use aide::axum::ApiRouter;
use aide::axum::routing::{post, post_with};
use aide::openapi::OpenApi;
use axum::Json;
use axum::extract::FromRef;
use axum::http::{HeaderMap, StatusCode};
use idem_axum::utoipa::{KeyHeader, OptionalKeyHeader, Problems, Replays};
use idem_axum::webhook::{Unverified, Verifier};
use idem_axum::{Idempotency, IdempotencyKey, Tx, idempotent};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use sqlx::Sqlite;
use sqlx::sqlite::SqlitePoolOptions;

#[derive(Deserialize, JsonSchema)]
struct NewPayment {
    amount: i64,
}

#[derive(Serialize, JsonSchema)]
struct Payment {
    id: i64,
    amount: i64,
}

#[idempotent(unscoped = true, required = true, ttl_header = true)]
async fn create_payment(
    tx: Tx<Sqlite>,
    Json(new): Json<NewPayment>,
) -> (StatusCode, Json<Payment>) {
    drop(tx);
    let payment = Payment {
        id: 1,
        amount: new.amount,
    };
    (StatusCode::CREATED, Json(payment))
}

/// The key is optional here, taken to relay it.
#[idempotent(unscoped = true)]
async fn refund(
    key: Option<IdempotencyKey>,
    tx: Tx<Sqlite>,
    Json(new): Json<NewPayment>,
) -> Json<Payment> {
    drop((key, tx));
    Json(Payment {
        id: 2,
        amount: -new.amount,
    })
}

/// A webhook: the key from the event's body, the sender's signature checked first.
#[idempotent(unscoped = true, key = json("/id"), verify = Signed, required = true)]
async fn provider_event(tx: Tx<Sqlite>, Json(new): Json<NewPayment>) -> Json<Payment> {
    drop(tx);
    Json(Payment {
        id: 3,
        amount: new.amount,
    })
}

/// A webhook keyed by a header of the sender's own.
#[idempotent(unscoped = true, key = header("webhook-id"))]
async fn github_event(tx: Tx<Sqlite>) -> StatusCode {
    drop(tx);
    StatusCode::NO_CONTENT
}

/// A sender's signature scheme, from the router's state.
struct Signed;

impl FromRef<Idempotency<Sqlite>> for Signed {
    fn from_ref(_: &Idempotency<Sqlite>) -> Self {
        Self
    }
}

impl Verifier for Signed {
    fn verify(&self, _: &HeaderMap, _: &[u8]) -> Result<(), Unverified> {
        Ok(())
    }
}

async fn list_payments() -> Json<Vec<Payment>> {
    Json(Vec::new())
}

#[tokio::test]
async fn aide_documents_idempotent_handlers_by_themselves() {
    aide::generate::infer_responses(true);
    let pool = SqlitePoolOptions::new()
        .connect("sqlite::memory:")
        .await
        .expect("in-memory SQLite");
    let store = Idempotency::<Sqlite>::new(pool);
    let mut api = OpenApi::default();
    let _app: axum::Router = ApiRouter::new()
        .api_route(
            "/payments",
            post_with(create_payment, |op| {
                op.response::<201, Json<Payment>>()
                    .with(idem_axum::aide::replayed_with_ttl)
            })
            .get(list_payments),
        )
        .api_route("/refunds", post(refund))
        .api_route("/webhooks/provider", post(provider_event))
        .api_route("/webhooks/github", post(github_event))
        .finish_api(&mut api)
        .with_state(store);
    let document = serde_json::to_value(&api).expect("serialize");
    openapi::validate("aide", &document);

    let paths = &document["paths"];
    openapi::assert_keyed(&document, &paths["/payments"]["post"], "201", true, true);
    openapi::assert_keyed(&document, &paths["/refunds"]["post"], "200", false, false);
    assert_own_problems(&document, &paths["/payments"]["post"]);
    openapi::assert_unkeyed(&paths["/payments"]["get"]);
    // The handler's own response and body are still there.
    let created = &paths["/payments"]["post"]["responses"]["201"];
    assert!(
        created["content"]["application/json"]["schema"].is_object(),
        "{created:#}"
    );
    let body = &paths["/payments"]["post"]["requestBody"]["content"]["application/json"];
    assert!(body["schema"].is_object(), "{body:#}");
    // A key read elsewhere is not asked for in `Idempotency-Key`; a signed
    // endpoint documents its 401, and idem's other problems as any keyed one.
    for path in ["/webhooks/provider", "/webhooks/github"] {
        let operation = &paths[path]["post"];
        let parameters = operation["parameters"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert!(
            parameters.iter().all(|p| !p["name"]
                .as_str()
                .is_some_and(|n| n.eq_ignore_ascii_case("idempotency-key"))),
            "{path}: {operation:#}"
        );
    }
    let provider = &paths["/webhooks/provider"]["post"];
    assert_own_problems(&document, provider);
    let unverified = &provider["responses"]["401"];
    assert!(
        unverified["description"]
            .as_str()
            .is_some_and(|d| d.contains("unverified")),
        "{provider:#}"
    );
    assert!(
        paths["/webhooks/github"]["post"]["responses"]
            .get("401")
            .is_none()
    );
}

#[utoipa::path(post, path = "/payments", params(KeyHeader),
    responses((status = 201, description = "The payment", body = UtoipaPayment)))]
#[idempotent(unscoped = true, required = true)]
async fn utoipa_create(tx: Tx<Sqlite>, Json(new): Json<NewPayment>) -> (StatusCode, Json<Payment>) {
    drop(tx);
    (
        StatusCode::CREATED,
        Json(Payment {
            id: 3,
            amount: new.amount,
        }),
    )
}

#[utoipa::path(post, path = "/refunds", params(OptionalKeyHeader),
    responses((status = 200, description = "The refund"), Problems))]
#[idempotent(unscoped = true)]
async fn utoipa_refund(tx: Tx<Sqlite>) -> StatusCode {
    drop(tx);
    StatusCode::OK
}

#[utoipa::path(get, path = "/payments", responses((status = 200, description = "All payments")))]
async fn utoipa_list() -> StatusCode {
    StatusCode::OK
}

/// utoipa's schema of the response body, as an app writes one.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
struct UtoipaPayment {
    id: i64,
}

#[derive(utoipa::OpenApi)]
#[openapi(paths(utoipa_create, utoipa_refund, utoipa_list), modifiers(&Replays))]
struct UtoipaDoc;

#[test]
fn utoipa_documents_keyed_operations_with_one_parameter_and_one_modifier() {
    use utoipa::OpenApi as _;
    // The handlers route as usual.
    let _app: axum::Router<Idempotency<Sqlite>> = axum::Router::new()
        .route(
            "/payments",
            axum::routing::post(utoipa_create).get(utoipa_list),
        )
        .route("/refunds", axum::routing::post(utoipa_refund));
    let document = serde_json::to_value(UtoipaDoc::openapi()).expect("serialize");
    openapi::validate("utoipa", &document);
    let paths = &document["paths"];
    openapi::assert_keyed(&document, &paths["/payments"]["post"], "201", true, false);
    openapi::assert_keyed(&document, &paths["/refunds"]["post"], "200", false, false);
    assert_own_problems(&document, &paths["/payments"]["post"]);
    openapi::assert_unkeyed(&paths["/payments"]["get"]);
}

/// idem's own problems on `operation`, where an app may document its own
/// instead: each says no cache may keep it, and the 422's schema names the part
/// of the request that differed.
fn assert_own_problems(document: &serde_json::Value, operation: &serde_json::Value) {
    for status in ["400", "422"] {
        let headers = &operation["responses"][status]["headers"];
        assert!(
            headers.get("Cache-Control").is_some(),
            "{status}: {headers:#}"
        );
    }
    let schema = &operation["responses"]["422"]["content"]["application/problem+json"]["schema"];
    let schema = openapi::resolve(document, schema);
    let mismatch = &schema["properties"]["mismatch"]["enum"];
    for part in ["method", "path", "query", "content-type", "body"] {
        assert!(
            mismatch
                .as_array()
                .is_some_and(|e| e.iter().any(|v| v == part)),
            "422 mismatch {part}: {schema:#}"
        );
    }
}
