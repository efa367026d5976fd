//! Bad plugin configurations through a real Envoy: each one must keep Envoy from starting, with
//! a log line that names the offending field (`computeflux: invalid configuration: <field> …`);
//! a good configuration is logged once, with its effective values, however many VMs read it.
//!
//! Envoy exits within about a second when the plugin's `on_configure` returns false, so the
//! cases run on a small, fixed number of threads to keep the 2-core machine usable.
//! Configurations that are not JSON at all cannot be expressed through
//! [`EnvoyConfig::plugin_config`] (a JSON value), so those cases, and the ones that change the
//! filter's failure policy, write their own bootstrap from [`render_bootstrap`].

// Test code: a failed unwrap is a failed test.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use crate::support;

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::{envoy_bin, render_bootstrap, unique_u32, wasm_path, Envoy, EnvoyConfig};

/// Threads starting Envoys at once.
const PARALLEL: usize = 2;
/// Clusters every bootstrap defines (never connected to: Envoy refuses to start first).
const CLUSTERS: &[(&str, u16)] = &[("a", 9), ("b", 9), ("c", 9)];

enum Source {
    /// A JSON value, through `Envoy::try_start`.
    Json(Value),
    /// Raw configuration text, through a bootstrap written here.
    Raw(&'static str),
    /// A JSON value with the Wasm filter's failure policy overridden (`(key, value)` set in the
    /// filter's `config`, e.g. `("failure_policy", "FAIL_OPEN")`).
    Policy(Value, &'static str, Value),
}

struct Case {
    what: &'static str,
    source: Source,
    /// Every one of these must appear after `computeflux: invalid configuration: ` on a line.
    expect: Vec<&'static str>,
}

fn case(what: &'static str, config: Value, expect: &[&'static str]) -> Case {
    Case {
        what,
        source: Source::Json(config),
        expect: expect.to_vec(),
    }
}

fn ep(name: &str) -> Value {
    json!({"name": name, "cluster": "a"})
}

fn cases() -> Vec<Case> {
    let with_ep = |extra: Value| {
        let mut e = json!({"name": "a", "cluster": "a"});
        if let (Some(o), Value::Object(more)) = (e.as_object_mut(), extra) {
            o.extend(more);
        }
        json!({"endpoints": [ep("x"), ep("y"), e]})
    };
    let top = |key: &str, v: Value| {
        let mut c = json!({"endpoints": [ep("a")]});
        c[key] = v;
        c
    };
    vec![
        case("missing endpoints", json!({}), &["endpoints is required"]),
        case(
            "empty endpoints",
            json!({"endpoints": []}),
            &["endpoints must list at least one endpoint"],
        ),
        case(
            "endpoints not an array",
            json!({"endpoints": {"name": "a", "cluster": "a"}}),
            &["endpoints must be an array, got an object"],
        ),
        case(
            "endpoint not an object",
            json!({"endpoints": ["a"]}),
            &["endpoints[0] must be an object, got a string"],
        ),
        case(
            "duplicate names",
            json!({"endpoints": [ep("a"), ep("b"), ep("a")]}),
            &["endpoints names must be unique: \"a\" is used twice (entries 0 and 2)"],
        ),
        case(
            "missing cluster",
            json!({"endpoints": [ep("a"), {"name": "b"}]}),
            &["endpoints[1].cluster is required"],
        ),
        case(
            "missing name",
            json!({"endpoints": [{"cluster": "a"}]}),
            &["endpoints[0].name is required"],
        ),
        case(
            "invalid name",
            json!({"endpoints": [{"name": "a b", "cluster": "a"}]}),
            &["endpoints[0].name must match [A-Za-z0-9_-]{1,64}"],
        ),
        case(
            "weight zero",
            with_ep(json!({"weight": 0})),
            &["endpoints[2].weight must be > 0, got 0"],
        ),
        case(
            "weight negative",
            with_ep(json!({"weight": -1})),
            &["endpoints[2].weight must be > 0, got -1"],
        ),
        case(
            "weight NaN-like string",
            with_ep(json!({"weight": "NaN"})),
            &["endpoints[2].weight must be a number, got a string"],
        ),
        case(
            "weight numeric string",
            with_ep(json!({"weight": "1"})),
            &["endpoints[2].weight must be a number, got a string"],
        ),
        case(
            "weight too large",
            with_ep(json!({"weight": 1e300})),
            &["endpoints[2].weight must be <= 1000000"],
        ),
        case(
            "empty models",
            with_ep(json!({"models": []})),
            &["endpoints[2].models must not be empty"],
        ),
        case(
            "model not a string",
            with_ep(json!({"models": ["m", 7]})),
            &["endpoints[2].models[1] must be a string, got a number"],
        ),
        case(
            "disabled not a boolean",
            with_ep(json!({"disabled": "yes"})),
            &["endpoints[2].disabled must be a boolean, got a string"],
        ),
        case(
            "ewma_alpha zero",
            top("ewma_alpha", json!(0)),
            &["ewma_alpha must be in (0, 1], got 0"],
        ),
        case(
            "ewma_alpha above one",
            top("ewma_alpha", json!(1.5)),
            &["ewma_alpha must be in (0, 1], got 1.5"],
        ),
        // Removed keys name what replaced them.
        case(
            "success_rate_alpha removed",
            top("success_rate_alpha", json!(0.2)),
            &["success_rate_alpha was removed: it is built in (0.1, `routing::select::SUCCESS_RATE_ALPHA`)"],
        ),
        case(
            "quota_pacing removed",
            top("quota_pacing", json!(false)),
            &["quota_pacing was removed: quota pacing is always on"],
        ),
        case(
            "pin_break_ratio moved into tuning",
            top("pin_break_ratio", json!(4.0)),
            &["pin_break_ratio was moved: set it as `tuning.pin_break_ratio` (unstable)"],
        ),
        case(
            "tuning key out of bounds",
            top("tuning", json!({"quota_reserve_percent": 101})),
            &["tuning.quota_reserve_percent must be in 0..=100, got 101"],
        ),
        case(
            "half_open_probes zero",
            top("half_open_probes", json!(0)),
            &["half_open_probes must be in 1..=1000, got 0"],
        ),
        case(
            "max_attempts as a string",
            top("max_attempts", json!("3")),
            &["max_attempts must be an integer, got a string"],
        ),
        case(
            "affinity_max_sessions fractional",
            top("affinity_max_sessions", json!(1.5)),
            &["affinity_max_sessions must be an integer in 1..=10000000, got 1.5"],
        ),
        case(
            "max_body_bytes above Envoy's buffers",
            top("max_body_bytes", json!(32 * 1024 * 1024)),
            &["max_body_bytes must be in 1..=16777216, got 33554432"],
        ),
        case(
            "expose_headers not a boolean",
            top("expose_headers", json!(1)),
            &["expose_headers must be a boolean, got a number"],
        ),
        case(
            "unknown top-level key",
            top("affinity_ttl", json!(1000)),
            &["affinity_ttl is not a known key (known: endpoints,"],
        ),
        case(
            "empty key",
            top("", json!(1)),
            &["\"\" is not a known key (known: endpoints,"],
        ),
        case(
            "unknown endpoint key",
            with_ep(json!({"weigth": 2})),
            &["endpoints[2].weigth is not a known key (known: name, cluster,"],
        ),
        case(
            "invalid routing header name",
            top("routing_header", json!("x cluster")),
            &["routing_header must be a valid HTTP header name, got \"x cluster\""],
        ),
        case(
            "session header equals routing header",
            top("session_header", json!("x-computeflux-cluster")),
            &["session_header must differ from routing_header"],
        ),
        case(
            "invalid endpoint header name",
            with_ep(json!({"headers": {"bad header": "v"}})),
            &["endpoints[2].headers.\"bad header\" is not a valid HTTP header name"],
        ),
        case(
            "endpoint header value with CR/LF",
            with_ep(json!({"headers": {"authorization": "Bearer sk-cfg-secret\r\nx-evil: 1"}})),
            &["endpoints[2].headers.authorization value must be printable ASCII without CR/LF"],
        ),
        case(
            "endpoint header value not a string",
            with_ep(json!({"headers": {"x-api-key": 42}})),
            &["endpoints[2].headers.x-api-key value must be a string, got a number"],
        ),
        case(
            "reserved endpoint header",
            with_ep(json!({"headers": {"Host": "evil"}})),
            &["endpoints[2].headers.Host may not be set by an endpoint"],
        ),
        case(
            "several problems at once",
            json!({"endpoints": [ep("a"), {"name": "b", "cluster": "b", "weight": -2}],
                   "ewma_alpha": 2, "bogus": true}),
            &[
                "endpoints[1].weight must be > 0, got -2",
                "ewma_alpha must be in (0, 1], got 2",
                "bogus is not a known key",
            ],
        ),
        Case {
            what: "not JSON",
            source: Source::Raw("{nope"),
            expect: vec!["configuration is not valid JSON"],
        },
        Case {
            what: "empty configuration",
            source: Source::Raw(""),
            expect: vec!["configuration is not valid JSON"],
        },
        Case {
            what: "JSON but not an object",
            source: Source::Raw("[1, 2]"),
            expect: vec!["configuration must be a JSON object, got an array"],
        },
        Case {
            what: "number out of range",
            source: Source::Raw(r#"{"endpoints":[{"name":"a","cluster":"a","weight":1e400}]}"#),
            expect: vec!["configuration is not valid JSON"],
        },
        Case {
            what: "bad configuration with failure_policy FAIL_OPEN",
            source: Source::Policy(
                with_ep(json!({"weight": -1})),
                "failure_policy",
                json!("FAIL_OPEN"),
            ),
            expect: vec!["endpoints[2].weight must be > 0, got -1"],
        },
        Case {
            what: "bad configuration with fail_open: true",
            source: Source::Policy(with_ep(json!({"weight": -1})), "fail_open", json!(true)),
            expect: vec!["endpoints[2].weight must be > 0, got -1"],
        },
    ]
}

/// The filter's `config` object inside a rendered bootstrap.
fn filter_config(bootstrap: &mut Value) -> &mut Value {
    bootstrap
        .pointer_mut(
            "/static_resources/listeners/0/filter_chains/0/filters/0/typed_config/http_filters/0/typed_config/config",
        )
        .expect("the wasm filter's config in the bootstrap")
}

/// Starts Envoy on a bootstrap edited by `edit` and waits for it to exit (≤ 20 s). Returns
/// (exited with failure, log). An Envoy that becomes ready instead is killed: (false, log).
fn run_edited(edit: impl FnOnce(&mut Value)) -> (bool, String) {
    let cfg = EnvoyConfig::new(json!({}), CLUSTERS);
    let wasm = wasm_path();
    let mut bootstrap: Value =
        serde_json::from_str(&render_bootstrap(&cfg, &wasm, 0, 0)).expect("bootstrap is JSON");
    edit(&mut bootstrap);
    let id = unique_u32();
    let dir = std::env::temp_dir().join(format!("computeflux-badcfg-{id}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("envoy.yaml");
    std::fs::write(&config, bootstrap.to_string()).unwrap();
    let log_path = dir.join("envoy.log");
    let mut child = Command::new(envoy_bin())
        .arg("-c")
        .arg(&config)
        .args([
            "--concurrency",
            "2",
            "--disable-hot-restart",
            "--log-level",
            "info",
        ])
        .arg("--base-id")
        .arg(id.to_string())
        .arg("--log-path")
        .arg(&log_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start envoy");
    let deadline = Instant::now() + Duration::from_secs(20);
    let failed = loop {
        match child.try_wait() {
            Ok(Some(status)) => break !status.success(),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break false;
            }
        }
    };
    let log = read(&log_path);
    let _ = std::fs::remove_dir_all(&dir);
    (failed, log)
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

/// Runs one case: `Err(reason)` if Envoy started or the log lacks an expected line.
fn check(c: &Case) -> Result<Duration, String> {
    let start = Instant::now();
    let (refused, log) = match &c.source {
        Source::Json(v) => match Envoy::try_start(EnvoyConfig::new(v.clone(), CLUSTERS)) {
            Ok(envoy) => (false, envoy.log_contents()),
            Err(log) => (true, log),
        },
        Source::Raw(text) => run_edited(|b| {
            filter_config(b)["configuration"]["value"] = json!(text);
        }),
        Source::Policy(v, key, value) => run_edited(|b| {
            let f = filter_config(b);
            f["configuration"]["value"] = json!(v.to_string());
            if let Some(o) = f.as_object_mut() {
                o.remove("failure_policy");
                o.insert(key.to_string(), value.clone());
            }
        }),
    };
    let took = start.elapsed();
    if !refused {
        return Err(format!("Envoy started (or did not exit):\n{log}"));
    }
    let problems: Vec<&str> = log
        .lines()
        .filter_map(|l| {
            l.split_once("computeflux: invalid configuration: ")
                .map(|(_, p)| p)
        })
        .collect();
    for want in &c.expect {
        if !problems.iter().any(|p| p.starts_with(want)) {
            return Err(format!(
                "no line naming {want:?}; problems logged: {problems:#?}"
            ));
        }
    }
    let summary = format!(
        "computeflux: configuration rejected ({} problem(s)); the plugin will not start",
        problems.len()
    );
    if !log.contains(&summary) {
        return Err(format!("missing {summary:?} in:\n{log}"));
    }
    if log.contains("sk-cfg-secret") {
        return Err("a header value (secret) was logged".into());
    }
    if log.contains("configuration accepted") {
        return Err("a rejected configuration was also accepted".into());
    }
    Ok(took)
}

#[test]
fn bad_configurations_keep_envoy_from_starting_and_name_the_field() {
    let cases = cases();
    assert!(cases.len() >= 15);
    let next = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::new());
    let timings = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..PARALLEL {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some(c) = cases.get(i) else { break };
                match check(c) {
                    Ok(t) => timings.lock().unwrap().push((c.what, t)),
                    Err(e) => failures.lock().unwrap().push(format!("{}: {e}", c.what)),
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    let timings = timings.into_inner().unwrap();
    assert_eq!(timings.len(), cases.len());
    let slowest = timings.iter().max_by_key(|(_, t)| *t).unwrap();
    eprintln!(
        "{} bad configurations refused; slowest: {} in {:?}",
        timings.len(),
        slowest.0,
        slowest.1
    );
}

/// The line logged for an accepted configuration, or panics with the log.
fn accepted_lines(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| l.contains("computeflux: configuration accepted: "))
        .collect()
}

#[test]
fn good_configuration_is_logged_once_with_effective_values() {
    let plugin = json!({
        "endpoints": [
            {"name": "gpu-1", "cluster": "a", "weight": 2.5, "models": ["m1", "m2"],
             "headers": {"authorization": "Bearer sk-good-secret"}},
            {"name": "api-key-2", "cluster": "b", "disabled": true},
        ],
        "ewma_alpha": 0.5,
        "affinity_max_sessions": 5000,
    });
    for concurrency in [2, 4] {
        let mut cfg = EnvoyConfig::new(plugin.clone(), CLUSTERS);
        cfg.concurrency = concurrency;
        let envoy = Envoy::start(cfg);
        // on_configure runs concurrency + 2 times; wait until the workers have configured too.
        let r = support::http::get(envoy.port, "/v1/models");
        assert_ne!(r.status, 0);
        std::thread::sleep(Duration::from_millis(300));
        let log = envoy.log_contents();
        let lines = accepted_lines(&log);
        assert_eq!(
            lines.len(),
            1,
            "concurrency {concurrency}: expected one accepted line:\n{log}"
        );
        let line = lines[0];
        for want in [
            "gpu-1(cluster=a weight=2.5 models=m1|m2 disabled=false headers=[authorization])",
            "api-key-2(cluster=b weight=1 models=* disabled=true headers=[])",
            "routing_header=x-computeflux-cluster",
            "session_header=x-session-id",
            "affinity_ttl_ms=300000",
            "affinity_max_sessions=5000",
            "ewma_alpha=0.5",
            "tuning.retry_budget_min_retries=10",
            "half_open_probes=3",
            "failure_threshold=5",
            "max_attempts=3",
            "max_body_bytes=8388608",
            "failover_timeout_ms=120000",
        ] {
            assert!(line.contains(want), "missing {want:?} in {line}");
        }
        assert!(
            !log.contains("sk-good-secret"),
            "header value logged:\n{log}"
        );
        assert!(!log.contains("invalid configuration"), "{log}");
    }
}
