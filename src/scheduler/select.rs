//! Selection: filter (exclusions) → affinity → score → pick, and recording what happened.
//!
//! Exclusions apply in this order, each counted for diagnostics: disabled; dead keys (401/403
//! earlier in *this* request); used keys (429 earlier in this request); endpoints already tried
//! in this request; model mismatch; breaker not admitting. Dead and used keys live only in the
//! request's [`Exclusions`]: cross-request memory is the breaker and the statistics alone.
//!
//! Among the remaining candidates a live affinity pin wins; otherwise a half-open endpoint
//! with a free probe slot (probing is how it recovers, so probes are sent promptly); otherwise
//! the best score. Scores within [`TIE_TOLERANCE`] of the best count as tied, and the tie is
//! broken by a rendezvous hash of (session, endpoint): new sessions spread evenly over equal
//! endpoints, and independent Envoy processes with the same view choose the same endpoint.

use super::affinity::Affinity;
use super::breaker::{Admission, BreakerConfig, BreakerState};
use super::config::Config;
use super::ewma;
use super::hash::rendezvous;
use super::outcome::Outcome;
use super::score::{score, Scored};
use super::state::Table;
use super::store::{update_if, Store};

/// Relative score difference treated as a tie (noise in the EWMA is not a reason to pile every
/// new session onto one endpoint).
pub const TIE_TOLERANCE: f64 = 0.05;

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

fn serves_opt(ep: &super::config::EndpointConfig, model: Option<&str>) -> bool {
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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    AffinityHit,
    HalfOpenProbe,
    ColdStart,
    Scored,
}

impl Reason {
    /// Every reason, in metric order (`computeflux_decisions_total` is defined from it).
    pub const ALL: &'static [Reason] = &[
        Reason::AffinityHit,
        Reason::HalfOpenProbe,
        Reason::ColdStart,
        Reason::Scored,
    ];

    pub fn label(&self) -> &'static str {
        match self {
            Reason::AffinityHit => "affinity_hit",
            Reason::HalfOpenProbe => "half_open_probe",
            Reason::ColdStart => "cold_start",
            Reason::Scored => "scored",
        }
    }
}

/// The session's affinity as seen by this pick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AffinityResult {
    /// Pinned endpoint chosen.
    Hit,
    /// A live pin existed but its endpoint could not serve this attempt.
    Miss,
    /// No live pin (a new or expired session).
    New,
    /// The request has no session key.
    None,
}

impl AffinityResult {
    /// Every result, in metric order (`computeflux_affinity_total` is defined from it).
    pub const ALL: &'static [AffinityResult] = &[
        AffinityResult::Hit,
        AffinityResult::Miss,
        AffinityResult::New,
        AffinityResult::None,
    ];

    pub fn label(&self) -> &'static str {
        match self {
            AffinityResult::Hit => "hit",
            AffinityResult::Miss => "miss",
            AffinityResult::New => "new",
            AffinityResult::None => "none",
        }
    }
}

/// Proof of an attempt in flight; hand it back to [`Scheduler::finish`] exactly once.
///
/// Move-only (no `Clone`/`Copy`) and consumed by `finish`, so finishing an attempt twice does
/// not compile; only the scheduler makes one (`non_exhaustive`). Dropping one unfinished leaks
/// its in-flight count (until [`super::state::IN_FLIGHT_STALE_MS`]) and its probe slot.
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
}

#[derive(Debug, PartialEq, Eq)]
pub struct Decision {
    pub endpoint: usize,
    pub reason: Reason,
    pub affinity: AffinityResult,
    pub ticket: Ticket,
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

    /// The endpoint table as stored now, aligned to the configuration.
    pub fn table(&self) -> Table {
        Table::aligned(self.store.get(TABLE_KEY).0.as_deref(), self.cfg)
    }

    /// Applies the request-scoped and static exclusions. `Err` when nothing is left.
    pub fn candidates(&self, pick: &Pick<'_>) -> Result<(Vec<usize>, Dropped), NoEndpoint> {
        let mut dropped = Dropped::default();
        let mut out = Vec::with_capacity(self.cfg.endpoints.len());
        let mut serves_model = false;
        let serves = |ep: &super::config::EndpointConfig| pick.model.is_none_or(|m| ep.serves(m));
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
        let pinned = pick
            .session
            .and_then(|s| self.affinity().lookup(s, now_ms).map(|id| (s, id)));
        // A pin to an endpoint that is disabled or no longer serves the model is a hard failure
        // of that pin: evict it so it does not keep costing a lookup.
        if let Some((session, id)) = pinned {
            let still_valid = self
                .cfg
                .endpoints
                .iter()
                .any(|e| e.id == id && !e.disabled && serves_opt(e, pick.model));
            if !still_valid {
                self.affinity().forget(session, id);
            }
        }
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
            match self.choose(
                &table,
                &candidates,
                pick,
                pinned.map(|p| p.1),
                now_ms,
                &bcfg,
            ) {
                Err(e) => (None, Err(e)),
                Ok((i, reason, affinity)) => {
                    let Some((_, st)) = table.entries.get_mut(i) else {
                        return (None, Err(NoEndpoint::Exhausted));
                    };
                    let probe_epoch = match st.breaker.admit(now_ms, &bcfg) {
                        Admission::Probe { epoch } => Some(epoch),
                        _ => None,
                    };
                    st.in_flight = st.in_flight.saturating_add(1);
                    st.in_flight_changed_ms = now_ms;
                    if pick.attempt <= 1 {
                        table.budget.on_request(now_ms);
                    }
                    let ticket = Ticket {
                        endpoint: i,
                        endpoint_id: self.cfg.endpoints.get(i).map_or(0, |e| e.id),
                        probe_epoch,
                        counted: true,
                        started_ms: now_ms,
                    };
                    let bytes = match bytes {
                        Some(stored) if same_layout => table.encode_patched(stored, i),
                        _ => table.encode(),
                    };
                    (
                        Some(bytes),
                        Ok(Decision {
                            endpoint: i,
                            reason,
                            affinity,
                            ticket,
                        }),
                    )
                }
            }
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
                let (i, reason, affinity) =
                    self.choose(&table, &closed, pick, pinned.map(|p| p.1), now_ms, &bcfg)?;
                let ticket = Ticket {
                    endpoint: i,
                    endpoint_id: self.cfg.endpoints.get(i).map_or(0, |e| e.id),
                    probe_epoch: None,
                    counted: false,
                    started_ms: now_ms,
                };
                Ok(Decision {
                    endpoint: i,
                    reason,
                    affinity,
                    ticket,
                })
            }
            // CAS kept losing: go with the decision, but nothing was stored for it.
            Err(r) => r.map(|mut d| {
                d.ticket.counted = false;
                d.ticket.probe_epoch = None;
                d
            }),
        }
    }

    /// The ranking, read-only over a table snapshot. Returns (endpoint, reason, affinity).
    fn choose(
        &self,
        table: &Table,
        candidates: &[usize],
        pick: &Pick<'_>,
        pinned: Option<u32>,
        now_ms: u64,
        bcfg: &BreakerConfig,
    ) -> Result<(usize, Reason, AffinityResult), NoEndpoint> {
        let mut admitted: Vec<(usize, bool)> = Vec::with_capacity(candidates.len());
        let mut retry_at = u64::MAX;
        let mut all_rate_limited = true;
        for &i in candidates {
            let Some((_, st)) = table.entries.get(i) else {
                continue;
            };
            match st.breaker.peek(now_ms, bcfg) {
                Admission::Normal => admitted.push((i, false)),
                Admission::Probe { .. } => admitted.push((i, true)),
                Admission::Rejected {
                    retry_at_ms,
                    rate_limited,
                } => {
                    retry_at = retry_at.min(retry_at_ms);
                    all_rate_limited &= rate_limited;
                }
            }
        }
        if admitted.is_empty() {
            return Err(NoEndpoint::CoolingDown {
                retry_at_ms: retry_at,
                all_rate_limited,
            });
        }
        let mut affinity = match (pick.session, pinned) {
            (None, _) => AffinityResult::None,
            (Some(_), None) => AffinityResult::New,
            (Some(_), Some(_)) => AffinityResult::Miss,
        };
        if let Some(id) = pinned {
            if let Some(&(i, _)) = admitted
                .iter()
                .find(|(i, _)| self.cfg.endpoints.get(*i).is_some_and(|e| e.id == id))
            {
                affinity = AffinityResult::Hit;
                return Ok((i, Reason::AffinityHit, affinity));
            }
        }
        let best_latency = admitted
            .iter()
            .filter_map(|(i, _)| table.entries.get(*i))
            .filter(|(_, st)| st.total >= self.cfg.cold_start_samples)
            .filter_map(|(_, st)| st.latency_ms)
            .fold(None, |acc: Option<f64>, l| {
                Some(acc.map_or(l, |a| a.min(l)))
            });
        // Half-open endpoints with a free probe slot go first; among the pool, the best score,
        // ties (within TIE_TOLERANCE) broken by the rendezvous hash.
        let probing = admitted.iter().any(|(_, probe)| *probe);
        let scored: Vec<(usize, bool, Scored)> = admitted
            .iter()
            .filter(|(_, probe)| *probe == probing)
            .filter_map(|&(i, probe)| {
                let weight = self.cfg.endpoints.get(i)?.weight;
                let (_, st) = table.entries.get(i)?;
                Some((i, probe, score(weight, st, best_latency, self.cfg, now_ms)))
            })
            .collect();
        let best = scored
            .iter()
            .map(|(_, _, s)| s.score)
            .fold(f64::MIN, f64::max);
        let session = pick.session.unwrap_or(0);
        let chosen = scored
            .iter()
            .copied()
            .filter(|(_, _, s)| s.score >= best * (1.0 - TIE_TOLERANCE))
            .max_by_key(|(i, _, _)| {
                rendezvous(session, self.cfg.endpoints.get(*i).map_or(0, |e| e.id))
            });
        match chosen {
            Some((i, probe, s)) => {
                let reason = if probe {
                    Reason::HalfOpenProbe
                } else if s.cold {
                    Reason::ColdStart
                } else {
                    Reason::Scored
                };
                Ok((i, reason, affinity))
            }
            None => Err(NoEndpoint::Exhausted),
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
        let bcfg = self.breaker_config();
        let cfg = self.cfg;
        let result = update_if(self.store, TABLE_KEY, |bytes| {
            let (mut table, same_layout) = Table::load(bytes, cfg);
            // The ticket's endpoint, also if a reload moved it; gone: nothing to record.
            let at = match table.entries.get(ticket.endpoint) {
                Some((id, _)) if *id == ticket.endpoint_id => Some(ticket.endpoint),
                _ => table
                    .entries
                    .iter()
                    .position(|(id, _)| *id == ticket.endpoint_id),
            };
            let Some((at, (_, st))) = at.and_then(|i| Some((i, table.entries.get_mut(i)?))) else {
                return (None, None);
            };
            if ticket.counted {
                st.in_flight = st.in_flight.saturating_sub(1);
                st.in_flight_changed_ms = now_ms;
            }
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
            if matches!(outcome, Outcome::Success) {
                st.latency_ms = Some(ewma::update(
                    st.latency_ms,
                    latency_ms as f64,
                    cfg.ewma_alpha,
                ));
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
                Outcome::Success => aff.remember(s, ticket.endpoint_id, now_ms),
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
