//! Requests and answers as bytes: what a request is (its API, body format, model and session:
//! `api`, `request`, `prefix`, `multipart`, `json_scan`, `models`), what an answer says (`usage`,
//! `headers`), and the replies the gateway writes itself (`reply`, `text`).
//!
//! Parsing and writing only, no routing policy: which endpoint, and what an outcome means, is
//! decided elsewhere. May import `config` and `state` (the session hash).

pub mod api;
pub mod engine_load;
pub mod headers;
pub mod json_scan;
pub mod models;
pub mod multipart;
pub mod path;
pub mod prefix;
pub mod prompt_size;
pub mod reply;
pub mod request;
pub mod session;
pub mod text;
pub mod usage;

/// Longest accepted `model`, in any body format (real model ids are far shorter). Here, not in
/// `request`, so that the form parser (`multipart`) and `request` need not import each other.
pub const MAX_MODEL_BYTES: usize = 256;
