//! The house as drawn: every module of `src/` belongs to a layer, and a module may use only
//! modules of its own layer or of layers below it, in its test module too. This test reads
//! `src/` and fails on a `crate::` path that climbs, naming the file, the line and both
//! layers; and on a cycle between two files (`a` uses `b` and `b` uses `a`) anywhere in the
//! crate's code outside test modules.
//!
//! The table below is the README's architecture map ("How it is built"); change both together.
//!
//! The data plane has layers of its own ([`DATAPLANE`]): a file under `src/dataplane/` may use
//! only the data plane's modules of its own sub-layer or below (and, in a sub-layer whose
//! modules are independent, not its siblings), so that, for one, the syscall code in
//! `dataplane::sys` never imports a planner. `dataplane/mod.rs`, the front door, is above them
//! all.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, lowest first: (name, the top-level modules of `src/` in it).
const LAYERS: &[(&str, &[&str])] = &[
    (
        "ground floor",
        &[
            "vocab",
            "time",
            "metrics",
            "atomic_file",
            "panics",
            "logging",
            "rlimit",
            "capabilities",
            "secret_file",
            "fds",
            "health",
        ],
    ),
    ("config", &["config"]),
    ("lease", &["lease"]),
    ("route", &["route"]),
    ("data plane", &["dataplane"]),
    ("daemon", &["daemon", "instance", "stop"]),
    ("CLI", &["cli"]),
];

/// The data plane's layers, lowest first: (name, the modules of `src/dataplane/` in it, whether
/// they may use one another). A module of the data plane that is in none of them is the front
/// door's (`dataplane/mod.rs` and what it declares there), above them all.
const DATAPLANE: &[(&str, &[&str], bool)] = &[
    ("packet formats", &["wire"], true),
    ("syscalls", &["sys"], true),
    ("offloads", &["offload"], true),
    ("transports", &["transport"], true),
    ("workers", &["worker"], true),
    ("settings", &["settings"], true),
    // The backends, and masquerading beside them: independent drivers.
    ("backends", &["tunnel", "kernel_routes", "masq"], false),
];

/// The data plane layer of a module path under `dataplane` (`None` outside the data plane);
/// [`DATAPLANE`]`.len()` is the front door's.
fn dataplane_layer_of(path: &[String]) -> Option<usize> {
    if path.first().is_none_or(|m| m != "dataplane") {
        return None;
    }
    let Some(second) = path.get(1) else { return Some(DATAPLANE.len()) };
    Some(
        DATAPLANE
            .iter()
            .position(|(_, modules, _)| modules.contains(&second.as_str()))
            .unwrap_or(DATAPLANE.len()),
    )
}

/// Why a file of the data plane, `me`, may not use `path` (`None`: it may).
fn dataplane_climb(me: &[String], path: &[String]) -> Option<String> {
    let (mine, theirs) = (dataplane_layer_of(me)?, dataplane_layer_of(path)?);
    let name = |l: usize| DATAPLANE.get(l).map_or("front door", |(n, _, _)| n);
    if theirs > mine {
        return Some(format!(
            "the data plane's {} layer uses `{}` of its {} layer",
            name(mine),
            path.join("::"),
            name(theirs)
        ));
    }
    if theirs == mine && mine < DATAPLANE.len() && !DATAPLANE[mine].2 && me.get(1) != path.get(1) {
        return Some(format!(
            "`{}` uses `{}`: the {} layer's modules are independent of one another",
            me.join("::"),
            path.join("::"),
            name(mine)
        ));
    }
    None
}

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|(_, modules)| modules.contains(&module))
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src/") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of a file under `src/` (`src/lease/keeper.rs` -> `["lease", "keeper"]`,
/// `src/lease/mod.rs` -> `["lease"]`).
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).expect("under src/").with_extension("");
    let mut parts: Vec<String> =
        rel.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

/// The code of a line without its comment (`//`, `///`, `//!`); string contents are kept,
/// which is fine: no string of weft's names a `crate::` path.
fn code_of(line: &str) -> &str {
    line.find("//").map_or(line, |i| &line[..i])
}

/// The module paths a line of code names: `crate::a::b` and `super::` paths resolved against
/// `me`; `use crate::{a, b::c}` groups are expanded one level.
fn paths_in(code: &str, me: &[String]) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    for (start, root) in code
        .match_indices("crate::")
        .map(|(i, _)| (i, "crate"))
        .chain(code.match_indices("super::").map(|(i, _)| (i, "super")))
    {
        // A visibility (`pub(in crate::dataplane)`) names a scope, not a use.
        if code[..start].ends_with("(in ") {
            continue;
        }
        // Only a path's start: not the `super` in `crate::x::super::` (never written) nor
        // an identifier ending in `crate`/`super`.
        if start > 0 {
            let before = code.as_bytes()[start - 1];
            if before.is_ascii_alphanumeric() || before == b'_' || before == b':' {
                continue;
            }
        }
        let rest = &code[start..];
        let mut base: Vec<String> = Vec::new();
        let mut tail = rest;
        loop {
            if let Some(t) = tail.strip_prefix("crate::") {
                base.clear();
                tail = t;
            } else if let Some(t) = tail.strip_prefix("super::") {
                if base.is_empty() && root == "super" {
                    base = me.to_vec();
                    // A file's `super` is its parent module, `mod.rs`'s too (its path is the
                    // directory's already).
                }
                base.pop();
                tail = t;
            } else {
                break;
            }
        }
        if let Some(group) = tail.strip_prefix('{') {
            let group = group.split('}').next().unwrap_or("");
            for item in group.split(',') {
                let item: Vec<String> = item
                    .trim()
                    .split("::")
                    .map(|s| s.trim().to_owned())
                    .take_while(|s| s.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
                    .filter(|s| !s.is_empty() && s != "self")
                    .collect();
                let mut p = base.clone();
                p.extend(item);
                found.push(p);
            }
        } else {
            let mut p = base;
            p.extend(
                tail.split("::")
                    .map(|s| {
                        s.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect()
                    })
                    .take_while(|s: &String| {
                        !s.is_empty() && s.chars().all(|c| c.is_ascii_lowercase() || c == '_')
                    }),
            );
            found.push(p);
        }
    }
    found
}

/// The name of the inline module a line opens (`mod tests {`, `pub mod code {`), if it opens one.
fn inline_module(line: &str) -> Option<String> {
    let code = code_of(line).trim();
    let rest = code.strip_suffix('{')?.trim_end();
    let words: Vec<&str> = rest.split_whitespace().collect();
    match words.as_slice() {
        [.., "mod", name] => Some((*name).to_owned()),
        _ => None,
    }
}

/// The longest prefix of `path` that is a module of the crate (a file), if any.
fn module_named<'a>(
    modules: &'a BTreeSet<Vec<String>>,
    path: &[String],
) -> Option<&'a Vec<String>> {
    (1..=path.len()).rev().find_map(|n| modules.get(&path[..n].to_vec()))
}

#[test]
fn no_import_climbs_a_layer_and_no_two_files_use_each_other() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.retain(|f| !f.ends_with("main.rs") && !f.ends_with("lib.rs"));
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_path(&src, f)).collect();
    let mut climbs = Vec::new();
    let mut uses: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for file in &files {
        let me = module_path(&src, file);
        let Some(my_layer) = layer_of(&me[0]) else {
            climbs.push(format!("{}: module {} is in no layer", file.display(), me[0]));
            continue;
        };
        if me.len() > 1 && dataplane_layer_of(&me) == Some(DATAPLANE.len()) {
            climbs.push(format!(
                "{}: dataplane::{} is in no layer of the data plane (tests/layers.rs, DATAPLANE)",
                file.display(),
                me[1]
            ));
        }
        let text = std::fs::read_to_string(file).expect("read a source file");
        // Test modules are held to the layers too; only the code above `mod tests` counts
        // toward cycles (a test may use a sibling that uses the module under test).
        let tests_start = text.find("#[cfg(test)]\nmod tests").unwrap_or(text.len());
        let tests_line = text[..tests_start].lines().count();
        // The inline modules (`mod tests {`, `pub mod checksum {`) the line is in, by their
        // indentation (the code is rustfmt's): a `super::` inside one is relative to it.
        let mut inline: Vec<(usize, String)> = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let in_tests = n >= tests_line;
            let indent = line.len() - line.trim_start().len();
            if line.trim() == "}" && inline.last().is_some_and(|(i, _)| *i == indent) {
                inline.pop();
            }
            let here: Vec<String> =
                me.iter().cloned().chain(inline.iter().map(|(_, m)| m.clone())).collect();
            if let Some(name) = inline_module(line) {
                inline.push((indent, name));
            }
            for path in paths_in(code_of(line), &here) {
                let Some(first) = path.first() else { continue };
                let Some(layer) = layer_of(first) else { continue };
                if layer > my_layer {
                    climbs.push(format!(
                        "{}:{}: the {} layer uses `{}` of the {} layer",
                        file.display(),
                        n + 1,
                        LAYERS[my_layer].0,
                        path.join("::"),
                        LAYERS[layer].0
                    ));
                }
                if let Some(why) = dataplane_climb(&me, &path) {
                    climbs.push(format!("{}:{}: {why}", file.display(), n + 1));
                }
                if let Some(target) = module_named(&modules, &path)
                    && !in_tests
                    && *target != me
                    && !me.starts_with(target)
                {
                    uses.entry(me.clone()).or_default().insert(target.clone());
                }
            }
        }
    }
    let mut cycles = Vec::new();
    for (a, targets) in &uses {
        for b in targets {
            if a < b && uses.get(b).is_some_and(|t| t.contains(a)) {
                cycles.push(format!("{} <-> {}", a.join("::"), b.join("::")));
            }
        }
    }
    assert!(
        climbs.is_empty() && cycles.is_empty(),
        "imports that climb:\n{}\nfiles that use each other:\n{}",
        climbs.join("\n"),
        cycles.join("\n")
    );
}

#[test]
fn paths_are_read_as_the_compiler_reads_them() {
    let me: Vec<String> = ["lease", "keeper"].map(String::from).to_vec();
    let p = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(paths_in("use crate::config::NetworkConfig;", &me), vec![p(&["config"])]);
    assert_eq!(
        paths_in("use super::record::{Subnet, LeaseName};", &me),
        vec![p(&["lease", "record"])]
    );
    assert_eq!(
        paths_in("use crate::{logging, metrics::counter};", &me),
        vec![p(&["logging"]), p(&["metrics", "counter"])]
    );
    assert_eq!(paths_in("let x = crate::time::BootClock;", &me), vec![p(&["time"])]);
    assert!(paths_in(code_of("// see crate::daemon"), &me).is_empty());
}

#[test]
fn the_data_plane_layers_refuse_a_planner_in_the_syscall_code() {
    let p = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let netlink = p(&["dataplane", "sys", "netlink"]);
    // The syscall code importing a planner (the kernel route planner, drift repair, send
    // planning, a transport) climbs.
    for planner in [
        p(&["dataplane", "kernel_routes", "route_plan"]),
        p(&["dataplane", "tunnel", "drift"]),
        p(&["dataplane", "worker", "plan"]),
        p(&["dataplane", "transport"]),
    ] {
        assert!(dataplane_climb(&netlink, &planner).is_some(), "{planner:?}");
    }
    // Downward is fine: the planners use the syscall code's plain data, and the packet formats.
    let route_plan = p(&["dataplane", "kernel_routes", "route_plan"]);
    assert_eq!(dataplane_climb(&route_plan, &netlink), None);
    assert_eq!(
        dataplane_climb(&p(&["dataplane", "sys", "udp", "raw"]), &p(&["dataplane", "wire"])),
        None
    );
    // The backends are independent of each other; the front door uses them all.
    assert!(dataplane_climb(&route_plan, &p(&["dataplane", "tunnel"])).is_some());
    assert_eq!(dataplane_climb(&p(&["dataplane"]), &p(&["dataplane", "tunnel"])), None);
    // A `super::` inside an inline module is relative to it.
    assert_eq!(inline_module("mod tests {"), Some("tests".to_owned()));
    assert_eq!(inline_module("    pub mod checksum {"), Some("checksum".to_owned()));
    assert_eq!(inline_module("mod gro;"), None);
}
