//! The per-worker caches of the endpoint table: each worker's decoded entries
//! ([`TableCache`]) and the memos kept beside them (which endpoints serve a model, their
//! peers' medians, a board's verdicts and weights, the entries that stayed quiet). Each is
//! checked against the uncached computation by the scheduler's tests (`select/memo_tests.rs`,
//! `select/lazy_tests.rs`, and the kept-home check of every pick).

use super::*;

/// One worker's memory of the entries it decoded, each with the stamp it had.
///
/// Why: a request reads the whole table (its pick weighs every endpoint), but between two
/// requests of one worker only the entries of the endpoints used in between changed. Their
/// stamps moved; every other entry is taken from here instead of decoded again. The cache is
/// per VM (one per Envoy worker thread), never shared, and only ever a shortcut: the table it
/// returns equals [`Table::load_from`] of the same store (every write that changes an entry's
/// bytes gives it a new stamp: its group's next version, which grows with each CAS-ordered
/// write of the group).
///
/// Which groups moved is read from the header: each group's recorded version is compared with
/// the version of that group the cache last read, and only groups past it are read (one key
/// each, [`GROUP_LEN`] entries), so a load costs the header plus the groups written since,
/// whatever the fleet's size. A writer records its group's version after writing the group, so
/// a reader may read a group newer than the header says (it keeps the group's own version, and
/// does not read it again until the header passes that); a group the header has not caught up
/// with yet is read at a later load. A pick whose chosen entry turns out to have changed in
/// between reads that group again ([`TableCache::forget_group`]) and decides again.
///
/// A reader that only reads (the pick) borrows the cached table itself ([`TableCache::lend`]
/// and [`TableCache::give_back`]) instead of a copy: copying every entry cost more than
/// decoding the changed ones (about 870 instructions per endpoint under wasm).
#[derive(Debug, Default)]
pub struct TableCache {
    /// By position in the configuration: `(stamp, id)` of the entry of `table` as decoded.
    pub(super) stamps: Vec<Option<(u64, u32)>>,
    /// The table as last loaded; empty while lent.
    pub(super) table: Table,
    /// `table` is lent out: its entries are not here, whatever `stamps` says.
    pub(super) lent: bool,
    /// Entries decoded (not taken from the cache), for tests and diagnostics.
    pub decoded: u64,
    /// The peers' median slowness of the last decision, and what it was computed from.
    pub peers: MedianMemo,
    /// Which endpoints serve the models of the last few decisions (see [`ServesMemo`]).
    pub serves: ServesMemo,
    /// The quiet endpoints' verdicts and weights, by write stamp (see [`QuietMemo`]).
    pub quiet: QuietMemo,
    /// Positions of the entries decoded since [`TableCache::forget_changes`] (meaningful
    /// while `changed_known`; else more than the table holds, or unknown: anything may have
    /// changed).
    pub(super) changed: Vec<usize>,
    pub(super) changed_known: bool,
    /// The last session decision's verdicts and weights (see [`BoardMemo`]).
    pub board: BoardMemo,
    /// The same for the last drawn decision (a request without a session over many
    /// candidates, `placement::Draws`): often of another model than the sessions' (an
    /// upload's), so kept apart, so that neither evicts the other's board.
    pub drawn_board: BoardMemo,
    /// Positions of the entries decoded since the board memo was last brought up to date
    /// (as `changed`, for [`BoardMemo`]; `board_changed_known` false: unknown).
    pub(super) board_changed: Vec<usize>,
    pub(super) board_changed_known: bool,
    /// Entries of `table` decoded (`stamps` set) whose stored verdict is degraded: whether
    /// any endpoint is, without visiting every entry.
    pub(super) degraded: usize,
    /// By group: the version of the group `table` was last brought up to (`None`: unknown),
    /// compared with the header's record to tell which groups changed since.
    pub(super) groups_seen: Vec<Option<u64>>,
    /// The published engine loads as last decoded (see [`crate::scheduler::routing::scrape::LoadsMemo`]).
    pub loads: crate::scheduler::routing::scrape::LoadsMemo,
    /// What decisions derive from them (see [`EnginesMemo`]).
    pub engines: EnginesMemo,
    /// The configuration's endpoint ids, sorted (`None`: not computed yet).
    pub(super) slot_ids: Option<Vec<u32>>,
    /// Some endpoint of the configuration is scraped (`None`: not computed yet).
    pub(super) scrapes: Option<bool>,
}

/// Every configured endpoint's id, sorted: the slot space of the scraped loads (an
/// endpoint's slot is its place among them, see `scrape::fold`).
pub fn slot_ids(cfg: &Config) -> Vec<u32> {
    let mut ids: Vec<u32> = cfg.endpoints.iter().map(|e| e.id).collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// One worker's fresh engine loads by endpoint index and their peers' median pace, derived
/// from its [`crate::scheduler::routing::scrape::LoadsMemo`] (`select::signals::fresh_engines`).
///
/// Why: a decision needs every endpoint's fresh load; deriving them (a record look-up and a
/// freshness check per endpoint) and the peers' median pace (a sort) cost every request an
/// amount that grew with the fleet, while the loads change only at the ticks that bring the
/// memo up to the store, and a load turns stale only at a known instant. Kept while the loads
/// memo's version is the one derived from and no load known then has turned stale.
#[derive(Debug, Default, Clone)]
pub struct EnginesMemo {
    /// The loads memo's version they were derived from (`None`: nothing derived).
    pub version: Option<u64>,
    /// Derived at this instant; they hold from it up to `valid_until_ms`.
    pub derived_ms: u64,
    pub valid_until_ms: u64,
    /// By endpoint index (empty: nothing scraped is fresh).
    pub loads: Rc<Vec<Option<EngineLoad>>>,
    /// By endpoint index (empty: no engine publishes a pace).
    pub pace: Rc<Vec<Option<f64>>>,
}

/// Which configured endpoints list a model (or serve every model), for the last few models
/// asked.
///
/// Why: every decision filters the fleet by the request's model, comparing the model name
/// with every endpoint's list (about 300 instructions per endpoint under wasm, twice per
/// decision), while the answer depends only on the configuration and the name. A fleet that
/// serves several models sees them interleaved, so the last [`ServesMemo::MODELS`] names are
/// kept (a name not among them replaces the oldest). Belongs to one configuration, as the
/// cache it lives in.
#[derive(Debug, Default, Clone)]
pub struct ServesMemo {
    /// The models (`None`: a request without one), oldest first, each with whether each
    /// endpoint serves it, by endpoint index, and its static candidates ([`Statics`]).
    pub(super) kept: Vec<(Option<String>, Vec<bool>, Rc<Statics>)>,
}

/// The endpoints that could serve a model at all (enabled and serving it), in index order,
/// with the counts of those left out: disabled, and enabled but not serving the model. A
/// function of the configuration and the model alone, kept beside the model's mask so that a
/// decision does not filter the fleet again (about 50 instructions per endpoint, twice per
/// decision: `Scheduler::candidates` and the pick's board).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Statics {
    pub indexes: Vec<usize>,
    /// Their rendezvous seeds (`hash::rendezvous_seed` of their ids), aligned with `indexes`.
    pub seeds: Vec<u64>,
    /// Their configured weights summed in that order (`cumulative[k]`: positions `0..=k`),
    /// from which a request without a session draws its order (`placement::Draws`).
    pub cumulative: Vec<f64>,
    pub disabled: u32,
    pub not_serving: u32,
}

impl Statics {
    /// Computed from `cfg` and the mask of who serves the model.
    pub fn of(cfg: &Config, serves: &[bool]) -> Statics {
        let mut s = Statics {
            indexes: Vec::with_capacity(cfg.endpoints.len()),
            seeds: Vec::with_capacity(cfg.endpoints.len()),
            cumulative: Vec::with_capacity(cfg.endpoints.len()),
            disabled: 0,
            not_serving: 0,
        };
        for (i, (ep, serves)) in cfg.endpoints.iter().zip(serves).enumerate() {
            if ep.disabled {
                s.disabled += 1;
            } else if *serves {
                s.indexes.push(i);
                s.seeds.push(rendezvous_seed(ep.id));
                let sum = s.cumulative.last().copied().unwrap_or(0.0);
                s.cumulative.push(sum + ep.weight.max(0.0));
            } else {
                s.not_serving += 1;
            }
        }
        s
    }
}

impl ServesMemo {
    /// Models kept.
    pub const MODELS: usize = 8;

    /// By endpoint index: whether `cfg`'s endpoint serves `model` (disabled or not).
    pub fn serves(&mut self, cfg: &Config, model: Option<&str>) -> &[bool] {
        let at = self.position(cfg, model);
        self.kept.get(at).map_or(&[], |(_, v, _)| v.as_slice())
    }

    /// The static candidates for `model` ([`Statics`]), shared (a decision holds them
    /// without a copy).
    pub fn statics(&mut self, cfg: &Config, model: Option<&str>) -> Option<&Rc<Statics>> {
        let at = self.position(cfg, model);
        self.kept.get(at).map(|(_, _, s)| s)
    }

    /// Where `model`'s entry is kept, made if it is not.
    pub(super) fn position(&mut self, cfg: &Config, model: Option<&str>) -> usize {
        let n = cfg.endpoints.len();
        let at = self
            .kept
            .iter()
            .position(|(m, v, _)| m.as_deref() == model && v.len() == n);
        match at {
            Some(at) => at,
            None => {
                let v: Vec<bool> = cfg
                    .endpoints
                    .iter()
                    .map(|e| model.is_none_or(|m| e.serves(m)))
                    .collect();
                let statics = Rc::new(Statics::of(cfg, &v));
                if self.kept.len() >= Self::MODELS {
                    self.kept.remove(0);
                }
                self.kept.push((model.map(str::to_string), v, statics));
                self.kept.len().saturating_sub(1)
            }
        }
    }
}

impl TableCache {
    /// An empty cache for `cfg` whose model memo already holds the models `cfg` names (the
    /// first [`ServesMemo::MODELS`] of them, in configuration order) and requests without one.
    pub fn for_config(cfg: &Config) -> TableCache {
        let mut cache = TableCache::default();
        let mut models: Vec<Option<&str>> = vec![None];
        let named = cfg
            .endpoints
            .iter()
            .filter_map(|e| e.models.as_ref())
            .flatten();
        for m in named {
            if models.len() >= ServesMemo::MODELS {
                break;
            }
            if !models.contains(&Some(m.as_str())) {
                models.push(Some(m.as_str()));
            }
        }
        for m in models {
            cache.serves.statics(cfg, m);
        }
        cache
    }

    /// [`Table::load_from`] of the store, reading only the groups whose version moved since
    /// this cache last read them, and decoding only their entries whose stamp changed.
    pub fn load(&mut self, store: &dyn Store, cfg: &Config) -> (Table, bool) {
        match self.refresh(store, cfg) {
            Some(()) => (self.table.clone(), true),
            None => self.reset(store, cfg),
        }
    }

    /// [`TableCache::load`] without the copy: the cached table itself, to be handed back
    /// unchanged with [`TableCache::give_back`] (until then the cache holds nothing).
    pub fn lend(&mut self, store: &dyn Store, cfg: &Config) -> (Table, bool) {
        match self.refresh(store, cfg) {
            Some(()) => {
                self.lent = true;
                (std::mem::take(&mut self.table), true)
            }
            None => self.reset(store, cfg),
        }
    }

    /// The configuration's endpoint ids, sorted: the slots of their loads
    /// ([`crate::scheduler::routing::scrape::fold`]), computed once per cache (one
    /// configuration).
    pub fn slot_ids(&mut self, cfg: &Config) -> &[u32] {
        self.slot_ids.get_or_insert_with(|| slot_ids(cfg))
    }

    /// The published loads of the configuration's endpoints, through [`TableCache::loads`]
    /// (see [`crate::scheduler::routing::scrape::LoadsMemo::read`]); none, without a read,
    /// when the configuration scrapes nothing.
    pub fn published_loads(
        &mut self,
        store: &dyn Store,
        cfg: &Config,
    ) -> Rc<crate::scheduler::routing::scrape::Loads> {
        let scrapes = *self
            .scrapes
            .get_or_insert_with(|| cfg.endpoints.iter().any(|e| e.metrics.is_some()));
        if !scrapes {
            // Nothing configured is scraped: no loads, nothing read.
            return Rc::default();
        }
        self.slot_ids(cfg);
        let ids = self.slot_ids.as_deref().unwrap_or_default();
        self.loads.read(store, ids)
    }

    /// From the worker's timer: [`TableCache::loads`] brought up to every slot (a catch-up
    /// for what the change ring could not say). A configuration that scrapes nothing reads
    /// nothing.
    pub fn tick_loads(
        &mut self,
        store: &dyn Store,
        cfg: &Config,
    ) -> Rc<crate::scheduler::routing::scrape::Loads> {
        if !cfg.endpoints.iter().any(|e| e.metrics.is_some()) {
            return Rc::default();
        }
        self.slot_ids(cfg);
        let ids = self.slot_ids.as_deref().unwrap_or_default();
        self.loads.tick(store, ids)
    }

    /// Group `g` is read again at the next load, whatever the header says (a write found it
    /// changed by a writer that has not recorded its version in the header yet).
    pub fn forget_group(&mut self, g: usize) {
        if let Some(seen) = self.groups_seen.get_mut(g) {
            *seen = None;
        }
    }

    /// While a table with `entries` entries is lent: how many of its entries store a degraded
    /// flag (`None`: no table lent).
    pub fn lent_degraded(&self, entries: usize) -> Option<usize> {
        (self.lent && self.stamps.len() == entries).then_some(self.degraded)
    }

    /// While a table is lent: the peers' median memo and the positions of the entries decoded
    /// since the last call (`None`: unknown, compare everything), which this call forgets.
    /// Without a lent table: the memo and `None` (the caller's table may be other bytes).
    pub fn lent_changes(&mut self, entries: usize) -> (&mut MedianMemo, Option<&[usize]>) {
        let known = self.lent && self.stamps.len() == entries && self.changed_known;
        (&mut self.peers, known.then_some(self.changed.as_slice()))
    }

    /// While a table with `entries` entries is lent: what a decision's board reads from and
    /// keeps in this cache ([`LentBoard`]). The list of entries changed since the board memo
    /// was last brought up to date is handed over and starts again empty: the caller brings
    /// the memo up to date or invalidates it. `None` when no table is lent.
    /// `drawn`: the decision's board is [`TableCache::drawn_board`] (the other memo keeps the
    /// changed entries for its next decision).
    pub fn lent_board(&mut self, entries: usize, drawn: bool) -> Option<LentBoard<'_>> {
        if !(self.lent && self.stamps.len() == entries) {
            return None;
        }
        let mut changed = self
            .board_changed_known
            .then(|| std::mem::take(&mut self.board_changed));
        self.board_changed.clear();
        self.board_changed_known = true;
        let (served, other) = if drawn {
            (&mut self.drawn_board, &mut self.board)
        } else {
            (&mut self.board, &mut self.drawn_board)
        };
        // The other memo keeps them for its next decision (past `entries`: unknown).
        match changed.as_ref() {
            Some(list) if !other.carried_unknown && other.carried.len() + list.len() <= entries => {
                other.carried.extend_from_slice(list);
            }
            _ => {
                other.carried.clear();
                other.carried_unknown = true;
            }
        }
        // And those carried by decisions the memo did not serve (see `BoardMemo::carry`).
        let carried = std::mem::take(&mut served.carried);
        match changed.as_mut() {
            Some(list) if !served.carried_unknown => list.extend(carried),
            _ => changed = None,
        }
        served.carried_unknown = false;
        Some(LentBoard {
            stamps: self.stamps.as_slice(),
            quiet: &mut self.quiet,
            board: served,
            changed,
            medians_computed: self.peers.computed,
            stored_degraded: self.degraded,
        })
    }

    /// After [`TableCache::lent_changes`] was read, while the table is lent: the list starts
    /// again, empty and known.
    pub fn forget_changes(&mut self, entries: usize) {
        if self.lent && self.stamps.len() == entries {
            self.changed.clear();
            self.changed_known = true;
        }
    }

    /// Takes back a table from [`TableCache::lend`] (unchanged: it must still match the
    /// stamps). Anything else is dropped, and the cache starts over.
    pub fn give_back(&mut self, table: Table) {
        if self.lent && table.entries.len() == self.stamps.len() {
            self.table = table;
        } else {
            self.stamps.clear();
            self.degraded = 0;
            self.groups_seen.clear();
        }
        self.lent = false;
    }

    pub(super) fn reset(&mut self, store: &dyn Store, cfg: &Config) -> (Table, bool) {
        self.stamps.clear();
        self.degraded = 0;
        self.groups_seen.clear();
        self.table = Table::default();
        self.lent = false;
        self.decoded = self.decoded.saturating_add(cfg.endpoints.len() as u64);
        Table::load_from(store, cfg)
    }

    /// Brings `table` up to the store when it has the configuration's layout: the header,
    /// then each group whose recorded version is past the one this cache read (or unknown),
    /// and of those the entries whose stamp moved. `None` when the stored layout is not the
    /// configuration's or a key does not decode (the caller starts over with a full load).
    pub(super) fn refresh(&mut self, store: &dyn Store, cfg: &Config) -> Option<()> {
        let n = cfg.endpoints.len();
        let head = groups::Head::read(store).0?;
        if head.entries != n {
            return None;
        }
        let count = groups::groups(n);
        let whole = self.lent
            || self.table.entries.len() != n
            || self.stamps.len() != n
            || self.groups_seen.len() != count;
        if whole {
            self.stamps.clear();
            self.table.entries.clear();
            self.degraded = 0;
            self.stamps.resize(n, None);
            self.table.entries.resize(n, (0, EndpointState::default()));
            self.groups_seen.clear();
            self.groups_seen.resize(count, None);
        }
        let mut notes = Notes {
            n,
            decoded: &mut self.decoded,
            degraded: &mut self.degraded,
            changed: (&mut self.changed, &mut self.changed_known),
            board_changed: (&mut self.board_changed, &mut self.board_changed_known),
        };
        // Each group's recorded version: as many as `groups_seen` (the header has the
        // configuration's entry count, and `groups_seen` as many groups, reset above).
        for ((g, seen), recorded) in self.groups_seen.iter_mut().enumerate().zip(head.versions()) {
            debug_assert_eq!(recorded, head.version(g));
            if seen.is_some_and(|s| s >= recorded) {
                continue;
            }
            *seen = None;
            let bytes = store.get(&groups::group_key(g)).0?;
            let (version, chunks) = groups::parse_group(&bytes)?;
            let from = g * GROUP_LEN;
            if chunks.len() != n.saturating_sub(from).min(GROUP_LEN) * ENTRY_BYTES {
                return None;
            }
            for (k, chunk) in chunks.chunks_exact(ENTRY_BYTES).enumerate() {
                let i = from + k;
                // Id, then stamp: the first 12 bytes of the entry.
                let id = u32_at(chunk, 0)?;
                let stamp = u64_at(chunk, 4)?;
                if cfg.endpoints.get(i).map(|e| e.id) != Some(id) {
                    return None;
                }
                let (Some(slot), Some(entry)) =
                    (self.stamps.get_mut(i), self.table.entries.get_mut(i))
                else {
                    return None;
                };
                if *slot != Some((stamp, id)) {
                    notes.take(chunk, i, (stamp, id), slot, entry)?;
                }
            }
            *seen = Some(version);
        }
        self.lent = false;
        self.table.budget = head.budget;
        self.table.generation = cfg.layout_generation;
        Some(())
    }
}

/// What [`TableCache::refresh`] notes of the entries it decodes again.
pub(super) struct Notes<'c> {
    pub(super) n: usize,
    pub(super) decoded: &'c mut u64,
    pub(super) degraded: &'c mut usize,
    /// The positions decoded, for the medians memo and for the board memo (each reads its own
    /// list: a board's decisions are not every decision the medians memo serves); `false`:
    /// more than the table holds, unknown.
    pub(super) changed: (&'c mut Vec<usize>, &'c mut bool),
    pub(super) board_changed: (&'c mut Vec<usize>, &'c mut bool),
}

impl Notes<'_> {
    /// Entry `i` of `bytes`, whose `(stamp, id)` differ from its `slot`'s, decoded into
    /// `entry`. `None` when it does not decode: nothing of this load may be trusted then (the
    /// caller starts over).
    pub(super) fn take(
        &mut self,
        chunk: &[u8],
        i: usize,
        key: (u64, u32),
        slot: &mut Option<(u64, u32)>,
        entry: &mut (u32, EndpointState),
    ) -> Option<()> {
        let was_degraded = slot.is_some() && entry.1.degraded;
        *slot = None;
        *entry = decode_entry(chunk)?;
        *self.degraded =
            self.degraded.saturating_sub(usize::from(was_degraded)) + usize::from(entry.1.degraded);
        *self.decoded = self.decoded.saturating_add(1);
        *slot = Some(key);
        for (list, known) in [&mut self.changed, &mut self.board_changed] {
            if **known && list.len() < self.n {
                list.push(i);
            } else {
                **known = false;
            }
        }
        Some(())
    }
}

/// One worker's memo of `signals::peer_medians`, kept beside its table cache.
///
/// Why: every decision needs every endpoint's peer median, and computing them sorts the
/// fleet's slowness values per model (about 1 400 instructions per endpoint under wasm at 512
/// endpoints), while the inputs change only when an answer teaches some endpoint's slowness:
/// most decisions see exactly the inputs of the one before. The memo keeps the inputs it was
/// computed from and recomputes only when one of them differs, so it always returns what
/// `signals::peer_medians` returns for the same table. It belongs to one configuration (the cache it
/// lives in is made anew with each configuration); ids and disabled flags are compared too.
#[derive(Debug, Default, Clone)]
pub struct MedianMemo {
    pub(crate) min_samples: u32,
    /// Per endpoint, in configuration order: id, disabled, and the one part of its slowness
    /// the medians read (`signals::median_input`: its smoothed log value's bits once it has
    /// the samples to count, else nothing), as last used. A cold endpoint's answers, and
    /// every other field of a warm one's slowness, leave the medians as they were.
    pub(crate) inputs: Vec<(u32, bool, Option<u64>)>,
    /// Shared with the decisions that read them (a decision holds them without a copy: a
    /// copy cost a byte's worth of instructions per byte under wasm).
    pub(crate) medians: Rc<Vec<Option<f64>>>,
    /// Times the medians were recomputed, for tests and diagnostics.
    pub computed: u64,
    /// The inputs are those of the table cache's table as of its last list of changes
    /// (`MedianMemo::medians_since`): the next list says all that may differ.
    pub(crate) synced: bool,
}

/// What [`TableCache::lent_board`] lends.
pub struct LentBoard<'a> {
    /// `(stamp, id)` of each entry of the lent table, by position.
    pub stamps: &'a [Option<(u64, u32)>],
    pub quiet: &'a mut QuietMemo,
    pub board: &'a mut BoardMemo,
    /// Positions decoded since the board memo was last brought up to date (`None`: unknown).
    pub changed: Option<Vec<usize>>,
    /// The medians memo's recomputations so far ([`MedianMemo::computed`]): unchanged, the
    /// peers' medians are those of the memo's last decision.
    pub medians_computed: u64,
    /// Entries of the lent table whose stored verdict is degraded.
    pub stored_degraded: usize,
}

/// One worker's last session decision's board: the static candidates' verdicts, flips and
/// placement weights, kept current by the entries that changed since.
///
/// Why: with the quiet memo a pick still visits every candidate (a memo look-up, about 180
/// instructions per endpoint under wasm), while between two decisions of a worker only the
/// entries of the endpoints used in between changed. This memo keeps the whole board of the
/// last session decision for one model; the next one recomputes only the positions whose
/// entry was decoded again since (their stamp moved), whose peers' median changed, whose
/// scraped load, slots or peers' median pace changed, whose load turned past its age, or whose
/// values depend on the clock (`live`: not quiet, see [`QuietMemo`]). Every other position's
/// values are those the quiet memo would return. It belongs to one configuration (the cache
/// it lives in); `select`'s `memo_tests` hold it to the decisions computed without it.
#[derive(Debug, Default, Clone)]
pub struct BoardMemo {
    /// Holds a board (false: the next session decision computes every position).
    pub(crate) valid: bool,
    pub(crate) model: Option<String>,
    /// The medians memo's recomputations when the board was last brought up to date, and the
    /// medians it read then (by index).
    pub(crate) medians_computed: u64,
    pub(crate) references: Rc<Vec<Option<f64>>>,
    /// The static candidates (index order) and their `(index, id, weight)`, aligned.
    pub(crate) statics: Vec<usize>,
    /// The board's parts are shared with the decision that reads them (lent without a copy,
    /// changed in place once it is done: `Rc::make_mut` copies only while one is held).
    pub(crate) weights: Rc<Vec<(usize, u32, f64)>>,
    /// By index: the verdict.
    pub(crate) verdicts: Rc<Vec<Verdict>>,
    /// The positions whose verdict differs from the stored one, index order.
    pub(crate) flips: Rc<Vec<usize>>,
    /// Positions whose values depend on the clock: recomputed by every decision.
    pub(crate) live: Vec<usize>,
    /// The engines' inputs the board was judged on, by index (empty: nothing scraped): the
    /// loads and their peers' median pace (shared with the decision's), and the slots.
    pub(crate) loads: Rc<Vec<Option<EngineLoad>>>,
    pub(crate) pace: Rc<Vec<Option<f64>>>,
    pub(crate) slots: Vec<Option<u32>>,
    /// The engines' `slots_version` the statics' `slots` equal (`None`: unknown).
    pub(crate) slots_version: Option<u64>,
    /// Counts the changes to `weights` (a new board, a weight or id recomputed otherwise).
    pub(crate) weights_version: u64,
    /// What the last decision over this board derived from its weights, slots and loads
    /// (see `choose::gather`), with the versions and loads it was derived from.
    pub(crate) lists: Option<BoardLists>,
    /// Every load kept that was fresh when judged stays so up to this instant (see
    /// `signals::Engine::fresh_until`).
    pub(crate) fresh_until: u64,
    /// Static candidates treated as degraded.
    pub(crate) degraded: usize,
    /// The positions the last reuse computed again.
    pub(crate) dirty: Vec<usize>,
    /// By index: the breaker admission of the statics as a first attempt saw it (empty: none
    /// kept), and the statics whose breaker was not closed (asked again by every decision: a
    /// closed breaker admits whatever the time).
    pub(crate) admission: Rc<Vec<Option<crate::scheduler::health::breaker::Admission>>>,
    pub(crate) open: Vec<usize>,
    /// Decisions that reused the memo, for tests and diagnostics.
    pub hits: u64,
    /// Positions decoded again that decisions the memo did not serve took from the table
    /// cache's list, for the next one it serves; `carried_unknown`: some were not known.
    pub(crate) carried: Vec<usize>,
    pub(crate) carried_unknown: bool,
    /// The homes of the last few rendezvous keys placed over this board, `(key, home)`:
    /// cleared when a weight or a degraded flag changes.
    pub(crate) homes: Vec<(u64, Option<usize>)>,
    /// The first passes of the same keys' orders where they were the whole search (no
    /// degraded candidate), kept and forgotten with the homes: a failover's next attempt
    /// takes the second of its order from the kept hashes without hashing every candidate.
    pub(crate) passes: Vec<(u64, FirstPass)>,
}

/// What a decision derives from a board's weights, its statics' slots and loads (see
/// `choose::gather`): kept in the board memo while the weights (`weights_version`), the slots
/// (`slots_version`) and the loads (the same list) are the ones they were derived from.
#[derive(Debug, Clone)]
pub struct BoardLists {
    pub(crate) weights_version: u64,
    pub(crate) slots_version: u64,
    pub(crate) loads: Rc<Vec<Option<EngineLoad>>>,
    /// Every static candidate has a fresh load.
    pub(crate) all_scraped: bool,
    /// Every static candidate's slots are known.
    pub(crate) by_slots: bool,
    /// The most slots known among the statics (0: none).
    pub(crate) most_slots: u32,
    /// The rendezvous weights as the decision weighs them (by slots where some are known).
    pub(crate) weights: Rc<Vec<(usize, u32, f64)>>,
}

/// A rendezvous order's first pass as `placement::Keyed` keeps it, for the board memo.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FirstPass {
    /// The first of the order, if any: its position among the candidates and its exact key
    /// `(key, id, index)`.
    pub top: Option<(usize, (f64, u32, usize))>,
    /// The greatest hashes the pass kept, when they decided it alone.
    pub kept: Option<KeptHashes>,
}

/// The `(hash, position)`s of a first pass's greatest bounds, greatest first (as many as
/// `placement::TOP_KEPT`), and the greatest bound a candidate left out may have.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KeptHashes {
    pub hashes: [(u64, usize); 4],
    pub left: f64,
}

/// One worker's memo of its quiet endpoints' verdicts and session placement weights.
///
/// Why: a pick judges every candidate (its verdict, for the walk and for the hysteresis its
/// write stores) and weighs it (the rendezvous weights): about 350 instructions per endpoint
/// and request under wasm, while most endpoints of a large fleet are quiet between two
/// requests of a worker. An endpoint is quiet (`signals::quiet`) when its weight cannot
/// change with the clock: a success level that does not fade (cold, or never failing). Its
/// verdict and weight are then functions of its entry, its peers' median, and, where it has a
/// scraped load, of that load (the scrape it came from), its slots, its peers' median pace and
/// whether the load is past the saturation rule's age (the one thing of the clock a verdict
/// reads, `signals::judge_with`). They are kept here by the entry's write stamp (see
/// [`TableCache`], which holds this memo: one per configuration) and those inputs, compared
/// at every look-up. Anything not quiet, or not kept, is computed as before; the memo never
/// returns what computing would not (`select`'s `memo_tests` hold it to that).
#[derive(Debug, Default, Clone)]
pub struct QuietMemo {
    /// By endpoint index (compact: a hit reads one entry and writes at most two flags).
    pub(crate) at: Vec<Quiet>,
    /// Values taken from the memo instead of computed, for tests and diagnostics.
    pub hits: u64,
}

/// What [`QuietMemo`] keeps of one endpoint. A quiet endpoint's verdict is its sticky flag
/// (`degraded` equals it), its saturation and its load.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct Quiet {
    /// Holds a value (false: nothing kept).
    pub(crate) valid: bool,
    /// The entry's write stamp and id, as the table cache decoded it.
    pub(crate) stamp: u64,
    pub(crate) id: u32,
    /// The peers' median it was judged against (its bits; `has_reference` false: none).
    pub(crate) has_reference: bool,
    pub(crate) reference: u64,
    pub(crate) sticky: bool,
    /// Its verdict differs from the one stored in its entry (`select`'s `Board::flips`).
    pub(crate) flip: bool,
    /// Its session placement weight (`placement::weigh`).
    pub(crate) weight: f64,
    /// The scraped load it was judged on (`None`: none), with what its verdict read besides
    /// when there is one: the slots of its saturation rule, the peers' median pace (its bits,
    /// read only where the load has a pace) and whether the load was past the rule's age
    /// then; and the saturation judged.
    pub(crate) load: Option<EngineLoad>,
    pub(crate) slots: Option<u32>,
    pub(crate) pace_reference: Option<u64>,
    pub(crate) stale: bool,
    pub(crate) saturation: Saturation,
}
