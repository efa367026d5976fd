//! What a membership run measured (`membership.rs`): from the client's records, the hosts'
//! comings and goings, and what each host received after it left.
//!
//! Why its own module: the run decides what happens to the fleet, this decides what counts, and
//! the rules are the (40): follow-ups on their previous host, hosts that left excluded;
//! the cached-token ratio; how soon a host that joins gets its share of new sessions; client
//! errors; requests that reached a host after it left the cluster; p99.
//!
//! The counting rules, each a pure function tested below:
//! - **Follow-up kept**: turn k ≥ 1 whose turn k−1 succeeded, answered by the same host. A
//!   follow-up whose previous host had left the cluster before it was sent is counted apart
//!   (`follow_ups_host_left`): it must move, once.
//! - **A joining host's share**: new sessions are first turns. Its fair share at time t is
//!   1 / (hosts in the cluster at t). "Time to fair share" is from its addition to the first new
//!   session at which, among the last [`FAIR_WINDOW`] new sessions sent after its addition, it
//!   had at least [`FAIR_FRACTION`] of its fair share. "Share ÷ fair" is its share of the new
//!   sessions sent after its addition (until it left or the end), divided by the mean fair share
//!   over them.
//! - **After leaving**: requests a host's server logged at or after the moment it was removed
//!   from the file, and those more than [`PROPAGATION_MS`] later (beyond Envoy's reload of the
//!   file and what was already in flight).

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::summary::{label, quantile, ratio};
use super::workload::Record;

/// Trailing window of new sessions for "time to fair share".
pub const FAIR_WINDOW: usize = 10;
/// Share of the fair share the window must reach.
pub const FAIR_FRACTION: f64 = 0.8;
/// Requests reaching a host later than this after its removal are not in flight nor waiting for
/// Envoy to read the file.
pub const PROPAGATION_MS: f64 = 500.0;

/// The membership changes as they happened: `(ms from the run's origin, "add h4")`.
pub type Events = Vec<(f64, String)>;

/// One server's life in the cluster, in ms from the run's origin.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HostLife {
    /// Its `x-mock-endpoint` name.
    pub name: String,
    pub port: u16,
    /// None: in the file from the start.
    pub added_ms: Option<f64>,
    pub removed_ms: Option<f64>,
    pub stopped_ms: Option<f64>,
    /// When its server received each chat request (its own log).
    pub received_ms: Vec<f64>,
}

impl HostLife {
    /// In the cluster's file at `t_ms`.
    pub fn present_at(&self, t_ms: f64) -> bool {
        self.added_ms.is_none_or(|a| a <= t_ms) && self.removed_ms.is_none_or(|r| t_ms < r)
    }

    /// Had left the cluster's file by `t_ms`.
    pub fn left_by(&self, t_ms: f64) -> bool {
        self.removed_ms.is_some_and(|r| r <= t_ms)
    }
}

/// How soon one joining host was used.
#[derive(Clone, Debug, PartialEq)]
pub struct Joiner {
    pub name: String,
    pub added_ms: f64,
    /// From its addition to the first request it served / the first new session it served /
    /// its fair share (see the module doc); None: never.
    pub first_request_ms: Option<f64>,
    pub first_session_ms: Option<f64>,
    pub fair_share_ms: Option<f64>,
    /// Its share of the new sessions after its addition ÷ the mean fair share over them.
    pub share_over_fair: f64,
    pub new_sessions: u64,
}

/// One topology × policy × membership scenario.
#[derive(Clone, Debug, Default)]
pub struct MembershipSummary {
    pub scenario: String,
    pub policy: String,
    pub replicas: u32,
    pub requests: u64,
    pub errors: u64,
    pub error_kinds: BTreeMap<String, u64>,
    pub follow_ups: u64,
    pub same_host: u64,
    pub follow_ups_host_left: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub joiners: Vec<Joiner>,
    /// Requests the leaving hosts' servers received at or after their removal, and those more
    /// than [`PROPAGATION_MS`] after it.
    pub after_leaving: u64,
    pub after_leaving_late: u64,
    /// Chat requests every server received, per client request (retries and failovers in).
    pub upstream_per_request: f64,
    /// The membership changes as they happened: `(ms, "add h4")`.
    pub events: Events,
    pub wall_s: f64,
}

/// Follow-ups: `(counted, kept on their host, previous host had left)`.
pub fn follow_ups(recs: &[Record], hosts: &[HostLife]) -> (u64, u64, u64) {
    let mut by_session: BTreeMap<usize, Vec<&Record>> = BTreeMap::new();
    for r in recs {
        by_session.entry(r.session).or_default().push(r);
    }
    let (mut counted, mut kept, mut left) = (0, 0, 0);
    for turns in by_session.values_mut() {
        turns.sort_by_key(|r| r.turn);
        for pair in turns.windows(2) {
            let [prev, cur] = pair else { continue };
            if cur.turn != prev.turn + 1 || !prev.ok() {
                continue;
            }
            let Some(prev_host) = prev.endpoint.as_deref() else {
                continue;
            };
            let gone = hosts
                .iter()
                .find(|h| h.name == prev_host)
                .is_some_and(|h| h.left_by(cur.start_ms));
            if gone {
                left += 1;
                continue;
            }
            counted += 1;
            if cur.ok() && cur.endpoint.as_deref() == Some(prev_host) {
                kept += 1;
            }
        }
    }
    (counted, kept, left)
}

/// Hosts in the cluster at `t_ms` (at least 1).
fn hosts_at(hosts: &[HostLife], t_ms: f64) -> usize {
    hosts.iter().filter(|h| h.present_at(t_ms)).count().max(1)
}

/// How soon each host that joined mid-run was used (see the module doc).
pub fn joiners(recs: &[Record], hosts: &[HostLife]) -> Vec<Joiner> {
    let mut firsts: Vec<&Record> = recs.iter().filter(|r| r.turn == 0 && r.ok()).collect();
    firsts.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
    hosts
        .iter()
        .filter_map(|h| {
            let added = h.added_ms?;
            let served = |r: &&Record| r.ok() && r.endpoint.as_deref() == Some(h.name.as_str());
            let first = |it: &mut dyn Iterator<Item = &Record>| {
                it.filter(|r| r.start_ms >= added)
                    .map(|r| r.start_ms - added)
                    .min_by(f64::total_cmp)
            };
            let first_request_ms = first(&mut recs.iter().filter(served));
            let first_session_ms = first(&mut firsts.iter().copied().filter(served));
            let after: Vec<&Record> = firsts
                .iter()
                .copied()
                .filter(|r| r.start_ms >= added && h.removed_ms.is_none_or(|e| r.start_ms < e))
                .collect();
            let mut fair_share_ms = None;
            for end in FAIR_WINDOW..=after.len() {
                let window = after.get(end - FAIR_WINDOW..end).unwrap_or(&[]);
                let Some(last) = window.last() else { continue };
                let mine = window.iter().copied().filter(served).count() as f64;
                let fair = FAIR_WINDOW as f64 / hosts_at(hosts, last.start_ms) as f64;
                if mine >= FAIR_FRACTION * fair {
                    fair_share_ms = Some(last.start_ms - added);
                    break;
                }
            }
            let mine = after.iter().copied().filter(served).count() as u64;
            let fair: f64 = after
                .iter()
                .map(|r| 1.0 / hosts_at(hosts, r.start_ms) as f64)
                .sum();
            Some(Joiner {
                name: h.name.clone(),
                added_ms: added,
                first_request_ms,
                first_session_ms,
                fair_share_ms,
                share_over_fair: if fair > 0.0 {
                    mine as f64 / fair
                } else {
                    f64::NAN
                },
                new_sessions: mine,
            })
        })
        .collect()
}

/// Requests the hosts received at or after their removal: `(all, later than PROPAGATION_MS)`.
pub fn after_leaving(hosts: &[HostLife]) -> (u64, u64) {
    hosts
        .iter()
        .filter_map(|h| h.removed_ms.map(|r| (h, r)))
        .fold((0, 0), |(all, late), (h, r)| {
            let n = h.received_ms.iter().filter(|t| **t >= r).count() as u64;
            let l = h
                .received_ms
                .iter()
                .filter(|t| **t >= r + PROPAGATION_MS)
                .count() as u64;
            (all + n, late + l)
        })
}

/// Everything above for one run.
pub fn summarize(
    scenario: &str,
    policy: &str,
    replicas: u32,
    recs: &[Record],
    hosts: &[HostLife],
) -> MembershipSummary {
    let ok: Vec<&Record> = recs.iter().filter(|r| r.ok()).collect();
    let mut lat: Vec<f64> = ok.iter().map(|r| r.latency_ms).collect();
    lat.sort_by(f64::total_cmp);
    let mut error_kinds = BTreeMap::new();
    for r in recs.iter().filter(|r| !r.ok()) {
        let k = r
            .error
            .clone()
            .unwrap_or_else(|| format!("http {}", r.status));
        *error_kinds.entry(k).or_insert(0) += 1;
    }
    let (follow_ups, same_host, follow_ups_host_left) = follow_ups(recs, hosts);
    let (after_leaving, after_leaving_late) = after_leaving(hosts);
    let upstream: usize = hosts.iter().map(|h| h.received_ms.len()).sum();
    MembershipSummary {
        scenario: scenario.into(),
        policy: policy.into(),
        replicas,
        requests: recs.len() as u64,
        errors: (recs.len() - ok.len()) as u64,
        error_kinds,
        follow_ups,
        same_host,
        follow_ups_host_left,
        prompt_tokens: ok.iter().map(|r| r.prompt_tokens).sum(),
        cached_tokens: ok.iter().map(|r| r.cached_tokens).sum(),
        p50_ms: quantile(&lat, 0.5),
        p99_ms: quantile(&lat, 0.99),
        joiners: joiners(recs, hosts),
        after_leaving,
        after_leaving_late,
        upstream_per_request: ratio(upstream as u64, recs.len() as u64),
        events: Vec::new(),
        wall_s: 0.0,
    }
}

fn num(x: f64) -> Value {
    if x.is_finite() {
        json!((x * 1000.0).round() / 1000.0)
    } else {
        Value::Null
    }
}

/// Median and maximum of the known values, and how many are unknown ("never").
fn med_max(v: &[Option<f64>]) -> (f64, f64, usize) {
    let mut s: Vec<f64> = v.iter().flatten().copied().collect();
    s.sort_by(f64::total_cmp);
    let never = v.len() - s.len();
    (
        quantile(&s, 0.5),
        s.last().copied().unwrap_or(f64::NAN),
        never,
    )
}

impl MembershipSummary {
    pub fn cached_ratio(&self) -> f64 {
        ratio(self.cached_tokens, self.prompt_tokens)
    }

    pub fn same_host_share(&self) -> f64 {
        ratio(self.same_host, self.follow_ups)
    }

    pub fn label(&self) -> String {
        label(&self.policy, self.replicas)
    }

    pub fn to_json(&self) -> Value {
        let joiners: Vec<Value> = self
            .joiners
            .iter()
            .map(|j| {
                json!({
                    "host": j.name, "added_ms": num(j.added_ms),
                    "first_request_ms": j.first_request_ms.map(num),
                    "first_new_session_ms": j.first_session_ms.map(num),
                    "fair_share_ms": j.fair_share_ms.map(num),
                    "share_over_fair": num(j.share_over_fair),
                    "new_sessions": j.new_sessions,
                })
            })
            .collect();
        json!({
            "scenario": self.scenario, "policy": self.policy, "replicas": self.replicas,
            "requests": self.requests, "errors": self.errors, "error_kinds": self.error_kinds,
            "follow_ups": self.follow_ups, "same_host": self.same_host,
            "same_host_share": num(self.same_host_share()),
            "follow_ups_host_left": self.follow_ups_host_left,
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "cached_ratio": num(self.cached_ratio()),
            "p50_ms": num(self.p50_ms), "p99_ms": num(self.p99_ms),
            "joiners": joiners,
            "after_leaving": self.after_leaving, "after_leaving_late": self.after_leaving_late,
            "upstream_per_request": num(self.upstream_per_request),
            "events": self.events.iter().map(|(t, e)| json!([num(*t), e])).collect::<Vec<_>>(),
            "wall_s": num(self.wall_s),
        })
    }

    /// One row of the markdown table (see [`markdown_header`]).
    pub fn markdown_row(&self) -> String {
        let pct = |x: f64| {
            if x.is_finite() {
                format!("{:.1} %", x * 100.0)
            } else {
                "–".into()
            }
        };
        let s = |x: f64| {
            if x.is_finite() {
                format!("{:.1}", x / 1000.0)
            } else {
                "–".into()
            }
        };
        let pair = |v: Vec<Option<f64>>| {
            if v.is_empty() {
                return "–".to_string();
            }
            let (m, x, never) = med_max(&v);
            let never = if never > 0 {
                format!(" ({never} never)")
            } else {
                String::new()
            };
            format!("{} / {}{never}", s(m), s(x))
        };
        let share = {
            let mut v: Vec<f64> = self
                .joiners
                .iter()
                .map(|j| j.share_over_fair)
                .filter(|x| x.is_finite())
                .collect();
            v.sort_by(f64::total_cmp);
            if v.is_empty() {
                "–".to_string()
            } else {
                format!(
                    "{:.2} ({:.2}…{:.2})",
                    quantile(&v, 0.5),
                    v.first().copied().unwrap_or(f64::NAN),
                    v.last().copied().unwrap_or(f64::NAN)
                )
            }
        };
        let errors = if self.error_kinds.is_empty() {
            "0".to_string()
        } else {
            format!(
                "{} ({})",
                self.errors,
                self.error_kinds
                    .iter()
                    .map(|(k, n)| format!("{k}: {n}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        format!(
            "| {} | {} | {} ({}/{}) | {} | {} | {} | {} | {} | {} | {} / {} | {:.2} | {:.0} | {:.0} |\n",
            self.scenario,
            self.label(),
            pct(self.same_host_share()),
            self.same_host,
            self.follow_ups,
            self.follow_ups_host_left,
            pct(self.cached_ratio()),
            pair(self.joiners.iter().map(|j| j.first_request_ms).collect()),
            pair(self.joiners.iter().map(|j| j.fair_share_ms).collect()),
            share,
            errors,
            self.after_leaving,
            self.after_leaving_late,
            self.upstream_per_request,
            self.p50_ms,
            self.p99_ms,
        )
    }
}

pub fn markdown_header() -> &'static str {
    "| scenario | policy | follow-ups on their host (kept/counted) | follow-ups whose host had left | cached tokens | new host: first request, s (median / max) | new host: fair share of new sessions, s (median / max) | new hosts' share ÷ fair (median, min…max) | client errors | requests reaching a host after it left (all / > 0.5 s after) | upstream requests per request | p50 ms | p99 ms |\n\
     |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(session: usize, turn: usize, start_ms: f64, host: &str) -> Record {
        Record {
            session,
            app: None,
            model: "m1",
            turn,
            start_ms,
            latency_ms: 100.0,
            ttfb_ms: 10.0,
            stream: false,
            completion_tokens: 1,
            status: 200,
            endpoint: Some(host.into()),
            prompt_tokens: 100,
            cached_tokens: if turn > 0 { 80 } else { 0 },
            attempts: None,
            affinity: None,
            replica: None,
            error: None,
        }
    }

    fn host(name: &str, added: Option<f64>, removed: Option<f64>) -> HostLife {
        HostLife {
            name: name.into(),
            added_ms: added,
            removed_ms: removed,
            ..HostLife::default()
        }
    }

    #[test]
    fn a_follow_up_whose_host_left_is_counted_apart_and_its_move_is_not_a_miss() {
        let hosts = [host("a", None, Some(1_000.0)), host("b", None, None)];
        let recs = [
            // Session 0: a, then a left; moved to b, then stays on b.
            rec(0, 0, 0.0, "a"),
            rec(0, 1, 1_500.0, "b"),
            rec(0, 2, 3_000.0, "b"),
            // Session 1: b, b, then wrongly a (present then? no: a left) -> counted as a miss.
            rec(1, 0, 100.0, "b"),
            rec(1, 1, 500.0, "b"),
            rec(1, 2, 2_000.0, "a"),
        ];
        let (counted, kept, left) = follow_ups(&recs, &hosts);
        assert_eq!((counted, kept, left), (3, 2, 1));
        // A failed previous turn is not a follow-up.
        let mut failed = recs.to_vec();
        failed[3].status = 503;
        assert_eq!(follow_ups(&failed, &hosts), (2, 1, 1));
    }

    #[test]
    fn a_joining_host_gets_its_times_from_its_addition() {
        let hosts = [
            host("a", None, None),
            host("b", None, None),
            host("n", Some(1_000.0), None),
        ];
        let mut recs = Vec::new();
        // New sessions every 100 ms from 0 to 4 s; before 1 s all on a/b; from 2 s on, every
        // third on n (its fair share: 1/3).
        for i in 0..40 {
            let t = i as f64 * 100.0;
            let h = if t >= 2_000.0 && i % 3 == 0 {
                "n"
            } else if i % 2 == 0 {
                "a"
            } else {
                "b"
            };
            recs.push(rec(i, 0, t, h));
        }
        // A follow-up reached n at 1.5 s.
        recs.push(rec(100, 1, 1_500.0, "n"));
        let j = joiners(&recs, &hosts);
        assert_eq!(j.len(), 1);
        let j = &j[0];
        assert_eq!(j.first_request_ms, Some(500.0));
        assert_eq!(j.first_session_ms, Some(1_100.0), "session 21 at 2.1 s");
        // The trailing 10 new sessions need ≥ 0.8 × 10/3 = 2.67, so 3 on n: sessions 21, 24,
        // 27 → the window ending at 2.7 s.
        assert_eq!(j.fair_share_ms, Some(1_700.0));
        // 7 of the 30 new sessions after 1 s (21, 24, …, 39) against a fair 10.
        assert_eq!(j.new_sessions, 7);
        assert!(
            (j.share_over_fair - 0.7).abs() < 1e-9,
            "{}",
            j.share_over_fair
        );
        // A host that never gets a new session has no time to fair share.
        let none: Vec<Record> = recs
            .iter()
            .filter(|r| r.endpoint.as_deref() != Some("n"))
            .cloned()
            .collect();
        let j = joiners(&none, &hosts);
        assert_eq!(
            (j[0].first_request_ms, j[0].fair_share_ms, j[0].new_sessions),
            (None, None, 0)
        );
    }

    #[test]
    fn requests_after_leaving_count_from_the_removal() {
        let mut h = host("a", None, Some(1_000.0));
        h.received_ms = vec![10.0, 999.0, 1_000.0, 1_400.0, 1_600.0];
        let stay = HostLife {
            received_ms: vec![5_000.0],
            ..host("b", None, None)
        };
        assert_eq!(after_leaving(&[h.clone(), stay.clone()]), (3, 1));
        let s = summarize("scale_in", "x", 1, &[rec(0, 0, 0.0, "a")], &[h, stay]);
        assert_eq!((s.after_leaving, s.after_leaving_late), (3, 1));
        assert!((s.upstream_per_request - 6.0).abs() < 1e-9);
        assert!(s.markdown_row().starts_with("| scale_in | x |"));
        assert_eq!(
            s.markdown_row().matches('|').count(),
            markdown_header()
                .lines()
                .next()
                .unwrap()
                .matches('|')
                .count()
        );
    }
}
