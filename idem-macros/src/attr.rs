//! The attribute's options: `scope` or `unscoped`, `ttl`, `lock`, `wait`,
//! `required`, `ttl_header`, `release_on`, `fingerprint`, `ignore`, `key` (where
//! the request carries it), `verify`, `db`, `crate`; and for a message handler,
//! `message`, `key` (an expression) and `payload`.

use syn::ext::IdentExt as _;
use syn::parse::{Parse, ParseStream};
use syn::{Error, Ident, Lit, LitBool, LitStr, Path, Token, Type};

const OPTIONS: &str = "`scope`, `unscoped`, `ttl`, `lock`, `wait`, `required`, `ttl_header`, \
     `release_on`, `fingerprint`, `ignore`, `key`, `verify`, `db`, `crate`, or `message` with \
     `key` and `payload`";

/// How `key = …` reads on an axum handler.
const KEY_SOURCES: &str = "an axum handler's `key` says where its requests carry the key: \
     `key = header(\"webhook-id\")` or `key = json(\"/id\")` (by default, the \
     `Idempotency-Key` header); `key = <expression>` is for message handlers, \
     `#[idempotent(message, key = …, payload = …, …)]`";

/// Where an axum handler's requests carry their key, when not in `Idempotency-Key`.
pub(crate) enum KeySource {
    /// A header, its name in lowercase.
    Header(String),
    /// A JSON Pointer into the body.
    Json(String),
}

/// Milliseconds in a day: the default `ttl`.
pub(crate) const DEFAULT_TTL_MS: u64 = 24 * 60 * 60 * 1000;
/// The default `lock`: 30 seconds.
pub(crate) const DEFAULT_LOCK_MS: u64 = 30 * 1000;

/// A duration option and where it was written.
pub(crate) struct Duration {
    pub(crate) millis: u64,
    pub(crate) lit: LitStr,
}

#[derive(Default)]
pub(crate) struct Args {
    /// `message`: the function is a message handler, not an axum handler.
    pub(crate) message: Option<Ident>,
    /// A message's id, an expression over the handler's arguments.
    pub(crate) key: Option<syn::Expr>,
    /// A message's bytes, an expression over the handler's arguments.
    pub(crate) payload: Option<syn::Expr>,
    /// Where an axum handler's requests carry their key, when not in
    /// `Idempotency-Key`; read from `key`.
    pub(crate) key_source: Option<KeySource>,
    /// The type that checks an axum handler's sender's signature.
    pub(crate) verify: Option<Type>,
    /// `scope` as written: a parameter's name (HTTP) or an expression (messages).
    pub(crate) scope_expr: Option<syn::Expr>,
    pub(crate) scope: Option<LitStr>,
    pub(crate) unscoped: Option<LitBool>,
    pub(crate) ttl: Option<Duration>,
    pub(crate) lock: Option<Duration>,
    pub(crate) wait: Option<Duration>,
    pub(crate) required: Option<LitBool>,
    pub(crate) ttl_header: Option<LitBool>,
    /// The 4xx statuses answered but not recorded, when written.
    pub(crate) release_on: Option<Vec<u16>>,
    /// `release_on` as written, for an error that points at it.
    pub(crate) release_on_at: Option<syn::Expr>,
    /// `fingerprint = "json"`: the body's JSON value is fingerprinted, not its bytes.
    pub(crate) json: bool,
    /// The JSON Pointers `ignore` leaves out of a JSON fingerprint.
    pub(crate) ignore: Vec<LitStr>,
    pub(crate) db: Option<Type>,
    /// The path the generated code names the facade by, when the dependency is
    /// renamed (`crate = "pay"`).
    pub(crate) krate: Option<Path>,
}

/// Collects errors so one mistake does not hide the next.
#[derive(Default)]
pub(crate) struct Errors(Option<Error>);

impl Errors {
    pub(crate) fn push(&mut self, error: Error) {
        match &mut self.0 {
            Some(all) => all.combine(error),
            None => self.0 = Some(error),
        }
    }

    pub(crate) fn finish(self) -> Result<(), Error> {
        self.0.map_or(Ok(()), Err)
    }
}

impl Parse for Args {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let mut args = Self::default();
        let mut errors = Errors::default();
        let mut seen: Vec<String> = Vec::new();
        let mut ignore_at = None;
        while !input.is_empty() {
            // `parse_any`: `crate` is a keyword.
            let name: Ident = Ident::parse_any(input).map_err(|e| {
                Error::new(e.span(), format!("expected an option: one of {OPTIONS}"))
            })?;
            let key = name.to_string();
            if key == "message" && (input.is_empty() || input.peek(Token![,])) {
                if args.message.is_some() {
                    errors.push(Error::new_spanned(&name, "duplicate option `message`"));
                }
                args.message = Some(name);
                if input.is_empty() {
                    break;
                }
                input.parse::<Token![,]>()?;
                continue;
            }
            input.parse::<Token![=]>()?;
            if seen.contains(&key) {
                errors.push(Error::new_spanned(
                    &name,
                    format!("duplicate option `{key}`"),
                ));
            }
            seen.push(key.clone());
            match key.as_str() {
                "db" => args.db = Some(input.parse()?),
                "crate" => match input.parse()? {
                    Lit::Str(lit) => match lit.parse::<Path>() {
                        Ok(path) => args.krate = Some(path),
                        Err(_) => errors.push(Error::new_spanned(
                            &lit,
                            "expected the path of the `idem-axum` crate as your Cargo.toml names it, \
                             like `crate = \"pay\"` for `pay = { package = \"idem-axum\", … }`",
                        )),
                    },
                    other => errors.push(Error::new_spanned(
                        other,
                        "expected a string, like `crate = \"pay\"`",
                    )),
                },
                // A string for an axum handler, any expression for a message
                // handler: which one is known once every option is read.
                "scope" => {
                    let written: syn::Expr = input.parse()?;
                    if let syn::Expr::Lit(syn::ExprLit {
                        lit: Lit::Str(lit), ..
                    }) = &written
                    {
                        args.scope = Some(lit.clone());
                    }
                    args.scope_expr = Some(written);
                }
                "key" => args.key = Some(input.parse()?),
                "payload" => args.payload = Some(input.parse()?),
                "verify" => args.verify = Some(input.parse()?),
                "ttl" | "lock" | "wait" => match input.parse()? {
                    Lit::Str(lit) => match parse_duration(&lit) {
                        Ok(millis) => {
                            let value = Some(Duration { millis, lit });
                            match key.as_str() {
                                "ttl" => args.ttl = value,
                                "lock" => args.lock = value,
                                _ => args.wait = value,
                            }
                        }
                        Err(error) => errors.push(error),
                    },
                    other => errors.push(Error::new_spanned(
                        other,
                        format!("expected a duration string, like `{key} = \"30s\"`"),
                    )),
                },
                "release_on" => match input.parse()? {
                    syn::Expr::Array(array) => match statuses(&array) {
                        Ok(list) => {
                            args.release_on = Some(list);
                            args.release_on_at = Some(syn::Expr::Array(array));
                        }
                        Err(error) => errors.push(error),
                    },
                    other => errors.push(Error::new_spanned(
                        other,
                        "expected a list of 4xx statuses, like `release_on = [408, 425, 429]`",
                    )),
                },
                "fingerprint" => match input.parse()? {
                    Lit::Str(lit) if lit.value() == "json" => args.json = true,
                    Lit::Str(lit) if lit.value() == "bytes" => args.json = false,
                    other => errors.push(Error::new_spanned(
                        other,
                        "expected `fingerprint = \"json\"` (the body's JSON value: key order, \
                         whitespace and number spelling do not count) or `\"bytes\"` (the default)",
                    )),
                },
                "ignore" => {
                    let written: syn::Expr = input.parse()?;
                    match pointers(&written) {
                        Ok(list) => {
                            ignore_at = Some(written);
                            args.ignore = list;
                        }
                        Err(error) => errors.push(error),
                    }
                }
                "required" | "ttl_header" | "unscoped" => match input.parse()? {
                    Lit::Bool(lit) => match key.as_str() {
                        "required" => args.required = Some(lit),
                        "ttl_header" => args.ttl_header = Some(lit),
                        _ => args.unscoped = Some(lit),
                    },
                    other => errors.push(Error::new_spanned(
                        other,
                        "expected `true` or `false`",
                    )),
                },
                _ => {
                    let _: syn::Expr = input.parse()?;
                    errors.push(Error::new_spanned(
                        &name,
                        format!("unknown option `{key}`; expected one of {OPTIONS}"),
                    ));
                }
            }
            if input.is_empty() {
                break;
            }
            input.parse::<Token![,]>()?;
        }
        if args.message.is_none() {
            if let (Some(written), None) = (&args.scope_expr, &args.scope) {
                errors.push(Error::new_spanned(
                    written,
                    "expected the name of a handler parameter as a string, like `scope = \"user_id\"`",
                ));
            }
            if let Some(written) = &args.key {
                match key_source(written) {
                    Ok(source) => args.key_source = Some(source),
                    Err(error) => errors.push(error),
                }
            }
            if let Some(written) = &args.payload {
                errors.push(Error::new_spanned(
                    written,
                    "`payload` is for message handlers, `#[idempotent(message, key = …, \
                     payload = …, …)]`: an axum handler's payload is its request's body",
                ));
            }
        }
        if let (Some(written), false) = (&ignore_at, args.json) {
            errors.push(Error::new_spanned(
                written,
                "`ignore` leaves members out of a JSON fingerprint: add `fingerprint = \"json\"`",
            ));
        }
        let ttl = args.ttl.as_ref().map_or(DEFAULT_TTL_MS, |d| d.millis);
        let lock = args.lock.as_ref().map_or(DEFAULT_LOCK_MS, |d| d.millis);
        if lock >= ttl {
            // Point at whichever of the two was written; the other is a default.
            let message = "`lock` must be shorter than `ttl` (defaults: lock 30s, ttl 24h): a key must outlive any execution holding it";
            if let Some(written) = args.lock.as_ref().or(args.ttl.as_ref()) {
                errors.push(Error::new_spanned(&written.lit, message));
            }
        }
        errors.finish()?;
        Ok(args)
    }
}

/// Reads an axum handler's `key`: `header("name")` or `json("/pointer")`.
fn key_source(written: &syn::Expr) -> syn::Result<KeySource> {
    let syn::Expr::Call(call) = written else {
        return Err(Error::new_spanned(written, KEY_SOURCES));
    };
    let syn::Expr::Path(function) = &*call.func else {
        return Err(Error::new_spanned(written, KEY_SOURCES));
    };
    let kind = function.path.get_ident().map(ToString::to_string);
    let (Some(kind), 1) = (kind, call.args.len()) else {
        return Err(Error::new_spanned(written, KEY_SOURCES));
    };
    let lit = match &call.args[0] {
        syn::Expr::Lit(syn::ExprLit {
            lit: Lit::Str(lit), ..
        }) => lit,
        other => {
            return Err(Error::new_spanned(
                other,
                format!(
                    "expected a string, like `{kind}(\"{}\")`",
                    if kind == "json" { "/id" } else { "webhook-id" }
                ),
            ));
        }
    };
    let text = lit.value();
    match kind.as_str() {
        "header" => {
            let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
            if text.is_empty() || !text.chars().all(token) {
                return Err(Error::new_spanned(
                    lit,
                    format!(
                        "{text:?} is not a header name: letters, digits and !#$%&'*+-.^_`|~, like \"webhook-id\""
                    ),
                ));
            }
            Ok(KeySource::Header(text.to_ascii_lowercase()))
        }
        "json" => match pointer_problem(&text) {
            Some(problem) => Err(Error::new_spanned(
                lit,
                format!("{text:?} is not a JSON Pointer to a member of the body: {problem}"),
            )),
            None => Ok(KeySource::Json(text)),
        },
        _ => Err(Error::new_spanned(&call.func, KEY_SOURCES)),
    }
}

/// Reads `release_on`'s list: integer literals from 400 to 499, each once. Every
/// wrong element gets its own error.
fn statuses(array: &syn::ExprArray) -> syn::Result<Vec<u16>> {
    let mut errors = Errors::default();
    let mut list = Vec::new();
    for element in &array.elems {
        let status = match element {
            syn::Expr::Lit(syn::ExprLit {
                lit: Lit::Int(int), ..
            }) => int.base10_parse::<u16>().ok(),
            _ => None,
        };
        match status {
            Some(status @ 400..=499) if list.contains(&status) => errors.push(Error::new_spanned(
                element,
                format!("status {status} is listed twice"),
            )),
            Some(status @ 400..=499) => list.push(status),
            _ => errors.push(Error::new_spanned(
                element,
                "`release_on` takes statuses from 400 to 499: an answer of 500 or above is \
                 always released, and one below 400 always recorded",
            )),
        }
    }
    errors.finish()?;
    Ok(list)
}

/// Reads `ignore`'s list: string literals, each a JSON Pointer (RFC 6901) to a
/// member, each once. Every wrong element gets its own error.
fn pointers(written: &syn::Expr) -> syn::Result<Vec<LitStr>> {
    let syn::Expr::Array(array) = written else {
        return Err(Error::new_spanned(
            written,
            "expected a list of JSON Pointers, like `ignore = [\"/sent_at\"]`",
        ));
    };
    let mut errors = Errors::default();
    let mut list: Vec<LitStr> = Vec::new();
    for element in &array.elems {
        let syn::Expr::Lit(syn::ExprLit {
            lit: Lit::Str(lit), ..
        }) = element
        else {
            errors.push(Error::new_spanned(
                element,
                "expected a JSON Pointer as a string, like \"/sent_at\"",
            ));
            continue;
        };
        let pointer = lit.value();
        if let Some(problem) = pointer_problem(&pointer) {
            errors.push(Error::new_spanned(
                lit,
                format!("{pointer:?} is not a JSON Pointer to a member: {problem}"),
            ));
        } else if list.iter().any(|seen| seen.value() == pointer) {
            errors.push(Error::new_spanned(
                lit,
                format!("{pointer:?} is listed twice"),
            ));
        } else {
            list.push(lit.clone());
        }
    }
    errors.finish()?;
    Ok(list)
}

/// What is wrong with `pointer` as RFC 6901 writes one, if anything.
fn pointer_problem(pointer: &str) -> Option<String> {
    if pointer.is_empty() {
        return Some("it names the whole body; name a member, like \"/sent_at\"".into());
    }
    if !pointer.starts_with('/') {
        return Some(format!("it starts with `/`, like \"/{pointer}\""));
    }
    let mut chars = pointer.chars();
    while let Some(c) = chars.next() {
        if c == '~' && !matches!(chars.next(), Some('0' | '1')) {
            return Some("`~` is written `~0`, and a `/` inside a member name `~1`".into());
        }
    }
    None
}

/// Parses "500ms", "30s", "15m", "24h", "3d" into milliseconds.
pub(crate) fn parse_duration(lit: &LitStr) -> syn::Result<u64> {
    let text = lit.value();
    let malformed = || {
        Error::new_spanned(
            lit,
            format!(
                "`{text}` is not a duration: write a whole number and a unit, like \"500ms\", \"30s\", \"15m\", \"24h\" or \"3d\""
            ),
        )
    };
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    if number.is_empty() {
        return Err(malformed());
    }
    let factor = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(malformed()),
    };
    let too_long = || Error::new_spanned(lit, format!("`{text}` is too long a duration"));
    let millis = number
        .parse::<u64>()
        .map_err(|_| too_long())?
        .checked_mul(factor)
        .filter(|ms| *ms <= 100 * 365 * 86_400_000)
        .ok_or_else(too_long)?;
    if millis == 0 {
        return Err(Error::new_spanned(
            lit,
            "a duration must be greater than zero",
        ));
    }
    Ok(millis)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proc_macro2::Span;

    fn ms(text: &str) -> Result<u64, String> {
        parse_duration(&LitStr::new(text, Span::call_site())).map_err(|e| e.to_string())
    }

    #[test]
    fn durations() {
        assert_eq!(ms("500ms"), Ok(500));
        assert_eq!(ms("30s"), Ok(30_000));
        assert_eq!(ms("15m"), Ok(900_000));
        assert_eq!(ms("24h"), Ok(86_400_000));
        assert_eq!(ms("3d"), Ok(259_200_000));
        for bad in ["", "24x", "-1s", "1.5s", "s", "1 s", "1S", " 1s"] {
            assert!(
                ms(bad).is_err_and(|e| e.contains("not a duration")),
                "{bad}"
            );
        }
        assert!(ms("0s").is_err_and(|e| e.contains("greater than zero")));
        assert!(ms("99999999999999999999d").is_err_and(|e| e.contains("too long")));
    }
}
