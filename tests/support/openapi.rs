//! OpenAPI documents as the tests check them: valid by a real validator (Python's
//! `openapi-spec-validator`, which `.ci/run` installs), and saying what a generated
//! client must learn about idem, on keyed operations only.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

/// Validates `document` with the Python validator; a missing validator fails.
pub(crate) fn validate(name: &str, document: &Value) {
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
/// `schema`, or what its `$ref` names in `document`'s components.
pub(crate) fn resolve<'a>(document: &'a Value, schema: &'a Value) -> &'a Value {
    match schema["$ref"].as_str().and_then(|r| r.strip_prefix("#/")) {
        Some(path) => path.split('/').fold(document, |at, part| &at[part]),
        None => schema,
    }
}

pub(crate) fn assert_keyed(
    document: &Value,
    operation: &Value,
    success: &str,
    required: bool,
    ttl_header: bool,
) {
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
        let schema = resolve(document, schema);
        let fields = &schema["properties"];
        for field in ["type", "title", "status", "detail"] {
            assert!(fields.get(field).is_some(), "{status} {field}: {schema:#}");
        }
    }
    // Only idem answers these; an app may document its own 400 and 422.
    for status in ["409", "503"] {
        for header in ["Retry-After", "Cache-Control"] {
            assert!(
                responses[status]["headers"].get(header).is_some(),
                "{status} {header}"
            );
        }
    }
}

pub(crate) fn assert_unkeyed(operation: &Value) {
    assert!(key_parameter(operation).is_none(), "{operation:#}");
    for status in ["409", "422"] {
        assert!(
            operation["responses"].get(status).is_none(),
            "{operation:#}"
        );
    }
}
