// The flow's unit tests (over 600 lines: one scenario per lifecycle rule, on a native MemStore).
//! The request lifecycle natively, over `MemStore`: what used to be testable only through
//! Envoy (phases, attempt limit, failover loop, Envoy's own 5xx, in-flight accounting).

use super::*;
use crate::scheduler::config::Config;
use crate::scheduler::routing::table::Table;
use crate::scheduler::state::store::{MemStore, Store};
use crate::scheduler::wire::reply::RejectReason;
use serde_json::json;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

#[derive(Debug, Clone, PartialEq)]
enum Event {
    Picked(usize, u32),
    Finished(usize, &'static str, Timing, bool),
    FailedOver(usize),
    BudgetExhausted,
    Replied(&'static str),
    Usage(usize, &'static str, Usage),
    PinnedTurn(usize, bool),
}

#[derive(Default)]
struct Log(Vec<Event>);

impl Observer for Log {
    fn picked(&mut self, d: &Decision, attempt: u32) {
        self.0.push(Event::Picked(d.endpoint, attempt));
    }
    fn finished(&mut self, endpoint: usize, outcome: &Outcome, report: &Finished, t: Timing) {
        // The last field: whether the filter would count it as a lost update.
        let lost = !report.stored;
        self.0
            .push(Event::Finished(endpoint, outcome.label(), t, lost));
    }
    fn failed_over(&mut self, from: usize) {
        self.0.push(Event::FailedOver(from));
    }
    fn budget_exhausted(&mut self) {
        self.0.push(Event::BudgetExhausted);
    }
    fn replied(&mut self, reply: &Reply) {
        self.0.push(Event::Replied(reply.reason.label()));
    }
    fn usage(&mut self, endpoint: usize, affinity: AffinityResult, usage: &Usage) {
        self.0
            .push(Event::Usage(endpoint, affinity.label(), *usage));
    }
    fn pinned_turn(&mut self, endpoint: usize, cold: bool) {
        self.0.push(Event::PinnedTurn(endpoint, cold));
    }
}

impl Log {
    fn usages(&self) -> Vec<&Event> {
        self.0
            .iter()
            .filter(|e| matches!(e, Event::Usage(..)))
            .collect()
    }
}

/// Endpoints a (weight 10^6), b (10^3), c (1): cold, a request's rendezvous order is a, b, c
/// but for about one session in a thousand (weighted rendezvous; these tests' sessions are
/// fixed, and checked to be ordinary ones).
fn cfg(extra: serde_json::Value) -> Config {
    let mut v = json!({"endpoints": [
        {"name": "a", "cluster": "ca", "weight": 1_000_000, "headers": {"authorization": "Bearer ka"}},
        {"name": "b", "cluster": "cb", "weight": 1000},
        {"name": "c", "cluster": "cc", "weight": 1},
    ], "cold_start_samples": 1000000, "failure_threshold": 1000,
       "tuning": {"retry_budget_min_retries": 1000}});
    if let (Some(o), serde_json::Value::Object(more)) = (v.as_object_mut(), extra) {
        o.extend(more);
    }
    Config::from_value(&v).unwrap()
}

fn pairs(list: &[(&str, &str)]) -> Pairs {
    list.iter()
        .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
        .collect()
}

fn post_headers(extra: &[(&str, &str)]) -> Pairs {
    let mut h = pairs(&[
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        (":authority", "llm"),
        ("content-type", "application/json"),
    ]);
    h.extend(pairs(extra));
    h
}

const BODY: &[u8] = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;

fn in_flight(store: &MemStore, cfg: &Config) -> Vec<u32> {
    Table::read(&store, cfg)
        .entries
        .iter()
        .map(|(_, st)| st.in_flight)
        .collect()
}

/// Runs a POST with `BODY` up to its routing; returns the step.
fn route(f: &mut Flow, s: &Scheduler<'_>, log: &mut Log, headers: Pairs, now: u64) -> Step {
    assert_eq!(
        f.on_request_headers(s, log, headers, false, now),
        Step::Pause
    );
    assert_eq!(
        f.on_request_body(s, log, BODY.len() / 2, false, &mut || unreachable(), now),
        Step::Pause
    );
    f.on_request_body(s, log, BODY.len(), true, &mut || BODY.to_vec(), now)
}

/// A POST with `body` in one piece: the step its end returns.
fn send(f: &mut Flow, s: &Scheduler<'_>, log: &mut Log, body: &str) -> Step {
    f.on_request_headers(s, log, post_headers(&[]), false, 0);
    f.on_request_body(
        s,
        log,
        body.len(),
        true,
        &mut || body.as_bytes().to_vec(),
        0,
    )
}

fn unreachable() -> Vec<u8> {
    panic!("the body is read once, at its end")
}

#[test]
fn a_streamed_answer_is_in_flight_until_it_ends_with_latency_to_its_headers() {
    // No pin cookie: the headers compared below are the routing ones alone.
    let c = cfg(json!({"pin_cookie": false}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let mut log = Log::default();
    let mut f = Flow::default();
    let step = route(
        &mut f,
        &s,
        &mut log,
        post_headers(&[("x-session-id", "s1")]),
        1_000,
    );
    assert_eq!(step, Step::Route(0));
    assert_eq!(in_flight(&store, &c), vec![1, 0, 0]);
    let step = f.on_response_headers(&s, &mut log, &pairs(&[(":status", "200")]), false, 1_040);
    assert_eq!(
        step,
        Step::Relay(vec![
            (HEADER_ATTEMPTS, "1".into()),
            (HEADER_ENDPOINT, "a".into()),
            (HEADER_AFFINITY, "home".into()),
        ])
    );
    // The answer streams for 5 s: still one attempt in flight, no shared-data write.
    let writes = store.writes.get();
    assert_eq!(in_flight(&store, &c), vec![1, 0, 0]);
    f.on_response_end(&s, &mut log, 6_040);
    assert_eq!(in_flight(&store, &c), vec![0, 0, 0]);
    // One table write for the finish (its group, and its version in the header), one
    // affinity write for the pin: as at the headers.
    assert_eq!(store.writes.get(), writes + 3);
    let t = Timing {
        to_headers_ms: Some(40),
        total_ms: 5_040,
    };
    assert_eq!(
        log.0,
        vec![Event::Picked(0, 1), Event::Finished(0, "success", t, false)]
    );
    assert_eq!(Table::read(&store, &c).entries[0].1.latency_ms, Some(40.0));
    f.on_log(&s, &mut log, 7_000);
    assert_eq!(log.0.len(), 2, "finished exactly once");
}

/// An event stream's headers come before the prefill (vLLM, TGI): its latency sample is the
/// time to its first body byte, the time to first token; a plain answer keeps its headers' time.
#[test]
fn a_streamed_answer_is_timed_to_its_first_byte() {
    let c = cfg(json!({}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let mut log = Log::default();
    let mut f = Flow::default();
    let step = route(&mut f, &s, &mut log, post_headers(&[]), 1_000);
    assert_eq!(step, Step::Route(0));
    let sse = pairs(&[
        (":status", "200"),
        ("content-type", "text/event-stream; charset=utf-8"),
    ]);
    f.on_response_headers(&s, &mut log, &sse, false, 1_002);
    assert!(f.awaits_first_byte());
    f.on_first_byte(1_450);
    assert!(!f.awaits_first_byte());
    f.on_first_byte(1_900); // later chunks change nothing
    f.on_response_end(&s, &mut log, 3_000);
    let latency = |store: &MemStore| Table::read(&store, &c).entries[0].1.latency_ms;
    assert_eq!(latency(&store), Some(450.0));

    // A JSON answer: timed to its headers, whatever its body does.
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let mut f = Flow::default();
    route(&mut f, &s, &mut log, post_headers(&[]), 1_000);
    let json_answer = pairs(&[(":status", "200"), ("content-type", "application/json")]);
    f.on_response_headers(&s, &mut log, &json_answer, false, 1_300);
    assert!(!f.awaits_first_byte());
    f.on_first_byte(1_400);
    f.on_response_end(&s, &mut log, 1_400);
    assert_eq!(latency(&store), Some(300.0));
}

#[test]
fn a_stream_cut_midway_keeps_its_verdict_and_no_answer_is_cancelled() {
    let c = cfg(json!({}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let mut log = Log::default();
    // Cut after the headers (upstream reset or client gone): on_log, the verdict of the headers.
    let mut f = Flow::default();
    route(&mut f, &s, &mut log, post_headers(&[]), 0);
    f.on_response_headers(&s, &mut log, &pairs(&[(":status", "200")]), false, 10);
    f.on_log(&s, &mut log, 900);
    // Gone before any answer: cancelled.
    let mut g = Flow::default();
    route(&mut g, &s, &mut log, post_headers(&[]), 1_000);
    g.on_log(&s, &mut log, 1_500);
    let finished: Vec<&Event> = log
        .0
        .iter()
        .filter(|e| matches!(e, Event::Finished(..)))
        .collect();
    assert_eq!(
        finished,
        vec![
            &Event::Finished(
                0,
                "success",
                Timing {
                    to_headers_ms: Some(10),
                    total_ms: 900
                },
                false
            ),
            &Event::Finished(
                0,
                "cancelled",
                Timing {
                    to_headers_ms: Some(500),
                    total_ms: 500
                },
                false
            ),
        ]
    );
    assert_eq!(in_flight(&store, &c), vec![0, 0, 0]);
    // An answer that ends at its headers (HEAD, 204) finishes at once.
    let mut h = Flow::default();
    let get = pairs(&[(":method", "HEAD"), (":path", "/v1/models")]);
    assert_eq!(
        h.on_request_headers(&s, &mut log, get, true, 2_000),
        Step::Route(0)
    );
    h.on_response_headers(&s, &mut log, &pairs(&[(":status", "200")]), true, 2_005);
    assert!(!h.in_flight());
    assert_eq!(in_flight(&store, &c), vec![0, 0, 0]);
}

#[test]
fn failover_chain_relays_the_last_answer_with_its_headers() {
    let c = cfg(json!({"max_attempts": 3}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let mut log = Log::default();
    let mut f = Flow::default();
    let client = post_headers(&[
        ("x-computeflux-cluster", "cc"),
        ("authorization", "Bearer client"),
    ]);
    assert_eq!(route(&mut f, &s, &mut log, client, 0), Step::Route(0));
    // a: 503 → held, b called.
    let step = f.on_response_headers(&s, &mut log, &pairs(&[(":status", "503")]), false, 5);
    assert_eq!(step, Step::Dispatch(1));
    assert!(f.holds_answer());
    let call = f.call(&c, 1).unwrap();
    assert_eq!(call.cluster, "cb");
    assert_eq!(call.body, BODY);
    assert_eq!(call.timeout_ms, c.failover_timeout_ms);
    assert!(
        call.headers.header("x-computeflux-cluster").is_none(),
        "routing header removed"
    );
    assert_eq!(
        call.headers.header("content-length").as_deref(),
        Some(BODY.len().to_string().as_bytes())
    );
    // a's own API key goes to a only; the client's reaches b (b sets none).
    let to_a = f.call(&c, 0).unwrap();
    assert_eq!(
        to_a.headers.header("authorization").as_deref(),
        Some(&b"Bearer ka"[..])
    );
    assert_eq!(
        call.headers.header("authorization").as_deref(),
        Some(&b"Bearer client"[..])
    );
    assert_eq!(in_flight(&store, &c), vec![0, 1, 0]);
    // b: 429 with a hint → c called.
    let b_answer = pairs(&[
        (":status", "429"),
        ("retry-after", "7"),
        (UPSTREAM_MARKER, "1"),
    ]);
    let step = f.on_call_response(&s, &mut log, Some(b_answer), 10, 20);
    assert_eq!(step, Step::Dispatch(2));
    // c: 200 → relayed, hop-by-hop and pseudo headers dropped, explanations added.
    let c_answer = pairs(&[
        (":status", "200"),
        ("content-type", "text/event-stream"),
        ("content-length", "999"),
        ("transfer-encoding", "chunked"),
        (HEADER_ATTEMPTS, "forged"),
        (UPSTREAM_MARKER, "3"),
    ]);
    let step = f.on_call_response(&s, &mut log, Some(c_answer), 999, 40);
    // The session now served away from its home is told where it is (`pin_cookie`, on by
    // default): its signed cookie comes with the relayed answer.
    let Step::RelayCall {
        status,
        mut headers,
        body_size,
    } = step
    else {
        panic!("{step:?}")
    };
    let cookie = headers
        .iter()
        .position(|(k, _)| *k == "set-cookie")
        .map(|i| headers.remove(i));
    assert!(
        cookie
            .as_ref()
            .is_some_and(|(_, v)| v.starts_with(b"cf_pin_")),
        "{cookie:?}"
    );
    assert_eq!(
        Step::RelayCall {
            status,
            headers,
            body_size
        },
        Step::RelayCall {
            status: 200,
            headers: pairs(&[
                ("content-type", "text/event-stream"),
                (UPSTREAM_MARKER, "3"),
                (HEADER_ATTEMPTS, "3"),
                (HEADER_ENDPOINT, "c"),
                (HEADER_AFFINITY, "home"),
            ]),
            body_size: 999,
        }
    );
    assert_eq!(in_flight(&store, &c), vec![0, 0, 0]);
    assert!(!f.in_flight());
    assert_eq!(f.phase(), Phase::Done);
    assert_eq!(
        log.0
            .iter()
            .filter(|e| matches!(e, Event::FailedOver(_)))
            .collect::<Vec<_>>(),
        vec![&Event::FailedOver(0), &Event::FailedOver(1)]
    );
    // b is rate limited for its hint.
    let table = Table::read(&store, &c);
    assert_eq!(table.entries[1].1.breaker.open_until_ms, 20 + 7_000);
    f.on_log(&s, &mut log, 50);
    assert_eq!(
        log.0
            .iter()
            .filter(|e| matches!(e, Event::Finished(..)))
            .count(),
        3,
        "each attempt finished exactly once"
    );
}

#[test]
fn the_attempt_limit_passes_the_last_failure_through() {
    let c = cfg(json!({"max_attempts": 2}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let mut log = Log::default();
    let mut f = Flow::default();
    route(&mut f, &s, &mut log, post_headers(&[]), 0);
    let step = f.on_response_headers(&s, &mut log, &pairs(&[(":status", "502")]), false, 1);
    assert_eq!(step, Step::Dispatch(1));
    let b = pairs(&[(":status", "500"), (UPSTREAM_MARKER, "2"), ("x-which", "b")]);
    match f.on_call_response(&s, &mut log, Some(b), 17, 3) {
        Step::RelayCall {
            status, headers, ..
        } => {
            assert_eq!(status, 500);
            assert_eq!(headers.header("x-which").as_deref(), Some(&b"b"[..]));
            assert_eq!(headers.header(HEADER_ENDPOINT).as_deref(), Some(&b"b"[..]));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(f.attempts(), 2);
    // Routed failure with nothing left: the failing answer itself is relayed.
    let one = cfg(json!({"max_attempts": 1}));
    let s1 = Scheduler::new(&one, &store);
    let mut g = Flow::default();
    route(&mut g, &s1, &mut log, post_headers(&[]), 10);
    let step = g.on_response_headers(&s1, &mut log, &pairs(&[(":status", "503")]), false, 11);
    assert!(matches!(step, Step::Relay(_)), "{step:?}");
    assert!(!g.in_flight(), "a failure is finished at its headers");
}

#[test]
fn a_refused_dispatch_is_a_connect_failure_and_the_next_endpoint_is_tried() {
    let c = cfg(json!({"max_attempts": 3}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let mut log = Log::default();
    let mut f = Flow::default();
    route(&mut f, &s, &mut log, post_headers(&[]), 0);
    assert_eq!(
        f.on_response_headers(&s, &mut log, &pairs(&[(":status", "503")]), false, 1),
        Step::Dispatch(1)
    );
    assert_eq!(f.dispatch_failed(&s, &mut log, 2), Step::Dispatch(2));
    // Every call refused: the held answer of a is relayed, and it says so.
    match f.dispatch_failed(&s, &mut log, 3) {
        Step::Relay(expose) => {
            assert!(
                expose.contains(&(HEADER_ENDPOINT, "a".to_string())),
                "{expose:?}"
            );
            assert!(
                expose.contains(&(HEADER_ATTEMPTS, "3".to_string())),
                "{expose:?}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(in_flight(&store, &c), vec![0, 0, 0]);
    let outcomes: Vec<(usize, &str)> = log
        .0
        .iter()
        .filter_map(|e| match e {
            Event::Finished(i, o, _, _) => Some((*i, *o)),
            _ => None,
        })
        .collect();
    assert_eq!(
        outcomes,
        vec![
            (0, "endpoint_failure"),
            (1, "endpoint_failure"),
            (2, "endpoint_failure")
        ]
    );
}

#[test]
fn envoys_own_failures_resets_and_oversized_answers_get_openai_errors() {
    let c = cfg(json!({"max_attempts": 2}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let mut log = Log::default();
    let failed_over = |log: &mut Log| {
        let mut f = Flow::default();
        route(&mut f, &s, log, post_headers(&[]), 0);
        let step = f.on_response_headers(&s, log, &pairs(&[(":status", "503")]), false, 1);
        assert!(matches!(step, Step::Dispatch(_)), "{step:?}");
        f
    };
    // Envoy's own 503 for the call (no upstream marker).
    let mut f = failed_over(&mut log);
    match f.on_call_response(&s, &mut log, Some(pairs(&[(":status", "503")])), 90, 2) {
        Step::Reply(r) => {
            assert_eq!(
                (r.status, r.reason),
                (503, RejectReason::UpstreamUnavailable)
            );
            assert!(r.headers.contains(&(HEADER_ATTEMPTS, "2".to_string())));
        }
        other => panic!("{other:?}"),
    }
    // The call failed without headers (reset, timeout after headers).
    let mut f = failed_over(&mut log);
    match f.on_call_response(&s, &mut log, None, 0, 2) {
        Step::Reply(r) => assert_eq!(
            (r.status, r.reason),
            (502, RejectReason::UpstreamUnavailable)
        ),
        other => panic!("{other:?}"),
    }
    // A success larger than the relay limit: refused, but the endpoint did succeed.
    let mut f = failed_over(&mut log);
    let ok = pairs(&[(":status", "200"), (UPSTREAM_MARKER, "5")]);
    match f.on_call_response(
        &s,
        &mut log,
        Some(ok.clone()),
        MAX_RELAYED_ANSWER_BYTES + 1,
        2,
    ) {
        Step::Reply(r) => {
            assert_eq!(
                (r.status, r.reason),
                (502, RejectReason::FailoverAnswerTooLarge)
            );
            assert!(
                r.message.contains(&MAX_RELAYED_ANSWER_BYTES.to_string()),
                "{}",
                r.message
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(log.0.contains(&Event::Finished(
        1,
        "success",
        Timing {
            to_headers_ms: Some(1),
            total_ms: 1
        },
        false
    )));
    // At the limit: relayed.
    let mut f = failed_over(&mut log);
    let step = f.on_call_response(&s, &mut log, Some(ok), MAX_RELAYED_ANSWER_BYTES, 2);
    assert!(
        matches!(step, Step::RelayCall { status: 200, .. }),
        "{step:?}"
    );
    assert_eq!(in_flight(&store, &c), vec![0, 0, 0]);
}

#[test]
fn bad_requests_get_openai_errors_and_never_take_a_ticket() {
    let c = cfg(json!({"max_body_bytes": 4096}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let mut log = Log::default();
    let refused = |step: Step| match step {
        Step::Reply(r) => (r.status, r.reason.label(), r.body()),
        other => panic!("{other:?}"),
    };
    // A body that once killed the VM: serde_json quotes the "é"s and used to be cut inside one.
    let body = format!(
        r#"{{"model":"llama-3-8b","messages":"a{}"}}"#,
        "é".repeat(200)
    );
    let mut f = Flow::default();
    let (status, code, json) = refused(send(&mut f, &s, &mut log, &body));
    assert_eq!((status, code), (400, "invalid_json"));
    assert!(json.len() < 1024, "{json}");
    // No body at all; a declared size over the limit; a chunked body that grows past it.
    let mut f = Flow::default();
    assert_eq!(
        refused(f.on_request_headers(&s, &mut log, post_headers(&[]), true, 0)).1,
        "empty_body"
    );
    let mut f = Flow::default();
    let big = post_headers(&[("content-length", "4097")]);
    assert_eq!(
        refused(f.on_request_headers(&s, &mut log, big, false, 0)).0,
        413
    );
    let mut f = Flow::default();
    f.on_request_headers(&s, &mut log, post_headers(&[]), false, 0);
    assert_eq!(
        refused(f.on_request_body(&s, &mut log, 4097, false, &mut unreachable, 0)).1,
        "request_too_large"
    );
    // A long session header is no error (it is hashed: routed, on a store of its own); a
    // model nobody serves (a long multi-byte name) is.
    let own_store = MemStore::new();
    let routed = Scheduler::new(&c, &own_store);
    let mut f = Flow::default();
    let long = "é".repeat(3000);
    let mut quiet = Log::default();
    f.on_request_headers(
        &routed,
        &mut quiet,
        post_headers(&[("x-session-id", &long)]),
        false,
        0,
    );
    let step = f.on_request_body(
        &routed,
        &mut quiet,
        BODY.len(),
        true,
        &mut || BODY.to_vec(),
        0,
    );
    assert!(matches!(step, Step::Route(_)), "{step:?}");
    let only_x = cfg(json!({"endpoints": [{"name": "x", "cluster": "cx", "models": ["x"]}]}));
    let sx = Scheduler::new(&only_x, &store);
    let model = "é".repeat(128);
    let body = format!(r#"{{"model":"{model}"}}"#);
    let mut f = Flow::default();
    let (status, code, json) = refused(send(&mut f, &sx, &mut log, &body));
    assert_eq!((status, code), (404, "model_not_found"));
    assert!(serde_json::from_str::<serde_json::Value>(&json).is_ok());
    // No picks, no tickets, nothing in flight.
    assert!(
        !log.0.iter().any(|e| matches!(e, Event::Picked(..))),
        "{:?}",
        log.0
    );
    assert_eq!(in_flight(&store, &c), vec![0, 0, 0]);
}

#[test]
fn trailers_complete_a_body_whose_end_the_body_callback_never_saw() {
    let c = cfg(json!({"max_attempts": 2}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let mut log = Log::default();
    let mut f = Flow::default();
    f.on_request_headers(&s, &mut log, post_headers(&[]), false, 0);
    assert_eq!(
        f.on_request_body(&s, &mut log, BODY.len(), false, &mut unreachable, 0),
        Step::Pause
    );
    let trailers = pairs(&[("x-checksum", "abc")]);
    let step = f.on_request_trailers(&s, &mut log, trailers.clone(), &mut || BODY.to_vec(), 1);
    assert_eq!(step, Step::Route(0));
    // ...and go along on a failover call.
    f.on_response_headers(&s, &mut log, &pairs(&[(":status", "503")]), false, 2);
    assert_eq!(f.call(&c, 1).unwrap().trailers, trailers.as_slice());
    // Trailers after an empty body: refused as empty, not routed without a model.
    let mut g = Flow::default();
    g.on_request_headers(&s, &mut log, post_headers(&[]), false, 0);
    let step = g.on_request_trailers(&s, &mut log, trailers, &mut Vec::<u8>::new, 1);
    assert!(matches!(step, Step::Reply(r) if r.reason == RejectReason::EmptyBody));
}

#[test]
fn a_reload_under_an_attempt_is_not_a_lost_update() {
    // The attempt started under a configuration with a; the table now belongs to one without.
    let before = cfg(json!({}));
    let after = Config::from_value(&json!({"endpoints": [
        {"name": "b", "cluster": "cb"}, {"name": "c", "cluster": "cc"}]}))
    .unwrap();
    let store = MemStore::new();
    let mut log = Log::default();
    let mut f = Flow::default();
    route(
        &mut f,
        &Scheduler::new(&before, &store),
        &mut log,
        post_headers(&[]),
        0,
    );
    let s_after = Scheduler::new(&after, &store);
    let _ = s_after.pick(
        &Pick {
            model: None,
            session: None,
            attempt: 1,
            exclusions: &Exclusions::default(),
            nonce: 0,
            body_bytes: 0,
            pin_hint: None,
            holder: None,
            prefix: Prefix::NONE,
            follow_up: false,
            max_output_tokens: 0,
        },
        1,
    );
    f.on_response_headers(&s_after, &mut log, &pairs(&[(":status", "200")]), true, 5);
    assert!(
        log.0
            .iter()
            .any(|e| matches!(e, Event::Finished(0, "success", _, false))),
        "counted as a lost update: {:?}",
        log.0
    );
    // A reload that only moved the endpoint records the attempt where it now is.
    let moved = Config::from_value(&json!({"endpoints": [
        {"name": "c", "cluster": "cc"}, {"name": "a", "cluster": "ca"}]}))
    .unwrap();
    let store = MemStore::new();
    let mut g = Flow::default();
    route(
        &mut g,
        &Scheduler::new(&before, &store),
        &mut log,
        post_headers(&[]),
        0,
    );
    let s_moved = Scheduler::new(&moved, &store);
    g.on_response_headers(&s_moved, &mut log, &pairs(&[(":status", "200")]), true, 5);
    let t = Table::read(&store, &moved);
    assert_eq!((t.entries[1].1.in_flight, t.entries[1].1.total), (0, 1));
}

const SSE_USAGE: &[u8] = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":4,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n";

#[test]
fn usage_is_counted_when_a_relayed_answer_ends_and_never_for_a_cut_one() {
    let c = cfg(json!({}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let usage = Usage {
        prompt_tokens: 40,
        cached_tokens: 32,
        completion_tokens: 4,
    };
    let sse = pairs(&[(":status", "200"), ("content-type", "text/event-stream")]);
    // Turn 1 is placed at home, turn 2 is an affinity hit; both streams end.
    for (now, affinity) in [(0, "home"), (100, "hit")] {
        let mut log = Log::default();
        let mut f = Flow::default();
        let step = route(
            &mut f,
            &s,
            &mut log,
            post_headers(&[("x-session-id", "u1")]),
            now,
        );
        assert_eq!(step, Step::Route(0));
        f.on_response_headers(&s, &mut log, &sse, false, now + 5);
        assert!(f.scans_answer());
        f.on_response_data(&SSE_USAGE[..30]);
        f.on_response_data(&SSE_USAGE[30..]);
        assert!(log.usages().is_empty(), "not before the end");
        f.on_response_data(b"data: [DONE]\n\n");
        f.on_response_end(&s, &mut log, now + 9);
        assert_eq!(log.usages(), vec![&Event::Usage(0, affinity, usage)]);
        f.on_log(&s, &mut log, now + 10);
        assert_eq!(log.usages().len(), 1, "counted once");
    }
    // A stream cut before its end: on_log only, nothing counted.
    let mut log = Log::default();
    let mut f = Flow::default();
    route(
        &mut f,
        &s,
        &mut log,
        post_headers(&[("x-session-id", "u1")]),
        200,
    );
    f.on_response_headers(&s, &mut log, &sse, false, 205);
    f.on_response_data(SSE_USAGE);
    f.on_log(&s, &mut log, 210);
    assert!(log.usages().is_empty());
    // An error answer is not scanned.
    let mut f = Flow::default();
    route(&mut f, &s, &mut log, post_headers(&[]), 300);
    f.on_response_headers(&s, &mut log, &pairs(&[(":status", "400")]), false, 305);
    assert!(!f.scans_answer());
}

#[test]
fn usage_of_a_relayed_failover_answer_counts_for_the_endpoint_that_gave_it() {
    let c = cfg(json!({}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let mut log = Log::default();
    let mut f = Flow::default();
    route(&mut f, &s, &mut log, post_headers(&[]), 0);
    let step = f.on_response_headers(&s, &mut log, &pairs(&[(":status", "503")]), false, 5);
    assert_eq!(step, Step::Dispatch(1));
    let answer = pairs(&[
        (":status", "200"),
        ("content-type", "application/json"),
        (UPSTREAM_MARKER, "3"),
    ]);
    let body = br#"{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2}}"#;
    let step = f.on_call_response(&s, &mut log, Some(answer), body.len(), 20);
    assert!(matches!(step, Step::RelayCall { status: 200, .. }));
    f.on_call_body(&mut log, body);
    let usage = Usage {
        prompt_tokens: 7,
        cached_tokens: 0,
        completion_tokens: 2,
    };
    assert_eq!(log.usages(), vec![&Event::Usage(1, "home", usage)]);
}

#[test]
fn usage_accounting_off_reads_nothing() {
    let c = cfg(json!({"usage_accounting": false}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let mut log = Log::default();
    let mut f = Flow::default();
    route(&mut f, &s, &mut log, post_headers(&[]), 0);
    f.on_response_headers(&s, &mut log, &pairs(&[(":status", "200")]), false, 5);
    assert!(!f.scans_answer());
    f.on_response_data(br#"{"usage":{"prompt_tokens":7}}"#);
    f.on_response_end(&s, &mut log, 9);
    assert!(log.usages().is_empty());
}

fn quota_of(store: &MemStore, cfg: &Config, i: usize) -> crate::scheduler::routing::quota::Quota {
    Table::read(&store, cfg).entries[i].1.quota
}

#[test]
fn a_success_answers_quota_is_remembered_in_the_finish_write_and_moves_the_next_session() {
    let c = cfg(json!({}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let mut log = Log::default();
    let mut f = Flow::default();
    assert_eq!(
        route(
            &mut f,
            &s,
            &mut log,
            post_headers(&[("x-session-id", "q1")]),
            0
        ),
        Step::Route(0)
    );
    let answer = pairs(&[
        (":status", "200"),
        ("x-ratelimit-remaining-requests", "0"),
        ("x-ratelimit-reset-requests", "20s"),
    ]);
    f.on_response_headers(&s, &mut log, &answer, false, 10);
    let writes = store.writes.get();
    f.on_response_end(&s, &mut log, 20);
    // One table write (the finish: its group and the header), one affinity write: the quota
    // costs none of its own.
    assert_eq!(store.writes.get(), writes + 3);
    assert_eq!(quota_of(&store, &c, 0).requests_left(20), Some(0));
    // The next session whose home is `a` goes to `b`, without a 429 from `a`.
    let mut g = Flow::default();
    assert_eq!(
        route(
            &mut g,
            &s,
            &mut log,
            post_headers(&[("x-session-id", "q2")]),
            30
        ),
        Step::Route(1)
    );
    // Twenty seconds on (the reset), `a` is the home again.
    let mut h = Flow::default();
    assert_eq!(
        route(
            &mut h,
            &s,
            &mut log,
            post_headers(&[("x-session-id", "q3")]),
            20_011
        ),
        Step::Route(0)
    );
}

/// A plain answer's headers come after its whole generation, but the upstream
/// stated its reset when it admitted the request: "1s" on an answer relayed 3 s after it was
/// sent has passed. Counted from the headers, the key stayed spent two seconds past its reset.
#[test]
fn a_quota_reset_counts_from_when_the_request_was_sent() {
    let c = cfg(json!({}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let mut log = Log::default();
    let mut f = Flow::default();
    let headers = post_headers(&[("x-session-id", "q1")]);
    assert_eq!(route(&mut f, &s, &mut log, headers, 0), Step::Route(0));
    let answer = pairs(&[
        (":status", "200"),
        ("x-ratelimit-remaining-requests", "0"),
        ("x-ratelimit-reset-requests", "1s"),
    ]);
    f.on_response_headers(&s, &mut log, &answer, false, 3_000);
    f.on_response_end(&s, &mut log, 3_010);
    assert_eq!(quota_of(&store, &c, 0).requests_left(3_010), None);
    // The next session whose home is `a` goes there.
    let mut g = Flow::default();
    let headers = post_headers(&[("x-session-id", "q2")]);
    assert_eq!(route(&mut g, &s, &mut log, headers, 3_020), Step::Route(0));
}

/// The quota bench, three replicas: a 429 whose headers state fewer tokens left than
/// the request needs is the request against what the key has left. It fails over, the key's
/// count takes the stated value, and the breaker stays closed: the next request that fits
/// still goes there (before, the key was cooled until its reset, then probed by three).
#[test]
fn a_429_whose_quota_headers_explain_it_fails_over_and_leaves_the_key_open() {
    let c = cfg(json!({"max_attempts": 3}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let mut log = Log::default();
    let mut f = Flow::default();
    assert_eq!(
        route(&mut f, &s, &mut log, post_headers(&[]), 0),
        Step::Route(0)
    );
    // `BODY` is estimated at 15 tokens; 10 are left until the reset in 2 s.
    let refused = pairs(&[
        (":status", "429"),
        (UPSTREAM_MARKER, "1"),
        ("retry-after", "2"),
        ("x-ratelimit-limit-tokens", "1000"),
        ("x-ratelimit-remaining-tokens", "10"),
        ("x-ratelimit-reset-tokens", "2s"),
    ]);
    assert_eq!(
        f.on_response_headers(&s, &mut log, &refused, false, 5),
        Step::Dispatch(1)
    );
    let table = Table::read(&store, &c);
    assert_eq!(table.entries[0].1.quota.tokens_left(10), Some(10));
    assert_eq!(
        table.entries[0].1.breaker.state,
        crate::scheduler::health::breaker::BreakerState::Closed
    );
    // Without an explaining statement (10 000 left), the breaker opens as before.
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let mut g = Flow::default();
    assert_eq!(
        route(&mut g, &s, &mut log, post_headers(&[]), 20),
        Step::Route(0)
    );
    let unexplained = pairs(&[
        (":status", "429"),
        (UPSTREAM_MARKER, "1"),
        ("retry-after", "2"),
        ("x-ratelimit-remaining-tokens", "10000"),
        ("x-ratelimit-reset-tokens", "2s"),
    ]);
    g.on_response_headers(&s, &mut log, &unexplained, false, 25);
    let table = Table::read(&store, &c);
    assert_eq!(
        table.entries[0].1.breaker.state,
        crate::scheduler::health::breaker::BreakerState::Open
    );
}

#[test]
fn quota_headers_are_not_read_off_failures_nor_with_the_feature_off() {
    for (extra, status) in [(json!({}), "500"), (json!({"quota_aware": false}), "200")] {
        let c = cfg(extra);
        let store = MemStore::new();
        let s = Scheduler::new(&c, &store);
        let mut log = Log::default();
        let mut f = Flow::default();
        route(&mut f, &s, &mut log, post_headers(&[]), 0);
        let answer = pairs(&[(":status", status), ("x-ratelimit-remaining-requests", "0")]);
        f.on_response_headers(&s, &mut log, &answer, true, 10);
        f.on_log(&s, &mut log, 20);
        assert_eq!(quota_of(&store, &c, 0), Default::default(), "{status}");
    }
}

#[test]
fn only_an_affinity_hits_own_answer_feeds_the_payoff() {
    let c = cfg(json!({"tuning": {"payoff_min_prompt_tokens": 1}}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let payoff = |i: usize| Table::read(&store, &c).entries[i].1.payoff;
    let json_ok = pairs(&[(":status", "200"), ("content-type", "application/json")]);
    let body = br#"{"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":32}}}"#;
    // Turn 1 at home (not a sample), turn 2 an affinity hit (a sample: 32 of 40 cached).
    for (now, samples) in [(0, 0), (100, 1)] {
        let mut log = Log::default();
        let mut f = Flow::default();
        let step = route(
            &mut f,
            &s,
            &mut log,
            post_headers(&[("x-session-id", "p")]),
            now,
        );
        assert_eq!(step, Step::Route(0));
        f.on_response_headers(&s, &mut log, &json_ok, false, now + 5);
        f.on_response_data(body);
        f.on_response_end(&s, &mut log, now + 9);
        f.on_log(&s, &mut log, now + 10);
        assert_eq!(payoff(0).samples, samples, "after the turn at {now}");
    }
    assert_eq!(payoff(0).permille(), 800);
    // A hit whose pinned endpoint fails: the failover answer teaches neither endpoint.
    let mut log = Log::default();
    let mut f = Flow::default();
    route(
        &mut f,
        &s,
        &mut log,
        post_headers(&[("x-session-id", "p")]),
        200,
    );
    let step = f.on_response_headers(&s, &mut log, &pairs(&[(":status", "503")]), false, 205);
    assert_eq!(step, Step::Dispatch(1));
    let answer = pairs(&[
        (":status", "200"),
        ("content-type", "application/json"),
        (UPSTREAM_MARKER, "3"),
    ]);
    f.on_call_response(&s, &mut log, Some(answer), body.len(), 220);
    f.on_call_body(&mut log, body);
    f.on_log(&s, &mut log, 230);
    assert_eq!(log.usages().len(), 1, "counted as usage");
    assert_eq!((payoff(0).samples, payoff(1).samples), (1, 0));
}

/// Did the pin pay: each affinity hit's answer is judged against the prompt its session's
/// previous answer on that endpoint reported; cold when less than half of it was cached.
#[test]
fn a_pinned_turn_is_judged_against_its_sessions_previous_prompt() {
    let c = cfg(json!({"tuning": {"payoff_min_prompt_tokens": 100}}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let json_ok = pairs(&[(":status", "200"), ("content-type", "application/json")]);
    let answer = |prompt: u64, cached: u64| {
        format!(
            r#"{{"choices":[],"usage":{{"prompt_tokens":{prompt},"completion_tokens":4,"prompt_tokens_details":{{"cached_tokens":{cached}}}}}}}"#
        )
    };
    let turn = |session: &str, prompt: u64, cached: u64, usage: bool, now: u64| {
        let mut log = Log::default();
        let mut f = Flow::default();
        let step = route(
            &mut f,
            &s,
            &mut log,
            post_headers(&[("x-session-id", session)]),
            now,
        );
        assert_eq!(step, Step::Route(0));
        f.on_response_headers(&s, &mut log, &json_ok, false, now + 5);
        if usage {
            f.on_response_data(answer(prompt, cached).as_bytes());
        } else {
            f.on_response_data(br#"{"choices":[]}"#);
        }
        f.on_response_end(&s, &mut log, now + 9);
        f.on_log(&s, &mut log, now + 10);
        log.0
            .into_iter()
            .filter_map(|e| match e {
                Event::PinnedTurn(i, cold) => Some((i, cold)),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    // The first turn has nothing to be judged against; the second found its 1 000 cached.
    assert_eq!(turn("p", 1_000, 0, true, 0), vec![]);
    assert_eq!(turn("p", 1_200, 992, true, 100), vec![(0, false)]);
    // The third found 400 of the previous 1 200: cold (so is a miss of the whole prompt).
    assert_eq!(turn("p", 1_400, 400, true, 200), vec![(0, true)]);
    assert_eq!(turn("p", 1_600, 0, true, 300), vec![(0, true)]);
    // An answer without usage teaches nothing, and leaves the next turn unjudged.
    assert_eq!(turn("p", 0, 0, false, 400), vec![]);
    assert_eq!(turn("p", 1_800, 0, true, 500), vec![]);
    assert_eq!(turn("p", 2_000, 1_800, true, 600), vec![(0, false)]);
    // A previous prompt below `payoff_min_prompt_tokens` is not judged.
    assert_eq!(turn("q", 90, 0, true, 700), vec![]);
    assert_eq!(turn("q", 120, 0, true, 800), vec![]);
}

// What a request brings on itself is not held against the endpoint, a body the
// filter never read is never replayed, and only a canonical path is classified.

const TPM_429: &[u8] = br#"{"error":{"message":"Request too large for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Requested 52000.","type":"tokens","code":"rate_limit_exceeded"}}"#;

#[test]
fn a_429_too_large_for_any_key_is_relayed_and_not_held_against_the_endpoint() {
    let c = cfg(json!({"max_attempts": 3}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let mut log = Log::default();
    let mut f = Flow::default();
    assert_eq!(
        route(&mut f, &s, &mut log, post_headers(&[]), 0),
        Step::Route(0)
    );
    // No reset hint: held until the body says whose fault it is.
    let h = pairs(&[(":status", "429"), (UPSTREAM_MARKER, "1")]);
    assert_eq!(
        f.on_response_headers(&s, &mut log, &h, false, 5),
        Step::Pause
    );
    assert!(f.judges_answer() && !f.holds_answer());
    assert!(matches!(
        f.on_judged_body(&s, &mut log, TPM_429, 6),
        Step::Relay(_)
    ));
    f.on_response_end(&s, &mut log, 7);
    assert!(log
        .0
        .iter()
        .any(|e| matches!(e, Event::Finished(0, "client_error", _, _))));
    assert!(!log.0.iter().any(|e| matches!(e, Event::FailedOver(_))));
    // a is not cooled: the next request goes there again.
    let mut g = Flow::default();
    assert_eq!(
        route(&mut g, &s, &mut log, post_headers(&[]), 10),
        Step::Route(0)
    );
}

#[test]
fn a_429_without_hints_that_is_a_rate_limit_still_fails_over() {
    let c = cfg(json!({"max_attempts": 3}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let mut log = Log::default();
    let mut f = Flow::default();
    route(&mut f, &s, &mut log, post_headers(&[]), 0);
    let h = pairs(&[(":status", "429"), (UPSTREAM_MARKER, "1")]);
    assert_eq!(
        f.on_response_headers(&s, &mut log, &h, false, 5),
        Step::Pause
    );
    let quota = br#"{"error":{"message":"Rate limit reached: Limit 30000, Used 29000, Requested 2000.","code":"rate_limit_exceeded"}}"#;
    assert_eq!(f.on_judged_body(&s, &mut log, quota, 6), Step::Dispatch(1));
    assert!(f.holds_answer());
    // A failover call's 429 is judged on its body's head too: relayed, b not cooled.
    let b = pairs(&[(":status", "429"), (UPSTREAM_MARKER, "1")]);
    match f.on_call_answer(&s, &mut log, Some(b), TPM_429.len(), TPM_429, 9) {
        Step::RelayCall { status: 429, .. } => {}
        other => panic!("{other:?}"),
    }
    assert!(log
        .0
        .iter()
        .any(|e| matches!(e, Event::Finished(1, "client_error", _, _))));
    // With a reset hint the header decides, as before (no body read).
    let mut g = Flow::default();
    route(&mut g, &s, &mut log, post_headers(&[]), 20);
    let hinted = pairs(&[(":status", "429"), ("retry-after", "1")]);
    assert!(matches!(
        g.on_response_headers(&s, &mut log, &hinted, false, 21),
        Step::Dispatch(_)
    ));
}

#[test]
fn a_401_is_the_clients_own_key_when_the_endpoint_injects_none() {
    let c = cfg(json!({"max_attempts": 3}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let mut log = Log::default();
    let mut f = Flow::default();
    route(&mut f, &s, &mut log, post_headers(&[]), 0);
    // a injects its own key: its 401 is a dead key, failed over to b.
    let h = pairs(&[(":status", "401"), (UPSTREAM_MARKER, "1")]);
    assert_eq!(
        f.on_response_headers(&s, &mut log, &h, false, 5),
        Step::Dispatch(1)
    );
    // b injects none: the client's own key was refused; relayed, not failed over.
    let b = pairs(&[(":status", "401"), (UPSTREAM_MARKER, "1")]);
    match f.on_call_response(&s, &mut log, Some(b), 10, 9) {
        Step::RelayCall { status: 401, .. } => {}
        other => panic!("{other:?}"),
    }
    let labels: Vec<_> = log
        .0
        .iter()
        .filter_map(|e| match e {
            Event::Finished(i, l, _, _) => Some((*i, *l)),
            _ => None,
        })
        .collect();
    assert_eq!(labels, vec![(0, "dead_key"), (1, "client_error")]);
}

#[test]
fn a_pass_through_request_with_an_unread_body_is_never_replayed() {
    let c = cfg(json!({"max_attempts": 3}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let mut log = Log::default();
    let upload = pairs(&[
        (":method", "POST"),
        (":path", "/v1/files"),
        (":authority", "llm"),
    ]);
    let mut f = Flow::default();
    assert_eq!(
        f.on_request_headers(&s, &mut log, upload, false, 0),
        Step::Route(0)
    );
    let h = pairs(&[(":status", "503"), (UPSTREAM_MARKER, "1")]);
    assert!(matches!(
        f.on_response_headers(&s, &mut log, &h, false, 5),
        Step::Relay(_)
    ));
    assert!(!log.0.iter().any(|e| matches!(e, Event::FailedOver(_))));
    // Without a body there is nothing to lose: failed over as before.
    let get = pairs(&[
        (":method", "GET"),
        (":path", "/v1/files"),
        (":authority", "llm"),
    ]);
    let mut g = Flow::default();
    assert!(matches!(
        g.on_request_headers(&s, &mut log, get, true, 10),
        Step::Route(_)
    ));
    assert!(matches!(
        g.on_response_headers(&s, &mut log, &h, false, 11),
        Step::Dispatch(_)
    ));
}

#[test]
fn ambiguous_paths_are_refused_before_any_pick() {
    let c = cfg(json!({}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    for path in [
        "/v1/%63hat/completions",
        "//v1/chat/completions",
        "/v1/files/../chat/completions",
        "/v1%2Fchat%2Fcompletions",
    ] {
        let mut log = Log::default();
        let mut f = Flow::default();
        let h = pairs(&[(":method", "POST"), (":path", path), (":authority", "llm")]);
        match f.on_request_headers(&s, &mut log, h, false, 0) {
            Step::Reply(r) => {
                assert_eq!(
                    (r.status, r.reason.label()),
                    (400, "invalid_path"),
                    "{path}"
                )
            }
            other => panic!("{path}: {other:?}"),
        }
        assert_eq!(log.0, vec![Event::Replied("invalid_path")], "{path}");
    }
}

/// A finished answer becomes a sample that compares like with like. A stream is
/// timed to its first byte (against its uncached prompt), a plain answer to its end (against
/// prompt and completion); with `usage` the sample teaches the work model, without it the
/// tokens are estimated from the body and the relayed bytes and it only judges.
#[test]
fn finished_answers_are_judged_against_their_work() {
    use crate::scheduler::routing::judge::slowness::{Sample, WorkModel};
    use crate::scheduler::routing::select::signals::{read_model, work_key};
    let c = cfg(json!({}));
    let store = MemStore::new();
    let key = work_key(&c, Some("m"));
    // A warm model at the prior's costs: 50 ms + 0.2 ms per uncached token.
    let mut m = WorkModel::default();
    for i in 0..64u64 {
        let prompt = 10 + i;
        m.observe(&Sample {
            streamed: true,
            observed_ms: 50.0 + 0.2 * prompt as f64,
            prompt_tokens: prompt,
            cached_tokens: 0,
            completion_tokens: 0,
            estimated: false,
            decode_ms: None,
        });
    }
    store.set(&key, &m.encode(), None).unwrap();
    let s = Scheduler::new(&c, &store);
    let sse = pairs(&[(":status", "200"), ("content-type", "text/event-stream")]);
    let mut log = Log::default();
    let mut f = Flow::default();
    route(&mut f, &s, &mut log, post_headers(&[]), 1_000);
    f.on_response_headers(&s, &mut log, &sse, false, 1_002);
    f.count_answer_bytes(10);
    f.on_first_byte(1_057);
    f.on_response_data(SSE_USAGE);
    f.on_response_data(b"data: [DONE]\n\n");
    f.count_answer_bytes(SSE_USAGE.len());
    // The stream goes on for 10 s: its sample is its first byte, 57 ms.
    f.on_response_end(&s, &mut log, 11_000);
    let table = Table::read(&store, &c);
    let sl = table.entries[0].1.slowness;
    assert_eq!(sl.samples, 1);
    // 40 prompt tokens, 32 cached: 8 uncached, expected 50 + 1.6 ms (as fitted).
    let expected = m.expected_ms(&Sample {
        streamed: true,
        observed_ms: 0.0,
        prompt_tokens: 40,
        cached_tokens: 32,
        completion_tokens: 4,
        estimated: false,
        decode_ms: None,
    });
    assert!(
        (sl.value().unwrap() - 57.0 / expected).abs() < 1e-9,
        "{sl:?} {expected}"
    );
    assert_eq!(
        read_model(&store, &key).samples,
        65,
        "usage teaches the model"
    );

    // A plain answer without usage: timed to its end, estimated, teaches nothing.
    let c2 = cfg(json!({"usage_accounting": false}));
    let s2 = Scheduler::new(&c2, &store);
    let mut f = Flow::default();
    route(&mut f, &s2, &mut log, post_headers(&[]), 20_000);
    f.on_response_headers(&s2, &mut log, &pairs(&[(":status", "200")]), false, 20_040);
    f.count_answer_bytes(400);
    f.on_response_end(&s2, &mut log, 21_000);
    let sl = Table::read(&store, &c).entries[0].1.slowness;
    assert_eq!((sl.samples, sl.last_sample_ms), (2, 21_000));
    assert_eq!(read_model(&store, &key).samples, 65);
}

/// A Responses follow-up whose holder is cooling down. A plain one gets the retryable
/// 503 without a pick; one that replays its whole input is routed elsewhere, and the body the
/// first attempt forwards is the one without `previous_response_id` (before, only failover
/// copies had it removed: the first attempt forwarded Envoy's buffered body unchanged).
#[test]
fn a_whole_input_follow_up_forwards_the_body_decided_on_from_its_first_attempt() {
    let c = cfg(json!({}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let mut log = Log::default();
    let a = c.endpoints[0].id;
    assert!(responses::remember(&s, None, "resp_1", a, 0));
    // a is rate limited for 30 s.
    let ex = Exclusions::default();
    let pick = Pick {
        model: Some("m"),
        session: None,
        attempt: 1,
        exclusions: &ex,
        nonce: 0,
        body_bytes: 0,
        pin_hint: None,
        holder: Some(a),
        prefix: Prefix::NONE,
        follow_up: false,
        max_output_tokens: 0,
    };
    let d = s.pick(&pick, 0).unwrap();
    let limited = Outcome::RateLimited {
        retry_after_ms: Some(30_000),
    };
    s.finish(d.ticket, &limited, 1, None, 0);
    let headers = || {
        pairs(&[
            (":method", "POST"),
            (":path", "/v1/responses"),
            (":authority", "llm"),
            ("content-type", "application/json"),
            ("content-length", "1"),
        ])
    };
    let plain = br#"{"model":"m","previous_response_id":"resp_1","input":"next"}"#;
    let mut f = Flow::default();
    f.on_request_headers(&s, &mut log, headers(), false, 10);
    match f.on_request_body(&s, &mut log, plain.len(), true, &mut || plain.to_vec(), 10) {
        Step::Reply(r) => {
            assert_eq!(
                (r.status, r.reason.label()),
                (503, "previous_response_unavailable")
            );
            assert!(r.headers.iter().any(|(n, _)| *n == "retry-after"), "{r:?}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(f.rewritten_body(), None);
    let whole = br#"{"model":"m","previous_response_id":"resp_1","input":[{"role":"user","content":"hi"},{"role":"assistant","content":"yo"},{"role":"user","content":"next"}]}"#;
    let mut f = Flow::default();
    f.on_request_headers(&s, &mut log, headers(), false, 10);
    let step = f.on_request_body(&s, &mut log, whole.len(), true, &mut || whole.to_vec(), 10);
    assert!(matches!(step, Step::Route(i) if i != 0), "{step:?}");
    let (body, declared) = f.rewritten_body().unwrap();
    assert!(declared);
    let sent: serde_json::Value = serde_json::from_slice(body).unwrap();
    assert!(sent.get("previous_response_id").is_none(), "{sent}");
    assert_eq!(sent["input"].as_array().map(Vec::len), Some(3));
    // A request that was not rewritten forwards Envoy's body.
    let mut g = Flow::default();
    route(&mut g, &s, &mut log, post_headers(&[]), 20);
    assert_eq!(g.rewritten_body(), None);
}

/// A failover call's streamed answer arrives whole, after its generation:
/// its duration is no latency sample (nor a slowness sample); a plain answer's is (its headers
/// come with its body). Before: a 20 s stream was a 20 s sample of the backup.
#[test]
fn a_streamed_failover_answer_is_no_latency_sample() {
    let c = cfg(json!({}));
    for (content_type, sample) in [("text/event-stream", None), ("application/json", Some(300))] {
        let store = MemStore::new();
        let s = Scheduler::new(&c, &store);
        let mut log = Log::default();
        let mut f = Flow::default();
        assert_eq!(
            route(&mut f, &s, &mut log, post_headers(&[]), 0),
            Step::Route(0)
        );
        let failed = pairs(&[(":status", "503"), (UPSTREAM_MARKER, "1")]);
        assert_eq!(
            f.on_response_headers(&s, &mut log, &failed, false, 10),
            Step::Dispatch(1)
        );
        let ok = pairs(&[
            (":status", "200"),
            ("content-type", content_type),
            (UPSTREAM_MARKER, "1"),
        ]);
        let step = f.on_call_response(&s, &mut log, Some(ok), 100, 310);
        assert!(
            matches!(step, Step::RelayCall { status: 200, .. }),
            "{step:?}"
        );
        let t = Timing {
            to_headers_ms: sample,
            total_ms: 300,
        };
        assert!(
            log.0.contains(&Event::Finished(1, "success", t, false)),
            "{content_type}: {:?}",
            log.0
        );
        let table = Table::read(&store, &c);
        assert_eq!(
            table.entries[1].1.latency_ms,
            sample.map(|ms| ms as f64),
            "{content_type}"
        );
    }
}

/// Envoy refuses a failover call whose request lacks `:authority` (or
/// `:path`, `:method`), whichever the cluster: the request's own fault. It is not charged to
/// the endpoint as a connect failure, and no further call is tried (each would be refused
/// alike): the held answer is relayed. An unknown cluster (headers complete) still is one.
#[test]
fn a_call_refused_for_the_requests_own_headers_is_not_charged_to_the_endpoint() {
    let c = cfg(json!({"max_attempts": 3}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let mut log = Log::default();
    let mut f = Flow::default();
    let no_authority: Pairs = post_headers(&[])
        .into_iter()
        .filter(|(n, _)| n != ":authority")
        .collect();
    route(&mut f, &s, &mut log, no_authority, 0);
    assert_eq!(
        f.on_response_headers(&s, &mut log, &pairs(&[(":status", "503")]), false, 1),
        Step::Dispatch(1)
    );
    assert!(matches!(f.dispatch_failed(&s, &mut log, 2), Step::Relay(_)));
    let outcomes: Vec<(usize, &str)> = log
        .0
        .iter()
        .filter_map(|e| match e {
            Event::Finished(i, o, _, _) => Some((*i, *o)),
            _ => None,
        })
        .collect();
    assert_eq!(outcomes, vec![(0, "endpoint_failure"), (1, "client_error")]);
    assert_eq!(in_flight(&store, &c), vec![0, 0, 0]);
    let table = Table::read(&store, &c);
    assert_eq!(table.entries[1].1.success_rate, 1.0, "b is not charged");
    assert_eq!(table.entries[1].1.breaker.consecutive_failures, 0);
}

/// A running stream's pace: once its relayed bytes stand for enough tokens, a
/// decode phase 5× slower than the group's is folded into the endpoint's slowness while the
/// stream runs, and its end is not judged again; a healthy pace is left to the stream's end.
#[test]
fn a_slow_running_stream_is_judged_by_its_pace() {
    use crate::scheduler::routing::judge::slowness::{Sample, WorkModel, PACE_FIRST_CHECK_BYTES};
    use crate::scheduler::routing::select::signals::{read_model, work_key};
    // Peers b and c warm at slowness 1 (the rule compares with their median).
    let c = cfg(json!({"cold_start_samples": 2}));
    let store = MemStore::new();
    let key = work_key(&c, Some("m"));
    // A warm model: 2 ms per decode token, 170 bytes per token.
    let mut m = WorkModel::default();
    for _ in 0..64u64 {
        let s = Sample {
            streamed: true,
            observed_ms: 60.0,
            prompt_tokens: 50,
            cached_tokens: 0,
            completion_tokens: 101,
            estimated: false,
            decode_ms: Some(200.0),
        };
        m.observe(&s);
        m.observe_decode_bytes(&s, 17_000);
    }
    store.set(&key, &m.encode(), None).unwrap();
    let mut table = Table::aligned(None, &c);
    for (_, st) in table.entries.iter_mut().skip(1) {
        st.slowness.samples = 40;
    }
    table.write_to(&store);
    let s = Scheduler::new(&c, &store);
    let sse = pairs(&[(":status", "200"), ("content-type", "text/event-stream")]);
    let mut log = Log::default();
    let slowness = |store: &MemStore| Table::read(&store, &c).entries[0].1.slowness;
    // Two streams at the group's pace: judged at their ends only.
    for k in 0..2u64 {
        let t0 = 1_000 + k * 10_000;
        let mut f = Flow::default();
        route(&mut f, &s, &mut log, post_headers(&[]), t0);
        f.on_response_headers(&s, &mut log, &sse, false, t0 + 2);
        f.count_answer_bytes(170);
        f.on_first_byte(t0 + 60);
        for i in 1..=100u64 {
            f.count_answer_bytes(170);
            if f.pace_due() {
                f.on_pace(&s, t0 + 60 + 2 * i);
            }
        }
        f.on_response_data(SSE_USAGE);
        f.on_response_data(b"data: [DONE]\n\n");
        f.on_response_end(&s, &mut log, t0 + 260);
    }
    let before = slowness(&store);
    assert_eq!(before.samples, 2);
    // A stream 5× slower: 10 ms per token. Its first checks (13 and 26 events, 2210 and 4420
    // bytes: 15.6 and 31.2 tokens with the margin) are too short; the third (52 events, 8840
    // bytes: 62.4 tokens, 520 ms observed against 125 ms: 4.2× ≥ 3 × the peers' median 1)
    // judges it.
    let t0 = 30_000;
    let mut f = Flow::default();
    route(&mut f, &s, &mut log, post_headers(&[]), t0);
    f.on_response_headers(&s, &mut log, &sse, false, t0 + 2);
    f.count_answer_bytes(170);
    f.on_first_byte(t0 + 60);
    let mut judged_at = None;
    for i in 1..=100u64 {
        f.count_answer_bytes(170);
        if f.pace_due() {
            f.on_pace(&s, t0 + 60 + 10 * i);
            if judged_at.is_none() && slowness(&store).samples == 3 {
                judged_at = Some(i);
            }
        }
    }
    assert_eq!(PACE_FIRST_CHECK_BYTES.div_ceil(170), 13);
    assert_eq!(judged_at, Some(52), "{:?}", slowness(&store));
    assert!(slowness(&store).value().unwrap() > before.value().unwrap() * 1.3);
    let folded = slowness(&store);
    f.on_response_data(SSE_USAGE);
    f.on_response_data(b"data: [DONE]\n\n");
    f.on_response_end(&s, &mut log, t0 + 1_060);
    // Its end is not judged again (its first byte teaches the model, as any stream's, and
    // counts toward warm-up without being folded).
    let after = slowness(&store);
    assert_eq!((after.log_mean, after.samples), (folded.log_mean, 4));
    assert_eq!(read_model(&store, &key).samples, 67);
}

/// A failover call to a data-parallel rank carries that rank's
/// `x-data-parallel-rank`, once; a client's own value reaches no endpoint, ranked or not.
#[test]
fn failover_calls_carry_the_targets_rank_never_the_clients() {
    let c = Config::from_value(&json!({"endpoints": [
        {"name": "g", "cluster": "cg", "data_parallel_size": 2},
        {"name": "p", "cluster": "cp"}
    ]}))
    .unwrap();
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let mut log = Log::default();
    let mut f = Flow::default();
    let client = post_headers(&[("x-data-parallel-rank", "7"), ("x-session-id", "s")]);
    assert!(matches!(
        route(&mut f, &s, &mut log, client, 0),
        Step::Route(_)
    ));
    for (i, want) in [(0, Some("0")), (1, Some("1")), (2, None)] {
        let call = f.call(&c, i).unwrap();
        let ranks: Vec<&[u8]> = call
            .headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case("x-data-parallel-rank"))
            .map(|(_, v)| v.as_slice())
            .collect();
        assert_eq!(
            ranks,
            want.map(str::as_bytes).into_iter().collect::<Vec<_>>(),
            "{i}"
        );
    }
}

/// `pin_cookie` (on by default): every successful answer tells the client where its session
/// is — at its home too, from a static endpoint as from a pool's host (a home can change under
/// a session as replicas learn engines' slots, saturation and a pool's hosts) — unless the
/// request carried that cookie with at least half its lifetime left, or brought no cookie to
/// this replica's own pin at home (a client that keeps none); with `"pin_cookie": false`, none.
#[test]
fn every_answer_carries_the_pin_cookie_unless_the_request_carried_it_fresh() {
    use crate::scheduler::routing::pools::{expand, Membership};
    let answer = |c: &Config, store: &MemStore, cookie: Option<&str>, now: u64| {
        let s = Scheduler::new(c, store);
        let mut log = Log::default();
        let mut f = Flow::default();
        let mut headers = vec![("x-session-id", "s1")];
        if let Some(v) = cookie {
            headers.push(("cookie", v));
        }
        let step = route(&mut f, &s, &mut log, post_headers(&headers), now);
        assert!(matches!(step, Step::Route(_)), "{step:?}");
        let step =
            f.on_response_headers(&s, &mut log, &pairs(&[(":status", "200")]), true, now + 40);
        let Step::Relay(headers) = step else {
            panic!("{step:?}")
        };
        let find = |name: &str| {
            headers
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.clone())
        };
        (find(HEADER_AFFINITY), find("set-cookie"))
    };
    let cookie_of = |c: &Config| answer(c, &MemStore::new(), None, 1_000).1;
    // A static endpoint, the session at its home: told where it is.
    let c = cfg(json!({}));
    let store = MemStore::new();
    let (affinity, first) = answer(&c, &store, None, 1_000);
    assert_eq!(affinity.as_deref(), Some("home"));
    let first = first.unwrap_or_default();
    assert!(first.starts_with("cf_pin_"), "{first}");
    let sent = first.split(';').next().unwrap_or_default().to_string();
    // The next turn carries it fresh: a pin hit, nothing set again.
    let (affinity, again) = answer(&c, &store, Some(&sent), 60_000);
    assert_eq!(affinity.as_deref(), Some("hit"));
    assert_eq!(again, None);
    // A turn without any cookie following this replica's own pin at home: a client that keeps
    // no cookies, not signed for again.
    let (affinity, cookieless) = answer(&c, &store, None, 61_000);
    assert_eq!(affinity.as_deref(), Some("hit"));
    assert_eq!(cookieless, None);
    // Past half its lifetime (affinity_ttl_ms, 300 s): renewed.
    let (_, renewed) = answer(&c, &store, Some(&sent), 1_000 + 200_000);
    assert!(renewed.is_some_and(|v| v.starts_with("cf_pin_")));
    assert_eq!(cookie_of(&cfg(json!({"pin_cookie": false}))), None);
    let pooled = |extra: serde_json::Value| {
        let mut v = json!({"endpoints": [{"name": "vllm", "cluster": "pool", "pool": true}]});
        if let (Some(o), serde_json::Value::Object(more)) = (v.as_object_mut(), extra) {
            o.extend(more);
        }
        let base = Config::from_value(&v).unwrap();
        let mut m = Membership::default();
        for a in ["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"] {
            m.observe(None, Some(a), 0);
        }
        expand(&base, &[("vllm".into(), m)])
    };
    // The defaults: the pool host's answer carries it.
    let cookie = cookie_of(&pooled(json!({})));
    assert!(
        cookie.as_deref().is_some_and(|c| c.starts_with("cf_pin_")),
        "{cookie:?}"
    );
    // `"pin_cookie": false`: none.
    assert_eq!(cookie_of(&pooled(json!({"pin_cookie": false}))), None);
}
