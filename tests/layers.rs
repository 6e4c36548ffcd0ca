//! The host library's layers (docs/architecture.md, "Layers"): every
//! `crate::` path in host/ points to its own layer or one below, and no
//! two modules reach each other, in Rust or in the Python package.
//!
//! The table is read from docs/architecture.md, so the document and this
//! check cannot drift apart: a module added to host/ fails here until the
//! table names its layer. Text only, no compiler: `crate::x::...` paths in
//! code (`use` lines, grouped ones, and paths in expressions); comments
//! and doc links are left out, and `super::` stays inside its module.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The kernel crate and cudarc, re-exported at the crate root: below every
/// layer of host/.
const EXTERNAL: &[&str] = &["abi", "device", "ll", "cudarc"];

/// `(layer number, its name)` per module path (`driver`, `fused::launch`),
/// from the table under "## Layers" in docs/architecture.md.
fn layer_table() -> BTreeMap<String, (usize, String)> {
    let doc = std::fs::read_to_string(root().join("docs/architecture.md"))
        .expect("read docs/architecture.md");
    let section = doc
        .split("\n## Layers")
        .nth(1)
        .expect("docs/architecture.md has a \"## Layers\" section");
    let section = section.split("\n## ").next().unwrap_or(section);
    let mut table = BTreeMap::new();
    let mut next = 0;
    for line in section.lines().filter(|l| l.starts_with('|')) {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let Some((number, name)) = cells.get(1).and_then(|c| c.split_once(' ')) else {
            continue;
        };
        let Ok(number) = number.parse::<usize>() else {
            continue;
        };
        assert_eq!(
            number, next,
            "layers are numbered 0, 1, 2, ... from the bottom: {line}"
        );
        next += 1;
        let modules = cells.get(2).expect("a layer row names its modules");
        for module in modules.split('`').skip(1).step_by(2) {
            let before = table.insert(module.to_string(), (number, name.to_string()));
            assert!(before.is_none(), "`{module}` is in two layers");
        }
    }
    assert!(next > 1, "no layer rows found under \"## Layers\"");
    table
}

/// Every .rs file under `dir`, recursively.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read dir") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of a file of host/: `host/driver/kernels.rs` ->
/// `driver::kernels`, `host/lib.rs` -> "" (the crate root).
fn module_of(file: &Path) -> String {
    let rel = file.strip_prefix(root().join("host")).expect("under host/");
    let rel = rel.with_extension("");
    let parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if parts == ["lib"] {
        String::new()
    } else {
        parts.join("::")
    }
}

/// The code of a line without its comment (`//` at the start or after a
/// blank; `https://` inside a string stays).
fn code_of(line: &str) -> &str {
    let t = line.trim_start();
    if t.starts_with("//") {
        return "";
    }
    match line.find(" //") {
        Some(i) => &line[..i],
        None => line,
    }
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Every path that follows `crate::` in `code`, as segments; a group
/// `crate::{a::B, c}` gives `[a, B]` and `[c]`.
fn crate_paths(code: &str) -> Vec<Vec<String>> {
    fn path_at(s: &[char], mut i: usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) -> usize {
        let mut segs = prefix;
        loop {
            if s.get(i) == Some(&'{') {
                // A group: each comma-separated member continues `segs`.
                i += 1;
                loop {
                    while s.get(i).is_some_and(|c| c.is_whitespace() || *c == ',') {
                        i += 1;
                    }
                    match s.get(i) {
                        None => return i,
                        Some('}') => return i + 1,
                        _ => {
                            let before = i;
                            i = path_at(s, i, segs.clone(), out);
                            // Skip `as x` and anything else up to , or }.
                            while s.get(i).is_some_and(|c| *c != ',' && *c != '}') {
                                i += 1;
                            }
                            if i == before {
                                i += 1;
                            }
                        }
                    }
                }
            }
            let start = i;
            while s.get(i).is_some_and(|c| is_ident(*c)) {
                i += 1;
            }
            if i > start {
                segs.push(s[start..i].iter().collect());
            }
            if i > start && s.get(i) == Some(&':') && s.get(i + 1) == Some(&':') {
                i += 2;
                continue;
            }
            if !segs.is_empty() {
                out.push(segs);
            }
            return i;
        }
    }
    let chars: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i + 7 <= chars.len() {
        let at_word = i == 0 || !is_ident(chars[i - 1]);
        if at_word && chars[i..i + 7].iter().collect::<String>() == "crate::" {
            i = path_at(&chars, i + 7, Vec::new(), &mut out);
        } else {
            i += 1;
        }
    }
    out
}

/// Names the crate root re-exports from a module of its own
/// (`pub use error::{Error, Result};` -> Error, Result -> error).
fn root_reexports(lib: &str) -> BTreeMap<String, String> {
    let mut map = BTreeMap::new();
    for line in lib.lines().map(code_of) {
        let Some(rest) = line.trim().strip_prefix("pub use ") else {
            continue;
        };
        let rest = rest.trim_end_matches(';');
        let Some((module, names)) = rest.split_once("::") else {
            continue;
        };
        if module.starts_with("p2p_allreduce_device") || module == "cudarc" {
            continue;
        }
        for name in names.trim_matches(|c| c == '{' || c == '}').split(',') {
            let name = name.trim();
            if !name.is_empty() {
                map.insert(name.to_string(), module.to_string());
            }
        }
    }
    map
}

/// The module a `crate::` path names: its longest prefix that is a module
/// file; `None` for the kernel crate, cudarc and the crate root's own items.
fn target_of(
    path: &[String],
    modules: &BTreeSet<String>,
    reexports: &BTreeMap<String, String>,
) -> Option<String> {
    let first = path.first()?;
    if EXTERNAL.contains(&first.as_str()) {
        return None;
    }
    if let Some(module) = reexports.get(first) {
        return Some(module.clone());
    }
    (1..=path.len())
        .rev()
        .map(|n| path[..n].join("::"))
        .find(|m| modules.contains(m))
}

/// The layer of `module`: its own row, else its nearest listed parent's
/// (a `tests` child sits with its module).
fn layer_of<'a>(
    module: &str,
    table: &'a BTreeMap<String, (usize, String)>,
) -> Option<&'a (usize, String)> {
    let mut m = module;
    loop {
        if let Some(l) = table.get(m) {
            return Some(l);
        }
        m = &m[..m.rfind("::")?];
    }
}

fn related(a: &str, b: &str) -> bool {
    a.starts_with(&format!("{b}::")) || b.starts_with(&format!("{a}::"))
}

/// A cycle of `graph` (as the list of its nodes, first repeated last), if
/// it has one.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        done: &mut BTreeSet<String>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = stack.iter().position(|n| n == node) {
            let mut cycle = stack[i..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        stack.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(c) = visit(next, graph, done, stack) {
                return Some(c);
            }
        }
        stack.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        if let Some(c) = visit(node, graph, &mut done, &mut Vec::new()) {
            return Some(c);
        }
    }
    None
}

/// Every `crate::` edge of host/ (binaries, a crate of their own, left
/// out): `(from module, to module, file:line)`.
fn host_edges() -> Vec<(String, String, String)> {
    let mut files = Vec::new();
    rust_files(&root().join("host"), &mut files);
    files.retain(|f| !f.starts_with(root().join("host/bin")));
    files.sort();
    let modules: BTreeSet<String> = files.iter().map(|f| module_of(f)).collect();
    let lib = std::fs::read_to_string(root().join("host/lib.rs")).expect("read host/lib.rs");
    let reexports = root_reexports(&lib);
    let mut edges = Vec::new();
    for file in &files {
        let from = module_of(file);
        let text = std::fs::read_to_string(file).expect("read source");
        for (n, line) in text.lines().enumerate() {
            for path in crate_paths(code_of(line)) {
                if let Some(to) = target_of(&path, &modules, &reexports) {
                    if to != from {
                        let at = format!(
                            "{}:{}",
                            file.strip_prefix(root()).unwrap_or(file).display(),
                            n + 1
                        );
                        edges.push((from.clone(), to, at));
                    }
                }
            }
        }
    }
    edges
}

#[test]
fn host_imports_point_down_the_layers() {
    let table = layer_table();
    let edges = host_edges();
    assert!(
        edges.len() > 50,
        "only {} crate:: paths found in host/: is the scan broken?",
        edges.len()
    );
    let mut unplaced = BTreeSet::new();
    let mut upward = Vec::new();
    for (from, to, at) in &edges {
        let (Some(lf), Some(lt)) = (layer_of(from, &table), layer_of(to, &table)) else {
            for m in [from, to] {
                if layer_of(m, &table).is_none() && !m.is_empty() {
                    unplaced.insert(m.clone());
                }
            }
            continue;
        };
        if from.is_empty() {
            continue; // the crate root declares and re-exports everything
        }
        if lt.0 > lf.0 {
            upward.push(format!(
                "{at}: `{from}` (layer {} {}) uses `{to}` (layer {} {})",
                lf.0, lf.1, lt.0, lt.1
            ));
        }
    }
    assert!(
        unplaced.is_empty(),
        "modules of host/ that docs/architecture.md's \"Layers\" table does not place: {unplaced:?}"
    );
    assert!(
        upward.is_empty(),
        "imports that point up a layer (docs/architecture.md, \"Layers\"): move the code down, or \
         pass what the lower module needs as a value:\n{}",
        upward.join("\n")
    );
    // Within a layer, one way only: no cycle among modules (a module and
    // its own submodules may use each other).
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (from, to, _) in &edges {
        if !from.is_empty() && !related(from, to) {
            graph.entry(from.clone()).or_default().insert(to.clone());
        }
    }
    if let Some(cycle) = find_cycle(&graph) {
        let witness: Vec<&String> = edges
            .iter()
            .filter(|(f, t, _)| cycle.windows(2).any(|w| &w[0] == f && &w[1] == t))
            .map(|(_, _, at)| at)
            .collect();
        panic!(
            "import circle in host/: {} (at {witness:?})",
            cycle.join(" -> ")
        );
    }
}

/// The scan sees what it must: grouped imports, paths in code, root
/// re-exports, and not comments.
#[test]
fn the_scan_reads_paths_as_written() {
    let paths = |s: &str| crate_paths(code_of(s));
    assert_eq!(
        paths("use crate::{abi::X, driver, fused::{launch::Y, Z}};"),
        vec![
            vec!["abi", "X"],
            vec!["driver"],
            vec!["fused", "launch", "Y"],
            vec!["fused", "Z"]
        ]
    );
    assert_eq!(
        paths("    let g = crate::driver::device_info(ctx)?; // crate::plan::x"),
        vec![vec!["driver", "device_info"]]
    );
    assert!(paths("/// [`crate::error::Error`]").is_empty());
    assert!(paths("let s = \"https://x\"; my_crate::a::b;").is_empty());
    let reexports =
        root_reexports("pub use error::{Error, Result};\npub use p2p_allreduce_device::abi;\n");
    assert_eq!(reexports.get("Result").map(String::as_str), Some("error"));
    assert!(!reexports.contains_key("abi"));
    let modules: BTreeSet<String> = ["driver", "driver::kernels", "error"]
        .map(String::from)
        .into();
    let to = |p: &[&str]| {
        let p: Vec<String> = p.iter().map(|s| s.to_string()).collect();
        target_of(&p, &modules, &reexports)
    };
    assert_eq!(
        to(&["driver", "kernels", "Kernels"]).as_deref(),
        Some("driver::kernels")
    );
    assert_eq!(to(&["driver", "open_device"]).as_deref(), Some("driver"));
    assert_eq!(to(&["Error", "NoDriver"]).as_deref(), Some("error"));
    assert_eq!(to(&["abi", "Signal"]), None);
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("a".to_string(), ["b".to_string()].into()),
        ("b".to_string(), ["c".to_string()].into()),
        ("c".to_string(), ["a".to_string()].into()),
    ]
    .into();
    assert_eq!(find_cycle(&graph).map(|c| c.len()), Some(4));
    let line: BTreeMap<String, BTreeSet<String>> =
        [("a".to_string(), ["b".to_string()].into())].into();
    assert_eq!(find_cycle(&line), None);
}

/// The Python package's modules (python/p2p_allreduce/), imports at any
/// depth (a function's own `import` too): no circle.
#[test]
fn python_imports_form_no_circle() {
    let base = root().join("python");
    let package = base.join("p2p_allreduce");
    let mut files = Vec::new();
    fn py_files(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("read dir") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                py_files(&path, out);
            } else if path.extension().is_some_and(|e| e == "py") {
                out.push(path);
            }
        }
    }
    py_files(&package, &mut files);
    // Dotted module names: p2p_allreduce.integrations._adapter; a
    // package's __init__.py is the package itself.
    let name_of = |f: &Path| -> String {
        let rel = f
            .strip_prefix(&base)
            .expect("under python/")
            .with_extension("");
        let mut parts: Vec<String> = rel
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect();
        if parts.last().is_some_and(|p| p == "__init__") {
            parts.pop();
        }
        parts.join(".")
    };
    let modules: BTreeSet<String> = files.iter().map(|f| name_of(f)).collect();
    // The compiled extension (pyproject.toml's `module-name`): a module
    // too, with no imports of its own.
    let pyproject =
        std::fs::read_to_string(base.join("pyproject.toml")).expect("read python/pyproject.toml");
    let native = pyproject
        .lines()
        .find_map(|l| l.trim().strip_prefix("module-name = "))
        .expect("pyproject.toml names the extension module")
        .trim_matches('"')
        .to_string();
    let mut modules = modules;
    modules.insert(native);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut count = 0;
    for file in &files {
        let me = name_of(file);
        let is_package = file.ends_with("__init__.py");
        let text = std::fs::read_to_string(file).expect("read source");
        let mut in_docstring = false;
        for line in text.lines() {
            let quotes = line.matches("\"\"\"").count();
            if in_docstring || quotes > 0 {
                if quotes % 2 == 1 {
                    in_docstring = !in_docstring;
                }
                continue;
            }
            let t = line.trim();
            let mut targets = Vec::new();
            if let Some(rest) = t.strip_prefix("from ") {
                let Some((from, names)) = rest.split_once(" import ") else {
                    continue;
                };
                let dots = from.chars().take_while(|c| *c == '.').count();
                let base_module = if dots == 0 {
                    from.to_string()
                } else {
                    // `.` is this module's package (the module itself for
                    // an __init__.py), each further dot one package up.
                    let mut parts: Vec<&str> = me.split('.').collect();
                    let up = if is_package { dots - 1 } else { dots };
                    for _ in 0..up {
                        parts.pop();
                    }
                    let tail = &from[dots..];
                    if tail.is_empty() {
                        parts.join(".")
                    } else {
                        format!("{}.{tail}", parts.join("."))
                    }
                };
                for name in names.trim_matches(|c| c == '(' || c == ')').split(',') {
                    let name = name.split_whitespace().next().unwrap_or("");
                    let sub = format!("{base_module}.{name}");
                    targets.push(if modules.contains(&sub) {
                        sub
                    } else {
                        base_module.clone()
                    });
                }
            } else if let Some(rest) = t.strip_prefix("import ") {
                for name in rest.split(',') {
                    targets.push(name.split_whitespace().next().unwrap_or("").to_string());
                }
            }
            for target in targets {
                if modules.contains(&target) && target != me {
                    count += 1;
                    graph.entry(me.clone()).or_default().insert(target);
                }
            }
        }
    }
    assert!(
        count >= 5,
        "only {count} imports of the package found: is the scan broken?"
    );
    assert_eq!(
        find_cycle(&graph),
        None,
        "import circle in python/p2p_allreduce (imports: {graph:?})"
    );
}
