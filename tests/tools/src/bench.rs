//! The benchmark driver behind `scripts/bench`: routing quality of the filter against Envoy's
//! own balancers, with one Envoy and with three Envoy replicas behind a round-robin front Envoy,
//! the filter's per-request overhead, and the scheduler microbenchmarks' figures, written as
//! JSON, a markdown report and an SVG chart.
//!
//! Why: users ask how much better the filter is than what Envoy already gives them, in the
//! deployment they run, and what it costs per request. The answers are measured side by side in
//! one run, reproducible with one command.
//!
//! ```text
//! cargo run --release -p computeflux-tools --bin bench -- [--quick] [--out results/bench]
//!     [--policies round_robin,least_request,ring_hash,maglev,computeflux]
//!     [--scenarios steady,rate_limited,down,slow,join,rolling_restart,quota,quota_off,no_cache]
//!     [--replicas 1,3] [--replica-concurrency 1] [--front-concurrency 1] [--drain-s 1]
//!     [--baseline FILE | --no-baseline] [--no-routing] [--no-overhead]
//!     [--sessions 200] [--turns 6] [--rate 20] [--think-ms 800] [--user-tokens 300]
//!     [--second-model-share 0.2] [--seed 7] [--prefill-us-per-token 100] [--decode-ms 20]
//!     [--engine batched|constant] [--decode-ms-per-token 1.5] [--batch-slowdown 0.05]
//!     [--stream-share 0.5] [--output-tokens 16..512] [--system-prompts 0] [--system-tokens 200]
//!     [--system-zipf 0] [--system-head-tokens 0]
//!     [--max-concurrency 16] [--envoy-retries on|off] [--open-ms 3000]
//!     [--overhead-reps 6] [--overhead-seconds 2] [--overhead-endpoints 4,512]
//!     [--micro FILE | --micro-missing REASON]
//!     [--date D] [--commit C] [--command CMD] [--raw-dir results/tmp/bench] [--replicate-all]
//! cargo run --release -p computeflux-tools --bin bench -- --render results/bench/results.json
//! ```
//!
//! Besides the default policies, `--policies` takes `computeflux_noprefix` (the filter with
//! `"prefix_placement": false`), `computeflux_nometrics`, `computeflux_rulesoff`,
//! `computeflux_nocookie` (`"pin_cookie": false`) and `sglang_cache_aware` (the SGLang gateway from PyPI, see `bench/peer.rs`); besides the default scenarios, `--scenarios` takes
//! `shared_prefix`, `mixed_prefix` and `shared_preamble` (issue 20, see `bench/routing.rs`).
//! Neither is in the default run.
//!
//! `--replicas 1,3` (the default) runs every scenario with a lone Envoy and with three replicas;
//! the replicated topology runs ring_hash, maglev and computeflux only (those that promise
//! stickiness; `--replicate-all`: every policy), and the rolling restart only there.
//! `--baseline` (default: the `results.json` already in `--out`) is a previous run whose
//! lone-Envoy computeflux rows the report compares with, when its workload was the same.
//!
//! The routing runs' mocks behave like inference engines (`--engine batched`, the default; see
//! `mock_upstream/engine.rs`): `--max-concurrency` slots and a queue, one prefill at a time,
//! decode per output token slowed by the batch, every request's `max_tokens` generated exactly.
//! `--engine constant` is the earlier model (prefill per uncached token, then `--decode-ms`,
//! 16-token answers), which the overhead runs always use.
//!
//! `--overhead-endpoints 4,512` makes the overhead part the comparison against fleet size instead
//! (`bench/fleet.rs`: plain Envoy and the filter with each number of endpoint clusters, Envoy CPU
//! per request, filter ÷ no wasm req/s, the CPU ratio to the smallest fleet), written into
//! `results.json` (`overhead_fleet`), `fleet.md` and the end of `results.md`.
//!
//! `--membership scale_out,scale_in,rollout` (or `all`) runs only the issue 40 scenarios instead:
//! the engines are the hosts of one EDS cluster fed from a watched file whose host list changes
//! mid-run (`bench/membership.rs`; what counts: `bench/membership_summary.rs`), least_request,
//! ring_hash and the filter with a pool unless `--policies` says otherwise, written to
//! `OUT/latest.md` and `OUT/latest.json`.
//!
//! `--noisy-neighbor` runs only the noisy-neighbour scenario instead (`bench/noisy_neighbor.rs`;
//! what counts: `bench/noisy_summary.rs`): a quiet tenant and a noisy one at twice the fleet's
//! capacity, told apart by their `Authorization` header, against the filter (one Envoy and,
//! with `--replicas 1,3`, three replicas), least_request, ring_hash and the SGLang router unless
//! `--policies` says otherwise; `--client-timeout-s 15` is when a request is left to time out.
//! Written to `OUT/latest.md` and `OUT/latest.json`.
//!
//! `--zipf` runs only the Zipf-popular prefix workload (issue 39; `bench/zipf.rs`): eight
//! system prompts of 800 tokens, Zipf 1.1, two models, on steady, rate_limited, mixed_fleet
//! and slow, with one Envoy and three, computeflux, computeflux_nometrics, computeflux_nocookie
//! (the pin cookie's rule-off run) and ring_hash unless `--scenarios`/`--policies` narrow it;
//! written to `OUT/latest.md` and `OUT/latest.json`, the per-request records to
//! `results/tmp/bench/zipf` unless `--raw-dir`.
//!
//! `--render` rewrites `results.md`, `chart.svg`, `summary-table.md` (and, for a full run, the
//! docs/performance.md block) from a run's `results.json` without measuring anything.
//!
//! Needs `.venv/bin/envoy` (or `ENVOY_BIN`), the release wasm module and mock (built by the
//! harness if missing) and `wrk` on the PATH for the overhead part; `scripts/bench` sees to all.

#[path = "bench/data_parallel.rs"]
mod data_parallel;
#[path = "bench/deployment.rs"]
mod deployment;
#[path = "bench/filter_stats.rs"]
mod filter_stats;
#[path = "bench/fleet.rs"]
mod fleet;
#[path = "bench/membership.rs"]
mod membership;
#[path = "bench/membership_summary.rs"]
mod membership_summary;
#[path = "bench/noisy_neighbor.rs"]
mod noisy_neighbor;
#[path = "bench/noisy_summary.rs"]
mod noisy_summary;
#[path = "bench/overhead.rs"]
mod overhead;
#[path = "bench/peer.rs"]
mod peer;
#[path = "bench/report.rs"]
mod report;
#[path = "bench/routing.rs"]
mod routing;
#[path = "bench/summary.rs"]
mod summary;
#[path = "../../support/mod.rs"]
mod support;
#[path = "bench/targets.rs"]
mod targets;
#[path = "bench/topology.rs"]
mod topology;
#[path = "bench/workload.rs"]
mod workload;
#[path = "bench/zipf.rs"]
mod zipf;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use serde_json::json;

use routing::{RoutingOpts, Scenario};
use topology::Policy;
use workload::WorkloadParams;

struct Args {
    out: PathBuf,
    quick: bool,
    policies: Vec<Policy>,
    scenarios: Vec<Scenario>,
    /// Topologies: 1 (a lone Envoy) and/or N replicas behind a front Envoy.
    replicas: Vec<usize>,
    replica_concurrency: u32,
    front_concurrency: u32,
    drain_s: u32,
    /// A previous run's `results.json` to compare the lone Envoy's computeflux rows with.
    baseline: Option<PathBuf>,
    routing: bool,
    overhead: bool,
    workload: WorkloadParams,
    prefill_us: u64,
    decode_ms: u64,
    max_concurrency: u64,
    /// The routing runs' mock model: batched (engine-like) or constant.
    engine_batched: bool,
    decode_ms_per_token: f64,
    batch_slowdown: f64,
    envoy_retries: bool,
    open_ms: u64,
    /// Plugin configuration keys (a JSON object) set on top of the bench's own.
    plugin_extra: serde_json::Value,
    overhead_reps: usize,
    overhead_s: u64,
    /// Fleet sizes for the overhead against fleet size (empty: the usual overhead matrix).
    overhead_endpoints: Vec<usize>,
    micro: Result<PathBuf, String>,
    date: String,
    commit: String,
    command: String,
    /// Re-render the outputs from this `results.json` instead of running.
    render: Option<PathBuf>,
    /// Where the per-request records go (default `results/tmp/bench`).
    raw_dir: Option<PathBuf>,
    /// Run every policy in the replicated topology too, not only those that promise stickiness.
    replicate_all: bool,
    /// Membership scenarios (`--membership`, issue 40): when given, only these run.
    membership: Vec<membership::Change>,
    /// `--policies` was given (else the membership runs compare their own default set).
    policies_given: bool,
    /// `--data-parallel R`: only the data-parallel scenario, `dp` with R ranks.
    data_parallel: Option<usize>,
    /// `--noisy-neighbor`: run only the noisy-neighbour scenario (`bench/noisy_neighbor.rs`).
    noisy_neighbor: bool,
    /// The noisy-neighbour clients' timeout (`--client-timeout-s`).
    client_timeout_s: u64,
    /// `--zipf`: run only the Zipf-popular prefix workload (`bench/zipf.rs`).
    zipf: bool,
    /// `--scenarios` was given (else `--zipf` runs its own set).
    scenarios_given: bool,
}

fn parse() -> Result<Args, String> {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let quick = raw.iter().any(|a| a == "--quick");
    let mut a = Args {
        out: support::repo_root().join("results/bench"),
        quick,
        policies: Policy::ALL.to_vec(),
        scenarios: Scenario::ALL.to_vec(),
        replicas: vec![1, 3],
        replica_concurrency: 1,
        front_concurrency: 1,
        drain_s: 1,
        baseline: None,
        routing: true,
        overhead: true,
        workload: WorkloadParams {
            sessions: if quick { 40 } else { 200 },
            turns: if quick { 3 } else { 6 },
            rate_per_s: 20.0,
            think_ms: if quick { 400 } else { 800 },
            user_tokens: 300,
            second_model_share: 0.2,
            stream_share: 0.5,
            output_min: 16,
            output_max: 512,
            system_prompts: 0,
            system_tokens: 200,
            system_zipf_s: 0.0,
            system_head_tokens: 0,
            seed: 7,
        },
        prefill_us: 100,
        decode_ms: 20,
        max_concurrency: 16,
        engine_batched: true,
        decode_ms_per_token: 1.5,
        batch_slowdown: 0.05,
        envoy_retries: true,
        open_ms: 3000,
        plugin_extra: serde_json::Value::Null,
        // Six rounds: enough for a sign test on a 5 µs difference (see bench/report.rs).
        overhead_reps: if quick { 1 } else { 6 },
        overhead_s: if quick { 1 } else { 2 },
        overhead_endpoints: Vec::new(),
        micro: Err(
            "not run (pass --micro FILE with `cargo bench --bench scheduler` output)".into(),
        ),
        date: String::new(),
        commit: String::new(),
        command: String::new(),
        render: None,
        raw_dir: None,
        replicate_all: false,
        membership: Vec::new(),
        policies_given: false,
        data_parallel: None,
        noisy_neighbor: false,
        client_timeout_s: noisy_neighbor::CLIENT_TIMEOUT_S,
        zipf: false,
        scenarios_given: false,
    };
    let mut it = raw.into_iter();
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--quick" => continue,
            "--no-routing" => {
                a.routing = false;
                continue;
            }
            "--no-overhead" => {
                a.overhead = false;
                continue;
            }
            "--replicate-all" => {
                a.replicate_all = true;
                continue;
            }
            "--noisy-neighbor" => {
                a.noisy_neighbor = true;
                continue;
            }
            "--zipf" => {
                a.zipf = true;
                continue;
            }
            "--no-baseline" => {
                a.baseline = Some(PathBuf::new());
                continue;
            }
            "-h" | "--help" => return Err("help".into()),
            _ => {}
        }
        let v = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let int = |v: &str| {
            v.parse::<u64>()
                .map_err(|_| format!("{flag}: not a non-negative integer: {v:?}"))
        };
        let float = |v: &str| {
            v.parse::<f64>()
                .ok()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| format!("{flag}: not a non-negative number: {v:?}"))
        };
        match flag.as_str() {
            "--out" => a.out = PathBuf::from(v),
            "--policies" => {
                a.policies_given = true;
                a.policies = v
                    .split(',')
                    .map(|p| Policy::parse(p.trim()).ok_or_else(|| format!("unknown policy {p:?}")))
                    .collect::<Result<_, _>>()?
            }
            "--scenarios" => {
                a.scenarios_given = true;
                a.scenarios = v
                    .split(',')
                    .map(|p| {
                        Scenario::parse(p.trim()).ok_or_else(|| format!("unknown scenario {p:?}"))
                    })
                    .collect::<Result<_, _>>()?
            }
            "--replicas" => {
                a.replicas = v
                    .split(',')
                    .map(|r| match r.trim() {
                        "both" => Ok(vec![1, 3]),
                        n => n
                            .parse::<usize>()
                            .ok()
                            .filter(|n| (1..=9).contains(n))
                            .map(|n| vec![n])
                            .ok_or_else(|| format!("--replicas: not 1..=9 or both: {r:?}")),
                    })
                    .collect::<Result<Vec<_>, _>>()?
                    .concat();
                a.replicas.sort_unstable();
                a.replicas.dedup();
            }
            "--replica-concurrency" => a.replica_concurrency = int(&v)?.clamp(1, 64) as u32,
            "--front-concurrency" => a.front_concurrency = int(&v)?.clamp(1, 64) as u32,
            "--drain-s" => a.drain_s = int(&v)?.clamp(1, 60) as u32,
            "--baseline" => a.baseline = Some(PathBuf::from(v)),
            "--sessions" => a.workload.sessions = int(&v)?.max(1) as usize,
            "--turns" => a.workload.turns = int(&v)?.max(1) as usize,
            "--rate" => a.workload.rate_per_s = float(&v)?.max(0.01),
            "--think-ms" => a.workload.think_ms = int(&v)?,
            "--user-tokens" => a.workload.user_tokens = int(&v)?.max(1) as usize,
            "--second-model-share" => a.workload.second_model_share = float(&v)?.min(1.0),
            "--seed" => a.workload.seed = int(&v)?,
            "--prefill-us-per-token" => a.prefill_us = int(&v)?,
            "--decode-ms" => a.decode_ms = int(&v)?,
            "--max-concurrency" => a.max_concurrency = int(&v)?,
            "--engine" => {
                a.engine_batched = match v.as_str() {
                    "batched" => true,
                    "constant" => false,
                    _ => return Err(format!("--engine: batched or constant, got {v:?}")),
                }
            }
            "--decode-ms-per-token" => a.decode_ms_per_token = float(&v)?,
            "--batch-slowdown" => a.batch_slowdown = float(&v)?,
            "--stream-share" => a.workload.stream_share = float(&v)?.min(1.0),
            "--output-tokens" => {
                let (lo, hi) = v
                    .split_once("..")
                    .and_then(|(l, h)| Some((l.parse::<u64>().ok()?, h.parse::<u64>().ok()?)))
                    .filter(|(l, h)| 1 <= *l && l <= h)
                    .ok_or_else(|| format!("--output-tokens: LO..HI, got {v:?}"))?;
                a.workload.output_min = lo;
                a.workload.output_max = hi;
            }
            "--system-prompts" => a.workload.system_prompts = int(&v)? as usize,
            "--system-tokens" => a.workload.system_tokens = int(&v)? as usize,
            "--system-zipf" => a.workload.system_zipf_s = float(&v)?,
            "--system-head-tokens" => a.workload.system_head_tokens = int(&v)? as usize,
            "--envoy-retries" => a.envoy_retries = v == "on",
            "--open-ms" => a.open_ms = int(&v)?.max(1),
            "--client-timeout-s" => a.client_timeout_s = int(&v)?.clamp(1, 300),
            "--plugin-extra" => {
                a.plugin_extra = serde_json::from_str(&v)
                    .ok()
                    .filter(serde_json::Value::is_object)
                    .ok_or_else(|| format!("--plugin-extra: not a JSON object: {v:?}"))?
            }
            "--overhead-reps" => a.overhead_reps = int(&v)?.max(1) as usize,
            "--overhead-seconds" => a.overhead_s = int(&v)?.max(1),
            "--overhead-endpoints" => {
                a.overhead_endpoints = v
                    .split(',')
                    .map(|n| {
                        n.trim()
                            .parse::<usize>()
                            .ok()
                            .filter(|n| (1..=4096).contains(n))
                            .ok_or_else(|| format!("--overhead-endpoints: not 1..=4096: {n:?}"))
                    })
                    .collect::<Result<_, _>>()?;
                a.overhead_endpoints.sort_unstable();
                a.overhead_endpoints.dedup();
            }
            "--micro" => a.micro = Ok(PathBuf::from(v)),
            "--micro-missing" => a.micro = Err(v),
            "--date" => a.date = v,
            "--commit" => a.commit = v,
            "--command" => a.command = v,
            "--membership" => {
                a.membership = v
                    .split(',')
                    .map(|c| match c.trim() {
                        "all" => Ok(membership::Change::ALL.to_vec()),
                        c => membership::Change::parse(c)
                            .map(|c| vec![c])
                            .ok_or_else(|| format!("unknown membership scenario {c:?}")),
                    })
                    .collect::<Result<Vec<_>, _>>()?
                    .concat();
            }
            "--data-parallel" => {
                a.data_parallel = Some(
                    v.parse::<usize>()
                        .ok()
                        .filter(|r| (2..=4).contains(r))
                        .ok_or_else(|| format!("--data-parallel {v}: ranks in 2..=4"))?,
                )
            }
            "--render" => a.render = Some(PathBuf::from(v)),
            "--raw-dir" => a.raw_dir = Some(PathBuf::from(v)),
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(a)
}

/// Envoy's balancers' clusters: model → the endpoints serving it (the lone-Envoy steady set).
fn model_clusters() -> serde_json::Value {
    let eps = topology::ENDPOINTS.get(..4).unwrap_or(&[]);
    let mut models: Vec<&str> = eps.iter().flat_map(|e| e.1.iter().copied()).collect();
    models.sort_unstable();
    models.dedup();
    models
        .into_iter()
        .map(|m| {
            let hosts: Vec<&str> = eps
                .iter()
                .filter(|e| e.1.contains(&m))
                .map(|e| e.0)
                .collect();
            (topology::model_cluster(m), json!(hosts))
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// The overhead floor's module (`examples/floor_filter.rs`): `$COMPUTEFLUX_FLOOR_WASM`, else
/// `<target>/wasm32-wasip1/release/examples/floor_filter.wasm`.
fn floor_wasm() -> PathBuf {
    std::env::var_os("COMPUTEFLUX_FLOOR_WASM")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            support::target_dir().join("wasm32-wasip1/release/examples/floor_filter.wasm")
        })
}

fn envoy_version() -> String {
    let bin = support::envoy_bin();
    std::process::Command::new(bin)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| {
            // "<path>  version: <sha>/1.40.0/Clean/RELEASE/BoringSSL"
            let text = String::from_utf8_lossy(&o.stdout).into_owned();
            let after = text.split_once("version:")?.1.trim().to_string();
            after.split('/').nth(1).map(str::to_string)
        })
        .unwrap_or_else(|| "?".into())
}

fn machine() -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into());
    format!("{cores} cores (load average {load} at start, shared with other work)")
}

fn run(a: Args) -> Result<(), String> {
    if !a.membership.is_empty() {
        return run_membership(&a);
    }
    if let Some(ranks) = a.data_parallel {
        return run_data_parallel(&a, ranks);
    }
    if a.noisy_neighbor {
        return run_noisy(&a);
    }
    if a.zipf {
        return zipf::run(&a);
    }
    let started = Instant::now();
    std::fs::create_dir_all(&a.out).map_err(|e| format!("{}: {e}", a.out.display()))?;
    let tmp = support::repo_root().join("results/tmp/bench");
    std::fs::create_dir_all(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
    let wasm = support::wasm_path();
    let mock_args = mock_args(&a);
    let raw_dir = match &a.raw_dir {
        Some(d) => {
            std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
            d.clone()
        }
        None => tmp.clone(),
    };
    let opts = routing_opts(&a, &mock_args, raw_dir);
    let plans = workload::plan(&a.workload);
    let span_ms = workload::SessionPlan::last_arrival_ms(&plans);

    // A previous run to compare with, read before this run overwrites it.
    let baseline_path = match &a.baseline {
        Some(p) if p.as_os_str().is_empty() => None,
        Some(p) => Some(p.clone()),
        None => Some(a.out.join("results.json")),
    };
    let baseline = baseline_path.as_deref().and_then(targets::Baseline::read);

    let mut rows = Vec::new();
    if a.routing {
        // Scenario outer, then topology, then policy: the rows that are compared run close
        // together in time.
        let runs: Vec<(Scenario, usize, Policy)> = a
            .scenarios
            .iter()
            .flat_map(|&sc| {
                let (policies, all) = (&a.policies, a.replicate_all);
                a.replicas.iter().flat_map(move |&n| {
                    policies
                        .iter()
                        .filter(move |p| n == 1 || all || p.replicable())
                        .filter(move |_| n > 1 || !sc.needs_replicas())
                        .filter(move |p| !sc.filter_only() || p.is_filter())
                        // The peer's routers are not restarted (the rolling restart is Envoy's).
                        .filter(move |p| !(sc.needs_replicas() && **p == Policy::SglangCacheAware))
                        .map(move |&p| (sc, n, p))
                })
            })
            .collect();
        for (i, &(sc, n, p)) in runs.iter().enumerate() {
            let name = summary::label(p.name(), n as u32);
            eprintln!(
                "bench: routing {}/{}: {name} × {}",
                i + 1,
                runs.len(),
                sc.name()
            );
            let w = sc.workload(&a.workload);
            let s = if w.rate_per_s == a.workload.rate_per_s
                && w.sessions == a.workload.sessions
                && w.system_prompts == a.workload.system_prompts
            {
                routing::run(p, sc, n, &plans, &opts, &wasm)?
            } else {
                routing::run(p, sc, n, &workload::plan(&w), &opts, &wasm)?
            };
            eprintln!(
                "bench:   cached {:.1} %, same endpoint {:.1} %, p50 {:.1} ms, p99 {:.1} ms, errors {}/{} ({}), upstream 429s {}, spread {:.2}, {:.1} s",
                s.cached_ratio * 100.0,
                s.same_endpoint_share * 100.0,
                s.p50_ms,
                s.p99_ms,
                s.errors,
                s.requests,
                s.statuses(),
                s.upstream_429,
                s.max_spread(),
                s.wall_s
            );
            rows.push(s);
        }
        summary::relate_costs(&mut rows);
    }

    let oh_opts = overhead::OverheadOpts {
        concurrencies: vec![1, 2],
        throughput_s: a.overhead_s,
        latency_s: a.overhead_s,
        reps: a.overhead_reps,
        connections: 16,
        work_dir: tmp.clone(),
    };
    let floor = floor_wasm();
    let fleet_opts = fleet::FleetOpts {
        endpoints: a.overhead_endpoints.clone(),
        seconds: a.overhead_s,
        reps: a.overhead_reps,
        connections: 8,
        sessions: 2000,
        work_dir: tmp.clone(),
    };
    let fleet = if a.overhead && !fleet_opts.endpoints.is_empty() {
        eprintln!(
            "bench: overhead against fleet size {:?}",
            fleet_opts.endpoints
        );
        Some(fleet::run(&fleet_opts, &wasm, &floor)?)
    } else {
        None
    };
    let cases = if a.overhead && fleet.is_none() {
        eprintln!("bench: overhead");
        if !floor.is_file() {
            return Err(format!(
                "the floor module {} is missing: `cargo build --release --target wasm32-wasip1 \
                 --example floor_filter` (scripts/bench builds it)",
                floor.display()
            ));
        }
        overhead::run(&oh_opts, &wasm, &floor)?
    } else {
        Vec::new()
    };

    let micro = match &a.micro {
        Ok(p) => std::fs::read_to_string(p).map_err(|e| format!("reading {}: {e}", p.display())),
        Err(e) => Err(e.clone()),
    };
    let example_cfg =
        topology::plugin_config(topology::ENDPOINTS.get(..4).unwrap_or(&[]), a.open_ms, true);
    let meta = report::Meta {
        date: a.date.clone(),
        commit: a.commit.clone(),
        command: a.command.clone(),
        mode: if a.quick {
            "quick".into()
        } else {
            "full".into()
        },
        machine: machine(),
        envoy_version: envoy_version(),
        params: json!({
            "workload": {
                "sessions": a.workload.sessions, "turns": a.workload.turns,
                "rate_per_s": a.workload.rate_per_s, "think_ms": a.workload.think_ms,
                "user_tokens": a.workload.user_tokens,
                "second_model_share": a.workload.second_model_share, "seed": a.workload.seed,
                "stream_share": a.workload.stream_share,
                "output_tokens": [a.workload.output_min, a.workload.output_max],
                "system_prompts": a.workload.system_prompts,
                "system_tokens": a.workload.system_tokens,
                "system_zipf_s": a.workload.system_zipf_s,
                "system_head_tokens": a.workload.system_head_tokens,
                "arrival_span_ms": span_ms,
            },
            "mock_args": mock_args,
            "concurrency": opts.concurrency,
            "envoy_retries": a.envoy_retries,
            "envoy_retry_policy": topology::envoy_retry_policy(),
            "envoy_model_clusters": {
                "header": topology::MODEL_CLUSTER_HEADER,
                "clusters": model_clusters(),
                "lua": topology::model_lua(),
            },
            "replicas": a.replicas,
            "replicated": {
                "replica_concurrency": a.replica_concurrency,
                "front_concurrency": a.front_concurrency,
                "front_lb_policy": "ROUND_ROBIN",
                "front_retry_policy": topology::front_retry_policy(),
                "front_idle_timeout": topology::FRONT_IDLE_TIMEOUT,
                "replica_drain_time_s": a.drain_s,
                "replica_drain_strategy": "immediate",
                "policies": a.policies.iter().filter(|p| a.replicate_all || p.replicable()).map(Policy::name).collect::<Vec<_>>(),
            },
            "plugin_config_example": example_cfg,
            "overhead": {
                "concurrencies": oh_opts.concurrencies, "throughput_s": oh_opts.throughput_s,
                "latency_s": oh_opts.latency_s, "reps": oh_opts.reps,
                "connections": oh_opts.connections, "load_generator": "wrk",
                "routes": overhead::ROUTES.iter().map(|(n, d)| json!({"name": n, "description": d})).collect::<Vec<_>>(),
                "floor_module_bytes": std::fs::metadata(&floor).ok().map(|m| m.len()),
                "round_order": "each round runs every route once, the order rotated by one route per round",
            },
            "wall_s": started.elapsed().as_secs(),
        }),
        scenarios: a
            .scenarios
            .iter()
            .map(|s| (s.name().to_string(), s.describe(span_ms)))
            .collect(),
    };
    let rep = report::Report {
        meta,
        routing: &rows,
        overhead: &cases,
        wasm_bytes: std::fs::metadata(&wasm).ok().map(|m| m.len()),
        micro,
        baseline,
    };
    let mut json_value = rep.json();
    if let (Some(f), Some(o)) = (&fleet, json_value.as_object_mut()) {
        o.insert("overhead_fleet".into(), f.clone());
    }
    let json_text = serde_json::to_string_pretty(&json_value).map_err(|e| e.to_string())? + "\n";
    write_outputs(&rep, &a.out, Some(json_text))?;
    if let Some(f) = &fleet {
        let md = fleet::markdown(f, &rep.meta.machine);
        let path = a.out.join("fleet.md");
        std::fs::write(&path, &md).map_err(|e| format!("{}: {e}", path.display()))?;
        let results = a.out.join("results.md");
        let text = std::fs::read_to_string(&results).unwrap_or_default();
        std::fs::write(&results, format!("{text}\n{md}"))
            .map_err(|e| format!("{}: {e}", results.display()))?;
        eprint!("{md}");
    }
    if !a.quick && a.routing && a.overhead {
        update_readme(&rep.readme_block());
    }
    eprintln!("bench: done in {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// The mocks' flags of the routing runs (the engine model and its timings).
/// Every run of a mode: each of `cases` with each replica count and each policy (`--policies`,
/// else the mode's `defaults`); several replicas only for a policy that can be replicated
/// (unless `--replicate-all`), never the SGLang router (it runs behind one Envoy).
fn run_matrix<C: Copy>(a: &Args, cases: &[C], defaults: &[Policy]) -> Vec<(C, usize, Policy)> {
    let policies: &[Policy] = if a.policies_given {
        &a.policies
    } else {
        defaults
    };
    let mut runs = Vec::new();
    for &c in cases {
        for &n in &a.replicas {
            for &p in policies {
                if (n == 1 || a.replicate_all || p.replicable()) && p != Policy::SglangCacheAware {
                    runs.push((c, n, p));
                }
            }
        }
    }
    runs
}

/// The routing runs' options from the command line: 2 worker threads per Envoy, a 30 s
/// request timeout, raw records under `raw_dir` (shared by the even and the Zipf modes).
fn routing_opts(a: &Args, mock_args: &[String], raw_dir: PathBuf) -> RoutingOpts {
    RoutingOpts {
        mock_args: mock_args.to_vec(),
        prefill_us: a.prefill_us,
        concurrency: 2,
        replica_concurrency: a.replica_concurrency,
        front_concurrency: a.front_concurrency,
        drain_s: a.drain_s,
        envoy_retries: a.envoy_retries,
        open_ms: a.open_ms,
        plugin_extra: a.plugin_extra.clone(),
        request_timeout: Duration::from_secs(30),
        raw_dir: Some(raw_dir),
    }
}

fn mock_args(a: &Args) -> Vec<String> {
    let mut mock_args: Vec<String> = vec![
        "--prefill-us-per-token".into(),
        a.prefill_us.to_string(),
        "--decode-ms".into(),
        a.decode_ms.to_string(),
        "--max-concurrency".into(),
        a.max_concurrency.to_string(),
    ];
    if a.engine_batched {
        mock_args.extend([
            "--engine".into(),
            "batched".into(),
            "--output-tokens".into(),
            "max_tokens".into(),
            "--decode-ms-per-token".into(),
            a.decode_ms_per_token.to_string(),
            "--batch-slowdown".into(),
            a.batch_slowdown.to_string(),
        ]);
    }
    mock_args
}

/// `--membership`: the pool scenarios of issue 40 (`bench/membership.rs`), written to
/// `OUT/latest.md` and `OUT/latest.json`.
fn run_membership(a: &Args) -> Result<(), String> {
    let started = Instant::now();
    std::fs::create_dir_all(&a.out).map_err(|e| format!("{}: {e}", a.out.display()))?;
    let tmp = support::repo_root().join("results/tmp/bench");
    std::fs::create_dir_all(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
    let wasm = support::wasm_path();
    let mut mock_args = mock_args(a);
    // Every request a server received, for "after it left" (its log's default is 1 000).
    mock_args.extend(["--history".into(), "20000".into()]);
    let opts = membership::MembershipOpts {
        mock_args: mock_args.clone(),
        concurrency: 2,
        replica_concurrency: a.replica_concurrency,
        front_concurrency: a.front_concurrency,
        drain_s: a.drain_s,
        envoy_retries: a.envoy_retries,
        open_ms: a.open_ms,
        request_timeout: Duration::from_secs(30),
        work_dir: tmp.clone(),
        raw_dir: Some(a.raw_dir.clone().unwrap_or_else(|| tmp.clone())),
    };
    let w = membership::workload(&a.workload, a.quick);
    let plans = workload::plan(&w);
    let span_ms = workload::SessionPlan::last_arrival_ms(&plans);
    let runs = run_matrix(a, &a.membership, &membership::POLICIES);
    let mut rows = Vec::new();
    for (i, &(c, n, p)) in runs.iter().enumerate() {
        eprintln!(
            "bench: membership {}/{}: {} × {}",
            i + 1,
            runs.len(),
            summary::label(p.name(), n as u32),
            c.name()
        );
        let s = membership::run(p, c, n, &plans, &opts, &wasm)?;
        eprintln!(
            "bench:   follow-ups on their host {}/{} ({} whose host left), cached {:.1} %, \
             errors {}, after leaving {}/{}, p99 {:.0} ms, {:.1} s",
            s.same_host,
            s.follow_ups,
            s.follow_ups_host_left,
            s.cached_ratio() * 100.0,
            s.errors,
            s.after_leaving,
            s.after_leaving_late,
            s.p99_ms,
            s.wall_s
        );
        rows.push(s);
    }
    let meta = [
        ("command", format!("`{}`", a.command)),
        ("commit", a.commit.clone()),
        ("date", a.date.clone()),
        ("machine", machine()),
        ("Envoy", envoy_version()),
        (
            "workload",
            format!(
                "{} sessions of {} turns (one model, every host serves it), {} sessions/s, \
                 think {} ms, arrivals over {:.1} s, seed {}; mocks: {}",
                w.sessions,
                w.turns,
                w.rate_per_s,
                w.think_ms,
                span_ms as f64 / 1000.0,
                w.seed,
                mock_args.join(" ")
            ),
        ),
        (
            "topologies",
            "one Envoy (--concurrency 2), and three replicas (--concurrency 1) behind a \
             round-robin front Envoy, every Envoy watching the same EDS file"
                .into(),
        ),
        ("wall", format!("{:.0} s", started.elapsed().as_secs_f64())),
    ];
    let md = membership::markdown(&rows, &a.membership, span_ms, &meta);
    let json_text = serde_json::to_string_pretty(&json!({
        "meta": meta.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
        "plugin_config": membership::pool_plugin_config(Policy::Filter, a.open_ms),
        "pool_cluster_lb": membership::override_host_policy(),
        "scenarios": a.membership.iter().map(|c| json!({"name": c.name(), "description": c.describe(span_ms)})).collect::<Vec<_>>(),
        "runs": rows.iter().map(membership_summary::MembershipSummary::to_json).collect::<Vec<_>>(),
    }))
    .map_err(|e| e.to_string())?
        + "\n";
    write_latest(&a.out, md, json_text)
}

/// `--noisy-neighbor`: the noisy-neighbour scenario (`bench/noisy_neighbor.rs`) with every
/// policy (default: the filter with one Envoy and with three replicas, least_request, ring_hash,
/// the SGLang router), written to `OUT/latest.md` and `OUT/latest.json`.
fn run_noisy(a: &Args) -> Result<(), String> {
    use noisy_neighbor::{NoisyOpts, Shape};
    let started = Instant::now();
    std::fs::create_dir_all(&a.out).map_err(|e| format!("{}: {e}", a.out.display()))?;
    let tmp = support::repo_root().join("results/tmp/bench");
    std::fs::create_dir_all(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
    let wasm = support::wasm_path();
    // The engines' slots instead of the routing runs' default.
    let mut mock_args = mock_args(a);
    if let Some(i) = mock_args.iter().position(|f| f == "--max-concurrency") {
        if let Some(v) = mock_args.get_mut(i + 1) {
            *v = noisy_neighbor::ENGINE_SLOTS.to_string();
        }
    }
    let opts = NoisyOpts {
        mock_args: mock_args.clone(),
        concurrency: 2,
        replica_concurrency: a.replica_concurrency,
        front_concurrency: a.front_concurrency,
        drain_s: a.drain_s,
        envoy_retries: a.envoy_retries,
        open_ms: a.open_ms,
        plugin_extra: a.plugin_extra.clone(),
        client_timeout: Duration::from_secs(a.client_timeout_s),
        raw_dir: Some(match &a.raw_dir {
            Some(d) => {
                std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
                d.clone()
            }
            None => tmp.clone(),
        }),
    };
    let shape = Shape::new(a.quick, a.workload.seed);
    let reqs = noisy_neighbor::plan(&shape);
    let policies: Vec<topology::Policy> = if a.policies_given {
        a.policies.clone()
    } else {
        noisy_neighbor::POLICIES.to_vec()
    };
    // The previous run, read before this one overwrites it.
    let previous: Option<(String, Vec<noisy_summary::RunSummary>)> =
        std::fs::read_to_string(a.out.join("latest.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .map(|v| {
                let commit = v
                    .pointer("/meta/commit")
                    .and_then(serde_json::Value::as_str)
                    .unwrap_or("?")
                    .to_string();
                let rows = v
                    .get("runs")
                    .and_then(serde_json::Value::as_array)
                    .map(|r| r.iter().map(noisy_summary::RunSummary::from_json).collect())
                    .unwrap_or_default();
                (format!("commit {commit}"), rows)
            });
    let runs: Vec<(usize, topology::Policy)> = a
        .replicas
        .iter()
        .flat_map(|&n| {
            policies
                .iter()
                .filter(move |p| n == 1 || a.replicate_all || p.is_filter())
                .map(move |&p| (n, p))
        })
        .collect();
    let mut rows = Vec::new();
    let mut failed = Vec::new();
    for (i, &(n, p)) in runs.iter().enumerate() {
        let label = summary::label(p.name(), n as u32);
        eprintln!("bench: noisy_neighbor {}/{}: {label}", i + 1, runs.len());
        // An Envoy that is not ready in time on a loaded machine (three replicas compile the
        // module at once): the run is tried once more.
        let mut result = noisy_neighbor::run(p, n, &shape, &reqs, &opts, &wasm);
        if let Err(e) = &result {
            if e.contains("not ready") {
                let first = e.lines().next().unwrap_or("");
                eprintln!("bench:   {label}: {first}; trying once more");
                result = noisy_neighbor::run(p, n, &shape, &reqs, &opts, &wasm);
            }
        }
        match result {
            Ok(s) => {
                eprintln!(
                    "bench:   quiet p99 alone {:.0} ms, under noise {:.0} ms; quiet errors {}; \
                     noisy served {:.1}/s, 429 {}, timed out {}; steady p99 {:.0} ms; {:.0} s",
                    s.alone_quiet.p99_ms,
                    s.noise_quiet.p99_ms,
                    s.quiet_errors(),
                    s.noise_noisy.served_per_s,
                    s.noise_noisy.r429,
                    s.timed_out(),
                    s.steady_all.p99_ms,
                    s.wall_s
                );
                rows.push(s);
            }
            Err(e) => {
                eprintln!("bench:   {label} failed: {e}");
                failed.push(format!("{label}: {}", e.lines().next().unwrap_or("")));
            }
        }
    }
    let end_load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "?".into());
    let meta = [
        ("command", format!("`{}`", a.command)),
        ("commit", a.commit.clone()),
        ("date", a.date.clone()),
        (
            "machine",
            format!("{}; load average at the end {end_load}", machine()),
        ),
        ("Envoy", envoy_version()),
        ("client timeout", format!("{} s", a.client_timeout_s)),
        ("mocks", mock_args.join(" ")),
        (
            "topologies",
            "one Envoy (--concurrency 2); the filter also as three replicas (--concurrency 1) \
             behind a round-robin front Envoy; the SGLang router (cache_aware, its defaults) \
             behind one Envoy"
                .into(),
        ),
        ("wall", format!("{:.0} s", started.elapsed().as_secs_f64())),
    ];
    let md = noisy_neighbor::markdown(
        &rows,
        &shape,
        &meta,
        previous.as_ref().map(|(w, r)| (w.as_str(), r.as_slice())),
        &failed,
    );
    let json_text = serde_json::to_string_pretty(&json!({
        "meta": meta.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
        "shape": {
            "steady_ms": shape.steady_ms, "alone_ms": shape.alone_ms, "noise_ms": shape.noise_ms,
            "gap_ms": shape.gap_ms, "quiet_rate": shape.quiet_rate, "noisy_rate": shape.noisy_rate,
            "steady_noisy_rate": shape.steady_noisy_rate, "seed": shape.seed,
        },
        "plugin_config": topology::plugin_config(topology::ENDPOINTS.get(..noisy_neighbor::ENGINES).unwrap_or(&[]), a.open_ms, true),
        "runs": rows.iter().map(noisy_summary::RunSummary::to_json).collect::<Vec<_>>(),
        "failed": failed,
    }))
    .map_err(|e| e.to_string())?
        + "\n";
    for (name, text) in [("latest.md", md), ("latest.json", json_text)] {
        let p = a.out.join(name);
        std::fs::write(&p, text).map_err(|e| format!("{}: {e}", p.display()))?;
        eprintln!("bench: wrote {}", p.display());
    }
    if rows.is_empty() {
        return Err("no noisy_neighbor run succeeded".into());
    }
    Ok(())
}

/// `--data-parallel R`: one endpoint with R data-parallel ranks (`bench/data_parallel.rs`),
/// the filter pinning ranks, the filter without ranks, ring_hash; one Envoy and three. Written
/// to `OUT/latest.md` and `OUT/latest.json`.
fn run_data_parallel(a: &Args, ranks: usize) -> Result<(), String> {
    let started = Instant::now();
    std::fs::create_dir_all(&a.out).map_err(|e| format!("{}: {e}", a.out.display()))?;
    let load_at_start = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let wasm = support::wasm_path();
    let mut mock_args = mock_args(a);
    mock_args.extend(["--history".into(), "20000".into()]);
    let opts = data_parallel::DpOpts {
        ranks,
        mock_args: mock_args.clone(),
        deploy: deployment::DeployOpts {
            replicas: 1,
            concurrency: 2,
            replica_concurrency: a.replica_concurrency,
            front_concurrency: a.front_concurrency,
            drain_s: a.drain_s,
        },
        envoy_retries: a.envoy_retries,
        open_ms: a.open_ms,
        request_timeout: Duration::from_secs(30),
    };
    // One model that both endpoints serve; the rest as the command line says.
    let mut w = a.workload.clone();
    w.second_model_share = 0.0;
    let plans = workload::plan(&w);
    let span_ms = workload::SessionPlan::last_arrival_ms(&plans);
    let mut rows = Vec::new();
    for &n in &a.replicas {
        for r in data_parallel::Routing::ALL {
            eprintln!("bench: data-parallel {} × {n}", r.name());
            let s = data_parallel::run(r, n, &plans, &opts, &wasm)?;
            eprintln!(
                "bench:   cached {:.1} %, follow-ups on endpoint+rank {}/{}, dp ranks {:?}, \
                 errors {}, p50 {:.0} ms, p99 {:.0} ms, {:.1} s",
                s.cached_ratio() * 100.0,
                s.same_rank,
                s.follow_ups,
                s.dp_ranks,
                s.errors,
                s.p50_ms,
                s.p99_ms,
                s.wall_s
            );
            rows.push(s);
        }
    }
    let load_at_end = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let meta = [
        ("command", format!("`{}`", a.command)),
        ("commit", a.commit.clone()),
        ("date", a.date.clone()),
        ("machine", machine()),
        ("load average (/proc/loadavg) at start", load_at_start.trim().to_string()),
        ("load average at end", load_at_end.trim().to_string()),
        ("Envoy", envoy_version()),
        (
            "fleet",
            format!(
                "`dp`: one engine with {ranks} data-parallel ranks (a prefix cache each), \
                 `solo`: one engine with one; mocks: {}",
                mock_args.join(" ")
            ),
        ),
        (
            "workload",
            format!(
                "{} sessions of {} turns, {} sessions/s, think {} ms, arrivals over {:.1} s, seed {}",
                w.sessions,
                w.turns,
                w.rate_per_s,
                w.think_ms,
                span_ms as f64 / 1000.0,
                w.seed
            ),
        ),
        (
            "topologies",
            "one Envoy (--concurrency 2); three replicas behind a round-robin front Envoy".into(),
        ),
        ("wall", format!("{:.0} s", started.elapsed().as_secs_f64())),
    ];
    let md = data_parallel::markdown(&meta, &rows);
    let json_text = serde_json::to_string_pretty(&json!({
        "meta": meta.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
        "runs": rows.iter().map(data_parallel::DpSummary::to_json).collect::<Vec<_>>(),
    }))
    .map_err(|e| e.to_string())?
        + "\n";
    write_latest(&a.out, md, json_text)
}

/// Writes the report files into `out` (`results.json` only when given).
fn write_outputs(
    rep: &report::Report<'_>,
    out: &std::path::Path,
    json: Option<String>,
) -> Result<(), String> {
    let mut files = vec![
        ("results.md", rep.markdown()),
        ("chart.svg", rep.svg()),
        ("summary-table.md", rep.summary_table()),
    ];
    if let Some(j) = json {
        files.insert(0, ("results.json", j));
    }
    for (name, text) in files {
        let p = out.join(name);
        std::fs::write(&p, text).map_err(|e| format!("{}: {e}", p.display()))?;
        eprintln!("bench: wrote {}", p.display());
    }
    Ok(())
}

/// `--render results.json`: the markdown, the chart and (for a full run) the docs/performance.md
/// block again from a run's data, after a change to the report's layout.
fn render(path: &std::path::Path, out: &std::path::Path) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let st = |k: &str| {
        v.get(k)
            .and_then(serde_json::Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    let arr = |k: &str| {
        v.get(k)
            .and_then(serde_json::Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let rows: Vec<summary::Summary> = arr("routing")
        .iter()
        .map(summary::Summary::from_json)
        .collect();
    let cases: Vec<overhead::Case> = arr("overhead")
        .iter()
        .map(overhead::Case::from_json)
        .collect();
    let meta = report::Meta {
        date: st("date"),
        commit: st("commit"),
        command: st("command"),
        mode: st("mode"),
        machine: st("machine"),
        envoy_version: st("envoy_version"),
        params: v.get("params").cloned().unwrap_or(serde_json::Value::Null),
        scenarios: arr("scenarios")
            .iter()
            .map(|s| {
                let g = |k: &str| {
                    s.get(k)
                        .and_then(serde_json::Value::as_str)
                        .unwrap_or("")
                        .to_string()
                };
                (g("name"), g("description"))
            })
            .collect(),
    };
    let micro = match v
        .pointer("/scheduler_microbench/figures")
        .and_then(serde_json::Value::as_str)
    {
        Some(f) => Ok(f.to_string()),
        None => Err(v
            .pointer("/scheduler_microbench/missing")
            .and_then(serde_json::Value::as_str)
            .unwrap_or("not run")
            .to_string()),
    };
    let full = meta.mode == "full";
    let rep = report::Report {
        meta,
        routing: &rows,
        overhead: &cases,
        wasm_bytes: v
            .get("wasm_module_bytes")
            .and_then(serde_json::Value::as_u64),
        micro,
        baseline: v.get("baseline").and_then(targets::Baseline::from_json),
    };
    write_outputs(&rep, out, None)?;
    if full && !rows.is_empty() && !cases.is_empty() {
        update_readme(&rep.readme_block());
    }
    Ok(())
}

const README_BEGIN: &str =
    "<!-- bench:begin (written by scripts/bench; edits inside are replaced) -->";
const README_END: &str = "<!-- bench:end -->";
/// The page whose bench block a full run rewrites (its links are relative to `docs/`).
const PERFORMANCE_PAGE: &str = "docs/performance.md";

/// Replaces the block between the bench markers in docs/performance.md (a full run's figures).
/// Without the markers the page is left alone: the section is added by hand once.
fn update_readme(block: &str) {
    let path = support::repo_root().join(PERFORMANCE_PAGE);
    let Ok(text) = std::fs::read_to_string(&path) else {
        return;
    };
    let (Some(b), Some(e)) = (text.find(README_BEGIN), text.find(README_END)) else {
        eprintln!("bench: {PERFORMANCE_PAGE} has no bench markers; not updated");
        return;
    };
    if e < b {
        return;
    }
    let (head, rest) = text.split_at(b + README_BEGIN.len());
    let tail = rest.get(e - b - README_BEGIN.len()..).unwrap_or("");
    let new = format!("{head}\n{block}{tail}");
    match std::fs::write(&path, new) {
        Ok(()) => eprintln!("bench: updated the bench block of {PERFORMANCE_PAGE}"),
        Err(e) => eprintln!("bench: {PERFORMANCE_PAGE}: {e}"),
    }
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) if e == "help" => {
            println!("see the module docs of tests/tools/src/bench.rs (or scripts/bench --help)");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("bench: {e}");
            return ExitCode::from(2);
        }
    };
    let result = match &args.render {
        Some(p) => render(p, &args.out),
        None => run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Writes a scenario's report into `out` as `latest.md` and `latest.json`.
fn write_latest(out: &std::path::Path, md: String, json_text: String) -> Result<(), String> {
    for (name, text) in [("latest.md", md), ("latest.json", json_text)] {
        let p = out.join(name);
        std::fs::write(&p, text).map_err(|e| format!("{}: {e}", p.display()))?;
        eprintln!("bench: wrote {}", p.display());
    }
    Ok(())
}
