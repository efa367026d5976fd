//! The scraper's decisions, host-independent: how often the root context ticks, how long the
//! lease runs, which endpoints are due, what the scrape request looks like and how an answer
//! is judged.
//!
//! Why here and not in the glue: every rule that decides whether an engine is asked, once or
//! twice per interval, or whether an answer counts as a timeout or a parse error, can then be
//! tested natively with a controlled clock. `src/filter/scrape.rs` only performs the host calls.
//!
//! - Tick: half the shortest scrape interval, between [`MIN_TICK_MS`] and [`MAX_TICK_MS`] (the
//!   root's own one-second gauge refresh). The lease runs [`LEASE_TICKS`] ticks, so a holder
//!   that misses two ticks still holds it and one whose VM is gone is replaced within three.
//! - [`Schedule`]: per endpoint the next due time and the call in flight (at most one). Due
//!   times advance by whole intervals from the previous due time (not from the tick that
//!   happened to send it), so the rate is one scrape per interval whatever the tick's phase.
//!   A worker that takes the lease over starts from the published records' times
//!   ([`Schedule::seed`]), so a handover does not scrape twice.
//! - [`judge_head`] / [`judge_body`]: at most [`BODY_LIMIT_BYTES`] of an answer are ever read.

use crate::scheduler::config::metrics::MetricsConfig;
use crate::scheduler::config::{Config, EndpointConfig};
use crate::scheduler::routing::scrape::{Loads, ScrapeError};
use crate::scheduler::state::store::{Store, CAS_RETRIES};
use crate::scheduler::wire::engine_load::{parse_rank, EngineLoad};

/// The largest metrics page read; a larger one is a [`ScrapeError::TooLarge`] and is not read.
pub const BODY_LIMIT_BYTES: usize = 256 * 1024;
/// The shortest tick (a 100 ms interval ticks every 50 ms).
pub const MIN_TICK_MS: u64 = 50;
/// The longest tick: the root context's own gauge refresh period.
pub const MAX_TICK_MS: u64 = 1_000;
/// The lease lasts this many ticks.
pub const LEASE_TICKS: u64 = 3;
/// Shared-data counter that hands every VM a distinct lease holder id.
pub const HOLDERS_KEY: &str = "computeflux/scrape/holders";
/// A call whose answer has not come back this long after its timeout is given up (Envoy
/// always answers a dispatched call, but a lost callback must not stop scraping for good).
pub const LOST_CALL_GRACE_MS: u64 = 1_000;

/// The root context's tick period: half the shortest interval of the scraped endpoints,
/// within [`MIN_TICK_MS`]..=[`MAX_TICK_MS`]; [`MAX_TICK_MS`] when nothing is scraped.
pub fn tick_ms(cfg: &Config) -> u64 {
    cfg.endpoints
        .iter()
        .filter_map(|e| e.metrics.as_ref())
        .map(|m| m.interval_ms / 2)
        .min()
        .unwrap_or(MAX_TICK_MS)
        .clamp(MIN_TICK_MS, MAX_TICK_MS)
}

pub fn lease_ms(tick_ms: u64) -> u64 {
    tick_ms.saturating_mul(LEASE_TICKS)
}

/// The ids of the endpoints that are scraped (what the published loads keep).
pub fn scraped_ids(cfg: &Config) -> Vec<u32> {
    cfg.endpoints
        .iter()
        .filter(|e| e.metrics.is_some())
        .map(|e| e.id)
        .collect()
}

/// A distinct lease holder id for this VM (48 bits, [`crate::scheduler::routing::scrape::HOLDER_BITS`]): `(n << 32) | c`,
/// where `n` (15 bits) is the next value of a counter in shared data and `c` the CAS token the
/// write of `n` was conditioned on; from `seed` (the clock), with bit 47 set, in case every
/// CAS attempt lost.
///
/// Why the token: CAS does not protect a key's *creation* (a write to a missing key succeeds
/// whatever its CAS, and an unconditional write replaces whatever is there), so two workers
/// starting at once both read "missing", both wrote 1 and both took holder id 1; each then
/// renewed the other's lease as its own, and both scraped for good. Here an id is
/// only ever taken by a conditional write on the existing key: the key is created first (its
/// value then read again), and two conditional writes cannot both succeed against the same
/// token, which a key's writes never give back (Envoy's tokens come from one counter that
/// only grows). A late creation write that resets the counter changes the token: the ids
/// taken after it still differ from those taken before.
pub fn holder_id(store: &dyn Store, seed: u64) -> u64 {
    for _ in 0..CAS_RETRIES {
        let (bytes, cas) = store.get(HOLDERS_KEY);
        let Some(token) = cas else {
            // Create it; the id comes from the next, conditional write.
            let _ = store.set(HOLDERS_KEY, &0u64.to_le_bytes(), None);
            continue;
        };
        let n = bytes
            .and_then(|b| <[u8; 8]>::try_from(b.as_slice()).ok())
            .map_or(0, u64::from_le_bytes)
            .wrapping_add(1);
        if store
            .set(HOLDERS_KEY, &n.to_le_bytes(), Some(token))
            .is_ok()
        {
            return ((n & 0x7fff) << 32) | u64::from(token);
        }
    }
    (crate::scheduler::state::hash::fmix64(seed) & ((1 << 48) - 1)) | (1 << 47)
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Slot {
    next_due_ms: u64,
    /// The token of the call in flight and when it was sent.
    in_flight: Option<(u32, u64)>,
}

/// One VM's scrape schedule, by endpoint index.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Schedule {
    slots: Vec<Slot>,
}

impl Schedule {
    pub fn new(endpoints: usize) -> Schedule {
        Schedule {
            slots: vec![Slot::default(); endpoints],
        }
    }

    /// The endpoints (indices) to scrape at `now_ms`: scraped, enabled, due, and without a
    /// call in flight. A call in flight past its timeout and [`LOST_CALL_GRACE_MS`] is
    /// forgotten first.
    pub fn due(&mut self, cfg: &Config, now_ms: u64) -> Vec<usize> {
        let mut out = Vec::new();
        for (i, (e, slot)) in cfg.endpoints.iter().zip(self.slots.iter_mut()).enumerate() {
            let Some(m) = &e.metrics else { continue };
            if let Some((_, sent)) = slot.in_flight {
                let lost_at = sent
                    .saturating_add(m.timeout_ms)
                    .saturating_add(LOST_CALL_GRACE_MS);
                if now_ms < lost_at {
                    continue;
                }
                slot.in_flight = None;
            }
            if !e.disabled && now_ms >= slot.next_due_ms {
                out.push(i);
            }
        }
        out
    }

    /// Records that endpoint `i` was scraped (or its call refused) at `now_ms`: the next scrape
    /// is one interval after this one's due time, or after now when it ran late by a whole
    /// interval or more.
    pub fn sent(&mut self, i: usize, token: Option<u32>, m: &MetricsConfig, now_ms: u64) {
        let Some(slot) = self.slots.get_mut(i) else {
            return;
        };
        let next = slot.next_due_ms.saturating_add(m.interval_ms);
        slot.next_due_ms = if next > now_ms {
            next
        } else {
            now_ms.saturating_add(m.interval_ms)
        };
        slot.in_flight = token.map(|t| (t, now_ms));
    }

    /// The endpoint and send time of the call with `token`, which is no longer in flight.
    pub fn answered(&mut self, token: u32) -> Option<(usize, u64)> {
        self.slots.iter_mut().enumerate().find_map(|(i, s)| {
            let (t, sent) = s.in_flight?;
            (t == token).then(|| {
                s.in_flight = None;
                (i, sent)
            })
        })
    }

    /// Sets endpoint `i`'s next due time (a worker taking the lease over: one interval after
    /// the last scrape anyone published).
    pub fn seed(&mut self, i: usize, next_due_ms: u64) {
        if let Some(slot) = self.slots.get_mut(i) {
            slot.next_due_ms = next_due_ms;
        }
    }

    /// A worker that has just taken the lease: each endpoint is next due one interval after
    /// the last scrape anyone published (due now when there is none).
    pub fn take_over(&mut self, cfg: &Config, loads: &Loads) {
        for (i, e) in cfg.endpoints.iter().enumerate() {
            if let (Some(m), Some(rec)) = (&e.metrics, loads.get(e.id)) {
                self.seed(i, rec.attempted_at_ms.saturating_add(m.interval_ms));
            }
        }
    }

    pub fn in_flight(&self) -> usize {
        self.slots.iter().filter(|s| s.in_flight.is_some()).count()
    }
}

/// The scrape request's headers.
pub fn request_headers(m: &MetricsConfig) -> Vec<(String, Vec<u8>)> {
    vec![
        (":method".into(), b"GET".to_vec()),
        (":path".into(), m.path.as_bytes().to_vec()),
        (":authority".into(), m.authority.as_bytes().to_vec()),
        ("accept".into(), b"text/plain;version=0.0.4".to_vec()),
        ("user-agent".into(), b"computeflux-scraper".to_vec()),
    ]
}

/// Bytes of a 503/504 answer read to tell Envoy's own reply from the engine's.
pub const LOCAL_REPLY_PROBE_BYTES: usize = 64;

/// Whether a 503/504 body is Envoy's own reply to a failed call (connect failure, reset,
/// timeout, no healthy host) rather than the engine's.
pub fn is_envoy_reply(body_start: &[u8]) -> bool {
    [
        &b"upstream connect error"[..],
        b"upstream request timeout",
        b"no healthy upstream",
        b"upstream reset",
    ]
    .iter()
    .any(|p| body_start.starts_with(p))
}

/// What to do with an answer's head: `Ok(n)`, read `n` bytes of body and [`judge_body`] them;
/// `Err`, the scrape failed. `num_headers == 0` (the call failed without an answer) and
/// Envoy's own 503/504 replies (`envoy_reply`, see [`is_envoy_reply`]) are timeouts: the
/// engine did not answer.
pub fn judge_head(
    num_headers: usize,
    status: Option<u16>,
    body_size: usize,
    envoy_reply: bool,
) -> Result<usize, ScrapeError> {
    if num_headers == 0 {
        return Err(ScrapeError::Timeout);
    }
    match status {
        Some(503 | 504) if envoy_reply => Err(ScrapeError::Timeout),
        Some(200..=299) if body_size > BODY_LIMIT_BYTES => Err(ScrapeError::TooLarge),
        Some(200..=299) => Ok(body_size),
        _ => Err(ScrapeError::Status),
    }
}

/// The load in a body read after [`judge_head`] (`full_len`: the body's announced size), as
/// endpoint `e` bears it: a data-parallel rank's own series where the page labels them by rank
/// (vLLM `engine`, SGLang `dp_rank`), else its even share of the engine's queue and batch.
pub fn judge_body(
    body: &[u8],
    full_len: usize,
    e: &EndpointConfig,
) -> Result<EngineLoad, ScrapeError> {
    let Some(m) = e.metrics.as_ref() else {
        return Err(ScrapeError::NoSeries);
    };
    let models = e.models.as_deref().unwrap_or(&[]);
    let rank = e.data_parallel.map(|dp| dp.rank);
    let parsed = parse_rank(body, full_len, m.format, models, rank, BODY_LIMIT_BYTES);
    let mut load = parsed.load.map_err(ScrapeError::from)?;
    // A page that labels its series by rank gave this rank's own load; otherwise the rank
    // bears its even share of the engine's queue and batch.
    if let (Some(dp), 0) = (e.data_parallel, parsed.stats.own_rank) {
        load.waiting = load.waiting.map(|n| dp.share(n));
        load.running = load.running.map(|n| dp.share(n));
    }
    Ok(load)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::routing::scrape;
    use crate::scheduler::state::store::{CasMismatch, MemStore};
    use crate::scheduler::wire::engine_load::Engine;
    use serde_json::json;
    use std::cell::Cell;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn cfg(intervals: &[Option<u64>]) -> Config {
        let eps: Vec<_> = intervals
            .iter()
            .enumerate()
            .map(|(i, iv)| match iv {
                Some(ms) => json!({"name": format!("e{i}"), "cluster": format!("c{i}"),
                                   "metrics": {"interval_ms": ms, "timeout_ms": 100}}),
                None => json!({"name": format!("e{i}"), "cluster": format!("c{i}")}),
            })
            .collect();
        Config::from_value(&json!({ "endpoints": eps })).unwrap()
    }

    #[test]
    fn tick_and_lease() {
        assert_eq!(tick_ms(&cfg(&[None])), 1_000);
        assert_eq!(tick_ms(&cfg(&[None, Some(1_000), Some(700)])), 350);
        assert_eq!(tick_ms(&cfg(&[Some(100)])), 50);
        assert_eq!(tick_ms(&cfg(&[Some(60_000)])), 1_000);
        assert_eq!(lease_ms(350), 1_050);
        assert_eq!(scraped_ids(&cfg(&[None, Some(1_000)])).len(), 1);
    }

    #[test]
    fn one_scrape_per_interval_whatever_the_tick_phase() {
        let c = cfg(&[Some(1_000), None]);
        let m = c.endpoints[0].metrics.clone().unwrap();
        let mut s = Schedule::new(2);
        let mut sent = Vec::new();
        let mut token = 0;
        // Ticks every 500 ms with a 37 ms drift each, answers after 20 ms, for 10 s.
        let mut now = 0;
        while now < 10_000 {
            for i in s.due(&c, now) {
                token += 1;
                s.sent(i, Some(token), &m, now);
                sent.push(now);
            }
            // The answer comes back before the next tick.
            if s.in_flight() > 0 {
                assert_eq!(s.answered(token), Some((0, *sent.last().unwrap())));
            }
            now += 537;
        }
        // 10 s at one per second: 10 scrapes (the first at 0), never two within one interval/2.
        assert_eq!(sent.len(), 10, "{sent:?}");
        assert!(sent.windows(2).all(|w| w[1] - w[0] >= 500), "{sent:?}");
    }

    #[test]
    fn at_most_one_call_in_flight_and_lost_calls_are_forgotten() {
        let c = cfg(&[Some(200)]);
        let m = c.endpoints[0].metrics.clone().unwrap();
        let mut s = Schedule::new(1);
        assert_eq!(s.due(&c, 0), vec![0]);
        s.sent(0, Some(7), &m, 0);
        // Due again at 200, but the call is still in flight: not sent twice.
        assert_eq!(s.due(&c, 300), Vec::<usize>::new());
        assert_eq!(s.in_flight(), 1);
        // Its answer never came: given up after timeout (100) + grace.
        assert_eq!(s.due(&c, 100 + LOST_CALL_GRACE_MS), vec![0]);
        s.sent(0, Some(8), &m, 1_100);
        assert_eq!(s.answered(7), None);
        assert_eq!(s.answered(8), Some((0, 1_100)));
        assert_eq!(s.answered(8), None);
        // Late by more than an interval: the next is one interval after now.
        s.seed(0, 5_000);
        assert!(s.due(&c, 4_999).is_empty());
        s.sent(0, None, &m, 5_000);
        assert!(s.due(&c, 5_199).is_empty());
        assert_eq!(s.due(&c, 5_200), vec![0]);
    }

    #[test]
    fn disabled_endpoints_are_not_scraped() {
        let c = Config::from_value(&json!({"endpoints": [
            {"name": "a", "cluster": "a", "disabled": true, "metrics": {}}]}))
        .unwrap();
        assert!(Schedule::new(1).due(&c, 10_000).is_empty());
    }

    #[test]
    fn holder_ids_are_distinct() {
        let s = MemStore::new();
        let ids: Vec<u64> = (0..4).map(|i| holder_id(&s, i)).collect();
        assert_eq!(ids, [1 << 32 | 1, 2 << 32 | 2, 3 << 32 | 3, 4 << 32 | 4]);
        s.inject_conflicts.set(100);
        let lost = holder_id(&s, 42);
        assert!((1 << 47..1 << 48).contains(&lost));
    }

    /// A store where, when this worker first writes the missing holders key, another worker
    /// does everything first: it too read the key missing, created it and took its id.
    struct CreationRace {
        inner: MemStore,
        rival: Cell<bool>,
        rival_id: Cell<u64>,
    }

    impl Store for CreationRace {
        fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
            self.inner.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
            if self.rival.replace(false) {
                self.rival_id.set(holder_id(&self.inner, 7));
            }
            self.inner.set(key, value, cas)
        }
    }

    /// Two workers starting at once both read the holders key missing; the
    /// second's write of the missing key lands after the first took its id. Their ids differ,
    /// and only one of them holds the scrape lease. Before, both took id 1 and both scraped.
    #[test]
    fn two_workers_creating_the_holders_key_at_once_take_distinct_ids() {
        let s = CreationRace {
            inner: MemStore::new(),
            rival: Cell::new(true),
            rival_id: Cell::new(0),
        };
        let mine = holder_id(&s, 3);
        let theirs = s.rival_id.get();
        assert_ne!(theirs, 0, "the race was not injected");
        assert!(
            mine < 1 << 47 && theirs < 1 << 47,
            "an id fell back to the seed"
        );
        assert_ne!(mine, theirs, "two workers took the same holder id");
        let lease = scrape::LEASE_KEY;
        let held = [mine, theirs]
            .iter()
            .filter(|&&me| scrape::try_take(&s.inner, lease, me, 1, 1_000, 3_000))
            .count();
        assert_eq!(held, 1);
        // A third worker, later, takes yet another id.
        let third = holder_id(&s.inner, 9);
        assert!(third != mine && third != theirs);
    }

    #[test]
    fn judging_answers() {
        use ScrapeError::*;
        assert_eq!(judge_head(0, None, 0, false), Err(Timeout));
        assert_eq!(judge_head(3, Some(200), 10, false), Ok(10));
        assert_eq!(
            judge_head(3, Some(200), BODY_LIMIT_BYTES, false),
            Ok(BODY_LIMIT_BYTES)
        );
        assert_eq!(
            judge_head(3, Some(200), BODY_LIMIT_BYTES + 1, false),
            Err(TooLarge)
        );
        assert_eq!(judge_head(3, Some(404), 10, false), Err(Status));
        assert_eq!(judge_head(3, None, 10, false), Err(Status));
        assert_eq!(judge_head(3, Some(504), 24, true), Err(Timeout));
        assert_eq!(judge_head(3, Some(503), 24, false), Err(Status));
        assert!(is_envoy_reply(b"upstream request timeout"));
        assert!(is_envoy_reply(
            b"upstream connect error or disconnect/reset before headers"
        ));
        assert!(!is_envoy_reply(b"Service Unavailable"));
        let c = cfg(&[Some(1_000)]);
        let m = c.endpoints[0].metrics.clone().unwrap();
        let body = b"tgi_queue_size 3\ntgi_batch_current_size 4\n";
        let l = judge_body(body, body.len(), &c.endpoints[0]).unwrap();
        assert_eq!(
            (l.engine, l.waiting, l.running),
            (Engine::Tgi, Some(3), Some(4))
        );
        assert_eq!(judge_body(b"<html>", 6, &c.endpoints[0]), Err(NoSeries));
        // A data-parallel rank bears its even share of the engine's queue and batch.
        let dp = Config::from_value(&json!({"endpoints": [{"name": "g", "cluster": "cg",
            "data_parallel_size": 2, "metrics": {"interval_ms": 1000}}]}))
        .unwrap();
        let l = judge_body(body, body.len(), &dp.endpoints[1]).unwrap();
        assert_eq!((l.waiting, l.running), (Some(2), Some(2)));
        // A page that labels its series by rank (vLLM's engine index): the rank's own.
        let ranked = b"vllm:num_requests_waiting{engine=\"0\"} 6\n\
                       vllm:num_requests_waiting{engine=\"1\"} 1\n\
                       vllm:num_requests_running{engine=\"0\"} 4\n\
                       vllm:num_requests_running{engine=\"1\"} 2\n";
        let vllm = Config::from_value(&json!({"endpoints": [{"name": "g", "cluster": "cg",
            "data_parallel_size": 2, "metrics": {"interval_ms": 1000, "format": "vllm"}}]}))
        .unwrap();
        let own = |i: usize| {
            let l = judge_body(ranked, ranked.len(), &vllm.endpoints[i]).unwrap();
            (l.waiting, l.running)
        };
        assert_eq!((own(0), own(1)), ((Some(6), Some(4)), (Some(1), Some(2))));
        let h = request_headers(&m);
        assert_eq!(h[1], (":path".to_string(), b"/metrics".to_vec()));
        assert_eq!(h[2], (":authority".to_string(), b"c0".to_vec()));
    }

    /// A data-parallel rank is saturated by its own series: on a vLLM page that labels them by
    /// engine index, rank 0 with 6 waiting (or 95 % of its KV cache) is saturated while rank 1,
    /// idle, has room. The same engine's page without rank labels, split evenly (3 waiting per
    /// rank, the mean KV usage of 52.5 %), saturates neither: the per-rank series are what
    /// make one rank full.
    #[test]
    fn a_rank_is_saturated_by_its_own_series() {
        use crate::scheduler::routing::judge::saturation::{self, judge, Saturation};
        let cfg = Config::from_value(&json!({"endpoints": [{"name": "g", "cluster": "cg",
            "data_parallel_size": 2, "metrics": {"interval_ms": 1000, "format": "vllm"}}]}))
        .unwrap();
        let verdicts = |page: &str| -> Vec<Saturation> {
            cfg.endpoints
                .iter()
                .map(|e| {
                    let l = judge_body(page.as_bytes(), page.len(), e).unwrap();
                    let load = saturation::EngineLoad {
                        waiting: l.waiting,
                        running: l.running,
                        kv_usage_permille: l.kv_usage_permille,
                        scraped_ms: 1_000,
                        decode_us_per_token: None,
                        decoded_at_ms: None,
                    };
                    judge(Saturation::Room, Some(&load), &Default::default(), 1_000)
                })
                .collect()
        };
        let page = |w0: u32, w1: u32, kv0: f64, kv1: f64| {
            format!(
                "vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} {w0}\n\
                 vllm:num_requests_waiting{{engine=\"1\",model_name=\"m\"}} {w1}\n\
                 vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} 8\n\
                 vllm:num_requests_running{{engine=\"1\",model_name=\"m\"}} 0\n\
                 vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {kv0}\n\
                 vllm:kv_cache_usage_perc{{engine=\"1\",model_name=\"m\"}} {kv1}\n"
            )
        };
        let (full, room) = (Saturation::Saturated, Saturation::Room);
        // By its queue, by its KV cache.
        assert_eq!(verdicts(&page(6, 0, 0.1, 0.1)), vec![full, room]);
        assert_eq!(verdicts(&page(0, 0, 0.95, 0.1)), vec![full, room]);
        // The other rank full: the verdicts swap.
        assert_eq!(verdicts(&page(0, 7, 0.1, 0.2)), vec![room, full]);
        // The same engine, its series not labelled by rank: split evenly, neither is full.
        let unlabelled = "vllm:num_requests_waiting{model_name=\"m\"} 6\n\
                          vllm:num_requests_running{model_name=\"m\"} 8\n\
                          vllm:kv_cache_usage_perc{model_name=\"m\"} 0.525\n";
        assert_eq!(verdicts(unlabelled), vec![room, room]);
    }

    /// Two workers of one Envoy share the store; each ticks every 100 ms (offset by 50 ms),
    /// answers come back at once. The holder's root context is done at 2.9 s and releases the
    /// lease: the other takes it at its next tick and goes on from the published record — never
    /// two scrapes within an interval (without `take_over` it would scrape 50 ms after the
    /// last), and the engine is asked once per interval throughout.
    #[test]
    fn a_lapsed_lease_is_taken_over_without_double_scrapes() {
        use crate::scheduler::routing::scrape;
        use crate::scheduler::wire::engine_load::EngineLoad;
        let c = cfg(&[Some(200)]);
        let m = c.endpoints[0].metrics.clone().unwrap();
        let id = c.endpoints[0].id;
        let store = MemStore::new();
        let tick = tick_ms(&c);
        assert_eq!(tick, 100);
        let lease = lease_ms(tick);
        struct Vm {
            me: u64,
            holding: bool,
            schedule: Schedule,
            alive_until: u64,
        }
        let mut vms = [
            Vm {
                me: holder_id(&store, 0),
                holding: false,
                schedule: Schedule::new(1),
                alive_until: 2_900,
            },
            Vm {
                me: holder_id(&store, 0),
                holding: false,
                schedule: Schedule::new(1),
                alive_until: u64::MAX,
            },
        ];
        let load = EngineLoad {
            engine: Engine::Tgi,
            waiting: Some(1),
            running: Some(2),
            kv_usage_permille: None,
            prompt_tokens_total: None,
            prompt_tokens_cached_total: None,
            decode: None,
        };
        let mut scrapes: Vec<(u64, u64)> = Vec::new(); // (time, holder)
        let mut token = 0;
        for step in 0..200u64 {
            let now = step * 50;
            let vm = &mut vms[(step % 2) as usize];
            if now >= vm.alive_until {
                // Its root context is done: it hands the lease over at once.
                if vm.holding {
                    assert!(scrape::release(&store, scrape::LEASE_KEY, vm.me));
                    vm.holding = false;
                }
                continue;
            }
            if !scrape::try_take(&store, scrape::LEASE_KEY, vm.me, 1, now, lease) {
                vm.holding = false;
                continue;
            }
            if !vm.holding {
                vm.schedule
                    .take_over(&c, &scrape::read_loads(&store, &[id]));
                vm.holding = true;
            }
            for i in vm.schedule.due(&c, now) {
                token += 1;
                vm.schedule.sent(i, Some(token), &m, now);
                assert_eq!(vm.schedule.answered(token), Some((0, now)));
                scrape::fold(&store, id, now, Ok(load), &[id]).unwrap();
                scrapes.push((now, vm.me));
            }
        }
        let by = |h: u64| scrapes.iter().filter(|(_, who)| *who == h).count();
        // A scraped until its root context was done at 2.9 s, B after: both held the lease.
        assert!(by(vms[0].me) >= 14 && by(vms[1].me) >= 30, "{scrapes:?}");
        assert!(scrapes
            .iter()
            .all(|(t, who)| *who == vms[0].me || *t >= 2_900));
        // Never two scrapes within an interval, handover included.
        assert!(
            scrapes.windows(2).all(|w| w[1].0 - w[0].0 >= 200),
            "{scrapes:?}"
        );
        // 10 s at 200 ms is 50; the handover costs at most the lease (300 ms) plus one interval.
        assert!(
            (46..=50).contains(&scrapes.len()),
            "{}: {scrapes:?}",
            scrapes.len()
        );
    }
}
