// The worker's caches (the table cache, its quiet-endpoint memo, the median and model memos)
// change no decision: a scheduler reading through one decides exactly as one that decodes and
// computes everything, over a run of picks and finishes on a moving clock.
use super::*;
use crate::scheduler::health::breaker::BreakerState;
use crate::scheduler::health::outcome::{FailureKind, Outcome};
use crate::scheduler::state::hash::fmix64;
use crate::scheduler::state::store::MemStore;
use proptest::prelude::*;
use serde_json::json;

const START: u64 = 5_000_000;

/// `n` endpoints (some serving a second model, one sometimes disabled), with the knobs that
/// make verdicts and weights depend on the clock set low: few samples to warm, a short open
/// time.
fn config(seed: u64, n: usize) -> Config {
    config_with(seed, n, false)
}

/// [`config`], every endpoint scraped with `metrics`.
#[allow(clippy::unwrap_used)]
fn config_with(seed: u64, n: usize, metrics: bool) -> Config {
    let r = |k: u64| fmix64(seed ^ fmix64(k));
    let eps: Vec<_> = (0..n)
        .map(|i| {
            let models = if r(i as u64) % 3 == 0 {
                json!(["m1", "m2"])
            } else {
                json!(["m1"])
            };
            let ep = json!({
                "name": format!("e{i}"),
                "cluster": format!("c{i}"),
                "models": models,
                "disabled": i == 1 && r(77) % 4 == 0,
            });
            match ep {
                serde_json::Value::Object(mut o) if metrics => {
                    o.insert("metrics".into(), json!({}));
                    serde_json::Value::Object(o)
                }
                ep => ep,
            }
        })
        .collect();
    Config::from_value(&json!({
        "endpoints": eps,
        "cold_start_samples": 1 + r(1) % 3,
        "failure_threshold": 2,
        "open_ms": 3_000,
    }))
    .unwrap()
}

/// A stored table drawn from `seed`: some endpoints warm and slow, some failing, some open,
/// some with attempts in flight.
fn seeded(store: &MemStore, cfg: &Config, seed: u64) {
    let mut t = Table::load(None, cfg).0;
    for (i, (_, st)) in t.entries.iter_mut().enumerate() {
        let x = fmix64(seed ^ fmix64(1_000 + i as u64));
        if x.is_multiple_of(3) {
            st.total = 50;
            st.last_sample_ms = START - (x >> 4) % 5_000;
            st.success_rate = if (x >> 8).is_multiple_of(2) { 0.4 } else { 1.0 };
        }
        if (x >> 12).is_multiple_of(5) {
            st.breaker.state = BreakerState::Open;
            st.breaker.open_until_ms = START + (x >> 16) % 6_000;
        }
        if (x >> 20).is_multiple_of(2) {
            st.slowness.samples = 40;
            st.slowness.expected_ms = 2_000.0;
            st.slowness.log_mean = if (x >> 24).is_multiple_of(3) {
                1.8
            } else {
                0.0
            };
        }
        if (x >> 28).is_multiple_of(4) {
            st.start_attempt(START - 1_000, cfg.in_flight_max_age_ms);
        }
    }
    t.write_to(&store);
}

fn outcome(x: u64) -> Outcome {
    match x % 6 {
        0 => Outcome::EndpointFailure(FailureKind::Status(503)),
        1 => Outcome::RateLimited {
            retry_after_ms: Some(1_500),
        },
        2 => Outcome::DeadKey,
        _ => Outcome::Success,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(120))]
    #[test]
    fn cached_decisions_equal_computed_ones(
        seed in any::<u64>(),
        n in 1usize..10,
        steps in 1usize..60,
    ) {
        same_decisions(seed, n, steps, false, |_| 40)?;
    }

    /// With the engines' loads scraped and changing between picks (some saturated, some
    /// turning stale while the memos hold them, slots learned from queueing engines, decode
    /// paces judging slowness), the memos still change no decision.
    #[test]
    fn cached_decisions_equal_computed_ones_with_scraped_loads(
        seed in any::<u64>(),
        n in 1usize..40,
        steps in 1usize..80,
    ) {
        same_decisions(seed, n, steps, true, |x| match x % 3 {
            0 => 40,
            1 => 2_500,
            _ => 9_000,
        })?;
    }

    /// Larger fleets (where the board memo recomputes only what changed) and answers whose
    /// latencies move endpoints' slowness, so that peers' medians and verdicts change while
    /// most entries do not.
    #[test]
    fn cached_decisions_equal_computed_ones_in_larger_fleets(
        seed in any::<u64>(),
        n in 10usize..40,
        steps in 1usize..80,
    ) {
        same_decisions(seed, n, steps, false, |x| match x % 4 {
            0 => 40,
            1 => 2_500,
            2 => 9_000,
            _ => 30_000,
        })?;
    }
}

/// A run of picks and finishes (latency of a finish drawn by `latency`) through a scheduler
/// without caches and one with them: the same decisions, finishes and final table.
/// With `scraped`, some engines' loads are scraped between picks (the same into both stores).
fn same_decisions(
    seed: u64,
    n: usize,
    steps: usize,
    scraped: bool,
    latency: impl Fn(u64) -> u64,
) -> Result<(), TestCaseError> {
    {
        let cfg = config_with(seed, n, scraped);
        let (plain, cached) = (MemStore::new(), MemStore::new());
        seeded(&plain, &cfg, seed);
        seeded(&cached, &cfg, seed);
        let cache = RefCell::new(TableCache::default());
        let rooms = RefCell::new(crate::scheduler::routing::select::capacity::RoomsMemo::default());
        let a = Scheduler::new(&cfg, &plain);
        let b = Scheduler::with_caches(&cfg, &cached, &cache, &rooms);
        let mut now = START;
        let mut pending: Vec<(Ticket, Ticket, u64, Option<u64>)> = Vec::new();
        let mut decoded = vec![(0u64, 0u64); n];
        for step in 0..steps {
            let x = fmix64(seed ^ fmix64(50_000 + step as u64));
            now += match x % 5 {
                0 => 0,
                1 => 7,
                2 => 900,
                3 => 2_500,
                _ => 40_000,
            };
            if scraped {
                scrape_some(&cfg, [&plain, &cached], &mut decoded, x, now);
                // Another worker (its loads newer than this one's) learned an engine's slots:
                // the capacities change under the same loads.
                if (x >> 50).is_multiple_of(3) {
                    another_worker_learns_slots(&cfg, [&plain, &cached], x, now);
                }
            }
            let session = match (x >> 4) % 5 {
                0 => None,
                s => Some(s),
            };
            let model = if (x >> 8).is_multiple_of(4) {
                Some("m2")
            } else {
                Some("m1")
            };
            let mut ex = Exclusions::default();
            for attempt in 1..=2u32 {
                let pick = Pick {
                    model,
                    session,
                    attempt,
                    exclusions: &ex,
                    nonce: x,
                    body_bytes: 1_000,
                    pin_hint: None,
                    holder: None,
                    prefix: Prefix::NONE,
                    follow_up: (x >> 12).is_multiple_of(7),
                    max_output_tokens: 0,
                };
                let (da, db) = (a.pick(&pick, now), b.pick(&pick, now));
                prop_assert_eq!(&da, &db, "step {} attempt {}", step, attempt);
                let (Ok(da), Ok(db)) = (da, db) else { break };
                let o = outcome(x >> (16 + attempt));
                if (x >> 24).is_multiple_of(3) {
                    pending.push((da.ticket, db.ticket, now, session));
                    break;
                }
                let lat = latency(x >> 44);
                let (fa, fb) = (
                    a.finish(da.ticket, &o, lat, session, now),
                    b.finish(db.ticket, &o, lat, session, now),
                );
                prop_assert_eq!(fa, fb);
                if !o.fails_over() {
                    break;
                }
                ex.after_attempt(da.endpoint, &o);
            }
            if (x >> 30).is_multiple_of(2) && !pending.is_empty() {
                let (ta, tb, started, s) = pending.remove(0);
                let o = outcome(x >> 40);
                let lat = now.saturating_sub(started);
                let (fa, fb) = (a.finish(ta, &o, lat, s, now), b.finish(tb, &o, lat, s, now));
                prop_assert_eq!(fa, fb);
            }
        }
        prop_assert_eq!(a.table(), b.table());
        for (ta, tb, _, s) in pending {
            let o = Outcome::Success;
            prop_assert_eq!(a.finish(ta, &o, 10, s, now), b.finish(tb, &o, 10, s, now));
        }
    }
    Ok(())
}

/// Scrapes some engines at `now` (drawn from `x`; none of them when `x` says so), the same
/// load into each store: queues from empty to saturated, KV usage sometimes unreported, a
/// running count sometimes missing, decode totals that grow (a pace) for most, and scrape
/// times up to a little more than the staleness age before `now`.
fn scrape_some(cfg: &Config, stores: [&MemStore; 2], decoded: &mut [(u64, u64)], x: u64, now: u64) {
    use crate::scheduler::wire::engine_load::{DecodeTotals, Engine, EngineLoad};
    if x.is_multiple_of(7) {
        return;
    }
    let ids = crate::scheduler::routing::table::slot_ids(cfg);
    for (i, ep) in cfg.endpoints.iter().enumerate() {
        let r = fmix64(x ^ fmix64(9_000 + i as u64));
        // About one endpoint in three per round (all of them in one round of eight).
        if !(r.is_multiple_of(3) || (x >> 3).is_multiple_of(8)) {
            continue;
        }
        let Some(d) = decoded.get_mut(i) else {
            continue;
        };
        if (r >> 4).is_multiple_of(4) {
            *d = (d.0 + 1_000 + (r >> 8) % 40_000, d.1 + 1 + (r >> 20) % 50);
        }
        let load = EngineLoad {
            engine: Engine::Vllm,
            waiting: (!(r >> 28).is_multiple_of(9)).then_some(((r >> 32) % 9) as u32),
            running: (!(r >> 36).is_multiple_of(7)).then_some(((r >> 40) % 17) as u32),
            kv_usage_permille: (!(r >> 44).is_multiple_of(3)).then_some(((r >> 48) % 1_000) as u16),
            prompt_tokens_total: None,
            prompt_tokens_cached_total: None,
            decode: (!(r >> 56).is_multiple_of(5)).then_some(DecodeTotals {
                seconds_us: d.0,
                count: d.1,
            }),
        };
        let at = now.saturating_sub(match (r >> 58) % 4 {
            0 => 0,
            1 => 300,
            2 => 4_900,
            _ => 5_200,
        });
        for store in stores {
            let _ = crate::scheduler::routing::scrape::fold(store, ep.id, at, Ok(load), &ids);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(120))]
    /// Between two scrapes (the loads the same), other workers learn engines' slots: the
    /// memos that keep what was derived from the slots (the rooms, the board's weights by
    /// slots, which positions moved) follow, and change no decision.
    #[test]
    fn cached_decisions_equal_computed_ones_when_slots_change_between_scrapes(
        seed in any::<u64>(),
        n in 2usize..30,
        steps in 1usize..40,
    ) {
        let cfg = config_with(seed, n, true);
        let (plain, cached) = (MemStore::new(), MemStore::new());
        seeded(&plain, &cfg, seed);
        seeded(&cached, &cfg, seed);
        let mut decoded = vec![(0u64, 0u64); n];
        // `x` = 1: every endpoint scraped at once.
        scrape_some(&cfg, [&plain, &cached], &mut decoded, 1, START);
        let cache = RefCell::new(TableCache::default());
        let rooms = RefCell::new(crate::scheduler::routing::select::capacity::RoomsMemo::default());
        let a = Scheduler::new(&cfg, &plain);
        let b = Scheduler::with_caches(&cfg, &cached, &cache, &rooms);
        let ex = Exclusions::default();
        let mut now = START;
        for step in 0..steps {
            let x = fmix64(seed ^ fmix64(70_000 + step as u64));
            now += 7;
            if x.is_multiple_of(2) {
                another_worker_learns_slots(&cfg, [&plain, &cached], x, now);
            }
            let pick = Pick {
                model: Some("m1"),
                // New sessions and later turns (their homes kept by the board memo).
                session: Some(1_000 + (x >> 8) % 6),
                attempt: 1,
                exclusions: &ex,
                nonce: x,
                body_bytes: 1_000,
                pin_hint: None,
                holder: None,
                prefix: Prefix::NONE,
                follow_up: false,
                max_output_tokens: 0,
            };
            let (da, db) = (a.pick(&pick, now), b.pick(&pick, now));
            prop_assert_eq!(&da, &db, "step {}", step);
            if let (Ok(da), Ok(db)) = (da, db) {
                let o = Outcome::Success;
                prop_assert_eq!(
                    a.finish(da.ticket, &o, 40, pick.session, now),
                    b.finish(db.ticket, &o, 40, pick.session, now)
                );
            }
        }
    }
}

/// Records in both stores the slots an engine drawn from `x` showed another worker: a
/// queue over a running count of 1 to 24 (slots only ever grow).
fn another_worker_learns_slots(cfg: &Config, stores: [&MemStore; 2], x: u64, now: u64) {
    let Some(ep) = cfg.endpoints.get((x >> 52) as usize % cfg.endpoints.len()) else {
        return;
    };
    let keep: Vec<u32> = cfg.endpoints.iter().map(|e| e.id).collect();
    let load = crate::scheduler::routing::judge::saturation::EngineLoad {
        waiting: Some(1),
        running: Some(1 + ((x >> 56) % 24) as u32),
        kv_usage_permille: None,
        scraped_ms: now,
        decode_us_per_token: None,
        decoded_at_ms: None,
    };
    for store in stores {
        crate::scheduler::routing::select::capacity::record(store, &[(ep.id, load)], None, &keep);
    }
}

/// Four session picks and finishes, for `model(k)` on turn `k`.
fn four_picks(cfg: &Config, cache: &RefCell<TableCache>, model: impl Fn(u64) -> &'static str) {
    let store = MemStore::new();
    let s = Scheduler::with_cache(cfg, &store, cache);
    let ex = Exclusions::default();
    for k in 0..4u64 {
        let pick = Pick {
            model: Some(model(k)),
            session: Some(100 + k),
            attempt: 1,
            exclusions: &ex,
            nonce: k,
            body_bytes: 1_000,
            pin_hint: None,
            holder: None,
            prefix: Prefix::NONE,
            follow_up: false,
            max_output_tokens: 0,
        };
        let d = s.pick(&pick, START + k);
        if let Ok(d) = d {
            let _ = s.finish(d.ticket, &Outcome::Success, 10, pick.session, START + k);
        }
    }
}

#[test]
fn quiet_memo_is_used_between_picks() {
    // The models alternate: the board memo (one model's board) is computed whole every time,
    // from the quiet memo.
    let cfg = config(3, 16);
    let cache = RefCell::new(TableCache::default());
    four_picks(&cfg, &cache, |k| if k % 2 == 0 { "m1" } else { "m2" });
    let hits = cache.borrow().quiet.hits;
    eprintln!("hits {hits} computed {}", cache.borrow().peers.computed);
    assert!(hits > 8, "{hits}");
    assert_eq!(cache.borrow().board.hits, 0);
}

#[test]
fn board_memo_is_used_between_picks_of_one_model() {
    let cfg = config(3, 16);
    let cache = RefCell::new(TableCache::default());
    four_picks(&cfg, &cache, |_| "m1");
    let hits = cache.borrow().board.hits;
    // The first pick finds no table (nothing lent), the second computes the board whole; the
    // later ones reuse it.
    assert_eq!(hits, 2);
}

/// The exclusions as `candidates` applied them before it took them out of one pass: a look-up
/// in every list per endpoint.
fn candidates_one_by_one(
    cfg: &Config,
    model: Option<&str>,
    ex: &Exclusions,
) -> Result<(Vec<usize>, Dropped), NoEndpoint> {
    let mut dropped = Dropped::default();
    let mut out = Vec::new();
    let mut serves_model = false;
    for (i, ep) in cfg.endpoints.iter().enumerate() {
        let serves = serves_opt(ep, model);
        if ep.disabled {
            dropped.disabled += 1;
        } else if ex.dead.contains(&i) {
            dropped.dead += 1;
            serves_model |= serves;
        } else if ex.used.contains(&i) {
            dropped.used += 1;
            serves_model |= serves;
        } else if ex.tried.contains(&i) {
            dropped.tried += 1;
            serves_model |= serves;
        } else if !serves {
            dropped.model += 1;
        } else {
            serves_model = true;
            out.push(i);
        }
    }
    if out.is_empty() {
        return Err(if serves_model {
            NoEndpoint::Exhausted
        } else {
            NoEndpoint::ModelNotFound
        });
    }
    Ok((out, dropped))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    #[test]
    fn candidates_equal_the_one_by_one_exclusions(
        seed in any::<u64>(),
        n in 1usize..10,
        dead in proptest::collection::vec(0usize..12, 0..3),
        used in proptest::collection::vec(0usize..12, 0..3),
        tried in proptest::collection::vec(0usize..12, 0..4),
        m2 in any::<bool>(),
    ) {
        let cfg = config(seed, n);
        let store = MemStore::new();
        let cache = RefCell::new(TableCache::default());
        let ex = Exclusions { dead, used, tried, retry_free: false, placeless: vec![] };
        let model = Some(if m2 { "m2" } else { "m1" });
        let pick = Pick {
            model,
            session: None,
            attempt: 2,
            exclusions: &ex,
            nonce: 0,
            body_bytes: 0,
            pin_hint: None,
            holder: None,
            prefix: Prefix::NONE,
            follow_up: false,
            max_output_tokens: 0,
        };
        let expected = candidates_one_by_one(&cfg, model, &ex);
        prop_assert_eq!(Scheduler::new(&cfg, &store).candidates(&pick), expected.clone());
        let s = Scheduler::with_cache(&cfg, &store, &cache);
        prop_assert_eq!(s.candidates(&pick), expected);
    }
}

/// A quiet endpoint whose entry does not change but whose peers' median does (one peer's
/// slowness moved) is judged again by the board memo: the decisions of new sessions, whose
/// homes are the first non-degraded endpoints of their orders, stay those computed without
/// caches.
#[test]
fn board_memo_judges_again_what_a_moved_median_changes() {
    let eps: Vec<_> = (0..12)
        .map(|i| json!({"name": format!("e{i}"), "cluster": format!("c{i}")}))
        .collect();
    let cfg = Config::from_value(&json!({"endpoints": eps, "cold_start_samples": 1})).unwrap();
    // e0 4.5× slower than expected; five peers at 1×, six at 4×: e0's peers' median is 4×
    // (not degraded); one 4× peer back at 1× moves it to 1× (degraded), and the 4× peers'
    // medians with it.
    let log_mean = |i: usize| match i {
        0 => 1.5,
        1..=5 => 0.0,
        _ => 1.4,
    };
    let (plain, cached, before) = (MemStore::new(), MemStore::new(), MemStore::new());
    let mut t = Table::load(None, &cfg).0;
    for (i, (_, st)) in t.entries.iter_mut().enumerate() {
        st.slowness.samples = 40;
        st.slowness.expected_ms = 2_000.0;
        st.slowness.log_mean = log_mean(i);
        st.slowness.last_sample_ms = START;
    }
    for store in [&plain, &cached, &before] {
        t.write_to(&store);
    }
    let cache = RefCell::new(TableCache::default());
    let a = Scheduler::new(&cfg, &plain);
    let b = Scheduler::with_cache(&cfg, &cached, &cache);
    let ex = Exclusions::default();
    let pick = |session: u64| Pick {
        model: Some("m1"),
        session: Some(session),
        attempt: 1,
        exclusions: &ex,
        nonce: session,
        body_bytes: 1_000,
        pin_hint: None,
        holder: None,
        prefix: Prefix::NONE,
        follow_up: false,
        max_output_tokens: 0,
    };
    let mut now = START;
    for s in 0..3 {
        now += 10;
        assert_eq!(a.pick(&pick(s), now), b.pick(&pick(s), now));
    }
    // Peer e11 back to 1×: only its entry is written (the others keep their stamps).
    for store in [&plain, &cached] {
        let id = cfg.endpoints[11].id;
        let w = crate::scheduler::routing::table::groups::update_entry(
            store,
            Some(11),
            id,
            |st| {
                st.slowness.log_mean = 0.0;
                true
            },
            |_| {},
        );
        assert_eq!(w, Some(Ok(true)));
    }
    let hits = cache.borrow().board.hits;
    // Where the same sessions would go without the change (e0 and the 4× peers admitted).
    let c = Scheduler::new(&cfg, &before);
    let slow = |i: usize| i == 0 || (6..=10).contains(&i);
    let mut went_slow_before = 0;
    for s in 3..40 {
        now += 10;
        let (da, db) = (a.pick(&pick(s), now), b.pick(&pick(s), now));
        assert_eq!(da, db, "session {s}");
        assert!(
            da.as_ref().is_ok_and(|d| !slow(d.endpoint)),
            "session {s}: {da:?}"
        );
        went_slow_before += usize::from(c.pick(&pick(s), now).is_ok_and(|d| slow(d.endpoint)));
    }
    assert!(
        cache.borrow().board.hits > hits + 30,
        "the board memo was used"
    );
    assert!(went_slow_before > 0, "the change moved some session");
}

/// With every engine scraped, the board memo serves the session decisions of one model after
/// the first whole one, loads and all (it used to compute every scraped fleet's board whole).
#[test]
fn board_memo_is_used_between_picks_with_scraped_loads() {
    let cfg = config_with(3, 16, true);
    let cache = RefCell::new(TableCache::default());
    let rooms = RefCell::new(crate::scheduler::routing::select::capacity::RoomsMemo::default());
    let store = MemStore::new();
    let mut decoded = vec![(0u64, 0u64); 16];
    // `x` = 1: every endpoint scraped at once.
    scrape_some(&cfg, [&store, &store], &mut decoded, 1, START);
    let s = Scheduler::with_caches(&cfg, &store, &cache, &rooms);
    let ex = Exclusions::default();
    for k in 0..4u64 {
        let pick = Pick {
            model: Some("m1"),
            session: Some(100 + k),
            attempt: 1,
            exclusions: &ex,
            nonce: k,
            body_bytes: 1_000,
            pin_hint: None,
            holder: None,
            prefix: Prefix::NONE,
            follow_up: false,
            max_output_tokens: 0,
        };
        if let Ok(d) = s.pick(&pick, START + k) {
            let _ = s.finish(d.ticket, &Outcome::Success, 10, pick.session, START + k);
        }
    }
    let c = cache.borrow();
    assert!(c.board.verdicts.iter().any(|v| v.load.is_some()));
    assert_eq!(c.board.hits, 2);
}
