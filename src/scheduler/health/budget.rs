//! The retry budget: failovers limited to a share of recent requests.
//!
//! Without it an outage multiplies load on the survivors: every request that hits the failing
//! endpoint is sent again elsewhere. Requests and retries are counted with exponential decay
//! (time constant [`WINDOW_MS`]); a retry is allowed while
//! `retries + 1 <= min_retries + percent/100 · requests`.

use crate::scheduler::state::codec::{Reader, Writer};

/// Time constant of the decayed counters.
pub const WINDOW_MS: f64 = 10_000.0;

#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RetryBudget {
    pub requests: f64,
    pub retries: f64,
    pub updated_ms: u64,
}

impl RetryBudget {
    fn decay(&mut self, now_ms: u64) {
        let dt = now_ms.saturating_sub(self.updated_ms) as f64;
        if dt > 0.0 {
            let k = (-dt / WINDOW_MS).exp();
            self.requests *= k;
            self.retries *= k;
            self.updated_ms = now_ms;
        }
    }

    pub fn on_request(&mut self, now_ms: u64) {
        self.decay(now_ms);
        self.requests += 1.0;
    }

    /// Takes a retry from the budget if one is left.
    pub fn try_retry(&mut self, now_ms: u64, percent: f64, min_retries: f64) -> bool {
        self.decay(now_ms);
        if self.retries + 1.0 <= min_retries + percent / 100.0 * self.requests {
            self.retries += 1.0;
            true
        } else {
            false
        }
    }

    pub fn encode(&self, w: &mut Writer) {
        w.f64(self.requests);
        w.f64(self.retries);
        w.u64(self.updated_ms);
    }

    pub fn decode(r: &mut Reader<'_>) -> Option<RetryBudget> {
        Some(RetryBudget {
            requests: r.f64()?.max(0.0),
            retries: r.f64()?.max(0.0),
            updated_ms: r.u64()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn retries_bounded_by_floor_plus_percent() {
        let mut b = RetryBudget::default();
        for _ in 0..100 {
            b.on_request(0);
        }
        let allowed = (0..1000).filter(|_| b.try_retry(0, 20.0, 10.0)).count();
        assert_eq!(allowed, 30); // 10 + 20% of 100
                                 // After a few windows the counters decay and retries are allowed again.
        assert!(b.try_retry(60_000, 20.0, 10.0));
    }
}
