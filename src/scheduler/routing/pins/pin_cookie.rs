//! The pin cookie: a session's place carried by the client, for replicas that never saw it.
//!
//! Placement is computed alike by every Envoy replica (rendezvous order), but a *failover*
//! moves a session away from its home, and only the replica that served the move remembers
//! it; and the home itself moves with what each replica learns at its own moment (engines'
//! slots weigh the order, saturation passes over a home, a pool's hosts come and go). A
//! replica that never saw the session would send the next turn by its own view, the one that
//! did to its pin: the session's prefix is re-sent at every switch. With `pin_cookie`, a
//! successful answer sets a cookie naming the endpoint (unless the request carried it with
//! half its lifetime left), and every replica follows it like a pin: the session's place
//! travels with the request, as anything that must hold across replicas must.
//!
//! Why it is signed: a cookie is the client's to write. Unsigned, it let any client pin its
//! sessions to an endpoint of its choice, past bounded load, weights, payoff and the quota
//! reserve that placement applies to new sessions. So the value carries a MAC, and only a
//! cookie the filter issued, for this session, not yet expired, is followed:
//!
//! ```text
//! cf_pin_<slot>=<session key, 16 hex>.<endpoint id>.<expires, unix s>.<MAC, 32 hex>
//! MAC = HMAC-SHA256(key, "cf_pin v1" ‖ session (8 bytes BE) ‖ endpoint id (4) ‖ expires (8)),
//!       its first 128 bits
//! ```
//!
//! The key (`config::secret::PinCookieKey`) is `pin_cookie_secret` when configured, else
//! derived from the whole configuration: identical on every replica with the same
//! configuration, and secret from clients as long as the configuration holds something they
//! cannot know, such as an endpoint's injected credentials. Without such credentials a client
//! that knows the configuration could compute the key: set the secret then
//! (docs/hardening.md). A configuration change changes a derived key: cookies issued before
//! are ignored (their sessions go home, or stay by this replica's own pins).
//!
//! Everything else is ignored and counted ([`Ignored`]): a value that is not of this form
//! (`unsigned`, also the unsigned `cf_pin_<session>` cookies of earlier versions), a MAC that
//! does not match (`forged`: an edited endpoint id or expiry), a cookie past its expiry
//! (`stale`). A cookie of *another* session that shares the slot is skipped silently: two
//! sessions of one client may meet in a slot, the later one's cookie replaces the earlier.
//!
//! Bounded jar: the cookie's name is one of [`SLOTS`] names (the session key modulo `SLOTS`),
//! not one per session, so a client that keeps one jar for many sessions (an SDK client, a
//! long Responses conversation whose every turn is a session of its own) holds at most
//! `SLOTS` pin cookies of about 80 bytes each, far below Envoy's request header limit. The
//! cookie names the session by its 64-bit tenant-scoped key (never the session id) and the
//! endpoint by its numeric id (never its name or cluster). Even a valid cookie only chooses
//! among the endpoints that may serve the request anyway: it goes through the same
//! availability, degraded and quota checks as a pin.

use crate::scheduler::config::secret::PinCookieKey;

/// The cookie name prefix; the slot number follows.
pub const PREFIX: &str = "cf_pin_";

/// The cookie names a client can be given: at most this many pin cookies per jar.
pub const SLOTS: u64 = 8;

/// Bytes of the MAC carried in the cookie (128 bits).
const MAC_BYTES: usize = 16;

/// Domain separation of the MAC input (and its version).
const MAC_LABEL: &[u8] = b"cf_pin v1";

/// Why a pin cookie of the request's slot was not followed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ignored {
    /// Not a value the filter writes (no MAC, malformed, or an earlier version's cookie).
    Unsigned,
    /// Well-formed for this session, but its MAC does not match.
    Forged,
    /// Signed, but past its expiry.
    Stale,
}

impl Ignored {
    pub const ALL: &'static [Ignored] = &[Ignored::Unsigned, Ignored::Forged, Ignored::Stale];

    pub fn label(&self) -> &'static str {
        match self {
            Ignored::Unsigned => "unsigned",
            Ignored::Forged => "forged",
            Ignored::Stale => "stale",
        }
    }
}

/// What the request's cookies say about its session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// No pin cookie for this session.
    Absent,
    /// A valid cookie naming endpoint `id`, valid until `expires_ms`.
    Endpoint { id: u32, expires_ms: u64 },
    /// A pin cookie for this session (or in its slot, unreadable) that is not followed.
    Ignored(Ignored),
}

/// The MAC input of one cookie.
fn message(session: u64, endpoint_id: u32, expires_s: u64) -> [u8; 29] {
    let mut m = [0u8; 29];
    let (label, rest) = m.split_at_mut(MAC_LABEL.len());
    label.copy_from_slice(MAC_LABEL);
    let (s, rest) = rest.split_at_mut(8);
    s.copy_from_slice(&session.to_be_bytes());
    let (e, x) = rest.split_at_mut(4);
    e.copy_from_slice(&endpoint_id.to_be_bytes());
    x.copy_from_slice(&expires_s.to_be_bytes());
    m
}

/// The cookie's name for `session`: one of [`SLOTS`].
pub fn name(session: u64) -> String {
    format!("{PREFIX}{}", session % SLOTS)
}

/// The `set-cookie` value that pins `session` to `endpoint_id` for `ttl_ms` from `now_ms`
/// (whole seconds, at least one), signed with `key`.
pub fn set_cookie(
    key: &PinCookieKey,
    session: u64,
    endpoint_id: u32,
    now_ms: u64,
    ttl_ms: u64,
) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let max_age = ttl_ms.div_ceil(1000).max(1);
    let expires_s = (now_ms / 1000).saturating_add(max_age);
    // Lowercase hex by table: a `format!` per byte cost more than the MAC (`tests/cost`).
    let mut tag = String::with_capacity(2 * MAC_BYTES);
    for &b in key
        .tag(&message(session, endpoint_id, expires_s))
        .iter()
        .take(MAC_BYTES)
    {
        for nibble in [b >> 4, b & 0x0f] {
            tag.push(char::from(
                HEX.get(usize::from(nibble)).copied().unwrap_or(b'0'),
            ));
        }
    }
    format!(
        "{}={session:016x}.{endpoint_id}.{expires_s}.{tag}; Max-Age={max_age}; Path=/; HttpOnly; SameSite=Lax",
        name(session)
    )
}

/// What the request's `cookie` header values say about `session` at `now_ms`. Reads each
/// value once; the first valid cookie wins, else the first reason to ignore one.
pub fn find<'a>(
    key: &PinCookieKey,
    values: impl IntoIterator<Item = &'a [u8]>,
    session: u64,
    now_ms: u64,
) -> Found {
    // Most requests carry no cookie at all: name nothing for them (`tests/cost`).
    let mut values = values.into_iter().peekable();
    if values.peek().is_none() {
        return Found::Absent;
    }
    let slot = name(session);
    let legacy = format!("{PREFIX}{session:016x}");
    let mut found = Found::Absent;
    for value in values {
        for pair in value.split(|&b| b == b';') {
            let pair = trim(pair);
            let Some(eq) = pair.iter().position(|&b| b == b'=') else {
                continue;
            };
            let (n, v) = pair.split_at(eq);
            let n = trim(n);
            let v = trim(v.get(1..).unwrap_or_default());
            let verdict = if n == slot.as_bytes() {
                judge(key, v, session, now_ms)
            } else if n == legacy.as_bytes() {
                Some(Found::Ignored(Ignored::Unsigned))
            } else {
                None
            };
            match verdict {
                Some(found @ Found::Endpoint { .. }) => return found,
                Some(other) if found == Found::Absent => found = other,
                _ => {}
            }
        }
    }
    found
}

/// One value under the session's slot name; `None`: another session's cookie.
fn judge(key: &PinCookieKey, v: &[u8], session: u64, now_ms: u64) -> Option<Found> {
    let v = match v {
        [b'"', inner @ .., b'"'] => inner,
        v => v,
    };
    let mut fields = v.split(|&b| b == b'.');
    let (Some(s), Some(id), Some(exp), Some(tag), None) = (
        fields.next(),
        fields.next(),
        fields.next(),
        fields.next(),
        fields.next(),
    ) else {
        return Some(Found::Ignored(Ignored::Unsigned));
    };
    let parsed = (
        parse_hex_u64(s),
        parse_decimal(id, 10).and_then(|n| u32::try_from(n).ok()),
        parse_decimal(exp, 19),
        parse_tag(tag),
    );
    let (Some(s), Some(id), Some(expires_s), Some(tag)) = parsed else {
        return Some(Found::Ignored(Ignored::Unsigned));
    };
    if s != session {
        return None;
    }
    if !key.verify(&message(session, id, expires_s), &tag) {
        return Some(Found::Ignored(Ignored::Forged));
    }
    if expires_s.saturating_mul(1000) <= now_ms {
        return Some(Found::Ignored(Ignored::Stale));
    }
    Some(Found::Endpoint {
        id,
        expires_ms: expires_s.saturating_mul(1000),
    })
}

fn trim(b: &[u8]) -> &[u8] {
    let start = b
        .iter()
        .position(|c| !c.is_ascii_whitespace())
        .unwrap_or(b.len());
    let end = b
        .iter()
        .rposition(|c| !c.is_ascii_whitespace())
        .map_or(start, |e| e + 1);
    b.get(start..end).unwrap_or_default()
}

/// A decimal of 1 to `max_digits` digits.
fn parse_decimal(v: &[u8], max_digits: usize) -> Option<u64> {
    if v.is_empty() || v.len() > max_digits || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(v).ok()?.parse().ok()
}

/// Exactly 16 lowercase hex digits.
fn parse_hex_u64(v: &[u8]) -> Option<u64> {
    if v.len() != 16
        || !v
            .iter()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
    {
        return None;
    }
    u64::from_str_radix(std::str::from_utf8(v).ok()?, 16).ok()
}

/// Exactly `2 * MAC_BYTES` lowercase hex digits.
fn parse_tag(v: &[u8]) -> Option<[u8; MAC_BYTES]> {
    if v.len() != 2 * MAC_BYTES {
        return None;
    }
    let mut out = [0u8; MAC_BYTES];
    for (o, pair) in out.iter_mut().zip(v.chunks_exact(2)) {
        let hex = std::str::from_utf8(pair).ok()?;
        if !hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return None;
        }
        *o = u8::from_str_radix(hex, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const NOW: u64 = 1_700_000_000_000;

    fn key() -> PinCookieKey {
        PinCookieKey::from_secret(b"a secret of sixteen bytes or more")
    }

    /// The name=value part of a `set-cookie`.
    fn pair(set: &str) -> String {
        set.split(';').next().unwrap_or_default().to_string()
    }

    #[test]
    fn round_trip_through_a_jar() {
        let set = set_cookie(&key(), 0xabc, 4_000_000_001, NOW, 300_000);
        assert!(
            set.starts_with("cf_pin_4=0000000000000abc.4000000001.1700000300."),
            "{set}"
        );
        assert!(
            set.ends_with("; Max-Age=300; Path=/; HttpOnly; SameSite=Lax"),
            "{set}"
        );
        // What a client sends back: the name=value part, among other cookies.
        let header = format!("a=b; {}; c=d", pair(&set));
        assert_eq!(
            find(&key(), [header.as_bytes()], 0xabc, NOW),
            Found::Endpoint {
                id: 4_000_000_001,
                expires_ms: 1_700_000_300_000
            }
        );
        // Another session of the same slot: not its cookie, not counted.
        assert_eq!(
            find(&key(), [header.as_bytes()], 0xabc + 8, NOW),
            Found::Absent
        );
        // Another slot: absent.
        assert_eq!(find(&key(), [header.as_bytes()], 0xabd, NOW), Found::Absent);
    }

    /// The MAC pinned: native and wasm32 must agree, and so must every replica. The value
    /// was computed independently (Python's `hmac`): key = HMAC-SHA256("computeflux pin
    /// cookie key v1: secret", secret); tag = HMAC-SHA256(key, "cf_pin v1" ‖ 1 ‖ 42 ‖ 1)[..16].
    #[test]
    fn the_mac_is_hmac_sha256_truncated_and_pinned() {
        let set = set_cookie(&key(), 1, 42, 0, 1000);
        assert_eq!(
            pair(&set),
            "cf_pin_1=0000000000000001.42.1.98b34192671e6bffd17521ba27ef5ecd"
        );
    }

    #[test]
    fn forged_unsigned_and_stale_cookies_are_ignored() {
        let set = set_cookie(&key(), 1, 42, NOW, 60_000);
        let good = pair(&set);
        // Another key (another configuration or secret): forged.
        assert_eq!(
            find(
                &PinCookieKey::from_secret(b"another secret, as long"),
                [good.as_bytes()],
                1,
                NOW
            ),
            Found::Ignored(Ignored::Forged)
        );
        // An edited endpoint id or expiry: forged.
        for edited in [
            good.replace(".42.", ".43."),
            good.replace(".1700000060.", ".1800000060."),
        ] {
            assert_eq!(
                find(&key(), [edited.as_bytes()], 1, NOW),
                Found::Ignored(Ignored::Forged),
                "{edited}"
            );
        }
        // Past its expiry: stale.
        assert_eq!(
            find(&key(), [good.as_bytes()], 1, NOW + 60_000),
            Found::Ignored(Ignored::Stale)
        );
        assert_eq!(
            find(&key(), [good.as_bytes()], 1, NOW + 59_999),
            Found::Endpoint {
                id: 42,
                expires_ms: NOW + 60_000
            }
        );
        // Unsigned: the earlier form, under either name, and malformed values.
        for v in [
            "cf_pin_1=42",
            "cf_pin_0000000000000001=42",
            "cf_pin_1=",
            "cf_pin_1=0000000000000001.42.1700000060",
            "cf_pin_1=0000000000000001.42.1700000060.zz",
            "cf_pin_1=1.42.1700000060.00000000000000000000000000000000",
            "cf_pin_1=0000000000000001.4294967296.1700000060.00000000000000000000000000000000",
            "cf_pin_1=0000000000000001.42.1700000060.00000000000000000000000000000000.x",
        ] {
            assert_eq!(
                find(&key(), [v.as_bytes()], 1, NOW),
                Found::Ignored(Ignored::Unsigned),
                "{v}"
            );
        }
        // A valid cookie wins over an ignored one in any order.
        let both = format!("cf_pin_1=42; {good}");
        assert!(matches!(
            find(&key(), [both.as_bytes()], 1, NOW),
            Found::Endpoint { id: 42, .. }
        ));
        // Nothing: absent.
        assert_eq!(find(&key(), [&b"x=1; ;;=;"[..]], 1, NOW), Found::Absent);
    }

    #[test]
    fn several_headers_quotes_and_spaces() {
        let good = pair(&set_cookie(&key(), 9, 7, NOW, 60_000));
        let (n, v) = good.split_once('=').unwrap_or_default();
        let spaced = format!("  {n} = \"{v}\" ");
        let h1: &[u8] = b"x=1";
        assert_eq!(
            find(&key(), [h1, spaced.as_bytes()], 9, NOW),
            Found::Endpoint {
                id: 7,
                expires_ms: NOW + 60_000
            }
        );
    }

    #[test]
    fn a_jar_holds_at_most_slots_pin_cookies() {
        let names: std::collections::BTreeSet<String> = (0..10_000u64)
            .map(|s| s.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .map(name)
            .collect();
        assert_eq!(names.len() as u64, SLOTS);
        assert!(set_cookie(&key(), u64::MAX, u32::MAX, u64::MAX, u64::MAX).len() < 160);
    }

    #[test]
    fn max_age_is_whole_seconds_at_least_one() {
        assert!(set_cookie(&key(), 1, 1, NOW, 1).contains("Max-Age=1;"));
        assert!(set_cookie(&key(), 1, 1, NOW, 1_500).contains("Max-Age=2;"));
    }
}
