//! Headers as the request flow reads them, wherever they live.
//!
//! Why a trait: the flow reads a response's `:status`, its rate-limit hints and Envoy's own
//! markers from two places — the live header map of the routed answer (read one name at a
//! time through host calls, so that a 200 costs one call) and the header list of a failover
//! call's answer (already copied out). [`HeaderSource`] covers both, so the flow is the same
//! code natively (tests, simulations) and in Envoy.
//!
//! The host passes header lists as one byte string: a little-endian `u32` count, then a
//! (`u32` name length, `u32` value length) pair per header, then each name and value followed
//! by a NUL. [`encode_pairs`] and [`decode_pairs`] read and write it without trusting it:
//! anything malformed decodes as `None`, never as a panic.

use std::borrow::Cow;

/// Header name (lower case, as Envoy gives it) and raw value bytes.
pub type Pairs = Vec<(String, Vec<u8>)>;

/// Somewhere header values can be read by name.
pub trait HeaderSource {
    /// The first value of header `name` (lower case), if present.
    fn header(&self, name: &str) -> Option<Cow<'_, [u8]>>;

    /// The `:status` pseudo-header as a number.
    fn status(&self) -> Option<u16> {
        let v = self.header(":status")?;
        std::str::from_utf8(&v).ok()?.trim().parse().ok()
    }

    /// The value of `name` as text, if it is UTF-8.
    fn header_str(&self, name: &str) -> Option<String> {
        let v = self.header(name)?;
        String::from_utf8(v.into_owned()).ok()
    }
}

impl HeaderSource for [(String, Vec<u8>)] {
    fn header(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        self.iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| Cow::Borrowed(v.as_slice()))
    }
}

impl HeaderSource for Pairs {
    fn header(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        self.as_slice().header(name)
    }
}

/// A header list as the host serialized it, read in place: the bytes and, per header, where
/// its name and value lie. What the request headers (kept for failover) and a response's
/// headers (its status, content type and quota headers, looked up by name) are read as,
/// without a `String` and a `Vec` per header ([`decode_pairs`]: two allocations and their
/// frees per header, about a tenth of a plain request's instructions in tests/cost).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderList {
    bytes: Vec<u8>,
    /// Per header: name start, name length, value start, value length.
    spans: Vec<[u32; 4]>,
}

impl HeaderList {
    /// Reads a serialized header list (see [`decode_pairs`]); `None` if it is malformed. An
    /// empty input is an empty list.
    pub fn decode(bytes: Vec<u8>) -> Option<HeaderList> {
        let spans = spans(&bytes)?;
        Some(HeaderList { bytes, spans })
    }

    /// The headers in order: name (lossily UTF-8, Envoy only allows tokens) and value bytes.
    pub fn iter(&self) -> impl Iterator<Item = (Cow<'_, str>, &[u8])> {
        self.spans.iter().map(|&[n, nl, v, vl]| {
            (
                String::from_utf8_lossy(span(&self.bytes, n, nl)),
                span(&self.bytes, v, vl),
            )
        })
    }

    pub fn len(&self) -> usize {
        self.spans.len()
    }

    /// The values of every header named `name` (any case), in order. (Its spans are sliced in
    /// place rather than through [`span`]: the lookups of every request run here, and this form
    /// measured 1 600 instructions a request fewer in tests/cost.)
    pub fn values<'s, 'n>(&'s self, name: &'n str) -> impl Iterator<Item = &'s [u8]> + use<'s, 'n> {
        self.spans.iter().filter_map(move |&[n, nl, v, vl]| {
            let at = |start: u32, len: u32| {
                self.bytes
                    .get(start as usize..(start as usize).checked_add(len as usize)?)
            };
            at(n, nl)?
                .eq_ignore_ascii_case(name.as_bytes())
                .then(|| at(v, vl))
                .flatten()
        })
    }

    /// Drops every header named `name` (any case).
    pub fn remove(&mut self, name: &str) {
        let bytes = &self.bytes;
        self.spans
            .retain(|&[n, nl, _, _]| !span(bytes, n, nl).eq_ignore_ascii_case(name.as_bytes()));
    }

    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }
}

impl From<Pairs> for HeaderList {
    fn from(pairs: Pairs) -> HeaderList {
        let borrowed: Vec<(&str, &[u8])> = pairs
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_slice()))
            .collect();
        HeaderList::decode(encode_pairs(&borrowed)).unwrap_or_default()
    }
}

impl HeaderSource for HeaderList {
    fn header(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        self.values(name).next().map(Cow::Borrowed)
    }
}

/// The `len` bytes of `bytes` from `start` (empty if out of range, which [`spans`] rules out).
fn span(bytes: &[u8], start: u32, len: u32) -> &[u8] {
    let start = start as usize;
    bytes
        .get(start..start.saturating_add(len as usize))
        .unwrap_or_default()
}

/// Where each header's name and value lie in a serialized header list; `None` if it is
/// malformed (truncated, lengths past the end, a missing NUL, trailing bytes, more than
/// `u32` can address).
fn spans(bytes: &[u8]) -> Option<Vec<[u32; 4]>> {
    if bytes.is_empty() {
        return Some(Vec::new());
    }
    u32::try_from(bytes.len()).ok()?;
    let word = |at: usize| -> Option<usize> {
        let b: [u8; 4] = bytes.get(at..at.checked_add(4)?)?.try_into().ok()?;
        Some(u32::from_le_bytes(b) as usize)
    };
    let count = word(0)?;
    // Each header takes at least 10 bytes (two lengths, two NULs): bounds the allocation.
    if count > bytes.len() / 10 {
        return None;
    }
    let mut at = 4usize.checked_add(count.checked_mul(8)?)?;
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        let (name_len, value_len) = (word(4 + i * 8)?, word(8 + i * 8)?);
        let name_end = at.checked_add(name_len)?;
        let value_at = name_end.checked_add(1)?;
        let value_end = value_at.checked_add(value_len)?;
        if bytes.get(name_end) != Some(&0) || bytes.get(value_end) != Some(&0) {
            return None;
        }
        // Below bytes.len(), which fits in a u32 (checked above).
        out.push([at, name_len, value_at, value_len].map(|x| x as u32));
        at = value_end + 1;
    }
    (at == bytes.len()).then_some(out)
}

/// The rate-limit reset hints the classifier reads on a 429 (`outcome::retry_hint_ms`).
pub const RATE_LIMIT_HINTS: [&str; 4] = [
    "retry-after",
    "retry-after-ms",
    "x-ratelimit-reset-requests",
    "x-ratelimit-reset-tokens",
];

/// The rate-limit hints present in `h`, as text.
pub fn rate_limit_hints<H: HeaderSource + ?Sized>(h: &H) -> Vec<(String, String)> {
    RATE_LIMIT_HINTS
        .iter()
        .filter_map(|n| {
            h.header(n)
                .map(|v| (n.to_string(), String::from_utf8_lossy(&v).into_owned()))
        })
        .collect()
}

/// The host's serialized form of a header list.
pub fn encode_pairs(pairs: &[(&str, &[u8])]) -> Vec<u8> {
    let size = 4 + pairs
        .iter()
        .map(|(k, v)| 10 + k.len() + v.len())
        .sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
    out
}

/// Reads a serialized header list; `None` if it is malformed (truncated, lengths past the
/// end, trailing bytes). Names that are not UTF-8 are read lossily (Envoy only allows
/// tokens). An empty input is an empty list.
pub fn decode_pairs(bytes: &[u8]) -> Option<Pairs> {
    Some(
        spans(bytes)?
            .into_iter()
            .map(|[n, nl, v, vl]| {
                (
                    String::from_utf8_lossy(span(bytes, n, nl)).into_owned(),
                    span(bytes, v, vl).to_vec(),
                )
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn round_trip_and_malformed_input() {
        let pairs: Vec<(&str, &[u8])> = vec![
            (":status", b"429"),
            ("retry-after", b"7"),
            ("x-bin", b"\xff\x00\x01"),
        ];
        let bytes = encode_pairs(&pairs);
        let back = decode_pairs(&bytes).unwrap();
        assert_eq!(back.len(), 3);
        assert_eq!(back.status(), Some(429));
        assert_eq!(back.header("x-bin").as_deref(), Some(&b"\xff\x00\x01"[..]));
        assert_eq!(back.header("RETRY-AFTER").as_deref(), Some(&b"7"[..]));
        assert_eq!(
            rate_limit_hints(&back),
            vec![("retry-after".to_string(), "7".to_string())]
        );
        assert_eq!(decode_pairs(&[]), Some(Vec::new()));
        assert_eq!(decode_pairs(&encode_pairs(&[])), Some(Vec::new()));
        for cut in 1..bytes.len() {
            assert_eq!(decode_pairs(&bytes[..cut]), None, "cut at {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(decode_pairs(&longer), None);
        // A count far beyond the input is refused before allocating.
        assert_eq!(decode_pairs(&u32::MAX.to_le_bytes()), None);

        // Read in place: the same headers, the same refusals.
        let list = HeaderList::decode(bytes.clone()).unwrap();
        assert_eq!(list.len(), 3);
        assert_eq!(list.status(), Some(429));
        assert_eq!(list.header("x-bin").as_deref(), Some(&b"\xff\x00\x01"[..]));
        assert_eq!(list.header("RETRY-AFTER").as_deref(), Some(&b"7"[..]));
        assert_eq!(list.header("retry"), None);
        assert_eq!(rate_limit_hints(&list), rate_limit_hints(&back));
        let owned: Pairs = list
            .iter()
            .map(|(n, v)| (n.into_owned(), v.to_vec()))
            .collect();
        assert_eq!(owned, back);
        assert_eq!(HeaderList::decode(Vec::new()), Some(HeaderList::default()));
        for cut in 1..bytes.len() {
            assert_eq!(
                HeaderList::decode(bytes[..cut].to_vec()),
                None,
                "cut at {cut}"
            );
        }
        assert_eq!(HeaderList::decode(longer), None);
        assert_eq!(HeaderList::decode(u32::MAX.to_le_bytes().to_vec()), None);
    }
}
