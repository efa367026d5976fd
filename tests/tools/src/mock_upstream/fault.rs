//! Injected faults, set with `POST /_mock/fault`.
//!
//! Why: the balancer's breaker, failover and Retry-After handling can only be tested against an
//! upstream that fails on command, in each of the ways real inference servers fail.

use serde_json::{json, Map, Value};

/// What the next chat-completion requests suffer.
#[derive(Clone, Debug, PartialEq)]
pub enum Mode {
    None,
    /// Answer `status` with an OpenAI error body (or `body`), a `Retry-After` header if given, and
    /// the extra `headers`.
    Status {
        status: u16,
        retry_after: Option<String>,
        headers: Vec<(String, String)>,
        body: Option<String>,
    },
    /// Multiply the simulated latency (prefill and decode) by `factor`.
    Slow {
        factor: f64,
    },
    /// Add `ms` milliseconds before the response headers.
    DelayMs {
        ms: u64,
    },
    /// Serve normally, with an `x_padding` field of `bytes` bytes in a non-streamed answer
    /// (large answers, e.g. for the failover relay limit).
    Pad {
        bytes: u64,
    },
    /// Serve normally, without `usage` (no usage object, no usage chunk).
    NoUsage,
    /// Serve a streamed answer's headers and first half of its chunks, then close the
    /// connection (TCP RST): a stream cut mid-way. A non-streamed answer is served normally.
    Cut,
    /// Close the connection without answering (TCP RST).
    Reset,
    /// Never answer (until the client gives up).
    Hang,
    /// Stop listening (connects are refused) and drop open connections.
    Refuse,
}

/// The current fault: a mode, optionally limited to the next `count` requests, and for `refuse`
/// optionally lifted after `for_ms`.
#[derive(Clone, Debug, PartialEq)]
pub struct Fault {
    pub mode: Mode,
    pub count: Option<u64>,
    pub for_ms: Option<u64>,
    /// Only requests carrying this header (lower case) suffer the fault (as OpenAI refuses a
    /// valid key sent with a mismatched `OpenAI-Organization` header); others are served.
    pub when_header: Option<String>,
}

impl Fault {
    pub fn none() -> Self {
        Fault {
            mode: Mode::None,
            count: None,
            for_ms: None,
            when_header: None,
        }
    }

    pub fn parse(v: &Value) -> Result<Fault, String> {
        let obj = v.as_object().ok_or("fault must be a JSON object")?;
        let mode_name = obj
            .get("mode")
            .and_then(Value::as_str)
            .ok_or("fault.mode must be a string")?;
        let count = opt_u64(obj, "count")?;
        if count == Some(0) {
            return Err("fault.count must be > 0".into());
        }
        let for_ms = opt_u64(obj, "for_ms")?;
        let mode = match mode_name {
            "none" => Mode::None,
            "status" => {
                let status = opt_u64(obj, "status")?.ok_or("fault.status is required")?;
                if !(100..=599).contains(&status) {
                    return Err(format!("fault.status must be in 100..=599, got {status}"));
                }
                let retry_after = match obj.get("retry_after") {
                    None | Some(Value::Null) => None,
                    Some(Value::String(s)) => Some(s.clone()),
                    Some(Value::Number(n)) => Some(n.to_string()),
                    Some(_) => return Err("fault.retry_after must be a string or number".into()),
                };
                let mut headers = Vec::new();
                if let Some(h) = obj.get("headers") {
                    let h = h.as_object().ok_or("fault.headers must be an object")?;
                    for (k, v) in h {
                        let v = v
                            .as_str()
                            .ok_or_else(|| format!("fault.headers.{k} must be a string"))?;
                        headers.push((k.to_ascii_lowercase(), v.to_string()));
                    }
                }
                let body = obj.get("body").and_then(Value::as_str).map(str::to_string);
                Mode::Status {
                    status: status as u16,
                    retry_after,
                    headers,
                    body,
                }
            }
            "slow" => {
                let factor = obj
                    .get("factor")
                    .and_then(Value::as_f64)
                    .ok_or("fault.factor must be a number")?;
                if !(factor.is_finite() && factor >= 0.0) {
                    return Err(format!("fault.factor must be >= 0, got {factor}"));
                }
                Mode::Slow { factor }
            }
            "delay_ms" => Mode::DelayMs {
                ms: opt_u64(obj, "ms")?.ok_or("fault.ms is required")?,
            },
            "pad" => Mode::Pad {
                bytes: opt_u64(obj, "bytes")?.ok_or("fault.bytes is required")?,
            },
            "no_usage" => Mode::NoUsage,
            "cut" => Mode::Cut,
            "reset" => Mode::Reset,
            "hang" => Mode::Hang,
            "refuse" => Mode::Refuse,
            other => return Err(format!("unknown fault.mode {other:?}")),
        };
        let when_header = match obj.get("when_header") {
            None | Some(Value::Null) => None,
            Some(Value::String(h)) => Some(h.to_ascii_lowercase()),
            Some(_) => return Err("fault.when_header must be a string".into()),
        };
        Ok(Fault {
            mode,
            count,
            for_ms,
            when_header,
        })
    }

    pub fn to_json(&self) -> Value {
        let mut v = match &self.mode {
            Mode::None => json!({"mode": "none"}),
            Mode::Status {
                status,
                retry_after,
                headers,
                body,
            } => {
                let h: Map<String, Value> = headers
                    .iter()
                    .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                    .collect();
                json!({"mode": "status", "status": status, "retry_after": retry_after,
                       "headers": h, "body": body})
            }
            Mode::Slow { factor } => json!({"mode": "slow", "factor": factor}),
            Mode::DelayMs { ms } => json!({"mode": "delay_ms", "ms": ms}),
            Mode::Pad { bytes } => json!({"mode": "pad", "bytes": bytes}),
            Mode::NoUsage => json!({"mode": "no_usage"}),
            Mode::Cut => json!({"mode": "cut"}),
            Mode::Reset => json!({"mode": "reset"}),
            Mode::Hang => json!({"mode": "hang"}),
            Mode::Refuse => json!({"mode": "refuse"}),
        };
        if let Some(obj) = v.as_object_mut() {
            if let Some(c) = self.count {
                obj.insert("count".into(), json!(c));
            }
            if let Some(ms) = self.for_ms {
                obj.insert("for_ms".into(), json!(ms));
            }
            if let Some(h) = &self.when_header {
                obj.insert("when_header".into(), json!(h));
            }
        }
        v
    }

    /// The mode that applies to one request carrying `has_header`'s headers; consumes one
    /// unit of `count` when it applies.
    pub fn take(&mut self, has_header: impl Fn(&str) -> bool) -> Mode {
        if self.when_header.as_deref().is_some_and(|h| !has_header(h)) {
            return Mode::None;
        }
        let mode = self.mode.clone();
        if let Some(c) = self.count.as_mut() {
            *c = c.saturating_sub(1);
            if *c == 0 {
                *self = Fault::none();
            }
        }
        mode
    }

    /// The short label used in request records and `status_counts` for faults with no status.
    pub fn label(mode: &Mode) -> Option<&'static str> {
        match mode {
            Mode::Reset => Some("reset"),
            Mode::Hang => Some("hang"),
            _ => None,
        }
    }
}

fn opt_u64(obj: &Map<String, Value>, key: &str) -> Result<Option<u64>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| format!("fault.{key} must be a non-negative integer")),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn count_expires() {
        let mut f =
            Fault::parse(&json!({"mode":"status","status":429,"retry_after":2,"count":2})).unwrap();
        assert!(matches!(
            f.take(|_| false),
            Mode::Status { status: 429, .. }
        ));
        assert!(matches!(
            f.take(|_| false),
            Mode::Status { status: 429, .. }
        ));
        assert_eq!(f.take(|_| false), Mode::None);
    }

    #[test]
    fn rejects_bad() {
        assert!(Fault::parse(&json!({"mode":"status"})).is_err());
        assert!(Fault::parse(&json!({"mode":"bogus"})).is_err());
        assert!(Fault::parse(&json!({"mode":"slow","factor":-1})).is_err());
    }
}
