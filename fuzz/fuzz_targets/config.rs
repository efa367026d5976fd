//! Configuration parsing and validation on arbitrary bytes: never panics; an accepted
//! configuration satisfies every documented bound; a refused one names a field for each problem.
#![no_main]

use computeflux::scheduler::config::{is_header_name, is_header_value, MAX_ENDPOINTS};
use computeflux::scheduler::Config;
use libfuzzer_sys::fuzz_target;

fn check_valid(c: &Config) {
    assert!(!c.endpoints.is_empty() && c.endpoints.len() <= MAX_ENDPOINTS);
    for (i, e) in c.endpoints.iter().enumerate() {
        assert!(!e.name.is_empty() && e.name.len() <= 64, "{e:?}");
        assert!(!e.cluster.is_empty() && e.cluster.len() <= 255, "{e:?}");
        assert!(e.weight.is_finite() && e.weight > 0.0 && e.weight <= 1_000_000.0);
        if let Some(m) = &e.models {
            assert!(!m.is_empty());
        }
        for (n, v) in &e.headers {
            assert!(is_header_name(n) && n.to_ascii_lowercase() == *n, "{n:?}");
            assert!(is_header_value(v));
            assert!(
                !["host", "content-length", "transfer-encoding", "connection"]
                    .contains(&n.as_str())
            );
            assert_ne!(n, &c.routing_header);
        }
        for o in c.endpoints.iter().skip(i + 1) {
            assert_ne!(o.name, e.name);
            assert_ne!(o.id, e.id);
        }
        assert_eq!(c.endpoint_index(e.id), Some(i));
    }
    assert!(c.ewma_alpha > 0.0 && c.ewma_alpha <= 1.0);
    assert!((1..=1000).contains(&c.half_open_probes));
    assert!((1..=1000).contains(&c.failure_threshold));
    assert!((1..=16).contains(&c.max_attempts));
    assert!((1..=16 * 1024 * 1024).contains(&c.max_body_bytes));
    assert!((1..=10_000_000).contains(&c.affinity_max_sessions));
    assert!(c.affinity_ttl_ms >= 1 && c.open_ms >= 1 && c.rate_limit_ms >= 1);
    assert!((0.0..=100.0).contains(&c.retry_budget_percent));
    assert_ne!(c.routing_header, c.session_header);
    // The summary names header names, never values (values long enough not to occur by chance
    // elsewhere in the summary).
    let summary = c.summary();
    for e in &c.endpoints {
        for (_, v) in &e.headers {
            let elsewhere = c.endpoints.iter().any(|o| {
                o.name.contains(v.as_str())
                    || o.cluster.contains(v.as_str())
                    || o.models.iter().flatten().any(|m| m.contains(v.as_str()))
                    || o.headers.iter().any(|(n, _)| n.contains(v.as_str()))
            }) || c.routing_header.contains(v.as_str())
                || c.session_header.contains(v.as_str());
            if v.len() >= 12 && !elsewhere {
                assert!(!summary.contains(v.as_str()), "header value in the summary");
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    match Config::from_json(data) {
        Ok(c) => {
            check_valid(&c);
            let v: serde_json::Value = serde_json::from_slice(data).expect("accepted JSON");
            assert_eq!(Config::from_value(&v), Ok(c));
        }
        Err(errors) => {
            assert!(!errors.is_empty());
            for e in &errors {
                assert!(!e.field.is_empty() && !e.problem.is_empty(), "{e:?}");
                let _ = e.to_string();
            }
        }
    }
});
