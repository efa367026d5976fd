use super::*;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

const RULE: Rule = Rule {
    max_waiting: 8,
    max_wait_ms: 1_000,
};

fn ask(ctx: u32, tenant: u64, priority: i8) -> Arrival {
    Arrival {
        vm: 1,
        ctx,
        tenant,
        priority,
        model: 7,
        cost: 100,
    }
}

#[test]
fn goes_at_once_with_room_and_nobody_waiting() {
    let mut q = Queue::default();
    assert_eq!(q.arrive(ask(1, 1, 0), None, &RULE, 0), Arrived::Direct);
    assert_eq!(q.arrive(ask(2, 1, 0), Some(1), &RULE, 0), Arrived::Direct);
    assert!(q.waiters.is_empty(), "a direct admission writes nothing");
    // Full: waits. Another request for the same model then waits too, even with room (no
    // overtaking), while another model with room goes.
    assert_eq!(
        q.arrive(ask(3, 1, 0), Some(0), &RULE, 0),
        Arrived::Queued(0)
    );
    assert_eq!(
        q.arrive(ask(4, 2, 0), Some(3), &RULE, 0),
        Arrived::Queued(1)
    );
    let other = Arrival {
        model: 9,
        ..ask(5, 2, 0)
    };
    assert_eq!(q.arrive(other, Some(3), &RULE, 0), Arrived::Direct);
    // Sheddable requests never wait.
    assert_eq!(
        q.arrive(ask(6, 3, -1), Some(0), &RULE, 0),
        Arrived::Refused(Refusal::QueueFull)
    );
}

#[test]
fn admits_by_priority_then_counter_then_arrival() {
    let mut q = Queue::default();
    q.arrive(ask(1, 1, 0), Some(0), &RULE, 0);
    q.arrive(ask(2, 1, 0), Some(0), &RULE, 0);
    q.arrive(ask(3, 2, 0), Some(0), &RULE, 0);
    q.arrive(ask(4, 3, 2), Some(0), &RULE, 0);
    let order = |q: &mut Queue| {
        let mut out = Vec::new();
        for _ in 0..4 {
            q.admit(&RULE, 10, |_| Some(1));
            out.extend(q.take(1, 10).iter().map(|d| d.ctx));
        }
        out
    };
    // Priority 2 first; then tenant 1 (first in), then tenant 2 (its counter is now below
    // tenant 1's), then tenant 1 again.
    assert_eq!(order(&mut q), vec![4, 1, 3, 2]);
}

#[test]
fn one_free_slot_is_given_once_across_workers() {
    let mut q = Queue::default();
    q.arrive(
        Arrival {
            vm: 2,
            ..ask(1, 1, 0)
        },
        Some(0),
        &RULE,
        0,
    );
    q.arrive(ask(2, 2, 0), Some(0), &RULE, 0);
    // VM 1's tick admits VM 2's entry (best ranked); it is not taken by VM 1.
    assert!(q.admit(&RULE, 5, |_| Some(1)));
    assert!(q.take(1, 5).is_empty());
    // Until VM 2 takes it, it holds the slot: the same room admits nobody else.
    assert!(!q.admit(&RULE, 6, |_| Some(1)));
    let d = q.take(2, 7);
    assert_eq!(
        (d.len(), d[0].ctx, d[0].refused, d[0].waited_ms),
        (1, 1, None, 7)
    );
    assert!(q.admit(&RULE, 8, |_| Some(1)));
    assert_eq!(q.take(1, 8)[0].ctx, 2);
}

#[test]
fn waits_are_bounded_in_time_and_count() {
    let mut q = Queue::default();
    for c in 0..8 {
        assert!(matches!(
            q.arrive(ask(c, 1, 0), Some(0), &RULE, 0),
            Arrived::Queued(_)
        ));
    }
    // A ninth from the same tenant ranks last: refused itself.
    assert_eq!(
        q.arrive(ask(8, 1, 0), Some(0), &RULE, 0),
        Arrived::Refused(Refusal::QueueFull)
    );
    // Another tenant (never served) ranks first among equals' newest: it takes the place of
    // tenant 1's newest entry, which is refused.
    assert!(matches!(
        q.arrive(ask(9, 2, 0), Some(0), &RULE, 1),
        Arrived::Queued(_)
    ));
    let d = q.take(1, 2);
    assert_eq!(d.len(), 1);
    assert_eq!((d[0].ctx, d[0].refused), (7, Some(Refusal::QueueFull)));
    assert_eq!(q.waiting(), 8);
    // Past the longest wait: every one refused with a timeout.
    q.admit(&RULE, 1_001, |_| Some(0));
    let d = q.take(1, 1_001);
    assert_eq!(
        d.iter()
            .filter(|d| d.refused == Some(Refusal::Timeout))
            .count(),
        7
    );
    assert_eq!(q.waiting(), 1, "the newcomer waited less than the bound");
}

#[test]
fn newcomers_start_at_the_minimum_and_bank_no_credit() {
    let mut q = Queue::default();
    // Tenant 1 is served 10 requests while alone.
    for c in 0..10 {
        q.arrive(ask(c, 1, 0), Some(0), &RULE, 0);
        q.admit(&RULE, 0, |_| Some(1));
        q.take(1, 0);
    }
    assert_eq!(q.counter(1), Some(1_000));
    // Tenant 2 arrives to an empty queue: it starts level with the most served, not at 0,
    // so it cannot take the next 10 slots in a row.
    q.arrive(ask(20, 2, 0), Some(0), &RULE, 0);
    assert_eq!(q.counter(2), Some(1_000));
    // While tenant 2 waits, tenant 3 starts at the waiting minimum.
    q.charge(2, 500);
    q.arrive(ask(21, 3, 0), Some(0), &RULE, 0);
    assert_eq!(q.counter(3), Some(1_500));
}

/// A steady tenant (1 request per round) under a tenant bursting 10 per round, with 2 slots
/// freed per round: the steady one gets its whole demand (below its fair share of 1 slot), the
/// burst the rest; the steady one never waits more than a round.
#[test]
fn a_steady_tenant_is_not_starved_by_a_burst() {
    let rule = Rule {
        max_waiting: 64,
        max_wait_ms: 1_000_000,
    };
    let mut q = Queue::default();
    let (mut quiet, mut noisy, mut quiet_worst_wait) = (0u32, 0u32, 0u64);
    let mut ctx = 0;
    for round in 0..200u64 {
        let now = round * 10;
        for _ in 0..10 {
            ctx += 1;
            q.arrive(ask(ctx, 9, 0), Some(0), &rule, now);
        }
        ctx += 1;
        q.arrive(ask(1_000_000 + ctx, 1, 0), Some(0), &rule, now);
        q.admit(&rule, now, |_| Some(2));
        for d in q.take(1, now) {
            if d.refused.is_some() {
                continue;
            }
            if d.ctx >= 1_000_000 {
                quiet += 1;
                quiet_worst_wait = quiet_worst_wait.max(d.waited_ms);
            } else {
                noisy += 1;
            }
        }
    }
    assert_eq!(quiet, 200, "every steady request admitted");
    assert_eq!(quiet_worst_wait, 0, "admitted in the round it came");
    assert_eq!(noisy, 200, "the burst takes the other slot");
}

#[test]
fn codec_round_trips_and_rejects_junk() {
    let mut q = Queue::default();
    q.arrive(ask(1, 1, 3), Some(0), &RULE, 5);
    q.arrive(ask(2, 2, -0), Some(0), &RULE, 6);
    q.admit(&RULE, 7, |_| Some(1));
    let bytes = q.encode();
    assert_eq!(Queue::decode(&bytes), Some(q.clone()));
    assert_eq!(Queue::decode(&bytes[..bytes.len() - 1]), None);
    assert_eq!(Queue::decode(&[3]), None);
    assert_eq!(Queue::decode(&[]), None);
    // Version 1 (counters without an in-flight count) is still read, counting none in flight.
    let mut v1 = bytes.clone();
    v1[0] = 1;
    let at = v1.len() - q.counters.len() * 28;
    let mut counters = Vec::new();
    for c in v1[at..].chunks(28) {
        counters.extend_from_slice(&c[..24]);
    }
    v1.truncate(at);
    v1.extend_from_slice(&counters);
    let read = Queue::decode(&v1).unwrap();
    assert_eq!(read.waiters, q.waiters);
    assert!(read.counters.iter().all(|c| c.in_flight == 0));
    assert!(q.counters.iter().any(|c| c.in_flight == 1));
}

/// A tenant with nothing admitted in flight passes a full model's room when its engines are
/// shared with other replicas: its best-ranked request only, once per round; never a tenant
/// with a request in flight, never where nothing is shared.
#[test]
fn a_light_tenant_passes_where_replicas_share_the_engines() {
    let mut q = Queue::default();
    // The noisy tenant 1 has one admitted and in flight, two waiting; the quiet tenant 2 two
    // waiting.
    q.arrive(ask(1, 1, 0), Some(0), &RULE, 0);
    q.admit(&RULE, 1, |_| Some(1));
    assert_eq!(q.take(1, 1).len(), 1);
    for (ctx, tenant) in [(2, 1), (3, 1), (4, 2), (5, 2)] {
        q.arrive(ask(ctx, tenant, 0), Some(0), &RULE, 2);
    }
    // The room is full: nothing by the room; nothing shared: no pass.
    assert!(!q.admit(&RULE, 3, |_| Some(0)));
    assert!(!q.admit_light(|_| false));
    // Shared: the quiet tenant's first request passes, once.
    assert!(q.admit_light(|_| true));
    assert_eq!(
        q.take(1, 4).iter().map(|d| d.ctx).collect::<Vec<_>>(),
        vec![4]
    );
    assert!(!q.admit_light(|_| true), "its request is in flight now");
    // It ends: the next passes.
    q.ended(2, 10);
    assert!(q.admit_light(|_| true));
    assert_eq!(
        q.take(1, 5).iter().map(|d| d.ctx).collect::<Vec<_>>(),
        vec![5]
    );
    // The noisy tenant's end leaves it with nothing in flight: it passes too, once.
    q.ended(1, 0);
    assert!(q.admit_light(|_| true));
    assert_eq!(
        q.take(1, 6).iter().map(|d| d.ctx).collect::<Vec<_>>(),
        vec![2]
    );
    assert!(!q.admit_light(|_| true));
    assert_eq!(q.waiting(), 1);
    // Its counter was charged the completion and the prompts admitted.
    let served = |t: u64| q.counters.iter().find(|c| c.tenant == t).unwrap().served;
    assert!(served(2) >= 210, "{}", served(2));
}

#[cfg(not(target_arch = "wasm32"))]
mod props {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Arrive {
            vm: u32,
            tenant: u64,
            priority: i8,
            room: Option<u32>,
            model: u64,
        },
        Admit {
            room: Option<u32>,
        },
        Take {
            vm: u32,
        },
        Leave {
            vm: u32,
            seq: u32,
        },
        Tick {
            ms: u64,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u32..3, any::<u64>(), -8i8..=8, proptest::option::of(0u32..4), 0u64..3)
                .prop_map(|(vm, tenant, priority, room, model)| Op::Arrive { vm, tenant, priority, room, model }),
            2 => proptest::option::of(0u32..4).prop_map(|room| Op::Admit { room }),
            2 => (0u32..3).prop_map(|vm| Op::Take { vm }),
            1 => (0u32..3, 0u32..64).prop_map(|(vm, seq)| Op::Leave { vm, seq }),
            1 => (0u64..500).prop_map(|ms| Op::Tick { ms }),
        ]
    }

    proptest! {
        /// Whatever clients send (any tenant ids, priorities, arrival patterns), the queue
        /// stays within its bounds, round-trips, and every decided entry is delivered once.
        #[test]
        fn bounded_under_any_input(ops in proptest::collection::vec(op(), 1..400)) {
            let rule = Rule { max_waiting: 6, max_wait_ms: 300 };
            let mut q = Queue::default();
            let mut now = 0u64;
            let mut ctx = 0u32;
            let mut delivered = std::collections::HashSet::new();
            for o in ops {
                match o {
                    Op::Arrive { vm, tenant, priority, room, model } => {
                        ctx += 1;
                        let a = Arrival { vm, ctx, tenant, priority, model, cost: 10 };
                        let r = q.arrive(a, room, &rule, now);
                        if priority < 0 {
                            prop_assert!(!matches!(r, Arrived::Queued(_)), "sheddable never waits");
                        }
                    }
                    Op::Admit { room } => {
                        q.admit(&rule, now, |_| room);
                        prop_assert!(q.waiters.iter().all(|w| w.state != Wait::Waiting
                            || now.saturating_sub(w.since_ms) <= rule.max_wait_ms));
                    }
                    Op::Take { vm } => {
                        for d in q.take(vm, now) {
                            prop_assert!(delivered.insert((vm, d.seq)), "delivered once");
                        }
                    }
                    Op::Leave { vm, seq } => { q.leave(vm, seq); }
                    Op::Tick { ms } => now += ms,
                }
                prop_assert!(q.waiting() <= rule.max_waiting);
                prop_assert!(q.waiters.len() <= 2 * rule.max_waiting);
                prop_assert!(q.counters.len() <= MAX_TENANTS);
                prop_assert_eq!(Queue::decode(&q.encode()), Some(q.clone()));
            }
        }

        /// Many distinct tenants (a client cycling credentials) never grow the counters past
        /// their bound.
        #[test]
        fn counters_bounded(n in 300usize..1000) {
            let rule = Rule { max_waiting: 10_000, max_wait_ms: 1 };
            let mut q = Queue::default();
            for t in 0..n {
                q.arrive(ask(t as u32, t as u64, 0), Some(0), &rule, t as u64);
                q.admit(&rule, t as u64 + 2, |_| Some(0));
                q.take(1, t as u64 + 2);
            }
            prop_assert!(q.counters.len() <= MAX_TENANTS);
        }
    }
}
