//! What the filter itself said during a routing run: its decision counters
//! (`computeflux_decisions_total{reason}`, summed over the replicas) and its per-endpoint
//! slowness estimate (`computeflux_slowness_permille{endpoint}`, sampled once a second).
//!
//! Why: the client's records show where requests went, not why. Issue 23's steady target is "no
//! `pin_break` or `degraded` decision at all", and its closing note asks for the spread of the
//! slowness estimate on a healthy endpoint; both are only visible in the filter's own metrics.
//!
//! How: a thread polls every replica's admin `/stats/prometheus` once a second while the workload
//! runs and keeps each process's latest counters (a replica restarted by a rolling restart is a
//! new process on a new admin port: its predecessor's last sample is kept, so the sum covers both)
//! and every non-zero slowness sample. Envoy's own balancers have no such metrics: their rows
//! stay empty.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::summary::quantile;
use super::support::http;

/// Time between two samples.
pub const SAMPLE_INTERVAL: Duration = Duration::from_millis(1000);

/// The filter metrics one admin page held.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Page {
    /// `reason` → count.
    pub decisions: BTreeMap<String, u64>,
    /// `endpoint` → slowness in thousandths (0: not judged yet).
    pub slowness: BTreeMap<String, f64>,
    /// `name{endpoint}` → value of the per-endpoint gauges in [`TIMELINE_GAUGES`] (kept only for
    /// the timeline, see [`timeline_interval`]).
    pub gauges: BTreeMap<String, f64>,
}

/// The per-endpoint gauges a timeline records: what the filter judged and what it scraped
/// (and one counter, the quota skips).
pub const TIMELINE_GAUGES: [&str; 7] = [
    "computeflux_degraded",
    "computeflux_saturated",
    "computeflux_engine_waiting",
    "computeflux_engine_running",
    "computeflux_engine_decode_us_per_token",
    "computeflux_in_flight",
    // A counter: picks that passed the endpoint over for its quota (when, in the timeline).
    "computeflux_quota_skips_total",
];

/// `BENCH_TIMELINE_MS=N` (diagnostics): sample every N ms instead of once a second and keep
/// every sample of [`TIMELINE_GAUGES`] per process, written next to the per-request records
/// (`--raw-dir`) as `…-timeline.jsonl`. Unset: no timeline.
pub fn timeline_interval() -> Option<Duration> {
    std::env::var("BENCH_TIMELINE_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|ms| *ms > 0)
        .map(Duration::from_millis)
}

/// The label value of `name` in a Prometheus series' label set `{a="x",b="y"}`.
fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    let key = format!("{name}=\"");
    let at = labels.find(&key)? + key.len();
    let rest = labels.get(at..)?;
    rest.get(..rest.find('"')?)
}

/// Reads the decision counters and slowness gauges out of a `/stats/prometheus` text.
pub fn parse(text: &str) -> Page {
    let mut page = Page::default();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(v) = value.trim().parse::<f64>() else {
            continue;
        };
        let Some((name, labels)) = series.split_once('{') else {
            continue;
        };
        match name {
            "computeflux_decisions_total" => {
                if let Some(r) = label(labels, "reason") {
                    *page.decisions.entry(r.to_string()).or_default() += v.max(0.0) as u64;
                }
            }
            "computeflux_slowness_permille" => {
                if let Some(e) = label(labels, "endpoint") {
                    page.slowness.insert(e.to_string(), v);
                    // The timeline keeps the estimate beside the verdicts it leads to.
                    page.gauges.insert(format!("{name}{{{e}}}"), v);
                }
            }
            n if TIMELINE_GAUGES.contains(&n) => {
                if let Some(e) = label(labels, "endpoint") {
                    page.gauges.insert(format!("{n}{{{e}}}"), v);
                }
            }
            _ => {}
        }
    }
    page
}

fn read(admin_port: u16) -> Option<Page> {
    let r = http::request(
        admin_port,
        "GET",
        "/stats/prometheus",
        &[],
        None,
        Duration::from_secs(2),
    )
    .ok()?;
    (r.status == 200).then(|| parse(&r.body))
}

/// What the sampler gathered.
#[derive(Clone, Debug, Default)]
pub struct Gathered {
    /// Admin port → that process's latest decision counters.
    latest: BTreeMap<u16, BTreeMap<String, u64>>,
    /// Endpoint → every non-zero slowness sample (all replicas pooled), with the sample's time
    /// in ms from the run's origin.
    slowness: BTreeMap<String, Vec<(f64, f64)>>,
    /// With [`timeline_interval`]: one JSON object per sample and process.
    pub timeline: Vec<Value>,
}

impl Gathered {
    fn add(&mut self, port: u16, page: Page, at_ms: f64) {
        if timeline_interval().is_some() {
            self.timeline
                .push(json!({"t_ms": at_ms, "port": port, "gauges": page.gauges}));
        }
        self.latest.insert(port, page.decisions);
        for (e, v) in page.slowness {
            if v > 0.0 {
                self.slowness.entry(e).or_default().push((at_ms, v));
            }
        }
    }

    /// Decision counters summed over every process seen.
    pub fn decisions(&self) -> BTreeMap<String, u64> {
        let mut sum = BTreeMap::new();
        for counts in self.latest.values() {
            for (r, n) in counts {
                *sum.entry(r.clone()).or_default() += n;
            }
        }
        sum
    }

    /// Per endpoint, the spread of its slowness samples taken from `from_ms` on.
    pub fn slowness_spread(&self, from_ms: f64) -> BTreeMap<String, Spread> {
        self.slowness
            .iter()
            .filter_map(|(e, samples)| {
                let mut v: Vec<f64> = samples
                    .iter()
                    .filter(|(t, _)| *t >= from_ms)
                    .map(|(_, v)| *v)
                    .collect();
                v.sort_by(f64::total_cmp);
                (!v.is_empty()).then(|| (e.clone(), Spread::of(&v)))
            })
            .collect()
    }
}

/// Quantiles of one endpoint's slowness samples, in thousandths.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Spread {
    pub samples: u64,
    pub min: f64,
    pub p10: f64,
    pub p50: f64,
    pub p90: f64,
    pub max: f64,
}

impl Spread {
    /// Of sorted samples.
    pub fn of(sorted: &[f64]) -> Spread {
        Spread {
            samples: sorted.len() as u64,
            min: sorted.first().copied().unwrap_or(f64::NAN),
            p10: quantile(sorted, 0.1),
            p50: quantile(sorted, 0.5),
            p90: quantile(sorted, 0.9),
            max: sorted.last().copied().unwrap_or(f64::NAN),
        }
    }

    /// p90 ÷ p10: how far apart the estimate's usual values lie (1 = constant).
    pub fn p90_over_p10(&self) -> f64 {
        self.p90 / self.p10
    }

    pub fn to_json(&self) -> Value {
        json!({"samples": self.samples, "min": self.min, "p10": self.p10, "p50": self.p50,
               "p90": self.p90, "max": self.max})
    }

    pub fn from_json(v: &Value) -> Spread {
        let f = |k: &str| v.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
        Spread {
            samples: v.get("samples").and_then(Value::as_u64).unwrap_or(0),
            min: f("min"),
            p10: f("p10"),
            p50: f("p50"),
            p90: f("p90"),
            max: f("max"),
        }
    }
}

/// Polls `ports` (admin ports) every [`SAMPLE_INTERVAL`] until `stop`; times from `t0`.
pub fn sample(ports: &[u16], stop: &AtomicBool, t0: Instant) -> Gathered {
    let mut g = Gathered::default();
    let every = timeline_interval().unwrap_or(SAMPLE_INTERVAL);
    while !stop.load(Ordering::Relaxed) {
        let next = Instant::now() + every;
        let at_ms = Instant::now().saturating_duration_since(t0).as_secs_f64() * 1000.0;
        for p in ports {
            if let Some(page) = read(*p) {
                g.add(*p, page, at_ms);
            }
        }
        while !stop.load(Ordering::Relaxed) && Instant::now() < next {
            std::thread::sleep(Duration::from_millis(10).min(every));
        }
    }
    g
}

/// One last read of `ports` (the processes running at the end, restarted replicas included)
/// into `g`.
pub fn finish(g: &mut Gathered, ports: &[u16], t0: Instant) {
    let at_ms = Instant::now().saturating_duration_since(t0).as_secs_f64() * 1000.0;
    for p in ports {
        if let Some(page) = read(*p) {
            g.add(*p, page, at_ms);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# TYPE computeflux_decisions_total counter\n\
computeflux_decisions_total{reason=\"home\"} 80\n\
computeflux_decisions_total{reason=\"pin_break\"} 3\n\
# TYPE computeflux_slowness_permille gauge\n\
computeflux_slowness_permille{endpoint=\"a\"} 1042\n\
computeflux_slowness_permille{endpoint=\"b\"} 0\n\
computeflux_requests_total{endpoint=\"a\",outcome=\"success\"} 9\n";

    #[test]
    fn reads_decisions_and_slowness_and_nothing_else() {
        let p = parse(TEXT);
        assert_eq!(p.decisions.get("home"), Some(&80));
        assert_eq!(p.decisions.get("pin_break"), Some(&3));
        assert_eq!(p.decisions.len(), 2);
        assert_eq!(p.slowness.get("a"), Some(&1042.0));
        assert_eq!(p.slowness.get("b"), Some(&0.0));
    }

    #[test]
    fn sums_processes_keeps_a_restarted_ones_counts_and_skips_unjudged_slowness() {
        let mut g = Gathered::default();
        g.add(1, parse(TEXT), 0.0);
        g.add(1, parse(TEXT), 1000.0); // same process again: not counted twice
        g.add(2, parse(TEXT), 2000.0); // its successor on another admin port
        assert_eq!(g.decisions().get("home"), Some(&160));
        let s = g.slowness_spread(500.0);
        assert_eq!(s.get("a").map(|s| s.samples), Some(2));
        assert!(!s.contains_key("b"));
    }
}
