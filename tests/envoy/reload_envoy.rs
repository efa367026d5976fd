//! A live configuration update with requests in flight keeps the endpoint table (issue 22,
//! item 7), through a real Envoy: the plugin is reconfigured by ECDS (same process, same VM,
//! shared data kept) while slow requests of the old configuration are still being answered.
//!
//! The new configuration adds endpoint `d`, alone on model `m2`, which fails: its breaker
//! opens after `failure_threshold` failures and stays open for `open_ms` (a minute), so `m2`
//! requests are answered 503 by the filter without reaching `d`. Then the old requests finish,
//! one by one, each writing the table under the old configuration.
//!
//! Before (main): each of those writes laid the table out for the old configuration, which
//! has no `d`: `d`'s entry (its open breaker) was dropped, and the new configuration's next
//! request for `m2` found it fresh and sent `d` new failures. After: an old writer patches the
//! entries it knows into the newer layout and leaves `d` alone; `d` gets no request until its
//! breaker's minute is over.
//!
//! A listener update (LDS from a watched file) is the long version: a keep-alive connection
//! opened before it keeps sending new requests through the old filter chain, each a pick and a
//! finish under the old configuration, for up to Envoy's drain time.
//!
//! A module upgrade is the same with two VMs: the old module's requests drain in the old VM
//! while the new module serves, both with the filter's `vm_id`, so they share shared data.
//! Before, an upgrade that changed the table's byte format had each module read the other's
//! table as garbage and write its own, fresh, on every write; now each format has its own key.
//!
//! Run with `COMPUTEFLUX_WASM=<another build>` to judge another module (e.g. main's); the
//! upgrade test starts from `COMPUTEFLUX_OLD_WASM` when set (else the same module in its own
//! VM, an upgrade that keeps the format).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use crate::support;

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::{chat_body, post_chat, wasm_path, EcdsEnvoy, EnvoyConfig, MockUpstream};

/// Failures that open a breaker (both configurations).
const FAILURE_THRESHOLD: u64 = 2;
/// How long the old side's requests take (the upstream holds its headers this long): long
/// enough for the new side to take over and open `d`'s breaker while they are in flight (a new
/// VM took ~5 s to start on a loaded 2-core machine).
const SLOW_MS: u64 = 6_000;
const SLOW_UPGRADE_MS: u64 = 12_000;
/// Old requests in flight across the update.
const IN_FLIGHT: usize = 6;

fn plugin(endpoints: Value) -> Value {
    json!({
        "endpoints": endpoints,
        "failure_threshold": FAILURE_THRESHOLD,
        "open_ms": 60_000,
        "failover_timeout_ms": 20_000,
    })
}

/// What the new side saw while the old side drained.
struct Drain {
    /// Requests that reached `d` after its breaker had opened (0 when it held).
    reached_d: u64,
    old_ok: usize,
    log: String,
}

fn m2(port: u16) -> u16 {
    post_chat(port, &[], &chat_body("m2", &["x"], Value::Null)).status
}

/// Starts `IN_FLIGHT` slow requests on `s` through `envoy`, then `update` (the new side takes
/// over once `ready` appears in Envoy's log, or at once), opens `d`'s breaker with `m2`
/// requests under the new side, and counts the `m2` requests that reach `d` while the old
/// requests drain and for half a second after.
fn drain_across(
    envoy: &EcdsEnvoy,
    d: &MockUpstream,
    slow_ms: u64,
    update: impl FnOnce(),
    ready: Option<&str>,
) -> Drain {
    let port = envoy.port;
    let r = post_chat(port, &[], &chat_body("m1", &["warm"], Value::Null));
    assert_eq!(r.status, 200, "{}", r.body);
    // Slow requests of the old side, started 300 ms apart: they end one by one.
    let t0 = Instant::now();
    let slow: Vec<_> = (0..IN_FLIGHT)
        .map(|k| {
            std::thread::sleep(Duration::from_millis(300));
            std::thread::spawn(move || {
                let body = chat_body("ms", &[&format!("slow {k}")], Value::Null);
                let r = support::http::request(
                    port,
                    "POST",
                    "/v1/chat/completions",
                    &[],
                    Some(body.as_bytes()),
                    Duration::from_secs(40),
                );
                (r.map_or(0, |r| r.status), Instant::now())
            })
        })
        .collect();
    // The update, while they are in flight.
    update();
    if let Some(needle) = ready {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !envoy.log().contains(needle) {
            assert!(
                Instant::now() < deadline,
                "the update never took: {}",
                envoy.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    // Under the new side `m2` goes to `d`, which fails until its breaker opens.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut statuses = Vec::new();
    loop {
        assert!(
            Instant::now() < deadline,
            "d's breaker never opened: {statuses:?}\n{}",
            envoy.log()
        );
        let before = d.request_count();
        statuses.push(m2(port));
        if before >= FAILURE_THRESHOLD && d.request_count() == before {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let opened_at = t0.elapsed();
    let hits_open = d.request_count();
    println!(
        "d's breaker open after {hits_open} requests at {:.1} s: m2 statuses {statuses:?}",
        opened_at.as_secs_f64()
    );
    assert!(
        opened_at < Duration::from_millis(slow_ms),
        "the old requests were no longer in flight when d's breaker opened"
    );
    // The old requests drain; new requests for `m2` keep coming.
    let mut after = Vec::new();
    let mut drained = Vec::new();
    let mut pending = slow;
    while !pending.is_empty() {
        let (done, rest): (Vec<_>, Vec<_>) = pending.into_iter().partition(|h| h.is_finished());
        pending = rest;
        drained.extend(done.into_iter().map(|h| h.join().unwrap()));
        after.push(m2(port));
        std::thread::sleep(Duration::from_millis(100));
    }
    for _ in 0..5 {
        after.push(m2(port));
        std::thread::sleep(Duration::from_millis(100));
    }
    let reached_d = d.request_count() - hits_open;
    let old_ok = drained.iter().filter(|(status, _)| *status == 200).count();
    let last_old = drained
        .iter()
        .map(|(_, at)| at.duration_since(t0).as_secs_f64())
        .fold(0.0, f64::max);
    println!(
        "old requests: {old_ok}/{IN_FLIGHT} answered 200, the last at {last_old:.1} s; \
         while they drained: {} m2 requests, statuses {after:?}; {reached_d} reached d \
         (its breaker should hold them all off)",
        after.len()
    );
    let gauge = envoy
        .stats()
        .get("wasmcustom.computeflux_breaker_state.endpoint.d")
        .copied();
    println!("breaker gauge of d at the end: {gauge:?} (1 = open)");
    Drain {
        reached_d,
        old_ok,
        log: envoy.log(),
    }
}

fn mocks(slow_ms: u64) -> (MockUpstream, MockUpstream, MockUpstream) {
    let a = MockUpstream::start("a", &["m1"], &[]);
    let s = MockUpstream::start("s", &["ms"], &[]);
    let d = MockUpstream::start("d", &["m2"], &[]);
    s.set_fault(json!({"mode": "delay_ms", "ms": slow_ms}));
    d.set_fault(json!({"mode": "status", "status": 500}));
    (a, s, d)
}

fn judge(drain: &Drain) {
    assert!(
        !drain.log.contains("panicked") && !drain.log.contains("Wasm VM failed"),
        "{}",
        drain.log
    );
    assert_eq!(
        drain.old_ok, IN_FLIGHT,
        "the old requests must all be answered"
    );
    assert_eq!(
        drain.reached_d, 0,
        "d's open breaker was reset while the old side's requests drained"
    );
}

#[test]
fn a_live_reconfiguration_keeps_the_new_endpoints_breaker_while_old_requests_drain() {
    let (a, s, d) = mocks(SLOW_MS);
    let old = plugin(json!([
        {"name": "a", "cluster": "c-a", "models": ["m1"]},
        {"name": "s", "cluster": "c-s", "models": ["ms"]},
    ]));
    let new = plugin(json!([
        {"name": "a", "cluster": "c-a", "models": ["m1"]},
        {"name": "s", "cluster": "c-s", "models": ["ms"]},
        {"name": "d", "cluster": "c-d", "models": ["m2"]},
    ]));
    let envoy = EcdsEnvoy::start_with(EnvoyConfig::new(
        old,
        &[("c-a", a.port), ("c-s", s.port), ("c-d", d.port)],
    ));
    // Under the old configuration `m2` is a 404: the loop waits for the new one by itself.
    let drain = drain_across(&envoy, &d, SLOW_MS, || envoy.write_plugin(&new, "2"), None);
    judge(&drain);
}

#[test]
fn a_module_upgrade_keeps_the_new_modules_breaker_while_the_old_module_drains() {
    let (a, s, d) = mocks(SLOW_UPGRADE_MS);
    let endpoints = json!([
        {"name": "a", "cluster": "c-a", "models": ["m1"]},
        {"name": "s", "cluster": "c-s", "models": ["ms"]},
        {"name": "d", "cluster": "c-d", "models": ["m2"]},
    ]);
    let old = plugin(endpoints.clone());
    // The same fleet; one key differs so that the new VM logs its configuration.
    let mut new = plugin(endpoints);
    new["open_ms"] = json!(60_001);
    let old_wasm = std::env::var_os("COMPUTEFLUX_OLD_WASM")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(wasm_path);
    let new_wasm = wasm_path();
    println!("upgrade {} -> {}", old_wasm.display(), new_wasm.display());
    let envoy = EcdsEnvoy::start_module(
        EnvoyConfig::new(old, &[("c-a", a.port), ("c-s", s.port), ("c-d", d.port)]),
        &old_wasm,
    );
    let drain = drain_across(
        &envoy,
        &d,
        SLOW_UPGRADE_MS,
        || envoy.write_module(&new, &new_wasm, "upgraded", "2"),
        Some("open_ms=60001"),
    );
    judge(&drain);
}

/// Envoy whose listener comes by LDS from a watched file: replacing it (here: its wasm
/// filter's configuration) drains the old listener's connections for Envoy's drain time, and a
/// keep-alive connection opened before keeps sending its requests through the old filter chain,
/// with the old plugin configuration.
struct LdsEnvoy {
    child: std::process::Child,
    dir: std::path::PathBuf,
    port: u16,
    listener: Value,
}

impl LdsEnvoy {
    fn start(cfg: &EnvoyConfig) -> LdsEnvoy {
        let wasm = wasm_path();
        let mut boot: Value =
            serde_json::from_str(&support::render_bootstrap(cfg, &wasm, 0, 0)).unwrap();
        let dir = std::env::temp_dir().join(format!("computeflux-lds-{}", support::unique_u32()));
        std::fs::create_dir_all(&dir).unwrap();
        let listener = boot["static_resources"]["listeners"][0].take();
        boot["static_resources"]["listeners"] = json!([]);
        boot["dynamic_resources"] = json!({"lds_config": {
            "path_config_source": {
                "path": dir.join("lds.json").display().to_string(),
                "watched_directory": {"path": dir.display().to_string()},
            },
            "resource_api_version": "V3",
        }});
        let mut e = LdsEnvoy {
            child: std::process::Command::new("true").spawn().unwrap(),
            dir: dir.clone(),
            port: 0,
            listener,
        };
        let _ = e.child.wait();
        e.write_plugin(&cfg.plugin_config, "1");
        let boot_path = dir.join("envoy.json");
        std::fs::write(&boot_path, boot.to_string()).unwrap();
        let admin_path = dir.join("admin.txt");
        e.child = std::process::Command::new(support::envoy_bin())
            .arg("-c")
            .arg(&boot_path)
            .args(["--concurrency", "2", "--disable-hot-restart", "--base-id"])
            .arg(support::unique_u32().to_string())
            // The default drain time and gradual strategy: old connections are closed at random,
            // more often as the 600 s pass; in the test's seconds, almost never.
            .arg("--log-path")
            .arg(dir.join("envoy.log"))
            .arg("--admin-address-path")
            .arg(&admin_path)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let (_, port) =
            support::envoy::wait_ready(&mut e.child, &admin_path, Duration::from_secs(20))
                .unwrap_or_else(|err| panic!("{err}\n{}", e.log()));
        e.port = port;
        e
    }

    /// Replaces the listener with one whose filter has `plugin` as its configuration (the same
    /// address, so the socket is handed over).
    fn write_plugin(&self, plugin: &Value, version: &str) {
        let mut l = self.listener.clone();
        let filters = l
            .pointer_mut("/filter_chains/0/filters/0/typed_config/http_filters/0/typed_config/config/configuration")
            .unwrap();
        filters["value"] = Value::String(plugin.to_string());
        l["@type"] = json!("type.googleapis.com/envoy.config.listener.v3.Listener");
        let doc = json!({"version_info": version, "resources": [l]});
        let tmp = self.dir.join("lds.json.tmp");
        std::fs::write(&tmp, doc.to_string()).unwrap();
        std::fs::rename(&tmp, self.dir.join("lds.json")).unwrap();
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("envoy.log")).unwrap_or_default()
    }
}

impl Drop for LdsEnvoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// One request on a kept-alive HTTP/1.1 connection: its status, and whether Envoy closes the
/// connection after it (`connection: close`, as a draining listener does at random).
fn keep_alive_post(conn: &mut std::net::TcpStream, body: &str) -> (u16, bool) {
    use std::io::{Read, Write};
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(req.as_bytes()).unwrap();
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        assert_eq!(
            conn.read(&mut byte).unwrap(),
            1,
            "connection closed mid-head"
        );
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).to_ascii_lowercase();
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    let header = |name: &str| {
        head.lines().find_map(|l| {
            l.strip_prefix(&format!("{name}:"))
                .map(|v| v.trim().to_string())
        })
    };
    match header("content-length") {
        Some(n) => {
            let mut body = vec![0u8; n.parse().unwrap()];
            conn.read_exact(&mut body).unwrap();
        }
        None => {
            // Chunked: read up to the last chunk.
            let mut rest = Vec::new();
            while !rest.ends_with(b"0\r\n\r\n") {
                assert_eq!(
                    conn.read(&mut byte).unwrap(),
                    1,
                    "connection closed mid-body"
                );
                rest.push(byte[0]);
            }
        }
    }
    (status, header("connection").as_deref() == Some("close"))
}

/// A listener update (LDS): a connection opened before it keeps sending requests under the old
/// plugin configuration — picks and finishes, each a table write — while the new one serves
/// new connections. The new endpoint's breaker holds throughout.
#[test]
fn a_listener_update_keeps_the_new_endpoints_breaker_while_old_connections_drain() {
    let (a, s, d) = mocks(SLOW_MS);
    let old = plugin(json!([
        {"name": "a", "cluster": "c-a", "models": ["m1"]},
        {"name": "s", "cluster": "c-s", "models": ["ms"]},
    ]));
    let new = plugin(json!([
        {"name": "a", "cluster": "c-a", "models": ["m1"]},
        {"name": "s", "cluster": "c-s", "models": ["ms"]},
        {"name": "d", "cluster": "c-d", "models": ["m2"]},
    ]));
    let envoy = LdsEnvoy::start(&EnvoyConfig::new(
        old,
        &[("c-a", a.port), ("c-s", s.port), ("c-d", d.port)],
    ));
    let port = envoy.port;
    let m1 = chat_body("m1", &["old connection"], Value::Null);
    let m2_body = chat_body("m2", &["x"], Value::Null);
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    assert_eq!(keep_alive_post(&mut conn, &m1).0, 200);
    envoy.write_plugin(&new, "2");
    // New connections get the new configuration (m2 reaches d) once the listener is replaced.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut statuses = Vec::new();
    loop {
        assert!(
            Instant::now() < deadline,
            "d's breaker never opened: {statuses:?}\n{}",
            envoy.log()
        );
        let before = d.request_count();
        statuses.push(m2(port));
        if before >= FAILURE_THRESHOLD && d.request_count() == before {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let hits_open = d.request_count();
    println!("d's breaker open after {hits_open} requests: m2 statuses {statuses:?}");
    // The old connection: m1 requests (a pick and a finish each, under the old configuration)
    // and an m2 probe (404 under the old configuration, which has no m2), with new m2 requests
    // in between.
    let (mut old_m1, mut old_m2_404, mut closed) = (0, 0, false);
    let mut after = Vec::new();
    for _ in 0..15 {
        let (st, close) = keep_alive_post(&mut conn, &m1);
        old_m1 += usize::from(st == 200);
        if close {
            closed = true;
            break;
        }
        let (st, close) = keep_alive_post(&mut conn, &m2_body);
        old_m2_404 += usize::from(st == 404);
        if close {
            closed = true;
            break;
        }
        after.push(m2(port));
        std::thread::sleep(Duration::from_millis(100));
    }
    let reached_d = d.request_count() - hits_open;
    println!(
        "old connection: {old_m1} m1 requests answered 200, {old_m2_404} m2 probes answered 404 \
         (the old configuration), closed by the drain: {closed}; new m2 statuses {after:?}; \
         {reached_d} reached d (its breaker should hold them all off)"
    );
    let log = envoy.log();
    assert!(
        !log.contains("panicked") && !log.contains("Wasm VM failed"),
        "{log}"
    );
    assert!(
        old_m1 >= 3 && old_m2_404 >= 3,
        "the old connection did not keep the old configuration long enough to judge"
    );
    assert_eq!(
        reached_d, 0,
        "d's open breaker was reset by the old connection's requests"
    );
}
