//! An endpoint's optional `metrics` object: where and how often its engine's own `/metrics`
//! page is scraped.
//!
//! Why a file of its own: the keys are nested under each endpoint (`endpoints[i].metrics.*`),
//! so they are validated here, by [`parse`], and documented as dotted rows of the endpoint
//! table ([`metrics_keys`], appended to `config::endpoint_keys`). `config.rs` calls [`parse`]
//! for an endpoint that has the object; an endpoint without it (a hosted API key) is never
//! scraped and keeps the behaviour it had before scraping existed.
//!
//! Defaults: `path` `/metrics`, `format` `auto`, `interval_ms` 250 (100..=60000; see
//! [`DEFAULT_INTERVAL_MS`] for why so often),
//! `timeout_ms` 500 (10..=60000), `cluster` the endpoint's own cluster, `authority` the scrape
//! cluster's name. A scraped load is trusted for [`MetricsConfig::stale_after_ms`] after the
//! scrape that produced it.

use super::{is_header_value, ConfigError, KeyDoc};

/// Which engine's metric names to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Vllm,
    Sglang,
    Llamacpp,
    Tgi,
    /// Whichever engine's names the body holds most families of (ties: vLLM, SGLang,
    /// llama.cpp, TGI).
    Auto,
}

impl Format {
    /// The configuration spelling: `vllm`, `sglang`, `llamacpp`, `tgi`, `auto`.
    pub fn from_name(name: &str) -> Option<Format> {
        match name {
            "vllm" => Some(Format::Vllm),
            "sglang" => Some(Format::Sglang),
            "llamacpp" => Some(Format::Llamacpp),
            "tgi" => Some(Format::Tgi),
            "auto" => Some(Format::Auto),
            _ => None,
        }
    }
}
use serde_json::Value;

/// How one endpoint's engine is scraped (validated; `cluster` and `authority` resolved).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsConfig {
    /// The request path, e.g. `/metrics`.
    pub path: String,
    pub format: Format,
    /// Time between the starts of two scrapes of this endpoint.
    pub interval_ms: u64,
    /// Timeout of one scrape call.
    pub timeout_ms: u64,
    /// The Envoy cluster the scrape call goes to.
    pub cluster: String,
    /// The `:authority` of the scrape call.
    pub authority: String,
}

/// Spellings of [`Format`] in the configuration, in the order the docs list them.
pub const FORMATS: &[&str] = &["auto", "vllm", "sglang", "llamacpp", "tgi"];

pub const DEFAULT_PATH: &str = "/metrics";
/// Four scrapes a second: the engine's decode pace judges a slowed engine degraded at the
/// first scrape whose window lies mostly after the onset (`scrape::Scraped::pace`), so every
/// request sent there meanwhile pays the slowdown. At 1000 ms that took 1.3–2.2 s on the
/// bench's `slow` run (three replicas, each scraping on its own phase), and the requests sent
/// to the slowed engine in that time were half of those above 1.5 × the steady p99. The cost
/// is one small GET per endpoint per interval per Envoy process (the Gateway API Inference
/// Extension's endpoint picker polls every 50 ms by default).
pub const DEFAULT_INTERVAL_MS: u64 = 250;
pub const MIN_INTERVAL_MS: u64 = 100;
pub const MAX_INTERVAL_MS: u64 = 60_000;
pub const DEFAULT_TIMEOUT_MS: u64 = 500;
pub const MIN_TIMEOUT_MS: u64 = 10;
pub const MAX_TIMEOUT_MS: u64 = 60_000;
/// Scrapes that may be missed (late, failed or lost with their worker) before a load is stale.
pub const STALE_INTERVALS: u64 = 3;

impl MetricsConfig {
    /// How long a successful scrape's load stays [`super::scrape::LoadState::Known`]: three
    /// intervals plus one timeout, so that one or two late or lost scrapes (a lease handover
    /// waits up to its lease) do not make every load unknown at once.
    pub fn stale_after_ms(&self) -> u64 {
        self.interval_ms
            .saturating_mul(STALE_INTERVALS)
            .saturating_add(self.timeout_ms)
    }

    /// The configuration spelling of [`MetricsConfig::format`].
    pub fn format_name(&self) -> &'static str {
        match self.format {
            Format::Auto => "auto",
            Format::Vllm => "vllm",
            Format::Sglang => "sglang",
            Format::Llamacpp => "llamacpp",
            Format::Tgi => "tgi",
        }
    }
}

/// The documented rows of `metrics` and its keys (`metrics.path`, …).
pub fn metrics_keys() -> Vec<KeyDoc> {
    let row = |key, kind: &str, default: String, bounds: String, effect| KeyDoc {
        key,
        kind: kind.into(),
        default,
        bounds,
        effect,
    };
    vec![
        row("metrics", "object", "(absent: not scraped)".into(), "keys below".into(),
            "Scrape this endpoint's inference engine's own Prometheus `/metrics` (vLLM, SGLang, llama.cpp `--metrics`, TGI) for its queue, running batch, KV-cache usage and decode pace (the decode-time counters that judge it slow against its peers, see [decisions](routing.md#judging-endpoints)). One worker per Envoy process scrapes (a lease in shared data) and every worker reads the result; see [metrics](metrics.md) for the scraped gauges. Leave it out for hosted API keys."),
        row("metrics.path", "string", DEFAULT_PATH.into(), "starts with `/`, 1..=1024 printable bytes".into(),
            "Path of the engine's metrics page."),
        row("metrics.format", "string", "auto".into(), format!("one of {}", FORMATS.join(", ")),
            "Which engine's metric names to read: `vllm` (`vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc` or the older `vllm:gpu_cache_usage_perc`), `sglang` (`sglang:` or `sglang_` `num_queue_reqs`, `num_running_reqs`, `token_usage`), `llamacpp` (`llamacpp:requests_deferred`, `llamacpp:requests_processing`), `tgi` (`tgi_queue_size`, `tgi_batch_current_size`); `auto` picks the engine whose names the page holds. The decode pace is read from vLLM's `inter_token_latency_seconds` (else `time_per_output_token_seconds`, else `request_time_per_output_token_seconds`) `_sum` / `_count`, SGLang's `inter_token_latency_seconds`, llama.cpp's `tokens_predicted_seconds_total` / `tokens_predicted_total` (TGI: none). Series are summed over data-parallel ranks and filtered by the endpoint's `models`."),
        row("metrics.interval_ms", "integer", DEFAULT_INTERVAL_MS.to_string(), format!("{MIN_INTERVAL_MS}..={MAX_INTERVAL_MS}"),
            "Time between two scrapes of the endpoint (per Envoy process, not per worker). A load is trusted for 3 intervals plus `timeout_ms` after its scrape, then counts as unknown."),
        row("metrics.timeout_ms", "integer", DEFAULT_TIMEOUT_MS.to_string(), format!("{MIN_TIMEOUT_MS}..={MAX_TIMEOUT_MS}"),
            "Timeout of one scrape; a scrape that times out counts as failed (`computeflux_scrape_errors_total`, error `timeout`). At most one scrape per endpoint is in flight."),
        row("metrics.cluster", "string", "(the endpoint's cluster)".into(), "1..=255 bytes, an Envoy cluster name".into(),
            "The Envoy cluster the scrape goes to, when the metrics are served elsewhere than the API (another port)."),
        row("metrics.authority", "string", "(the scrape cluster's name)".into(), "1..=255 printable bytes".into(),
            "The `:authority` (Host) of the scrape request."),
    ]
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

struct Errors<'a> {
    at: String,
    errors: &'a mut Vec<ConfigError>,
}

impl Errors<'_> {
    fn push(&mut self, key: &str, problem: String) {
        self.errors.push(ConfigError {
            field: format!("{}.{key}", self.at),
            problem,
        });
    }

    fn int(
        &mut self,
        obj: &serde_json::Map<String, Value>,
        key: &str,
        min: u64,
        max: u64,
    ) -> Option<u64> {
        let v = obj.get(key)?;
        match v.as_u64() {
            Some(n) if (min..=max).contains(&n) => Some(n),
            Some(n) => {
                self.push(key, format!("must be in {min}..={max}, got {n}"));
                None
            }
            None => {
                let got = match v.as_f64() {
                    Some(x) => x.to_string(),
                    None => type_name(v).to_string(),
                };
                self.push(
                    key,
                    format!("must be an integer in {min}..={max}, got {got}"),
                );
                None
            }
        }
    }

    fn text(
        &mut self,
        obj: &serde_json::Map<String, Value>,
        key: &str,
        max: usize,
        ok: impl Fn(&str) -> bool,
        what: &str,
    ) -> Option<String> {
        let v = obj.get(key)?;
        match v.as_str() {
            Some(s) if !s.is_empty() && s.len() <= max && is_header_value(s) && ok(s) => {
                Some(s.to_string())
            }
            Some(s) => {
                self.push(key, format!("must be {what}, got {s:?}"));
                None
            }
            None => {
                self.push(key, format!("must be a string, got {}", type_name(v)));
                None
            }
        }
    }
}

/// Validates `endpoints[i].metrics` (`at` is that path). Every problem is pushed onto `errors`
/// with its full field path; `None` when there was one.
pub fn parse(
    at: &str,
    value: &Value,
    endpoint_cluster: &str,
    errors: &mut Vec<ConfigError>,
) -> Option<MetricsConfig> {
    let before = errors.len();
    let mut e = Errors {
        at: at.to_string(),
        errors,
    };
    let Some(obj) = value.as_object() else {
        e.errors.push(ConfigError {
            field: at.to_string(),
            problem: format!("must be an object, got {}", type_name(value)),
        });
        return None;
    };
    let known = metrics_keys();
    for key in obj.keys() {
        let dotted = format!("metrics.{key}");
        if !known.iter().any(|k| k.key == dotted) {
            let names: Vec<&str> = known
                .iter()
                .filter_map(|k| k.key.strip_prefix("metrics."))
                .collect();
            let plain = !key.is_empty()
                && key
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_-".contains(&b));
            let shown = if plain {
                key.clone()
            } else {
                Value::String(key.clone()).to_string()
            };
            e.errors.push(ConfigError {
                field: format!("{at}.{shown}"),
                problem: format!("is not a known key (known: {})", names.join(", ")),
            });
        }
    }
    let path = e
        .text(
            obj,
            "path",
            1024,
            |s| s.starts_with('/') && !s.contains([' ', '\t']),
            "a path starting with / without blanks, 1..=1024 printable bytes",
        )
        .unwrap_or_else(|| DEFAULT_PATH.to_string());
    let format = match obj.get("format") {
        None => Format::Auto,
        Some(v) => match v.as_str().map(|s| (s, Format::from_name(s))) {
            Some((_, Some(f))) => f,
            Some((s, None)) => {
                e.push(
                    "format",
                    format!("must be one of {}, got {s:?}", FORMATS.join(", ")),
                );
                Format::Auto
            }
            None => {
                e.push("format", format!("must be a string, got {}", type_name(v)));
                Format::Auto
            }
        },
    };
    let interval_ms = e
        .int(obj, "interval_ms", MIN_INTERVAL_MS, MAX_INTERVAL_MS)
        .unwrap_or(DEFAULT_INTERVAL_MS);
    let timeout_ms = e
        .int(obj, "timeout_ms", MIN_TIMEOUT_MS, MAX_TIMEOUT_MS)
        .unwrap_or(DEFAULT_TIMEOUT_MS);
    let cluster = e
        .text(obj, "cluster", 255, |_| true, "1..=255 printable bytes")
        .unwrap_or_else(|| endpoint_cluster.to_string());
    let authority = e
        .text(
            obj,
            "authority",
            255,
            |s| !s.contains([' ', '\t']),
            "1..=255 printable bytes without blanks",
        )
        .unwrap_or_else(|| cluster.clone());
    if e.errors.len() > before {
        return None;
    }
    Some(MetricsConfig {
        path,
        format,
        interval_ms,
        timeout_ms,
        cluster,
        authority,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::config::Config;
    use serde_json::json;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn errors(v: Value) -> Vec<String> {
        Config::from_value(&v)
            .err()
            .unwrap_or_default()
            .iter()
            .map(|e| e.to_string())
            .collect()
    }

    #[test]
    fn defaults_and_overrides() {
        let c = Config::from_value(&json!({"endpoints": [
            {"name": "api", "cluster": "openai"},
            {"name": "gpu", "cluster": "gpu-1", "metrics": {}},
            {"name": "gpu2", "cluster": "gpu-2", "models": ["m"], "metrics": {
                "path": "/stats/metrics", "format": "sglang", "interval_ms": 250,
                "timeout_ms": 100, "cluster": "gpu-2-metrics", "authority": "gpu2.local:30000"}},
        ]}))
        .unwrap();
        assert_eq!(c.endpoints[0].metrics, None);
        let m = c.endpoints[1].metrics.clone().unwrap();
        assert_eq!(
            m,
            MetricsConfig {
                path: "/metrics".into(),
                format: Format::Auto,
                interval_ms: 250,
                timeout_ms: 500,
                cluster: "gpu-1".into(),
                authority: "gpu-1".into(),
            }
        );
        assert_eq!(m.stale_after_ms(), 1_250);
        let m = c.endpoints[2].metrics.clone().unwrap();
        assert_eq!(m.format, Format::Sglang);
        assert_eq!(m.format_name(), "sglang");
        assert_eq!((m.interval_ms, m.timeout_ms), (250, 100));
        assert_eq!(m.cluster, "gpu-2-metrics");
        assert_eq!(m.authority, "gpu2.local:30000");
        // The authority follows the scrape cluster when only the cluster is given.
        let c = Config::from_value(&json!({"endpoints": [
            {"name": "g", "cluster": "g", "metrics": {"cluster": "g-m"}}]}))
        .unwrap();
        assert_eq!(c.endpoints[0].metrics.as_ref().unwrap().authority, "g-m");
    }

    #[test]
    fn every_problem_names_its_field() {
        let errs = errors(json!({"endpoints": [
            {"name": "a", "cluster": "a", "metrics": {"interval_ms": 50, "format": "vLLM",
                "path": "metrics", "timeout_ms": 1.5, "bogus": 1}},
            {"name": "b", "cluster": "b", "metrics": "yes"},
            {"name": "c", "cluster": "c", "metrics": {"authority": "a b", "cluster": ""}},
            {"name": "d", "cluster": "d", "metrics.path": "/m"},
        ]}));
        for want in [
            "endpoints[0].metrics.interval_ms must be in 100..=60000, got 50",
            "endpoints[0].metrics.format must be one of auto, vllm, sglang, llamacpp, tgi, got \"vLLM\"",
            "endpoints[0].metrics.path must be a path starting with /",
            "endpoints[0].metrics.timeout_ms must be an integer in 10..=60000, got 1.5",
            "endpoints[0].metrics.bogus is not a known key (known: path, format, interval_ms, timeout_ms, cluster, authority)",
            "endpoints[1].metrics must be an object, got a string",
            "endpoints[2].metrics.authority must be 1..=255 printable bytes without blanks, got \"a b\"",
            "endpoints[2].metrics.cluster must be 1..=255 printable bytes, got \"\"",
            "endpoints[3].metrics.path is not a known key",
        ] {
            assert!(errs.iter().any(|e| e.starts_with(want)), "{want}\n{errs:#?}");
        }
        assert_eq!(errs.len(), 9, "{errs:#?}");
    }

    #[test]
    fn documented_defaults_match() {
        let keys = metrics_keys();
        let default = |k: &str| keys.iter().find(|d| d.key == k).unwrap().default.clone();
        assert_eq!(default("metrics.path"), DEFAULT_PATH);
        assert_eq!(default("metrics.interval_ms"), "250");
        assert_eq!(default("metrics.timeout_ms"), "500");
        assert_eq!(default("metrics.format"), "auto");
        for f in FORMATS {
            assert!(Format::from_name(f).is_some(), "{f}");
        }
    }
}
