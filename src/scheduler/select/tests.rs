use super::*;
use crate::scheduler::outcome::FailureKind;
use crate::scheduler::store::MemStore;
use serde_json::json;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

fn cfg(v: serde_json::Value) -> Config {
    Config::from_value(&v).unwrap()
}

fn four() -> Config {
    cfg(json!({"endpoints":[
        {"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"},
        {"name":"c","cluster":"cc","models":["other"]},{"name":"d","cluster":"cd","disabled":true}
    ]}))
}

fn pick_at(
    s: &Scheduler<'_>,
    session: Option<u64>,
    ex: &Exclusions,
    now: u64,
) -> Result<Decision, NoEndpoint> {
    s.pick(
        &Pick {
            model: Some("m"),
            session,
            attempt: 1,
            exclusions: ex,
        },
        now,
    )
}

#[test]
fn exclusions_in_order_and_model_not_found() {
    let c = four();
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions {
        dead: vec![0],
        used: vec![0, 1],
        tried: vec![],
        retry_free: false,
    };
    let (cands, dropped) = s
        .candidates(&Pick {
            model: Some("m"),
            session: None,
            attempt: 1,
            exclusions: &Exclusions::default(),
        })
        .unwrap();
    assert_eq!(cands, vec![0, 1]);
    assert_eq!(
        dropped,
        Dropped {
            disabled: 1,
            model: 1,
            ..Default::default()
        }
    );
    // a is dead (counted as dead, not used), b used: nothing left, but the model exists.
    let err = s
        .candidates(&Pick {
            model: Some("m"),
            session: None,
            attempt: 1,
            exclusions: &ex,
        })
        .unwrap_err();
    assert_eq!(err, NoEndpoint::Exhausted);
    assert_eq!(
        pick_at(&s, None, &Exclusions::default(), 0).map(|_| ()),
        Ok(())
    );
    // Only a disabled endpoint serves "dmodel": not found either.
    let c2 = cfg(
        json!({"endpoints":[{"name":"a","cluster":"ca","models":["m"]},{"name":"d","cluster":"cd","models":["dm"],"disabled":true}]}),
    );
    let s2 = Scheduler::new(&c2, &store);
    assert_eq!(
        s2.pick(
            &Pick {
                model: Some("dm"),
                session: None,
                attempt: 1,
                exclusions: &Exclusions::default()
            },
            0
        )
        .unwrap_err(),
        NoEndpoint::ModelNotFound
    );
}

#[test]
fn affinity_sticks_and_repins_after_failover() {
    let c = four();
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    let d1 = pick_at(&s, Some(77), &ex, 0).unwrap();
    assert_eq!(d1.affinity, AffinityResult::New);
    s.finish(d1.ticket, &Outcome::Success, 100, Some(77), 10);
    for t in 0..10 {
        let d = pick_at(&s, Some(77), &ex, 20 + t).unwrap();
        assert_eq!(
            (d.endpoint, d.reason, d.affinity),
            (d1.endpoint, Reason::AffinityHit, AffinityResult::Hit)
        );
        s.finish(d.ticket, &Outcome::Success, 100, Some(77), 20 + t);
    }
    // The pinned endpoint rate-limits: this request fails over; the pin moves on success.
    let first = pick_at(&s, Some(77), &ex, 100).unwrap();
    let rl = Outcome::RateLimited {
        retry_after_ms: Some(5_000),
    };
    s.finish(first.ticket, &rl, 5, Some(77), 101);
    let mut ex2 = Exclusions::default();
    ex2.after_attempt(first.endpoint, &rl);
    let second = s
        .pick(
            &Pick {
                model: Some("m"),
                session: Some(77),
                attempt: 2,
                exclusions: &ex2,
            },
            102,
        )
        .unwrap();
    assert_ne!(second.endpoint, first.endpoint);
    assert_eq!(second.affinity, AffinityResult::Miss);
    s.finish(second.ticket, &Outcome::Success, 50, Some(77), 150);
    let after = pick_at(&s, Some(77), &ex, 200).unwrap();
    assert_eq!(
        (after.endpoint, after.affinity),
        (second.endpoint, AffinityResult::Hit)
    );
    // TTL: idle past 5 minutes, the pin is gone.
    s.finish(after.ticket, &Outcome::Cancelled, 0, Some(77), 200);
    assert_eq!(
        pick_at(&s, Some(77), &ex, 150 + 300_000).unwrap().affinity,
        AffinityResult::New
    );
}

#[test]
fn dead_key_evicts_the_pin() {
    let c = four();
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let d = pick_at(&s, Some(5), &Exclusions::default(), 0).unwrap();
    s.finish(d.ticket, &Outcome::Success, 10, Some(5), 1);
    let d = pick_at(&s, Some(5), &Exclusions::default(), 2).unwrap();
    assert_eq!(d.affinity, AffinityResult::Hit);
    s.finish(d.ticket, &Outcome::DeadKey, 10, Some(5), 3);
    assert_eq!(s.affinity().lookup(5, 4), None);
}

#[test]
fn cold_start_weight_only_for_exactly_twenty_requests() {
    let c = cfg(
        json!({"endpoints":[{"name":"bad","cluster":"c1","weight":3},{"name":"good","cluster":"c2","weight":1}]}),
    );
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    for n in 0..20u64 {
        let d = pick_at(&s, None, &ex, n * 10).unwrap();
        assert_eq!(
            (d.endpoint, d.reason),
            (0, Reason::ColdStart),
            "request {n}"
        );
        // Fails every time, but below the breaker threshold (spaced by successes elsewhere
        // would be unrealistic): use 401s, which never trip the breaker.
        s.finish(d.ticket, &Outcome::DeadKey, 5, None, n * 10 + 1);
    }
    let table = s.table();
    assert_eq!(table.entries[0].1.total, 20);
    let st = table.entries[0].1;
    let warm = score(3.0, &st, None, &c, 200);
    assert!(
        !warm.cold && warm.score < 1.0,
        "score dropped below the healthy endpoint's weight: {warm:?}"
    );
    let d = pick_at(&s, None, &ex, 200).unwrap();
    assert_eq!(
        d.endpoint, 1,
        "after 20 failures the weight-1 endpoint wins"
    );
}

#[test]
fn slow_endpoint_loses_new_sessions_after_warm_up() {
    let c = cfg(
        json!({"endpoints":[{"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"}],"cold_start_samples":5}),
    );
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    let mut now = 0;
    for i in 0..200u64 {
        let d = pick_at(&s, Some(i), &ex, now).unwrap();
        let latency = if d.endpoint == 1 { 500 } else { 100 };
        now += 1;
        s.finish(d.ticket, &Outcome::Success, latency, None, now);
    }
    let mut to_b = 0;
    for i in 1000..1100u64 {
        let d = pick_at(&s, Some(i), &ex, now).unwrap();
        to_b += usize::from(d.endpoint == 1);
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, now);
    }
    assert_eq!(to_b, 0);
}

#[test]
fn new_sessions_spread_over_equal_endpoints_by_rendezvous() {
    let c = cfg(
        json!({"endpoints":[{"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"},{"name":"c","cluster":"cc"}]}),
    );
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let mut counts = [0usize; 3];
    for i in 0..3000u64 {
        let d = pick_at(
            &s,
            Some(crate::scheduler::hash::session_key(b"", &i.to_le_bytes())),
            &Exclusions::default(),
            0,
        )
        .unwrap();
        counts[d.endpoint] += 1;
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, 0);
        // A second process with the same view agrees.
        let other = MemStore::new();
        let s2 = Scheduler::new(&c, &other);
        let d2 = pick_at(
            &s2,
            Some(crate::scheduler::hash::session_key(b"", &i.to_le_bytes())),
            &Exclusions::default(),
            0,
        )
        .unwrap();
        assert_eq!(d.endpoint, d2.endpoint);
    }
    for n in counts {
        assert!((800..1200).contains(&n), "{counts:?}");
    }
}

#[test]
fn breaker_lifecycle_through_the_scheduler() {
    let c = cfg(
        json!({"endpoints":[{"name":"a","cluster":"ca"},{"name":"b","cluster":"cb","weight":0.5}],
        "open_ms":1000,"failure_threshold":2,"half_open_probes":3}),
    );
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    let fail = Outcome::EndpointFailure(FailureKind::ConnectFailure);
    for t in 0..2 {
        let d = pick_at(&s, None, &ex, t).unwrap();
        assert_eq!(d.endpoint, 0);
        s.finish(d.ticket, &fail, 1, None, t);
    }
    // a is open: everything goes to b.
    let d = pick_at(&s, None, &ex, 10).unwrap();
    assert_eq!(d.endpoint, 1);
    s.finish(d.ticket, &Outcome::Success, 1, None, 10);
    // Cooldown over: exactly three probes go to a, then b takes the rest.
    let picks: Vec<Decision> = (0..6)
        .map(|_| pick_at(&s, None, &ex, 1001).unwrap())
        .collect();
    let probes: Vec<&Decision> = picks.iter().filter(|d| d.endpoint == 0).collect();
    assert_eq!(probes.len(), 3);
    assert!(probes
        .iter()
        .all(|d| d.reason == Reason::HalfOpenProbe && d.ticket.probe_epoch.is_some()));
    for d in picks {
        s.finish(d.ticket, &Outcome::Success, 1, None, 1002);
    }
    assert_eq!(s.table().entries[0].1.breaker.state, BreakerState::Closed);
    assert_eq!(s.table().entries[0].1.in_flight, 0);
    assert_eq!(pick_at(&s, None, &ex, 1003).unwrap().endpoint, 0);
}

#[test]
fn all_cooling_down_reports_earliest_recovery_and_rate_limit() {
    let c = cfg(json!({"endpoints":[{"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"}]}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    let d = pick_at(&s, None, &ex, 0).unwrap();
    s.finish(
        d.ticket,
        &Outcome::RateLimited {
            retry_after_ms: Some(7_000),
        },
        1,
        None,
        0,
    );
    let d = pick_at(&s, None, &ex, 0).unwrap();
    s.finish(
        d.ticket,
        &Outcome::RateLimited {
            retry_after_ms: Some(3_000),
        },
        1,
        None,
        0,
    );
    assert_eq!(
        pick_at(&s, None, &ex, 1).unwrap_err(),
        NoEndpoint::CoolingDown {
            retry_at_ms: 3_000,
            all_rate_limited: true
        }
    );
}

#[test]
fn retry_budget_limits_failovers() {
    let c = cfg(
        json!({"endpoints":[{"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"}],
        "retry_budget_percent":10,"retry_budget_min_retries":2}),
    );
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    for _ in 0..10 {
        let d = pick_at(&s, None, &ex, 0).unwrap();
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, 0);
    }
    let retry = |_| {
        s.pick(
            &Pick {
                model: Some("m"),
                session: None,
                attempt: 2,
                exclusions: &ex,
            },
            0,
        )
    };
    let results: Vec<bool> = (0..5).map(retry).map(|r| r.is_ok()).collect();
    assert_eq!(results, vec![true, true, true, false, false]); // 2 + 10% of 10
}

#[test]
fn failovers_after_401_or_429_spend_no_retry_budget() {
    let c = cfg(
        json!({"endpoints":[{"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"}],
        "retry_budget_percent":0,"retry_budget_min_retries":0}),
    );
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let failover = |outcome: Outcome| {
        let mut ex = Exclusions::default();
        ex.after_attempt(0, &outcome);
        let pick = Pick {
            model: Some("m"),
            session: None,
            attempt: 2,
            exclusions: &ex,
        };
        s.pick(&pick, 0)
            .map(|d| s.finish(d.ticket, &Outcome::Cancelled, 0, None, 0))
    };
    // No budget at all: a 5xx failover is refused, 401/403/429 failovers go through.
    assert_eq!(
        failover(Outcome::EndpointFailure(FailureKind::Status(503))).unwrap_err(),
        NoEndpoint::BudgetExhausted
    );
    assert!(failover(Outcome::DeadKey).is_ok());
    assert!(failover(Outcome::RateLimited {
        retry_after_ms: None
    })
    .is_ok());
}

#[test]
fn dead_keys_sink_fast() {
    let c = cfg(json!({"endpoints":[{"name":"a","cluster":"ca"}],"cold_start_samples":0}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    for _ in 0..2 {
        let d = pick_at(&s, None, &Exclusions::default(), 0).unwrap();
        s.finish(d.ticket, &Outcome::DeadKey, 1, None, 0);
    }
    // Two 401s at alpha 0.5: 1 → 0.5 → 0.25 (at the default alpha 0.1 it would be 0.81).
    assert!((s.table().entries[0].1.success_rate - 0.25).abs() < 1e-12);
}

#[test]
fn cas_conflicts_are_retried_and_exhaustion_is_reported() {
    let c = four();
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    store.inject_conflicts.set(3);
    let d = pick_at(&s, None, &Exclusions::default(), 0).unwrap();
    assert!(d.ticket.counted);
    store.inject_conflicts.set(100);
    let d2 = pick_at(&s, None, &Exclusions::default(), 0).unwrap();
    assert!(!d2.ticket.counted);
    store.inject_conflicts.set(0);
    s.finish(d2.ticket, &Outcome::Success, 1, None, 1);
    s.finish(d.ticket, &Outcome::Success, 1, None, 1);
    assert_eq!(s.table().entries[d.endpoint].1.in_flight, 0);
}
