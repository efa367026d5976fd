//! Every error path, fed long multi-byte text: nothing panics, and every answer is a bounded
//! OpenAI error.
//!
//! Why this file: issue 14. serde_json quotes the client's text in its error message, the
//! filter cut that message at byte 160, and a body of 200 `é` put the cut inside a character:
//! a panic, a dead VM, an empty 503. The generators of `scheduler_props.rs` and the fuzz
//! targets produced short, mostly ASCII strings and never got there. Here every generated
//! string is long (hundreds of characters) and made of 2-, 3- and 4-byte characters after
//! 0–3 ASCII bytes, so every cut position inside a character is reached, on every path that
//! turns text into an error: body parsing, session keys, the lifecycle's replies (which
//! quote the model), upstream rate-limit hints, header lists from the host, and the
//! configuration parser.

// Test code: a failed unwrap is a failed test.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use computeflux::scheduler::flow::{Flow, Step};
use computeflux::scheduler::health::outcome::{parse_retry_after, retry_hint_ms};
use computeflux::scheduler::time::parse_go_duration_ms;
use computeflux::scheduler::wire::headers::decode_pairs;
use computeflux::scheduler::wire::reply::{Reply, MAX_MESSAGE_BYTES};
use computeflux::scheduler::wire::request::parse_chat;
use computeflux::scheduler::wire::session::{derive_session, SessionHeaders};
use computeflux::scheduler::wire::text;
use computeflux::scheduler::{Config, MemStore, RejectReason, Scheduler};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use serde_json::{json, Value};

fn props(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Off)),
        ..ProptestConfig::default()
    }
}

/// Long text of multi-byte characters after a few ASCII bytes: every byte offset of a cut
/// modulo the character width is reached.
fn long_text() -> impl Strategy<Value = String> {
    let ch = prop_oneof![
        Just('é'),  // 2 bytes
        Just('€'),  // 3 bytes
        Just('中'), // 3 bytes
        Just('𝄞'),  // 4 bytes
        Just('😀'), // 4 bytes
        any::<char>().prop_filter("not a JSON-special char", |c| !matches!(c, '"' | '\\')
            && !c.is_control()),
    ];
    (0usize..4, ch, 60usize..700).prop_map(|(lead, c, n)| {
        let mut s = "a".repeat(lead);
        s.extend(std::iter::repeat_n(c, n));
        s
    })
}

/// A body for each way the body parser refuses a request, quoting `t` where JSON allows.
fn bodies(t: &str) -> Vec<String> {
    vec![
        format!(r#"{{"model":"llama-3-8b","messages":"{t}"}}"#), // issue 14: wrong type
        format!(r#"{{"model":"llama-3-8b","messages":[{t}]}}"#), // syntax error
        format!(r#"{{"model":"{t}"#),                            // unterminated
        format!(r#"{{"model":"{t}"}}"#),                         // too long, or unserved
        format!(r#"{{"model":["{t}"]}}"#),                       // not a string
        format!(r#"{{"messages":"{t}"}}"#),                      // no model
        format!(r#"["{t}"]"#),                                   // not an object
        format!(r#""{t}""#),                                     // not an object
        format!(r#"["{t}""#),                                    // invalid, not an object
        format!(r#"{{"model":"m","user":{{"{t}":1}},"x":{t}}}"#), // error after a valid part
        format!("{{\"model\":\"m\",\"messages\":\"{t}\u{1}\"}}"), // control character
    ]
}

/// The error body of a reply: an OpenAI error, bounded, that names `reason`.
fn check_reply(reply: &Reply) -> Result<(), TestCaseError> {
    prop_assert!(reply.message.len() <= MAX_MESSAGE_BYTES);
    let body = reply.body();
    prop_assert!(body.len() < 1024, "{} bytes: {body}", body.len());
    let v: Value = serde_json::from_str(&body).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(v["error"]["code"].as_str(), Some(reply.reason.label()));
    prop_assert!(v["error"]["message"]
        .as_str()
        .is_some_and(|m| !m.is_empty()));
    Ok(())
}

fn config() -> Config {
    Config::from_value(&json!({"endpoints": [
        {"name": "a", "cluster": "ca", "models": ["llama-3-8b", "m"]},
    ]}))
    .unwrap()
}

proptest! {
    #![proptest_config(props(256))]

    /// The one cut every message goes through: a prefix, within the budget, as long as the
    /// budget allows without splitting a character.
    #[test]
    fn truncate_cuts_on_character_boundaries(s in prop_oneof![long_text(), any::<String>()], max in 0usize..2000) {
        let cut = text::truncate(&s, max);
        prop_assert!(s.starts_with(cut));
        prop_assert!(cut.len() <= max);
        if cut.len() < s.len() {
            let next = s[cut.len()..].chars().next().unwrap();
            prop_assert!(cut.len() + next.len_utf8() > max, "not the longest cut");
        }
    }

    /// Every refusal of the body parser, quoting long multi-byte text: no panic, a bounded
    /// message, an OpenAI error body.
    #[test]
    fn body_errors_with_multibyte_text_are_bounded_openai_errors(t in long_text()) {
        for body in bodies(&t) {
            match parse_chat(body.as_bytes()) {
                Ok(req) => {
                    let _ = derive_session(Some(t.as_bytes()), SessionHeaders::default(), &req, body.as_bytes());
                }
                Err(e) => {
                    prop_assert!(matches!(e.status(), 400 | 413));
                    prop_assert!(e.message().len() <= 320, "{}", e.message());
                    check_reply(&e.reply())?;
                }
            }
        }
    }

    /// Session headers of multi-byte text, of any length: always a key (hashed, never refused).
    #[test]
    fn session_headers_of_multibyte_text(t in long_text(), times in 1usize..12) {
        let body = br#"{"model":"m"}"#;
        let req = parse_chat(body).unwrap();
        let header = t.repeat(times);
        let (key, _) = derive_session(None, SessionHeaders::configured(header.as_bytes()), &req, body);
        prop_assert!(header.is_empty() || key.is_some());
    }

    /// The whole request path through the lifecycle: every body either routes or is answered
    /// with a bounded OpenAI error (including `model_not_found`, which quotes the model).
    #[test]
    fn the_lifecycle_answers_multibyte_bodies_with_openai_errors(t in long_text()) {
        let cfg = config();
        let store = MemStore::new();
        let s = Scheduler::new(&cfg, &store);
        let mut bodies = bodies(&t);
        bodies.push(format!(r#"{{"model":"{}"}}"#, text::truncate(&t, 256)));
        for body in bodies {
            let mut flow = Flow::default();
            let headers = vec![
                (":method".to_string(), b"POST".to_vec()),
                (":path".to_string(), b"/v1/chat/completions".to_vec()),
                ("x-session-id".to_string(), t.as_bytes().to_vec()),
            ];
            prop_assert_eq!(flow.on_request_headers(&s, &mut (), headers, false, 0), Step::Pause);
            let bytes = body.into_bytes();
            let step = flow.on_request_body(&s, &mut (), bytes.len(), true, &mut || bytes.clone(), 0);
            match step {
                Step::Route(0) => flow.on_log(&s, &mut (), 1),
                Step::Reply(reply) => {
                    check_reply(&reply)?;
                    prop_assert!(reply.status == 400 || reply.reason == RejectReason::ModelNotFound);
                }
                other => prop_assert!(false, "unexpected step {other:?}"),
            }
            prop_assert!(!flow.in_flight());
        }
    }

    /// Any message given to a reply is cut to the budget on a character boundary.
    #[test]
    fn replies_bound_any_message(t in long_text(), times in 1usize..8) {
        check_reply(&Reply::new(400, RejectReason::InvalidJson, &t.repeat(times)))?;
    }

    /// Upstream rate-limit hints in multi-byte text: read as absent, never a panic.
    #[test]
    fn rate_limit_hints_of_multibyte_text(t in long_text(), digits in "[0-9]{0,3}") {
        for v in [t.clone(), format!("{digits}{t}"), format!("{digits}s{t}"), format!("{t}{digits}ms")] {
            let _ = parse_go_duration_ms(&v);
            let _ = parse_retry_after(&v, 0);
            let hints = vec![
                ("retry-after".to_string(), v.clone()),
                ("retry-after-ms".to_string(), v.clone()),
                ("x-ratelimit-reset-requests".to_string(), v.clone()),
            ];
            let _ = retry_hint_ms(&hints, 0);
        }
    }

    /// Header lists from the host, well-formed or not: decoded or refused, never a panic.
    #[test]
    fn header_lists_decode_or_refuse(t in long_text(), noise in proptest::collection::vec(any::<u8>(), 0..64), cut in any::<usize>()) {
        let pairs: Vec<(&str, &[u8])> = vec![(t.as_str(), t.as_bytes()), ("x", noise.as_slice())];
        let bytes = computeflux::scheduler::wire::headers::encode_pairs(&pairs);
        let decoded = decode_pairs(&bytes).unwrap();
        prop_assert_eq!(decoded.len(), 2);
        prop_assert_eq!(decoded[0].0.as_str(), t.as_str());
        let _ = decode_pairs(&bytes[..cut % (bytes.len() + 1)]);
        let _ = decode_pairs(&noise);
    }

    /// Configuration errors quoting long multi-byte keys and values.
    #[test]
    fn configuration_errors_with_multibyte_text(t in long_text()) {
        for v in [
            json!({"endpoints": [{"name": t, "cluster": t}]}),
            json!({"endpoints": [{"name": "a", "cluster": "a", "headers": {(t.clone()): t}}]}),
            json!({(t.clone()): 1, "endpoints": [{"name": "a", "cluster": "a"}]}),
            json!({"endpoints": [{"name": "a", "cluster": "a", "models": [t, 1]}], "routing_header": t}),
        ] {
            match Config::from_value(&v) {
                Ok(_) => {}
                Err(errors) => {
                    prop_assert!(!errors.is_empty());
                    for e in errors {
                        let _ = e.to_string();
                    }
                }
            }
        }
    }
}
