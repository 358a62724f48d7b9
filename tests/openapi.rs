//! The OpenAPI documents an app gets for its `#[idempotent]` handlers: each is
//! checked by a real validator (Python's `openapi-spec-validator`, which `.ci/run`
//! installs), and for what a generated client must learn from it: the key header,
//! the headers of a replayed answer, and idem's own problem answers, on keyed
//! operations only.

use std::path::PathBuf;
use std::process::Command;

use aide::axum::ApiRouter;
use aide::axum::routing::{post, post_with};
use aide::openapi::OpenApi;
use axum::Json;
use axum::http::StatusCode;
use idem_axum::{Idempotency, IdempotencyKey, Tx, idempotent};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;
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

async fn list_payments() -> Json<Vec<Payment>> {
    Json(Vec::new())
}

/// Validates `document` with the Python validator; a missing validator fails.
fn validate(name: &str, document: &Value) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let path = dir.join(format!("{name}.json"));
    let text = serde_json::to_string_pretty(document).expect("serialize");
    std::fs::write(&path, text).expect("write the document");
    let out = Command::new("python3")
        .args(["-m", "openapi_spec_validator"])
        .arg(&path)
        .output()
        .expect("python3 runs (`.ci/run` installs openapi-spec-validator)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("No module named"),
        "the validator is missing: `python3 -m pip install openapi-spec-validator` (`.ci/run` does)"
    );
    assert!(
        out.status.success(),
        "{} is not a valid OpenAPI document:\n{}{}",
        path.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn key_parameter(operation: &Value) -> Option<&Value> {
    operation["parameters"]
        .as_array()?
        .iter()
        .find(|p| p["in"] == "header" && p["name"] == "Idempotency-Key")
}

/// What a keyed operation must say, whichever library wrote it.
fn assert_keyed(operation: &Value, success: &str, required: bool, ttl_header: bool) {
    let key = key_parameter(operation).unwrap_or_else(|| panic!("no key header: {operation:#}"));
    assert_eq!(
        key["required"].as_bool().unwrap_or(false),
        required,
        "{key:#}"
    );
    assert_eq!(key["schema"]["type"], "string");
    let responses = &operation["responses"];
    let headers = &responses[success]["headers"];
    assert!(
        headers.get("Idempotent-Replayed").is_some(),
        "{responses:#}"
    );
    assert_eq!(
        headers.get("Idempotency-Key-TTL").is_some(),
        ttl_header,
        "{headers:#}"
    );
    for status in ["400", "409", "422", "503"] {
        let schema = &responses[status]["content"]["application/problem+json"]["schema"];
        let fields = &schema["properties"];
        for field in ["type", "title", "status", "detail"] {
            assert!(fields.get(field).is_some(), "{status} {field}: {schema:#}");
        }
    }
    for status in ["409", "503"] {
        assert!(
            responses[status]["headers"].get("Retry-After").is_some(),
            "{status}"
        );
    }
}

fn assert_unkeyed(operation: &Value) {
    assert!(key_parameter(operation).is_none(), "{operation:#}");
    for status in ["409", "422"] {
        assert!(
            operation["responses"].get(status).is_none(),
            "{operation:#}"
        );
    }
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
        .finish_api(&mut api)
        .with_state(store);
    let document = serde_json::to_value(&api).expect("serialize");
    validate("aide", &document);

    let paths = &document["paths"];
    assert_keyed(&paths["/payments"]["post"], "201", true, true);
    assert_keyed(&paths["/refunds"]["post"], "200", false, false);
    assert_unkeyed(&paths["/payments"]["get"]);
    // The handler's own response and body are still there.
    let created = &paths["/payments"]["post"]["responses"]["201"];
    assert!(
        created["content"]["application/json"]["schema"].is_object(),
        "{created:#}"
    );
    let body = &paths["/payments"]["post"]["requestBody"]["content"]["application/json"];
    assert!(body["schema"].is_object(), "{body:#}");
}
