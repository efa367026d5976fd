//! Saturation: an endpoint that is *full*, decided on the engine's own queue and KV cache.
//!
//! Why: slow and full are different faults with different remedies. A slow endpoint (see
//! `slowness`) serves each request worse than its peers, and its sessions gain by moving. A
//! full one serves each request as well as ever once it runs it, but new requests wait in its
//! queue: it should get no *new* sessions while others have room, and its pinned sessions
//! should stay unless the wait costs more than the prefill their cache saves. Only the engine
//! knows it is full: every router for self-hosted engines (the Gateway API Inference
//! Extension's endpoint picker, llm-d, the SGLang router, AIBrix, Dynamo) reads the queue depth
//! and KV-cache usage from the engine's `/metrics`. The filter's own in-flight counts see one
//! replica's share of the load, and finished latencies arrive too late.
//!
//! **The state** ([`judge`]), a tri-state with hysteresis on the scraped
//! [`EngineLoad`] (waiting requests, running requests, KV-cache usage in ‰):
//!
//! ```text
//! Room → Saturated   waiting ≥ 5  or  kv ≥ 900 ‰
//! Saturated → Room   waiting ≤ 1  and kv ≤ 800 ‰     (otherwise it stays Saturated)
//! Unknown            no fresh scrape, or neither waiting nor kv reported
//! ```
//!
//! The Gateway API Inference Extension's endpoint picker (the utilization detector of its
//! `saturationdetector` package: `DefaultQueueDepthThreshold = 5`,
//! `DefaultKVCacheUtilThreshold = 0.8`) filters out an endpoint with `waiting ≥ 5` or
//! `kv ≥ 0.8`, without hysteresis, and counts an endpoint whose metrics are stale as saturated.
//! We keep its queue threshold: 5 waiting means the engine turned away several requests in a
//! row, while 1–2 are the normal jitter of admission (a request arriving between two scheduler
//! steps). We enter on KV at 0.9 rather than 0.8, a judgement rather than a measurement: a busy
//! engine that still admits everything (no queue) can hold most of its blocks for its running
//! requests, and what makes a newcomer wait is the queue; at 0.9 the next admissions are close
//! to waiting or preempting. The exit needs *both* signals low (waiting ≤ 1, kv ≤ 0.8), so the
//! state does not flap with each scrape of a busy engine. A missing signal is not judged (llama.cpp
//! and TGI report no KV usage: the queue alone decides); with neither, or a stale scrape, the
//! state is [`Saturation::Unknown`] — never "has room" by assumption, and never "full" (which
//! would push sessions away from an endpoint only because its metrics port is unreachable).
//!
//! **The pin rule** ([`keep_pin`]): a pinned session on a saturated endpoint stays unless the
//! expected wait there exceeds what moving costs. Waiting `w` requests ahead, served `slots` at
//! a time in `service_ms` each, take about `w × service_ms / slots` (a saturated engine runs at
//! capacity, so its running count is its slot count). Moving re-prefills the session's cached
//! prefix elsewhere (`cached_tokens × prefill_ms_per_token` from the work model) on top of the
//! other endpoint's own wait. Unknown queue or costs keep the pin: moving needs evidence. A
//! queue shallower than one batch (`w < slots`: less than one service time of wait) keeps the
//! pin whatever the prefix: it drains by itself within one service, and every follow-up that
//! arrives before the next scrape reads the same queue, so moving them all re-prefills each
//! elsewhere to skip a wait the first few moves end (the bench's steady run, with the rule
//! moving from 5 waiting on 16 slots: the moved turns' first bytes came as late as those that
//! stayed, and 7–12 % of follow-ups lost their cache).
//!
//! Where a moved session goes is the placement walk's choice, with one more condition (see
//! `capacity`): an endpoint with a free slot, counting the placements this Envoy sent it since
//! its last scrape, or else nowhere (the pin stays). Without it, the sessions moved in one
//! scrape interval all went to the first endpoint of their rendezvous order whose last scrape
//! said "room", a 4-slot engine among them, and waited there longer than they would have stayed.
//!
//! **Moving once** ([`MoveMark`]): a session moved away for a reason is not moved again for
//! the same reason within the affinity TTL, so that two endpoints taking turns being full cannot
//! make a session pay a prefill on every turn. The mark is meant to live in the session's
//! affinity entry (one byte of reason and the move time in seconds, 5 bytes: the entry grows
//! from 20 to 25 bytes), written by the same CAS that re-pins the session; a move for another
//! reason (a failover, a degraded endpoint) is still allowed and replaces the mark.

use crate::scheduler::state::codec::{Reader, Writer};

/// What a scrape of the engine's `/metrics` said (each field `None` when the engine does not
/// report it or the parse failed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineLoad {
    /// Requests waiting for admission (vLLM `num_requests_waiting`, SGLang `num_queue_reqs`,
    /// llama.cpp `requests_deferred`, TGI `tgi_queue_size`).
    pub waiting: Option<u32>,
    /// Requests being run (vLLM `num_requests_running`, llama.cpp `requests_processing`).
    pub running: Option<u32>,
    /// KV-cache usage in thousandths (vLLM `kv_cache_usage_perc` × 1000).
    pub kv_usage_permille: Option<u16>,
    /// When the scrape completed.
    pub scraped_ms: u64,
    /// The engine's own decode pace, µs per token (`scrape::Scraped::pace_at`): what judges
    /// its slowness against its peers' where they publish one too (`signals`).
    pub decode_us_per_token: Option<u32>,
    /// When the engine last showed decoding (its last pace window closed: `scrape::Pace`'s
    /// `at_ms`): a probe that another replica sent it shows here, as the pace does.
    pub decoded_at_ms: Option<u64>,
}

/// The saturation of an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Saturation {
    /// No fresh, usable metrics: neither full nor healthy by assumption (placement behaves as
    /// without metrics).
    #[default]
    Unknown,
    /// Has room for new sessions.
    Room,
    /// Full: no new sessions while others have room; pins kept unless [`keep_pin`] says no.
    Saturated,
}

impl Saturation {
    /// Whether storing the verdict `judged` over this stored one changes anything read back
    /// from it: only whether it is saturated does ([`judge`]'s hysteresis reads
    /// `was == Saturated`, the saturated gauge likewise); `Unknown` and `Room` read alike.
    ///
    /// Why: when a fleet's loads turn known (the first pick after a scrape round) every
    /// endpoint's verdict goes from `Unknown` to `Room`, and storing that rewrote the whole
    /// endpoint table for nothing (33 groups, about 2.6 M instructions at 512 endpoints).
    pub fn stored_differs(self, judged: Saturation) -> bool {
        (self == Saturation::Saturated) != (judged == Saturation::Saturated)
    }
}

/// The thresholds of the saturation state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SaturationRule {
    /// Enter at this many waiting requests.
    pub enter_waiting: u32,
    /// Enter at this KV usage, ‰.
    pub enter_kv_permille: u16,
    /// Leave at or below this many waiting requests (and KV at or below `exit_kv_permille`).
    pub exit_waiting: u32,
    pub exit_kv_permille: u16,
    /// A scrape older than this is stale: [`Saturation::Unknown`].
    pub max_age_ms: u64,
}

impl Default for SaturationRule {
    /// Enter at 5 waiting or 900 ‰, leave at ≤ 1 waiting and ≤ 800 ‰; stale after 5 s (the
    /// caller should pass about three scrape intervals).
    fn default() -> Self {
        SaturationRule {
            enter_waiting: 5,
            enter_kv_permille: 900,
            exit_waiting: 1,
            exit_kv_permille: 800,
            max_age_ms: 5_000,
        }
    }
}

/// The saturation state after a scrape (or at any later time: staleness is judged at
/// `now_ms`), given the previous state `was` ([`Saturation::Unknown`] judges as not saturated).
pub fn judge(
    was: Saturation,
    load: Option<&EngineLoad>,
    rule: &SaturationRule,
    now_ms: u64,
) -> Saturation {
    let Some(load) = load else {
        return Saturation::Unknown;
    };
    if now_ms.saturating_sub(load.scraped_ms) > rule.max_age_ms {
        return Saturation::Unknown;
    }
    if load.waiting.is_none() && load.kv_usage_permille.is_none() {
        return Saturation::Unknown;
    }
    let full = if was == Saturation::Saturated {
        // Stays unless every reported signal is low.
        load.waiting.is_some_and(|w| w > rule.exit_waiting)
            || load
                .kv_usage_permille
                .is_some_and(|k| k > rule.exit_kv_permille)
    } else {
        load.waiting.is_some_and(|w| w >= rule.enter_waiting)
            || load
                .kv_usage_permille
                .is_some_and(|k| k >= rule.enter_kv_permille)
    };
    if full {
        Saturation::Saturated
    } else {
        Saturation::Room
    }
}

/// Why a session was moved away from its endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoveReason {
    Saturated = 1,
    Degraded = 2,
}

/// The last move of a session (in its affinity entry): the reason and when, in seconds (a u32
/// of seconds covers 136 years; the TTL is minutes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MoveMark {
    /// `None`: never moved (or the mark was cleared).
    pub reason: Option<MoveReason>,
    pub at_s: u32,
}

impl MoveMark {
    pub const BYTES: usize = 1 + 4;

    /// The mark of a move for `reason` at `now_ms`.
    pub fn moved(reason: MoveReason, now_ms: u64) -> MoveMark {
        MoveMark {
            reason: Some(reason),
            at_s: u32::try_from(now_ms / 1000).unwrap_or(u32::MAX),
        }
    }

    /// Whether the session may be moved for `reason` now: not if it was moved for the same
    /// reason less than `ttl_ms` ago.
    pub fn may_move(&self, reason: MoveReason, now_ms: u64, ttl_ms: u64) -> bool {
        if self.reason != Some(reason) {
            return true;
        }
        let since_ms = now_ms.saturating_sub(u64::from(self.at_s).saturating_mul(1000));
        since_ms >= ttl_ms
    }

    pub fn encode_into(&self, w: &mut Writer) {
        w.u8(self.reason.map_or(0, |r| r as u8));
        w.u32(self.at_s);
    }

    /// `None` for an unknown reason byte.
    pub fn decode_from(r: &mut Reader) -> Option<MoveMark> {
        let reason = match r.u8()? {
            0 => None,
            1 => Some(MoveReason::Saturated),
            2 => Some(MoveReason::Degraded),
            _ => return None,
        };
        Some(MoveMark {
            reason,
            at_s: r.u32()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn load(waiting: Option<u32>, kv: Option<u16>) -> EngineLoad {
        EngineLoad {
            waiting,
            running: Some(8),
            kv_usage_permille: kv,
            scraped_ms: 1_000,
            decode_us_per_token: None,
            decoded_at_ms: None,
        }
    }

    #[test]
    fn enters_and_leaves_with_hysteresis() {
        let r = SaturationRule::default();
        let j = |was, w, k| judge(was, Some(&load(w, k)), &r, 1_500);
        use Saturation::*;
        assert_eq!(j(Room, Some(4), Some(899)), Room);
        assert_eq!(j(Room, Some(5), Some(0)), Saturated);
        assert_eq!(j(Room, Some(0), Some(900)), Saturated);
        assert_eq!(j(Unknown, Some(5), None), Saturated);
        // Stays while either signal is above its exit threshold.
        assert_eq!(j(Saturated, Some(2), Some(100)), Saturated);
        assert_eq!(j(Saturated, Some(0), Some(801)), Saturated);
        assert_eq!(j(Saturated, Some(1), Some(800)), Room);
        // A queue of 3 at KV 850: full if it was, room if it was not (the dead band).
        assert_eq!(j(Saturated, Some(3), Some(850)), Saturated);
        assert_eq!(j(Room, Some(3), Some(850)), Room);
        // Only the queue reported (llama.cpp, TGI): judged on it alone.
        assert_eq!(j(Saturated, Some(1), None), Room);
        assert_eq!(j(Saturated, None, Some(700)), Room);
    }

    #[test]
    fn unknown_is_neither_full_nor_room() {
        let r = SaturationRule::default();
        use Saturation::*;
        assert_eq!(judge(Saturated, None, &r, 0), Unknown);
        assert_eq!(judge(Room, Some(&load(None, None)), &r, 1_000), Unknown);
        // Stale: 5 s old is still fresh, 5.001 s is not.
        let full = load(Some(50), Some(990));
        assert_eq!(judge(Room, Some(&full), &r, 6_000), Saturated);
        assert_eq!(judge(Room, Some(&full), &r, 6_001), Unknown);
        // A scrape stamped in the future (clock skew between workers) is not stale.
        assert_eq!(judge(Room, Some(&full), &r, 0), Saturated);
    }

    #[test]
    fn moved_once_per_reason_and_ttl() {
        let ttl = 300_000;
        let never = MoveMark::default();
        assert!(never.may_move(MoveReason::Saturated, 0, ttl));
        let m = MoveMark::moved(MoveReason::Saturated, 1_000_500);
        assert_eq!(m.at_s, 1_000);
        assert!(!m.may_move(MoveReason::Saturated, 1_200_000, ttl));
        assert!(m.may_move(MoveReason::Degraded, 1_200_000, ttl));
        assert!(!m.may_move(MoveReason::Saturated, 1_299_999, ttl));
        assert!(m.may_move(MoveReason::Saturated, 1_300_000, ttl));
        let mut w = Writer::default();
        m.encode_into(&mut w);
        assert_eq!(w.buf.len(), MoveMark::BYTES);
        assert_eq!(MoveMark::decode_from(&mut Reader::new(&w.buf)), Some(m));
        assert_eq!(
            MoveMark::decode_from(&mut Reader::new(&[3, 0, 0, 0, 0])),
            None
        );
        assert_eq!(MoveMark::decode_from(&mut Reader::new(&[1, 0])), None);
    }
}
