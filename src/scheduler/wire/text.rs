//! Cutting text to a byte budget without splitting a character.
//!
//! Why: messages the filter sends back quote text it did not write (serde_json's parse errors
//! quote the client's own body), and `String::truncate` or `&s[..n]` panic when byte `n` falls
//! inside a multi-byte character. In a wasm VM a panic kills the worker's VM, so one crafted
//! request (`"é"` repeated past the cut) became a denial of service. Every cut of text in the
//! crate goes through [`truncate`]; `clippy.toml` refuses the panicking `String` methods.

/// The longest prefix of `s` that is at most `max_bytes` long and ends on a character
/// boundary (so it may be a few bytes shorter than `max_bytes`, and is `s` itself when `s`
/// fits). Never panics.
pub fn truncate(s: &str, max_bytes: usize) -> &str {
    if s.len() <= max_bytes {
        return s;
    }
    let mut end = max_bytes;
    while end > 0 && !s.is_char_boundary(end) {
        end -= 1;
    }
    s.get(..end).unwrap_or("")
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn cuts_on_character_boundaries() {
        assert_eq!(truncate("hello", 10), "hello");
        assert_eq!(truncate("hello", 5), "hello");
        assert_eq!(truncate("hello", 3), "hel");
        assert_eq!(truncate("hello", 0), "");
        // "é" is 2 bytes, "€" 3, "𝄞" 4: a cut inside one drops the whole character.
        assert_eq!(truncate("aé", 2), "a");
        assert_eq!(truncate("aé", 3), "aé");
        assert_eq!(truncate("€€", 4), "€");
        assert_eq!(truncate("€€", 5), "€");
        assert_eq!(truncate("𝄞x", 3), "");
        let e200 = "é".repeat(200);
        assert_eq!(truncate(&e200, 161).len(), 160);
        assert_eq!(truncate(&format!("a{e200}"), 160).len(), 159);
    }
}
