//! What goes out of a request's lifecycle besides routing: the failover call to send, the
//! headers that explain an answer, and what the client finally gets after a failover (the
//! call's answer relayed, or a reply saying why not) or when no endpoint can take the request.

use super::{
    Flow, HEADER_AFFINITY, HEADER_ATTEMPTS, HEADER_ENDPOINT, MAX_RELAYED_ANSWER_BYTES,
    UPSTREAM_MARKER,
};
use super::{Observer, Step};
use crate::scheduler::config::{Config, EndpointConfig};
use crate::scheduler::health::blame;
use crate::scheduler::routing::select::NoEndpoint;
use crate::scheduler::wire::headers::{HeaderSource, Pairs};
use crate::scheduler::wire::reply::{RejectReason, Reply};
use crate::scheduler::wire::request::MAX_MODEL_BYTES;
use crate::scheduler::wire::text;

/// Response headers never copied from a failover answer into the local reply: Envoy frames
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

/// A failover call to send: the request as the client sent it (routing header removed, the
/// endpoint's headers applied, framing recomputed by the host), to `cluster`.
#[derive(Debug, PartialEq, Eq)]
pub struct Call<'a> {
    pub cluster: &'a str,
    pub headers: Pairs,
    pub body: &'a [u8],
    pub trailers: &'a [(String, Vec<u8>)],
    pub timeout_ms: u64,
}

impl Flow {
    /// The failover call to endpoint `i`.
    pub fn call<'a>(&'a self, cfg: &'a Config, i: usize) -> Option<Call<'a>> {
        let ep = cfg.endpoints.get(i)?;
        let mut headers: Pairs = Vec::with_capacity(self.headers.len() + ep.headers.len() + 1);
        for (name, value) in self.headers.iter() {
            let overridden = ep.headers.iter().any(|(n, _)| *n == name);
            let framing = name == "content-length" || name == "transfer-encoding";
            if !overridden && !framing && !blame::withheld(ep, &name) {
                headers.push((name.into_owned(), value.to_vec()));
            }
        }
        for (name, value) in &ep.headers {
            headers.push((name.clone(), value.clone().into_bytes()));
        }
        if let Some(d) = self.destination(cfg, i) {
            headers.push((cfg.destination_header.clone(), d.into_bytes()));
        }
        if !self.body.is_empty() {
            headers.push((
                "content-length".into(),
                self.body.len().to_string().into_bytes(),
            ));
        }
        Some(Call {
            cluster: &ep.cluster,
            headers,
            body: &self.body,
            trailers: &self.trailers,
            timeout_ms: cfg.failover_timeout_ms,
        })
    }

    /// The `x-computeflux-*` headers explaining the answer (empty unless `expose_headers`).
    pub fn exposed(&self, cfg: &Config) -> Vec<(&'static str, String)> {
        if !cfg.expose_headers {
            return Vec::new();
        }
        let mut out = vec![(HEADER_ATTEMPTS, self.attempts.to_string())];
        if let Some(ep) = self.endpoint(cfg) {
            out.push((HEADER_ENDPOINT, ep.name.clone()));
        }
        if let Some(a) = self.affinity {
            out.push((HEADER_AFFINITY, a.label().to_string()));
        }
        if let Some(ms) = self.waited_ms() {
            out.push((super::admit::HEADER_QUEUED_MS, ms.to_string()));
        }
        out
    }

    pub(super) fn endpoint<'a>(&self, cfg: &'a Config) -> Option<&'a EndpointConfig> {
        self.served_by.and_then(|i| cfg.endpoints.get(i))
    }

    /// What the client gets for the last failover call's answer.
    pub(super) fn call_answer(
        &mut self,
        cfg: &Config,
        obs: &mut dyn Observer,
        status: Option<u16>,
        headers: Pairs,
        body_size: usize,
    ) -> Step {
        // Endpoint names only where the operator shows them (`expose_headers`).
        let (name, subject) = match self.endpoint(cfg) {
            Some(e) if cfg.expose_headers => (
                format!("endpoint {}", e.name),
                format!("Endpoint {}", e.name),
            ),
            _ => ("the endpoint".to_string(), "The endpoint".to_string()),
        };
        let refusal = match status {
            None => Some(Reply::new(
                502,
                RejectReason::UpstreamUnavailable,
                &format!("{subject} reset the connection before answering."),
            )),
            Some(_) if body_size > MAX_RELAYED_ANSWER_BYTES => Some(Reply::new(
                502,
                RejectReason::FailoverAnswerTooLarge,
                &format!(
                    "The answer of {name} ({body_size} bytes) exceeds the \
                     {MAX_RELAYED_ANSWER_BYTES} bytes the filter relays after a failover."
                ),
            )),
            // A failure Envoy synthesized for the call (connect refused, overflow) rather than
            // an upstream's answer: answer in the OpenAI shape, as the listener's replies do.
            Some(s) if s >= 500 && headers.header(UPSTREAM_MARKER).is_none() => Some(Reply::new(
                s,
                RejectReason::UpstreamUnavailable,
                &format!("{subject} is unavailable (no response from the upstream)."),
            )),
            Some(_) => None,
        };
        let expose = self.exposed(cfg);
        if let Some(mut reply) = refusal {
            reply.headers.extend(expose);
            return self.reply(obs, reply);
        }
        let mut out: Pairs = headers
            .into_iter()
            .filter(|(n, _)| !n.starts_with(':') && !HOP_BY_HOP.contains(&n.as_str()))
            .filter(|(n, _)| !expose.iter().any(|(e, _)| e == n))
            .collect();
        out.extend(
            expose
                .into_iter()
                .map(|(n, v)| (n.to_string(), v.into_bytes())),
        );
        if status.is_some_and(|s| (200..300).contains(&s)) {
            if let Some(c) = &self.pin_cookie {
                out.push(("set-cookie".to_string(), c.clone().into_bytes()));
            }
            self.scan_usage(cfg, &out);
        }
        Step::RelayCall {
            status: status.unwrap_or(502),
            headers: out,
            body_size,
        }
    }

    /// The first attempt found no endpoint: say why.
    pub(super) fn no_endpoint(
        &mut self,
        obs: &mut dyn Observer,
        no: NoEndpoint,
        now_ms: u64,
    ) -> Step {
        let reply = match no {
            NoEndpoint::ModelNotFound => {
                let model = self.model.as_deref().unwrap_or("");
                Reply::new(
                    404,
                    RejectReason::ModelNotFound,
                    &format!(
                        "The model `{}` does not exist or no endpoint serves it.",
                        text::truncate(model, MAX_MODEL_BYTES)
                    ),
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
                    Reply::new(429, RejectReason::RateLimited, &msg).retry_after(secs)
                } else {
                    let msg = format!(
                        "No endpoint for this model is available right now; retry in {secs} s."
                    );
                    Reply::new(503, RejectReason::NoEndpointAvailable, &msg).retry_after(secs)
                }
            }
            NoEndpoint::Exhausted | NoEndpoint::BudgetExhausted => Reply::new(
                503,
                RejectReason::NoEndpointAvailable,
                "No endpoint for this model is available right now.",
            )
            .retry_after(1),
        };
        self.reply(obs, reply)
    }
}
