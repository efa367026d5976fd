//! Every call into Envoy goes through `src/filter/host.rs`.
//!
//! Why: the proxy-wasm SDK (0.2.5) panics on any host status it does not expect — in its
//! `hostcalls::*` functions (`status => panic!`), in the `Context` / `HttpContext` /
//! `RootContext` trait methods that wrap them (`.unwrap()`), and in the logger it installs
//! with `proxy_wasm::set_log_level`. A panic kills the worker's VM. `host.rs` declares the
//! host's `proxy_*` imports itself and maps every status to a fallback, so the promise
//! "nothing in the request path can panic" holds only if nothing else calls the host. This
//! test makes that a checked fact: it fails naming each file and line outside `host.rs` that
//! uses `hostcalls`, the SDK's logger, its own `proxy_*` import, or a trait method whose
//! default body calls the host. That method list is read from the SDK's own source
//! (`traits.rs` of the locked proxy-wasm version), so a method added by an SDK upgrade is
//! covered without editing this test.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::{Path, PathBuf};
use std::process::Command;

const HOST_RS: &str = "src/filter/host.rs";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The host's target triple (`rustc -vV`), so that `cargo metadata` needs no wasm-only crate.
fn host_triple() -> String {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let out = Command::new(rustc)
        .arg("-vV")
        .output()
        .expect("run rustc -vV");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: "))
        .expect("host triple")
        .trim()
        .to_string()
}

/// The proxy-wasm SDK's `src/traits.rs`, located with `cargo metadata`.
fn sdk_traits() -> PathBuf {
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--offline"])
        .args(["--filter-platform", &host_triple()])
        .current_dir(repo())
        .output()
        .expect("run cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let manifest = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "proxy-wasm")
        .and_then(|p| p["manifest_path"].as_str())
        .expect("proxy-wasm in cargo metadata");
    Path::new(manifest).with_file_name("src/traits.rs")
}

/// Names of the SDK trait methods whose default body calls the host.
fn host_calling_methods(traits_rs: &str) -> Vec<String> {
    let mut out = Vec::new();
    let pieces: Vec<&str> = traits_rs.split("fn ").collect();
    for piece in pieces.iter().skip(1) {
        let name: String = piece
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() && piece.contains("hostcalls::") && !out.contains(&name) {
            out.push(name);
        }
    }
    out
}

/// Source text without `//` comments (doc comments may name SDK functions freely).
fn code_lines(text: &str) -> Vec<(usize, String)> {
    text.lines()
        .enumerate()
        .map(|(i, l)| {
            let code = match l.find("//") {
                Some(at) => l.get(..at).unwrap_or(""),
                None => l,
            };
            (i + 1, code.to_string())
        })
        .collect()
}

/// What in `text` calls the host other than through `host::`.
fn violations(text: &str, methods: &[String]) -> Vec<String> {
    let mut found = Vec::new();
    for (line, code) in code_lines(text) {
        for fixed in ["hostcalls", "proxy_wasm::set_log_level", "fn proxy_"] {
            if code.contains(fixed) {
                found.push(format!("line {line}: `{fixed}`: {}", code.trim()));
            }
        }
        for m in methods {
            for sep in [".", "::"] {
                let pat = format!("{sep}{m}(");
                for (at, _) in code.match_indices(&pat) {
                    let before = code.get(..at).unwrap_or("");
                    if sep == "::" && before.ends_with("host") {
                        continue; // host::<name>( is the wrapper itself
                    }
                    found.push(format!("line {line}: `{sep}{m}(`: {}", code.trim()));
                }
            }
        }
    }
    found
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

#[test]
fn only_host_rs_calls_the_host() {
    let traits = std::fs::read_to_string(sdk_traits()).expect("read the SDK's traits.rs");
    let methods = host_calling_methods(&traits);
    // The derivation works: the methods the filter would be tempted to use are in it.
    for known in [
        "get_shared_data",
        "set_shared_data",
        "dispatch_http_call",
        "send_http_response",
        "get_http_request_header",
        "get_http_request_body",
        "get_http_call_response_body",
        "set_tick_period",
        "get_current_time",
        "get_property",
    ] {
        assert!(
            methods.iter().any(|m| m == known),
            "{known} not found among {methods:?}"
        );
    }
    let mut files = Vec::new();
    rust_files(&repo().join("src"), &mut files);
    files.sort();
    assert!(files.len() > 10, "{files:?}");
    let mut report = Vec::new();
    for f in &files {
        let rel = f
            .strip_prefix(repo())
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        if rel == HOST_RS {
            continue;
        }
        let text = std::fs::read_to_string(f).unwrap();
        for v in violations(&text, &methods) {
            report.push(format!("{rel} {v}"));
        }
    }
    assert!(
        report.is_empty(),
        "host calls outside {HOST_RS} (go through its wrappers instead):\n{}",
        report.join("\n")
    );
}

/// The scanner itself flags what it must, and not what it must not.
#[test]
fn the_scanner_flags_direct_host_calls() {
    let methods = host_calling_methods(
        "fn get_shared_data(&self) { hostcalls::get_shared_data(k).unwrap() }\n\
         fn on_tick(&mut self) {}\n\
         fn send_http_response(&self) { hostcalls::send_http_response(s).unwrap() }",
    );
    assert_eq!(methods, ["get_shared_data", "send_http_response"]);
    let bad = "use proxy_wasm::hostcalls;\n\
               let v = self.get_shared_data(\"k\");\n\
               proxy_wasm::set_log_level(LogLevel::Info);\n\
               Context::send_http_response(self, 200);\n\
               extern \"C\" { fn proxy_log(l: u32) -> u32; }";
    let found = violations(bad, &methods);
    assert_eq!(found.len(), 5, "{found:#?}");
    let fine = "// self.get_shared_data(k) in a comment\n\
                let v = host::get_shared_data(\"k\");\n\
                let w = store.get(\"k\");";
    assert_eq!(violations(fine, &methods), Vec::<String>::new());
}
