//! The orders consumer example (`examples/orders_consumer.rs`) run as its README
//! line runs it: its demo SIGKILLs its own consumer mid-stream against the real
//! RabbitMQ, publishes duplicates, and must find every order charged once.

#![allow(missing_docs)]

#[path = "support/example.rs"]
mod example;

use std::process::Stdio;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_charges_every_order_once_across_a_kill() {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
    if tokio::net::TcpStream::connect("127.0.0.1:5672")
        .await
        .is_err()
        && std::env::var("AMQP_URL").is_err()
    {
        assert!(!ci, "RabbitMQ not reachable at 127.0.0.1:5672");
        eprintln!(
            "SKIPPED: RabbitMQ not reachable at 127.0.0.1:5672; CI=true makes this a failure"
        );
        return;
    }
    let child = tokio::process::Command::new(example::orders_consumer())
        .arg("demo")
        .env_remove("DATABASE_URL")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start the demo");
    let pid = child.id().expect("a running demo");
    let output = tokio::time::timeout(Duration::from_secs(180), child.wait_with_output())
        .await
        .expect("the demo ended within 180 s")
        .expect("its output");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("killed the consumer with"), "{stdout}");
    assert!(
        stdout.contains("100 orders, 190 messages: 100 charged exactly once"),
        "{stdout}"
    );
    let scratch = std::fs::read_dir(std::env::temp_dir())
        .expect("temp dir")
        .filter_map(Result::ok)
        .filter(|entry| {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            name.starts_with("orders-demo-") && name.contains(&format!("-{pid}-"))
        })
        .count();
    assert_eq!(scratch, 0, "the demo removes its scratch databases");
}
