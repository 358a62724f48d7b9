//! Errors as RFC 9457 problem+json, and a `Json` whose rejections are too.

use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// `Json<T>` whose rejections are problem+json too.
pub(crate) struct ApiJson<T>(pub(crate) T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = Response;

    async fn from_request(request: Request, state: &S) -> Result<Self, Response> {
        match Json::<T>::from_request(request, state).await {
            Ok(Json(value)) => Ok(Self(value)),
            Err(rejection) => Err(problem(
                rejection.status(),
                "invalid-body",
                "Invalid request body",
                &rejection_detail(&rejection),
            )),
        }
    }
}

fn rejection_detail(rejection: &JsonRejection) -> String {
    rejection.body_text()
}

pub(crate) enum ApiError {
    Unauthorized,
    Invalid(&'static str),
    InsufficientFunds,
    NotFound,
    Provider,
    Internal,
    Database(sqlx::Error),
}

impl From<sqlx::Error> for ApiError {
    fn from(error: sqlx::Error) -> Self {
        Self::Database(error)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            Self::Unauthorized => {
                let mut response = problem(
                    StatusCode::UNAUTHORIZED,
                    "unauthorized",
                    "Authentication required",
                    "send `Authorization: Bearer <user>`",
                );
                response
                    .headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                response
            }
            Self::Invalid(detail) => problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid-payment",
                "Invalid payment",
                detail,
            ),
            Self::InsufficientFunds => problem(
                StatusCode::PAYMENT_REQUIRED,
                "insufficient-funds",
                "Insufficient funds",
                "the balance does not cover this amount",
            ),
            Self::NotFound => problem(
                StatusCode::NOT_FOUND,
                "not-found",
                "No such payment",
                "no payment of yours has this id",
            ),
            Self::Provider => problem(
                StatusCode::BAD_GATEWAY,
                "provider-failed",
                "Card provider failed",
                "the charge could not be confirmed; retry with the same key",
            ),
            Self::Internal => problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "Internal error",
                "retry with the same key",
            ),
            Self::Database(error) => {
                eprintln!("payments: database error: {error}");
                problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "database",
                    "Database unavailable",
                    "retry with the same key",
                )
            }
        }
    }
}

fn problem(status: StatusCode, slug: &str, title: &str, detail: &str) -> Response {
    let body = serde_json::json!({
        "type": format!("https://payments.example/problems/{slug}"),
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut response = (status, Json(body)).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}
