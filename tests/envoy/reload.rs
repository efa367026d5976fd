//! Configuration reloads and module upgrades keep the endpoint table (issue 22, item 7),
//! pure core: two configurations write one in-memory store in turn, as requests of the old
//! configuration drain while the new one serves (an ECDS update: the requests in flight; an
//! LDS update: every request of the old connections for up to Envoy's drain time).
//!
//! Before: every write of the old configuration realigned the shared table to the old layout,
//! dropping the entries of endpoints only the new configuration has (their breaker, in-flight
//! count, statistics); the new configuration's next write started them afresh. The real-Envoy
//! counterpart is `tests/envoy/reload_envoy.rs`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use computeflux::scheduler::health::breaker::BreakerState;
use computeflux::scheduler::health::outcome::FailureKind;
use computeflux::scheduler::routing::select::TABLE_KEY;
use computeflux::scheduler::routing::table::{claim_layout, Table};
use computeflux::scheduler::{
    Config, Decision, Exclusions, MemStore, Outcome, Pick, Prefix, Scheduler, Store,
};
use serde_json::json;

fn cfg(v: serde_json::Value) -> Config {
    Config::from_value(&v).unwrap()
}

/// `a` and `b` serve `m1`; the new configuration reorders them and adds `d`, alone on `m2`.
fn old_and_new() -> (Config, Config) {
    let knobs = json!({"failure_threshold": 2, "open_ms": 60_000});
    let mut old = json!({"endpoints": [
        {"name": "a", "cluster": "ca", "models": ["m1"]},
        {"name": "b", "cluster": "cb", "models": ["m1"]},
    ]});
    let mut new = json!({"endpoints": [
        {"name": "b", "cluster": "cb", "models": ["m1"]},
        {"name": "a", "cluster": "ca", "models": ["m1"]},
        {"name": "d", "cluster": "cd", "models": ["m2"]},
    ]});
    for v in [&mut old, &mut new] {
        v.as_object_mut()
            .unwrap()
            .extend(knobs.as_object().unwrap().clone());
    }
    (cfg(old), cfg(new))
}

fn pick(s: &Scheduler<'_>, model: &str, nonce: u64, now_ms: u64) -> Decision {
    s.pick(
        &Pick {
            model: Some(model),
            session: None,
            attempt: 1,
            exclusions: &Exclusions::default(),
            nonce,
            body_bytes: 0,
            pin_hint: None,
            holder: None,
            prefix: Prefix::NONE,
            follow_up: false,
            max_output_tokens: 0,
        },
        now_ms,
    )
    .unwrap()
}

fn state<'t>(
    table: &'t Table,
    cfg: &Config,
    name: &str,
) -> &'t computeflux::scheduler::EndpointState {
    let i = cfg.endpoints.iter().position(|e| e.name == name).unwrap();
    &table.entries[i].1
}

/// Old and new configuration alternate writes for a while: the new one's endpoint `d` keeps
/// its open breaker, the old one's finishes still count (patched into the new layout by
/// endpoint), and the layout is the new one's after every write.
#[test]
fn old_configuration_draining_never_resets_the_new_layout() {
    let (mut old, mut new) = old_and_new();
    let store = MemStore::new();
    old.layout_generation = claim_layout(&store, &old);
    // Requests of the old configuration in flight when the new one arrives.
    let so = Scheduler::new(&old, &store);
    let in_flight: Vec<Decision> = (0..6).map(|n| pick(&so, "m1", n, 1_000)).collect();
    new.layout_generation = claim_layout(&store, &new);
    println!(
        "generations: old {}, new {}",
        old.layout_generation, new.layout_generation
    );
    let sn = Scheduler::new(&new, &store);
    // d fails twice: its breaker opens for a minute.
    let fail = Outcome::EndpointFailure(FailureKind::ConnectFailure);
    for n in 0..2 {
        let d = pick(&sn, "m2", 100 + n, 2_000);
        sn.finish(d.ticket, &fail, 5, None, 2_000);
    }
    assert_eq!(
        state(&sn.table(), &new, "d").breaker.state_at(2_000),
        BreakerState::Open
    );
    let a_total = state(&sn.table(), &new, "a").total + state(&sn.table(), &new, "b").total;
    // The old requests drain, one finish at a time, with new requests in between.
    let mut resets = 0;
    let mut layout_lost = 0;
    for (k, d) in in_flight.into_iter().enumerate() {
        let now = 3_000 + 100 * k as u64;
        so.finish(d.ticket, &Outcome::Success, 40, None, now);
        // An old request that starts (an LDS drain keeps old connections busy) and ends.
        let o = pick(&so, "m1", 200 + k as u64, now);
        so.finish(o.ticket, &Outcome::Success, 40, None, now + 1);
        layout_lost += usize::from(!Table::has_layout(&store, &new));
        let d_state = *state(&sn.table(), &new, "d");
        if d_state.breaker.state_at(now + 2) != BreakerState::Open {
            resets += 1;
        }
        // A new request for m2 in between.
        let _ = sn.pick(
            &Pick {
                model: Some("m2"),
                session: None,
                attempt: 1,
                exclusions: &Exclusions::default(),
                nonce: 300 + k as u64,
                body_bytes: 0,
                pin_hint: None,
                holder: None,
                prefix: Prefix::NONE,
                follow_up: false,
                max_output_tokens: 0,
            },
            now + 2,
        );
    }
    let t = sn.table();
    let finished = state(&t, &new, "a").total + state(&t, &new, "b").total - a_total;
    println!("d's breaker reset {resets} time(s); layout lost {layout_lost} time(s); old finishes counted {finished}/12");
    assert_eq!(resets, 0, "d's open breaker was reset by old writes");
    assert_eq!(
        layout_lost, 0,
        "an old write realigned the table to its layout"
    );
    assert_eq!(finished, 12, "the old configuration's finishes were lost");
    assert_eq!(
        state(&t, &new, "d").breaker.state_at(4_000),
        BreakerState::Open
    );
}

/// Both sides agree which configuration is newer: claims are ordered by the table, every
/// worker of one configuration gets the same generation, and a configuration that comes back
/// (A → B → A) is newer again.
#[test]
fn claims_order_configurations_and_agree_within_one() {
    let (old, new) = old_and_new();
    let store = MemStore::new();
    let g_old = claim_layout(&store, &old);
    assert_eq!(
        claim_layout(&store, &old),
        g_old,
        "a second worker, same config"
    );
    let g_new = claim_layout(&store, &new);
    assert!(g_new > g_old);
    assert_eq!(claim_layout(&store, &new), g_new);
    assert!(Table::has_layout(&store, &new));
    let g_back = claim_layout(&store, &old);
    assert!(g_back > g_new);
    assert!(Table::has_layout(&store, &old));
}

/// A module of another table version never reads or writes this one's bytes: each version has
/// its own key, so an old module draining beside a new one (or a module that predates this rule)
/// keeps its own table and the new one keeps its own; neither resets the other.
#[test]
fn another_table_version_is_left_alone() {
    let (mut cfg, _) = old_and_new();
    let store = MemStore::new();
    // What a module of another version keeps (here: its bytes under the old unversioned key).
    let legacy = b"\x07some other version's table".to_vec();
    store.set("computeflux/endpoints", &legacy, None).unwrap();
    cfg.layout_generation = claim_layout(&store, &cfg);
    let s = Scheduler::new(&cfg, &store);
    for n in 0..4 {
        let d = pick(&s, "m1", n, 1_000);
        s.finish(d.ticket, &Outcome::Success, 10, None, 1_001);
    }
    assert_eq!(store.get("computeflux/endpoints").0, Some(legacy));
    assert_ne!(TABLE_KEY, "computeflux/endpoints");
    let t = s.table();
    assert_eq!(t.entries.iter().map(|(_, st)| st.total).sum::<u64>(), 4);
}
