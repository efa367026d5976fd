//! The lifecycle's session special cases, apart from the main path in `flow/mod.rs`:
//! - the pin cookie (`routing::pins::pin_cookie`): read from the request, where a replica last
//!   placed the session; set on a successful answer unless the request carried it fresh;
//! - the Responses API (`routing::select::responses`): a follow-up goes to the holder of its previous
//!   response, and a stored answer's id is learned from its first bytes.

use super::{Flow, Holder, Observer, Step};
use crate::scheduler::config::Config;
use crate::scheduler::health::outcome::Outcome;
use crate::scheduler::routing::pins::pin_cookie::{self, Found};
use crate::scheduler::routing::select::responses::{self, AnswerFormat, HolderUnavailable, IdScan};
use crate::scheduler::routing::select::{AffinityResult, Decision, NoEndpoint, Scheduler};
use crate::scheduler::wire::headers::HeaderSource;
use crate::scheduler::wire::reply::{RejectReason, Reply};

impl Flow {
    /// The endpoint the request's pin cookie names for its session (`pin_cookie`), if the
    /// filter signed that cookie for this session and it has not expired; any other pin
    /// cookie of the session is ignored and reported.
    pub(super) fn read_pin_cookie(&mut self, cfg: &Config, obs: &mut dyn Observer, now_ms: u64) {
        if !cfg.pin_cookie {
            return;
        }
        if let Some(session) = self.session {
            let cookies = self.headers.values("cookie");
            self.pin_hint = match pin_cookie::find(&cfg.pin_cookie_secret, cookies, session, now_ms)
            {
                Found::Endpoint { id, expires_ms } => {
                    let left = expires_ms.saturating_sub(now_ms);
                    self.pin_hint_fresh = left >= cfg.affinity_ttl_ms / 2;
                    Some(id)
                }
                Found::Ignored(why) => {
                    obs.pin_cookie_ignored(why);
                    None
                }
                Found::Absent => None,
            };
        }
    }

    /// Every successful answer of a session tells the client where the session now is, so
    /// that every replica follows it (see `pin_cookie`): unless the request already carried a
    /// cookie naming this endpoint with at least half its lifetime left (it is renewed past
    /// that, as a pin is by each success), or it followed this replica's own pin to the
    /// session's home without any cookie (a client that keeps none). A session's home is not fixed: replicas learn the
    /// engines' slots (which weigh the rendezvous order) and their saturation at their own
    /// scrapes, a pool's hosts at their own moments, so a replica that never saw a session
    /// could place its next turn elsewhere than the one that served it. Not a Responses
    /// follow-up sent to the holder of its previous response: the holder decides where it
    /// goes, and its session key (the previous response's id) is never seen again.
    pub(super) fn pin_cookie_for(
        &self,
        s: &Scheduler<'_>,
        decision: &Decision,
        now_ms: u64,
    ) -> Option<String> {
        let carried = self.pin_hint == Some(decision.ticket.endpoint_id) && self.pin_hint_fresh;
        // A pin of this replica's own followed while the request brought no cookie: the client
        // did not keep the one set when the pin was made (or another of its sessions took the
        // cookie's name): signing again is wasted, except where the place is not the home.
        let cookieless_hit = self.pin_hint.is_none() && decision.affinity == AffinityResult::Hit;
        let pooled = || {
            s.cfg
                .endpoints
                .get(decision.endpoint)
                .and_then(|e| e.pool.as_ref())
                .is_some_and(|p| p.address.is_some())
        };
        match self.session {
            Some(session)
                if s.cfg.pin_cookie
                    && !self.holder_pinned
                    && decision.ticket.pin_on_success
                    && !carried
                    && (!cookieless_hit
                        || Some(decision.endpoint) != decision.home
                        || pooled()) =>
            {
                Some(pin_cookie::set_cookie(
                    &s.cfg.pin_cookie_secret,
                    session,
                    decision.ticket.endpoint_id,
                    now_ms,
                    s.cfg.affinity_ttl_ms,
                ))
            }
            _ => None,
        }
    }

    /// A Responses API request: remembers to learn its answer's id when it will be stored, and
    /// sends a follow-up (`previous_response_id`) to the endpoint holding the previous response.
    /// If that endpoint cannot take it, the request is refused — unless it carries its whole
    /// input, then it goes anywhere without `previous_response_id`.
    pub(super) fn follow_up(
        &mut self,
        s: &Scheduler<'_>,
        obs: &mut dyn Observer,
        now_ms: u64,
    ) -> Option<Step> {
        let f = responses::parse_follow_up(&self.body);
        self.learn_id = f.store;
        let prev = f.previous_response_id?;
        let holder = responses::holder(s, self.tenant.as_deref(), &prev, now_ms)?;
        match responses::check_holder(s, holder, self.model.as_deref(), &self.exclusions, now_ms) {
            Ok(_) => {
                self.holder = Some(Holder {
                    endpoint_id: holder,
                    previous_response_id: prev.clone(),
                    whole_input: f.whole_input,
                    own_session: self.session,
                });
                self.session = Some(responses::response_key(self.tenant.as_deref(), &prev));
                self.holder_pinned = true;
                None
            }
            Err(_) if f.whole_input => {
                self.drop_previous_response_id();
                None
            }
            Err(e) => Some(self.refuse_follow_up(s, obs, &e, &prev, now_ms)),
        }
    }

    /// The body without `previous_response_id`; the first attempt forwards it (the glue
    /// replaces Envoy's buffered body with [`Flow::rewritten_body`]).
    fn drop_previous_response_id(&mut self) {
        if let Some(body) = responses::without_previous_response_id(&self.body) {
            // The instructions' places are in the body as sent: their key first.
            self.prefix_key();
            self.body = body;
            self.body_rewritten = true;
        }
    }

    /// The body the first attempt must forward instead of the one Envoy buffered, if the flow
    /// changed it (a whole-input follow-up placed away from its holder), and whether the
    /// request declared a `content-length` (then the host sets it to the new length; a chunked
    /// request stays chunked). The host replaces the buffered body before it performs
    /// [`Step::Route`].
    pub fn rewritten_body(&self) -> Option<(&[u8], bool)> {
        let declared = self.headers.values("content-length").next().is_some();
        self.body_rewritten
            .then_some((self.body.as_slice(), declared))
    }

    /// The holder's pick failed (its breaker turned, or it already failed this request): a
    /// whole-input follow-up goes anywhere without `previous_response_id`; any other gets the
    /// retryable `503 previous_response_unavailable` (or the 404 if the holder is gone).
    pub(super) fn holder_unavailable(
        &mut self,
        s: &Scheduler<'_>,
        obs: &mut dyn Observer,
        no: NoEndpoint,
        now_ms: u64,
    ) -> Step {
        let Some(h) = self.holder.take() else {
            return self.no_endpoint(obs, no, now_ms);
        };
        if h.whole_input {
            self.holder_pinned = false;
            self.session = h.own_session;
            self.drop_previous_response_id();
            return self.first_attempt(s, obs, now_ms);
        }
        let model = self.model.as_deref();
        let e = match responses::check_holder(s, h.endpoint_id, model, &self.exclusions, now_ms) {
            Err(e) => e,
            Ok(i) => {
                let name = s
                    .cfg
                    .endpoints
                    .get(i)
                    .map_or_else(String::new, |e| e.name.clone());
                match no {
                    NoEndpoint::CoolingDown {
                        retry_at_ms,
                        all_rate_limited,
                    } => HolderUnavailable::CoolingDown {
                        name,
                        retry_at_ms,
                        rate_limited: all_rate_limited,
                    },
                    _ => HolderUnavailable::FailedInRequest { name },
                }
            }
        };
        self.refuse_follow_up(s, obs, &e, &h.previous_response_id, now_ms)
    }

    /// The OpenAI-shaped refusal of a follow-up whose holder cannot take it.
    fn refuse_follow_up(
        &mut self,
        s: &Scheduler<'_>,
        obs: &mut dyn Observer,
        e: &HolderUnavailable,
        prev: &str,
        now_ms: u64,
    ) -> Step {
        let reason = match e.status() {
            404 => RejectReason::PreviousResponseNotFound,
            _ => RejectReason::PreviousResponseUnavailable,
        };
        let message = e.message_naming(prev, now_ms, s.cfg.expose_headers);
        let mut reply = Reply::new(e.status(), reason, &message);
        if let Some(secs) = e.retry_after_s(now_ms) {
            reply = reply.retry_after(secs);
        }
        self.reply(obs, reply)
    }

    /// Whether the relayed answer's body chunks should be passed to [`Flow::on_answer_chunk`].
    pub fn reads_answer(&self) -> bool {
        self.id_scan.is_some()
    }

    /// A chunk of the answer the client gets (relayed, or a failover call's whole answer), as
    /// it passes; never held back. `end`: the answer is complete.
    pub fn on_answer_chunk(&mut self, s: &Scheduler<'_>, chunk: &[u8], end: bool, now_ms: u64) {
        let Some(scan) = self.id_scan.as_mut() else {
            return;
        };
        let found = match scan.feed(chunk) {
            crate::scheduler::wire::json_scan::Scan::Found(id) => Some(id),
            crate::scheduler::wire::json_scan::Scan::Absent => None,
            crate::scheduler::wire::json_scan::Scan::NeedMore if end => scan.finish(),
            crate::scheduler::wire::json_scan::Scan::NeedMore => return,
        };
        self.id_scan = None;
        let holder = self
            .served_by
            .and_then(|i| s.cfg.endpoints.get(i))
            .map(|e| e.id);
        if let (Some(id), Some(holder)) = (found, holder) {
            responses::remember(s, self.tenant.as_deref(), &id, holder, now_ms);
        }
    }

    /// An answer's headers: scan its body for the response id if it is a success to learn from.
    pub(super) fn expect_answer<H: HeaderSource + ?Sized>(
        &mut self,
        outcome: &Outcome,
        headers: &H,
    ) {
        self.id_scan = match (self.learn_id, outcome) {
            (true, Outcome::Success) => headers
                .header_str("content-type")
                .and_then(|ct| AnswerFormat::from_content_type(&ct))
                .map(IdScan::new),
            _ => None,
        };
    }
}
