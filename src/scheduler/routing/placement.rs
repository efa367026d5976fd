//! Placement: where a session without a live pin goes, computed so that every Envoy agrees.
//!
//! Users run several Envoy replicas behind one load balancer and restart them on every rollout.
//! Shared data is per process, so a session's pin is known only to the replica that served it.
//! A follow-up turn that lands on another replica (or on a restarted one) must still reach the
//! endpoint holding the conversation's KV cache: its place has to be a function of what every
//! replica knows alike — the configuration, the session key and smoothed statistics.
//!
//! **Weighted rendezvous hashing** (highest random weight). Each candidate gets
//! `key = w / -ln(u)`, with `u ∈ (0, 1)` a uniform hash of (session, endpoint id) and `w` its
//! placement weight; candidates in decreasing key order are the session's *rendezvous order*,
//! and the first is its *home*. The probability that an endpoint is a session's home is
//! `w / Σw`; removing an endpoint moves only the sessions whose home it was, adding one takes
//! about `w_new / Σw` of them from the others; and failover walks the same order, so replicas
//! that discover the same fault independently converge on the same backup.
//!
//! **Placement weight** = `weight × quantize(health)`, where `health = success / latency
//! factor ∈ (0, 1]` (`score::health`; `1` while cold, so the cold start is by weight alone).
//! Replicas measure slightly different statistics; quantizing health to levels `2^(-k·q)`
//! (`q = placement_quantum`, default one halving) makes small differences vanish: every endpoint
//! within 2× of the fastest and succeeding weighs exactly its `weight` on every replica. Only an
//! endpoint near a level boundary can be weighed differently, and then only the sessions near
//! the corresponding rendezvous boundary move (`examples/placement_sim.rs` measures this).
//!
//! **Bounded load** (consistent hashing with bounded loads, as Envoy's `hash_balance_factor`).
//! In-flight counts are per replica, so they must not weigh placement; they bound it instead. A
//! candidate whose in-flight would exceed `(1 + ε) × (L + 1) × w / Σw + slack` (L: in-flight over
//! the candidates) is skipped in rendezvous order (a *spill*). Since the shares add up to
//! `L + 1 > L`, some candidate is always within its bound when `slack ≥ 1`.
//!
//! **Affinity payoff** (`payoff_floor`, off by default): an endpoint whose pinned turns find
//! (almost) nothing in its cache weighs `payoff_weight` × the above (see [`crate::scheduler::routing::payoff`]).
//!
//! **Degraded endpoints** (far slower than the fastest, see [`degraded`]) get no new sessions
//! but a probe now and then, and their pins are broken (`select`).

use crate::scheduler::config::Config;
use crate::scheduler::routing::ewma::LATENCY_FLOOR_MS;
use crate::scheduler::routing::overdue::Rule as OverdueRule;
use crate::scheduler::routing::payoff::PayoffRule;
use crate::scheduler::routing::score::health;
use crate::scheduler::routing::table::EndpointState;
use crate::scheduler::state::hash::rendezvous;

/// `u ∈ (0, 1)` from the 52 high bits of a 64-bit hash: never 0 nor 1 (every value is exactly
/// representable), so `ln u` is finite and negative.
fn unit(h: u64) -> f64 {
    ((h >> 12) as f64 + 0.5) * (1.0 / (1u64 << 52) as f64)
}

/// The weighted rendezvous key of (session, endpoint): larger wins. A weight of zero (or less)
/// never wins against a positive one.
pub fn hrw_key(session_key: u64, endpoint_id: u32, weight: f64) -> f64 {
    if weight.is_nan() || weight <= 0.0 {
        return 0.0;
    }
    weight / -unit(rendezvous(session_key, endpoint_id)).ln()
}

/// `h ∈ (0, 1]` rounded up to the nearest level `2^(-k·step)` at or above it, so that
/// `(2^-step, 1]` all reads as 1: a dead band in which small differences between replicas'
/// measurements change nothing. `step = 0` keeps `h`. Levels are computed by repeated
/// multiplication from 1, so the same inputs give the same level on every target.
pub fn quantize(h: f64, step: f64) -> f64 {
    if h.is_nan() || h <= 0.0 {
        return 0.0;
    }
    let h = h.min(1.0);
    if step <= 0.0 {
        return h;
    }
    let ratio = 0.5f64.powf(step);
    let mut level = 1.0;
    // Health is at least 1e-2 / latency factor in practice: this ends within a few rounds;
    // the bound only guards against a degenerate step.
    for _ in 0..256 {
        let next = level * ratio;
        if h > next {
            return level;
        }
        level = next;
    }
    level
}

/// What placement knows of one endpoint.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weighed {
    /// `weight × quantize(health)`: its share of new sessions.
    pub weight: f64,
    /// Whether it should be treated as degraded now: by its estimate, or by overdue affinity
    /// hits in flight (see `overdue`).
    pub degraded: bool,
    /// Degraded by its estimate alone: what is stored for the hysteresis and what makes
    /// probes due.
    pub sticky: bool,
}

/// Weighs an endpoint for placement. `best_latency_ms` is the fastest warm latency among the
/// endpoints that could serve the request at all (before request exclusions and breakers, so
/// that a failover walks the same order as the first attempt).
pub fn weigh(
    weight: f64,
    st: &EndpointState,
    best_latency_ms: Option<f64>,
    cfg: &Config,
    now_ms: u64,
) -> Weighed {
    let warm = st.total >= cfg.cold_start_samples;
    let latency = match (st.latency_ms, best_latency_ms) {
        (Some(own), Some(best)) if warm => Some((own, best)),
        _ => None,
    };
    let h = health(st, best_latency_ms, cfg, now_ms).unwrap_or(1.0);
    // An endpoint whose pinned turns find nothing cached gains nothing from sessions (a
    // boolean of smoothed state, like the health levels: see `payoff`).
    let payoff = PayoffRule::from_config(cfg).factor(&st.payoff);
    let sticky = degraded(st.degraded, latency, cfg);
    // Only looked at when the estimate alone does not already say so.
    let overdue = !sticky
        && latency.is_some_and(|(own, best)| {
            st.watch.overdue(
                own,
                st.latency_dev_ms,
                best,
                &OverdueRule::from_config(cfg),
                now_ms,
            )
        });
    Weighed {
        weight: weight * quantize(h, cfg.placement_quantum) * payoff,
        degraded: sticky || overdue,
        sticky,
    }
}

/// How long after its last probe a degraded endpoint that has had `probes` probes since it
/// was degraded (or since one came back fast) gets the next: `degraded_probe_interval_ms`
/// doubled per probe, up to `degraded_probe_max_interval_ms` (never below the base).
pub fn probe_interval(cfg: &Config, probes: u8) -> u64 {
    let base = cfg.degraded_probe_interval_ms;
    let cap = cfg.degraded_probe_max_interval_ms.max(base);
    let doubled = base.saturating_mul(1u64 << u32::from(probes.min(20)));
    doubled.min(cap)
}

/// The degraded rule with hysteresis. A warm endpoint becomes degraded when its latency
/// estimate reaches `pin_break_ratio` × the fastest's *and* exceeds it by `pin_break_min_ms`
/// (a ratio of small numbers is noise, and a few milliseconds a turn never repay a re-prefill);
/// it stays so until it falls below `degraded_exit_ratio` × the fastest's or within half of
/// `pin_break_min_ms` of it. `latency` is (own, fastest) in ms; a cold or unmeasured endpoint
/// (`None`) is never degraded.
pub fn degraded(was: bool, latency: Option<(f64, f64)>, cfg: &Config) -> bool {
    let Some((own, best)) = latency else {
        return false;
    };
    let ratio = own.max(LATENCY_FLOOR_MS) / best.max(LATENCY_FLOOR_MS);
    let gap = own - best;
    let min_gap = cfg.pin_break_min_ms as f64;
    if was {
        ratio >= cfg.degraded_exit_ratio && gap >= min_gap / 2.0
    } else {
        ratio >= cfg.pin_break_ratio && gap >= min_gap
    }
}

/// Candidates (`(index, endpoint id, weight)`) in rendezvous order for `session_key`:
/// decreasing key, ties (equal keys, e.g. zero weights) by endpoint id.
pub fn order(session_key: u64, candidates: &[(usize, u32, f64)]) -> Vec<usize> {
    let mut keyed: Vec<(f64, u32, usize)> = candidates
        .iter()
        .map(|&(i, id, w)| (hrw_key(session_key, id, w), id, i))
        .collect();
    keyed.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    keyed.into_iter().map(|(_, _, i)| i).collect()
}

/// The first candidate of [`order`] that `keep` accepts, found without sorting (a pin hit needs
/// only the session's home).
pub fn first(
    session_key: u64,
    candidates: &[(usize, u32, f64)],
    keep: impl Fn(usize) -> bool,
) -> Option<usize> {
    candidates
        .iter()
        .filter(|c| keep(c.0))
        .map(|&(i, id, w)| (hrw_key(session_key, id, w), id, i))
        // The largest key; among equal keys the smallest id, as `order` ranks them.
        .max_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)))
        .map(|(_, _, i)| i)
}

/// The bounded-load limit of one candidate: in-flight attempts it may have *after* taking one
/// more, given `total_load` in flight over all candidates.
pub fn load_limit(total_load: u64, weight: f64, total_weight: f64, cfg: &Config) -> f64 {
    let share = if total_weight > 0.0 {
        weight / total_weight
    } else {
        0.0
    };
    (1.0 + cfg.bounded_load_epsilon) * (total_load as f64 + 1.0) * share
        + cfg.bounded_load_slack as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn quantize_levels() {
        assert_eq!(quantize(1.0, 1.0), 1.0);
        assert_eq!(quantize(0.51, 1.0), 1.0);
        assert_eq!(quantize(0.5, 1.0), 0.5);
        assert_eq!(quantize(0.49, 1.0), 0.5);
        assert_eq!(quantize(0.25, 1.0), 0.25);
        assert_eq!(quantize(0.2, 1.0), 0.25);
        assert_eq!(quantize(0.7, 0.0), 0.7);
        assert_eq!(quantize(f64::NAN, 1.0), 0.0);
        assert_eq!(quantize(3.0, 1.0), 1.0);
        // Half-halvings: levels 1, 0.707, 0.5, ...
        assert_eq!(quantize(0.6, 0.5), 0.5f64.powf(0.5));
        assert_eq!(quantize(0.8, 0.5), 1.0);
    }

    #[test]
    fn quantize_is_a_fixed_point_below_the_first_level() {
        // Everything within 2x of the best (health above one half) weighs the same.
        for h in [0.5001, 0.6, 0.75, 0.9, 0.99, 1.0] {
            assert_eq!(quantize(h, 1.0), 1.0, "{h}");
        }
    }

    #[test]
    fn unit_is_open_interval() {
        assert!(unit(0) > 0.0 && unit(u64::MAX) < 1.0);
        assert!(hrw_key(1, 2, 1.0).is_finite());
        assert_eq!(hrw_key(1, 2, 0.0), 0.0);
        assert_eq!(hrw_key(1, 2, f64::NAN), 0.0);
    }

    /// Pinned: the same inputs must give the same order natively and on wasm32 (this test runs
    /// under wasm-bindgen-test too), or replicas built for different targets would disagree.
    #[test]
    fn order_is_pinned() {
        let cands: Vec<(usize, u32, f64)> = (0..6)
            .map(|i| (i, 1000 + i as u32, 1.0 + i as f64 * 0.5))
            .collect();
        let orders: Vec<Vec<usize>> = [1u64, 2, 3, 0xdead_beef]
            .iter()
            .map(|s| order(*s, &cands))
            .collect();
        assert_eq!(orders, EXPECTED_ORDERS);
    }

    const EXPECTED_ORDERS: [[usize; 6]; 4] = [
        [4, 3, 1, 2, 5, 0],
        [0, 5, 4, 2, 1, 3],
        [5, 0, 2, 1, 3, 4],
        [3, 2, 5, 4, 1, 0],
    ];

    #[test]
    fn first_is_the_first_of_order() {
        // Zero weights tie (key 0) and are ranked by id: covered too.
        let cands: Vec<(usize, u32, f64)> = (0..7)
            .map(|i| {
                (
                    i,
                    500 - i as u32 * 3,
                    [0.0, 1.0, 2.5, 0.0, 1.0, 4.0, 0.5][i],
                )
            })
            .collect();
        for s in 0..2_000u64 {
            let key = crate::scheduler::state::hash::fmix64(s);
            for skip in [None, Some(2usize), Some(5)] {
                let keep = |i: usize| Some(i) != skip;
                let expected = order(key, &cands).into_iter().find(|&i| keep(i));
                assert_eq!(
                    first(key, &cands, keep),
                    expected,
                    "session {s}, skip {skip:?}"
                );
            }
        }
        assert_eq!(first(1, &cands, |_| false), None);
    }

    #[test]
    fn shares_follow_weights() {
        let cands = [(0usize, 11u32, 1.0), (1, 22, 2.0), (2, 33, 1.0)];
        let mut homes = [0u32; 3];
        for s in 0..40_000u64 {
            let o = order(crate::scheduler::state::hash::fmix64(s), &cands);
            homes[o[0]] += 1;
        }
        let share = |i: usize| f64::from(homes[i]) / 40_000.0;
        assert!((share(0) - 0.25).abs() < 0.01, "{homes:?}");
        assert!((share(1) - 0.50).abs() < 0.01, "{homes:?}");
        assert!((share(2) - 0.25).abs() < 0.01, "{homes:?}");
    }

    #[test]
    fn degraded_has_hysteresis_and_ignores_cold() {
        let cfg = Config::default(); // break 3.0 and 50 ms, exit 1.5 or 25 ms
        assert!(!degraded(false, None, &cfg));
        assert!(!degraded(true, None, &cfg));
        assert!(!degraded(false, Some((290.0, 100.0)), &cfg));
        assert!(degraded(false, Some((300.0, 100.0)), &cfg));
        assert!(degraded(true, Some((160.0, 100.0)), &cfg));
        assert!(!degraded(true, Some((140.0, 100.0)), &cfg));
        // Small absolute numbers are noise: 3 ms against 1 ms is not degraded, nor 45 vs 10.
        assert!(!degraded(false, Some((3.0, 1.0)), &cfg));
        assert!(!degraded(false, Some((45.0, 10.0)), &cfg));
        assert!(degraded(false, Some((60.0, 10.0)), &cfg));
        assert!(degraded(true, Some((40.0, 10.0)), &cfg));
        assert!(!degraded(true, Some((30.0, 10.0)), &cfg));
    }

    #[test]
    fn load_limit_exact() {
        let cfg = Config::default(); // epsilon 1, slack 8
                                     // 9 in flight, a quarter of the weight: 2 x 10 x 0.25 + 8
        assert_eq!(load_limit(9, 1.0, 4.0, &cfg), 13.0);
        assert_eq!(load_limit(0, 1.0, 0.0, &cfg), 8.0);
    }
}
