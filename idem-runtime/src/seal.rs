//! Recorded responses sealed at rest, and fingerprints keyed: the key ring.
//!
//! Every key of a ring is expanded with HKDF-SHA-256 into three values that
//! never serve two purposes: its id (8 bytes, stored beside what it sealed, so a
//! record names the key that opens it without revealing it), the
//! XChaCha20-Poly1305 key that seals responses, and the HMAC-SHA-256 key that
//! keys fingerprints. XChaCha20-Poly1305 rather than AES-256-GCM: its 192-bit
//! nonce may be drawn at random for every record with no bound worth counting,
//! where AES-GCM's 96-bit random nonces allow about 2^32 records per key.
//!
//! A sealed record is `version ‖ key id ‖ nonce ‖ ciphertext ‖ tag`, over
//! `status ‖ headers' length ‖ headers ‖ body`; its associated data is the
//! record's identity (scope, key, method, path, each length-prefixed), so a row
//! copied to another scope or key does not open.
// Not yet called by the stores, which take a ring in the next step.
#![cfg_attr(not(test), expect(dead_code))]

use std::fmt;

use chacha20poly1305::aead::{Aead as _, KeyInit as _, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use hmac::{Hmac, Mac as _};
use sha2::Sha256;

/// The first byte of every sealed record: the envelope's format.
const VERSION: u8 = 1;
const ID_LEN: usize = 8;
const NONCE_LEN: usize = 24;
const TAG_LEN: usize = 16;
/// HKDF's salt: the ring's keys are used by idem alone, for these purposes.
const SALT: &[u8] = b"idem key ring v1";

/// The id of a key of a ring: derived from the key, stored beside the records
/// it sealed and the fingerprints it keyed.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyId([u8; ID_LEN]);

impl KeyId {
    /// The id as stored: 8 bytes.
    pub fn as_bytes(&self) -> &[u8; ID_LEN] {
        &self.0
    }

    /// The id from its stored bytes, if they are an id's length.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
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

struct RingKey {
    id: KeyId,
    cipher: XChaCha20Poly1305,
    fingerprints: Hmac<Sha256>,
}

impl RingKey {
    fn derive(material: &[u8]) -> Self {
        let hkdf = hkdf::Hkdf::<Sha256>::new(Some(SALT), material);
        let mut id = [0; ID_LEN];
        let mut seal = [0; 32];
        let mut fingerprint = [0; 32];
        // Lengths far below HKDF's limit of 255 blocks: expansion cannot fail.
        for (info, out) in [
            (&b"key id"[..], &mut id[..]),
            (b"response sealing", &mut seal[..]),
            (b"fingerprint keying", &mut fingerprint[..]),
        ] {
            let expanded = hkdf.expand(info, out);
            debug_assert!(expanded.is_ok());
        }
        let key = Self {
            id: KeyId(id),
            cipher: XChaCha20Poly1305::new(&seal.into()),
            fingerprints: <Hmac<Sha256>>::new_from_slice(&fingerprint)
                .unwrap_or_else(|_| unreachable!("HMAC takes a key of any length")),
        };
        seal.fill(0);
        fingerprint.fill(0);
        key
    }
}

/// The keys that seal recorded responses and key fingerprints, newest first:
/// the first seals and keys what is written now, every one opens and matches
/// what it wrote before.
///
/// Keys come from the application (a secret store, the environment): raw
/// 32-byte keys, or secrets of at least 32 bytes that HKDF expands. A ring never
/// prints its keys, only their ids.
///
/// ```
/// use idem_runtime::KeyRing;
///
/// // `openssl rand -base64 32`, newest first, separated by commas.
/// let ring = KeyRing::from_base64(
///     "3q2+7wAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=,AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyA=",
/// )?;
/// assert_eq!(ring.len(), 2);
/// assert!(KeyRing::from_base64("").is_err());
/// # Ok::<(), idem_runtime::KeyRingError>(())
/// ```
pub struct KeyRing {
    keys: Vec<RingKey>,
}

impl fmt::Debug for KeyRing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.keys.iter().map(|key| key.id))
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
    /// A ring of raw 32-byte keys, newest first.
    ///
    /// # Errors
    /// An empty list, or a key given twice.
    pub fn from_keys<'k>(
        keys: impl IntoIterator<Item = &'k [u8; 32]>,
    ) -> Result<Self, KeyRingError> {
        Self::build(keys.into_iter().map(|key| &key[..]))
    }

    /// A ring of secrets (passphrases, or keys in a text form of their own),
    /// newest first, each expanded with HKDF-SHA-256.
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
        Self::build(secrets.into_iter().map(str::as_bytes))
    }

    /// A ring from its text form: raw 32-byte keys in standard base64 (with its
    /// padding), separated by commas, newest first, nothing else (no spaces, no
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
                decode_key(entry).ok_or_else(|| {
                    KeyRingError::new(format!("key {} is not standard base64 of 32 bytes", n + 1))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Self::from_keys(&keys)
    }

    fn build<'m>(materials: impl Iterator<Item = &'m [u8]>) -> Result<Self, KeyRingError> {
        let keys: Vec<RingKey> = materials.map(RingKey::derive).collect();
        if keys.is_empty() {
            return Err(KeyRingError::new("it holds no key"));
        }
        for (n, key) in keys.iter().enumerate() {
            if keys[..n].iter().any(|earlier| earlier.id == key.id) {
                return Err(KeyRingError::new(format!("key {} is given twice", n + 1)));
            }
        }
        Ok(Self { keys })
    }

    /// How many keys the ring holds.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Never: a ring holds at least one key.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The ids of the ring's keys, newest (the one that seals) first.
    pub fn ids(&self) -> impl Iterator<Item = KeyId> + '_ {
        self.keys.iter().map(|key| key.id)
    }

    fn newest(&self) -> &RingKey {
        &self.keys[0]
    }

    fn key(&self, id: KeyId) -> Option<&RingKey> {
        self.keys.iter().find(|key| key.id == id)
    }

    /// Seals a response for the record of `identity` under the newest key.
    ///
    /// # Errors
    /// The operating system gave no random nonce: nothing may be sealed then.
    pub(crate) fn seal(
        &self,
        identity: &Sealed<'_>,
        status: u16,
        headers: &[u8],
        body: &[u8],
    ) -> Result<Vec<u8>, getrandom::Error> {
        let key = self.newest();
        let mut nonce = [0; NONCE_LEN];
        getrandom::fill(&mut nonce)?;
        let mut plain = Vec::with_capacity(6 + headers.len() + body.len());
        plain.extend_from_slice(&status.to_be_bytes());
        plain.extend_from_slice(
            &u32::try_from(headers.len())
                .unwrap_or(u32::MAX)
                .to_be_bytes(),
        );
        plain.extend_from_slice(headers);
        plain.extend_from_slice(body);
        let aad = identity.associated_data();
        let sealed = key
            .cipher
            .encrypt(
                &XNonce::from(nonce),
                Payload {
                    msg: &plain,
                    aad: &aad,
                },
            )
            .unwrap_or_else(|_| unreachable!("XChaCha20-Poly1305 seals up to 256 GiB"));
        plain.fill(0);
        let mut out = Vec::with_capacity(1 + ID_LEN + NONCE_LEN + sealed.len());
        out.push(VERSION);
        out.extend_from_slice(&key.id.0);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        Ok(out)
    }

    /// Opens a sealed record of `identity`.
    pub(crate) fn open(
        &self,
        identity: &Sealed<'_>,
        sealed: &[u8],
    ) -> Result<OpenedResponse, Unsealable> {
        let (id, nonce, ciphertext) = split(sealed).ok_or(Unsealable::Malformed)?;
        let nonce = XNonce::try_from(nonce).map_err(|_| Unsealable::Malformed)?;
        let key = self.key(id).ok_or(Unsealable::UnknownKey(id))?;
        let aad = identity.associated_data();
        let plain = key
            .cipher
            .decrypt(
                &nonce,
                Payload {
                    msg: ciphertext,
                    aad: &aad,
                },
            )
            .map_err(|_| Unsealable::Tampered(id))?;
        OpenedResponse::parse(plain).ok_or(Unsealable::Tampered(id))
    }

    /// The fingerprint to store for a request whose unkeyed digest is
    /// `digest`: HMAC-SHA-256 of it under the newest key, and that key's id.
    pub(crate) fn keyed(&self, digest: &[u8; 32]) -> (KeyId, [u8; 32]) {
        let key = self.newest();
        (key.id, keyed(key, digest))
    }

    /// `digest` keyed as a row keyed it, under `id`; `None` when that key has
    /// left the ring.
    pub(crate) fn keyed_under(&self, id: KeyId, digest: &[u8; 32]) -> Option<[u8; 32]> {
        self.key(id).map(|key| keyed(key, digest))
    }
}

fn keyed(key: &RingKey, digest: &[u8; 32]) -> [u8; 32] {
    let mut mac = key.fingerprints.clone();
    mac.update(digest);
    mac.finalize().into_bytes().into()
}

/// A sealed record's parts: its key id, its nonce, its ciphertext with the tag.
fn split(sealed: &[u8]) -> Option<(KeyId, &[u8], &[u8])> {
    let (&version, rest) = sealed.split_first()?;
    if version != VERSION || rest.len() < ID_LEN + NONCE_LEN + TAG_LEN {
        return None;
    }
    let (id, rest) = rest.split_at(ID_LEN);
    let (nonce, ciphertext) = rest.split_at(NONCE_LEN);
    Some((KeyId::from_bytes(id)?, nonce, ciphertext))
}

/// The key id a sealed record names, if it is one.
pub(crate) fn sealed_by(sealed: &[u8]) -> Option<KeyId> {
    split(sealed).map(|(id, _, _)| id)
}

/// What binds a sealed record to its row: the record opens only as the
/// response of this scope, key, method and path.
pub(crate) struct Sealed<'a> {
    pub(crate) scope: &'a str,
    pub(crate) key: &'a str,
    pub(crate) method: &'a str,
    pub(crate) path: &'a str,
}

impl Sealed<'_> {
    fn associated_data(&self) -> Vec<u8> {
        let parts = [self.scope, self.key, self.method, self.path];
        let mut aad = Vec::with_capacity(32 + parts.iter().map(|p| 4 + p.len()).sum::<usize>());
        aad.extend_from_slice(b"idem sealed response v1");
        for part in parts {
            aad.extend_from_slice(&u32::try_from(part.len()).unwrap_or(u32::MAX).to_be_bytes());
            aad.extend_from_slice(part.as_bytes());
        }
        aad
    }
}

/// A sealed record, opened.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct OpenedResponse {
    pub(crate) status: u16,
    pub(crate) headers: Vec<u8>,
    pub(crate) body: Vec<u8>,
}

impl OpenedResponse {
    fn parse(mut plain: Vec<u8>) -> Option<Self> {
        let status = u16::from_be_bytes(plain.get(..2)?.try_into().ok()?);
        let headers_len = u32::from_be_bytes(plain.get(2..6)?.try_into().ok()?);
        let headers_end = 6usize.checked_add(usize::try_from(headers_len).ok()?)?;
        let headers = plain.get(6..headers_end)?.to_vec();
        let body = plain.split_off(headers_end);
        Some(Self {
            status,
            headers,
            body,
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

/// Standard base64 of exactly 32 bytes, padded, canonical (44 characters, the
/// last `=`, the unused low bits of the last symbol zero).
fn decode_key(text: &str) -> Option<[u8; 32]> {
    fn value(symbol: u8) -> Option<u32> {
        Some(match symbol {
            b'A'..=b'Z' => symbol - b'A',
            b'a'..=b'z' => symbol - b'a' + 26,
            b'0'..=b'9' => symbol - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    }
    let text = text.as_bytes();
    let (symbols, padding) = text.split_at_checked(43)?;
    if padding != b"=" {
        return None;
    }
    let mut out = [0; 32];
    let mut written = 0;
    for chunk in symbols.chunks(4) {
        let mut bits = 0u32;
        for &symbol in chunk {
            bits = bits << 6 | value(symbol)?;
        }
        // The last chunk has 3 symbols: 18 bits, 16 of them data.
        let bytes = if chunk.len() == 4 {
            bits.to_be_bytes()[1..].to_vec()
        } else {
            if bits & 0b11 != 0 {
                return None;
            }
            (bits >> 2).to_be_bytes()[2..].to_vec()
        };
        out[written..written + bytes.len()].copy_from_slice(&bytes);
        written += bytes.len();
    }
    (written == 32).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "3q2+7wAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
    const B: &str = "AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyA=";

    fn identity<'a>(scope: &'a str, key: &'a str) -> Sealed<'a> {
        Sealed {
            scope,
            key,
            method: "POST",
            path: "/payments",
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
            assert_eq!(decode_key(bad), None, "{bad:?}");
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
        let ring = KeyRing::from_secrets(["a secret of at least thirty-two bytes"]).expect("ok");
        assert_eq!(ring.len(), 1);
        assert!(!format!("{ring:?}").is_empty());
    }

    #[test]
    fn a_sealed_record_opens_as_its_own_row_only() {
        let ring = KeyRing::from_base64(&format!("{A},{B}")).expect("ring");
        let id = identity("alice", "k-1");
        let sealed = ring
            .seal(
                &id,
                201,
                b"content-type: application/json\r\n",
                b"{\"card\":\"4242\"}",
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
                201,
                b"content-type: application/json\r\n",
                b"{\"card\":\"4242\"}"
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
        let sealed = old.seal(&id, 200, b"", b"ok").expect("sealed");
        assert_eq!(rotated.open(&id, &sealed).expect("opens").body, b"ok");
        let b_id = old.ids().next().expect("a key");
        assert_eq!(
            removed.open(&id, &sealed),
            Err(Unsealable::UnknownKey(b_id))
        );
        // New records are sealed under the newest key.
        let a_id = removed.ids().next().expect("a key");
        assert_eq!(
            sealed_by(&rotated.seal(&id, 200, b"", b"ok").expect("sealed")),
            Some(a_id)
        );
    }

    #[test]
    fn fingerprints_are_keyed_and_match_after_rotation() {
        let digest = [7; 32];
        let old = KeyRing::from_base64(B).expect("ring");
        let other = KeyRing::from_base64(A).expect("ring");
        let rotated = KeyRing::from_base64(&format!("{A},{B}")).expect("ring");
        let (b_id, stored) = old.keyed(&digest);
        assert_ne!(stored, digest);
        assert_ne!(stored, other.keyed(&digest).1);
        assert_eq!(rotated.keyed_under(b_id, &digest), Some(stored));
        assert_ne!(rotated.keyed(&digest).1, stored);
        assert_eq!(other.keyed_under(b_id, &digest), None);
        // Raw keys and their base64 form are one ring.
        let raw = KeyRing::from_keys([&decode_key(B).expect("key")]).expect("ring");
        assert_eq!(raw.keyed(&digest), (b_id, stored));
    }
}
