// The walk in lazy rendezvous order (a heap, summing weights without sorting when they are
// equal) against the straightforward walk over the sorted order, on random fleets.
use super::*;
use crate::scheduler::health::breaker::BreakerState;
use crate::scheduler::state::hash::fmix64;
use crate::scheduler::state::store::MemStore;
use proptest::prelude::*;
use serde_json::json;

impl<'a> Scheduler<'a> {
    /// The walk as it was written before the lazy order: sort everything, sum in order.
    #[allow(clippy::too_many_arguments)]
    fn walk_sorted(
        &self,
        board: &Board,
        table: &Table,
        keyed: &placement::Keyed,
        pin: &PinVerdict,
        pick: &Pick<'_>,
        now_ms: u64,
        quota_skipped: &mut Vec<usize>,
    ) -> Option<(usize, Reason)> {
        let left = pin.left();
        let order = keyed.order();
        let eligible = |i: usize| {
            board.admitted(i)
                && !board.degraded(i)
                && Some(i) != left
                && !(board.saturated(i) && board.room_elsewhere(i))
        };
        let (total_load, total_weight) = order
            .iter()
            .filter(|&&i| eligible(i))
            .fold((0u64, 0.0f64), |(l, w), &i| {
                (l + u64::from(board.load_of(i)), w + board.weight(i))
            });
        let mut passed = Passed::default();
        for &i in &order {
            if Some(i) == left {
                passed.unavailable = true;
                continue;
            }
            if board.degraded(i) {
                if self.probe_due(board, table, i, pick, now_ms) {
                    return Some((i, Reason::DegradedProbe));
                }
                passed.degraded = true;
                continue;
            }
            if board.admitted(i) && board.short(i) && !quota_skipped.contains(&i) {
                quota_skipped.push(i);
            }
            if !board.admitted(i) || board.short(i) {
                passed.unavailable = true;
                continue;
            }
            if board.saturated(i) && board.room_elsewhere(i) {
                passed.saturated = true;
                continue;
            }
            let load = f64::from(board.load_of(i));
            if load + 1.0
                > placement::load_limit(total_load, board.weight(i), total_weight, self.cfg)
            {
                passed.spilled.get_or_insert(i);
                continue;
            }
            return Some((i, passed.reason(pin, pick.attempt)));
        }
        passed.spilled.map(|i| (i, Reason::Spill))
    }
}

/// A fleet of `n` endpoints and a table, drawn from `seed`: mixed weights (sometimes all
/// equal), in-flight loads near the bounded-load limit, open breakers, slow endpoints.
#[allow(clippy::unwrap_used)]
fn fleet(seed: u64, n: usize, equal_weights: bool) -> (Config, Table) {
    let r = |k: u64| fmix64(seed ^ fmix64(k));
    let eps: Vec<_> = (0..n)
        .map(|i| {
            let w = if equal_weights {
                1.0
            } else {
                match r(i as u64) % 5 {
                    1 => 2.0,
                    2 => 0.5,
                    4 => 3.0,
                    _ => 1.0,
                }
            };
            json!({"name": format!("e{i}"), "cluster": format!("c{i}"), "weight": w})
        })
        .collect();
    let c = Config::from_value(&json!({
        "endpoints": eps,
        "tuning": {"bounded_load_epsilon": 0.25, "bounded_load_slack": 1 + r(999) % 3},
    }))
    .unwrap();
    let mut t = Table::load(None, &c).0;
    for (i, (_, st)) in t.entries.iter_mut().enumerate() {
        let x = r(1_000 + i as u64);
        st.in_flight = (x % 7) as u32;
        st.in_flight_ages = Default::default();
        for _ in 0..st.in_flight {
            st.in_flight_ages.add(NOW, c.in_flight_max_age_ms);
        }
        st.in_flight_changed_ms = NOW;
        st.total = 100;
        st.last_sample_ms = NOW;
        st.success_rate = if x % 11 == 0 { 0.3 } else { 1.0 };
        if (x >> 8) % 6 == 0 {
            st.breaker.state = BreakerState::Open;
            st.breaker.open_until_ms = NOW + 10_000;
        }
        st.slowness.samples = 40;
        st.slowness.expected_ms = 2_000.0;
        st.slowness.log_mean = if (x >> 16) % 5 == 0 { 1.5 } else { 0.0 };
        st.degraded_probe_ms = if (x >> 24) % 2 == 0 { NOW } else { 0 };
    }
    (c, t)
}

const NOW: u64 = 5_000_000;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    /// The lazy walk decides exactly as the sorted one: the same endpoint, reason and quota
    /// skips, for sessions and session-less requests, first attempts and failovers, with and
    /// without a pin left behind.
    #[test]
    fn lazy_walk_equals_sorted_walk(
        seed in any::<u64>(),
        n in 1usize..24,
        equal in any::<bool>(),
        key in any::<u64>(),
        attempt in 1u32..3,
        session in any::<bool>(),
        left in any::<u8>(),
    ) {
        let (c, t) = fleet(seed, n, equal);
        let store = MemStore::new();
        let s = Scheduler::new(&c, &store);
        let ex = Exclusions::default();
        let pick = Pick {
            model: None,
            session: session.then_some(key),
            attempt,
            exclusions: &ex,
            nonce: key,
            body_bytes: 1_000,
            pin_hint: None,
            holder: None,
            prefix: Prefix::NONE,
            follow_up: false,
            max_output_tokens: 0,
        };
        let candidates: Vec<usize> = (0..n).collect();
        let bcfg = s.breaker_config();
        let engines = crate::scheduler::routing::select::capacity::Engines::read(&store, &c, NOW);
        let Ok(board) = s.board(&t, &candidates, &pick, &engines, NOW, &bcfg) else {
            return Ok(());
        };
        // A drawn order (no session, many candidates) is no ranking to compare with the sort
        // (`drawn_tests` hold it to its law).
        if board.drawn {
            return Ok(());
        }
        let keyed = placement::Keyed::new(key, &board.weights);
        let lazy: Vec<usize> = keyed.lazy().collect();
        prop_assert_eq!(&lazy, &keyed.order());
        let l = usize::from(left) % (n + 1);
        let pin = if l < n { PinVerdict::Break(l) } else { PinVerdict::None };
        let (mut q1, mut q2) = (Vec::new(), Vec::new());
        let fast = s.walk(&board, &t, &keyed, &pin, &pick, NOW, &mut q1);
        let slow = s.walk_sorted(&board, &t, &keyed, &pin, &pick, NOW, &mut q2);
        prop_assert_eq!(fast, slow);
        prop_assert_eq!(q1, q2);
    }
}

/// Equal weights tie on key only through zero weights; ties are ranked by id in both orders.
#[test]
fn lazy_order_ranks_ties_as_the_sort() {
    let cands: Vec<(usize, u32, f64)> = (0..9)
        .map(|i| (i, 900 - i as u32 * 7, if i % 3 == 0 { 0.0 } else { 1.0 }))
        .collect();
    for s in 0..500u64 {
        let keyed = placement::Keyed::new(fmix64(s), &cands);
        assert_eq!(keyed.lazy().collect::<Vec<_>>(), keyed.order(), "{s}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    /// A drawn decision settled without a board (`drawn_choice`) takes the endpoint and
    /// reason the board's walk over the same draws takes, on fleets with open breakers,
    /// degraded and loaded endpoints and request exclusions.
    #[test]
    fn a_drawn_choice_without_a_board_equals_the_walk(
        seed in any::<u64>(),
        n in 17usize..48,
        equal in any::<bool>(),
        nonce in any::<u64>(),
        attempt in 1u32..3,
        excluded in proptest::collection::vec(0usize..48, 0..4),
    ) {
        let (c, t) = fleet(seed, n, equal);
        let store = MemStore::new();
        let s = Scheduler::new(&c, &store);
        let ex = Exclusions {
            tried: excluded.into_iter().filter(|&i| i < n).collect(),
            ..Exclusions::default()
        };
        let pick = Pick {
            model: None,
            session: None,
            attempt,
            exclusions: &ex,
            nonce,
            body_bytes: 1_000,
            pin_hint: None,
            holder: None,
            prefix: Prefix::NONE,
            follow_up: false,
            max_output_tokens: 0,
        };
        let Ok((candidates, _)) = s.candidates(&pick) else {
            return Ok(());
        };
        let bcfg = s.breaker_config();
        let engines = crate::scheduler::routing::select::capacity::Engines::read(&store, &c, NOW);
        let Some(quick) = s.drawn_choice(&t, &candidates, &pick, &engines, NOW, &bcfg) else {
            return Ok(());
        };
        let board = s.board(&t, &candidates, &pick, &engines, NOW, &bcfg);
        prop_assert!(board.is_ok());
        let Ok(board) = board else { return Ok(()) };
        prop_assert!(board.drawn);
        let keyed = placement::Keyed::seeded(nonce, &board.weights, board.seeds());
        let mut q = Vec::new();
        let walked = s.walk(&board, &t, &keyed, &PinVerdict::None, &pick, NOW, &mut q);
        prop_assert_eq!(walked, Some((quick.endpoint, quick.reason)));
        q.retain(|&i| i != quick.endpoint);
        prop_assert_eq!(q, quick.quota_skipped);
    }
}
