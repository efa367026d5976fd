//! The root context: configuration, metrics and the periodic gauge refresh (one per VM).

use super::host;
use super::http::Http;
use super::metrics::Metrics;
use super::shared::SharedData;
use crate::scheduler::breaker::BreakerState;
use crate::scheduler::config::Config;
use crate::scheduler::hash::hash_parts;
use crate::scheduler::saturation::Saturation;
use crate::scheduler::select::{Scheduler, TABLE_KEY};
use crate::scheduler::store::Store;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType, LogLevel};
use std::rc::Rc;
use std::time::Duration;

/// What every HTTP context of this VM shares: the validated configuration and metric ids.
pub struct Plugin {
    pub cfg: Config,
    pub metrics: Metrics,
}

#[derive(Default)]
pub struct Root {
    plugin: Option<Rc<Plugin>>,
}

const TICK: Duration = Duration::from_secs(1);
/// Shared-data key holding the hash of the last configuration logged, so that the effective
/// configuration is logged once per change rather than once per VM.
const LOGGED_KEY: &str = "computeflux/config-logged";

impl Context for Root {}

impl RootContext for Root {
    fn on_vm_start(&mut self, _size: usize) -> bool {
        // Do not format debug lines that Envoy would drop anyway.
        host::init_logging(host::envoy_log_level());
        true
    }

    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = host::buffer(BufferType::PluginConfiguration, 0, usize::MAX);
        let cfg = match Config::from_json(&bytes) {
            Ok(cfg) => cfg,
            Err(errors) => {
                for e in &errors {
                    host::log(
                        LogLevel::Error,
                        &format!("computeflux: invalid configuration: {e}"),
                    );
                }
                host::log(
                    LogLevel::Error,
                    &format!("computeflux: configuration rejected ({} problem(s)); the plugin will not start", errors.len()),
                );
                return false;
            }
        };
        let store = SharedData;
        let digest = hash_parts(0, &[&bytes]).to_le_bytes();
        if store.get(LOGGED_KEY).0.as_deref() != Some(&digest[..]) {
            let _ = store.set(LOGGED_KEY, &digest, None);
            host::log(
                LogLevel::Info,
                &format!("computeflux: configuration accepted: {}", cfg.summary()),
            );
        }
        // Create the endpoint table up front: CAS does not protect key creation.
        if store.get(TABLE_KEY).0.is_none() {
            let table = Scheduler::new(&cfg, &store).table();
            let _ = store.set(TABLE_KEY, &table.encode(), None);
        }
        let metrics = Metrics::define(&cfg);
        self.plugin = Some(Rc::new(Plugin { cfg, metrics }));
        if !host::tick_every(TICK) {
            host::log(
                LogLevel::Warn,
                "computeflux: no tick timer; gauges refresh only as requests finish",
            );
        }
        true
    }

    fn on_tick(&mut self) {
        if let Some(p) = &self.plugin {
            refresh_gauges(p, host::now_ms());
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        self.plugin
            .as_ref()
            .map(|p| Box::new(Http::new(Rc::clone(p), context_id)) as Box<dyn HttpContext>)
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// Gauges mirror the shared endpoint table (absolute values, so every VM may set them).
pub fn refresh_gauges(p: &Plugin, now_ms: u64) {
    let store = SharedData;
    let table = Scheduler::new(&p.cfg, &store).table();
    for (i, (_, st)) in table.entries.iter().enumerate() {
        let Some(m) = p.metrics.endpoint(i) else {
            continue;
        };
        let state = match st.breaker.state_at(now_ms) {
            BreakerState::Closed => 0,
            BreakerState::Open => 1,
            BreakerState::HalfOpen => 2,
        };
        Metrics::set(m.breaker_state, state);
        Metrics::set(
            m.ewma_latency_ms,
            st.latency_ms.map_or(0, |l| l.round() as u64),
        );
        Metrics::set(m.in_flight, u64::from(st.load(now_ms)));
        Metrics::set(m.affinity_payoff_permille, st.payoff.permille());
        let slowness = st
            .slowness
            .value()
            .map_or(0, |v| (v * 1000.0).round() as u64);
        Metrics::set(m.slowness_permille, slowness);
        Metrics::set(m.degraded, u64::from(st.degraded));
        Metrics::set(
            m.saturated,
            u64::from(st.saturation == Saturation::Saturated),
        );
    }
}
