//! The relief of the last server of a model (the bench's `slow` tail) through a real Envoy in front of
//! engine-like mocks that publish their queue on `/metrics`.
//!
//! Why: the rule is unit-tested on a fake store with hand-written verdicts and loads
//! (`select/tests.rs`); only through Envoy does it meet a slowness verdict formed from real
//! answers, a load scraped on a timer and the per-model candidate lists of a configuration.
//!
//! The fleet is the bench's `slow` one in small: `a` and `b` serve `m1` and `m2`, `c` and `d`
//! serve `m1` only. Once `a` is 5× slower (the mock's `slow` fault) and degraded, `b` is the last
//! healthy server of `m2` and takes every `m2` session; the rule keeps new `m1` sessions (which
//! `c` and `d` can take) off it. To make the rule's load condition certain rather than a coin,
//! `b` carries a few requests from elsewhere (clients sending straight to the mock, seen by the
//! filter only in the scraped `/metrics`), while `c` and `d` are idle.
//!
//! What must hold (each test prints its figures):
//! 1. Before anything is degraded, new `m1` sessions homed on `b` go to `b`, its load
//!    notwithstanding (the rule never acts without a degraded endpoint).
//! 2. With `a` degraded: new `m1` sessions homed on `b` (rendezvous order over the
//!    configuration) are placed on `c` or `d`, labelled `saturated`; new `m2` sessions still go
//!    to `b`, the only healthy server of `m2`.
//!
//! (The rule is always on: its comparison with the rule off was measured on the bench's `slow`
//! run, see `docs/routing.md`, "Judging endpoints"; item 1 shows the setup alone does not
//! steer them.)

// Test code: failing loudly with context is the point.
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

use crate::support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::envoy::{decisions, endpoint_stat, Stats};
use support::http::{request, try_post_chat};
use support::placement::{header_session, rendezvous_order};
use support::session::{H_AFFINITY, H_ENDPOINT, H_SESSION};
use support::{for_each_parallel, tally, Checks, Envoy, EnvoyConfig, MockUpstream};

/// `(name, served models)`: the bench's `slow` fleet.
const FLEET: [(&str, &[&str]); 4] = [
    ("a", &["m1", "m2"]),
    ("b", &["m1", "m2"]),
    ("c", &["m1"]),
    ("d", &["m1"]),
];
/// Equal configured weights: placement is rendezvous over these alone.
const WEIGHTS: [(&str, f64); 4] = [("a", 1.0), ("b", 1.0), ("c", 1.0), ("d", 1.0)];
/// Requests `b` carries from elsewhere during the placements: its scraped running count, above
/// the idle `c` and `d`.
const ELSEWHERE_CLIENTS: usize = 4;
/// New sessions of each kind placed per phase, one at a time (so that the test's own requests
/// never make `c` or `d` as loaded as `b`).
const NEW_SESSIONS: usize = 8;
const CLIENTS: usize = 4;
/// Generous limit of every eventually-style wait (scrapes, the verdict).
const WAIT: Duration = Duration::from_secs(20);

/// The filter's configuration: every endpoint with its `models` and scraped every 250 ms;
/// probes of the degraded endpoint rare (new sessions homed elsewhere never need one).
fn plugin() -> Value {
    let endpoints: Vec<Value> = FLEET
        .iter()
        .map(|(n, models)| {
            json!({"name": n, "cluster": n, "models": models,
                   "metrics": {"format": "vllm", "interval_ms": 250, "timeout_ms": 1000}})
        })
        .collect();
    json!({
        "endpoints": endpoints,
        "cold_start_samples": 5,
        "tuning": {"degraded_probe_interval_ms": 10_000, "degraded_probe_max_interval_ms": 20_000},
    })
}

/// Clients sending plain requests straight to one engine until dropped: its running count
/// rises, and Envoy learns of it only from the engine's `/metrics`.
struct Elsewhere {
    stop: Arc<AtomicBool>,
    clients: Vec<JoinHandle<()>>,
}

impl Elsewhere {
    fn start(port: u16, clients: usize) -> Elsewhere {
        let stop = Arc::new(AtomicBool::new(false));
        let clients = (0..clients)
            .map(|k| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut n = 0u64;
                    while !stop.load(Ordering::SeqCst) {
                        n += 1;
                        let body = json!({"model": "m1", "max_tokens": 150,
                            "messages": [{"role": "user", "content": format!("elsewhere {k} {n}")}]})
                        .to_string();
                        let r = request(
                            port,
                            "POST",
                            "/v1/chat/completions",
                            &[],
                            Some(body.as_bytes()),
                            Duration::from_secs(30),
                        );
                        if r.is_err() {
                            std::thread::sleep(Duration::from_millis(50));
                        }
                    }
                })
            })
            .collect();
        Elsewhere { stop, clients }
    }
}

impl Drop for Elsewhere {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for c in self.clients.drain(..) {
            let _ = c.join();
        }
    }
}

/// Waits (≤ [`WAIT`]) until `f` holds on the stats; panics with the engines' stats otherwise.
fn wait_for(envoy: &Envoy, what: &str, f: impl Fn(&Stats) -> bool) {
    let deadline = Instant::now() + WAIT;
    loop {
        let s = envoy.computeflux_stats();
        if f(&s) {
            return;
        }
        if Instant::now() > deadline {
            let shown: Stats = s
                .into_iter()
                .filter(|(k, _)| {
                    k.contains("engine_") || k.contains("degraded") || k.contains("slowness")
                })
                .collect();
            panic!("{what}: not reached in {WAIT:?}; stats: {shown:#?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One turn's answer.
#[derive(Clone, Debug)]
struct Reply {
    status: u16,
    endpoint: String,
    served_by: String,
    affinity: String,
}

/// A conversation of `model` with a session id, replaying its history on every turn.
#[derive(Clone, Debug)]
struct Chat {
    id: String,
    model: &'static str,
    users: Vec<String>,
    replies: Vec<Reply>,
}

impl Chat {
    fn new(id: String, model: &'static str) -> Chat {
        Chat {
            id,
            model,
            users: Vec::new(),
            replies: Vec::new(),
        }
    }

    /// The next turn, streamed, 48 output tokens (a decode phase of ~144 ms that the filter
    /// judges against the fleet's pace).
    fn send(&mut self, port: u16) -> &Reply {
        let mut text = format!("session {} turn {}: ", self.id, self.users.len());
        while text.len() < 240 {
            text.push_str("the quick brown fox jumps over the lazy dog; ");
        }
        self.users.push(text);
        let mut messages = Vec::new();
        for (i, u) in self.users.iter().enumerate() {
            if i > 0 {
                messages.push(json!({"role": "assistant", "content": format!("reply {i}")}));
            }
            messages.push(json!({"role": "user", "content": u}));
        }
        let body = json!({"model": self.model, "messages": messages, "stream": true,
                          "max_tokens": 48});
        let reply = match try_post_chat(port, &[(H_SESSION, &self.id)], &body.to_string()) {
            Ok(r) => Reply {
                status: r.status,
                endpoint: r.header(H_ENDPOINT).unwrap_or("-").to_string(),
                served_by: r.header("x-mock-endpoint").unwrap_or("-").to_string(),
                affinity: r.header(H_AFFINITY).unwrap_or("-").to_string(),
            },
            Err(e) => Reply {
                status: 0,
                endpoint: "-".into(),
                served_by: format!("error: {e}"),
                affinity: "-".into(),
            },
        };
        self.replies.push(reply);
        self.replies.last().unwrap()
    }

    fn trail(&self) -> String {
        let turns: Vec<String> = self
            .replies
            .iter()
            .map(|r| format!("{}/{}/{}", r.status, r.endpoint, r.affinity))
            .collect();
        format!("{} {} [{}]", self.id, self.model, turns.join(" "))
    }
}

fn failed(chats: &[Chat]) -> Vec<String> {
    chats
        .iter()
        .filter(|c| {
            c.replies
                .iter()
                .any(|r| r.status != 200 || r.endpoint != r.served_by)
        })
        .map(Chat::trail)
        .collect()
}

/// `count` chats of `model` named `<prefix>-<n>` whose rendezvous order over the endpoints
/// serving `model` starts with `home` — where the filter places them without a pin, a pure
/// function of the configuration and the session (`tests/support/placement.rs`).
fn homed(prefix: &str, model: &'static str, home: &str, count: usize) -> Vec<Chat> {
    let serving: Vec<(&str, f64)> = WEIGHTS
        .iter()
        .copied()
        .filter(|(n, _)| FLEET.iter().any(|(f, ms)| f == n && ms.contains(&model)))
        .collect();
    let mut out = Vec::new();
    let mut n = 0u64;
    while out.len() < count {
        let id = format!("{prefix}-{n}");
        n += 1;
        if rendezvous_order(header_session(&id), &serving)[0] == home {
            out.push(Chat::new(id, model));
        }
        assert!(n < 100_000, "no session of {model} homed on {home}");
    }
    out
}

/// First turns of `chats`, one at a time (each session's placement sees the others' load
/// only as the idle `c` and `d` carry it: at most one request).
fn place(port: u16, chats: &mut [Chat]) -> BTreeMap<String, usize> {
    for c in chats.iter_mut() {
        c.send(port);
    }
    tally(chats.iter().map(|c| c.replies[0].endpoint.clone()))
}

/// What one run measured.
struct Run {
    /// Before any endpoint is degraded: where new `m1` sessions homed on `b` went.
    before: BTreeMap<String, usize>,
    /// With `a` degraded: where new `m1` sessions homed on `b` went, and `m2` sessions.
    m1_after: BTreeMap<String, usize>,
    m2_after: BTreeMap<String, usize>,
    /// `saturated` decisions during the placements with `a` degraded.
    saturated: i64,
    /// `m1` sessions placed with `a` degraded, with their trails (for the messages).
    trails: Vec<String>,
    failed: Vec<String>,
    crashes: Vec<String>,
}

/// The scenario, with the rule on or off: warm-up, `b` loaded from elsewhere, new `m1`
/// sessions homed on `b`; then `a` slowed until degraded, and new `m1` and `m2` sessions.
fn run() -> Run {
    let mocks: Vec<MockUpstream> = FLEET
        .iter()
        .map(|(n, ms)| MockUpstream::paced_engine(n, ms))
        .collect();
    let clusters: Vec<(&str, u16)> = mocks.iter().map(|m| (m.name.as_str(), m.port)).collect();
    let envoy = Envoy::start(EnvoyConfig::new(plugin(), &clusters));
    let port = envoy.port;
    let mock = |name: &str| mocks.iter().find(|m| m.name == name).unwrap();

    // Warm-up: four `m1` sessions homed on each endpoint, three turns each (the work model and
    // every endpoint warm, `a` among its `m1` peers).
    let mut warm: Vec<Chat> = ["a", "b", "c", "d"]
        .iter()
        .flat_map(|h| homed(&format!("warm-{h}"), "m1", h, 4))
        .collect();
    for _ in 0..3 {
        for_each_parallel(&mut warm, CLIENTS, |_, c| {
            c.send(port);
        });
    }
    let mut all_failed = failed(&warm);

    // `b` carries requests from elsewhere; the filter sees them once scraped.
    let elsewhere = Elsewhere::start(mock("b").port, ELSEWHERE_CLIENTS);
    wait_for(&envoy, "b's load from elsewhere scraped", |s| {
        endpoint_stat(s, "computeflux_engine_running", "b") >= ELSEWHERE_CLIENTS as i64 - 1
    });
    let mut before = homed("before", "m1", "b", NEW_SESSIONS);
    let before_spread = place(port, &mut before);
    all_failed.extend(failed(&before));

    // `a` 5× slower: the sessions homed on it keep sending turns until it is degraded.
    mock("a").set_fault(json!({"mode": "slow", "factor": 5}));
    let mut on_a: Vec<Chat> = warm
        .iter()
        .filter(|c| c.id.starts_with("warm-a-"))
        .cloned()
        .collect();
    let deadline = Instant::now() + WAIT;
    while endpoint_stat(&envoy.computeflux_stats(), "computeflux_degraded", "a") != 1 {
        assert!(
            Instant::now() < deadline,
            "a not degraded in {WAIT:?}: {:?}",
            on_a.iter().map(Chat::trail).collect::<Vec<_>>()
        );
        for_each_parallel(&mut on_a, CLIENTS, |_, c| {
            c.send(port);
        });
    }
    wait_for(&envoy, "b's load from elsewhere still scraped", |s| {
        endpoint_stat(s, "computeflux_engine_running", "b") >= ELSEWHERE_CLIENTS as i64 - 1
    });
    let saturated_before = decisions(&envoy.computeflux_stats(), "saturated");
    let mut m1 = homed("m1-after", "m1", "b", NEW_SESSIONS);
    let m1_after = place(port, &mut m1);
    // `m2` sessions homed on `b` (one homed on `a` could be its probe).
    let mut m2 = homed("m2-after", "m2", "b", NEW_SESSIONS);
    let m2_after = place(port, &mut m2);
    let s = envoy.computeflux_stats();
    drop(elsewhere);
    all_failed.extend(failed(&m1));
    all_failed.extend(failed(&m2));
    eprintln!(
        "slowness ‰ a {} b {} c {} d {}; running b {} c {} d {}",
        endpoint_stat(&s, "computeflux_slowness_permille", "a"),
        endpoint_stat(&s, "computeflux_slowness_permille", "b"),
        endpoint_stat(&s, "computeflux_slowness_permille", "c"),
        endpoint_stat(&s, "computeflux_slowness_permille", "d"),
        endpoint_stat(&s, "computeflux_engine_running", "b"),
        endpoint_stat(&s, "computeflux_engine_running", "c"),
        endpoint_stat(&s, "computeflux_engine_running", "d"),
    );
    Run {
        before: before_spread,
        m1_after,
        m2_after,
        saturated: decisions(&s, "saturated") - saturated_before,
        trails: m1.iter().map(Chat::trail).collect(),
        failed: all_failed,
        crashes: envoy.wasm_crashes(),
    }
}

fn on(spread: &BTreeMap<String, usize>, endpoint: &str) -> usize {
    spread.get(endpoint).copied().unwrap_or(0)
}

/// Common to both runs: no failed turn, no wasm crash, and before `a` slowed every new `m1`
/// session homed on the loaded `b` went to `b` (nothing degraded: the rule does not act).
fn expect_common(checks: &mut Checks, r: &Run) {
    checks.expect(
        r.failed.is_empty() && r.crashes.is_empty(),
        format!("failed turns {:?}; wasm crashes {:?}", r.failed, r.crashes),
    );
    checks.expect(
        on(&r.before, "b") == NEW_SESSIONS,
        format!(
            "before anything is degraded, new m1 sessions homed on the loaded b go to b: {:?}",
            r.before
        ),
    );
    checks.expect(
        on(&r.m2_after, "b") == NEW_SESSIONS,
        format!(
            "with a degraded, new m2 sessions go to b, the last healthy server of m2: {:?}",
            r.m2_after
        ),
    );
}

/// With `a` degraded, `b` is the last server of `m2`: new `m1` sessions homed on `b` are placed
/// on `c` or `d` (`saturated`), while `m2` sessions still reach `b`.
#[test]
fn a_new_session_passes_over_the_last_server_of_another_model() {
    let r = run();
    let mut checks = Checks::new();
    expect_common(&mut checks, &r);
    checks.expect(
        on(&r.m1_after, "b") == 0 && on(&r.m1_after, "c") + on(&r.m1_after, "d") == NEW_SESSIONS,
        format!(
            "with a degraded, new m1 sessions homed on b go to c or d: {:?}; {:?}",
            r.m1_after, r.trails
        ),
    );
    checks.expect(
        r.saturated >= NEW_SESSIONS as i64,
        format!(
            "decisions `saturated` while placing them: {} (>= {NEW_SESSIONS})",
            r.saturated
        ),
    );
    checks.finish();
}
