//! Where the filter places a session, computed the way it does: placement is a pure function of
//! the configuration, the session and the endpoints' weights (see `src/scheduler/routing/placement/mod.rs`),
//! so a test can choose sessions whose rendezvous order it knows in advance instead of relying on
//! whichever order a random session happens to get.

use computeflux::scheduler::routing::placement::order;
use computeflux::scheduler::state::hash::{endpoint_id, session_key};
use computeflux::scheduler::wire::request::parse_chat;
use computeflux::scheduler::wire::session::{derive_session, SessionHeaders};

/// The affinity key of a chat body sent without credentials or session header (its `user`, else
/// its fingerprint), as the filter derives it.
pub fn body_session(body: &str) -> u64 {
    let req = parse_chat(body.as_bytes()).unwrap();
    derive_session(None, SessionHeaders::default(), &req, body.as_bytes())
        .0
        .unwrap()
}

/// The affinity key of a request without credentials carrying `x-session-id: id`.
pub fn header_session(id: &str) -> u64 {
    session_key(b"", &[b"h:", id.as_bytes()].concat())
}

/// The rendezvous order of `session` over `(name, placement weight)` pairs, by name.
pub fn rendezvous_order<'a>(session: u64, weights: &[(&'a str, f64)]) -> Vec<&'a str> {
    let cands: Vec<(usize, u32, f64)> = weights
        .iter()
        .enumerate()
        .map(|(i, (name, w))| (i, endpoint_id(name), *w))
        .collect();
    order(session, &cands)
        .into_iter()
        .map(|i| weights[i].0)
        .collect()
}

/// Whether `session`'s order over `weights` starts with `prefix`.
pub fn starts_with(session: u64, weights: &[(&str, f64)], prefix: &[&str]) -> bool {
    rendezvous_order(session, weights).starts_with(prefix)
}
