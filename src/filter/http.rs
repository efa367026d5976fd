//! The per-request HTTP context: Envoy's callbacks, translated.
//!
//! Every decision about the request — wait for the body, route, relay, fail over, reply, when
//! an attempt ends — is made by the host-independent lifecycle,
//! [`crate::scheduler::flow::Flow`]. This file reads what a callback brings (through
//! [`super::host`]), hands it to the flow, and performs the [`Step`] the flow returns.
//!
//! Callback → flow:
//! - request headers / body / trailers → `on_request_headers` / `on_request_body` /
//!   `on_request_trailers` (the body is read once, when complete);
//! - response headers → `on_response_headers` (a 429 without reset hints is held: its body is
//!   buffered up to `blame::JUDGE_BYTES` and judged by `on_judged_body`); each response body
//!   chunk's last bytes → `on_response_data` (read only while the flow scans the answer's usage; the chunk passes
//!   unchanged); a relayed stream's size, at doubling sizes → `on_pace` (its pace while it runs); the last response body chunk or the response trailers → `on_response_end`;
//!   response body while a failover call runs → held (`Pause`);
//! - a failover call's answer → `on_call_response`, and once relayed, its body →
//!   `on_call_body`; a call Envoy refuses → `dispatch_failed`;
//! - `on_log` (runs in every case, client gone included) → `on_log`.

use super::host;
use super::observe::Recorder;
use super::parked::Slot;
use super::plugin::Plugin;
use super::pools;
use super::shared::SharedData;
use crate::scheduler::config::ranks;
use crate::scheduler::flow::{Flow, Step};
use crate::scheduler::health::blame::{self, JUDGE_BYTES};
use crate::scheduler::routing::pools::STAMP_HEADER;
use crate::scheduler::routing::select::Scheduler;
use crate::scheduler::wire::headers::HeaderSource;
use crate::scheduler::wire::usage::TAIL_BYTES;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};
use std::cell::RefCell;
use std::rc::Rc;

pub struct Http {
    plugin: Rc<Plugin>,
    flow: Flow,
    context_id: u32,
    /// While the request waits for admission its flow is here, shared with the VM's
    /// [`super::parked::Parked`] registry (the root's tick routes it when admitted).
    parked: Option<Rc<RefCell<Flow>>>,
}

impl Http {
    pub fn new(plugin: Rc<Plugin>, context_id: u32) -> Self {
        // Distinct per request: the context id (unique within this VM) mixed with the clock
        // (distinct across VMs and restarts); only its spread matters.
        let nonce = crate::scheduler::state::hash::fmix64(
            host::now_ms().rotate_left(32) ^ u64::from(context_id),
        );
        let mut flow = Flow::new(nonce);
        flow.set_owner(plugin.vm, context_id);
        Http {
            plugin,
            flow,
            context_id,
            parked: None,
        }
    }

    /// Takes the flow back from the parked registry (a callback after the request waited:
    /// admitted and resumed, or its stream ending while it waited).
    fn unpark(&mut self) {
        if let Some(shared) = self.parked.take() {
            let _ = self.plugin.parked.take(self.context_id);
            if let Ok(mut f) = shared.try_borrow_mut() {
                self.flow = std::mem::take(&mut *f);
            }
        }
    }

    /// Runs `f` on the flow with a scheduler over shared data and a metrics recorder.
    fn with_flow<R>(
        &mut self,
        now_ms: u64,
        f: impl FnOnce(&mut Flow, &Scheduler<'_>, &mut Recorder<'_>) -> R,
    ) -> R {
        run(&self.plugin, &mut self.flow, now_ms, f)
    }

    /// Performs a step of the flow; a request that must wait for admission is parked.
    fn perform(&mut self, step: Step, now_ms: u64) -> Action {
        if let Step::Wait = step {
            let shared = Rc::new(RefCell::new(std::mem::take(&mut self.flow)));
            self.plugin.parked.park(
                self.context_id,
                Slot {
                    flow: Rc::clone(&shared),
                    plugin: Rc::clone(&self.plugin),
                },
            );
            self.parked = Some(shared);
            // The root context's timer now runs admission rounds often (see `admit`).
            host::tick_every(super::parked::ADMISSION_TICK);
            return Action::Pause;
        }
        perform(&self.plugin, &mut self.flow, step, now_ms)
    }
}

/// Runs `f` on `flow` with a scheduler over shared data and a metrics recorder.
pub(super) fn run<R>(
    plugin: &Plugin,
    flow: &mut Flow,
    now_ms: u64,
    f: impl FnOnce(&mut Flow, &Scheduler<'_>, &mut Recorder<'_>) -> R,
) -> R {
    let store = SharedData;
    let sched =
        Scheduler::with_caches(&plugin.cfg, &store, &plugin.table_cache, &plugin.rooms_memo);
    let mut rec = Recorder { plugin, now_ms };
    f(flow, &sched, &mut rec)
}

/// Performs a step of `flow` on the current (effective) request.
pub(super) fn perform(plugin: &Plugin, flow: &mut Flow, step: Step, now_ms: u64) -> Action {
    match step {
        Step::Wait => Action::Pause,
        Step::Continue => Action::Continue,
        Step::Pause => Action::Pause,
        Step::Route(i) => {
            let cfg = &plugin.cfg;
            if let Some(ep) = cfg.endpoints.get(i) {
                let req = MapType::HttpRequestHeaders;
                host::set_header(req, &cfg.routing_header, ep.cluster.as_bytes());
                for name in blame::withheld_headers(ep) {
                    host::remove_header(req, name);
                }
                // A pool's host: named for the cluster's override_host policy.
                if let Some(d) = flow.destination(cfg, i) {
                    host::set_header(req, &cfg.destination_header, d.as_bytes());
                }
                for (name, value) in &ep.headers {
                    host::set_header(req, name, value.as_bytes());
                }
            }
            // The body decided on (a follow-up without `previous_response_id`), not the
            // one Envoy buffered; its framing follows it.
            if let Some((body, declared)) = flow.rewritten_body() {
                host::replace_buffer(BufferType::HttpRequestBody, usize::MAX, body);
                if declared {
                    let len = body.len().to_string();
                    host::set_header(
                        MapType::HttpRequestHeaders,
                        "content-length",
                        len.as_bytes(),
                    );
                }
            }
            Action::Continue
        }
        Step::Dispatch(i) => {
            let sent = flow.call(&plugin.cfg, i).is_some_and(|c| {
                host::dispatch(c.cluster, &c.headers, c.body, c.trailers, c.timeout_ms)
            });
            if sent {
                return Action::Pause;
            }
            log::warn!(
                    "computeflux: failover call to endpoint {i} refused; is its cluster defined in Envoy?"
                );
            let next = run(plugin, flow, now_ms, |f, s, r| {
                f.dispatch_failed(s, r, now_ms)
            });
            perform(plugin, flow, next, now_ms)
        }
        Step::Relay(expose) => {
            for (name, value) in expose {
                // The upstream's own cookies stay; every other header is ours alone.
                if name == "set-cookie" {
                    host::add_header(MapType::HttpResponseHeaders, name, value.as_bytes());
                } else {
                    host::set_header(MapType::HttpResponseHeaders, name, value.as_bytes());
                }
            }
            Action::Continue
        }
        Step::RelayCall {
            status,
            headers,
            body_size,
        } => {
            let body = host::buffer(BufferType::HttpCallResponseBody, 0, body_size);
            let body = flow.call_body(&plugin.cfg, status, body);
            if flow.reads_answer() {
                run(plugin, flow, now_ms, |f, s, _| {
                    f.on_answer_chunk(s, &body, true, now_ms)
                });
            }
            let headers: Vec<(&str, &[u8])> = headers
                .iter()
                .map(|(n, v)| (n.as_str(), v.as_slice()))
                .collect();
            host::send_response(u32::from(status), &headers, &body);
            if flow.scans_answer() {
                run(plugin, flow, now_ms, |f, _, r| f.on_call_body(r, &body));
            }
            Action::Pause
        }
        Step::Answer { status, body } => {
            let headers: [(&str, &[u8]); 1] = [("content-type", b"application/json")];
            host::send_response(u32::from(status), &headers, body.as_bytes());
            Action::Pause
        }
        Step::Reply(reply) => {
            let mut headers: Vec<(&str, &[u8])> = vec![("content-type", b"application/json")];
            headers.extend(reply.headers.iter().map(|(n, v)| (*n, v.as_bytes())));
            host::send_response(u32::from(reply.status), &headers, reply.body().as_bytes());
            Action::Pause
        }
    }
}

impl Context for Http {
    fn on_http_call_response(
        &mut self,
        _token: u32,
        num_headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        self.unpark();
        let now = host::now_ms();
        // num_headers == 0: the call failed (reset, timeout after headers).
        let mut headers =
            (num_headers > 0).then(|| host::header_pairs(MapType::HttpCallResponseHeaders));
        // A pool host's answer names who served it (the stamp), never shown to the client.
        if let Some(h) = headers.as_mut() {
            if let Some(served) = pools::stamp(h) {
                let cfg = &self.plugin.cfg;
                let ep = self.flow.served_by().and_then(|i| cfg.endpoints.get(i));
                if let Some(p) = ep.and_then(|e| e.pool.as_ref()) {
                    pools::news(cfg, &p.pool, p.address.as_deref(), &served, now);
                }
                h.retain(|(n, _)| !n.eq_ignore_ascii_case(STAMP_HEADER));
            }
        }
        // A 429's first bytes tell a request too large for any key from a rate limit.
        let head = match headers.as_ref().and_then(|h| h.status()) {
            Some(429) => host::buffer(BufferType::HttpCallResponseBody, 0, JUDGE_BYTES),
            _ => Vec::new(),
        };
        let step = self.with_flow(now, |f, s, r| {
            f.on_call_answer(s, r, headers, body_size, &head, now)
        });
        self.perform(step, now);
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.unpark();
        let now = host::now_ms();
        // Clients never pick clusters, hosts nor data-parallel ranks: gone from the live map
        // before any route matching.
        host::remove_header(MapType::HttpRequestHeaders, &self.plugin.cfg.routing_header);
        host::remove_header(
            MapType::HttpRequestHeaders,
            &self.plugin.cfg.destination_header,
        );
        host::remove_header(MapType::HttpRequestHeaders, ranks::RANK_HEADER);
        let headers = host::header_list(MapType::HttpRequestHeaders);
        let step = self.with_flow(now, |f, s, r| {
            f.on_request_headers(s, r, headers, end_of_stream, now)
        });
        self.perform(step, now)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.unpark();
        let now = host::now_ms();
        let mut read = || host::buffer(BufferType::HttpRequestBody, 0, body_size);
        let step = self.with_flow(now, |f, s, r| {
            f.on_request_body(s, r, body_size, end_of_stream, &mut read, now)
        });
        self.perform(step, now)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        self.unpark();
        let now = host::now_ms();
        let trailers = host::header_pairs(MapType::HttpRequestTrailers);
        // The body buffered so far (the body callback returned Pause for it).
        let mut read = || host::buffer(BufferType::HttpRequestBody, 0, usize::MAX);
        let step = self.with_flow(now, |f, s, r| {
            f.on_request_trailers(s, r, trailers, &mut read, now)
        });
        self.perform(step, now)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.unpark();
        let now = host::now_ms();
        // One host call for the whole map: a success answer is read for its status, its
        // content type (twice) and up to a dozen quota headers, each a host call if looked up
        // one by one.
        let headers = host::header_list(MapType::HttpResponseHeaders);
        // A pool host's answer: who served it is news when it is not the host named first
        // (that one left) or not known yet.
        if let Some(i) = self.flow.served_by() {
            pools::learn_from_answer(&self.plugin.cfg, i, now);
        }
        if headers.header(STAMP_HEADER).is_some() {
            host::remove_header(MapType::HttpResponseHeaders, STAMP_HEADER);
        }
        let step = self.with_flow(now, |f, s, r| {
            f.on_response_headers(s, r, &headers, end_of_stream, now)
        });
        self.perform(step, now)
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.unpark();
        if self.flow.judges_answer() {
            // A 429 held at its headers: buffered until its head can be judged.
            if !end_of_stream && body_size < JUDGE_BYTES {
                return Action::Pause;
            }
            let now = host::now_ms();
            let head = host::buffer(BufferType::HttpResponseBody, 0, JUDGE_BYTES);
            let step = self.with_flow(now, |f, s, r| f.on_judged_body(s, r, &head, now));
            if self.perform(step, now) == Action::Pause {
                return Action::Pause;
            }
        }
        if self.flow.holds_answer() {
            return Action::Pause;
        }
        self.flow.count_answer_bytes(body_size);
        if body_size > 0 && self.flow.awaits_first_byte() {
            let now = host::now_ms();
            self.with_flow(now, |f, _, _| f.on_first_byte(now));
        }
        // A running stream's pace, at doubling sizes (see `slowness`).
        if self.flow.pace_due() {
            let now = host::now_ms();
            self.with_flow(now, |f, s, _| f.on_pace(s, now));
        }
        // A Responses API answer: its id is read as it passes (bounded, never held back).
        let whole = self.flow.reads_answer().then(|| {
            let now = host::now_ms();
            let chunk = host::buffer(BufferType::HttpResponseBody, 0, body_size);
            self.with_flow(now, |f, s, _| {
                f.on_answer_chunk(s, &chunk, end_of_stream, now)
            });
            chunk
        });
        if self.flow.scans_answer() && body_size > 0 {
            // Only the chunk's end can matter; the chunk itself goes on unchanged.
            match &whole {
                Some(chunk) => {
                    let start = chunk.len().saturating_sub(TAIL_BYTES);
                    self.flow
                        .on_response_data(chunk.get(start..).unwrap_or(&[]));
                }
                None => {
                    let start = body_size.saturating_sub(TAIL_BYTES);
                    let tail = host::buffer(BufferType::HttpResponseBody, start, TAIL_BYTES);
                    self.flow.on_response_data(&tail);
                }
            }
        }
        if end_of_stream {
            let now = host::now_ms();
            self.with_flow(now, |f, s, r| f.on_response_end(s, r, now));
        }
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        self.unpark();
        if self.flow.judges_answer() {
            let now = host::now_ms();
            let head = host::buffer(BufferType::HttpResponseBody, 0, JUDGE_BYTES);
            let step = self.with_flow(now, |f, s, r| f.on_judged_body(s, r, &head, now));
            if self.perform(step, now) == Action::Pause {
                return Action::Pause;
            }
        }
        if self.flow.holds_answer() {
            return Action::Pause;
        }
        let now = host::now_ms();
        if self.flow.reads_answer() {
            self.with_flow(now, |f, s, _| f.on_answer_chunk(s, &[], true, now));
        }
        self.with_flow(now, |f, s, r| f.on_response_end(s, r, now));
        Action::Continue
    }

    fn on_log(&mut self) {
        self.unpark();
        let now = host::now_ms();
        self.with_flow(now, |f, s, r| f.on_log(s, r, now));
    }
}
