//! The other replicas' requests on each engine, as this Envoy process can tell them apart from
//! its own: the engine's scraped `running + waiting` less this process's in-flight attempts on
//! it at that scrape.
//!
//! Why: replicas of the filter share nothing. Each knows its own in-flight attempts exactly and
//! at once, and the engines' loads only from its own scrapes, up to an interval old. Counting
//! only its own attempts against an engine's slots, each of three replicas believed it owned
//! every slot and together they ran the engines up to their saturation threshold (≈ 5
//! waiting), where requests queue first come, first served and fairness no longer applies
//! (`noisy_neighbor`: the quiet tenant's p99 4.06 × its p99 alone with three replicas, 1.38 ×
//! with one). Counting the whole scrape against the slots instead (others' *and* its own)
//! leaves a slot idle until the next scrape after each of its own requests ends, since the
//! scrape still counts it.
//!
//! So the scrape is split at the moment it is taken: what the engine counts beyond this
//! process's own attempts is *the others'* ([`others_of`]), kept until the next scrape, while
//! this process's own share is read live. An endpoint's room for admission is then
//! `slots − others − own in flight now` (`fleet`): a slot this process frees it may fill at
//! once, and a slot another replica holds stays taken until a scrape shows it free.
//!
//! **Held over two scrapes** ([`Sighting::held`]): the larger of the last two scrapes' counts.
//! A scrape that lands between another replica's request ending and that replica filling the
//! slot again (its next admission round, a few ms) shows a slot free that is not; every
//! replica that read it would fill it, and the engine would queue. A slot the others really
//! gave up is taken one scrape later. With one Envoy the others' count is 0 and nothing
//! changes: its room is its slots less its own attempts.
//!
//! Record ([`Others`], one shared-data value under [`OTHERS_KEY`], per Envoy process): per
//! configured endpoint id, the scrape time of the last count, the last count and the one
//! before. Bounded by the configuration (entries of endpoints no longer scraped are dropped
//! on write). Written by the scraper once per scrape answer, read by admission's room.

use crate::scheduler::routing::scrape;
use crate::scheduler::state::codec::{Reader, Writer};
use crate::scheduler::state::store::{update_if, Store};
use crate::scheduler::wire::engine_load::EngineLoad;

/// The shared-data key of [`Others`].
pub const OTHERS_KEY: &str = "computeflux/admission/others";

const VERSION: u8 = 1;
/// Per entry: id (u32), scraped_ms (u64), last (u32), before (u32).
const ENTRY_BYTES: usize = 4 + 8 + 4 + 4;

/// The requests an engine ran for others (other replicas, other clients) at two scrapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sighting {
    /// The completion time of the scrape `last` was taken at.
    pub scraped_ms: u64,
    /// At that scrape.
    pub last: u32,
    /// At the scrape before it (0 before a second).
    pub before: u32,
}

impl Sighting {
    /// The others' requests to count now: the larger of the last two scrapes' (see the module
    /// doc: a slot freed between a request's end and its refill is not taken for free).
    pub fn held(&self) -> u32 {
        self.last.max(self.before)
    }
}

/// The others' requests on an engine: the engine's `running + waiting` less this process's
/// attempts in flight on it at the same moment (never below 0: an answer this process still
/// streams, or an attempt on its way, is counted here and not yet, or no longer, there).
pub fn others_of(engine_requests: u32, own_in_flight: u32) -> u32 {
    engine_requests.saturating_sub(own_in_flight)
}

/// An engine's requests as its scrape counts them: `running + waiting`; `None` without a
/// running count.
pub fn engine_requests(load: &EngineLoad) -> Option<u32> {
    Some(load.running?.saturating_add(load.waiting.unwrap_or(0)))
}

/// Every scraped endpoint's [`Sighting`], by endpoint id.
///
/// Codec (little-endian): version `1` (u8), entry count (u32), then per entry in strictly
/// increasing id order: id (u32), scraped_ms (u64), last (u32), before (u32). Anything else
/// decodes as `None` (read as no others seen).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Others {
    /// Sorted by id, ids distinct.
    entries: Vec<(u32, Sighting)>,
}

impl Others {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(5 + self.entries.len() * ENTRY_BYTES);
        w.u8(VERSION);
        w.u32(u32::try_from(self.entries.len()).unwrap_or(u32::MAX));
        for (id, s) in &self.entries {
            w.u32(*id);
            w.u64(s.scraped_ms);
            w.u32(s.last);
            w.u32(s.before);
        }
        w.buf
    }

    pub fn decode(bytes: &[u8]) -> Option<Others> {
        let mut r = Reader::new(bytes);
        if r.u8()? != VERSION {
            return None;
        }
        let n = usize::try_from(r.u32()?).ok()?;
        if r.remaining() != n.checked_mul(ENTRY_BYTES)? {
            return None;
        }
        let mut entries: Vec<(u32, Sighting)> = Vec::with_capacity(n);
        for _ in 0..n {
            let id = r.u32()?;
            if entries.last().is_some_and(|(last, _)| *last >= id) {
                return None;
            }
            let s = Sighting {
                scraped_ms: r.u64()?,
                last: r.u32()?,
                before: r.u32()?,
            };
            entries.push((id, s));
        }
        Some(Others { entries })
    }

    /// Endpoint `id`'s sighting (none yet: the default, no others).
    pub fn get(&self, id: u32) -> Sighting {
        self.entries
            .binary_search_by_key(&id, |(k, _)| *k)
            .ok()
            .and_then(|i| self.entries.get(i))
            .map(|(_, s)| *s)
            .unwrap_or_default()
    }

    /// Folds in a scrape of endpoint `id` completed at `scraped_ms` that counted
    /// `engine_requests` while this process had `own_in_flight` attempts on it; the entries of
    /// ids not in `keep` (the scraped ids) are dropped when an entry is added (entries are
    /// only ever added there, so the record stays within the ids scraped at the last
    /// addition). The same scrape twice counts once.
    /// Returns whether anything changed.
    pub fn observe(
        &mut self,
        id: u32,
        scraped_ms: u64,
        engine_requests: u32,
        own_in_flight: u32,
        keep: &[u32],
    ) -> bool {
        let was = self.get(id);
        if was.scraped_ms >= scraped_ms && was != Sighting::default() {
            return false;
        }
        let now = Sighting {
            scraped_ms,
            last: others_of(engine_requests, own_in_flight),
            before: was.last,
        };
        match self.entries.binary_search_by_key(&id, |(k, _)| *k) {
            Ok(i) => {
                if let Some(e) = self.entries.get_mut(i) {
                    e.1 = now;
                }
            }
            Err(i) => {
                self.entries.insert(i, (id, now));
                let sorted = scrape::sorted_ids(keep);
                self.entries
                    .retain(|(k, _)| sorted.binary_search(k).is_ok());
            }
        }
        true
    }
}

/// The stored record (absent or undecodable: no others seen).
pub fn read(store: &dyn Store) -> Others {
    store
        .get(OTHERS_KEY)
        .0
        .as_deref()
        .and_then(Others::decode)
        .unwrap_or_default()
}

/// [`Others::observe`] on the stored record (bounded CAS retries; a lost race loses this
/// scrape's count, and the previous one holds until the next).
pub fn observe(
    store: &dyn Store,
    id: u32,
    scraped_ms: u64,
    engine_requests: u32,
    own_in_flight: u32,
    keep: &[u32],
) -> bool {
    update_if(store, OTHERS_KEY, |bytes| {
        let mut o = bytes.and_then(Others::decode).unwrap_or_default();
        let changed = o.observe(id, scraped_ms, engine_requests, own_in_flight, keep);
        (changed.then(|| o.encode()), changed)
    })
    .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::state::store::MemStore;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn the_others_are_the_scrape_less_this_processs_attempts() {
        assert_eq!(others_of(2, 0), 2);
        assert_eq!(others_of(2, 2), 0, "one Envoy alone: nobody else");
        assert_eq!(others_of(5, 1), 4);
        // An answer still streaming here that the engine finished: not below 0.
        assert_eq!(others_of(1, 2), 0);
    }

    /// Three scrapes of a 2-slot engine shared with another replica: it holds one slot, then
    /// its request ends just before the second scrape (the slot looks free for a moment), then
    /// it holds one again. The held count stays 1 throughout; a slot given up for two scrapes
    /// is free.
    #[test]
    fn a_slot_freed_for_one_scrape_stays_taken() {
        let keep = [7];
        let store = MemStore::new();
        assert!(observe(&store, 7, 1_000, 2, 1, &keep));
        assert_eq!(read(&store).get(7).held(), 1);
        assert!(observe(&store, 7, 1_250, 1, 1, &keep));
        assert_eq!(
            read(&store).get(7),
            Sighting {
                scraped_ms: 1_250,
                last: 0,
                before: 1
            }
        );
        assert_eq!(read(&store).get(7).held(), 1);
        assert!(observe(&store, 7, 1_500, 2, 1, &keep));
        assert_eq!(read(&store).get(7).held(), 1);
        // The other replica gave the slot up: free after two scrapes.
        observe(&store, 7, 1_750, 1, 1, &keep);
        assert_eq!(read(&store).get(7).held(), 1);
        observe(&store, 7, 2_000, 1, 1, &keep);
        assert_eq!(read(&store).get(7).held(), 0);
        // The same scrape folded twice (two workers' answers) counts once; an older one not.
        assert!(!observe(&store, 7, 2_000, 2, 0, &keep));
        assert!(!observe(&store, 7, 1_900, 2, 0, &keep));
        assert_eq!(read(&store).get(7).held(), 0);
        // Never seen: no others.
        assert_eq!(read(&store).get(8), Sighting::default());
    }

    #[test]
    fn entries_stay_bounded_by_the_scraped_ids_and_round_trip() {
        let mut o = Others::default();
        assert!(o.observe(9, 5, 3, 1, &[9, 3]));
        assert!(o.observe(3, 5, 2, 0, &[9, 3]));
        let bytes = o.encode();
        assert_eq!(bytes.len(), 5 + 2 * ENTRY_BYTES);
        assert_eq!(Others::decode(&bytes), Some(o.clone()));
        assert_eq!(o.get(9).held(), 2);
        // Endpoint 3 is no longer scraped, 4 is new: 3 dropped when 4 is added.
        o.observe(9, 6, 3, 3, &[9, 4]);
        assert_eq!(o.get(9).held(), 2, "the scrape before still counts");
        o.observe(4, 6, 1, 0, &[9, 4]);
        assert_eq!(o.get(3), Sighting::default());
        assert_eq!(o.encode().len(), 5 + 2 * ENTRY_BYTES);
        // Undecodable: none.
        assert_eq!(Others::decode(&[2, 0, 0, 0, 0]), None);
        assert_eq!(Others::decode(&bytes[..bytes.len() - 1]), None);
        let mut unsorted = Others::default().encode();
        unsorted[1] = 2;
        for id in [5u32, 4] {
            unsorted.extend_from_slice(&id.to_le_bytes());
            unsorted.extend_from_slice(&[0; ENTRY_BYTES - 4]);
        }
        assert_eq!(Others::decode(&unsorted), None);
        assert_eq!(read(&MemStore::new()), Others::default());
    }
}
