//! Running the official OpenAI Python SDK against the filter: the scenarios in `tests/sdk/`.
//!
//! Why: the filter must keep working for real clients, whose retries, error classes and
//! parsers are not ours. `scripts/lib/ensure-python-sdk` installs a pinned `openai` into the
//! project's `.venv`; a scenario prints one JSON line of findings, which the Rust test asserts
//! together with what the mock upstreams saw.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::artifacts::repo_root;

/// The Python with the SDK: `$COMPUTEFLUX_PYTHON`, else `<repo>/.venv/bin/python`. Panics with
/// the install command if it is missing or cannot import `openai`.
pub fn python_bin() -> PathBuf {
    let p = std::env::var_os("COMPUTEFLUX_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".venv/bin/python"));
    let ok = Command::new(&p)
        .args(["-c", "import openai"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        panic!(
            "{} cannot import the OpenAI SDK; run scripts/lib/ensure-python-sdk (scripts/test \
             does) or set COMPUTEFLUX_PYTHON",
            p.display()
        );
    }
    p
}

/// The output of one scenario run.
#[derive(Debug)]
pub struct SdkRun {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

impl SdkRun {
    /// The scenario's findings (its last stdout line, JSON); panics with its output if it
    /// failed or printed none.
    pub fn findings(&self) -> Value {
        let last = self.stdout.lines().last().unwrap_or("");
        match serde_json::from_str::<Value>(last) {
            Ok(v) if self.ok => v,
            _ => panic!(
                "SDK scenario failed (ok={}):\n--- stdout ---\n{}\n--- stderr ---\n{}",
                self.ok, self.stdout, self.stderr
            ),
        }
    }
}

/// Runs `tests/sdk/scenarios.py <scenario>` against `base_url` (e.g.
/// `http://127.0.0.1:<port>/v1`) with `args` (JSON, read by the scenario as `ARGS`), and kills
/// it (by PID) after `timeout`.
pub fn run_scenario(scenario: &str, base_url: &str, args: &Value, timeout: Duration) -> SdkRun {
    let script = repo_root().join("tests/sdk/scenarios.py");
    let mut child = Command::new(python_bin())
        .arg(&script)
        .arg(scenario)
        .env("OPENAI_BASE_URL", base_url)
        .env("OPENAI_API_KEY", "sk-computeflux-test")
        .env("SCENARIO_ARGS", args.to_string())
        // Never reach a proxy or anything but loopback.
        .env("NO_PROXY", "*")
        .env_remove("HTTP_PROXY")
        .env_remove("HTTPS_PROXY")
        .env_remove("ALL_PROXY")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", script.display()));
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = drain(Box::new(child.stdout.take().expect("stdout pipe")));
    let err = drain(Box::new(child.stderr.take().expect("stderr pipe")));
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    let stdout = out.join().unwrap_or_default();
    let mut stderr = err.join().unwrap_or_default();
    if status.is_none() {
        stderr.push_str(&format!("\n(killed after {timeout:?})"));
    }
    SdkRun {
        ok: status.is_some_and(|s| s.success()),
        stdout,
        stderr,
    }
}
