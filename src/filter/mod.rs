//! The proxy-wasm glue: the only code that talks to Envoy.
//!
//! It translates Envoy callbacks into calls on the pure [`crate::scheduler`] and back:
//! - [`root`]: configuration (validated, refused with one log line per problem), metrics,
//!   the periodic gauge refresh;
//! - [`http`]: the request path (buffer the body, read `model`, derive the session, pick,
//!   write the routing header) and the response path (classify, record, fail over);
//! - [`shared`]: the scheduler's `Store` over Envoy shared data;
//! - [`host`]: host calls wrapped so that no unexpected host status can panic the VM.

mod host;
mod http;
mod metrics;
mod root;
mod shared;

use proxy_wasm::types::LogLevel;

proxy_wasm::main! {{
    // Host calls other than logging are not allowed here; the level is aligned with Envoy's
    // in on_vm_start. The SDK installs its own panic hook (which can itself panic): replace it.
    proxy_wasm::set_log_level(LogLevel::Info);
    std::panic::set_hook(Box::new(|info| {
        host::log(LogLevel::Critical, &format!("computeflux: panic: {info}"));
    }));
    proxy_wasm::set_root_context(|_| -> Box<dyn proxy_wasm::traits::RootContext> { Box::new(root::Root::default()) });
}}
