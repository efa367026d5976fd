//! The pick's steps, top to bottom: `board` (what the decision knows of every candidate:
//! weights, verdicts, admission, quota, load) → `pin_verdict` (a live pin kept, broken or moved)
//! → `walk` (rendezvous order, skipping what cannot take a new session; probes) → `fallback` →
//! `settle` (the reason, the affinity result, whether a success pins).
//! (Step 1, step 3 and the `Board` they all read are the child modules `gather`, `walk` and
//! `board`; the per-worker board memo is `memo`. No unit tests here, see `tests.rs`.)

use super::*;

mod board;
mod gather;
mod memo;
mod walk;

use board::*;
use gather::*;
use memo::*;

impl<'a> Scheduler<'a> {
    /// The decision, read-only over a table snapshot, in four named steps (see the module doc):
    /// [`Scheduler::board`] (what every endpoint may do: weights, verdicts, quota, breaker
    /// admission), [`Scheduler::pin_verdict`] (keep, break or move a live pin),
    /// [`Scheduler::walk`] (placement in rendezvous order, with the probe decision), and
    /// [`Scheduler::settle`] (the labels and whether a success pins).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn choose(
        &self,
        table: &Table,
        candidates: &[usize],
        pick: &Pick<'_>,
        pinned: Option<u32>,
        engines: &Engines,
        now_ms: u64,
    ) -> Result<Choice, NoEndpoint> {
        let bcfg = self.breaker_config();
        if let Some(choice) = self.drawn_choice(table, candidates, pick, engines, now_ms, &bcfg) {
            return Ok(choice);
        }
        let mut board = self.board(table, candidates, pick, engines, now_ms, &bcfg)?;
        let pinned_index = pinned.and_then(|id| self.cfg.endpoint_index(id));
        board.pinned = pinned_index;
        // A session whose instructions make a prefix key is placed by that key: the same
        // candidates, weights, exclusions and bounded load, in the prefix's rendezvous order
        // (see `placement`, "Placement by prefix"). The key is its home on every turn, also
        // once pinned, so that a pin cookie, `return_home` and a broken pin's next place all
        // mean the application's endpoint, as they would on a replica without the pin.
        let prefix_key = (self.cfg.prefix_placement && pick.session.is_some())
            .then(|| pick.prefix.get())
            .flatten();
        // A prefix whose home is a small engine (see `Board::small`) places its sessions by
        // their own keys: what every replica computes alike from the slots the engines showed,
        // whichever turn it is, where the small home's fullness, read by each replica at its
        // own scrape, sent one session's turns to different endpoints (mixed fleet, three
        // replicas: the most popular application, a third of the sessions, homed on a 4-slot
        // engine).
        let prefix_key = prefix_key.filter(|&k| {
            board.most_slots == 0 || {
                let keyed = placement::Keyed::seeded(k, &board.weights, board.seeds());
                !keyed
                    .first(|i| !board.degraded(i))
                    .is_some_and(|h| board.small(h))
            }
        });
        let key = prefix_key.unwrap_or(pick.session.unwrap_or(pick.nonce));
        let by_prefix = prefix_key.is_some() && pinned.is_none();
        // The session's home: the first non-degraded endpoint of its rendezvous order.
        let keyed = placement::Keyed::seeded(key, &board.weights, board.seeds());
        // A function of the key, the weights and the degraded flags alone: kept by the board
        // memo for the keys it placed while they stay the same (an affinity hit then weighs
        // no other endpoint).
        let memo = board
            .from_memo
            .then(|| self.cache.and_then(|c| c.try_borrow_mut().ok()))
            .flatten();
        // A drawn order has no home (its first is drawn by the walk).
        let kept_home = if board.drawn {
            Some(None)
        } else {
            memo.as_ref().and_then(|c| c.board.home_of(key))
        };
        // Its first pass too, when it was the whole search: a failover's next attempt takes
        // the second of the order from the kept hashes (see `Keyed::second`).
        let kept_pass = match (&memo, board.drawn || board.any_degraded) {
            (Some(c), false) => c.board.pass_of(key),
            _ => None,
        };
        drop(memo);
        if let Some(pass) = kept_pass {
            keyed.restore_pass(pass);
        }
        let home = kept_home.unwrap_or_else(|| {
            let home = if board.any_degraded {
                keyed.first(|i| !board.degraded(i))
            } else {
                // Every candidate is not degraded: the home is the first of the order, which
                // the walk starts from (one search for both).
                keyed.first_of_all()
            };
            if let Some(mut c) = board
                .from_memo
                .then(|| self.cache.and_then(|c| c.try_borrow_mut().ok()))
                .flatten()
            {
                c.board.keep_home(key, home);
                if !board.any_degraded {
                    if let Some(pass) = keyed.pass() {
                        c.board.keep_pass(key, pass);
                    }
                }
            }
            home
        });
        // Debug builds (every test) check a kept home against the search.
        if cfg!(debug_assertions) && kept_home.is_some() && !board.drawn {
            check_kept_home(&board, key, kept_home, kept_pass);
        }
        if let Some(id) = pick.holder {
            return holder_choice(&board, self.cfg.endpoint_index(id), home);
        }
        let mut quota_skipped = Vec::new();
        let pin = self.pin_verdict(&board, pick, pinned_index, now_ms, &mut quota_skipped);
        if let PinVerdict::Keep(p) = pin {
            return Ok(kept_pin(p, home, &board, quota_skipped));
        }
        // A later turn without a pin here goes home as a pin would, past a full home that new
        // sessions pass over (see `walk`): relieved as a pin would be when its home is the
        // last server of another model (`relief_move`).
        let as_pin = pick.follow_up && pick.attempt <= 1 && pin == PinVerdict::None;
        // A new placement (or a pinned session placed again) walks the order weighted by the
        // keys' stated limits; a later turn without a pin goes home by the plain weights (see
        // `quota::weigh_by_limits`).
        let limit_weights = (self.cfg.quota_aware
            && pick.session.is_some()
            && !(pick.follow_up && pin == PinVerdict::None))
            .then(|| {
                quota::weigh_by_limits(&board.weights, |i| {
                    table
                        .entries
                        .get(i)
                        .map_or((0, 0), |(_, st)| st.quota.limits())
                })
            })
            .flatten();
        // The same candidates in the same positions, so the board's seeds still align.
        let by_limits = limit_weights
            .as_deref()
            .map(|w| placement::Keyed::seeded(key, w, board.seeds()));
        let keyed = by_limits.as_ref().unwrap_or(&keyed);
        let relieved_home = home.filter(|&h| as_pin && self.relief_move(&board, pick, h, now_ms));
        let mut pin = relieved_home.map_or(pin, PinVerdict::Relieve);
        let skipped_before = quota_skipped.clone();
        let mut walked = self.walk(&board, table, keyed, &pin, pick, now_ms, &mut quota_skipped);
        // A relief move goes only where the queue is far shorter; else the pin stays (a later
        // turn without one goes home as before).
        if let PinVerdict::Relieve(p) = pin {
            let taken = walked.is_some_and(|(e, r)| {
                r != Reason::Spill && e != p && board.far_shorter_queue(e, p)
            });
            if !taken {
                if relieved_home.is_none() {
                    return Ok(kept_pin(p, home, &board, skipped_before));
                }
                pin = PinVerdict::None;
                quota_skipped = skipped_before;
                walked = self.walk(&board, table, keyed, &pin, pick, now_ms, &mut quota_skipped);
            }
        }
        let (endpoint, reason) = match walked.or_else(|| fallback(&board, keyed, &pin)) {
            Some(c) => c,
            None => return Err(NoEndpoint::Exhausted),
        };
        Ok(self.settle(
            &board,
            pick,
            pinned_index,
            &pin,
            (endpoint, reason),
            home,
            quota_skipped,
            by_prefix,
        ))
    }

    /// A drawn decision (a request without a session over more than `DRAWN_FROM`
    /// candidates) without a board, when its first drawn candidates settle it: each drawn
    /// candidate is judged alone (breaker, request exclusions, quota, verdict, in-flight
    /// against the bounded load's slack), so the decision costs what it draws, not the fleet.
    /// `None` (the caller builds the board and walks) when anything needs the others:
    /// scraped loads, a follow-up or holder, a drawn candidate degraded, saturated, probing
    /// or past the slack, a degraded endpoint stored anywhere (the relief of a last server),
    /// or nothing taken within the draws. It takes the candidate the board's walk over the
    /// same draws would; the verdicts it stores are the chosen endpoint's alone (the others'
    /// flips are stored by the next decision that judges them).
    fn drawn_choice(
        &self,
        table: &Table,
        candidates: &[usize],
        pick: &Pick<'_>,
        engines: &Engines,
        now_ms: u64,
        bcfg: &BreakerConfig,
    ) -> Option<Choice> {
        let cfg = self.cfg;
        if pick.session.is_some() || pick.holder.is_some() || pick.follow_up {
            return None;
        }
        let shared = self.statics(pick.model);
        let statics: &[usize] = &shared.indexes;
        if statics.len() <= placement::DRAWN_FROM || engines.loads.iter().any(Option::is_some) {
            return None;
        }
        let stored_degraded = match self.cache.and_then(|c| c.try_borrow().ok()) {
            Some(c) => c.lent_degraded(table.entries.len()),
            None => None,
        }
        .unwrap_or_else(|| table.entries.iter().filter(|(_, st)| st.degraded).count());
        if stored_degraded > 0 {
            return None;
        }
        let references = self.peer_references(table);
        let accept = acceptance(cfg, statics, table, now_ms);
        let quotas = QuotaView {
            table: cfg.quota_aware.then_some(table),
            estimate: pick.quota_estimate(crate::scheduler::routing::quota::BYTES_PER_TOKEN),
            rule: self.quota_rule(),
            now_ms,
        };
        let mut quota_skipped = Vec::new();
        let mut unavailable = false;
        for at in placement::Draws::new(pick.nonce, &shared.cumulative, accept) {
            let i = *statics.get(at)?;
            let (_, st) = table.entries.get(i)?;
            // In the walk's order of checks: degraded (a probe may be due), unavailable
            // (breaker, exclusions, quota), saturated, load.
            let reference = references.get(i).copied().flatten();
            let v = signals::judge_with(table, cfg, i, reference, None, None, None, now_ms);
            if v.degraded {
                return None;
            }
            let admission = candidates
                .binary_search(&i)
                .ok()
                .map(|_| st.breaker.peek(now_ms, bcfg));
            match admission {
                Some(Admission::Normal) => {}
                Some(Admission::Probe { .. }) => return None,
                Some(Admission::Rejected { .. }) | None => {
                    unavailable = true;
                    continue;
                }
            }
            if quotas.short_at(i) {
                if !quota_skipped.contains(&i) {
                    quota_skipped.push(i);
                }
                unavailable = true;
                continue;
            }
            let load = st.load(now_ms, cfg.in_flight_max_age_ms);
            if v.saturated() || f64::from(load) + 1.0 > cfg.bounded_load_slack as f64 {
                return None;
            }
            let reason = if pick.attempt > 1 || unavailable {
                Reason::Backup
            } else {
                Reason::Home
            };
            quota_skipped.retain(|&j| j != i);
            return Some(Choice {
                endpoint: i,
                reason,
                affinity: AffinityResult::None,
                // A failover's success re-pins the session where it was served (its newest
                // prefix is cached there; `docs/routing.md`, "After a failover").
                pin_on_success: true,
                broke_pin_of: None,
                moved: None,
                home: None,
                verdicts: vec![(i, v.sticky, v.saturation)],
                quota_skipped,
                by_prefix: false,
            });
        }
        None
    }

    /// Step 2: what becomes of a live pin. Kept, unless staying is a certain 429 (placed
    /// again, the pin untouched), its endpoint is degraded (the pin is broken), or it is the
    /// last server of another model with a far longer queue than another candidate's
    /// (relieved). A pin on a saturated engine stays: moves off it measured fewer cached
    /// tokens for no better p99 (`docs/routing.md`, "Judging endpoints").
    pub(super) fn pin_verdict(
        &self,
        board: &Board,
        pick: &Pick<'_>,
        pinned: Option<usize>,
        now_ms: u64,
        quota_skipped: &mut Vec<usize>,
    ) -> PinVerdict {
        let Some(p) = pinned.filter(|&p| board.admitted(p)) else {
            return PinVerdict::None;
        };
        if board.certain_429(p) {
            quota_skipped.push(p);
            return PinVerdict::None;
        }
        if board.degraded(p) {
            return PinVerdict::Break(p);
        }
        if self.relief_move(board, pick, p, now_ms) {
            return PinVerdict::Relieve(p);
        }
        PinVerdict::Keep(p)
    }

    /// Whether a session of the request's model on captive `p` (the last healthy server of
    /// another model, [`last_servers`]) moves off it: `p`'s queue is at least a batch deep and
    /// another candidate that could take it (admitted, not degraded, not short, not captive)
    /// has a queue at most 1 / [`QUEUE_GAP`] of it in batches, and the session was not moved
    /// for load within its TTL. Why: the last server takes every session of its other model
    /// from the degraded peer, on top of its own; on the bench's `slow` run its queue (20–40
    /// waiting on 16 slots for 6 s while its peers had a few) was most of the p99 tail, and
    /// the sessions of the model that others serve were half of its load.
    pub(super) fn relief_move(
        &self,
        board: &Board,
        pick: &Pick<'_>,
        p: usize,
        now_ms: u64,
    ) -> bool {
        if !board.captive(p) || pick.attempt > 1 {
            return false;
        }
        let Some(session) = pick.session else {
            return false;
        };
        let target = board.statics().iter().any(|&j| {
            j != p
                && board.admitted(j)
                && !board.degraded(j)
                && !board.short(j)
                && !board.captive(j)
                && board.far_shorter_queue(j, p)
        });
        if !target {
            return false;
        }
        // The moves table holds marks younger than the affinity TTL only.
        let marked = self.moves().lookup(session, now_ms).and_then(move_reason);
        marked != Some(MoveReason::Saturated)
    }

    /// Whether a placement passes over captive `i` for relief ([`Board::relief_passes_over`]
    /// with the session's [`reserved`] coin).
    fn relief_passes_over(&self, board: &Board, keyed: &placement::Keyed, i: usize) -> bool {
        let id = self.cfg.endpoints.get(i).map_or(0, |e| e.id);
        board.relief_passes_over(i, reserved(keyed.session_key(), id))
    }

    /// The probe decision: a degraded endpoint gets a first attempt of a new session (a first
    /// turn, unpinned) once its probe interval (with backoff) has passed, if it admits traffic
    /// and has quota. A later turn is never a probe, pinned here or not: its history is cached
    /// where its session lives, and with several replicas most later turns reach a replica
    /// that holds no pin for them — as probes they paid a full prefill on the slow endpoint
    /// (the bench's `slow` run, three replicas: 3.9–4.5 s, nothing cached).
    /// Overdue verdicts are not probed (the hits in flight are probes already).
    ///
    /// Where the engine is scraped, the replicas time their probes alike: the interval runs
    /// from the engine's last decoding by its scrape (`EngineLoad::decoded_at_ms`) when that
    /// is later than this replica's own last probe, and no probe goes while the scrape shows
    /// the engine running anything. Each replica used to probe on its own timer, so three
    /// replicas sent three times one Envoy's probes (the bench's `slow` run: 6 requests to the
    /// slowed engine after detection against 2); a probe any of them sends is evidence for
    /// all, through the engine's pace. And the interval doubles after the fleet's probes as
    /// that decoding counts them ([`placement::fleet_probes`]), not after this replica's own
    /// alone: three replicas probe about as often as one Envoy.
    pub(super) fn probe_due(
        &self,
        board: &Board,
        table: &Table,
        i: usize,
        pick: &Pick<'_>,
        now_ms: u64,
    ) -> bool {
        let sticky = board.verdicts.get(i).is_some_and(|v| v.sticky);
        let load = board.verdicts.get(i).and_then(|v| v.load);
        // The interval runs from this replica's last probe, or from the engine's last
        // decoding by its scrape (another replica's probe), whichever is later.
        let since = load.and_then(|l| l.decoded_at_ms).unwrap_or(0);
        // The interval doubles after every probe the fleet sent, as the engine's decoding shows
        // them ([`placement::fleet_probes`]), not only after this replica's own.
        // And the replica whose work the engine did last goes first: the others wait two scrape
        // intervals more, by when its probe shows running in their scrapes. The fleet's
        // schedule is every replica's, so they would all be due at once, and two probes went
        // within one scrape interval (the zipf bench's `slow` run: 32.8 and 33.0 s).
        let scrape_ms = self
            .cfg
            .endpoints
            .get(i)
            .and_then(|e| e.metrics.as_ref())
            .map_or(0, |m| m.interval_ms);
        let due = table.entries.get(i).is_some_and(|(_, st)| {
            let probes =
                st.degraded_probes
                    .max(placement::fleet_probes(self.cfg, st.degraded_at_ms, since));
            let others = since > st.degraded_own_end_ms.saturating_add(2 * scrape_ms);
            let after = if others { 2 * scrape_ms } else { 0 };
            now_ms.saturating_sub(st.degraded_probe_ms.max(since))
                >= placement::probe_interval(self.cfg, probes).saturating_add(after)
        });
        // Where its engine is scraped: idle by its last scrape. Another replica's probe still
        // running there fetches the evidence this one would, for every replica (its pace).
        let idle = load.is_none_or(|l| l.running.unwrap_or(0) == 0 && l.waiting.unwrap_or(0) == 0);
        sticky
            && due
            && idle
            && board.admitted(i)
            && !board.short(i)
            && pick.attempt <= 1
            && board.pinned.is_none()
            && !pick.follow_up
    }

    /// Step 4: the labels of the decision and whether a success pins the session there.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn settle(
        &self,
        board: &Board,
        pick: &Pick<'_>,
        pinned: Option<usize>,
        pin: &PinVerdict,
        (endpoint, mut reason): (usize, Reason),
        home: Option<usize>,
        mut quota_skipped: Vec<usize>,
        by_prefix: bool,
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
            PinVerdict::Relieve(p) if !kept => Some(*p),
            _ => None,
        };
        let affinity = match (pick.session, pinned, reason) {
            (None, _, _) => AffinityResult::None,
            (Some(_), _, Reason::AffinityHit) => AffinityResult::Hit,
            (Some(_), _, Reason::PinBreak) => AffinityResult::PinBreak,
            (Some(_), Some(_), Reason::Saturated) if moved.is_some() => AffinityResult::Saturated,
            (Some(_), Some(_), _) => AffinityResult::Miss,
            (Some(_), None, Reason::Home | Reason::Spill) if by_prefix => AffinityResult::Prefix,
            (Some(_), None, Reason::Home) => AffinityResult::Home,
            (Some(_), None, Reason::Spill) => AffinityResult::Spill,
            (Some(_), None, _) => AffinityResult::Backup,
        };
        if board.probing(endpoint) && reason != Reason::AffinityHit {
            reason = Reason::HalfOpenProbe;
        }
        let pin_on_success = match reason {
            Reason::AffinityHit => true,
            // A new session placed by prefix that spilled: a popular application spreading.
            // Its own turns, and now its instructions, are cached where it was served.
            Reason::Spill if by_prefix => true,
            // Spilled by slots (every candidate's capacity known: the fleet is past its slots
            // and the home past its share). Its next turn would find the home as full, and
            // sending it there would re-prefill the turn the spill place has cached.
            Reason::Spill if board.by_slots => true,
            // Spilled while its home was kept off for its quota: its next turn would go home
            // as a pin would (only a certain 429 passes a home over), a move onto a key it was
            // kept off, that re-prefills the turn cached here (the quota bench, `quota7-3` ×3:
            // two sessions spilled from their short homes, then moved home between keys that
            // both had quota).
            Reason::Spill if home.is_some_and(|h| quota_skipped.contains(&h)) => true,
            // A new session's first turn that spilled: its turn is cached where it was served
            // and nothing at its home, which it would otherwise go back to on its next turn (on
            // another replica, without a pin cookie: the quota bench's `confirm9-quota` ×3,
            // three such moves between keys that both had quota).
            Reason::Spill if !pick.follow_up => true,
            // A probe, or a later turn's burst that spilled: the session's place stays its home.
            Reason::DegradedProbe | Reason::Spill => false,
            // A failover or a move: the session stays where it was served.
            _ => true,
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
            verdicts: board.stored_verdicts(endpoint),
            quota_skipped,
            by_prefix,
        }
    }
}

/// The choice of a request only its state's holder can serve ([`Pick::holder`]): the holder
/// if its breaker admits this attempt, whatever its verdicts or quota (nowhere else is better
/// than a certain `previous_response_not_found`); else the holder's own cooling down, or
/// `Exhausted` when the request already tried it or it cannot serve the request at all.
pub(super) fn holder_choice(
    board: &Board,
    holder: Option<usize>,
    home: Option<usize>,
) -> Result<Choice, NoEndpoint> {
    let Some(h) = holder else {
        return Err(NoEndpoint::Exhausted);
    };
    match board.admission_of(h) {
        Some(Admission::Normal | Admission::Probe { .. }) => Ok(Choice {
            reason: if board.probing(h) {
                Reason::HalfOpenProbe
            } else {
                Reason::AffinityHit
            },
            ..kept_pin(h, home, board, Vec::new())
        }),
        Some(Admission::Rejected {
            retry_at_ms,
            rate_limited,
        }) => Err(NoEndpoint::CoolingDown {
            retry_at_ms,
            all_rate_limited: rate_limited,
        }),
        None => Err(NoEndpoint::Exhausted),
    }
}

/// The load and weight of the walk's `eligible` candidates, summed in the board's order (the
/// configuration's, the same on every replica: the weight's rounding depends on the order, so
/// an order every replica shares, not one that needs the candidates sorted per decision).
/// The slots are summed only when placement is by slots (0 otherwise): only the bound by
/// slots (`capacity::slot_limit`) reads them. `eligible` is the walk's: admitted, not
/// degraded, not `left`, not passed over; the sums are [`Board::eligible_totals`]'s, the same
/// test with each look-up once (debug builds, every test, check them against `eligible`).
pub(super) fn eligible_totals(
    board: &Board,
    left: Option<usize>,
    eligible: impl Fn(usize) -> bool,
) -> (u64, f64, u64) {
    let totals = board.eligible_totals(left);
    if cfg!(debug_assertions) {
        let plain = plain_eligible_totals(board, eligible);
        debug_assert_eq!(
            (totals.0, totals.1.to_bits(), totals.2),
            (plain.0, plain.1.to_bits(), plain.2),
            "eligible totals"
        );
    }
    totals
}

/// [`eligible_totals`] as the walk's `eligible` says, candidate by candidate (the proof of
/// [`Board::eligible_totals`] in debug builds).
fn plain_eligible_totals(board: &Board, eligible: impl Fn(usize) -> bool) -> (u64, f64, u64) {
    let mut total_load = 0u64;
    let mut total_slots = 0u64;
    let mut total_weight = 0.0f64;
    for &(i, _, w) in board.weights.iter() {
        if !eligible(i) {
            continue;
        }
        total_load += u64::from(board.load_of(i));
        if board.by_slots {
            total_slots += u64::from(board.slots(i));
        }
        total_weight += w;
    }
    (total_load, total_weight, total_slots)
}

/// The session stays on its pinned endpoint `p` (an affinity hit).
fn kept_pin(p: usize, home: Option<usize>, board: &Board, quota_skipped: Vec<usize>) -> Choice {
    Choice {
        endpoint: p,
        reason: Reason::AffinityHit,
        affinity: AffinityResult::Hit,
        pin_on_success: true,
        broke_pin_of: None,
        moved: None,
        home,
        verdicts: board.stored_verdicts(p),
        quota_skipped,
        by_prefix: false,
    }
}

/// Nothing placeable by the walk: only degraded or left endpoints admit traffic. The first
/// other one in order (a backup), else the pinned endpoint after all.
pub(super) fn fallback(
    board: &Board,
    keyed: &placement::Keyed,
    pin: &PinVerdict,
) -> Option<(usize, Reason)> {
    let left = pin.left();
    let order = keyed.order();
    let first = order
        .iter()
        .copied()
        .find(|&i| board.admitted(i) && Some(i) != left);
    // Every candidate short of quota (the first of the order is): the key with the most
    // tokens left after its forecast use, not the first of the order, which may be a key
    // with a sixth of the others' limit that then runs dry in the next window (ties and
    // keys without a stated limit: the order).
    let roomiest = first.filter(|&f| board.short(f)).and_then(|_| {
        let mut best: Option<(usize, i128)> = None;
        for &i in &order {
            if !board.admitted(i) || Some(i) == left || board.degraded(i) || board.certain_429(i) {
                continue;
            }
            if let Some(h) = board.headroom(i) {
                if best.is_none_or(|(_, b)| h > b) {
                    best = Some((i, h));
                }
            }
        }
        best.map(|(i, _)| i)
    });
    roomiest
        .or(first)
        .map(|i| (i, Reason::Backup))
        .or_else(|| left.map(|i| (i, Reason::AffinityHit)))
}

/// The candidates (`statics`) left as the *last healthy server* of a model other than the
/// request's `model`, by index (empty when none is): an endpoint whose configured `models`
/// name another model that some other enabled endpoint serves too, all of which are degraded
/// (this decision's verdict for a candidate, the stored sticky flag for the others). It takes
/// every session of that model from its degraded peers, so the request's model, which other
/// candidates serve, is steered off it. An endpoint without a `models`
/// list serves every model and is never counted as the last server of one. Costs nothing
/// while no endpoint is degraded (one pass over the verdicts and the table).
pub(super) fn last_servers(
    cfg: &Config,
    table: &Table,
    verdicts: &[Verdict],
    statics: &[usize],
    model: Option<&str>,
) -> Vec<bool> {
    let degraded = |j: usize| {
        if statics.binary_search(&j).is_ok() {
            verdicts.get(j).is_some_and(|v| v.degraded)
        } else {
            table.entries.get(j).is_some_and(|(_, st)| st.degraded)
        }
    };
    // The common case in one linear pass: nobody degraded, by this decision or as stored.
    if !verdicts.iter().any(|v| v.degraded) && !table.entries.iter().any(|(_, st)| st.degraded) {
        return Vec::new();
    }
    let n = cfg.endpoints.len();
    let mut captive = vec![false; n];
    for &i in statics {
        let Some(models) = cfg.endpoints.get(i).and_then(|e| e.models.as_ref()) else {
            continue;
        };
        let last = models
            .iter()
            .filter(|m| Some(m.as_str()) != model)
            .any(|m| {
                let peers = cfg
                    .endpoints
                    .iter()
                    .enumerate()
                    .filter(|&(j, e)| j != i && !e.disabled && e.serves(m));
                let mut lost = false;
                for (j, _) in peers {
                    if !degraded(j) {
                        return false;
                    }
                    lost = true;
                }
                lost
            });
        if let Some(slot) = captive.get_mut(i) {
            *slot = last;
        }
    }
    captive
}

/// The placement of the session with rendezvous key `key` on captive endpoint `id` is kept
/// for the model only it still serves (see [`Board::relief_passes_over`]): a coin from the low bit
/// of the session's (salted) rendezvous hash with `id`, the same on every replica and independent of the
/// rendezvous order (which reads the high 52 bits), so half the sessions homed there are kept
/// off it. Why half: the share of the captive model in the traffic is unknown to the filter;
/// the bench's `slow` run (a fifth of the sessions on `m2`) put as many new `m1` sessions on
/// the last `m2` server after the onset as on each of its peers when placed by load alone.
pub(super) fn reserved(key: u64, id: u32) -> bool {
    crate::scheduler::state::hash::rendezvous(key ^ RESERVE_SALT, id) & 1 == 0
}

/// Salts the reservation coin's key, so that it is no function of the rendezvous keys.
const RESERVE_SALT: u64 = 0x5eed_0f1a_575e_4e00;

/// What becomes of a live pin ([`Scheduler::pin_verdict`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PinVerdict {
    /// No pin, or one that cannot serve this attempt (placed as a new session).
    None,
    Keep(usize),
    /// Degraded: the pin is broken.
    Break(usize),
    /// The last healthy server of another model, with a far longer queue than another
    /// candidate's: the session moves ([`Scheduler::relief_move`]).
    Relieve(usize),
}

impl PinVerdict {
    /// The pinned endpoint the session leaves, if any.
    pub(super) fn left(&self) -> Option<usize> {
        match self {
            PinVerdict::Break(p) | PinVerdict::Relieve(p) => Some(*p),
            _ => None,
        }
    }
}

/// What the placement walk passed over before its choice.
#[derive(Debug, Default)]
pub(super) struct Passed {
    /// Breaker, exclusion or quota (or the pin left).
    unavailable: bool,
    degraded: bool,
    saturated: bool,
    /// The first candidate over its bounded load.
    spilled: Option<usize>,
}

impl Passed {
    pub(super) fn reason(&self, pin: &PinVerdict, attempt: u32) -> Reason {
        match pin {
            PinVerdict::Break(_) => Reason::PinBreak,
            PinVerdict::Relieve(_) => Reason::Saturated,
            _ if attempt > 1 || self.unavailable => Reason::Backup,
            _ if self.degraded => Reason::Degraded,
            _ if self.saturated => Reason::Saturated,
            _ if self.spilled.is_some() => Reason::Spill,
            _ => Reason::Home,
        }
    }
}

/// The reason of a stored move mark (`Affinity` entry's endpoint field in the moves table).
pub(super) fn move_reason(code: u32) -> Option<MoveReason> {
    match code {
        1 => Some(MoveReason::Saturated),
        2 => Some(MoveReason::Degraded),
        _ => None,
    }
}

#[cfg(all(test, not(target_arch = "wasm32")))]
#[path = "lazy_tests.rs"]
mod lazy_tests;

/// A kept home (and first pass) equals what searching the rendezvous order gives (debug builds
/// only: the board memo's proof, run by every scheduler test).
fn check_kept_home(
    board: &Board,
    key: u64,
    kept_home: Option<Option<usize>>,
    kept_pass: Option<crate::scheduler::routing::table::FirstPass>,
) {
    let keyed = placement::Keyed::seeded(key, &board.weights, board.seeds());
    let searched = if board.any_degraded {
        keyed.first(|i| !board.degraded(i))
    } else {
        keyed.first_of_all()
    };
    debug_assert_eq!(Some(searched), kept_home, "kept home of {key}");
    if let (Some(pass), false) = (kept_pass, board.any_degraded) {
        debug_assert_eq!(keyed.pass(), Some(pass), "kept first pass of {key}");
    }
}
