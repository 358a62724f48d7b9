//! What an idempotent operation adds to an OpenAPI 3 document, written once as
//! JSON and read into each library's own model (`aide`, `utoipa`): the
//! `Idempotency-Key` request header, the headers a recorded answer carries, and the
//! problems idem answers by itself (`docs/outcomes.md`), with the problem+json body
//! idem writes (`src/problem.rs`).

use serde_json::{Value, json};

use crate::Problem;
use crate::key::MAX_KEY_LEN;

/// The request header's parameter object.
pub(crate) fn key_parameter(required: bool) -> Value {
    json!({
        "name": "Idempotency-Key",
        "in": "header",
        "required": required,
        "description": "Makes the request safe to retry: a repeat with the same key and \
            request gets the recorded answer (with `Idempotent-Replayed: true`) instead of \
            running again. Quoted (`\"…\"`, the IETF draft's structured-field string) or bare.",
        "schema": {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_KEY_LEN + 2,
            "pattern": "^[\\x20-\\x7E]+$",
        },
        "example": "\"8e03978e-40d5-43e8-bc93-6894a57f9324\"",
    })
}

/// Headers of an answer idem may have replayed, documented on the successes.
pub(crate) fn answer_headers(ttl_header: bool) -> serde_json::Map<String, Value> {
    let mut headers = serde_json::Map::new();
    headers.insert(
        "Idempotent-Replayed".to_owned(),
        json!({
            "description": "`true` when this is the recorded answer of an earlier request \
                with the same key, sent again without running the handler (a recorded 4xx \
                answer is replayed with it too); absent otherwise.",
            "schema": { "type": "string", "enum": ["true"] },
        }),
    );
    if ttl_header {
        headers.insert(
            "Idempotency-Key-TTL".to_owned(),
            json!({
                "description": "How many seconds the key is kept, counted from its first request.",
                "schema": { "type": "integer", "minimum": 0 },
            }),
        );
    }
    headers
}

/// The problem+json body idem writes (RFC 9457).
pub(crate) fn problem_schema() -> Value {
    json!({
        "type": "object",
        "required": ["type", "title", "status", "detail"],
        "properties": {
            "type": { "type": "string", "format": "uri-reference" },
            "title": { "type": "string" },
            "status": { "type": "integer", "minimum": 100, "maximum": 599 },
            "detail": { "type": "string" },
            "mismatch": {
                "description": "With 422 `payload-mismatch`: the first part of the request \
                    that differs from the key's first use (its stored values are never shown).",
                "type": "string",
                "enum": ["method", "path", "query", "content-type", "body"],
            },
        },
    })
}

/// The answers idem gives before or instead of the handler, by status.
pub(crate) fn problem_responses() -> Vec<(u16, Value)> {
    let groups: [(u16, &[Problem], &str); 4] = [
        (
            400,
            &[
                Problem::MissingKey,
                Problem::InvalidKey,
                Problem::InvalidJson,
                Problem::InvalidMultipart,
            ],
            "The Idempotency-Key header is missing (where required), malformed or \
             repeated, or the body is not the JSON the endpoint fingerprints or the \
             multipart body its Content-Type announces: nothing ran.",
        ),
        (
            409,
            &[Problem::InFlight],
            "A request with this key is still running: retry after `Retry-After` seconds.",
        ),
        (
            422,
            &[Problem::PayloadMismatch],
            "This key was first used with another method, path, query, content type or \
             body (the problem's `mismatch` names which): nothing ran, and the first \
             request's record is unchanged.",
        ),
        (
            503,
            &[
                Problem::StoreUnavailable,
                Problem::LeaseExpired,
                Problem::ShuttingDown,
            ],
            "Nothing of the request was kept: retry with the same key after `Retry-After` \
             seconds.",
        ),
    ];
    groups
        .into_iter()
        .map(|(status, problems, description)| problem_group(status, problems, description))
        .collect()
}

/// The 401 a handler with `verify = …` answers before anything else.
#[cfg(feature = "aide")]
pub(crate) fn unverified_response() -> (u16, Value) {
    problem_group(
        401,
        &[Problem::Unverified],
        "The sender's signature does not verify (missing, malformed, stale or not the \
         body's): nothing was claimed or replayed.",
    )
}

/// The response documenting `problems`, all answered with `status`.
fn problem_group(status: u16, problems: &[Problem], description: &str) -> (u16, Value) {
    let slugs: Vec<&str> = problems.iter().map(|p| p.slug()).collect();
    let mut response = json!({
        "description": format!("{description} Problem types: {}.", slugs.join(", ")),
        "content": {
            "application/problem+json": { "schema": problem_schema() },
        },
    });
    response["headers"] = json!({
        "Cache-Control": {
            "description": "`no-store`: no cache may answer a retry with this problem.",
            "schema": { "type": "string", "enum": ["no-store"] },
        },
    });
    if problems.iter().any(|p| p.retry_after()) {
        response["headers"]["Retry-After"] = json!({
            "description": "Seconds to wait before retrying with the same key.",
            "schema": { "type": "integer", "minimum": 0 },
        });
    }
    (status, response)
}

/// Adds the recorded answers' headers to `response` (a response object as JSON),
/// keeping any the application documented itself.
pub(crate) fn with_answer_headers(mut response: Value, ttl_header: bool) -> Value {
    if let Some(object) = response.as_object_mut() {
        let headers = object
            .entry("headers")
            .or_insert_with(|| Value::Object(serde_json::Map::new()));
        if let Some(headers) = headers.as_object_mut() {
            for (name, header) in answer_headers(ttl_header) {
                headers.entry(name).or_insert(header);
            }
        }
    }
    response
}

/// The responses documented with the replay headers: the successes (and a
/// `default`). A recorded 4xx is replayed with them too, which their description
/// says; a 4xx an extractor answers before idem never is, so none is marked.
pub(crate) fn recorded(status: Option<u16>) -> bool {
    status.is_none_or(|s| (200..300).contains(&s))
}

/// The flags `#[idempotent]` writes into the types of a rewritten handler, so that
/// documentation generators see the endpoint's options.
#[cfg(feature = "aide")]
pub(crate) mod doc {
    /// `required = true`, or a parameter of type `IdempotencyKey`.
    pub(crate) const REQUIRED: u8 = 1;
    /// `ttl_header = true`.
    pub(crate) const TTL_HEADER: u8 = 2;
    /// `key = header(…)` or `key = json(…)`: no `Idempotency-Key` parameter.
    pub(crate) const KEY_ELSEWHERE: u8 = 4;
}

#[cfg(feature = "aide")]
pub(crate) mod aide;
#[cfg(feature = "utoipa")]
pub(crate) mod utoipa;

/// The methods a path item holds operations under.
#[cfg(feature = "utoipa")]
const METHODS: [&str; 8] = [
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

/// Completes, in a whole document, every operation that takes the key header: its
/// recorded answers get the replay headers, and idem's problems are added where the
/// operation does not document their status itself.
#[cfg(feature = "utoipa")]
pub(crate) fn complete(document: &mut Value, ttl_header: bool) {
    let Some(paths) = document.get_mut("paths").and_then(Value::as_object_mut) else {
        return;
    };
    for item in paths.values_mut() {
        for method in METHODS {
            let Some(operation) = item.get_mut(method).and_then(Value::as_object_mut) else {
                continue;
            };
            let keyed = operation
                .get("parameters")
                .and_then(Value::as_array)
                .is_some_and(|parameters| parameters.iter().any(is_key_parameter));
            if !keyed {
                continue;
            }
            let responses = operation
                .entry("responses")
                .or_insert_with(|| Value::Object(serde_json::Map::new()));
            let Some(responses) = responses.as_object_mut() else {
                continue;
            };
            for (status, response) in responses.iter_mut() {
                if recorded(status.parse().ok()) {
                    *response = with_answer_headers(response.take(), ttl_header);
                }
            }
            for (status, problem) in problem_responses() {
                responses.entry(status.to_string()).or_insert(problem);
            }
        }
    }
}

#[cfg(feature = "utoipa")]
fn is_key_parameter(parameter: &Value) -> bool {
    parameter.get("in").and_then(Value::as_str) == Some("header")
        && parameter
            .get("name")
            .and_then(Value::as_str)
            .is_some_and(|name| name.eq_ignore_ascii_case("idempotency-key"))
}
