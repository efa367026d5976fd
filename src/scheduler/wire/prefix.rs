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
//! and placed no better than this key's rendezvous order: it was dropped
//! (see docs/adr/0006-learned-prefix-index-dropped.md).

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

/// Parts whose place in the body a [`Segment`] keeps; a segment with more (a request with many
/// leading system messages) is hashed as it is parsed from the first part past them on.
pub const MAX_SPANS: usize = 8;

/// Where one part of the instructions segment is in the request body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Span {
    part: u8,
    at: u32,
    len: u32,
}

/// The instructions segment of a parsed request, kept as where its parts are in the body and
/// hashed only when a placement asks for its key ([`Segment::hash`]): a later turn whose pin
/// recorded its placement key (see `affinity`) never reads them again, and hashing costs about
/// 2.5 wasm instructions a byte. Bounded: past [`MAX_SPANS`] parts the stream is hashed while
/// parsing (the same digest either way: one xxh64 stream over the same bytes in the same order).
#[derive(Clone)]
pub struct Segment {
    model_len: usize,
    spans: [Span; MAX_SPANS],
    n: usize,
    /// The stream so far, once the parts outgrew `spans` (they were fed to it in order).
    eager: Option<Box<Xxh64>>,
    /// Length of the parts (without the model).
    pub bytes: usize,
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment")
            .field("spans", &self.kept())
            .field("eager", &self.eager.as_ref().map(|h| h.digest()))
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl PartialEq for Segment {
    fn eq(&self, other: &Self) -> bool {
        self.model_len == other.model_len
            && self.kept() == other.kept()
            && self.eager.as_ref().map(|h| h.digest()) == other.eager.as_ref().map(|h| h.digest())
            && self.bytes == other.bytes
    }
}

impl Eq for Segment {}

fn stream_start(model: &str) -> Xxh64 {
    let mut hasher = Xxh64::new(INSTRUCTIONS_SEED);
    hasher.update(&(model.len() as u64).to_le_bytes());
    hasher.update(model.as_bytes());
    hasher
}

fn stream_part(hasher: &mut Xxh64, part: u8, raw: &[u8]) {
    hasher.update(&[part]);
    hasher.update(&(raw.len() as u64).to_le_bytes());
    hasher.update(raw);
}

impl Segment {
    /// The parts kept as places (none once the stream is hashed while parsing).
    fn kept(&self) -> &[Span] {
        self.spans.get(..self.n).unwrap_or_default()
    }

    /// The segment's hash, from `body` (the bytes it was parsed from) and `model` (the
    /// request's model): `None` when a part is not where the segment says (another body).
    pub fn hash(&self, body: &[u8], model: &str) -> Option<Instructions> {
        if model.len() != self.model_len {
            return None;
        }
        let mut hasher = match &self.eager {
            Some(h) => Xxh64::clone(h),
            None => stream_start(model),
        };
        for s in self.kept() {
            let at = s.at as usize;
            let raw = body.get(at..at.checked_add(s.len as usize)?)?;
            stream_part(&mut hasher, s.part, raw);
        }
        Some(Instructions {
            hash: hasher.digest(),
            bytes: self.bytes,
        })
    }
}

/// Collects the parts of the instructions segment, in the order they are added, as places in
/// `body` (see [`Segment`]). One made by [`InstructionsHasher::off`] keeps nothing and finishes
/// with no segment (a configuration without `prefix_placement` pays nothing for it).
pub struct InstructionsHasher<'b> {
    body: &'b [u8],
    model: &'b str,
    on: bool,
    seg: Segment,
}

impl<'b> InstructionsHasher<'b> {
    /// Parts are slices of `body`; the stream starts with `model`.
    pub fn new(body: &'b [u8], model: &'b str) -> Self {
        InstructionsHasher {
            body,
            model,
            on: true,
            seg: Segment {
                model_len: model.len(),
                spans: [Span::default(); MAX_SPANS],
                n: 0,
                eager: None,
                bytes: 0,
            },
        }
    }

    /// A hasher that ignores every part.
    pub fn off() -> Self {
        InstructionsHasher {
            on: false,
            ..Self::new(&[], "")
        }
    }

    /// Adds one part (its raw JSON text, a slice of the body).
    pub fn add(&mut self, part: Part, raw: &str) {
        if !self.on {
            return;
        }
        let seg = &mut self.seg;
        seg.bytes = seg.bytes.saturating_add(raw.len());
        // Its place in the body: the parser's slices borrow from it.
        let at = (raw.as_ptr() as usize).wrapping_sub(self.body.as_ptr() as usize);
        let inside = at
            .checked_add(raw.len())
            .is_some_and(|end| end <= self.body.len())
            && u32::try_from(at.saturating_add(raw.len())).is_ok();
        if let Some(slot) = seg
            .spans
            .get_mut(seg.n)
            .filter(|_| inside && seg.eager.is_none())
        {
            *slot = Span {
                part: part as u8,
                at: at as u32,
                len: raw.len() as u32,
            };
            seg.n += 1;
            return;
        }
        // Past the spans (or, never expected, not a slice of the body): hash from here on.
        let hasher = match seg.eager.as_mut() {
            Some(h) => h,
            None => {
                let mut h = stream_start(self.model);
                for s in seg.kept() {
                    let at = s.at as usize;
                    // Checked when the span was kept.
                    let raw = self.body.get(at..at + s.len as usize).unwrap_or_default();
                    stream_part(&mut h, s.part, raw);
                }
                seg.n = 0;
                seg.eager.insert(Box::new(h))
            }
        };
        stream_part(hasher, part as u8, raw.as_bytes());
    }

    /// The segment, if any part was added (never for [`InstructionsHasher::off`]); boxed, as
    /// it travels with the parsed request and most requests never hash it.
    pub fn finish(self) -> Option<Box<Segment>> {
        (self.on && self.seg.bytes > 0).then(|| Box::new(self.seg))
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

    /// The parts laid out in one body (as a parser would find them), collected and hashed.
    fn segment(model: &str, parts: &[(Part, &str)]) -> Option<Instructions> {
        let body: String = parts.iter().map(|(_, raw)| *raw).collect();
        let mut h = InstructionsHasher::new(body.as_bytes(), model);
        let mut at = 0;
        for (p, raw) in parts {
            h.add(*p, &body[at..at + raw.len()]);
            at += raw.len();
        }
        h.finish()?.hash(body.as_bytes(), model)
    }

    /// The same digest whether the parts are kept as places and hashed later, or hashed while
    /// parsing past [`MAX_SPANS`] parts, or given as slices of another buffer.
    #[test]
    fn kept_or_streamed_the_hash_is_the_same() {
        let raws: Vec<String> = (0..3 * MAX_SPANS)
            .map(|i| format!("{{\"role\":\"system\",\"content\":\"rule {i}\"}}"))
            .collect();
        for n in [1, MAX_SPANS - 1, MAX_SPANS, MAX_SPANS + 1, 3 * MAX_SPANS] {
            let parts: Vec<(Part, &str)> = raws[..n]
                .iter()
                .map(|r| (Part::Message, r.as_str()))
                .collect();
            let mut flat = stream_start("m");
            for (p, raw) in &parts {
                stream_part(&mut flat, *p as u8, raw.as_bytes());
            }
            let got = segment("m", &parts).unwrap();
            assert_eq!(got.hash, flat.digest(), "{n} parts");
            assert_eq!(got.bytes, parts.iter().map(|(_, r)| r.len()).sum::<usize>());
            // Parts that are not slices of the body are hashed as they come.
            let mut h = InstructionsHasher::new(b"{}", "m");
            for (p, raw) in &parts {
                h.add(*p, raw);
            }
            let seg = h.finish().unwrap();
            assert_eq!(
                seg.hash(b"{}", "m").unwrap().hash,
                flat.digest(),
                "{n} foreign parts"
            );
        }
        // Another body (shorter than the places) or another model: no hash, no panic.
        let body = raws[0].clone();
        let mut h = InstructionsHasher::new(body.as_bytes(), "m");
        h.add(Part::System, &body);
        let seg = h.finish().unwrap();
        assert!(seg.hash(b"{}", "m").is_none());
        assert!(seg.hash(body.as_bytes(), "mm").is_none());
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
        assert!(off.finish().is_none());
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
