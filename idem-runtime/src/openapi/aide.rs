//! aide (`docs.rs/aide`): the extractors of a rewritten handler document the key header and idem's
//! own answers, and its output adds the recorded answers' headers to the
//! responses the handler's own type documents.

use aide::OperationInput;
use aide::generate::GenContext;
use aide::openapi::{Operation, Parameter, ReferenceOr, Response, StatusCode};
use aide::operation::OperationOutput;
use aide::transform::TransformOperation;
use serde_json::Value;

use super::{
    doc, key_parameter, problem_responses, recorded, unverified_response, with_answer_headers,
};
use crate::axum::{Answer, Arg, Buffered, IdempotentRequest};
use crate::{Backend, IdempotencyKey, Tx};

/// Reads one of `super`'s JSON fragments into aide's model; they are written to fit.
fn read<T: serde::de::DeserializeOwned>(ctx: &mut GenContext, value: Value) -> Option<T> {
    match serde_json::from_value(value) {
        Ok(item) => Some(item),
        Err(error) => {
            ctx.error(aide::Error::Other(Box::new(error)));
            None
        }
    }
}

/// Adds the key header, or makes the one a parameter added required.
fn key_header(ctx: &mut GenContext, operation: &mut Operation, required: bool) {
    for parameter in &mut operation.parameters {
        if let ReferenceOr::Item(Parameter::Header { parameter_data, .. }) = parameter
            && parameter_data.name.eq_ignore_ascii_case("idempotency-key")
        {
            parameter_data.required |= required;
            return;
        }
    }
    if let Some(parameter) = read::<Parameter>(ctx, key_parameter(required)) {
        operation.parameters.push(ReferenceOr::Item(parameter));
    }
}

/// idem's own answers, documented whether or not aide infers responses; a status
/// the operation documents already keeps its documentation.
fn problems(ctx: &mut GenContext, operation: &mut Operation) {
    let responses = operation.responses.get_or_insert_with(Default::default);
    for (status, response) in problem_responses() {
        let code = StatusCode::Code(status);
        if responses.responses.contains_key(&code) {
            continue;
        }
        if let Some(response) = read::<Response>(ctx, response) {
            responses
                .responses
                .insert(code, ReferenceOr::Item(response));
        }
    }
}

/// Taking the key makes it required.
impl OperationInput for IdempotencyKey {
    fn operation_input(ctx: &mut GenContext, operation: &mut Operation) {
        key_header(ctx, operation, true);
    }
}

impl<DB: Backend> OperationInput for Tx<DB> {}

/// A handler that checks its sender's signature answers 401 before anything else.
impl<V> OperationInput for crate::axum::Verifying<V> {
    fn operation_input(ctx: &mut GenContext, operation: &mut Operation) {
        let (status, response) = unverified_response();
        let responses = operation.responses.get_or_insert_with(Default::default);
        let code = StatusCode::Code(status);
        if !responses.responses.contains_key(&code)
            && let Some(response) = read::<Response>(ctx, response)
        {
            responses
                .responses
                .insert(code, ReferenceOr::Item(response));
        }
    }
}

impl<DB: Backend, T: OperationInput> OperationInput for Arg<DB, T> {
    fn operation_input(ctx: &mut GenContext, operation: &mut Operation) {
        T::operation_input(ctx, operation);
    }

    fn inferred_early_responses(
        ctx: &mut GenContext,
        operation: &mut Operation,
    ) -> Vec<(Option<u16>, Response)> {
        T::inferred_early_responses(ctx, operation)
    }
}

impl<DB: Backend, T: OperationInput, const DOC: u8> OperationInput for Buffered<DB, T, DOC> {
    fn operation_input(ctx: &mut GenContext, operation: &mut Operation) {
        T::operation_input(ctx, operation);
        if DOC & doc::KEY_ELSEWHERE == 0 {
            key_header(ctx, operation, DOC & doc::REQUIRED != 0);
        }
        problems(ctx, operation);
    }

    fn inferred_early_responses(
        ctx: &mut GenContext,
        operation: &mut Operation,
    ) -> Vec<(Option<u16>, Response)> {
        T::inferred_early_responses(ctx, operation)
    }
}

/// A hand-written handler that takes the request and runs it itself: its options
/// are not known here, so the key is documented as optional.
impl<DB: Backend> OperationInput for IdempotentRequest<DB> {
    fn operation_input(ctx: &mut GenContext, operation: &mut Operation) {
        key_header(ctx, operation, false);
        problems(ctx, operation);
    }
}

impl<O: OperationOutput, const DOC: u8> OperationOutput for Answer<O, DOC> {
    type Inner = O::Inner;

    fn operation_response(ctx: &mut GenContext, operation: &mut Operation) -> Option<Response> {
        let response = O::operation_response(ctx, operation)?;
        Some(with_headers::<DOC>(ctx, response))
    }

    fn inferred_responses(
        ctx: &mut GenContext,
        operation: &mut Operation,
    ) -> Vec<(Option<u16>, Response)> {
        O::inferred_responses(ctx, operation)
            .into_iter()
            .map(|(status, response)| match recorded(status) {
                true => (status, with_headers::<DOC>(ctx, response)),
                false => (status, response),
            })
            .collect()
    }
}

/// `response` with the headers of a replayed answer.
fn headed(response: &Response, ttl: bool) -> Result<Response, serde_json::Error> {
    let json = serde_json::to_value(response)?;
    serde_json::from_value(with_answer_headers(json, ttl))
}

fn with_headers<const DOC: u8>(ctx: &mut GenContext, response: Response) -> Response {
    match headed(&response, DOC & doc::TTL_HEADER != 0) {
        Ok(with) => with,
        Err(error) => {
            ctx.error(aide::Error::Other(Box::new(error)));
            response
        }
    }
}

fn add_answer_headers(mut op: TransformOperation<'_>, ttl: bool) -> TransformOperation<'_> {
    if let Some(responses) = &mut op.inner_mut().responses {
        for (status, response) in &mut responses.responses {
            let code = match status {
                StatusCode::Code(code) => Some(*code),
                StatusCode::Range(_) => None,
            };
            if let (true, ReferenceOr::Item(item)) = (recorded(code), response)
                && let Ok(with) = headed(item, ttl)
            {
                *item = with;
            }
        }
    }
    op
}

/// Adds the headers of a replayed answer (`Idempotent-Replayed`) to the responses
/// an operation's transform documents by hand, which aide adds after the handler's
/// own types spoke: with `infer_responses(true)`, responses aide infers from the
/// handler's return type get them without this.
///
/// # Examples
///
/// ```
/// # extern crate idem_runtime as idem_axum;
/// use aide::axum::{ApiRouter, routing::post_with};
/// use axum::Json;
///
/// # async fn create_payment() -> Json<u64> { Json(1) }
/// let router: ApiRouter = ApiRouter::new().api_route(
///     "/payments",
///     post_with(create_payment, |op| {
///         op.response::<201, Json<u64>>().with(idem_axum::aide::replayed)
///     }),
/// );
/// ```
pub fn replayed(op: TransformOperation<'_>) -> TransformOperation<'_> {
    add_answer_headers(op, false)
}

/// [`replayed`], with `Idempotency-Key-TTL` too, for endpoints with
/// `ttl_header = true`.
pub fn replayed_with_ttl(op: TransformOperation<'_>) -> TransformOperation<'_> {
    add_answer_headers(op, true)
}
