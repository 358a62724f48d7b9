//! Per-endpoint settings: `ttl`, `lock`, `required`, `wait`, `ttl_header`,
//! `release_on`.

use std::time::Duration;

/// How one endpoint uses idempotency keys.
///
/// The `#[idempotent]` attribute builds one of these from its arguments; the
/// builder methods are `const` so a hand-written handler can keep its options in
/// a `const` too.
///
/// # Examples
///
/// ```
/// # extern crate idem_runtime as idem_axum;
/// use std::time::Duration;
/// use idem_axum::Options;
///
/// const PAYMENTS: Options = Options::new()
///     .ttl(Duration::from_secs(24 * 3600))
///     .lock(Duration::from_secs(30))
///     .required(true)
///     .wait(Duration::from_secs(5));
/// assert!(PAYMENTS.is_required());
/// assert_eq!(PAYMENTS.wait_duration(), Duration::from_secs(5));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    ttl: Duration,
    lock: Duration,
    required: bool,
    wait: Duration,
    ttl_header: bool,
    /// The 4xx statuses released instead of recorded: bit `n` is status `400 + n`.
    release: u128,
    /// A status given to `release_on` that is not a 4xx, for `check` to report.
    not_4xx: Option<u16>,
    /// `Some`: the body's fingerprint is its JSON value's, without these pointers.
    json: Option<&'static [&'static str]>,
}

/// 408 Request Timeout, 425 Too Early, 429 Too Many Requests: answers that say the
/// request was not executed and may be sent again later.
const NOT_EXECUTED: [u16; 3] = [408, 425, 429];

impl Options {
    /// Defaults: `ttl` 24 hours, `lock` 30 seconds, key not required, no `wait`, no
    /// TTL header, 408, 425 and 429 released (see [`release_on`](Self::release_on)).
    pub const fn new() -> Self {
        Self {
            ttl: Duration::from_secs(24 * 60 * 60),
            lock: Duration::from_secs(30),
            required: false,
            wait: Duration::ZERO,
            ttl_header: false,
            release: 0,
            not_4xx: None,
            json: None,
        }
        .release_on(&NOT_EXECUTED)
    }

    /// How long a key is remembered, counted from its first claim. A request whose
    /// key is older is treated as never seen.
    #[must_use]
    pub const fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// The longest one execution may hold the key. An executor still running at its
    /// deadline is cancelled and rolled back (it can never commit late), and its key
    /// is free for a retry. It must be shorter than `ttl`, so that a key outlives
    /// any execution holding it: see [`check`](Self::check).
    #[must_use]
    pub const fn lock(mut self, lock: Duration) -> Self {
        self.lock = lock;
        self
    }

    /// Whether a request without `Idempotency-Key` is refused with 400 `missing-key`
    /// (otherwise it runs normally and nothing is stored).
    #[must_use]
    pub const fn required(mut self, required: bool) -> Self {
        self.required = required;
        self
    }

    /// How long a duplicate that arrives while the first request is still executing
    /// waits for it, instead of being answered 409 `in-flight` at once. When the
    /// first completes within `wait`, the duplicate gets its stored response as a
    /// replay; when it fails and releases the key, the duplicate claims the key and
    /// runs the handler itself; at the bound, 409 as without `wait`.
    ///
    /// A waiting duplicate holds no database connection. It is woken as soon as an
    /// executor of this endpoint finishes on the same instance, or, on PostgreSQL,
    /// on any instance (`LISTEN`/`NOTIFY`); otherwise it looks again after 25 ms,
    /// then at doubling intervals of at most 500 ms. On PostgreSQL the first wait
    /// starts a listener that keeps one of the pool's connections for as long as
    /// the store lives, and executors of waiting endpoints send one `NOTIFY` in
    /// their recording statement. Zero (the default) never waits.
    #[must_use]
    pub const fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Whether responses recorded for this endpoint carry `Idempotency-Key-TTL`:
    /// the whole seconds the key is kept, counted from its first request. The header
    /// is stored with the response, so every replay repeats it byte for byte.
    #[must_use]
    pub const fn ttl_header(mut self, advertise: bool) -> Self {
        self.ttl_header = advertise;
        self
    }

    /// The 4xx statuses that mean "not executed, try later": answered as the
    /// handler gave them, but not recorded. Like an answer of 500 or above, such an
    /// answer rolls back the handler's transaction and releases the key, so that a
    /// retry runs the handler again instead of replaying the refusal for the whole
    /// `ttl`. The same holds for a request without a key: its transaction is rolled
    /// back.
    ///
    /// Replaces the set, whose default is 408 Request Timeout, 425 Too Early and
    /// 429 Too Many Requests (a rate limiter's answer, for one); `&[]` records every
    /// answer below 500. Answers of 500 and above are always released. A status
    /// outside 400–499 makes [`check`](Self::check) fail.
    ///
    /// # Examples
    ///
    /// ```
    /// # extern crate idem_runtime as idem_axum;
    /// use http::StatusCode;
    /// use idem_axum::Options;
    ///
    /// // A 409 this handler answers for a conflict that may clear is not kept either.
    /// const TRANSFERS: Options = Options::new().release_on(&[409, 429]);
    /// assert!(!TRANSFERS.records(StatusCode::CONFLICT));
    /// assert!(TRANSFERS.records(StatusCode::REQUEST_TIMEOUT));
    /// assert!(Options::new().records(StatusCode::UNPROCESSABLE_ENTITY));
    /// assert!(!Options::new().records(StatusCode::TOO_MANY_REQUESTS));
    /// ```
    #[must_use]
    pub const fn release_on(mut self, statuses: &[u16]) -> Self {
        self.release = 0;
        self.not_4xx = None;
        let mut i = 0;
        while i < statuses.len() {
            let status = statuses[i];
            if status >= 400 && status <= 499 {
                self.release |= 1 << (status - 400);
            } else if self.not_4xx.is_none() {
                self.not_4xx = Some(status);
            }
            i += 1;
        }
        self
    }

    /// Fingerprints the body as JSON: a key's later uses must carry the same JSON
    /// value, not the same bytes. Member order, whitespace, string escapes and the
    /// spelling of numbers (`1.0`, `1`, `1e0`) do not count, so a client that
    /// rebuilds its body for a retry is not refused 422; the values at the JSON
    /// Pointers in `ignore` (a time the client stamps into each send, say) do not
    /// count either: an object member named there is left out, an array element
    /// counts as `null`. The canonical form is RFC 8785's, except that an integer
    /// beyond ±2^53 written without fraction or exponent is compared digit for
    /// digit (two 64-bit ids never look alike).
    ///
    /// A keyed request whose body is not one JSON value (or repeats a member name
    /// within an object) is answered 400 [`invalid-json`](crate::Problem::InvalidJson),
    /// with nothing claimed. The default fingerprint is the SHA-256 of the raw
    /// bytes, or, for a `multipart/*` body, of its parts (see
    /// [`RequestIdentity::with_body`](crate::RequestIdentity::with_body)). A
    /// pointer that does not start with `/`, or has a `~` not followed by `0` or
    /// `1`, makes [`check`](Self::check) fail.
    ///
    /// # Examples
    ///
    /// ```
    /// # extern crate idem_runtime as idem_axum;
    /// use idem_axum::Options;
    ///
    /// const PAYMENTS: Options = Options::new().json_fingerprint(&["/sent_at"]);
    /// let first = PAYMENTS.fingerprint(br#"{"amount":100,"sent_at":"12:00:00"}"#).unwrap();
    /// let retry = PAYMENTS.fingerprint(br#"{ "sent_at": "12:00:09", "amount": 1e2 }"#).unwrap();
    /// assert_eq!(first, retry);
    /// assert!(Options::new().json_fingerprint(&["sent_at"]).check().is_err());
    /// ```
    #[must_use]
    pub const fn json_fingerprint(mut self, ignore: &'static [&'static str]) -> Self {
        self.json = Some(ignore);
        self
    }

    /// The fingerprint these options give `body`: of its bytes, or of its JSON
    /// value (see [`json_fingerprint`](Self::json_fingerprint)).
    ///
    /// # Errors
    ///
    /// [`InvalidJson`](crate::InvalidJson) when the options fingerprint JSON and
    /// `body` is not JSON.
    pub fn fingerprint(&self, body: &[u8]) -> Result<[u8; 32], crate::InvalidJson> {
        match self.json {
            Some(ignore) => crate::json_fingerprint(body, ignore),
            None => Ok(crate::digest::fingerprint(body)),
        }
    }

    /// Whether the body's JSON value is fingerprinted, not its bytes.
    pub(crate) const fn fingerprints_json(&self) -> bool {
        self.json.is_some()
    }

    /// Whether an answer with `status` is recorded and replayed: below 500, and
    /// not one of [`release_on`](Self::release_on)'s.
    pub const fn records(&self, status: http::StatusCode) -> bool {
        let status = status.as_u16();
        if status >= 500 {
            return false;
        }
        status < 400 || self.release & (1 << (status - 400)) == 0
    }

    /// Checks that the options are consistent: `lock` shorter than `ttl`, only 4xx
    /// statuses in [`release_on`](Self::release_on), and JSON Pointers in
    /// [`json_fingerprint`](Self::json_fingerprint). The
    /// engine refuses every request of an endpoint whose options fail this, with
    /// 500 [`invalid-options`](crate::Problem::InvalidOptions), before anything runs.
    /// In a `const` the failure is a compile error.
    ///
    /// # Errors
    ///
    /// [`InvalidOptions`] naming both durations, or the status that is not a 4xx.
    ///
    /// # Examples
    ///
    /// ```
    /// # extern crate idem_runtime as idem_axum;
    /// use std::time::Duration;
    /// use idem_axum::Options;
    ///
    /// let short_ttl = Options::new().ttl(Duration::from_secs(10));
    /// assert!(short_ttl.check().is_err(), "the default lock is 30 s");
    /// assert!(short_ttl.lock(Duration::from_secs(5)).check().is_ok());
    /// ```
    pub const fn check(self) -> Result<Self, InvalidOptions> {
        if let Some(status) = self.not_4xx {
            return Err(InvalidOptions(Invalid::NotA4xx(status)));
        }
        if let Some(ignore) = self.json {
            let mut i = 0;
            while i < ignore.len() {
                if !crate::json::is_pointer(ignore[i]) {
                    return Err(InvalidOptions(Invalid::NotAPointer(ignore[i])));
                }
                i += 1;
            }
        }
        if self.lock.as_nanos() < self.ttl.as_nanos() {
            Ok(self)
        } else {
            Err(InvalidOptions(Invalid::LockNotShorter {
                ttl: self.ttl,
                lock: self.lock,
            }))
        }
    }

    /// See [`wait`](Self::wait).
    pub const fn wait_duration(&self) -> Duration {
        self.wait
    }

    /// See [`ttl_header`](Self::ttl_header).
    pub const fn advertises_ttl(&self) -> bool {
        self.ttl_header
    }

    /// See [`ttl`](Self::ttl).
    pub const fn ttl_duration(&self) -> Duration {
        self.ttl
    }

    /// See [`lock`](Self::lock).
    pub const fn lock_duration(&self) -> Duration {
        self.lock
    }

    /// See [`required`](Self::required).
    pub const fn is_required(&self) -> bool {
        self.required
    }

    pub(crate) fn ttl_millis(&self) -> i64 {
        millis(self.ttl)
    }

    pub(crate) fn lock_millis(&self) -> i64 {
        // A zero lock would make every claim stale at birth.
        millis(self.lock).max(1)
    }
}

impl Default for Options {
    fn default() -> Self {
        Self::new()
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 4)
}

/// [`Options`] whose `lock` is not shorter than their `ttl`, or that release a
/// status other than a 4xx; see [`Options::check`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InvalidOptions(Invalid);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Invalid {
    LockNotShorter { ttl: Duration, lock: Duration },
    NotA4xx(u16),
    NotAPointer(&'static str),
}

impl std::fmt::Display for InvalidOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Invalid::LockNotShorter { ttl, lock } => write!(
                f,
                "lock ({lock:?}) must be shorter than ttl ({ttl:?}): a key must outlive any execution holding it"
            ),
            Invalid::NotA4xx(status) => write!(
                f,
                "release_on takes statuses from 400 to 499, not {status}: an answer of 500 or \
                 above is always released, and one below 400 always recorded"
            ),
            Invalid::NotAPointer(pointer) => write!(
                f,
                "json_fingerprint's {pointer:?} is not a JSON Pointer to a member: it starts \
                 with `/`, and each `~` is followed by `0` (for `~`) or `1` (for `/`)"
            ),
        }
    }
}

impl std::error::Error for InvalidOptions {}
