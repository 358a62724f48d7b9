//! The operator's view of the key table: what is in flight, what is stuck, and
//! what one key holds.

use crate::backend::Backend;
use crate::store::Idempotency;

/// One stored key, as an operator sees it. Times are relative to the database
/// clock at the moment of the query.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyRecord {
    /// The scope the key belongs to.
    pub scope: String,
    /// The key.
    pub key: String,
    /// `processing` (claimed) or `completed` (response stored).
    pub state: String,
    /// Method of the request that claimed it.
    pub method: String,
    /// Path and query of the request that claimed it.
    pub path: String,
    /// The stored status, once completed.
    pub status: Option<i32>,
    /// Milliseconds until the claim's lock passes; negative once it has.
    pub lock_left_ms: i64,
    /// Milliseconds until the key expires; negative once it has.
    pub expires_in_ms: i64,
    /// Milliseconds since it was claimed.
    pub age_ms: i64,
    /// The stored headers (`name: value` lines), once completed.
    pub headers: Vec<u8>,
    /// The stored body, once completed.
    pub body: Vec<u8>,
}

impl KeyRecord {
    /// A `processing` row whose lock has passed: its executor is gone or hung, and
    /// the next retry takes it over.
    pub fn is_stuck(&self) -> bool {
        self.state == "processing" && self.lock_left_ms <= 0
    }
}

/// What to look up; built by [`Idempotency::claims`] and [`Idempotency::inspect`].
#[doc(hidden)]
#[derive(Debug)]
#[allow(unreachable_pub)]
pub enum Query<'a> {
    /// `processing` rows, oldest first.
    Claims {
        scope: Option<&'a str>,
        stuck_only: bool,
        limit: u32,
    },
    /// One (scope, key).
    Key { scope: &'a str, key: &'a str },
    /// The scopes other than `scope` holding `key` (up to 100).
    OtherScopes { scope: &'a str, key: &'a str },
}

impl<DB: Backend> Idempotency<DB> {
    /// Claims in flight (`processing` rows), oldest first: all of them, one
    /// scope's, or only the stuck ones (lock passed).
    ///
    /// # Errors
    ///
    /// Any database error.
    ///
    /// # Examples
    ///
    /// ```rust,no_run
    /// # async fn demo<DB: idem_runtime::Backend>(idempotency: idem_runtime::Idempotency<DB>) -> Result<(), sqlx::Error> {
    /// for claim in idempotency.claims(None, true, 50).await? {
    ///     println!("stuck: {} {} since {} ms", claim.scope, claim.key, claim.age_ms);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn claims(
        &self,
        scope: Option<&str>,
        stuck_only: bool,
        limit: u32,
    ) -> Result<Vec<KeyRecord>, sqlx::Error> {
        let query = Query::Claims {
            scope,
            stuck_only,
            limit,
        };
        self.run_inspect(&query).await
    }

    /// What `scope` holds under `key`, including its stored response.
    ///
    /// # Errors
    ///
    /// Any database error.
    pub async fn inspect(&self, scope: &str, key: &str) -> Result<Option<KeyRecord>, sqlx::Error> {
        let found = self.run_inspect(&Query::Key { scope, key }).await?;
        Ok(found.into_iter().next())
    }

    /// The other scopes (up to 100) that hold `key`; their records are not read.
    /// Scans the table: an operator's call, not one for the hot path.
    ///
    /// # Errors
    ///
    /// Any database error.
    pub async fn other_scopes(&self, scope: &str, key: &str) -> Result<Vec<String>, sqlx::Error> {
        let found = self.run_inspect(&Query::OtherScopes { scope, key }).await?;
        Ok(found.into_iter().map(|record| record.scope).collect())
    }

    async fn run_inspect(&self, query: &Query<'_>) -> Result<Vec<KeyRecord>, sqlx::Error> {
        let mut conn = self.inner.pool.acquire().await?;
        DB::idem_inspect(&mut conn, &self.inner.table, query).await
    }
}

/// Runs a backend's inspection query with its text parameters and decodes the rows.
#[cfg(any(feature = "mysql", feature = "postgres", feature = "sqlite"))]
pub(crate) async fn fetch<DB>(
    conn: &mut DB::Connection,
    sql: String,
    params: Vec<&str>,
) -> Result<Vec<KeyRecord>, sqlx::Error>
where
    DB: sqlx::Database + sqlx::database::HasStatementCache,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'a> DB::Arguments: sqlx::IntoArguments<DB>,
    for<'e> &'e str: sqlx::Encode<'e, DB> + sqlx::Type<DB>,
    for<'a> &'a str: sqlx::ColumnIndex<DB::Row>,
    for<'r> String: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> i64: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> Option<i64>: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> Vec<u8>: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
{
    // Unprepared: an operator's query is rare, and must work through a pooler.
    let mut statement = sqlx::query(sqlx::AssertSqlSafe(sql)).persistent(false);
    for param in params {
        statement = statement.bind(param);
    }
    let rows = statement.fetch_all(conn).await?;
    rows.iter().map(decode).collect()
}

/// Decodes the columns every backend's inspection query selects, in one shape:
/// `scope`, `idempotency_key`, `state`, `method`, `path` as text, `status` and the
/// three `*_ms` as 64-bit integers, `headers` and `body` as bytes (empty if none).
#[cfg(any(feature = "mysql", feature = "postgres", feature = "sqlite"))]
fn decode<R>(row: &R) -> Result<KeyRecord, sqlx::Error>
where
    R: sqlx::Row,
    for<'a> &'a str: sqlx::ColumnIndex<R>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<i64>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    Ok(KeyRecord {
        scope: row.try_get("scope")?,
        key: row.try_get("idempotency_key")?,
        state: row.try_get("state")?,
        method: row.try_get("method")?,
        path: row.try_get("path")?,
        status: row
            .try_get::<Option<i64>, _>("status")?
            .and_then(|s| i32::try_from(s).ok()),
        lock_left_ms: row.try_get("lock_left_ms")?,
        expires_in_ms: row.try_get("expires_in_ms")?,
        age_ms: row.try_get("age_ms")?,
        headers: row.try_get("headers")?,
        body: row.try_get("body")?,
    })
}

impl Query<'_> {
    /// The `WHERE` clause (with `placeholder(n)` for the n-th parameter and `now`
    /// for the database clock), the row limit, whether stored responses are read,
    /// and the parameters in order.
    #[cfg(any(feature = "mysql", feature = "postgres", feature = "sqlite"))]
    pub(crate) fn parts(
        &self,
        placeholder: impl Fn(usize) -> String,
        now: &str,
    ) -> (String, u32, bool, Vec<&str>) {
        match *self {
            Query::Claims {
                scope,
                stuck_only,
                limit,
            } => {
                let mut filter = "state = 'processing'".to_owned();
                let mut params = Vec::new();
                if let Some(scope) = scope {
                    filter.push_str(&format!(" AND scope = {}", placeholder(1)));
                    params.push(scope);
                }
                if stuck_only {
                    filter.push_str(&format!(" AND locked_until <= {now}"));
                }
                (filter, limit, false, params)
            }
            Query::Key { scope, key } => (
                format!(
                    "scope = {} AND idempotency_key = {}",
                    placeholder(1),
                    placeholder(2)
                ),
                1,
                true,
                vec![scope, key],
            ),
            Query::OtherScopes { scope, key } => (
                format!(
                    "idempotency_key = {} AND scope <> {}",
                    placeholder(1),
                    placeholder(2)
                ),
                100,
                false,
                vec![key, scope],
            ),
        }
    }
}
