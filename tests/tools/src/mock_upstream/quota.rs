//! A hosted API key's quota: a request and a token budget per fixed window.
//!
//! Each chat completion costs one request and `prompt + completion` tokens, charged when it is
//! admitted (as hosted APIs charge the estimate up front). Once either budget would be
//! exceeded the request gets a 429 with `Retry-After` (seconds to the window's end, at least 1)
//! until the window resets. Successful answers say what is left in one header family:
//! `openai` (`x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, resets as durations such
//! as `1m0s` / `250ms`), `anthropic` (`anthropic-ratelimit-{requests,tokens,input-tokens}-
//! {limit,remaining,reset}`, resets as RFC 3339 instants), or `none`. `headers` are added to
//! every successful answer after the family's own (tests use them to send hostile values).

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    OpenAi,
    Anthropic,
    None,
}

impl Family {
    pub fn parse(s: &str) -> Result<Family, String> {
        match s {
            "openai" => Ok(Family::OpenAi),
            "anthropic" => Ok(Family::Anthropic),
            "none" => Ok(Family::None),
            _ => Err(format!(
                "quota headers: expected openai|anthropic|none, got {s:?}"
            )),
        }
    }

    fn label(self) -> &'static str {
        match self {
            Family::OpenAi => "openai",
            Family::Anthropic => "anthropic",
            Family::None => "none",
        }
    }
}

/// The budget and its use in the current window.
#[derive(Debug, Clone)]
pub struct Quota {
    pub requests: Option<u64>,
    pub tokens: Option<u64>,
    pub window_ms: u64,
    pub family: Family,
    pub headers: BTreeMap<String, String>,
    window_start_ms: u64,
    used_requests: u64,
    used_tokens: u64,
    /// 429s answered for an exhausted budget (all windows).
    pub rejected: u64,
}

/// What the budget says about one request.
pub enum Verdict {
    /// Served: add these headers to the answer.
    Admit(Vec<(String, String)>),
    /// 429: Retry-After seconds and the headers of the answer.
    Reject(u64, Vec<(String, String)>),
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Default for Quota {
    fn default() -> Self {
        Quota {
            requests: None,
            tokens: None,
            window_ms: 60_000,
            family: Family::OpenAi,
            headers: BTreeMap::new(),
            window_start_ms: 0,
            used_requests: 0,
            used_tokens: 0,
            rejected: 0,
        }
    }
}

impl Quota {
    pub fn enabled(&self) -> bool {
        self.requests.is_some() || self.tokens.is_some() || !self.headers.is_empty()
    }

    /// Replaces the budget from `{"requests","tokens","window_ms","headers_family","headers"}`
    /// (`null` or absent budgets are unlimited); the window restarts, `rejected` is kept.
    pub fn configure(&mut self, v: &Value) -> Result<(), String> {
        let count = |k: &str| -> Result<Option<u64>, String> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(n) => n.as_u64().map(Some).ok_or(format!("{k}: expected a count")),
            }
        };
        let requests = count("requests")?;
        let tokens = count("tokens")?;
        let window_ms = count("window_ms")?.unwrap_or(60_000).max(1);
        let family = match v.get("headers_family").and_then(Value::as_str) {
            Some(s) => Family::parse(s)?,
            None => Family::OpenAi,
        };
        let mut headers = BTreeMap::new();
        if let Some(h) = v.get("headers").and_then(Value::as_object) {
            for (k, val) in h {
                let s = val
                    .as_str()
                    .ok_or(format!("headers.{k}: expected a string"))?;
                headers.insert(k.to_ascii_lowercase(), s.to_string());
            }
        }
        *self = Quota {
            requests,
            tokens,
            window_ms,
            family,
            headers,
            rejected: self.rejected,
            ..Quota::default()
        };
        Ok(())
    }

    pub fn to_json(&self) -> Value {
        json!({
            "requests": self.requests,
            "tokens": self.tokens,
            "window_ms": self.window_ms,
            "headers_family": self.family.label(),
            "headers": self.headers,
            "used_requests": self.used_requests,
            "used_tokens": self.used_tokens,
            "rejected": self.rejected,
        })
    }

    /// Charges one request of `tokens` tokens, if the budget allows.
    pub fn charge(&mut self, tokens: u64) -> Verdict {
        let now = now_ms();
        if now.saturating_sub(self.window_start_ms) >= self.window_ms {
            self.window_start_ms = now - now % self.window_ms;
            self.used_requests = 0;
            self.used_tokens = 0;
        }
        let reset_in_ms = (self.window_start_ms + self.window_ms)
            .saturating_sub(now)
            .max(1);
        let over_requests = self.requests.is_some_and(|b| self.used_requests >= b);
        let over_tokens = self
            .tokens
            .is_some_and(|b| self.used_tokens.saturating_add(tokens) > b);
        if over_requests || over_tokens {
            self.rejected += 1;
            return Verdict::Reject(
                reset_in_ms.div_ceil(1000),
                self.family_headers(now, reset_in_ms),
            );
        }
        self.used_requests += 1;
        self.used_tokens = self.used_tokens.saturating_add(tokens);
        let mut h = self.family_headers(now, reset_in_ms);
        h.extend(self.headers.iter().map(|(k, v)| (k.clone(), v.clone())));
        Verdict::Admit(h)
    }

    fn family_headers(&self, now: u64, reset_in_ms: u64) -> Vec<(String, String)> {
        let left = |budget: Option<u64>, used: u64| budget.map(|b| (b, b.saturating_sub(used)));
        let families = [
            ("requests", left(self.requests, self.used_requests)),
            ("tokens", left(self.tokens, self.used_tokens)),
        ];
        let mut out = Vec::new();
        for (what, budget) in families {
            let Some((limit, remaining)) = budget else {
                continue;
            };
            match self.family {
                Family::OpenAi => {
                    out.push((format!("x-ratelimit-limit-{what}"), limit.to_string()));
                    out.push((
                        format!("x-ratelimit-remaining-{what}"),
                        remaining.to_string(),
                    ));
                    out.push((
                        format!("x-ratelimit-reset-{what}"),
                        go_duration(reset_in_ms),
                    ));
                }
                Family::Anthropic => {
                    let reset = rfc3339(now + reset_in_ms);
                    let names: &[&str] = if what == "tokens" {
                        &["tokens", "input-tokens"]
                    } else {
                        &["requests"]
                    };
                    for n in names {
                        out.push((format!("anthropic-ratelimit-{n}-limit"), limit.to_string()));
                        out.push((
                            format!("anthropic-ratelimit-{n}-remaining"),
                            remaining.to_string(),
                        ));
                        out.push((format!("anthropic-ratelimit-{n}-reset"), reset.clone()));
                    }
                }
                Family::None => {}
            }
        }
        out
    }
}

/// `6m0s`, `1.5s`, `250ms`: the form OpenAI sends.
fn go_duration(ms: u64) -> String {
    if ms < 1_000 {
        return format!("{ms}ms");
    }
    let (m, rest) = (ms / 60_000, ms % 60_000);
    let secs = if rest % 1000 == 0 {
        format!("{}s", rest / 1000)
    } else {
        format!("{:.3}s", rest as f64 / 1000.0)
    };
    if m > 0 {
        format!("{m}m{secs}")
    } else {
        secs
    }
}

/// Unix ms as `YYYY-MM-DDTHH:MM:SSZ` (Howard Hinnant's civil_from_days).
pub fn rfc3339(ms: u64) -> String {
    let secs = ms.div_ceil(1000);
    let (days, sod) = (secs / 86_400, secs % 86_400);
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        sod / 3600,
        sod % 3600 / 60,
        sod % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(go_duration(250), "250ms");
        assert_eq!(go_duration(360_000), "6m0s");
        assert_eq!(go_duration(1_500), "1.500s");
        assert_eq!(rfc3339(1_796_054_400_000), "2026-11-30T16:00:00Z");
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
    }

    #[test]
    fn budget_runs_out_and_says_so() {
        let mut q = Quota::default();
        q.configure(&json!({"requests": 2, "tokens": 100, "window_ms": 600_000}))
            .unwrap();
        let Verdict::Admit(h) = q.charge(60) else {
            panic!()
        };
        assert!(h.contains(&("x-ratelimit-remaining-tokens".into(), "40".into())));
        assert!(h.contains(&("x-ratelimit-remaining-requests".into(), "1".into())));
        assert!(matches!(q.charge(41), Verdict::Reject(..)));
        assert!(matches!(q.charge(40), Verdict::Admit(_)));
        assert!(matches!(q.charge(0), Verdict::Reject(..)));
        assert_eq!(q.rejected, 2);
    }
}
