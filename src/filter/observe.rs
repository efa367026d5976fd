//! What the request lifecycle reports, turned into metrics and log lines.
//!
//! The lifecycle ([`crate::scheduler::flow`]) is host-independent: it tells an
//! [`Observer`] what happened, and this one records it in Envoy (metrics through
//! [`super::metrics`], the debug line per decision, warnings for lost shared-data updates).

use super::metrics::Metrics;
use super::plugin::{refresh_endpoint_gauges, Plugin};
use crate::scheduler::flow::{Admission, Observer, Timing};
use crate::scheduler::health::outcome::Outcome;
use crate::scheduler::routing::pin_cookie::Ignored;
use crate::scheduler::routing::select::{AffinityResult, Decision, Finished};
use crate::scheduler::wire::reply::Reply;
use crate::scheduler::wire::session::SessionSource;
use crate::scheduler::wire::usage::Usage;
use log::{debug, warn};

pub struct Recorder<'a> {
    pub plugin: &'a Plugin,
    pub now_ms: u64,
}

impl Recorder<'_> {
    fn name(&self, endpoint: usize) -> &str {
        self.plugin
            .cfg
            .endpoints
            .get(endpoint)
            .map_or("?", |e| e.name.as_str())
    }
}

impl Observer for Recorder<'_> {
    fn picked(&mut self, d: &Decision, attempt: u32) {
        let m = &self.plugin.metrics;
        if attempt == 1 {
            m.affinity(d.affinity);
            if d.by_prefix {
                Metrics::inc(m.prefix_placements);
            }
        }
        m.decision(d.reason);
        if let Some(e) = d.broke_pin_of.and_then(|i| m.endpoint(i)) {
            Metrics::inc(e.pin_breaks);
        }
        for e in d.quota_skipped.iter().filter_map(|&i| m.endpoint(i)) {
            Metrics::inc(e.quota_skips);
        }
        if !d.ticket.counted {
            Metrics::inc(m.cas_exhausted);
            warn!("computeflux: shared-data CAS retries exhausted at pick; in-flight not counted");
        }
        debug!(
            "computeflux: attempt {attempt} -> endpoint {} reason={} affinity={}",
            self.name(d.endpoint),
            d.reason.label(),
            d.affinity.label()
        );
    }

    fn finished(&mut self, endpoint: usize, outcome: &Outcome, report: &Finished, t: Timing) {
        let m = &self.plugin.metrics;
        if !report.stored {
            Metrics::inc(m.cas_exhausted);
            warn!("computeflux: shared-data CAS retries exhausted at finish");
        }
        debug!(
            "computeflux: attempt on endpoint {} ended {} after {} ms (first byte at {:?} ms)",
            self.name(endpoint),
            outcome.label(),
            t.total_ms,
            t.to_headers_ms
        );
        let Some(em) = m.endpoint(endpoint) else {
            return;
        };
        em.outcome(outcome);
        Metrics::set(em.in_flight, u64::from(report.in_flight));
        if let Some(l) = report.latency_ms {
            Metrics::set(em.ewma_latency_ms, l.round() as u64);
        }
        if let (Outcome::Success, Some(ms)) = (outcome, t.to_headers_ms) {
            Metrics::set(em.latency_ms, ms);
        }
        if report.breaker_changed {
            refresh_endpoint_gauges(self.plugin, endpoint, self.now_ms);
        }
    }

    fn failed_over(&mut self, from: usize) {
        if let Some(em) = self.plugin.metrics.endpoint(from) {
            Metrics::inc(em.failovers);
        }
    }

    fn session(&mut self, source: SessionSource) {
        self.plugin.metrics.session(source);
        debug!("computeflux: session keyed by {}", source.label());
    }

    fn budget_exhausted(&mut self) {
        Metrics::inc(self.plugin.metrics.retry_budget_exhausted);
        debug!("computeflux: retry budget exhausted; passing the failure through");
    }

    fn usage(&mut self, endpoint: usize, affinity: AffinityResult, u: &Usage) {
        if let Some(em) = self.plugin.metrics.endpoint(endpoint) {
            em.usage(affinity, u);
        }
        // A session placed by prefix that found its prompt (its instructions) cached.
        if affinity == AffinityResult::Prefix && u.cached_tokens > 0 {
            Metrics::inc(self.plugin.metrics.prefix_hits);
        }
        debug!(
            "computeflux: endpoint {} answered with {} prompt ({} cached) and {} completion tokens",
            self.name(endpoint),
            u.prompt_tokens,
            u.cached_tokens,
            u.completion_tokens
        );
    }

    fn pin_cookie_ignored(&mut self, why: Ignored) {
        self.plugin.metrics.pin_cookie_ignored(why);
        debug!("computeflux: pin cookie ignored ({})", why.label());
    }

    fn admission(&mut self, e: &Admission) {
        self.plugin.metrics.admission.record(e);
        debug!(
            "computeflux: admission {} priority {} after {} ms",
            e.outcome.label(),
            e.asker.priority,
            e.waited_ms
        );
    }

    fn replied(&mut self, reply: &Reply) {
        self.plugin.metrics.rejected(reply.reason);
        debug!(
            "computeflux: local reply {} {}",
            reply.status,
            reply.reason.label()
        );
    }
}
