//! The [`Board`]: what one decision knows of every candidate, read by every step of the pick
//! through its accessors (verdicts, room by slots, waits elsewhere).

use super::*;

/// How much shorter (in batches of wait) another full candidate's queue must be for a new
/// session to pass over a full endpoint when none has room ([`Board::far_shorter_queue_elsewhere`]).
pub(in crate::scheduler::routing::select) const QUEUE_GAP: f64 = 4.0;

/// What one decision knows of every endpoint (indexes into `Config::endpoints`).
pub(in crate::scheduler::routing::select) struct Board<'t> {
    /// The verdicts and weights are the worker's board memo's, current (see `BoardMemo`).
    pub(super) from_memo: bool,
    /// A request without a session over more than `placement::DRAWN_FROM` candidates: its
    /// order is drawn ([`Scheduler::order`]); `weights` are placement weights all the same.
    pub(super) drawn: bool,
    /// Endpoints that could serve the request at all (enabled, serving its model; see
    /// [`Board::statics`]), as the worker's memo keeps them, with their rendezvous seeds.
    pub(super) shared: Rc<Statics>,
    /// The new sessions this process placed per endpoint (see `sessions`): `Some` only for
    /// a new session placed by prefix with the session bound on (borrowed: the decision's
    /// copy would cost as many instructions as the value's bytes).
    pub(super) sessions: Option<&'t sessions::Counts>,
    /// The request's pinned endpoint, if any (even one that cannot serve it now).
    pub(super) pinned: Option<usize>,
    /// Some static candidate is degraded (else the home is the first of the order).
    pub(super) any_degraded: bool,
    /// The table, its time and in-flight age limit: for [`Board::load_of`] when `load` is
    /// empty.
    pub(super) table: &'t Table,
    pub(super) now_ms: u64,
    pub(super) max_age_ms: u64,
    /// Nothing is scraped: the walk's totals may be [`PlainTotals`].
    pub(super) plain: bool,
    /// `(index, endpoint id, placement weight)` of the statics: the rendezvous candidates.
    pub(super) weights: Rc<Vec<(usize, u32, f64)>>,
    pub(super) verdicts: Rc<Vec<Verdict>>,
    /// The statics whose verdict (sticky degraded flag or saturation) differs from the one
    /// stored in their entry, in index order: the only ones besides the chosen endpoint whose
    /// verdict the pick's write stores (see [`Board::stored_verdicts`]).
    pub(super) flips: Rc<Vec<usize>>,
    /// Every endpoint's remembered quota against this request (`quota_aware`): see
    /// [`Board::short`] and [`Board::certain_429`].
    pub(super) quotas: QuotaView<'t>,
    /// The engines' fresh loads by index (empty when nothing is scraped), and whether every
    /// static candidate has one: what [`Board::load_of`] reads on demand.
    pub(super) loads: &'t [Option<crate::scheduler::routing::judge::saturation::EngineLoad>],
    pub(super) all_scraped: bool,
    /// Each endpoint's projected load and slots, where scraped (see `capacity`; empty when
    /// nothing is scraped), the engines' own list.
    pub(super) room: &'t [Option<Room>],
    /// The most slots among the statics as their rendezvous weights count them (0: none
    /// known; an engine that never queued counts as the most known × 4, see `gather`).
    pub(super) most_slots: u32,
    /// Every static candidate's slots are known: bounded load by slots
    /// (`capacity::slot_limit`) rather than by weight.
    pub(super) by_slots: bool,
    /// Breaker admission of this attempt's candidates (`None`: not a candidate), or of the
    /// statics as the memo keeps it, with `excluded` (the statics this attempt excludes, index
    /// order; empty otherwise) masked.
    pub(super) admission: Admissions,
    pub(super) excluded: Vec<usize>,
    /// The candidates left as the last healthy server of another model than the request's
    /// (see [`last_servers`]), by index; empty when none is (no endpoint degraded).
    pub(super) captive: Vec<bool>,
    /// The first two statics with room for a new session (see [`Board::room_elsewhere`]),
    /// found on first use.
    pub(super) room_at: std::cell::OnceCell<[Option<usize>; 2]>,
}

/// The totals of the walk's eligible candidates ([`eligible_totals`]) when no engine load is
/// scraped: then no candidate is full (no saturation, no room known) and no slots are known, so
/// the eligible are the admitted, non-degraded candidates but the one left, summed in index
/// order as `eligible_totals` sums them, with fewer look-ups.
#[derive(Debug, Clone, Copy)]
pub(in crate::scheduler::routing::select) struct PlainTotals {
    pub(super) load: u64,
    pub(super) weight: f64,
}

impl PlainTotals {
    /// Over the rendezvous candidates `weights` (in index order): `counted(i)`, the load of
    /// candidate `i` if it is counted.
    pub(super) fn of(
        weights: &[(usize, u32, f64)],
        counted: impl Fn(usize) -> Option<u32>,
    ) -> Self {
        let mut t = PlainTotals {
            load: 0,
            weight: 0.0,
        };
        for &(i, _, w) in weights {
            let Some(load) = counted(i) else {
                continue;
            };
            t.load += u64::from(load);
            t.weight += w;
        }
        t
    }
}

/// The table's quotas as one decision sees them (`None`: not `quota_aware`, never short).
pub(in crate::scheduler::routing::select) struct QuotaView<'t> {
    pub(super) table: Option<&'t Table>,
    pub(super) estimate: u64,
    pub(super) rule: QuotaRule,
    pub(super) now_ms: u64,
}

impl QuotaView<'_> {
    /// Short of quota for this request: skipped for placements (`quota_aware`).
    pub(super) fn short_at(&self, i: usize) -> bool {
        self.table
            .and_then(|t| t.entries.get(i))
            .is_some_and(|(_, st)| st.quota.short(self.estimate, &self.rule, self.now_ms))
    }
}

impl<'t> Board<'t> {
    /// Endpoints that could serve the request at all (enabled, serving its model), in index
    /// order.
    pub(in crate::scheduler::routing::select) fn statics(&self) -> &[usize] {
        &self.shared.indexes
    }
    /// The rendezvous seeds of the candidates `weights` lists, aligned with it, when it lists
    /// every static candidate (else empty: the keys are computed from the ids).
    pub(in crate::scheduler::routing::select) fn seeds(&self) -> &[u64] {
        if self.weights.len() == self.shared.seeds.len() {
            &self.shared.seeds
        } else {
            &[]
        }
    }
    /// Short of quota for this request: skipped for placements (`quota_aware`).
    pub(in crate::scheduler::routing::select) fn short(&self, i: usize) -> bool {
        self.quotas.short_at(i)
    }
    /// What `i`'s key has left for new sessions after its forecast use (`Quota::headroom`;
    /// `None`: no stated token limit).
    pub(in crate::scheduler::routing::select) fn headroom(&self, i: usize) -> Option<i128> {
        let q = &self.quotas;
        q.table
            .and_then(|t| t.entries.get(i))
            .and_then(|(_, st)| st.quota.headroom(q.now_ms))
    }
    /// Staying there is a certain 429 (`quota_aware`): even a pin leaves it.
    pub(in crate::scheduler::routing::select) fn certain_429(&self, i: usize) -> bool {
        let q = &self.quotas;
        q.table
            .and_then(|t| t.entries.get(i))
            .is_some_and(|(_, st)| st.quota.certain_429(q.estimate, q.now_ms))
    }
    /// The load bounded-load placement weighs: the projected load when `by_slots`, else
    /// `signals::placement_load` (the scraped one where every candidate reports it), and the
    /// in-flight count when nothing is scraped. Read on demand, for the candidates a decision
    /// weighs: a list of every endpoint's cost each decision about 60 instructions per
    /// endpoint.
    pub(in crate::scheduler::routing::select) fn load_of(&self, i: usize) -> u32 {
        if self.plain {
            return self
                .table
                .entries
                .get(i)
                .map_or(0, |(_, st)| st.load(self.now_ms, self.max_age_ms));
        }
        if self.by_slots {
            return self
                .room
                .get(i)
                .copied()
                .flatten()
                .map_or(0, |r| r.projected);
        }
        let l = self
            .loads
            .get(i)
            .copied()
            .flatten()
            .filter(|_| self.all_scraped);
        self.table.entries.get(i).map_or(0, |(_, st)| {
            signals::placement_load(st, l.as_ref(), self.now_ms, self.max_age_ms)
        })
    }
    /// Whether [`Board::load_of`] is this process's own in-flight count (no slots known and
    /// not every candidate scraped), which with several replicas is each one's share of the
    /// engine's load, not the load every replica reads alike.
    pub(in crate::scheduler::routing::select) fn own_loads(&self) -> bool {
        self.plain || (!self.by_slots && !self.all_scraped)
    }
    /// The walk's `(load, weight, slots)` totals over the eligible candidates, without `left`
    /// (the pinned endpoint the session leaves), the cheap way when nothing is scraped (see
    /// [`PlainTotals`]); else `None`.
    pub(in crate::scheduler::routing::select) fn plain_totals(
        &self,
        left: Option<usize>,
    ) -> Option<(u64, f64, u64)> {
        if !self.plain {
            return None;
        }
        let t = PlainTotals::of(&self.weights, |i| {
            (Some(i) != left && self.admitted(i) && !self.degraded(i)).then(|| self.load_of(i))
        });
        Some((t.load, t.weight, 0))
    }
    /// The walk's totals (see [`eligible_totals`]) over the candidates admitted, not
    /// degraded, not `left` and not passed over, in the board's order: each candidate's
    /// admission, verdict and room looked up once, the tests cheapest first, and the
    /// exclusions read once (a failover's first attempt at 512 endpoints, scraped, spent
    /// about 68 000 instructions here through the accessors; about 2 500 fewer this way).
    pub(in crate::scheduler::routing::select) fn eligible_totals(
        &self,
        left: Option<usize>,
    ) -> (u64, f64, u64) {
        let (mut load, mut weight, mut slots) = (0u64, 0.0f64, 0u64);
        let excluded = &self.excluded;
        for &(i, _, w) in self.weights.iter() {
            if !matches!(
                self.admission.get(i),
                Some(Some(Admission::Normal | Admission::Probe { .. }))
            ) {
                continue;
            }
            let verdict = self.verdicts.get(i);
            if verdict.is_some_and(|v| v.degraded) || Some(i) == left {
                continue;
            }
            if !excluded.is_empty() && excluded.binary_search(&i).is_ok() {
                continue;
            }
            let room = self.room.get(i).copied().flatten();
            let full = verdict.is_some_and(Verdict::saturated) || room.is_some_and(|r| r.herd());
            if full && (self.room_elsewhere(i) || self.far_shorter_queue_elsewhere(i)) {
                continue;
            }
            load += u64::from(self.load_of(i));
            if self.by_slots {
                slots += u64::from(room.and_then(|r| r.slots).unwrap_or(0));
            }
            weight += w;
        }
        (load, weight, slots)
    }
    pub(in crate::scheduler::routing::select) fn weight(&self, i: usize) -> f64 {
        // The weights are in index order (the statics'): a search, for the few a walk weighs.
        self.weights
            .binary_search_by_key(&i, |&(j, _, _)| j)
            .ok()
            .and_then(|at| self.weights.get(at))
            .map_or(0.0, |&(_, _, w)| w)
    }
    pub(in crate::scheduler::routing::select) fn degraded(&self, i: usize) -> bool {
        self.verdicts.get(i).is_some_and(|v| v.degraded)
    }
    pub(in crate::scheduler::routing::select) fn saturated(&self, i: usize) -> bool {
        self.verdicts.get(i).is_some_and(Verdict::saturated)
    }
    /// Saturated, or filled by a burst of this process's own placements since its last
    /// scrape (`capacity::Room::herd`): what a new session's placement passes over while
    /// another candidate has room.
    pub(in crate::scheduler::routing::select) fn full(&self, i: usize) -> bool {
        self.saturated(i)
            || self
                .room
                .get(i)
                .copied()
                .flatten()
                .is_some_and(|r| r.herd())
    }
    /// Whether a later turn without a pin here passes over `i`: saturated (the engine's
    /// scrape with hysteresis, [`signals::saturation_rule`]: what every replica reads alike)
    /// while another candidate is not, or another's queue is far shorter. Never this
    /// process's own placements: the replica that served the turn before counted others.
    pub(in crate::scheduler::routing::select) fn passed_over_alike(&self, i: usize) -> bool {
        self.saturated(i)
            && (self.statics().iter().any(|&j| {
                j != i
                    && self.admitted(j)
                    && !self.degraded(j)
                    && !self.short(j)
                    && !self.saturated(j)
            }) || self.far_shorter_queue_elsewhere(i))
    }
    /// Whether `i` is a small engine: its slots known and at most half the most slots known
    /// among the candidates.
    pub(in crate::scheduler::routing::select) fn small(&self, i: usize) -> bool {
        let slots = self.slots(i);
        slots > 0 && slots.saturating_mul(2) <= self.most_slots
    }
    /// Its known slots (0: unknown).
    pub(in crate::scheduler::routing::select) fn slots(&self, i: usize) -> u32 {
        self.room
            .get(i)
            .copied()
            .flatten()
            .and_then(|r| r.slots)
            .unwrap_or(0)
    }
    /// This attempt's breaker admission of `i` (`None`: not a candidate).
    pub(in crate::scheduler::routing::select) fn admission_of(
        &self,
        i: usize,
    ) -> Option<Admission> {
        if !self.excluded.is_empty() && self.excluded.binary_search(&i).is_ok() {
            return None;
        }
        self.admission.get(i).copied().flatten()
    }
    pub(in crate::scheduler::routing::select) fn admitted(&self, i: usize) -> bool {
        matches!(
            self.admission_of(i),
            Some(Admission::Normal | Admission::Probe { .. })
        )
    }
    pub(in crate::scheduler::routing::select) fn probing(&self, i: usize) -> bool {
        matches!(self.admission_of(i), Some(Admission::Probe { .. }))
    }
    /// Whether some candidate other than `i` could take a new session and is not full (see
    /// [`Board::full`]): only then is a full endpoint passed over (all full: placed as
    /// without metrics).
    pub(in crate::scheduler::routing::select) fn room_elsewhere(&self, i: usize) -> bool {
        // The first two statics (index order) that could take it, found once per decision:
        // some other than `i` is among them if there is one. A walk asks it of every full
        // candidate it meets, and scanning the statics each time cost a failover's walk over
        // a fleet with many full engines about 60 000 instructions at 512.
        let first = self.room_at.get_or_init(|| {
            let mut with_room = self.statics().iter().copied().filter(|&j| {
                self.admitted(j) && !self.degraded(j) && !self.short(j) && !self.full(j)
            });
            [with_room.next(), with_room.next()]
        });
        match *first {
            [Some(j), _] if j != i => true,
            [Some(_), Some(_)] => true,
            _ => false,
        }
    }
    /// Whether a new session's placement passes over full `i` (see [`Board::full`]): another
    /// candidate has room, or — every one full — another's queue is far shorter
    /// ([`Board::far_shorter_queue_elsewhere`]).
    pub(in crate::scheduler::routing::select) fn passed_over(&self, i: usize) -> bool {
        self.full(i) && (self.room_elsewhere(i) || self.far_shorter_queue_elsewhere(i))
    }
    /// The wait at `i` in batches: its engine's scraped waiting ÷ running (at least 1), where
    /// both are known.
    pub(super) fn queue_batches(&self, i: usize) -> Option<f64> {
        let load = self.verdicts.get(i).and_then(|v| v.load)?;
        Some(f64::from(load.waiting?) / f64::from(load.running?.max(1)))
    }
    /// Whether `i`'s queue is at least a batch deep and another candidate that could take a
    /// new session (admitted, not degraded, not short) has a known queue at most
    /// 1 / [`QUEUE_GAP`] of it. When every candidate is full, placement used to go home as
    /// without metrics; on the bench's `slow` run that put new sessions on the one endpoint
    /// left serving a second model, which took all of that model's sessions from the slowed
    /// one (waiting 20–34 on 16 slots for 8 s while the others had 0–12): its queue was the
    /// whole remaining tail above 1.5 × the steady p99. A queue shallower than a batch drains
    /// by itself, and a gap of 4× leaves the jitter between replicas' scrapes alone. New
    /// sessions only: no pin moves for it.
    pub(in crate::scheduler::routing::select) fn far_shorter_queue_elsewhere(
        &self,
        i: usize,
    ) -> bool {
        self.statics().iter().any(|&j| {
            j != i
                && self.admitted(j)
                && !self.degraded(j)
                && !self.short(j)
                && self.far_shorter_queue(j, i)
        })
    }
    /// Whether `i` is the last healthy server of another model than the request's
    /// ([`last_servers`]): sessions of the request's model are steered off it.
    pub(in crate::scheduler::routing::select) fn captive(&self, i: usize) -> bool {
        self.captive.get(i).copied().unwrap_or(false)
    }
    /// Whether a placement passes over captive `i` ([`last_servers`]) for relief: some
    /// candidate other than `i` that could take it (admitted, not degraded, not short, not
    /// passed over, not captive itself) has a lower load ([`Board::load_of`]), or, for the
    /// half of the sessions whose `reserved` coin came up, any such candidate at all.
    pub(in crate::scheduler::routing::select) fn relief_passes_over(
        &self,
        i: usize,
        reserved: bool,
    ) -> bool {
        let mine = self.load_of(i);
        self.statics().iter().any(|&j| {
            j != i
                && self.admitted(j)
                && !self.degraded(j)
                && !self.short(j)
                && !self.captive(j)
                && !self.passed_over(j)
                && (reserved || self.load_of(j) < mine)
        })
    }
    /// Whether `j`'s known queue is at most 1 / [`QUEUE_GAP`] of `i`'s in batches, with `i`'s
    /// at least a batch deep (the relief move's condition, [`Scheduler::relief_move`]).
    pub(in crate::scheduler::routing::select) fn far_shorter_queue(
        &self,
        j: usize,
        i: usize,
    ) -> bool {
        let Some(mine) = self.queue_batches(i).filter(|q| *q >= 1.0) else {
            return false;
        };
        self.queue_batches(j).is_some_and(|q| q * QUEUE_GAP <= mine)
    }
    /// The verdicts to store for their hysteresis: `(index, degraded, saturation)`.
    /// The verdicts the pick's write stores for their hysteresis: the chosen endpoint's (its
    /// entry is rewritten anyway) and those that differ from the stored ones ([`Board::flips`]),
    /// of the statics only. The other statics' verdicts equal what is stored, so their entries
    /// are neither copied nor compared again (that cost about 120 instructions per endpoint).
    pub(in crate::scheduler::routing::select) fn stored_verdicts(
        &self,
        chosen: usize,
    ) -> Vec<(usize, bool, Saturation)> {
        let chosen_static =
            self.statics().binary_search(&chosen).is_ok() && !self.flips.contains(&chosen);
        self.flips
            .iter()
            .copied()
            .chain(chosen_static.then_some(chosen))
            .filter_map(|i| self.verdicts.get(i).map(|v| (i, v.sticky, v.saturation)))
            .collect()
    }
}
