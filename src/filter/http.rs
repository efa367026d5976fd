//! The per-request HTTP context: request path, response path, failover.
//!
//! Request path (POST): pause the headers, buffer the body (bounded by `max_body_bytes`), read
//! `model`, derive the tenant-scoped session key, ask the scheduler, write the endpoint's
//! cluster into the routing header and its configured headers, continue. Other methods
//! (`GET /v1/models`, ...) are routed to the best endpoint for any model, without a session.
//!
//! Response path: classify the status, record latency (time to response headers) and outcome,
//! refresh or evict affinity. On 401/403/429/5xx/connect failure the same client request is
//! sent to the next best endpoint with `dispatch_http_call` (the failing response is held back,
//! the final answer delivered with a local reply). An attempt that never reports (client gone)
//! is finished as cancelled in `on_log`, so in-flight counts stay exact.

use super::host;
use super::metrics::{Metrics, AFFINITY_RESULTS, DECISION_REASONS, REJECT_REASONS};
use super::root::Plugin;
use super::shared::SharedData;
use crate::scheduler::outcome::{classify, FailureKind, Outcome};
use crate::scheduler::request::{derive_session, openai_error, parse_chat, RequestError};
use crate::scheduler::select::{AffinityResult, Exclusions, NoEndpoint, Pick, Scheduler, Ticket};
use log::{debug, warn};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, Bytes, MapType};
use std::rc::Rc;
use std::time::Duration;

pub const HEADER_ENDPOINT: &str = "x-computeflux-endpoint";
pub const HEADER_ATTEMPTS: &str = "x-computeflux-attempts";
pub const HEADER_AFFINITY: &str = "x-computeflux-affinity";

/// Response headers never copied from a failover response into the local reply: Envoy frames
/// the reply itself.
const HOP_BY_HOP: &[&str] = &[
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "upgrade",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the request body (POST).
    AwaitBody,
    /// Routed; waiting for the upstream's response headers.
    Routed,
    /// A failover call is in flight; the held response must not reach the client.
    FailingOver,
    /// Done with decisions (answered locally, or the final response is flowing).
    Done,
}

pub struct Http {
    plugin: Rc<Plugin>,
    phase: Phase,
    /// Request headers copied at header time (for failover calls), routing header removed.
    headers: Vec<(String, Bytes)>,
    session_header: Option<Bytes>,
    tenant: Option<Bytes>,
    model: Option<String>,
    session: Option<u64>,
    body: Option<Bytes>,
    exclusions: Exclusions,
    attempts: u32,
    /// The attempt in flight, if any: finished exactly once.
    current: Option<Ticket>,
    /// The endpoint whose response the client gets.
    served_by: Option<usize>,
    affinity: Option<AffinityResult>,
    /// Placement key if the request has no session (see `Pick::nonce`).
    nonce: u64,
}

impl Http {
    pub fn new(plugin: Rc<Plugin>, context_id: u32) -> Self {
        // Distinct per request: the context id (unique within this VM) mixed with the clock
        // (distinct across VMs and restarts); only its spread matters.
        let nonce =
            crate::scheduler::hash::fmix64(host::now_ms().rotate_left(32) ^ u64::from(context_id));
        Http {
            nonce,
            plugin,
            phase: Phase::AwaitBody,
            headers: Vec::new(),
            session_header: None,
            tenant: None,
            model: None,
            session: None,
            body: None,
            exclusions: Exclusions::default(),
            attempts: 0,
            current: None,
            served_by: None,
            affinity: None,
        }
    }

    fn reject(&mut self, err: &RequestError) -> Action {
        self.local_error(
            err.status(),
            "invalid_request_error",
            err.code(),
            &err.message(),
            None,
        )
    }

    /// Answers the client with an OpenAI-shaped error and stops the request here.
    fn local_error(
        &mut self,
        status: u16,
        kind: &str,
        code: &str,
        message: &str,
        retry_after_s: Option<u64>,
    ) -> Action {
        self.phase = Phase::Done;
        Metrics::inc_labelled(&self.plugin.metrics.rejected, REJECT_REASONS, code);
        let body = openai_error(message, kind, code);
        let retry = retry_after_s.map(|s| s.to_string());
        let mut headers: Vec<(&str, &[u8])> = vec![("content-type", b"application/json")];
        if let Some(r) = &retry {
            headers.push(("retry-after", r.as_bytes()));
        }
        debug!("computeflux: local reply {status} {code}");
        host::send_response(u32::from(status), &headers, body.as_bytes());
        Action::Pause
    }

    /// Picks an endpoint for the next attempt. `Err` carries why none is available.
    fn pick(&mut self, now_ms: u64) -> Result<(usize, Ticket), NoEndpoint> {
        let store = SharedData;
        let sched = Scheduler::new(&self.plugin.cfg, &store);
        let pick = Pick {
            model: self.model.as_deref(),
            session: self.session,
            attempt: self.attempts + 1,
            exclusions: &self.exclusions,
            nonce: self.nonce,
        };
        let decision = sched.pick(&pick, now_ms)?;
        if let Some(m) = decision
            .broke_pin_of
            .and_then(|i| self.plugin.metrics.endpoint(i))
        {
            Metrics::inc(m.pin_breaks);
        }
        self.attempts += 1;
        if self.affinity.is_none() {
            self.affinity = Some(decision.affinity);
            Metrics::inc_labelled(
                &self.plugin.metrics.affinity,
                AFFINITY_RESULTS,
                decision.affinity.label(),
            );
        }
        Metrics::inc_labelled(
            &self.plugin.metrics.decisions,
            DECISION_REASONS,
            decision.reason.label(),
        );
        if !decision.ticket.counted {
            Metrics::inc(self.plugin.metrics.cas_exhausted);
            warn!("computeflux: shared-data CAS retries exhausted at pick; in-flight not counted");
        }
        debug!(
            "computeflux: attempt {} -> endpoint {} reason={} affinity={}",
            self.attempts,
            self.plugin
                .cfg
                .endpoints
                .get(decision.endpoint)
                .map_or("?", |e| e.name.as_str()),
            decision.reason.label(),
            decision.affinity.label()
        );
        Ok((decision.endpoint, decision.ticket))
    }

    /// First attempt: route through Envoy's router by writing the routing header.
    fn route(&mut self) -> Action {
        let now = host::now_ms();
        match self.pick(now) {
            Ok((i, ticket)) => {
                let Some(ep) = self.plugin.cfg.endpoints.get(i) else {
                    return Action::Continue;
                };
                host::set_header(
                    MapType::HttpRequestHeaders,
                    &self.plugin.cfg.routing_header,
                    Some(ep.cluster.as_bytes()),
                );
                for (name, value) in &ep.headers {
                    host::set_header(MapType::HttpRequestHeaders, name, Some(value.as_bytes()));
                }
                self.current = Some(ticket);
                self.served_by = Some(i);
                self.phase = Phase::Routed;
                Action::Continue
            }
            Err(no) => self.no_endpoint(no, now),
        }
    }

    fn no_endpoint(&mut self, no: NoEndpoint, now_ms: u64) -> Action {
        match no {
            NoEndpoint::ModelNotFound => {
                let model = self.model.clone().unwrap_or_default();
                let message = format!(
                    "The model `{}` does not exist or no endpoint serves it.",
                    truncate(&model, 256)
                );
                self.local_error(
                    404,
                    "invalid_request_error",
                    "model_not_found",
                    &message,
                    None,
                )
            }
            NoEndpoint::CoolingDown {
                retry_at_ms,
                all_rate_limited,
            } => {
                let secs = retry_at_ms.saturating_sub(now_ms).div_ceil(1000).max(1);
                if all_rate_limited {
                    let msg = format!(
                        "Every endpoint for this model is rate limited; retry in {secs} s."
                    );
                    self.local_error(429, "rate_limit_error", "rate_limited", &msg, Some(secs))
                } else {
                    let msg = format!(
                        "No endpoint for this model is available right now; retry in {secs} s."
                    );
                    self.local_error(
                        503,
                        "server_error",
                        "no_endpoint_available",
                        &msg,
                        Some(secs),
                    )
                }
            }
            NoEndpoint::Exhausted | NoEndpoint::BudgetExhausted => self.local_error(
                503,
                "server_error",
                "no_endpoint_available",
                "No endpoint for this model is available right now.",
                Some(1),
            ),
        }
    }

    /// Records the outcome of the attempt in flight and notes it in this request's exclusions.
    fn finish(&mut self, outcome: &Outcome, now_ms: u64) -> Option<usize> {
        let ticket = self.current.take()?;
        let store = SharedData;
        let sched = Scheduler::new(&self.plugin.cfg, &store);
        let latency = now_ms.saturating_sub(ticket.started_ms);
        let report = sched.finish(&ticket, outcome, latency, self.session, now_ms);
        if !report.stored {
            Metrics::inc(self.plugin.metrics.cas_exhausted);
            warn!("computeflux: shared-data CAS retries exhausted at finish");
        }
        self.exclusions.after_attempt(ticket.endpoint, outcome);
        if let Some(m) = self.plugin.metrics.endpoint(ticket.endpoint) {
            let label = outcome.label();
            if let Some(i) = Outcome::ALL_LABELS.iter().position(|l| *l == label) {
                Metrics::inc(m.requests.get(i).copied().flatten());
            }
            Metrics::set(m.in_flight, u64::from(report.in_flight));
            if let Some(l) = report.latency_ms {
                Metrics::set(m.ewma_latency_ms, l.round() as u64);
            }
            if matches!(outcome, Outcome::Success) {
                Metrics::set(m.latency_ms, latency);
            }
            if report.breaker_changed {
                super::root::refresh_gauges(&self.plugin, now_ms);
            }
        }
        Some(ticket.endpoint)
    }

    /// After a failed attempt: dispatch the request to the next endpoint if allowed.
    /// Returns true when a call is in flight.
    fn fail_over(&mut self, failed: usize, outcome: &Outcome, now_ms: u64) -> bool {
        if !outcome.fails_over() || self.attempts >= self.plugin.cfg.max_attempts {
            return false;
        }
        loop {
            if self.attempts >= self.plugin.cfg.max_attempts {
                return false;
            }
            let (i, ticket) = match self.pick(now_ms) {
                Ok(p) => p,
                Err(NoEndpoint::BudgetExhausted) => {
                    Metrics::inc(self.plugin.metrics.retry_budget_exhausted);
                    debug!("computeflux: retry budget exhausted; passing the failure through");
                    return false;
                }
                Err(_) => return false,
            };
            if let Some(m) = self.plugin.metrics.endpoint(failed) {
                Metrics::inc(m.failovers);
            }
            self.current = Some(ticket);
            if self.dispatch(i) {
                self.served_by = Some(i);
                self.phase = Phase::FailingOver;
                return true;
            }
            // The cluster is unknown to Envoy (configuration mismatch): count it as a connect
            // failure of that endpoint and try the next one.
            warn!("computeflux: dispatch to endpoint {i} failed; is its cluster defined in Envoy?");
            self.finish(
                &Outcome::EndpointFailure(FailureKind::ConnectFailure),
                now_ms,
            );
        }
    }

    fn dispatch(&self, i: usize) -> bool {
        let Some(ep) = self.plugin.cfg.endpoints.get(i) else {
            return false;
        };
        let body = self.body.as_deref().unwrap_or(&[]);
        let content_length = body.len().to_string();
        let mut headers: Vec<(&str, &[u8])> =
            Vec::with_capacity(self.headers.len() + ep.headers.len() + 1);
        for (name, value) in &self.headers {
            let overridden = ep.headers.iter().any(|(n, _)| n == name);
            let framing = name == "content-length" || name == "transfer-encoding";
            if !overridden && !framing {
                headers.push((name.as_str(), value.as_slice()));
            }
        }
        for (name, value) in &ep.headers {
            headers.push((name.as_str(), value.as_bytes()));
        }
        if !body.is_empty() {
            headers.push(("content-length", content_length.as_bytes()));
        }
        let timeout = Duration::from_millis(self.plugin.cfg.failover_timeout_ms);
        let body_opt = if body.is_empty() { None } else { Some(body) };
        hostcalls::dispatch_http_call(
            &ep.cluster,
            headers_as_str(&headers),
            body_opt,
            vec![],
            timeout,
        )
        .is_ok()
    }

    fn expose(&self) -> Vec<(&'static str, String)> {
        if !self.plugin.cfg.expose_headers {
            return Vec::new();
        }
        let mut out = vec![(HEADER_ATTEMPTS, self.attempts.to_string())];
        if let Some(ep) = self
            .served_by
            .and_then(|i| self.plugin.cfg.endpoints.get(i))
        {
            out.push((HEADER_ENDPOINT, ep.name.clone()));
        }
        if let Some(a) = self.affinity {
            out.push((HEADER_AFFINITY, a.label().to_string()));
        }
        out
    }
}

/// `dispatch_http_call` takes `&str` values; header values that are not UTF-8 are dropped
/// from failover calls (Envoy itself only accepts visible ASCII in practice).
fn headers_as_str<'a>(headers: &[(&'a str, &'a [u8])]) -> Vec<(&'a str, &'a str)> {
    headers
        .iter()
        .filter_map(|(n, v)| std::str::from_utf8(v).ok().map(|v| (*n, v)))
        .collect()
}

fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.get(..end).unwrap_or("")
}

fn status_of(headers: &[(String, Bytes)]) -> Option<u16> {
    headers
        .iter()
        .find(|(n, _)| n == ":status")
        .and_then(|(_, v)| std::str::from_utf8(v).ok())
        .and_then(|s| s.trim().parse().ok())
}

/// The headers the classifier reads (rate-limit hints), as strings.
fn hint_headers(headers: &[(String, Bytes)]) -> Vec<(String, String)> {
    headers
        .iter()
        .filter(|(n, _)| n.starts_with("retry-after") || n.starts_with("x-ratelimit-reset"))
        .map(|(n, v)| (n.clone(), String::from_utf8_lossy(v).into_owned()))
        .collect()
}

impl Context for Http {
    fn on_http_call_response(
        &mut self,
        _token: u32,
        num_headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        if self.phase != Phase::FailingOver {
            return;
        }
        let now = host::now_ms();
        // num_headers == 0: the call failed (reset, timeout after headers); reading its headers
        // would panic in the SDK.
        let headers = if num_headers == 0 {
            Vec::new()
        } else {
            host::headers(MapType::HttpCallResponseHeaders)
        };
        let status = status_of(&headers);
        let outcome = match status {
            Some(s) => classify(s, &hint_headers(&headers), now),
            None => Outcome::EndpointFailure(FailureKind::Reset),
        };
        let Some(failed) = self.finish(&outcome, now) else {
            return;
        };
        if self.fail_over(failed, &outcome, now) {
            return;
        }
        self.phase = Phase::Done;
        let body = if body_size == 0 {
            Vec::new()
        } else {
            hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
                .ok()
                .flatten()
                .unwrap_or_default()
        };
        let Some(status) = status else {
            self.local_error(
                502,
                "server_error",
                "no_endpoint_available",
                "The upstream reset the connection.",
                None,
            );
            return;
        };
        // A failure Envoy synthesized for the call (connect refused, overflow) rather than an
        // upstream's answer: answer in the OpenAI shape, as the listener's local replies do.
        if status >= 500
            && !headers
                .iter()
                .any(|(n, _)| n == "x-envoy-upstream-service-time")
        {
            let name = self
                .served_by
                .and_then(|i| self.plugin.cfg.endpoints.get(i))
                .map_or("?", |e| e.name.as_str());
            let message =
                format!("Endpoint {name} is unavailable (no response from the upstream).");
            let body = openai_error(&message, "server_error", "upstream_unavailable");
            let expose = self.expose();
            let mut out: Vec<(&str, &[u8])> = vec![("content-type", b"application/json")];
            for (n, v) in &expose {
                out.push((n, v.as_bytes()));
            }
            host::send_response(u32::from(status), &out, body.as_bytes());
            return;
        }
        let expose = self.expose();
        let mut out: Vec<(&str, &[u8])> = headers
            .iter()
            .filter(|(n, _)| !n.starts_with(':') && !HOP_BY_HOP.contains(&n.as_str()))
            .filter(|(n, _)| !expose.iter().any(|(e, _)| e == n))
            .map(|(n, v)| (n.as_str(), v.as_slice()))
            .collect();
        for (n, v) in &expose {
            out.push((n, v.as_bytes()));
        }
        host::send_response(u32::from(status), &out, &body);
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let cfg = &self.plugin.cfg;
        // Clients must never pick clusters.
        host::remove_header(MapType::HttpRequestHeaders, &cfg.routing_header);
        let method = host::header_bytes(MapType::HttpRequestHeaders, ":method");
        self.headers = host::headers(MapType::HttpRequestHeaders);
        let routing = cfg.routing_header.clone();
        self.headers.retain(|(n, _)| *n != routing);
        if method.as_deref() != Some(b"POST") {
            return self.route();
        }
        if end_of_stream {
            return self.reject(&RequestError::EmptyBody);
        }
        let limit = cfg.max_body_bytes;
        let declared = host::header_str(MapType::HttpRequestHeaders, "content-length")
            .and_then(|v| v.trim().parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit) {
            return self.reject(&RequestError::TooLarge { limit });
        }
        self.session_header = host::header_bytes(MapType::HttpRequestHeaders, &cfg.session_header);
        self.tenant = host::header_bytes(MapType::HttpRequestHeaders, "authorization")
            .or_else(|| host::header_bytes(MapType::HttpRequestHeaders, "x-api-key"));
        self.phase = Phase::AwaitBody;
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.phase != Phase::AwaitBody {
            return Action::Continue;
        }
        let limit = self.plugin.cfg.max_body_bytes;
        if body_size as u64 > limit {
            return self.reject(&RequestError::TooLarge { limit });
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size)
            .ok()
            .flatten()
            .unwrap_or_default();
        let req = match parse_chat(&body) {
            Ok(r) => r,
            Err(e) => return self.reject(&e),
        };
        match derive_session(self.tenant.as_deref(), self.session_header.as_deref(), &req) {
            Ok((session, _)) => self.session = session,
            Err(e) => return self.reject(&e),
        }
        self.model = Some(req.model);
        self.body = Some(body);
        self.route()
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if self.phase != Phase::Routed {
            return Action::Continue;
        }
        let now = host::now_ms();
        let status = host::header_str(MapType::HttpResponseHeaders, ":status")
            .and_then(|s| s.trim().parse::<u16>().ok());
        let outcome = match status {
            // Rate-limit hints matter only on a 429: spare the other responses four host calls.
            Some(429) => {
                let hints: Vec<(String, String)> = [
                    "retry-after",
                    "retry-after-ms",
                    "x-ratelimit-reset-requests",
                    "x-ratelimit-reset-tokens",
                ]
                .iter()
                .filter_map(|n| {
                    host::header_str(MapType::HttpResponseHeaders, n).map(|v| (n.to_string(), v))
                })
                .collect();
                classify(429, &hints, now)
            }
            Some(s) => classify(s, &[], now),
            None => Outcome::EndpointFailure(FailureKind::Reset),
        };
        let Some(failed) = self.finish(&outcome, now) else {
            return Action::Continue;
        };
        if self.fail_over(failed, &outcome, now) {
            return Action::Pause;
        }
        self.phase = Phase::Done;
        for (name, value) in self.expose() {
            host::set_header(MapType::HttpResponseHeaders, name, Some(value.as_bytes()));
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, _body_size: usize, _end_of_stream: bool) -> Action {
        if self.phase == Phase::FailingOver {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    fn on_log(&mut self) {
        // An attempt still in flight: the client went away (or Envoy ended the stream) before
        // its outcome was seen. Release its in-flight count and probe slot.
        if self.current.is_some() {
            self.finish(&Outcome::Cancelled, host::now_ms());
        }
    }
}
