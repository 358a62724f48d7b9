//! The replay cache holds no more memory than its bound, whatever the shape of the
//! responses it keeps: measured by bytes held, with a counting allocator (this
//! binary's only test, so that no other test's allocations are counted).
//!
//! Each shape runs twice on its own in-memory SQLite database, with the cache off
//! and with a 512 KiB cache, 4,000 keys each, every key then replayed; what the
//! second holds beyond the first after the same requests is what the cache holds.

#![allow(missing_docs)]

use std::alloc::System;
use std::time::Duration;

use bytes::{BufMut as _, Bytes, BytesMut};
use http::{HeaderName, HeaderValue, Method, Response, Uri};
use http_body_util::Full;
use idem_runtime::{HandlerFuture, Idempotency, IdempotencyKey, Options, RequestIdentity, Tx};
use sqlx::Sqlite;
use sqlx::sqlite::SqlitePoolOptions;
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const BOUND: usize = 512 * 1024;
const KEYS: usize = 4_000;

/// How a handler builds the body it answers.
#[derive(Debug, Clone, Copy)]
enum Shape {
    /// 16 bytes, allocated as such.
    Small,
    /// 600 bytes written into a buffer that grew by doubling from 128, as a
    /// serializer writing into a `Vec` leaves it (capacity 1024).
    Grown,
    /// 16 bytes written into a fresh 64 KiB buffer, as a handler that reuses a
    /// large write buffer leaves them.
    InLargeBuffer,
    /// 60 KiB: few entries, each a large share of the bound.
    Large,
    /// 16 bytes under eight headers of the handler's own (custom names, 40-byte
    /// values), all stored and replayed.
    Headers,
}

impl Shape {
    fn body(self, n: usize) -> Bytes {
        match self {
            Self::Small => Bytes::from(format!("{{\"id\":{n:>8}}}").into_bytes()),
            Self::Grown => {
                let mut out = Vec::with_capacity(128);
                while out.len() < 600 {
                    out.extend_from_slice(format!("{n:>8}").as_bytes());
                }
                out.truncate(600);
                Bytes::from(out)
            }
            Self::InLargeBuffer => {
                let mut buffer = BytesMut::with_capacity(64 * 1024);
                buffer.put_slice(format!("{{\"id\":{n:>8}}}").as_bytes());
                buffer.freeze()
            }
            Self::Large => Bytes::from(vec![b'x'; 60 * 1024]),
            Self::Headers => Self::Small.body(n),
        }
    }

    /// The response the handler answers.
    fn response(self, n: usize) -> Response<Full<Bytes>> {
        let mut response = Response::new(Full::new(self.body(n)));
        if let Self::Headers = self {
            for h in 0..8 {
                let name = HeaderName::try_from(format!("x-trace-{h}")).expect("a name");
                let value = HeaderValue::try_from(format!("{n:>20}-{h:>19}")).expect("a value");
                response.headers_mut().insert(name, value);
            }
        }
        response
    }
}

fn answer(
    response: Response<Full<Bytes>>,
) -> impl FnOnce(Tx<Sqlite>) -> HandlerFuture<Full<Bytes>> + Send + 'static {
    move |tx| {
        Box::pin(async move {
            drop(tx);
            response
        })
    }
}

/// Bytes held after `KEYS` first requests of `shape` on a fresh store.
async fn held(shape: Shape, cache: usize) -> i64 {
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect("sqlite::memory:")
        .await
        .expect("in-memory SQLite");
    let store = Idempotency::builder(pool)
        .replay_cache(cache)
        .replay_cache_refresh(Duration::from_secs(600))
        .build()
        .expect("store");
    store.migrate().await.expect("migrate");
    let uri: Uri = "/payments".parse().expect("uri");
    let send = |n: usize, prefix: &'static str| {
        let key = IdempotencyKey::parse(format!("{prefix}-{n}").as_bytes()).ok();
        let request = RequestIdentity::new(key, "memory", &Method::POST, &uri, b"{}");
        store.execute(request, Options::new(), answer(shape.response(n)))
    };
    // Statement caches and the like, before counting.
    for n in 0..50 {
        assert_eq!(send(n, "warm").await.status(), 200);
    }
    let region = Region::new(GLOBAL);
    for n in 0..KEYS {
        assert_eq!(send(n, "key").await.status(), 200);
    }
    // Replays too: a kept body handed out may allocate (a shared `Bytes` header).
    for n in 0..KEYS {
        let replay = send(n, "key").await;
        assert!(replay.headers().contains_key("idempotent-replayed"));
        if let Shape::Headers = shape {
            assert_eq!(replay.headers().len(), 9, "{:?}", replay.headers());
        }
    }
    // A reallocation's growth is counted in `bytes_allocated` and its shrinking in
    // `bytes_deallocated` already; `bytes_reallocated` is their net again.
    let change = region.change();
    let held = change.bytes_allocated as i64 - change.bytes_deallocated as i64;
    drop(store);
    held
}

#[tokio::test]
async fn the_replay_cache_holds_no_more_than_its_bound() {
    let mut report = Vec::new();
    for shape in [
        Shape::Small,
        Shape::Grown,
        Shape::InLargeBuffer,
        Shape::Large,
        Shape::Headers,
    ] {
        let without = held(shape, 0).await;
        let with = held(shape, BOUND).await;
        let cache = with - without;
        let ratio = cache as f64 / BOUND as f64;
        println!(
            "{shape:?}: {KEYS} keys, bound {BOUND} B: held {cache} B by the cache ({ratio:.2}× the bound)"
        );
        report.push((shape, ratio));
    }
    for (shape, ratio) in report {
        assert!(
            ratio <= 1.1,
            "{shape:?}: the cache held {ratio:.2}× its bound"
        );
        // Filled, too: an entry that weighs far more than it holds wastes the bound.
        // (60 KiB entries fill a shard one at a time.)
        assert!(
            matches!(shape, Shape::Large) || ratio >= 0.8,
            "{shape:?}: the cache held only {ratio:.2}× its bound"
        );
    }
}
