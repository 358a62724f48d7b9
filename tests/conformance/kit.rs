//! `idem_axum::testing::ExactlyOnce`, the kit users prove their own handlers with,
//! on every backend: it passes a handler written right, with its duplicates made to
//! overlap it, and names one that writes through the pool instead of its `Tx`
//! (on a pool of one connection too) and one that is not idempotent at all.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idem_axum::axum::IdempotentRequest;
use idem_axum::testing::{ExactlyOnce, Failure};
use idem_axum::{Idempotency, Options};

use crate::BODY;
use crate::harness::Harness;

fn scope_of(request: &IdempotentRequest<impl idem_axum::Backend>) -> String {
    let header = request.parts().headers.get("x-scope");
    header
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// Written right: its one write goes through its `Tx`.
async fn through_tx<H: Harness>(request: IdempotentRequest<H::DB>) -> Response {
    let scope = scope_of(&request);
    request
        .run(&scope.clone(), Options::new(), move |mut tx| {
            Box::pin(async move {
                match H::insert_effect(&mut tx, &scope, "kit").await {
                    Ok(id) => (StatusCode::CREATED, format!("effect {id}")).into_response(),
                    Err(error) => {
                        (StatusCode::SERVICE_UNAVAILABLE, error.to_string()).into_response()
                    }
                }
            })
        })
        .await
}

/// Written wrong: its write goes through the store's pool, outside the `Tx`.
async fn through_pool<H: Harness>(
    State(store): State<Idempotency<H::DB>>,
    request: IdempotentRequest<H::DB>,
) -> Response {
    let scope = scope_of(&request);
    let pool = store.pool().clone();
    request
        .run(&scope.clone(), Options::new(), move |tx| {
            Box::pin(async move {
                let _held = tx;
                // Committed on its own, whatever the session's autocommit.
                let written = async {
                    let mut own = pool.begin().await?;
                    let sql = "INSERT INTO effects (scope, note) VALUES ($1, $2)";
                    H::exec(&mut *own, sql, &[&scope, "pool"]).await?;
                    own.commit().await
                };
                match written.await {
                    Ok(_) => (StatusCode::CREATED, "written").into_response(),
                    Err(error) => {
                        (StatusCode::SERVICE_UNAVAILABLE, error.to_string()).into_response()
                    }
                }
            })
        })
        .await
}

/// Not idempotent at all: a plain handler on the same route shape.
async fn unkeyed<H: Harness>(
    State(store): State<Idempotency<H::DB>>,
    request: Request<Body>,
) -> Response {
    let scope = request
        .headers()
        .get("x-scope")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let written = async {
        let mut own = store.pool().begin().await?;
        let sql = "INSERT INTO effects (scope, note) VALUES ($1, $2)";
        H::exec(&mut *own, sql, &[&scope, "unkeyed"]).await?;
        own.commit().await
    };
    match written.await {
        Ok(_) => (StatusCode::CREATED, "written").into_response(),
        Err(error) => (StatusCode::SERVICE_UNAVAILABLE, error.to_string()).into_response(),
    }
}

/// The kit on `store`'s routes (`path` one of them), counting `scope`'s effects
/// with `count`.
fn kit_on<H: Harness, C, F>(
    store: &Idempotency<H::DB>,
    path: &'static str,
    scope: &str,
    count: C,
) -> ExactlyOnce
where
    C: Fn(String) -> F + Send + Sync + 'static,
    F: std::future::Future<Output = i64> + Send + 'static,
{
    let app = Router::new()
        .route("/tx", post(through_tx::<H>))
        .route("/pool", post(through_pool::<H>))
        .route("/unkeyed", post(unkeyed::<H>))
        .with_state(store.clone());
    let request = {
        let scope = scope.to_owned();
        move || {
            Request::post(path)
                .header("x-scope", &scope)
                .header("content-type", "application/json")
                .body(Body::from(BODY))
                .expect("request")
        }
    };
    let scope = scope.to_owned();
    ExactlyOnce::new(app, store, request, move || count(scope.clone()))
}

fn kit<H: Harness>(h: &Arc<H>, path: &'static str, scope: &str) -> ExactlyOnce {
    let counted = Arc::clone(h);
    kit_on::<H, _, _>(h.store(), path, scope, move |scope| {
        let h = Arc::clone(&counted);
        async move { h.effects(&scope).await }
    })
}

/// The kit's verdict on a handler that writes through the pool, on a store whose
/// pool has one connection (the handler's `Tx` holds it): named within 5 s, where
/// the pool's acquire timeout is 30 s.
async fn pool_writers_are_named_on_one_connection(kit: ExactlyOnce) {
    let verdict = tokio::time::timeout(Duration::from_secs(5), kit.check()).await;
    let verdict = verdict.expect("the kit named the handler within 5 s");
    assert!(
        matches!(verdict, Err(Failure::WaitsForPool { connections: 1, .. })),
        "a handler writing through a one-connection pool: {verdict:?}"
    );
    let sentence = format!("{:?}", verdict.err());
    assert!(
        sentence.contains("writes outside its Tx") && sentence.contains("uses the pool"),
        "{sentence}"
    );
}

pub async fn the_testing_kit_proves_handlers_exactly_once<H: Harness>() {
    let Some(h) = crate::start::<H>().await else {
        return;
    };
    let h = Arc::new(h);

    let right = kit(&h, "/tx", "kit-tx").check().await;
    let report = right.expect("a handler that writes through its Tx passes");
    assert_eq!(report.once, 1);
    assert_eq!(report.overlapped, 7, "every duplicate overlapped the first");
    assert_eq!(h.effects("kit-tx").await, 2, "one write per key executed");

    let wrong = kit(&h, "/pool", "kit-pool").check().await;
    assert!(
        matches!(wrong, Err(Failure::WroteOutsideTx { moved: 1 })),
        "a handler writing through the pool: {wrong:?}"
    );
    // Its Debug, which `.expect` prints, is its sentence.
    let printed = format!("{:?}", wrong.err());
    assert!(
        printed.contains("WroteOutsideTx: the count moved by 1")
            && printed.contains("outside its Tx"),
        "{printed}"
    );

    let plain = kit(&h, "/unkeyed", "kit-plain").check().await;
    assert!(
        matches!(plain, Err(Failure::NotIdempotent)),
        "a handler without idem: {plain:?}"
    );
    assert!(
        format!("{:?}", plain.err()).contains("not #[idempotent]"),
        "named as such"
    );

    // One connection: the right handler still overlaps its duplicates (they wait
    // for the connection, then replay), the wrong one is named at once.
    let (pool, single) = h.one_session_store().await;
    let counted = Arc::clone(&h);
    let count = move |scope: String| {
        let h = Arc::clone(&counted);
        async move { h.effects(&scope).await }
    };
    let right = kit_on::<H, _, _>(&single, "/tx", "kit-one-tx", count.clone())
        .check()
        .await;
    let report = right.expect("a right handler on one connection passes");
    assert_eq!((report.once, report.overlapped), (1, 7));
    pool_writers_are_named_on_one_connection(kit_on::<H, _, _>(
        &single,
        "/pool",
        "kit-one-pool",
        count,
    ))
    .await;
    pool.close().await;

    let Ok(h) = Arc::try_unwrap(h) else {
        panic!("the kits are gone");
    };
    h.finish().await;
}

/// The quick start's store: an in-memory SQLite database, alive as long as its one
/// connection. A handler writing through the pool waits for the connection its
/// `Tx` holds; the kit names it in seconds.
#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kit_names_pool_writers_on_the_quick_starts_in_memory_database() {
    use crate::harness::Lite;
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .connect("sqlite::memory:")
        .await
        .expect("in-memory database");
    sqlx::raw_sql(
        "CREATE TABLE effects (id INTEGER PRIMARY KEY AUTOINCREMENT, scope TEXT NOT NULL, \
         note TEXT NOT NULL)",
    )
    .execute(&pool)
    .await
    .expect("effects");
    let store = Idempotency::new(pool.clone());
    store.migrate().await.expect("migrate");
    let count = move |scope: String| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar("SELECT count(*) FROM effects WHERE scope = ?1")
                .bind(scope)
                .fetch_one(&pool)
                .await
                .expect("count")
        }
    };
    let right = kit_on::<Lite, _, _>(&store, "/tx", "mem-tx", count.clone())
        .check()
        .await;
    assert_eq!(right.expect("passes").overlapped, 7);
    pool_writers_are_named_on_one_connection(kit_on::<Lite, _, _>(
        &store, "/pool", "mem-pool", count,
    ))
    .await;
}
