//! Rewrites the handler so that its body runs inside the runtime's engine.

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{
    Error, FnArg, GenericArgument, Ident, Item, ItemFn, LitBool, Pat, PatType, PathArguments,
    ReturnType, Type,
};

use crate::attr::{Args, DEFAULT_LOCK_MS, DEFAULT_TTL_MS, Errors};

pub(crate) fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    let func = match syn::parse2::<ItemFn>(item.clone()) {
        Ok(func) => func,
        Err(_) => {
            let error = not_a_function(item.clone());
            return quote! { #error #item };
        }
    };
    let args = syn::parse2::<Args>(args);
    match (args, Handler::analyze(&func)) {
        (Ok(args), Ok(handler)) => match handler.expand(&args, &func) {
            Ok(tokens) => tokens,
            Err(error) => with_errors(&func, error),
        },
        (Err(mut first), Err(second)) => {
            first.combine(second);
            with_errors(&func, first)
        }
        (Err(error), _) | (_, Err(error)) => with_errors(&func, error),
    }
}

/// The user's function as written, plus the errors: one mistake, one message.
fn with_errors(func: &ItemFn, error: Error) -> TokenStream {
    let errors = error.to_compile_error();
    quote! { #errors #func }
}

fn not_a_function(item: TokenStream) -> TokenStream {
    const MESSAGE: &str = "#[idempotent] applies to `async fn` axum handlers";
    let error = match syn::parse2::<Item>(item.clone()) {
        Ok(Item::Struct(s)) => Error::new_spanned(s.struct_token, MESSAGE),
        Ok(Item::Enum(e)) => Error::new_spanned(e.enum_token, MESSAGE),
        Ok(Item::Impl(i)) => Error::new_spanned(i.impl_token, MESSAGE),
        Ok(Item::Trait(t)) => Error::new_spanned(t.trait_token, MESSAGE),
        Ok(Item::Const(c)) => Error::new_spanned(c.const_token, MESSAGE),
        Ok(Item::Static(s)) => Error::new_spanned(s.static_token, MESSAGE),
        Ok(Item::Mod(m)) => Error::new_spanned(m.mod_token, MESSAGE),
        Ok(Item::Type(t)) => Error::new_spanned(t.type_token, MESSAGE),
        _ => Error::new_spanned(item, MESSAGE),
    };
    error.to_compile_error()
}

/// A parameter the runtime provides instead of axum.
struct Provided<'a> {
    param: &'a PatType,
}

/// What the handler's signature says.
struct Handler<'a> {
    /// Parameters axum extracts, in order; the last one becomes the body extractor.
    extracted: Vec<&'a PatType>,
    tx: Option<Provided<'a>>,
    /// The database named by `Tx<DB>`.
    db: Option<&'a Type>,
    key: Option<Provided<'a>>,
    /// `true` for `IdempotencyKey`, `false` for `Option<IdempotencyKey>`.
    key_required: bool,
}

impl<'a> Handler<'a> {
    fn analyze(func: &'a ItemFn) -> syn::Result<Self> {
        let mut errors = Errors::default();
        let sig = &func.sig;
        if sig.asyncness.is_none() {
            errors.push(Error::new_spanned(
                sig.fn_token,
                "#[idempotent] handlers must be `async fn`",
            ));
        }
        let mut handler = Handler {
            extracted: Vec::new(),
            tx: None,
            db: None,
            key: None,
            key_required: false,
        };
        for input in &sig.inputs {
            let param = match input {
                FnArg::Typed(param) => param,
                FnArg::Receiver(receiver) => {
                    errors.push(Error::new_spanned(
                        receiver,
                        "#[idempotent] handlers take no `self`",
                    ));
                    continue;
                }
            };
            if let Some(db) = tx_database(&param.ty) {
                if handler.tx.is_some() {
                    errors.push(Error::new_spanned(
                        &param.ty,
                        "a handler has one transaction: this is a second `Tx` parameter",
                    ));
                    continue;
                }
                match db {
                    Some(db) => handler.db = Some(db),
                    None => errors.push(Error::new_spanned(
                        &param.ty,
                        "name the database of the transaction: `Tx<Postgres>` or `Tx<Sqlite>`",
                    )),
                }
                handler.tx = Some(Provided { param });
            } else if let Some(required) = key_param(&param.ty) {
                if handler.key.is_some() {
                    errors.push(Error::new_spanned(
                        &param.ty,
                        "the key is given once: this is a second `IdempotencyKey` parameter",
                    ));
                    continue;
                }
                handler.key = Some(Provided { param });
                handler.key_required = required;
            } else {
                handler.extracted.push(param);
            }
        }
        errors.finish()?;
        Ok(handler)
    }

    fn expand(&self, args: &Args, func: &ItemFn) -> syn::Result<TokenStream> {
        let mut errors = Errors::default();
        let private = quote!(::idem::__private);
        let call = Ident::new("__idem_call", Span::mixed_site());
        let request = Ident::new("__idem_request", Span::mixed_site());
        let tx = Ident::new("__idem_tx", Span::mixed_site());
        let key = Ident::new("__idem_key", Span::mixed_site());
        let scope = Ident::new("__idem_scope", Span::mixed_site());
        let output = Ident::new("__idem_output", Span::mixed_site());

        let db = match (self.db, &args.db) {
            (Some(db), _) | (None, Some(db)) => db.to_token_stream(),
            (None, None) => {
                errors.push(Error::new_spanned(
                    &func.sig.ident,
                    "a handler without a `Tx<DB>` parameter must name its store's database: `#[idempotent(db = Postgres, ...)]`",
                ));
                TokenStream::new()
            }
        };

        // One key space for every client is a choice the handler spells out: by
        // default a guessed key (`order-1`) would replay another user's response.
        let unscoped = args.unscoped.as_ref().filter(|lit| lit.value);
        let scope_value = match (&args.scope, unscoped) {
            (None, Some(_)) => quote!(::std::string::String::new()),
            (Some(_), Some(unscoped)) => {
                errors.push(Error::new_spanned(
                    unscoped,
                    "`scope` and `unscoped = true` contradict each other: keep `scope`",
                ));
                TokenStream::new()
            }
            (None, None) => {
                errors.push(Error::new_spanned(
                    &func.sig.ident,
                    "keys need a scope: name the parameter that identifies the caller, \
                     `scope = \"user\"`, or write `unscoped = true` for an endpoint with no \
                     caller to tell apart (a webhook); in one key space shared by every \
                     client, a guessed key replays another client's response",
                ));
                TokenStream::new()
            }
            (Some(lit), None) => match self.scope_param(lit) {
                Ok((ident, ty)) => {
                    quote_spanned!(ty.span()=> #private::scope_of(&#ident))
                }
                Err(error) => {
                    errors.push(error);
                    TokenStream::new()
                }
            },
        };

        let explicit = args.required.as_ref().map(|lit| lit.value);
        if let (Some(false), true) = (explicit, self.key_required) {
            let span = args.required.as_ref().map(|lit| lit.span());
            let message = "a handler taking `IdempotencyKey` needs a key on every request: \
                           take `Option<IdempotencyKey>`, or drop `required = false`";
            errors.push(Error::new(span.unwrap_or_else(Span::call_site), message));
        }
        errors.finish()?;

        let required = explicit.unwrap_or(false) || self.key_required;
        let ttl = args.ttl.as_ref().map_or(DEFAULT_TTL_MS, |d| d.millis);
        let lock = args.lock.as_ref().map_or(DEFAULT_LOCK_MS, |d| d.millis);
        let wait = args.wait.as_ref().map_or(0, |d| d.millis);
        let ttl_header = args.ttl_header.as_ref().is_some_and(LitBool::value);
        let options = quote! {
            #private::Options::new()
                .ttl(::std::time::Duration::from_millis(#ttl))
                .lock(::std::time::Duration::from_millis(#lock))
                .wait(::std::time::Duration::from_millis(#wait))
                .required(#required)
                .ttl_header(#ttl_header)
        };

        // The last extracted parameter is axum's body extractor; the rest stay in
        // the signature as they were written.
        let (kept, body_pat, body_ty) = match self.extracted.split_last() {
            Some((last, kept)) => (kept, last.pat.to_token_stream(), last.ty.to_token_stream()),
            None => (&[][..], quote!(()), quote!(())),
        };

        let tx_binding = match &self.tx {
            Some(Provided { param }) => {
                let (pat, ty) = (&param.pat, &param.ty);
                quote!(let #pat: #ty = #tx;)
            }
            None => quote!(::std::mem::drop(#tx);),
        };
        let key_binding = match &self.key {
            Some(Provided { param }) if self.key_required => {
                let (pat, ty) = (&param.pat, &param.ty);
                quote! {
                    let #pat: #ty = match #key {
                        ::std::option::Option::Some(key) => key,
                        ::std::option::Option::None => return #private::missing_key(),
                    };
                }
            }
            Some(Provided { param }) => {
                let (pat, ty) = (&param.pat, &param.ty);
                quote!(let #pat: #ty = #key;)
            }
            None => quote!(let _ = #key;),
        };

        let body = &func.block;
        let guard = return_type_guard(&func.sig.output);
        let user_body = quote_spanned! {body.span()=>
            async move {
                #guard
                #body
            }
        };

        let returns = match impl_trait_check(&func.sig.output, &func.sig.generics) {
            check if check.is_empty() => quote!(#user_body.await),
            check => quote!(#check(#user_body.await)),
        };
        let attrs = &func.attrs;
        let vis = &func.vis;
        let ident = &func.sig.ident;
        let generics = &func.sig.generics;
        let where_clause = &func.sig.generics.where_clause;
        let kept = kept.iter();

        Ok(quote! {
            #(#attrs)*
            #vis async fn #ident #generics (
                #(#kept,)*
                #request: #private::Buffered<#db, #body_ty>,
            ) -> #private::Response #where_clause {
                let (#call, #body_pat) = #request.into_parts();
                let #scope: ::std::string::String = #scope_value;
                let #key = #call.scoped_key(&#scope);
                #call
                    .run(&#scope, #options, move |#tx| {
                        ::std::boxed::Box::pin(async move {
                            #tx_binding
                            #key_binding
                            let #output = #returns;
                            #private::IntoResponse::into_response(#output)
                        })
                    })
                    .await
            }
        })
    }

    /// The extracted parameter whose pattern binds the name `scope` gives.
    fn scope_param(&self, lit: &syn::LitStr) -> syn::Result<(Ident, &'a Type)> {
        let wanted = lit.value();
        for param in &self.extracted {
            if let Some(ident) = binds(&param.pat, &wanted) {
                return Ok((ident.clone(), &param.ty));
            }
        }
        let provided = [self.tx.as_ref(), self.key.as_ref()];
        if provided
            .into_iter()
            .flatten()
            .any(|p| binds(&p.param.pat, &wanted).is_some())
        {
            return Err(Error::new_spanned(
                lit,
                format!(
                    "`{wanted}` is given by idem, not by the client: scope names the parameter that identifies the tenant or user"
                ),
            ));
        }
        let mut names = Vec::new();
        for param in &self.extracted {
            bindings(&param.pat, &mut names);
        }
        let hint = if names.is_empty() {
            "the handler has no parameters to scope by".to_owned()
        } else {
            let names: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
            format!("parameters: {}", names.join(", "))
        };
        Err(Error::new_spanned(
            lit,
            format!("no parameter named `{wanted}` to scope keys by; {hint}"),
        ))
    }
}

/// `Some(Some(db))` for `Tx<DB>` (any path ending in `Tx`), `Some(None)` for a `Tx`
/// without a database argument, `None` otherwise.
fn tx_database(ty: &Type) -> Option<Option<&Type>> {
    let segment = last_segment(ty)?;
    if segment.ident != "Tx" {
        return None;
    }
    let PathArguments::AngleBracketed(args) = &segment.arguments else {
        return Some(None);
    };
    Some(args.args.iter().rev().find_map(|arg| match arg {
        GenericArgument::Type(db) => Some(db),
        _ => None,
    }))
}

/// `Some(true)` for `IdempotencyKey`, `Some(false)` for `Option<IdempotencyKey>`.
fn key_param(ty: &Type) -> Option<bool> {
    let segment = last_segment(ty)?;
    if segment.ident == "IdempotencyKey" {
        return Some(true);
    }
    if segment.ident == "Option"
        && let PathArguments::AngleBracketed(args) = &segment.arguments
        && let Some(GenericArgument::Type(inner)) = args.args.first()
        && last_segment(inner).is_some_and(|s| s.ident == "IdempotencyKey")
    {
        return Some(false);
    }
    None
}

fn last_segment(ty: &Type) -> Option<&syn::PathSegment> {
    match ty {
        Type::Path(path) if path.qself.is_none() => path.path.segments.last(),
        Type::Group(group) => last_segment(&group.elem),
        Type::Paren(paren) => last_segment(&paren.elem),
        _ => None,
    }
}

/// Every name `pat` binds, wherever it sits (`user_id`, `AuthUser(user_id)`,
/// `Path((org, user_id))`, ...).
fn bindings<'p>(pat: &'p Pat, out: &mut Vec<&'p Ident>) {
    match pat {
        Pat::Ident(p) => {
            out.push(&p.ident);
            if let Some((_, sub)) = &p.subpat {
                bindings(sub, out);
            }
        }
        Pat::Tuple(t) => t.elems.iter().for_each(|p| bindings(p, out)),
        Pat::TupleStruct(t) => t.elems.iter().for_each(|p| bindings(p, out)),
        Pat::Struct(s) => s.fields.iter().for_each(|f| bindings(&f.pat, out)),
        Pat::Reference(r) => bindings(&r.pat, out),
        Pat::Paren(p) => bindings(&p.pat, out),
        Pat::Slice(s) => s.elems.iter().for_each(|p| bindings(p, out)),
        _ => {}
    }
}

/// The binding named `wanted` in `pat`, if any.
fn binds<'p>(pat: &'p Pat, wanted: &str) -> Option<&'p Ident> {
    let mut names = Vec::new();
    bindings(pat, &mut names);
    names.into_iter().find(|ident| *ident == wanted)
}

/// An unreachable `return` of the declared type, so that `?` inside the body knows
/// which error type to convert into. Skipped for `impl Trait`, which cannot be
/// named in a `let`.
fn return_type_guard(output: &ReturnType) -> TokenStream {
    let ty = match output {
        ReturnType::Default => quote!(()),
        ReturnType::Type(_, ty) if matches!(**ty, Type::ImplTrait(_)) => return TokenStream::new(),
        ReturnType::Type(_, ty) => ty.to_token_stream(),
    };
    let fake = Ident::new("__idem_fake_return", Span::mixed_site());
    quote! {
        #[allow(
            unreachable_code,
            clippy::diverging_sub_expression,
            clippy::empty_loop,
            clippy::let_unit_value,
            clippy::needless_return,
        )]
        if false {
            let #fake: #ty = loop {};
            return #fake;
        }
    }
}

/// For `-> impl Trait`: an identity function bounded by `Trait`, so the bounds the
/// user wrote are still checked (and their imports still used) once the generated
/// handler returns a plain `Response`. Left out when the bounds name the handler's
/// own generics, which a nested fn cannot see.
fn impl_trait_check(output: &ReturnType, generics: &syn::Generics) -> TokenStream {
    let ReturnType::Type(_, ty) = output else {
        return TokenStream::new();
    };
    let Type::ImplTrait(bounded) = &**ty else {
        return TokenStream::new();
    };
    let bounds: Vec<_> = bounded
        .bounds
        .iter()
        .filter(|b| {
            matches!(
                b,
                syn::TypeParamBound::Trait(_) | syn::TypeParamBound::Lifetime(_)
            )
        })
        .collect();
    let outer: Vec<String> = generics
        .params
        .iter()
        .map(|p| match p {
            syn::GenericParam::Type(t) => t.ident.to_string(),
            syn::GenericParam::Lifetime(l) => l.lifetime.ident.to_string(),
            syn::GenericParam::Const(c) => c.ident.to_string(),
        })
        .collect();
    if bounds.is_empty() || mentions(&quote!(#(#bounds)*), &outer) {
        return TokenStream::new();
    }
    let check = Ident::new("__idem_returns", Span::mixed_site());
    quote! {
        {
            fn #check<R: #(#bounds)+*>(value: R) -> R {
                value
            }
            #check
        }
    }
}

fn mentions(tokens: &TokenStream, names: &[String]) -> bool {
    tokens.clone().into_iter().any(|tree| match tree {
        proc_macro2::TokenTree::Ident(ident) => names.iter().any(|n| ident == n),
        proc_macro2::TokenTree::Group(group) => mentions(&group.stream(), names),
        _ => false,
    })
}
