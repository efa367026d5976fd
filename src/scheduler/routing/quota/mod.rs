//! Quota-aware routing: leave an API key before it answers 429.
//!
//! Hosted APIs say on every successful answer how much of the key's quota is left:
//!
//! | family | remaining | reset |
//! |---|---|---|
//! | OpenAI, Azure OpenAI | `x-ratelimit-remaining-requests`, `x-ratelimit-remaining-tokens` | `x-ratelimit-reset-requests`, `x-ratelimit-reset-tokens` (durations: `1s`, `6m0s`, `20ms`) |
//! | Anthropic | `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-remaining` | `anthropic-ratelimit-…-reset` (RFC 3339 instant) |
//!
//! The rule:
//! - The latest successful answer's counts are kept per endpoint in the endpoint table, each
//!   with the instant its window resets (the hint, capped by `retry_after_max_ms`; without a
//!   valid reset hint, `rate_limit_ms`). Past that instant the count is forgotten. Anthropic's
//!   token families are folded into one count: the smallest remaining, with its reset.
//!   Upstreams compute the headers when they admit a request, so a reset counts from when the
//!   request was sent, not from when its headers were read (a plain answer's come after its
//!   whole generation: counted from there, a 4 s window's count outlived its reset by seconds).
//!   An answer about the same window (its reset within [`SAME_WINDOW_MS`] of the remembered
//!   one) reports a count from before the requests admitted meanwhile, which the picks since
//!   have already taken off: it is reconciled with those picks (the statement less what this
//!   replica picked after its request, [`Quota::observe`]), raising the count or lowering it;
//!   without its pick's [`Mark`], or when a fresher statement is merged already, it only
//!   lowers the count. A new window (a later reset) replaces the count; an answer about a
//!   window that has ended (relayed after its reset) or an earlier one is passed over.
//! - When the answer also states the limit (`x-ratelimit-limit-*`, `anthropic-ratelimit-*-limit`),
//!   a count whose reset has passed is not forgotten but *assumed* back at its limit for a
//!   window as long as the last stated reset: the picks after the reset are counted before any
//!   answer from the new window arrives (else every pick in that gap would pass unchecked), and
//!   that first answer only lowers the assumed count.
//! - A request's size is estimated as `ceil(prompt bytes / BYTES_PER_TOKEN)` tokens plus
//!   the output limit it states (hosted APIs charge `max_tokens` at admission: a turn whose
//!   prompt fit but whose limit did not was a 429, and the key cooled for every session on it),
//!   where its prompt bytes are its body's bytes with each inline image or audio clip
//!   counted at a fixed size (`wire::prompt_size`): a base64 upload of megabytes is a few hundred tokens at
//!   the provider, and counting its bytes took the key's count to zero. When the
//!   answer reports `usage`, its prompt and completion tokens replace the estimate in the
//!   count ([`Quota::settle`]), unless a statement already counts them: one of a request
//!   sent later was merged (the upstream charged this one before it) or the window began
//!   after it was sent. Answers end out of the order they were admitted (a short stream
//!   overtakes a long plain answer), and settling those again took a long answer's tokens
//!   off twice: one Envoy's count drifted thousands of tokens below the key's within a window
//!   and moved pinned turns off keys that still had quota (quota bench).
//! - An endpoint is *short* when its remaining requests are below
//!   `max(tuning.quota_min_requests, 1)` or its remaining tokens below
//!   `max(tuning.quota_min_tokens, estimate)`. A short endpoint is
//!   skipped for new placements like an unavailable one (the next in rendezvous order takes
//!   the session, the same on every replica), unless every candidate is short. Paced: with a
//!   stated limit it is short too when the pinned sessions' use until
//!   the reset would leave less than the floors ([`Remaining::projected_use`]), or when their
//!   use over the last window's length already exceeds the limit less the reserve
//!   ([`Remaining::span_use`]): sessions placed now spend in the next window.
//! - New sessions go to keys in proportion to their stated
//!   limits ([`weigh_by_limits`]): pacing judges a key by what its sessions have spent, which
//!   says nothing until they have spent it, and a session spends most in the windows after
//!   the one it was placed in. The stated limit is known from a key's first answer on.
//! - A 429 whose statement explains it (no request left, or fewer tokens than the request's
//!   estimate, with a reset) sets the count like an answer's instead of opening the breaker
//!   ([`Quota::refused`]): with several replicas each one's count misses the others' use, and
//!   a key cooled whole for one large turn turned away the pinned turns that still fitted.
//! - A pinned session leaves its endpoint only when staying is a *certain* 429: no request
//!   left, or fewer tokens left than the estimate. A mere floor is not worth a re-prefill.
//! - Each pick takes one request and the estimate from the remembered counts, so concurrent
//!   requests do not all pass on the same stale count before the next answer refreshes it.
//!   The estimate is capped by the key's stated limit ([`Remaining::charge`]: no window holds
//!   more), and given back whole when the attempt ends without a served answer (a provider's
//!   400, a 401/403, a 5xx, a reset, a client gone, a 429 its statement does not explain;
//!   [`Quota::give_back`]): the upstream charged nothing. A new session's placement counts its
//!   estimate until its answer's `usage` replaces it. Kept, a refused request of
//!   `max_tokens: 10000000` left a key at 0 for its window and moved every session pinned
//!   there.
//!
//! A header value that is not a plain decimal count (garbage, negative, fractional) or is
//! implausibly large (over [`MAX_REMAINING`]) is ignored, as is a reset that does not parse;
//! a far-future reset is capped. So a hostile upstream can at most make its own endpoint look
//! short for `retry_after_max_ms`, which a 429 could do anyway.

use crate::scheduler::state::codec::{Reader, Writer};
use crate::scheduler::state::levels::quantize;
use crate::scheduler::time::{parse_go_duration_ms, parse_rfc3339_ms};
use crate::scheduler::wire::headers::HeaderSource;

/// Counts above this (10^12) are not believed: no key has that much, and such a value is
/// more likely garbage than a quota.
pub const MAX_REMAINING: u64 = 1_000_000_000_000;

/// Two statements whose resets are this close (ms) are about the same window.
pub const SAME_WINDOW_MS: u64 = 1_000;

/// One remembered count: what was left, and until when that is known to hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Remaining {
    pub left: u64,
    /// Unix ms at which the window resets (and the count is forgotten, or back at `limit`).
    pub reset_at_ms: u64,
    /// The stated limit, if any.
    pub limit: Option<u64>,
    /// The longest reset stated for this count (the window assumed after a reset).
    pub span_ms: u64,
    /// Assumed at `limit` after a reset, not yet confirmed by an answer.
    pub assumed: bool,
    /// When the request whose answer made the latest statement merged into this count was
    /// sent (Unix ms; the upstream admitted it at about then, and charged every request
    /// admitted before it): an answer to a request sent earlier is already in the count.
    pub stated_ms: u64,
    /// What the window before this one used (its limit less its last count; 0 when unknown
    /// or when a whole window passed unseen): the rate of the sessions already pinned to the
    /// key at the start of a window, when this window's own use is too young to tell it.
    pub prev_used: u64,
    /// What this replica's picks have taken in this window, as they were estimated, summed
    /// (0 when the window began): each pick's [`Mark`] holds the sum after it, so that the
    /// answer's statement can be reconciled with the picks made after it ([`Quota::observe`]).
    pub picked: u64,
    /// What the first turns of the new sessions this replica placed on the key in this window
    /// were estimated at, summed (0 when the window began): those sessions spend more in the
    /// next window than [`Remaining::span_use`] sees of them now ([`Remaining::growth`]).
    pub placed: u64,
}

/// A session placed in a window spends in the next about this many times its first turn's
/// estimate *more* than the key's use in this window holds of it (its first turn): a
/// conversation resends its transcript, so each turn costs more than the last (the bench's
/// sessions: about 650 tokens at the first turn, 1 400 in their first window, 2 800 in the
/// next).
pub const NEXT_WINDOW_GROWTH: u64 = 3;

/// The most replicas' worth of new sessions [`Remaining::growth`] assumes per placement of
/// its own (the key's use over this replica's picks, capped).
pub const MAX_REPLICA_SHARE: u64 = 4;

/// Where one pick stood in its count's window: the window (its reset) and the count's
/// [`Remaining::picked`] after the pick. Kept with the request (its ticket), not stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mark {
    pub reset_at_ms: u64,
    pub picked: u64,
}

/// One pick's [`Mark`] in each family (`None`: the count was unknown at the pick), and what
/// it took off the token count and added to its placements: given back whole when the
/// attempt ends without a served answer ([`Quota::give_back`]), replaced by the answer's
/// `usage` when it reports one ([`Quota::settle`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QuotaMark {
    pub requests: Option<Mark>,
    pub tokens: Option<Mark>,
    /// Tokens the pick took off the count (its estimate, capped by the key's limit and by
    /// what was left).
    pub taken: u64,
    /// Tokens the pick added to [`Remaining::placed`] (a new session's first turn; else 0).
    pub placed: u64,
}

impl Remaining {
    /// A count of `left` until `reset_at_ms`, without limit.
    pub fn new(left: u64, reset_at_ms: u64) -> Remaining {
        Remaining {
            left,
            reset_at_ms,
            limit: None,
            span_ms: 0,
            assumed: false,
            stated_ms: 0,
            prev_used: 0,
            picked: 0,
            placed: 0,
        }
    }

    /// What the new sessions placed on the key in this window will spend in the next beyond
    /// what its use in this window holds of them: [`NEXT_WINDOW_GROWTH`] × their first turns'
    /// estimates ([`Remaining::placed`]), × the key's use in this window over this replica's
    /// picks in it (at least 1, at most [`MAX_REPLICA_SHARE`]). Several replicas share
    /// nothing but the key's statements: each one's `placed` holds only its own new sessions,
    /// and the key's use (from the statements, everyone's) over its own picks says how many
    /// replicas' worth of traffic the key takes (about 3 behind three replicas, under 1 alone:
    /// estimates overshoot). Counting its own placements only, each of three replicas let a
    /// small key take a third more than it held (quota bench, `quota7-1` ×3: `d`
    /// took 22 new sessions late in a window and ran dry in the next, 17 follow-ups moved).
    pub fn growth(self) -> u64 {
        let own = self.placed.saturating_mul(NEXT_WINDOW_GROWTH);
        let used = self.limit.map_or(0, |l| l.saturating_sub(self.left));
        if own == 0 || self.picked == 0 || used <= self.picked {
            return own;
        }
        let share = u128::from(used).min(u128::from(self.picked) * u128::from(MAX_REPLICA_SHARE));
        u64::try_from(u128::from(own) * share / u128::from(self.picked)).unwrap_or(u64::MAX)
    }

    /// What the sessions already using the endpoint will take until the reset: quota pacing
    /// keeps new sessions off a key that is on course to run out before its reset, so that the
    /// sessions pinned there are not moved (a re-prefill each) when it does. The larger of two
    /// rates (see [`Remaining::span_use`]), times the time to reset. `0` when the limit or the
    /// window is unknown.
    pub fn projected_use(self, now_ms: u64) -> u64 {
        let Some((rate_use, span, to_reset)) = self.rates(now_ms) else {
            return 0;
        };
        u64::try_from(rate_use * to_reset / span).unwrap_or(u64::MAX)
    }

    /// What the sessions already using the endpoint take per window: the larger of
    /// - this window's use at its rate since it began (`(limit − left) × span ÷ time elapsed`;
    ///   not in the window's first tenth, too little to extrapolate from);
    /// - the use over the last span: this window's plus the previous window's in the part of
    ///   the span before this one began (`prev_used × (1 − elapsed ÷ span)`).
    ///
    /// Sessions placed now spend most of their tokens in the windows after this one, at this
    /// rate (more, as their prompts grow): with only this window's use, a window's start
    /// looked empty, and new sessions were placed on a key that the sessions pinned there
    /// then ran dry in the next window (quota bench: 16 to 30 follow-ups moved
    /// per run, each a re-prefill). `0` when the limit or the window is unknown.
    pub fn span_use(self, now_ms: u64) -> u64 {
        self.rates(now_ms).map_or(0, |(rate_use, _, _)| {
            u64::try_from(rate_use).unwrap_or(u64::MAX)
        })
    }

    /// `(use per span at the larger rate, span, time to reset)`, see [`Remaining::span_use`].
    fn rates(self, now_ms: u64) -> Option<(u128, u128, u128)> {
        let limit = self.limit?;
        if self.span_ms == 0 {
            return None;
        }
        let span = u128::from(self.span_ms);
        let to_reset = u128::from(self.reset_at_ms.saturating_sub(now_ms)).min(span);
        let elapsed = span - to_reset;
        let used = u128::from(limit.saturating_sub(self.left));
        let in_window = if elapsed == 0 || elapsed < span / 10 {
            0
        } else {
            used * span / elapsed
        };
        let last_span = used + u128::from(self.prev_used) * to_reset / span;
        Some((in_window.max(last_span), span, to_reset))
    }

    /// What a request estimated at `estimate` tokens can take from this count: at most the
    /// stated limit (a window never holds more). A request whose output limit (`max_tokens`,
    /// accepted up to 10 000 000) exceeds what the key's window holds is refused by the
    /// provider; counted whole, its estimate made the key look empty to every pinned session.
    pub fn charge(self, estimate: u64) -> u64 {
        self.limit.map_or(estimate, |l| estimate.min(l))
    }

    /// Whether the request sent at `sent_ms`, picked at `mark`, is still held in this count:
    /// no statement about a request sent after it has been merged (the upstream's count
    /// would hold it, or not, as it really was), and its window is this one.
    fn holds(self, sent_ms: u64, mark: Option<Mark>) -> bool {
        let window_start_ms = self.reset_at_ms.saturating_sub(self.span_ms);
        let this_window = mark.is_none_or(|m| {
            m.reset_at_ms.abs_diff(self.reset_at_ms) < SAME_WINDOW_MS.min(self.span_ms / 2).max(1)
        });
        self.stated_ms <= sent_ms && !(self.span_ms > 0 && sent_ms < window_start_ms) && this_window
    }

    /// The count as it stands at `now_ms`: itself before its reset; after it, back at its
    /// limit for the window that holds `now_ms` (if the limit and a window are known).
    pub fn current(self, now_ms: u64) -> Option<Remaining> {
        if now_ms < self.reset_at_ms {
            return Some(self);
        }
        let limit = self.limit?;
        if self.span_ms == 0 {
            return None;
        }
        let periods = (now_ms - self.reset_at_ms) / self.span_ms + 1;
        Some(Remaining {
            left: limit,
            reset_at_ms: self
                .reset_at_ms
                .saturating_add(periods.saturating_mul(self.span_ms)),
            assumed: true,
            prev_used: if periods == 1 {
                limit.saturating_sub(self.left)
            } else {
                0
            },
            picked: 0,
            placed: 0,
            ..self
        })
    }
}

/// An endpoint's remembered quota (part of `EndpointState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Quota {
    pub requests: Option<Remaining>,
    pub tokens: Option<Remaining>,
}

/// One family's count as an answer stated it: remaining, and the reset hint in ms from now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stated {
    pub left: u64,
    pub reset_in_ms: Option<u64>,
    pub limit: Option<u64>,
}

/// The quota an answer's headers stated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QuotaHint {
    pub requests: Option<Stated>,
    pub tokens: Option<Stated>,
    /// When the request was sent (Unix ms): upstreams admit a request, charge it and compute
    /// its reset from then, so resets count from there; `None`: when observed.
    pub at_ms: Option<u64>,
}

/// What the rule needs from the configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaRule {
    pub min_requests: u64,
    pub min_tokens: u64,
    /// Share (percent) of a count's stated limit kept for pinned sessions: below it, new
    /// placements go elsewhere.
    pub reserve_percent: u64,
    /// Reset assumed when an answer states a count without a valid reset.
    pub default_reset_ms: u64,
    /// Cap on any reset hint.
    pub max_reset_ms: u64,
}

/// The least a stated limit weighs a key down to, against the largest limit among the
/// candidates ([`weigh_by_limits`]): a key whose limit is a tiny share of another's still gets
/// a few new sessions, and an upstream that claims a huge limit takes at most
/// `1 / (1 + others × floor)` of the new sessions from the others.
pub const LIMIT_WEIGHT_FLOOR: f64 = 0.125;

/// [`weigh_by_limits`] reads every candidate's limits (about 80 instructions each under wasm,
/// on every new placement): above this many candidates it is skipped. A model served by more
/// endpoints than this is a fleet of engines, not of API keys (`computeflux-cost`: 11 % more
/// per new session at 512 endpoints, 2–3 % at 64).
pub const LIMIT_WEIGHT_MAX_CANDIDATES: usize = 64;

/// The levels of [`weigh_by_limits`]: `2^(-k × step)`, 1, 0.71, 0.5, 0.35, 0.25, 0.18, 0.125.
pub const LIMIT_WEIGHT_STEP: f64 = 0.5;

/// Session placement weights scaled by the keys' stated limits (`None`: no candidate's weight
/// changes): each candidate's weight × the ratio of its stated limit to the largest stated among the
/// candidates (per family, tokens and requests; the smaller of the two ratios), rounded up to
/// a level `2^(-k/2)` ([`LIMIT_WEIGHT_STEP`]) and at least [`LIMIT_WEIGHT_FLOOR`]. A candidate without a stated limit (a
/// self-hosted engine, a key not yet heard from) keeps its weight.
///
/// Why: before a key has spent anything in a window, pacing has nothing to go by, and the
/// sessions placed then spend most of their tokens in the windows after (a session's next
/// window costs about twice its first). Placed evenly, a key with a sixth of its peers' limit
/// took a quarter of a long first window's new sessions and ran dry in the next, and its
/// pinned sessions moved (quota bench: up to 29 moved follow-ups a run, 2.1–2.9
/// points of cached tokens, depending on where the first window fell). A stated limit is
/// the same on every replica (unlike a count of what each one placed) once each has heard from
/// the key, and the rounding keeps the weights so while a provider's limits move a little.
/// Until then replicas disagree: so these weights order only a new placement's walk, not the
/// session's *home*, which every replica computes from the plain weights, and a session
/// placed away from that home carries its place in the pin cookie like any other exception
/// (a later turn without a pin goes home by the plain weights). Ordering homes by them, a
/// replica that had heard from the keys sent a later turn to another key than the one a
/// replica that had not placed it on, and the session went back and forth (one bench run,
/// three replicas: 6 follow-ups moved between keys that both had quota). (Rounded up to powers of two, a key with 15 % of its
/// peers' limit weighed 25 %: two thirds more sessions than its share.)
pub fn weigh_by_limits(
    weights: &[(usize, u32, f64)],
    limits: impl Fn(usize) -> (u64, u64),
) -> Option<Vec<(usize, u32, f64)>> {
    if weights.len() > LIMIT_WEIGHT_MAX_CANDIDATES {
        return None;
    }
    // The largest and smallest stated limits (0: none stated): a pass that reads two numbers
    // per candidate, and nothing more when no candidate states a smaller limit than another
    // (none stated, or all alike: a fleet of keys of one tier).
    let (mut max_requests, mut max_tokens) = (0u64, 0u64);
    let (mut min_requests, mut min_tokens) = (u64::MAX, u64::MAX);
    for &(i, _, _) in weights {
        let (r, t) = limits(i);
        max_requests = max_requests.max(r);
        max_tokens = max_tokens.max(t);
        if r > 0 {
            min_requests = min_requests.min(r);
        }
        if t > 0 {
            min_tokens = min_tokens.min(t);
        }
    }
    let below = |min: u64, max: u64| max > 0 && min < max;
    if !below(min_requests, max_requests) && !below(min_tokens, max_tokens) {
        return None;
    }
    let ratio = |l: u64, max: u64| {
        if l == 0 || max == 0 {
            1.0
        } else {
            l as f64 / max as f64
        }
    };
    let mut scaled = None;
    for (at, &(i, _, _)) in weights.iter().enumerate() {
        let (r, t) = limits(i);
        let share = ratio(r, max_requests).min(ratio(t, max_tokens));
        if share < 1.0 {
            let level = quantize(share, LIMIT_WEIGHT_STEP).max(LIMIT_WEIGHT_FLOOR);
            let w = scaled.get_or_insert_with(|| weights.to_vec());
            if let Some(x) = w.get_mut(at) {
                x.2 *= level;
            }
        }
    }
    scaled
}

/// Request body bytes per estimated token: a request is taken to cost
/// `ceil(body bytes / BYTES_PER_TOKEN)` tokens of an endpoint's quota. Not a key: the measured
/// default.
pub const BYTES_PER_TOKEN: u64 = 4;

/// The tokens a request of `prompt_bytes` (see [`crate::scheduler::routing::select::Pick`])
/// is taken to cost.
pub fn estimate_tokens(prompt_bytes: usize, bytes_per_token: u64) -> u64 {
    (prompt_bytes as u64).div_ceil(bytes_per_token.max(1))
}

fn live(r: Option<Remaining>, now_ms: u64) -> Option<u64> {
    r.and_then(|r| r.current(now_ms)).map(|r| r.left)
}

impl Quota {
    /// Remaining requests known at `now_ms` (`None`: unknown, or the window has reset).
    pub fn requests_left(&self, now_ms: u64) -> Option<u64> {
        live(self.requests, now_ms)
    }

    pub fn tokens_left(&self, now_ms: u64) -> Option<u64> {
        live(self.tokens, now_ms)
    }

    /// Below a floor or below this request's estimate: skipped for new placements. Paced:
    /// also when what is left will not cover the reserve and the pinned sessions' use
    /// until the reset ([`Remaining::projected_use`]), or when their use per window already
    /// takes more than the limit less the reserve ([`Remaining::span_use`]: the reserve is
    /// for their growth, in this window and the next).
    pub fn short(&self, estimate: u64, rule: &QuotaRule, now_ms: u64) -> bool {
        let below = |r: Option<Remaining>, floor: u64| {
            r.and_then(|r| r.current(now_ms)).is_some_and(|r| {
                let reserve = r
                    .limit
                    .map_or(0, |l| l.saturating_mul(rule.reserve_percent) / 100);
                // The new sessions' growth counts (see [`Remaining::growth`]).
                let growth = r.growth();
                let busy = r.limit.is_some_and(|l| {
                    r.span_use(now_ms).saturating_add(growth) > l.saturating_sub(reserve)
                });
                busy || r.left < floor.max(reserve).saturating_add(r.projected_use(now_ms))
            })
        };
        let estimate = self.tokens.map_or(estimate, |r| r.charge(estimate));
        below(self.requests, rule.min_requests.max(1))
            || below(self.tokens, rule.min_tokens.max(estimate))
    }

    /// The stated limits `(requests, tokens)`, 0 where none is stated (see
    /// [`weigh_by_limits`]); read by reference, on every session decision.
    #[inline]
    pub fn limits(&self) -> (u64, u64) {
        let limit = |r: &Option<Remaining>| r.as_ref().and_then(|r| r.limit).unwrap_or(0);
        (limit(&self.requests), limit(&self.tokens))
    }

    /// Staying would be a 429 for sure: left even by a pinned session.
    pub fn certain_429(&self, estimate: u64, now_ms: u64) -> bool {
        let estimate = self.tokens.map_or(estimate, |r| r.charge(estimate));
        self.requests_left(now_ms) == Some(0)
            || self.tokens_left(now_ms).is_some_and(|n| n < estimate)
    }

    /// A pick: one request and the estimate are spoken for until the next answer says more.
    /// Returns where the pick stands in each count's window (see [`Quota::observe`]).
    /// The tokens taken are the estimate capped by the key's limit ([`Remaining::charge`])
    /// and by what is left; the mark holds them ([`QuotaMark::taken`]).
    pub fn consume(&mut self, estimate: u64, now_ms: u64) -> QuotaMark {
        let take = |r: Option<Remaining>, n: u64| {
            r.and_then(|r| r.current(now_ms)).map(|r| {
                let n = r.charge(n).min(r.left);
                Remaining {
                    left: r.left - n,
                    picked: r.picked.saturating_add(n),
                    ..r
                }
            })
        };
        let mark = |r: Option<Remaining>| {
            r.map(|r| Mark {
                reset_at_ms: r.reset_at_ms,
                picked: r.picked,
            })
        };
        let before = self
            .tokens
            .and_then(|r| r.current(now_ms))
            .map_or(0, |r| r.left);
        let (requests, tokens) = (take(self.requests, 1), take(self.tokens, estimate));
        self.requests = requests.or(self.requests);
        self.tokens = tokens.or(self.tokens);
        QuotaMark {
            requests: mark(requests),
            tokens: mark(tokens),
            taken: tokens.map_or(0, |r| before - r.left.min(before)),
            placed: 0,
        }
    }

    /// A new session's first turn was placed here (after [`Quota::consume`], whose `mark` it
    /// completes): its estimate (capped like the pick's, [`Remaining::charge`]) counts in
    /// [`Remaining::placed`] until the answer's `usage` replaces it ([`Quota::settle`]) or
    /// the attempt ends unserved ([`Quota::give_back`]), or the window resets. Counted whole
    /// until then, one new session's large valid `max_tokens` closed a small key to new
    /// sessions for the rest of its window.
    pub fn place(&mut self, estimate: u64, mark: &mut QuotaMark, now_ms: u64) {
        if let Some(r) = self.tokens.and_then(|r| r.current(now_ms)) {
            let n = r.charge(estimate);
            self.tokens = Some(Remaining {
                placed: r.placed.saturating_add(n),
                ..r
            });
            mark.placed = n;
        }
    }

    /// An attempt picked at `mark` and sent at `sent_ms` ended without a served answer (a
    /// provider's 4xx such as a 400 for a `max_tokens` too large, a 5xx, a reset, a client
    /// gone before the answer, a 429 its statement does not explain): the upstream charged
    /// nothing for it, so what its pick took off the token count, and added to the
    /// placements, is given back (never past the stated limit). Not when the count no longer
    /// holds it (see [`Quota::settle`]). Kept, a refused request of 10 000 000 `max_tokens`
    /// left a key at 0 until its window ended: every session pinned there counted as a certain
    /// 429 and moved, and nothing repaired it, since no request reached the key any more.
    pub fn give_back(&mut self, mark: &QuotaMark, sent_ms: u64, now_ms: u64) {
        let Some(r) = self.tokens.and_then(|r| r.current(now_ms)) else {
            return;
        };
        if (mark.taken == 0 && mark.placed == 0) || !r.holds(sent_ms, mark.tokens) {
            return;
        }
        let left = r.left.saturating_add(mark.taken);
        self.tokens = Some(Remaining {
            left: r.limit.map_or(left, |l| left.min(l)),
            picked: r.picked.saturating_sub(mark.taken),
            placed: r.placed.saturating_sub(mark.placed),
            ..r
        });
    }

    /// What a key has left for new sessions after the forecast of its sessions' use
    /// (`limit − (span_use + growth)`, tokens; negative when over): `None` without a stated
    /// token limit and window. When every candidate is short, a new session goes to the one
    /// with the most (see `select`): the first of its order may be a key with a sixth of
    /// the others' limit, which then runs dry in the next window.
    pub fn headroom(&self, now_ms: u64) -> Option<i128> {
        let r = self.tokens.and_then(|r| r.current(now_ms))?;
        let limit = r.limit?;
        if r.span_ms == 0 {
            return None;
        }
        Some(i128::from(limit) - i128::from(r.span_use(now_ms)) - i128::from(r.growth()))
    }

    /// [`Quota::settle_pick`] for a pick that took `estimated` tokens and placed nothing.
    pub fn settle(&mut self, estimated: u64, used: u64, sent_ms: u64, now_ms: u64) {
        let mark = QuotaMark {
            taken: estimated,
            ..QuotaMark::default()
        };
        self.settle_pick(&mark, used, sent_ms, now_ms);
    }

    /// An answer reported `used` tokens (prompt and completion) for a request sent at
    /// `sent_ms` whose pick took `estimated` off the count: the difference is taken off too,
    /// or given back (never past the stated limit), so that the count follows what the key
    /// really spent. Not when the count already holds what the upstream charged for it: a
    /// statement merged since was about a request sent later (upstreams charge at admission,
    /// in arrival order: answers that end out of order would count a long answer twice), or the
    /// count's window began after the request was sent (it was charged to the window before).
    ///
    /// `mark`: the pick's ([`QuotaMark::taken`] is what it took, [`QuotaMark::placed`] what it
    /// added to the placements, which the measured use replaces too: a new session's weight
    /// in [`Remaining::growth`] is what its first turn spent, not its `max_tokens`).
    pub fn settle_pick(&mut self, mark: &QuotaMark, used: u64, sent_ms: u64, now_ms: u64) {
        let Some(r) = self.tokens.and_then(|r| r.current(now_ms)) else {
            return;
        };
        let window_start_ms = r.reset_at_ms.saturating_sub(r.span_ms);
        if r.stated_ms > sent_ms || (r.span_ms > 0 && sent_ms < window_start_ms) {
            return;
        }
        let estimated = mark.taken;
        let left = if used >= estimated {
            r.left.saturating_sub(used - estimated)
        } else {
            r.left.saturating_add(estimated - used)
        };
        let left = r.limit.map_or(left, |l| left.min(l));
        let placed = if mark.placed > 0 {
            r.placed.saturating_sub(mark.placed).saturating_add(used)
        } else {
            r.placed
        };
        self.tokens = Some(Remaining { left, placed, ..r });
    }

    /// A 429's statement (upstreams that state the counts on answers state them on their 429s
    /// too): when it explains the refusal — no request left, or fewer tokens left than this
    /// request's `estimate`, with a reset to wait for — it is remembered like an answer's
    /// and `true` is returned: the count, not the breaker, keeps the key's requests off it
    /// until the reset, and only those that do not fit. Cooled whole for a 429 that said
    /// 1 808 tokens were left, a key turned away a pinned turn of 1 431 tokens on that replica
    /// until its window ended, then admitted only the breaker's few probes for the length of
    /// their generations: quota bench, three replicas, moved pinned turns off keys
    /// with quota. A 429 whose statement does not explain it (or that has none) is left to
    /// the breaker.
    pub fn refused(
        &mut self,
        hint: &QuotaHint,
        estimate: u64,
        mark: &QuotaMark,
        rule: &QuotaRule,
        now_ms: u64,
    ) -> bool {
        let explains = |s: Option<Stated>, need: u64| {
            s.is_some_and(|s| s.reset_in_ms.is_some() && s.left < need)
        };
        if !(explains(hint.requests, 1) || explains(hint.tokens, estimate)) {
            return false;
        }
        self.observe(hint, mark, rule, now_ms);
        true
    }

    /// An answer's statement updates what was remembered, family by family: a new window
    /// replaces it, the same window only lowers it unless it can be reconciled (see the
    /// module doc). A statement about a window that has already ended, or about an earlier
    /// window than the remembered count's (an answer that took longer than the window,
    /// relayed after the reset), says nothing about the current one and is passed over.
    ///
    /// `mark`: where the request that the statement answers stood in its count's window when
    /// it was picked ([`Quota::consume`]; default: unknown). The upstream's count holds that
    /// request and every one it admitted before it, at what they really cost, and misses the
    /// requests sent after it. So when the statement is the freshest merged in this window
    /// and the mark is from this window, it is *reconciled*: the statement less what this
    /// replica's picks since that one took ([`Remaining::picked`] − the mark's, at their
    /// estimates). The count becomes that, unless it lies between that and the statement
    /// (then it stands: it has given back what the picks since that have settled overshot).
    /// Only lowered, the count kept the estimates' overshoot (JSON punctuation and roles are
    /// not tokens) of the requests sent before the statement's and still in flight, and of
    /// requests that never settle (no `usage`), and a key with 2 827 tokens left looked
    /// short for a pinned turn of 2 387 (quota bench, one Envoy); merged by the
    /// lower of the two, a statement below the count forgot the picks since, and the count
    /// stood above what the key had left. As long as estimates do not undershoot, the
    /// reconciled count is never above what the upstream has left for this replica.
    pub fn observe(&mut self, hint: &QuotaHint, mark: &QuotaMark, rule: &QuotaRule, now_ms: u64) {
        // Resets count from when the request was sent (the upstream admitted it then; a plain
        // answer's headers come after its whole generation).
        let base = hint.at_ms.map_or(now_ms, |at| at.min(now_ms));
        let remember = |old: Option<Remaining>, s: Stated, mark: Option<Mark>| {
            let reset_in = s
                .reset_in_ms
                .unwrap_or(rule.default_reset_ms)
                .min(rule.max_reset_ms);
            let new = Remaining {
                left: s.left,
                reset_at_ms: base.saturating_add(reset_in),
                limit: s.limit,
                span_ms: reset_in,
                assumed: false,
                stated_ms: base,
                prev_used: 0,
                picked: 0,
                placed: 0,
            };
            let Some(o) = old.and_then(|o| o.current(now_ms)) else {
                return new;
            };
            let ended = new.reset_at_ms <= now_ms;
            let earlier = base < o.stated_ms
                && new.reset_at_ms.saturating_add(SAME_WINDOW_MS) < o.reset_at_ms;
            if ended || earlier {
                return o;
            }
            let same = new.reset_at_ms <= o.reset_at_ms.saturating_add(SAME_WINDOW_MS);
            if !o.assumed && !same {
                // A new window: the one remembered was the window before it.
                return Remaining {
                    prev_used: o.limit.map_or(0, |l| l.saturating_sub(o.left)),
                    ..new
                };
            }
            // The statement less the picks made after its request, when both are known in
            // this window's terms (its mark is from this window: same reset, within half a
            // window; and no fresher statement is merged already).
            let reconciled = mark
                .filter(|m| {
                    base >= o.stated_ms
                        && m.picked <= o.picked
                        && m.reset_at_ms.abs_diff(o.reset_at_ms)
                            < SAME_WINDOW_MS.min(o.span_ms / 2).max(1)
                })
                .map(|m| s.left.saturating_sub(o.picked - m.picked));
            let limit = new.limit.or(o.limit);
            let (left, stated_ms) = match reconciled {
                // The count below the statement and above the reconciled one: it stands (it
                // has given back the overshoot of the picks since that have settled, whose
                // estimates the reconciled one still holds).
                Some(r) if o.left <= new.left && o.left >= r => (o.left, o.stated_ms),
                Some(r) => (limit.map_or(r, |l| r.min(l)), base),
                None if new.left <= o.left => (new.left, o.stated_ms.max(base)),
                None => (o.left, o.stated_ms),
            };
            if o.assumed {
                // The first answer after an assumed reset: its window, its reset.
                return Remaining {
                    left,
                    span_ms: o.span_ms.max(reset_in),
                    limit,
                    stated_ms,
                    prev_used: o.prev_used,
                    picked: o.picked,
                    placed: o.placed,
                    ..new
                };
            }
            Remaining {
                left,
                reset_at_ms: o.reset_at_ms.max(new.reset_at_ms),
                limit,
                span_ms: o.span_ms.max(reset_in),
                assumed: false,
                stated_ms,
                prev_used: o.prev_used,
                picked: o.picked,
                placed: o.placed,
            }
        };
        if let Some(s) = hint.requests {
            self.requests = Some(remember(self.requests, s, mark.requests));
        }
        if let Some(s) = hint.tokens {
            self.tokens = Some(remember(self.tokens, s, mark.tokens));
        }
    }

    /// Bytes of [`Quota::encode`].
    pub const BYTES: usize = 2 * (1 + 8 + 8 + 8 + 8 + 8 + 8 + 8 + 8);

    pub fn encode(&self, w: &mut Writer) {
        for r in [self.requests, self.tokens] {
            w.u8(r.map_or(0, |r| 1 | (u8::from(r.assumed) << 1)));
            w.u64(r.map_or(0, |r| r.left));
            w.u64(r.map_or(0, |r| r.reset_at_ms));
            w.u64(r.and_then(|r| r.limit).unwrap_or(u64::MAX));
            w.u64(r.map_or(0, |r| r.span_ms));
            w.u64(r.map_or(0, |r| r.stated_ms));
            w.u64(r.map_or(0, |r| r.prev_used));
            w.u64(r.map_or(0, |r| r.picked));
            w.u64(r.map_or(0, |r| r.placed));
        }
    }

    pub fn decode(r: &mut Reader<'_>) -> Option<Quota> {
        let mut one = || -> Option<Option<Remaining>> {
            let flags = r.u8()?;
            if flags > 3 || flags == 2 {
                return None;
            }
            let left = r.u64()?;
            let reset_at_ms = r.u64()?;
            let limit = r.u64()?;
            let span_ms = r.u64()?;
            let stated_ms = r.u64()?;
            let prev_used = r.u64()?;
            let picked = r.u64()?;
            let placed = r.u64()?;
            Some((flags & 1 == 1).then_some(Remaining {
                left,
                reset_at_ms,
                limit: (limit != u64::MAX).then_some(limit),
                span_ms,
                assumed: flags & 2 == 2,
                stated_ms,
                prev_used,
                picked,
                placed,
            }))
        };
        let requests = one()?;
        let tokens = one()?;
        Some(Quota { requests, tokens })
    }
}

mod headers;
pub use headers::parse_count;

#[cfg(test)]
mod tests;
