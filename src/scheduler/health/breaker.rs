//! The per-endpoint circuit breaker: Closed → Open → HalfOpen, with bounded probes.
//!
//! - Closed → Open at once on a 429, for the `Retry-After` it carried (capped) or else
//!   `rate_limit_ms`; after `failure_threshold` consecutive endpoint failures (5xx, connect
//!   failure, reset, timeout), for `open_ms`.
//! - Open → HalfOpen when the cooldown ends (evaluated lazily at the next admission).
//! - HalfOpen admits exactly `half_open_probes` requests. When all of them succeed the breaker
//!   closes; the first failing probe re-opens it with the cooldown reset (for the same cause's
//!   duration). This is what keeps a still-rate-limited provider from receiving a burst.
//!
//! Every transition happens inside a CAS update of the shared endpoint table, so the probe bound
//! holds across Envoy's worker threads. Probes carry the breaker's `epoch`; outcomes of requests
//! admitted in an earlier epoch (or while closed) cannot close or re-open a later half-open.
//! A probe that never reports (its VM crashed) is reclaimed after `probe_stale_ms`, under a new
//! epoch: a late report of the reclaimed probe is then ignored like any other stale outcome.

use crate::scheduler::health::outcome::Outcome;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    Closed,
    Open,
    HalfOpen,
}

/// Why the breaker opened: recovery differs (a rate-limit window vs overload).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenCause {
    Failures,
    RateLimited,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Breaker {
    pub state: BreakerState,
    pub cause: OpenCause,
    pub consecutive_failures: u32,
    pub open_until_ms: u64,
    pub probes_admitted: u32,
    pub probes_succeeded: u32,
    pub last_probe_ms: u64,
    pub epoch: u32,
}

impl Default for Breaker {
    fn default() -> Self {
        Breaker {
            state: BreakerState::Closed,
            cause: OpenCause::Failures,
            consecutive_failures: 0,
            open_until_ms: 0,
            probes_admitted: 0,
            probes_succeeded: 0,
            last_probe_ms: 0,
            epoch: 0,
        }
    }
}

/// The breaker's answer to "may a request go to this endpoint now?".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Closed: normal traffic.
    Normal,
    /// HalfOpen: admitted as one of the bounded probes of this epoch.
    Probe { epoch: u32 },
    /// Not now; the earliest time it may admit again, and whether it is a rate-limit window.
    Rejected {
        retry_at_ms: u64,
        rate_limited: bool,
    },
}

/// Breaker timing knobs, from the configuration.
#[derive(Debug, Clone, Copy)]
pub struct BreakerConfig {
    pub failure_threshold: u32,
    pub half_open_probes: u32,
    pub open_ms: u64,
    pub rate_limit_ms: u64,
    pub retry_after_max_ms: u64,
    pub probe_stale_ms: u64,
}

/// How long a half-open slot that is fully taken is retried later when rejected.
const HALF_OPEN_RETRY_MS: u64 = 1_000;

impl Breaker {
    /// The state as of `now_ms` (an Open breaker whose cooldown ended reads as HalfOpen).
    pub fn state_at(&self, now_ms: u64) -> BreakerState {
        match self.state {
            BreakerState::Open if now_ms >= self.open_until_ms => BreakerState::HalfOpen,
            s => s,
        }
    }

    /// Read-only admission check, used while ranking candidates.
    pub fn peek(&self, now_ms: u64, cfg: &BreakerConfig) -> Admission {
        // What `admit` answers a closed breaker, without copying it (a pick peeks at every
        // candidate's breaker).
        if self.state == BreakerState::Closed {
            return Admission::Normal;
        }
        let mut copy = *self;
        copy.admit(now_ms, cfg)
    }

    /// Admission that takes a probe slot when half-open. Call inside a CAS update.
    pub fn admit(&mut self, now_ms: u64, cfg: &BreakerConfig) -> Admission {
        if self.state == BreakerState::Open {
            if now_ms < self.open_until_ms {
                return Admission::Rejected {
                    retry_at_ms: self.open_until_ms,
                    rate_limited: self.cause == OpenCause::RateLimited,
                };
            }
            self.state = BreakerState::HalfOpen;
            self.epoch = self.epoch.wrapping_add(1);
            self.probes_admitted = 0;
            self.probes_succeeded = 0;
        }
        match self.state {
            BreakerState::Closed => Admission::Normal,
            BreakerState::HalfOpen => {
                if self.probes_admitted >= cfg.half_open_probes
                    && now_ms.saturating_sub(self.last_probe_ms) >= cfg.probe_stale_ms
                {
                    // Outstanding probes never reported (VM crash): give their slots back, under
                    // a new epoch, so that a late report of a reclaimed probe cannot give its
                    // slot back a second time (or re-open the breaker).
                    self.probes_admitted = self.probes_succeeded;
                    self.epoch = self.epoch.wrapping_add(1);
                }
                if self.probes_admitted < cfg.half_open_probes {
                    self.probes_admitted += 1;
                    self.last_probe_ms = now_ms;
                    Admission::Probe { epoch: self.epoch }
                } else {
                    Admission::Rejected {
                        retry_at_ms: now_ms.saturating_add(HALF_OPEN_RETRY_MS),
                        rate_limited: self.cause == OpenCause::RateLimited,
                    }
                }
            }
            BreakerState::Open => Admission::Rejected {
                retry_at_ms: self.open_until_ms,
                rate_limited: self.cause == OpenCause::RateLimited,
            },
        }
    }

    /// Feeds one attempt's outcome. `probe` is the epoch the attempt was admitted under as a
    /// probe, `None` for normal traffic. Returns true when the state changed.
    pub fn record(
        &mut self,
        outcome: &Outcome,
        probe: Option<u32>,
        now_ms: u64,
        cfg: &BreakerConfig,
    ) -> bool {
        let before = (self.state, self.open_until_ms);
        match self.state {
            BreakerState::Closed => match outcome {
                Outcome::Success => self.consecutive_failures = 0,
                Outcome::RateLimited { retry_after_ms } => {
                    self.open(OpenCause::RateLimited, *retry_after_ms, now_ms, cfg)
                }
                Outcome::EndpointFailure(_) => {
                    self.consecutive_failures = self.consecutive_failures.saturating_add(1);
                    if self.consecutive_failures >= cfg.failure_threshold {
                        self.open(OpenCause::Failures, None, now_ms, cfg);
                    }
                }
                // Per-request (dead key) or not the endpoint's fault: no breaker change.
                Outcome::DeadKey | Outcome::ClientError | Outcome::Cancelled => {}
            },
            BreakerState::HalfOpen if probe == Some(self.epoch) => match outcome {
                Outcome::Success => {
                    self.probes_succeeded += 1;
                    if self.probes_succeeded >= cfg.half_open_probes {
                        self.state = BreakerState::Closed;
                        self.consecutive_failures = 0;
                    }
                }
                Outcome::RateLimited { retry_after_ms } => {
                    self.open(OpenCause::RateLimited, *retry_after_ms, now_ms, cfg)
                }
                Outcome::EndpointFailure(_) | Outcome::DeadKey => {
                    let cause = self.cause;
                    self.open(cause, None, now_ms, cfg)
                }
                // The probe told us nothing: give its slot back.
                Outcome::ClientError | Outcome::Cancelled => {
                    self.probes_admitted = self.probes_admitted.saturating_sub(1)
                }
            },
            // Open, or an outcome from before this half-open epoch: it says nothing new.
            _ => {}
        }
        before != (self.state, self.open_until_ms)
    }

    fn open(
        &mut self,
        cause: OpenCause,
        retry_after_ms: Option<u64>,
        now_ms: u64,
        cfg: &BreakerConfig,
    ) {
        let cooldown = match cause {
            OpenCause::Failures => cfg.open_ms,
            OpenCause::RateLimited => retry_after_ms
                .unwrap_or(cfg.rate_limit_ms)
                .min(cfg.retry_after_max_ms),
        };
        self.state = BreakerState::Open;
        self.cause = cause;
        self.open_until_ms = now_ms.saturating_add(cooldown.max(1));
        self.consecutive_failures = 0;
        self.probes_admitted = 0;
        self.probes_succeeded = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::health::outcome::FailureKind;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const CFG: BreakerConfig = BreakerConfig {
        failure_threshold: 5,
        half_open_probes: 3,
        open_ms: 30_000,
        rate_limit_ms: 60_000,
        retry_after_max_ms: 300_000,
        probe_stale_ms: 120_000,
    };
    const FAIL: Outcome = Outcome::EndpointFailure(FailureKind::Status(503));

    #[test]
    fn opens_after_threshold_consecutive_failures() {
        let mut b = Breaker::default();
        for _ in 0..4 {
            b.record(&FAIL, None, 1_000, &CFG);
        }
        b.record(&Outcome::Success, None, 1_000, &CFG); // resets the streak
        for _ in 0..4 {
            b.record(&FAIL, None, 1_000, &CFG);
            assert_eq!(b.state, BreakerState::Closed);
        }
        assert!(b.record(&FAIL, None, 1_000, &CFG));
        assert_eq!(b.state, BreakerState::Open);
        assert_eq!(b.open_until_ms, 31_000);
        assert_eq!(
            b.peek(30_999, &CFG),
            Admission::Rejected {
                retry_at_ms: 31_000,
                rate_limited: false
            }
        );
        assert_eq!(b.state_at(31_000), BreakerState::HalfOpen);
    }

    #[test]
    fn rate_limit_opens_at_once_for_retry_after_capped() {
        let mut b = Breaker::default();
        b.record(
            &Outcome::RateLimited {
                retry_after_ms: Some(2_000),
            },
            None,
            0,
            &CFG,
        );
        assert_eq!(
            (b.state, b.open_until_ms, b.cause),
            (BreakerState::Open, 2_000, OpenCause::RateLimited)
        );
        let mut b = Breaker::default();
        b.record(
            &Outcome::RateLimited {
                retry_after_ms: None,
            },
            None,
            0,
            &CFG,
        );
        assert_eq!(b.open_until_ms, 60_000);
        let mut b = Breaker::default();
        b.record(
            &Outcome::RateLimited {
                retry_after_ms: Some(86_400_000),
            },
            None,
            0,
            &CFG,
        );
        assert_eq!(b.open_until_ms, 300_000);
    }

    #[test]
    fn half_open_admits_exactly_n_probes_and_closes_when_all_succeed() {
        let mut b = Breaker::default();
        for _ in 0..5 {
            b.record(&FAIL, None, 0, &CFG);
        }
        let mut epochs = Vec::new();
        for _ in 0..10 {
            if let Admission::Probe { epoch } = b.admit(30_000, &CFG) {
                epochs.push(epoch);
            }
        }
        assert_eq!(epochs.len(), 3);
        let epoch = epochs[0];
        // A straggler from the closed era does not count as a probe.
        b.record(&Outcome::Success, None, 30_001, &CFG);
        assert_eq!(b.probes_succeeded, 0);
        b.record(&Outcome::Success, Some(epoch), 30_001, &CFG);
        b.record(&Outcome::Success, Some(epoch), 30_001, &CFG);
        assert_eq!(b.state, BreakerState::HalfOpen);
        assert!(b.record(&Outcome::Success, Some(epoch), 30_002, &CFG));
        assert_eq!(b.state, BreakerState::Closed);
        assert_eq!(b.admit(30_003, &CFG), Admission::Normal);
    }

    #[test]
    fn failing_probe_reopens_with_cooldown_reset() {
        let mut b = Breaker::default();
        b.record(
            &Outcome::RateLimited {
                retry_after_ms: Some(1_000),
            },
            None,
            0,
            &CFG,
        );
        let Admission::Probe { epoch } = b.admit(1_000, &CFG) else {
            panic!("expected a probe")
        };
        b.record(&Outcome::Success, Some(epoch), 1_100, &CFG);
        b.record(
            &Outcome::RateLimited {
                retry_after_ms: None,
            },
            Some(epoch),
            1_200,
            &CFG,
        );
        assert_eq!((b.state, b.open_until_ms), (BreakerState::Open, 61_200));
        // A late probe result of the old epoch changes nothing.
        let Admission::Probe { epoch: e2 } = b.admit(61_200, &CFG) else {
            panic!("expected a probe")
        };
        assert_ne!(e2, epoch);
        assert!(!b.record(&FAIL, Some(epoch), 61_300, &CFG));
        assert_eq!(b.state, BreakerState::HalfOpen);
    }

    #[test]
    fn lost_probes_are_reclaimed_and_cancelled_probes_release_their_slot() {
        let mut b = Breaker::default();
        b.record(
            &Outcome::RateLimited {
                retry_after_ms: Some(10),
            },
            None,
            0,
            &CFG,
        );
        for _ in 0..3 {
            assert!(matches!(b.admit(10, &CFG), Admission::Probe { .. }));
        }
        assert!(matches!(b.admit(11, &CFG), Admission::Rejected { .. }));
        b.record(&Outcome::Cancelled, Some(b.epoch), 12, &CFG);
        assert!(matches!(b.admit(13, &CFG), Admission::Probe { .. }));
        assert!(matches!(b.admit(14, &CFG), Admission::Rejected { .. }));
        assert!(matches!(
            b.admit(13 + 120_000, &CFG),
            Admission::Probe { .. }
        ));
    }

    /// Found by the `scheduler` fuzz target: with one probe slot, a probe reclaimed as stale
    /// reported `Cancelled` late, gave its slot back a second time, and a second probe was
    /// admitted while the replacement probe was still in flight.
    #[test]
    fn late_report_of_a_reclaimed_probe_frees_no_slot() {
        let cfg = BreakerConfig {
            half_open_probes: 1,
            ..CFG
        };
        let mut b = Breaker::default();
        b.record(
            &FAIL,
            None,
            0,
            &BreakerConfig {
                failure_threshold: 1,
                ..cfg
            },
        );
        let Admission::Probe { epoch: stale } = b.admit(40_000, &cfg) else {
            panic!("expected a probe")
        };
        assert!(matches!(b.admit(40_001, &cfg), Admission::Rejected { .. }));
        // The first probe never reports within probe_stale_ms: its slot is reclaimed.
        let t = 40_000 + cfg.probe_stale_ms;
        let Admission::Probe { epoch: fresh } = b.admit(t, &cfg) else {
            panic!("expected the reclaimed slot")
        };
        // Then the reclaimed probe reports after all: nothing changes.
        assert!(!b.record(&Outcome::Cancelled, Some(stale), t + 1, &cfg));
        assert!(!b.record(&FAIL, Some(stale), t + 1, &cfg));
        assert_eq!(b.state, BreakerState::HalfOpen);
        assert!(
            matches!(b.admit(t + 2, &cfg), Admission::Rejected { .. }),
            "a second probe while the fresh one is in flight: {b:?}"
        );
        // The fresh probe's own report still counts.
        assert!(b.record(&Outcome::Success, Some(fresh), t + 3, &cfg));
        assert_eq!(b.state, BreakerState::Closed);
    }

    #[test]
    fn dead_keys_and_client_errors_do_not_trip_a_closed_breaker() {
        let mut b = Breaker::default();
        for _ in 0..50 {
            b.record(&Outcome::DeadKey, None, 0, &CFG);
            b.record(&Outcome::ClientError, None, 0, &CFG);
        }
        assert_eq!(b.state, BreakerState::Closed);
    }
}
