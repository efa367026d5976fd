//! Metric label values come from the enums they label, and the reference documents them all.
//!
//! `src/filter/metrics.rs` defines one series per entry of `Outcome::ALL`, `Reason::ALL`,
//! `AffinityResult::ALL` and `RejectReason::ALL`, so a variant added to one of those lists gets
//! its series without another edit. This test keeps `docs/metrics.md` in step: every label
//! value must appear in the row (or paragraph) of its metric, and values must be distinct (two
//! variants sharing a label would share, and blur, one series).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use computeflux::scheduler::routing::scrape::ScrapeError;
use computeflux::scheduler::{AffinityResult, Outcome, Reason, RejectReason, SessionSource};

fn doc() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/metrics.md")).unwrap()
}

/// The paragraph (or table row) of `docs/metrics.md` that starts with `start`.
fn line(doc: &str, start: &str) -> String {
    let mut lines = doc.lines().skip_while(|l| !l.starts_with(start));
    let first = lines
        .next()
        .unwrap_or_else(|| panic!("docs/metrics.md has no line starting with {start:?}"));
    if first.starts_with('|') {
        return first.to_string();
    }
    std::iter::once(first)
        .chain(lines.take_while(|l| !l.trim().is_empty()))
        .collect::<Vec<_>>()
        .join(" ")
}

fn check(doc_line: &str, what: &str, labels: &[&str]) {
    let mut sorted = labels.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(
        sorted.len(),
        labels.len(),
        "{what}: duplicate labels in {labels:?}"
    );
    for l in labels {
        assert!(
            doc_line.contains(&format!("`{l}`")),
            "{what}: label `{l}` is not documented in docs/metrics.md:\n{doc_line}"
        );
    }
}

#[test]
fn every_label_value_is_distinct_and_documented() {
    let doc = doc();
    let outcomes: Vec<&str> = Outcome::ALL.iter().map(|o| o.label()).collect();
    check(&line(&doc, "`outcome` values:"), "outcome", &outcomes);
    let reasons: Vec<&str> = Reason::ALL.iter().map(|r| r.label()).collect();
    check(
        &line(&doc, "| `computeflux_decisions_total`"),
        "decision reason",
        &reasons,
    );
    let sources: Vec<&str> = SessionSource::ALL.iter().map(|s| s.label()).collect();
    check(
        &line(&doc, "| `computeflux_sessions_total`"),
        "session source",
        &sources,
    );
    let results: Vec<&str> = AffinityResult::ALL.iter().map(|a| a.label()).collect();
    check(
        &line(&doc, "| `computeflux_affinity_total`"),
        "affinity result",
        &results,
    );
    for tokens in [
        "| `computeflux_prompt_tokens_total`",
        "| `computeflux_cached_prompt_tokens_total`",
        "| `computeflux_completion_tokens_total`",
        "| `computeflux_affinity_payoff_permille`",
    ] {
        line(&doc, tokens); // documented; the affinity values are listed in the first row
    }
    check(
        &line(&doc, "| `computeflux_prompt_tokens_total`"),
        "token affinity",
        &results,
    );
    let rejects: Vec<&str> = RejectReason::ALL.iter().map(|r| r.label()).collect();
    check(
        &line(&doc, "| `computeflux_rejected_total`"),
        "reject reason",
        &rejects,
    );
    let errors: Vec<&str> = ScrapeError::ALL.iter().map(|e| e.name()).collect();
    check(
        &line(&doc, "| `computeflux_scrape_errors_total`"),
        "scrape error",
        &errors,
    );
}

/// Every metric `src/filter/metrics.rs` defines has its row in `docs/metrics.md`'s table (a
/// counter added to the filter without documentation fails here).
#[test]
fn every_defined_metric_has_a_row() {
    let doc = doc();
    // The request path's metrics, and the scraper's (defined beside it).
    let src = ["/src/filter/metrics.rs", "/src/filter/scrape.rs"]
        .iter()
        .map(|f| std::fs::read_to_string(format!("{}{f}", env!("CARGO_MANIFEST_DIR"))).unwrap())
        .collect::<Vec<_>>()
        .join("\n");
    let mut names: Vec<&str> = src
        .match_indices("\"computeflux_")
        .map(|(i, _)| {
            let rest = &src[i + 1..];
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            &rest[..end]
        })
        .collect();
    names.sort_unstable();
    names.dedup();
    // The counters defined when this test was written, so that a broken scan cannot pass.
    for known in [
        "computeflux_requests_total",
        "computeflux_pin_breaks_total",
        "computeflux_quota_skips_total",
        "computeflux_cas_exhausted_total",
        "computeflux_scrape_errors_total",
        "computeflux_engine_waiting",
    ] {
        assert!(
            names.contains(&known),
            "{known} not found in src/filter/metrics.rs: {names:?}"
        );
    }
    for n in names {
        line(&doc, &format!("| `{n}`"));
    }
}
