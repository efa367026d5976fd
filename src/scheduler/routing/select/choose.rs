//! The pick's steps, top to bottom: `board` (what the decision knows of every candidate:
//! weights, verdicts, admission, quota, load) → `pin_verdict` (a live pin kept, broken or moved)
//! → `walk` (rendezvous order, skipping what cannot take a new session; probes) → `fallback` →
//! `settle` (the reason, the affinity result, whether a success pins).
//! (Over 600 lines: the four steps and the `Board` they all read, whose accessors — verdicts,
//! room by slots, waits elsewhere — are the steps' vocabulary; no unit tests here, see `tests.rs`.)

use super::*;

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
        // Every scheduler test checks a kept home against the search.
        #[cfg(test)]
        if kept_home.is_some() && !board.drawn {
            let keyed = placement::Keyed::seeded(key, &board.weights, board.seeds());
            let searched = if board.any_degraded {
                keyed.first(|i| !board.degraded(i))
            } else {
                keyed.first_of_all()
            };
            assert_eq!(Some(searched), kept_home, "kept home of {key}");
            if let (Some(pass), false) = (kept_pass, board.any_degraded) {
                assert_eq!(keyed.pass(), Some(pass), "kept first pass of {key}");
            }
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
            let v = signals::judge_with(table, cfg, i, reference, None, None, now_ms);
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

    /// Step 1: what every endpoint may do in this decision. Weights and verdicts come from
    /// every endpoint that could serve the request at all, before request exclusions and
    /// breakers, so that a failover walks the first attempt's order; breaker admission is of
    /// this attempt's candidates (`Err` when none admits).
    pub(super) fn board<'t>(
        &self,
        table: &'t Table,
        candidates: &[usize],
        pick: &Pick<'_>,
        engines: &'t Engines,
        now_ms: u64,
        bcfg: &BreakerConfig,
    ) -> Result<Board<'t>, NoEndpoint> {
        let cfg = self.cfg;
        let (loads, rooms) = (&engines.loads, &engines.rooms);
        let n = cfg.endpoints.len();
        let state = |i: usize| table.entries.get(i).map(|(_, st)| st);
        // The enabled endpoints serving the model, from the worker's memo (see `Statics`).
        let shared = self.statics(pick.model);
        let statics: &[usize] = &shared.indexes;
        let references = self.peer_references(table);
        let pace_references = signals::pace_medians(cfg, loads);
        // Requests without a session keep the full score (nothing to keep together); the
        // fastest warm latency is its yardstick, not needed by a session's placement weight.
        // Over many candidates their order is drawn (`placement::Draws`): the board holds
        // placement weights, as a session's does, and only the candidates drawn are scored
        // (`Scheduler::order`).
        let drawn = pick.session.is_none() && statics.len() > placement::DRAWN_FROM;
        let by_score = pick.session.is_none() && !drawn;
        let best_latency = if by_score {
            fastest_warm(
                statics.iter().filter_map(|&i| state(i)),
                cfg.cold_start_samples,
            )
        } else {
            None
        };
        // Nothing scraped (hosted keys, no metrics): no load, no room, in-flight counts;
        // nothing to look up per endpoint.
        let any_scraped = loads.iter().any(Option::is_some);
        // The quiet endpoints' verdicts and weights from the worker's memo, while the table
        // is the one lent by its cache (the memo is keyed by that table's write stamps), and
        // the last session decision's board (see `BoardMemo`).
        let mut cache = self.cache.and_then(|c| c.try_borrow_mut().ok());
        let lent = cache
            .as_deref_mut()
            .and_then(|c| c.lent_board(table.entries.len(), drawn));
        let (mut memo, mut board_memo, changed, medians_computed, stored_degraded) = match lent {
            Some(l) => (
                Some((l.stamps, l.quiet)),
                Some(l.board),
                l.changed,
                l.medians_computed,
                Some(l.stored_degraded),
            ),
            None => (None, None, None, 0, None),
        };
        // One static candidate's verdict (into `v`, which holds the default verdict), flip and
        // `(index, id, weight)` (`None`: not in the table), and whether they hold until its
        // entry or its peers' median changes (quiet).
        let mut one = |i: usize, v: &mut Verdict| -> Option<One> {
            let load = if any_scraped {
                loads.get(i).copied().flatten()
            } else {
                None
            };
            let reference = references.get(i).copied().flatten();
            // A quiet endpoint kept by the memo: its sticky flag is its verdict (not overdue,
            // saturation unknown, no load).
            let hit = match (&mut memo, load) {
                (Some((stamps, quiet)), None) => quiet.get(i, stamps.get(i), reference),
                _ => None,
            };
            if let Some((id, weight, sticky, flip)) = hit {
                if sticky {
                    v.sticky = true;
                    v.degraded = true;
                }
                let w = match (by_score, cfg.endpoints.get(i), state(i)) {
                    (false, _, _) => Some(weight),
                    (true, Some(ep), Some(st)) => {
                        Some(score(ep.weight, st, best_latency, cfg, now_ms).score)
                    }
                    _ => None,
                };
                return Some(One {
                    flip,
                    weight: w.map(|w| (i, id, w)),
                    quiet: true,
                });
            }
            let (Some(ep), Some(st)) = (cfg.endpoints.get(i), state(i)) else {
                return None;
            };
            let pace_reference = pace_references.get(i).copied().flatten();
            *v = signals::judge_with(table, cfg, i, reference, pace_reference, load, now_ms);
            let flip = st.degraded != v.sticky || st.saturation != v.saturation;
            let key = memo
                .as_ref()
                .and_then(|(stamps, _)| stamps.get(i).copied().flatten());
            let keep = match (&mut memo, key) {
                (Some((_, quiet)), Some(key)) if signals::quiet(st, load.as_ref(), cfg) => {
                    Some((quiet, key))
                }
                _ => None,
            };
            let quiet = keep.is_some();
            // A request without a session weighs by score: the placement weight only to
            // keep it.
            let weight =
                (!by_score || keep.is_some()).then(|| placement::weigh(ep.weight, st, cfg, now_ms));
            if let (Some((quiet, key)), Some(w)) = (keep, weight) {
                quiet.keep(n, i, key, reference, v, flip, w);
            }
            let w = match weight {
                Some(w) if !by_score => w,
                _ => score(ep.weight, st, best_latency, cfg, now_ms).score,
            };
            Some(One {
                flip,
                weight: Some((i, ep.id, w)),
                quiet,
            })
        };
        // A session decision (or a drawn one) without scraped loads over the same model as the
        // memo's board: only the positions that changed since are computed (see `BoardMemo`).
        let memo_fits = !by_score && !any_scraped;
        // A decision the memo does not serve leaves it as it is: the entries changed since
        // are carried to the next one it serves (this one may end early, `admit` below).
        let mut changed = changed;
        if let Some(bm) = board_memo.as_deref_mut().filter(|_| !memo_fits) {
            bm.carry(changed.take(), n);
        }
        let reused = match (memo_fits, board_memo.as_deref_mut(), changed.as_deref()) {
            (true, Some(bm), Some(changed)) => bm.update(
                pick.model,
                n,
                changed,
                &references,
                medians_computed,
                &mut one,
            ),
            _ => None,
        };
        let mut full_memo = memo;
        let reused_board = reused.is_some();
        let mut from_memo = reused_board;
        let (verdicts, weights, flips, any_degraded) = match reused {
            Some(board) => board,
            None => {
                let mut verdicts = vec![Verdict::default(); n];
                let mut weights = Vec::with_capacity(statics.len());
                // The endpoints whose verdict differs from the stored one (rare: see `flips`).
                let mut flips = Vec::new();
                let mut degraded = 0;
                let mut live = Vec::new();
                // `one`'s body, inline (a call per endpoint cost about 90 instructions more):
                // keep the two the same (`memo_tests` compare the decisions of both).
                for &i in statics {
                    let load = if any_scraped {
                        loads.get(i).copied().flatten()
                    } else {
                        None
                    };
                    let reference = references.get(i).copied().flatten();
                    let hit = match (&mut full_memo, load) {
                        (Some((stamps, quiet)), None) => quiet.get(i, stamps.get(i), reference),
                        _ => None,
                    };
                    if let Some((id, weight, sticky, flip)) = hit {
                        if sticky {
                            if let Some(v) = verdicts.get_mut(i) {
                                v.sticky = true;
                                v.degraded = true;
                            }
                        }
                        degraded += usize::from(sticky);
                        if flip {
                            flips.push(i);
                        }
                        let w = match (by_score, cfg.endpoints.get(i), state(i)) {
                            (false, _, _) => weight,
                            (true, Some(ep), Some(st)) => {
                                score(ep.weight, st, best_latency, cfg, now_ms).score
                            }
                            _ => continue,
                        };
                        weights.push((i, id, w));
                        continue;
                    }
                    let (Some(ep), Some(st), Some(v)) =
                        (cfg.endpoints.get(i), state(i), verdicts.get_mut(i))
                    else {
                        continue;
                    };
                    let pace_reference = pace_references.get(i).copied().flatten();
                    *v =
                        signals::judge_with(table, cfg, i, reference, pace_reference, load, now_ms);
                    degraded += usize::from(v.degraded);
                    let flip = st.degraded != v.sticky || st.saturation != v.saturation;
                    if flip {
                        flips.push(i);
                    }
                    let key = full_memo
                        .as_ref()
                        .and_then(|(stamps, _)| stamps.get(i).copied().flatten());
                    let keep = match (&mut full_memo, key) {
                        (Some((_, quiet)), Some(key)) if signals::quiet(st, load.as_ref(), cfg) => {
                            Some((quiet, key))
                        }
                        _ => None,
                    };
                    if keep.is_none() {
                        live.push(i);
                    }
                    let weight = (!by_score || keep.is_some())
                        .then(|| placement::weigh(ep.weight, st, cfg, now_ms));
                    if let (Some((quiet, key)), Some(w)) = (keep, weight) {
                        quiet.keep(n, i, key, reference, v, flip, w);
                    }
                    let w = match weight {
                        Some(w) if !by_score => w,
                        _ => score(ep.weight, st, best_latency, cfg, now_ms).score,
                    };
                    weights.push((i, ep.id, w));
                }
                let (verdicts, weights, flips) =
                    (Rc::new(verdicts), Rc::new(weights), Rc::new(flips));
                // A decision the memo does not serve (no session, scraped loads) leaves it as
                // it is: the entries changed since are handed back for the next one it does.
                if let Some(bm) = board_memo.as_deref_mut().filter(|_| memo_fits) {
                    if weights.len() == statics.len() {
                        from_memo = true;
                        bm.keep(
                            pick.model,
                            statics,
                            (&verdicts, &weights, &flips),
                            live,
                            degraded,
                            &references,
                            medians_computed,
                        );
                    } else {
                        bm.valid = false;
                    }
                }
                (verdicts, weights, flips, degraded > 0)
            }
        };
        // Breaker admission of this attempt's candidates: a first attempt's candidates are the
        // statics, whose admission the board memo keeps when it was reused (a closed breaker
        // admits whatever the time; the others are asked again).
        // A later attempt's candidates lack the ones it excludes: the memo's admission is
        // brought up to date all the same (the positions its board recomputed are asked
        // again), and this attempt's own is asked of its candidates.
        let first = candidates.len() == statics.len();
        // A later attempt's candidates are the statics but the few it excludes (see
        // `Scheduler::candidates`): the memo's admission serves it with those masked
        // ([`Board::admitted`]), so a failover asks no breaker the memo keeps (asking every
        // candidate's cost about 60 instructions each).
        let excluded = if first {
            Vec::new()
        } else {
            excluded_statics(statics, pick.exclusions)
        };
        // Candidates are a subset of the statics without `excluded`: as many means the same.
        let masked = excluded.len() + candidates.len() == statics.len();
        let kept = match (reused_board, board_memo.as_deref_mut()) {
            (true, Some(bm)) => bm
                .admission(table, now_ms, bcfg)
                .filter(|_| first || (masked && bm.admits_besides(&excluded))),
            _ => None,
        };
        let excluded = if kept.is_some() { excluded } else { Vec::new() };
        // This decision's admission is the statics' that the memo keeps (a session's first
        // attempt over the memo's board).
        let keeps = memo_fits && first;
        let admission = match kept {
            Some(a) => a,
            None => {
                // Nothing kept past this point unless kept below (`admit` may answer `Err`).
                if let Some(bm) = board_memo.as_deref_mut().filter(|_| keeps) {
                    bm.keep_admission(None);
                }
                let mut open = Vec::new();
                let a = Rc::new(admit(table, candidates, n, now_ms, bcfg, &mut open)?);
                if let (Some(bm), true) = (board_memo, keeps) {
                    bm.keep_admission(Some((&a, open)));
                }
                a
            }
        };
        drop(cache);

        // Quota: short endpoints are skipped for placements, a certain 429 even by a pin.
        let estimate = pick.quota_estimate(crate::scheduler::routing::quota::BYTES_PER_TOKEN);
        let rule = self.quota_rule();
        // Judged on demand, of the endpoints a decision looks at (a pin, the walk's first few):
        // judging all cost about 110 instructions per endpoint and request.
        let quotas = QuotaView {
            table: cfg.quota_aware.then_some(table),
            estimate,
            rule,
            now_ms,
        };
        // The engines' own running + waiting where every candidate reports it (one unit for
        // all: an engine's count includes every replica's requests, an in-flight count only
        // this one's), else this replica's in-flight counts.
        let all_scraped = any_scraped
            && statics
                .iter()
                .all(|&i| loads.get(i).copied().flatten().is_some());
        // Every candidate's slots known (see `capacity`): the load is the projected one (scraped
        // running + waiting and this process's placements since), bounded by slots.
        let room: Vec<Option<Room>> = if any_scraped {
            (0..n)
                .map(|i| {
                    rooms
                        .get(i)
                        .copied()
                        .flatten()
                        .filter(|_| loads.get(i).copied().flatten().is_some())
                })
                .collect()
        } else {
            // Nothing scraped: no room anywhere (read as `None`, as a list of them would be).
            Vec::new()
        };
        let by_slots = !statics.is_empty()
            && statics.iter().all(|&i| {
                room.get(i)
                    .copied()
                    .flatten()
                    .is_some_and(|r| r.slots.is_some())
            });
        // Without scraped loads, an endpoint's load is its in-flight count: read on demand
        // ([`Board::load_of`]) rather than for every endpoint.
        let load = if any_scraped {
            (0..n)
                .map(|i| {
                    if by_slots {
                        return room.get(i).copied().flatten().map_or(0, |r| r.projected);
                    }
                    let l = loads.get(i).copied().flatten().filter(|_| all_scraped);
                    state(i).map_or(0, |st| {
                        signals::placement_load(st, l.as_ref(), now_ms, cfg.in_flight_max_age_ms)
                    })
                })
                .collect()
        } else {
            Vec::new()
        };
        // Nobody degraded, by this decision (`any_degraded`: the statics' verdicts) or as
        // stored (counted by the worker's cache when there is one): no last server.
        let stored_degraded = match stored_degraded {
            Some(count) => count > 0,
            None => table.entries.iter().any(|(_, st)| st.degraded),
        };
        // Every scheduler test checks the cache's count against the table.
        #[cfg(test)]
        assert_eq!(
            stored_degraded,
            table.entries.iter().any(|(_, st)| st.degraded)
        );
        let captive = if any_degraded || stored_degraded {
            last_servers(cfg, table, &verdicts, statics, pick.model)
        } else {
            Vec::new()
        };
        Ok(Board {
            from_memo,
            drawn,
            shared,
            sessions: engines.sessions.as_ref(),
            pinned: None,
            any_degraded,
            table,
            now_ms,
            max_age_ms: cfg.in_flight_max_age_ms,
            plain: !any_scraped,
            weights,
            verdicts,
            flips,
            quotas,
            load,
            room,
            by_slots,
            admission,
            excluded,
            captive,
        })
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

    /// Step 3: placement, the first candidate in rendezvous order that admits traffic, is not
    /// degraded (but for a due probe), not saturated while another has room, not short of
    /// quota, and within its bounded load. `None` when nothing is placeable.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn walk(
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
                    .unwrap_or_else(|| eligible_totals(board, keyed, eligible))
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
                // A full endpoint (by its engine's scrape) that new sessions pass over is
                // passed over here too: the session's first turn, on whichever replica, went
                // past it while it was full, and a replica without a pin cannot tell. Sent
                // home regardless, such turns reached a small full engine without their
                // conversation cached (mixed fleet near saturation, three replicas: 215 later
                // turns placed there, its median latency 4.0 s against 0.6 s with this rule).
                if board.admitted(i) && board.passed_over(i) {
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
            if board.passed_over(i) {
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
            // Every scheduler test checks the floor: the bound itself gives the same answer.
            #[cfg(test)]
            assert_eq!(
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
            if self.session_busy(board, i) && {
                let total_weight = totals_of().1;
                self.over_session_bound(board, i, total_weight, &mut total_sessions, &eligible)
            } {
                passed.spilled.get_or_insert(i);
                let totals = totals_of();
                let total_weight = totals.1;
                // Passed over for the sessions placed there: the spill goes where the counts
                // say there is room (the least counted), else on in the prefix's order.
                let fits = |j: usize| {
                    self.takes_new(board, keyed, j, left, totals)
                        && !self.over_session_bound(
                            board,
                            j,
                            total_weight,
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
    fn order<'k>(
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
    fn within_load(&self, board: &Board, i: usize, (load, weight, slots): (u64, f64, u64)) -> bool {
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
    fn takes_new(
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
    fn session_spill_target(
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

    /// Whether the session bound can pass over `i` (the walk sums no totals otherwise): `i`
    /// is busy ([`sessions::SESSION_BUSY_LOAD`]).
    fn session_busy(&self, board: &Board, i: usize) -> bool {
        board.sessions.is_some()
            && sessions::busy(
                board.load_of(i),
                board.slots(i),
                sessions::SESSION_BUSY_LOAD,
            )
    }

    /// Whether a new session placed by prefix passes over `i` for the sessions already
    /// placed there (see `sessions`): its count + 1 over `(1 + SESSION_EPSILON) × (S + 1) ×`
    /// its weight share + the slack, S summed over the `eligible` candidates into `total` the
    /// first time (an idle walk never sums it). False without counts (pins, follow-ups,
    /// session keys) and while `i` is not busy.
    pub(super) fn over_session_bound(
        &self,
        board: &Board,
        i: usize,
        total_weight: f64,
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
            .filter(|_| self.session_busy(board, i))
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
        let limit = sessions::session_limit(
            total,
            board.weight(i),
            total_weight,
            sessions::SESSION_EPSILON,
        );
        counts.of(id) + 1.0 > limit
    }

    /// The probe decision: a degraded endpoint gets a first attempt of a new session (a first
    /// turn, unpinned) once its probe interval (with backoff) has passed, if it admits traffic
    /// and has quota. A later turn is never a probe, pinned here or not: its history is cached
    /// where its session lives, and with several replicas most later turns reach a replica
    /// that holds no pin for them — as probes they paid a full prefill on the slow endpoint
    /// (the bench's `slow` run, three replicas: 3.9–4.5 s, nothing cached).
    /// Overdue verdicts are not probed (the hits in flight are probes already).
    pub(super) fn probe_due(
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

/// How much shorter (in batches of wait) another full candidate's queue must be for a new
/// session to pass over a full endpoint when none has room ([`Board::far_shorter_queue_elsewhere`]).
pub(super) const QUEUE_GAP: f64 = 4.0;

/// What one decision knows of every endpoint (indexes into `Config::endpoints`).
pub(super) struct Board<'t> {
    /// The verdicts and weights are the worker's board memo's, current (see `BoardMemo`).
    from_memo: bool,
    /// A request without a session over more than `placement::DRAWN_FROM` candidates: its
    /// order is drawn ([`Scheduler::order`]); `weights` are placement weights all the same.
    drawn: bool,
    /// Endpoints that could serve the request at all (enabled, serving its model; see
    /// [`Board::statics`]), as the worker's memo keeps them, with their rendezvous seeds.
    shared: Rc<Statics>,
    /// The new sessions this process placed per endpoint (see `sessions`): `Some` only for
    /// a new session placed by prefix with the session bound on (borrowed: the decision's
    /// copy would cost as many instructions as the value's bytes).
    sessions: Option<&'t sessions::Counts>,
    /// The request's pinned endpoint, if any (even one that cannot serve it now).
    pinned: Option<usize>,
    /// Some static candidate is degraded (else the home is the first of the order).
    any_degraded: bool,
    /// The table, its time and in-flight age limit: for [`Board::load_of`] when `load` is
    /// empty.
    table: &'t Table,
    now_ms: u64,
    max_age_ms: u64,
    /// Nothing is scraped: the walk's totals may be [`PlainTotals`].
    plain: bool,
    /// `(index, endpoint id, placement weight)` of the statics: the rendezvous candidates.
    weights: Rc<Vec<(usize, u32, f64)>>,
    verdicts: Rc<Vec<Verdict>>,
    /// The statics whose verdict (sticky degraded flag or saturation) differs from the one
    /// stored in their entry, in index order: the only ones besides the chosen endpoint whose
    /// verdict the pick's write stores (see [`Board::stored_verdicts`]).
    flips: Rc<Vec<usize>>,
    /// Every endpoint's remembered quota against this request (`quota_aware`): see
    /// [`Board::short`] and [`Board::certain_429`].
    quotas: QuotaView<'t>,
    /// The load bounded-load placement weighs (see `signals::placement_load`), or the
    /// projected load when `by_slots`; empty when nothing is scraped (the in-flight count,
    /// read on demand).
    load: Vec<u32>,
    /// Each endpoint's projected load and slots, where scraped (see `capacity`).
    room: Vec<Option<Room>>,
    /// Every static candidate's slots are known: bounded load by slots
    /// (`capacity::slot_limit`) rather than by weight.
    by_slots: bool,
    /// Breaker admission of this attempt's candidates (`None`: not a candidate), or of the
    /// statics as the memo keeps it, with `excluded` (the statics this attempt excludes, index
    /// order; empty otherwise) masked.
    admission: Admissions,
    excluded: Vec<usize>,
    /// The candidates left as the last healthy server of another model than the request's
    /// (see [`last_servers`]), by index; empty when none is (no endpoint degraded).
    captive: Vec<bool>,
}

/// The totals of the walk's eligible candidates ([`eligible_totals`]) when no engine load is
/// scraped: then no candidate is full (no saturation, no room known) and no slots are known, so
/// the eligible are the admitted, non-degraded candidates but the one left, summed in index
/// order as `eligible_totals` sums equal weights, with fewer look-ups; `None` when the counted
/// weights differ (`eligible_totals` sums them in rendezvous order).
#[derive(Debug, Clone, Copy)]
pub(super) struct PlainTotals {
    load: u64,
    weight: f64,
}

impl PlainTotals {
    /// Over the rendezvous candidates `weights` (in index order): `counted(i)`, the load of
    /// candidate `i` if it is counted. `None` when the counted weights differ.
    fn of(weights: &[(usize, u32, f64)], counted: impl Fn(usize) -> Option<u32>) -> Option<Self> {
        let mut t = PlainTotals {
            load: 0,
            weight: 0.0,
        };
        let mut first: Option<u64> = None;
        for &(i, _, w) in weights {
            let Some(load) = counted(i) else {
                continue;
            };
            if *first.get_or_insert(w.to_bits()) != w.to_bits() {
                return None;
            }
            t.load += u64::from(load);
            t.weight += w;
        }
        Some(t)
    }
}

/// The table's quotas as one decision sees them (`None`: not `quota_aware`, never short).
pub(super) struct QuotaView<'t> {
    table: Option<&'t Table>,
    estimate: u64,
    rule: QuotaRule,
    now_ms: u64,
}

impl QuotaView<'_> {
    /// Short of quota for this request: skipped for placements (`quota_aware`).
    fn short_at(&self, i: usize) -> bool {
        self.table
            .and_then(|t| t.entries.get(i))
            .is_some_and(|(_, st)| st.quota.short(self.estimate, &self.rule, self.now_ms))
    }
}

impl<'t> Board<'t> {
    /// Endpoints that could serve the request at all (enabled, serving its model), in index
    /// order.
    pub(super) fn statics(&self) -> &[usize] {
        &self.shared.indexes
    }
    /// The rendezvous seeds of the candidates `weights` lists, aligned with it, when it lists
    /// every static candidate (else empty: the keys are computed from the ids).
    pub(super) fn seeds(&self) -> &[u64] {
        if self.weights.len() == self.shared.seeds.len() {
            &self.shared.seeds
        } else {
            &[]
        }
    }
    /// Short of quota for this request: skipped for placements (`quota_aware`).
    pub(super) fn short(&self, i: usize) -> bool {
        self.quotas.short_at(i)
    }
    /// What `i`'s key has left for new sessions after its forecast use (`Quota::headroom`;
    /// `None`: no stated token limit).
    pub(super) fn headroom(&self, i: usize) -> Option<i128> {
        let q = &self.quotas;
        q.table
            .and_then(|t| t.entries.get(i))
            .and_then(|(_, st)| st.quota.headroom(q.now_ms))
    }
    /// Staying there is a certain 429 (`quota_aware`): even a pin leaves it.
    pub(super) fn certain_429(&self, i: usize) -> bool {
        let q = &self.quotas;
        q.table
            .and_then(|t| t.entries.get(i))
            .is_some_and(|(_, st)| st.quota.certain_429(q.estimate, q.now_ms))
    }
    pub(super) fn load_of(&self, i: usize) -> u32 {
        if self.load.is_empty() {
            return self
                .table
                .entries
                .get(i)
                .map_or(0, |(_, st)| st.load(self.now_ms, self.max_age_ms));
        }
        self.load.get(i).copied().unwrap_or(0)
    }
    /// The walk's `(load, weight, slots)` totals over the eligible candidates, without `left`
    /// (the pinned endpoint the session leaves), the cheap way when nothing is scraped and
    /// every counted weight is the same number (see [`PlainTotals`]); else `None`.
    pub(super) fn plain_totals(&self, left: Option<usize>) -> Option<(u64, f64, u64)> {
        if !self.plain {
            return None;
        }
        let t = PlainTotals::of(&self.weights, |i| {
            (Some(i) != left && self.admitted(i) && !self.degraded(i)).then(|| self.load_of(i))
        })?;
        Some((t.load, t.weight, 0))
    }
    pub(super) fn weight(&self, i: usize) -> f64 {
        // The weights are in index order (the statics'): a search, for the few a walk weighs.
        self.weights
            .binary_search_by_key(&i, |&(j, _, _)| j)
            .ok()
            .and_then(|at| self.weights.get(at))
            .map_or(0.0, |&(_, _, w)| w)
    }
    pub(super) fn degraded(&self, i: usize) -> bool {
        self.verdicts.get(i).is_some_and(|v| v.degraded)
    }
    pub(super) fn saturated(&self, i: usize) -> bool {
        self.verdicts.get(i).is_some_and(Verdict::saturated)
    }
    /// Saturated, or without a free slot by its projected load (see `capacity`): what a
    /// placement passes over while another candidate has room.
    pub(super) fn full(&self, i: usize) -> bool {
        self.saturated(i)
            || self
                .room
                .get(i)
                .copied()
                .flatten()
                .and_then(|r| r.free_slot())
                == Some(false)
    }
    /// Its known slots (0: unknown).
    pub(super) fn slots(&self, i: usize) -> u32 {
        self.room
            .get(i)
            .copied()
            .flatten()
            .and_then(|r| r.slots)
            .unwrap_or(0)
    }
    /// This attempt's breaker admission of `i` (`None`: not a candidate).
    pub(super) fn admission_of(&self, i: usize) -> Option<Admission> {
        if !self.excluded.is_empty() && self.excluded.binary_search(&i).is_ok() {
            return None;
        }
        self.admission.get(i).copied().flatten()
    }
    pub(super) fn admitted(&self, i: usize) -> bool {
        matches!(
            self.admission_of(i),
            Some(Admission::Normal | Admission::Probe { .. })
        )
    }
    pub(super) fn probing(&self, i: usize) -> bool {
        matches!(self.admission_of(i), Some(Admission::Probe { .. }))
    }
    /// Whether some candidate other than `i` could take a new session and is not full (see
    /// [`Board::full`]): only then is a full endpoint passed over (all full: placed as
    /// without metrics).
    pub(super) fn room_elsewhere(&self, i: usize) -> bool {
        self.statics().iter().any(|&j| {
            j != i && self.admitted(j) && !self.degraded(j) && !self.short(j) && !self.full(j)
        })
    }
    /// Whether a new session's placement passes over full `i` (see [`Board::full`]): another
    /// candidate has room, or — every one full — another's queue is far shorter
    /// ([`Board::far_shorter_queue_elsewhere`]).
    pub(super) fn passed_over(&self, i: usize) -> bool {
        self.full(i) && (self.room_elsewhere(i) || self.far_shorter_queue_elsewhere(i))
    }
    /// The wait at `i` in batches: its engine's scraped waiting ÷ running (at least 1), where
    /// both are known.
    fn queue_batches(&self, i: usize) -> Option<f64> {
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
    pub(super) fn far_shorter_queue_elsewhere(&self, i: usize) -> bool {
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
    pub(super) fn captive(&self, i: usize) -> bool {
        self.captive.get(i).copied().unwrap_or(false)
    }
    /// Whether a placement passes over captive `i` ([`last_servers`]) for relief: some
    /// candidate other than `i` that could take it (admitted, not degraded, not short, not
    /// passed over, not captive itself) has a lower load ([`Board::load_of`]), or, for the
    /// half of the sessions whose `reserved` coin came up, any such candidate at all.
    pub(super) fn relief_passes_over(&self, i: usize, reserved: bool) -> bool {
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
    pub(super) fn far_shorter_queue(&self, j: usize, i: usize) -> bool {
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
    pub(super) fn stored_verdicts(&self, chosen: usize) -> Vec<(usize, bool, Saturation)> {
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

/// A drawn candidate's acceptance ([`placement::Draws`]): its full score ÷ its configured
/// weight, in [0, 1] (0 for a position outside `statics`, a missing entry or no weight), so
/// that the first taken is candidate *i* with probability scoreᵢ ÷ Σ score.
fn acceptance<'a>(
    cfg: &'a Config,
    statics: &'a [usize],
    table: &'a Table,
    now_ms: u64,
) -> impl FnMut(usize) -> f64 + 'a {
    let best = std::cell::OnceCell::new();
    move |at: usize| -> f64 {
        let Some(&i) = statics.get(at) else {
            return 0.0;
        };
        let (Some(ep), Some((_, st))) = (cfg.endpoints.get(i), table.entries.get(i)) else {
            return 0.0;
        };
        if ep.weight.is_nan() || ep.weight <= 0.0 {
            return 0.0;
        }
        // The fastest warm latency is the yardstick of a warm candidate's score only.
        let best_latency = if st.total >= cfg.cold_start_samples {
            *best.get_or_init(|| {
                fastest_warm(
                    statics
                        .iter()
                        .filter_map(|&j| table.entries.get(j).map(|(_, st)| st)),
                    cfg.cold_start_samples,
                )
            })
        } else {
            None
        };
        (score(ep.weight, st, best_latency, cfg, now_ms).score / ep.weight).clamp(0.0, 1.0)
    }
}

/// The statics (index order) a later attempt's exclusions name: the candidates are the
/// statics without them (`Scheduler::candidates`), found without visiting every static.
fn excluded_statics(statics: &[usize], ex: &Exclusions) -> Vec<usize> {
    let mut excluded: Vec<usize> = ex
        .dead
        .iter()
        .chain(&ex.used)
        .chain(&ex.tried)
        .copied()
        .filter(|i| statics.binary_search(i).is_ok())
        .collect();
    excluded.sort_unstable();
    excluded.dedup();
    excluded
}

/// Breaker admission of `candidates`; `Err(CoolingDown)` when none admits. The candidates
/// whose breaker is not closed are added to `open` (the others admit whatever the time).
pub(super) fn admit(
    table: &Table,
    candidates: &[usize],
    n: usize,
    now_ms: u64,
    bcfg: &BreakerConfig,
    open: &mut Vec<usize>,
) -> Result<Vec<Option<Admission>>, NoEndpoint> {
    let mut admission: Vec<Option<Admission>> = vec![None; n];
    let mut retry_at = u64::MAX;
    let mut all_rate_limited = true;
    let mut any_admitted = false;
    for &i in candidates {
        let Some((_, st)) = table.entries.get(i) else {
            continue;
        };
        if st.breaker.state != BreakerState::Closed {
            open.push(i);
        }
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

/// The load and weight of the walk's `eligible` candidates, summed in rendezvous order (the
/// weight's rounding depends on the order). When every eligible weight is the same number
/// (the common case: equal configured weights, all healthy), every order gives the same
/// partial sums, so the candidates are summed as they come and nothing is sorted.
pub(super) fn eligible_totals(
    board: &Board,
    keyed: &placement::Keyed,
    eligible: impl Fn(usize) -> bool,
) -> (u64, f64, u64) {
    let mut total_load = 0u64;
    let mut total_slots = 0u64;
    let mut first_weight: Option<u64> = None;
    let mut uniform = true;
    let mut total_weight = 0.0f64;
    for &(i, _, w) in board.weights.iter() {
        if !eligible(i) {
            continue;
        }
        total_load += u64::from(board.load_of(i));
        total_slots += u64::from(board.slots(i));
        uniform &= *first_weight.get_or_insert(w.to_bits()) == w.to_bits();
        total_weight += w;
    }
    if uniform {
        return (total_load, total_weight, total_slots);
    }
    let mut weight_at = vec![0.0; board.statics().last().map_or(0, |&i| i + 1)];
    for &(i, _, w) in board.weights.iter() {
        if let Some(slot) = weight_at.get_mut(i) {
            *slot = w;
        }
    }
    let weight = keyed
        .order()
        .into_iter()
        .filter(|&i| eligible(i))
        .fold(0.0f64, |w, i| w + weight_at.get(i).copied().unwrap_or(0.0));
    (total_load, weight, total_slots)
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

/// One static candidate's values in a decision's board (see [`Scheduler::board`]).
pub(super) struct One {
    /// The verdict differs from the one stored in its entry.
    flip: bool,
    /// `(index, id, weight)`; `None`: no weight (a request without a session whose entry is
    /// missing).
    weight: Option<(usize, u32, f64)>,
    /// The values hold until its entry or its peers' median changes (see `QuietMemo`).
    quiet: bool,
}

/// Breaker admission by endpoint index, shared between the board memo and a decision.
type Admissions = Rc<Vec<Option<Admission>>>;

/// A board's verdicts (by index), weights and flips, shared.
type BoardRefs<'b> = (
    &'b Rc<Vec<Verdict>>,
    &'b Rc<Vec<(usize, u32, f64)>>,
    &'b Rc<Vec<usize>>,
);

/// A board's verdicts (by index), weights, flips and whether any static candidate is degraded.
type BoardParts = (
    Rc<Vec<Verdict>>,
    Rc<Vec<(usize, u32, f64)>>,
    Rc<Vec<usize>>,
    bool,
);

// `BoardMemo` is defined in `table` (the per-worker `TableCache` holds one), as `QuietMemo`.
impl BoardMemo {
    /// The board of a session decision for `model` over `n` endpoints, from the memo brought
    /// up to date: the positions in `changed` (entries decoded again since), those whose
    /// peers' median differs from the memo's (compared only when the medians memo recomputed
    /// since: `medians_computed`), and the live ones are computed again with `one`. `None`
    /// (and the memo invalid) when it holds no board for this model or too much changed: the
    /// caller computes every position and keeps them ([`BoardMemo::keep`]).
    pub(super) fn update(
        &mut self,
        model: Option<&str>,
        n: usize,
        changed: &[usize],
        references: &Rc<Vec<Option<f64>>>,
        medians_computed: u64,
        one: &mut impl FnMut(usize, &mut Verdict) -> Option<One>,
    ) -> Option<BoardParts> {
        let fits = self.valid && self.model.as_deref() == model && self.verdicts.len() == n;
        self.valid = false;
        // Past a quarter of the board, computing it whole costs about the same.
        let most = self.statics.len() / 4 + 4;
        if !fits || changed.len() + self.live.len() > most {
            return None;
        }
        let statics = &self.statics;
        let mut dirty: Vec<usize> = changed
            .iter()
            .chain(&self.live)
            .copied()
            .filter(|i| statics.binary_search(i).is_ok())
            .collect();
        let new_medians = self.medians_computed != medians_computed;
        if new_medians {
            for &i in statics {
                let now = references.get(i).copied().flatten().map(f64::to_bits);
                let then = self.references.get(i).copied().flatten().map(f64::to_bits);
                if now != then {
                    dirty.push(i);
                    if dirty.len() > most {
                        return None;
                    }
                }
            }
        }
        dirty.sort_unstable();
        dirty.dedup();
        let mut live = Vec::new();
        // In place: the last decision's board is dropped (else these copy it).
        let (verdicts, weights, flips) = (
            Rc::make_mut(&mut self.verdicts),
            Rc::make_mut(&mut self.weights),
            Rc::make_mut(&mut self.flips),
        );
        for &i in &dirty {
            let (Ok(s), Some(v)) = (self.statics.binary_search(&i), verdicts.get_mut(i)) else {
                return None;
            };
            let was_degraded = v.degraded;
            if v.degraded {
                self.degraded = self.degraded.saturating_sub(1);
            }
            *v = Verdict::default();
            let o = one(i, v)?;
            if v.degraded {
                self.degraded += 1;
            }
            let (Some(w), Some(slot_w)) = (o.weight, weights.get_mut(s)) else {
                return None;
            };
            // The kept homes hold while no weight and no degraded flag changes.
            if was_degraded != v.degraded || slot_w.1 != w.1 || slot_w.2.to_bits() != w.2.to_bits()
            {
                self.homes.clear();
                self.passes.clear();
            }
            *slot_w = w;
            // The flipped positions stay in index order.
            match (flips.binary_search(&i), o.flip) {
                (Ok(at), false) => {
                    flips.remove(at);
                }
                (Err(at), true) => flips.insert(at, i),
                _ => {}
            }
            if !o.quiet {
                live.push(i);
            }
        }
        self.live = live;
        self.dirty = dirty;
        if new_medians {
            self.references = Rc::clone(references);
            self.medians_computed = medians_computed;
        }
        self.valid = true;
        self.hits = self.hits.saturating_add(1);
        Some((
            Rc::clone(&self.verdicts),
            Rc::clone(&self.weights),
            Rc::clone(&self.flips),
            self.degraded > 0,
        ))
    }

    /// Keeps a whole board computed for a session decision for `model` (`weights` aligned
    /// with `statics`; `live`: the positions that are not quiet; `degraded`: the statics
    /// treated as degraded).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn keep(
        &mut self,
        model: Option<&str>,
        statics: &[usize],
        (verdicts, weights, flips): BoardRefs<'_>,
        live: Vec<usize>,
        degraded: usize,
        references: &Rc<Vec<Option<f64>>>,
        medians_computed: u64,
    ) {
        self.valid = true;
        if self.model.as_deref() != model {
            self.model = model.map(str::to_string);
        }
        self.medians_computed = medians_computed;
        self.references = Rc::clone(references);
        self.statics.clear();
        self.statics.extend_from_slice(statics);
        self.weights = Rc::clone(weights);
        self.verdicts = Rc::clone(verdicts);
        self.flips = Rc::clone(flips);
        self.live = live;
        self.degraded = degraded;
        self.dirty.clear();
        self.homes.clear();
        self.passes.clear();
        // Kept only by `keep_admission`, for this board.
        self.admission = Rc::default();
        self.open.clear();
    }

    /// The admission of the statics (a first attempt's candidates) in `table`, from the memo
    /// just brought up to date by [`BoardMemo::update`]: the positions it recomputed and
    /// those whose breaker was not closed are asked again. `None` when it keeps none, or when
    /// no candidate admits (the caller answers that with its retry time).
    pub(super) fn admission(
        &mut self,
        table: &Table,
        now_ms: u64,
        bcfg: &BreakerConfig,
    ) -> Option<Admissions> {
        if !self.valid || self.admission.len() != self.verdicts.len() {
            return None;
        }
        let mut ask: Vec<usize> = self.dirty.iter().chain(&self.open).copied().collect();
        ask.sort_unstable();
        ask.dedup();
        let mut open = Vec::new();
        let admission = Rc::make_mut(&mut self.admission);
        for i in ask {
            let (Some((_, st)), Some(slot)) = (table.entries.get(i), admission.get_mut(i)) else {
                self.admission = Rc::default();
                return None;
            };
            *slot = Some(st.breaker.peek(now_ms, bcfg));
            if st.breaker.state != BreakerState::Closed {
                open.push(i);
            }
        }
        self.open = open;
        let admits =
            |a: &Option<Admission>| matches!(a, Some(Admission::Normal | Admission::Probe { .. }));
        let any = self.open.len() < self.statics.len()
            || self
                .open
                .iter()
                .any(|&i| self.admission.get(i).is_some_and(admits));
        any.then(|| Rc::clone(&self.admission))
    }

    /// Keeps the admission of the statics computed by `admit`, with the statics whose
    /// breaker is not closed (`None`: of other candidates, or not computed: nothing kept).
    /// The home of rendezvous key `key` over the memo's board, if kept (`Some(None)`: no
    /// candidate).
    pub(super) fn home_of(&self, key: u64) -> Option<Option<usize>> {
        self.homes.iter().find(|(k, _)| *k == key).map(|&(_, h)| h)
    }

    /// Keeps the home of `key` over the memo's board (the oldest of [`BoardMemo::HOMES`]
    /// makes room).
    pub(super) fn keep_home(&mut self, key: u64, home: Option<usize>) {
        if self.home_of(key).is_some() {
            return;
        }
        if self.homes.len() >= Self::HOMES {
            self.homes.remove(0);
        }
        self.homes.push((key, home));
    }

    /// The first pass of `key`'s order over the memo's board, if kept.
    pub(super) fn pass_of(&self, key: u64) -> Option<crate::scheduler::routing::table::FirstPass> {
        self.passes.iter().find(|(k, _)| *k == key).map(|&(_, p)| p)
    }

    /// Keeps the first pass of `key`'s order (the oldest of [`BoardMemo::HOMES`] makes room).
    pub(super) fn keep_pass(
        &mut self,
        key: u64,
        pass: crate::scheduler::routing::table::FirstPass,
    ) {
        if self.pass_of(key).is_some() {
            return;
        }
        if self.passes.len() >= Self::HOMES {
            self.passes.remove(0);
        }
        self.passes.push((key, pass));
    }

    /// Homes kept at most.
    pub(super) const HOMES: usize = 64;

    /// Keeps `changed` (positions decoded since the memo was last brought up to date, taken
    /// by a decision it does not serve; `None`: unknown) for the next decision it serves
    /// (`TableCache::lent_board` adds them to its list). Past `n` positions: unknown.
    pub(super) fn carry(&mut self, changed: Option<Vec<usize>>, n: usize) {
        match changed {
            Some(list) if !self.carried_unknown && self.carried.len() + list.len() <= n => {
                self.carried.extend(list);
            }
            _ => {
                self.carried.clear();
                self.carried_unknown = true;
            }
        }
    }

    /// Whether a static outside `excluded` (index order) admits by the admission kept and
    /// just brought up to date ([`BoardMemo::admission`]): one whose breaker is closed, when
    /// fewer are open or excluded than there are statics, else one of the open ones.
    pub(super) fn admits_besides(&self, excluded: &[usize]) -> bool {
        let out = |i: &usize| excluded.binary_search(i).is_ok();
        let open_kept = self.open.iter().filter(|i| !out(i)).count();
        if open_kept + excluded.len() < self.statics.len() {
            return true;
        }
        self.open.iter().filter(|i| !out(i)).any(|&i| {
            matches!(
                self.admission.get(i).copied().flatten(),
                Some(Admission::Normal | Admission::Probe { .. })
            )
        })
    }

    pub(super) fn keep_admission(&mut self, kept: Option<(&Admissions, Vec<usize>)>) {
        self.admission = Rc::default();
        self.open.clear();
        let Some((a, open)) = kept.filter(|_| self.valid) else {
            return;
        };
        self.admission = Rc::clone(a);
        self.open = open;
    }
}
