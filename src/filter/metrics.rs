//! Metrics, defined once per VM and cached by id.
//!
//! Names follow `computeflux_<noun>_<unit>` with labels encoded as `.label.value` segments
//! (`computeflux_requests_total.endpoint.gpu-1.outcome.success`); the bootstrap's
//! `stats_config.stats_tags` rules in `envoy/envoy.yaml` turn them into Prometheus labels:
//! `computeflux_requests_total{endpoint="gpu-1",outcome="success"}`. Label values are bounded:
//! endpoint names come from the configuration, the others from fixed lists.

use crate::scheduler::config::Config;
use crate::scheduler::outcome::Outcome;
use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

/// Local-reply reasons (the `reason` label of `computeflux_rejected_total`).
pub const REJECT_REASONS: &[&str] = &[
    "empty_body",
    "request_too_large",
    "invalid_json",
    "invalid_request_body",
    "missing_model",
    "invalid_model",
    "invalid_session_id",
    "model_not_found",
    "no_endpoint_available",
    "rate_limited",
];

pub const DECISION_REASONS: &[&str] = &[
    "affinity_hit",
    "home",
    "backup",
    "spill",
    "pin_break",
    "half_open_probe",
    "degraded_probe",
];
pub const AFFINITY_RESULTS: &[&str] = &[
    "hit",
    "miss",
    "home",
    "backup",
    "spill",
    "pin_break",
    "none",
];

/// The metric ids of one endpoint.
pub struct EndpointMetrics {
    /// One counter per outcome, in `Outcome::ALL_LABELS` order.
    pub requests: Vec<Option<u32>>,
    pub failovers: Option<u32>,
    /// Pins to this endpoint broken because it was degraded.
    pub pin_breaks: Option<u32>,
    pub breaker_state: Option<u32>,
    pub ewma_latency_ms: Option<u32>,
    pub in_flight: Option<u32>,
    pub latency_ms: Option<u32>,
}

pub struct Metrics {
    pub endpoints: Vec<EndpointMetrics>,
    pub affinity: Vec<Option<u32>>,
    pub decisions: Vec<Option<u32>>,
    pub rejected: Vec<Option<u32>>,
    pub retry_budget_exhausted: Option<u32>,
    pub cas_exhausted: Option<u32>,
}

fn define(kind: MetricType, name: &str) -> Option<u32> {
    hostcalls::define_metric(kind, name).ok()
}

impl Metrics {
    pub fn define(cfg: &Config) -> Metrics {
        let endpoints = cfg
            .endpoints
            .iter()
            .map(|e| {
                let n = &e.name;
                EndpointMetrics {
                    requests: Outcome::ALL_LABELS
                        .iter()
                        .map(|o| {
                            define(
                                MetricType::Counter,
                                &format!("computeflux_requests_total.endpoint.{n}.outcome.{o}"),
                            )
                        })
                        .collect(),
                    failovers: define(
                        MetricType::Counter,
                        &format!("computeflux_failovers_total.endpoint.{n}"),
                    ),
                    pin_breaks: define(
                        MetricType::Counter,
                        &format!("computeflux_pin_breaks_total.endpoint.{n}"),
                    ),
                    breaker_state: define(
                        MetricType::Gauge,
                        &format!("computeflux_breaker_state.endpoint.{n}"),
                    ),
                    ewma_latency_ms: define(
                        MetricType::Gauge,
                        &format!("computeflux_ewma_latency_ms.endpoint.{n}"),
                    ),
                    in_flight: define(
                        MetricType::Gauge,
                        &format!("computeflux_in_flight.endpoint.{n}"),
                    ),
                    latency_ms: define(
                        MetricType::Histogram,
                        &format!("computeflux_upstream_latency_ms.endpoint.{n}"),
                    ),
                }
            })
            .collect();
        let labelled = |kind, base: &str, label: &str, values: &[&str]| -> Vec<Option<u32>> {
            values
                .iter()
                .map(|v| define(kind, &format!("{base}.{label}.{v}")))
                .collect()
        };
        Metrics {
            endpoints,
            affinity: labelled(
                MetricType::Counter,
                "computeflux_affinity_total",
                "result",
                AFFINITY_RESULTS,
            ),
            decisions: labelled(
                MetricType::Counter,
                "computeflux_decisions_total",
                "reason",
                DECISION_REASONS,
            ),
            rejected: labelled(
                MetricType::Counter,
                "computeflux_rejected_total",
                "reason",
                REJECT_REASONS,
            ),
            retry_budget_exhausted: define(
                MetricType::Counter,
                "computeflux_retry_budget_exhausted_total",
            ),
            cas_exhausted: define(MetricType::Counter, "computeflux_cas_exhausted_total"),
        }
    }

    pub fn inc(id: Option<u32>) {
        if let Some(id) = id {
            let _ = hostcalls::increment_metric(id, 1);
        }
    }

    pub fn set(id: Option<u32>, value: u64) {
        if let Some(id) = id {
            let _ = hostcalls::record_metric(id, value);
        }
    }

    pub fn inc_labelled(ids: &[Option<u32>], labels: &[&str], label: &str) {
        if let Some(i) = labels.iter().position(|l| *l == label) {
            Self::inc(ids.get(i).copied().flatten());
        }
    }

    pub fn endpoint(&self, i: usize) -> Option<&EndpointMetrics> {
        self.endpoints.get(i)
    }
}
