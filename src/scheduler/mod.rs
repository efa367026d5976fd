//! The scheduler: which endpoint serves this request, and what an attempt's outcome teaches us.
//!
//! Everything here is host-independent. The filter reads the host clock once per callback and
//! passes `now_ms`; shared state (per-endpoint statistics, breakers, the affinity table, the
//! retry budget) is reached only through the [`Store`] trait, whose compare-and-swap makes the
//! same code correct across Envoy worker threads.
//!
//! The code lives in rooms, each named after what it is. A room imports only the rooms below it
//! in this table (`tests/repo/room_imports.rs` keeps it so, and finds any import cycle between files):
//!
//! | room        | what it is                                                      | may import                               |
//! |-------------|-----------------------------------------------------------------|------------------------------------------|
//! | [`time`]    | the time formats upstreams speak: HTTP-date, Go duration, RFC 3339 | —                                     |
//! | [`state`]   | bytes every worker agrees on: the `Store`, the codec, fixed hashes | —                                     |
//! | [`config`]  | the plugin configuration, validated                             | state                                    |
//! | [`wire`]    | requests and answers as bytes: parse, scan, write; no policy     | config, state                            |
//! | [`health`]  | what an outcome means, breakers, the retry budget               | time, state, config                      |
//! | [`routing`] | the decision: endpoint table, signals, placement, pick, finish  | time, state, config, wire, health        |
//! | [`admission`] | who waits when the fleet is full: fairness id, priority, the queue | time, state, config, wire, health, routing |
//! | [`flow`]    | one request's lifecycle, from headers to the last answer byte   | time, state, config, wire, health, routing, admission |

pub mod admission;
pub mod config;
pub mod flow;
pub mod health;
pub mod routing;
pub mod state;
pub mod time;
pub mod wire;

pub use config::{Config, ConfigError, EndpointConfig};
pub use flow::{Flow, Step};
pub use health::breaker::{Breaker, BreakerState};
pub use health::budget::RetryBudget;
pub use health::outcome::{classify, Outcome};
pub use routing::pins::affinity::Affinity;
pub use routing::select::{
    AffinityResult, Decision, Exclusions, NoEndpoint, Pick, Prefix, Reason, Scheduler,
};
pub use routing::table::EndpointState;
pub use state::store::{CasMismatch, MemStore, Store};
pub use wire::reply::{RejectReason, Reply};
pub use wire::request::{ChatRequest, RequestError};
pub use wire::session::SessionSource;
pub use wire::usage::{Usage, UsageScan};
