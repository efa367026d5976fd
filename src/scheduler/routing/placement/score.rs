//! The score of an endpoint: static weight while cold, live signals once warm.
//!
//! ```text
//! cold (total < cold_start_samples):  score = weight
//! warm:  score = weight × success_rate × load_factor / latency_factor
//!   success_rate   = 1 - (1 - sr)·fade          sr: EWMA of 1/0 outcomes (SUCCESS_RATE_ALPHA)
//!   load_factor    = 1 / (1 + in_flight)        every request already queued there costs
//!                                               one more service time (peak-EWMA style)
//!   latency_factor = 1 + (ewma/best - 1)·fade   relative to the fastest warm candidate,
//!                                               so the fastest has factor 1 and a 5× slower
//!                                               one scores 1/5 of it
//!   fade           = 1 / (1 + idle/STATS_DECAY_MS)   idle = time since the last sample
//! ```
//! The success rate is floored at 1 % so that weights still order endpoints that all fail.
//! Scores are all in `(0, weight]`, so cold and warm endpoints compare on one scale.
//!
//! [`health`] is the score's smoothed part, `success_rate / latency_factor`: what placement
//! across Envoy replicas weighs endpoints by, since in-flight counts are per Envoy.

use crate::scheduler::config::Config;
use crate::scheduler::routing::table::ewma::{fade, LATENCY_FLOOR_MS};
use crate::scheduler::routing::table::EndpointState;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scored {
    pub score: f64,
    pub cold: bool,
}

const SUCCESS_FLOOR: f64 = 0.01;

pub fn score(
    weight: f64,
    st: &EndpointState,
    best_latency_ms: Option<f64>,
    cfg: &Config,
    now_ms: u64,
) -> Scored {
    match health(st, best_latency_ms, cfg, now_ms) {
        None => Scored {
            score: weight,
            cold: true,
        },
        Some(h) => Scored {
            // One quotient: every request already queued there costs one more service time.
            score: weight * h / (1.0 + f64::from(st.load(now_ms, cfg.in_flight_max_age_ms))),
            cold: false,
        },
    }
}

/// The smoothed part of the score, `success_rate / latency_factor` in `(0, 1]`; `None` while
/// the endpoint is cold. Unlike the score it ignores in-flight counts, which each Envoy sees
/// only for itself: placement across replicas weighs endpoints by this (see `placement`).
/// Time constant with which an idle endpoint's latency and failure penalties fade back toward
/// neutral, so an endpoint that was slow once is tried again. Not a key: the measured default.
pub const STATS_DECAY_MS: u64 = 60_000;

pub fn health(
    st: &EndpointState,
    best_latency_ms: Option<f64>,
    cfg: &Config,
    now_ms: u64,
) -> Option<f64> {
    let success = success(st, cfg, now_ms)?;
    let f = fade(now_ms.saturating_sub(st.last_sample_ms), STATS_DECAY_MS);
    let latency = match latency_ratio(st, best_latency_ms) {
        Some(raw) => 1.0 + (raw - 1.0).max(0.0) * f,
        None => 1.0,
    };
    Some(success / latency)
}

/// The faded success rate in `[0.01, 1]`; `None` while the endpoint is cold.
pub fn success(st: &EndpointState, cfg: &Config, now_ms: u64) -> Option<f64> {
    if st.total < cfg.cold_start_samples {
        return None;
    }
    let f = fade(now_ms.saturating_sub(st.last_sample_ms), STATS_DECAY_MS);
    Some((1.0 - (1.0 - st.success_rate) * f).max(SUCCESS_FLOOR))
}

/// The endpoint's latency estimate over the fastest's, unfaded (1 for the fastest).
pub fn latency_ratio(st: &EndpointState, best_latency_ms: Option<f64>) -> Option<f64> {
    match (st.latency_ms, best_latency_ms) {
        (Some(own), Some(best)) => Some(own.max(LATENCY_FLOOR_MS) / best.max(LATENCY_FLOOR_MS)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn cfg() -> Config {
        Config::default()
    }

    #[test]
    fn cold_endpoint_scores_its_weight() {
        let st = EndpointState {
            total: 19,
            success_rate: 0.0,
            in_flight: 9,
            in_flight_changed_ms: 0,
            ..Default::default()
        };
        assert_eq!(
            score(2.5, &st, Some(1.0), &cfg(), 0),
            Scored {
                score: 2.5,
                cold: true
            }
        );
    }

    #[test]
    fn warm_formula_with_exact_numbers() {
        let st = EndpointState {
            total: 20,
            success_rate: 0.8,
            latency_ms: Some(500.0),
            last_sample_ms: 1_000,
            in_flight: 1,
            in_flight_changed_ms: 1_000,
            ..Default::default()
        };
        // fresh: fade = 1 → 2 × 0.8 × 1/2 / (500/250) = 0.4
        let s = score(2.0, &st, Some(250.0), &cfg(), 1_000);
        assert!((s.score - 0.4).abs() < 1e-12 && !s.cold, "{s:?}");
        // after one decay period idle: fade 0.5 → sr 0.9, latency factor 1.5 → 2 × .9 × .5 / 1.5
        let s = score(2.0, &st, Some(250.0), &cfg(), 61_000);
        assert!((s.score - 0.6).abs() < 1e-12, "{s:?}");
    }

    #[test]
    fn five_times_slower_scores_a_fifth() {
        let fast = EndpointState {
            total: 50,
            latency_ms: Some(100.0),
            last_sample_ms: 5,
            ..Default::default()
        };
        let slow = EndpointState {
            latency_ms: Some(500.0),
            ..fast
        };
        let a = score(1.0, &fast, Some(100.0), &cfg(), 5).score;
        let b = score(1.0, &slow, Some(100.0), &cfg(), 5).score;
        assert!((a / b - 5.0).abs() < 1e-9);
    }
}
