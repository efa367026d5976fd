//! `scripts/run --demo`: replays multi-turn conversations through the local Envoy and prints,
//! per endpoint, what the balancer achieved (requests, affinity hits, KV-cache-hit tokens).
//!
//! Each session is a conversation whose prompt grows turn by turn (every turn resends the
//! history), so a turn served by the endpoint that served the previous one finds its prefix in
//! that endpoint's KV cache. The mock upstreams report cached tokens per request.
//!
//! ```text
//! cargo run --release --example demo -- [--port 10000] [--sessions 24] [--turns 5] \
//!     [--mocks 18001,18002,18003,18004] [--model llama-3-8b]
//! ```

#[path = "../tests/support/http.rs"]
#[allow(
    dead_code,
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]
mod http;

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::Duration;

struct Args {
    port: u16,
    sessions: usize,
    turns: usize,
    mocks: Vec<u16>,
    model: String,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        port: 10000,
        sessions: 24,
        turns: 5,
        mocks: vec![18001, 18002, 18003, 18004],
        model: "llama-3-8b".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let num = |v: &str| v.parse::<usize>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--port" => a.port = num(&value)? as u16,
            "--sessions" => a.sessions = num(&value)?,
            "--turns" => a.turns = num(&value)?,
            "--model" => a.model = value,
            "--mocks" => {
                a.mocks = value
                    .split(',')
                    .map(|p| p.parse::<u16>().map_err(|e| format!("--mocks: {e}")))
                    .collect::<Result<_, _>>()?
            }
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(a)
}

#[derive(Default)]
struct Row {
    requests: u64,
    affinity_hits: u64,
    failovers: u64,
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("demo: {e}");
            std::process::exit(2);
        }
    };
    let timeout = Duration::from_secs(30);
    for port in &args.mocks {
        let _ = http::request(
            *port,
            "POST",
            "/_mock/reset_stats",
            &[],
            Some(b"{}"),
            timeout,
        );
    }
    let topics = [
        "a trip to Lisbon",
        "a sourdough recipe",
        "Rust lifetimes",
        "a job interview",
        "tax forms",
        "a garden plan",
    ];
    let mut rows: BTreeMap<String, Row> = BTreeMap::new();
    let mut errors = 0u64;
    let mut follow_ups = 0u64;
    let mut same_endpoint = 0u64;
    let mut histories: Vec<(Vec<Value>, Option<String>)> = (0..args.sessions)
        .map(|s| {
            let topic = topics.get(s % topics.len()).copied().unwrap_or("anything");
            (vec![json!({"role": "system", "content": format!("You are assistant #{s}. Be helpful about {topic}.")})], None)
        })
        .collect();
    // Interleave sessions turn by turn, as concurrent users would.
    for turn in 0..args.turns {
        for (s, (messages, last)) in histories.iter_mut().enumerate() {
            messages.push(json!({"role": "user", "content": format!(
                "Turn {turn} of session {s}: please continue with more detail, examples and a short summary of everything so far."
            )}));
            let body = json!({"model": args.model, "messages": messages}).to_string();
            let sid = format!("demo-session-{s}");
            let headers = [("x-session-id", sid.as_str())];
            let r = match http::request(
                args.port,
                "POST",
                "/v1/chat/completions",
                &headers,
                Some(body.as_bytes()),
                timeout,
            ) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("demo: request failed: {e}");
                    errors += 1;
                    continue;
                }
            };
            if r.status != 200 {
                errors += 1;
                continue;
            }
            let ep = r
                .header("x-computeflux-endpoint")
                .unwrap_or("?")
                .to_string();
            let row = rows.entry(ep.clone()).or_default();
            row.requests += 1;
            row.affinity_hits += u64::from(r.header("x-computeflux-affinity") == Some("hit"));
            row.failovers +=
                u64::from(r.header("x-computeflux-attempts").is_some_and(|a| a != "1"));
            if let Some(prev) = last.as_ref() {
                follow_ups += 1;
                same_endpoint += u64::from(*prev == ep);
            }
            *last = Some(ep);
            let answer = r
                .json()
                .pointer("/choices/0/message/content")
                .cloned()
                .unwrap_or_default()
                .as_str()
                .unwrap_or("")
                .to_string();
            messages.push(json!({"role": "assistant", "content": answer}));
        }
    }
    println!();
    println!(
        "{:<10} {:>9} {:>14} {:>10} {:>14} {:>14} {:>9}",
        "endpoint",
        "requests",
        "affinity hits",
        "failovers",
        "prompt tokens",
        "cached tokens",
        "hit %"
    );
    let (mut total_prompt, mut total_cached) = (0u64, 0u64);
    for port in &args.mocks {
        let Ok(stats) = http::request(*port, "GET", "/_mock/stats", &[], None, timeout) else {
            continue;
        };
        let st = stats.json();
        let name = st
            .get("name")
            .cloned()
            .unwrap_or_default()
            .as_str()
            .unwrap_or("?")
            .to_string();
        let prompt = st
            .get("prompt_tokens")
            .cloned()
            .unwrap_or_default()
            .as_u64()
            .unwrap_or(0);
        let cached = st
            .get("cached_tokens")
            .cloned()
            .unwrap_or_default()
            .as_u64()
            .unwrap_or(0);
        total_prompt += prompt;
        total_cached += cached;
        let row = rows.remove(&name).unwrap_or_default();
        let pct = if prompt > 0 {
            100.0 * cached as f64 / prompt as f64
        } else {
            0.0
        };
        println!(
            "{:<10} {:>9} {:>14} {:>10} {:>14} {:>14} {:>8.1}%",
            name, row.requests, row.affinity_hits, row.failovers, prompt, cached, pct
        );
    }
    let pct = |a: u64, b: u64| {
        if b > 0 {
            100.0 * a as f64 / b as f64
        } else {
            0.0
        }
    };
    println!(
        "\n{} sessions x {} turns: {} errors; follow-up turns on the previous endpoint: {}/{} ({:.1}%); \
         cached prompt tokens: {}/{} ({:.1}%)",
        args.sessions,
        args.turns,
        errors,
        same_endpoint,
        follow_ups,
        pct(same_endpoint, follow_ups),
        total_cached,
        total_prompt,
        pct(total_cached, total_prompt)
    );
    if errors > 0 {
        std::process::exit(1);
    }
}
