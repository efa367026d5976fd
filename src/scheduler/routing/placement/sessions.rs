//! Sessions placed per endpoint: the bound that spreads a busy prefix home by the sessions it
//! was given, not by the requests it runs now.
//!
//! Why: placement by prefix sends an application's new sessions to one home. The in-flight
//! bound of [`crate::scheduler::routing::placement`] reads the load *now* (the engines' scrape of the last second,
//! or in-flight counts), but a session placed now brings its load later: every later turn comes
//! back to where it was placed. On the bench's `mixed_prefix` (200 six-turn sessions arriving
//! within 10 s, 8 shared system prompts, Zipf) the popular applications' homes took 57–59
//! sessions each against 28 for the fourth endpoint while their scraped load still looked
//! fine; by the time it did not, the sessions were there and came back, and the p99 was
//! 1.4–1.5× that of placement by session key. Tighter in-flight bounds did not fix it (see
//! `docs/routing.md`, "Bounding a busy prefix home by the sessions placed there").
//!
//! **The count** ([`Placed`]): per configured endpoint id, the new sessions (first turns
//! without a pin: by prefix or by session key) this Envoy process placed there, fading with a
//! half-life of [`SESSION_HALF_LIFE_MS`] (a session's later turns keep coming for about
//! as long as it lives; the count is of recent placements, not of live pins, which no process
//! can enumerate cheaply). One shared-data value under [`SESSIONS_KEY`], so every worker of the
//! process adds to it; entries of endpoints no longer configured are dropped on write. The
//! fading is forward decay (a session counted at `t` weighs `2^((t - at_ms) / half-life)`
//! against the value's reference time; see [`Placed`]), so that counting a session changes
//! only its own entry, in place in the stored bytes ([`add_in_place`]): read, counted and
//! written once per new session without decoding the value.
//!
//! **The bound** ([`session_limit`]): a new session placed by prefix passes over a candidate
//! whose count would exceed `(1 + SESSION_EPSILON) × (S + 1) × w / Σw` (S: the count
//! over the walk's candidates, w its placement weight) plus [`SESSION_SLACK`] (2) — the
//! bounded-load formula over sessions instead of requests, so some candidate is always
//! within it — **while that
//! candidate is busy** ([`busy`]: its load at least [`SESSION_BUSY_LOAD`], 8, or half its
//! known slots if that is less). An idle fleet gains nothing from spreading an application's
//! sessions and would lose the cache that keeping them together buys (the bench's
//! `shared_prefix` runs its endpoints far below their slots with one holding 37 % of the
//! sessions): only a busy home spills by count.
//!
//! **Where the spill goes**: to the candidate
//! that would take the session (admitted, healthy, not saturated, within its bounded load)
//! with the fewest sessions counted per unit of placement weight, ties in the prefix's
//! rendezvous order — not to the next endpoint of the prefix's order, which is as often
//! another popular application's busy home. The counts are of every model's sessions, so an
//! endpoint that also serves a second model looks as full as it is, and the first model's
//! spills fill the endpoints the second leaves. On the bench's `mixed_prefix` the popular
//! applications' homes were `a`, `b` and `d`; `c` was no one's, and spills in prefix order
//! reached it last (39 sessions at the end against 51–55; the next of the prefix's order, the
//! rule before, measured no better anywhere and a worse p99 with three replicas: see
//! `docs/adr/0003-session-bound-for-busy-prefix-homes.md`).
//!
//! **Replicas**: each counts its own placements, so each sees about a third of the sessions
//! with three replicas; the bound compares shares, which agree between replicas up to that
//! sampling, not exactly. The busy test reads the engines' scraped load where known, the same
//! on every replica. Where no engine is scraped the loads are each replica's own in-flight
//! counts, a third of the engine's too, so both tests are scale-free there ([`busy_by_share`],
//! [`own_session_limit`]): with busy at 8 and the slack of 2 added, three replicas judged the
//! home of the most popular application busy at three times the load one Envoy did (mixed
//! fleet without metrics: p99 2.6–3.1 s against 1.4 s; now 1.2–1.3 s, ADR 0003's note). A session spilled by one replica is pinned there; its next turn on
//! another replica follows the pin cookie (`pin_cookie`) or, without it, goes to the prefix's
//! home as a pin would (its instructions are cached there, its own turn is not). Pinned
//! sessions never move for this bound: it reads only new sessions' walks.

use crate::scheduler::config::Config;
use crate::scheduler::state::codec::{Reader, Writer};
use crate::scheduler::state::store::{update_owned, Store};

/// Half-life of the per-endpoint count of new sessions that the session bound reads (about
/// how long a session keeps sending turns). Not a key: the measured default.
pub const SESSION_HALF_LIFE_MS: u64 = 60_000;

/// The session bound's epsilon: a new session placed by prefix passes over a busy candidate
/// whose count of recent new sessions would exceed `(1 + epsilon) ×` its weighted share of
/// those placed on the candidates (plus [`SESSION_SLACK`]). A session's later turns come back
/// where it was placed, so a home that took more than its share keeps its load long after the
/// load it showed at the placement. Not a key: the measured default (ε 0 spilled more for no
/// clearer gain; `docs/adr/0003-session-bound-for-busy-prefix-homes.md`).
pub const SESSION_EPSILON: f64 = 0.25;

/// The load (its engine's scraped running + waiting where known, else the in-flight attempts
/// this Envoy counts) from which an endpoint is busy enough for the session bound to pass over
/// it; with known slots, at most half of them. Below it a prefix home takes every new session
/// of its prefixes, however many it was given: an idle fleet is never spread. Not a key: the
/// measured default (busy 4 and 0 cost `shared_prefix` cached tokens).
pub const SESSION_BUSY_LOAD: u64 = 8;

/// The shared-data key of [`Placed`], one per [`VERSION`]: modules of two versions running
/// side by side during an upgrade each keep their own counts instead of resetting each
/// other's.
pub const SESSIONS_KEY: &str = "computeflux/sessions/4";

const VERSION: u8 = 4;
/// Per entry: id (u32), count (f64).
const ENTRY_BYTES: usize = 4 + 8;

/// The new sessions this Envoy process placed per endpoint id, as of `at_ms`.
///
/// Codec (little-endian): version `4` (u8), `at_ms` (u64, the reference time), entry count
/// (u32), then per entry in strictly increasing id order: id (u32), count (f64, finite, ≥ 0).
/// Anything else decodes as `None` (read as nothing placed).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Placed {
    /// The reference time of the counts: each session is counted with weight
    /// `2^((t - at_ms) / half-life)` at its time `t` (forward decay), so that a count as of
    /// `now` is the stored one × `2^(-(now - at_ms) / half-life)` and a write changes only
    /// the entries it counts.
    at_ms: u64,
    /// Sorted by id, ids distinct.
    entries: Vec<(u32, f64)>,
}

/// The factor by which a count fades over `elapsed_ms` with `half_life_ms` (1 for a half-life
/// of 0, which never reaches here: the bound is off).
fn fade(elapsed_ms: u64, half_life_ms: u64) -> f64 {
    if half_life_ms == 0 || elapsed_ms == 0 {
        return 1.0;
    }
    (-(elapsed_ms as f64) / half_life_ms as f64).exp2()
}

/// Half-lives after the reference time past which the stored counts are rescaled to a new
/// reference (a session counted then weighs 2^32: far from the f64 range and its precision
/// for counts of a few thousand sessions).
const REBASE_HALF_LIVES: f64 = 32.0;

/// The weight of a session counted `elapsed_ms` after the reference time (forward decay:
/// `2^(elapsed / half-life)`, so that the stored counts never need fading on a write), or
/// `None` past [`REBASE_HALF_LIVES`] (and for the reference 0 of an empty value).
fn weight(elapsed_ms: u64, half_life_ms: u64) -> Option<f64> {
    if half_life_ms == 0 || elapsed_ms == 0 {
        return Some(1.0);
    }
    let half_lives = elapsed_ms as f64 / half_life_ms as f64;
    (half_lives <= REBASE_HALF_LIVES).then(|| half_lives.exp2())
}

impl Placed {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(HEADER_BYTES + self.entries.len() * ENTRY_BYTES);
        w.u8(VERSION);
        w.u64(self.at_ms);
        w.u32(u32::try_from(self.entries.len()).unwrap_or(u32::MAX));
        for (id, n) in &self.entries {
            w.u32(*id);
            w.f64(*n);
        }
        w.buf
    }

    pub fn decode(bytes: &[u8]) -> Option<Placed> {
        // Fixed-width entries read from exact chunks (one bounds check per entry, not per
        // field): decoded on every new session, so its instructions count (tests/cost).
        let mut r = Reader::new(bytes);
        if r.u8()? != VERSION {
            return None;
        }
        let at_ms = r.u64()?;
        let n = usize::try_from(r.u32()?).ok()?;
        let rest = r.rest();
        let (body, rest) = rest.split_at_checked(n.checked_mul(ENTRY_BYTES)?)?;
        let mut entries: Vec<(u32, f64)> = Vec::with_capacity(n);
        for e in body.chunks_exact(ENTRY_BYTES) {
            let (id, count) = e.split_first_chunk::<4>()?;
            let id = u32::from_le_bytes(*id);
            let count = f64::from_le_bytes(*count.first_chunk::<8>()?);
            if entries.last().is_some_and(|(last, _)| *last >= id)
                || !count.is_finite()
                || count < 0.0
            {
                return None;
            }
            entries.push((id, count));
        }
        if !rest.is_empty() {
            return None;
        }
        Some(Placed { at_ms, entries })
    }

    /// Endpoint `id`'s count as stored (not faded).
    #[cfg(test)]
    fn get(&self, id: u32) -> f64 {
        self.entries
            .binary_search_by_key(&id, |(k, _)| *k)
            .ok()
            .and_then(|i| self.entries.get(i))
            .map_or(0.0, |(_, n)| *n)
    }

    /// The counts as of `now_ms`, for one decision.
    pub fn at(self, now_ms: u64) -> Counts {
        Counts::of_bytes(Some(self.encode()), None, now_ms)
    }

    /// Counts one session placed on endpoint `id` at `now_ms` with its weight (see
    /// [`Placed::at_ms`]; a clock behind the reference counts 1); past
    /// [`REBASE_HALF_LIVES`] every count is faded to `now_ms`, the new reference, first. Entries of endpoints no longer
    /// configured are dropped once there are more entries than the `configured` ids (a reload
    /// that removed some; the ids are asked for only then), so the value never holds more
    /// than one entry over the fleet.
    pub fn add(
        &mut self,
        id: u32,
        now_ms: u64,
        half_life_ms: u64,
        configured: (usize, impl FnOnce() -> Vec<u32>),
    ) {
        let elapsed = now_ms.saturating_sub(self.at_ms);
        let w = match weight(elapsed, half_life_ms) {
            Some(w) => w,
            None => {
                // Rescaled to `now_ms` as the new reference (the counts faded to it).
                let f = fade(elapsed, half_life_ms);
                self.at_ms = now_ms;
                for (_, n) in &mut self.entries {
                    *n *= f;
                }
                1.0
            }
        };
        match self.entries.binary_search_by_key(&id, |(k, _)| *k) {
            Ok(at) => {
                if let Some((_, n)) = self.entries.get_mut(at) {
                    *n += w;
                }
            }
            Err(at) => self.entries.insert(at, (id, w)),
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

/// The counts one decision reads: the stored value's bytes (never decoded: a full table is
/// 1.5 KB, and decoding and encoding it on every new session cost more instructions than
/// the rest of placement by prefix; see [`add_in_place`]) and their fade to the decision's
/// time.
#[derive(Debug, Clone, PartialEq)]
pub struct Counts {
    /// A value of the right version and shape ([`shape`]; empty: nothing placed). Its
    /// entries are checked as they are read: a count that would not decode reads as 0.
    bytes: Vec<u8>,
    /// Its endpoint entry count.
    layout: Layout,
    fade: f64,
    /// The CAS token the counts were read with ([`read_counts`]), so that [`record_read`]
    /// writes the session counted on them without reading the value again.
    cas: Option<u32>,
}

impl Counts {
    /// Counts of `bytes` (as stored; undecodable: nothing placed) as of `now_ms`.
    fn of_bytes(bytes: Option<Vec<u8>>, cas: Option<u32>, now_ms: u64) -> Counts {
        let checked = bytes.and_then(|b| shape(&b).map(|l| (b, l)));
        let (bytes, layout, at_ms) = match checked {
            Some((b, l)) => {
                let at = u64_at(&b, 1).unwrap_or(0);
                (b, l, at)
            }
            None => (Vec::new(), Layout::EMPTY, 0),
        };
        Counts {
            bytes,
            layout,
            fade: fade(now_ms.saturating_sub(at_ms), SESSION_HALF_LIFE_MS),
            cas,
        }
    }

    /// Endpoint `id`'s count, faded (0 for an endpoint without one).
    pub fn of(&self, id: u32) -> f64 {
        self.layout
            .find_entry(&self.bytes, id)
            .ok()
            .and_then(|i| f64_at(&self.bytes, self.layout.entry(i) + 4))
            .filter(|n| n.is_finite() && *n >= 0.0)
            .map_or(0.0, |n| n * self.fade)
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

/// The stored counts as of `now_ms` with the CAS token they were read with (see
/// [`record_read`]).
pub fn read_counts(store: &dyn Store, now_ms: u64) -> Counts {
    let (bytes, cas) = store.get(SESSIONS_KEY);
    Counts::of_bytes(bytes, cas, now_ms)
}

/// [`record`] on the `counts` a decision read ([`read_counts`]): written with their CAS token,
/// so that the value is read once per new session; if another worker wrote in between,
/// [`record`] (read, count, write again).
pub fn record_read(store: &dyn Store, cfg: &Config, counts: Counts, id: u32, now_ms: u64) -> bool {
    let bytes = (!counts.bytes.is_empty()).then_some(counts.bytes);
    let value = counted(cfg, bytes, id, now_ms);
    match store.set(SESSIONS_KEY, &value, counts.cas) {
        Ok(()) => true,
        Err(_) => record(store, cfg, id, now_ms),
    }
}

/// Counts one new session placed on endpoint `id`. A lost CAS race loses one count (bounded
/// retries); false then.
pub fn record(store: &dyn Store, cfg: &Config, id: u32, now_ms: u64) -> bool {
    update_owned(store, SESSIONS_KEY, |bytes| {
        (Some(counted(cfg, bytes, id, now_ms)), true)
    })
    .unwrap_or(false)
}

/// The stored value `bytes` with one new session on `id` counted at `now_ms`: [`Placed::add`],
/// on the bytes in place where it can be ([`add_in_place`]; the same floating-point operations
/// in the same order, so the same value), else decoded and encoded.
fn counted(cfg: &Config, bytes: Option<Vec<u8>>, id: u32, now_ms: u64) -> Vec<u8> {
    let h = SESSION_HALF_LIFE_MS;
    let fleet = cfg.endpoints.len();
    let mut placed = match bytes {
        Some(mut b) => match add_in_place(&mut b, id, now_ms, h, fleet) {
            InPlace::Done => return b,
            InPlace::Prune => Placed::decode(&b).unwrap_or_default(),
            InPlace::Invalid => Placed::default(),
        },
        None => Placed::default(),
    };
    let ids = || cfg.endpoints.iter().map(|e| e.id).collect();
    placed.add(id, now_ms, h, (fleet, ids));
    placed.encode()
}

/// Where the entries of an encoded [`Placed`] are (checked by [`check`]).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Layout {
    /// Endpoint entries.
    n: usize,
}

/// Bytes before the first endpoint entry: version, `at_ms`, entry count.
const HEADER_BYTES: usize = 1 + 8 + 4;

impl Layout {
    const EMPTY: Layout = Layout { n: 0 };

    /// Offset of endpoint entry `i`.
    fn entry(&self, i: usize) -> usize {
        HEADER_BYTES + i * ENTRY_BYTES
    }

    /// Binary search of endpoint `id` (entries sorted by id): its index, or where it would go.
    fn find_entry(&self, bytes: &[u8], id: u32) -> Result<usize, usize> {
        let (mut lo, mut hi) = (0, self.n);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match u32_at(bytes, self.entry(mid)).map(|k| k.cmp(&id)) {
                Some(std::cmp::Ordering::Less) => lo = mid + 1,
                Some(std::cmp::Ordering::Greater) => hi = mid,
                Some(std::cmp::Ordering::Equal) => return Ok(mid),
                None => return Err(lo),
            }
        }
        Err(lo)
    }
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    bytes
        .get(at..)?
        .first_chunk::<4>()
        .map(|b| u32::from_le_bytes(*b))
}

fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    bytes
        .get(at..)?
        .first_chunk::<8>()
        .map(|b| u64::from_le_bytes(*b))
}

fn f64_at(bytes: &[u8], at: usize) -> Option<f64> {
    u64_at(bytes, at).map(f64::from_bits)
}

fn put_f64(bytes: &mut [u8], at: usize, v: f64) {
    if let Some(b) = bytes.get_mut(at..).and_then(|b| b.first_chunk_mut::<8>()) {
        *b = v.to_bits().to_le_bytes();
    }
}

/// The layout of `bytes` if [`Placed::decode`] would accept them: the same checks, without
/// decoding (a pass over the entries, no allocation).
#[cfg(test)]
fn check(bytes: &[u8]) -> Option<Layout> {
    let l = shape(bytes)?;
    let mut last = None;
    for i in 0..l.n {
        let (id, n) = (u32_at(bytes, l.entry(i))?, f64_at(bytes, l.entry(i) + 4)?);
        if last.is_some_and(|p| p >= id) || !n.is_finite() || n < 0.0 {
            return None;
        }
        last = Some(id);
    }
    Some(l)
}

/// The version and the lengths: the entry counts if they add up to the value's length.
fn shape(bytes: &[u8]) -> Option<Layout> {
    if *bytes.first()? != VERSION {
        return None;
    }
    let n = usize::try_from(u32_at(bytes, 9)?).ok()?;
    let len = n.checked_mul(ENTRY_BYTES)?.checked_add(HEADER_BYTES)?;
    (bytes.len() == len).then_some(Layout { n })
}

/// What [`add_in_place`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InPlace {
    /// Counted: the bytes are the new value.
    Done,
    /// The entries (with a new one for the endpoint) would outnumber the fleet (entries of
    /// removed endpoints to drop), or the counts are due to be rescaled
    /// ([`REBASE_HALF_LIVES`]): the bytes are unchanged, for [`Placed::add`].
    Prune,
    /// The bytes would not decode (they may be half changed): count on nothing placed.
    Invalid,
}

/// [`Placed::add`] on an encoded value, in place: the counted entries found by binary
/// search and raised by the session's weight, an entry inserted where it is new — the same
/// floating-point operations as
/// decoding, adding and encoding, so the same bytes (tested), without a pass over every
/// entry. Only the entries it reads are checked as [`Placed::decode`] checks them (and the
/// value's shape); a value written by this code is valid, and one of another version does not
/// get past the version byte.
fn add_in_place(
    bytes: &mut Vec<u8>,
    id: u32,
    now_ms: u64,
    half_life_ms: u64,
    fleet: usize,
) -> InPlace {
    let Some(l) = shape(bytes) else {
        return InPlace::Invalid;
    };
    let entry_at = l.find_entry(bytes, id);
    if l.n + usize::from(entry_at.is_err()) > fleet {
        return InPlace::Prune;
    }
    let at_ms = u64_at(bytes, 1).unwrap_or(0);
    let Some(w) = weight(now_ms.saturating_sub(at_ms), half_life_ms) else {
        return InPlace::Prune;
    };
    let count_at =
        |bytes: &[u8], at: usize| f64_at(bytes, at).filter(|n| n.is_finite() && *n >= 0.0);
    match entry_at {
        Ok(i) => {
            let at = l.entry(i) + 4;
            let Some(n) = count_at(bytes, at) else {
                return InPlace::Invalid;
            };
            put_f64(bytes, at, n + w);
        }
        Err(i) => {
            let mut e = [0u8; ENTRY_BYTES];
            e[..4].copy_from_slice(&id.to_le_bytes());
            e[4..].copy_from_slice(&w.to_bits().to_le_bytes());
            let at = l.entry(i);
            // Copied once into a value one entry longer (the bytes read fill their buffer
            // exactly: a splice grew it, a copy, then moved the tail up, a second one; each
            // about 1.5 instructions per byte of the value under wasm).
            let (head, tail) = bytes.split_at(at.min(bytes.len()));
            let mut grown = Vec::with_capacity(bytes.len() + ENTRY_BYTES);
            grown.extend_from_slice(head);
            grown.extend_from_slice(&e);
            grown.extend_from_slice(tail);
            *bytes = grown;
            if let Some(b) = bytes.get_mut(9..).and_then(|b| b.first_chunk_mut::<4>()) {
                *b = u32::try_from(l.n + 1).unwrap_or(u32::MAX).to_le_bytes();
            }
        }
    }
    InPlace::Done
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

/// [`session_limit`] for a process whose loads are its own counts (its count + 1 over it
/// passes the candidate over): over when its count exceeds `(1 + epsilon) × S ×` its weight
/// share — scale-free, so that a replica counting a third of the sessions decides as one
/// Envoy — and its count + 1 exceeds [`SESSION_SLACK`], a floor instead of an addend.
pub fn own_session_limit(total_sessions: f64, weight: f64, total_weight: f64, epsilon: f64) -> f64 {
    let share = if total_weight > 0.0 {
        weight / total_weight
    } else {
        0.0
    };
    ((1.0 + epsilon.max(0.0)) * total_sessions.max(0.0) * share + 1.0).max(SESSION_SLACK)
}

/// The multiple of its weighted share of the candidates' in-flight attempts from which an
/// endpoint is busy for the session bound when the loads are this process's own counts (no
/// engine scraped): with several replicas each counts its share of the traffic, so an
/// absolute threshold is reached at that many times the engine's load; a share is the same
/// on every replica, up to sampling. See [`busy_by_share`].
pub const SESSION_BUSY_SHARE: f64 = 2.0;

/// The fewest in-flight attempts of this process at which [`busy_by_share`] can hold: one
/// request is no evidence of anything, whatever its share.
pub const SESSION_BUSY_FLOOR: u32 = 2;

/// Whether an endpoint counted by this process's own in-flight attempts is busy for the
/// session bound: its `load` at least [`SESSION_BUSY_SHARE`] × its weighted share of
/// `total_load` (the walk's candidates' attempts, its own among them), and at least
/// [`SESSION_BUSY_FLOOR`]. Scale-free: a replica that sees a third of each endpoint's
/// requests decides as one that sees them all.
pub fn busy_by_share(load: u32, total_load: u64, weight: f64, total_weight: f64) -> bool {
    let share = if total_weight > 0.0 {
        weight / total_weight
    } else {
        return false;
    };
    load >= SESSION_BUSY_FLOOR && f64::from(load) >= SESSION_BUSY_SHARE * share * total_load as f64
}

/// Whether an endpoint with `load` (running + waiting, or in flight: the load the bounded
/// load reads) and `slots` (0: unknown) is busy enough for the session bound to apply: at
/// least `busy_load` ([`SESSION_BUSY_LOAD`]), or half its slots if that is less.
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
        let h = SESSION_HALF_LIFE_MS;
        assert!(record(&store, &c, a, 1_000));
        assert!(record(&store, &c, a, 1_000));
        assert!(record(&store, &c, b, 1_000 + h));
        // a's two faded by one half-life, b's one fresh.
        let n = read(&store).at(1_000 + h);
        assert!(
            (n.of(a) - 1.0).abs() < 1e-9 && (n.of(b) - 1.0).abs() < 1e-9,
            "{n:?}"
        );
        let n = read(&store).at(1_000 + 2 * h);
        assert!(
            (n.of(a) - 0.5).abs() < 1e-9 && (n.of(b) - 0.5).abs() < 1e-9,
            "{n:?}"
        );
        assert_eq!(n.of(a ^ b ^ 1), 0.0);
        // A clock behind the reference time (0 here: nothing rescaled) reads the counts as of
        // that time: each session weighs 2^(t / h) (forward decay).
        let n = read(&store).at(0);
        let w = (1_000.0_f64 / h as f64).exp2();
        assert!(
            (n.of(a) - 2.0 * w).abs() < 1e-9 && (n.of(b) - 2.0 * w).abs() < 1e-9,
            "{n:?}"
        );
        let p = read(&store);
        assert_eq!(Placed::decode(&p.encode()), Some(p.clone()));
        assert_eq!(p.encode().len(), HEADER_BYTES + 2 * ENTRY_BYTES);
    }

    #[test]
    fn entries_stay_bounded_by_the_configuration_and_bad_bytes_read_as_nothing() {
        let mut p = Placed::default();
        p.add(9, 0, 1_000, (2, || vec![9, 3]));
        p.add(3, 0, 1_000, (2, || vec![9, 3]));
        // Endpoint 3 removed, 5 added: 3 is dropped once the entries outnumber the fleet.
        p.add(5, 0, 1_000, (2, || vec![9, 5]));
        p.add(9, 0, 1_000, (2, || vec![9, 5]));
        assert_eq!(p.entries, vec![(5, 1.0), (9, 2.0)]);
        let bytes = p.encode();
        assert_eq!(Placed::decode(&bytes[..bytes.len() - 1]), None);
        let mut v1 = bytes.clone();
        v1[0] = 1;
        assert_eq!(Placed::decode(&v1), None);
        let mut negative = bytes.clone();
        let at = negative.len() - 8;
        negative[at..at + 8].copy_from_slice(&(-1.0f64).to_le_bytes());
        assert_eq!(Placed::decode(&negative), None);
        let mut unsorted = bytes.clone();
        unsorted[13..17].copy_from_slice(&9u32.to_le_bytes());
        assert_eq!(Placed::decode(&unsorted), None);
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(Placed::decode(&longer), None);
        let store = MemStore::new();
        store.set(SESSIONS_KEY, &[1, 2, 3], None).ok();
        assert_eq!(read(&store), Placed::default());
    }

    /// The value counted in place is byte for byte the one decoding, adding and encoding
    /// gives: over a stream that weighs sessions by their time, rescales past 32 half-lives, brings new
    /// endpoints, and (a fleet of 5 whose entries already number 6) must drop a removed
    /// endpoint's entry.
    #[test]
    fn counting_in_place_gives_the_decoded_value() {
        let mut slow = Placed::default();
        let mut fast: Option<Vec<u8>> = None;
        let mut rng = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut now = 1_000u64;
        for step in 0..3_000u64 {
            let r = next();
            let id = [3u32, 9, 5, 1, 7, 11][(r % 6) as usize];
            now += [0, 0, 1, 250, 4_000][(r >> 16) as usize % 5];
            if step == 2_000 {
                // Past 32 half-lives of the reference: rescaled (by decoding).
                now += 3_000_000;
            }
            let fleet = if step < 1_500 { 6 } else { 5 };
            let ids = || {
                if fleet == 6 {
                    vec![1, 3, 5, 7, 9, 11]
                } else {
                    vec![1, 3, 5, 7, 9]
                }
            };
            slow.add(id, now, 60_000, (fleet, ids));
            let mut bytes = fast.take().unwrap_or_else(|| Placed::default().encode());
            let mut placed = match add_in_place(&mut bytes, id, now, 60_000, fleet) {
                InPlace::Done => None,
                InPlace::Prune => Some(Placed::decode(&bytes).unwrap()),
                InPlace::Invalid => panic!("step {step}: valid bytes read as invalid"),
            };
            if let Some(p) = placed.as_mut() {
                p.add(id, now, 60_000, (fleet, ids));
                bytes = p.encode();
            }
            assert_eq!(bytes, slow.encode(), "step {step}");
            fast = Some(bytes);
        }
        // The counts read from the bytes are the decoded ones.
        let counts = slow.clone().at(now + 500);
        let f = fade(now + 500 - slow.at_ms, SESSION_HALF_LIFE_MS);
        assert!(f < 1.0);
        for id in [1, 3, 5, 7, 9, 11, 4] {
            assert_eq!(counts.of(id), slow.get(id) * f);
        }
        // Bytes that do not decode do not count in place either.
        let good = slow.encode();
        for bad in [
            good[..good.len() - 1].to_vec(),
            [&[1u8][..], &good[1..]].concat(),
        ] {
            let mut b = bad.clone();
            assert_eq!(add_in_place(&mut b, 3, now, 60_000, 6), InPlace::Invalid);
            assert_eq!(check(&bad), None);
        }
        let mut negative = good.clone();
        negative[HEADER_BYTES + 4..HEADER_BYTES + 12].copy_from_slice(&(-1.0f64).to_le_bytes());
        assert_eq!(Placed::decode(&negative), None);
        assert_eq!(check(&negative), None);
        // A count is checked where it is read (endpoint 1's here), and reads as 0 for a
        // decision.
        let mut other = negative.clone();
        assert_eq!(
            add_in_place(&mut negative, 1, now, 60_000, 6),
            InPlace::Invalid
        );
        assert_eq!(add_in_place(&mut other, 3, now, 60_000, 6), InPlace::Done);
        assert_eq!(Placed::default().at(now).of(1), 0.0);
        let read = Counts::of_bytes(Some(other), None, now);
        assert_eq!(read.of(1), 0.0);
        assert!(read.of(3) > 0.0);
        assert_eq!(
            check(&good),
            Some(Layout {
                n: slow.entries.len()
            })
        );
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

    /// Own counts: busy from twice the weighted share of the attempts in flight, never under
    /// 2; the same verdict for a third of the traffic in the same proportions.
    #[test]
    fn busy_by_share_is_scale_free_above_its_floor() {
        // Share 1/4: busy from half the attempts.
        assert!(!busy_by_share(4, 9, 1.0, 4.0) && busy_by_share(5, 9, 1.0, 4.0));
        assert!(!busy_by_share(12, 27, 1.0, 4.0) && busy_by_share(15, 27, 1.0, 4.0));
        assert!(busy_by_share(2, 2, 1.0, 4.0) && !busy_by_share(1, 1, 1.0, 4.0));
        assert!(!busy_by_share(3, 3, 1.0, 0.0), "no weight: never busy");
        for (load, total) in [(2u32, 5u64), (3, 5), (4, 7), (6, 10)] {
            assert_eq!(
                busy_by_share(load, total, 1.0, 5.0),
                busy_by_share(load * 3, total * 3, 1.0, 5.0),
                "{load} of {total}"
            );
        }
    }

    /// Own counts: over when the count exceeds `1.25 × S ×` its share (the count + 1 against
    /// the limit), the slack a floor; scale-free above it.
    #[test]
    fn own_session_limit_is_the_share_with_the_slack_as_a_floor() {
        let l = own_session_limit(60.0, 1.0, 4.0, 0.25);
        assert!((l - 19.75).abs() < 1e-9, "{l}");
        assert_eq!(own_session_limit(0.0, 1.0, 4.0, 0.25), SESSION_SLACK);
        assert_eq!(own_session_limit(60.0, 1.0, 0.0, 0.25), SESSION_SLACK);
        for (count, total) in [(19.0, 60.0), (18.0, 60.0), (7.0, 20.0), (6.0, 20.0)] {
            let over = |k: f64| count * k + 1.0 > own_session_limit(total * k, 1.0, 4.0, 0.25);
            assert_eq!(over(1.0), over(3.0), "{count} of {total}");
        }
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
