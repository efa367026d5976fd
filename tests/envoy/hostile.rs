//! Hostile requests through a real Envoy (`--concurrency 2`) with the filter in front of mock
//! upstreams: every case gets its defined status and body, the upstream is not called when the
//! filter can answer alone, and no wasm panic or VM failure shows in Envoy's log.
//!
//! Defined behaviour checked here (also in docs/hardening.md):
//! - A `POST` (any path) is a chat-completion request: its body is buffered (≤ `max_body_bytes`),
//!   parsed, and refused with an OpenAI-shaped error (`{"error":{"message","type","param","code"}}`)
//!   when it is not one: 400 `empty_body`, `invalid_json` (also for nesting deeper than 128
//!   levels), `invalid_request_body` (JSON, but not an object), `missing_model`, `invalid_model`
//!   (not a string, or longer than 256 bytes); a 10 KiB session header is served (hashed);
//!   413 `request_too_large`, decided from `content-length` before any body byte is read, or from
//!   the buffered size when the body comes chunked.
//! - Error messages quote at most 160 bytes of the parser's text, cut on a character boundary:
//!   long runs of 2-, 3- and 4-byte characters (issue 14: `"messages":"a` + 200 × `é`) get a
//!   400, not a VM panic.
//! - Session header values are opaque bytes: a non-UTF-8 value is a valid session id.
//! - A session header beyond Envoy's own header limit (`max_request_headers_kb`, 60 KiB by
//!   default) is refused by Envoy's codec before the filter runs: HTTP/1.1 gets Envoy's plain
//!   431, HTTP/2 a dropped connection without a response; nothing reaches an upstream.
//! - A client-sent routing header (`x-computeflux-cluster`) is removed: the filter alone picks the
//!   cluster, and no upstream sees the header, neither on the routed path nor on failover calls.
//! - `GET /v1/models` is answered by the filter; other methods and paths that are not inference
//!   are routed to the best endpoint for any model,
//!   without a session (`x-computeflux-affinity: none`); the endpoint's answer passes through.

// Test code: a failed unwrap is a failed test.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use crate::support;

use std::time::Duration;

use serde_json::{json, Value};
use support::http::{self, Response};
use support::raw::{chunk, h2_request, head, raw_exchange};
use support::{chat_body, curl_h2, post_chat, Envoy, EnvoyConfig, MockUpstream};

/// Small enough that the over-limit cases stay cheap, large enough for the 100 KB model and the
/// 100 000-level nesting cases to reach the parser.
const MAX_BODY: usize = 1024 * 1024;
const CLUSTERS: [&str; 3] = ["a", "b", "c"];

struct Fixture {
    a: MockUpstream,
    b: MockUpstream,
    c: MockUpstream,
    envoy: Envoy,
}

/// Endpoints `a` (weight 100: every cold pick goes there), `c` (weight 1) and `b` (disabled,
/// but its cluster exists in Envoy, so only the filter keeps requests away from it).
fn start() -> Fixture {
    let fast = ["--prefill-us-per-token", "0", "--decode-ms", "0"];
    let a = MockUpstream::start("a", &[], &fast);
    let b = MockUpstream::start("b", &[], &fast);
    let c = MockUpstream::start("c", &[], &fast);
    let plugin = json!({
        "endpoints": [
            {"name": "a", "cluster": "a", "weight": 100},
            {"name": "b", "cluster": "b", "disabled": true},
            {"name": "c", "cluster": "c", "weight": 1},
        ],
        "max_body_bytes": MAX_BODY,
    });
    let cfg = EnvoyConfig::new(plugin, &[("a", a.port), ("b", b.port), ("c", c.port)]);
    let envoy = Envoy::start(cfg);
    Fixture { a, b, c, envoy }
}

impl Fixture {
    /// Requests Envoy sent to any upstream cluster (chat or not; routed or dispatched).
    fn upstream_total(&self) -> i64 {
        CLUSTERS
            .iter()
            .map(|c| {
                self.envoy
                    .stat(&format!("cluster.{c}.upstream_rq_total"))
                    .unwrap_or(0)
            })
            .sum()
    }

    /// Runs `f` and asserts that no request reached any upstream meanwhile.
    fn no_upstream<T>(&self, what: &str, f: impl FnOnce() -> T) -> T {
        let before = self.upstream_total();
        let out = f();
        let after = self.upstream_total();
        assert_eq!(after, before, "{what}: the upstream was called");
        out
    }

    /// No panic and no VM failure in Envoy's log, and the filter still routes.
    fn assert_healthy(&self) {
        let r = post_chat(
            self.envoy.port,
            &[],
            &chat_body("m", &["still alive?"], json!({})),
        );
        assert_eq!(r.status, 200, "after the hostile cases: {}", r.body);
        // The log file is flushed every 100 ms.
        std::thread::sleep(Duration::from_millis(300));
        let log = self.envoy.log_contents();
        let lower = log.to_ascii_lowercase();
        assert!(!lower.contains("panic"), "panic in Envoy's log:\n{log}");
        assert!(
            !log.contains("Wasm VM failed"),
            "VM failure in Envoy's log:\n{log}"
        );
        assert!(
            !lower.contains("wasm vm failed"),
            "VM failure in Envoy's log:\n{log}"
        );
    }
}

/// Asserts status and the exact OpenAI error shape with `code`; returns the message.
fn assert_openai_error(r: &Response, status: u16, code: &str) -> String {
    assert_eq!(r.status, status, "want {code}; body: {}", r.body);
    assert_eq!(
        r.header("content-type"),
        Some("application/json"),
        "{:?}",
        r.headers
    );
    let v: Value = r.json();
    let top = v.as_object().expect("error body is an object");
    assert_eq!(top.len(), 1, "only `error` at the top level: {v}");
    let e = v["error"].as_object().expect("`error` is an object");
    let mut keys: Vec<&str> = e.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["code", "message", "param", "type"], "{v}");
    assert_eq!(e["code"], code, "{v}");
    assert!(e["param"].is_null(), "{v}");
    let kind = e["type"].as_str().unwrap_or("");
    let want_kind = if status == 413 || status == 400 {
        "invalid_request_error"
    } else {
        kind
    };
    assert_eq!(kind, want_kind, "{v}");
    let message = e["message"].as_str().unwrap_or("").to_string();
    assert!(!message.is_empty(), "{v}");
    // A refusal never echoes large client input back.
    assert!(r.body.len() < 1024, "error body is {} bytes", r.body.len());
    message
}

fn post(port: u16, headers: &[(&str, &str)], body: &[u8]) -> Response {
    http::request(
        port,
        "POST",
        "/v1/chat/completions",
        headers,
        Some(body),
        http::DEFAULT_TIMEOUT,
    )
    .unwrap_or_else(|e| panic!("POST failed: {e}"))
}

#[test]
fn malformed_bodies_get_openai_errors_without_reaching_an_upstream() {
    let f = start();
    let port = f.envoy.port;
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        ("invalid JSON", b"{nope".to_vec(), 400, "invalid_json"),
        (
            "truncated JSON",
            br#"{"model":"m","messages":["#.to_vec(),
            400,
            "invalid_json",
        ),
        (
            "JSON array",
            b"[1,2,3]".to_vec(),
            400,
            "invalid_request_body",
        ),
        (
            "JSON string",
            br#""hello""#.to_vec(),
            400,
            "invalid_request_body",
        ),
        ("JSON number", b"42".to_vec(), 400, "invalid_request_body"),
        (
            "no model",
            br#"{"messages":[]}"#.to_vec(),
            400,
            "missing_model",
        ),
        (
            "model null",
            br#"{"model":null}"#.to_vec(),
            400,
            "missing_model",
        ),
        (
            "model number",
            br#"{"model":7}"#.to_vec(),
            400,
            "invalid_model",
        ),
        (
            "model object",
            br#"{"model":{"id":"m"}}"#.to_vec(),
            400,
            "invalid_model",
        ),
        (
            "model array",
            br#"{"model":["m"]}"#.to_vec(),
            400,
            "invalid_model",
        ),
        ("whitespace body", b"  \n\t ".to_vec(), 400, "empty_body"),
        (
            "non-UTF-8 in JSON",
            b"{\"model\":\"m\xff\"}".to_vec(),
            400,
            "invalid_json",
        ),
    ];
    // Issue 14: serde_json's error quotes the client's text; cutting it at a byte inside a
    // multi-byte character panicked the VM (an empty 503). Every character width, every cut.
    let mut cases = cases;
    for (what, ch) in [("2-byte", "é"), ("3-byte", "€"), ("4-byte", "𝄞")] {
        for lead in 0..4 {
            let text = format!("{}{}", "a".repeat(lead), ch.repeat(200));
            cases.push((
                what,
                format!(r#"{{"model":"llama-3-8b","messages":"{text}"}}"#).into_bytes(),
                400,
                "invalid_json",
            ));
            cases.push((
                what,
                format!(r#"{{"model":"llama-3-8b","messages":[{text}]}}"#).into_bytes(),
                400,
                "invalid_json",
            ));
        }
        cases.push((
            what,
            format!(r#"{{"model":"{}"}}"#, ch.repeat(200)).into_bytes(),
            400,
            "invalid_model",
        ));
        cases.push((
            what,
            format!(r#"{{"model":"{}"#, ch.repeat(200)).into_bytes(),
            400,
            "invalid_json",
        ));
    }
    for (what, body, status, code) in &cases {
        let r = f.no_upstream(what, || post(port, &[], body));
        assert_openai_error(&r, *status, code);
    }

    // 100 KB model string: refused as too long, and not echoed back.
    let long_model = format!(r#"{{"model":"{}","messages":[]}}"#, "m".repeat(100_000));
    let r = f.no_upstream("100 KB model", || post(port, &[], long_model.as_bytes()));
    let msg = assert_openai_error(&r, 400, "invalid_model");
    assert!(msg.contains("at most 256 bytes"), "{msg}");

    // Empty body: content-length 0 (end of stream at the headers).
    let r = f.no_upstream("empty body", || {
        http::request(
            port,
            "POST",
            "/v1/chat/completions",
            &[], // no body: the client sends `content-length: 0`
            None,
            http::DEFAULT_TIMEOUT,
        )
        .expect("POST")
    });
    assert_openai_error(&r, 400, "empty_body");

    // 100 000 levels of nesting inside an object with a valid model, as arrays and as objects:
    // refused as invalid JSON (the filter's depth limit is 128), no stack overflow.
    let n = 100_000;
    let deep_arrays = format!(r#"{{"model":"m","x":{}{}}}"#, "[".repeat(n), "]".repeat(n));
    let deep_objects = format!(
        r#"{{"model":"m","x":{}1{}}}"#,
        r#"{"a":"#.repeat(n),
        "}".repeat(n)
    );
    let bare = format!("{}{}", "[".repeat(n), "]".repeat(n));
    for (what, body) in [
        ("100 000-level arrays", &deep_arrays),
        ("100 000-level objects", &deep_objects),
    ] {
        assert!(body.len() < MAX_BODY, "{what} must reach the parser");
        let r = f.no_upstream(what, || post(port, &[], body.as_bytes()));
        assert_openai_error(&r, 400, "invalid_json");
    }
    // A bare deep array is valid JSON (serde_json skips it without recursing): not an object.
    let r = f.no_upstream("100 000-level bare array", || {
        post(port, &[], bare.as_bytes())
    });
    assert_openai_error(&r, 400, "invalid_request_body");
    // Unclosed nesting (a truncated deep body).
    let unclosed = format!(r#"{{"model":"m","x":{}"#, "[".repeat(n));
    let r = f.no_upstream("unclosed nesting", || post(port, &[], unclosed.as_bytes()));
    assert_openai_error(&r, 400, "invalid_json");

    // The mocks saw nothing at all.
    for m in [&f.a, &f.b, &f.c] {
        assert_eq!(m.request_count(), 0, "mock {}", m.name);
    }
    f.assert_healthy();
}

#[test]
fn oversized_bodies_get_413_with_content_length_and_chunked() {
    let f = start();
    let port = f.envoy.port;

    // Declared too large: refused from content-length.
    let big = vec![b' '; MAX_BODY + 1];
    let r = f.no_upstream("content-length over the limit", || post(port, &[], &big));
    let msg = assert_openai_error(&r, 413, "request_too_large");
    assert!(msg.contains(&MAX_BODY.to_string()), "{msg}");
    // Exactly at the limit is not too large (whitespace: then an empty body).
    let at = vec![b' '; MAX_BODY];
    let r = f.no_upstream("body at the limit", || post(port, &[], &at));
    assert_openai_error(&r, 400, "empty_body");

    // Chunked, no content-length: 16 KiB chunks until past the limit, then the last chunk.
    let mut parts = vec![head(&[], "transfer-encoding: chunked")];
    let piece = vec![b' '; 16 * 1024];
    for _ in 0..(MAX_BODY / piece.len() + 2) {
        parts.push(chunk(&piece));
    }
    parts.push(b"0\r\n\r\n".to_vec());
    let raw = f.no_upstream("chunked over the limit", || {
        raw_exchange(port, &parts, Duration::from_millis(2)).expect("chunked exchange")
    });
    assert!(raw.header("content-length").is_some() || !raw.body.is_empty());
    assert_openai_error(&raw.as_response(), 413, "request_too_large");

    // Chunked and within the limit: the body is reassembled from its chunks and routed.
    let body = chat_body("m", &["chunked hello"], json!({"user": "chunky"}));
    let bytes = body.as_bytes();
    let mut parts = vec![head(&[], "transfer-encoding: chunked")];
    for piece in bytes.chunks(7) {
        parts.push(chunk(piece));
    }
    parts.push(b"0\r\n\r\n".to_vec());
    let before = f.a.request_count();
    let raw = raw_exchange(port, &parts, Duration::from_millis(1)).expect("chunked exchange");
    assert_eq!(raw.status, 200, "{raw:?}");
    assert_eq!(raw.header("x-computeflux-endpoint").as_deref(), Some("a"));
    assert_eq!(f.a.request_count(), before + 1);
    let last = f.a.requests().last().cloned().unwrap_or_default();
    assert_eq!(last["user"], "chunky", "{last}");

    for m in [&f.b, &f.c] {
        assert_eq!(m.request_count(), 0, "mock {}", m.name);
    }
    f.assert_healthy();
}

#[test]
fn session_headers_non_utf8_oversized_and_beyond_envoys_limit() {
    let f = start();
    let port = f.envoy.port;
    let body = chat_body("m", &["session test"], json!({}));
    let framing = format!("content-length: {}", body.len());

    // Non-UTF-8 bytes are an opaque session id: the first request pins, the second hits.
    let line: &[u8] = b"x-session-id: s\xff\xfe-\x80\x81";
    let mut affinity = Vec::new();
    for _ in 0..2 {
        let parts = vec![head(&[line], &framing), body.clone().into_bytes()];
        let raw = raw_exchange(port, &parts, Duration::ZERO).expect("exchange");
        assert_eq!(raw.status, 200, "{raw:?}");
        affinity.push(raw.header("x-computeflux-affinity").unwrap_or_default());
    }
    assert_eq!(affinity, ["home", "hit"]);

    // 10 KiB session id: within Envoy's header limit; hashed like any other, never refused
    // (issue 42; it was a 400 `invalid_session_id` over 4096 bytes).
    let ten_k = "s".repeat(10 * 1024);
    let mut affinity = Vec::new();
    for _ in 0..2 {
        let r = post(port, &[("x-session-id", &ten_k)], body.as_bytes());
        assert_eq!(r.status, 200, "{}", r.body);
        affinity.push(
            r.header("x-computeflux-affinity")
                .unwrap_or_default()
                .to_string(),
        );
    }
    assert_eq!(affinity, ["home", "hit"]);

    // 64 KiB: over Envoy's max_request_headers_kb (60 KiB): Envoy's HTTP/1.1 codec answers 431
    // itself (plain text, not the filter's JSON) and the filter never runs.
    let sixty_four_k = "s".repeat(64 * 1024);
    let r = f.no_upstream("64 KiB session header (HTTP/1.1)", || {
        post(port, &[("x-session-id", &sixty_four_k)], body.as_bytes())
    });
    assert_eq!(r.status, 431, "{}", r.body);
    // HTTP/2: the same limit is a connection error: Envoy drops the connection without a
    // response (curl: "Connection died"); nothing reaches an upstream.
    let out = f.no_upstream("64 KiB session header (HTTP/2)", || {
        std::process::Command::new("curl")
            .args([
                "-sS",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--http2-prior-knowledge",
            ])
            .args(["--max-time", "15", "-H", "content-type: application/json"])
            .arg("-H")
            .arg(format!("x-session-id: {sixty_four_k}"))
            .args(["--data-binary", &body])
            .arg(format!("http://127.0.0.1:{port}/v1/chat/completions"))
            .output()
            .expect("run curl")
    });
    let code = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        !out.status.success() && code == "000",
        "HTTP/2 64 KiB header: expected the connection dropped without a response, got \
         code {code}, curl {:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );

    for m in [&f.b, &f.c] {
        assert_eq!(m.request_count(), 0, "mock {}", m.name);
    }
    f.assert_healthy();
}

#[test]
fn client_routing_header_is_removed_on_routed_and_failover_paths() {
    let f = start();
    let port = f.envoy.port;
    // Two values, mixed case: the client asks for the disabled endpoint's cluster.
    let spoof: &[(&str, &str)] = &[
        ("X-ComputeFlux-Cluster", "b"),
        ("x-computeflux-cluster", "c"),
    ];
    let seen_routing = |m: &MockUpstream| {
        m.requests()
            .iter()
            .any(|r| r["headers"].get("x-computeflux-cluster").is_some())
    };

    let r = post(
        port,
        spoof,
        chat_body("m", &["where do I go"], json!({})).as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-computeflux-endpoint"), Some("a"));
    assert_eq!(r.header("x-mock-endpoint"), Some("a"));

    // Failover: `a` answers 503 once; the filter dispatches the request to `c` itself (no
    // route, so no route-level header removal): `c` must not see the client's header either.
    f.a.set_fault(json!({"mode": "status", "status": 503, "count": 1}));
    let r = post(
        port,
        spoof,
        chat_body("m", &["fail me over"], json!({})).as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-mock-endpoint"), Some("c"));
    assert_eq!(r.header("x-computeflux-attempts"), Some("2"));
    assert_eq!(f.c.request_count(), 1);

    // Not a POST, not inference: routed by the filter too (the mock's own 404 comes back).
    let r = http::request(
        port,
        "GET",
        "/v1/files/x",
        spoof,
        None,
        http::DEFAULT_TIMEOUT,
    )
    .expect("GET");
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(r.header("x-computeflux-endpoint"), Some("a"));
    assert!(r.body.contains("mock a: no route"), "{}", r.body);

    // A refused request with the header reaches no one.
    let r = f.no_upstream("refused with a routing header", || {
        post(port, spoof, b"{nope")
    });
    assert_openai_error(&r, 400, "invalid_json");

    assert_eq!(f.b.request_count(), 0);
    assert_eq!(f.envoy.stat("cluster.b.upstream_rq_total"), Some(0));
    assert!(!seen_routing(&f.a), "a saw the routing header");
    assert!(!seen_routing(&f.c), "c saw the routing header");
    f.assert_healthy();
}

#[test]
fn non_chat_requests_are_routed_without_a_session() {
    let f = start();
    let port = f.envoy.port;

    // GET /v1/models: answered by the filter from its configuration (these endpoints serve
    // any model and name none: an empty list), no upstream involved.
    let before = f.upstream_total();
    let r = http::request(
        port,
        "GET",
        "/v1/models",
        &[("x-session-id", "s1")],
        None,
        http::DEFAULT_TIMEOUT,
    )
    .expect("GET");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-computeflux-endpoint"), None);
    assert_eq!(r.json()["object"], "list");
    assert_eq!(r.json()["data"], serde_json::json!([]));
    assert_eq!(
        f.upstream_total(),
        before,
        "GET /v1/models reached an upstream"
    );

    // Requests without a session spread on a per-request key (`Pick::nonce`), weighted: `a`
    // (weight 100) nearly always, `c` (weight 1) about once in a hundred; never disabled `b`.
    let routed = |r: &http::Response| {
        let e = r.header("x-computeflux-endpoint");
        assert!(matches!(e, Some("a" | "c")), "routed to {e:?}: {}", r.body);
        e.unwrap_or_default().to_string()
    };

    // Another path: the endpoint's own answer (the mock's 404) passes through unchanged.
    let r = http::get(port, "/v1/not-a-thing");
    assert_eq!(r.status, 404, "{}", r.body);
    let e = routed(&r);
    assert!(
        r.body.contains(&format!("mock {e}: no route")),
        "{}",
        r.body
    );
    // DELETE and HEAD are routed the same way.
    let r = http::request(
        port,
        "DELETE",
        "/v1/files/x",
        &[],
        None,
        http::DEFAULT_TIMEOUT,
    )
    .expect("DELETE");
    assert_eq!(r.status, 404, "{}", r.body);
    routed(&r);
    let r =
        http::request(port, "HEAD", "/v1/models", &[], None, http::DEFAULT_TIMEOUT).expect("HEAD");
    routed(&r);

    // A POST to another path is read as a chat-completion body: a model is required.
    let r = f.no_upstream("POST /v1/embeddings without model", || {
        http::post_json(port, "/v1/embeddings", r#"{"input":"x"}"#)
    });
    assert_openai_error(&r, 400, "missing_model");
    let r = http::post_json(port, "/v1/embeddings", r#"{"model":"m","input":"x"}"#);
    routed(&r);

    assert_eq!(f.envoy.stat("cluster.b.upstream_rq_total"), Some(0));
    f.assert_healthy();
}

#[test]
fn http2_downstream_gets_the_same_answers() {
    let f = start();
    let port = f.envoy.port;
    let path = "/v1/chat/completions";

    let r = f.no_upstream("h2 invalid JSON", || {
        curl_h2(port, "POST", path, &[], Some("{nope"))
    });
    assert_openai_error(&r, 400, "invalid_json");
    let crafted = format!(
        r#"{{"model":"llama-3-8b","messages":"a{}"}}"#,
        "é".repeat(200)
    );
    let r = f.no_upstream("h2 issue-14 body", || {
        curl_h2(port, "POST", path, &[], Some(&crafted))
    });
    assert_openai_error(&r, 400, "invalid_json");
    let r = f.no_upstream("h2 model not a string", || {
        curl_h2(port, "POST", path, &[], Some(r#"{"model":7}"#))
    });
    assert_openai_error(&r, 400, "invalid_model");
    let deep = format!(
        r#"{{"model":"m","x":{}{}}}"#,
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    let r = f.no_upstream("h2 deep nesting", || {
        curl_h2(port, "POST", path, &[], Some(&deep))
    });
    assert_openai_error(&r, 400, "invalid_json");
    // Over the limit: Envoy sends the 413 while the upload is in progress, then resets the
    // request half with RST_STREAM(NO_ERROR). curl reports that as a framing error and drops
    // the response, so this case uses the h2 crate, which keeps it.
    let big = vec![b' '; MAX_BODY + 1];
    let r = f.no_upstream("h2 over the limit", || {
        h2_request(
            port,
            "POST",
            path,
            &[("content-type", "application/json")],
            &big,
        )
        .expect("h2 413")
    });
    assert_openai_error(&r, 413, "request_too_large");
    let r = f.no_upstream("h2 empty body", || {
        curl_h2(port, "POST", path, &[], Some(""))
    });
    assert_openai_error(&r, 400, "empty_body");

    // A valid request, twice with one session: routed, then an affinity hit; the client's
    // routing header is ignored.
    let body = chat_body("m", &["over h2"], json!({}));
    let hdrs = [
        ("x-session-id", "h2-session"),
        ("x-computeflux-cluster", "b"),
    ];
    let r1 = curl_h2(port, "POST", path, &hdrs, Some(&body));
    assert_eq!(r1.status, 200, "{}", r1.body);
    assert_eq!(r1.header("x-computeflux-endpoint"), Some("a"));
    assert_eq!(r1.header("x-computeflux-affinity"), Some("home"));
    let r2 = curl_h2(port, "POST", path, &hdrs, Some(&body));
    assert_eq!(r2.header("x-computeflux-affinity"), Some("hit"));
    let r = curl_h2(port, "GET", "/v1/models", &[], None);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["object"], "list");

    assert_eq!(f.envoy.stat("cluster.b.upstream_rq_total"), Some(0));
    f.assert_healthy();
}
