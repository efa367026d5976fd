//! Pins: where a session's earlier turns went.
//!
//! - `affinity`: session → the endpoint that last served it successfully, with an idle TTL;
//! - `pin_cookie`: a session's place carried by the client, for replicas that never saw it.
//!
//! A Responses API follow-up's holder is read by `select::responses`.

pub mod affinity;
pub mod pin_cookie;
