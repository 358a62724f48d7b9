//! The retrying client as middleware of a [`reqwest-middleware`] client (feature
//! `reqwest`): the policy of the [parent module](super), for reqwest users.
//!
//! [`RetryMiddleware`] keys each `POST` and `PATCH` without an `Idempotency-Key`
//! and sends it again, with the same key and body, after a connection error or
//! timeout, `409` or any `5xx`, as [`RetryLayer`](super::RetryLayer) does; the
//! [`Receipt`] is in the response's extensions. A request whose body cannot be
//! cloned (a stream) is sent once.
//!
//! # Examples
//!
//! ```rust,no_run
//! # extern crate idem_runtime as idem_axum;
//! use idem_axum::client::reqwest::RetryMiddleware;
//! use idem_axum::client::{Receipt, RetryPolicy};
//!
//! # async fn demo() -> Result<(), reqwest_middleware::Error> {
//! let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
//!     .with(RetryMiddleware::new(RetryPolicy::new().max_attempts(4)))
//!     .build();
//! let response = client
//!     .post("http://127.0.0.1:3000/payments")
//!     .header("content-type", "application/json")
//!     .body(r#"{"amount": 1200, "currency": "JPY", "to": "bob"}"#)
//!     .send()
//!     .await?;
//! if let Some(receipt) = response.extensions().get::<Receipt>() {
//!     println!("{} attempt(s) under key {:?}", receipt.attempts(), receipt.key());
//! }
//! # Ok(())
//! # }
//! ```
//!
//! [`reqwest-middleware`]: https://docs.rs/reqwest-middleware

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};

/// The `reqwest-middleware` this module is built against (with `reqwest` inside
/// it), for code that must name the same versions.
pub use reqwest_middleware;

use super::{Receipt, RetryPolicy, key_for, pause_after};

/// Keys and retries requests of a `reqwest-middleware` client: see the [module
/// docs](self).
#[derive(Debug, Clone, Copy, Default)]
pub struct RetryMiddleware {
    policy: RetryPolicy,
}

impl RetryMiddleware {
    /// Middleware retrying under `policy`.
    pub const fn new(policy: RetryPolicy) -> Self {
        Self { policy }
    }
}

#[async_trait::async_trait]
impl Middleware for RetryMiddleware {
    async fn handle(
        &self,
        mut request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let method = request.method().clone();
        let key = key_for(&method, request.headers_mut());
        let policy = self.policy;
        let mut attempts = 1;
        let mut spare = request.try_clone();
        let mut sent = next.clone().run(request, extensions).await;
        loop {
            let pause = match &sent {
                Ok(response) => {
                    match pause_after(response.status(), response.headers(), attempts, &policy) {
                        Some(pause) => pause,
                        None => break,
                    }
                }
                Err(error) if is_transient(error) => policy.backoff(attempts),
                Err(_) => break,
            };
            if attempts >= policy.max_attempts {
                break;
            }
            let Some(again) = spare.take() else {
                break;
            };
            spare = again.try_clone();
            tokio::time::sleep(pause).await;
            attempts += 1;
            sent = next.clone().run(again, extensions).await;
        }
        sent.map(|mut response| {
            let receipt = Receipt::of(key, attempts, response.headers());
            response.extensions_mut().insert(receipt);
            response
        })
    }
}

/// A failure to reach the server or hear from it, as opposed to a request that
/// could never be sent (a bad URL) or another middleware's refusal.
fn is_transient(error: &reqwest_middleware::Error) -> bool {
    match error {
        reqwest_middleware::Error::Reqwest(error) => {
            error.is_connect() || error.is_timeout() || error.is_request()
        }
        reqwest_middleware::Error::Middleware(_) => false,
    }
}
