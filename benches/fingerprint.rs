//! What `fingerprint = "json"` costs per request against the default fingerprint of
//! the raw bytes, for a small payment body and a 1 MiB one.
//!
//! ```text
//! cargo bench --bench fingerprint            # 5 rounds
//! cargo bench --bench fingerprint -- 11      # 11 rounds
//! ```
//!
//! Each round times both fingerprints over the same bodies, alternating, and
//! reports the median of the rounds: time per body, throughput and the ratio
//! json ÷ bytes (machines here are shared: compare the ratio, not the times).

#![allow(missing_docs)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use idem_axum::{fingerprint, json_fingerprint};

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
}
