//! Webhook senders' signatures, checked over the body exactly as it arrived.
//!
//! A webhook's sender is known only once its signature verifies; a key claimed
//! before that can be taken by anyone who learns an event's id, with a body of
//! their own, and the sender's real delivery then finds the key used for another
//! payload. So a signature is checked before anything is claimed or replayed
//! (docs/contract.md §9).
//!
//! Two schemes are built in (feature `webhooks`), each as its senders' reference
//! libraries check it: [`StandardWebhooks`] (`webhook-id`, `webhook-timestamp`,
//! `webhook-signature`; Svix and many providers) and [`StripeSignature`]
//! (`Stripe-Signature`). Any other is an implementation of [`Verifier`].

use std::fmt;

use http::HeaderMap;

#[cfg(feature = "webhooks")]
mod schemes;
#[cfg(feature = "webhooks")]
#[cfg_attr(docsrs, doc(cfg(feature = "webhooks")))]
pub use schemes::{DEFAULT_TOLERANCE, InvalidSecret, StandardWebhooks, StripeSignature};

/// A sender's signature scheme: whether a delivery's body, as received, was
/// signed by the sender.
///
/// # Examples
///
/// GitHub's scheme, `X-Hub-Signature-256: sha256=<hex>`, the HMAC-SHA-256 of
/// the body under the hook's secret, compared in constant time (by `hmac`):
///
/// ```
/// # extern crate idem_runtime as idem_axum;
/// use hmac::{Hmac, KeyInit, Mac};
/// use http::HeaderMap;
/// use idem_axum::webhook::{Unverified, Verifier};
/// use sha2::Sha256;
///
/// struct GitHub(Hmac<Sha256>);
///
/// impl Verifier for GitHub {
///     fn verify(&self, headers: &HeaderMap, body: &[u8]) -> Result<(), Unverified> {
///         const HEADER: &str = "x-hub-signature-256";
///         let sent = headers.get(HEADER).ok_or(Unverified::Missing(HEADER))?;
///         let hex = sent
///             .to_str()
///             .ok()
///             .and_then(|value| value.strip_prefix("sha256="))
///             .filter(|hex| hex.len() == 64 && hex.is_ascii())
///             .ok_or(Unverified::Malformed(HEADER))?;
///         let tag: Vec<u8> = (0..64)
///             .step_by(2)
///             .map(|i| u8::from_str_radix(&hex[i..i + 2], 16))
///             .collect::<Result<_, _>>()
///             .map_err(|_| Unverified::Malformed(HEADER))?;
///         let mut mac = self.0.clone();
///         mac.update(body);
///         mac.verify_slice(&tag).map_err(|_| Unverified::Mismatch)
///     }
/// }
///
/// let github = GitHub(Hmac::new_from_slice(b"It's a Secret to Everybody")?);
/// let mut headers = HeaderMap::new();
/// headers.insert(
///     "x-hub-signature-256",
///     "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17".parse()?,
/// );
/// assert_eq!(github.verify(&headers, b"Hello, World!"), Ok(()));
/// assert_eq!(github.verify(&headers, b"Hello, World?"), Err(Unverified::Mismatch));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` does not check a webhook sender's signature",
    label = "not a `Verifier`",
    note = "`verify = …` names a type that implements `idem_axum::webhook::Verifier`, such as \
            `StandardWebhooks` or `StripeSignature` (feature `webhooks`), taken from the \
            router's state through `FromRef`"
)]
pub trait Verifier: Send + Sync {
    /// `Ok` when `body`, byte for byte as received, carries a valid signature
    /// in `headers`.
    ///
    /// # Errors
    ///
    /// Why the delivery is not taken for the sender's.
    fn verify(&self, headers: &HeaderMap, body: &[u8]) -> Result<(), Unverified>;
}

/// Why a delivery was not taken for the sender's.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unverified {
    /// A header the scheme needs is absent.
    Missing(&'static str),
    /// A header the scheme needs is not in the scheme's format, or is sent
    /// more than once.
    Malformed(&'static str),
    /// The signed timestamp is further from the receiver's clock than the
    /// tolerance: a delivery replayed later, or a clock far off.
    Stale {
        /// The timestamp's distance from now, negative when it is ahead.
        age_secs: i64,
    },
    /// No signature the delivery carries is the body's under the secret.
    Mismatch,
}

impl fmt::Display for Unverified {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Missing(header) => write!(f, "the {header} header is missing"),
            Self::Malformed(header) => write!(f, "the {header} header is malformed"),
            Self::Stale { age_secs } if *age_secs < 0 => write!(
                f,
                "the signed timestamp is {}s ahead of the receiver's clock",
                age_secs.unsigned_abs()
            ),
            Self::Stale { age_secs } => write!(f, "the signed timestamp is {age_secs}s old"),
            Self::Mismatch => f.write_str("no signature matches the body"),
        }
    }
}

impl std::error::Error for Unverified {}
