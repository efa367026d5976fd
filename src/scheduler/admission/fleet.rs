//! Whether the fleet serving a model is full: the room admission counts on.
//!
//! Why these signals: the filter already judges every scraped engine (`routing::judge::saturation`,
//! with its hysteresis) and learns its slots (`routing::select::capacity`); admission reads the same
//! verdicts rather than a second detector. An endpoint whose saturation is `Saturated` (scraped
//! queue ≥ 5 or KV ≥ 90 %) is **full**; the others' slots are this Envoy's to fill as far as its
//! [`share`] of them goes: with one Envoy, its slots less its own in-flight attempts (exact
//! and immediate for this process, where the scrape is up to an interval old); with several
//! replicas, what their scrapes show the others hold is left to them. So the waiting happens in
//! the filter's fair queue, not in the engine's first-come-first-served one. An endpoint whose
//! load is unknown (not scraped, a stale or failed scrape) or whose slots were never seen is
//! never full by assumption — as everywhere in the filter — so the model's room is then
//! unbounded and nothing waits.
//!
//! **A burst while nobody waits** ([`Free::burst`]): a request arriving while nobody waits for
//! its model goes on while the engines hold fewer than their slots plus [`BURST`] each (the
//! queue starts only once the engines would queue more than one each). Nobody is passed over
//! then, and the engine's queue of at most one holds it about as long as the filter would
//! (until a slot frees) without the pause, the admission round and the resumption; so a fleet
//! without overload holds nothing even when its slots happen to be full at an arrival (the
//! `noisy_neighbor` steady phase, 57 % busy: 3 of 131 requests waited without it). Requests
//! admitted from the queue count the slots alone.

use crate::scheduler::admission::queue::Room;
use crate::scheduler::admission::share::{self, Engine};
use crate::scheduler::routing::judge::saturation::{judge, Saturation, SaturationRule};
use crate::scheduler::routing::select::capacity::slots_seen;
use crate::scheduler::routing::select::Scheduler;
use crate::scheduler::state::hash::hash_parts;

const MODEL_SEED: u64 = 0x6164_6d69_7373_696f; // "admissio"

/// How many requests beyond its slots an endpoint may take for an arrival while nobody waits.
pub const BURST: u32 = 1;

/// The free slots of an endpoint, or of a model's endpoints summed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Free {
    /// For requests admitted from the queue: below the slots.
    pub slots: u32,
    /// For an arrival while nobody waits: below the slots plus [`BURST`].
    pub burst: u32,
}

/// The queue's name for a model.
pub fn model_key(model: Option<&str>) -> u64 {
    hash_parts(MODEL_SEED, &[model.unwrap_or("").as_bytes()])
}

/// How admission counts one endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Judged {
    /// Its load or its slots are unknown: the model's room is unbounded.
    Unbounded,
    /// `Saturated`: no room, and nothing counted.
    Full,
    /// Counted in the model's [`share`].
    Counted(Engine),
}

/// One endpoint for admission. `own`: this Envoy's attempts in flight on it now;
/// `own_at_scrape`: at the scrape `load` is from, when recorded (else `own` stands for it).
pub fn judge_endpoint(
    was: Saturation,
    own: u32,
    own_at_scrape: Option<u32>,
    load: Option<&crate::scheduler::routing::judge::saturation::EngineLoad>,
    slots_before: u32,
    now_ms: u64,
) -> Judged {
    let Some(load) = load else {
        return Judged::Unbounded;
    };
    // The load is fresh (stale ones are never handed here): judged without an age bound.
    let rule = SaturationRule {
        max_age_ms: u64::MAX,
        ..SaturationRule::default()
    };
    match judge(was, Some(load), &rule, now_ms) {
        Saturation::Saturated => Judged::Full,
        Saturation::Unknown => Judged::Unbounded,
        Saturation::Room => {
            let slots = slots_seen(slots_before, load);
            let scraped = load
                .running
                .map(|r| r.saturating_add(load.waiting.unwrap_or(0)));
            match scraped {
                Some(scraped) if slots > 0 => Judged::Counted(Engine {
                    slots,
                    scraped,
                    own_at_scrape: own_at_scrape.unwrap_or(own),
                    own,
                }),
                _ => Judged::Unbounded,
            }
        }
    }
}

/// The model's free places from its endpoints judged: `None` when one is unbounded.
pub fn free(judged: &[Judged]) -> Option<Free> {
    let mut engines: Vec<Engine> = Vec::with_capacity(judged.len());
    for j in judged {
        match j {
            Judged::Unbounded => return None,
            Judged::Full => {}
            Judged::Counted(e) => engines.push(*e),
        }
    }
    Some(Free {
        slots: share::free(&engines, 0),
        burst: share::free(&engines, BURST),
    })
}

/// The free places on the endpoints serving `model` (enabled ones), `None` when any of them is
/// not known to be bounded, or none serves it (the pick answers that).
pub fn room(s: &Scheduler<'_>, model: Option<&str>, now_ms: u64) -> Option<Free> {
    let judged: Vec<Judged> = judged(s, model, now_ms)?
        .into_iter()
        .map(|(_, j)| j)
        .collect();
    free(&judged)
}

/// Whether an arrival for `model` may go while nobody waits at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArrivalRoom {
    /// Some endpoint serving it is not known to be bounded (or none serves it).
    Unbounded,
    /// Bounded, with a burst place free.
    Fits,
    /// Bounded: the model's free burst places (none, or `room` said so exactly).
    Room(u32),
}

/// [`room`]'s burst places for an arrival while nobody waits: its endpoints are judged in turn
/// only until one burst place is found, so an arrival costs one endpoint's judgement while the
/// fleet has room, and the whole model's only when it is full (when it then waits).
pub fn arrival(s: &Scheduler<'_>, model: Option<&str>, now_ms: u64) -> ArrivalRoom {
    match scan(s, model, now_ms, Some(1)) {
        Scan::Unbounded => ArrivalRoom::Unbounded,
        Scan::Enough => ArrivalRoom::Fits,
        Scan::All(judged) => {
            let judged: Vec<Judged> = judged.into_iter().map(|(_, j)| j).collect();
            match free(&judged) {
                Some(f) => ArrivalRoom::Room(f.burst),
                None => ArrivalRoom::Unbounded,
            }
        }
    }
}

/// The endpoints serving `model` (enabled ones, by index) as admission judges them, `None`
/// when any of them is not known to be bounded, or none serves it (the pick answers that).
fn judged(s: &Scheduler<'_>, model: Option<&str>, now_ms: u64) -> Option<Vec<(usize, Judged)>> {
    match scan(s, model, now_ms, None) {
        Scan::All(judged) => Some(judged),
        Scan::Unbounded | Scan::Enough => None,
    }
}

enum Scan {
    Unbounded,
    /// The burst places asked for were found before every endpoint was judged.
    Enough,
    All(Vec<(usize, Judged)>),
}

/// The model's endpoints judged in turn (on the worker's table, lent without a copy), until
/// one is unbounded or, when `enough` is given, until that many burst places are found.
fn scan(s: &Scheduler<'_>, model: Option<&str>, now_ms: u64, enough: Option<u32>) -> Scan {
    let statics = s.statics(model);
    if statics.indexes.is_empty() {
        return Scan::Unbounded;
    }
    let engines = s.engines(now_ms);
    if engines.loads.is_empty() {
        return Scan::Unbounded;
    }
    let record = share::View::read(s.store);
    let max_age = s.cfg.in_flight_max_age_ms;
    s.with_table(|table, _| {
        let mut judged: Vec<(usize, Judged)> = Vec::with_capacity(statics.indexes.len());
        let mut burst = 0.0;
        for &i in &statics.indexes {
            let (Some(ep), Some((_, st))) = (s.cfg.endpoints.get(i), table.entries.get(i)) else {
                return Scan::Unbounded;
            };
            let load = engines.loads.get(i).copied().flatten();
            let j = judge_endpoint(
                st.saturation,
                st.load(now_ms, max_age),
                load.and_then(|l| record.own_at(ep.id, l.scraped_ms)),
                load.as_ref(),
                engines.seen.get(ep.id).slots,
                now_ms,
            );
            match (j, enough) {
                (Judged::Unbounded, _) => return Scan::Unbounded,
                (Judged::Counted(e), Some(need)) => {
                    // The model's places are at least the sum so far (every term is ≥ 0 and
                    // the floor only adds).
                    burst += (share::allowance(&e) + f64::from(BURST) - f64::from(e.own)).max(0.0);
                    if burst + 1e-9 >= f64::from(need) {
                        return Scan::Enough;
                    }
                }
                _ => {}
            }
            judged.push((i, j));
        }
        Scan::All(judged)
    })
}

/// The endpoints (indexes) a request admitted from the queue is not placed on while another
/// has a place ([`share::places`]): the full ones and those without a free place. Empty when
/// the model's room is unbounded.
pub fn without_place(judged: &[(usize, Judged)]) -> Vec<usize> {
    let counted: Vec<(usize, Engine)> = judged
        .iter()
        .filter_map(|&(i, j)| match j {
            Judged::Counted(e) => Some((i, e)),
            _ => None,
        })
        .collect();
    if judged.iter().any(|(_, j)| *j == Judged::Unbounded) {
        return Vec::new();
    }
    let engines: Vec<Engine> = counted.iter().map(|&(_, e)| e).collect();
    let has = share::places(&engines);
    let mut out: Vec<usize> = judged
        .iter()
        .filter(|(_, j)| *j == Judged::Full)
        .map(|&(i, _)| i)
        .collect();
    out.extend(
        counted
            .iter()
            .zip(&has)
            .filter(|(_, &h)| !h)
            .map(|(&(i, _), _)| i),
    );
    out.sort_unstable();
    out
}

/// [`without_place`] for `model`'s endpoints now (empty when its room is unbounded).
pub fn placeless(s: &Scheduler<'_>, model: Option<&str>, now_ms: u64) -> Vec<usize> {
    judged(s, model, now_ms).map_or_else(Vec::new, |j| without_place(&j))
}

/// The model whose [`model_key`] is `key`, as [`room`] and [`judged`] take it: found among
/// the configured models, else a model only the endpoints serving any model serve.
fn model_of_key<'c>(s: &Scheduler<'c>, key: u64) -> Option<&'c str> {
    let named = s
        .cfg
        .endpoints
        .iter()
        .filter_map(|e| e.models.as_ref())
        .flatten()
        .find(|m| model_key(Some(m)) == key);
    match named {
        Some(m) => Some(m.as_str()),
        None if key == model_key(None) => None,
        // A model no endpoint lists by name: the wildcard endpoints'.
        None => Some("\u{0}"),
    }
}

/// The queue's room (the slots, [`Free::slots`]) for the model whose [`model_key`] is `key`.
pub fn room_by_key(s: &Scheduler<'_>, key: u64, now_ms: u64) -> Room {
    room(s, model_of_key(s, key), now_ms).map(|f| f.slots)
}

/// Whether this Envoy shares the engines it counts with others: their last scrapes showed at
/// least [`OTHERS_SHARING`] requests in all that were not this Envoy's (other replicas', other
/// clients'). One Envoy alone sees at most a request or so that ended between the engine's
/// answer and the record of its own count.
pub fn shared(judged: &[Judged]) -> bool {
    let others: u32 = judged
        .iter()
        .map(|j| match j {
            Judged::Counted(e) => e.scraped - e.own_at_scrape.min(e.scraped),
            _ => 0,
        })
        .fold(0, u32::saturating_add);
    others >= OTHERS_SHARING
}

/// The others' requests on a model's engines at their scrapes from which [`shared`] says so.
pub const OTHERS_SHARING: u32 = 2;

/// [`shared`] for the model whose [`model_key`] is `key` (false when its room is unbounded).
pub fn shared_by_key(s: &Scheduler<'_>, key: u64, now_ms: u64) -> bool {
    judged(s, model_of_key(s, key), now_ms).is_some_and(|j| {
        let j: Vec<Judged> = j.into_iter().map(|(_, j)| j).collect();
        shared(&j)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::routing::judge::saturation::EngineLoad;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn load(waiting: u32, running: u32) -> EngineLoad {
        EngineLoad {
            waiting: Some(waiting),
            running: Some(running),
            kv_usage_permille: Some(100),
            scraped_ms: 1_000,
            decode_us_per_token: None,
            decoded_at_ms: None,
        }
    }

    fn counted(slots: u32, scraped: u32, own_at_scrape: u32, own: u32) -> Judged {
        Judged::Counted(Engine {
            slots,
            scraped,
            own_at_scrape,
            own,
        })
    }

    #[test]
    fn endpoints_are_counted_unless_saturated_or_unknown() {
        use Saturation::*;
        // Unknown load: unbounded.
        assert_eq!(
            judge_endpoint(Room, 5, None, None, 4, 1_000),
            Judged::Unbounded
        );
        // Slots never seen (never queued): unbounded.
        assert_eq!(
            judge_endpoint(Room, 5, None, Some(&load(0, 3)), 0, 1_000),
            Judged::Unbounded
        );
        // Slots known: counted, with this Envoy's attempts at the scrape when recorded, else
        // its attempts now.
        assert_eq!(
            judge_endpoint(Room, 1, Some(2), Some(&load(0, 3)), 4, 1_000),
            counted(4, 3, 2, 1)
        );
        assert_eq!(
            judge_endpoint(Room, 1, None, Some(&load(0, 3)), 4, 1_000),
            counted(4, 3, 1, 1)
        );
        // A queue seen now teaches the slots (running while queueing).
        assert_eq!(
            judge_endpoint(Room, 0, None, Some(&load(2, 2)), 0, 1_000),
            counted(2, 4, 0, 0)
        );
        // Saturated by the scrape: full whatever the counts.
        assert_eq!(
            judge_endpoint(Room, 0, None, Some(&load(5, 2)), 2, 1_000),
            Judged::Full
        );
        // Hysteresis: a saturated engine with 2 waiting stays full.
        assert_eq!(
            judge_endpoint(Saturated, 0, None, Some(&load(2, 2)), 2, 1_000),
            Judged::Full
        );
        assert_eq!(
            judge_endpoint(Saturated, 0, None, Some(&load(1, 2)), 2, 1_000),
            counted(2, 3, 0, 0)
        );
    }

    #[test]
    fn the_models_room_is_its_share_of_the_counted_engines() {
        let room = |slots, burst| Some(Free { slots, burst });
        // One Envoy, two 2-slot engines, 3 of its requests running: one free, two in a burst.
        assert_eq!(
            free(&[counted(2, 2, 2, 2), counted(2, 1, 1, 1)]),
            room(1, 3)
        );
        // A saturated one adds nothing; an unbounded one makes the room unbounded.
        assert_eq!(free(&[counted(2, 2, 2, 2), Judged::Full]), room(0, 1));
        assert_eq!(free(&[counted(2, 2, 2, 2), Judged::Unbounded]), None);
        // Another replica holds both slots of one engine: this Envoy has the other's.
        assert_eq!(
            free(&[counted(2, 2, 0, 0), counted(2, 1, 1, 1)]),
            room(1, 3)
        );
        // Nothing counted (all saturated): no room.
        assert_eq!(free(&[Judged::Full]), room(0, 0));
    }

    #[test]
    fn engines_are_shared_when_a_scrape_showed_load_not_this_envoys() {
        // One Envoy: everything scraped is its own (an answer it still streams counted
        // here, not by the engine, is no one else's), but for one that ended between the
        // engine's answer and the record of its count.
        let one = [counted(2, 2, 2, 1), counted(2, 1, 2, 2), Judged::Full];
        assert!(!shared(&one));
        assert!(!shared(&[counted(2, 2, 1, 1), counted(2, 2, 2, 2)]));
        // Other replicas held two at the scrapes.
        assert!(shared(&[counted(2, 2, 1, 1), counted(2, 2, 1, 1)]));
        assert!(shared(&[counted(2, 2, 0, 0), counted(2, 2, 2, 2)]));
        assert!(!shared(&[Judged::Full, Judged::Unbounded]));
    }

    #[test]
    fn an_admitted_request_is_kept_off_engines_without_a_place() {
        // Endpoint 3 saturated, 5 at its slots, 7 with a free slot: 3 and 5 are passed over.
        let judged = [
            (3, Judged::Full),
            (5, counted(2, 2, 2, 2)),
            (7, counted(2, 2, 2, 1)),
        ];
        assert_eq!(without_place(&judged), vec![3, 5]);
        // Every counted one at its slots (the floor let it in): only the saturated one.
        assert_eq!(
            without_place(&[(7, counted(2, 2, 2, 2)), (3, Judged::Full)]),
            vec![3]
        );
        // Unbounded room: nothing is steered.
        assert!(without_place(&[(3, Judged::Full), (5, Judged::Unbounded)]).is_empty());
    }
}
