//! The prefix key: what the new sessions of one application have in common, so that they can
//! be placed where that prefix is already cached.
//!
//! Agents, RAG pipelines and assistants send long shared instructions (a system prompt, tool
//! definitions, few-shot examples) ahead of short conversations. An inference engine's prefix
//! cache keeps those instructions' KV blocks; a new session placed by its own session key lands
//! on any endpoint, so every endpoint must prefill (and cache) every application's
//! instructions. Placed by a key of its instructions instead, an application's new sessions go
//! to one endpoint — and since placement is rendezvous hashing, every Envoy replica picks the
//! same one without sharing anything.
//!
//! **The instructions segment** is the part of the request before the conversation proper, in
//! a canonical order, each part tagged and length-prefixed:
//! 1. the model;
//! 2. Anthropic Messages' top-level `system`;
//! 3. the Responses API's `instructions`;
//! 4. `tools`, then the legacy `functions`;
//! 5. the leading `system` / `developer` messages of `messages` (or of the Responses API's
//!    `input` array): every message before the first one with another role (user, assistant,
//!    tool, or an item without a role).
//!
//! Parts are hashed as the raw JSON text the client sent (no re-serialisation): one
//! application sends the same bytes for the same instructions, and the engine caches exactly
//! what it was sent. The hash is streamed over the parser's borrowed slices (xxh3, fixed seed:
//! the same on every target and replica), so no part of the body is copied, and the work is
//! linear in the segment's length — the messages after it are never looked at again.
//!
//! **Only long instructions make a key**: below `prefix_min_bytes` (counted over parts 2–5 as
//! sent) the prefix is not worth keeping together, and grouping every short-prompt session of a
//! model on one endpoint would only add load there; such sessions are placed by their session
//! key as before. The key is scoped by the caller's identity like a session key, so two tenants
//! sending the same instructions are placed independently.
//!
//! **The chain** (issue 20, item 3): besides the whole segment, the hash is read at the end of
//! each of its first [`MAX_BOUNDARIES`] parts (a digest of the same stream, so nothing is hashed
//! twice), and [`prefix_chain`] turns those at least `prefix_min_bytes` long into at most
//! [`MAX_CHAIN`] keys, shallowest first, the whole segment's key last. Applications that share a
//! leading part (the same policy message or tool definitions, then one of their own) share the
//! chain's first keys and differ in its last: what a learned index (`routing::prefix_index`) or
//! a placement on the shallowest key can use. Boundaries are the parts the client sent, not
//! blocks of fixed size: one part is one message of the engine's template, so a shared part is
//! a shared run of KV blocks; a common head inside one message's text makes no key of its own.

use crate::scheduler::state::hash::hash_parts;
use xxhash_rust::xxh3::Xxh3;

const INSTRUCTIONS_SEED: u64 = 0x7072_6566_6978_3031; // "prefix01"
const PREFIX_KEY_SEED: u64 = 0x7072_6566_6b65_7931; // "prefkey1"

/// Tags of the parts of the instructions segment (a part moved to another field is another
/// prefix to the engine's template, so another key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Part {
    System = b's',
    Instructions = b'i',
    Tools = b't',
    Functions = b'f',
    Message = b'm',
}

/// Part boundaries whose digest is kept (later parts still count in the whole segment's hash).
pub const MAX_BOUNDARIES: usize = 8;
/// Most keys of one request's chain (the whole segment's included): bounds the index's reads
/// and writes per request.
pub const MAX_CHAIN: usize = 4;

/// The instructions segment of a request: its hash (with the model) and its length in bytes
/// (without the model), and the same at the end of each of its first parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Instructions {
    pub hash: u64,
    pub bytes: usize,
    /// `(hash, bytes)` of the stream at the end of each of the first `boundary_count` parts
    /// (the last of them is `(hash, bytes)` when there are at most [`MAX_BOUNDARIES`] parts).
    pub boundaries: [(u64, usize); MAX_BOUNDARIES],
    pub boundary_count: usize,
}

/// Streams the parts of the instructions segment into one hash, in the order they are added.
pub struct InstructionsHasher {
    hasher: Xxh3,
    bytes: usize,
    boundaries: [(u64, usize); MAX_BOUNDARIES],
    boundary_count: usize,
}

impl InstructionsHasher {
    pub fn new(model: &str) -> Self {
        let mut hasher = Xxh3::with_seed(INSTRUCTIONS_SEED);
        hasher.update(&(model.len() as u64).to_le_bytes());
        hasher.update(model.as_bytes());
        InstructionsHasher {
            hasher,
            bytes: 0,
            boundaries: [(0, 0); MAX_BOUNDARIES],
            boundary_count: 0,
        }
    }

    /// Adds one part (its raw JSON text).
    pub fn add(&mut self, part: Part, raw: &str) {
        self.hasher.update(&[part as u8]);
        self.hasher.update(&(raw.len() as u64).to_le_bytes());
        self.hasher.update(raw.as_bytes());
        self.bytes = self.bytes.saturating_add(raw.len());
        if let Some(slot) = self.boundaries.get_mut(self.boundary_count) {
            *slot = (self.hasher.digest(), self.bytes);
            self.boundary_count += 1;
        }
    }

    /// The segment, if any part was added.
    pub fn finish(&self) -> Option<Instructions> {
        (self.bytes > 0).then(|| Instructions {
            hash: self.hasher.digest(),
            bytes: self.bytes,
            boundaries: self.boundaries,
            boundary_count: self.boundary_count,
        })
    }
}

/// A request's prefix keys, shallowest first; the last is the whole segment's
/// ([`prefix_key`]). Never empty.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixChain {
    keys: [u64; MAX_CHAIN],
    len: usize,
}

impl PrefixChain {
    /// A chain of one key (the whole segment's).
    pub fn single(key: u64) -> Self {
        PrefixChain {
            keys: [key; MAX_CHAIN],
            len: 1,
        }
    }

    /// A chain of the given keys, shallowest first (at most [`MAX_CHAIN`]: the first ones
    /// and the last); `None` when empty.
    pub fn from_keys(keys: &[u64]) -> Option<Self> {
        let (&last, inner) = keys.split_last()?;
        let mut chain = PrefixChain::single(last);
        for (slot, &k) in chain.keys.iter_mut().zip(inner.iter().take(MAX_CHAIN - 1)) {
            *slot = k;
        }
        let n = inner.len().min(MAX_CHAIN - 1);
        if let Some(slot) = chain.keys.get_mut(n) {
            *slot = last;
        }
        chain.len = n + 1;
        Some(chain)
    }

    /// The keys, shallowest first.
    pub fn keys(&self) -> &[u64] {
        self.keys.get(..self.len).unwrap_or(&[])
    }

    /// The whole segment's key.
    pub fn longest(&self) -> u64 {
        self.keys().last().copied().unwrap_or(1)
    }

    /// The shallowest key at least `prefix_min_bytes` long (the longest when there is one).
    pub fn head(&self) -> u64 {
        self.keys().first().copied().unwrap_or(1)
    }
}

/// The placement key of a request's instructions, when they are at least `min_bytes` long:
/// scoped by `tenant` (the caller's credential value), never 0.
pub fn prefix_key(
    tenant: Option<&[u8]>,
    instructions: &Instructions,
    min_bytes: u64,
) -> Option<u64> {
    if (instructions.bytes as u64) < min_bytes {
        return None;
    }
    let tenant = tenant.unwrap_or(b"");
    match hash_parts(PREFIX_KEY_SEED, &[tenant, &instructions.hash.to_le_bytes()]) {
        0 => Some(1),
        h => Some(h),
    }
}

/// The chain of `instructions` ([`PrefixChain`]): the keys of the part boundaries at least
/// `min_bytes` into the segment, at most [`MAX_CHAIN`] − 1 of them (the shallowest), then the
/// whole segment's; `None` when the segment is shorter than `min_bytes`.
pub fn prefix_chain(
    tenant: Option<&[u8]>,
    instructions: &Instructions,
    min_bytes: u64,
) -> Option<PrefixChain> {
    let longest = prefix_key(tenant, instructions, min_bytes)?;
    let mut chain = PrefixChain::single(longest);
    let inner = instructions
        .boundaries
        .iter()
        .take(instructions.boundary_count)
        .filter(|(_, bytes)| (*bytes as u64) >= min_bytes && *bytes < instructions.bytes)
        .take(MAX_CHAIN - 1);
    let mut len = 0;
    for (hash, bytes) in inner {
        let partial = Instructions {
            hash: *hash,
            bytes: *bytes,
            ..*instructions
        };
        if let (Some(k), Some(slot)) = (
            prefix_key(tenant, &partial, min_bytes),
            chain.keys.get_mut(len),
        ) {
            *slot = k;
            len += 1;
        }
    }
    if let Some(slot) = chain.keys.get_mut(len) {
        *slot = longest;
    }
    chain.len = len + 1;
    Some(chain)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn segment(model: &str, parts: &[(Part, &str)]) -> Option<Instructions> {
        let mut h = InstructionsHasher::new(model);
        for (p, raw) in parts {
            h.add(*p, raw);
        }
        h.finish()
    }

    /// Pinned: every replica, native or wasm32, must compute the same key.
    #[test]
    fn hash_is_pinned() {
        let i = segment("m", &[(Part::System, "\"be brief\""), (Part::Tools, "[]")]).unwrap();
        assert_eq!(i.bytes, 12);
        assert_eq!(i.hash, PINNED_HASH);
        assert_eq!(prefix_key(None, &i, 1), Some(PINNED_KEY));
        // The stream is xxh3 of the length-prefixed, tagged concatenation: a specification
        // another implementation can follow.
        let mut flat = Vec::new();
        flat.extend_from_slice(&1u64.to_le_bytes());
        flat.extend_from_slice(b"m");
        for (tag, raw) in [(b's', "\"be brief\""), (b't', "[]")] {
            flat.push(tag);
            flat.extend_from_slice(&(raw.len() as u64).to_le_bytes());
            flat.extend_from_slice(raw.as_bytes());
        }
        let flat_hash = xxhash_rust::xxh3::xxh3_64_with_seed(&flat, INSTRUCTIONS_SEED);
        assert_eq!(flat_hash, i.hash);
    }

    const PINNED_HASH: u64 = 14_932_671_755_980_255_158;
    const PINNED_KEY: u64 = 14_642_363_066_246_908_423;

    #[test]
    fn parts_are_tagged_and_delimited() {
        let a = segment("m", &[(Part::System, "\"ab\""), (Part::Tools, "\"c\"")]);
        let b = segment("m", &[(Part::System, "\"a\""), (Part::Tools, "\"bc\"")]);
        let c = segment(
            "m",
            &[(Part::Instructions, "\"ab\""), (Part::Tools, "\"c\"")],
        );
        let d = segment("n", &[(Part::System, "\"ab\""), (Part::Tools, "\"c\"")]);
        assert_ne!(a, b);
        assert_ne!(a.map(|i| i.hash), c.map(|i| i.hash));
        assert_ne!(a.map(|i| i.hash), d.map(|i| i.hash));
        assert_eq!(segment("m", &[]), None);
    }

    #[test]
    fn short_instructions_make_no_key_and_tenants_differ() {
        let i = segment("m", &[(Part::System, &"x".repeat(100))]).unwrap();
        assert_eq!(prefix_key(None, &i, 101), None);
        let k = prefix_key(None, &i, 100);
        assert!(k.is_some());
        assert_ne!(k, prefix_key(Some(b"Bearer other"), &i, 100));
        assert_eq!(k, prefix_key(Some(b""), &i, 100));
    }

    fn parts(n: usize, len: usize, tail: &str) -> Vec<String> {
        (0..n)
            .map(|k| {
                if k + 1 == n {
                    format!("\"{tail}{}\"", "t".repeat(len))
                } else {
                    format!("\"{k}{}\"", "h".repeat(len))
                }
            })
            .collect()
    }

    fn chain_of(raw: &[String], min: u64) -> Option<PrefixChain> {
        let mut h = InstructionsHasher::new("m");
        for r in raw {
            h.add(Part::Message, r);
        }
        prefix_chain(None, &h.finish()?, min)
    }

    #[test]
    fn the_chain_ends_with_the_whole_segments_key_and_shares_its_head() {
        // Two applications: the same 2 000-byte policy message, then one of their own.
        let a = chain_of(&parts(2, 2_000, "app a"), 1_024).unwrap();
        let b = chain_of(&parts(2, 2_000, "app b"), 1_024).unwrap();
        assert_eq!(a.keys().len(), 2);
        assert_eq!(a.head(), b.head(), "the shared head is one key");
        assert_ne!(a.longest(), b.longest());
        // The whole segment's key is today's prefix key: placement by it is unchanged.
        let mut h = InstructionsHasher::new("m");
        for r in parts(2, 2_000, "app a") {
            h.add(Part::Message, &r);
        }
        let whole = h.finish().unwrap();
        assert_eq!(Some(a.longest()), prefix_key(None, &whole, 1_024));
        assert_eq!(whole.boundary_count, 2);
        assert_eq!(whole.boundaries[1], (whole.hash, whole.bytes));
        // A head shorter than the minimum makes no key of its own.
        let short = chain_of(&parts(2, 600, "app a"), 1_024).unwrap();
        assert_eq!(short.keys().len(), 1);
        assert_eq!(short.head(), short.longest());
        // Too short altogether: no chain.
        assert_eq!(chain_of(&parts(2, 200, "x"), 1_024), None);
    }

    #[test]
    fn the_chain_is_bounded_and_keeps_the_shallowest_boundaries() {
        let raw = parts(12, 1_100, "last");
        let c = chain_of(&raw, 1_024).unwrap();
        assert_eq!(c.keys().len(), MAX_CHAIN);
        // Its first keys are those of the first parts: the same as a request with only them.
        let first = chain_of(&raw[..2], 1_024).unwrap();
        assert_eq!(c.keys()[..2], first.keys()[..2]);
        let keys = c.keys();
        for (i, k) in keys.iter().enumerate() {
            assert!(!keys[i + 1..].contains(k), "distinct keys: {keys:?}");
        }
        assert_eq!(PrefixChain::single(7).keys(), &[7]);
        let f = PrefixChain::from_keys(&[1, 2, 3, 4, 5, 6]).unwrap();
        assert_eq!(f.keys(), &[1, 2, 3, 6]);
        assert_eq!((f.head(), f.longest()), (1, 6));
        assert_eq!(PrefixChain::from_keys(&[]), None);
    }

    // Property tests run natively only (proptest is not a wasm32 dev-dependency).
    #[cfg(not(target_arch = "wasm32"))]
    mod props {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(128))]

            /// Whatever the parts: at most `MAX_CHAIN` keys, none 0, the last the whole
            /// segment's key, and a request that starts with the same parts shares the keys of
            /// those parts.
            #[test]
            fn chains_are_bounded_and_prefix_consistent(
                lens in proptest::collection::vec(1usize..3_000, 1..14),
                min in 64u64..4_096,
                cut in 0usize..14,
            ) {
                let raw: Vec<String> =
                    lens.iter().enumerate().map(|(k, l)| format!("\"{k}:{}\"", "x".repeat(*l))).collect();
                let mut h = InstructionsHasher::new("m");
                for r in &raw {
                    h.add(Part::Message, r);
                }
                let whole = h.finish().unwrap();
                let chain = prefix_chain(None, &whole, min);
                prop_assert_eq!(chain.is_some(), whole.bytes as u64 >= min);
                let Some(chain) = chain else { return Ok(()) };
                prop_assert!(!chain.keys().is_empty() && chain.keys().len() <= MAX_CHAIN);
                prop_assert!(chain.keys().iter().all(|&k| k != 0));
                prop_assert_eq!(Some(chain.longest()), prefix_key(None, &whole, min));
                // A shorter request made of the first parts: its inner keys are a prefix of ours.
                let cut = cut.clamp(1, raw.len());
                let mut g = InstructionsHasher::new("m");
                for r in raw.iter().take(cut) {
                    g.add(Part::Message, r);
                }
                if let Some(short) = g.finish().and_then(|i| prefix_chain(None, &i, min)) {
                    let inner = short.keys().len() - 1;
                    let n = inner.min(chain.keys().len() - 1);
                    prop_assert_eq!(&short.keys()[..n], &chain.keys()[..n]);
                    if cut < raw.len() && cut <= MAX_BOUNDARIES && chain.keys().len() < MAX_CHAIN {
                        prop_assert!(chain.keys().contains(&short.longest()));
                    }
                }
            }
        }
    }
}
