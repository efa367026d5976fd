//! The scheduler as a state machine: a generated configuration, then an arbitrary sequence of
//! picks (with exclusions, models, sessions, failover attempts), finishes with arbitrary
//! outcomes and latencies, clock advances and injected CAS conflicts on the in-memory store.
//!
//! Invariants checked after every event:
//! - a pick never returns a disabled, excluded (dead / used / tried) or wrong-model endpoint,
//!   and an affinity hit is the endpoint the session was pinned to;
//! - in-flight counts never fall below the attempts started and not finished (no underflow, no
//!   double decrement), equal them while no update was lost to CAS exhaustion, and return to 0
//!   when every ticket has finished;
//! - a half-open breaker never has more than `half_open_probes` probe slots taken, nor more
//!   live probes of its epoch in flight;
//! - the affinity table holds at most `affinity_max_sessions` entries in its fixed buckets.
#![no_main]

use arbitrary::Arbitrary;
use computeflux::scheduler::health::breaker::BreakerState;
use computeflux::scheduler::health::outcome::FailureKind;
use computeflux::scheduler::routing::select::Ticket;
use computeflux::scheduler::routing::placement::sessions::SESSIONS_KEY;
use computeflux::scheduler::routing::table::groups;
use computeflux::scheduler::state::hash::session_key;
use computeflux::scheduler::state::store::CAS_RETRIES;
use computeflux::scheduler::{Config, Exclusions, MemStore, Outcome, Pick, Scheduler, Store};
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Value};

const MODELS: [&str; 3] = ["m0", "m1", "m2"];

#[derive(Arbitrary, Debug)]
struct EndpointSpec {
    disabled: bool,
    /// Bit i: serves MODELS[i]; 0: any model.
    models: u8,
    weight: u8,
}

#[derive(Arbitrary, Debug)]
struct Setup {
    endpoints: Vec<EndpointSpec>,
    half_open_probes: u8,
    failure_threshold: u8,
    open_ms: u16,
    rate_limit_ms: u16,
    retry_after_max_ms: u16,
    affinity_max_sessions: u8,
    affinity_ttl_ms: u16,
    cold_start_samples: u8,
    failover_timeout_ms: u16,
    retry_budget_percent: u8,
    start_ms: u32,
    events: Vec<Event>,
}

#[derive(Arbitrary, Debug)]
enum OutcomeSpec {
    Success,
    DeadKey,
    RateLimited(Option<u16>),
    Status(u16),
    ConnectFailure,
    Reset,
    Timeout,
    ClientError,
    Cancelled,
}

#[derive(Arbitrary, Debug)]
enum Event {
    Pick {
        /// 0: no model (a non-POST request); else MODELS[(m - 1) % 3].
        model: u8,
        session: Option<u8>,
        attempt: u8,
        dead: u8,
        used: u8,
        tried: u8,
        /// Endpoints the admission queue found no free place on (`Exclusions::placeless`).
        placeless: u8,
    },
    Finish {
        which: u8,
        outcome: OutcomeSpec,
        latency_ms: u16,
        keep_session: bool,
    },
    Advance(u16),
    AdvanceFar(u32),
    Conflicts(u8),
}

fn outcome(o: &OutcomeSpec) -> Outcome {
    match o {
        OutcomeSpec::Success => Outcome::Success,
        OutcomeSpec::DeadKey => Outcome::DeadKey,
        OutcomeSpec::RateLimited(ms) => Outcome::RateLimited {
            retry_after_ms: ms.map(u64::from),
        },
        OutcomeSpec::Status(s) => Outcome::EndpointFailure(FailureKind::Status(*s)),
        OutcomeSpec::ConnectFailure => Outcome::EndpointFailure(FailureKind::ConnectFailure),
        OutcomeSpec::Reset => Outcome::EndpointFailure(FailureKind::Reset),
        OutcomeSpec::Timeout => Outcome::EndpointFailure(FailureKind::Timeout),
        OutcomeSpec::ClientError => Outcome::ClientError,
        OutcomeSpec::Cancelled => Outcome::Cancelled,
    }
}

fn config(s: &Setup) -> Option<Config> {
    let endpoints: Vec<Value> = s
        .endpoints
        .iter()
        .take(6)
        .enumerate()
        .map(|(i, e)| {
            let mut ep = json!({
                "name": format!("e{i}"),
                "cluster": format!("c{i}"),
                "weight": 1 + u32::from(e.weight % 10),
                "disabled": e.disabled,
            });
            let models: Vec<&str> = (0..3)
                .filter(|b| e.models & (1 << b) != 0)
                .map(|b| MODELS[b])
                .collect();
            if !models.is_empty() {
                ep["models"] = json!(models);
            }
            ep
        })
        .collect();
    if endpoints.is_empty() {
        return None;
    }
    Config::from_value(&json!({
        "endpoints": endpoints,
        "half_open_probes": 1 + u32::from(s.half_open_probes % 4),
        "failure_threshold": 1 + u32::from(s.failure_threshold % 4),
        "open_ms": 1 + u64::from(s.open_ms),
        "rate_limit_ms": 1 + u64::from(s.rate_limit_ms),
        "retry_after_max_ms": 1 + u64::from(s.retry_after_max_ms),
        "affinity_max_sessions": 1 + u64::from(s.affinity_max_sessions % 64),
        "affinity_ttl_ms": 1 + u64::from(s.affinity_ttl_ms),
        "cold_start_samples": u64::from(s.cold_start_samples % 8),
        "failover_timeout_ms": 1 + u64::from(s.failover_timeout_ms),
        "retry_budget_percent": u64::from(s.retry_budget_percent % 101),
        "max_attempts": 16,
    }))
    .ok()
}

fn mask(bits: u8, n: usize) -> Vec<usize> {
    (0..n.min(8)).filter(|i| bits & (1 << i) != 0).collect()
}

struct Outstanding {
    ticket: Ticket,
    session: Option<u64>,
}

fuzz_target!(|setup: Setup| {
    let Some(cfg) = config(&setup) else { return };
    let n = cfg.endpoints.len();
    let store = MemStore::new();
    let sched = Scheduler::new(&cfg, &store);
    let aff = sched.affinity();
    let bcfg = sched.breaker_config();
    let probes_bound = cfg.half_open_probes;
    let mut now = u64::from(setup.start_ms);
    let mut open: Vec<Outstanding> = Vec::new();
    // True once an in-flight decrement may have been lost to CAS exhaustion.
    let mut lossy = false;

    let check = |open: &[Outstanding], now: u64, lossy: bool| {
        let table = sched.table();
        assert_eq!(table.entries.len(), n);
        for (i, (id, st)) in table.entries.iter().enumerate() {
            assert_eq!(*id, cfg.endpoints[i].id);
            let counted = |o: &&Outstanding| o.ticket.endpoint == i && o.ticket.counted;
            let outstanding = open.iter().filter(counted).count() as u32;
            // Attempts younger than `in_flight_max_age_ms` are surely counted; older ones may
            // have expired (issue 22: a leaked count expires by its age).
            let young = open
                .iter()
                .filter(counted)
                .filter(|o| now.saturating_sub(o.ticket.started_ms) < cfg.in_flight_max_age_ms)
                .count() as u32;
            assert!(
                st.in_flight >= young,
                "endpoint {i}: in_flight {} < {young} young attempts in flight",
                st.in_flight
            );
            if !lossy {
                assert!(st.in_flight <= outstanding, "endpoint {i}");
                if young == outstanding {
                    assert_eq!(st.in_flight, outstanding, "endpoint {i}");
                }
            }
            let b = &st.breaker;
            assert!(b.probes_admitted <= probes_bound, "{b:?}");
            if b.state == BreakerState::HalfOpen {
                let live_probes = open
                    .iter()
                    .filter(|o| {
                        o.ticket.endpoint == i
                            && o.ticket.probe_epoch == Some(b.epoch)
                            && o.ticket.started_ms + bcfg.probe_stale_ms > now
                    })
                    .count() as u32;
                assert!(
                    live_probes <= probes_bound,
                    "{live_probes} probes in flight: {b:?}"
                );
            }
        }
        assert!(aff.stored_entries() as u64 <= cfg.affinity_max_sessions);
        // The table (its header and groups), the affinity buckets and the count of sessions
        // placed (one key).
        let table_keys = 1 + groups::groups(cfg.endpoints.len()) as u64;
        assert!(store.keys() as u64 <= aff.buckets() + table_keys + 1);
        assert!(
            store.keys() as u64 <= aff.buckets() + table_keys
                || store.get(SESSIONS_KEY).0.is_some()
        );
    };

    for ev in setup.events.iter().take(400) {
        match ev {
            Event::Pick {
                model,
                session,
                attempt,
                dead,
                used,
                tried,
                placeless,
            } => {
                let model = match model % 4 {
                    0 => None,
                    m => Some(MODELS[usize::from(m - 1)]),
                };
                let session = session.map(|s| session_key(b"tenant", &[s % 16]));
                let exclusions = Exclusions {
                    dead: mask(*dead, n),
                    used: mask(*used, n),
                    tried: mask(*tried, n),
                    retry_free: false,
                    placeless: mask(*placeless, n),
                };
                let pinned = session.and_then(|s| aff.lookup(s, now));
                let pick = Pick {
                    model,
                    session,
                    attempt: 1 + u32::from(attempt % 3),
                    exclusions: &exclusions,
                    nonce: 0,
                    body_bytes: 0,
                    pin_hint: None,
                    holder: None,
                    prefix: computeflux::scheduler::Prefix::NONE,
                    follow_up: false,
                    max_output_tokens: u64::from(*attempt) * 100,
                };
                if let Ok(d) = sched.pick(&pick, now) {
                    let i = d.endpoint;
                    let ep = &cfg.endpoints[i];
                    assert!(!ep.disabled, "picked disabled endpoint {i}");
                    assert!(!exclusions.dead.contains(&i), "picked dead endpoint {i}");
                    assert!(!exclusions.used.contains(&i), "picked used endpoint {i}");
                    assert!(!exclusions.tried.contains(&i), "picked tried endpoint {i}");
                    assert!(model.is_none_or(|m| ep.serves(m)), "model mismatch");
                    assert_eq!(d.ticket.endpoint, i);
                    assert_eq!(d.ticket.endpoint_id, ep.id);
                    assert_eq!(d.ticket.started_ms, now);
                    if d.affinity == computeflux::scheduler::AffinityResult::Hit {
                        assert_eq!(pinned, Some(ep.id), "hit on a different endpoint");
                    }
                    if d.ticket.probe_epoch.is_some() {
                        assert!(d.ticket.counted, "an unrecorded probe was sent");
                    }
                    open.push(Outstanding {
                        ticket: d.ticket,
                        session,
                    });
                }
            }
            Event::Finish {
                which,
                outcome: spec,
                latency_ms,
                keep_session,
            } => {
                if open.is_empty() {
                    continue;
                }
                let o = open.swap_remove(usize::from(*which) % open.len());
                let session = if *keep_session { o.session } else { None };
                let report = sched.finish(
                    o.ticket,
                    &outcome(spec),
                    u64::from(*latency_ms),
                    session,
                    now,
                );
                if !report.stored {
                    lossy = true;
                }
            }
            Event::Advance(ms) => now += u64::from(*ms),
            Event::AdvanceFar(ms) => now += u64::from(*ms),
            Event::Conflicts(k) => store
                .inject_conflicts
                .set(u32::from(*k) % (2 * CAS_RETRIES as u32 + 1)),
        }
        check(&open, now, lossy);
    }

    // Every attempt finishes: the in-flight counts return to zero.
    store.inject_conflicts.set(0);
    for o in open.drain(..) {
        let report = sched.finish(o.ticket, &Outcome::Cancelled, 0, None, now);
        lossy |= !report.stored;
    }
    check(&[], now, lossy);
    if !lossy {
        for (_, st) in sched.table().entries {
            assert_eq!(st.in_flight, 0);
        }
    }
});
