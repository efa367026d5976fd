//! The pin cookie's MAC key (`pin_cookie_secret`), and the MAC itself.
//!
//! Why a key: the pin cookie (`routing::pins::pin_cookie`) is written by the filter and sent back by
//! the client; only a MAC over its content keeps a client from writing its own. Every Envoy
//! replica must verify what any other issued, so the key cannot be random per process: it
//! comes from the configuration, which every replica shares.
//!
//! How: with `pin_cookie_secret` set, the key is HMAC-SHA256 over that secret. Without it, the
//! key is HMAC-SHA256 over the whole configuration in canonical JSON (object keys sorted, no
//! spaces, so key order and formatting do not matter). That configuration holds the
//! endpoints' injected credentials (`headers`), secret from clients; it is identical on every
//! replica with the same configuration. The trade-off (docs/hardening.md): a fleet whose
//! endpoints inject no credentials has a configuration a client may know or guess, hence a
//! key it could compute: set `pin_cookie_secret` then. And any configuration change changes a
//! derived key, so cookies issued before are ignored (their sessions go home once).
//!
//! The MAC is HMAC-SHA256 (RFC 2104, the `hmac` and `sha2` crates of RustCrypto), truncated to
//! its first 128 bits in the cookie, compared in constant time.

use hmac::{Hmac, KeyInit, Mac};
use serde_json::Value;
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

const KEY_FROM_SECRET: &[u8] = b"computeflux pin cookie key v1: secret";
const KEY_FROM_CONFIG: &[u8] = b"computeflux pin cookie key v1: configuration";

/// Shortest accepted `pin_cookie_secret`, in bytes (128 bits of a random hex or base64 string
/// take 22 to 32 characters; 16 bytes of any text is the floor).
pub const MIN_SECRET_BYTES: usize = 16;
/// Longest accepted `pin_cookie_secret`, in bytes.
pub const MAX_SECRET_BYTES: usize = 4096;

/// The pin cookie's MAC key, and whether it was configured (`pin_cookie_secret`) or derived
/// from the configuration. `Debug` and the start-up summary never show the key.
#[derive(Clone)]
pub struct PinCookieKey {
    configured: bool,
    key: [u8; 32],
    /// HMAC with this key, its padded key blocks already hashed: each MAC then costs two
    /// SHA-256 blocks instead of four (every answer of a pool's host signs one, `tests/cost`).
    mac: HmacSha256,
}

impl PartialEq for PinCookieKey {
    fn eq(&self, other: &Self) -> bool {
        self.configured == other.configured && self.key == other.key
    }
}

impl Eq for PinCookieKey {}

impl std::fmt::Debug for PinCookieKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinCookieKey({})", self.show())
    }
}

impl Default for PinCookieKey {
    /// Not configured; the key of an empty configuration until [`PinCookieKey::derive`].
    fn default() -> Self {
        PinCookieKey::derived(&Value::Null)
    }
}

impl PinCookieKey {
    /// The key from a configured secret.
    pub fn from_secret(secret: &[u8]) -> PinCookieKey {
        PinCookieKey::with(true, hmac_sha256(KEY_FROM_SECRET, &[secret]))
    }

    fn with(configured: bool, key: [u8; 32]) -> PinCookieKey {
        // HMAC takes a key of any length: `new_from_slice` cannot fail.
        let mac = <HmacSha256 as KeyInit>::new_from_slice(&key)
            .unwrap_or_else(|_| <HmacSha256 as KeyInit>::new(&Default::default()));
        PinCookieKey {
            configured,
            key,
            mac,
        }
    }

    /// The key from the whole configuration `config` (canonical JSON).
    pub fn derived(config: &Value) -> PinCookieKey {
        let mut canonical = Vec::new();
        write_canonical(config, &mut canonical);
        PinCookieKey::with(false, hmac_sha256(KEY_FROM_CONFIG, &[&canonical]))
    }

    /// Whether `pin_cookie_secret` was set.
    pub fn configured(&self) -> bool {
        self.configured
    }

    /// What the start-up summary and the reference say instead of the key.
    pub fn show(&self) -> String {
        if self.configured {
            "(set)".into()
        } else {
            "(derived)".into()
        }
    }

    /// HMAC-SHA256 of `message` under this key.
    pub fn tag(&self, message: &[u8]) -> [u8; 32] {
        let mut m = self.mac.clone();
        m.update(message);
        let mut out = [0u8; 32];
        out.copy_from_slice(&m.finalize().into_bytes());
        out
    }

    /// Whether `tag` is the first `tag.len()` bytes (at least 16) of [`PinCookieKey::tag`] of
    /// `message`, compared in constant time.
    pub fn verify(&self, message: &[u8], tag: &[u8]) -> bool {
        if tag.len() < 16 {
            return false;
        }
        let mut m = self.mac.clone();
        m.update(message);
        m.verify_truncated_left(tag).is_ok()
    }
}

fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut out = [0u8; 32];
    // HMAC takes a key of any length: `new_from_slice` cannot fail.
    if let Ok(mut m) = <HmacSha256 as KeyInit>::new_from_slice(key) {
        for p in parts {
            m.update(p);
        }
        out.copy_from_slice(&m.finalize().into_bytes());
    }
    out
}

/// Objects with their keys sorted, strings and numbers as serde_json writes them, no spaces.
fn write_canonical(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (k, x)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(Value::String(k.clone()).to_string().as_bytes());
                out.push(b':');
                write_canonical(x, out);
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(x, out);
            }
            out.push(b']');
        }
        scalar => out.extend_from_slice(scalar.to_string().as_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    /// RFC 4231 test case 2: the primitive is HMAC-SHA256, on native and wasm32 alike.
    #[test]
    fn hmac_sha256_matches_rfc_4231() {
        let k = hmac_sha256(b"Jefe", &[b"what do ya want ", b"for nothing?"]);
        assert_eq!(
            hex(&k),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn the_derived_key_ignores_key_order_and_spacing_only() {
        let parse = |s: &str| serde_json::from_str::<Value>(s).unwrap_or_default();
        let a = parse(r#"{"b":[1,{"y":"x","x":2}],"a":true}"#);
        let b = parse(r#"{ "a": true, "b": [1, {"x": 2, "y": "x"}] }"#);
        let c = parse(r#"{"a":true,"b":[1,{"x":3,"y":"x"}]}"#);
        assert_eq!(PinCookieKey::derived(&a), PinCookieKey::derived(&b));
        assert_ne!(PinCookieKey::derived(&a), PinCookieKey::derived(&c));
        let mut canonical = Vec::new();
        write_canonical(&b, &mut canonical);
        assert_eq!(canonical, br#"{"a":true,"b":[1,{"x":2,"y":"x"}]}"#);
    }

    #[test]
    fn secrets_give_other_keys_and_are_never_shown() {
        let s = PinCookieKey::from_secret(b"0123456789abcdef");
        assert_ne!(s, PinCookieKey::from_secret(b"0123456789abcdeF"));
        assert_ne!(s, PinCookieKey::derived(&Value::Null));
        assert!(s.configured() && !PinCookieKey::default().configured());
        assert_eq!(format!("{s:?}"), "PinCookieKey((set))");
        let tag = s.tag(b"m");
        assert!(s.verify(b"m", tag.get(..16).unwrap_or_default()));
        assert!(s.verify(b"m", &tag));
        assert!(!s.verify(b"n", tag.get(..16).unwrap_or_default()));
        assert!(!s.verify(b"m", tag.get(..15).unwrap_or_default()));
        assert!(!PinCookieKey::default().verify(b"m", tag.get(..16).unwrap_or_default()));
    }
}
