//! This Envoy's share of the fleet's slots when replicas share nothing: how many requests it
//! may have in flight on a model's engines, from what it alone can see.
//!
//! Why: replicas of the filter share nothing. Each knows its own in-flight attempts exactly and
//! at once, and the engines' loads only from its own scrapes, up to an interval (250 ms) old.
//! Counting only its own attempts against the engines' slots, each of three replicas believed
//! it owned every slot and together they ran the engines up to their saturation threshold (≈ 5
//! waiting), where requests queue first come, first served and fairness no longer applies
//! (`noisy_neighbor`: the quiet tenant's p99 4.06 × its p99 alone with three replicas, 1.38 ×
//! with one). Counting the whole scrape against the slots instead left a slot idle until the
//! next scrape after each of its own requests ended (the scrape still counts it); counting the
//! others' requests seen at the scrape as theirs for good starved a replica that held none (a
//! quiet request waited 9.3 s there while the other two kept every slot).
//!
//! **What each replica sees.** At each scrape of an engine, the scraper records this process's
//! in-flight attempts on it (`own_at_scrape`, [`Record`]): the engine's `running + waiting` `T`
//! less that part `m` is *the others'* load. With its slots `S` and this Envoy's in-flight
//! attempts now `n`:
//!
//! **The rule** ([`allowance`], per engine): this Envoy may have `A` requests in flight on it:
//! - nobody else's at the scrape (`T = m`, always with one Envoy): `A = S`, its room is its
//!   slots less its own attempts, exact and immediate — a slot its request frees it fills at
//!   once;
//! - the engine had free slots at the scrape (`T ≤ S`): `A = S − (T − m)`, every slot the
//!   others did not hold;
//! - it queued (`T > S`): `A = m × S / T`, its part of the load scaled to the slots. The
//!   replicas' allowances then sum to `S`: the queue drains without any replica knowing how
//!   many there are.
//!
//! The model's free places ([`free`]) are the sum over its engines of `A − n` where positive,
//! rounded down once (the fractions of several engines make whole places); and one at least
//! while this Envoy has nothing in flight on them (*the floor*).
//!
//! Free slots are taken by every replica that sees them (an increase equal for all), an excess
//! is given back in proportion to what each held (a decrease by share): the additive-increase,
//! multiplicative-decrease of TCP congestion control (Chiu and Jain, 1989), which brings
//! replicas with the same demand towards the same share, where keeping the others' load as
//! theirs kept whatever share each had first. Under overload the others refill a freed slot
//! within milliseconds, so a scrape rarely shows one free: the floor is what lets a replica
//! that holds nothing in (and its excess then makes the others give back by share). The cost:
//! each scrape that shows `F` slots free lets up to `N × F` in across `N` replicas, the floor
//! up to `N − 1` more, and the engines queue the excess until the next scrape (250 ms) has it
//! given back.
//!
//! Record ([`Record`], one shared-data value under [`SHARE_KEY`], per Envoy process): per
//! scraped endpoint id, the scrape time and this process's in-flight attempts then. Bounded by
//! the configuration (entries of endpoints no longer scraped are dropped when one is added).
//! Written by the scraper once per scrape answer, read by admission's room.

use crate::scheduler::routing::scrape;
use crate::scheduler::state::codec::{Reader, Writer};
use crate::scheduler::state::store::{update_if, Store};

/// The shared-data key of [`Record`].
pub const SHARE_KEY: &str = "computeflux/admission/share";

const VERSION: u8 = 1;
/// Per entry: id (u32), scraped_ms (u64), own (u32).
const ENTRY_BYTES: usize = 4 + 8 + 4;

/// One engine as admission counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Engine {
    /// Its slots (learned, `routing::select::capacity`).
    pub slots: u32,
    /// Its `running + waiting` at its last scrape.
    pub scraped: u32,
    /// This Envoy's in-flight attempts on it at that scrape.
    pub own_at_scrape: u32,
    /// This Envoy's in-flight attempts on it now.
    pub own: u32,
}

/// How many requests this Envoy may have in flight on engine `e` (see the module doc): its
/// slots when the scrape showed nobody else's; else the slots the others did not hold when it
/// had free ones; else this Envoy's part scaled to the slots (a fraction: the model's places
/// are the sum of its engines', rounded down once).
pub fn allowance(e: &Engine) -> f64 {
    // An answer this process still streams, or an attempt on its way, is counted here and
    // not yet, or no longer, by the engine: its part is at most the engine's count.
    let mine = e.own_at_scrape.min(e.scraped);
    let others = e.scraped - mine;
    if others == 0 {
        f64::from(e.slots)
    } else if e.scraped <= e.slots {
        f64::from(e.slots - others)
    } else {
        f64::from(mine) * f64::from(e.slots) / f64::from(e.scraped)
    }
}

/// The free places for admission on `engines`: per engine its allowance plus `extra` (a
/// burst's places) less this Envoy's attempts on it now, summed and rounded down. An engine
/// over its allowance takes nothing from the others' places (the routing places requests on
/// engines with room).
pub fn free(engines: &[Engine], extra: u32) -> u32 {
    let free: f64 = engines
        .iter()
        .map(|e| (allowance(e) + f64::from(extra) - f64::from(e.own)).max(0.0))
        .sum();
    // Within u32 (a sum of u32 slot counts); `as` saturates.
    let free = (free + 1e-9).floor() as u32;
    // The floor: one request in flight at least, or a replica that holds nothing never sees a
    // slot free (the others fill theirs again within milliseconds of a scrape).
    let idle = !engines.is_empty() && engines.iter().all(|e| e.own == 0);
    if idle {
        free.max(1)
    } else {
        free
    }
}

/// Which of `engines` an admitted request may be placed on (aligned with `engines`): those with
/// a whole free place (allowance less this Envoy's attempts, at least one); when none has one
/// (a place made of fractions, or the floor), those with the most. The model's free places are
/// a sum over its engines, so without this the routing's own order could put an admitted
/// request on an engine already at its allowance while another had the free slot, and the
/// engine would queue it, first come first served.
pub fn places(engines: &[Engine]) -> Vec<bool> {
    let free: Vec<f64> = engines
        .iter()
        .map(|e| allowance(e) - f64::from(e.own))
        .collect();
    let best = free.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let bar = if best >= 1.0 - 1e-9 { 1.0 - 1e-9 } else { best };
    free.iter().map(|&f| f >= bar).collect()
}

/// This process's in-flight attempts on every scraped endpoint at its last scrape, by id.
///
/// Codec (little-endian): version `1` (u8), entry count (u32), then per entry in strictly
/// increasing id order: id (u32), scraped_ms (u64), own (u32). Anything else decodes as
/// `None` (read as nothing recorded).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Record {
    /// Sorted by id, ids distinct: (id, scraped_ms, own).
    entries: Vec<(u32, u64, u32)>,
}

impl Record {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(5 + self.entries.len() * ENTRY_BYTES);
        w.u8(VERSION);
        w.u32(u32::try_from(self.entries.len()).unwrap_or(u32::MAX));
        for (id, at, own) in &self.entries {
            w.u32(*id);
            w.u64(*at);
            w.u32(*own);
        }
        w.buf
    }

    pub fn decode(bytes: &[u8]) -> Option<Record> {
        let mut r = Reader::new(bytes);
        if r.u8()? != VERSION {
            return None;
        }
        let n = usize::try_from(r.u32()?).ok()?;
        if r.remaining() != n.checked_mul(ENTRY_BYTES)? {
            return None;
        }
        let mut entries: Vec<(u32, u64, u32)> = Vec::with_capacity(n);
        for _ in 0..n {
            let id = r.u32()?;
            if entries.last().is_some_and(|(last, _, _)| *last >= id) {
                return None;
            }
            entries.push((id, r.u64()?, r.u32()?));
        }
        Some(Record { entries })
    }

    /// This process's attempts on endpoint `id` at the scrape completed at `scraped_ms`, if
    /// that scrape was recorded.
    pub fn own_at(&self, id: u32, scraped_ms: u64) -> Option<u32> {
        let i = self.entries.binary_search_by_key(&id, |e| e.0).ok()?;
        let (_, at, own) = self.entries.get(i)?;
        (*at == scraped_ms).then_some(*own)
    }

    /// Records `own` attempts on endpoint `id` at the scrape completed at `scraped_ms`; the
    /// entries of ids not in `keep` (the scraped ids) are dropped when an entry is added
    /// (entries are only ever added here, so the record stays within the ids scraped at the
    /// last addition). Returns whether anything changed.
    pub fn observe(&mut self, id: u32, scraped_ms: u64, own: u32, keep: &[u32]) -> bool {
        match self.entries.binary_search_by_key(&id, |e| e.0) {
            Ok(i) => match self.entries.get_mut(i) {
                Some(e) if (e.1, e.2) != (scraped_ms, own) => {
                    *e = (id, scraped_ms, own);
                    true
                }
                _ => false,
            },
            Err(i) => {
                self.entries.insert(i, (id, scraped_ms, own));
                let sorted = scrape::sorted_ids(keep);
                self.entries
                    .retain(|(k, _, _)| sorted.binary_search(k).is_ok());
                true
            }
        }
    }
}

/// The stored record (absent or undecodable: nothing recorded). Admission reads it in place
/// ([`View`]); decoded whole, it is what the tests compare.
#[cfg(test)]
fn read(store: &dyn Store) -> Record {
    store
        .get(SHARE_KEY)
        .0
        .as_deref()
        .and_then(Record::decode)
        .unwrap_or_default()
}

/// The stored record as its bytes, read in place ([`View::own_at`]): a look-up costs a binary
/// search, where decoding the whole record cost every arrival an amount that grew with the
/// fleet. Bytes that do not hold a well-formed record read as nothing recorded.
#[derive(Debug, Clone, Default)]
pub struct View {
    bytes: Vec<u8>,
    entries: usize,
}

impl View {
    pub fn read(store: &dyn Store) -> View {
        View::of(store.get(SHARE_KEY).0.unwrap_or_default())
    }

    pub fn of(bytes: Vec<u8>) -> View {
        let count = bytes
            .get(1..5)
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map(u32::from_le_bytes)
            .and_then(|n| usize::try_from(n).ok());
        let entries = match (bytes.first(), count) {
            (Some(&VERSION), Some(n))
                if n.checked_mul(ENTRY_BYTES).and_then(|b| b.checked_add(5))
                    == Some(bytes.len()) =>
            {
                n
            }
            _ => 0,
        };
        View { bytes, entries }
    }

    fn entry(&self, i: usize) -> Option<(u32, u64, u32)> {
        let b = self
            .bytes
            .get(5 + i * ENTRY_BYTES..5 + (i + 1) * ENTRY_BYTES)?;
        let id = u32::from_le_bytes(b.get(0..4)?.try_into().ok()?);
        let at = u64::from_le_bytes(b.get(4..12)?.try_into().ok()?);
        let own = u32::from_le_bytes(b.get(12..16)?.try_into().ok()?);
        Some((id, at, own))
    }

    /// [`Record::own_at`] of the record these bytes hold (entries sorted by id, as written).
    pub fn own_at(&self, id: u32, scraped_ms: u64) -> Option<u32> {
        let (mut lo, mut hi) = (0usize, self.entries);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let (at_id, at, own) = self.entry(mid)?;
            match at_id.cmp(&id) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => return (at == scraped_ms).then_some(own),
            }
        }
        None
    }
}

/// [`Record::observe`] on the stored record (bounded CAS retries; a lost race loses this
/// scrape's count: admission then takes the attempts in flight now for it).
pub fn observe(store: &dyn Store, id: u32, scraped_ms: u64, own: u32, keep: &[u32]) -> bool {
    update_if(store, SHARE_KEY, |bytes| {
        let mut r = bytes.and_then(Record::decode).unwrap_or_default();
        let changed = r.observe(id, scraped_ms, own, keep);
        (changed.then(|| r.encode()), changed)
    })
    .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::state::store::MemStore;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn engine(slots: u32, scraped: u32, own_at_scrape: u32, own: u32) -> Engine {
        Engine {
            slots,
            scraped,
            own_at_scrape,
            own,
        }
    }

    #[test]
    fn the_view_reads_what_the_record_holds() {
        let mut r = Record::default();
        let keep: Vec<u32> = (1..=40).collect();
        for id in (1..=40).rev().step_by(3) {
            r.observe(id, 1_000 + u64::from(id), id * 2, &keep);
        }
        let v = View::of(r.encode());
        for id in 0..=42 {
            for at in [1_000 + u64::from(id), 7] {
                assert_eq!(v.own_at(id, at), r.own_at(id, at), "id {id} at {at}");
            }
        }
        // Not a record: nothing recorded.
        let mut bad = r.encode();
        bad.pop();
        assert_eq!(View::of(bad).own_at(40, 1_040), None);
        assert_eq!(View::of(Vec::new()).own_at(40, 1_040), None);
        assert_eq!(View::of(vec![9, 1, 0, 0, 0]).own_at(40, 1_040), None);
    }

    #[test]
    fn one_envoy_alone_has_every_slot() {
        // Two 2-slot engines, all four slots this Envoy's at the scrape; one ended since.
        let e = [engine(2, 2, 2, 1), engine(2, 2, 2, 2)];
        assert_eq!(allowance(&e[0]), 2.0);
        assert_eq!(free(&e, 0), 1, "the slot it freed, at once");
        // An answer still streaming here that the engine finished: not counted twice.
        assert_eq!(allowance(&engine(2, 1, 2, 2)), 2.0);
        // A burst's places on top; an engine over its slots takes none of the other's.
        assert_eq!(free(&[engine(2, 2, 2, 2)], 1), 1);
        assert_eq!(free(&[engine(2, 3, 3, 3), engine(2, 1, 1, 1)], 0), 1);
    }

    #[test]
    fn free_slots_go_to_whoever_sees_them_held_ones_stay_taken() {
        // 4-slot engines; the others held 3 and 2 at the scrape, this Envoy 1 on each.
        let e = [engine(4, 4, 1, 1), engine(4, 3, 1, 1)];
        assert_eq!(allowance(&e[0]), 1.0);
        assert_eq!(allowance(&e[1]), 2.0);
        assert_eq!(free(&e, 0), 1);
        // A replica holding nothing sees the free slot too.
        let e = [engine(4, 4, 0, 0), engine(4, 3, 0, 0)];
        assert_eq!(free(&e, 0), 1);
        // Full, nothing of its own: the floor, one.
        assert_eq!(free(&[engine(8, 8, 0, 0)], 0), 1);
        assert_eq!(free(&[engine(8, 8, 1, 1)], 0), 0);
        assert_eq!(free(&[], 0), 0, "nothing counted: nothing free");
    }

    /// Three replicas that each took the one free slot they saw (8 slots, 10 at the next
    /// scrape): each keeps its part of the load scaled by 8 / 10, together the slots.
    #[test]
    fn an_excess_is_given_back_in_proportion() {
        let parts = [5u32, 4, 1];
        let a: Vec<f64> = parts
            .iter()
            .map(|&m| allowance(&engine(8, 10, m, m)))
            .collect();
        assert_eq!(a, vec![4.0, 3.2, 0.8]);
        assert_eq!(a.iter().sum::<f64>(), 8.0);
        let f: Vec<u32> = parts
            .iter()
            .map(|&m| free(&[engine(8, 10, m, m)], 0))
            .collect();
        assert_eq!(
            f,
            vec![0, 0, 0],
            "each over its allowance: nothing until some end"
        );
        assert_eq!(free(&[engine(8, 10, 5, 3)], 0), 1);
        // Fractions of two engines make a place: 2 × (1 × 2 / 3) − 0 = 1.33 (and a third
        // engine with its one slot taken by this Envoy).
        let full = engine(2, 2, 1, 1);
        assert_eq!(free(&[engine(2, 3, 1, 0), engine(2, 3, 1, 0), full], 0), 1);
        assert_eq!(free(&[engine(2, 3, 1, 0), full], 0), 0);
        // Nothing in flight at all: the floor.
        assert_eq!(free(&[engine(2, 3, 1, 0)], 0), 1);
    }

    /// From a share of one slot in eight, a replica reaches an equal share: each scrape with a
    /// free slot lets all three in once, each excess is given back by share.
    #[test]
    fn replicas_with_the_same_demand_converge_to_the_same_share() {
        let slots = 8u32;
        let mut held = [6u32, 1, 1];
        for round in 0..40 {
            let total: u32 = held.iter().sum();
            let next: Vec<u32> = held
                .iter()
                .map(|&m| m + free(&[engine(slots, total, m, m)], 0))
                .map(|n| n.min(slots))
                .collect();
            // Over the allowance: requests end until within it (rounded to the nearest).
            let next: Vec<u32> = next
                .iter()
                .zip(&held)
                .map(|(&n, &m)| {
                    let a = allowance(&engine(slots, total, m, m)).round() as u32;
                    if n > a {
                        a
                    } else {
                        n
                    }
                })
                .collect();
            held = [next[0], next[1], next[2]];
            // Every few rounds a request ends at a scrape: one slot looks free to all.
            if round % 3 == 0 {
                let i = held.iter().enumerate().max_by_key(|(_, m)| **m).unwrap().0;
                held[i] -= 1;
            }
        }
        let (lo, hi) = (held.iter().min().unwrap(), held.iter().max().unwrap());
        assert!(hi - lo <= 1, "shares {held:?}");
    }

    #[test]
    fn an_admitted_request_goes_where_a_place_is_free() {
        // One Envoy: the engine with a free slot, not the one at its slots.
        assert_eq!(
            places(&[engine(2, 2, 2, 2), engine(2, 1, 1, 1), engine(2, 2, 2, 2)]),
            vec![false, true, false]
        );
        // A slot freed since the scrape is free at once; an engine over its slots has none.
        assert_eq!(
            places(&[engine(2, 2, 2, 1), engine(2, 3, 3, 3)]),
            vec![true, false]
        );
        // Several with a whole place: all of them (the routing's order chooses among them).
        assert_eq!(
            places(&[engine(4, 2, 2, 2), engine(2, 0, 0, 0)]),
            vec![true, true]
        );
        // Only fractions (other replicas' load): the largest. 1 × 2/3 − 0 against
        // 2 × 2/5 − 0.
        assert_eq!(
            places(&[engine(2, 3, 1, 0), engine(2, 5, 2, 0)]),
            vec![false, true]
        );
        // Nothing free anywhere (the floor let it in): the least over its allowance.
        assert_eq!(
            places(&[engine(2, 4, 0, 0), engine(2, 2, 2, 2)]),
            vec![true, true]
        );
        assert_eq!(
            places(&[engine(2, 2, 2, 3), engine(2, 2, 2, 2)]),
            vec![false, true]
        );
        assert!(places(&[]).is_empty());
    }

    #[test]
    fn the_record_keeps_one_scrape_per_scraped_endpoint_and_round_trips() {
        let store = MemStore::new();
        let keep = [3, 9];
        assert!(observe(&store, 9, 1_000, 2, &keep));
        assert!(observe(&store, 3, 1_000, 0, &keep));
        assert!(!observe(&store, 9, 1_000, 2, &keep), "unchanged: no write");
        let r = read(&store);
        assert_eq!(r.own_at(9, 1_000), Some(2));
        assert_eq!(r.own_at(9, 1_250), None, "another scrape: not recorded");
        assert_eq!(r.own_at(4, 1_000), None);
        assert_eq!(Record::decode(&r.encode()), Some(r.clone()));
        assert_eq!(r.encode().len(), 5 + 2 * ENTRY_BYTES);
        // Endpoint 3 no longer scraped, 4 new: 3 dropped when 4 is added.
        assert!(observe(&store, 4, 1_250, 1, &[4, 9]));
        let r = read(&store);
        assert_eq!(r.own_at(3, 1_000), None);
        assert_eq!(r.encode().len(), 5 + 2 * ENTRY_BYTES);
        // Undecodable: nothing recorded.
        assert_eq!(Record::decode(&[2, 0, 0, 0, 0]), None);
        let bytes = r.encode();
        assert_eq!(Record::decode(&bytes[..bytes.len() - 1]), None);
        let mut unsorted = Record::default().encode();
        unsorted[1] = 2;
        for id in [5u32, 4] {
            unsorted.extend_from_slice(&id.to_le_bytes());
            unsorted.extend_from_slice(&[0; ENTRY_BYTES - 4]);
        }
        assert_eq!(Record::decode(&unsorted), None);
        assert_eq!(read(&MemStore::new()), Record::default());
    }
}
