//! Replica-consistent placement (issue 10) through three real Envoy processes with the same
//! configuration in front of the same four mock endpoints: each session's turns are spread over
//! the replicas client-side (round-robin), as a load balancer in front of Envoy pods does.
//!
//! What must hold: a session with no pin on a replica is placed by weighted rendezvous hashing,
//! so every replica (also one restarted with empty shared data) sends it to the same endpoint;
//! after a 429 on its home, every replica fails the session over to the same backup (the next
//! endpoint in the session's rendezvous order); `x-computeflux-affinity` tells a pin hit (`hit`)
//! from a rendezvous placement (`home`, or `spill` when bounded load skipped the home).
//!
//! Every request costs the mocks the same (see `support::session`), so the endpoints' latency
//! estimates are equal up to machine noise and their rendezvous weights are their static
//! weights (1, 1, 2, 4), whether warm or cold. Each test prints the figures it measures.

// Test code: failing loudly with context is the point.
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use serde_json::{json, Value};
use support::{
    for_each_parallel, percent, steady_mock, tally, Checks, CookieJar, EnvoyConfig, MockUpstream,
    Replicas, Session,
};

const REPLICAS: usize = 3;
const MODEL: &str = "m1";
/// The endpoints and their static weights: unequal, so the spread must follow the weights (`d`
/// gets half of the new sessions, against a quarter if the weights were ignored).
const ENDPOINTS: [(&str, f64); 4] = [("a", 1.0), ("b", 1.0), ("c", 2.0), ("d", 4.0)];
/// Prefill cost per uncached token: ~80 tokens per request (`support::session::PROMPT_BYTES`)
/// make ~60 ms before the response headers on every endpoint. Long enough that scheduling stalls
/// of a loaded machine (tens of ms) rarely double an endpoint's latency estimate on one replica
/// only, which would make that replica weigh it differently.
const PREFILL_US_PER_TOKEN: u64 = 750;
/// Concurrent clients, two per replica. Client `j` takes sessions `j, j + 6, …` and in a round
/// of turns sends them all through the same replica, so each replica has exactly two requests in
/// flight at a time: a placement that depends on a replica's own load (rather than on the session
/// and the weights alone) shows, while bounded load has no reason to spill (with at most one
/// other request in flight on the replica, no candidate exceeds its share plus a slack of 2).
const CLIENT_THREADS: usize = 2 * REPLICAS;
/// Sessions measured in a test (the issue asks for >= 100).
const SESSIONS: usize = 120;
/// Follow-up turns on the session's earlier endpoint, in percent, the target.
const FOLLOW_UP_TARGET: f64 = 99.0;
/// One-turn sessions per replica before measuring, so that each replica's endpoints are past
/// `cold_start_samples` and scored on live statistics.
const WARM_UP_PER_REPLICA: usize = 80;
const COLD_START_SAMPLES: u64 = 5;

/// Four mocks and three Envoy replicas in front of them.
struct Fleet {
    mocks: Vec<MockUpstream>,
    replicas: Replicas,
}

fn plugin_config() -> Value {
    let endpoints: Vec<Value> = ENDPOINTS
        .iter()
        .map(|(name, weight)| json!({"name": name, "cluster": name, "weight": weight}))
        .collect();
    json!({"endpoints": endpoints, "cold_start_samples": COLD_START_SAMPLES})
}

fn fleet() -> Fleet {
    fleet_with(json!({}))
}

/// The fleet with `extra` merged into the plugin configuration.
fn fleet_with(extra: Value) -> Fleet {
    let mocks: Vec<MockUpstream> = ENDPOINTS
        .iter()
        .map(|(name, _)| steady_mock(name, PREFILL_US_PER_TOKEN))
        .collect();
    let clusters: Vec<(&str, u16)> = mocks.iter().map(|m| (m.name.as_str(), m.port)).collect();
    let mut config = plugin_config();
    if let (Some(c), Some(e)) = (config.as_object_mut(), extra.as_object()) {
        c.extend(e.clone());
    }
    let replicas = Replicas::start(EnvoyConfig::new(config, &clusters), REPLICAS);
    Fleet { mocks, replicas }
}

impl Fleet {
    fn mock(&self, name: &str) -> &MockUpstream {
        self.mocks.iter().find(|m| m.name == name).unwrap()
    }

    /// Sends the next turn of every session, through the replica `via(session index)`, from
    /// `threads` concurrent clients.
    fn turn(&self, sessions: &mut [Session], threads: usize, via: impl Fn(usize) -> usize + Sync) {
        let ports: Vec<u16> = (0..self.replicas.len())
            .map(|r| self.replicas.port(r))
            .collect();
        for_each_parallel(sessions, threads, |i, s| {
            let r = via(i);
            s.send(r, ports[r]);
        });
    }

    /// `turns` turns of every session, round-robin over the replicas: session `i`'s turn `t`
    /// goes through replica `(i + t) % REPLICAS` (so sessions start on different replicas).
    fn round_robin(&self, sessions: &mut [Session], turns: usize) {
        for _ in 0..turns {
            let done: Vec<usize> = sessions.iter().map(|s| s.turns.len()).collect();
            self.turn(sessions, CLIENT_THREADS, |i| {
                self.replicas.round_robin(i + done[i])
            });
        }
    }

    /// Warms every replica up with one-turn sessions of its own (not measured).
    fn warm_up(&self, tag: &str) {
        let mut warm = Session::many(
            &format!("warm-{tag}"),
            WARM_UP_PER_REPLICA * REPLICAS,
            MODEL,
        );
        self.turn(&mut warm, CLIENT_THREADS, |i| i % REPLICAS);
        let failed = warm.iter().filter(|s| !s.turns[0].ok()).count();
        assert_eq!(
            failed,
            0,
            "warm-up requests failed: {:?}",
            first_failure(&warm)
        );
    }
}

/// The sessions whose first turn `home` served, and the others; expects enough of the former
/// (>= 10) to measure anything.
fn split_homed(
    checks: &mut Checks,
    sessions: Vec<Session>,
    home: &str,
) -> (Vec<Session>, Vec<Session>) {
    let total = sessions.len();
    let (homed, others): (Vec<Session>, Vec<Session>) = sessions
        .into_iter()
        .partition(|s| s.first_endpoint() == Some(home));
    checks.expect(
        homed.len() >= 10,
        format!(
            "sessions homed on {home}: {} of {total} (need >= 10)",
            homed.len()
        ),
    );
    (homed, others)
}

/// Session id → the endpoint that served its latest turn (`-` if none did).
fn latest_endpoints(sessions: &[Session]) -> BTreeMap<String, String> {
    sessions
        .iter()
        .map(|s| (s.id.clone(), s.last_endpoint().unwrap_or("-").to_string()))
        .collect()
}

fn expected_share(endpoint: &str) -> f64 {
    let total: f64 = ENDPOINTS.iter().map(|(_, w)| w).sum();
    ENDPOINTS
        .iter()
        .find(|(n, _)| *n == endpoint)
        .map_or(0.0, |(_, w)| w / total)
}

fn first_failure(sessions: &[Session]) -> Option<String> {
    sessions.iter().find_map(|s| {
        s.turns.iter().find(|t| !t.ok()).map(|t| {
            format!(
                "session {} via {}: status {} {:?}",
                s.id, t.via, t.status, t.error
            )
        })
    })
}

/// Checks that every turn of `sessions` succeeded (0 client-visible errors).
fn expect_no_errors(checks: &mut Checks, what: &str, sessions: &[Session]) {
    let total: usize = sessions.iter().map(|s| s.turns.len()).sum();
    let failed: usize = sessions
        .iter()
        .map(|s| s.turns.iter().filter(|t| !t.ok()).count())
        .sum();
    checks.expect(
        failed == 0,
        format!(
            "{what}: {failed}/{total} turns failed (first: {:?})",
            first_failure(sessions)
        ),
    );
}

/// Turns `turns[from..]` (from >= 1) measured against the turn before each.
struct Stayed {
    /// Served where the turn before was.
    same: usize,
    total: usize,
    /// Moves, by the endpoint the session left.
    moved_from: BTreeMap<String, usize>,
    /// The first few sessions that moved, turn by turn.
    examples: Vec<String>,
}

impl Stayed {
    fn of(sessions: &[Session], from: usize) -> Stayed {
        let mut st = Stayed {
            same: 0,
            total: 0,
            moved_from: BTreeMap::new(),
            examples: Vec::new(),
        };
        for s in sessions {
            let mut moved = false;
            for w in s.turns.get(from.max(1) - 1..).unwrap_or(&[]).windows(2) {
                st.total += 1;
                if w[1].endpoint == w[0].endpoint {
                    st.same += 1;
                } else {
                    moved = true;
                    *st.moved_from
                        .entry(w[0].endpoint().to_string())
                        .or_insert(0) += 1;
                }
            }
            if moved && st.examples.len() < 3 {
                st.examples.push(s.trail());
            }
        }
        st
    }

    fn percent(&self) -> f64 {
        percent(self.same, self.total)
    }
}

impl std::fmt::Display for Stayed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{} ({:.1} %); moves by endpoint left: {:?}; e.g. {:?}",
            self.same,
            self.total,
            self.percent(),
            self.moved_from,
            self.examples
        )
    }
}

/// Pearson's χ² at p = 0.001 for 3 degrees of freedom (four endpoints).
const CHI2_CRITICAL: f64 = 16.27;

/// Checks that sessions were spread over all endpoints with shares that follow the weights: every
/// endpoint gets some, and Pearson's χ² of the sessions' first endpoints against the weight shares
/// stays below the 0.001 critical value. Placement is a function of the session id, so the figure
/// is the same in every run of one implementation: a weighted rendezvous exceeds the bound for 1
/// set of session ids in 1000; ignoring the weights (χ² ≈ 45 with 120 sessions), weights applied
/// as their square (≈ 27) or a constant choice exceed it.
fn expect_weighted_spread(checks: &mut Checks, sessions: &[Session]) {
    let firsts = tally(sessions.iter().map(|s| s.first_endpoint().unwrap_or("-")));
    let n = sessions.len() as f64;
    let mut chi2 = 0.0;
    let mut figures = Vec::new();
    for (name, _) in ENDPOINTS {
        let want = n * expected_share(name);
        let got = firsts.get(name).copied().unwrap_or(0);
        chi2 += (got as f64 - want).powi(2) / want;
        figures.push(format!("{name}: {got} (expected {want:.1})"));
        checks.expect(got > 0, format!("new sessions placed on {name}: {got}"));
    }
    let placed: usize = ENDPOINTS.iter().filter_map(|(e, _)| firsts.get(*e)).sum();
    checks.expect(
        placed == sessions.len() && chi2 < CHI2_CRITICAL,
        format!(
            "new sessions per endpoint against the weights: {}; χ² = {chi2:.1} (must be < \
             {CHI2_CRITICAL})",
            figures.join(", ")
        ),
    );
}

/// For each turn: was it the session's first turn through that replica? Tallies the affinity
/// values of first visits and of revisits separately.
fn affinity_by_visit(sessions: &[Session]) -> (BTreeMap<String, usize>, BTreeMap<String, usize>) {
    let (mut first, mut again) = (Vec::new(), Vec::new());
    for s in sessions {
        let mut seen = BTreeSet::new();
        for t in &s.turns {
            if seen.insert(t.via) {
                first.push(t.affinity());
            } else {
                again.push(t.affinity());
            }
        }
    }
    (tally(first), tally(again))
}

fn expect_no_crashes(checks: &mut Checks, replicas: &Replicas) {
    let crashes = replicas.wasm_crashes();
    checks.expect(
        crashes.is_empty(),
        format!("wasm panics / VM failures in the Envoy logs: {crashes:?}"),
    );
}

/// Steady state: 120 sessions × 5 turns round-robin over three replicas, each replica warm.
/// Every follow-up turn should land where the session started (a replica without a pin places it
/// at the same rendezvous home); the sessions' homes follow the endpoints' weights.
#[test]
fn steady_state_follow_ups_stay_on_the_first_endpoint_across_replicas() {
    let fleet = fleet();
    fleet.warm_up("steady");
    let started = Instant::now();
    let mut sessions = Session::many("steady", SESSIONS, MODEL);
    fleet.round_robin(&mut sessions, 5);
    eprintln!(
        "{SESSIONS} sessions x 5 turns through {REPLICAS} replicas in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    let mut checks = Checks::new();
    expect_no_errors(&mut checks, "steady state", &sessions);
    let on_first = sessions
        .iter()
        .flat_map(|s| {
            s.turns[1..]
                .iter()
                .map(|t| t.endpoint == s.turns[0].endpoint)
        })
        .collect::<Vec<bool>>();
    let same = on_first.iter().filter(|b| **b).count();
    checks.expect(
        percent(same, on_first.len()) >= FOLLOW_UP_TARGET,
        format!(
            "follow-up turns on the session's first endpoint: {same}/{} ({:.1} %, target >= \
             {FOLLOW_UP_TARGET} %); against the turn before: {}",
            on_first.len(),
            percent(same, on_first.len()),
            Stayed::of(&sessions, 1)
        ),
    );
    expect_weighted_spread(&mut checks, &sessions);
    let served = tally(
        sessions
            .iter()
            .flat_map(|s| s.turns.iter().map(|t| t.endpoint())),
    );
    eprintln!("turns served per endpoint: {served:?}");

    // Explainability: a replica that has not seen the session places it (home, or spill under
    // load); one that served it before has the pin (hit).
    let (first, again) = affinity_by_visit(&sessions);
    let placed = first.get("home").copied().unwrap_or(0) + first.get("spill").copied().unwrap_or(0);
    let first_total: usize = first.values().sum();
    checks.expect(
        placed == first_total && first.get("home").copied().unwrap_or(0) * 100 >= first_total * 95,
        format!("affinity on a session's first turn through a replica: {first:?} (all home/spill, >= 95 % home)"),
    );
    let again_total: usize = again.values().sum();
    let hits = again.get("hit").copied().unwrap_or(0);
    checks.expect(
        percent(hits, again_total) >= FOLLOW_UP_TARGET,
        format!("affinity on later turns through the same replica: {again:?} (>= {FOLLOW_UP_TARGET} % hit)"),
    );
    expect_no_crashes(&mut checks, &fleet.replicas);
    checks.finish();
}

/// A 429 (with Retry-After) on the home of some sessions, seen first by replica 0 alone: it fails
/// them over to their next endpoint in rendezvous order. Replicas 1 and 2, which learn of the
/// 429 on their own, must send each of those sessions to the same backup, with no client-visible
/// error; sessions homed elsewhere do not move.
#[test]
fn rate_limited_home_fails_over_to_the_same_backup_on_every_replica() {
    const HOME: &str = "d";
    let fleet = fleet();
    fleet.warm_up("429");
    let mut sessions = Session::many("rl", 45, MODEL);
    fleet.round_robin(&mut sessions, REPLICAS);
    let mut checks = Checks::new();
    let (mut homed, mut others) = split_homed(&mut checks, sessions, HOME);
    expect_no_errors(&mut checks, "before the 429", &homed);
    expect_no_errors(&mut checks, "before the 429 (other sessions)", &others);

    let home = fleet.mock(HOME);
    home.reset_stats();
    home.set_fault(json!({"mode": "status", "status": 429, "retry_after": "30"}));

    // Replica 0 alone sees the 429 first (one session after the other).
    let port0 = fleet.replicas.port(0);
    for s in &mut homed {
        s.send(0, port0);
    }
    let backups = latest_endpoints(&homed);
    let rejected = home
        .stats()
        .pointer("/status_counts/429")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let r0_attempts = tally(homed.iter().map(|s| {
        s.turns.last().and_then(|t| t.attempts).map_or("-", |a| {
            if a > 1 {
                "failed over"
            } else {
                "first attempt"
            }
        })
    }));
    eprintln!(
        "replica 0 after the 429: {rejected} request(s) answered 429 by {HOME}; {r0_attempts:?}"
    );
    checks.expect(
        rejected >= 1,
        format!("{HOME} answered 429 to replica 0 ({rejected} time(s))"),
    );
    let backup_spread = tally(backups.values().map(String::as_str));
    checks.expect(
        !backup_spread.contains_key(HOME) && !backup_spread.contains_key("-"),
        format!("backups chosen by replica 0: {backup_spread:?} (none on {HOME})"),
    );
    // The backup is the session's next endpoint in rendezvous order, not one global fallback.
    checks.expect(
        backup_spread.len() >= 2,
        format!(
            "backups spread over {} endpoint(s) (>= 2)",
            backup_spread.len()
        ),
    );

    // Now replicas 1 and 2 (which never saw the 429; one session after the other, as replica 0),
    // then every replica once more.
    let before = homed[0].turns.len();
    fleet.turn(&mut homed, 1, |_| 1);
    fleet.turn(&mut homed, 1, |_| 2);
    fleet.round_robin(&mut homed, REPLICAS);
    expect_no_errors(&mut checks, "after the 429 (homed sessions)", &homed);
    let mut agree: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
    let mut disagreements = Vec::new();
    for s in &homed {
        for t in &s.turns[before..] {
            let e = agree.entry(t.via).or_insert((0, 0));
            e.1 += 1;
            if t.endpoint() == backups[&s.id] {
                e.0 += 1;
            } else if disagreements.len() < 5 {
                disagreements.push(format!(
                    "{} via replica {}: {} (replica 0 chose {})",
                    s.id,
                    t.via,
                    t.endpoint(),
                    backups[&s.id]
                ));
            }
        }
    }
    let (ok, total) = agree.values().fold((0, 0), |(a, b), (c, d)| (a + c, b + d));
    checks.expect(
        ok == total,
        format!(
            "turns after the 429 on replica 0's backup: {ok}/{total}; per replica (on backup, \
             turns): {agree:?}; first disagreements: {disagreements:?}"
        ),
    );

    // Sessions homed elsewhere: one more turn through every replica, still on their endpoint.
    let before = others[0].turns.len();
    for r in 0..REPLICAS {
        fleet.turn(&mut others, CLIENT_THREADS, |_| r);
    }
    expect_no_errors(&mut checks, "after the 429 (other sessions)", &others);
    let stayed = Stayed::of(&others, before);
    checks.expect(
        stayed.percent() >= FOLLOW_UP_TARGET,
        format!(
            "sessions homed elsewhere, turns on the previous endpoint during the 429: {stayed}"
        ),
    );
    expect_no_crashes(&mut checks, &fleet.replicas);
    checks.finish();
}

/// `pin_cookie` (on by default: the fleet sets no key for it): a session that one replica failed
/// over gets a cookie naming its backup, and the replicas that never saw the fault follow it,
/// also once the home is healthy again. The control (the same sessions' turns without their
/// cookies) goes home on those replicas: the cookie, not shared state, carries the place.
#[test]
fn pin_cookie_carries_a_failover_to_replicas_that_never_saw_it() {
    const HOME: &str = "d";
    let fleet = fleet_with(json!({}));
    fleet.warm_up("cookie");
    let mut sessions = Session::many("ck", 45, MODEL);
    for s in &mut sessions {
        s.jar = Some(CookieJar::default());
    }
    fleet.round_robin(&mut sessions, REPLICAS);
    let mut checks = Checks::new();
    expect_no_errors(&mut checks, "before the 429", &sessions);
    let with_cookie = sessions
        .iter()
        .filter(|s| s.jar.as_ref().is_some_and(|j| !j.is_empty()))
        .count();
    // Every successful answer tells the client where its session is, at home too.
    checks.expect(
        with_cookie == sessions.len(),
        format!(
            "sessions given a cookie while at home: {with_cookie}/{}",
            sessions.len()
        ),
    );
    let (mut homed, _) = split_homed(&mut checks, sessions, HOME);

    // Replica 0 alone sees the 429 and fails the sessions over.
    let home = fleet.mock(HOME);
    home.set_fault(json!({"mode": "status", "status": 429, "retry_after": "30"}));
    let port0 = fleet.replicas.port(0);
    for s in &mut homed {
        s.send(0, port0);
    }
    home.clear_fault();
    let backups = latest_endpoints(&homed);
    let spread = tally(backups.values().map(String::as_str));
    checks.expect(
        !spread.contains_key(HOME) && !spread.contains_key("-"),
        format!("backups chosen by replica 0: {spread:?} (none on {HOME})"),
    );
    let cookies = homed
        .iter()
        .filter(|s| {
            s.jar
                .as_ref()
                .is_some_and(|j| j.names().any(|k| k.starts_with("cf_pin_")))
        })
        .count();
    checks.expect(
        cookies == homed.len(),
        format!(
            "sessions given a pin cookie by the failover: {cookies}/{}",
            homed.len()
        ),
    );

    // Control: replica 1, which never saw the 429 and finds the home healthy, gets the turn
    // without the cookie and sends it home.
    let mut control: Vec<Session> = homed.clone();
    for s in &mut control {
        s.jar = None;
    }
    fleet.turn(&mut control, 1, |_| 1);
    let control_home = control
        .iter()
        .filter(|s| s.last_endpoint() == Some(HOME))
        .count();
    checks.expect(
        control_home == control.len(),
        format!(
            "without the cookie, replica 1 sent {control_home}/{} sessions home to {HOME}",
            control.len()
        ),
    );

    // With the cookie, replicas 2 then 1 (whose own pin now says home) follow the backup.
    let before = homed[0].turns.len();
    fleet.turn(&mut homed, 1, |_| 2);
    fleet.turn(&mut homed, 1, |_| 1);
    expect_no_errors(&mut checks, "cookie turns", &homed);
    let mut followed = 0;
    let mut total = 0;
    let mut misses = Vec::new();
    for s in &homed {
        for t in &s.turns[before..] {
            total += 1;
            if t.endpoint() == backups[&s.id] && t.affinity() == "hit" {
                followed += 1;
            } else if misses.len() < 5 {
                misses.push(s.trail());
            }
        }
    }
    eprintln!("cookie turns on replica 0's backup (affinity hit): {followed}/{total}");
    checks.expect(
        followed == total,
        format!("cookie turns on replica 0's backup as a pin hit: {followed}/{total}; {misses:?}"),
    );
    expect_no_crashes(&mut checks, &fleet.replicas);
    checks.finish();
}

/// A replica restarted mid-test (new process, empty shared data, cold statistics) sends every
/// session's follow-ups to the endpoint the session was on before the restart.
#[test]
fn restarted_replica_sends_follow_ups_to_the_same_endpoints() {
    const RESTARTED: usize = 1;
    let mut fleet = fleet();
    fleet.warm_up("restart");
    let mut sessions = Session::many("rs", SESSIONS, MODEL);
    fleet.round_robin(&mut sessions, REPLICAS);
    let before = sessions[0].turns.len();

    let (old_pid, new_pid) = fleet.replicas.restart(RESTARTED);
    let mut checks = Checks::new();
    checks.expect(
        old_pid != new_pid,
        format!("replica {RESTARTED} restarted: pid {old_pid} -> {new_pid}"),
    );
    // Each session passes through every replica once more, the restarted one included.
    fleet.round_robin(&mut sessions, REPLICAS);
    expect_no_errors(&mut checks, "around the restart", &sessions);

    let through_restarted: Vec<(bool, &str)> = sessions
        .iter()
        .flat_map(|s| {
            (before..s.turns.len())
                .filter(|&k| s.turns[k].via == RESTARTED)
                .map(move |k| {
                    (
                        s.turns[k].endpoint == s.turns[k - 1].endpoint,
                        s.turns[k].affinity(),
                    )
                })
        })
        .collect();
    let same = through_restarted.iter().filter(|(same, _)| *same).count();
    let affinity = tally(through_restarted.iter().map(|(_, a)| *a));
    checks.expect(
        percent(same, through_restarted.len()) >= FOLLOW_UP_TARGET,
        format!(
            "turns through the restarted replica on the session's previous endpoint: {same}/{} \
             ({:.1} %, target >= {FOLLOW_UP_TARGET} %)",
            through_restarted.len(),
            percent(same, through_restarted.len())
        ),
    );
    // Its shared data is empty: nothing can be a pin hit; the session is placed at its home.
    checks.expect(
        !affinity.contains_key("hit")
            && affinity.get("home").copied().unwrap_or(0) * 100 >= through_restarted.len() * 95,
        format!("affinity through the restarted replica: {affinity:?} (no hit, >= 95 % home)"),
    );
    let stayed = Stayed::of(&sessions, before);
    checks.expect(
        stayed.percent() >= FOLLOW_UP_TARGET,
        format!("all turns after the restart on the previous endpoint: {stayed}"),
    );
    expect_no_crashes(&mut checks, &fleet.replicas);
    checks.finish();
}
