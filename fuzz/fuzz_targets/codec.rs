//! The shared-data codecs: arbitrary bytes decode to a value or to "absent" without panicking,
//! decoded values re-encode to bytes that decode to the same value, structured values
//! round-trip exactly, and a scheduler reading garbage from shared data neither panics nor
//! grows the store beyond its bound.
#![no_main]

use arbitrary::Arbitrary;
use computeflux::scheduler::health::breaker::{Breaker, BreakerState, OpenCause};
use computeflux::scheduler::routing::pins::affinity::{self, Entry, KEY_PREFIX};
use computeflux::scheduler::routing::table::in_flight::InFlightAges;
use computeflux::scheduler::routing::judge::payoff::Payoff;
use computeflux::scheduler::routing::quota::{Quota, Remaining};
use computeflux::scheduler::routing::judge::saturation::Saturation;
use computeflux::scheduler::routing::select::TABLE_KEY;
use computeflux::scheduler::routing::placement::sessions::SESSIONS_KEY;
use computeflux::scheduler::routing::judge::slowness::Slowness;
use computeflux::scheduler::routing::table::{group_key, groups, Table, TableCache};
use computeflux::scheduler::{
    Config, EndpointState, Exclusions, MemStore, Outcome, Pick, RetryBudget, Scheduler, Store,
};
use libfuzzer_sys::fuzz_target;
use serde_json::json;

#[derive(Arbitrary, Debug)]
struct StateSpec {
    id: u32,
    latency: Option<u32>,
    success_permille: u16,
    last_sample_ms: u64,
    total: u64,
    in_flight: u32,
    in_flight_changed_ms: u64,
    state: u8,
    rate_limited: bool,
    consecutive_failures: u32,
    open_until_ms: u64,
    probes_admitted: u32,
    probes_succeeded: u32,
    last_probe_ms: u64,
    epoch: u32,
    degraded: bool,
    degraded_probe_ms: u64,
    latency_dev: u32,
    degraded_probes: u8,
    degraded_at_ms: u64,
    degraded_own_end_ms: u64,
    quota_requests: Option<(u64, u64, Option<u64>, u64, bool)>,
    quota_tokens: Option<(u64, u64, Option<u64>, u64, bool)>,
    /// Prompt and cached token averages (non-negative, as the codec requires) and samples.
    payoff: (u32, u32, u32),
    /// Slowness: log-mean in thousandths (|ln| ≤ 50 as the codec requires), deviation,
    /// expected ms, samples, last sample; and the saturation state (mod 3).
    slowness: (i16, u16, u32, u32, u64),
    saturation: u8,
}

fn remaining(
    (left, reset_at_ms, limit, span_ms, assumed): (u64, u64, Option<u64>, u64, bool),
) -> Remaining {
    Remaining {
        left,
        reset_at_ms,
        // u64::MAX is the codec's "no limit" (limits parsed from headers are at most 10^12).
        limit: limit.filter(|l| *l != u64::MAX),
        span_ms,
        assumed,
        // Any value round-trips; this one varies with the others.
        stated_ms: reset_at_ms.wrapping_sub(span_ms),
        prev_used: left.wrapping_mul(3),
        picked: span_ms.wrapping_mul(5),
        placed: left.wrapping_mul(7),
    }
}

#[derive(Arbitrary, Debug)]
enum Input<'a> {
    /// Arbitrary bytes as a stored endpoint table and as an affinity bucket.
    Raw(&'a [u8]),
    /// Structured values: exact round-trips.
    Entries(Vec<(u64, u32, u64)>),
    Table {
        requests: u32,
        retries: u32,
        updated_ms: u64,
        states: Vec<StateSpec>,
    },
    /// Garbage in shared data under a running scheduler.
    Garbage {
        table: &'a [u8],
        bucket: &'a [u8],
        session: u64,
        now_ms: u32,
    },
}

fn state(s: &StateSpec) -> (u32, EndpointState) {
    (
        s.id,
        EndpointState {
            latency_ms: s.latency.map(f64::from),
            latency_dev_ms: f64::from(s.latency_dev),
            success_rate: f64::from(s.success_permille.min(1000)) / 1000.0,
            last_sample_ms: s.last_sample_ms,
            total: s.total,
            in_flight: s.in_flight,
            in_flight_changed_ms: s.in_flight_changed_ms,
            in_flight_ages: {
                let mut a = InFlightAges::default();
                a.add(s.in_flight_changed_ms, 600_000);
                a.add(s.last_sample_ms, u64::from(s.in_flight).max(1));
                a
            },
            breaker: Breaker {
                state: match s.state % 3 {
                    0 => BreakerState::Closed,
                    1 => BreakerState::Open,
                    _ => BreakerState::HalfOpen,
                },
                cause: if s.rate_limited {
                    OpenCause::RateLimited
                } else {
                    OpenCause::Failures
                },
                consecutive_failures: s.consecutive_failures,
                open_until_ms: s.open_until_ms,
                probes_admitted: s.probes_admitted,
                probes_succeeded: s.probes_succeeded,
                last_probe_ms: s.last_probe_ms,
                epoch: s.epoch,
            },
            degraded: s.degraded,
            degraded_probe_ms: s.degraded_probe_ms,
            degraded_probes: s.degraded_probes,
            degraded_at_ms: s.degraded_at_ms,
            degraded_own_end_ms: s.degraded_own_end_ms,
            quota: Quota {
                requests: s.quota_requests.map(remaining),
                tokens: s.quota_tokens.map(remaining),
            },
            payoff: Payoff {
                prompt: f64::from(s.payoff.0),
                cached: f64::from(s.payoff.1),
                samples: s.payoff.2,
            },
            slowness: Slowness {
                log_mean: f64::from(s.slowness.0) / 1000.0,
                log_dev: f64::from(s.slowness.1) / 1000.0,
                expected_ms: f64::from(s.slowness.2),
                samples: s.slowness.3,
                last_sample_ms: s.slowness.4,
                last_decode_ms: s.slowness.4 / 2,
                degraded: false,
            },
            saturation: match s.saturation % 3 {
                0 => Saturation::Unknown,
                1 => Saturation::Room,
                _ => Saturation::Saturated,
            },
        },
    )
}

fuzz_target!(|input: Input<'_>| match input {
    Input::Raw(bytes) => {
        if let Some(t) = Table::decode(bytes) {
            for (_, st) in &t.entries {
                assert!((0.0..=1.0).contains(&st.success_rate));
                assert!(st.latency_ms.is_none_or(f64::is_finite));
            }
            assert!(t.budget.requests >= 0.0 && t.budget.retries >= 0.0);
            let again = t.encode();
            assert_eq!(Table::decode(&again).as_ref(), Some(&t));
        }
        if let Some(entries) = affinity::decode(bytes) {
            // The bucket format is canonical: re-encoding gives the same bytes (a bucket of the
            // previous version is rewritten in the current one, with the same entries).
            let again = affinity::encode(&entries);
            assert_eq!(entries.len() * affinity::ENTRY_BYTES + 1, again.len());
            if again.first() == bytes.first() {
                assert_eq!(again, bytes);
            }
            assert_eq!(affinity::decode(&again), Some(entries));
        }
    }
    Input::Entries(list) => {
        let entries: Vec<Entry> = list
            .iter()
            .map(|&(session, endpoint_id, last_used_ms)| Entry {
                session,
                endpoint_id,
                last_used_ms,
                placement_key: session.rotate_left(17),
                prompt_tokens: endpoint_id.rotate_left(5),
            })
            .collect();
        let bytes = affinity::encode(&entries);
        assert_eq!(affinity::decode(&bytes), Some(entries));
    }
    Input::Table {
        requests,
        retries,
        updated_ms,
        states,
    } => {
        let t = Table {
            budget: RetryBudget {
                requests: f64::from(requests),
                retries: f64::from(retries),
                updated_ms,
            },
            entries: states.iter().map(state).collect(),
            generation: u64::from(requests),
        };
        let bytes = t.encode();
        assert_eq!(Table::decode(&bytes), Some(t));
        // Any strict prefix or extension is refused.
        if let Some((_, shorter)) = bytes.split_last() {
            assert_eq!(Table::decode(shorter), None);
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(Table::decode(&longer), None);
    }
    Input::Garbage {
        table,
        bucket,
        session,
        now_ms,
    } => {
        let cfg = Config::from_value(&json!({
            "endpoints": [{"name": "a", "cluster": "a"}, {"name": "b", "cluster": "b"}],
            "affinity_max_sessions": 10,
        }))
        .expect("valid");
        let store = MemStore::new();
        let sched = Scheduler::new(&cfg, &store);
        let aff = sched.affinity();
        // Every bucket and the table hold the garbage.
        for b in 0..aff.buckets() {
            store
                .set(&format!("{KEY_PREFIX}{b}"), bucket, None)
                .expect("MemStore set");
        }
        store.set(TABLE_KEY, table, None).expect("MemStore set");
        // A worker's cache reads the garbage as a full load does, with garbage in the header,
        // in a group, or in both; and a one-entry write over it (its group and the header's
        // record of it) as well.
        let mut cache = TableCache::default();
        assert_eq!(cache.load(&store, &cfg), Table::load_from(&store, &cfg));
        Table::aligned(None, &cfg).write_to(&store);
        assert_eq!(cache.load(&store, &cfg), Table::load_from(&store, &cfg));
        // A group changed without the header recording it (only a foreign writer does that:
        // every writer of this version records its group's version) is seen by a worker's cache
        // at the group's next recorded version, by design; a fresh cache reads it as a full
        // load does.
        store.set(&group_key(0), table, None).expect("MemStore set");
        cache = TableCache::default();
        assert_eq!(cache.load(&store, &cfg), Table::load_from(&store, &cfg));
        let id = cfg.endpoints[0].id;
        let bump = |st: &mut EndpointState| {
            st.total = st.total.wrapping_add(1);
            true
        };
        if groups::update_entry(&store, Some(0), id, bump, |_| {}).is_some() {
            assert_eq!(cache.load(&store, &cfg), Table::load_from(&store, &cfg));
        }
        store.set(TABLE_KEY, table, None).expect("MemStore set");
        assert_eq!(cache.load(&store, &cfg), Table::load_from(&store, &cfg));
        let now = u64::from(now_ms);
        let _ = aff.lookup(session, now);
        let ex = Exclusions::default();
        let pick = Pick {
            model: Some("m"),
            session: Some(session | 1),
            attempt: 1,
            exclusions: &ex,
            nonce: 0,
            body_bytes: 0,
            pin_hint: None,
            holder: None,
            prefix: computeflux::scheduler::Prefix::NONE,
            follow_up: false,
            max_output_tokens: 0,
        };
        if let Ok(d) = sched.pick(&pick, now) {
            let id = d.ticket.endpoint_id;
            let f = sched.finish(d.ticket, &Outcome::Success, 5, Some(session | 1), now + 5);
            assert!(f.stored);
            // Never another endpoint; none when the fuzzed store holds that session's bucket in
            // a later version, which this reader leaves alone (an upgrade's newer module owns it).
            let got = aff.lookup(session | 1, now + 6);
            assert!(got.is_none() || got == Some(id), "{got:?} != {id}");
        }
        assert!(aff.stored_entries() <= 10);
        // The table (its header and groups), the affinity buckets, and the count of sessions
        // placed once a new session was placed.
        let sessions = u64::from(store.get(SESSIONS_KEY).0.is_some());
        let table_keys = 1 + groups::groups(cfg.endpoints.len()) as u64;
        assert_eq!(store.keys() as u64, aff.buckets() + table_keys + sessions);
    }
});
