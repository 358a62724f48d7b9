//! The `Idempotency-Key` request header (`docs/contract.md` §2) and key relay (§5).

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use http::HeaderMap;
use http::header::HeaderName;
use sha2::{Digest, Sha256};

/// The request header that carries the key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// Longest key accepted, in characters after unquoting.
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key, as sent by the client.
///
/// Both forms in use are accepted: the Structured Field string of the IETF draft
/// (`Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"`) and the bare form
/// Stripe-style clients send (`Idempotency-Key: 8e03978e-40d5-43e8-bc93-6894a57f9324`).
/// After unquoting, a key is 1 to 255 printable ASCII characters.
///
/// Inside a handler the key is what to relay to downstream providers;
/// [`derive`](Self::derive) gives stable sub-keys when one request makes several
/// downstream calls.
///
/// # Examples
///
/// ```
/// # extern crate idem_runtime as idem_axum;
/// use http::HeaderMap;
/// use idem_axum::IdempotencyKey;
///
/// let mut headers = HeaderMap::new();
/// headers.insert("idempotency-key", "\"order-42\"".parse().unwrap());
/// let key = IdempotencyKey::from_headers(&headers).unwrap().unwrap();
/// assert_eq!(key.as_str(), "order-42");
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey {
    value: Arc<str>,
    scope: Option<Arc<str>>,
}

impl IdempotencyKey {
    /// Reads the key from request headers.
    ///
    /// Returns `Ok(None)` when the header is absent.
    ///
    /// # Errors
    ///
    /// [`InvalidKey`] (answered with 400 `invalid-key`) when the header appears more
    /// than once, or its value is empty, longer than 255 characters, holds control
    /// or non-ASCII characters, or is a malformed quoted string.
    pub fn from_headers(headers: &HeaderMap) -> Result<Option<Self>, InvalidKey> {
        Self::from_header(headers, IDEMPOTENCY_KEY.as_str())
    }

    /// The key in header `name`, read as `Idempotency-Key` is: sent once, bare
    /// or quoted.
    pub(crate) fn from_header(headers: &HeaderMap, name: &str) -> Result<Option<Self>, InvalidKey> {
        let mut values = headers.get_all(name).iter();
        let Some(value) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(InvalidKey::Repeated);
        }
        Self::parse(value.as_bytes()).map(Some)
    }

    /// Parses one header value, quoted or bare.
    ///
    /// # Errors
    ///
    /// [`InvalidKey`] as for [`from_headers`](Self::from_headers).
    ///
    /// # Examples
    ///
    /// ```
    /// # extern crate idem_runtime as idem_axum;
    /// use idem_axum::{IdempotencyKey, InvalidKey};
    ///
    /// assert_eq!(IdempotencyKey::parse(b"abc").unwrap().as_str(), "abc");
    /// assert_eq!(IdempotencyKey::parse(br#""a \"b\"""#).unwrap().as_str(), r#"a "b""#);
    /// assert_eq!(IdempotencyKey::parse(b"").unwrap_err(), InvalidKey::Empty);
    /// ```
    pub fn parse(raw: &[u8]) -> Result<Self, InvalidKey> {
        let raw = trim_ows(raw);
        let value = match raw.first() {
            None => return Err(InvalidKey::Empty),
            Some(b'"') => unquote(raw)?,
            Some(_) => Cow::Borrowed(bare(raw)?),
        };
        if value.is_empty() {
            return Err(InvalidKey::Empty);
        }
        if value.len() > MAX_KEY_LEN {
            return Err(InvalidKey::TooLong);
        }
        Ok(Self {
            value: Arc::from(&*value),
            scope: None,
        })
    }

    /// A message's id as the key, exactly as it is: never trimmed nor
    /// unquoted, so that two ids differing only there stay two keys. 1 to 255
    /// printable ASCII characters, spaces included.
    ///
    /// # Errors
    ///
    /// [`InvalidKey::Empty`], [`InvalidKey::TooLong`] or
    /// [`InvalidKey::BadCharacter`] (a control or non-ASCII character).
    ///
    /// # Examples
    ///
    /// ```
    /// # extern crate idem_runtime as idem_axum;
    /// use idem_axum::{IdempotencyKey, InvalidKey};
    ///
    /// assert_eq!(IdempotencyKey::from_id("\"evt 1\"").unwrap().as_str(), "\"evt 1\"");
    /// assert_eq!(IdempotencyKey::from_id("").unwrap_err(), InvalidKey::Empty);
    /// ```
    pub fn from_id(id: &str) -> Result<Self, InvalidKey> {
        if id.is_empty() {
            return Err(InvalidKey::Empty);
        }
        if id.len() > MAX_KEY_LEN {
            return Err(InvalidKey::TooLong);
        }
        if !id.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
            return Err(InvalidKey::BadCharacter);
        }
        Ok(Self {
            value: Arc::from(id),
            scope: None,
        })
    }

    /// The key as the client sent it, unquoted.
    pub fn as_str(&self) -> &str {
        &self.value
    }

    /// The scope the key was used under, once the request has been scoped.
    pub fn scope(&self) -> Option<&str> {
        self.scope.as_deref()
    }

    /// Returns this key bound to `scope`, which [`derive`](Self::derive) then mixes in.
    #[must_use]
    pub fn with_scope(self, scope: &str) -> Self {
        self.with_shared_scope(scope.into())
    }

    pub(crate) fn with_shared_scope(mut self, scope: Arc<str>) -> Self {
        self.scope = Some(scope);
        self
    }

    /// A stable sub-key for one downstream call, e.g. `key.derive("charge")`.
    ///
    /// The result is 64 lowercase hex characters, the same for the same scope, key
    /// and label on every retry and every instance, and different across scopes: two
    /// tenants who happen to send the same key never share a downstream key.
    ///
    /// # Examples
    ///
    /// ```
    /// # extern crate idem_runtime as idem_axum;
    /// use idem_axum::IdempotencyKey;
    ///
    /// let alice = IdempotencyKey::parse(b"k1").unwrap().with_scope("alice");
    /// let bob = IdempotencyKey::parse(b"k1").unwrap().with_scope("bob");
    /// assert_eq!(alice.derive("charge"), alice.derive("charge"));
    /// assert_ne!(alice.derive("charge"), alice.derive("refund"));
    /// assert_ne!(alice.derive("charge"), bob.derive("charge"));
    /// ```
    pub fn derive(&self, label: &str) -> String {
        let mut hash = Sha256::new();
        // Length prefixes keep ("a:b", "c") and ("a", "b:c") apart.
        for part in [self.scope.as_deref().unwrap_or(""), &self.value, label] {
            hash.update((part.len() as u64).to_be_bytes());
            hash.update(part.as_bytes());
        }
        to_hex(&hash.finalize())
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdempotencyKey").field(&self.value).finish()
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.value)
    }
}

/// Why an `Idempotency-Key` header was refused; answered with 400 `invalid-key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum InvalidKey {
    /// The header was sent more than once (or folded into a comma-separated list).
    Repeated,
    /// The key is empty.
    Empty,
    /// The key is longer than 255 characters.
    TooLong,
    /// The key holds a control, non-ASCII or (bare form) separator character.
    BadCharacter,
    /// A quoted key is not a valid Structured Field string.
    BadQuoting,
}

impl fmt::Display for InvalidKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Repeated => "the Idempotency-Key header must be sent exactly once",
            Self::Empty => "the Idempotency-Key header is empty",
            Self::TooLong => "the Idempotency-Key is longer than 255 characters",
            Self::BadCharacter => {
                "the Idempotency-Key holds a character outside printable ASCII (or a bare key holds a space or comma)"
            }
            Self::BadQuoting => "the Idempotency-Key is not a valid quoted string",
        })
    }
}

impl std::error::Error for InvalidKey {}

fn trim_ows(mut raw: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = raw {
        raw = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = raw {
        raw = rest;
    }
    raw
}

/// The bare form: visible ASCII without spaces or commas, since a comma is what
/// two folded headers look like.
fn bare(raw: &[u8]) -> Result<&str, InvalidKey> {
    match std::str::from_utf8(raw) {
        Ok(text) if raw.iter().all(|&b| b.is_ascii_graphic() && b != b',') => Ok(text),
        _ => Err(InvalidKey::BadCharacter),
    }
}

/// An RFC 8941 sf-string: `"` chars `"`, where `\` escapes only `"` and `\`.
fn unquote(raw: &[u8]) -> Result<Cow<'_, str>, InvalidKey> {
    // Without escapes the key is the text between the quotes, as it stands.
    if let [b'"', inner @ .., b'"'] = raw
        && inner
            .iter()
            .all(|&b| (0x20..=0x7e).contains(&b) && b != b'"' && b != b'\\')
        && let Ok(text) = std::str::from_utf8(inner)
    {
        return Ok(Cow::Borrowed(text));
    }
    let mut out = String::with_capacity(raw.len());
    let mut bytes = raw.iter().skip(1);
    loop {
        match bytes.next() {
            None => return Err(InvalidKey::BadQuoting),
            Some(b'"') => break,
            Some(b'\\') => match bytes.next() {
                Some(&b @ (b'"' | b'\\')) => out.push(char::from(b)),
                _ => return Err(InvalidKey::BadQuoting),
            },
            Some(&b) if (0x20..=0x7e).contains(&b) => out.push(char::from(b)),
            Some(_) => return Err(InvalidKey::BadCharacter),
        }
    }
    if bytes.next().is_some() {
        // Anything after the closing quote: parameters or a folded second header.
        return Err(InvalidKey::BadQuoting);
    }
    Ok(Cow::Owned(out))
}

pub(crate) fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn parse(raw: &[u8]) -> Result<String, InvalidKey> {
        IdempotencyKey::parse(raw).map(|k| k.as_str().to_owned())
    }

    #[test]
    fn accepts_bare_and_quoted_forms() {
        assert_eq!(parse(b"8e03-24").as_deref(), Ok("8e03-24"));
        assert_eq!(parse(b"\"8e03-24\"").as_deref(), Ok("8e03-24"));
        assert_eq!(parse(b"  padded\t").as_deref(), Ok("padded"));
        assert_eq!(
            parse(b"\"with space, comma\"").as_deref(),
            Ok("with space, comma")
        );
        assert_eq!(parse(br#""esc \\ \"""#).as_deref(), Ok(r#"esc \ ""#));
        assert_eq!(
            parse(b"'; DROP TABLE x; --").unwrap_err(),
            InvalidKey::BadCharacter
        );
        assert_eq!(parse(b"';DROP--").as_deref(), Ok("';DROP--"));
    }

    #[test]
    fn enforces_length_bounds() {
        assert_eq!(parse(b""), Err(InvalidKey::Empty));
        assert_eq!(parse(b"   "), Err(InvalidKey::Empty));
        assert_eq!(parse(b"\"\""), Err(InvalidKey::Empty));
        assert_eq!(parse(&[b'k'; 255]).map(|k| k.len()), Ok(255));
        assert_eq!(parse(&[b'k'; 256]), Err(InvalidKey::TooLong));
        let mut quoted = vec![b'"'];
        quoted.extend([b'k'; 255]);
        quoted.push(b'"');
        assert_eq!(parse(&quoted).map(|k| k.len()), Ok(255));
    }

    #[test]
    fn rejects_bad_characters_and_quoting() {
        assert_eq!(parse(b"a\x01b"), Err(InvalidKey::BadCharacter));
        assert_eq!(parse("cl\u{e9}".as_bytes()), Err(InvalidKey::BadCharacter));
        assert_eq!(parse(b"a b"), Err(InvalidKey::BadCharacter));
        assert_eq!(parse(b"a,b"), Err(InvalidKey::BadCharacter));
        assert_eq!(parse(b"\"a\x7fb\""), Err(InvalidKey::BadCharacter));
        assert_eq!(parse(b"\"open"), Err(InvalidKey::BadQuoting));
        assert_eq!(parse(b"\"a\", \"b\""), Err(InvalidKey::BadQuoting));
        assert_eq!(parse(b"\"a\";p=1"), Err(InvalidKey::BadQuoting));
        assert_eq!(parse(br#""bad \x""#), Err(InvalidKey::BadQuoting));
        // Quoted at both ends, yet the last quote is escaped.
        assert_eq!(parse(br#""a\""#), Err(InvalidKey::BadQuoting));
        assert_eq!(parse(br#""\""#), Err(InvalidKey::BadQuoting));
    }

    #[test]
    fn header_must_appear_once() {
        let mut headers = HeaderMap::new();
        assert_eq!(IdempotencyKey::from_headers(&headers), Ok(None));
        headers.append(IDEMPOTENCY_KEY, HeaderValue::from_static("a"));
        assert!(IdempotencyKey::from_headers(&headers).is_ok_and(|k| k.is_some()));
        headers.append(IDEMPOTENCY_KEY, HeaderValue::from_static("a"));
        assert_eq!(
            IdempotencyKey::from_headers(&headers),
            Err(InvalidKey::Repeated)
        );
    }

    #[test]
    fn derived_keys_do_not_collide_across_boundaries() {
        let a = IdempotencyKey::parse(b"b:c").unwrap().with_scope("a");
        let b = IdempotencyKey::parse(b"c").unwrap().with_scope("a:b");
        assert_ne!(a.derive("x"), b.derive("x"));
        assert_eq!(a.derive("x").len(), 64);
    }
}
