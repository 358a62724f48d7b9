//! Where an endpoint reads its requests' keys: the `Idempotency-Key` header, a
//! header of the sender's own, or a JSON Pointer into the body. A webhook's
//! sender sends no `Idempotency-Key`: its event's id is where the sender puts it.

use std::fmt;

use http::HeaderMap;

use crate::json::{InvalidJson, Pointed, is_pointer, pointed};
use crate::key::{IdempotencyKey, InvalidKey};

/// Where an endpoint reads the idempotency key of its requests.
///
/// Wherever it is read, a key is 1 to 255 printable ASCII characters, and a
/// request without one runs unkeyed unless the endpoint requires it.
///
/// # Examples
///
/// ```
/// # extern crate idem_runtime as idem_axum;
/// use http::HeaderMap;
/// use idem_axum::KeySource;
///
/// // Standard Webhooks senders (Svix and others) put the event's id in `webhook-id`.
/// let header = KeySource::header("webhook-id")?;
/// let mut headers = HeaderMap::new();
/// headers.insert("webhook-id", "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W".parse()?);
/// let key = header.read(&headers, b"{}")?.expect("a key");
/// assert_eq!(key.as_str(), "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W");
///
/// // Stripe puts it in the event's body.
/// let body = KeySource::json("/id")?;
/// let event = br#"{"id": "evt_1", "type": "charge.refunded"}"#;
/// assert_eq!(body.read(&HeaderMap::new(), event)?.expect("a key").as_str(), "evt_1");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct KeySource(Where);

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
enum Where {
    #[default]
    IdempotencyKey,
    Header(&'static str),
    Json(&'static str),
}

impl KeySource {
    /// The `Idempotency-Key` header: the default.
    pub const IDEMPOTENCY_KEY: Self = Self(Where::IdempotencyKey);

    /// A header of the sender's own (`webhook-id`, `x-github-delivery`,
    /// `x-shopify-webhook-id`), its value read as `Idempotency-Key`'s is: bare or
    /// quoted, sent once.
    ///
    /// # Errors
    ///
    /// [`InvalidSource`] unless `name` is a header name in lowercase (as HTTP/2
    /// sends them, and as `http` stores them).
    pub fn header(name: &'static str) -> Result<Self, InvalidSource> {
        let token =
            |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b"!#$%&'*+-.^_`|~".contains(&b);
        if name.is_empty() || !name.bytes().all(token) {
            return Err(InvalidSource::Header(name));
        }
        Ok(Self(Where::Header(name)))
    }

    /// The string a JSON Pointer (RFC 6901) names in the body (`/id` for a
    /// Stripe event, `/data/object/id` for what it is about), or a number, in
    /// the canonical form the JSON fingerprint writes it (`1.0` reads as `1`).
    /// A body that is not JSON is refused; `null` or nothing there is no key.
    ///
    /// # Errors
    ///
    /// [`InvalidSource`] unless `pointer` is a JSON Pointer into the document
    /// (it starts with `/`, and `~` comes only as `~0` or `~1`).
    pub fn json(pointer: &'static str) -> Result<Self, InvalidSource> {
        if !is_pointer(pointer) {
            return Err(InvalidSource::Pointer(pointer));
        }
        Ok(Self(Where::Json(pointer)))
    }

    /// What `#[idempotent(key = header(..))]` writes, the name checked and set in
    /// lowercase at compile time.
    #[doc(hidden)]
    pub const fn __header(name: &'static str) -> Self {
        Self(Where::Header(name))
    }

    /// What `#[idempotent(key = json(..))]` writes, the pointer checked at
    /// compile time.
    #[doc(hidden)]
    pub const fn __json(pointer: &'static str) -> Self {
        Self(Where::Json(pointer))
    }

    /// The header this source reads, if it reads one.
    pub fn header_name(self) -> Option<&'static str> {
        match self.0 {
            Where::IdempotencyKey => Some("idempotency-key"),
            Where::Header(name) => Some(name),
            Where::Json(_) => None,
        }
    }

    /// The JSON Pointer this source reads, if it reads the body.
    pub fn pointer(self) -> Option<&'static str> {
        match self.0 {
            Where::Json(pointer) => Some(pointer),
            _ => None,
        }
    }

    /// The request's key, read here; `None` when the request has none there.
    ///
    /// # Errors
    ///
    /// [`UnreadKey`] when something is there but is not a key, or, for a JSON
    /// Pointer, the body is not JSON.
    pub fn read(
        self,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Result<Option<IdempotencyKey>, UnreadKey> {
        let invalid = |invalid| UnreadKey::Invalid {
            source: self,
            invalid,
        };
        match self.0 {
            Where::IdempotencyKey => IdempotencyKey::from_headers(headers).map_err(invalid),
            Where::Header(name) => IdempotencyKey::from_header(headers, name).map_err(invalid),
            Where::Json(pointer) => match pointed(body, pointer).map_err(UnreadKey::NotJson)? {
                Pointed::Key(text) => IdempotencyKey::from_id(&text).map(Some).map_err(invalid),
                Pointed::Absent => Ok(None),
                Pointed::Other(found) => Err(UnreadKey::NotAKey { pointer, found }),
            },
        }
    }
}

impl fmt::Display for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Where::IdempotencyKey => f.write_str("the Idempotency-Key header"),
            Where::Header(name) => write!(f, "the {name} header"),
            Where::Json(pointer) => write!(f, "the body's {pointer}"),
        }
    }
}

/// A key source that cannot work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum InvalidSource {
    /// Not a header name in lowercase.
    Header(&'static str),
    /// Not a JSON Pointer into the document.
    Pointer(&'static str),
}

impl fmt::Display for InvalidSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Header(name) => write!(
                f,
                "`{name}` is not a header name in lowercase (letters, digits and !#$%&'*+-.^_`|~)"
            ),
            Self::Pointer(pointer) => write!(
                f,
                "`{pointer}` is not a JSON Pointer into the body: it starts with `/`, and `~` comes only as `~0` or `~1`"
            ),
        }
    }
}

impl std::error::Error for InvalidSource {}

/// A key that could not be read where the endpoint reads it: answered 400
/// (`invalid-json` for a body that is not JSON, else `invalid-key`), with
/// nothing claimed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum UnreadKey {
    /// What is there is not a valid key.
    Invalid {
        /// Where it was read.
        source: KeySource,
        /// What is wrong with it.
        invalid: InvalidKey,
    },
    /// The key is read from the body's JSON, and the body is not JSON.
    NotJson(InvalidJson),
    /// The JSON Pointer names a value that is not a string or a number.
    NotAKey {
        /// The pointer.
        pointer: &'static str,
        /// What it names: `an object`, `an array` or `a boolean`.
        found: &'static str,
    },
}

impl fmt::Display for UnreadKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Invalid {
                source,
                invalid: InvalidKey::Repeated,
            } => write!(f, "{source} must be sent exactly once"),
            Self::Invalid {
                source,
                invalid: InvalidKey::Empty,
            } => write!(f, "the key in {source} is empty"),
            Self::Invalid {
                source,
                invalid: InvalidKey::TooLong,
            } => write!(f, "the key in {source} is longer than 255 characters"),
            Self::Invalid {
                source,
                invalid: InvalidKey::BadQuoting,
            } => write!(f, "the key in {source} is not a valid quoted string"),
            Self::Invalid { source, .. } => write!(
                f,
                "the key in {source} holds a character outside printable ASCII (or, bare in a header, a space or comma)"
            ),
            Self::NotJson(invalid) => write!(f, "the key is read from the body's JSON: {invalid}"),
            Self::NotAKey { pointer, found } => write!(
                f,
                "the body's {pointer} is {found}, not a string or a number to key the request by"
            ),
        }
    }
}

impl std::error::Error for UnreadKey {}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(*name, value.parse().expect("value"));
        }
        headers
    }

    fn key(source: KeySource, headers: &HeaderMap, body: &[u8]) -> Option<String> {
        let read = source.read(headers, body).expect("a key or none");
        read.map(|key| key.as_str().to_owned())
    }

    #[test]
    fn a_header_of_the_senders_own() {
        let source = KeySource::header("webhook-id").expect("source");
        let sent = headers(&[("webhook-id", "msg_1"), ("idempotency-key", "other")]);
        assert_eq!(key(source, &sent, b""), Some("msg_1".to_owned()));
        assert_eq!(
            key(source, &headers(&[("webhook-id", "\"msg 2\"")]), b""),
            Some("msg 2".to_owned())
        );
        assert_eq!(
            key(source, &headers(&[("idempotency-key", "k")]), b""),
            None
        );
        let twice = headers(&[("webhook-id", "a"), ("webhook-id", "b")]);
        let refused = source.read(&twice, b"").expect_err("twice");
        assert_eq!(
            refused.to_string(),
            "the webhook-id header must be sent exactly once"
        );
        let long = "k".repeat(256);
        let refused = source
            .read(&headers(&[("webhook-id", &long)]), b"")
            .expect_err("too long");
        assert_eq!(
            refused.to_string(),
            "the key in the webhook-id header is longer than 255 characters"
        );
        assert!(
            source
                .read(&headers(&[("webhook-id", "a b")]), b"")
                .is_err()
        );
        // The default reads Idempotency-Key alone.
        let default = KeySource::default();
        assert_eq!(default, KeySource::IDEMPOTENCY_KEY);
        assert_eq!(key(default, &sent, b""), Some("other".to_owned()));
    }

    #[test]
    fn a_pointer_into_the_body() {
        let source = KeySource::json("/id").expect("source");
        let none = HeaderMap::new();
        let event = br#"{"type": "charge.refunded", "id": "evt_1"}"#;
        assert_eq!(key(source, &none, event), Some("evt_1".to_owned()));
        let nested = KeySource::json("/data/object/id").expect("source");
        let body = br#"{"data": {"object": {"id": 42.0}}}"#;
        assert_eq!(key(nested, &none, body), Some("42".to_owned()));
        let escaped = KeySource::json("/a~1b/~0c/1").expect("source");
        let body = br#"{"a/b": {"~c": ["x", "y"]}}"#;
        assert_eq!(key(escaped, &none, body), Some("y".to_owned()));
        // Nothing there, or null: no key.
        assert_eq!(key(source, &none, br#"{"type": "x"}"#), None);
        assert_eq!(key(source, &none, br#"{"id": null}"#), None);
        assert_eq!(key(source, &none, b"[1]"), None);
        // Refused: not JSON, not a key, not a valid key.
        assert!(matches!(
            source.read(&none, b"id=evt_1"),
            Err(UnreadKey::NotJson(_))
        ));
        let refused = source
            .read(&none, br#"{"id": {"v": 1}}"#)
            .expect_err("object");
        assert_eq!(
            refused.to_string(),
            "the body's /id is an object, not a string or a number to key the request by"
        );
        let refused = source.read(&none, br#"{"id": ""}"#).expect_err("empty");
        assert_eq!(refused.to_string(), "the key in the body's /id is empty");
        assert!(source.read(&none, br#"{"id": "caf\u00e9"}"#).is_err());
        // A body key is not read from the headers.
        let sent = headers(&[("idempotency-key", "k")]);
        assert_eq!(key(source, &sent, b"{}"), None);
    }

    #[test]
    fn sources_that_cannot_work() {
        for bad in ["", "Webhook-Id", "webhook id", "webhook:id", "é"] {
            assert_eq!(KeySource::header(bad), Err(InvalidSource::Header(bad)));
        }
        for bad in ["", "id", "/a~2", "/a~"] {
            assert_eq!(KeySource::json(bad), Err(InvalidSource::Pointer(bad)));
        }
        let source = KeySource::json("/id").expect("source");
        assert_eq!(
            (source.pointer(), source.header_name()),
            (Some("/id"), None)
        );
        let source = KeySource::header("x-github-delivery").expect("source");
        assert_eq!(source.header_name(), Some("x-github-delivery"));
    }
}
