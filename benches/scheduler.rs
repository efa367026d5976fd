//! The cost of one selection, natively, over an in-memory store.
//!
//! The budget is 2 µs per selection at 100 endpoints. A selection is one
//! [`Scheduler::pick`] (affinity lookup, one read-modify-write of the endpoint table) and,
//! when the attempt ends, one [`Scheduler::finish`] (another read-modify-write of the table,
//! plus an affinity write for a session). Statistics are warm (every endpoint past its cold
//! start, with latencies and success rates), so the scoring path is the one production runs.
//!
//! Baselines in the same run: a `MemStore` get + set of the encoded table alone (the floor any
//! design with one shared value pays) and a decode + encode of the table (the codec's share).
//! After criterion's report a summary table prints each case against its baseline.
//!
//! Also the cost of reading an answer's usage (`usage_scan_*`), natively.
//!
//! Run: `cargo bench --bench scheduler` (add `-- --quick` for a fast pass).

// A benchmark aborts on a broken setup: that is what expect is for here.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::indexing_slicing)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use computeflux::scheduler::routing::select::TABLE_KEY;
use computeflux::scheduler::routing::table::Table;
use computeflux::scheduler::state::hash::session_key;
use computeflux::scheduler::wire::usage::{Framing, UsageScan};
use computeflux::scheduler::{
    Config, Exclusions, MemStore, Outcome, Pick, Prefix, Scheduler, Store,
};
use criterion::{BenchmarkId, Criterion, Throughput};
use serde_json::json;

const SIZES: [usize; 3] = [10, 100, 1000];
const NOW_MS: u64 = 1_000_000;

fn config(endpoints: usize, max_sessions: u64) -> Config {
    let eps: Vec<_> = (0..endpoints)
        .map(|i| json!({"name": format!("ep-{i}"), "cluster": format!("cluster-{i}"), "weight": 1 + (i % 3)}))
        .collect();
    Config::from_value(&json!({"endpoints": eps, "affinity_max_sessions": max_sessions}))
        .expect("valid bench config")
}

/// A store whose endpoint table is warm: every endpoint past the cold start, with a latency,
/// a success rate and a recent sample.
fn warm_store(cfg: &Config) -> MemStore {
    let store = MemStore::new();
    let mut table = Table::aligned(None, cfg);
    for (i, (_, st)) in table.entries.iter_mut().enumerate() {
        st.total = cfg.cold_start_samples + 100;
        st.latency_ms = Some(200.0 + (i % 17) as f64 * 25.0);
        st.success_rate = 0.9 + (i % 5) as f64 * 0.02;
        st.last_sample_ms = NOW_MS - 1_000;
        st.in_flight_changed_ms = NOW_MS - 1_000;
    }
    table.write_to(&store);
    store
}

/// Fills every affinity bucket to capacity (`max_sessions` live pins) and returns a session
/// that is pinned, so a pick with it is an affinity hit.
fn fill_affinity(s: &Scheduler<'_>, max_sessions: u64) -> u64 {
    let aff = s.affinity();
    let n_endpoints = s.cfg.endpoints.len() as u64;
    // Twice the bound in distinct sessions: every bucket ends up full, LRU evicting.
    for k in 0..2 * max_sessions {
        let session = session_key(b"bench", &k.to_le_bytes());
        let endpoint = s.cfg.endpoints[(k % n_endpoints) as usize].id;
        aff.remember(session, endpoint, NOW_MS - 2 * max_sessions + k);
    }
    assert_eq!(
        aff.stored_entries() as u64,
        max_sessions,
        "affinity table is full"
    );
    let pinned = session_key(b"bench", &(2 * max_sessions - 1).to_le_bytes());
    assert!(
        aff.lookup(pinned, NOW_MS).is_some(),
        "the last session is pinned"
    );
    pinned
}

/// One benchmark case: a name, and a routine that runs `iters` operations and returns the time
/// spent in the part being measured.
struct Case {
    group: &'static str,
    size: usize,
    baseline: &'static str,
    run: Box<dyn FnMut(u64) -> Duration>,
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for &n in &SIZES {
        // Leaked so that the closures can borrow config and store for the whole run.
        let cfg: &'static Config = Box::leak(Box::new(config(n, 100_000)));
        let store: &'static MemStore = Box::leak(Box::new(warm_store(cfg)));
        let ex: &'static Exclusions = Box::leak(Box::new(Exclusions::default()));
        let bytes = Table::read(store, cfg).encode();

        out.push(Case {
            group: "baseline_store_get_set",
            size: n,
            baseline: "baseline_store_get_set",
            run: Box::new(move |iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    let (v, cas) = store.get(TABLE_KEY);
                    store
                        .set(TABLE_KEY, &v.unwrap_or_default(), cas)
                        .expect("no conflicts");
                }
                start.elapsed()
            }),
        });
        out.push(Case {
            group: "baseline_table_decode_encode",
            size: n,
            baseline: "baseline_store_get_set",
            run: Box::new(move |iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    black_box(Table::aligned(Some(black_box(&bytes)), cfg).encode());
                }
                start.elapsed()
            }),
        });
        out.push(Case {
            group: "pick_finish",
            size: n,
            baseline: "baseline_store_get_set",
            run: Box::new(move |iters| {
                let s = Scheduler::new(cfg, store);
                let start = Instant::now();
                for i in 0..iters {
                    let pick = Pick {
                        model: Some("m"),
                        session: None,
                        attempt: 1,
                        exclusions: ex,
                        nonce: 0,
                        body_bytes: 0,
                        pin_hint: None,
                        holder: None,
                        prefix: Prefix::NONE,
                        follow_up: false,
                        max_output_tokens: 0,
                    };
                    let d = s.pick(&pick, NOW_MS + i).expect("an endpoint");
                    black_box(s.finish(d.ticket, &Outcome::Success, 250, None, NOW_MS + i));
                }
                start.elapsed()
            }),
        });
        out.push(Case {
            group: "pick",
            size: n,
            baseline: "baseline_store_get_set",
            run: Box::new(move |iters| {
                // Only the pick is timed; the finish (untimed) keeps the table stationary.
                let s = Scheduler::new(cfg, store);
                let mut spent = Duration::ZERO;
                for i in 0..iters {
                    let pick = Pick {
                        model: Some("m"),
                        session: None,
                        attempt: 1,
                        exclusions: ex,
                        nonce: 0,
                        body_bytes: 0,
                        pin_hint: None,
                        holder: None,
                        prefix: Prefix::NONE,
                        follow_up: false,
                        max_output_tokens: 0,
                    };
                    let start = Instant::now();
                    let d = s.pick(&pick, NOW_MS + i).expect("an endpoint");
                    spent += start.elapsed();
                    s.finish(d.ticket, &Outcome::Success, 250, None, NOW_MS + i);
                }
                spent
            }),
        });
    }

    // A full affinity table (100 000 live pins) and a pinned session: the sticky path.
    let n = 100;
    let max_sessions = 100_000;
    let cfg: &'static Config = Box::leak(Box::new(config(n, max_sessions)));
    let store: &'static MemStore = Box::leak(Box::new(warm_store(cfg)));
    let ex: &'static Exclusions = Box::leak(Box::new(Exclusions::default()));
    let pinned = fill_affinity(&Scheduler::new(cfg, store), max_sessions);
    out.push(Case {
        group: "pick_finish_affinity_hit_full_table",
        size: n,
        baseline: "baseline_store_get_set",
        run: Box::new(move |iters| {
            let s = Scheduler::new(cfg, store);
            let start = Instant::now();
            for i in 0..iters {
                let pick = Pick {
                    model: Some("m"),
                    session: Some(pinned),
                    attempt: 1,
                    exclusions: ex,
                    nonce: 0,
                    body_bytes: 0,
                    pin_hint: None,
                    holder: None,
                    prefix: Prefix::NONE,
                    follow_up: false,
                    max_output_tokens: 0,
                };
                let d = s.pick(&pick, NOW_MS + i).expect("an endpoint");
                debug_assert_eq!(d.reason, computeflux::scheduler::Reason::AffinityHit);
                black_box(s.finish(d.ticket, &Outcome::Success, 250, Some(pinned), NOW_MS + i));
            }
            start.elapsed()
        }),
    });
    out.push(Case {
        group: "pick_affinity_hit_full_table",
        size: n,
        baseline: "baseline_store_get_set",
        run: Box::new(move |iters| {
            let s = Scheduler::new(cfg, store);
            let mut spent = Duration::ZERO;
            for i in 0..iters {
                let pick = Pick {
                    model: Some("m"),
                    session: Some(pinned),
                    attempt: 1,
                    exclusions: ex,
                    nonce: 0,
                    body_bytes: 0,
                    pin_hint: None,
                    holder: None,
                    prefix: Prefix::NONE,
                    follow_up: false,
                    max_output_tokens: 0,
                };
                let start = Instant::now();
                let d = s.pick(&pick, NOW_MS + i).expect("an endpoint");
                spent += start.elapsed();
                s.finish(d.ticket, &Outcome::Cancelled, 0, None, NOW_MS + i);
            }
            spent
        }),
    });
    usage_cases(&mut out);
    out
}

/// Reading an answer's usage (`usage::UsageScan`): a ~600-byte OpenAI JSON answer in one chunk,
/// and a 16-token stream in 19 chunks (role, tokens, finish, usage, `[DONE]`), as the mock
/// upstream sends them. Size 0: no endpoints involved; each is its own baseline.
fn usage_cases(out: &mut Vec<Case>) {
    let usage = json!({"prompt_tokens": 812, "completion_tokens": 16, "total_tokens": 828,
                       "prompt_tokens_details": {"cached_tokens": 768}});
    let answer =
        json!({"id": "chatcmpl-a-1", "object": "chat.completion", "created": 1_700_000_000,
        "model": "m1", "choices": [{"index": 0, "message": {"role": "assistant",
        "content": "lorem ipsum dolor sit amet ".repeat(12)}, "finish_reason": "stop"}],
        "usage": usage, "system_fingerprint": "mock-a"})
        .to_string()
        .into_bytes();
    let chunk = |v: serde_json::Value| format!("data: {v}\n\n").into_bytes();
    let mut stream: Vec<Vec<u8>> =
        vec![chunk(json!({"id": "c", "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))];
    for i in 0..16 {
        stream.push(chunk(json!({"id": "c", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": format!("word{i} ")}}]})));
    }
    stream.push(chunk(json!({"id": "c", "choices": [], "usage": usage})));
    stream.push(b"data: [DONE]\n\n".to_vec());
    out.push(Case {
        group: "usage_scan_json_answer",
        size: 0,
        baseline: "usage_scan_json_answer",
        run: Box::new(move |iters| {
            let start = Instant::now();
            for _ in 0..iters {
                let mut scan = UsageScan::new(Framing::Json);
                scan.feed(black_box(&answer));
                black_box(scan.finish()).expect("usage");
            }
            start.elapsed()
        }),
    });
    out.push(Case {
        group: "usage_scan_stream_19_chunks",
        size: 0,
        baseline: "usage_scan_stream_19_chunks",
        run: Box::new(move |iters| {
            let start = Instant::now();
            for _ in 0..iters {
                let mut scan = UsageScan::new(Framing::EventStream);
                for c in &stream {
                    scan.feed(black_box(c));
                }
                black_box(scan.finish()).expect("usage");
            }
            start.elapsed()
        }),
    });
}

fn bench(c: &mut Criterion, cases: &mut [Case]) {
    for case in cases.iter_mut() {
        let mut group = c.benchmark_group(case.group);
        group.throughput(Throughput::Elements(1));
        let run = &mut case.run;
        group.bench_function(BenchmarkId::from_parameter(case.size), |b| {
            b.iter_custom(&mut *run)
        });
        group.finish();
    }
}

/// Median time per operation over a few short runs: for the ratio table, measured in this run.
fn per_op_ns(run: &mut dyn FnMut(u64) -> Duration) -> f64 {
    // Calibrate to about 50 ms per run.
    let mut iters = 16u64;
    while run(iters) < Duration::from_millis(5) && iters < (1 << 24) {
        iters *= 2;
    }
    iters *= 10;
    let mut samples: Vec<f64> = (0..5)
        .map(|_| run(iters).as_nanos() as f64 / iters as f64)
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[2]
}

fn summary(cases: &mut [Case]) {
    let measured: Vec<(&'static str, usize, &'static str, f64)> = cases
        .iter_mut()
        .map(|c| (c.group, c.size, c.baseline, per_op_ns(&mut c.run)))
        .collect();
    println!("\nsummary (median of 5 runs, ns per operation; ratio to the store get+set baseline at the same size)");
    println!(
        "{:<40} {:>9} {:>12} {:>8}",
        "case", "endpoints", "ns/op", "ratio"
    );
    for &(group, size, baseline, ns) in &measured {
        let base = measured
            .iter()
            .find(|m| m.0 == baseline && m.1 == size)
            .map_or(f64::NAN, |m| m.3);
        println!("{group:<40} {size:>9} {ns:>12.0} {:>7.1}x", ns / base);
    }
    let at_100 = measured
        .iter()
        .find(|m| m.0 == "pick_finish" && m.1 == 100)
        .map_or(f64::NAN, |m| m.3);
    println!(
        "budget: pick+finish at 100 endpoints = {:.2} µs (target < 2 µs)",
        at_100 / 1_000.0
    );
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` runs each benchmark once as a test.
    let benchmarking = std::env::args().any(|a| a == "--bench");
    let mut cases = cases();
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c, &mut cases);
    c.final_summary();
    if benchmarking && std::env::var_os("COMPUTEFLUX_BENCH_NO_SUMMARY").is_none() {
        summary(&mut cases);
    }
}
