//! What a pick takes and gives: the request's [`Pick`] and [`Exclusions`], the [`Decision`]
//! with its [`Ticket`] and [`Reason`], the affinity result, and why no endpoint was found.

use super::*;

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
    /// Endpoints without a free place for a request admitted from the admission queue
    /// (`admission::fleet::placeless`): its first attempt's placement passes over them while
    /// another candidate has one. Empty for every other request.
    pub placeless: Vec<usize>,
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

pub(super) fn serves_opt(
    ep: &crate::scheduler::config::EndpointConfig,
    model: Option<&str>,
) -> bool {
    model.is_none_or(|m| ep.serves(m))
}

pub(super) fn push_unique(v: &mut Vec<usize>, i: usize) {
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
    /// scrape, with hysteresis: saturated) that new sessions pass over is passed over as the
    /// first turn was; never for this replica's own placements since the scrape.
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
/// [`crate::scheduler::routing::table::in_flight`]) and its probe slot.
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
    /// The prompt tokens of the session's last answer on this endpoint, as its pin recorded
    /// them (0: unknown, or not the pinned endpoint): what this turn should find cached
    /// (see `payoff::cold_turn`).
    pub previous_prompt_tokens: u64,
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
pub(super) struct Choice {
    pub(super) endpoint: usize,
    pub(super) reason: Reason,
    pub(super) affinity: AffinityResult,
    pub(super) pin_on_success: bool,
    pub(super) broke_pin_of: Option<usize>,
    /// The saturated endpoint a pinned session moved away from, if any.
    pub(super) moved: Option<usize>,
    pub(super) home: Option<usize>,
    /// The degraded flag and saturation as this choice saw them, of the chosen endpoint and of
    /// every weighed endpoint whose verdict differs from its stored one (see
    /// `Board::stored_verdicts`).
    pub(super) verdicts: Vec<(usize, bool, Saturation)>,
    /// See [`Decision::quota_skipped`].
    pub(super) quota_skipped: Vec<usize>,
    /// See [`Decision::by_prefix`].
    pub(super) by_prefix: bool,
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
