//! `#[idempotent(message, …)]`: rewrites an `async fn` that takes a message and a
//! `Tx<DB>` into one that runs it through `Idempotency::process`, at most once per
//! message id (docs/contract.md, "Messages").

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{Error, FnArg, GenericArgument, Ident, ItemFn, PathArguments, ReturnType, Type};

use crate::attr::{Args, DEFAULT_LOCK_MS, DEFAULT_TTL_MS, Errors};
use crate::expand::{bindings, private_path, return_type_guard, tx_database};
use crate::facade::Found;

/// The options that only an axum handler has, and why.
const HTTP_ONLY: &[(&str, &str)] = &[
    (
        "required",
        "a message handler's id is always required: a message without one is refused, never run",
    ),
    (
        "ttl_header",
        "a message handler sends no response headers: its result is handed back as a value",
    ),
    (
        "release_on",
        "a message handler's `Err` is never recorded: it rolls back and the message is delivered again",
    ),
    (
        "unscoped",
        "a message handler always names its key space: `scope = \"orders\"`",
    ),
    (
        "verify",
        "a message comes from the broker the consumer trusts; `verify` checks a webhook sender's signature",
    ),
];

pub(crate) fn expand(
    args: &Args,
    message: &Ident,
    func: &ItemFn,
    facade: impl FnOnce() -> Found,
) -> syn::Result<TokenStream> {
    let mut errors = Errors::default();
    for (name, why) in HTTP_ONLY {
        let written = match *name {
            "required" => args.required.as_ref().map(ToTokens::to_token_stream),
            "ttl_header" => args.ttl_header.as_ref().map(ToTokens::to_token_stream),
            "unscoped" => args.unscoped.as_ref().map(ToTokens::to_token_stream),
            "verify" => args.verify.as_ref().map(ToTokens::to_token_stream),
            _ => args.release_on_at.as_ref().map(ToTokens::to_token_stream),
        };
        if let Some(written) = written {
            errors.push(Error::new_spanned(
                written,
                format!("`{name}` is for axum handlers: {why}"),
            ));
        }
    }

    let sig = &func.sig;
    if sig.asyncness.is_none() {
        errors.push(Error::new_spanned(
            sig.fn_token,
            "#[idempotent(message, …)] handlers must be `async fn`",
        ));
    }
    let mut tx = None;
    let mut params = Vec::new();
    let mut names = Vec::new();
    for input in &sig.inputs {
        let param = match input {
            FnArg::Typed(param) => param,
            FnArg::Receiver(receiver) => {
                errors.push(Error::new_spanned(
                    receiver,
                    "#[idempotent(message, …)] handlers take no `self`",
                ));
                continue;
            }
        };
        bindings(&param.pat, &mut names);
        match tx_database(&param.ty) {
            Some(db) if tx.is_none() => tx = Some((param, db)),
            Some(_) => errors.push(Error::new_spanned(
                &param.ty,
                "a handler has one transaction: this is a second `Tx` parameter",
            )),
            None => params.push(param),
        }
    }
    if tx.is_none() {
        errors.push(Error::new_spanned(
            &sig.ident,
            "a message handler writes through its transaction, which commits with its \
             recorded result: add a parameter `tx: Tx<DB>`",
        ));
    }
    let key = args.key.as_ref();
    if key.is_none() {
        errors.push(Error::new_spanned(
            message,
            "a message handler needs the message's id: `key = …`, an expression over the \
             arguments, like `key = order.id` or `key = delivery.id.as_str()`",
        ));
    }
    let payload = args.payload.as_ref();
    if payload.is_none() {
        errors.push(Error::new_spanned(
            message,
            "name the message's bytes, `payload = …`, like `payload = &delivery.data`: a \
             redelivery of the same id with other bytes is refused, never run",
        ));
    }
    let scope = args.scope_expr.as_ref();
    match (scope, &args.scope) {
        (None, _) => errors.push(Error::new_spanned(
            message,
            "name the key space the ids are unique in: `scope = \"orders\"`, or an expression \
             over the arguments, like `scope = order.shop_id`",
        )),
        (Some(_), Some(lit)) if names.iter().any(|name| *name == &lit.value()) => {
            let name = lit.value();
            errors.push(Error::new_spanned(
                lit,
                format!(
                    "a message handler's scope is an expression: write `scope = {name}` for \
                     the parameter's value; `\"{name}\"` would be the same scope for every message"
                ),
            ));
        }
        _ => {}
    }
    let private = private_path(args, facade, &mut errors);
    let (ok, err) = match &sig.output {
        ReturnType::Default => {
            errors.push(Error::new_spanned(
                &sig.ident,
                "a message handler returns `Result<T, E>`: `Ok` is recorded with its writes \
                 and handed to every later delivery, `Err` rolls them back",
            ));
            (TokenStream::new(), TokenStream::new())
        }
        ReturnType::Type(_, ty) => result_parts(ty, &private),
    };
    let db = match (&args.db, tx.and_then(|(_, db)| db)) {
        (Some(db), _) | (None, Some(db)) => db.to_token_stream(),
        (None, None) if tx.is_some() => {
            errors.push(Error::new_spanned(
                &sig.ident,
                "name the database of the handler's store, `#[idempotent(message, db = Postgres, \
                 ...)]`: idem reads it from a parameter written `Tx<DB>` and finds none here \
                 (a type alias hides it)",
            ));
            TokenStream::new()
        }
        (None, None) => TokenStream::new(),
    };
    errors.finish()?;
    let (Some((tx, _)), Some(key), Some(payload), Some(scope), ReturnType::Type(_, ret)) =
        (tx, key, payload, scope, &sig.output)
    else {
        unreachable!("each missing part is an error above");
    };

    let ttl = args.ttl.as_ref().map_or(DEFAULT_TTL_MS, |d| d.millis);
    let lock = args.lock.as_ref().map_or(DEFAULT_LOCK_MS, |d| d.millis);
    let wait = args.wait.as_ref().map_or(0, |d| d.millis);
    let json = args.json.then(|| {
        let ignore = &args.ignore;
        quote!(.json_fingerprint(&[#(#ignore),*]))
    });
    let store = Ident::new("idempotency", Span::mixed_site());
    let options = Ident::new("__idem_options", Span::mixed_site());
    let delivery = Ident::new("__idem_delivery", Span::mixed_site());
    let given = Ident::new("__idem_tx", Span::mixed_site());
    let source = sig.ident.to_string();
    let (tx_pat, tx_ty) = (&tx.pat, &tx.ty);
    let guard = return_type_guard(&sig.output);
    let body = &func.block;
    // One call carries every bound a handler's result must meet, so that a
    // result that is not a `Result`, or cannot be recorded, is one error.
    let process = quote_spanned! {ret.span()=> #private::process };
    let attrs = &func.attrs;
    let vis = &func.vis;
    let ident = &sig.ident;
    let generics = &sig.generics;
    let where_clause = &sig.generics.where_clause;
    Ok(quote! {
        #(#attrs)*
        #vis async fn #ident #generics (
            #store: &#private::Idempotency<#db>,
            #(#params),*
        ) -> #private::Processed<#ok, #err> #where_clause {
            let #options = #private::Options::new()
                .ttl(::std::time::Duration::from_millis(#ttl))
                .lock(::std::time::Duration::from_millis(#lock))
                .wait(::std::time::Duration::from_millis(#wait))
                #json;
            let #delivery = #private::delivery(
                #private::message_id(&(#key)),
                ::std::string::ToString::to_string(&(#scope)),
                #source,
                &#options,
                &(#payload),
            );
            #process(#store, #delivery, #options, move |#given| async move {
                #guard
                let #tx_pat: #tx_ty = #given;
                #body
            })
            .await
        }
    })
}

/// `T` and `E` of a return type written `Result<T, E>`; under another name (an
/// alias), the runtime's `MessageResult` names them, and refuses a non-`Result`.
fn result_parts(ty: &Type, private: &TokenStream) -> (TokenStream, TokenStream) {
    if let Type::Path(path) = ty
        && let Some(last) = path.path.segments.last()
        && last.ident == "Result"
        && let PathArguments::AngleBracketed(args) = &last.arguments
        && let [GenericArgument::Type(ok), GenericArgument::Type(err)] =
            args.args.iter().collect::<Vec<_>>()[..]
    {
        return (ok.to_token_stream(), err.to_token_stream());
    }
    (
        quote_spanned! {ty.span()=> <#ty as #private::MessageResult>::Ok },
        quote_spanned! {ty.span()=> <#ty as #private::MessageResult>::Err },
    )
}
