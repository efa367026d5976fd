//! Judging endpoints: the verdicts kept per endpoint in its record, each with the rule that
//! decides it.
//!
//! - `slowness`: slow *for the work it was given*, against its peers (degraded);
//! - `saturation`: full by the engine's own scraped queue and KV cache;
//! - `payoff`: how much of a pinned turn's prompt its endpoint really had cached.
//!
//! Gathered for one decision by `select::signals`.

pub mod payoff;
pub mod saturation;
pub mod slowness;
