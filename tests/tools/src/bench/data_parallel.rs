//! Data-parallel ranks (`--data-parallel R`, R in 2..=4): one endpoint, `dp`, is an engine with
//! R data-parallel ranks (the mock's `--data-parallel-size R`, one prefix cache per rank), the
//! other, `solo`, has one. Three ways to route, each with one Envoy and with three replicas
//! behind the round-robin front of `deployment.rs`:
//! - `computeflux`: the filter with `data_parallel_size: R` on `dp` (each rank an endpoint,
//!   `x-data-parallel-rank` set on the request);
//! - `computeflux_no_ranks`: the same filter without `data_parallel_size`: `dp` is one endpoint
//!   and its engine spreads requests over its ranks itself (the mock: least loaded, ties
//!   round-robin, as vLLM's internal balancer);
//! - `ring_hash`: Envoy's ring hash on the session header (the engine spreads as above).
//!
//! What counts, per run: the cached share of prompt tokens (the answers' `usage`), follow-ups
//! that reached the endpoint *and rank* of their session's previous turn (from the engines'
//! request logs: a session's requests ordered by prompt size, which grows every turn), the
//! requests per rank of `dp`, errors, p50 / p99 of the whole request. Written to
//! `OUT/latest.md` and `OUT/latest.json`.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::deployment::{DeployOpts, Deployment};
use super::summary::quantile;
use super::support::MockUpstream;
use super::topology::{self, Policy, Setup};
use super::workload::{self, SessionPlan, SESSION_HEADER};

/// How one run routes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routing {
    Ranks,
    NoRanks,
    RingHash,
}

impl Routing {
    pub const ALL: [Routing; 3] = [Routing::Ranks, Routing::NoRanks, Routing::RingHash];

    pub fn name(&self) -> &'static str {
        match self {
            Routing::Ranks => "computeflux",
            Routing::NoRanks => "computeflux_no_ranks",
            Routing::RingHash => "ring_hash",
        }
    }

    fn policy(&self) -> Policy {
        match self {
            Routing::Ranks | Routing::NoRanks => Policy::Filter,
            Routing::RingHash => Policy::RingHash,
        }
    }
}

/// The run's settings.
pub struct DpOpts {
    pub ranks: usize,
    pub mock_args: Vec<String>,
    pub deploy: DeployOpts,
    pub envoy_retries: bool,
    pub open_ms: u64,
    pub request_timeout: Duration,
}

/// One run's figures.
#[derive(Clone, Debug)]
pub struct DpSummary {
    pub routing: &'static str,
    pub replicas: usize,
    pub requests: usize,
    pub errors: usize,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub follow_ups: u64,
    /// Follow-ups served by the endpoint and rank of the session's previous turn.
    pub same_rank: u64,
    /// Requests per rank of `dp`.
    pub dp_ranks: Vec<u64>,
    pub solo_requests: u64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub wall_s: f64,
}

impl DpSummary {
    pub fn cached_ratio(&self) -> f64 {
        self.cached_tokens as f64 / self.prompt_tokens.max(1) as f64
    }

    pub fn same_rank_ratio(&self) -> f64 {
        self.same_rank as f64 / self.follow_ups.max(1) as f64
    }

    pub fn to_json(&self) -> Value {
        json!({
            "routing": self.routing, "replicas": self.replicas, "requests": self.requests,
            "errors": self.errors, "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens, "cached_ratio": self.cached_ratio(),
            "follow_ups": self.follow_ups, "same_endpoint_and_rank": self.same_rank,
            "same_endpoint_and_rank_ratio": self.same_rank_ratio(),
            "dp_requests_per_rank": self.dp_ranks, "solo_requests": self.solo_requests,
            "p50_ms": self.p50_ms, "p99_ms": self.p99_ms, "wall_s": self.wall_s,
        })
    }
}

/// The endpoints' filter configuration: `dp` with `data_parallel_size` for [`Routing::Ranks`].
fn plugin_extra(routing: Routing, ranks: usize, open_ms: u64) -> Value {
    let models: &[&str] = &[workload::MODEL];
    let mut cfg = topology::plugin_config(&[("dp", models), ("solo", models)], open_ms, true);
    if routing == Routing::Ranks {
        if let Some(dp) = cfg
            .pointer_mut("/endpoints/0")
            .and_then(Value::as_object_mut)
        {
            dp.insert("data_parallel_size".into(), json!(ranks));
        }
    }
    json!({"endpoints": cfg.get("endpoints").cloned().unwrap_or(Value::Null)})
}

/// Follow-ups and those on the previous turn's endpoint and rank, from the engines' request
/// logs: `(endpoint, log)` pairs.
pub fn follow_ups(logs: &[(&str, Vec<Value>)]) -> (u64, u64) {
    let mut by_session: BTreeMap<String, Vec<(u64, String, u64)>> = BTreeMap::new();
    for (endpoint, log) in logs {
        for r in log.iter().filter(|r| r.get("status") == Some(&json!(200))) {
            let (Some(s), Some(p)) = (
                r.pointer(&format!("/headers/{SESSION_HEADER}"))
                    .and_then(Value::as_str),
                r.get("prompt_tokens").and_then(Value::as_u64),
            ) else {
                continue;
            };
            let rank = r.get("rank").and_then(Value::as_u64).unwrap_or(0);
            by_session
                .entry(s.to_string())
                .or_default()
                .push((p, endpoint.to_string(), rank));
        }
    }
    let (mut all, mut same) = (0, 0);
    for turns in by_session.values_mut() {
        turns.sort();
        for pair in turns.windows(2) {
            if let [(_, e0, r0), (_, e1, r1)] = pair {
                all += 1;
                same += u64::from(e0 == e1 && r0 == r1);
            }
        }
    }
    (all, same)
}

/// One run: fresh engines, the deployment, the sessions, the figures.
pub fn run(
    routing: Routing,
    replicas: usize,
    plans: &[SessionPlan],
    o: &DpOpts,
    wasm: &Path,
) -> Result<DpSummary, String> {
    let started = Instant::now();
    let args: Vec<&str> = o.mock_args.iter().map(String::as_str).collect();
    let ranks = o.ranks.to_string();
    let dp_args: Vec<&str> = [&args[..], &["--data-parallel-size", &ranks]].concat();
    let dp = MockUpstream::start("dp", &[workload::MODEL], &dp_args);
    let solo = MockUpstream::start("solo", &[workload::MODEL], &args);
    for m in [&dp, &solo] {
        topology::record_pid(m.pid());
    }
    let models: &[&str] = &[workload::MODEL];
    let hosts = [("dp", models, dp.port), ("solo", models, solo.port)];
    let setup = Setup {
        policy: routing.policy(),
        hosts: &hosts,
        concurrency: o.deploy.concurrency,
        envoy_retries: o.envoy_retries,
        open_ms: o.open_ms,
        plugin_extra: match routing.policy().lb_policy() {
            None => plugin_extra(routing, o.ranks, o.open_ms),
            Some(_) => Value::Null,
        },
    };
    let boot = topology::bootstrap(&setup, wasm)?;
    let deploy = DeployOpts {
        replicas,
        ..o.deploy.clone()
    };
    let deployment = Deployment::start(&boot, &format!("dp-{}", routing.name()), &deploy)?;
    let t0 = Instant::now() + Duration::from_millis(200);
    let recs = workload::drive(deployment.port(), plans, t0, o.request_timeout);
    drop(deployment);
    let ok: Vec<&workload::Record> = recs.iter().filter(|r| r.ok()).collect();
    let mut lat: Vec<f64> = ok.iter().map(|r| r.latency_ms).collect();
    lat.sort_by(f64::total_cmp);
    let (follow, same) = follow_ups(&[("dp", dp.requests()), ("solo", solo.requests())]);
    let dp_ranks = dp
        .stats()
        .get("ranks")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .map(|r| r.get("requests").and_then(Value::as_u64).unwrap_or(0))
                .collect()
        })
        .unwrap_or_default();
    Ok(DpSummary {
        routing: routing.name(),
        replicas,
        requests: recs.len(),
        errors: recs.len() - ok.len(),
        prompt_tokens: ok.iter().map(|r| r.prompt_tokens).sum(),
        cached_tokens: ok.iter().map(|r| r.cached_tokens).sum(),
        follow_ups: follow,
        same_rank: same,
        dp_ranks,
        solo_requests: solo
            .stats()
            .get("requests")
            .and_then(Value::as_u64)
            .unwrap_or(0),
        p50_ms: quantile(&lat, 0.5),
        p99_ms: quantile(&lat, 0.99),
        wall_s: started.elapsed().as_secs_f64(),
    })
}

/// The report: `meta` lines, then one row per run.
pub fn markdown(meta: &[(&str, String)], rows: &[DpSummary]) -> String {
    let mut md =
        String::from("# Data-parallel ranks: pinned ranks against the engine's own spread\n\n");
    for (k, v) in meta {
        md.push_str(&format!("- {k}: {v}\n"));
    }
    md.push_str(
        "\n| routing | Envoys | cached share of prompt tokens | follow-ups on previous endpoint + rank | \
         dp requests per rank | solo requests | errors | p50 ms | p99 ms | wall s |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        md.push_str(&format!(
            "| {} | {} | {:.1} % | {}/{} ({:.1} %) | {:?} | {} | {} | {:.0} | {:.0} | {:.1} |\n",
            r.routing,
            r.replicas,
            r.cached_ratio() * 100.0,
            r.same_rank,
            r.follow_ups,
            r.same_rank_ratio() * 100.0,
            r.dp_ranks,
            r.solo_requests,
            r.errors,
            r.p50_ms,
            r.p99_ms,
            r.wall_s
        ));
    }
    md
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn follow_ups_count_the_same_endpoint_and_rank_in_prompt_order() {
        let r = |s: &str, p: u64, rank: u64| json!({"status": 200, "headers": {SESSION_HEADER: s}, "prompt_tokens": p, "rank": rank});
        let dp = vec![
            r("a", 300, 1),
            r("a", 100, 1),
            r("b", 100, 0),
            r("b", 200, 1),
        ];
        let solo = vec![r("a", 200, 1), r("c", 100, 0)];
        // a: 100 dp/1 → 200 solo → 300 dp/1: 2 follow-ups, none on the same endpoint and rank;
        // b: 100 dp/0 → 200 dp/1: 1, not the same rank; c: none.
        assert_eq!(follow_ups(&[("dp", dp.clone()), ("solo", solo)]), (3, 0));
        let dp2 = vec![r("a", 100, 1), r("a", 200, 1), json!({"status": 429})];
        assert_eq!(follow_ups(&[("dp", dp2)]), (1, 1));
    }

    #[test]
    fn only_the_ranks_variant_sets_data_parallel_size() {
        let on = plugin_extra(Routing::Ranks, 3, 1000);
        let off = plugin_extra(Routing::NoRanks, 3, 1000);
        assert_eq!(on["endpoints"][0]["data_parallel_size"], json!(3));
        assert_eq!(on["endpoints"][1]["name"], json!("solo"));
        assert!(off["endpoints"][0].get("data_parallel_size").is_none());
    }
}
