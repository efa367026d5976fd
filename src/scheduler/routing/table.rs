//! Cross-request state of every endpoint, kept together in one shared-data value.
//!
//! One value (the "endpoint table") holds the statistics and breaker of every configured
//! endpoint plus the retry budget, so a selection costs one shared-data read and one CAS write
//! whatever the number of endpoints. Entries are keyed by endpoint id (a hash of the name):
//! a configuration reload that adds, removes or reorders endpoints keeps the others' history.
//!
//! What a request pays need not grow with the fleet (issue 21): entries have a fixed size, so
//! a write that changes one endpoint rewrites that entry alone in a copy of the stored bytes
//! ([`Table::patch_entry`], [`Table::encode_patched`]), and every entry carries the *stamp*
//! of the write that last changed it (the header counts writes). A worker keeps the entries
//! it decoded ([`TableCache`]); reading the table again, it decodes only the entries whose
//! stamp moved — the one or two endpoints the requests in between used — instead of all.
//! Finding them without comparing every stamp: the header also holds a *write log*, the
//! position each of the last [`LOG_LEN`] single-entry writes changed, from the last write
//! that changed more than one entry (a full rewrite or a layout change starts it again). A
//! worker that saw the table at most that many writes ago decodes the logged entries alone;
//! one further behind compares every stamp, as before.
//!
//! Reloads and upgrades (issue 22, item 7). After a configuration update, requests of the old
//! configuration keep writing the table while the new one serves: the requests in flight at an
//! ECDS update, every request of the old connections for up to Envoy's drain time at a listener
//! update. Two layouts would take turns, each write dropping the entries the other
//! configuration alone has. So the header records the *generation* of the layout that wrote
//! it: each configuration claims one when it is configured ([`claim_layout`]: the stored
//! generation if the layout is already its own, else one more, written with its layout under
//! CAS, so both sides agree on the order). A writer of an older generation never rewrites the
//! layout: it patches the entries it can find by endpoint id and leaves the rest (see
//! [`Table::encode_over`]). A new table version (another byte format) gets its own shared-data
//! key ([`TABLE_KEY`]): a module of another version, also one that predates this rule, neither
//! reads nor writes it, so an upgrade starts the new table once and resets nothing in turn.

use crate::scheduler::config::Config;
use crate::scheduler::health::breaker::{Breaker, BreakerState, OpenCause};
use crate::scheduler::health::budget::RetryBudget;
use crate::scheduler::routing::in_flight::InFlightAges;
use crate::scheduler::routing::overdue::Watch;
use crate::scheduler::routing::payoff::Payoff;
use crate::scheduler::routing::quota::Quota;
use crate::scheduler::routing::saturation::Saturation;
use crate::scheduler::routing::slowness::Slowness;
use crate::scheduler::state::codec::{Reader, Writer};
use crate::scheduler::state::hash::rendezvous_seed;
use crate::scheduler::state::store::{update_if, Store};
use std::rc::Rc;

/// Statistics of one endpoint.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EndpointState {
    /// EWMA of the raw latency sample of successful attempts (time to response headers, or to
    /// the first byte of a stream); `None` before the first. For metrics and the score of
    /// requests without a session only: raw samples mix unlike work, so no rule that breaks
    /// pins or weighs placement reads it (see `slowness`).
    pub latency_ms: Option<f64>,
    /// EWMA of |sample − estimate| (mean deviation, as TCP's RTO estimator), for the overdue
    /// rule's spread bound (see `overdue`).
    pub latency_dev_ms: f64,
    /// Decayed success rate in [0, 1] (EWMA of 1/0 outcomes); starts at 1.
    pub success_rate: f64,
    /// When the last latency or success sample arrived.
    pub last_sample_ms: u64,
    /// Completed attempts with a verdict (drives the cold start).
    pub total: u64,
    /// Attempts started and not yet finished.
    pub in_flight: u32,
    /// Last change of `in_flight` (stale counts are ignored, see [`Self::load`]).
    pub in_flight_changed_ms: u64,
    /// The same attempts by the age of their start: a count that never reported back expires
    /// after `in_flight_max_age_ms`, also on a busy endpoint (see `in_flight`).
    pub in_flight_ages: InFlightAges,
    pub breaker: Breaker,
    /// Slow for the work it was given, against its peers serving the same models (see
    /// `slowness::degraded`): its pins are broken and it gets new sessions only as probes.
    /// Kept for hysteresis.
    pub degraded: bool,
    /// When this Envoy last sent a degraded endpoint a probe placement.
    pub degraded_probe_ms: u64,
    /// Probe placements sent since it was degraded (or since a probe came back fast): the
    /// probe interval doubles with each, up to `degraded_probe_max_interval_ms`.
    pub degraded_probes: u8,
    /// Affinity hits in flight there, watched for being overdue (see `overdue`).
    pub watch: Watch,
    /// What its last successful answer said was left of its quota (see `quota`).
    pub quota: Quota,
    /// The affinity payoff: cached share of its pinned turns' prompts (see `payoff`).
    pub payoff: Payoff,
    /// Its smoothed slowness, observed ÷ expected for the work (see `slowness`). Its own
    /// `degraded` flag is unused: [`EndpointState::degraded`] is the stored verdict.
    pub slowness: Slowness,
    /// Full by the engine's own queue and KV cache, as last judged (see `saturation`); kept
    /// for the hysteresis.
    pub saturation: Saturation,
}

impl Default for EndpointState {
    fn default() -> Self {
        EndpointState {
            latency_ms: None,
            latency_dev_ms: 0.0,
            success_rate: 1.0,
            last_sample_ms: 0,
            total: 0,
            in_flight: 0,
            in_flight_changed_ms: 0,
            in_flight_ages: InFlightAges::default(),
            breaker: Breaker::default(),
            degraded: false,
            degraded_probe_ms: 0,
            degraded_probes: 0,
            watch: Watch::default(),
            quota: Quota::default(),
            payoff: Payoff::default(),
            slowness: Slowness::default(),
            saturation: Saturation::default(),
        }
    }
}

/// An in-flight count that has not moved for this long is presumed leaked (a VM crashed between
/// start and finish, so the decrement never ran) and is ignored by the load factor.
pub const IN_FLIGHT_STALE_MS: u64 = 600_000;

/// The fastest latency estimate among warm endpoints (at least `cold_start_samples`
/// verdicts), if any.
pub fn fastest_warm<'s>(
    states: impl IntoIterator<Item = &'s EndpointState>,
    cold_start_samples: u64,
) -> Option<f64> {
    states
        .into_iter()
        .filter(|st| st.total >= cold_start_samples)
        .filter_map(|st| st.latency_ms)
        .fold(None, |acc: Option<f64>, l| {
            Some(acc.map_or(l, |a| a.min(l)))
        })
}

impl EndpointState {
    /// In-flight attempts as the scorer sees them: without those started `max_age_ms` ago or
    /// more (presumed leaked; see `in_flight`), and none if the count has not moved for
    /// [`IN_FLIGHT_STALE_MS`].
    pub fn load(&self, now_ms: u64, max_age_ms: u64) -> u32 {
        // Nothing in flight: nothing to expire (a pick asks every endpoint).
        if self.in_flight == 0
            || now_ms.saturating_sub(self.in_flight_changed_ms) > IN_FLIGHT_STALE_MS
        {
            0
        } else {
            self.in_flight
                .saturating_sub(self.in_flight_ages.expired(now_ms, max_age_ms))
        }
    }

    /// An attempt started now: counted in flight.
    pub fn start_attempt(&mut self, now_ms: u64, max_age_ms: u64) {
        self.expire_in_flight(now_ms, max_age_ms);
        let leaked = self.in_flight_ages.add(now_ms, max_age_ms);
        self.in_flight = self.in_flight.saturating_sub(leaked).saturating_add(1);
        self.in_flight_changed_ms = now_ms;
    }

    /// The attempt started at `started_ms` reported back: no longer in flight (unless its
    /// count already expired).
    pub fn end_attempt(&mut self, started_ms: u64, now_ms: u64, max_age_ms: u64) {
        self.expire_in_flight(now_ms, max_age_ms);
        if self.in_flight_ages.remove(started_ms, max_age_ms) {
            self.in_flight = self.in_flight.saturating_sub(1);
        }
        self.in_flight_changed_ms = now_ms;
    }

    /// Takes attempts started `max_age_ms` ago or more off the count.
    fn expire_in_flight(&mut self, now_ms: u64, max_age_ms: u64) {
        let leaked = self.in_flight_ages.expire(now_ms, max_age_ms);
        self.in_flight = self.in_flight.saturating_sub(leaked);
    }
}

/// The endpoint table: the retry budget and one entry per endpoint, in configuration order.
/// (The write stamps live in the bytes only: see [`TableCache`].)
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Table {
    pub budget: RetryBudget,
    pub entries: Vec<(u32, EndpointState)>,
    /// The layout generation of the writer (its configuration's `layout_generation`; the
    /// stored one for [`Table::decode`]): written with a full rewrite, and what decides
    /// whether this writer may lay the table out anew (see [`Table::encode_over`]).
    pub generation: u64,
}

/// The byte format's version. A new one needs a new [`TABLE_KEY`] (a test checks that they
/// agree).
pub const TABLE_VERSION: u8 = 14;
/// The table's shared-data key, one per [`TABLE_VERSION`]: modules of two versions running
/// side by side during an upgrade each keep their own table instead of resetting each other's
/// on every write (Envoy never frees a key: one table's worth of bytes per version ever run).
pub const TABLE_KEY: &str = "computeflux/endpoints/14";
/// Id, write stamp, then the state.
const ENTRY_BYTES: usize = 4
    + 8
    + 1
    + 8
    + 8
    + 8
    + 8
    + 8
    + 4
    + 8
    + InFlightAges::BYTES
    + 1
    + 1
    + 4
    + 8
    + 4
    + 4
    + 8
    + 4
    + 1
    + 8
    + 1
    + Watch::BYTES
    + Quota::BYTES
    + Payoff::BYTES
    + Slowness::BYTES
    + 1;
const BUDGET_BYTES: usize = 8 + 8 + 8;
/// Where the header's write counter is: after the version byte and the budget.
const STAMP_AT: usize = 1 + BUDGET_BYTES;
/// Where the header's layout generation is: after the write counter.
const GENERATION_AT: usize = STAMP_AT + 8;
/// The write log (see [`TableCache`]): the first write stamp it covers, after the layout
/// generation, then the position of the entry each write changed, by stamp modulo
/// [`LOG_LEN`].
const LOG_FROM_AT: usize = GENERATION_AT + 8;
const LOG_AT: usize = LOG_FROM_AT + 8;
/// Writes the log covers at most: a worker that saw the table this many writes ago or less
/// reads the changed entries alone.
pub const LOG_LEN: usize = 64;
/// Version byte, budget, write counter, layout generation, write log, entry count.
const HEADER_BYTES: usize = LOG_AT + 4 * LOG_LEN + 4;

/// The little-endian u64 at `at`, if `bytes` reaches that far.
fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    let b = bytes.get(at..at.checked_add(8)?)?;
    <[u8; 8]>::try_from(b).ok().map(u64::from_le_bytes)
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    let b = bytes.get(at..at.checked_add(4)?)?;
    <[u8; 4]>::try_from(b).ok().map(u32::from_le_bytes)
}

/// The stamp of the next write over `stored`: one more than its write counter (1 over bytes
/// that are not a table of this version).
fn next_stamp(stored: Option<&[u8]>) -> u64 {
    stored
        .filter(|b| b.first() == Some(&TABLE_VERSION))
        .and_then(|b| u64_at(b, STAMP_AT))
        .unwrap_or(0)
        .wrapping_add(1)
}

/// Records in `stored`'s header a write with `stamp` that changed entry `position` alone: the
/// write counter, and the position in the write log, which covers this write and those before
/// it back to the last that changed more than one entry (at most [`LOG_LEN`]).
fn log_one(stored: &mut [u8], stamp: u64, position: usize) {
    // The writes logged so far: `from ..= stamp - 1` (`from` past it when none is).
    let from = u64_at(stored, LOG_FROM_AT).unwrap_or(stamp);
    let from = from
        .min(stamp)
        .max(stamp.saturating_sub(LOG_LEN as u64 - 1));
    let slot = LOG_AT + (stamp % LOG_LEN as u64) as usize * 4;
    let parts: [(usize, &[u8]); 3] = [
        (STAMP_AT, &stamp.to_le_bytes()),
        (LOG_FROM_AT, &from.to_le_bytes()),
        (slot, &(position as u32).to_le_bytes()),
    ];
    for (at, bytes) in parts {
        if let Some(dst) = stored.get_mut(at..at + bytes.len()) {
            dst.copy_from_slice(bytes);
        }
    }
}

/// The header of a write with `stamp` that changed every entry (or the layout): the log
/// covers nothing before the next write.
fn write_header(w: &mut Writer, budget: &RetryBudget, stamp: u64, generation: u64, entries: usize) {
    w.u8(TABLE_VERSION);
    budget.encode(w);
    w.u64(stamp);
    w.u64(generation);
    w.u64(stamp.wrapping_add(1));
    for _ in 0..LOG_LEN {
        w.u32(0);
    }
    w.u32(entries as u32);
}

/// The positions of the entries the writes after the one with stamp `seen` changed, in
/// write order (repeats included), when the write log of `bytes` (a table of `entries`
/// entries) covers every one of them; `None` otherwise (the caller compares every entry).
fn logged_since(
    bytes: &[u8],
    seen: u64,
    entries: usize,
) -> Option<impl Iterator<Item = usize> + '_> {
    let now = u64_at(bytes, STAMP_AT)?;
    let from = u64_at(bytes, LOG_FROM_AT)?;
    let newer = now.checked_sub(seen)?;
    if newer > LOG_LEN as u64 || from > seen.wrapping_add(1) {
        return None;
    }
    let positions = (1..=newer).map(move |k| {
        let slot = LOG_AT + (seen.wrapping_add(k) % LOG_LEN as u64) as usize * 4;
        u32_at(bytes, slot).map_or(usize::MAX, |p| p as usize)
    });
    // Every logged position must be an entry (a garbled log reads as no log).
    positions.clone().all(|p| p < entries).then_some(positions)
}

/// The write stamp of entry `i` (stored right after its id).
#[cfg(test)]
fn stamp_of(bytes: &[u8], i: usize) -> Option<u64> {
    u64_at(bytes, HEADER_BYTES + i.checked_mul(ENTRY_BYTES)? + 4)
}

/// One entry from exactly [`ENTRY_BYTES`] bytes (a fixed-size slice, so the field reads
/// compile to plain loads).
fn decode_entry(chunk: &[u8]) -> Option<(u32, EndpointState)> {
    let mut r = Reader::new(chunk);
    let id = r.u32()?;
    let _stamp = r.u64()?;
    let has_latency = r.u8()? == 1;
    let latency = r.f64()?;
    let latency_dev_ms = r.f64()?;
    let success_rate = r.f64()?.clamp(0.0, 1.0);
    let state = EndpointState {
        latency_ms: has_latency.then_some(latency),
        latency_dev_ms: if latency_dev_ms.is_finite() {
            latency_dev_ms.max(0.0)
        } else {
            0.0
        },
        success_rate,
        last_sample_ms: r.u64()?,
        total: r.u64()?,
        in_flight: r.u32()?,
        in_flight_changed_ms: r.u64()?,
        in_flight_ages: InFlightAges::decode(&mut r)?,
        breaker: Breaker {
            state: match r.u8()? {
                0 => BreakerState::Closed,
                1 => BreakerState::Open,
                2 => BreakerState::HalfOpen,
                _ => return None,
            },
            cause: match r.u8()? {
                0 => OpenCause::Failures,
                1 => OpenCause::RateLimited,
                _ => return None,
            },
            consecutive_failures: r.u32()?,
            open_until_ms: r.u64()?,
            probes_admitted: r.u32()?,
            probes_succeeded: r.u32()?,
            last_probe_ms: r.u64()?,
            epoch: r.u32()?,
        },
        degraded: match r.u8()? {
            0 => false,
            1 => true,
            _ => return None,
        },
        degraded_probe_ms: r.u64()?,
        degraded_probes: r.u8()?,
        watch: Watch::decode(&mut r)?,
        quota: Quota::decode(&mut r)?,
        payoff: Payoff::decode(&mut r)?,
        slowness: Slowness::decode_from(&mut r)?,
        saturation: match r.u8()? {
            0 => Saturation::Unknown,
            1 => Saturation::Room,
            2 => Saturation::Saturated,
            _ => return None,
        },
    };
    Some((id, state))
}

fn encode_entry(w: &mut Writer, id: u32, stamp: u64, s: &EndpointState) {
    w.u32(id);
    w.u64(stamp);
    w.u8(u8::from(s.latency_ms.is_some()));
    w.f64(s.latency_ms.unwrap_or(0.0));
    w.f64(s.latency_dev_ms);
    w.f64(s.success_rate);
    w.u64(s.last_sample_ms);
    w.u64(s.total);
    w.u32(s.in_flight);
    w.u64(s.in_flight_changed_ms);
    s.in_flight_ages.encode(w);
    let b = &s.breaker;
    w.u8(match b.state {
        BreakerState::Closed => 0,
        BreakerState::Open => 1,
        BreakerState::HalfOpen => 2,
    });
    w.u8(match b.cause {
        OpenCause::Failures => 0,
        OpenCause::RateLimited => 1,
    });
    w.u32(b.consecutive_failures);
    w.u64(b.open_until_ms);
    w.u32(b.probes_admitted);
    w.u32(b.probes_succeeded);
    w.u64(b.last_probe_ms);
    w.u32(b.epoch);
    w.u8(u8::from(s.degraded));
    w.u64(s.degraded_probe_ms);
    w.u8(s.degraded_probes);
    s.watch.encode(w);
    s.quota.encode(w);
    s.payoff.encode(w);
    s.slowness.encode_into(w);
    w.u8(match s.saturation {
        Saturation::Unknown => 0,
        Saturation::Room => 1,
        Saturation::Saturated => 2,
    });
}

impl Table {
    /// The table aligned to `cfg.endpoints`: entry `i` belongs to endpoint `i`. Endpoints new to
    /// the stored table start fresh; stored entries of endpoints no longer configured are kept
    /// out (they fall away at the next write).
    pub fn aligned(bytes: Option<&[u8]>, cfg: &Config) -> Table {
        Table::load(bytes, cfg).0
    }

    /// Like [`Table::aligned`], plus whether the stored bytes already had exactly the
    /// configuration's layout (the common case), so that [`Table::encode_patched`] may rewrite
    /// only what changed instead of the whole table.
    pub fn load(bytes: Option<&[u8]>, cfg: &Config) -> (Table, bool) {
        let stored = bytes.and_then(Table::decode).unwrap_or_default();
        let same_layout = bytes.is_some()
            && stored.entries.len() == cfg.endpoints.len()
            && stored
                .entries
                .iter()
                .zip(&cfg.endpoints)
                .all(|((id, _), ep)| *id == ep.id);
        if same_layout {
            return (
                Table {
                    generation: cfg.layout_generation,
                    ..stored
                },
                true,
            );
        }
        let mut entries = Vec::with_capacity(cfg.endpoints.len());
        for (i, ep) in cfg.endpoints.iter().enumerate() {
            let state = match stored.entries.get(i) {
                Some((id, st)) if *id == ep.id => *st,
                _ => stored
                    .entries
                    .iter()
                    .find(|(id, _)| *id == ep.id)
                    .map(|(_, st)| *st)
                    .unwrap_or_default(),
            };
            entries.push((ep.id, state));
        }
        (
            Table {
                budget: stored.budget,
                entries,
                generation: cfg.layout_generation,
            },
            false,
        )
    }

    /// The encoding of this table when it was loaded from `stored` with the same layout and only
    /// the budget and entry `changed` were modified: a copy of `stored` with those two rewritten.
    /// The entry and the write counter get the next stamp; the other entries keep theirs.
    pub fn encode_patched(&self, stored: &[u8], changed: usize) -> Vec<u8> {
        self.entries
            .get(changed)
            .and_then(|(id, st)| {
                Table::patch_budget_and_entry(
                    stored,
                    &self.budget,
                    changed,
                    *id,
                    st,
                    self.entries.len(),
                )
            })
            .unwrap_or_else(|| self.encode_over(Some(stored)))
    }

    /// [`Table::encode_patched`] from its parts, for a table of `entries` entries loaded from
    /// `stored` with its layout whose budget is now `budget` and entry `changed` is now
    /// `(id, st)`, the others unchanged. `None` when `stored` does not have that layout (then
    /// the whole table is encoded instead).
    pub fn patch_budget_and_entry(
        stored: &[u8],
        budget: &RetryBudget,
        changed: usize,
        id: u32,
        st: &EndpointState,
        entries: usize,
    ) -> Option<Vec<u8>> {
        if stored.len() != HEADER_BYTES.checked_add(entries.checked_mul(ENTRY_BYTES)?)? {
            return None;
        }
        let mut out = stored.to_vec();
        Table::patch_in_place(&mut out, budget, changed, id, st, entries).then_some(out)
    }

    /// Whether [`Table::patch_in_place`] can rewrite entry `changed` of `stored` as a table of
    /// `entries` entries (its size is exactly that, and the entry is within it).
    pub fn patchable(stored: &[u8], changed: usize, entries: usize) -> bool {
        let size = entries
            .checked_mul(ENTRY_BYTES)
            .and_then(|e| e.checked_add(HEADER_BYTES));
        size == Some(stored.len()) && changed < entries
    }

    /// [`Table::patch_budget_and_entry`] without the copy: `stored` itself is rewritten (false,
    /// and nothing written, when it does not have that layout or `changed` is out of range).
    pub fn patch_in_place(
        stored: &mut [u8],
        budget: &RetryBudget,
        changed: usize,
        id: u32,
        st: &EndpointState,
        entries: usize,
    ) -> bool {
        let at = changed
            .checked_mul(ENTRY_BYTES)
            .and_then(|e| e.checked_add(HEADER_BYTES));
        let size = entries
            .checked_mul(ENTRY_BYTES)
            .and_then(|e| e.checked_add(HEADER_BYTES));
        if !Table::patchable(stored, changed, entries) {
            return false;
        }
        let (Some(at), Some(_)) = (at, size) else {
            return false;
        };
        let stamp = next_stamp(Some(stored));
        let mut b = Writer::with_capacity(BUDGET_BYTES);
        budget.encode(&mut b);
        let mut entry = Writer::with_capacity(ENTRY_BYTES);
        encode_entry(&mut entry, id, stamp, st);
        if let Some(dst) = stored.get_mut(1..1 + BUDGET_BYTES) {
            dst.copy_from_slice(&b.buf);
        }
        log_one(stored, stamp, changed);
        if let Some(dst) = stored.get_mut(at..at + ENTRY_BYTES) {
            dst.copy_from_slice(&entry.buf);
        }
        true
    }

    /// The whole table as a first write (write counter and every stamp 1).
    pub fn encode(&self) -> Vec<u8> {
        self.encode_over(None)
    }

    /// The whole table as the write that replaces `stored`: every entry gets the next stamp
    /// (a full rewrite is rare: a layout change or verdicts of several endpoints flipping).
    /// Over a table of a newer layout generation (this writer is a request of an older
    /// configuration, still draining) the layout is kept instead: see [`Table::merge_into`].
    pub fn encode_over(&self, stored: Option<&[u8]>) -> Vec<u8> {
        if let Some(merged) = stored.and_then(|s| self.merge_into(s)) {
            return merged;
        }
        let stamp = next_stamp(stored);
        let mut w = Writer::with_capacity(HEADER_BYTES + self.entries.len() * ENTRY_BYTES);
        write_header(
            &mut w,
            &self.budget,
            stamp,
            self.generation,
            self.entries.len(),
        );
        for (id, s) in &self.entries {
            encode_entry(&mut w, *id, stamp, s);
        }
        w.buf
    }

    /// When `stored` is a valid table laid out by a newer generation than this writer's: a
    /// copy of it with the budget and each of this table's entries that it holds (found by
    /// endpoint id) and that this writer changed rewritten under the next stamp. Its layout,
    /// its generation and the entries of endpoints this writer does not know stay as they are;
    /// an entry this writer has and the stored table lacks (an endpoint the newer
    /// configuration removed) is not written. `None` otherwise (a plain full rewrite).
    fn merge_into(&self, stored: &[u8]) -> Option<Vec<u8>> {
        let stored_generation = u64_at(stored, GENERATION_AT)?;
        if stored_generation <= self.generation {
            return None;
        }
        // Only over bytes that decode whole: a corrupt table is rewritten, not patched.
        let ids: Vec<u32> = Table::decode(stored)?
            .entries
            .iter()
            .map(|(id, _)| *id)
            .collect();
        let stamp = next_stamp(Some(stored));
        let mut out = stored.to_vec();
        let mut budget = Writer::with_capacity(BUDGET_BYTES);
        self.budget.encode(&mut budget);
        out.get_mut(1..1 + BUDGET_BYTES)?
            .copy_from_slice(&budget.buf);
        for (id, st) in &self.entries {
            let Some(i) = ids.iter().position(|stored_id| stored_id == id) else {
                continue;
            };
            let at = HEADER_BYTES.checked_add(i.checked_mul(ENTRY_BYTES)?)?;
            let slot = out.get_mut(at..at.checked_add(ENTRY_BYTES)?)?;
            let mut entry = Writer::with_capacity(ENTRY_BYTES);
            encode_entry(&mut entry, *id, stamp, st);
            // Unchanged but for the stamp: kept with its old stamp (workers' caches stay valid).
            let unchanged = slot.get(12..) == entry.buf.get(12..);
            if !unchanged {
                slot.copy_from_slice(&entry.buf);
            }
        }
        out.get_mut(STAMP_AT..STAMP_AT + 8)?
            .copy_from_slice(&stamp.to_le_bytes());
        // Several entries may have changed: the log starts again after this write.
        out.get_mut(LOG_FROM_AT..LOG_FROM_AT + 8)?
            .copy_from_slice(&stamp.wrapping_add(1).to_le_bytes());
        Some(out)
    }

    /// Whether `bytes` is a table of this version with exactly `cfg`'s layout (one entry per
    /// configured endpoint, in configuration order): then entry `i` sits at a fixed offset and
    /// [`Table::entry_at`] / [`Table::patch_entry`] read and rewrite it alone. Reads the ids
    /// only (4 bytes per endpoint), not the entries.
    pub fn has_layout(bytes: &[u8], cfg: &Config) -> bool {
        let n = cfg.endpoints.len();
        bytes.first() == Some(&TABLE_VERSION)
            && u32_at(bytes, HEADER_BYTES - 4) == Some(n as u32)
            && Some(bytes.len()) == n.checked_mul(ENTRY_BYTES).map(|e| e + HEADER_BYTES)
            && bytes.get(HEADER_BYTES..).is_some_and(|entries| {
                // Entry by entry (the size is checked above, so there is one per endpoint):
                // no offset arithmetic per endpoint, which cost several times the compare.
                entries
                    .chunks_exact(ENTRY_BYTES)
                    .zip(&cfg.endpoints)
                    .all(|(entry, ep)| {
                        entry.first_chunk::<4>().map(|b| u32::from_le_bytes(*b)) == Some(ep.id)
                    })
            })
    }

    /// Entry `i` of a table with its configuration's layout ([`Table::has_layout`]), decoded
    /// alone; `None` if it does not decode (then the caller falls back to [`Table::load`]).
    pub fn entry_at(bytes: &[u8], i: usize) -> Option<(u32, EndpointState)> {
        let at = HEADER_BYTES.checked_add(i.checked_mul(ENTRY_BYTES)?)?;
        decode_entry(bytes.get(at..at.checked_add(ENTRY_BYTES)?)?)
    }

    /// A copy of `stored` (with its configuration's layout) with entry `i` rewritten under
    /// the next stamp: a change to one endpoint costs its own entry's encoding, whatever the
    /// fleet's size. `None` when `i` is out of range.
    pub fn patch_entry(stored: &[u8], i: usize, id: u32, st: &EndpointState) -> Option<Vec<u8>> {
        let at = HEADER_BYTES.checked_add(i.checked_mul(ENTRY_BYTES)?)?;
        let stamp = next_stamp(Some(stored));
        let mut entry = Writer::with_capacity(ENTRY_BYTES);
        encode_entry(&mut entry, id, stamp, st);
        let mut out = stored.to_vec();
        out.get_mut(at..at.checked_add(ENTRY_BYTES)?)?
            .copy_from_slice(&entry.buf);
        out.get(STAMP_AT..LOG_AT)?;
        log_one(&mut out, stamp, i);
        Some(out)
    }

    /// Whether `bytes` is a complete table of this version with `entries` entries (version
    /// byte, entry count and size agree), read from the header alone.
    pub fn is_complete(bytes: &[u8], entries: usize) -> bool {
        let size = entries
            .checked_mul(ENTRY_BYTES)
            .and_then(|e| e.checked_add(HEADER_BYTES));
        bytes.first() == Some(&TABLE_VERSION)
            && u32_at(bytes, HEADER_BYTES - 4) == Some(entries as u32)
            && size == Some(bytes.len())
    }

    /// Endpoint `id`'s entry when it is entry `i` of a complete table of this version
    /// (version byte, entry count and size agree), decoded alone. Reads the header and that
    /// entry only: unlike [`Table::has_layout`], it does not compare every endpoint's id, so
    /// it costs the same at any fleet size. Enough for a write that changes one endpoint
    /// ([`Table::patch_entry_in_place`]): the entry is found by its id, whichever
    /// configuration laid the table out, and the layout and its generation stay as they are.
    pub fn entry_of(bytes: &[u8], i: usize, id: u32) -> Option<EndpointState> {
        let n = u32_at(bytes, HEADER_BYTES - 4)? as usize;
        let size = n.checked_mul(ENTRY_BYTES)?.checked_add(HEADER_BYTES)?;
        if bytes.first() != Some(&TABLE_VERSION) || bytes.len() != size || i >= n {
            return None;
        }
        match Table::entry_at(bytes, i)? {
            (stored_id, st) if stored_id == id => Some(st),
            _ => None,
        }
    }

    /// [`Table::patch_entry`] without the copy: `stored` itself gets entry `i` rewritten under
    /// the next stamp (a copy of the whole table cost about half an instruction per byte under
    /// wasm, 170 000 at 512 endpoints). False, and nothing written, when `stored` is not a
    /// complete table of this version or `i` is out of range.
    pub fn patch_entry_in_place(stored: &mut [u8], i: usize, id: u32, st: &EndpointState) -> bool {
        let Some(n) = u32_at(stored, HEADER_BYTES - 4) else {
            return false;
        };
        if stored.first() != Some(&TABLE_VERSION) || !Table::patchable(stored, i, n as usize) {
            return false;
        }
        let Some(at) = i
            .checked_mul(ENTRY_BYTES)
            .and_then(|e| e.checked_add(HEADER_BYTES))
        else {
            return false;
        };
        let stamp = next_stamp(Some(stored));
        let mut entry = Writer::with_capacity(ENTRY_BYTES);
        encode_entry(&mut entry, id, stamp, st);
        match (
            stored.get_mut(at..at + ENTRY_BYTES),
            entry.buf.len() == ENTRY_BYTES,
        ) {
            (Some(dst), true) => dst.copy_from_slice(&entry.buf),
            _ => return false,
        }
        log_one(stored, stamp, i);
        true
    }

    /// Where endpoint `id` is: at `hint` (its index when a ticket was issued), or wherever a
    /// configuration reload moved it; `None` once it is gone.
    pub fn locate(&self, hint: usize, id: u32) -> Option<usize> {
        match self.entries.get(hint) {
            Some((i, _)) if *i == id => Some(hint),
            _ => self.entries.iter().position(|(i, _)| *i == id),
        }
    }

    /// `None` for anything that is not a complete table of this version.
    pub fn decode(bytes: &[u8]) -> Option<Table> {
        let mut r = Reader::new(bytes);
        if r.u8()? != TABLE_VERSION {
            return None;
        }
        let budget = RetryBudget::decode(&mut r)?;
        let _writes = r.u64()?;
        let generation = r.u64()?;
        // The write log (read by `TableCache` only).
        let _log_from = r.u64()?;
        for _ in 0..LOG_LEN {
            r.u32()?;
        }
        let n = r.u32()? as usize;
        if r.remaining() != n.checked_mul(ENTRY_BYTES)? {
            return None;
        }
        let rest = bytes.get(bytes.len() - r.remaining()..)?;
        let mut entries = Vec::with_capacity(n);
        for chunk in rest.chunks_exact(ENTRY_BYTES) {
            entries.push(decode_entry(chunk)?);
        }
        Some(Table {
            budget,
            entries,
            generation,
        })
    }
}

/// Claims `cfg`'s layout generation, at configure time (every worker's root context calls it;
/// they agree): the stored table's generation if it already has `cfg`'s layout; else one more,
/// and the table is laid out for `cfg` (entries kept by endpoint id) under CAS in the same
/// step, so two configurations never claim one generation. A missing or undecodable table is
/// created at generation 1 (creating the key here also covers that CAS does not protect key
/// creation). If every CAS attempt loses, the generation computed last is returned unwritten:
/// the configuration's first write lays the table out.
pub fn claim_layout(store: &dyn Store, cfg: &Config) -> u64 {
    let claimed = update_if(store, TABLE_KEY, |bytes| {
        let stored = bytes.filter(|b| Table::decode(b).is_some());
        match stored {
            Some(b) if Table::has_layout(b, cfg) => (None, u64_at(b, GENERATION_AT).unwrap_or(0)),
            _ => {
                let generation = stored
                    .and_then(|b| u64_at(b, GENERATION_AT))
                    .unwrap_or(0)
                    .saturating_add(1);
                let mut table = Table::load(stored, cfg).0;
                table.generation = generation;
                (Some(table.encode_over(stored)), generation)
            }
        }
    });
    match claimed {
        Ok(g) | Err(g) => g,
    }
}

/// One worker's memory of the entries it decoded, each with the stamp it had.
///
/// Why: a request reads the whole table (its pick weighs every endpoint), but between two
/// requests of one worker only the entries of the endpoints used in between changed. Their
/// stamps moved; every other entry is taken from here instead of decoded again. The cache is
/// per VM (one per Envoy worker thread), never shared, and only ever a shortcut: the table it
/// returns equals [`Table::load`] of the same bytes (every write that changes an entry's bytes
/// gives it a new stamp, from a counter that grows with each CAS-ordered write).
///
/// Which stamps moved is read from the header's write log when it covers every write since
/// the cache last loaded the table (its write counter is kept): only the logged positions are
/// looked at, so a load costs the same at any fleet size. The log is part of the CAS-written
/// value, so it names exactly the writes that came between; a log that names a position past
/// the table reads as no log.
///
/// A reader that only reads (the pick) borrows the cached table itself ([`TableCache::lend`]
/// and [`TableCache::give_back`]) instead of a copy: copying every entry cost more than
/// decoding the changed ones (about 870 instructions per endpoint under wasm).
#[derive(Debug, Default)]
pub struct TableCache {
    /// By position in the configuration: `(stamp, id)` of the entry of `table` as decoded.
    stamps: Vec<Option<(u64, u32)>>,
    /// The table as last loaded; empty while lent.
    table: Table,
    /// `table` is lent out: its entries are not here, whatever `stamps` says.
    lent: bool,
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
    changed: Vec<usize>,
    changed_known: bool,
    /// The last session decision's verdicts and weights (see [`BoardMemo`]).
    pub board: BoardMemo,
    /// The same for the last drawn decision (a request without a session over many
    /// candidates, `placement::Draws`): often of another model than the sessions' (an
    /// upload's), so kept apart, so that neither evicts the other's board.
    pub drawn_board: BoardMemo,
    /// Positions of the entries decoded since the board memo was last brought up to date
    /// (as `changed`, for [`BoardMemo`]; `board_changed_known` false: unknown).
    board_changed: Vec<usize>,
    board_changed_known: bool,
    /// Entries of `table` decoded (`stamps` set) whose stored verdict is degraded: whether
    /// any endpoint is, without visiting every entry.
    degraded: usize,
    /// The write counter of the bytes `table` was last brought up to (`None`: unknown), from
    /// which the header's write log tells which entries changed since.
    seen: Option<u64>,
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
    kept: Vec<(Option<String>, Vec<bool>, Rc<Statics>)>,
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
    fn position(&mut self, cfg: &Config, model: Option<&str>) -> usize {
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

    /// [`Table::load`] of `bytes`, decoding only the entries whose stamp changed since this
    /// cache last saw them.
    pub fn load(&mut self, bytes: Option<&[u8]>, cfg: &Config) -> (Table, bool) {
        match bytes.and_then(|b| self.refresh(b, cfg)) {
            Some(()) => (self.table.clone(), true),
            None => self.reset(bytes, cfg),
        }
    }

    /// [`TableCache::load`] without the copy: the cached table itself, to be handed back
    /// unchanged with [`TableCache::give_back`] (until then the cache holds nothing).
    pub fn lend(&mut self, bytes: Option<&[u8]>, cfg: &Config) -> (Table, bool) {
        match bytes.and_then(|b| self.refresh(b, cfg)) {
            Some(()) => {
                self.lent = true;
                (std::mem::take(&mut self.table), true)
            }
            None => self.reset(bytes, cfg),
        }
    }

    /// While a table with `entries` entries is lent ([`TableCache::lend`]): the `(stamp, id)`
    /// of each of its entries, by position, and the quiet memo, which is keyed by them. `None`
    /// when no table is lent (the stamps may then describe other bytes than the caller's).
    pub fn lent_stamps(&mut self, entries: usize) -> Option<LentStamps<'_>> {
        (self.lent && self.stamps.len() == entries)
            .then_some((self.stamps.as_slice(), &mut self.quiet))
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
            self.seen = None;
        }
        self.lent = false;
    }

    fn reset(&mut self, bytes: Option<&[u8]>, cfg: &Config) -> (Table, bool) {
        self.stamps.clear();
        self.degraded = 0;
        self.seen = None;
        self.table = Table::default();
        self.lent = false;
        self.decoded = self.decoded.saturating_add(cfg.endpoints.len() as u64);
        Table::load(bytes, cfg)
    }

    /// Brings `table` up to `bytes` when they have the configuration's layout: the entries
    /// the write log says changed since the table this cache holds, when it covers every write
    /// since; else every entry whose stamp moved.
    fn refresh(&mut self, bytes: &[u8], cfg: &Config) -> Option<()> {
        let n = cfg.endpoints.len();
        let budget = RetryBudget::decode(&mut Reader::new(bytes.get(1..STAMP_AT)?))?;
        let counter = u64_at(bytes, STAMP_AT)?;
        let whole = self.lent || self.table.entries.len() != n || self.stamps.len() != n;
        let seen = self.seen.take().filter(|_| !whole);
        let logged = seen
            .filter(|_| Table::is_complete(bytes, n))
            .and_then(|seen| logged_since(bytes, seen, n));
        let mut notes = Notes {
            n,
            decoded: &mut self.decoded,
            degraded: &mut self.degraded,
            changed: (&mut self.changed, &mut self.changed_known),
            board_changed: (&mut self.board_changed, &mut self.board_changed_known),
        };
        match logged {
            Some(positions) => {
                for i in positions {
                    let at = HEADER_BYTES.checked_add(i.checked_mul(ENTRY_BYTES)?)?;
                    let chunk = bytes.get(at..at.checked_add(ENTRY_BYTES)?)?;
                    let id = u32_at(chunk, 0)?;
                    let stamp = u64_at(chunk, 4)?;
                    // The log vouches for the layout: an entry of another id means it lied.
                    if cfg.endpoints.get(i).map(|e| e.id) != Some(id) {
                        return None;
                    }
                    let (Some(slot), Some(entry)) =
                        (self.stamps.get_mut(i), self.table.entries.get_mut(i))
                    else {
                        return None;
                    };
                    if *slot != Some((stamp, id)) {
                        notes.take(bytes, i, (stamp, id), slot, entry)?;
                    }
                }
            }
            None => {
                if !Table::has_layout(bytes, cfg) {
                    return None;
                }
                if whole {
                    self.stamps.clear();
                    self.table.entries.clear();
                    *notes.degraded = 0;
                }
                self.stamps.resize(n, None);
                self.table.entries.resize(n, (0, EndpointState::default()));
                let chunks = bytes.get(HEADER_BYTES..)?.chunks_exact(ENTRY_BYTES);
                for (i, ((slot, entry), chunk)) in self
                    .stamps
                    .iter_mut()
                    .zip(self.table.entries.iter_mut())
                    .zip(chunks)
                    .enumerate()
                {
                    // Id, then stamp: the first 12 bytes of the entry.
                    let id = u32_at(chunk, 0)?;
                    let stamp = u64_at(chunk, 4)?;
                    if *slot != Some((stamp, id)) {
                        notes.take(bytes, i, (stamp, id), slot, entry)?;
                    }
                }
            }
        }
        self.lent = false;
        self.table.budget = budget;
        self.table.generation = cfg.layout_generation;
        self.seen = Some(counter);
        Some(())
    }
}

/// What [`TableCache::refresh`] notes of the entries it decodes again.
struct Notes<'c> {
    n: usize,
    decoded: &'c mut u64,
    degraded: &'c mut usize,
    /// The positions decoded, for the medians memo and for the board memo (each reads its own
    /// list: a board's decisions are not every decision the medians memo serves); `false`:
    /// more than the table holds, unknown.
    changed: (&'c mut Vec<usize>, &'c mut bool),
    board_changed: (&'c mut Vec<usize>, &'c mut bool),
}

impl Notes<'_> {
    /// Entry `i` of `bytes`, whose `(stamp, id)` differ from its `slot`'s, decoded into
    /// `entry`. `None` when it does not decode: nothing of this load may be trusted then (the
    /// caller starts over).
    fn take(
        &mut self,
        bytes: &[u8],
        i: usize,
        key: (u64, u32),
        slot: &mut Option<(u64, u32)>,
        entry: &mut (u32, EndpointState),
    ) -> Option<()> {
        let was_degraded = slot.is_some() && entry.1.degraded;
        *slot = None;
        *entry = Table::entry_at(bytes, i)?;
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
    /// `(stamp, id)` of each entry of the lent table, by position (as [`LentStamps`]).
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
/// entry was decoded again since (their stamp moved), whose peers' median changed, or whose
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
    pub(crate) verdicts: Rc<Vec<crate::scheduler::routing::signals::Verdict>>,
    /// The positions whose verdict differs from the stored one, index order.
    pub(crate) flips: Rc<Vec<usize>>,
    /// Positions whose values depend on the clock: recomputed by every decision.
    pub(crate) live: Vec<usize>,
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

/// A rendezvous order's first pass as `placement::Keyed` keeps it: the first
/// `(position, (key, id, index))`, if any, and the greatest `(hash, position)`s with the weight
/// they share when they decided it.
pub type FirstPass = (
    Option<(usize, (f64, u32, usize))>,
    Option<([(u64, usize); 4], f64)>,
);

/// What [`TableCache::lent_stamps`] lends: the `(stamp, id)` of each entry of the lent table,
/// by position, and the quiet memo keyed by them.
pub type LentStamps<'a> = (&'a [Option<(u64, u32)>], &'a mut QuietMemo);

/// One worker's memo of its quiet endpoints' verdicts and session placement weights.
///
/// Why: a pick judges every candidate (its verdict, for the walk and for the hysteresis its
/// write stores) and weighs it (the rendezvous weights): about 350 instructions per endpoint
/// and request under wasm, while most endpoints of a large fleet are quiet between two
/// requests of a worker. An endpoint is quiet (`signals::quiet`) when neither value can change
/// with the clock: no fresh scraped load (its saturation is `Unknown`, its slowness judges
/// it), no watched attempt that could become overdue, and a success level that does not fade
/// (cold, or never failing). Its verdict and weight are then functions of its entry, its
/// peers' median and the configuration alone, and are kept here by the entry's write stamp
/// (see [`TableCache`], which holds this memo: one per configuration) and the median's bits.
/// Anything not quiet, or not kept, is computed as before; the memo never returns what
/// computing would not (`select`'s `memo_tests` hold it to that).
#[derive(Debug, Default, Clone)]
pub struct QuietMemo {
    /// By endpoint index (compact: a hit reads one entry and writes at most two flags).
    pub(crate) at: Vec<Quiet>,
    /// Values taken from the memo instead of computed, for tests and diagnostics.
    pub hits: u64,
}

/// What [`QuietMemo`] keeps of one endpoint. A quiet endpoint's verdict is its sticky flag
/// alone: not overdue (so `degraded` equals it), saturation `Unknown`, no load.
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
}

/// A [`QuietMemo`] hit: the endpoint's id, session weight, sticky flag and whether its
/// verdict flipped.
pub(crate) type QuietHit = (u32, f64, bool, bool);

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn round_trip_and_realignment() {
        let cfg = Config::from_value(
            &json!({"endpoints":[{"name":"a","cluster":"a"},{"name":"b","cluster":"b"}]}),
        )
        .unwrap();
        let mut t = Table::aligned(None, &cfg);
        t.entries[1].1.total = 42;
        t.entries[1].1.latency_ms = Some(12.5);
        t.entries[1].1.breaker.state = BreakerState::Open;
        t.entries[1].1.degraded = true;
        t.entries[1].1.degraded_probe_ms = 77;
        t.entries[1].1.slowness.log_mean = 0.5;
        t.entries[1].1.slowness.samples = 9;
        t.entries[1].1.saturation = Saturation::Saturated;
        t.entries[1].1.quota.tokens = Some(crate::scheduler::routing::quota::Remaining::new(5, 6));
        t.entries[1].1.payoff.observe(
            &crate::scheduler::wire::usage::Usage {
                prompt_tokens: 300,
                cached_tokens: 200,
                completion_tokens: 1,
            },
            1,
        );
        let bytes = t.encode();
        assert_eq!(Table::decode(&bytes), Some(t.clone()));
        assert_eq!(Table::decode(&bytes[..bytes.len() - 1]), None);
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(Table::decode(&longer), None);
        // Reordered configuration keeps each endpoint's history.
        let swapped = Config::from_value(
            &json!({"endpoints":[{"name":"b","cluster":"b"},{"name":"c","cluster":"c"}]}),
        )
        .unwrap();
        let t2 = Table::aligned(Some(&bytes), &swapped);
        assert_eq!(t2.entries[0].1.total, 42);
        assert_eq!(t2.entries[1].1, EndpointState::default());
    }

    #[test]
    fn cache_equals_a_full_decode_and_decodes_only_changed_entries() {
        let cfg = Config::from_value(&json!({"endpoints":[{"name":"a","cluster":"a"},{"name":"b","cluster":"b"},{"name":"c","cluster":"c"}]})).unwrap();
        let b0 = Table::aligned(None, &cfg).encode();
        let mut cache = TableCache::default();
        assert_eq!(cache.load(Some(&b0), &cfg), Table::load(Some(&b0), &cfg));
        assert_eq!(cache.decoded, 3);
        // Unchanged bytes: nothing decoded.
        assert_eq!(cache.load(Some(&b0), &cfg), Table::load(Some(&b0), &cfg));
        assert_eq!(cache.decoded, 3);
        // One entry patched (as a pick writes): that entry only.
        let (mut t, same) = Table::load(Some(&b0), &cfg);
        assert!(same);
        t.entries[1].1.in_flight = 5;
        t.budget.on_request(1_000);
        let b1 = t.encode_patched(&b0, 1);
        assert_eq!(cache.load(Some(&b1), &cfg), Table::load(Some(&b1), &cfg));
        assert_eq!(cache.load(Some(&b1), &cfg).0.entries[1].1.in_flight, 5);
        assert_eq!(cache.decoded, 4);
        // One entry rewritten alone (as a finish writes): that entry only.
        let mut st = t.entries[2].1;
        st.total = 9;
        let b2 = Table::patch_entry(&b1, 2, t.entries[2].0, &st).unwrap();
        assert!(Table::has_layout(&b2, &cfg));
        assert_eq!(Table::entry_at(&b2, 2), Some((t.entries[2].0, st)));
        assert_eq!(cache.load(Some(&b2), &cfg), Table::load(Some(&b2), &cfg));
        assert_eq!(cache.decoded, 5);
        // A full rewrite over it: every entry, the write counter still growing.
        t.entries[0].1.total = 1;
        let b3 = t.encode_over(Some(&b2));
        assert_eq!(cache.load(Some(&b3), &cfg), Table::load(Some(&b3), &cfg));
        assert_eq!(cache.decoded, 8);
        assert!(next_stamp(Some(&b3)) > next_stamp(Some(&b2)));
        // Older bytes again (a reader may see any version): still what a full decode says.
        assert_eq!(cache.load(Some(&b1), &cfg), Table::load(Some(&b1), &cfg));
        assert_eq!(cache.degraded, 0);
        // A degraded flag stored, then cleared: the cache counts what its table holds.
        let mut st = t.entries[2].1;
        st.degraded = true;
        let b4 = Table::patch_entry(&b3, 2, t.entries[2].0, &st).unwrap();
        assert_eq!(cache.load(Some(&b4), &cfg), Table::load(Some(&b4), &cfg));
        assert_eq!(cache.degraded, 1);
        st.degraded = false;
        let b5 = Table::patch_entry(&b4, 2, t.entries[2].0, &st).unwrap();
        assert_eq!(cache.load(Some(&b5), &cfg), Table::load(Some(&b5), &cfg));
        assert_eq!(cache.degraded, 0);
        // A layout change or undecodable bytes: the plain load, cache dropped.
        let other = Config::from_value(&json!({"endpoints":[{"name":"b","cluster":"b"}]})).unwrap();
        assert!(!Table::has_layout(&b3, &other));
        assert_eq!(
            cache.load(Some(&b3), &other),
            Table::load(Some(&b3), &other)
        );
        assert_eq!(
            cache.load(Some(&b3[1..]), &cfg),
            Table::load(Some(&b3[1..]), &cfg)
        );
        assert_eq!(cache.load(None, &cfg), Table::load(None, &cfg));
    }

    /// Through the write log, a cache decodes only the entries the writes since its last load
    /// changed, and its table still equals a full decode of the same bytes: over every kind of
    /// write (a pick's patch with the budget, a finish's patch alone, copying or in place, a
    /// full rewrite, an older generation's merge), past the log's length, over older bytes
    /// again, and over a log that names a position past the table (read as no log).
    #[test]
    fn the_write_log_names_every_changed_entry() {
        use crate::scheduler::state::hash::fmix64;
        let names: Vec<String> = (0..40).map(|i| format!("e{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let cfg = two(&refs);
        let mut older = cfg.clone();
        older.layout_generation = 0;
        let mut cfg = cfg;
        cfg.layout_generation = 1;
        let mut bytes = Table::aligned(None, &cfg).encode();
        let mut cache = TableCache::default();
        let mut history = vec![bytes.clone()];
        let mut writes_since_load = 0usize;
        for step in 0..2_000u64 {
            let r = fmix64(step);
            let (t, _) = Table::load(Some(&bytes), &cfg);
            let i = (r % 40) as usize;
            let mut st = t.entries[i].1;
            st.total = step;
            st.degraded = r & 64 != 0;
            match (r >> 8) % 16 {
                0 => {
                    let mut whole = t.clone();
                    whole.entries[(i + 1) % 40].1.total = step;
                    bytes = whole.encode_over(Some(&bytes));
                    writes_since_load = usize::MAX / 2;
                }
                1 => {
                    let mut theirs = Table::load(Some(&bytes), &older).0;
                    theirs.generation = 0;
                    theirs.entries[i].1 = st;
                    bytes = theirs.encode_over(Some(&bytes));
                    writes_since_load = usize::MAX / 2;
                }
                2..=5 => {
                    bytes = Table::patch_entry(&bytes, i, t.entries[i].0, &st).unwrap();
                    writes_since_load += 1;
                }
                6..=9 => {
                    assert!(Table::patch_entry_in_place(
                        &mut bytes,
                        i,
                        t.entries[i].0,
                        &st
                    ));
                    writes_since_load += 1;
                }
                10..=13 => {
                    let mut budget = t.budget;
                    budget.on_request(step);
                    assert!(Table::patch_in_place(
                        &mut bytes,
                        &budget,
                        i,
                        t.entries[i].0,
                        &st,
                        40
                    ));
                    writes_since_load += 1;
                }
                14 => {
                    // Older bytes again: whatever is read must equal a full decode.
                    let old = &history[(r >> 16) as usize % history.len()];
                    assert_eq!(cache.load(Some(old), &cfg), Table::load(Some(old), &cfg));
                    writes_since_load = usize::MAX / 2;
                    continue;
                }
                _ => {
                    let decoded = cache.decoded;
                    assert_eq!(
                        cache.load(Some(&bytes), &cfg),
                        Table::load(Some(&bytes), &cfg),
                        "step {step}"
                    );
                    if writes_since_load <= LOG_LEN {
                        assert!(
                            cache.decoded - decoded <= writes_since_load as u64,
                            "step {step}: {} decoded for {writes_since_load} writes",
                            cache.decoded - decoded
                        );
                    }
                    let degraded = Table::load(Some(&bytes), &cfg)
                        .0
                        .entries
                        .iter()
                        .filter(|(_, st)| st.degraded)
                        .count();
                    assert_eq!(cache.degraded, degraded, "step {step}");
                    writes_since_load = 0;
                    continue;
                }
            }
            history.push(bytes.clone());
        }
        // A log naming a position past the table: read as no log (every stamp compared).
        let (t, _) = Table::load(Some(&bytes), &cfg);
        let _ = cache.load(Some(&bytes), &cfg);
        let mut st = t.entries[3].1;
        st.total = 1;
        assert!(Table::patch_entry_in_place(
            &mut bytes,
            3,
            t.entries[3].0,
            &st
        ));
        let stamp = u64_at(&bytes, STAMP_AT).unwrap();
        let slot = LOG_AT + (stamp % LOG_LEN as u64) as usize * 4;
        bytes[slot..slot + 4].copy_from_slice(&99u32.to_le_bytes());
        assert_eq!(
            cache.load(Some(&bytes), &cfg),
            Table::load(Some(&bytes), &cfg)
        );
    }

    /// A lent table is the loaded table itself; given back unchanged, the next load decodes
    /// only what moved; not given back (or given back another), the cache starts over.
    #[test]
    fn lent_tables_equal_loads_and_come_back() {
        let cfg = Config::from_value(&json!({"endpoints":[{"name":"a","cluster":"a"},{"name":"b","cluster":"b"},{"name":"c","cluster":"c"}]})).unwrap();
        let b0 = Table::aligned(None, &cfg).encode();
        let mut cache = TableCache::default();
        let lent = cache.lend(Some(&b0), &cfg);
        assert_eq!(lent, Table::load(Some(&b0), &cfg));
        assert_eq!(cache.decoded, 3);
        cache.give_back(lent.0);
        let st = EndpointState {
            total: 7,
            ..EndpointState::default()
        };
        let b1 = Table::patch_entry(&b0, 1, Table::aligned(None, &cfg).entries[1].0, &st).unwrap();
        let lent = cache.lend(Some(&b1), &cfg);
        assert_eq!(lent, Table::load(Some(&b1), &cfg));
        assert_eq!(cache.decoded, 4, "only the patched entry");
        // Never given back: the next load decodes everything and is still right.
        assert_eq!(cache.load(Some(&b1), &cfg), Table::load(Some(&b1), &cfg));
        assert_eq!(cache.decoded, 7);
        // Given back something else: dropped.
        let lent = cache.lend(Some(&b1), &cfg);
        cache.give_back(Table::default());
        drop(lent);
        assert_eq!(cache.load(Some(&b1), &cfg), Table::load(Some(&b1), &cfg));
        assert_eq!(cache.decoded, 10);
        // The parts patch equals the table's patch.
        let (mut t, _) = Table::load(Some(&b1), &cfg);
        t.entries[2].1.in_flight = 3;
        t.budget.on_request(5);
        let id = t.entries[2].0;
        assert_eq!(
            Table::patch_budget_and_entry(&b1, &t.budget, 2, id, &t.entries[2].1, 3),
            Some(t.encode_patched(&b1, 2))
        );
        assert_eq!(
            Table::patch_budget_and_entry(&b1, &t.budget, 2, id, &t.entries[2].1, 4),
            None
        );
        // In place: the same bytes, without the copy; out of range or another size: untouched.
        let mut own = b1.clone();
        assert!(Table::patch_in_place(
            &mut own,
            &t.budget,
            2,
            id,
            &t.entries[2].1,
            3
        ));
        assert_eq!(own, t.encode_patched(&b1, 2));
        let mut own = b1.clone();
        assert!(!Table::patch_in_place(
            &mut own,
            &t.budget,
            3,
            id,
            &t.entries[2].1,
            3
        ));
        assert!(!Table::patch_in_place(
            &mut own,
            &t.budget,
            2,
            id,
            &t.entries[2].1,
            2
        ));
        assert_eq!(own, b1);
    }

    /// One endpoint's entry read and rewritten in place equals the copying patch, found by id
    /// at its index whatever the layout around it; anything else reads as absent and writes
    /// nothing.
    #[test]
    fn entry_of_and_in_place_patch_equal_the_copying_ones() {
        let cfg = two(&["a", "b", "c"]);
        let mut t = Table::aligned(None, &cfg);
        t.entries[1].1.total = 5;
        let stored = t.encode();
        let (id_b, id_c) = (t.entries[1].0, t.entries[2].0);
        assert_eq!(Table::entry_of(&stored, 1, id_b), Some(t.entries[1].1));
        assert_eq!(Table::entry_of(&stored, 1, id_c), None, "another id there");
        assert_eq!(Table::entry_of(&stored, 3, id_b), None, "out of range");
        assert_eq!(Table::entry_of(&stored[1..], 1, id_b), None);
        assert_eq!(Table::entry_of(&stored[..stored.len() - 1], 1, id_b), None);
        let mut st = t.entries[1].1;
        st.in_flight = 4;
        let mut own = stored.clone();
        assert!(Table::patch_entry_in_place(&mut own, 1, id_b, &st));
        assert_eq!(Some(own.clone()), Table::patch_entry(&stored, 1, id_b, &st));
        assert_eq!(Table::entry_of(&own, 1, id_b), Some(st));
        // Found by id in another configuration's layout: b at index 0, c kept.
        let other = two(&["b", "c"]);
        let theirs = Table::aligned(Some(&stored), &other).encode();
        assert_eq!(Table::entry_of(&theirs, 0, id_b), Some(t.entries[1].1));
        let mut own = theirs.clone();
        assert!(Table::patch_entry_in_place(&mut own, 0, id_b, &st));
        assert!(Table::has_layout(&own, &other));
        assert_eq!(Table::decode(&own).unwrap().entries[0].1, st);
        // Out of range or not a table: untouched.
        let mut own = stored.clone();
        assert!(!Table::patch_entry_in_place(&mut own, 3, id_b, &st));
        assert_eq!(own, stored);
        let mut junk = b"junk".to_vec();
        assert!(!Table::patch_entry_in_place(&mut junk, 0, id_b, &st));
        assert_eq!(junk, b"junk");
    }

    #[test]
    fn serves_memo_follows_the_model_asked() {
        let cfg = Config::from_value(&json!({"endpoints":[
            {"name":"a","cluster":"a","models":["m1"]},
            {"name":"b","cluster":"b","models":["m2","m1"]},
            {"name":"c","cluster":"c"}]}))
        .unwrap();
        let mut memo = ServesMemo::default();
        assert_eq!(memo.serves(&cfg, Some("m1")), &[true, true, true]);
        assert_eq!(memo.serves(&cfg, Some("m2")), &[false, true, true]);
        assert_eq!(memo.serves(&cfg, Some("m2")), &[false, true, true]);
        assert_eq!(memo.serves(&cfg, Some("x")), &[false, false, true]);
        assert_eq!(memo.serves(&cfg, None), &[true, true, true]);
        // Interleaved models are answered from the memo, and past its size it still answers.
        for k in 0..3 * ServesMemo::MODELS {
            let m = format!("m{}", k % (ServesMemo::MODELS + 2));
            let want = [m == "m1", m == "m1" || m == "m2", true];
            assert_eq!(memo.serves(&cfg, Some(&m)), &want, "{m}");
            let statics = Statics::of(&cfg, &want);
            assert_eq!(memo.statics(&cfg, Some(&m)), Some(&Rc::new(statics)), "{m}");
        }
        assert!(memo.kept.len() <= ServesMemo::MODELS);
        // A cache for a configuration holds its models (and none) before any request.
        let warm = TableCache::for_config(&cfg);
        assert_eq!(warm.serves.kept.len(), 3);
        let mut serves = warm.serves.clone();
        assert_eq!(serves.serves(&cfg, Some("m2")), &[false, true, true]);
        assert_eq!(serves.kept.len(), 3, "found, not computed again");
    }

    #[test]
    fn patched_encoding_equals_full_encoding() {
        let cfg = Config::from_value(&json!({"endpoints":[{"name":"a","cluster":"a"},{"name":"b","cluster":"b"},{"name":"c","cluster":"c"}]})).unwrap();
        let mut t = Table::aligned(None, &cfg);
        t.entries[0].1.total = 3;
        let stored = t.encode();
        let (mut loaded, same) = Table::load(Some(&stored), &cfg);
        assert!(same);
        loaded.entries[2].1.in_flight = 9;
        loaded.entries[2].1.breaker.epoch = 4;
        loaded.budget.on_request(1_000);
        // The same table; only the stamps differ (the patched entry and the write counter
        // move, the others keep theirs).
        let patched = loaded.encode_patched(&stored, 2);
        assert_eq!(Table::decode(&patched), Some(loaded.clone()));
        assert_eq!(patched.len(), loaded.encode().len());
        assert_eq!(stamp_of(&patched, 0), stamp_of(&stored, 0));
        assert_eq!(stamp_of(&patched, 2), Some(next_stamp(Some(&stored))));
        assert_eq!(next_stamp(Some(&patched)), next_stamp(Some(&stored)) + 1);
        // A layout change is never patched.
        let other = Config::from_value(&json!({"endpoints":[{"name":"b","cluster":"b"}]})).unwrap();
        assert!(!Table::load(Some(&stored), &other).1);
        assert!(!Table::load(None, &cfg).1);
    }

    fn two(names: &[&str]) -> Config {
        let eps: Vec<_> = names
            .iter()
            .map(|n| json!({"name": n, "cluster": n}))
            .collect();
        Config::from_value(&json!({ "endpoints": eps })).unwrap()
    }

    #[test]
    fn key_follows_the_version() {
        assert_eq!(TABLE_KEY, format!("computeflux/endpoints/{TABLE_VERSION}"));
    }

    /// An older generation's write keeps the newer layout and generation, changes only its own
    /// changed entries (by id) and the budget; a newer or equal generation lays it out anew.
    #[test]
    fn older_generation_patches_by_id_and_never_relays_out() {
        let mut new = two(&["b", "a", "d"]);
        new.layout_generation = 2;
        let mut old = two(&["a", "b", "c"]);
        old.layout_generation = 1;
        let mut t = Table::aligned(None, &new);
        t.entries[2].1.breaker.state = BreakerState::Open;
        t.entries[0].1.total = 7;
        let stored = t.encode();
        // The old writer sees its layout: a and b from the table, c fresh.
        let (mut mine, same) = Table::load(Some(&stored), &old);
        assert!(!same);
        assert_eq!(mine.entries[1].1.total, 7);
        mine.entries[0].1.total = 3;
        mine.entries[2].1.total = 9;
        mine.budget.on_request(5);
        let out = mine.encode_over(Some(&stored));
        assert!(Table::has_layout(&out, &new));
        let back = Table::decode(&out).unwrap();
        assert_eq!(back.generation, 2);
        assert_eq!(back.entries[1].1.total, 3, "a patched by id");
        assert_eq!(back.entries[0].1.total, 7, "b kept");
        assert_eq!(
            back.entries[2].1.breaker.state,
            BreakerState::Open,
            "d kept"
        );
        assert_eq!(back.budget, mine.budget);
        // Only a's entry got the new stamp; the write counter moved.
        assert_eq!(stamp_of(&out, 0), stamp_of(&stored, 0));
        assert_eq!(stamp_of(&out, 2), stamp_of(&stored, 2));
        assert_eq!(stamp_of(&out, 1), Some(next_stamp(Some(&stored))));
        assert_eq!(next_stamp(Some(&out)), next_stamp(Some(&stored)) + 1);
        // The newer configuration itself (or a later one) writes its own layout.
        let mut newer = two(&["a", "c"]);
        newer.layout_generation = 3;
        let relaid = Table::load(Some(&out), &newer).0.encode_over(Some(&out));
        assert!(Table::has_layout(&relaid, &newer));
        assert_eq!(Table::decode(&relaid).unwrap().generation, 3);
        // Equal generations (never claimed: tests and tools) keep the old rule, last writer's
        // layout.
        let (a, b) = (two(&["a"]), two(&["b"]));
        let ta = Table::aligned(None, &a).encode();
        assert!(Table::has_layout(
            &Table::load(Some(&ta), &b).0.encode_over(Some(&ta)),
            &b
        ));
        // Over corrupt bytes of a newer generation: a full rewrite, not a patch.
        let mut bad = out.clone();
        // The first entry's latency (after id, stamp, presence byte) as NaN: undecodable.
        bad[HEADER_BYTES + 13..HEADER_BYTES + 21].copy_from_slice(&f64::NAN.to_le_bytes());
        assert_eq!(Table::decode(&bad), None);
        assert!(Table::has_layout(
            &Table::load(Some(&bad), &old).0.encode_over(Some(&bad)),
            &old
        ));
    }

    #[test]
    fn claim_is_idempotent_per_layout_and_orders_layouts() {
        let store = crate::scheduler::state::store::MemStore::new();
        let (a, b) = (two(&["a", "b"]), two(&["b", "c"]));
        assert_eq!(claim_layout(&store, &a), 1);
        assert_eq!(claim_layout(&store, &a), 1);
        let writes = store.writes.get();
        assert_eq!(claim_layout(&store, &a), 1);
        assert_eq!(
            store.writes.get(),
            writes,
            "a claim of the stored layout writes nothing"
        );
        assert_eq!(claim_layout(&store, &b), 2);
        // b's claim laid the table out for b, keeping b's entry.
        let bytes = store.get(TABLE_KEY).0.unwrap();
        assert!(Table::has_layout(&bytes, &b));
        assert_eq!(claim_layout(&store, &a), 3);
        // Undecodable bytes: a fresh table at generation 1.
        store.set(TABLE_KEY, b"junk", None).unwrap();
        assert_eq!(claim_layout(&store, &b), 1);
    }
}
