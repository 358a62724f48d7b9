//! RFC 9457 `application/problem+json` answers for every case idem answers itself.

use std::fmt::{self, Write as _};

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};

/// Why idem answered a request itself instead of (or after) running the handler.
///
/// Each case has a fixed status and a stable problem `type`: the store's problem base
/// URI (see [`Builder::problem_base`](crate::Builder::problem_base)) followed by
/// [`slug`](Self::slug), e.g. `urn:idem:problem:in-flight`.
///
/// # Examples
///
/// ```
/// # extern crate idem_runtime as idem_axum;
/// use http::StatusCode;
/// use idem_axum::Problem;
///
/// assert_eq!(Problem::InFlight.status(), StatusCode::CONFLICT);
/// assert_eq!(Problem::InFlight.slug(), "in-flight");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Problem {
    /// 400: the endpoint is `required` and the request has no `Idempotency-Key`.
    MissingKey,
    /// 400: the `Idempotency-Key` header is malformed or repeated.
    InvalidKey,
    /// 401: the endpoint checks its sender's signature (`verify = …`, a
    /// webhook's) and this request's does not verify: missing, malformed,
    /// stale or not the body's. Checked before anything else: nothing was
    /// claimed or replayed.
    Unverified,
    /// 409: an earlier request with this key is still being executed. The engine
    /// sets `Retry-After` to the seconds left on the holder's lock (by then the key
    /// is completed or free); [`to_response`](Self::to_response) alone sends 1.
    InFlight,
    /// 422: the key was first used with another method, path or body.
    PayloadMismatch,
    /// 413: the request body is larger than the endpoint accepts.
    PayloadTooLarge,
    /// 400: the endpoint fingerprints bodies as JSON
    /// ([`Options::json_fingerprint`](crate::Options::json_fingerprint)) and this
    /// keyed request's body is not one JSON value, or repeats a member name within
    /// an object; nothing was claimed.
    InvalidJson,
    /// 400: this keyed request's `Content-Type` is a multipart type and its body
    /// is not the multipart body it announces (no boundary, a part whose headers
    /// never end, no closing delimiter); nothing was claimed.
    InvalidMultipart,
    /// 408: the request body did not arrive within the store's
    /// [`body_timeout`](crate::Builder::body_timeout); nothing was claimed.
    RequestTimeout,
    /// 503: the handler ran past its `lock`; its work was rolled back and the key
    /// released, so a retry runs it again. Carries `Retry-After: 1`.
    LeaseExpired,
    /// 500: the handler's response is larger than the store keeps; its work was
    /// rolled back and the key released rather than leave a partial record.
    ResponseTooLarge,
    /// 500: the handler panicked or its response body failed; its work was rolled back.
    HandlerFailed,
    /// 500: the database ended the handler's transaction before idem could record
    /// its answer, and committed some of its writes (on MySQL and MariaDB: a
    /// statement that commits implicitly, such as DDL or `LOCK TABLES`, or a
    /// `COMMIT` the handler sent). The key keeps this answer for its `ttl` and the
    /// handler never runs again under it: what committed needs an operator to
    /// reconcile, never a second execution.
    TransactionEnded,
    /// 500: the response recorded under this key cannot be opened by this store
    /// (see [`Sealing`](crate::Sealing)): it is in plain text where the store
    /// seals, sealed where it does not, changed, copied from another key's row,
    /// or sealed under a key no longer in the ring. It is never replayed, and the
    /// key is not run again: an operator restores the key ring, or reads and
    /// forgets the key (`idem show`, `idem forget`). The log names the key id.
    RecordUnreadable,
    /// 500: the endpoint's [`Options`](crate::Options) are inconsistent (`lock` not
    /// shorter than `ttl`, or a `release_on` status outside 400–499): nothing was
    /// run or stored. The `#[idempotent]`
    /// attribute refuses such options at compile time; this catches options built
    /// by hand.
    InvalidOptions,
    /// 503: the database could not be reached or failed mid-request. Nothing was
    /// committed unless the failure struck the commit itself, and a retry finds
    /// either the stored response or a free key. Carries `Retry-After: 1`.
    StoreUnavailable,
    /// 503: the server is shutting down (see [`Shutdown`](crate::Shutdown)):
    /// nothing of the request was kept, and its retry, with the same key, finds the
    /// key free. Carries `Retry-After: 1`.
    ShuttingDown,
}

impl Problem {
    /// The HTTP status this problem is answered with.
    pub fn status(self) -> StatusCode {
        match self {
            Self::MissingKey | Self::InvalidKey | Self::InvalidJson | Self::InvalidMultipart => {
                StatusCode::BAD_REQUEST
            }
            Self::Unverified => StatusCode::UNAUTHORIZED,
            Self::InFlight => StatusCode::CONFLICT,
            Self::PayloadMismatch => StatusCode::UNPROCESSABLE_ENTITY,
            Self::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            Self::ResponseTooLarge
            | Self::HandlerFailed
            | Self::TransactionEnded
            | Self::RecordUnreadable
            | Self::InvalidOptions => StatusCode::INTERNAL_SERVER_ERROR,
            Self::LeaseExpired | Self::StoreUnavailable | Self::ShuttingDown => {
                StatusCode::SERVICE_UNAVAILABLE
            }
        }
    }

    /// The last segment of the problem `type` URI; stable across releases.
    pub fn slug(self) -> &'static str {
        match self {
            Self::MissingKey => "missing-key",
            Self::InvalidKey => "invalid-key",
            Self::Unverified => "unverified",
            Self::InFlight => "in-flight",
            Self::PayloadMismatch => "payload-mismatch",
            Self::PayloadTooLarge => "payload-too-large",
            Self::InvalidJson => "invalid-json",
            Self::InvalidMultipart => "invalid-multipart",
            Self::RequestTimeout => "request-timeout",
            Self::LeaseExpired => "lease-expired",
            Self::ResponseTooLarge => "response-too-large",
            Self::HandlerFailed => "handler-failed",
            Self::TransactionEnded => "transaction-ended",
            Self::RecordUnreadable => "record-unreadable",
            Self::InvalidOptions => "invalid-options",
            Self::StoreUnavailable => "store-unavailable",
            Self::ShuttingDown => "shutting-down",
        }
    }

    /// The short, human-readable summary sent as `title`.
    pub fn title(self) -> &'static str {
        match self {
            Self::MissingKey => "Idempotency-Key header required",
            Self::InvalidKey => "Invalid Idempotency-Key header",
            Self::Unverified => "Request's signature does not verify",
            Self::InFlight => "Request with this key is in flight",
            Self::PayloadMismatch => "Idempotency-Key reused with another request",
            Self::PayloadTooLarge => "Request body too large",
            Self::InvalidJson => "Request body is not JSON",
            Self::InvalidMultipart => "Request body is not the multipart body announced",
            Self::RequestTimeout => "Request body too slow",
            Self::LeaseExpired => "Request ran past its lock and was rolled back",
            Self::ResponseTooLarge => "Response too large to store",
            Self::HandlerFailed => "Request handler failed",
            Self::TransactionEnded => "Request's transaction ended before its answer was recorded",
            Self::RecordUnreadable => "Recorded response cannot be opened",
            Self::InvalidOptions => "Endpoint misconfigured",
            Self::StoreUnavailable => "Idempotency store unavailable",
            Self::ShuttingDown => "Server shutting down",
        }
    }

    /// Whether the answer carries `Retry-After: 1`.
    pub fn retry_after(self) -> bool {
        matches!(
            self,
            Self::InFlight | Self::LeaseExpired | Self::StoreUnavailable | Self::ShuttingDown
        )
    }

    /// Renders the problem+json response, with `type` = `base` + [`slug`](Self::slug),
    /// `Cache-Control: no-store` (no cache in between may answer a retry with it)
    /// and, where [`retry_after`](Self::retry_after), `Retry-After: 1`.
    ///
    /// # Examples
    ///
    /// ```
    /// # extern crate idem_runtime as idem_axum;
    /// use idem_axum::Problem;
    ///
    /// let response = Problem::MissingKey.to_response("https://api.example.com/problems/", "send one");
    /// assert_eq!(response.status(), 400);
    /// assert_eq!(response.headers()["content-type"], "application/problem+json");
    /// assert_eq!(response.headers()["cache-control"], "no-store");
    /// assert!(response.body().starts_with(br#"{"type":"https://api.example.com/problems/missing-key""#));
    /// ```
    pub fn to_response(self, base: &str, detail: &str) -> Response<Bytes> {
        self.to_response_with(base, detail, &[])
    }

    /// [`to_response`](Self::to_response) with extension members (RFC 9457 §3.2),
    /// string-valued, after the standard ones.
    pub(crate) fn to_response_with(
        self,
        base: &str,
        detail: &str,
        members: &[(&str, &str)],
    ) -> Response<Bytes> {
        let mut body = String::with_capacity(160 + detail.len());
        body.push_str("{\"type\":");
        json_string(&mut body, &[base, self.slug()]);
        body.push_str(",\"title\":");
        json_string(&mut body, &[self.title()]);
        let _ = write!(body, ",\"status\":{},\"detail\":", self.status().as_u16());
        json_string(&mut body, &[detail]);
        for (name, value) in members {
            body.push(',');
            json_string(&mut body, &[name]);
            body.push(':');
            json_string(&mut body, &[value]);
        }
        body.push('}');

        let mut response = Response::new(Bytes::from(body));
        *response.status_mut() = self.status();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        // A cache between client and server must not answer a retry with this
        // problem: the key's real answer comes later (a 409), or is the server's
        // alone to give (every other).
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if self.retry_after() {
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.title())
    }
}

/// Appends the concatenation of `parts` as one JSON string literal.
fn json_string(out: &mut String, parts: &[&str]) {
    out.push('"');
    for c in parts.iter().flat_map(|p| p.chars()) {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detail_is_escaped() {
        let response = Problem::InFlight.to_response("urn:x:", "a \"quoted\"\n\\ \u{1}");
        assert_eq!(
            response.body().as_ref(),
            br#"{"type":"urn:x:in-flight","title":"Request with this key is in flight","status":409,"detail":"a \"quoted\"\n\\ \u0001"}"#
        );
        assert_eq!(response.headers()["retry-after"], "1");
    }
}
