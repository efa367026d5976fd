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
use super::peer::SglangRouter;
use super::summary::{self, Summary};
use super::support::MockUpstream;
use super::topology::{self, Policy, Setup, ENDPOINTS};
use super::workload::{self, Record, SessionPlan, WorkloadParams};

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
    /// Issue 20: many applications, each with its own long system prompt, Zipf-popular, short
    /// conversations, one model on four engines whose caches cannot each hold every prompt.
    SharedPrefix,
    /// Issue 20: the default workload plus a few shared system prompts.
    MixedPrefix,
    /// Issue 20, item 3: `SharedPrefix` whose applications all start with the same preamble (a
    /// policy and tools message), then a shorter prompt of their own; smaller caches.
    SharedPreamble,
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
            Scenario::SharedPrefix => "shared_prefix",
            Scenario::MixedPrefix => "mixed_prefix",
            Scenario::SharedPreamble => "shared_preamble",
        }
    }

    /// Every scenario `--scenarios` accepts, in the report's order (the default set first).
    pub const KNOWN: [Scenario; 13] = [
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
        Scenario::SharedPrefix,
        Scenario::MixedPrefix,
        Scenario::SharedPreamble,
    ];

    pub fn parse(s: &str) -> Option<Scenario> {
        Scenario::KNOWN.into_iter().find(|x| x.name() == s)
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
            Scenario::Quota => json!({"tuning": {"quota_reserve_percent": QUOTA_RESERVE_PERCENT}}),
            Scenario::QuotaOff => json!({"quota_aware": false}),
            _ => serde_json::Value::Null,
        }
    }

    /// The workload of this scenario, from the run's (`base`).
    pub fn workload(&self, base: &WorkloadParams) -> WorkloadParams {
        let mut w = base.clone();
        match self {
            Scenario::MixedFleet => w.rate_per_s *= MIXED_RATE_FACTOR,
            Scenario::SharedPrefix | Scenario::SharedPreamble => {
                w.sessions = base.sessions * SHARED_SESSIONS_FACTOR;
                w.turns = SHARED_TURNS;
                w.second_model_share = 0.0;
                w.system_prompts = SHARED_APPS;
                w.system_tokens = SHARED_SYSTEM_TOKENS;
                w.system_zipf_s = SHARED_ZIPF_S;
                w.rate_per_s = SHARED_REQUESTS_PER_S / SHARED_TURNS as f64;
                if *self == Scenario::SharedPreamble {
                    w.system_head_tokens = PREAMBLE_HEAD_TOKENS;
                    w.system_tokens = PREAMBLE_TAIL_TOKENS;
                }
            }
            Scenario::MixedPrefix => {
                w.system_prompts = MIXED_PREFIX_APPS;
                w.system_tokens = MIXED_PREFIX_SYSTEM_TOKENS;
                w.system_zipf_s = SHARED_ZIPF_S;
            }
            _ => {}
        }
        w
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
            Scenario::SharedPrefix => vec![
                "--cache-tokens".into(),
                SHARED_CACHE_TOKENS.to_string(),
                "--prefill-us-per-token".into(),
                SHARED_PREFILL_US.to_string(),
            ],
            Scenario::SharedPreamble => vec![
                "--cache-tokens".into(),
                PREAMBLE_CACHE_TOKENS.to_string(),
                "--prefill-us-per-token".into(),
                SHARED_PREFILL_US.to_string(),
            ],
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
            | Scenario::MixedFleet
            | Scenario::SharedPrefix
            | Scenario::MixedPrefix
            | Scenario::SharedPreamble => None,
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
            (Scenario::SharedPrefix, _) => format!(
                "shared prefixes (issue 20): {SHARED_APPS} applications, each with its own system \
                 prompt of {SHARED_SYSTEM_TOKENS} tokens, popularity Zipf (s = {SHARED_ZIPF_S}); \
                 conversations of {SHARED_TURNS} turns, {SHARED_SESSIONS_FACTOR}× the run's \
                 sessions, one model (m1) on the four endpoints, {SHARED_REQUESTS_PER_S} req/s \
                 offered; each engine's KV cache holds {SHARED_CACHE_TOKENS} tokens (all prompts: \
                 {} tokens) and prefills at {SHARED_PREFILL_US} µs per uncached token",
                SHARED_APPS * SHARED_SYSTEM_TOKENS
            ),
            (Scenario::SharedPreamble, _) => format!(
                "shared preamble (issue 20, item 3): as shared_prefix, but every one of the \
                 {SHARED_APPS} applications' prompts is the same {PREAMBLE_HEAD_TOKENS}-token \
                 system message (a policy and tools preamble) followed by a \
                 {PREAMBLE_TAIL_TOKENS}-token system message of its own; each engine's KV cache \
                 holds {PREAMBLE_CACHE_TOKENS} tokens (all prompts: {} tokens)",
                PREAMBLE_HEAD_TOKENS + SHARED_APPS * PREAMBLE_TAIL_TOKENS
            ),
            (Scenario::MixedPrefix, _) => format!(
                "the default workload plus {MIXED_PREFIX_APPS} shared system prompts of \
                 {MIXED_PREFIX_SYSTEM_TOKENS} tokens (popularity Zipf, s = {SHARED_ZIPF_S}); no fault"
            ),
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
                    "`quota_aware: true` (default) with `tuning.quota_reserve_percent: 50`"
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

/// The shared-prefix scenario (issue 20's independent benchmark: 48 applications of 3 000-token
/// system prompts, Zipf-popular, two-turn conversations, four engines of 64 k tokens of KV cache,
/// 27 req/s). The prefill cost is set so that the engines run near but below capacity: measured
/// with round_robin and least_request (which place with no regard to prompts: 60 % of the prompt
/// tokens cached, 6.7 req/s per engine), each engine's one prefill lane is busy ≈ 47 % of the
/// time at 50 µs per uncached token, so 80 µs puts it at ≈ 75 % (a 3 000-token prompt prefills
/// in 240 ms); a policy that finds more of the prompt cached has proportionally more headroom.
pub const SHARED_APPS: usize = 48;
pub const SHARED_SYSTEM_TOKENS: usize = 3_000;
pub const SHARED_ZIPF_S: f64 = 1.0;
pub const SHARED_TURNS: usize = 2;
pub const SHARED_SESSIONS_FACTOR: usize = 3;
pub const SHARED_CACHE_TOKENS: u64 = 64_000;
pub const SHARED_PREFILL_US: u64 = 80;
pub const SHARED_REQUESTS_PER_S: f64 = 27.0;
/// The shared-preamble scenario: the same applications, arrivals and turns as shared_prefix,
/// each prompt split into a preamble all share and a shorter part of its own (3 000 tokens in
/// all, as there), on engines of half the cache (all prompts would fit in one 64 k cache).
pub const PREAMBLE_HEAD_TOKENS: usize = 2_000;
pub const PREAMBLE_TAIL_TOKENS: usize = 1_000;
pub const PREAMBLE_CACHE_TOKENS: u64 = 32_000;
/// The mixed one: the default workload's sessions with a few shared prompts.
pub const MIXED_PREFIX_APPS: usize = 8;
pub const MIXED_PREFIX_SYSTEM_TOKENS: usize = 1_500;

/// Each key's token budget per window, as a share of its even part of the workload's tokens
/// in that window (endpoints in [`ENDPOINTS`] order; `c` and `d` serve `m1` only, so `m2`'s
/// keys `a` and `b` are never the ones that run out).
pub const QUOTA_SHARES: [f64; 5] = [4.0, 4.0, 0.6, 0.8, 4.0];
/// `tuning.quota_reserve_percent` of the quota scenario: new sessions leave a key with less than this
/// share of its budget left, so that its pinned sessions (and their cached prompts) can stay.
pub const QUOTA_RESERVE_PERCENT: u64 = 50;
/// The budgets' window: short, so that keys run out and come back many times in a run (a
/// hosted API's per-minute budget under proportionally heavier traffic).
pub const QUOTA_WINDOW_MS: u64 = 4_000;

/// Gives every mock its budget: the workload's tokens (as the mock charges them: prompt bytes
/// / 4 + the completion tokens, with the JSON body as an upper bound of the prompt) spread
/// evenly over the endpoints and the run, times [`QUOTA_SHARES`]. Returns each key's budget
/// (tokens per [`QUOTA_WINDOW_MS`]), in the mocks' order.
fn set_quotas(mocks: &[MockUpstream], plans: &[SessionPlan]) -> Vec<u64> {
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
    let mut budgets = Vec::new();
    for (m, share) in mocks.iter().zip(QUOTA_SHARES) {
        let tokens = (per_key_window * share).round() as u64;
        m.set_quota(json!({
            "tokens": tokens,
            "window_ms": window_ms,
            "headers_family": "openai",
        }));
        budgets.push(tokens);
    }
    budgets
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

/// The JSON objects of `parts` merged, later keys over earlier ones (Null: an empty object;
/// all empty: Null).
fn merged(parts: &[serde_json::Value]) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    for p in parts {
        if let Some(o) = p.as_object() {
            topology::merge_keys(&mut out, o);
        }
    }
    if out.is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::Value::Object(out)
    }
}

/// A run's file name stem in the raw directory: `computeflux-x3` for `computeflux ×3`.
fn raw_name(policy: Policy, replicas: usize) -> String {
    summary::label(policy.name(), replicas as u32).replace(" ×", "-x")
}

/// Where [`run`] writes a run's per-request records (JSON lines, sorted by start) in `dir`.
pub fn raw_path(
    dir: &std::path::Path,
    policy: Policy,
    scenario: Scenario,
    replicas: usize,
) -> std::path::PathBuf {
    dir.join(format!(
        "{}-{}.jsonl",
        raw_name(policy, replicas),
        scenario.name()
    ))
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
    let budgets = if matches!(scenario, Scenario::Quota | Scenario::QuotaOff) {
        set_quotas(&mocks, plans)
    } else {
        Vec::new()
    };
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
    // The peer router: one per model and replica slot, Envoy in front of them (see peer.rs).
    let peer = policy == Policy::SglangCacheAware;
    let mut routers: Vec<(String, &'static str, SglangRouter)> = Vec::new();
    if peer {
        // The models the workload asks for (shared_prefix: m1 only).
        let mut models: Vec<&'static str> = plans.iter().map(|p| p.model).collect();
        models.sort_unstable();
        models.dedup();
        for r in 0..replicas.max(1) {
            for &m in &models {
                let ports: Vec<u16> = ENDPOINTS
                    .iter()
                    .zip(&mocks)
                    .filter(|(e, _)| e.1.contains(&m))
                    .map(|(_, mock)| mock.port)
                    .collect();
                let name = format!("sglang_{m}_r{r}");
                let router = SglangRouter::start(&ports, &name)?;
                routers.push((name, m, router));
            }
        }
    }
    let router_models: Vec<&'static str> = routers.iter().map(|r| r.1).collect();
    let router_hosts: Vec<(&str, &[&str], u16)> = routers
        .iter()
        .zip(&router_models)
        .map(|((name, _, router), m)| (name.as_str(), std::slice::from_ref(m), router.port))
        .collect();
    let setup = Setup {
        policy,
        hosts: if peer { &router_hosts } else { &hosts },
        concurrency: opts.concurrency,
        envoy_retries: opts.envoy_retries,
        open_ms: opts.open_ms,
        // The scenario's keys, the policy's, then the command line's (`--plugin-extra`) on top.
        plugin_extra: merged(&[
            scenario.plugin_extra(),
            policy.plugin_extra(),
            opts.plugin_extra.clone(),
        ]),
    };
    let boot = topology::bootstrap(&setup, wasm)?;
    let deploy = DeployOpts {
        // The peer's replicas are its routers; one Envoy in front of them.
        replicas: if peer { 1 } else { replicas },
        concurrency: opts.concurrency,
        replica_concurrency: opts.replica_concurrency,
        front_concurrency: opts.front_concurrency,
        drain_s: opts.drain_s,
    };
    let mut deployment = Deployment::start(&boot, policy.name(), &deploy)?;
    let port = deployment.port();
    let span_ms = SessionPlan::last_arrival_ms(plans);
    let t0 = Instant::now() + Duration::from_millis(200);
    // The same instant on the mocks' clock (their quota windows are in unix ms).
    let t0_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
        + 200;
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
    let keys: Vec<summary::KeyUsage> = ENDPOINTS
        .iter()
        .zip(&mocks)
        .zip(&budgets)
        .map(|(((name, _), m), tokens)| summary::KeyUsage {
            endpoint: name.to_string(),
            tokens: *tokens,
            window_ms: QUOTA_WINDOW_MS,
            log: m.quota_usage(),
        })
        .collect();
    if let Some(dir) = &opts.raw_dir {
        let name = raw_name(policy, replicas);
        let path = raw_path(dir, policy, scenario, replicas);
        let mut text = String::new();
        let mut sorted: Vec<&Record> = recs.iter().collect();
        sorted.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
        for r in sorted {
            text.push_str(&r.to_json().to_string());
            text.push('\n');
        }
        let _ = std::fs::write(path, text);
        if !gathered.timeline.is_empty() {
            let lines: Vec<String> = gathered.timeline.iter().map(|v| v.to_string()).collect();
            let path = dir.join(format!("{name}-{}-timeline.jsonl", scenario.name()));
            let _ = std::fs::write(path, lines.join("\n") + "\n");
        }
        // The keys' budgets and use, for reading the moves again (`summary::quota_moves`).
        if !keys.is_empty() {
            let usage: Vec<serde_json::Value> = keys
                .iter()
                .map(|k| json!({"endpoint": k.endpoint, "tokens": k.tokens, "window_ms": k.window_ms, "log": k.log}))
                .collect();
            let path = dir.join(format!("{name}-{}-quota-usage.json", scenario.name()));
            let _ = std::fs::write(
                path,
                json!({"t0_unix_ms": t0_unix_ms, "keys": usage}).to_string(),
            );
        }
    }
    drop(deployment);
    drop(routers);
    drop(mocks);
    let mut s = summary::summarize(policy, scenario, replicas as u32, &recs, upstream, span_ms);
    s.restarts = restarts;
    s.decisions = gathered.decisions();
    // The estimate once warm: from a fifth of the arrival span on.
    s.slowness = gathered.slowness_spread(span_ms as f64 * 0.2);
    s.upstream_429 = upstream_429;
    if !keys.is_empty() {
        let max_tokens = |r: &Record| {
            plans
                .iter()
                .find(|p| p.index == r.session)
                .and_then(|p| p.max_tokens.get(r.turn))
                .copied()
                .unwrap_or(0)
        };
        s.quota_moves = Some(summary::quota_moves(&recs, &keys, t0_unix_ms, max_tokens));
    }
    s.wall_s = started.elapsed().as_secs_f64();
    Ok(s)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A run's workload as the driver's defaults make it (shared with the other modes' tests).
    pub(crate) fn base() -> WorkloadParams {
        WorkloadParams {
            sessions: 200,
            turns: 6,
            rate_per_s: 20.0,
            think_ms: 800,
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
        }
    }

    #[test]
    fn shared_prefix_is_issue_20s_workload_on_small_caches() {
        let w = Scenario::SharedPrefix.workload(&base());
        assert_eq!((w.system_prompts, w.system_tokens, w.turns), (48, 3_000, 2));
        assert_eq!(w.system_zipf_s, 1.0);
        assert_eq!(w.second_model_share, 0.0);
        assert_eq!(w.sessions, 600);
        // 27 requests per second, two per session.
        assert!((w.rate_per_s * w.turns as f64 - 27.0).abs() < 1e-9);
        let opts = RoutingOpts {
            mock_args: Vec::new(),
            prefill_us: 100,
            concurrency: 2,
            replica_concurrency: 1,
            front_concurrency: 1,
            drain_s: 1,
            envoy_retries: true,
            open_ms: 3000,
            plugin_extra: serde_json::Value::Null,
            request_timeout: Duration::from_secs(30),
            raw_dir: None,
        };
        let args = Scenario::SharedPrefix.endpoint_args(0, &opts);
        assert_eq!(
            args,
            ["--cache-tokens", "64000", "--prefill-us-per-token", "80"]
        );
        // No engine can hold every prompt.
        assert!(SHARED_CACHE_TOKENS < (SHARED_APPS * SHARED_SYSTEM_TOKENS) as u64);
        let m = Scenario::MixedPrefix.workload(&base());
        assert_eq!((m.system_prompts, m.sessions, m.turns), (8, 200, 6));
        assert_eq!(m.second_model_share, 0.2);
        assert_eq!(Scenario::Steady.workload(&base()).system_prompts, 0);
        let p = Scenario::SharedPreamble.workload(&base());
        assert_eq!(
            (
                p.system_prompts,
                p.system_head_tokens,
                p.system_tokens,
                p.sessions
            ),
            (48, 2_000, 1_000, 600)
        );
        assert_eq!(
            Scenario::SharedPreamble.endpoint_args(0, &opts),
            ["--cache-tokens", "32000", "--prefill-us-per-token", "80"]
        );
        assert!(
            PREAMBLE_CACHE_TOKENS
                < (PREAMBLE_HEAD_TOKENS + SHARED_APPS * PREAMBLE_TAIL_TOKENS) as u64
        );
        assert_eq!(
            Scenario::parse("shared_prefix"),
            Some(Scenario::SharedPrefix)
        );
        assert!(
            !Scenario::ALL.contains(&Scenario::SharedPrefix),
            "not in the default run"
        );
    }

    #[test]
    fn plugin_keys_merge_later_over_earlier() {
        let m = merged(&[
            json!({"a": 1, "b": 1}),
            serde_json::Value::Null,
            json!({"b": 2, "prefix_placement": false}),
        ]);
        assert_eq!(m, json!({"a": 1, "b": 2, "prefix_placement": false}));
        assert_eq!(merged(&[serde_json::Value::Null]), serde_json::Value::Null);
        assert_eq!(
            merged(&[Policy::FilterNoPrefix.plugin_extra()]),
            json!({"prefix_placement": false})
        );
        assert_eq!(Policy::Filter.plugin_extra(), serde_json::Value::Null);
        // The tuning keys of a scenario and a variant add up.
        assert_eq!(
            merged(&[
                Scenario::Quota.plugin_extra(),
                Policy::FilterEps25.plugin_extra()
            ]),
            json!({"tuning": {"quota_reserve_percent": QUOTA_RESERVE_PERCENT, "bounded_load_epsilon": 0.25}})
        );
    }
}
