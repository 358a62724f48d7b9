//! The unkeyed fingerprint of a request's body.

use sha2::{Digest as _, Sha256};

/// SHA-256 of a request body: the fingerprint a key's later uses must match.
///
/// # Examples
///
/// ```
/// # extern crate idem_runtime as idem_axum;
/// let a = idem_axum::fingerprint(br#"{"amount":100}"#);
/// assert_ne!(a, idem_axum::fingerprint(br#"{"amount":200}"#));
/// ```
pub fn fingerprint(body: &[u8]) -> [u8; 32] {
    Sha256::digest(body).into()
}
