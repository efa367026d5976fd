//! In-flight attempts counted by the age of their start, so that a leaked count expires.
//!
//! Why: an endpoint's in-flight count goes up at the pick and down at the finish. If a VM
//! crashes in between (Envoy then never runs `on_log`), the decrement never comes, and the
//! endpoint looks busier for good: bounded-load placement spills its sessions, the score of
//! requests without a session shuns it. The older rule ignored a count that had not moved for
//! 10 minutes (`table::IN_FLIGHT_STALE_MS`), which a busy endpoint — the one whose count
//! matters — never satisfies. A count must expire by the age of the
//! attempts it counts, not by the endpoint's quiet.
//!
//! How: attempts are counted in [`SLOTS`] slots by the epoch of their start, an epoch being
//! half of `in_flight_max_age_ms` (`width_ms`). A finish takes its attempt out of the slot of
//! its own start epoch (its ticket carries the start time). A slot whose newest possible start
//! is `max_age_ms` old is expired: its remaining count is attempts that never reported back,
//! taken off the endpoint's total at the next write of that entry, and ignored by every read
//! before it ([`InFlightAges::expired`]). So a leaked attempt stops counting between 1 and 1.5
//! × `max_age_ms` after its start, however busy the endpoint. An attempt that outlives the
//! bound (a generation longer than `in_flight_max_age_ms`) stops counting early; its finish
//! then finds its slot gone and takes nothing off (the count never goes below the live ones).
//! Four slots cover the three epochs a live attempt can be in, plus one being expired.

use crate::scheduler::state::codec::{Reader, Writer};

/// Slots per endpoint (epochs tracked at once).
pub const SLOTS: usize = 4;

/// Attempts in flight by start epoch: `(epoch + 1, count)` per slot, `(0, 0)` when empty.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct InFlightAges {
    slots: [(u32, u32); SLOTS],
}

/// The epoch width for a bound: half of it, at least 1 ms.
fn width_ms(max_age_ms: u64) -> u64 {
    (max_age_ms / 2).max(1)
}

/// The stored tag of the epoch of `at_ms` (epoch + 1, so that 0 means empty).
fn tag(at_ms: u64, max_age_ms: u64) -> u32 {
    u32::try_from(at_ms / width_ms(max_age_ms))
        .unwrap_or(u32::MAX - 1)
        .saturating_add(1)
}

/// Whether every attempt of the slot tagged `t` started at least `max_age_ms` before `now_ms`.
fn expired_tag(t: u32, now_ms: u64, max_age_ms: u64) -> bool {
    // The slot's newest possible start is the end of its epoch.
    let end_ms = u64::from(t).saturating_mul(width_ms(max_age_ms));
    now_ms.saturating_sub(end_ms) >= max_age_ms
}

impl InFlightAges {
    pub const BYTES: usize = SLOTS * 8;

    /// An attempt started at `started_ms`. Returns the count of an expired slot it reused
    /// (attempts that never reported back: take them off the total).
    pub fn add(&mut self, started_ms: u64, max_age_ms: u64) -> u32 {
        let t = tag(started_ms, max_age_ms);
        let i = (t as usize) % SLOTS;
        let Some(slot) = self.slots.get_mut(i) else {
            return 0;
        };
        if slot.0 == t {
            slot.1 = slot.1.saturating_add(1);
            return 0;
        }
        let evicted = slot.1;
        *slot = (t, 1);
        evicted
    }

    /// The attempt started at `started_ms` reported back. False if its slot is gone (expired,
    /// or never counted): nothing to take off the total then.
    pub fn remove(&mut self, started_ms: u64, max_age_ms: u64) -> bool {
        let t = tag(started_ms, max_age_ms);
        match self
            .slots
            .get_mut((t as usize) % SLOTS)
            .filter(|s| s.0 == t && s.1 > 0)
        {
            Some(slot) => {
                slot.1 -= 1;
                true
            }
            None => false,
        }
    }

    /// Attempts at `now_ms` in slots whose every start is `max_age_ms` old: presumed leaked.
    pub fn expired(&self, now_ms: u64, max_age_ms: u64) -> u32 {
        self.slots
            .iter()
            .filter(|(t, n)| *n > 0 && expired_tag(*t, now_ms, max_age_ms))
            .fold(0u32, |acc, (_, n)| acc.saturating_add(*n))
    }

    /// Empties the expired slots; returns how many attempts they held.
    pub fn expire(&mut self, now_ms: u64, max_age_ms: u64) -> u32 {
        let mut gone = 0u32;
        for slot in &mut self.slots {
            if slot.1 > 0 && expired_tag(slot.0, now_ms, max_age_ms) {
                gone = gone.saturating_add(slot.1);
                *slot = (0, 0);
            }
        }
        gone
    }

    pub fn encode(&self, w: &mut Writer) {
        for (t, n) in &self.slots {
            w.u32(*t);
            w.u32(*n);
        }
    }

    pub fn decode(r: &mut Reader<'_>) -> Option<InFlightAges> {
        let mut slots = [(0u32, 0u32); SLOTS];
        for slot in &mut slots {
            *slot = (r.u32()?, r.u32()?);
        }
        Some(InFlightAges { slots })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const MAX: u64 = 600_000;

    #[test]
    fn live_attempts_come_and_go_and_a_leaked_one_expires_within_one_and_a_half_bounds() {
        let mut a = InFlightAges::default();
        assert_eq!(a.add(1_000, MAX), 0);
        assert_eq!(a.add(2_000, MAX), 0);
        assert!(a.remove(2_000, MAX));
        // The attempt started at 1 s never reports back.
        assert_eq!(a.expired(MAX, MAX), 0);
        assert_eq!(a.expired(299_999 + MAX, MAX), 0, "its epoch ends at 300 s");
        assert_eq!(a.expired(300_000 + MAX, MAX), 1);
        assert_eq!(a.expire(300_000 + MAX, MAX), 1);
        assert_eq!(a.expired(300_000 + MAX, MAX), 0);
        // Its late finish takes nothing off.
        assert!(!a.remove(1_000, MAX));
    }

    #[test]
    fn codec_round_trips() {
        let mut a = InFlightAges::default();
        a.add(5, MAX);
        a.add(400_000, MAX);
        let mut w = Writer::default();
        a.encode(&mut w);
        let bytes = w.buf;
        assert_eq!(bytes.len(), InFlightAges::BYTES);
        assert_eq!(InFlightAges::decode(&mut Reader::new(&bytes)), Some(a));
    }
}
