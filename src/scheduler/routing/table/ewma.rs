//! Exponentially weighted moving averages, and how idle estimates forget.
//!
//! Latency: `ema = (1-α)·ema + α·sample`, the first sample initialising it. A plain average
//! is poisoned by one 10 s timeout for the next hundred requests; the EWMA forgets it at a rate
//! of (1-α) per sample.
//!
//! Idle endpoints: an endpoint that lost traffic because it looked slow or failing stops
//! producing samples, so its estimate would stay poisoned forever. We therefore let the
//! *penalty* an estimate implies fade with idle time: `fade(idle) = 1 / (1 + idle/decay)`
//! (hyperbolic, cheap on wasm, 0.5 after one `score::STATS_DECAY_MS`). The scorer multiplies the
//! excess latency factor and the missing success rate by it, so a long-idle endpoint drifts back
//! to neutral and gets a fresh look; one bad sample then pushes it away again.

/// Gain of the latency's mean deviation (`dev = (1-β)·dev + β·|sample − estimate|`), TCP's β
/// (RFC 6298).
pub const DEVIATION_ALPHA: f64 = 0.25;

/// Latencies below this are treated as equal: a few milliseconds of difference are network
/// noise, not a property of an inference endpoint (and would make latency ratios jump).
/// Here, beside the estimate, so that the table's records (`overdue`) and the scorer can both
/// use it without importing each other.
pub const LATENCY_FLOOR_MS: f64 = 10.0;

/// One EWMA step. `prev = None` (no sample yet) initialises with `sample`.
pub fn update(prev: Option<f64>, sample: f64, alpha: f64) -> f64 {
    match prev {
        None => sample,
        Some(ema) => (1.0 - alpha) * ema + alpha * sample,
    }
}

/// How much of a penalty survives `idle_ms` without new samples: 1 when fresh, → 0 when idle.
pub fn fade(idle_ms: u64, decay_ms: u64) -> f64 {
    1.0 / (1.0 + idle_ms as f64 / decay_ms.max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// The design article's worked example.
    #[test]
    fn outlier_is_forgotten() {
        let samples = [100.0, 200.0, 100.0, 200.0, 10_000.0, 100.0];
        let plain: f64 = samples.iter().sum::<f64>() / samples.len() as f64;
        assert!((plain - 1783.33).abs() < 0.01);
        let mut ema = None;
        let mut trace = Vec::new();
        for s in samples {
            ema = Some(update(ema, s, 0.3));
            trace.push(ema.unwrap_or_default());
        }
        // 100 → 130 → 121 → 144.7 → 3101.29 → 2200.903
        let expect = [100.0, 130.0, 121.0, 144.7, 3101.29, 2200.903];
        for (got, want) in trace.iter().zip(expect) {
            assert!((got - want).abs() < 1e-6, "{trace:?}");
        }
        // "roughly 3.1 s" right after the outlier
        assert!((trace[4] - 3100.0).abs() < 5.0);
        // two more normal samples bring it below the polluted plain average
        let after_two = update(Some(trace[5]), 100.0, 0.3);
        assert!((after_two - 1570.6321).abs() < 1e-3);
        assert!(after_two < plain);
        assert!(trace[5] > plain, "one normal sample is not yet enough");
    }

    #[test]
    fn fade_halves_after_one_decay_period() {
        assert_eq!(fade(0, 60_000), 1.0);
        assert_eq!(fade(60_000, 60_000), 0.5);
        assert!(fade(6_000_000, 60_000) < 0.01);
    }
}
