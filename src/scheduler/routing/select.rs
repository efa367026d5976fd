//! Selection: filter (exclusions) → affinity → score → pick, and recording what happened.
//!
//! Exclusions apply in this order, each counted for diagnostics: disabled; dead keys (401/403
//! earlier in *this* request); used keys (429 earlier in this request); endpoints already tried
//! in this request; model mismatch; breaker not admitting. Dead and used keys live only in the
//! request's [`Exclusions`]: cross-request memory is the breaker and the statistics alone.
//!
//! [`Scheduler::choose`] reads top to bottom in four steps:
//! 1. **board**: what every endpoint may do in this decision — its placement weight (what every
//!    replica sees alike, see [`crate::scheduler::routing::placement`]), its verdicts ([`crate::scheduler::routing::select::signals`]: degraded
//!    by its slowness for the work against its peers, saturated by its engine's scraped load),
//!    quota, and the breaker's admission of this attempt's candidates;
//! 2. **pin verdict**: a live pin wins, unless staying is a certain 429, its endpoint is
//!    degraded (the pin is broken: `pin_break`), or it is saturated with an expected wait
//!    longer than re-prefilling elsewhere and the session was not moved for that within its
//!    TTL (moved: `saturated`);
//! 3. **placement walk**: the first candidate in the session's weighted rendezvous order that
//!    admits traffic, is not degraded (but for a due probe — the probe decision), not
//!    saturated while another has room, not short of quota, and within its bounded load. The
//!    order is the same on every Envoy replica, so an unpinned session goes to the same home
//!    everywhere, and a failover walks the same order, to the same backup;
//! 4. **settle**: the decision's labels and whether a success pins the session there.
//!
//! A session without a pin whose request has a prefix key ([`Pick::prefix`]) walks the prefix's
//! rendezvous order instead of its own (`prefix_placement`; affinity `prefix`).
//! Requests without a session are placed the same way on a per-request key, with the full
//! score (in-flight included) as weight. [`Scheduler::finish_observed`] records an attempt, one
//! function per concern (in-flight and watch, success rate, raw latency, slowness, payoff,
//! quota, probe backoff, breaker; then the work model and the affinity).

use self::capacity::{Engines, Room, RoomsMemo};
pub use self::pick::*;
use self::signals::{Served, Verdict};
use crate::scheduler::config::Config;
use crate::scheduler::health::breaker::{Admission, BreakerConfig, BreakerState};
use crate::scheduler::health::outcome::Outcome;
use crate::scheduler::routing::judge::saturation::{MoveReason, Saturation};
use crate::scheduler::routing::judge::slowness::{self, DegradeRule, Sample, WorkModel};
use crate::scheduler::routing::pins::affinity::{Affinity, MOVES_PREFIX};
use crate::scheduler::routing::placement;
use crate::scheduler::routing::placement::score::score;
use crate::scheduler::routing::placement::sessions;
use crate::scheduler::routing::quota::{self, estimate_tokens, QuotaHint, QuotaMark, QuotaRule};
use crate::scheduler::routing::table::ewma;
use crate::scheduler::routing::table::groups::{self, GroupWrite, Head, Patch};
use crate::scheduler::routing::table::{
    fastest_warm, BoardMemo, EndpointState, Statics, Table, TableCache, GROUP_LEN,
};
use crate::scheduler::state::store::{Store, CAS_RETRIES};
use crate::scheduler::wire::usage::Usage;
use std::cell::RefCell;
use std::rc::Rc;

/// The weight of a dead-key (401/403) outcome in the success-rate EWMA, at least.
pub const DEAD_KEY_ALPHA: f64 = 0.5;

/// Weight of each new outcome (1 success, 0 failure) in an endpoint's success-rate estimate,
/// which multiplies its score and sets its placement level. Not a key: the measured default.
pub const SUCCESS_RATE_ALPHA: f64 = 0.1;

/// Shared-data key of the endpoint table.
pub use crate::scheduler::routing::table::TABLE_KEY;

pub struct Scheduler<'a> {
    pub cfg: &'a Config,
    pub store: &'a dyn Store,
    /// The worker's decoded entries (see [`TableCache`]); `None`: decode every read.
    pub cache: Option<&'a RefCell<TableCache>>,
    /// The worker's capacities and rooms last derived (see [`RoomsMemo`]); `None`: derived
    /// at every read.
    pub rooms: Option<&'a RefCell<RoomsMemo>>,
}

impl<'a> Scheduler<'a> {
    pub fn new(cfg: &'a Config, store: &'a dyn Store) -> Self {
        Scheduler {
            cfg,
            store,
            cache: None,
            rooms: None,
        }
    }

    /// What a decision knows of the engines ([`Engines::read`]), their loads through the
    /// worker's memos when there is a cache (the slots written since its last read alone,
    /// derived again only when they changed: `signals::fresh_engines`).
    pub fn engines(&self, now_ms: u64) -> Engines {
        let fresh = self
            .cache
            .and_then(|c| c.try_borrow_mut().ok())
            .map(|mut c| signals::fresh_engines(&mut c, self.store, self.cfg, now_ms));
        match fresh {
            Some(f) => {
                let mut rooms = self.rooms.and_then(|r| r.try_borrow_mut().ok());
                Engines::read_memo(self.store, self.cfg, f.loads, f.pace, rooms.as_deref_mut())
            }
            None => Engines::read(self.store, self.cfg, now_ms),
        }
    }

    /// A scheduler that reads the table through this worker's `cache` (same decisions, fewer
    /// entries decoded).
    pub fn with_cache(
        cfg: &'a Config,
        store: &'a dyn Store,
        cache: &'a RefCell<TableCache>,
    ) -> Self {
        Scheduler {
            cfg,
            store,
            cache: Some(cache),
            rooms: None,
        }
    }

    /// [`Scheduler::with_cache`] that also keeps the capacities and rooms it derives in the
    /// worker's `rooms` memo (derived again only when the stored capacities or the loads
    /// changed).
    pub fn with_caches(
        cfg: &'a Config,
        store: &'a dyn Store,
        cache: &'a RefCell<TableCache>,
        rooms: &'a RefCell<RoomsMemo>,
    ) -> Self {
        Scheduler {
            rooms: Some(rooms),
            ..Scheduler::with_cache(cfg, store, cache)
        }
    }

    /// [`Table::load_from`] of the store, through the cache if there is one (and it is not in
    /// use).
    fn load_table(&self) -> (Table, bool) {
        match self.cache.and_then(|c| c.try_borrow_mut().ok()) {
            Some(mut cache) => cache.load(self.store, self.cfg),
            None => Table::load_from(self.store, self.cfg),
        }
    }

    /// `f` over [`Table::load_from`] of the store: the worker's cached table itself, lent
    /// without a copy and taken back afterwards (the cache is free again while `f` runs), when
    /// there is a cache; else a table loaded for the occasion.
    pub(crate) fn with_table<R>(&self, f: impl FnOnce(&Table, bool) -> R) -> R {
        let lent = self
            .cache
            .and_then(|c| c.try_borrow_mut().ok())
            .map(|mut cache| cache.lend(self.store, self.cfg));
        let Some((table, same_layout)) = lent else {
            let (table, same_layout) = Table::load_from(self.store, self.cfg);
            return f(&table, same_layout);
        };
        let out = f(&table, same_layout);
        if let Some(mut cache) = self.cache.and_then(|c| c.try_borrow_mut().ok()) {
            cache.give_back(table);
        }
        out
    }

    /// By endpoint index: whether it serves `model` (disabled or not), from the worker's memo
    /// when there is one.
    pub(crate) fn serving(&self, model: Option<&str>) -> Vec<bool> {
        match self.cache.and_then(|c| c.try_borrow_mut().ok()) {
            Some(mut cache) => cache.serves.serves(self.cfg, model).to_vec(),
            None => self
                .cfg
                .endpoints
                .iter()
                .map(|e| serves_opt(e, model))
                .collect(),
        }
    }

    /// Every endpoint's peers' median slowness in `table` ([`signals::peer_medians`]), from
    /// the worker's memo when there is one (recomputed only when some slowness changed).
    fn peer_references(&self, table: &Table) -> Rc<Vec<Option<f64>>> {
        let min_samples = DegradeRule::from_config(self.cfg).min_samples;
        match self.cache.and_then(|c| c.try_borrow_mut().ok()) {
            Some(mut cache) => {
                // Through the lent table's list of re-decoded entries: only theirs compared.
                let (memo, changed) = cache.lent_changes(table.entries.len());
                memo.medians_since(table, self.cfg, min_samples, changed);
                let medians = memo.shared();
                cache.forget_changes(table.entries.len());
                medians
            }
            None => Rc::new(signals::peer_medians(table, self.cfg, min_samples)),
        }
    }

    pub fn affinity(&self) -> Affinity<'a> {
        Affinity::new(
            self.store,
            self.cfg.affinity_ttl_ms,
            self.cfg.affinity_max_sessions,
        )
    }

    /// The move marks (see `affinity::MOVES_PREFIX`).
    pub fn moves(&self) -> Affinity<'a> {
        Affinity::with_prefix(
            self.store,
            MOVES_PREFIX,
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
        }
    }

    /// The endpoint table as stored now, aligned to the configuration.
    pub fn table(&self) -> Table {
        self.load_table().0
    }

    /// The endpoints that could serve `model` at all ([`Statics`]), from the worker's memo
    /// when there is one.
    pub(crate) fn statics(&self, model: Option<&str>) -> Rc<Statics> {
        match self.cache.and_then(|c| c.try_borrow_mut().ok()) {
            Some(mut cache) => cache
                .serves
                .statics(self.cfg, model)
                .cloned()
                .unwrap_or_default(),
            None => Rc::new(Statics::of(self.cfg, &self.serving(model))),
        }
    }

    /// Applies the request-scoped and static exclusions. `Err` when nothing is left.
    pub fn candidates(&self, pick: &Pick<'_>) -> Result<(Vec<usize>, Dropped), NoEndpoint> {
        // The static candidates as if nothing were excluded, then the request's few
        // exclusions taken out (a look-up in the exclusion lists per endpoint cost about 300
        // instructions each).
        let statics = self.statics(pick.model);
        let mut dropped = Dropped {
            disabled: statics.disabled,
            model: statics.not_serving,
            ..Dropped::default()
        };
        let serves_model = !statics.indexes.is_empty();
        let mut out = statics.indexes.clone();
        let ex = pick.exclusions;
        // A first attempt excludes nothing.
        if !(ex.dead.is_empty() && ex.used.is_empty() && ex.tried.is_empty()) {
            let mut excluded: Vec<usize> = ex
                .dead
                .iter()
                .chain(&ex.used)
                .chain(&ex.tried)
                .copied()
                .collect();
            excluded.sort_unstable();
            excluded.dedup();
            for i in excluded {
                if self.cfg.endpoints.get(i).is_none_or(|ep| ep.disabled) {
                    continue;
                }
                // Counted by the first list that names it, in the order exclusions apply.
                if ex.dead.contains(&i) {
                    dropped.dead += 1;
                } else if ex.used.contains(&i) {
                    dropped.used += 1;
                } else {
                    dropped.tried += 1;
                }
                match out.binary_search(&i) {
                    Ok(at) => {
                        out.remove(at);
                    }
                    // Not serving the model: counted as excluded, not as a model mismatch.
                    Err(_) => dropped.model = dropped.model.saturating_sub(1),
                }
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
        let entry = pick
            .session
            .and_then(|s| self.affinity().lookup_entry(s, now_ms).map(|e| (s, e)));
        let local = entry.map(|(s, e)| (s, e.endpoint_id, e.placement_key));
        // The prefix key the pin recorded (the one its session was placed by) is its home's key
        // on this turn too: the instructions need not be hashed again (see `affinity`). Only
        // for a request that has instructions at all, as the key would come from them.
        let rekeyed;
        let pick = match local.map(|p| p.2) {
            Some(k) if k != 0 && !matches!(pick.prefix, Prefix::Known(None)) => {
                rekeyed = Pick {
                    prefix: Prefix::Known(Some(k)),
                    ..*pick
                };
                &rekeyed
            }
            _ => pick,
        };
        let local = local.map(|(s, id, _)| (s, id));
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
        let pinned = pick.holder.or(hinted).or(local.map(|p| p.1));
        let bcfg = self.breaker_config();
        let mut engines = self.engines(now_ms);
        // A new session placed by prefix reads the sessions placed per endpoint, for the
        // session bound of a busy prefix home (see `sessions`).
        let new_session = pick.session.is_some() && pinned.is_none() && !pick.follow_up;
        if self.cfg.prefix_placement && new_session && pick.prefix.get().is_some() {
            engines.sessions = Some(sessions::read_counts(self.store, now_ms));
        }
        let result = self.start_and_store(&candidates, pick, pinned, &engines, now_ms);
        let decision = match result {
            Placed::Stored(r) => r,
            // CAS kept losing on a half-open probe: its slot was never stored, so sending it
            // could exceed `half_open_probes` (every worker losing races would send one).
            // Decide locally among the endpoints whose breaker is closed.
            Placed::Unstored(Ok(d)) if d.ticket.probe_epoch.is_some() => {
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
                let c = self.choose(&table, &closed, pick, pinned, &engines, now_ms)?;
                let ticket = Ticket {
                    endpoint: c.endpoint,
                    endpoint_id: self.cfg.endpoints.get(c.endpoint).map_or(0, |e| e.id),
                    probe_epoch: None,
                    counted: false,
                    started_ms: now_ms,
                    degraded_probe: false,
                    pin_on_success: c.pin_on_success,
                    pinned_usage: None,
                    served: None,
                    quota_tokens: 0,
                    quota_mark: QuotaMark::default(),
                    placement_key: 0,
                    previous_prompt_tokens: 0,
                };
                Ok(Decision {
                    endpoint: c.endpoint,
                    reason: c.reason,
                    affinity: c.affinity,
                    ticket,
                    broke_pin_of: c.broke_pin_of,
                    moved_pin_of: c.moved,
                    home: c.home,
                    quota_skipped: c.quota_skipped,
                    by_prefix: c.by_prefix,
                })
            }
            // CAS kept losing: go with the decision, but nothing was stored for it.
            Placed::Unstored(r) => r.map(|mut d| {
                d.ticket.counted = false;
                d.ticket.probe_epoch = None;
                // Its pick's place among the stored picks is unknown: its answer's statement
                // only lowers the count.
                d.ticket.quota_mark = QuotaMark::default();
                d
            }),
        };
        // A placement (anything but a pinned session's hit) counts on top of its endpoint's
        // last scrape (see `capacity`).
        if let Ok(d) = &decision {
            let placed = (d.affinity != AffinityResult::Hit).then_some(d.endpoint);
            match self.cache.and_then(|c| c.try_borrow_mut().ok()) {
                // The configured ids sorted once per worker, not per placement.
                Some(mut c) => {
                    engines.record(self.store, self.cfg, placed, Some(c.slot_ids(self.cfg)))
                }
                None => engines.record(self.store, self.cfg, placed, None),
            }
            // A new session's first attempt counts where it was placed (by prefix or by its
            // own key: both bring their later turns there).
            let placed_new = matches!(
                d.affinity,
                AffinityResult::Prefix
                    | AffinityResult::Home
                    | AffinityResult::Spill
                    | AffinityResult::Backup
            );
            if self.cfg.prefix_placement && new_session && pick.attempt <= 1 && placed_new {
                let id = d.ticket.endpoint_id;
                // The counts the decision read are written back with this one (one read).
                match engines.sessions.take() {
                    Some(read) => sessions::record_read(self.store, self.cfg, read, id, now_ms),
                    None => sessions::record(self.store, self.cfg, id, now_ms),
                };
            }
        }
        // Its pin records the key its home is by (asked by `choose` already: remembered).
        let mut decision = decision;
        if let (Ok(d), true) = (&mut decision, self.cfg.prefix_placement) {
            if pick.session.is_some() {
                d.ticket.placement_key = pick.prefix.get().unwrap_or(0);
            }
        }
        // A turn sent where its session's last answer was: what that answer's prompt was.
        if let (Ok(d), Some((_, e))) = (&mut decision, entry) {
            if e.endpoint_id == d.ticket.endpoint_id {
                d.ticket.previous_prompt_tokens = u64::from(e.prompt_tokens);
            }
        }
        // A session moved away from a saturated endpoint is marked, so that it is not moved
        // for that reason again within its TTL.
        if let (Ok(d), Some(s)) = (&decision, pick.session) {
            if d.moved_pin_of.is_some() {
                self.moves()
                    .remember(s, MoveReason::Saturated as u32, now_ms);
            }
        }
        decision
    }

    /// The write of one pick over the stored table `bytes` (read as `table`): the choice,
    /// the verdicts that flipped, the attempt started on the chosen entry, and the bytes to
    /// store. Only the entries that change are copied out of `table`; a write that changes
    /// the chosen entry alone patches it into a copy of the stored bytes.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn start(
        &self,
        table: &Table,
        same_layout: bool,
        candidates: &[usize],
        pick: &Pick<'_>,
        pinned: Option<u32>,
        engines: &Engines,
        now_ms: u64,
    ) -> (Write, Result<Decision, NoEndpoint>) {
        let bcfg = self.breaker_config();
        let mut budget = table.budget;
        let retry = pick.attempt > 1 && !pick.exclusions.retry_free;
        if retry
            && !budget.try_retry(
                now_ms,
                self.cfg.retry_budget_percent,
                self.cfg.retry_budget_min_retries,
            )
        {
            return (Write::Nothing, Err(NoEndpoint::BudgetExhausted));
        }
        let choice = match self.choose(table, candidates, pick, pinned, engines, now_ms) {
            Err(e) => return (Write::Nothing, Err(e)),
            Ok(c) => c,
        };
        let i = choice.endpoint;
        // Verdicts that flipped are stored for their hysteresis (rare: a full write).
        let mut own = table.entries.get(i).map(|(_, st)| *st);
        let before = own;
        let mut flipped: Vec<(usize, EndpointState)> = Vec::new();
        let mut verdicts: Vec<(usize, u32, bool, Saturation)> = Vec::new();
        for &(j, degraded, saturation) in &choice.verdicts {
            if j == i {
                if let Some(st) = own.as_mut() {
                    store_verdict(st, degraded, saturation, now_ms);
                }
            } else if let Some((_, st)) = table
                .entries
                .get(j)
                // Only an entry whose stored verdict differs is copied (what `store_verdict`
                // would change): a copy per endpoint cost about 80 instructions each.
                .filter(|(_, st)| {
                    st.degraded != degraded || st.saturation.stored_differs(saturation)
                })
            {
                let mut st = *st;
                if store_verdict(&mut st, degraded, saturation, now_ms) {
                    flipped.push((j, st));
                    let id = table.entries.get(j).map_or(0, |(id, _)| *id);
                    verdicts.push((j, id, degraded, saturation));
                }
            }
        }
        let (Some(mut st), Some(before)) = (own, before) else {
            return (Write::Nothing, Err(NoEndpoint::Exhausted));
        };
        let probe_epoch = match st.breaker.admit(now_ms, &bcfg) {
            Admission::Probe { epoch } => Some(epoch),
            _ => None,
        };
        if choice.reason == Reason::DegradedProbe {
            st.degraded_probe_ms = now_ms;
            st.degraded_probes = st.degraded_probes.saturating_add(1);
        }
        st.start_attempt(now_ms, self.cfg.in_flight_max_age_ms);
        let (quota_tokens, quota_mark) = if self.cfg.quota_aware {
            let estimate = pick.quota_estimate(crate::scheduler::routing::quota::BYTES_PER_TOKEN);
            let mut mark = st.quota.consume(estimate, now_ms);
            // A new session's first turn: what it will spend next window counts in pacing.
            if pick.session.is_some() && !pick.follow_up && choice.reason != Reason::AffinityHit {
                st.quota.place(estimate, &mut mark, now_ms);
            }
            (estimate, mark)
        } else {
            (0, QuotaMark::default())
        };
        if pick.attempt <= 1 {
            budget.on_request(now_ms);
        }
        let id = table.entries.get(i).map_or(0, |(id, _)| *id);
        let ticket = Ticket {
            endpoint: i,
            endpoint_id: self.cfg.endpoints.get(i).map_or(0, |e| e.id),
            probe_epoch,
            counted: true,
            started_ms: now_ms,
            degraded_probe: choice.reason == Reason::DegradedProbe,
            pin_on_success: choice.pin_on_success,
            pinned_usage: None,
            served: None,
            quota_tokens,
            quota_mark,
            placement_key: 0,
            previous_prompt_tokens: 0,
        };
        let write = if same_layout {
            Write::Groups {
                endpoint: i,
                id,
                before,
                state: st,
                verdicts,
                retry,
                first: pick.attempt <= 1,
            }
        } else {
            let mut whole = table.clone();
            let mut changed = vec![i];
            for (j, s) in flipped {
                if let Some((_, e)) = whole.entries.get_mut(j) {
                    *e = s;
                    changed.push(j);
                }
            }
            if let Some((_, e)) = whole.entries.get_mut(i) {
                *e = st;
            }
            Write::Layout {
                table: whole,
                changed,
                retry,
                first: pick.attempt <= 1,
            }
        };
        (
            write,
            Ok(Decision {
                endpoint: i,
                reason: choice.reason,
                affinity: choice.affinity,
                ticket,
                broke_pin_of: choice.broke_pin_of,
                moved_pin_of: choice.moved,
                home: choice.home,
                quota_skipped: choice.quota_skipped,
                by_prefix: choice.by_prefix,
            }),
        )
    }
}

/// What a pick writes over the stored table (see [`Scheduler::start`]). Returned once per
/// pick and consumed at once: boxing the large variant would cost an allocation each time.
#[allow(clippy::large_enum_variant)]
enum Write {
    Nothing,
    /// The stored table has the configuration's layout: the chosen entry (if it is still
    /// `before`, as the decision read it) and the flipped verdicts, each in its group, then
    /// the groups' versions and the budget in the header.
    Groups {
        endpoint: usize,
        id: u32,
        before: EndpointState,
        state: EndpointState,
        /// Other entries whose stored verdict flipped: position, id, verdict.
        verdicts: Vec<(usize, u32, bool, Saturation)>,
        /// The budget's changes, applied to the stored budget: a retry taken, a request.
        retry: bool,
        first: bool,
    },
    /// Another layout (or none) is stored: the whole table laid out (see [`groups::lay_out`]).
    Layout {
        table: Table,
        changed: Vec<usize>,
        retry: bool,
        first: bool,
    },
}

/// A decision and whether its write was stored ([`Scheduler::start_and_store`]).
enum Placed {
    /// Stored (or nothing to store).
    Stored(Result<Decision, NoEndpoint>),
    /// Every attempt to store it lost the compare-and-swap: the last decision, with nothing
    /// stored for it.
    Unstored(Result<Decision, NoEndpoint>),
}

/// How storing a pick's write went.
enum Stored {
    Done,
    /// The chosen entry changed since the decision read it: decide again.
    Again,
    GaveUp,
}

impl Scheduler<'_> {
    /// Decides and stores the decision's write, deciding again (over the entries that moved)
    /// when the chosen entry changed in between; [`Placed::Unstored`] with the last decision
    /// when every attempt lost.
    fn start_and_store(
        &self,
        candidates: &[usize],
        pick: &Pick<'_>,
        pinned: Option<u32>,
        engines: &Engines,
        now_ms: u64,
    ) -> Placed {
        let mut last = None;
        for _ in 0..CAS_RETRIES {
            let (write, decision) = self.with_table(|table, same_layout| {
                self.start(
                    table,
                    same_layout,
                    candidates,
                    pick,
                    pinned,
                    engines,
                    now_ms,
                )
            });
            match self.store_write(write, now_ms) {
                Stored::Done => return Placed::Stored(decision),
                Stored::Again => last = Some(decision),
                Stored::GaveUp => return Placed::Unstored(decision),
            }
        }
        Placed::Unstored(last.unwrap_or(Err(NoEndpoint::Exhausted)))
    }

    /// Stores a pick's [`Write`].
    fn store_write(&self, write: Write, now_ms: u64) -> Stored {
        let cfg = self.cfg;
        let budget = |retry: bool, first: bool| {
            move |b: &mut crate::scheduler::health::budget::RetryBudget| {
                if retry {
                    b.try_retry(
                        now_ms,
                        cfg.retry_budget_percent,
                        cfg.retry_budget_min_retries,
                    );
                }
                if first {
                    b.on_request(now_ms);
                }
            }
        };
        match write {
            Write::Nothing => Stored::Done,
            Write::Layout {
                table,
                changed,
                retry,
                first,
            } => {
                if groups::lay_out(self.store, &table, &changed, budget(retry, first)) {
                    Stored::Done
                } else {
                    Stored::Again
                }
            }
            Write::Groups {
                endpoint,
                id,
                before,
                state,
                verdicts,
                retry,
                first,
            } => {
                let (head, cas) = Head::read(self.store);
                let floor = |g: usize| head.as_ref().map_or(0, |h| h.version(g));
                let g = endpoint / GROUP_LEN;
                // The chosen entry first, with the verdicts of its own group.
                let mut wanted = vec![(endpoint % GROUP_LEN, id)];
                let mut acts = vec![None];
                for &(j, jid, degraded, saturation) in &verdicts {
                    if j / GROUP_LEN == g {
                        wanted.push((j % GROUP_LEN, jid));
                        acts.push(Some((degraded, saturation)));
                    }
                }
                let w = groups::patch_group(self.store, g, floor(g), &wanted, |k, st| {
                    match acts.get(k).copied().flatten() {
                        None if *st == before => {
                            *st = state;
                            Patch::Changed
                        }
                        None => Patch::Stale,
                        Some((d, s)) if store_verdict(st, d, s, now_ms) => Patch::Changed,
                        Some(_) => Patch::Same,
                    }
                });
                let mut written = vec![];
                match w {
                    GroupWrite::Written(v) => written.push((g, v)),
                    GroupWrite::Unchanged => {}
                    GroupWrite::GaveUp => return Stored::GaveUp,
                    GroupWrite::Stale | GroupWrite::Missing => {
                        if let Some(mut cache) = self.cache.and_then(|c| c.try_borrow_mut().ok()) {
                            cache.forget_group(g);
                        }
                        return Stored::Again;
                    }
                }
                // The other groups' flipped verdicts (hysteresis only: a write lost here is
                // judged again by the next decision).
                let mut rest: Vec<&(usize, u32, bool, Saturation)> =
                    verdicts.iter().filter(|v| v.0 / GROUP_LEN != g).collect();
                rest.sort_by_key(|v| v.0);
                for chunk in rest.chunk_by(|a, b| a.0 / GROUP_LEN == b.0 / GROUP_LEN) {
                    let Some(first_of) = chunk.first() else {
                        continue;
                    };
                    let h = first_of.0 / GROUP_LEN;
                    let wanted: Vec<(usize, u32)> =
                        chunk.iter().map(|v| (v.0 % GROUP_LEN, v.1)).collect();
                    let w =
                        groups::patch_group(self.store, h, floor(h), &wanted, |k, st| match chunk
                            .get(k)
                        {
                            Some(v) if store_verdict(st, v.2, v.3, now_ms) => Patch::Changed,
                            _ => Patch::Same,
                        });
                    if let GroupWrite::Written(v) = w {
                        written.push((h, v));
                    }
                }
                groups::note_versions(
                    self.store,
                    Some((head, cas)),
                    &written,
                    budget(retry, first),
                );
                Stored::Done
            }
        }
    }
}

pub mod capacity;
mod choose;
mod finish;
mod pick;
pub mod responses;
pub mod signals;
/// A typical request, for the mean service time of a saturated engine's queue in
/// [`saturation::keep_pin`]: 1000 uncached prompt tokens and 128 completion tokens (a
/// judgement: the requests ahead in the queue are other sessions', of unknown size).
pub const TYPICAL_UNCACHED_TOKENS: u64 = 1000;
pub const TYPICAL_COMPLETION_TOKENS: u64 = 128;

use finish::store_verdict;

#[cfg(test)]
mod drawn_tests;
#[cfg(all(test, not(target_arch = "wasm32")))]
mod memo_tests;
#[cfg(test)]
mod prefix_tests;
#[cfg(test)]
mod tests;
