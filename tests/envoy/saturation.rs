//! Issue 23's rules about *full* and *slow* engines, through real Envoy processes in front of
//! engine-like mocks (`mock_upstream --engine batched`: slots, a FIFO queue, decode paced per
//! token, and a vLLM `/metrics` page with the actual queue, which the filter scrapes).
//!
//! Why: the rules (`select/choose.rs`, `capacity.rs`, `saturation.rs`, `slowness.rs`,
//! `signals.rs`) are unit-tested on a fake store with hand-written loads; only through Envoy
//! do they meet a real scrape on a timer, answers that really queue, streams whose decode phase
//! is timed by the filter, several worker VMs and replicas that share nothing.
//!
//! How an engine is made full: a [`Backlog`] of clients sends requests *straight to the mock*,
//! not through Envoy (another gateway's traffic, as it were): the engine's slots fill and its
//! queue grows, Envoy sees it only in the scraped `/metrics`, and turns routed there really wait.
//! How one is made slow: the mock's `slow` fault (prefill and decode 5× slower).
//!
//! What must hold (each test prints its figures):
//! 1. A full engine gets no new sessions while others have room, its pinned sessions stay
//!    (a saturated engine's pins never move) and it is never degraded nor its pins broken,
//!    although its answers wait in its queue; an engine whose streams decode 5× slower is
//!    degraded and its pins break (`pin_break`).
//! 2. With every engine's slots known from scraping, a 4-slot engine takes at most its slots of
//!    a herd of new sessions homed on it; a 16-slot engine takes the rest.
//! 3. A later turn (≥ 3 messages) reaching a replica that holds no pin for it passes over a
//!    full home as a first turn (1–2 messages) does: both go elsewhere, as the session's first
//!    turn did on whichever replica served it while the home was full.
//! 4. Replicas place new sessions alike while the engines' load changes: homes are weighted
//!    rendezvous on the configuration alone, and a saturated engine (seen by every replica's own
//!    scrape) is skipped by all of them for the next endpoint of the same order.

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
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::envoy::{decisions, endpoint_stat, Stats};
use support::http::{request, try_post_chat};
use support::placement::{header_session, rendezvous_order};
use support::session::{H_AFFINITY, H_ENDPOINT, H_SESSION};
use support::{
    for_each_parallel, tally, Backlog, Checks, Envoy, EnvoyConfig, MockUpstream, Replicas,
};

const MODEL: &str = "m1";
/// Decode time per output token of every engine, ms (the batched model's base rate).
const DECODE_MS_PER_TOKEN: &str = "3";
/// Prefill time per uncached prompt token, µs: a turn's ~70 new tokens take ~70 ms, so that a
/// 5× slower engine's excess is well above `pin_break_min_ms` (50 ms) per request.
const PREFILL_US_PER_TOKEN: &str = "1000";
/// Every engine's `metrics` object: scraped every 250 ms. A load is trusted for 3 intervals
/// plus the timeout after its scrape (1.75 s here): a generous margin for a busy machine's late
/// timers.
fn scrape() -> Value {
    json!({"format": "vllm", "interval_ms": 250, "timeout_ms": 1000})
}
/// The saturated state's entry: this many requests waiting (`saturation::SaturationRule`).
const SATURATED_WAITING: i64 = 5;
/// Generous limit of every eventually-style wait (scrapes, queues filling and draining).
const WAIT: Duration = Duration::from_secs(15);

// --- engines, load and the filter's configuration ---------------------------------------------

/// An engine-like mock serving [`MODEL`] with `slots` slots; `extra` flags appended.
fn engine(name: &str, slots: u32, extra: &[&str]) -> MockUpstream {
    let slots = slots.to_string();
    let mut args = vec![
        "--engine",
        "batched",
        "--max-concurrency",
        &slots,
        "--output-tokens",
        "max_tokens",
        "--decode-ms-per-token",
        DECODE_MS_PER_TOKEN,
        "--prefill-us-per-token",
        PREFILL_US_PER_TOKEN,
    ];
    args.extend_from_slice(extra);
    MockUpstream::start(name, &[MODEL], &args)
}

/// The filter's configuration: one endpoint per `(name, weight)`, cluster of the same name,
/// scraped every 250 ms; `extra` keys merged in.
fn plugin(weights: &[(&str, f64)], extra: Value) -> Value {
    let endpoints: Vec<Value> = weights
        .iter()
        .map(|(n, w)| json!({"name": n, "cluster": n, "weight": w, "metrics": scrape()}))
        .collect();
    let mut p = json!({"endpoints": endpoints, "cold_start_samples": 5});
    if let (Some(p), Value::Object(more)) = (p.as_object_mut(), extra) {
        p.extend(more);
    }
    p
}

fn config(mocks: &[MockUpstream], weights: &[(&str, f64)], extra: Value) -> EnvoyConfig {
    let clusters: Vec<(&str, u16)> = mocks.iter().map(|m| (m.name.as_str(), m.port)).collect();
    EnvoyConfig::new(plugin(weights, extra), &clusters)
}

fn mock<'a>(mocks: &'a [MockUpstream], name: &str) -> &'a MockUpstream {
    mocks.iter().find(|m| m.name == name).unwrap()
}

// --- the filter's stats -------------------------------------------------------------------------

/// Every `wasmcustom.computeflux_*` counter and gauge of `envoy`'s `/stats`, by name.
fn stats(envoy: &Envoy) -> Stats {
    envoy.computeflux_stats()
}

/// Waits (≤ [`WAIT`]) until `f` holds on every envoy's stats; panics with them otherwise.
fn wait_all(envoys: &[Envoy], what: &str, f: impl Fn(&Stats) -> bool) {
    let deadline = Instant::now() + WAIT;
    loop {
        let all: Vec<Stats> = envoys.iter().map(stats).collect();
        if all.iter().all(&f) {
            return;
        }
        if Instant::now() > deadline {
            let engine: Vec<Stats> = all
                .into_iter()
                .map(|s| {
                    s.into_iter()
                        .filter(|(k, _)| k.contains("engine_") || k.contains("scrape"))
                        .collect()
                })
                .collect();
            panic!("{what}: not reached in {WAIT:?}; scraped stats per Envoy: {engine:#?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn no_crash(checks: &mut Checks, envoys: &[Envoy]) {
    let crashes: Vec<String> = envoys.iter().flat_map(Envoy::wasm_crashes).collect();
    checks.expect(
        crashes.is_empty(),
        format!("wasm panics / VM failures: {crashes:?}"),
    );
}

// --- client conversations -----------------------------------------------------------------------

/// What one turn got back.
#[derive(Clone, Debug)]
struct Reply {
    status: u16,
    /// `x-computeflux-endpoint` (the filter's choice).
    endpoint: String,
    /// `x-mock-endpoint` (the engine that answered).
    served_by: String,
    /// `x-computeflux-affinity`.
    affinity: String,
    ttfb: Duration,
}

impl Reply {
    fn ok(&self) -> bool {
        self.status == 200 && self.endpoint == self.served_by
    }
}

/// One client conversation with a session id (`x-session-id`), replaying its history on every
/// turn as chat clients do (the engine's prefix cache sees the earlier turns).
#[derive(Clone, Debug)]
struct Chat {
    id: String,
    /// The session's rendezvous home over the test's configured weights.
    home: String,
    users: Vec<String>,
    replies: Vec<Reply>,
}

impl Chat {
    fn new(id: String, home: &str) -> Chat {
        Chat {
            id,
            home: home.to_string(),
            users: Vec::new(),
            replies: Vec::new(),
        }
    }

    /// The next turn through `127.0.0.1:port`: the earlier turns (with an assistant reply
    /// between two user turns) and a new user message; `extra` keys added to the body.
    fn send(&mut self, port: u16, extra: &Value) -> &Reply {
        let head = format!("session {} turn {}: ", self.id, self.users.len());
        let mut text = head;
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
        let r = post(port, &self.id, messages, extra);
        self.replies.push(r);
        self.replies.last().unwrap()
    }

    /// Endpoints of the replies from turn `from` on.
    fn served_from(&self, from: usize) -> Vec<&str> {
        self.replies[from..]
            .iter()
            .map(|r| r.endpoint.as_str())
            .collect()
    }

    fn trail(&self) -> String {
        let turns: Vec<String> = self
            .replies
            .iter()
            .map(|r| format!("{}/{}/{}", r.status, r.endpoint, r.affinity))
            .collect();
        format!("{} (home {}) [{}]", self.id, self.home, turns.join(" "))
    }
}

/// One chat request of session `id` with `messages` (and `extra` body keys).
fn post(port: u16, id: &str, messages: Vec<Value>, extra: &Value) -> Reply {
    let mut body = json!({"model": MODEL, "messages": messages});
    if let (Some(b), Value::Object(more)) = (body.as_object_mut(), extra) {
        b.extend(more.clone());
    }
    match try_post_chat(port, &[(H_SESSION, id)], &body.to_string()) {
        Ok(r) => Reply {
            status: r.status,
            endpoint: r.header(H_ENDPOINT).unwrap_or("-").to_string(),
            served_by: r.header("x-mock-endpoint").unwrap_or("-").to_string(),
            affinity: r.header(H_AFFINITY).unwrap_or("-").to_string(),
            ttfb: r.ttfb,
        },
        Err(e) => Reply {
            status: 0,
            endpoint: "-".into(),
            served_by: format!("error: {e}"),
            affinity: "-".into(),
            ttfb: Duration::ZERO,
        },
    }
}

/// Chats `<prefix>-<n>` whose rendezvous home over `weights` is as wanted: `count` of each
/// `(home, count)`, in that order. Where the filter places a session without a pin is a pure
/// function of the configuration and the session (see `tests/support/placement.rs`), so the
/// test knows each session's home in advance instead of relying on chance.
fn homed(prefix: &str, weights: &[(&str, f64)], want: &[(&str, usize)]) -> Vec<Chat> {
    let mut out = Vec::new();
    for (home, count) in want {
        let mut found = 0;
        let mut n = 0u64;
        while found < *count {
            let id = format!("{prefix}-{home}-{n}");
            n += 1;
            if rendezvous_order(header_session(&id), weights)[0] == *home {
                out.push(Chat::new(id, home));
                found += 1;
            }
            assert!(n < 100_000, "no session homed on {home}");
        }
    }
    out
}

/// The first endpoint of `id`'s rendezvous order over `weights` that is not in `skip`.
fn first_but(id: &str, weights: &[(&str, f64)], skip: &[&str]) -> String {
    rendezvous_order(header_session(id), weights)
        .into_iter()
        .find(|e| !skip.contains(e))
        .unwrap()
        .to_string()
}

/// The chats homed on `home`.
fn homed_on<'a>(chats: &'a [Chat], home: &'a str) -> impl Iterator<Item = &'a Chat> {
    chats.iter().filter(move |c| c.home == home)
}

fn failed(chats: &[Chat]) -> Vec<String> {
    chats
        .iter()
        .filter(|c| c.replies.iter().any(|r| !r.ok()))
        .map(Chat::trail)
        .collect()
}

/// Median first-byte time of `replies`, ms.
fn median_ttfb_ms<'a>(replies: impl Iterator<Item = &'a Reply>) -> u128 {
    let mut v: Vec<u128> = replies.map(|r| r.ttfb.as_millis()).collect();
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

// --- 1. saturated vs degraded -------------------------------------------------------------------

/// Streamed turns of 48 output tokens: a decode phase of ~144 ms (720 ms when 5× slower) that
/// the filter judges against the fleet's decode rate.
fn streamed() -> Value {
    json!({"stream": true, "max_tokens": 48})
}

const CLIENTS: usize = 8;
/// Turns of every pinned session once `a` is full and `b` slow.
const TURNS_AFTER: usize = 5;
/// A session pinned to the slow engine is served elsewhere by this turn after the slowdown.
const MAX_TURNS_TO_MOVE: usize = 3;
const PROBE_INTERVAL_MS: u64 = 1000;

/// A full engine (`a`: 8 slots, a queue of ~6 from elsewhere) and a slow one (`b`: every
/// request 5× slower) in one fleet with two healthy ones: `a` keeps every pinned session
/// (`hit`), gets no new session, is never degraded and none of its pins is broken, although
/// its turns wait in its queue; `b`'s pinned sessions move within a few turns (`pin_break`),
/// `b` is degraded and gets new sessions only as probes.
#[test]
fn a_full_engine_keeps_its_pins_while_a_slow_one_loses_them() {
    let weights = [("a", 1.0), ("b", 1.0), ("c", 1.0), ("d", 1.0)];
    let mocks = vec![
        // As many slots as the test's clients: the test's own turns never make it queue (a
        // queue seen at a scrape tells the filter its slots, and it is full at those).
        engine("a", CLIENTS as u32, &[]),
        engine("b", 16, &[]),
        engine("c", 16, &[]),
        engine("d", 16, &[]),
    ];
    let envoy = Envoy::start(config(
        &mocks,
        &weights,
        json!({"tuning": {"degraded_probe_interval_ms": PROBE_INTERVAL_MS,
               "degraded_probe_max_interval_ms": 4 * PROBE_INTERVAL_MS}}),
    ));
    let port = envoy.port;
    let mut checks = Checks::new();

    // Phase 1: six sessions homed on each engine, three streamed turns each (72 answers with
    // `usage`: the work model and every endpoint warm).
    let mut chats = homed(
        "pinned",
        &weights,
        &[("a", 6), ("b", 6), ("c", 6), ("d", 6)],
    );
    let round = |chats: &mut [Chat]| {
        for_each_parallel(chats, CLIENTS, |_, c| {
            c.send(port, &streamed());
        });
    };
    for _ in 0..3 {
        round(&mut chats);
    }
    let not_home: Vec<String> = chats
        .iter()
        .filter(|c| c.served_from(0).iter().any(|e| *e != c.home))
        .map(Chat::trail)
        .collect();
    checks.expect(
        failed(&chats).is_empty() && not_home.is_empty(),
        format!(
            "warm-up: every turn on its home; failed {:?}, elsewhere {not_home:?}",
            failed(&chats)
        ),
    );

    // Phase 2: `a` fills up from elsewhere (8 slots, 14 clients), `b` turns 5× slower.
    let backlog = Backlog::start(MODEL, mock(&mocks, "a").port, CLIENTS + 6, 40, 0);
    mock(&mocks, "b").set_fault(json!({"mode": "slow", "factor": 5}));
    wait_all(std::slice::from_ref(&envoy), "a's queue scraped", |s| {
        endpoint_stat(s, "computeflux_engine_waiting", "a") >= SATURATED_WAITING
    });
    let before = chats[0].replies.len();
    for _ in 0..TURNS_AFTER {
        round(&mut chats);
    }
    let after = stats(&envoy);
    checks.expect(
        failed(&chats).is_empty(),
        format!(
            "turns after a filled and b slowed: failed {:?}",
            failed(&chats)
        ),
    );
    let on = |home: &'static str| homed_on(&chats, home);
    // a: every turn a hit on a.
    let a_stayed = on("a")
        .filter(|c| {
            c.replies[before..]
                .iter()
                .all(|r| r.endpoint == "a" && r.affinity == "hit")
        })
        .count();
    let a_ttfb = median_ttfb_ms(on("a").flat_map(|c| c.replies[before..].iter()));
    let cd_ttfb = median_ttfb_ms(
        on("c")
            .chain(on("d"))
            .flat_map(|c| c.replies[before..].iter()),
    );
    checks.expect(
        a_stayed == 6,
        format!(
            "sessions pinned to the full a served by a (hit) on every turn: {a_stayed}/6; \
             median first byte of their turns {a_ttfb} ms (c and d: {cd_ttfb} ms); {:?}",
            on("a").map(Chat::trail).collect::<Vec<_>>()
        ),
    );
    // b: moved within a few turns by a pin break, never back, never to the full a.
    let mut b_moved = 0;
    for c in on("b") {
        let turns = &c.replies[before..];
        let stuck = turns.iter().take_while(|r| r.endpoint == "b").count();
        let moved = stuck < MAX_TURNS_TO_MOVE
            && turns[stuck].affinity == "pin_break"
            && turns[stuck..]
                .iter()
                .all(|r| r.endpoint != "b" && r.endpoint != "a");
        b_moved += usize::from(moved);
    }
    checks.expect(
        b_moved == 6,
        format!(
            "sessions pinned to the slow b moved by a pin_break within {MAX_TURNS_TO_MOVE} \
             turns, never back nor to a: {b_moved}/6; {:?}",
            on("b").map(Chat::trail).collect::<Vec<_>>()
        ),
    );
    let cd_stayed = on("c")
        .chain(on("d"))
        .filter(|c| c.served_from(before).iter().all(|e| *e == c.home))
        .count();
    checks.expect(
        cd_stayed == 12,
        format!("sessions pinned to c and d stayed: {cd_stayed}/12"),
    );
    checks.expect(
        endpoint_stat(&after, "computeflux_engine_waiting", "a") >= 1,
        format!(
            "a still queued at the end of the phase (scraped waiting {})",
            endpoint_stat(&after, "computeflux_engine_waiting", "a")
        ),
    );

    // Phase 3: new sessions, ten homed on a, five on each of the others. Homes by the
    // rendezvous weights in force: a's slots are known (its queue showed CLIENTS running), the
    // others never queued and count as 4 × the most known (ADR 0019).
    let known = CLIENTS as f64;
    let in_force = [
        ("a", known),
        ("b", 4.0 * known),
        ("c", 4.0 * known),
        ("d", 4.0 * known),
    ];
    let mut fresh = homed("new", &in_force, &[("a", 10), ("b", 5), ("c", 5), ("d", 5)]);
    let started = Instant::now();
    for_each_parallel(&mut fresh, CLIENTS, |_, c| {
        c.send(port, &streamed());
    });
    let took = started.elapsed();
    let spread = tally(fresh.iter().map(|c| c.replies[0].endpoint.clone()));
    let probes_allowed = (took.as_millis() as u64).div_ceil(PROBE_INTERVAL_MS) as usize + 1;
    checks.expect(
        failed(&fresh).is_empty(),
        format!("new sessions: failed {:?}", failed(&fresh)),
    );
    checks.expect(
        !spread.contains_key("a"),
        format!("new sessions on the full a: none expected; spread {spread:?}"),
    );
    let a_homed_backup = fresh
        .iter()
        .filter(|c| c.home == "a" && c.replies[0].affinity == "backup")
        .count();
    checks.expect(
        a_homed_backup == 10,
        format!("new sessions homed on a placed past it (affinity backup): {a_homed_backup}/10"),
    );
    let on_b = spread.get("b").copied().unwrap_or(0);
    checks.expect(
        on_b <= probes_allowed,
        format!(
            "new sessions on the degraded b: {on_b} (probes allowed in {took:?}: {probes_allowed})"
        ),
    );

    // The filter's own account.
    let s = stats(&envoy);
    let g = |base: &str, e: &str| endpoint_stat(&s, base, e);
    eprintln!(
        "slowness ‰ a {} b {} c {} d {}; decisions {:?}",
        g("computeflux_slowness_permille", "a"),
        g("computeflux_slowness_permille", "b"),
        g("computeflux_slowness_permille", "c"),
        g("computeflux_slowness_permille", "d"),
        s.iter()
            .filter(|(k, v)| k.contains("decisions_total") && **v > 0)
            .collect::<Vec<_>>()
    );
    checks.expect(
        g("computeflux_pin_breaks_total", "a") == 0 && g("computeflux_degraded", "a") == 0,
        format!(
            "the full a: pin breaks {} (0 expected), degraded gauge {} (0 expected)",
            g("computeflux_pin_breaks_total", "a"),
            g("computeflux_degraded", "a")
        ),
    );
    checks.expect(
        g("computeflux_saturated", "a") == 1,
        format!(
            "the full a is saturated: gauge {}",
            g("computeflux_saturated", "a")
        ),
    );
    checks.expect(
        g("computeflux_pin_breaks_total", "b") >= 6 && g("computeflux_degraded", "b") == 1,
        format!(
            "the slow b: pin breaks {} (>= 6 expected), degraded gauge {} (1 expected)",
            g("computeflux_pin_breaks_total", "b"),
            g("computeflux_degraded", "b")
        ),
    );
    // A placement that passes a degraded endpoint says `degraded` even if it passed a saturated
    // one too: the new sessions homed on a whose next endpoint is b say `degraded`.
    let second_b = fresh
        .iter()
        .filter(|c| c.home == "a" && first_but(&c.id, &in_force, &["a"]) == "b")
        .count();
    checks.expect(
        decisions(&s, "saturated") >= (10 - second_b) as i64,
        format!(
            "decisions passing the saturated a: {} (>= {}: the new sessions homed on a, but \
             the {second_b} whose next endpoint is b)",
            decisions(&s, "saturated"),
            10 - second_b
        ),
    );
    checks.expect(
        decisions(&s, "pin_break") >= 6
            && decisions(&s, "degraded") + decisions(&s, "degraded_probe") >= (5 + second_b) as i64,
        format!(
            "decisions pin_break {} (>= 6), degraded + degraded_probe {} (>= {}: the new \
             sessions homed on b, or on a with b next)",
            decisions(&s, "pin_break"),
            decisions(&s, "degraded") + decisions(&s, "degraded_probe"),
            5 + second_b
        ),
    );
    eprintln!("backlog requests sent to a: {}", backlog.sent());
    drop(backlog);
    no_crash(&mut checks, std::slice::from_ref(&envoy));
    checks.finish();
}

// --- 2. capacity by slots -----------------------------------------------------------------------

/// A herd of 18 new sessions at once, 12 of them homed on the 4-slot `s`, 6 on the 16-slot `l`
/// (by weight × slots), after both engines were seen queueing (their slots known) and drained: `s`
/// takes at most its 4 slots (one more if a scrape lands between a placement and its arrival),
/// never queues, and `l` takes the rest. (18 < 20 slots: `l` always has room, so `s` is never
/// the least full of two full engines.)
#[test]
fn a_herd_of_new_sessions_fills_a_small_engines_slots_only() {
    let weights = [("s", 1.0), ("l", 1.0)];
    // No batch slowdown: both engines decode at the same pace whatever their batch.
    let flat = ["--batch-slowdown", "0"];
    let mocks = vec![engine("s", 4, &flat), engine("l", 16, &flat)];
    let envoy = Envoy::start(config(&mocks, &weights, json!({})));
    let port = envoy.port;
    let mut checks = Checks::new();
    let (s, l) = (mock(&mocks, "s"), mock(&mocks, "l"));

    // Slots are learned from a scrape that shows a queue, at a decision: queue both engines
    // from elsewhere and send a few requests through Envoy meanwhile.
    let learn = [
        Backlog::start(MODEL, s.port, 6, 100, 0),
        Backlog::start(MODEL, l.port, 18, 100, 0),
    ];
    wait_all(
        std::slice::from_ref(&envoy),
        "both engines queueing",
        |st| {
            endpoint_stat(st, "computeflux_engine_waiting", "s") >= 1
                && endpoint_stat(st, "computeflux_engine_waiting", "l") >= 1
        },
    );
    for n in 0..3 {
        let r = post(
            port,
            &format!("learn-{n}"),
            vec![json!({"role": "user", "content": "hello"})],
            &json!({"max_tokens": 4}),
        );
        assert!(r.ok(), "{r:?}");
    }
    drop(learn);
    wait_all(std::slice::from_ref(&envoy), "both engines idle", |st| {
        ["s", "l"].iter().all(|e| {
            endpoint_stat(st, "computeflux_engine_waiting", e) == 0
                && endpoint_stat(st, "computeflux_engine_running", e) == 0
        })
    });

    // The herd: 18 streamed sessions of 150 output tokens (~450 ms each) released at once,
    // homed by the rendezvous weights in force (weight × slots, ADR 0019).
    let mut herd = homed("herd", &[("s", 4.0), ("l", 16.0)], &[("s", 12), ("l", 6)]);
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (stop, control) = (stop.clone(), s.control_port);
        std::thread::spawn(move || {
            let (mut busy, mut waiting) = (0i64, 0i64);
            while !stop.load(Ordering::SeqCst) {
                if let Ok(r) = request(control, "GET", "/_mock/stats", &[], None, WAIT) {
                    let v: Value = serde_json::from_str(&r.body).unwrap_or(Value::Null);
                    let w = v["waiting"].as_i64().unwrap_or(0);
                    busy = busy.max(w + v["running"].as_i64().unwrap_or(0));
                    waiting = waiting.max(w);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            (busy, waiting)
        })
    };
    let gate = Barrier::new(herd.len());
    let n = herd.len();
    for_each_parallel(&mut herd, n, |_, c| {
        gate.wait();
        c.send(port, &json!({"stream": true, "max_tokens": 150}));
    });
    stop.store(true, Ordering::SeqCst);
    let (s_busy, s_waiting) = sampler.join().unwrap();
    let spread = tally(herd.iter().map(|c| c.replies[0].endpoint.clone()));
    let on = |e: &str| spread.get(e).copied().unwrap_or(0);
    eprintln!(
        "herd of {n} (12 homed on s, 6 on l): spread {spread:?}; s busy at most {s_busy}, \
         waiting at most {s_waiting}"
    );
    checks.expect(
        failed(&herd).is_empty(),
        format!("herd: failed {:?}", failed(&herd)),
    );
    checks.expect(
        on("s") <= 5 && on("l") >= 13,
        format!(
            "the 4-slot s took {} of the herd (<= 5: its slots), the 16-slot l {} (>= 13)",
            on("s"),
            on("l")
        ),
    );
    checks.expect(
        s_waiting <= 1 && s_busy <= 5,
        format!("s never queued: at most {s_busy} busy and {s_waiting} waiting (<= 5, <= 1)"),
    );
    let passed = herd
        .iter()
        .filter(|c| c.home == "s" && c.replies[0].endpoint == "l")
        .all(|c| c.replies[0].affinity == "backup");
    checks.expect(
        passed,
        format!(
            "sessions homed on s placed on l were passed over as full (affinity backup): {:?}",
            herd.iter().map(Chat::trail).collect::<Vec<_>>()
        ),
    );
    no_crash(&mut checks, std::slice::from_ref(&envoy));
    checks.finish();
}

// --- 3. a later turn passes a full home as a first turn does ------------------------------------

/// Two replicas that share nothing. Sessions homed on `a` start on replica 0; `a` fills up; their
/// second turn (three messages) reaches replica 1, which has no pin for them: a full endpoint
/// is passed over as a new session's first turn passes it (the first turn of a session begun
/// while `a` was full went elsewhere on whichever replica served it, which replica 1 cannot
/// tell), so it goes where new sessions homed on `a` (one message, or a system message and a
/// user message) through the same replica at the same time go: elsewhere (`affinity: backup`).
#[test]
fn a_later_turn_on_another_replica_passes_over_a_full_home_as_a_first_turn_does() {
    let weights = [("a", 1.0), ("b", 1.0), ("c", 1.0)];
    let mocks = vec![
        engine("a", 4, &[]),
        engine("b", 16, &[]),
        engine("c", 16, &[]),
    ];
    let replicas = Replicas::start(config(&mocks, &weights, json!({})), 2);
    let (r0, r1) = (replicas.port(0), replicas.port(1));
    let mut checks = Checks::new();
    let plain = json!({"max_tokens": 16});

    // Once a has queued, the rendezvous weights are weight × slots, b and c (never queued)
    // counting as 4 × a's 4 (ADR 0019): sessions homed on a both before and after.
    let in_force = [("a", 4.0), ("b", 16.0), ("c", 16.0)];
    let mut later: Vec<Chat> = homed("later", &weights, &[("a", 600)])
        .into_iter()
        .filter(|c| rendezvous_order(header_session(&c.id), &in_force)[0] == "a")
        .take(6)
        .collect();
    assert_eq!(later.len(), 6);
    for c in &mut later {
        c.send(r0, &plain);
    }
    checks.expect(
        later
            .iter()
            .all(|c| c.replies[0].ok() && c.replies[0].endpoint == "a"),
        format!(
            "first turns through replica 0 at their home a: {:?}",
            later.iter().map(Chat::trail).collect::<Vec<_>>()
        ),
    );

    let backlog = Backlog::start(MODEL, mock(&mocks, "a").port, 10, 40, 0);
    wait_all(
        replicas.envoys(),
        "a's queue scraped by both replicas",
        |s| endpoint_stat(s, "computeflux_engine_waiting", "a") >= SATURATED_WAITING,
    );
    let before = stats(replicas.envoy(1));
    // Second turns (user, assistant, user) through replica 1, and first turns of new sessions
    // homed on a, interleaved.
    let mut first = homed("first", &in_force, &[("a", 6)]);
    for (k, (c, f)) in later.iter_mut().zip(first.iter_mut()).enumerate() {
        c.send(r1, &plain);
        let text = format!("session {} turn 0", f.id);
        let messages = if k % 2 == 0 {
            vec![json!({"role": "user", "content": text})]
        } else {
            vec![
                json!({"role": "system", "content": "You are terse."}),
                json!({"role": "user", "content": text}),
            ]
        };
        f.replies.push(post(r1, &f.id, messages, &plain));
    }
    let after = stats(replicas.envoy(1));
    let passed = later
        .iter()
        .filter(|c| c.replies[1].ok() && c.replies[1].endpoint != "a")
        .filter(|c| c.replies[1].affinity == "backup")
        .count();
    checks.expect(
        passed == 6,
        format!(
            "later turns through replica 1 (no pin there) past their full home a, affinity \
             backup: {passed}/6; {:?}",
            later.iter().map(Chat::trail).collect::<Vec<_>>()
        ),
    );
    let elsewhere = first
        .iter()
        .filter(|c| c.replies[0].ok() && c.replies[0].endpoint != "a")
        .filter(|c| c.replies[0].affinity == "backup")
        .count();
    checks.expect(
        elsewhere == 6,
        format!(
            "first turns (1 or 2 messages) homed on a through replica 1 placed elsewhere \
             (affinity backup): {elsewhere}/6; {:?}",
            first.iter().map(Chat::trail).collect::<Vec<_>>()
        ),
    );
    let delta = |reason: &str| decisions(&after, reason) - decisions(&before, reason);
    checks.expect(
        delta("home") == 0 && delta("saturated") == 12,
        format!(
            "replica 1's decisions in that phase: home {} (0), saturated {} (12)",
            delta("home"),
            delta("saturated")
        ),
    );
    drop(backlog);
    no_crash(&mut checks, replicas.envoys());
    checks.finish();
}

// --- 4. replicas agree while the load changes ---------------------------------------------------

/// Three replicas, four engines (weights 1, 1, 2, 2). Throughout, `c` and `d` carry a load from
/// elsewhere that changes all the time (clients with varying pauses and lengths, within their
/// slots); in phase 2 `a` is saturated, in phase 3 `a` has drained and `b` is saturated. Each new
/// session's first turn is sent to every replica (none has a pin for it): all three place it
/// on the same endpoint, its rendezvous home over the configured weights, or, when the home is
/// saturated (as every replica's own scrape says), the next endpoint of the same order.
/// Sessions are only placed once every replica has scraped the phase's state: between a change
/// and the next scrape each replica acts on its own last scrape, which the rule does not hide.
#[test]
fn replicas_place_new_sessions_alike_while_engine_load_changes() {
    let weights = [("a", 1.0), ("b", 1.0), ("c", 2.0), ("d", 2.0)];
    let mocks = vec![
        engine("a", 16, &[]),
        engine("b", 16, &[]),
        engine("c", 16, &[]),
        engine("d", 16, &[]),
    ];
    let replicas = Replicas::start(config(&mocks, &weights, json!({})), 3);
    let ports: Vec<u16> = (0..replicas.len()).map(|r| replicas.port(r)).collect();
    let mut checks = Checks::new();
    let churn = [
        Backlog::start(MODEL, mock(&mocks, "c").port, 6, 60, 400),
        Backlog::start(MODEL, mock(&mocks, "d").port, 6, 60, 400),
    ];
    // The running counts each replica scraped from c, over the whole test.
    let seen_running = std::sync::Mutex::new(BTreeMap::<String, Vec<i64>>::new());

    // Places `chats` (one first turn each, on every replica) and checks the replicas agree,
    // on the expected endpoint.
    // `w`: the rendezvous weights in force (weight × slots once an engine has queued, the
    // others as 4 × the most slots known; ADR 0019).
    let place =
        |checks: &mut Checks, phase: &str, chats: &mut [Chat], w: &[(&str, f64)], skip: &[&str]| {
            let threads = 4;
            let port_list = ports.clone();
            for_each_parallel(chats, threads, |_, c| {
                for &p in &port_list {
                    let text = format!("session {} turn 0", c.id);
                    let r = post(
                        p,
                        &c.id,
                        vec![json!({"role": "user", "content": text})],
                        &json!({"max_tokens": 8}),
                    );
                    c.replies.push(r);
                }
            });
            for (r, e) in replicas.envoys().iter().enumerate() {
                let v = endpoint_stat(&stats(e), "computeflux_engine_running", "c");
                seen_running
                    .lock()
                    .unwrap()
                    .entry(format!("replica {r}"))
                    .or_default()
                    .push(v);
            }
            let disagree: Vec<String> = chats
                .iter()
                .filter(|c| {
                    let expected = first_but(&c.id, w, skip);
                    !c.replies.iter().all(|r| r.ok() && r.endpoint == expected)
                })
                .map(|c| format!("{} expected {}", c.trail(), first_but(&c.id, w, skip)))
                .collect();
            let spread = tally(chats.iter().map(|c| c.replies[0].endpoint.clone()));
            checks.expect(
                disagree.is_empty(),
                format!(
                    "{phase}: sessions placed on the same, expected endpoint by all {} replicas: \
                 {}/{} (spread {spread:?}); the others: {disagree:?}",
                    ports.len(),
                    chats.len() - disagree.len(),
                    chats.len()
                ),
            );
        };

    // Phase 1: nothing saturated; c and d loaded and changing.
    let mut p1 = homed("p1", &weights, &[("a", 5), ("b", 5), ("c", 5), ("d", 5)]);
    place(&mut checks, "phase 1 (c, d loaded)", &mut p1, &weights, &[]);
    let mut p1b = homed("p1b", &weights, &[("a", 5), ("b", 5), ("c", 5), ("d", 5)]);
    place(&mut checks, "phase 1, later", &mut p1b, &weights, &[]);

    // Phase 2: a saturated (16 slots, 24 clients from elsewhere).
    let mut fill_a = Backlog::start(MODEL, mock(&mocks, "a").port, 24, 250, 0);
    wait_all(replicas.envoys(), "a saturated on every replica", |s| {
        endpoint_stat(s, "computeflux_engine_waiting", "a") >= SATURATED_WAITING
    });
    // a showed its 16 slots; the others never queued (4 × 16 each).
    let in_force = [("a", 16.0), ("b", 64.0), ("c", 128.0), ("d", 128.0)];
    let mut p2 = homed("p2", &in_force, &[("a", 8), ("b", 4), ("c", 4), ("d", 4)]);
    place(
        &mut checks,
        "phase 2 (a saturated)",
        &mut p2,
        &in_force,
        &["a"],
    );
    let skipped = p2
        .iter()
        .filter(|c| c.home == "a")
        .all(|c| c.replies.iter().all(|r| r.affinity == "backup"));
    checks.expect(
        skipped,
        "phase 2: sessions homed on a were passed over (affinity backup) by every replica",
    );

    // Phase 3: a drains, b saturated.
    fill_a.halt();
    let _fill_b = Backlog::start(MODEL, mock(&mocks, "b").port, 24, 250, 0);
    wait_all(
        replicas.envoys(),
        "a drained and b saturated on every replica",
        |s| {
            endpoint_stat(s, "computeflux_engine_waiting", "a") == 0
                && endpoint_stat(s, "computeflux_engine_waiting", "b") >= SATURATED_WAITING
        },
    );
    // b showed its 16 slots too.
    let in_force = [("a", 16.0), ("b", 16.0), ("c", 128.0), ("d", 128.0)];
    let mut p3 = homed("p3", &in_force, &[("a", 4), ("b", 8), ("c", 4), ("d", 4)]);
    place(
        &mut checks,
        "phase 3 (a drained, b saturated)",
        &mut p3,
        &in_force,
        &["b"],
    );

    let seen = seen_running.into_inner().unwrap();
    let distinct: usize = {
        let mut all: Vec<i64> = seen.values().flatten().copied().collect();
        all.sort_unstable();
        all.dedup();
        all.len()
    };
    checks.expect(
        distinct >= 2,
        format!("c's scraped running count changed during the test: {seen:?}"),
    );
    drop(churn);
    no_crash(&mut checks, replicas.envoys());
    checks.finish();
}
