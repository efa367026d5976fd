//! Overhead against fleet size: Envoy's CPU per request with the filter configured with N
//! endpoint clusters (`--overhead-endpoints 4,512`), beside plain Envoy, measured with `wrk`.
//!
//! Why: issue 21 asks that a request's cost not grow with the number of endpoints the filter
//! knows (a pool of a few hundred API keys or GPU instances is ordinary). The exact cost harness
//! (`tests/cost`) counts the module's own instructions; this is the same question asked of a
//! real Envoy, where the host's side of the work (shared-data copies, header maps, the wasm
//! runtime) counts too.
//!
//! How: one plain Envoy (no wasm, a static route to the upstream) and one Envoy per fleet size N,
//! each with the filter (defaults, no metrics scraping: the cost harness scrapes nothing either,
//! and a scrape per endpoint would charge background work to the requests) choosing among N
//! endpoint clusters that all point at the same fast upstream; and one Envoy per N with the floor
//! module (`examples/floor_filter.rs` with `"clusters": N`) spreading the requests over the same
//! N clusters by session: Envoy's own cost of routing among N clusters (a connection pool and
//! stats per cluster), which no filter can avoid, so that the filter's own share (filter/N −
//! floor/N) can be compared across fleet sizes too. Every Envoy runs with
//! `--concurrency 1`. wrk sends a small chat body with 8 connections, each request's session id
//! drawn from 2 000 ids (so the filter sees new sessions and affinity hits, as in issue 21's
//! measurement). Each round runs every Envoy once, the order rotated by one per round;
//! ratios (filter ÷ no wasm, N ÷ the smallest N) are taken per round ("paired"), so slow drifts
//! of the shared machine's load cancel, and the report gives their medians and min…max.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::overhead;
use super::support::MockUpstream;
use super::topology::{self, EnvoyProc, Policy, Setup};

#[derive(Clone, Debug)]
pub struct FleetOpts {
    /// Fleet sizes (endpoints the filter knows), ascending.
    pub endpoints: Vec<usize>,
    pub seconds: u64,
    pub reps: usize,
    pub connections: u32,
    /// Session ids drawn uniformly from this many.
    pub sessions: u32,
    pub work_dir: PathBuf,
}

/// One wrk run against one Envoy.
#[derive(Clone, Copy, Debug, Default)]
struct Run {
    rps: f64,
    cpu_us_per_request: f64,
    errors: u64,
}

/// Draws each request's session id; the `done` that prints the summary is the overhead
/// benchmark's ([`overhead::LUA_DONE`]).
const LUA: &str = r#"
math.randomseed(7)
request = function()
  wrk.headers["x-session-id"] = "fleet-" .. math.random(SESSIONS)
  return wrk.format()
end
"#;

fn script(dir: &Path, sessions: u32) -> Result<PathBuf, String> {
    let body = json!({"model": "m1", "messages": [{"role": "user", "content": "Say hello in one short sentence, please."}], "max_tokens": 1})
        .to_string();
    let path = dir.join("post-fleet.lua");
    let text = format!(
        "wrk.method = \"POST\"\nwrk.headers[\"content-type\"] = \"application/json\"\n\
         wrk.body = [==[{body}]==]\n{}{}",
        LUA.replace("SESSIONS", &sessions.to_string()),
        overhead::LUA_DONE
    );
    std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(path)
}

/// One wrk run (one thread) against `e`, with Envoy's CPU per request over it.
fn wrk(e: &EnvoyProc, script: &Path, conns: u32, secs: u64, tck: f64) -> Result<Run, String> {
    let before = e.cpu_ticks();
    let w = overhead::wrk(e.port, script, 1, conns, secs)?;
    Ok(Run {
        rps: w.rps,
        cpu_us_per_request: overhead::cpu_per_request(e, before, w.requests, tck)
            .unwrap_or(f64::NAN),
        errors: w.errors,
    })
}

/// Median and extremes of the finite values.
fn stats(v: &[f64]) -> (f64, f64, f64) {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    s.sort_by(f64::total_cmp);
    let (Some(lo), Some(hi)) = (s.first().copied(), s.last().copied()) else {
        return (f64::NAN, f64::NAN, f64::NAN);
    };
    let mid = s.len() / 2;
    let med = if s.len() % 2 == 1 {
        s.get(mid).copied().unwrap_or(f64::NAN)
    } else {
        (s.get(mid - 1).copied().unwrap_or(f64::NAN) + s.get(mid).copied().unwrap_or(f64::NAN))
            / 2.0
    };
    (med, lo, hi)
}

fn num(x: f64, scale: f64) -> Value {
    if x.is_finite() {
        json!((x * scale).round() / scale)
    } else {
        Value::Null
    }
}

fn stat_json(v: &[f64], scale: f64) -> Value {
    let (m, lo, hi) = stats(v);
    json!({"median": num(m, scale), "min": num(lo, scale), "max": num(hi, scale),
           "runs": v.iter().map(|x| num(*x, scale)).collect::<Vec<_>>()})
}

/// `/proc/loadavg`'s three load averages.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "?".into())
}

/// Runs the comparison; the result is the `overhead_fleet` JSON object (see [`markdown`]).
pub fn run(opts: &FleetOpts, wasm: &Path, floor: &Path) -> Result<Value, String> {
    std::fs::create_dir_all(&opts.work_dir).map_err(|e| e.to_string())?;
    let load_before = load_average();
    let upstream = MockUpstream::start(
        "fleet",
        &[],
        &[
            "--prefill-us-per-token",
            "0",
            "--decode-ms",
            "0",
            "--history",
            "0",
        ],
    );
    topology::record_pid(upstream.pid());
    let tck = overhead::clock_ticks_per_s();
    let names: Vec<String> = (0..opts.endpoints.iter().copied().max().unwrap_or(0))
        .map(|i| format!("f{i}"))
        .collect();
    let mut plain_cfg = super::support::EnvoyConfig {
        concurrency: 1,
        with_filter: false,
        log_level: "warn".into(),
        ..Default::default()
    };
    plain_cfg.clusters = vec![("upstream".into(), upstream.port)];
    let plain_boot = super::support::render_bootstrap(&plain_cfg, wasm, 0, 0);
    let mut envoys: Vec<(String, EnvoyProc)> = vec![(
        "no_wasm".into(),
        EnvoyProc::start(&plain_boot, 1, "fleet-plain")?,
    )];
    // The floor module spreading requests over the same N clusters by session: Envoy's own
    // cost of routing among N clusters, without the filter's logic.
    for &n in &opts.endpoints {
        let floor_cfg = super::support::EnvoyConfig {
            concurrency: 1,
            log_level: "warn".into(),
            plugin_config: json!({"cluster": "ep_f", "clusters": n}),
            clusters: names
                .iter()
                .take(n)
                .map(|name| (format!("ep_{name}"), upstream.port))
                .collect(),
            ..Default::default()
        };
        let boot = super::support::render_bootstrap(&floor_cfg, floor, 0, 0);
        envoys.push((
            format!("floor/{n}"),
            EnvoyProc::start(&boot, 1, &format!("fleet-floor-{n}"))?,
        ));
    }
    let floors = envoys.len();
    for &n in &opts.endpoints {
        let hosts: Vec<(&str, &[&str], u16)> = names
            .iter()
            .take(n)
            .map(|name| (name.as_str(), &[][..], upstream.port))
            .collect();
        let boot = topology::bootstrap(
            &Setup {
                policy: Policy::FilterNoMetrics,
                hosts: &hosts,
                concurrency: 1,
                envoy_retries: false,
                open_ms: 30_000,
                plugin_extra: Value::Null,
            },
            wasm,
        )?;
        envoys.push((
            format!("filter/{n}"),
            EnvoyProc::start(&boot, 1, &format!("fleet-filter-{n}"))?,
        ));
    }
    let script = script(&opts.work_dir, opts.sessions)?;
    // Warm-up: connections, the wasm runtime's tiers, the sessions' affinities.
    for (_, e) in &envoys {
        wrk(e, &script, opts.connections, 2, tck)?;
    }
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); envoys.len()];
    for round in 0..opts.reps {
        for k in 0..envoys.len() {
            let i = (k + round) % envoys.len();
            let Some((name, e)) = envoys.get(i) else {
                continue;
            };
            let r = wrk(e, &script, opts.connections, opts.seconds, tck)?;
            eprintln!(
                "bench: fleet round {}/{} {name}: {:.0} req/s, envoy cpu {:.1} µs/req, errors {}",
                round + 1,
                opts.reps,
                r.rps,
                r.cpu_us_per_request,
                r.errors
            );
            if let Some(v) = runs.get_mut(i) {
                v.push(r);
            }
        }
    }
    let plain = runs.first().cloned().unwrap_or_default();
    // Rows: 0 no wasm, 1..=sizes the floor per size, then the filter per size.
    let floor_of = |k: usize| runs.get(1 + k).cloned().unwrap_or_default();
    let filter_of = |k: usize| runs.get(floors + k).cloned().unwrap_or_default();
    let per_round = |a: &[Run], b: &[Run], f: &dyn Fn(&Run, &Run) -> f64| -> Vec<f64> {
        a.iter().zip(b).map(|(x, y)| f(x, y)).collect()
    };
    // The filter's own share of Envoy's CPU per request at size k: filter/N − floor/N.
    let own = |k: usize| -> Vec<f64> {
        per_round(&filter_of(k), &floor_of(k), &|a, b| {
            a.cpu_us_per_request - b.cpu_us_per_request
        })
    };
    let rows: Vec<Value> = envoys
        .iter()
        .zip(&runs)
        .enumerate()
        .map(|(i, ((name, _), r))| {
            let cpu: Vec<f64> = r.iter().map(|x| x.cpu_us_per_request).collect();
            let rps: Vec<f64> = r.iter().map(|x| x.rps).collect();
            // (kind, index of the size) of this row; the plain Envoy has none.
            let (kind, k) = match i {
                0 => ("no_wasm", None),
                i if i < floors => ("floor", Some(i - 1)),
                i => ("filter", Some(i - floors)),
            };
            let mut row = json!({
                "envoy": name,
                "kind": kind,
                "endpoints": k.and_then(|k| opts.endpoints.get(k)),
                "envoy_cpu_us_per_request": stat_json(&cpu, 10.0),
                "requests_per_s": stat_json(&rps, 1.0),
                "errors": r.iter().map(|x| x.errors).sum::<u64>(),
            });
            let (Some(k), Some(o)) = (k, row.as_object_mut()) else {
                return row;
            };
            let smallest = if kind == "floor" {
                floor_of(0)
            } else {
                filter_of(0)
            };
            o.insert(
                "cpu_minus_no_wasm_us".into(),
                stat_json(
                    &per_round(r, &plain, &|a, b| {
                        a.cpu_us_per_request - b.cpu_us_per_request
                    }),
                    10.0,
                ),
            );
            o.insert(
                "rps_over_no_wasm".into(),
                stat_json(&per_round(r, &plain, &|a, b| a.rps / b.rps), 1000.0),
            );
            o.insert(
                "cpu_over_smallest_fleet".into(),
                stat_json(
                    &per_round(r, &smallest, &|a, b| {
                        a.cpu_us_per_request / b.cpu_us_per_request
                    }),
                    1000.0,
                ),
            );
            if kind == "filter" {
                let own_k = own(k);
                let own_0 = own(0);
                o.insert("cpu_minus_floor_us".into(), stat_json(&own_k, 10.0));
                o.insert(
                    "own_over_smallest_fleet".into(),
                    stat_json(
                        &own_k
                            .iter()
                            .zip(&own_0)
                            .map(|(a, b)| a / b)
                            .collect::<Vec<_>>(),
                        1000.0,
                    ),
                );
            }
            row
        })
        .collect();
    Ok(json!({
        "method": "one plain Envoy, one floor-module Envoy per fleet size (spreading requests over the same N clusters by session) and one filter Envoy per fleet size (no metrics scraping), every endpoint a cluster in front of the same fast upstream; --concurrency 1; wrk -t1 with the given connections, a small chat body, session ids drawn uniformly from `sessions`; rounds run every Envoy once in an order rotated by one per round; ratios are per round, then the median",
        "endpoints": opts.endpoints,
        "seconds": opts.seconds,
        "reps": opts.reps,
        "connections": opts.connections,
        "sessions": opts.sessions,
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "rows": rows,
    }))
}

/// The markdown section for an `overhead_fleet` object.
pub fn markdown(v: &Value, machine: &str) -> String {
    let f = |r: &Value, p: &str| {
        r.pointer(p)
            .and_then(Value::as_f64)
            .map_or("–".to_string(), |x| format!("{x}"))
    };
    let range = |r: &Value, p: &str| {
        format!(
            "{} ({}…{})",
            f(r, &format!("{p}/median")),
            f(r, &format!("{p}/min")),
            f(r, &format!("{p}/max"))
        )
    };
    let mut s = String::from("## Overhead against fleet size (wrk, interleaved rounds)\n\n");
    s.push_str(&format!(
        "{} rounds of {} s per Envoy, {} connections, sessions drawn from {} ids; machine: {machine}; load average (1, 5, 15 min) {} before, \
         {} after. Medians over rounds (min…max); ratios are per round (paired), then the median.\n\n",
        v.get("reps").and_then(Value::as_u64).unwrap_or(0),
        v.get("seconds").and_then(Value::as_u64).unwrap_or(0),
        v.get("connections").and_then(Value::as_u64).unwrap_or(0),
        v.get("sessions").and_then(Value::as_u64).unwrap_or(0),
        v.get("load_average_before").and_then(Value::as_str).unwrap_or("?"),
        v.get("load_average_after").and_then(Value::as_str).unwrap_or("?"),
    ));
    s.push_str("| Envoy | CPU µs / request | − no wasm (µs) | req/s | ÷ no wasm req/s | CPU ÷ smallest fleet (same module) | filter − floor at N (µs) | (filter − floor) ÷ at smallest | errors |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for r in v
        .get("rows")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
    {
        let name = r.get("envoy").and_then(Value::as_str).unwrap_or("?");
        let filter = r.get("endpoints").is_some_and(|e| !e.is_null());
        let opt = |p: &str| if filter { range(r, p) } else { "–".into() };
        let filter_only = |p: &str| {
            if r.get("kind").and_then(Value::as_str) == Some("filter") {
                range(r, p)
            } else {
                "–".into()
            }
        };
        s.push_str(&format!(
            "| {name} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            range(r, "/envoy_cpu_us_per_request"),
            opt("/cpu_minus_no_wasm_us"),
            range(r, "/requests_per_s"),
            opt("/rps_over_no_wasm"),
            opt("/cpu_over_smallest_fleet"),
            filter_only("/cpu_minus_floor_us"),
            filter_only("/own_over_smallest_fleet"),
            r.get("errors").and_then(Value::as_u64).unwrap_or(0),
        ));
    }
    s.push('\n');
    s
}
