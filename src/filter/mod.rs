//! The proxy-wasm glue: the only code that talks to Envoy.
//!
//! It translates Envoy callbacks into calls on the pure [`crate::scheduler`] and back:
//! - [`root`]: configuration (validated, refused with one log line per problem), metrics,
//!   the periodic gauge refresh;
//! - [`plugin`]: what every request of a VM shares (configuration, metric ids) and the gauge
//!   refresh, apart so that `root`, `http` and `observe` do not import each other;
//! - [`http`]: Envoy's per-request callbacks, translated into calls on the request lifecycle
//!   ([`crate::scheduler::flow::Flow`]), whose steps it performs;
//! - [`parked`], [`admit`]: requests paused for admission, and the root timer's admission
//!   round that routes and resumes them;
//! - [`observe`]: what the lifecycle reports, as metrics and log lines;
//! - [`scrape`]: the engines' own `/metrics`, scraped from the root context's timer;
//! - [`pools`]: the hosts of a pool's cluster, learned from answers and discovery calls;
//! - [`shared`]: the scheduler's `Store` over Envoy shared data;
//! - [`host`]: every host call, none of which can panic (`tests/repo/host_boundary.rs` keeps it
//!   the only one).

mod admission_metrics;
mod admit;
mod host;
mod http;
mod metrics;
mod observe;
mod parked;
mod plugin;
mod pools;
mod root;
mod scrape;
mod shared;

use proxy_wasm::types::LogLevel;

proxy_wasm::main! {{
    // Host calls other than logging are not allowed here; the level is aligned with Envoy's
    // in on_vm_start. Our logger and panic hook, not the SDK's (both unwrap the host status).
    host::init_logging(LogLevel::Info);
    std::panic::set_hook(Box::new(|info| {
        host::log(LogLevel::Critical, &format!("computeflux: panic: {info}"));
    }));
    proxy_wasm::set_root_context(|_| -> Box<dyn proxy_wasm::traits::RootContext> { Box::new(root::Root::default()) });
}}
