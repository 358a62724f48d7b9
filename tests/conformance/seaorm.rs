//! SeaORM handlers (feature `sea-orm`): entities, active models, related finds
//! and SeaORM's own nested transactions on the handler's `Tx` through
//! `Tx::sea_orm`, on every backend. What they write commits with the recorded
//! answer or not at all; SeaORM's `begin` is a savepoint; the testing kit proves
//! such a handler exactly-once and names one that writes through SeaORM's own
//! pool connection.

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{FromRef, State};
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idem_axum::axum::IdempotentRequest;
use idem_axum::testing::{ExactlyOnce, Failure};
use idem_axum::{Idempotency, Options, Outcome, SeaDriver, Tx};
use sea_orm::entity::prelude::*;
use sea_orm::{
    ActiveValue::Set, DatabaseConnection, DbBackend, IsolationLevel, TransactionSession,
    TransactionTrait,
};

use crate::app::{Req, send};
use crate::harness::Harness;
use crate::{BODY, send_all};

/// The business table every harness creates.
mod effect {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "effects")]
    pub struct Model {
        #[sea_orm(primary_key)]
        pub id: i64,
        pub scope: String,
        pub note: String,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {
        #[sea_orm(has_many = "super::line::Entity")]
        Line,
    }

    impl Related<super::line::Entity> for Entity {
        fn to() -> RelationDef {
            Relation::Line.def()
        }
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// Lines of an effect, for `find_with_related`.
mod line {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "sea_lines")]
    pub struct Model {
        #[sea_orm(primary_key)]
        pub id: i64,
        pub effect_id: i64,
        pub memo: String,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {
        #[sea_orm(
            belongs_to = "super::effect::Entity",
            from = "Column::EffectId",
            to = "super::effect::Column::Id"
        )]
        Effect,
    }

    impl Related<super::effect::Entity> for Entity {
        fn to() -> RelationDef {
            Relation::Effect.def()
        }
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// Creates `sea_lines` beside the harness's `effects`.
async fn lines_table<H: Harness>(h: &H)
where
    H::DB: SeaDriver,
{
    let id = match <H::DB as SeaDriver>::BACKEND {
        DbBackend::Postgres => "BIGSERIAL PRIMARY KEY",
        DbBackend::MySql => "BIGINT AUTO_INCREMENT PRIMARY KEY",
        _ => "INTEGER PRIMARY KEY AUTOINCREMENT",
    };
    h.script(&format!(
        "CREATE TABLE sea_lines (id {id}, effect_id BIGINT NOT NULL, memo TEXT NOT NULL); \
         CREATE INDEX sea_lines_effect ON sea_lines (effect_id)"
    ))
    .await;
}

/// `effects` read with its text column as a number.
#[derive(Debug, sea_orm::FromQueryResult)]
struct Misread {
    #[allow(dead_code)]
    note: i64,
}

fn header(headers: &HeaderMap, name: &str) -> String {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

fn new_effect(scope: &str, note: &str) -> effect::ActiveModel {
    effect::ActiveModel {
        scope: Set(scope.to_owned()),
        note: Set(note.to_owned()),
        ..Default::default()
    }
}

/// The handler's writes, all through SeaORM on its `Tx`: an effect and a line of
/// it, then what `x-nested` asks of SeaORM's nested transactions, then the
/// effect read back with its lines. Answers the effect's id and lines read.
async fn write<DB: SeaDriver>(tx: &mut Tx<DB>, scope: &str, nested: &str) -> Result<String, DbErr> {
    let db = tx.sea_orm();
    let outer = new_effect(scope, "outer").insert(&db).await?;
    let first = line::ActiveModel {
        effect_id: Set(outer.id),
        memo: Set("first".to_owned()),
        ..Default::default()
    }
    .insert(&db)
    .await?;
    // An update and a delete through active models and the entity.
    let mut first: line::ActiveModel = first.into();
    first.memo = Set("updated".to_owned());
    first.update(&db).await?;
    let temporary = line::ActiveModel {
        effect_id: Set(outer.id),
        memo: Set("temporary".to_owned()),
        ..Default::default()
    }
    .insert(&db)
    .await?;
    line::Entity::delete_by_id(temporary.id).exec(&db).await?;
    match nested {
        "commit" | "rollback" | "drop" => {
            let inner = db.begin().await?;
            new_effect(scope, "nested").insert(&inner).await?;
            match nested {
                "commit" => inner.commit().await?,
                "rollback" => inner.rollback().await?,
                _ => drop(inner),
            }
        }
        // A statement that fails inside the savepoint (the outer effect's id
        // again), caught and rolled back to: PostgreSQL keeps the transaction.
        "failed" => {
            let inner = db.begin().await?;
            let again = effect::ActiveModel {
                id: Set(outer.id),
                ..new_effect(scope, "nested")
            };
            let failed = again.insert(&inner).await;
            assert!(failed.is_err(), "a duplicate primary key is refused");
            inner.rollback().await?;
        }
        // Two levels: the inner one rolled back, the outer one committed.
        "deep" => {
            let kept = db.begin().await?;
            new_effect(scope, "kept").insert(&kept).await?;
            let gone = kept.begin().await?;
            new_effect(scope, "nested").insert(&gone).await?;
            gone.rollback().await?;
            kept.commit().await?;
        }
        // SeaORM's closure form: an error rolls its savepoint back.
        "refused" => {
            let scope = scope.to_owned();
            let refused = db
                .transaction::<_, (), DbErr>(|inner| {
                    Box::pin(async move {
                        new_effect(&scope, "nested").insert(inner).await?;
                        Err(DbErr::Custom("refused".to_owned()))
                    })
                })
                .await;
            assert!(refused.is_err(), "the closure's error comes back");
        }
        "panic" => {
            let scope = scope.to_owned();
            db.transaction::<_, (), DbErr>(|inner| {
                Box::pin(async move {
                    new_effect(&scope, "nested").insert(inner).await?;
                    panic!("a bug inside a SeaORM transaction");
                })
            })
            .await
            .map_err(|error| DbErr::Custom(error.to_string()))?;
        }
        // A column read as a type it does not hold: SeaORM's error, not a panic.
        "misread" => {
            effect::Entity::find()
                .into_model::<Misread>()
                .one(&db)
                .await?;
        }
        "isolation" => {
            db.begin_with_config(Some(IsolationLevel::Serializable), None)
                .await?;
        }
        _ => {}
    }
    let found = effect::Entity::find_by_id(outer.id)
        .find_with_related(line::Entity)
        .all(&db)
        .await?;
    let lines = found.first().map_or(0, |(_, lines)| lines.len());
    Ok(format!(r#"{{"id":{},"lines":{lines}}}"#, outer.id))
}

/// The SeaORM handler: `x-nested` as in [`write`], `x-status` the status it
/// answers after writing (201 by default).
async fn sea<H: Harness>(request: IdempotentRequest<H::DB>) -> Response
where
    H::DB: SeaDriver,
{
    let headers = request.parts().headers.clone();
    let scope = header(&headers, "x-scope");
    let nested = header(&headers, "x-nested");
    let status = header(&headers, "x-status")
        .parse()
        .ok()
        .and_then(|code| StatusCode::from_u16(code).ok())
        .unwrap_or(StatusCode::CREATED);
    request
        .run(&scope.clone(), Options::new(), move |mut tx| {
            Box::pin(async move {
                match write(&mut tx, &scope, &nested).await {
                    Ok(body) => (status, body).into_response(),
                    Err(error) => {
                        (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response()
                    }
                }
            })
        })
        .await
}

/// The app's state: its store, and SeaORM on a pool of the app's database, as a
/// SeaORM app connects it (straight to the database: SeaORM prepares its
/// statements, which a transaction pooler does not keep).
struct SeaApp<H: Harness> {
    store: Idempotency<H::DB>,
    db: DatabaseConnection,
}

impl<H: Harness> Clone for SeaApp<H> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            db: self.db.clone(),
        }
    }
}

impl<H: Harness> FromRef<SeaApp<H>> for Idempotency<H::DB> {
    fn from_ref(app: &SeaApp<H>) -> Self {
        app.store.clone()
    }
}

/// Written wrong: SeaORM on the app's pool inside an `#[idempotent]` handler.
/// `x-status` as above.
async fn pooled<H: Harness>(
    State(app): State<SeaApp<H>>,
    request: IdempotentRequest<H::DB>,
) -> Response
where
    H::DB: SeaDriver,
{
    let headers = request.parts().headers.clone();
    let scope = header(&headers, "x-scope");
    let status = header(&headers, "x-status")
        .parse()
        .ok()
        .and_then(|code| StatusCode::from_u16(code).ok())
        .unwrap_or(StatusCode::CREATED);
    let db = app.db.clone();
    request
        .run(&scope.clone(), Options::new(), move |tx| {
            Box::pin(async move {
                let _held = tx;
                // Committed on its own, whatever the session's autocommit.
                let written = async {
                    let own = db.begin().await?;
                    new_effect(&scope, "pool").insert(&own).await?;
                    own.commit().await
                };
                match written.await {
                    Ok(_) => (status, "written").into_response(),
                    Err(error) => {
                        (StatusCode::SERVICE_UNAVAILABLE, error.to_string()).into_response()
                    }
                }
            })
        })
        .await
}

fn app<H: Harness>(h: &H) -> Router
where
    H::DB: SeaDriver,
    DatabaseConnection: From<sqlx::Pool<H::DB>>,
{
    let state = SeaApp::<H> {
        store: h.store().clone(),
        db: DatabaseConnection::from(h.direct_pool().clone()),
    };
    Router::new()
        .route("/sea", post(sea::<H>))
        .route("/pooled", post(pooled::<H>))
        .with_state(state)
}

async fn notes<H: Harness>(h: &H, scope: &str, note: &str) -> i64 {
    h.count(
        "SELECT count(*) FROM effects WHERE scope = $1 AND note = $2",
        &[scope, note],
    )
    .await
}

/// Concurrent duplicates run a SeaORM handler once; a 5xx after its writes
/// leaves none of them; SeaORM's nested transactions are savepoints inside
/// idem's; a panic inside one is idem's 500 and nothing commits.
pub async fn seaorm_handlers_commit_with_their_answer<H: Harness>()
where
    H::DB: SeaDriver,
    DatabaseConnection: From<sqlx::Pool<H::DB>>,
{
    let Some(h) = crate::start::<H>().await else {
        return;
    };
    lines_table(&h).await;
    let app = app(&h);
    let post = |scope: &str, key: &str| Req::post(scope, key, BODY).path("/sea");

    // Eight at once under one key: one execution, one effect and its line.
    let answers = send_all(&app, vec![post("dup", "k-dup"); 8]).await;
    let executed = answers
        .iter()
        .filter(|got| got.outcome == Some(Outcome::Executed))
        .count();
    assert_eq!(executed, 1, "{answers:?}");
    for got in &answers {
        assert!(
            matches!(got.status, 201 | 409),
            "{} {}",
            got.status,
            got.text()
        );
    }
    assert_eq!(h.effects("dup").await, 1);
    let first = answers.iter().find(|got| got.status == 201).expect("a 201");
    assert!(first.text().ends_with(r#""lines":1}"#), "{}", first.text());
    let replay = send(&app, &post("dup", "k-dup")).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.body, first.body);

    // A 500 after the writes: none kept, and the key runs again.
    for _ in 0..2 {
        let failed = send(&app, &post("failed", "k-failed").header("x-status", 500)).await;
        assert_eq!(failed.status, 500, "{}", failed.text());
    }
    assert_eq!(h.effects("failed").await, 0, "a 5xx keeps nothing");
    // The duplicates' one line, updated; the deleted one gone.
    let updated = "SELECT count(*) FROM sea_lines WHERE memo = 'updated'";
    assert_eq!(h.count(updated, &[]).await, 1);
    assert_eq!(h.count("SELECT count(*) FROM sea_lines", &[]).await, 1);

    // Nested transactions: (x-nested, outer kept, nested kept).
    let cases = [
        ("commit", 1, 1),
        ("rollback", 1, 0),
        ("drop", 1, 0),
        ("deep", 1, 0),
        ("refused", 1, 0),
        ("failed", 1, 0),
    ];
    for (nested, outer, inner) in cases {
        let scope = format!("nested-{nested}");
        let got = send(&app, &post(&scope, "k").header("x-nested", nested)).await;
        assert_eq!(got.status, 201, "{nested}: {}", got.text());
        assert_eq!(notes(&h, &scope, "outer").await, outer, "{nested}: outer");
        assert_eq!(notes(&h, &scope, "nested").await, inner, "{nested}: nested");
    }
    assert_eq!(
        notes(&h, "nested-deep", "kept").await,
        1,
        "the outer savepoint's write"
    );

    // A panic inside SeaORM's transaction: idem's 500, nothing commits.
    let panicked = send(&app, &post("panic", "k").header("x-nested", "panic")).await;
    assert_eq!(panicked.status, 500, "{}", panicked.text());
    assert_eq!(panicked.problem().as_deref(), Some("handler-failed"));
    assert_eq!(h.effects("panic").await, 0);

    // A column SeaORM cannot read as asked: its error, which the handler answers.
    let misread = send(&app, &post("misread", "k").header("x-nested", "misread")).await;
    assert_eq!(misread.status, 500);
    assert_eq!(
        misread.problem(),
        None,
        "the handler's answer: {}",
        misread.text()
    );
    assert_eq!(h.effects("misread").await, 0);

    // A savepoint cannot change the transaction's isolation: SeaORM's error,
    // answered 500 by the handler, nothing kept.
    let refused = send(
        &app,
        &post("isolation", "k").header("x-nested", "isolation"),
    )
    .await;
    assert_eq!(refused.status, 500);
    assert!(refused.text().contains("savepoint"), "{}", refused.text());
    assert_eq!(h.effects("isolation").await, 0);
    h.finish().await;
}

/// Sends `req` again after a 500 for a deadlock, as a client retries a 5xx:
/// SERIALIZABLE MySQL locks what the handler reads, so handlers of different
/// keys may deadlock over the related find, and the loser's writes are undone.
async fn deadlocks_retried(app: &Router, req: &Req) -> crate::app::Got {
    let mut tries = 0;
    loop {
        let got = send(app, req).await;
        tries += 1;
        if got.status != 500 || !got.text().contains("Deadlock found") || tries > 20 {
            return got;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5 * tries)).await;
    }
}

/// Forty keys sent four times each, all at once: every key runs once and every
/// answer is its 201 or a 409, on every connection of the pool (through a
/// transaction pooler too, whose server connections keep no prepared statement).
pub async fn seaorm_storms_run_each_key_once<H: Harness>()
where
    H::DB: SeaDriver,
    DatabaseConnection: From<sqlx::Pool<H::DB>>,
{
    let Some(h) = crate::start::<H>().await else {
        return;
    };
    lines_table(&h).await;
    let app = app(&h);
    let barrier = Arc::new(tokio::sync::Barrier::new(160));
    let tasks: Vec<_> = (0..160)
        .map(|n| {
            let (app, barrier) = (app.clone(), Arc::clone(&barrier));
            let req = Req::post("storm", &format!("k-{}", n / 4), BODY).path("/sea");
            tokio::spawn(async move {
                barrier.wait().await;
                deadlocks_retried(&app, &req).await
            })
        })
        .collect();
    let mut created = std::collections::HashSet::new();
    for task in tasks {
        let got = task.await.expect("request task");
        assert!(
            matches!(got.status, 201 | 409),
            "{} {}",
            got.status,
            got.text()
        );
        if got.status == 201 {
            created.insert(got.body.clone());
        }
    }
    assert_eq!(created.len(), 40, "one answer per key");
    assert_eq!(h.effects("storm").await, 40);
    assert_eq!(h.count("SELECT count(*) FROM sea_lines", &[]).await, 40);
    h.finish().await;
}

/// The testing kit proves a SeaORM handler exactly-once, and names one that
/// writes through SeaORM's own pool connection; that one, answering 500 after
/// its write, keeps the write and runs again on the retry.
pub async fn the_kit_proves_seaorm_handlers<H: Harness>()
where
    H::DB: SeaDriver,
    DatabaseConnection: From<sqlx::Pool<H::DB>>,
{
    let Some(h) = crate::start::<H>().await else {
        return;
    };
    lines_table(&h).await;
    let h = Arc::new(h);
    let kit = |path: &'static str, scope: &'static str| {
        let counted = Arc::clone(&h);
        let request = move || {
            Request::post(path)
                .header("x-scope", scope)
                .header("content-type", "application/json")
                .body(Body::from(BODY))
                .expect("request")
        };
        ExactlyOnce::new(app(&*h), h.store(), request, move || {
            let h = Arc::clone(&counted);
            async move { h.effects(scope).await }
        })
    };
    let right = kit("/sea", "kit-sea").check().await;
    let report = right.expect("a SeaORM handler on its Tx passes");
    assert_eq!(report.once, 1);
    assert_eq!(report.overlapped, 7, "every duplicate overlapped the first");

    let wrong = kit("/pooled", "kit-pooled").check().await;
    assert!(
        matches!(wrong, Err(Failure::WroteOutsideTx { moved: 1 })),
        "SeaORM on the pool: {wrong:?}"
    );

    // What the kit guards against: the pool's write survives the 500, and the
    // retry writes a second. (On SQLite the pool cannot write at all while the
    // handler's transaction holds the one write lock.)
    if H::SWEEPS_BESIDE_HANDLERS {
        let app = app(&*h);
        let req = Req::post("pooled", "k", BODY)
            .path("/pooled")
            .header("x-status", 500);
        for _ in 0..2 {
            assert_eq!(send(&app, &req).await.status, 500);
        }
        assert_eq!(h.effects("pooled").await, 2, "two executions, two rows");
    }
    match Arc::try_unwrap(h) {
        Ok(h) => h.finish().await,
        Err(_) => panic!("the harness is still shared"),
    }
}

macro_rules! seaorm {
    ($($test:ident),* $(,)?) => {
        seaorm!(@on "postgres", postgres, Pg; $($test),*);
        seaorm!(@on "postgres", postgres_partitioned, PgParted; $($test),*);
        seaorm!(@on "mysql", mysql, My; $($test),*);
        seaorm!(@on "sqlite", sqlite, Lite; $($test),*);
        seaorm!(@on "sqlite", sqlite_deferred, LiteDeferred; $($test),*);
    };
    (@on $feature:literal, $module:ident, $harness:ident; $($test:ident),*) => {
        #[cfg(feature = $feature)]
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $test() {
                    super::$test::<crate::harness::$harness>().await;
                }
            )*
        }
    };
}

seaorm!(
    seaorm_handlers_commit_with_their_answer,
    seaorm_storms_run_each_key_once,
    the_kit_proves_seaorm_handlers,
);
