//! The stored form of a response: status, the headers worth replaying, raw body bytes.

use bytes::Bytes;
use http::header::{self, HeaderName};
use http::{HeaderMap, HeaderValue, Response, StatusCode};

/// Marks a response that was replayed from the store rather than executed.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// On endpoints with [`Options::ttl_header`](crate::Options::ttl_header): how many
/// seconds the key is kept, counted from its first request. Stored with the response.
pub const IDEMPOTENCY_KEY_TTL: HeaderName = HeaderName::from_static("idempotency-key-ttl");

/// Headers that describe one connection or one moment, not the result: never stored.
fn is_stored(name: &HeaderName) -> bool {
    !matches!(
        *name,
        header::SET_COOKIE
            | header::DATE
            | header::CONNECTION
            | header::TRANSFER_ENCODING
            | header::UPGRADE
            | header::TE
            | header::TRAILER
            | header::CONTENT_LENGTH
    ) && name != "keep-alive"
        && name != "proxy-connection"
        && name != IDEMPOTENT_REPLAYED
}

/// Encodes the headers to keep as `name: value\r\n` lines. Values may hold
/// obs-text bytes, so the column is binary; names and values never hold CR or LF.
pub(crate) fn encode_headers(headers: &HeaderMap) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in headers {
        if is_stored(name) {
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
    }
    out
}

/// Rebuilds a replay. Lines that fail to parse are skipped: they can only come
/// from a row edited by hand.
pub(crate) fn replay(status: i32, headers: &[u8], body: Bytes) -> Response<Bytes> {
    let mut response = Response::new(body);
    *response.status_mut() = u16::try_from(status)
        .ok()
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let map = response.headers_mut();
    for line in headers.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(colon) = line.windows(2).position(|w| w == b": ") else {
            continue;
        };
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(&line[..colon]),
            HeaderValue::from_bytes(&line[colon + 2..]),
        ) {
            map.append(name, value);
        }
    }
    map.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_kept_headers_in_order() {
        let mut headers = HeaderMap::new();
        headers.append("content-type", HeaderValue::from_static("application/json"));
        headers.append("set-cookie", HeaderValue::from_static("session=1"));
        headers.append("x-multi", HeaderValue::from_static("one"));
        headers.append(
            "date",
            HeaderValue::from_static("Mon, 30 Nov 2026 10:00:00 GMT"),
        );
        headers.append("x-multi", HeaderValue::from_static("two"));
        headers.append("x-bytes", HeaderValue::from_bytes(b"caf\xe9: ok").unwrap());
        headers.append("connection", HeaderValue::from_static("close"));

        let encoded = encode_headers(&headers);
        let response = replay(201, &encoded, Bytes::from_static(b"{\"b\":1,\"a\":2}"));
        assert_eq!(response.status(), 201);
        assert_eq!(response.body().as_ref(), b"{\"b\":1,\"a\":2}");
        let got: Vec<_> = response
            .headers()
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_bytes()))
            .collect();
        assert_eq!(
            got,
            [
                ("content-type", &b"application/json"[..]),
                ("x-multi", b"one"),
                ("x-multi", b"two"),
                ("x-bytes", b"caf\xe9: ok"),
                ("idempotent-replayed", b"true"),
            ]
        );
    }
}
