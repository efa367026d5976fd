//! Step 3 of the pick: [`Scheduler::walk`], placement in rendezvous order — the first
//! candidate that may take the session (breaker, quota, verdicts, bounded load, the session
//! bound) — with the steps it alone uses.

use super::*;

impl<'a> Scheduler<'a> {
    /// Whether a request admitted from the admission queue passes over `i` on its first
    /// attempt, when admission's places decide it: `None` for every other request, and when
    /// no candidate that could take a new session has a place ([`Exclusions::placeless`]);
    /// else whether `i` has none. Admission counts this process's attempts in flight exactly,
    /// where a full engine by the board ([`Board::passed_over`]) counts its own placements since
    /// the last scrape on top of the scraped load, never the answers ended since: under
    /// overload every engine is full that way after two placements, and the admitted request
    /// went home to an engine at its slots while another's slot was free (the model's room
    /// is a sum over its engines). Its engine's queue then held it first come, first served
    /// (one Envoy, `noisy_neighbor`: the quiet tenant's slowest requests waited up to 0.74 s
    /// in an engine's queue after 0.1 s in the filter's).
    pub(in crate::scheduler::routing::select) fn without_place(
        &self,
        board: &Board,
        pick: &Pick<'_>,
        i: usize,
    ) -> Option<bool> {
        let none = &pick.exclusions.placeless;
        if pick.attempt > 1 || none.is_empty() {
            return None;
        }
        let placeless = |j: usize| none.binary_search(&j).is_ok();
        let some_place = board
            .statics()
            .iter()
            .any(|&j| !placeless(j) && board.admitted(j) && !board.degraded(j) && !board.short(j));
        some_place.then(|| placeless(i))
    }

    /// Step 3: placement, the first candidate in rendezvous order that admits traffic, is not
    /// degraded (but for a due probe), not saturated while another has room, not short of
    /// quota, and within its bounded load. `None` when nothing is placeable.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::scheduler::routing::select) fn walk(
        &self,
        board: &Board,
        table: &Table,
        keyed: &placement::Keyed,
        pin: &PinVerdict,
        pick: &Pick<'_>,
        now_ms: u64,
        quota_skipped: &mut Vec<usize>,
    ) -> Option<(usize, Reason)> {
        let left = pin.left();
        let eligible = |i: usize| {
            board.admitted(i) && !board.degraded(i) && Some(i) != left && !board.passed_over(i)
        };
        // The eligible candidates' totals, summed when a candidate's bound first needs them:
        // a bound is never below the slack (by weight) or the endpoint's own slots (by
        // slots), so a candidate whose load stays under that is within it whatever the totals
        // (summing them visited every candidate: about 110 instructions each).
        let mut totals = None;
        let mut totals_of = || {
            *totals.get_or_insert_with(|| {
                board
                    .plain_totals(left)
                    .unwrap_or_else(|| eligible_totals(board, left, eligible))
            })
        };
        // The sessions placed over the same candidates (the session bound's S), summed when
        // a busy candidate first needs it.
        let mut total_sessions = None;
        let mut passed = Passed::default();
        // A later turn without a pin here: its home, as a pin would be (see `Pick`), and by the
        // pin's quota rule: passed over only for a certain 429, not for the reserve that keeps
        // new sessions off a key (a replica that did not serve the last turn would otherwise
        // move it from a key with quota to another with quota).
        let as_pin = pick.follow_up && pick.attempt <= 1 && matches!(pin, PinVerdict::None);
        for i in self.order(board, table, keyed, now_ms) {
            if Some(i) == left {
                passed.unavailable = true;
                continue;
            }
            if as_pin && !board.degraded(i) {
                // A saturated endpoint (by its engine's scrape, with hysteresis) that new
                // sessions pass over is passed over here too: the session's first turn, on
                // whichever replica, went past it while it was saturated, and a replica
                // without a pin cannot tell. Sent home regardless, such turns reached a small
                // full engine without their conversation cached (mixed fleet near saturation,
                // three replicas: 215 later turns placed there, its median latency 4.0 s
                // against 0.6 s with the pass-over). Only what every replica reads alike
                // decides it (`Board::passed_over_alike`): "no free slot", counting this
                // replica's own placements, turned with every answer and moved a quarter of
                // the later turns between a 4-slot engine and the next of their order.
                if board.admitted(i) && board.passed_over_alike(i) {
                    passed.saturated = true;
                    continue;
                }
                if board.admitted(i) && !board.certain_429(i) {
                    return Some((i, passed.reason(pin, pick.attempt)));
                }
                if board.admitted(i) && !quota_skipped.contains(&i) {
                    quota_skipped.push(i);
                }
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
            if board.admitted(i) && board.short(i) && !quota_skipped.contains(&i) {
                quota_skipped.push(i);
            }
            if !board.admitted(i) || board.short(i) {
                passed.unavailable = true;
                continue;
            }
            let passed_over = self
                .without_place(board, pick, i)
                .unwrap_or_else(|| board.passed_over(i));
            if passed_over {
                passed.saturated = true;
                continue;
            }
            // The last server of another model keeps half of its placements for that model, and
            // takes the others only as the lightest (see [`last_servers`]).
            if board.captive(i) && self.relief_passes_over(board, keyed, i) {
                passed.saturated = true;
                continue;
            }
            let load = f64::from(board.load_of(i));
            let floor = if board.by_slots {
                f64::from(board.slots(i))
            } else {
                self.cfg.bounded_load_slack as f64
            };
            let over_load = load + 1.0 > floor && !self.within_load(board, i, totals_of());
            // Debug builds (every test) check the floor: the bound itself gives the same answer.
            debug_assert_eq!(
                over_load,
                !self.within_load(board, i, totals_of()),
                "floor {floor}"
            );
            if over_load {
                passed.spilled.get_or_insert(i);
                continue;
            }
            // The session bound reads the totals only for counted new sessions, and only
            // once a candidate is busy (it passes no idle one over).
            if self.session_busy(board, i, &mut totals_of) && {
                let totals = totals_of();
                self.over_session_bound(board, i, totals, &mut total_sessions, &eligible)
            } {
                passed.spilled.get_or_insert(i);
                let totals = totals_of();
                // Passed over for the sessions placed there: the spill goes where the counts
                // say there is room (the least counted), else on in the prefix's order.
                let fits = |j: usize| {
                    self.takes_new(board, keyed, j, left, totals)
                        && !self.over_session_bound(
                            board,
                            j,
                            totals,
                            &mut total_sessions.clone(),
                            &eligible,
                        )
                };
                if let Some(t) = self.session_spill_target(board, keyed, &eligible, fits) {
                    return Some((t, passed.reason(pin, pick.attempt)));
                }
                continue;
            }
            return Some((i, passed.reason(pin, pick.attempt)));
        }
        passed.spilled.map(|i| (i, Reason::Spill))
    }

    /// The walk's order: the rendezvous order of `keyed`, or a drawn one for a request without
    /// a session over many candidates ([`placement::Draws`]: each drawn candidate taken with
    /// probability score ÷ configured weight; past the draws, on in `keyed`'s order without
    /// those already given).
    pub(super) fn order<'k>(
        &'k self,
        board: &'k Board,
        table: &'k Table,
        keyed: &'k placement::Keyed,
        now_ms: u64,
    ) -> impl Iterator<Item = usize> + 'k {
        let cfg = self.cfg;
        let statics = board.statics();
        let accept = acceptance(cfg, statics, table, now_ms);
        // Not drawn: no draws (no weights to draw from), the rendezvous order at once.
        let cumulative: &[f64] = if board.drawn {
            &board.shared.cumulative
        } else {
            &[]
        };
        let mut draws = placement::Draws::new(keyed.session_key(), cumulative, accept);
        let mut rest = None;
        std::iter::from_fn(move || {
            if rest.is_none() {
                if let Some(at) = draws.next() {
                    return statics.get(at).copied();
                }
                rest = Some(keyed.lazy());
            }
            let taken = &draws.taken;
            rest.as_mut()?
                .find(|i| !taken.iter().any(|&at| statics.get(at) == Some(i)))
        })
    }

    /// Whether `i`'s load + 1 is within its bounded-load limit (by slots where every
    /// candidate's are known), given the walk's `(load, weight, slots)` totals.
    pub(super) fn within_load(
        &self,
        board: &Board,
        i: usize,
        (load, weight, slots): (u64, f64, u64),
    ) -> bool {
        let limit = if board.by_slots {
            capacity::slot_limit(load, board.slots(i), slots, self.cfg.bounded_load_epsilon)
        } else {
            placement::load_limit(load, board.weight(i), weight, self.cfg)
        };
        f64::from(board.load_of(i)) + 1.0 <= limit
    }

    /// Whether the walk would place a new session on `i` but for the session bound: not the
    /// pin left, admitted, not degraded, not short, not passed over (saturated), not a captive
    /// kept for its model, within its bounded load.
    pub(super) fn takes_new(
        &self,
        board: &Board,
        keyed: &placement::Keyed,
        i: usize,
        left: Option<usize>,
        totals: (u64, f64, u64),
    ) -> bool {
        let kept_for_its_model = board.captive(i) && self.relief_passes_over(board, keyed, i);
        Some(i) != left
            && board.admitted(i)
            && !board.degraded(i)
            && !board.short(i)
            && !board.passed_over(i)
            && !kept_for_its_model
            && self.within_load(board, i, totals)
    }

    /// Where a new session goes that the session bound passed over: `None` when no candidate
    /// `fits` (takes a new session within its bounds), else the `eligible` candidate that fits
    /// with the fewest sessions counted per unit of weight, ties in the prefix's order. The
    /// counts are of every model's sessions, so an endpoint that also serves another model's
    /// sessions looks as full as it is.
    pub(super) fn session_spill_target(
        &self,
        board: &Board,
        keyed: &placement::Keyed,
        eligible: &impl Fn(usize) -> bool,
        fits: impl Fn(usize) -> bool,
    ) -> Option<usize> {
        let counts = board.sessions?;
        let mut least: Option<(usize, f64)> = None;
        for j in keyed.lazy() {
            let w = board.weight(j);
            if !eligible(j) || w <= 0.0 || !fits(j) {
                continue;
            }
            let per_weight = self.cfg.endpoints.get(j).map_or(0.0, |e| counts.of(e.id)) / w;
            if least.is_none_or(|(_, l)| per_weight < l) {
                least = Some((j, per_weight));
            }
        }
        least.map(|(j, _)| j)
    }

    /// Whether the session bound can pass over `i`: `i` is busy. Where the loads are the
    /// engines' (scraped: every replica reads the same), at [`sessions::SESSION_BUSY_LOAD`] or
    /// half its slots; where they are this process's own in-flight counts, by its share of
    /// the walk's `totals` ([`sessions::busy_by_share`]), so that a replica seeing a third of
    /// the traffic decides as one Envoy would (the totals are summed only then, and only for
    /// a candidate holding [`sessions::SESSION_BUSY_FLOOR`]).
    pub(super) fn session_busy(
        &self,
        board: &Board,
        i: usize,
        totals: &mut impl FnMut() -> (u64, f64, u64),
    ) -> bool {
        if board.sessions.is_none() {
            return false;
        }
        let load = board.load_of(i);
        if board.own_loads() {
            if load < sessions::SESSION_BUSY_FLOOR {
                return false;
            }
            let (total_load, total_weight, _) = totals();
            return sessions::busy_by_share(load, total_load, board.weight(i), total_weight);
        }
        sessions::busy(load, board.slots(i), sessions::SESSION_BUSY_LOAD)
    }

    /// Whether a new session placed by prefix passes over `i` for the sessions already
    /// placed there (see `sessions`): its count + 1 over `(1 + SESSION_EPSILON) × (S + 1) ×`
    /// its weight share + the slack (on own counts [`sessions::own_session_limit`]: over
    /// `(1 + SESSION_EPSILON) × S ×` the share, the slack a floor), S summed over the
    /// `eligible` candidates into `total` the
    /// first time (an idle walk never sums it). False without counts (pins, follow-ups,
    /// session keys) and while `i` is not busy. `totals`: the walk's `(load, weight, slots)`.
    pub(in crate::scheduler::routing::select) fn over_session_bound(
        &self,
        board: &Board,
        i: usize,
        totals: (u64, f64, u64),
        total: &mut Option<f64>,
        eligible: &impl Fn(usize) -> bool,
    ) -> bool {
        let Some(counts) = board.sessions else {
            return false;
        };
        let Some(id) = self
            .cfg
            .endpoints
            .get(i)
            .map(|e| e.id)
            .filter(|_| self.session_busy(board, i, &mut || totals))
        else {
            return false;
        };
        let total = *total.get_or_insert_with(|| {
            board
                .weights
                .iter()
                .filter(|&&(j, _, _)| eligible(j))
                .map(|&(_, id, _)| counts.of(id))
                .sum::<f64>()
        });
        // Own counts (no engine scraped): the scale-free limit, as the busy test.
        let limit = if board.own_loads() {
            sessions::own_session_limit
        } else {
            sessions::session_limit
        };
        let limit = limit(total, board.weight(i), totals.1, sessions::SESSION_EPSILON);
        counts.of(id) + 1.0 > limit
    }
}
