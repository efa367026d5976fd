//! The observability artifacts name what the filter really emits: a real Envoy with the filter
//! in front of two mock endpoints serves a few requests (one of them failing over, one rejected),
//! then every metric and label used by the Grafana dashboard's queries, and every metric and
//! label documented in docs/metrics.md, must appear in `/stats/prometheus`, and every metric the
//! filter defines (src/filter/metrics.rs) must be documented.
// Test helpers fail loudly: that is their job.
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

use crate::deploy_support;
use crate::support;

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{json, Value};
use support::{chat_body, post_chat, Envoy, EnvoyConfig, MockUpstream};

/// Prometheus text → metric name → label names seen on it.
fn exposition(text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let (name, rest) = match line.find(['{', ' ']) {
            Some(i) => (&line[..i], &line[i..]),
            None => continue,
        };
        let labels = out.entry(name.to_string()).or_default();
        if let Some(body) = rest
            .strip_prefix('{')
            .and_then(|r| r.split_once('}'))
            .map(|p| p.0)
        {
            for pair in body.split("\",") {
                if let Some((k, _)) = pair.split_once('=') {
                    labels.insert(k.trim().to_string());
                }
            }
        }
    }
    out
}

/// Identifiers in a PromQL expression that are computeflux metric names.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while let Some(pos) = expr[i..].find("computeflux_") {
        let start = i + pos;
        let boundary =
            start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        if boundary {
            out.insert(expr[start..end].to_string());
        }
        i = end;
    }
    out
}

/// Label names a PromQL expression uses: in `{…}` matchers and in `by (…)` / `without (…)`.
fn label_names(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = expr;
    while let Some(open) = rest.find('{') {
        let close = rest[open..]
            .find('}')
            .map(|c| open + c)
            .expect("unclosed {");
        for m in rest[open + 1..close].split(',') {
            let name: String = m
                .trim()
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.insert(name);
            }
        }
        rest = &rest[close + 1..];
    }
    for kw in ["by", "without"] {
        let mut rest = expr;
        while let Some(p) = rest.find(&format!("{kw} (")) {
            let after = &rest[p + kw.len() + 2..];
            let close = after.find(')').expect("unclosed (");
            for l in after[..close].split(',') {
                out.insert(l.trim().to_string());
            }
            rest = &after[close..];
        }
    }
    out
}

/// Every PromQL expression in the dashboard (panel targets and template queries).
fn dashboard_queries() -> Vec<String> {
    let path = deploy_support::root().join("envoy/grafana/computeflux-dashboard.json");
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut out = Vec::new();
    deploy_support::walk(&dash, String::new(), &mut |ptr, v| {
        if let Some(s) = v.as_str() {
            if ptr.ends_with("/expr") || ptr.ends_with("/definition") {
                out.push(s.to_string());
            }
        }
    });
    out
}

/// Rows of the metrics table in docs/metrics.md: (name, labels).
fn documented() -> Vec<(String, BTreeSet<String>)> {
    let text = std::fs::read_to_string(deploy_support::root().join("docs/metrics.md")).unwrap();
    text.lines()
        .filter(|l| l.starts_with("| `computeflux_"))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let name = cells[1].trim_matches('`').to_string();
            let labels = cells[3]
                .split(',')
                .map(|s| s.trim().trim_matches('`').to_string())
                .filter(|s| !s.is_empty())
                .collect();
            (name, labels)
        })
        .collect()
}

#[test]
fn promql_helpers_find_names_and_labels() {
    let e = r#"histogram_quantile(0.95, sum by (endpoint, le) (rate(computeflux_upstream_latency_ms_bucket{endpoint=~"$endpoint",x!="y"}[5m]))) / xcomputeflux_no"#;
    assert_eq!(
        metric_names(e),
        BTreeSet::from(["computeflux_upstream_latency_ms_bucket".to_string()])
    );
    assert_eq!(
        label_names(e),
        ["endpoint", "le", "x"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    );
    let p = exposition("# TYPE a counter\na{endpoint=\"x,y\",outcome=\"s\"} 1\nb 2\n");
    assert_eq!(
        p["a"],
        ["endpoint", "outcome"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    );
    assert!(p["b"].is_empty());
}

#[test]
fn dashboard_and_docs_use_only_emitted_metrics_and_labels() {
    let a = MockUpstream::start("a", &["m"], &["--decode-ms", "0"]);
    let b = MockUpstream::start("b", &["m"], &["--decode-ms", "0"]);
    let plugin = json!({
        // `a` is scraped (the mock's /metrics): the engine and scrape gauges are emitted too.
        "endpoints": [
            {"name": "a", "cluster": "a", "metrics": {"interval_ms": 200, "format": "vllm"}},
            {"name": "b", "cluster": "b"},
        ],
        "cold_start_samples": 0,
    });
    let envoy = Envoy::start(EnvoyConfig::new(plugin, &[("a", a.port), ("b", b.port)]));
    // A few scrape intervals, so that the scraped gauges have values.
    std::thread::sleep(std::time::Duration::from_millis(600));

    // Sessions (affinity hit/new), a request without one, a rejected one, then a failover: the
    // first endpoint picked answers 503 and the request completes on the other.
    for turn in 0..3 {
        let body = chat_body("m", &["hello", "again", "more"][..=turn], Value::Null);
        let r = post_chat(envoy.port, &[("x-session-id", "s1")], &body);
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let r = post_chat(
        envoy.port,
        &[],
        &chat_body("m", &["no session"], json!({"user": ""})),
    );
    assert!(
        r.status == 200 || r.status == 400,
        "{} {}",
        r.status,
        r.body
    );
    let bad = post_chat(envoy.port, &[], "{not json");
    assert_eq!(bad.status, 400, "{}", bad.body);
    a.set_fault(json!({"mode": "status", "status": 503}));
    let mut failed_over = false;
    for i in 0..6 {
        let body = chat_body("m", &[&format!("failover {i}")], Value::Null);
        let r = post_chat(envoy.port, &[("x-session-id", &format!("f{i}"))], &body);
        assert_eq!(r.status, 200, "{}", r.body);
        if r.header("x-computeflux-attempts") == Some("2") {
            failed_over = true;
            break;
        }
    }
    assert!(failed_over, "no request failed over from a to b");
    // Gauges are refreshed by the 1 s tick as well.
    std::thread::sleep(std::time::Duration::from_millis(1200));

    let prom = exposition(&envoy.prometheus());
    let emitted: BTreeMap<&String, &BTreeSet<String>> = prom
        .iter()
        .filter(|(k, _)| k.starts_with("computeflux_"))
        .collect();
    assert!(
        !emitted.is_empty(),
        "no computeflux_ metrics in /stats/prometheus"
    );

    // The dashboard: names and labels of every query.
    let queries = dashboard_queries();
    assert!(queries.len() >= 10, "{queries:?}");
    let mut used = BTreeSet::new();
    for q in &queries {
        let names = metric_names(q);
        assert!(!names.is_empty(), "query without a computeflux metric: {q}");
        for n in &names {
            assert!(
                prom.contains_key(n),
                "dashboard uses {n}, not emitted; emitted: {:?}",
                emitted.keys()
            );
        }
        let labels: BTreeSet<String> = names.iter().flat_map(|n| prom[n].iter().cloned()).collect();
        for l in label_names(q) {
            assert!(
                labels.contains(&l),
                "dashboard query uses label {l}, not on {names:?}: {q}"
            );
        }
        used.extend(names);
    }
    for must in [
        "computeflux_requests_total",
        "computeflux_affinity_total",
        "computeflux_breaker_state",
        "computeflux_ewma_latency_ms",
        "computeflux_failovers_total",
        "computeflux_in_flight",
        "computeflux_affinity_payoff_permille",
    ] {
        assert!(used.contains(must), "the dashboard has no panel on {must}");
    }

    // docs/metrics.md: every documented metric is emitted with exactly the documented labels
    // (histograms as _bucket/_sum/_count, whose buckets add `le`).
    let docs = documented();
    for (name, labels) in &docs {
        let (key, extra) = if prom.contains_key(name) {
            (name.clone(), BTreeSet::new())
        } else {
            (format!("{name}_bucket"), BTreeSet::from(["le".to_string()]))
        };
        let seen = prom
            .get(&key)
            .unwrap_or_else(|| panic!("documented {name} is not emitted"));
        let mut want = labels.clone();
        want.extend(extra);
        assert_eq!(seen, &want, "labels of {name}");
    }
    // ... and every metric the filter emits is documented.
    for name in emitted.keys() {
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| {
                name.strip_suffix(s)
                    .filter(|b| docs.iter().any(|(d, _)| d == b))
            })
            .unwrap_or(name);
        assert!(
            docs.iter().any(|(d, _)| d == base),
            "{name} is emitted but not in docs/metrics.md"
        );
    }
    // The definitions in the source agree with the docs (names only; labels are checked above).
    let src =
        std::fs::read_to_string(deploy_support::root().join("src/filter/metrics.rs")).unwrap();
    // (Names in prose such as `computeflux_<noun>_<unit>` end in `_` here and are skipped.)
    for n in metric_names(&src).into_iter().filter(|n| !n.ends_with('_')) {
        assert!(
            docs.iter().any(|(d, _)| *d == n),
            "{n} (src/filter/metrics.rs) not in docs/metrics.md"
        );
    }
}
