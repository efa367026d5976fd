//! ComputeFlux sticky balancer: an Envoy proxy-wasm HTTP filter that routes OpenAI-style LLM
//! inference requests to the endpoint most likely to hold the conversation's KV cache.
//!
//! The crate has two halves:
//! - [`scheduler`]: the pure decision core (affinity, EWMA latency, cold start, scoring, circuit
//!   breaker, exclusions, outcome classification, request parsing). No host calls, no clock
//!   reads, no global state: time comes in as `now_ms`, shared state through [`scheduler::Store`].
//! - `filter` (feature `filter`, wasm32 only): the thin proxy-wasm glue that turns Envoy
//!   callbacks and shared data into calls on the scheduler.

// Text is never cut at a byte offset (clippy.toml lists the panicking methods): a cut inside a
// multi-byte character panicked once and killed the wasm VM.
#![deny(clippy::disallowed_methods)]

pub mod scheduler;

#[cfg(all(feature = "filter", target_arch = "wasm32"))]
mod filter;
