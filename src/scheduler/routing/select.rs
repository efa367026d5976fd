//! Selection: filter (exclusions) → affinity → score → pick, and recording what happened.
//!
//! Exclusions apply in this order, each counted for diagnostics: disabled; dead keys (401/403
//! earlier in *this* request); used keys (429 earlier in this request); endpoints already tried
//! in this request; model mismatch; breaker not admitting. Dead and used keys live only in the
//! request's [`Exclusions`]: cross-request memory is the breaker and the statistics alone.
//!
//! Among the remaining candidates a live affinity pin wins, unless its endpoint is degraded
//! (far slower than the fastest alternative: the pin is broken and the session placed again).
//! Otherwise the session is *placed* ([`crate::scheduler::routing::placement`]): the first candidate in its weighted
//! rendezvous order that admits traffic and is within its bounded load. The order is the same on
//! every Envoy replica, so an unpinned session (a new one, or one that reaches a replica that
//! never saw it, or a restarted one) goes to the same home everywhere, and a failover walks the
//! same order, to the same backup. Requests without a session are placed the same way on a
//! per-request key, with the full score (in-flight included) as weight.

use crate::scheduler::config::AfterFailover;
use crate::scheduler::config::Config;
use crate::scheduler::health::breaker::{Admission, BreakerConfig, BreakerState};
use crate::scheduler::health::outcome::Outcome;
use crate::scheduler::routing::affinity::Affinity;
use crate::scheduler::routing::ewma;
use crate::scheduler::routing::overdue;
use crate::scheduler::routing::placement::{self, Weighed};
use crate::scheduler::routing::quota::{estimate_tokens, QuotaHint, QuotaRule};
use crate::scheduler::routing::ewma::LATENCY_FLOOR_MS;
use crate::scheduler::routing::score::score;
use crate::scheduler::routing::table::{fastest_warm, Table};
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
}

#[derive(Debug, PartialEq, Eq)]
pub struct Decision {
    pub endpoint: usize,
    pub reason: Reason,
    pub affinity: AffinityResult,
    pub ticket: Ticket,
    /// The endpoint whose pin was broken, if any (for its `pin_breaks` counter).
    pub broke_pin_of: Option<usize>,
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
    home: Option<usize>,
    /// The degraded flag of every weighed endpoint as this choice saw it (index, flag).
    degraded: Vec<(usize, bool)>,
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
            let choice = match self.choose(&table, &candidates, pick, pinned, now_ms, &bcfg) {
                Err(e) => return (None, Err(e)),
                Ok(c) => c,
            };
            let i = choice.endpoint;
            // Degraded flags that flipped are stored for their hysteresis (rare: a full write).
            let mut others_changed = false;
            for &(j, flag) in &choice.degraded {
                if let Some((_, st)) = table.entries.get_mut(j) {
                    if st.degraded != flag {
                        st.degraded = flag;
                        st.degraded_probes = 0;
                        if flag {
                            // The first probe comes one interval after the degradation.
                            st.degraded_probe_ms = now_ms;
                        }
                        others_changed |= j != i;
                    }
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
                    home: choice.home,
                    quota_skipped: choice.quota_skipped,
                }),
            )
        });
        match result {
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
                let c = self.choose(&table, &closed, pick, pinned, now_ms, &bcfg)?;
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
                };
                Ok(Decision {
                    endpoint: c.endpoint,
                    reason: c.reason,
                    affinity: c.affinity,
                    ticket,
                    broke_pin_of: c.broke_pin_of,
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
        }
    }

    /// The decision, read-only over a table snapshot: pin (or pin break), else placement in
    /// rendezvous order (see the module doc and [`crate::scheduler::routing::placement`]).
    fn choose(
        &self,
        table: &Table,
        candidates: &[usize],
        pick: &Pick<'_>,
        pinned: Option<u32>,
        now_ms: u64,
        bcfg: &BreakerConfig,
    ) -> Result<Choice, NoEndpoint> {
        let cfg = self.cfg;
        let n = cfg.endpoints.len();
        let state = |i: usize| table.entries.get(i).map(|(_, st)| st);
        // Weights come from every endpoint that could serve this request at all, before
        // request exclusions and breakers: a failover then walks the first attempt's order.
        let statics: Vec<usize> = (0..n)
            .filter(|&i| {
                cfg.endpoints
                    .get(i)
                    .is_some_and(|e| !e.disabled && serves_opt(e, pick.model))
            })
            .collect();
        let best_latency = fastest_warm(
            statics.iter().filter_map(|&i| state(i)),
            cfg.cold_start_samples,
        );
        let mut weighed: Vec<Option<Weighed>> = vec![None; n];
        for &i in &statics {
            if let (Some(ep), Some(st)) = (cfg.endpoints.get(i), state(i)) {
                let mut w = placement::weigh(ep.weight, st, best_latency, cfg, now_ms);
                if pick.session.is_none() {
                    // No session to keep together: the full score, in-flight included.
                    w.weight = score(ep.weight, st, best_latency, cfg, now_ms).score;
                }
                if let Some(slot) = weighed.get_mut(i) {
                    *slot = Some(w);
                }
            }
        }
        let weight_of = |i: usize| weighed.get(i).copied().flatten();
        let is_degraded = |i: usize| weight_of(i).is_some_and(|w| w.degraded);
        // Stored for its hysteresis: the estimate's verdict, not the transient overdue one.
        let sticky = |i: usize| weight_of(i).is_some_and(|w| w.sticky);
        let degraded: Vec<(usize, bool)> = statics.iter().map(|&i| (i, sticky(i))).collect();
        // Quota: short endpoints are skipped for placements, a certain 429 even by a pin.
        let estimate = estimate_tokens(pick.body_bytes, cfg.quota_bytes_per_token);
        let rule = self.quota_rule();
        let quota = |i: usize| state(i).filter(|_| cfg.quota_aware).map(|st| st.quota);
        let short = |i: usize| quota(i).is_some_and(|q| q.short(estimate, &rule, now_ms));
        let certain_429 = |i: usize| quota(i).is_some_and(|q| q.certain_429(estimate, now_ms));
        // Endpoints that would have been taken but for their quota (at most one entry each).
        let mut quota_skipped: Vec<usize> = Vec::new();

        // Breaker admission of this attempt's candidates.
        let mut admission: Vec<Option<Admission>> = vec![None; n];
        let mut retry_at = u64::MAX;
        let mut all_rate_limited = true;
        let mut any_admitted = false;
        for &i in candidates {
            let Some(st) = state(i) else { continue };
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
        let admitted = |i: usize| {
            matches!(
                admission.get(i).copied().flatten(),
                Some(Admission::Normal | Admission::Probe { .. })
            )
        };
        let probing = |i: usize| {
            matches!(
                admission.get(i).copied().flatten(),
                Some(Admission::Probe { .. })
            )
        };

        // The session's home: the first non-degraded endpoint of its rendezvous order.
        let key = pick.session.unwrap_or(pick.nonce);
        let weights: Vec<(usize, u32, f64)> = statics
            .iter()
            .filter_map(|&i| Some((i, cfg.endpoints.get(i)?.id, weight_of(i)?.weight)))
            .collect();
        let home = placement::first(key, &weights, |i| !is_degraded(i));

        // A live pin wins, unless its endpoint is degraded.
        let pinned_index = pinned.and_then(|id| cfg.endpoint_index(id));
        let mut broke_pin_of = None;
        if let Some(p) = pinned_index.filter(|&p| admitted(p) && certain_429(p)) {
            quota_skipped.push(p);
        }
        if let Some(p) = pinned_index.filter(|&p| admitted(p) && !certain_429(p)) {
            if is_degraded(p) {
                broke_pin_of = Some(p);
            } else {
                return Ok(Choice {
                    endpoint: p,
                    reason: Reason::AffinityHit,
                    affinity: AffinityResult::Hit,
                    pin_on_success: true,
                    broke_pin_of: None,
                    home,
                    degraded,
                    quota_skipped,
                });
            }
        }

        // Placement: the first candidate in rendezvous order that admits traffic, is not
        // degraded (but for a due probe) and is within its bounded load.
        let order = placement::order(key, &weights);
        let eligible = |i: usize| admitted(i) && !is_degraded(i);
        let (total_load, total_weight) =
            order
                .iter()
                .filter(|&&i| eligible(i))
                .fold((0u64, 0.0f64), |(l, w), &i| {
                    (
                        l + u64::from(state(i).map_or(0, |st| st.load(now_ms))),
                        w + weight_of(i).map_or(0.0, |x| x.weight),
                    )
                });
        let mut chosen: Option<(usize, Reason)> = None;
        let mut spilled: Option<usize> = None;
        let mut unavailable_before = false;
        for &i in &order {
            if Some(i) == broke_pin_of {
                unavailable_before = true;
                continue;
            }
            if is_degraded(i) {
                // Probes only once the estimate says so: overdue hits in flight are probes
                // already.
                let due = sticky(i)
                    && state(i).is_some_and(|st| {
                        now_ms.saturating_sub(st.degraded_probe_ms)
                            >= placement::probe_interval(cfg, st.degraded_probes)
                    });
                if due && admitted(i) && !short(i) && pick.attempt <= 1 && pinned_index.is_none() {
                    chosen = Some((i, Reason::DegradedProbe));
                    break;
                }
                unavailable_before = true;
                continue;
            }
            if admitted(i) && short(i) && !quota_skipped.contains(&i) {
                quota_skipped.push(i);
            }
            if !admitted(i) || short(i) {
                unavailable_before = true;
                continue;
            }
            let load = f64::from(state(i).map_or(0, |st| st.load(now_ms)));
            let w = weight_of(i).map_or(0.0, |x| x.weight);
            if load + 1.0 > placement::load_limit(total_load, w, total_weight, cfg) {
                spilled.get_or_insert(i);
                continue;
            }
            let reason = if broke_pin_of.is_some() {
                Reason::PinBreak
            } else if pick.attempt > 1 || unavailable_before {
                Reason::Backup
            } else if spilled.is_some() {
                Reason::Spill
            } else {
                Reason::Home
            };
            chosen = Some((i, reason));
            break;
        }
        // Nothing placeable: over-bound (impossible with slack >= 1), else only degraded
        // endpoints admit traffic: the first of them in order, the broken pin last.
        let (endpoint, mut reason) = match chosen {
            Some(c) => c,
            None => match spilled
                .map(|i| (i, Reason::Spill))
                .or_else(|| {
                    order
                        .iter()
                        .copied()
                        .find(|&i| admitted(i) && Some(i) != broke_pin_of)
                        .map(|i| (i, Reason::Backup))
                })
                .or_else(|| broke_pin_of.map(|i| (i, Reason::AffinityHit)))
            {
                Some(c) => c,
                None => return Err(NoEndpoint::Exhausted),
            },
        };
        if reason == Reason::AffinityHit {
            // The pinned endpoint is degraded but nothing else can serve: keep the pin.
            broke_pin_of = None;
        }
        let affinity = match (pick.session, pinned_index, reason) {
            (None, _, _) => AffinityResult::None,
            (Some(_), _, Reason::AffinityHit) => AffinityResult::Hit,
            (Some(_), _, Reason::PinBreak) => AffinityResult::PinBreak,
            (Some(_), Some(_), _) => AffinityResult::Miss,
            (Some(_), None, Reason::Home) => AffinityResult::Home,
            (Some(_), None, Reason::Spill) => AffinityResult::Spill,
            (Some(_), None, _) => AffinityResult::Backup,
        };
        if probing(endpoint) && reason != Reason::AffinityHit {
            reason = Reason::HalfOpenProbe;
        }
        let pin_on_success = match (reason, cfg.after_failover) {
            (Reason::AffinityHit, _) => true,
            // A probe, or a burst that spilled: the session's place stays its home.
            (Reason::DegradedProbe | Reason::Spill, _) => false,
            (_, AfterFailover::Stay) => true,
            (_, AfterFailover::ReturnHome) => Some(endpoint) == home,
        };
        // Nothing else could take it: a short endpoint chosen after all was not skipped.
        quota_skipped.retain(|&i| i != endpoint);
        Ok(Choice {
            endpoint,
            reason,
            affinity,
            pin_on_success,
            broke_pin_of,
            home,
            degraded,
            quota_skipped,
        })
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
    /// same write).
    pub fn finish_observed(
        &self,
        ticket: Ticket,
        outcome: &Outcome,
        latency_ms: u64,
        session: Option<u64>,
        quota: &QuotaHint,
        now_ms: u64,
    ) -> Finished {
        let rule = self.quota_rule();
        let bcfg = self.breaker_config();
        let cfg = self.cfg;
        let result = update_if(self.store, TABLE_KEY, |bytes| {
            let (mut table, same_layout) = Table::load(bytes, cfg);
            // The ticket's endpoint, also if a reload moved it; gone: nothing to record.
            let at = table.locate(ticket.endpoint, ticket.endpoint_id);
            // A degraded endpoint's probe is judged against the fastest of the others.
            let fastest_other = if ticket.degraded_probe {
                let others = table.entries.iter().enumerate();
                fastest_warm(
                    others.filter(|(j, _)| Some(*j) != at).map(|(_, (_, o))| o),
                    cfg.cold_start_samples,
                )
            } else {
                None
            };
            let Some((at, (_, st))) = at.and_then(|i| Some((i, table.entries.get_mut(i)?))) else {
                return (None, None);
            };
            if ticket.counted {
                st.in_flight = st.in_flight.saturating_sub(1);
                st.in_flight_changed_ms = now_ms;
            }
            st.watch.release(ticket.watch_token, ticket.started_ms);
            let verdict = match outcome {
                Outcome::Success => Some(1.0),
                Outcome::DeadKey | Outcome::RateLimited { .. } | Outcome::EndpointFailure(_) => {
                    Some(0.0)
                }
                Outcome::ClientError => None,
                Outcome::Cancelled => None,
            };
            if !matches!(outcome, Outcome::Cancelled) {
                st.total = st.total.saturating_add(1);
            }
            if let Some(v) = verdict {
                // Fold in the fading of the idle penalty first, then the new sample.
                let idle_fade =
                    ewma::fade(now_ms.saturating_sub(st.last_sample_ms), cfg.stats_decay_ms);
                let faded = 1.0 - (1.0 - st.success_rate) * idle_fade;
                // A 401/403 is deterministic (the key is dead), not a flaky sample: it weighs
                // at least DEAD_KEY_ALPHA, so a dead key stops winning first attempts after a
                // couple of requests instead of a dozen.
                let alpha = match outcome {
                    Outcome::DeadKey => cfg.success_rate_alpha.max(DEAD_KEY_ALPHA),
                    _ => cfg.success_rate_alpha,
                };
                st.success_rate = ewma::update(Some(faded), v, alpha).clamp(0.0, 1.0);
                st.last_sample_ms = now_ms;
            }
            if let (Outcome::Success, Some(u)) = (outcome, &ticket.pinned_usage) {
                st.payoff.observe(u, cfg.payoff_min_prompt_tokens);
            }
            if matches!(outcome, Outcome::Success) && cfg.quota_aware {
                st.quota.observe(quota, &rule, now_ms);
            }
            if matches!(outcome, Outcome::Success) {
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
            let fast_probe = ticket.degraded_probe
                && matches!(outcome, Outcome::Success)
                && fastest_other.is_some_and(|best| {
                    (latency_ms as f64) < cfg.degraded_exit_ratio * best.max(LATENCY_FLOOR_MS)
                });
            if fast_probe {
                // Recovering: probe at the base interval again.
                st.degraded_probes = 0;
            }
            let changed = st
                .breaker
                .record(outcome, ticket.probe_epoch, now_ms, &bcfg);
            if changed && st.breaker.state == BreakerState::Closed {
                // All probes succeeded: the endpoint has genuinely recovered.
                st.success_rate = 1.0;
            }
            let report = Finished {
                breaker_changed: changed,
                breaker: st.breaker.state_at(now_ms),
                latency_ms: st.latency_ms,
                in_flight: st.in_flight,
                stored: true,
                stale: false,
            };
            let bytes = match bytes {
                Some(stored) if same_layout => table.encode_patched(stored, at),
                _ => table.encode(),
            };
            (Some(bytes), Some(report))
        });
        let mut report = match result {
            Ok(r) => r,
            Err(r) => r.map(|mut f| {
                f.stored = false;
                f
            }),
        }
        .unwrap_or(Finished {
            breaker_changed: false,
            breaker: BreakerState::Closed,
            latency_ms: None,
            in_flight: 0,
            stored: true,
            stale: true,
        });
        if let Some(s) = session {
            let aff = self.affinity();
            let ok = match outcome {
                Outcome::Success if ticket.pin_on_success => {
                    aff.remember(s, ticket.endpoint_id, now_ms)
                }
                Outcome::DeadKey => aff.forget(s, ticket.endpoint_id),
                _ => true,
            };
            report.stored &= ok;
        }
        report
    }
}

#[cfg(test)]
mod tests;
