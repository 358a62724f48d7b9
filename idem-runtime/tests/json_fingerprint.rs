//! Property tests of `json_fingerprint`: two renderings of one JSON value (members in
//! another order, other whitespace, escapes and number spellings) share a
//! fingerprint, two different values never do, and an ignored member never counts.

#![allow(missing_docs)]

use std::collections::BTreeMap;
use std::fmt::Write as _;

use idem_runtime::json_fingerprint;
use proptest::prelude::*;

#[derive(Debug, Clone, PartialEq)]
enum Tree {
    Null,
    Bool(bool),
    /// Small values, so that two generated trees are often equal.
    Number(f64),
    Text(String),
    List(Vec<Tree>),
    Map(BTreeMap<String, Tree>),
}

fn text() -> impl Strategy<Value = String> {
    // ASCII, an escape-worthy control character, a quote, accents, a character
    // above U+E000 and one beyond the BMP (a surrogate pair in UTF-16).
    proptest::collection::vec(
        prop::sample::select(vec![
            'a', 'b', 'Z', '\n', '\u{1}', '"', '\\', '/', 'é', '\u{fffd}', '😀',
        ]),
        0..4,
    )
    .prop_map(|chars| chars.into_iter().collect())
}

fn tree() -> impl Strategy<Value = Tree> {
    let leaf = prop_oneof![
        Just(Tree::Null),
        any::<bool>().prop_map(Tree::Bool),
        // Within ±2^53: an integer beyond is compared as written (see `json.rs`).
        prop::sample::select(vec![
            0.0,
            1.0,
            -1.0,
            100.0,
            0.5,
            1.25,
            1e-7,
            123.456,
            9007199254740992.0
        ])
        .prop_map(Tree::Number),
        text().prop_map(Tree::Text),
    ];
    leaf.prop_recursive(4, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Tree::List),
            proptest::collection::btree_map(text(), inner, 0..4).prop_map(Tree::Map),
        ]
    })
}

/// How a client renders a value: compact and in order, or rebuilt.
#[derive(Debug, Clone, Copy)]
struct Style {
    reversed: bool,
    spaced: bool,
    escaped: bool,
    spelling: u8,
}

fn style() -> impl Strategy<Value = Style> {
    (any::<bool>(), any::<bool>(), any::<bool>(), 0u8..3).prop_map(
        |(reversed, spaced, escaped, spelling)| Style {
            reversed,
            spaced,
            escaped,
            spelling,
        },
    )
}

fn render(tree: &Tree, style: Style, out: &mut String) {
    let gap = if style.spaced { " \n\t" } else { "" };
    match tree {
        Tree::Null => out.push_str("null"),
        Tree::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Tree::Number(n) => {
            let _ = match style.spelling {
                0 => write!(out, "{n}"),
                1 => write!(out, "{n:e}"),
                _ if n.fract() == 0.0 && n.abs() < 1e15 => write!(out, "{n:.1}"),
                _ => write!(out, "{:E}", n),
            };
        }
        Tree::Text(s) => string(s, style.escaped, out),
        Tree::List(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(gap);
                render(item, style, out);
            }
            out.push_str(gap);
            out.push(']');
        }
        Tree::Map(members) => {
            out.push('{');
            let mut order: Vec<_> = members.iter().collect();
            if style.reversed {
                order.reverse();
            }
            for (i, (name, value)) in order.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(gap);
                string(name, style.escaped, out);
                out.push_str(gap);
                out.push(':');
                render(value, style, out);
            }
            out.push_str(gap);
            out.push('}');
        }
    }
}

fn string(s: &str, escaped: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c if escaped && !c.is_ascii_alphanumeric() => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04X}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn rendered(tree: &Tree, style: Style) -> String {
    let mut out = String::new();
    render(tree, style, &mut out);
    out
}

fn fp(body: &str, ignore: &[&str]) -> [u8; 32] {
    json_fingerprint(body.as_bytes(), ignore).unwrap_or_else(|e| panic!("{body}: {e}"))
}

/// `-0` and `0` are one value in JSON's number model, as RFC 8785 writes it.
fn same_value(a: &Tree, b: &Tree) -> bool {
    match (a, b) {
        (Tree::Number(x), Tree::Number(y)) => x == y,
        (Tree::List(x), Tree::List(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same_value(a, b))
        }
        (Tree::Map(x), Tree::Map(y)) => {
            x.len() == y.len()
                && x.iter()
                    .zip(y)
                    .all(|((ka, a), (kb, b))| ka == kb && same_value(a, b))
        }
        _ => a == b,
    }
}

proptest! {
    #[test]
    fn one_value_has_one_fingerprint(tree in tree(), a in style(), b in style()) {
        prop_assert_eq!(fp(&rendered(&tree, a), &[]), fp(&rendered(&tree, b), &[]));
    }

    #[test]
    fn two_values_have_two(x in tree(), y in tree(), a in style(), b in style()) {
        let equal = fp(&rendered(&x, a), &[]) == fp(&rendered(&y, b), &[]);
        prop_assert_eq!(equal, same_value(&x, &y), "{:?} / {:?}", x, y);
    }

    #[test]
    fn ignored_members_never_count(
        members in proptest::collection::btree_map("[a-c]{1,2}", tree(), 0..4),
        stamp in tree(),
        a in style(),
        b in style(),
    ) {
        let without = Tree::Map(members.clone());
        let mut with = members;
        with.insert("sent_at".to_owned(), stamp);
        let with = Tree::Map(with);
        let ignore = ["/sent_at"];
        prop_assert_eq!(fp(&rendered(&with, a), &ignore), fp(&rendered(&without, b), &ignore));
    }
}
