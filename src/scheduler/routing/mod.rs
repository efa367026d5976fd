//! The decision: which endpoint serves an attempt, and what its outcome changes. Its rooms:
//!
//! - `quota`: leaving an API key before it answers 429;
//! - `scrape`: engines' `/metrics` — who scrapes (the lease), what was scraped, and its `plan`;
//! - `judge`: the verdicts kept per endpoint — slowness, saturation, affinity payoff;
//! - `table`: the per-endpoint record every worker shares (its codec, stored in groups of keys),
//!   holding those verdicts and the numbers beside them: `ewma` latency, `in_flight` counts;
//! - `placement`: weighted rendezvous over each endpoint's `score`, so that every replica places
//!   a session alike, and the `sessions` bound that spreads a busy prefix's home;
//! - `pins`: session `affinity` and the `pin_cookie`;
//! - `pools`: the hosts of one Envoy cluster as endpoints, learned as membership changes;
//! - `select`: one decision — what it knows of every candidate (`signals`, `capacity`), its
//!   steps (`choose`: board → pin verdict → walk → settle), Responses API holders
//!   (`responses`), and what an outcome changes (`finish`).
//!
//! A room imports only the rooms listed before it (checked by `tests/repo/room_imports.rs`).
//! May import `time`, `state`, `config`, `wire` (usage, headers) and `health`.

pub mod judge;
pub mod pins;
pub mod placement;
pub mod pools;
pub mod quota;
pub mod scrape;
pub mod select;
pub mod table;
