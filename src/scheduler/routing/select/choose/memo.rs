//! The per-worker board memo ([`BoardMemo`], kept in the table cache): a board's verdicts,
//! weights and admissions carried between decisions while their inputs stay the same.

use super::*;

/// One static candidate's values in a decision's board (see [`Scheduler::board`]).
pub(in crate::scheduler::routing::select) struct One {
    /// The verdict differs from the one stored in its entry.
    pub(super) flip: bool,
    /// `(index, id, weight)`; `None`: no weight (a request without a session whose entry is
    /// missing).
    pub(super) weight: Option<(usize, u32, f64)>,
    /// The values hold until its entry or its peers' median changes (see `QuietMemo`).
    pub(super) quiet: bool,
}

/// Breaker admission by endpoint index, shared between the board memo and a decision.
pub(super) type Admissions = Rc<Vec<Option<Admission>>>;

/// A board as the memo shares it with a decision: the verdicts by endpoint index, the
/// statics' rendezvous weights `(index, id, weight)`, the positions whose verdict differs from
/// the stored one (in index order), and whether any static candidate is degraded.
pub(in crate::scheduler::routing::select) struct SharedBoard {
    pub(in crate::scheduler::routing::select) verdicts: Rc<Vec<Verdict>>,
    pub(in crate::scheduler::routing::select) weights: Rc<Vec<(usize, u32, f64)>>,
    pub(in crate::scheduler::routing::select) flips: Rc<Vec<usize>>,
    pub(in crate::scheduler::routing::select) any_degraded: bool,
}

// `BoardMemo` is defined in `table` (the per-worker `TableCache` holds one), as `QuietMemo`.
impl BoardMemo {
    /// The board of a session decision for `model` over `n` endpoints, from the memo brought
    /// up to date: the positions in `changed` (entries decoded again since), those whose
    /// peers' median differs from the memo's (compared only when the medians memo recomputed
    /// since: `medians_computed`), and the live ones are computed again with `one`. `None`
    /// (and the memo invalid) when it holds no board for this model or too much changed: the
    /// caller computes every position and keeps them ([`BoardMemo::keep`]).
    #[allow(clippy::too_many_arguments)]
    pub(in crate::scheduler::routing::select) fn update(
        &mut self,
        model: Option<&str>,
        n: usize,
        changed: &[usize],
        references: &Rc<Vec<Option<f64>>>,
        medians_computed: u64,
        engines: &Engines,
        now_ms: u64,
        one: &mut impl FnMut(usize, &mut Verdict) -> Option<One>,
    ) -> Option<SharedBoard> {
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
        // The engines' inputs, where anything is scraped: the positions whose load, slots or
        // peers' median pace differ from the memo's, or whose load turned past its age (a
        // position kept with a load was judged on a fresh one: see `live`), are judged again;
        // where slots or a load's presence moved, the weights the decision multiplies by
        // slots do too (the kept homes go).
        let scraped = !(engines.loads.is_empty()
            && self.loads.is_empty()
            && engines.rooms.is_empty()
            && self.slots.is_empty()
            && engines.pace.is_empty()
            && self.pace.is_empty());
        let mut slots_moved = false;
        // Each input is compared only where it may differ: the loads and paces are shared
        // lists (the same list: nothing in it changed), and a kept load turns past its age
        // no sooner than `fresh_until`.
        let same_loads = Rc::ptr_eq(&engines.loads, &self.loads);
        let same_pace = Rc::ptr_eq(&engines.pace, &self.pace);
        let expired = now_ms > self.fresh_until;
        // The same loads and paces, none turned past its age, and the slots at the version
        // the memo's equal (the rooms memo counts their changes): nothing of the engines
        // moved, and nothing is compared.
        let same_slots =
            engines.slots_version.is_some() && engines.slots_version == self.slots_version;
        if scraped && !(same_loads && same_pace && !expired && same_slots) {
            for &i in statics {
                let slots = engines
                    .rooms
                    .get(i)
                    .copied()
                    .flatten()
                    .and_then(|r| r.slots);
                let mut moved = slots != self.slots.get(i).copied().flatten();
                slots_moved |= moved;
                if !same_pace {
                    let pace = engines.pace.get(i).copied().flatten().map(f64::to_bits);
                    let then = self.pace.get(i).copied().flatten().map(f64::to_bits);
                    moved |= pace != then;
                }
                if !same_loads || expired {
                    let load = engines.loads.get(i).copied().flatten();
                    let then = self.loads.get(i).copied().flatten();
                    slots_moved |= load.is_some() != then.is_some();
                    let engine = signals::Engine {
                        load,
                        slots,
                        pace_reference: None,
                        now_ms,
                    };
                    moved |= load != then || (load.is_some() && engine.fresh_until().is_none());
                }
                if moved {
                    dirty.push(i);
                    if dirty.len() > most {
                        return None;
                    }
                }
            }
        }
        // Compared above (or the same): the statics' slots are those of this version.
        self.slots_version = engines.slots_version;
        dirty.sort_unstable();
        dirty.dedup();
        if slots_moved {
            self.homes.clear();
            self.passes.clear();
        }
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
                self.weights_version = self.weights_version.wrapping_add(1);
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
        if scraped && (!same_loads || !same_pace || slots_moved || expired) {
            self.keep_engines(engines, now_ms);
        }
        if new_medians {
            self.references = Rc::clone(references);
            self.medians_computed = medians_computed;
        }
        self.valid = true;
        self.hits = self.hits.saturating_add(1);
        Some(SharedBoard {
            verdicts: Rc::clone(&self.verdicts),
            weights: Rc::clone(&self.weights),
            flips: Rc::clone(&self.flips),
            any_degraded: self.degraded > 0,
        })
    }

    /// Keeps a whole board computed for a session decision for `model` (`weights` aligned
    /// with `statics`; `live`: the positions that are not quiet; `degraded`: the statics
    /// treated as degraded; the board's own `any_degraded` is not read).
    #[allow(clippy::too_many_arguments)]
    pub(in crate::scheduler::routing::select) fn keep(
        &mut self,
        model: Option<&str>,
        statics: &[usize],
        board: &SharedBoard,
        live: Vec<usize>,
        degraded: usize,
        references: &Rc<Vec<Option<f64>>>,
        medians_computed: u64,
        engines: &Engines,
        now_ms: u64,
    ) {
        self.valid = true;
        self.keep_engines(engines, now_ms);
        if self.model.as_deref() != model {
            self.model = model.map(str::to_string);
        }
        self.medians_computed = medians_computed;
        self.references = Rc::clone(references);
        self.statics.clear();
        self.statics.extend_from_slice(statics);
        self.weights = Rc::clone(&board.weights);
        self.weights_version = self.weights_version.wrapping_add(1);
        self.lists = None;
        self.verdicts = Rc::clone(&board.verdicts);
        self.flips = Rc::clone(&board.flips);
        self.live = live;
        self.degraded = degraded;
        self.dirty.clear();
        self.homes.clear();
        self.passes.clear();
        // Kept only by `keep_admission`, for this board.
        self.admission = Rc::default();
        self.open.clear();
    }

    /// Keeps the engines' inputs a board was judged on (see [`BoardMemo::update`]), and the
    /// last instant at which every load it holds fresh at `now_ms` still is (a load past its
    /// age now is of a position judged by every decision).
    fn keep_engines(&mut self, engines: &Engines, now_ms: u64) {
        self.slots_version = engines.slots_version;
        self.loads = Rc::clone(&engines.loads);
        self.pace = Rc::clone(&engines.pace);
        self.slots.clear();
        self.slots
            .extend(engines.rooms.iter().map(|r| r.and_then(|r| r.slots)));
        let slots = &self.slots;
        self.fresh_until = engines
            .loads
            .iter()
            .enumerate()
            .filter_map(|(i, &load)| {
                signals::Engine {
                    load,
                    slots: slots.get(i).copied().flatten(),
                    pace_reference: None,
                    now_ms,
                }
                .fresh_until()
            })
            .min()
            .unwrap_or(u64::MAX);
    }

    /// The admission of the statics (a first attempt's candidates) in `table`, from the memo
    /// just brought up to date by [`BoardMemo::update`]: the positions it recomputed and
    /// those whose breaker was not closed are asked again. `None` when it keeps none, or when
    /// no candidate admits (the caller answers that with its retry time).
    pub(in crate::scheduler::routing::select) fn admission(
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
    pub(in crate::scheduler::routing::select) fn home_of(&self, key: u64) -> Option<Option<usize>> {
        self.homes.iter().find(|(k, _)| *k == key).map(|&(_, h)| h)
    }

    /// Keeps the home of `key` over the memo's board (the oldest of [`BoardMemo::HOMES`]
    /// makes room).
    pub(in crate::scheduler::routing::select) fn keep_home(
        &mut self,
        key: u64,
        home: Option<usize>,
    ) {
        if self.home_of(key).is_some() {
            return;
        }
        if self.homes.len() >= Self::HOMES {
            self.homes.remove(0);
        }
        self.homes.push((key, home));
    }

    /// The first pass of `key`'s order over the memo's board, if kept.
    pub(in crate::scheduler::routing::select) fn pass_of(
        &self,
        key: u64,
    ) -> Option<crate::scheduler::routing::table::FirstPass> {
        self.passes.iter().find(|(k, _)| *k == key).map(|&(_, p)| p)
    }

    /// Keeps the first pass of `key`'s order (the oldest of [`BoardMemo::HOMES`] makes room).
    pub(in crate::scheduler::routing::select) fn keep_pass(
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
    pub(in crate::scheduler::routing::select) const HOMES: usize = 64;

    /// Keeps `changed` (positions decoded since the memo was last brought up to date, taken
    /// by a decision it does not serve; `None`: unknown) for the next decision it serves
    /// (`TableCache::lent_board` adds them to its list). Past `n` positions: unknown.
    pub(in crate::scheduler::routing::select) fn carry(
        &mut self,
        changed: Option<Vec<usize>>,
        n: usize,
    ) {
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
    pub(in crate::scheduler::routing::select) fn admits_besides(&self, excluded: &[usize]) -> bool {
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

    pub(in crate::scheduler::routing::select) fn keep_admission(
        &mut self,
        kept: Option<(&Admissions, Vec<usize>)>,
    ) {
        self.admission = Rc::default();
        self.open.clear();
        let Some((a, open)) = kept.filter(|_| self.valid) else {
            return;
        };
        self.admission = Rc::clone(a);
        self.open = open;
    }
}
