//! The operator's view of the key table: what is in flight, what is stuck, and
//! what one key holds.

use crate::backend::{Backend, KeyRecord, Query};
use crate::signal::key_digest;
use crate::store::Idempotency;

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
    /// # extern crate idem_runtime as idem_axum;
    /// # async fn demo<DB: idem_axum::Backend>(idempotency: idem_axum::Idempotency<DB>) -> Result<(), sqlx::Error> {
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

    /// Deletes `scope`'s completed record of `key`, so that the next request with
    /// it runs the handler again; returns whether there was one. A claim in flight
    /// is never deleted (its executor may still commit).
    ///
    /// This store's copy in memory goes at once; other running instances replay
    /// theirs until their [`replay_cache_refresh`](crate::Builder::replay_cache_refresh)
    /// has passed (30 seconds by default). The `idem forget` command calls this.
    ///
    /// # Errors
    ///
    /// Any database error.
    ///
    /// # Examples
    ///
    /// ```rust,no_run
    /// # extern crate idem_runtime as idem_axum;
    /// # async fn demo<DB: idem_axum::Backend>(idempotency: idem_axum::Idempotency<DB>) -> Result<(), sqlx::Error> {
    /// if idempotency.forget("user-7", "order-42").await? {
    ///     println!("the next request with order-42 runs again");
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn forget(&self, scope: &str, key: &str) -> Result<bool, sqlx::Error> {
        let mut conn = self.inner().pool.acquire().await?;
        let deleted = DB::idem_forget(&mut conn, &self.inner().sql, scope, key).await?;
        if let Some(cache) = &self.inner().replay_cache {
            cache.forget(&key_digest(&self.inner().table, scope, key));
        }
        Ok(deleted)
    }

    async fn run_inspect(&self, query: &Query<'_>) -> Result<Vec<KeyRecord>, sqlx::Error> {
        let mut conn = self.inner().pool.acquire().await?;
        DB::idem_inspect(&mut conn, &self.inner().sql, query).await
    }
}
