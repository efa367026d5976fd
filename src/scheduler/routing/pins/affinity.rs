//! Session affinity: session → the endpoint that last served it successfully, with an idle TTL.
//!
//! A TTL cache rather than a hash of the session: it adapts (a failover success re-pins the
//! session to the endpoint that now holds its KV cache) and can be evicted on hard failures.
//!
//! Envoy never frees a shared-data key, so there is no key per session. Sessions live in a
//! fixed set of hashed buckets (one shared-data value each, written with CAS), each holding at
//! most its share of `affinity_max_sessions` entries. A write prunes expired entries and, when
//! the bucket is still full, evicts the least recently used one: memory is bounded by
//! `affinity_max_sessions × 28 bytes` whatever sessions arrive. Entries hold a 64-bit hash of
//! the (tenant-scoped) session id, never the id itself.
//!
//! An entry also records the prefix key its session was placed by (0: none or unknown; see
//! `wire::prefix`): a later turn's home is that key's, so an affinity hit takes it from here
//! instead of hashing its instructions again (the hottest request of a multi-turn workload
//! spares about 2.5 wasm instructions per byte of system prompt and tools). Buckets of the
//! previous version (no key) are read as entries with an unknown key and rewritten in this
//! version by their next write: an upgrade keeps every pin.
//!
//! A bucket of a *later* version (a newer module beside this one during an upgrade, same
//! `vm_id`) is left as it is: not read (no pin found there) and never written, so this
//! module cannot take it for empty and overwrite the newer module's pins. Only a bucket that
//! is not any version's (garbage, a version this code knows with a broken length) is read as
//! empty and rewritten. Before this rule, an old module still draining read a newer bucket as
//! empty and overwrote it, up to 64 pins a write.

use crate::scheduler::state::codec::{Reader, Writer};
use crate::scheduler::state::store::{numbered_key, update_if, Store};

/// Entries per bucket aimed for: small values keep each CAS write cheap.
const TARGET_PER_BUCKET: u64 = 64;
const MAX_BUCKETS: u64 = 4096;
const BUCKET_VERSION: u8 = 2;
/// Version bytes up to this are versions (later ones are left alone, [`is_later`]); above
/// it, garbage.
const MAX_BUCKET_VERSION: u8 = 63;
/// Buckets written before entries recorded a placement key.
const BUCKET_VERSION_1: u8 = 1;
const ENTRY_BYTES_1: usize = 20;
pub const ENTRY_BYTES: usize = 28;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub session: u64,
    pub endpoint_id: u32,
    pub last_used_ms: u64,
    /// The prefix key the session was last placed or served by (0: none or unknown).
    pub placement_key: u64,
}

/// The bucketed affinity table over a [`Store`].
pub struct Affinity<'a> {
    store: &'a dyn Store,
    prefix: &'static str,
    ttl_ms: u64,
    max_sessions: u64,
    buckets: u64,
}

/// Shared-data key prefix of the buckets.
pub const KEY_PREFIX: &str = "computeflux/affinity/";

/// Shared-data key prefix of the move marks: the same bucketed table, whose entries say why a
/// session was last moved away from its pin (the endpoint field holds the reason code of
/// `saturation::MoveReason`), so that it is not moved twice within its TTL for the same
/// reason. Written only on such a move (rare), bounded like the pins.
pub const MOVES_PREFIX: &str = "computeflux/moved/";

impl<'a> Affinity<'a> {
    pub fn new(store: &'a dyn Store, ttl_ms: u64, max_sessions: u64) -> Self {
        Self::with_prefix(store, KEY_PREFIX, ttl_ms, max_sessions)
    }

    /// The same table under another key prefix (see [`MOVES_PREFIX`]).
    pub fn with_prefix(
        store: &'a dyn Store,
        prefix: &'static str,
        ttl_ms: u64,
        max_sessions: u64,
    ) -> Self {
        let buckets = max_sessions
            .div_ceil(TARGET_PER_BUCKET)
            .clamp(1, MAX_BUCKETS);
        Affinity {
            store,
            prefix,
            ttl_ms,
            max_sessions,
            buckets,
        }
    }

    pub fn buckets(&self) -> u64 {
        self.buckets
    }

    fn bucket_of(&self, session: u64) -> u64 {
        // Multiply-shift: uniform for a uniform hash, no modulo bias worth mentioning.
        ((u128::from(session) * u128::from(self.buckets)) >> 64) as u64
    }

    /// Entries bucket `b` may hold; the capacities add up to exactly `max_sessions`.
    pub fn capacity(&self, b: u64) -> usize {
        let base = self.max_sessions / self.buckets;
        let extra = u64::from(b < self.max_sessions % self.buckets);
        (base + extra) as usize
    }

    fn key(&self, b: u64) -> String {
        numbered_key(&[self.prefix], b)
    }

    /// The pinned endpoint id of a live (not idle past the TTL) entry.
    pub fn lookup(&self, session: u64, now_ms: u64) -> Option<u32> {
        self.lookup_keyed(session, now_ms).map(|(id, _)| id)
    }

    /// The pinned endpoint id of a live entry and the placement key it recorded (0: none or
    /// unknown).
    pub fn lookup_keyed(&self, session: u64, now_ms: u64) -> Option<(u32, u64)> {
        let (bytes, _) = self.store.get(&self.key(self.bucket_of(session)));
        let e = find(bytes.as_deref()?, session)?;
        (now_ms.saturating_sub(e.last_used_ms) < self.ttl_ms)
            .then_some((e.endpoint_id, e.placement_key))
    }

    /// Pins `session` to `endpoint_id` (a success: refresh, or re-pin after failover).
    /// Returns false if the CAS retries were exhausted.
    pub fn remember(&self, session: u64, endpoint_id: u32, now_ms: u64) -> bool {
        self.remember_keyed(session, endpoint_id, 0, now_ms)
    }

    /// [`Affinity::remember`], recording the prefix key the session was placed by (0: none).
    pub fn remember_keyed(
        &self,
        session: u64,
        endpoint_id: u32,
        placement_key: u64,
        now_ms: u64,
    ) -> bool {
        let b = self.bucket_of(session);
        let cap = self.capacity(b);
        let ttl = self.ttl_ms;
        update_if(self.store, &self.key(b), |bytes| {
            if bytes.is_some_and(is_later) {
                return (None, ());
            }
            let mut entries = bytes.and_then(decode).unwrap_or_default();
            entries.retain(|e| e.session != session && now_ms.saturating_sub(e.last_used_ms) < ttl);
            while entries.len() >= cap.max(1) {
                let lru = entries
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, e)| e.last_used_ms)
                    .map(|(i, _)| i);
                match lru {
                    Some(i) => {
                        entries.swap_remove(i);
                    }
                    None => break,
                }
            }
            if cap > 0 {
                entries.push(Entry {
                    session,
                    endpoint_id,
                    last_used_ms: now_ms,
                    placement_key,
                });
            }
            (Some(encode(&entries)), ())
        })
        .is_ok()
    }

    /// Drops the pin of `session` if it points at `endpoint_id` (a hard failure there).
    pub fn forget(&self, session: u64, endpoint_id: u32) -> bool {
        let b = self.bucket_of(session);
        let (bytes, _) = self.store.get(&self.key(b));
        let pinned = bytes.as_deref().and_then(decode).is_some_and(|es| {
            es.iter()
                .any(|e| e.session == session && e.endpoint_id == endpoint_id)
        });
        if !pinned {
            return true;
        }
        update_if(self.store, &self.key(b), |bytes| {
            if bytes.is_some_and(is_later) {
                return (None, ());
            }
            let mut entries = bytes.and_then(decode).unwrap_or_default();
            entries.retain(|e| !(e.session == session && e.endpoint_id == endpoint_id));
            (Some(encode(&entries)), ())
        })
        .is_ok()
    }

    /// Total entries stored (live or not yet pruned): for tests and the memory report.
    pub fn stored_entries(&self) -> usize {
        (0..self.buckets)
            .map(|b| {
                self.store
                    .get(&self.key(b))
                    .0
                    .as_deref()
                    .and_then(decode)
                    .map_or(0, |e| e.len())
            })
            .sum()
    }
}

/// A bucket written by a later version of this code (its version byte above ours): left
/// untouched (see the module doc). Version bytes are small; a byte above
/// [`MAX_BUCKET_VERSION`] is garbage, not a version.
pub fn is_later(bytes: &[u8]) -> bool {
    bytes
        .first()
        .is_some_and(|v| (BUCKET_VERSION + 1..=MAX_BUCKET_VERSION).contains(v))
}

pub fn encode(entries: &[Entry]) -> Vec<u8> {
    let mut w = Writer::with_capacity(1 + entries.len() * ENTRY_BYTES);
    w.u8(BUCKET_VERSION);
    for e in entries {
        w.u64(e.session);
        w.u32(e.endpoint_id);
        w.u64(e.last_used_ms);
        w.u64(e.placement_key);
    }
    w.buf
}

/// The entry of `session` in a bucket, read where it is stored (no other entry is decoded;
/// the same answer as [`decode`] and a search).
fn find(bytes: &[u8], session: u64) -> Option<Entry> {
    let (version, rest) = bytes.split_first()?;
    let size = match *version {
        BUCKET_VERSION => ENTRY_BYTES,
        BUCKET_VERSION_1 => ENTRY_BYTES_1,
        _ => return None,
    };
    if !rest.len().is_multiple_of(size) {
        return None;
    }
    let want = session.to_le_bytes();
    let chunk = rest
        .chunks_exact(size)
        .find(|c| c.get(..8) == Some(&want[..]))?;
    let mut r = Reader::new(chunk);
    Some(Entry {
        session: r.u64()?,
        endpoint_id: r.u32()?,
        last_used_ms: r.u64()?,
        placement_key: if size == ENTRY_BYTES { r.u64()? } else { 0 },
    })
}

/// A bucket of this version, or of version 1 (entries without a placement key: read as 0).
pub fn decode(bytes: &[u8]) -> Option<Vec<Entry>> {
    let mut r = Reader::new(bytes);
    let keyed = match r.u8()? {
        BUCKET_VERSION => true,
        BUCKET_VERSION_1 => false,
        _ => return None,
    };
    let size = if keyed { ENTRY_BYTES } else { ENTRY_BYTES_1 };
    if !r.remaining().is_multiple_of(size) {
        return None;
    }
    let mut entries = Vec::with_capacity(r.remaining() / size);
    while !r.is_empty() {
        entries.push(Entry {
            session: r.u64()?,
            endpoint_id: r.u32()?,
            last_used_ms: r.u64()?,
            placement_key: if keyed { r.u64()? } else { 0 },
        });
    }
    Some(entries)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::state::store::MemStore;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn ttl_refresh_and_repin() {
        let s = MemStore::new();
        let a = Affinity::new(&s, 300_000, 1000);
        assert_eq!(a.lookup(7, 0), None);
        assert!(a.remember(7, 1, 0));
        assert_eq!(a.lookup(7, 299_999), Some(1));
        assert_eq!(a.lookup(7, 300_000), None, "idle past the TTL");
        assert!(a.remember(7, 1, 200_000)); // success refreshes
        assert_eq!(a.lookup(7, 450_000), Some(1));
        assert!(a.remember(7, 2, 450_000)); // served elsewhere after failover: re-pin
        assert_eq!(a.lookup(7, 450_001), Some(2));
        assert!(a.forget(7, 1)); // not pinned to 1: no-op
        assert_eq!(a.lookup(7, 450_001), Some(2));
        assert!(a.forget(7, 2));
        assert_eq!(a.lookup(7, 450_001), None);
    }

    #[test]
    fn bounded_with_lru_eviction() {
        let s = MemStore::new();
        let a = Affinity::new(&s, 1_000_000, 100);
        assert_eq!((0..a.buckets()).map(|b| a.capacity(b)).sum::<usize>(), 100);
        for i in 0..10_000u64 {
            let session = crate::scheduler::state::hash::session_key(b"t", &i.to_le_bytes());
            a.remember(session, 1, i);
        }
        assert_eq!(a.stored_entries(), 100);
        // The most recent session survives; the first is long evicted.
        let last = crate::scheduler::state::hash::session_key(b"t", &9_999u64.to_le_bytes());
        let first = crate::scheduler::state::hash::session_key(b"t", &0u64.to_le_bytes());
        assert_eq!(a.lookup(last, 10_000), Some(1));
        assert_eq!(a.lookup(first, 10_000), None);
    }

    #[test]
    fn undecodable_bucket_reads_as_empty() {
        let s = MemStore::new();
        let a = Affinity::new(&s, 1000, 10);
        s.set(&a.key(a.bucket_of(5)), b"\xf9garbage", None).unwrap();
        assert_eq!(a.lookup(5, 0), None);
        assert!(a.remember(5, 3, 0));
        assert_eq!(a.lookup(5, 1), Some(3));
    }

    /// An entry records the key its session was placed by; a bucket written before entries had
    /// one (version 1) keeps its pins, with the key unknown, and is rewritten by the next write.
    #[test]
    fn entries_record_their_placement_key_and_old_buckets_keep_their_pins() {
        let s = MemStore::new();
        let a = Affinity::new(&s, 300_000, 10);
        assert!(a.remember_keyed(7, 1, 0xfeed, 0));
        assert_eq!(a.lookup_keyed(7, 1), Some((1, 0xfeed)));
        assert!(a.remember(7, 2, 5)); // the moves table and key-less pins record none
        assert_eq!(a.lookup_keyed(7, 6), Some((2, 0)));
        // A version-1 bucket: 20-byte entries.
        let mut w = Writer::with_capacity(41);
        w.u8(BUCKET_VERSION_1);
        for (session, id) in [(5u64, 3u32), (9, 4)] {
            w.u64(session);
            w.u32(id);
            w.u64(100);
        }
        let b = a.bucket_of(5);
        s.set(&a.key(b), &w.buf, None).unwrap();
        assert_eq!(a.lookup_keyed(5, 200), Some((3, 0)));
        if a.bucket_of(9) == b {
            assert_eq!(a.lookup_keyed(9, 200), Some((4, 0)));
        }
        assert!(a.remember_keyed(5, 3, 42, 300));
        let stored = s.get(&a.key(b)).0.unwrap();
        assert_eq!(stored[0], BUCKET_VERSION);
        assert_eq!(a.lookup_keyed(5, 301), Some((3, 42)));
        if a.bucket_of(9) == b {
            assert_eq!(a.lookup_keyed(9, 301), Some((4, 0)), "the other pin kept");
        }
        // A version-1 bucket of the wrong length reads as empty.
        s.set(&a.key(b), &w.buf[..30], None).unwrap();
        assert_eq!(a.lookup(5, 400), None);
    }

    /// A bucket of a later version (written by a newer module during an
    /// upgrade) is never overwritten by this one, whatever it does with the sessions in it,
    /// nor read as pins; a version this code knows with a broken length still is.
    #[test]
    fn a_later_bucket_version_is_never_overwritten() {
        let s = MemStore::new();
        let a = Affinity::new(&s, 300_000, 64);
        assert_eq!(a.buckets(), 1);
        for version in [BUCKET_VERSION + 1, 7, MAX_BUCKET_VERSION] {
            // A later format: 40-byte entries, say, holding sessions 5 and 9.
            let mut later = vec![version];
            for session in [5u64, 9] {
                later.extend(session.to_le_bytes());
                later.extend([0u8; 32]);
            }
            s.set(&a.key(0), &later, None).unwrap();
            let writes = s.writes.get();
            assert_eq!(a.lookup(5, 10), None);
            assert!(a.remember_keyed(5, 3, 42, 10));
            assert!(a.remember(11, 3, 10));
            assert!(a.forget(9, 0));
            assert_eq!(
                s.get(&a.key(0)).0.as_deref(),
                Some(&later[..]),
                "v{version}"
            );
            assert_eq!(s.writes.get(), writes, "v{version}: written");
            assert_eq!(a.stored_entries(), 0);
        }
        // This version's own bucket of a broken length is rewritten.
        s.set(&a.key(0), &[BUCKET_VERSION, 1, 2, 3], None).unwrap();
        assert!(a.remember(5, 3, 20));
        assert_eq!(a.lookup(5, 21), Some(3));
    }

    /// Reading one entry where it is stored answers as decoding the bucket and searching it.
    #[test]
    fn finding_in_place_equals_decoding() {
        let entries: Vec<Entry> = (0..50u64)
            .map(|i| Entry {
                session: i.wrapping_mul(0x9e37_79b9_7f4a_7c15),
                endpoint_id: i as u32 % 7,
                last_used_ms: i * 1000,
                placement_key: i % 3,
            })
            .collect();
        let bytes = encode(&entries);
        for probe in entries.iter().map(|e| e.session).chain([1, 2, u64::MAX]) {
            let searched = decode(&bytes)
                .unwrap()
                .into_iter()
                .find(|e| e.session == probe);
            assert_eq!(find(&bytes, probe), searched);
        }
        assert_eq!(find(&bytes[..bytes.len() - 1], entries[0].session), None);
        assert_eq!(find(&[], 1), None);
        assert_eq!(find(&[9, 0, 0], 1), None);
    }
}
