//! Fixed, specified hashing: XXH3-64 with constant seeds.
//!
//! Every hash here must agree across Envoy worker VMs, across Envoy processes and between the
//! native test build and the wasm32 filter, so `std::hash` (per-process random seeds, and
//! output that differs between targets) is never used for anything stored or compared.

use xxhash_rust::xxh3::xxh3_64_with_seed;

const SESSION_SEED: u64 = 0x636f_6d70_7574_6531; // "compute1"
const ENDPOINT_SEED: u64 = 0x666c_7578_656e_6470; // "fluxendp"
const RENDEZVOUS_SEED: u64 = 0x7265_6e64_657a_766f; // "rendezvo"

/// Hash of one or more byte strings, each length-prefixed so that ("ab","c") != ("a","bc").
pub fn hash_parts(seed: u64, parts: &[&[u8]]) -> u64 {
    let mut buf = Vec::with_capacity(parts.iter().map(|p| p.len() + 8).sum());
    for p in parts {
        buf.extend_from_slice(&(p.len() as u64).to_le_bytes());
        buf.extend_from_slice(p);
    }
    xxh3_64_with_seed(&buf, seed)
}

/// The affinity key of a session: a hash of the tenant scope and the session id. The raw id is
/// never stored. Zero is reserved for "empty slot", so it is mapped to 1.
pub fn session_key(tenant: &[u8], session: &[u8]) -> u64 {
    match hash_parts(SESSION_SEED, &[tenant, session]) {
        0 => 1,
        h => h,
    }
}

/// The 32-bit id under which the affinity table refers to an endpoint (by name, so that a
/// configuration reload that reorders endpoints does not misroute pinned sessions).
pub fn endpoint_id(name: &str) -> u32 {
    let h = xxh3_64_with_seed(name.as_bytes(), ENDPOINT_SEED);
    (h ^ (h >> 32)) as u32
}

/// Rendezvous (highest-random-weight) hash of (session, endpoint): the tie breaker that makes
/// independent Envoy processes with the same view pick the same endpoint for a new session.
/// It runs once per tied candidate on every selection, so it is a pure-integer mixer
/// (MurmurHash3's 64-bit finalizer, twice) rather than a byte hash: identical on every target.
pub fn rendezvous(session_key: u64, endpoint_id: u32) -> u64 {
    rendezvous_seeded(session_key, rendezvous_seed(endpoint_id))
}

/// The half of [`rendezvous`] that depends on the endpoint alone: computed once per endpoint
/// (a function of its id) and kept, a key costs one mix per candidate instead of two.
pub fn rendezvous_seed(endpoint_id: u32) -> u64 {
    fmix64(u64::from(endpoint_id) ^ RENDEZVOUS_SEED)
}

/// [`rendezvous`] from the endpoint's [`rendezvous_seed`]: the same value.
pub fn rendezvous_seeded(session_key: u64, seed: u64) -> u64 {
    fmix64(session_key.wrapping_add(seed))
}

/// MurmurHash3's 64-bit finalizer: a bijective avalanche mix.
pub fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^= k >> 33;
    k
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// Pinned values: these must never change between releases or targets (the same test runs
    /// under wasm-bindgen-test on wasm32), or pins and rendezvous choices would move.
    #[test]
    fn hashes_are_stable() {
        assert_eq!(endpoint_id("a"), endpoint_id("a"));
        assert_ne!(endpoint_id("a"), endpoint_id("b"));
        assert_ne!(session_key(b"ab", b"c"), session_key(b"a", b"bc"));
        assert_ne!(session_key(b"", b""), 0);
        let pinned = (
            endpoint_id("gpu-1"),
            session_key(b"tenant", b"s1"),
            rendezvous(42, 7),
        );
        assert_eq!(pinned, EXPECTED_PINNED);
        assert_eq!(rendezvous_seeded(42, rendezvous_seed(7)), rendezvous(42, 7));
    }

    const EXPECTED_PINNED: (u32, u64, u64) = (
        270_278_089,
        14_436_467_762_409_092_098,
        7_260_026_509_070_100_995,
    );
}
