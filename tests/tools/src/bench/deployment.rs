//! Where the workload's requests enter: one Envoy, or several Envoy replicas (same bootstrap,
//! own ports, nothing shared) behind a fourth, plain round-robin Envoy; and the rolling restart
//! of those replicas.
//!
//! Why: production gateways run several Envoy pods behind a load balancer and restart them on
//! every rollout. A session's follow-up turns then land on any replica, including one that has
//! just started with empty shared data; what a policy keeps of its stickiness there is what its
//! users get.
//!
//! How: the replicas bind port 0 and the front Envoy's static cluster lists the ports they got
//! (see [`topology::front_bootstrap`]). A restart drains the replica (`POST
//! /drain_listeners?graceful`: for `--drain-time-s` every response carries `Connection: close`,
//! then the listener closes), waits until it has no request in flight and no connection left (the
//! front closes its idle ones after its idle timeout), stops it by PID and starts it again on the
//! same port from the same bootstrap: a new process, so a new wasm VM with empty shared data.
//! Meanwhile the front retries a refused connection on another replica.

use std::time::{Duration, Instant};

use serde_json::Value;

use super::support::http;
use super::topology::{self, EnvoyProc};

/// How to deploy Envoy for one run.
#[derive(Clone, Debug)]
pub struct DeployOpts {
    /// 1: one Envoy, the client talks to it directly. More: that many replicas behind a front.
    pub replicas: usize,
    /// `--concurrency` of a lone Envoy.
    pub concurrency: u32,
    /// `--concurrency` of each replica.
    pub replica_concurrency: u32,
    /// `--concurrency` of the front Envoy.
    pub front_concurrency: u32,
    /// `--drain-time-s` of each replica: how long a draining replica keeps accepting
    /// connections (answering each request with `Connection: close`) before its listener closes.
    pub drain_s: u32,
}

/// The Envoys of one run. Every process is stopped (by PID) when this is dropped.
pub struct Deployment {
    replicas: Vec<Replica>,
    front: Option<EnvoyProc>,
    drain_s: u32,
}

struct Replica {
    /// None only between stopping and starting again.
    envoy: Option<EnvoyProc>,
    /// Rendered with listener port 0; a restart binds [`Replica::port`] instead.
    bootstrap: String,
    port: u16,
    label: String,
    concurrency: u32,
}

/// One replica restart; times in ms from the run's origin.
#[derive(Clone, Debug)]
pub struct Restart {
    pub replica: usize,
    pub drain_ms: f64,
    pub stopped_ms: f64,
    pub ready_ms: f64,
    /// Requests and connections the replica still had when it was stopped (0 unless the wait
    /// for them timed out).
    pub open_requests: u64,
    pub open_connections: u64,
}

/// How long a drained replica may take to lose its last request and connection before it is
/// stopped anyway (the requests' own timeout is 30 s).
const IDLE_WAIT_LIMIT: Duration = Duration::from_secs(35);

impl Deployment {
    /// Starts `opts.replicas` Envoys from `bootstrap` (listener port 0) and, for more than one,
    /// the front Envoy in front of them.
    pub fn start(bootstrap: &str, label: &str, opts: &DeployOpts) -> Result<Deployment, String> {
        if opts.replicas <= 1 {
            let envoy = EnvoyProc::start(bootstrap, opts.concurrency, label)?;
            let port = envoy.port;
            return Ok(Deployment {
                replicas: vec![Replica {
                    envoy: Some(envoy),
                    bootstrap: bootstrap.to_string(),
                    port,
                    label: label.to_string(),
                    concurrency: opts.concurrency,
                }],
                front: None,
                drain_s: opts.drain_s,
            });
        }
        let extra = replica_args(opts.drain_s);
        // Started side by side: each Envoy spends most of its start-up compiling the module.
        let started: Vec<Result<EnvoyProc, String>> = std::thread::scope(|sc| {
            let handles: Vec<_> = (0..opts.replicas)
                .map(|i| {
                    let (extra, label) = (&extra, format!("{label}-r{i}"));
                    sc.spawn(move || {
                        EnvoyProc::start_with(bootstrap, opts.replica_concurrency, &label, extra)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err("replica start-up panicked".into()))
                })
                .collect()
        });
        let mut replicas = Vec::with_capacity(opts.replicas);
        for (i, envoy) in started.into_iter().enumerate() {
            let envoy = envoy?;
            replicas.push(Replica {
                port: envoy.port,
                envoy: Some(envoy),
                bootstrap: bootstrap.to_string(),
                label: format!("{label}-r{i}"),
                concurrency: opts.replica_concurrency,
            });
        }
        let ports: Vec<u16> = replicas.iter().map(|r| r.port).collect();
        let front_boot = topology::front_bootstrap(&ports, opts.front_concurrency)?;
        let front = EnvoyProc::start(
            &front_boot,
            opts.front_concurrency,
            &format!("{label}-front"),
        )?;
        Ok(Deployment {
            replicas,
            front: Some(front),
            drain_s: opts.drain_s,
        })
    }

    /// The port clients send requests to (the front's, or the lone Envoy's).
    pub fn port(&self) -> u16 {
        match &self.front {
            Some(f) => f.port,
            None => self.replicas.first().map_or(0, |r| r.port),
        }
    }

    /// The admin ports of the Envoys running the policy (the replicas, not the front).
    pub fn admin_ports(&self) -> Vec<u16> {
        self.replicas
            .iter()
            .filter_map(|r| r.envoy.as_ref().map(|e| e.admin_port))
            .collect()
    }

    pub fn replica_count(&self) -> usize {
        if self.front.is_some() {
            self.replicas.len()
        } else {
            1
        }
    }

    /// Drains replica `i`, stops it by PID once idle and starts it again on its port with empty
    /// shared data. Blocks for the whole restart (≈ drain time + start-up).
    pub fn restart(&mut self, i: usize, t0: Instant) -> Result<Restart, String> {
        let since = |t: Instant| t.saturating_duration_since(t0).as_secs_f64() * 1000.0;
        let drain_s = self.drain_s;
        let r = self
            .replicas
            .get_mut(i)
            .filter(|_| self.front.is_some())
            .ok_or_else(|| format!("no replica {i} to restart"))?;
        let envoy = r
            .envoy
            .as_ref()
            .ok_or_else(|| format!("replica {i} is not running"))?;
        let admin = envoy.admin_port;
        let drain_at = Instant::now();
        admin_post(admin, "/drain_listeners?graceful")?;
        std::thread::sleep(Duration::from_secs(u64::from(drain_s)));
        let deadline = Instant::now() + IDLE_WAIT_LIMIT;
        let (open_requests, open_connections) = loop {
            let open = open_downstream(admin);
            match open {
                Some((0, 0)) => break (0, 0),
                _ if Instant::now() >= deadline => break open.unwrap_or((u64::MAX, u64::MAX)),
                _ => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        let stopped_at = Instant::now();
        // Dropping the handle stops the process by its PID (and waits for it).
        drop(r.envoy.take());
        let boot = topology::with_listener_port(&r.bootstrap, r.port)?;
        let extra = replica_args(drain_s);
        // The old port is free again at once (Envoy's listeners set SO_REUSEADDR); retry a few
        // times in case the process had not released it yet.
        let mut last_err = String::new();
        for attempt in 0..5 {
            if attempt > 0 {
                std::thread::sleep(Duration::from_millis(200));
            }
            match EnvoyProc::start_with(&boot, r.concurrency, &r.label, &extra) {
                Ok(e) => {
                    r.envoy = Some(e);
                    return Ok(Restart {
                        replica: i,
                        drain_ms: since(drain_at),
                        stopped_ms: since(stopped_at),
                        ready_ms: since(Instant::now()),
                        open_requests,
                        open_connections,
                    });
                }
                Err(e) => last_err = e,
            }
        }
        Err(format!(
            "replica {i} did not start again on port {}: {last_err}",
            r.port
        ))
    }
}

/// Command-line flags of a replica: a short graceful drain that closes every connection after
/// its next response.
fn replica_args(drain_s: u32) -> Vec<String> {
    vec![
        "--drain-time-s".into(),
        drain_s.to_string(),
        "--drain-strategy".into(),
        "immediate".into(),
    ]
}

fn admin_post(admin_port: u16, path: &str) -> Result<(), String> {
    match http::request(admin_port, "POST", path, &[], None, http::DEFAULT_TIMEOUT) {
        Ok(r) if r.status == 200 => Ok(()),
        Ok(r) => Err(format!("admin POST {path}: {} {}", r.status, r.body)),
        Err(e) => Err(format!("admin POST {path}: {e}")),
    }
}

/// `(requests in flight, open connections)` on the listener's HTTP connection manager (stat
/// prefix `computeflux`, as every bench bootstrap has it).
fn open_downstream(admin_port: u16) -> Option<(u64, u64)> {
    let r = http::request(
        admin_port,
        "GET",
        "/stats?format=json&filter=downstream_",
        &[],
        None,
        Duration::from_secs(2),
    )
    .ok()?;
    let v: Value = serde_json::from_str(&r.body).ok()?;
    let stats = v.get("stats")?.as_array()?;
    let get = |name: &str| {
        stats
            .iter()
            .find(|s| s.get("name").and_then(Value::as_str) == Some(name))
            .and_then(|s| s.get("value"))
            .and_then(Value::as_u64)
    };
    Some((
        get("http.computeflux.downstream_rq_active")?,
        get("http.computeflux.downstream_cx_active")?,
    ))
}
