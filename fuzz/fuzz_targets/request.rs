//! Body parsing and session derivation on arbitrary bytes: never panics, and what it accepts
//! obeys the documented bounds. Run: `scripts/fuzz` (or `cargo +nightly fuzz run request`).
//!
//! Byte-level mutation rarely builds long runs of multi-byte characters, which is where
//! issue 14 hid (an error message cut inside a character). So an input may also carry a
//! [`Long`] text — up to 3 ASCII bytes, then one character repeated up to 2047 times — put
//! into each shape of body the parser refuses, and used as the session header.
#![no_main]

use arbitrary::Arbitrary;
use computeflux::scheduler::wire::request::{openai_error, parse_chat, MAX_MODEL_BYTES};
use computeflux::scheduler::wire::session::{derive_session, SessionHeaders};
use computeflux::scheduler::SessionSource;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

#[derive(Arbitrary, Debug)]
struct Input<'a> {
    tenant: Option<&'a [u8]>,
    session_header: Option<&'a [u8]>,
    /// Whether to also try the body with a valid model spliced in front (reaches deeper paths).
    splice: bool,
    long: Option<Long>,
    body: &'a [u8],
}

/// Long text of one (often multi-byte) character.
#[derive(Arbitrary, Debug)]
struct Long {
    lead: u8,
    ch: char,
    count: u16,
}

impl Long {
    fn text(&self) -> String {
        let mut s = "a".repeat(usize::from(self.lead % 4));
        let ch = if matches!(self.ch, '"' | '\\') {
            'é'
        } else {
            self.ch
        };
        s.extend(std::iter::repeat_n(ch, usize::from(self.count % 2048)));
        s
    }
}

/// Each shape of body the parser refuses, quoting `t` where JSON allows.
fn bodies(t: &str) -> [String; 9] {
    [
        format!(r#"{{"model":"llama-3-8b","messages":"{t}"}}"#),
        format!(r#"{{"model":"llama-3-8b","messages":[{t}]}}"#),
        format!(r#"{{"model":"{t}"#),
        format!(r#"{{"model":"{t}"}}"#),
        format!(r#"{{"model":["{t}"]}}"#),
        format!(r#"{{"messages":"{t}"}}"#),
        format!(r#"["{t}"]"#),
        format!(r#"["{t}""#),
        format!(r#"{{"model":"m","x":{t}}}"#),
    ]
}

fn check(body: &[u8], tenant: Option<&[u8]>, header: Option<&[u8]>) {
    match parse_chat(body) {
        Ok(req) => {
            assert!(!req.model.is_empty() && req.model.len() <= MAX_MODEL_BYTES);
            if let Some(u) = &req.user {
                assert!(!u.is_empty());
            }
            // Deterministic.
            assert_eq!(parse_chat(body).ok(), Some(req.clone()));
            // What a full parser reads agrees (when it can parse at all: its recursion limit).
            if let Ok(Value::Object(obj)) = serde_json::from_slice::<Value>(body) {
                assert_eq!(
                    obj.get("model").and_then(Value::as_str),
                    Some(req.model.as_str())
                );
            }
            let headers = SessionHeaders {
                configured: header,
                harness: None,
            };
            let (key, source) = derive_session(tenant, headers, &req, body);
            assert_ne!(key, Some(0), "0 is reserved");
            let has_header = header.is_some_and(|h| !h.is_empty());
            let has_pck = req
                .prompt_cache_key
                .clone()
                .and_then(|r| body.get(r))
                .is_some_and(|k| !k.is_empty());
            match source {
                SessionSource::Header => assert!(has_header),
                SessionSource::PromptCacheKey => assert!(!has_header && has_pck),
                SessionSource::User => assert!(!has_header && !has_pck && req.user.is_some()),
                SessionSource::Fingerprint => assert!(
                    !has_header && !has_pck && req.user.is_none() && req.fingerprint.is_some()
                ),
                SessionSource::None => assert!(key.is_none() && !has_header && !has_pck),
                SessionSource::HarnessHeader | SessionSource::PreviousResponse => {
                    panic!("not derivable here: {source:?}")
                }
            }
            assert_eq!(derive_session(tenant, headers, &req, body), (key, source));
        }
        Err(e) => {
            assert!(matches!(e.status(), 400 | 413));
            let message = e.message();
            // Errors describe, they do not echo the client's input back.
            assert!(!message.is_empty() && message.len() <= 320, "{message}");
            let json: Value = serde_json::from_str(&openai_error(&message, "x", e.code()))
                .expect("error body is JSON");
            assert_eq!(json["error"]["code"], e.code());
        }
    }
}

fuzz_target!(|input: Input<'_>| {
    check(input.body, input.tenant, input.session_header);
    if let Some(long) = &input.long {
        let t = long.text();
        for body in bodies(&t) {
            check(body.as_bytes(), input.tenant, Some(t.as_bytes()));
        }
    }
    if input.splice {
        let mut spliced = br#"{"model":"m","messages":"#.to_vec();
        spliced.extend_from_slice(input.body);
        spliced.push(b'}');
        check(&spliced, input.tenant, input.session_header);
    }
});
