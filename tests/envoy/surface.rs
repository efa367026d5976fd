//! The API surface beyond chat completions, through a real Envoy with the filter (raw HTTP,
//! where no official SDK applies): Anthropic Messages sessions, bodies that are not inference
//! requests, bodies whose content type contradicts their path.
//!

// A test fails loudly: panics with context are the point here.
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

use crate::support;

use serde_json::json;
use support::http::{request, DEFAULT_TIMEOUT};
use support::{Envoy, EnvoyConfig, MockUpstream};

fn fleet(names: &[&str], models: &[&str]) -> (Vec<MockUpstream>, Envoy) {
    let mocks: Vec<MockUpstream> = names
        .iter()
        .map(|n| MockUpstream::start(n, models, &["--decode-ms", "2"]))
        .collect();
    let eps: Vec<_> = names
        .iter()
        .map(|n| json!({"name": n, "cluster": n, "models": models}))
        .collect();
    let clusters: Vec<(&str, u16)> = mocks.iter().map(|m| (m.name.as_str(), m.port)).collect();
    let envoy = Envoy::start(EnvoyConfig::new(json!({ "endpoints": eps }), &clusters));
    (mocks, envoy)
}

#[test]
fn messages_session_is_metadata_user_id() {
    let (_mocks, envoy) = fleet(&["a", "b", "c"], &["claude"]);
    let send = |user_id: &str, first: &str| {
        let body = json!({
            "model": "claude", "max_tokens": 8,
            "metadata": {"user_id": user_id},
            "messages": [{"role": "user", "content": first}],
        });
        let r = request(
            envoy.port,
            "POST",
            "/v1/messages",
            &[
                ("x-api-key", "sk-ant-test"),
                ("anthropic-version", "2023-06-01"),
            ],
            Some(body.to_string().as_bytes()),
            DEFAULT_TIMEOUT,
        )
        .expect("request");
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["type"], "message");
        (
            r.header("x-computeflux-endpoint").unwrap_or("").to_string(),
            r.header("x-computeflux-affinity").unwrap_or("").to_string(),
        )
    };
    // Every request opens differently (its fingerprint differs), yet one user_id sticks.
    let (first, affinity) = send("user_42_session_7", "question 0");
    assert_eq!(affinity, "home");
    for i in 1..4 {
        let (ep, affinity) = send("user_42_session_7", &format!("question {i}"));
        assert_eq!((ep.as_str(), affinity.as_str()), (first.as_str(), "hit"));
    }
    // Another user is another session.
    assert_eq!(send("user_43", "question 0").1, "home");
}

#[test]
fn file_uploads_pass_through_unread() {
    let (mocks, envoy) = fleet(&["a"], &["m"]);
    let body = b"--xyz\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n\
--xyz\r\nContent-Disposition: form-data; name=\"file\"; filename=\"b.jsonl\"\r\n\r\n{}\r\n--xyz--\r\n";
    let r = request(
        envoy.port,
        "POST",
        "/v1/files",
        &[("content-type", "multipart/form-data; boundary=xyz")],
        Some(body),
        DEFAULT_TIMEOUT,
    )
    .expect("request");
    // The endpoint's own answer (the mock reads the form as a malformed chat body: 400), not
    // the filter's (which would have said invalid_json or 415): the upload reached `a` whole.
    assert_eq!(
        r.header("x-computeflux-endpoint"),
        Some("a"),
        "{} {}",
        r.status,
        r.body
    );
    let got: Vec<u64> = mocks[0]
        .requests()
        .into_iter()
        .filter(|q| q["path"] == "/v1/files")
        .map(|q| q["body_bytes"].as_u64().unwrap_or(0))
        .collect();
    assert_eq!(got, vec![body.len() as u64], "{} {}", r.status, r.body);
}

#[test]
fn json_body_on_an_audio_path_is_refused_with_415() {
    let (mocks, envoy) = fleet(&["a"], &["whisper-1"]);
    let r = request(
        envoy.port,
        "POST",
        "/v1/audio/transcriptions",
        &[("content-type", "application/json")],
        Some(br#"{"model":"whisper-1"}"#),
        DEFAULT_TIMEOUT,
    )
    .expect("request");
    assert_eq!(r.status, 415, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "unsupported_content_type");
    assert_eq!(mocks[0].request_count(), 0);
}

/// `list_models: upstream_merged`: one endpoint's own `GET /v1/models` answer (fetched with a
/// call), followed by the configured models it did not list; without the key the filter answers
/// alone and no upstream is asked.
#[test]
fn models_list_from_an_upstream_merged_with_the_configuration() {
    let fast = ["--decode-ms", "0"];
    let a = MockUpstream::start("a", &["llama", "qwen"], &fast);
    let b = MockUpstream::start("b", &["qwen", "whisper-1"], &fast);
    let eps = json!([
        {"name": "a", "cluster": "a", "models": ["llama", "qwen"]},
        {"name": "b", "cluster": "b", "models": ["qwen", "whisper-1"]},
    ]);
    let clusters = [("a", a.port), ("b", b.port)];
    // Requests Envoy sent to each endpoint's cluster (routed or called).
    let calls = |envoy: &Envoy| {
        let n = |c: &str| {
            envoy
                .stat(&format!("cluster.{c}.upstream_rq_total"))
                .unwrap_or(0)
        };
        (n("a"), n("b"))
    };
    let ids_and_owners = |body: &serde_json::Value| -> Vec<(String, String)> {
        body["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                (
                    m["id"].as_str().unwrap().to_string(),
                    m["owned_by"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    };

    let merged = Envoy::start(EnvoyConfig::new(
        json!({"endpoints": eps, "list_models": "upstream_merged"}),
        &clusters,
    ));
    let r = request(merged.port, "GET", "/v1/models", &[], None, DEFAULT_TIMEOUT).expect("GET");
    assert_eq!(r.status, 200, "{}", r.body);
    let got = ids_and_owners(&r.json());
    // Exactly one endpoint was asked; its entries come first, as it gave them, then the
    // configured model it lacks.
    let (asked, other) = match calls(&merged) {
        (1, 0) => ("a", "whisper-1"),
        (0, 1) => ("b", "llama"),
        calls => panic!("GET /v1/models calls at (a, b): {calls:?}"),
    };
    let own: Vec<&str> = if asked == "a" {
        vec!["llama", "qwen"]
    } else {
        vec!["qwen", "whisper-1"]
    };
    let mut expected: Vec<(String, String)> = own
        .iter()
        .map(|id| (id.to_string(), asked.to_string()))
        .collect();
    expected.push((other.to_string(), "computeflux".to_string()));
    assert_eq!(got, expected, "{}", r.body);
    drop(merged);

    let local = Envoy::start(EnvoyConfig::new(json!({ "endpoints": eps }), &clusters));
    let r = request(local.port, "GET", "/v1/models", &[], None, DEFAULT_TIMEOUT).expect("GET");
    assert_eq!(r.status, 200, "{}", r.body);
    let ids: Vec<String> = ids_and_owners(&r.json())
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    assert_eq!(ids, ["llama", "qwen", "whisper-1"]);
    assert_eq!(calls(&local), (0, 0), "the local list asked an upstream");
}
