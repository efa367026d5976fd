//! The soak's report: the checks with their figures, as Markdown and JSON.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::{json, Value};

use super::support::MockUpstream;
use super::{
    percentile, prom, prom_sum, stat, Args, FaultEvent, Kind, Outcome, CLIENT_THREADS, ENDPOINTS,
    SETTLE,
};

pub struct ReportInput<'a> {
    pub args: &'a Args,
    pub command: &'a str,
    pub commit: &'a str,
    pub load_secs: f64,
    pub outcomes: &'a [Outcome],
    pub events: &'a [FaultEvent],
    pub skipped_faults: usize,
    pub min_settled: u64,
    pub rss: &'a [(f64, u64)],
    pub rss_end: u64,
    pub in_flight: &'a [(String, f64)],
    pub prom_text: &'a str,
    pub stats: &'a str,
    pub log: &'a str,
    pub mocks: &'a [MockUpstream],
    pub plugin: &'a Value,
}

pub struct Report {
    pub markdown: String,
    pub json: Value,
    pub pass: bool,
}

impl Report {
    pub fn build(i: ReportInput<'_>) -> Report {
        let o = i.outcomes;
        let n = o.len();
        let errors: Vec<&Outcome> = o.iter().filter(|o| !o.ok).collect();
        // Streams cut by a fault injected on their endpoint mid-response are passed through by
        // design (a failure after the first byte cannot fail over); they are listed apart.
        let cut_by_fault = errors.iter().filter(|o| o.cut_by_fault).count();
        let errors_healthy: Vec<&&Outcome> = errors
            .iter()
            .filter(|o| o.settled >= 1 && !o.cut_by_fault)
            .collect();
        let mut by_status: BTreeMap<String, usize> = BTreeMap::new();
        let mut by_attempts: BTreeMap<u32, usize> = BTreeMap::new();
        let mut by_endpoint: BTreeMap<String, usize> = BTreeMap::new();
        let mut by_kind: BTreeMap<&str, usize> = BTreeMap::new();
        for x in o {
            let key = if x.status == 0 {
                "transport error".to_string()
            } else {
                x.status.to_string()
            };
            *by_status.entry(key).or_default() += 1;
            *by_attempts.entry(x.attempts).or_default() += 1;
            *by_kind.entry(x.kind).or_default() += 1;
            if x.ok {
                *by_endpoint.entry(x.endpoint.clone()).or_default() += 1;
            }
        }
        let mut lat: Vec<f64> = o.iter().filter(|o| o.ok).map(|o| o.latency_ms).collect();
        lat.sort_by(f64::total_cmp);

        // Attempts vs upstream requests.
        let p = i.prom_text;
        let attempts_filter = prom_sum(p, "computeflux_requests_total");
        let mut by_outcome: BTreeMap<String, f64> = BTreeMap::new();
        for (labels, v) in prom(p, "computeflux_requests_total") {
            let outcome = labels
                .split(',')
                .find_map(|kv| kv.strip_prefix("outcome="))
                .unwrap_or("?")
                .trim_matches('"')
                .to_string();
            *by_outcome.entry(outcome).or_default() += v;
        }
        let mock_requests: Vec<(String, u64)> = i
            .mocks
            .iter()
            .map(|m| (m.name.clone(), m.request_count()))
            .collect();
        let upstream_total: u64 = mock_requests.iter().map(|(_, c)| c).sum();
        let refused: u64 = ENDPOINTS
            .iter()
            .map(|e| {
                stat(
                    i.stats,
                    &format!("cluster.{e}.upstream_rq_pending_failure_eject"),
                )
            })
            .sum();
        let connect_fail: u64 = ENDPOINTS
            .iter()
            .map(|e| stat(i.stats, &format!("cluster.{e}.upstream_cx_connect_fail")))
            .sum();
        let envoy_rq_total: u64 = ENDPOINTS
            .iter()
            .map(|e| stat(i.stats, &format!("cluster.{e}.upstream_rq_total")))
            .sum();
        let destroyed_active: u64 = ENDPOINTS
            .iter()
            .map(|e| {
                stat(
                    i.stats,
                    &format!("cluster.{e}.upstream_cx_destroy_remote_with_active_rq"),
                )
            })
            .sum();
        let reconciled = attempts_filter as u64 == upstream_total + refused;

        // Log.
        let bad_lines: Vec<&str> = i
            .log
            .lines()
            .filter(|l| {
                let l = l.to_ascii_lowercase();
                l.contains("panic") || l.contains("wasm vm failed") || l.contains("restarting")
            })
            .collect();

        // RSS.
        let at = |t: f64| {
            i.rss
                .iter()
                .min_by(|a, b| (a.0 - t).abs().total_cmp(&(b.0 - t).abs()))
                .map_or(0, |s| s.1)
        };
        let rss_start = at(15.0);
        let rss_mid = at(i.load_secs / 2.0);
        let rss_end = i.rss_end;
        let rss_max = i.rss.iter().map(|s| s.1).max().unwrap_or(0);
        // Stable: the second half grows by less than 10 % + 8 MiB.
        let rss_stable = (rss_end as f64) <= rss_mid as f64 * 1.10 + 8.0 * 1024.0;

        let in_flight_zero = !i.in_flight.is_empty() && i.in_flight.iter().all(|(_, v)| *v == 0.0);
        let mut fault_counts: BTreeMap<Kind, (usize, f64)> = BTreeMap::new();
        for e in i.events {
            let c = fault_counts.entry(e.kind).or_default();
            c.0 += 1;
            c.1 += e.secs;
        }
        let pass = errors_healthy.is_empty()
            && in_flight_zero
            && reconciled
            && bad_lines.is_empty()
            && rss_stable
            && i.min_settled >= 1;

        let mib = |k: u64| k as f64 / 1024.0;
        let yes = |b: bool| if b { "PASS" } else { "FAIL" };
        let mut md = String::new();
        let _ = writeln!(md, "# Fault soak report\n");
        let _ = writeln!(
            md,
            "Command: `{}` (commit {}, {} on {} CPUs). Envoy 1.40 `--concurrency 2`, four mock \
             endpoints, bounded load of {} req/s from {} client threads. Generated by \
             `tests/tools/src/soak.rs`; see its module docs for the method.\n",
            i.command,
            i.commit,
            std::env::consts::ARCH,
            std::thread::available_parallelism().map_or(0, |n| n.get()),
            i.args.rps,
            CLIENT_THREADS
        );
        let _ = writeln!(md, "## Verdict: {}\n", if pass { "PASS" } else { "FAIL" });
        let _ = writeln!(md, "| check | result | figures |\n|---|---|---|");
        let _ = writeln!(
            md,
            "| client-visible errors while ≥ 1 endpoint was healthy (target 0) | {} | {} of {} requests (all errors: {}) |",
            yes(errors_healthy.is_empty()),
            errors_healthy.len(),
            n,
            errors.len()
        );
        let _ = writeln!(
            md,
            "| streams cut after their first byte by a fault injected on their endpoint mid-response (passed through by design) | info | {} |",
            cut_by_fault
        );
        let _ = writeln!(
            md,
            "| in-flight gauges back to 0 | {} | {} |",
            yes(in_flight_zero),
            i.in_flight
                .iter()
                .map(|(l, v)| format!("{l} = {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let _ = writeln!(
            md,
            "| filter attempts = upstream requests + refused connects | {} | {} = {} + {} |",
            yes(reconciled),
            attempts_filter,
            upstream_total,
            refused
        );
        let _ = writeln!(
            md,
            "| no wasm panic / VM restart in the Envoy log | {} | {} matching lines |",
            yes(bad_lines.is_empty()),
            bad_lines.len()
        );
        let _ = writeln!(
            md,
            "| Envoy RSS stable | {} | start {:.1} MiB, middle {:.1} MiB, end {:.1} MiB (max {:.1}) |",
            yes(rss_stable),
            mib(rss_start),
            mib(rss_mid),
            mib(rss_end),
            mib(rss_max)
        );
        let _ = writeln!(
            md,
            "| ≥ 1 settled-healthy endpoint at every request | {} | minimum seen: {} |\n",
            yes(i.min_settled >= 1),
            i.min_settled
        );

        let _ = writeln!(md, "## Load\n");
        let _ = writeln!(
            md,
            "- {} requests in {:.0} s ({:.1} req/s achieved): {}.",
            n,
            i.load_secs,
            n as f64 / i.load_secs.max(1.0),
            by_kind
                .iter()
                .map(|(k, v)| format!("{v} {k}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let _ = writeln!(md, "- Client statuses: {}.", counts(&by_status));
        let _ = writeln!(
            md,
            "- Attempts per request (`x-computeflux-attempts`): {}.",
            counts(&by_attempts)
        );
        let _ = writeln!(md, "- Served by: {}.", counts(&by_endpoint));
        let _ = writeln!(
            md,
            "- Latency of successful requests (client side): p50 {:.0} ms, p90 {:.0} ms, p99 {:.0} ms, max {:.0} ms.\n",
            percentile(&lat, 0.5),
            percentile(&lat, 0.9),
            percentile(&lat, 0.99),
            lat.last().copied().unwrap_or(0.0)
        );

        let _ = writeln!(md, "## Faults injected\n");
        let _ = writeln!(
            md,
            "{} faults ({} more skipped to keep an endpoint settled); healthy = fault-free or \
             only slow for ≥ {} s.\n",
            i.events.len(),
            i.skipped_faults,
            SETTLE.as_secs()
        );
        let _ = writeln!(md, "| fault | count | total seconds |\n|---|---|---|");
        for (k, (c, secs)) in &fault_counts {
            let _ = writeln!(md, "| {} | {} | {:.0} |", k.label(), c, secs);
        }
        let _ = writeln!(md);

        let _ = writeln!(md, "## Counting\n");
        let _ = writeln!(
            md,
            "- Filter attempts (`sum(computeflux_requests_total)`): {} — by outcome: {}.",
            attempts_filter,
            counts_sep(by_outcome.iter(), " ")
        );
        let _ = writeln!(
            md,
            "- Requests counted by the mocks: {} ({}).",
            upstream_total,
            counts_sep(mock_requests.iter().map(|(k, v)| (k, v)), " ")
        );
        let _ = writeln!(
            md,
            "- Refused connects (Envoy `upstream_rq_pending_failure_eject`): {}; \
             `upstream_cx_connect_fail`: {}; Envoy `upstream_rq_total`: {}; \
             `upstream_cx_destroy_remote_with_active_rq`: {}.",
            refused, connect_fail, envoy_rq_total, destroyed_active
        );
        let _ = writeln!(
            md,
            "- Failovers: {}; retry budget exhausted: {}; local replies: {}; CAS exhausted: {}.\n",
            prom_sum(p, "computeflux_failovers_total"),
            prom_sum(p, "computeflux_retry_budget_exhausted_total"),
            {
                let r: Vec<String> = prom(p, "computeflux_rejected_total")
                    .iter()
                    .filter(|(_, v)| *v > 0.0)
                    .map(|(l, v)| format!("{l} {v}"))
                    .collect();
                if r.is_empty() {
                    "none".to_string()
                } else {
                    r.join(", ")
                }
            },
            prom_sum(p, "computeflux_cas_exhausted_total")
        );

        if !errors.is_empty() {
            let _ = writeln!(md, "## Client errors (first 20)\n");
            for e in errors.iter().take(20) {
                let _ = writeln!(
                    md,
                    "- t={:.1}s {} status={} attempts={} endpoint={} settled={} healthy={}{}: {}",
                    e.at_s,
                    e.kind,
                    e.status,
                    e.attempts,
                    e.endpoint,
                    e.settled,
                    e.healthy,
                    if e.cut_by_fault {
                        " (stream cut: its endpoint began refusing mid-response)"
                    } else if e.cut {
                        " (stream cut)"
                    } else {
                        ""
                    },
                    e.error.as_deref().unwrap_or("")
                );
            }
            let _ = writeln!(md);
        }
        if !bad_lines.is_empty() {
            let _ = writeln!(md, "## Envoy log lines (first 20)\n\n```text");
            for l in bad_lines.iter().take(20) {
                let _ = writeln!(md, "{l}");
            }
            let _ = writeln!(md, "```\n");
        }
        let _ = writeln!(md, "## RSS samples (every 5 s; MiB)\n");
        let series: Vec<String> = i
            .rss
            .iter()
            .step_by((i.rss.len() / 20).max(1))
            .map(|(t, k)| format!("{t:.0}s {:.1}", mib(*k)))
            .collect();
        let _ = writeln!(md, "{}\n", series.join(" · "));
        let _ = writeln!(
            md,
            "Plugin configuration: `{}`",
            serde_json::to_string(i.plugin).unwrap_or_default()
        );

        let json = json!({
            "command": i.command,
            "commit": i.commit,
            "pass": pass,
            "seconds": i.load_secs,
            "rps_target": i.args.rps,
            "seed": i.args.seed,
            "requests": n,
            "client_errors": errors.len(),
            "client_errors_while_healthy": errors_healthy.len(),
            "streams_cut_by_fault_mid_response": cut_by_fault,
            "statuses": by_status,
            "attempts": by_attempts.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "served_by": by_endpoint,
            "latency_ms": {"p50": percentile(&lat, 0.5), "p90": percentile(&lat, 0.9),
                           "p99": percentile(&lat, 0.99), "max": lat.last().copied().unwrap_or(0.0)},
            "in_flight": i.in_flight.iter().map(|(l, v)| (l.clone(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "filter_attempts": attempts_filter,
            "filter_attempts_by_outcome": by_outcome,
            "upstream_requests": upstream_total,
            "upstream_requests_by_mock": mock_requests.iter().map(|(k, v)| (k.clone(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "refused_connects": refused,
            "envoy_upstream_cx_connect_fail": connect_fail,
            "envoy_upstream_rq_total": envoy_rq_total,
            "envoy_upstream_cx_destroy_remote_with_active_rq": destroyed_active,
            "attempts_reconciled": reconciled,
            "failovers": prom_sum(p, "computeflux_failovers_total"),
            "retry_budget_exhausted": prom_sum(p, "computeflux_retry_budget_exhausted_total"),
            "cas_exhausted": prom_sum(p, "computeflux_cas_exhausted_total"),
            "log_panic_or_restart_lines": bad_lines,
            "rss_kib": {"start": rss_start, "middle": rss_mid, "end": rss_end, "max": rss_max,
                        "samples": i.rss.iter().map(|(t, k)| json!([t, k])).collect::<Vec<_>>()},
            "rss_stable": rss_stable,
            "faults": i.events.iter().map(|e| json!({"at_s": e.at_s, "endpoint": e.endpoint,
                       "kind": e.kind.label(), "secs": e.secs})).collect::<Vec<_>>(),
            "faults_skipped": i.skipped_faults,
            "min_settled_endpoints": i.min_settled,
            "errors": errors.iter().take(200).map(|e| json!({"at_s": e.at_s, "kind": e.kind,
                       "status": e.status, "attempts": e.attempts, "endpoint": e.endpoint,
                       "settled": e.settled, "healthy": e.healthy, "cut": e.cut,
                       "cut_by_fault": e.cut_by_fault, "error": e.error})).collect::<Vec<_>>(),
            "plugin_config": i.plugin,
        });
        Report {
            markdown: md,
            json,
            pass,
        }
    }
}

/// `k: v, k: v, …` of a count map, in its iteration order.
fn counts<K: std::fmt::Display, V: std::fmt::Display>(
    map: impl IntoIterator<Item = (K, V)>,
) -> String {
    counts_sep(map, ": ")
}

/// `k<sep>v, k<sep>v, …` of a count map, in its iteration order.
fn counts_sep<K: std::fmt::Display, V: std::fmt::Display>(
    map: impl IntoIterator<Item = (K, V)>,
    sep: &str,
) -> String {
    map.into_iter()
        .map(|(k, v)| format!("{k}{sep}{v}"))
        .collect::<Vec<_>>()
        .join(", ")
}
