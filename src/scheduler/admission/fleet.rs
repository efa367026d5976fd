//! Whether the fleet serving a model is full: the room admission counts on.
//!
//! Why these signals: the filter already judges every scraped engine (`routing::judge::saturation`,
//! with its hysteresis) and learns its slots (`routing::select::capacity`); admission reads the same
//! verdicts rather than a second detector. An endpoint is **full** when its saturation is
//! `Saturated` (scraped queue ≥ 5 or KV ≥ 90 %), else it has `slots − in flight` free slots,
//! counting this Envoy's own in-flight attempts (exact and immediate for this process, where
//! the scrape is up to an interval old). An endpoint whose load is unknown (not scraped, a
//! stale or failed scrape) or whose slots were never seen is never full by assumption — as
//! everywhere in the filter — so the model's room is then unbounded and nothing waits.

use crate::scheduler::admission::queue::Room;
use crate::scheduler::routing::judge::saturation::{judge, Saturation, SaturationRule};
use crate::scheduler::routing::select::capacity::slots_seen;
use crate::scheduler::routing::select::Scheduler;
use crate::scheduler::state::hash::hash_parts;

const MODEL_SEED: u64 = 0x6164_6d69_7373_696f; // "admissio"

/// The queue's name for a model.
pub fn model_key(model: Option<&str>) -> u64 {
    hash_parts(MODEL_SEED, &[model.unwrap_or("").as_bytes()])
}

/// An endpoint's free slots for admission: `None` when not known to be bounded.
pub fn endpoint_room(
    was: Saturation,
    in_flight: u32,
    load: Option<&crate::scheduler::routing::judge::saturation::EngineLoad>,
    slots_before: u32,
    now_ms: u64,
) -> Option<u32> {
    let load = load?;
    // The load is fresh (stale ones are never handed here): judged without an age bound.
    let rule = SaturationRule {
        max_age_ms: u64::MAX,
        ..SaturationRule::default()
    };
    match judge(was, Some(load), &rule, now_ms) {
        Saturation::Saturated => Some(0),
        Saturation::Unknown => None,
        Saturation::Room => {
            let slots = slots_seen(slots_before, load);
            (slots > 0).then(|| slots.saturating_sub(in_flight))
        }
    }
}

/// The free slots of the endpoints serving `model` (enabled ones), `None` when any of them is
/// not known to be bounded; `Some(0)` also when none serves it (the pick answers that).
pub fn room(s: &Scheduler<'_>, model: Option<&str>, now_ms: u64) -> Room {
    let statics = s.statics(model);
    if statics.indexes.is_empty() {
        return None;
    }
    let engines = s.engines(now_ms);
    if engines.loads.is_empty() {
        return None;
    }
    let table = s.table();
    let max_age = s.cfg.in_flight_max_age_ms;
    let mut free: u32 = 0;
    for &i in &statics.indexes {
        let (Some(ep), Some((_, st))) = (s.cfg.endpoints.get(i), table.entries.get(i)) else {
            return None;
        };
        let load = engines.loads.get(i).copied().flatten();
        let slots = engines.seen.get(ep.id).slots;
        let r = endpoint_room(
            st.saturation,
            st.load(now_ms, max_age),
            load.as_ref(),
            slots,
            now_ms,
        )?;
        free = free.saturating_add(r);
    }
    Some(free)
}

/// [`room`] for the model whose [`model_key`] is `key`: found among the configured models,
/// else a model only the endpoints serving any model serve.
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

    #[test]
    fn room_is_slots_minus_in_flight_unless_saturated_or_unknown() {
        use Saturation::*;
        // Unknown load: unbounded.
        assert_eq!(endpoint_room(Room, 5, None, 4, 1_000), None);
        // Slots never seen (never queued): unbounded.
        assert_eq!(endpoint_room(Room, 5, Some(&load(0, 3)), 0, 1_000), None);
        // Slots known: the free ones, this Envoy's in-flight attempts taken off.
        assert_eq!(endpoint_room(Room, 1, Some(&load(0, 1)), 4, 1_000), Some(3));
        assert_eq!(endpoint_room(Room, 6, Some(&load(0, 4)), 4, 1_000), Some(0));
        // A queue seen now teaches the slots (running while queueing).
        assert_eq!(endpoint_room(Room, 0, Some(&load(2, 2)), 0, 1_000), Some(2));
        // Saturated by the scrape: full whatever the in-flight count.
        assert_eq!(endpoint_room(Room, 0, Some(&load(5, 2)), 2, 1_000), Some(0));
        // Hysteresis: a saturated engine with 2 waiting stays full.
        assert_eq!(
            endpoint_room(Saturated, 0, Some(&load(2, 2)), 2, 1_000),
            Some(0)
        );
        assert_eq!(
            endpoint_room(Saturated, 0, Some(&load(1, 2)), 2, 1_000),
            Some(2)
        );
    }
}
