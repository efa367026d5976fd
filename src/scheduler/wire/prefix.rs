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
//! what it was sent. The hash is streamed over the parser's borrowed slices (xxh64, fixed seed:
//! the same on every target and replica), so no part of the body is copied, and the work is
//! linear in the segment's length — the messages after it are never looked at again.
//!
//! **Only long instructions make a key**: below `prefix_min_bytes` (counted over parts 2–5 as
//! sent) the prefix is not worth keeping together, and grouping every short-prompt session of a
//! model on one endpoint would only add load there; such sessions are placed by their session
//! key as before. The key is scoped by the caller's identity like a session key, so two tenants
//! sending the same instructions are placed independently.
//!
//! **One key, the whole segment's.** A chain of keys at the parts' boundaries (so that
//! applications sharing a leading policy message or tool definitions share a key), read by a
//! learned per-Envoy index or by a placement on the shallowest key, was built and measured
//! (issue 20, item 3) and placed no better than this key's rendezvous order: it was dropped
//! (see decisions.md, "A learned prefix index, tried and dropped").

use crate::scheduler::state::hash::hash_parts;
use xxhash_rust::xxh64::Xxh64;

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

/// The instructions segment of a request: its hash (with the model) and its length in bytes
/// (without the model).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Instructions {
    pub hash: u64,
    pub bytes: usize,
}

/// Streams the parts of the instructions segment into one hash, in the order they are added.
/// One made by [`InstructionsHasher::off`] hashes nothing and finishes with no segment (a
/// configuration without `prefix_placement` pays nothing for it).
pub struct InstructionsHasher {
    hasher: Option<Xxh64>,
    bytes: usize,
}

impl InstructionsHasher {
    pub fn new(model: &str) -> Self {
        let mut hasher = Xxh64::new(INSTRUCTIONS_SEED);
        hasher.update(&(model.len() as u64).to_le_bytes());
        hasher.update(model.as_bytes());
        InstructionsHasher {
            hasher: Some(hasher),
            bytes: 0,
        }
    }

    /// A hasher that ignores every part.
    pub fn off() -> Self {
        InstructionsHasher {
            hasher: None,
            bytes: 0,
        }
    }

    /// Adds one part (its raw JSON text).
    pub fn add(&mut self, part: Part, raw: &str) {
        let Some(hasher) = self.hasher.as_mut() else {
            return;
        };
        hasher.update(&[part as u8]);
        hasher.update(&(raw.len() as u64).to_le_bytes());
        hasher.update(raw.as_bytes());
        self.bytes = self.bytes.saturating_add(raw.len());
    }

    /// The segment, if any part was added (never for [`InstructionsHasher::off`]).
    pub fn finish(&self) -> Option<Instructions> {
        let hasher = self.hasher.as_ref().filter(|_| self.bytes > 0)?;
        Some(Instructions {
            hash: hasher.digest(),
            bytes: self.bytes,
        })
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
        // The stream is xxh64 of the length-prefixed, tagged concatenation: a specification
        // another implementation can follow.
        let mut flat = Vec::new();
        flat.extend_from_slice(&1u64.to_le_bytes());
        flat.extend_from_slice(b"m");
        for (tag, raw) in [(b's', "\"be brief\""), (b't', "[]")] {
            flat.push(tag);
            flat.extend_from_slice(&(raw.len() as u64).to_le_bytes());
            flat.extend_from_slice(raw.as_bytes());
        }
        let flat_hash = xxhash_rust::xxh64::xxh64(&flat, INSTRUCTIONS_SEED);
        assert_eq!(flat_hash, i.hash);
    }

    const PINNED_HASH: u64 = 8_282_398_788_004_269_267;
    const PINNED_KEY: u64 = 6_559_681_112_989_784_962;

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
        let mut off = InstructionsHasher::off();
        off.add(Part::System, "\"ab\"");
        assert_eq!(off.finish(), None);
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
}
