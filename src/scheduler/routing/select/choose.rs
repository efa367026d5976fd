//! [`Scheduler::choose`]: the decision for one attempt, read-only over a table snapshot, as
//! the steps it takes in order:
//! 1. [`Weighing`]: the placement weight and degraded verdict of every endpoint that could
//!    serve the request at all (before request exclusions and breakers, so that a failover
//!    walks the first attempt's order);
//! 2. [`Admissions`]: the breaker's word on this attempt's candidates (none admitting: the
//!    request cools down);
//! 3. [`pin_verdict`]: a live pin wins, unless its endpoint is degraded (the pin is broken) or
//!    staying is a certain 429;
//! 4. [`walk`]: placement, the first candidate in rendezvous order that admits traffic, is not
//!    degraded (but for a due probe), has quota and is within its bounded load; else
//!    [`fallback`];
//! 5. [`settle`]: the affinity label, the half-open probe, and whether a success pins.

use super::{AffinityResult, Choice, NoEndpoint, Pick, Reason, Scheduler};
use crate::scheduler::config::{AfterFailover, Config};
use crate::scheduler::health::breaker::{Admission, BreakerConfig};
use crate::scheduler::routing::placement::{self, Weighed};
use crate::scheduler::routing::quota::{estimate_tokens, QuotaRule};
use crate::scheduler::routing::score::score;
use crate::scheduler::routing::table::{fastest_warm, EndpointState, Table};

fn state_of(table: &Table, i: usize) -> Option<&EndpointState> {
    table.entries.get(i).map(|(_, st)| st)
}

impl Scheduler<'_> {
    /// The decision, read-only over a table snapshot: pin (or pin break), else placement in
    /// rendezvous order (see the module doc and [`crate::scheduler::routing::placement`]).
    pub(super) fn choose(
        &self,
        table: &Table,
        candidates: &[usize],
        pick: &Pick<'_>,
        pinned: Option<u32>,
        now_ms: u64,
        bcfg: &BreakerConfig,
    ) -> Result<Choice, NoEndpoint> {
        let cfg = self.cfg;
        let weighing = Weighing::of(cfg, table, pick, now_ms);
        let quota = QuotaCheck {
            table,
            on: cfg.quota_aware,
            estimate: estimate_tokens(pick.body_bytes, cfg.quota_bytes_per_token),
            rule: self.quota_rule(),
            now_ms,
        };
        // Endpoints that would have been taken but for their quota (at most one entry each).
        let mut quota_skipped: Vec<usize> = Vec::new();
        let admissions = Admissions::of(table, candidates, cfg.endpoints.len(), now_ms, bcfg)?;

        // The session's home: the first non-degraded endpoint of its rendezvous order.
        let key = pick.session.unwrap_or(pick.nonce);
        let weights = weighing.rendezvous(cfg);
        let home = placement::first(key, &weights, |i| !weighing.is_degraded(i));

        let pinned_index = pinned.and_then(|id| cfg.endpoint_index(id));
        let broke_pin_of = match pin_verdict(
            pinned_index,
            &weighing,
            &admissions,
            &quota,
            &mut quota_skipped,
        ) {
            Pin::Keep(p) => {
                return Ok(Choice {
                    endpoint: p,
                    reason: Reason::AffinityHit,
                    affinity: AffinityResult::Hit,
                    pin_on_success: true,
                    broke_pin_of: None,
                    home,
                    degraded: weighing.degraded_flags(),
                    quota_skipped,
                });
            }
            Pin::Break(p) => Some(p),
            Pin::None => None,
        };

        let order = placement::order(key, &weights);
        let place = Placement {
            cfg,
            table,
            pick,
            now_ms,
            weighing: &weighing,
            admissions: &admissions,
            quota: &quota,
            pinned_index,
            broke_pin_of,
        };
        let walked = walk(&place, &order, &mut quota_skipped);
        let (endpoint, reason) = match walked.chosen {
            Some(c) => c,
            None => fallback(&place, &order, walked.spilled).ok_or(NoEndpoint::Exhausted)?,
        };
        Ok(settle(
            &place,
            endpoint,
            reason,
            home,
            weighing.degraded_flags(),
            quota_skipped,
        ))
    }
}

/// Step 1: the placement weight of every endpoint that could serve this request at all.
struct Weighing {
    /// Enabled endpoints serving the model (indexes into `Config::endpoints`).
    statics: Vec<usize>,
    /// By endpoint index; `None` for the others.
    weighed: Vec<Option<Weighed>>,
}

impl Weighing {
    fn of(cfg: &Config, table: &Table, pick: &Pick<'_>, now_ms: u64) -> Weighing {
        let n = cfg.endpoints.len();
        let statics: Vec<usize> = (0..n)
            .filter(|&i| {
                cfg.endpoints
                    .get(i)
                    .is_some_and(|e| !e.disabled && super::serves_opt(e, pick.model))
            })
            .collect();
        let best_latency = fastest_warm(
            statics.iter().filter_map(|&i| state_of(table, i)),
            cfg.cold_start_samples,
        );
        let mut weighed: Vec<Option<Weighed>> = vec![None; n];
        for &i in &statics {
            if let (Some(ep), Some(st)) = (cfg.endpoints.get(i), state_of(table, i)) {
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
        Weighing { statics, weighed }
    }

    fn weight_of(&self, i: usize) -> Option<Weighed> {
        self.weighed.get(i).copied().flatten()
    }

    fn is_degraded(&self, i: usize) -> bool {
        self.weight_of(i).is_some_and(|w| w.degraded)
    }

    /// The estimate's degraded verdict (not the transient overdue one), stored for its
    /// hysteresis.
    fn sticky(&self, i: usize) -> bool {
        self.weight_of(i).is_some_and(|w| w.sticky)
    }

    fn degraded_flags(&self) -> Vec<(usize, bool)> {
        self.statics.iter().map(|&i| (i, self.sticky(i))).collect()
    }

    /// `(index, id, weight)` of every weighed endpoint, for the rendezvous order.
    fn rendezvous(&self, cfg: &Config) -> Vec<(usize, u32, f64)> {
        self.statics
            .iter()
            .filter_map(|&i| Some((i, cfg.endpoints.get(i)?.id, self.weight_of(i)?.weight)))
            .collect()
    }
}

/// Quota: short endpoints are skipped for placements, a certain 429 even by a pin.
struct QuotaCheck<'t> {
    table: &'t Table,
    /// `quota_aware`.
    on: bool,
    estimate: u64,
    rule: QuotaRule,
    now_ms: u64,
}

impl QuotaCheck<'_> {
    fn short(&self, i: usize) -> bool {
        self.quota(i)
            .is_some_and(|q| q.short(self.estimate, &self.rule, self.now_ms))
    }

    fn certain_429(&self, i: usize) -> bool {
        self.quota(i)
            .is_some_and(|q| q.certain_429(self.estimate, self.now_ms))
    }

    fn quota(&self, i: usize) -> Option<crate::scheduler::routing::quota::Quota> {
        state_of(self.table, i)
            .filter(|_| self.on)
            .map(|st| st.quota)
    }
}

/// Step 2: breaker admission of this attempt's candidates, by endpoint index.
struct Admissions(Vec<Option<Admission>>);

impl Admissions {
    /// `Err(CoolingDown)` with the earliest recovery when no candidate's breaker admits.
    fn of(
        table: &Table,
        candidates: &[usize],
        n: usize,
        now_ms: u64,
        bcfg: &BreakerConfig,
    ) -> Result<Admissions, NoEndpoint> {
        let mut admission: Vec<Option<Admission>> = vec![None; n];
        let mut retry_at = u64::MAX;
        let mut all_rate_limited = true;
        let mut any_admitted = false;
        for &i in candidates {
            let Some(st) = state_of(table, i) else {
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
        Ok(Admissions(admission))
    }

    fn admitted(&self, i: usize) -> bool {
        matches!(
            self.0.get(i).copied().flatten(),
            Some(Admission::Normal | Admission::Probe { .. })
        )
    }

    fn probing(&self, i: usize) -> bool {
        matches!(
            self.0.get(i).copied().flatten(),
            Some(Admission::Probe { .. })
        )
    }
}

/// What becomes of the session's pin.
enum Pin {
    /// No pin, or one that cannot serve this attempt (not admitted, or a certain 429).
    None,
    /// The pinned endpoint takes the attempt.
    Keep(usize),
    /// The pinned endpoint is degraded: placed again without it (it stays the last resort).
    Break(usize),
}

/// Step 3: a live pin wins, unless its endpoint is degraded. A pinned endpoint whose quota
/// makes the attempt a certain 429 is left, and noted in `quota_skipped`.
fn pin_verdict(
    pinned_index: Option<usize>,
    weighing: &Weighing,
    admissions: &Admissions,
    quota: &QuotaCheck<'_>,
    quota_skipped: &mut Vec<usize>,
) -> Pin {
    let Some(p) = pinned_index.filter(|&p| admissions.admitted(p)) else {
        return Pin::None;
    };
    if quota.certain_429(p) {
        quota_skipped.push(p);
        return Pin::None;
    }
    if weighing.is_degraded(p) {
        Pin::Break(p)
    } else {
        Pin::Keep(p)
    }
}

/// What the placement steps read.
struct Placement<'p> {
    cfg: &'p Config,
    table: &'p Table,
    pick: &'p Pick<'p>,
    now_ms: u64,
    weighing: &'p Weighing,
    admissions: &'p Admissions,
    quota: &'p QuotaCheck<'p>,
    pinned_index: Option<usize>,
    broke_pin_of: Option<usize>,
}

impl Placement<'_> {
    fn load(&self, i: usize) -> u32 {
        state_of(self.table, i).map_or(0, |st| st.load(self.now_ms))
    }

    fn weight(&self, i: usize) -> f64 {
        self.weighing.weight_of(i).map_or(0.0, |x| x.weight)
    }

    /// A degraded endpoint is probed once the estimate says so and its probe interval has
    /// passed (overdue hits in flight are probes already), only by a first attempt of an
    /// unpinned request that its breaker and quota let through.
    fn degraded_probe_due(&self, i: usize) -> bool {
        let due = self.weighing.sticky(i)
            && state_of(self.table, i).is_some_and(|st| {
                self.now_ms.saturating_sub(st.degraded_probe_ms)
                    >= placement::probe_interval(self.cfg, st.degraded_probes)
            });
        due && self.admissions.admitted(i)
            && !self.quota.short(i)
            && self.pick.attempt <= 1
            && self.pinned_index.is_none()
    }
}

/// Where the walk in rendezvous order stopped.
struct Walked {
    chosen: Option<(usize, Reason)>,
    /// The first endpoint passed over for its bounded load.
    spilled: Option<usize>,
}

/// Step 4: the first candidate in rendezvous order that admits traffic, is not degraded (but
/// for a due probe), is not short of quota and is within its bounded load.
fn walk(place: &Placement<'_>, order: &[usize], quota_skipped: &mut Vec<usize>) -> Walked {
    let (admissions, weighing, quota) = (place.admissions, place.weighing, place.quota);
    let eligible = |i: usize| admissions.admitted(i) && !weighing.is_degraded(i);
    let (total_load, total_weight) = order
        .iter()
        .filter(|&&i| eligible(i))
        .fold((0u64, 0.0f64), |(l, w), &i| {
            (l + u64::from(place.load(i)), w + place.weight(i))
        });
    let mut spilled: Option<usize> = None;
    let mut unavailable_before = false;
    for &i in order {
        if Some(i) == place.broke_pin_of {
            unavailable_before = true;
            continue;
        }
        if weighing.is_degraded(i) {
            if place.degraded_probe_due(i) {
                return Walked {
                    chosen: Some((i, Reason::DegradedProbe)),
                    spilled,
                };
            }
            unavailable_before = true;
            continue;
        }
        if admissions.admitted(i) && quota.short(i) && !quota_skipped.contains(&i) {
            quota_skipped.push(i);
        }
        if !admissions.admitted(i) || quota.short(i) {
            unavailable_before = true;
            continue;
        }
        let load = f64::from(place.load(i));
        let w = place.weight(i);
        if load + 1.0 > placement::load_limit(total_load, w, total_weight, place.cfg) {
            spilled.get_or_insert(i);
            continue;
        }
        let reason = if place.broke_pin_of.is_some() {
            Reason::PinBreak
        } else if place.pick.attempt > 1 || unavailable_before {
            Reason::Backup
        } else if spilled.is_some() {
            Reason::Spill
        } else {
            Reason::Home
        };
        return Walked {
            chosen: Some((i, reason)),
            spilled,
        };
    }
    Walked {
        chosen: None,
        spilled,
    }
}

/// Nothing placeable: over-bound (impossible with slack >= 1), else only degraded endpoints
/// admit traffic: the first of them in order, the broken pin last.
fn fallback(
    place: &Placement<'_>,
    order: &[usize],
    spilled: Option<usize>,
) -> Option<(usize, Reason)> {
    spilled
        .map(|i| (i, Reason::Spill))
        .or_else(|| {
            order
                .iter()
                .copied()
                .find(|&i| place.admissions.admitted(i) && Some(i) != place.broke_pin_of)
                .map(|i| (i, Reason::Backup))
        })
        .or_else(|| place.broke_pin_of.map(|i| (i, Reason::AffinityHit)))
}

/// Step 5: the affinity label of the placement, the half-open probe, whether a success pins
/// the session there, and the quota skips that still stand.
fn settle(
    place: &Placement<'_>,
    endpoint: usize,
    mut reason: Reason,
    home: Option<usize>,
    degraded: Vec<(usize, bool)>,
    mut quota_skipped: Vec<usize>,
) -> Choice {
    // The pinned endpoint is degraded but nothing else can serve: keep the pin.
    let broke_pin_of = place.broke_pin_of.filter(|_| reason != Reason::AffinityHit);
    let affinity = match (place.pick.session, place.pinned_index, reason) {
        (None, _, _) => AffinityResult::None,
        (Some(_), _, Reason::AffinityHit) => AffinityResult::Hit,
        (Some(_), _, Reason::PinBreak) => AffinityResult::PinBreak,
        (Some(_), Some(_), _) => AffinityResult::Miss,
        (Some(_), None, Reason::Home) => AffinityResult::Home,
        (Some(_), None, Reason::Spill) => AffinityResult::Spill,
        (Some(_), None, _) => AffinityResult::Backup,
    };
    if place.admissions.probing(endpoint) && reason != Reason::AffinityHit {
        reason = Reason::HalfOpenProbe;
    }
    let pin_on_success = match (reason, place.cfg.after_failover) {
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
        home,
        degraded,
        quota_skipped,
    }
}
