//! How often do Envoy replicas agree on a session's home? A simulation of the pure scheduler.
//!
//! Why: placement weighs endpoints by their smoothed health, which each replica measures for
//! itself. Quantizing health to levels (`routing::placement::PLACEMENT_QUANTUM`, 1: halvings)
//! trades latency-awareness for agreement; this measures what the built-in step gives. (Other
//! steps were compared when it was a key — 0, 0.25, 0.5, 1, 2 — and 1 was kept: see
//! `docs/adr/0001-rendezvous-placement.md`.)
//!
//! How: for each fleet shape, three replicas each warm their own scheduler (their own
//! `MemStore`) with latency samples drawn around the same true latencies with independent
//! noise, then place the same 20 000 new sessions. Reported:
//! - agreement: sessions whose home is the same on all three replicas (and on a freshly
//!   restarted replica with empty state, "with restart");
//! - the share of sessions homed on the slowest endpoint(s), to show what quantizing gives up.
//!
//! Run: `cargo run --release -p computeflux-tools --bin placement_sim` (a few seconds).

use computeflux::scheduler::health::outcome::Outcome;
use computeflux::scheduler::routing::placement::PLACEMENT_QUANTUM;
use computeflux::scheduler::routing::select::{Exclusions, Pick, Prefix};
use computeflux::scheduler::state::hash::session_key;
use computeflux::scheduler::{Config, MemStore, Scheduler};
use serde_json::json;

/// xorshift64*: deterministic noise without a dependency.
struct Rng(u64);

impl Rng {
    fn next_f64(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// A sample of `mean` with multiplicative noise of about ±`spread` (uniform in log space).
    fn around(&mut self, mean: f64, spread: f64) -> f64 {
        mean * (1.0 + spread).powf(2.0 * self.next_f64() - 1.0)
    }
}

fn config(n: usize) -> Config {
    let endpoints: Vec<_> = (0..n)
        .map(|i| json!({"name": format!("gpu-{i}"), "cluster": format!("c{i}")}))
        .collect();
    match Config::from_value(&json!({"endpoints": endpoints, "cold_start_samples": 20})) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("configuration rejected: {e:?}");
            std::process::exit(1)
        }
    }
}

/// One replica's view after `samples` successes per endpoint around `latencies`.
fn warm(cfg: &Config, latencies: &[f64], samples: u32, rng: &mut Rng) -> MemStore {
    let store = MemStore::new();
    let s = Scheduler::new(cfg, &store);
    let n = latencies.len();
    for _ in 0..samples {
        for (i, &lat) in latencies.iter().enumerate() {
            // An attempt on endpoint i: every other endpoint excluded for it.
            let ex = Exclusions {
                tried: (0..n).filter(|&j| j != i).collect(),
                ..Exclusions::default()
            };
            let pick = Pick {
                model: Some("m"),
                session: None,
                attempt: 1,
                exclusions: &ex,
                nonce: 0,
                body_bytes: 0,
                pin_hint: None,
                holder: None,
                prefix: Prefix::NONE,
                follow_up: false,
                max_output_tokens: 0,
            };
            let Ok(d) = s.pick(&pick, 1_000) else {
                continue;
            };
            let sample = rng.around(lat, 0.3).round() as u64;
            s.finish(d.ticket, &Outcome::Success, sample, None, 1_000);
        }
    }
    store
}

fn home(cfg: &Config, store: &MemStore, session: u64) -> Option<usize> {
    let s = Scheduler::new(cfg, store);
    let ex = Exclusions::default();
    let pick = Pick {
        model: Some("m"),
        session: Some(session),
        attempt: 1,
        exclusions: &ex,
        nonce: 0,
        body_bytes: 0,
        pin_hint: None,
        holder: None,
        prefix: Prefix::NONE,
        follow_up: false,
        max_output_tokens: 0,
    };
    let d = s.pick(&pick, 1_001).ok()?;
    s.finish(d.ticket, &Outcome::Cancelled, 0, None, 1_001);
    Some(d.endpoint)
}

fn main() {
    let fleets: &[(&str, &[f64])] = &[
        ("equal (4 x 400 ms)", &[400.0, 400.0, 400.0, 400.0]),
        ("spread (400..700 ms)", &[400.0, 500.0, 600.0, 700.0]),
        ("near 2x (400, 780, 820)", &[400.0, 780.0, 820.0, 400.0]),
        ("one 2.5x slower", &[400.0, 400.0, 400.0, 1000.0]),
    ];
    const SESSIONS: u64 = 20_000;
    println!("| fleet | placement_quantum | agree (3 warm) | agree (2 warm + restarted) | share on slowest |");
    println!("|---|---|---|---|---|");
    for (name, latencies) in fleets {
        let slowest = latencies.iter().cloned().fold(f64::MIN, f64::max);
        {
            let quantum = PLACEMENT_QUANTUM;
            let cfg = config(latencies.len());
            let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
            let replicas: Vec<MemStore> = (0..3)
                .map(|_| warm(&cfg, latencies, 40, &mut rng))
                .collect();
            let fresh = MemStore::new();
            let (mut agree, mut agree_restart, mut on_slowest) = (0u64, 0u64, 0u64);
            for n in 0..SESSIONS {
                let k = session_key(b"sim", &n.to_le_bytes());
                let homes: Vec<Option<usize>> = replicas.iter().map(|r| home(&cfg, r, k)).collect();
                let first = homes.first().copied().flatten();
                if homes.iter().all(|h| *h == first) {
                    agree += 1;
                }
                let restarted = home(&cfg, &fresh, k);
                if homes
                    .get(..2)
                    .is_some_and(|h| h.iter().all(|x| *x == restarted))
                {
                    agree_restart += 1;
                }
                if first.and_then(|i| latencies.get(i)) == Some(&slowest) {
                    on_slowest += 1;
                }
            }
            let pct = |x: u64| 100.0 * x as f64 / SESSIONS as f64;
            let all_equal = latencies.iter().all(|l| *l == slowest);
            let slow_share = if all_equal {
                "n/a".to_string()
            } else {
                format!("{:.1} %", pct(on_slowest))
            };
            println!(
                "| {name} | {quantum} | {:.1} % | {:.1} % | {slow_share} |",
                pct(agree),
                pct(agree_restart),
            );
        }
    }
}
