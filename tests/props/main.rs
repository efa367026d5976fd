#![cfg(not(target_arch = "wasm32"))]
//! Property tests of the pure core (proptest), natively.
//!
//! One test binary for these files (one link instead of one per file: see CONTRIBUTING.md);
//! `tests/repo/layout.rs` checks that every file here is declared below.

mod engine_load_props;
mod error_text_props;
mod placement_props;
mod scheduler_props;
mod slowness_props;
mod surface_props;
