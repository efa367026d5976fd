//! Properties of replica-consistent placement (weighted rendezvous hashing with bounded loads),
//! checked on the pure core over random fleets and session streams:
//! - removing an endpoint moves only the sessions that were on it;
//! - adding an endpoint moves about its weight's share of sessions, all of them to it;
//! - the share of new sessions per endpoint tracks its weight;
//! - bounded load is never exceeded by more than its constant;
//! - two schedulers with the same configuration and empty state (two replicas, or one before and
//!   after a restart) place every session alike.
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

use computeflux::scheduler::health::outcome::Outcome;
use computeflux::scheduler::routing::select::{Exclusions, Pick, Prefix, Reason};
use computeflux::scheduler::state::hash::session_key;
use computeflux::scheduler::{Config, MemStore, Scheduler};
use proptest::prelude::*;
use serde_json::json;

fn fleet(weights: &[u32], extra: serde_json::Value) -> Config {
    let endpoints: Vec<_> = weights
        .iter()
        .enumerate()
        .map(|(i, w)| json!({"name": format!("ep-{i}"), "cluster": format!("c{i}"), "weight": w}))
        .collect();
    let mut v = json!({ "endpoints": endpoints });
    if let (Some(obj), Some(more)) = (v.as_object_mut(), extra.as_object()) {
        for (k, x) in more {
            obj.insert(k.clone(), x.clone());
        }
    }
    Config::from_value(&v).unwrap()
}

/// The home of each session on a fresh scheduler (no pins, cold statistics), by endpoint name.
fn homes(cfg: &Config, sessions: &[u64]) -> Vec<String> {
    let store = MemStore::new();
    let s = Scheduler::new(cfg, &store);
    let ex = Exclusions::default();
    sessions
        .iter()
        .map(|&k| {
            let pick = Pick {
                model: Some("m"),
                session: Some(k),
                attempt: 1,
                exclusions: &ex,
                nonce: 0,
                body_bytes: 0,
                pin_hint: None,
                holder: None,
                prefix: Prefix::NONE,
                follow_up: false,
                max_output_tokens: 0,
            };
            let d = s.pick(&pick, 0).unwrap();
            s.finish(d.ticket, &Outcome::Cancelled, 0, None, 0);
            cfg.endpoints[d.endpoint].name.clone()
        })
        .collect()
}

fn sessions(seed: u64, n: usize) -> Vec<u64> {
    (0..n as u64)
        .map(|i| session_key(&seed.to_le_bytes(), &i.to_le_bytes()))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, .. ProptestConfig::default() })]

    #[test]
    fn removing_an_endpoint_moves_only_its_sessions(
        weights in prop::collection::vec(1u32..5, 2..8),
        removed in any::<prop::sample::Index>(),
        seed in any::<u64>(),
    ) {
        let cfg = fleet(&weights, json!({}));
        let gone = removed.index(weights.len());
        let mut fewer = cfg.clone();
        fewer.endpoints.remove(gone);
        let ss = sessions(seed, 600);
        let before = homes(&cfg, &ss);
        let after = homes(&fewer, &ss);
        let gone_name = &cfg.endpoints[gone].name;
        for (b, a) in before.iter().zip(&after) {
            if b != gone_name {
                prop_assert_eq!(b, a);
            }
        }
    }

    #[test]
    fn adding_an_endpoint_moves_its_share_to_it(
        weights in prop::collection::vec(1u32..5, 1..8),
        new_weight in 1u32..5,
        seed in any::<u64>(),
    ) {
        let cfg = fleet(&weights, json!({}));
        let mut grown_w = weights.clone();
        grown_w.push(new_weight);
        let grown = fleet(&grown_w, json!({}));
        let ss = sessions(seed, 2000);
        let before = homes(&cfg, &ss);
        let after = homes(&grown, &ss);
        let new_name = &grown.endpoints[weights.len()].name;
        let mut moved = 0usize;
        for (b, a) in before.iter().zip(&after) {
            if b != a {
                prop_assert_eq!(a, new_name, "a session moved between old endpoints");
                moved += 1;
            }
        }
        let total: u32 = grown_w.iter().sum();
        let expected = f64::from(new_weight) / f64::from(total);
        let share = moved as f64 / ss.len() as f64;
        // 2000 sessions: a binomial's sd is at most 1.2 points; allow 4 sd.
        prop_assert!((share - expected).abs() < 0.045, "moved {share}, expected {expected}");
    }

    #[test]
    fn new_session_shares_track_weights(
        weights in prop::collection::vec(1u32..6, 2..7),
        seed in any::<u64>(),
    ) {
        let cfg = fleet(&weights, json!({}));
        let ss = sessions(seed, 3000);
        let h = homes(&cfg, &ss);
        let total: u32 = weights.iter().sum();
        for (i, w) in weights.iter().enumerate() {
            let name = &cfg.endpoints[i].name;
            let share = h.iter().filter(|x| *x == name).count() as f64 / ss.len() as f64;
            let expected = f64::from(*w) / f64::from(total);
            prop_assert!((share - expected).abs() < 0.04, "{name}: {share} vs {expected}");
        }
    }

    /// Attempts kept in flight (a burst): every placement stays within
    /// `(1 + epsilon) × (L + 1) × w/W + slack`.
    #[test]
    fn bounded_load_is_never_exceeded(
        weights in prop::collection::vec(1u32..5, 2..6),
        epsilon in 0.0f64..1.0,
        slack in 1u64..4,
        seed in any::<u64>(),
        finish_every in 2usize..10,
    ) {
        let cfg = fleet(&weights, json!({"tuning": {"bounded_load_epsilon": epsilon, "bounded_load_slack": slack}}));
        let store = MemStore::new();
        let s = Scheduler::new(&cfg, &store);
        let ex = Exclusions::default();
        let total_w: f64 = weights.iter().map(|w| f64::from(*w)).sum();
        let mut open = Vec::new();
        for (n, k) in sessions(seed, 300).into_iter().enumerate() {
            let pick = Pick { model: Some("m"), session: Some(k), attempt: 1, exclusions: &ex, nonce: 0, body_bytes: 0 , pin_hint: None, holder: None, prefix: Prefix::NONE, follow_up: false, max_output_tokens: 0 };
            let before = s.table();
            let load_before: u64 = before.entries.iter().map(|(_, st)| u64::from(st.in_flight)).sum();
            let d = s.pick(&pick, 0).unwrap();
            let mine = s.table().entries[d.endpoint].1.in_flight;
            let limit = (1.0 + epsilon) * (load_before as f64 + 1.0)
                * f64::from(weights[d.endpoint]) / total_w + slack as f64;
            prop_assert!(f64::from(mine) <= limit + 1e-9, "{mine} > {limit} ({:?})", d.reason);
            open.push(d);
            if n % finish_every == 0 && !open.is_empty() {
                let done = open.remove(0);
                s.finish(done.ticket, &Outcome::Cancelled, 0, None, 0);
            }
        }
    }

    /// A replica that restarts (empty shared data) or never saw a session places it where the
    /// others do, whatever pins and statistics they accumulated meanwhile while healthy.
    #[test]
    fn a_fresh_replica_agrees_with_a_warm_one(
        weights in prop::collection::vec(1u32..4, 2..6),
        latencies in prop::collection::vec(80u64..150, 6),
        seed in any::<u64>(),
    ) {
        let cfg = fleet(&weights, json!({"cold_start_samples": 5}));
        let warm_store = MemStore::new();
        let warm = Scheduler::new(&cfg, &warm_store);
        let ex = Exclusions::default();
        let ss = sessions(seed, 400);
        // The warm replica serves every session once (pins + latency statistics within 2x).
        for &k in &ss {
            let pick = Pick { model: Some("m"), session: Some(k), attempt: 1, exclusions: &ex, nonce: 0, body_bytes: 0 , pin_hint: None, holder: None, prefix: Prefix::NONE, follow_up: false, max_output_tokens: 0 };
            let d = warm.pick(&pick, 0).unwrap();
            prop_assert_eq!(d.reason, Reason::Home);
            warm.finish(d.ticket, &Outcome::Success, latencies[d.endpoint % latencies.len()], Some(k), 1);
        }
        let fresh = homes(&cfg, &ss);
        for (k, home) in ss.iter().zip(&fresh) {
            let pick = Pick { model: Some("m"), session: Some(*k), attempt: 1, exclusions: &ex, nonce: 0, body_bytes: 0 , pin_hint: None, holder: None, prefix: Prefix::NONE, follow_up: false, max_output_tokens: 0 };
            let d = warm.pick(&pick, 2).unwrap();
            warm.finish(d.ticket, &Outcome::Cancelled, 0, None, 2);
            prop_assert_eq!(&cfg.endpoints[d.endpoint].name, home);
        }
    }
}
