//! MySQL/MariaDB's cluster mode (`Builder::galera`), checked on whatever server
//! the run has (standalone, or a node of a Galera cluster): everything it sends
//! is a statement that Percona XtraDB Cluster's default strict mode accepts, read
//! back from the server's general query log.

use std::sync::Arc;
use std::time::Duration;

use axum::http::{Method, Response, StatusCode, Uri};
use bytes::Bytes;
use http_body_util::Full;
use idem_axum::{
    Forgotten, Idempotency, IdempotencyKey, Options, Outcome, RequestIdentity, Sweep, Tx,
};
use sqlx::MySql;
use tokio::sync::Notify;

use crate::harness::{Harness, My};

/// What Percona XtraDB Cluster refuses under `pxc_strict_mode = ENFORCING`
/// (explicit table locks, SERIALIZABLE, `FLUSH … WITH READ LOCK`), and the
/// named-lock functions, which it refuses too and which hold on one node only.
const REFUSED: &[&str] = &[
    "GET_LOCK",
    "RELEASE_LOCK",
    "RELEASE_ALL_LOCKS",
    "IS_USED_LOCK",
    "IS_FREE_LOCK",
    "LOCK TABLE",
    "SERIALIZABLE",
    "WITH READ LOCK",
];

/// What a handler of the workload does in its transaction.
#[derive(Clone, Copy)]
enum Handler {
    /// Writes its effect and answers with the status.
    Answer(u16),
    /// Waits for the gate, then writes and answers 201.
    Gated,
    /// Writes, sends the statement (which ends its transaction), writes again.
    Ends(&'static str),
    /// Writes its effect and answers 201 with a body of this many bytes.
    Sized(usize),
}

#[derive(Clone)]
struct Workload {
    store: Idempotency<MySql>,
    gate: Arc<Notify>,
}

impl Workload {
    async fn send(&self, key: &str, body: &str, options: Options, handler: Handler) -> Outcome {
        let response = self.answer(key, body, options, handler).await;
        *response.extensions().get::<Outcome>().expect("an outcome")
    }

    async fn answer(
        &self,
        key: &str,
        body: &str,
        options: Options,
        handler: Handler,
    ) -> Response<Bytes> {
        let uri = Uri::from_static("/effects");
        let key = IdempotencyKey::parse(key.as_bytes()).ok();
        let request = RequestIdentity::new(key, "alice", &Method::POST, &uri, body.as_bytes());
        let gate = Arc::clone(&self.gate);
        self.store
            .execute(request, options, move |mut tx: Tx<MySql>| {
                Box::pin(async move {
                    let mut answer = Bytes::from_static(b"{}");
                    let status = match handler {
                        Handler::Answer(status) => status,
                        Handler::Sized(bytes) => {
                            answer = Bytes::from(vec![b'x'; bytes]);
                            201
                        }
                        Handler::Gated => {
                            gate.notified().await;
                            201
                        }
                        Handler::Ends(statement) => {
                            let _ = My::insert_effect(&mut tx, "alice", "before").await;
                            let _ = My::exec(&mut tx, statement, &[]).await;
                            201
                        }
                    };
                    let written = My::insert_effect(&mut tx, "alice", "effect").await;
                    let mut response = Response::new(Full::new(answer));
                    *response.status_mut() = match written {
                        Ok(_) => StatusCode::from_u16(status).unwrap_or(StatusCode::CREATED),
                        Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
                    };
                    response
                })
            })
            .await
    }
}

/// Every path of the cluster mode's claim → execute → record, and every
/// operator's call, with the general query log on: no statement on its sessions
/// is one that Percona XtraDB Cluster's strict mode refuses, and no session is
/// left in a transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_cluster_mode_sends_nothing_a_strict_cluster_refuses() {
    let Some(h) = crate::start::<My>().await else {
        return;
    };
    let (pool, sessions) = h.pool_noting_sessions().await;
    let logged: (i64, String) =
        sqlx::query_as("SELECT @@GLOBAL.general_log, CAST(@@GLOBAL.log_output AS CHAR)")
            .fetch_one(h.admin())
            .await
            .expect("the log's settings");
    // The table keeps earlier runs' lines, whose session ids a restarted server
    // hands out again: only what is logged from now on is read.
    let since: String = sqlx::query_scalar("SELECT CAST(NOW(6) AS CHAR)")
        .fetch_one(h.admin())
        .await
        .expect("the server's clock");
    sqlx::raw_sql("SET GLOBAL log_output = 'TABLE'; SET GLOBAL general_log = 1")
        .execute(h.admin())
        .await
        .expect("the general query log on");
    let store = Idempotency::builder(pool.clone())
        .table("pxc_keys")
        .galera(true)
        .replay_cache(0)
        .build()
        .expect("store");
    let work = Workload {
        store: store.clone(),
        gate: Arc::new(Notify::new()),
    };
    let plain = Options::new();
    let ran = async {
        store.migrate().await.expect("migrate");
        let body = r#"{"amount":100}"#;
        let answer = Handler::Answer(201);
        assert_eq!(
            work.send("k-new", body, plain, answer).await,
            Outcome::Executed
        );
        assert_eq!(
            work.send("k-new", body, plain, answer).await,
            Outcome::Replayed
        );
        assert_eq!(
            work.send("k-new", "{}", plain, answer).await,
            Outcome::Mismatch
        );
        assert_eq!(
            work.send("k-fails", body, plain, Handler::Answer(500))
                .await,
            Outcome::Released
        );
        // In flight: a duplicate (with its Retry-After), a waiting one, and the
        // operator's calls.
        let first = {
            let work = work.clone();
            tokio::spawn(async move { work.send("k-held", body, plain, Handler::Gated).await })
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while store
            .in_flight("alice", "k-held")
            .await
            .expect("in_flight")
            .is_none()
        {
            assert!(tokio::time::Instant::now() < deadline, "never claimed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            work.send("k-held", body, plain, answer).await,
            Outcome::InFlight
        );
        assert_eq!(
            store.forget("alice", "k-held").await.expect("forget"),
            Forgotten::InFlight
        );
        assert_eq!(
            store.claims(None, false, 10).await.expect("claims").len(),
            1
        );
        let waiting = {
            let work = work.clone();
            let wait = plain.wait(Duration::from_secs(10));
            tokio::spawn(async move { work.send("k-held", body, wait, answer).await })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        work.gate.notify_one();
        assert_eq!(first.await.expect("first"), Outcome::Executed);
        assert_eq!(waiting.await.expect("waiting"), Outcome::Replayed);
        // A claim left past its lock twice (the cluster's margin), and an expired
        // record: taken over, replaced.
        h.script(
            "INSERT INTO pxc_keys (scope, idempotency_key, state, lease, method, path, \
                 fingerprint, content_type, locked_until, expires_at, created_at) \
             VALUES ('alice', 'k-stale', 'processing', 7, 'POST', '/effects', \
                     UNHEX(SHA2('{\"amount\":100}', 256)), '', \
                     UTC_TIMESTAMP(6) - INTERVAL 61 SECOND, UTC_TIMESTAMP(6) + INTERVAL 1 HOUR, \
                     UTC_TIMESTAMP(6) - INTERVAL 2 MINUTE), \
                    ('alice', 'k-old', 'completed', 8, 'POST', '/effects', \
                     UNHEX(SHA2('{\"amount\":100}', 256)), '', \
                     UTC_TIMESTAMP(6) - INTERVAL 2 HOUR, UTC_TIMESTAMP(6) - INTERVAL 1 SECOND, \
                     UTC_TIMESTAMP(6) - INTERVAL 2 HOUR)",
        )
        .await;
        assert_eq!(
            work.send("k-stale", body, plain, answer).await,
            Outcome::TakenOver
        );
        assert_eq!(
            work.send("k-old", body, plain, answer).await,
            Outcome::Executed
        );
        // Handlers that end their own transaction: after a ROLLBACK its next write
        // is refused (the session is read-only until idem's end), so it fails.
        assert_eq!(
            work.send("k-rollback", body, plain, Handler::Ends("ROLLBACK"))
                .await,
            Outcome::Released
        );
        assert_eq!(
            work.send("k-commit", body, plain, Handler::Ends("COMMIT"))
                .await,
            Outcome::TransactionEnded
        );
        assert_eq!(
            store.forget("alice", "k-new").await.expect("forget"),
            Forgotten::Deleted
        );
        store.sweep(Sweep::new()).await.expect("sweep");
    };
    let ran = futures_util::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(ran)).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "SET GLOBAL general_log = {}; SET GLOBAL log_output = '{}'",
        logged.0, logged.1
    )))
    .execute(h.admin())
    .await
    .expect("the general query log back");
    if let Err(panic) = ran {
        std::panic::resume_unwind(panic);
    }

    let ids: Vec<String> = sessions
        .lock()
        .expect("sessions")
        .iter()
        .map(u64::to_string)
        .collect();
    let statements: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT CAST(argument AS CHAR) FROM mysql.general_log \
         WHERE thread_id IN ({}) AND command_type IN ('Query', 'Prepare', 'Execute') \
           AND event_time >= '{since}'",
        ids.join(", ")
    )))
    .fetch_all(h.admin())
    .await
    .expect("the general query log");
    let claims = statements
        .iter()
        .filter(|s| s.contains("INSERT INTO") && s.contains("pxc_keys"))
        .count();
    assert!(claims >= 5, "the log holds the claims: {statements:#?}");
    // The application's own settings (a CI run's SERIALIZABLE) are not idem's.
    for statement in statements.iter().filter(|s| *s != h.session_settings()) {
        let upper = statement.to_uppercase();
        for refused in REFUSED {
            assert!(
                !upper.contains(refused),
                "{refused} sent in the cluster mode: {statement}"
            );
        }
    }
    assert_eq!(
        crate::transactions_left(&h).await,
        0,
        "a session left in a transaction"
    );
    pool.close().await;
    h.finish().await;
}

/// The cluster mode records no response that a write set cannot carry: with
/// `wsrep_max_ws_size` lowered to 8 MiB, a response of 4.5 MiB (which the node
/// would refuse at the commit, "Maximum writeset size exceeded": the write set
/// carries it twice) is refused before the commit (500 `response-too-large`), its
/// writes rolled back and the key released, as the store's own limit is; 2 MiB
/// is recorded and replayed.
/// A server that is no Galera node (MySQL without wsrep, or MariaDB outside a
/// cluster) has no such limit: the same response is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_cluster_mode_refuses_a_response_its_write_set_cannot_carry() {
    let Some(h) = crate::start::<My>().await else {
        return;
    };
    const MIB: usize = 1 << 20;
    let is = |error: &sqlx::Error, number: u16| {
        error
            .as_database_error()
            .and_then(|e| e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
            .is_some_and(|e| e.number() == number)
    };
    // Global, for this test's requests (every other test's write sets are well
    // below it), and back whatever happens. Unknown (1193): no wsrep at all; a
    // node outside a cluster (1210) keeps its 2 GiB default.
    let before =
        match sqlx::query_scalar::<_, i64>("SELECT CAST(@@GLOBAL.wsrep_max_ws_size AS SIGNED)")
            .fetch_one(h.admin())
            .await
        {
            Ok(max) => Some(max),
            Err(error) if is(&error, 1193) => None,
            Err(error) => panic!("wsrep_max_ws_size: {error}"),
        };
    let lowered = match before {
        Some(max) => match sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "SET GLOBAL wsrep_max_ws_size = {}",
            8 * MIB
        )))
        .execute(h.admin())
        .await
        {
            Ok(_) => Some(max),
            Err(error) if is(&error, 1210) => None,
            Err(error) => panic!("lower wsrep_max_ws_size: {error}"),
        },
        None => None,
    };
    let (pool, _) = h.pool_noting_sessions().await;
    let ran = async {
        let store = Idempotency::builder(pool.clone())
            .table("ws_keys")
            .galera(true)
            .max_response_bytes(8 * MIB)
            .replay_cache(0)
            .build()
            .expect("store");
        store.migrate().await.expect("migrate");
        let work = Workload {
            store,
            gate: Arc::new(Notify::new()),
        };
        let body = r#"{"amount":100}"#;
        let plain = Options::new();
        let big = work
            .answer("k-big", body, plain, Handler::Sized(4 * MIB + MIB / 2))
            .await;
        let problem = String::from_utf8_lossy(big.body()).into_owned();
        if lowered.is_some() {
            assert_eq!(big.status(), StatusCode::INTERNAL_SERVER_ERROR, "{problem}");
            assert!(problem.contains("response-too-large"), "{problem}");
            assert_eq!(h.effects("alice").await, 0, "the writes rolled back");
            let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM ws_keys")
                .fetch_one(&pool)
                .await
                .expect("count");
            assert_eq!(rows, 0, "the key released");
        } else {
            assert_eq!(big.status(), StatusCode::CREATED, "{problem}");
        }
        let fits = work
            .answer("k-fits", body, plain, Handler::Sized(2 * MIB))
            .await;
        assert_eq!(fits.status(), StatusCode::CREATED);
        let replay = work.answer("k-fits", body, plain, Handler::Sized(0)).await;
        assert_eq!(
            replay.extensions().get::<Outcome>(),
            Some(&Outcome::Replayed)
        );
        assert_eq!(replay.body(), fits.body());
        let effects = if lowered.is_some() { 1 } else { 2 };
        assert_eq!(h.effects("alice").await, effects);
    };
    let ran = futures_util::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(ran)).await;
    if let Some(max) = lowered {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "SET GLOBAL wsrep_max_ws_size = {max}"
        )))
        .execute(h.admin())
        .await
        .expect("wsrep_max_ws_size back");
    }
    if let Err(panic) = ran {
        std::panic::resume_unwind(panic);
    }
    pool.close().await;
    h.finish().await;
}
