//! What one routing run measured, from the client's records: cache hits, stickiness, latency,
//! errors, cost, per-phase figures around the fault, and how evenly new sessions were spread.
//!
//! Why its own module: the run (`routing.rs`) decides what happens, this decides what counts,
//! and the report and `--render` read the same figures back from `results.json`.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::deployment::Restart;
use super::filter_stats::Spread;
use super::routing::Scenario;
use super::topology::{Policy, ENDPOINTS};
use super::workload::{Record, Rng};

/// What one topology × policy × scenario run measured.
#[derive(Clone, Debug, Default)]
pub struct Summary {
    pub policy: String,
    pub scenario: String,
    /// Envoy replicas the client's requests were spread over (1: a lone Envoy; more: behind a
    /// round-robin front Envoy).
    pub replicas: u32,
    pub requests: u64,
    pub ok: u64,
    pub errors: u64,
    /// Errors that are 404 model_not_found (a request sent to a host that does not serve its
    /// model).
    pub wrong_model: u64,
    pub error_kinds: BTreeMap<String, u64>,
    /// Client-visible errors by HTTP status (`"io"`: no HTTP response).
    pub error_statuses: BTreeMap<String, u64>,
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
    /// `cost_per_prompt_token` relative to the lone Envoy's round_robin in the same scenario
    /// (filled later).
    pub cost_vs_round_robin: Option<f64>,
    /// Chat requests the mocks received per client request (retries and failovers included).
    pub upstream_per_request: f64,
    /// 429s the mocks answered (those the filter absorbed by failover included).
    pub upstream_429: u64,
    /// Quota scenarios: the follow-up turns that moved, split by whether the endpoint they
    /// left could still have served them (see [`quota_moves`]). `None` elsewhere.
    pub quota_moves: Option<QuotaMoves>,
    /// Per phase (before / during / after the fault window): requests, errors, cached ratio,
    /// same-endpoint share, p99.
    pub phases: BTreeMap<String, PhaseSummary>,
    /// Per model: where its new sessions went.
    pub load_spread: Vec<ModelSpread>,
    /// The replica restarts of a rolling restart.
    pub restarts: Vec<Restart>,
    /// The filter's `computeflux_decisions_total` by reason, summed over its Envoys (empty for
    /// Envoy's balancers).
    pub decisions: BTreeMap<String, u64>,
    /// Per endpoint, the spread of the filter's slowness estimate sampled once a second once
    /// warm (see `filter_stats.rs`).
    pub slowness: BTreeMap<String, Spread>,
    pub wall_s: f64,
}

/// Follow-up turns (both turns successful) answered by another endpoint than their previous
/// turn, in a run whose endpoints are API keys with token budgets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuotaMoves {
    pub moved: u64,
    /// The key left still had the turn's tokens in its window when the turn was sent (its
    /// prompt and its `max_tokens`: the key could certainly have served it), and the key taken
    /// had them too (it admitted the turn). Issue 22 wants none.
    pub both_had_quota: u64,
    /// The key left had fewer tokens left than the turn cost: the move avoided a 429.
    pub left_was_short: u64,
}

/// One key's budget and what it had used, as the mock logged it: `(unix ms, tokens used in
/// that window after the request)` per admitted request, windows aligned to multiples of
/// `window_ms` (`mock_upstream/quota.rs`).
#[derive(Clone, Debug, Default)]
pub struct KeyUsage {
    pub endpoint: String,
    pub tokens: u64,
    pub window_ms: u64,
    pub log: Vec<(u64, u64)>,
}

impl KeyUsage {
    /// Tokens used in the window holding `at_ms` before that instant.
    pub fn used_at(&self, at_ms: u64) -> u64 {
        let window_start = at_ms - at_ms % self.window_ms.max(1);
        // The log is in time order: the last entry at or before `at_ms`, if it is in the window.
        let i = self.log.partition_point(|e| e.0 <= at_ms);
        match i.checked_sub(1).and_then(|j| self.log.get(j)) {
            Some(&(t, used)) if t >= window_start => used,
            _ => 0,
        }
    }
}

/// Splits the moved follow-ups of `recs` by whether the key they left could have served them
/// when they were sent: its window's use then plus the turn's most tokens (`max_tokens(r)`:
/// its prompt and the completion it allowed; the mocks charge prompt + completion, the
/// completion drawn up to that) within its budget. `t0_unix_ms`: the run's start (`start_ms`
/// 0).
pub fn quota_moves(
    recs: &[Record],
    keys: &[KeyUsage],
    t0_unix_ms: u64,
    max_tokens: impl Fn(&Record) -> u64,
) -> QuotaMoves {
    let prev: BTreeMap<(usize, usize), &Record> =
        recs.iter().map(|r| ((r.session, r.turn), r)).collect();
    let mut out = QuotaMoves::default();
    for r in recs.iter().filter(|r| r.turn > 0 && r.ok()) {
        let Some(p) = prev.get(&(r.session, r.turn - 1)).filter(|p| p.ok()) else {
            continue;
        };
        if p.endpoint.is_none() || p.endpoint == r.endpoint {
            continue;
        }
        out.moved += 1;
        let Some(key) = keys
            .iter()
            .find(|k| Some(k.endpoint.as_str()) == p.endpoint.as_deref())
        else {
            continue;
        };
        let at = t0_unix_ms + r.start_ms.max(0.0) as u64;
        let cost = r.prompt_tokens + max_tokens(r).max(r.completion_tokens);
        if key.used_at(at) + cost <= key.tokens {
            out.both_had_quota += 1;
        } else {
            out.left_was_short += 1;
        }
    }
    out
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

/// Where one model's new sessions (first turns answered) went, against the endpoints' weights.
/// Every bench endpoint has the default weight 1, so an endpoint's weight share is 1 / (the
/// number of endpoints serving the model).
#[derive(Clone, Debug, Default)]
pub struct ModelSpread {
    pub model: String,
    /// `(endpoint, new sessions)` for each endpoint configured for the model.
    pub sessions: Vec<(String, u64)>,
    /// Max over the endpoints of (its share of the model's new sessions) ÷ (its weight share).
    pub max_ratio: f64,
    /// The `max_ratio` that a placement drawing each session independently in proportion to
    /// weight exceeds in 5 % of draws with this many sessions (what sampling noise alone gives).
    pub random_p95: f64,
}

impl ModelSpread {
    pub fn total(&self) -> u64 {
        self.sessions.iter().map(|(_, n)| n).sum()
    }
}

/// The `q` quantile (0..=1) of sorted values, nearest rank.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted.get(rank - 1).copied().unwrap_or(f64::NAN)
}

pub fn ratio(a: u64, b: u64) -> f64 {
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

/// Where each model's new sessions went among `endpoints` (the run's configured endpoints).
pub fn load_spread(recs: &[Record], endpoints: &[(&str, &[&str])]) -> Vec<ModelSpread> {
    let mut models: Vec<&str> = endpoints.iter().flat_map(|e| e.1.iter().copied()).collect();
    models.sort_unstable();
    models.dedup();
    models
        .into_iter()
        .map(|model| {
            let serving: Vec<&str> = endpoints
                .iter()
                .filter(|e| e.1.contains(&model))
                .map(|e| e.0)
                .collect();
            let sessions: Vec<(String, u64)> = serving
                .iter()
                .map(|ep| {
                    let n = recs
                        .iter()
                        .filter(|r| r.turn == 0 && r.ok() && r.model == model)
                        .filter(|r| r.endpoint.as_deref() == Some(*ep))
                        .count() as u64;
                    (ep.to_string(), n)
                })
                .collect();
            let total: u64 = sessions.iter().map(|(_, n)| n).sum();
            let fair = total as f64 / serving.len().max(1) as f64;
            let max_ratio = sessions
                .iter()
                .map(|(_, n)| *n as f64 / fair)
                .fold(f64::NAN, f64::max);
            ModelSpread {
                model: model.to_string(),
                sessions,
                max_ratio,
                random_p95: random_max_ratio_p95(total, serving.len()),
            }
        })
        .collect()
}

/// The 95th percentile of `max count ÷ (n / k)` when `n` sessions are each placed on one of `k`
/// equally weighted endpoints uniformly at random (Monte Carlo, 2000 draws, fixed seed).
pub fn random_max_ratio_p95(n: u64, k: usize) -> f64 {
    if n == 0 || k == 0 {
        return f64::NAN;
    }
    let mut rng = Rng::new(0x5eed_10ad);
    let mut maxima: Vec<f64> = (0..2000)
        .map(|_| {
            let mut counts = vec![0u64; k];
            for _ in 0..n {
                let i = (rng.next_u64() % k as u64) as usize;
                if let Some(c) = counts.get_mut(i) {
                    *c += 1;
                }
            }
            let max = counts.iter().copied().max().unwrap_or(0);
            max as f64 * k as f64 / n as f64
        })
        .collect();
    maxima.sort_by(f64::total_cmp);
    quantile(&maxima, 0.95)
}

/// The figures of one run whose arrivals spanned `span_ms`.
pub fn summarize(
    policy: Policy,
    scenario: Scenario,
    replicas: u32,
    recs: &[Record],
    upstream_requests: u64,
    span_ms: u64,
) -> Summary {
    let mut s = Summary {
        policy: policy.name().into(),
        scenario: scenario.name().into(),
        replicas,
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
            let status = if r.status == 0 {
                "io".to_string()
            } else {
                r.status.to_string()
            };
            *s.error_statuses.entry(status).or_insert(0) += 1;
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
    s.load_spread = load_spread(recs, ENDPOINTS.get(..scenario.endpoints()).unwrap_or(&[]));
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

/// Fills `cost_vs_round_robin` from the lone Envoy's round_robin row of each scenario.
pub fn relate_costs(rows: &mut [Summary]) {
    let base: BTreeMap<String, f64> = rows
        .iter()
        .filter(|r| r.policy == Policy::RoundRobin.name() && r.replicas <= 1)
        .map(|r| (r.scenario.clone(), r.cost_per_prompt_token))
        .collect();
    for r in rows.iter_mut() {
        r.cost_vs_round_robin = base.get(&r.scenario).map(|b| r.cost_per_prompt_token / b);
    }
}

pub fn num(x: f64) -> Value {
    if x.is_finite() {
        json!((x * 10_000.0).round() / 10_000.0)
    } else {
        Value::Null
    }
}

impl Summary {
    /// The row's label in tables: the policy, with `×N` for N replicas.
    pub fn label(&self) -> String {
        label(&self.policy, self.replicas)
    }

    pub fn error_rate(&self) -> f64 {
        ratio(self.errors, self.requests)
    }

    /// The largest load-spread ratio over the models.
    pub fn max_spread(&self) -> f64 {
        self.load_spread
            .iter()
            .map(|m| m.max_ratio)
            .fold(f64::NAN, f64::max)
    }

    /// `"503 ×2, io ×1"`, or `"–"`.
    pub fn statuses(&self) -> String {
        if self.error_statuses.is_empty() {
            return "–".into();
        }
        self.error_statuses
            .iter()
            .map(|(k, v)| format!("{k} ×{v}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

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
        let spread: Vec<Value> = self
            .load_spread
            .iter()
            .map(|m| {
                json!({
                    "model": m.model,
                    "new_sessions": m.sessions.iter().map(|(e, n)| (e.clone(), json!(n))).collect::<serde_json::Map<_, _>>(),
                    "max_ratio_to_weight_share": num(m.max_ratio),
                    "random_placement_p95": num(m.random_p95),
                })
            })
            .collect();
        let restarts: Vec<Value> = self
            .restarts
            .iter()
            .map(|r| {
                json!({
                    "replica": r.replica, "drain_ms": num(r.drain_ms),
                    "stopped_ms": num(r.stopped_ms), "ready_ms": num(r.ready_ms),
                    "open_requests": r.open_requests, "open_connections": r.open_connections,
                })
            })
            .collect();
        json!({
            "policy": self.policy,
            "scenario": self.scenario,
            "replicas": self.replicas,
            "requests": self.requests,
            "ok": self.ok,
            "errors": self.errors,
            "error_rate": num(ratio(self.errors, self.requests)),
            "wrong_model_errors": self.wrong_model,
            "error_kinds": self.error_kinds,
            "error_statuses": self.error_statuses,
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
            "upstream_429": self.upstream_429,
            "quota_moves": self.quota_moves.map_or(Value::Null, |m| json!({
                "moved": m.moved, "both_had_quota": m.both_had_quota,
                "left_was_short": m.left_was_short,
            })),
            "phases": phases,
            "load_spread": spread,
            "restarts": restarts,
            "decisions": self.decisions,
            "slowness_permille": self.slowness.iter().map(|(e, s)| (e.clone(), s.to_json())).collect::<serde_json::Map<_, _>>(),
            "wall_s": num(self.wall_s),
        })
    }

    /// The inverse of [`Summary::to_json`] (for re-rendering a report from `results.json`).
    /// Rows of runs before the replicated topology read as one Envoy.
    pub fn from_json(v: &Value) -> Summary {
        let f = |p: &str| v.pointer(p).and_then(Value::as_f64).unwrap_or(f64::NAN);
        let u = |p: &str| v.pointer(p).and_then(Value::as_u64).unwrap_or(0);
        let st = |p: &str| {
            v.pointer(p)
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string()
        };
        let counts = |k: &str| -> BTreeMap<String, u64> {
            v.get(k)
                .and_then(Value::as_object)
                .map(|o| {
                    o.iter()
                        .map(|(k, n)| (k.clone(), n.as_u64().unwrap_or(0)))
                        .collect()
                })
                .unwrap_or_default()
        };
        let arr = |k: &str| {
            v.get(k)
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default()
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
        let load_spread = arr("load_spread")
            .iter()
            .map(|m| {
                let f = |q: &str| m.get(q).and_then(Value::as_f64).unwrap_or(f64::NAN);
                ModelSpread {
                    model: m
                        .get("model")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string(),
                    sessions: m
                        .get("new_sessions")
                        .and_then(Value::as_object)
                        .map(|o| {
                            o.iter()
                                .map(|(e, n)| (e.clone(), n.as_u64().unwrap_or(0)))
                                .collect()
                        })
                        .unwrap_or_default(),
                    max_ratio: f("max_ratio_to_weight_share"),
                    random_p95: f("random_placement_p95"),
                }
            })
            .collect();
        let restarts = arr("restarts")
            .iter()
            .map(|r| {
                let f = |q: &str| r.get(q).and_then(Value::as_f64).unwrap_or(f64::NAN);
                let u = |q: &str| r.get(q).and_then(Value::as_u64).unwrap_or(0);
                Restart {
                    replica: u("replica") as usize,
                    drain_ms: f("drain_ms"),
                    stopped_ms: f("stopped_ms"),
                    ready_ms: f("ready_ms"),
                    open_requests: u("open_requests"),
                    open_connections: u("open_connections"),
                }
            })
            .collect();
        Summary {
            policy: st("/policy"),
            scenario: st("/scenario"),
            replicas: v
                .get("replicas")
                .and_then(Value::as_u64)
                .map_or(1, |n| n as u32),
            requests: u("/requests"),
            ok: u("/ok"),
            errors: u("/errors"),
            wrong_model: u("/wrong_model_errors"),
            error_kinds: counts("error_kinds"),
            error_statuses: counts("error_statuses"),
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
            upstream_429: v.get("upstream_429").and_then(Value::as_u64).unwrap_or(0),
            quota_moves: v
                .get("quota_moves")
                .filter(|m| m.is_object())
                .map(|m| QuotaMoves {
                    moved: m.get("moved").and_then(Value::as_u64).unwrap_or(0),
                    both_had_quota: m.get("both_had_quota").and_then(Value::as_u64).unwrap_or(0),
                    left_was_short: m.get("left_was_short").and_then(Value::as_u64).unwrap_or(0),
                }),
            phases,
            load_spread,
            restarts,
            decisions: counts("decisions"),
            slowness: v
                .get("slowness_permille")
                .and_then(Value::as_object)
                .map(|o| {
                    o.iter()
                        .map(|(e, s)| (e.clone(), Spread::from_json(s)))
                        .collect()
                })
                .unwrap_or_default(),
            wall_s: f("/wall_s"),
        }
    }
}

/// A row label: `policy` for a lone Envoy, `policy ×N` for N replicas.
pub fn label(policy: &str, replicas: u32) -> String {
    if replicas <= 1 {
        policy.to_string()
    } else {
        format!("{policy} ×{replicas}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(session: usize, turn: usize, model: &'static str, ep: &str) -> Record {
        Record {
            session,
            app: None,
            model,
            turn,
            start_ms: 0.0,
            latency_ms: 1.0,
            ttfb_ms: 1.0,
            stream: false,
            completion_tokens: 16,
            status: 200,
            endpoint: Some(ep.into()),
            prompt_tokens: 10,
            cached_tokens: 0,
            attempts: None,
            affinity: None,
            replica: None,
            error: None,
        }
    }

    #[test]
    fn load_spread_counts_first_turns_per_model_against_equal_weights() {
        let eps: &[(&str, &[&str])] = &[("a", &["m1", "m2"]), ("b", &["m1", "m2"]), ("c", &["m1"])];
        let recs = vec![
            rec(0, 0, "m1", "a"),
            rec(0, 1, "m1", "b"), // a follow-up: not a new session
            rec(1, 0, "m1", "a"),
            rec(2, 0, "m1", "c"),
            rec(3, 0, "m2", "b"),
        ];
        let s = load_spread(&recs, eps);
        let m1 = s.iter().find(|m| m.model == "m1").unwrap();
        assert_eq!(
            m1.sessions,
            vec![("a".into(), 2), ("b".into(), 0), ("c".into(), 1)]
        );
        // a has 2 of 3 sessions against a weight share of 1/3: ratio 2.
        assert!((m1.max_ratio - 2.0).abs() < 1e-9);
        let m2 = s.iter().find(|m| m.model == "m2").unwrap();
        assert_eq!(m2.total(), 1);
        assert!((m2.max_ratio - 2.0).abs() < 1e-9);
    }

    #[test]
    fn random_placement_noise_shrinks_with_more_sessions() {
        let few = random_max_ratio_p95(40, 2);
        let many = random_max_ratio_p95(4000, 2);
        assert!(few > 1.15 && few < 1.5, "{few}");
        assert!(many > 1.0 && many < 1.05, "{many}");
    }

    #[test]
    fn a_move_counts_as_avoidable_when_the_key_left_had_the_tokens() {
        // Key `c`: 100 tokens per 1000 ms window; 80 used at 10 ms into the window starting at
        // 1_000_000 (t0 = 1_000_000).
        let keys = vec![KeyUsage {
            endpoint: "c".into(),
            tokens: 100,
            window_ms: 1_000,
            log: vec![(1_000_010, 80)],
        }];
        let at = |session, turn, ep, ms: f64| Record {
            start_ms: ms,
            ..rec(session, turn, "m1", ep)
        };
        let recs = vec![
            // Session 0 leaves `c` at 20 ms: 80 + 26 > 100, a 429 avoided.
            at(0, 0, "c", 0.0),
            at(0, 1, "a", 20.0),
            // Session 1 leaves `c` in the next window (nothing used yet): avoidable.
            at(1, 0, "c", 0.0),
            at(1, 1, "a", 1_005.0),
            // Session 2 leaves `a` (no budget known): counted as moved only.
            at(2, 0, "a", 0.0),
            at(2, 1, "b", 5.0),
            // Session 3 stays.
            at(3, 0, "c", 0.0),
            at(3, 1, "c", 5.0),
        ];
        let m = quota_moves(&recs, &keys, 1_000_000, |r| r.completion_tokens);
        assert_eq!(
            m,
            QuotaMoves {
                moved: 3,
                both_had_quota: 1,
                left_was_short: 1
            }
        );
        let c = keys.first().unwrap();
        assert_eq!(c.used_at(1_000_009), 0);
        assert_eq!(c.used_at(1_000_999), 80);
        assert_eq!(c.used_at(1_001_000), 0);
    }
}
