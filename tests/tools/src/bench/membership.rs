//! A fleet that changes (issue 40): the engines are the hosts of one Envoy cluster fed by EDS
//! from a watched file, and the bench rewrites the file's host list mid-run, as an autoscaler
//! and a Deployment's rolling update change a Kubernetes Service's endpoints.
//!
//! Why: self-hosted engines are pods behind one Service, scaled and replaced all day. What a
//! policy keeps of a session's KV cache through those changes, how soon a new pod gets its share
//! of new sessions, and whether anything is sent to a pod that has gone, are what users of such
//! a fleet get. Every policy runs on the same cluster shape: the filter with a pool endpoint
//! (the cluster's `override_host` policy reads the host the filter writes in
//! `x-gateway-destination-endpoint`), Envoy's ring_hash (hash on the session header) and
//! least_request as the cluster's own `lb_policy`.
//!
//! The scenarios (times from the run's origin; `span` is the arrival span of the sessions):
//! - `scale_out`: 4 hosts; at 0.35 × span four new servers start and join the file at once.
//! - `scale_in`: 8 hosts; at 0.35 × span two leave the file; their servers stop
//!   [`STOP_AFTER_REMOVE_MS`] later (a pod's termination grace).
//! - `rollout`: 4 hosts, each replaced in turn from 0.2 × span, one step every 0.15 × span (a
//!   step also waits for the previous one): a new server starts on a new port and joins the
//!   file; [`REMOVE_AFTER_ADD_MS`] later the old one leaves it; [`STOP_AFTER_REMOVE_MS`] later
//!   the old server stops (maxSurge 1, maxUnavailable 0).
//! - `steady` (not part of `all`): 4 hosts, no change: what the filter's rules for a changing
//!   fleet cost a fleet that does not change (no follow-up may move).
//!
//! The file is written whole and renamed into the watched directory (what Envoy's file-based
//! xDS expects); every Envoy of the run (one, or three replicas behind the round-robin front of
//! `deployment.rs`) watches the same file. What counts is in `membership_summary.rs`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::deployment::{DeployOpts, Deployment};
use super::membership_summary::{self, Events, HostLife, MembershipSummary};
use super::support::{self, EnvoyConfig, MockUpstream};
use super::topology::{self, Policy};
use super::workload::{self, SessionPlan, WorkloadParams};

/// The Envoy cluster whose hosts are the engines.
pub const POOL_CLUSTER: &str = "engines_pool";
/// The header the filter writes the chosen host into and the cluster's `override_host` policy
/// reads (the filter's default `destination_header`).
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// The EDS file's name in its watched directory.
pub const EDS_FILE: &str = "engines_pool.json";

/// From a new host's addition to its predecessor's removal (a rollout's readiness wait).
pub const REMOVE_AFTER_ADD_MS: u64 = 1_000;
/// From a host's removal to its server's stop (a pod's termination grace: what was in flight
/// finishes).
pub const STOP_AFTER_REMOVE_MS: u64 = 3_000;

/// The membership scenarios (`--membership`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    ScaleOut,
    ScaleIn,
    Rollout,
    Steady,
}

/// One change to the fleet, not before `at_ms`; the changes run in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Start the servers of these slots (each a new port).
    Start(Vec<usize>),
    /// Add these slots' hosts to the file.
    Add(Vec<usize>),
    /// Remove them from the file.
    Remove(Vec<usize>),
    /// Stop their servers.
    Stop(Vec<usize>),
}

impl Change {
    /// `--membership all` (`steady` is asked for by name).
    pub const ALL: [Change; 3] = [Change::ScaleOut, Change::ScaleIn, Change::Rollout];

    pub fn name(&self) -> &'static str {
        match self {
            Change::ScaleOut => "scale_out",
            Change::ScaleIn => "scale_in",
            Change::Rollout => "rollout",
            Change::Steady => "steady",
        }
    }

    pub fn parse(s: &str) -> Option<Change> {
        Change::ALL
            .into_iter()
            .chain([Change::Steady])
            .find(|c| c.name() == s)
    }

    /// Hosts in the file at the start (slots `0..n`).
    pub fn initial_hosts(&self) -> usize {
        match self {
            Change::ScaleOut | Change::Rollout | Change::Steady => 4,
            Change::ScaleIn => 8,
        }
    }

    /// The fleet's changes for a run whose arrivals span `span_ms`: `(not before ms, action)`.
    pub fn actions(&self, span_ms: u64) -> Vec<(u64, Action)> {
        let at = |f: f64| (span_ms as f64 * f).round() as u64;
        match self {
            Change::ScaleOut => {
                let new: Vec<usize> = (4..8).collect();
                vec![
                    (at(0.35), Action::Start(new.clone())),
                    (at(0.35), Action::Add(new)),
                ]
            }
            Change::Steady => Vec::new(),
            Change::ScaleIn => {
                let out = vec![6, 7];
                vec![
                    (at(0.35), Action::Remove(out.clone())),
                    (at(0.35) + STOP_AFTER_REMOVE_MS, Action::Stop(out)),
                ]
            }
            Change::Rollout => {
                let mut steps: Vec<(u64, Action)> = (0..4)
                    .flat_map(|k| {
                        let t = at(0.2 + 0.15 * k as f64);
                        let (old, new) = (vec![k], vec![4 + k]);
                        [
                            (t, Action::Start(new.clone())),
                            (t, Action::Add(new)),
                            (t + REMOVE_AFTER_ADD_MS, Action::Remove(old.clone())),
                            (
                                t + REMOVE_AFTER_ADD_MS + STOP_AFTER_REMOVE_MS,
                                Action::Stop(old),
                            ),
                        ]
                    })
                    .collect();
                // A step's stop may fall after the next step's start (the old pod terminates
                // while the next new one starts); a stable sort keeps each step's own order.
                steps.sort_by_key(|s| s.0);
                steps
            }
        }
    }

    /// One line for the report.
    pub fn describe(&self, span_ms: u64) -> String {
        let s = |ms: u64| format!("{:.1} s", ms as f64 / 1000.0);
        let at = |f: f64| (span_ms as f64 * f).round() as u64;
        match self {
            Change::Steady => "4 hosts, no change".to_string(),
            Change::ScaleOut => format!(
                "4 hosts; at {} four new servers start and join the EDS file at once (4 → 8)",
                s(at(0.35))
            ),
            Change::ScaleIn => format!(
                "8 hosts; at {} two leave the EDS file (8 → 6); their servers stop {} later",
                s(at(0.35)),
                s(STOP_AFTER_REMOVE_MS)
            ),
            Change::Rollout => format!(
                "4 hosts replaced one at a time from {} (steps {} apart, or when the previous \
                 step is done): a new server on a new port starts and joins the file, the old \
                 host leaves it {} later and its server stops {} after that",
                s(at(0.2)),
                s(at(0.15)),
                s(REMOVE_AFTER_ADD_MS),
                s(STOP_AFTER_REMOVE_MS)
            ),
        }
    }
}

/// The workload of the membership runs from the run's: one model that every host serves.
pub fn workload(base: &WorkloadParams, quick: bool) -> WorkloadParams {
    let mut w = base.clone();
    w.second_model_share = 0.0;
    w.system_prompts = 0;
    // Full: ≈ 25 s of arrivals at 6 sessions/s of 6 turns (≈ 36 requests/s), so the changes
    // fall among live sessions and a run with its tail lasts ≈ 35 s. Quick: ≈ 15 s of arrivals
    // of 3-turn sessions.
    (w.sessions, w.rate_per_s) = if quick { (60, 4.0) } else { (150, 6.0) };
    w
}

/// The EDS file's content: one `ClusterLoadAssignment` for [`POOL_CLUSTER`] with these ports
/// on 127.0.0.1.
pub fn eds_document(ports: &[u16], version: u64) -> Value {
    let lb: Vec<Value> = ports
        .iter()
        .map(|p| json!({"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}))
        .collect();
    json!({
        "version_info": version.to_string(),
        "resources": [{
            "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
            "cluster_name": POOL_CLUSTER,
            "endpoints": [{"lb_endpoints": lb}],
        }],
    })
}

/// Writes the file whole, then renames it into `dir` (Envoy's watch fires on the rename).
pub fn write_eds(dir: &Path, ports: &[u16], version: u64) -> Result<(), String> {
    let tmp = dir.join(format!(".{EDS_FILE}.tmp"));
    let text = eds_document(ports, version).to_string();
    std::fs::write(&tmp, text).map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, dir.join(EDS_FILE)).map_err(|e| format!("{}: {e}", dir.display()))
}

/// The pool cluster: EDS from the watched file. The filter's variants get the `override_host`
/// policy (the host named in [`DESTINATION_HEADER`], else least_request); Envoy's balancers
/// their `lb_policy`.
pub fn pool_cluster(template: &Value, eds_dir: &Path, lb: Option<&str>) -> Result<Value, String> {
    let mut c = template.clone();
    let o = c.as_object_mut().ok_or("cluster is not an object")?;
    o.remove("load_assignment");
    o.insert("name".into(), json!(POOL_CLUSTER));
    o.insert("type".into(), json!("EDS"));
    o.insert(
        "eds_cluster_config".into(),
        json!({"eds_config": {
            "resource_api_version": "V3",
            "path_config_source": {
                "path": eds_dir.join(EDS_FILE).display().to_string(),
                "watched_directory": {"path": eds_dir.display().to_string()},
            },
        }}),
    );
    // The upstream stamp (every answer names the host that served it: how the filter learns a
    // pool's hosts, docs/configuration.md#pools), the same for every policy so that the
    // clusters differ only in how a host is picked.
    let shaped = support::pool::pool_cluster(
        POOL_CLUSTER,
        &eds_dir.join(EDS_FILE),
        eds_dir,
        "least_request",
    );
    if let Some(opts) = shaped.get("typed_extension_protocol_options") {
        o.insert("typed_extension_protocol_options".into(), opts.clone());
    }
    match lb {
        Some(lb) => {
            o.insert("lb_policy".into(), json!(lb));
        }
        None => {
            o.insert(
                "load_balancing_policy".into(),
                shaped
                    .get("load_balancing_policy")
                    .cloned()
                    .unwrap_or_else(override_host_policy),
            );
        }
    }
    Ok(c)
}

/// `load_balancing_policy` of a pool cluster: the host in [`DESTINATION_HEADER`] (a
/// comma-separated list: the first that exists), else least_request.
pub fn override_host_policy() -> Value {
    json!({"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
            "override_host_sources": [{"header": DESTINATION_HEADER}],
            "fallback_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.least_request",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest",
                },
            }}]},
        },
    }}]})
}

/// The filter's configuration: one pool endpoint, every host of [`POOL_CLUSTER`], scraped as
/// the engine it is when the variant scrapes.
pub fn pool_plugin_config(policy: Policy, open_ms: u64) -> Value {
    let mut ep = json!({"name": "engines", "cluster": POOL_CLUSTER, "pool": true,
                        "models": [workload::MODEL]});
    if let (true, Some(o)) = (policy.scrapes(), ep.as_object_mut()) {
        let mut m = json!({"format": topology::METRICS_FORMAT});
        if let (Some(ms), Some(mo)) = (topology::metrics_interval_ms(), m.as_object_mut()) {
            mo.insert("interval_ms".into(), json!(ms));
        }
        o.insert("metrics".into(), m);
    }
    let mut cfg = json!({
        "endpoints": [ep],
        "session_header": workload::SESSION_HEADER,
        "open_ms": open_ms,
    });
    if let (Some(c), Some(extra)) = (cfg.as_object_mut(), policy.plugin_extra().as_object()) {
        c.extend(extra.clone());
    }
    cfg
}

/// The bootstrap of `policy` on the pool cluster fed from `eds_dir`.
pub fn bootstrap(
    policy: Policy,
    eds_dir: &Path,
    wasm: &Path,
    concurrency: u32,
    envoy_retries: bool,
    open_ms: u64,
) -> Result<String, String> {
    let lb = policy.lb_policy();
    let mut cfg = EnvoyConfig {
        concurrency,
        log_level: "warn".into(),
        with_filter: lb.is_none(),
        clusters: vec![(POOL_CLUSTER.into(), 0)],
        ..EnvoyConfig::default()
    };
    if lb.is_none() {
        cfg.plugin_config = pool_plugin_config(policy, open_ms);
    } else {
        let mut extra = serde_json::Map::new();
        if matches!(policy, Policy::RingHash | Policy::Maglev) {
            extra.insert(
                "hash_policy".into(),
                json!([{"header": {"header_name": workload::SESSION_HEADER}}]),
            );
        }
        if envoy_retries {
            extra.insert("retry_policy".into(), topology::envoy_retry_policy());
        }
        cfg.route_extra = Value::Object(extra);
    }
    let text = support::render_bootstrap(&cfg, wasm, 0, 0);
    let mut v: Value = serde_json::from_str(&text).map_err(|e| format!("bootstrap: {e}"))?;
    let cluster = v
        .pointer_mut("/static_resources/clusters/0")
        .ok_or("bootstrap has no cluster")?;
    *cluster = pool_cluster(cluster, eds_dir, lb)?;
    serde_json::to_string_pretty(&v).map_err(|e| e.to_string())
}

/// Everything a membership run needs besides policy, scenario and topology.
#[derive(Clone, Debug)]
pub struct MembershipOpts {
    pub mock_args: Vec<String>,
    pub concurrency: u32,
    pub replica_concurrency: u32,
    pub front_concurrency: u32,
    pub drain_s: u32,
    pub envoy_retries: bool,
    pub open_ms: u64,
    pub request_timeout: Duration,
    pub work_dir: PathBuf,
    pub raw_dir: Option<PathBuf>,
}

/// One server slot: its server while it runs, and its life in the cluster.
struct Slot {
    mock: Option<MockUpstream>,
    /// When the server started (its log's `t_ms` count from about then).
    started: Instant,
    life: HostLife,
}

impl Slot {
    fn start(i: usize, args: &[String]) -> Slot {
        let name = format!("h{i}");
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let mock = MockUpstream::start(&name, &[workload::MODEL], &a);
        topology::record_pid(mock.pid());
        Slot {
            started: Instant::now(),
            life: HostLife {
                name,
                port: mock.port,
                ..HostLife::default()
            },
            mock: Some(mock),
        }
    }

    /// Reads the server's request log into `life.received_ms` (times from `t0`), then stops it.
    fn stop(&mut self, t0: Instant) {
        let Some(m) = self.mock.take() else { return };
        let offset = self.started.saturating_duration_since(t0).as_secs_f64() * 1000.0
            - t0.saturating_duration_since(self.started).as_secs_f64() * 1000.0;
        self.life.received_ms = m
            .requests()
            .iter()
            .filter(|r| r.get("path").and_then(Value::as_str) == Some("/v1/chat/completions"))
            .filter_map(|r| r.get("t_ms").and_then(Value::as_f64))
            .map(|t| t + offset)
            .collect();
        drop(m);
    }
}

fn since_ms(t0: Instant) -> f64 {
    let now = Instant::now();
    now.saturating_duration_since(t0).as_secs_f64() * 1000.0
        - t0.saturating_duration_since(now).as_secs_f64() * 1000.0
}

/// Applies `actions` in order, each not before its time from `t0`; returns the slots and the
/// events as they happened.
fn inject(
    actions: &[(u64, Action)],
    mut slots: Vec<Slot>,
    eds_dir: &Path,
    mock_args: &[String],
    t0: Instant,
) -> Result<(Vec<Slot>, Events), String> {
    let mut events = Vec::new();
    let mut version = 1u64;
    for (at, action) in actions {
        if let Some(d) = (t0 + Duration::from_millis(*at)).checked_duration_since(Instant::now()) {
            std::thread::sleep(d);
        }
        let names = |v: &[usize]| {
            v.iter()
                .map(|i| format!("h{i}"))
                .collect::<Vec<_>>()
                .join(",")
        };
        match action {
            Action::Start(v) => {
                for &i in v {
                    while slots.len() <= i {
                        let n = slots.len();
                        slots.push(Slot::start(n, mock_args));
                    }
                }
                events.push((since_ms(t0), format!("start {}", names(v))));
            }
            Action::Add(v) | Action::Remove(v) => {
                let adding = matches!(action, Action::Add(_));
                let now = since_ms(t0);
                for &i in v {
                    if let Some(s) = slots.get_mut(i) {
                        if adding {
                            s.life.added_ms = Some(now);
                        } else {
                            s.life.removed_ms = Some(now);
                        }
                    }
                }
                version += 1;
                let ports: Vec<u16> = slots
                    .iter()
                    .filter(|s| s.life.present_at(now))
                    .map(|s| s.life.port)
                    .collect();
                write_eds(eds_dir, &ports, version)?;
                let verb = if adding { "add" } else { "remove" };
                events.push((now, format!("{verb} {} ({} hosts)", names(v), ports.len())));
            }
            Action::Stop(v) => {
                for &i in v {
                    if let Some(s) = slots.get_mut(i) {
                        s.stop(t0);
                        s.life.stopped_ms = Some(since_ms(t0));
                    }
                }
                events.push((since_ms(t0), format!("stop {}", names(v))));
            }
        }
    }
    Ok((slots, events))
}

/// One topology × policy × membership scenario.
pub fn run(
    policy: Policy,
    change: Change,
    replicas: usize,
    plans: &[SessionPlan],
    opts: &MembershipOpts,
    wasm: &Path,
) -> Result<MembershipSummary, String> {
    let started = Instant::now();
    let eds_dir = opts.work_dir.join(format!(
        "eds-{}-{}-{}",
        change.name(),
        policy.name(),
        support::unique_u32()
    ));
    std::fs::create_dir_all(&eds_dir).map_err(|e| format!("{}: {e}", eds_dir.display()))?;
    let slots: Vec<Slot> = (0..change.initial_hosts())
        .map(|i| Slot::start(i, &opts.mock_args))
        .collect();
    let ports: Vec<u16> = slots.iter().map(|s| s.life.port).collect();
    write_eds(&eds_dir, &ports, 1)?;
    let boot = bootstrap(
        policy,
        &eds_dir,
        wasm,
        opts.concurrency,
        opts.envoy_retries,
        opts.open_ms,
    )?;
    let deploy = DeployOpts {
        replicas,
        concurrency: opts.concurrency,
        replica_concurrency: opts.replica_concurrency,
        front_concurrency: opts.front_concurrency,
        drain_s: opts.drain_s,
    };
    let deployment = Deployment::start(&boot, &format!("pool-{}", policy.name()), &deploy)?;
    let port = deployment.port();
    let span_ms = SessionPlan::last_arrival_ms(plans);
    let actions = change.actions(span_ms);
    let t0 = Instant::now() + Duration::from_millis(200);
    let (recs, injected) = std::thread::scope(|sc| {
        let (eds_dir, args) = (&eds_dir, &opts.mock_args);
        let injector = sc.spawn(move || inject(&actions, slots, eds_dir, args, t0));
        let recs = workload::drive(port, plans, t0, opts.request_timeout);
        let injected = injector
            .join()
            .unwrap_or_else(|_| Err("the membership injector panicked".into()));
        (recs, injected)
    });
    let (mut slots, events) = injected?;
    drop(deployment);
    for s in &mut slots {
        s.stop(t0);
    }
    let _ = std::fs::remove_dir_all(&eds_dir);
    let lives: Vec<HostLife> = slots.into_iter().map(|s| s.life).collect();
    if let Some(dir) = &opts.raw_dir {
        let name = format!(
            "pool-{}-{}",
            super::summary::label(policy.name(), replicas as u32).replace(" ×", "-x"),
            change.name()
        );
        let mut sorted: Vec<&workload::Record> = recs.iter().collect();
        sorted.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
        let text: String = sorted
            .iter()
            .map(|r| r.to_json().to_string() + "\n")
            .collect();
        let _ = std::fs::write(dir.join(format!("{name}.jsonl")), text);
    }
    let mut s =
        membership_summary::summarize(change.name(), policy.name(), replicas as u32, &recs, &lives);
    s.events = events;
    s.wall_s = started.elapsed().as_secs_f64();
    Ok(s)
}

/// The policies a membership run compares by default.
pub const POLICIES: [Policy; 3] = [Policy::LeastRequest, Policy::RingHash, Policy::Filter];

/// The report: `latest.md`.
pub fn markdown(
    rows: &[MembershipSummary],
    changes: &[Change],
    span_ms: u64,
    meta: &[(&str, String)],
) -> String {
    let mut s = String::from("# A fleet that changes: pools on an EDS cluster (issue 40)\n\n");
    for (k, v) in meta {
        s.push_str(&format!("- {k}: {v}\n"));
    }
    s.push_str("\nScenarios:\n");
    for c in changes {
        s.push_str(&format!("- `{}`: {}\n", c.name(), c.describe(span_ms)));
    }
    s.push_str(&format!(
        "\nWhat counts (tests/tools/src/bench/membership_summary.rs): a follow-up is turn k ≥ 1 \
         after a successful turn k−1; those whose previous host had left the file before they \
         were sent are counted apart. A new host's fair share is 1 / hosts in the file; its time \
         to fair share is from its addition to the first new session at which it had ≥ {:.0} % \
         of it among the last {} new sessions. Requests reaching a host after it left come from \
         each server's own request log.\n\n",
        membership_summary::FAIR_FRACTION * 100.0,
        membership_summary::FAIR_WINDOW
    ));
    s.push_str(membership_summary::markdown_header());
    for r in rows {
        s.push_str(&r.markdown_row());
    }
    s.push_str("\nMembership changes as they happened (s from the run's origin), per run:\n\n");
    for r in rows {
        let ev: Vec<String> = r
            .events
            .iter()
            .map(|(t, e)| format!("{:.1} {e}", t / 1000.0))
            .collect();
        s.push_str(&format!(
            "- {} / {}: {}\n",
            r.scenario,
            r.label(),
            ev.join("; ")
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replays the actions on a set of hosts in the file and of running servers.
    fn replay(c: Change) -> Vec<(u64, Vec<usize>, Vec<usize>)> {
        let mut file: Vec<usize> = (0..c.initial_hosts()).collect();
        let mut running = file.clone();
        let mut out = Vec::new();
        for (t, a) in c.actions(25_000) {
            match a {
                Action::Start(v) => running.extend(v),
                Action::Add(v) => {
                    for i in v {
                        assert!(running.contains(&i), "{c:?}: h{i} added before it started");
                        file.push(i);
                    }
                }
                Action::Remove(v) => file.retain(|i| !v.contains(i)),
                Action::Stop(v) => {
                    for i in &v {
                        assert!(!file.contains(i), "{c:?}: h{i} stopped while in the file");
                    }
                    running.retain(|i| !v.contains(i));
                }
            }
            out.push((t, file.clone(), running.clone()));
        }
        out
    }

    #[test]
    fn the_scenarios_change_the_fleet_as_their_names_say() {
        let last = |c| replay(c).last().cloned().unwrap();
        assert_eq!(last(Change::ScaleOut).1, (0..8).collect::<Vec<_>>());
        let (_, file, running) = last(Change::ScaleIn);
        assert_eq!((file.len(), running.len()), (6, 6));
        let (_, file, running) = last(Change::Rollout);
        assert_eq!(file, [4, 5, 6, 7], "every host replaced by a new server");
        assert_eq!(running, [4, 5, 6, 7]);
        // A rollout never has fewer than 4 hosts in the file (maxUnavailable 0), and each
        // step's removal comes after its replacement joined.
        for (_, file, _) in replay(Change::Rollout) {
            assert!((4..=5).contains(&file.len()), "{file:?}");
        }
        let acts = Change::Rollout.actions(25_000);
        let times: Vec<u64> = acts.iter().map(|a| a.0).collect();
        assert!(times.windows(2).all(|w| w[0] <= w[1]), "in time order");
        // Every change falls within the arrivals (sessions live across it).
        assert!(times.iter().all(|t| *t < 25_000));
    }

    #[test]
    fn the_pool_cluster_is_eds_from_the_watched_file_with_override_host_for_the_filter() {
        let dir = Path::new("/tmp/eds-x");
        let boot = |p: Policy| -> Value {
            serde_json::from_str(&bootstrap(p, dir, Path::new("m.wasm"), 1, true, 3000).unwrap())
                .unwrap()
        };
        let f = boot(Policy::Filter);
        let c = &f["static_resources"]["clusters"][0];
        assert_eq!(c["name"], POOL_CLUSTER);
        assert_eq!(c["type"], "EDS");
        assert!(c.get("load_assignment").is_none());
        assert_eq!(
            c["eds_cluster_config"]["eds_config"]["path_config_source"]["path"],
            "/tmp/eds-x/engines_pool.json"
        );
        let lb = &c["load_balancing_policy"]["policies"][0]["typed_extension_config"];
        assert_eq!(lb["name"], "envoy.load_balancing_policies.override_host");
        assert_eq!(
            lb["typed_config"]["override_host_sources"][0]["header"],
            DESTINATION_HEADER
        );
        assert!(c.get("lb_policy").is_none());
        assert_eq!(
            c.pointer("/typed_extension_protocol_options/envoy.extensions.upstreams.http.v3.HttpProtocolOptions/http_filters/0/name"),
            Some(&json!("envoy.filters.http.header_mutation")),
            "the upstream stamp the filter learns hosts from"
        );
        let text = f.to_string();
        assert!(
            text.contains(r#"\"pool\":true"#),
            "the plugin has a pool endpoint"
        );
        assert!(
            text.contains(r#"\"metrics\":{\"format\":\"vllm\""#)
                || topology::metrics_interval_ms().is_some()
        );
        let r = boot(Policy::RingHash);
        let c = &r["static_resources"]["clusters"][0];
        assert_eq!(
            (c["type"].as_str(), c["lb_policy"].as_str()),
            (Some("EDS"), Some("RING_HASH"))
        );
        assert!(c.get("load_balancing_policy").is_none());
        assert!(
            c.get("typed_extension_protocol_options").is_some(),
            "the same cluster shape"
        );
        let route = r
            .pointer("/static_resources/listeners/0/filter_chains/0/filters/0/typed_config/route_config/virtual_hosts/0/routes/0/route")
            .unwrap();
        assert_eq!(route["cluster"], POOL_CLUSTER);
        assert_eq!(
            route["hash_policy"][0]["header"]["header_name"],
            workload::SESSION_HEADER
        );
        let l = boot(Policy::LeastRequest);
        assert!(l
            .pointer("/static_resources/listeners/0/filter_chains/0/filters/0/typed_config/route_config/virtual_hosts/0/routes/0/route/hash_policy")
            .is_none());
        let doc = eds_document(&[1001, 1002], 3);
        assert_eq!(doc["version_info"], "3");
        assert_eq!(
            doc["resources"][0]["endpoints"][0]["lb_endpoints"][1]["endpoint"]["address"]
                ["socket_address"]["port_value"],
            1002
        );
    }
}
