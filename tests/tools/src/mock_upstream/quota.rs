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
//!
//! With `per_model` each model has its own budget and window, as OpenAI limits a key per model
//! (`models` overrides the budget of named models: `{"m1": {"requests": 2, "tokens": null}}`),
//! and the headers of an answer state its model's counts.

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
    /// One budget per model (the request's `model`), else one for the key.
    pub per_model: bool,
    /// Budgets `(requests, tokens)` of named models, with `per_model`.
    pub models: BTreeMap<String, (Option<u64>, Option<u64>)>,
    /// Use in the current window, per model with `per_model`, else under `""`.
    uses: BTreeMap<String, Use>,
    /// 429s answered for an exhausted budget (all windows).
    pub rejected: u64,
    /// `(unix ms, tokens used in that window after it)` for each admitted request, the last
    /// [`USAGE_LOG_CAP`]: the bench reads it back to tell whether a key could still have served
    /// a turn that the router moved elsewhere (windows are aligned to multiples of `window_ms`).
    usage_log: std::collections::VecDeque<(u64, u64)>,
}

/// Entries kept in [`Quota`]'s usage log (a bench run admits a few thousand requests per key).
pub const USAGE_LOG_CAP: usize = 100_000;

/// One budget's use in its current window.
#[derive(Debug, Clone, Copy, Default)]
struct Use {
    window_start_ms: u64,
    used_requests: u64,
    used_tokens: u64,
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
            per_model: false,
            models: BTreeMap::new(),
            uses: BTreeMap::new(),
            rejected: 0,
            usage_log: std::collections::VecDeque::new(),
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
        let per_model = v.get("per_model").and_then(Value::as_bool).unwrap_or(false);
        let mut models = BTreeMap::new();
        if let Some(m) = v.get("models").and_then(Value::as_object) {
            for (name, b) in m {
                let n = |k: &str| b.get(k).and_then(Value::as_u64);
                models.insert(name.clone(), (n("requests"), n("tokens")));
            }
        }
        *self = Quota {
            requests,
            tokens,
            window_ms,
            family,
            headers,
            per_model,
            models,
            rejected: self.rejected,
            ..Quota::default()
        };
        Ok(())
    }

    /// The usage log (see the field) as `[[unix ms, tokens used], …]`, oldest first.
    pub fn usage_log_json(&self) -> Value {
        Value::Array(self.usage_log.iter().map(|(t, u)| json!([t, u])).collect())
    }

    pub fn to_json(&self) -> Value {
        json!({
            "requests": self.requests,
            "tokens": self.tokens,
            "window_ms": self.window_ms,
            "headers_family": self.family.label(),
            "headers": self.headers,
            "per_model": self.per_model,
            "used_requests": self.uses.values().map(|u| u.used_requests).sum::<u64>(),
            "used_tokens": self.uses.values().map(|u| u.used_tokens).sum::<u64>(),
            "rejected": self.rejected,
        })
    }

    /// Charges one request of `tokens` tokens for `model`, if the budget allows.
    pub fn charge(&mut self, tokens: u64, model: &str) -> Verdict {
        let now = now_ms();
        let key = if self.per_model { model } else { "" };
        let (b_requests, b_tokens) = self
            .models
            .get(key)
            .copied()
            .filter(|_| self.per_model)
            .unwrap_or((self.requests, self.tokens));
        let window_ms = self.window_ms;
        let u = self.uses.entry(key.to_string()).or_default();
        if now.saturating_sub(u.window_start_ms) >= window_ms {
            *u = Use {
                window_start_ms: now - now % window_ms,
                ..Use::default()
            };
        }
        let reset_in_ms = (u.window_start_ms + window_ms).saturating_sub(now).max(1);
        let over_requests = b_requests.is_some_and(|b| u.used_requests >= b);
        let over_tokens = b_tokens.is_some_and(|b| u.used_tokens.saturating_add(tokens) > b);
        if over_requests || over_tokens {
            let u = *u;
            self.rejected += 1;
            return Verdict::Reject(
                reset_in_ms.div_ceil(1000),
                self.family_headers(now, reset_in_ms, (b_requests, b_tokens), u),
            );
        }
        u.used_requests += 1;
        u.used_tokens = u.used_tokens.saturating_add(tokens);
        let u = *u;
        if self.usage_log.len() >= USAGE_LOG_CAP {
            self.usage_log.pop_front();
        }
        self.usage_log.push_back((now, u.used_tokens));
        let mut h = self.family_headers(now, reset_in_ms, (b_requests, b_tokens), u);
        h.extend(self.headers.iter().map(|(k, v)| (k.clone(), v.clone())));
        Verdict::Admit(h)
    }

    fn family_headers(
        &self,
        now: u64,
        reset_in_ms: u64,
        (requests, tokens): (Option<u64>, Option<u64>),
        u: Use,
    ) -> Vec<(String, String)> {
        let left = |budget: Option<u64>, used: u64| budget.map(|b| (b, b.saturating_sub(used)));
        let families = [
            ("requests", left(requests, u.used_requests)),
            ("tokens", left(tokens, u.used_tokens)),
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
        let Verdict::Admit(h) = q.charge(60, "m1") else {
            panic!()
        };
        assert!(h.contains(&("x-ratelimit-remaining-tokens".into(), "40".into())));
        assert!(h.contains(&("x-ratelimit-remaining-requests".into(), "1".into())));
        assert!(matches!(q.charge(41, "m2"), Verdict::Reject(..)));
        assert!(matches!(q.charge(40, "m1"), Verdict::Admit(_)));
        assert!(matches!(q.charge(0, "m1"), Verdict::Reject(..)));
        assert_eq!(q.rejected, 2);
        // Each admitted request is logged with the window's use after it.
        let used: Vec<u64> = q.usage_log.iter().map(|e| e.1).collect();
        assert_eq!(used, [60, 100]);
        assert_eq!(q.usage_log_json().as_array().map(Vec::len), Some(2));
    }

    /// Per model: each model has its own budget (named ones their own), and an answer's
    /// headers state its model's counts.
    #[test]
    fn per_model_budgets_are_separate() {
        let mut q = Quota::default();
        q.configure(
            &json!({"requests": 10, "window_ms": 600_000, "per_model": true,
            "models": {"m1": {"requests": 1}}}),
        )
        .unwrap();
        assert!(matches!(q.charge(5, "m1"), Verdict::Admit(_)));
        assert!(matches!(q.charge(5, "m1"), Verdict::Reject(..)));
        let Verdict::Admit(h) = q.charge(5, "m2") else {
            panic!()
        };
        assert!(h.contains(&("x-ratelimit-remaining-requests".into(), "9".into())));
        assert!(h.contains(&("x-ratelimit-limit-requests".into(), "10".into())));
    }
}
