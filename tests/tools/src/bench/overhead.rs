//! Overhead: what the filter costs per request, measured with `wrk` against Envoy with and
//! without the filter in front of the same fast upstream.
//!
//! Why: the routing gains are only worth having if the filter's per-request cost is small next
//! to Envoy's own, and a user deciding between this filter and any other body-routing wasm
//! filter wants to know how much of that cost is the filter's own logic. Five Envoys run side by
//! side in front of the same upstream (see [`ROUTES`]): no wasm; the *floor*
//! (`examples/floor_filter.rs`: pause the headers, buffer the body, set one routing header,
//! nothing else: what any proxy-wasm filter that routes on the body pays); the filter; the
//! filter with `usage_accounting: false`; and the filter with `usage_accounting: false` and
//! `quota_aware: false`. So: floor − no wasm = the cost of being a body-routing wasm filter,
//! filter − floor = computeflux's own logic, filter − the last two = reading every answer's usage
//! (and its quota headers). The upstream sends OpenAI quota headers on every answer (a budget no
//! run can spend), so that reading them is measured too.
//!
//! Each repetition ("round") runs every Envoy once (in an order rotated by one each round, so no
//! Envoy always runs right after the same other one), and differences are taken per round
//! ("paired"), so slow drifts of the shared machine's load cancel; the report gives the median of
//! the per-round differences and their min…max.
//!
//! Three figures per case: throughput with 16 keep-alive connections (closed loop, the whole
//! machine saturated: wrk, Envoy and the upstream share the CPUs), latency with one connection
//! (each request alone: p50 difference = added latency), and Envoy's own CPU time per request
//! (`/proc/<pid>/stat` around the throughput run), which is the least noisy of the three.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};

use super::summary::quantile;
use super::support::MockUpstream;
use super::topology::{self, EnvoyProc, Policy, Setup};

#[derive(Clone, Debug)]
pub struct OverheadOpts {
    pub concurrencies: Vec<u32>,
    pub throughput_s: u64,
    pub latency_s: u64,
    pub reps: usize,
    pub connections: u32,
    pub work_dir: PathBuf,
}

/// One measured wrk run.
#[derive(Clone, Debug, Default)]
pub struct WrkRun {
    pub requests: u64,
    pub rps: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub errors: u64,
    /// Envoy CPU µs per request during the run.
    pub envoy_cpu_us: Option<f64>,
}

/// Medians over the repetitions of one (concurrency, body, route) case.
#[derive(Clone, Debug, Default)]
pub struct Case {
    pub concurrency: u32,
    pub body: String,
    pub body_bytes: usize,
    /// One of [`ROUTES`].
    pub route: String,
    pub rps: f64,
    pub rps_runs: Vec<f64>,
    /// From the throughput runs (16 connections).
    pub loaded_p50_us: f64,
    pub loaded_p99_us: f64,
    /// From the one-connection runs.
    pub p50_us: f64,
    pub p99_us: f64,
    pub p50_runs: Vec<f64>,
    pub envoy_cpu_us: f64,
    /// Per round, in round order (pair them with another route's to difference them).
    pub cpu_runs: Vec<f64>,
    /// Envoy CPU per request in the one-connection runs (no batching across requests).
    pub envoy_cpu_us_one_conn: f64,
    pub cpu_one_conn_runs: Vec<f64>,
    pub errors: u64,
}

/// The Envoys measured, in report order: name and what it runs.
pub const ROUTES: [(&str, &str); 5] = [
    ("no_wasm", "no wasm filter: a static route to one cluster"),
    (
        "floor",
        "the floor module (`examples/floor_filter.rs`): pauses the headers, buffers the body, copies it into the module, sets the routing header to a fixed cluster; nothing else",
    ),
    (
        "filter",
        "the computeflux filter (defaults: usage accounting and quota-aware routing on) choosing among four endpoint clusters",
    ),
    (
        "filter_no_usage",
        "the filter with `usage_accounting: false` (answers' usage not read)",
    ),
    (
        "filter_no_usage_quota",
        "the filter with `usage_accounting: false` and `quota_aware: false` (neither answers' usage nor their quota headers read)",
    ),
];

/// The mock's quota: far more than any run can spend, so that every answer carries OpenAI's
/// `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` headers and no endpoint runs short.
const QUOTA_ARGS: [&str; 6] = [
    "--quota-requests",
    "100000000000",
    "--quota-tokens",
    "100000000000",
    "--quota-window-ms",
    "3600000",
];

pub(super) const LUA_DONE: &str = r#"
done = function(summary, latency, requests)
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,"err_connect":%d,"err_read":%d,"err_write":%d,"err_status":%d,"err_timeout":%d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), summary.errors.connect, summary.errors.read, summary.errors.write,
    summary.errors.status, summary.errors.timeout))
end
"#;

/// A chat body of about `bytes` bytes (one user message).
fn body(bytes: usize) -> String {
    let base =
        json!({"model": "m1", "messages": [{"role": "user", "content": ""}], "max_tokens": 1})
            .to_string()
            .len();
    let fill = bytes.saturating_sub(base).max(8);
    let content: String = "lorem ipsum dolor sit amet "
        .chars()
        .cycle()
        .take(fill)
        .collect();
    json!({"model": "m1", "messages": [{"role": "user", "content": content}], "max_tokens": 1})
        .to_string()
}

fn lua_script(dir: &Path, name: &str, body: &str) -> Result<PathBuf, String> {
    let path = dir.join(format!("post-{name}.lua"));
    let text = format!(
        "wrk.method = \"POST\"\nwrk.headers[\"content-type\"] = \"application/json\"\n\
         wrk.headers[\"x-session-id\"] = \"overhead-bench\"\nwrk.body = [==[{body}]==]\n{LUA_DONE}"
    );
    std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(path)
}

pub(super) fn wrk(
    port: u16,
    script: &Path,
    threads: u32,
    conns: u32,
    secs: u64,
) -> Result<WrkRun, String> {
    let out = Command::new("wrk")
        .args(["-t", &threads.to_string(), "-c", &conns.to_string()])
        .args(["-d", &format!("{secs}s"), "--timeout", "5s", "-s"])
        .arg(script)
        .arg(format!("http://127.0.0.1:{port}/v1/chat/completions"))
        .output()
        .map_err(|e| format!("running wrk: {e} (is wrk installed? scripts/bench installs it)"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("WRKJSON "))
        .ok_or_else(|| format!("wrk printed no summary: {stdout}"))?;
    let v: Value = serde_json::from_str(line).map_err(|e| format!("wrk summary {line}: {e}"))?;
    let n = |k: &str| v.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
    let requests = n("requests") as u64;
    let duration_s = n("duration_us") / 1e6;
    let errors = [
        "err_connect",
        "err_read",
        "err_write",
        "err_status",
        "err_timeout",
    ]
    .iter()
    .map(|k| n(k) as u64)
    .sum();
    Ok(WrkRun {
        requests,
        rps: requests as f64 / duration_s,
        p50_us: n("p50_us"),
        p99_us: n("p99_us"),
        errors,
        envoy_cpu_us: None,
    })
}

pub(super) fn clock_ticks_per_s() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

fn median(v: &[f64]) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return f64::NAN;
    }
    if s.len() % 2 == 1 {
        quantile(&s, 0.5)
    } else {
        let hi = s.len() / 2;
        (s.get(hi - 1).copied().unwrap_or(f64::NAN) + s.get(hi).copied().unwrap_or(f64::NAN)) / 2.0
    }
}

/// CPU µs per request of `e` over a run that started at `before` ticks.
pub(super) fn cpu_per_request(
    e: &EnvoyProc,
    before: Option<u64>,
    requests: u64,
    tck: f64,
) -> Option<f64> {
    let (a, b) = (before?, e.cpu_ticks()?);
    Some(b.saturating_sub(a) as f64 / tck * 1e6 / requests.max(1) as f64)
}

/// Runs the whole overhead matrix. `floor` is the floor module (`examples/floor_filter.rs`).
pub fn run(opts: &OverheadOpts, wasm: &Path, floor: &Path) -> Result<Vec<Case>, String> {
    std::fs::create_dir_all(&opts.work_dir).map_err(|e| e.to_string())?;
    let args: Vec<String> = [
        "--prefill-us-per-token",
        "0",
        "--decode-ms",
        "0",
        "--history",
        "0",
    ]
    .iter()
    .chain(QUOTA_ARGS.iter())
    .map(|s| s.to_string())
    .collect();
    let upstream = MockUpstream::start(
        "fast",
        &[],
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    topology::record_pid(upstream.pid());
    let tck = clock_ticks_per_s();
    let bodies = [("small", body(300)), ("32KB", body(32 * 1024))];
    let mut cases = Vec::new();
    for &conc in &opts.concurrencies {
        // The filter sees four endpoints (all the same fast upstream) so that selection does
        // its real work; the baseline routes statically to one cluster.
        let eps: [(&str, &[&str]); 4] = [("f1", &[]), ("f2", &[]), ("f3", &[]), ("f4", &[])];
        let hosts: Vec<(&str, &[&str], u16)> =
            eps.iter().map(|(n, m)| (*n, *m, upstream.port)).collect();
        let mut plain_cfg = super::support::EnvoyConfig {
            concurrency: conc,
            with_filter: false,
            log_level: "warn".into(),
            ..Default::default()
        };
        plain_cfg.clusters = vec![("upstream".into(), upstream.port)];
        let plain_boot = super::support::render_bootstrap(&plain_cfg, wasm, 0, 0);
        // Every filter variant: the same bootstrap, plugin keys on top.
        let filter_boot = |extra: Value| {
            topology::bootstrap(
                &Setup {
                    policy: Policy::Filter,
                    hosts: &hosts,
                    concurrency: conc,
                    envoy_retries: false,
                    open_ms: 30_000,
                    plugin_extra: extra,
                },
                wasm,
            )
        };
        // The floor: the same listener, route (on the routing header) and clusters.
        let floor_cfg = super::support::EnvoyConfig {
            concurrency: conc,
            log_level: "warn".into(),
            plugin_config: json!({"cluster": "ep_f1"}),
            clusters: hosts
                .iter()
                .map(|(n, _, p)| (format!("ep_{n}"), *p))
                .collect(),
            ..Default::default()
        };
        let floor_boot = super::support::render_bootstrap(&floor_cfg, floor, 0, 0);
        // The filter config has no models: any model is served by every endpoint.
        let envoys = [
            EnvoyProc::start(&plain_boot, conc, "overhead-plain")?,
            EnvoyProc::start(&floor_boot, conc, "overhead-floor")?,
            EnvoyProc::start(&filter_boot(Value::Null)?, conc, "overhead-filter")?,
            EnvoyProc::start(
                &filter_boot(json!({"usage_accounting": false}))?,
                conc,
                "overhead-filter-no-usage",
            )?,
            EnvoyProc::start(
                &filter_boot(json!({"usage_accounting": false, "quota_aware": false}))?,
                conc,
                "overhead-filter-no-usage-quota",
            )?,
        ];
        let routes: Vec<(&str, &EnvoyProc)> = ROUTES
            .iter()
            .map(|(name, _)| *name)
            .zip(envoys.iter())
            .collect();
        for (bname, b) in &bodies {
            let script = lua_script(&opts.work_dir, bname, b)?;
            // Warm-up: connections, V8 tiers, the upstream's cache.
            for (_, e) in &routes {
                wrk(e.port, &script, 1, opts.connections, 1)?;
            }
            let mut tput: Vec<Vec<WrkRun>> = vec![Vec::new(); routes.len()];
            let mut lat: Vec<Vec<WrkRun>> = vec![Vec::new(); routes.len()];
            for round in 0..opts.reps {
                // Rotated order: round r starts with route r (mod the number of routes).
                let order: Vec<usize> = (0..routes.len())
                    .map(|k| (k + round) % routes.len())
                    .collect();
                for &i in &order {
                    let Some((_, e)) = routes.get(i) else {
                        continue;
                    };
                    let before = e.cpu_ticks();
                    let mut r = wrk(e.port, &script, 1, opts.connections, opts.throughput_s)?;
                    r.envoy_cpu_us = cpu_per_request(e, before, r.requests, tck);
                    if let Some(v) = tput.get_mut(i) {
                        v.push(r);
                    }
                }
                for &i in &order {
                    let Some((_, e)) = routes.get(i) else {
                        continue;
                    };
                    let before = e.cpu_ticks();
                    let mut r = wrk(e.port, &script, 1, 1, opts.latency_s)?;
                    r.envoy_cpu_us = cpu_per_request(e, before, r.requests, tck);
                    if let Some(v) = lat.get_mut(i) {
                        v.push(r);
                    }
                }
            }
            for (i, (rname, _)) in routes.iter().enumerate() {
                let t = tput.get(i).cloned().unwrap_or_default();
                let l = lat.get(i).cloned().unwrap_or_default();
                let m = |f: &dyn Fn(&WrkRun) -> f64, runs: &[WrkRun]| {
                    median(&runs.iter().map(f).collect::<Vec<_>>())
                };
                let case = Case {
                    concurrency: conc,
                    body: bname.to_string(),
                    body_bytes: b.len(),
                    route: rname.to_string(),
                    rps: m(&|r| r.rps, &t),
                    rps_runs: t.iter().map(|r| r.rps.round()).collect(),
                    loaded_p50_us: m(&|r| r.p50_us, &t),
                    loaded_p99_us: m(&|r| r.p99_us, &t),
                    p50_us: m(&|r| r.p50_us, &l),
                    p99_us: m(&|r| r.p99_us, &l),
                    p50_runs: l.iter().map(|r| r.p50_us).collect(),
                    envoy_cpu_us: m(&|r| r.envoy_cpu_us.unwrap_or(f64::NAN), &t),
                    cpu_runs: t
                        .iter()
                        .map(|r| round1(r.envoy_cpu_us.unwrap_or(f64::NAN)))
                        .collect(),
                    envoy_cpu_us_one_conn: m(&|r| r.envoy_cpu_us.unwrap_or(f64::NAN), &l),
                    cpu_one_conn_runs: l
                        .iter()
                        .map(|r| round1(r.envoy_cpu_us.unwrap_or(f64::NAN)))
                        .collect(),
                    errors: t.iter().chain(&l).map(|r| r.errors).sum(),
                };
                eprintln!(
                    "bench: overhead conc={conc} body={bname} {rname}: {:.0} req/s, p50 {:.0} µs (1 conn), envoy cpu {:.1} µs/req ({:.1} with 1 conn), errors {}",
                    case.rps, case.p50_us, case.envoy_cpu_us, case.envoy_cpu_us_one_conn, case.errors
                );
                cases.push(case);
            }
        }
        drop(routes);
        drop(envoys);
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(cases)
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

fn num(x: f64) -> Value {
    if x.is_finite() {
        json!((x * 10.0).round() / 10.0)
    } else {
        Value::Null
    }
}

impl Case {
    pub fn to_json(&self) -> Value {
        json!({
            "concurrency": self.concurrency,
            "body": self.body,
            "body_bytes": self.body_bytes,
            "route": self.route,
            "requests_per_s": num(self.rps),
            "requests_per_s_runs": self.rps_runs,
            "loaded_latency_us": {"p50": num(self.loaded_p50_us), "p99": num(self.loaded_p99_us)},
            "latency_us_one_connection": {"p50": num(self.p50_us), "p99": num(self.p99_us)},
            "p50_us_runs": self.p50_runs,
            "envoy_cpu_us_per_request": num(self.envoy_cpu_us),
            "envoy_cpu_us_per_request_runs": self.cpu_runs.iter().map(|x| num(*x)).collect::<Vec<_>>(),
            "envoy_cpu_us_per_request_one_connection": num(self.envoy_cpu_us_one_conn),
            "envoy_cpu_us_per_request_one_connection_runs": self.cpu_one_conn_runs.iter().map(|x| num(*x)).collect::<Vec<_>>(),
            "errors": self.errors,
        })
    }

    /// The inverse of [`Case::to_json`].
    pub fn from_json(v: &Value) -> Case {
        let f = |p: &str| v.pointer(p).and_then(Value::as_f64).unwrap_or(f64::NAN);
        let list = |p: &str| {
            v.pointer(p)
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(Value::as_f64).collect())
                .unwrap_or_default()
        };
        // Per-round values keep their position (a missing one is NaN) so rounds stay paired.
        let runs = |p: &str| {
            v.pointer(p)
                .and_then(Value::as_array)
                .map(|a| a.iter().map(|x| x.as_f64().unwrap_or(f64::NAN)).collect())
                .unwrap_or_default()
        };
        let st = |p: &str| {
            v.pointer(p)
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string()
        };
        Case {
            concurrency: v.get("concurrency").and_then(Value::as_u64).unwrap_or(0) as u32,
            body: st("/body"),
            body_bytes: v.get("body_bytes").and_then(Value::as_u64).unwrap_or(0) as usize,
            route: st("/route"),
            rps: f("/requests_per_s"),
            rps_runs: list("/requests_per_s_runs"),
            loaded_p50_us: f("/loaded_latency_us/p50"),
            loaded_p99_us: f("/loaded_latency_us/p99"),
            p50_us: f("/latency_us_one_connection/p50"),
            p99_us: f("/latency_us_one_connection/p99"),
            p50_runs: list("/p50_us_runs"),
            envoy_cpu_us: f("/envoy_cpu_us_per_request"),
            cpu_runs: runs("/envoy_cpu_us_per_request_runs"),
            envoy_cpu_us_one_conn: f("/envoy_cpu_us_per_request_one_connection"),
            cpu_one_conn_runs: runs("/envoy_cpu_us_per_request_one_connection_runs"),
            errors: v.get("errors").and_then(Value::as_u64).unwrap_or(0),
        }
    }
}
