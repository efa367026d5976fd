//! The scheduler: which endpoint serves this request, and what an attempt's outcome teaches us.
//!
//! Everything here is host-independent. The filter reads the host clock once per callback and
//! passes `now_ms`; shared state (per-endpoint statistics, breakers, the affinity table, the
//! retry budget) is reached only through the [`Store`] trait, whose compare-and-swap makes the
//! same code correct across Envoy worker threads.

pub mod affinity;
pub mod api;
pub mod breaker;
pub mod budget;
pub mod codec;
pub mod config;
pub mod engine_load;
pub mod ewma;
pub mod flow;
pub mod hash;
pub mod headers;
pub mod json_scan;
pub mod models;
pub mod multipart;
pub mod outcome;
pub mod overdue;
pub mod payoff;
pub mod pin_cookie;
pub mod placement;
pub mod quota;
pub mod reply;
pub mod request;
pub mod responses;
pub mod saturation;
pub mod score;
pub mod scrape;
pub mod select;
pub mod signals;
pub mod slowness;
pub mod state;
pub mod store;
pub mod text;
pub mod usage;

pub use affinity::Affinity;
pub use breaker::{Breaker, BreakerState};
pub use budget::RetryBudget;
pub use config::{Config, ConfigError, EndpointConfig};
pub use flow::{Flow, Step};
pub use outcome::{classify, Outcome};
pub use reply::{RejectReason, Reply};
pub use request::{ChatRequest, RequestError, SessionSource};
pub use select::{AffinityResult, Decision, Exclusions, NoEndpoint, Pick, Reason, Scheduler};
pub use state::EndpointState;
pub use store::{CasMismatch, MemStore, Store};
pub use usage::{Usage, UsageScan};
