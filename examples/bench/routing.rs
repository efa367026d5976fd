//! Routing quality: one run per policy × scenario, the same workload each time, and what the
//! client saw (cache hits, stickiness, latency, errors, cost).
//!
//! Why: the question users ask is "how much better than what Envoy already gives me?". Each run
//! starts fresh mocks (empty caches) and a fresh Envoy (no learned state), replays the identical
//! session plan, and injects the scenario's fault at the same offsets, so the rows of a scenario
//! differ only in the policy.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::support::MockUpstream;
use super::topology::{self, EnvoyProc, Policy, Setup, ENDPOINTS};
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
}

impl Scenario {
    pub const ALL: [Scenario; 5] = [
        Scenario::Steady,
        Scenario::RateLimited,
        Scenario::Down,
        Scenario::Slow,
        Scenario::Join,
    ];

    pub fn name(&self) -> &'static str {
        match self {
            Scenario::Steady => "steady",
            Scenario::RateLimited => "rate_limited",
            Scenario::Down => "down",
            Scenario::Slow => "slow",
            Scenario::Join => "join",
        }
    }

    pub fn parse(s: &str) -> Option<Scenario> {
        Scenario::ALL.into_iter().find(|x| x.name() == s)
    }

    fn endpoints(&self) -> usize {
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
            Scenario::Steady => None,
            Scenario::RateLimited | Scenario::Down => Some((at(0.3), Some(at(0.6)))),
            Scenario::Slow => Some((at(0.3), None)),
            // The new endpoint is "faulty" (absent) until it joins.
            Scenario::Join => Some((0, Some(at(0.4)))),
        }
    }

    /// One line for the report.
    pub fn describe(&self, span_ms: u64) -> String {
        let s = |ms: u64| format!("{:.1} s", ms as f64 / 1000.0);
        let ep = ENDPOINTS.get(FAULTY).map_or("a", |e| e.0);
        match (self, self.window(span_ms)) {
            (Scenario::Steady, _) => "no fault".into(),
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
            _ => String::new(),
        }
    }
}

/// Everything a routing run needs besides policy and scenario.
#[derive(Clone, Debug)]
pub struct RoutingOpts {
    pub mock_args: Vec<String>,
    pub concurrency: u32,
    pub envoy_retries: bool,
    pub open_ms: u64,
    pub request_timeout: Duration,
    /// Per-request records go here as JSON lines (diagnostics; not committed).
    pub raw_dir: Option<std::path::PathBuf>,
}

/// What one policy × scenario run measured.
#[derive(Clone, Debug, Default)]
pub struct Summary {
    pub policy: String,
    pub scenario: String,
    pub requests: u64,
    pub ok: u64,
    pub errors: u64,
    /// Errors that are 404 model_not_found (a request for m2 sent to an m1-only endpoint).
    pub wrong_model: u64,
    pub error_kinds: BTreeMap<String, u64>,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub cached_ratio: f64,
    /// Follow-up turns whose previous turn also succeeded.
    pub follow_ups: u64,
    pub same_endpoint: u64,
    pub same_endpoint_share: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// (uncached + 0.5 × cached) / prompt tokens, over successful requests.
    pub cost_per_prompt_token: f64,
    /// `cost_per_prompt_token` relative to round_robin's in the same scenario (filled later).
    pub cost_vs_round_robin: Option<f64>,
    /// Chat requests the mocks received per client request (retries and failovers included).
    pub upstream_per_request: f64,
    /// Per phase (before / during / after the fault window): requests, errors, cached ratio,
    /// same-endpoint share, p99.
    pub phases: BTreeMap<String, PhaseSummary>,
    pub wall_s: f64,
}

#[derive(Clone, Debug, Default)]
pub struct PhaseSummary {
    pub requests: u64,
    pub errors: u64,
    /// Errors other than 404 model_not_found: the ones a fault caused.
    pub other_errors: u64,
    pub cached_ratio: f64,
    pub same_endpoint_share: f64,
    pub p99_ms: f64,
}

/// The `q` quantile (0..=1) of sorted values, nearest rank.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted.get(rank - 1).copied().unwrap_or(f64::NAN)
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        f64::NAN
    } else {
        a as f64 / b as f64
    }
}

/// Same-endpoint pairs among `recs` (a follow-up counts when it and its previous turn succeeded).
fn stickiness<'a>(
    recs: impl Iterator<Item = &'a Record>,
    prev: &BTreeMap<(usize, usize), &'a Record>,
) -> (u64, u64) {
    let (mut pairs, mut same) = (0, 0);
    for r in recs.filter(|r| r.turn > 0 && r.ok()) {
        if let Some(p) = prev.get(&(r.session, r.turn - 1)).filter(|p| p.ok()) {
            pairs += 1;
            if p.endpoint.is_some() && p.endpoint == r.endpoint {
                same += 1;
            }
        }
    }
    (pairs, same)
}

fn phase(recs: &[&Record], prev: &BTreeMap<(usize, usize), &Record>) -> PhaseSummary {
    let ok: Vec<&&Record> = recs.iter().filter(|r| r.ok()).collect();
    let prompt: u64 = ok.iter().map(|r| r.prompt_tokens).sum();
    let cached: u64 = ok.iter().map(|r| r.cached_tokens).sum();
    let mut lat: Vec<f64> = ok.iter().map(|r| r.latency_ms).collect();
    lat.sort_by(f64::total_cmp);
    let (pairs, same) = stickiness(recs.iter().copied(), prev);
    PhaseSummary {
        requests: recs.len() as u64,
        errors: (recs.len() - ok.len()) as u64,
        other_errors: recs.iter().filter(|r| !r.ok() && r.status != 404).count() as u64,
        cached_ratio: ratio(cached, prompt),
        same_endpoint_share: ratio(same, pairs),
        p99_ms: quantile(&lat, 0.99),
    }
}

pub fn summarize(
    policy: Policy,
    scenario: Scenario,
    recs: &[Record],
    upstream_requests: u64,
    span_ms: u64,
) -> Summary {
    let mut s = Summary {
        policy: policy.name().into(),
        scenario: scenario.name().into(),
        requests: recs.len() as u64,
        ..Summary::default()
    };
    let prev: BTreeMap<(usize, usize), &Record> =
        recs.iter().map(|r| ((r.session, r.turn), r)).collect();
    let mut lat = Vec::new();
    for r in recs {
        if r.ok() {
            s.ok += 1;
            s.prompt_tokens += r.prompt_tokens;
            s.cached_tokens += r.cached_tokens;
            lat.push(r.latency_ms);
        } else {
            s.errors += 1;
            let kind = r
                .error
                .clone()
                .unwrap_or_else(|| format!("http {}", r.status));
            if r.status == 404 {
                s.wrong_model += 1;
            }
            *s.error_kinds.entry(kind).or_insert(0) += 1;
        }
    }
    lat.sort_by(f64::total_cmp);
    s.p50_ms = quantile(&lat, 0.50);
    s.p90_ms = quantile(&lat, 0.90);
    s.p99_ms = quantile(&lat, 0.99);
    s.max_ms = lat.last().copied().unwrap_or(f64::NAN);
    s.cached_ratio = ratio(s.cached_tokens, s.prompt_tokens);
    let (pairs, same) = stickiness(recs.iter(), &prev);
    s.follow_ups = pairs;
    s.same_endpoint = same;
    s.same_endpoint_share = ratio(same, pairs);
    let uncached = s.prompt_tokens.saturating_sub(s.cached_tokens) as f64;
    s.cost_per_prompt_token = (uncached + 0.5 * s.cached_tokens as f64) / s.prompt_tokens as f64;
    s.upstream_per_request = ratio(upstream_requests, s.requests);
    if let Some((a, b)) = scenario.window(span_ms) {
        let (a, b) = (a as f64, b.map_or(f64::INFINITY, |b| b as f64));
        let mut by: BTreeMap<&str, Vec<&Record>> = BTreeMap::new();
        for r in recs {
            let key = if r.start_ms < a {
                "before"
            } else if r.start_ms < b {
                "during"
            } else {
                "after"
            };
            by.entry(key).or_default().push(r);
        }
        for (k, v) in by {
            s.phases.insert(k.to_string(), phase(&v, &prev));
        }
    }
    if scenario == Scenario::Steady {
        // The same windows without a fault: what "after the fault" is compared with.
        for sc in Scenario::ALL {
            if let Some((_, Some(end))) = sc.window(span_ms) {
                let v: Vec<&Record> = recs.iter().filter(|r| r.start_ms >= end as f64).collect();
                s.phases
                    .insert(format!("after:{}", sc.name()), phase(&v, &prev));
            }
        }
    }
    s
}

/// Applies the scenario's fault changes at their offsets from `t0` (runs in its own thread).
fn inject(scenario: Scenario, mocks: &[MockUpstream], span_ms: u64, t0: Instant) {
    let Some((start, end)) = scenario.window(span_ms) else {
        return;
    };
    let wait_until = |ms: u64| {
        if let Some(d) = (t0 + Duration::from_millis(ms)).checked_duration_since(Instant::now()) {
            std::thread::sleep(d);
        }
    };
    match scenario {
        Scenario::Steady | Scenario::Join => {}
        Scenario::RateLimited => {
            let Some(m) = mocks.get(FAULTY) else { return };
            wait_until(start);
            m.set_fault(json!({"mode": "status", "status": 429, "retry_after": "2"}));
            wait_until(end.unwrap_or(start));
            m.clear_fault();
        }
        Scenario::Down => {
            let Some(m) = mocks.get(FAULTY) else { return };
            wait_until(start);
            m.set_fault(json!({"mode": "refuse"}));
            wait_until(end.unwrap_or(start));
            // Back after a restart: its KV cache is gone.
            m.flush_cache();
            m.clear_fault();
        }
        Scenario::Slow => {
            let Some(m) = mocks.get(FAULTY) else { return };
            wait_until(start);
            m.set_fault(json!({"mode": "slow", "factor": 5}));
        }
    }
    if scenario == Scenario::Join {
        if let Some(m) = mocks.get(4) {
            wait_until(end.unwrap_or(start));
            m.clear_fault();
        }
    }
}

/// One policy × scenario run.
pub fn run(
    policy: Policy,
    scenario: Scenario,
    plans: &[SessionPlan],
    opts: &RoutingOpts,
    wasm: &std::path::Path,
) -> Result<Summary, String> {
    let started = Instant::now();
    let mocks = topology::start_mocks(scenario.endpoints(), &opts.mock_args);
    for m in &mocks {
        topology::record_pid(m.pid());
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
    };
    let boot = topology::bootstrap(&setup, wasm)?;
    let envoy = EnvoyProc::start(&boot, opts.concurrency, policy.name())?;
    let span_ms = SessionPlan::last_arrival_ms(plans);
    let t0 = Instant::now() + Duration::from_millis(200);
    let recs = std::thread::scope(|sc| {
        let mocks = &mocks;
        sc.spawn(move || inject(scenario, mocks, span_ms, t0));
        workload::drive(envoy.port, plans, t0, opts.request_timeout)
    });
    let upstream: u64 = mocks.iter().map(MockUpstream::request_count).sum();
    if let Some(dir) = &opts.raw_dir {
        let path = dir.join(format!("{}-{}.jsonl", policy.name(), scenario.name()));
        let mut text = String::new();
        let mut sorted: Vec<&Record> = recs.iter().collect();
        sorted.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
        for r in sorted {
            text.push_str(&r.to_json().to_string());
            text.push('\n');
        }
        let _ = std::fs::write(path, text);
    }
    drop(envoy);
    drop(mocks);
    let mut s = summarize(policy, scenario, &recs, upstream, span_ms);
    s.wall_s = started.elapsed().as_secs_f64();
    Ok(s)
}

/// Fills `cost_vs_round_robin` from the round_robin row of each scenario.
pub fn relate_costs(rows: &mut [Summary]) {
    let base: BTreeMap<String, f64> = rows
        .iter()
        .filter(|r| r.policy == Policy::RoundRobin.name())
        .map(|r| (r.scenario.clone(), r.cost_per_prompt_token))
        .collect();
    for r in rows.iter_mut() {
        r.cost_vs_round_robin = base.get(&r.scenario).map(|b| r.cost_per_prompt_token / b);
    }
}

fn num(x: f64) -> Value {
    if x.is_finite() {
        json!((x * 10_000.0).round() / 10_000.0)
    } else {
        Value::Null
    }
}

impl Summary {
    pub fn to_json(&self) -> Value {
        let phases: serde_json::Map<String, Value> = self
            .phases
            .iter()
            .map(|(k, p)| {
                (
                    k.clone(),
                    json!({
                        "requests": p.requests, "errors": p.errors,
                        "errors_other_than_404": p.other_errors,
                        "cached_ratio": num(p.cached_ratio),
                        "same_endpoint_share": num(p.same_endpoint_share),
                        "p99_ms": num(p.p99_ms),
                    }),
                )
            })
            .collect();
        json!({
            "policy": self.policy,
            "scenario": self.scenario,
            "requests": self.requests,
            "ok": self.ok,
            "errors": self.errors,
            "error_rate": num(ratio(self.errors, self.requests)),
            "wrong_model_errors": self.wrong_model,
            "error_kinds": self.error_kinds,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_ratio": num(self.cached_ratio),
            "follow_ups": self.follow_ups,
            "same_endpoint": self.same_endpoint,
            "same_endpoint_share": num(self.same_endpoint_share),
            "latency_ms": {"p50": num(self.p50_ms), "p90": num(self.p90_ms), "p99": num(self.p99_ms), "max": num(self.max_ms)},
            "cost_per_prompt_token": num(self.cost_per_prompt_token),
            "cost_vs_round_robin": self.cost_vs_round_robin.map_or(Value::Null, num),
            "upstream_requests_per_request": num(self.upstream_per_request),
            "phases": phases,
            "wall_s": num(self.wall_s),
        })
    }

    pub fn error_rate(&self) -> f64 {
        ratio(self.errors, self.requests)
    }

    /// The inverse of [`Summary::to_json`] (for re-rendering a report from `results.json`).
    pub fn from_json(v: &Value) -> Summary {
        let f = |p: &str| v.pointer(p).and_then(Value::as_f64).unwrap_or(f64::NAN);
        let u = |p: &str| v.pointer(p).and_then(Value::as_u64).unwrap_or(0);
        let st = |p: &str| {
            v.pointer(p)
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string()
        };
        let phases = v
            .get("phases")
            .and_then(Value::as_object)
            .map(|o| {
                o.iter()
                    .map(|(k, p)| {
                        let f = |q: &str| p.get(q).and_then(Value::as_f64).unwrap_or(f64::NAN);
                        let u = |q: &str| p.get(q).and_then(Value::as_u64).unwrap_or(0);
                        (
                            k.clone(),
                            PhaseSummary {
                                requests: u("requests"),
                                errors: u("errors"),
                                other_errors: u("errors_other_than_404"),
                                cached_ratio: f("cached_ratio"),
                                same_endpoint_share: f("same_endpoint_share"),
                                p99_ms: f("p99_ms"),
                            },
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        let error_kinds = v
            .get("error_kinds")
            .and_then(Value::as_object)
            .map(|o| {
                o.iter()
                    .map(|(k, n)| (k.clone(), n.as_u64().unwrap_or(0)))
                    .collect()
            })
            .unwrap_or_default();
        Summary {
            policy: st("/policy"),
            scenario: st("/scenario"),
            requests: u("/requests"),
            ok: u("/ok"),
            errors: u("/errors"),
            wrong_model: u("/wrong_model_errors"),
            error_kinds,
            prompt_tokens: u("/prompt_tokens"),
            cached_tokens: u("/cached_tokens"),
            cached_ratio: f("/cached_ratio"),
            follow_ups: u("/follow_ups"),
            same_endpoint: u("/same_endpoint"),
            same_endpoint_share: f("/same_endpoint_share"),
            p50_ms: f("/latency_ms/p50"),
            p90_ms: f("/latency_ms/p90"),
            p99_ms: f("/latency_ms/p99"),
            max_ms: f("/latency_ms/max"),
            cost_per_prompt_token: f("/cost_per_prompt_token"),
            cost_vs_round_robin: v.get("cost_vs_round_robin").and_then(Value::as_f64),
            upstream_per_request: f("/upstream_requests_per_request"),
            phases,
            wall_s: f("/wall_s"),
        }
    }
}
