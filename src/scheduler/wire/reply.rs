//! The answers the filter gives itself, in the OpenAI error shape.
//!
//! Why one place: every local reply (a refused request, no endpoint left, a failover that
//! cannot be relayed) must be the same JSON shape with a bounded message, and every one is
//! counted under its [`RejectReason`] in `computeflux_rejected_total`. The metric's label list
//! is [`RejectReason::ALL`], so a reason added here gets its series without another edit.

use crate::scheduler::wire::text;

/// Longest message a reply carries; longer ones are cut (on a character boundary).
pub const MAX_MESSAGE_BYTES: usize = 512;

/// Why the filter answered a request itself (the `code` of the error body, and the `reason`
/// label of `computeflux_rejected_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectReason {
    EmptyBody,
    RequestTooLarge,
    InvalidJson,
    InvalidRequestBody,
    MissingModel,
    InvalidModel,
    ModelNotFound,
    NoEndpointAvailable,
    RateLimited,
    /// The last endpoint tried gave no answer of its own (Envoy synthesized the failure).
    UpstreamUnavailable,
    /// A failover call's answer is larger than [`crate::scheduler::flow::MAX_RELAYED_ANSWER_BYTES`].
    FailoverAnswerTooLarge,
    /// The body's content type contradicts its API (415).
    UnsupportedContentType,
    /// A multipart form that cannot be read.
    InvalidMultipart,
    /// `previous_response_id` names a response no configured endpoint can hold any more.
    PreviousResponseNotFound,
    /// The endpoint holding `previous_response_id` cannot take the request now.
    PreviousResponseUnavailable,
    /// The request path is ambiguous or not in canonical form (`path`).
    InvalidPath,
    /// The fleet is full and the admission queue has no place for the request (or it is
    /// sheddable).
    QueueFull,
    /// The request waited for admission as long as it may.
    QueueTimeout,
}

impl RejectReason {
    /// Every reason, in metric order.
    pub const ALL: &'static [RejectReason] = &[
        RejectReason::EmptyBody,
        RejectReason::RequestTooLarge,
        RejectReason::InvalidJson,
        RejectReason::InvalidRequestBody,
        RejectReason::MissingModel,
        RejectReason::InvalidModel,
        RejectReason::ModelNotFound,
        RejectReason::NoEndpointAvailable,
        RejectReason::RateLimited,
        RejectReason::UpstreamUnavailable,
        RejectReason::FailoverAnswerTooLarge,
        RejectReason::UnsupportedContentType,
        RejectReason::InvalidMultipart,
        RejectReason::PreviousResponseNotFound,
        RejectReason::PreviousResponseUnavailable,
        RejectReason::InvalidPath,
        RejectReason::QueueFull,
        RejectReason::QueueTimeout,
    ];

    /// The error `code`, also the metric label.
    pub fn label(self) -> &'static str {
        match self {
            RejectReason::EmptyBody => "empty_body",
            RejectReason::RequestTooLarge => "request_too_large",
            RejectReason::InvalidJson => "invalid_json",
            RejectReason::InvalidRequestBody => "invalid_request_body",
            RejectReason::MissingModel => "missing_model",
            RejectReason::InvalidModel => "invalid_model",
            RejectReason::ModelNotFound => "model_not_found",
            RejectReason::NoEndpointAvailable => "no_endpoint_available",
            RejectReason::RateLimited => "rate_limited",
            RejectReason::UpstreamUnavailable => "upstream_unavailable",
            RejectReason::FailoverAnswerTooLarge => "failover_answer_too_large",
            RejectReason::UnsupportedContentType => "unsupported_content_type",
            RejectReason::InvalidMultipart => "invalid_multipart",
            RejectReason::PreviousResponseNotFound => "previous_response_not_found",
            RejectReason::PreviousResponseUnavailable => "previous_response_unavailable",
            RejectReason::InvalidPath => "invalid_path",
            RejectReason::QueueFull => "queue_full",
            RejectReason::QueueTimeout => "queue_timeout",
        }
    }

    /// The error `type`.
    pub fn kind(self) -> &'static str {
        match self {
            RejectReason::RateLimited | RejectReason::QueueFull | RejectReason::QueueTimeout => {
                "rate_limit_error"
            }
            RejectReason::NoEndpointAvailable
            | RejectReason::UpstreamUnavailable
            | RejectReason::FailoverAnswerTooLarge
            | RejectReason::PreviousResponseUnavailable => "server_error",
            _ => "invalid_request_error",
        }
    }
}

/// A local reply: status, OpenAI error body, and the headers that go with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    pub reason: RejectReason,
    /// At most [`MAX_MESSAGE_BYTES`].
    pub message: String,
    /// Headers besides `content-type` (`retry-after`, the `x-computeflux-*` explanations).
    pub headers: Vec<(&'static str, String)>,
}

impl Reply {
    pub fn new(status: u16, reason: RejectReason, message: &str) -> Reply {
        Reply {
            status,
            reason,
            message: text::truncate(message, MAX_MESSAGE_BYTES).to_string(),
            headers: Vec::new(),
        }
    }

    /// Adds `retry-after: <secs>`.
    pub fn retry_after(mut self, secs: u64) -> Reply {
        self.headers.push(("retry-after", secs.to_string()));
        self
    }

    /// The body: `{"error":{"message","type","param","code"}}`.
    pub fn body(&self) -> String {
        openai_error(&self.message, self.reason.kind(), self.reason.label())
    }
}

/// The OpenAI error body: `{"error":{"message","type","param","code"}}`.
pub fn openai_error(message: &str, kind: &str, code: &str) -> String {
    serde_json::json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn labels_are_distinct_and_bodies_are_openai_errors() {
        let mut labels: Vec<&str> = RejectReason::ALL.iter().map(|r| r.label()).collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), RejectReason::ALL.len());
        let r = Reply::new(429, RejectReason::RateLimited, "slow down").retry_after(3);
        let v: serde_json::Value = serde_json::from_str(&r.body()).unwrap();
        assert_eq!(v["error"]["code"], "rate_limited");
        assert_eq!(v["error"]["type"], "rate_limit_error");
        assert!(v["error"]["param"].is_null());
        assert_eq!(r.headers, vec![("retry-after", "3".to_string())]);
    }

    #[test]
    fn messages_are_bounded_without_splitting_characters() {
        let r = Reply::new(400, RejectReason::InvalidJson, &"é".repeat(1000));
        assert_eq!(r.message.len(), MAX_MESSAGE_BYTES);
        let r = Reply::new(
            400,
            RejectReason::InvalidJson,
            &format!("a{}", "é".repeat(1000)),
        );
        assert_eq!(r.message.len(), MAX_MESSAGE_BYTES - 1);
    }
}
