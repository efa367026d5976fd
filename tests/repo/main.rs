#![cfg(not(target_arch = "wasm32"))]
//! Checks of the repository itself: the documented configuration and metrics, deployment
//! files validated by Envoy, the import order of the rooms, memory bounds of the core.
//!
//! One test binary for these files (one link instead of one per file: see CONTRIBUTING.md);
//! `tests/repo/layout.rs` checks that every file here is declared below.

#[path = "../deploy_support/mod.rs"]
mod deploy_support;
#[path = "../support/mod.rs"]
mod support;

mod config_reference;
mod dashboard;
mod deploy;
mod host_boundary;
mod istio;
mod layout;
mod memory_bounds;
mod metric_labels;
mod oci_image;
mod room_imports;
