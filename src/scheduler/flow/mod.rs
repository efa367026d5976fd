//! One client request's life, from its headers to the end of its answer — host-independent.
//! (About 1 000 lines: one state machine, `Flow`, with the attempt bookkeeping that feeds the
//! work model; its session special cases are in `pins.rs`,
//! the answers it builds in `answer.rs`.)
//!
//! The top room: it may import every other room (`time`, `state`, `config`, `wire`, `health`,
//! `routing`), and none imports it.
//!
//! Why here and not in the filter: when to wait for the body, which endpoint takes each
//! attempt, when an answer ends its attempt, when to fail over and when to stop, and what the
//! client finally gets are the product. In wasm glue they could only be tested through Envoy;
//! here they run natively over [`crate::scheduler::state::store::MemStore`] (unit tests, simulations of many
//! workers). `src/filter/http.rs` only turns Envoy's callbacks into calls on [`Flow`] and
//! performs the [`Step`] each call returns.
//!
//! ```text
//! Start ─POST headers─▶ AwaitBody ─end of body / trailers─▶ Routed
//! Start ─other methods──────────────────────────────────▶ Routed
//! Routed ─success / client error─▶ Relaying ─end of answer, or on_log─▶ Done
//! Routed ─failure, failover allowed─▶ FailingOver ─call answer─▶ FailingOver (again) | Done
//! Routed ─failure, no failover─▶ Done (the failing answer is relayed)
//!   (never a failover for a request routed with a body the filter did not read: a pass-through
//!   upload cannot be replayed whole, and a truncated replay is worse than the upstream's 429)
//! a refused request, or no endpoint for the first attempt ─▶ Done (local reply)
//! ```
//!
//! Every attempt holds a move-only [`Ticket`], owned here and handed back exactly once:
//! - a failing answer (dead key, rate limit, endpoint failure) at its headers: the next pick
//!   must see it (breaker, exclusions), and its body is never relayed if a failover follows;
//! - a relayed answer (success, client error) when it ends, so a streamed generation counts as
//!   in flight for as long as it streams; its latency is still the time to its headers;
//! - a failover call when its answer arrives (the host delivers it whole);
//! - in `on_log`, whatever is left: an answer cut mid-stream (upstream reset or client gone)
//!   keeps the verdict of its headers — the filter cannot tell the two apart, and a cut is not
//!   held against the endpoint — and an attempt without an answer is `Cancelled`.
//!
//! That is one shared-data write for the pick and one for the finish per attempt (plus the
//! affinity bucket on a success or dead key), as when attempts were finished at the headers,
//! and one more at the first byte of a streamed affinity hit, which releases its overdue watch
//! (its latency sample is that byte; see `overdue`).
//!
//! "Exactly once" is the compiler's to check: `Scheduler::finish` takes the ticket by value,
//! and a ticket can be neither copied nor made outside the scheduler, so this does not build:
//!
//! ```compile_fail,E0382
//! use computeflux::scheduler::{Config, Exclusions, MemStore, Outcome, Pick, Scheduler};
//! let cfg = Config::from_json(br#"{"endpoints":[{"name":"a","cluster":"a"}]}"#).unwrap();
//! let store = MemStore::new();
//! let s = Scheduler::new(&cfg, &store);
//! let ex = Exclusions::default();
//! let pick = Pick { model: None, session: None, attempt: 1, exclusions: &ex, nonce: 0, body_bytes: 0 };
//! let d = s.pick(&pick, 0).unwrap();
//! s.finish(d.ticket, &Outcome::Success, 1, None, 1);
//! s.finish(d.ticket, &Outcome::Success, 1, None, 2); // use of moved value
//! ```

use crate::scheduler::config::{Config, ListModels};
use crate::scheduler::health::blame;
use crate::scheduler::health::outcome::{classify, FailureKind, Outcome};
use crate::scheduler::routing::judge::payoff;
use crate::scheduler::routing::judge::slowness;
use crate::scheduler::routing::pins::pin_cookie::Ignored;
use crate::scheduler::routing::quota::QuotaHint;
use crate::scheduler::routing::select::responses::{self, IdScan};
use crate::scheduler::routing::select::signals::{self, Served};
use crate::scheduler::routing::select::{
    AffinityResult, Decision, Exclusions, Finished, NoEndpoint, Pick, Prefix, Scheduler, Ticket,
};
use crate::scheduler::wire::api::{self, Api, BodyFormat, Handling};
use crate::scheduler::wire::headers::{rate_limit_hints, HeaderList, HeaderSource, Pairs};
use crate::scheduler::wire::models::{self, Merged, Retrieved};
use crate::scheduler::wire::prefix;
use crate::scheduler::wire::reply::Reply;
use crate::scheduler::wire::request::{parse_chat_with, RequestError};
use crate::scheduler::wire::session::{self, derive_session_with, SessionSource};
use crate::scheduler::wire::usage::{Framing, Usage, UsageScan};
use std::borrow::Cow;
use std::cell::Cell;

pub mod admit;
mod answer;
mod answers;
mod attempts;
mod pins;
pub use admit::{Admission, AdmissionOutcome};
pub use answer::Call;

pub const HEADER_ENDPOINT: &str = "x-computeflux-endpoint";
pub const HEADER_ATTEMPTS: &str = "x-computeflux-attempts";
pub const HEADER_AFFINITY: &str = "x-computeflux-affinity";

/// The largest failover answer the filter relays (8 MiB).
///
/// Envoy hands a failover call's answer to the filter only once it is complete (the ABI has
/// no streamed callout), so it cannot be streamed through: the filter copies it into the VM
/// and gives it back to Envoy as a local reply. A larger answer gets a
/// `502 failover_answer_too_large` instead: a wasm VM's memory never shrinks, so this bounds
/// what one answer can make each worker's VM grow. Envoy bounds the answer on its side too:
/// past the cluster's `per_connection_buffer_limit_bytes` (16 MiB in `envoy/envoy.yaml`) it
/// drains the rest and reports the call as failed without headers, which the filter can only
/// see as a reset. Keep that buffer above this limit.
pub const MAX_RELAYED_ANSWER_BYTES: usize = 8 * 1024 * 1024;

/// Set by Envoy's router on answers that came from an upstream; absent on Envoy's own replies
/// (connect failure, overflow, timeout), which the filter answers in the OpenAI shape.
pub const UPSTREAM_MARKER: &str = "x-envoy-upstream-service-time";

/// Where the request is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Before the request headers.
    Start,
    /// The headers are held while the body is buffered (POST).
    AwaitBody,
    /// Routed; waiting for the answer's headers.
    Routed,
    /// A failover call is in flight; the held answer must not reach the client.
    FailingOver,
    /// A routed 429 without reset hints is held at its headers until its body's first bytes
    /// say whose fault it is ([`Flow::on_judged_body`], `blame`).
    Judging,
    /// The routed answer flows to the client; its attempt ends with it.
    Relaying,
    /// Paused in the admission queue: the fleet serving its model is full.
    Queued,
    /// Nothing left to decide.
    Done,
}

/// What the host glue does after a call on [`Flow`].
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// Let the stream go on as it is.
    Continue,
    /// Hold the stream (the body is being buffered; or the answer, while a call runs).
    Pause,
    /// Hold the request: it waits for admission (its queue entry is [`Flow::queued`]); the
    /// owner's tick calls [`Flow::on_admitted`] or [`Flow::on_refused`] later.
    Wait,
    /// First attempt: write endpoint `i`'s cluster into the routing header, set its headers,
    /// let the request go on.
    Route(usize),
    /// Hold the answer and send the request to endpoint `i` with a failover call
    /// ([`Flow::call`]); if the host refuses the call, report it with
    /// [`Flow::dispatch_failed`] and perform the step that returns.
    Dispatch(usize),
    /// Let the routed answer through with these headers added.
    Relay(Vec<(&'static str, String)>),
    /// Answer with the current failover call's answer: this status and these headers, and
    /// its body (`body_size` bytes, read from the call).
    RelayCall {
        status: u16,
        headers: Pairs,
        body_size: usize,
    },
    /// Answer with this local reply and stop the request.
    Reply(Reply),
    /// Answer with this JSON body and status (an answer the filter gives itself that is not an
    /// error, e.g. `GET /v1/models`) and stop the request.
    Answer { status: u16, body: String },
}

/// The timing of a finished attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// The attempt's latency sample, what the latency estimate learns from: from the pick to
    /// the answer's first byte — its headers, or a relayed stream's first body byte; for a
    /// failover call's plain answer, its whole answer (its headers come with it). `None` when
    /// the first byte could not be seen: a failover call's streamed answer arrives whole, and
    /// its duration is the generation's, not its latency.
    pub to_headers_ms: Option<u64>,
    /// From the pick to the end of the attempt.
    pub total_ms: u64,
}

/// What the flow reports as it goes (metrics and log lines in Envoy; assertions in tests).
pub trait Observer {
    /// Attempt number `attempt` (1 = first) was started by `decision`.
    fn picked(&mut self, _decision: &Decision, _attempt: u32) {}
    /// An attempt on `endpoint` was handed back to the scheduler.
    fn finished(&mut self, _endpoint: usize, _outcome: &Outcome, _report: &Finished, _t: Timing) {}
    /// The request moves on from `endpoint` to another one.
    fn failed_over(&mut self, _from: usize) {}
    /// A failover was wanted but the retry budget is spent.
    fn budget_exhausted(&mut self) {}
    /// An inference request with a body is about to be routed; its session key came from
    /// `source` (see `wire::session`).
    fn session(&mut self, _source: SessionSource) {}
    /// The filter answered the request itself.
    fn replied(&mut self, _reply: &Reply) {}
    /// What admission did with the request (see `admission`).
    fn admission(&mut self, _event: &admit::Admission) {}
    /// The answer `endpoint` gave reported `usage`; the request's affinity at its first pick
    /// was `affinity`.
    fn usage(&mut self, _endpoint: usize, _affinity: AffinityResult, _usage: &Usage) {}
    /// An affinity hit's answer on `endpoint` was judged against its session's previous prompt
    /// there: `cold` when it found less than half of it cached (`payoff::cold_turn`).
    fn pinned_turn(&mut self, _endpoint: usize, _cold: bool) {}
    /// The request carried a pin cookie for its session that is not followed (`pin_cookie`).
    fn pin_cookie_ignored(&mut self, _why: Ignored) {}
}

impl Observer for () {}

/// The attempt in flight.
#[derive(Debug)]
struct Attempt {
    ticket: Ticket,
    /// Once its answer's headers were seen: the outcome and the latency sample (the time to
    /// the headers, or for a streamed answer to its first body byte).
    verdict: Option<(Outcome, u64)>,
    /// A streamed answer whose first body byte has not passed yet.
    awaits_first_byte: bool,
    /// The quota its successful answer stated (empty unless `quota_aware`).
    quota: QuotaHint,
    /// A relayed stream (`text/event-stream`): its sample is timed to its first byte.
    streamed: bool,
    /// Bytes of the relayed answer so far (the completion estimate without `usage`).
    relayed_bytes: u64,
    /// Its first byte was never seen (a failover call's streamed answer): no latency sample.
    unmeasured: bool,
    /// A relayed stream's decode phase so far, for its pace (see `slowness`).
    pace: Pace,
}

/// A relayed stream's decode phase while it runs: when it began, the bytes relayed until then,
/// and the size at which its pace is checked next (0: never; once its pace was judged, never
/// again, and its end is not judged a second time).
#[derive(Debug, Default)]
struct Pace {
    first_byte_at_ms: u64,
    bytes_at_first_byte: u64,
    next_check_bytes: u64,
    judged: bool,
}

impl Attempt {
    /// What a successful relayed answer that just ended was, for the slowness model: a
    /// stream timed to its first byte, a plain answer to now. `None` for anything but a
    /// success, and for a stream whose first byte was never seen.
    fn served(
        &self,
        usage: Option<Usage>,
        body_bytes: u64,
        work_key: String,
        now_ms: u64,
    ) -> Option<Served> {
        let (outcome, first_byte_ms) = self.verdict?;
        if !matches!(outcome, Outcome::Success) || (self.streamed && self.awaits_first_byte) {
            return None;
        }
        let total_ms = now_ms.saturating_sub(self.ticket.started_ms);
        // A stream whose pace was judged while it ran is not judged again by its end.
        let (observed_ms, decode_ms) = if self.streamed {
            let decode_ms = total_ms.saturating_sub(first_byte_ms);
            (first_byte_ms, (!self.pace.judged).then_some(decode_ms))
        } else {
            (total_ms, None)
        };
        let decode_bytes = self.streamed.then(|| {
            self.relayed_bytes
                .saturating_sub(self.pace.bytes_at_first_byte)
        });
        Some(Served {
            streamed: self.streamed,
            observed_ms,
            decode_ms,
            decode_bytes,
            usage,
            body_bytes,
            relayed_bytes: self.relayed_bytes,
            work_key,
        })
    }
}

/// A Responses API follow-up bound to the endpoint holding its previous response.
#[derive(Debug, Clone)]
struct Holder {
    endpoint_id: u32,
    previous_response_id: String,
    /// The input replays the conversation: if the holder cannot take it after all, it goes
    /// anywhere without `previous_response_id`.
    whole_input: bool,
    /// The request's own session, for that case.
    own_session: Option<u64>,
}

/// The answer the client gets if no failover call can be sent after all.
#[derive(Debug)]
enum Fallback {
    /// The routed answer, held at its headers.
    Routed { served_by: Option<usize> },
    /// The current failover call's answer.
    Call {
        served_by: Option<usize>,
        status: Option<u16>,
        headers: Pairs,
        body_size: usize,
    },
}

/// The request's lifecycle state. Create one per client request ([`Flow::default`]).
#[derive(Debug)]
pub struct Flow {
    phase: Phase,
    /// The request headers (routing header removed), sent again on failover.
    headers: HeaderList,
    trailers: Pairs,
    session_header: Option<Vec<u8>>,
    tenant: Option<Vec<u8>>,
    body: Vec<u8>,
    /// The body's bytes, inline media at a fixed size each (`wire::prompt_size`): what its
    /// token cost is estimated from, for quota-aware routing ([`Pick::body_bytes`]).
    prompt_bytes: u64,
    model: Option<String>,
    session: Option<u64>,
    /// The request's instructions segment, with placement by prefix on, and the shortest that
    /// makes a key (`prefix_min_bytes`): hashed into the placement key only when a placement
    /// asks for it ([`Flow::prefix_key`], [`Pick::prefix`]).
    instructions: Option<(Box<prefix::Segment>, u64)>,
    /// That key, once computed (`None` inside: the instructions make no key).
    prefix_memo: Cell<Option<Option<u64>>>,
    /// The body carries earlier turns ([`Pick::follow_up`]).
    follow_up: bool,
    /// The request's output limit, if it states one ([`Pick::max_output_tokens`]).
    max_output_tokens: u64,
    exclusions: Exclusions,
    attempts: u32,
    current: Option<Attempt>,
    /// The endpoint whose answer the client gets.
    served_by: Option<usize>,
    /// The session's affinity at the first pick.
    affinity: Option<AffinityResult>,
    fallback: Option<Fallback>,
    /// Placement key of a request without a session ([`Pick::nonce`]).
    nonce: u64,
    /// The inference API of the request, when it has one (`api::policy`).
    api: Option<Api>,
    content_type: Option<String>,
    /// A Responses API follow-up pinned to the endpoint holding its previous response: no
    /// other endpoint has that state, so it never fails over.
    holder_pinned: bool,
    /// The follow-up's holder (endpoint id): its pick takes that endpoint or fails
    /// ([`Pick::holder`]); and what to say, or do, if it fails.
    holder: Option<Holder>,
    /// The body differs from what the client sent (`previous_response_id` removed): the first
    /// attempt must forward this body, not the one Envoy buffered.
    body_rewritten: bool,
    /// A Responses API request whose answer will be stored: learn its id from the answer.
    learn_id: bool,
    /// `GET /v1/models` with `list_models: upstream_merged`: the call's answer is merged with
    /// the configured models before it is relayed.
    merge_models: bool,
    /// Reads the id of the successful answer the client gets, as it passes.
    id_scan: Option<IdScan>,
    /// The scan of a successful answer's usage (`usage_accounting`), while it passes.
    usage: Option<UsageScan>,
    /// The endpoint id the request's pin cookie names (`pin_cookie`).
    pin_hint: Option<u32>,
    /// That cookie has half its lifetime left or more: its endpoint's answer need not renew it.
    pin_hint_fresh: bool,
    /// The `set-cookie` value for a successful answer of the current attempt (`pin_cookie`).
    pin_cookie: Option<String>,
    /// A request routed with a body the filter never read (pass-through): a failover call
    /// could not send it, so it never fails over (an upload was once replayed empty).
    body_unread: bool,
    /// This request's place for admission: (VM, context id), its queue entry while it
    /// waits, and what it went through (see `admit.rs`).
    admission: admit::State,
}

impl Default for Flow {
    fn default() -> Self {
        Flow::new(0)
    }
}

impl Flow {
    /// A flow whose sessionless picks are placed on `nonce` (any value that differs between
    /// requests).
    pub fn new(nonce: u64) -> Self {
        Flow {
            nonce,
            follow_up: false,
            max_output_tokens: 0,
            phase: Phase::Start,
            headers: HeaderList::default(),
            trailers: Vec::new(),
            session_header: None,
            tenant: None,
            body: Vec::new(),
            prompt_bytes: 0,
            model: None,
            session: None,
            instructions: None,
            prefix_memo: Cell::new(None),
            exclusions: Exclusions::default(),
            attempts: 0,
            current: None,
            served_by: None,
            affinity: None,
            fallback: None,
            api: None,
            content_type: None,
            holder_pinned: false,
            holder: None,
            body_rewritten: false,
            learn_id: false,
            merge_models: false,
            id_scan: None,
            usage: None,
            pin_hint: None,
            pin_hint_fresh: false,
            pin_cookie: None,
            body_unread: false,
            admission: admit::State::default(),
        }
    }

    /// The `destination_header` value for an attempt on endpoint `i` when it is a host of a
    /// pool: the host, then the pool's other hosts not tried yet in this request, in
    /// rendezvous order for the request's placement key, up to `max_attempts` in all
    /// (`routing::pools::destination`).
    pub fn destination(&self, cfg: &Config, i: usize) -> Option<String> {
        let key = self.session.unwrap_or(self.nonce);
        let max = usize::try_from(cfg.max_attempts).unwrap_or(1);
        let tried = &self.exclusions.tried;
        crate::scheduler::routing::pools::destination(cfg, i, key, max, |j| tried.contains(&j))
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Endpoints tried so far.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    pub fn served_by(&self) -> Option<usize> {
        self.served_by
    }

    /// Whether an attempt is in flight (its ticket not yet handed back).
    pub fn in_flight(&self) -> bool {
        self.current.is_some()
    }

    /// Whether the routed answer must be held (a failover call is in flight).
    pub fn holds_answer(&self) -> bool {
        self.phase == Phase::FailingOver
    }

    /// Whether the answer's bytes are wanted ([`Flow::on_response_data`],
    /// [`Flow::on_call_body`]): its usage is being read.
    pub fn scans_answer(&self) -> bool {
        self.usage.is_some()
    }

    /// Bytes of the relayed answer as they pass: a chunk, or at least its last
    /// [`crate::scheduler::wire::usage::TAIL_BYTES`] bytes. The answer itself goes on unchanged.
    pub fn on_response_data(&mut self, bytes: &[u8]) {
        if self.phase != Phase::Relaying {
            return;
        }
        if let Some(scan) = self.usage.as_mut() {
            scan.feed(bytes);
        }
    }

    /// The body of the failover answer of the last [`Step::RelayCall`] (at least its last
    /// [`crate::scheduler::wire::usage::TAIL_BYTES`] bytes), relayed whole: its usage is counted.
    pub fn on_call_body(&mut self, obs: &mut dyn Observer, bytes: &[u8]) {
        if let Some(mut scan) = self.usage.take() {
            scan.feed(bytes);
            self.report_usage(obs, scan.finish());
        }
    }

    /// Reports the usage of the answer the client got, if it had one.
    fn report_usage(&self, obs: &mut dyn Observer, usage: Option<Usage>) {
        let (Some(endpoint), Some(usage)) = (self.served_by, usage) else {
            return;
        };
        let affinity = self.affinity.unwrap_or(AffinityResult::None);
        obs.usage(endpoint, affinity, &usage);
    }

    /// Starts reading the usage of a successful answer with these headers.
    fn scan_usage<H: HeaderSource + ?Sized>(
        &mut self,
        cfg: &crate::scheduler::config::Config,
        headers: &H,
    ) {
        self.usage = cfg.usage_accounting.then(|| {
            UsageScan::new(Framing::from_content_type(
                headers.header("content-type").as_deref(),
            ))
        });
    }

    /// The request headers. `Pause` while the body is buffered.
    pub fn on_request_headers(
        &mut self,
        s: &Scheduler<'_>,
        obs: &mut dyn Observer,
        headers: impl Into<HeaderList>,
        end_of_stream: bool,
        now_ms: u64,
    ) -> Step {
        if self.phase != Phase::Start {
            return Step::Continue;
        }
        let cfg = s.cfg;
        let mut headers = headers.into();
        // Clients never pick clusters, hosts nor data-parallel ranks (not even for failover
        // calls).
        headers.remove(&cfg.routing_header);
        headers.remove(&cfg.destination_header);
        headers.remove(crate::scheduler::config::ranks::RANK_HEADER);
        let method = headers.header_str(":method").unwrap_or_default();
        let path = headers.header_str(":path").unwrap_or_default();
        self.content_type = headers.header_str("content-type");
        let declared = headers
            .header_str("content-length")
            .and_then(|v| v.trim().parse::<u64>().ok());
        self.session_header = headers.header(&cfg.session_header).map(Cow::into_owned);
        self.tenant = headers
            .header("authorization")
            .or_else(|| headers.header("x-api-key"))
            .map(Cow::into_owned);
        self.headers = headers;
        // Set for the requests routed at once below; a body read in full clears it.
        self.body_unread = !end_of_stream;
        match api::policy(&method, &path, self.content_type.as_deref()) {
            Handling::Json(a) | Handling::Multipart(a) => self.api = Some(a),
            Handling::ListModels => match cfg.list_models {
                ListModels::Local => return self.answer(200, models::list(cfg)),
                ListModels::UpstreamMerged => return self.fetch_models(s, obs, now_ms),
            },
            Handling::RetrieveModel { id } => match models::retrieve(cfg, id) {
                Retrieved::Found(body) => return self.answer(200, body),
                Retrieved::NotFound(body) => return self.answer(404, body),
                Retrieved::AskUpstream(model) => {
                    self.model = Some(model);
                    self.session_header = None;
                    return self.first_attempt(s, obs, now_ms);
                }
            },
            Handling::StoredResponse { id } => {
                // Only the endpoint that stored the response has it: its response key finds it
                // through the affinity table as a pin would (and a removed or cooling holder
                // is placed like any request: the upstream answers for itself).
                self.session = Some(responses::response_key(self.tenant.as_deref(), id));
                self.holder_pinned = true;
                return self.first_attempt(s, obs, now_ms);
            }
            Handling::WrongContentType { api } => {
                return self.refuse(obs, &RequestError::UnsupportedContentType(api))
            }
            Handling::InvalidPath(e) => return self.refuse(obs, &RequestError::InvalidPath(e)),
            Handling::PassThrough => {
                // Not inference (files, batches, anything unknown): routed at once, without a
                // model or session, the body never read.
                self.session_header = None;
                return self.first_attempt(s, obs, now_ms);
            }
        }
        if end_of_stream {
            return self.refuse(obs, &RequestError::EmptyBody);
        }
        let limit = cfg.max_body_bytes;
        if declared.is_some_and(|n| n > limit) {
            return self.refuse(obs, &RequestError::TooLarge { limit });
        }
        self.phase = Phase::AwaitBody;
        Step::Pause
    }

    /// A body chunk; `buffered` is the body size so far. At its end `read_body` is called
    /// once for the whole body.
    pub fn on_request_body(
        &mut self,
        s: &Scheduler<'_>,
        obs: &mut dyn Observer,
        buffered: usize,
        end_of_stream: bool,
        read_body: &mut dyn FnMut() -> Vec<u8>,
        now_ms: u64,
    ) -> Step {
        if self.phase != Phase::AwaitBody {
            return Step::Continue;
        }
        let limit = s.cfg.max_body_bytes;
        if buffered as u64 > limit {
            return self.refuse(obs, &RequestError::TooLarge { limit });
        }
        if !end_of_stream {
            return Step::Pause;
        }
        let body = read_body();
        self.complete(s, obs, body, now_ms)
    }

    /// Request trailers end the request: a body that was still awaited is complete (the body
    /// callback never saw its end). The trailers go along on failover calls.
    pub fn on_request_trailers(
        &mut self,
        s: &Scheduler<'_>,
        obs: &mut dyn Observer,
        trailers: Pairs,
        read_body: &mut dyn FnMut() -> Vec<u8>,
        now_ms: u64,
    ) -> Step {
        self.trailers = trailers;
        if self.phase != Phase::AwaitBody {
            return Step::Continue;
        }
        let body = read_body();
        let limit = s.cfg.max_body_bytes;
        if body.len() as u64 > limit {
            return self.refuse(obs, &RequestError::TooLarge { limit });
        }
        self.complete(s, obs, body, now_ms)
    }

    /// The body is complete: parse it, key the session, route.
    fn complete(
        &mut self,
        s: &Scheduler<'_>,
        obs: &mut dyn Observer,
        body: Vec<u8>,
        now_ms: u64,
    ) -> Step {
        let parsed = match (self.api.map(|a| a.body()), self.content_type.as_deref()) {
            (Some(BodyFormat::Multipart), Some(ct)) => {
                crate::scheduler::wire::request::parse_form(ct, &body)
            }
            // The instructions are hashed only for placement by prefix.
            _ => parse_chat_with(&body, s.cfg.prefix_placement),
        };
        let mut req = match parsed {
            Ok(r) => r,
            Err(e) => return self.refuse(obs, &e),
        };
        // The harness headers are looked up in the kept copy of the request headers, and only
        // when the configured header and `prompt_cache_key` did not decide.
        let (session, mut source) = derive_session_with(
            self.tenant.as_deref(),
            self.session_header.as_deref(),
            || session::harness_header(&self.headers),
            &req,
            &body,
        );
        self.session = session;
        if s.cfg.prefix_placement {
            self.instructions = req.instructions.take().map(|i| (i, s.cfg.prefix_min_bytes));
        }
        self.read_pin_cookie(s.cfg, obs, now_ms);
        self.follow_up = req.follow_up;
        self.max_output_tokens = req.max_output_tokens.unwrap_or(0);
        self.model = Some(req.model);
        // An upload form's file is one media item; a JSON body was measured by its parse.
        self.prompt_bytes = req.prompt_bytes;
        self.body = body;
        self.body_unread = false;
        if self.api == Some(Api::Responses) {
            if let Some(step) = self.follow_up(s, obs, now_ms) {
                return step;
            }
        }
        if self.holder.is_some() {
            source = SessionSource::PreviousResponse;
        }
        obs.session(source);
        self.admit(s, obs, now_ms)
    }

    /// The placement key of the request's instructions, when they are long enough: hashed on
    /// the first call (a placement that needs it), remembered for the next attempts.
    fn prefix_key(&self) -> Option<u64> {
        if let Some(known) = self.prefix_memo.get() {
            return known;
        }
        let key = self.instructions.as_ref().and_then(|(segment, min_bytes)| {
            let model = self.model.as_deref()?;
            let hashed = segment.hash(&self.body, model)?;
            prefix::prefix_key(self.tenant.as_deref(), &hashed, *min_bytes)
        });
        self.prefix_memo.set(Some(key));
        key
    }

    /// `bytes` more of the relayed answer passed (every chunk's size, whether or not its
    /// bytes are read): the completion estimate of an answer without `usage`.
    pub fn count_answer_bytes(&mut self, bytes: usize) {
        if let Some(a) = self.current.as_mut() {
            a.relayed_bytes = a.relayed_bytes.saturating_add(bytes as u64);
        }
    }

    /// Whether [`Flow::on_first_byte`] wants the next body chunk's time.
    pub fn awaits_first_byte(&self) -> bool {
        self.current.as_ref().is_some_and(|a| a.awaits_first_byte)
    }

    /// The first body byte of a streamed answer passed: its time is the attempt's latency
    /// sample (time to first token), instead of the time to its headers.
    pub fn on_first_byte(&mut self, now_ms: u64) {
        if let Some(a) = self.current.as_mut().filter(|a| a.awaits_first_byte) {
            a.awaits_first_byte = false;
            if let Some((_, latency)) = a.verdict.as_mut() {
                *latency = now_ms.saturating_sub(a.ticket.started_ms);
            }
            a.pace = Pace {
                first_byte_at_ms: now_ms,
                bytes_at_first_byte: a.relayed_bytes,
                next_check_bytes: slowness::PACE_FIRST_CHECK_BYTES,
                judged: false,
            };
        }
    }

    /// Whether a relayed stream's pace is due for a check ([`Flow::on_pace`]): enough bytes
    /// passed since the last one. A comparison per chunk.
    pub fn pace_due(&self) -> bool {
        self.current.as_ref().is_some_and(|a| {
            let p = &a.pace;
            p.next_check_bytes > 0
                && !p.judged
                && a.relayed_bytes.saturating_sub(p.bytes_at_first_byte) >= p.next_check_bytes
        })
    }

    /// Checks a running stream's pace (see `slowness`): a decode phase already slow past
    /// `pin_break_ratio` for the bytes it relayed is judged now, not when the slow stream ends.
    /// The next check is at twice the size.
    pub fn on_pace(&mut self, s: &Scheduler<'_>, now_ms: u64) {
        let work_key = signals::work_key(s.cfg, self.model.as_deref());
        let Some(a) = self.current.as_mut() else {
            return;
        };
        let decode_bytes = a.relayed_bytes.saturating_sub(a.pace.bytes_at_first_byte);
        a.pace.next_check_bytes = decode_bytes.saturating_mul(2);
        let decode_ms = now_ms.saturating_sub(a.pace.first_byte_at_ms);
        a.pace.judged = s.judge_pace(&a.ticket, &work_key, decode_ms, decode_bytes, now_ms);
    }

    /// `GET /v1/models` from an endpoint: sent as a call (so its answer can be merged before it
    /// is relayed), to the first endpoint in order for this request, failing over like any.
    fn fetch_models(&mut self, s: &Scheduler<'_>, obs: &mut dyn Observer, now_ms: u64) -> Step {
        self.session_header = None;
        self.merge_models = true;
        match self.start_attempt(s, obs, now_ms) {
            Ok(i) => {
                self.served_by = Some(i);
                self.phase = Phase::FailingOver;
                Step::Dispatch(i)
            }
            // Nothing to ask: the configuration's own list.
            Err(_) => self.answer(200, models::list(s.cfg)),
        }
    }

    /// The body of a failover call's answer as the client gets it: a successful model list is
    /// merged with the configured models (`list_models: upstream_merged`).
    pub fn call_body(&self, cfg: &Config, status: u16, body: Vec<u8>) -> Vec<u8> {
        if !self.merge_models || !(200..300).contains(&status) {
            return body;
        }
        // An answer that is not a model list gives way to the configured models alone.
        match models::merge(cfg, &body) {
            Merged::Merged(merged) | Merged::UpstreamUnreadable(merged) => merged.into_bytes(),
        }
    }

    fn answer(&mut self, status: u16, body: String) -> Step {
        self.phase = Phase::Done;
        Step::Answer { status, body }
    }
}

/// The quota a successful answer or a 429 states (a 429's, when it explains the refusal,
/// stands in for the breaker: `Quota::refused`), read only when `quota_aware` is on (each
/// header read is a host call in Envoy). `sent_ms`: when the attempt was sent (resets count
/// from there: the upstream admitted it then).
fn quota_hint<H: HeaderSource + ?Sized>(
    s: &Scheduler<'_>,
    outcome: &Outcome,
    headers: &H,
    sent_ms: u64,
) -> QuotaHint {
    if s.cfg.quota_aware && matches!(outcome, Outcome::Success | Outcome::RateLimited { .. }) {
        QuotaHint::read(headers, sent_ms)
    } else {
        QuotaHint::default()
    }
}

#[cfg(test)]
mod tests;
