//! Overdue affinity hits: evidence that an endpoint has turned slow before its slow answers
//! arrive.
//!
//! Why: the latency estimate learns of a slowdown only from answers, and the first answer of an
//! endpoint that has become 5× slower arrives 5× later. Every pinned turn sent there in the
//! meantime pays the slowdown; a measured slow-endpoint run lost most of its p99 in that window.
//! An attempt that is still waiting long after it should have been answered says the same thing
//! earlier.
//!
//! What is watched: affinity hits only. Their prefix is cached where they go, so what they
//! cost is homogeneous (the new message and the generation); placements and moved sessions pay
//! full prefills whose length says nothing about the endpoint. Each endpoint keeps the start
//! times of up to [`SLOTS`] hits in flight, in the endpoint table (written in the pick and the
//! finish that write the table anyway; a streamed answer, whose latency sample is its first
//! byte, releases its slot at that byte). When more hits are in flight than slots, the later
//! ones are not watched: they are younger, so the oldest watched age never overstates the
//! evidence.
//!
//! The rule ([`Watch::overdue`]): a hit is overdue once its age exceeds `ratio × best` and
//! `best + min_gap_ms`, and also the endpoint's own usual spread (`own + 4 × dev`, the TCP
//! retransmission-timeout rule). The caller (`signals`) passes these on the work
//! model's terms: `best` = the endpoint's typical expected time × its peers' median slowness,
//! `own` = that time × its own slowness, `dev` from its slowness deviation. An endpoint with
//! `pin_break_overdue` overdue hits counts as degraded while they last; once the slow answers
//! arrive its slowness carries the degradation (with its hysteresis), and a false alarm ends
//! with the attempt.
//!
//! **Off by default** (`pin_break_overdue: 0`): what a watched hit should take is not known at
//! the pick. A streamed hit's first byte depends on the uncached part of its prompt, which the
//! filter can only estimate; a plain hit's end depends on how many tokens it will generate,
//! which nobody knows (16–512 on the bench: 30× apart). The endpoint's *typical*
//! expected time is the only yardstick, and a long plain generation on a healthy endpoint
//! exceeds three times it — a false pin break on every such turn. Answers, judged against
//! their own work, detect a 5× slower endpoint within 3–4 answers (`slowness`).

use crate::scheduler::config::Config;
use crate::scheduler::routing::ewma::LATENCY_FLOOR_MS;
use crate::scheduler::state::codec::{Reader, Writer};

/// The thresholds of the overdue rule, from the configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rule {
    /// `pin_break_ratio`.
    pub ratio: f64,
    /// `pin_break_min_ms`.
    pub min_gap_ms: f64,
    /// `pin_break_overdue`: overdue hits that make the evidence (0: never).
    pub needed: usize,
}

impl Rule {
    pub fn from_config(cfg: &Config) -> Rule {
        Rule {
            ratio: cfg.pin_break_ratio,
            min_gap_ms: cfg.pin_break_min_ms as f64,
            needed: usize::try_from(cfg.pin_break_overdue).unwrap_or(usize::MAX),
        }
    }
}

/// Watched attempts per endpoint.
pub const SLOTS: usize = 4;

/// A watched attempt whose release never came (its VM died between pick and finish) is
/// forgotten after this long, so a leak cannot hold an endpoint degraded.
pub const LEAK_MS: u64 = 600_000;

/// The deviation gain of the spread bound (TCP's RTO uses 4).
pub const SPREAD_GAIN: f64 = 4.0;

/// One watched attempt: a nonzero token and its start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Slot {
    pub token: u32,
    pub started_ms: u64,
}

/// The watched affinity hits of one endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Watch {
    pub slots: [Slot; SLOTS],
}

impl Watch {
    pub const BYTES: usize = SLOTS * (4 + 8);

    /// Watches an attempt started at `now_ms`; false when every slot holds a live attempt
    /// (`token` 0 is never watched).
    pub fn insert(&mut self, token: u32, now_ms: u64) -> bool {
        if token == 0 {
            return false;
        }
        let free = self
            .slots
            .iter_mut()
            .find(|s| s.token == 0 || now_ms.saturating_sub(s.started_ms) >= LEAK_MS);
        match free {
            Some(s) => {
                *s = Slot {
                    token,
                    started_ms: now_ms,
                };
                true
            }
            None => false,
        }
    }

    /// Stops watching the attempt `token` started at `started_ms`; false if it was not watched.
    pub fn release(&mut self, token: u32, started_ms: u64) -> bool {
        if token == 0 {
            return false;
        }
        match self
            .slots
            .iter_mut()
            .find(|s| s.token == token && s.started_ms == started_ms)
        {
            Some(s) => {
                *s = Slot::default();
                true
            }
            None => false,
        }
    }

    /// How many watched attempts are older than `threshold_ms` (and not leaked).
    pub fn count_older(&self, threshold_ms: f64, now_ms: u64) -> usize {
        self.slots
            .iter()
            .filter(|s| s.token != 0)
            .map(|s| now_ms.saturating_sub(s.started_ms))
            .filter(|&age| age < LEAK_MS && age as f64 >= threshold_ms)
            .count()
    }

    /// The overdue rule (module doc): `own` and `dev` are this endpoint's estimate and mean
    /// deviation, `best` the fastest warm estimate.
    pub fn overdue(&self, own: f64, dev: f64, best: f64, rule: &Rule, now_ms: u64) -> bool {
        if rule.needed == 0 || !(own.is_finite() && dev.is_finite() && best.is_finite()) {
            return false;
        }
        let threshold = (rule.ratio * best.max(LATENCY_FLOOR_MS))
            .max(best + rule.min_gap_ms)
            .max(own + SPREAD_GAIN * dev.max(0.0));
        self.count_older(threshold, now_ms) >= rule.needed
    }

    pub fn encode(&self, w: &mut Writer) {
        for s in &self.slots {
            w.u32(s.token);
            w.u64(s.started_ms);
        }
    }

    pub fn decode(r: &mut Reader<'_>) -> Option<Watch> {
        let mut w = Watch::default();
        for s in &mut w.slots {
            s.token = r.u32()?;
            s.started_ms = r.u64()?;
        }
        Some(w)
    }
}

/// A token for an attempt: nonzero, from the request's nonce (collisions between concurrent
/// attempts of one endpoint are unlikely and harmless: a release then frees the other slot of the
/// same start time only, see [`Watch::release`]).
pub fn token(nonce: u64, attempt: u32) -> u32 {
    let mixed = (nonce ^ (nonce >> 32)) as u32 ^ attempt.wrapping_mul(0x9E37_79B9);
    mixed.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn insert_release_and_capacity() {
        let mut w = Watch::default();
        for t in 1..=SLOTS as u32 {
            assert!(w.insert(t, 100));
        }
        // Full: a fifth live attempt is not watched.
        assert!(!w.insert(9, 150));
        assert!(w.release(2, 100));
        assert!(!w.release(2, 100), "released once");
        assert!(!w.release(3, 101), "another start time is another attempt");
        assert!(w.insert(9, 150));
        assert!(!w.insert(0, 150), "token 0 is never watched");
    }

    #[test]
    fn leaked_slots_are_reused_and_never_count() {
        let mut w = Watch::default();
        for t in 1..=SLOTS as u32 {
            w.insert(t, 0);
        }
        assert_eq!(w.count_older(10.0, LEAK_MS - 1), SLOTS);
        assert_eq!(w.count_older(10.0, LEAK_MS), 0, "leaked: no evidence");
        assert!(w.insert(7, LEAK_MS), "a leaked slot is taken over");
    }

    #[test]
    fn overdue_threshold_is_the_largest_of_ratio_gap_and_spread() {
        let rule = |needed| Rule {
            ratio: 3.0,
            min_gap_ms: 50.0,
            needed,
        };
        let mut w = Watch::default();
        w.insert(1, 1_000);
        // best 50, ratio 3 → 150; gap 50 → 100; own 60 + 4 × 5 = 80: threshold 150.
        assert!(!w.overdue(60.0, 5.0, 50.0, &rule(1), 1_149));
        assert!(w.overdue(60.0, 5.0, 50.0, &rule(1), 1_150));
        // A widely varying endpoint (own 200, deviation 100): 600 ms.
        assert!(!w.overdue(200.0, 100.0, 50.0, &rule(1), 1_599));
        assert!(w.overdue(200.0, 100.0, 50.0, &rule(1), 1_600));
        // Two needed, one watched: never.
        assert!(!w.overdue(60.0, 5.0, 50.0, &rule(2), 5_000));
        // Off.
        assert!(!w.overdue(60.0, 5.0, 50.0, &rule(0), 5_000));
        // Not a number: no evidence.
        assert!(!w.overdue(f64::NAN, 5.0, 50.0, &rule(1), 5_000));
    }

    #[test]
    fn round_trip() {
        let mut w = Watch::default();
        w.insert(5, 77);
        w.insert(6, 88);
        let mut out = Writer::with_capacity(Watch::BYTES);
        w.encode(&mut out);
        assert_eq!(out.buf.len(), Watch::BYTES);
        let mut r = Reader::new(&out.buf);
        assert_eq!(Watch::decode(&mut r), Some(w));
    }

    #[test]
    fn tokens_are_nonzero() {
        assert_ne!(token(0, 0), 0);
        assert_ne!(token(u64::MAX, 1), 0);
        assert_ne!(token(42, 1), token(42, 2));
    }
}
