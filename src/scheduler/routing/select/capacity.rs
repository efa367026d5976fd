//! Capacity: how many requests an engine runs at once, and how many this Envoy has sent it
//! since its last scrape, so that a burst of placements cannot pile onto a small engine.
//!
//! Why: the saturation state ([`crate::scheduler::routing::judge::saturation`]) and the bounded load read the engine's
//! `running + waiting` as of its last scrape (one a second). Between two scrapes every
//! placement reads the same picture, so when the large engines of a mixed fleet turn full, all
//! the sessions moved or placed in that second go to the next endpoint of their rendezvous
//! order whose last scrape said "room" — often a 4-slot engine — and then wait there 10 s
//! (the bench's `mixed_fleet`: 37 moves onto `d` within a few scrapes). And the bounded-load
//! limit is a share of all requests by configured *weight* plus a slack of 8, which lets a
//! 4-slot engine take 8 more than its share whatever its size.
//!
//! **Slots** ([`slots_seen`]): an engine that queues (`waiting > 0`) runs all it can, so its
//! running count then *is* its slot count (vLLM's `max_num_seqs` or what its KV cache admits,
//! llama.cpp's `--parallel`, the mock's `--max-concurrency`). We keep the largest running
//! count seen at a scrape with a queue; until an engine has queued once its slots are unknown,
//! and it is judged as before (no engine format reports its slot count as a metric).
//!
//! **Projected load** ([`Room`]): the scraped `running + waiting`, plus the placements (new
//! sessions, moves; not affinity hits, whose load the scrape already shows as the sessions'
//! steady traffic) this Envoy process sent the endpoint since that scrape. The count is this
//! process's own (kept in shared data, so all its workers add to it) and starts again at every
//! new scrape, which includes the placements by then. With several replicas each counts its own
//! share only: the projection is a lower bound.
//!
//! **Room**: an endpoint with known slots has room for one more when `projected + 1 ≤ slots`.
//! A new session's placement passes over an endpoint without room that this process filled
//! by a burst of its own ([`Room::herd`]: two or more placements since the scrape) when another
//! has room, as it passes over a saturated one; "no room" by the scrape alone is left to the
//! saturation verdict, which replicas share. A later turn never reads the own count.
//!
//! **Bounded load by slots** ([`slot_limit`]): when every candidate's slots are known, an
//! endpoint takes a new session while `projected + 1 ≤ max(slots, (1 + ε) × (P + 1) × slots /
//! S + 1)` (`P`, `S`: the candidates' projected loads and slots): always up to its own slots,
//! beyond them only its slot share of the fleet's excess. Without known slots everywhere
//! (hosted API keys, engines that never queued), the bound stays the weighted share of
//! `placement::load_limit`.
//!
//! The record ([`Capacities`], one shared-data value under [`CAPACITY_KEY`]): per configured
//! endpoint id, its slots seen, the scrape time its sent count is on top of, and the count.
//! Bounded by the configuration: the first write that needs an entry gives every configured
//! endpoint one (nothing seen reads as no entry), and drops those of endpoints no longer
//! configured, so that later writes change entries in place (see [`Capacities::put`]).

use crate::scheduler::config::Config;
use crate::scheduler::routing::judge::saturation::EngineLoad;
use crate::scheduler::routing::scrape;
use crate::scheduler::routing::select::signals;
use crate::scheduler::state::codec::{Reader, Writer};
use crate::scheduler::state::store::{update_owned_if, Store};

/// The shared-data key of [`Capacities`].
pub const CAPACITY_KEY: &str = "computeflux/capacity";

const VERSION: u8 = 1;
/// Per entry: id (u32), slots (u32), scraped_ms (u64), sent (u32).
const ENTRY_BYTES: usize = 4 + 4 + 8 + 4;

/// What this Envoy process knows of one engine's capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Seen {
    /// The largest running count seen at a scrape with a queue; 0: unknown.
    pub slots: u32,
    /// The scrape (its completion time) that `sent` counts on top of.
    pub scraped_ms: u64,
    /// Placements sent since that scrape.
    pub sent: u32,
}

/// The slot count `load` shows, folded into what was seen before (`prev`, 0: unknown): its
/// running count if it queues, never less than before.
pub fn slots_seen(prev: u32, load: &EngineLoad) -> u32 {
    match (load.waiting, load.running) {
        (Some(w), Some(r)) if w > 0 => prev.max(r),
        _ => prev,
    }
}

/// One endpoint's projected load and slots for a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Room {
    /// Scraped running + waiting, plus the placements sent since that scrape.
    pub projected: u32,
    /// Its slots, if it was ever seen queueing.
    pub slots: Option<u32>,
    /// This process's own placements since that scrape (part of `projected`).
    pub sent: u32,
}

impl Room {
    /// The room for one more, from a fresh `load` and what was `seen` of the engine. `None`
    /// without a scraped running count (no basis for a projection).
    pub fn of(seen: &Seen, load: &EngineLoad) -> Option<Room> {
        let running = load.running?;
        let sent = if seen.scraped_ms == load.scraped_ms {
            seen.sent
        } else {
            0
        };
        let slots = slots_seen(seen.slots, load);
        Some(Room {
            projected: running
                .saturating_add(load.waiting.unwrap_or(0))
                .saturating_add(sent),
            slots: (slots > 0).then_some(slots),
            sent,
        })
    }

    /// Whether one more would run at once: `Some(projected + 1 ≤ slots)`, `None` when the
    /// slots are unknown.
    pub fn free_slot(&self) -> Option<bool> {
        self.slots.map(|s| u64::from(self.projected) < u64::from(s))
    }

    /// A burst of this process's own: at least [`HERD_MIN_SENT`] placements sent since the
    /// scrape and no free slot counting them. What bounds a herd of new sessions onto a small
    /// engine between two scrapes; never read for a later turn (see [`HERD_MIN_SENT`]).
    pub fn herd(&self) -> bool {
        self.sent >= HERD_MIN_SENT && self.free_slot() == Some(false)
    }
}

/// The own placements since a scrape that make a burst ([`Room::herd`]).
///
/// Why not any: with one or none sent, "no free slot" is the scrape's own running + waiting,
/// which on a 4-slot engine turns with every answer, and is read by each replica at its own
/// scrape; with three replicas, each turn of a session met another verdict and the session
/// moved between the small engine and the next of its order (mixed fleet near saturation:
/// 75–79 % of later turns on their previous endpoint). The scrape's judgement of a full
/// engine is the saturation verdict, which every replica reads alike (hysteresis, slot-scaled
/// in [`signals::saturation_rule`]); the own count only stops a herd released between two
/// scrapes (18 sessions at once: the 4-slot engine takes 4).
pub const HERD_MIN_SENT: u32 = 2;

impl Room {}

/// The bounded-load limit of an endpoint with `slots`, when every candidate's slots are known:
/// the load it may have after taking one more, given the candidates' projected loads summing
/// to `total_projected` and their slots to `total_slots`. Its own slots at least; beyond them
/// `(1 + epsilon) × (P + 1) × slots / S + 1`, its slot share of the excess.
pub fn slot_limit(total_projected: u64, slots: u32, total_slots: u64, epsilon: f64) -> f64 {
    let own = f64::from(slots);
    if total_slots == 0 {
        return own;
    }
    let share = own / total_slots as f64;
    let shared = (1.0 + epsilon.max(0.0)) * (total_projected as f64 + 1.0) * share + 1.0;
    own.max(shared)
}

/// Every configured endpoint's [`Seen`], by endpoint id.
///
/// Codec (little-endian): version `1` (u8), entry count (u32), then per entry in strictly
/// increasing id order: id (u32), slots (u32), scraped_ms (u64), sent (u32). Anything else
/// decodes as `None` (read as nothing seen: every endpoint judged as before).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Capacities {
    /// Sorted by id, ids distinct.
    entries: Vec<(u32, Seen)>,
}

impl Capacities {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(5 + self.entries.len() * ENTRY_BYTES);
        w.u8(VERSION);
        w.u32(u32::try_from(self.entries.len()).unwrap_or(u32::MAX));
        for (id, s) in &self.entries {
            w.u32(*id);
            w.u32(s.slots);
            w.u64(s.scraped_ms);
            w.u32(s.sent);
        }
        w.buf
    }

    pub fn decode(bytes: &[u8]) -> Option<Capacities> {
        let mut r = Reader::new(bytes);
        if r.u8()? != VERSION {
            return None;
        }
        let n = usize::try_from(r.u32()?).ok()?;
        if r.remaining() != n.checked_mul(ENTRY_BYTES)? {
            return None;
        }
        let mut entries: Vec<(u32, Seen)> = Vec::with_capacity(n);
        for _ in 0..n {
            let id = r.u32()?;
            if entries.last().is_some_and(|(last, _)| *last >= id) {
                return None;
            }
            let seen = Seen {
                slots: r.u32()?,
                scraped_ms: r.u64()?,
                sent: r.u32()?,
            };
            entries.push((id, seen));
        }
        Some(Capacities { entries })
    }

    /// What was seen of endpoint `id` (nothing: the default).
    pub fn get(&self, id: u32) -> Seen {
        self.find(id).1
    }

    /// [`Capacities::get`], with the entry's position when there is one.
    fn find(&self, id: u32) -> (Option<usize>, Seen) {
        match self.entries.binary_search_by_key(&id, |(k, _)| *k) {
            Ok(k) => (
                Some(k),
                self.entries.get(k).map(|(_, s)| *s).unwrap_or_default(),
            ),
            Err(_) => (None, Seen::default()),
        }
    }

    /// Sets endpoint `id`'s entry (binary search: replaced in place). Where it has none, the
    /// record is first made to hold one for every configured id (`keep`, any order), those
    /// it held kept and the others added with nothing seen (as a missing entry reads), while
    /// the entries of ids no longer configured go; an `id` not configured is then dropped.
    ///
    /// Why every configured id at once: a write that only changes entries keeps the record's
    /// length and its ids' positions, so that a worker's memo brings in another's write by
    /// the entries whose bytes differ ([`RoomsMemo::patch`]) and a placement is counted in
    /// place; an entry inserted per new endpoint moved every later one, and each such write
    /// cost every worker a whole decoding and every room derived again. The record is as
    /// large as the configuration, as it was once every endpoint had been placed on.
    fn put(&mut self, id: u32, seen: Seen, keep: &[u32]) {
        let at = match self.entries.binary_search_by_key(&id, |(k, _)| *k) {
            Ok(at) => Some(at),
            Err(_) => {
                self.fill_configured(keep);
                self.entries.binary_search_by_key(&id, |(k, _)| *k).ok()
            }
        };
        if let Some(e) = at.and_then(|at| self.entries.get_mut(at)) {
            e.1 = seen;
        }
    }

    /// Makes the entries those of `keep` (the configured ids, in any order): an entry kept
    /// where there was one, else nothing seen; sorted once, then one binary search per id.
    ///
    /// Why not `keep.contains` per entry, after every change: a scrape round that shows every
    /// engine's slots for the first time changes every entry, and that was cubic in the fleet
    /// (111.8 M instructions for one request at 512 endpoints).
    fn fill_configured(&mut self, keep: &[u32]) {
        let sorted = scrape::sorted_ids(keep);
        let mut entries: Vec<(u32, Seen)> = Vec::with_capacity(sorted.len());
        for &id in sorted.iter() {
            if entries.last().is_some_and(|(last, _)| *last == id) {
                continue;
            }
            entries.push((id, self.get(id)));
        }
        self.entries = entries;
    }

    /// Folds the slots each fresh load shows (`(id, load)`, ids among `keep`); true when some
    /// grew; where one had no entry, every configured id gets one (see [`Capacities::put`]).
    pub fn observe(&mut self, loads: &[(u32, EngineLoad)], keep: &[u32]) -> bool {
        let mut changed = false;
        for (id, load) in loads {
            let mut seen = self.get(*id);
            let slots = slots_seen(seen.slots, load);
            if slots != seen.slots {
                seen.slots = slots;
                self.put(*id, seen, keep);
                changed = true;
            }
        }
        changed
    }

    /// Counts one placement sent to endpoint `id` (one of `keep`), whose last scrape is `load`;
    /// where it had no entry, every configured id gets one (see [`Capacities::put`]).
    pub fn sent(&mut self, id: u32, load: &EngineLoad, keep: &[u32]) {
        let mut seen = self.get(id);
        if seen.scraped_ms != load.scraped_ms {
            seen.scraped_ms = load.scraped_ms;
            seen.sent = 0;
        }
        seen.sent = seen.sent.saturating_add(1);
        seen.slots = slots_seen(seen.slots, load);
        self.put(id, seen, keep);
    }
}

/// What one decision knows of the engines: each configured endpoint's fresh scraped load
/// (`signals::engine_loads`) and its room (by index into `Config::endpoints`).
#[derive(Debug, Clone, Default)]
pub struct Engines {
    /// By endpoint index (empty when nothing is scraped: read with `get`); shared with the
    /// worker's memo (`signals::fresh_engines`).
    pub loads: std::rc::Rc<Vec<Option<EngineLoad>>>,
    /// The peers' median engine pace by endpoint index (`signals::pace_medians` of `loads`).
    pub pace: std::rc::Rc<Vec<Option<f64>>>,
    pub rooms: std::rc::Rc<Vec<Option<Room>>>,
    /// What was seen before the decision (for [`Engines::record`]).
    pub seen: std::rc::Rc<Capacities>,
    /// The CAS token of the stored capacities `seen` was decoded from, when they decoded (their
    /// ids strictly increasing): a placement counted on the same write checks no id again.
    pub decoded_cas: Option<u32>,
    /// Some fresh load shows slots beyond what `seen` holds (derived with the rooms).
    pub grew: bool,
    /// The worker's rooms memo's count of changes to the rooms' slots when these were
    /// derived (`None`: no memo): equal counts of one memo, the same slots.
    pub slots_version: Option<u64>,
    /// The new sessions this process placed per endpoint (see `sessions`), faded to the
    /// decision's time: read only for a new session placed by prefix while the session bound
    /// is on; `None` otherwise.
    pub sessions: Option<crate::scheduler::routing::placement::sessions::Counts>,
}

/// One worker's last derived capacities and rooms ([`Engines::read_memo`]): the stored
/// capacities' bytes they were decoded from and the loads (the worker's shared list) they were
/// derived with. Why: decoding every endpoint's capacity and deriving its room cost each
/// decision an amount that grew with the fleet (twice per request with admission), while both
/// change only at a placement or a scrape.
#[derive(Debug, Clone, Default)]
pub struct RoomsMemo {
    bytes: Option<Vec<u8>>,
    cas: Option<u32>,
    /// `bytes` decoded (a patch keeps the ids and their positions, so it keeps that too).
    decoded: bool,
    loads: std::rc::Rc<Vec<Option<EngineLoad>>>,
    rooms: std::rc::Rc<Vec<Option<Room>>>,
    seen: std::rc::Rc<Capacities>,
    /// The endpoint index of each of `seen`'s entries (by position; `None`: not configured),
    /// for patching the rooms of the entries a write changed ([`RoomsMemo::patch`]).
    at: Vec<Option<usize>>,
    /// How many endpoints' fresh loads show slots beyond what `seen` holds (`grew`: some do).
    growing: usize,
    /// Writes brought in by [`RoomsMemo::patch`] (read by tests).
    patches: u64,
    /// Counts the derivations and patches that may have changed some room's slots (see
    /// [`Engines::slots_version`]).
    slots_version: u64,
}

impl RoomsMemo {
    /// Brings the memo up to date with the stored capacities' new `bytes`, when they hold
    /// the same ids at the same positions as the memo's (the usual write: one placement
    /// counted, or slots learned, on entries already there) and the loads are the memo's:
    /// only the entries whose bytes differ are decoded and their endpoints' rooms derived
    /// again. False (the memo unchanged) when it cannot: the caller derives everything.
    ///
    /// Why: every new session rewrites the capacities (its placement's count), so every
    /// later decision found them changed and decoded every entry and derived every room again,
    /// an amount that grew with the fleet (about 200 000 instructions per request at 512).
    fn patch(&mut self, bytes: &[u8], cfg: &Config) -> bool {
        let Some(old) = self.bytes.as_deref() else {
            return false;
        };
        let (Some(old_head), Some(new_head)) = (old.get(..5), bytes.get(..5)) else {
            return false;
        };
        if old.len() != bytes.len()
            || old_head != new_head
            || self.at.len() != self.seen.entries.len()
            || self.rooms.len() != cfg.endpoints.len()
        {
            return false;
        }
        let (Some(old_entries), Some(new_entries)) = (old.get(5..), bytes.get(5..)) else {
            return false;
        };
        if new_entries.len() != self.seen.entries.len() * ENTRY_BYTES {
            return false;
        }
        // The positions whose bytes differ, their ids unchanged: the entries of the 32-byte
        // blocks that differ (compared as words), each then compared whole.
        let mut maybe = Vec::new();
        entries_maybe_differing(old_entries, new_entries, &mut maybe);
        let mut changed: Vec<(usize, Seen)> = Vec::new();
        for k in maybe {
            let span = k * ENTRY_BYTES..(k + 1) * ENTRY_BYTES;
            let (Some(a), Some(b)) = (old_entries.get(span.clone()), new_entries.get(span)) else {
                return false;
            };
            let word = |c: &[u8], at: usize| {
                c.get(at..at + 8)
                    .and_then(|w| <[u8; 8]>::try_from(w).ok())
                    .map(u64::from_le_bytes)
            };
            let tail = |c: &[u8]| c.get(16..20).and_then(|w| <[u8; 4]>::try_from(w).ok());
            if word(a, 0) == word(b, 0) && word(a, 8) == word(b, 8) && tail(a) == tail(b) {
                continue;
            }
            if a.get(..4) != b.get(..4) {
                return false;
            }
            let mut r = Reader::new(b.get(4..).unwrap_or_default());
            let (Some(slots), Some(scraped_ms), Some(sent)) = (r.u32(), r.u64(), r.u32()) else {
                return false;
            };
            changed.push((
                k,
                Seen {
                    slots,
                    scraped_ms,
                    sent,
                },
            ));
        }
        let (seen, rooms) = (
            std::rc::Rc::make_mut(&mut self.seen),
            std::rc::Rc::make_mut(&mut self.rooms),
        );
        for (k, now) in changed {
            let Some(entry) = seen.entries.get_mut(k) else {
                return false;
            };
            let before = entry.1;
            entry.1 = now;
            let Some(i) = self.at.get(k).copied().flatten() else {
                continue;
            };
            let Some(load) = self.loads.get(i).copied().flatten() else {
                continue;
            };
            if let Some(room) = rooms.get_mut(i) {
                let then = room.and_then(|r| r.slots);
                *room = Room::of(&now, &load);
                if room.and_then(|r| r.slots) != then {
                    self.slots_version = self.slots_version.wrapping_add(1);
                }
            }
            let grows = |s: &Seen| usize::from(slots_seen(s.slots, &load) != s.slots);
            self.growing = self.growing.saturating_sub(grows(&before)) + grows(&now);
        }
        true
    }
}

/// The bytes compared at a time by [`entries_maybe_differing`].
const BLOCK: usize = 128;

/// Pushes to `out` (increasing, each once) the positions of the [`ENTRY_BYTES`]-byte entries
/// of `a` that may differ from `b`'s: every entry with a byte that differs is among them, with
/// the other entries of its block of [`BLOCK`] bytes (or word, past the last whole block; the
/// caller compares each entry it is given). Two lists of different lengths name every entry.
///
/// Why: every new session rewrites one entry of the capacities, and each worker's next
/// decision finds which one; comparing entry by entry cost about 50 instructions per
/// endpoint (25 000 at 512), sixteen words XORed per block about a fifth of that.
fn entries_maybe_differing(a: &[u8], b: &[u8], out: &mut Vec<usize>) {
    let mut mark = |from: usize, to: usize| {
        if to <= from {
            return;
        }
        for k in from / ENTRY_BYTES..=(to - 1) / ENTRY_BYTES {
            if out.last().is_none_or(|&l| l < k) {
                out.push(k);
            }
        }
    };
    if a.len() != b.len() {
        mark(0, a.len().max(b.len()));
        return;
    }
    let (blocks_a, rest_a) = a.as_chunks::<BLOCK>();
    let (blocks_b, rest_b) = b.as_chunks::<BLOCK>();
    for (j, (x, y)) in blocks_a.iter().zip(blocks_b).enumerate() {
        let (words_x, _) = x.as_chunks::<8>();
        let (words_y, _) = y.as_chunks::<8>();
        let differs = words_x.iter().zip(words_y).fold(0u64, |d, (p, q)| {
            d | (u64::from_le_bytes(*p) ^ u64::from_le_bytes(*q))
        });
        if differs != 0 {
            mark(j * BLOCK, (j + 1) * BLOCK);
        }
    }
    // The rest by words, then by bytes.
    let at = blocks_a.len() * BLOCK;
    let (words_a, tail_a) = rest_a.as_chunks::<8>();
    let (words_b, tail_b) = rest_b.as_chunks::<8>();
    for (j, (p, q)) in words_a.iter().zip(words_b).enumerate() {
        if u64::from_le_bytes(*p) != u64::from_le_bytes(*q) {
            mark(at + j * 8, at + (j + 1) * 8);
        }
    }
    let at = at + words_a.len() * 8;
    for (j, (p, q)) in tail_a.iter().zip(tail_b).enumerate() {
        if p != q {
            mark(at + j, at + j + 1);
        }
    }
}

impl Engines {
    /// The engines as `store` holds them at `now_ms`.
    pub fn read(store: &dyn Store, cfg: &Config, now_ms: u64) -> Engines {
        let loads = signals::engine_loads(store, cfg, now_ms);
        let pace = signals::pace_medians(cfg, &loads);
        Engines::read_with(store, cfg, std::rc::Rc::new(loads), std::rc::Rc::new(pace))
    }

    /// [`Engines::read`] with the fresh loads and their peers' median pace already known
    /// (`signals::fresh_engines`, a worker's memo of them).
    pub fn read_with(
        store: &dyn Store,
        cfg: &Config,
        loads: std::rc::Rc<Vec<Option<EngineLoad>>>,
        pace: std::rc::Rc<Vec<Option<f64>>>,
    ) -> Engines {
        Engines::read_memo(store, cfg, loads, pace, None)
    }

    /// [`Engines::read_with`] through a worker's memo of the capacities and rooms last derived
    /// (`memo`): the stored capacities are read (one copy) and decoded, and the rooms derived,
    /// only when their bytes or the loads changed since; else the memo's are shared.
    pub fn read_memo(
        store: &dyn Store,
        cfg: &Config,
        loads: std::rc::Rc<Vec<Option<EngineLoad>>>,
        pace: std::rc::Rc<Vec<Option<f64>>>,
        mut memo: Option<&mut RoomsMemo>,
    ) -> Engines {
        if loads.iter().all(Option::is_none) {
            // Nothing scraped (hosted keys, or no fresh scrape): no room is known, and the
            // capacities are neither read nor written (a request's cost stays per candidate).
            // Empty lists: every endpoint's load and room read by index as `None`.
            return Engines::default();
        }
        let (bytes, cas) = store.get(CAPACITY_KEY);
        if let Some(m) = memo.as_deref_mut() {
            // The same write (its CAS token: every write takes a new one) or the same bytes.
            let same = match (cas, m.cas) {
                (Some(now), Some(then)) => now == then,
                _ => m.bytes == bytes,
            };
            let same_loads = std::rc::Rc::ptr_eq(&m.loads, &loads);
            // Another write over the same entries: only those that changed are derived again.
            let patched = !same && same_loads && bytes.as_deref().is_some_and(|b| m.patch(b, cfg));
            if (same || patched) && same_loads {
                if patched {
                    m.bytes = bytes;
                    m.cas = cas;
                    m.patches += 1;
                }
                return Engines {
                    loads,
                    pace,
                    rooms: std::rc::Rc::clone(&m.rooms),
                    seen: std::rc::Rc::clone(&m.seen),
                    decoded_cas: m.cas.filter(|_| m.decoded),
                    grew: m.growing > 0,
                    slots_version: Some(m.slots_version),
                    sessions: None,
                };
            }
        }
        let decoded = bytes.as_deref().and_then(Capacities::decode);
        let decoded_cas = cas.filter(|_| decoded.is_some());
        let seen = decoded.unwrap_or_default();
        let mut at: Vec<Option<usize>> = vec![None; seen.entries.len()];
        let mut growing = 0;
        let rooms: Vec<Option<Room>> = cfg
            .endpoints
            .iter()
            .zip(loads.iter())
            .enumerate()
            .map(|(i, (e, l))| {
                let (k, s) = seen.find(e.id);
                if let Some(slot) = k.and_then(|k| at.get_mut(k)) {
                    *slot = Some(i);
                }
                let l = l.as_ref()?;
                growing += usize::from(slots_seen(s.slots, l) != s.slots);
                Room::of(&s, l)
            })
            .collect();
        let (rooms, seen) = (std::rc::Rc::new(rooms), std::rc::Rc::new(seen));
        let mut slots_version = None;
        if let Some(m) = memo {
            let version = m.slots_version.wrapping_add(1);
            slots_version = Some(version);
            *m = RoomsMemo {
                bytes,
                cas,
                decoded: decoded_cas.is_some(),
                loads: std::rc::Rc::clone(&loads),
                rooms: std::rc::Rc::clone(&rooms),
                seen: std::rc::Rc::clone(&seen),
                at,
                growing,
                patches: m.patches,
                slots_version: version,
            };
        }
        Engines {
            loads,
            pace,
            rooms,
            seen,
            decoded_cas,
            grew: growing > 0,
            slots_version,
            sessions: None,
        }
    }

    /// Stores what a decision taught: the slots the fresh loads show, and `placed` (the index
    /// of the endpoint a placement was sent to, counted on top of its last scrape). No write
    /// when neither changed anything.
    /// `sorted_ids`: the configured ids sorted, when the caller keeps them (else derived).
    pub fn record(
        &self,
        store: &dyn Store,
        cfg: &Config,
        placed: Option<usize>,
        sorted_ids: Option<&[u32]>,
    ) {
        if self.loads.iter().all(Option::is_none) || !(placed.is_some() || self.grew) {
            return;
        }
        // The slots the loads show, only when they show more than was seen (else a placement
        // alone is counted).
        let fresh: Vec<(u32, EngineLoad)> = if self.grew {
            cfg.endpoints
                .iter()
                .zip(self.loads.iter())
                .filter_map(|(e, l)| l.map(|l| (e.id, l)))
                .collect()
        } else {
            Vec::new()
        };
        let placed = placed.and_then(|i| {
            let load = self.loads.get(i).copied().flatten()?;
            Some((cfg.endpoints.get(i)?.id, load))
        });
        match sorted_ids {
            Some(ids) => record_decoded(store, &fresh, placed, ids, self.decoded_cas),
            None => {
                let ids: Vec<u32> = cfg.endpoints.iter().map(|e| e.id).collect();
                record_decoded(store, &fresh, placed, &ids, self.decoded_cas)
            }
        };
    }
}

/// The stored capacities (absent or undecodable: nothing seen).
pub fn read(store: &dyn Store) -> Capacities {
    store
        .get(CAPACITY_KEY)
        .0
        .as_deref()
        .and_then(Capacities::decode)
        .unwrap_or_default()
}

/// Stores what a decision learned: the slots the fresh `loads` show, and the placement it sent
/// (`placed`: endpoint id and its load), if any. Writes only when something changed; a lost
/// CAS race loses one count (bounded retries). `keep`: the configured endpoint ids.
pub fn record(
    store: &dyn Store,
    loads: &[(u32, EngineLoad)],
    placed: Option<(u32, EngineLoad)>,
    keep: &[u32],
) -> bool {
    record_decoded(store, loads, placed, keep, None)
}

/// [`record`], knowing that the stored capacities of CAS token `decoded_cas` decode (a
/// worker's memo decoded them): a placement counted on that write checks no id again.
fn record_decoded(
    store: &dyn Store,
    loads: &[(u32, EngineLoad)],
    placed: Option<(u32, EngineLoad)>,
    keep: &[u32],
    decoded_cas: Option<u32>,
) -> bool {
    update_owned_if(store, CAPACITY_KEY, |mut bytes, cas| {
        // A placement alone on an entry already there: its bytes rewritten in place.
        if let (true, Some((id, load)), Some(b)) = (loads.is_empty(), &placed, bytes.as_mut()) {
            let decodes = cas.is_some() && cas == decoded_cas;
            if sent_in_place(b, *id, load, decodes) {
                return (bytes, true);
            }
        }
        let mut caps = bytes
            .as_deref()
            .and_then(Capacities::decode)
            .unwrap_or_default();
        let mut changed = caps.observe(loads, keep);
        if let Some((id, load)) = &placed {
            caps.sent(*id, load, keep);
            changed = true;
        }
        (changed.then(|| caps.encode()), changed)
    })
    .unwrap_or(false)
}

/// [`Capacities::sent`] on the encoded record `bytes`, in place, when it decodes and holds an
/// entry for `id`: that entry rewritten, giving the record [`Capacities::encode`] would write,
/// and true. False, the bytes untouched, otherwise (the caller decodes, inserts and encodes).
///
/// Why: every new session counts its placement, and decoding and encoding the whole record
/// for it cost an amount that grew with the fleet (about 45 000 instructions at 512); so did
/// checking the ids entry by entry through slices, and copying the record (about 10 000 each).
///
/// `decodes`: the bytes are known to decode (the ids are not checked again).
fn sent_in_place(bytes: &mut [u8], id: u32, load: &EngineLoad, decodes: bool) -> bool {
    let Some((&[version], rest)) = bytes.split_first_chunk::<1>() else {
        return false;
    };
    let Some((count, entries)) = rest.split_first_chunk::<4>() else {
        return false;
    };
    let Ok(n) = usize::try_from(u32::from_le_bytes(*count)) else {
        return false;
    };
    if version != VERSION || Some(entries.len()) != n.checked_mul(ENTRY_BYTES) {
        return false;
    }
    let (records, _) = entries.as_chunks::<ENTRY_BYTES>();
    let id_of = |r: &[u8; ENTRY_BYTES]| u32::from_le_bytes([r[0], r[1], r[2], r[3]]);
    // Strictly increasing ids, as `Capacities::decode` requires (else it reads as nothing).
    let mut last: Option<u32> = None;
    for r in records.iter().filter(|_| !decodes) {
        let now = id_of(r);
        if last.is_some_and(|l| l >= now) {
            return false;
        }
        last = Some(now);
    }
    let Ok(found) = records.binary_search_by_key(&id, id_of) else {
        return false;
    };
    let at = 5 + found * ENTRY_BYTES;
    let Some(entry) = bytes.get_mut(at + 4..at + ENTRY_BYTES) else {
        return false;
    };
    let mut e = Reader::new(entry);
    let (Some(slots), Some(scraped_ms), Some(sent)) = (e.u32(), e.u64(), e.u32()) else {
        return false;
    };
    let mut seen = Seen {
        slots,
        scraped_ms,
        sent,
    };
    if seen.scraped_ms != load.scraped_ms {
        seen.scraped_ms = load.scraped_ms;
        seen.sent = 0;
    }
    seen.sent = seen.sent.saturating_add(1);
    seen.slots = slots_seen(seen.slots, load);
    let mut w = Writer::with_capacity(ENTRY_BYTES - 4);
    w.u32(seen.slots);
    w.u64(seen.scraped_ms);
    w.u32(seen.sent);
    if w.buf.len() != entry.len() {
        return false;
    }
    entry.copy_from_slice(&w.buf);
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::state::store::MemStore;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn load(waiting: u32, running: u32, scraped_ms: u64) -> EngineLoad {
        EngineLoad {
            waiting: Some(waiting),
            running: Some(running),
            kv_usage_permille: None,
            scraped_ms,
            decode_us_per_token: None,
            decoded_at_ms: None,
        }
    }

    #[test]
    fn slots_are_the_running_count_of_a_queueing_engine() {
        assert_eq!(slots_seen(0, &load(0, 3, 0)), 0, "no queue: unknown");
        assert_eq!(slots_seen(0, &load(2, 4, 0)), 4);
        assert_eq!(slots_seen(4, &load(1, 3, 0)), 4, "never shrinks");
        assert_eq!(slots_seen(4, &load(1, 16, 0)), 16);
        let no_running = EngineLoad {
            running: None,
            ..load(5, 0, 0)
        };
        assert_eq!(slots_seen(7, &no_running), 7);
    }

    /// The burst: a 4-slot engine scraped at 2 running, no queue, seen queueing earlier. Two
    /// placements fill it; the third finds no room until the next scrape.
    #[test]
    fn placements_since_the_scrape_fill_the_slots() {
        let keep = [7, 9];
        let store = MemStore::new();
        assert!(record(&store, &[(7, load(3, 4, 1_000))], None, &keep));
        assert_eq!(read(&store).get(7).slots, 4);
        let now = load(0, 2, 2_000);
        let room = |store: &MemStore| Room::of(&read(store).get(7), &now).unwrap();
        assert_eq!(
            room(&store),
            Room {
                projected: 2,
                slots: Some(4),
                sent: 0,
            }
        );
        assert_eq!(room(&store).free_slot(), Some(true));
        record(&store, &[(7, now)], Some((7, now)), &keep);
        assert_eq!(room(&store).free_slot(), Some(true));
        record(&store, &[(7, now)], Some((7, now)), &keep);
        assert_eq!(room(&store).projected, 4);
        assert_eq!(room(&store).free_slot(), Some(false));
        // Two of its own since the scrape and no free slot: a burst.
        assert!(room(&store).herd());
        // Full by the scrape alone (4 running, none sent): no free slot, but no burst.
        assert!(!Room::of(&read(&store).get(7), &load(0, 4, 2_500))
            .unwrap()
            .herd());
        // The next scrape counts them itself: the count starts again.
        let next = load(0, 3, 3_000);
        assert_eq!(Room::of(&read(&store).get(7), &next).unwrap().projected, 3);
        // Nothing changed: no write.
        assert!(!record(&store, &[(7, next)], None, &keep));
        // Slots unknown: room is not judged.
        assert_eq!(
            Room::of(&Seen::default(), &load(0, 9, 0))
                .unwrap()
                .free_slot(),
            None
        );
        assert_eq!(
            Room::of(
                &Seen::default(),
                &EngineLoad {
                    running: None,
                    ..now
                }
            ),
            None
        );
    }

    #[test]
    fn entries_stay_bounded_by_the_configuration_and_round_trip() {
        let mut c = Capacities::default();
        c.sent(9, &load(1, 16, 5), &[9, 3]);
        c.sent(3, &load(0, 2, 5), &[9, 3]);
        let bytes = c.encode();
        assert_eq!(bytes.len(), 5 + 2 * ENTRY_BYTES);
        assert_eq!(Capacities::decode(&bytes), Some(c.clone()));
        assert_eq!(c.get(9).slots, 16);
        assert_eq!(
            c.get(3),
            Seen {
                slots: 0,
                scraped_ms: 5,
                sent: 1
            }
        );
        // Endpoint 3 is no longer configured: kept while entries only change, dropped when
        // one is added (the record never holds more than the configuration at its last
        // insertion).
        c.sent(9, &load(1, 16, 5), &[9, 7]);
        assert_eq!(c.get(3).sent, 1);
        assert_eq!(c.get(9).sent, 2);
        c.sent(7, &load(1, 4, 5), &[9, 7]);
        assert_eq!(c.get(3), Seen::default());
        assert_eq!(c.get(7).sent, 1);
        assert_eq!(c.encode().len(), 5 + 2 * ENTRY_BYTES);
        // Undecodable: none.
        assert_eq!(Capacities::decode(&[2, 0, 0, 0, 0]), None);
        assert_eq!(Capacities::decode(&bytes[..bytes.len() - 1]), None);
        let mut unsorted = Capacities::default().encode();
        unsorted[1] = 2;
        for id in [5u32, 4] {
            unsorted.extend_from_slice(&id.to_le_bytes());
            unsorted.extend_from_slice(&[0; ENTRY_BYTES - 4]);
        }
        assert_eq!(Capacities::decode(&unsorted), None);
    }

    /// The record as it was written before [`Capacities::put`]: every insertion filtered the
    /// whole list against `keep` (linear), then inserted the entry.
    #[cfg(not(target_arch = "wasm32"))]
    fn plain_record(
        caps: &mut Capacities,
        loads: &[(u32, EngineLoad)],
        placed: Option<(u32, EngineLoad)>,
        keep: &[u32],
    ) -> bool {
        fn set(c: &mut Capacities, id: u32, seen: Seen, keep: &[u32]) {
            // Entries of endpoints no longer configured go when one is added.
            if !c.entries.iter().any(|(k, _)| *k == id) {
                c.entries.retain(|(k, _)| keep.contains(k));
            }
            c.entries.retain(|(k, _)| *k != id);
            let at = c.entries.partition_point(|(k, _)| *k < id);
            c.entries.insert(at, (id, seen));
        }
        let mut changed = false;
        for (id, load) in loads {
            let mut seen = caps.get(*id);
            let slots = slots_seen(seen.slots, load);
            if slots != seen.slots {
                seen.slots = slots;
                set(caps, *id, seen, keep);
                changed = true;
            }
        }
        if let Some((id, load)) = placed {
            let mut seen = caps.get(id);
            if seen.scraped_ms != load.scraped_ms {
                seen.scraped_ms = load.scraped_ms;
                seen.sent = 0;
            }
            seen.sent = seen.sent.saturating_add(1);
            seen.slots = slots_seen(seen.slots, &load);
            set(caps, id, seen, keep);
            changed = true;
        }
        changed
    }

    #[cfg(not(target_arch = "wasm32"))]
    proptest::proptest! {
        /// Random records (ids configured or not), fresh loads of configured ids (repeats
        /// included) and a placement: the sorted put, which gives every configured id an
        /// entry where one is added, reads as the per-change linear filter's record.
        #[test]
        fn put_and_one_filter_equal_the_linear_filter(
            before in proptest::collection::btree_map(0u32..64, (0u32..20, 0u64..4, 0u32..5), 0..40),
            keep in proptest::collection::btree_set(0u32..64, 1..40),
            picks in proptest::collection::vec((0usize..64, 0u32..4, 0u32..20, 0u64..4), 0..40),
            placed in proptest::option::of((0usize..64, 0u32..4, 0u32..20, 0u64..4)),
        ) {
            let keep: Vec<u32> = keep.into_iter().rev().collect();
            let caps = Capacities {
                entries: before
                    .into_iter()
                    .map(|(id, (slots, scraped_ms, sent))| (id, Seen { slots, scraped_ms, sent }))
                    .collect(),
            };
            let at = |(i, w, r, t): (usize, u32, u32, u64)| {
                (keep[i % keep.len()], load(w, r, t))
            };
            let loads: Vec<(u32, EngineLoad)> = picks.into_iter().map(at).collect();
            let placed = placed.map(at);
            let mut plain = caps.clone();
            let plain_changed = plain_record(&mut plain, &loads, placed, &keep);
            let mut fast = caps.clone();
            let mut fast_changed = fast.observe(&loads, &keep);
            if let Some((id, l)) = &placed {
                fast.sent(*id, l, &keep);
                fast_changed = true;
            }
            proptest::prop_assert_eq!(fast_changed, plain_changed);
            // The same record as read (an entry with nothing seen reads as none), every
            // configured id given an entry where one was added, none of another id kept then.
            for id in 0..64 {
                proptest::prop_assert_eq!(fast.get(id), plain.get(id), "id {}", id);
            }
            let added = plain.entries.iter().any(|(id, _)| caps.find(*id).0.is_none());
            let ids: Vec<u32> = fast.entries.iter().map(|(id, _)| *id).collect();
            if added {
                let mut configured = keep.clone();
                configured.sort_unstable();
                proptest::prop_assert_eq!(ids, configured);
            } else {
                proptest::prop_assert_eq!(fast, plain);
            }
        }
    }

    #[cfg(not(target_arch = "wasm32"))]
    proptest::proptest! {
        /// A worker's memo brought up to date write by write (placements counted, slots
        /// learned, entries added, a scrape now and then) hands every decision the rooms,
        /// capacities and growth that reading and deriving everything gives.
        #[test]
        fn patched_rooms_equal_derived_ones(
            n in 1usize..24,
            scrapes in proptest::collection::vec(
                proptest::collection::vec(proptest::option::of((0u32..4, 0u32..12, 0u64..3)), 24),
                1..4,
            ),
            steps in proptest::collection::vec((0usize..64, 0usize..24, proptest::bool::ANY), 1..60),
        ) {
            let eps: Vec<_> = (0..n)
                .map(|i| serde_json::json!({"name": format!("e{i}"), "cluster": format!("c{i}")}))
                .collect();
            let cfg = Config::from_value(&serde_json::json!({ "endpoints": eps }))
                .map_err(|e| proptest::test_runner::TestCaseError::fail(format!("{e:?}")))?;
            let keep: Vec<u32> = cfg.endpoints.iter().map(|e| e.id).collect();
            let lists: Vec<std::rc::Rc<Vec<Option<EngineLoad>>>> = scrapes
                .iter()
                .map(|s| {
                    std::rc::Rc::new(
                        s.iter()
                            .take(n)
                            .map(|l| l.map(|(w, r, t)| load(w, r, 1_000 * t)))
                            .collect(),
                    )
                })
                .collect();
            let store = MemStore::new();
            let mut memo = RoomsMemo::default();
            let pace = std::rc::Rc::new(Vec::new());
            let mut loads = std::rc::Rc::clone(&lists[0]);
            for (k, (what, at, learn)) in steps.into_iter().enumerate() {
                if what % 16 == 0 {
                    loads = std::rc::Rc::clone(&lists[what / 16 % lists.len()]);
                }
                let mine = Engines::read_memo(&store, &cfg, std::rc::Rc::clone(&loads), std::rc::Rc::clone(&pace), Some(&mut memo));
                let plain = Engines::read_with(&store, &cfg, std::rc::Rc::clone(&loads), std::rc::Rc::clone(&pace));
                proptest::prop_assert_eq!(&mine.rooms, &plain.rooms, "step {}", k);
                proptest::prop_assert_eq!(&mine.seen, &plain.seen, "step {}", k);
                proptest::prop_assert_eq!(mine.grew, plain.grew, "step {}", k);
                let placed = (what % 3 != 0).then_some(at % n);
                // Learns the slots the loads show only sometimes (as a decision that did not
                // record them), so that growth stays to be seen.
                let engines = Engines { grew: plain.grew && learn, ..plain };
                drop(mine);
                engines.record(&store, &cfg, placed, Some(&keep));
            }
        }
    }

    #[cfg(not(target_arch = "wasm32"))]
    proptest::proptest! {
        /// A placement counted in place gives the bytes that decoding, counting and encoding
        /// give, and declines only what that path would not find (an entry to insert, an
        /// undecodable record): records drawn sorted or not, of any version and length.
        #[test]
        fn sent_in_place_equals_decode_and_encode(
            entries in proptest::collection::vec((0u32..40, 0u32..20, 0u64..4, 0u32..5), 0..30),
            sorted in proptest::bool::ANY,
            cut in proptest::option::of(0usize..8),
            version in proptest::option::of(0u8..3),
            id in 0u32..40,
            (w, r, t) in (0u32..4, 0u32..20, 0u64..4),
            told in proptest::bool::ANY,
        ) {
            let mut entries = entries;
            if sorted {
                entries.sort_by_key(|e| e.0);
                entries.dedup_by_key(|e| e.0);
            }
            let mut bytes = Writer::with_capacity(0);
            bytes.u8(version.unwrap_or(VERSION));
            bytes.u32(entries.len() as u32);
            for (id, slots, scraped_ms, sent) in &entries {
                bytes.u32(*id);
                bytes.u32(*slots);
                bytes.u64(*scraped_ms);
                bytes.u32(*sent);
            }
            let mut bytes = bytes.buf;
            if let Some(c) = cut {
                bytes.truncate(bytes.len().saturating_sub(c));
            }
            let l = load(w, r, t);
            let keep: Vec<u32> = (0..40).collect();
            let decoded = Capacities::decode(&bytes);
            let mut fast = bytes.clone();
            // Told that the bytes decode only when they do (a worker's memo decoded them).
            let decodes = told && decoded.is_some();
            if sent_in_place(&mut fast, id, &l, decodes) {
                let mut caps = decoded.clone().unwrap_or_default();
                proptest::prop_assert!(decoded.is_some());
                proptest::prop_assert!(caps.find(id).0.is_some());
                caps.sent(id, &l, &keep);
                proptest::prop_assert_eq!(fast, caps.encode());
            } else {
                proptest::prop_assert_eq!(&fast, &bytes, "declined, yet changed");
                proptest::prop_assert!(decoded.is_none_or(|c| c.find(id).0.is_none()));
            }
        }
    }

    /// The memo patches a write over the same entries in place: a placement counted on an
    /// endpoint already in the record derives that endpoint's room alone.
    #[test]
    fn a_placement_patches_the_memo() {
        let eps: Vec<_> = (0..8)
            .map(|i| serde_json::json!({"name": format!("e{i}"), "cluster": format!("c{i}")}))
            .collect();
        let cfg = Config::from_value(&serde_json::json!({ "endpoints": eps })).unwrap();
        let keep: Vec<u32> = cfg.endpoints.iter().map(|e| e.id).collect();
        let loads = std::rc::Rc::new(
            (0..8)
                .map(|i| Some(load(1, 4 + i, 1_000)))
                .collect::<Vec<_>>(),
        );
        let pace = std::rc::Rc::new(Vec::new());
        let store = MemStore::new();
        let mut memo = RoomsMemo::default();
        let read = |memo: &mut RoomsMemo| {
            Engines::read_memo(
                &store,
                &cfg,
                std::rc::Rc::clone(&loads),
                std::rc::Rc::clone(&pace),
                Some(memo),
            )
        };
        // Learns every slot (every entry added), then counts placements on 3 and 5.
        read(&mut memo).record(&store, &cfg, None, Some(&keep));
        assert!(!read(&mut memo).grew);
        for i in [3, 5, 3] {
            read(&mut memo).record(&store, &cfg, Some(i), Some(&keep));
        }
        let e = read(&mut memo);
        assert_eq!(memo.patches, 3);
        assert_eq!(e.rooms[3].map(|r| r.sent), Some(2));
        assert_eq!(e.rooms[5].map(|r| r.projected), Some(1 + 9 + 1));
        assert_eq!(
            e.rooms,
            Engines::read_with(&store, &cfg, loads.clone(), pace.clone()).rooms
        );
    }

    /// Worked: a fleet of 4 + 16 + 4 + 16 = 40 slots. Below its slots an engine is within
    /// bound whatever the fleet's load; with 48 projected (20 % over), a small engine may hold
    /// 2 × 49 × 0.1 + 1 = 10.8, a large one 2 × 49 × 0.4 + 1 = 40.2.
    #[test]
    fn slot_limit_worked_numbers() {
        assert_eq!(slot_limit(0, 4, 40, 1.0), 4.0);
        assert_eq!(slot_limit(0, 16, 40, 1.0), 16.0);
        assert!((slot_limit(48, 4, 40, 1.0) - 10.8).abs() < 1e-9);
        assert!((slot_limit(48, 16, 40, 1.0) - 40.2).abs() < 1e-9);
        assert_eq!(slot_limit(48, 4, 0, 1.0), 4.0);
        // With epsilon 0, the excess is shared by slots exactly: 49 × 0.1 + 1.
        assert!((slot_limit(48, 4, 40, 0.0) - 5.9).abs() < 1e-9);
    }
}
