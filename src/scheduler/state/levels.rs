//! Levels that every replica reads alike: a measured ratio rounded up to the nearest level
//! `2^(-k·step)`, so that small differences between replicas' measurements (each sees its own
//! share of the answers) change nothing. Placement weighs endpoints' health by these levels and
//! quota weighs keys' stated limits by them; both must give the same number on every worker,
//! process and machine, hence computed by repeated multiplication, not by a logarithm.

/// `h ∈ (0, 1]` rounded up to the nearest level `2^(-k·step)` at or above it, so that
/// `(2^-step, 1]` all reads as 1: a dead band in which small differences between replicas'
/// measurements change nothing. `step = 0` keeps `h`. Levels are computed by repeated
/// multiplication from 1, so the same inputs give the same level on every target.
pub fn quantize(h: f64, step: f64) -> f64 {
    if h.is_nan() || h <= 0.0 {
        return 0.0;
    }
    let h = h.min(1.0);
    if step <= 0.0 {
        return h;
    }
    // The top level without the `powf` (the common case: every endpoint succeeding more than
    // half the time; the loop below would return 1 at its first round).
    if h >= 1.0 && !step.is_nan() {
        return 1.0;
    }
    let ratio = 0.5f64.powf(step);
    let mut level = 1.0;
    // Health is at least 1e-2 / latency factor in practice: this ends within a few rounds;
    // the bound only guards against a degenerate step.
    for _ in 0..256 {
        let next = level * ratio;
        if h > next {
            return level;
        }
        level = next;
    }
    level
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantize_levels() {
        assert_eq!(quantize(1.0, 1.0), 1.0);
        assert_eq!(quantize(0.51, 1.0), 1.0);
        assert_eq!(quantize(0.5, 1.0), 0.5);
        assert_eq!(quantize(0.49, 1.0), 0.5);
        assert_eq!(quantize(0.25, 1.0), 0.25);
        assert_eq!(quantize(0.2, 1.0), 0.25);
        assert_eq!(quantize(0.7, 0.0), 0.7);
        assert_eq!(quantize(f64::NAN, 1.0), 0.0);
        assert_eq!(quantize(3.0, 1.0), 1.0);
        // Half-halvings: levels 1, 0.707, 0.5, ...
        assert_eq!(quantize(0.6, 0.5), 0.5f64.powf(0.5));
        assert_eq!(quantize(0.8, 0.5), 1.0);
    }
}
