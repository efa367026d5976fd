//! The scraper: asks self-hosted engines for their own `/metrics` from the root context's
//! timer, one worker per Envoy process at a time.
//!
//! Why in the root context: scraping belongs to no request, and a root context has a timer and
//! may send calls whose answers come back to it. Why a lease: every worker's VM (and the main
//! thread's) runs a root context with its own timer; without the lease each engine would be
//! asked `concurrency + 1` times per interval.
//!
//! Each tick ([`crate::scheduler::routing::scrape::plan::tick_ms`]):
//! 1. every VM brings its memo of the published loads up to the slot keys (the root context's
//!    `TableCache::tick_loads`: a read per slot, only the changed ones decoded), which its
//!    requests then read without touching shared data;
//! 2. the VM tries the lease ([`scrape::try_take`], lease = 3 ticks); the holder mirrors the
//!    loads into the gauges (so that the age of a scrape grows in `/stats` even when no
//!    scrape succeeds) and sends `GET <path>` to each due endpoint (at most one call in flight
//!    per endpoint). A VM that has just taken the lease over first sets its due times from the
//!    published records and empties the slots an earlier, larger configuration used.
//!
//! An answer ([`Scraper::on_response`]) is judged from its head first: a failed call, Envoy's
//! own 503/504 (connect failure, timeout) and a body over
//! [`crate::scheduler::routing::scrape::plan::BODY_LIMIT_BYTES`] are failures without reading the body;
//! otherwise at most that many bytes are read and parsed. The result is folded into the
//! endpoint's record in its slot key ([`scrape::fold`]: one small key per scraped endpoint of
//! the configuration, whatever names come and go): an answer costs the same at any fleet size.

use super::host;
use super::metrics::Metrics;
use super::shared::SharedData;
use crate::scheduler::admission::share;
use crate::scheduler::config::Config;
use crate::scheduler::routing::pools::address as pools_address;
use crate::scheduler::routing::scrape::plan::{self, Schedule};
use crate::scheduler::routing::scrape::{self, ScrapeError, Scraped};
use crate::scheduler::routing::table::groups;
use crate::scheduler::routing::table::slot_ids;
use crate::scheduler::wire::engine_load::EngineLoad;
use crate::scheduler::wire::headers::HeaderSource;
use proxy_wasm::types::{BufferType, MapType, MetricType};

/// The metric ids of one scraped endpoint (of all the hosts of a pool).
#[derive(Clone)]
struct EndpointScrapeMetrics {
    waiting: Option<u32>,
    running: Option<u32>,
    kv_usage_permille: Option<u32>,
    /// The engine's decode pace of its last window, µs per token (0: none).
    decode_us_per_token: Option<u32>,
    age_ms: Option<u32>,
    scrapes: Option<u32>,
    /// In [`ScrapeError::ALL`] order.
    errors: Vec<Option<u32>>,
}

impl EndpointScrapeMetrics {
    fn define(n: &str) -> EndpointScrapeMetrics {
        let gauge = |base: &str| host::metric(MetricType::Gauge, &format!("{base}.endpoint.{n}"));
        EndpointScrapeMetrics {
            waiting: gauge("computeflux_engine_waiting"),
            running: gauge("computeflux_engine_running"),
            kv_usage_permille: gauge("computeflux_engine_kv_usage_permille"),
            decode_us_per_token: gauge("computeflux_engine_decode_us_per_token"),
            age_ms: gauge("computeflux_scrape_age_ms"),
            scrapes: host::metric(
                MetricType::Counter,
                &format!("computeflux_scrapes_total.endpoint.{n}"),
            ),
            errors: ScrapeError::ALL
                .iter()
                .map(|e| {
                    host::metric(
                        MetricType::Counter,
                        &format!(
                            "computeflux_scrape_errors_total.endpoint.{n}.error.{}",
                            e.name()
                        ),
                    )
                })
                .collect(),
        }
    }

    fn error(&self, e: ScrapeError) {
        let i = ScrapeError::ALL.iter().position(|x| *x == e);
        Metrics::inc(i.and_then(|i| self.errors.get(i).copied().flatten()));
    }
}

/// The scrape metrics of each endpoint, defined once per label (a pool's hosts share the
/// pool's).
fn define_by_label(cfg: &Config) -> Vec<Option<EndpointScrapeMetrics>> {
    let mut defined: Vec<(&str, EndpointScrapeMetrics)> = Vec::new();
    cfg.endpoints
        .iter()
        .map(|e| {
            e.metrics.as_ref()?;
            let label = e.metrics_label();
            if let Some((_, m)) = defined.iter().find(|(l, _)| *l == label) {
                return Some(m.clone());
            }
            let m = EndpointScrapeMetrics::define(label);
            defined.push((label, m.clone()));
            Some(m)
        })
        .collect()
}

/// One VM's scraper (present when some endpoint has `metrics`).
pub struct Scraper {
    me: u64,
    tick_ms: u64,
    holding: bool,
    schedule: Schedule,
    ids: Vec<u32>,
    /// By endpoint index; `None` for endpoints that are not scraped.
    metrics: Vec<Option<EndpointScrapeMetrics>>,
}

impl Scraper {
    /// `None` when no endpoint is scraped. `me` is this VM's lease holder id.
    pub fn new(cfg: &Config, me: u64) -> Option<Scraper> {
        if plan::scraped_ids(cfg).is_empty() {
            return None;
        }
        // Every endpoint's id, sorted: an endpoint's slot is its place among them
        // (`scrape::fold`), as every reader finds it (`TableCache::slot_ids`).
        let ids = slot_ids(cfg);
        Some(Scraper {
            me,
            tick_ms: plan::tick_ms(cfg),
            holding: false,
            schedule: Schedule::new(cfg.endpoints.len()),
            ids,
            metrics: define_by_label(cfg),
        })
    }

    pub fn tick_ms(&self) -> u64 {
        self.tick_ms
    }

    /// A lease holder id for this VM.
    pub fn holder_id(now_ms: u64) -> u64 {
        plan::holder_id(&SharedData, now_ms)
    }

    /// Gives the lease up if this VM holds it (its root context is going away).
    pub fn release(&mut self) {
        if self.holding && scrape::release(&SharedData, scrape::LEASE_KEY, self.me) {
            log::debug!("computeflux: scrape lease released (holder {})", self.me);
        }
        self.holding = false;
    }

    /// The timer: `loads` are the published loads as this VM's memo holds them, just brought
    /// up to the store (`TableCache::tick_loads`).
    pub fn on_tick(&mut self, cfg: &Config, loads: &scrape::Loads, now_ms: u64) {
        let store = SharedData;
        let lease_ms = plan::lease_ms(self.tick_ms);
        let held = scrape::try_take(
            &store,
            scrape::LEASE_KEY,
            self.me,
            cfg.layout_generation,
            now_ms,
            lease_ms,
        );
        if !held {
            if self.holding {
                log::debug!("computeflux: scrape lease lost (holder {})", self.me);
            }
            self.holding = false;
            return;
        }
        if !self.holding {
            log::debug!("computeflux: scrape lease taken (holder {})", self.me);
            // Pick up where the previous holder stopped: one interval after its last scrape.
            self.schedule.take_over(cfg, loads);
            // The slots an earlier, larger configuration used are emptied (once).
            let emptied = scrape::retire_slots(&store, self.ids.len());
            if emptied > 0 {
                log::debug!(
                    "computeflux: {emptied} scrape slots of an earlier configuration emptied"
                );
            }
            self.holding = true;
        }
        // The lease holder alone mirrors the loads into the gauges (absolute values, one set
        // for the process: every VM setting every endpoint's cost each a host call per
        // endpoint and tick), so that a scrape's age grows in `/stats` even when no scrape
        // succeeds; its answers set their own endpoint's at once.
        self.refresh_gauges(cfg, loads, now_ms);
        for i in self.schedule.due(cfg, now_ms) {
            let Some(e) = cfg.endpoints.get(i) else {
                continue;
            };
            let Some(m) = &e.metrics else {
                continue;
            };
            let mut headers = plan::request_headers(m);
            // A pool's host alone: if it left, the fallback's answer says so by its stamp.
            if let Some(a) = e.address() {
                headers.push((cfg.destination_header.clone(), a.as_bytes().to_vec()));
            }
            let token = host::dispatch_call(&m.cluster, &headers, m.timeout_ms);
            self.schedule.sent(i, token, m, now_ms);
            if token.is_none() {
                log::warn!(
                    "computeflux: scrape of endpoint {i} refused; is cluster {:?} defined in Envoy?",
                    m.cluster
                );
                self.finish(cfg, i, now_ms, Err(ScrapeError::Dispatch));
            }
        }
    }

    /// A scrape's answer. False when `token` is not one of this scraper's calls.
    pub fn on_response(
        &mut self,
        cfg: &Config,
        token: u32,
        num_headers: usize,
        body_size: usize,
        now_ms: u64,
    ) -> bool {
        let Some((i, _sent_ms)) = self.schedule.answered(token) else {
            return false;
        };
        let Some(e) = cfg.endpoints.get(i) else {
            return true;
        };
        if e.metrics.is_none() {
            return true;
        }
        // Never read the headers of a failed call (the SDK's getter would panic; ours would
        // return nothing, but there is nothing to read).
        let (status, envoy_reply) = if num_headers > 0 {
            let headers = host::header_pairs(MapType::HttpCallResponseHeaders);
            if let (Some(p), Some(listed)) = (&e.pool, e.address()) {
                if let Some(served) = super::pools::stamp(&headers) {
                    super::pools::news(cfg, &p.pool, Some(listed), &served, now_ms);
                    if pools_address(&served).as_deref() != Some(listed) {
                        // Another host's load: not this one's.
                        return true;
                    }
                }
            }
            let status = headers.status();
            let envoy_reply = matches!(status, Some(503 | 504)) && {
                let n = body_size.min(plan::LOCAL_REPLY_PROBE_BYTES);
                let start = host::buffer(BufferType::HttpCallResponseBody, 0, n);
                plan::is_envoy_reply(&start)
            };
            (status, envoy_reply)
        } else {
            (None, false)
        };
        let result = plan::judge_head(num_headers, status, body_size, envoy_reply).and_then(|n| {
            let n = n.min(plan::BODY_LIMIT_BYTES);
            let body = host::buffer(BufferType::HttpCallResponseBody, 0, n);
            plan::judge_body(&body, body_size, e)
        });
        self.finish(cfg, i, now_ms, result);
        true
    }

    /// Records a scrape's result for endpoint `i` and publishes it.
    fn finish(
        &mut self,
        cfg: &Config,
        i: usize,
        now_ms: u64,
        result: Result<EngineLoad, ScrapeError>,
    ) {
        let Some(e) = cfg.endpoints.get(i) else {
            return;
        };
        let store = SharedData;
        let (rec, published) = match scrape::fold(&store, e.id, now_ms, result, &self.ids) {
            Ok(r) => (r, true),
            Err(r) => {
                log::warn!(
                    "computeflux: scrape of {} not published (CAS retries exhausted)",
                    e.name
                );
                (r, false)
            }
        };
        if let (Ok(_), true) = (&result, published) {
            // This process's own part of the engine's load at this scrape (admission's share).
            if let Some(st) = groups::read_entry(&store, i, e.id) {
                let own = st.load(now_ms, cfg.in_flight_max_age_ms);
                share::observe(&store, e.id, rec.scraped_at_ms, own, &self.ids);
            }
        }
        let m = self.metrics.get(i).and_then(Option::as_ref);
        match result {
            Ok(load) => {
                if let Some(m) = m {
                    Metrics::inc(m.scrapes);
                }
                log::debug!(
                    "computeflux: scraped {}: {} waiting={:?} running={:?} kv={:?}",
                    e.name,
                    load.engine.name(),
                    load.waiting,
                    load.running,
                    load.kv_usage_permille
                );
            }
            Err(err) => {
                if let Some(m) = m {
                    m.error(err);
                }
                if rec.consecutive_failures == 1 {
                    log::warn!(
                        "computeflux: scrape of {} failed: {}; its engine load is unknown",
                        e.name,
                        err.name()
                    );
                }
            }
        }
        // This endpoint's gauges only: the others' record did not change, and every tick
        // mirrors them all (`on_tick`). Setting every endpoint's here cost 2 562 host calls
        // per answer at 1 024 endpoints.
        if let (Some(m), true) = (m, published) {
            Self::refresh_endpoint(e, m, &rec, now_ms);
        }
    }

    /// Mirrors the published loads into the gauges (absolute values: any VM may set them).
    fn refresh_gauges(&self, cfg: &Config, loads: &scrape::Loads, now_ms: u64) {
        for (e, m) in cfg.endpoints.iter().zip(&self.metrics) {
            let (Some(m), Some(rec)) = (m, loads.get(e.id)) else {
                continue;
            };
            Self::refresh_endpoint(e, m, rec, now_ms);
        }
    }

    /// One endpoint's gauges from its record.
    fn refresh_endpoint(
        e: &crate::scheduler::config::EndpointConfig,
        m: &EndpointScrapeMetrics,
        rec: &Scraped,
        now_ms: u64,
    ) {
        // A pool's hosts share its series: gauges would show the last host's.
        if e.address().is_some() {
            return;
        }
        if let Some(age) = rec.age_ms(now_ms) {
            Metrics::set(m.age_ms, age);
        }
        if let Some(l) = rec.last {
            if let Some(w) = l.waiting {
                Metrics::set(m.waiting, u64::from(w));
            }
            if let Some(r) = l.running {
                Metrics::set(m.running, u64::from(r));
            }
            if let Some(kv) = l.kv_usage_permille {
                Metrics::set(m.kv_usage_permille, u64::from(kv));
            }
        }
        // 0 when the engine publishes no pace, or its counters just restarted.
        Metrics::set(
            m.decode_us_per_token,
            rec.pace.map_or(0, |p| u64::from(p.us_per_token)),
        );
    }
}
