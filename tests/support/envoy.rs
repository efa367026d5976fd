//! A running Envoy 1.40 with (or without) the ComputeFlux wasm filter, and the bootstrap it runs.
//!
//! Ports: the listener and the admin interface bind port 0. Envoy writes the admin address to the
//! `--admin-address-path` file; the listener's port comes from admin `GET /listeners?format=json`
//! once `GET /ready` answers `LIVE`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::artifacts::{envoy_bin, wasm_path};
use super::http::{self, Response};
use super::unique_u32;

/// Stat tags turned into labels by default (see [`stats_tags`]).
pub const DEFAULT_STAT_TAGS: &[&str] = &[
    "endpoint", "outcome", "result", "reason", "source", "affinity", "error", "priority", "tenant",
];

/// How to run Envoy.
#[derive(Clone, Debug)]
pub struct EnvoyConfig {
    /// The filter's JSON configuration (passed as a `google.protobuf.StringValue`).
    pub plugin_config: Value,
    /// `(cluster name, port on 127.0.0.1)`; the filter names clusters in the routing header.
    pub clusters: Vec<(String, u16)>,
    /// Envoy worker threads (`--concurrency`).
    pub concurrency: u32,
    /// The route's timeout.
    pub route_timeout_ms: u64,
    /// false: no wasm filter, every request goes to the first cluster (baseline for benches).
    pub with_filter: bool,
    /// Extra keys merged into the route action (e.g. `{"retry_policy": {...}}`).
    pub route_extra: Value,
    /// Extra keys merged into the HTTP connection manager (e.g.
    /// `{"http_protocol_options": {"enable_trailers": true}}`).
    pub hcm_extra: Value,
    /// Tags extracted from `computeflux` metric names (see [`stats_tags`]).
    pub stat_tags: Vec<String>,
    /// `--log-level`.
    pub log_level: String,
    /// `--component-log-level` (e.g. `"wasm:debug"`), if any.
    pub component_log_level: Option<String>,
    /// `--base-id`; None: a process-unique one.
    pub base_id: Option<u32>,
    /// Clusters added as they are (e.g. an EDS pool cluster, see `support::pool`).
    pub raw_clusters: Vec<Value>,
}

impl Default for EnvoyConfig {
    fn default() -> Self {
        EnvoyConfig {
            plugin_config: json!({}),
            clusters: Vec::new(),
            concurrency: 2,
            route_timeout_ms: 30_000,
            with_filter: true,
            route_extra: Value::Null,
            hcm_extra: Value::Null,
            stat_tags: DEFAULT_STAT_TAGS.iter().map(|s| s.to_string()).collect(),
            log_level: "info".into(),
            component_log_level: None,
            base_id: None,
            raw_clusters: Vec::new(),
        }
    }
}

impl EnvoyConfig {
    /// A filter config with these clusters and defaults for the rest.
    pub fn new(plugin_config: Value, clusters: &[(&str, u16)]) -> Self {
        EnvoyConfig {
            plugin_config,
            clusters: clusters.iter().map(|(n, p)| (n.to_string(), *p)).collect(),
            ..EnvoyConfig::default()
        }
    }

    /// The header the route reads the cluster from: `plugin_config.routing_header`, else
    /// `x-computeflux-cluster`.
    pub fn routing_header(&self) -> String {
        self.plugin_config
            .get("routing_header")
            .and_then(Value::as_str)
            .unwrap_or("x-computeflux-cluster")
            .to_ascii_lowercase()
    }
}

/// `stats_config.stats_tags` rules: for each tag `t`, a metric named
/// `computeflux_<x>[.<k>.<v>…].t.<value>[…]` (or `computeflux.<x>…`), seen by Envoy as
/// `wasmcustom.computeflux_<x>…`, loses `.t.<value>` from its name and gets the tag `t=<value>`.
/// So `computeflux_requests_total.endpoint.a.outcome.success` is exported to Prometheus as
/// `computeflux_requests_total{endpoint="a",outcome="success"}`. Values cannot contain dots.
pub fn stats_tags(tags: &[String]) -> Value {
    let rules: Vec<Value> = tags
        .iter()
        .map(|t| {
            json!({
                "tag_name": t,
                "regex": format!(r"^wasmcustom\.computeflux[._][^.]*(?:\.[^.]+)*?(\.{t}\.([^.]+))"),
            })
        })
        .collect();
    Value::Array(rules)
}

/// As envoy/envoy.yaml: Envoy's own replies for upstream failures (connect failure, reset,
/// timeout, no cluster) answer in the OpenAI error shape, like the filter's.
pub fn local_reply_config() -> Value {
    json!({"mappers": [{
        // Not the filter's own replies (response details `computeflux_reply`): the flags stay
        // set after a failed first attempt, also when the filter relays a failover's answer.
        "filter": {"and_filter": {"filters": [
            {"response_flag_filter": {"flags": ["UF", "UH", "UT", "UC", "UO", "UR", "URX", "NC", "DC"]}},
            {"extension_filter": {
                "name": "envoy.access_loggers.extension_filters.cel",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                    "expression": "response.code_details != 'computeflux_reply'",
                },
            }},
        ]}},
        "body_format_override": {"json_format": {"error": {
            "message": "%LOCAL_REPLY_BODY%",
            "type": "server_error",
            "code": "upstream_unavailable",
        }}},
    }]})
}

/// The Envoy bootstrap for `cfg`, as JSON text (JSON is YAML, so Envoy reads it from a `.yaml`
/// file too). `wasm` is the filter module; ports 0 let the OS choose.
pub fn render_bootstrap(
    cfg: &EnvoyConfig,
    wasm: &Path,
    listener_port: u16,
    admin_port: u16,
) -> String {
    const BUFFER: u64 = 16 * 1024 * 1024;
    let timeout = format!("{}s", cfg.route_timeout_ms as f64 / 1000.0);
    let mut route = if cfg.with_filter {
        json!({"cluster_header": cfg.routing_header(), "timeout": timeout})
    } else {
        let first = cfg
            .clusters
            .first()
            .map(|c| c.0.clone())
            .unwrap_or_default();
        json!({"cluster": first, "timeout": timeout})
    };
    if let (Some(r), Value::Object(extra)) = (route.as_object_mut(), &cfg.route_extra) {
        for (k, v) in extra {
            r.insert(k.clone(), v.clone());
        }
    }
    let mut route_entry = json!({"match": {"prefix": "/"}, "route": route});
    if cfg.with_filter {
        // As envoy/envoy.yaml: the upstream never sees the routing header.
        if let Some(e) = route_entry.as_object_mut() {
            e.insert(
                "request_headers_to_remove".into(),
                json!([cfg.routing_header()]),
            );
        }
    }
    let mut http_filters = Vec::new();
    if cfg.with_filter {
        http_filters.push(json!({
            "name": "envoy.filters.http.wasm",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
                "config": {
                    "name": "computeflux",
                    "root_id": "computeflux",
                    "vm_config": {
                        "vm_id": "computeflux",
                        "runtime": "envoy.wasm.runtime.v8",
                        "code": {"local": {"filename": wasm.display().to_string()}},
                    },
                    "configuration": {
                        "@type": "type.googleapis.com/google.protobuf.StringValue",
                        "value": cfg.plugin_config.to_string(),
                    },
                    "allow_on_headers_stop_iteration": true,
                    "failure_policy": "FAIL_RELOAD",
                },
            },
        }));
    }
    http_filters.push(json!({
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
    }));
    let high = json!({"thresholds": [{
        "max_connections": 100000, "max_pending_requests": 100000,
        "max_requests": 100000, "max_retries": 1000,
    }]});
    let mut clusters: Vec<Value> = cfg
        .clusters
        .iter()
        .map(|(name, port)| {
            json!({
                "name": name,
                "type": "STATIC",
                "connect_timeout": "1s",
                "per_connection_buffer_limit_bytes": BUFFER,
                "circuit_breakers": high,
                "load_assignment": {
                    "cluster_name": name,
                    "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                        "socket_address": {"address": "127.0.0.1", "port_value": port}
                    }}}]}],
                },
            })
        })
        .collect();
    clusters.extend(cfg.raw_clusters.iter().cloned());
    let mut hcm = json!({
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "computeflux",
        "local_reply_config": local_reply_config(),
        "codec_type": "AUTO",
        "http2_protocol_options": {
            "initial_stream_window_size": BUFFER,
            "initial_connection_window_size": BUFFER,
        },
        "route_config": {
            "name": "computeflux",
            "virtual_hosts": [{
                "name": "all",
                "domains": ["*"],
                "routes": [route_entry],
            }],
        },
        "http_filters": http_filters,
    });
    if let (Some(h), Value::Object(extra)) = (hcm.as_object_mut(), &cfg.hcm_extra) {
        for (k, v) in extra {
            h.insert(k.clone(), v.clone());
        }
    }
    let bootstrap = json!({
        "node": {"id": "computeflux-test", "cluster": "computeflux-test"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "stats_config": {"stats_tags": stats_tags(&cfg.stat_tags)},
        "static_resources": {
            "listeners": [{
                "name": "computeflux",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": listener_port}},
                "per_connection_buffer_limit_bytes": BUFFER,
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": hcm,
                }]}],
            }],
            "clusters": clusters,
        },
    });
    match serde_json::to_string_pretty(&bootstrap) {
        Ok(s) => s + "\n",
        Err(_) => bootstrap.to_string(),
    }
}

/// A running Envoy. Killed when dropped; its temp dir (config, logs) is removed then, unless the
/// thread is panicking (a failing test) or `KEEP_ENVOY_DIR` is set, in which case the dir is kept
/// and the log's tail printed.
pub struct Envoy {
    /// The listener's port on 127.0.0.1.
    pub port: u16,
    pub admin_port: u16,
    pub dir: PathBuf,
    pub config_path: PathBuf,
    pub log_path: PathBuf,
    child: Child,
}

impl Envoy {
    /// Starts Envoy and waits (≤ 20 s) until it is ready. Panics with the log if it is not.
    pub fn start(cfg: EnvoyConfig) -> Envoy {
        match Envoy::try_start(cfg) {
            Ok(e) => e,
            Err(e) => panic!("{e}"),
        }
    }

    /// Like [`Envoy::start`], returning Envoy's log in the error (for tests that expect a
    /// configuration to be rejected).
    pub fn try_start(cfg: EnvoyConfig) -> Result<Envoy, String> {
        let bin = envoy_bin();
        let wasm = if cfg.with_filter {
            wasm_path()
        } else {
            PathBuf::new()
        };
        let id = unique_u32();
        let dir = std::env::temp_dir().join(format!("computeflux-envoy-{id}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let config_path = dir.join("envoy.yaml");
        let log_path = dir.join("envoy.log");
        let admin_path = dir.join("admin-address.txt");
        std::fs::write(&config_path, render_bootstrap(&cfg, &wasm, 0, 0))
            .map_err(|e| format!("writing {}: {e}", config_path.display()))?;
        let stderr = std::fs::File::create(dir.join("envoy.stderr"))
            .map_err(|e| format!("creating envoy.stderr: {e}"))?;
        let mut cmd = Command::new(&bin);
        cmd.arg("-c")
            .arg(&config_path)
            .arg("--concurrency")
            .arg(cfg.concurrency.to_string())
            .arg("--base-id")
            .arg(cfg.base_id.unwrap_or(id).to_string())
            .arg("--disable-hot-restart")
            .arg("--log-level")
            .arg(&cfg.log_level)
            .arg("--log-path")
            .arg(&log_path)
            // The log file is written in the background; flush it often so tests can read it.
            .arg("--file-flush-interval-msec")
            .arg("100")
            .arg("--admin-address-path")
            .arg(&admin_path);
        if let Some(c) = &cfg.component_log_level {
            cmd.arg("--component-log-level").arg(c);
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(stderr));
        let child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
        let mut envoy = Envoy {
            port: 0,
            admin_port: 0,
            dir,
            config_path,
            log_path,
            child,
        };
        match envoy.wait_ready(&admin_path, Duration::from_secs(20)) {
            Ok(()) => Ok(envoy),
            Err(e) => {
                let _ = envoy.child.kill();
                let _ = envoy.child.wait();
                Err(format!(
                    "Envoy did not become ready: {e}\nconfig: {}\n--- log ---\n{}",
                    envoy.config_path.display(),
                    envoy.log_contents()
                ))
            }
        }
    }

    fn wait_ready(&mut self, admin_path: &Path, limit: Duration) -> Result<(), String> {
        let (admin, port) = wait_ready(&mut self.child, admin_path, limit)?;
        self.admin_port = admin;
        self.port = port;
        Ok(())
    }

    /// `127.0.0.1:<listener port>`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Is the process still running?
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Envoy's log file followed by anything it wrote to stderr.
    pub fn log_contents(&self) -> String {
        let log = std::fs::read_to_string(&self.log_path).unwrap_or_default();
        let err = std::fs::read_to_string(self.dir.join("envoy.stderr")).unwrap_or_default();
        if err.trim().is_empty() {
            log
        } else {
            format!("{log}\n--- stderr ---\n{err}")
        }
    }

    /// Log lines that show a wasm panic or a failed VM (empty when the filter never crashed).
    pub fn wasm_crashes(&self) -> Vec<String> {
        self.log_contents()
            .lines()
            .filter(|l| l.contains("panic") || l.contains("Wasm VM failed"))
            .map(str::to_string)
            .collect()
    }

    /// Waits (≤ `timeout`) until [`Envoy::log_contents`] contains `needle` (the log file is
    /// flushed every 100 ms, so a line just logged may not be there yet).
    pub fn wait_for_log(&self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.log_contents().contains(needle) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `GET <path>` on the admin interface. Panics on I/O errors.
    pub fn admin_get(&self, path: &str) -> Response {
        http::get(self.admin_port, path)
    }

    /// Every `wasmcustom.computeflux_*` counter and gauge of `/stats`, by name.
    pub fn computeflux_stats(&self) -> std::collections::BTreeMap<String, i64> {
        computeflux_stats(self.admin_port)
    }

    /// `POST <path>` on the admin interface (e.g. `/reset_counters`). Panics on I/O errors.
    pub fn admin_post(&self, path: &str) -> Response {
        match http::request(
            self.admin_port,
            "POST",
            path,
            &[],
            None,
            http::DEFAULT_TIMEOUT,
        ) {
            Ok(r) => r,
            Err(e) => panic!("admin POST {path}: {e}"),
        }
    }

    /// `/stats/prometheus` text.
    pub fn prometheus(&self) -> String {
        self.admin_get("/stats/prometheus").body
    }

    /// The value of the stat exactly named `name` in admin `/stats` (e.g.
    /// `"wasmcustom.computeflux_requests_total.endpoint.a.outcome.success"` or
    /// `"cluster.a.upstream_rq_total"`), if it exists and is a counter or gauge.
    pub fn stat(&self, name: &str) -> Option<i64> {
        let body = self.admin_get("/stats?format=json").body;
        let v: Value = serde_json::from_str(&body).ok()?;
        v.get("stats")?
            .as_array()?
            .iter()
            .find(|s| s.get("name").and_then(Value::as_str) == Some(name))?
            .get("value")?
            .as_i64()
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() || std::env::var_os("KEEP_ENVOY_DIR").is_some() {
            let log = self.log_contents();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines
                .get(lines.len().saturating_sub(60)..)
                .unwrap_or(&[])
                .join("\n");
            eprintln!(
                "Envoy (pid {}) files kept in {}; last log lines:\n{tail}",
                self.child.id(),
                self.dir.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Waits (≤ `limit`) until the Envoy `child`, started with `--admin-address-path admin_path`
/// and port-0 listeners, is ready, and returns `(admin port, listener port)`: the admin port
/// from the address file, readiness from `/ready`, the listener's port (the one named
/// `computeflux`, else the first) from `/listeners`. Fails early if the process exits.
pub fn wait_ready(
    child: &mut Child,
    admin_path: &Path,
    limit: Duration,
) -> Result<(u16, u16), String> {
    let deadline = Instant::now() + limit;
    let short = Duration::from_secs(2);
    let mut admin_port = 0u16;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("envoy exited: {status}"));
        }
        if Instant::now() > deadline {
            return Err(format!("not ready after {limit:?}"));
        }
        std::thread::sleep(Duration::from_millis(50));
        if admin_port == 0 {
            let Ok(text) = std::fs::read_to_string(admin_path) else {
                continue;
            };
            match text
                .trim()
                .rsplit_once(':')
                .and_then(|(_, p)| p.parse().ok())
            {
                Some(p) => admin_port = p,
                None => continue,
            }
        }
        let ready = http::request(admin_port, "GET", "/ready", &[], None, short);
        if !matches!(&ready, Ok(r) if r.status == 200 && r.body.trim() == "LIVE") {
            continue;
        }
        let Ok(l) = http::request(
            admin_port,
            "GET",
            "/listeners?format=json",
            &[],
            None,
            short,
        ) else {
            continue;
        };
        let port = serde_json::from_str::<Value>(&l.body).ok().and_then(|v| {
            let statuses = v.get("listener_statuses")?.as_array()?;
            statuses
                .iter()
                .find(|s| s.get("name").and_then(Value::as_str) == Some("computeflux"))
                .or_else(|| statuses.first())?
                .pointer("/local_address/socket_address/port_value")?
                .as_u64()
        });
        if let Some(p) = port.and_then(|p| u16::try_from(p).ok()).filter(|p| *p != 0) {
            return Ok((admin_port, p));
        }
    }
}

/// Every `wasmcustom.computeflux_*` counter and gauge of the `/stats` of the Envoy whose admin
/// interface is on `admin_port`, by name.
/// The filter's stats of one Envoy by name (`computeflux_stats`).
pub type Stats = std::collections::BTreeMap<String, i64>;

/// The per-endpoint stat `base` of `endpoint` in `s` (-1 when absent).
pub fn endpoint_stat(s: &Stats, base: &str, endpoint: &str) -> i64 {
    s.get(&format!("wasmcustom.{base}.endpoint.{endpoint}"))
        .copied()
        .unwrap_or(-1)
}

/// `computeflux_decisions_total` of `reason` in `s` (0 when absent).
pub fn decisions(s: &Stats, reason: &str) -> i64 {
    s.get(&format!(
        "wasmcustom.computeflux_decisions_total.reason.{reason}"
    ))
    .copied()
    .unwrap_or(0)
}

pub fn computeflux_stats(admin_port: u16) -> std::collections::BTreeMap<String, i64> {
    let body = http::get(admin_port, "/stats?format=json&filter=computeflux_").body;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["stats"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| Some((s["name"].as_str()?.to_string(), s["value"].as_i64()?)))
        .collect()
}
