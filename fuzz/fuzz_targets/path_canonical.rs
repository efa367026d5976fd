//! Path canonicalization and request classification on arbitrary paths, and the judgment of
//! 429 bodies: never panics, and a path the filter accepts is the path it classified.
//! Run: `scripts/fuzz` (or `cargo +nightly fuzz run path_canonical`).
//!
//! Checked for every input:
//! - `path::check` accepts exactly the paths equal to their canonical form, and the canonical
//!   form is a fixed point (canonicalizing it again changes nothing and it passes the check);
//! - a path `api::policy` does not refuse is canonical, and when it holds `%2F` the upstream's
//!   reading (every `%2F` decoded) names the same API;
//! - `blame::judge_429` on the same bytes read as an answer body never panics and depends only
//!   on the first `JUDGE_BYTES`.
#![no_main]

use computeflux::scheduler::health::blame::{judge_429, JUDGE_BYTES};
use computeflux::scheduler::wire::api::{policy, Handling};
use computeflux::scheduler::wire::path::{canonical, check, has_encoded_slash, path_part};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let head = data.get(..JUDGE_BYTES).unwrap_or(data);
    assert_eq!(judge_429(data), judge_429(head));
    let Ok(path) = std::str::from_utf8(data) else {
        return;
    };
    match canonical(path, false) {
        Ok(c) => {
            assert_eq!(check(path).is_ok(), c == path_part(path));
            assert_eq!(canonical(&c, false).as_deref(), Ok(c.as_str()));
            assert!(check(&c).is_ok(), "{c:?}");
        }
        Err(e) => assert_eq!(check(path), Err(e)),
    }
    for method in ["POST", "GET"] {
        let h = policy(method, path, Some("application/json"));
        if !matches!(h, Handling::InvalidPath(_)) {
            assert!(check(path).is_ok(), "{path:?} classified as {h:?}");
            if has_encoded_slash(path) {
                let decoded = canonical(path, true).expect("decodable");
                let again = policy(method, &decoded, Some("application/json"));
                assert_eq!(
                    std::mem::discriminant(&h),
                    std::mem::discriminant(&again),
                    "{path:?} vs {decoded:?}"
                );
            }
        }
    }
});
