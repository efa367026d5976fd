#![cfg(not(target_arch = "wasm32"))]
//! Tests through a real Envoy (1.40, from `.venv` or `ENVOY_BIN`) with the built module
//! (`target/wasm32-wasip1/release/computeflux.wasm`) and real upstream servers on loopback.
//!
//! One test binary for these files (one link instead of one per file: see CONTRIBUTING.md);
//! `tests/repo/layout.rs` checks that every file here is declared below.

#[path = "../deploy_support/mod.rs"]
mod deploy_support;
#[path = "../support/mod.rs"]
mod support;

mod bad_config;
mod contention;
mod data_parallel;
mod fairness;
mod filter;
mod floor;
mod harness_selftest;
mod hostile;
mod key_pool;
mod lifecycle;
mod mock_engine;
mod payoff;
mod pin_break;
mod pin_paid;
mod pools;
mod prefix;
mod probes;
mod quota;
mod relief;
mod reload;
mod reload_envoy;
mod replicas;
mod resilience;
mod saturation;
mod scrape;
mod sdk;
mod secrets;
mod session_keys;
mod slow_replicas;
mod surface;
mod trust;
mod trust_followups;
mod trust_keys;
mod trust_shared_keys;
mod usage;
