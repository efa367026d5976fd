//! The affinity payoff: how much of a pinned turn's prompt its endpoint really had cached.
//!
//! Why: stickiness is worth exactly the prompt tokens an endpoint's KV cache does not compute
//! again. An endpoint that runs without prefix caching, or whose cache forgets conversations
//! sooner than their pins expire (a thrashing cache), gains nothing from it: its sessions'
//! follow-up turns are full prefills wherever they go. Only the answers can tell: the `usage`
//! of an affinity hit's answer says how much of the prompt the pinned endpoint had cached.
//!
//! How: per endpoint, in the shared endpoint table (so every worker sees the same value, and
//! the `computeflux_affinity_payoff_permille` gauge mirrors it), exponentially weighted
//! averages of the prompt tokens and cached tokens of the answers to **affinity hits** (the
//! first attempt went to the session's pin and answered with a `usage`; failover answers and
//! answers without usage are not samples):
//!
//! ```text
//! prompt ← (1-α)·prompt + α·p     cached ← (1-α)·cached + α·c     α = PAYOFF_ALPHA = 0.1
//! payoff = cached / prompt ∈ [0, 1]
//! ```
//!
//! A ratio of averages weighs each turn by its prompt: a short prompt that does not fill one
//! cache block (and so cannot be cached anywhere) barely moves it. Prompts shorter than
//! `payoff_min_prompt_tokens` (1024) are no samples at all: hosted APIs cache nothing below
//! about that size, so their answers would read as "no cache" on an endpoint that has one.
//!
//! **Closed loop** (`payoff_floor`, 0.1 by default; `0` turns it off): an endpoint is *unrewarding* when
//! it has at least [`PAYOFF_MIN_SAMPLES`] samples and its payoff is below the floor. Its weight in
//! *session* placement is multiplied by [`PAYOFF_WEIGHT`] ([`PayoffRule::factor`]), so that new
//! sessions (and sessions a replica places without a pin) go mostly to endpoints that cache.
//! Requests without a session are placed as before (they have nothing to cache), and pins
//! are kept (moving a session costs it a prefill; staying costs nothing extra). The reduced
//! weight is not zero: a few sessions still land there, so its pinned turns keep measuring
//! and an endpoint whose cache comes back is weighed in full again. The decision is a boolean
//! of smoothed state, so replicas (each measuring its own traffic) agree on it except while an
//! endpoint's payoff sits near the floor.

use crate::scheduler::config::Config;
use crate::scheduler::state::codec::{Reader, Writer};
use crate::scheduler::wire::usage::Usage;

/// Weight of each new answer in the payoff averages.
pub const PAYOFF_ALPHA: f64 = 0.1;

/// The payoff state of one endpoint (part of [`crate::scheduler::routing::table::EndpointState`]).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Payoff {
    /// EWMA of the prompt tokens of its affinity hits' answers.
    pub prompt: f64,
    /// EWMA of the cached prompt tokens of the same answers.
    pub cached: f64,
    /// Answers folded in (saturating).
    pub samples: u32,
}

/// The closed-loop rule (from the configuration).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PayoffRule {
    /// Below this payoff an endpoint is unrewarding; `0` turns the rule off.
    pub floor: f64,
    /// Samples needed before the rule judges an endpoint.
    pub min_samples: u64,
    /// Multiplier of an unrewarding endpoint's session placement weight, in (0, 1].
    pub weight: f64,
}

/// Pinned answers with `usage` an endpoint needs before `tuning.payoff_floor` judges it. Not
/// a key: the measured default.
pub const PAYOFF_MIN_SAMPLES: u64 = 5;

/// Multiplier of the session placement weight of an endpoint below `tuning.payoff_floor`.
/// Above zero, so that a few sessions still go there and show when its cache works again. Not
/// a key: the measured default.
pub const PAYOFF_WEIGHT: f64 = 0.125;

impl PayoffRule {
    /// The rule the configuration asks for (`tuning.payoff_floor`, with
    /// [`PAYOFF_MIN_SAMPLES`] and [`PAYOFF_WEIGHT`]).
    pub fn from_config(cfg: &Config) -> PayoffRule {
        PayoffRule {
            floor: cfg.payoff_floor,
            min_samples: PAYOFF_MIN_SAMPLES,
            weight: PAYOFF_WEIGHT,
        }
    }

    /// The rule that never fires.
    pub const OFF: PayoffRule = PayoffRule {
        floor: 0.0,
        min_samples: 0,
        weight: 1.0,
    };

    /// Whether `p` is unrewarding: enough samples, and a payoff below the floor.
    pub fn unrewarding(&self, p: &Payoff) -> bool {
        self.floor > 0.0
            && u64::from(p.samples) >= self.min_samples
            && p.ratio().is_some_and(|r| r < self.floor)
    }

    /// The factor of `p`'s endpoint's session placement weight: `weight` if unrewarding, else 1.
    pub fn factor(&self, p: &Payoff) -> f64 {
        if self.unrewarding(p) && self.weight > 0.0 && self.weight.is_finite() {
            self.weight.min(1.0)
        } else {
            1.0
        }
    }
}

impl Payoff {
    /// Bytes of [`Payoff::encode`].
    pub const BYTES: usize = 8 + 8 + 4;

    /// Folds in the usage of one affinity hit's answer. An answer with fewer than
    /// `min_prompt_tokens` prompt tokens (at least 1) teaches nothing: providers do not cache
    /// short prompts at all (OpenAI caches from 1024 tokens, Anthropic from 1024 or 2048).
    pub fn observe(&mut self, u: &Usage, min_prompt_tokens: u64) {
        if u.prompt_tokens < min_prompt_tokens.max(1) {
            return;
        }
        let p = u.prompt_tokens as f64;
        let c = u.cached_tokens.min(u.prompt_tokens) as f64;
        if self.samples == 0 {
            self.prompt = p;
            self.cached = c;
        } else {
            self.prompt = (1.0 - PAYOFF_ALPHA) * self.prompt + PAYOFF_ALPHA * p;
            self.cached = (1.0 - PAYOFF_ALPHA) * self.cached + PAYOFF_ALPHA * c;
        }
        self.samples = self.samples.saturating_add(1);
    }

    /// The payoff in [0, 1]; `None` before the first sample.
    pub fn ratio(&self) -> Option<f64> {
        if self.samples == 0 || self.prompt.is_nan() || self.prompt <= 0.0 {
            return None;
        }
        Some((self.cached / self.prompt).clamp(0.0, 1.0))
    }

    /// The payoff in thousandths, rounded (the gauge); `0` before the first sample.
    pub fn permille(&self) -> u64 {
        self.ratio().map_or(0, |r| (r * 1000.0).round() as u64)
    }

    pub fn encode(&self, w: &mut Writer) {
        w.f64(self.prompt);
        w.f64(self.cached);
        w.u32(self.samples);
    }

    /// `None` for a negative average (corruption).
    pub fn decode(r: &mut Reader<'_>) -> Option<Payoff> {
        let prompt = r.f64()?;
        let cached = r.f64()?;
        let samples = r.u32()?;
        if prompt < 0.0 || cached < 0.0 {
            return None;
        }
        Some(Payoff {
            prompt,
            cached,
            samples,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    // Property tests run natively only (proptest is not a wasm32 dev-dependency).
    #[cfg(not(target_arch = "wasm32"))]
    use proptest::prelude::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn usage(prompt: u64, cached: u64) -> Usage {
        Usage {
            prompt_tokens: prompt,
            cached_tokens: cached,
            completion_tokens: 16,
        }
    }

    const ON: PayoffRule = PayoffRule {
        floor: 0.1,
        min_samples: 3,
        weight: 0.125,
    };

    #[test]
    fn worked_example() {
        let mut p = Payoff::default();
        assert_eq!((p.ratio(), p.permille()), (None, 0));
        p.observe(&usage(100, 80), 1);
        assert_eq!(p.permille(), 800);
        // prompt 0.9·100 + 0.1·300 = 120; cached 0.9·80 + 0.1·0 = 72: 0.6
        p.observe(&usage(300, 0), 1);
        assert!((p.prompt - 120.0).abs() < 1e-9 && (p.cached - 72.0).abs() < 1e-9);
        assert_eq!(p.permille(), 600);
        assert_eq!(p.samples, 2);
        // No prompt, or a prompt below the minimum: not a sample.
        p.observe(&usage(0, 0), 0);
        p.observe(&usage(1023, 0), 1024);
        assert_eq!(p.samples, 2);
        p.observe(&usage(1024, 0), 1024);
        assert_eq!(p.samples, 3);
        // Cached above prompt counts as the whole prompt.
        let mut q = Payoff::default();
        q.observe(&usage(10, 99), 1);
        assert_eq!(q.permille(), 1000);
    }

    #[test]
    fn a_short_uncached_prompt_barely_moves_it() {
        let mut p = Payoff::default();
        for _ in 0..10 {
            p.observe(&usage(2000, 1800), 1);
        }
        p.observe(&usage(10, 0), 1);
        assert_eq!(p.permille(), 900);
    }

    #[test]
    fn rule_needs_samples_and_a_low_payoff() {
        let mut none = Payoff::default();
        let mut good = Payoff::default();
        for i in 0..3 {
            assert!(!ON.unrewarding(&none), "{i} samples");
            none.observe(&usage(500, 0), 1);
            good.observe(&usage(500, 400), 1);
        }
        assert!(ON.unrewarding(&none));
        assert_eq!(ON.factor(&none), 0.125);
        assert!(!ON.unrewarding(&good));
        assert_eq!(ON.factor(&good), 1.0);
        // Off: never.
        assert!(!PayoffRule::OFF.unrewarding(&none));
        assert_eq!(PayoffRule::OFF.factor(&none), 1.0);
        // A cache that comes back lifts it over the floor again.
        for _ in 0..3 {
            none.observe(&usage(500, 450), 1);
        }
        assert!(!ON.unrewarding(&none), "{:?}", none.ratio());
    }

    #[test]
    fn codec_round_trip_and_corruption() {
        let mut p = Payoff::default();
        p.observe(&usage(123, 45), 1);
        let mut w = Writer::with_capacity(Payoff::BYTES);
        p.encode(&mut w);
        assert_eq!(w.buf.len(), Payoff::BYTES);
        assert_eq!(Payoff::decode(&mut Reader::new(&w.buf)), Some(p));
        let mut bad = Writer::with_capacity(Payoff::BYTES);
        Payoff { prompt: -1.0, ..p }.encode(&mut bad);
        assert_eq!(Payoff::decode(&mut Reader::new(&bad.buf)), None);
        assert_eq!(Payoff::decode(&mut Reader::new(&w.buf[..10])), None);
    }

    /// Through the scheduler: samples folded in at finish, and new sessions leaving an
    /// endpoint whose pinned turns find nothing cached while its pins stay.
    #[test]
    fn the_loop_moves_new_sessions_and_keeps_pins() {
        use crate::scheduler::health::outcome::Outcome;
        use crate::scheduler::routing::select::{Exclusions, Pick, Reason, Scheduler};
        use crate::scheduler::state::store::MemStore;
        let cfg = Config::from_value(&serde_json::json!({
            "endpoints": [{"name": "a", "cluster": "a"}, {"name": "b", "cluster": "b"}],
        }))
        .unwrap();
        let store = MemStore::new();
        let s = Scheduler::new(&cfg, &store);
        let ex = Exclusions::default();
        let pick = |k: u64| Pick {
            model: None,
            session: Some(k),
            attempt: 1,
            exclusions: &ex,
            nonce: 0,
            body_bytes: 0,
            pin_hint: None,
            holder: None,
            prefix: crate::scheduler::routing::select::Prefix::NONE,
            follow_up: false,
            max_output_tokens: 0,
        };
        // Where each of 400 new sessions starts (nothing is pinned: cancelled attempts).
        let homes = || -> Vec<usize> {
            (1_000..1_400u64)
                .map(|k| {
                    let d = s.pick(&pick(k), 0).unwrap();
                    let at = d.endpoint;
                    s.finish(d.ticket, &Outcome::Cancelled, 0, None, 0);
                    at
                })
                .collect()
        };
        let before = homes();
        // A session pinned to `b`, whose pinned turns find nothing cached.
        let k = (0..)
            .find(|&k| {
                s.pick(&pick(k), 0).map(|d| {
                    let at = d.endpoint;
                    s.finish(d.ticket, &Outcome::Cancelled, 0, None, 0);
                    at
                }) == Ok(1)
            })
            .unwrap();
        let d = s.pick(&pick(k), 0).unwrap();
        s.finish(d.ticket, &Outcome::Success, 10, Some(k), 0);
        for i in 0..PAYOFF_MIN_SAMPLES {
            assert_eq!(homes(), before, "{i} samples: not yet judged");
            let mut d = s.pick(&pick(k), 1).unwrap();
            assert_eq!(d.reason, Reason::AffinityHit);
            d.ticket.pinned_usage = Some(usage(2_000, 0));
            s.finish(d.ticket, &Outcome::Success, 10, Some(k), 1);
        }
        let p = s.table().entries[1].1.payoff;
        assert_eq!(
            (u64::from(p.samples), p.permille()),
            (PAYOFF_MIN_SAMPLES, 0)
        );
        let after = homes();
        let on_b = |h: &[usize]| h.iter().filter(|&&e| e == 1).count();
        // Weighted rendezvous: a lower weight only moves sessions away from `b`, to about
        // 0.125 / 1.125 of them.
        assert!(after.iter().zip(&before).all(|(a, b)| *a == 0 || *b == 1));
        let (n_before, n_after) = (on_b(&before), on_b(&after));
        assert!((170..230).contains(&n_before), "{n_before}");
        assert!((25..70).contains(&n_after), "{n_after}");
        // The pinned session stays.
        let d = s.pick(&pick(k), 2).unwrap();
        assert_eq!((d.endpoint, d.reason), (1, Reason::AffinityHit));
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, 2);
        // Usage on a failed attempt is no sample.
        let mut d = s.pick(&pick(k), 3).unwrap();
        d.ticket.pinned_usage = Some(usage(2_000, 2_000));
        s.finish(d.ticket, &Outcome::ClientError, 10, Some(k), 3);
        assert_eq!(
            u64::from(s.table().entries[1].1.payoff.samples),
            PAYOFF_MIN_SAMPLES
        );
    }

    #[cfg(not(target_arch = "wasm32"))]
    proptest! {
        #[test]
        fn payoff_stays_within_its_samples(
            samples in proptest::collection::vec((1u64..100_000, 0u64..100_000), 1..60),
        ) {
            let mut p = Payoff::default();
            let (mut lo, mut hi) = (1.0f64, 0.0f64);
            for &(prompt, cached) in &samples {
                p.observe(&usage(prompt, cached), 1);
                let r = cached.min(prompt) as f64 / prompt as f64;
                lo = lo.min(r);
                hi = hi.max(r);
                let got = p.ratio().unwrap();
                // A ratio of averages lies between the smallest and largest sample ratio.
                prop_assert!(got >= lo - 1e-9 && got <= hi + 1e-9, "{got} not in [{lo}, {hi}]");
                prop_assert!(p.permille() <= 1000);
            }
            prop_assert_eq!(p.samples as usize, samples.len());
        }

        #[test]
        fn factor_is_one_or_the_weight(
            prompt in 0.0f64..1e9, cached in 0.0f64..1e9, samples in any::<u32>(),
            floor in 0.0f64..=1.0, min_samples in 0u64..100, weight in 0.001f64..=1.0,
        ) {
            let p = Payoff { prompt, cached, samples };
            let rule = PayoffRule { floor, min_samples, weight };
            let f = rule.factor(&p);
            prop_assert!(f == 1.0 || f == weight);
            prop_assert_eq!(f == weight && weight < 1.0, rule.unrewarding(&p) && weight < 1.0);
        }
    }
}
