//! utoipa (`docs.rs/utoipa`): types to name in `#[utoipa::path(…)]`, and a
//! `Modify` that completes every operation taking the key.

use std::collections::BTreeMap;

use utoipa::openapi::path::{Parameter, ParameterIn};
use utoipa::openapi::{OpenApi, RefOr, Response};

use super::{complete, key_parameter, problem_responses};

/// The `Idempotency-Key` header of an endpoint that requires one
/// (`required = true`, or a handler taking `IdempotencyKey`), for `params(…)`.
///
/// # Examples
///
/// ```
/// # extern crate idem_runtime as idem_axum;
/// use idem_axum::utoipa::{KeyHeader, Problems};
///
/// #[utoipa::path(
///     post,
///     path = "/payments",
///     params(KeyHeader),
///     responses((status = 201, description = "The payment"), Problems)
/// )]
/// async fn create_payment() {}
/// ```
#[derive(Debug, Clone, Copy)]
pub struct KeyHeader;

/// The `Idempotency-Key` header of an endpoint where it is optional: a request
/// without one runs unrecorded.
#[derive(Debug, Clone, Copy)]
pub struct OptionalKeyHeader;

fn parameters(required: bool) -> Vec<Parameter> {
    serde_json::from_value(key_parameter(required))
        .map(|parameter| vec![parameter])
        .unwrap_or_default()
}

impl utoipa::IntoParams for KeyHeader {
    fn into_params(_: impl Fn() -> Option<ParameterIn>) -> Vec<Parameter> {
        parameters(true)
    }
}

impl utoipa::IntoParams for OptionalKeyHeader {
    fn into_params(_: impl Fn() -> Option<ParameterIn>) -> Vec<Parameter> {
        parameters(false)
    }
}

/// idem's own answers, for `responses(…)`: 400 (missing or malformed key, a body
/// that is not the JSON the endpoint fingerprints), 409 `in-flight` and 503 with
/// `Retry-After`, 422 `payload-mismatch`, each with the problem+json body idem
/// writes (`type`, `title`, `status`, `detail`).
#[derive(Debug, Clone, Copy)]
pub struct Problems;

impl utoipa::IntoResponses for Problems {
    fn responses() -> BTreeMap<String, RefOr<Response>> {
        problem_responses()
            .into_iter()
            .filter_map(|(status, response)| {
                let response = serde_json::from_value(response).ok()?;
                Some((status.to_string(), RefOr::T(response)))
            })
            .collect()
    }
}

/// A `Modify` that completes every operation taking the key header (see
/// [`KeyHeader`]): its 2xx responses get `Idempotent-Replayed` (a replay of a
/// recorded answer), and [`Problems`] are added where the operation does not
/// document their status itself.
///
/// # Examples
///
/// ```
/// # extern crate idem_runtime as idem_axum;
/// use idem_axum::utoipa::{KeyHeader, Replays};
/// use utoipa::OpenApi;
///
/// #[utoipa::path(post, path = "/payments", params(KeyHeader),
///     responses((status = 201, description = "The payment")))]
/// async fn create_payment() {}
///
/// #[derive(OpenApi)]
/// #[openapi(paths(create_payment), modifiers(&Replays))]
/// struct ApiDoc;
///
/// let document = serde_json::to_value(ApiDoc::openapi()).unwrap();
/// let created = &document["paths"]["/payments"]["post"]["responses"]["201"];
/// assert!(created["headers"].get("Idempotent-Replayed").is_some());
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Replays;

/// [`Replays`], with `Idempotency-Key-TTL` documented too, for apps whose keyed
/// endpoints set `ttl_header = true`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReplaysWithTtl;

fn modify(openapi: &mut OpenApi, ttl_header: bool) {
    let Ok(mut document) = serde_json::to_value(&*openapi) else {
        return;
    };
    complete(&mut document, ttl_header);
    if let Ok(completed) = serde_json::from_value(document) {
        *openapi = completed;
    }
}

impl utoipa::Modify for ReplaysWithTtl {
    fn modify(&self, openapi: &mut OpenApi) {
        modify(openapi, true);
    }
}

impl utoipa::Modify for Replays {
    fn modify(&self, openapi: &mut OpenApi) {
        modify(openapi, false);
    }
}
