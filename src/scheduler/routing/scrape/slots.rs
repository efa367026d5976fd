//! Where the lease holder publishes what it scraped, and how every worker reads it: one small
//! key per endpoint slot of the configuration ([`slot_key`]), a bounded ring of the slots
//! written last ([`Changes`]) so that a request reads only what moved, and each worker's
//! [`LoadsMemo`] of the records.

use super::*;

/// The shared-data key of the combined loads value modules before slot keys wrote (every
/// endpoint's record in one value): emptied by the first lease holder that finds it
/// ([`retire_slots`]), so that an upgrade leaves no copy of a fleet's records behind.
pub const LEGACY_LOADS_KEY: &str = "computeflux/scrape/loads";

/// The prefix of the slot keys ([`slot_key`]): `computeflux/scrape/load/<slot>`.
pub const SLOT_PREFIX: &str = "computeflux/scrape/load/";

/// The shared-data key of the slot count the last lease holder's configuration used (version
/// `1`, u32): slots past a newer configuration's count are emptied ([`retire_slots`]).
pub const SLOTS_KEY: &str = "computeflux/scrape/slots";

const SLOT_VERSION: u8 = 1;
const SLOTS_VERSION: u8 = 1;
/// A slot's value: version, the endpoint id, its [`Scraped`] record.
pub(super) const SLOT_BYTES: usize = 1 + 4 + RECORD_BYTES;

/// The key of the `slot`-th scraped endpoint's record (its place among the sorted scraped ids).
pub fn slot_key(slot: usize) -> String {
    format!("{SLOT_PREFIX}{slot}")
}

/// A slot's value (codec: version `1` (u8), the endpoint id (u32), [`Scraped::encode`]).
pub fn encode_slot(id: u32, rec: &Scraped) -> Vec<u8> {
    let mut w = Writer::with_capacity(SLOT_BYTES);
    w.u8(SLOT_VERSION);
    w.u32(id);
    w.buf.extend_from_slice(&rec.encode());
    w.buf
}

/// `None` for anything but what [`encode_slot`] writes (an emptied slot included).
pub fn decode_slot(bytes: &[u8]) -> Option<(u32, Scraped)> {
    if bytes.len() != SLOT_BYTES || bytes.first() != Some(&SLOT_VERSION) {
        return None;
    }
    let id = u32::from_le_bytes(bytes.get(1..5)?.try_into().ok()?);
    Some((id, Scraped::decode(bytes.get(5..)?)?))
}

/// Empties the slots past `slots` that an earlier (larger) configuration used, and the
/// combined value of modules before slot keys; records `slots`. Run by a VM taking the lease
/// (a new configuration's scraper takes it): at most one write per retired slot, once.
/// Returns the slots emptied.
pub fn retire_slots(store: &dyn Store, slots: usize) -> usize {
    let stored = store.get(SLOTS_KEY).0.and_then(|b| {
        let mut r = Reader::new(&b);
        (r.u8()? == SLOTS_VERSION)
            .then(|| r.u32())
            .flatten()
            .filter(|_| r.is_empty())
    });
    let before = stored.map_or(0, |n| usize::try_from(n).unwrap_or(usize::MAX));
    let mut emptied = 0;
    for slot in slots..before {
        let key = slot_key(slot);
        if store.get(&key).0.is_some_and(|b| !b.is_empty()) && store.set(&key, &[], None).is_ok() {
            emptied += 1;
        }
    }
    if store.get(LEGACY_LOADS_KEY).0.is_some_and(|b| !b.is_empty()) {
        let _ = store.set(LEGACY_LOADS_KEY, &[], None);
    }
    if stored != u32::try_from(slots).ok() {
        let mut w = Writer::with_capacity(5);
        w.u8(SLOTS_VERSION);
        w.u32(u32::try_from(slots).unwrap_or(u32::MAX));
        let _ = store.set(SLOTS_KEY, &w.buf, None);
    }
    emptied
}

/// Every scraped endpoint's [`Scraped`] record, by endpoint id (`EndpointConfig::id`), as
/// read from the slot keys ([`read_loads`], [`LoadsMemo`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Loads {
    /// Sorted by id, ids distinct.
    pub entries: Vec<(u32, Scraped)>,
}

impl Loads {
    /// The endpoint's record, if it was ever scraped.
    pub fn get(&self, id: u32) -> Option<&Scraped> {
        let i = self.entries.binary_search_by_key(&id, |(k, _)| *k).ok()?;
        self.entries.get(i).map(|(_, rec)| rec)
    }

    /// The endpoint's load as the scheduler may use it at `now_ms` (absent: never scraped).
    pub fn state(&self, id: u32, now_ms: u64, stale_after_ms: u64) -> LoadState {
        match self.get(id) {
            Some(rec) => rec.state_at(now_ms, stale_after_ms),
            None => LoadState::Unknown(Unknown::NeverScraped),
        }
    }

    /// The endpoint's load quantized for placement, when it is known at `now_ms`.
    pub fn quantized(&self, id: u32, now_ms: u64, stale_after_ms: u64) -> Option<Quantized> {
        match self.state(id, now_ms, stale_after_ms) {
            LoadState::Known(load) => Some(quantize(&load)),
            LoadState::Unknown(_) => None,
        }
    }
}

/// The shared-data key of the change ring ([`Changes`]): which slots the last answers wrote.
pub const CHANGES_KEY: &str = "computeflux/scrape/changes";

const CHANGES_VERSION: u8 = 1;
/// Slots the change ring remembers: a reader more answers behind reads every slot.
pub const CHANGES_KEPT: usize = 256;

/// The slots the last [`CHANGES_KEPT`] answers wrote, and how many answers were folded in all.
///
/// Why: a request must see an answer as soon as it is published (the gauges show it at
/// once, and replicas that scraped the same load must place alike), but reading every slot to
/// find the changed ones would cost a host call per endpoint and request. The ring tells a
/// reader which slots moved since the answer count it last saw, so it reads those alone. One
/// writer (the lease holder) appends after writing the slot, so a reader that sees count `n`
/// finds the slots of answers up to `n` written.
///
/// Codec (little-endian): version `1` (u8), the count (u64), then [`CHANGES_KEPT`] slots
/// (u32), the answer numbered `k` (from 1) at `(k - 1) % CHANGES_KEPT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Changes {
    pub count: u64,
    pub slots: Vec<u32>,
}

impl Changes {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(9 + 4 * CHANGES_KEPT);
        w.u8(CHANGES_VERSION);
        w.u64(self.count);
        for k in 0..CHANGES_KEPT {
            w.u32(self.slots.get(k).copied().unwrap_or(0));
        }
        w.buf
    }

    pub fn decode(bytes: &[u8]) -> Option<Changes> {
        let mut r = Reader::new(bytes);
        if r.u8()? != CHANGES_VERSION || r.remaining() != 8 + 4 * CHANGES_KEPT {
            return None;
        }
        let count = r.u64()?;
        let slots = (0..CHANGES_KEPT)
            .map(|_| r.u32())
            .collect::<Option<Vec<u32>>>()?;
        Some(Changes { count, slots })
    }

    /// The count alone, without decoding the ring.
    fn count_of(bytes: &[u8]) -> Option<u64> {
        if bytes.len() != 9 + 4 * CHANGES_KEPT || bytes.first() != Some(&CHANGES_VERSION) {
            return None;
        }
        Some(u64::from_le_bytes(bytes.get(1..9)?.try_into().ok()?))
    }

    /// The slot of answer `k` (from 1), from the encoded ring.
    fn slot_of(bytes: &[u8], k: u64) -> Option<usize> {
        let at = usize::try_from(k.checked_sub(1)? % CHANGES_KEPT as u64).ok()?;
        let from = 9 + 4 * at;
        let slot = u32::from_le_bytes(bytes.get(from..from + 4)?.try_into().ok()?);
        usize::try_from(slot).ok()
    }
}

/// Appends `slot` to the change ring (bounded CAS retries; a lost append is caught up by the
/// readers' ticks, which read every slot).
pub(super) fn note_change(store: &dyn Store, slot: usize) {
    let slot = u32::try_from(slot).unwrap_or(u32::MAX);
    let _ = update(store, CHANGES_KEY, |bytes| {
        let mut c = bytes.and_then(Changes::decode).unwrap_or(Changes {
            count: 0,
            slots: vec![0; CHANGES_KEPT],
        });
        c.count = c.count.wrapping_add(1);
        let at = usize::try_from((c.count - 1) % CHANGES_KEPT as u64).unwrap_or(0);
        if let Some(e) = c.slots.get_mut(at) {
            *e = slot;
        }
        (c.encode(), ())
    });
}

/// One worker's decoded slot records, each with the CAS token of the value it was decoded
/// from, for the slot ids of one configuration.
///
/// Why: every request that picks reads the loads; reading every slot key per request would
/// cost a host call per endpoint. A read ([`LoadsMemo::read`]) reads the change ring
/// ([`Changes`]) and only the slots written since the answer count it last saw (every slot
/// when it is more than [`CHANGES_KEPT`] answers behind, or has never read them); the
/// worker's tick reads every slot ([`LoadsMemo::refresh`]), decoding only the values whose CAS
/// token moved, as a catch-up for anything the ring missed. Per VM, never shared; equals
/// [`read_loads`] of the same store after every read.
#[derive(Debug, Default)]
pub struct LoadsMemo {
    /// The slot ids, sorted (slot order), as last refreshed for.
    ids: Vec<u32>,
    /// By slot: the CAS token of the value decoded (`None`: absent, or never read).
    cas: Vec<Option<u32>>,
    /// Every slot read since `ids` were set.
    read_once: bool,
    /// The change ring's count as of the last read (`None`: unknown).
    seen: Option<u64>,
    loads: std::rc::Rc<Loads>,
    /// Grows with every change of `loads` (for memos of what is derived from them).
    pub version: u64,
    /// Slot values decoded (not taken from the memo), for tests and diagnostics.
    pub decoded: u64,
}

impl LoadsMemo {
    /// The loads for a request: the slots the change ring names since the last read, or
    /// every slot ([`LoadsMemo::refresh`]) when the ring cannot say.
    pub fn read(&mut self, store: &dyn Store, ids: &[u32]) -> std::rc::Rc<Loads> {
        let ring = store.get(CHANGES_KEY).0;
        let count = ring.as_deref().and_then(Changes::count_of);
        // The memo belongs to one configuration (the table cache it lives in): the same ids
        // at every read (compared by count: comparing them all cost every request a pass
        // over the fleet).
        let same_ids = self.read_once && self.ids.len() == ids.len();
        match (same_ids, self.seen, count) {
            (true, Some(seen), Some(now)) if now == seen => {}
            (true, Some(seen), Some(now)) if now > seen && now - seen <= CHANGES_KEPT as u64 => {
                let bytes = ring.as_deref().unwrap_or_default();
                let mut slots: Vec<usize> = (seen + 1..=now)
                    .filter_map(|k| Changes::slot_of(bytes, k))
                    .collect();
                slots.sort_unstable();
                slots.dedup();
                self.read_slots(store, &slots);
                self.seen = Some(now);
            }
            // No ring (nothing answered since the slots were read): nothing moved.
            (true, _, None) => {}
            _ => {
                self.refresh(store, ids);
                self.seen = count;
            }
        }
        std::rc::Rc::clone(&self.loads)
    }

    /// From a timer: every slot read (see [`LoadsMemo::refresh`]).
    pub fn tick(&mut self, store: &dyn Store, ids: &[u32]) -> std::rc::Rc<Loads> {
        let count = store
            .get(CHANGES_KEY)
            .0
            .as_deref()
            .and_then(Changes::count_of);
        self.refresh(store, ids);
        self.seen = count;
        std::rc::Rc::clone(&self.loads)
    }

    /// Reads every slot of `ids` (the slot ids, any order), decoding only the values whose
    /// CAS token moved; equals [`read_loads`] afterwards.
    pub fn refresh(&mut self, store: &dyn Store, ids: &[u32]) {
        let sorted = sorted_ids(ids);
        if self.ids != sorted.as_ref() {
            self.ids = sorted.into_owned();
            self.cas = vec![None; self.ids.len()];
            self.read_once = false;
        }
        let all: Vec<usize> = (0..self.ids.len()).collect();
        self.read_slots(store, &all);
    }

    /// Reads `slots` (increasing), decoding only the values whose CAS token moved.
    fn read_slots(&mut self, store: &dyn Store, slots: &[usize]) {
        let mut changed = !self.read_once;
        let mut entries: Option<Vec<(u32, Scraped)>> = None;
        for &slot in slots {
            let (Some(&id), Some(seen)) = (self.ids.get(slot), self.cas.get_mut(slot)) else {
                continue;
            };
            let (bytes, cas) = store.get(&slot_key(slot));
            // A store without tokens: decoded at every read.
            let same = self.read_once && *seen == cas && (cas.is_some() || bytes.is_none());
            if same {
                continue;
            }
            *seen = cas;
            let rec = bytes
                .as_deref()
                .and_then(decode_slot)
                .filter(|(k, _)| *k == id)
                .map(|(_, r)| r);
            self.decoded = self.decoded.saturating_add(1);
            let list = entries.get_or_insert_with(|| self.loads.entries.clone());
            let at = list.binary_search_by_key(&id, |(k, _)| *k);
            match (at, rec) {
                (Ok(i), Some(r)) => {
                    if let Some(e) = list.get_mut(i) {
                        if e.1 != r {
                            e.1 = r;
                            changed = true;
                        }
                    }
                }
                (Ok(i), None) => {
                    list.remove(i);
                    changed = true;
                }
                (Err(i), Some(r)) => {
                    list.insert(i, (id, r));
                    changed = true;
                }
                (Err(_), None) => {}
            }
        }
        if !self.read_once {
            // A new set of ids: entries of ids no longer configured go.
            let list = entries.get_or_insert_with(|| self.loads.entries.clone());
            let ids = &self.ids;
            list.retain(|(k, _)| ids.binary_search(k).is_ok());
        }
        self.read_once = true;
        if let (true, Some(list)) = (changed, entries) {
            self.loads = std::rc::Rc::new(Loads { entries: list });
            self.version = self.version.wrapping_add(1);
        }
    }
}

/// `ids` in increasing order: borrowed when they already are (the scraper keeps its ids so).
pub fn sorted_ids(ids: &[u32]) -> std::borrow::Cow<'_, [u32]> {
    if ids.windows(2).all(|w| w.first() <= w.last()) {
        std::borrow::Cow::Borrowed(ids)
    } else {
        let mut v = ids.to_vec();
        v.sort_unstable();
        std::borrow::Cow::Owned(v)
    }
}

/// The published loads of the scraped `ids` (any order): every slot read (absent, emptied,
/// undecodable or another endpoint's: none).
pub fn read_loads(store: &dyn Store, ids: &[u32]) -> Loads {
    let sorted = sorted_ids(ids);
    let entries = sorted
        .iter()
        .enumerate()
        .filter_map(|(slot, &id)| {
            let bytes = store.get(&slot_key(slot)).0?;
            let (k, rec) = decode_slot(&bytes)?;
            (k == id).then_some((id, rec))
        })
        .collect();
    Loads { entries }
}
