//! The request lifecycle (`scheduler::flow::Flow`) driven by arbitrary sequences of Envoy's
//! callbacks — request headers, body chunks, trailers, answers, failover call answers,
//! refused calls, access log — over one `MemStore`, request after request.
//!
//! Invariants checked after every callback:
//! - nothing panics (bodies and header values include long multi-byte text, issue 14);
//! - every local reply is an OpenAI error body, valid JSON, under 1 KiB;
//! - a `Dispatch` names an endpoint the flow can build a call for, and never more than
//!   `max_attempts` endpoints are tried;
//! - every ticket is handed back: after `on_log` the flow holds no attempt, and once every
//!   request is logged the shared table has nothing in flight.
#![no_main]

use arbitrary::Arbitrary;
use computeflux::scheduler::flow::{Flow, Step};
use computeflux::scheduler::routing::table::Table;
use computeflux::scheduler::wire::headers::Pairs;
use computeflux::scheduler::wire::reply::MAX_MESSAGE_BYTES;
use computeflux::scheduler::{Config, MemStore, Scheduler};
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Value};

#[derive(Arbitrary, Debug)]
struct Input<'a> {
    max_attempts: u8,
    endpoints: u8,
    events: Vec<Event<'a>>,
}

#[derive(Arbitrary, Debug)]
enum Body<'a> {
    Valid,
    Raw(&'a [u8]),
    Long {
        lead: u8,
        ch: char,
        count: u16,
        shape: u8,
    },
}

impl Body<'_> {
    fn bytes(&self) -> Vec<u8> {
        match self {
            Body::Valid => br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#.to_vec(),
            Body::Raw(b) => b.to_vec(),
            Body::Long {
                lead,
                ch,
                count,
                shape,
            } => {
                let ch = if matches!(ch, '"' | '\\') { 'é' } else { *ch };
                let mut t = "a".repeat(usize::from(lead % 4));
                t.extend(std::iter::repeat_n(ch, usize::from(count % 2048)));
                match shape % 4 {
                    0 => format!(r#"{{"model":"m","messages":"{t}"}}"#),
                    1 => format!(r#"{{"model":"{t}"}}"#),
                    2 => format!(r#"{{"model":"m","messages":[{t}]}}"#),
                    _ => format!(r#"{{"model":"m","user":"{t}"}}"#),
                }
                .into_bytes()
            }
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Event<'a> {
    /// Logs the current request and starts the next one with these headers.
    Request {
        post: bool,
        end_of_stream: bool,
        content_length: Option<u32>,
        session: Option<&'a [u8]>,
        routing: Option<&'a [u8]>,
    },
    Body {
        buffered: u16,
        end_of_stream: bool,
        body: Body<'a>,
    },
    Trailers(Body<'a>),
    Answer {
        status: Option<u16>,
        retry_after: Option<&'a [u8]>,
        end_of_stream: bool,
    },
    AnswerEnd,
    CallAnswer {
        status: Option<u16>,
        from_upstream: bool,
        body_size: u32,
    },
    DispatchFailed,
    Log,
    Advance(u16),
}

fn pairs(list: &[(&str, &[u8])]) -> Pairs {
    list.iter()
        .map(|(k, v)| (k.to_string(), v.to_vec()))
        .collect()
}

fn check(step: &Step, flow: &Flow, cfg: &Config) {
    match step {
        Step::Reply(r) => {
            assert!(r.message.len() <= MAX_MESSAGE_BYTES);
            let body = r.body();
            assert!(body.len() < 1024, "{body}");
            let v: Value = serde_json::from_str(&body).expect("reply is JSON");
            assert_eq!(v["error"]["code"], r.reason.label());
        }
        Step::Dispatch(i) => assert!(flow.call(cfg, *i).is_some(), "dispatch to {i}"),
        _ => {}
    }
    assert!(
        flow.attempts() <= cfg.max_attempts,
        "{} attempts",
        flow.attempts()
    );
}

fuzz_target!(|input: Input<'_>| {
    let n = usize::from(input.endpoints % 4) + 1;
    let endpoints: Vec<Value> = (0..n)
        .map(|i| json!({"name": format!("e{i}"), "cluster": format!("c{i}"), "weight": i + 1}))
        .collect();
    let Ok(cfg) = Config::from_value(&json!({
        "endpoints": endpoints,
        "max_attempts": u32::from(input.max_attempts % 4) + 1,
        "max_body_bytes": 65536,
        "tuning": {"retry_budget_min_retries": 1000},
    })) else {
        return;
    };
    let store = MemStore::new();
    let s = Scheduler::new(&cfg, &store);
    let mut now = 1_000u64;
    let mut flow = Flow::default();
    for event in &input.events {
        let step = match event {
            Event::Request {
                post,
                end_of_stream,
                content_length,
                session,
                routing,
            } => {
                flow.on_log(&s, &mut (), now);
                assert!(!flow.in_flight());
                flow = Flow::default();
                let method: &[u8] = if *post { b"POST" } else { b"GET" };
                let mut h = pairs(&[(":method", method), (":path", b"/v1/chat/completions")]);
                if let Some(n) = content_length {
                    h.push(("content-length".into(), n.to_string().into_bytes()));
                }
                if let Some(v) = session {
                    h.push(("x-session-id".into(), v.to_vec()));
                }
                if let Some(v) = routing {
                    h.push(("x-computeflux-cluster".into(), v.to_vec()));
                }
                flow.on_request_headers(&s, &mut (), h, *end_of_stream, now)
            }
            Event::Body {
                buffered,
                end_of_stream,
                body,
            } => {
                let bytes = body.bytes();
                let size = if *end_of_stream {
                    bytes.len()
                } else {
                    usize::from(*buffered)
                };
                flow.on_request_body(
                    &s,
                    &mut (),
                    size,
                    *end_of_stream,
                    &mut || bytes.clone(),
                    now,
                )
            }
            Event::Trailers(body) => {
                let bytes = body.bytes();
                let t = pairs(&[("x-checksum", b"abc")]);
                flow.on_request_trailers(&s, &mut (), t, &mut || bytes.clone(), now)
            }
            Event::Answer {
                status,
                retry_after,
                end_of_stream,
            } => {
                let mut h = Pairs::new();
                if let Some(st) = status {
                    h.push((":status".into(), st.to_string().into_bytes()));
                }
                if let Some(v) = retry_after {
                    h.push(("retry-after".into(), v.to_vec()));
                }
                flow.on_response_headers(&s, &mut (), &h, *end_of_stream, now)
            }
            Event::AnswerEnd => {
                flow.on_response_end(&s, &mut (), now);
                Step::Continue
            }
            Event::CallAnswer {
                status,
                from_upstream,
                body_size,
            } => {
                let headers = status.map(|st| {
                    let mut h = pairs(&[(":status", st.to_string().as_bytes())]);
                    if *from_upstream {
                        h.push(("x-envoy-upstream-service-time".into(), b"3".to_vec()));
                    }
                    h
                });
                flow.on_call_response(&s, &mut (), headers, *body_size as usize, now)
            }
            Event::DispatchFailed => {
                if flow.holds_answer() {
                    flow.dispatch_failed(&s, &mut (), now)
                } else {
                    Step::Continue
                }
            }
            Event::Log => {
                flow.on_log(&s, &mut (), now);
                assert!(!flow.in_flight());
                Step::Continue
            }
            Event::Advance(ms) => {
                now += u64::from(*ms);
                Step::Continue
            }
        };
        check(&step, &flow, &cfg);
    }
    flow.on_log(&s, &mut (), now);
    assert!(!flow.in_flight());
    let table = Table::read(&store, &cfg);
    for (i, (_, st)) in table.entries.iter().enumerate() {
        assert_eq!(
            st.in_flight, 0,
            "endpoint {i} still in flight after every request ended"
        );
    }
});
