//! `idem_axum::testing::ExactlyOnce`, the kit users prove their own handlers with,
//! on every backend: it passes a handler written right, and catches one that writes
//! through the pool instead of its `Tx` and one that is not idempotent at all.

use std::sync::Arc;

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

fn kit<H: Harness>(h: &Arc<H>, path: &'static str, scope: &str) -> ExactlyOnce {
    let app = Router::new()
        .route("/tx", post(through_tx::<H>))
        .route("/pool", post(through_pool::<H>))
        .route("/unkeyed", post(unkeyed::<H>))
        .with_state(h.store().clone());
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
    let count = {
        let (h, scope) = (Arc::clone(h), scope.to_owned());
        move || {
            let (h, scope) = (Arc::clone(&h), scope.clone());
            async move { h.effects(&scope).await }
        }
    };
    ExactlyOnce::new(app, h.store(), request, count)
}

pub async fn the_testing_kit_proves_handlers_exactly_once<H: Harness>() {
    let Some(h) = crate::start::<H>().await else {
        return;
    };
    let h = Arc::new(h);

    let right = kit(&h, "/tx", "kit-tx").check().await;
    let report = right.expect("a handler that writes through its Tx passes");
    assert_eq!(report.once, 1);

    // SQLite has one writer: the handler's transaction holds it, so the pool's
    // write waits for it and fails; the kit fails that handler at its first request.
    let wrong = kit(&h, "/pool", "kit-pool").check().await;
    if <H::DB as sqlx::Database>::NAME == "SQLite" {
        assert!(
            wrong.is_err(),
            "a handler writing through the pool: {wrong:?}"
        );
    } else {
        assert!(
            matches!(wrong, Err(Failure::WroteOutsideTx { moved: 1 })),
            "a handler writing through the pool: {wrong:?}"
        );
    }
    assert!(
        wrong
            .as_ref()
            .err()
            .is_some_and(|e| !e.to_string().is_empty()),
        "{wrong:?}"
    );

    let plain = kit(&h, "/unkeyed", "kit-plain").check().await;
    assert!(
        matches!(
            plain,
            Err(Failure::WroteOutsideTx { .. } | Failure::RanMoreThanOnce { .. })
        ),
        "a handler without idem: {plain:?}"
    );

    let Ok(h) = Arc::try_unwrap(h) else {
        panic!("the kits are gone");
    };
    h.finish().await;
}
