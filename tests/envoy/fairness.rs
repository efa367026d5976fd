//! Admission when the fleet is full, through a real Envoy (two worker VMs) in front of
//! engine-like mocks with two slots each (`mock_upstream --engine batched`, a vLLM `/metrics`
//! page the filter scrapes).
//!
//! Why through Envoy: the queue is one shared-data value for the whole process, requests wait
//! paused in Envoy and are resumed by the root context's timer of the VM that paused them; only
//! a real Envoy shows that a paused request really resumes, that a client who leaves takes its
//! entry out, and that two worker VMs share one order.
//!
//! What must hold:
//! 1. Without overload nothing waits: sequential requests before and after the flood are
//!    admitted at once (`direct`), none waits, none is refused.
//! 2. Under a noisy tenant flooding well past the fleet's slots, a quiet tenant at the same
//!    granted priority gets every request served (0 errors) and waits less than the noisy
//!    one; the noisy tenant is served too, and its excess is answered 429 with `Retry-After`
//!    and an OpenAI error body — every request gets an answer, none is left to time out.
//! 3. A sheddable request (`x-computeflux-priority: -1`) is refused at once while the fleet is
//!    full; a client may not raise its priority above the granted one.
//! 4. A client that goes away while waiting leaves the queue (`abandoned`).

#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

use crate::support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use support::envoy::Stats;
use support::http::request;
use support::{Envoy, EnvoyConfig, MockUpstream};

const MODEL: &str = "m1";
const QUIET: &str = "Bearer quiet-key";
const NOISY: &str = "Bearer noisy-key";
const LEAVER: &str = "Bearer leaver-key";

fn engine(name: &str) -> MockUpstream {
    MockUpstream::start(
        name,
        &[MODEL],
        &[
            "--engine",
            "batched",
            "--max-concurrency",
            "2",
            "--output-tokens",
            "max_tokens",
            "--decode-ms-per-token",
            "3",
        ],
    )
}

/// One endpoint per mock, its `/metrics` scraped (vLLM format, every 250 ms).
fn scraped_endpoints(mocks: &[MockUpstream]) -> Vec<Value> {
    mocks
        .iter()
        .map(|m| {
            json!({"name": m.name, "cluster": m.name,
                "metrics": {"format": "vllm", "interval_ms": 250, "timeout_ms": 1000}})
        })
        .collect()
}

fn envoy(mocks: &[MockUpstream]) -> Envoy {
    let endpoints = scraped_endpoints(mocks);
    let plugin = json!({
        "endpoints": endpoints,
        "tenants": [
            {"id": "quiet-key", "priority": 1, "label": "quiet"},
            {"id": "noisy-key", "priority": 1, "label": "noisy"}
        ],
        "tuning": {"admission_queue_max": 64, "admission_max_wait_ms": 1000}
    });
    let clusters: Vec<(&str, u16)> = mocks.iter().map(|m| (m.name.as_str(), m.port)).collect();
    Envoy::start(EnvoyConfig::new(plugin, &clusters))
}

fn body(tag: &str) -> String {
    json!({"model": MODEL, "max_tokens": 60,
        "messages": [{"role": "user", "content": format!("hello {tag}")}]})
    .to_string()
}

/// One answer as the test sees it.
#[derive(Debug, Clone)]
struct Seen {
    status: u16,
    queued_ms: Option<u64>,
    retry_after: Option<String>,
    code: Option<String>,
}

fn send(port: u16, auth: &str, extra: &[(&str, &str)], tag: &str) -> Result<Seen, String> {
    let mut headers = vec![("authorization", auth)];
    headers.extend_from_slice(extra);
    let b = body(tag);
    let r = request(
        port,
        "POST",
        "/v1/chat/completions",
        &headers,
        Some(b.as_bytes()),
        Duration::from_secs(30),
    )
    .map_err(|e| format!("{tag}: {e}"))?;
    let code = (r.status != 200)
        .then(|| r.json()["error"]["code"].as_str().map(str::to_string))
        .flatten();
    Ok(Seen {
        status: r.status,
        queued_ms: r
            .header("x-computeflux-queued-ms")
            .and_then(|v| v.parse().ok()),
        retry_after: r.header("retry-after").map(str::to_string),
        code,
    })
}

fn admission(s: &Stats, priority: i8, outcome: &str) -> i64 {
    s.get(&format!(
        "wasmcustom.computeflux_admission_total.priority.{priority}.outcome.{outcome}"
    ))
    .copied()
    .unwrap_or(0)
}

fn total(s: &Stats, outcome: &str) -> i64 {
    (-8..=8).map(|p| admission(s, p, outcome)).sum()
}

fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

/// Sequential requests of the quiet tenant: all served, none waited.
fn calm(port: u16, n: usize, tag: &str) {
    for i in 0..n {
        let s = send(port, QUIET, &[], &format!("{tag} {i}")).unwrap();
        assert_eq!(s.status, 200, "calm request {tag} {i}: {s:?}");
        assert_eq!(s.queued_ms, None, "calm request {tag} {i} waited: {s:?}");
    }
}

#[test]
fn a_quiet_tenant_is_served_under_a_noisy_one_and_the_excess_is_answered() {
    let mocks = vec![engine("a"), engine("b")];
    let env = envoy(&mocks);
    let port = env.port;

    // 1. No overload: nothing waits.
    calm(port, 8, "before");
    let s0 = env.computeflux_stats();
    assert_eq!(total(&s0, "queued"), 0, "{s0:?}");

    // 2. The flood: 32 noisy clients in closed loop against 4 slots (their waits pass the
    // 1 s bound), one quiet client.
    let stop = Arc::new(AtomicBool::new(false));
    let noisy: Arc<Mutex<Vec<Result<Seen, String>>>> = Arc::default();
    let clients: Vec<_> = (0..32)
        .map(|k| {
            let (stop, noisy) = (stop.clone(), noisy.clone());
            std::thread::spawn(move || {
                let mut n = 0;
                while !stop.load(Ordering::SeqCst) {
                    n += 1;
                    let r = send(port, NOISY, &[], &format!("noisy {k} {n}"));
                    let refused = matches!(&r, Ok(s) if s.status == 429);
                    noisy.lock().unwrap().push(r);
                    if refused {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
            })
        })
        .collect();
    // Let the engines queue once (their slots are learned from a scrape with a queue) and the
    // filter's queue fill.
    std::thread::sleep(Duration::from_secs(3));

    // 3. A sheddable request is refused at once; a raised priority is capped (it still waits
    // or goes like any priority-1 request, never refused as sheddable).
    let shed = send(port, QUIET, &[("x-computeflux-priority", "-1")], "shed").unwrap();
    assert_eq!(shed.status, 429, "{shed:?}");
    assert_eq!(shed.code.as_deref(), Some("queue_full"), "{shed:?}");
    assert!(shed.retry_after.is_some(), "{shed:?}");

    // 4. A client of an unlisted tenant (priority 0, behind the flood's priority 1) goes away
    // while it waits.
    let leaver = request(
        port,
        "POST",
        "/v1/chat/completions",
        &[("authorization", LEAVER)],
        Some(body("leaver").as_bytes()),
        Duration::from_millis(500),
    );
    assert!(
        leaver.is_err(),
        "the leaver was answered within 500 ms: {leaver:?}"
    );

    let mut quiet = Vec::new();
    for i in 0..20 {
        quiet.push(send(
            port,
            QUIET,
            &[("x-computeflux-priority", "8")],
            &format!("quiet {i}"),
        ));
        std::thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, Ordering::SeqCst);
    for c in clients {
        c.join().unwrap();
    }
    let noisy = noisy.lock().unwrap().clone();

    // Every request got an answer.
    let io: Vec<&String> = noisy
        .iter()
        .chain(&quiet)
        .filter_map(|r| r.as_ref().err())
        .collect();
    assert!(io.is_empty(), "requests without an answer: {io:?}");
    let quiet: Vec<Seen> = quiet.into_iter().map(Result::unwrap).collect();
    let noisy: Vec<Seen> = noisy.into_iter().map(Result::unwrap).collect();
    let bad_quiet: Vec<&Seen> = quiet.iter().filter(|s| s.status != 200).collect();
    assert!(bad_quiet.is_empty(), "quiet tenant errors: {bad_quiet:?}");
    let served = noisy.iter().filter(|s| s.status == 200).count();
    let refused: Vec<&Seen> = noisy.iter().filter(|s| s.status == 429).collect();
    let other: Vec<&Seen> = noisy
        .iter()
        .filter(|s| s.status != 200 && s.status != 429)
        .collect();
    assert!(
        other.is_empty(),
        "noisy answers other than 200/429: {other:?}"
    );
    assert!(served > 0, "the noisy tenant was served too");
    assert!(!refused.is_empty(), "the noisy tenant's excess was refused");
    for r in &refused {
        assert!(
            r.retry_after
                .as_deref()
                .is_some_and(|v| v.parse::<u64>().is_ok_and(|n| n >= 1)),
            "{r:?}"
        );
        assert!(
            matches!(r.code.as_deref(), Some("queue_full" | "queue_timeout")),
            "{r:?}"
        );
    }
    let quiet_waits: Vec<u64> = quiet.iter().map(|s| s.queued_ms.unwrap_or(0)).collect();
    let noisy_waits: Vec<u64> = noisy
        .iter()
        .filter(|s| s.status == 200)
        .map(|s| s.queued_ms.unwrap_or(0))
        .collect();
    let waited = noisy_waits.iter().filter(|w| **w > 0).count();
    println!(
        "noisy: {} sent, {served} served ({waited} after waiting), {} refused; quiet: {} served; \
         median wait quiet {} ms, noisy {} ms; quiet waits {quiet_waits:?}",
        noisy.len(),
        refused.len(),
        quiet.len(),
        median(quiet_waits.clone()),
        median(noisy_waits.clone()),
    );
    assert!(
        waited > 0,
        "the flood made requests wait (the fleet was full)"
    );
    assert!(
        median(quiet_waits) < median(noisy_waits),
        "the quiet tenant waits less than the noisy one"
    );

    let s1 = env.computeflux_stats();
    assert!(
        total(&s1, "abandoned") >= 1,
        "the leaver left the queue: {s1:?}"
    );
    assert!(admission(&s1, -1, "queue_full") >= 1, "{s1:?}");
    assert!(total(&s1, "waited") >= waited as i64);

    // 5. The flood is over: once the engines drain, nothing waits again.
    std::thread::sleep(Duration::from_secs(2));
    let before = total(&env.computeflux_stats(), "queued");
    calm(port, 8, "after");
    let s2 = env.computeflux_stats();
    assert_eq!(
        total(&s2, "queued"),
        before,
        "calm requests after the flood waited"
    );
    assert!(env.wasm_crashes().is_empty(), "{:?}", env.wasm_crashes());
}

/// An admitted request goes to the engine whose slot freed, not to an engine already running
/// its slots (whose own queue would hold it first come, first served). Three engines with two
/// slots each and answers of different lengths, so that slots free one engine at a time; 16
/// clients in closed loop keep the filter's queue full. Of the requests that waited in the
/// filter, those that then found every slot of their engine taken are counted by the mocks
/// (`x-mock-slot-wait`): placed by the rendezvous order alone, 35 of 78 and 42 of 80 did;
/// placed where admission found the place, 0–2 of about 80, and 9 of 55 with another Envoy
/// test beside it on 2 cores (a worker VM that took its admitted entry out of the queue and has
/// not yet counted its attempt leaves the place free for the other VM's round).
#[test]
fn an_admitted_request_takes_the_free_slot_not_an_engine_queue() {
    let mocks = [engine("a"), engine("b"), engine("c")];
    let endpoints = scraped_endpoints(&mocks);
    let plugin = json!({
        "endpoints": endpoints,
        "expose_headers": true,
        "tuning": {"admission_queue_max": 64, "admission_max_wait_ms": 10000}
    });
    let clusters: Vec<(&str, u16)> = mocks.iter().map(|m| (m.name.as_str(), m.port)).collect();
    let env = Envoy::start(EnvoyConfig::new(plugin, &clusters));
    let port = env.port;
    let ask = move |tag: String, tokens: u64| {
        let b = json!({"model": MODEL, "max_tokens": tokens,
            "messages": [{"role": "user", "content": format!("hello {tag}")}]})
        .to_string();
        request(
            port,
            "POST",
            "/v1/chat/completions",
            &[("authorization", NOISY)],
            Some(b.as_bytes()),
            Duration::from_secs(30),
        )
    };

    // The engines' slots are learned from a scrape that shows a queue: 12 at once on 6 slots.
    let teach: Vec<_> = (0..12)
        .map(|i| std::thread::spawn(move || ask(format!("teach {i}"), 150)))
        .collect();
    for t in teach {
        assert_eq!(t.join().unwrap().unwrap().status, 200);
    }
    std::thread::sleep(Duration::from_millis(600));

    // The flood: answers of 10..160 tokens (30..480 ms), every client its own lengths.
    let stop = Arc::new(AtomicBool::new(false));
    // (status, waited in the filter, the mock's `x-mock-slot-wait`)
    type Answer = (u16, bool, Option<String>);
    let seen: Arc<Mutex<Vec<Answer>>> = Arc::default();
    let clients: Vec<_> = (0..16u64)
        .map(|k| {
            let (stop, seen) = (stop.clone(), seen.clone());
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    n += 1;
                    let tokens = 10 + (k * 37 + n * 53) % 150;
                    let r = ask(format!("flood {k} {n}"), tokens).unwrap();
                    let waited = r.header("x-computeflux-queued-ms").is_some();
                    let slot = r.header("x-mock-slot-wait").map(str::to_string);
                    seen.lock().unwrap().push((r.status, waited, slot));
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(4));
    stop.store(true, Ordering::SeqCst);
    for c in clients {
        c.join().unwrap();
    }
    let seen = seen.lock().unwrap().clone();
    let bad: Vec<_> = seen.iter().filter(|(s, _, _)| *s != 200).collect();
    assert!(bad.is_empty(), "{bad:?}");
    let waited: Vec<_> = seen.iter().filter(|(_, w, _)| *w).collect();
    let in_engine_queue = waited
        .iter()
        .filter(|(_, _, slot)| slot.as_deref() == Some("1"))
        .count();
    println!(
        "{} answers, {} waited in the filter, {in_engine_queue} of those then waited for a slot \
         in their engine",
        seen.len(),
        waited.len()
    );
    assert!(
        waited.iter().all(|(_, _, slot)| slot.is_some()),
        "the mocks say whether a slot was free"
    );
    assert!(waited.len() >= 20, "the flood made requests wait");
    assert!(
        in_engine_queue * 4 <= waited.len(),
        "{in_engine_queue} of {} admitted requests queued in an engine",
        waited.len()
    );
    assert!(env.wasm_crashes().is_empty(), "{:?}", env.wasm_crashes());
}
