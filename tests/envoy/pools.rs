//! Pools (issue 40) through real Envoys: an endpoint entry with `"pool": true` stands for every
//! host of an EDS cluster fed from a watched file; the filter learns the hosts from answers and
//! discovery calls (no configuration change), names the chosen one in
//! `x-gateway-destination-endpoint`, and the cluster's `override_host` policy sends it there.
//!
//! What must hold: hosts discovered with nothing configured but the pool; a host added to the
//! file gets new sessions within 5 s; follow-up turns stay on their host; a removed host's
//! sessions move once and then stay; no request reaches a host after it left the cluster; no
//! client error; three replicas fed the same file place the same sessions on the same hosts,
//! and a restarted replica sends their follow-ups there too. With the default configuration a
//! pool host's answer carries the session's place in a signed pin cookie, and a replica that
//! never saw the session follows it after a host joined; `"pin_cookie": false` sets none.

// Test code: failing loudly with context is the point.
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::http::{try_post_chat, CookieJar};
use support::pool::EdsFile;
use support::{chat_body, get, Checks, Envoy, EnvoyConfig, MockUpstream, Replicas};

const MODEL: &str = "m1";
const POOL: &str = "vllm";
const CLUSTER: &str = "vllm_pool";

/// The endpoint name the filter gives the host on `port` (`routing::pools::host_name`).
fn host_name(port: u16) -> String {
    format!("{POOL}-127_0_0_1-{port}")
}

fn plugin() -> Value {
    json!({
        "endpoints": [{"name": POOL, "cluster": CLUSTER, "pool": true, "models": [MODEL]}],
    })
}

fn envoy_config(eds: &EdsFile) -> EnvoyConfig {
    EnvoyConfig {
        plugin_config: plugin(),
        raw_clusters: vec![eds.cluster("round_robin")],
        ..EnvoyConfig::default()
    }
}

/// One answer: status, the endpoint the filter says served it, the mock that really did.
#[derive(Debug, Clone)]
struct Served {
    status: u16,
    endpoint: String,
    mock: String,
}

fn ask(port: u16, session: &str, turn: usize) -> Served {
    let text = format!("{session} turn {turn} {}", "x".repeat(200));
    let body = chat_body(MODEL, &[text.as_str()], Value::Null);
    match try_post_chat(port, &[("x-session-id", session)], &body) {
        Ok(r) => Served {
            status: r.status,
            endpoint: r
                .header("x-computeflux-endpoint")
                .unwrap_or("-")
                .to_string(),
            mock: r.header("x-mock-endpoint").unwrap_or("-").to_string(),
        },
        Err(e) => Served {
            status: 0,
            endpoint: format!("error: {e}"),
            mock: "-".into(),
        },
    }
}

struct Hosts {
    mocks: Vec<MockUpstream>,
}

impl Hosts {
    fn start(n: usize) -> Hosts {
        Hosts {
            mocks: (0..n)
                .map(|i| MockUpstream::start(&format!("h{i}"), &[MODEL], &[]))
                .collect(),
        }
    }

    fn port(&self, i: usize) -> u16 {
        self.mocks[i].port
    }

    fn ports(&self, which: &[usize]) -> Vec<u16> {
        which.iter().map(|&i| self.port(i)).collect()
    }

    /// The endpoint name of the mock called `mock`.
    fn endpoint_of(&self, mock: &str) -> String {
        self.mocks
            .iter()
            .find(|m| m.name == mock)
            .map_or_else(|| "-".into(), |m| host_name(m.port))
    }
}

/// Sends new sessions through `port` until every host of `which` has served one as that host
/// (or `limit` passes); returns the time it took, if it did.
fn discover(
    port: u16,
    hosts: &Hosts,
    which: &[usize],
    tag: &str,
    limit: Duration,
) -> Option<Duration> {
    let want: BTreeSet<String> = which.iter().map(|&i| host_name(hosts.port(i))).collect();
    let mut seen = BTreeSet::new();
    let t0 = Instant::now();
    let mut n = 0;
    while t0.elapsed() < limit {
        let s = ask(port, &format!("{tag}-probe-{n}"), 0);
        n += 1;
        if s.status == 200 && s.endpoint == hosts.endpoint_of(&s.mock) {
            seen.insert(s.endpoint);
        }
        if want.is_subset(&seen) {
            return Some(t0.elapsed());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("discovered {seen:?}, wanted {want:?}");
    None
}

/// Waits until Envoy's own view of the cluster lists (or no longer lists) the host on `port`.
fn wait_membership(envoy: &Envoy, port: u16, present: bool) {
    let needle = format!("{CLUSTER}::127.0.0.1:{port}::");
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(10) {
        if get(envoy.admin_port, "/clusters").body.contains(&needle) == present {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!(
        "Envoy's cluster never {} {port}",
        if present { "listed" } else { "dropped" }
    );
}

#[test]
fn pool_hosts_follow_the_clusters_membership() {
    let hosts = Hosts::start(4);
    let eds = EdsFile::new(CLUSTER);
    eds.set(&hosts.ports(&[0, 1, 2]));
    let envoy = Envoy::start(envoy_config(&eds));
    let port = envoy.port;
    let mut c = Checks::new();
    let mut errors = 0;

    // 1. Discovered with nothing configured but the pool.
    let found = discover(port, &hosts, &[0, 1, 2], "a", Duration::from_secs(15));
    c.expect(
        found.is_some(),
        format!("the three hosts of the file were discovered (in {found:?})"),
    );

    // A client cannot pick the host: its destination header is removed.
    let mut obeyed = 0;
    let mut stamped = 0;
    for i in 0..10 {
        let id = format!("c{i}");
        let home_host = ask(port, &id, 0).mock;
        let other = (0..3).find(|&k| format!("h{k}") != home_host).unwrap();
        let text = format!("{id} turn 1 {}", "x".repeat(200));
        let body = chat_body(MODEL, &[text.as_str()], Value::Null);
        let target = format!("127.0.0.1:{}", hosts.port(other));
        let r = try_post_chat(
            port,
            &[
                ("x-session-id", id.as_str()),
                (support::pool::DESTINATION_HEADER, target.as_str()),
            ],
            &body,
        )
        .unwrap();
        errors += usize::from(r.status != 200);
        obeyed += usize::from(r.header("x-mock-endpoint") == Some(format!("h{other}").as_str()));
        stamped += usize::from(r.header(support::pool::STAMP_HEADER).is_some());
    }
    c.expect(
        obeyed == 0,
        format!("{obeyed}/10 client-sent destination headers obeyed"),
    );
    c.expect(
        stamped == 0,
        format!("{stamped}/10 answers showed the upstream stamp to the client"),
    );

    // 2. Sessions placed on the hosts, each served where the filter says.
    const SESSIONS: usize = 30;
    let mut home: BTreeMap<String, String> = BTreeMap::new();
    let mut mismatched = 0;
    for i in 0..SESSIONS {
        let id = format!("s{i}");
        let s = ask(port, &id, 0);
        errors += usize::from(s.status != 200);
        mismatched += usize::from(s.endpoint != hosts.endpoint_of(&s.mock));
        home.insert(id, s.mock);
    }
    let spread: BTreeSet<&String> = home.values().collect();
    c.expect(
        mismatched == 0,
        format!("{mismatched} answers served by another host than named"),
    );
    c.expect(
        spread.len() == 3,
        format!("{SESSIONS} sessions spread over {} hosts", spread.len()),
    );

    // 3. A host added to the file gets new sessions within 5 s.
    eds.set(&hosts.ports(&[0, 1, 2, 3]));
    let t0 = Instant::now();
    let mut first_on_new = None;
    let mut n = 0;
    while t0.elapsed() < Duration::from_secs(10) {
        let s = ask(port, &format!("new-{n}"), 0);
        n += 1;
        errors += usize::from(s.status != 200);
        if s.mock == "h3" && s.endpoint == host_name(hosts.port(3)) {
            first_on_new = Some(t0.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    c.expect(
        first_on_new.is_some_and(|t| t <= Duration::from_secs(5)),
        format!("the added host served its first new session after {first_on_new:?} (limit 5 s)"),
    );
    let mut on_new = 0;
    for i in 0..40 {
        let s = ask(port, &format!("share-{i}"), 0);
        errors += usize::from(s.status != 200);
        on_new += usize::from(s.mock == "h3");
    }
    c.expect(
        (4..=20).contains(&on_new),
        format!("then {on_new} of 40 new sessions went to it (its share: 10)"),
    );

    // 4. Follow-ups stay on their host.
    let mut stayed = 0;
    for (id, h) in &home {
        let s = ask(port, id, 1);
        errors += usize::from(s.status != 200);
        stayed += usize::from(&s.mock == h);
    }
    c.expect(
        stayed == SESSIONS,
        format!("{stayed}/{SESSIONS} follow-ups on their host after a join"),
    );

    // 5. A host removed: its sessions move once, then stay; nothing reaches it after it left.
    let gone = home.values().next().cloned().unwrap_or_default();
    let gone_i: usize = gone.trim_start_matches('h').parse().unwrap();
    let left: Vec<usize> = (0..4).filter(|&i| i != gone_i).collect();
    eds.set(&hosts.ports(&left));
    wait_membership(&envoy, hosts.port(gone_i), false);
    let before = hosts.mocks[gone_i].request_count();
    let mut moved: BTreeMap<String, String> = BTreeMap::new();
    let mut stayed = 0;
    let mut others = 0;
    for (id, h) in &home {
        let s = ask(port, id, 2);
        errors += usize::from(s.status != 200);
        if *h == gone {
            moved.insert(id.clone(), s.mock);
        } else {
            others += 1;
            stayed += usize::from(&s.mock == h);
        }
    }
    c.expect(
        stayed == others,
        format!("{stayed}/{others} sessions of the other hosts stayed"),
    );
    let mut settled = 0;
    for (id, h) in &moved {
        let s = ask(port, id, 3);
        errors += usize::from(s.status != 200);
        settled += usize::from(&s.mock == h && *h != gone);
    }
    c.expect(
        !moved.is_empty() && settled == moved.len(),
        format!(
            "{settled}/{} sessions of the removed host moved once and stayed",
            moved.len()
        ),
    );
    let after = hosts.mocks[gone_i].request_count();
    c.expect(
        after == before,
        format!(
            "requests reaching the removed host after it left: {}",
            after - before
        ),
    );
    c.expect(errors == 0, format!("{errors} client errors"));
    c.expect(envoy.wasm_crashes().is_empty(), "no wasm crash");
    c.finish();
}

/// A session's second turn: the body carries the first one, so the filter reads it as a
/// follow-up (a replica without its pin takes the session's home as a pin would be).
fn ask_follow_up(port: u16, session: &str) -> Served {
    let first = format!("{session} turn 0 {}", "x".repeat(200));
    let second = format!("{session} turn 1 {}", "y".repeat(50));
    let body = chat_body(MODEL, &[first.as_str(), second.as_str()], Value::Null);
    match try_post_chat(port, &[("x-session-id", session)], &body) {
        Ok(r) => Served {
            status: r.status,
            endpoint: r
                .header("x-computeflux-endpoint")
                .unwrap_or("-")
                .to_string(),
            mock: r.header("x-mock-endpoint").unwrap_or("-").to_string(),
        },
        Err(e) => Served {
            status: 0,
            endpoint: format!("error: {e}"),
            mock: "-".into(),
        },
    }
}

/// Waits until `envoy`'s filter has learned every host of `ports` (its log says each joined).
fn wait_learned(envoy: &Envoy, ports: &[u16], limit: Duration) -> bool {
    ports
        .iter()
        .all(|p| envoy.wait_for_log(&format!("pool {POOL}: host 127.0.0.1:{p} joined"), limit))
}

#[test]
fn three_replicas_place_the_same_sessions_on_the_same_hosts() {
    let hosts = Hosts::start(3);
    let eds = EdsFile::new(CLUSTER);
    eds.set(&hosts.ports(&[0, 1, 2]));
    let mut replicas = Replicas::start(envoy_config(&eds), 3);
    let mut c = Checks::new();
    for r in 0..replicas.len() {
        let found = discover(
            replicas.port(r),
            &hosts,
            &[0, 1, 2],
            &format!("r{r}"),
            Duration::from_secs(15),
        );
        c.expect(
            found.is_some(),
            format!("replica {r} discovered the three hosts in {found:?}"),
        );
    }
    // Each session asked of every replica (each places it afresh): the same host.
    const SESSIONS: usize = 30;
    let mut agree = 0;
    let mut errors = 0;
    let mut used = BTreeSet::new();
    let mut home: BTreeMap<String, String> = BTreeMap::new();
    for i in 0..SESSIONS {
        let id = format!("x{i}");
        let served: Vec<Served> = (0..replicas.len())
            .map(|r| ask(replicas.port(r), &id, 0))
            .collect();
        errors += served.iter().filter(|s| s.status != 200).count();
        used.insert(served[0].mock.clone());
        agree += usize::from(served.iter().all(|s| s.mock == served[0].mock));
        home.insert(id, served[0].mock.clone());
    }
    c.expect(
        agree == SESSIONS,
        format!("{agree}/{SESSIONS} sessions placed on the same host by all three replicas"),
    );
    c.expect(used.len() == 3, format!("over {} hosts", used.len()));

    // A restarted replica (a pod replaced: nothing of its shared data survives) learns the
    // same hosts again and sends every session's next turn where the others placed it.
    let (old_pid, new_pid) = replicas.restart(1);
    c.expect(old_pid != new_pid, "replica 1 is a new process");
    let t0 = Instant::now();
    let learned = wait_learned(
        replicas.envoy(1),
        &hosts.ports(&[0, 1, 2]),
        Duration::from_secs(15),
    );
    c.expect(
        learned,
        format!(
            "the restarted replica learned the three hosts (after {:?})",
            t0.elapsed()
        ),
    );
    // The log line is the worker that learned a host; every other worker of that Envoy installs
    // the shared membership at its next pool tick (250 ms): give them a few.
    std::thread::sleep(Duration::from_millis(1_000));
    let mut kept = 0;
    for (id, h) in &home {
        let s = ask_follow_up(replicas.port(1), id);
        errors += usize::from(s.status != 200);
        kept += usize::from(&s.mock == h && s.endpoint == hosts.endpoint_of(&s.mock));
    }
    c.expect(
        kept == SESSIONS,
        format!("{kept}/{SESSIONS} follow-ups sent by the restarted replica to their host"),
    );
    c.expect(errors == 0, format!("{errors} client errors"));
    c.expect(replicas.wasm_crashes().is_empty(), "no wasm crash");
    c.finish();
}

#[test]
fn each_host_of_a_pool_is_scraped_new_ones_included() {
    let hosts = Hosts::start(3);
    let eds = EdsFile::new(CLUSTER);
    eds.set(&hosts.ports(&[0, 1]));
    let mut cfg = envoy_config(&eds);
    cfg.plugin_config = json!({
        "endpoints": [{"name": POOL, "cluster": CLUSTER, "pool": true, "models": [MODEL],
                       "metrics": {"format": "vllm", "interval_ms": 250}}],
    });
    cfg.component_log_level = Some("wasm:debug".into());
    let envoy = Envoy::start(cfg);
    let mut c = Checks::new();
    let scraped = |i: usize| format!("scraped {}:", host_name(hosts.port(i)));
    for i in 0..2 {
        c.expect(
            envoy.wait_for_log(&scraped(i), Duration::from_secs(15)),
            format!("host h{i} scraped as {}", host_name(hosts.port(i))),
        );
    }
    eds.set(&hosts.ports(&[0, 1, 2]));
    let t0 = Instant::now();
    let found = envoy.wait_for_log(&scraped(2), Duration::from_secs(15));
    c.expect(
        found,
        format!("the added host h2 scraped after {:?}", t0.elapsed()),
    );
    // Series are the pool's, never a host's.
    let stats = get(envoy.admin_port, "/stats?filter=computeflux").body;
    let per_host = stats.lines().filter(|l| l.contains("127_0_0_1")).count();
    c.expect(
        per_host == 0,
        format!("{per_host} metric series named after a host"),
    );
    c.expect(
        stats.contains("computeflux_scrapes_total.endpoint.vllm:"),
        "scrapes counted under the pool's name",
    );
    c.expect(envoy.wasm_crashes().is_empty(), "no wasm crash");
    c.finish();
}

/// A turn of `session` by a client that keeps cookies: `jar`'s cookies sent, the answer's kept.
/// `follow_up`: the body carries an earlier turn (as [`ask_follow_up`]), else as [`ask`]'s first
/// turn. Also whether the answer set a pin cookie (`cf_pin_<slot>`).
fn ask_in_jar(port: u16, session: &str, follow_up: bool, jar: &mut CookieJar) -> (Served, bool) {
    let first = format!("{session} turn 0 {}", "x".repeat(200));
    let second = format!("{session} turn 1 {}", "y".repeat(50));
    let texts: Vec<&str> = if follow_up {
        vec![first.as_str(), second.as_str()]
    } else {
        vec![first.as_str()]
    };
    let body = chat_body(MODEL, &texts, Value::Null);
    let cookie = jar.header();
    let mut headers = vec![("x-session-id", session)];
    if let Some(c) = cookie.as_deref() {
        headers.push(("cookie", c));
    }
    match try_post_chat(port, &headers, &body) {
        Ok(r) => {
            let pin = r
                .header("set-cookie")
                .is_some_and(|c| c.contains("cf_pin_"));
            jar.store(&r);
            let served = Served {
                status: r.status,
                endpoint: r
                    .header("x-computeflux-endpoint")
                    .unwrap_or("-")
                    .to_string(),
                mock: r.header("x-mock-endpoint").unwrap_or("-").to_string(),
            };
            (served, pin)
        }
        Err(e) => (
            Served {
                status: 0,
                endpoint: format!("error: {e}"),
                mock: "-".into(),
            },
            false,
        ),
    }
}

/// The default configuration (no `pin_cookie` key): a session's first answer from a pool's host
/// carries its place (later ones only once the cookie is half spent), and after a host joined, a replica that never saw a session follows its
/// cookie to the host that served it. The control: the same follow-ups without their cookies,
/// sent to another replica that never saw them either, go to their home by the new membership
/// (about a quarter of them to the new host): the cookie, not chance, keeps them.
#[test]
fn by_default_a_pool_hosts_cookie_carries_its_session_to_a_replica_that_never_saw_it() {
    let hosts = Hosts::start(4);
    let eds = EdsFile::new(CLUSTER);
    eds.set(&hosts.ports(&[0, 1, 2]));
    let replicas = Replicas::start(envoy_config(&eds), 3);
    let mut c = Checks::new();
    let learned = |which: &[usize]| {
        (0..replicas.len()).all(|r| {
            wait_learned(
                replicas.envoy(r),
                &hosts.ports(which),
                Duration::from_secs(15),
            )
        })
    };
    c.expect(learned(&[0, 1, 2]), "every replica learned the three hosts");
    // Every worker installs the shared membership at its next pool tick (250 ms).
    std::thread::sleep(Duration::from_millis(1_000));

    // First turns through replica 0, each session its own client with its own jar.
    const SESSIONS: usize = 40;
    let mut errors = 0;
    let mut cookies = 0;
    let mut sessions: Vec<(String, String, CookieJar)> = Vec::new();
    for i in 0..SESSIONS {
        let id = format!("k{i}");
        let mut jar = CookieJar::default();
        let (s, pin) = ask_in_jar(replicas.port(0), &id, false, &mut jar);
        errors += usize::from(s.status != 200 || s.endpoint != hosts.endpoint_of(&s.mock));
        cookies += usize::from(pin);
        sessions.push((id, s.mock, jar));
    }
    c.expect(
        cookies == SESSIONS,
        format!("{cookies}/{SESSIONS} first turns served at home by a pool host set a pin cookie"),
    );

    // A host joins; every replica learns it.
    eds.set(&hosts.ports(&[0, 1, 2, 3]));
    c.expect(learned(&[3]), "every replica learned the new host");
    std::thread::sleep(Duration::from_millis(1_000));

    // Control: replica 1 never saw the sessions; without their cookies it places the follow-ups
    // by the new membership.
    let mut moved_without = 0;
    for (id, host, _) in &sessions {
        let (s, _) = ask_in_jar(replicas.port(1), id, true, &mut CookieJar::default());
        errors += usize::from(s.status != 200);
        moved_without += usize::from(&s.mock != host);
    }
    eprintln!("without their cookies, replica 1 moved {moved_without}/{SESSIONS} follow-ups");
    c.expect(
        moved_without > 0,
        format!("without their cookies, replica 1 moved {moved_without}/{SESSIONS} follow-ups (want some)"),
    );

    // With them, replica 2 (which never saw the sessions either) keeps every one on its host.
    let mut kept = 0;
    let mut refreshed = 0;
    for (id, host, jar) in &mut sessions {
        let (s, pin) = ask_in_jar(replicas.port(2), id, true, jar);
        errors += usize::from(s.status != 200);
        kept += usize::from(s.mock == *host && s.endpoint == hosts.endpoint_of(&s.mock));
        refreshed += usize::from(pin);
    }
    c.expect(
        kept == SESSIONS,
        format!("with their cookies, replica 2 kept {kept}/{SESSIONS} follow-ups on their host"),
    );
    // Their cookies are fresh (well within half the affinity TTL): not signed again.
    c.expect(
        refreshed == 0,
        format!("{refreshed}/{SESSIONS} follow-ups carrying a fresh cookie were given it again (want 0)"),
    );
    c.expect(errors == 0, format!("{errors} client errors"));
    c.expect(replicas.wasm_crashes().is_empty(), "no wasm crash");
    c.finish();
}

/// `"pin_cookie": false` (clients that must not receive cookies): no answer sets one, not even a
/// pool host's first answer, which sets one by default (the test above).
#[test]
fn pin_cookie_false_sets_no_cookie() {
    let hosts = Hosts::start(2);
    let eds = EdsFile::new(CLUSTER);
    eds.set(&hosts.ports(&[0, 1]));
    let mut cfg = envoy_config(&eds);
    cfg.plugin_config = json!({
        "endpoints": [{"name": POOL, "cluster": CLUSTER, "pool": true, "models": [MODEL]}],
        "pin_cookie": false,
    });
    let envoy = Envoy::start(cfg);
    let mut c = Checks::new();
    let found = discover(envoy.port, &hosts, &[0, 1], "off", Duration::from_secs(15));
    c.expect(
        found.is_some(),
        format!("the two hosts were discovered (in {found:?})"),
    );
    const SESSIONS: usize = 20;
    let mut errors = 0;
    let mut on_host = 0;
    let mut set = 0;
    for i in 0..SESSIONS {
        let id = format!("off{i}");
        let mut jar = CookieJar::default();
        for follow_up in [false, true] {
            let (s, _) = ask_in_jar(envoy.port, &id, follow_up, &mut jar);
            errors += usize::from(s.status != 200);
            on_host += usize::from(s.endpoint == hosts.endpoint_of(&s.mock));
        }
        set += usize::from(!jar.is_empty());
    }
    c.expect(
        on_host == 2 * SESSIONS,
        format!("{on_host}/{} turns served by a pool host", 2 * SESSIONS),
    );
    c.expect(
        set == 0,
        format!("{set}/{SESSIONS} clients were given a cookie"),
    );
    c.expect(errors == 0, format!("{errors} client errors"));
    c.expect(envoy.wasm_crashes().is_empty(), "no wasm crash");
    c.finish();
}
