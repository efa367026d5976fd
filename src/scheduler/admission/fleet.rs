//! Whether the fleet serving a model is full: the room admission counts on.
//!
//! Why these signals: the filter already judges every scraped engine (`routing::judge::saturation`,
//! with its hysteresis) and learns its slots (`routing::select::capacity`); admission reads the same
//! verdicts rather than a second detector. An endpoint is **full** when its saturation is
//! `Saturated` (scraped queue ≥ 5 or KV ≥ 90 %), else it has `slots − others − own` free slots:
//! `own`, this Envoy's in-flight attempts on it (exact and immediate for this process, where
//! the scrape is up to an interval old); `others`, the requests its last scrapes showed beyond
//! this Envoy's own (other replicas' and other clients', [`super::others`]). So the waiting
//! happens in the filter's fair queue, not in the engine's first-come-first-served one, with
//! one Envoy as with several. An endpoint whose load is unknown (not scraped, a stale or failed
//! scrape) or whose slots were never seen is never full by assumption — as everywhere in the
//! filter — so the model's room is then unbounded and nothing waits.
//!
//! **A burst while nobody waits** ([`Free::burst`]): a request arriving while nobody waits for
//! its model goes on as long as some endpoint has fewer than `slots + BURST` requests (the
//! queue starts only once the engines would queue more than one each). Nobody is passed over
//! then, and the engine's queue of at most one holds it about as long as the filter would
//! (until a slot frees) without the pause, the admission round and the resumption; so a fleet
//! without overload holds nothing even when its slots happen to be full at an arrival (the
//! `noisy_neighbor` steady phase, 57 % busy: 3 of 131 requests waited without it). Requests
//! admitted from the queue count the slots alone.

use crate::scheduler::admission::others;
use crate::scheduler::admission::queue::Room;
use crate::scheduler::routing::judge::saturation::{judge, Saturation, SaturationRule};
use crate::scheduler::routing::select::capacity::{slots_seen, Engines};
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

/// An endpoint's free slots for admission: `None` when not known to be bounded. `own`: this
/// Envoy's attempts in flight on it now; `others`: the requests its scrapes showed beyond this
/// Envoy's ([`others::Sighting::held`]).
pub fn endpoint_room(
    was: Saturation,
    own: u32,
    others: u32,
    load: Option<&crate::scheduler::routing::judge::saturation::EngineLoad>,
    slots_before: u32,
    now_ms: u64,
) -> Option<Free> {
    let load = load?;
    // The load is fresh (stale ones are never handed here): judged without an age bound.
    let rule = SaturationRule {
        max_age_ms: u64::MAX,
        ..SaturationRule::default()
    };
    match judge(was, Some(load), &rule, now_ms) {
        Saturation::Saturated => Some(Free::default()),
        Saturation::Unknown => None,
        Saturation::Room => {
            let slots = slots_seen(slots_before, load);
            let taken = own.saturating_add(others);
            (slots > 0).then(|| Free {
                slots: slots.saturating_sub(taken),
                burst: slots.saturating_add(BURST).saturating_sub(taken),
            })
        }
    }
}

/// The free slots of the endpoints serving `model` (enabled ones), `None` when any of them is
/// not known to be bounded, or none serves it (the pick answers that).
pub fn room(s: &Scheduler<'_>, model: Option<&str>, now_ms: u64) -> Option<Free> {
    let statics = s.statics(model);
    if statics.indexes.is_empty() {
        return None;
    }
    let engines = Engines::read(s.store, s.cfg, now_ms);
    if engines.loads.is_empty() {
        return None;
    }
    let table = s.table();
    let others = others::read(s.store);
    let max_age = s.cfg.in_flight_max_age_ms;
    let mut free = Free::default();
    for &i in &statics.indexes {
        let (Some(ep), Some((_, st))) = (s.cfg.endpoints.get(i), table.entries.get(i)) else {
            return None;
        };
        let load = engines.loads.get(i).copied().flatten();
        let slots = engines.seen.get(ep.id).slots;
        let r = endpoint_room(
            st.saturation,
            st.load(now_ms, max_age),
            others.get(ep.id).held(),
            load.as_ref(),
            slots,
            now_ms,
        )?;
        free.slots = free.slots.saturating_add(r.slots);
        free.burst = free.burst.saturating_add(r.burst);
    }
    Some(free)
}

/// The queue's room (the slots, [`Free::slots`]) for the model whose [`model_key`] is `key`:
/// found among the configured models, else a model only the endpoints serving any model serve.
pub fn room_by_key(s: &Scheduler<'_>, key: u64, now_ms: u64) -> Room {
    let named = s
        .cfg
        .endpoints
        .iter()
        .filter_map(|e| e.models.as_ref())
        .flatten()
        .find(|m| model_key(Some(m)) == key);
    match named {
        Some(m) => room(s, Some(m.as_str()), now_ms),
        None if key == model_key(None) => room(s, None, now_ms),
        // A model no endpoint lists by name: the wildcard endpoints' room.
        None => room(s, Some("\u{0}"), now_ms),
    }
    .map(|f| f.slots)
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
        }
    }

    fn free(slots: u32, burst: u32) -> Option<Free> {
        Some(Free { slots, burst })
    }

    #[test]
    fn room_is_slots_minus_own_and_others_unless_saturated_or_unknown() {
        use Saturation::*;
        // Unknown load: unbounded.
        assert_eq!(endpoint_room(Room, 5, 0, None, 4, 1_000), None);
        // Slots never seen (never queued): unbounded.
        assert_eq!(endpoint_room(Room, 5, 0, Some(&load(0, 3)), 0, 1_000), None);
        // Slots known: the free ones, this Envoy's in-flight attempts taken off; one more for
        // an arrival while nobody waits.
        assert_eq!(
            endpoint_room(Room, 1, 0, Some(&load(0, 1)), 4, 1_000),
            free(3, 4)
        );
        assert_eq!(
            endpoint_room(Room, 4, 0, Some(&load(0, 4)), 4, 1_000),
            free(0, 1)
        );
        assert_eq!(
            endpoint_room(Room, 6, 0, Some(&load(0, 4)), 4, 1_000),
            free(0, 0)
        );
        // Another replica's requests (the scrape showed 3 beyond this Envoy's 1): one free.
        assert_eq!(
            endpoint_room(Room, 1, 2, Some(&load(0, 3)), 4, 1_000),
            free(1, 2)
        );
        // This Envoy's slot freed since the scrape (the scrape still counts it): free at once.
        assert_eq!(
            endpoint_room(Room, 0, 2, Some(&load(0, 4)), 4, 1_000),
            free(2, 3)
        );
        // A queue seen now teaches the slots (running while queueing).
        assert_eq!(
            endpoint_room(Room, 0, 0, Some(&load(2, 2)), 0, 1_000),
            free(2, 3)
        );
        // Saturated by the scrape: full whatever the in-flight count.
        assert_eq!(
            endpoint_room(Room, 0, 0, Some(&load(5, 2)), 2, 1_000),
            free(0, 0)
        );
        // Hysteresis: a saturated engine with 2 waiting stays full.
        assert_eq!(
            endpoint_room(Saturated, 0, 0, Some(&load(2, 2)), 2, 1_000),
            free(0, 0)
        );
        assert_eq!(
            endpoint_room(Saturated, 0, 0, Some(&load(1, 2)), 2, 1_000),
            free(2, 3)
        );
    }
}
