//! The runtime's modules import one another without a circle: each module's
//! `crate::…` paths (outside its unit tests) point only at modules below it, so
//! that each can be read, changed and tested from the bottom up.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Names the crate root re-exports, by the module that defines them.
const REEXPORTS: &[(&str, &str)] = &[
    ("Backend", "backend"),
    ("Forgotten", "backend"),
    ("InFlight", "backend"),
    ("KeyRecord", "backend"),
    ("Idempotency", "store"),
    ("Builder", "store"),
    ("fingerprint", "digest"),
    ("KeyRing", "seal"),
    ("KeyId", "seal"),
    ("Sealing", "seal"),
    ("Options", "options"),
    ("Tx", "tx"),
    ("IdempotencyKey", "key"),
    ("Outcome", "engine"),
    ("RequestIdentity", "engine"),
    ("HandlerFuture", "engine"),
    ("IDEMPOTENCY_KEY", "record"),
    ("IDEMPOTENT_REPLAYED", "record"),
    ("IDEMPOTENCY_KEY_TTL", "record"),
];

/// The modules each module of `src` names through `crate::`.
fn imports(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut files = Vec::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("the sources").flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    let module = |name: &str| -> Option<String> {
        if src.join(format!("{name}.rs")).exists() {
            return Some(name.to_owned());
        }
        REEXPORTS
            .iter()
            .find(|(reexported, _)| *reexported == name)
            .map(|(_, from)| (*from).to_owned())
    };
    for file in files {
        let relative = file.strip_prefix(src).expect("under src");
        let top = relative
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .expect("a name")
            .trim_end_matches(".rs")
            .to_owned();
        if top == "lib" {
            continue;
        }
        let text = std::fs::read_to_string(&file).expect("a source file");
        let code = text.split("#[cfg(test)]\nmod tests").next().unwrap_or("");
        let edges = graph.entry(top.clone()).or_default();
        for line in code.lines() {
            let line = line.split("//").next().unwrap_or("");
            for (at, _) in line.match_indices("crate::") {
                let rest = &line[at + "crate::".len()..];
                let names: Vec<&str> = match rest.strip_prefix('{') {
                    Some(list) => list.split('}').next().unwrap_or("").split(',').collect(),
                    None => vec![rest],
                };
                for name in names {
                    let name = name.trim();
                    let end = name
                        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                        .unwrap_or(name.len());
                    if let Some(target) = module(&name[..end])
                        && target != top
                    {
                        edges.insert(target);
                    }
                }
            }
        }
    }
    graph
}

/// A circle through `from`, if there is one.
fn circle(
    graph: &BTreeMap<String, BTreeSet<String>>,
    from: &str,
    path: &mut Vec<String>,
) -> Option<Vec<String>> {
    if let Some(at) = path.iter().position(|m| m == from) {
        let mut found = path[at..].to_vec();
        found.push(from.to_owned());
        return Some(found);
    }
    path.push(from.to_owned());
    for next in graph.get(from).into_iter().flatten() {
        if let Some(found) = circle(graph, next, path) {
            return Some(found);
        }
    }
    path.pop();
    None
}

#[test]
fn every_import_points_down() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = imports(&src);
    assert!(graph.len() > 20, "the modules were read: {graph:?}");
    assert!(
        graph["engine"].contains("store") && graph["store"].contains("backend"),
        "imports are found: {graph:?}"
    );
    for module in graph.keys() {
        if let Some(found) = circle(&graph, module, &mut Vec::new()) {
            panic!(
                "modules import one another in a circle: {}",
                found.join(" → ")
            );
        }
    }
}
