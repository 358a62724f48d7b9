//! Recorded responses sealed at rest, and fingerprints keyed: the key ring.
//!
//! Every key of a ring is expanded with HKDF-SHA-256 into three values that
//! never serve two purposes: its id (8 bytes, stored beside what it sealed, so a
//! record names the key that opens it; it tells nothing of the key, but two
//! deployments that share a key share its id), the XChaCha20-Poly1305 key that
//! seals responses, and the HMAC-SHA-256 key that keys fingerprints.
//! XChaCha20-Poly1305 rather than AES-256-GCM: its 192-bit nonce may be drawn at
//! random for every record with no bound worth counting, where AES-GCM's 96-bit
//! random nonces allow about 2^32 records per key.
//!
//! A sealed record is `version ‖ key id ‖ nonce ‖ ciphertext ‖ tag`, over
//! `status ‖ body digest ‖ headers' length ‖ headers ‖ body`. The request body's
//! digest rides inside, never in the clear, so that a record re-sealed under a
//! new key gets its fingerprint keyed anew: once every record is, the old key
//! can leave the ring. Its associated data is the
//! version, the key id, the row's identity (scope, key, method, path, content
//! type and stored fingerprint) and the context the application names for the
//! ring (`KeyRing::with_context`), each length-prefixed, so a row copied to
//! another scope, key, table or environment, or given another request's
//! fingerprint, does not open. Version 1, what a ring without a context seals
//! (and all that earlier releases sealed), has none, and opens under any.
//!
//! A keyed fingerprint is the key's id and HMAC-SHA-256 of the request's scope
//! and key and its unkeyed digest (SHA-256 of the body, or of its canonical
//! form), cut to 24 bytes: a retry matches under an older key from the digest
//! alone, the unkeyed digest is never stored, and equal bodies of two keys or
//! tenants are stored apart. Earlier releases keyed the digest alone; those
//! fingerprints still match.

use std::fmt;

use chacha20poly1305::aead::AeadInOut as _;
use chacha20poly1305::{KeyInit as _, Tag, XChaCha20Poly1305, XNonce};
use hmac::{Hmac, Mac as _};
use sha2::Sha256;
use zeroize::Zeroizing;

/// The first byte of every sealed record: the envelope's format. Version 2's
/// associated data holds the ring's context; version 1's holds none: what a
/// ring without a context seals, and what earlier releases sealed. A version 1
/// record opens under any context.
const VERSION: u8 = 2;
const VERSION_1: u8 = 1;
const ID_LEN: usize = 8;
const NONCE_LEN: usize = 24;
const TAG_LEN: usize = 16;
const HEAD_LEN: usize = 1 + ID_LEN + NONCE_LEN;
/// Status, body digest and headers' length, before the headers.
const PLAIN_HEAD_LEN: usize = 2 + 32 + 4;
/// HKDF's salts: the ring's keys are used by idem alone, and a raw key and a
/// secret of the same bytes are two keys.
const KEY_SALT: &[u8] = b"idem key ring v1: key";
const SECRET_SALT: &[u8] = b"idem key ring v1: secret";

/// The id of a key of a ring: derived from the key, stored beside the records
/// it sealed and the fingerprints it keyed.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyId([u8; ID_LEN]);

impl KeyId {
    /// The id as stored: 8 bytes.
    pub fn as_bytes(&self) -> &[u8; ID_LEN] {
        &self.0
    }
}

impl From<[u8; ID_LEN]> for KeyId {
    fn from(bytes: [u8; ID_LEN]) -> Self {
        Self(bytes)
    }
}

impl TryFrom<&[u8]> for KeyId {
    type Error = std::array::TryFromSliceError;

    fn try_from(bytes: &[u8]) -> Result<Self, Self::Error> {
        bytes.try_into().map(Self)
    }
}

impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for byte in self.0 {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyId({self})")
    }
}

/// One key of a ring, expanded. The cipher and the HMAC state clear their keys
/// when dropped (the crates' `zeroize` features).
struct RingKey {
    id: KeyId,
    cipher: XChaCha20Poly1305,
    fingerprints: Hmac<Sha256>,
}

impl RingKey {
    fn derive(salt: &[u8], material: &[u8]) -> Self {
        let hkdf = hkdf::Hkdf::<Sha256>::new(Some(salt), material);
        let mut id = [0; ID_LEN];
        let mut seal = Zeroizing::new([0; 32]);
        let mut fingerprint = Zeroizing::new([0; 32]);
        for (info, out) in [
            (&b"key id"[..], &mut id[..]),
            (b"response sealing", &mut seal[..]),
            (b"fingerprint keying", &mut fingerprint[..]),
        ] {
            hkdf.expand(info, out)
                .unwrap_or_else(|_| unreachable!("HKDF expands up to 8160 bytes"));
        }
        Self {
            id: KeyId(id),
            cipher: XChaCha20Poly1305::new_from_slice(&seal[..])
                .unwrap_or_else(|_| unreachable!("the key is 32 bytes")),
            fingerprints: <Hmac<Sha256>>::new_from_slice(&fingerprint[..])
                .unwrap_or_else(|_| unreachable!("HMAC takes a key of any length")),
        }
    }
}

/// The keys that seal recorded responses and key fingerprints: the first seals
/// and keys what is written now, every one opens and matches what it wrote
/// before.
///
/// A rotation across instances that restart one by one takes two steps, so that
/// no instance meets a record sealed under a key it does not hold: add the new
/// key last (`OLD,NEW`: it opens and matches, `OLD` still seals) on every
/// instance, then promote it (`NEW,OLD`), then, once `reseal` has caught up,
/// remove `OLD` (`docs/runbook.md`, "Rotating the sealing key").
///
/// Keys come from the application (a secret store, the environment): raw
/// 32-byte keys from a cryptographic generator, in bytes or in base64. A ring
/// never prints its keys, only their ids.
///
/// ```
/// # extern crate idem_runtime as idem_axum;
/// use idem_axum::KeyRing;
///
/// // Example keys only: make your own with `openssl rand -base64 32`.
/// // The sealing key first, separated by commas.
/// let ring = KeyRing::from_base64(
///     "3q2+7wAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=,AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyA=",
/// )?;
/// assert_eq!(ring.len(), 2);
/// assert!(KeyRing::from_base64("").is_err());
/// # Ok::<(), idem_axum::KeyRingError>(())
/// ```
pub struct KeyRing {
    keys: Vec<RingKey>,
    /// What the application names the records' home (`with_context`).
    context: Box<str>,
}

impl fmt::Debug for KeyRing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ids: Vec<KeyId> = self.ids().collect();
        f.debug_struct("KeyRing")
            .field("ids", &ids)
            .field("context", &self.context)
            .finish()
    }
}

/// Why a key ring was refused. Its message names the key by its place in the
/// list, never by its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRingError {
    message: String,
}

impl KeyRingError {
    fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
        }
    }
}

impl fmt::Display for KeyRingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "key ring refused: {}", self.message)
    }
}

impl std::error::Error for KeyRingError {}

impl KeyRing {
    /// A ring of raw 32-byte keys, the sealing key first.
    ///
    /// # Errors
    /// An empty list, or a key given twice.
    pub fn from_keys<'k>(
        keys: impl IntoIterator<Item = &'k [u8; 32]>,
    ) -> Result<Self, KeyRingError> {
        Self::build(keys.into_iter().map(|key| RingKey::derive(KEY_SALT, key)))
    }

    /// A ring of secrets that a secret store hands out as text, the sealing one first,
    /// each expanded with HKDF-SHA-256. HKDF does not slow down guessing: a
    /// secret must hold at least 256 bits of randomness (not a passphrase), and
    /// the same bytes given to [`KeyRing::from_keys`] are another key.
    ///
    /// # Errors
    /// An empty list, a secret shorter than 32 bytes, one that begins or ends
    /// with whitespace (a stray newline from a file changes the key), or a
    /// secret given twice.
    pub fn from_secrets<'s>(
        secrets: impl IntoIterator<Item = &'s str>,
    ) -> Result<Self, KeyRingError> {
        let secrets: Vec<&str> = secrets.into_iter().collect();
        for (n, secret) in secrets.iter().enumerate() {
            if secret.trim() != *secret {
                return Err(KeyRingError::new(format!(
                    "secret {} begins or ends with whitespace",
                    n + 1
                )));
            }
            if secret.len() < 32 {
                return Err(KeyRingError::new(format!(
                    "secret {} is shorter than 32 bytes",
                    n + 1
                )));
            }
        }
        Self::build(
            secrets
                .into_iter()
                .map(|secret| RingKey::derive(SECRET_SALT, secret.as_bytes())),
        )
    }

    /// A ring from its text form: raw 32-byte keys in standard base64 (with its
    /// padding), separated by commas, the sealing key first, nothing else (no spaces, no
    /// newline), as `PAYMENTS_SEAL_KEYS` holds it.
    ///
    /// # Errors
    /// Nothing, an empty entry, whitespace, anything that is not standard
    /// base64 of exactly 32 bytes, or a key given twice.
    pub fn from_base64(text: &str) -> Result<Self, KeyRingError> {
        if text.bytes().any(|b| b.is_ascii_whitespace()) {
            return Err(KeyRingError::new(
                "the list holds whitespace: keys are separated by commas alone",
            ));
        }
        let keys = text
            .split(',')
            .enumerate()
            .map(|(n, entry)| {
                let key = decode_key(entry).ok_or_else(|| {
                    KeyRingError::new(format!("key {} is not standard base64 of 32 bytes", n + 1))
                })?;
                Ok(RingKey::derive(KEY_SALT, &key[..]))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Self::build(keys.into_iter())
    }

    fn build(keys: impl Iterator<Item = RingKey>) -> Result<Self, KeyRingError> {
        let keys: Vec<RingKey> = keys.collect();
        if keys.is_empty() {
            return Err(KeyRingError::new("it holds no key"));
        }
        for (n, key) in keys.iter().enumerate() {
            if keys[..n].iter().any(|earlier| earlier.id == key.id) {
                return Err(KeyRingError::new(format!("key {} is given twice", n + 1)));
            }
        }
        Ok(Self {
            keys,
            context: Box::from(""),
        })
    }

    /// Binds what this ring seals to `context`, a name the application gives
    /// the records' home (its deployment and table: `payments-prod/idempotency_keys`),
    /// so that a record copied to another table or environment whose ring holds
    /// the same keys does not open there. Every instance, and the `idem` tool
    /// (`--seal-context`), must name the same context. Records sealed without a
    /// context (before it was named, or by earlier releases) are bound to none
    /// and open under any; `reseal` seals them anew under it.
    ///
    /// ```
    /// # extern crate idem_runtime as idem_axum;
    /// use idem_axum::KeyRing;
    ///
    /// let ring = KeyRing::from_base64("3q2+7wAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=")?
    ///     .with_context("payments-prod/idempotency_keys");
    /// assert_eq!(ring.context(), "payments-prod/idempotency_keys");
    /// # Ok::<(), idem_axum::KeyRingError>(())
    /// ```
    #[must_use]
    pub fn with_context(mut self, context: impl Into<String>) -> Self {
        self.context = context.into().into_boxed_str();
        self
    }

    /// The context what this ring seals is bound to (empty unless set).
    pub fn context(&self) -> &str {
        &self.context
    }

    /// The envelope this ring seals in: version 2 with its context, version 1
    /// (as before contexts) without one.
    fn version(&self) -> u8 {
        if self.context.is_empty() {
            VERSION_1
        } else {
            VERSION
        }
    }

    /// How many keys the ring holds.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Never: a ring holds at least one key.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The ids of the ring's keys, the one that seals first.
    pub fn ids(&self) -> impl Iterator<Item = KeyId> + '_ {
        self.keys.iter().map(|key| key.id)
    }

    fn newest(&self) -> &RingKey {
        &self.keys[0]
    }

    fn key(&self, id: KeyId) -> Option<&RingKey> {
        self.keys.iter().find(|key| key.id == id)
    }

    /// Seals a response for the record of `identity` under the sealing key, with
    /// the unkeyed `digest` of the request's body.
    ///
    /// # Errors
    /// The operating system gave no random nonce, or the headers pass 4 GiB.
    pub(crate) fn seal(
        &self,
        identity: &Sealed<'_>,
        response: &Plain<'_>,
    ) -> Result<Vec<u8>, SealError> {
        let mut nonce = [0; NONCE_LEN];
        getrandom::fill(&mut nonce).map_err(SealError::Random)?;
        self.seal_with_nonce(identity, nonce, response)
    }

    fn seal_with_nonce(
        &self,
        identity: &Sealed<'_>,
        nonce: [u8; NONCE_LEN],
        response: &Plain<'_>,
    ) -> Result<Vec<u8>, SealError> {
        let Plain {
            status,
            digest,
            headers,
            body,
        } = *response;
        let key = self.newest();
        let headers_len = u32::try_from(headers.len()).map_err(|_| SealError::TooLarge)?;
        // Sealed in place: the body is copied once, into the record.
        let mut out =
            Vec::with_capacity(HEAD_LEN + PLAIN_HEAD_LEN + headers.len() + body.len() + TAG_LEN);
        let version = self.version();
        out.push(version);
        out.extend_from_slice(&key.id.0);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&status.to_be_bytes());
        out.extend_from_slice(digest);
        out.extend_from_slice(&headers_len.to_be_bytes());
        out.extend_from_slice(headers);
        out.extend_from_slice(body);
        let aad = identity.associated_data(version, key.id, &self.context);
        let tag = key
            .cipher
            .encrypt_inout_detached(&XNonce::from(nonce), &aad, (&mut out[HEAD_LEN..]).into())
            .map_err(|_| SealError::TooLarge)?;
        out.extend_from_slice(&tag);
        Ok(out)
    }

    /// Opens a sealed record of `identity`.
    pub(crate) fn open(
        &self,
        identity: &Sealed<'_>,
        sealed: &[u8],
    ) -> Result<OpenedResponse, Unsealable> {
        let parts = split(sealed).ok_or(Unsealable::Malformed)?;
        let id = parts.id;
        let key = self.key(id).ok_or(Unsealable::UnknownKey(id))?;
        let nonce = XNonce::try_from(parts.nonce).map_err(|_| Unsealable::Malformed)?;
        let tag = Tag::try_from(parts.tag).map_err(|_| Unsealable::Malformed)?;
        let aad = identity.associated_data(parts.version, id, &self.context);
        let mut plain = parts.ciphertext.to_vec();
        key.cipher
            .decrypt_inout_detached(&nonce, &aad, plain.as_mut_slice().into(), &tag)
            .map_err(|_| Unsealable::Tampered(id))?;
        OpenedResponse::parse(plain).ok_or(Unsealable::Tampered(id))
    }

    /// The fingerprint to store for the request of `owner` whose unkeyed
    /// digest is `digest`: the sealing key's id, then the first 24 bytes of
    /// HMAC-SHA-256 under it of the owner's scope and key and of the digest (32
    /// bytes in all, the width of the column). Over the owner too, so that equal
    /// bodies under two keys or two tenants are not equal in the table.
    pub(crate) fn fingerprint(&self, owner: Owner<'_>, digest: &[u8; 32]) -> [u8; 32] {
        let key = self.newest();
        let mut stored = [0; 32];
        stored[..ID_LEN].copy_from_slice(&key.id.0);
        let mac = keyed(key, Some(owner), digest).finalize().into_bytes();
        stored[ID_LEN..].copy_from_slice(&mac[..32 - ID_LEN]);
        stored
    }

    /// Whether a key of this ring keyed `stored`: its first 8 bytes are the id of
    /// one (an unkeyed SHA-256 begins so by chance once in 2^64).
    pub(crate) fn keyed(&self, stored: &[u8]) -> bool {
        stored.len() == 32
            && stored
                .first_chunk::<ID_LEN>()
                .is_some_and(|id| self.key(KeyId(*id)).is_some())
    }

    /// Whether `stored`, a fingerprint this ring wrote under any of its keys,
    /// is that of `owner`'s request with `digest`; `None` when no key of the
    /// ring wrote it (an unkeyed fingerprint, or one keyed under a key that has
    /// left). Compared in constant time. Fingerprints of earlier releases,
    /// keyed over the digest alone, still match.
    pub(crate) fn matches(
        &self,
        stored: &[u8],
        owner: Owner<'_>,
        digest: &[u8; 32],
    ) -> Option<bool> {
        let (id, mac) = stored.split_first_chunk::<ID_LEN>()?;
        if mac.len() != 32 - ID_LEN {
            return None;
        }
        let key = self.key(KeyId(*id))?;
        let is = |owner| keyed(key, owner, digest).verify_truncated_left(mac).is_ok();
        Some(is(Some(owner)) || is(None))
    }
}

/// The request a fingerprint is keyed for: its scope and idempotency key.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Owner<'a> {
    pub(crate) scope: &'a str,
    pub(crate) key: &'a str,
}

/// HMAC-SHA-256 under `key`'s fingerprint key of the owner (length-prefixed,
/// after a label, so that no input of one form is one of the other) and the
/// digest; over the digest alone without an owner, as earlier releases keyed.
fn keyed(key: &RingKey, owner: Option<Owner<'_>>, digest: &[u8; 32]) -> Hmac<Sha256> {
    let mut mac = key.fingerprints.clone();
    if let Some(Owner { scope, key }) = owner {
        mac.update(b"idem fingerprint v2");
        for part in [scope, key] {
            mac.update(&(part.len() as u64).to_be_bytes());
            mac.update(part.as_bytes());
        }
    }
    mac.update(digest);
    mac
}

/// Whether a store seals the responses it records and keys the fingerprints it
/// stores ([`Builder::sealing`](crate::Builder::sealing)).
///
/// With [`On`](Self::On), every recorded response (status, headers and body) is
/// sealed with XChaCha20-Poly1305 under the ring's first key, bound to its
/// row's scope, key, method, path, content type and fingerprint, and every
/// stored fingerprint is HMAC-SHA-256 under a key derived from the ring. A
/// record that does not open (in plain text, changed, moved to another row, or
/// sealed under a key no longer in the ring) is never replayed: the request is
/// answered 500 [`RecordUnreadable`](crate::Problem::RecordUnreadable) and its
/// key is not run again. Request bodies are never stored, sealed or not.
///
/// Between [`Off`](Self::Off) and [`On`](Self::On) lie two steps, so that a
/// running deployment changes without a key left unanswerable: no instance ever
/// writes a record another cannot read. Turning sealing on: every instance moves
/// to [`OpensSealed`](Self::OpensSealed), then every instance to
/// [`SealsNew`](Self::SealsNew), then, once the longest `ttl` has passed (the
/// records in plain text have expired), to `On`. Turning it off is the same
/// ladder down. A step starts once every instance runs the one before.
///
/// # Examples
///
/// ```rust,no_run
/// # extern crate idem_runtime as idem_axum;
/// # fn demo<DB: idem_axum::Backend>(pool: sqlx::Pool<DB>) -> Result<(), Box<dyn std::error::Error>> {
/// use idem_axum::{Idempotency, KeyRing, Sealing};
///
/// // The sealing key first: `openssl rand -base64 32` makes a key.
/// let ring = KeyRing::from_base64(&std::env::var("SEAL_KEYS")?)?;
/// let idempotency = Idempotency::builder(pool)
///     .sealing(Sealing::On(ring))
///     .build()?;
/// # Ok(()) }
/// ```
#[derive(Debug, Default)]
#[non_exhaustive]
pub enum Sealing {
    /// Responses are recorded in plain text and fingerprints are SHA-256 of the
    /// body; a sealed record is refused, as it cannot be opened. The default.
    #[default]
    Off,
    /// Records are written in plain text; sealed records open too. The first
    /// step on, the last step off.
    OpensSealed(KeyRing),
    /// Records are written sealed; records in plain text are still replayed.
    /// The second step on, the first step off.
    SealsNew(KeyRing),
    /// Responses are sealed and fingerprints keyed; a record in plain text is
    /// refused.
    On(KeyRing),
}

impl Sealing {
    /// The ring that seals what is written now.
    pub(crate) fn writer(&self) -> Option<&KeyRing> {
        match self {
            Self::On(ring) | Self::SealsNew(ring) => Some(ring),
            Self::Off | Self::OpensSealed(_) => None,
        }
    }

    /// The ring that opens what was written.
    pub(crate) fn ring(&self) -> Option<&KeyRing> {
        match self {
            Self::On(ring) | Self::SealsNew(ring) | Self::OpensSealed(ring) => Some(ring),
            Self::Off => None,
        }
    }

    /// Whether a record in plain text is replayed.
    pub(crate) fn opens_plain(&self) -> bool {
        !matches!(self, Self::On(_))
    }
}

/// Why a response was not sealed (and so not recorded).
#[derive(Debug)]
pub(crate) enum SealError {
    /// The operating system's random generator failed.
    Random(getrandom::Error),
    /// Headers over 4 GiB, or a record over the cipher's 256 GiB.
    TooLarge,
}

impl fmt::Display for SealError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Random(error) => write!(f, "no random nonce to seal with: {error}"),
            Self::TooLarge => f.write_str("the response is too large to seal"),
        }
    }
}

impl std::error::Error for SealError {}

/// A sealed record's parts.
struct Parts<'a> {
    version: u8,
    id: KeyId,
    nonce: &'a [u8],
    ciphertext: &'a [u8],
    tag: &'a [u8],
}

fn split(sealed: &[u8]) -> Option<Parts<'_>> {
    let (&version, rest) = sealed.split_first()?;
    if !matches!(version, VERSION | VERSION_1) || rest.len() < ID_LEN + NONCE_LEN + TAG_LEN {
        return None;
    }
    let (id, rest) = rest.split_at(ID_LEN);
    let (nonce, rest) = rest.split_at(NONCE_LEN);
    let (ciphertext, tag) = rest.split_at(rest.len() - TAG_LEN);
    Some(Parts {
        version,
        id: KeyId::try_from(id).ok()?,
        nonce,
        ciphertext,
        tag,
    })
}

/// Whether a sealed record is in the envelope `ring` seals in (with its
/// context, if it names one), not one that `reseal` brings up to date.
pub(crate) fn current_envelope(ring: &KeyRing, sealed: &[u8]) -> bool {
    sealed.first() == Some(&ring.version())
}

/// The key id a sealed record names, if it is one.
pub(crate) fn sealed_by(sealed: &[u8]) -> Option<KeyId> {
    split(sealed).map(|parts| parts.id)
}

/// What binds a sealed record to its row: the record opens only as the
/// response of this scope, key, method, path, content type and stored
/// fingerprint, as the row holds them.
pub(crate) struct Sealed<'a> {
    pub(crate) scope: &'a str,
    pub(crate) key: &'a str,
    pub(crate) method: &'a str,
    pub(crate) path: &'a str,
    /// `None` in rows from before content types were stored, which match any.
    pub(crate) content_type: Option<&'a str>,
    pub(crate) fingerprint: &'a [u8],
}

impl Sealed<'_> {
    /// The associated data of an envelope of `version` under key `id`; from
    /// version 2 on, with the ring's `context`.
    fn associated_data(&self, version: u8, id: KeyId, context: &str) -> Vec<u8> {
        let label = b"idem sealed response";
        // A missing content type is not an empty one: it would match any.
        let content_type = self.content_type.map(str::as_bytes);
        // Version 1 had no context: its parts end with the fingerprint.
        let context = (version != VERSION_1).then_some(context.as_bytes());
        let parts = [
            Some(self.scope.as_bytes()),
            Some(self.key.as_bytes()),
            Some(self.method.as_bytes()),
            Some(self.path.as_bytes()),
            content_type,
            Some(self.fingerprint),
        ];
        let parts = parts.iter().copied().chain(context.map(Some));
        let mut aad = Vec::with_capacity(
            label.len()
                + 1
                + ID_LEN
                + parts
                    .clone()
                    .map(|p| 9 + p.map_or(0, <[u8]>::len))
                    .sum::<usize>(),
        );
        aad.extend_from_slice(label);
        aad.push(version);
        aad.extend_from_slice(&id.0);
        for part in parts {
            match part {
                Some(part) => {
                    aad.push(1);
                    aad.extend_from_slice(&(part.len() as u64).to_be_bytes());
                    aad.extend_from_slice(part);
                }
                None => aad.push(0),
            }
        }
        aad
    }
}

/// What is sealed: a response, and the digest of the request's body.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Plain<'a> {
    pub(crate) status: u16,
    /// The request body's digest, unkeyed.
    pub(crate) digest: &'a [u8; 32],
    pub(crate) headers: &'a [u8],
    pub(crate) body: &'a [u8],
}

/// A sealed record, opened.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct OpenedResponse {
    pub(crate) status: u16,
    pub(crate) digest: [u8; 32],
    pub(crate) headers: Vec<u8>,
    pub(crate) body: Vec<u8>,
}

impl OpenedResponse {
    fn parse(mut plain: Vec<u8>) -> Option<Self> {
        let status = u16::from_be_bytes(*plain.first_chunk::<2>()?);
        let digest = *plain.get(2..)?.first_chunk::<32>()?;
        let headers_len = u32::from_be_bytes(*plain.get(34..)?.first_chunk::<4>()?);
        let headers_end = PLAIN_HEAD_LEN.checked_add(usize::try_from(headers_len).ok()?)?;
        let headers = plain.get(PLAIN_HEAD_LEN..headers_end)?.to_vec();
        plain.drain(..headers_end);
        Some(Self {
            status,
            digest,
            headers,
            body: plain,
        })
    }
}

/// Why a record is not replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unsealable {
    /// Not a sealed record of this format.
    Malformed,
    /// Sealed under a key the ring no longer holds.
    UnknownKey(KeyId),
    /// It does not open under its key: changed, or moved from another row.
    Tampered(KeyId),
}

/// Why a stored response is not replayed by this store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unreadable {
    /// In plain text, where the store seals ([`Sealing::On`]).
    Plain,
    /// Sealed (under this key, when the record names one), where the store has
    /// no ring ([`Sealing::Off`]).
    Sealed(Option<KeyId>),
    /// Sealed, and it does not open with the store's ring.
    Unsealable(Unsealable),
    /// In plain text under a fingerprint a key of the ring keyed: only a store
    /// that seals keys fingerprints, and it records sealed. The row was
    /// rewritten (a sealed record replaced by a plain one, its fingerprint kept).
    Downgraded,
    /// Its fingerprint is no unkeyed digest of this request's body and was keyed
    /// by no key of the ring ([`Sealing::On`]): keyed under a key that has left,
    /// so whether the request is the one recorded cannot be told.
    UnknownFingerprint,
}

impl fmt::Display for Unreadable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Plain => f.write_str("the record is in plain text and this store seals"),
            Self::Sealed(Some(id)) => write!(
                f,
                "the record is sealed under key {id} and this store has no key ring"
            ),
            Self::Sealed(None) => f.write_str(
                "the record is sealed in a format this release does not know, and this store \
                 has no key ring",
            ),
            Self::Unsealable(Unsealable::Malformed) => {
                f.write_str("the record is marked sealed but is not a sealed record")
            }
            Self::Unsealable(Unsealable::UnknownKey(id)) => write!(
                f,
                "the record is sealed under key {id}, which the key ring no longer holds"
            ),
            Self::Unsealable(Unsealable::Tampered(id)) => write!(
                f,
                "the record does not open under key {id}: it was changed, or copied from \
                 another row"
            ),
            Self::Downgraded => f.write_str(
                "the record is in plain text under a keyed fingerprint, which only a sealing \
                 store writes: the row was rewritten",
            ),
            Self::UnknownFingerprint => f.write_str(
                "the record's fingerprint was keyed under a key the key ring no longer holds",
            ),
        }
    }
}

/// Standard base64 of exactly 32 bytes, padded, canonical (44 characters, the
/// last `=`, the unused low bits of the last symbol zero).
fn decode_key(text: &str) -> Option<Zeroizing<[u8; 32]>> {
    fn value(symbol: u8) -> Option<u32> {
        Some(u32::from(match symbol {
            b'A'..=b'Z' => symbol - b'A',
            b'a'..=b'z' => symbol - b'a' + 26,
            b'0'..=b'9' => symbol - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        }))
    }
    let (symbols, padding) = text.as_bytes().split_at_checked(43)?;
    if padding != b"=" {
        return None;
    }
    let mut out = Zeroizing::new([0; 32]);
    // Ten groups of 4 symbols (3 bytes each), then 3 symbols: 18 bits, 16 of
    // them data and the last 2 zero.
    for (n, group) in symbols.chunks(4).enumerate() {
        let mut bits = 0u32;
        for &symbol in group {
            bits = bits << 6 | value(symbol)?;
        }
        let at = n * 3;
        if group.len() == 4 {
            out[at..at + 3].copy_from_slice(&bits.to_be_bytes()[1..]);
        } else {
            if bits & 0b11 != 0 {
                return None;
            }
            out[at..at + 2].copy_from_slice(&(bits >> 2).to_be_bytes()[2..]);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "3q2+7wAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
    const B: &str = "AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyA=";

    fn plain<'a>(status: u16, headers: &'a [u8], body: &'a [u8]) -> Plain<'a> {
        Plain {
            status,
            digest: &[7; 32],
            headers,
            body,
        }
    }

    fn identity<'a>(scope: &'a str, key: &'a str) -> Sealed<'a> {
        Sealed {
            scope,
            key,
            method: "POST",
            path: "/payments",
            content_type: Some("application/json"),
            fingerprint: &[5; 32],
        }
    }

    #[test]
    fn decodes_standard_base64_of_32_bytes_only() {
        let b = decode_key(B).expect("valid");
        assert_eq!(b.to_vec(), (1..=32).collect::<Vec<u8>>());
        assert_eq!(decode_key(A).expect("valid")[..4], [0xde, 0xad, 0xbe, 0xef]);
        for bad in [
            "",
            &B[..43],                                        // no padding
            "AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyA==", // 33 bytes' worth
            "AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyB=",  // unused bits set
            "AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHy-=",  // URL-safe alphabet
            "AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eH=A=",
        ] {
            assert!(decode_key(bad).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn refuses_rings_that_would_seal_wrongly() {
        for bad in [
            String::new(),
            format!("{A},"),
            format!(",{A}"),
            format!("{A}, {B}"),
            format!("{A}\n"),
            format!(" {A}"),
            format!("{A},{A}"),
            "not base64".to_owned(),
        ] {
            let error = KeyRing::from_base64(&bad).expect_err(&bad);
            // The message names the key's place, never its value.
            assert!(!error.to_string().contains(&A[..8]), "{error}");
        }
        assert!(KeyRing::from_keys([]).is_err());
        assert!(KeyRing::from_secrets(["a secret of at least thirty-two bytes\n"]).is_err());
        assert!(KeyRing::from_secrets(["short"]).is_err());
        let secret = "a-secret-of-at-least-thirty-two-bytes";
        assert!(KeyRing::from_secrets([secret, secret]).is_err());
        let ring = KeyRing::from_secrets([secret]).expect("ok");
        assert_eq!(ring.len(), 1);
        // A secret and a raw key of the same bytes are two keys.
        let same_bytes: [u8; 32] = secret.as_bytes()[..32].try_into().expect("32 bytes");
        let short = KeyRing::from_secrets([&secret[..32]]).expect("ok");
        let raw = KeyRing::from_keys([&same_bytes]).expect("ok");
        assert_ne!(short.ids().next(), raw.ids().next());
    }

    #[test]
    fn debug_shows_ids_never_keys() {
        let ring = KeyRing::from_keys([&[0xab; 32]]).expect("ring");
        let shown = format!("{ring:?}");
        assert!(shown.starts_with("KeyRing { ids: [KeyId("), "{shown}");
        assert!(!shown.contains("abab"), "{shown}");
    }

    /// What the ring writes is stored for the key's lifetime: its derivation,
    /// envelope and fingerprints are pinned, so that a change that would leave
    /// every stored record unreadable fails here first.
    #[test]
    fn what_is_stored_stays_readable() {
        let ring = KeyRing::from_base64(B).expect("ring");
        let id = ring.ids().next().expect("a key");
        assert_eq!(id.to_string(), KNOWN_ID);
        let fingerprint = ring.fingerprint(ALICE_K1, &[7; 32]);
        assert_eq!(hex(&fingerprint), KNOWN_FINGERPRINT);
        assert_eq!(fingerprint[..ID_LEN], *id.as_bytes());
        // Keyed over the digest alone, as releases before the owner was keyed
        // wrote them: they still match, for any owner.
        let legacy = unhex(KNOWN_FINGERPRINT_V1);
        assert_eq!(ring.matches(&legacy, ALICE_K1, &[7; 32]), Some(true));
        assert_eq!(ring.matches(&legacy, BOB_K1, &[7; 32]), Some(true));
        assert_eq!(ring.matches(&legacy, ALICE_K1, &[8; 32]), Some(false));
        let sealed = ring
            .seal_with_nonce(
                &identity("alice", "k-1"),
                [9; NONCE_LEN],
                &plain(201, b"a: b\r\n", b"{}"),
            )
            .expect("sealed");
        assert_eq!(hex(&sealed), KNOWN_RECORD);
        let opened = ring
            .open(&identity("alice", "k-1"), &sealed)
            .expect("opens");
        assert_eq!(
            (opened.status, &opened.headers[..], &opened.body[..]),
            (201, &b"a: b\r\n"[..], &b"{}"[..])
        );
        assert_eq!(opened.digest, [7; 32]);
        // Without a context, version 1 (as earlier releases sealed): it opens
        // under any context. With one, version 2, bound to it.
        let bound = KeyRing::from_base64(B)
            .expect("ring")
            .with_context("prod/keys");
        let opened = bound
            .open(&identity("alice", "k-1"), &sealed)
            .expect("opens");
        assert_eq!((opened.status, &opened.body[..]), (201, &b"{}"[..]));
        let in_context = bound
            .seal_with_nonce(
                &identity("alice", "k-1"),
                [9; NONCE_LEN],
                &plain(201, b"a: b\r\n", b"{}"),
            )
            .expect("sealed");
        assert_eq!(hex(&in_context), KNOWN_RECORD_IN_CONTEXT);
        assert!(bound.open(&identity("alice", "k-1"), &in_context).is_ok());
        // Nothing at all is sealed too.
        let empty = ring
            .seal(&identity("alice", "k-2"), &plain(204, b"", b""))
            .expect("sealed");
        let opened = ring.open(&identity("alice", "k-2"), &empty).expect("opens");
        assert_eq!(
            (opened.status, opened.headers.len(), opened.body.len()),
            (204, 0, 0)
        );
    }

    #[test]
    fn a_record_relabelled_with_another_key_of_the_ring_does_not_open() {
        let ring = KeyRing::from_base64(&format!("{A},{B}")).expect("ring");
        let id = identity("alice", "k-1");
        let mut sealed = ring.seal(&id, &plain(200, b"", b"ok")).expect("sealed");
        let b_id = ring.ids().nth(1).expect("two keys");
        sealed[1..1 + ID_LEN].copy_from_slice(b_id.as_bytes());
        assert_eq!(ring.open(&id, &sealed), Err(Unsealable::Tampered(b_id)));
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn unhex(text: &str) -> Vec<u8> {
        (0..text.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex"))
            .collect()
    }

    /// A record sealed in one context (deployment, table) does not open in
    /// another whose ring holds the same keys, nor where none is named.
    #[test]
    fn records_open_only_in_their_context() {
        let prod = KeyRing::from_base64(B)
            .expect("ring")
            .with_context("prod/keys");
        let id = identity("alice", "k-1");
        let sealed = prod.seal(&id, &plain(200, b"", b"ok")).expect("sealed");
        assert_eq!(prod.open(&id, &sealed).expect("opens").body, b"ok");
        let b_id = prod.ids().next().expect("a key");
        for other in ["staging/keys", "prod/other_keys", ""] {
            let ring = KeyRing::from_base64(B).expect("ring").with_context(other);
            assert_eq!(
                ring.open(&id, &sealed),
                Err(Unsealable::Tampered(b_id)),
                "{other:?}"
            );
        }
        // Relabelled as version 1, which had no context: refused too.
        let mut relabelled = sealed.clone();
        relabelled[0] = VERSION_1;
        let plain_ring = KeyRing::from_base64(B).expect("ring");
        assert_eq!(
            plain_ring.open(&id, &relabelled),
            Err(Unsealable::Tampered(b_id))
        );
        assert!(format!("{prod:?}").contains("prod/keys"));
    }

    const KNOWN_ID: &str = "92bfd512f7926b1d";
    const KNOWN_FINGERPRINT: &str = concat!(
        "92bfd512f7926b1d",                                 // key id
        "adcc00aeca3fa1e37a502d291af12f1724e624b75a96136b", // HMAC of the owner and the digest, cut
    );
    const KNOWN_FINGERPRINT_V1: &str = concat!(
        "92bfd512f7926b1d",                                 // key id
        "6cefdac8501d9d195befaa15b4ce0fd7ea6a27d0c479ea8e", // HMAC of the digest, cut
    );
    const ALICE_K1: Owner<'static> = Owner {
        scope: "alice",
        key: "k-1",
    };
    const BOB_K1: Owner<'static> = Owner {
        scope: "bob",
        key: "k-1",
    };
    const KNOWN_RECORD_IN_CONTEXT: &str = concat!(
        "02",                                               // version
        "92bfd512f7926b1d",                                 // key id
        "090909090909090909090909090909090909090909090909", // nonce
        // ciphertext
        "f5c15f941b490a748e7918f96d7614d4f7bfca6297851d989c88fb9fcedc533b",
        "f752fc7d5669b222be26163372a7",
        "cb303d8c4e4b56098fa708ee589c174f", // tag, over the context "prod/keys"
    );
    const KNOWN_RECORD: &str = concat!(
        "01",                                               // version
        "92bfd512f7926b1d",                                 // key id
        "090909090909090909090909090909090909090909090909", // nonce
        // ciphertext
        "f5c15f941b490a748e7918f96d7614d4f7bfca6297851d989c88fb9fcedc533b",
        "f752fc7d5669b222be26163372a7",
        "5d9afe7a8304db126048d0c657cb5efd", // tag
    );

    #[test]
    fn a_sealed_record_opens_as_its_own_row_only() {
        let ring = KeyRing::from_base64(&format!("{A},{B}")).expect("ring");
        let id = identity("alice", "k-1");
        let sealed = ring
            .seal(
                &id,
                &plain(
                    201,
                    b"content-type: application/json\r\n",
                    b"{\"card\":\"4242\"}",
                ),
            )
            .expect("sealed");
        assert!(!sealed.windows(4).any(|w| w == b"4242"));
        assert!(!sealed.windows(12).any(|w| w == b"content-type"));
        let opened = ring.open(&id, &sealed).expect("opens");
        assert_eq!(opened.status, 201);
        assert_eq!(opened.headers, b"content-type: application/json\r\n");
        assert_eq!(opened.body, b"{\"card\":\"4242\"}");
        let newest = ring.ids().next().expect("a key");
        assert_eq!(sealed_by(&sealed), Some(newest));

        // Another scope, key, method or path: it does not open.
        for other in [
            identity("mallory", "k-1"),
            identity("alice", "k-2"),
            Sealed {
                method: "PUT",
                ..identity("alice", "k-1")
            },
            Sealed {
                path: "/refunds",
                ..identity("alice", "k-1")
            },
            Sealed {
                content_type: Some("text/plain"),
                ..identity("alice", "k-1")
            },
            // A missing content type matches any: it is not an empty one.
            Sealed {
                content_type: None,
                ..identity("alice", "k-1")
            },
            Sealed {
                fingerprint: &[6; 32],
                ..identity("alice", "k-1")
            },
            // Length-prefixed: moving bytes between parts changes the data.
            identity("alicek", "-1"),
        ] {
            assert_eq!(
                ring.open(&other, &sealed),
                Err(Unsealable::Tampered(newest))
            );
        }
        // Any byte flipped, or cut short.
        for at in 0..sealed.len() {
            let mut flipped = sealed.clone();
            flipped[at] ^= 1;
            assert!(ring.open(&id, &flipped).is_err(), "byte {at}");
        }
        assert_eq!(ring.open(&id, &sealed[..40]), Err(Unsealable::Malformed));
        assert_eq!(
            ring.open(&id, b"{\"plain\":true}"),
            Err(Unsealable::Malformed)
        );
        // Two seals of one response differ (a nonce each).
        assert_ne!(
            sealed,
            ring.seal(
                &id,
                &plain(
                    201,
                    b"content-type: application/json\r\n",
                    b"{\"card\":\"4242\"}"
                )
            )
            .expect("sealed")
        );
    }

    #[test]
    fn rotation_opens_old_records_and_removal_names_the_key() {
        let old = KeyRing::from_base64(B).expect("ring");
        let rotated = KeyRing::from_base64(&format!("{A},{B}")).expect("ring");
        let removed = KeyRing::from_base64(A).expect("ring");
        let id = identity("alice", "k-1");
        let sealed = old.seal(&id, &plain(200, b"", b"ok")).expect("sealed");
        assert_eq!(rotated.open(&id, &sealed).expect("opens").body, b"ok");
        let b_id = old.ids().next().expect("a key");
        assert_eq!(
            removed.open(&id, &sealed),
            Err(Unsealable::UnknownKey(b_id))
        );
        // New records are sealed under the newest key.
        let a_id = removed.ids().next().expect("a key");
        assert_eq!(
            sealed_by(&rotated.seal(&id, &plain(200, b"", b"ok")).expect("sealed")),
            Some(a_id)
        );
    }

    #[test]
    fn fingerprints_are_keyed_and_match_after_rotation() {
        let digest = [7; 32];
        let old = KeyRing::from_base64(B).expect("ring");
        let other = KeyRing::from_base64(A).expect("ring");
        let rotated = KeyRing::from_base64(&format!("{A},{B}")).expect("ring");
        let stored = old.fingerprint(ALICE_K1, &digest);
        assert_ne!(stored, digest);
        assert_ne!(stored, other.fingerprint(ALICE_K1, &digest));
        assert_eq!(old.matches(&stored, ALICE_K1, &digest), Some(true));
        assert_eq!(old.matches(&stored, ALICE_K1, &[8; 32]), Some(false));
        // The same body under another scope, or another key, is stored apart
        // and does not match there.
        assert_ne!(old.fingerprint(BOB_K1, &digest), stored);
        let k2 = Owner {
            scope: "alice",
            key: "k-2",
        };
        assert_ne!(old.fingerprint(k2, &digest), stored);
        assert_eq!(old.matches(&stored, BOB_K1, &digest), Some(false));
        // Length-prefixed: a scope's end is not a key's start.
        let split = Owner {
            scope: "alicek",
            key: "-1",
        };
        assert_ne!(old.fingerprint(split, &digest), stored);
        // After a rotation, under the key that wrote it.
        assert_eq!(rotated.matches(&stored, ALICE_K1, &digest), Some(true));
        assert_ne!(rotated.fingerprint(ALICE_K1, &digest), stored);
        // Not written by this ring: the key left, or it is an unkeyed digest.
        assert_eq!(other.matches(&stored, ALICE_K1, &digest), None);
        assert_eq!(old.matches(&digest, ALICE_K1, &digest), None);
        assert_eq!(old.matches(&stored[..31], ALICE_K1, &digest), None);
        // Raw keys and their base64 form are one ring.
        let raw = KeyRing::from_keys([&*decode_key(B).expect("key")]).expect("ring");
        assert_eq!(raw.fingerprint(ALICE_K1, &digest), stored);
    }
}
