//! JSON-aware fingerprints (`docs/contract.md` §2): the SHA-256 of a body's JSON
//! value written in the canonical form of RFC 8785 (JCS), with the members named by
//! JSON Pointers (RFC 6901) left out. Two bodies that differ only in member order,
//! whitespace, string escapes or the spelling of a number (`1.0`, `1`, `1e0`) get
//! the same fingerprint.
//!
//! One deviation from RFC 8785, in the safe direction: an integer written without a
//! fraction or exponent whose magnitude exceeds 2^53 is kept digit for digit instead
//! of being rounded to the nearest double, so that two different 64-bit ids never
//! share a fingerprint (RFC 8785 would make a retry with another id a replay).

use std::borrow::Cow;
use std::cmp::Ordering;
use std::fmt;

use sha2::{Digest, Sha256};

/// Deeper nesting is refused rather than followed: the parser recurses.
const MAX_DEPTH: usize = 128;

/// The largest integer every double represents exactly, and its digit count.
const EXACT: u64 = 1 << 53;
const EXACT_DIGITS: usize = 16;

/// A body that cannot be fingerprinted as JSON: answered 400 `invalid-json`, with
/// nothing claimed or stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidJson {
    what: Cow<'static, str>,
    at: usize,
}

impl InvalidJson {
    fn new(what: impl Into<Cow<'static, str>>, at: usize) -> Self {
        Self {
            what: what.into(),
            at,
        }
    }

    /// The byte offset in the body where the problem was found.
    pub fn offset(&self) -> usize {
        self.at
    }
}

impl fmt::Display for InvalidJson {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the body is not the JSON this endpoint fingerprints: {} at byte {}",
            self.what, self.at
        )
    }
}

impl std::error::Error for InvalidJson {}

/// SHA-256 of `body`'s JSON value in its canonical form, without the values the
/// JSON Pointers in `ignore` name: an object member is left out, an array element
/// counts as `null`, and a pointer to nothing changes nothing.
///
/// # Errors
///
/// [`InvalidJson`] when the body is not one JSON value in UTF-8, repeats a member
/// name within an object, holds a number beyond the range of a double or a string
/// with a lone surrogate, or nests deeper than 128.
///
/// # Examples
///
/// ```
/// # extern crate idem_runtime as idem_axum;
/// use idem_axum::json_fingerprint;
///
/// let first = json_fingerprint(br#"{"amount": 1.0, "to": "acct-7"}"#, &[]).unwrap();
/// let rebuilt = json_fingerprint(br#"{"to":"acct-7","amount":1}"#, &[]).unwrap();
/// assert_eq!(first, rebuilt);
///
/// let stamped = br#"{"amount": 1, "to": "acct-7", "sent_at": "12:00:03"}"#;
/// assert_eq!(json_fingerprint(stamped, &["/sent_at"]).unwrap(), first);
/// assert!(json_fingerprint(b"amount=1", &[]).is_err());
/// ```
pub fn json_fingerprint(body: &[u8], ignore: &[&str]) -> Result<[u8; 32], InvalidJson> {
    let mut value = parse(body)?;
    for pointer in ignore {
        leave_out(&mut value, pointer);
    }
    let mut canonical = Canonical {
        out: Hashing::new(),
    };
    canonical.value(&value);
    Ok(canonical.out.finish())
}

/// What a JSON Pointer names in a body, read as a key.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Pointed {
    /// A string, as it is, or a number in its canonical form (`1.0` is `1`).
    Key(String),
    /// Nothing is there.
    Absent,
    /// Something that is not a key is there: what it is.
    Other(&'static str),
}

/// What `pointer` names in `body`, parsed as [`json_fingerprint`] parses it.
pub(crate) fn pointed(body: &[u8], pointer: &str) -> Result<Pointed, InvalidJson> {
    let value = parse(body)?;
    let mut at = &value;
    for token in tokens(pointer) {
        let next = match at {
            Value::Object(members) => members
                .iter()
                .find(|(name, _)| *name == token)
                .map(|(_, v)| v),
            Value::Array(items) => index(&token).and_then(|i| items.get(i)),
            _ => None,
        };
        match next {
            Some(next) => at = next,
            None => return Ok(Pointed::Absent),
        }
    }
    Ok(match at {
        Value::String(text) => Pointed::Key(text.clone().into_owned()),
        Value::Number(Number::AsWritten(digits)) => Pointed::Key((*digits).to_owned()),
        Value::Number(Number::Double(value)) => Pointed::Key(es_number(*value)),
        Value::Null => Pointed::Absent,
        Value::Bool(_) => Pointed::Other("a boolean"),
        Value::Array(_) => Pointed::Other("an array"),
        Value::Object(_) => Pointed::Other("an object"),
    })
}

/// One JSON value in UTF-8, and nothing after it.
fn parse(body: &[u8]) -> Result<Value<'_>, InvalidJson> {
    let text = std::str::from_utf8(body)
        .map_err(|error| InvalidJson::new("invalid UTF-8", error.valid_up_to()))?;
    let mut parser = Parser { text, pos: 0 };
    parser.skip_whitespace();
    let value = parser.value(0)?;
    parser.skip_whitespace();
    if parser.pos < text.len() {
        return Err(InvalidJson::new("more after the JSON value", parser.pos));
    }
    Ok(value)
}

/// A JSON Pointer's reference tokens, unescaped; none for the whole document.
fn tokens(pointer: &str) -> Vec<String> {
    match pointer.strip_prefix('/') {
        Some(path) => path
            .split('/')
            .map(|token| token.replace("~1", "/").replace("~0", "~"))
            .collect(),
        None => Vec::new(),
    }
}

/// Whether `pointer` is a JSON Pointer naming something inside a document: it
/// starts with `/`, and every `~` is followed by `0` or `1`. The whole document
/// (`""`) cannot be left out.
pub(crate) const fn is_pointer(pointer: &str) -> bool {
    let bytes = pointer.as_bytes();
    if bytes.is_empty() || bytes[0] != b'/' {
        return false;
    }
    let mut i = 1;
    while i < bytes.len() {
        if bytes[i] == b'~'
            && (i + 1 == bytes.len() || (bytes[i + 1] != b'0' && bytes[i + 1] != b'1'))
        {
            return false;
        }
        i += 1;
    }
    true
}

enum Value<'a> {
    Null,
    Bool(bool),
    Number(Number<'a>),
    String(Cow<'a, str>),
    Array(Vec<Value<'a>>),
    /// Members in canonical order, names unique.
    Object(Vec<(Cow<'a, str>, Value<'a>)>),
}

/// A number, classified once by the parser.
#[derive(Debug, Clone, Copy)]
enum Number<'a> {
    /// Written as its own canonical form: an integer of up to 15 digits other than
    /// zero (the grammar forbids leading zeros), or one beyond ±2^53, which is kept
    /// digit for digit (see the module).
    AsWritten(&'a str),
    /// Any other: its double, written in ECMAScript's form.
    Double(f64),
}

/// RFC 8785 orders member names by their UTF-16 code units. That is UTF-8's byte
/// order unless a name holds a character from U+E000 (lead byte 0xEE) up, where
/// surrogate pairs (U+10000 and above) sort before U+E000–U+FFFF.
fn utf16_order(a: &str, b: &str) -> Ordering {
    let plain = |s: &str| s.bytes().all(|b| b < 0xEE);
    if plain(a) && plain(b) {
        a.cmp(b)
    } else {
        a.encode_utf16().cmp(b.encode_utf16())
    }
}

fn leave_out(value: &mut Value<'_>, pointer: &str) {
    let tokens = tokens(pointer);
    let Some((last, parents)) = tokens.split_last() else {
        return;
    };
    let mut at = value;
    for token in parents {
        let next = match at {
            Value::Object(members) => members
                .iter_mut()
                .find(|(name, _)| name == token)
                .map(|(_, v)| v),
            Value::Array(items) => index(token).and_then(|i| items.get_mut(i)),
            _ => None,
        };
        match next {
            Some(next) => at = next,
            None => return,
        }
    }
    match at {
        Value::Object(members) => members.retain(|(name, _)| name != last),
        Value::Array(items) => {
            if let Some(item) = index(last).and_then(|i| items.get_mut(i)) {
                *item = Value::Null;
            }
        }
        _ => {}
    }
}

/// An array index as RFC 6901 writes it: `0`, or digits without a leading zero.
fn index(token: &str) -> Option<usize> {
    let digits = token.bytes().all(|b| b.is_ascii_digit());
    if token.is_empty() || !digits || (token.len() > 1 && token.starts_with('0')) {
        return None;
    }
    token.parse().ok()
}

struct Parser<'a> {
    text: &'a str,
    pos: usize,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.pos).copied()
    }

    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    fn expect(&mut self, word: &str) -> Result<(), InvalidJson> {
        if self.text[self.pos..].starts_with(word) {
            self.pos += word.len();
            Ok(())
        } else {
            Err(InvalidJson::new(format!("expected `{word}`"), self.pos))
        }
    }

    fn value(&mut self, depth: usize) -> Result<Value<'a>, InvalidJson> {
        if depth >= MAX_DEPTH && matches!(self.peek(), Some(b'{' | b'[')) {
            return Err(InvalidJson::new("nested deeper than 128", self.pos));
        }
        match self.peek() {
            Some(b'{') => self.object(depth),
            Some(b'[') => self.array(depth),
            Some(b'"') => self.string().map(Value::String),
            Some(b't') => self.expect("true").map(|()| Value::Bool(true)),
            Some(b'f') => self.expect("false").map(|()| Value::Bool(false)),
            Some(b'n') => self.expect("null").map(|()| Value::Null),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(_) => Err(InvalidJson::new("expected a value", self.pos)),
            None => Err(InvalidJson::new("unexpected end", self.pos)),
        }
    }

    fn object(&mut self, depth: usize) -> Result<Value<'a>, InvalidJson> {
        let start = self.pos;
        self.pos += 1;
        let mut members = Vec::new();
        self.skip_whitespace();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            return Ok(Value::Object(members));
        }
        loop {
            self.skip_whitespace();
            if self.peek() != Some(b'"') {
                return Err(InvalidJson::new("expected a member name", self.pos));
            }
            let name = self.string()?;
            self.skip_whitespace();
            self.expect(":")?;
            self.skip_whitespace();
            let value = self.value(depth + 1)?;
            members.push((name, value));
            self.skip_whitespace();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b'}') => {
                    self.pos += 1;
                    break;
                }
                _ => return Err(InvalidJson::new("expected `,` or `}`", self.pos)),
            }
        }
        members.sort_by(|(a, _), (b, _)| utf16_order(a, b));
        if let Some(pair) = members.windows(2).find(|pair| pair[0].0 == pair[1].0) {
            let what = format!(
                "the member name {:?} appears twice in one object",
                pair[0].0
            );
            return Err(InvalidJson::new(what, start));
        }
        Ok(Value::Object(members))
    }

    fn array(&mut self, depth: usize) -> Result<Value<'a>, InvalidJson> {
        self.pos += 1;
        let mut items = Vec::new();
        self.skip_whitespace();
        if self.peek() == Some(b']') {
            self.pos += 1;
            return Ok(Value::Array(items));
        }
        loop {
            self.skip_whitespace();
            items.push(self.value(depth + 1)?);
            self.skip_whitespace();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b']') => {
                    self.pos += 1;
                    return Ok(Value::Array(items));
                }
                _ => return Err(InvalidJson::new("expected `,` or `]`", self.pos)),
            }
        }
    }

    fn number(&mut self) -> Result<Value<'a>, InvalidJson> {
        let start = self.pos;
        let bytes = self.text.as_bytes();
        let digits = |pos: &mut usize| {
            let from = *pos;
            while bytes.get(*pos).is_some_and(u8::is_ascii_digit) {
                *pos += 1;
            }
            *pos - from
        };
        let mut pos = self.pos;
        if bytes.get(pos) == Some(&b'-') {
            pos += 1;
        }
        let whole = digits(&mut pos);
        let leading_zero = whole > 1 && bytes[pos - whole] == b'0';
        let mut ok = whole > 0 && !leading_zero;
        let integer = !matches!(bytes.get(pos), Some(b'.' | b'e' | b'E'));
        if bytes.get(pos) == Some(&b'.') {
            pos += 1;
            ok &= digits(&mut pos) > 0;
        }
        if let Some(b'e' | b'E') = bytes.get(pos) {
            pos += 1;
            if let Some(b'+' | b'-') = bytes.get(pos) {
                pos += 1;
            }
            ok &= digits(&mut pos) > 0;
        }
        if !ok {
            return Err(InvalidJson::new("malformed number", start));
        }
        self.pos = pos;
        let raw = &self.text[start..pos];
        if integer && whole_is_as_written(&raw[raw.len() - whole..]) {
            return Ok(Value::Number(Number::AsWritten(raw)));
        }
        match raw.parse::<f64>() {
            Ok(value) if value.is_finite() => Ok(Value::Number(Number::Double(value))),
            _ => Err(InvalidJson::new(
                "a number beyond the range of a double",
                start,
            )),
        }
    }

    fn string(&mut self) -> Result<Cow<'a, str>, InvalidJson> {
        self.pos += 1;
        let start = self.pos;
        let bytes = self.text.as_bytes();
        // Borrowed until the first escape.
        loop {
            match bytes.get(self.pos) {
                Some(b'"') => {
                    let text = &self.text[start..self.pos];
                    self.pos += 1;
                    return Ok(Cow::Borrowed(text));
                }
                Some(b'\\') => break,
                Some(&b) if b < 0x20 => {
                    return Err(InvalidJson::new(
                        "a control character in a string",
                        self.pos,
                    ));
                }
                Some(_) => self.pos += 1,
                None => return Err(InvalidJson::new("an unterminated string", start)),
            }
        }
        let mut out = String::from(&self.text[start..self.pos]);
        loop {
            match bytes.get(self.pos) {
                Some(b'"') => {
                    self.pos += 1;
                    return Ok(Cow::Owned(out));
                }
                Some(b'\\') => {
                    let escape = self.pos;
                    self.pos += 1;
                    let decoded = match bytes.get(self.pos) {
                        Some(b'"') => '"',
                        Some(b'\\') => '\\',
                        Some(b'/') => '/',
                        Some(b'b') => '\u{8}',
                        Some(b'f') => '\u{c}',
                        Some(b'n') => '\n',
                        Some(b'r') => '\r',
                        Some(b't') => '\t',
                        Some(b'u') => {
                            self.pos += 1;
                            let unit = self.hex4(escape)?;
                            let code = match unit {
                                0xD800..=0xDBFF => {
                                    if !self.text[self.pos..].starts_with("\\u") {
                                        return Err(InvalidJson::new("a lone surrogate", escape));
                                    }
                                    self.pos += 2;
                                    let low = self.hex4(escape)?;
                                    if !(0xDC00..=0xDFFF).contains(&low) {
                                        return Err(InvalidJson::new("a lone surrogate", escape));
                                    }
                                    0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00)
                                }
                                0xDC00..=0xDFFF => {
                                    return Err(InvalidJson::new("a lone surrogate", escape));
                                }
                                unit => unit,
                            };
                            let Some(c) = char::from_u32(code) else {
                                return Err(InvalidJson::new("an invalid escape", escape));
                            };
                            out.push(c);
                            continue;
                        }
                        _ => return Err(InvalidJson::new("an invalid escape", escape)),
                    };
                    out.push(decoded);
                    self.pos += 1;
                }
                Some(&b) if b < 0x20 => {
                    return Err(InvalidJson::new(
                        "a control character in a string",
                        self.pos,
                    ));
                }
                Some(_) => {
                    // Copy the run up to the next quote or escape, whole characters.
                    let run = self.text[self.pos..]
                        .find(|c: char| c == '"' || c == '\\' || c < '\u{20}')
                        .map_or(self.text.len(), |n| self.pos + n);
                    out.push_str(&self.text[self.pos..run]);
                    self.pos = run;
                }
                None => return Err(InvalidJson::new("an unterminated string", start)),
            }
        }
    }

    /// Four hex digits after `\u`.
    fn hex4(&mut self, escape: usize) -> Result<u32, InvalidJson> {
        let digits = self
            .text
            .get(self.pos..self.pos + 4)
            .filter(|d| d.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or_else(|| InvalidJson::new("an invalid escape", escape))?;
        self.pos += 4;
        u32::from_str_radix(digits, 16).map_err(|_| InvalidJson::new("an invalid escape", escape))
    }
}

/// Whether an integer's digits (no sign, no leading zero) are its canonical form:
/// up to 15 of them but `0` (which a double writes the same, `-0` as `0`), or a
/// magnitude beyond 2^53.
fn whole_is_as_written(digits: &str) -> bool {
    match digits.len().cmp(&EXACT_DIGITS) {
        Ordering::Greater => true,
        Ordering::Less => digits != "0",
        Ordering::Equal => digits.parse::<u64>().is_ok_and(|n| n > EXACT),
    }
}

/// Where the canonical form goes: straight into the hash, or (in tests) a buffer.
trait Sink {
    fn put(&mut self, bytes: &[u8]);
}

/// The hash, fed in blocks: one `update` per token would cost more than the hashing.
struct Hashing {
    hasher: Sha256,
    buffer: Vec<u8>,
}

const BLOCK: usize = 8 * 1024;

impl Hashing {
    fn new() -> Self {
        Self {
            hasher: Sha256::new(),
            buffer: Vec::with_capacity(BLOCK),
        }
    }

    fn finish(mut self) -> [u8; 32] {
        self.hasher.update(&self.buffer);
        self.hasher.finalize().into()
    }
}

impl Sink for Hashing {
    fn put(&mut self, bytes: &[u8]) {
        if self.buffer.len() + bytes.len() > BLOCK {
            self.hasher.update(&self.buffer);
            self.buffer.clear();
            if bytes.len() >= BLOCK {
                self.hasher.update(bytes);
                return;
            }
        }
        self.buffer.extend_from_slice(bytes);
    }
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// Writes a value in its canonical form.
struct Canonical<W> {
    out: W,
}

impl<W: Sink> Canonical<W> {
    fn put(&mut self, bytes: &[u8]) {
        self.out.put(bytes);
    }

    fn value(&mut self, value: &Value<'_>) {
        match value {
            Value::Null => self.put(b"null"),
            Value::Bool(true) => self.put(b"true"),
            Value::Bool(false) => self.put(b"false"),
            Value::Number(number) => self.number(*number),
            Value::String(text) => self.string(text),
            Value::Array(items) => {
                self.put(b"[");
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        self.put(b",");
                    }
                    self.value(item);
                }
                self.put(b"]");
            }
            Value::Object(members) => {
                self.put(b"{");
                for (i, (name, item)) in members.iter().enumerate() {
                    if i > 0 {
                        self.put(b",");
                    }
                    self.string(name);
                    self.put(b":");
                    self.value(item);
                }
                self.put(b"}");
            }
        }
    }

    fn number(&mut self, number: Number<'_>) {
        match number {
            Number::AsWritten(raw) => self.put(raw.as_bytes()),
            Number::Double(value) => self.put(es_number(value).as_bytes()),
        }
    }

    fn string(&mut self, text: &str) {
        self.put(b"\"");
        let mut from = 0;
        for (i, b) in text.bytes().enumerate() {
            let escaped: &[u8] = match b {
                b'"' => b"\\\"",
                b'\\' => b"\\\\",
                0x08 => b"\\b",
                0x09 => b"\\t",
                0x0A => b"\\n",
                0x0C => b"\\f",
                0x0D => b"\\r",
                0x00..=0x1F => b"",
                _ => continue,
            };
            self.put(&text.as_bytes()[from..i]);
            if escaped.is_empty() {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                self.put(&[
                    b'\\',
                    b'u',
                    b'0',
                    b'0',
                    HEX[usize::from(b >> 4)],
                    HEX[usize::from(b & 0xF)],
                ]);
            } else {
                self.put(escaped);
            }
            from = i + 1;
        }
        self.put(&text.as_bytes()[from..]);
        self.put(b"\"");
    }
}

/// A finite double as ECMAScript's `Number.prototype.toString` writes it, which is
/// RFC 8785's number form: the shortest digits that read back as the same double.
fn es_number(value: f64) -> String {
    if value == 0.0 {
        return "0".to_owned();
    }
    // `{:e}` gives the shortest round-trip digits: `d.ddde-7`.
    let exp_form = format!("{:e}", value.abs());
    let (mantissa, exponent) = exp_form.split_once('e').unwrap_or((&exp_form, "0"));
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let k = i32::try_from(digits.len()).unwrap_or(i32::MAX);
    let n = exponent + 1;
    let mut out = String::new();
    if value < 0.0 {
        out.push('-');
    }
    if k <= n && n <= 21 {
        out.push_str(&digits);
        out.extend(std::iter::repeat_n(
            '0',
            usize::try_from(n - k).unwrap_or(0),
        ));
    } else if 0 < n && n <= 21 {
        let (int, frac) = digits.split_at(usize::try_from(n).unwrap_or(0));
        out.push_str(int);
        out.push('.');
        out.push_str(frac);
    } else if -6 < n && n <= 0 {
        out.push_str("0.");
        out.extend(std::iter::repeat_n('0', usize::try_from(-n).unwrap_or(0)));
        out.push_str(&digits);
    } else {
        let (first, rest) = digits.split_at(1);
        out.push_str(first);
        if !rest.is_empty() {
            out.push('.');
            out.push_str(rest);
        }
        out.push('e');
        out.push(if n > 0 { '+' } else { '-' });
        out.push_str(&(n - 1).abs().to_string());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canonical(body: &str) -> String {
        let mut parser = Parser { text: body, pos: 0 };
        parser.skip_whitespace();
        let value = parser.value(0).expect("JSON");
        let mut canonical = Canonical { out: Vec::new() };
        canonical.value(&value);
        String::from_utf8(canonical.out).expect("UTF-8")
    }

    fn same(a: &str, b: &str) -> bool {
        json_fingerprint(a.as_bytes(), &[]).expect(a)
            == json_fingerprint(b.as_bytes(), &[]).expect(b)
    }

    #[test]
    fn numbers_take_the_ecmascript_form() {
        let cases = [
            (0.0, "0"),
            (-0.0, "0"),
            (1.0, "1"),
            (-1.5, "-1.5"),
            (100.0, "100"),
            (123.456, "123.456"),
            (1e20, "100000000000000000000"),
            (1e21, "1e+21"),
            (1.5e300, "1.5e+300"),
            (0.000001, "0.000001"),
            (1e-7, "1e-7"),
            (1.2345e-7, "1.2345e-7"),
            (5e-324, "5e-324"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (9007199254740992.0, "9007199254740992"),
            (0.1 + 0.2, "0.30000000000000004"),
            (333333333.3333333, "333333333.3333333"),
        ];
        for (value, text) in cases {
            assert_eq!(es_number(value), text, "{value:e}");
        }
    }

    #[test]
    fn the_canonical_form_is_rfc_8785s() {
        assert_eq!(
            canonical(r#" { "b" : [ 1.0 , 2e1, -0 ] , "a" : { "z": null, "y": true } } "#),
            r#"{"a":{"y":true,"z":null},"b":[1,20,0]}"#
        );
        // Member names sort by UTF-16 code units: U+10000 (a surrogate pair,
        // 0xD800…) comes before U+FFFD (0xFFFD), unlike in UTF-8 byte order.
        assert_eq!(
            canonical("{\"\u{fffd}\":1,\"\u{10000}\":2}"),
            "{\"\u{10000}\":2,\"\u{fffd}\":1}"
        );
        assert!(same(r#""\u00e9\n\/""#, "\"é\\n/\""));
        assert!(same(r#""\ud83d\ude00""#, "\"😀\""));
    }

    #[test]
    fn rebuilt_bodies_share_a_fingerprint_and_changed_values_do_not() {
        assert!(same(
            r#"{"amount":100,"to":"a"}"#,
            "{\n  \"to\": \"a\",\n  \"amount\": 1e2\n}"
        ));
        assert!(!same(r#"{"amount":100}"#, r#"{"amount":101}"#));
        assert!(!same(r#"{"amount":"100"}"#, r#"{"amount":100}"#));
        assert!(!same(r#"[1,2]"#, r#"[2,1]"#));
        // Past 2^53, ids that one double would merge stay apart.
        assert!(!same("12345678901234567891", "12345678901234567892"));
        assert!(same("9007199254740992", "9007199254740992.0"));
    }

    #[test]
    fn ignored_pointers_leave_their_values_out() {
        let a = br#"{"amount":1,"sent_at":"12:00","meta":{"a/b":1,"m~n":2,"k":3},"list":[1,2]}"#;
        let b = br#"{"amount":1,"sent_at":"12:09","meta":{"a/b":7,"m~n":8,"k":3},"list":[9,2]}"#;
        let ignore = [
            "/sent_at",
            "/meta/a~1b",
            "/meta/m~0n",
            "/list/0",
            "/absent/x",
            "/list/9",
        ];
        let fp = |body: &[u8]| json_fingerprint(body, &ignore).expect("JSON");
        assert_eq!(fp(a), fp(b));
        assert_eq!(fp(a), fp(br#"{"amount":1,"meta":{"k":3},"list":[null,2]}"#));
        assert_ne!(
            fp(a),
            fp(br#"{"amount":2,"sent_at":"12:00","meta":{"k":3},"list":[1,2]}"#)
        );
    }

    #[test]
    fn what_is_not_one_json_value_is_refused() {
        let refused = [
            "",
            "amount=1",
            "{\"a\":1,}",
            "[1 2]",
            "{\"a\":1} x",
            "01",
            "1.",
            "-",
            "1e400",
            "\"\\ud800\"",
            "\"\\udc00x\"",
            "\"a\u{1}\"",
            "\"\\x\"",
            "{\"a\":1,\"a\":2}",
            "{\"a\":{\"b\":1,\"b\":1}}",
            "nul",
            "\"unterminated",
        ];
        for body in refused {
            assert!(json_fingerprint(body.as_bytes(), &[]).is_err(), "{body:?}");
        }
        assert!(json_fingerprint(b"\xff", &[]).is_err());
        let deep = "[".repeat(129) + &"]".repeat(129);
        assert!(json_fingerprint(deep.as_bytes(), &[]).is_err());
        let fine = "[".repeat(128) + &"]".repeat(128);
        assert!(json_fingerprint(fine.as_bytes(), &[]).is_ok());
    }

    #[test]
    fn pointers_are_checked() {
        for good in ["/a", "/a/0", "/a~0b~1c", "/", "//"] {
            assert!(is_pointer(good), "{good}");
        }
        for bad in ["", "a", "/a~", "/a~2", "sent_at"] {
            assert!(!is_pointer(bad), "{bad}");
        }
    }
}
