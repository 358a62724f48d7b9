//! Property tests: the `Idempotency-Key` parser on arbitrary bytes grown from a seed
//! corpus (`tests/corpus/idempotency-key/`, one header value per file, named `ok-*`
//! or `bad-*`), and the claim → execute → record state machine against a model,
//! on SQLite, over random sequences of requests.
//!
//! `PROPTEST_CASES=2000 cargo test -p idem-runtime --features sqlite --test properties` runs longer.

#![allow(missing_docs)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Response, StatusCode, Uri};
use http_body_util::Full;
use idem_runtime::{
    HandlerFuture, IDEMPOTENCY_KEY, Idempotency, IdempotencyKey, MAX_KEY_LEN, Options, Outcome,
    RequestIdentity, Tx,
};
use proptest::prelude::*;
use sqlx::Sqlite;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

fn corpus() -> &'static [(String, Vec<u8>)] {
    static CORPUS: OnceLock<Vec<(String, Vec<u8>)>> = OnceLock::new();
    CORPUS.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/idempotency-key");
        let mut entries: Vec<_> = std::fs::read_dir(&dir)
            .expect("the seed corpus")
            .map(|entry| {
                let entry = entry.expect("corpus entry");
                let name = entry.file_name().to_string_lossy().into_owned();
                (name, std::fs::read(entry.path()).expect("corpus file"))
            })
            .collect();
        entries.sort();
        assert!(entries.len() >= 20, "the seed corpus is missing");
        entries
    })
}

/// What every parse result must satisfy, whatever the input.
fn check_parsed(raw: &[u8]) -> Result<(), TestCaseError> {
    if let Ok(key) = IdempotencyKey::parse(raw) {
        let value = key.as_str();
        prop_assert!((1..=MAX_KEY_LEN).contains(&value.len()), "{value:?}");
        prop_assert!(
            value.bytes().all(|b| (0x20..=0x7e).contains(&b)),
            "{value:?}"
        );
        // Parsing what it names again, quoted, gives the same key.
        let requoted = quote(value);
        prop_assert_eq!(
            IdempotencyKey::parse(requoted.as_bytes()).map(|k| k.as_str().to_owned()),
            Ok(value.to_owned())
        );
    }
    // The header path agrees with the parser wherever the bytes make a header value.
    if let Ok(value) = HeaderValue::from_bytes(raw) {
        let mut headers = HeaderMap::new();
        headers.insert(IDEMPOTENCY_KEY, value.clone());
        let via_headers =
            IdempotencyKey::from_headers(&headers).map(|k| k.map(|k| k.as_str().to_owned()));
        let direct = IdempotencyKey::parse(raw).map(|k| Some(k.as_str().to_owned()));
        prop_assert_eq!(via_headers, direct);
        // Two headers are never accepted, whatever they hold.
        headers.append(IDEMPOTENCY_KEY, value);
        prop_assert!(IdempotencyKey::from_headers(&headers).is_err());
    }
    Ok(())
}

/// The RFC 8941 sf-string form of `value`.
fn quote(value: &str) -> String {
    let mut out = String::from("\"");
    for c in value.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

#[test]
fn the_seed_corpus_parses_as_named() {
    for (name, raw) in corpus() {
        let parsed = IdempotencyKey::parse(raw);
        if name.starts_with("ok-") {
            assert!(parsed.is_ok(), "{name}: {parsed:?}");
        } else {
            assert!(name.starts_with("bad-"), "{name}: name it ok-* or bad-*");
            assert!(parsed.is_err(), "{name}: {parsed:?}");
        }
        check_parsed(raw).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

/// A corpus entry with up to 8 random edits (replace, insert, delete a byte).
fn mutated() -> impl Strategy<Value = Vec<u8>> {
    let edits = prop::collection::vec((any::<usize>(), any::<u8>(), 0..3u8), 0..8);
    (prop::sample::select(corpus().to_vec()), edits).prop_map(|((_, mut raw), edits)| {
        for (at, byte, op) in edits {
            match op {
                0 if !raw.is_empty() => {
                    let at = at % raw.len();
                    raw[at] = byte;
                }
                1 => raw.insert(at % (raw.len() + 1), byte),
                _ if !raw.is_empty() => {
                    raw.remove(at % raw.len());
                }
                _ => {}
            }
        }
        raw
    })
}

/// Printable ASCII keys of every allowed length.
fn key_text() -> impl Strategy<Value = String> {
    prop::collection::vec(0x20u8..=0x7e, 1..=MAX_KEY_LEN)
        .prop_map(|bytes| bytes.into_iter().map(char::from).collect())
}

proptest! {
    #[test]
    fn any_bytes_parse_or_are_refused_and_never_panic(raw in prop::collection::vec(any::<u8>(), 0..600)) {
        check_parsed(&raw)?;
    }

    #[test]
    fn corpus_mutations_parse_or_are_refused(raw in mutated()) {
        check_parsed(&raw)?;
    }

    #[test]
    fn quoted_and_bare_forms_name_the_same_key(value in key_text()) {
        let quoted = IdempotencyKey::parse(quote(&value).as_bytes());
        prop_assert_eq!(quoted.map(|k| k.as_str().to_owned()), Ok(value.clone()));
        let bare_ok = value.bytes().all(|b| b.is_ascii_graphic() && b != b',') && !value.starts_with('"');
        if bare_ok {
            prop_assert_eq!(IdempotencyKey::parse(value.as_bytes()).map(|k| k.as_str().to_owned()), Ok(value));
        }
    }

    #[test]
    fn keys_past_the_limit_are_refused(extra in 1usize..64) {
        let value = "k".repeat(MAX_KEY_LEN + extra);
        prop_assert!(IdempotencyKey::parse(value.as_bytes()).is_err());
        prop_assert!(IdempotencyKey::parse(quote(&value).as_bytes()).is_err());
    }
}

// ---------------------------------------------------------------------------------
// The state machine against a model

/// One step: a request for key `key` with body `body`, whose handler answers `answer`;
/// or the key's record expiring.
#[derive(Debug, Clone)]
enum Step {
    Send {
        key: u8,
        body: u8,
        answer: Answer,
    },
    /// The key's expiry passes (the table's row is aged), or, on a store that
    /// keeps replays in memory, an operator deletes it there (`forget`): either
    /// way the key is as if never used.
    Expire {
        key: u8,
    },
}

#[derive(Debug, Clone, Copy)]
enum Answer {
    Created,
    Refused,
    Failed,
    Panicked,
}

impl Answer {
    fn status(self) -> StatusCode {
        match self {
            Self::Created => StatusCode::CREATED,
            Self::Refused => StatusCode::PAYMENT_REQUIRED,
            Self::Failed | Self::Panicked => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

fn step() -> impl Strategy<Value = Step> {
    let answer = prop_oneof![
        4 => Just(Answer::Created),
        2 => Just(Answer::Refused),
        1 => Just(Answer::Failed),
        1 => Just(Answer::Panicked),
    ];
    prop_oneof![
        8 => (0..3u8, 0..2u8, answer).prop_map(|(key, body, answer)| Step::Send { key, body, answer }),
        1 => (0..3u8).prop_map(|key| Step::Expire { key }),
    ]
}

struct Bench {
    runtime: tokio::runtime::Runtime,
    /// Replays from the table only.
    store: Idempotency<Sqlite>,
    /// The same table, replays kept in memory.
    cached: Idempotency<Sqlite>,
    path: PathBuf,
}

impl Drop for Bench {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm"] {
            let mut file = self.path.clone().into_os_string();
            file.push(suffix);
            let _ = std::fs::remove_file(file);
        }
    }
}

fn bench() -> &'static Bench {
    static BENCH: OnceLock<Bench> = OnceLock::new();
    BENCH.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let path =
            std::env::temp_dir().join(format!("idem_test_properties_{}.db", std::process::id()));
        let store = runtime.block_on(async {
            let pool = SqlitePoolOptions::new()
                .max_connections(4)
                .connect_with(
                    SqliteConnectOptions::new()
                        .filename(&path)
                        .create_if_missing(true)
                        .journal_mode(SqliteJournalMode::Wal)
                        .busy_timeout(Duration::from_secs(10)),
                )
                .await
                .expect("sqlite");
            sqlx::raw_sql("CREATE TABLE effects (id INTEGER PRIMARY KEY, key TEXT NOT NULL)")
                .execute(&pool)
                .await
                .expect("effects");
            let store = Idempotency::builder(pool.clone())
                .replay_cache(0)
                .build()
                .expect("store");
            store.migrate().await.expect("migrate");
            (store, Idempotency::new(pool))
        });
        let (store, cached) = store;
        Bench {
            runtime,
            store,
            cached,
            path,
        }
    })
}

fn handler(
    key: String,
    answer: Answer,
) -> impl FnOnce(Tx<Sqlite>) -> HandlerFuture<Full<Bytes>> + Send + 'static {
    move |mut tx| {
        Box::pin(async move {
            let inserted: Result<i64, _> =
                sqlx::query_scalar("INSERT INTO effects (key) VALUES (?1) RETURNING id")
                    .bind(&key)
                    .fetch_one(&mut *tx)
                    .await;
            let Ok(id) = inserted else {
                // Unexpected: the model will see a 500 it did not ask for.
                let mut failed = Response::new(Full::new(Bytes::from_static(b"insert failed")));
                *failed.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                return failed;
            };
            assert!(!matches!(answer, Answer::Panicked), "the handler panics");
            let mut response =
                Response::new(Full::new(Bytes::from(format!("{{\"effect\":{id}}}"))));
            *response.status_mut() = answer.status();
            response
        })
    }
}

/// The model's memory of one key: the body it was first used with, and the answer
/// recorded (status and body bytes).
#[derive(Clone)]
struct Recorded {
    body: u8,
    status: StatusCode,
    bytes: Bytes,
}

static RUNS: AtomicU64 = AtomicU64::new(0);

fn run_steps(steps: &[Step], cached: bool) -> Result<(), TestCaseError> {
    let bench = bench();
    let store = if cached { &bench.cached } else { &bench.store };
    let run = RUNS.fetch_add(1, Ordering::Relaxed);
    bench.runtime.block_on(async {
        let mut model: HashMap<u8, Recorded> = HashMap::new();
        let mut effects = 0i64;
        let uri = Uri::from_static("/effects");
        for (n, step) in steps.iter().enumerate() {
            match step.clone() {
                Step::Expire { key } if cached => {
                    let name = format!("r{run}-k{key}");
                    store
                        .forget("model", &name)
                        .await
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    model.remove(&key);
                }
                Step::Expire { key } => {
                    let name = format!("r{run}-k{key}");
                    sqlx::query(
                        "UPDATE idempotency_keys SET expires_at = 0 WHERE idempotency_key = ?1",
                    )
                    .bind(&name)
                    .execute(bench.store.pool())
                    .await
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    model.remove(&key);
                }
                Step::Send { key, body, answer } => {
                    let name = format!("r{run}-k{key}");
                    let request = RequestIdentity::new(
                        IdempotencyKey::parse(name.as_bytes()).ok(),
                        "model",
                        &Method::POST,
                        &uri,
                        &[b'a' + body],
                    );
                    let response = store
                        .execute(request, Options::new(), handler(name.clone(), answer))
                        .await;
                    let outcome = response.extensions().get::<Outcome>().copied();
                    let status = response.status();
                    let bytes = response.into_body();
                    match model.get(&key).cloned() {
                        Some(first) if first.body != body => {
                            prop_assert_eq!(outcome, Some(Outcome::Mismatch), "step {}", n);
                            prop_assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
                        }
                        Some(first) => {
                            prop_assert_eq!(outcome, Some(Outcome::Replayed), "step {}", n);
                            prop_assert_eq!(status, first.status);
                            prop_assert_eq!(&bytes, &first.bytes, "replayed byte for byte");
                        }
                        None if status.is_server_error() => {
                            prop_assert!(
                                matches!(answer, Answer::Failed | Answer::Panicked),
                                "step {}: {:?}",
                                n,
                                status
                            );
                            prop_assert_eq!(outcome, Some(Outcome::Released));
                        }
                        None => {
                            prop_assert!(matches!(answer, Answer::Created | Answer::Refused));
                            prop_assert_eq!(outcome, Some(Outcome::Executed), "step {}", n);
                            prop_assert_eq!(status, answer.status());
                            effects += 1;
                            model.insert(
                                key,
                                Recorded {
                                    body,
                                    status,
                                    bytes,
                                },
                            );
                        }
                    }
                }
            }
            let committed: i64 =
                sqlx::query_scalar("SELECT count(*) FROM effects WHERE key LIKE ?1")
                    .bind(format!("r{run}-k%"))
                    .fetch_one(bench.store.pool())
                    .await
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(committed, effects, "step {}: business writes", n);
        }
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn the_engine_follows_its_model(steps in prop::collection::vec(step(), 1..40)) {
        run_steps(&steps, false)?;
    }

    #[test]
    fn the_engine_with_replays_in_memory_follows_its_model(
        steps in prop::collection::vec(step(), 1..40),
    ) {
        run_steps(&steps, true)?;
    }
}
