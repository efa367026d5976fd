//! Property tests of the scheduler's public API.
//!
//! The unit tests pin exact numbers for hand-picked cases; these check the promises that must
//! hold for *every* configuration and history: an excluded endpoint is never picked, half-open
//! never lets more than `half_open_probes` probes through (even with several workers racing on
//! one store), affinity memory stays within its bound, the shared-data codecs round-trip and
//! never panic, EWMAs stay within their samples, in-flight counts return to zero, and the
//! request and configuration parsers never panic on hostile bytes.
//!
//! Workers are simulated the way Envoy runs them: one [`Scheduler`] per worker over one shared
//! store. [`RacingStore`] makes the races real: before a write of the endpoint table it can let
//! another worker's pick land first, so the writer's CAS token is stale and it must re-read.

// Test code: a failed unwrap is a failed test.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use computeflux::scheduler::health::breaker::{
    Admission, Breaker, BreakerConfig, BreakerState, OpenCause,
};
use computeflux::scheduler::health::outcome::FailureKind;
use computeflux::scheduler::routing::judge::payoff::Payoff;
use computeflux::scheduler::routing::judge::saturation::Saturation;
use computeflux::scheduler::routing::judge::slowness::{
    self, DegradeRule, Sample, Slowness, WorkModel,
};
use computeflux::scheduler::routing::pins::affinity::{self, Affinity, Entry};
use computeflux::scheduler::routing::quota::{Quota, Remaining};
use computeflux::scheduler::routing::select::signals;
use computeflux::scheduler::routing::select::{Ticket, TABLE_KEY};
use computeflux::scheduler::routing::table::ewma;
use computeflux::scheduler::routing::table::group_key;
use computeflux::scheduler::routing::table::in_flight::InFlightAges;
use computeflux::scheduler::routing::table::Table;
use computeflux::scheduler::state::store::CAS_RETRIES;
use computeflux::scheduler::wire::request;
use computeflux::scheduler::{
    CasMismatch, Config, Decision, EndpointState, Exclusions, MemStore, NoEndpoint, Outcome, Pick,
    Prefix, RetryBudget, Scheduler, Store,
};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use serde_json::{json, Value};

const MODELS: [&str; 3] = ["m0", "m1", "m2"];

fn props(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        // Shrunk counterexamples are reported in the failure message; check them in as unit
        // tests rather than as a regressions file next to this one.
        failure_persistence: Some(Box::new(FileFailurePersistence::Off)),
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Generators
// ---------------------------------------------------------------------------------------------

/// An endpoint of a generated configuration.
#[derive(Debug, Clone)]
struct EndpointSpec {
    disabled: bool,
    /// Indexes into [`MODELS`]; `None` serves any model.
    models: Option<Vec<usize>>,
    weight: f64,
}

fn endpoint_spec() -> impl Strategy<Value = EndpointSpec> {
    (
        prop::bool::weighted(0.15),
        prop::option::weighted(0.5, vec(0..MODELS.len(), 1..=2)),
        prop_oneof![Just(1.0), 0.1f64..10.0],
    )
        .prop_map(|(disabled, models, weight)| EndpointSpec {
            disabled,
            models,
            weight,
        })
}

/// The knobs that shape selection and the breaker, kept small so that breakers trip, recover
/// and pins expire within a short generated history.
#[derive(Debug, Clone)]
struct Knobs {
    cold_start_samples: u64,
    failure_threshold: u64,
    half_open_probes: u64,
    open_ms: u64,
    rate_limit_ms: u64,
    retry_after_max_ms: u64,
    affinity_ttl_ms: u64,
    affinity_max_sessions: u64,
    retry_budget_percent: f64,
    retry_budget_min_retries: f64,
    failover_timeout_ms: u64,
}

fn knobs(failover_timeout_ms: BoxedStrategy<u64>) -> impl Strategy<Value = Knobs> {
    (
        (
            0u64..5,
            1u64..4,
            1u64..5,
            1u64..3_000,
            1u64..3_000,
            1u64..5_000,
        ),
        (
            1u64..5_000,
            1u64..200,
            0.0f64..100.0,
            0.0f64..5.0,
            failover_timeout_ms,
        ),
    )
        .prop_map(
            |((cs, ft, hop, open, rl, ram), (ttl, maxs, pct, minr, fo))| Knobs {
                cold_start_samples: cs,
                failure_threshold: ft,
                half_open_probes: hop,
                open_ms: open,
                rate_limit_ms: rl,
                retry_after_max_ms: ram,
                affinity_ttl_ms: ttl,
                affinity_max_sessions: maxs,
                retry_budget_percent: pct,
                retry_budget_min_retries: minr,
                failover_timeout_ms: fo,
            },
        )
}

fn build_config(endpoints: &[EndpointSpec], k: &Knobs) -> Config {
    let eps: Vec<Value> = endpoints
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let mut v = json!({"name": format!("ep-{i}"), "cluster": format!("cluster-{i}"), "weight": e.weight,
                "disabled": e.disabled});
            if let Some(models) = &e.models {
                v["models"] = json!(models.iter().map(|&m| MODELS[m]).collect::<Vec<_>>());
            }
            v
        })
        .collect();
    let raw = json!({
        "endpoints": eps,
        "cold_start_samples": k.cold_start_samples,
        "failure_threshold": k.failure_threshold,
        "half_open_probes": k.half_open_probes,
        "open_ms": k.open_ms,
        "rate_limit_ms": k.rate_limit_ms,
        "retry_after_max_ms": k.retry_after_max_ms,
        "affinity_ttl_ms": k.affinity_ttl_ms,
        "affinity_max_sessions": k.affinity_max_sessions,
        "retry_budget_percent": k.retry_budget_percent,
        "tuning": {"retry_budget_min_retries": k.retry_budget_min_retries},
        "failover_timeout_ms": k.failover_timeout_ms,
    });
    match Config::from_value(&raw) {
        Ok(c) => c,
        Err(errors) => panic!("generated configuration rejected: {errors:?}\n{raw}"),
    }
}

fn outcome() -> impl Strategy<Value = Outcome> {
    prop_oneof![
        4 => Just(Outcome::Success),
        1 => Just(Outcome::DeadKey),
        2 => prop::option::of(0u64..10_000).prop_map(|retry_after_ms| Outcome::RateLimited { retry_after_ms }),
        3 => prop_oneof![
            prop::sample::select(vec![500u16, 502, 503, 504]).prop_map(FailureKind::Status),
            Just(FailureKind::ConnectFailure),
            Just(FailureKind::Reset),
            Just(FailureKind::Timeout),
        ]
        .prop_map(Outcome::EndpointFailure),
        1 => Just(Outcome::ClientError),
        1 => Just(Outcome::Cancelled),
    ]
}

/// One step of a simulated history. Indexes (`worker`, `which`, exclusion entries) are taken
/// modulo what exists, so every generated step is meaningful and shrinking stays valid.
#[derive(Debug, Clone)]
enum Op {
    /// A new client request's first attempt.
    Pick {
        worker: usize,
        model: Option<usize>,
        session: Option<u8>,
        dead: Vec<usize>,
        used: Vec<usize>,
        tried: Vec<usize>,
    },
    /// An attempt ends; if its outcome fails over and `failover` is set, the same request's next
    /// attempt is picked with the exclusions the outcome implies.
    Finish {
        worker: usize,
        which: usize,
        outcome: Outcome,
        latency_ms: u64,
        failover: bool,
    },
    Advance(u64),
    /// The next `n` writes lose their CAS race (as if another worker had won it).
    Conflicts(u32),
    /// The next write of the endpoint table is preceded by another worker's pick.
    Race {
        worker: usize,
        model: Option<usize>,
    },
}

fn op(workers: usize, max_conflicts: u32, max_advance: u64) -> impl Strategy<Value = Op> {
    let idx = || vec(0usize..16, 0..3);
    prop_oneof![
        6 => (0..workers, prop::option::weighted(0.9, 0..MODELS.len()), prop::option::weighted(0.7, 0u8..6), idx(), idx(), idx())
            .prop_map(|(worker, model, session, dead, used, tried)| Op::Pick { worker, model, session, dead, used, tried }),
        5 => (0..workers, 0usize..64, outcome(), 1u64..2_000, any::<bool>())
            .prop_map(|(worker, which, outcome, latency_ms, failover)| Op::Finish { worker, which, outcome, latency_ms, failover }),
        2 => (0..=max_advance).prop_map(Op::Advance),
        1 => (0..=max_conflicts).prop_map(Op::Conflicts),
        1 => (0..workers, prop::option::weighted(0.9, 0..MODELS.len())).prop_map(|(worker, model)| Op::Race { worker, model }),
    ]
}

// ---------------------------------------------------------------------------------------------
// The simulation
// ---------------------------------------------------------------------------------------------

/// A store shared by all simulated workers: a [`MemStore`] plus real write races. When a race
/// is armed, the next table write first lets another worker's pick through, which changes the
/// CAS token under the writer.
struct RacingStore<'a> {
    inner: MemStore,
    cfg: &'a Config,
    now_ms: Cell<u64>,
    armed: RefCell<Vec<(usize, Option<&'static str>)>>,
    /// The endpoint table as it was at the last read of its header before the pick's first
    /// successful table write: the snapshot a pick decided on, even when it had to re-read
    /// after losing a race (the table is its header and its groups: see `table::groups`).
    last_table_read: RefCell<Option<Table>>,
    /// A write to the table (header or group) succeeded since the last reset.
    table_written: Cell<bool>,
    /// Writes of the endpoint table that lost their CAS race (counted from a reset).
    table_conflicts: Cell<u32>,
    /// Attempts started by intruding picks: (worker, attempt), for the simulation to adopt.
    intruded: RefCell<Vec<(usize, Attempt)>>,
}

impl Store for RacingStore<'_> {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        let got = self.inner.get(key);
        if key == TABLE_KEY && !self.table_written.get() {
            *self.last_table_read.borrow_mut() = Some(Table::read(&self.inner, self.cfg));
        }
        got
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
        let table_key = key.starts_with(TABLE_KEY);
        let intruder = if table_key {
            self.armed.borrow_mut().pop()
        } else {
            None
        };
        if let Some((worker, model)) = intruder {
            // The intruder works on the inner store directly: it is not raced itself.
            let now = self.now_ms.get();
            let ex = Exclusions::default();
            let pick = Pick {
                model,
                session: None,
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
            let before = Scheduler::new(self.cfg, &self.inner).table();
            if let Ok(d) = Scheduler::new(self.cfg, &self.inner).pick(&pick, now) {
                let attempt = Attempt::started(self.cfg, &before, d, model, None, ex, 1, now);
                self.intruded.borrow_mut().push((worker, attempt));
            }
        }
        let result = self.inner.set(key, value, cas);
        if table_key && result.is_err() {
            self.table_conflicts.set(self.table_conflicts.get() + 1);
        }
        if table_key && result.is_ok() {
            self.table_written.set(true);
        }
        result
    }
}

/// An attempt in flight, with what the simulation knows about it.
#[derive(Debug)]
struct Attempt {
    /// `None` only for an attempt the checker's self-test fakes (a ticket cannot be forged).
    ticket: Option<Ticket>,
    endpoint: usize,
    /// Whether the scheduler recorded the attempt (its ticket's `counted`).
    counted: bool,
    model: Option<&'static str>,
    session: Option<u64>,
    exclusions: Exclusions,
    attempt: u32,
    /// The half-open epoch this attempt probes, whether or not the scheduler recorded it.
    probe: Option<u32>,
}

impl Attempt {
    /// Classifies a decision against the table the pick decided on.
    #[allow(clippy::too_many_arguments)]
    fn started(
        cfg: &Config,
        decided_on: &Table,
        d: Decision,
        model: Option<&'static str>,
        session: Option<u64>,
        exclusions: Exclusions,
        attempt: u32,
        now: u64,
    ) -> Attempt {
        let probe = if d.ticket.counted {
            d.ticket.probe_epoch
        } else {
            // Not recorded: what would it have been in the table the pick decided on?
            match decided_on.entries[d.endpoint]
                .1
                .breaker
                .peek(now, &breaker_config(cfg))
            {
                Admission::Probe { epoch } => Some(epoch),
                _ => None,
            }
        };
        Attempt {
            endpoint: d.ticket.endpoint,
            counted: d.ticket.counted,
            ticket: Some(d.ticket),
            model,
            session,
            exclusions,
            attempt,
            probe,
        }
    }
}

fn breaker_config(cfg: &Config) -> BreakerConfig {
    BreakerConfig {
        failure_threshold: cfg.failure_threshold,
        half_open_probes: cfg.half_open_probes,
        open_ms: cfg.open_ms,
        rate_limit_ms: cfg.rate_limit_ms,
        retry_after_max_ms: cfg.retry_after_max_ms,
        probe_stale_ms: cfg.failover_timeout_ms.max(cfg.open_ms),
    }
}

/// Which invariants a simulation asserts after every step.
#[derive(Debug, Clone, Copy, Default)]
struct Checks {
    exclusions: bool,
    probe_bound: bool,
    in_flight: bool,
}

struct Sim<'a> {
    cfg: &'a Config,
    store: RacingStore<'a>,
    flights: Vec<Vec<Attempt>>,
    checks: Checks,
    picks_ok: usize,
}

impl<'a> Sim<'a> {
    fn new(cfg: &'a Config, workers: usize, checks: Checks) -> Self {
        let store = RacingStore {
            inner: MemStore::new(),
            cfg,
            now_ms: Cell::new(1_000),
            armed: RefCell::new(Vec::new()),
            last_table_read: RefCell::new(None),
            table_written: Cell::new(false),
            table_conflicts: Cell::new(0),
            intruded: RefCell::new(Vec::new()),
        };
        // As the filter does at configure time: CAS does not protect a key's creation (a write
        // to a missing key always succeeds), so the table exists before the first request.
        let table = Scheduler::new(cfg, &store.inner).table();
        table.write_to(&store.inner);
        Sim {
            cfg,
            store,
            flights: (0..workers).map(|_| Vec::new()).collect(),
            checks,
            picks_ok: 0,
        }
    }

    fn scheduler(&self) -> Scheduler<'_> {
        Scheduler::new(self.cfg, &self.store)
    }

    fn now(&self) -> u64 {
        self.store.now_ms.get()
    }

    fn run(&mut self, ops: &[Op]) -> Result<(), TestCaseError> {
        for (step, op) in ops.iter().enumerate() {
            self.apply(op)
                .map_err(|e| TestCaseError::fail(format!("step {step} ({op:?}): {e}")))?;
            self.adopt_intruders();
            self.check_state()
                .map_err(|e| TestCaseError::fail(format!("after step {step} ({op:?}): {e}")))?;
        }
        Ok(())
    }

    fn apply(&mut self, op: &Op) -> Result<(), String> {
        let n = self.cfg.endpoints.len();
        match op {
            Op::Pick {
                worker,
                model,
                session,
                dead,
                used,
                tried,
            } => {
                let ex = Exclusions {
                    dead: dead.iter().map(|i| i % n).collect(),
                    used: used.iter().map(|i| i % n).collect(),
                    tried: tried.iter().map(|i| i % n).collect(),
                    retry_free: false,
                    placeless: Vec::new(),
                };
                let model = model.map(|m| MODELS[m]);
                let session = session.map(|s| 0x5e55_0000 + u64::from(s));
                self.pick(*worker, model, session, ex, 1)
            }
            Op::Finish {
                worker,
                which,
                outcome,
                latency_ms,
                failover,
            } => {
                let flights = &mut self.flights[*worker];
                if flights.is_empty() {
                    return Ok(());
                }
                let a = flights.swap_remove(which % flights.len());
                let now = self.now();
                if let Some(ticket) = a.ticket {
                    self.scheduler()
                        .finish(ticket, outcome, *latency_ms, a.session, now);
                }
                if *failover && outcome.fails_over() {
                    let mut ex = a.exclusions.clone();
                    ex.after_attempt(a.endpoint, outcome);
                    self.pick(*worker, a.model, a.session, ex, a.attempt + 1)?;
                }
                Ok(())
            }
            Op::Advance(ms) => {
                self.store.now_ms.set(self.now() + ms);
                Ok(())
            }
            Op::Conflicts(c) => {
                self.store.inner.inject_conflicts.set(*c);
                Ok(())
            }
            Op::Race { worker, model } => {
                self.store
                    .armed
                    .borrow_mut()
                    .push((*worker, model.map(|m| MODELS[m])));
                Ok(())
            }
        }
    }

    fn adopt_intruders(&mut self) {
        let workers = self.flights.len();
        for (worker, a) in self.store.intruded.borrow_mut().drain(..) {
            self.flights[worker % workers].push(a);
        }
    }

    /// One attempt, with its decision checked against the table it was made on.
    fn pick(
        &mut self,
        worker: usize,
        model: Option<&'static str>,
        session: Option<u64>,
        ex: Exclusions,
        attempt: u32,
    ) -> Result<(), String> {
        let now = self.now();
        let pick = Pick {
            model,
            session,
            attempt,
            exclusions: &ex,
            nonce: 0,
            body_bytes: 0,
            pin_hint: None,
            holder: None,
            prefix: Prefix::NONE,
            follow_up: false,
            max_output_tokens: 0,
        };
        *self.store.last_table_read.borrow_mut() = None;
        self.store.table_written.set(false);
        self.store.table_conflicts.set(0);
        let result = self.scheduler().pick(&pick, now);
        // An intruding pick may have changed the table under this one, which then re-read it:
        // the decision is judged against the snapshot it was last made on.
        let last_read = self.store.last_table_read.borrow_mut().take();
        let decided_on = match last_read {
            Some(table) => table,
            None => self.scheduler().table(),
        };
        if self.checks.exclusions {
            self.check_decision(&decided_on, &pick, &result, now)?;
        }
        if let Ok(d) = result {
            self.picks_ok += 1;
            let a = Attempt::started(self.cfg, &decided_on, d, model, session, ex, attempt, now);
            self.flights[worker].push(a);
        }
        Ok(())
    }

    fn check_decision(
        &self,
        decided_on: &Table,
        pick: &Pick<'_>,
        result: &Result<Decision, NoEndpoint>,
        now: u64,
    ) -> Result<(), String> {
        let bcfg = breaker_config(self.cfg);
        let ex = pick.exclusions;
        let serves = |i: usize| pick.model.is_none_or(|m| self.cfg.endpoints[i].serves(m));
        let enabled = |i: usize| !self.cfg.endpoints[i].disabled;
        let excluded =
            |i: usize| ex.dead.contains(&i) || ex.used.contains(&i) || ex.tried.contains(&i);
        let candidates: Vec<usize> = (0..self.cfg.endpoints.len())
            .filter(|&i| enabled(i) && serves(i) && !excluded(i))
            .collect();
        let admissible = |i: usize| {
            !matches!(
                decided_on.entries[i].1.breaker.peek(now, &bcfg),
                Admission::Rejected { .. }
            )
        };
        match result {
            Ok(d) => {
                let i = d.endpoint;
                let ep = &self.cfg.endpoints[i];
                if ep.disabled {
                    return Err(format!("picked disabled endpoint {i}"));
                }
                if ex.dead.contains(&i) || ex.used.contains(&i) || ex.tried.contains(&i) {
                    return Err(format!("picked endpoint {i} excluded by {ex:?}"));
                }
                if !serves(i) {
                    return Err(format!(
                        "picked endpoint {i} ({:?}) for model {:?}",
                        ep.models, pick.model
                    ));
                }
                if d.ticket.endpoint != i || d.ticket.endpoint_id != ep.id {
                    return Err(format!(
                        "ticket {:?} does not match decision endpoint {i}",
                        d.ticket
                    ));
                }
                if !admissible(i) {
                    return Err(format!(
                        "picked endpoint {i} whose breaker rejects: {:?}",
                        decided_on.entries[i].1.breaker
                    ));
                }
            }
            Err(NoEndpoint::ModelNotFound) => {
                if let Some(i) = (0..self.cfg.endpoints.len()).find(|&i| enabled(i) && serves(i)) {
                    return Err(format!(
                        "ModelNotFound although enabled endpoint {i} serves {:?}",
                        pick.model
                    ));
                }
            }
            Err(NoEndpoint::Exhausted) => {
                if let Some(i) = candidates.first() {
                    return Err(format!("Exhausted although endpoint {i} is a candidate"));
                }
            }
            Err(NoEndpoint::BudgetExhausted) => {
                if pick.attempt <= 1 {
                    return Err("a first attempt was refused for retry budget".into());
                }
            }
            Err(NoEndpoint::CoolingDown { retry_at_ms, .. }) => {
                // When every CAS retry lost, a half-open slot cannot be taken safely: only a
                // closed breaker may then take the attempt.
                let gave_up = self.store.table_conflicts.get() >= CAS_RETRIES as u32;
                let admits = |i: usize| match decided_on.entries[i].1.breaker.peek(now, &bcfg) {
                    Admission::Normal => true,
                    Admission::Probe { .. } => !gave_up,
                    Admission::Rejected { .. } => false,
                };
                if let Some(i) = candidates.iter().copied().find(|&i| admits(i)) {
                    return Err(format!(
                        "CoolingDown although endpoint {i}'s breaker admits (CAS gave up: {gave_up})"
                    ));
                }
                if *retry_at_ms < now {
                    return Err(format!(
                        "CoolingDown retry_at_ms {retry_at_ms} is in the past (now {now})"
                    ));
                }
            }
        }
        Ok(())
    }

    fn check_state(&self) -> Result<(), String> {
        let table = self.scheduler().table();
        let n_probes = self.cfg.half_open_probes;
        if self.checks.probe_bound {
            for (i, (_, st)) in table.entries.iter().enumerate() {
                let b = &st.breaker;
                if b.state == BreakerState::HalfOpen && b.probes_admitted > n_probes {
                    return Err(format!(
                        "endpoint {i}: stored breaker admitted {} > {n_probes} probes",
                        b.probes_admitted
                    ));
                }
            }
            // Probes actually out, recorded or not, per (endpoint, epoch).
            let mut out: HashMap<(usize, u32), u32> = HashMap::new();
            for a in self.flights.iter().flatten() {
                if let Some(epoch) = a.probe {
                    *out.entry((a.endpoint, epoch)).or_default() += 1;
                }
            }
            if let Some(((i, epoch), k)) = out.iter().find(|(_, &k)| k > n_probes) {
                return Err(format!("endpoint {i}: {k} probes in flight in half-open epoch {epoch}, bound {n_probes}"));
            }
        }
        if self.checks.in_flight {
            let mut counted = vec![0u32; self.cfg.endpoints.len()];
            for a in self.flights.iter().flatten() {
                if a.counted {
                    counted[a.endpoint] += 1;
                }
            }
            let stored: Vec<u32> = table.entries.iter().map(|(_, st)| st.in_flight).collect();
            if stored != counted {
                return Err(format!(
                    "stored in-flight {stored:?} != attempts in flight {counted:?}"
                ));
            }
            for (i, (_, st)) in table.entries.iter().enumerate() {
                if !(0.0..=1.0).contains(&st.success_rate) {
                    return Err(format!(
                        "endpoint {i}: success rate {} outside [0, 1]",
                        st.success_rate
                    ));
                }
            }
        }
        Ok(())
    }

    /// Finishes every attempt still in flight, as a drained worker would.
    fn drain(&mut self, outcome: &Outcome) -> Result<(), TestCaseError> {
        let now = self.now();
        // Finishing may set off an armed race, whose attempt then needs finishing too.
        while let Some(a) = self.flights.iter_mut().find_map(|f| f.pop()) {
            if let Some(ticket) = a.ticket {
                self.scheduler().finish(ticket, outcome, 1, a.session, now);
            }
            self.adopt_intruders();
            self.check_state().map_err(TestCaseError::fail)?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// (a) exclusions, (b) the half-open bound, (f) in-flight accounting
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(props(192))]

    /// Disabled, dead, used, tried, model-mismatched and breaker-rejected endpoints are never
    /// picked, and every refusal is justified, whatever the configuration and history
    /// (including CAS retries that run out, and stale probes being reclaimed).
    #[test]
    fn excluded_endpoints_are_never_picked(
        eps in vec(endpoint_spec(), 1..8),
        k in knobs((1u64..200_000).boxed()),
        ops in vec(op(3, 2 * CAS_RETRIES as u32, 3_000), 1..120),
    ) {
        let cfg = build_config(&eps, &k);
        let mut sim = Sim::new(&cfg, 3, Checks { exclusions: true, ..Checks::default() });
        sim.run(&ops)?;
    }
}

proptest! {
    #![proptest_config(props(192))]

    /// However picks of several workers interleave on one store, with CAS races and injected
    /// conflicts (up to more than the retry bound), no half-open epoch of any endpoint ever has
    /// more than `half_open_probes` probes in flight, recorded or not.
    #[test]
    fn half_open_never_admits_more_than_the_probe_bound(
        eps in vec(endpoint_spec().prop_map(|e| EndpointSpec { disabled: false, models: None, ..e }), 1..4),
        k in knobs(Just(3_600_000u64).boxed()),
        ops in vec(op(4, 2 * CAS_RETRIES as u32, 400), 1..150),
    ) {
        // The history spans < 150 × 400 ms, far less than probe_stale_ms (1 h): no probe is
        // ever reclaimed as lost, so the bound is exact.
        let cfg = build_config(&eps, &k);
        let mut sim = Sim::new(&cfg, 4, Checks { probe_bound: true, ..Checks::default() });
        sim.run(&ops)?;
        sim.drain(&Outcome::Success)?;
    }

    /// With conflicts below the retry bound (every update lands eventually), the stored
    /// in-flight count of each endpoint always equals the attempts started and not yet
    /// finished, and returns to 0 once each ticket is finished exactly once.
    #[test]
    fn in_flight_returns_to_zero(
        eps in vec(endpoint_spec(), 1..6),
        k in knobs((1u64..200_000).boxed()),
        // At most CAS_RETRIES - 2 injected conflicts plus one race: every update lands.
        ops in vec(op(3, CAS_RETRIES as u32 - 2, 3_000), 1..120),
        last in outcome(),
    ) {
        let cfg = build_config(&eps, &k);
        let mut sim = Sim::new(&cfg, 3, Checks { in_flight: true, ..Checks::default() });
        sim.run(&ops)?;
        sim.drain(&last)?;
        let table = sim.scheduler().table();
        prop_assert!(table.entries.iter().all(|(_, st)| st.in_flight == 0), "{table:?}");
    }
}

/// The simulation's own checks can fail: a scheduler that ignored exclusions would be caught.
/// (Guards against a generator that never produces a pick or never excludes anything.)
#[test]
fn the_simulation_exercises_picks_and_probes() {
    let eps = vec![
        EndpointSpec {
            disabled: false,
            models: None,
            weight: 1.0
        };
        2
    ];
    let k = Knobs {
        cold_start_samples: 0,
        failure_threshold: 1,
        half_open_probes: 2,
        open_ms: 10,
        rate_limit_ms: 10,
        retry_after_max_ms: 10,
        affinity_ttl_ms: 1_000,
        affinity_max_sessions: 10,
        retry_budget_percent: 20.0,
        retry_budget_min_retries: 1.0,
        failover_timeout_ms: 3_600_000,
    };
    let cfg = build_config(&eps, &k);
    let mut sim = Sim::new(
        &cfg,
        2,
        Checks {
            exclusions: true,
            probe_bound: true,
            in_flight: true,
        },
    );
    let pick = |worker| Op::Pick {
        worker,
        model: None,
        session: None,
        dead: vec![],
        used: vec![],
        tried: vec![],
    };
    let fail = Op::Finish {
        worker: 0,
        which: 0,
        outcome: Outcome::EndpointFailure(FailureKind::Timeout),
        latency_ms: 1,
        failover: false,
    };
    // Both endpoints fail once and open; after the cooldown, picks are probes, two per endpoint.
    let mut ops = vec![pick(0), fail.clone(), pick(0), fail, Op::Advance(10)];
    ops.extend((0..6).map(|i| pick(i % 2)));
    sim.run(&ops).unwrap();
    let probes = sim
        .flights
        .iter()
        .flatten()
        .filter(|a| a.probe.is_some())
        .count();
    assert_eq!(
        probes, 4,
        "two probes per half-open endpoint, then nothing: {:?}",
        sim.flights
    );
    assert_eq!(sim.picks_ok, 6);
    // A third worker's view of the half-open endpoints: a probe over the bound is detected.
    let first = &sim.flights[0][0];
    let extra = Attempt {
        ticket: None,
        endpoint: first.endpoint,
        counted: false,
        model: first.model,
        session: first.session,
        exclusions: first.exclusions.clone(),
        attempt: first.attempt,
        probe: first.probe,
    };
    sim.flights[1].push(extra);
    assert!(sim.check_state().unwrap_err().contains("probes in flight"));
}

// ---------------------------------------------------------------------------------------------
// (c) affinity memory bound
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
enum AffinityOp {
    Remember { session: u64, endpoint: u32 },
    Forget { session: u64, endpoint: u32 },
    Advance(u64),
    Conflicts(u32),
}

fn affinity_op() -> impl Strategy<Value = AffinityOp> {
    // A mix of recurring sessions (refresh, re-pin, forget) and a stream of new ones.
    let session = prop_oneof![0u64..32, any::<u64>()];
    prop_oneof![
        8 => (session.clone(), 0u32..4).prop_map(|(session, endpoint)| AffinityOp::Remember { session, endpoint }),
        2 => (session, 0u32..4).prop_map(|(session, endpoint)| AffinityOp::Forget { session, endpoint }),
        2 => (0u64..2_000).prop_map(AffinityOp::Advance),
        1 => (0..=CAS_RETRIES as u32 + 2).prop_map(AffinityOp::Conflicts),
    ]
}

proptest! {
    #![proptest_config(props(64))]

    /// For any session stream the stored entries never exceed `affinity_max_sessions`, and a
    /// pin that was stored is found right after.
    #[test]
    fn affinity_memory_stays_within_its_bound(
        max_sessions in prop_oneof![1u64..10, 10u64..300, Just(64), Just(65), Just(128)],
        ttl_ms in 1u64..5_000,
        ops in vec(affinity_op(), 1..400),
    ) {
        let store = MemStore::new();
        let aff = Affinity::new(&store, ttl_ms, max_sessions);
        let mut now = 0u64;
        let mut stored_once = false;
        for op in &ops {
            match *op {
                AffinityOp::Remember { session, endpoint } => {
                    if aff.remember(session, endpoint, now) {
                        prop_assert_eq!(aff.lookup(session, now), Some(endpoint), "pin of {} lost at once", session);
                        stored_once = true;
                    }
                }
                AffinityOp::Forget { session, endpoint } => {
                    if aff.forget(session, endpoint) {
                        prop_assert_ne!(aff.lookup(session, now), Some(endpoint));
                    }
                }
                AffinityOp::Advance(ms) => now += ms,
                AffinityOp::Conflicts(c) => store.inject_conflicts.set(c),
            }
            let stored = aff.stored_entries();
            prop_assert!(stored as u64 <= max_sessions, "{} entries stored, bound {}", stored, max_sessions);
        }
        // Shared-data keys are bounded by the bucket count whatever the stream.
        prop_assert!(store.keys() as u64 <= aff.buckets());
        let _ = stored_once;
    }
}

// ---------------------------------------------------------------------------------------------
// (d) codecs
// ---------------------------------------------------------------------------------------------

fn finite(range: std::ops::Range<f64>) -> impl Strategy<Value = f64> {
    prop_oneof![range, Just(0.0)]
}

fn breaker() -> impl Strategy<Value = Breaker> {
    (
        prop::sample::select(vec![
            BreakerState::Closed,
            BreakerState::Open,
            BreakerState::HalfOpen,
        ]),
        prop::sample::select(vec![OpenCause::Failures, OpenCause::RateLimited]),
        (
            any::<u32>(),
            any::<u64>(),
            any::<u32>(),
            any::<u32>(),
            any::<u64>(),
            any::<u32>(),
        ),
    )
        .prop_map(
            |(state, cause, (cf, until, admitted, succeeded, last, epoch))| Breaker {
                state,
                cause,
                consecutive_failures: cf,
                open_until_ms: until,
                probes_admitted: admitted,
                probes_succeeded: succeeded,
                last_probe_ms: last,
                epoch,
            },
        )
}

fn endpoint_state() -> impl Strategy<Value = EndpointState> {
    (
        prop::option::of(finite(-1e12..1e12)),
        finite(0.0..1.0),
        (any::<u64>(), any::<u64>(), any::<u32>(), any::<u64>()),
        breaker(),
        (any::<bool>(), any::<u64>()),
        quota(),
        (finite(0.0..1e12), finite(0.0..1e12), any::<u32>()),
    )
        .prop_map(
            |(
                latency_ms,
                success_rate,
                (last, total, in_flight, changed),
                breaker,
                (degraded, degraded_probe_ms),
                quota,
                (prompt, cached, samples),
            )| {
                let mut in_flight_ages = InFlightAges::default();
                in_flight_ages.add(changed, 600_000);
                in_flight_ages.add(last, 1_000);
                EndpointState {
                    latency_ms,
                    // Derived from the drawn values: every field takes varied values.
                    latency_dev_ms: latency_ms.unwrap_or(0.0).abs() / 3.0,
                    degraded_probes: (degraded_probe_ms % 7) as u8,
                    success_rate,
                    last_sample_ms: last,
                    total,
                    in_flight,
                    in_flight_changed_ms: changed,
                    in_flight_ages,
                    breaker,
                    degraded,
                    degraded_probe_ms,
                    degraded_at_ms: degraded_probe_ms / 3,
                    degraded_own_end_ms: degraded_probe_ms / 2,
                    quota,
                    payoff: Payoff {
                        prompt,
                        cached,
                        samples,
                    },
                    slowness: Slowness {
                        log_mean: (prompt % 40.0) - 20.0,
                        log_dev: cached % 10.0,
                        expected_ms: prompt,
                        samples,
                        last_sample_ms: last,
                        last_decode_ms: last / 2,
                        degraded: false,
                    },
                    saturation: match samples % 3 {
                        0 => Saturation::Unknown,
                        1 => Saturation::Room,
                        _ => Saturation::Saturated,
                    },
                }
            },
        )
}

fn quota() -> impl Strategy<Value = Quota> {
    let remaining = prop::option::of(
        (any::<u64>(), any::<u64>())
            .prop_map(|(left, reset_at_ms)| Remaining::new(left, reset_at_ms)),
    );
    (remaining.clone(), remaining).prop_map(|(requests, tokens)| Quota { requests, tokens })
}

fn table() -> impl Strategy<Value = Table> {
    (
        (finite(0.0..1e15), finite(0.0..1e15), any::<u64>()),
        vec((any::<u32>(), endpoint_state()), 0..12),
    )
        .prop_map(|((requests, retries, updated_ms), entries)| Table {
            budget: RetryBudget {
                requests,
                retries,
                updated_ms,
            },
            entries,
            generation: 0,
        })
}

/// Bytes that look like the codecs' formats (right version byte, plausible lengths) more often
/// than uniform noise would, so decoding gets past its first checks.
fn codec_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        vec(any::<u8>(), 0..256),
        (vec(any::<u8>(), 0..400), 0usize..4).prop_map(|(mut b, n)| {
            if let Some(first) = b.first_mut() {
                *first = 1;
            }
            // A small entry count at the table's count position.
            if b.len() >= 29 {
                b[25..29].copy_from_slice(&(n as u32).to_le_bytes());
            }
            b
        }),
        vec(any::<u8>(), 0..8).prop_map(|noise| {
            let mut b = vec![1u8];
            b.extend(std::iter::repeat_n(
                0u8,
                affinity::ENTRY_BYTES * (noise.len() % 4),
            ));
            for (i, x) in noise.iter().enumerate() {
                if let Some(slot) = b.get_mut(1 + i * 7) {
                    *slot = *x;
                }
            }
            b
        }),
    ]
}

proptest! {
    #![proptest_config(props(256))]

    #[test]
    fn table_round_trips(t in table()) {
        let bytes = t.encode();
        prop_assert_eq!(Table::decode(&bytes), Some(t.clone()));
        // Any strict prefix, and any extension, is rejected rather than misread.
        for cut in [0, 1, bytes.len() / 2, bytes.len() - 1] {
            prop_assert_eq!(Table::decode(&bytes[..cut]), None, "prefix of {} bytes decoded", cut);
        }
        let mut longer = bytes.clone();
        longer.push(0);
        prop_assert_eq!(Table::decode(&longer), None);
    }

    #[test]
    fn affinity_buckets_round_trip(entries in vec((any::<u64>(), any::<u32>(), any::<u64>(), any::<u64>()), 0..40)) {
        let entries: Vec<Entry> = entries
            .into_iter()
            .map(|(session, endpoint_id, last_used_ms, placement_key)| Entry { session, endpoint_id, last_used_ms, placement_key, prompt_tokens: endpoint_id ^ 7 })
            .collect();
        let bytes = affinity::encode(&entries);
        prop_assert_eq!(bytes.len(), 1 + entries.len() * affinity::ENTRY_BYTES);
        prop_assert_eq!(affinity::decode(&bytes), Some(entries));
        prop_assert_eq!(affinity::decode(&bytes[..bytes.len() - 1]), None);
    }

    /// Arbitrary bytes never panic a decoder; whatever decodes re-encodes to something that
    /// decodes to the same value (the affinity format is canonical: to the same bytes, but for a
    /// bucket of the previous version, rewritten in the current one).
    #[test]
    fn arbitrary_bytes_never_panic_decoders(bytes in codec_bytes()) {
        if let Some(t) = Table::decode(&bytes) {
            prop_assert_eq!(Table::decode(&t.encode()), Some(t.clone()));
            prop_assert!(t.entries.iter().all(|(_, st)| (0.0..=1.0).contains(&st.success_rate)));
        }
        if let Some(entries) = affinity::decode(&bytes) {
            let again = affinity::encode(&entries);
            // A current bucket is canonical; an older one is rewritten in the current version.
            if bytes.first() == again.first() {
                prop_assert_eq!(&again, &bytes);
            }
            prop_assert_eq!(affinity::decode(&again), Some(entries));
        }
        // Undecodable bytes in the store read as absent: the table is rebuilt, aligned.
        let cfg = Config::from_json(br#"{"endpoints":[{"name":"a","cluster":"a"},{"name":"b","cluster":"b"}]}"#).unwrap();
        let aligned = Table::aligned(Some(&bytes), &cfg);
        prop_assert_eq!(aligned.entries.len(), 2);
        prop_assert_eq!(aligned.entries[0].0, cfg.endpoints[0].id);
        // And the scheduler works on top of such bytes.
        let store = MemStore::new();
        store.set(TABLE_KEY, &bytes, None).unwrap();
        // And in a group key (with a header that decodes, or not).
        store.set(&group_key(0), &bytes, None).unwrap();
        let s = Scheduler::new(&cfg, &store);
        let ex = Exclusions::default();
        let _ = s.pick(&Pick { model: Some("m"), session: Some(1), attempt: 1, exclusions: &ex, nonce: 0, body_bytes: 0 , pin_hint: None, holder: None, prefix: Prefix::NONE, follow_up: false, max_output_tokens: 0 }, 0);
    }
}

// ---------------------------------------------------------------------------------------------
// (e) EWMA
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(props(256))]

    /// Each EWMA value lies within [min, max] of the samples seen so far (up to one rounding
    /// of the convex combination).
    #[test]
    fn ewma_stays_within_its_samples(
        alpha in prop_oneof![Just(1.0), Just(1e-9), 1e-6f64..=1.0],
        samples in vec(prop_oneof![0.0f64..1e7, 0.0f64..10.0, Just(0.0)], 1..200),
    ) {
        let mut ema = None;
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for &s in &samples {
            lo = lo.min(s);
            hi = hi.max(s);
            let v = ewma::update(ema, s, alpha);
            let slack = 4.0 * f64::EPSILON * hi.abs().max(lo.abs());
            prop_assert!(v >= lo - slack && v <= hi + slack, "ewma {} outside [{}, {}] (alpha {})", v, lo, hi, alpha);
            ema = Some(v);
        }
        // With alpha = 1 it is the last sample exactly.
        if alpha == 1.0 {
            prop_assert_eq!(ema, samples.last().copied());
        }
    }

    #[test]
    fn fade_is_a_fraction_that_decreases_with_idle_time(idle in any::<u64>(), more in any::<u64>(), decay in any::<u64>()) {
        let a = ewma::fade(idle, decay);
        let b = ewma::fade(idle.saturating_add(more), decay);
        prop_assert!((0.0..=1.0).contains(&a) && b <= a, "fade({idle}) = {a}, fade(+{more}) = {b}");
    }
}

// ---------------------------------------------------------------------------------------------
// (g) parsers never panic
// ---------------------------------------------------------------------------------------------

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("finite", |x| x.is_finite())
            .prop_map(|x| json!(x)),
        prop_oneof![
            Just("model".to_string()),
            Just("endpoints".to_string()),
            "[a-z_]{0,12}",
            ".{0,12}"
        ]
        .prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        let key = prop_oneof![
            prop::sample::select(vec![
                "model",
                "user",
                "messages",
                "role",
                "content",
                "stream",
                "endpoints",
                "name",
                "cluster",
                "weight",
                "models",
                "disabled",
                "headers",
                "ewma_alpha",
                "half_open_probes",
                "affinity_max_sessions",
            ])
            .prop_map(str::to_string),
            "[a-z_]{1,8}",
        ];
        prop_oneof![
            vec(inner.clone(), 0..6).prop_map(Value::Array),
            vec((key, inner), 0..6).prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// Mutations of a valid body: byte flips, cuts and splices keep most of the JSON structure.
fn mutated(base: &'static [u8]) -> impl Strategy<Value = Vec<u8>> {
    vec((any::<usize>(), any::<u8>(), 0u8..3), 0..6).prop_map(move |edits| {
        let mut b = base.to_vec();
        for (at, byte, kind) in edits {
            let at = at % (b.len() + 1);
            match kind {
                0 => b.insert(at, byte),
                1 if at < b.len() => b[at] = byte,
                _ => b.truncate(at.max(1)),
            }
        }
        b
    })
}

const CHAT: &[u8] = br#"{"model":"gpt-4o","user":"u","stream":true,"messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#;
const CONFIG: &[u8] = br#"{"endpoints":[{"name":"a","cluster":"ca","weight":2,"models":["m"],"headers":{"authorization":"Bearer k"}},{"name":"b","cluster":"cb","disabled":true}],"ewma_alpha":0.5,"half_open_probes":2}"#;

proptest! {
    #![proptest_config(props(256))]

    #[test]
    fn parse_chat_never_panics(
        bytes in prop_oneof![
            vec(any::<u8>(), 0..300),
            "[ \\[\\]{}\":,0-9a-z\\\\.-]{0,200}".prop_map(String::into_bytes),
            mutated(CHAT),
            json_value().prop_map(|v| v.to_string().into_bytes()),
        ],
    ) {
        if let Ok(r) = request::parse_chat(&bytes) {
            prop_assert!(!r.model.is_empty() && r.model.len() <= request::MAX_MODEL_BYTES);
            // Whatever parses can be keyed without panicking.
            let _ = computeflux::scheduler::wire::session::derive_session(Some(b"t"), computeflux::scheduler::wire::session::SessionHeaders::default(), &r, &bytes);
        }
    }

    /// Arbitrary bytes never panic the configuration parser; a configuration it accepts
    /// satisfies the documented bounds, and a rejection always names at least one problem.
    #[test]
    fn config_from_json_never_panics(
        bytes in prop_oneof![
            vec(any::<u8>(), 0..300),
            mutated(CONFIG),
            json_value().prop_map(|v| v.to_string().into_bytes()),
            json_value().prop_map(|v| json!({"endpoints": [v]}).to_string().into_bytes()),
        ],
    ) {
        match Config::from_json(&bytes) {
            Ok(c) => {
                prop_assert!(!c.endpoints.is_empty() && c.endpoints.len() <= 1024);
                prop_assert!(c.ewma_alpha > 0.0 && c.ewma_alpha <= 1.0);
                prop_assert!(c.half_open_probes >= 1 && c.affinity_max_sessions >= 1);
                prop_assert!(c.endpoints.iter().all(|e| e.weight > 0.0 && e.weight.is_finite()));
                let _ = c.summary();
            }
            Err(errors) => prop_assert!(!errors.is_empty()),
        }
    }
}

/// The counterexample the probe-bound property found, as a fixed case: when every CAS retry
/// of a pick loses, the pick must not send a probe whose slot was never stored (each worker
/// losing its races would send one more). A closed endpoint takes the attempt instead; with
/// none, the request cools down.
#[test]
fn cas_exhaustion_never_sends_an_unrecorded_probe() {
    let cfg = Config::from_value(&json!({
        "endpoints": [{"name": "a", "cluster": "ca", "weight": 1000}, {"name": "b", "cluster": "cb", "weight": 0.001}],
        "failure_threshold": 1, "open_ms": 100, "half_open_probes": 1, "cold_start_samples": 0,
    }))
    .unwrap();
    let store = MemStore::new();
    let s = Scheduler::new(&cfg, &store);
    let ex = Exclusions::default();
    let pick = Pick {
        model: Some("m"),
        session: None,
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
    assert_eq!(d.endpoint, 0, "the heavier endpoint first");
    s.finish(
        d.ticket,
        &Outcome::EndpointFailure(FailureKind::Timeout),
        1,
        None,
        0,
    );
    // a is half-open at 100 with one free probe slot, but every write loses its race.
    store.inject_conflicts.set(CAS_RETRIES as u32);
    let d = s.pick(&pick, 100).unwrap();
    assert_eq!(
        (d.endpoint, d.ticket.counted, d.ticket.probe_epoch),
        (1, false, None)
    );
    // b excluded: nothing closed is left, so no attempt at all rather than an unrecorded probe.
    let only_a = Exclusions {
        tried: vec![1],
        ..Exclusions::default()
    };
    store.inject_conflicts.set(CAS_RETRIES as u32);
    let r = s.pick(
        &Pick {
            exclusions: &only_a,
            ..pick
        },
        100,
    );
    assert!(matches!(r, Err(NoEndpoint::CoolingDown { .. })), "{r:?}");
    // Once writes land again, a's probe slot is still free and is taken, recorded.
    let d = s
        .pick(
            &Pick {
                exclusions: &only_a,
                ..pick
            },
            100,
        )
        .unwrap();
    assert_eq!(d.endpoint, 0);
    assert!(d.ticket.counted && d.ticket.probe_epoch.is_some());
}

// ---------------------------------------------------------------------------------------------
// Quota-aware routing
// ---------------------------------------------------------------------------------------------

fn quota_fleet(n: usize) -> Config {
    let endpoints: Vec<Value> = (0..n)
        .map(|i| json!({"name": format!("k{i}"), "cluster": format!("c{i}")}))
        .collect();
    Config::from_value(&json!({ "endpoints": endpoints })).unwrap()
}

/// A header value as a hostile or broken upstream might send it.
fn junk_value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("-1".to_string()),
        Just("1e9".to_string()),
        Just("0x10".to_string()),
        Just("99999999999999999999999".to_string()),
        Just("10000000000001".to_string()),
        Just(" 12 ms".to_string()),
        "[ -~]{0,24}".prop_filter("not a plain count", |s| {
            let t = s.trim();
            t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit())
        }),
    ]
}

proptest! {
    #![proptest_config(props(256))]

    /// An endpoint short of quota never takes a new placement while another candidate is not.
    #[test]
    fn a_key_short_of_quota_is_never_placed_while_another_has_quota(
        quotas in vec((prop::option::of(0u64..4), prop::option::of(0u64..3_000)), 2..6),
        session in prop::option::of(any::<u64>()),
        nonce in any::<u64>(),
        body_bytes in 0usize..8_000,
        now in 0u64..5_000,
    ) {
        let cfg = quota_fleet(quotas.len());
        let store = MemStore::new();
        let mut table = Table::aligned(None, &cfg);
        for ((_, st), (requests, tokens)) in table.entries.iter_mut().zip(&quotas) {
            let remember = |left| Remaining::new(left, 5_000);
            st.quota = Quota { requests: requests.map(remember), tokens: tokens.map(remember) };
        }
        table.write_to(&store);
        let s = Scheduler::new(&cfg, &store);
        let rule = s.quota_rule();
        let estimate = computeflux::scheduler::routing::quota::estimate_tokens(body_bytes, computeflux::scheduler::routing::quota::BYTES_PER_TOKEN);
        let short: Vec<bool> = table.entries.iter().map(|(_, st)| st.quota.short(estimate, &rule, now)).collect();
        let ex = Exclusions::default();
        let d = s.pick(&Pick { model: Some("m"), session, attempt: 1, exclusions: &ex, nonce, body_bytes, pin_hint: None, holder: None, prefix: Prefix::NONE , follow_up: false, max_output_tokens: 0 }, now).unwrap();
        if short.iter().any(|s| !s) {
            prop_assert!(!short[d.endpoint], "placed on short {} of {:?}", d.endpoint, short);
        }
    }

    /// A header value that is not a plain count changes nothing: same table, same placements.
    #[test]
    fn malformed_quota_headers_change_nothing(
        values in vec(junk_value(), 4),
        session in any::<u64>(),
    ) {
        let cfg = quota_fleet(3);
        let names = [
            "x-ratelimit-remaining-requests",
            "x-ratelimit-remaining-tokens",
            "anthropic-ratelimit-requests-remaining",
            "anthropic-ratelimit-tokens-remaining",
        ];
        let headers: Vec<(String, Vec<u8>)> = names
            .iter()
            .zip(&values)
            .map(|(n, v)| (n.to_string(), v.clone().into_bytes()))
            .chain([(":status".to_string(), b"200".to_vec())])
            .collect();
        let hint = computeflux::scheduler::routing::quota::QuotaHint::read(&headers, 0);
        prop_assert!(hint.is_empty());
        let (plain, junk) = (MemStore::new(), MemStore::new());
        let ex = Exclusions::default();
        for (store, h) in [(&plain, Default::default()), (&junk, hint)] {
            let s = Scheduler::new(&cfg, store);
            for t in 0..4 {
                let d = s.pick(&Pick { model: Some("m"), session: Some(session), attempt: 1, exclusions: &ex, nonce: 0, body_bytes: 40 , pin_hint: None, holder: None, prefix: Prefix::NONE, follow_up: false, max_output_tokens: 0 }, t).unwrap();
                s.finish_observed(d.ticket, &Outcome::Success, Some(5), Some(session), &h, t);
            }
        }
        prop_assert_eq!(plain.get(TABLE_KEY).0, junk.get(TABLE_KEY).0);
        prop_assert_eq!(plain.get(&group_key(0)).0, junk.get(&group_key(0)).0);
    }
}

// --- Pin breaking (issues 11, 23): the degraded rule ------------------------------------------

/// A work model warm at the prior's costs (50 ms + 0.2 ms per uncached token).
fn warm_model() -> WorkModel {
    let mut m = WorkModel::default();
    for i in 0..64u64 {
        let prompt = 500 + (i * 97) % 3000;
        m.observe(&Sample {
            streamed: true,
            observed_ms: 50.0 + 0.2 * prompt as f64,
            prompt_tokens: prompt,
            cached_tokens: 0,
            completion_tokens: 0,
            estimated: false,
            decode_ms: None,
        });
    }
    m
}

/// A streamed answer of 1000 uncached tokens that took `ms` to its first byte.
fn work(ms: f64) -> Sample {
    Sample {
        streamed: true,
        observed_ms: ms,
        prompt_tokens: 1000,
        cached_tokens: 0,
        completion_tokens: 0,
        estimated: false,
        decode_ms: None,
    }
}

proptest! {
    #![proptest_config(props(512))]

    /// The degraded rule (issue 23: slowness against the peers' median): never below
    /// `pin_break_ratio` × the peers (or a gap costing less than `pin_break_min_ms`), always
    /// at or above both; and a degraded endpoint stays so between the exit and the entry
    /// thresholds (hysteresis).
    #[test]
    fn degraded_exactly_above_the_threshold_with_hysteresis(
        peers in 0.05f64..20.0,
        ratio_of_peers in 0.0f64..10.0,
        expected_ms in 1.0f64..5_000.0,
    ) {
        let rule = DegradeRule::from_config(&Config::default()); // ratio 3, 50 ms, exit 1.5
        let own = peers * ratio_of_peers;
        let st = |was| Slowness {
            log_mean: own.max(1e-9).ln(),
            log_dev: 0.0,
            expected_ms,
            samples: 20,
            last_sample_ms: 0,
            last_decode_ms: 0,
            degraded: was,
        };
        // The value goes through ln/exp: compare with a relative tolerance at the edges.
        let value = st(false).value().unwrap();
        let ratio = value / peers;
        let gap = (value - peers) * expected_ms;
        let enters = slowness::degraded(&st(false), Some(peers), &rule);
        if ratio >= 3.0 * (1.0 + 1e-9) && gap >= 50.0 * (1.0 + 1e-9) {
            prop_assert!(enters);
        }
        if ratio < 3.0 * (1.0 - 1e-9) || gap < 50.0 * (1.0 - 1e-9) {
            prop_assert!(!enters);
        }
        let stays = slowness::degraded(&st(true), Some(peers), &rule);
        if enters {
            prop_assert!(stays);
        }
        if ratio < 1.5 * (1.0 - 1e-9) || gap < 25.0 * (1.0 - 1e-9) {
            prop_assert!(!stays);
        }
        prop_assert!(!slowness::degraded(&st(true), None, &rule));
    }

    /// No flapping on noise: an endpoint whose samples' slowness scatters around the entry
    /// threshold (all of them above the exit threshold) changes state at most once, from whole
    /// to degraded; one whose samples all stay below the entry threshold never degrades.
    #[test]
    fn noisy_samples_around_the_threshold_never_flap(
        centre in 1.6f64..4.5,
        noise in vec(-0.4f64..0.4, 20..200),
    ) {
        let rule = DegradeRule::from_config(&Config::default());
        let model = warm_model();
        let mut st = Slowness::default();
        let mut flips = 0;
        let mut max_ratio = 0.0f64;
        // Every sample asks for the same work: expected 250 ms (1000 uncached, streamed).
        let expected = model.expected_ms(&work(0.0));
        for n in &noise {
            let ratio = (centre + n).max(1.55);
            max_ratio = max_ratio.max(ratio);
            st.observe(&work(expected * ratio), &model, 0);
            let now = slowness::degraded(&st, Some(1.0), &rule);
            flips += usize::from(now != st.degraded);
            prop_assert!(!st.degraded || now, "left the degraded state with every sample above 1.5x");
            st.degraded = now;
        }
        prop_assert!(flips <= 1);
        if max_ratio < 3.0 {
            prop_assert_eq!(flips, 0);
        }
    }

    /// Cold endpoints never count as degraded, whatever their slowness and attempts in flight.
    #[test]
    fn cold_endpoints_are_never_degraded(
        own in 0.01f64..1_000.0,
        samples in 0u32..20,
        ages in vec(0u64..500_000, 0..6),
        was in any::<bool>(),
    ) {
        let cfg = Config::from_value(&serde_json::json!({
            "endpoints": [{"name":"a","cluster":"a"},{"name":"b","cluster":"b"}],
        })).unwrap(); // cold_start_samples 20
        let now = 1_000_000;
        let mut table = Table::aligned(None, &cfg);
        let slow = |v: f64, samples| Slowness {
            log_mean: v.ln(),
            log_dev: 0.1,
            expected_ms: 1_000.0,
            samples,
            last_sample_ms: 0,
            last_decode_ms: 0,
            degraded: false,
        };
        table.entries[1].1.slowness = slow(1.0, 100);
        let st = &mut table.entries[0].1;
        st.slowness = slow(own, samples);
        st.degraded = was;
        for age in &ages {
            st.start_attempt(now - age, cfg.in_flight_max_age_ms);
        }
        let v = signals::judge(&table, &cfg, 0, None, now);
        prop_assert!(!v.degraded && !v.sticky);
    }
}
