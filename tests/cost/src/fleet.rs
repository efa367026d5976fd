//! The fleet's own costs: engine `/metrics` scraping configured on every endpoint, and a pool
//! (`"pool": true`) whose membership holds hundreds of hosts.
//!
//! Scraping. In production the root context's timer sends `GET /metrics` to every due
//! endpoint (one worker per Envoy holds the scrape lease), and each answer is folded into its
//! endpoint's slot key (`computeflux/scrape/load/<slot>`, and the change ring). Here the
//! suite's measured tick is the tick that takes the lease and sends a scrape to every endpoint
//! (all are due at first); each call is then answered with [`metrics_page`] and measured
//! ([`Figures::answers`]); a later tick with nothing due is measured too
//! ([`Figures::tick_idle`]). The first request after the round pays for every load changed
//! ([`Figures::after_round`]); the scenarios are measured after it, every load fresh and as
//! the previous request left it.
//!
//! Pools. Proxy-wasm cannot list a cluster's hosts; the filter learns them from answers and
//! keeps them in one shared-data value per pool. Here that value is written before the plugin
//! is configured, as discovery would have left it ([`membership`], the codec of
//! `scheduler::routing::pools::Membership`), so the plugin starts with every host known. Routed
//! answers carry the host that served them (`upstream.address`, the first host the request
//! named), failover calls' answers the pool's stamp header: the glue confirms the host it
//! named, as it does in Envoy.
//!
//! [`Shared`] and the defined metrics are taken after every suite.

use crate::host::{self, Host, Traffic};
use crate::vm::Vm;
use std::collections::BTreeMap;
use wasmtime::{bail, Result};

/// The pool entry's name and Envoy cluster.
pub const POOL: &str = "vllm";
pub const POOL_CLUSTER: &str = "vllm_pool";
/// The filter's default `destination_header` and the pool cluster's stamp header.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
pub const STAMP_HEADER: &str = "x-computeflux-upstream-host";
/// The membership's shared-data key (`pools::membership_key`, codec version 1).
pub fn membership_key(pool: &str) -> String {
    format!("computeflux/pool/v1/{pool}")
}

/// The address of pool host `i` (distinct for `i` < 62 500).
pub fn host_address(i: usize) -> String {
    format!("10.0.{}.{}:8000", i / 250, i % 250 + 1)
}

/// A pool membership value with hosts `0..n` (slot `i` for host `i`, joined at 0) and the
/// departures given (address, when), as `pools::Membership::encode` writes it: version 1,
/// host count (u32), per host its address (u8 length, bytes), slot (u32) and join time (u64),
/// sorted by address; then the departures' count (u32) and each (address, time u64).
pub fn membership(hosts: &[usize], departed: &[(String, u64)]) -> Vec<u8> {
    let mut sorted: Vec<(String, usize)> = hosts.iter().map(|&i| (host_address(i), i)).collect();
    sorted.sort();
    let mut out = vec![1u8];
    out.extend((sorted.len() as u32).to_le_bytes());
    for (a, slot) in &sorted {
        out.push(a.len() as u8);
        out.extend(a.as_bytes());
        out.extend((*slot as u32).to_le_bytes());
        out.extend(0u64.to_le_bytes());
    }
    out.extend((departed.len() as u32).to_le_bytes());
    for (a, at) in departed {
        out.push(a.len() as u8);
        out.extend(a.as_bytes());
        out.extend(at.to_le_bytes());
    }
    out
}

/// A vLLM `/metrics` page (the families the filter reads, in vLLM 0.10's names, with the
/// histogram buckets and neighbouring families an engine publishes around them): 2.3 KB. Real
/// pages are larger (tens of KB: more histograms); parsing is linear in the bytes.
pub fn metrics_page(i: usize) -> Vec<u8> {
    let model = "llama-3-8b";
    let waiting = i % 5;
    let running = 3 + i % 7;
    let kv = 0.05 + (i % 10) as f64 * 0.08;
    let tokens = 10_000 + i as u64 * 37;
    let mut p = String::new();
    p.push_str("# HELP vllm:num_requests_running Number of requests in model execution batches.\n# TYPE vllm:num_requests_running gauge\n");
    p.push_str(&format!(
        "vllm:num_requests_running{{engine=\"0\",model_name=\"{model}\"}} {running}.0\n"
    ));
    p.push_str("# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n# TYPE vllm:num_requests_waiting gauge\n");
    p.push_str(&format!(
        "vllm:num_requests_waiting{{engine=\"0\",model_name=\"{model}\"}} {waiting}.0\n"
    ));
    p.push_str("# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n# TYPE vllm:kv_cache_usage_perc gauge\n");
    p.push_str(&format!(
        "vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"{model}\"}} {kv:.4}\n"
    ));
    p.push_str("# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n# TYPE vllm:prompt_tokens_total counter\n");
    p.push_str(&format!(
        "vllm:prompt_tokens_total{{engine=\"0\",model_name=\"{model}\"}} {}.0\n",
        tokens * 8
    ));
    p.push_str("# HELP vllm:generation_tokens_total Number of generation tokens processed.\n# TYPE vllm:generation_tokens_total counter\n");
    p.push_str(&format!(
        "vllm:generation_tokens_total{{engine=\"0\",model_name=\"{model}\"}} {tokens}.0\n"
    ));
    p.push_str("# HELP vllm:time_per_output_token_seconds Histogram of time per output token in seconds.\n# TYPE vllm:time_per_output_token_seconds histogram\n");
    let mut cum = 0u64;
    for (le, n) in [
        ("0.01", 40u64),
        ("0.025", 900),
        ("0.05", 300),
        ("0.075", 40),
        ("0.1", 10),
        ("0.15", 5),
        ("0.2", 3),
        ("0.3", 1),
        ("+Inf", 0),
    ] {
        cum += n * (1 + i as u64 % 3);
        p.push_str(&format!(
            "vllm:time_per_output_token_seconds_bucket{{engine=\"0\",le=\"{le}\",model_name=\"{model}\"}} {cum}.0\n"
        ));
    }
    p.push_str(&format!(
        "vllm:time_per_output_token_seconds_count{{engine=\"0\",model_name=\"{model}\"}} {tokens}.0\n"
    ));
    p.push_str(&format!(
        "vllm:time_per_output_token_seconds_sum{{engine=\"0\",model_name=\"{model}\"}} {:.3}\n",
        tokens as f64 * 0.021
    ));
    p.push_str("# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.\n# TYPE vllm:num_preemptions_total counter\n");
    p.push_str(&format!(
        "vllm:num_preemptions_total{{engine=\"0\",model_name=\"{model}\"}} 0.0\n"
    ));
    p.into_bytes()
}

/// Shared data as the host holds it: keys, and bytes of keys and values.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Shared {
    pub keys: usize,
    pub key_bytes: u64,
    pub value_bytes: u64,
    /// Value bytes by key family (the key up to its last `/`, numbered suffixes folded:
    /// `computeflux/affinity/*`).
    pub by_family: BTreeMap<String, (usize, u64)>,
}

impl Shared {
    pub fn of(host: &Host) -> Shared {
        let mut s = Shared::default();
        for (k, (v, _)) in &host.shared {
            s.keys += 1;
            s.key_bytes += k.len() as u64;
            s.value_bytes += v.len() as u64;
            let k = String::from_utf8_lossy(k);
            let family = match k.rsplit_once('/') {
                Some((head, tail))
                    if tail
                        .trim_start_matches('g')
                        .chars()
                        .all(|c| c.is_ascii_digit()) =>
                {
                    format!("{head}/*")
                }
                _ => k.into_owned(),
            };
            let e = s.by_family.entry(family).or_insert((0, 0));
            e.0 += 1;
            e.1 += v.len() as u64;
        }
        s
    }
}

/// What a fleet suite measures besides its scenarios (not budgeted: printed).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Figures {
    /// Instructions of each answer of the first scrape round, in the order sent.
    pub answers: Vec<u64>,
    /// Host calls and bytes of that round's answers, together.
    pub answers_traffic: Traffic,
    /// A tick with no scrape due (lease renewed, loads read, scrape gauges refreshed).
    pub tick_idle: Option<(u64, Traffic)>,
    /// The first request after the round (a new session): every load changed since the last
    /// request, each derived again. The scenarios that follow are measured after it.
    pub after_round: Option<u64>,
    /// Shared data after the suite.
    pub shared: Shared,
    /// Metrics the module defined (one series each in Envoy's stats).
    pub metrics_defined: usize,
    /// The root context's tick period the module asked for.
    pub tick_period_ms: u32,
}

/// Answers every call the root context dispatched (scrapes) with [`metrics_page`], each
/// measured. `Err` when a call was not a scrape.
pub fn answer_scrapes(vm: &mut Vm, root: u32) -> Result<(Vec<u64>, Traffic)> {
    let calls = std::mem::take(&mut vm.host().calls);
    let before = vm.host().traffic.clone();
    let mut out = Vec::with_capacity(calls.len());
    vm.host().advance_ms(5);
    for call in calls {
        let path = call
            .headers
            .iter()
            .find(|(k, _)| k == b":path")
            .map(|(_, v)| v.clone());
        if path.as_deref() != Some(b"/metrics") {
            bail!("root call to {} is not a scrape", call.cluster);
        }
        let i: usize = call.cluster.trim_start_matches("gpu_").parse().unwrap_or(0);
        let body = metrics_page(i);
        let headers = vec![
            (b":status".to_vec(), b"200".to_vec()),
            (
                b"content-type".to_vec(),
                b"text/plain; version=0.0.4; charset=utf-8".to_vec(),
            ),
            (
                b"content-length".to_vec(),
                body.len().to_string().into_bytes(),
            ),
        ];
        let nh = headers.len();
        let n = body.len();
        vm.host().maps[host::MAP_CALL_RESPONSE_HEADERS] = headers;
        vm.host().buffers[host::BUF_CALL_RESPONSE_BODY] = body;
        let f0 = vm.fuel_used()?;
        vm.http_call_response(root, call.token, nh, n)?;
        out.push(vm.fuel_used()? - f0);
    }
    let traffic = vm.host().traffic.since(&before);
    Ok((out, traffic))
}

/// New sessions of two turns each, `sessions` of them, then a tick: traffic after a change.
fn traffic(vm: &mut Vm, ctx: &mut u32, sessions: usize, tag: &str) -> Result<()> {
    use crate::scenario::{chat_request, exchange, json_answer, messages_body, ROOT};
    for i in 0..sessions {
        for turns in [1, 2] {
            *ctx += 1;
            let req = chat_request(Some(&format!("{tag}-{i}")), messages_body(turns, 0, false));
            exchange(vm, *ctx, &req, &[json_answer(0)])?;
            vm.host().advance_ms(20);
        }
    }
    vm.host().advance_ms(1_000);
    vm.tick(ROOT)?;
    vm.host().calls.clear();
    Ok(())
}

/// The hosts a routed request named (its destination header), after one more request.
fn named_hosts(vm: &mut Vm, ctx: &mut u32) -> Result<Vec<String>> {
    use crate::scenario::{chat_request, exchange, json_answer, messages_body};
    *ctx += 1;
    let req = chat_request(Some("probe"), messages_body(1, 0, false));
    exchange(vm, *ctx, &req, &[json_answer(0)])?;
    let v = vm
        .host()
        .header(host::MAP_REQUEST_HEADERS, DESTINATION_HEADER)
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .unwrap_or_default();
    Ok(v.split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect())
}

/// Shared data of a pool whose hosts mostly left, against a pool that only ever had the few
/// that stayed (see [`departures`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Departures {
    pub hosts: usize,
    pub stayed: usize,
    /// After the suite at `hosts` hosts and the same traffic as below.
    pub before: Shared,
    /// After `hosts - stayed` left, the reload, and [`traffic`].
    pub after: Shared,
    /// A fresh pool of `stayed` hosts, the same suite and traffic.
    pub small: Shared,
    /// The hosts a request named after the departures (only those that stayed).
    pub named_after: Vec<String>,
}

/// A pool of `hosts` hosts runs the suite and some traffic; then all but `stayed` leave (the
/// membership as `pools::observe` leaves it: the hosts that stayed, the newest 64 departures),
/// the root context's next tick installs the smaller pool, and traffic goes on. Compared with
/// a pool that only ever had `stayed` hosts, through the same suite and traffic.
pub fn departures(loaded: &crate::vm::Loaded, hosts: usize, stayed: usize) -> Result<Departures> {
    use crate::scenario::{run_suite_vm, Module, Setup, ROOT};
    let setup = Setup {
        pool: true,
        ..Setup::new(hosts)
    };
    let (_, _, mut vm) = run_suite_vm(loaded, Module::Filter, setup, None)?;
    let mut ctx = 100_000;
    traffic(&mut vm, &mut ctx, 40, "before")?;
    let before = Shared::of(vm.host());
    let now_ms = vm.host().now_ns / 1_000_000;
    let kept: Vec<usize> = (0..stayed).collect();
    let departed: Vec<(String, u64)> = (stayed..hosts)
        .rev()
        .take(64)
        .map(|i| (host_address(i), now_ms))
        .collect();
    vm.host().put_shared(
        membership_key(POOL).as_bytes(),
        membership(&kept, &departed),
    );
    vm.host().advance_ms(250);
    vm.tick(ROOT)?;
    vm.host().calls.clear();
    traffic(&mut vm, &mut ctx, 40, "after")?;
    let named_after = named_hosts(&mut vm, &mut ctx)?;
    let after = Shared::of(vm.host());

    let small = Setup {
        pool: true,
        ..Setup::new(stayed)
    };
    let (_, _, mut vm) = run_suite_vm(loaded, Module::Filter, small, None)?;
    let mut ctx = 100_000;
    traffic(&mut vm, &mut ctx, 40, "before")?;
    traffic(&mut vm, &mut ctx, 40, "after")?;
    let _ = named_hosts(&mut vm, &mut ctx)?;
    let small = Shared::of(vm.host());
    Ok(Departures {
        hosts,
        stayed,
        before,
        after,
        small,
        named_after,
    })
}

fn mean(v: &[u64]) -> u64 {
    v.iter().sum::<u64>() / (v.len().max(1) as u64)
}

fn shared_row(md: &mut String, key: &str, s: &Shared) {
    use std::fmt::Write as _;
    let mut fam: Vec<(&String, &(usize, u64))> = s.by_family.iter().collect();
    fam.sort_by_key(|(_, (_, b))| std::cmp::Reverse(*b));
    let top: Vec<String> = fam
        .iter()
        .take(4)
        .map(|(k, (n, b))| {
            let k = k.trim_start_matches("computeflux/");
            if *n > 1 {
                format!("`{k}` {n} keys {}", crate::thousands(*b))
            } else {
                format!("`{k}` {}", crate::thousands(*b))
            }
        })
        .collect();
    let _ = writeln!(
        md,
        "| {key} | {} | {} | {} | {} |",
        s.keys,
        crate::thousands(s.key_bytes),
        crate::thousands(s.value_bytes),
        top.join(", ")
    );
}

/// The fleet report: scraping (per request, per tick, per answer, per second at the default
/// interval, shared data), pools (per request, series, shared data) and departures. `base` are
/// the suites without scraping (`filter/N`), for comparison.
pub fn markdown(
    base: &[(String, crate::scenario::Suite)],
    fleet: &[(String, crate::scenario::Suite)],
    departures: Option<&Departures>,
) -> String {
    use crate::scenario::SCENARIOS;
    use crate::thousands as th;
    use std::fmt::Write as _;
    let get = |key: &str| {
        base.iter()
            .chain(fleet.iter())
            .find(|(k, _)| k == key)
            .map(|(_, s)| s)
    };
    let count = |key: &str, row: &str| -> Option<u64> {
        let s = get(key)?;
        match row {
            "startup" => Some(s.startup.instructions),
            "tick" => Some(s.tick.instructions),
            r => s.request(r).map(|m| m.instructions),
        }
    };
    let mut md = String::new();

    // Scraping: per request.
    let _ = writeln!(
        md,
        "### Scraping on: instructions per request (every endpoint's load fresh)\n"
    );
    let _ = write!(md, "| scenario |");
    for n in crate::SCRAPE_COUNTS {
        let _ = write!(md, " {n} |");
    }
    let _ = writeln!(
        md,
        " 512 ÷ 4 | 1 024 ÷ 4 | scraping off, 4 → 512 | scraping's cost at 512 |"
    );
    let _ = writeln!(md, "|---|---:|---:|---:|---:|---:|---:|---|---:|");
    let mut rows: Vec<&str> = SCENARIOS.to_vec();
    rows.push("startup");
    for row in rows {
        let _ = write!(md, "| {row} |");
        for n in crate::SCRAPE_COUNTS {
            let c = count(&format!("filter/{n}/scrape"), row);
            let _ = write!(md, " {} |", c.map(th).unwrap_or_else(|| "–".into()));
        }
        let ratio = |n: usize| match (
            count("filter/4/scrape", row),
            count(&format!("filter/{n}/scrape"), row),
        ) {
            (Some(a), Some(b)) => format!("{:.3}", b as f64 / a.max(1) as f64),
            _ => "–".into(),
        };
        let off = match (count("filter/4", row), count("filter/512", row)) {
            (Some(a), Some(b)) => format!("{} → {} ({:.3})", th(a), th(b), b as f64 / a as f64),
            _ => "–".into(),
        };
        let cost = match (count("filter/512", row), count("filter/512/scrape", row)) {
            (Some(a), Some(b)) => format!("{:+}", b as i64 - a as i64),
            _ => "–".into(),
        };
        let _ = writeln!(md, " {} | {} | {off} | {cost} |", ratio(512), ratio(1024));
    }
    // The request that follows a whole round: every load changed since the previous one.
    let after = |n: usize| get(&format!("filter/{n}/scrape")).and_then(|s| s.fleet.after_round);
    let _ = write!(
        md,
        "| new_session after a whole round (every load changed) |"
    );
    for n in crate::SCRAPE_COUNTS {
        let _ = write!(md, " {} |", after(n).map(th).unwrap_or_else(|| "–".into()));
    }
    let r = |n: usize| match (after(4), after(n)) {
        (Some(a), Some(b)) => format!("{:.3}", b as f64 / a.max(1) as f64),
        _ => "–".into(),
    };
    let _ = writeln!(md, " {} | {} | – | – |", r(512), r(1024));
    let _ = writeln!(
        md,
        "\nThe scenarios are measured after the first request that follows a scrape round \
         (the last row): every load fresh, as the previous request left them. A request after \
         `k` loads changed pays between the two rows (its worker derives the loads, rooms and \
         verdicts again)."
    );

    // Scraping: the scraper's own work.
    let per_s = 1_000 / crate::DEFAULT_SCRAPE_INTERVAL_MS;
    let _ = writeln!(
        md,
        "\n### Scraping: the scraper's work (instructions; one worker per Envoy)\n"
    );
    let _ = writeln!(
        md,
        "| endpoints | tick sending every scrape (host calls) | one answer: first / mean / last | a round's answers (host calls, bytes in / out) | tick, nothing due (host calls) | per second at {} ms, steady ({per_s} rounds, every answer as the last) | in new sessions at 4 endpoints | loads (slot keys), bytes |",
        crate::DEFAULT_SCRAPE_INTERVAL_MS
    );
    let _ = writeln!(md, "|---:|---:|---:|---:|---:|---:|---:|---:|");
    for n in crate::SCRAPE_COUNTS {
        let Some(s) = get(&format!("filter/{n}/scrape")) else {
            continue;
        };
        let f = &s.fleet;
        let round: u64 = f.answers.iter().sum();
        let (idle, idle_traffic) = f.tick_idle.clone().unwrap_or_default();
        // Per second at the default interval, steady: a round's sending tick, every answer
        // folding into its endpoint's slot (the round's last answer), and
        // as many ticks with nothing due (the tick is half the interval).
        let last = f.answers.last().copied().unwrap_or(0);
        let second = per_s * (s.tick.instructions + n as u64 * last + idle);
        let ns = count("filter/4", "new_session").unwrap_or(1);
        let loads = f
            .shared
            .by_family
            .get("computeflux/scrape/load/*")
            .map_or(0, |(_, b)| *b);
        let _ = writeln!(
            md,
            "| {n} | {} ({}) | {} / {} / {} | {} ({}, {} / {}) | {} ({}) | {} | {:.0} | {} |",
            th(s.tick.instructions),
            s.tick.traffic.total_calls(),
            th(f.answers.first().copied().unwrap_or(0)),
            th(mean(&f.answers)),
            th(f.answers.last().copied().unwrap_or(0)),
            th(round),
            f.answers_traffic.total_calls(),
            th(f.answers_traffic.bytes_in),
            th(f.answers_traffic.bytes_out),
            th(idle),
            idle_traffic.total_calls(),
            th(second),
            second as f64 / ns as f64,
            th(loads)
        );
    }
    let page = metrics_page(0).len();
    let _ = writeln!(
        md,
        "\nEach answer is a {page}-byte vLLM page. Host calls of one answer at the largest \
         count, by kind: {}.",
        get("filter/1024/scrape")
            .map(|s| {
                let n = s.fleet.answers.len().max(1) as u64;
                s.fleet
                    .answers_traffic
                    .calls
                    .iter()
                    .map(|(k, v)| format!("{}×{}", k.trim_start_matches("proxy_"), v / n))
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default()
    );

    // Pools.
    let _ = writeln!(
        md,
        "\n### Pools: instructions per request, series defined\n"
    );
    let _ = write!(md, "| scenario |");
    for n in crate::POOL_HOSTS {
        let _ = write!(md, " {n} hosts |");
    }
    let _ = writeln!(md, " 1 000 ÷ 4 |");
    let _ = writeln!(md, "|---|---:|---:|---:|---:|");
    let mut rows: Vec<&str> = SCENARIOS.to_vec();
    rows.extend(["startup", "tick"]);
    for row in rows {
        let _ = write!(md, "| {row} |");
        for n in crate::POOL_HOSTS {
            let c = count(&format!("filter/{n}/pool"), row);
            let _ = write!(md, " {} |", c.map(th).unwrap_or_else(|| "–".into()));
        }
        let ratio = match (count("filter/4/pool", row), count("filter/1000/pool", row)) {
            (Some(a), Some(b)) => format!("{:.3}", b as f64 / a.max(1) as f64),
            _ => "–".into(),
        };
        let _ = writeln!(md, " {ratio} |");
    }
    let _ = write!(md, "| metrics defined (series) |");
    for n in crate::POOL_HOSTS {
        let c = get(&format!("filter/{n}/pool")).map(|s| s.fleet.metrics_defined);
        let _ = write!(md, " {} |", c.map_or("–".into(), |c| c.to_string()));
    }
    let _ = writeln!(md, " |");
    let _ = write!(
        md,
        "\nMetrics defined by static fleets, for comparison (one label per endpoint):"
    );
    for (k, s) in base.iter().chain(fleet.iter()) {
        if k.matches('/').count() == 1 && k.starts_with("filter/") {
            let _ = write!(md, " {k}: {};", s.fleet.metrics_defined);
        }
    }
    let _ = writeln!(md);

    // Shared data.
    let _ = writeln!(
        md,
        "\n### Shared data after each suite\n\n| suite | keys | key bytes | value bytes | largest values |\n|---|---:|---:|---:|---|"
    );
    for (k, s) in base.iter().chain(fleet.iter()) {
        if k.starts_with("filter/") && !k.contains("/no_") {
            shared_row(&mut md, k, &s.fleet.shared);
        }
    }

    if let Some(d) = departures {
        let _ = writeln!(
            md,
            "\n### A pool of {} hosts of which {} leave\n\n| state | keys | key bytes | value bytes | largest values |\n|---|---:|---:|---:|---|",
            d.hosts,
            d.hosts - d.stayed
        );
        shared_row(&mut md, &format!("{} hosts, traffic", d.hosts), &d.before);
        shared_row(
            &mut md,
            &format!("{} left, reload, traffic", d.hosts - d.stayed),
            &d.after,
        );
        shared_row(
            &mut md,
            &format!("a pool that only ever had {}", d.stayed),
            &d.small,
        );
        let _ = writeln!(
            md,
            "\nHosts a request named after the departures: {}.",
            d.named_after.join(", ")
        );
    }
    md
}
