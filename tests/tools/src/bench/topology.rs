//! What runs in a bench: the mock endpoints, the Envoy bootstrap of each policy, and an Envoy
//! process started from a bootstrap text.
//!
//! Why its own Envoy launcher: the test harness (`tests/support`) renders one bootstrap shape,
//! one single-host cluster per endpoint. Envoy's own balancers need clusters holding several
//! hosts with an `lb_policy`, so the bench renders the harness's bootstrap and reshapes its
//! clusters (everything else, listener, buffers, circuit-breaker thresholds, stays identical),
//! then starts Envoy itself.
//!
//! Envoy's balancers get one cluster per model, holding only the hosts that serve it, as an
//! operator who knows the fleet would configure them: a small Lua filter reads the body's
//! `model` and names the cluster in a header (see [`model_lua`]). The client sends exactly the
//! same requests to every policy; without this split a request for a model that only some
//! hosts serve lands on a host that answers 404.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use super::support::{self, EnvoyConfig};

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
    /// The filter with its defaults, scraping every mock engine's `/metrics`.
    Filter,
    /// The filter with `"prefix_placement": false` (issue 20: the feature on against off in one
    /// run).
    FilterNoPrefix,
    /// The SGLang gateway's `cache_aware` policy behind the same Envoy (see `peer.rs`).
    SglangCacheAware,
    /// The filter without `metrics`: it sees only its own traffic (a hosted-API fleet).
    FilterNoMetrics,
    /// The filter with every latency rule off (degraded and pin breaking):
    /// what "moves no session in steady traffic" is measured against.
    FilterRulesOff,
    /// The filter with a tighter bounded load (`"tuning": {"bounded_load_epsilon": 0.25}`).
    FilterEps25,
    /// The filter with a tighter bounded load (`"tuning": {"bounded_load_epsilon": 0.15}`).
    FilterEps15,
    /// The filter with `"pin_cookie": false`: as if clients kept no cookies, nothing travels
    /// with a session and each replica computes a turn's place from what it sees itself (the
    /// rule-off run of the pin cookie, docs/adr/0018).
    FilterNoCookie,
}

impl Policy {
    /// The policies a run compares by default.
    pub const ALL: [Policy; 5] = [
        Policy::RoundRobin,
        Policy::LeastRequest,
        Policy::RingHash,
        Policy::Maglev,
        Policy::Filter,
    ];

    /// Every policy `--policies` accepts, in the report's order (the default set first).
    pub const KNOWN: [Policy; 12] = [
        Policy::RoundRobin,
        Policy::LeastRequest,
        Policy::RingHash,
        Policy::Maglev,
        Policy::Filter,
        Policy::FilterNoPrefix,
        Policy::SglangCacheAware,
        Policy::FilterNoMetrics,
        Policy::FilterRulesOff,
        Policy::FilterEps25,
        Policy::FilterEps15,
        Policy::FilterNoCookie,
    ];

    pub fn name(&self) -> &'static str {
        match self {
            Policy::RoundRobin => "round_robin",
            Policy::LeastRequest => "least_request",
            Policy::RingHash => "ring_hash",
            Policy::Maglev => "maglev",
            Policy::Filter => "computeflux",
            Policy::FilterNoPrefix => "computeflux_noprefix",
            Policy::SglangCacheAware => "sglang_cache_aware",
            Policy::FilterNoMetrics => "computeflux_nometrics",
            Policy::FilterRulesOff => "computeflux_rulesoff",
            Policy::FilterEps25 => "computeflux_eps25",
            Policy::FilterEps15 => "computeflux_eps15",
            Policy::FilterNoCookie => "computeflux_nocookie",
        }
    }

    pub fn parse(s: &str) -> Option<Policy> {
        Policy::KNOWN
            .into_iter()
            .find(|p| p.name() == s || (s == "filter" && *p == Policy::Filter))
    }

    /// One of the filter's variants.
    pub fn is_filter(&self) -> bool {
        self.lb_policy().is_none()
    }

    /// Run in the replicated topology: the policies that promise stickiness or place by prefix.
    pub fn replicable(&self) -> bool {
        matches!(
            self,
            Policy::RingHash | Policy::Maglev | Policy::SglangCacheAware
        ) || self.is_filter()
    }

    /// Envoy's `lb_policy` of the policy; None: one of the filter's variants.
    pub fn lb_policy(&self) -> Option<&'static str> {
        match self {
            Policy::RoundRobin => Some("ROUND_ROBIN"),
            Policy::LeastRequest => Some("LEAST_REQUEST"),
            Policy::RingHash => Some("RING_HASH"),
            Policy::Maglev => Some("MAGLEV"),
            // Envoy round-robins over the model's routers (one per replica slot).
            Policy::SglangCacheAware => Some("ROUND_ROBIN"),
            Policy::Filter
            | Policy::FilterNoPrefix
            | Policy::FilterNoMetrics
            | Policy::FilterRulesOff
            | Policy::FilterEps25
            | Policy::FilterEps15
            | Policy::FilterNoCookie => None,
        }
    }

    /// The variant's filter configuration keys on top of [`plugin_config`]'s.
    pub fn plugin_extra(&self) -> Value {
        match self {
            // Degraded and pin breaking need a slowness of 1000× the peers' median.
            Policy::FilterRulesOff => json!({"tuning": {"pin_break_ratio": 1000.0}}),
            Policy::FilterNoPrefix => json!({"prefix_placement": false}),
            Policy::FilterEps25 => json!({"tuning": {"bounded_load_epsilon": 0.25}}),
            Policy::FilterEps15 => json!({"tuning": {"bounded_load_epsilon": 0.15}}),
            Policy::FilterNoCookie => json!({"pin_cookie": false}),
            _ => Value::Null,
        }
    }

    /// Whether the variant's endpoints get a `metrics` object (see [`plugin_config`]).
    pub fn scrapes(&self) -> bool {
        matches!(
            self,
            Policy::Filter
                | Policy::FilterRulesOff
                | Policy::FilterNoPrefix
                | Policy::FilterEps25
                | Policy::FilterEps15
                | Policy::FilterNoCookie
        )
    }
}

/// The mock engines' `/metrics` dialect (the mock's `--metrics-format` default).
pub const METRICS_FORMAT: &str = "vllm";
/// How often the filter scrapes each mock engine: `BENCH_METRICS_INTERVAL_MS` from the
/// environment (100..=60000) for an experiment with another interval (the run's `results.md`
/// shows the plugin config); unset, the config leaves `interval_ms` out and the bench measures
/// the filter's default (`metrics.interval_ms`, 250 ms).
pub fn metrics_interval_ms() -> Option<u64> {
    std::env::var("BENCH_METRICS_INTERVAL_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|v| (100..=60_000).contains(v))
}

/// The filter's configuration for these endpoints (one Envoy cluster `ep_<name>` each; no
/// models: the endpoint serves any model). With `metrics`, every endpoint is scraped as the
/// engine it is (format [`METRICS_FORMAT`], at the filter's default interval unless
/// [`metrics_interval_ms`] says otherwise).
pub fn plugin_config(endpoints: &[(&str, &[&str])], open_ms: u64, metrics: bool) -> Value {
    let eps: Vec<Value> = endpoints
        .iter()
        .map(|(name, models)| {
            let mut e = json!({"name": name, "cluster": format!("ep_{name}")});
            if let Some(o) = e.as_object_mut() {
                if !models.is_empty() {
                    o.insert("models".into(), json!(models));
                }
                if metrics {
                    let mut m = json!({"format": METRICS_FORMAT});
                    if let (Some(ms), Some(mo)) = (metrics_interval_ms(), m.as_object_mut()) {
                        mo.insert("interval_ms".into(), json!(ms));
                    }
                    o.insert("metrics".into(), m);
                }
            }
            e
        })
        .collect();
    // The workload's clients keep each conversation's cookies (one client per conversation),
    // and `pin_cookie` is on by default (docs/routing.md#after-a-failover).
    json!({
        "endpoints": eps,
        "session_header": super::workload::SESSION_HEADER,
        "open_ms": open_ms,
    })
}

/// Puts the filter configuration keys of `extra` into `into`, later over earlier; the keys of
/// an object both hold (`tuning`) are merged the same way, so that a scenario's tuning keys and
/// a variant's add up.
pub fn merge_keys(
    into: &mut serde_json::Map<String, Value>,
    extra: &serde_json::Map<String, Value>,
) {
    for (k, v) in extra {
        match (into.get_mut(k), v) {
            (Some(Value::Object(old)), Value::Object(new)) => {
                old.extend(new.iter().map(|(a, b)| (a.clone(), b.clone())));
            }
            _ => {
                into.insert(k.clone(), v.clone());
            }
        }
    }
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
    /// Filter configuration keys added for this run (an object, or `Value::Null`).
    pub plugin_extra: Value,
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
            cfg.plugin_config = plugin_config(&eps, setup.open_ms, setup.policy.scrapes());
            // The variant's keys, then the run's (scenario and command line) on top.
            for extra in [&setup.policy.plugin_extra(), &setup.plugin_extra] {
                if let (Some(p), Some(extra)) =
                    (cfg.plugin_config.as_object_mut(), extra.as_object())
                {
                    merge_keys(p, extra);
                }
            }
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
            cfg.clusters = vec![("template".into(), first)];
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
            let text = model_clusters(&text, lb, setup.hosts)?;
            if setup.policy == Policy::SglangCacheAware {
                // Which router answered, for the per-request records.
                replica_header(&text)
            } else {
                Ok(text)
            }
        }
    }
}

/// `bootstrap` whose responses carry `x-bench-replica`: the upstream (router) that answered.
fn replica_header(bootstrap: &str) -> Result<String, String> {
    let mut v: Value = serde_json::from_str(bootstrap).map_err(|e| format!("bootstrap: {e}"))?;
    let rc = v
        .pointer_mut(
            "/static_resources/listeners/0/filter_chains/0/filters/0/typed_config/route_config",
        )
        .and_then(Value::as_object_mut)
        .ok_or("bootstrap has no route_config")?;
    rc.insert(
        "response_headers_to_add".into(),
        json!([{"header": {"key": "x-bench-replica", "value": "%UPSTREAM_REMOTE_ADDRESS%"}}]),
    );
    serde_json::to_string_pretty(&v).map_err(|e| e.to_string())
}

/// The request header [`model_lua`] sets for Envoy's balancers: the cluster of the body's model.
pub const MODEL_CLUSTER_HEADER: &str = "x-bench-model-cluster";

/// The cluster of Envoy's balancers that holds the hosts serving `model`.
pub fn model_cluster(model: &str) -> String {
    format!("model_{model}")
}

/// The Lua filter in front of Envoy's balancers: reads the (buffered) request body, takes the
/// top-level `"model"` string and names its cluster (see [`model_cluster`]) in
/// [`MODEL_CLUSTER_HEADER`] (Lua's header change clears the route cache, so the route's
/// `cluster_header` sees it). A pattern match, not a JSON parser: inside a JSON string every `"`
/// is escaped, so `"model": "…"` only matches a key, and the bench's bodies have no nested
/// `model` keys. No model: no header, and Envoy answers 503 (no cluster).
pub fn model_lua() -> String {
    format!(
        r#"function envoy_on_request(handle)
  local body = handle:body()
  if body == nil then return end
  local model = string.match(body:getBytes(0, body:length()), '"model"%s*:%s*"([^"]+)"')
  if model ~= nil then
    handle:headers():replace("{MODEL_CLUSTER_HEADER}", "{}" .. model)
  end
end
"#,
        model_cluster("")
    )
}

/// Rewrites the single (template) cluster of a rendered bootstrap into one cluster per model with
/// `lb_policy`, each holding the hosts that serve the model; the route takes the cluster from
/// [`MODEL_CLUSTER_HEADER`], which the [`model_lua`] filter sets.
fn model_clusters(
    text: &str,
    lb_policy: &str,
    hosts: &[(&str, &[&str], u16)],
) -> Result<String, String> {
    let mut v: Value = serde_json::from_str(text).map_err(|e| format!("bootstrap: {e}"))?;
    let template = v
        .pointer("/static_resources/clusters/0")
        .cloned()
        .ok_or("bootstrap has no cluster")?;
    let mut models: Vec<&str> = hosts.iter().flat_map(|h| h.1.iter().copied()).collect();
    models.sort_unstable();
    models.dedup();
    let clusters: Vec<Value> = models
        .iter()
        .map(|model| {
            let ports: Vec<u16> = hosts
                .iter()
                .filter(|h| h.1.contains(model))
                .map(|h| h.2)
                .collect();
            pool(&template, &model_cluster(model), lb_policy, &ports)
        })
        .collect::<Result<_, _>>()?;
    *v.pointer_mut("/static_resources/clusters")
        .ok_or("bootstrap has no clusters")? = Value::Array(clusters);
    let hcm = "/static_resources/listeners/0/filter_chains/0/filters/0/typed_config";
    let route = v
        .pointer_mut(&format!(
            "{hcm}/route_config/virtual_hosts/0/routes/0/route"
        ))
        .and_then(Value::as_object_mut)
        .ok_or("bootstrap has no route")?;
    route.remove("cluster");
    route.insert("cluster_header".into(), json!(MODEL_CLUSTER_HEADER));
    let filters = v
        .pointer_mut(&format!("{hcm}/http_filters"))
        .and_then(Value::as_array_mut)
        .ok_or("bootstrap has no http_filters")?;
    filters.insert(
        0,
        json!({
            "name": "envoy.filters.http.lua",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
                "default_source_code": {"inline_string": model_lua()},
            },
        }),
    );
    serde_json::to_string_pretty(&v).map_err(|e| e.to_string())
}

/// `template` (a rendered cluster) renamed to `name`, holding every port of `ports`, with
/// `lb_policy`.
fn pool(template: &Value, name: &str, lb_policy: &str, ports: &[u16]) -> Result<Value, String> {
    let mut c = template.clone();
    let o = c.as_object_mut().ok_or("cluster is not an object")?;
    let lb_endpoints: Vec<Value> = ports
        .iter()
        .map(|p| {
            json!({"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}})
        })
        .collect();
    o.insert("name".into(), json!(name));
    o.insert("lb_policy".into(), json!(lb_policy));
    o.insert(
        "load_assignment".into(),
        json!({"cluster_name": name, "endpoints": [{"lb_endpoints": lb_endpoints}]}),
    );
    Ok(c)
}

/// The front Envoy of the replicated topology: no filter, one cluster of the replicas'
/// listeners with Envoy's round robin, and the route retry that lets a replica restart without
/// a client error (`connect-failure`, on another replica). Its idle upstream connections close
/// after [`FRONT_IDLE_TIMEOUT`], so a drained replica is left without connections soon after
/// its listener closes.
pub fn front_bootstrap(replica_ports: &[u16], concurrency: u32) -> Result<String, String> {
    let mut cfg = EnvoyConfig {
        concurrency,
        log_level: "warn".into(),
        with_filter: false,
        clusters: vec![(
            "replicas".into(),
            replica_ports.first().copied().unwrap_or(0),
        )],
        ..EnvoyConfig::default()
    };
    cfg.route_extra = json!({"retry_policy": front_retry_policy()});
    let text = support::render_bootstrap(&cfg, Path::new(""), 0, 0);
    let mut v: Value = serde_json::from_str(&text).map_err(|e| format!("bootstrap: {e}"))?;
    let cluster = v
        .pointer_mut("/static_resources/clusters/0")
        .ok_or("bootstrap has no cluster")?;
    let mut c = pool(cluster, "replicas", "ROUND_ROBIN", replica_ports)?;
    if let Some(o) = c.as_object_mut() {
        o.insert(
            "common_http_protocol_options".into(),
            json!({"idle_timeout": FRONT_IDLE_TIMEOUT}),
        );
    }
    *cluster = c;
    // Which replica served each request, for the raw per-request records.
    if let Some(rc) = v.pointer_mut(
        "/static_resources/listeners/0/filter_chains/0/filters/0/typed_config/route_config",
    ) {
        if let Some(o) = rc.as_object_mut() {
            o.insert(
                "response_headers_to_add".into(),
                json!([{"header": {"key": "x-bench-replica", "value": "%UPSTREAM_REMOTE_ADDRESS%"}}]),
            );
        }
    }
    serde_json::to_string_pretty(&v).map_err(|e| e.to_string())
}

/// Idle timeout of the front Envoy's connections to the replicas.
pub const FRONT_IDLE_TIMEOUT: &str = "1s";

/// The front Envoy's route retry: a refused connection (a replica that is restarting) is retried
/// on another replica. Nothing else is retried there: the replicas' own policies handle the
/// endpoints' faults.
pub fn front_retry_policy() -> Value {
    json!({
        "retry_on": "connect-failure",
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

/// `bootstrap` with its listener bound to `port` (a restarted replica takes its old port back,
/// so the front Envoy's static cluster finds it again).
pub fn with_listener_port(bootstrap: &str, port: u16) -> Result<String, String> {
    let mut v: Value = serde_json::from_str(bootstrap).map_err(|e| format!("bootstrap: {e}"))?;
    *v.pointer_mut("/static_resources/listeners/0/address/socket_address/port_value")
        .ok_or("bootstrap has no listener")? = json!(port);
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
        EnvoyProc::start_with(bootstrap, concurrency, label, &[])
    }

    /// [`EnvoyProc::start`] with more command-line flags (e.g. `--drain-time-s 1`).
    pub fn start_with(
        bootstrap: &str,
        concurrency: u32,
        label: &str,
        extra_args: &[String],
    ) -> Result<EnvoyProc, String> {
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
            .args(extra_args)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ports(cluster: &Value) -> Vec<u64> {
        cluster
            .pointer("/load_assignment/endpoints/0/lb_endpoints")
            .and_then(Value::as_array)
            .unwrap()
            .iter()
            .map(|e| {
                e.pointer("/endpoint/address/socket_address/port_value")
                    .and_then(Value::as_u64)
                    .unwrap()
            })
            .collect()
    }

    #[test]
    fn balancers_get_one_cluster_per_model_with_only_its_hosts_and_the_lua_filter() {
        let hosts: Vec<(&str, &[&str], u16)> = ENDPOINTS
            .iter()
            .take(4)
            .zip([1001u16, 1002, 1003, 1004])
            .map(|((n, m), p)| (*n, *m, p))
            .collect();
        let setup = Setup {
            policy: Policy::RingHash,
            hosts: &hosts,
            concurrency: 1,
            envoy_retries: true,
            open_ms: 3000,
            plugin_extra: Value::Null,
        };
        let v: Value = serde_json::from_str(&bootstrap(&setup, Path::new("")).unwrap()).unwrap();
        let clusters = v.pointer("/static_resources/clusters").unwrap();
        let by_name = |n: &str| {
            clusters
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c.get("name").and_then(Value::as_str) == Some(n))
                .unwrap()
                .clone()
        };
        assert_eq!(clusters.as_array().unwrap().len(), 2);
        assert_eq!(ports(&by_name("model_m1")), [1001, 1002, 1003, 1004]);
        assert_eq!(ports(&by_name("model_m2")), [1001, 1002]);
        assert_eq!(by_name("model_m2")["lb_policy"], "RING_HASH");
        let hcm = v
            .pointer("/static_resources/listeners/0/filter_chains/0/filters/0/typed_config")
            .unwrap();
        let route = hcm
            .pointer("/route_config/virtual_hosts/0/routes/0/route")
            .unwrap();
        assert_eq!(route["cluster_header"], MODEL_CLUSTER_HEADER);
        assert!(route.get("cluster").is_none());
        assert!(route.get("hash_policy").is_some() && route.get("retry_policy").is_some());
        assert_eq!(hcm["http_filters"][0]["name"], "envoy.filters.http.lua");
        let lua = model_lua();
        assert!(
            lua.contains(r#"replace("x-bench-model-cluster", "model_" .. model)"#),
            "{lua}"
        );
    }

    #[test]
    fn the_peer_gets_a_round_robin_cluster_of_its_routers_per_model() {
        // Three replica slots: three m1 routers, three m2 routers.
        let hosts: Vec<(&str, &[&str], u16)> = vec![
            ("sglang_m1_r0", &["m1"], 3001),
            ("sglang_m2_r0", &["m2"], 3002),
            ("sglang_m1_r1", &["m1"], 3003),
            ("sglang_m2_r1", &["m2"], 3004),
            ("sglang_m1_r2", &["m1"], 3005),
            ("sglang_m2_r2", &["m2"], 3006),
        ];
        let setup = Setup {
            policy: Policy::SglangCacheAware,
            hosts: &hosts,
            concurrency: 2,
            envoy_retries: true,
            open_ms: 3000,
            plugin_extra: Value::Null,
        };
        let v: Value = serde_json::from_str(&bootstrap(&setup, Path::new("")).unwrap()).unwrap();
        let clusters = v
            .pointer("/static_resources/clusters")
            .and_then(Value::as_array)
            .unwrap();
        let m1 = clusters.iter().find(|c| c["name"] == "model_m1").unwrap();
        let m2 = clusters.iter().find(|c| c["name"] == "model_m2").unwrap();
        assert_eq!(ports(m1), [3001, 3003, 3005]);
        assert_eq!(ports(m2), [3002, 3004, 3006]);
        assert_eq!(m1["lb_policy"], "ROUND_ROBIN");
        let rc = v
            .pointer(
                "/static_resources/listeners/0/filter_chains/0/filters/0/typed_config/route_config",
            )
            .unwrap();
        assert_eq!(
            rc["response_headers_to_add"][0]["header"]["key"],
            "x-bench-replica"
        );
        assert!(rc
            .pointer("/virtual_hosts/0/routes/0/route/hash_policy")
            .is_none());
        assert_eq!(
            Policy::parse("sglang_cache_aware"),
            Some(Policy::SglangCacheAware)
        );
        assert_eq!(
            Policy::parse("computeflux_noprefix"),
            Some(Policy::FilterNoPrefix)
        );
        assert!(Policy::SglangCacheAware.replicable() && Policy::FilterNoPrefix.replicable());
        assert!(
            !Policy::ALL.contains(&Policy::SglangCacheAware),
            "not in the default run"
        );
    }

    #[test]
    fn filter_variants_differ_only_in_metrics_and_the_latency_rules() {
        let hosts: Vec<(&str, &[&str], u16)> = vec![("a", &["m1"], 1001), ("b", &["m1"], 1002)];
        let config = |policy: Policy| -> Value {
            let setup = Setup {
                policy,
                hosts: &hosts,
                concurrency: 1,
                envoy_retries: true,
                open_ms: 3000,
                plugin_extra: json!({"open_ms": 5000}),
            };
            let boot: Value =
                serde_json::from_str(&bootstrap(&setup, Path::new("")).unwrap()).unwrap();
            // The plugin configuration: a JSON string at `…configuration.value`.
            fn find(v: &Value) -> Option<String> {
                match v {
                    Value::Object(o) => o
                        .get("configuration")
                        .and_then(|c| c.get("value"))
                        .and_then(Value::as_str)
                        .map(str::to_string)
                        .or_else(|| o.values().find_map(find)),
                    Value::Array(a) => a.iter().find_map(find),
                    _ => None,
                }
            }
            serde_json::from_str(&find(&boot).unwrap()).unwrap()
        };
        let on = config(Policy::Filter);
        assert_eq!(on["endpoints"][0]["metrics"]["format"], METRICS_FORMAT);
        assert_eq!(
            on["endpoints"][1]["metrics"].get("interval_ms").cloned(),
            metrics_interval_ms().map(|ms| json!(ms))
        );
        assert_eq!(on["open_ms"], 5000, "the run's keys apply on top");
        assert!(on.get("tuning").is_none());
        let off = config(Policy::FilterNoMetrics);
        assert!(off["endpoints"][0].get("metrics").is_none());
        let rules = config(Policy::FilterRulesOff);
        assert_eq!(rules["tuning"]["pin_break_ratio"], 1000.0);
        assert!(rules["endpoints"][0].get("metrics").is_some());
        assert_eq!(
            Policy::parse("computeflux_nometrics"),
            Some(Policy::FilterNoMetrics)
        );
        assert!(Policy::FilterRulesOff.replicable() && Policy::FilterRulesOff.is_filter());
        assert!(!Policy::ALL.contains(&Policy::FilterNoMetrics));
    }

    #[test]
    fn front_round_robins_over_the_replicas_and_a_restart_keeps_the_port() {
        let v: Value =
            serde_json::from_str(&front_bootstrap(&[2001, 2002, 2003], 1).unwrap()).unwrap();
        let c = v.pointer("/static_resources/clusters/0").unwrap();
        assert_eq!(c["lb_policy"], "ROUND_ROBIN");
        assert_eq!(ports(c), [2001, 2002, 2003]);
        let route = v
            .pointer("/static_resources/listeners/0/filter_chains/0/filters/0/typed_config/route_config/virtual_hosts/0/routes/0/route")
            .unwrap();
        assert_eq!(route["retry_policy"]["retry_on"], "connect-failure");
        let text = serde_json::to_string(&v).unwrap();
        let moved: Value = serde_json::from_str(&with_listener_port(&text, 2999).unwrap()).unwrap();
        assert_eq!(
            moved.pointer("/static_resources/listeners/0/address/socket_address/port_value"),
            Some(&json!(2999))
        );
    }
}
