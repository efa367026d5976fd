//! Selection: filter (exclusions) → affinity → score → pick, and recording what happened.
//!
//! Exclusions apply in this order, each counted for diagnostics: disabled; dead keys (401/403
//! earlier in *this* request); used keys (429 earlier in this request); endpoints already tried
//! in this request; model mismatch; breaker not admitting. Dead and used keys live only in the
//! request's [`Exclusions`]: cross-request memory is the breaker and the statistics alone.
//!
//! [`Scheduler::choose`] reads top to bottom in four steps:
//! 1. **board**: what every endpoint may do in this decision — its placement weight (what every
//!    replica sees alike, see [`super::placement`]), its verdicts ([`super::signals`]: degraded
//!    by its slowness for the work against its peers, saturated by its engine's scraped load),
//!    quota, and the breaker's admission of this attempt's candidates;
//! 2. **pin verdict**: a live pin wins, unless staying is a certain 429, its endpoint is
//!    degraded (the pin is broken: `pin_break`), or it is saturated with an expected wait
//!    longer than re-prefilling elsewhere and the session was not moved for that within its
//!    TTL (moved: `saturated`);
//! 3. **placement walk**: the first candidate in the session's weighted rendezvous order that
//!    admits traffic, is not degraded (but for a due probe — the probe decision), not
//!    saturated while another has room, not short of quota, and within its bounded load. The
//!    order is the same on every Envoy replica, so an unpinned session goes to the same home
//!    everywhere, and a failover walks the same order, to the same backup;
//! 4. **settle**: the decision's labels and whether a success pins the session there.
//!
//! Requests without a session are placed the same way on a per-request key, with the full
//! score (in-flight included) as weight. [`Scheduler::finish_observed`] records an attempt, one
//! function per concern (in-flight and watch, success rate, raw latency, slowness, payoff,
//! quota, probe backoff, breaker; then the work model and the affinity).

use crate::scheduler::config::AfterFailover;
use crate::scheduler::config::Config;
use crate::scheduler::health::breaker::{Admission, BreakerConfig, BreakerState};
use crate::scheduler::health::outcome::Outcome;
use crate::scheduler::routing::affinity::{Affinity, MOVES_PREFIX};
use crate::scheduler::routing::ewma;
use crate::scheduler::routing::overdue;
use crate::scheduler::routing::placement;
use crate::scheduler::routing::quota::{estimate_tokens, QuotaHint, QuotaRule};
use crate::scheduler::routing::saturation::{
    keep_pin, EngineLoad, MoveReason, PinCase, Saturation,
};
use crate::scheduler::routing::score::score;
use crate::scheduler::routing::signals::{self, Served, Verdict};
use crate::scheduler::routing::slowness::{self, DegradeRule, Sample, WorkModel};
use crate::scheduler::routing::table::{fastest_warm, EndpointState, Table};
use crate::scheduler::state::store::{update_if, Store};
use crate::scheduler::wire::usage::Usage;

/// The weight of a dead-key (401/403) outcome in the success-rate EWMA, at least.
pub const DEAD_KEY_ALPHA: f64 = 0.5;

/// Shared-data key of the endpoint table.
pub const TABLE_KEY: &str = "computeflux/endpoints";

/// Per-request exclusions; indexes into `Config::endpoints`. Bounded by the endpoint count.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Exclusions {
    pub dead: Vec<usize>,
    pub used: Vec<usize>,
    pub tried: Vec<usize>,
    /// The last attempt was turned away before any work was done (401/403/429): failing over
    /// from it adds no load the fleet did not already carry, so it spends no retry budget.
    /// The budget exists to stop 5xx/timeout storms from multiplying load on the survivors.
    pub retry_free: bool,
}

impl Exclusions {
    /// Notes an attempt on `endpoint` and what its outcome implies for the rest of the request.
    pub fn after_attempt(&mut self, endpoint: usize, outcome: &Outcome) {
        push_unique(&mut self.tried, endpoint);
        self.retry_free = matches!(outcome, Outcome::DeadKey | Outcome::RateLimited { .. });
        match outcome {
            Outcome::DeadKey => push_unique(&mut self.dead, endpoint),
            Outcome::RateLimited { .. } => push_unique(&mut self.used, endpoint),
            _ => {}
        }
    }
}

fn serves_opt(ep: &crate::scheduler::config::EndpointConfig, model: Option<&str>) -> bool {
    model.is_none_or(|m| ep.serves(m))
}

fn push_unique(v: &mut Vec<usize>, i: usize) {
    if !v.contains(&i) {
        v.push(i);
    }
}

/// What is asked of the scheduler for one attempt.
#[derive(Debug, Clone, Copy)]
pub struct Pick<'a> {
    /// The requested model; `None` for requests that carry none (e.g. `GET /v1/models`),
    /// which any endpoint may serve.
    pub model: Option<&'a str>,
    /// The tenant-scoped session key (`hash::session_key`), if the request has a session.
    pub session: Option<u64>,
    /// 1 for the first attempt of a client request, 2.. for failovers (which spend retry budget).
    pub attempt: u32,
    pub exclusions: &'a Exclusions,
    /// Placement key of a request without a session (any value that differs between
    /// requests, e.g. a counter mixed with the clock), so that such requests spread.
    pub nonce: u64,
    /// The request body's size, from which its token cost is estimated (quota-aware routing).
    pub body_bytes: usize,
    /// The endpoint id the request's pin cookie names (`pin_cookie`): where another replica
    /// last placed the session away from its home. Followed like a pin, before this replica's
    /// own (older) memory of the session.
    pub pin_hint: Option<u32>,
}

/// How an endpoint was chosen (the `reason` of the decision metric and log line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The session's live pin.
    AffinityHit,
    /// The first candidate of the rendezvous order: the session's home.
    Home,
    /// A later candidate of the rendezvous order because earlier ones could not serve this
    /// attempt (breaker, exclusion, degraded): the deterministic backup, and every failover.
    Backup,
    /// A later candidate because earlier ones were over their bounded load.
    Spill,
    /// The pinned endpoint was degraded: placed again without it.
    PinBreak,
    /// Admitted as one of a half-open breaker's probes.
    HalfOpenProbe,
    /// A degraded endpoint's periodic probe placement.
    DegradedProbe,
    /// A later candidate because an earlier one was degraded (slow for the work against its
    /// peers; see `slowness`).
    Degraded,
    /// A later candidate because an earlier one was saturated (full by its engine's own queue
    /// or KV cache while others had room; see `saturation`), or a pinned session moved away
    /// from a saturated endpoint whose wait exceeds re-prefilling elsewhere.
    Saturated,
}

impl Reason {
    /// Every reason, in metric order (`computeflux_decisions_total` is defined from it).
    pub const ALL: &'static [Reason] = &[
        Reason::AffinityHit,
        Reason::Home,
        Reason::Backup,
        Reason::Spill,
        Reason::PinBreak,
        Reason::HalfOpenProbe,
        Reason::DegradedProbe,
        Reason::Degraded,
        Reason::Saturated,
    ];

    pub fn label(&self) -> &'static str {
        match self {
            Reason::AffinityHit => "affinity_hit",
            Reason::Home => "home",
            Reason::Backup => "backup",
            Reason::Spill => "spill",
            Reason::PinBreak => "pin_break",
            Reason::HalfOpenProbe => "half_open_probe",
            Reason::DegradedProbe => "degraded_probe",
            Reason::Degraded => "degraded",
            Reason::Saturated => "saturated",
        }
    }
}

/// The session's affinity as seen by the first attempt (the `x-computeflux-affinity` value).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AffinityResult {
    /// Pinned endpoint chosen.
    Hit,
    /// A live pin existed but its endpoint could not serve this attempt.
    Miss,
    /// No live pin: placed at the session's rendezvous home.
    Home,
    /// No live pin and the home could not serve: placed at the next in rendezvous order.
    Backup,
    /// No live pin and the home was over its bounded load: placed at the next within it.
    Spill,
    /// The pinned endpoint was degraded: the pin was broken and the session placed again.
    PinBreak,
    /// The pinned endpoint was saturated with a wait longer than re-prefilling elsewhere: the
    /// session moved (once per TTL).
    Saturated,
    /// The request has no session key.
    None,
}

impl AffinityResult {
    /// Every result, in metric order (`computeflux_affinity_total` is defined from it).
    pub const ALL: &'static [AffinityResult] = &[
        AffinityResult::Hit,
        AffinityResult::Miss,
        AffinityResult::Home,
        AffinityResult::Backup,
        AffinityResult::Spill,
        AffinityResult::PinBreak,
        AffinityResult::Saturated,
        AffinityResult::None,
    ];

    pub fn label(&self) -> &'static str {
        match self {
            AffinityResult::Hit => "hit",
            AffinityResult::Miss => "miss",
            AffinityResult::Home => "home",
            AffinityResult::Backup => "backup",
            AffinityResult::Spill => "spill",
            AffinityResult::PinBreak => "pin_break",
            AffinityResult::Saturated => "saturated",
            AffinityResult::None => "none",
        }
    }
}

/// Proof of an attempt in flight; hand it back to [`Scheduler::finish`] exactly once.
///
/// Move-only (no `Clone`/`Copy`) and consumed by `finish`, so finishing an attempt twice does
/// not compile; only the scheduler makes one (`non_exhaustive`). Dropping one unfinished leaks
/// its in-flight count (until [`crate::scheduler::routing::table::IN_FLIGHT_STALE_MS`]) and its probe slot.
#[derive(Debug, PartialEq, Eq)]
#[non_exhaustive]
#[must_use = "an attempt in flight must be handed back to Scheduler::finish"]
pub struct Ticket {
    pub endpoint: usize,
    pub endpoint_id: u32,
    pub probe_epoch: Option<u32>,
    /// Whether the in-flight increment was stored (false when CAS retries ran out).
    pub counted: bool,
    pub started_ms: u64,
    /// The affinity hit's slot in its endpoint's overdue watch (0: not watched; see `overdue`).
    pub watch_token: u32,
    /// A degraded endpoint's probe placement (a fast answer resets the probe backoff).
    pub degraded_probe: bool,
    /// Whether a success should pin the session here (not for a degraded endpoint's probe, nor,
    /// with `after_failover: return_home`, away from the session's home).
    pub pin_on_success: bool,
    /// Set by the holder before finishing: the usage of the answer of an affinity hit (the
    /// session's pinned endpoint answered its first attempt), folded into the endpoint's
    /// affinity payoff in the finishing write (see `payoff`).
    pub pinned_usage: Option<Usage>,
    /// Set by the holder before finishing a success: what the answer was (streamed or not,
    /// its time, its usage or sizes), judged against the work model (see `signals`).
    pub served: Option<Served>,
}

#[derive(Debug, PartialEq, Eq)]
pub struct Decision {
    pub endpoint: usize,
    pub reason: Reason,
    pub affinity: AffinityResult,
    pub ticket: Ticket,
    /// The endpoint whose pin was broken, if any (for its `pin_breaks` counter).
    pub broke_pin_of: Option<usize>,
    /// The saturated endpoint a pinned session moved away from, if any.
    pub moved_pin_of: Option<usize>,
    /// The session's rendezvous home (the first non-degraded endpoint of its order), if any.
    pub home: Option<usize>,
    /// Endpoints passed over because their quota was short (`quota_aware`): a placement skipped
    /// them, or a pinned session left one for a certain 429 (for their `quota_skips` counter).
    /// At most one entry per endpoint; never the chosen one.
    pub quota_skipped: Vec<usize>,
}

/// What [`Scheduler::choose`] decided, before the attempt is started.
#[derive(Debug, Clone, PartialEq)]
struct Choice {
    endpoint: usize,
    reason: Reason,
    affinity: AffinityResult,
    pin_on_success: bool,
    broke_pin_of: Option<usize>,
    /// The saturated endpoint a pinned session moved away from, if any.
    moved: Option<usize>,
    home: Option<usize>,
    /// The degraded flag and saturation of every weighed endpoint as this choice saw them.
    verdicts: Vec<(usize, bool, Saturation)>,
    /// See [`Decision::quota_skipped`].
    quota_skipped: Vec<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoEndpoint {
    /// No enabled endpoint serves the model at all.
    ModelNotFound,
    /// Every endpoint for the model was already tried (or dead/used) in this request.
    Exhausted,
    /// A failover was wanted but the retry budget is spent.
    BudgetExhausted,
    /// Every remaining candidate's breaker is open; the earliest recovery, and whether all of
    /// them are rate limited (answer 429 rather than 503).
    CoolingDown {
        retry_at_ms: u64,
        all_rate_limited: bool,
    },
}

/// Counts of endpoints dropped by each exclusion, in the order they are applied.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Dropped {
    pub disabled: u32,
    pub dead: u32,
    pub used: u32,
    pub tried: u32,
    pub model: u32,
    pub breaker: u32,
}

/// What [`Scheduler::finish`] did, for metrics and logs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Finished {
    pub breaker_changed: bool,
    pub breaker: BreakerState,
    pub latency_ms: Option<f64>,
    pub in_flight: u32,
    /// False when a CAS retry loop gave up and the update was lost.
    pub stored: bool,
    /// The ticket's endpoint is no longer configured (a configuration reload under the
    /// attempt): there was nothing to record. Not a lost update.
    pub stale: bool,
}

pub struct Scheduler<'a> {
    pub cfg: &'a Config,
    pub store: &'a dyn Store,
}

impl<'a> Scheduler<'a> {
    pub fn new(cfg: &'a Config, store: &'a dyn Store) -> Self {
        Scheduler { cfg, store }
    }

    pub fn affinity(&self) -> Affinity<'a> {
        Affinity::new(
            self.store,
            self.cfg.affinity_ttl_ms,
            self.cfg.affinity_max_sessions,
        )
    }

    /// The move marks (see `affinity::MOVES_PREFIX`).
    pub fn moves(&self) -> Affinity<'a> {
        Affinity::with_prefix(
            self.store,
            MOVES_PREFIX,
            self.cfg.affinity_ttl_ms,
            self.cfg.affinity_max_sessions,
        )
    }

    pub fn breaker_config(&self) -> BreakerConfig {
        BreakerConfig {
            failure_threshold: self.cfg.failure_threshold,
            half_open_probes: self.cfg.half_open_probes,
            open_ms: self.cfg.open_ms,
            rate_limit_ms: self.cfg.rate_limit_ms,
            retry_after_max_ms: self.cfg.retry_after_max_ms,
            probe_stale_ms: self.cfg.failover_timeout_ms.max(self.cfg.open_ms),
        }
    }

    pub fn quota_rule(&self) -> QuotaRule {
        QuotaRule {
            min_requests: self.cfg.quota_min_requests,
            min_tokens: self.cfg.quota_min_tokens,
            reserve_percent: self.cfg.quota_reserve_percent,
            default_reset_ms: self.cfg.rate_limit_ms,
            max_reset_ms: self.cfg.retry_after_max_ms,
            pacing: self.cfg.quota_pacing,
        }
    }

    /// The endpoint table as stored now, aligned to the configuration.
    pub fn table(&self) -> Table {
        Table::aligned(self.store.get(TABLE_KEY).0.as_deref(), self.cfg)
    }

    /// Applies the request-scoped and static exclusions. `Err` when nothing is left.
    pub fn candidates(&self, pick: &Pick<'_>) -> Result<(Vec<usize>, Dropped), NoEndpoint> {
        let mut dropped = Dropped::default();
        let mut out = Vec::with_capacity(self.cfg.endpoints.len());
        let mut serves_model = false;
        let serves =
            |ep: &crate::scheduler::config::EndpointConfig| pick.model.is_none_or(|m| ep.serves(m));
        for (i, ep) in self.cfg.endpoints.iter().enumerate() {
            if ep.disabled {
                dropped.disabled += 1;
            } else if pick.exclusions.dead.contains(&i) {
                dropped.dead += 1;
                serves_model |= serves(ep);
            } else if pick.exclusions.used.contains(&i) {
                dropped.used += 1;
                serves_model |= serves(ep);
            } else if pick.exclusions.tried.contains(&i) {
                dropped.tried += 1;
                serves_model |= serves(ep);
            } else if !serves(ep) {
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

    /// Chooses the endpoint for one attempt and starts it (in-flight +1, probe slot taken).
    pub fn pick(&self, pick: &Pick<'_>, now_ms: u64) -> Result<Decision, NoEndpoint> {
        let (candidates, _) = self.candidates(pick)?;
        let local = pick
            .session
            .and_then(|s| self.affinity().lookup(s, now_ms).map(|id| (s, id)));
        let valid = |id: u32| {
            self.cfg
                .endpoints
                .iter()
                .any(|e| e.id == id && !e.disabled && serves_opt(e, pick.model))
        };
        // A pin to an endpoint that is disabled or no longer serves the model is a hard failure
        // of that pin: evict it so it does not keep costing a lookup.
        let local = match local {
            Some((session, id)) if !valid(id) => {
                self.affinity().forget(session, id);
                None
            }
            other => other,
        };
        // A pin cookie is the client's record of the session's newest place (set by whichever
        // replica served it last away from home): it wins over this replica's memory.
        let hinted = pick.session.and(pick.pin_hint).filter(|&id| valid(id));
        let pinned = hinted.or(local.map(|p| p.1));
        let bcfg = self.breaker_config();
        let loads = signals::engine_loads(self.store, self.cfg, now_ms);
        let result = update_if(self.store, TABLE_KEY, |bytes| {
            let (mut table, same_layout) = Table::load(bytes, self.cfg);
            if pick.attempt > 1
                && !pick.exclusions.retry_free
                && !table.budget.try_retry(
                    now_ms,
                    self.cfg.retry_budget_percent,
                    self.cfg.retry_budget_min_retries,
                )
            {
                return (None, Err(NoEndpoint::BudgetExhausted));
            }
            let choice = match self.choose(&table, &candidates, pick, pinned, &loads, now_ms) {
                Err(e) => return (None, Err(e)),
                Ok(c) => c,
            };
            let i = choice.endpoint;
            // Verdicts that flipped are stored for their hysteresis (rare: a full write).
            let mut others_changed = false;
            for &(j, degraded, saturation) in &choice.verdicts {
                if let Some((_, st)) = table.entries.get_mut(j) {
                    let flipped = store_verdict(st, degraded, saturation, now_ms);
                    others_changed |= flipped && j != i;
                }
            }
            let Some((_, st)) = table.entries.get_mut(i) else {
                return (None, Err(NoEndpoint::Exhausted));
            };
            let probe_epoch = match st.breaker.admit(now_ms, &bcfg) {
                Admission::Probe { epoch } => Some(epoch),
                _ => None,
            };
            if choice.reason == Reason::DegradedProbe {
                st.degraded_probe_ms = now_ms;
                st.degraded_probes = st.degraded_probes.saturating_add(1);
            }
            st.in_flight = st.in_flight.saturating_add(1);
            st.in_flight_changed_ms = now_ms;
            // An affinity hit is watched: still waiting long after it should have been
            // answered, it is early evidence of a slowdown (see `overdue`).
            let watch_token =
                if choice.reason == Reason::AffinityHit && self.cfg.pin_break_overdue > 0 {
                    let t = overdue::token(pick.nonce, pick.attempt);
                    if st.watch.insert(t, now_ms) {
                        t
                    } else {
                        0
                    }
                } else {
                    0
                };
            if self.cfg.quota_aware {
                st.quota.consume(
                    estimate_tokens(pick.body_bytes, self.cfg.quota_bytes_per_token),
                    now_ms,
                );
            }
            if pick.attempt <= 1 {
                table.budget.on_request(now_ms);
            }
            let ticket = Ticket {
                endpoint: i,
                endpoint_id: self.cfg.endpoints.get(i).map_or(0, |e| e.id),
                probe_epoch,
                counted: true,
                started_ms: now_ms,
                watch_token,
                degraded_probe: choice.reason == Reason::DegradedProbe,
                pin_on_success: choice.pin_on_success,
                pinned_usage: None,
                served: None,
            };
            let bytes = match bytes {
                Some(stored) if same_layout && !others_changed => table.encode_patched(stored, i),
                _ => table.encode(),
            };
            (
                Some(bytes),
                Ok(Decision {
                    endpoint: i,
                    reason: choice.reason,
                    affinity: choice.affinity,
                    ticket,
                    broke_pin_of: choice.broke_pin_of,
                    moved_pin_of: choice.moved,
                    home: choice.home,
                    quota_skipped: choice.quota_skipped,
                }),
            )
        });
        let decision = match result {
            Ok(r) => r,
            // CAS kept losing on a half-open probe: its slot was never stored, so sending it
            // could exceed `half_open_probes` (every worker losing races would send one).
            // Decide locally among the endpoints whose breaker is closed.
            Err(Ok(d)) if d.ticket.probe_epoch.is_some() => {
                let table = self.table();
                let closed: Vec<usize> = candidates
                    .iter()
                    .copied()
                    .filter(|&i| {
                        table.entries.get(i).is_some_and(|(_, st)| {
                            st.breaker.peek(now_ms, &bcfg) == Admission::Normal
                        })
                    })
                    .collect();
                if closed.is_empty() {
                    return Err(NoEndpoint::CoolingDown {
                        retry_at_ms: now_ms.saturating_add(1_000),
                        all_rate_limited: false,
                    });
                }
                let c = self.choose(&table, &closed, pick, pinned, &loads, now_ms)?;
                let ticket = Ticket {
                    endpoint: c.endpoint,
                    endpoint_id: self.cfg.endpoints.get(c.endpoint).map_or(0, |e| e.id),
                    probe_epoch: None,
                    counted: false,
                    started_ms: now_ms,
                    watch_token: 0,
                    degraded_probe: false,
                    pin_on_success: c.pin_on_success,
                    pinned_usage: None,
                    served: None,
                };
                Ok(Decision {
                    endpoint: c.endpoint,
                    reason: c.reason,
                    affinity: c.affinity,
                    ticket,
                    broke_pin_of: c.broke_pin_of,
                    moved_pin_of: c.moved,
                    home: c.home,
                    quota_skipped: c.quota_skipped,
                })
            }
            // CAS kept losing: go with the decision, but nothing was stored for it.
            Err(r) => r.map(|mut d| {
                d.ticket.counted = false;
                d.ticket.probe_epoch = None;
                d.ticket.watch_token = 0;
                d
            }),
        };
        // A session moved away from a saturated endpoint is marked, so that it is not moved
        // for that reason again within its TTL.
        if let (Ok(d), Some(s)) = (&decision, pick.session) {
            if d.moved_pin_of.is_some() {
                self.moves()
                    .remember(s, MoveReason::Saturated as u32, now_ms);
            }
        }
        decision
    }

    /// The decision, read-only over a table snapshot, in four named steps (see the module doc):
    /// [`Scheduler::board`] (what every endpoint may do: weights, verdicts, quota, breaker
    /// admission), [`Scheduler::pin_verdict`] (keep, break or move a live pin),
    /// [`Scheduler::walk`] (placement in rendezvous order, with the probe decision), and
    /// [`Scheduler::settle`] (the labels and whether a success pins).
    fn choose(
        &self,
        table: &Table,
        candidates: &[usize],
        pick: &Pick<'_>,
        pinned: Option<u32>,
        loads: &[Option<EngineLoad>],
        now_ms: u64,
    ) -> Result<Choice, NoEndpoint> {
        let bcfg = self.breaker_config();
        let mut board = self.board(table, candidates, pick, loads, now_ms, &bcfg)?;
        let pinned_index = pinned.and_then(|id| self.cfg.endpoint_index(id));
        board.pinned = pinned_index;
        let key = pick.session.unwrap_or(pick.nonce);
        // The session's home: the first non-degraded endpoint of its rendezvous order.
        let home = placement::first(key, &board.weights, |i| !board.degraded(i));
        let mut quota_skipped = Vec::new();
        let pin = self.pin_verdict(
            &board,
            table,
            pick,
            pinned_index,
            now_ms,
            &mut quota_skipped,
        );
        if let PinVerdict::Keep(p) = pin {
            return Ok(Choice {
                endpoint: p,
                reason: Reason::AffinityHit,
                affinity: AffinityResult::Hit,
                pin_on_success: true,
                broke_pin_of: None,
                moved: None,
                home,
                verdicts: board.stored_verdicts(),
                quota_skipped,
            });
        }
        let walked = self.walk(&board, table, key, &pin, pick, now_ms, &mut quota_skipped);
        let (endpoint, reason) = match walked.or_else(|| fallback(&board, key, &pin)) {
            Some(c) => c,
            None => return Err(NoEndpoint::Exhausted),
        };
        Ok(self.settle(
            &board,
            pick,
            pinned_index,
            &pin,
            endpoint,
            reason,
            home,
            quota_skipped,
        ))
    }

    /// Step 1: what every endpoint may do in this decision. Weights and verdicts come from
    /// every endpoint that could serve the request at all, before request exclusions and
    /// breakers, so that a failover walks the first attempt's order; breaker admission is of
    /// this attempt's candidates (`Err` when none admits).
    fn board(
        &self,
        table: &Table,
        candidates: &[usize],
        pick: &Pick<'_>,
        loads: &[Option<EngineLoad>],
        now_ms: u64,
        bcfg: &BreakerConfig,
    ) -> Result<Board, NoEndpoint> {
        let cfg = self.cfg;
        let n = cfg.endpoints.len();
        let state = |i: usize| table.entries.get(i).map(|(_, st)| st);
        let statics: Vec<usize> = (0..n)
            .filter(|&i| {
                cfg.endpoints
                    .get(i)
                    .is_some_and(|e| !e.disabled && serves_opt(e, pick.model))
            })
            .collect();
        let mut verdicts = vec![Verdict::default(); n];
        let references =
            signals::peer_medians(table, cfg, DegradeRule::from_config(cfg).min_samples);
        let mut weights = Vec::with_capacity(statics.len());
        // Requests without a session keep the full score (nothing to keep together).
        let best_latency = fastest_warm(
            statics.iter().filter_map(|&i| state(i)),
            cfg.cold_start_samples,
        );
        for &i in &statics {
            let (Some(ep), Some(st)) = (cfg.endpoints.get(i), state(i)) else {
                continue;
            };
            let load = loads.get(i).copied().flatten();
            if let Some(v) = verdicts.get_mut(i) {
                let reference = references.get(i).copied().flatten();
                *v = signals::judge_with(table, cfg, i, reference, load, now_ms);
            }
            let w = match pick.session {
                Some(_) => placement::weigh(ep.weight, st, cfg, now_ms),
                None => score(ep.weight, st, best_latency, cfg, now_ms).score,
            };
            weights.push((i, ep.id, w));
        }
        // Quota: short endpoints are skipped for placements, a certain 429 even by a pin.
        let estimate = estimate_tokens(pick.body_bytes, cfg.quota_bytes_per_token);
        let rule = self.quota_rule();
        let quota = |i: usize| state(i).filter(|_| cfg.quota_aware).map(|st| st.quota);
        let short = (0..n)
            .map(|i| quota(i).is_some_and(|q| q.short(estimate, &rule, now_ms)))
            .collect();
        let certain_429 = (0..n)
            .map(|i| quota(i).is_some_and(|q| q.certain_429(estimate, now_ms)))
            .collect();
        // The engines' own running + waiting where every candidate reports it (one unit for
        // all: an engine's count includes every replica's requests, an in-flight count only
        // this one's), else this replica's in-flight counts.
        let all_scraped = statics
            .iter()
            .all(|&i| loads.get(i).copied().flatten().is_some());
        let load = (0..n)
            .map(|i| {
                let l = loads.get(i).copied().flatten().filter(|_| all_scraped);
                state(i).map_or(0, |st| signals::placement_load(st, l.as_ref(), now_ms))
            })
            .collect();
        let admission = admit(table, candidates, n, now_ms, bcfg)?;
        let mut weight_at = vec![0.0; n];
        for &(i, _, w) in &weights {
            if let Some(slot) = weight_at.get_mut(i) {
                *slot = w;
            }
        }
        Ok(Board {
            pinned: None,
            statics,
            weights,
            weight_at,
            verdicts,
            short,
            certain_429,
            load,
            admission,
        })
    }

    /// Step 2: what becomes of a live pin. Kept, unless staying is a certain 429 (placed
    /// again, the pin untouched), its endpoint is degraded (the pin is broken), or it is
    /// saturated with a wait longer than re-prefilling elsewhere and the session was not moved
    /// for that reason within its TTL (moved).
    fn pin_verdict(
        &self,
        board: &Board,
        table: &Table,
        pick: &Pick<'_>,
        pinned: Option<usize>,
        now_ms: u64,
        quota_skipped: &mut Vec<usize>,
    ) -> PinVerdict {
        let Some(p) = pinned.filter(|&p| board.admitted(p)) else {
            return PinVerdict::None;
        };
        if board.flag(&board.certain_429, p) {
            quota_skipped.push(p);
            return PinVerdict::None;
        }
        if board.degraded(p) {
            return PinVerdict::Break(p);
        }
        if board.saturated(p)
            && board.room_elsewhere(p)
            && self.saturated_pin_moves(board, table, pick, p, now_ms)
        {
            return PinVerdict::Move(p);
        }
        PinVerdict::Keep(p)
    }

    /// Whether a session pinned to saturated `p` moves: the expected wait there exceeds
    /// re-prefilling its prompt elsewhere (`saturation::keep_pin`), and it was not moved for
    /// saturation within its TTL.
    fn saturated_pin_moves(
        &self,
        board: &Board,
        table: &Table,
        pick: &Pick<'_>,
        p: usize,
        now_ms: u64,
    ) -> bool {
        let Some(load) = board.verdicts.get(p).and_then(|v| v.load) else {
            return false;
        };
        let model = signals::read_model(self.store, &signals::work_key(self.cfg, pick.model));
        if !model.warm() {
            return false;
        }
        let slowness = table
            .entries
            .get(p)
            .and_then(|(_, st)| st.slowness.value())
            .unwrap_or(1.0);
        let case = PinCase {
            waiting: load.waiting,
            slots: load.running.map(|r| r.max(1)),
            service_ms: model.service_ms(TYPICAL_UNCACHED_TOKENS, TYPICAL_COMPLETION_TOKENS)
                * slowness,
            cached_tokens: estimate_tokens(pick.body_bytes, self.cfg.quota_bytes_per_token),
            prefill_ms_per_token: model.prefill_ms_per_token(),
            elsewhere_wait_ms: 0.0,
        };
        if keep_pin(&case) {
            return false;
        }
        // The moves table holds marks younger than the affinity TTL only.
        let marked = pick
            .session
            .and_then(|s| self.moves().lookup(s, now_ms))
            .and_then(move_reason);
        marked != Some(MoveReason::Saturated)
    }

    /// Step 3: placement, the first candidate in rendezvous order that admits traffic, is not
    /// degraded (but for a due probe), not saturated while another has room, not short of
    /// quota, and within its bounded load. `None` when nothing is placeable.
    #[allow(clippy::too_many_arguments)]
    fn walk(
        &self,
        board: &Board,
        table: &Table,
        key: u64,
        pin: &PinVerdict,
        pick: &Pick<'_>,
        now_ms: u64,
        quota_skipped: &mut Vec<usize>,
    ) -> Option<(usize, Reason)> {
        let left = pin.left();
        let order = placement::order(key, &board.weights);
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
            if board.admitted(i) && board.flag(&board.short, i) && !quota_skipped.contains(&i) {
                quota_skipped.push(i);
            }
            if !board.admitted(i) || board.flag(&board.short, i) {
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

    /// The probe decision: a degraded endpoint gets a first attempt of an unpinned session once
    /// its probe interval (with backoff) has passed, if it admits traffic and has quota.
    /// Overdue verdicts are not probed (the hits in flight are probes already).
    fn probe_due(
        &self,
        board: &Board,
        table: &Table,
        i: usize,
        pick: &Pick<'_>,
        now_ms: u64,
    ) -> bool {
        let sticky = board.verdicts.get(i).is_some_and(|v| v.sticky);
        let due = table.entries.get(i).is_some_and(|(_, st)| {
            now_ms.saturating_sub(st.degraded_probe_ms)
                >= placement::probe_interval(self.cfg, st.degraded_probes)
        });
        sticky
            && due
            && board.admitted(i)
            && !board.flag(&board.short, i)
            && pick.attempt <= 1
            && board.pinned.is_none()
    }

    /// Step 4: the labels of the decision and whether a success pins the session there.
    #[allow(clippy::too_many_arguments)]
    fn settle(
        &self,
        board: &Board,
        pick: &Pick<'_>,
        pinned: Option<usize>,
        pin: &PinVerdict,
        endpoint: usize,
        mut reason: Reason,
        home: Option<usize>,
        mut quota_skipped: Vec<usize>,
    ) -> Choice {
        // The pinned endpoint taken after all (nothing else could serve): the pin is kept.
        let kept = Some(endpoint) == pin.left();
        if kept {
            reason = Reason::AffinityHit;
        }
        let broke_pin_of = match pin {
            PinVerdict::Break(p) if !kept => Some(*p),
            _ => None,
        };
        let moved = match pin {
            PinVerdict::Move(p) if !kept => Some(*p),
            _ => None,
        };
        let affinity = match (pick.session, pinned, reason) {
            (None, _, _) => AffinityResult::None,
            (Some(_), _, Reason::AffinityHit) => AffinityResult::Hit,
            (Some(_), _, Reason::PinBreak) => AffinityResult::PinBreak,
            (Some(_), Some(_), Reason::Saturated) if moved.is_some() => AffinityResult::Saturated,
            (Some(_), Some(_), _) => AffinityResult::Miss,
            (Some(_), None, Reason::Home) => AffinityResult::Home,
            (Some(_), None, Reason::Spill) => AffinityResult::Spill,
            (Some(_), None, _) => AffinityResult::Backup,
        };
        if board.probing(endpoint) && reason != Reason::AffinityHit {
            reason = Reason::HalfOpenProbe;
        }
        let pin_on_success = match (reason, self.cfg.after_failover) {
            (Reason::AffinityHit, _) => true,
            // A probe, or a burst that spilled: the session's place stays its home.
            (Reason::DegradedProbe | Reason::Spill, _) => false,
            (_, AfterFailover::Stay) => true,
            (_, AfterFailover::ReturnHome) => Some(endpoint) == home,
        };
        // Nothing else could take it: a short endpoint chosen after all was not skipped.
        quota_skipped.retain(|&i| i != endpoint);
        Choice {
            endpoint,
            reason,
            affinity,
            pin_on_success,
            broke_pin_of,
            moved,
            home,
            verdicts: board.stored_verdicts(),
            quota_skipped,
        }
    }

    /// The first byte of a streamed answer, whose latency sample it is: the attempt stops being
    /// watched for being overdue (its stream may go on for long). One more table write, for
    /// watched attempts only; if it keeps losing the CAS race the finish releases the slot.
    pub fn release_watch(&self, ticket: &mut Ticket) {
        if ticket.watch_token == 0 {
            return;
        }
        let (token, started, id, hint) = (
            ticket.watch_token,
            ticket.started_ms,
            ticket.endpoint_id,
            ticket.endpoint,
        );
        let cfg = self.cfg;
        let result = update_if(self.store, TABLE_KEY, |bytes| {
            let (mut table, same_layout) = Table::load(bytes, cfg);
            let at = table.locate(hint, id);
            let Some((at, (_, st))) = at.and_then(|i| Some((i, table.entries.get_mut(i)?))) else {
                return (None, ());
            };
            if !st.watch.release(token, started) {
                return (None, ());
            }
            let bytes = match bytes {
                Some(stored) if same_layout => table.encode_patched(stored, at),
                _ => table.encode(),
            };
            (Some(bytes), ())
        });
        if result.is_ok() {
            ticket.watch_token = 0;
        }
    }

    /// Records an attempt's outcome: in-flight −1, statistics, breaker, affinity.
    /// `latency_ms` is the time to response headers.
    pub fn finish(
        &self,
        ticket: Ticket,
        outcome: &Outcome,
        latency_ms: u64,
        session: Option<u64>,
        now_ms: u64,
    ) -> Finished {
        self.finish_observed(
            ticket,
            outcome,
            latency_ms,
            session,
            &QuotaHint::default(),
            now_ms,
        )
    }

    /// [`Scheduler::finish`], also remembering the quota a successful answer stated (in the
    /// same write). The bookkeeping is one function per concern, applied to the endpoint's
    /// entry in one table write: [`release`] (in-flight, overdue watch), [`record_success`],
    /// [`record_latency`] (raw EWMA, metrics only), [`record_slowness`], [`record_payoff`],
    /// [`record_quota`], [`record_probe`] (probe backoff), [`record_breaker`]; then the work
    /// model ([`signals::teach`]) and the affinity ([`Scheduler::record_affinity`]).
    pub fn finish_observed(
        &self,
        ticket: Ticket,
        outcome: &Outcome,
        latency_ms: u64,
        session: Option<u64>,
        quota: &QuotaHint,
        now_ms: u64,
    ) -> Finished {
        let cfg = self.cfg;
        let rule = self.quota_rule();
        let bcfg = self.breaker_config();
        let min_samples = DegradeRule::from_config(cfg).min_samples;
        // The answer judged against the work model of its model group (read before the
        // table write; the model changes by one sample in hundreds).
        let served = match outcome {
            Outcome::Success => ticket.served.as_ref(),
            _ => None,
        };
        let judged = served.map(|s| (s.sample(), signals::read_model(self.store, &s.work_key)));
        let result = update_if(self.store, TABLE_KEY, |bytes| {
            let (mut table, same_layout) = Table::load(bytes, cfg);
            // The ticket's endpoint, also if a reload moved it; gone: nothing to record.
            let at = table.locate(ticket.endpoint, ticket.endpoint_id);
            let reference = at.and_then(|i| signals::peer_median(&table, cfg, i, min_samples));
            let Some((at, (_, st))) = at.and_then(|i| Some((i, table.entries.get_mut(i)?))) else {
                return (None, None);
            };
            release(st, &ticket, now_ms);
            record_success(st, outcome, cfg, now_ms);
            record_latency(st, outcome, latency_ms, cfg);
            let ratio = judged
                .as_ref()
                .and_then(|(sample, model)| record_slowness(st, sample, model, now_ms));
            record_payoff(st, outcome, &ticket, cfg);
            record_quota(st, outcome, quota, &rule, cfg, now_ms);
            record_probe(st, &ticket, ratio, reference, cfg);
            let changed = record_breaker(st, outcome, &ticket, now_ms, &bcfg);
            let report = Finished {
                breaker_changed: changed,
                breaker: st.breaker.state_at(now_ms),
                latency_ms: st.latency_ms,
                in_flight: st.in_flight,
                stored: true,
                stale: false,
            };
            let degraded = st.degraded;
            let bytes = match bytes {
                Some(stored) if same_layout => table.encode_patched(stored, at),
                _ => table.encode(),
            };
            (Some(bytes), Some((report, degraded)))
        });
        let (mut report, degraded) = match result {
            Ok(r) => r,
            Err(r) => r.map(|(mut f, d)| {
                f.stored = false;
                (f, d)
            }),
        }
        .unwrap_or((
            Finished {
                breaker_changed: false,
                breaker: BreakerState::Closed,
                latency_ms: None,
                in_flight: 0,
                stored: true,
                stale: true,
            },
            true,
        ));
        // The fleet's yardstick learns from endpoints that are not degraded only.
        if let (Some(s), Some((sample, _)), false) = (served, &judged, degraded) {
            signals::teach(self.store, &s.work_key, sample);
        }
        report.stored &= self.record_affinity(&ticket, outcome, session, now_ms);
        report
    }

    /// The session's pin after an attempt: a success pins it (unless the ticket says not), a
    /// dead key drops a pin to that endpoint. False when a CAS retry loop gave up.
    fn record_affinity(
        &self,
        ticket: &Ticket,
        outcome: &Outcome,
        session: Option<u64>,
        now_ms: u64,
    ) -> bool {
        let Some(s) = session else {
            return true;
        };
        let aff = self.affinity();
        match outcome {
            Outcome::Success if ticket.pin_on_success => {
                aff.remember(s, ticket.endpoint_id, now_ms)
            }
            Outcome::DeadKey => aff.forget(s, ticket.endpoint_id),
            _ => true,
        }
    }
}

/// In-flight −1 (if the pick counted it) and the overdue watch released.
fn release(st: &mut EndpointState, ticket: &Ticket, now_ms: u64) {
    if ticket.counted {
        st.in_flight = st.in_flight.saturating_sub(1);
        st.in_flight_changed_ms = now_ms;
    }
    st.watch.release(ticket.watch_token, ticket.started_ms);
}

/// The success-rate EWMA and the verdict count (cold start).
fn record_success(st: &mut EndpointState, outcome: &Outcome, cfg: &Config, now_ms: u64) {
    let verdict = match outcome {
        Outcome::Success => Some(1.0),
        Outcome::DeadKey | Outcome::RateLimited { .. } | Outcome::EndpointFailure(_) => Some(0.0),
        Outcome::ClientError | Outcome::Cancelled => None,
    };
    if !matches!(outcome, Outcome::Cancelled) {
        st.total = st.total.saturating_add(1);
    }
    let Some(v) = verdict else {
        return;
    };
    // Fold in the fading of the idle penalty first, then the new sample.
    let idle_fade = ewma::fade(now_ms.saturating_sub(st.last_sample_ms), cfg.stats_decay_ms);
    let faded = 1.0 - (1.0 - st.success_rate) * idle_fade;
    // A 401/403 is deterministic (the key is dead), not a flaky sample: it weighs at least
    // DEAD_KEY_ALPHA, so a dead key stops winning first attempts after a couple of requests.
    let alpha = match outcome {
        Outcome::DeadKey => cfg.success_rate_alpha.max(DEAD_KEY_ALPHA),
        _ => cfg.success_rate_alpha,
    };
    st.success_rate = ewma::update(Some(faded), v, alpha).clamp(0.0, 1.0);
    st.last_sample_ms = now_ms;
}

/// The raw latency EWMA and its mean deviation: for metrics and the score of requests without
/// a session only (raw samples mix unlike work; see `slowness`).
fn record_latency(st: &mut EndpointState, outcome: &Outcome, latency_ms: u64, cfg: &Config) {
    if !matches!(outcome, Outcome::Success) {
        return;
    }
    let sample = latency_ms as f64;
    if let Some(prev) = st.latency_ms {
        st.latency_dev_ms = ewma::update(
            Some(st.latency_dev_ms),
            (sample - prev).abs(),
            ewma::DEVIATION_ALPHA,
        );
    }
    st.latency_ms = Some(ewma::update(st.latency_ms, sample, cfg.ewma_alpha));
}

/// The endpoint's slowness, from a successful answer judged against the work model. Returns
/// the sample's unclamped ratio (observed ÷ expected), `None` while the model is cold.
fn record_slowness(
    st: &mut EndpointState,
    sample: &Sample,
    model: &WorkModel,
    now_ms: u64,
) -> Option<f64> {
    st.slowness.observe(sample, model, now_ms)?;
    Some(sample.observed_ms.max(slowness::FLOOR_MS) / model.expected_ms(sample))
}

/// The affinity payoff, from the usage of an affinity hit's answer.
fn record_payoff(st: &mut EndpointState, outcome: &Outcome, ticket: &Ticket, cfg: &Config) {
    if let (Outcome::Success, Some(u)) = (outcome, &ticket.pinned_usage) {
        st.payoff.observe(u, cfg.payoff_min_prompt_tokens);
    }
}

/// The quota a successful answer stated (`quota_aware`).
fn record_quota(
    st: &mut EndpointState,
    outcome: &Outcome,
    quota: &QuotaHint,
    rule: &QuotaRule,
    cfg: &Config,
    now_ms: u64,
) {
    if matches!(outcome, Outcome::Success) && cfg.quota_aware {
        st.quota.observe(quota, rule, now_ms);
    }
}

/// Probe backoff: a degraded endpoint's probe whose answer was fast for its work (its ratio
/// below `degraded_exit_ratio` × the peers' median slowness) resets the probe interval.
fn record_probe(
    st: &mut EndpointState,
    ticket: &Ticket,
    ratio: Option<f64>,
    reference: Option<f64>,
    cfg: &Config,
) {
    let fast = match (ratio, reference) {
        (Some(r), Some(peers)) => r < cfg.degraded_exit_ratio * peers,
        _ => false,
    };
    if ticket.degraded_probe && fast {
        // Recovering: probe at the base interval again.
        st.degraded_probes = 0;
    }
}

/// The breaker; returns whether its state changed.
fn record_breaker(
    st: &mut EndpointState,
    outcome: &Outcome,
    ticket: &Ticket,
    now_ms: u64,
    bcfg: &BreakerConfig,
) -> bool {
    let changed = st.breaker.record(outcome, ticket.probe_epoch, now_ms, bcfg);
    if changed && st.breaker.state == BreakerState::Closed {
        // All probes succeeded: the endpoint has genuinely recovered.
        st.success_rate = 1.0;
    }
    changed
}

/// Stores a verdict that flipped for its hysteresis; returns whether anything changed. A newly
/// degraded endpoint gets its first probe one interval later.
fn store_verdict(
    st: &mut EndpointState,
    degraded: bool,
    saturation: Saturation,
    now_ms: u64,
) -> bool {
    let mut changed = false;
    if st.degraded != degraded {
        st.degraded = degraded;
        st.degraded_probes = 0;
        if degraded {
            st.degraded_probe_ms = now_ms;
        }
        changed = true;
    }
    if st.saturation != saturation {
        st.saturation = saturation;
        changed = true;
    }
    changed
}

/// A typical request, for the mean service time of a saturated engine's queue in
/// [`saturation::keep_pin`]: 1000 uncached prompt tokens and 128 completion tokens (a
/// judgement: the requests ahead in the queue are other sessions', of unknown size).
pub const TYPICAL_UNCACHED_TOKENS: u64 = 1000;
pub const TYPICAL_COMPLETION_TOKENS: u64 = 128;

/// What one decision knows of every endpoint (indexes into `Config::endpoints`).
struct Board {
    /// The request's pinned endpoint, if any (even one that cannot serve it now).
    pinned: Option<usize>,
    /// Endpoints that could serve the request at all (enabled, serving its model).
    statics: Vec<usize>,
    /// `(index, endpoint id, placement weight)` of the statics: the rendezvous candidates.
    weights: Vec<(usize, u32, f64)>,
    /// The same weights by endpoint index (0 for the others): an O(1) look-up in the walk.
    weight_at: Vec<f64>,
    verdicts: Vec<Verdict>,
    /// Short of quota for this request (`quota_aware`).
    short: Vec<bool>,
    /// Staying there is a certain 429.
    certain_429: Vec<bool>,
    /// The load bounded-load placement weighs (see `signals::placement_load`).
    load: Vec<u32>,
    /// Breaker admission of this attempt's candidates (`None`: not a candidate).
    admission: Vec<Option<Admission>>,
}

impl Board {
    fn flag(&self, v: &[bool], i: usize) -> bool {
        v.get(i).copied().unwrap_or(false)
    }
    fn load_of(&self, i: usize) -> u32 {
        self.load.get(i).copied().unwrap_or(0)
    }
    fn weight(&self, i: usize) -> f64 {
        self.weight_at.get(i).copied().unwrap_or(0.0)
    }
    fn degraded(&self, i: usize) -> bool {
        self.verdicts.get(i).is_some_and(|v| v.degraded)
    }
    fn saturated(&self, i: usize) -> bool {
        self.verdicts.get(i).is_some_and(Verdict::saturated)
    }
    fn admitted(&self, i: usize) -> bool {
        matches!(
            self.admission.get(i).copied().flatten(),
            Some(Admission::Normal | Admission::Probe { .. })
        )
    }
    fn probing(&self, i: usize) -> bool {
        matches!(
            self.admission.get(i).copied().flatten(),
            Some(Admission::Probe { .. })
        )
    }
    /// Whether some candidate other than `i` could take a new session and is not saturated:
    /// only then is a saturated endpoint passed over (all full: placed as without metrics).
    fn room_elsewhere(&self, i: usize) -> bool {
        self.statics.iter().any(|&j| {
            j != i
                && self.admitted(j)
                && !self.degraded(j)
                && !self.flag(&self.short, j)
                && !self.saturated(j)
        })
    }
    /// The verdicts to store for their hysteresis: `(index, degraded, saturation)`.
    fn stored_verdicts(&self) -> Vec<(usize, bool, Saturation)> {
        self.statics
            .iter()
            .filter_map(|&i| self.verdicts.get(i).map(|v| (i, v.sticky, v.saturation)))
            .collect()
    }
}

/// Breaker admission of `candidates`; `Err(CoolingDown)` when none admits.
fn admit(
    table: &Table,
    candidates: &[usize],
    n: usize,
    now_ms: u64,
    bcfg: &BreakerConfig,
) -> Result<Vec<Option<Admission>>, NoEndpoint> {
    let mut admission: Vec<Option<Admission>> = vec![None; n];
    let mut retry_at = u64::MAX;
    let mut all_rate_limited = true;
    let mut any_admitted = false;
    for &i in candidates {
        let Some((_, st)) = table.entries.get(i) else {
            continue;
        };
        let a = st.breaker.peek(now_ms, bcfg);
        match a {
            Admission::Rejected {
                retry_at_ms,
                rate_limited,
            } => {
                retry_at = retry_at.min(retry_at_ms);
                all_rate_limited &= rate_limited;
            }
            _ => any_admitted = true,
        }
        if let Some(slot) = admission.get_mut(i) {
            *slot = Some(a);
        }
    }
    if !any_admitted {
        return Err(NoEndpoint::CoolingDown {
            retry_at_ms: retry_at,
            all_rate_limited,
        });
    }
    Ok(admission)
}

/// Nothing placeable by the walk: only degraded or left endpoints admit traffic. The first
/// other one in order (a backup), else the pinned endpoint after all.
fn fallback(board: &Board, key: u64, pin: &PinVerdict) -> Option<(usize, Reason)> {
    let left = pin.left();
    placement::order(key, &board.weights)
        .into_iter()
        .find(|&i| board.admitted(i) && Some(i) != left)
        .map(|i| (i, Reason::Backup))
        .or_else(|| left.map(|i| (i, Reason::AffinityHit)))
}

/// What becomes of a live pin ([`Scheduler::pin_verdict`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PinVerdict {
    /// No pin, or one that cannot serve this attempt (placed as a new session).
    None,
    Keep(usize),
    /// Degraded: the pin is broken.
    Break(usize),
    /// Saturated with a long wait: the session moves.
    Move(usize),
}

impl PinVerdict {
    /// The pinned endpoint the session leaves, if any.
    fn left(&self) -> Option<usize> {
        match self {
            PinVerdict::Break(p) | PinVerdict::Move(p) => Some(*p),
            _ => None,
        }
    }
}

/// What the placement walk passed over before its choice.
#[derive(Debug, Default)]
struct Passed {
    /// Breaker, exclusion or quota (or the pin left).
    unavailable: bool,
    degraded: bool,
    saturated: bool,
    /// The first candidate over its bounded load.
    spilled: Option<usize>,
}

impl Passed {
    fn reason(&self, pin: &PinVerdict, attempt: u32) -> Reason {
        match pin {
            PinVerdict::Break(_) => Reason::PinBreak,
            PinVerdict::Move(_) => Reason::Saturated,
            _ if attempt > 1 || self.unavailable => Reason::Backup,
            _ if self.degraded => Reason::Degraded,
            _ if self.saturated => Reason::Saturated,
            _ if self.spilled.is_some() => Reason::Spill,
            _ => Reason::Home,
        }
    }
}

/// The reason of a stored move mark (`Affinity` entry's endpoint field in the moves table).
fn move_reason(code: u32) -> Option<MoveReason> {
    match code {
        1 => Some(MoveReason::Saturated),
        2 => Some(MoveReason::Degraded),
        _ => None,
    }
}

#[cfg(test)]
mod tests;
