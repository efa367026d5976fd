//! What counts in the noisy-neighbour runs (`noisy_neighbor.rs`), and the report's tables and
//! checks, computed from the rows alone.
//!
//! Latency percentiles are over the requests that got a complete 2xx answer or were left to
//! time out (counted at the time the client gave up, so a percentile that includes one is a
//! lower bound, written "≥"); an error answer (429, 503, …) is counted apart, not as a latency.
//! The noisy tenant's served rate is its 2xx answers completed during the noise phase (to
//! requests sent in it), divided by the phase's length: the throughput it gets while the fleet
//! is overloaded (what the engines' backlog serves after the phase does not count).
//!
//! The "Done when", per row:
//! - the quiet tenant's p99 under the noise ≤ [`P99_FACTOR`] × its p99 alone;
//! - 0 errors for the quiet tenant (every phase);
//! - the noisy tenant's served rate ≥ [`SERVED_SHARE`] × least_request's (one Envoy, same run):
//!   it still receives the capacity the quiet tenant leaves;
//! - nothing left to time out (either tenant, every phase);
//! - steady (no overload): 0 shed, and no request waited when the filter says how long one did;
//! - three replicas: the same checks, and the quiet p99 under the noise and the noisy served rate
//!   within [`REPLICA_TOLERANCE`] of one Envoy's.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::summary::quantile;

pub const P99_FACTOR: f64 = 1.5;
pub const SERVED_SHARE: f64 = 0.8;
pub const REPLICA_TOLERANCE: f64 = 0.2;

/// The response header with which the filter says it held a request before admitting it (ms);
/// only on a request that waited.
pub const QUEUE_HEADER: &str = "x-computeflux-queued-ms";

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tenant {
    Quiet = 1,
    Noisy = 2,
}

impl Tenant {
    pub fn name(&self) -> &'static str {
        match self {
            Tenant::Quiet => "quiet",
            Tenant::Noisy => "noisy",
        }
    }

    pub fn key(&self) -> &'static str {
        match self {
            Tenant::Quiet => super::noisy_neighbor::QUIET_KEY,
            Tenant::Noisy => super::noisy_neighbor::NOISY_KEY,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    Steady,
    Alone,
    Noise,
}

impl Phase {
    pub fn name(&self) -> &'static str {
        match self {
            Phase::Steady => "steady",
            Phase::Alone => "alone",
            Phase::Noise => "noise",
        }
    }
}

/// What one request got back.
#[derive(Clone, Debug)]
pub struct Rec {
    pub tenant: Tenant,
    pub phase: Phase,
    /// Sent at, ms from the run's origin.
    pub start_ms: f64,
    /// Until the whole answer was read (or the client gave up).
    pub latency_ms: f64,
    /// 0: no HTTP answer.
    pub status: u16,
    pub retry_after: Option<String>,
    /// No complete answer within the client timeout.
    pub timed_out: bool,
    pub error: Option<String>,
    pub endpoint: Option<String>,
    /// The replica that answered (`x-bench-replica`, three replicas only).
    pub replica: Option<String>,
    /// How long the filter held it ([`QUEUE_HEADER`]), when it says it did.
    pub queue_ms: Option<f64>,
    /// How long the engine held it before its own prefill (`x-mock-queued-ms`).
    pub engine_queue_ms: Option<f64>,
    pub stream: bool,
    pub max_tokens: u64,
}

impl Rec {
    pub fn ok(&self) -> bool {
        (200..300).contains(&self.status) && self.error.is_none()
    }

    pub fn to_json(&self) -> Value {
        json!({
            "tenant": self.tenant.name(), "phase": self.phase.name(),
            "start_ms": self.start_ms, "latency_ms": self.latency_ms, "status": self.status,
            "retry_after": self.retry_after, "timed_out": self.timed_out, "error": self.error,
            "endpoint": self.endpoint, "replica": self.replica, "queue_ms": self.queue_ms,
            "engine_queue_ms": self.engine_queue_ms, "stream": self.stream,
            "max_tokens": self.max_tokens,
        })
    }
}

/// One tenant in one phase (or several tenants together).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stats {
    pub sent: u64,
    pub ok: u64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// Some request left to time out is inside the percentiles (they are lower bounds).
    pub lower_bound: bool,
    /// Every request without a complete 2xx answer.
    pub errors: u64,
    pub r429: u64,
    /// 429s that carried `Retry-After`.
    pub r429_retry_after: u64,
    /// Error answers other than 429 (503, 504, cut streams, resets …).
    pub other_errors: u64,
    pub timed_out: u64,
    /// 2xx answers completed within the phase, per second of the phase (its throughput while
    /// it lasts; answers completed later count in `ok` only).
    pub served_per_s: f64,
    pub sent_per_s: f64,
    /// Requests whose answer said the filter held them ([`QUEUE_HEADER`]), and the longest
    /// hold it said (ms; 0 when none).
    pub waited: u64,
    pub waited_max_ms: f64,
    pub statuses: BTreeMap<String, u64>,
}

impl Stats {
    /// The stats of `recs`, sent in the phase `window` (ms from the run's origin).
    pub fn of(recs: &[&Rec], window: (u64, u64)) -> Stats {
        let phase_ms = window.1.saturating_sub(window.0);
        let mut lat: Vec<f64> = recs
            .iter()
            .filter(|r| r.ok() || r.timed_out)
            .map(|r| r.latency_ms)
            .collect();
        lat.sort_by(f64::total_cmp);
        let mut statuses = BTreeMap::new();
        for r in recs {
            let k = if r.timed_out {
                "timeout".to_string()
            } else if r.status == 0 {
                "no answer".to_string()
            } else {
                r.status.to_string()
            };
            *statuses.entry(k).or_insert(0) += 1;
        }
        let count = |f: &dyn Fn(&Rec) -> bool| recs.iter().filter(|r| f(r)).count() as u64;
        let secs = (phase_ms as f64 / 1000.0).max(1e-9);
        let ok = count(&|r| r.ok());
        let in_window = count(&|r| {
            r.ok() && r.start_ms + r.latency_ms <= window.1 as f64 && r.start_ms >= window.0 as f64
        });
        let r429 = count(&|r| r.status == 429);
        let timed_out = count(&|r| r.timed_out);
        let errors = recs.len() as u64 - ok;
        Stats {
            sent: recs.len() as u64,
            ok,
            p50_ms: quantile(&lat, 0.5),
            p99_ms: quantile(&lat, 0.99),
            lower_bound: timed_out > 0,
            errors,
            r429,
            r429_retry_after: count(&|r| r.status == 429 && r.retry_after.is_some()),
            other_errors: errors - r429 - timed_out,
            timed_out,
            served_per_s: in_window as f64 / secs,
            sent_per_s: recs.len() as f64 / secs,
            waited: count(&|r| r.queue_ms.is_some()),
            waited_max_ms: recs.iter().filter_map(|r| r.queue_ms).fold(0.0, f64::max),
            statuses,
        }
    }

    pub fn to_json(&self) -> Value {
        json!({
            "sent": self.sent, "ok": self.ok, "p50_ms": self.p50_ms, "p99_ms": self.p99_ms,
            "percentiles_lower_bound": self.lower_bound, "errors": self.errors,
            "r429": self.r429, "r429_retry_after": self.r429_retry_after,
            "other_errors": self.other_errors, "timed_out": self.timed_out,
            "served_per_s": self.served_per_s, "sent_per_s": self.sent_per_s,
            "waited": self.waited, "waited_max_ms": self.waited_max_ms,
            "statuses": self.statuses,
        })
    }

    pub fn from_json(v: &Value) -> Stats {
        let u = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
        let f = |k: &str| v.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
        Stats {
            sent: u("sent"),
            ok: u("ok"),
            p50_ms: f("p50_ms"),
            p99_ms: f("p99_ms"),
            lower_bound: v
                .get("percentiles_lower_bound")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            errors: u("errors"),
            r429: u("r429"),
            r429_retry_after: u("r429_retry_after"),
            other_errors: u("other_errors"),
            timed_out: u("timed_out"),
            served_per_s: f("served_per_s"),
            sent_per_s: f("sent_per_s"),
            waited: u("waited"),
            waited_max_ms: v
                .get("waited_max_ms")
                .and_then(Value::as_f64)
                .unwrap_or(0.0),
            statuses: v
                .get("statuses")
                .and_then(Value::as_object)
                .map(|o| {
                    o.iter()
                        .map(|(k, n)| (k.clone(), n.as_u64().unwrap_or(0)))
                        .collect()
                })
                .unwrap_or_default(),
        }
    }

    /// `p50 / p99` in ms, "≥" when a request left to time out is inside.
    fn p50_p99(&self) -> String {
        let ge = if self.lower_bound { "≥ " } else { "" };
        let ms = |x: f64| {
            if x.is_nan() {
                "–".to_string()
            } else {
                group(x.round() as u64)
            }
        };
        format!("{ge}{} / {ge}{}", ms(self.p50_ms), ms(self.p99_ms))
    }
}

/// `12345` → `12 345` (the style).
fn group(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(' ');
        }
        out.push(c);
    }
    out
}

/// One policy × topology.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunSummary {
    pub label: String,
    pub policy: String,
    pub replicas: u32,
    pub steady_quiet: Stats,
    pub steady_noisy: Stats,
    /// Both tenants of the steady phase.
    pub steady_all: Stats,
    pub alone_quiet: Stats,
    pub noise_quiet: Stats,
    pub noise_noisy: Stats,
    /// Requests the engines received.
    pub engine_requests: u64,
    /// The filter's admission counters (summed over its Envoys) at the end of the run.
    pub filter_stats: Vec<(String, u64)>,
    pub wall_s: f64,
}

pub fn summarize(
    label: &str,
    policy: &str,
    replicas: u32,
    shape: &super::noisy_neighbor::Shape,
    recs: &[Rec],
) -> RunSummary {
    let pick = |t: Option<Tenant>, p: Phase| -> Vec<&Rec> {
        recs.iter()
            .filter(|r| r.phase == p && t.is_none_or(|t| r.tenant == t))
            .collect()
    };
    let ms = |p: Phase| shape.window(p);
    RunSummary {
        label: label.to_string(),
        policy: policy.to_string(),
        replicas,
        steady_quiet: Stats::of(&pick(Some(Tenant::Quiet), Phase::Steady), ms(Phase::Steady)),
        steady_noisy: Stats::of(&pick(Some(Tenant::Noisy), Phase::Steady), ms(Phase::Steady)),
        steady_all: Stats::of(&pick(None, Phase::Steady), ms(Phase::Steady)),
        alone_quiet: Stats::of(&pick(Some(Tenant::Quiet), Phase::Alone), ms(Phase::Alone)),
        noise_quiet: Stats::of(&pick(Some(Tenant::Quiet), Phase::Noise), ms(Phase::Noise)),
        noise_noisy: Stats::of(&pick(Some(Tenant::Noisy), Phase::Noise), ms(Phase::Noise)),
        engine_requests: 0,
        filter_stats: Vec::new(),
        wall_s: 0.0,
    }
}

impl RunSummary {
    /// One of the filter's variants (the only policies that can say a request waited).
    pub fn is_filter(&self) -> bool {
        self.policy.starts_with("computeflux")
    }

    pub fn quiet_errors(&self) -> u64 {
        self.steady_quiet.errors + self.alone_quiet.errors + self.noise_quiet.errors
    }

    pub fn timed_out(&self) -> u64 {
        [
            &self.steady_all,
            &self.alone_quiet,
            &self.noise_quiet,
            &self.noise_noisy,
        ]
        .iter()
        .map(|s| s.timed_out)
        .sum()
    }

    pub fn to_json(&self) -> Value {
        json!({
            "label": self.label, "policy": self.policy, "replicas": self.replicas,
            "steady_quiet": self.steady_quiet.to_json(),
            "steady_noisy": self.steady_noisy.to_json(),
            "steady_all": self.steady_all.to_json(),
            "alone_quiet": self.alone_quiet.to_json(),
            "noise_quiet": self.noise_quiet.to_json(),
            "noise_noisy": self.noise_noisy.to_json(),
            "engine_requests": self.engine_requests,
            "filter_stats": self.filter_stats.iter().map(|(k, v)| (k.clone(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "wall_s": self.wall_s,
        })
    }

    pub fn from_json(v: &Value) -> RunSummary {
        let st = |k: &str| Stats::from_json(v.get(k).unwrap_or(&Value::Null));
        RunSummary {
            label: v.get("label").and_then(Value::as_str).unwrap_or("").into(),
            policy: v.get("policy").and_then(Value::as_str).unwrap_or("").into(),
            replicas: v.get("replicas").and_then(Value::as_u64).unwrap_or(1) as u32,
            steady_quiet: st("steady_quiet"),
            steady_noisy: st("steady_noisy"),
            steady_all: st("steady_all"),
            alone_quiet: st("alone_quiet"),
            noise_quiet: st("noise_quiet"),
            noise_noisy: st("noise_noisy"),
            engine_requests: v
                .get("engine_requests")
                .and_then(Value::as_u64)
                .unwrap_or(0),
            filter_stats: v
                .get("filter_stats")
                .and_then(Value::as_object)
                .map(|o| {
                    o.iter()
                        .map(|(k, n)| (k.clone(), n.as_u64().unwrap_or(0)))
                        .collect()
                })
                .unwrap_or_default(),
            wall_s: v.get("wall_s").and_then(Value::as_f64).unwrap_or(0.0),
        }
    }
}

/// One row's "Done when" checks. `None`: cannot be computed from the rows (no reference row).
#[derive(Clone, Debug, PartialEq)]
pub struct Checks {
    pub label: String,
    pub p99_ratio: f64,
    pub quiet_errors: u64,
    /// Noisy served ÷ least_request's (one Envoy).
    pub served_ratio: Option<f64>,
    pub timed_out: u64,
    /// Shed (429 or 503) answers in the steady phase, and requests that waited there.
    pub steady_shed: u64,
    pub steady_waited: Option<u64>,
    /// Replicated rows: (quiet p99 under noise, noisy served) relative to one Envoy's, − 1.
    pub replica_delta: Option<(f64, f64)>,
}

impl Checks {
    pub fn p99_ok(&self) -> bool {
        self.p99_ratio <= P99_FACTOR
    }

    pub fn served_ok(&self) -> Option<bool> {
        self.served_ratio.map(|r| r >= SERVED_SHARE)
    }

    pub fn steady_ok(&self) -> bool {
        self.steady_shed == 0 && self.steady_waited.unwrap_or(0) == 0
    }

    pub fn replica_ok(&self) -> Option<bool> {
        self.replica_delta
            .map(|(a, b)| a.abs() <= REPLICA_TOLERANCE && b.abs() <= REPLICA_TOLERANCE)
    }

    /// Every check that applies passes.
    pub fn all_ok(&self) -> bool {
        self.p99_ok()
            && self.quiet_errors == 0
            && self.served_ok().unwrap_or(false)
            && self.timed_out == 0
            && self.steady_ok()
            && self.replica_ok().unwrap_or(true)
    }
}

/// The checks of every row, from the rows alone.
pub fn checks(rows: &[RunSummary]) -> Vec<Checks> {
    let reference = rows
        .iter()
        .find(|r| r.policy == "least_request" && r.replicas <= 1)
        .map(|r| r.noise_noisy.served_per_s);
    rows.iter()
        .map(|r| {
            let single = rows
                .iter()
                .find(|o| o.policy == r.policy && o.replicas <= 1 && r.replicas > 1);
            Checks {
                label: r.label.clone(),
                p99_ratio: r.noise_quiet.p99_ms / r.alone_quiet.p99_ms,
                quiet_errors: r.quiet_errors(),
                served_ratio: reference
                    .filter(|x| *x > 0.0)
                    .map(|x| r.noise_noisy.served_per_s / x),
                timed_out: r.timed_out(),
                steady_shed: r
                    .steady_all
                    .statuses
                    .iter()
                    .filter(|(k, _)| *k == "429" || *k == "503")
                    .map(|(_, n)| n)
                    .sum(),
                steady_waited: r.is_filter().then_some(r.steady_all.waited),
                replica_delta: single.map(|s| {
                    (
                        r.noise_quiet.p99_ms / s.noise_quiet.p99_ms - 1.0,
                        r.noise_noisy.served_per_s / s.noise_noisy.served_per_s - 1.0,
                    )
                }),
            }
        })
        .collect()
}

fn yes(ok: bool) -> &'static str {
    if ok {
        "yes"
    } else {
        "**no**"
    }
}

/// The figures' table.
pub fn figures_table(rows: &[RunSummary]) -> String {
    let mut s = String::from(
        "| policy | quiet alone p50 / p99 ms | quiet under noise p50 / p99 ms | quiet errors | \
         noisy sent /s | noisy served /s | noisy 429 (with Retry-After) | noisy other errors | \
         left to time out (noisy / quiet) | held by the filter under noise, quiet / noisy (longest, \
         ms) | steady p50 / p99 ms (both tenants) | steady shed | steady waited (longest, ms) | \
         run s |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        let held = |x: &Stats| {
            if !r.is_filter() {
                "–".to_string()
            } else if x.waited == 0 {
                "0".to_string()
            } else {
                format!("{} ({})", x.waited, group(x.waited_max_ms.round() as u64))
            }
        };
        let waited = held(&r.steady_all);
        let under_noise = format!("{} / {}", held(&r.noise_quiet), held(&r.noise_noisy));
        let other: Vec<String> = r
            .noise_noisy
            .statuses
            .iter()
            .filter(|(k, _)| !matches!(k.as_str(), "200" | "429" | "timeout"))
            .map(|(k, n)| format!("{n} × {k}"))
            .collect();
        let shed: u64 = r
            .steady_all
            .statuses
            .iter()
            .filter(|(k, _)| *k == "429" || *k == "503")
            .map(|(_, n)| n)
            .sum();
        s.push_str(&format!(
            "| {} | {} | {} | {} | {:.1} | {:.1} | {} ({}) | {} | {} / {} | {} | {} | {} | {} | {:.0} |\n",
            r.label,
            r.alone_quiet.p50_p99(),
            r.noise_quiet.p50_p99(),
            r.quiet_errors(),
            r.noise_noisy.sent_per_s,
            r.noise_noisy.served_per_s,
            r.noise_noisy.r429,
            r.noise_noisy.r429_retry_after,
            if other.is_empty() {
                "0".to_string()
            } else {
                other.join(", ")
            },
            r.noise_noisy.timed_out,
            r.alone_quiet.timed_out + r.noise_quiet.timed_out + r.steady_quiet.timed_out,
            under_noise,
            r.steady_all.p50_p99(),
            shed,
            waited,
            r.wall_s
        ));
    }
    s
}

/// The checks' table.
pub fn checks_table(rows: &[RunSummary]) -> String {
    let mut s = format!(
        "| policy | quiet p99 under noise ÷ alone (≤ {P99_FACTOR}) | quiet errors (0) | noisy \
         served ÷ least_request's (≥ {SERVED_SHARE}) | left to time out (0) | steady: 0 shed, \
         none waited | ×3 against one Envoy: quiet p99, noisy served (within ± {:.0} %) | all |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n",
        REPLICA_TOLERANCE * 100.0
    );
    for c in checks(rows) {
        let served = match c.served_ratio {
            Some(x) => format!("{x:.2} {}", yes(x >= SERVED_SHARE)),
            None => "– (no least_request row)".into(),
        };
        let steady = match c.steady_waited {
            Some(w) => format!("{} shed, {w} waited {}", c.steady_shed, yes(c.steady_ok())),
            None => format!("{} shed {}", c.steady_shed, yes(c.steady_ok())),
        };
        let replica = match c.replica_delta {
            Some((a, b)) => format!(
                "{:+.0} %, {:+.0} % {}",
                a * 100.0,
                b * 100.0,
                yes(c.replica_ok().unwrap_or(false))
            ),
            None => "–".into(),
        };
        s.push_str(&format!(
            "| {} | {:.2} {} | {} {} | {} | {} {} | {} | {} | {} |\n",
            c.label,
            c.p99_ratio,
            yes(c.p99_ok()),
            c.quiet_errors,
            yes(c.quiet_errors == 0),
            served,
            c.timed_out,
            yes(c.timed_out == 0),
            steady,
            replica,
            yes(c.all_ok())
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(tenant: Tenant, phase: Phase, ms: f64, status: u16) -> Rec {
        Rec {
            tenant,
            phase,
            start_ms: 0.0,
            latency_ms: ms,
            status,
            retry_after: (status == 429).then(|| "1".to_string()),
            timed_out: status == 0,
            error: (status != 200).then(|| "x".to_string()),
            endpoint: None,
            replica: None,
            queue_ms: None,
            engine_queue_ms: None,
            stream: false,
            max_tokens: 16,
        }
    }

    fn row(
        label: &str,
        policy: &str,
        replicas: u32,
        alone: f64,
        noise: f64,
        served: f64,
    ) -> RunSummary {
        let mut r = RunSummary {
            label: label.into(),
            policy: policy.into(),
            replicas,
            ..RunSummary::default()
        };
        r.alone_quiet.p99_ms = alone;
        r.noise_quiet.p99_ms = noise;
        r.noise_noisy.served_per_s = served;
        r
    }

    #[test]
    fn stats_count_errors_apart_and_timeouts_as_lower_bounds() {
        let recs = [
            rec(Tenant::Noisy, Phase::Noise, 100.0, 200),
            rec(Tenant::Noisy, Phase::Noise, 200.0, 200),
            rec(Tenant::Noisy, Phase::Noise, 2.0, 429),
            rec(Tenant::Noisy, Phase::Noise, 15_000.0, 0),
            rec(Tenant::Noisy, Phase::Noise, 30.0, 503),
        ];
        let refs: Vec<&Rec> = recs.iter().collect();
        let s = Stats::of(&refs, (0, 2_000));
        assert_eq!((s.sent, s.ok, s.errors), (5, 2, 3));
        assert_eq!(
            (s.r429, s.r429_retry_after, s.timed_out, s.other_errors),
            (1, 1, 1, 1)
        );
        assert_eq!(s.served_per_s, 1.0);
        // The 429 and the 503 are not latencies; the timeout is, as a lower bound.
        assert_eq!((s.p50_ms, s.p99_ms), (200.0, 15_000.0));
        assert!(s.lower_bound);
        assert_eq!(s.p50_p99(), "≥ 200 / ≥ 15 000");
        assert_eq!(Stats::from_json(&s.to_json()), s);
        // An answer completed after the phase counts as served, not in the phase's throughput.
        let late = rec(Tenant::Noisy, Phase::Noise, 2_500.0, 200);
        let s = Stats::of(&[&recs[0], &late], (0, 2_000));
        assert_eq!((s.ok, s.served_per_s), (2, 0.5));
    }

    #[test]
    fn checks_are_computed_from_the_rows() {
        let lr = row("least_request", "least_request", 1, 300.0, 30_000.0, 28.0);
        let mut cf = row("computeflux", "computeflux", 1, 300.0, 420.0, 25.0);
        let mut cf3 = row("computeflux ×3", "computeflux", 3, 300.0, 440.0, 24.0);
        let rows = vec![lr.clone(), cf.clone(), cf3.clone()];
        let c = checks(&rows);
        assert!(!c[0].p99_ok(), "least_request's quiet p99 explodes");
        assert!(c[1].all_ok(), "{:?}", c[1]);
        assert!((c[1].served_ratio.unwrap() - 25.0 / 28.0).abs() < 1e-12);
        assert_eq!(c[1].replica_delta, None);
        // ×3: 440 ms against 420 (+5 %), 24 against 25 served (−4 %): within 20 %.
        assert!(c[2].replica_ok().unwrap() && c[2].all_ok(), "{:?}", c[2]);
        // Each check can fail.
        cf.noise_quiet.p99_ms = 451.0;
        cf.alone_quiet.errors = 1;
        cf.noise_noisy.served_per_s = 22.0;
        cf.noise_noisy.timed_out = 2;
        cf.steady_all.statuses.insert("429".into(), 1);
        cf3.noise_quiet.p99_ms = 700.0;
        let c = checks(&[lr, cf, cf3]);
        assert!(!c[1].p99_ok());
        assert_eq!(c[1].quiet_errors, 1);
        assert_eq!(c[1].served_ok(), Some(false));
        assert_eq!((c[1].timed_out, c[1].steady_shed), (2, 1));
        assert!(!c[1].all_ok());
        assert_eq!(c[2].replica_ok(), Some(false));
        // Without least_request in the run the served check cannot pass.
        let alone = checks(&[row("computeflux", "computeflux", 1, 300.0, 300.0, 30.0)]);
        assert_eq!(alone[0].served_ok(), None);
        assert!(!alone[0].all_ok());
        assert!(checks_table(&rows).contains("| computeflux ×3 |"));
        assert_eq!(group(15_551), "15 551");
        assert_eq!(group(232), "232");
    }
}
