//! The issues' routing targets, checked against a run's figures: reported as met or missed with
//! the numbers, never asserted (a shared 2-core machine makes single runs noisy; the report shows
//! the figures so a reader can judge a near miss).
//!
//! - Issue 5 (one Envoy): stickiness and cache hits as good as ring_hash, no client errors, the
//!   best p99 in every fault scenario.
//! - Issue 10 (replicas): with three replicas ≥ 99 % follow-ups on the previous endpoint in
//!   steady state and ≥ 97 % in the 429-window, outage and join scenarios; no client-visible
//!   error while a healthy endpoint exists (every scenario here keeps three healthy); cached
//!   tokens within 1 point of the lone Envoy and ≥ ring_hash's in every scenario; the lone Envoy
//!   no worse than before (against a previous run, the [`Baseline`]); new sessions spread within
//!   1.25 × each endpoint's weight share.
//! - Issue 11 (slow endpoint): p99 ≤ 1.5 × the steady p99 of the same run and topology, cached
//!   tokens within 3 points of steady, no client-visible error; one and three replicas.

use std::fmt::Write as _;
use std::path::Path;

use serde_json::{json, Value};

use super::report::{ms, pct, Report};
use super::summary::{label, Summary};
use super::topology::Policy;

/// One checked target.
pub struct Check {
    pub issue: u32,
    /// What was checked, with the figures.
    pub text: String,
    /// None: nothing to judge (figures for context, or no data).
    pub met: Option<bool>,
}

fn check(issue: u32, met: Option<bool>, text: String) -> Check {
    Check { issue, text, met }
}

fn verdict(met: Option<bool>) -> &'static str {
    match met {
        Some(true) => "met",
        Some(false) => "**missed**",
        None => "for context",
    }
}

/// A previous run's lone-Envoy computeflux rows and the workload they ran, to tell whether the
/// lone Envoy got worse ("one replica: no scenario worse than today").
#[derive(Clone, Debug)]
pub struct Baseline {
    pub source: String,
    pub commit: String,
    pub date: String,
    pub mode: String,
    pub workload: Value,
    pub mock_args: Value,
    pub rows: Vec<Summary>,
}

impl Baseline {
    /// Reads a `results.json`; None if it is missing, unreadable or has no lone-Envoy
    /// computeflux row.
    pub fn read(path: &Path) -> Option<Baseline> {
        let text = std::fs::read_to_string(path).ok()?;
        let v: Value = serde_json::from_str(&text).ok()?;
        let rows: Vec<Summary> = v
            .get("routing")?
            .as_array()?
            .iter()
            .map(Summary::from_json)
            .filter(|r| r.policy == Policy::Filter.name() && r.replicas <= 1)
            .collect();
        if rows.is_empty() {
            return None;
        }
        let st = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_string();
        Some(Baseline {
            source: path.display().to_string(),
            commit: st("commit"),
            date: st("date"),
            mode: st("mode"),
            workload: v
                .pointer("/params/workload")
                .cloned()
                .unwrap_or(Value::Null),
            mock_args: v
                .pointer("/params/mock_args")
                .cloned()
                .unwrap_or(Value::Null),
            rows,
        })
    }

    pub fn to_json(&self) -> Value {
        json!({
            "source": self.source, "commit": self.commit, "date": self.date, "mode": self.mode,
            "workload": self.workload, "mock_args": self.mock_args,
            "routing": self.rows.iter().map(Summary::to_json).collect::<Vec<_>>(),
        })
    }

    pub fn from_json(v: &Value) -> Option<Baseline> {
        let st = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_string();
        Some(Baseline {
            source: st("source"),
            commit: st("commit"),
            date: st("date"),
            mode: st("mode"),
            workload: v.get("workload").cloned().unwrap_or(Value::Null),
            mock_args: v.get("mock_args").cloned().unwrap_or(Value::Null),
            rows: v
                .get("routing")?
                .as_array()?
                .iter()
                .map(Summary::from_json)
                .collect(),
        })
    }

    /// Ran the same workload against the same mocks as `params` (a run's `params`)?
    fn comparable(&self, params: &Value) -> bool {
        // The arrival span is derived from the rest; older runs may not have recorded it.
        let strip = |w: &Value| {
            let mut w = w.clone();
            if let Some(o) = w.as_object_mut() {
                o.remove("arrival_span_ms");
            }
            w
        };
        params.get("workload").map(strip) == Some(strip(&self.workload))
            && params.get("mock_args") == Some(&self.mock_args)
    }
}

/// Every target, checked against `rep`'s rows.
pub fn checks(rep: &Report<'_>) -> Vec<Check> {
    let mut out = Vec::new();
    issue5(rep, &mut out);
    issue10(rep, &mut out);
    issue11(rep, &mut out);
    out
}

fn issue5(rep: &Report<'_>, out: &mut Vec<Check>) {
    let cf = Policy::Filter.name();
    if let Some(st) = rep.row(1, cf, "steady") {
        out.push(check(
            5,
            Some(st.same_endpoint_share >= 0.99),
            format!(
                "Steady, follow-up turns on the previous endpoint ≥ 99 %: {}",
                pct(st.same_endpoint_share)
            ),
        ));
        if let Some(rh) = rep.row(1, Policy::RingHash.name(), "steady") {
            let gap = (st.cached_ratio - rh.cached_ratio) * 100.0;
            out.push(check(
                5,
                Some(gap >= -2.0),
                format!(
                    "Steady, cached-token ratio within 2 points of ring_hash (or above): {} vs {} ({gap:+.1} points)",
                    pct(st.cached_ratio),
                    pct(rh.cached_ratio)
                ),
            ));
        }
        if let Some(rr) = rep.row(1, Policy::RoundRobin.name(), "steady") {
            out.push(check(
                5,
                Some(st.cached_ratio > rr.cached_ratio),
                format!(
                    "Steady, far above round_robin: {} vs {}",
                    pct(st.cached_ratio),
                    pct(rr.cached_ratio)
                ),
            ));
        }
    }
    for sc in rep.scenarios() {
        if sc == "steady" {
            continue;
        }
        let Some(me) = rep.row(1, cf, sc) else {
            continue;
        };
        let others: Vec<&Summary> = rep
            .routing
            .iter()
            .filter(|r| r.scenario == sc && r.policy != cf && r.replicas <= 1)
            .collect();
        let best_other = others
            .iter()
            .map(|r| r.p99_ms)
            .filter(|x| x.is_finite())
            .fold(f64::INFINITY, f64::min);
        let other_errors: Vec<String> = others
            .iter()
            .map(|r| format!("{} {}", r.policy, r.errors))
            .collect();
        let mut text = format!(
            "{sc}: computeflux errors {} (others: {}); p99 {} ms vs best other {} ms",
            me.errors,
            other_errors.join(", "),
            ms(me.p99_ms),
            ms(best_other)
        );
        let after = me.phases.get("after").map(|a| a.cached_ratio);
        let steady_after = rep
            .row(1, cf, "steady")
            .and_then(|st| st.phases.get(&format!("after:{sc}")))
            .map(|a| a.cached_ratio);
        if let (Some(a), Some(b)) = (after, steady_after) {
            let _ = write!(
                text,
                "; cached ratio after the fault {} vs {} in the steady run's same window ({:+.1} points)",
                pct(a),
                pct(b),
                (a - b) * 100.0
            );
        }
        out.push(check(
            5,
            Some(me.errors == 0 && me.p99_ms <= best_other),
            text,
        ));
    }
}

fn issue10(rep: &Report<'_>, out: &mut Vec<Check>) {
    let cf = Policy::Filter.name();
    let Some(&n) = rep.replicated().last() else {
        return;
    };
    let x = |p: &str| label(p, n);
    if let Some(st) = rep.row(n, cf, "steady") {
        out.push(check(
            10,
            Some(st.same_endpoint_share >= 0.99),
            format!(
                "{}, steady: follow-up turns on the previous endpoint ≥ 99 %: {}",
                x(cf),
                pct(st.same_endpoint_share)
            ),
        ));
    }
    let faults: Vec<String> = ["rate_limited", "down", "join"]
        .iter()
        .filter_map(|sc| rep.row(n, cf, sc))
        .map(|r| format!("{} {}", r.scenario, pct(r.same_endpoint_share)))
        .collect();
    if !faults.is_empty() {
        let met = ["rate_limited", "down", "join"]
            .iter()
            .filter_map(|sc| rep.row(n, cf, sc))
            .all(|r| r.same_endpoint_share >= 0.97);
        out.push(check(
            10,
            Some(met),
            format!(
                "{}, follow-ups ≥ 97 % in the 429-window, outage and join scenarios: {}",
                x(cf),
                faults.join(", ")
            ),
        ));
    }
    let mine: Vec<&Summary> = rep
        .scenarios()
        .into_iter()
        .filter_map(|sc| rep.row(n, cf, sc))
        .collect();
    if !mine.is_empty() {
        // Every scenario here keeps at least three healthy endpoints.
        let errors: Vec<String> = mine
            .iter()
            .map(|r| format!("{} {} ({})", r.scenario, r.errors, r.statuses()))
            .collect();
        out.push(check(
            10,
            Some(mine.iter().all(|r| r.errors == 0)),
            format!(
                "{}, 0 client-visible errors in every scenario: {}",
                x(cf),
                errors.join(", ")
            ),
        ));
        // The rolling restart has no lone-Envoy run: it compares with the lone Envoy's steady.
        let vs = |reps: u32, p: &str, r: &Summary| {
            rep.row(reps, p, &r.scenario).or_else(|| {
                (r.scenario == "rolling_restart")
                    .then(|| rep.row(reps, p, "steady"))
                    .flatten()
            })
        };
        for (reps, p, points, what) in [
            (1, cf, -1.0, "within 1 point of one Envoy's"),
            (
                n,
                Policy::RingHash.name(),
                0.0,
                "≥ ring_hash's with the same replicas",
            ),
        ] {
            let pairs: Vec<(&Summary, &Summary)> = mine
                .iter()
                .filter_map(|r| vs(reps, p, r).map(|o| (*r, o)))
                .collect();
            if pairs.is_empty() {
                continue;
            }
            let figures: Vec<String> = pairs
                .iter()
                .map(|(me, o)| {
                    format!(
                        "{} {} vs {}{} ({:+.1})",
                        me.scenario,
                        pct(me.cached_ratio),
                        pct(o.cached_ratio),
                        if o.scenario != me.scenario {
                            format!(" ({})", o.scenario)
                        } else {
                            String::new()
                        },
                        (me.cached_ratio - o.cached_ratio) * 100.0
                    )
                })
                .collect();
            out.push(check(
                10,
                Some(
                    pairs
                        .iter()
                        .all(|(me, o)| (me.cached_ratio - o.cached_ratio) * 100.0 >= points - 1e-9),
                ),
                format!(
                    "{}, cached-token ratio {what} in every scenario: {}",
                    x(cf),
                    figures.join(", ")
                ),
            ));
        }
    }
    for reps in [1, n] {
        let Some(st) = rep.row(reps, cf, "steady") else {
            continue;
        };
        if st.load_spread.is_empty() {
            continue;
        }
        let parts: Vec<String> = st
            .load_spread
            .iter()
            .map(|m| {
                format!(
                    "{} {:.2} ({} sessions; random placement p95 {:.2})",
                    m.model,
                    m.max_ratio,
                    m.total(),
                    m.random_p95
                )
            })
            .collect();
        let worst = st.max_spread();
        out.push(check(
            10,
            Some(worst <= 1.25),
            format!(
                "{}, steady: no endpoint above 1.25 × its weight share of a model's new sessions: {}",
                label(cf, reps),
                parts.join(", ")
            ),
        ));
    }
    // "One replica: no scenario worse than today", against a previous run.
    match &rep.baseline {
        None => out.push(check(
            10,
            None,
            "One Envoy no worse than before: no previous results.json to compare with".into(),
        )),
        Some(b) if !b.comparable(&rep.meta.params) => out.push(check(
            10,
            None,
            format!(
                "One Envoy no worse than before: the previous run ({}, commit `{}`, {} mode) ran \
                 another workload; not compared",
                b.source, b.commit, b.mode
            ),
        )),
        Some(b) => {
            for sc in rep.scenarios() {
                let (Some(now), Some(then)) =
                    (rep.row(1, cf, sc), b.rows.iter().find(|r| r.scenario == sc))
                else {
                    continue;
                };
                let d_cached = (now.cached_ratio - then.cached_ratio) * 100.0;
                let d_same = (now.same_endpoint_share - then.same_endpoint_share) * 100.0;
                out.push(check(
                    10,
                    Some(d_cached >= -1.0 && d_same >= -1.0 && now.errors <= then.errors),
                    format!(
                        "{cf}, {sc}, one Envoy vs the previous run (commit `{}`, {}; another \
                         time on a shared machine): cached {} vs {} ({d_cached:+.1}), follow-ups \
                         {} vs {} ({d_same:+.1}), errors {} vs {}, p99 {} vs {} ms",
                        b.commit,
                        b.date,
                        pct(now.cached_ratio),
                        pct(then.cached_ratio),
                        pct(now.same_endpoint_share),
                        pct(then.same_endpoint_share),
                        now.errors,
                        then.errors,
                        ms(now.p99_ms),
                        ms(then.p99_ms)
                    ),
                ));
            }
        }
    }
}

/// The issues' slow scenario has the slowdown at t = 12 s, at the load of issue 23's benchmark
/// (≈ 21 requests/s: `--rate 3.5 --sessions 150`, whose arrivals span ≈ 43 s). Earlier, the
/// replicas are still cold (a cold endpoint never triggers a break) and the sessions caught on
/// the endpoint at the onset are about as many as the p99 tolerates (what every request after
/// the onset costs even an oracle, `scripts/slow-floor`), so a shorter run reports its figures
/// for context only. (`--sessions 850` at the default 20 sessions/s also reaches 12 s, but at
/// ≈ 120 requests/s: beyond the four engines' capacity, its steady run's median latency climbs
/// 6× over the run, and the slow run measures an overloaded fleet losing a fifth of its
/// capacity — reported in `docs/performance.md`, not judged.)
pub const ISSUE11_ONSET_MS: u64 = 12_000;

/// The command that runs the issues' slow scenario (the full `scripts/bench` runs it into `slow/`).
pub const ISSUE11_COMMAND: &str = "scripts/bench --no-micro --no-overhead --policies \
     computeflux,ring_hash --scenarios steady,slow --rate 3.5 --sessions 150";

fn issue11(rep: &Report<'_>, out: &mut Vec<Check>) {
    let span = rep
        .meta
        .params
        .pointer("/workload/arrival_span_ms")
        .and_then(serde_json::Value::as_u64);
    let onset = span.and_then(|s| super::routing::Scenario::Slow.window(s).map(|w| w.0));
    let timed = onset.is_some_and(|o| o >= ISSUE11_ONSET_MS);
    let mut counts: Vec<u32> = vec![1];
    counts.extend(rep.replicated());
    for n in counts {
        for p in [Policy::Filter.name(), Policy::RingHash.name()] {
            let (Some(slow), Some(steady)) = (rep.row(n, p, "slow"), rep.row(n, p, "steady"))
            else {
                continue;
            };
            let factor = slow.p99_ms / steady.p99_ms;
            let gap = (slow.cached_ratio - steady.cached_ratio) * 100.0;
            let met = slow.errors == 0 && factor <= 1.5 && gap >= -3.0;
            let timing = if timed {
                String::new()
            } else {
                format!(
                    " (slowdown at {:.1} s, before the issue's {} s: judged by `{ISSUE11_COMMAND}`)",
                    onset.unwrap_or(0) as f64 / 1000.0,
                    ISSUE11_ONSET_MS / 1000
                )
            };
            out.push(check(
                11,
                (p == Policy::Filter.name() && timed).then_some(met),
                format!(
                    "{}, slow: p99 {} ms = {factor:.2} × steady p99 {} ms (target ≤ 1.5); cached \
                     {} vs steady {} ({gap:+.1} points, target ≥ −3); errors {}{timing}",
                    label(p, n),
                    ms(slow.p99_ms),
                    ms(steady.p99_ms),
                    pct(slow.cached_ratio),
                    pct(steady.cached_ratio),
                    slow.errors
                ),
            ));
        }
    }
}

/// The report's targets section.
pub fn section(rep: &Report<'_>) -> String {
    let all = checks(rep);
    let mut s = String::new();
    for (issue, title) in [
        (5, "Targets (issue 5, one Envoy)"),
        (10, "Targets (issue 10, replicas)"),
        (
            11,
            "Targets (issue 11, a slow endpoint; ring_hash for context)",
        ),
    ] {
        let these: Vec<&Check> = all.iter().filter(|c| c.issue == issue).collect();
        if these.is_empty() {
            continue;
        }
        let _ = writeln!(s, "### {title}, as measured in this run\n");
        for c in these {
            let _ = writeln!(s, "- {}: {}.", c.text, verdict(c.met));
        }
        s.push('\n');
    }
    s
}

/// The performance page's short form: how many of the replica and slow-endpoint targets
/// (issues 10 and 11) were met, and the missed ones.
pub fn brief(rep: &Report<'_>) -> String {
    let all = checks(rep);
    let mut s = String::new();
    for issue in [10, 11] {
        let judged: Vec<&Check> = all
            .iter()
            .filter(|c| c.issue == issue && c.met.is_some())
            .collect();
        if judged.is_empty() {
            continue;
        }
        let met = judged.iter().filter(|c| c.met == Some(true)).count();
        let name = if issue == 10 {
            "Replica"
        } else {
            "Slow-endpoint"
        };
        let _ = writeln!(
            s,
            "{name} targets: {met} of {} met{}",
            judged.len(),
            if met == judged.len() {
                "."
            } else {
                "; missed:"
            }
        );
        for c in judged.iter().filter(|c| c.met == Some(false)) {
            let _ = writeln!(s, "- {}", c.text);
        }
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_baseline_compares_only_with_the_same_workload_and_mocks() {
        let b = Baseline {
            source: "results.json".into(),
            commit: "abc".into(),
            date: String::new(),
            mode: "full".into(),
            workload: json!({"sessions": 200, "turns": 6, "arrival_span_ms": 9966}),
            mock_args: json!(["--decode-ms", "20"]),
            rows: Vec::new(),
        };
        let same = json!({"workload": {"sessions": 200, "turns": 6, "arrival_span_ms": 1}, "mock_args": ["--decode-ms", "20"]});
        let quick =
            json!({"workload": {"sessions": 40, "turns": 3}, "mock_args": ["--decode-ms", "20"]});
        let other_mock =
            json!({"workload": {"sessions": 200, "turns": 6}, "mock_args": ["--decode-ms", "5"]});
        assert!(b.comparable(&same));
        assert!(!b.comparable(&quick));
        assert!(!b.comparable(&other_mock));
    }
}
