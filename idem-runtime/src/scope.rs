//! What scopes keys: the tenant or user a key belongs to (`docs/contract.md` §2).

use std::borrow::Cow;
use std::sync::Arc;

/// A value that scopes idempotency keys, such as the authenticated user's id.
///
/// Keys are unique per (scope, key): the same key under two scopes is two unrelated
/// requests, and one scope never sees another's stored response. The
/// `#[idempotent(scope = "user_id")]` attribute calls this on the parameter it names.
///
/// Implemented for strings and integers, and for axum's `Extension<T>` of any
/// `T` that implements it (feature `axum`): a layer that inserts the
/// authenticated user scopes by it as it is, `Extension<CurrentUser>`, or
/// destructured, `Extension(user): Extension<CurrentUser>` with `scope = "user"`.
/// Implement it for your own id types.
///
/// # Examples
///
/// ```
/// # extern crate idem_runtime as idem_axum;
/// use std::borrow::Cow;
/// use idem_axum::Scope;
///
/// struct UserId(u64);
///
/// impl Scope for UserId {
///     fn scope(&self) -> Cow<'_, str> {
///         self.0.scope()
///     }
/// }
///
/// assert_eq!(UserId(7).scope(), "7");
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot scope idempotency keys",
    label = "named by `scope = ...`, so it must implement `idem_axum::Scope`",
    note = "implement `idem_axum::Scope` for it, returning the id of the tenant or user the request acts for; \
            a type of another crate can be scoped by a field, or wrapped in a type of yours"
)]
pub trait Scope {
    /// The scope's string form; equal values must give equal strings.
    fn scope(&self) -> Cow<'_, str>;
}

impl Scope for str {
    fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(self)
    }
}

impl Scope for String {
    fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(self)
    }
}

impl Scope for Box<str> {
    fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(self)
    }
}

impl Scope for Arc<str> {
    fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(self)
    }
}

impl Scope for Cow<'_, str> {
    fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(self)
    }
}

impl<T: Scope + ?Sized> Scope for &T {
    fn scope(&self) -> Cow<'_, str> {
        (**self).scope()
    }
}

/// The value a layer inserted: `Extension<CurrentUser>` scopes as `CurrentUser`.
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
impl<T: Scope> Scope for axum::Extension<T> {
    fn scope(&self) -> Cow<'_, str> {
        self.0.scope()
    }
}

macro_rules! integer_scopes {
    ($($t:ty),*) => {
        $(
            impl Scope for $t {
                fn scope(&self) -> Cow<'_, str> {
                    Cow::Owned(self.to_string())
                }
            }
        )*
    };
}

integer_scopes!(
    i8, i16, i32, i64, i128, isize, u8, u16, u32, u64, u128, usize
);

#[cfg(all(test, feature = "axum"))]
mod tests {
    use super::*;

    #[test]
    fn an_extension_scopes_as_its_value() {
        assert_eq!(axum::Extension(42_u64).scope(), "42");
        assert_eq!(axum::Extension(String::from("user-7")).scope(), "user-7");
    }
}
