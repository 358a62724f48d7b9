//! Sealed records (docs/contract.md §3; docs/deployment.md, "Sealing recorded
//! responses"): with sealing on, the table holds no response and no bare digest
//! of a body, every retry still matches and replays, and a record that does not
//! open is never replayed nor run again.

use idem_axum::{Idempotency, KeyRing, Reseal, Sealing};
use sha2::{Digest as _, Sha256};

use crate::app::{Got, Req, router_on, send};
use crate::harness::{Harness, KeyRow};
use crate::{BODY, send_all, start};

/// Example keys, base64 of 32 bytes each (never use these).
const A: &str = "3q2+7wAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
const B: &str = "AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyA=";

fn ring(keys: &str) -> KeyRing {
    KeyRing::from_base64(keys).expect("a ring")
}

/// An instance of the harness's settings, sealing as told, with no replay cache:
/// every answer is read from the table.
fn instance<H: Harness>(h: &H, sealing: Sealing) -> axum::Router {
    let store: Idempotency<H::DB> = h
        .instance_on(h.store().pool().clone())
        .replay_cache(0)
        .sealing(sealing)
        .build()
        .expect("a sealing instance");
    router_on::<H>(store)
}

fn id_of(keys: &str) -> [u8; 8] {
    *ring(keys).ids().next().expect("a key").as_bytes()
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// What a sealed row must not hold: the handler's body, its headers, the bare
/// digest of the request's body.
fn assert_sealed(row: &KeyRow, keys: &str) {
    assert_eq!(row.state, "completed");
    assert_eq!(row.status, Some(0), "a sealed record's status is 0");
    assert!(row.headers.as_deref().unwrap_or_default().is_empty());
    let body = row.body.as_deref().expect("the sealed record");
    for plain in [&b"nonce"[..], b"kept", b"application/json", b"location"] {
        assert!(!contains(body, plain), "{:?} in the table", plain);
    }
    assert_eq!(body[1..9], id_of(keys), "sealed under the newest key");
    let bare = idem_axum::fingerprint(BODY.as_bytes());
    assert_ne!(row.fingerprint, bare, "a bare digest of the body is stored");
    assert!(!contains(&row.fingerprint, &bare[..8]));
    let sha = Sha256::digest(BODY.as_bytes());
    assert_ne!(row.fingerprint[..], sha[..]);
    assert_eq!(
        row.fingerprint[..8],
        id_of(keys),
        "keyed under the newest key"
    );
}

/// Rewrites alice's completed `key` into what a transaction ended behind idem's
/// back leaves (500, no response), as the table holds it; the row written.
async fn end_behind_idems_back<H: Harness>(h: &H, key: &str) -> KeyRow {
    let (_, recorded) = h
        .key_rows("alice")
        .await
        .into_iter()
        .find(|(k, _)| k == key)
        .expect("its row");
    let ended = KeyRow {
        status: Some(500),
        headers: None,
        body: None,
        ..recorded
    };
    h.rewrite_row("alice", key, &ended).await;
    ended
}

/// A request of alice's on a fresh key, sent through `app` and held at a gate
/// once its handler has started (its claim made): the key, and its answer to
/// come once the gate opens.
async fn hold_at_a_gate(app: &axum::Router) -> (String, tokio::task::JoinHandle<Got>) {
    let key = format!("k-live-{}", crate::unique_suffix());
    let (app, req) = (
        app.clone(),
        Req::post("alice", &key, BODY).header("x-gate", &key),
    );
    let held = tokio::spawn(async move { send(&app, &req).await });
    crate::await_started(&key).await;
    (key, held)
}

fn unreadable(got: &Got) -> bool {
    got.status == 500 && got.problem().as_deref() == Some("record-unreadable")
}

/// Storms of duplicates on a sealing store execute each key once; the table holds
/// only sealed records and keyed fingerprints; every retry, through another
/// instance that reads the table, replays the first answer byte for byte, and a
/// retry with another body is still told apart.
pub async fn sealed_records_replay_and_hold_no_plaintext<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let first = instance(&h, Sealing::On(ring(A)));
    let other = instance(&h, Sealing::On(ring(A)));
    let keys: Vec<String> = (0..6).map(|n| format!("k-sealed-{n}")).collect();
    let reqs = keys
        .iter()
        .flat_map(|key| (0..4).map(move |_| Req::post("alice", key, BODY)))
        .collect();
    let answers = send_all(&first, reqs).await;
    assert_eq!(h.effects("alice").await, 6, "each key ran once");
    for (key, sent) in keys.iter().zip(answers.chunks(4)) {
        assert!(sent.iter().all(|got| [201, 409].contains(&got.status)));
        let won = sent
            .iter()
            .find(|got| got.status == 201)
            .expect("an answer");
        let replay = send(&other, &Req::post("alice", key, BODY)).await;
        assert_eq!(replay.body, won.body, "replays are byte for byte");
        assert_eq!(replay.header("x-custom"), Some("kept"));
        let kept = send(&first, &Req::post("alice", key, BODY)).await;
        assert_eq!(kept.body, won.body);
        for store in [&first, &other] {
            let changed = send(store, &Req::post("alice", key, "another body")).await;
            assert_eq!(changed.status, 422, "{}", changed.text());
        }
    }
    let rows = h.key_rows("alice").await;
    assert_eq!(rows.len(), 6);
    for (_, row) in &rows {
        assert_sealed(row, A);
    }
    // One body under six keys: six fingerprints, and none equal to another
    // tenant's under the same key (what is keyed is the request's key too).
    let mut fingerprints: Vec<&[u8]> = rows.iter().map(|(_, row)| &row.fingerprint[..]).collect();
    fingerprints.sort_unstable();
    fingerprints.dedup();
    assert_eq!(fingerprints.len(), 6, "equal bodies stored apart");
    let carol = send(&first, &Req::post("carol", &keys[0], BODY)).await;
    assert_eq!(carol.status, 201);
    let theirs = &h.key_rows("carol").await[0].1;
    assert_ne!(
        theirs.fingerprint, rows[0].1.fingerprint,
        "another tenant, same key and body"
    );
    assert_eq!(h.effects("alice").await, 6, "nothing ran again");

    // A JSON fingerprint is keyed too: a body re-encoded by a retry still
    // matches, and another value does not.
    let json = |body: &str| Req::post("bob", "k-json", body).header("x-json-fingerprint", 1);
    let sent = send(&first, &json(r#"{"amount":100,"to":"acct-7"}"#)).await;
    assert_eq!(sent.status, 201);
    let again = send(&other, &json(r#"{ "to": "acct-7", "amount": 1e2 }"#)).await;
    assert_eq!(again.body, sent.body, "{}", again.text());
    let changed = send(&other, &json(r#"{"amount":101,"to":"acct-7"}"#)).await;
    assert_eq!(changed.status, 422);
    let row = &h.key_rows("bob").await[0].1;
    let bare = idem_axum::json_fingerprint(br#"{"amount":100,"to":"acct-7"}"#, &[]);
    assert_ne!(row.fingerprint, bare.expect("JSON"));
    assert_eq!(row.fingerprint[..8], id_of(A));
    // Another ring keys the same body otherwise.
    let elsewhere = instance(&h, Sealing::On(ring(B)));
    let twin = send(&elsewhere, &Req::post("carol", "k-0", BODY)).await;
    assert_eq!(twin.status, 201);
    let twin = &h.key_rows("carol").await[0].1;
    assert_ne!(twin.fingerprint[8..], rows[0].1.fingerprint[8..]);

    // An operator's look opens the record with the ring, and says it cannot
    // without one.
    let store = |sealing| -> Idempotency<H::DB> {
        h.instance_on(h.store().pool().clone())
            .sealing(sealing)
            .build()
            .expect("a store")
    };
    let record = store(Sealing::OpensSealed(ring(A)))
        .inspect("alice", &keys[0])
        .await
        .expect("inspect")
        .expect("a record");
    assert_eq!(record.sealed_by, ring(A).ids().next());
    assert_eq!(
        (record.status, record.unreadable.as_deref()),
        (Some(201), None)
    );
    assert!(contains(&record.body, b"nonce") && contains(&record.headers, b"x-custom"));
    let blind = store(Sealing::Off)
        .inspect("alice", &keys[0])
        .await
        .expect("inspect")
        .expect("a record");
    assert_eq!(blind.sealed_by, record.sealed_by);
    let why = blind.unreadable.as_deref().expect("unreadable");
    assert!(
        why.contains(&record.sealed_by.expect("a key").to_string()),
        "{why}"
    );
    assert_eq!(
        (blind.status, blind.body.len(), blind.headers.len()),
        (None, 0, 0)
    );
    h.finish().await;
}

/// A key added to the ring seals new records while older ones still open and
/// still match; a key removed leaves its records unreadable, never run again.
pub async fn rotation_keeps_every_key_answered<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let old = instance(&h, Sealing::On(ring(B)));
    let first = send(&old, &Req::post("alice", "k-old", BODY)).await;
    assert_eq!(first.status, 201, "{}", first.text());

    let rotated = instance(&h, Sealing::On(ring(&format!("{A},{B}"))));
    let replay = send(&rotated, &Req::post("alice", "k-old", BODY)).await;
    assert_eq!((replay.status, &replay.body), (201, &first.body));
    let changed = send(&rotated, &Req::post("alice", "k-old", "another body")).await;
    assert_eq!(changed.status, 422, "{}", changed.text());
    let new = send(&rotated, &Req::post("alice", "k-new", BODY)).await;
    assert_eq!(new.status, 201);
    let rows = h.key_rows("alice").await;
    assert_sealed(&rows[0].1, A);
    assert_eq!(rows[0].0, "k-new");
    assert_sealed(&rows[1].1, B);

    let removed = instance(&h, Sealing::On(ring(A)));
    for body in [BODY, "another body"] {
        let got = send(&removed, &Req::post("alice", "k-old", body)).await;
        assert!(unreadable(&got), "{} {}", got.status, got.text());
        assert!(!contains(&got.body, b"nonce"));
    }
    let still = send(&removed, &Req::post("alice", "k-new", BODY)).await;
    assert_eq!((still.status, &still.body), (201, &new.body));
    assert_eq!(h.effects("alice").await, 2, "nothing ran again");
    h.finish().await;
}

/// Rows changed by someone with write access to the table: a flipped byte, a
/// record copied to another key or scope, a fingerprint swapped, a record planted
/// in plain text. None is replayed, none runs its key again; a store without
/// sealing refuses sealed records the same way.
pub async fn changed_records_are_never_replayed<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let sealing = instance(&h, Sealing::On(ring(A)));
    for (scope, key) in [("alice", "k-1"), ("alice", "k-2"), ("bob", "k-1")] {
        let got = send(&sealing, &Req::post(scope, key, BODY)).await;
        assert_eq!(got.status, 201);
    }
    let row = |scope: &'static str, key: &'static str| {
        let h = &h;
        async move {
            let rows = h.key_rows(scope).await;
            let found = rows.into_iter().find(|(k, _)| k == key);
            found.expect("the row").1
        }
    };
    let k1 = row("alice", "k-1").await;
    let effects = h.effects("alice").await + h.effects("bob").await;

    // Each change, then what every store answers for the row; the row is put
    // back after each.
    let mut flipped = k1.clone();
    let body = flipped.body.as_mut().expect("a record");
    let last = body.len() - 20;
    body[last] ^= 1;
    let mut swapped = k1.clone();
    swapped.fingerprint[12] ^= 1;
    let mut moved_path = k1.clone();
    moved_path.path = "/other".into();
    let planted = KeyRow {
        status: Some(201),
        headers: Some(b"content-type: text/plain\r\n".to_vec()),
        body: Some(b"planted".to_vec()),
        ..k1.clone()
    };
    let originals = [
        ("alice", "k-2", row("alice", "k-2").await),
        ("bob", "k-1", row("bob", "k-1").await),
        ("alice", "k-1", k1.clone()),
    ];
    let cases: [(&str, &str, &str, &KeyRow); 6] = [
        ("a flipped byte", "alice", "k-1", &flipped),
        ("copied to another key", "alice", "k-2", &k1),
        ("copied to another scope", "bob", "k-1", &k1),
        ("another fingerprint", "alice", "k-1", &swapped),
        ("another path", "alice", "k-1", &moved_path),
        ("planted in plain text", "alice", "k-1", &planted),
    ];
    for (case, scope, key, changed) in cases {
        h.rewrite_row(scope, key, changed).await;
        let got = send(&sealing, &Req::post(scope, key, BODY)).await;
        assert!(unreadable(&got), "{case}: {} {}", got.status, got.text());
        assert!(!contains(&got.body, b"planted"), "{case}");
        for (scope, key, original) in &originals {
            h.rewrite_row(scope, key, original).await;
        }
    }
    // Sealing off: a sealed record is refused too.
    let plain = instance(&h, Sealing::Off);
    let got = send(&plain, &Req::post("alice", "k-1", BODY)).await;
    assert!(unreadable(&got), "{} {}", got.status, got.text());
    // Put back, every row replays again.
    for (scope, key, _) in &originals {
        let got = send(&sealing, &Req::post(scope, key, BODY)).await;
        assert_eq!(got.status, 201, "{scope} {key}: {}", got.text());
    }
    let now = h.effects("alice").await + h.effects("bob").await;
    assert_eq!(now, effects, "no key ran again");
    h.finish().await;
}

/// Sealing turned on, then off, in a running deployment, one step at a time:
/// instances of two adjacent steps run side by side, and each answers every key
/// the other stored; what each writes is sealed (or not) as its step says.
pub async fn sealing_turns_on_and_off_without_losing_keys<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let steps = [
        ("off", instance(&h, Sealing::Off), false),
        (
            "opens sealed",
            instance(&h, Sealing::OpensSealed(ring(A))),
            false,
        ),
        ("seals new", instance(&h, Sealing::SealsNew(ring(A))), true),
        ("on", instance(&h, Sealing::On(ring(A))), true),
    ];
    // Up the ladder, then down: each pair of neighbours, both ways round.
    let mut answers: Vec<(String, Got)> = Vec::new();
    let order = [0, 1, 2, 3, 2, 1, 0];
    for (n, pair) in order.windows(2).enumerate() {
        let (writer, reader) = (&steps[pair[0]], &steps[pair[1]]);
        for (from, to) in [(writer, reader), (reader, writer)] {
            let key = format!("k-{n}-{}", from.0.replace(' ', "-"));
            let first = send(&from.1, &Req::post("alice", &key, BODY)).await;
            assert_eq!(first.status, 201, "{key}: {}", first.text());
            let replay = send(&to.1, &Req::post("alice", &key, BODY)).await;
            assert_eq!(
                replay.body, first.body,
                "{key} written by {}, read by {}",
                from.0, to.0
            );
            let changed = send(&to.1, &Req::post("alice", &key, "another body")).await;
            assert_eq!(changed.status, 422, "{key}: {}", changed.text());
            let rows = h.key_rows("alice").await;
            let row = &rows.iter().find(|(k, _)| *k == key).expect("its row").1;
            if from.2 {
                assert_sealed(row, A);
            } else {
                assert_eq!(row.status, Some(201), "{key} is written in plain text");
                assert_eq!(row.fingerprint, idem_axum::fingerprint(BODY.as_bytes()));
            }
            answers.push((key, first));
        }
    }
    // At the ends: `On` refuses what is plain, `Off` what is sealed.
    for (key, first) in &answers {
        let sealed = h
            .key_rows("alice")
            .await
            .iter()
            .any(|(k, row)| k == key && row.status == Some(0));
        for (name, store, seals) in &steps {
            let got = send(store, &Req::post("alice", key, BODY)).await;
            let refused = (*name == "on" && !sealed) || (*name == "off" && sealed);
            if refused {
                assert!(unreadable(&got), "{key} read by {name}: {}", got.text());
            } else {
                assert_eq!(got.body, first.body, "{key} read by {name} ({seals})");
            }
        }
    }
    assert_eq!(h.effects("alice").await, 12, "each of 12 keys ran once");
    h.finish().await;
}

/// After a rotation, `reseal` seals every record anew under the newest key while
/// requests go on beside it (retries replay, new keys run), and then the old key
/// can leave the ring: every key still replays and still tells another body
/// apart. Records in plain text are sealed only when asked.
pub async fn reseal_lets_an_old_key_leave_the_ring<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let old = instance(&h, Sealing::On(ring(B)));
    let keys: Vec<String> = (0..40).map(|n| format!("k-{n:02}")).collect();
    let mut first = Vec::new();
    for chunk in keys.chunks(8) {
        let reqs = chunk.iter().map(|k| Req::post("alice", k, BODY)).collect();
        first.extend(send_all(&old, reqs).await);
    }
    assert!(first.iter().all(|got| got.status == 201));
    let plain = send(
        &instance(&h, Sealing::Off),
        &Req::post("alice", "k-plain", BODY),
    )
    .await;
    assert_eq!(plain.status, 201);

    let both = format!("{A},{B}");
    let unsealed: Idempotency<H::DB> = h
        .instance_on(h.store().pool().clone())
        .build()
        .expect("a store");
    let refused = unsealed.reseal(Reseal::new()).await.expect_err("no ring");
    assert!(refused.to_string().contains("Sealing::On"), "{refused}");
    let resealer: Idempotency<H::DB> = h
        .instance_on(h.store().pool().clone())
        .sealing(Sealing::On(ring(&both)))
        .build()
        .expect("a store");
    let rotated = instance(&h, Sealing::On(ring(&both)));
    let run = {
        let resealer = resealer.clone();
        tokio::spawn(async move {
            let gentle = Reseal::new()
                .batch(7)
                .pause(std::time::Duration::from_millis(2));
            resealer.reseal(gentle).await
        })
    };
    // Beside it: retries replay, new keys run, and no session waits for a lock.
    let mut round = 0;
    while !run.is_finished() || round < 2 {
        for (key, got) in keys.iter().zip(&first).step_by(5) {
            let replay = send(&rotated, &Req::post("alice", key, BODY)).await;
            assert_eq!(replay.body, got.body, "{key} during the re-seal");
            assert_eq!(
                h.count(H::ROW_LOCK_WAITS, &[]).await,
                0,
                "a wait on the re-seal"
            );
        }
        let new = send(
            &rotated,
            &Req::post("alice", &format!("k-new-{round}"), BODY),
        )
        .await;
        assert_eq!(new.status, 201);
        round += 1;
    }
    let report = run.await.expect("reseal task").expect("reseal");
    assert!(report.caught_up, "{report:?}");
    assert_eq!(
        (
            report.resealed,
            report.plain,
            report.unreadable,
            report.changed
        ),
        (40, 1, 0, 0),
        "{report:?}"
    );
    assert_eq!(report.read, report.resealed + report.current + report.plain);
    let again = resealer.reseal(Reseal::new()).await.expect("reseal");
    assert_eq!(
        (again.resealed, again.plain, again.current),
        (0, 1, again.read - 1),
        "{again:?}"
    );

    // The old key leaves.
    let removed = instance(&h, Sealing::On(ring(A)));
    for (key, got) in keys.iter().zip(&first) {
        let replay = send(&removed, &Req::post("alice", key, BODY)).await;
        assert_eq!(replay.body, got.body, "{key} after the old key left");
    }
    let changed = send(&removed, &Req::post("alice", "k-07", "another body")).await;
    assert_eq!(changed.status, 422, "keyed anew: {}", changed.text());
    assert!(unreadable(
        &send(&removed, &Req::post("alice", "k-plain", BODY)).await
    ));
    for (key, row) in h.key_rows("alice").await {
        if key != "k-plain" {
            assert_sealed(&row, A);
        }
    }

    // Asked to, it seals what is in plain text too.
    let plain_too = resealer
        .reseal(Reseal::new().plain(true))
        .await
        .expect("reseal");
    assert_eq!(
        (plain_too.resealed, plain_too.plain),
        (1, 0),
        "{plain_too:?}"
    );
    let replay = send(&removed, &Req::post("alice", "k-plain", BODY)).await;
    assert_eq!(replay.body, plain.body);
    let changed = send(&removed, &Req::post("alice", "k-plain", "another body")).await;
    assert_eq!(changed.status, 422);
    for (_, row) in h.key_rows("alice").await {
        assert_sealed(&row, A);
    }
    assert_eq!(
        h.effects("alice").await,
        41 + i64::from(round),
        "no key ran twice"
    );
    h.finish().await;
}

/// The process's Prometheus text: a recorder installed once for the whole run,
/// so counts only grow, whichever test moves them.
pub fn metrics_text() -> String {
    static HANDLE: std::sync::OnceLock<Option<metrics_exporter_prometheus::PrometheusHandle>> =
        std::sync::OnceLock::new();
    HANDLE
        .get_or_init(|| {
            metrics_exporter_prometheus::PrometheusBuilder::new()
                .install_recorder()
                .ok()
        })
        .as_ref()
        .expect("the only metrics recorder of the run")
        .render()
}

/// `idem_plain_replays_total` as the recorder has it now.
fn plain_replays() -> u64 {
    metrics_text()
        .lines()
        .find_map(|line| line.strip_prefix("idem_plain_replays_total "))
        .and_then(|count| count.trim().parse().ok())
        .unwrap_or(0)
}

/// Someone who can write the table replaces a sealed record with one in plain
/// text of their own (status, headers, body), keeping its keyed fingerprint, so
/// that the client's genuine retry would match: no store with a key ring replays
/// it, at any step of the ladder, and the key does not run again. A record that
/// was written in plain text (an unkeyed fingerprint) is still replayed while
/// sealing turns on or off, and each such replay is counted.
pub async fn downgraded_records_are_never_replayed<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    // Installed before the first replay, so that none goes uncounted.
    let before = plain_replays();
    let writers = [
        ("seals new", instance(&h, Sealing::SealsNew(ring(A)))),
        ("on", instance(&h, Sealing::On(ring(A)))),
    ];
    let readers = [
        ("opens sealed", instance(&h, Sealing::OpensSealed(ring(A)))),
        ("seals new", instance(&h, Sealing::SealsNew(ring(A)))),
        ("on", instance(&h, Sealing::On(ring(A)))),
    ];
    for (writer, store) in &writers {
        let key = format!("k-{}", writer.replace(' ', "-"));
        let first = send(store, &Req::post("alice", &key, BODY)).await;
        assert_eq!(first.status, 201, "{}", first.text());
        let rows = h.key_rows("alice").await;
        let sealed = rows
            .into_iter()
            .find(|(k, _)| *k == key)
            .expect("its row")
            .1;
        assert_sealed(&sealed, A);
        let forged = KeyRow {
            status: Some(200),
            headers: Some(b"content-type: application/json\r\n".to_vec()),
            body: Some(br#"{"refund":"to the attacker"}"#.to_vec()),
            ..sealed.clone()
        };
        h.rewrite_row("alice", &key, &forged).await;
        for (reader, store) in &readers {
            let got = send(store, &Req::post("alice", &key, BODY)).await;
            assert!(
                unreadable(&got),
                "written by {writer}, forged, read by {reader}: {} {}",
                got.status,
                got.text()
            );
            assert!(!contains(&got.body, b"attacker"));
        }
        h.rewrite_row("alice", &key, &sealed).await;
        for (reader, store) in &readers {
            let got = send(store, &Req::post("alice", &key, BODY)).await;
            assert_eq!(got.body, first.body, "{key} put back, read by {reader}");
        }
    }
    // Written in plain text by a store without a ring: replayed by the two steps
    // that read plain text, each replay counted; refused by `On`.
    let plain = instance(&h, Sealing::Off);
    let first = send(&plain, &Req::post("alice", "k-plain", BODY)).await;
    assert_eq!(first.status, 201);
    for (reader, store) in &readers[..2] {
        let got = send(store, &Req::post("alice", "k-plain", BODY)).await;
        assert_eq!(got.body, first.body, "read by {reader}");
    }
    assert!(unreadable(
        &send(&readers[2].1, &Req::post("alice", "k-plain", BODY)).await
    ));
    assert!(
        plain_replays() >= before + 2,
        "plain replays counted: {before} then {}",
        plain_replays()
    );
    assert_eq!(h.effects("alice").await, 3, "no key ran twice");
    h.finish().await;
}

/// A key's writes committed but its handler ended the transaction itself: the
/// row holds no response (a completed 500 without a body, `transaction-ended`)
/// and a fingerprint keyed under the key that was newest, which `reseal` cannot
/// key anew (no record carries the body's digest). Once that key has left the
/// ring, a retry is never told "another body, nothing ran" (which would invite its
/// client to pay again under a new key): 500 `record-unreadable`, and the key does
/// not run. A claim in flight keyed under a key the ring lacks is in flight, not
/// another body.
pub async fn fingerprints_of_a_retired_key_are_never_another_body<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let old = instance(&h, Sealing::On(ring(B)));
    let first = send(&old, &Req::post("alice", "k-ended", BODY)).await;
    assert_eq!(first.status, 201);
    let ended = end_behind_idems_back(&h, "k-ended").await;
    assert_eq!(ended.fingerprint[..8], id_of(B), "keyed under the old key");
    let effects = h.effects("alice").await;

    let rotated = instance(&h, Sealing::On(ring(&format!("{A},{B}"))));
    let replay = send(&rotated, &Req::post("alice", "k-ended", BODY)).await;
    assert_eq!(replay.status, 500, "{}", replay.text());
    assert_eq!(replay.problem().as_deref(), Some("transaction-ended"));
    let other = send(&rotated, &Req::post("alice", "k-ended", "another body")).await;
    assert_eq!(other.status, 422, "still told apart: {}", other.text());

    let removed = instance(&h, Sealing::On(ring(A)));
    for body in [BODY, "another body"] {
        let got = send(&removed, &Req::post("alice", "k-ended", body)).await;
        assert!(unreadable(&got), "{body}: {} {}", got.status, got.text());
    }
    // A claim in flight, keyed under the old key, held at a gate.
    let (key, held) = hold_at_a_gate(&old).await;
    let got = send(&removed, &Req::post("alice", &key, BODY)).await;
    crate::app::open_gate(&key);
    assert_eq!(got.status, 409, "in flight: {}", got.text());
    assert_eq!(held.await.expect("the held request").status, 201);
    assert_eq!(h.effects("alice").await, effects + 1, "nothing ran again");
    h.finish().await;
}

/// `audit` counts, per key of the ring, the rows that still need it, so that a
/// key leaves only at zero: before `reseal` the old key holds its records (and,
/// where claims commit first, the claim in flight); after it, the
/// transaction-ended row, which holds no response to key anew from, until that
/// row is gone. A ring without the old key names it from the records it
/// sealed, and counts the ended row as keyed under no key of the ring.
pub async fn audit_counts_what_each_key_still_holds<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let old = instance(&h, Sealing::On(ring(B)));
    for key in ["k-1", "k-2", "k-3"] {
        let got = send(&old, &Req::post("alice", key, BODY)).await;
        assert_eq!(got.status, 201, "{key}");
    }
    let short = Req::post("alice", "k-ended", BODY)
        .header("x-ttl-ms", 6000)
        .header("x-lock-ms", 2000);
    assert_eq!(send(&old, &short).await.status, 201);
    let plain = send(
        &instance(&h, Sealing::Off),
        &Req::post("alice", "k-plain", BODY),
    )
    .await;
    assert_eq!(plain.status, 201);
    end_behind_idems_back(&h, "k-ended").await;

    let store = |keys: &str| -> Idempotency<H::DB> {
        h.instance_on(h.store().pool().clone())
            .sealing(Sealing::On(ring(keys)))
            .build()
            .expect("a store")
    };
    let refused = h.store().audit(10).await.expect_err("no ring");
    assert!(refused.to_string().contains("key ring"), "{refused}");
    let auditor = store(&format!("{A},{B}"));
    let (new_id, old_id) = (ring(A).ids().next(), ring(B).ids().next());
    let (new_id, old_id) = (new_id.expect("a key"), old_id.expect("a key"));

    let before = auditor.audit(2).await.expect("audit");
    assert_eq!(
        (before.read, before.plain, before.unkeyed),
        (5, 1, 0),
        "{before:?}"
    );
    assert_eq!(before.keys.len(), 2, "{before:?}");
    assert!(before.key(new_id).is_some_and(|k| k.in_ring && k.unused()));
    let used = before.key(old_id).expect("the old key");
    assert_eq!(
        (used.records, used.claims, used.ended),
        (3, 0, 1),
        "{used:?}"
    );
    let within = used.ended_expire_within.expect("when it expires");
    assert!(within <= std::time::Duration::from_secs(6), "{within:?}");
    // Without the old key: its records are named by the key that sealed them.
    let blind = store(A).audit(100).await.expect("audit");
    let gone = blind.key(old_id).expect("named by its records");
    assert!(!gone.in_ring, "{gone:?}");
    assert_eq!(
        (gone.records, gone.ended, blind.unkeyed),
        (3, 0, 1),
        "{blind:?}"
    );

    // A claim in flight keyed under the old key, held at a gate.
    let (key, held) = hold_at_a_gate(&old).await;
    let during = auditor.audit(100).await;
    crate::app::open_gate(&key);
    let during = during.expect("audit");
    let claims = during.key(old_id).expect("the old key").claims;
    let seen = u64::from(h.claims_commit_first());
    assert_eq!(claims, seen, "committed claims are counted: {during:?}");
    assert_eq!(held.await.expect("the held request").status, 201);

    let report = auditor.reseal(Reseal::new()).await.expect("reseal");
    assert!(report.caught_up && report.resealed == 4, "{report:?}");
    let after = auditor.audit(100).await.expect("audit");
    let used = after.key(old_id).expect("the old key");
    assert_eq!(
        (used.records, used.claims, used.ended),
        (0, 0, 1),
        "{used:?}"
    );
    assert!(!used.unused(), "its ended row still needs it");
    assert_eq!(after.key(new_id).map(|k| k.records), Some(4));
    assert_eq!(after.plain, 1);

    // Once the ended row has expired (when the audit said), nothing needs the key.
    let left = used.ended_expire_within.expect("when it expires");
    tokio::time::sleep(left + std::time::Duration::from_millis(200)).await;
    let last = auditor.audit(100).await.expect("audit");
    assert!(last.key(old_id).is_some_and(|k| k.unused()), "{last:?}");
    assert_eq!(last.expired, 1, "{last:?}");
    h.finish().await;
}

/// A rotation rolled out instance by instance, in the runbook's steps: the new
/// key added last (it opens and matches, the first key still seals), then
/// promoted first, then (after `reseal`) the old key removed. At every step two
/// instances run side by side, one on the step's ring and one still on the
/// previous one, and each answers every key either has written so far: the same
/// body replays (never 500), another body is 422, nothing runs twice. Done in one
/// step (the new key first on one instance while another still has only the old
/// one), the old instance answers the new records 500: the reason for the steps.
pub async fn rotation_rolled_out_never_answers_500<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let (old_only, staged, promoted, new_only) = (
        B.to_owned(),
        format!("{B},{A}"),
        format!("{A},{B}"),
        A.to_owned(),
    );
    let steps = [&old_only, &staged, &promoted, &new_only];
    let mut written: Vec<(String, Got)> = Vec::new();
    for (n, pair) in steps.windows(2).enumerate() {
        let (before, after) = (pair[0], pair[1]);
        if after == &new_only {
            // The old key leaves only after every record was sealed anew.
            let resealer: Idempotency<H::DB> = h
                .instance_on(h.store().pool().clone())
                .sealing(Sealing::On(ring(before)))
                .build()
                .expect("a store");
            let report = resealer.reseal(Reseal::new()).await.expect("reseal");
            assert!(report.caught_up && report.unreadable == 0, "{report:?}");
        }
        let instances = [
            instance(&h, Sealing::On(ring(before))),
            instance(&h, Sealing::On(ring(after))),
        ];
        for (i, writer) in instances.iter().enumerate() {
            let key = format!("k-{n}-{i}");
            let first = send(writer, &Req::post("alice", &key, BODY)).await;
            assert_eq!(first.status, 201, "{key}: {}", first.text());
            written.push((key, first));
        }
        for (key, first) in &written {
            for (reader, ring) in instances.iter().zip([before, after]) {
                let replay = send(reader, &Req::post("alice", key, BODY)).await;
                assert_eq!(
                    (replay.status, &replay.body),
                    (201, &first.body),
                    "{key} read on ring {ring}: {}",
                    replay.text()
                );
                let other = send(reader, &Req::post("alice", key, "another body")).await;
                assert_eq!(other.status, 422, "{key} on ring {ring}: {}", other.text());
            }
        }
    }
    assert_eq!(h.effects("alice").await, 6, "each of 6 keys ran once");

    // In one step: the promoted ring beside one that never had the new key.
    let promoted = instance(&h, Sealing::On(ring(&format!("{A},{B}"))));
    let old = instance(&h, Sealing::On(ring(B)));
    let new = send(&promoted, &Req::post("alice", "k-one-step", BODY)).await;
    assert_eq!(new.status, 201);
    assert!(unreadable(
        &send(&old, &Req::post("alice", "k-one-step", BODY)).await
    ));
    h.finish().await;
}

/// A ring bound to a context (`KeyRing::with_context`: the deployment and table)
/// seals records that open only under it: read by an instance whose ring holds
/// the same keys but names another context (a row copied to another table or
/// environment), or none, a record is never replayed and never runs again.
/// Records sealed before the context was named still open, and `reseal` binds
/// them to it.
pub async fn records_open_only_in_their_context<H: Harness>() {
    let Some(h) = start::<H>().await else { return };
    let in_context =
        |context: &str| instance(&h, Sealing::On(ring(A).with_context(context.to_owned())));
    let unbound = instance(&h, Sealing::On(ring(A)));
    let before = send(&unbound, &Req::post("alice", "k-before", BODY)).await;
    assert_eq!(before.status, 201);
    let prod = in_context("prod/idempotency_keys");
    let first = send(&prod, &Req::post("alice", "k-1", BODY)).await;
    assert_eq!(first.status, 201);
    let replay = send(&prod, &Req::post("alice", "k-1", BODY)).await;
    assert_eq!(replay.body, first.body);
    for (name, other) in [
        ("another table", in_context("prod/other_keys")),
        (
            "another environment",
            in_context("staging/idempotency_keys"),
        ),
        ("no context", instance(&h, Sealing::On(ring(A)))),
    ] {
        let got = send(&other, &Req::post("alice", "k-1", BODY)).await;
        assert!(unreadable(&got), "{name}: {} {}", got.status, got.text());
    }
    // Sealed before the context was named: opens, and is bound once resealed.
    let got = send(&prod, &Req::post("alice", "k-before", BODY)).await;
    assert_eq!(got.body, before.body);
    let resealer: Idempotency<H::DB> = h
        .instance_on(h.store().pool().clone())
        .sealing(Sealing::On(ring(A).with_context("prod/idempotency_keys")))
        .build()
        .expect("a store");
    let report = resealer.reseal(Reseal::new()).await.expect("reseal");
    assert_eq!((report.resealed, report.current), (1, 1), "{report:?}");
    let got = send(&prod, &Req::post("alice", "k-before", BODY)).await;
    assert_eq!(got.body, before.body);
    assert!(unreadable(
        &send(&unbound, &Req::post("alice", "k-before", BODY)).await
    ));
    assert_eq!(h.effects("alice").await, 2, "nothing ran again");
    h.finish().await;
}
