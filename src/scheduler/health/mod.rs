//! What an attempt's outcome says about its endpoint (`outcome`), and the two brakes that
//! follow from it: the per-endpoint circuit breaker (`breaker`) and the fleet-wide retry budget
//! (`budget`).
//!
//! May import `time` (the reset hints' formats) and `state` (the codec).

pub mod blame;
pub mod breaker;
pub mod budget;
pub mod outcome;
