//! What `fingerprint = "json"` costs per request against the default fingerprint of
//! the raw bytes, for a small payment body and a 1 MiB one; and what identifying a
//! multipart upload by its parts costs against the plain SHA-256 of the same body
//! (a form with a small file, uploads of 1 and 20 MiB), with the heap it takes.
//!
//! ```text
//! cargo bench --bench fingerprint            # 5 rounds
//! cargo bench --bench fingerprint -- 11      # 11 rounds
//! ```
//!
//! Each round times both fingerprints over the same bodies, alternating, and
//! reports the median of the rounds: time per body, throughput and the ratio
//! json ÷ bytes, or parts ÷ bytes (machines here are shared: compare the ratio,
//! not the times). A multipart identity also hashes the bytes once (rows of
//! earlier releases match by them), so about 2× is its floor.

#![allow(missing_docs)]

use std::alloc::System;
use std::hint::black_box;
use std::time::{Duration, Instant};

use http::{Method, Uri};
use idem_axum::{IdempotencyKey, Options, RequestIdentity, fingerprint, json_fingerprint};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

/// The system allocator, counting: what identifying an upload allocates.
#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// An upload as a browser frames it: two fields and one file of `file` bytes.
fn upload(file: usize) -> (String, Vec<u8>) {
    let boundary = "----WebKitFormBoundary7MA4YWxkTrZu0gW";
    let mut body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"amount\"\r\n\r\n12500\r\n\
         --{boundary}\r\nContent-Disposition: form-data; name=\"currency\"\r\n\r\nJPY\r\n\
         --{boundary}\r\nContent-Disposition: form-data; name=\"receipt\"; filename=\"scan.pdf\"\r\n\
         Content-Type: application/pdf\r\n\r\n"
    )
    .into_bytes();
    body.extend((0..file).map(|i| (i * 31 % 251) as u8));
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

/// The identity of an upload, as the axum integration computes it.
fn parts(content_type: &str, body: &[u8]) -> Option<[u8; 32]> {
    let uri = Uri::from_static("/receipts");
    RequestIdentity::new(
        IdempotencyKey::parse(b"k").ok(),
        "s",
        &Method::POST,
        &uri,
        b"",
    )
    .with_body(&Options::new(), content_type, body)
    .fingerprint()
}

/// A payment as clients send it, with a stamped time to leave out.
const SMALL: &str = r#"{"amount":12500,"currency":"JPY","to":"acct-7f3a","reference":"inv-2026-0412","sent_at":"2026-12-04T05:12:09Z"}"#;
const IGNORE: &[&str] = &["/sent_at"];

/// About 1 MiB of line items: objects of strings and numbers in an array.
fn large() -> String {
    let mut out = String::from(r#"{"sent_at":"2026-12-04T05:12:09Z","items":["#);
    let mut i = 0u32;
    while out.len() < 1 << 20 {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&format!(
            r#"{{"sku":"SKU-{i:06}","name":"Item number {i}","qty":{},"price":{}.{:02},"tags":["a","b"]}}"#,
            i % 7 + 1,
            i % 1000,
            i % 100
        ));
        i += 1;
    }
    out.push_str("]}");
    out
}

/// Time per call of `f`, over at least `budget`.
fn time(budget: Duration, mut f: impl FnMut()) -> Duration {
    let start = Instant::now();
    let mut calls = 0u32;
    while start.elapsed() < budget || calls == 0 {
        f();
        calls += 1;
    }
    start.elapsed() / calls
}

fn median(mut values: Vec<Duration>) -> Duration {
    values.sort();
    values[values.len() / 2]
}

fn main() {
    let rounds: usize = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .and_then(|a| a.parse().ok())
        .unwrap_or(5);
    let large = large();
    println!("rounds: {rounds} (median reported)");
    for (name, body, budget) in [
        ("small", SMALL, Duration::from_millis(300)),
        ("1 MiB", large.as_str(), Duration::from_millis(1500)),
    ] {
        let bytes = body.as_bytes();
        assert!(json_fingerprint(bytes, IGNORE).is_ok(), "the body is JSON");
        let (mut raw, mut json) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            raw.push(time(budget, || {
                black_box(fingerprint(black_box(bytes)));
            }));
            json.push(time(budget, || {
                let _ = black_box(json_fingerprint(black_box(bytes), IGNORE));
            }));
        }
        let (raw, json) = (median(raw), median(json));
        let mib_s = |d: Duration| bytes.len() as f64 / d.as_secs_f64() / f64::from(1 << 20);
        println!(
            "{name:>6} ({} B): bytes {raw:>10.2?} ({:7.1} MiB/s)  json {json:>10.2?} ({:7.1} MiB/s)  json/bytes {:.2}",
            bytes.len(),
            mib_s(raw),
            mib_s(json),
            json.as_secs_f64() / raw.as_secs_f64()
        );
    }
    for (name, file, budget) in [
        ("form + 2 KiB file", 2 << 10, Duration::from_millis(300)),
        ("1 MiB upload", 1 << 20, Duration::from_millis(1500)),
        ("20 MiB upload", 20 << 20, Duration::from_millis(3000)),
    ] {
        let (content_type, body) = upload(file);
        assert!(
            parts(&content_type, &body).is_some(),
            "the body is multipart"
        );
        let (mut raw, mut multipart) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            raw.push(time(budget, || {
                black_box(fingerprint(black_box(&body)));
            }));
            multipart.push(time(budget, || {
                black_box(parts(black_box(&content_type), black_box(&body)));
            }));
        }
        // Every byte allocated meanwhile: a bound on the heap it adds to the body's.
        let region = Region::new(GLOBAL);
        black_box(parts(&content_type, &body));
        let heap = region.change().bytes_allocated;
        let (raw, multipart) = (median(raw), median(multipart));
        let mib_s = |d: Duration| body.len() as f64 / d.as_secs_f64() / f64::from(1 << 20);
        println!(
            "{name:>17} ({} B): bytes {raw:>10.2?} ({:7.1} MiB/s)  parts {multipart:>10.2?} ({:7.1} MiB/s)  parts/bytes {:.2}  allocated while identifying {heap} B",
            body.len(),
            mib_s(raw),
            mib_s(multipart),
            multipart.as_secs_f64() / raw.as_secs_f64()
        );
    }
}
