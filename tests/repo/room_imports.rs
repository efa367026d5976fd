//! The scheduler's rooms import one another in one direction only, and no file imports itself
//! back through others.
//!
//! Why: `src/scheduler/` is split into rooms named after what they are (see the table in
//! `src/scheduler/mod.rs`). The split shows the architecture only while a room never reaches
//! up: the request parser must not learn about routing, the endpoint table must not depend on
//! the request's lifecycle. Import cycles between files (three existed before the split:
//! `filter/http ↔ observe ↔ root`, `multipart ↔ request`, `overdue → score → state → overdue`)
//! make a change anywhere in the loop a change everywhere in it.
//!
//! How: every `crate::…` and `super::…` path in the code of `src/` (comments, `#[cfg(test)]`
//! modules and `tests.rs` files left out: tests may reach anywhere) is resolved to the module
//! it names. A path from room A into room B must be allowed by [`ROOMS`]; the graph of
//! file-to-file imports (a module and its own submodules excepted) must have no cycle.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each room of `src/scheduler/` and the rooms it may import, lowest first. A room may import
/// only rooms listed before it (checked below), so the table itself has no cycle. Keep in step
/// with the table in `src/scheduler/mod.rs`.
const ROOMS: &[(&str, &[&str])] = &[
    ("time", &[]),
    ("state", &[]),
    ("config", &["state"]),
    ("wire", &["config", "state"]),
    ("health", &["time", "state", "config"]),
    ("routing", &["time", "state", "config", "wire", "health"]),
    (
        "admission",
        &["time", "state", "config", "wire", "health", "routing"],
    ),
    (
        "flow",
        &[
            "time",
            "state",
            "config",
            "wire",
            "health",
            "routing",
            "admission",
        ],
    ),
];

/// The sub-rooms of `routing` and the sub-rooms each may import, lowest first, as for
/// [`ROOMS`]. Keep in step with the list in `src/scheduler/routing/mod.rs`.
const ROUTING_ROOMS: &[(&str, &[&str])] = &[
    ("quota", &[]),
    ("scrape", &[]),
    ("judge", &[]),
    ("table", &["quota", "scrape", "judge"]),
    ("placement", &["judge", "table"]),
    ("pins", &[]),
    ("pools", &["placement"]),
    (
        "select",
        &[
            "quota",
            "scrape",
            "judge",
            "table",
            "placement",
            "pins",
            "pools",
        ],
    ),
];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of a file under `src/`: `scheduler/routing/select.rs` → `scheduler::routing::select`.
fn module_of(rel: &str) -> Vec<String> {
    let rel = rel.strip_suffix(".rs").unwrap();
    let mut segs: Vec<String> = rel.split('/').map(str::to_string).collect();
    if segs.last().is_some_and(|s| s == "mod" || s == "lib") {
        segs.pop();
    }
    segs
}

/// The code of a file that counts: `//` comments removed, everything from the first
/// `#[cfg(test)]` on left out (test modules sit at the bottom of each file).
fn code(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        if line.trim_start().starts_with("#[cfg(test)]") {
            break;
        }
        let code = match line.find("//") {
            Some(at) => line.get(..at).unwrap_or(""),
            None => line,
        };
        out.push_str(code);
        out.push('\n');
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Every path starting at `crate::` or `super::` in `code`, `use` groups expanded
/// (`use super::{a::B, c}` gives `super::a::B` and `super::c`).
fn paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let bytes: Vec<char> = code.chars().collect();
    let mut i = 0;
    while i < bytes.len() {
        let rest: String = bytes[i..bytes.len().min(i + 7)].iter().collect();
        let starts = (rest.starts_with("crate::") || rest.starts_with("super::"))
            && (i == 0 || !is_ident(bytes[i - 1]) && bytes[i - 1] != ':');
        if starts {
            let (found, end) = read_path(&bytes, i);
            out.extend(found);
            i = end;
        } else {
            i += 1;
        }
    }
    out
}

/// Reads the path starting at `at`; returns its expansions and where it ends.
fn read_path(s: &[char], mut at: usize) -> (Vec<String>, usize) {
    let mut prefix = String::new();
    loop {
        while at < s.len() && s[at].is_whitespace() {
            at += 1;
        }
        if at < s.len() && s[at] == '{' {
            let (items, end) = read_group(s, at + 1);
            // `self` in a group names the prefix itself.
            let out = items
                .into_iter()
                .map(|item| match item.as_str() {
                    "" => prefix.trim_end_matches("::").to_string(),
                    _ => format!("{prefix}{item}"),
                })
                .collect();
            return (out, end);
        }
        let start = at;
        while at < s.len() && (is_ident(s[at]) || s[at] == '*') {
            at += 1;
        }
        prefix.extend(&s[start..at]);
        if s.get(at) == Some(&':') && s.get(at + 1) == Some(&':') {
            prefix.push_str("::");
            at += 2;
        } else {
            return (vec![prefix], at);
        }
    }
}

/// The items of a `{…}` group whose opening brace is just before `at`, each a path relative to
/// the group's prefix; and the index after the closing brace.
fn read_group(s: &[char], mut at: usize) -> (Vec<String>, usize) {
    let mut out = Vec::new();
    loop {
        while at < s.len() && (s[at].is_whitespace() || s[at] == ',') {
            at += 1;
        }
        if at >= s.len() {
            return (out, at);
        }
        if s[at] == '}' {
            return (out, at + 1);
        }
        let (items, end) = read_path(s, at);
        // `self as x`, `X as Y`: the alias does not change what is imported.
        let mut next = end;
        let tail: String = s[end..s.len().min(end + 4)].iter().collect();
        if tail.trim_start().starts_with("as ") {
            next = end;
            while next < s.len() && s[next].is_whitespace() {
                next += 1;
            }
            next += 2;
            while next < s.len() && s[next].is_whitespace() {
                next += 1;
            }
            while next < s.len() && is_ident(s[next]) {
                next += 1;
            }
        }
        out.extend(items.into_iter().map(|p| match p.strip_suffix("::self") {
            Some(inner) => inner.to_string(),
            None if p == "self" => String::new(),
            None => p,
        }));
        if next == at {
            next += 1; // not a path: step over it
        }
        at = next;
    }
}

/// `path` as seen from module `from`, made absolute (without the leading `crate`).
fn resolve(from: &[String], path: &str) -> Vec<String> {
    let mut segs: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
    let mut base: Vec<String> = if segs.first() == Some(&"crate") {
        segs.remove(0);
        Vec::new()
    } else {
        from.to_vec()
    };
    while segs.first() == Some(&"super") {
        segs.remove(0);
        base.pop();
    }
    base.extend(segs.iter().map(|s| s.to_string()));
    base
}

struct Source {
    rel: String,
    module: Vec<String>,
    imports: Vec<Vec<String>>,
}

fn sources() -> Vec<Source> {
    let mut files = Vec::new();
    rust_files(&repo().join("src"), &mut files);
    files.sort();
    files
        .iter()
        .map(|f| {
            let rel = f
                .strip_prefix(repo().join("src"))
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            let module = module_of(&rel);
            let text = std::fs::read_to_string(f).unwrap();
            let imports = if rel.ends_with("/tests.rs") {
                Vec::new()
            } else {
                paths(&code(&text))
                    .iter()
                    .map(|p| resolve(&module, p))
                    .collect()
            };
            Source {
                rel,
                module,
                imports,
            }
        })
        .collect()
}

/// The room a module lies in: `scheduler::<room>::…`.
fn room_of(module: &[String]) -> Option<&str> {
    match module {
        [first, room, ..] if first == "scheduler" => Some(room.as_str()),
        _ => None,
    }
}

fn allowed(from: &str, to: &str) -> bool {
    from == to
        || ROOMS
            .iter()
            .any(|(room, may)| *room == from && may.contains(&to))
}

#[test]
fn the_room_table_points_down_only() {
    check_room_table(ROOMS, "src/scheduler/mod.rs");
}

#[test]
fn rooms_import_only_the_rooms_below_them() {
    let rooms: BTreeSet<&str> = ROOMS.iter().map(|(r, _)| *r).collect();
    let mut report = Vec::new();
    let mut seen_edges = 0;
    for src in sources() {
        let Some(from) = room_of(&src.module) else {
            continue;
        };
        for target in &src.imports {
            if target.first().map(String::as_str) != Some("scheduler") {
                continue;
            }
            match target.get(1).map(String::as_str) {
                Some(to) if rooms.contains(to) => {
                    seen_edges += 1;
                    if !allowed(from, to) {
                        report.push(format!("{}: {from} imports {}", src.rel, target.join("::")));
                    }
                }
                _ => report.push(format!(
                    "{}: {} goes through the scheduler's re-exports; import from the room",
                    src.rel,
                    target.join("::")
                )),
            }
        }
    }
    assert!(
        seen_edges > 50,
        "the scanner found only {seen_edges} imports"
    );
    assert!(
        report.is_empty(),
        "imports against the room table of src/scheduler/mod.rs:\n{}",
        report.join("\n")
    );
}

/// `table` lists each room's allowed imports from rooms listed before it only; its rooms are
/// exactly the `pub mod`s declared in `declared_in`.
fn check_room_table(table: &[(&str, &[&str])], declared_in: &str) {
    for (at, (room, may)) in table.iter().enumerate() {
        for m in *may {
            let below = table[..at].iter().any(|(r, _)| r == m);
            assert!(
                below,
                "{room} may import {m}, which is not listed before it"
            );
        }
    }
    let declared = std::fs::read_to_string(repo().join(declared_in)).unwrap();
    let mods: BTreeSet<&str> = declared
        .lines()
        .filter_map(|l| l.strip_prefix("pub mod ")?.strip_suffix(';'))
        .collect();
    let rooms: BTreeSet<&str> = table.iter().map(|(r, _)| *r).collect();
    assert_eq!(mods, rooms, "the rooms of {declared_in}");
}

#[test]
fn the_routing_room_table_points_down_only() {
    check_room_table(ROUTING_ROOMS, "src/scheduler/routing/mod.rs");
}

#[test]
fn routing_rooms_import_only_the_rooms_below_them() {
    let rooms: BTreeSet<&str> = ROUTING_ROOMS.iter().map(|(r, _)| *r).collect();
    let mut report = Vec::new();
    let mut seen_edges = 0;
    for src in sources() {
        let from = match src.module.as_slice() {
            [a, b, room, ..] if a == "scheduler" && b == "routing" => room.as_str(),
            _ => continue,
        };
        for target in &src.imports {
            let to = match target.as_slice() {
                [a, b, room, ..] if a == "scheduler" && b == "routing" => room.as_str(),
                _ => continue,
            };
            if !rooms.contains(to) {
                report.push(format!(
                    "{}: {} is in no routing room",
                    src.rel,
                    target.join("::")
                ));
                continue;
            }
            if from == to {
                continue;
            }
            seen_edges += 1;
            let ok = ROUTING_ROOMS
                .iter()
                .any(|(room, may)| *room == from && may.contains(&to));
            if !ok {
                report.push(format!("{}: {from} imports {}", src.rel, target.join("::")));
            }
        }
    }
    assert!(
        seen_edges > 20,
        "the scanner found only {seen_edges} imports between routing rooms"
    );
    assert!(
        report.is_empty(),
        "imports against the routing room table (ROUTING_ROOMS):\n{}",
        report.join("\n")
    );
}

#[test]
fn no_file_imports_itself_back() {
    let srcs = sources();
    let modules: BTreeSet<Vec<String>> = srcs.iter().map(|s| s.module.clone()).collect();
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for src in &srcs {
        let from = &src.module;
        for target in &src.imports {
            // The longest prefix of the path that is a module: what the file depends on.
            let Some(to) = (1..=target.len())
                .rev()
                .map(|n| target[..n].to_vec())
                .find(|m| modules.contains(m))
            else {
                continue;
            };
            let related = to.starts_with(from) || from.starts_with(&to);
            if !related {
                edges.entry(from.clone()).or_default().insert(to);
            }
        }
    }
    assert!(edges.len() > 20, "{} modules import others", edges.len());
    if let Some(cycle) = find_cycle(&edges) {
        let names: Vec<String> = cycle.iter().map(|m| m.join("::")).collect();
        panic!("import cycle: {}", names.join(" → "));
    }
}

/// A cycle of the graph, as the list of its modules (first repeated at the end), if any.
fn find_cycle(edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Option<Vec<Vec<String>>> {
    fn visit(
        at: &Vec<String>,
        edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        done: &mut BTreeSet<Vec<String>>,
        stack: &mut Vec<Vec<String>>,
    ) -> Option<Vec<Vec<String>>> {
        if let Some(from) = stack.iter().position(|m| m == at) {
            let mut cycle = stack[from..].to_vec();
            cycle.push(at.clone());
            return Some(cycle);
        }
        if done.contains(at) {
            return None;
        }
        stack.push(at.clone());
        for next in edges.get(at).into_iter().flatten() {
            if let Some(c) = visit(next, edges, done, stack) {
                return Some(c);
            }
        }
        stack.pop();
        done.insert(at.clone());
        None
    }
    let mut done = BTreeSet::new();
    for start in edges.keys() {
        if let Some(c) = visit(start, edges, &mut done, &mut Vec::new()) {
            return Some(c);
        }
    }
    None
}

/// The scanner reads what it must: groups, `self`, aliases, `super`, inline paths; and finds a
/// cycle when there is one.
#[test]
fn the_scanner_reads_paths_and_finds_cycles() {
    let text = "use super::{a::B, c::{self, D as E}};\n\
                use crate::scheduler::routing::select;\n\
                // use crate::scheduler::flow; in a comment\n\
                fn f() { let x = crate::scheduler::state::hash::fmix64(1); }\n\
                #[cfg(test)]\n\
                mod tests { use crate::scheduler::flow::Flow; }\n";
    let found = paths(&code(text));
    assert_eq!(
        found,
        [
            "super::a::B",
            "super::c",
            "super::c::D",
            "crate::scheduler::routing::select",
            "crate::scheduler::state::hash::fmix64",
        ]
    );
    let from = module_of("scheduler/wire/request.rs");
    assert_eq!(
        resolve(&from, "super::api::Api"),
        ["scheduler", "wire", "api", "Api"]
    );
    assert_eq!(
        resolve(&from, "super::super::config"),
        ["scheduler", "config"]
    );
    assert!(allowed("routing", "wire") && !allowed("wire", "routing"));
    let m = |s: &str| s.split("::").map(str::to_string).collect::<Vec<_>>();
    let mut edges = BTreeMap::new();
    edges.insert(m("a"), BTreeSet::from([m("b")]));
    edges.insert(m("b"), BTreeSet::from([m("c")]));
    assert_eq!(find_cycle(&edges), None);
    edges.insert(m("c"), BTreeSet::from([m("a")]));
    assert_eq!(
        find_cycle(&edges),
        Some(vec![m("a"), m("b"), m("c"), m("a")])
    );
}
