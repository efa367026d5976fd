//! The request path, checked once before it is classified: what the filter routes on must be
//! what the upstream serves.
//!
//! Why: the filter decides what a request is (chat completion, file upload, …) from its path,
//! and from that whether it reads the body, which model lists and body limit apply, and which
//! endpoints may take it. Inference servers decode the path before they route it (vLLM and
//! SGLang through Starlette decode every escape, `%2F` included, and many frameworks merge
//! repeated slashes and resolve dot segments), so `POST /v1/%63hat/completions`,
//! `//v1/chat/completions` or `/v1/files/../chat/completions` are chat completions for the
//! upstream while an exact string match calls them unknown paths and routes them without a
//! model, to endpoints that do not serve it.
//!
//! How, in order, on the path without its query:
//! 1. **Refused as ambiguous** ([`PathError`]): a malformed escape (`%`, `%4`, `%zz`), an
//!    encoded `%` (`%25`: decoded twice it is another path), a backslash raw or encoded (some
//!    servers read it as `/`), a NUL or other control byte raw or encoded.
//! 2. **Canonical form**: escapes of unreserved characters (`A-Z a-z 0-9 - . _ ~`, RFC 3986
//!    §2.3) decoded, other escapes kept as sent, repeated `/` merged, `.` and `..`
//!    segments resolved (§5.2.4; `..` never climbs above the root).
//! 3. **Refused as not canonical** when the canonical form differs from the sent path. The
//!    filter does not rewrite `:path` to the canonical form: refusing is the simpler rule with
//!    the same guarantee, since what goes upstream is then byte for byte what was classified,
//!    and a client that sends such paths is broken or probing. The error names the canonical
//!    path, so a client that meant well knows what to send.
//! 4. **Refused when an encoded `/` changes what the request is**: the path read with every
//!    `%2F` decoded (what Starlette routes on) must classify the same way as the sent path
//!    (`api::policy`). `GET /v1/models/meta-llama%2FLlama-3` keeps working (a model id either
//!    way); `/v1/responses/x%2F..%2F..%2Fchat%2Fcompletions` does not.
//!
//! Envoy's own options (`normalize_path`, `merge_slashes`, `path_with_escaped_slashes_action`
//! on the HTTP connection manager) rewrite the path before the filter sees it; the filter does
//! not rely on them (they are off by default, and off in the test configurations), but with
//! them on it sees and forwards the already-normalized path, which passes these checks.

/// Why a path is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathError {
    /// `%` not followed by two hex digits.
    InvalidEscape,
    /// `%25`: an encoded `%`.
    EncodedPercent,
    /// A backslash, raw or encoded.
    Backslash,
    /// A NUL or other control byte, raw or encoded.
    ControlByte,
    /// The path is not in canonical form; this is its canonical form.
    NotCanonical(String),
    /// An encoded `/` makes the path another request once decoded.
    EncodedSlash,
}

impl PathError {
    /// What the client is told (no path bytes quoted except a canonical form, which is made of
    /// the request's own path and bounded by Envoy's header limit).
    pub fn message(&self) -> String {
        match self {
            PathError::InvalidEscape => {
                "The request path has a malformed percent-escape.".to_string()
            }
            PathError::EncodedPercent => "The request path has an encoded `%` (%25).".to_string(),
            PathError::Backslash => "The request path has a backslash.".to_string(),
            PathError::ControlByte => "The request path has a control character.".to_string(),
            PathError::NotCanonical(c) => format!(
                "The request path is not in canonical form (encoded unreserved characters, \
                 repeated slashes or dot segments); send `{}` instead.",
                super::text::truncate(c, 200)
            ),
            PathError::EncodedSlash => {
                "The request path has an encoded `/` (%2F) that changes which API it names."
                    .to_string()
            }
        }
    }
}

/// The path part of a `:path` (before `?` or `#`).
pub fn path_part(path: &str) -> &str {
    let end = path.find(['?', '#']).unwrap_or(path.len());
    path.get(..end).unwrap_or(path)
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// The canonical form of `path` (its path part only; see the module doc), or why it is
/// ambiguous. With `decode_slash`, `%2F` is decoded as well (the upstream's reading).
pub fn canonical(path: &str, decode_slash: bool) -> Result<String, PathError> {
    let raw = path_part(path).as_bytes();
    let mut decoded: Vec<u8> = Vec::with_capacity(raw.len());
    let mut i = 0;
    while let Some(&b) = raw.get(i) {
        if b == b'\\' {
            return Err(PathError::Backslash);
        }
        if b < 0x20 || b == 0x7f {
            return Err(PathError::ControlByte);
        }
        if b != b'%' {
            decoded.push(b);
            i += 1;
            continue;
        }
        let (Some(hi), Some(lo)) = (
            raw.get(i + 1).copied().and_then(hex),
            raw.get(i + 2).copied().and_then(hex),
        ) else {
            return Err(PathError::InvalidEscape);
        };
        let c = hi * 16 + lo;
        match c {
            b'%' => return Err(PathError::EncodedPercent),
            b'\\' => return Err(PathError::Backslash),
            0..=0x1f | 0x7f => return Err(PathError::ControlByte),
            b'/' if decode_slash => decoded.push(b'/'),
            c if unreserved(c) => decoded.push(c),
            // Kept as sent (either hex case): it is data, not structure, for every server.
            _ => decoded.extend(raw.get(i..i + 3).unwrap_or_default()),
        }
        i += 3;
    }
    // Only ASCII bytes were added or removed around the input's own (UTF-8) bytes.
    let decoded = String::from_utf8(decoded).map_err(|_| PathError::InvalidEscape)?;
    Ok(resolve(&decoded))
}

/// Merges repeated `/` and resolves `.` / `..` segments (never above the root). A path that
/// does not start with `/` (`*`, empty) is left as it is.
fn resolve(path: &str) -> String {
    let Some(rest) = path.strip_prefix('/') else {
        return path.to_string();
    };
    let mut out: Vec<&str> = Vec::new();
    let segments: Vec<&str> = rest.split('/').collect();
    let last = segments.len().saturating_sub(1);
    // A trailing `/`, `/.` or `/..` keeps the path a "directory".
    let mut trailing = false;
    for (n, seg) in segments.into_iter().enumerate() {
        trailing = false;
        match seg {
            "" => trailing = n == last,
            "." => trailing = true,
            ".." => {
                out.pop();
                trailing = true;
            }
            s => out.push(s),
        }
    }
    let mut s = String::with_capacity(path.len());
    for seg in &out {
        s.push('/');
        s.push_str(seg);
    }
    if trailing || out.is_empty() {
        s.push('/');
    }
    s
}

/// Checks the sent path (steps 1 and 3 of the module doc): `Ok` when it is canonical.
pub fn check(path: &str) -> Result<(), PathError> {
    if plainly_canonical(path_part(path).as_bytes()) {
        return Ok(());
    }
    let c = canonical(path, false)?;
    if c != path_part(path) {
        return Err(PathError::NotCanonical(c));
    }
    Ok(())
}

/// Whether a path part is canonical on its face, so that [`canonical`] would return it as it
/// is: it starts with `/`, has no `%`, backslash or control byte, no `.` or `..` segment, and
/// no empty segment but the last (one trailing `/`). What clients send; one pass over the
/// bytes without the decoded copy and the segment list (about 5 000 instructions of a
/// request's headers callback in tests/cost).
fn plainly_canonical(p: &[u8]) -> bool {
    let Some(rest) = p.strip_prefix(b"/") else {
        return false;
    };
    if rest
        .iter()
        .any(|&b| matches!(b, b'%' | b'\\' | 0..=0x1f | 0x7f))
    {
        return false;
    }
    let mut segments = rest.split(|&b| b == b'/').peekable();
    while let Some(seg) = segments.next() {
        let last = segments.peek().is_none();
        if matches!(seg, b"." | b"..") || (seg.is_empty() && !last) {
            return false;
        }
    }
    true
}

/// Whether the path has an encoded `/` (so step 4 applies).
pub fn has_encoded_slash(path: &str) -> bool {
    let p = path_part(path).as_bytes();
    p.windows(3).any(|w| matches!(w, [b'%', b'2', b'f' | b'F']))
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(not(target_arch = "wasm32"))]
    use proptest::prelude::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[cfg(not(target_arch = "wasm32"))]
    proptest! {
        /// The fast path only ever says "canonical" of a path [`canonical`] leaves as it is.
        #[test]
        fn a_plainly_canonical_path_is_its_canonical_form(
            parts in proptest::collection::vec(
                prop::sample::select(vec![
                    "/", "v1", "chat", ".", "..", "%2F", "%41", "a.b", "\\", "\u{1}", "caf\u{e9}",
                    "?x=/..", "#f", "-_~",
                ]),
                0..8,
            )
        ) {
            let path: String = parts.concat();
            if plainly_canonical(path_part(&path).as_bytes()) {
                prop_assert_eq!(canonical(&path, false), Ok(path_part(&path).to_string()));
            }
            let full = canonical(&path, false).map(|c| c == path_part(&path));
            prop_assert_eq!(check(&path).is_ok(), full == Ok(true), "{}", path);
        }
    }

    #[test]
    fn canonical_paths_pass() {
        for p in [
            "/v1/chat/completions",
            "/v1/chat/completions/",
            "/v1/chat/completions?x=%2F..%25",
            "/v1/models/meta-llama%2FLlama-3",
            "/v1/files/file-1/content",
            "/v1/models/caf%C3%A9",
            "/v1/models/org%2fmodel",
            "/",
            "",
            "*",
        ] {
            assert_eq!(check(p), Ok(()), "{p}");
        }
    }

    #[test]
    fn non_canonical_paths_name_their_canonical_form() {
        for (p, c) in [
            ("/v1/%63hat/completions", "/v1/chat/completions"),
            ("/v1/%63%68%61%74/completions", "/v1/chat/completions"),
            ("//v1/chat/completions", "/v1/chat/completions"),
            ("/v1//chat///completions", "/v1/chat/completions"),
            ("/v1/files/../chat/completions", "/v1/chat/completions"),
            ("/v1/./chat/completions", "/v1/chat/completions"),
            ("/v1/chat/%2e%2E/chat/completions", "/v1/chat/completions"),
            ("/../../v1/embeddings", "/v1/embeddings"),
            ("/v1/files/..", "/v1/"),
            ("/v1/files/.", "/v1/files/"),
        ] {
            assert_eq!(check(p), Err(PathError::NotCanonical(c.into())), "{p}");
        }
    }

    #[test]
    fn ambiguous_paths_are_refused() {
        assert_eq!(check("/v1/%"), Err(PathError::InvalidEscape));
        assert_eq!(check("/v1/%4"), Err(PathError::InvalidEscape));
        assert_eq!(check("/v1/%zz"), Err(PathError::InvalidEscape));
        assert_eq!(check("/v1/%2563hat"), Err(PathError::EncodedPercent));
        assert_eq!(check("/v1\\chat"), Err(PathError::Backslash));
        assert_eq!(check("/v1%5Cchat"), Err(PathError::Backslash));
        assert_eq!(check("/v1/chat%00"), Err(PathError::ControlByte));
        assert_eq!(check("/v1/chat\u{0}"), Err(PathError::ControlByte));
        assert_eq!(check("/v1/\tchat"), Err(PathError::ControlByte));
    }

    #[test]
    fn decoding_slashes_is_the_upstream_reading() {
        assert_eq!(
            canonical("/v1%2Fchat%2Fcompletions", true),
            Ok("/v1/chat/completions".into())
        );
        assert_eq!(
            canonical("/v1/responses/x%2F..%2F..%2Fchat%2Fcompletions", true),
            Ok("/v1/chat/completions".into())
        );
        assert!(has_encoded_slash("/v1%2fchat"));
        assert!(!has_encoded_slash("/v1/chat?x=%2F"));
    }
}

#[cfg(all(test, not(target_arch = "wasm32")))]
mod props {
    use super::*;
    use proptest::prelude::*;

    fn path_strategy() -> impl Strategy<Value = String> {
        let piece = prop_oneof![
            Just("/".to_string()),
            Just("//".to_string()),
            Just(".".to_string()),
            Just("..".to_string()),
            Just("v1".to_string()),
            Just("chat".to_string()),
            Just("completions".to_string()),
            "%[0-9a-fA-F]{2}",
            "%[0-9a-zA-Z]{0,2}",
            "[a-z~._-]{1,3}",
            "[\\x00-\\x7f]",
            "\\PC",
        ];
        proptest::collection::vec(piece, 0..12).prop_map(|v| v.concat())
    }

    proptest! {
        /// The canonical form is canonical: checking it again passes, and canonicalizing it is
        /// the identity.
        #[test]
        fn canonical_is_a_fixed_point(p in path_strategy()) {
            if let Ok(c) = canonical(&p, false) {
                prop_assert_eq!(check(&c), Ok(()));
                prop_assert_eq!(canonical(&c, false), Ok(c.clone()));
                // No escape of an unreserved character, no `//`, no dot segment survives.
                if c.starts_with('/') {
                    prop_assert!(!c.contains("//"));
                    prop_assert!(!c.split('/').any(|s| s == "." || s == ".."));
                }
            }
        }

        /// A path that passes the check is its own canonical form (what goes upstream is what
        /// was classified), and the check never panics.
        #[test]
        fn passing_paths_are_canonical(p in path_strategy()) {
            if check(&p).is_ok() {
                prop_assert_eq!(canonical(&p, false), Ok(path_part(&p).to_string()));
            }
        }
    }
}
