//! The `idem` binary on a table whose records are sealed: it opens them with the
//! ring from `IDEM_SEAL_KEYS` or a file, says when it cannot, and re-seals them
//! after a rotation so that the old key can leave.

mod support;

use bytes::Bytes;
use http::{Method, Response, StatusCode, Uri};
use http_body_util::Full;
use idem_runtime::{Idempotency, IdempotencyKey, KeyRing, Options, RequestIdentity, Sealing};
use sqlx::Sqlite;
use sqlx::sqlite::SqliteConnectOptions;
use support::{idem, idem_with};

const OLD: &str = "AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyA=";
const NEW: &str = "3q2+7wAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";

fn id(keys: &str) -> String {
    let ring = KeyRing::from_base64(keys).expect("a ring");
    ring.ids().next().expect("a key").to_string()
}

/// Records `key` through `store`, answering `receipt`.
async fn pay(store: &Idempotency<Sqlite>, key: &str, receipt: &'static str) -> Response<Bytes> {
    let uri = Uri::from_static("/payments");
    let key = IdempotencyKey::parse(key.as_bytes()).expect("a key");
    let request = RequestIdentity::new(Some(key), "alice", &Method::POST, &uri, b"{}");
    store
        .execute(request, Options::new(), move |_tx| {
            Box::pin(async move {
                let mut response = Response::new(Full::new(Bytes::from_static(receipt.as_bytes())));
                *response.status_mut() = StatusCode::CREATED;
                response
            })
        })
        .await
}

#[tokio::test]
async fn sealed_records_open_with_the_ring_and_reseal() {
    let dir = std::env::temp_dir().join(format!("idem_cli_sealed_{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let path = dir.join("keys.db");
    let pool = sqlx::SqlitePool::connect_with(
        SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true),
    )
    .await
    .expect("sqlite");
    let store = Idempotency::builder(pool.clone())
        .sealing(Sealing::On(KeyRing::from_base64(OLD).expect("a ring")))
        .build()
        .expect("a store");
    store.migrate().await.expect("migrate");
    for (key, receipt) in [("k-1", "card 4242, receipt one"), ("k-2", "receipt two")] {
        assert_eq!(pay(&store, key, receipt).await.status(), 201);
    }
    pool.close().await;
    let url = format!("sqlite://{}", path.display());

    // Without the ring: what it is sealed under, and how to open it; never the body.
    let blind = idem(&url, &["show", "--scope", "alice", "k-1"]);
    assert_eq!(blind.code, 0, "{}", blind.stderr);
    assert!(
        blind
            .stdout
            .contains(&format!("sealed:      under key {}", id(OLD))),
        "{}",
        blind.stdout
    );
    assert!(blind.stdout.contains("IDEM_SEAL_KEYS"), "{}", blind.stdout);
    assert!(!blind.stdout.contains("4242") && !blind.stdout.contains("body ("));

    // With it, from the environment or a file (one trailing newline dropped).
    let seen = idem_with(
        &url,
        &["show", "--scope", "alice", "k-1"],
        &[("IDEM_SEAL_KEYS", OLD)],
    );
    assert_eq!(seen.code, 0, "{}", seen.stderr);
    assert!(
        seen.stdout.contains("card 4242, receipt one"),
        "{}",
        seen.stdout
    );
    assert!(seen.stdout.contains("status:      201"), "{}", seen.stdout);
    let file = dir.join("ring");
    std::fs::write(&file, format!("{NEW},{OLD}\n")).expect("ring file");
    let ring_path = file.clone();
    let file = file.to_str().expect("a path");
    // A file others can read is refused, naming its permissions, not its keys.
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&ring_path, std::fs::Permissions::from_mode(0o644))
            .expect("chmod");
        let open = idem(
            &url,
            &["--seal-keys-file", file, "show", "--scope", "alice", "k-2"],
        );
        assert_eq!(open.code, 2, "{}", open.stderr);
        assert!(
            open.stderr.contains("0644") && open.stderr.contains("chmod 600"),
            "{}",
            open.stderr
        );
        assert!(!open.stderr.contains(&NEW[..10]) && !open.stdout.contains("receipt"));
        std::fs::set_permissions(&ring_path, std::fs::Permissions::from_mode(0o600))
            .expect("chmod");
    }
    let seen = idem(
        &url,
        &["--seal-keys-file", file, "show", "--scope", "alice", "k-2"],
    );
    assert!(
        seen.stdout.contains("receipt two"),
        "{} {}",
        seen.stdout,
        seen.stderr
    );

    // A wrong ring says so; a malformed one is refused before anything is read.
    let wrong = idem_with(
        &url,
        &["show", "--scope", "alice", "k-1"],
        &[("IDEM_SEAL_KEYS", NEW)],
    );
    assert!(wrong.stdout.contains("no longer holds"), "{}", wrong.stdout);
    assert!(!wrong.stdout.contains("4242"));
    let spaced = format!("{NEW}, {OLD}");
    let bad = idem_with(
        &url,
        &["show", "--scope", "alice", "k-1"],
        &[("IDEM_SEAL_KEYS", &spaced)],
    );
    assert_eq!(bad.code, 2, "{}", bad.stderr);
    assert!(
        bad.stderr.contains("whitespace") && !bad.stderr.contains(&NEW[..10]),
        "{}",
        bad.stderr
    );

    // Re-sealing and auditing need the ring; the audit then says the old key
    // is needed, re-sealing moves its records, and the audit lets it go.
    for command in ["reseal", "audit"] {
        let none = idem(&url, &[command]);
        assert_eq!(none.code, 2);
        assert!(none.stderr.contains("IDEM_SEAL_KEYS"), "{}", none.stderr);
    }
    let audit = |expect: &str| {
        let run = idem(&url, &["--seal-keys-file", file, "audit", "--batch", "1"]);
        assert_eq!(run.code, 0, "{}", run.stderr);
        let old = format!("key {} (in the ring): {expect}", id(OLD));
        assert!(run.stdout.contains(&old), "{old}\n{}", run.stdout);
        assert!(
            run.stdout.contains("0 records in plain text") && run.stdout.contains("read 2 rows"),
            "{}",
            run.stdout
        );
    };
    audit("2 records, 0 claims, 0 ended: needed; run idem reseal");
    let run = idem(&url, &["--seal-keys-file", file, "reseal", "--batch", "1"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(
        run.stdout.starts_with("read 2 records: 2 sealed anew"),
        "{}",
        run.stdout
    );
    assert!(run.stdout.contains("caught up"), "{}", run.stdout);
    audit("0 records, 0 claims, 0 ended: may leave");
    // A ring without the key the records are sealed under names it, and says
    // what its records answer.
    let blind = idem_with(&url, &["audit"], &[("IDEM_SEAL_KEYS", OLD)]);
    let named = format!("key {} (not in the ring): 2 records", id(NEW));
    assert!(
        blind.stdout.contains(&named) && blind.stdout.contains("record-unreadable"),
        "{}",
        blind.stdout
    );
    let moved = idem_with(
        &url,
        &["show", "--scope", "alice", "k-1"],
        &[("IDEM_SEAL_KEYS", NEW)],
    );
    assert!(
        moved.stdout.contains(&format!("under key {}", id(NEW))),
        "{}",
        moved.stdout
    );
    assert!(
        moved.stdout.contains("card 4242, receipt one"),
        "{}",
        moved.stdout
    );

    // A store whose ring names a context: its records open only where the tool
    // names the same one (`--seal-context` or `IDEM_SEAL_CONTEXT`).
    let pool = sqlx::SqlitePool::connect_with(SqliteConnectOptions::new().filename(&path))
        .await
        .expect("sqlite");
    let bound = Idempotency::builder(pool.clone())
        .sealing(Sealing::On(
            KeyRing::from_base64(NEW)
                .expect("a ring")
                .with_context("payments-test/idempotency_keys"),
        ))
        .build()
        .expect("a store");
    let paid = pay(&bound, "k-3", "receipt three").await;
    assert_eq!(paid.status(), 201, "{:?}", paid.body());
    pool.close().await;
    let show = ["show", "--scope", "alice", "k-3"];
    let elsewhere = idem_with(&url, &show, &[("IDEM_SEAL_KEYS", NEW)]);
    assert!(
        elsewhere.stdout.contains("does not open") && !elsewhere.stdout.contains("receipt three"),
        "{}",
        elsewhere.stdout
    );
    let named = idem_with(
        &url,
        &[
            "--seal-context",
            "payments-test/idempotency_keys",
            "show",
            "--scope",
            "alice",
            "k-3",
        ],
        &[("IDEM_SEAL_KEYS", NEW)],
    );
    assert!(
        named.stdout.contains("receipt three"),
        "{} {}",
        named.stdout,
        named.stderr
    );
    let from_env = idem_with(
        &url,
        &show,
        &[
            ("IDEM_SEAL_KEYS", NEW),
            ("IDEM_SEAL_CONTEXT", "payments-test/idempotency_keys"),
        ],
    );
    assert!(
        from_env.stdout.contains("receipt three"),
        "{}",
        from_env.stdout
    );

    let _ = std::fs::remove_dir_all(dir);
}
