//! A multipart body (RFC 2046 §5.1, RFC 7578) identified by its parts, not by its
//! framing: clients choose a new boundary for every send (curl, reqwest, every
//! browser), so the bytes of a resubmitted form never repeat. What counts is the
//! ordered list of parts, each with its headers (`Content-Disposition`, so the
//! field's name and filename, and `Content-Type`, each in one form) and its
//! bytes; the boundary, the preamble and epilogue (which no form parser hands a
//! handler) and the padding of delimiter lines do not. See `docs/contract.md`,
//! "What identifies a request".
//!
//! The body is read where it lies, already buffered and under the endpoint's
//! limit: no part is copied.

use std::fmt;

use memchr::memmem;
use sha2::{Digest as _, Sha256};

use crate::media;

/// Why a keyed multipart body cannot be identified: it is not the multipart body
/// its `Content-Type` announces. Answered 400 `invalid-multipart`, with nothing
/// claimed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InvalidMultipart {
    reason: &'static str,
    /// Byte offset in the body, where there is one.
    at: Option<usize>,
}

impl InvalidMultipart {
    fn at(reason: &'static str, at: usize) -> Self {
        Self {
            reason,
            at: Some(at),
        }
    }
}

impl fmt::Display for InvalidMultipart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the multipart body is malformed: {}", self.reason)?;
        if let Some(at) = self.at {
            write!(f, " (at byte {at})")?;
        }
        f.write_str("; nothing was claimed")
    }
}

impl std::error::Error for InvalidMultipart {}

/// Domain of the digest. The parts' stream is hashed, then that hash with this
/// prefix: no body a client can send hashes to a parts digest (which the
/// fallback to earlier rows' byte digests would otherwise let it match).
const DOMAIN: &[u8] = b"idem multipart/* parts v1\0";

/// The fingerprint of a multipart body: `None` when `content_type` is no
/// multipart type (the body is fingerprinted otherwise).
pub(crate) fn fingerprint(
    content_type: &str,
    body: &[u8],
) -> Option<Result<[u8; 32], InvalidMultipart>> {
    let boundary = media::multipart_boundary(content_type)?;
    Some(match boundary {
        None => Err(InvalidMultipart {
            reason: "its Content-Type has no boundary",
            at: None,
        }),
        Some(boundary) => parts_digest(boundary.as_bytes(), body),
    })
}

fn parts_digest(boundary: &[u8], body: &[u8]) -> Result<[u8; 32], InvalidMultipart> {
    // "\r\n--boundary": every delimiter but a first one at the very start.
    let mut delimiter = Vec::with_capacity(boundary.len() + 4);
    delimiter.extend_from_slice(b"\r\n--");
    delimiter.extend_from_slice(boundary);
    let finder = memmem::Finder::new(&delimiter);
    // The first delimiter wherever it is, as form parsers take it (RFC 2046
    // wants it at the start or after a CRLF; a parser that finds it elsewhere
    // would see parts a stricter reading calls preamble).
    let mut at = match memmem::find(body, &delimiter[2..]) {
        Some(found) => found + delimiter.len() - 2,
        None => return Err(InvalidMultipart::at("no boundary delimiter", 0)),
    };
    let mut hash = Sha256::new();
    let mut headers: Vec<(String, Vec<u8>)> = Vec::new();
    loop {
        // After a delimiter: `--` closes the body (what follows is the epilogue);
        // else transport padding, then the line ends and a part begins.
        let rest = &body[at..];
        if rest.starts_with(b"--") {
            let parts: [u8; 32] = hash.finalize().into();
            let outer = Sha256::new().chain_update(DOMAIN).chain_update(parts);
            return Ok(outer.finalize().into());
        }
        let padding = rest
            .iter()
            .take_while(|b| matches!(b, b' ' | b'\t'))
            .count();
        if !rest[padding..].starts_with(b"\r\n") {
            return Err(InvalidMultipart::at(
                "a boundary delimiter line has more after the boundary",
                at,
            ));
        }
        at += padding + 2;
        let data_start = part_headers(body, &mut at, &mut headers)?;
        let Some(end) = finder.find(&body[data_start..]) else {
            return Err(InvalidMultipart::at(
                "a part has no closing boundary delimiter",
                data_start,
            ));
        };
        let data = &body[data_start..data_start + end];
        hash.update(b"part");
        // Stable: a header given twice keeps its values' order.
        headers.sort_by(|a, b| a.0.cmp(&b.0));
        hash.update((headers.len() as u64).to_be_bytes());
        for (name, value) in headers.drain(..) {
            framed(&mut hash, name.as_bytes());
            framed(&mut hash, &value);
        }
        framed(&mut hash, data);
        at = data_start + end + delimiter.len();
    }
}

/// Hashes `bytes` after their length, so that no two lists of fields share a hash.
fn framed(hash: &mut Sha256, bytes: &[u8]) {
    hash.update((bytes.len() as u64).to_be_bytes());
    hash.update(bytes);
}

/// Reads a part's header lines from `at` up to the empty line that ends them,
/// into `headers` (names in lower case, values in the form they compare in), and
/// returns where the part's data begins.
fn part_headers(
    body: &[u8],
    at: &mut usize,
    headers: &mut Vec<(String, Vec<u8>)>,
) -> Result<usize, InvalidMultipart> {
    loop {
        let line_start = *at;
        let Some(len) = memmem::find(&body[line_start..], b"\r\n") else {
            return Err(InvalidMultipart::at(
                "a part's headers never end",
                line_start,
            ));
        };
        *at = line_start + len + 2;
        let line = &body[line_start..line_start + len];
        if line.is_empty() {
            return Ok(*at);
        }
        // A bare CR or LF ends a header line for some parsers and not for
        // others: refused, as every control byte but a tab.
        if line.iter().any(|&b| (b < b' ' && b != b'\t') || b == 0x7f) {
            return Err(InvalidMultipart::at(
                "a part's header line has a control byte",
                line_start,
            ));
        }
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            return Err(InvalidMultipart::at(
                "a part's header line has no `:`",
                line_start,
            ));
        };
        let name = &line[..colon];
        if name.is_empty() || !name.iter().all(|&b| is_tchar(b)) {
            // Also a folded line (obsolete, refused by form parsers).
            return Err(InvalidMultipart::at(
                "a part's header has no valid name",
                line_start,
            ));
        }
        let name = String::from_utf8_lossy(name).to_ascii_lowercase();
        let value = trim_ows(&line[colon + 1..]);
        // A part's `Content-Type` in one form (as a media type: `Text/Plain` is
        // `text/plain`); every other header as sent, `Content-Disposition` too,
        // since form parsers read its parameters each their own way (the case of
        // `name`, escapes, a `filename*`): a retry sends the same bytes there.
        let typed = (name == "content-type")
            .then(|| std::str::from_utf8(value).ok())
            .flatten()
            .and_then(media::canonical_part_type);
        let value = match typed {
            Some(form) => tagged(b'm', form.as_bytes()),
            None => tagged(b'r', value),
        };
        headers.push((name, value));
    }
}

/// `bytes` without the spaces and tabs around them (RFC 9110's OWS).
fn trim_ows(bytes: &[u8]) -> &[u8] {
    let start = bytes.iter().position(|&b| b != b' ' && b != b'\t');
    let end = bytes.iter().rposition(|&b| b != b' ' && b != b'\t');
    match (start, end) {
        (Some(start), Some(end)) => &bytes[start..=end],
        _ => &[],
    }
}

/// A header value as hashed: put in one form (`m`) or as sent (`r`), never
/// mistaken for each other.
fn tagged(tag: u8, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(value.len() + 1);
    out.push(tag);
    out.extend_from_slice(value);
    out
}

/// RFC 9110's `tchar`: what a header's name is made of.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

#[cfg(test)]
mod tests {
    use super::fingerprint;

    /// A form with a text field and a file, framed with `boundary` as a client
    /// frames it, with `preamble` and `epilogue` around it.
    fn form(boundary: &str, preamble: &str, epilogue: &str, file: &str) -> (String, Vec<u8>) {
        let body = format!(
            "{preamble}--{boundary}\r\n\
             Content-Disposition: form-data; name=\"amount\"\r\n\r\n\
             100\r\n\
             --{boundary}\r\n\
             Content-Disposition: form-data; name=\"receipt\"; filename=\"r.txt\"\r\n\
             Content-Type: text/plain\r\n\r\n\
             {file}\r\n\
             --{boundary}--{epilogue}"
        );
        (
            format!("multipart/form-data; boundary={boundary}"),
            body.into_bytes(),
        )
    }

    fn digest(content_type: &str, body: &[u8]) -> [u8; 32] {
        match fingerprint(content_type, body) {
            Some(Ok(digest)) => digest,
            other => panic!("{content_type}: {other:?}"),
        }
    }

    #[test]
    fn framing_is_no_part_of_the_identity() {
        let (ct, body) = form("X-abc", "", "", "paid");
        let first = digest(&ct, &body);
        for (boundary, preamble, epilogue) in [
            ("----WebKitFormBoundary7MA4YWxkTrZu0gW", "", "\r\n"),
            (
                "------------------------d74496d66958873e",
                "a preamble\r\n",
                "",
            ),
            ("geckoformboundary2c7b9f1", "", "\r\nan epilogue"),
        ] {
            let (ct, body) = form(boundary, preamble, epilogue, "paid");
            assert_eq!(digest(&ct, &body), first, "{boundary}");
        }
        // Padding on the delimiter lines, header names in any case, the part's
        // media type respelled.
        let padded = b"--b \t\r\ncontent-disposition:  form-data; name=\"amount\"\r\n\r\n100\r\n\
            --b\r\nCONTENT-DISPOSITION: form-data; name=\"receipt\"; filename=\"r.txt\"\r\n\
            content-type: Text/Plain\r\n\r\npaid\r\n--b--";
        assert_eq!(digest("multipart/form-data; boundary=\"b\"", padded), first);
    }

    #[test]
    fn another_part_is_another_request() {
        let (ct, body) = form("b", "", "", "paid");
        let first = digest(&ct, &body);
        let (ct, body) = form("b", "", "", "paid twice");
        assert_ne!(digest(&ct, &body), first, "another file");
        for (from, to) in [
            ("name=\"amount\"", "name=\"total\""),
            ("filename=\"r.txt\"", "filename=\"R.txt\""),
            ("100", "101"),
            ("Content-Type: text/plain", "Content-Type: text/csv"),
        ] {
            let (ct, body) = form("b", "", "", "paid");
            let changed = String::from_utf8(body).unwrap().replacen(from, to, 1);
            assert_ne!(digest(&ct, changed.as_bytes()), first, "{from} -> {to}");
        }
        // The same parts in another order.
        let swapped =
            b"--b\r\nContent-Disposition: form-data; name=\"receipt\"; filename=\"r.txt\"\r\n\
            Content-Type: text/plain\r\n\r\npaid\r\n\
            --b\r\nContent-Disposition: form-data; name=\"amount\"\r\n\r\n100\r\n--b--";
        assert_ne!(digest("multipart/form-data; boundary=b", swapped), first);
        // Bytes that move between a part's data and its headers.
        let a = digest(
            "multipart/mixed; boundary=b",
            b"--b\r\nA: 1\r\n\r\nB: 2\r\n--b--",
        );
        let b = digest(
            "multipart/mixed; boundary=b",
            b"--b\r\nA: 1\r\nB: 2\r\n\r\n\r\n--b--",
        );
        assert_ne!(a, b);
        assert_ne!(
            digest("multipart/mixed; boundary=b", b"--b--"),
            a,
            "no part"
        );
    }

    /// What a form parser reads differently is never one identity.
    #[test]
    fn what_parsers_read_apart_stays_apart() {
        let ct = "multipart/form-data; boundary=b";
        let form = |preamble: &str, disposition: &str, value: &str| {
            let body = format!(
                "{preamble}--b\r\nContent-Disposition: {disposition}\r\n\r\n{value}\r\n--b--"
            );
            digest(ct, body.as_bytes())
        };
        // A delimiter right after text is the first one: its part counts.
        let plain = "form-data; name=\"amount\"";
        assert_ne!(form("x", plain, "100"), form("x", plain, "999"));
        // The case of a parameter's name, escapes, parameter order.
        for (a, b) in [
            (
                "form-data; Name=\"fee\"; name=\"amount\"",
                "form-data; name=\"fee\"; Name=\"amount\"",
            ),
            ("form-data; name=\"a\\mount\"", "form-data; name=\"amount\""),
            (
                "form-data; filename=\"x; name=evil\"; name=\"real\"",
                "form-data; name=\"real\"; filename=\"x; name=evil\"",
            ),
        ] {
            assert_ne!(form("", a, "1"), form("", b, "1"), "{a} / {b}");
        }
        // A part's own parameters all count.
        let part = |content_type: &str| {
            let body = format!("--b\r\nContent-Type: {content_type}\r\n\r\n1\r\n--b--");
            digest(ct, body.as_bytes())
        };
        assert_ne!(
            part("multipart/mixed; boundary=x"),
            part("multipart/mixed; boundary=y")
        );
        assert_ne!(
            part("application/json; charset=utf-8"),
            part("application/json")
        );
        // A boundary with an escape is compared as bytes, not parts.
        assert!(fingerprint("multipart/form-data; boundary=\"a\\b\"", b"--a\\b--").is_none());
        // The parts' digest is no SHA-256 of any body.
        let body = b"--b\r\nA: 1\r\n\r\n1\r\n--b--";
        assert_ne!(digest(ct, body), crate::fingerprint(body));
    }

    #[test]
    fn malformed_bodies_are_refused() {
        let ct = "multipart/form-data; boundary=b";
        for body in [
            &b""[..],
            b"no delimiter at all",
            b"--b\r\nContent-Disposition: form-data; name=a\r\n\r\n1",
            b"--b\r\nContent-Disposition: form-data; name=a\r\n\r\n1\r\n--b",
            b"--bx\r\n\r\n1\r\n--b--",
            b"--b\r\nno colon\r\n\r\n1\r\n--b--",
            b"--b\r\nA: 1\r\n folded\r\n\r\n1\r\n--b--",
            b"--b\nA: 1\n\n1\n--b--",
            b"--b\r\nA: 1\nB: 2\r\n\r\n1\r\n--b--",
            b"--b\r\nA: 1\r2\r\n\r\n1\r\n--b--",
        ] {
            assert!(
                matches!(fingerprint(ct, body), Some(Err(_))),
                "{:?}",
                String::from_utf8_lossy(body)
            );
        }
        assert!(matches!(
            fingerprint("multipart/form-data", b"--b--"),
            Some(Err(_))
        ));
        assert!(fingerprint("application/json", b"{}").is_none());
    }
}
