//! A noisy neighbour: two tenants on one fleet, told apart by their API key (`Authorization`)
//! only, one of them sending about twice what the fleet can serve.
//!
//! Why: when the fleet is full, somebody waits. A router that passes every request on lets the
//! engines queue them in arrival order, so a tenant that sends ten times its share takes ten
//! times the capacity and every other tenant's latency climbs with the queue. What users of a
//! shared self-hosted fleet get is the quiet tenant's latency with and without the noise, what
//! the noisy one is still served, and whether the excess is answered (admitted later, or refused
//! with 429 and `Retry-After`) rather than left to time out.
//!
//! The run (times from its origin; every policy replays the identical plan on fresh engines and
//! a fresh Envoy):
//! - `steady` (no overload): the quiet tenant at [`Shape::quiet_rate`] and the noisy one at
//!   [`Shape::steady_noisy_rate`] (together about half the fleet's capacity): nobody should
//!   wait, nothing should be shed;
//! - `alone`: the quiet tenant alone;
//! - `noise`: the quiet tenant again (the same arrival gaps, output lengths and stream/plain
//!   choices as in `alone`, continued for the longer phase; new texts, so that neither phase
//!   finds the other's prompts cached), and the noisy tenant open loop at
//!   [`Shape::noisy_rate`].
//!
//! A short gap separates the phases so that one phase's requests do not pile into the next.
//! Every request is a new conversation (its own `x-session-id`) opened by one of the tenant's
//! shared system prompts; half the answers are streamed; each asks for its own `max_tokens`
//! (log-uniform 16..512, generated exactly by the engines). Arrivals are open loop (Poisson,
//! one client thread per request, never delayed by earlier answers); a 429 is recorded, not
//! retried. A request with no complete answer within the client timeout is "left to time
//! out". What counts is in `noisy_summary.rs`.
//!
//! The engines are the bench's engine-like mocks (`mock_upstream/engine.rs`) with
//! [`ENGINE_SLOTS`] slots each: four of them serve about 30 requests/s of this workload.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::deployment::{DeployOpts, Deployment};
use super::noisy_summary::{self, Phase, Rec, RunSummary, Tenant};
use super::peer::SglangRouter;
use super::support::{http, MockUpstream};
use super::topology::{self, Policy, Setup, ENDPOINTS};
use super::workload::{self, Rng, SESSION_HEADER};

/// Slots (requests decoded at once) of every engine; the rest wait in the engine's queue.
pub const ENGINE_SLOTS: u64 = 2;
/// The engines: the first four of [`ENDPOINTS`] (all serve [`workload::MODEL`]).
pub const ENGINES: usize = 4;
/// The tenants' API keys (`Authorization: Bearer …`).
pub const QUIET_KEY: &str = "sk-quiet-tenant-0001";
pub const NOISY_KEY: &str = "sk-noisy-tenant-0002";
/// Shared system prompts per tenant and their length in tokens.
pub const PROMPTS_PER_TENANT: usize = 2;
pub const SYSTEM_TOKENS: usize = 200;
/// Tokens of each request's own user message.
pub const USER_TOKENS: usize = 300;
/// Each request's `max_tokens`: log-uniform in this range.
pub const OUTPUT_TOKENS: (u64, u64) = (16, 512);
/// The clients' timeout: a request with no complete answer by then is left to time out.
pub const CLIENT_TIMEOUT_S: u64 = 15;

/// The phases' lengths and rates.
#[derive(Clone, Debug, PartialEq)]
pub struct Shape {
    pub steady_ms: u64,
    pub alone_ms: u64,
    pub noise_ms: u64,
    /// Between two phases.
    pub gap_ms: u64,
    /// Requests per second of the quiet tenant (every phase).
    pub quiet_rate: f64,
    /// Requests per second of the noisy tenant in the noise phase.
    pub noisy_rate: f64,
    /// Requests per second of the noisy tenant in the steady phase.
    pub steady_noisy_rate: f64,
    pub seed: u64,
}

impl Shape {
    /// The full run: ≈ 1 min per policy. Quick: about half.
    pub fn new(quick: bool, seed: u64) -> Shape {
        let s = if quick { 2 } else { 1 };
        Shape {
            steady_ms: 8_000 / s,
            alone_ms: 15_000 / s,
            noise_ms: 20_000 / s,
            gap_ms: 2_000,
            quiet_rate: 4.0,
            noisy_rate: 60.0,
            steady_noisy_rate: 12.0,
            seed,
        }
    }

    /// `(start, end)` of a phase, ms from the run's origin.
    pub fn window(&self, p: Phase) -> (u64, u64) {
        let steady = (0, self.steady_ms);
        let alone = (
            steady.1 + self.gap_ms,
            steady.1 + self.gap_ms + self.alone_ms,
        );
        let noise = (alone.1 + self.gap_ms, alone.1 + self.gap_ms + self.noise_ms);
        match p {
            Phase::Steady => steady,
            Phase::Alone => alone,
            Phase::Noise => noise,
        }
    }

    pub fn describe(&self) -> String {
        let s = |ms: u64| format!("{:.0} s", ms as f64 / 1000.0);
        let w = |p| {
            let (a, b) = self.window(p);
            format!("{:.1}–{:.1} s", a as f64 / 1000.0, b as f64 / 1000.0)
        };
        format!(
            "`steady` {} (quiet {} req/s + noisy {} req/s, no overload); `alone` {} (quiet {} \
             req/s alone); `noise` {} (quiet {} req/s, the gaps and output lengths of alone \
             continued, + noisy {} req/s open loop); {} between phases; seed {}",
            w(Phase::Steady),
            self.quiet_rate,
            self.steady_noisy_rate,
            w(Phase::Alone),
            self.quiet_rate,
            w(Phase::Noise),
            self.quiet_rate,
            self.noisy_rate,
            s(self.gap_ms),
            self.seed
        )
    }
}

/// One planned request.
#[derive(Clone, Debug)]
pub struct Req {
    pub tenant: Tenant,
    pub phase: Phase,
    /// When it is sent, ms from the run's origin.
    pub at_ms: u64,
    pub id: String,
    pub body: String,
    pub stream: bool,
    pub max_tokens: u64,
}

/// Arrivals, output lengths and stream choices of one tenant over `dur_ms` at `rate`, from
/// `seed` alone: `(offset ms, max_tokens, stream)`.
fn shapes(seed: u64, rate: f64, dur_ms: u64) -> Vec<(u64, u64, bool)> {
    let mut rng = Rng::new(seed);
    let gap = 1000.0 / rate.max(0.001);
    let mut t = -gap * (1.0 - rng.unit()).ln();
    let mut out = Vec::new();
    while t < dur_ms as f64 {
        let max_tokens = workload::log_uniform(&mut rng, OUTPUT_TOKENS.0, OUTPUT_TOKENS.1);
        let stream = rng.unit() < 0.5;
        out.push((t.round() as u64, max_tokens, stream));
        t += -gap * (1.0 - rng.unit()).ln();
    }
    out
}

/// `bytes` bytes of words starting with `lead` (a new text for every request).
fn text(rng: &mut Rng, lead: &str, bytes: usize) -> String {
    const WORDS: &[&str] = &[
        "alpha", "bravo", "carbon", "delta", "ember", "fjord", "gamma", "harbor", "indigo",
        "juniper", "kernel", "lumen", "matrix", "nebula", "orbit", "prism", "quartz", "raster",
        "sierra", "tensor", "umbra", "vector", "willow", "xenon",
    ];
    let mut s = String::with_capacity(bytes + 16);
    s.push_str(lead);
    while s.len() < bytes {
        let i = (rng.next_u64() % WORDS.len() as u64) as usize;
        s.push(' ');
        s.push_str(WORDS.get(i).copied().unwrap_or("word"));
    }
    s.truncate(bytes);
    s
}

/// The tenants' shared system prompts (each starts with its own lead: none shares a block).
fn system_prompts(tenant: Tenant, seed: u64) -> Vec<String> {
    let mut rng = Rng::new(seed ^ 0x5157_E3D0 ^ tenant as u64);
    (0..PROMPTS_PER_TENANT)
        .map(|i| {
            let lead = format!("[{} app {i}] You are a helpful assistant.", tenant.name());
            text(&mut rng, &lead, SYSTEM_TOKENS * 4)
        })
        .collect()
}

/// The whole run's requests, in sending order. The quiet tenant's `noise` phase starts with the
/// arrival gaps, output lengths and stream choices of its `alone` phase (one seed), new texts.
pub fn plan(shape: &Shape) -> Vec<Req> {
    let mut out = Vec::new();
    let mut texts = Rng::new(shape.seed ^ 0x7E47);
    let mut add = |tenant: Tenant, phase: Phase, seed: u64, rate: f64| {
        let (start, end) = shape.window(phase);
        let prompts = system_prompts(tenant, shape.seed);
        for (i, (off, max_tokens, stream)) in
            shapes(seed, rate, end - start).into_iter().enumerate()
        {
            let id = format!("{}-{}-{i:05}", tenant.name(), phase.name());
            let system = prompts
                .get((texts.next_u64() % prompts.len().max(1) as u64) as usize)
                .cloned()
                .unwrap_or_default();
            let user = text(&mut texts, &format!("[{id}]"), USER_TOKENS * 4);
            let messages = json!([
                {"role": "system", "content": system},
                {"role": "user", "content": user},
            ]);
            let body = if stream {
                json!({"model": workload::MODEL, "messages": messages, "max_tokens": max_tokens,
                       "stream": true, "stream_options": {"include_usage": true}})
            } else {
                json!({"model": workload::MODEL, "messages": messages, "max_tokens": max_tokens})
            };
            out.push(Req {
                tenant,
                phase,
                at_ms: start + off,
                id,
                body: body.to_string(),
                stream,
                max_tokens,
            });
        }
    };
    let s = shape.seed;
    add(Tenant::Quiet, Phase::Steady, s ^ 0x51, shape.quiet_rate);
    add(
        Tenant::Noisy,
        Phase::Steady,
        s ^ 0x52,
        shape.steady_noisy_rate,
    );
    // The same seed for the quiet tenant's two measured phases.
    add(Tenant::Quiet, Phase::Alone, s ^ 0x53, shape.quiet_rate);
    add(Tenant::Quiet, Phase::Noise, s ^ 0x53, shape.quiet_rate);
    add(Tenant::Noisy, Phase::Noise, s ^ 0x54, shape.noisy_rate);
    out.sort_by_key(|r| r.at_ms);
    out
}

/// Sends one request with the tenant's key; records what came back.
fn send(port: u16, req: &Req, t0: Instant, timeout: Duration) -> Rec {
    let start = Instant::now();
    let auth = format!("Bearer {}", req.tenant.key());
    let headers = [
        (SESSION_HEADER, req.id.as_str()),
        ("authorization", auth.as_str()),
    ];
    let res = http::request(
        port,
        "POST",
        "/v1/chat/completions",
        &headers,
        Some(req.body.as_bytes()),
        timeout,
    );
    let latency_ms = start.elapsed().as_secs_f64() * 1000.0;
    let mut rec = Rec {
        tenant: req.tenant,
        phase: req.phase,
        start_ms: start.saturating_duration_since(t0).as_secs_f64() * 1000.0,
        latency_ms,
        status: 0,
        retry_after: None,
        timed_out: false,
        error: None,
        endpoint: None,
        replica: None,
        queue_ms: None,
        engine_queue_ms: None,
        stream: req.stream,
        max_tokens: req.max_tokens,
    };
    match res {
        Ok(r) => {
            rec.status = r.status;
            rec.retry_after = r.header("retry-after").map(str::to_string);
            rec.endpoint = r.header("x-mock-endpoint").map(str::to_string);
            rec.replica = r.header("x-bench-replica").map(str::to_string);
            rec.queue_ms = r
                .header(noisy_summary::QUEUE_HEADER)
                .map(|v| v.trim().parse::<f64>().unwrap_or(0.0));
            rec.engine_queue_ms = r
                .header("x-mock-queued-ms")
                .and_then(|v| v.trim().parse::<f64>().ok());
            let complete = !req.stream || r.status != 200 || r.body.contains("[DONE]");
            if !(200..300).contains(&r.status) {
                let code = serde_json::from_str::<Value>(&r.body)
                    .ok()
                    .and_then(|v| v.pointer("/error/code").cloned())
                    .and_then(|c| c.as_str().map(str::to_string));
                rec.error = Some(code.unwrap_or_else(|| format!("http {}", r.status)));
            } else if !complete {
                rec.error = Some("stream cut".into());
            }
        }
        Err(e) => {
            use std::io::ErrorKind;
            rec.timed_out = matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock)
                || latency_ms + 50.0 >= timeout.as_secs_f64() * 1000.0;
            rec.error = Some(format!("io: {:?}", e.kind()));
        }
    }
    rec
}

/// Plays `reqs` against `127.0.0.1:port`, each at its time from `t0` in its own thread (open
/// loop); returns every request's record.
pub fn drive(port: u16, reqs: &[Req], t0: Instant, timeout: Duration) -> Vec<Rec> {
    let (tx, rx) = mpsc::channel::<Rec>();
    let mut handles = Vec::with_capacity(reqs.len());
    for req in reqs {
        let due = t0 + Duration::from_millis(req.at_ms);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let (req, tx) = (req.clone(), tx.clone());
        let h = std::thread::Builder::new()
            .name("nn-client".into())
            .stack_size(128 * 1024)
            .spawn(move || {
                let _ = tx.send(send(port, &req, t0, timeout));
            });
        match h {
            Ok(h) => handles.push(h),
            Err(e) => eprintln!("bench: cannot start a client thread: {e}"),
        }
    }
    drop(tx);
    for h in handles {
        let _ = h.join();
    }
    rx.into_iter().collect()
}

/// Everything a run needs besides policy and topology.
#[derive(Clone, Debug)]
pub struct NoisyOpts {
    pub mock_args: Vec<String>,
    pub concurrency: u32,
    pub replica_concurrency: u32,
    pub front_concurrency: u32,
    pub drain_s: u32,
    pub envoy_retries: bool,
    pub open_ms: u64,
    /// Filter configuration keys on top of the defaults (`--plugin-extra`; none by default).
    pub plugin_extra: Value,
    pub client_timeout: Duration,
    pub raw_dir: Option<PathBuf>,
}

/// The filter's counters whose names contain one of these (summed over the replicas) go into
/// the run's record.
pub const FILTER_STAT_MARKS: &[&str] = &["admission", "admit", "shed", "queue", "fair"];

/// `name → value` of the counters and gauges matching [`FILTER_STAT_MARKS`] of one Envoy.
fn filter_stats(admin_port: u16) -> Vec<(String, u64)> {
    let Ok(r) = http::request(
        admin_port,
        "GET",
        "/stats?format=json",
        &[],
        None,
        Duration::from_secs(5),
    ) else {
        return Vec::new();
    };
    let v: Value = serde_json::from_str(&r.body).unwrap_or(Value::Null);
    v.get("stats")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|s| {
                    let name = s.get("name")?.as_str()?;
                    let value = s.get("value")?.as_u64()?;
                    let lower = name.to_ascii_lowercase();
                    (lower.contains("computeflux") || lower.contains("wasm"))
                        .then_some(())
                        .filter(|_| FILTER_STAT_MARKS.iter().any(|m| lower.contains(m)))
                        .map(|_| (name.to_string(), value))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// One policy × topology.
pub fn run(
    policy: Policy,
    replicas: usize,
    shape: &Shape,
    reqs: &[Req],
    opts: &NoisyOpts,
    wasm: &Path,
) -> Result<RunSummary, String> {
    let started = Instant::now();
    let mocks: Vec<MockUpstream> = ENDPOINTS
        .iter()
        .take(ENGINES)
        .map(|(name, models)| {
            let args: Vec<&str> = opts.mock_args.iter().map(String::as_str).collect();
            MockUpstream::start(name, models, &args)
        })
        .collect();
    for m in &mocks {
        topology::record_pid(m.pid());
    }
    let hosts: Vec<(&str, &[&str], u16)> = ENDPOINTS
        .iter()
        .zip(&mocks)
        .map(|((n, models), m)| (*n, *models, m.port))
        .collect();
    let peer = policy == Policy::SglangCacheAware;
    let mut routers: Vec<(String, SglangRouter)> = Vec::new();
    if peer {
        // One router per Envoy replica slot over every engine (one model).
        for r in 0..replicas.max(1) {
            let ports: Vec<u16> = mocks.iter().map(|m| m.port).collect();
            let name = format!("sglang_m1_r{r}");
            let router = SglangRouter::start(&ports, &name)?;
            routers.push((name, router));
        }
    }
    let model: &[&str] = &[workload::MODEL];
    let router_hosts: Vec<(&str, &[&str], u16)> = routers
        .iter()
        .map(|(name, router)| (name.as_str(), model, router.port))
        .collect();
    let mut extra = serde_json::Map::new();
    for part in [policy.plugin_extra(), opts.plugin_extra.clone()] {
        if let Some(o) = part.as_object() {
            topology::merge_keys(&mut extra, o);
        }
    }
    let setup = Setup {
        policy,
        hosts: if peer { &router_hosts } else { &hosts },
        concurrency: opts.concurrency,
        envoy_retries: opts.envoy_retries,
        open_ms: opts.open_ms,
        plugin_extra: if extra.is_empty() {
            Value::Null
        } else {
            Value::Object(extra)
        },
    };
    let boot = topology::bootstrap(&setup, wasm)?;
    let deploy = DeployOpts {
        replicas: if peer { 1 } else { replicas },
        concurrency: opts.concurrency,
        replica_concurrency: opts.replica_concurrency,
        front_concurrency: opts.front_concurrency,
        drain_s: opts.drain_s,
    };
    let deployment = Deployment::start(&boot, &format!("nn-{}", policy.name()), &deploy)?;
    let port = deployment.port();
    let t0 = Instant::now() + Duration::from_millis(300);
    let recs = drive(port, reqs, t0, opts.client_timeout);
    // The filter's admission counters, summed over its Envoys.
    let mut stats: Vec<(String, u64)> = Vec::new();
    if policy.is_filter() {
        for admin in deployment.admin_ports() {
            for (name, v) in filter_stats(admin) {
                match stats.iter_mut().find(|(n, _)| *n == name) {
                    Some(s) => s.1 += v,
                    None => stats.push((name, v)),
                }
            }
        }
        stats.sort();
    }
    let served_by_engines: u64 = mocks.iter().map(MockUpstream::request_count).sum();
    drop(deployment);
    drop(routers);
    drop(mocks);
    let label = super::summary::label(policy.name(), replicas as u32);
    if let Some(dir) = &opts.raw_dir {
        let mut sorted: Vec<&Rec> = recs.iter().collect();
        sorted.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
        let text: String = sorted
            .iter()
            .map(|r| r.to_json().to_string() + "\n")
            .collect();
        let name = format!("noisy-{}.jsonl", label.replace(" ×", "-x"));
        let _ = std::fs::write(dir.join(name), text);
    }
    let mut s = noisy_summary::summarize(&label, policy.name(), replicas as u32, shape, &recs);
    s.engine_requests = served_by_engines;
    s.filter_stats = stats;
    s.wall_s = started.elapsed().as_secs_f64();
    Ok(s)
}

/// The policies the scenario compares by default: the filter (with one Envoy and with three
/// replicas), Envoy's least_request and ring_hash, the SGLang router.
pub const POLICIES: [Policy; 4] = [
    Policy::Filter,
    Policy::LeastRequest,
    Policy::RingHash,
    Policy::SglangCacheAware,
];

/// The report: `latest.md`. `baseline`: a previous run's rows (its `latest.json`), for the
/// steady phase's figures before and after.
pub fn markdown(
    rows: &[RunSummary],
    shape: &Shape,
    meta: &[(&str, String)],
    baseline: Option<(&str, &[RunSummary])>,
    failed: &[String],
) -> String {
    let mut s =
        String::from("# Noisy neighbour: a tenant at twice the fleet's capacity (issue 43)\n\n");
    for (k, v) in meta {
        s.push_str(&format!("- {k}: {v}\n"));
    }
    s.push_str(&format!(
        "\nScenario `noisy_neighbor` (tests/tools/src/bench/noisy_neighbor.rs): two tenants told \
         apart by their `Authorization` header only (`Bearer {QUIET_KEY}`, `Bearer \
         {NOISY_KEY}`), {ENGINES} engine-like mocks with {ENGINE_SLOTS} slots each (prefill \
         serialized, decode slowed by the batch, every request's `max_tokens` generated), every \
         request a new conversation opened by one of its tenant's {PROMPTS_PER_TENANT} shared \
         system prompts ({SYSTEM_TOKENS} tokens) and a {USER_TOKENS}-token message, `max_tokens` \
         log-uniform {}..{}, half streamed; open loop, one client per request, no retries; \
         client timeout {} s. Phases: {}.\n\n",
        OUTPUT_TOKENS.0,
        OUTPUT_TOKENS.1,
        meta.iter()
            .find(|(k, _)| *k == "client timeout")
            .map_or("?".to_string(), |(_, v)| v
                .trim_end_matches(" s")
                .to_string()),
        shape.describe()
    ));
    s.push_str(
        "What counts (tests/tools/src/bench/noisy_summary.rs): percentiles over the requests \
         that got a complete 2xx answer or were left to time out (\"≥\": one that timed out is \
         inside, counted at the timeout); error answers are counted apart. Noisy served: the noisy \
         tenant's 2xx answers completed during the noise phase ÷ the phase's length (its \
         throughput while the fleet is overloaded; what a backlog serves later does not count). Quiet errors: \
         every quiet request without a complete 2xx answer, all phases. Steady waited: answers \
         whose `x-computeflux-queued-ms` header said the filter held them (– for the policies \
         that cannot say).\n\n",
    );
    s.push_str("## Figures\n\n");
    s.push_str(&noisy_summary::figures_table(rows));
    s.push_str("\n## Done when (computed from the rows above)\n\n");
    s.push_str(&noisy_summary::checks_table(rows));
    if let Some((what, base)) = baseline.filter(|(_, b)| !b.is_empty()) {
        s.push_str(&format!(
            "\n## Without overload: the steady phase against the previous run ({what})\n\n\
             | policy | steady p50 / p99 ms now | before | steady shed now / before |\n\
             |---|---:|---:|---:|\n"
        ));
        for r in rows {
            let Some(b) = base.iter().find(|b| b.label == r.label) else {
                continue;
            };
            let shed = |x: &RunSummary| x.steady_all.errors;
            s.push_str(&format!(
                "| {} | {:.0} / {:.0} | {:.0} / {:.0} | {} / {} |\n",
                r.label,
                r.steady_all.p50_ms,
                r.steady_all.p99_ms,
                b.steady_all.p50_ms,
                b.steady_all.p99_ms,
                shed(r),
                shed(b)
            ));
        }
    }
    let with_stats: Vec<&RunSummary> = rows.iter().filter(|r| !r.filter_stats.is_empty()).collect();
    if !with_stats.is_empty() {
        s.push_str("\n## The filter's admission counters at the end of each run (summed over its Envoys; those above 0)\n\n");
        for r in with_stats {
            let kv: Vec<String> = r
                .filter_stats
                .iter()
                .filter(|(_, v)| *v > 0)
                .map(|(k, v)| format!("`{}` {v}", k.trim_start_matches("wasmcustom.")))
                .collect();
            s.push_str(&format!("- {}: {}\n", r.label, kv.join(", ")));
        }
    }
    s.push_str("\nRequests per status, per row (steady both tenants; quiet alone; quiet under noise; noisy under noise):\n\n");
    for r in rows {
        let st = |x: &noisy_summary::Stats| {
            x.statuses
                .iter()
                .map(|(k, v)| format!("{k}: {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        s.push_str(&format!(
            "- {}: {{{}}}; {{{}}}; {{{}}}; {{{}}}; engines received {}\n",
            r.label,
            st(&r.steady_all),
            st(&r.alone_quiet),
            st(&r.noise_quiet),
            st(&r.noise_noisy),
            r.engine_requests
        ));
    }
    for f in failed {
        s.push_str(&format!("\nFailed run: {f}\n"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_quiet_tenant_sends_the_same_work_alone_and_under_the_noise() {
        let shape = Shape::new(false, 7);
        let reqs = plan(&shape);
        let pick = |t: Tenant, p: Phase| -> Vec<&Req> {
            reqs.iter()
                .filter(|r| r.tenant == t && r.phase == p)
                .collect()
        };
        let (alone, noise) = (
            pick(Tenant::Quiet, Phase::Alone),
            pick(Tenant::Quiet, Phase::Noise),
        );
        // The noise phase is longer: it starts with the alone phase's sequence.
        assert!(
            alone.len() > 40 && noise.len() > alone.len(),
            "{} {}",
            alone.len(),
            noise.len()
        );
        let (a0, n0) = (shape.window(Phase::Alone).0, shape.window(Phase::Noise).0);
        for (a, n) in alone.iter().zip(&noise) {
            assert_eq!(
                (a.at_ms - a0, a.max_tokens, a.stream),
                (n.at_ms - n0, n.max_tokens, n.stream)
            );
            assert_ne!(
                a.body, n.body,
                "new texts: nothing cached from the other phase"
            );
        }
        // Open-loop rates close to the asked ones (Poisson counts over the phase).
        let rate = |v: &[&Req], ms: u64| v.len() as f64 * 1000.0 / ms as f64;
        let noisy = pick(Tenant::Noisy, Phase::Noise);
        assert!((50.0..70.0).contains(&rate(&noisy, shape.noise_ms)));
        assert!((2.0..6.0).contains(&rate(&alone, shape.alone_ms)));
        assert!(pick(Tenant::Noisy, Phase::Alone).is_empty());
        // Every request inside its phase's window, in sending order.
        for r in &reqs {
            let (a, b) = shape.window(r.phase);
            assert!((a..b).contains(&r.at_ms), "{} at {}", r.id, r.at_ms);
        }
        assert!(reqs.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
        // Tenants share no system prompt; each request is its own conversation.
        let sys = |t: Tenant| system_prompts(t, 7);
        assert!(sys(Tenant::Quiet)
            .iter()
            .all(|p| !sys(Tenant::Noisy).contains(p)));
        let mut ids: Vec<&str> = reqs.iter().map(|r| r.id.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), reqs.len());
        let body: Value = serde_json::from_str(&noise[0].body).unwrap();
        assert_eq!(body["messages"][0]["role"], "system");
        assert_eq!(body["max_tokens"], noise[0].max_tokens);
    }
}
