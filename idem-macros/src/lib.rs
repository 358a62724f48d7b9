//! The `#[idempotent]` attribute of the `idem-axum` crate. Use it through `idem-axum`: the
//! code it generates calls its `__private` module, by the name the crate's
//! `Cargo.toml` gives `idem-axum` (or the path given with `crate = "…"`).

use proc_macro::TokenStream;

mod attr;
mod expand;
mod facade;
mod message;

/// Makes an axum handler exactly-once under the `Idempotency-Key` header.
///
/// ```text
/// #[idempotent(scope = "user_id", ttl = "24h", lock = "30s", required = true)]
/// async fn create_payment(user_id: UserId, tx: Tx<Postgres>, Json(req): Json<NewPayment>) -> ...
/// ```
///
/// See the `idem-axum` crate documentation for the options and what the rewritten
/// handler does.
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(args.into(), item.into(), facade::facade).into()
}
