//! Which name the crate being compiled gives `idem-axum`: its `Cargo.toml` may
//! rename the dependency (`pay = { package = "idem-axum", … }`), and the
//! generated code must call the facade by the name that is in scope.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::SystemTime;

use toml::de::{DeTable, DeValue};

/// The package the generated code calls.
const PACKAGE: &str = "idem-axum";

/// What a manifest says of the facade.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Found {
    /// In scope as this crate name (`-` already made `_`).
    Named(String),
    /// The manifest was read and names no such dependency.
    Missing,
    /// No manifest to read (a build outside Cargo): the package's own name is
    /// the best guess.
    Unknown,
}

/// The facade's name for the crate being compiled, read once per version of its
/// manifest: every attribute of a crate asks the same, and a process that
/// expands for a long time (an editor's) sees an edited manifest anew.
pub(crate) fn facade() -> Found {
    type Seen = HashMap<(PathBuf, Option<SystemTime>), Found>;
    static SEEN: Mutex<Option<Seen>> = Mutex::new(None);
    let Some(dir) = std::env::var_os("CARGO_MANIFEST_DIR") else {
        return Found::Unknown;
    };
    let manifest = Path::new(&dir).join("Cargo.toml");
    let modified = std::fs::metadata(&manifest)
        .and_then(|meta| meta.modified())
        .ok();
    let mut seen = SEEN.lock().unwrap_or_else(PoisonError::into_inner);
    seen.get_or_insert_with(HashMap::new)
        .entry((manifest.clone(), modified))
        .or_insert_with(|| read(&manifest))
        .clone()
}

fn read(manifest: &Path) -> Found {
    let Ok(text) = std::fs::read_to_string(manifest) else {
        return Found::Unknown;
    };
    // A dependency inherited from the workspace (`pay = { workspace = true }`)
    // takes its package from the workspace's manifest.
    let workspace = || {
        manifest
            .parent()?
            .ancestors()
            .skip(1)
            .map(|dir| dir.join("Cargo.toml"))
            .filter_map(|path| std::fs::read_to_string(path).ok())
            .find(|text| {
                DeTable::parse(text).is_ok_and(|doc| doc.get_ref().contains_key("workspace"))
            })
    };
    name_in(&text, workspace)
}

/// What the manifest `text` says of the facade; [`Found::Unknown`] if it is not
/// TOML, which Cargo would not have read either. `workspace` gives the workspace
/// root's manifest, read only if a dependency is inherited.
pub(crate) fn name_in(text: &str, workspace: impl FnOnce() -> Option<String>) -> Found {
    let Ok(doc) = DeTable::parse(text) else {
        return Found::Unknown;
    };
    let doc = doc.get_ref();
    // The facade's own tests, examples and doctests.
    if table(doc, "package").and_then(|p| string(p, "name")) == Some(PACKAGE) {
        return Found::Named(PACKAGE.replace('-', "_"));
    }
    // Normal dependencies first: a lib sees only those.
    let mut tables: Vec<&DeTable<'_>> = Vec::new();
    for kind in ["dependencies", "dev-dependencies", "build-dependencies"] {
        tables.extend(table(doc, kind));
        if let Some(targets) = table(doc, "target") {
            tables.extend(targets.values().filter_map(|cfg| match cfg.get_ref() {
                DeValue::Table(cfg) => table(cfg, kind),
                _ => None,
            }));
        }
    }
    let mut inherited = Vec::new();
    for deps in tables {
        for (name, spec) in deps {
            let name = name.get_ref().as_ref();
            let package = match spec.get_ref() {
                DeValue::Table(spec) => {
                    if matches!(
                        spec.get("workspace").map(|v| v.get_ref()),
                        Some(DeValue::Boolean(true))
                    ) {
                        inherited.push(name);
                    }
                    string(spec, "package").unwrap_or(name)
                }
                _ => name,
            };
            if package == PACKAGE {
                return Found::Named(name.replace('-', "_"));
            }
        }
    }
    if inherited.is_empty() {
        return Found::Missing;
    }
    let root = workspace();
    let root = root.as_deref().and_then(|root| DeTable::parse(root).ok());
    let shared = root
        .as_ref()
        .and_then(|root| table(root.get_ref(), "workspace"))
        .and_then(|workspace| table(workspace, "dependencies"));
    let from_workspace = |name: &&str| {
        let spec = shared.and_then(|deps| table(deps, name));
        spec.and_then(|spec| string(spec, "package")) == Some(PACKAGE)
    };
    match inherited.into_iter().find(from_workspace) {
        Some(name) => Found::Named(name.replace('-', "_")),
        None => Found::Missing,
    }
}

fn table<'a, 'i>(parent: &'a DeTable<'i>, name: &str) -> Option<&'a DeTable<'i>> {
    match parent.get(name)?.get_ref() {
        DeValue::Table(table) => Some(table),
        _ => None,
    }
}

fn string<'a>(parent: &'a DeTable<'_>, name: &str) -> Option<&'a str> {
    match parent.get(name)?.get_ref() {
        DeValue::String(value) => Some(value.as_ref()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::{Found, name_in};

    fn name(text: &str) -> Found {
        name_in(text, || None)
    }

    fn named(name: &str) -> Found {
        Found::Named(name.to_owned())
    }

    #[test]
    fn the_dependency_is_found_however_it_is_written() {
        let cases = [
            ("[dependencies]\nidem-axum = \"0.1\"", "idem_axum"),
            (
                "[dependencies]\npay = { package = \"idem-axum\", version = \"0.1\" }",
                "pay",
            ),
            (
                "[dependencies.pay]\npackage = \"idem-axum\"\nversion = \"0.1\"",
                "pay",
            ),
            ("[dependencies]\npay.package = \"idem-axum\"", "pay"),
            (
                "[dev-dependencies]\nmy-idem = { package = \"idem-axum\" }",
                "my_idem",
            ),
            (
                "[target.'cfg(unix)'.dependencies]\npay = { package = \"idem-axum\" }",
                "pay",
            ),
            // A dependency merely called like the facade is another package.
            (
                "[dependencies]\nidem-axum = { package = \"other\" }\npay = { package = \"idem-axum\" }",
                "pay",
            ),
            ("[package]\nname = \"idem-axum\"", "idem_axum"),
        ];
        for (text, expected) in cases {
            assert_eq!(name(text), named(expected), "{text}");
        }
    }

    #[test]
    fn a_lib_uses_its_normal_dependency_before_a_dev_one() {
        let text = "[dev-dependencies]\ntested = { package = \"idem-axum\" }\n\
                    [dependencies]\npay = { package = \"idem-axum\" }";
        assert_eq!(name(text), named("pay"));
    }

    #[test]
    fn an_inherited_dependency_takes_its_package_from_the_workspace() {
        let member = "[dependencies]\npay = { workspace = true }";
        let root = "[workspace]\n[workspace.dependencies]\npay = { package = \"idem-axum\", version = \"0.1\" }";
        assert_eq!(name_in(member, || Some(root.to_owned())), named("pay"));
        let elsewhere = "[workspace]\n[workspace.dependencies]\npay = \"3\"";
        assert_eq!(
            name_in(member, || Some(elsewhere.to_owned())),
            Found::Missing
        );
        assert_eq!(name(member), Found::Missing);
    }

    #[test]
    fn a_manifest_without_the_facade_says_so() {
        let shop = "[package]\nname = \"shop\"\n[dependencies]\nplatform = \"1\"";
        assert_eq!(name(shop), Found::Missing);
        assert_eq!(name("not [toml"), Found::Unknown);
    }
}
