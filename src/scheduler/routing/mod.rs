//! The decision: which endpoint serves an attempt, and what its outcome changes.
//!
//! - `table`: the per-endpoint record every worker shares (one `Store` key);
//! - the signals kept in it or beside it: `ewma` latency, `quota`, `payoff`,
//!   session `affinity`, the `pin_cookie`, `responses` (Responses API follow-ups);
//! - `score` and `placement` (weighted rendezvous), and `select`: exclusions → pin → placement →
//!   pick, then the finishing write.
//!
//! May import `time`, `state`, `config`, `wire` (usage, headers) and `health`.

pub mod affinity;
pub mod capacity;
pub mod ewma;
pub mod in_flight;
pub mod payoff;
pub mod pin_cookie;
pub mod placement;
pub mod pools;
pub mod quota;
pub mod responses;
pub mod saturation;
pub mod score;
pub mod scrape;
pub mod scrape_plan;
pub mod select;
pub mod sessions;
pub mod signals;
pub mod slowness;
pub mod table;
