//! Metrics, defined once per VM and cached by id.
//!
//! Names follow `computeflux_<noun>_<unit>` with labels encoded as `.label.value` segments
//! (`computeflux_requests_total.endpoint.gpu-1.outcome.success`); the bootstrap's
//! `stats_config.stats_tags` rules in `envoy/envoy.yaml` turn them into Prometheus labels:
//! `computeflux_requests_total{endpoint="gpu-1",outcome="success"}`. Label values are bounded:
//! endpoint names come from the configuration, the others from the `ALL` list of the enum they
//! label ([`Outcome::ALL`], [`Reason::ALL`], [`AffinityResult::ALL`], [`RejectReason::ALL`],
//! [`SessionSource::ALL`]),
//! so a variant added there gets its series here without another edit.

use super::admission_metrics::AdmissionMetrics;
use super::host;
use crate::scheduler::config::Config;
use crate::scheduler::health::outcome::Outcome;
use crate::scheduler::routing::pin_cookie::Ignored;
use crate::scheduler::routing::select::{AffinityResult, Reason};
use crate::scheduler::wire::reply::RejectReason;
use crate::scheduler::wire::session::SessionSource;
use crate::scheduler::wire::usage::Usage;
use proxy_wasm::types::MetricType;

/// The metric ids of one endpoint.
#[derive(Clone)]
pub struct EndpointMetrics {
    /// One counter per outcome, in [`Outcome::ALL`] order ([`Outcome::index`]).
    pub requests: Vec<Option<u32>>,
    pub failovers: Option<u32>,
    /// Pins to this endpoint broken because it was degraded.
    pub pin_breaks: Option<u32>,
    /// Picks that passed over this endpoint because its quota was short.
    pub quota_skips: Option<u32>,
    pub breaker_state: Option<u32>,
    pub ewma_latency_ms: Option<u32>,
    pub in_flight: Option<u32>,
    pub latency_ms: Option<u32>,
    /// The affinity payoff of its pinned turns, in thousandths (`payoff`).
    pub affinity_payoff_permille: Option<u32>,
    /// Its smoothed slowness (observed ÷ expected for the work), in thousandths (`slowness`).
    pub slowness_permille: Option<u32>,
    /// Whether it is degraded (1) and saturated (1), as last stored.
    pub degraded: Option<u32>,
    pub saturated: Option<u32>,
    /// Token counters by affinity result, in [`AffinityResult::ALL`] order.
    pub tokens: Vec<TokenMetrics>,
}

/// The token counters of one endpoint and affinity result.
#[derive(Clone)]
pub struct TokenMetrics {
    pub prompt: Option<u32>,
    pub cached: Option<u32>,
    pub completion: Option<u32>,
}

impl TokenMetrics {
    fn define(endpoint: &str, affinity: &str) -> TokenMetrics {
        let counter = |base: &str| {
            host::metric(
                MetricType::Counter,
                &format!("{base}.endpoint.{endpoint}.affinity.{affinity}"),
            )
        };
        TokenMetrics {
            prompt: counter("computeflux_prompt_tokens_total"),
            cached: counter("computeflux_cached_prompt_tokens_total"),
            completion: counter("computeflux_completion_tokens_total"),
        }
    }
}

#[derive(Clone)]
pub struct Metrics {
    /// By metrics label (an endpoint's name, a pool's name for all its hosts), in the order
    /// of `labels`.
    pub endpoints: Vec<EndpointMetrics>,
    labels: Vec<String>,
    /// By endpoint index of the configuration in effect: its entry in `endpoints`.
    index: Vec<Option<usize>>,
    /// In [`AffinityResult::ALL`] order.
    affinity: Vec<Option<u32>>,
    /// In [`Reason::ALL`] order.
    decisions: Vec<Option<u32>>,
    /// In [`RejectReason::ALL`] order.
    rejected: Vec<Option<u32>>,
    /// In [`Ignored::ALL`] order.
    pin_cookies_ignored: Vec<Option<u32>>,
    /// In [`SessionSource::ALL`] order.
    sessions: Vec<Option<u32>>,
    pub retry_budget_exhausted: Option<u32>,
    pub cas_exhausted: Option<u32>,
    /// New sessions placed by their instructions' prefix key (`prefix_placement`).
    pub prefix_placements: Option<u32>,
    /// Answers to sessions placed by prefix whose `usage` reported cached prompt tokens.
    pub prefix_hits: Option<u32>,
    /// Admission outcomes, queue lengths and waits.
    pub admission: AdmissionMetrics,
}

/// One counter per label value: `<base>.<label>.<value>`.
fn labelled<'a>(
    base: &str,
    label: &str,
    values: impl Iterator<Item = &'a str>,
) -> Vec<Option<u32>> {
    values
        .map(|v| host::metric(MetricType::Counter, &format!("{base}.{label}.{v}")))
        .collect()
}

/// The id for `value` among `all` (the list `ids` was defined from).
fn slot<T: PartialEq>(all: &[T], value: &T, ids: &[Option<u32>]) -> Option<u32> {
    let i = all.iter().position(|v| v == value)?;
    ids.get(i).copied().flatten()
}

impl Metrics {
    pub fn define(cfg: &Config) -> Metrics {
        // Each label once (a pool's hosts share theirs), looked up by a map: a fleet of 512
        // endpoints is not compared pairwise.
        let mut seen = std::collections::BTreeSet::new();
        let labels: Vec<String> = cfg
            .endpoints
            .iter()
            .map(|e| e.metrics_label())
            .filter(|l| seen.insert(*l))
            .map(str::to_string)
            .collect();
        let endpoints = labels
            .iter()
            .map(|n| EndpointMetrics {
                requests: labelled(
                    &format!("computeflux_requests_total.endpoint.{n}"),
                    "outcome",
                    Outcome::ALL.iter().map(|o| o.label()),
                ),
                failovers: host::metric(
                    MetricType::Counter,
                    &format!("computeflux_failovers_total.endpoint.{n}"),
                ),
                pin_breaks: host::metric(
                    MetricType::Counter,
                    &format!("computeflux_pin_breaks_total.endpoint.{n}"),
                ),
                quota_skips: host::metric(
                    MetricType::Counter,
                    &format!("computeflux_quota_skips_total.endpoint.{n}"),
                ),
                breaker_state: host::metric(
                    MetricType::Gauge,
                    &format!("computeflux_breaker_state.endpoint.{n}"),
                ),
                ewma_latency_ms: host::metric(
                    MetricType::Gauge,
                    &format!("computeflux_ewma_latency_ms.endpoint.{n}"),
                ),
                in_flight: host::metric(
                    MetricType::Gauge,
                    &format!("computeflux_in_flight.endpoint.{n}"),
                ),
                latency_ms: host::metric(
                    MetricType::Histogram,
                    &format!("computeflux_upstream_latency_ms.endpoint.{n}"),
                ),
                affinity_payoff_permille: host::metric(
                    MetricType::Gauge,
                    &format!("computeflux_affinity_payoff_permille.endpoint.{n}"),
                ),
                slowness_permille: host::metric(
                    MetricType::Gauge,
                    &format!("computeflux_slowness_permille.endpoint.{n}"),
                ),
                degraded: host::metric(
                    MetricType::Gauge,
                    &format!("computeflux_degraded.endpoint.{n}"),
                ),
                saturated: host::metric(
                    MetricType::Gauge,
                    &format!("computeflux_saturated.endpoint.{n}"),
                ),
                tokens: AffinityResult::ALL
                    .iter()
                    .map(|a| TokenMetrics::define(n, a.label()))
                    .collect(),
            })
            .collect();
        let mut m = Metrics {
            endpoints,
            labels,
            index: Vec::new(),
            affinity: labelled(
                "computeflux_affinity_total",
                "result",
                AffinityResult::ALL.iter().map(|a| a.label()),
            ),
            decisions: labelled(
                "computeflux_decisions_total",
                "reason",
                Reason::ALL.iter().map(|r| r.label()),
            ),
            rejected: labelled(
                "computeflux_rejected_total",
                "reason",
                RejectReason::ALL.iter().map(|r| r.label()),
            ),
            pin_cookies_ignored: labelled(
                "computeflux_pin_cookies_ignored_total",
                "reason",
                Ignored::ALL.iter().map(|r| r.label()),
            ),
            sessions: labelled(
                "computeflux_sessions_total",
                "source",
                SessionSource::ALL.iter().map(|s| s.label()),
            ),
            retry_budget_exhausted: host::metric(
                MetricType::Counter,
                "computeflux_retry_budget_exhausted_total",
            ),
            cas_exhausted: host::metric(MetricType::Counter, "computeflux_cas_exhausted_total"),
            prefix_placements: host::metric(
                MetricType::Counter,
                "computeflux_prefix_placements_total",
            ),
            prefix_hits: host::metric(MetricType::Counter, "computeflux_prefix_hits_total"),
            admission: AdmissionMetrics::define(cfg),
        };
        m.index = m.index_of(cfg);
        m
    }

    /// The same metric ids for another layout of the same configuration (a pool's membership
    /// changed): nothing is defined again.
    pub fn for_layout(&self, cfg: &Config) -> Metrics {
        let mut m = self.clone();
        m.index = m.index_of(cfg);
        m
    }

    fn index_of(&self, cfg: &Config) -> Vec<Option<usize>> {
        let slots: std::collections::BTreeMap<&str, usize> = self
            .labels
            .iter()
            .enumerate()
            .map(|(k, l)| (l.as_str(), k))
            .collect();
        cfg.endpoints
            .iter()
            .map(|e| slots.get(e.metrics_label()).copied())
            .collect()
    }

    pub fn add(id: Option<u32>, value: u64) {
        if let (Some(id), Ok(v)) = (id, i64::try_from(value)) {
            if v > 0 {
                host::metric_add(id, v);
            }
        }
    }

    pub fn inc(id: Option<u32>) {
        if let Some(id) = id {
            host::metric_add(id, 1);
        }
    }

    pub fn set(id: Option<u32>, value: u64) {
        if let Some(id) = id {
            host::metric_set(id, value);
        }
    }

    pub fn affinity(&self, a: AffinityResult) {
        Self::inc(slot(AffinityResult::ALL, &a, &self.affinity));
    }

    pub fn decision(&self, r: Reason) {
        Self::inc(slot(Reason::ALL, &r, &self.decisions));
    }

    pub fn pin_cookie_ignored(&self, why: Ignored) {
        Metrics::inc(slot(Ignored::ALL, &why, &self.pin_cookies_ignored));
    }

    pub fn session(&self, s: SessionSource) {
        Self::inc(slot(SessionSource::ALL, &s, &self.sessions));
    }

    pub fn rejected(&self, r: RejectReason) {
        Self::inc(slot(RejectReason::ALL, &r, &self.rejected));
    }

    /// The admission queue gauges from a snapshot of the queue.
    pub fn admission_gauges(&self, q: &crate::scheduler::admission::queue::Queue) {
        self.admission.gauges(q);
    }

    pub fn endpoint(&self, i: usize) -> Option<&EndpointMetrics> {
        let k = self.index.get(i).copied().flatten()?;
        self.endpoints.get(k)
    }
}

impl EndpointMetrics {
    pub fn outcome(&self, o: &Outcome) {
        Metrics::inc(self.requests.get(o.index()).copied().flatten());
    }

    /// Adds one answer's tokens to the counters of its affinity result.
    pub fn usage(&self, affinity: AffinityResult, u: &Usage) {
        let Some(t) = AffinityResult::ALL
            .iter()
            .position(|a| *a == affinity)
            .and_then(|i| self.tokens.get(i))
        else {
            return;
        };
        Metrics::add(t.prompt, u.prompt_tokens);
        Metrics::add(t.cached, u.cached_tokens);
        Metrics::add(t.completion, u.completion_tokens);
    }
}
