//! Data-parallel ranks (issue 42) through a real Envoy: an endpoint with
//! `data_parallel_size: 2` is two endpoints, `gpu-r0` and `gpu-r1`, on one upstream. Its requests
//! carry `x-data-parallel-rank` 0 or 1 (the mock records every request's headers), the rank of
//! the endpoint that served them; every turn of a session reaches the same rank; both ranks are
//! used; a client's own value never reaches an upstream, neither a ranked one nor a plain one;
//! a failover call from one rank to the other carries the other's rank; and a rank whose own
//! series (vLLM's `engine` label) say it is full gets no new sessions while the other rank
//! serves them, until it drains.

// Test code: failing loudly with context is the point.
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

use crate::support;

use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use support::envoy::endpoint_stat;
use support::placement::{header_session, rendezvous_order};
use support::{chat_body, post_chat, Backlog, Checks, Envoy, EnvoyConfig, MockUpstream, Session};

const RANK: &str = "x-data-parallel-rank";

fn fast() -> [&'static str; 4] {
    ["--prefill-us-per-token", "0", "--decode-ms", "1"]
}

/// The engine behind the data-parallel endpoint: two ranks, as configured (the mock refuses a
/// rank it does not have, as vLLM does).
fn two_ranks() -> Vec<&'static str> {
    [&fast()[..], &["--data-parallel-size", "2"]].concat()
}

/// The rank header of each request the mock received, by `x-session-id`, in order.
fn ranks_by_session(mock: &MockUpstream) -> BTreeMap<String, Vec<Option<String>>> {
    let mut out: BTreeMap<String, Vec<Option<String>>> = BTreeMap::new();
    for r in mock.requests() {
        let h = &r["headers"];
        let session = h["x-session-id"].as_str().unwrap_or("-").to_string();
        out.entry(session)
            .or_default()
            .push(h[RANK].as_str().map(str::to_string));
    }
    out
}

#[test]
fn each_rank_is_an_endpoint_and_a_session_keeps_its_rank() {
    let gpu = MockUpstream::start("gpu", &[], &two_ranks());
    let solo = MockUpstream::start("solo", &[], &fast());
    let plugin = json!({"endpoints": [
        {"name": "gpu", "cluster": "cg", "data_parallel_size": 2},
        {"name": "solo", "cluster": "cs"}
    ]});
    let envoy = Envoy::start(EnvoyConfig::new(
        plugin,
        &[("cg", gpu.port), ("cs", solo.port)],
    ));
    let mut served: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for s in 0..16 {
        let session = format!("dp-{s}");
        for turn in 0..3 {
            let msgs: Vec<String> = (0..=turn).map(|t| format!("turn {t}")).collect();
            let msgs: Vec<&str> = msgs.iter().map(String::as_str).collect();
            // Every request carries a client's own rank: it must never pass.
            let r = post_chat(
                envoy.port,
                &[("x-session-id", &session), (RANK, "7")],
                &chat_body("m", &msgs, Value::Null),
            );
            assert_eq!(r.status, 200, "{}", r.body);
            let ep = r.header("x-computeflux-endpoint").unwrap().to_string();
            assert!(["gpu-r0", "gpu-r1", "solo"].contains(&ep.as_str()), "{ep}");
            served.entry(session.clone()).or_default().insert(ep);
        }
    }
    // A session stays on one endpoint, a rank included.
    for (s, eps) in &served {
        assert_eq!(eps.len(), 1, "session {s} moved: {eps:?}");
    }
    let used: BTreeSet<&String> = served.values().flatten().collect();
    assert!(
        used.contains(&"gpu-r0".to_string()) && used.contains(&"gpu-r1".to_string()),
        "both ranks used: {used:?}"
    );
    // What the engine saw: each request of a ranked session carries that rank, never the
    // client's; the plain endpoint gets no rank at all.
    let gpu_seen = ranks_by_session(&gpu);
    assert!(!gpu_seen.is_empty());
    for (s, ranks) in &gpu_seen {
        let ep = served[s].iter().next().unwrap();
        let want = ep
            .strip_prefix("gpu-r")
            .unwrap_or_else(|| panic!("{s} on {ep}"));
        assert_eq!(ranks.len(), 3, "{s}: {ranks:?}");
        assert!(
            ranks.iter().all(|r| r.as_deref() == Some(want)),
            "session {s} on {ep}: {ranks:?}"
        );
    }
    for (s, ranks) in ranks_by_session(&solo) {
        assert!(ranks.iter().all(Option::is_none), "{s}: {ranks:?}");
    }
    // Metrics are per rank.
    let stats = envoy.computeflux_stats();
    for ep in ["gpu-r0", "gpu-r1"] {
        let n = stats
            .get(&format!(
                "wasmcustom.computeflux_requests_total.endpoint.{ep}.outcome.success"
            ))
            .copied()
            .unwrap_or(0);
        assert!(n > 0, "{ep}: {stats:?}");
    }
}

#[test]
fn a_failover_call_to_the_other_rank_carries_its_rank() {
    let gpu = MockUpstream::start("gpu", &[], &two_ranks());
    let plugin = json!({"endpoints": [
        {"name": "gpu", "cluster": "cg", "data_parallel_size": 2}
    ]});
    let envoy = Envoy::start(EnvoyConfig::new(plugin, &[("cg", gpu.port)]));
    gpu.set_fault(json!({"mode": "status", "status": 503, "count": 1}));
    let r = post_chat(
        envoy.port,
        &[("x-session-id", "fo-1"), (RANK, "5")],
        &chat_body("m", &["hello"], Value::Null),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-computeflux-attempts"), Some("2"));
    let last = r.header("x-computeflux-endpoint").unwrap().to_string();
    let seen = gpu.requests();
    assert_eq!(seen.len(), 2, "{seen:?}");
    let rank = |i: usize| seen[i]["headers"][RANK].as_str().map(str::to_string);
    let (first, second) = (rank(0), rank(1));
    assert_eq!(seen[0]["status"], 503);
    assert_eq!(seen[1]["status"], 200);
    // The routed attempt and the failover call: the two ranks, each its endpoint's.
    assert_eq!(second.as_deref(), last.strip_prefix("gpu-r"));
    let both: BTreeSet<Option<String>> = [first, second].into_iter().collect();
    assert_eq!(
        both,
        [Some("0".to_string()), Some("1".to_string())]
            .into_iter()
            .collect()
    );
}

// --- one rank full, the other with room ---------------------------------------------------------

const MODEL: &str = "m1";
/// Slots per rank of the engine-like mock (`--max-concurrency` is per rank, as vLLM's
/// `--max-num-seqs` is per engine core).
const SLOTS: usize = 8;
/// Clients filling rank 0 from elsewhere: its 8 slots and a queue of 6, which saturates it on
/// the rank's own series (entered at 5 waiting, or at `slots / 4 + 1` = 3 once its 8 slots are
/// known); split evenly over the two ranks, rank 1 would read 3 waiting of a queue it does not
/// have (the test checks that each rank's scrape reads its own).
const BACKLOG_CLIENTS: usize = SLOTS + 6;
/// The saturated state's entry: this many requests waiting (`saturation::SaturationRule`).
const SATURATED_WAITING: i64 = 5;
/// Generous limit of every wait (scrapes, queues filling and draining).
const WAIT: std::time::Duration = std::time::Duration::from_secs(15);

/// Waits (≤ [`WAIT`]) until `ok` holds; panics with `what` and the last `state` otherwise.
fn wait_until(what: &str, mut ok: impl FnMut() -> bool, state: impl Fn() -> String) {
    let deadline = std::time::Instant::now() + WAIT;
    while !ok() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not reached in {WAIT:?}; {}",
            state()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Sessions `<prefix>-<n>` whose rendezvous home over the two ranks is `home` under the
/// rendezvous weights in force (`weights`), `count` of them (where the filter places a session
/// without a pin is a pure function of the configuration, the slots the engines showed and the
/// session: `tests/support/placement.rs`).
fn homed(prefix: &str, home: &str, count: usize, weights: &[(&str, f64)]) -> Vec<Session> {
    (0..100_000)
        .map(|n| format!("{prefix}-{home}-{n}"))
        .filter(|id| rendezvous_order(header_session(id), weights)[0] == home)
        .take(count)
        .map(|id| Session::new(id, MODEL))
        .collect()
}

/// One short turn of each session, one after the other.
fn turn(sessions: &mut [Session], port: u16) {
    for s in sessions.iter_mut() {
        s.send_with(0, port, json!({"max_tokens": 8}));
    }
}

/// The sessions whose latest turn was not served by `endpoint` with affinity `affinity`.
fn not_on(sessions: &[Session], endpoint: &str, affinity: &str) -> Vec<String> {
    sessions
        .iter()
        .filter(|s| {
            let t = s.turns.last().unwrap();
            !(t.ok() && t.endpoint() == endpoint && t.affinity() == affinity)
        })
        .map(Session::trail)
        .collect()
}

/// The ranks of `mock`'s load now: (waiting, running) per rank, from `/_mock/stats`.
fn rank_load(mock: &MockUpstream) -> Vec<(u64, u64)> {
    mock.stats()["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["waiting"].as_u64().unwrap(),
                r["running"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// vLLM labels its series by engine index.
#[test]
fn a_full_rank_gets_no_new_sessions_while_the_other_serves_them() {
    a_full_rank_case("vllm");
}

/// SGLang labels them `dp_rank`.
#[test]
fn a_full_sglang_rank_gets_no_new_sessions_either() {
    a_full_rank_case("sglang");
}

/// Saturation per rank, through a real Envoy scraping an engine's page that labels its series
/// by rank (`format`: vLLM's `engine="k"`, SGLang's `dp_rank="k"`). One engine with two ranks,
/// 8 slots each; clients from elsewhere fill rank 0 (8 running, 6 waiting) while rank 1 stays
/// idle. What the design
/// promises (docs/routing.md, Data-parallel ranks; `judge/saturation.rs`):
/// - new sessions homed on the full rank 0 are placed past it, on rank 1 (`backup`), which
///   serves them at once (its own slots, its own queue), and those homed on rank 1 stay home;
/// - sessions already pinned to rank 0 stay (a queue shallower than one batch keeps the pin);
/// - once rank 0 drains, new sessions homed on it reach it again (`home`).
///
/// Split evenly, the engine's queue of 6 would be 3 per rank, under the threshold of 5: rank 0
/// would not be saturated and its new sessions would stay there — this test fails then.
fn a_full_rank_case(format: &str) {
    let slots = SLOTS.to_string();
    let gpu = MockUpstream::start(
        "gpu",
        &[MODEL],
        &[
            "--engine",
            "batched",
            "--data-parallel-size",
            "2",
            "--max-concurrency",
            &slots,
            "--output-tokens",
            "max_tokens",
            "--decode-ms-per-token",
            "3",
            "--prefill-us-per-token",
            "100",
            "--metrics-format",
            format,
        ],
    );
    let plugin = json!({"endpoints": [{"name": "gpu", "cluster": "cg", "data_parallel_size": 2,
        "metrics": {"format": format, "interval_ms": 250, "timeout_ms": 1000}}]});
    let envoy = Envoy::start(EnvoyConfig::new(plugin, &[("cg", gpu.port)]));
    let port = envoy.port;
    let scraped_as = |base: &str, rank: &str| endpoint_stat(&envoy.computeflux_stats(), base, rank);
    let scraped = |rank: &str| scraped_as("computeflux_engine_waiting", rank);
    let state = || {
        format!(
            "scraped (waiting, running) r0 ({}, {}) r1 ({}, {}); engine (waiting, running) per \
             rank {:?}",
            scraped("gpu-r0"),
            scraped_as("computeflux_engine_running", "gpu-r0"),
            scraped("gpu-r1"),
            scraped_as("computeflux_engine_running", "gpu-r1"),
            rank_load(&gpu)
        )
    };
    let mut checks = Checks::new();

    // Both ranks with room: each session at its rendezvous home, rank 0 included.
    wait_until(
        "both ranks scraped",
        || scraped("gpu-r0") >= 0 && scraped("gpu-r1") >= 0,
        state,
    );
    // No rank has queued yet: their slots are unknown and their weights equal.
    let equal = [("gpu-r0", 1.0), ("gpu-r1", 1.0)];
    let mut pinned = homed("pinned", "gpu-r0", 3, &equal);
    let mut before = homed("before", "gpu-r1", 3, &equal);
    turn(&mut pinned, port);
    turn(&mut before, port);
    checks.expect(
        not_on(&pinned, "gpu-r0", "home").is_empty()
            && not_on(&before, "gpu-r1", "home").is_empty(),
        format!(
            "with room everywhere, new sessions at their home: {:?} {:?}",
            not_on(&pinned, "gpu-r0", "home"),
            not_on(&before, "gpu-r1", "home")
        ),
    );

    // Rank 0 fills from elsewhere: 14 clients straight to the engine, rank 0 named.
    let mut backlog = Backlog::start_with(MODEL, gpu.port, &[(RANK, "0")], BACKLOG_CLIENTS, 40, 0);
    wait_until(
        "rank 0 queueing in the engine",
        || rank_load(&gpu)[0].0 >= SATURATED_WAITING as u64,
        state,
    );
    // Then a scrape that saw the queue, however the filter shares it out over the ranks.
    wait_until(
        "the queue scraped",
        || scraped("gpu-r0") + scraped("gpu-r1") >= SATURATED_WAITING,
        state,
    );
    let (r0, r1) = (scraped("gpu-r0"), scraped("gpu-r1"));
    checks.expect(
        r0 >= SATURATED_WAITING && r1 == 0,
        format!("each rank's own queue scraped: r0 {r0} (≥ {SATURATED_WAITING}), r1 {r1} (0)"),
    );
    // Rank 0 queued with its SLOTS running: its slots are known and weigh its place; rank 1
    // never queued and counts as 4 × the most known (ADR 0019).
    let in_force = [("gpu-r0", SLOTS as f64), ("gpu-r1", 4.0 * SLOTS as f64)];
    let mut during = homed("during", "gpu-r0", 6, &in_force);
    let mut r1_home = homed("during", "gpu-r1", 3, &in_force);
    turn(&mut during, port);
    turn(&mut r1_home, port);
    turn(&mut pinned, port);
    let load = rank_load(&gpu);
    checks.expect(
        not_on(&during, "gpu-r1", "backup").is_empty(),
        format!(
            "new sessions homed on the full rank 0 placed past it, on rank 1: {:?}",
            not_on(&during, "gpu-r1", "backup")
        ),
    );
    checks.expect(
        not_on(&r1_home, "gpu-r1", "home").is_empty(),
        format!(
            "new sessions homed on rank 1 at home: {:?}",
            not_on(&r1_home, "gpu-r1", "home")
        ),
    );
    checks.expect(
        not_on(&pinned, "gpu-r0", "hit").is_empty(),
        format!(
            "sessions pinned to rank 0 kept there (a queue under one batch): {:?}",
            not_on(&pinned, "gpu-r0", "hit")
        ),
    );
    checks.expect(
        load[0].0 >= 1,
        format!("rank 0 still queueing after those turns: {load:?}"),
    );
    // What the engine saw: the sessions placed past rank 0 were served by rank 1.
    let served_rank: std::collections::BTreeMap<String, Option<u64>> = gpu
        .requests()
        .iter()
        .filter_map(|r| {
            let s = r["headers"]["x-session-id"].as_str()?;
            Some((s.to_string(), r["rank"].as_u64()))
        })
        .collect();
    let elsewhere: Vec<&String> = during
        .iter()
        .chain(&r1_home)
        .map(|s| &s.id)
        .filter(|id| served_rank.get(*id).copied().flatten() != Some(1))
        .collect();
    checks.expect(
        elsewhere.is_empty(),
        format!("rank 1 of the engine served them: not {elsewhere:?}"),
    );

    // Rank 0 drains: new sessions homed on it reach it again, once a scrape saw it idle (a
    // scrape that still saw its last batch running leaves it without a free slot for the
    // placements this Envoy sends it before the next: `capacity.rs`).
    backlog.halt();
    wait_until(
        "rank 0 drained and scraped idle",
        || {
            rank_load(&gpu)[0] == (0, 0)
                && scraped("gpu-r0") == 0
                && scraped_as("computeflux_engine_running", "gpu-r0") == 0
        },
        state,
    );
    let mut after = homed("after", "gpu-r0", 3, &in_force);
    turn(&mut after, port);
    checks.expect(
        not_on(&after, "gpu-r0", "home").is_empty(),
        format!(
            "once rank 0 drained, new sessions homed on it at home: {:?}",
            not_on(&after, "gpu-r0", "home")
        ),
    );
    eprintln!(
        "backlog requests sent to rank 0: {}; {}",
        backlog.sent(),
        state()
    );
    let crashes = envoy.wasm_crashes();
    checks.expect(crashes.is_empty(), format!("wasm crashes: {crashes:?}"));
    checks.finish();
}
