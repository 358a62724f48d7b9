//! `Content-Type` compared as a media type (RFC 9110 §8.3.1), not as bytes: a
//! client that spells its retry's `Content-Type` another way sends the same
//! request. The header is stored as the client sent it; both sides are put in
//! one form when a key's uses are compared, so keys recorded before this form
//! existed compare the same way. See `docs/contract.md`, "What identifies a
//! request".

use std::borrow::Cow;

/// The form two uses of a key compare their `Content-Type` in: type, subtype and
/// parameter names in lower case, parameters sorted by name, values unquoted
/// where quoting changes nothing, `charset` values in lower case. Dropped: a
/// multipart type's `boundary` (framing, chosen anew by the client for each
/// send; the parts are compared instead), and `charset` where the body is JSON
/// (a JSON media type, or `json_body` when the endpoint fingerprints JSON): JSON
/// is UTF-8 whatever the header says (RFC 8259 §8.1).
///
/// Anything that is not one media type (no header: empty; several
/// `Content-Type` headers; a malformed one) is compared byte for byte.
pub(crate) fn canonical(raw: &str, json_body: bool) -> Cow<'_, str> {
    let Some(parsed) = MediaType::parse(raw) else {
        return Cow::Borrowed(raw);
    };
    let json = json_body || parsed.is_json();
    let multipart = parsed.essence.starts_with("multipart/");
    Cow::Owned(parsed.form(|name| multipart && name == "boundary" || json && name == "charset"))
}

/// A multipart part's `Content-Type` in one form, as [`canonical`] but keeping
/// every parameter: the part's bytes are compared as they are, so a nested
/// boundary or a charset is part of what they mean. `None` (compare it as sent)
/// when it is not one media type, or escapes a character in a quoted value
/// (form parsers read those differently).
pub(crate) fn canonical_part_type(raw: &str) -> Option<String> {
    if raw.contains('\\') {
        return None;
    }
    Some(MediaType::parse(raw)?.form(|_| false))
}

/// A multipart media type's boundary: `None` when `raw` is no multipart type
/// (or one whose boundary is not RFC 2046's), `Some(None)` when it is one
/// without a boundary.
pub(crate) fn multipart_boundary(raw: &str) -> Option<Option<Cow<'_, str>>> {
    // Every keyed request asks: most are no multipart type, and need no parse.
    if !raw
        .get(..10)
        .is_some_and(|kind| kind.eq_ignore_ascii_case("multipart/"))
    {
        return None;
    }
    let parsed = MediaType::parse(raw)?;
    if !parsed.essence.starts_with("multipart/") {
        return None;
    }
    let boundary = parsed
        .params
        .into_iter()
        .find(|(name, _)| name == "boundary")
        .map(|(_, value)| value);
    match boundary {
        None => Some(None),
        // What RFC 2046 allows, and nothing a form parser could read otherwise
        // (an escape in a quoted value): else the body is compared as bytes.
        Some(value) if is_boundary(&value) && !raw.contains('\\') => Some(Some(value)),
        Some(_) => None,
    }
}

/// RFC 2046's `boundary`: 1 to 70 `bchars`, not ending in a space.
fn is_boundary(value: &str) -> bool {
    (1..=70).contains(&value.len())
        && !value.ends_with(' ')
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"'()+_,-./:=? ".contains(&b))
}

/// Writes `;name=value` for each parameter, quoting a value only where a token
/// cannot carry it.
fn render(out: &mut String, params: Vec<(String, Cow<'_, str>)>) {
    for (name, value) in params {
        let value = if name == "charset" {
            Cow::Owned(value.to_ascii_lowercase())
        } else {
            value
        };
        out.push(';');
        out.push_str(&name);
        out.push('=');
        if !value.is_empty() && value.bytes().all(is_tchar) {
            out.push_str(&value);
        } else {
            out.push('"');
            for c in value.chars() {
                if c == '"' || c == '\\' {
                    out.push('\\');
                }
                out.push(c);
            }
            out.push('"');
        }
    }
}

/// One media type, parsed.
struct MediaType<'a> {
    /// `type/subtype`, in lower case.
    essence: String,
    /// Names in lower case; values unquoted.
    params: Vec<(String, Cow<'a, str>)>,
}

impl<'a> MediaType<'a> {
    fn parse(raw: &'a str) -> Option<Self> {
        let bytes = raw.as_bytes();
        let mut at = 0;
        let kind = token(bytes, &mut at)?;
        if bytes.get(at) != Some(&b'/') {
            return None;
        }
        at += 1;
        let subtype = token(bytes, &mut at)?;
        let mut essence = String::with_capacity(kind.len() + 1 + subtype.len());
        essence.push_str(&kind.to_ascii_lowercase());
        essence.push('/');
        essence.push_str(&subtype.to_ascii_lowercase());
        let params = parameters(raw, &mut at)?;
        Some(Self { essence, params })
    }

    /// `type/subtype;name=value…`, parameters sorted by name (stable: a name
    /// given twice keeps its values' order), those `dropped` left out.
    fn form(self, dropped: impl Fn(&str) -> bool) -> String {
        let mut params: Vec<(String, Cow<'_, str>)> = self
            .params
            .into_iter()
            .filter(|(name, _)| !dropped(name))
            .collect();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        let mut out = self.essence;
        render(&mut out, params);
        out
    }

    /// `application/json`, or a structured syntax suffix `+json` (RFC 6839).
    fn is_json(&self) -> bool {
        self.essence == "application/json" || self.essence.ends_with("+json")
    }
}

/// `*( OWS ";" OWS [ name "=" value ] )` to the end of `raw`, from `at`: names in
/// lower case, values unquoted. `None` if anything else is there.
fn parameters<'a>(raw: &'a str, at: &mut usize) -> Option<Vec<(String, Cow<'a, str>)>> {
    let bytes = raw.as_bytes();
    let mut params = Vec::new();
    loop {
        skip_ows(bytes, at);
        match bytes.get(*at) {
            None => return Some(params),
            Some(b';') => *at += 1,
            Some(_) => return None,
        }
        skip_ows(bytes, at);
        // `;` with no parameter after it is allowed (RFC 9110 §5.6.6).
        if matches!(bytes.get(*at), None | Some(b';')) {
            continue;
        }
        let name = token(bytes, at)?.to_ascii_lowercase();
        if bytes.get(*at) != Some(&b'=') {
            return None;
        }
        *at += 1;
        let value = if bytes.get(*at) == Some(&b'"') {
            quoted(raw, at)?
        } else {
            Cow::Borrowed(token(bytes, at)?)
        };
        params.push((name, value));
    }
}

/// RFC 9110's `tchar`.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// A token (one `tchar` or more) at `at`, moving past it.
fn token<'a>(bytes: &'a [u8], at: &mut usize) -> Option<&'a str> {
    let start = *at;
    while bytes.get(*at).copied().is_some_and(is_tchar) {
        *at += 1;
    }
    // Only ASCII was taken, so this is a slice on character boundaries.
    (*at > start).then(|| std::str::from_utf8(&bytes[start..*at]).ok())?
}

/// A quoted string at `at` (its opening quote), moving past its closing one.
fn quoted<'a>(raw: &'a str, at: &mut usize) -> Option<Cow<'a, str>> {
    let bytes = raw.as_bytes();
    let start = *at + 1;
    let mut i = start;
    let mut escaped = false;
    loop {
        match bytes.get(i)? {
            b'"' => break,
            b'\\' => {
                escaped = true;
                i += 2;
            }
            _ => i += 1,
        }
    }
    let inner = raw.get(start..i)?;
    *at = i + 1;
    if !escaped {
        return Some(Cow::Borrowed(inner));
    }
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        out.push(if c == '\\' { chars.next()? } else { c });
    }
    Some(Cow::Owned(out))
}

fn skip_ows(bytes: &[u8], at: &mut usize) {
    while matches!(bytes.get(*at), Some(b' ' | b'\t')) {
        *at += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::canonical;

    fn same(a: &str, b: &str, json: bool) -> bool {
        canonical(a, json) == canonical(b, json)
    }

    #[test]
    fn spellings_of_one_media_type_compare_equal() {
        for (a, b) in [
            ("application/json", "Application/JSON"),
            ("application/json", "application/json; charset=utf-8"),
            ("application/json", "application/json;charset=\"UTF-8\""),
            (
                "application/merge-patch+json; charset=utf-8",
                "application/merge-patch+json",
            ),
            ("text/plain; a=1; b=2", "text/plain;b=2 ;A=1"),
            ("text/plain; charset=utf-8", "TEXT/Plain; Charset=\"UTF-8\""),
            ("text/plain; name=\"a b\"", "text/plain; name=\"a\\ b\""),
            ("text/plain; name=x", "text/plain; name=\"x\""),
            (
                "multipart/form-data; boundary=----WebKitFormBoundaryA1",
                "multipart/form-data; boundary=\"------------------------d74496d66958873e\"",
            ),
            ("text/plain;", "text/plain"),
        ] {
            assert!(same(a, b, false), "{a} ~ {b}");
        }
        // Under a JSON fingerprint, the charset of any type.
        assert!(same("text/plain", "text/plain; charset=latin1", true));
    }

    #[test]
    fn other_media_types_stay_apart() {
        for (a, b) in [
            ("text/plain; charset=utf-8", "text/plain; charset=latin1"),
            ("text/plain", "text/plain; charset=utf-8"),
            ("application/json", "application/x-www-form-urlencoded"),
            ("application/json", ""),
            ("text/plain; name=A", "text/plain; name=a"),
            ("text/plain; a=1; a=2", "text/plain; a=2; a=1"),
            (
                "multipart/form-data; boundary=x",
                "multipart/mixed; boundary=x",
            ),
            // Not one media type: byte for byte.
            (
                "application/json, text/plain",
                "application/json,text/plain",
            ),
            ("application/json; x", "application/json;  x"),
        ] {
            assert!(!same(a, b, false), "{a} !~ {b}");
        }
    }

    #[test]
    fn the_form_is_a_fixed_point() {
        for raw in [
            "Text/Plain; B=\"x y\"; a=\"q\\\"uote\"",
            "application/json; charset=UTF-8",
            "",
            "not a media type",
        ] {
            let once = canonical(raw, false).into_owned();
            assert_eq!(canonical(&once, false), once, "{raw}");
        }
    }
}
