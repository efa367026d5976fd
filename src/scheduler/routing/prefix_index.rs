//! The learned prefix index (issue 20, item 3; `prefix_index`, off by default): which endpoint
//! last served, successfully, a request whose instructions start with a given prefix key.
//!
//! Why: placement by prefix (`placement`, "Placement by prefix") puts an application's new
//! sessions at the rendezvous home of one key of its instructions, the same on every replica.
//! It cannot see that two applications share a leading part (the same policy message or tool
//! definitions, then one of their own): their whole-segment keys differ. The SGLang gateway,
//! the Gateway API Inference Extension and AIBrix learn instead where each prefix was sent, per
//! router process. This index is that, bounded: a new session goes first to the endpoint of the
//! deepest key of its chain (`wire::prefix::prefix_chain`) found here, if that endpoint can take
//! it as the walk's first choice could; else as without the index.
//!
//! How: the session affinity table's bucketed, CAS-written LRU (`affinity`) under its own key
//! prefix: `prefix key → (endpoint id, last served)`, at most `prefix_index_entries` entries of
//! 20 bytes whatever arrives, idle entries dropped after `affinity_ttl_ms`. A success writes
//! each key of its chain (at most `MAX_CHAIN`), but not a key that already names that endpoint
//! and was written less than an eighth of the TTL ago, so that a popular application's steady
//! traffic costs reads, not CAS writes. Per Envoy process: replicas learn apart, and a restarted
//! one starts empty (then it places as without the index).

use crate::scheduler::config::Config;
use crate::scheduler::routing::affinity::Affinity;
use crate::scheduler::state::store::Store;
use crate::scheduler::wire::prefix::PrefixChain;

/// Shared-data key prefix of the index's buckets.
pub const KEY_PREFIX: &str = "computeflux/prefix_index/";

/// The index over a [`Store`].
pub struct PrefixIndex<'a> {
    table: Affinity<'a>,
    ttl_ms: u64,
}

impl<'a> PrefixIndex<'a> {
    pub fn new(store: &'a dyn Store, cfg: &Config) -> Self {
        Self::with_bounds(store, cfg.affinity_ttl_ms, cfg.prefix_index_entries)
    }

    pub fn with_bounds(store: &'a dyn Store, ttl_ms: u64, entries: u64) -> Self {
        PrefixIndex {
            table: Affinity::with_prefix(store, KEY_PREFIX, ttl_ms, entries),
            ttl_ms,
        }
    }

    /// The endpoint ids the index names for `chain`, deepest key first (repeats possible).
    pub fn lookup(&self, chain: &PrefixChain, now_ms: u64) -> Vec<u32> {
        chain
            .keys()
            .iter()
            .rev()
            .filter_map(|&k| self.table.lookup(k, now_ms))
            .collect()
    }

    /// `endpoint_id` served a request of `chain`. Returns false if a CAS retry loop gave up.
    pub fn record(&self, chain: &PrefixChain, endpoint_id: u32, now_ms: u64) -> bool {
        let fresh_ms = self.ttl_ms / 8;
        let mut ok = true;
        for &k in chain.keys() {
            let fresh = self.table.lookup_entry(k, now_ms).is_some_and(|e| {
                e.endpoint_id == endpoint_id && now_ms.saturating_sub(e.last_used_ms) < fresh_ms
            });
            if !fresh {
                ok &= self.table.remember(k, endpoint_id, now_ms);
            }
        }
        ok
    }

    /// Entries stored (live or not yet pruned).
    pub fn stored_entries(&self) -> usize {
        self.table.stored_entries()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::state::store::MemStore;
    use crate::scheduler::wire::prefix::{prefix_chain, InstructionsHasher, Part};
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn chain(parts: &[&str]) -> PrefixChain {
        let mut h = InstructionsHasher::new("m");
        for p in parts {
            h.add(Part::Message, p);
        }
        prefix_chain(None, &h.finish().unwrap(), 64).unwrap()
    }

    #[test]
    fn the_deepest_known_key_comes_first() {
        let store = MemStore::default();
        let idx = PrefixIndex::with_bounds(&store, 300_000, 1_024);
        let head = "\"a shared policy of more than sixty-four bytes, the same for every app\"";
        let a = chain(&[head, "\"application a's own part\""]);
        let b = chain(&[head, "\"application b's own part\""]);
        assert_eq!(a.keys().len(), 2);
        assert!(idx.lookup(&a, 0).is_empty());
        assert!(idx.record(&a, 7, 1_000));
        // a: its own key, then the head's.
        assert_eq!(idx.lookup(&a, 2_000), vec![7, 7]);
        // b was never served: only the shared head is known.
        assert_eq!(idx.lookup(&b, 2_000), vec![7]);
        assert!(idx.record(&b, 9, 3_000));
        assert_eq!(idx.lookup(&b, 4_000), vec![9, 9]);
        assert_eq!(idx.lookup(&a, 4_000), vec![7, 9]);
        // Idle past the TTL: forgotten.
        assert!(idx.lookup(&a, 1_000 + 300_000).len() < 2);
        assert!(idx.lookup(&b, 3_000 + 300_000).is_empty());
    }

    #[test]
    fn a_fresh_entry_is_not_written_again() {
        let store = MemStore::default();
        let idx = PrefixIndex::with_bounds(&store, 80_000, 1_024);
        let c = chain(&["\"one part long enough to make a key of its own, more than 64 bytes\""]);
        idx.record(&c, 1, 0);
        let writes = |s: &MemStore| {
            (0..idx.table.buckets())
                .map(|b| s.get(&format!("{KEY_PREFIX}{b}")).1)
                .collect::<Vec<_>>()
        };
        let w0 = writes(&store);
        idx.record(&c, 1, 9_999); // within 80 000 / 8
        assert_eq!(writes(&store), w0);
        idx.record(&c, 1, 10_000); // an eighth of the TTL: refreshed
        assert_ne!(writes(&store), w0);
        let w1 = writes(&store);
        idx.record(&c, 2, 10_001); // another endpoint: written at once
        assert_ne!(writes(&store), w1);
        assert_eq!(idx.lookup(&c, 10_002), vec![2]);
    }

    // Property tests run natively only (proptest is not a wasm32 dev-dependency).
    #[cfg(not(target_arch = "wasm32"))]
    mod props {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(48))]

            /// Whatever prefixes arrive, the index holds at most its bound, and what it names
            /// is an endpoint that served that key.
            #[test]
            fn memory_stays_bounded(
                bound in 64u64..600,
                served in proptest::collection::vec((0u64..5_000, 0u32..8), 1..1_500),
            ) {
                let store = MemStore::default();
                let idx = PrefixIndex::with_bounds(&store, 10_000_000, bound);
                let mut now = 0;
                for (key, ep) in &served {
                    now += 1;
                    let c = PrefixChain::single(key.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
                    idx.record(&c, *ep, now);
                    prop_assert!(idx.stored_entries() as u64 <= bound);
                }
                let (key, ep) = served[served.len() - 1];
                let c = PrefixChain::single(key.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
                prop_assert_eq!(idx.lookup(&c, now), vec![ep]);
            }
        }
    }
}
