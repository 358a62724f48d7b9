//! Rewrites the handler so that its body runs inside the runtime's engine.

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{
    Error, FnArg, GenericArgument, Ident, Item, ItemFn, LitBool, Pat, PatType, PathArguments,
    ReturnType, Type,
};

use crate::attr::{Args, DEFAULT_LOCK_MS, DEFAULT_TTL_MS, Errors, KeySource};
use crate::facade::Found;

/// `facade` tells the name the crate's Cargo.toml gives idem-axum, asked only
/// when the attribute does not say it (`crate = "…"`).
pub(crate) fn idempotent(
    args: TokenStream,
    item: TokenStream,
    facade: impl FnOnce() -> Found,
) -> TokenStream {
    let func = match syn::parse2::<ItemFn>(item.clone()) {
        Ok(func) => func,
        Err(_) => {
            let error = not_a_function(item.clone());
            return quote! { #error #item };
        }
    };
    let args = syn::parse2::<Args>(args);
    if let Ok(parsed) = &args
        && let Some(message) = &parsed.message
    {
        return match crate::message::expand(parsed, message, &func, facade) {
            Ok(tokens) => tokens,
            Err(error) => with_errors(&func, error),
        };
    }
    match (args, Handler::analyze(&func)) {
        (Ok(args), Ok(handler)) => match not_built_for(args.db.as_ref().or(handler.db)) {
            Some(error) => not_built(&func, error),
            None => match handler.expand(&args, &func, facade) {
                Ok(tokens) => tokens,
                Err(error) => with_errors(&func, error),
            },
        },
        (Err(mut first), Err(second)) => {
            first.combine(second);
            with_errors(&func, first)
        }
        (Err(error), _) | (_, Err(error)) => with_errors(&func, error),
    }
}

/// The path generated code reaches the runtime through: `crate = "…"`'s, or the
/// name the crate's Cargo.toml gives idem-axum.
pub(crate) fn private_path(
    args: &Args,
    facade: impl FnOnce() -> Found,
    errors: &mut Errors,
) -> TokenStream {
    if let Some(path) = &args.krate {
        return quote!(#path::__private);
    }
    let name = match facade() {
        Found::Named(name) => syn::parse_str::<Ident>(&name).ok(),
        // Outside Cargo: the package's own name is the best guess.
        Found::Unknown => None,
        Found::Missing => {
            errors.push(Error::new(Span::call_site(), NO_FACADE));
            None
        }
    };
    let name = name.unwrap_or_else(|| Ident::new("idem_axum", Span::call_site()));
    quote!(::#name::__private)
}

/// The crate's Cargo.toml names no dependency on idem-axum: the attribute came
/// through another crate, whose path only the user knows.
const NO_FACADE: &str = "idem-axum is not among this crate's dependencies in Cargo.toml, \
     under its own name or another (`pay = { package = \"idem-axum\", … }`): add it, \
     or, if the attribute comes re-exported by another crate, name the path to idem-axum \
     there: `#[idempotent(crate = \"platform::idem\", …)]`";

/// The errors, and in the function's place a stub any router takes, so that the
/// route adds no error of its own: one mistake, one message. The function as
/// written is kept under another name, so that its body is still checked.
fn with_errors(func: &ItemFn, error: Error) -> TokenStream {
    let errors = error.to_compile_error();
    let mut written = func.clone();
    written.attrs.retain(|attr| attr.path().is_ident("cfg"));
    written.vis = syn::Visibility::Inherited;
    written.sig.ident = Ident::new(
        &format!("__idem_written_{}", func.sig.ident),
        func.sig.ident.span(),
    );
    stub(
        func,
        quote! {
            #errors
            #[allow(dead_code, non_snake_case, clippy::all)]
            #written
        },
    )
}

/// `before`, then a handler any router takes in the function's place, with its
/// `cfg` and docs (a crate that denies missing docs gets no second error).
fn stub(func: &ItemFn, before: TokenStream) -> TokenStream {
    let kept = func
        .attrs
        .iter()
        .filter(|attr| attr.path().is_ident("cfg") || attr.path().is_ident("doc"));
    let vis = &func.vis;
    let ident = &func.sig.ident;
    let generics = &func.sig.generics;
    let where_clause = &func.sig.generics.where_clause;
    quote! {
        #before
        #(#kept)*
        #[allow(dead_code, unused)]
        #vis async fn #ident #generics () #where_clause {}
    }
}

/// The error, the stub, and the parameter types alone (so their imports count
/// as used and a misspelt one is still reported): the handler's body would only
/// repeat the error, in sqlx's traits.
fn not_built(func: &ItemFn, error: Error) -> TokenStream {
    let errors = error.to_compile_error();
    let types = func.sig.inputs.iter().filter_map(|input| match input {
        FnArg::Typed(param) => Some(&param.ty),
        FnArg::Receiver(_) => None,
    });
    let ident = Ident::new(
        &format!("__idem_unbuilt_{}", func.sig.ident),
        func.sig.ident.span(),
    );
    let generics = &func.sig.generics;
    let where_clause = &func.sig.generics.where_clause;
    stub(
        func,
        quote! {
            #errors
            #[allow(dead_code, non_snake_case, clippy::all)]
            fn #ident #generics (#(_: #types),*) #where_clause {}
        },
    )
}

/// The databases this build of idem-axum supports: its features reach this crate
/// too (Cargo.toml), so a missing one is one error on the handler's own `Tx<DB>`
/// rather than several in idem's traits. A name other than sqlx's own (an alias)
/// is left to the trait bounds, whose messages say the same.
const DATABASES: &[(&str, &str, bool)] = &[
    ("Postgres", "postgres", cfg!(feature = "postgres")),
    ("MySql", "mysql", cfg!(feature = "mysql")),
    ("Sqlite", "sqlite", cfg!(feature = "sqlite")),
];

fn not_built_for(db: Option<&Type>) -> Option<Error> {
    let db = db?;
    let (name, feature, _) = DATABASES
        .iter()
        .find(|(name, _, enabled)| !enabled && is_named(db, name))?;
    Some(Error::new_spanned(
        db,
        format!(
            "idem-axum was built without `{name}`: enable its `{feature}` feature, \
             `idem-axum = {{ version = \"0.1\", features = [\"{feature}\"] }}` in Cargo.toml \
             (no database is enabled by default, as in sqlx)"
        ),
    ))
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

/// axum's extractors that read the request body, by the last segment of their path.
const BODY_EXTRACTORS: &[&str] = &[
    "Json",
    "Form",
    "RawForm",
    "Bytes",
    "String",
    "Body",
    "Request",
    "Multipart",
];

/// What the handler's signature says.
struct Handler<'a> {
    /// Its parameters, in order; the last one is axum's body extractor.
    params: Vec<&'a PatType>,
    /// The database named by a parameter spelled `Tx<DB>`.
    db: Option<&'a Type>,
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
            params: Vec::new(),
            db: None,
        };
        let mut txs = 0;
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
            // Spelled out, a second `Tx` is caught here; behind an alias, it is
            // refused when extracted.
            if let Some(db) = tx_database(&param.ty) {
                txs += 1;
                if txs > 1 {
                    errors.push(Error::new_spanned(
                        &param.ty,
                        "a handler has one transaction: this is a second `Tx` parameter",
                    ));
                }
                handler.db = handler.db.or(db);
            }
            handler.params.push(param);
        }
        // Axum reads the body once, with the last parameter: a body extractor
        // elsewhere would fail in the router, far from here.
        let last = handler.params.len().saturating_sub(1);
        for param in &handler.params[..last] {
            if let Some(name) = BODY_EXTRACTORS.iter().find(|n| is_named(&param.ty, n)) {
                errors.push(Error::new_spanned(
                    &param.ty,
                    format!(
                        "`{name}` reads the request body: make it the handler's last parameter"
                    ),
                ));
            }
        }
        errors.finish()?;
        Ok(handler)
    }

    fn expand(
        &self,
        args: &Args,
        func: &ItemFn,
        facade: impl FnOnce() -> Found,
    ) -> syn::Result<TokenStream> {
        let mut errors = Errors::default();
        let private = private_path(args, facade, &mut errors);
        let call = Ident::new("__idem_call", Span::mixed_site());
        let scope = Ident::new("__idem_scope", Span::mixed_site());
        let mark = Ident::new("__idem_mark", Span::mixed_site());
        let handed = Ident::new("__idem_handed", Span::mixed_site());
        let output = Ident::new("__idem_output", Span::mixed_site());
        let tx = Ident::new("__idem_tx", Span::mixed_site());
        let arg = |i: usize| Ident::new(&format!("__idem_a{i}"), Span::mixed_site());
        let value = |i: usize| Ident::new(&format!("__idem_v{i}"), Span::mixed_site());

        let db = match (&args.db, self.db) {
            (Some(db), _) | (None, Some(db)) => db.to_token_stream(),
            (None, None) => {
                errors.push(Error::new_spanned(
                    &func.sig.ident,
                    "name the database of the handler's store, `#[idempotent(db = Postgres, ...)]`: \
                     idem reads it from a parameter written `Tx<DB>` and finds none here \
                     (a type alias hides it)",
                ));
                TokenStream::new()
            }
        };

        // One key space for every client is a choice the handler spells out: by
        // default a guessed key (`order-1`) would replay another user's response.
        let unscoped = args.unscoped.as_ref().filter(|lit| lit.value);
        let scope_param = match (&args.scope, unscoped) {
            (None, Some(_)) => None,
            (Some(_), Some(unscoped)) => {
                errors.push(Error::new_spanned(
                    unscoped,
                    "`scope` and `unscoped = true` contradict each other: keep `scope`",
                ));
                None
            }
            (None, None) => {
                errors.push(Error::new_spanned(
                    &func.sig.ident,
                    "keys need a scope: name the parameter that identifies the caller, \
                     `scope = \"user\"`, or write `unscoped = true` for an endpoint with no \
                     caller to tell apart (a webhook); in one key space shared by every \
                     client, a guessed key replays another client's response",
                ));
                None
            }
            (Some(lit), None) => match self.scope_param(lit) {
                Ok(found) => Some(found),
                Err(error) => {
                    errors.push(error);
                    None
                }
            },
        };

        let explicit = args.required.as_ref().map(|lit| lit.value);
        if let Some(required) = args.required.as_ref().filter(|lit| !lit.value)
            && self
                .params
                .iter()
                .any(|p| is_named(&p.ty, "IdempotencyKey"))
        {
            let message = "a handler taking `IdempotencyKey` needs a key on every request: \
                           take `Option<IdempotencyKey>`, or drop `required = false`";
            errors.push(Error::new_spanned(required, message));
        }
        if let Some(source) = &args.key_source
            && let Some(param) = self.params.iter().find(|p| {
                is_named(&p.ty, "IdempotencyKey") || is_option_of(&p.ty, "IdempotencyKey")
            })
        {
            let place = match source {
                KeySource::Header(name) => format!("the {name} header"),
                KeySource::Json(pointer) => format!("the body's {pointer}"),
            };
            let message = format!(
                "`IdempotencyKey` is the request's `Idempotency-Key` header, and this handler's key is \
                 read from {place}: read it there, from the header or body the handler already takes"
            );
            errors.push(Error::new_spanned(&param.ty, message));
        }
        errors.finish()?;

        let required = explicit.unwrap_or(false);
        let ttl = args.ttl.as_ref().map_or(DEFAULT_TTL_MS, |d| d.millis);
        let lock = args.lock.as_ref().map_or(DEFAULT_LOCK_MS, |d| d.millis);
        let wait = args.wait.as_ref().map_or(0, |d| d.millis);
        let ttl_header = args.ttl_header.as_ref().is_some_and(LitBool::value);
        let release_on = args
            .release_on
            .as_ref()
            .map(|statuses| quote!(.release_on(&[#(#statuses),*])));
        // What documentation generators read from the types (`openapi::doc`).
        let doc = u8::from(required)
            | (u8::from(ttl_header) << 1)
            | (u8::from(args.key_source.is_some()) << 2);
        let json = args.json.then(|| {
            let ignore = &args.ignore;
            quote!(.json_fingerprint(&[#(#ignore),*]))
        });
        let options = quote! {
            #private::Options::new()
                .ttl(::std::time::Duration::from_millis(#ttl))
                .lock(::std::time::Duration::from_millis(#lock))
                .wait(::std::time::Duration::from_millis(#wait))
                .required(#required)
                .ttl_header(#ttl_header)
                #release_on
                #json
        };

        // Every parameter keeps its place, so that the function still takes what it
        // was written to take (`#[debug_handler]` checks it either side of this
        // attribute). `State`s stay as written; the others are wrapped so that the
        // runtime sees them, and bound to their patterns once the key is claimed.
        let last = self.params.len().saturating_sub(1);
        let mut inputs = Vec::new();
        let mut before = Vec::new();
        let mut receive = Vec::new();
        let mut bind = Vec::new();
        for (i, param) in self.params.iter().enumerate() {
            let (pat, ty, a, v) = (&param.pat, &param.ty, arg(i), value(i));
            let taken = if i == last {
                inputs.push(quote!(#a: #private::Buffered<#db, #ty, #doc>));
                quote!(#v)
            } else if is_named(ty, "State") {
                inputs.push(quote!(#param));
                continue;
            } else {
                inputs.push(quote!(#a: #private::Arg<#db, #ty>));
                quote!(#a.0)
            };
            if scope_param.is_some_and(|(index, _)| index == i) {
                before.push(quote!(let #pat: #ty = #taken;));
                continue;
            }
            receive.push(quote_spanned! {ty.span()=>
                let mut #v = #taken;
                (&mut #v).idem_receive(&mut #handed);
            });
            bind.push(quote!(let #pat: #ty = #v;));
        }
        let (last_arg, last_value) = (arg(last), value(last));
        if self.params.is_empty() {
            inputs.push(quote!(#last_arg: #private::Buffered<#db, (), #doc>));
        }
        // The verifier comes from the router's state, as a `State` does; it is
        // extracted before the buffered request, and runs first on it.
        let verifying = Ident::new("__idem_verifying", Span::mixed_site());
        let verifier = match &args.verify {
            Some(ty) => {
                let at = inputs.len() - 1;
                inputs.insert(
                    at,
                    quote_spanned!(ty.span()=> #verifying: #private::Verifying<#ty>),
                );
                quote_spanned!(ty.span()=> #private::verifier::<#ty>(&#verifying))
            }
            None => quote!(::std::option::Option::None),
        };
        let source = match &args.key_source {
            None => quote!(#private::KeySource::IDEMPOTENCY_KEY),
            Some(KeySource::Header(name)) => quote!(#private::KeySource::__header(#name)),
            Some(KeySource::Json(pointer)) => quote!(#private::KeySource::__json(#pointer)),
        };
        // The last extractor runs once the request is known not to be a replay
        // kept in memory (`Call::run`), unless the scope needs its value first.
        let extracting = Ident::new("__idem_extracting", Span::mixed_site());
        let (extract_now, extracted, last_received) =
            if scope_param.is_some_and(|(index, _)| index == last) {
                let now = quote! {
                    let #last_value = match #extracting.await {
                        ::std::result::Result::Ok(value) => value,
                        ::std::result::Result::Err(rejection) => {
                            return #private::Answer::new(rejection);
                        }
                    };
                };
                (now, quote!(#private::Extracting::done(())), quote!(_))
            } else {
                (TokenStream::new(), quote!(#extracting), quote!(#last_value))
            };
        let scope_value = match scope_param {
            Some((_, (ident, ty))) => quote_spanned!(ty.span()=> #private::scope_of(&#ident)),
            None => quote!(::std::string::String::new()),
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
        // The handler's own return type, unless an `impl Trait` in it cannot be named.
        let answer = match &func.sig.output {
            ReturnType::Default => quote!(()),
            ReturnType::Type(_, ty) if names_impl_trait(&ty.to_token_stream()) => {
                quote!(#private::Response)
            }
            ReturnType::Type(_, ty) => ty.to_token_stream(),
        };
        let answered = Ident::new("__idem_answered", Span::mixed_site());
        let attrs = &func.attrs;
        let vis = &func.vis;
        let ident = &func.sig.ident;
        let generics = &func.sig.generics;
        let where_clause = &func.sig.generics.where_clause;

        Ok(quote! {
            #(#attrs)*
            #vis async fn #ident #generics (#(#inputs),*) -> #private::Answer<#answer, #doc> #where_clause {
                let (#call, #extracting) = match #last_arg.receive(#source, #verifier) {
                    ::std::result::Result::Ok(received) => received,
                    ::std::result::Result::Err(rejection) => {
                        return #private::Answer::new(*rejection);
                    }
                };
                let #mark = #call.in_handler();
                #extract_now
                #(#before)*
                let #scope: ::std::string::String = #scope_value;
                let #answered = #call
                    .run(#scope, #options, #extracted, move |#tx, #last_received, #scope| {
                        ::std::boxed::Box::pin(async move {
                            #[allow(unused_imports)]
                            use #private::{Inert as _, Receive as _};
                            let mut #handed = #private::Handed::new(#tx, #scope, #mark);
                            #(#receive)*
                            if let ::std::option::Option::Some(refused) = #handed.refused() {
                                return refused;
                            }
                            ::std::mem::drop(#handed);
                            #(#bind)*
                            let #output = #returns;
                            #private::IntoResponse::into_response(#output)
                        })
                    })
                    .await;
                #private::Answer::new(#answered)
            }
        })
    }

    /// The parameter whose pattern binds the name `scope` gives: its index, the
    /// binding and its type.
    fn scope_param(&self, lit: &syn::LitStr) -> syn::Result<(usize, (&'a Ident, &'a Type))> {
        let wanted = lit.value();
        for (i, param) in self.params.iter().enumerate() {
            if let Some(ident) = binds(&param.pat, &wanted) {
                if is_named(&param.ty, "Tx") || is_named(&param.ty, "IdempotencyKey") {
                    return Err(Error::new_spanned(
                        lit,
                        format!(
                            "`{wanted}` is given by idem, not by the client: scope names the parameter that identifies the tenant or user"
                        ),
                    ));
                }
                if is_named(&param.ty, "Option") {
                    return Err(Error::new_spanned(
                        &param.ty,
                        "the scope must be there: an `Option` lets a caller without one share one key space with every other; \
                         take the type itself, whose extractor refuses a request without it, or scope by another parameter",
                    ));
                }
                return Ok((i, (ident, &param.ty)));
            }
        }
        let mut names = Vec::new();
        for param in &self.params {
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

/// Whether `ty`'s path ends in `name`: a hint only, since an alias hides it.
fn is_named(ty: &Type, name: &str) -> bool {
    last_segment(ty).is_some_and(|segment| segment.ident == name)
}

/// Whether `ty` is `Option<T>` with `T`'s path ending in `name`.
fn is_option_of(ty: &Type, name: &str) -> bool {
    let Some(segment) = last_segment(ty).filter(|segment| segment.ident == "Option") else {
        return false;
    };
    let PathArguments::AngleBracketed(args) = &segment.arguments else {
        return false;
    };
    args.args
        .iter()
        .any(|arg| matches!(arg, GenericArgument::Type(inner) if is_named(inner, name)))
}

/// `Some(Some(db))` for `Tx<DB>` (any path ending in `Tx`), `Some(None)` for a `Tx`
/// without a database argument, `None` otherwise.
pub(crate) fn tx_database(ty: &Type) -> Option<Option<&Type>> {
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
pub(crate) fn bindings<'p>(pat: &'p Pat, out: &mut Vec<&'p Ident>) {
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
pub(crate) fn return_type_guard(output: &ReturnType) -> TokenStream {
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

/// Whether `tokens` hold an `impl` (an `impl Trait` anywhere in a type).
fn names_impl_trait(tokens: &TokenStream) -> bool {
    tokens.clone().into_iter().any(|token| match token {
        proc_macro2::TokenTree::Ident(ident) => ident == "impl",
        proc_macro2::TokenTree::Group(group) => names_impl_trait(&group.stream()),
        _ => false,
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn expanded(args: TokenStream) -> String {
        expanded_where(args, Found::Unknown)
    }

    /// Expanded in a crate whose Cargo.toml says `found` of idem-axum.
    fn expanded_where(args: TokenStream, found: Found) -> String {
        // Behind an alias, so that the test does not depend on this crate's features.
        let item = quote! {
            async fn transfer(tx: Tx<Db>) -> StatusCode {
                let _ = tx;
                StatusCode::CREATED
            }
        };
        idempotent(args, item, || found).to_string()
    }

    /// A renamed dependency: every path of the generated code goes through the
    /// name given, none through the crate's own name.
    #[test]
    fn the_crate_option_names_every_path() {
        let default = expanded(quote!(unscoped = true));
        assert!(default.contains(":: idem_axum :: __private"), "{default}");
        let renamed = expanded(quote!(crate = "pay", unscoped = true));
        assert!(renamed.contains("pay :: __private"), "{renamed}");
        assert!(!renamed.contains("idem_axum"), "{renamed}");
        assert!(!renamed.contains("compile_error"), "{renamed}");
    }

    /// Without the option, the name Cargo.toml gives idem-axum; the option wins
    /// over it; no dependency at all is one error that says what to write.
    #[test]
    fn the_name_in_cargo_toml_is_used() {
        let pay = || Found::Named("pay".to_owned());
        let found = expanded_where(quote!(unscoped = true), pay());
        assert!(found.contains(":: pay :: __private"), "{found}");
        assert!(!found.contains("idem_axum"), "{found}");
        assert!(!found.contains("compile_error"), "{found}");
        let told = expanded_where(quote!(crate = "app::idem", unscoped = true), pay());
        assert!(told.contains("app :: idem :: __private"), "{told}");
        assert!(!told.contains(":: pay"), "{told}");
        let missing = expanded_where(quote!(unscoped = true), Found::Missing);
        assert_eq!(missing.matches("compile_error").count(), 1, "{missing}");
        assert!(
            missing.contains("crate = \\\"platform::idem\\\""),
            "{missing}"
        );
        assert!(!missing.contains("__private"), "{missing}");
    }

    /// A database this build lacks is one error, on the handler's `Tx<DB>` or
    /// `db = …`, and nothing else is generated; one it has expands as usual.
    #[test]
    fn a_database_not_built_for_is_one_error() {
        for (name, feature, enabled) in DATABASES {
            let db = Ident::new(name, Span::call_site());
            for (args, item) in [
                (
                    quote!(unscoped = true),
                    quote!(async fn transfer(tx: sqlx::Tx<#db>) {}),
                ),
                (
                    quote!(unscoped = true, db = sqlx::#db),
                    quote!(
                        async fn transfer(tx: Alias) {}
                    ),
                ),
            ] {
                let out = idempotent(args, item, || Found::Unknown).to_string();
                let errors = out.matches("compile_error").count();
                if *enabled {
                    assert_eq!(errors, 0, "{out}");
                } else {
                    assert_eq!(errors, 1, "{out}");
                    assert!(out.contains(&format!("[\\\"{feature}\\\"]")), "{out}");
                    assert!(!out.contains("__private"), "{out}");
                }
            }
        }
    }
}
