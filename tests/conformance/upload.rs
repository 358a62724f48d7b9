//! Uploads retried the way clients retry them: each send of a multipart form picks
//! a new boundary (curl's `-F`, reqwest's `Form`, every browser), so a retry's
//! bytes never repeat; it must still be a retry. The bank's upload endpoint
//! (`/v1/receipts`, axum's `Multipart` under `#[idempotent]`) over TCP, with the
//! clients themselves.

use std::time::Duration;

use idem_axum::Outcome;

use crate::app::{Req, router_on, send};
use crate::bank;
use crate::harness::Harness;
use crate::{start, unique_suffix};

/// What a client got back: status, whether it was a replay, the body.
#[derive(Debug, Clone, PartialEq)]
struct Answer {
    status: u16,
    replayed: bool,
    body: String,
}

/// Sends the form with curl, as a user at a terminal would: `-F amount=…` and
/// `-F receipt=@file;type=text/plain`.
async fn curl(url: &str, key: &str, amount: &str, file: &std::path::Path) -> Answer {
    let output = tokio::process::Command::new("curl")
        .args(["-sS", "-i", "--max-time", "30", "-H", "Expect:"])
        .args(["-H", "authorization: Bearer alice"])
        .args(["-H", &format!("idempotency-key: {key}")])
        .args(["-F", &format!("amount={amount}")])
        .args([
            "-F",
            &format!("receipt=@{};type=text/plain", file.display()),
        ])
        .arg(url)
        .output()
        .await
        .expect("curl runs (the CI installs it)");
    assert!(output.status.success(), "curl: {output:?}");
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").expect("a response head");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status line");
    let replayed = head
        .lines()
        .any(|line| line.eq_ignore_ascii_case("idempotent-replayed: true"));
    Answer {
        status,
        replayed,
        body: body.to_owned(),
    }
}

async fn answer(response: reqwest::Response) -> Answer {
    let status = response.status().as_u16();
    let replayed = response
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    let body = response.text().await.expect("a body");
    Answer {
        status,
        replayed,
        body,
    }
}

/// Sends a form reqwest builds anew for each send, as a retry loop does.
async fn reqwest_form(client: &reqwest::Client, url: &str, key: &str, file: &[u8]) -> Answer {
    let receipt = reqwest::multipart::Part::bytes(file.to_vec())
        .file_name("receipt.pdf")
        .mime_str("application/pdf")
        .expect("a media type");
    let form = reqwest::multipart::Form::new()
        .text("amount", "250")
        .text("note", "café ☕")
        .part("receipt", receipt);
    let sent = client
        .post(url)
        .header("authorization", "Bearer alice")
        .header("idempotency-key", key)
        .multipart(form)
        .send()
        .await
        .expect("sent");
    answer(sent).await
}

/// A form as a browser frames it: WebKit's and Firefox's boundaries, the
/// filename quoted, the CRLFs of RFC 7578.
fn browser_form(boundary: &str, amount: &str) -> Vec<u8> {
    format!(
        "--{boundary}\r\n\
         Content-Disposition: form-data; name=\"amount\"\r\n\r\n\
         {amount}\r\n\
         --{boundary}\r\n\
         Content-Disposition: form-data; name=\"receipt\"; filename=\"scan 1.png\"\r\n\
         Content-Type: image/png\r\n\r\n\
         \u{89}PNG\r\n--not-the-boundary\r\n\r\n\
         --{boundary}--\r\n"
    )
    .into_bytes()
}

async fn browser(client: &reqwest::Client, url: &str, key: &str, boundary: &str) -> Answer {
    let sent = client
        .post(url)
        .header("authorization", "Bearer alice")
        .header("idempotency-key", key)
        .header(
            "content-type",
            format!("multipart/form-data; boundary={boundary}"),
        )
        .body(browser_form(boundary, "75"))
        .send()
        .await
        .expect("sent");
    answer(sent).await
}

async fn audit_rows<H: Harness>(h: &H) -> i64 {
    h.count("SELECT count(*) FROM audit WHERE owner = $1", &["alice"])
        .await
}

/// Contract §2: the same upload sent again by curl, by reqwest (its form built
/// anew) and by a browser (another boundary) is a retry: one execution, one row,
/// the recorded answer replayed. Another file or field value under the key is a
/// mismatch (422 naming the body); a body that is not the multipart body its
/// type announces is refused 400 before anything is claimed.
pub async fn uploads_are_retried_by_their_parts<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    h.script(bank::SCHEMA).await;
    let app = bank::app::<H>(h.store().clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let url = format!(
        "http://{}/v1/receipts",
        listener.local_addr().expect("an address")
    );
    let server =
        tokio::spawn(axum::serve(listener, axum::ServiceExt::into_make_service(app)).into_future());
    let dir = std::env::temp_dir().join(format!("idem-upload-{}", unique_suffix()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let (file, other) = (dir.join("receipt.txt"), dir.join("other.txt"));
    std::fs::write(&file, "paid 100 to ACME\n").expect("a file");
    std::fs::write(&other, "paid 100 to ACME!\n").expect("a file");
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("a client");

    let first = curl(&url, "up-curl", "100", &file).await;
    assert_eq!((first.status, first.replayed), (201, false), "{first:?}");
    let retry = curl(&url, "up-curl", "100", &file).await;
    assert_eq!(
        retry,
        Answer {
            replayed: true,
            ..first.clone()
        },
        "curl's retry"
    );
    let changed = curl(&url, "up-curl", "100", &other).await;
    assert_eq!(changed.status, 422, "another file: {changed:?}");
    assert!(changed.body.contains(r#""mismatch":"body""#), "{changed:?}");
    let changed = curl(&url, "up-curl", "101", &file).await;
    assert_eq!(changed.status, 422, "another field value: {changed:?}");

    let pdf = b"%PDF-1.7\r\n--\r\n\x00\xff binary\r\n";
    let first = reqwest_form(&client, &url, "up-reqwest", pdf).await;
    assert_eq!((first.status, first.replayed), (201, false), "{first:?}");
    let retry = reqwest_form(&client, &url, "up-reqwest", pdf).await;
    assert_eq!(
        retry,
        Answer {
            replayed: true,
            ..first.clone()
        },
        "reqwest's retry"
    );
    let changed = reqwest_form(&client, &url, "up-reqwest", b"%PDF-1.7 other").await;
    assert_eq!(changed.status, 422, "{changed:?}");

    let first = browser(
        &client,
        &url,
        "up-browser",
        "----WebKitFormBoundaryu7NEgjKx2Xc9Tq1P",
    )
    .await;
    assert_eq!((first.status, first.replayed), (201, false), "{first:?}");
    for boundary in [
        "----WebKitFormBoundaryQ3mZ8aK1vLp0Yw2c",
        "----geckoformboundary9c1e4b7d2f0a3e8b6c5d",
    ] {
        let retry = browser(&client, &url, "up-browser", boundary).await;
        assert_eq!(
            retry,
            Answer {
                replayed: true,
                ..first.clone()
            },
            "{boundary}"
        );
    }

    // Malformed under a key: refused before anything is claimed. (Without a
    // boundary axum's `Multipart` refuses it first; idem's own check is below.)
    for (content_type, body) in [
        ("multipart/form-data; boundary=b", &b"--b\r\nno end"[..]),
        (
            "multipart/form-data; boundary=zz",
            &browser_form("b", "75")[..],
        ),
        (
            "multipart/form-data; boundary=b",
            &b"--b\r\nA: 1\r\n\r\n1\r\n--b"[..],
        ),
    ] {
        let sent = client
            .post(&url)
            .header("authorization", "Bearer alice")
            .header("idempotency-key", "up-bad")
            .header("content-type", content_type)
            .body(body.to_vec())
            .send()
            .await
            .expect("sent");
        let got = answer(sent).await;
        assert_eq!(got.status, 400, "{content_type}: {got:?}");
        assert!(got.body.contains("invalid-multipart"), "{got:?}");
    }
    let rows = h.key_rows("alice").await;
    assert!(
        rows.iter().all(|(key, _)| key != "up-bad"),
        "nothing claimed"
    );
    assert_eq!(audit_rows(&h).await, 3, "one execution per upload");
    // An endpoint that reads the body itself: no boundary, refused by idem.
    let plain =
        Req::post("alice", "up-plain", "--b--").header("content-type", "multipart/form-data");
    let got = send(&crate::app::router(&h), &plain).await;
    assert_eq!(got.status, 400, "{}", got.text());
    assert_eq!(got.problem().as_deref(), Some("invalid-multipart"));
    assert_eq!(h.effects("alice").await, 0);
    server.abort();
    let _ = std::fs::remove_dir_all(&dir);
    h.finish().await;
}

/// Contract §2: a multipart key recorded by an earlier release (its fingerprint
/// the SHA-256 of the body's bytes) still replays a retry of those bytes after
/// the upgrade; a retry whose client framed the form anew did not match it then
/// and does not now.
pub async fn multipart_keys_of_earlier_releases_still_replay<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let table = "legacy_uploads";
    let body = browser_form("----WebKitFormBoundaryu7NEgjKx2Xc9Tq1P", "75");
    h.legacy_table(table, &body).await;
    let store = h.store_on(table);
    store.migrate().await.expect("upgrade");
    let app = router_on::<H>(store);
    let upload = |boundary: &str| {
        let body = String::from_utf8(browser_form(boundary, "75")).expect("text");
        Req::post("alice", "k-old", &body).header(
            "content-type",
            format!("multipart/form-data; boundary={boundary}"),
        )
    };
    let replay = send(&app, &upload("----WebKitFormBoundaryu7NEgjKx2Xc9Tq1P")).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed), "{}", replay.text());
    assert_eq!(replay.text(), "old-body");
    let reframed = send(&app, &upload("----WebKitFormBoundaryQ3mZ8aK1vLp0Yw2c")).await;
    assert_eq!(reframed.status, 422, "{}", reframed.text());
    assert_eq!(h.effects("alice").await, 0);
    h.finish().await;
}
