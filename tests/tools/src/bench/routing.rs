//! Routing quality: one run per topology × policy × scenario, the same workload each time, and
//! what the client saw (cache hits, stickiness, latency, errors, cost; see `summary.rs`).
//!
//! Why: the question users ask is "how much better than what Envoy already gives me?", in the
//! deployment they run: one Envoy, or several replicas behind a load balancer that restart on
//! every rollout. Each run starts fresh mocks (empty caches) and fresh Envoys (no learned state),
//! replays the identical session plan, and injects the scenario's fault at the same offsets, so
//! the rows of a scenario differ only in the policy and the topology.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;

use super::deployment::{DeployOpts, Deployment, Restart};
use super::filter_stats;
use super::summary::{self, Summary};
use super::support::MockUpstream;
use super::topology::{self, Policy, Setup, ENDPOINTS};
use super::workload::{self, Record, SessionPlan};

/// The endpoint that suffers the fault (serves both models, so both lose capacity).
pub const FAULTY: usize = 0;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    Steady,
    RateLimited,
    Down,
    Slow,
    Join,
    RollingRestart,
    /// API keys with token budgets per window that run out during the run (quota-aware routing).
    Quota,
    /// `Quota` with `quota_aware: false`: the same budgets, the filter learns only from 429s.
    QuotaOff,
    /// One endpoint runs without a prefix cache: stickiness gains nothing there (the affinity
    /// payoff's closed loop, `payoff_floor`).
    NoCache,
    /// Two small engines (few slots, slower prefill) and two large ones, the load close to the
    /// fleet's capacity: an endpoint that is full must be told from one that is slow.
    MixedFleet,
}

impl Scenario {
    pub const ALL: [Scenario; 10] = [
        Scenario::Steady,
        Scenario::RateLimited,
        Scenario::Down,
        Scenario::Slow,
        Scenario::Join,
        Scenario::RollingRestart,
        Scenario::Quota,
        Scenario::QuotaOff,
        Scenario::NoCache,
        Scenario::MixedFleet,
    ];

    pub fn name(&self) -> &'static str {
        match self {
            Scenario::Steady => "steady",
            Scenario::RateLimited => "rate_limited",
            Scenario::Down => "down",
            Scenario::Slow => "slow",
            Scenario::Join => "join",
            Scenario::RollingRestart => "rolling_restart",
            Scenario::Quota => "quota",
            Scenario::QuotaOff => "quota_off",
            Scenario::NoCache => "no_cache",
            Scenario::MixedFleet => "mixed_fleet",
        }
    }

    pub fn parse(s: &str) -> Option<Scenario> {
        Scenario::ALL.into_iter().find(|x| x.name() == s)
    }

    /// Only meaningful with several Envoy replicas.
    pub fn needs_replicas(&self) -> bool {
        *self == Scenario::RollingRestart
    }

    /// Only meaningful for the filter (a filter setting is what differs).
    pub fn filter_only(&self) -> bool {
        *self == Scenario::QuotaOff
    }

    /// Filter configuration keys of this scenario.
    pub fn plugin_extra(&self) -> serde_json::Value {
        match self {
            Scenario::Quota => json!({"quota_reserve_percent": QUOTA_RESERVE_PERCENT}),
            Scenario::QuotaOff => json!({"quota_aware": false}),
            _ => serde_json::Value::Null,
        }
    }

    /// Multiplies the workload's session arrival rate.
    pub fn rate_factor(&self) -> f64 {
        if *self == Scenario::MixedFleet {
            MIXED_RATE_FACTOR
        } else {
            1.0
        }
    }

    /// Mock flags of endpoint `i` on top of the run's (the last flag wins in the mock).
    pub fn endpoint_args(&self, i: usize, opts: &RoutingOpts) -> Vec<String> {
        match self {
            Scenario::NoCache if i == FAULTY => vec!["--cache-tokens".into(), "0".into()],
            Scenario::MixedFleet if MIXED_SMALL.contains(&i) => vec![
                "--max-concurrency".into(),
                MIXED_SMALL_SLOTS.to_string(),
                "--prefill-us-per-token".into(),
                (opts.prefill_us * MIXED_SMALL_PREFILL).to_string(),
            ],
            Scenario::MixedFleet => {
                vec!["--max-concurrency".into(), MIXED_LARGE_SLOTS.to_string()]
            }
            _ => Vec::new(),
        }
    }

    /// How many of [`ENDPOINTS`] the run configures.
    pub fn endpoints(&self) -> usize {
        if *self == Scenario::Join {
            5
        } else {
            4
        }
    }

    /// The fault window `(start_ms, end_ms)` for a run whose arrivals span `span_ms`; `end_ms`
    /// None: the condition lasts to the end. Steady has none.
    pub fn window(&self, span_ms: u64) -> Option<(u64, Option<u64>)> {
        let at = |f: f64| (span_ms as f64 * f).round() as u64;
        match self {
            Scenario::Steady
            | Scenario::Quota
            | Scenario::QuotaOff
            | Scenario::NoCache
            | Scenario::MixedFleet => None,
            Scenario::RateLimited | Scenario::Down => Some((at(0.3), Some(at(0.6)))),
            Scenario::Slow => Some((at(0.3), None)),
            // The new endpoint is "faulty" (absent) until it joins.
            Scenario::Join => Some((0, Some(at(0.4)))),
            // From the first drain to the end of the arrivals, by which the three restarts (each
            // waiting for the previous) are normally done; the report lists the actual times
            // and flags a restart that ended later. A fixed window, so that the steady run's
            // requests in the same window compare.
            Scenario::RollingRestart => {
                Some((RESTART_AT.first().map_or(0, |f| at(*f)), Some(span_ms)))
            }
        }
    }

    /// One line for the report.
    pub fn describe(&self, span_ms: u64) -> String {
        let s = |ms: u64| format!("{:.1} s", ms as f64 / 1000.0);
        let at = |f: f64| (span_ms as f64 * f).round() as u64;
        let ep = ENDPOINTS.get(FAULTY).map_or("a", |e| e.0);
        match (self, self.window(span_ms)) {
            (Scenario::Steady, _) => "no fault".into(),
            (Scenario::NoCache, _) => format!(
                "`{ep}` runs without a prefix cache (mock `--cache-tokens 0`): its turns are full \
                 prefills whether pinned or not; the others cache as in steady"
            ),
            (Scenario::MixedFleet, _) => format!(
                "mixed fleet: {} are small engines ({MIXED_SMALL_SLOTS} slots, {MIXED_SMALL_PREFILL}× \
                 slower prefill), the others large ({MIXED_LARGE_SLOTS} slots); session arrivals \
                 × {MIXED_RATE_FACTOR} (close to the fleet's capacity)",
                MIXED_SMALL
                    .iter()
                    .filter_map(|i| ENDPOINTS.get(*i).map(|e| format!("`{}`", e.0)))
                    .collect::<Vec<_>>()
                    .join(" and ")
            ),
            (Scenario::Quota | Scenario::QuotaOff, _) => format!(
                "every endpoint is an API key with a token budget per window (the mock's \
                 `--quota-*`, OpenAI headers); `c` and `d` get {:.0} % and {:.0} % of their even \
                 share of the workload's tokens per {} ms window, `a` and `b` {:.0} %; {}",
                QUOTA_SHARES[2] * 100.0,
                QUOTA_SHARES[3] * 100.0,
                QUOTA_WINDOW_MS,
                QUOTA_SHARES[0] * 100.0,
                if *self == Scenario::QuotaOff {
                    "`quota_aware: false` (the filter learns only from 429s)"
                } else {
                    "`quota_aware: true` (default) with `quota_reserve_percent: 50`"
                }
            ),
            (Scenario::RateLimited, Some((a, Some(b)))) => {
                format!("`{ep}` answers 429 with `Retry-After: 2` from {} to {}", s(a), s(b))
            }
            (Scenario::Down, Some((a, Some(b)))) => format!(
                "`{ep}` refuses connections from {} to {}, then comes back with an empty cache (a restart)",
                s(a),
                s(b)
            ),
            (Scenario::Slow, Some((a, _))) => {
                format!("`{ep}` becomes 5× slower (prefill and decode) from {} on", s(a))
            }
            (Scenario::Join, Some((_, Some(b)))) => format!(
                "fifth endpoint `e` (serves m1) is configured from the start but refuses connections until it joins at {}",
                s(b)
            ),
            (Scenario::RollingRestart, _) => format!(
                "replicated topology only: each replica in turn is drained (`POST /drain_listeners?graceful`), \
                 stopped by PID once idle and started again on its port with empty shared data, \
                 from {} (the next ones at {} or when the previous is back, whichever is later; \
                 actual times below); with one Envoy: not run",
                s(at(RESTART_AT.first().copied().unwrap_or(0.1))),
                RESTART_AT
                    .iter()
                    .skip(1)
                    .map(|f| s(at(*f)))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            _ => String::new(),
        }
    }
}

/// The mixed fleet: which endpoints are small (one per model group: `b` serves both models,
/// `d` only m1), their slots and prefill slowdown, the large ones' slots, and the load.
pub const MIXED_SMALL: [usize; 2] = [1, 3];
pub const MIXED_SMALL_SLOTS: u64 = 4;
pub const MIXED_SMALL_PREFILL: u64 = 3;
pub const MIXED_LARGE_SLOTS: u64 = 16;
pub const MIXED_RATE_FACTOR: f64 = 1.25;

/// Each key's token budget per window, as a share of its even part of the workload's tokens
/// in that window (endpoints in [`ENDPOINTS`] order; `c` and `d` serve `m1` only, so `m2`'s
/// keys `a` and `b` are never the ones that run out).
pub const QUOTA_SHARES: [f64; 5] = [4.0, 4.0, 0.6, 0.8, 4.0];
/// `quota_reserve_percent` of the quota scenario: new sessions leave a key with less than this
/// share of its budget left, so that its pinned sessions (and their cached prompts) can stay.
pub const QUOTA_RESERVE_PERCENT: u64 = 50;
/// The budgets' window: short, so that keys run out and come back many times in a run (a
/// hosted API's per-minute budget under proportionally heavier traffic).
pub const QUOTA_WINDOW_MS: u64 = 4_000;

/// Gives every mock its budget: the workload's tokens (as the mock charges them: prompt bytes
/// / 4 + the completion tokens, with the JSON body as an upper bound of the prompt) spread
/// evenly over the endpoints and the run, times [`QUOTA_SHARES`].
fn set_quotas(mocks: &[MockUpstream], plans: &[SessionPlan]) {
    let tokens: u64 = plans
        .iter()
        .flat_map(|p| {
            (0..p.user_msgs.len()).map(move |t| {
                p.body(t).len() as u64 / 4 + p.max_tokens.get(t).copied().unwrap_or(16)
            })
        })
        .sum();
    let run_ms = plans
        .iter()
        .map(|p| p.arrival_ms + p.think_ms.iter().sum::<u64>())
        .max()
        .unwrap_or(1)
        .max(1);
    let window_ms = QUOTA_WINDOW_MS;
    let per_key_window =
        tokens as f64 / mocks.len().max(1) as f64 * window_ms as f64 / run_ms as f64;
    for (m, share) in mocks.iter().zip(QUOTA_SHARES) {
        m.set_quota(json!({
            "tokens": (per_key_window * share).round() as u64,
            "window_ms": window_ms,
            "headers_family": "openai",
        }));
    }
}

/// When the replicas of a rolling restart begin to drain, as fractions of the arrival span (a
/// restart also waits for the previous one to be back).
pub const RESTART_AT: [f64; 3] = [0.1, 0.4, 0.7];

/// Everything a routing run needs besides policy, scenario and topology.
#[derive(Clone, Debug)]
pub struct RoutingOpts {
    pub mock_args: Vec<String>,
    /// The mocks' `--prefill-us-per-token` (the mixed fleet's small engines get a multiple).
    pub prefill_us: u64,
    /// `--concurrency` of a lone Envoy.
    pub concurrency: u32,
    /// `--concurrency` of each replica and of the front Envoy of the replicated topology.
    pub replica_concurrency: u32,
    pub front_concurrency: u32,
    /// `--drain-time-s` of the replicas.
    pub drain_s: u32,
    pub envoy_retries: bool,
    pub open_ms: u64,
    /// Plugin configuration keys set on top of the bench's own (`--plugin-extra`).
    pub plugin_extra: serde_json::Value,
    pub request_timeout: Duration,
    /// Per-request records go here as JSON lines (diagnostics; not committed).
    pub raw_dir: Option<std::path::PathBuf>,
}

/// Applies the scenario's fault changes at their offsets from `t0` (runs in its own thread);
/// returns the replica restarts it made.
fn inject(
    scenario: Scenario,
    mocks: &[MockUpstream],
    deployment: &mut Deployment,
    span_ms: u64,
    t0: Instant,
) -> Result<Vec<Restart>, String> {
    let Some((start, end)) = scenario.window(span_ms) else {
        return Ok(Vec::new());
    };
    let wait_until = |ms: u64| {
        if let Some(d) = (t0 + Duration::from_millis(ms)).checked_duration_since(Instant::now()) {
            std::thread::sleep(d);
        }
    };
    let faulty = mocks.get(FAULTY);
    match (scenario, faulty) {
        (Scenario::RateLimited, Some(m)) => {
            wait_until(start);
            m.set_fault(json!({"mode": "status", "status": 429, "retry_after": "2"}));
            wait_until(end.unwrap_or(start));
            m.clear_fault();
        }
        (Scenario::Down, Some(m)) => {
            wait_until(start);
            m.set_fault(json!({"mode": "refuse"}));
            wait_until(end.unwrap_or(start));
            // Back after a restart: its KV cache is gone.
            m.flush_cache();
            m.clear_fault();
        }
        (Scenario::Slow, Some(m)) => {
            wait_until(start);
            m.set_fault(json!({"mode": "slow", "factor": 5}));
        }
        (Scenario::Join, _) => {
            if let Some(m) = mocks.get(4) {
                wait_until(end.unwrap_or(start));
                m.clear_fault();
            }
        }
        (Scenario::RollingRestart, _) => {
            let mut done = Vec::new();
            for (i, f) in RESTART_AT
                .iter()
                .enumerate()
                .take(deployment.replica_count())
            {
                wait_until((span_ms as f64 * f).round() as u64);
                done.push(deployment.restart(i, t0)?);
            }
            return Ok(done);
        }
        _ => {}
    }
    Ok(Vec::new())
}

/// One topology × policy × scenario run: `replicas` Envoys (1: a lone one).
pub fn run(
    policy: Policy,
    scenario: Scenario,
    replicas: usize,
    plans: &[SessionPlan],
    opts: &RoutingOpts,
    wasm: &std::path::Path,
) -> Result<Summary, String> {
    let started = Instant::now();
    // Each endpoint with the run's flags and the scenario's own (the last flag wins in the mock).
    let mocks: Vec<MockUpstream> = ENDPOINTS
        .iter()
        .take(scenario.endpoints())
        .enumerate()
        .map(|(i, (name, models))| {
            let own = scenario.endpoint_args(i, opts);
            let args: Vec<&str> = opts
                .mock_args
                .iter()
                .chain(&own)
                .map(String::as_str)
                .collect();
            MockUpstream::start(name, models, &args)
        })
        .collect();
    for m in &mocks {
        topology::record_pid(m.pid());
    }
    if matches!(scenario, Scenario::Quota | Scenario::QuotaOff) {
        set_quotas(&mocks, plans);
    }
    if scenario == Scenario::Join {
        if let Some(e) = mocks.get(4) {
            e.set_fault(json!({"mode": "refuse"}));
        }
    }
    let hosts: Vec<(&str, &[&str], u16)> = ENDPOINTS
        .iter()
        .zip(&mocks)
        .map(|((n, models), m)| (*n, *models, m.port))
        .collect();
    let setup = Setup {
        policy,
        hosts: &hosts,
        concurrency: opts.concurrency,
        envoy_retries: opts.envoy_retries,
        open_ms: opts.open_ms,
        plugin_extra: {
            // The scenario's own keys, then the command line's (`--plugin-extra`) on top.
            let mut extra = scenario.plugin_extra();
            match (extra.as_object_mut(), opts.plugin_extra.as_object()) {
                (Some(o), Some(cli)) => o.extend(cli.clone()),
                (None, Some(_)) => extra = opts.plugin_extra.clone(),
                _ => {}
            }
            extra
        },
    };
    let boot = topology::bootstrap(&setup, wasm)?;
    let deploy = DeployOpts {
        replicas,
        concurrency: opts.concurrency,
        replica_concurrency: opts.replica_concurrency,
        front_concurrency: opts.front_concurrency,
        drain_s: opts.drain_s,
    };
    let mut deployment = Deployment::start(&boot, policy.name(), &deploy)?;
    let port = deployment.port();
    let span_ms = SessionPlan::last_arrival_ms(plans);
    let t0 = Instant::now() + Duration::from_millis(200);
    let admin_ports = if policy.is_filter() {
        deployment.admin_ports()
    } else {
        Vec::new()
    };
    let stop = AtomicBool::new(false);
    let (recs, injected, mut gathered) = std::thread::scope(|sc| {
        let (mocks, deployment) = (&mocks, &mut deployment);
        let injector = sc.spawn(move || inject(scenario, mocks, deployment, span_ms, t0));
        let (ports, stop) = (&admin_ports, &stop);
        let sampler = sc.spawn(move || filter_stats::sample(ports, stop, t0));
        let recs = workload::drive(port, plans, t0, opts.request_timeout);
        stop.store(true, Ordering::Relaxed);
        let injected = injector
            .join()
            .unwrap_or_else(|_| Err("the fault injector panicked".into()));
        let gathered = sampler.join().unwrap_or_default();
        (recs, injected, gathered)
    });
    let restarts = injected?;
    if policy.is_filter() {
        filter_stats::finish(&mut gathered, &deployment.admin_ports(), t0);
    }
    let upstream: u64 = mocks.iter().map(MockUpstream::request_count).sum();
    let upstream_429: u64 = mocks.iter().map(MockUpstream::count_429).sum();
    if let Some(dir) = &opts.raw_dir {
        let name = summary::label(policy.name(), replicas as u32).replace(" ×", "-x");
        let path = dir.join(format!("{name}-{}.jsonl", scenario.name()));
        let mut text = String::new();
        let mut sorted: Vec<&Record> = recs.iter().collect();
        sorted.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
        for r in sorted {
            text.push_str(&r.to_json().to_string());
            text.push('\n');
        }
        let _ = std::fs::write(path, text);
    }
    drop(deployment);
    drop(mocks);
    let mut s = summary::summarize(policy, scenario, replicas as u32, &recs, upstream, span_ms);
    s.restarts = restarts;
    s.decisions = gathered.decisions();
    // The estimate once warm: from a fifth of the arrival span on.
    s.slowness = gathered.slowness_spread(span_ms as f64 * 0.2);
    s.upstream_429 = upstream_429;
    s.wall_s = started.elapsed().as_secs_f64();
    Ok(s)
}
