//! Cross-request state of every endpoint: the "endpoint table", stored split in keys.
//!
//! The table holds the statistics and breaker of every configured endpoint plus the retry
//! budget. Entries are keyed by endpoint id (a hash of the name): a configuration reload that
//! adds, removes or reorders endpoints keeps the others' history.
//!
//! What a request pays must not grow with the fleet. Envoy copies a whole
//! shared-data value on every read and write (into its map and across the wasm boundary), so
//! the table is not one value: a small header key ([`TABLE_KEY`]: the budget, the layout
//! generation, the entry count and one version per group) and the entries in groups of
//! [`GROUP_LEN`] (by position in the layout) under keys of their own ([`group_key`]), each
//! written under its own CAS (see [`groups`]). Entries have a fixed size, and each carries the
//! *stamp* of the write that last changed it (its group's version at that write). A write that
//! changes one endpoint rewrites that entry in its group alone, with the group's next version,
//! then records that version in the header (as a maximum, under the header's CAS: versions
//! only move up, so a lost race there never hides an entry update). A worker keeps the entries
//! it decoded and the version of each group it read ([`TableCache`]); reading the table again,
//! it reads the header, then only the groups whose recorded version passed the one it read, and
//! of those decodes only the entries whose stamp moved. At 512 endpoints a new session copies
//! the header and the few groups that changed since its worker's last request, not 380 KB.
//!
//! Reloads and upgrades. After a configuration update, requests of the old
//! configuration keep writing the table while the new one serves: the requests in flight at an
//! ECDS update, every request of the old connections for up to Envoy's drain time at a listener
//! update. Two layouts would take turns, each write dropping the entries the other
//! configuration alone has. So the header records the *generation* of the layout that wrote
//! it: each configuration claims one when it is configured ([`claim_layout`]: the stored
//! generation if the layout is already its own, else one more, written with its layout, the
//! header last under the CAS of the header read, so both sides agree on the order). A writer of
//! an older generation never rewrites the layout: it patches the entries it can find by
//! endpoint id and leaves the rest (see [`groups::lay_out`]). A new table version (another
//! byte format) gets its own shared-data keys ([`TABLE_KEY`] and its groups): a module of
//! another version, also one that predates this rule, neither reads nor writes them, so an
//! upgrade starts the new table once and resets nothing in turn.

pub mod ewma;
pub mod in_flight;

use crate::scheduler::config::Config;
use crate::scheduler::health::breaker::{Breaker, BreakerState, OpenCause};
use crate::scheduler::health::budget::RetryBudget;
use crate::scheduler::routing::judge::payoff::Payoff;
use crate::scheduler::routing::judge::saturation::{EngineLoad, Saturation};
use crate::scheduler::routing::judge::slowness::Slowness;
use crate::scheduler::routing::quota::Quota;
use crate::scheduler::routing::table::in_flight::InFlightAges;
use crate::scheduler::state::codec::{Reader, Writer};
use crate::scheduler::state::hash::rendezvous_seed;
use crate::scheduler::state::store::{Store, CAS_RETRIES};

mod cache;
pub mod groups;
pub use cache::*;
pub use groups::{group_key, GROUP_LEN};
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
    /// The start of the probe schedule that the scraped engine's last decoding is read against
    /// (see `placement::fleet_probes`): when this Envoy judged it degraded or saw a probe of
    /// its come back fast, moved on by its own work there since (`finish::record_degraded_busy`).
    pub degraded_at_ms: u64,
    /// When this Envoy last had an answer from it while it was degraded (or judged it so): a
    /// later decoding by its scrape is another replica's probe (see `choose::probe_due`).
    pub degraded_own_end_ms: u64,
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
            degraded_at_ms: 0,
            degraded_own_end_ms: 0,
            quota: Quota::default(),
            payoff: Payoff::default(),
            slowness: Slowness::default(),
            saturation: Saturation::default(),
        }
    }
}

/// One endpoint's verdicts for a decision.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Verdict {
    /// Degraded by its slowness (with hysteresis): stored, and what makes probes due.
    pub sticky: bool,
    /// Treated as degraded now: `sticky`, or overdue affinity hits in flight (see `overdue`).
    pub degraded: bool,
    /// Its saturation, judged now on the scraped load (stored for the hysteresis).
    pub saturation: Saturation,
    /// The scraped load, if fresh.
    pub load: Option<EngineLoad>,
}

impl Verdict {
    pub fn saturated(&self) -> bool {
        self.saturation == Saturation::Saturated
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
    /// whether this writer may lay the table out anew (see [`groups::lay_out`]).
    pub generation: u64,
}

/// The byte format's version. A new one needs a new [`TABLE_KEY`] (a test checks that they
/// agree).
pub const TABLE_VERSION: u8 = 17;
/// The table's header key, one per [`TABLE_VERSION`] (its groups' keys are under it, see
/// [`group_key`]): modules of two versions running side by side during an upgrade each keep
/// their own table instead of resetting each other's on every write (Envoy never frees a key:
/// one table's worth of bytes per version ever run).
pub const TABLE_KEY: &str = "computeflux/endpoints/17";
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
    + 8
    + 8
    + Quota::BYTES
    + Payoff::BYTES
    + Slowness::BYTES
    + 1;
const BUDGET_BYTES: usize = 8 + 8 + 8;
/// A table snapshot ([`Table::encode`]): version byte, budget, layout generation, entry count,
/// then the entries. Not what is stored (see [`groups`]): for tests, tools and the fuzzer.
const SNAPSHOT_HEAD: usize = 1 + BUDGET_BYTES + 8 + 4;

/// The little-endian u64 at `at`, if `bytes` reaches that far.
fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    let b = bytes.get(at..at.checked_add(8)?)?;
    <[u8; 8]>::try_from(b).ok().map(u64::from_le_bytes)
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    let b = bytes.get(at..at.checked_add(4)?)?;
    <[u8; 4]>::try_from(b).ok().map(u32::from_le_bytes)
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
        degraded_at_ms: r.u64()?,
        degraded_own_end_ms: r.u64()?,
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
    w.u64(s.degraded_at_ms);
    w.u64(s.degraded_own_end_ms);
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
    /// The table aligned to `cfg.endpoints` from a snapshot ([`Table::encode`]): entry `i`
    /// belongs to endpoint `i`. Endpoints new to the stored table start fresh; stored entries
    /// of endpoints no longer configured are kept out.
    pub fn aligned(bytes: Option<&[u8]>, cfg: &Config) -> Table {
        Table::load(bytes, cfg).0
    }

    /// Like [`Table::aligned`], plus whether the snapshot had exactly the configuration's
    /// layout.
    pub fn load(bytes: Option<&[u8]>, cfg: &Config) -> (Table, bool) {
        let stored = bytes.and_then(Table::decode);
        Table::align(stored, true, cfg)
    }

    /// The stored table ([`groups`]: the header and every group) aligned to `cfg`, plus
    /// whether it already had exactly the configuration's layout (every group read whole).
    pub fn load_from(store: &dyn Store, cfg: &Config) -> (Table, bool) {
        match groups::read_stored(store) {
            Some((t, complete)) => Table::align(Some(t), complete, cfg),
            None => Table::align(None, false, cfg),
        }
    }

    /// [`Table::load_from`] without the layout flag.
    pub fn read(store: &dyn Store, cfg: &Config) -> Table {
        Table::load_from(store, cfg).0
    }

    /// Stores this table as it is, whatever is stored (tests and tools).
    pub fn write_to(&self, store: &dyn Store) {
        groups::write_table(store, self);
    }

    /// `stored` aligned to `cfg`; `complete`: `stored` holds every entry it was written with.
    fn align(stored: Option<Table>, complete: bool, cfg: &Config) -> (Table, bool) {
        let present = stored.is_some();
        let stored = stored.unwrap_or_default();
        let same_layout = present
            && complete
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

    /// Whether the stored table has exactly `cfg`'s layout (one entry per configured endpoint,
    /// in configuration order, every group readable). Reads every group.
    pub fn has_layout(store: &dyn Store, cfg: &Config) -> bool {
        Table::load_from(store, cfg).1
    }

    /// Where endpoint `id` is: at `hint` (its index when a ticket was issued), or wherever a
    /// configuration reload moved it; `None` once it is gone.
    pub fn locate(&self, hint: usize, id: u32) -> Option<usize> {
        match self.entries.get(hint) {
            Some((i, _)) if *i == id => Some(hint),
            _ => self.entries.iter().position(|(i, _)| *i == id),
        }
    }

    /// The table as one snapshot value (every stamp 1): what tests, tools and the fuzzer hand
    /// around. The store holds it split ([`groups`]).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(SNAPSHOT_HEAD + self.entries.len() * ENTRY_BYTES);
        w.u8(TABLE_VERSION);
        self.budget.encode(&mut w);
        w.u64(self.generation);
        w.u32(self.entries.len() as u32);
        for (id, s) in &self.entries {
            encode_entry(&mut w, *id, 1, s);
        }
        w.buf
    }

    /// `None` for anything that is not a complete snapshot of this version.
    pub fn decode(bytes: &[u8]) -> Option<Table> {
        let mut r = Reader::new(bytes);
        if r.u8()? != TABLE_VERSION {
            return None;
        }
        let budget = RetryBudget::decode(&mut r)?;
        let generation = r.u64()?;
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
/// and the table is laid out for `cfg` (entries kept by endpoint id), its header written under
/// the CAS of the header read first, so two configurations never claim one generation (the
/// loser claims again, over the winner's layout). A missing or undecodable table is created at
/// generation 1. If every attempt loses, the generation computed last is returned unwritten:
/// the configuration's first write lays the table out.
pub fn claim_layout(store: &dyn Store, cfg: &Config) -> u64 {
    let mut generation = 1;
    for _ in 0..CAS_RETRIES {
        let head = groups::Head::read(store).0;
        let (mut table, same) = Table::load_from(store, cfg);
        if let (Some(h), true) = (head.as_ref(), same) {
            return h.generation;
        }
        generation = head.map_or(0, |h| h.generation).saturating_add(1);
        table.generation = generation;
        if groups::lay_out(store, &table, &[], |_| {}) {
            return generation;
        }
    }
    generation
}

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

    use crate::scheduler::state::hash::fmix64;
    use crate::scheduler::state::store::{CasMismatch, MemStore};
    use std::cell::RefCell;

    type Race = Box<dyn FnOnce(&MemStore)>;

    /// A store whose next write to a key first lets "another worker" run (`race`): a write
    /// that comes between this worker's read and its CAS write. Counts reads per key kind.
    #[derive(Default)]
    struct Racing {
        inner: MemStore,
        race: RefCell<Option<Race>>,
        group_reads: std::cell::Cell<u64>,
    }

    impl Store for Racing {
        fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
            if key != TABLE_KEY {
                self.group_reads.set(self.group_reads.get() + 1);
            }
            self.inner.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
            let race = self.race.borrow_mut().take();
            if let Some(race) = race {
                race(&self.inner);
            }
            self.inner.set(key, value, cas)
        }
    }

    fn names(n: usize) -> Config {
        let names: Vec<String> = (0..n).map(|i| format!("e{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        two(&refs)
    }

    fn bump(store: &dyn Store, cfg: &Config, i: usize) -> Option<Result<bool, ()>> {
        groups::update_entry(
            store,
            Some(i),
            cfg.endpoints[i].id,
            |st| {
                st.total += 1;
                true
            },
            |b| b.on_request(1),
        )
    }

    #[test]
    fn cache_equals_a_full_load_and_reads_only_changed_groups() {
        let cfg = names(40);
        let store = Racing::default();
        Table::aligned(None, &cfg).write_to(&store);
        let mut cache = TableCache::default();
        assert_eq!(cache.load(&store, &cfg), Table::load_from(&store, &cfg));
        assert!(Table::load_from(&store, &cfg).1);
        assert_eq!(cache.decoded, 40);
        // Unchanged: the header read, no group, nothing decoded.
        let reads = store.group_reads.get();
        assert_eq!(cache.load(&store, &cfg), Table::load_from(&store, &cfg));
        assert_eq!(cache.decoded, 40);
        let reads_full = store.group_reads.get() - reads;
        let reads = store.group_reads.get();
        let _ = cache.load(&store, &cfg);
        assert_eq!(store.group_reads.get(), reads, "no group read");
        assert_eq!(
            reads_full,
            groups::groups(40) as u64,
            "the full load reads every group"
        );
        // One entry changed: its group read, that entry decoded.
        assert_eq!(bump(&store, &cfg, 17), Some(Ok(true)));
        let reads = store.group_reads.get();
        let (t, same) = cache.load(&store, &cfg);
        assert!(same);
        assert_eq!(store.group_reads.get() - reads, 1);
        assert_eq!(cache.decoded, 41);
        assert_eq!(t.entries[17].1.total, 1);
        assert_eq!(t.budget.requests, Table::read(&store, &cfg).budget.requests);
        assert!(t.budget.requests > 0.0, "the budget is in the header");
        assert_eq!((t, same), Table::load_from(&store, &cfg));
        // A degraded flag stored, then cleared: the cache counts what its table holds.
        for degraded in [true, false] {
            let id = cfg.endpoints[3].id;
            let w = groups::update_entry(
                &store,
                Some(3),
                id,
                |st| {
                    st.degraded = degraded;
                    true
                },
                |_| {},
            );
            assert_eq!(w, Some(Ok(true)));
            assert_eq!(cache.load(&store, &cfg), Table::load_from(&store, &cfg));
            assert_eq!(cache.degraded, usize::from(degraded));
        }
        // Another layout, or garbage in any key: the plain load, never a panic.
        let other = names(3);
        assert!(!Table::load_from(&store, &other).1);
        assert_eq!(cache.load(&store, &other), Table::load_from(&store, &other));
        store.inner.set(&group_key(1), b"junk", None).unwrap();
        let (t, same) = cache.load(&store, &cfg);
        assert!(!same);
        assert_eq!((t.clone(), same), Table::load_from(&store, &cfg));
        assert_eq!(
            t.entries[17].1.total, 0,
            "a garbage group reads as fresh entries"
        );
        assert_eq!(t.entries[3].1.total, 0);
        assert_eq!(
            bump(&store, &cfg, 17),
            None,
            "not stored anywhere: the caller lays out"
        );
        store.inner.set(TABLE_KEY, b"junk", None).unwrap();
        assert_eq!(cache.load(&store, &cfg), Table::load_from(&store, &cfg));
        assert_eq!(Table::load_from(&store, &cfg).0, Table::aligned(None, &cfg));
        assert_eq!(bump(&store, &cfg, 2), None);
    }

    /// Two workers, each with its own cache, write entries of the same and of different
    /// groups, with another worker's write landing between a read and its CAS write (on the
    /// same group, another group, or the header alone): no increment is lost, and each
    /// cache's table equals a full load after every step.
    #[test]
    fn two_workers_lose_no_update_and_caches_equal_full_loads() {
        let cfg = names(40);
        let store = Racing::default();
        Table::aligned(None, &cfg).write_to(&store);
        let mut caches = [TableCache::default(), TableCache::default()];
        let mut want = [0u64; 40];
        let mut requests = 0u32;
        for step in 0..3_000u64 {
            let r = fmix64(step);
            let i = (r % 40) as usize;
            let w = ((r >> 8) % 2) as usize;
            // The intruder: the same group, another group, or a header write alone.
            let j = match (r >> 16) % 4 {
                0 => {
                    (i / GROUP_LEN) * GROUP_LEN
                        + (((r >> 24) as usize) % GROUP_LEN).min(39 - (i / GROUP_LEN) * GROUP_LEN)
                }
                1 => (i + GROUP_LEN) % 40,
                2 => usize::MAX,
                _ => usize::MAX - 1,
            };
            if j < 40 {
                let cfg2 = cfg.clone();
                *store.race.borrow_mut() = Some(Box::new(move |inner: &MemStore| {
                    assert_eq!(bump(inner, &cfg2, j), Some(Ok(true)));
                }));
                want[j] += 1;
                requests += 1;
            } else if j == usize::MAX {
                *store.race.borrow_mut() = Some(Box::new(|inner: &MemStore| {
                    assert!(groups::note_versions(inner, None, &[], |b| b.on_request(1)));
                }));
                requests += 1;
            }
            assert_eq!(bump(&store, &cfg, i), Some(Ok(true)), "step {step}");
            want[i] += 1;
            requests += 1;
            // A reader in between may read the groups before the header records them.
            let _ = caches[1 - w].load(&store, &cfg);
            for cache in caches.iter_mut() {
                let (t, same) = cache.load(&store, &cfg);
                assert!(same);
                assert_eq!((t, same), Table::load_from(&store, &cfg), "step {step}");
            }
        }
        let t = Table::read(&store, &cfg);
        let totals: Vec<u64> = t.entries.iter().map(|(_, st)| st.total).collect();
        assert_eq!(totals, want.to_vec());
        // The budget saw every request, and the caches decoded far fewer entries than full
        // loads would have.
        assert!((t.budget.requests - f64::from(requests)).abs() < 1e-6 * f64::from(requests));
        assert!(caches[0].decoded < 3_000 * 40 / 4, "{}", caches[0].decoded);
    }

    /// A lent table is the loaded table itself; given back unchanged, the next load decodes
    /// only what moved; not given back (or given back another), the cache starts over.
    #[test]
    fn lent_tables_equal_loads_and_come_back() {
        let cfg = names(3);
        let store = MemStore::new();
        Table::aligned(None, &cfg).write_to(&store);
        let mut cache = TableCache::default();
        let lent = cache.lend(&store, &cfg);
        assert_eq!(lent, Table::load_from(&store, &cfg));
        assert_eq!(cache.decoded, 3);
        cache.give_back(lent.0);
        assert_eq!(bump(&store, &cfg, 1), Some(Ok(true)));
        let lent = cache.lend(&store, &cfg);
        assert_eq!(lent, Table::load_from(&store, &cfg));
        assert_eq!(cache.decoded, 4, "only the patched entry");
        // Never given back: the next load decodes everything and is still right.
        assert_eq!(cache.load(&store, &cfg), Table::load_from(&store, &cfg));
        assert_eq!(cache.decoded, 7);
        // Given back something else: dropped.
        let lent = cache.lend(&store, &cfg);
        cache.give_back(Table::default());
        drop(lent);
        assert_eq!(cache.load(&store, &cfg), Table::load_from(&store, &cfg));
        assert_eq!(cache.decoded, 10);
        // A group forgotten is read again, and only its changed entries decoded (none).
        cache.forget_group(0);
        assert_eq!(cache.load(&store, &cfg), Table::load_from(&store, &cfg));
        assert_eq!(cache.decoded, 10);
    }

    #[test]
    fn group_keys_are_the_formatted_ones() {
        for g in [0, 1, 9, 10, 31, 99, 100, 4095, usize::MAX] {
            assert_eq!(group_key(g), format!("{TABLE_KEY}/g{g}"));
        }
        let at = |n: u64| crate::scheduler::state::store::numbered_key(&["a/", "b"], n);
        for n in [0, 7, 10, 12345, u64::MAX] {
            assert_eq!(at(n), format!("a/b{n}"));
        }
    }

    #[test]
    fn a_header_patched_in_place_is_the_header_encoded() {
        let h = groups::Header {
            budget: RetryBudget {
                requests: 3.0,
                retries: 1.0,
                updated_ms: 7,
            },
            generation: 4,
            entries: 40,
            versions: vec![5, 9, 2],
        };
        let mut head = groups::Head::decode(h.encode()).expect("a header");
        assert_eq!((head.version(1), head.version(3)), (9, 0));
        assert_eq!(head.versions().collect::<Vec<_>>(), h.versions);
        head.record(1, 12);
        head.record(2, 1);
        head.record(3, 99);
        head.budget.on_request(10);
        let mut want = h.clone();
        want.versions[1] = 12;
        want.budget.on_request(10);
        assert_eq!(head.into_bytes(), want.encode());
        let mut long = h.encode();
        long.push(0);
        assert_eq!(groups::Head::decode(long), None);
        let mut short = h.encode();
        short.pop();
        assert_eq!(groups::Head::decode(short), None);
    }

    #[test]
    fn one_entry_reads_and_writes_alone_found_by_id() {
        let cfg = two(&["a", "b", "c"]);
        let store = MemStore::new();
        let mut t = Table::aligned(None, &cfg);
        t.entries[1].1.total = 5;
        t.write_to(&store);
        let (id_b, id_c) = (t.entries[1].0, t.entries[2].0);
        assert_eq!(groups::read_entry(&store, 1, id_b), Some(t.entries[1].1));
        assert_eq!(
            groups::read_entry(&store, 1, id_c),
            None,
            "another id there"
        );
        assert_eq!(groups::read_entry(&store, 3, id_b), None, "out of range");
        // Found by id in another configuration's layout: b at index 0, c kept.
        let other = two(&["b", "c"]);
        Table::read(&store, &other).write_to(&store);
        assert_eq!(groups::read_entry(&store, 0, id_b), Some(t.entries[1].1));
        let w = groups::update_entry(
            &store,
            Some(1),
            id_b,
            |st| {
                st.in_flight = 4;
                true
            },
            |_| {},
        );
        assert_eq!(w, Some(Ok(true)), "hint wrong: found by id");
        assert!(Table::has_layout(&store, &other));
        assert_eq!(Table::read(&store, &other).entries[0].1.in_flight, 4);
        assert_eq!(Table::read(&store, &other).entries[1].0, id_c);
        // No change: nothing written.
        let writes = store.writes.get();
        let w = groups::update_entry(&store, Some(0), id_b, |_| false, |_| {});
        assert_eq!(w, Some(Ok(false)));
        assert_eq!(store.writes.get(), writes);
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
        assert_eq!(
            group_key(3),
            format!("computeflux/endpoints/{TABLE_VERSION}/g3")
        );
    }

    /// An older generation's write keeps the newer layout and generation, changes only its own
    /// changed entries (by id) and the budget; a newer or equal generation lays it out anew.
    #[test]
    fn older_generation_patches_by_id_and_never_relays_out() {
        let store = MemStore::new();
        let mut new = two(&["b", "a", "d"]);
        new.layout_generation = 2;
        let mut old = two(&["a", "b", "c"]);
        old.layout_generation = 1;
        let mut t = Table::aligned(None, &new);
        t.generation = 2;
        t.entries[2].1.breaker.state = BreakerState::Open;
        t.entries[0].1.total = 7;
        t.write_to(&store);
        // The old writer sees its layout: a and b from the table, c fresh.
        let (mut mine, same) = Table::load_from(&store, &old);
        assert!(!same);
        assert_eq!(mine.entries[1].1.total, 7);
        mine.entries[0].1.total = 3;
        mine.entries[2].1.total = 9;
        assert!(groups::lay_out(&store, &mine, &[0, 2], |b| b.on_request(5)));
        assert!(Table::has_layout(&store, &new));
        let back = groups::read_stored(&store).unwrap().0;
        assert_eq!(back.generation, 2);
        assert_eq!(back.entries[1].1.total, 3, "a patched by id");
        assert_eq!(back.entries[0].1.total, 7, "b kept");
        assert_eq!(
            back.entries[2].1.breaker.state,
            BreakerState::Open,
            "d kept"
        );
        assert!(back.budget.requests > 0.0);
        // The newer configuration itself (or a later one) writes its own layout.
        let mut newer = two(&["a", "c"]);
        newer.layout_generation = 3;
        let relaid = Table::load_from(&store, &newer).0;
        assert!(groups::lay_out(&store, &relaid, &[], |_| {}));
        assert!(Table::has_layout(&store, &newer));
        assert_eq!(groups::read_stored(&store).unwrap().0.generation, 3);
        assert_eq!(
            Table::read(&store, &newer).entries[0].1.total,
            3,
            "a kept by id"
        );
        // Equal generations (never claimed: tests and tools) keep the old rule, last writer's
        // layout.
        let (a, b) = (two(&["a"]), two(&["b"]));
        let s2 = MemStore::new();
        Table::aligned(None, &a).write_to(&s2);
        assert!(groups::lay_out(&s2, &Table::read(&s2, &b), &[], |_| {}));
        assert!(Table::has_layout(&s2, &b));
    }

    /// A fleet that shrinks (a pool's hosts left): the groups the smaller layout no longer
    /// uses are emptied, so their departed endpoints' entries do not stay in shared data; the
    /// keys stay (Envoy never frees one). Growing again reuses them, versions moving up.
    #[test]
    fn a_smaller_layout_empties_the_groups_it_no_longer_uses() {
        let store = MemStore::new();
        let names: Vec<String> = (0..1_000).map(|i| format!("h{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let big = two(&refs);
        assert_eq!(claim_layout(&store, &big), 1);
        let bytes = |s: &MemStore| -> usize {
            (0..groups::groups(1_000))
                .map(|g| s.get(&group_key(g)).0.map_or(0, |b| b.len()))
                .sum()
        };
        let full = bytes(&store);
        let keys = store.keys();
        let small = two(&["h0"]);
        assert_eq!(claim_layout(&store, &small), 2);
        assert_eq!(store.keys(), keys, "no key added");
        // Group 0 holds h0; the other 62 are empty groups (13 bytes each).
        let one = store.get(&group_key(0)).0.unwrap().len();
        assert_eq!(bytes(&store), one + 62 * 13, "was {full}");
        assert!(Table::has_layout(&store, &small));
        assert_eq!(Table::read(&store, &small).entries.len(), 1);
        // Back to 1 000: every group laid out again, readable, versions above the emptied ones.
        assert_eq!(claim_layout(&store, &big), 3);
        assert!(Table::has_layout(&store, &big));
        let (t, complete) = groups::read_stored(&store).unwrap();
        assert!(complete);
        assert_eq!(t.entries.len(), 1_000);
        assert_eq!(bytes(&store), full);
    }

    #[test]
    fn claim_is_idempotent_per_layout_and_orders_layouts() {
        let store = MemStore::new();
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
        assert!(Table::has_layout(&store, &b));
        assert_eq!(claim_layout(&store, &a), 3);
        // An undecodable header: a fresh table at generation 1.
        store.set(TABLE_KEY, b"junk", None).unwrap();
        assert_eq!(claim_layout(&store, &b), 1);
        assert!(Table::has_layout(&store, &b));
    }
}
