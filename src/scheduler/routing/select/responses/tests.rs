use super::*;
use crate::scheduler::health::outcome::Outcome;
use crate::scheduler::routing::select::{AffinityResult, Pick, Prefix, Reason};
use crate::scheduler::state::store::MemStore;
use serde_json::json;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

fn fleet() -> Config {
    Config::from_value(&json!({"endpoints": [
        {"name": "a", "cluster": "a", "models": ["m"]},
        {"name": "b", "cluster": "b", "models": ["m"]},
        {"name": "c", "cluster": "c", "models": ["other"]},
        {"name": "d", "cluster": "d", "models": ["m"], "disabled": true},
    ]}))
    .unwrap()
}

fn id_of(cfg: &Config, name: &str) -> u32 {
    cfg.endpoints.iter().find(|e| e.name == name).unwrap().id
}

#[test]
fn keys_are_tenant_scoped_and_apart_from_sessions() {
    let k = response_key(Some(b"Bearer A"), "resp_1");
    assert_ne!(k, response_key(Some(b"Bearer B"), "resp_1"));
    assert_ne!(k, response_key(Some(b"Bearer A"), "resp_2"));
    assert_eq!(k, response_key(Some(b"Bearer A"), "resp_1"));
    // A session header of the same text is another key.
    assert_ne!(k, session_key(b"Bearer A", b"h:resp_1"));
    assert_ne!(k, session_key(b"Bearer A", b"resp_1"));
}

#[test]
fn remembered_holder_is_picked_as_an_affinity_hit() {
    let cfg = fleet();
    let store = MemStore::new();
    let sched = Scheduler::new(&cfg, &store);
    let b = id_of(&cfg, "b");
    assert_eq!(holder(&sched, Some(b"t"), "resp_1", 0), None);
    assert!(remember(&sched, Some(b"t"), "resp_1", b, 1_000));
    assert_eq!(holder(&sched, Some(b"t"), "resp_1", 2_000), Some(b));
    assert_eq!(holder(&sched, Some(b"other"), "resp_1", 2_000), None);
    assert_eq!(
        holder(&sched, Some(b"t"), "resp_1", 1_000 + cfg.affinity_ttl_ms),
        None,
        "idle past the TTL"
    );
    // The follow-up's session is the response key: the scheduler picks the holder.
    let ex = Exclusions::default();
    assert_eq!(check_holder(&sched, b, Some("m"), &ex, 2_000), Ok(1));
    let d = sched
        .pick(
            &Pick {
                model: Some("m"),
                session: Some(response_key(Some(b"t"), "resp_1")),
                attempt: 1,
                exclusions: &ex,
                nonce: 0,
                body_bytes: 0,
                pin_hint: None,
                holder: None,
                prefix: Prefix::NONE,
                follow_up: false,
                max_output_tokens: 0,
            },
            2_000,
        )
        .unwrap();
    assert_eq!(
        (d.endpoint, d.reason, d.affinity),
        (1, Reason::AffinityHit, AffinityResult::Hit)
    );
}

#[test]
fn holder_unavailable_reasons() {
    let cfg = fleet();
    let store = MemStore::new();
    let sched = Scheduler::new(&cfg, &store);
    let ex = Exclusions::default();
    let now = 10_000;
    assert_eq!(
        check_holder(&sched, 12345, Some("m"), &ex, now),
        Err(HolderUnavailable::NotConfigured)
    );
    assert_eq!(
        check_holder(&sched, id_of(&cfg, "d"), Some("m"), &ex, now),
        Err(HolderUnavailable::Disabled { name: "d".into() })
    );
    assert_eq!(
        check_holder(&sched, id_of(&cfg, "c"), Some("m"), &ex, now),
        Err(HolderUnavailable::ModelNotServed { name: "c".into() })
    );
    let tried = Exclusions {
        tried: vec![0],
        ..Exclusions::default()
    };
    assert_eq!(
        check_holder(&sched, id_of(&cfg, "a"), Some("m"), &tried, now),
        Err(HolderUnavailable::FailedInRequest { name: "a".into() })
    );
    // A 429 with Retry-After 7 s opens a's breaker: cooling down, rate limited.
    let d = sched
        .pick(
            &Pick {
                model: Some("m"),
                session: None,
                attempt: 1,
                exclusions: &Exclusions {
                    tried: vec![1],
                    ..Exclusions::default()
                },
                nonce: 0,
                body_bytes: 0,
                pin_hint: None,
                holder: None,
                prefix: Prefix::NONE,
                follow_up: false,
                max_output_tokens: 0,
            },
            now,
        )
        .unwrap();
    assert_eq!(d.endpoint, 0);
    let limited = Outcome::RateLimited {
        retry_after_ms: Some(7_000),
    };
    sched.finish(d.ticket, &limited, 5, None, now);
    let err = check_holder(&sched, id_of(&cfg, "a"), Some("m"), &ex, now + 1).unwrap_err();
    assert_eq!(
        err,
        HolderUnavailable::CoolingDown {
            name: "a".into(),
            retry_at_ms: now + 7_000,
            rate_limited: true,
        }
    );
    assert_eq!(
        (err.status(), err.code()),
        (503, "previous_response_unavailable")
    );
    assert_eq!(err.retry_after_s(now + 1), Some(7));
    assert_eq!(
        check_holder(&sched, id_of(&cfg, "a"), Some("m"), &ex, now + 7_000),
        Ok(0)
    );
    // Without a model (e.g. GET /v1/responses/{id}) only the endpoint's state matters.
    assert_eq!(
        check_holder(&sched, id_of(&cfg, "c"), None, &ex, now),
        Ok(2)
    );
}

#[test]
fn error_bodies_name_the_reason() {
    let gone = HolderUnavailable::Disabled {
        name: "gpu-a".into(),
    };
    assert_eq!(
        (gone.status(), gone.code()),
        (404, "previous_response_not_found")
    );
    assert_eq!(gone.retry_after_s(0), None);
    let body: serde_json::Value = serde_json::from_str(&gone.body("resp_\"x", 0)).unwrap();
    assert_eq!(body["error"]["param"], "previous_response_id");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("resp_\"x") && msg.contains("gpu-a") && msg.contains("disabled"),
        "{msg}"
    );
    let failed = HolderUnavailable::FailedInRequest { name: "b".into() };
    assert_eq!((failed.status(), failed.kind()), (503, "server_error"));
    assert_eq!(failed.retry_after_s(0), Some(1));
    assert_eq!(HolderUnavailable::NotConfigured.status(), 404);
}

#[test]
fn follow_up_fields() {
    let f = parse_follow_up(br#"{"model":"m","previous_response_id":"resp_1","input":"more"}"#);
    assert_eq!(
        f,
        FollowUp {
            previous_response_id: Some("resp_1".into()),
            store: true,
            whole_input: false
        }
    );
    let f =
        parse_follow_up(br#"{"model":"m","store":false,"input":[{"role":"user","content":"x"}]}"#);
    assert_eq!(
        (f.previous_response_id, f.store, f.whole_input),
        (None, false, false)
    );
    let replay = br#"{"model":"m","previous_response_id":"r","input":[
        {"role":"user","content":"q"},{"role":"assistant","content":"a"},{"role":"user","content":"q2"}]}"#;
    assert!(parse_follow_up(replay).whole_input);
    let tool = br#"{"model":"m","input":[{"type":"function_call","call_id":"c","name":"f","arguments":"{}"},
        {"type":"function_call_output","call_id":"c","output":"1"}]}"#;
    assert!(parse_follow_up(tool).whole_input);
    // Unusable ids are ignored; unreadable bodies are not follow-ups.
    let long = format!(
        r#"{{"previous_response_id":"{}"}}"#,
        "r".repeat(MAX_RESPONSE_ID_BYTES + 1)
    );
    assert_eq!(parse_follow_up(long.as_bytes()).previous_response_id, None);
    assert_eq!(
        parse_follow_up(br#"{"previous_response_id":7}"#).previous_response_id,
        None
    );
    assert_eq!(parse_follow_up(b"nope").previous_response_id, None);
    // The body for another endpoint loses only the previous_response_id member.
    let stripped = without_previous_response_id(replay).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&stripped).unwrap();
    assert!(v.get("previous_response_id").is_none());
    assert_eq!(v["input"].as_array().unwrap().len(), 3);
}

const JSON_ANSWER: &[u8] =
    br#"{"id":"resp_abc","object":"response","created_at":1,"output":[{"id":"msg_1"}]}"#;

const SSE_ANSWER: &[u8] = b"event: response.created\n\
data: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_s1\",\"object\":\"response\",\"output\":[]}}\n\n\
event: response.output_text.delta\n\
data: {\"type\":\"response.output_text.delta\",\"item_id\":\"msg_1\",\"delta\":\"hi\"}\n\n";

#[test]
fn id_from_a_json_answer_in_any_chunking() {
    for size in [1, 2, 7, JSON_ANSWER.len()] {
        let mut scan = IdScan::new(AnswerFormat::Json);
        let mut last = Scan::NeedMore;
        for chunk in JSON_ANSWER.chunks(size) {
            last = scan.feed(chunk);
            if last != Scan::NeedMore {
                break;
            }
        }
        if last == Scan::NeedMore {
            last = scan.finish().map_or(Scan::Absent, Scan::Found);
        }
        assert_eq!(last, Scan::Found("resp_abc".into()), "chunks of {size}");
    }
    // Found is final.
    let mut scan = IdScan::new(AnswerFormat::Json);
    scan.feed(JSON_ANSWER);
    assert_eq!(scan.feed(b"garbage"), Scan::Found("resp_abc".into()));
    assert_eq!(scan.finish(), Some("resp_abc".into()));
}

#[test]
fn id_from_the_first_sse_event() {
    for size in [1, 3, 50, SSE_ANSWER.len()] {
        let mut scan = IdScan::new(AnswerFormat::EventStream);
        let mut last = Scan::NeedMore;
        for chunk in SSE_ANSWER.chunks(size) {
            last = scan.feed(chunk);
            if last != Scan::NeedMore {
                break;
            }
        }
        if last == Scan::NeedMore {
            last = scan.finish().map_or(Scan::Absent, Scan::Found);
        }
        assert_eq!(last, Scan::Found("resp_s1".into()), "chunks of {size}");
    }
    // CRLF framing, a comment and a data-less event first.
    let crlf =
        b": keep-alive\r\n\r\nevent: ping\r\n\r\ndata: {\"response\":{\"id\":\"r2\"}}\r\n\r\n";
    assert_eq!(
        IdScan::new(AnswerFormat::EventStream).feed(crlf),
        Scan::Found("r2".into())
    );
    // An event without the id is skipped; the end of the body without one: none.
    let mut scan = IdScan::new(AnswerFormat::EventStream);
    assert_eq!(
        scan.feed(b"data: {\"type\":\"x\"}\n\ndata: [DONE]\n\n"),
        Scan::NeedMore
    );
    assert_eq!(scan.finish(), None);
}

#[test]
fn gives_up_after_the_scan_bound() {
    let mut scan = IdScan::new(AnswerFormat::Json);
    assert_eq!(scan.feed(b"{\"pad\":\""), Scan::NeedMore);
    let pad = vec![b'x'; ID_SCAN_BYTES];
    assert_eq!(scan.feed(&pad), Scan::Absent);
    assert_eq!(scan.feed(b"\",\"id\":\"late\"}"), Scan::Absent);
    let mut sse = IdScan::new(AnswerFormat::EventStream);
    assert_eq!(sse.feed(&vec![b'a'; ID_SCAN_BYTES + 10]), Scan::Absent);
    assert_eq!(
        AnswerFormat::from_content_type("text/event-stream; charset=utf-8"),
        Some(AnswerFormat::EventStream)
    );
    assert_eq!(
        AnswerFormat::from_content_type("Application/JSON"),
        Some(AnswerFormat::Json)
    );
    assert_eq!(AnswerFormat::from_content_type("text/plain"), None);
}

#[test]
fn tiny_chunks_cost_linear_work() {
    // Byte by byte, the prefix is rescanned only at doublings: about log2(n) scans, and the
    // id is found within one doubling of its end.
    let mut scan = IdScan::new(AnswerFormat::Json);
    let mut found_at = None;
    for (i, b) in JSON_ANSWER.iter().enumerate() {
        if let Scan::Found(id) = scan.feed(std::slice::from_ref(b)) {
            assert_eq!(id, "resp_abc");
            found_at = Some(i + 1);
            break;
        }
    }
    let id_end = JSON_ANSWER
        .windows(10)
        .position(|w| w == b"resp_abc\",")
        .unwrap()
        + 9;
    let at = found_at.expect("found before the end");
    assert!(
        at >= id_end && at <= 2 * id_end,
        "found at {at}, id ends at {id_end}"
    );
}
