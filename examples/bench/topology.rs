//! What runs in a bench: the mock endpoints, the Envoy bootstrap of each policy, and an Envoy
//! process started from a bootstrap text.
//!
//! Why its own Envoy launcher: the test harness (`tests/support`) renders one bootstrap shape,
//! one single-host cluster per endpoint. Envoy's own balancers need one cluster holding every
//! host with an `lb_policy`, so the bench renders the harness's bootstrap and reshapes its
//! clusters (everything else, listener, buffers, circuit-breaker thresholds, stays identical),
//! then starts Envoy itself.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use super::support::{self, EnvoyConfig, MockUpstream};

/// The endpoints: name and served models. The first four are always up; the fifth is the one
/// that joins mid-run.
pub const ENDPOINTS: &[(&str, &[&str])] = &[
    ("a", &["m1", "m2"]),
    ("b", &["m1", "m2"]),
    ("c", &["m1"]),
    ("d", &["m1"]),
    ("e", &["m1"]),
];

/// A routing policy under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    RoundRobin,
    LeastRequest,
    RingHash,
    Maglev,
    Filter,
}

impl Policy {
    pub const ALL: [Policy; 5] = [
        Policy::RoundRobin,
        Policy::LeastRequest,
        Policy::RingHash,
        Policy::Maglev,
        Policy::Filter,
    ];

    pub fn name(&self) -> &'static str {
        match self {
            Policy::RoundRobin => "round_robin",
            Policy::LeastRequest => "least_request",
            Policy::RingHash => "ring_hash",
            Policy::Maglev => "maglev",
            Policy::Filter => "computeflux",
        }
    }

    pub fn parse(s: &str) -> Option<Policy> {
        Policy::ALL
            .into_iter()
            .find(|p| p.name() == s || (s == "filter" && *p == Policy::Filter))
    }

    fn lb_policy(&self) -> Option<&'static str> {
        match self {
            Policy::RoundRobin => Some("ROUND_ROBIN"),
            Policy::LeastRequest => Some("LEAST_REQUEST"),
            Policy::RingHash => Some("RING_HASH"),
            Policy::Maglev => Some("MAGLEV"),
            Policy::Filter => None,
        }
    }
}

/// Starts the first `n` endpoints of [`ENDPOINTS`] with the given mock flags.
pub fn start_mocks(n: usize, args: &[String]) -> Vec<MockUpstream> {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    ENDPOINTS
        .iter()
        .take(n)
        .map(|(name, models)| MockUpstream::start(name, models, &args))
        .collect()
}

/// The filter's configuration for these endpoints (one Envoy cluster `ep_<name>` each; no
/// models: the endpoint serves any model).
pub fn plugin_config(endpoints: &[(&str, &[&str])], open_ms: u64) -> Value {
    let eps: Vec<Value> = endpoints
        .iter()
        .map(|(name, models)| {
            let mut e = json!({"name": name, "cluster": format!("ep_{name}")});
            if let (false, Some(o)) = (models.is_empty(), e.as_object_mut()) {
                o.insert("models".into(), json!(models));
            }
            e
        })
        .collect();
    json!({
        "endpoints": eps,
        "session_header": super::workload::SESSION_HEADER,
        "open_ms": open_ms,
    })
}

/// Envoy's route retry policy for its own balancers: what an operator would configure so that a
/// refused connection, a reset or a 429/503 from one host is retried on another host.
pub fn envoy_retry_policy() -> Value {
    json!({
        "retry_on": "connect-failure,reset,refused-stream,retriable-status-codes",
        "retriable_status_codes": [429, 503],
        "num_retries": 2,
        "retry_host_predicate": [{
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
            }
        }],
        "host_selection_retry_max_attempts": 5,
    })
}

/// How Envoy is set up for one run.
pub struct Setup<'a> {
    pub policy: Policy,
    /// `(endpoint name, models, port)`.
    pub hosts: &'a [(&'a str, &'a [&'a str], u16)],
    pub concurrency: u32,
    pub envoy_retries: bool,
    pub open_ms: u64,
}

/// The bootstrap text for `setup`.
pub fn bootstrap(setup: &Setup<'_>, wasm: &Path) -> Result<String, String> {
    let mut cfg = EnvoyConfig {
        concurrency: setup.concurrency,
        log_level: "warn".into(),
        ..EnvoyConfig::default()
    };
    match setup.policy.lb_policy() {
        None => {
            let eps: Vec<(&str, &[&str])> = setup.hosts.iter().map(|(n, m, _)| (*n, *m)).collect();
            cfg.plugin_config = plugin_config(&eps, setup.open_ms);
            cfg.clusters = setup
                .hosts
                .iter()
                .map(|(n, _, p)| (format!("ep_{n}"), *p))
                .collect();
            Ok(support::render_bootstrap(&cfg, wasm, 0, 0))
        }
        Some(lb) => {
            let first = setup.hosts.first().map(|h| h.2).unwrap_or(0);
            cfg.with_filter = false;
            cfg.clusters = vec![("pool".into(), first)];
            let mut extra = serde_json::Map::new();
            if matches!(setup.policy, Policy::RingHash | Policy::Maglev) {
                extra.insert(
                    "hash_policy".into(),
                    json!([{"header": {"header_name": super::workload::SESSION_HEADER}}]),
                );
            }
            if setup.envoy_retries {
                extra.insert("retry_policy".into(), envoy_retry_policy());
            }
            cfg.route_extra = Value::Object(extra);
            let text = support::render_bootstrap(&cfg, wasm, 0, 0);
            let ports: Vec<u16> = setup.hosts.iter().map(|h| h.2).collect();
            pool_cluster(&text, lb, &ports)
        }
    }
}

/// Rewrites the single cluster of a rendered bootstrap into one cluster of all `ports` with
/// `lb_policy`.
fn pool_cluster(text: &str, lb_policy: &str, ports: &[u16]) -> Result<String, String> {
    let mut v: Value = serde_json::from_str(text).map_err(|e| format!("bootstrap: {e}"))?;
    let cluster = v
        .pointer_mut("/static_resources/clusters/0")
        .and_then(Value::as_object_mut)
        .ok_or("bootstrap has no cluster")?;
    let lb_endpoints: Vec<Value> = ports
        .iter()
        .map(|p| {
            json!({"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}})
        })
        .collect();
    cluster.insert("lb_policy".into(), json!(lb_policy));
    cluster.insert(
        "load_assignment".into(),
        json!({"cluster_name": "pool", "endpoints": [{"lb_endpoints": lb_endpoints}]}),
    );
    serde_json::to_string_pretty(&v).map_err(|e| e.to_string())
}

/// An Envoy process started from a bootstrap text. Killed (by its PID) when dropped.
pub struct EnvoyProc {
    pub port: u16,
    pub admin_port: u16,
    pub dir: PathBuf,
    child: Child,
}

impl EnvoyProc {
    pub fn start(bootstrap: &str, concurrency: u32, label: &str) -> Result<EnvoyProc, String> {
        let id = support::unique_u32();
        let dir = std::env::temp_dir().join(format!("computeflux-bench-{label}-{id}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let config = dir.join("envoy.yaml");
        std::fs::write(&config, bootstrap).map_err(|e| format!("{}: {e}", config.display()))?;
        let admin_path = dir.join("admin-address.txt");
        let stderr = std::fs::File::create(dir.join("envoy.stderr")).map_err(|e| e.to_string())?;
        let child = Command::new(support::envoy_bin())
            .arg("-c")
            .arg(&config)
            .args(["--concurrency", &concurrency.to_string()])
            .args(["--base-id", &id.to_string()])
            .arg("--disable-hot-restart")
            .args(["--log-level", "warn"])
            .arg("--log-path")
            .arg(dir.join("envoy.log"))
            .arg("--admin-address-path")
            .arg(&admin_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(stderr))
            .spawn()
            .map_err(|e| format!("starting envoy: {e}"))?;
        record_pid(child.id());
        let mut p = EnvoyProc {
            port: 0,
            admin_port: 0,
            dir,
            child,
        };
        match p.wait_ready(&admin_path, Duration::from_secs(30)) {
            Ok(()) => Ok(p),
            Err(e) => {
                let log = std::fs::read_to_string(p.dir.join("envoy.log")).unwrap_or_default();
                let err = std::fs::read_to_string(p.dir.join("envoy.stderr")).unwrap_or_default();
                Err(format!(
                    "envoy ({label}) not ready: {e}\n{}\n{}",
                    tail(&log, 30),
                    tail(&err, 30)
                ))
            }
        }
    }

    fn wait_ready(&mut self, admin_path: &Path, limit: Duration) -> Result<(), String> {
        let (admin, port) = support::envoy::wait_ready(&mut self.child, admin_path, limit)?;
        self.admin_port = admin;
        self.port = port;
        Ok(())
    }

    /// User + system CPU time of the process so far, in clock ticks (`/proc/<pid>/stat`).
    pub fn cpu_ticks(&self) -> Option<u64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).ok()?;
        // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
        let rest = stat.rsplit_once(')')?.1;
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let utime: u64 = fields.get(11)?.parse().ok()?;
        let stime: u64 = fields.get(12)?.parse().ok()?;
        Some(utime + stime)
    }
}

impl Drop for EnvoyProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::env::var_os("KEEP_ENVOY_DIR").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines
        .get(lines.len().saturating_sub(n)..)
        .unwrap_or(&[])
        .join("\n")
}

/// Appends a child PID to `$BENCH_PID_FILE` so that `scripts/bench` can stop it if this process
/// dies without running its destructors.
pub fn record_pid(pid: u32) {
    use std::io::Write;
    if let Some(path) = std::env::var_os("BENCH_PID_FILE") {
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = writeln!(f, "{pid}");
        }
    }
}
