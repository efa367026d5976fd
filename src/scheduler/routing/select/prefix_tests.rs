// Placement by prefix (`prefix_placement`): a session without a pin whose instructions make a
// prefix key goes to the prefix's rendezvous home, on every replica; pins still win.
use super::*;
use crate::scheduler::routing::placement;
use crate::scheduler::state::hash::session_key;
use crate::scheduler::state::store::MemStore;
use serde_json::json;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

fn cfg(extra: serde_json::Value) -> Config {
    let mut v = json!({"endpoints":[
        {"name":"e0","cluster":"c0"},{"name":"e1","cluster":"c1"},{"name":"e2","cluster":"c2"},
        {"name":"e3","cluster":"c3","weight":2},{"name":"e4","cluster":"c4"}
    ]});
    if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
        o.extend(e.clone());
    }
    Config::from_value(&v).unwrap()
}

fn session(i: u64) -> u64 {
    session_key(b"", &i.to_le_bytes())
}

const PREFIX: u64 = 0x5eed_0fa9;

fn pick(
    s: &Scheduler<'_>,
    session: u64,
    prefix: Option<u64>,
    attempt: u32,
    ex: &Exclusions,
    now: u64,
) -> Decision {
    s.pick(
        &Pick {
            model: Some("m"),
            session: Some(session),
            attempt,
            exclusions: ex,
            nonce: 0,
            body_bytes: 0,
            pin_hint: None,
            holder: None,
            prefix: prefix.map(PrefixChain::single),
            follow_up: false,
        },
        now,
    )
    .unwrap()
}

fn weights(c: &Config) -> Vec<(usize, u32, f64)> {
    c.endpoints
        .iter()
        .enumerate()
        .map(|(i, e)| (i, e.id, e.weight))
        .collect()
}

#[test]
fn new_sessions_of_one_prefix_share_its_home_on_every_replica() {
    let c = cfg(json!({}));
    let stores = [MemStore::new(), MemStore::new(), MemStore::new()];
    let ex = Exclusions::default();
    let home = placement::order(PREFIX, &weights(&c))[0];
    let mut by_session = [0u32; 5];
    for n in 0..300u64 {
        for store in &stores {
            let s = Scheduler::new(&c, store);
            let d = pick(&s, session(n), Some(PREFIX), 1, &ex, 0);
            assert_eq!(
                (d.endpoint, d.reason, d.affinity, d.by_prefix),
                (home, Reason::Home, AffinityResult::Prefix, true),
                "session {n}"
            );
            s.finish(d.ticket, &Outcome::Cancelled, 0, None, 0);
            // Without the prefix: the session's own home, as before.
            let d = pick(&s, session(n), None, 1, &ex, 0);
            assert_eq!((d.affinity, d.by_prefix), (AffinityResult::Home, false));
            by_session[d.endpoint] += 1;
            s.finish(d.ticket, &Outcome::Cancelled, 0, None, 0);
        }
    }
    // By session key they scatter over every endpoint.
    assert!(by_session.iter().all(|&h| h > 0), "{by_session:?}");
}

#[test]
fn a_pinned_session_stays_and_a_served_one_is_pinned() {
    let c = cfg(json!({}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    let home = placement::order(PREFIX, &weights(&c))[0];
    // A session whose own home is elsewhere, served there before its prefix was known.
    let n = (0..)
        .find(|&n| placement::order(session(n), &weights(&c))[0] != home)
        .unwrap();
    let d = pick(&s, session(n), None, 1, &ex, 0);
    let elsewhere = d.endpoint;
    s.finish(d.ticket, &Outcome::Success, 10, Some(session(n)), 1);
    let d = pick(&s, session(n), Some(PREFIX), 1, &ex, 2);
    assert_eq!(
        (d.endpoint, d.affinity, d.by_prefix),
        (elsewhere, AffinityResult::Hit, false)
    );
    s.finish(d.ticket, &Outcome::Success, 10, Some(session(n)), 3);
    // A new session placed by prefix is pinned where it was served.
    let d = pick(&s, session(n + 1), Some(PREFIX), 1, &ex, 4);
    assert!(d.ticket.pin_on_success);
    s.finish(d.ticket, &Outcome::Success, 10, Some(session(n + 1)), 5);
    let d = pick(&s, session(n + 1), None, 1, &ex, 6);
    assert_eq!((d.endpoint, d.affinity), (home, AffinityResult::Hit));
    s.finish(d.ticket, &Outcome::Cancelled, 0, None, 7);
}

#[test]
fn switched_off_every_session_is_placed_by_its_own_key() {
    let c = cfg(json!({"prefix_placement": false}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    for n in 0..100u64 {
        let d = pick(&s, session(n), Some(PREFIX), 1, &ex, 0);
        let own = placement::order(session(n), &weights(&c))[0];
        assert_eq!(
            (d.endpoint, d.affinity, d.by_prefix),
            (own, AffinityResult::Home, false)
        );
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, 0);
    }
}

#[test]
fn a_popular_prefix_spills_in_its_rendezvous_order_and_pins_there() {
    let c = cfg(json!({"bounded_load_epsilon": 0.25, "bounded_load_slack": 2}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    let order = placement::order(PREFIX, &weights(&c));
    let mut held = Vec::new();
    let mut first_spill = None;
    for n in 0..40u64 {
        let d = pick(&s, session(n), Some(PREFIX), 1, &ex, 0);
        if d.endpoint != order[0] {
            assert_eq!(
                (d.reason, d.affinity),
                (Reason::Spill, AffinityResult::Prefix)
            );
            assert!(d.ticket.pin_on_success, "a prefix spill pins");
            first_spill.get_or_insert(d.endpoint);
        }
        held.push(d);
    }
    // The first spill goes to the prefix's second endpoint, as on every replica.
    assert_eq!(first_spill, Some(order[1]));
    // It spreads over a leading part of that order, never skipping an endpoint of it.
    let on = |i: usize| held.iter().filter(|d| d.endpoint == i).count();
    let used = order.iter().take_while(|&&i| on(i) > 0).count();
    assert!(used >= 2);
    assert_eq!(
        order[..used].iter().map(|&i| on(i)).sum::<usize>(),
        held.len()
    );
    for d in held {
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, 1);
    }
    let d = pick(&s, session(999), Some(PREFIX), 1, &ex, 2);
    assert_eq!((d.endpoint, d.affinity), (order[0], AffinityResult::Prefix));
    s.finish(d.ticket, &Outcome::Cancelled, 0, None, 2);
}

#[test]
fn a_failover_walks_the_prefix_order() {
    let c = cfg(json!({}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let order = placement::order(PREFIX, &weights(&c));
    let mut ex = Exclusions::default();
    let mut walked = Vec::new();
    for attempt in 1..=3u32 {
        let d = pick(&s, session(7), Some(PREFIX), attempt, &ex, 0);
        assert!(d.by_prefix);
        walked.push(d.endpoint);
        let failed = Outcome::RateLimited {
            retry_after_ms: None,
        };
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, 0);
        ex.after_attempt(d.endpoint, &failed);
    }
    assert_eq!(walked, order[..3].to_vec());
}

// The prefix chain (issue 20, item 3): placement on the shallowest key (`prefix_home: head`),
// and the learned index (`prefix_index`).
const HEAD: u64 = 0x4ead_0001;
const APP_A: u64 = 0xa_0001;
const APP_B: u64 = 0xb_0001;

fn pick_chain(
    s: &Scheduler<'_>,
    session: u64,
    keys: &[u64],
    attempt: u32,
    ex: &Exclusions,
    now: u64,
) -> Decision {
    s.pick(
        &Pick {
            model: Some("m"),
            session: Some(session),
            attempt,
            exclusions: ex,
            nonce: 0,
            body_bytes: 0,
            pin_hint: None,
            holder: None,
            prefix: PrefixChain::from_keys(keys),
            follow_up: false,
        },
        now,
    )
    .unwrap()
}

#[test]
fn head_placement_gives_applications_that_share_a_head_one_home() {
    let c = cfg(json!({"prefix_home": "head"}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    let head_home = placement::order(HEAD, &weights(&c))[0];
    for n in 0..50u64 {
        let app = if n % 2 == 0 { APP_A } else { APP_B };
        let d = pick_chain(&s, session(n), &[HEAD, app], 1, &ex, 0);
        assert_eq!(
            (d.endpoint, d.affinity),
            (head_home, AffinityResult::Prefix)
        );
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, 0);
    }
    // The default places each application on its own (longest) key.
    let c = cfg(json!({}));
    let s = Scheduler::new(&c, &store);
    let d = pick_chain(&s, session(1), &[HEAD, APP_B], 1, &ex, 0);
    assert_eq!(d.endpoint, placement::order(APP_B, &weights(&c))[0]);
    s.finish(d.ticket, &Outcome::Cancelled, 0, None, 0);
}

#[test]
fn the_index_sends_a_new_application_where_its_shared_head_was_served() {
    let c = cfg(json!({"prefix_index": true}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    let b_home = placement::order(APP_B, &weights(&c))[0];
    // Application A was served on an endpoint that is not B's rendezvous home.
    let x = (0..5).find(|&i| i != b_home).unwrap();
    let x_id = c.endpoints[x].id;
    s.learn_prefix(PrefixChain::from_keys(&[HEAD, APP_A]).as_ref(), x_id, 10);
    let d = pick_chain(&s, session(1), &[HEAD, APP_B], 1, &ex, 20);
    assert_eq!(
        (d.endpoint, d.reason, d.affinity, d.by_prefix, d.by_index),
        (x, Reason::Home, AffinityResult::Prefix, true, true)
    );
    assert!(d.ticket.pin_on_success);
    s.finish(d.ticket, &Outcome::Cancelled, 0, None, 21);
    // B's own key, once learned elsewhere, is deeper: it wins over the head.
    let y = (0..5).find(|&i| i != x).unwrap();
    s.learn_prefix(
        PrefixChain::from_keys(&[HEAD, APP_B]).as_ref(),
        c.endpoints[y].id,
        30,
    );
    s.learn_prefix(PrefixChain::from_keys(&[HEAD]).as_ref(), x_id, 31);
    let d = pick_chain(&s, session(2), &[HEAD, APP_B], 1, &ex, 40);
    assert_eq!((d.endpoint, d.by_index), (y, true));
    s.finish(d.ticket, &Outcome::Cancelled, 0, None, 41);
    // A failover's excluded endpoint is not taken from the index: the walk goes on.
    let mut ex2 = Exclusions::default();
    ex2.after_attempt(
        y,
        &Outcome::RateLimited {
            retry_after_ms: None,
        },
    );
    let d = pick_chain(&s, session(3), &[HEAD, APP_B], 2, &ex2, 50);
    assert_ne!(d.endpoint, y);
    s.finish(d.ticket, &Outcome::Cancelled, 0, None, 51);
    // Switched off (the default), the index is neither read nor written.
    let off = cfg(json!({}));
    let s = Scheduler::new(&off, &store);
    let d = pick_chain(&s, session(4), &[HEAD, APP_B], 1, &ex, 60);
    assert_eq!((d.endpoint, d.by_index), (b_home, false));
    s.finish(d.ticket, &Outcome::Cancelled, 0, None, 61);
    let fresh = MemStore::new();
    Scheduler::new(&off, &fresh).learn_prefix(PrefixChain::from_keys(&[HEAD]).as_ref(), 1, 0);
    assert_eq!(fresh.keys(), 0);
}

#[test]
fn the_index_gives_way_to_bounded_load() {
    let c =
        cfg(json!({"prefix_index": true, "bounded_load_epsilon": 0.25, "bounded_load_slack": 2}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    let b_order = placement::order(APP_B, &weights(&c));
    let x = b_order[4];
    s.learn_prefix(
        PrefixChain::from_keys(&[HEAD, APP_B]).as_ref(),
        c.endpoints[x].id,
        0,
    );
    let mut held = Vec::new();
    for n in 0..30u64 {
        held.push(pick_chain(&s, session(n), &[HEAD, APP_B], 1, &ex, 1));
    }
    let on_x = held.iter().filter(|d| d.endpoint == x).count();
    let by_index = held.iter().filter(|d| d.by_index).count();
    assert_eq!(on_x, by_index, "only the index sends sessions to x");
    assert!(
        (2..30).contains(&on_x),
        "x takes some, then its bound stops it: {on_x}"
    );
    // Past x's bound the walk is the rendezvous one: B's home first.
    assert!(held.iter().any(|d| d.endpoint == b_order[0] && !d.by_index));
    for d in held {
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, 2);
    }
}
