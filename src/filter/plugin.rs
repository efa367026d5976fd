//! What every HTTP context of a VM shares (the validated configuration and metric ids), and the
//! gauges that mirror the shared endpoint table.
//!
//! Its own module so that the root context (which creates HTTP contexts) and the request path
//! and its recorder (which use the plugin) do not import each other.

use super::metrics::Metrics;
use super::parked::Parked;
use super::shared::SharedData;
use crate::scheduler::config::Config;
use crate::scheduler::health::breaker::BreakerState;
use crate::scheduler::routing::judge::saturation::Saturation;
use crate::scheduler::routing::select::capacity::RoomsMemo;
use crate::scheduler::routing::select::Scheduler;
use crate::scheduler::routing::table::{groups, EndpointState, TableCache};
use std::cell::RefCell;

/// What every HTTP context of this VM shares: the validated configuration, metric ids, and
/// the endpoint entries this VM last decoded (a new configuration starts a new cache).
pub struct Plugin {
    pub cfg: Config,
    pub metrics: Metrics,
    pub table_cache: RefCell<TableCache>,
    /// The capacities and rooms this worker's decisions last derived (see `RoomsMemo`).
    pub rooms_memo: RefCell<RoomsMemo>,
    /// This VM's id in the admission queue (drawn once per VM).
    pub vm: u32,
    /// This VM's requests paused for admission (one registry per VM, kept across
    /// configurations).
    pub parked: std::rc::Rc<Parked<Plugin>>,
}

/// Gauges mirror the shared endpoint table (absolute values, so every VM may set them).
pub fn refresh_gauges(p: &Plugin, now_ms: u64) {
    let store = SharedData;
    let table = Scheduler::with_cache(&p.cfg, &store, &p.table_cache).table();
    for (i, (_, st)) in table.entries.iter().enumerate() {
        set_gauges(p, i, st, now_ms);
    }
}

/// The gauges of endpoint `i` alone (its breaker changed): its own entry read from the shared
/// table, not the whole table (a request's cost must not grow with the fleet; the
/// others' gauges follow at the next tick). Falls back to [`refresh_gauges`] when the
/// endpoint's entry is not where the configuration puts it.
pub fn refresh_endpoint_gauges(p: &Plugin, i: usize, now_ms: u64) {
    let entry = p
        .cfg
        .endpoints
        .get(i)
        .and_then(|ep| groups::read_entry(&SharedData, i, ep.id));
    match entry {
        Some(st) => set_gauges(p, i, &st, now_ms),
        None => refresh_gauges(p, now_ms),
    }
}

fn set_gauges(p: &Plugin, i: usize, st: &EndpointState, now_ms: u64) {
    // A pool's hosts share its series: counters add up, gauges would be the last host's.
    if p.cfg
        .endpoints
        .get(i)
        .is_some_and(|e| e.address().is_some())
    {
        return;
    }
    let Some(m) = p.metrics.endpoint(i) else {
        return;
    };
    let state = match st.breaker.state_at(now_ms) {
        BreakerState::Closed => 0,
        BreakerState::Open => 1,
        BreakerState::HalfOpen => 2,
    };
    Metrics::set(m.breaker_state, state);
    Metrics::set(
        m.ewma_latency_ms,
        st.latency_ms.map_or(0, |l| l.round() as u64),
    );
    Metrics::set(
        m.in_flight,
        u64::from(st.load(now_ms, p.cfg.in_flight_max_age_ms)),
    );
    Metrics::set(m.affinity_payoff_permille, st.payoff.permille());
    let slowness = st
        .slowness
        .value()
        .map_or(0, |v| (v * 1000.0).round() as u64);
    Metrics::set(m.slowness_permille, slowness);
    Metrics::set(m.degraded, u64::from(st.degraded));
    Metrics::set(
        m.saturated,
        u64::from(st.saturation == Saturation::Saturated),
    );
}
