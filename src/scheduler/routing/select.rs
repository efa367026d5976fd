//! Selection: filter (exclusions) → affinity → score → pick, and recording what happened.
//!
//! Exclusions apply in this order, each counted for diagnostics: disabled; dead keys (401/403
//! earlier in *this* request); used keys (429 earlier in this request); endpoints already tried
//! in this request; model mismatch; breaker not admitting. Dead and used keys live only in the
//! request's [`Exclusions`]: cross-request memory is the breaker and the statistics alone.
//!
//! [`Scheduler::choose`] reads top to bottom in four steps:
//! 1. **board**: what every endpoint may do in this decision — its placement weight (what every
//!    replica sees alike, see [`super::placement`]), its verdicts ([`super::signals`]: degraded
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

use crate::scheduler::config::Config;
use crate::scheduler::health::breaker::{Admission, BreakerConfig, BreakerState};
use crate::scheduler::health::outcome::Outcome;
use crate::scheduler::routing::affinity::{Affinity, MOVES_PREFIX};
use crate::scheduler::routing::capacity::{self, Engines, Room};
use crate::scheduler::routing::ewma;
use crate::scheduler::routing::placement;
use crate::scheduler::routing::quota::{self, estimate_tokens, QuotaHint, QuotaMark, QuotaRule};
use crate::scheduler::routing::saturation::{MoveReason, Saturation};
use crate::scheduler::routing::score::score;
use crate::scheduler::routing::sessions;
use crate::scheduler::routing::signals::{self, Served, Verdict};
use crate::scheduler::routing::slowness::{self, DegradeRule, Sample, WorkModel};
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

fn serves_opt(ep: &crate::scheduler::config::EndpointConfig, model: Option<&str>) -> bool {
    model.is_none_or(|m| ep.serves(m))
}

fn push_unique(v: &mut Vec<usize>, i: usize) {
    if !v.contains(&i) {
        v.push(i);
    }
}

/// A request's prefix key ([`Pick::prefix`]): known, or computed on first use (hashing the
/// instructions costs about 2.5 wasm instructions a byte; an affinity hit whose pin recorded
/// the key it was placed by never needs it, see `affinity`). A lazy one must remember its
/// value: it may be asked more than once.
#[derive(Clone, Copy)]
pub enum Prefix<'a> {
    Known(Option<u64>),
    Lazy(&'a dyn Fn() -> Option<u64>),
}

impl Prefix<'_> {
    /// No prefix key.
    pub const NONE: Prefix<'static> = Prefix::Known(None);

    pub fn get(&self) -> Option<u64> {
        match self {
            Prefix::Known(k) => *k,
            Prefix::Lazy(f) => f(),
        }
    }
}

impl std::fmt::Debug for Prefix<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Prefix::Known(k) => write!(f, "Known({k:?})"),
            Prefix::Lazy(_) => f.write_str("Lazy"),
        }
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
    /// Placement key of a request without a session (any value that differs between
    /// requests, e.g. a counter mixed with the clock), so that such requests spread.
    pub nonce: u64,
    /// The request's prompt size in bytes, from which its token cost is estimated
    /// (quota-aware routing, the re-prefill cost of a move): its body's bytes with inline
    /// media (base64 images, audio) at a fixed size each (`wire::prompt_size`), never the
    /// raw bytes of an upload.
    pub body_bytes: usize,
    /// The endpoint id the request's pin cookie names (`pin_cookie`): where another replica
    /// last placed the session away from its home. Followed like a pin, before this replica's
    /// own (older) memory of the session.
    pub pin_hint: Option<u32>,
    /// The endpoint id holding the state this request continues (a Responses API follow-up's
    /// previous response): no other endpoint can serve it. The pick takes it whatever its
    /// verdicts (degraded, saturated, short of quota) and whatever a pin cookie says, or fails
    /// when it cannot take this attempt (breaker, request exclusions): the holder check is
    /// part of the pick, not a hint beside it.
    pub holder: Option<u32>,
    /// The placement key of the request's instructions (`wire::prefix::prefix_key`), when they
    /// are long enough: a session without a pin is placed by it (`prefix_placement`). Asked
    /// for only when needed: a pin that recorded its placement key answers instead.
    pub prefix: Prefix<'a>,
    /// A later turn of a conversation (the body carries earlier turns: at least three
    /// messages or input items). Without a pin at this replica, its home is taken as a pin
    /// would be — over its bounded load (this replica's own count), not passed — since its
    /// cache is there and every replica computes the same home (the first turn may have been
    /// served by another replica, which holds the pin); but a full endpoint (by its engine's
    /// scrape) that new sessions pass over is passed over as the first turn was.
    pub follow_up: bool,
    /// The most output tokens the request allows, if it says (0: unknown): part of its
    /// estimated cost to a key's token quota ([`Pick::quota_estimate`]).
    pub max_output_tokens: u64,
}

impl Pick<'_> {
    /// The tokens a key's quota is taken to lose to this request: its prompt's estimate plus
    /// its output limit, as hosted APIs charge at admission.
    pub fn quota_estimate(&self, bytes_per_token: u64) -> u64 {
        estimate_tokens(self.body_bytes, bytes_per_token).saturating_add(self.max_output_tokens)
    }
}

/// How an endpoint was chosen (the `reason` of the decision metric and log line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The session's live pin.
    AffinityHit,
    /// The first candidate of the rendezvous order: the session's home.
    Home,
    /// A later candidate of the rendezvous order because earlier ones could not serve this
    /// attempt (breaker, exclusion, degraded): the deterministic backup, and every failover.
    Backup,
    /// A later candidate because earlier ones were over their bounded load.
    Spill,
    /// The pinned endpoint was degraded: placed again without it.
    PinBreak,
    /// Admitted as one of a half-open breaker's probes.
    HalfOpenProbe,
    /// A degraded endpoint's periodic probe placement.
    DegradedProbe,
    /// A later candidate because an earlier one was degraded (slow for the work against its
    /// peers; see `slowness`).
    Degraded,
    /// A later candidate because an earlier one was saturated (full by its engine's own queue
    /// or KV cache while others had room; see `saturation`), or a pinned session moved away
    /// from a saturated endpoint whose wait exceeds re-prefilling elsewhere.
    Saturated,
}

impl Reason {
    /// Every reason, in metric order (`computeflux_decisions_total` is defined from it).
    pub const ALL: &'static [Reason] = &[
        Reason::AffinityHit,
        Reason::Home,
        Reason::Backup,
        Reason::Spill,
        Reason::PinBreak,
        Reason::HalfOpenProbe,
        Reason::DegradedProbe,
        Reason::Degraded,
        Reason::Saturated,
    ];

    pub fn label(&self) -> &'static str {
        match self {
            Reason::AffinityHit => "affinity_hit",
            Reason::Home => "home",
            Reason::Backup => "backup",
            Reason::Spill => "spill",
            Reason::PinBreak => "pin_break",
            Reason::HalfOpenProbe => "half_open_probe",
            Reason::DegradedProbe => "degraded_probe",
            Reason::Degraded => "degraded",
            Reason::Saturated => "saturated",
        }
    }
}

/// The session's affinity as seen by the first attempt (the `x-computeflux-affinity` value).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AffinityResult {
    /// Pinned endpoint chosen.
    Hit,
    /// A live pin existed but its endpoint could not serve this attempt.
    Miss,
    /// No live pin: placed at the session's rendezvous home.
    Home,
    /// No live pin and the home could not serve: placed at the next in rendezvous order.
    Backup,
    /// No live pin and the home was over its bounded load: placed at the next within it.
    Spill,
    /// No live pin; placed by its instructions' prefix key (see `placement`): at the prefix's
    /// home, where the application's other new sessions go, or past it when it was over its
    /// bounded load (a popular application spreading in its prefix's rendezvous order; the
    /// decision's reason is `spill` then). One value for both keeps the per-endpoint token
    /// counters (one set per value) from growing twice.
    Prefix,
    /// The pinned endpoint was degraded: the pin was broken and the session placed again.
    PinBreak,
    /// The pinned endpoint was saturated with a wait longer than re-prefilling elsewhere: the
    /// session moved (once per TTL).
    Saturated,
    /// The request has no session key.
    None,
}

impl AffinityResult {
    /// Every result, in metric order (`computeflux_affinity_total` is defined from it).
    pub const ALL: &'static [AffinityResult] = &[
        AffinityResult::Hit,
        AffinityResult::Miss,
        AffinityResult::Home,
        AffinityResult::Backup,
        AffinityResult::Spill,
        AffinityResult::Prefix,
        AffinityResult::PinBreak,
        AffinityResult::Saturated,
        AffinityResult::None,
    ];

    pub fn label(&self) -> &'static str {
        match self {
            AffinityResult::Hit => "hit",
            AffinityResult::Miss => "miss",
            AffinityResult::Home => "home",
            AffinityResult::Backup => "backup",
            AffinityResult::Spill => "spill",
            AffinityResult::Prefix => "prefix",
            AffinityResult::PinBreak => "pin_break",
            AffinityResult::Saturated => "saturated",
            AffinityResult::None => "none",
        }
    }
}

/// Proof of an attempt in flight; hand it back to [`Scheduler::finish`] exactly once.
///
/// Move-only (no `Clone`/`Copy`) and consumed by `finish`, so finishing an attempt twice does
/// not compile; only the scheduler makes one (`non_exhaustive`). Dropping one unfinished leaks
/// its in-flight count (until `in_flight_max_age_ms` after its start, see
/// [`crate::scheduler::routing::in_flight`]) and its probe slot.
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
    /// A degraded endpoint's probe placement (a fast answer resets the probe backoff).
    pub degraded_probe: bool,
    /// Whether a success should pin the session here (not for a degraded endpoint's probe).
    pub pin_on_success: bool,
    /// Set by the holder before finishing: the usage of the answer of an affinity hit (the
    /// session's pinned endpoint answered its first attempt), folded into the endpoint's
    /// affinity payoff in the finishing write (see `payoff`).
    pub pinned_usage: Option<Usage>,
    /// Set by the holder before finishing a success: what the answer was (streamed or not,
    /// its time, its usage or sizes), judged against the work model (see `signals`).
    pub served: Option<Served>,
    /// The tokens this attempt took off its endpoint's remembered quota at the pick (the
    /// request's estimate; 0 without `quota_aware`): replaced by what the answer's `usage`
    /// reports when it ends (`Quota::settle`).
    pub quota_tokens: u64,
    /// Where that pick stood in the endpoint's quota windows: the answer's statement is
    /// reconciled with the picks made after it (`Quota::observe`).
    pub quota_mark: QuotaMark,
    /// The prefix key the session's home is by (0: none), recorded with its pin on success.
    pub placement_key: u64,
}

#[derive(Debug, PartialEq, Eq)]
pub struct Decision {
    pub endpoint: usize,
    pub reason: Reason,
    pub affinity: AffinityResult,
    pub ticket: Ticket,
    /// The endpoint whose pin was broken, if any (for its `pin_breaks` counter).
    pub broke_pin_of: Option<usize>,
    /// The saturated endpoint a pinned session moved away from, if any.
    pub moved_pin_of: Option<usize>,
    /// The session's rendezvous home (the first non-degraded endpoint of its order), if any.
    pub home: Option<usize>,
    /// Endpoints passed over because their quota was short (`quota_aware`): a placement skipped
    /// them, or a pinned session left one for a certain 429 (for their `quota_skips` counter).
    /// At most one entry per endpoint; never the chosen one.
    pub quota_skipped: Vec<usize>,
    /// Placed by the request's prefix key rather than its session key (`prefix_placement`).
    pub by_prefix: bool,
}

/// What [`Scheduler::choose`] decided, before the attempt is started.
#[derive(Debug, Clone, PartialEq)]
struct Choice {
    endpoint: usize,
    reason: Reason,
    affinity: AffinityResult,
    pin_on_success: bool,
    broke_pin_of: Option<usize>,
    /// The saturated endpoint a pinned session moved away from, if any.
    moved: Option<usize>,
    home: Option<usize>,
    /// The degraded flag and saturation as this choice saw them, of the chosen endpoint and of
    /// every weighed endpoint whose verdict differs from its stored one (see
    /// `Board::stored_verdicts`).
    verdicts: Vec<(usize, bool, Saturation)>,
    /// See [`Decision::quota_skipped`].
    quota_skipped: Vec<usize>,
    /// See [`Decision::by_prefix`].
    by_prefix: bool,
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
    /// The worker's decoded entries (see [`TableCache`]); `None`: decode every read.
    pub cache: Option<&'a RefCell<TableCache>>,
}

impl<'a> Scheduler<'a> {
    pub fn new(cfg: &'a Config, store: &'a dyn Store) -> Self {
        Scheduler {
            cfg,
            store,
            cache: None,
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
    fn with_table<R>(&self, f: impl FnOnce(&Table, bool) -> R) -> R {
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
        let local = pick.session.and_then(|s| {
            self.affinity()
                .lookup_keyed(s, now_ms)
                .map(|(id, k)| (s, id, k))
        });
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
        let mut engines = Engines::read(self.store, self.cfg, now_ms);
        // A new session placed by prefix reads the sessions placed per endpoint, for the
        // session bound of a busy prefix home (see `sessions`).
        let new_session = pick.session.is_some() && pinned.is_none() && !pick.follow_up;
        if self.cfg.prefix_placement && new_session && pick.prefix.get().is_some() {
            engines.sessions = Some(sessions::read_counts(self.store, now_ms));
        }
        let result = self.start_and_store(&candidates, pick, pinned, &engines, now_ms);
        let decision = match result {
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
            Err(r) => r.map(|mut d| {
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
            engines.record(self.store, self.cfg, placed);
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
                .filter(|(_, st)| st.degraded != degraded || st.saturation != saturation)
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

/// How storing a pick's write went.
enum Stored {
    Done,
    /// The chosen entry changed since the decision read it: decide again.
    Again,
    GaveUp,
}

impl Scheduler<'_> {
    /// Decides and stores the decision's write, deciding again (over the entries that moved)
    /// when the chosen entry changed in between; `Err` with the last decision when every
    /// attempt lost.
    #[allow(clippy::type_complexity, clippy::result_large_err)]
    fn start_and_store(
        &self,
        candidates: &[usize],
        pick: &Pick<'_>,
        pinned: Option<u32>,
        engines: &Engines,
        now_ms: u64,
    ) -> Result<Result<Decision, NoEndpoint>, Result<Decision, NoEndpoint>> {
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
                Stored::Done => return Ok(decision),
                Stored::Again => last = Some(decision),
                Stored::GaveUp => return Err(decision),
            }
        }
        Err(last.unwrap_or(Err(NoEndpoint::Exhausted)))
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

mod choose;
mod finish;
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
