//! The pin cookie: a session's place carried by the client, for replicas that never saw it.
//!
//! Placement is computed alike by every Envoy replica (rendezvous order), but a *failover*
//! moves a session away from its home, and only the replica that served the move remembers
//! it. A replica that never saw the move sends the next turn home, the one that did sends it
//! to the backup: the session's prefix is re-sent at every switch. With `pin_cookie`, the
//! answer of a turn served away from home sets a cookie naming the endpoint, and every replica
//! follows it like a pin: the exception travels with the request, as the brief requires of
//! anything that must hold across replicas.
//!
//! Only sessions away from their home get a cookie (and keep getting it refreshed while they
//! carry one), so a client's jar holds at most the sessions that failed over within the idle
//! TTL. The cookie names the session by its 64-bit tenant-scoped key (never the session id)
//! and the endpoint by its numeric id (never its name or cluster). A forged or stale cookie
//! can only choose among the endpoints that may serve the request anyway: it goes through the
//! same availability, degraded and quota checks as a pin.

/// The cookie name prefix; the session key follows in 16 lowercase hex digits.
pub const PREFIX: &str = "cf_pin_";

/// The cookie's name for `session`.
pub fn name(session: u64) -> String {
    format!("{PREFIX}{session:016x}")
}

/// The endpoint id the request's `cookie` header values name for `session`, if any. Reads each
/// value once, without allocating; a malformed pair is skipped.
pub fn find<'a>(values: impl IntoIterator<Item = &'a [u8]>, session: u64) -> Option<u32> {
    let wanted = name(session);
    let wanted = wanted.as_bytes();
    for value in values {
        for pair in value.split(|&b| b == b';') {
            let pair = trim(pair);
            let Some(eq) = pair.iter().position(|&b| b == b'=') else {
                continue;
            };
            let (n, v) = pair.split_at(eq);
            if trim(n) != wanted {
                continue;
            }
            if let Some(id) = parse_id(trim(v.get(1..).unwrap_or_default())) {
                return Some(id);
            }
        }
    }
    None
}

/// The `set-cookie` value that pins `session` to `endpoint_id` for `ttl_ms` (whole seconds,
/// at least one).
pub fn set_cookie(session: u64, endpoint_id: u32, ttl_ms: u64) -> String {
    let max_age = ttl_ms.div_ceil(1000).max(1);
    format!(
        "{}={endpoint_id}; Max-Age={max_age}; Path=/; HttpOnly; SameSite=Lax",
        name(session)
    )
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

/// A decimal u32 of 1 to 10 digits (optionally quoted, as RFC 6265 allows).
fn parse_id(v: &[u8]) -> Option<u32> {
    let v = match v {
        [b'"', inner @ .., b'"'] => inner,
        v => v,
    };
    if v.is_empty() || v.len() > 10 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(v).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn round_trip_through_a_jar() {
        let set = set_cookie(0xabc, 4_000_000_001, 300_000);
        assert_eq!(
            set,
            "cf_pin_0000000000000abc=4000000001; Max-Age=300; Path=/; HttpOnly; SameSite=Lax"
        );
        // What a client sends back: the name=value part, among other cookies.
        let header = format!("a=b; {}; c=d", set.split(';').next().unwrap_or_default());
        assert_eq!(find([header.as_bytes()], 0xabc), Some(4_000_000_001));
        assert_eq!(find([header.as_bytes()], 0xabd), None);
    }

    #[test]
    fn several_headers_quotes_and_spaces() {
        let h1: &[u8] = b"x=1";
        let h2: &[u8] = b"  cf_pin_0000000000000001 = \"42\" ";
        assert_eq!(find([h1, h2], 1), Some(42));
    }

    #[test]
    fn malformed_values_are_ignored() {
        for v in [
            "cf_pin_0000000000000001=",
            "cf_pin_0000000000000001=-1",
            "cf_pin_0000000000000001=12345678901",
            "cf_pin_0000000000000001=99999999999",
            "cf_pin_0000000000000001=4294967296",
            "cf_pin_0000000000000001=1e3",
            "cf_pin_0000000000000001",
            "cf_pin_1=5",
            ";;;=;",
        ] {
            assert_eq!(find([v.as_bytes()], 1), None, "{v}");
        }
        // The first well-formed one wins.
        let v = b"cf_pin_0000000000000001=x; cf_pin_0000000000000001=7";
        assert_eq!(find([&v[..]], 1), Some(7));
    }

    #[test]
    fn max_age_is_whole_seconds_at_least_one() {
        assert!(set_cookie(1, 1, 1).contains("Max-Age=1;"));
        assert!(set_cookie(1, 1, 1_500).contains("Max-Age=2;"));
    }
}
