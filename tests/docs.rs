//! The documents that must not drift apart.

#![allow(missing_docs)]

use std::path::Path;

fn read(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

/// The outcome table has one source, `docs/outcomes.md`, which the crate docs
/// include; the README shows it too, and must show it as it is.
#[test]
fn readme_shows_the_outcome_table_of_the_crate_docs() {
    let table = read("docs/outcomes.md");
    let readme = read("README.md");
    assert!(
        readme.contains(table.trim_end()),
        "README.md's outcome table differs from docs/outcomes.md: copy the latter"
    );
}

/// Every `docs/*.md` a source comment or document names exists.
#[test]
fn cited_documents_exist() {
    let mut cited = Vec::new();
    for file in [
        "README.md",
        "src/lib.rs",
        "docs/contract.md",
        "docs/deployment.md",
        "docs/backends.md",
        "docs/runbook.md",
        "idem-runtime/src/backend.rs",
        "idem-runtime/src/engine.rs",
        "idem-runtime/src/key.rs",
        "idem-runtime/src/store.rs",
        "idem-runtime/src/scope.rs",
        "idem-runtime/src/sweep.rs",
        "tests/conformance/main.rs",
    ] {
        let text = read(file);
        for (at, _) in text.match_indices("docs/") {
            let name: String = text[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '/' | '.' | '_' | '-'))
                .collect();
            if let Some(doc) = name
                .strip_suffix('.')
                .or(Some(&name))
                .filter(|n| n.ends_with(".md"))
            {
                cited.push((file, doc.to_owned()));
            }
        }
    }
    assert!(
        cited.len() > 5,
        "found too few citations to be checking anything: {cited:?}"
    );
    for (file, doc) in cited {
        assert!(
            Path::new(env!("CARGO_MANIFEST_DIR")).join(&doc).is_file(),
            "{file} cites {doc}, which does not exist"
        );
    }
}

/// Every problem idem answers is in the outcome table, with its status: a client
/// can meet each of them.
#[test]
fn the_outcome_table_names_every_problem() {
    let table = read("docs/outcomes.md");
    let source = read("idem-runtime/src/problem.rs");
    let slugs: Vec<&str> = source
        .lines()
        .filter_map(|line| line.trim().split_once(" => \"")?.1.strip_suffix("\","))
        .filter(|slug| slug.chars().all(|c| c.is_ascii_lowercase() || c == '-'))
        .collect();
    assert!(slugs.len() >= 13, "the slugs of problem.rs: {slugs:?}");
    for slug in slugs {
        assert!(
            table.contains(&format!("`{slug}`")),
            "docs/outcomes.md does not name `{slug}`"
        );
    }
}

/// Users depend on `idem-axum` and never name `idem-runtime`: every doc example
/// of the runtime names `idem_axum` (behind `extern crate idem_runtime as
/// idem_axum`, which the rendered docs hide).
#[test]
fn doc_examples_name_the_crate_users_depend_on() {
    let mut checked = 0;
    let mut naming = Vec::new();
    let mut dirs = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("idem-runtime/src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("the runtime's sources") {
            let path = entry.expect("an entry").path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("a source");
            for (n, line) in text.lines().enumerate() {
                let line = line.trim_start();
                if !(line.starts_with("///") || line.starts_with("//!")) {
                    continue;
                }
                checked += 1;
                if line.contains("idem_runtime")
                    && !line.contains("extern crate idem_runtime as idem_axum")
                {
                    naming.push(format!("{}:{}: {line}", path.display(), n + 1));
                }
            }
        }
    }
    assert!(
        checked > 1000,
        "read too few doc lines to be checking anything: {checked}"
    );
    assert!(
        naming.is_empty(),
        "doc lines that name idem_runtime:\n{}",
        naming.join("\n")
    );
}
