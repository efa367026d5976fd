//! Bounded memory under a session flood: sends N distinct session ids through a real Envoy with
//! the filter and samples Envoy's resident memory (`VmRSS`) while it does.
//!
//! Why: Envoy never frees a shared-data key, so the affinity table lives in a fixed set of
//! buckets bounded by `affinity_max_sessions`. This driver shows that bound holding from the
//! outside: RSS must level off once the table is full, whatever the number of sessions. A second
//! run with a small bound gives the memory cost of one session entry.
//!
//! ```text
//! cargo run --release -p computeflux-tools --bin session_flood -- [--sessions 1000000] [--bound 100000]
//!     [--compare-bound 1000] [--compare-sessions N] [--rate 3000] [--threads 4]
//!     [--concurrency 2] [--sample-ms 1000] [--out results/memory/latest.md]
//! ```
//! (`scripts/memory` builds and runs it.) Loopback only; the request loop is bounded in count
//! (`--sessions`) and rate (`--rate` requests/s over all threads, keep-alive HTTP/1.1
//! connections). The mock upstream answers at once (`--prefill-us-per-token 0 --decode-ms 0`).

#[path = "../../support/mod.rs"]
mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use support::{repo_root, Envoy, EnvoyConfig, MockUpstream};

struct Args {
    sessions: u64,
    bound: u64,
    compare_bound: u64,
    compare_sessions: Option<u64>,
    rate: u64,
    threads: u64,
    concurrency: u32,
    sample_ms: u64,
    out: PathBuf,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        sessions: 1_000_000,
        bound: 100_000,
        compare_bound: 1_000,
        compare_sessions: None,
        rate: 3_000,
        threads: 4,
        concurrency: 2,
        sample_ms: 1_000,
        out: repo_root().join("results/memory/latest.md"),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let num = |v: &str| {
            v.replace('_', "")
                .parse::<u64>()
                .map_err(|_| format!("{flag}: bad number {v:?}"))
        };
        match flag.as_str() {
            "--sessions" => a.sessions = num(&value)?,
            "--bound" => a.bound = num(&value)?,
            "--compare-bound" => a.compare_bound = num(&value)?,
            "--compare-sessions" => a.compare_sessions = Some(num(&value)?),
            "--rate" => a.rate = num(&value)?.max(1),
            "--threads" => a.threads = num(&value)?.clamp(1, 64),
            "--concurrency" => {
                a.concurrency = u32::try_from(num(&value)?).map_err(|e| e.to_string())?
            }
            "--sample-ms" => a.sample_ms = num(&value)?.max(100),
            "--out" => a.out = PathBuf::from(value),
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(a)
}

/// One RSS sample.
#[derive(Clone, Copy, Debug)]
struct Sample {
    secs: f64,
    sent: u64,
    rss_kib: u64,
}

/// The outcome of one flood.
struct Run {
    bound: u64,
    sessions: u64,
    samples: Vec<Sample>,
    ok: u64,
    not_new: u64,
    errors: u64,
    secs: f64,
    idle_rss_kib: u64,
    start_rss_kib: u64,
}

impl Run {
    /// RSS when `fraction` of the sessions had been sent (the first sample at or after it).
    fn rss_at(&self, fraction: f64) -> u64 {
        let target = (self.sessions as f64 * fraction) as u64;
        self.samples
            .iter()
            .find(|s| s.sent >= target)
            .or(self.samples.last())
            .map_or(0, |s| s.rss_kib)
    }
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// A keep-alive HTTP/1.1 connection to Envoy.
struct Conn {
    port: u16,
    reader: Option<BufReader<TcpStream>>,
}

impl Conn {
    /// Sends one chat request with `session`; returns (status, x-computeflux-affinity).
    fn chat(&mut self, session: &str) -> Result<(u16, String), String> {
        const BODY: &str =
            r#"{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}"#;
        if self.reader.is_none() {
            let s = TcpStream::connect(("127.0.0.1", self.port)).map_err(|e| e.to_string())?;
            s.set_nodelay(true).map_err(|e| e.to_string())?;
            s.set_read_timeout(Some(Duration::from_secs(10)))
                .map_err(|e| e.to_string())?;
            self.reader = Some(BufReader::new(s));
        }
        let result = self.exchange(session, BODY);
        if result.is_err() {
            self.reader = None;
        }
        result
    }

    fn exchange(&mut self, session: &str, body: &str) -> Result<(u16, String), String> {
        let r = self.reader.as_mut().ok_or("no connection")?;
        let req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: flood\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nx-session-id: {session}\r\n\r\n{body}",
            body.len()
        );
        r.get_mut()
            .write_all(req.as_bytes())
            .map_err(|e| e.to_string())?;
        let mut line = String::new();
        r.read_line(&mut line).map_err(|e| e.to_string())?;
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse::<u16>().ok())
            .ok_or_else(|| format!("bad status line {line:?}"))?;
        let (mut len, mut affinity, mut close) = (0usize, String::new(), false);
        loop {
            line.clear();
            r.read_line(&mut line).map_err(|e| e.to_string())?;
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':') {
                let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
                match k.as_str() {
                    "content-length" => len = v.parse().map_err(|_| "bad content-length")?,
                    "x-computeflux-affinity" => affinity = v.to_string(),
                    "connection" => close = v.eq_ignore_ascii_case("close"),
                    _ => {}
                }
            }
        }
        let mut body = vec![0u8; len];
        r.read_exact(&mut body).map_err(|e| e.to_string())?;
        if close {
            self.reader = None;
        }
        Ok((status, affinity))
    }
}

fn flood(a: &Args, bound: u64, sessions: u64, tag: &str) -> Result<Run, String> {
    let fast = [
        "--prefill-us-per-token",
        "0",
        "--decode-ms",
        "0",
        "--completion-tokens",
        "1",
        "--history",
        "1",
    ];
    let mock = MockUpstream::start("flood", &[], &fast);
    let plugin = json!({
        "endpoints": [{"name": "a", "cluster": "a"}, {"name": "b", "cluster": "b"}],
        "affinity_max_sessions": bound,
        // Entries never expire during the run: only the bound keeps the table small.
        "affinity_ttl_ms": 86_400_000,
    });
    let mut cfg = EnvoyConfig::new(plugin, &[("a", mock.port), ("b", mock.port)]);
    cfg.concurrency = a.concurrency;
    cfg.log_level = "warning".into();
    let envoy = Envoy::try_start(cfg)?;
    let pid = envoy.pid();
    let port = envoy.port;
    std::thread::sleep(Duration::from_millis(500));
    let start_rss_kib = rss_kib(pid);
    eprintln!(
        "[{tag}] bound {bound}: {sessions} sessions at ≤ {} req/s; Envoy pid {pid}, RSS {} MiB",
        a.rate,
        start_rss_kib / 1024
    );

    let sent = Arc::new(AtomicU64::new(0));
    let ok = Arc::new(AtomicU64::new(0));
    let not_new = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let samples = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();

    let sampler = {
        let (sent, done, samples) = (sent.clone(), done.clone(), samples.clone());
        let period = Duration::from_millis(a.sample_ms);
        let every = (sessions / 10).max(1);
        std::thread::spawn(move || {
            let mut next_report = every;
            while !done.load(Ordering::SeqCst) {
                let s = Sample {
                    secs: start.elapsed().as_secs_f64(),
                    sent: sent.load(Ordering::SeqCst),
                    rss_kib: rss_kib(pid),
                };
                if s.sent >= next_report {
                    eprintln!(
                        "  {:>9} sent  {:>6.0} s  RSS {:>7.1} MiB",
                        s.sent,
                        s.secs,
                        s.rss_kib as f64 / 1024.0
                    );
                    next_report += every;
                }
                if let Ok(mut v) = samples.lock() {
                    v.push(s);
                }
                std::thread::sleep(period);
            }
        })
    };

    let threads = a.threads;
    // Each thread sends its share at rate / threads, on a fixed schedule (no catch-up bursts
    // beyond 50 ms behind).
    let interval = Duration::from_secs_f64(threads as f64 / a.rate as f64);
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let (sent, ok, not_new, errors) =
                (sent.clone(), ok.clone(), not_new.clone(), errors.clone());
            let tag = tag.to_string();
            std::thread::spawn(move || {
                let mut conn = Conn { port, reader: None };
                let mut next = Instant::now();
                let mut i = t;
                while i < sessions {
                    let now = Instant::now();
                    if next > now {
                        std::thread::sleep(next - now);
                    } else if now - next > Duration::from_millis(50) {
                        next = now;
                    }
                    next += interval;
                    match conn.chat(&format!("{tag}-{i}")) {
                        Ok((200, aff)) => {
                            ok.fetch_add(1, Ordering::Relaxed);
                            if !matches!(aff.as_str(), "home" | "backup" | "spill") {
                                not_new.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        Ok(_) | Err(_) => {
                            errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    sent.fetch_add(1, Ordering::SeqCst);
                    i += threads;
                }
            })
        })
        .collect();
    for w in workers {
        let _ = w.join();
    }
    let secs = start.elapsed().as_secs_f64();
    // Let the sampler see the idle state (and Envoy settle).
    std::thread::sleep(Duration::from_millis(2 * a.sample_ms + 1000));
    done.store(true, Ordering::SeqCst);
    let _ = sampler.join();
    let idle_rss_kib = rss_kib(pid);
    let samples = samples.lock().map(|v| v.clone()).unwrap_or_default();
    drop(envoy);
    drop(mock);
    let run = Run {
        bound,
        sessions,
        samples,
        ok: ok.load(Ordering::SeqCst),
        not_new: not_new.load(Ordering::SeqCst),
        errors: errors.load(Ordering::SeqCst),
        secs,
        idle_rss_kib,
        start_rss_kib,
    };
    eprintln!(
        "[{tag}] done in {:.0} s ({:.0} req/s): {} ok, {} errors, {} not new; idle RSS {:.1} MiB",
        run.secs,
        run.sessions as f64 / run.secs,
        run.ok,
        run.errors,
        run.not_new,
        run.idle_rss_kib as f64 / 1024.0
    );
    Ok(run)
}

fn mib(kib: u64) -> String {
    format!("{:.1}", kib as f64 / 1024.0)
}

fn write_csv(run: &Run, dir: &std::path::Path) -> Result<PathBuf, String> {
    let path = dir.join(format!("rss-bound-{}.csv", run.bound));
    let mut out = String::from("seconds,requests_sent,envoy_rss_kib\n");
    for s in &run.samples {
        out.push_str(&format!("{:.1},{},{}\n", s.secs, s.sent, s.rss_kib));
    }
    std::fs::write(&path, out).map_err(|e| format!("writing {}: {e}", path.display()))?;
    Ok(path)
}

/// Bytes the affinity table stores for `bound` entries, from the bucket format: 20 bytes per
/// entry plus, per bucket, a version byte and its key (`computeflux/affinity/<n>`).
fn format_bytes(bound: u64) -> (u64, u64) {
    let buckets = bound.div_ceil(64).clamp(1, 4096);
    let key_bytes: u64 = (0..buckets)
        .map(|b| "computeflux/affinity/".len() as u64 + b.to_string().len() as u64)
        .sum();
    (buckets, bound * 20 + buckets + key_bytes)
}

fn report(a: &Args, main: &Run, small: Option<&Run>) -> String {
    let mut md = String::new();
    let line = |md: &mut String, s: String| {
        md.push_str(&s);
        md.push('\n');
    };
    line(&mut md, "# Memory under a session flood".into());
    line(&mut md, String::new());
    line(
        &mut md,
        format!(
            "Generated by `scripts/memory` (tests/tools/src/session_flood.rs) on {}: {} distinct session ids \
             (`x-session-id`), one request each, through Envoy 1.40 `--concurrency {}` with the \
             filter, from {} keep-alive HTTP/1.1 client threads at ≤ {} req/s, loopback, mock \
             upstream answering at once. `affinity_ttl_ms` is 1 day, so only \
             `affinity_max_sessions` limits the table. RSS is Envoy's `VmRSS`.",
            today(),
            main.sessions,
            a.concurrency,
            a.threads,
            a.rate
        ),
    );
    line(&mut md, String::new());
    for run in std::iter::once(main).chain(small) {
        let (buckets, bytes) = format_bytes(run.bound);
        line(
            &mut md,
            format!(
                "## affinity_max_sessions = {} ({} buckets, {} B of entries and keys)",
                run.bound, buckets, bytes
            ),
        );
        line(&mut md, String::new());
        line(
            &mut md,
            format!(
                "{} requests in {:.0} s ({:.0} req/s): {} answered 200, {} errors, {} not `new` \
                 (every id is distinct, so every request must be a new session).",
                run.sessions,
                run.secs,
                run.sessions as f64 / run.secs,
                run.ok,
                run.errors,
                run.not_new
            ),
        );
        line(&mut md, String::new());
        line(
            &mut md,
            "| sessions sent | share | Envoy RSS (MiB) |".into(),
        );
        line(&mut md, "|---:|---:|---:|".into());
        line(
            &mut md,
            format!("| 0 (started) | 0 % | {} |", mib(run.start_rss_kib)),
        );
        for pct in [5u64, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100] {
            let target = run.sessions * pct / 100;
            let rss = run.rss_at(pct as f64 / 100.0);
            line(&mut md, format!("| {target} | {pct} % | {} |", mib(rss)));
        }
        line(
            &mut md,
            format!("| (idle after the run) | | {} |", mib(run.idle_rss_kib)),
        );
        line(&mut md, String::new());
        let half = run.rss_at(0.5);
        let end = run.idle_rss_kib.max(run.rss_at(1.0));
        line(
            &mut md,
            format!(
                "Growth over the second half of the run: {} MiB ({} → {} MiB).",
                mib(end.saturating_sub(half)),
                mib(half),
                mib(end)
            ),
        );
        line(&mut md, String::new());
    }
    if let Some(small) = small {
        let (_, big_bytes) = format_bytes(main.bound);
        let (_, small_bytes) = format_bytes(small.bound);
        let rss_diff = main.idle_rss_kib as i64 - small.idle_rss_kib as i64;
        let entries = (main.bound - small.bound) as f64;
        line(&mut md, "## Bytes per session entry".into());
        line(&mut md, String::new());
        line(
            &mut md,
            format!(
                "- From the bucket format: ({} − {}) B / ({} − {}) entries = **{:.1} B per entry** \
                 (20 B of session hash, endpoint id and last use, plus the bucket's version byte \
                 and key shared by 64 entries).",
                big_bytes,
                small_bytes,
                main.bound,
                small.bound,
                (big_bytes - small_bytes) as f64 / entries
            ),
        );
        line(
            &mut md,
            format!(
                "- From RSS: idle RSS at bound {} minus idle RSS at bound {} = {} KiB over {} \
                 entries = **{:.1} B per entry** (this includes Envoy's own copy-on-write of each \
                 bucket value, allocator slack, and run-to-run noise of a few hundred KiB).",
                main.bound,
                small.bound,
                rss_diff,
                main.bound - small.bound,
                rss_diff as f64 * 1024.0 / entries
            ),
        );
        let growth = |r: &Run| r.idle_rss_kib as i64 - r.start_rss_kib as i64;
        let growth_diff = growth(main) - growth(small);
        line(
            &mut md,
            format!(
                "- From RSS growth (each run's idle RSS minus its RSS at start, which cancels the \
                 baseline's run-to-run difference): {} KiB − {} KiB = {} KiB over {} entries = \
                 **{:.1} B per entry**.",
                growth(main),
                growth(small),
                growth_diff,
                main.bound - small.bound,
                growth_diff as f64 * 1024.0 / entries
            ),
        );
        line(&mut md, String::new());
    }
    md
}

fn today() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn run() -> Result<(), String> {
    let a = parse()?;
    let main = flood(&a, a.bound, a.sessions, "main")?;
    let small = if a.compare_bound > 0 {
        let n = a.compare_sessions.unwrap_or(a.sessions);
        Some(flood(&a, a.compare_bound, n, "small")?)
    } else {
        None
    };
    let dir = a
        .out
        .parent()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let mut md = report(&a, &main, small.as_ref());
    for run in std::iter::once(&main).chain(small.as_ref()) {
        let csv = write_csv(run, &dir)?;
        md.push_str(&format!(
            "Samples of the bound-{} run: `{}`.\n",
            run.bound,
            csv.file_name()
                .map_or(String::new(), |f| f.to_string_lossy().into_owned())
        ));
    }
    std::fs::write(&a.out, &md).map_err(|e| format!("writing {}: {e}", a.out.display()))?;
    println!("{md}");
    eprintln!("wrote {}", a.out.display());
    let bad = main.errors + main.not_new;
    if bad > 0 {
        return Err(format!("{bad} requests failed or were not new sessions"));
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("session_flood: {e}");
            ExitCode::FAILURE
        }
    }
}
