//! The signals that judge endpoints, gathered for one decision: is an endpoint *degraded* (slow
//! for the work, against its peers) or *saturated* (full, by its engine's own load), and what
//! its load is for bounded-load placement.
//!
//! Why a module of its own: the two verdicts read different sources — the endpoint table's
//! per-endpoint [`Slowness`] and the scraped engine records — and both are kept with hysteresis
//! in the table. `select` asks for every verdict once per decision ([`judge`]) and stores the
//! flags that flipped; `finish` teaches the slowness and the fleet's [`WorkModel`] from the
//! attempt's [`Served`] answer.
//!
//! - **Peers** ([`peers`]): the endpoints that share a configured model with an endpoint
//!   (an endpoint without a model list serves every model, so it shares with all). Static, from
//!   the configuration, not "the request's model": an endpoint's verdict is the same for every
//!   request.
//! - **Work model** ([`work_key`]): one [`WorkModel`] per requested model that some endpoint
//!   lists (its own shared-data key), and one for every other model: bounded by the
//!   configuration. Keyed by the requested model because the per-token costs are the served
//!   LLM's. Only non-degraded endpoints teach it, so a slow endpoint does not drag the
//!   yardstick.
//! - **Engine loads** ([`engine_loads`]): the scraped record of each endpoint, if fresh; the
//!   one place that reads them (the scraper may later combine them into one key).

use crate::scheduler::config::{Config, EndpointConfig};
use crate::scheduler::routing::judge::saturation::{self, EngineLoad, SaturationRule};
use crate::scheduler::routing::judge::slowness::{self, DegradeRule, Sample, Slowness, WorkModel};
use crate::scheduler::routing::scrape::{self, LoadState};
use crate::scheduler::routing::table::{EndpointState, Table};
use crate::scheduler::routing::table::{MedianMemo, Quiet, QuietMemo, TableCache};
use crate::scheduler::state::store::{update, Store};
use crate::scheduler::wire::usage::Usage;
use std::rc::Rc;

/// Shared-data key prefix of the work models.
pub const WORK_PREFIX: &str = "computeflux/work/";

/// A scraped record older than this is stale (about three scrape intervals of 1–2 s; matches
/// [`SaturationRule::default`]).
pub const SCRAPE_STALE_MS: u64 = 5_000;

/// Whether two endpoints serve a model in common (`None` serves every model).
pub fn share_model(a: &EndpointConfig, b: &EndpointConfig) -> bool {
    match (&a.models, &b.models) {
        (Some(x), Some(y)) => x.iter().any(|m| y.contains(m)),
        _ => true,
    }
}

/// The enabled endpoints that share a model with endpoint `i`, without `i`.
pub fn peers(cfg: &Config, i: usize) -> impl Iterator<Item = usize> + '_ {
    let me = cfg.endpoints.get(i);
    cfg.endpoints
        .iter()
        .enumerate()
        .filter(move |(j, e)| *j != i && !e.disabled && me.is_some_and(|m| share_model(m, e)))
        .map(|(j, _)| j)
}

/// The median slowness of endpoint `i`'s warm peers in `table` (see [`peer_medians`]).
pub fn peer_median(table: &Table, cfg: &Config, i: usize, min_samples: u32) -> Option<f64> {
    peer_medians(table, cfg, min_samples)
        .get(i)
        .copied()
        .flatten()
}

/// Every endpoint's peer median, computed once per decision: for each model an endpoint
/// lists, the median slowness of the other enabled endpoints serving that model (an endpoint
/// without a model list serves every model); an endpoint serving several models takes the
/// largest of those medians (the most lenient reference: a slow endpoint is slow against
/// every model's peers), one without a list compares with every other endpoint. One sorted
/// list per model and one for the fleet, with each endpoint's own value left out by position:
/// O(n log n + Σ models) for the whole fleet, whatever its size.
pub fn peer_medians(table: &Table, cfg: &Config, min_samples: u32) -> Vec<Option<f64>> {
    let n = cfg.endpoints.len();
    let value = |i: usize| {
        table
            .entries
            .get(i)
            .map(|(_, st)| &st.slowness)
            .filter(|s| s.samples >= min_samples)
            .and_then(Slowness::value)
            .filter(|x| x.is_finite())
    };
    let values: Vec<Option<f64>> = (0..n).map(value).collect();
    medians_among_peers(cfg, &values)
}

/// Every endpoint's peers' median engine pace (µs per token, from the fresh scraped loads):
/// [`peer_medians`]'s rule over the endpoints whose engines publish a pace. `None` for an
/// endpoint none of whose peers has one; an empty list when no engine has one.
pub fn pace_medians(cfg: &Config, loads: &[Option<EngineLoad>]) -> Vec<Option<f64>> {
    if !loads
        .iter()
        .flatten()
        .any(|l| l.decode_us_per_token.is_some())
    {
        // No engine publishes a pace (hosted keys, no metrics): nothing to compare, and no
        // allocation (an empty list reads as `None` for every endpoint).
        return Vec::new();
    }
    let values: Vec<Option<f64>> = (0..cfg.endpoints.len())
        .map(|i| {
            loads
                .get(i)
                .copied()
                .flatten()
                .and_then(|l| l.decode_us_per_token)
                .map(f64::from)
        })
        .collect();
    medians_among_peers(cfg, &values)
}

/// The median of `values` (by endpoint index, `None`: no value) over each endpoint's enabled
/// peers, as [`peer_medians`] documents.
fn medians_among_peers(cfg: &Config, values: &[Option<f64>]) -> Vec<Option<f64>> {
    let n = cfg.endpoints.len();
    let values: Vec<Option<f64>> = (0..n)
        .map(|i| {
            values
                .get(i)
                .copied()
                .flatten()
                .filter(|x| x.is_finite())
                .filter(|_| cfg.endpoints.get(i).is_some_and(|e| !e.disabled))
        })
        .collect();
    let mut fleet: Vec<f64> = values.iter().flatten().copied().collect();
    let wildcard: Vec<f64> = cfg
        .endpoints
        .iter()
        .zip(&values)
        .filter(|(e, _)| e.models.is_none())
        .filter_map(|(_, v)| *v)
        .collect();
    let mut per_model: std::collections::BTreeMap<&str, Vec<f64>> = Default::default();
    for e in &cfg.endpoints {
        for m in e.models.iter().flatten() {
            per_model
                .entry(m.as_str())
                .or_insert_with(|| wildcard.clone());
        }
    }
    for (e, v) in cfg.endpoints.iter().zip(&values) {
        if let (Some(ms), Some(v)) = (&e.models, v) {
            let mut seen: Vec<&str> = Vec::with_capacity(ms.len());
            for m in ms {
                if seen.contains(&m.as_str()) {
                    continue;
                }
                seen.push(m);
                if let Some(list) = per_model.get_mut(m.as_str()) {
                    list.push(*v);
                }
            }
        }
    }
    fleet.sort_unstable_by(f64::total_cmp);
    for list in per_model.values_mut() {
        list.sort_unstable_by(f64::total_cmp);
    }
    let without_self = |sorted: &[f64], own: Option<f64>| {
        let skip = own.and_then(|v| sorted.binary_search_by(|x| x.total_cmp(&v)).ok());
        median_without(sorted, skip)
    };
    (0..n)
        .map(|i| {
            let e = cfg.endpoints.get(i)?;
            let own = values.get(i).copied().flatten();
            match &e.models {
                None => without_self(&fleet, own),
                Some(ms) => ms
                    .iter()
                    .filter_map(|m| per_model.get(m.as_str()))
                    .filter_map(|list| without_self(list, own))
                    .reduce(f64::max),
            }
        })
        .collect()
}

/// What [`peer_medians`] reads of one endpoint's slowness: its value counts once it has
/// `min_samples` samples (and at least one), and is a function of `log_mean` alone; the bits,
/// so that equal inputs mean equal values (NaN included).
pub(crate) fn median_input(s: &Slowness, min_samples: u32) -> Option<u64> {
    (s.samples >= min_samples && s.samples > 0).then_some(s.log_mean.to_bits())
}

// `MedianMemo` is defined in `table` (the per-worker `TableCache` holds one; defining it here
// would make `table` and `signals` import each other); its medians are computed here.
impl MedianMemo {
    /// [`peer_medians`] of `table`, recomputed only when its inputs changed.
    pub fn medians(&mut self, table: &Table, cfg: &Config, min_samples: u32) -> &[Option<f64>] {
        self.medians_since(table, cfg, min_samples, None)
    }

    /// The medians last computed, shared (see [`MedianMemo::medians_since`]).
    pub fn shared(&self) -> Rc<Vec<Option<f64>>> {
        Rc::clone(&self.medians)
    }

    /// [`MedianMemo::medians`], comparing only the inputs of the entries in `changed` when
    /// given: the entries of `table` that may differ from the table the memo last saw through
    /// this call (the table cache's re-decoded entries; see `TableCache::lent_changes`). Every
    /// other entry is then the same as last time. Without it (or right after a call without
    /// it), every input is compared.
    pub fn medians_since(
        &mut self,
        table: &Table,
        cfg: &Config,
        min_samples: u32,
        changed: Option<&[usize]>,
    ) -> &[Option<f64>] {
        let n = cfg.endpoints.len();
        let same_input = |i: usize| match (
            self.inputs.get(i),
            cfg.endpoints.get(i),
            table.entries.get(i),
        ) {
            (Some((id, disabled, input)), Some(ep), Some((_, st))) => {
                *id == ep.id
                    && *disabled == ep.disabled
                    && *input == median_input(&st.slowness, min_samples)
            }
            _ => false,
        };
        let shape =
            self.min_samples == min_samples && self.inputs.len() == n && table.entries.len() == n;
        let same = shape
            && match changed.filter(|_| self.synced) {
                Some(changed) => changed.iter().all(|&i| same_input(i)),
                None => (0..n).all(same_input),
            };
        self.synced = changed.is_some();
        if !same {
            self.min_samples = min_samples;
            self.inputs = cfg
                .endpoints
                .iter()
                .enumerate()
                .map(|(i, ep)| {
                    let input = table
                        .entries
                        .get(i)
                        .and_then(|(_, st)| median_input(&st.slowness, min_samples));
                    (ep.id, ep.disabled, input)
                })
                .collect();
            // Entries missing from the table count as absent (as `peer_medians` reads them):
            // such a table is never taken as the same as a complete one (length check above).
            self.medians = Rc::new(peer_medians(table, cfg, min_samples));
            self.computed = self.computed.saturating_add(1);
        }
        self.medians.as_slice()
    }
}

// `QuietMemo` is defined in `table` (the per-worker `TableCache` holds one), as `MedianMemo`.
/// What a verdict of [`judge_with`] reads besides the endpoint's entry and its peers' median
/// (see [`QuietMemo`]): its scraped load, its slots, its peers' median pace, and the clock
/// only through whether the load is past the saturation rule's age.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Engine {
    pub(crate) load: Option<EngineLoad>,
    pub(crate) slots: Option<u32>,
    pub(crate) pace_reference: Option<f64>,
    pub(crate) now_ms: u64,
}

impl Engine {
    /// Whether the load is past the saturation rule's age at `now_ms` (judged `Unknown`).
    fn stale(&self) -> bool {
        self.load.is_some_and(|l| {
            self.now_ms.saturating_sub(l.scraped_ms) > saturation_rule(self.slots).max_age_ms
        })
    }

    /// The instant up to which [`Engine::stale`] stays false, if it is false now (`None`: no
    /// load, or stale now, which a later instant may not change back only if the clock never
    /// goes back: not assumed).
    pub(crate) fn fresh_until(&self) -> Option<u64> {
        let l = self.load?;
        (!self.stale()).then(|| {
            l.scraped_ms
                .saturating_add(saturation_rule(self.slots).max_age_ms)
        })
    }
}

impl QuietMemo {
    /// The kept values of endpoint `i` whose entry has `key` (`(stamp, id)`), judged against
    /// `reference` and `engine` (`None`: compute them).
    pub(crate) fn get(
        &mut self,
        i: usize,
        key: Option<&Option<(u64, u32)>>,
        reference: Option<f64>,
        engine: &Engine,
    ) -> Option<Quiet> {
        let q = self.at.get(i)?;
        let &(stamp, id) = key?.as_ref()?;
        let same_reference = match reference {
            Some(r) => q.has_reference && q.reference == r.to_bits(),
            None => !q.has_reference,
        };
        if !(q.valid && q.stamp == stamp && q.id == id && same_reference && q.load == engine.load) {
            return None;
        }
        // With a load: what else its verdict read (the slots, the pace's yardstick where it
        // has a pace, its age).
        if let Some(l) = engine.load {
            let pace = l
                .decode_us_per_token
                .and(engine.pace_reference)
                .map(f64::to_bits);
            if q.slots != engine.slots || q.pace_reference != pace || q.stale != engine.stale() {
                return None;
            }
        }
        let hit = *q;
        self.hits = self.hits.saturating_add(1);
        Some(hit)
    }

    /// Keeps endpoint `i`'s values (only call for a [`quiet`] endpoint, of `n`), judged on
    /// `engine`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn keep(
        &mut self,
        n: usize,
        i: usize,
        (stamp, id): (u64, u32),
        reference: Option<f64>,
        engine: &Engine,
        verdict: &Verdict,
        flip: bool,
        weight: f64,
    ) {
        if self.at.len() != n {
            self.at = vec![Quiet::default(); n];
        }
        if let Some(slot) = self.at.get_mut(i) {
            *slot = Quiet {
                valid: true,
                stamp,
                id,
                has_reference: reference.is_some(),
                reference: reference.map_or(0, f64::to_bits),
                sticky: verdict.sticky,
                flip,
                weight,
                load: engine.load,
                slots: engine.slots,
                pace_reference: engine
                    .load
                    .and_then(|l| l.decode_us_per_token)
                    .and(engine.pace_reference)
                    .map(f64::to_bits),
                stale: engine.stale(),
                saturation: verdict.saturation,
            };
        }
    }
}

/// Whether endpoint state `st` is quiet: its session weight (`placement::weigh`) cannot
/// change with the clock, and its verdict ([`judge_with`]) only as [`Engine`] says (see
/// [`QuietMemo`]). The success level fades toward 1 with idle time unless the endpoint is
/// cold (no level) or its rate is 1 (nothing to fade).
pub fn quiet(st: &EndpointState, cfg: &Config) -> bool {
    st.total < cfg.cold_start_samples || st.success_rate == 1.0
}

/// The median of `sorted` without its element at `skip` (if any), as [`slowness::peer_median`]
/// computes it: the middle one, or the mean of the two middle ones.
fn median_without(sorted: &[f64], skip: Option<usize>) -> Option<f64> {
    let len = sorted.len() - usize::from(skip.is_some() && !sorted.is_empty());
    let at = |k: usize| match skip {
        Some(s) if k >= s => sorted.get(k + 1).copied(),
        _ => sorted.get(k).copied(),
    };
    let upper = at(len / 2)?;
    if len.is_multiple_of(2) {
        Some((upper + at(len / 2 - 1).unwrap_or(upper)) / 2.0)
    } else {
        Some(upper)
    }
}

/// The work model's key for a request of `model`: its own for a model some endpoint lists,
/// one shared key otherwise.
pub fn work_key(cfg: &Config, model: Option<&str>) -> String {
    let listed = model.filter(|m| {
        cfg.endpoints.iter().any(|e| {
            e.models
                .as_ref()
                .is_some_and(|ms| ms.iter().any(|x| x == m))
        })
    });
    // Joined, not `format!`ted: the same string without the formatting machinery (a request
    // names its work key several times).
    [WORK_PREFIX, listed.unwrap_or("*")].concat()
}

/// The work model as stored (absent or undecodable: the prior).
pub fn read_model(store: &dyn Store, key: &str) -> WorkModel {
    store
        .get(key)
        .0
        .as_deref()
        .and_then(WorkModel::decode)
        .unwrap_or_default()
}

/// Folds `sample` into the stored work model (bounded CAS retries; a lost update is one
/// sample of hundreds), with the relayed bytes of its decode phase when counted. Returns
/// whether it was stored.
pub fn teach(store: &dyn Store, key: &str, sample: &Sample, decode_bytes: Option<u64>) -> bool {
    if sample.estimated {
        return true;
    }
    update(store, key, |bytes| {
        let mut m = bytes.and_then(WorkModel::decode).unwrap_or_default();
        m.observe(sample);
        if let Some(b) = decode_bytes {
            m.observe_decode_bytes(sample, b);
        }
        (m.encode(), ())
    })
    .is_ok()
}

/// What the filter saw of a successful answer, for the slowness model. Set on the ticket by the
/// holder before finishing (see `flow`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    /// Timed to its first byte (a relayed stream); otherwise timed to its end.
    pub streamed: bool,
    /// Time to first byte (streamed) or to the end of the answer, ms.
    pub observed_ms: u64,
    /// A stream's decode phase, from its first byte to its end, ms (`None` for a plain answer).
    pub decode_ms: Option<u64>,
    /// A stream's relayed bytes after its first chunk (`None` for a plain answer): with
    /// `usage`, what calibrates the pace of running streams (`slowness::WorkModel::pace_ratio`).
    pub decode_bytes: Option<u64>,
    /// The answer's `usage`, if it had one.
    pub usage: Option<Usage>,
    /// The request body's size (the prompt estimate without `usage`).
    pub body_bytes: u64,
    /// The answer's size (the completion estimate without `usage`).
    pub relayed_bytes: u64,
    /// The work model's key ([`work_key`] of the request's model).
    pub work_key: String,
}

impl Served {
    pub fn sample(&self) -> Sample {
        let observed_ms = self.observed_ms as f64;
        match &self.usage {
            Some(u) => Sample {
                streamed: self.streamed,
                observed_ms,
                prompt_tokens: u.prompt_tokens,
                cached_tokens: u.cached_tokens.min(u.prompt_tokens),
                completion_tokens: u.completion_tokens,
                estimated: false,
                decode_ms: self.decode_ms.map(|ms| ms as f64),
            },
            None => Sample::estimated(
                self.streamed,
                observed_ms,
                self.body_bytes,
                self.relayed_bytes,
            ),
        }
    }
}

/// Every configured endpoint's scraped load, if fresh (`None`: unknown — no metrics, never
/// scraped, failed or stale; hosted API keys have none), from every scraped endpoint's slot.
pub fn engine_loads(store: &dyn Store, cfg: &Config, now_ms: u64) -> Vec<Option<EngineLoad>> {
    let ids = crate::scheduler::routing::table::slot_ids(cfg);
    engine_loads_from(&scrape::read_loads(store, &ids), cfg, now_ms)
}

/// [`engine_loads`] from the published loads already read (a worker's
/// [`scrape::LoadsMemo`]).
pub fn engine_loads_from(
    loads: &scrape::Loads,
    cfg: &Config,
    now_ms: u64,
) -> Vec<Option<EngineLoad>> {
    engine_loads_until(loads, cfg, now_ms).0
}

/// [`engine_loads_from`], and until when it holds: the last instant at which every load it
/// knows is still fresh (a load unknown at `now_ms` stays unknown later: only a new record
/// makes it known). `u64::MAX` when it knows none.
pub fn engine_loads_until(
    loads: &scrape::Loads,
    cfg: &Config,
    now_ms: u64,
) -> (Vec<Option<EngineLoad>>, u64) {
    // Nothing scraped (no endpoint has metrics, or none answered yet): every load unknown,
    // as an empty list (read by index with `get`: `None` for every endpoint), not one `None`
    // per endpoint to build and scan.
    if loads.entries.is_empty() {
        return (Vec::new(), u64::MAX);
    }
    let mut until = u64::MAX;
    let list = cfg
        .endpoints
        .iter()
        .map(|ep| {
            let stale = ep
                .metrics
                .as_ref()
                .map_or(SCRAPE_STALE_MS, |m| m.stale_after_ms().min(SCRAPE_STALE_MS));
            // One lookup of the record (its state, scrape time and pace read from it): a
            // binary search per read cost about 950 instructions per endpoint at 512.
            let rec = loads.get(ep.id)?;
            match rec.state_at(now_ms, stale) {
                LoadState::Known(l) => {
                    until = until.min(rec.scraped_at_ms.saturating_add(stale));
                    Some(EngineLoad {
                        waiting: l.waiting,
                        running: l.running,
                        kv_usage_permille: l.kv_usage_permille,
                        scraped_ms: rec.scraped_at_ms,
                        // `pace_at`: the pace when the load is known.
                        decode_us_per_token: rec.pace.map(|p| p.us_per_token),
                        decoded_at_ms: rec.pace.map(|p| p.at_ms),
                    })
                }
                LoadState::Unknown(_) => None,
            }
        })
        .collect();
    (list, until)
}

/// The fresh loads by endpoint index and their peers' median pace ([`pace_medians`]), from
/// the worker's memos: the loads as its [`scrape::LoadsMemo`] holds them (it reads the change
/// ring and the slots written since its last read alone), derived again only when they
/// changed or one of them turned stale.
/// Equals `(engine_loads, pace_medians)` of the memo's loads at `now_ms`.
pub fn fresh_engines(
    cache: &mut TableCache,
    store: &dyn Store,
    cfg: &Config,
    now_ms: u64,
) -> Fresh {
    let loads = cache.published_loads(store, cfg);
    let version = cache.loads.version;
    let m = &mut cache.engines;
    let holds = m.version == Some(version) && now_ms >= m.derived_ms && now_ms <= m.valid_until_ms;
    if !holds {
        let (list, until) = engine_loads_until(&loads, cfg, now_ms);
        m.pace = Rc::new(pace_medians(cfg, &list));
        m.loads = Rc::new(list);
        m.version = Some(version);
        m.derived_ms = now_ms;
        m.valid_until_ms = until;
    }
    Fresh {
        loads: Rc::clone(&m.loads),
        pace: Rc::clone(&m.pace),
    }
}

/// What [`fresh_engines`] hands a decision: by endpoint index, the fresh loads and their
/// peers' median pace (shared with the worker's memo).
pub struct Fresh {
    pub loads: Rc<Vec<Option<EngineLoad>>>,
    pub pace: Rc<Vec<Option<f64>>>,
}

/// The load bounded-load placement weighs: the engine's running + waiting, quantized so that
/// replicas agree, where scraped; else this replica's in-flight count.
pub fn placement_load(
    st: &EndpointState,
    load: Option<&EngineLoad>,
    now_ms: u64,
    max_age_ms: u64,
) -> u32 {
    let scraped = load.and_then(|l| {
        scrape::quantize(&crate::scheduler::wire::engine_load::EngineLoad {
            engine: crate::scheduler::wire::engine_load::Engine::Vllm,
            waiting: l.waiting,
            running: l.running,
            kv_usage_permille: l.kv_usage_permille,
            prompt_tokens_total: None,
            prompt_tokens_cached_total: None,
            decode: None,
        })
        .requests_floor()
    });
    scraped.unwrap_or_else(|| st.load(now_ms, max_age_ms))
}

/// One endpoint's verdicts for a decision (kept in the table cache's memos, so defined beside
/// them).
pub use crate::scheduler::routing::table::Verdict;

/// The verdict of endpoint `i` (see the module doc).
pub fn judge(
    table: &Table,
    cfg: &Config,
    i: usize,
    load: Option<EngineLoad>,
    now_ms: u64,
) -> Verdict {
    let rule = DegradeRule::from_config(cfg);
    let reference = peer_median(table, cfg, i, rule.min_samples);
    judge_with(table, cfg, i, reference, None, load, None, now_ms)
}

/// The saturation rule of an engine with `slots` (known once it was seen queueing, see
/// `capacity`): [`SaturationRule::default`]'s, entered at a queue of `slots / 4 + 1` where
/// that is fewer than 5 and then left only with an empty queue.
///
/// Why: the saturation verdict is the fullness every replica reads alike (the engine's
/// scrape, with hysteresis), the one a later turn without a pin passes over. A 4-slot engine
/// with 5 waiting holds more than a batch in its queue; entered at 2 and left at 0, its
/// verdict stays put across the answers that make "a free slot" come and go.
pub fn saturation_rule(slots: Option<u32>) -> SaturationRule {
    let base = SaturationRule {
        max_age_ms: SCRAPE_STALE_MS,
        ..SaturationRule::default()
    };
    match slots {
        Some(s) if s > 0 && s / 4 + 1 < base.enter_waiting => SaturationRule {
            enter_waiting: s / 4 + 1,
            exit_waiting: 0,
            ..base
        },
        _ => base,
    }
}

/// [`judge`] with the peers' medians already known: their slowness ([`peer_medians`]) and
/// their engines' pace ([`pace_medians`]). Where the endpoint's engine and at least one peer's
/// publish a decode pace, the degraded rule judges the pace ([`slowness::pace_degraded`]);
/// otherwise the slowness learned from this process's own answers.
#[allow(clippy::too_many_arguments)]
pub fn judge_with(
    table: &Table,
    cfg: &Config,
    i: usize,
    reference: Option<f64>,
    pace_reference: Option<f64>,
    load: Option<EngineLoad>,
    slots: Option<u32>,
    now_ms: u64,
) -> Verdict {
    let Some((_, st)) = table.entries.get(i) else {
        return Verdict::default();
    };
    let rule = DegradeRule::from_config(cfg);
    let own = Slowness {
        degraded: st.degraded,
        ..st.slowness
    };
    let pace = load.and_then(|l| l.decode_us_per_token);
    let sticky = match (pace, pace_reference) {
        (Some(mine), Some(peers)) => {
            slowness::pace_degraded(f64::from(mine), peers, st.degraded, &rule)
        }
        _ => slowness::degraded(&own, reference, &rule),
    };
    let saturation = saturation::judge(
        st.saturation,
        load.as_ref(),
        &saturation_rule(slots),
        now_ms,
    );
    Verdict {
        sticky,
        degraded: sticky,
        saturation,
        load,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::state::store::MemStore;
    use serde_json::json;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn cfg() -> Config {
        Config::from_value(&json!({"endpoints":[
            {"name":"a","cluster":"a","models":["m1"]},
            {"name":"b","cluster":"b","models":["m1","m2"]},
            {"name":"c","cluster":"c","models":["m2"]},
            {"name":"d","cluster":"d"},
            {"name":"e","cluster":"e","models":["m1"],"disabled":true}
        ]}))
        .unwrap()
    }

    /// The per-model medians against a brute force over `peers` per model.
    #[test]
    fn peer_medians_match_a_brute_force_per_model() {
        let c = Config::from_json(
            br#"{"endpoints":[
                {"name":"a","cluster":"a","models":["m1"]},{"name":"b","cluster":"b","models":["m1","m2"]},
                {"name":"c","cluster":"c","models":["m1"]},{"name":"d","cluster":"d","models":["m1"]},
                {"name":"e","cluster":"e","models":["m2"]},{"name":"f","cluster":"f"},
                {"name":"g","cluster":"g","models":["m2"],"disabled":true}]}"#,
        )
        .unwrap_or_default();
        assert_eq!(c.endpoints.len(), 7);
        let mut t = Table::load(None, &c).0;
        for (k, (_, st)) in t.entries.iter_mut().enumerate() {
            // d is cold; the others warm with distinct and equal values.
            st.slowness.samples = if k == 3 { 2 } else { 40 };
            st.slowness.log_mean = [0.0, 0.4, 0.0, 1.0, 0.2, 0.9, 0.3][k];
        }
        let fast = peer_medians(&t, &c, 20);
        let warm = |j: usize| {
            let st = &t.entries[j].1;
            (st.slowness.samples >= 20 && !c.endpoints[j].disabled)
                .then(|| st.slowness.value())
                .flatten()
        };
        let median = |mut v: Vec<f64>| {
            v.sort_unstable_by(f64::total_cmp);
            let n = v.len();
            (n > 0).then(|| {
                if n.is_multiple_of(2) {
                    (v[n / 2] + v[n / 2 - 1]) / 2.0
                } else {
                    v[n / 2]
                }
            })
        };
        #[allow(clippy::needless_range_loop)]
        for i in 0..7 {
            let serves = |j: usize, m: &str| {
                c.endpoints[j]
                    .models
                    .as_ref()
                    .is_none_or(|ms| ms.iter().any(|x| x == m))
            };
            let expected = match &c.endpoints[i].models {
                None => median((0..7).filter(|&j| j != i).filter_map(warm).collect()),
                Some(ms) => ms
                    .iter()
                    .filter_map(|m| {
                        median(
                            (0..7)
                                .filter(|&j| j != i && serves(j, m))
                                .filter_map(warm)
                                .collect(),
                        )
                    })
                    .reduce(f64::max),
            };
            match (fast[i], expected) {
                (Some(x), Some(y)) => assert!((x - y).abs() < 1e-12, "{i}: {x} vs {y}"),
                (a, b) => assert_eq!(a, b, "{i}"),
            }
        }
        // a (m1): peers b, c, f warm (d cold) -> e^0.4, 1, e^0.9 -> median 1.49
        assert!((fast[0].unwrap_or(0.0) - 0.4f64.exp()).abs() < 1e-9);
    }

    /// The memo returns what `peer_medians` returns, recomputing only when an input moved.
    #[test]
    fn median_memo_equals_a_fresh_computation() {
        let c = cfg();
        let mut t = Table::load(None, &c).0;
        let mut memo = MedianMemo::default();
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for step in 0..200u32 {
            state = crate::scheduler::state::hash::fmix64(state.wrapping_add(u64::from(step)));
            let k = (state % 5) as usize;
            if state.is_multiple_of(3) {
                let st = &mut t.entries[k].1.slowness;
                st.samples = ((state >> 8) % 30) as u32;
                st.log_mean = ((state >> 16) % 100) as f64 / 50.0 - 1.0;
            }
            let before = memo.computed;
            let fresh = peer_medians(&t, &c, 20);
            assert_eq!(memo.medians(&t, &c, 20), fresh.as_slice(), "step {step}");
            let again = memo.computed;
            assert_eq!(memo.medians(&t, &c, 20), fresh.as_slice());
            assert_eq!(memo.computed, again, "unchanged inputs reuse the medians");
            assert!(memo.computed <= before + 1);
        }
        // What the medians do not read (a cold endpoint's value, the other fields of any
        // slowness) changes nothing: no recomputation.
        let n = memo.computed;
        for k in 0..5 {
            let st = &mut t.entries[k].1.slowness;
            st.expected_ms += 7.0;
            st.last_sample_ms += 1;
            if st.samples < 20 {
                st.log_mean += 0.25;
            }
        }
        assert_eq!(
            memo.medians(&t, &c, 20),
            peer_medians(&t, &c, 20).as_slice()
        );
        assert_eq!(memo.computed, n);
        // Another threshold is another computation.
        let n = memo.computed;
        assert_eq!(memo.medians(&t, &c, 3), peer_medians(&t, &c, 3).as_slice());
        assert_eq!(memo.computed, n + 1);
    }

    /// A scraped endpoint's kept verdict is served while the load, its slots, its pace's
    /// yardstick and its age side of the saturation rule stay the same, and no longer.
    #[test]
    fn quiet_memo_keys_a_scraped_verdict_by_everything_it_read() {
        let load = EngineLoad {
            waiting: Some(6),
            running: Some(3),
            kv_usage_permille: Some(500),
            scraped_ms: 1_000,
            decode_us_per_token: Some(40),
            decoded_at_ms: Some(900),
        };
        let engine = Engine {
            load: Some(load),
            slots: Some(8),
            pace_reference: Some(30.0),
            now_ms: 1_000,
        };
        let mut memo = QuietMemo::default();
        let v = Verdict {
            saturation: saturation::Saturation::Saturated,
            load: Some(load),
            ..Verdict::default()
        };
        memo.keep(2, 1, (7, 9), None, &engine, &v, false, 1.0);
        let key = Some((7u64, 9u32));
        let age = saturation_rule(Some(8)).max_age_ms;
        let get = |m: &mut QuietMemo, e: Engine| m.get(1, Some(&key), None, &e).is_some();
        assert!(get(&mut memo, engine));
        let last = Engine {
            now_ms: 1_000 + age,
            ..engine
        };
        assert!(get(&mut memo, last), "fresh up to the rule's age");
        assert_eq!(engine.fresh_until(), Some(1_000 + age));
        let past = Engine {
            now_ms: 1_000 + age + 1,
            ..engine
        };
        assert!(!get(&mut memo, past), "past it, judged again");
        for other in [
            Engine {
                load: Some(EngineLoad {
                    scraped_ms: 1_001,
                    ..load
                }),
                ..engine
            },
            Engine {
                load: Some(EngineLoad {
                    waiting: Some(5),
                    ..load
                }),
                ..engine
            },
            Engine {
                load: None,
                ..engine
            },
            Engine {
                slots: Some(4),
                ..engine
            },
            Engine {
                pace_reference: Some(31.0),
                ..engine
            },
        ] {
            assert!(!get(&mut memo, other), "{other:?}");
        }
        // Without a pace of its own, the pace's yardstick is not read.
        let unpaced = Engine {
            load: Some(EngineLoad {
                decode_us_per_token: None,
                ..load
            }),
            ..engine
        };
        memo.keep(2, 1, (7, 9), None, &unpaced, &v, false, 1.0);
        assert!(get(
            &mut memo,
            Engine {
                pace_reference: None,
                ..unpaced
            }
        ));
    }

    #[test]
    fn peers_share_a_configured_model() {
        let c = cfg();
        let p = |i| peers(&c, i).collect::<Vec<_>>();
        assert_eq!(p(0), vec![1, 3]);
        assert_eq!(p(1), vec![0, 2, 3]);
        assert_eq!(p(2), vec![1, 3]);
        assert_eq!(p(3), vec![0, 1, 2]);
    }

    #[test]
    fn work_keys_are_bounded_by_the_configuration() {
        let c = cfg();
        assert_eq!(work_key(&c, Some("m2")), "computeflux/work/m2");
        assert_eq!(work_key(&c, Some("other")), "computeflux/work/*");
        assert_eq!(work_key(&c, None), "computeflux/work/*");
    }

    #[test]
    fn served_samples_use_usage_else_estimates() {
        let mut s = Served {
            streamed: true,
            decode_ms: None,
            decode_bytes: None,
            observed_ms: 120,
            usage: Some(Usage {
                prompt_tokens: 1000,
                cached_tokens: 800,
                completion_tokens: 50,
            }),
            body_bytes: 9999,
            relayed_bytes: 9999,
            work_key: String::new(),
        };
        let x = s.sample();
        assert_eq!(
            (x.uncached(), x.estimated, x.observed_ms),
            (200, false, 120.0)
        );
        s.usage = None;
        let y = s.sample();
        assert_eq!(
            (y.prompt_tokens, y.completion_tokens, y.estimated),
            (2499, 2499, true)
        );
    }

    #[test]
    fn teach_skips_estimates_and_stores_measured() {
        let store = MemStore::new();
        let s = Sample::estimated(true, 100.0, 400, 400);
        assert!(teach(&store, "k", &s, None));
        assert_eq!(read_model(&store, "k").samples, 0);
        let m = Sample {
            estimated: false,
            ..s
        };
        assert!(teach(&store, "k", &m, None));
        assert_eq!(read_model(&store, "k").samples, 1);
    }

    #[test]
    fn engine_loads_reads_fresh_records_only() {
        let c = cfg();
        let store = MemStore::new();
        let load = crate::scheduler::wire::engine_load::EngineLoad {
            engine: crate::scheduler::wire::engine_load::Engine::Vllm,
            waiting: Some(6),
            running: Some(3),
            kv_usage_permille: Some(500),
            prompt_tokens_total: None,
            prompt_tokens_cached_total: None,
            decode: None,
        };
        let ids: Vec<u32> = c.endpoints.iter().map(|e| e.id).collect();
        scrape::fold(&store, c.endpoints[1].id, 1_000, Ok(load), &ids).unwrap();
        let l = engine_loads(&store, &c, 2_000);
        assert_eq!(l[0], None);
        assert_eq!(
            l[1],
            Some(EngineLoad {
                waiting: Some(6),
                running: Some(3),
                kv_usage_permille: Some(500),
                scraped_ms: 1_000,
                decode_us_per_token: None,
                decoded_at_ms: None,
            })
        );
        assert_eq!(
            engine_loads(&store, &c, 1_000 + SCRAPE_STALE_MS + 1)[1],
            None
        );
        // Bounded load: 6 → bucket floor 4, 3 → 2.
        let st = EndpointState {
            in_flight: 40,
            in_flight_changed_ms: 2_000,
            ..EndpointState::default()
        };
        assert_eq!(placement_load(&st, l[1].as_ref(), 2_000, 600_000), 6);
        assert_eq!(placement_load(&st, None, 2_000, 600_000), 40);
    }
}
