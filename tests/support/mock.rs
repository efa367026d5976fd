//! A running `mock_upstream` process (tests/tools/src/mock_upstream.rs): one simulated inference endpoint.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;

use super::artifacts::mock_bin;
use super::http;

/// One mock upstream. Killed (by PID) when dropped; it also exits by itself when the test process
/// dies (it runs with `--exit-on-stdin-eof` and its stdin is a pipe held here).
pub struct MockUpstream {
    pub name: String,
    /// The port Envoy's cluster points at.
    pub port: u16,
    /// The `/_mock/*` port, which keeps working while the main port refuses connections.
    pub control_port: u16,
    child: Child,
    _stdin: Option<ChildStdin>,
}

impl MockUpstream {
    /// Starts `mock_upstream --port 0 --name <name> [--models a,b] <extra_args…>` and waits (≤ 20 s)
    /// for its `LISTENING` and `CONTROL` lines. `models` empty: any model is accepted.
    pub fn start(name: &str, models: &[&str], extra_args: &[&str]) -> MockUpstream {
        let bin = mock_bin();
        let mut cmd = Command::new(&bin);
        cmd.args([
            "--port",
            "0",
            "--control-port",
            "0",
            "--exit-on-stdin-eof",
            "--name",
            name,
        ]);
        if !models.is_empty() {
            cmd.arg("--models").arg(models.join(","));
        }
        cmd.args(extra_args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => panic!("cannot start {}: {e}", bin.display()),
        };
        let stdin = child.stdin.take();
        let Some(stdout) = child.stdout.take() else {
            let _ = child.kill();
            let _ = child.wait();
            panic!("mock {name}: no stdout pipe");
        };
        let (tx, rx) = mpsc::channel::<String>();
        std::thread::spawn(move || {
            // Forward lines until EOF (keeps the pipe drained for the process's whole life).
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // After the ports are read nobody listens: keep draining anyway.
                let _ = tx.send(line);
            }
        });
        let mut port = None;
        let mut control_port = None;
        let (port, control_port) = loop {
            if let (Some(p), Some(c)) = (port, control_port) {
                break (p, c);
            }
            match rx.recv_timeout(Duration::from_secs(20)) {
                Ok(line) => {
                    let parsed = line
                        .rsplit_once(':')
                        .and_then(|(_, p)| p.trim().parse::<u16>().ok());
                    if line.starts_with("LISTENING ") {
                        port = parsed;
                    } else if line.starts_with("CONTROL ") {
                        control_port = parsed;
                    }
                }
                Err(e) => {
                    let status = child.try_wait();
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!("mock {name} did not report its ports ({e}); exit status: {status:?}");
                }
            }
        };
        MockUpstream {
            name: name.to_string(),
            port,
            control_port,
            child,
            _stdin: stdin,
        }
    }

    /// An engine-like mock serving `models`: 16 slots, a FIFO queue, `max_tokens` output
    /// tokens at 3 ms each, 1 ms per uncached prompt token (a turn's ~70 new tokens: ~70 ms, so
    /// that 5× slower is well above the noise of a loaded machine); its decode counters in its
    /// `/metrics` (vLLM format).
    pub fn paced_engine(name: &str, models: &[&str]) -> MockUpstream {
        MockUpstream::start(
            name,
            models,
            &[
                "--engine",
                "batched",
                "--max-concurrency",
                "16",
                "--output-tokens",
                "max_tokens",
                "--decode-ms-per-token",
                "3",
                "--prefill-us-per-token",
                "1000",
            ],
        )
    }

    /// `127.0.0.1:<port>`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Replaces the mock's fault (see `tests/tools/src/mock_upstream.rs`), e.g.
    /// `json!({"mode":"status","status":429,"retry_after":"2"})`. Returns once it is in force
    /// (for `refuse`: the port is closed; leaving `refuse`: the same port is bound again).
    pub fn set_fault(&self, fault: Value) {
        let r = http::post_json(self.control_port, "/_mock/fault", &fault.to_string());
        assert_eq!(
            r.status, 200,
            "mock {}: setting fault {fault}: {}",
            self.name, r.body
        );
    }

    /// `set_fault({"mode":"none"})`.
    pub fn clear_fault(&self) {
        self.set_fault(serde_json::json!({"mode": "none"}));
    }

    /// `GET /_mock/stats`.
    pub fn stats(&self) -> Value {
        http::get(self.control_port, "/_mock/stats").json()
    }

    /// `stats()["requests"]`: chat-completion requests received (faulted ones included).
    pub fn request_count(&self) -> u64 {
        self.stats()
            .get("requests")
            .and_then(Value::as_u64)
            .unwrap_or(0)
    }

    /// `GET /_mock/requests`: the last requests, oldest first.
    pub fn requests(&self) -> Vec<Value> {
        match http::get(self.control_port, "/_mock/requests").json() {
            Value::Array(a) => a,
            other => panic!(
                "mock {}: /_mock/requests is not an array: {other}",
                self.name
            ),
        }
    }

    /// `POST /_mock/reset_stats` (counters and request log).
    pub fn reset_stats(&self) {
        let r = http::post_json(self.control_port, "/_mock/reset_stats", "{}");
        assert_eq!(r.status, 200, "mock {}: reset_stats: {}", self.name, r.body);
    }

    /// Replaces the key's quota (`POST /_mock/quota`, see `tests/tools/src/mock_upstream/quota.rs`),
    /// e.g. `json!({"requests": 5, "window_ms": 60000, "headers_family": "openai"})`; its window
    /// starts again.
    pub fn set_quota(&self, quota: Value) {
        let r = http::post_json(self.control_port, "/_mock/quota", &quota.to_string());
        assert_eq!(
            r.status, 200,
            "mock {}: setting quota {quota}: {}",
            self.name, r.body
        );
    }

    /// `GET /_mock/quota_usage`: `(unix ms, tokens used in its window after it)` for each
    /// request the key's quota admitted, oldest first.
    pub fn quota_usage(&self) -> Vec<(u64, u64)> {
        let v = http::get(self.control_port, "/_mock/quota_usage").json();
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|e| Some((e.get(0)?.as_u64()?, e.get(1)?.as_u64()?)))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// 429s answered since the last `reset_stats` (`status_counts["429"]`).
    pub fn count_429(&self) -> u64 {
        self.stats()
            .pointer("/status_counts/429")
            .and_then(Value::as_u64)
            .unwrap_or(0)
    }

    /// `POST /_mock/flush_cache`.
    pub fn flush_cache(&self) {
        let r = http::post_json(self.control_port, "/_mock/flush_cache", "{}");
        assert_eq!(r.status, 200, "mock {}: flush_cache: {}", self.name, r.body);
    }
}

impl Drop for MockUpstream {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
