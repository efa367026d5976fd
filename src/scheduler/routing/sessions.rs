//! Sessions placed per endpoint: the bound that spreads a busy prefix home by the sessions it
//! was given, not by the requests it runs now.
//!
//! Why: placement by prefix sends an application's new sessions to one home. The in-flight
//! bound of [`super::placement`] reads the load *now* (the engines' scrape of the last second,
//! or in-flight counts), but a session placed now brings its load later: every later turn comes
//! back to where it was placed. On the bench's `mixed_prefix` (200 six-turn sessions arriving
//! within 10 s, 8 shared system prompts, Zipf) the popular applications' homes took 57–59
//! sessions each against 28 for the fourth endpoint while their scraped load still looked
//! fine; by the time it did not, the sessions were there and came back, and the p99 was
//! 1.4–1.5× that of placement by session key. Tighter in-flight bounds did not fix it (see
//! `docs/decisions.md`, "Bounding a busy prefix home by the sessions placed there").
//!
//! **The count** ([`Placed`]): per configured endpoint id, the new sessions (first turns
//! without a pin: by prefix or by session key) this Envoy process placed there, fading with a
//! half-life of `prefix_session_half_life_ms` (a session's later turns keep coming for about
//! as long as it lives; the count is of recent placements, not of live pins, which no process
//! can enumerate cheaply). One shared-data value under [`SESSIONS_KEY`], so every worker of the
//! process adds to it; entries of endpoints no longer configured are dropped on write.
//!
//! **The bound** ([`session_limit`]): a new session placed by prefix passes over a candidate
//! whose count would exceed `(1 + prefix_session_epsilon) × (S + 1) × w / Σw` (S: the count
//! over the walk's candidates, w its placement weight) plus [`SESSION_SLACK`] (2) — the
//! bounded-load formula over sessions instead of requests, so some candidate is always
//! within it — **while that
//! candidate is busy** ([`busy`]: its load at least `prefix_session_busy_load`, 8 by default,
//! or half its known slots if that is less). An idle fleet gains nothing from spreading an application's
//! sessions and would lose the cache that keeping them together buys (the bench's
//! `shared_prefix` runs its endpoints far below their slots with one holding 37 % of the
//! sessions): only a busy home spills by count.
//!
//! **Where the spill goes** (`prefix_session_spill`, default `least_counted`): to the candidate
//! that would take the session (admitted, healthy, not saturated, within its bounded load)
//! with the fewest sessions counted per unit of placement weight, ties in the prefix's
//! rendezvous order — not to the next endpoint of the prefix's order, which is as often
//! another popular application's busy home. The counts are of every model's sessions, so an
//! endpoint that also serves a second model looks as full as it is, and the first model's
//! spills fill the endpoints the second leaves. On the bench's `mixed_prefix` the popular
//! applications' homes were `a`, `b` and `d`; `c` was no one's, and spills in prefix order
//! reached it last (39 sessions at the end against 51–55). (`prefix_order`, the rule before, is
//! kept for comparison; see `docs/decisions.md`.)
//!
//! **A popular prefix is bounded before its home is busy** (`prefix_popular_share`): the
//! busy test keeps an idle fleet's applications together, but it also lets the homes of the
//! most popular applications take far more than their share of new sessions before any load
//! shows it. On the bench's `shared_prefix` the draw put the two most popular applications
//! (a third of the sessions) on one endpoint with 15 others: it ran 47 % of the requests and
//! its cache churned the rarer prompts out; on `mixed_prefix` the imbalance is made in the
//! first three seconds, before any home is busy. So the value also counts the new sessions
//! per prefix key ([`PREFIX_ENTRIES`] heaviest, by the Space-Saving algorithm of Metwally,
//! Agrawal and El Abbadi, 2005, fading like the endpoints' counts): a prefix whose sessions
//! alone are at least `prefix_popular_share` of a candidate's share (its count's lower bound
//! at least `prefix_popular_share × S × w / Σw`, and at least [`SESSION_SLACK`]) is bounded
//! there as soon as the candidate runs anything (a load of 1 instead of
//! `prefix_session_busy_load`; an idle one gains nothing from a spill). Spreading a popular prompt costs little (it
//! stays hot in every cache it reaches); spreading a rare one costs a prefill per session,
//! and rare prefixes keep the busy test.
//!
//! **Replicas**: each counts its own placements, so each sees about a third of the sessions
//! with three replicas; the bound compares shares, which agree between replicas up to that
//! sampling, not exactly. The busy test reads the engines' scraped load where known, the same
//! on every replica. A session spilled by one replica is pinned there; its next turn on
//! another replica follows the pin cookie (`pin_cookie`) or, without it, goes to the prefix's
//! home as a pin would (its instructions are cached there, its own turn is not). Pinned
//! sessions never move for this bound: it reads only new sessions' walks.

use crate::scheduler::config::Config;
use crate::scheduler::state::codec::{Reader, Writer};
use crate::scheduler::state::store::{update_if, Store};

/// The shared-data key of [`Placed`].
pub const SESSIONS_KEY: &str = "computeflux/sessions";

const VERSION: u8 = 2;
/// Per entry: id (u32), count (f64).
const ENTRY_BYTES: usize = 4 + 8;
/// Per prefix entry: key (u64), count (f64), error (f64).
const PREFIX_ENTRY_BYTES: usize = 8 + 8 + 8;
/// The prefix keys counted (the heaviest, see [`Placed::add`]): a prefix with more than
/// 1/32 of the sessions counted is always among them.
pub const PREFIX_ENTRIES: usize = 32;

/// The new sessions this Envoy process placed per endpoint id, as of `at_ms`.
///
/// Codec (little-endian): version `2` (u8), `at_ms` (u64), entry count (u32), then per entry
/// in strictly increasing id order: id (u32), count (f64, finite, ≥ 0); then the prefix entry
/// count (u32, at most [`PREFIX_ENTRIES`]) and per prefix entry in strictly increasing key
/// order: key (u64), count (f64, finite, ≥ 0), error (f64, finite, between 0 and the count).
/// Anything else decodes as `None` (read as nothing placed).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Placed {
    /// When the counts were last faded to.
    at_ms: u64,
    /// Sorted by id, ids distinct.
    entries: Vec<(u32, f64)>,
    /// New sessions per prefix key, `(key, count, error)`, sorted by key, keys distinct: the
    /// Space-Saving summary (a key's true count lies between `count - error` and `count`).
    prefixes: Vec<(u64, f64, f64)>,
}

/// The factor by which a count fades over `elapsed_ms` with `half_life_ms` (1 for a half-life
/// of 0, which never reaches here: the bound is off).
fn fade(elapsed_ms: u64, half_life_ms: u64) -> f64 {
    if half_life_ms == 0 || elapsed_ms == 0 {
        return 1.0;
    }
    (-(elapsed_ms as f64) / half_life_ms as f64).exp2()
}

impl Placed {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(
            17 + self.entries.len() * ENTRY_BYTES + self.prefixes.len() * PREFIX_ENTRY_BYTES,
        );
        w.u8(VERSION);
        w.u64(self.at_ms);
        w.u32(u32::try_from(self.entries.len()).unwrap_or(u32::MAX));
        for (id, n) in &self.entries {
            w.u32(*id);
            w.f64(*n);
        }
        w.u32(u32::try_from(self.prefixes.len()).unwrap_or(u32::MAX));
        for (key, n, err) in &self.prefixes {
            w.u64(*key);
            w.f64(*n);
            w.f64(*err);
        }
        w.buf
    }

    pub fn decode(bytes: &[u8]) -> Option<Placed> {
        let mut r = Reader::new(bytes);
        if r.u8()? != VERSION {
            return None;
        }
        let at_ms = r.u64()?;
        let n = usize::try_from(r.u32()?).ok()?;
        if r.remaining() < n.checked_mul(ENTRY_BYTES)? {
            return None;
        }
        let mut entries: Vec<(u32, f64)> = Vec::with_capacity(n);
        for _ in 0..n {
            let id = r.u32()?;
            if entries.last().is_some_and(|(last, _)| *last >= id) {
                return None;
            }
            let count = r.f64()?;
            if !count.is_finite() || count < 0.0 {
                return None;
            }
            entries.push((id, count));
        }
        let k = usize::try_from(r.u32()?).ok()?;
        if k > PREFIX_ENTRIES || r.remaining() != k.checked_mul(PREFIX_ENTRY_BYTES)? {
            return None;
        }
        let mut prefixes: Vec<(u64, f64, f64)> = Vec::with_capacity(k);
        for _ in 0..k {
            let key = r.u64()?;
            if prefixes.last().is_some_and(|(last, _, _)| *last >= key) {
                return None;
            }
            let (count, err) = (r.f64()?, r.f64()?);
            if !count.is_finite()
                || count < 0.0
                || !err.is_finite()
                || !(0.0..=count).contains(&err)
            {
                return None;
            }
            prefixes.push((key, count, err));
        }
        Some(Placed {
            at_ms,
            entries,
            prefixes,
        })
    }

    /// Endpoint `id`'s count as stored (not faded).
    fn get(&self, id: u32) -> f64 {
        self.entries
            .binary_search_by_key(&id, |(k, _)| *k)
            .ok()
            .and_then(|i| self.entries.get(i))
            .map_or(0.0, |(_, n)| *n)
    }

    /// The lower bound of prefix `key`'s count as stored (not faded): 0 for a key not held.
    fn prefix_floor(&self, key: u64) -> f64 {
        self.prefixes
            .binary_search_by_key(&key, |(k, _, _)| *k)
            .ok()
            .and_then(|i| self.prefixes.get(i))
            .map_or(0.0, |(_, n, err)| (n - err).max(0.0))
    }

    /// The counts as of `now_ms`, for one decision.
    pub fn at(self, cfg: &Config, now_ms: u64) -> Counts {
        let fade = fade(
            now_ms.saturating_sub(self.at_ms),
            cfg.prefix_session_half_life_ms,
        );
        Counts {
            placed: self,
            fade,
            prefix: 0.0,
        }
    }

    /// Counts one new session of prefix `key` (the counts already faded to now): Space-Saving
    /// — a held key adds 1; a new key takes a free entry at 1, or, all [`PREFIX_ENTRIES`]
    /// held, replaces the entry of the least count `m` at `m + 1` with error `m` (so a key's
    /// count never undercounts it, and its count less its error never overcounts it).
    fn add_prefix(&mut self, key: u64) {
        match self.prefixes.binary_search_by_key(&key, |(k, _, _)| *k) {
            Ok(at) => {
                if let Some((_, n, _)) = self.prefixes.get_mut(at) {
                    *n += 1.0;
                }
            }
            Err(at) if self.prefixes.len() < PREFIX_ENTRIES => {
                self.prefixes.insert(at, (key, 1.0, 0.0));
            }
            Err(_) => {
                let least = self
                    .prefixes
                    .iter()
                    .enumerate()
                    .min_by(|(_, x), (_, y)| x.1.total_cmp(&y.1))
                    .map(|(i, &(_, n, _))| (i, n));
                if let Some((i, m)) = least {
                    self.prefixes.remove(i);
                    let at = self
                        .prefixes
                        .binary_search_by_key(&key, |(k, _, _)| *k)
                        .unwrap_or_else(|at| at);
                    self.prefixes.insert(at, (key, m + 1.0, m));
                }
            }
        }
    }

    /// Counts one session placed on endpoint `id` at `now_ms`: every count is faded to
    /// `now_ms` first (a clock that went back fades nothing). Entries of endpoints no longer
    /// configured are dropped once there are more entries than the `configured` ids (a reload
    /// that removed some; the ids are asked for only then), so the value never holds more
    /// than one entry over the fleet.
    /// With `prefix`, the session's prefix key is counted too (see [`Placed::add_prefix`]).
    pub fn add(
        &mut self,
        id: u32,
        prefix: Option<u64>,
        now_ms: u64,
        half_life_ms: u64,
        configured: (usize, impl FnOnce() -> Vec<u32>),
    ) {
        let f = fade(now_ms.saturating_sub(self.at_ms), half_life_ms);
        self.at_ms = self.at_ms.max(now_ms);
        for (_, n) in &mut self.entries {
            *n *= f;
        }
        if f < 1.0 {
            for (_, n, err) in &mut self.prefixes {
                *n *= f;
                *err *= f;
            }
        }
        if let Some(key) = prefix {
            self.add_prefix(key);
        }
        match self.entries.binary_search_by_key(&id, |(k, _)| *k) {
            Ok(at) => {
                if let Some((_, n)) = self.entries.get_mut(at) {
                    *n += 1.0;
                }
            }
            Err(at) => self.entries.insert(at, (id, 1.0)),
        }
        let (count, ids) = configured;
        if self.entries.len() > count {
            let mut keep = ids();
            keep.sort_unstable();
            self.entries
                .retain(|(k, _)| *k == id || keep.binary_search(k).is_ok());
        }
    }
}

/// The counts one decision reads: stored ones and their fade to the decision's time.
#[derive(Debug, Clone, PartialEq)]
pub struct Counts {
    placed: Placed,
    fade: f64,
    /// The decision's prefix key's count (its lower bound), faded; 0 until [`Counts::for_prefix`].
    prefix: f64,
}

impl Counts {
    /// Endpoint `id`'s count, faded (0 for an endpoint without one).
    pub fn of(&self, id: u32) -> f64 {
        self.placed.get(id) * self.fade
    }

    /// The counts for a decision about a session of prefix `key`: [`Counts::prefix`] reads
    /// its count.
    pub fn for_prefix(mut self, key: Option<u64>) -> Counts {
        self.prefix = key.map_or(0.0, |k| self.placed.prefix_floor(k) * self.fade);
        self
    }

    /// The new sessions of the decision's prefix counted (at least; faded).
    pub fn prefix(&self) -> f64 {
        self.prefix
    }
}

/// The stored counts (absent or undecodable: nothing placed).
pub fn read(store: &dyn Store) -> Placed {
    store
        .get(SESSIONS_KEY)
        .0
        .as_deref()
        .and_then(Placed::decode)
        .unwrap_or_default()
}

/// Counts one new session placed on endpoint `id`, and its `prefix` key where
/// `prefix_popular_share` reads them. A lost CAS race loses one count (bounded retries); false
/// then.
pub fn record(store: &dyn Store, cfg: &Config, id: u32, prefix: Option<u64>, now_ms: u64) -> bool {
    let ids = || cfg.endpoints.iter().map(|e| e.id).collect();
    let prefix = prefix.filter(|_| cfg.prefix_popular_share > 0.0);
    update_if(store, SESSIONS_KEY, |bytes| {
        let mut placed = bytes.and_then(Placed::decode).unwrap_or_default();
        let configured = (cfg.endpoints.len(), ids);
        placed.add(
            id,
            prefix,
            now_ms,
            cfg.prefix_session_half_life_ms,
            configured,
        );
        (Some(placed.encode()), true)
    })
    .unwrap_or(false)
}

/// The sessions a busy candidate may hold beyond its share, so that a process that has
/// placed few sessions (just started, or a large fleet's share below one session) does not
/// pass over every busy home for the first session counted there.
pub const SESSION_SLACK: f64 = 2.0;

/// The sessions a candidate may hold *after* taking one more: `(1 + epsilon) × (S + 1) ×`
/// its weight share + [`SESSION_SLACK`], given `total_sessions` (S) over the walk's
/// candidates.
pub fn session_limit(total_sessions: f64, weight: f64, total_weight: f64, epsilon: f64) -> f64 {
    let share = if total_weight > 0.0 {
        weight / total_weight
    } else {
        0.0
    };
    (1.0 + epsilon.max(0.0)) * (total_sessions.max(0.0) + 1.0) * share + SESSION_SLACK
}

/// Whether the prefix with `prefix_count` new sessions counted is popular at a candidate whose
/// share of the `total_sessions` (S) is `weight / total_weight`: at least `popular_share`
/// (`prefix_popular_share`; 0: never) of that share, and at least [`SESSION_SLACK`].
pub fn popular(
    prefix_count: f64,
    total_sessions: f64,
    weight: f64,
    total_weight: f64,
    popular_share: f64,
) -> bool {
    if popular_share <= 0.0 || total_weight <= 0.0 {
        return false;
    }
    let share = popular_share * total_sessions.max(0.0) * weight / total_weight;
    prefix_count >= share.max(SESSION_SLACK)
}

/// Whether an endpoint with `load` (running + waiting, or in flight: the load the bounded
/// load reads) and `slots` (0: unknown) is busy enough for the session bound to apply: at
/// least `busy_load` (`prefix_session_busy_load`), or half its slots if that is less.
pub fn busy(load: u32, slots: u32, busy_load: u64) -> bool {
    let threshold = match slots {
        0 => busy_load,
        s => busy_load.min(u64::from(s).div_ceil(2)),
    };
    u64::from(load) >= threshold
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::state::store::MemStore;
    use serde_json::json;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn cfg() -> Config {
        Config::from_value(&json!({"endpoints":[
            {"name":"a","cluster":"a"},{"name":"b","cluster":"b"}
        ]}))
        .unwrap()
    }

    #[test]
    fn counts_fade_with_their_half_life_and_round_trip() {
        let c = cfg();
        let (a, b) = (c.endpoints[0].id, c.endpoints[1].id);
        let store = MemStore::new();
        let h = c.prefix_session_half_life_ms;
        assert!(record(&store, &c, a, None, 1_000));
        assert!(record(&store, &c, a, None, 1_000));
        assert!(record(&store, &c, b, None, 1_000 + h));
        // a's two faded by one half-life, b's one fresh.
        let n = read(&store).at(&c, 1_000 + h);
        assert!(
            (n.of(a) - 1.0).abs() < 1e-9 && (n.of(b) - 1.0).abs() < 1e-9,
            "{n:?}"
        );
        let n = read(&store).at(&c, 1_000 + 2 * h);
        assert!(
            (n.of(a) - 0.5).abs() < 1e-9 && (n.of(b) - 0.5).abs() < 1e-9,
            "{n:?}"
        );
        assert_eq!(n.of(a ^ b ^ 1), 0.0);
        // A clock behind the record fades nothing.
        let n = read(&store).at(&c, 0);
        assert_eq!((n.of(a), n.of(b)), (1.0, 1.0));
        let p = read(&store);
        assert_eq!(Placed::decode(&p.encode()), Some(p.clone()));
        assert_eq!(p.encode().len(), 17 + 2 * ENTRY_BYTES);
    }

    #[test]
    fn entries_stay_bounded_by_the_configuration_and_bad_bytes_read_as_nothing() {
        let mut p = Placed::default();
        p.add(9, None, 0, 1_000, (2, || vec![9, 3]));
        p.add(3, None, 0, 1_000, (2, || vec![9, 3]));
        // Endpoint 3 removed, 5 added: 3 is dropped once the entries outnumber the fleet.
        p.add(5, None, 0, 1_000, (2, || vec![9, 5]));
        p.add(9, None, 0, 1_000, (2, || vec![9, 5]));
        assert_eq!(p.entries, vec![(5, 1.0), (9, 2.0)]);
        let bytes = p.encode();
        assert_eq!(Placed::decode(&bytes[..bytes.len() - 1]), None);
        let mut v1 = bytes.clone();
        v1[0] = 1;
        assert_eq!(Placed::decode(&v1), None);
        let mut negative = bytes.clone();
        let at = negative.len() - 4 - 8;
        negative[at..at + 8].copy_from_slice(&(-1.0f64).to_le_bytes());
        assert_eq!(Placed::decode(&negative), None);
        let mut unsorted = bytes.clone();
        unsorted[13..17].copy_from_slice(&9u32.to_le_bytes());
        assert_eq!(Placed::decode(&unsorted), None);
        let store = MemStore::new();
        store.set(SESSIONS_KEY, &[1, 2, 3], None).ok();
        assert_eq!(read(&store), Placed::default());
    }

    /// The prefix counts (Space-Saving): at most [`PREFIX_ENTRIES`] keys; a heavy key among
    /// a stream of one-off keys is held with a lower bound that never overcounts it and a
    /// count that never undercounts it; one-off keys read at most what they were counted;
    /// the counts fade with the endpoints'; the value round-trips and a bad entry reads as
    /// nothing.
    #[test]
    fn prefix_counts_keep_the_heavy_keys_within_their_bound() {
        let mut p = Placed::default();
        let ids = || vec![1];
        let heavy = 0x5eed_u64;
        for n in 0..400u64 {
            let key = if n % 4 == 0 { heavy } else { 1_000 + n };
            p.add(1, Some(key), 0, 1_000, (1, ids));
        }
        assert_eq!(p.prefixes.len(), PREFIX_ENTRIES);
        let (_, count, err) = p
            .prefixes
            .iter()
            .copied()
            .find(|(k, _, _)| *k == heavy)
            .expect("the heavy key is held");
        assert!(count >= 100.0 && count - err <= 100.0, "{count} {err}");
        assert!(p.prefix_floor(heavy) >= 50.0, "{}", p.prefix_floor(heavy));
        assert!(p
            .prefixes
            .iter()
            .all(|(k, n, e)| *k == heavy || n - e <= 1.0));
        assert_eq!(p.prefix_floor(7), 0.0);
        // Faded by one half-life with the next session (not of a prefix).
        let floor = p.prefix_floor(heavy);
        p.add(1, None, 1_000, 1_000, (1, ids));
        assert!((p.prefix_floor(heavy) - floor / 2.0).abs() < 1e-9);
        let c = cfg();
        let counts = p.clone().at(&c, 1_000).for_prefix(Some(heavy));
        assert!((counts.prefix() - floor / 2.0).abs() < 1e-9);
        assert_eq!(p.clone().at(&c, 1_000).prefix(), 0.0);
        let bytes = p.encode();
        assert_eq!(
            bytes.len(),
            17 + ENTRY_BYTES + PREFIX_ENTRIES * PREFIX_ENTRY_BYTES
        );
        assert_eq!(Placed::decode(&bytes), Some(p.clone()));
        // An error above its count, keys out of order: nothing.
        let first = 17 + ENTRY_BYTES;
        let mut bad = bytes.clone();
        bad[first + 16..first + 24].copy_from_slice(&1e9f64.to_le_bytes());
        assert_eq!(Placed::decode(&bad), None);
        let mut unsorted = bytes.clone();
        unsorted[first..first + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(Placed::decode(&unsorted), None);
        // Popular: at least the share and the slack.
        assert!(popular(10.0, 22.0, 1.0, 5.0, 0.5));
        assert!(!popular(2.0, 23.0, 1.0, 5.0, 0.5), "2 < 2.3");
        assert!(!popular(1.5, 0.0, 1.0, 5.0, 0.5), "below the slack");
        assert!(!popular(100.0, 100.0, 1.0, 5.0, 0.0), "off");
    }

    /// Worked: four endpoints of weight 1, 60 sessions counted over them, ε 0.25: a candidate
    /// may hold 1.25 × 61 / 4 + 2 = 21.06 after one more, so one holding 21 spills and one
    /// holding 20 takes it. A process that counted nothing yet lets a busy home take two.
    #[test]
    fn session_limit_worked_numbers() {
        let l = session_limit(60.0, 1.0, 4.0, 0.25);
        assert!((l - 21.0625).abs() < 1e-9);
        assert!((21.0..22.0).contains(&l), "21 + 1 over it, 20 + 1 within");
        assert_eq!(session_limit(60.0, 1.0, 0.0, 0.25), SESSION_SLACK);
        assert!(session_limit(0.0, 1.0, 512.0, 0.25) >= 2.0);
        // The limits of all candidates add up to more than S: one is always within.
        let total: f64 = (0..4).map(|_| session_limit(60.0, 1.0, 4.0, 0.0)).sum();
        assert!(total > 60.0);
    }

    #[test]
    fn busy_at_the_busy_load_or_half_the_slots() {
        assert!(!busy(7, 16, 8) && busy(8, 16, 8));
        assert!(!busy(7, 0, 8) && busy(8, 0, 8));
        assert!(!busy(1, 4, 8) && busy(2, 4, 8));
        assert!(!busy(3, 16, 4) && busy(4, 16, 4));
        assert!(busy(0, 0, 0) && busy(0, 16, 0));
    }
}
