//! Step 1 of the pick: [`Scheduler::board`], what every endpoint may do in this decision
//! (weights, verdicts, breaker admission, quota, load), and the helpers it alone uses.

use super::*;
use crate::scheduler::routing::judge::saturation::EngineLoad;
use crate::scheduler::routing::table::{BoardLists, Quiet};

impl<'a> Scheduler<'a> {
    /// Step 1: what every endpoint may do in this decision. Weights and verdicts come from
    /// every endpoint that could serve the request at all, before request exclusions and
    /// breakers, so that a failover walks the first attempt's order; breaker admission is of
    /// this attempt's candidates (`Err` when none admits).
    pub(in crate::scheduler::routing::select) fn board<'t>(
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
        let pace_references = &engines.pace;
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
            let engine = signals::Engine {
                load,
                slots: slots_of(rooms, i),
                pace_reference: pace_references.get(i).copied().flatten(),
                now_ms,
            };
            // A quiet endpoint kept by the memo: its verdict is its sticky flag (not
            // overdue), its saturation and its load.
            let hit = match &mut memo {
                Some((stamps, quiet)) => quiet.get(i, stamps.get(i), reference, &engine),
                None => None,
            };
            if let Some(Quiet {
                id,
                weight,
                sticky,
                flip,
                saturation,
                ..
            }) = hit
            {
                v.sticky = sticky;
                v.degraded = sticky;
                v.saturation = saturation;
                v.load = load;
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
                    quiet: engine.load.is_none() || engine.fresh_until().is_some(),
                });
            }
            let (Some(ep), Some(st)) = (cfg.endpoints.get(i), state(i)) else {
                return None;
            };
            *v = signals::judge_with(
                table,
                cfg,
                i,
                reference,
                engine.pace_reference,
                load,
                engine.slots,
                now_ms,
            );
            let flip = st.degraded != v.sticky || st.saturation.stored_differs(v.saturation);
            let key = memo
                .as_ref()
                .and_then(|(stamps, _)| stamps.get(i).copied().flatten());
            let keep = match (&mut memo, key) {
                (Some((_, quiet)), Some(key)) if signals::quiet(st, cfg) => Some((quiet, key)),
                _ => None,
            };
            // A load past its age now is judged again by every decision (the board memo's
            // `live`), as one whose weight fades.
            let quiet = keep.is_some() && (engine.load.is_none() || engine.fresh_until().is_some());
            // A request without a session weighs by score: the placement weight only to
            // keep it.
            let weight =
                (!by_score || keep.is_some()).then(|| placement::weigh(ep.weight, st, cfg, now_ms));
            if let (Some((quiet, key)), Some(w)) = (keep, weight) {
                quiet.keep(n, i, key, reference, &engine, v, flip, w);
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
        // A session decision (or a drawn one) over the same model as the
        // memo's board: only the positions that changed since are computed (see `BoardMemo`).
        let memo_fits = !by_score;
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
                engines,
                now_ms,
                &mut one,
            ),
            _ => None,
        };
        let mut full_memo = memo;
        let reused_board = reused.is_some();
        let mut from_memo = reused_board;
        let SharedBoard {
            verdicts,
            weights,
            flips,
            any_degraded,
        } = match reused {
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
                    let engine = signals::Engine {
                        load,
                        slots: slots_of(rooms, i),
                        pace_reference: pace_references.get(i).copied().flatten(),
                        now_ms,
                    };
                    let hit = match &mut full_memo {
                        Some((stamps, quiet)) => quiet.get(i, stamps.get(i), reference, &engine),
                        None => None,
                    };
                    if let Some(Quiet {
                        id,
                        weight,
                        sticky,
                        flip,
                        saturation,
                        ..
                    }) = hit
                    {
                        if let Some(v) = verdicts.get_mut(i) {
                            *v = Verdict {
                                sticky,
                                degraded: sticky,
                                saturation,
                                load,
                            };
                        }
                        if load.is_some() && engine.fresh_until().is_none() {
                            live.push(i);
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
                    *v = signals::judge_with(
                        table,
                        cfg,
                        i,
                        reference,
                        engine.pace_reference,
                        load,
                        engine.slots,
                        now_ms,
                    );
                    degraded += usize::from(v.degraded);
                    let flip =
                        st.degraded != v.sticky || st.saturation.stored_differs(v.saturation);
                    if flip {
                        flips.push(i);
                    }
                    let key = full_memo
                        .as_ref()
                        .and_then(|(stamps, _)| stamps.get(i).copied().flatten());
                    let keep = match (&mut full_memo, key) {
                        (Some((_, quiet)), Some(key)) if signals::quiet(st, cfg) => {
                            Some((quiet, key))
                        }
                        _ => None,
                    };
                    if keep.is_none() || (load.is_some() && engine.fresh_until().is_none()) {
                        live.push(i);
                    }
                    let weight = (!by_score || keep.is_some())
                        .then(|| placement::weigh(ep.weight, st, cfg, now_ms));
                    if let (Some((quiet, key)), Some(w)) = (keep, weight) {
                        quiet.keep(n, i, key, reference, &engine, v, flip, w);
                    }
                    let w = match weight {
                        Some(w) if !by_score => w,
                        _ => score(ep.weight, st, best_latency, cfg, now_ms).score,
                    };
                    weights.push((i, ep.id, w));
                }
                let board = SharedBoard {
                    verdicts: Rc::new(verdicts),
                    weights: Rc::new(weights),
                    flips: Rc::new(flips),
                    any_degraded: degraded > 0,
                };
                // A decision the memo does not serve (no session, scraped loads) leaves it as
                // it is: the entries changed since are handed back for the next one it does.
                if let Some(bm) = board_memo.as_deref_mut().filter(|_| memo_fits) {
                    if board.weights.len() == statics.len() {
                        from_memo = true;
                        bm.keep(
                            pick.model,
                            statics,
                            &board,
                            live,
                            degraded,
                            &references,
                            medians_computed,
                            engines,
                            now_ms,
                        );
                    } else {
                        bm.valid = false;
                    }
                }
                board
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
                if let (Some(bm), true) = (board_memo.as_deref_mut(), keeps) {
                    bm.keep_admission(Some((&a, open)));
                }
                a
            }
        };

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
        // Every candidate's slots known (see `capacity`): the load is the projected one (scraped
        // running + waiting and this process's placements since), bounded by slots. The rooms
        // are derived from these loads (a room only where there is a load).
        let room: &[Option<Room>] = if any_scraped { rooms } else { &[] };
        debug_assert!(room
            .iter()
            .enumerate()
            .all(|(i, r)| r.is_none() || loads.get(i).copied().flatten().is_some()));
        // What follows passes over every static candidate: the board memo's, while its
        // weights, the slots (the rooms memo's version) and the loads are those it was
        // derived from.
        let kept_lists = match (from_memo, engines.slots_version, board_memo.as_deref()) {
            (true, Some(v), Some(bm)) => bm
                .lists
                .as_ref()
                .filter(|l| {
                    l.slots_version == v
                        && l.weights_version == bm.weights_version
                        && Rc::ptr_eq(&l.loads, loads)
                })
                .cloned(),
            _ => None,
        };
        let lists = match kept_lists {
            Some(l) => l,
            None => {
                let l = derive_lists(statics, loads, room, any_scraped, weights);
                if let (true, Some(v), Some(bm)) = (from_memo, engines.slots_version, board_memo) {
                    bm.lists = Some(BoardLists {
                        slots_version: v,
                        weights_version: bm.weights_version,
                        ..l.clone()
                    });
                }
                l
            }
        };
        drop(cache);
        let BoardLists {
            all_scraped,
            by_slots,
            most_slots,
            weights,
            ..
        } = lists;
        // Nobody degraded, by this decision (`any_degraded`: the statics' verdicts) or as
        // stored (counted by the worker's cache when there is one): no last server.
        let stored_degraded = match stored_degraded {
            Some(count) => count > 0,
            None => table.entries.iter().any(|(_, st)| st.degraded),
        };
        // Debug builds (every test) check the cache's count against the table.
        debug_assert_eq!(
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
            loads: if any_scraped { loads } else { &[] },
            all_scraped,
            room,
            // As the weights count them: an engine that never queued as the most known × 4.
            most_slots: if by_slots {
                most_slots
            } else {
                most_slots.saturating_mul(UNQUEUED_SLOTS_FACTOR)
            },
            by_slots,
            admission,
            excluded,
            captive,
            room_at: std::cell::OnceCell::new(),
        })
    }
}

/// What a decision derives from its board's `weights`, the statics' slots (`room`) and
/// `loads` (see [`BoardLists`]; its versions are the caller's to set).
fn derive_lists(
    statics: &[usize],
    loads: &Rc<Vec<Option<EngineLoad>>>,
    room: &[Option<Room>],
    any_scraped: bool,
    weights: Rc<Vec<(usize, u32, f64)>>,
) -> BoardLists {
    let all_scraped = any_scraped
        && statics
            .iter()
            .all(|&i| loads.get(i).copied().flatten().is_some());
    // Every candidate's slots known: bounded load by slots.
    let by_slots = !statics.is_empty()
        && statics.iter().all(|&i| {
            room.get(i)
                .copied()
                .flatten()
                .is_some_and(|r| r.slots.is_some())
        });
    // Some candidate's slots known: a session's rendezvous weight is its placement weight
    // × its slots (an engine that never queued counted as `UNQUEUED_SLOTS_FACTOR` × the
    // most known), so that where new sessions and later turns without a pin go follows
    // what the engines can run, which every replica learns alike (the largest running
    // count an engine showed while it queued, never smaller later).
    // Without it, a 4-slot engine was the home of as many sessions as a 16-slot one,
    // full every other second, and replicas reading "full" a moment apart sent the turns
    // of one session to different endpoints (mixed fleet, three replicas: 80 % of later
    // turns on their previous endpoint).
    let most_slots = statics
        .iter()
        .filter_map(|&i| slots_of(room, i))
        .max()
        .unwrap_or(0);
    let weights = if most_slots > 0 {
        Rc::new(
            weights
                .iter()
                .map(|&(i, id, w)| {
                    let slots = slots_of(room, i)
                        .unwrap_or(most_slots.saturating_mul(UNQUEUED_SLOTS_FACTOR));
                    (i, id, w * f64::from(slots))
                })
                .collect(),
        )
    } else {
        weights
    };
    BoardLists {
        weights_version: 0,
        slots_version: 0,
        loads: Rc::clone(loads),
        all_scraped,
        by_slots,
        most_slots,
        weights,
    }
}

/// How many times the most slots known among the candidates an engine that never queued is
/// weighed as (its slots unknown, see `capacity`): it ran all it was given while another
/// queued at its own slots.
const UNQUEUED_SLOTS_FACTOR: u32 = 4;

/// Endpoint `i`'s slots, where known (the saturation rule's, [`signals::saturation_rule`]).
fn slots_of(rooms: &[Option<Room>], i: usize) -> Option<u32> {
    rooms.get(i).copied().flatten().and_then(|r| r.slots)
}

/// A drawn candidate's acceptance ([`placement::Draws`]): its full score ÷ its configured
/// weight, in [0, 1] (0 for a position outside `statics`, a missing entry or no weight), so
/// that the first taken is candidate *i* with probability scoreᵢ ÷ Σ score.
pub(super) fn acceptance<'a>(
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
pub(super) fn excluded_statics(statics: &[usize], ex: &Exclusions) -> Vec<usize> {
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
pub(in crate::scheduler::routing::select) fn admit(
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
