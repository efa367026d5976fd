//! Expectations collected over a whole test, reported together at its end.
//!
//! Why: the routing tests measure several figures in phases (follow-up share, spread, behaviour
//! after a fault, after a restart). Stopping at the first failed expectation hides the others,
//! and a failing routing test is diagnosed from all of its figures at once. Every figure is
//! printed when it is checked; [`Checks::finish`] fails the test with the list of what failed.

/// Collected expectations. Must be finished: dropping it unfinished (outside a panic) panics,
/// so a forgotten [`Checks::finish`] cannot turn failures into a pass.
#[must_use = "call finish() to fail the test on unmet expectations"]
pub struct Checks {
    failures: Vec<String>,
    finished: bool,
}

impl Checks {
    pub fn new() -> Checks {
        Checks {
            failures: Vec::new(),
            finished: false,
        }
    }

    /// Records `what` (printed either way) as failed unless `ok`. Returns `ok`.
    pub fn expect(&mut self, ok: bool, what: impl Into<String>) -> bool {
        let what = what.into();
        eprintln!("[{}] {what}", if ok { "ok" } else { "FAILED" });
        if !ok {
            self.failures.push(what);
        }
        ok
    }

    /// Panics listing every failed expectation, if any.
    pub fn finish(mut self) {
        self.finished = true;
        if !self.failures.is_empty() {
            panic!(
                "{} expectation(s) failed:\n  - {}",
                self.failures.len(),
                self.failures.join("\n  - ")
            );
        }
    }
}

impl Default for Checks {
    fn default() -> Self {
        Checks::new()
    }
}

impl Drop for Checks {
    fn drop(&mut self) {
        if !self.finished && !std::thread::panicking() {
            panic!(
                "Checks dropped without finish(); unreported failures: {:?}",
                self.failures
            );
        }
    }
}
