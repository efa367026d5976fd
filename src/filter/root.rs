//! The root context: configuration, metrics and the periodic gauge refresh (one per VM).

use super::admit;
use super::host;
use super::http::Http;
use super::metrics::Metrics;
use super::parked::Parked;
use super::plugin::{refresh_gauges, Plugin};
use super::pools::Pools;
use super::scrape::Scraper;
use super::shared::SharedData;
use crate::scheduler::config::Config;
use crate::scheduler::routing::pools;
use crate::scheduler::routing::scrape;
use crate::scheduler::routing::table::{claim_layout, slot_ids, TableCache};
use crate::scheduler::state::hash::hash_parts;
use crate::scheduler::state::store::Store;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType, LogLevel};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

#[derive(Default)]
pub struct Root {
    plugin: Option<Rc<Plugin>>,
    /// The configuration as written (pool entries unexpanded); the plugin's is its expansion
    /// by the pools' membership.
    base: Option<Config>,
    /// Present when some endpoint is a pool (see `pools.rs`).
    pools: Option<Pools>,
    /// The metric ids, defined once per configuration (labels are the configured names).
    metrics: Option<Metrics>,
    /// Present when some endpoint's engine is scraped (see `scrape.rs`).
    scraper: Option<Scraper>,
    /// This VM's scrape lease holder id, drawn once.
    holder_id: Option<u64>,
    last_gauges_ms: u64,
    /// This VM's requests paused for admission (kept across configurations: a request keeps
    /// the plugin it started under).
    parked: Rc<Parked<Plugin>>,
    /// The timer period without waiting requests, and when its work last ran.
    base_tick: Duration,
    last_base_ms: u64,
    last_tick_ms: u64,
    /// The timer runs at `admit::ADMISSION_TICK` (requests of this VM wait).
    fast: bool,
}

const TICK: Duration = Duration::from_secs(1);
/// With pools, the membership is followed (and discovery rounds run) at least this often.
const POOL_TICK: Duration = Duration::from_millis(250);
/// Shared-data key holding the hash of the last configuration logged, so that the effective
/// configuration is logged once per change rather than once per VM.
const LOGGED_KEY: &str = "computeflux/config-logged";

impl Context for Root {
    /// The root context is going away (plugin reconfigured by ECDS, VM shut down): hand the
    /// scrape lease over at once instead of letting it lapse.
    fn on_done(&mut self) -> bool {
        if let Some(s) = &mut self.scraper {
            s.release();
        }
        if let Some(p) = &mut self.pools {
            p.release();
        }
        true
    }

    fn on_http_call_response(
        &mut self,
        token: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let now = host::now_ms();
        if let Some(pools) = &mut self.pools {
            if pools.on_response(token, num_headers, now) {
                return;
            }
        }
        if let (Some(p), Some(s)) = (&self.plugin, &mut self.scraper) {
            s.on_response(&p.cfg, token, num_headers, body_size, now);
        }
    }
}

impl Root {
    /// Installs `cfg` (the configured one with its pools expanded) as a configuration reload
    /// does: its place among the layouts of the endpoint table, its scraper, a new plugin for
    /// the requests that start from now on (those in flight keep theirs).
    fn install(&mut self, mut cfg: Config) {
        let store = SharedData;
        // This configuration's place among the layouts that write the endpoint table (requests
        // of the previous configuration may still be draining); creates the table up front,
        // as CAS does not protect key creation.
        cfg.layout_generation = claim_layout(&store, &cfg);
        let me = *self
            .holder_id
            .get_or_insert_with(|| Scraper::holder_id(host::now_ms()));
        if let Some(s) = &mut self.scraper {
            s.release();
        }
        self.scraper = Scraper::new(&cfg, me);
        let metrics = match &self.metrics {
            Some(m) => m.for_layout(&cfg),
            None => Metrics::define(&cfg),
        };
        // The models the configuration names are known now: their static candidates are
        // computed here, not by the first request of each (a pass over the fleet).
        let table_cache = TableCache::for_config(&cfg);
        self.plugin = Some(Rc::new(Plugin {
            cfg,
            metrics,
            table_cache: RefCell::new(table_cache),
            rooms_memo: RefCell::default(),
            // Distinct per VM: the holder id is unique per VM of the process (drawn by CAS).
            vm: (crate::scheduler::state::hash::fmix64(me) as u32).max(1),
            parked: Rc::clone(&self.parked),
        }));
    }

    /// Follows the pools' membership: a discovery round when due, and the expanded
    /// configuration installed when a membership changed.
    fn follow_pools(&mut self, now_ms: u64) {
        let (Some(pools), Some(base), Some(p)) = (&mut self.pools, &self.base, &self.plugin) else {
            return;
        };
        pools.on_tick(&p.cfg, now_ms);
        if let Some(members) = pools.changed(now_ms) {
            let cfg = pools::expand(base, &members);
            if cfg.endpoints != p.cfg.endpoints {
                log::debug!(
                    "computeflux: pool membership changed: {} endpoints",
                    cfg.endpoints.len()
                );
                self.install(cfg);
            }
        }
    }
}

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
        let me = *self
            .holder_id
            .get_or_insert_with(|| Scraper::holder_id(host::now_ms()));
        self.metrics = Some(Metrics::define(&cfg));
        self.pools = Pools::new(&cfg, me);
        let now = host::now_ms();
        let effective = match self.pools.as_mut().and_then(|p| p.changed(now)) {
            Some(members) => pools::expand(&cfg, &members),
            None => cfg.clone(),
        };
        self.base = Some(cfg);
        self.install(effective);
        let mut tick = self
            .scraper
            .as_ref()
            .map_or(TICK, |s| Duration::from_millis(s.tick_ms()).min(TICK));
        if self.pools.is_some() {
            tick = tick.min(POOL_TICK);
        }
        self.base_tick = tick;
        if !host::tick_every(tick) {
            host::log(
                LogLevel::Warn,
                "computeflux: no tick timer; gauges refresh only as requests finish",
            );
        }
        true
    }

    fn on_tick(&mut self) {
        let Some(p) = &self.plugin else { return };
        let now = host::now_ms();
        // Admission rounds while requests of this VM wait (any plugin generation's: a
        // request's own plugin is in its slot), at the fast period; the rest of the timer's
        // work at its own.
        let waiting = admit::round(p, &self.parked, now);
        let base_ms = self.base_tick.as_millis() as u64;
        // A tick sooner than the base period: the fast period is on (a request set it when it
        // started waiting, and may have left since).
        let early = now.saturating_sub(self.last_tick_ms).saturating_add(1) < base_ms;
        self.last_tick_ms = now;
        if waiting && !self.fast {
            self.fast = host::tick_every(admit::ADMISSION_TICK);
        } else if !waiting && (self.fast || early) {
            self.fast = false;
            host::tick_every(self.base_tick);
        }
        if now.saturating_sub(self.last_base_ms) < base_ms.saturating_sub(1) {
            return;
        }
        self.last_base_ms = now;
        // The scraper may tick faster; the endpoint gauges keep their one-second refresh.
        if now.saturating_sub(self.last_gauges_ms) >= TICK.as_millis() as u64 {
            self.last_gauges_ms = now;
            refresh_gauges(p, now);
        }
        // This VM's memo of the published loads, brought up to the store: its requests read
        // it without touching shared data (nothing to read when nothing is scraped).
        let loads = match p.table_cache.try_borrow_mut() {
            Ok(mut cache) => cache.tick_loads(&SharedData, &p.cfg),
            Err(_) => Rc::new(scrape::read_loads(&SharedData, &slot_ids(&p.cfg))),
        };
        if let Some(s) = &mut self.scraper {
            s.on_tick(&p.cfg, &loads, now);
        }
        self.follow_pools(now);
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
