//! The admission metrics: outcomes and waits per priority, queue length and waits per tenant
//! with bounded cardinality.
//!
//! Tenant labels never carry a credential: a configured tenant's `label`, else `t` and 8 hex
//! digits of its fairness-id hash (itself a hash of the credential) for the first
//! [`MAX_TENANT_LABELS`] tenants this VM sees waiting, else `other`.

use super::host;
use crate::scheduler::admission::queue::Queue;
use crate::scheduler::admission::who::{self, Asker};
use crate::scheduler::config::tenants::{MAX_PRIORITY, MIN_PRIORITY};
use crate::scheduler::config::Config;
use crate::scheduler::flow::{Admission, AdmissionOutcome};
use proxy_wasm::types::MetricType;
use std::cell::RefCell;

/// Hashed tenant labels a VM defines at most (then `other`).
pub const MAX_TENANT_LABELS: usize = 16;

const PRIORITIES: usize = (MAX_PRIORITY as i16 - MIN_PRIORITY as i16 + 1) as usize;

/// One tenant's series.
#[derive(Clone)]
struct TenantSeries {
    queued: Option<u32>,
    wait_ms: Option<u32>,
}

#[derive(Clone, Default)]
pub struct AdmissionMetrics {
    /// By priority index, then [`AdmissionOutcome::ALL`] order.
    outcomes: Vec<Vec<Option<u32>>>,
    queued: Vec<Option<u32>>,
    wait_ms: Vec<Option<u32>>,
    /// By configured tenant index: its fairness-id hash and series.
    configured: Vec<(u64, TenantSeries)>,
    /// Hashed tenants seen by this VM (tenant hash, series), then `other`.
    seen: RefCell<Vec<(u64, TenantSeries)>>,
    other: Option<TenantSeries>,
}

fn tenant_series(label: &str) -> TenantSeries {
    TenantSeries {
        queued: host::metric(
            MetricType::Gauge,
            &format!("computeflux_admission_tenant_queued.tenant.{label}"),
        ),
        wait_ms: host::metric(
            MetricType::Histogram,
            &format!("computeflux_admission_tenant_wait_ms.tenant.{label}"),
        ),
    }
}

fn index(priority: i8) -> usize {
    (i16::from(priority) - i16::from(MIN_PRIORITY)).clamp(0, PRIORITIES as i16 - 1) as usize
}

impl AdmissionMetrics {
    pub fn define(cfg: &Config) -> AdmissionMetrics {
        let prios = MIN_PRIORITY..=MAX_PRIORITY;
        AdmissionMetrics {
            outcomes: prios
                .clone()
                .map(|p| {
                    AdmissionOutcome::ALL
                        .iter()
                        .map(|o| {
                            host::metric(
                                MetricType::Counter,
                                &format!(
                                    "computeflux_admission_total.priority.{p}.outcome.{}",
                                    o.label()
                                ),
                            )
                        })
                        .collect()
                })
                .collect(),
            queued: prios
                .clone()
                .map(|p| {
                    host::metric(
                        MetricType::Gauge,
                        &format!("computeflux_admission_queued.priority.{p}"),
                    )
                })
                .collect(),
            wait_ms: prios
                .map(|p| {
                    host::metric(
                        MetricType::Histogram,
                        &format!("computeflux_admission_wait_ms.priority.{p}"),
                    )
                })
                .collect(),
            configured: cfg
                .tenants
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    let series = match &t.label {
                        Some(l) => tenant_series(l),
                        None => tenant_series(&format!("tenant{i}")),
                    };
                    (who::tenant_hash(t.id.as_bytes()), series)
                })
                .collect(),
            seen: RefCell::new(Vec::new()),
            other: Some(tenant_series("other")),
        }
    }

    /// The series of a tenant, defining a hashed one while fewer than the bound exist.
    fn tenant(&self, tenant: u64, configured: Option<usize>) -> Option<TenantSeries> {
        if let Some((_, s)) = configured.and_then(|i| self.configured.get(i)) {
            return Some(s.clone());
        }
        let mut seen = self.seen.try_borrow_mut().ok()?;
        if let Some((_, s)) = seen.iter().find(|(t, _)| *t == tenant) {
            return Some(s.clone());
        }
        if seen.len() < MAX_TENANT_LABELS {
            let s = tenant_series(&format!("t{:08x}", tenant >> 32));
            seen.push((tenant, s.clone()));
            return Some(s);
        }
        self.other.clone()
    }

    pub fn record(&self, e: &Admission) {
        let p = index(e.asker.priority);
        if let Some(id) = self
            .outcomes
            .get(p)
            .and_then(|o| o.get(AdmissionOutcome::ALL.iter().position(|x| *x == e.outcome)?))
            .copied()
            .flatten()
        {
            host::metric_add(id, 1);
        }
        let waited = !matches!(
            e.outcome,
            AdmissionOutcome::Direct | AdmissionOutcome::Queued
        );
        if waited {
            if let Some(id) = self.wait_ms.get(p).copied().flatten() {
                host::metric_set(id, e.waited_ms);
            }
            if let Some(id) = self.tenant_of(&e.asker).and_then(|s| s.wait_ms) {
                host::metric_set(id, e.waited_ms);
            }
        }
    }

    fn tenant_of(&self, a: &Asker) -> Option<TenantSeries> {
        self.tenant(a.tenant, a.configured)
    }

    /// The queue gauges from a snapshot of the process's queue (absolute values: any VM may
    /// set them). Tenants are found by hash among the series this VM knows; configured
    /// tenants are recognised by their series only when this VM saw them.
    pub fn gauges(&self, q: &Queue) {
        let mut by_prio = [0u64; PRIORITIES];
        let mut by_tenant: Vec<(u64, u64)> = Vec::new();
        q.waiting_of(|w| {
            if let Some(n) = by_prio.get_mut(index(w.priority)) {
                *n += 1;
            }
            match by_tenant.iter_mut().find(|(t, _)| *t == w.tenant) {
                Some((_, n)) => *n += 1,
                None => by_tenant.push((w.tenant, 1)),
            }
        });
        for (id, n) in self.queued.iter().zip(by_prio) {
            if let Some(id) = id {
                host::metric_set(*id, n);
            }
        }
        let Ok(seen) = self.seen.try_borrow() else {
            return;
        };
        let mut other = 0u64;
        for (t, n) in &by_tenant {
            let known = seen
                .iter()
                .chain(self.configured.iter())
                .any(|(s, _)| s == t);
            if !known {
                other += n;
            }
        }
        for (t, s) in seen.iter().chain(self.configured.iter()) {
            let n = by_tenant
                .iter()
                .find(|(x, _)| x == t)
                .map_or(0, |(_, n)| *n);
            if let Some(id) = s.queued {
                host::metric_set(id, n);
            }
        }
        if let Some(id) = self.other.as_ref().and_then(|s| s.queued) {
            host::metric_set(id, other);
        }
    }
}
