//! Fault soak (issue 4, item 7): a long run of bounded load through a real Envoy with the filter,
//! four mock endpoints and random faults injected over time, checking that nothing is lost.
//!
//! Why: unit and integration tests prove each resilience rule in isolation; a soak shows that
//! they compose over thousands of requests and hundreds of fault transitions: no client error
//! while an endpoint was healthy, no in-flight count leaked, every attempt the filter counted
//! reached an upstream (or was a refused connect), no wasm panic or VM restart, stable memory.
//!
//! How: `scripts/soak [--minutes N] [--seconds N] [--rps R] [--seed S]` (10 minutes, 20 req/s,
//! seed 1 by default). Envoy runs `--concurrency 2` (the test harness in `tests/support`,
//! reused here). A fault driver flips each endpoint between healthy and one of: 429 windows
//! (Retry-After 1–4 s), 503 bursts, 401 (dead key), refused connections, 5× slowness. It never
//! faults the last *settled* endpoint — fault-free (or merely slow) for at least
//! [`SETTLE`] — so at every moment at least one endpoint is healthy and the filter has had time
//! to know it. Clients: a mix of multi-turn sessions (session header), one-shot conversations
//! and streamed requests, paced to `--rps` by a shared schedule. At the end the load stops, the
//! faults are cleared, and the report goes to stdout and `results/soak/latest.{md,json}`.
//!
//! Counting attempts: `sum(computeflux_requests_total)` counts every attempt the filter
//! finished; the mocks' `requests` counts what reached them. A refused connect never reaches a
//! mock and the filter cannot tell it from other 503s (it is an `endpoint_failure`), so refused
//! connects are counted from Envoy's cluster statistic `upstream_rq_pending_failure_eject`
//! (requests failed because their upstream connection could not be established). Expected:
//! `filter attempts = mock requests + refused connects`.

// The report is one large `json!` literal.
#![recursion_limit = "256"]
// A driver program: failing loudly is right here.
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

#[path = "../../support/mod.rs"]
mod support;

#[path = "soak/report.rs"]
mod report;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use report::{Report, ReportInput};
use serde_json::{json, Value};
use support::http;
use support::{chat_body, Envoy, EnvoyConfig, MockUpstream};

/// An endpoint counts as healthy for the error criterion once it has been fault-free (or only
/// slow) this long: longer than any breaker cooldown in the configuration below (open_ms 3 s,
/// Retry-After ≤ 4 s) plus the half-open probes.
const SETTLE: Duration = Duration::from_secs(10);
const ENDPOINTS: [&str; 4] = ["e1", "e2", "e3", "e4"];
const CLIENT_THREADS: usize = 8;
const SESSIONS: u64 = 40;
const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);

// ------------------------------------------------------------------------------------------
// Arguments, randomness
// ------------------------------------------------------------------------------------------

struct Args {
    seconds: u64,
    rps: f64,
    seed: u64,
    out: PathBuf,
    /// How the run was started, for the report (scripts/soak passes its command line).
    command: Option<String>,
}

fn parse_args() -> Args {
    let mut a = Args {
        seconds: 600,
        rps: 20.0,
        seed: 1,
        out: support::repo_root().join("results/soak"),
        command: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .unwrap_or_else(|| panic!("{flag} needs a value (see tests/tools/src/soak.rs)"))
        };
        match flag.as_str() {
            "--minutes" => a.seconds = value().parse::<u64>().expect("--minutes N") * 60,
            "--seconds" => a.seconds = value().parse().expect("--seconds N"),
            "--rps" => a.rps = value().parse().expect("--rps R"),
            "--seed" => a.seed = value().parse().expect("--seed S"),
            "--out" => a.out = PathBuf::from(value()),
            "--command" => a.command = Some(value()),
            "-h" | "--help" => {
                println!("usage: scripts/soak [--minutes N | --seconds N] [--rps R] [--seed S] [--out DIR]");
                std::process::exit(0);
            }
            other => panic!("unknown argument {other:?} (see --help)"),
        }
    }
    assert!(a.seconds >= 20, "the soak needs at least 20 s");
    assert!(a.rps > 0.0 && a.rps <= 200.0, "--rps must be in (0, 200]");
    a
}

/// SplitMix64: a small seeded generator, so a run can be repeated with `--seed`.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn range_ms(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi - lo + 1))
    }
}

// ------------------------------------------------------------------------------------------
// Faults
// ------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    RateLimit,
    Burst503,
    DeadKey,
    Refuse,
    Slow,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::RateLimit => "429 window",
            Kind::Burst503 => "503 burst",
            Kind::DeadKey => "401 dead key",
            Kind::Refuse => "refused connections",
            Kind::Slow => "5x slow",
        }
    }
    /// Whether the endpoint still answers successfully under this fault.
    fn healthy(self) -> bool {
        self == Kind::Slow
    }
}

struct EndpointFault {
    kind: Option<Kind>,
    until: Instant,
    /// Since when it has been healthy (fault-free or slow); `None` while faulted.
    healthy_since: Option<Instant>,
}

struct FaultState {
    eps: Vec<EndpointFault>,
}

impl FaultState {
    fn settled(&self, now: Instant) -> usize {
        self.eps
            .iter()
            .filter(|e| {
                e.healthy_since
                    .is_some_and(|t| now.duration_since(t) >= SETTLE)
            })
            .count()
    }
    fn healthy_now(&self) -> usize {
        self.eps
            .iter()
            .filter(|e| e.kind.is_none_or(Kind::healthy))
            .count()
    }
}

struct FaultEvent {
    at_s: f64,
    endpoint: &'static str,
    kind: Kind,
    secs: f64,
}

fn set_fault(m: &MockUpstream, fault: &Value) -> Result<(), String> {
    let body = fault.to_string();
    match http::request(
        m.control_port,
        "POST",
        "/_mock/fault",
        &[],
        Some(body.as_bytes()),
        Duration::from_secs(10),
    ) {
        Ok(r) if r.status == 200 => Ok(()),
        Ok(r) => Err(format!(
            "{}: fault {fault}: {} {}",
            m.name, r.status, r.body
        )),
        Err(e) => Err(format!("{}: fault {fault}: {e}", m.name)),
    }
}

fn fault_json(kind: Kind, rng: &mut Rng) -> Value {
    match kind {
        Kind::RateLimit => json!({"mode": "status", "status": 429,
                                  "retry_after": (1 + rng.below(4)).to_string()}),
        Kind::Burst503 => json!({"mode": "status", "status": 503}),
        Kind::DeadKey => json!({"mode": "status", "status": 401}),
        Kind::Refuse => json!({"mode": "refuse"}),
        Kind::Slow => json!({"mode": "slow", "factor": 5}),
    }
}

/// Injects and lifts faults until `stop`; returns the events. Keeps ≥ 1 settled endpoint.
fn drive_faults(
    mocks: &[MockUpstream],
    state: &Mutex<FaultState>,
    stop: &AtomicBool,
    start: Instant,
    seed: u64,
) -> (Vec<FaultEvent>, usize) {
    let mut rng = Rng(seed ^ 0xFA17);
    let mut events = Vec::new();
    let mut skipped = 0;
    // First fault after the warm-up, then every 1–5 s on average.
    let mut next = start + Duration::from_secs(12);
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(100));
        let now = Instant::now();
        let mut st = state.lock().unwrap();
        for (i, e) in st.eps.iter_mut().enumerate() {
            if e.kind.is_some() && now >= e.until {
                set_fault(&mocks[i], &json!({"mode": "none"})).unwrap_or_else(|e| panic!("{e}"));
                if e.healthy_since.is_none() {
                    e.healthy_since = Some(now);
                }
                e.kind = None;
            }
        }
        if now < next {
            continue;
        }
        next = now + rng.range_ms(1000, 5000);
        let free: Vec<usize> = (0..mocks.len())
            .filter(|&i| st.eps[i].kind.is_none())
            .collect();
        if free.is_empty() {
            continue;
        }
        let i = free[rng.below(free.len() as u64) as usize];
        let kind = match rng.below(100) {
            0..=24 => Kind::RateLimit,
            25..=49 => Kind::Burst503,
            50..=64 => Kind::DeadKey,
            65..=79 => Kind::Refuse,
            _ => Kind::Slow,
        };
        if !kind.healthy() {
            // Would the others still include a settled endpoint?
            let was = st.eps[i].healthy_since.take();
            let ok = st.settled(now) >= 1;
            st.eps[i].healthy_since = was;
            if !ok {
                skipped += 1;
                continue;
            }
        }
        let dur = match kind {
            Kind::Burst503 => rng.range_ms(1500, 6000),
            Kind::Refuse => rng.range_ms(2000, 10_000),
            _ => rng.range_ms(3000, 15_000),
        };
        set_fault(&mocks[i], &fault_json(kind, &mut rng)).unwrap_or_else(|e| panic!("{e}"));
        let e = &mut st.eps[i];
        e.kind = Some(kind);
        e.until = now + dur;
        if !kind.healthy() {
            e.healthy_since = None;
        }
        events.push(FaultEvent {
            at_s: now.duration_since(start).as_secs_f64(),
            endpoint: ENDPOINTS[i],
            kind,
            secs: dur.as_secs_f64(),
        });
    }
    // Lift everything.
    let mut st = state.lock().unwrap();
    for (i, e) in st.eps.iter_mut().enumerate() {
        if e.kind.take().is_some() {
            set_fault(&mocks[i], &json!({"mode": "none"})).unwrap_or_else(|e| panic!("{e}"));
        }
    }
    (events, skipped)
}

// ------------------------------------------------------------------------------------------
// Load
// ------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct Outcome {
    at_s: f64,
    kind: &'static str,
    /// HTTP status, or 0 for a transport error.
    status: u16,
    ok: bool,
    error: Option<String>,
    attempts: u32,
    endpoint: String,
    latency_ms: f64,
    /// Endpoints settled-healthy / healthy when the request was sent.
    settled: usize,
    healthy: usize,
    /// A streamed answer whose 200 headers (and first bytes) arrived, then the body stopped.
    cut: bool,
    /// `cut`, and the serving endpoint started refusing (dropping its open connections) while
    /// this request was in flight: the streaming rule's pass-through case, not a lost request.
    cut_by_fault: bool,
}

/// Per-session turn counters: a session resends its history and adds a turn; after 8 turns
/// it starts a new conversation (its generation), so bodies stay small.
struct Sessions(Mutex<Vec<(u64, usize)>>);

fn one_request(port: u16, n: u64, rng_val: u64, sessions: &Sessions) -> (&'static str, Outcome) {
    let mut headers: Vec<(&str, String)> = Vec::new();
    let (kind, body, stream) = match rng_val % 10 {
        0..=5 => {
            let s = (rng_val / 10) % SESSIONS;
            let (gen, turns) = {
                let mut v = sessions.0.lock().unwrap();
                let e = &mut v[s as usize];
                e.1 += 1;
                if e.1 > 8 {
                    *e = (e.0 + 1, 1);
                }
                *e
            };
            let msgs: Vec<String> = (0..turns)
                .map(|t| format!("session {s} generation {gen} turn {t}: tell me more"))
                .collect();
            let refs: Vec<&str> = msgs.iter().map(String::as_str).collect();
            headers.push(("x-session-id", format!("soak-{s}-{gen}")));
            ("session", chat_body("m", &refs, Value::Null), false)
        }
        6..=8 => (
            "one-shot",
            chat_body("m", &[&format!("one-shot question {n}")], Value::Null),
            false,
        ),
        _ => (
            "stream",
            chat_body(
                "m",
                &[&format!("streamed question {n}")],
                json!({"stream": true}),
            ),
            true,
        ),
    };
    let hdrs: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let t = Instant::now();
    let r = if stream {
        raw_stream(port, &body)
    } else {
        http::request(
            port,
            "POST",
            "/v1/chat/completions",
            &hdrs,
            Some(body.as_bytes()),
            CLIENT_TIMEOUT,
        )
        .map_err(|e| e.to_string())
    };
    let latency_ms = t.elapsed().as_secs_f64() * 1000.0;
    let mut o = Outcome {
        at_s: 0.0,
        kind,
        status: 0,
        ok: false,
        error: None,
        attempts: 0,
        endpoint: String::new(),
        latency_ms,
        settled: 0,
        healthy: 0,
        cut: false,
        cut_by_fault: false,
    };
    match r {
        Err(e) => o.error = Some(format!("transport: {e}")),
        Ok(r) => {
            o.status = r.status;
            o.attempts = r
                .header("x-computeflux-attempts")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            o.endpoint = r.header("x-computeflux-endpoint").unwrap_or("").to_string();
            let body_ok = if stream {
                o.cut = r.status == 200 && r.header("x-raw-complete") != Some("1");
                !o.cut && r.sse_data().last().map(String::as_str) == Some("[DONE]")
            } else {
                serde_json::from_str::<Value>(&r.body)
                    .ok()
                    .is_some_and(|v| v["object"] == "chat.completion")
            };
            o.ok = r.status == 200 && body_ok;
            if !o.ok {
                let snippet: String = r.body.chars().take(160).collect();
                o.error = Some(format!("status {}: {snippet}", r.status));
            }
        }
    }
    (kind, o)
}

/// A streamed request read by hand: unlike the harness client, a body cut short still yields the
/// status and headers (who served it, after how many attempts). The response comes back as an
/// `http::Response` whose extra header `x-raw-complete: 1` says the chunked body ended properly.
fn raw_stream(port: u16, body: &str) -> Result<http::Response, String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(CLIENT_TIMEOUT))
        .map_err(|e| e.to_string())?;
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    // On a read error the bytes read so far are kept in `buf`.
    let read_err = s.read_to_end(&mut buf).err();
    let find = |hay: &[u8], needle: &[u8]| hay.windows(needle.len()).position(|w| w == needle);
    let Some(end) = find(&buf, b"\r\n\r\n") else {
        return Err(format!(
            "no response headers after {} bytes ({})",
            buf.len(),
            read_err.map_or("EOF".to_string(), |e| e.to_string())
        ));
    };
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("bad status line in {head:?}"))?;
    let mut resp = http::Response {
        status,
        ..http::Response::default()
    };
    for l in lines {
        if let Some((k, v)) = l.split_once(':') {
            resp.headers
                .insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    // A failed-over answer is the filter's local reply (content-length); the normal path is
    // chunked, complete only with the terminating zero-size chunk.
    let mut rest = &buf[end + 4..];
    let mut out = Vec::new();
    let chunked = resp
        .header("transfer-encoding")
        .is_some_and(|t| t.to_ascii_lowercase().contains("chunked"));
    let content_length = resp
        .header("content-length")
        .and_then(|v| v.trim().parse::<usize>().ok());
    let mut complete = false;
    if !chunked {
        out.extend_from_slice(rest);
        complete = match content_length {
            Some(n) => rest.len() >= n,
            None => read_err.is_none(),
        };
    }
    if chunked {
        while let Some(i) = find(rest, b"\r\n") {
            let size_text = String::from_utf8_lossy(&rest[..i]).into_owned();
            let Ok(size) =
                usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            else {
                break;
            };
            rest = &rest[i + 2..];
            if size == 0 {
                complete = true;
                break;
            }
            if rest.len() < size + 2 {
                out.extend_from_slice(&rest[..rest.len().min(size)]);
                break;
            }
            out.extend_from_slice(&rest[..size]);
            rest = &rest[size + 2..];
        }
    }
    resp.body = String::from_utf8_lossy(&out).into_owned();
    if complete {
        resp.headers.insert("x-raw-complete".into(), "1".into());
    }
    Ok(resp)
}

// ------------------------------------------------------------------------------------------
// Measurements
// ------------------------------------------------------------------------------------------

fn rss_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// `name{labels} value` lines of `/stats/prometheus` for one metric: (labels, value).
fn prom(text: &str, name: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, v) = l.rsplit_once(' ')?;
            let (n, labels) = series.split_once('{').unwrap_or((series, ""));
            (n == name).then(|| {
                (
                    labels.trim_end_matches('}').to_string(),
                    v.parse().unwrap_or(f64::NAN),
                )
            })
        })
        .collect()
}

fn prom_sum(text: &str, name: &str) -> f64 {
    prom(text, name).iter().map(|(_, v)| v).sum()
}

/// A counter from admin `/stats` text (`name: value`).
fn stat(stats: &str, name: &str) -> u64 {
    stats
        .lines()
        .find_map(|l| {
            l.strip_prefix(name)?
                .strip_prefix(": ")?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// The commit the run started from, with `+dirty` when the work tree had uncommitted changes
/// (the wasm module is built from the work tree).
fn git_head() -> String {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .current_dir(support::repo_root())
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    };
    let head = git(&["rev-parse", "--short", "HEAD"]);
    let dirty = !git(&["status", "--porcelain", "--untracked-files=no"]).is_empty();
    if dirty {
        format!("{head}+dirty")
    } else {
        head
    }
}

// ------------------------------------------------------------------------------------------
// Main
// ------------------------------------------------------------------------------------------

fn main() {
    let args = parse_args();
    let commit = git_head();
    let command = args.command.clone().unwrap_or_else(|| {
        format!(
            "target/release/soak --seconds {} --rps {} --seed {}",
            args.seconds, args.rps, args.seed
        )
    });
    println!(
        "soak: {} s at {} req/s, seed {}, 4 endpoints",
        args.seconds, args.rps, args.seed
    );
    let mocks: Vec<MockUpstream> = ENDPOINTS
        .iter()
        .map(|n| {
            MockUpstream::start(
                n,
                &["m"],
                &[
                    "--prefill-us-per-token",
                    "20",
                    "--decode-ms",
                    "30",
                    "--history",
                    "100",
                ],
            )
        })
        .collect();
    let plugin = json!({
        "endpoints": ENDPOINTS.iter().map(|n| json!({"name": n, "cluster": n, "models": ["m"]}))
            .collect::<Vec<_>>(),
        "failure_threshold": 3,
        "open_ms": 3000,
        "rate_limit_ms": 3000,
        "retry_after_max_ms": 10_000,
        "half_open_probes": 2,
        "max_attempts": 4,
        "failover_timeout_ms": 15_000,
    });
    let clusters: Vec<(&str, u16)> = ENDPOINTS
        .iter()
        .zip(&mocks)
        .map(|(n, m)| (*n, m.port))
        .collect();
    let mut cfg = EnvoyConfig::new(plugin.clone(), &clusters);
    cfg.concurrency = 2;
    cfg.route_timeout_ms = 30_000;
    let envoy = Envoy::start(cfg);
    let pid = envoy.pid();
    println!("envoy pid {pid} listening on {}", envoy.addr());
    // scripts/soak stops these if this program dies without running destructors.
    if let Some(f) = std::env::var_os("SOAK_PID_FILE") {
        let pids: Vec<String> = std::iter::once(pid)
            .chain(mocks.iter().map(MockUpstream::pid))
            .map(|p| p.to_string())
            .collect();
        let _ = std::fs::write(f, pids.join("\n") + "\n");
    }

    let start = Instant::now();
    let total = Duration::from_secs(args.seconds);
    let stop_load = AtomicBool::new(false);
    let stop_faults = AtomicBool::new(false);
    let faults = Mutex::new(FaultState {
        eps: (0..ENDPOINTS.len())
            .map(|_| EndpointFault {
                kind: None,
                until: start,
                // Healthy since long before the run: settled from the start.
                healthy_since: start.checked_sub(SETTLE),
            })
            .collect(),
    });
    let outcomes: Mutex<Vec<Outcome>> = Mutex::new(Vec::new());
    let rss: Mutex<Vec<(f64, u64)>> = Mutex::new(Vec::new());
    let min_settled = AtomicU64::new(u64::MAX);
    let ticket = AtomicU64::new(0);
    let sessions = Sessions(Mutex::new(vec![(0, 0); SESSIONS as usize]));
    let port = envoy.port;

    let (events, skipped, load_secs) = std::thread::scope(|s| {
        let driver = s.spawn(|| drive_faults(&mocks, &faults, &stop_faults, start, args.seed));
        // RSS sampler and progress line.
        s.spawn(|| {
            let mut last_print = Instant::now();
            while !stop_load.load(Ordering::SeqCst) {
                if let Some(kib) = rss_kib(pid) {
                    rss.lock()
                        .unwrap()
                        .push((start.elapsed().as_secs_f64(), kib));
                }
                if last_print.elapsed() >= Duration::from_secs(30) {
                    last_print = Instant::now();
                    let o = outcomes.lock().unwrap();
                    let errs = o.iter().filter(|o| !o.ok).count();
                    let active: Vec<String> = faults
                        .lock()
                        .unwrap()
                        .eps
                        .iter()
                        .enumerate()
                        .filter_map(|(i, e)| {
                            e.kind.map(|k| format!("{}={}", ENDPOINTS[i], k.label()))
                        })
                        .collect();
                    println!(
                        "  t={:>4.0}s requests={} client_errors={} faults=[{}] envoy_rss={} MiB",
                        start.elapsed().as_secs_f64(),
                        o.len(),
                        errs,
                        active.join(", "),
                        rss_kib(pid).unwrap_or(0) / 1024
                    );
                }
                // Sample every 5 s, but notice the end of the load promptly.
                for _ in 0..20 {
                    if stop_load.load(Ordering::SeqCst) {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(250));
                }
            }
        });
        let clients: Vec<_> = (0..CLIENT_THREADS)
            .map(|c| {
                let (ticket, outcomes, faults, sessions, min_settled) =
                    (&ticket, &outcomes, &faults, &sessions, &min_settled);
                s.spawn(move || {
                    let mut rng = Rng(args.seed.wrapping_mul(1000) + c as u64);
                    loop {
                        let n = ticket.fetch_add(1, Ordering::SeqCst);
                        let due = start + Duration::from_secs_f64(n as f64 / args.rps);
                        if due.duration_since(start) >= total {
                            break;
                        }
                        let now = Instant::now();
                        if due > now {
                            std::thread::sleep(due - now);
                        }
                        let (settled, healthy) = {
                            let st = faults.lock().unwrap();
                            (st.settled(Instant::now()), st.healthy_now())
                        };
                        min_settled.fetch_min(settled as u64, Ordering::SeqCst);
                        let at_s = start.elapsed().as_secs_f64();
                        let (_, mut o) = one_request(port, n, rng.next(), sessions);
                        o.at_s = at_s;
                        o.settled = settled;
                        o.healthy = healthy;
                        outcomes.lock().unwrap().push(o);
                    }
                })
            })
            .collect();
        for c in clients {
            c.join().unwrap();
        }
        let load_secs = start.elapsed().as_secs_f64();
        stop_load.store(true, Ordering::SeqCst);
        stop_faults.store(true, Ordering::SeqCst);
        let (events, skipped) = driver.join().unwrap();
        (events, skipped, load_secs)
    });
    let rss_end = rss_kib(pid).unwrap_or(0);

    // Settle: faults lifted, no load. In-flight gauges are refreshed every 1 s tick.
    let settle_start = Instant::now();
    while settle_start.elapsed() < Duration::from_secs(10) {
        let text = envoy.prometheus();
        if prom(&text, "computeflux_in_flight")
            .iter()
            .all(|(_, v)| *v == 0.0)
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_millis(1500)); // one more tick: values are final
    let text = envoy.prometheus();
    let in_flight = prom(&text, "computeflux_in_flight");
    let stats = envoy.admin_get("/stats").body;
    let log = envoy.log_contents();
    drop(envoy);

    // A cut stream is the streaming rule's pass-through case when its endpoint started refusing
    // (dropping open connections) while the request was in flight.
    let mut outcomes = outcomes.into_inner().unwrap();
    for o in outcomes.iter_mut().filter(|o| o.cut) {
        let (from, to) = (o.at_s - 0.05, o.at_s + o.latency_ms / 1000.0 + 0.05);
        o.cut_by_fault = events.iter().any(|e| {
            e.kind == Kind::Refuse && e.endpoint == o.endpoint && e.at_s >= from && e.at_s <= to
        });
    }
    let report = Report::build(ReportInput {
        args: &args,
        command: &command,
        commit: &commit,
        load_secs,
        outcomes: &outcomes,
        events: &events,
        skipped_faults: skipped,
        min_settled: min_settled.load(Ordering::SeqCst),
        rss: &rss.into_inner().unwrap(),
        rss_end,
        in_flight: &in_flight,
        prom_text: &text,
        stats: &stats,
        log: &log,
        mocks: &mocks,
        plugin: &plugin,
    });
    print!("{}", report.markdown);
    std::fs::create_dir_all(&args.out).expect("creating the results directory");
    std::fs::write(args.out.join("latest.md"), &report.markdown).expect("writing latest.md");
    std::fs::write(
        args.out.join("latest.json"),
        serde_json::to_string_pretty(&report.json).unwrap() + "\n",
    )
    .expect("writing latest.json");
    println!(
        "wrote {} and latest.json",
        args.out.join("latest.md").display()
    );
    if !report.pass {
        std::process::exit(1);
    }
}
