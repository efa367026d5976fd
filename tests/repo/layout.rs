//! The test binaries' layout: every test file belongs to one of three binaries (`envoy`,
//! `props`, `repo`), each a `main.rs` declaring its files. A file dropped directly into
//! `tests/` would link a binary of its own (about 20 MB and one more link per change), and one
//! in a group's folder but not declared in its `main.rs` would silently never run.

#![allow(clippy::panic)]

use std::fs;
use std::path::Path;

const GROUPS: [&str; 3] = ["envoy", "props", "repo"];

fn rust_files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().into_string().ok())
        .filter_map(|n| n.strip_suffix(".rs").map(str::to_owned))
        .collect();
    names.sort();
    names
}

#[test]
fn every_test_file_is_declared_by_its_binary() {
    let tests = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    for group in GROUPS {
        let dir = tests.join(group);
        let main = fs::read_to_string(dir.join("main.rs"))
            .unwrap_or_else(|e| panic!("read tests/{group}/main.rs: {e}"));
        let undeclared: Vec<String> = rust_files(&dir)
            .into_iter()
            .filter(|n| n != "main")
            .filter(|n| !main.lines().any(|l| l.trim() == format!("mod {n};")))
            .collect();
        assert!(
            undeclared.is_empty(),
            "tests/{group}/main.rs does not declare {undeclared:?}: add `mod NAME;` for each"
        );
    }
}

#[test]
fn no_test_file_links_a_binary_of_its_own() {
    let tests = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let loose = rust_files(&tests);
    assert!(
        loose.is_empty(),
        "tests/{loose:?}.rs would each link their own test binary: move them into \
         tests/envoy (real Envoy), tests/props (property tests) or tests/repo (repository checks)"
    );
}
