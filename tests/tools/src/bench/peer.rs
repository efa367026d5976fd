//! A peer router with prefix-aware routing in the same runs as Envoy's balancers and the filter:
//! the SGLang gateway (`sglang-router` from PyPI, a Rust router behind a Python launcher) with
//! its `cache_aware` policy (an approximate radix tree of the prompts each worker was sent).
//!
//! Why: issue 20 measures the filter's prefix placement against the best router that places by
//! prefix; the SGLang gateway is the one the numbers come from, and it installs from PyPI.
//!
//! How it is deployed: the router takes worker URLs and serves one model per router (workers
//! register as model "unknown": it does not read the mock's `/v1/models`, so a router given
//! workers of two models would send `m2` to an endpoint that only serves `m1`). So each run starts
//! one router per model and Envoy replica-slot, each given the mocks serving that model, and the
//! usual Envoy in front (the Lua model split of Envoy's balancers, see `topology.rs`) names the
//! model's router cluster: with one Envoy, one router per model; with three "replicas", three
//! routers per model in that cluster, round-robin, each learning its own tree (the deployment the
//! issue describes: every router process keeps its own index). The Envoy hop is the same for
//! every policy; what the router adds is its own.
//!
//! What the mock must answer for it (found by running it, `--log-level debug`): `GET /health`
//! (its start-up and periodic health checks); `/server_info`, `/get_server_info`, `/model_info`
//! and `/get_model_info` may be 404 (it falls back and registers the worker with model
//! "unknown"). It forwards the mock's response headers (`x-mock-endpoint`) and the body's
//! `usage`, streamed or not.
//!
//! The launcher: `$SGLANG_ROUTER_PYTHON` (default `.cache/peers/venv/bin/python`, which
//! `scripts/bench` creates with `pip install sglang-router==0.3.2` when a run asks for the peer).

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::support::{self, http};
use super::topology::record_pid;

/// The package and version the bench installs (scripts/bench).
pub const SGLANG_ROUTER_PACKAGE: &str = "sglang-router==0.3.2";

/// The router's flags besides workers, host and port: its prefix-aware policy with the
/// package's defaults for everything else (cache threshold, balance thresholds, retries,
/// circuit breaker), as a user who picks `cache_aware` runs it.
pub const SGLANG_ROUTER_ARGS: &[&str] = &["--policy", "cache_aware", "--log-level", "warn"];

/// The Python interpreter whose environment has `sglang_router`.
pub fn python() -> PathBuf {
    std::env::var_os("SGLANG_ROUTER_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| support::repo_root().join(".cache/peers/venv/bin/python"))
}

/// One `sglang_router.launch_router` process. Killed (by its PID) when dropped.
pub struct SglangRouter {
    pub port: u16,
    pub log: PathBuf,
    child: Child,
}

/// A port that was free a moment ago (the launcher has no "bind port 0 and report it").
fn free_port() -> Result<u16, String> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("binding port 0: {e}"))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| format!("port 0: {e}"))
}

impl SglangRouter {
    /// Starts a router over the workers on `worker_ports` and waits until it answers
    /// `GET /health` with 200 (its workers registered).
    pub fn start(worker_ports: &[u16], label: &str) -> Result<SglangRouter, String> {
        let py = python();
        if !py.exists() {
            return Err(format!(
                "{} is missing: `python3 -m venv .cache/peers/venv && \
                 .cache/peers/venv/bin/pip install {SGLANG_ROUTER_PACKAGE}` (scripts/bench does it)",
                py.display()
            ));
        }
        let dir = support::repo_root().join("results/tmp/bench/peers");
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let mut last = String::new();
        // A port picked free can be taken before the router binds it: try a few.
        for _ in 0..3 {
            let port = free_port()?;
            // Its metrics exporter binds a port of its own (29000 by default): one each.
            let metrics_port = free_port()?;
            let log = dir.join(format!("{label}-{port}.log"));
            let out = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
            let err = out.try_clone().map_err(|e| e.to_string())?;
            let urls: Vec<String> = worker_ports
                .iter()
                .map(|p| format!("http://127.0.0.1:{p}"))
                .collect();
            let child = Command::new(&py)
                .args(["-m", "sglang_router.launch_router", "--worker-urls"])
                .args(&urls)
                .args(SGLANG_ROUTER_ARGS)
                .args(["--host", "127.0.0.1", "--port", &port.to_string()])
                .args(["--prometheus-host", "127.0.0.1"])
                .args(["--prometheus-port", &metrics_port.to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::from(out))
                .stderr(Stdio::from(err))
                .spawn()
                .map_err(|e| format!("starting {}: {e}", py.display()))?;
            record_pid(child.id());
            let mut r = SglangRouter { port, log, child };
            match r.wait_ready(Duration::from_secs(60)) {
                Ok(()) => return Ok(r),
                Err(e) => last = e,
            }
        }
        Err(format!("sglang router ({label}) not ready: {last}"))
    }

    fn wait_ready(&mut self, limit: Duration) -> Result<(), String> {
        let deadline = Instant::now() + limit;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(20).collect();
                return Err(format!(
                    "exited with {status}: {}",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                ));
            }
            let ok = http::request(
                self.port,
                "GET",
                "/health",
                &[],
                None,
                Duration::from_secs(2),
            )
            .is_ok_and(|r| r.status == 200);
            if ok {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!("no 200 on /health within {limit:?}"));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for SglangRouter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
