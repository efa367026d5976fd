//! What an attempt's response means for the endpoint that produced it.
//!
//! | response                                   | outcome           | breaker            | failover |
//! |--------------------------------------------|-------------------|--------------------|----------|
//! | 2xx (and 1xx/3xx: the endpoint did answer) | `Success`         | resets the streak  | no       |
//! | 401, 403                                   | `DeadKey`         | none (per request) | yes      |
//! | 429                                        | `RateLimited`     | opens at once      | yes      |
//! | 500, 502, 503, 504, connect failure, reset, timeout | `EndpointFailure` | counts toward open | yes |
//! | any other 4xx                              | `ClientError`     | none               | no       |
//! | other 5xx (501, 505, ...)                  | `ClientError`-like: the request is unsupported, not the endpoint down |
//!
//! Rate-limit reset hints are read from `Retry-After` (delta seconds or an HTTP-date),
//! `retry-after-ms`, and OpenAI's `x-ratelimit-reset-requests` / `-tokens` (`"1s"`, `"6m0s"`,
//! `"20ms"`), taking the largest valid one.

use crate::scheduler::time::{parse_go_duration_ms, parse_http_date_ms};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    Status(u16),
    ConnectFailure,
    Reset,
    Timeout,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Success,
    DeadKey,
    RateLimited {
        retry_after_ms: Option<u64>,
    },
    EndpointFailure(FailureKind),
    ClientError,
    /// The attempt ended without a verdict (client went away): no statistics, no breaker.
    Cancelled,
}

impl Outcome {
    /// The label used in metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Success => "success",
            Outcome::DeadKey => "dead_key",
            Outcome::RateLimited { .. } => "rate_limited",
            Outcome::EndpointFailure(_) => "endpoint_failure",
            Outcome::ClientError => "client_error",
            Outcome::Cancelled => "cancelled",
        }
    }

    /// Whether the same client request should move to the next endpoint.
    pub fn fails_over(&self) -> bool {
        matches!(
            self,
            Outcome::DeadKey | Outcome::RateLimited { .. } | Outcome::EndpointFailure(_)
        )
    }

    /// One outcome of each kind, in metric order: `computeflux_requests_total{outcome}` is
    /// defined from it, and [`Outcome::index`] is an outcome's place in it.
    pub const ALL: [Outcome; 6] = [
        Outcome::Success,
        Outcome::DeadKey,
        Outcome::RateLimited {
            retry_after_ms: None,
        },
        Outcome::EndpointFailure(FailureKind::Reset),
        Outcome::ClientError,
        Outcome::Cancelled,
    ];

    /// The position of this outcome's kind in [`Outcome::ALL`].
    pub fn index(&self) -> usize {
        match self {
            Outcome::Success => 0,
            Outcome::DeadKey => 1,
            Outcome::RateLimited { .. } => 2,
            Outcome::EndpointFailure(_) => 3,
            Outcome::ClientError => 4,
            Outcome::Cancelled => 5,
        }
    }
}

/// Classifies a response by its status and headers (lower-case names). `now_ms` is wall-clock
/// Unix milliseconds, needed for HTTP-date `Retry-After`.
pub fn classify(status: u16, headers: &[(String, String)], now_ms: u64) -> Outcome {
    match status {
        401 | 403 => Outcome::DeadKey,
        429 => Outcome::RateLimited {
            retry_after_ms: retry_hint_ms(headers, now_ms),
        },
        500 | 502 | 503 | 504 => Outcome::EndpointFailure(FailureKind::Status(status)),
        400..=599 => Outcome::ClientError,
        _ => Outcome::Success,
    }
}

/// The wait a 429's rate-limit headers state, in ms from `now_ms`: the longest valid hint,
/// except that a whole-second `Retry-After` (rounded up: `1` for a window that resets in
/// 312 ms) yields to a millisecond hint of the same wait (`retry-after-ms`,
/// `x-ratelimit-reset-*` within the second below it). Cooled for the rounded second, a key
/// stayed unused for most of a second after its window had reset, and the sessions pinned
/// there moved (the quota bench). Hints that disagree by more keep the longest.
pub fn retry_hint_ms(headers: &[(String, String)], now_ms: u64) -> Option<u64> {
    let mut coarse: Option<u64> = None;
    let mut precise: Option<u64> = None;
    for (name, value) in headers {
        match name.as_str() {
            "retry-after" => {
                let v = parse_retry_after(value, now_ms);
                coarse = coarse.max(v);
            }
            "retry-after-ms" => {
                let v = value
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite() && *v >= 0.0)
                    .map(|v| v as u64);
                precise = precise.max(v);
            }
            "x-ratelimit-reset-requests" | "x-ratelimit-reset-tokens" => {
                precise = precise.max(parse_go_duration_ms(value));
            }
            _ => {}
        }
    }
    match (coarse, precise) {
        (Some(c), Some(p)) if p <= c && p.saturating_add(1_000) > c => Some(p),
        (c, p) => c.max(p),
    }
}

/// `Retry-After`: delta-seconds, or an IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`).
pub fn parse_retry_after(value: &str, now_ms: u64) -> Option<u64> {
    let v = value.trim();
    if let Ok(secs) = v.parse::<u64>() {
        return Some(secs.saturating_mul(1000));
    }
    let at_ms = parse_http_date_ms(v)?;
    Some(at_ms.saturating_sub(now_ms))
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn h(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn classification_table() {
        assert_eq!(classify(200, &[], 0), Outcome::Success);
        assert_eq!(classify(401, &[], 0), Outcome::DeadKey);
        assert_eq!(classify(403, &[], 0), Outcome::DeadKey);
        assert_eq!(
            classify(429, &[], 0),
            Outcome::RateLimited {
                retry_after_ms: None
            }
        );
        for s in [500, 502, 503, 504] {
            assert_eq!(
                classify(s, &[], 0),
                Outcome::EndpointFailure(FailureKind::Status(s))
            );
            assert!(classify(s, &[], 0).fails_over());
        }
        assert_eq!(classify(400, &[], 0), Outcome::ClientError);
        assert_eq!(classify(404, &[], 0), Outcome::ClientError);
        assert_eq!(classify(501, &[], 0), Outcome::ClientError);
        assert!(!Outcome::ClientError.fails_over());
    }

    #[test]
    fn all_lists_each_kind_once_at_its_index() {
        for (i, o) in Outcome::ALL.iter().enumerate() {
            assert_eq!(o.index(), i, "{o:?}");
        }
        let mut labels: Vec<&str> = Outcome::ALL.iter().map(|o| o.label()).collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), Outcome::ALL.len());
    }

    #[test]
    fn retry_after_forms() {
        assert_eq!(
            classify(429, &h(&[("retry-after", "7")]), 0),
            Outcome::RateLimited {
                retry_after_ms: Some(7000)
            }
        );
        // 1994-11-06T08:49:37Z = 784111777 s
        assert_eq!(
            parse_http_date_ms("Sun, 06 Nov 1994 08:49:37 GMT"),
            Some(784_111_777_000)
        );
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT", 784_111_770_000),
            Some(7_000)
        );
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT", 784_111_790_000),
            Some(0)
        );
        assert_eq!(parse_retry_after("soon", 0), None);
        assert_eq!(parse_http_date_ms("Sun, 06 Nov 1994 08:49:37 PST"), None);
        assert_eq!(parse_go_duration_ms("6m0s"), Some(360_000));
        assert_eq!(parse_go_duration_ms("1m30.5s"), Some(90_500));
        assert_eq!(parse_go_duration_ms("20ms"), Some(20));
        assert_eq!(parse_go_duration_ms("1x"), None);
        let hint = retry_hint_ms(
            &h(&[
                ("retry-after", "1"),
                ("retry-after-ms", "2500"),
                ("x-ratelimit-reset-requests", "2s"),
            ]),
            0,
        );
        assert_eq!(hint, Some(2_500));
    }

    /// A whole-second `Retry-After` is the rounded-up form of a millisecond hint of the same
    /// wait: the precise one is taken. Hints that disagree keep the longest.
    #[test]
    fn a_rounded_retry_after_yields_to_the_same_wait_in_milliseconds() {
        let hint = |pairs: &[(&str, &str)]| retry_hint_ms(&h(pairs), 0);
        let tokens = ("x-ratelimit-reset-tokens", "312ms");
        assert_eq!(hint(&[("retry-after", "1"), tokens]), Some(312));
        assert_eq!(hint(&[tokens, ("retry-after", "1")]), Some(312));
        assert_eq!(
            hint(&[("retry-after", "2"), ("retry-after-ms", "1478")]),
            Some(1_478)
        );
        assert_eq!(
            hint(&[("retry-after", "2"), ("retry-after-ms", "2000")]),
            Some(2_000)
        );
        // Not the same wait: the longest.
        assert_eq!(hint(&[("retry-after", "20"), tokens]), Some(20_000));
        assert_eq!(
            hint(&[("retry-after", "1"), ("x-ratelimit-reset-requests", "6m0s")]),
            Some(360_000)
        );
        assert_eq!(hint(&[("retry-after", "3")]), Some(3_000));
        assert_eq!(hint(&[tokens]), Some(312));
        assert_eq!(hint(&[("retry-after", "soon"), tokens]), Some(312));
    }
}
